#!/usr/bin/env bash
# Long-context findings on Gemma 3 270M (docs/findings-gemma3-270m.md):
#
# 1. retrieval with the full cache by context length (passkey and the
#    RULER-style single needle), to find where the base model retrieves at all;
# 2. fidelity (next-token KL against the full cache over TOKENS continuation
#    tokens) at 4K, 8K and 16K tokens for MiniKV 2-bit, SnapKV (25% + 32),
#    StreamingLLM (4 sinks + 25%) and KIVI 2-bit: compression applies to the
#    three global layers, the 15 sliding-window layers are rings of 512;
# 3. the methods on the RULER-style single needle at the lengths where the
#    full cache scores above chance (RET_LENGTHS; 4096 in the findings; the
#    passkey task is at chance beyond 1K for this base model), question-
#    agnostic, then MiniKV and SnapKV query-aware.
#
# Every config sees the same text windows and trials (they depend on the seed
# only): differences are paired. The full cache's reference logits are kept in
# OUT/reference (shared by the configs and by reruns).
# Knobs (env): LENGTHS ("1024 2048 4096 8192"), LEN_TRIALS (4),
# FID_LENGTHS ("4096 8192 16384"), FID_WINDOWS ("2 2 1"), TOKENS (32),
# RET_LENGTHS ("4096"), RET_TRIALS (6), OUT (results/gemma3), BIN
# (target/release/minikv). About 55 minutes on 2 cores. Resumable: rerun to
# finish (an empty knob skips its step, e.g. LENGTHS= FID_LENGTHS=).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gemma3}; bin=${BIN:-./target/release/minikv}
if [ -z "${BIN:-}" ]; then ./scripts/fetch-assets.sh; cargo build --release -p minikv-cli; fi
mkdir -p "$out"
m=(--model gemma3-270m)
toks=${TOKENS:-32}

# 1. The full cache by context length.
for n in ${LENGTHS-1024 2048 4096 8192}; do
  "$bin" sweep configs/full.toml "${m[@]}" --label "full cache @$n" --task passkey \
    --task ruler-niah-single-number --trials "${LEN_TRIALS:-4}" --context "$n" \
    --out "$out/lengths.jsonl" --quiet
  echo "lengths: $n done" >&2
done

# 2. Fidelity by length.
read -r -a fl <<< "${FID_LENGTHS-4096 8192 16384}"
read -r -a fw <<< "${FID_WINDOWS:-2 2 1}"
fid() { # label config n windows [--set ...]
  local label=$1 cfg=$2 n=$3 w=$4; shift 4
  "$bin" sweep "configs/$cfg.toml" "${m[@]}" "$@" --label "$label" --task fidelity \
    --trials "$w" --context "$n" --tokens "$toks" --reference-cache "$out/reference" \
    --out "$out/fidelity-$n.jsonl" --quiet
}
for i in "${!fl[@]}"; do
  n=${fl[$i]}; w=${fw[$i]:-1}
  fid "MiniKV 2-bit" minikv "$n" "$w"
  fid "SnapKV 25%+32" snapkv-kvpress "$n" "$w" --set cache.heavy=0.25 \
    --set cache.recent_tokens=32 --set cache.scorer.type=snapkv
  fid "StreamingLLM 4+25%" streamingllm "$n" "$w" --set cache.recent_tokens=$((n / 4))
  fid "KIVI 2-bit" kivi-2bit "$n" "$w" --set cache.quant.residual=32
  "$bin" report "$out/fidelity-$n.jsonl" --out "$out/fidelity-$n"
  echo "fidelity: $n done" >&2
done

# 3. Retrieval with the methods where the full cache retrieves.
for n in ${RET_LENGTHS-4096}; do
  ret() { # label config [--set ...]
    local label=$1 cfg=$2; shift 2
    "$bin" sweep "configs/$cfg.toml" "${m[@]}" "$@" --label "$label" \
      --task ruler-niah-single-number --trials "${RET_TRIALS:-6}" --context "$n" \
      --out "$out/retrieval-$n.jsonl" --quiet
  }
  ret "full cache" full
  ret "MiniKV 2-bit" minikv
  ret "SnapKV 25%+32" snapkv-kvpress --set cache.heavy=0.25 --set cache.recent_tokens=32 \
    --set cache.scorer.type=snapkv
  ret "StreamingLLM 4+25%" streamingllm --set cache.recent_tokens=$((n / 4))
  "$bin" report "$out/retrieval-$n.jsonl" --out "$out/retrieval-$n"
  # Query-aware: the question is prefilled with the context before compressing.
  qa() { # label config [--set ...]
    local label=$1 cfg=$2; shift 2
    "$bin" sweep "configs/$cfg.toml" "${m[@]}" "$@" --label "$label (query-aware)" --query-aware \
      --task ruler-niah-single-number --trials "${RET_TRIALS:-6}" --context "$n" \
      --out "$out/retrieval-$n-qa.jsonl" --quiet
  }
  qa "MiniKV 2-bit" minikv
  qa "SnapKV 25%+32" snapkv-kvpress --set cache.heavy=0.25 --set cache.recent_tokens=32 \
    --set cache.scorer.type=snapkv
  "$bin" report "$out/retrieval-$n-qa.jsonl" --out "$out/retrieval-$n-qa"
  echo "retrieval: $n done" >&2
done
[ -f "$out/lengths.jsonl" ] && "$bin" report "$out/lengths.jsonl" --out "$out/lengths"
cat "$out"/lengths/report.md "$out"/fidelity-*/report.md "$out"/retrieval-*/report.md 2>/dev/null || true
