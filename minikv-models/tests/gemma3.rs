//! Gemma 3 270M (Q4_K_M GGUF) against independent references committed in
//! `reference/gemma3/`: llama.cpp's tokenizer, perplexity and greedy
//! continuations (`scripts/gemma3-reference.sh`), gguf-py's dequantization
//! and a float64 numpy forward (`reference/gemma3/*.py`).

use minikv_core::{CacheBuilder, CacheConfig, RunConfig};
use minikv_models::blocks::dequantize_row;
use minikv_models::gguf::Gguf;
use minikv_models::{LanguageModel, Logits, SamplingConfig, Tokenizer, Workspace};
use minikv_policies as _;
use minikv_quant as _;
use minikv_test_support::{asset, full_cache, root};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;

fn model_path() -> PathBuf {
    asset("gemma-3-270m-q4_k_m.gguf")
}

fn model() -> (&'static dyn LanguageModel, &'static Tokenizer) {
    static M: OnceLock<(Box<dyn LanguageModel>, Tokenizer)> = OnceLock::new();
    let (m, t) = M.get_or_init(|| minikv_models::load(&model_path()).expect("gemma loads"));
    (m.as_ref(), t)
}

fn reference(name: &str) -> Value {
    let p = root().join("reference/gemma3").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn shape_and_layer_kinds_from_the_file() {
    let (m, t) = model();
    let s = m.spec();
    assert_eq!(
        (
            s.n_layers,
            s.n_q_heads,
            s.n_kv_heads,
            s.head_dim,
            s.max_seq_len
        ),
        (18, 4, 1, 256, 32768)
    );
    let global: Vec<usize> = s.global_layers();
    assert_eq!(global, vec![5, 11, 17]);
    assert!(
        (0..18)
            .filter(|l| !global.contains(l))
            .all(|l| s.window(l) == Some(512))
    );
    assert_eq!(t.vocab_size(), 262144);
    assert_eq!(m.describe()["architecture"], "gemma3");
    // Every block's `[q; k; v]` and `[gate; up]` stacks read their parts
    // where the file keeps them (apart: 38,522,880 bytes if copied).
    assert_eq!(m.describe()["weight_heap_bytes"], 0);
}

/// Token ids identical to llama.cpp's `llama-tokenize` on texts with spaces,
/// tabs, newline runs, Unicode, emoji, digits, tags and a whole essay.
#[test]
fn tokenizer_matches_llama_cpp() {
    let (_, t) = model();
    let r = reference("llamacpp.json");
    for case in r["tokenize"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(t.encode(text).unwrap(), ids(&case["ids"]), "text {text:?}");
    }
    let essay = std::fs::read_to_string(
        root()
            .join("assets/paul_graham")
            .join(r["text_ids"]["text"].as_str().unwrap()),
    )
    .unwrap();
    assert_eq!(t.encode(&essay).unwrap(), ids(&r["text_ids"]["ids"]));
    // Decoding gives the text back (byte-fallback pieces fuse into UTF-8).
    let s = "Unicode: café, 東京, emoji 🙂, tabs\tand  spaces";
    let e = t.encode(s).unwrap();
    assert_eq!(t.decode(&e[1..]).unwrap(), s);
}

/// Q5_0, Q4_K, Q6_K and Q8_0 rows dequantize to gguf-py's values.
#[test]
fn k_quant_rows_match_gguf_py() {
    let g = Gguf::open(&model_path()).unwrap();
    let r = reference("dequant_golden.json");
    let mut types = std::collections::BTreeSet::new();
    for (name, want) in r.as_object().unwrap() {
        let t = g.tensor(name).unwrap();
        types.insert(format!("{:?}", t.dtype));
        let cols = want["shape"][1].as_u64().unwrap() as usize;
        let rb = t.dtype.row_bytes(cols);
        let bytes = g.blob(t);
        for (row, w) in want["rows"].as_object().unwrap() {
            let row: usize = row.parse().unwrap();
            let mut out = vec![0.0f32; cols];
            dequantize_row(t.dtype, &bytes.bytes()[row * rb..(row + 1) * rb], &mut out);
            for (a, b) in out.iter().zip(w["first8"].as_array().unwrap()) {
                let b = b.as_f64().unwrap();
                assert!(
                    (*a as f64 - b).abs() <= 1e-6 * b.abs().max(1e-3),
                    "{name}[{row}]: {a} vs {b}"
                );
            }
            let sum: f64 = out.iter().map(|&x| x as f64).sum();
            let sq: f64 = out.iter().map(|&x| (x as f64).powi(2)).sum();
            assert!(
                (sum - w["sum"].as_f64().unwrap()).abs() < 1e-4,
                "{name}[{row}] sum {sum}"
            );
            assert!(
                (sq / w["sum_sq"].as_f64().unwrap() - 1.0).abs() < 1e-5,
                "{name}[{row}] sum_sq {sq}"
            );
        }
    }
    assert_eq!(
        types.into_iter().collect::<Vec<_>>(),
        ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    );
}

/// llama-perplexity's protocol on the same text: within 0.5% of llama.cpp
/// computing the same function (weights dequantized to F32, f32 KV cache),
/// and of the float64 numpy forward.
#[test]
fn perplexity_matches_llama_cpp_and_numpy() {
    let (m, t) = model();
    let r = reference("llamacpp.json");
    let p = &r["perplexity"];
    let text = std::fs::read_to_string(
        root()
            .join("assets/paul_graham")
            .join(p["text"].as_str().unwrap()),
    )
    .unwrap();
    let ids = t.encode(&text).unwrap();
    let ctx = p["ctx"].as_u64().unwrap() as usize;
    let chunks = p["chunks"].as_u64().unwrap() as usize;
    let got =
        minikv_models::perplexity_chunked(m, || Ok(full_cache(m)), &ids, ctx, Some(chunks), t.bos)
            .unwrap();
    let exact = p["exact"]["ppl"].as_f64().unwrap();
    assert!(
        (got.ppl / exact - 1.0).abs() < 0.005,
        "ppl {} vs llama.cpp {exact}",
        got.ppl
    );
    let numpy = reference("reference.json")["perplexity"]["ppl"]
        .as_f64()
        .unwrap();
    assert!(
        (got.ppl / numpy - 1.0).abs() < 1e-3,
        "ppl {} vs numpy {numpy}",
        got.ppl
    );
}

/// Greedy continuations (32 tokens) identical to llama.cpp's on the same
/// weights; top logits of the prompts equal the numpy forward's.
#[test]
fn greedy_continuations_and_logits_match_references() {
    let (m, t) = model();
    let r = reference("llamacpp.json");
    for g in r["greedy"].as_array().unwrap() {
        let prompt = g["prompt"].as_str().unwrap();
        let n = g["tokens"].as_u64().unwrap() as usize;
        let ids = t.encode(prompt).unwrap();
        let mut cache = full_cache(m);
        let out = minikv_models::generate(
            m,
            t,
            cache.as_mut(),
            &ids,
            n,
            SamplingConfig::default(),
            |_| {},
        )
        .unwrap();
        assert_eq!(out.tokens.len(), n);
        assert_eq!(out.text, g["exact"].as_str().unwrap(), "prompt {prompt:?}");
    }
    let np = reference("reference.json");
    for p in np["prompts"].as_array().unwrap() {
        let want = ids(&p["ids"]);
        assert_eq!(t.encode(p["prompt"].as_str().unwrap()).unwrap(), want);
        let l = m
            .forward(
                &want,
                full_cache(m).as_mut(),
                &mut Workspace::default(),
                Logits::Last,
            )
            .unwrap();
        for pair in p["top"].as_array().unwrap() {
            let (id, v) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap(),
            );
            assert!(
                (l[id] as f64 - v).abs() < 2e-3,
                "{:?}: logit {id} {} vs {v}",
                p["prompt"],
                l[id]
            );
        }
        assert_eq!(
            minikv_models::argmax(&l) as u64,
            p["top"][0][0].as_u64().unwrap()
        );
    }
}

