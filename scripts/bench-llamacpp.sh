#!/usr/bin/env bash
# minikv against llama.cpp on the same GGUF, same threads, same minutes: decode
# tokens/s by depth (llama-bench -p 0 -n N -d D, flash attention on, f16 and
# q4_0 KV) beside `minikv bench decode` (full cache, MiniKV 2-bit, KIVI-2), and
# prompt processing beside `minikv bench prefill`; prints one markdown table
# with ratios (docs/performance.md keeps the latest). llama.cpp is built once
# by scripts/build-llamacpp.sh. Knobs (env): MODEL (the fetched SmolLM2 GGUF),
# THREADS (nproc), DEPTHS (0,4096,8192), N (64), REPS (3), PROMPTS (4096,8000),
# OUT (results/bench-llamacpp), CONFIGS (configs/minikv.toml configs/kivi-2bit.toml),
# Q8 (1: also time the full cache with `--activations q8`, llama.cpp's 8-bit
# activation arithmetic; 0: skip).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-assets/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
DEPTHS=${DEPTHS:-0,4096,8192}
N=${N:-64}
REPS=${REPS:-3}
PROMPTS=${PROMPTS:-4096,8000}
OUT=${OUT:-results/bench-llamacpp}
CONFIGS=${CONFIGS:-configs/minikv.toml configs/kivi-2bit.toml}
Q8=${Q8:-1}
mkdir -p "$OUT"
[ -f "$MODEL" ] || ./scripts/fetch-assets.sh >&2
BIN=$(./scripts/build-llamacpp.sh)
cargo build --release -q -p minikv-cli
MK=target/release/minikv
CFG_ARGS=()
for c in $CONFIGS; do CFG_ARGS+=(--config "$c"); done
# Each result file is kept: a rerun measures only what is missing (delete
# OUT to measure everything again).
run_ll() { # name, llama-bench args...
  local f="$OUT/$1.json"; shift
  [ -s "$f" ] && return 0
  echo "bench-llamacpp: llama.cpp $*" >&2
  "$BIN/llama-bench" -m "$MODEL" -t "$THREADS" -fa 1 -r "$REPS" -o json "$@" > "$f.part"
  mv "$f.part" "$f"
}
run_ll llamacpp-decode-f16 -p 0 -n "$N" -d "$DEPTHS"
run_ll llamacpp-decode-q4_0 -ctk q4_0 -ctv q4_0 -p 0 -n "$N" -d "$DEPTHS"
run_ll llamacpp-prefill -p "$PROMPTS" -n 0
echo "bench-llamacpp: minikv decode" >&2
RAYON_NUM_THREADS=$THREADS $MK bench decode --model "$MODEL" --config configs/full.toml "${CFG_ARGS[@]}" \
  --depth "$DEPTHS" --tokens "$N" --runs "$REPS" --json > "$OUT/minikv-decode.json"
if [ "$Q8" = 1 ]; then
  echo "bench-llamacpp: minikv decode, q8 activations" >&2
  RAYON_NUM_THREADS=$THREADS $MK bench decode --model "$MODEL" --config configs/full.toml --activations q8 \
    --depth "$DEPTHS" --tokens "$N" --runs "$REPS" --json > "$OUT/minikv-decode-q8.json"
fi
echo "bench-llamacpp: minikv prefill" >&2
RAYON_NUM_THREADS=$THREADS $MK bench prefill --model "$MODEL" --config configs/full.toml --config configs/minikv.toml \
  --tokens "$PROMPTS" --runs "$REPS" --json > "$OUT/minikv-prefill.json"
python3 - "$OUT" "$THREADS" "$Q8" <<'PY'
import json, sys, os
out, threads = sys.argv[1], sys.argv[2]
def ll(name):
    rows = json.load(open(os.path.join(out, name)))
    return {(r["n_depth"] if r["n_gen"] else r["n_prompt"]): r["avg_ts"] for r in rows}
f16, q4 = ll("llamacpp-decode-f16.json"), ll("llamacpp-decode-q4_0.json")
pre = ll("llamacpp-prefill.json")
mk = json.load(open(os.path.join(out, "minikv-decode.json")))
mkp = json.load(open(os.path.join(out, "minikv-prefill.json")))
cfgs = []
for r in mk["results"]:
    if r["config"] not in cfgs: cfgs.append(r["config"])
dec = {(r["config"], r["depth"]): r for r in mk["results"]}
q8 = os.path.join(out, "minikv-decode-q8.json")
if sys.argv[3] == "1" and os.path.exists(q8):
    cfgs.append("full, q8 activations")
    for r in json.load(open(q8))["results"]:
        dec[("full, q8 activations", r["depth"])] = r
lowered = sorted({(r["depth"], r["depth_used"]) for r in mk["results"] if r["depth"] > 0 and r.get("depth_used", r["depth"]) != r["depth"]})
print(f"Decode tokens/s ({threads} threads, {mk['model']}, minikv {mk['git_rev']}; median of runs, minikv spread in brackets; ratio = minikv / llama.cpp f16):\n")
print("| depth | llama.cpp f16 KV | llama.cpp q4_0 KV | " + " | ".join(f"minikv {c}" for c in cfgs) + " |")
print("|---|---|---|" + "---|" * len(cfgs))
for d in sorted(f16):
    cells = []
    for c in cfgs:
        r = dec.get((c, d))
        cells.append("-" if r is None else f"{r['tokens_per_s']:.1f} [{r['min']:.1f}, {r['max']:.1f}] (x{r['tokens_per_s'] / f16[d]:.2f})")
    print(f"| {d} | {f16[d]:.1f} | {q4.get(d, float('nan')):.1f} | " + " | ".join(cells) + " |")
for d, u in lowered:
    print(f"\nminikv's depth {d} is {u}: the timed steps must fit the model's context (llama.cpp runs past it).")
print(f"\nPrefill tokens/s:\n")
pcfg = []
for r in mkp["results"]:
    if r["config"] not in pcfg: pcfg.append(r["config"])
pr = {(r["config"], r["tokens"]): r for r in mkp["results"]}
print("| prompt | llama.cpp | " + " | ".join(f"minikv {c}" for c in pcfg) + " |")
print("|---|---|" + "---|" * len(pcfg))
for n in sorted(pre):
    cells = [f"{pr[(c, n)]['tokens_per_s']:.1f} (x{pr[(c, n)]['tokens_per_s'] / pre[n]:.2f})" if (c, n) in pr else "-" for c in pcfg]
    print(f"| {n} | {pre[n]:.1f} | " + " | ".join(cells) + " |")
PY
