//! `calibrate duo`, `calibrate qfilters`, `calibrate lukv`.

use super::*;

use minikv_core::{Error, Result, RunConfig};

/// `minikv calibrate duo`: measures the DuoAttention head pattern of a model
/// on seeded passkey prompts and writes it (atomically) as JSON.
pub fn calibrate_duo(a: &crate::DuoArgs) -> Result<()> {
    let l = load_model_for(&a.model, a.context)?;
    let m = l.model.as_ref();
    if a.sinks + a.recent >= a.context {
        return Err(Error::Input(format!(
            "calibrate duo: --sinks {} + --recent {} leave no token of the {}-token context outside them: nothing to measure (make --context larger)",
            a.sinks, a.recent, a.context
        )));
    }
    let text_path = a.text.clone().unwrap_or_else(default_text);
    let haystack = l.tok.encode(&read_text(&text_path)?)?;
    let cal = minikv_eval::duo::DuoCalibration {
        prompts: minikv_eval::PasskeySpec {
            context: a.context,
            depth: None,
            trials: a.trials,
            seed: a.seed,
        },
        sinks: a.sinks,
        recent: a.recent,
        window: a.window,
    };
    let t0 = std::time::Instant::now();
    let full = RunConfig::default();
    let scores =
        minikv_eval::duo::calibrate_duo(m, &l.tok, &haystack, cal, || build_cache(m, &full))?;
    let pattern = minikv_policies::DuoPattern {
        format: minikv_policies::DuoPattern::FORMAT.into(),
        model: model_file_name(&l),
        model_sha256: l.sha256()?,
        calibration: serde_json::json!({
            "task": "passkey",
            "statistic": "mean attention mass of the last `window` prompt queries outside the first `sinks` and the last `recent` tokens, averaged over the query heads of each KV head",
            "context": a.context,
            "trials": a.trials,
            "seed": a.seed,
            "sinks": a.sinks,
            "recent": a.recent,
            "window": a.window,
            "text": text_path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "git_revision": crate::provenance::git_rev(),
        }),
        scores,
    };
    write_atomically(&a.out, &pattern)?;
    report(
        "duo pattern",
        "long-range mass",
        &pattern.scores,
        t0,
        &a.out,
    );
    Ok(())
}

/// Writes `value` as pretty JSON to `out` through a temporary file and a
/// rename (a kill never leaves half a file).
fn write_atomically(out: &std::path::Path, value: &impl serde::Serialize) -> Result<()> {
    let body = serde_json::to_string_pretty(value).map_err(|e| Error::Input(e.to_string()))? + "\n";
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, body).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))
}

/// One line on stderr: the table's shape and the min / median / max of
/// `what` over every (layer, KV head).
fn report(
    name: &str,
    what: &str,
    table: &[Vec<f32>],
    t0: std::time::Instant,
    out: &std::path::Path,
) {
    let mut sorted: Vec<f32> = table.iter().flatten().copied().collect();
    sorted.sort_by(|a, b| a.total_cmp(b));
    eprintln!(
        "{name}: {} layers x {} KV heads, {what} min {:.3} median {:.3} max {:.3}, {:.1}s -> {}",
        table.len(),
        table[0].len(),
        sorted[0],
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
        t0.elapsed().as_secs_f64(),
        out.display()
    );
}

/// `minikv calibrate qfilters`: per (layer, KV head) the dominant direction
/// of the model's post-RoPE queries over consecutive text chunks, written
/// (atomically) as a JSON filter file for the `q_filter` scorer.
pub fn calibrate_qfilters(a: &crate::QFilterArgs) -> Result<()> {
    let l = load_model_for(&a.model, a.context)?;
    let m = l.model.as_ref();
    let (text_path, chunks) = text_chunks(
        &l,
        a.text.as_ref(),
        a.context,
        a.chunks,
        "calibrate qfilters",
        &format!("--chunks {} x --context {}", a.chunks, a.context),
    )?;
    let t0 = std::time::Instant::now();
    let full = RunConfig::default();
    let per = minikv_eval::qfilters::calibrate_qfilters(m, &chunks, || build_cache(m, &full))?;
    let file = minikv_policies::QFilterFile {
        format: minikv_policies::QFilterFile::FORMAT.into(),
        model: model_file_name(&l),
        model_sha256: l.sha256()?,
        calibration: serde_json::json!({
            "statistic": "first right singular vector of the post-RoPE queries of the query heads of each KV head, stacked (uncentered), signed so that they project positively; score = <k, u>",
            "context": a.context,
            "chunks": a.chunks,
            "text": text_path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "git_revision": crate::provenance::git_rev(),
        }),
        filters: per
            .iter()
            .map(|hs| hs.iter().map(|(u, _)| u.clone()).collect())
            .collect(),
        explained: per
            .iter()
            .map(|hs| hs.iter().map(|(_, s)| *s).collect())
            .collect(),
    };
    write_atomically(&a.out, &file)?;
    report(
        "q-filters",
        "share of the queries' second moment along the filter",
        &file.explained,
        t0,
        &a.out,
    );
    Ok(())
}

