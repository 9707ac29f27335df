//! `minikv serve` and `minikv bench serve` end to end: the binary on the
//! real model, listening on a free loopback port; a greedy completion equals
//! `minikv generate`, the load generator drives it, SIGTERM shuts it down
//! cleanly, and bad flags are refused with the reason.

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
    let mut child = Command::new(env!("CARGO_BIN_EXE_minikv"))
        .args([
            "serve",
            "--config",
            "configs/kivi-2bit.toml",
            "--port",
            "0",
            "--kv-budget",
            "64MiB",
        ])
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
    let prompt = "The history of the printing press";
    let v = post(
        &url,
        serde_json::json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}),
    );
    let (ok, out, err) = minikv(&[
        "generate",
        "--json",
        "--config",
        "configs/kivi-2bit.toml",
        "--prompt",
        prompt,
        "--max-tokens",
        "16",
    ]);
    assert!(ok, "{err}");
    let g: serde_json::Value = serde_json::from_str(&out).unwrap();
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
