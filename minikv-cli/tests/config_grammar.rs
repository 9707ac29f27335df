//! A config that `config check` accepts never panics: configs are drawn from
//! the grammar (every registered component, with its parameters set to
//! ordinary, boundary and absurd values, NaN and infinities included), checked
//! as `minikv config check` does, built, and run (prefill, compression,
//! decode) on a tiny random Llama. Each must end in a clean error or a run
//! with finite logits.

use minikv_core::{CacheBuilder, RunConfig};
use minikv_models::llama::Block;
use minikv_models::matrix::QMatrix;
use minikv_models::{LanguageModel, Llama, LlamaConfig, Logits, RopeLayout, Workspace};
use minikv_policies as _;
use minikv_quant as _;
use proptest::prelude::*;
use serde_json::Value;
use std::sync::OnceLock;

fn tiny_model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| {
        let (hidden, heads, kv, d, ffn, vocab) = (32, 4, 2, 16, 48, 64);
        let mut seed = 1u64;
        let mut mat = |rows: usize, cols: usize| {
            let v: Vec<f32> = (0..rows * cols)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.4
                })
                .collect();
            QMatrix::from_f32(rows, cols, &v)
        };
        let blocks = (0..2)
            .map(|_| Block {
                attn_norm: vec![1.0; hidden],
                wq: mat(heads * d, hidden),
                wk: mat(kv * d, hidden),
                wv: mat(kv * d, hidden),
                wo: mat(hidden, heads * d),
                ffn_norm: vec![1.0; hidden],
                w_gate: mat(ffn, hidden),
                w_up: mat(ffn, hidden),
                w_down: mat(hidden, ffn),
            })
            .collect();
        let cfg = LlamaConfig {
            n_layers: 2,
            hidden,
            ffn,
            n_heads: heads,
            n_kv_heads: kv,
            head_dim: d,
            rope_base: 10000.0,
            rms_eps: 1e-5,
            max_seq_len: 96,
            vocab,
            rope: RopeLayout::Halves,
        };
        let embed = mat(vocab, hidden);
        Llama::assemble(cfg, embed, blocks, vec![1.0; hidden], None)
    })
}

