#!/usr/bin/env bash
# Fuzz the GGUF reader for a bounded time (default 300 s):  scripts/fuzz.sh [SECONDS]
# Needs the nightly toolchain and cargo-fuzz (installed here if missing). The seed
# corpus is the header and metadata of the real model plus small truncations.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-300}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
mkdir -p fuzz/corpus/gguf
model=assets/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$model" ]; then
  for n in 64 512 4096 65536 1785700; do head -c $n "$model" > fuzz/corpus/gguf/head_$n; done
fi
cd fuzz
cargo +nightly fuzz run gguf corpus/gguf -- -max_total_time="$secs" -rss_limit_mb=4096 -max_len=2000000
