//! # minikv-cli
//!
//! The `minikv` command line: run a model through a compressed KV cache chosen
//! by a config file, inspect components, configs, budgets and quantization, and
//! benchmark decode attention. Every `--json` result carries its provenance.
//!
//! ```text
//! minikv generate --chat --prompt "Name three rivers." --config configs/minikv.toml
//! minikv perplexity --text assets/paul_graham/addiction.txt --tokens 1024 --config configs/kivi-2bit.toml --json
//! minikv budgets configs/minikv-pyramid.toml --layers 30 --tokens 2048 --json
//! minikv components --json
//! ```
//!
//! The binary is a thin `main` over this library, so a command can also run
//! in-process (the fuzzers drive every command this way):
//!
//! ```
//! let cfg = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/minikv-pyramid.toml");
//! minikv_cli::run_args(["minikv", "budgets", cfg, "--layers", "4", "--tokens", "256"])?;
//! // Bad input is an error naming the problem, never a panic.
//! let e = minikv_cli::run_args(["minikv", "budgets", cfg, "--tokens", "0"]).unwrap_err();
//! assert!(e.to_string().contains("--tokens"));
//! # Ok::<(), minikv_core::Error>(())
//! ```

#![warn(missing_docs)]

use clap::{Args, Parser, Subcommand};
use minikv_core::{Error, Result};
use std::path::PathBuf;
use std::process::ExitCode;

// typetag registers impls only in binaries that reference their crate.
use minikv_policies as _;
use minikv_quant as _;

mod args;
mod bench;
mod commands;
mod provenance;
mod report;
mod results;
mod serve;
mod sweep;
mod throughput;

/// The command line.
#[derive(Parser)]
#[command(
    name = "minikv",
    version,
    about = "KV-cache compression for LLM inference (MiniKV, KIVI, H2O, SnapKV, ...)"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List every registered component (scorers, policies, selectors, quantizers) with its parameters.
    Components {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Config files.
    Config {
        #[command(subcommand)]
        cmd: ConfigCmd,
    },
    /// Model facts: shape, weight types and bytes, tokenizer.
    Info(ModelArg),
    /// Generate text from a prompt through a (compressed) cache.
    Generate(GenerateArgs),
    /// Prompt token ids and the top-K logits at the last position.
    Logits(LogitsArgs),
    /// Token ids of a text (as the model's tokenizer gives them, BOS included
    /// when the model adds one).
    Tokenize(TokenizeArgs),
    /// Perplexity of a text's first N tokens through a (compressed) cache.
    Perplexity(PplArgs),
    /// Evaluate a cache config against the full cache on the real model.
    Eval(EvalArgs),
    /// Grid of configs x seeds x tasks into a resumable JSONL file.
    Sweep(sweep::SweepArgs),
    /// Tables and plots from sweep results.
    Report(report::ReportArgs),
    /// Quantize rows of a JSON file and show codes, packing, scales, error.
    Quantize(QuantizeArgs),
    /// Per-layer (and per-head) token budgets a config gives.
    Budgets(BudgetsArgs),
    /// Micro-benchmarks.
    Bench {
        #[command(subcommand)]
        cmd: BenchCmd,
    },
    /// An OpenAI-compatible HTTP server (completions, chat, streaming,
    /// metrics) on the batched engine: every request gets its own cache
    /// from the config, admission by KV bytes.
    Serve(serve::ServeArgs),
    /// Per-model calibration files for methods that need one.
    Calibrate {
        #[command(subcommand)]
        cmd: CalibrateCmd,
    },
}

#[derive(Subcommand)]
enum CalibrateCmd {
    /// DuoAttention head pattern: per (layer, KV head) the attention mass that
    /// seeded passkey prompts' last queries put outside the sinks and the
    /// recent window, written as a JSON pattern file for the `duo_attention`
    /// selector.
    Duo(DuoArgs),
    /// Q-Filters: per (layer, KV head) the dominant direction of the model's
    /// post-RoPE queries over text chunks (the queries of a GQA group
    /// stacked), written as a JSON filter file for the `q_filter` scorer.
    Qfilters(QFilterArgs),
    /// LU-KV budget curve: per (layer, KV head) the future utility a
    /// scorer keeps at each budget (the text's own continuation, teacher
    /// forced), split across heads for target ratios 1% to 99%, written as a
    /// JSON curve file for the `lukv` selector.
    Lukv(LuKvArgs),
}

/// `--normalize` of `calibrate lukv`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum LuKvNormalize {
    Layer,
    Head,
    None,
}

impl From<LuKvNormalize> for minikv_eval::lukv::Normalize {
    fn from(n: LuKvNormalize) -> Self {
        match n {
            LuKvNormalize::Layer => Self::Layer,
            LuKvNormalize::Head => Self::Head,
            LuKvNormalize::None => Self::None,
        }
    }
}

