//! `perplexity`: through a compressed cache, or llama-perplexity's chunked
//! protocol.

use super::*;

use crate::PplArgs;
use crate::provenance::provenance;
use indicatif::{ProgressBar, ProgressStyle};
use minikv_core::{Error, Result, RunConfig};
use serde_json::json;

/// `perplexity --ctx N`: llama.cpp's chunked protocol over the whole text.
fn perplexity_chunked(a: &PplArgs, ctx: usize) -> Result<()> {
    let cfg = RunConfig::default();
    let l = load_model(&a.model)?;
    let max = l.model.spec().max_seq_len;
    if ctx > max {
        return Err(Error::ContextOverflow { len: ctx, max });
    }
    let text = read_text(&a.text)?;
    let ids = l.tok.encode(&text)?;
    let bos = l.tok.bos.filter(|_| l.tok.add_bos);
    let t0 = std::time::Instant::now();
    let r = minikv_models::perplexity_chunked(
        l.model.as_ref(),
        || build_cache(l.model.as_ref(), &cfg),
        &ids,
        ctx,
        a.chunks,
        bos,
    )?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&r).expect("json");
        v["text_tokens"] = json!(ids.len());
        v["wall_s"] = json!(secs);
        v["text"] = json!(a.text.display().to_string());
        v["provenance"] =
            serde_json::to_value(provenance(Some(&l.path), cfg.seed, None)?).expect("json");
        print_json(&v);
    } else {
        println!(
            "{} chunks of {ctx} tokens ({} scored, second halves): nll {:.5}, ppl {:.4}; {secs:.1}s",
            r.chunks, r.scored, r.nll, r.ppl
        );
    }
    Ok(())
}

pub fn perplexity(a: &PplArgs) -> Result<()> {
    if let Some(ctx) = a.ctx {
        return perplexity_chunked(a, ctx);
    }
    let cfg = load_config(a.config.as_deref())?;
    let l = load_model(&a.model)?;
    let max = l.model.spec().max_seq_len;
    if a.tokens > max {
        return Err(Error::ContextOverflow { len: a.tokens, max });
    }
    let text = read_text(&a.text)?;
    let ids = first_tokens(&l.tok, &text, a.tokens, &a.text)?;
    let prefill = a.prefill.unwrap_or((a.tokens / 2).max(1));
    let mut cache = build_cache(l.model.as_ref(), &cfg)?;
    let pb = ProgressBar::new((a.tokens - 1).saturating_sub(prefill) as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} tokens, eta {eta}")
            .expect("template"),
    );
    pb.set_message("decode");
    let t0 = std::time::Instant::now();
    let r = minikv_models::perplexity(l.model.as_ref(), cache.as_mut(), &ids, prefill, |i| {
        pb.set_position((i - prefill) as u64)
    })?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let mem = cache.memory();
    if a.json {
        let mut v = serde_json::to_value(&r).expect("json");
        v["wall_s"] = json!(secs);
        v["memory"] = memory_json(&mem);
        v["text"] = json!(a.text.display().to_string());
        v["provenance"] = serde_json::to_value(provenance(
            Some(&l.path),
            cfg.seed,
            Some(serde_json::to_value(&cfg).expect("json")),
        )?)
        .expect("json");
        print_json(&v);
    } else {
        println!(
            "tokens {} (prefill {}), nll {:.4}, ppl {:.3}",
            r.tokens, r.prefill_tokens, r.nll, r.ppl
        );
        if let (Some(n), Some(p)) = (r.decode_nll, r.decode_ppl) {
            println!("after compression: nll {n:.4}, ppl {p:.3}");
        }
        println!(
            "KV {} bytes = {:.1}% of fp16 ({} allocated); {secs:.1}s",
            mem.used_bytes(),
            100.0 * mem.used_bytes() as f64 / mem.full_fp16_bytes.max(1) as f64,
            mem.total_bytes()
        );
    }
    Ok(())
}
