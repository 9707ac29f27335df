//! The server over real HTTP on the real SmolLM2 (started on a free
//! loopback port): greedy and seeded answers equal `generate` alone, streams
//! equal whole answers, stop strings, logprobs against the model's own
//! distribution, many concurrent clients under a tight KV budget,
//! disconnects free their sequence, and every bad input gets a 4xx with an
//! OpenAI-style body naming the problem.

use minikv_core::{CacheBuilder, RunConfig};
use minikv_engine::EngineConfig;
use minikv_models::{LanguageModel, Logits, SamplingConfig, Tokenizer, Workspace, generate};
use minikv_policies as _;
use minikv_quant as _;
use minikv_server::{Server, ServerConfig};
use minikv_test_support::{preset, smollm2_path as model_path};
use serde_json::{Value, json};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The reference: the model loaded on its own, outside the server.
fn reference() -> &'static (Box<dyn LanguageModel>, Tokenizer) {
    static M: OnceLock<(Box<dyn LanguageModel>, Tokenizer)> = OnceLock::new();
    M.get_or_init(|| minikv_models::load(&model_path()).expect("model loads"))
}

fn config(name: &str) -> RunConfig {
    preset(name)
}

/// A full-cache budget for about `n` sequences of 300 tokens.
fn budget_for(n: usize) -> usize {
    let (m, _) = reference();
    n * m.spec().full_fp16_bytes(300)
}

fn start(cfg_name: &str, budget: usize) -> Server {
    let (model, tok) = minikv_models::load(&model_path()).unwrap();
    let cfg = config(cfg_name);
    let builder = CacheBuilder::new(model.spec());
    let scfg = ServerConfig {
        model_name: "smollm2".into(),
        engine: EngineConfig {
            kv_budget: budget,
            ..EngineConfig::default()
        },
        default_max_tokens: 24,
        max_body_bytes: 64 << 10,
        seed: 7,
        keep_alive: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    Server::start(model, tok, builder, cfg.cache, scfg, "127.0.0.1:0").unwrap()
}

/// One MiniKV server shared by the tests (a budget for 6 full sequences).
fn server() -> String {
    static S: OnceLock<Server> = OnceLock::new();
    let s = S.get_or_init(|| start("minikv.toml", budget_for(6)));
    format!("http://{}", s.addr())
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn post(url: &str, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The data lines of a server-sent-event stream, parsed (`[DONE]` kept as a string).
async fn stream(url: &str, path: &str, body: Value) -> Vec<Value> {
    let r = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = r.text().await.unwrap();
    text.split("\n\n")
        .filter_map(|ev| {
            ev.lines()
                .find_map(|l| l.strip_prefix("data: "))
                .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.into())))
        })
        .collect()
}

/// `generate` alone through the config's cache.
fn alone(
    cfg_name: &str,
    prompt: &[u32],
    max: usize,
    sampling: SamplingConfig,
    stop: bool,
) -> (String, usize) {
    let (m, tok) = reference();
    let cfg = config(cfg_name);
    let mut cache = CacheBuilder::new(m.spec()).build(&cfg.cache).unwrap();
    let mut t = tok.clone();
    if !stop {
        t.stop.clear();
    }
    let g = generate(
        m.as_ref(),
        &t,
        cache.as_mut(),
        prompt,
        max,
        sampling,
        |_| {},
    )
    .unwrap();
    (g.text, g.tokens.len())
}

const PROMPTS: [&str; 4] = [
    "The history of the printing press",
    "A recipe for bread: first,",
    "Rivers of Europe include",
    "In 1969, the first people to walk on the Moon",
];

