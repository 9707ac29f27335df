#!/usr/bin/env bash
# minikv against llama.cpp on the same GGUF, same threads, same minutes: decode
# tokens/s by depth (llama-bench -p 0 -n N -d D, f16 and q4_0 KV) beside `minikv bench decode` (full cache, MiniKV 2-bit, KIVI-2), and
# prompt processing beside `minikv bench prefill`; prints one markdown table
# with ratios (docs/performance.md keeps the latest). llama.cpp runs with
# flash attention off and on (`-fa 0` and `-fa 1`) and each cell takes the
# faster, naming it: on CPUs its non-flash path is often the faster one at
# depth, so a ratio against `-fa 1` alone would flatter minikv. A quantized V
# cache needs flash attention in llama.cpp; if `-fa 0` refuses it, the table
# says so. llama.cpp is built once
# by scripts/build-llamacpp.sh. Knobs (env): MODEL (the fetched SmolLM2 GGUF),
# THREADS (nproc), DEPTHS (0,4096,8192), N (64), REPS (3), PROMPTS (4096,8000),
# OUT (results/bench-llamacpp), CONFIGS (configs/minikv.toml configs/kivi-2bit.toml),
# Q8 (1: also time the full cache and CONFIGS with `--activations q8`,
# llama.cpp's 8-bit activation arithmetic; 0: skip), ISA (native; avx2:
# both sides without AVX-512 on this machine: llama.cpp's AVX2-only build
# and minikv's (scripts/build-minikv.sh) run under MINIKV_MAX_ISA=avx2:
# the figures of a CPU without AVX-512).
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
ISA=${ISA:-native}
mkdir -p "$OUT"
[ -f "$MODEL" ] || ./scripts/fetch-assets.sh >&2
BIN=$(ISA=$ISA ./scripts/build-llamacpp.sh)
MK=$(ISA=$ISA ./scripts/build-minikv.sh)
[ "$ISA" = avx2 ] && export MINIKV_MAX_ISA=avx2
CFG_ARGS=()
for c in $CONFIGS; do CFG_ARGS+=(--config "$c"); done
# Each result file is kept: a rerun measures only what is missing (delete
# OUT to measure everything again).
run_ll() { # name, fa (0|1), llama-bench args...
  local f="$OUT/$1-fa$2.json" fa=$2; shift 2
  [ -s "$f" ] && return 0
  echo "bench-llamacpp: llama.cpp -fa $fa $*" >&2
  if "$BIN/llama-bench" -m "$MODEL" -t "$THREADS" -fa "$fa" -r "$REPS" -o json "$@" > "$f.part" 2> "$f.log"; then
    mv "$f.part" "$f"
  else
    # Recorded, not fatal: e.g. a quantized V cache without flash attention.
    echo "bench-llamacpp: llama.cpp -fa $fa $* failed: $(tail -n 2 "$f.log" | tr '\n' ' ')" >&2
    rm -f "$f.part"
  fi
}
for fa in 0 1; do
  run_ll llamacpp-decode-f16 $fa -p 0 -n "$N" -d "$DEPTHS"
  run_ll llamacpp-decode-q4_0 $fa -ctk q4_0 -ctv q4_0 -p 0 -n "$N" -d "$DEPTHS"
  run_ll llamacpp-prefill $fa -p "$PROMPTS" -n 0
done
echo "bench-llamacpp: minikv decode" >&2
RAYON_NUM_THREADS=$THREADS $MK bench decode --model "$MODEL" --config configs/full.toml "${CFG_ARGS[@]}" \
  --depth "$DEPTHS" --tokens "$N" --runs "$REPS" --json > "$OUT/minikv-decode.json"
if [ "$Q8" = 1 ]; then
  echo "bench-llamacpp: minikv decode, q8 activations" >&2
  RAYON_NUM_THREADS=$THREADS $MK bench decode --model "$MODEL" --config configs/full.toml "${CFG_ARGS[@]}" --activations q8 \
    --depth "$DEPTHS" --tokens "$N" --runs "$REPS" --json > "$OUT/minikv-decode-q8.json"
fi
echo "bench-llamacpp: minikv prefill" >&2
RAYON_NUM_THREADS=$THREADS $MK bench prefill --model "$MODEL" --config configs/full.toml --config configs/minikv.toml \
  --tokens "$PROMPTS" --runs "$REPS" --json > "$OUT/minikv-prefill.json"
