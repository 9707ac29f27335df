//! The engine on the real SmolLM2: greedy and seeded outputs equal
//! `generate` alone, a tight budget makes requests wait (none fails, the
//! caches' own bytes never exceed the budget), every preset's projection
//! bounds what its cache holds, cancellation frees bytes, bad requests are
//! refused with the reason.

use minikv_core::{CacheBuilder, CacheConfig};
use minikv_engine::{Engine, EngineConfig, Event, Finish, Finished, Request};
use minikv_models::{LanguageModel, SamplingConfig, Tokenizer, generate};
use minikv_policies as _;
use minikv_quant as _;
use minikv_test_support::{preset, root, smollm2 as model};
use std::sync::OnceLock;

fn config(name: &str) -> CacheConfig {
    preset(name).cache
}

fn prompts(n: usize, len: usize) -> Vec<Vec<u32>> {
    let (_, tok) = model();
    let text = std::fs::read_to_string(root().join("assets/paul_graham/addiction.txt")).unwrap();
    let ids = tok.encode(&text).unwrap();
    (0..n)
        .map(|i| ids[37 * i..37 * i + len - 3 * i].to_vec())
        .collect()
}

fn run_all(e: &mut Engine<'_>) -> Vec<Finished> {
    let mut done = Vec::new();
    let mut guard = 0;
    while !e.is_idle() {
        for ev in e.step().unwrap() {
            if let Event::Finished(f) = ev {
                done.push(f);
            }
        }
        let s = e.stats();
        assert!(
            s.reserved <= s.kv_budget,
            "reserved {} > budget {}",
            s.reserved,
            s.kv_budget
        );
        assert!(
            s.kv_bytes <= s.kv_budget,
            "held {} > budget {}",
            s.kv_bytes,
            s.kv_budget
        );
        guard += 1;
        assert!(guard < 10_000, "engine does not finish");
    }
    done.sort_by_key(|f| f.id);
    done
}

fn engine(cfg: CacheConfig, budget: usize) -> Engine<'static> {
    let (m, _) = model();
    let ecfg = EngineConfig {
        kv_budget: budget,
        ..EngineConfig::default()
    };
    Engine::new(m, CacheBuilder::new(m.spec()), cfg, ecfg).unwrap()
}

#[test]
fn outputs_equal_generate_alone() {
    let (m, tok) = model();
    for (name, sampling) in [
        ("minikv.toml", SamplingConfig::default()),
        (
            "full.toml",
            SamplingConfig {
                temperature: 0.8,
                top_p: 0.9,
                seed: 11,
            },
        ),
        ("h2o.toml", SamplingConfig::default()),
    ] {
        let ps = prompts(4, 90);
        let mut e = engine(config(name), 1 << 30);
        for (i, p) in ps.iter().enumerate() {
            let s = SamplingConfig {
                seed: sampling.seed + i as u64,
                ..sampling
            };
            e.submit(Request {
                id: i as u64,
                prompt: p.clone(),
                max_new: 6 + i,
                sampling: s,
                stop: tok.stop.clone(),
                logprobs: None,
            })
            .unwrap();
        }
        let done = run_all(&mut e);
        assert_eq!(done.len(), ps.len());
        for (i, (f, p)) in done.iter().zip(&ps).enumerate() {
            let s = SamplingConfig {
                seed: sampling.seed + i as u64,
                ..sampling
            };
            let mut c = CacheBuilder::new(m.spec()).build(&config(name)).unwrap();
            let g = generate(m, tok, c.as_mut(), p, 6 + i, s, |_| {}).unwrap();
            assert_eq!(f.tokens, g.tokens, "{name}: request {i}");
            assert_eq!(f.finish, Finish::Length);
            assert_eq!(f.itl_s.len(), f.tokens.len() - 1);
        }
        assert!(
            e.stats().peak_decoding >= 3,
            "{name}: sequences decoded together"
        );
    }
}

#[test]
fn a_tight_budget_makes_requests_wait_and_none_is_lost() {
    let cfg = config("minikv.toml");
    let ps = prompts(6, 120);
    let probe = engine(cfg.clone(), 1 << 30);
    let one = probe.projection(120, 8).unwrap();
    // Room for two sequences at a time.
    let mut e = engine(cfg, 2 * one + one / 2);
    for (i, p) in ps.iter().enumerate() {
        e.submit(Request {
            id: i as u64,
            prompt: p.clone(),
            max_new: 8,
            sampling: SamplingConfig::default(),
            stop: Vec::new(),
            logprobs: None,
        })
        .unwrap();
    }
    let done = run_all(&mut e);
    assert_eq!(
        done.iter().map(|f| f.id).collect::<Vec<_>>(),
        (0..6).collect::<Vec<_>>()
    );
    assert!(
        done.iter()
            .all(|f| f.finish == Finish::Length && f.tokens.len() == 8)
    );
    let s = e.stats();
    assert_eq!(s.peak_running, 2, "the budget holds two at a time");
    assert_eq!(s.reserved, 0, "finished sequences gave their bytes back");
    assert_eq!(s.over_projection, 0);
    assert!(done.iter().skip(2).all(|f| f.queue_s > 0.0));
}

