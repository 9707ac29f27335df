//! Gemma 3 decoder (Gemma 3 270M): hybrid sliding-window / global attention
//! through the [`KvCache`](minikv_core::KvCache) trait only.
//!
//! Per block: RMSNorm, Q/K/V projections, per-head RMSNorm of queries and
//! keys, RoPE ("rotate half" pairs; base 10 000 on sliding-window layers,
//! `rope.freq_base` on global ones), attention scaled by `1/sqrt(head_dim)`,
//! output projection, RMSNorm of the attention output before the residual;
//! then RMSNorm, a GELU-gated (tanh approximation) feed-forward, RMSNorm of
//! its output before the residual. Embeddings are scaled by `sqrt(hidden)`
//! and tied to the output head. Every sixth layer (5, 11, 17 of 18) is global;
//! the others see the last `sliding_window` positions, themselves included.
//! GGUF norm weights already hold Gemma's `1 + w`.

use crate::batch::{BatchPass, Part, SeqStep};
use crate::gguf::Gguf;
use crate::llama::{RopeLayout, apply_rope, hand_over, rms_norm, rope_tables};
use crate::matrix::QMatrix;
use crate::{LanguageModel, Workspace};
use minikv_core::{Error, ModelSpec, Result};
use serde::Serialize;

/// Hyper-parameters.
#[derive(Debug, Clone, Serialize)]
pub struct Gemma3Config {
    /// Layers.
    pub n_layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// FFN inner size.
    pub ffn: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension (`attention.key_length`).
    pub head_dim: usize,
    /// RoPE base of global layers.
    pub rope_base: f64,
    /// RoPE base of sliding-window layers.
    pub rope_base_local: f64,
    /// Sliding window of local layers.
    pub sliding_window: usize,
    /// One global layer every `global_every` layers (the last of each group).
    pub global_every: usize,
    /// Attention logit scale (`1/sqrt(head_dim)` for every size but 27B).
    pub attention_scale: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Context length.
    pub max_seq_len: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Final logit soft-capping (0: none).
    pub final_softcap: f32,
}

impl Gemma3Config {
    /// Whether `layer` attends globally.
    pub fn is_global(&self, layer: usize) -> bool {
        layer % self.global_every == self.global_every - 1
    }

    fn validate(&self) -> Result<()> {
        crate::check_shape(
            &[
                ("n_layers", self.n_layers),
                ("hidden", self.hidden),
                ("ffn", self.ffn),
                ("max_seq_len", self.max_seq_len),
                ("vocab", self.vocab),
                ("sliding_window", self.sliding_window),
            ],
            (self.n_heads, self.n_kv_heads, self.head_dim),
        )?;
        let ok = self.rope_base > 1.0
            && self.rope_base_local > 1.0
            && self.rms_eps > 0.0
            && self.final_softcap.is_finite()
            && self.final_softcap >= 0.0;
        if !ok {
            return Err(Error::Format(
                "model config: rope bases must be > 1, rms eps > 0, soft-capping >= 0".into(),
            ));
        }
        Ok(())
    }
}

/// One Gemma 3 block.
#[derive(Debug, Clone)]
pub struct Gemma3Block {
    attn_norm: Vec<f32>,
    /// `[wq; wk; wv]` when they share a type, else the three.
    qkv: Qkv,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    wo: QMatrix,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    /// `[gate; up]` (the 270M file stores both as Q5_0).
    gate_up: GateUp,
    w_down: QMatrix,
    post_ffn_norm: Vec<f32>,
}

#[derive(Debug, Clone)]
enum Qkv {
    Fused(QMatrix),
    Split(QMatrix, QMatrix, QMatrix),
}

#[derive(Debug, Clone)]
enum GateUp {
    Fused(QMatrix),
    Split(QMatrix, QMatrix),
}

/// A Gemma 3 model.
#[derive(Debug, Clone)]
pub struct Gemma3 {
    /// Hyper-parameters.
    pub cfg: Gemma3Config,
    embed: QMatrix,
    blocks: Vec<Gemma3Block>,
    norm: Vec<f32>,
    lm_head: Option<QMatrix>,
    rope_global: minikv_core::Rope,
    rope_local: minikv_core::Rope,
    /// KVzip's instruction tokens, set by [`crate::load`].
    pub reconstruction: Option<crate::ReconstructionPrompts>,
}

fn rope(base: f64, d: usize) -> minikv_core::Rope {
    minikv_core::Rope {
        inv_freq: (0..d / 2)
            .map(|i| base.powf(-2.0 * i as f64 / d as f64))
            .collect(),
        pairs: minikv_core::RopePairs::Halves,
    }
}