#[derive(Args)]
pub(crate) struct LuKvArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Config whose cache scorer (and sinks, recent window, head mode) the
    /// curve is made for; its selector is not used (default: the LU-KV
    /// preset, Expected Attention with epsilon 0.02, 4 sinks, window 1).
    #[arg(long, default_value = "configs/kvpress/lukv.toml")]
    pub config: PathBuf,
    /// Calibration text file or directory (default: the fetched Paul Graham
    /// essays; keep it apart from the texts you evaluate on).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Prompt tokens per chunk (the budget curve is in shares of them).
    #[arg(long, default_value_t = 1024, value_parser = args::tokens)]
    pub context: usize,
    /// Future positions after each prompt whose attention defines the
    /// oracle importance (the text's own continuation).
    #[arg(long, default_value_t = 64, value_parser = args::tokens)]
    pub future: usize,
    /// Chunks: the first `chunks` consecutive `context + future`-token
    /// pieces of the text.
    #[arg(long, default_value_t = 4, value_parser = args::count)]
    pub chunks: usize,
    /// How the oracle importance is scaled before heads are compared:
    /// `layer` (a share of the layer's total: every layer's future output
    /// counts the same), `head` (a share of the head's own), `none` (as
    /// measured).
    #[arg(long, value_enum, default_value_t = LuKvNormalize::Layer)]
    pub normalize: LuKvNormalize,
    /// Output curve file (JSON; written atomically).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args)]
pub(crate) struct QFilterArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Calibration text file or directory (default: the fetched Paul Graham
    /// essays; keep it apart from the texts you evaluate on).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens per chunk (each chunk runs from an empty cache).
    #[arg(long, default_value_t = 1024, value_parser = args::tokens)]
    pub context: usize,
    /// Chunks: the first `chunks` consecutive `context`-token pieces of the
    /// text.
    #[arg(long, default_value_t = 4, value_parser = args::count)]
    pub chunks: usize,
    /// Output filter file (JSON; written atomically).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args)]
pub(crate) struct DuoArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Haystack text file or directory (default: the fetched Paul Graham essays).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 1024, value_parser = args::tokens)]
    pub context: usize,
    /// Prompts.
    #[arg(long, default_value_t = 8, value_parser = args::count)]
    pub trials: usize,
    /// Seed of the prompts (keys, offsets, depths).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Leading tokens a streaming head keeps (the preset's `cache.sinks`).
    #[arg(long, default_value_t = 4, value_parser = args::tokens_or_zero)]
    pub sinks: usize,
    /// Recent tokens a streaming head keeps (the preset's `recent_tokens`).
    #[arg(long, default_value_t = 128, value_parser = args::tokens_or_zero)]
    pub recent: usize,
    /// Final prompt queries measured (the question).
    #[arg(long, default_value_t = 8, value_parser = args::tokens)]
    pub window: usize,
    /// Output pattern file (JSON; written atomically).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Validate a config and print it resolved, defaults filled in.
    Check {
        /// TOML or JSON config.
        file: PathBuf,
        /// Print JSON instead of TOML.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Decode attention per token: full fp16 cache vs fused 2-bit and 4-bit caches.
    Attention(bench::AttentionArgs),
    /// End-to-end decode tokens/s of the real model by context depth (prefill
    /// excluded, warm-up, median of several runs with the spread).
    Decode(bench::DecodeBenchArgs),
    /// Prompt processing tokens/s by prompt length (compression included).
    Prefill(bench::PrefillBenchArgs),
    /// Many sequences at once through the engine (continuous batching,
    /// admission by KV bytes): generated and total tokens/s, decode tokens/s,
    /// concurrency, peak KV bytes, time to first token and inter-token
    /// latency, per config and batch limit.
    Throughput(throughput::ThroughputArgs),
    /// Load test of an OpenAI-compatible server on loopback (`minikv serve`
    /// or llama-server): concurrent streaming clients with token-id prompts;
    /// requests/s, generated tokens/s, time to first token, inter-token
    /// latency.
    Serve(serve::LoadArgs),
}

/// The model to load.
#[derive(Args, Clone)]
pub(crate) struct ModelArg {
    /// GGUF file, Hugging Face directory, or a fetched model's short name:
    /// `smollm2-135m` (the default) or `gemma3-270m`.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Decode matvec activations: `f32` (exact, the default) or `q8`
    /// (8-bit per block of 32 with integer dot products, llama.cpp's
    /// arithmetic, for `Q4_1`, `Q8_0`, `Q5_0`, `Q4_K` and `Q6_K` weights; in
    /// decode and in prefill chunks of at most 32 tokens). Recorded in every
    /// result's provenance.
    #[arg(long, default_value = "f32")]
    pub activations: minikv_models::Activations,
}

