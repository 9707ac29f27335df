#!/usr/bin/env bash
# Cross-check of minikv against kvpress 0.5.5 on identical tokens (not in CI:
# it installs torch, transformers, gguf and kvpress, several GB, into the
# git-ignored .venv-kvpress).
#
# 1. Golden vectors: kvpress's own score/compress of every method minikv took
#    from it, on a seeded tiny Llama attention layer; rewrites
#    minikv-policies/tests/golden/kvpress.json (replayed by
#    `cargo test -p minikv-policies --test kvpress_golden`; a diff after
#    this script means kvpress or the inputs changed).
# 2. The real model: the SmolLM2 GGUF loaded into transformers (dequantized
#    to f32) and into minikv; each context's token ids written once by
#    `minikv tokenize` and fed to both sides; every method in both at each
#    ratio; per-step KL(full || compressed) over the teacher-forced tokens,
#    each side against its own full cache. Rows go to
#    results/xcheck-kvpress.jsonl (resumable); the table and the KL curves to
#    docs/fidelity-kvpress.md and docs/img/fidelity-kvpress-*.svg.
#
# Knobs (env): XCHECK_TEXTS (boss desres: Paul Graham essays of >= 2112
# tokens), XCHECK_CONTEXT (2048), XCHECK_TOKENS (64), XCHECK_RATIOS (0.5;
# e.g. 0.25,0.5,0.75), XCHECK_METHODS (all).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-kvpress
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --no-cache-dir "kvpress==0.5.5" gguf matplotlib
fi
# transformers' quantized cache (the KIVI rows) runs on optimum-quanto, whose
# CPU kernels are C++ extensions built at first use with ninja.
"$venv/bin/python" -c "import optimum.quanto, ninja" 2>/dev/null \
  || "$venv/bin/pip" install -q --no-cache-dir "optimum-quanto==0.2.7" ninja
export PATH="$PWD/$venv/bin:$PATH"
"$venv/bin/python" -c "import kvpress, torch, gguf, optimum.quanto" || { echo "the venv $venv is broken: remove it and rerun" >&2; exit 1; }
./scripts/fetch-assets.sh >/dev/null
cargo build --release -q -p minikv-cli
export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore

echo "== golden vectors (kvpress's own outputs)"
"$venv/bin/python" scripts/xcheck/kvpress_golden.py minikv-policies/tests/golden/kvpress.json
git diff --stat -- minikv-policies/tests/golden/kvpress.json || true

echo "== the real model, identical tokens"
mkdir -p results/xcheck
files=()
for t in ${XCHECK_TEXTS:-boss desres}; do
  f=results/xcheck/$t.ids.json
  target/release/minikv tokenize --text "assets/paul_graham/$t.txt" > "$f"
  files+=("$f")
done
"$venv/bin/python" scripts/xcheck/kvpress_model.py results/xcheck-kvpress.jsonl "${files[@]}"
"$venv/bin/python" scripts/xcheck/kvpress_table.py results/xcheck-kvpress.jsonl docs/fidelity-kvpress.md docs/img
