#!/usr/bin/env bash
# One unattended command for a machine with an NVIDIA GPU and its driver:
# builds minikv-kernels, compiles the kernels with NVRTC for the device, runs
# them on the device against minikv's CPU reference backend (prefill outputs
# and A_cumul with and without a sliding window; split-K fused decode with
# extra entries; tolerance 1e-4), reports ptxas's registers and spills for
# sm_80 and sm_90, and runs the emulated parity tests. Writes results/gpu-check/
# and prints a short report. Under 10 minutes (most of it the cold build).
#
# Not covered yet: the `cuda` attention backend itself (device-resident stores
# and the launches behind AttentionBackend are not written; `backend = "cuda"`
# is a clear error), hence no `minikv bench attention --backend cuda` here.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=results/gpu-check
mkdir -p "$OUT"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
else
  echo "gpu-check: nvidia-smi not found; the device checks will report the missing driver" >&2
fi
TOOLS=$(./scripts/fetch-cuda-tools.sh)
export LD_LIBRARY_PATH="$PWD/$TOOLS/lib:${LD_LIBRARY_PATH:-}"
cargo build --release -q -p minikv-kernels --bins
echo "== kernels on the device against the CPU reference"
status=0
timeout 300 target/release/minikv-kernels-gpucheck > "$OUT/device.json" || status=$?
cat "$OUT/device.json"
echo "== NVRTC + ptxas (sm_80, sm_90)"
target/release/minikv-kernels-check --ptxas "$TOOLS/bin/ptxas" --out "$OUT/ptx" > "$OUT/ptxas.json"
python3 - "$OUT/ptxas.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for arch, ks in r.items():
    print(arch, ", ".join(f"{k}: {v.get('registers')} regs, {v.get('spill_stores')} B spilled" for k, v in ks.items()))
PY
echo "== emulated parity tests (CPU)"
timeout 600 cargo test -q --release -p minikv-kernels 2>&1 | tail -3
if [ "$status" = 0 ]; then echo "gpu-check: device checks passed"; else echo "gpu-check: device checks FAILED (exit $status)"; fi
exit "$status"