#[test]
fn greedy_completions_and_chat_equal_generate_alone() {
    let url = server();
    let (_, tok) = reference();
    rt().block_on(async {
        for p in PROMPTS {
            let (st, v) = post(&url, "/v1/completions", json!({"prompt": p, "max_tokens": 20, "temperature": 0})).await;
            assert_eq!(st, 200, "{v}");
            let want = alone("minikv.toml", &tok.encode(p).unwrap(), 20, SamplingConfig::default(), true);
            assert_eq!(v["choices"][0]["text"], want.0, "{p}");
            assert_eq!(v["usage"]["completion_tokens"], want.1);
            assert_eq!(v["usage"]["prompt_tokens"], tok.encode(p).unwrap().len());
            assert_eq!(v["object"], "text_completion");
            let u = &v["usage"];
            let kv = u["kv_bytes"].as_f64().unwrap();
            assert!(kv > 0.0 && (u["kv_ratio_to_fp16"].as_f64().unwrap() - kv / u["kv_fp16_bytes"].as_f64().unwrap()).abs() < 1e-12);
        }
        let q = "Name three rivers.";
        let (st, v) = post(&url, "/v1/chat/completions", json!({"model": "smollm2", "messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0})).await;
        assert_eq!(st, 200, "{v}");
        let ids = tok.encode(&tok.chat_prompt(q).unwrap()).unwrap();
        let want = alone("minikv.toml", &ids, 24, SamplingConfig::default(), true);
        assert_eq!(v["choices"][0]["message"]["content"], want.0);
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["object"], "chat.completion");
    });
}

#[test]
fn streams_equal_whole_answers_and_seeds_reproduce() {
    let url = server();
    let (_, tok) = reference();
    rt().block_on(async {
        let body = json!({"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 1234});
        let (_, whole) = post(&url, "/v1/completions", body.clone()).await;
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let evs = stream(&url, "/v1/completions", sb).await;
        assert_eq!(evs.last().unwrap(), "[DONE]");
        let text: String = evs.iter().filter_map(|e| e["choices"].get(0)?["text"].as_str()).collect();
        assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
        let usage = &evs[evs.len() - 2];
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], whole["usage"]["completion_tokens"]);
        let reason = evs.iter().filter_map(|e| e["choices"].get(0)?["finish_reason"].as_str()).collect::<Vec<_>>();
        assert_eq!(reason, vec![whole["choices"][0]["finish_reason"].as_str().unwrap()]);
        // The seeded sample is `generate`'s with the same seed.
        let s = SamplingConfig { temperature: 0.9, top_p: 0.95, seed: 1234 };
        let want = alone("minikv.toml", &tok.encode(PROMPTS[1]).unwrap(), 24, s, true);
        assert_eq!(text, want.0);
        // Chat streams: a role chunk first, then content deltas.
        let evs = stream(&url, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12, "temperature": 0, "stream": true})).await;
        assert_eq!(evs[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(evs.iter().all(|e| *e == "[DONE]" || e["object"] == "chat.completion.chunk"));
        let (_, whole) = post(&url, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12, "temperature": 0})).await;
        let text: String = evs.iter().filter_map(|e| e["choices"].get(0)?["delta"]["content"].as_str()).collect();
        assert_eq!(text, whole["choices"][0]["message"]["content"].as_str().unwrap());
    });
}

#[test]
fn stop_strings_cut_the_text() {
    let url = server();
    rt().block_on(async {
        let base =
            json!({"prompt": PROMPTS[3], "max_tokens": 40, "temperature": 0, "ignore_eos": true});
        let (_, full) = post(&url, "/v1/completions", base.clone()).await;
        let full = full["choices"][0]["text"].as_str().unwrap().to_owned();
        // A stop string from the middle of the greedy answer.
        let words: Vec<&str> = full.split_whitespace().collect();
        let stop = words[words.len() / 2];
        let cut = &full[..full.find(stop).unwrap()];
        for streamed in [false, true] {
            let mut b = base.clone();
            b["stop"] = json!([stop, "\u{1F600}never"]);
            let text = if streamed {
                b["stream"] = json!(true);
                let evs = stream(&url, "/v1/completions", b).await;
                let fin: Vec<_> = evs
                    .iter()
                    .filter_map(|e| e["choices"].get(0)?["finish_reason"].as_str())
                    .collect();
                assert_eq!(fin, vec!["stop"]);
                evs.iter()
                    .filter_map(|e| e["choices"].get(0)?["text"].as_str())
                    .collect::<String>()
            } else {
                let (_, v) = post(&url, "/v1/completions", b).await;
                assert_eq!(v["choices"][0]["finish_reason"], "stop");
                v["choices"][0]["text"].as_str().unwrap().to_owned()
            };
            assert_eq!(text, cut, "stop {stop:?} in {full:?}");
        }
    });
}

