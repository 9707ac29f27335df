//! Tests on the real SmolLM2-135M-Instruct (fetched by scripts/fetch-assets.sh),
//! against reference/smollm2_reference.json, produced by an independent numpy
//! implementation (reference/reference_logits.py).

use minikv_core::KvCache;
use minikv_models::{Llama, Logits, SamplingConfig, Workspace, generate, perplexity};
use minikv_policies as _;
use minikv_quant as _;
use minikv_test_support::{
    cache_from, full_cache, root, smollm2 as model, smollm2_path as model_path,
};

fn reference() -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(root().join("reference/smollm2_reference.json")).unwrap(),
    )
    .unwrap()
}

/// The forward pass reads `[q; k; v]` and `[gate; up]` as one matrix each,
/// and holds no copy of them: the stacks read their parts where the file
/// keeps them, though SmolLM2's tensors are in name order (`ffn_gate` and
/// `ffn_up` are adjacent; `attn_k`, `attn_output`, `attn_q`, `attn_v` are
/// not, so a stack that copied would hold 30 x 960 rows of 360 bytes).
#[test]
fn stacked_projections_hold_no_copy() {
    let g = minikv_models::gguf::Gguf::open(&model_path()).unwrap();
    let mut apart = 0;
    for i in 0..30 {
        for group in [&["attn_q", "attn_k", "attn_v"][..], &["ffn_gate", "ffn_up"]] {
            let t: Vec<_> = group
                .iter()
                .map(|s| g.tensor(&format!("blk.{i}.{s}.weight")).unwrap())
                .collect();
            if !t.windows(2).all(|w| w[0].offset + w[0].size == w[1].offset) {
                apart += t.iter().map(|t| t.size).sum::<usize>();
            }
        }
    }
    assert_eq!(apart, 30 * 960 * 360);
    let (model, _) = model();
    assert_eq!(model.describe()["weight_heap_bytes"], 0);
    let m = model
        .as_any()
        .downcast_ref::<Llama>()
        .expect("a llama model");
    assert_eq!(m.weight_heap_bytes(), 0);
}

#[test]
fn loads_with_the_documented_shape() {
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
        (30, 9, 3, 64, 8192)
    );
    let m = m.as_any().downcast_ref::<Llama>().expect("a llama model");
    assert_eq!((m.cfg.hidden, m.cfg.ffn, m.cfg.vocab), (576, 1536, 49152));
    assert_eq!(m.cfg.rope_base, 100000.0);
    assert!(m.lm_head.is_none(), "output head is tied to token_embd");
    assert_eq!(t.vocab_size(), 49152);
    assert!(!t.add_bos);
}

