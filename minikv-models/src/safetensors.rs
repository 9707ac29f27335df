//! Hugging Face Llama checkpoints: `config.json` + `*.safetensors` (f32, f16,
//! bf16) + `tokenizer.json`. RoPE uses the halves layout.

use crate::blocks::GgmlType;
use crate::gguf::Blob;
use crate::llama::{Block, Llama, LlamaConfig, RopeLayout};
use crate::matrix::QMatrix;
use minikv_core::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;

struct Tensor {
    dtype: GgmlType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn read_tensors(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Format(format!(
            "{}: no *.safetensors files",
            dir.display()
        )));
    }
    let mut out = HashMap::new();
    for f in files {
        let bytes = std::fs::read(&f).map_err(|e| Error::io(&f, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::Format(format!("{}: {e}", f.display())))?;
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                Dtype::F32 => GgmlType::F32,
                Dtype::F16 => GgmlType::F16,
                Dtype::BF16 => GgmlType::Bf16,
                d => {
                    return Err(Error::Format(format!(
                        "{}: tensor `{name}` has unsupported dtype {d:?} (f32, f16, bf16)",
                        f.display()
                    )));
                }
            };
            out.insert(
                name,
                Tensor {
                    dtype,
                    shape: view.shape().to_vec(),
                    data: view.data().to_vec(),
                },
            );
        }
    }
    Ok(out)
}

/// Loads a Hugging Face Llama directory.
pub fn load_hf(dir: &Path) -> Result<Llama> {
    let cpath = dir.join("config.json");
    let text = std::fs::read_to_string(&cpath).map_err(|e| Error::io(&cpath, e))?;
    let c: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Format(format!("{}: {e}", cpath.display())))?;
    let get = |k: &str| {
        c.get(k)
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| Error::Format(format!("{}: missing integer `{k}`", cpath.display())))
    };
    let arch = c
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("llama");
    if arch != "llama" {
        return Err(Error::Format(format!(
            "unsupported architecture `{arch}` (supported: llama)"
        )));
    }
    let hidden = get("hidden_size")?;
    let n_heads = get("num_attention_heads")?;
    let cfg = LlamaConfig {
        n_layers: get("num_hidden_layers")?,
        hidden,
        ffn: get("intermediate_size")?,
        n_heads,
        n_kv_heads: get("num_key_value_heads").unwrap_or(n_heads),
        head_dim: c
            .get("head_dim")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .unwrap_or(hidden / n_heads.max(1)),
        rope_base: c
            .get("rope_theta")
            .and_then(|v| v.as_f64())
            .unwrap_or(10000.0),
        rms_eps: c
            .get("rms_norm_eps")
            .and_then(|v| v.as_f64())
            .unwrap_or(1e-5) as f32,
        max_seq_len: get("max_position_embeddings")?,
        vocab: get("vocab_size")?,
        rope: RopeLayout::Halves,
    };
    cfg.validate()?;
    let tied = c
        .get("tie_word_embeddings")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let mut ts = read_tensors(dir)?;
    let mut take = |name: &str, shape: &[usize]| -> Result<Tensor> {
        let t = ts
            .remove(name)
            .ok_or_else(|| Error::Format(format!("missing tensor `{name}`")))?;
        if t.shape != shape {
            return Err(Error::Format(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                t.shape
            )));
        }
        Ok(t)
    };
    let mat = |t: Tensor, name: &str| {
        QMatrix::new(name, t.dtype, t.shape[0], t.shape[1], Blob::owned(t.data))
    };
    let vecf = |t: Tensor| {
        let mut v = vec![0.0; t.shape[0]];
        crate::blocks::dequantize_row(t.dtype, &t.data, &mut v);
        v
    };
    let (h, hd) = (cfg.hidden, cfg.head_dim);
    let mut blocks = Vec::with_capacity(cfg.n_layers);
    for i in 0..cfg.n_layers {
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        let m = |s: &str,
                 r: usize,
                 cc: usize,
                 take: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>|
         -> Result<QMatrix> { mat(take(&p(s), &[r, cc])?, &p(s)) };
        blocks.push(Block {
            attn_norm: vecf(take(&p("input_layernorm"), &[h])?),
            wq: m("self_attn.q_proj", cfg.n_heads * hd, h, &mut take)?,
            wk: m("self_attn.k_proj", cfg.n_kv_heads * hd, h, &mut take)?,
            wv: m("self_attn.v_proj", cfg.n_kv_heads * hd, h, &mut take)?,
            wo: m("self_attn.o_proj", h, cfg.n_heads * hd, &mut take)?,
            ffn_norm: vecf(take(&p("post_attention_layernorm"), &[h])?),
            w_gate: m("mlp.gate_proj", cfg.ffn, h, &mut take)?,
            w_up: m("mlp.up_proj", cfg.ffn, h, &mut take)?,
            w_down: m("mlp.down_proj", h, cfg.ffn, &mut take)?,
        });
    }
    let embed = mat(
        take("model.embed_tokens.weight", &[cfg.vocab, h])?,
        "model.embed_tokens.weight",
    )?;
    let norm = vecf(take("model.norm.weight", &[h])?);
    let lm_head = if tied {
        None
    } else {
        Some(mat(
            take("lm_head.weight", &[cfg.vocab, h])?,
            "lm_head.weight",
        )?)
    };
    Ok(Llama::assemble(cfg, embed, blocks, norm, lm_head))
}