#[test]
fn logprobs_are_the_models_distribution() {
    let url = server();
    let (m, tok) = reference();
    let p = PROMPTS[2];
    // The first token's distribution: the prompt's last logits (the full
    // prefill runs before any compression).
    let ids = tok.encode(p).unwrap();
    let mut cache = CacheBuilder::new(m.spec())
        .build(&RunConfig::default().cache)
        .unwrap();
    let lg = m
        .forward(
            &ids,
            cache.as_mut(),
            &mut Workspace::default(),
            Logits::Last,
        )
        .unwrap();
    let max = lg.iter().copied().fold(f32::MIN, f32::max) as f64;
    let lse = max + lg.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    let mut order: Vec<usize> = (0..lg.len()).collect();
    order.sort_by(|&a, &b| lg[b].total_cmp(&lg[a]).then(a.cmp(&b)));
    rt().block_on(async {
        let (st, v) = post(&url, "/v1/completions", json!({"prompt": p, "max_tokens": 6, "temperature": 0, "logprobs": 3})).await;
        assert_eq!(st, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let first = lp["token_logprobs"][0].as_f64().unwrap();
        assert!((first - (lg[order[0]] as f64 - lse)).abs() < 1e-4, "{first}");
        let top = lp["top_logprobs"][0].as_object().unwrap();
        assert_eq!(top.len(), 3);
        for &i in &order[..3] {
            let want = lg[i] as f64 - lse;
            let got = top[&tok.token_text(i as u32)].as_f64().unwrap();
            assert!((got - want).abs() < 1e-4, "{i}: {got} vs {want}");
        }
        // Greedy: every chosen token is its step's most likely one.
        let n = lp["tokens"].as_array().unwrap().len();
        assert_eq!(n, v["usage"]["completion_tokens"].as_u64().unwrap() as usize);
        for i in 0..n {
            let best = lp["top_logprobs"][i].as_object().unwrap().values().map(|x| x.as_f64().unwrap()).fold(f64::MIN, f64::max);
            assert_eq!(lp["token_logprobs"][i].as_f64().unwrap(), best);
        }
        let offs: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert!(offs.windows(2).all(|w| w[0] <= w[1]) && offs[0] == 0);
        // Chat: per-token entries with bytes and alternatives.
        let (_, v) = post(&url, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "logprobs": true, "top_logprobs": 2})).await;
        let c = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(c.len(), 4.min(v["usage"]["completion_tokens"].as_u64().unwrap() as usize));
        for e in c {
            assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2);
            assert!(e["logprob"].as_f64().unwrap() <= 0.0);
            let bytes: Vec<u8> = e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
            assert_eq!(String::from_utf8(bytes).unwrap(), e["token"].as_str().unwrap());
        }
    });
}

async fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
}

