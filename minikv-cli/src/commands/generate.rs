//! `generate` and `logits`.

use super::*;

use crate::provenance::provenance;
use crate::{GenerateArgs, LogitsArgs};
use minikv_core::{Error, Result};
use minikv_models::{Logits, SamplingConfig, Workspace};
use serde_json::json;
use std::io::Write;

pub fn generate(a: &GenerateArgs) -> Result<()> {
    let cfg = load_config(a.config.as_deref())?;
    let l = load_model(&a.model)?;
    let mut cache = build_cache(l.model.as_ref(), &cfg)?;
    let text = if a.chat {
        l.tok.chat_prompt(&a.prompt)?
    } else {
        a.prompt.clone()
    };
    let ids = l.tok.encode(&text)?;
    let sampling = SamplingConfig {
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed.unwrap_or(cfg.seed),
    };
    let stream = !a.json;
    let g = minikv_models::generate(
        l.model.as_ref(),
        &l.tok,
        cache.as_mut(),
        &ids,
        a.max_tokens,
        sampling,
        |s| {
            if stream {
                print!("{s}");
                let _ = std::io::stdout().flush();
            }
        },
    )?;
    let mem = cache.memory();
    let n = g.tokens.len();
    if a.json {
        print_json(&json!({
            "prompt_tokens": g.prompt_tokens,
            "tokens": g.tokens,
            "text": g.text,
            "stop": g.stop,
            "prefill_s": g.prefill_s,
            "decode_s": g.decode_s,
            "prefill_tokens_per_s": g.prompt_tokens as f64 / g.prefill_s,
            "decode_tokens_per_s": if n > 1 { (n - 1) as f64 / g.decode_s } else { 0.0 },
            "memory": memory_json(&mem),
            "provenance": provenance(Some(&l.path), sampling.seed, Some(serde_json::to_value(&cfg).expect("json")))?,
        }));
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens in {:.2}s ({:.0} tok/s), {} generated in {:.2}s ({:.1} tok/s), KV {} bytes = {:.1}% of fp16 ({} allocated), stop: {:?}]",
            g.prompt_tokens,
            g.prefill_s,
            g.prompt_tokens as f64 / g.prefill_s,
            n,
            g.decode_s,
            if n > 1 {
                (n - 1) as f64 / g.decode_s
            } else {
                0.0
            },
            mem.used_bytes(),
            100.0 * mem.used_bytes() as f64 / mem.full_fp16_bytes.max(1) as f64,
            mem.total_bytes(),
            g.stop
        );
    }
    Ok(())
}

pub fn logits(a: &LogitsArgs) -> Result<()> {
    let cfg = load_config(a.config.as_deref())?;
    let l = load_model(&a.model)?;
    let mut cache = build_cache(l.model.as_ref(), &cfg)?;
    let ids = l.tok.encode(&a.prompt)?;
    if ids.is_empty() {
        return Err(Error::Input("the prompt encodes to no tokens".into()));
    }
    let max = l.model.spec().max_seq_len;
    if ids.len() > max {
        return Err(Error::ContextOverflow {
            len: ids.len(),
            max,
        });
    }
    let lg = l.model.forward(
        &ids,
        cache.as_mut(),
        &mut Workspace::default(),
        Logits::Last,
    )?;
    let mut idx: Vec<usize> = (0..lg.len()).collect();
    idx.sort_by(|&x, &y| lg[y].total_cmp(&lg[x]).then(x.cmp(&y)));
    let top: Vec<(u32, f32)> = idx.iter().take(a.top).map(|&i| (i as u32, lg[i])).collect();
    if a.json {
        println!(
            "{}",
            serde_json::to_string(&json!({"ids": ids, "top": top})).expect("json")
        );
    } else {
        println!("ids: {ids:?}");
        for (id, v) in top {
            println!("{id:>6} {v:>10.4} {:?}", l.tok.decode(&[id])?);
        }
    }
    Ok(())
}
