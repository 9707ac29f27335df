#!/usr/bin/env bash
# Fresh machine -> assets, release build, and the main job on SmolLM2-135M:
# generation, then perplexity through the full cache and the compressed caches.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-assets.sh
cargo build --release -p minikv-cli
bin=./target/release/minikv
$bin generate --chat --prompt "What is the capital of France?" --max-tokens 32
printf "\n%-18s %8s %10s %10s\n" config ppl decode_ppl kv/fp16
for c in full kivi-2bit kivi-4bit h2o snapkv-kvpress minikv minikv-pyramid minikv-4bit; do
  $bin perplexity --text assets/paul_graham/addiction.txt --tokens 768 --prefill 512 --config configs/$c.toml --json \
    | python3 -c "import json,sys; d=json.load(sys.stdin); print('%-18s %8.3f %10.3f %10.3f' % ('$c', d['ppl'], d['decode_ppl'], d['memory']['compression_ratio']))"
done
