//! Evaluation tasks on the real SmolLM2-135M-Instruct (fetched by
//! scripts/fetch-assets.sh).

use minikv_policies as _;
use minikv_quant as _;
use minikv_test_support::{cache_from, full_cache, root, smollm2 as model};

/// Fidelity of the full config against itself is exact; a 2-bit cache is not.
#[test]
fn fidelity_and_passkey_on_the_real_model() {
    use minikv_eval as eval;
    let (m, t) = model();
    let text = std::fs::read_to_string(root().join("assets/paul_graham/addiction.txt")).unwrap();
    let ids: Vec<u32> = t.encode(&text).unwrap()[..96].to_vec();
    let same = eval::fidelity(m, full_cache(m).as_mut(), full_cache(m).as_mut(), &ids, 64).unwrap();
    assert_eq!((same.predictions, same.kl, same.top1), (32, 0.0, 1.0));
    let kivi = "[cache.quant]\nresidual = 32\nkeys = { type = \"minmax\", bits = 2, group = 32, axis = \"channel\" }\nvalues = { type = \"minmax\", bits = 2, group = 32, axis = \"token\" }";
    let q = eval::fidelity(
        m,
        full_cache(m).as_mut(),
        cache_from(m, kivi).as_mut(),
        &ids,
        64,
    )
    .unwrap();
    assert!(
        q.kl > 1e-3 && q.kl < 2.0 && q.top1 < 1.0 && q.top1 > 0.3,
        "{q:?}"
    );

    let hay = t.encode(&text).unwrap();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(1);
    let (p, key) = eval::passkey_prompt(t, &hay, 200, 0.5, &mut rng).unwrap();
    assert_eq!(p.len(), 200);
    let s = t.decode(&p).unwrap();
    assert!(
        s.contains(&format!("The pass key is {key}.")) && s.ends_with("The pass key is"),
        "{s}"
    );
    for kind in [eval::Retrieval::Needle, eval::Retrieval::KvRetrieval] {
        let (p, answer) = eval::retrieval_prompt(kind, t, &hay, 300, 0.3, &mut rng).unwrap();
        assert_eq!(p.len(), 300, "{kind:?}");
        let s = t.decode(&p).unwrap();
        let fact_at = s
            .find(&answer)
            .unwrap_or_else(|| panic!("{kind:?}: answer {answer} not in the prompt"));
        assert!(
            fact_at > 0 && fact_at < s.len() * 3 / 4,
            "{kind:?}: fact at {fact_at} of {}",
            s.len()
        );
        if kind == eval::Retrieval::KvRetrieval {
            // The asked key appears twice (fact and question); the fact is a whole line.
            let key = s
                .rsplit('\n')
                .next()
                .unwrap()
                .trim_end_matches(':')
                .to_string();
            assert!(
                s.contains(&format!("\n{key}: {answer}\n"))
                    || s.starts_with(&format!("{key}: {answer}\n")),
                "{s}"
            );
        } else {
            assert!(s.ends_with("The best thing to do in San Francisco is"));
        }
    }
    let spec = eval::PasskeySpec {
        context: 160,
        depth: None,
        trials: 3,
        seed: 5,
    };
    let r = eval::passkey(m, t, &hay, spec, || Ok(full_cache(m))).unwrap();
    assert_eq!(r.trials, 3);
    assert!(r.ci95.0 <= r.accuracy && r.accuracy <= r.ci95.1);
    // 160 prompt tokens plus the up to 7 tokens fed back while generating 8.
    assert!(
        r.full_fp16_bytes >= m.spec().full_fp16_bytes(160)
            && r.full_fp16_bytes <= m.spec().full_fp16_bytes(167)
    );
    assert!(
        r.kv_bytes >= r.full_fp16_bytes,
        "full cache holds at least the fp16 bytes"
    );
}