/// A prompt longer than the window: sliding layers hold exactly their last
/// 512 tokens, compression (SnapKV) applies to the three global layers only,
/// and decode stays finite.
#[test]
fn sliding_layers_are_rings_and_compression_governs_global_layers() {
    let (m, t) = model();
    let text = std::fs::read_to_string(root().join("assets/paul_graham/addiction.txt")).unwrap();
    let ids = &t.encode(&text).unwrap()[..900];
    let cfg = RunConfig::parse(
        "[cache]\nheavy = 0.25\nrecent_tokens = 32\nscorer = { type = \"snapkv\" }\n",
        false,
    )
    .unwrap();
    let mut ws = Workspace::default();
    for (name, cc) in [("full", CacheConfig::default()), ("snapkv", cfg.cache)] {
        let mut cache = CacheBuilder::new(m.spec()).build(&cc).unwrap();
        m.forward(ids, cache.as_mut(), &mut ws, Logits::None)
            .unwrap();
        minikv_models::finish_prefill(m, cache.as_mut(), ids, &mut ws).unwrap();
        let l = m
            .forward(&[ids[0]], cache.as_mut(), &mut ws, Logits::Last)
            .unwrap();
        assert!(l.iter().all(|x| x.is_finite()));
        let mem = cache.memory();
        for (i, layer) in mem.layers.iter().enumerate() {
            let held = layer.heads[0].tokens;
            match m.spec().window(i) {
                Some(w) => assert_eq!((layer.window, held), (Some(w), w), "{name} layer {i}"),
                None if name == "full" => assert_eq!(held, 901, "layer {i}"),
                None => assert!(held < 300, "{name} layer {i} holds {held}"),
            }
        }
        let budgets = cache.budgets();
        if name == "snapkv" {
            assert_eq!(budgets.len(), 18);
            assert_eq!(budgets[0].recent, 512);
        }
        // Full cache of this model: 15 rings of 512 + 3 global layers of 901.
        assert_eq!(mem.full_fp16_bytes, 2 * 2 * 256 * (15 * 512 + 3 * 901));
    }
}

/// Streamed text is the whole decode for Gemma's byte-fallback pieces too
/// (characters outside the vocabulary arrive as `<0xXX>` bytes over several
/// tokens).
#[test]
fn streamed_deltas_are_the_whole_decode() {
    let (_, t) = model();
    let text = "Ünïcödé 🦀🧬 ꙮ 𓂀 漢字 \t\n  x";
    let (streamed, whole) = minikv_test_support::streamed_and_whole(t, text);
    assert_eq!(streamed, whole);
}