/// `minikv calibrate lukv`: the utility curves of the config's scorer on
/// consecutive text chunks, the LU-KV budget split solved from them, written
/// (atomically) as a JSON curve file for the `lukv` selector.
pub fn calibrate_lukv(a: &crate::LuKvArgs) -> Result<()> {
    let span = a.context + a.future;
    let l = load_model_for(&a.model, span)?;
    let m = l.model.as_ref();
    // The config's scorer and cache settings; the selector is replaced by
    // the tap, so a config naming a curve not made yet still serves.
    let text = read_text(&a.config)?;
    let json = a.config.extension().is_some_and(|e| e == "json");
    let mut cfg = RunConfig::parse(&text, json)
        .map_err(|e| Error::Parse(format!("{}: {e}", a.config.display())))?;
    let Some(scorer) = cfg.cache.scorer.as_mut() else {
        return Err(Error::config(
            "cache.scorer",
            format!(
                "{}: calibrate lukv measures a scorer, and this config has none",
                a.config.display()
            ),
        ));
    };
    if let Some(dir) = a.config.parent() {
        scorer.resolve_paths(dir);
    }
    let scorer_json = serde_json::to_value(&*scorer).map_err(|e| Error::Input(e.to_string()))?;
    let tap = minikv_eval::lukv::ScoreTap::default();
    cfg.cache.selector = Some(Box::new(tap.clone()));
    cfg.cache.quant = None;
    cfg.resolve()?;
    cfg.validate(Some(&m.spec()))?;
    let (text_path, chunks) = text_chunks(
        &l,
        a.text.as_ref(),
        span,
        a.chunks,
        "calibrate lukv",
        &format!(
            "--chunks {} x (--context {} + --future {})",
            a.chunks, a.context, a.future
        ),
    )?;
    let t0 = std::time::Instant::now();
    let full = RunConfig::default();
    let util = minikv_eval::lukv::utility_curves(
        m,
        &chunks,
        a.context,
        a.normalize.into(),
        &tap,
        || build_cache(m, &cfg),
        || build_cache(m, &full),
        minikv_policies::lukv::keep_order,
    )?;
    let prune = minikv_policies::lukv::solve_budget_curve(&util, a.context)?;
    let file = minikv_policies::LuKvCurve {
        format: minikv_policies::LuKvCurve::FORMAT.into(),
        model: model_file_name(&l),
        model_sha256: l.sha256()?,
        scorer: scorer_json,
        calibration: serde_json::json!({
            "statistic": "oracle importance max over the group's query heads and the next `future` positions of attention x |W_o^q v| (text continuation, teacher forced), scaled as `normalize` says; utility of budget b = importance of the b tokens the lukv selector would keep (sinks and window first, then by score), averaged over chunks; budgets split greedily over the utilities' upper concave hulls",
            "context": a.context,
            "future": a.future,
            "chunks": a.chunks,
            "normalize": minikv_eval::lukv::Normalize::from(a.normalize),
            "sinks": cfg.cache.sinks,
            "text": text_path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "config": a.config.file_name().map(|f| f.to_string_lossy().into_owned()),
            "git_revision": crate::provenance::git_rev(),
        }),
        prune,
    };
    file.check().map_err(Error::Input)?;
    write_atomically(&a.out, &file)?;
    report(
        "lukv curve",
        "pruned share at ratio 0.5",
        &file.prune[49],
        t0,
        &a.out,
    );
    Ok(())
}

/// The model after the check that `len` tokens fit its context.
fn load_model_for(model: &crate::ModelArg, len: usize) -> Result<Loaded> {
    let l = load_model(model)?;
    let max = l.model.spec().max_seq_len;
    if len > max {
        return Err(Error::ContextOverflow { len, max });
    }
    Ok(l)
}

/// The model's file name, as the calibration files record it.
fn model_file_name(l: &Loaded) -> String {
    l.path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned())
}

/// The calibration text (`text`, else the fetched essays) cut into its
/// first `chunks` consecutive `span`-token pieces; a text too short is an
/// error of command `who` that names what was `asked`.
fn text_chunks(
    l: &Loaded,
    text: Option<&std::path::PathBuf>,
    span: usize,
    chunks: usize,
    who: &str,
    asked: &str,
) -> Result<(std::path::PathBuf, Vec<Vec<u32>>)> {
    let path = text.cloned().unwrap_or_else(default_text);
    let ids = l.tok.encode(&read_text(&path)?)?;
    if ids.len() < span * chunks {
        return Err(Error::Input(format!(
            "{who}: {} holds {} tokens, fewer than {asked} (use a longer text or fewer chunks)",
            path.display(),
            ids.len(),
        )));
    }
    let pieces = ids
        .chunks_exact(span)
        .take(chunks)
        .map(<[u32]>::to_vec)
        .collect();
    Ok((path, pieces))
}