/// `gelu(x)` with the tanh approximation (Gemma's `gelu_pytorch_tanh`),
/// `0.5 x (1 + tanh u)` with `u = sqrt(2/pi) (x + 0.044715 x^3)`, computed
/// as `x sigmoid(2u)` (the same function: `0.5 (1 + tanh u) = 1 / (1 +
/// e^(-2u))`): with `e = e^(-2|u|)`, `x / (1 + e)` for `u >= 0` and
/// `x e / (1 + e)` below, neither of which cancels (`1 + tanh u` loses
/// every digit as `u` goes negative). [`minikv_core::simd::exp_neg`] keeps
/// it branch-free and inlined, so the loops over a row vectorize (a libm
/// `tanhf` call per element took 15% of a 512-token prefill).
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    let u = C * (x + 0.044_715 * x * x * x);
    let e = minikv_core::simd::exp_neg(-2.0 * u.abs());
    let top = if u >= 0.0 { x } else { x * e };
    top / (1.0 + e)
}

#[cfg(test)]
#[test]
fn gelu_tanh_is_the_formula_in_f64() {
    for i in -24_000..=24_000 {
        let x = i as f32 * 5e-4 * (1.0 + (i as f32).abs() * 2e-4);
        let u = 0.797_884_560_802_865_4 * (x as f64 + 0.044_715 * (x as f64).powi(3));
        let want = x as f64 / (1.0 + (-2.0 * u).exp());
        let got = gelu_tanh(x) as f64;
        // `u` rounds in f32 (relative 2^-23 or so, times `2|u|` in the
        // exponential for negative x); below e^-87 the exponential flushes
        // to zero (as tanh rounds to -1 there).
        let tol = (2e-6 + 2.5e-7 * (2.0 * u).abs()) * want.abs() + 1e-35;
        assert!((got - want).abs() <= tol, "gelu({x}) = {got}, want {want}");
    }
    assert!(gelu_tanh(f32::NAN).is_nan());
    assert_eq!(gelu_tanh(f32::INFINITY), f32::INFINITY);
    assert_eq!(gelu_tanh(-30.0), 0.0);
}