python3 - "$OUT" "$THREADS" "$Q8" "$ISA" <<'PY'
import json, sys, os
out, threads = sys.argv[1], sys.argv[2]
class Best(dict):
    """depth or prompt -> (tokens/s, fa) of the faster flash-attention setting."""
    def __init__(self, name):
        super().__init__()
        self.missing = []
        for fa in (0, 1):
            p = os.path.join(out, f"{name}-fa{fa}.json")
            if not os.path.exists(p):
                self.missing.append(fa)
                continue
            for r in json.load(open(p)):
                k = r["n_depth"] if r["n_gen"] else r["n_prompt"]
                if k not in self or r["avg_ts"] > self[k][0]:
                    self[k] = (r["avg_ts"], fa)
    def cell(self, k):
        if k not in self:
            return "-"
        return f"{self[k][0]:.1f} (fa {self[k][1]})"
    def ts(self, k):
        return self[k][0]
f16, q4 = Best("llamacpp-decode-f16"), Best("llamacpp-decode-q4_0")
pre = Best("llamacpp-prefill")
mk = json.load(open(os.path.join(out, "minikv-decode.json")))
mkp = json.load(open(os.path.join(out, "minikv-prefill.json")))
cfgs = []
for r in mk["results"]:
    if r["config"] not in cfgs: cfgs.append(r["config"])
dec = {(r["config"], r["depth"]): r for r in mk["results"]}
q8 = os.path.join(out, "minikv-decode-q8.json")
if sys.argv[3] == "1" and os.path.exists(q8):
    for r in json.load(open(q8))["results"]:
        c = f"{r['config']}, q8 activations"
        if c not in cfgs: cfgs.append(c)
        dec[(c, r["depth"])] = r
lowered = sorted({(r["depth"], r["depth_used"]) for r in mk["results"] if r["depth"] > 0 and r.get("depth_used", r["depth"]) != r["depth"]})
isa = "" if sys.argv[4] == "native" else f", both sides without AVX-512 (ISA={sys.argv[4]})"
print(f"Decode tokens/s ({threads} threads{isa}, {mk['model']}, minikv {mk['git_rev']}; median of runs, minikv spread in brackets; llama.cpp at the faster of flash attention off and on per cell, `fa` says which; ratio = minikv / llama.cpp f16 at its fastest):\n")
print("| depth | llama.cpp f16 KV | llama.cpp q4_0 KV | " + " | ".join(f"minikv {c}" for c in cfgs) + " |")
print("|---|---|---|" + "---|" * len(cfgs))
# Every depth either side measured: a side that failed leaves "-" cells and
# no ratio, never a missing row.
for d in sorted(set(f16) | {k[1] for k in dec}):
    cells = []
    for c in cfgs:
        r = dec.get((c, d))
        ratio = f" (x{r['tokens_per_s'] / f16.ts(d):.2f})" if r is not None and d in f16 else ""
        cells.append("-" if r is None else f"{r['tokens_per_s']:.1f} [{r['min']:.1f}, {r['max']:.1f}]{ratio}")
    print(f"| {d} | {f16.cell(d)} | {q4.cell(d)} | " + " | ".join(cells) + " |")
name_of = {"f16 KV": "llamacpp-decode-f16", "q4_0 KV": "llamacpp-decode-q4_0", "prefill": "llamacpp-prefill"}
for name, b in (("f16 KV", f16), ("q4_0 KV", q4), ("prefill", pre)):
    for fa in b.missing:
        print(f"\nllama.cpp {name} with -fa {fa}: no result: llama.cpp refused or failed (its message: {out}/{name_of[name]}-fa{fa}.json.log).")
for d, u in lowered:
    print(f"\nminikv's depth {d} is {u}: the timed steps must fit the model's context (llama.cpp runs past it).")
print(f"\nPrefill tokens/s:\n")
pcfg = []
for r in mkp["results"]:
    if r["config"] not in pcfg: pcfg.append(r["config"])
pr = {(r["config"], r["tokens"]): r for r in mkp["results"]}
print("| prompt | llama.cpp | " + " | ".join(f"minikv {c}" for c in pcfg) + " |")
print("|---|---|" + "---|" * len(pcfg))
for n in sorted(set(pre) | {k[1] for k in pr}):
    cells = [f"{pr[(c, n)]['tokens_per_s']:.1f}" + (f" (x{pr[(c, n)]['tokens_per_s'] / pre.ts(n):.2f})" if n in pre else "") if (c, n) in pr else "-" for c in pcfg]
    print(f"| {n} | {pre.cell(n)} | " + " | ".join(cells) + " |")
PY
