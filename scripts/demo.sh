#!/usr/bin/env bash
# The main job, on a fresh machine: fetch the model and texts, build, generate,
# then the default ablation on SmolLM2-135M (perplexity, fidelity against the
# full cache, passkey retrieval) and its report (table, CSV, plots).
#
# Budgets are set so that the compressed caches hold comparable KV bytes
# (about 20-40% of the fp16 cache at the default context). Knobs (env):
# CONTEXT (512), TOKENS (64), SEEDS (1), WINDOWS (3 text windows per seed for
# perplexity, fidelity and attention error), TRIALS (6 per seed for passkey and
# the RULER-style needle task), OUT (results/main). Every row of the report
# carries an interval: Student-t over text windows, Wilson over trials.
set -euo pipefail
cd "$(dirname "$0")/.."
ctx=${CONTEXT:-512}; toks=${TOKENS:-64}; seeds=${SEEDS:-1}; windows=${WINDOWS:-3}
trials=${TRIALS:-6}; out=${OUT:-results/main}
./scripts/fetch-assets.sh
cargo build --release -p minikv-cli
bin=./target/release/minikv
mkdir -p "$out"
$bin generate --chat --prompt "What is the capital of France?" --max-tokens 32

run() { # label config [--set ...]
  local label=$1 cfg=$2; shift 2
  $bin sweep "configs/$cfg.toml" "$@" --label "$label" --seeds "$seeds" --task perplexity \
    --task fidelity --task attention-error --trials "$windows" --context "$ctx" --tokens "$toks" \
    --out "$out/results.jsonl" --quiet
  $bin sweep "configs/$cfg.toml" "$@" --label "$label" --seeds "$seeds" --task passkey \
    --task ruler-niah-single-number --trials "$trials" --context "$ctx" \
    --out "$out/results.jsonl" --quiet
  echo "done: $label" >&2
}
run "full cache" full
run "KIVI 2-bit" kivi-2bit --set cache.quant.residual=32
run "KIVI 4-bit" kivi-4bit --set cache.quant.residual=32
run "H2O 15%+15%" h2o --set cache.heavy=0.15 --set cache.recent=0.15
run "SnapKV 25%+32" snapkv-kvpress --set cache.heavy=0.25 --set cache.recent_tokens=32 --set cache.scorer.type=snapkv
run "StreamingLLM 4+30%" streamingllm --set cache.recent_tokens=$((ctx * 3 / 10))
run "MiniKV 2-bit" minikv
run "MiniKV 2-bit pyramid" minikv-pyramid
run "MiniKV 4-bit" minikv-4bit
run "MiniKV 4-bit pyramid" minikv-4bit --set cache.policy.type=pyramid
$bin report "$out/results.jsonl" --out "$out" --pair "MiniKV 2-bit pyramid vs MiniKV 2-bit" \
  --pair "KIVI 2-bit vs KIVI 4-bit" --pair "MiniKV 2-bit vs H2O 15%+15%"
cat "$out/report.md"
echo "plots: $out/*.svg (score vs KV bytes, per-layer budgets and errors); rows: $out/results.jsonl" >&2