impl Gemma3 {
    /// Loads a `gemma3`-architecture GGUF.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if arch != "gemma3" {
            return Err(Error::Format(format!(
                "Gemma3::from_gguf: architecture `{arch}`"
            )));
        }
        let k = |s: &str| format!("gemma3.{s}");
        let hidden = g.get_usize(&k("embedding_length"))?;
        let n_heads = g.get_usize(&k("attention.head_count"))?;
        let head_dim = g.get_usize(&k("attention.key_length"))?;
        if let Ok(vd) = g.get_usize(&k("attention.value_length"))
            && vd != head_dim
        {
            return Err(Error::Format(format!(
                "key length {head_dim} != value length {vd} is not supported"
            )));
        }
        let embd = g.tensor("token_embd.weight")?;
        let n_layers = g.get_usize(&k("block_count"))?;
        let sliding_window = g.get_usize(&k("attention.sliding_window")).map_err(|_| {
            Error::Unsupported(
                "gemma3 without `attention.sliding_window` (all-global layers) is not supported"
                    .into(),
            )
        })?;
        let cfg = Gemma3Config {
            n_layers,
            hidden,
            ffn: g.get_usize(&k("feed_forward_length"))?,
            n_heads,
            n_kv_heads: g
                .get_usize(&k("attention.head_count_kv"))
                .unwrap_or(n_heads),
            head_dim,
            rope_base: g.get_f64(&k("rope.freq_base")).unwrap_or(1_000_000.0),
            rope_base_local: g.get_f64(&k("rope.freq_base_swa")).unwrap_or(10_000.0),
            sliding_window,
            global_every: 6,
            // llama.cpp: 1/sqrt(n_embd / n_head) for the 62-layer (27B) model.
            attention_scale: if n_layers == 62 {
                1.0 / ((hidden / n_heads.max(1)) as f32).sqrt()
            } else {
                1.0 / (head_dim as f32).sqrt()
            },
            rms_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon"))? as f32,
            max_seq_len: g.get_usize(&k("context_length"))?,
            vocab: *embd
                .dims
                .get(1)
                .ok_or_else(|| Error::Format("token_embd.weight is not 2-D".into()))?,
            final_softcap: g.get_f64(&k("final_logit_softcapping")).unwrap_or(0.0) as f32,
        };
        cfg.validate()?;
        if g.metadata.contains_key(&k("rope.scaling.type"))
            || g.metadata.contains_key(&k("rope.scaling.factor"))
        {
            return Err(Error::Unsupported(
                "gemma3 with RoPE scaling (4B and larger) is not supported".into(),
            ));
        }
        g.check_block_count("gemma3", cfg.n_layers)?;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let b = |s: &str| format!("blk.{i}.{s}.weight");
            let wq = QMatrix::from_gguf(g, &b("attn_q"), cfg.n_heads * hd, h)?;
            let wk = QMatrix::from_gguf(g, &b("attn_k"), cfg.n_kv_heads * hd, h)?;
            let wv = QMatrix::from_gguf(g, &b("attn_v"), cfg.n_kv_heads * hd, h)?;
            let qkv = match QMatrix::concat_rows(&[&wq, &wk, &wv]) {
                Ok(m) => Qkv::Fused(m),
                Err(_) => Qkv::Split(wq, wk, wv),
            };
            let gate = QMatrix::from_gguf(g, &b("ffn_gate"), cfg.ffn, h)?;
            let up = QMatrix::from_gguf(g, &b("ffn_up"), cfg.ffn, h)?;
            let gate_up = match QMatrix::concat_rows(&[&gate, &up]) {
                Ok(m) => GateUp::Fused(m),
                Err(_) => GateUp::Split(gate, up),
            };
            blocks.push(Gemma3Block {
                attn_norm: g.vector(&b("attn_norm"), h)?,
                qkv,
                q_norm: g.vector(&b("attn_q_norm"), hd)?,
                k_norm: g.vector(&b("attn_k_norm"), hd)?,
                wo: QMatrix::from_gguf(g, &b("attn_output"), h, cfg.n_heads * hd)?,
                post_attn_norm: g.vector(&b("post_attention_norm"), h)?,
                ffn_norm: g.vector(&b("ffn_norm"), h)?,
                gate_up,
                w_down: QMatrix::from_gguf(g, &b("ffn_down"), h, cfg.ffn)?,
                post_ffn_norm: g.vector(&b("post_ffw_norm"), h)?,
            });
        }
        let embed = QMatrix::from_gguf(g, "token_embd.weight", cfg.vocab, h)?;
        let norm = g.vector("output_norm.weight", h)?;
        let lm_head = match g.tensors.contains_key("output.weight") {
            true => Some(QMatrix::from_gguf(g, "output.weight", cfg.vocab, h)?),
            false => None,
        };
        Ok(Self {
            rope_global: rope(cfg.rope_base, hd),
            rope_local: rope(cfg.rope_base_local, hd),
            cfg,
            embed,
            blocks,
            norm,
            lm_head,
            reconstruction: None,
        })
    }

    /// Every weight matrix as held: the embedding, the output head when
    /// untied, and each block's (a stack where its parts were fused).
    fn matrices(&self) -> Vec<&QMatrix> {
        let mut ms: Vec<&QMatrix> = vec![&self.embed];
        ms.extend(self.lm_head.as_ref());
        for b in &self.blocks {
            match &b.qkv {
                Qkv::Fused(w) => ms.push(w),
                Qkv::Split(a, c, d) => ms.extend([a, c, d]),
            }
            match &b.gate_up {
                GateUp::Fused(w) => ms.push(w),
                GateUp::Split(a, c) => ms.extend([a, c]),
            }
            ms.extend([&b.wo, &b.w_down]);
        }
        ms
    }

    /// Bytes of all weights as stored.
    pub fn weight_bytes(&self) -> usize {
        self.matrices().iter().map(|m| m.byte_len()).sum()
    }

    /// Heap bytes holding weights beyond the memory-mapped file: none for
    /// a mapped GGUF (the stacks read their parts in place); see
    /// [`QMatrix::heap_bytes`].
    pub fn weight_heap_bytes(&self) -> usize {
        QMatrix::heap_bytes(self.matrices())
    }

    /// The block's feed-forward half on `n` rows of `ws.x`: norm, GELU-gated
    /// product, down projection, post norm, residual add.
    fn ffn(&self, b: &Gemma3Block, ws: &mut Workspace, segs: &crate::matrix::Segments, n: usize) {
        let c = &self.cfg;
        rms_norm(&ws.x, &b.ffn_norm, c.rms_eps, &mut ws.h);
        match &b.gate_up {
            GateUp::Fused(w) => {
                let r = 2 * c.ffn;
                ws.f.resize(n * r, 0.0);
                w.matmul_segments(&ws.h, segs, &mut ws.f);
                for i in 0..n {
                    let row = &ws.f[i * r..(i + 1) * r];
                    let g = &mut ws.g[i * c.ffn..(i + 1) * c.ffn];
                    for ((g, &a), &u) in g.iter_mut().zip(&row[..c.ffn]).zip(&row[c.ffn..]) {
                        *g = gelu_tanh(a) * u;
                    }
                }
            }
            GateUp::Split(gate, up) => {
                ws.u.resize(n * c.ffn, 0.0);
                gate.matmul_segments(&ws.h, segs, &mut ws.g);
                up.matmul_segments(&ws.h, segs, &mut ws.u);
                for (g, u) in ws.g.iter_mut().zip(&ws.u) {
                    *g = gelu_tanh(*g) * u;
                }
            }
        }
        b.w_down.matmul_segments(&ws.g, segs, &mut ws.o);
        rms_norm(&ws.o, &b.post_ffn_norm, c.rms_eps, &mut ws.h);
        ws.x.iter_mut().zip(&ws.h).for_each(|(x, o)| *x += o);
    }

    /// One pass over the rows of every part (see [`crate::batch`]).
    fn pass_rows(
        &self,
        parts: &mut [Part<'_>],
        ws: &mut Workspace,
        outs: &mut [Vec<f32>],
    ) -> Result<()> {
        let c = &self.cfg;
        let off = crate::batch::offsets(parts);
        let n = off[parts.len()];
        let (h, hd) = (c.hidden, c.head_dim);
        let (qd, kd) = (c.n_heads * hd, c.n_kv_heads * hd);
        for buf in [&mut ws.x, &mut ws.h, &mut ws.o] {
            buf.resize(n * h, 0.0);
        }
        ws.q.resize(n * qd, 0.0);
        ws.att.resize(n * qd, 0.0);
        ws.k.resize(n * kd, 0.0);
        ws.v.resize(n * kd, 0.0);
        ws.g.resize(n * c.ffn, 0.0);
        let scale = (h as f32).sqrt();
        ws.segs.set(parts.iter().map(|p| p.tokens.len()));
        let tokens = parts.iter().flat_map(|p| p.tokens);
        for (i, &t) in tokens.enumerate() {
            let x = &mut ws.x[i * h..(i + 1) * h];
            self.embed.dequantize_row(t as usize, x);
            x.iter_mut().for_each(|v| *v *= scale);
        }
        // Two RoPE tables per chunk, one after the other: local, then global.
        let (mut cos, mut sin) = (std::mem::take(&mut ws.cos), std::mem::take(&mut ws.sin));
        let half = hd / 2;
        cos.clear();
        sin.clear();
        for rope in [&self.rope_local, &self.rope_global] {
            for p in parts.iter() {
                rope_tables(&rope.inv_freq, p.pos0, p.tokens.len(), &mut cos, &mut sin);
            }
        }
        let segs = std::mem::take(&mut ws.segs);
        // Queries are pre-scaled so that the backend's 1/sqrt(d) gives the
        // model's attention scale.
        let q_scale = c.attention_scale * (hd as f32).sqrt();
        for (l, b) in self.blocks.iter().enumerate() {
            rms_norm(&ws.x, &b.attn_norm, c.rms_eps, &mut ws.h);
            match &b.qkv {
                Qkv::Fused(w) => {
                    let r = qd + 2 * kd;
                    ws.f.resize(n * r, 0.0);
                    w.matmul_segments(&ws.h, &segs, &mut ws.f);
                    for i in 0..n {
                        let row = &ws.f[i * r..(i + 1) * r];
                        ws.q[i * qd..(i + 1) * qd].copy_from_slice(&row[..qd]);
                        ws.k[i * kd..(i + 1) * kd].copy_from_slice(&row[qd..qd + kd]);
                        ws.v[i * kd..(i + 1) * kd].copy_from_slice(&row[qd + kd..]);
                    }
                }
                Qkv::Split(wq, wk, wv) => {
                    wq.matmul_segments(&ws.h, &segs, &mut ws.q);
                    wk.matmul_segments(&ws.h, &segs, &mut ws.k);
                    wv.matmul_segments(&ws.h, &segs, &mut ws.v);
                }
            }
            head_norm(&mut ws.q, &b.q_norm, c.rms_eps);
            head_norm(&mut ws.k, &b.k_norm, c.rms_eps);
            let global = c.is_global(l);
            let (rope, tab) = match global {
                true => (&self.rope_global, n * half..2 * n * half),
                false => (&self.rope_local, 0..n * half),
            };
            for (p, &a) in parts.iter_mut().zip(&off) {
                let wants = p.cache.wants(l);
                if !wants.is_empty() {
                    let m = p.tokens.len();
                    let q = &ws.q[a * qd..(a + m) * qd];
                    hand_over(l, &b.wo, rope, wants, q, m, &mut *p.cache)?;
                }
            }
            let (cs, sn) = (&cos[tab.clone()], &sin[tab]);
            apply_rope(&mut ws.q, c.n_heads, hd, RopeLayout::Halves, cs, sn);
            apply_rope(&mut ws.k, c.n_kv_heads, hd, RopeLayout::Halves, cs, sn);
            if q_scale != 1.0 {
                ws.q.iter_mut().for_each(|v| *v *= q_scale);
            }
            crate::batch::attend_parts(l, parts, &off, &ws.q, &ws.k, &ws.v, &mut ws.att, (qd, kd))?;
            b.wo.matmul_segments(&ws.att, &segs, &mut ws.o);
            rms_norm(&ws.o, &b.post_attn_norm, c.rms_eps, &mut ws.h);
            ws.x.iter_mut().zip(&ws.h).for_each(|(x, o)| *x += o);
            self.ffn(b, ws, &segs, n);
        }
        ws.segs = segs;
        ws.cos = cos;
        ws.sin = sin;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let norm = |x: &[f32], out: &mut [f32]| rms_norm(x, &self.norm, c.rms_eps, out);
        let cap = c.final_softcap;
        let post = |v: &mut [f32]| {
            if cap > 0.0 {
                v.iter_mut().for_each(|v| *v = (*v / cap).tanh() * cap);
            }
        };
        crate::batch::logits(parts, &off, ws, head, &norm, &post, outs);
        Ok(())
    }
}

