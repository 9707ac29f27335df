//! Evaluation tasks on the real SmolLM2-135M-Instruct (fetched by
//! scripts/fetch-assets.sh).

use minikv_core::{CacheBuilder, CacheConfig, KvCache, RunConfig};
use minikv_models::{LanguageModel, Llama, Tokenizer};
use minikv_policies as _;
use minikv_quant as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn model() -> &'static (Box<Llama>, Tokenizer) {
    static M: OnceLock<(Box<Llama>, Tokenizer)> = OnceLock::new();
    M.get_or_init(|| {
        let p = root().join("assets/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            p.is_file(),
            "{} missing: run scripts/fetch-assets.sh",
            p.display()
        );
        minikv_models::load(&p).expect("model loads")
    })
}

fn full_cache(m: &Llama) -> Box<dyn KvCache> {
    CacheBuilder::new(m.spec())
        .build(&CacheConfig::default())
        .unwrap()
}

fn cache_from(m: &Llama, toml: &str) -> Box<dyn KvCache> {
    let mut cfg = RunConfig::parse(toml, false).unwrap();
    cfg.resolve().unwrap();
    CacheBuilder::new(m.spec()).build(&cfg.cache).unwrap()
}

/// Fidelity of the full config against itself is exact; a 2-bit cache is not.
#[test]
fn fidelity_and_passkey_on_the_real_model() {
    use minikv_eval as eval;
    let (m, t) = model();
    let text = std::fs::read_to_string(root().join("assets/paul_graham/addiction.txt")).unwrap();
    let ids: Vec<u32> = t.encode(&text).unwrap()[..96].to_vec();
    let same = eval::fidelity(
        m.as_ref(),
        full_cache(m).as_mut(),
        full_cache(m).as_mut(),
        &ids,
        64,
    )
    .unwrap();
    assert_eq!((same.predictions, same.kl, same.top1), (32, 0.0, 1.0));
    let kivi = "[cache.quant]\nresidual = 32\nkeys = { type = \"minmax\", bits = 2, group = 32, axis = \"channel\" }\nvalues = { type = \"minmax\", bits = 2, group = 32, axis = \"token\" }";
    let q = eval::fidelity(
        m.as_ref(),
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
    let r = eval::passkey(m.as_ref(), t, &hay, spec, || Ok(full_cache(m))).unwrap();
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
