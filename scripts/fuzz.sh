#!/usr/bin/env bash
# Fuzz for a bounded time (default 300 s per target):  scripts/fuzz.sh [SECONDS] [TARGET...]
# Targets: gguf (the GGUF reader and model construction) and config (config
# parsing, validation, cache construction and a short run); default both.
# Needs the nightly toolchain and cargo-fuzz (installed here if missing). Seed
# corpora: the real model's header and metadata with truncations, and every
# preset in configs/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-300}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf config)
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
mkdir -p fuzz/corpus/gguf fuzz/corpus/config
model=assets/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$model" ]; then
  for n in 64 512 4096 65536 1785700; do head -c $n "$model" > fuzz/corpus/gguf/head_$n; done
fi
cp configs/*.toml fuzz/corpus/config/
cd fuzz
for t in "${targets[@]}"; do
  max_len=2000000
  [ "$t" = config ] && max_len=4096
  cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=4096 -max_len=$max_len
done