impl BatchPass for Gemma3 {
    fn pass(
        &self,
        parts: &mut [Part<'_>],
        ws: &mut Workspace,
        outs: &mut [Vec<f32>],
    ) -> Result<()> {
        self.pass_rows(parts, ws, outs)
    }
}

/// Per-head RMSNorm of token-major `[n][heads * d]` rows in place.
fn head_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for hd in x.chunks_exact_mut(d) {
        let ms = hd.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        hd.iter_mut().zip(w).for_each(|(v, g)| *v = *v * inv * g);
    }
}

crate::register_architecture!("gemma3", |g, prompts| {
    let mut m = Gemma3::from_gguf(g)?;
    m.reconstruction = prompts;
    Ok(Box::new(m))
});

impl LanguageModel for Gemma3 {
    fn spec(&self) -> ModelSpec {
        let c = &self.cfg;
        ModelSpec {
            n_layers: c.n_layers,
            n_q_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            max_seq_len: c.max_seq_len,
            windows: (0..c.n_layers)
                .map(|l| (!c.is_global(l)).then_some(c.sliding_window))
                .collect(),
        }
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    fn reconstruction_prompts(&self) -> Option<&crate::ReconstructionPrompts> {
        self.reconstruction.as_ref()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "architecture": "gemma3",
            "config": &self.cfg,
            "weight_types": QMatrix::type_counts(self.matrices()),
            "weight_bytes": self.weight_bytes(),
            "weight_heap_bytes": self.weight_heap_bytes(),
        })
    }

    fn set_activations(&mut self, act: crate::Activations) {
        for b in &mut self.blocks {
            let qkv: Vec<&mut QMatrix> = match &mut b.qkv {
                Qkv::Fused(m) => vec![m],
                Qkv::Split(q, k, v) => vec![q, k, v],
            };
            let gate_up: Vec<&mut QMatrix> = match &mut b.gate_up {
                GateUp::Fused(m) => vec![m],
                GateUp::Split(g, u) => vec![g, u],
            };
            for m in qkv
                .into_iter()
                .chain(gate_up)
                .chain([&mut b.wo, &mut b.w_down])
            {
                m.set_activations(act);
            }
        }
        self.embed.set_activations(act);
        if let Some(h) = self.lm_head.as_mut() {
            h.set_activations(act);
        }
    }

    fn forward_batch(
        &self,
        steps: &mut [SeqStep<'_>],
        ws: &mut Workspace,
    ) -> Result<Vec<Vec<f32>>> {
        crate::batch::forward_batch(self, steps, ws)
    }
}
