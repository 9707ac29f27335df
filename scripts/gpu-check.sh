#!/usr/bin/env bash
# One unattended command for a machine with an NVIDIA GPU and its driver:
#   1. builds minikv (skipped when cargo is missing and the binaries exist,
#      e.g. copied from a build machine);
#   2. runs the CUDA backend's parity checks on the device against minikv's
#      CPU reference (the gpucheck example: prefill + A_cumul with GQA and
#      sliding windows, SnapKV window scores, bit-exact 2/4/8-bit
#      quantization on both axes, fused decode over ragged heads with extra
#      entries and decode probabilities; tolerance 1e-4) — the same checks
#      that run under the CPU emulation in every `cargo test`;
#   3. reports ptxas's registers and spills for sm_80 and sm_90;
#   4. `minikv bench attention --backend cuda` at 16K tokens next to the CPU;
#   5. when the real model is in assets/: MiniKV 2-bit generation with
#      backend = "cuda" against backend = "tiled" (same greedy tokens).
# Writes results/gpu-check/ and prints a short report. Under 10 minutes
# (most of it the cold build).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=results/gpu-check
mkdir -p "$OUT"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
else
  echo "gpu-check: nvidia-smi not found; the device checks will report the missing driver" >&2
fi
if [ -d third_party/cuda/lib ] && [ -x third_party/cuda/bin/ptxas ]; then
  TOOLS=third_party/cuda
else
  TOOLS=$(./scripts/fetch-cuda-tools.sh)
fi
export LD_LIBRARY_PATH="$PWD/$TOOLS/lib:${LD_LIBRARY_PATH:-}"
if command -v cargo >/dev/null; then
  cargo build --release -q -p minikv-kernels --bins --example gpucheck
  cargo build --release -q -p minikv-cli
fi
BIN=target/release
status=0
echo "== the CUDA backend on the device against the CPU reference"
timeout 300 "$BIN/examples/gpucheck" > "$OUT/device.json" || status=$?
[ -s "$OUT/device.json" ] && python3 - "$OUT/device.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print("device:", r["device"], "ok:", r["ok"])
for c in r["checks"]:
    errs = {k: v for k, v in c.items() if k.endswith("err") or k.endswith("equal")}
    print(f"  {'ok ' if c['ok'] else 'BAD'} {c['check']}: {errs}")
PY
echo "== NVRTC + ptxas (sm_80, sm_90)"
"$BIN/minikv-kernels-check" --ptxas "$TOOLS/bin/ptxas" --out "$OUT/ptx" > "$OUT/ptxas.json" || status=$?
[ -s "$OUT/ptxas.json" ] && python3 - "$OUT/ptxas.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for arch, ks in r.items():
    print(arch, ", ".join(f"{k}: {v.get('registers')} regs, {v.get('spill_stores')} B spilled" for k, v in ks.items()))
PY
echo "== decode attention at 16K tokens: cuda and the CPU"
for be in cuda tiled; do
  timeout 120 "$BIN/minikv" bench attention --tokens 16384 --backend "$be" --seconds 1 --json > "$OUT/bench-attention-$be.json" || status=$?
  [ -s "$OUT/bench-attention-$be.json" ] && python3 - "$OUT/bench-attention-$be.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["results"]:
    print(f"  {r['backend']:<6} {x['cache']:<58} {x['seconds_per_token'] * 1e6:9.1f} us/token")
PY
done
MODEL=assets/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$MODEL" ]; then
  echo "== MiniKV 2-bit on the real model: cuda against tiled"
  PROMPT="Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do"
  for be in cuda tiled; do
    { echo "backend = \"$be\""; cat configs/minikv.toml; } > "$OUT/minikv-$be.toml"
    timeout 120 "$BIN/minikv" generate --config "$OUT/minikv-$be.toml" --prompt "$PROMPT" --max-tokens 32 --json > "$OUT/generate-$be.json" || status=$?
  done
  [ -s "$OUT/generate-cuda.json" ] && python3 - "$OUT/generate-cuda.json" "$OUT/generate-tiled.json" <<'PY' || status=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
same = a["tokens"] == b["tokens"]
print(f"  same greedy tokens: {same}; kv bytes {a['memory']['kv_bytes']} vs {b['memory']['kv_bytes']}; "
      f"decode {a['decode_tokens_per_s']:.1f} vs {b['decode_tokens_per_s']:.1f} tok/s")
sys.exit(0 if same else 1)
PY
else
  echo "== (no $MODEL: the real-model comparison is skipped; ./scripts/fetch-assets.sh fetches it)"
fi
if [ "$status" = 0 ]; then echo "gpu-check: passed"; else echo "gpu-check: FAILED (exit $status)"; fi
exit "$status"
