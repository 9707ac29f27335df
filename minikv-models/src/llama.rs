//! Llama-family decoder (SmolLM2): RMSNorm, RoPE, grouped-query attention through
//! the [`KvCache`] trait only, SwiGLU, tied or separate output head.

use crate::batch::{BatchPass, Part, SeqStep};
use crate::gguf::Gguf;
use crate::matrix::QMatrix;
use crate::{LanguageModel, Workspace};
use minikv_core::{Error, KvCache, ModelSpec, Result};
use serde::Serialize;

/// How RoPE pairs dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeLayout {
    /// `(0,1), (2,3), ...`: GGUF files (Q/K weights permuted by llama.cpp's converter).
    Adjacent,
    /// `(i, i + d/2)`: Hugging Face checkpoints.
    Halves,
}

/// Hyper-parameters.
#[derive(Debug, Clone, Serialize)]
pub struct LlamaConfig {
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
    /// Head dimension.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_base: f64,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Context length.
    pub max_seq_len: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// RoPE pairing.
    pub rope: RopeLayout,
}

impl LlamaConfig {
    /// Checks the numbers before any tensor is read.
    pub fn validate(&self) -> Result<()> {
        crate::check_shape(
            &[
                ("n_layers", self.n_layers),
                ("hidden", self.hidden),
                ("ffn", self.ffn),
                ("max_seq_len", self.max_seq_len),
                ("vocab", self.vocab),
            ],
            (self.n_heads, self.n_kv_heads, self.head_dim),
        )?;
        if self.rope_base.is_nan()
            || self.rope_base <= 1.0
            || self.rms_eps.is_nan()
            || self.rms_eps <= 0.0
        {
            return Err(Error::Format(
                "model config: rope base must be > 1 and rms eps > 0".into(),
            ));
        }
        Ok(())
    }
}

/// One transformer block.
#[derive(Debug, Clone)]
pub struct Block {
    /// Pre-attention RMSNorm weight.
    pub attn_norm: Vec<f32>,
    /// Q projection `[Hq d][hidden]`.
    pub wq: QMatrix,
    /// K projection `[Hkv d][hidden]`.
    pub wk: QMatrix,
    /// V projection.
    pub wv: QMatrix,
    /// Output projection `[hidden][Hq d]`.
    pub wo: QMatrix,
    /// Pre-FFN RMSNorm weight.
    pub ffn_norm: Vec<f32>,
    /// Gate `[ffn][hidden]`.
    pub w_gate: QMatrix,
    /// Up `[ffn][hidden]`.
    pub w_up: QMatrix,
    /// Down `[hidden][ffn]`.
    pub w_down: QMatrix,
}

/// Row-stacked projections used by the forward pass.
#[derive(Debug, Clone)]
struct Fused {
    /// `[wq; wk; wv]` when the three share a type (else `None`).
    qkv: Option<QMatrix>,
    /// `[w_gate; w_up]` when they share a type.
    gate_up: Option<QMatrix>,
}

/// A Llama model.
#[derive(Debug, Clone)]
pub struct Llama {
    /// Hyper-parameters.
    pub cfg: LlamaConfig,
    /// Token embeddings `[vocab][hidden]`.
    pub embed: QMatrix,
    /// Blocks.
    pub blocks: Vec<Block>,
    /// Final norm.
    pub norm: Vec<f32>,
    /// Output head; `None` = tied to `embed`.
    pub lm_head: Option<QMatrix>,
    /// RoPE: inverse frequencies `base^(-2i/d)` (f64 for exact angles) and
    /// the channel pairing, as caches that ask for it see it.
    rope_info: minikv_core::Rope,
    fused: Vec<Fused>,
    /// The instruction tokens of a context-reconstruction pass (KVzip), set
    /// by [`crate::load`] from the model's tokenizer.
    pub reconstruction: Option<crate::ReconstructionPrompts>,
}