#[derive(Args)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Cache config (TOML/JSON); default: full fp16 cache.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 64, value_parser = args::new_tokens)]
    pub max_tokens: usize,
    /// Wrap the prompt in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Sampling temperature: 0 (greedy) or in [0.001, 1000].
    #[arg(long, default_value_t = 0.0, value_parser = args::temperature, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    #[arg(long, default_value_t = 1.0, value_parser = args::top_p, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Seed (default: the config's seed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// JSON output (no streaming).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub(crate) struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Prompt text.
    #[arg(long)]
    pub prompt: String,
    /// How many top logits.
    #[arg(long, default_value_t = 10, value_parser = args::top_k)]
    pub top: usize,
    /// Cache config (prefill attention is exact; the config matters for memory).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub(crate) struct PplArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Text file, or a directory of .txt files (concatenated in name order).
    #[arg(long)]
    pub text: PathBuf,
    /// Number of tokens to evaluate.
    #[arg(long, default_value_t = 512, value_parser = args::tokens)]
    pub tokens: usize,
    /// Tokens prefilled before compression (default: half); the rest are
    /// teacher-forced one per decode step through the compressed cache.
    #[arg(long, value_parser = args::tokens)]
    pub prefill: Option<usize>,
    /// Cache config; default: full fp16 cache.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// llama.cpp's `llama-perplexity` protocol instead: the whole text in
    /// chunks of this many tokens, BOS first, the second half of each chunk
    /// scored (full cache; `--tokens` and `--prefill` do not apply).
    #[arg(long, value_parser = args::tokens, conflicts_with_all = ["prefill", "config"])]
    pub ctx: Option<usize>,
    /// With `--ctx`: at most this many chunks.
    #[arg(long, requires = "ctx", value_parser = args::tokens)]
    pub chunks: Option<usize>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub(crate) struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Text to tokenize.
    #[arg(long, conflicts_with = "text", required_unless_present = "text")]
    pub prompt: Option<String>,
    /// Text file (or a directory of .txt files) to tokenize.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// JSON output (`{"ids": [...], "n": ...}`); default: the ids as one JSON array.
    #[arg(long)]
    pub json: bool,
}

/// Options shared by `eval` and `sweep`.
#[derive(Args, Clone)]
pub(crate) struct TaskOpts {
    /// Text file or directory (default: the fetched Paul Graham essays).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Context (prompt) length in tokens; compression happens after it.
    #[arg(long, default_value_t = 512, value_parser = args::tokens)]
    pub context: usize,
    /// Tokens after the context (perplexity, fidelity, generation, attention-error).
    #[arg(long, default_value_t = 128, value_parser = args::new_tokens)]
    pub tokens: usize,
    /// Trials (passkey) or text windows (other tasks).
    #[arg(long, default_value_t = 1, value_parser = args::count)]
    pub trials: usize,
    /// Question tasks (ruler-*, dataset): prefill the question with the
    /// context before compressing (query-aware). Default: question-agnostic,
    /// the question comes after compression.
    #[arg(long)]
    pub query_aware: bool,
    /// The `dataset` task's JSONL file (context, question, answer_prefix,
    /// answer, max_new_tokens per line).
    #[arg(long, value_name = "FILE.jsonl")]
    pub dataset: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Cache config to evaluate (default: full cache).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Task (with --dataset: `dataset`, the default then).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(minikv_eval::tasks::names()), required_unless_present = "dataset")]
    pub task: Option<String>,
    #[command(flatten)]
    pub opts: TaskOpts,
    /// With a ruler-* task: write the generated rows to FILE.jsonl (the
    /// dataset format) instead of evaluating; `--dataset FILE.jsonl` runs them.
    #[arg(long, value_name = "FILE.jsonl")]
    pub export: Option<PathBuf>,
    /// Token ids (a JSON array of integers) instead of --text: windows are
    /// cut from these ids, so another implementation can be given the very
    /// same tokens (`minikv tokenize` writes such a file).
    #[arg(long, value_name = "FILE.json", conflicts_with_all = ["text", "dataset"])]
    pub ids: Option<PathBuf>,
    /// Passkey depth in [0, 1] (default: uniform per trial).
    #[arg(long, value_parser = args::unit, allow_negative_numbers = true)]
    pub depth: Option<f64>,
    /// Seed (default: the config's seed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub(crate) struct QuantizeArgs {
    /// Bits: 2, 4 or 8.
    #[arg(long)]
    pub bits: u32,
    /// Group size.
    #[arg(long)]
    pub group: usize,
    /// `token`: each row is quantized along itself; `channel`: the rows are
    /// tokens and groups run down each column (rows of the output are channels).
    #[arg(long, value_parser = ["token", "channel"])]
    pub axis: String,
    /// JSON file: an array of rows of numbers.
    #[arg(long)]
    pub input: PathBuf,
    /// Storage of scale/min: f16 (reference) or f32.
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32"])]
    pub scale_dtype: String,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub(crate) struct BudgetsArgs {
    /// Cache config.
    pub config: PathBuf,
    /// Number of layers.
    #[arg(long, value_parser = args::layers)]
    pub layers: Option<usize>,
    /// Prompt length T.
    #[arg(long, value_parser = args::tokens)]
    pub tokens: usize,
    /// KV heads (for per-head output).
    #[arg(long, default_value_t = 1, value_parser = args::heads)]
    pub kv_heads: usize,
    /// Model for policies that need attention statistics (with --text).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Text whose first T tokens are prefilled (with --model).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// The clap definition of the command line (every command and flag), for
/// tools that enumerate them.
pub fn command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

/// Parses `args` (the program name first) and runs the command in this
/// process, on a rayon pool of its own. A parse error (unknown flag, value out
/// of range) is an [`Error::Input`] carrying clap's message; `--help` and
/// `--version` are errors too (their text is the message).
pub fn run_args<I, T>(args: I) -> Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    minikv_kernels::ensure_registered();
    let cli = Cli::try_parse_from(args).map_err(|e| Error::Input(e.to_string()))?;
    on_pool(cli)
}