/// A labelled series, 0 before its first sample.
async fn count(url: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Its own server, so other tests' sequences do not blur the counts.
#[test]
fn many_clients_under_a_tight_budget_and_disconnects_free_bytes() {
    let budget = budget_for(3);
    let s = start("full.toml", budget);
    let url = format!("http://{}", s.addr());
    let (_, tok) = reference();
    rt().block_on(async {
        // 12 concurrent clients, a budget for 3 full sequences: all answered,
        // each equal to its greedy answer alone.
        let mut tasks = Vec::new();
        for i in 0..12 {
            let url = url.clone();
            let p = format!("{} (part {i})", PROMPTS[i % 4]);
            tasks.push(tokio::spawn(async move {
                let (st, v) = post(&url, "/v1/completions", json!({"prompt": p, "max_tokens": 10, "temperature": 0})).await;
                (p, st, v)
            }));
        }
        for t in tasks {
            let (p, st, v) = t.await.unwrap();
            assert_eq!(st, 200, "{v}");
            let want = alone("full.toml", &tok.encode(&p).unwrap(), 10, SamplingConfig::default(), true);
            assert_eq!(v["choices"][0]["text"], want.0, "{p}");
        }
        assert!(metric(&url, "minikv_kv_peak_bytes").await <= budget as f64);
        assert_eq!(count(&url, "minikv_requests_total{finish=\"length\"}").await + count(&url, "minikv_requests_total{finish=\"stop\"}").await, 12.0);
        // A client that leaves mid-stream: its sequence ends at once.
        use futures_util::StreamExt;
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": PROMPTS[0], "max_tokens": 600, "temperature": 0, "ignore_eos": true, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let mut body = r.bytes_stream();
        let mut seen = 0;
        while seen < 3 {
            let chunk = body.next().await.unwrap().unwrap();
            seen += String::from_utf8_lossy(&chunk).matches("data: ").count();
        }
        assert_eq!(metric(&url, "minikv_running_sequences").await, 1.0);
        assert!(metric(&url, "minikv_kv_bytes").await > 0.0);
        drop(body);
        let t0 = Instant::now();
        while metric(&url, "minikv_running_sequences").await != 0.0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "the sequence still runs");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(metric(&url, "minikv_kv_bytes").await, 0.0);
        assert_eq!(metric(&url, "minikv_kv_reserved_bytes").await, 0.0);
        assert_eq!(metric(&url, "minikv_requests_total{finish=\"cancelled\"}").await, 1.0);
        // The same for a non-streaming request whose client times out.
        let c = reqwest::Client::builder().timeout(Duration::from_millis(600)).build().unwrap();
        let r = c.post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": PROMPTS[0], "max_tokens": 600, "temperature": 0, "ignore_eos": true}))
            .send()
            .await;
        assert!(r.is_err());
        let t0 = Instant::now();
        while metric(&url, "minikv_requests_total{finish=\"cancelled\"}").await != 2.0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "the non-streaming sequence still runs");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(metric(&url, "minikv_running_sequences").await, 0.0);
        // The server still serves.
        let (st, _) = post(&url, "/v1/completions", json!({"prompt": "Hello", "max_tokens": 2})).await;
        assert_eq!(st, 200);
        for m in ["minikv_kv_budget_bytes", "minikv_waiting_sequences", "minikv_generated_tokens_total", "minikv_time_to_first_token_seconds_count", "minikv_inter_token_latency_seconds_count"] {
            assert!(metric(&url, m).await >= 0.0);
        }
        assert_eq!(metric(&url, "minikv_kv_budget_bytes").await, budget as f64);
    });
    s.shutdown().unwrap();
}

