#!/usr/bin/env bash
# The main job, on a fresh machine: fetch the model and texts, build, generate,
# then the default ablation on SmolLM2-135M (perplexity, fidelity against the
# full cache, passkey retrieval) and its report (table, CSV, plots).
#
# Budgets are set so that the compressed caches hold comparable KV bytes
# (about 20-40% of the fp16 cache at the default context). Knobs (env):
# CONTEXT (512), TOKENS (64), SEEDS (1), PASSKEY_TRIALS (10), OUT (results/main).
set -euo pipefail
cd "$(dirname "$0")/.."
ctx=${CONTEXT:-512}; toks=${TOKENS:-64}; seeds=${SEEDS:-1}; trials=${PASSKEY_TRIALS:-10}; out=${OUT:-results/main}
./scripts/fetch-assets.sh
cargo build --release -p minikv-cli
bin=./target/release/minikv
mkdir -p "$out"
$bin generate --chat --prompt "What is the capital of France?" --max-tokens 32

run() { # config [--set ...]
  local cfg=$1; shift
  $bin sweep "configs/$cfg.toml" "$@" --seeds "$seeds" --task perplexity --task fidelity \
    --task attention-error --context "$ctx" --tokens "$toks" --out "$out/results.jsonl" --quiet
  $bin sweep "configs/$cfg.toml" "$@" --seeds "$seeds" --task passkey --trials "$trials" \
    --context "$ctx" --out "$out/results.jsonl" --quiet
  echo "done: $cfg $*" >&2
}
run full
run kivi-2bit --set cache.quant.residual=32
run kivi-4bit --set cache.quant.residual=32
run h2o --set cache.heavy=0.15 --set cache.recent=0.15
run snapkv-kvpress --set cache.heavy=0.25 --set cache.recent_tokens=32 --set cache.scorer.type=snapkv
run streamingllm --set cache.recent_tokens=$((ctx * 3 / 10))
run minikv
run minikv-pyramid
run minikv-4bit
run minikv-4bit --set cache.policy.type=pyramid
$bin report "$out/results.jsonl" --out "$out" --pair "minikv-pyramid vs minikv" \
  --pair "kivi-2bit quant.residual=32 vs kivi-4bit quant.residual=32"
cat "$out/report.md"
echo "plots: $out/*.svg (score vs KV bytes, per-layer budgets and errors); rows: $out/results.jsonl" >&2