#[test]
fn every_preset_projection_bounds_its_bytes() {
    std::env::set_current_dir(root()).unwrap();
    let ps = prompts(2, 200);
    let mut paths: Vec<_> = std::fs::read_dir(root().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    paths.sort();
    for p in paths {
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        let mut e = engine(config(&name), 1 << 30);
        for (i, q) in ps.iter().enumerate() {
            e.submit(Request {
                id: i as u64,
                prompt: q.clone(),
                max_new: 20,
                sampling: SamplingConfig::default(),
                stop: Vec::new(),
                logprobs: None,
            })
            .unwrap();
        }
        let done = run_all(&mut e);
        assert_eq!(
            e.stats().over_projection,
            0,
            "{name}: a cache held more than its projection"
        );
        for f in &done {
            assert!(
                f.kv_bytes <= f.reserved,
                "{name}: {} > {}",
                f.kv_bytes,
                f.reserved
            );
            // Tight enough to admit by: within 1.6x of what is held plus a
            // page of slack per head.
            assert!(
                f.reserved as f64 <= 1.6 * f.peak_kv_bytes as f64 + 400_000.0,
                "{name}: projection {} vs peak held {}",
                f.reserved,
                f.peak_kv_bytes
            );
        }
        assert_eq!(
            e.stats().over_projection,
            0,
            "{name}: a cache held more than its projection"
        );
    }
}

/// Gemma 3: the sliding-window rings count against the budget; the
/// projection bounds what the hybrid cache holds, and at a budget of two full
/// caches two run at a time.
#[test]
fn gemma3_rings_count_against_the_budget() {
    static G: OnceLock<(Box<dyn LanguageModel>, Tokenizer)> = OnceLock::new();
    let (m, tok) = G.get_or_init(|| {
        let p = root().join("assets/gemma-3-270m-q4_k_m.gguf");
        assert!(
            p.is_file(),
            "{} missing: run scripts/fetch-assets.sh",
            p.display()
        );
        minikv_models::load(&p).expect("gemma loads")
    });
    let m: &'static dyn LanguageModel = m.as_ref();
    let text = std::fs::read_to_string(root().join("assets/paul_graham/addiction.txt")).unwrap();
    let ids = tok.encode(&text).unwrap();
    for name in ["full.toml", "minikv.toml"] {
        let probe = Engine::new(
            m,
            CacheBuilder::new(m.spec()),
            config(name),
            EngineConfig::default(),
        )
        .unwrap();
        let one = probe.projection(140, 6).unwrap();
        let ecfg = EngineConfig {
            kv_budget: 2 * one + one / 2,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(m, CacheBuilder::new(m.spec()), config(name), ecfg).unwrap();
        for i in 0..3u64 {
            let p = ids[50 * i as usize..50 * i as usize + 140].to_vec();
            e.submit(Request {
                id: i,
                prompt: p,
                max_new: 6,
                sampling: SamplingConfig::default(),
                stop: Vec::new(),
                logprobs: None,
            })
            .unwrap();
        }
        let done = run_all(&mut e);
        assert_eq!(done.len(), 3);
        assert_eq!(
            e.stats().over_projection,
            0,
            "{name}: a cache held more than its projection"
        );
        assert_eq!(e.stats().peak_running, 2, "{name}");
        for f in &done {
            assert!(f.peak_kv_bytes <= f.reserved);
            assert!(
                f.reserved as f64 <= 1.6 * f.peak_kv_bytes as f64 + 400_000.0,
                "{name}: {} vs {}",
                f.reserved,
                f.peak_kv_bytes
            );
        }
    }
}

#[test]
fn cancellation_frees_bytes_and_bad_requests_are_refused() {
    let ps = prompts(2, 60);
    let mut e = engine(config("kivi-2bit.toml"), 1 << 30);
    let req = |id: u64, prompt: Vec<u32>, max_new: usize| Request {
        id,
        prompt,
        max_new,
        sampling: SamplingConfig::default(),
        stop: Vec::new(),
        logprobs: None,
    };
    e.submit(req(1, ps[0].clone(), 50)).unwrap();
    e.submit(req(2, ps[1].clone(), 50)).unwrap();
    for _ in 0..3 {
        e.step().unwrap();
    }
    let before = e.stats().reserved;
    assert!(e.cancel(1));
    assert!(!e.cancel(1), "already gone");
    assert!(e.stats().reserved < before);
    let evs = e.step().unwrap();
    assert!(
        evs.iter().any(
            |ev| matches!(ev, Event::Finished(f) if f.id == 1 && f.finish == Finish::Cancelled)
        )
    );
    let done = run_all(&mut e);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].tokens.len(), 50);

    let m = model().0;
    let err = |r: Request, e: &mut Engine<'_>| e.submit(r).unwrap_err().to_string();
    assert!(err(req(3, vec![], 4), &mut e).contains("empty prompt"));
    assert!(err(req(3, vec![1, 2], 0), &mut e).contains("max_new"));
    assert!(err(req(3, vec![u32::MAX], 4), &mut e).contains("vocabulary"));
    let long = vec![1u32; m.spec().max_seq_len];
    assert!(err(req(3, long, 4), &mut e).contains("exceeds the maximum"));
    let mut small = engine(config("full.toml"), 10_000);
    assert!(err(req(4, ps[0].clone(), 10), &mut small).contains("whole KV budget"));
}