impl Llama {
    /// Loads a `llama`-architecture GGUF.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(Error::Format(format!(
                "unsupported architecture `{arch}` (supported: llama)"
            )));
        }
        let k = |s: &str| format!("llama.{s}");
        let hidden = g.get_usize(&k("embedding_length"))?;
        let n_heads = g.get_usize(&k("attention.head_count"))?;
        let embd = g.tensor("token_embd.weight")?;
        let cfg = LlamaConfig {
            n_layers: g.get_usize(&k("block_count"))?,
            hidden,
            ffn: g.get_usize(&k("feed_forward_length"))?,
            n_heads,
            n_kv_heads: g
                .get_usize(&k("attention.head_count_kv"))
                .unwrap_or(n_heads),
            head_dim: hidden.checked_div(n_heads).unwrap_or(0),
            rope_base: g.get_f64(&k("rope.freq_base")).unwrap_or(10000.0),
            rms_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon"))? as f32,
            max_seq_len: g.get_usize(&k("context_length"))?,
            vocab: *embd
                .dims
                .get(1)
                .ok_or_else(|| Error::Format("token_embd.weight is not 2-D".into()))?,
            rope: RopeLayout::Adjacent,
        };
        cfg.validate()?;
        if let Ok(rd) = g.get_usize(&k("rope.dimension_count"))
            && rd != cfg.head_dim
        {
            return Err(Error::Format(format!(
                "partial RoPE (rope.dimension_count = {rd}, head dim {}) is not supported",
                cfg.head_dim
            )));
        }
        g.check_block_count("llama", cfg.n_layers)?;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let b = |s: &str| format!("blk.{i}.{s}.weight");
            blocks.push(Block {
                attn_norm: g.vector(&b("attn_norm"), h)?,
                wq: QMatrix::from_gguf(g, &b("attn_q"), cfg.n_heads * hd, h)?,
                wk: QMatrix::from_gguf(g, &b("attn_k"), cfg.n_kv_heads * hd, h)?,
                wv: QMatrix::from_gguf(g, &b("attn_v"), cfg.n_kv_heads * hd, h)?,
                wo: QMatrix::from_gguf(g, &b("attn_output"), h, cfg.n_heads * hd)?,
                ffn_norm: g.vector(&b("ffn_norm"), h)?,
                w_gate: QMatrix::from_gguf(g, &b("ffn_gate"), cfg.ffn, h)?,
                w_up: QMatrix::from_gguf(g, &b("ffn_up"), cfg.ffn, h)?,
                w_down: QMatrix::from_gguf(g, &b("ffn_down"), h, cfg.ffn)?,
            });
        }
        let embed = QMatrix::from_gguf(g, "token_embd.weight", cfg.vocab, h)?;
        let norm = g.vector("output_norm.weight", h)?;
        let lm_head = match g.tensors.contains_key("output.weight") {
            true => Some(QMatrix::from_gguf(g, "output.weight", cfg.vocab, h)?),
            false => None,
        };
        Ok(Self::assemble(cfg, embed, blocks, norm, lm_head))
    }

    /// Builds a model from parts (precomputes the RoPE tables).
    pub fn assemble(
        cfg: LlamaConfig,
        embed: QMatrix,
        blocks: Vec<Block>,
        norm: Vec<f32>,
        lm_head: Option<QMatrix>,
    ) -> Self {
        let half = cfg.head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| cfg.rope_base.powf(-2.0 * i as f64 / cfg.head_dim as f64))
            .collect();
        // The forward pass reads the stacks, which read their parts where
        // the file holds them (no copy): the blocks' own matrices and the
        // stacks share the same bytes.
        let fused = blocks
            .iter()
            .map(|b| Fused {
                qkv: QMatrix::concat_rows(&[&b.wq, &b.wk, &b.wv]).ok(),
                gate_up: QMatrix::concat_rows(&[&b.w_gate, &b.w_up]).ok(),
            })
            .collect();
        let pairs = match cfg.rope {
            RopeLayout::Adjacent => minikv_core::RopePairs::Adjacent,
            RopeLayout::Halves => minikv_core::RopePairs::Halves,
        };
        Self {
            cfg,
            embed,
            blocks,
            norm,
            lm_head,
            rope_info: minikv_core::Rope { inv_freq, pairs },
            fused,
            reconstruction: None,
        }
    }

    /// Every weight matrix as the file names them: the embedding, the
    /// output head when untied, and each block's seven (views of the
    /// stacks where fused).
    fn matrices(&self) -> impl Iterator<Item = &QMatrix> {
        let blocks = self
            .blocks
            .iter()
            .flat_map(|b| [&b.wq, &b.wk, &b.wv, &b.wo, &b.w_gate, &b.w_up, &b.w_down]);
        [&self.embed].into_iter().chain(&self.lm_head).chain(blocks)
    }

    /// Bytes of all weights as stored (the norms' f32 vectors included).
    pub fn weight_bytes(&self) -> usize {
        let norms = self.blocks.iter().map(|b| 8 * b.attn_norm.len());
        self.matrices().map(|m| m.byte_len()).sum::<usize>() + norms.sum::<usize>()
    }

    /// Heap bytes holding weights beyond the memory-mapped file: none for
    /// a mapped GGUF (the stacks read their parts in place), the weights
    /// converted on load otherwise; see [`QMatrix::heap_bytes`].
    pub fn weight_heap_bytes(&self) -> usize {
        QMatrix::heap_bytes(self.matrices())
    }

    /// Weight storage types, for reports (e.g. `Q4_1 x210, Q8_0 x1`).
    pub fn weight_types(&self) -> String {
        QMatrix::type_counts(self.matrices())
    }

    fn rope(&self, x: &mut [f32], n_heads: usize, cos: &[f32], sin: &[f32]) {
        apply_rope(x, n_heads, self.cfg.head_dim, self.cfg.rope, cos, sin);
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
        ws.x.resize(n * h, 0.0);
        ws.h.resize(n * h, 0.0);
        ws.q.resize(n * qd, 0.0);
        ws.k.resize(n * kd, 0.0);
        ws.v.resize(n * kd, 0.0);
        ws.att.resize(n * qd, 0.0);
        ws.o.resize(n * h, 0.0);
        ws.g.resize(n * c.ffn, 0.0);
        ws.u.resize(n * c.ffn, 0.0);
        ws.segs.set(parts.iter().map(|p| p.tokens.len()));
        let tokens = parts.iter().flat_map(|p| p.tokens);
        for (i, &t) in tokens.enumerate() {
            self.embed
                .dequantize_row(t as usize, &mut ws.x[i * h..(i + 1) * h]);
        }
        let (mut cos, mut sin) = (std::mem::take(&mut ws.cos), std::mem::take(&mut ws.sin));
        cos.clear();
        sin.clear();
        for p in parts.iter() {
            rope_tables(
                &self.rope_info.inv_freq,
                p.pos0,
                p.tokens.len(),
                &mut cos,
                &mut sin,
            );
        }
        let segs = std::mem::take(&mut ws.segs);
        for (l, b) in self.blocks.iter().enumerate() {
            rms_norm(&ws.x, &b.attn_norm, c.rms_eps, &mut ws.h);
            let f = &self.fused[l];
            match &f.qkv {
                Some(w) => {
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
                None => {
                    b.wq.matmul_segments(&ws.h, &segs, &mut ws.q);
                    b.wk.matmul_segments(&ws.h, &segs, &mut ws.k);
                    b.wv.matmul_segments(&ws.h, &segs, &mut ws.v);
                }
            }
            for (p, &a) in parts.iter_mut().zip(&off) {
                let wants = p.cache.wants(l);
                if !wants.is_empty() {
                    let m = p.tokens.len();
                    let q = &ws.q[a * qd..(a + m) * qd];
                    hand_over(l, &b.wo, &self.rope_info, wants, q, m, &mut *p.cache)?;
                }
            }
            self.rope(&mut ws.q, c.n_heads, &cos, &sin);
            self.rope(&mut ws.k, c.n_kv_heads, &cos, &sin);
            crate::batch::attend_parts(l, parts, &off, &ws.q, &ws.k, &ws.v, &mut ws.att, (qd, kd))?;
            b.wo.matmul_segments(&ws.att, &segs, &mut ws.o);
            ws.x.iter_mut().zip(&ws.o).for_each(|(x, o)| *x += o);
            rms_norm(&ws.x, &b.ffn_norm, c.rms_eps, &mut ws.h);
            match &f.gate_up {
                Some(w) => {
                    let r = 2 * c.ffn;
                    ws.f.resize(n * r, 0.0);
                    w.matmul_segments(&ws.h, &segs, &mut ws.f);
                    for i in 0..n {
                        let row = &ws.f[i * r..(i + 1) * r];
                        ws.g[i * c.ffn..(i + 1) * c.ffn].copy_from_slice(&row[..c.ffn]);
                        ws.u[i * c.ffn..(i + 1) * c.ffn].copy_from_slice(&row[c.ffn..]);
                    }
                }
                None => {
                    b.w_gate.matmul_segments(&ws.h, &segs, &mut ws.g);
                    b.w_up.matmul_segments(&ws.h, &segs, &mut ws.u);
                }
            }
            for (g, u) in ws.g.iter_mut().zip(&ws.u) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            b.w_down.matmul_segments(&ws.g, &segs, &mut ws.o);
            ws.x.iter_mut().zip(&ws.o).for_each(|(x, o)| *x += o);
        }
        ws.segs = segs;
        ws.cos = cos;
        ws.sin = sin;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let norm = |x: &[f32], out: &mut [f32]| rms_norm(x, &self.norm, c.rms_eps, out);
        crate::batch::logits(parts, &off, ws, head, &norm, &|_| {}, outs);
        Ok(())
    }
}