/// Writes `model` as a Hugging Face checkpoint (f32 weights, halves RoPE layout,
/// Q/K rows un-permuted from the GGUF adjacent-pair order) with its tokenizer.
/// Used to test the safetensors loader against the GGUF loader.
pub fn export_hf(model: &Llama, tok: &crate::Tokenizer, dir: &Path) -> Result<()> {
    use safetensors::tensor::TensorView;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let c = &model.cfg;
    let deq = |m: &QMatrix| {
        let mut v = vec![0.0f32; m.rows * m.cols];
        for r in 0..m.rows {
            m.dequantize_row(r, &mut v[r * m.cols..(r + 1) * m.cols]);
        }
        v
    };
    // GGUF row order within a head is (pair j, member e) -> j*2 + e; HF is e*half + j.
    let unpermute = |v: Vec<f32>, heads: usize| -> Vec<f32> {
        if model.cfg.rope == RopeLayout::Halves {
            return v;
        }
        let (d, cols) = (c.head_dim, c.hidden);
        let half = d / 2;
        let mut out = vec![0.0f32; v.len()];
        for hh in 0..heads {
            for j in 0..half {
                for e in 0..2 {
                    let src = (hh * d + 2 * j + e) * cols;
                    let dst = (hh * d + e * half + j) * cols;
                    out[dst..dst + cols].copy_from_slice(&v[src..src + cols]);
                }
            }
        }
        out
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut put = |name: String, shape: Vec<usize>, v: Vec<f32>| {
        tensors.push((
            name,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ))
    };
    put(
        "model.embed_tokens.weight".into(),
        vec![c.vocab, c.hidden],
        deq(&model.embed),
    );
    put(
        "model.norm.weight".into(),
        vec![c.hidden],
        model.norm.clone(),
    );
    for (i, b) in model.blocks.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        put(p("input_layernorm"), vec![c.hidden], b.attn_norm.clone());
        put(
            p("post_attention_layernorm"),
            vec![c.hidden],
            b.ffn_norm.clone(),
        );
        put(
            p("self_attn.q_proj"),
            vec![b.wq.rows, b.wq.cols],
            unpermute(deq(&b.wq), c.n_heads),
        );
        put(
            p("self_attn.k_proj"),
            vec![b.wk.rows, b.wk.cols],
            unpermute(deq(&b.wk), c.n_kv_heads),
        );
        for (s, m) in [
            ("self_attn.v_proj", &b.wv),
            ("self_attn.o_proj", &b.wo),
            ("mlp.gate_proj", &b.w_gate),
            ("mlp.up_proj", &b.w_up),
            ("mlp.down_proj", &b.w_down),
        ] {
            put(p(s), vec![m.rows, m.cols], deq(m));
        }
    }
    if let Some(m) = &model.lm_head {
        put("lm_head.weight".into(), vec![m.rows, m.cols], deq(m));
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            TensorView::new(Dtype::F32, s.clone(), d)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Format(e.to_string()))
        })
        .collect::<Result<_>>()?;
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path)
        .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": c.hidden, "intermediate_size": c.ffn,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "num_hidden_layers": c.n_layers,
        "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_base, "max_position_embeddings": c.max_seq_len,
        "vocab_size": c.vocab, "tie_word_embeddings": model.lm_head.is_none(),
    });
    let cp = dir.join("config.json");
    std::fs::write(&cp, serde_json::to_string_pretty(&config).expect("json"))
        .map_err(|e| Error::io(&cp, e))?;
    tok.save(&dir.join("tokenizer.json"))
}
