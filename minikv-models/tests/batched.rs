//! A batched step gives each sequence the logits it gets alone, bit for bit:
//! every preset in `configs/`, ragged prompt lengths, staggered starts, a
//! prompt longer than one prefill chunk whose chunks interleave with the
//! other sequences' decode steps (chunked prefill), on both real models.

use minikv_core::{CacheBuilder, KvCache, RunConfig};
use minikv_models::{
    Activations, LanguageModel, Logits, SeqStep, Tokenizer, Workspace, argmax, finish_prefill,
    llama::PREFILL_CHUNK,
};
use minikv_policies as _;
use minikv_quant as _;
use minikv_test_support::{load_model as load, root};
use std::path::{Path, PathBuf};

fn cache(m: &dyn LanguageModel, cfg: &Path) -> Box<dyn KvCache> {
    let mut c = RunConfig::load(cfg).unwrap_or_else(|e| panic!("{}: {e}", cfg.display()));
    c.resolve().unwrap();
    CacheBuilder::new(m.spec())
        .build(&c.cache)
        .unwrap_or_else(|e| panic!("{}: {e}", cfg.display()))
}

fn prompts(tok: &Tokenizer, lens: &[usize]) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(root().join("assets/paul_graham/addiction.txt")).unwrap();
    let ids = tok.encode(&text).unwrap();
    lens.iter()
        .enumerate()
        .map(|(i, &n)| ids[40 * i..40 * i + n].to_vec())
        .collect()
}

/// Greedy run of one sequence alone: logits of the prompt's last token and
/// of each decoded token.
fn alone(m: &dyn LanguageModel, cfg: &Path, prompt: &[u32], steps_out: usize) -> Vec<Vec<f32>> {
    let mut c = cache(m, cfg);
    let mut ws = Workspace::default();
    let mut out = vec![
        m.forward(prompt, c.as_mut(), &mut ws, Logits::Last)
            .unwrap(),
    ];
    finish_prefill(m, c.as_mut(), prompt, &mut ws).unwrap();
    for _ in 1..steps_out {
        let t = argmax(out.last().unwrap()) as u32;
        out.push(m.forward(&[t], c.as_mut(), &mut ws, Logits::Last).unwrap());
    }
    out
}

/// The same sequences in batched steps: sequence `i` joins at step `i`,
/// prompts go in chunks of `PREFILL_CHUNK` tokens, one chunk per step.
fn batched(
    m: &dyn LanguageModel,
    cfg: &Path,
    ps: &[Vec<u32>],
    steps_out: usize,
) -> Vec<Vec<Vec<f32>>> {
    struct Seq {
        cache: Box<dyn KvCache>,
        fed: usize,
        next: [u32; 1],
        decoding: bool,
        out: Vec<Vec<f32>>,
    }
    let mut seqs: Vec<Seq> = ps
        .iter()
        .map(|_| Seq {
            cache: cache(m, cfg),
            fed: 0,
            next: [0],
            decoding: false,
            out: Vec::new(),
        })
        .collect();
    let mut ws = Workspace::default();
    let mut step = 0;
    while seqs.iter().any(|s| s.out.len() < steps_out) {
        let mut st = Vec::new();
        let mut who = Vec::new();
        for (i, s) in seqs.iter_mut().enumerate() {
            if i > step || s.out.len() >= steps_out {
                continue;
            }
            let (tokens, logits): (&[u32], Logits) = if s.decoding {
                (&s.next, Logits::Last)
            } else {
                let p = &ps[i];
                let start = s.fed;
                s.fed = (start + PREFILL_CHUNK).min(p.len());
                let w = if s.fed == p.len() {
                    Logits::Last
                } else {
                    Logits::None
                };
                (&p[start..s.fed], w)
            };
            who.push((i, !s.decoding && logits == Logits::Last));
            st.push(SeqStep {
                tokens,
                cache: s.cache.as_mut(),
                logits,
            });
        }
        let outs = m.forward_batch(&mut st, &mut ws).unwrap();
        drop(st);
        for ((i, prompt_done), o) in who.into_iter().zip(outs) {
            let s = &mut seqs[i];
            if o.is_empty() {
                continue; // a prompt chunk before the last
            }
            if prompt_done {
                finish_prefill(m, s.cache.as_mut(), &ps[i], &mut ws).unwrap();
                s.decoding = true;
            }
            s.next = [argmax(&o) as u32];
            s.out.push(o);
        }
        step += 1;
    }
    seqs.into_iter().map(|s| s.out).collect()
}

fn check(model: &str, presets: &[PathBuf], lens: &[usize], steps_out: usize) {
    check_with(model, Activations::F32, presets, lens, steps_out);
}

fn check_with(
    model: &str,
    act: Activations,
    presets: &[PathBuf],
    lens: &[usize],
    steps_out: usize,
) {
    let (mut m, tok) = load(model);
    m.set_activations(act);
    let ps = prompts(&tok, lens);
    for cfg in presets {
        let b = batched(m.as_ref(), cfg, &ps, steps_out);
        for (i, p) in ps.iter().enumerate() {
            let a = alone(m.as_ref(), cfg, p, steps_out);
            assert_eq!(a.len(), b[i].len());
            for (t, (x, y)) in a.iter().zip(&b[i]).enumerate() {
                let same =
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(
                    same,
                    "{model} {}: sequence {i} (prompt {}), step {t}: batched logits differ from alone",
                    cfg.display(),
                    p.len()
                );
            }
        }
    }
}

fn presets() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_preset_batched_equals_alone_on_smollm2() {
    // The presets' relative paths (e.g. DuoAttention's pattern) resolve
    // against the repository root.
    std::env::set_current_dir(root()).unwrap();
    check(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        &presets(),
        &[48, 31, 77],
        4,
    );
}

#[test]
fn chunked_prefill_interleaves_with_decode() {
    let c = |n: &str| root().join("configs").join(n);
    // The 600-token prompt takes two steps, while the others decode.
    check(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        &[c("full.toml"), c("minikv.toml"), c("kivi-2bit.toml")],
        &[40, PREFILL_CHUNK + 88, 25],
        5,
    );
}

#[test]
fn gemma3_batched_equals_alone() {
    let c = |n: &str| root().join("configs").join(n);
    check(
        "gemma-3-270m-q4_k_m.gguf",
        &[c("full.toml"), c("minikv.toml")],
        &[36, 61, 20],
        4,
    );
}

/// With `--activations q8` the invariant holds too: prompts of up to 32
/// tokens (here 20 and 31) take 8-bit products, the 61-token one exact
/// ones, while the others' decode steps run in 8 bits beside them. (Two
/// prefill chunks of one step each going by its own length:
/// `matrix::batch_tests::q8_parts_go_by_their_own_length`.)
#[test]
fn gemma3_batched_equals_alone_with_q8_activations() {
    let c = |n: &str| root().join("configs").join(n);
    check_with(
        "gemma-3-270m-q4_k_m.gguf",
        Activations::Q8,
        &[c("full.toml")],
        &[20, 61, 31],
        4,
    );
}