impl BatchPass for Llama {
    fn pass(
        &self,
        parts: &mut [Part<'_>],
        ws: &mut Workspace,
        outs: &mut [Vec<f32>],
    ) -> Result<()> {
        self.pass_rows(parts, ws, outs)
    }
}

/// Prefill chunk length (bounds activation memory; the cache sees several chunks).
pub const PREFILL_CHUNK: usize = 512;

/// Appends cos/sin of the angles `p * inv_freq[i]` for positions
/// `pos0 .. pos0 + n`, `[n][d/2]` (angles in f64, as the caches see them).
pub(crate) fn rope_tables(
    inv_freq: &[f64],
    pos0: usize,
    n: usize,
    cos: &mut Vec<f32>,
    sin: &mut Vec<f32>,
) {
    for p in pos0..pos0 + n {
        for &f in inv_freq {
            let a = p as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
}

/// Rotates token-major `x` (`[n][n_heads * d]`) by the tables of
/// [`rope_tables`].
pub(crate) fn apply_rope(
    x: &mut [f32],
    n_heads: usize,
    d: usize,
    layout: RopeLayout,
    cos: &[f32],
    sin: &[f32],
) {
    let half = d / 2;
    let row = n_heads * d;
    for (i, xr) in x.chunks_exact_mut(row).enumerate() {
        let (c, s) = (
            &cos[i * half..(i + 1) * half],
            &sin[i * half..(i + 1) * half],
        );
        for hd in xr.chunks_exact_mut(d) {
            match layout {
                RopeLayout::Adjacent => {
                    for j in 0..half {
                        let (a, b) = (hd[2 * j], hd[2 * j + 1]);
                        hd[2 * j] = a * c[j] - b * s[j];
                        hd[2 * j + 1] = a * s[j] + b * c[j];
                    }
                }
                RopeLayout::Halves => {
                    let (lo, hi) = hd.split_at_mut(half);
                    for j in 0..half {
                        let (a, b) = (lo[j], hi[j]);
                        lo[j] = a * c[j] - b * s[j];
                        hi[j] = a * s[j] + b * c[j];
                    }
                }
            }
        }
    }
}

/// Hands the cache what its components asked for at layer `l` (rarely:
/// only methods such as Expected Attention or CriticalKV want model facts):
/// the chunk's pre-RoPE queries with the layer's RoPE, or `W_o`.
pub(crate) fn hand_over(
    l: usize,
    wo: &QMatrix,
    rope: &minikv_core::Rope,
    wants: minikv_core::ModelWants,
    q: &[f32],
    n: usize,
    cache: &mut dyn KvCache,
) -> Result<()> {
    if wants.pre_rope_queries {
        cache.observe(l, minikv_core::Observation::PreRopeQueries { q, n, rope })?;
    }
    if wants.output_projection {
        let (rows, cols) = (wo.rows, wo.cols);
        let mut w = vec![0.0f32; rows * cols];
        for (r, out) in w.chunks_exact_mut(cols).enumerate() {
            wo.dequantize_row(r, out);
        }
        cache.observe(
            l,
            minikv_core::Observation::OutputProjection {
                w: &w,
                hidden: rows,
            },
        )?;
    }
    Ok(())
}

pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

crate::register_architecture!("llama", |g, prompts| {
    let mut m = Llama::from_gguf(g)?;
    m.reconstruction = prompts;
    Ok(Box::new(m))
});

impl LanguageModel for Llama {
    fn spec(&self) -> ModelSpec {
        ModelSpec {
            n_layers: self.cfg.n_layers,
            n_q_heads: self.cfg.n_heads,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            max_seq_len: self.cfg.max_seq_len,
            windows: Vec::new(),
        }
    }

    fn reconstruction_prompts(&self) -> Option<&crate::ReconstructionPrompts> {
        self.reconstruction.as_ref()
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "architecture": "llama",
            "config": &self.cfg,
            "weight_types": self.weight_types(),
            "weight_bytes": self.weight_bytes(),
            "weight_heap_bytes": self.weight_heap_bytes(),
        })
    }

    fn set_activations(&mut self, act: crate::Activations) {
        let blocks = self.blocks.iter_mut().flat_map(|b| {
            [
                &mut b.wq,
                &mut b.wk,
                &mut b.wv,
                &mut b.wo,
                &mut b.w_gate,
                &mut b.w_up,
                &mut b.w_down,
            ]
        });
        let fused = self
            .fused
            .iter_mut()
            .flat_map(|f| [f.qkv.as_mut(), f.gate_up.as_mut()])
            .flatten();
        for m in blocks
            .chain(fused)
            .chain([&mut self.embed])
            .chain(self.lm_head.as_mut())
        {
            m.set_activations(act);
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
