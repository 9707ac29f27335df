#!/usr/bin/env bash
# NVIDIA's runtime compiler and assembler for checking minikv's CUDA kernels on
# a machine without a GPU (CI runs this): from PyPI, pinned and sha256-checked,
# into the git-ignored third_party/cuda/ (idempotent):
#   lib/libnvrtc.so.12, lib/libnvrtc-builtins.so.12.9  (nvidia-cuda-nvrtc-cu12==12.9.86)
#   bin/ptxas                                          (nvidia-cuda-nvcc-cu12==12.9.86)
# No driver and no GPU are involved: NVRTC compiles CUDA C to PTX, ptxas
# assembles PTX for an architecture and reports registers and spills.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=third_party/cuda
NVRTC_SHA=210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4
NVCC_SHA=5d6a0d32fdc7ea39917c20065614ae93add6f577d840233237ff08e9a38f58f0
if [ -f "$DIR/.complete" ]; then echo "$DIR"; exit 0; fi
mkdir -p "$DIR/dl" "$DIR/lib" "$DIR/bin"
fetch() { # spec glob sha
  local f
  f=$(ls "$DIR"/dl/$2 2>/dev/null | head -1 || true)
  if [ -z "$f" ]; then
    python3 -m pip download -q --no-deps --disable-pip-version-check -d "$DIR/dl" "$1" >&2 \
      || { echo "fetch-cuda-tools: could not download $1" >&2; exit 1; }
    f=$(ls "$DIR"/dl/$2 | head -1)
  fi
  [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$3" ] \
    || { echo "fetch-cuda-tools: sha256 mismatch for $f (delete it and rerun)" >&2; exit 1; }
  echo "$f"
}
nvrtc=$(fetch nvidia-cuda-nvrtc-cu12==12.9.86 "nvidia_cuda_nvrtc_cu12-12.9.86-*.whl" "$NVRTC_SHA")
nvcc=$(fetch nvidia-cuda-nvcc-cu12==12.9.86 "nvidia_cuda_nvcc_cu12-12.9.86-*.whl" "$NVCC_SHA")
python3 - "$nvrtc" "$nvcc" "$DIR" <<'PY'
import os, sys, zipfile
nvrtc, nvcc, out = sys.argv[1:4]
want = {nvrtc: {"nvidia/cuda_nvrtc/lib/libnvrtc.so.12": "lib",
                "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9": "lib"},
        nvcc: {"nvidia/cuda_nvcc/bin/ptxas": "bin"}}
for whl, members in want.items():
    with zipfile.ZipFile(whl) as z:
        for m, sub in members.items():
            dst = os.path.join(out, sub, os.path.basename(m))
            with z.open(m) as src, open(dst + ".tmp", "wb") as f:
                f.write(src.read())
            os.chmod(dst + ".tmp", 0o755)
            os.replace(dst + ".tmp", dst)
PY
rm -rf "$DIR/dl"
touch "$DIR/.complete"
echo "$DIR"
