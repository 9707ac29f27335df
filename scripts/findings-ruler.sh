#!/usr/bin/env bash
# RULER-style findings on SmolLM2: first the full cache's accuracy by context
# length (passkey and the needle tasks), then the default ablation's methods at
# comparable KV bytes on a RULER-style suite at the chosen CONTEXT, with the
# same trials for every config (they depend on the seed only), so differences
# are paired. Question-agnostic (the question comes after compression).
#
# Knobs (env): LENGTHS ("512 1024 2048 4096"), LEN_TRIALS (10), CONTEXT
# (1024), TASKS (ruler-niah-single-number ruler-niah-multikey
# ruler-niah-multivalue ruler-fwe), SEEDS (2), TRIALS (5 per seed), OUT
# (results/ruler), BIN (target/release/minikv). Resumable: rerun to finish.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/ruler}; bin=${BIN:-./target/release/minikv}
if [ -z "${BIN:-}" ]; then ./scripts/fetch-assets.sh; cargo build --release -p minikv-cli; fi
mkdir -p "$out"
lengths=${LENGTHS:-512 1024 2048 4096}
ctx=${CONTEXT:-1024}
tasks=${TASKS:-ruler-niah-single-number ruler-niah-multikey ruler-niah-multivalue ruler-fwe}
# 1. The full cache by context length.
for n in $lengths; do
  "$bin" sweep configs/full.toml --label "full cache @$n" --task passkey \
    --task ruler-niah-single-number --task ruler-niah-multikey \
    --trials "${LEN_TRIALS:-10}" --context "$n" --out "$out/lengths.jsonl" --quiet
  echo "lengths: $n done" >&2
done
# 2. Methods at CONTEXT on the suite.
task_args=(); for t in $tasks; do task_args+=(--task "$t"); done
run() { # label config [--set ...]
  local label=$1 cfg=$2; shift 2
  "$bin" sweep "configs/$cfg.toml" "$@" --label "$label" --seeds "${SEEDS:-2}" \
    "${task_args[@]}" --trials "${TRIALS:-5}" --context "$ctx" --out "$out/suite.jsonl" --quiet
  echo "suite: $label done" >&2
}
run "full cache" full
run "KIVI 2-bit" kivi-2bit --set cache.quant.residual=32
run "H2O 15%+15%" h2o --set cache.heavy=0.15 --set cache.recent=0.15
run "SnapKV 25%+32" snapkv-kvpress --set cache.heavy=0.25 --set cache.recent_tokens=32 --set cache.scorer.type=snapkv
run "StreamingLLM 4+30%" streamingllm --set cache.recent_tokens=$((ctx * 3 / 10))
run "MiniKV 2-bit" minikv
run "MiniKV 4-bit" minikv-4bit
"$bin" report "$out/lengths.jsonl" --out "$out/lengths"
"$bin" report "$out/suite.jsonl" --out "$out/suite" --pair "MiniKV 2-bit vs full cache" \
  --pair "MiniKV 2-bit vs H2O 15%+15%" --pair "MiniKV 2-bit vs SnapKV 25%+32" \
  --pair "MiniKV 4-bit vs full cache"
cat "$out/lengths/report.md" "$out/suite/report.md"