fn on_pool(cli: Cli) -> Result<()> {
    // An unknown `MINIKV_MAX_ISA` is refused before any kernel is chosen.
    minikv_core::cpu::max_isa()?;
    // Run on a pool worker: the model's many short parallel loops then start
    // on the worker's own deque instead of being handed over from `main`.
    match rayon::ThreadPoolBuilder::new().build() {
        Ok(pool) => pool.install(|| run(cli)),
        Err(_) => run(cli),
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Components { json } => commands::components(json),
        Cmd::Config {
            cmd: ConfigCmd::Check { file, json },
        } => commands::config_check(&file, json),
        Cmd::Info(m) => commands::info(&m),
        Cmd::Generate(a) => commands::generate(&a),
        Cmd::Logits(a) => commands::logits(&a),
        Cmd::Tokenize(a) => commands::tokenize(&a),
        Cmd::Perplexity(a) => commands::perplexity(&a),
        Cmd::Eval(a) => commands::eval(&a),
        Cmd::Sweep(a) => sweep::sweep(&a),
        Cmd::Report(a) => report::report(&a),
        Cmd::Quantize(a) => commands::quantize(&a),
        Cmd::Budgets(a) => commands::budgets(&a),
        Cmd::Bench {
            cmd: BenchCmd::Attention(a),
        } => bench::attention(&a),
        Cmd::Bench {
            cmd: BenchCmd::Decode(a),
        } => bench::decode(&a),
        Cmd::Bench {
            cmd: BenchCmd::Prefill(a),
        } => bench::prefill(&a),
        Cmd::Bench {
            cmd: BenchCmd::Throughput(a),
        } => throughput::run(&a),
        Cmd::Bench {
            cmd: BenchCmd::Serve(a),
        } => serve::load(&a),
        Cmd::Serve(a) => serve::serve(&a),
        Cmd::Calibrate {
            cmd: CalibrateCmd::Duo(a),
        } => commands::calibrate_duo(&a),
        Cmd::Calibrate {
            cmd: CalibrateCmd::Qfilters(a),
        } => commands::calibrate_qfilters(&a),
        Cmd::Calibrate {
            cmd: CalibrateCmd::Lukv(a),
        } => commands::calibrate_lukv(&a),
    }
}

/// What the `minikv` binary runs: parses the process arguments (clap prints
/// help and usage errors itself), runs the command, prints an error as
/// `error: ...` and returns exit code 2 for bad input, 3 for I/O errors.
pub fn main() -> ExitCode {
    minikv_kernels::ensure_registered();
    let cli = Cli::parse();
    // A closed pipe (`minikv components | head -1`) ends the process quietly,
    // as for any Unix filter, instead of a panic in `println!`. The server
    // and the load generator keep Rust's default (writes to a closed socket
    // are errors they handle).
    #[cfg(unix)]
    if !matches!(
        cli.cmd,
        Cmd::Serve(_)
            | Cmd::Bench {
                cmd: BenchCmd::Serve(_)
            }
    ) {
        // SAFETY: setting a signal disposition to its default before any
        // thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match on_pool(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            if let Error::Io { .. } = e {
                return ExitCode::from(3);
            }
            ExitCode::from(2)
        }
    }
}