#[test]
fn tokenizer_matches_reference_ids_and_round_trips() {
    let (_, t) = model();
    for p in reference()["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = p["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let text = p["prompt"].as_str().unwrap();
        assert_eq!(t.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
    for s in [
        "naïve café — 東京 🚀",
        "12345 + 678 = 13023",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        assert_eq!(t.decode(&t.encode(s).unwrap()).unwrap(), s);
    }
    // Digits are split one by one; special tokens are single ids.
    assert_eq!(t.encode("2024").unwrap().len(), 4);
    assert_eq!(t.encode("<|im_start|>").unwrap(), vec![1]);
    assert!(
        t.chat_prompt("Hi")
            .unwrap()
            .starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    );
}

#[test]
fn logits_match_the_independent_reference() {
    let (m, _) = model();
    let r = reference();
    let stride = r["stride"].as_u64().unwrap() as usize;
    for p in r["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = p["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let lg = m
            .forward(
                &ids,
                full_cache(m).as_mut(),
                &mut Workspace::default(),
                Logits::Last,
            )
            .unwrap();
        let mut worst = 0.0f64;
        for pair in p["top"].as_array().unwrap() {
            let (id, v) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap(),
            );
            worst = worst.max((lg[id] as f64 - v).abs());
        }
        for (i, v) in p["strided"].as_array().unwrap().iter().enumerate() {
            worst = worst.max((lg[i * stride] as f64 - v.as_f64().unwrap()).abs());
        }
        assert!(
            worst <= 1e-3,
            "{:?}: max abs logit difference {worst}",
            p["prompt"]
        );
        let top0 = p["top"][0][0].as_u64().unwrap() as u32;
        assert_eq!(minikv_models::argmax(&lg), top0);
    }
}

#[test]
fn greedy_continuation_is_paris() {
    let (m, t) = model();
    let ids = t.encode("The capital of France is").unwrap();
    let g = generate(
        m,
        t,
        full_cache(m).as_mut(),
        &ids,
        3,
        SamplingConfig::default(),
        |_| {},
    )
    .unwrap();
    assert!(g.text.starts_with(" Paris."), "{:?}", g.text);
}

#[test]
fn perplexity_matches_the_reference() {
    let (m, t) = model();
    let r = &reference()["perplexity"];
    let text = std::fs::read_to_string(
        root()
            .join("assets/paul_graham")
            .join(r["file"].as_str().unwrap()),
    )
    .unwrap();
    let ids: Vec<u32> = t.encode(&text).unwrap()[..512].to_vec();
    let first: Vec<u32> = r["first_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(&ids[..16], &first[..]);
    let p = perplexity(m, full_cache(m).as_mut(), &ids, 512, |_| {}).unwrap();
    let want = r["ppl"].as_f64().unwrap();
    assert!(
        (p.ppl - want).abs() / want < 1e-4,
        "ppl {} vs reference {want}",
        p.ppl
    );
}

/// A compression config that evicts nothing (budget covers the prompt) gives
/// exactly the full cache's generation.
#[test]
fn no_evict_config_generates_like_the_full_cache() {
    let (m, t) = model();
    let ids = t
        .encode(&t.chat_prompt("Name three colors.").unwrap())
        .unwrap();
    let run = |c: &mut dyn KvCache| {
        generate(
            m,
            t,
            c,
            &ids,
            24,
            SamplingConfig {
                temperature: 0.8,
                top_p: 0.9,
                seed: 7,
            },
            |_| {},
        )
        .unwrap()
        .tokens
    };
    let full = run(full_cache(m).as_mut());
    let keep_all = run(cache_from(
        m,
        "[cache]\nheavy = 1.0\nrecent = 0.0\nscorer = { type = \"cumulative_attention\" }",
    )
    .as_mut());
    let snap_all = run(cache_from(
        m,
        "[cache]\nheavy_tokens = 4096\nrecent_tokens = 32\nscorer = { type = \"snapkv\" }",
    )
    .as_mut());
    assert_eq!(full, keep_all);
    assert_eq!(full, snap_all);
    // Seeded sampling is reproducible.
    assert_eq!(full, run(full_cache(m).as_mut()));
}

/// Compression frees real memory and keeps the model usable.
#[test]
fn minikv_compresses_and_stays_close() {
    let (m, t) = model();
    let text = std::fs::read_to_string(root().join("assets/paul_graham/addiction.txt")).unwrap();
    let ids: Vec<u32> = t.encode(&text).unwrap()[..320].to_vec();
    let full = perplexity(m, full_cache(m).as_mut(), &ids, 256, |_| {}).unwrap();
    let mut c = cache_from(
        m,
        &std::fs::read_to_string(root().join("configs/minikv.toml")).unwrap(),
    );
    let mk = perplexity(m, c.as_mut(), &ids, 256, |_| {}).unwrap();
    let mem = c.memory();
    let used = mem.used_bytes() as f64 / mem.full_fp16_bytes as f64;
    assert!(used < 0.5, "MiniKV keeps {used:.3} of the fp16 bytes");
    // Allocated adds less than one page of growth per store (the fp16
    // residual's page is capped at R + 1 rows).
    assert!(mem.ratio() < 0.8, "allocated {:.3}", mem.ratio());
    assert!(mem.sum(|h| h.quant_codes) > 0);
    let (f, k) = (full.decode_nll.unwrap(), mk.decode_nll.unwrap());
    assert!(
        k > f - 0.05 && k < f + 0.5,
        "decode nll full {f} vs minikv {k}"
    );
}

#[test]
fn prompt_longer_than_the_context_is_an_error() {
    let (m, _) = model();
    let ids = vec![42u32; 8193];
    let e = m
        .forward(
            &ids,
            full_cache(m).as_mut(),
            &mut Workspace::default(),
            Logits::Last,
        )
        .unwrap_err();
    assert!(e.to_string().contains("exceeds the maximum of 8192"), "{e}");
    let e = m
        .forward(
            &[49152],
            full_cache(m).as_mut(),
            &mut Workspace::default(),
            Logits::Last,
        )
        .unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
}

#[test]
fn truncated_or_corrupt_gguf_is_a_clear_error() {
    let bytes = std::fs::read(model_path()).unwrap();
    let dir = std::env::temp_dir().join(format!("minikv-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (bytes[..50_000_000].to_vec(), "past the end of the file"),
        (bytes[..1_000_000].to_vec(), "exceeds the"),
        (bytes[..100].to_vec(), "more than the file can hold"),
        (bytes[..20].to_vec(), "truncated file"),
        (
            [b"GGUX".as_slice(), &bytes[4..4096]].concat(),
            "not a GGUF file",
        ),
        (
            {
                let mut b = bytes[..4096].to_vec();
                b[4] = 9;
                b
            },
            "unsupported GGUF version 9",
        ),
        (
            {
                let mut b = bytes[..4096].to_vec();
                b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
                b
            },
            "metadata entries",
        ),
    ];
    // Unsupported architecture: the metadata string "llama" patched to "gemma".
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 8;
    assert_eq!(&bytes[at..at + 5], b"llama");
    let mut arch = bytes.clone();
    arch[at..at + 5].copy_from_slice(b"gemma");
    // Unsupported tensor type: the first tensor's type id (after its name and dims) set to 10 (Q2_K).
    let name = b"token_embd.weight";
    let t = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let mut q2k = bytes[..2_000_000].to_vec();
    let ty = t + 4 + 2 * 8; // n_dims (u32) + 2 dims (u64)
    assert_eq!(u32::from_le_bytes(q2k[ty..ty + 4].try_into().unwrap()), 8); // Q8_0
    q2k[ty..ty + 4].copy_from_slice(&10u32.to_le_bytes());
    let cases: Vec<(Vec<u8>, &str)> = cases
        .into_iter()
        .chain([
            (
                arch,
                "unsupported architecture `gemma` (supported: gemma3, llama)",
            ),
            (q2k, "unsupported tensor type id 10"),
        ])
        .collect();
    for (i, (b, want)) in cases.iter().enumerate() {
        let p = dir.join(format!("bad{i}.gguf"));
        std::fs::write(&p, b).unwrap();
        let e = minikv_models::load(&p).unwrap_err().to_string();
        assert!(e.contains(want), "case {i}: {e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The safetensors loader (HF layout, halves RoPE) gives the GGUF logits.
#[test]
fn safetensors_export_loads_to_the_same_logits() {
    let (m, t) = model();
    let dir = std::env::temp_dir().join(format!("minikv-hf-{}", std::process::id()));
    let llama = m.as_any().downcast_ref::<Llama>().unwrap();
    minikv_models::export_hf(llama, t, &dir).unwrap();
    let (hf, ht) = minikv_models::load(&dir).unwrap();
    let hf_llama = hf.as_any().downcast_ref::<Llama>().unwrap();
    assert_eq!(hf_llama.cfg.rope, minikv_models::RopeLayout::Halves);
    let ids = t.encode("The capital of France is").unwrap();
    assert_eq!(ht.encode("The capital of France is").unwrap(), ids);
    let a = m
        .forward(
            &ids,
            full_cache(m).as_mut(),
            &mut Workspace::default(),
            Logits::Last,
        )
        .unwrap();
    let b = hf
        .forward(
            &ids,
            full_cache(hf.as_ref()).as_mut(),
            &mut Workspace::default(),
            Logits::Last,
        )
        .unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    std::fs::remove_dir_all(&dir).ok();
    assert!(worst < 1e-3, "max abs logit difference {worst}");
}

/// Streamed text is the whole decode: the detokenizer's deltas, token by
/// token, concatenate to `decode(all)`, through multi-byte characters split
/// over tokens (emoji, CJK), digits, newlines and runs of spaces.
#[test]
fn streamed_deltas_are_the_whole_decode() {
    let (_, t) = model();
    let text = "Hello   wörld 🦀🎉 漢字かな 12345\n\n\tend. «quoted» — done";
    let (streamed, whole) = minikv_test_support::streamed_and_whole(t, text);
    assert_eq!(streamed, whole);
    assert!(streamed.contains("🦀🎉 漢字かな"), "{streamed:?}");
}
