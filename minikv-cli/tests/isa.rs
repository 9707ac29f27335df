//! `MINIKV_MAX_ISA`: the 256-bit kernels a CPU without AVX-512 runs give
//! the real model's results bitwise (on a CPU with AVX-512 this is the one
//! end-to-end run of those kernels), and an unknown cap is refused.

use minikv_test_support::root;

/// Runs the binary with `MINIKV_MAX_ISA` set to `cap` (unset for `None`);
/// returns (exit code, stdout, stderr).
fn run(cap: Option<&str>, args: &[&str]) -> (i32, String, String) {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_minikv"));
    c.args(args).current_dir(root());
    match cap {
        Some(v) => c.env("MINIKV_MAX_ISA", v),
        None => c.env_remove("MINIKV_MAX_ISA"),
    };
    let o = c.output().expect("minikv starts");
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (o.status.code().unwrap_or(-1), s(&o.stdout), s(&o.stderr))
}

/// The JSON result without what differs between runs by design.
fn result(cap: Option<&str>, args: &[&str]) -> (serde_json::Value, Option<String>) {
    let (code, out, err) = run(cap, args);
    assert_eq!(code, 0, "minikv {args:?} (cap {cap:?}): {err}");
    let mut v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let p = v["provenance"].as_object_mut().expect("a provenance");
    let isa = p.remove("max_isa").map(|s| s.as_str().unwrap().to_string());
    p.remove("git_rev");
    let o = v.as_object_mut().unwrap();
    o.retain(|k, _| !k.ends_with("_s") && !k.ends_with("_per_s"));
    (v, isa)
}

/// `minikv args` gives the same JSON capped at AVX2 as on every kernel the
/// CPU has, and only the capped result names the cap in its provenance.
fn assert_capped_is_native(args: &[&str]) {
    let (native, none) = result(None, args);
    let (avx2, cap) = result(Some("avx2"), args);
    assert_eq!(none, None);
    assert_eq!(cap.as_deref(), Some("avx2"));
    assert_eq!(avx2, native, "minikv {args:?}");
}

/// `perplexity` of the bundled essays' first 200 tokens, 100 prefilled.
const PERPLEXITY: [&str; 7] = [
    "perplexity",
    "--text",
    "assets/paul_graham",
    "--tokens",
    "200",
    "--prefill",
    "100",
];

#[test]
fn an_unknown_cap_is_refused_by_name() {
    let (code, _, err) = run(Some("avx512"), &["components"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("MINIKV_MAX_ISA") && err.contains("avx512"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Gemma 3 (`Q5_0`, `Q4_K`, `Q6_K` and `Q8_0` weights): perplexity with a
/// 100-token prompt and 100 decode steps, exact and with 8-bit
/// activations, and 24 greedy tokens, each the same bits capped at AVX2 as
/// on every kernel the CPU has; the capped result says so in its
/// provenance.
#[test]
fn gemma3_on_the_avx2_kernels_gives_the_native_bits() {
    let ppl = |act: &'static str| {
        let mut a = PERPLEXITY.to_vec();
        a.extend(["--model", "gemma3-270m", "--activations", act, "--json"]);
        a
    };
    let greedy = vec![
        "generate",
        "--model",
        "gemma3-270m",
        "--prompt",
        "The three laws of thermodynamics are",
        "--max-tokens",
        "24",
        "--json",
    ];
    for args in [ppl("f32"), ppl("q8"), greedy] {
        assert_capped_is_native(&args);
    }
}

/// SmolLM2 (`Q4_1` weights, the `Q8_0` head: on AVX2 their rows go four /
/// two at a time against one input): perplexity with a full cache and with
/// MiniKV, exact, the same bits capped at AVX2 as on every kernel the CPU
/// has.
#[test]
fn smollm2_on_the_avx2_kernels_gives_the_native_bits() {
    for cfg in ["configs/full.toml", "configs/minikv.toml"] {
        let mut args = PERPLEXITY.to_vec();
        args.extend(["--config", cfg, "--json"]);
        assert_capped_is_native(&args);
    }
}

/// A timing says which kernels it ran on: `bench decode`'s JSON carries
/// `max_isa`, `avx2` under the cap and `native` without it.
#[test]
fn bench_results_name_the_kernels_they_timed() {
    let args = [
        "bench", "decode", "--depth", "0", "--tokens", "2", "--runs", "1", "--json",
    ];
    for (cap, want) in [(None, "native"), (Some("avx2"), "avx2")] {
        let (code, out, err) = run(cap, &args);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        assert_eq!(v["max_isa"], want, "{out}");
    }
}
