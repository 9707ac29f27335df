#!/usr/bin/env bash
# The findings run (issue 6): the default ablation at a 2K-token context plus
# the comparisons the MiniKV / KIVI papers make, with several seeds so that the
# report carries confidence intervals and paired differences.
#
#   budgets:   MiniKV 2-bit with uniform / pyramid / var_prop / var_inv budgets
#              at the same total (heavy 25% + recent 25%)
#   keys:      2-bit keys per channel (minikv) vs per token (minikv-per-token-keys)
#   bytes:     MiniKV 2-bit (50% of tokens) vs H2O fp16 at about the same KV
#              bytes (6.5% + 6.5% and 7.5% + 7.5% of tokens) and at the same
#              tokens (25% + 25%)
#   quant:     KIVI 2 and 4 bit vs the full cache
#   ResKV:     residual clusters on SnapKV at equal slots (proxy, no gate) vs r = 0
#
# Every config sees the same text windows and passkey trials (they depend on
# the seed only), so differences between configs are paired.
#
# Knobs (env): CONTEXT (2048), TOKENS (64), FID_SEEDS (5), FID_TRIALS (2),
# PK_SEEDS (3), PK_TRIALS (5), ERR_TRIALS (2), TASKS ("fidelity passkey
# attention-error"), OUT (results/findings), BIN (target/release/minikv).
# About 1 h 45 min on 2 cores with the defaults. Resumable: rerun to finish.
set -euo pipefail
cd "$(dirname "$0")/.."
ctx=${CONTEXT:-2048}; toks=${TOKENS:-64}; out=${OUT:-results/findings}
tasks=${TASKS:-fidelity passkey attention-error}
bin=${BIN:-./target/release/minikv}
if [ -z "${BIN:-}" ]; then ./scripts/fetch-assets.sh; cargo build --release -p minikv-cli; fi
mkdir -p "$out"

# One line per config: preset [--set ...]. The default ablation (as
# scripts/demo.sh, at comparable bytes), then the findings' comparisons.
configs=(
  "full"
  "kivi-2bit --set cache.quant.residual=32"
  "kivi-4bit --set cache.quant.residual=32"
  "h2o --set cache.heavy=0.15 --set cache.recent=0.15"
  "snapkv-kvpress --set cache.heavy=0.25 --set cache.recent_tokens=32 --set cache.scorer.type=snapkv"
  "streamingllm --set cache.recent_tokens=$((ctx * 3 / 10))"
  "minikv"
  "minikv-pyramid"
  "minikv-4bit"
  "minikv-4bit --set cache.policy.type=pyramid"
  "minikv-var-prop"
  "minikv-var-inv"
  "minikv-per-token-keys"
  "h2o --set cache.heavy=0.075 --set cache.recent=0.075"
  "h2o --set cache.heavy=0.065 --set cache.recent=0.065"
  "h2o --set cache.heavy=0.25 --set cache.recent=0.25"
  # ResKV on SnapKV at equal slots: r = 0 (plain SnapKV), the proxy, no gate.
  "reskv-snapkv --set cache.compensator.select=fixed --set cache.compensator.ratio=0"
  "reskv-snapkv"
  "reskv-snapkv --set cache.compensator.gate=none"
)
common=(--out "$out/results.jsonl" --quiet --context "$ctx")
# Tasks outer: the cheaper, more sensitive fidelity rows finish first.
for t in $tasks; do
  for c in "${configs[@]}"; do
    read -r -a args <<< "$c"
    cfg=configs/${args[0]}.toml; sets=("${args[@]:1}")
    case $t in
      fidelity) $bin sweep "$cfg" "${sets[@]}" "${common[@]}" --task fidelity --seeds "${FID_SEEDS:-5}" \
        --trials "${FID_TRIALS:-2}" --tokens "$toks" --reference-cache "$out/refs" ;;
      passkey) $bin sweep "$cfg" "${sets[@]}" "${common[@]}" --task passkey --seeds "${PK_SEEDS:-3}" \
        --trials "${PK_TRIALS:-5}" ;;
      attention-error) $bin sweep "$cfg" "${sets[@]}" "${common[@]}" --task attention-error --seeds 1 \
        --trials "${ERR_TRIALS:-2}" --tokens 16 ;;
      *) echo "unknown task $t" >&2; exit 2 ;;
    esac
    echo "$(date +%T) done: $t $c" >&2
  done
done
$bin report "$out/results.jsonl" --out "$out" \
  --pair "minikv-pyramid vs minikv" --pair "minikv-var-prop vs minikv" \
  --pair "minikv-var-inv vs minikv" --pair "minikv-var-prop vs minikv-var-inv" \
  --pair "minikv-pyramid vs minikv-var-prop" \
  --pair "minikv-4bit policy.type=pyramid vs minikv-4bit" \
  --pair "minikv-per-token-keys vs minikv" \
  --pair "minikv vs h2o heavy=0.065 recent=0.065" --pair "minikv vs h2o heavy=0.075 recent=0.075" \
  --pair "minikv vs h2o heavy=0.25 recent=0.25" \
  --pair "reskv-snapkv vs reskv-snapkv reskv.select=fixed reskv.ratio=0" \
  --pair "reskv-snapkv reskv.gate=none vs reskv-snapkv reskv.select=fixed reskv.ratio=0" \
  --pair "reskv-snapkv reskv.gate=none vs reskv-snapkv" \
  --pair "kivi-2bit quant.residual=32 vs full" --pair "kivi-4bit quant.residual=32 vs full" \
  --pair "kivi-2bit quant.residual=32 vs kivi-4bit quant.residual=32"
cat "$out/report.md"
