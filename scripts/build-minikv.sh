#!/usr/bin/env bash
# Builds the minikv CLI (release) and prints the binary's path. Knob (env):
# ISA: native (the default: target/, this CPU's features, as .cargo/config
# sets them) or avx2 (target-avx2/: x86-64-v3 code, matrixmultiply held to
# its AVX2 kernels through MMTEST_FEATURE, which it reads when it compiles).
# Run an avx2 binary with MINIKV_MAX_ISA=avx2 so that minikv's own kernels
# leave AVX-512 aside too: together, the figures of a CPU without AVX-512.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${ISA:-native}" in
  native)
    cargo build --release -q -p minikv-cli >&2
    echo target/release/minikv ;;
  avx2)
    RUSTFLAGS="-C target-cpu=x86-64-v3" MMTEST_FEATURE="sse2,avx,avx2,fma" \
      cargo build --release -q -p minikv-cli --target-dir target-avx2 >&2
    echo target-avx2/release/minikv ;;
  *) echo "build-minikv: ISA=$ISA: expected native or avx2" >&2; exit 2 ;;
esac