#[test]
fn bad_input_gets_an_openai_error_naming_the_problem() {
    let url = server();
    let big = "a ".repeat(9_000);
    let cases: Vec<(&str, Value, u16, &str, Option<&str>)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "x", "bogus": 1}),
            400,
            "Unrecognized request argument supplied: bogus",
            Some("bogus"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            400,
            "max_tokens must be at least 1",
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 100000}),
            400,
            "maximum context length is 8192",
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": -1}),
            400,
            "temperature must be",
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 1.5}),
            400,
            "top_p must be",
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 9}),
            400,
            "logprobs must be in 0..=5",
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 3}),
            400,
            "n must be 1",
            Some("n"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": [""]}),
            400,
            "must not be empty",
            Some("stop"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [5, -1]}),
            400,
            "outside the vocabulary",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": []}),
            400,
            "the prompt is empty",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"]}),
            400,
            "one prompt per request",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "presence_penalty": 0.5}),
            400,
            "presence_penalty is not supported",
            Some("presence_penalty"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}),
            400,
            "missing field `prompt`",
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "many"}),
            400,
            "invalid type",
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            400,
            "messages must not be empty",
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "unsupported role `wizard`",
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            400,
            "not supported (text only)",
            Some("messages[0].content"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30, "logprobs": true}),
            400,
            "top_logprobs must be in 0..=20",
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
            400,
            "tool calling is not supported",
            Some("tools"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2}),
            400,
            "max_completion_tokens must be at least 1",
            Some("max_completion_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": big}]}),
            400,
            "maximum context length is 8192",
            Some("prompt"),
        ),
    ];
    rt().block_on(async {
        let c = reqwest::Client::new();
        for (path, body, status, msg, param) in cases {
            let (st, v) = post(&url, path, body.clone()).await;
            assert_eq!(
                st,
                status,
                "{}: {v}",
                &body.to_string()[..body.to_string().len().min(200)]
            );
            let e = &v["error"];
            assert!(e["message"].as_str().unwrap().contains(msg), "{body}: {v}");
            assert_eq!(e["type"], "invalid_request_error", "{v}");
            if let Some(p) = param {
                assert_eq!(e["param"], p, "{v}");
            }
        }
        let raw = |path: &'static str, body: Vec<u8>| {
            let c = c.clone();
            let url = url.clone();
            async move {
                let r = c
                    .post(format!("{url}{path}"))
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.json::<Value>().await.unwrap())
            }
        };
        let (st, v) = raw("/v1/completions", b"{\"prompt\": \"x\"".to_vec()).await;
        assert!(
            st == 400
                && v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("EOF while parsing"),
            "{v}"
        );
        let (st, v) = raw("/v1/completions", b"{\"prompt\": \"\xff\xfe\"}".to_vec()).await;
        assert!(
            st == 400
                && v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("not valid UTF-8"),
            "{v}"
        );
        let (st, v) = raw("/v1/completions", vec![b' '; 100 << 10]).await;
        assert!(
            st == 413
                && v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("larger than 65536 bytes"),
            "{v}"
        );
        let r = c.get(format!("{url}/v1/nothing")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 404);
        let r = c.get(format!("{url}/v1/completions")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 405);
        assert_eq!(
            r.json::<Value>().await.unwrap()["error"]["message"],
            "GET is not allowed on /v1/completions"
        );
        // Still serving; models and health answer.
        let (st, _) = post(
            &url,
            "/v1/completions",
            json!({"prompt": "ok", "max_tokens": 1}),
        )
        .await;
        assert_eq!(st, 200);
        let m: Value = c
            .get(format!("{url}/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(m["data"][0]["id"], "smollm2");
        assert_eq!(m["data"][0]["max_model_len"], 8192);
        let h: Value = c
            .get(format!("{url}/health"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(h["status"], "ok");
    });
}

#[test]
fn a_model_without_a_chat_template_says_so() {
    let (model, mut tok) = minikv_models::load(&model_path()).unwrap();
    tok.set_chat_template("{{ raise_exception('this template refuses everything') }}")
        .unwrap();
    let builder = CacheBuilder::new(model.spec());
    let s = Server::start(
        model,
        tok,
        builder,
        RunConfig::default().cache,
        ServerConfig::default(),
        "127.0.0.1:0",
    )
    .unwrap();
    let url = format!("http://{}", s.addr());
    rt().block_on(async {
        let (st, v) = post(
            &url,
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
        assert_eq!(st, 400);
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("this template refuses everything"),
            "{v}"
        );
    });
    // Engine settings are checked at start.
    let (model, tok) = minikv_models::load(&model_path()).unwrap();
    let builder = CacheBuilder::new(model.spec());
    let bad = ServerConfig {
        engine: EngineConfig {
            kv_budget: 0,
            ..EngineConfig::default()
        },
        ..ServerConfig::default()
    };
    let e = Server::start(
        model,
        tok,
        builder,
        RunConfig::default().cache,
        bad,
        "127.0.0.1:0",
    )
    .unwrap_err();
    assert!(e.to_string().contains("kv_budget"), "{e}");
}