/// A TOML value for a JSON value; `f` replaces numbers.
fn toml_of(v: &Value, f: &mut impl FnMut(f64) -> String) -> String {
    match v {
        Value::Null => "0".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => f(n.as_f64().unwrap()),
        Value::String(s) => format!("{s:?}"),
        Value::Array(a) => format!(
            "[{}]",
            a.iter()
                .map(|x| toml_of(x, f))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::Object(o) => format!(
            "{{ {} }}",
            o.iter()
                .map(|(k, x)| format!("{k} = {}", toml_of(x, f)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

const SPECIAL: [&str; 12] = [
    "0", "1", "2", "3", "16", "-1", "0.5", "1.5", "1e9", "nan", "inf", "-inf",
];

/// A registered component of `point` (by index), its numbers mutated by `picks`.
fn component(point: &str, which: usize, picks: &[usize]) -> Option<String> {
    let all: Vec<_> = minikv_core::components::all()
        .into_iter()
        .filter(|c| c.point.to_string() == point)
        .collect();
    let c = all.get(which % (all.len() + 1))?;
    let picks = &picks[which % 7..];
    let mut i = 0;
    let mut f = |x: f64| {
        i += 1;
        match picks.get(i).copied().unwrap_or(999) % 200 {
            p @ 0..12 => SPECIAL[p].to_string(),
            _ => {
                if x.fract() == 0.0 {
                    format!("{}", x as i64)
                } else {
                    format!("{x:?}")
                }
            }
        }
    };
    Some(toml_of(&(c.default)(), &mut f))
}

fn config_text(choice: &[usize]) -> String {
    let c = |i: usize| choice[i];
    let pick = |i: usize, xs: &[&str]| xs[c(i) % xs.len()].to_string();
    let mut s = String::from("[cache]\n");
    // Each field: absent half the time, else a valid value, sometimes a bad one.
    for (i, key, good, bad) in [
        (
            0,
            "heads",
            &["\"per_kv\"", "\"per_query\""][..],
            &["\"per_token\""][..],
        ),
        (1, "gqa_reduce", &["\"mean\"", "\"max\"", "\"sum\""], &["2"]),
        (
            2,
            "heavy",
            &["0", "0.25", "1.0", "0.1"],
            &["1.5", "-0.1", "nan", "inf"],
        ),
        (
            3,
            "heavy_tokens",
            &["0", "5", "40", "1000"],
            &["1099511627776", "-3"],
        ),
        (4, "recent", &["0", "0.1", "0.5"], &["nan", "2.0"]),
        (5, "recent_tokens", &["0", "3", "8", "500"], &["-1"]),
        (6, "sinks", &["0", "1", "4", "200"], &["-4"]),
        (
            7,
            "decode",
            &[
                "\"frozen\"",
                "\"evict\"",
                "{ type = \"evict\", every = 3 }",
                "{ type = \"evict\", every = 64 }",
            ],
            &["\"sometimes\"", "{ type = \"evict\", every = 0 }"],
        ),
        (
            8,
            "pages",
            &[
                "{ page_size = 4, token_budget = 8 }",
                "{ page_size = 16, token_budget = 16, score = { type = \"page_mean\" } }",
            ],
            &["{ page_size = 0 }", "{ page_size = 8, token_budget = 4 }"],
        ),
        (9, "page_tokens", &["1", "7", "256"], &["0", "1e9"]),
    ] {
        let x = c(i) % 40;
        let exclusive = (key == "heavy_tokens" && s.contains("heavy ="))
            || (key == "recent_tokens" && s.contains("recent ="));
        let v = if x < 18 || (exclusive && x < 39) {
            None
        } else if x < 39 {
            Some(good[x % good.len()])
        } else {
            Some(bad[x % bad.len()])
        };
        if let Some(v) = v {
            s += &format!("{key} = {v}\n");
        }
    }
    for (i, key, point) in [
        (10, "scorer", "scorer"),
        (11, "policy", "policy"),
        (12, "selector", "selector"),
        (18, "compensator", "compensator"),
        (19, "channels", "channels"),
    ] {
        if (c(i) % 3 != 0 || key == "scorer")
            && let Some(t) = component(point, c(i) / 3, &choice[20 + i..])
        {
            s += &format!("{key} = {t}\n");
        }
    }
    if c(13) % 3 == 0 {
        s += "[cache.quant]\n";
        s += &pick(
            14,
            &[
                "",
                "residual = 16\n",
                "residual = 32\n",
                "residual = 0\n",
                "residual = 100\n",
            ],
        );
        s += &pick(
            15,
            &[
                "",
                "residual_mode = \"kivi\"\n",
                "residual_mode = \"minikv\"\n",
            ],
        );
        for (i, key) in [(16, "keys"), (17, "values")] {
            if c(i) % 4 != 0
                && let Some(t) = component("quantizer", 0, &choice[40 + i..])
            {
                s += &format!("{key} = {t}\n");
            }
        }
    }
    s
}

/// Check as `minikv config check` does; if accepted, build and run.
fn check_build_run(text: &str) -> Result<(), String> {
    let mut cfg = match RunConfig::parse(text, false) {
        Ok(c) => c,
        Err(_) => return Ok(()),
    };
    if cfg.resolve().and_then(|_| cfg.validate(None)).is_err() {
        return Ok(());
    }
    let m = tiny_model();
    let run = || -> minikv_core::Result<()> {
        let mut cache = CacheBuilder::new(m.spec()).build(&cfg.cache)?;
        let mut ws = Workspace::default();
        let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7) % 64).collect();
        m.forward(&prompt, cache.as_mut(), &mut ws, Logits::None)?;
        cache.end_prefill()?;
        for t in 0..6u32 {
            let l = m.forward(&[t], cache.as_mut(), &mut ws, Logits::Last)?;
            assert!(l.iter().all(|x| x.is_finite()), "non-finite logits");
        }
        let _ = cache.memory();
        Ok(())
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(_) => Ok(()),
        Err(p) => Err(format!(
            "accepted config panicked: {:?}\n{text}",
            p.downcast_ref::<String>()
                .map(String::as_str)
                .or(p.downcast_ref::<&str>().copied())
        )),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]
    #[test]
    fn accepted_configs_never_panic(choice in prop::collection::vec(0usize..1000, 80)) {
        let text = config_text(&choice);
        if let Err(e) = check_build_run(&text) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// The grammar reaches configs that are accepted and run, not only errors.
#[test]
fn the_grammar_produces_runnable_configs() {
    let mut ok = 0;
    for s in 0..300usize {
        let mut x = s as u64 + 1;
        let choice: Vec<usize> = (0..80)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % 1000) as usize
            })
            .collect();
        let text = config_text(&choice);
        let accepted = RunConfig::parse(&text, false)
            .and_then(|mut c| {
                c.resolve()?;
                c.validate(None)?;
                Ok(c)
            })
            .is_ok();
        if accepted {
            ok += 1;
        }
        check_build_run(&text).unwrap();
    }
    assert!(ok >= 30, "only {ok} of 300 drawn configs were accepted");
}