fn essays() -> String {
    let dir = root().join("assets/paul_graham");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    names.sort();
    names
        .iter()
        .take(8)
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Generators are deterministic per seed; every prompt fits its token budget
/// closely; the stated answers are in the context, the asked needle at the
/// stated depth.
#[test]
fn ruler_generators_are_seeded_fit_and_hold_their_answers() {
    use minikv_eval::ruler::{RulerSpec, generate};
    let (_, t) = model();
    let hay = essays();
    let all = minikv_eval::ruler::all();
    assert_eq!(all.len(), 9);
    for task in all {
        let name = task.name();
        let spec = RulerSpec {
            context: 1500,
            depth: Some(0.3),
            trials: 2,
            seed: 9,
        };
        let a = generate(task, t, &hay, spec).unwrap();
        assert_eq!(
            a,
            generate(task, t, &hay, spec).unwrap(),
            "{name} not deterministic"
        );
        let b = generate(task, t, &hay, RulerSpec { seed: 10, ..spec }).unwrap();
        assert_ne!(a, b, "{name} ignores the seed");
        for r in &a {
            let n = t
                .encode(&format!("{}{}{}", r.context, r.question, r.answer_prefix))
                .unwrap()
                .len();
            assert!((1500 - 120..=1500).contains(&n), "{name}: {n} tokens");
            assert_eq!(r.task.as_deref(), Some(name));
            for ans in r.answer.all() {
                assert!(
                    r.context.contains(ans),
                    "{name}: `{ans}` not in the context"
                );
            }
            if name.starts_with("ruler-niah-single-") {
                let ans = r.answer.all()[0];
                let at = r.context.find(&format!("is: {ans}.")).unwrap() as f64;
                let d = at / r.context.len() as f64;
                assert!(
                    (d - 0.3).abs() < 0.08,
                    "{name}: needle at {d:.3}, asked 0.3"
                );
            }
        }
    }
}

/// A generated suite exported to JSONL and read back gives the same rows and
/// the same scores; malformed rows are errors naming their line.
#[test]
fn dataset_round_trip_and_errors() {
    use minikv_eval::qa::{QueryMode, evaluate, read_dataset, write_dataset};
    use minikv_eval::ruler::{RulerSpec, generate};
    let (m, t) = model();
    let rows = generate(
        minikv_eval::ruler::find("ruler-niah-single-number").unwrap(),
        t,
        &essays(),
        RulerSpec {
            context: 400,
            depth: None,
            trials: 2,
            seed: 3,
        },
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("minikv-ds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("suite.jsonl");
    write_dataset(&p, &rows).unwrap();
    let back = read_dataset(&p).unwrap();
    assert_eq!(rows, back);
    for mode in [QueryMode::Agnostic, QueryMode::Aware] {
        let a = evaluate(m, t, &rows, mode, || Ok(full_cache(m))).unwrap();
        let b = evaluate(m, t, &back, mode, || Ok(full_cache(m))).unwrap();
        assert_eq!(a.per_trial, b.per_trial);
        assert_eq!(a.trials, 2);
    }
    let bad = dir.join("bad.jsonl");
    let good = std::fs::read_to_string(&p).unwrap();
    for (line, want) in [
        ("{\"context\": \"x\"}", "missing field"),
        (
            "{\"context\": \"x\", \"question\": \"q\", \"answer\": \"a\", \"max_new_tokens\": 0}",
            "max_new_tokens",
        ),
        (
            "{\"context\": \"x\", \"question\": \"q\", \"answer\": \"a\", \"extra\": 1}",
            "unknown field",
        ),
        ("not json", "line 3"),
    ] {
        std::fs::write(&bad, format!("{good}{line}\n")).unwrap();
        let e = read_dataset(&bad).unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains(want), "{line}: {e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The passkey prompt follows the standard format: the instruction first, the
/// fact after a sentence end, the question last.
#[test]
fn passkey_prompt_has_the_standard_format() {
    let (_, t) = model();
    let hay = t.encode(&essays()).unwrap();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(4);
    for depth in [0.0, 0.25, 0.5, 0.9] {
        let (p, key) = minikv_eval::passkey_prompt(t, &hay, 600, depth, &mut rng).unwrap();
        assert_eq!(p.len(), 600);
        let s = t.decode(&p).unwrap();
        assert!(s.starts_with(minikv_eval::PASSKEY_INSTRUCTION), "{s}");
        let fact = format!(" The pass key is {key}. Remember it. {key} is the pass key.");
        let at = s.find(&fact).unwrap();
        let before = s[..at].trim_end();
        assert!(
            before.ends_with(['.', '!', '?'])
                || before == minikv_eval::PASSKEY_INSTRUCTION.trim_end(),
            "fact not after a sentence end: ...{}",
            &before[before.len().saturating_sub(40)..]
        );
        assert!(s.ends_with("\nWhat is the pass key? The pass key is"));
    }
}
