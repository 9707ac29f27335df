//! `minikv serve` and `minikv bench serve` end to end: the binary on the
//! real model, listening on a free loopback port; a greedy completion equals
//! `minikv generate`, the load generator drives it, SIGTERM shuts it down
//! cleanly, concurrent requests on the CUDA backend (under its CPU
//! emulation) are batched and each equals `minikv generate` alone, and bad
//! flags are refused with the reason.

use minikv_test_support::{root, run_in_root};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

fn minikv(args: &[&str]) -> (bool, String, String) {
    let r = run_in_root(env!("CARGO_BIN_EXE_minikv"), args);
    (r.code == 0, r.stdout, r.stderr)
}

/// Kills the server if a check fails first.
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `minikv serve` with `args` on a free port; returns it and its URL.
fn serve(args: &[&str]) -> (Serve, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_minikv"))
        .arg("serve")
        .args(args)
        .args(["--port", "0"])
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let server = Serve(child);
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    (server, url)
}

fn post(url: &str, body: serde_json::Value) -> serde_json::Value {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            reqwest::Client::new()
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap()
        })
}

#[test]
fn serve_answers_like_generate_and_bench_serve_drives_it() {
    let (server, url) = serve(&["--config", "configs/kivi-2bit.toml", "--kv-budget", "64MiB"]);
    let prompt = "The history of the printing press";
    let v = post(
        &url,
        serde_json::json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}),
    );
    let g = generate_json("configs/kivi-2bit.toml", prompt, 16);
    assert_eq!(v["choices"][0]["text"], g["text"]);
    assert!(v["usage"]["kv_bytes"].as_u64().unwrap() > 0);
    // The load generator against it: every request answered, every token counted.
    let (ok, out, err) = minikv(&[
        "bench",
        "serve",
        "--url",
        &url,
        "--clients",
        "4",
        "--requests",
        "6",
        "--prompt",
        "40",
        "--gen",
        "8",
        "--json",
        "--label",
        "t",
    ]);
    assert!(ok, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (r["ok"].as_u64(), r["errors"].as_u64()),
        (Some(6), Some(0)),
        "{r}"
    );
    assert_eq!(r["generated_tokens"], 48);
    assert!(r["ttft_p50_s"].as_f64().unwrap() > 0.0 && r["mean_kv_bytes"].as_f64().unwrap() > 0.0);
    // SIGTERM: a clean shutdown.
    let mut server = server;
    let pid = server.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = server.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

/// Many sequences at once on the CUDA backend: the server on
/// `backend = "cuda-emulated"` (the MiniKV preset with a residual of 16
/// tokens, so that codes are written and read by the fused decode) answers three requests
/// sent together, decoding them in the same engine steps (fewer steps than
/// one sequence after another), and each completion is the one `minikv
/// generate` gives alone with that config: the batched host calls into the
/// device (one backend, its scratch and upload queue shared by the
/// sequences' threads) change no result.
#[test]
fn serve_batches_requests_on_the_cuda_emulation_like_generate_alone() {
    let dir = std::env::temp_dir().join(format!("minikv-serve-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("minikv-cuda.toml");
    // The MiniKV preset with a residual of 16 tokens.
    let preset = std::fs::read_to_string(root().join("configs/minikv.toml")).unwrap();
    let body = preset.replace("\nresidual = 128\n", "\nresidual = 16\n");
    assert_ne!(
        body, preset,
        "configs/minikv.toml: no residual line to shorten"
    );
    std::fs::write(&cfg, format!("backend = \"cuda-emulated\"\n{body}")).unwrap();
    let cfg = cfg.to_str().unwrap();
    let (_server, url) = serve(&["--config", cfg, "--kv-budget", "64MiB"]);
    let prompts = [
        "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years presses were running in",
        "Rivers of Europe, from the longest to the shortest, are listed below with their sources, their mouths and the countries they cross on the way to the sea. The first of them, the Volga, rises in the hills northwest of",
        "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations in it, and",
    ];
    let (new, n) = (8, prompts.len());
    let answers: Vec<serde_json::Value> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let url = &url;
                s.spawn(move || {
                    post(
                        url,
                        serde_json::json!({"prompt": p, "max_tokens": new, "temperature": 0}),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (p, v) in prompts.iter().zip(&answers) {
        let g = &generate_json(cfg, p, new);
        assert_eq!(v["choices"][0]["text"], g["text"], "{p}");
        assert_eq!(v["usage"]["completion_tokens"], new, "{v}");
        // Past the residual: the fused decode read 2-bit codes.
        assert!(g["memory"]["quant_codes"].as_u64().unwrap() > 0, "{g}");
    }
    // One after another the requests take n prefill steps and n (new - 1)
    // decode steps; together fewer.
    let metrics = get(&format!("{url}/metrics"));
    let steps: usize = metrics
        .lines()
        .find_map(|l| l.strip_prefix("minikv_engine_steps_total "))
        .unwrap_or_else(|| panic!("no step count in {metrics}"))
        .trim()
        .parse()
        .unwrap();
    assert!(steps < n * new, "{steps} engine steps for {n} requests");
    std::fs::remove_dir_all(&dir).ok();
}

/// `minikv generate --json` with `config`, greedy.
fn generate_json(config: &str, prompt: &str, max: usize) -> serde_json::Value {
    let max = max.to_string();
    let (ok, out, err) = minikv(&[
        "generate",
        "--json",
        "--config",
        config,
        "--prompt",
        prompt,
        "--max-tokens",
        &max,
    ]);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap()
}

fn get(url: &str) -> String {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async { reqwest::get(url).await.unwrap().text().await.unwrap() })
}

#[test]
fn bad_serve_flags_are_refused() {
    let (ok, _, err) = minikv(&["serve", "--kv-budget", "0"]);
    assert!(!ok && err.contains("--kv-budget"), "{err}");
    let (ok, _, err) = minikv(&[
        "serve",
        "--chat-template",
        "/nonexistent/t.jinja",
        "--port",
        "0",
    ]);
    assert!(!ok && err.contains("/nonexistent/t.jinja"), "{err}");
    let (ok, _, err) = minikv(&["bench", "serve", "--url", "http://192.0.2.1:8080"]);
    assert!(!ok && err.contains("loopback only"), "{err}");
    let (ok, _, err) = minikv(&["bench", "serve", "--url", "not a url"]);
    assert!(!ok && err.contains("--url"), "{err}");
    // A port in use.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let (ok, _, err) = minikv(&["serve", "--port", &port]);
    assert!(!ok && err.contains("cannot listen"), "{err}");
}
