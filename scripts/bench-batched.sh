#!/usr/bin/env bash
# Batched decode side by side with llama.cpp's llama-batched-bench: the same
# GGUF, the same threads, NPP-token prompts, NTG generated tokens, NPL parallel
# sequences (1, 4, 16). llama.cpp runs with flash attention off and on and the
# faster is kept per row; minikv runs `bench throughput` with every sequence
# admitted and prefilled at once (its decode tokens/s is measured over the
# steps where all admitted sequences only decode, as llama-batched-bench's
# S_TG is). Prints one markdown table with ratios. llama.cpp is built once by
# scripts/build-llamacpp.sh. On a CPU that advertises AMX inside a VM that
# does not grant AMX state, llama.cpp's repacked (AMX) weight buffers die with
# SIGILL in batched prompt processing; REPACK=0 (the default when the CPU
# lists amx_int8) passes -nr, which keeps llama.cpp's plain CPU kernels.
# Knobs (env): MODEL (the fetched SmolLM2 GGUF),
# THREADS (nproc), NPP (1024), NTG (64), NPL (1,4,16), OUT
# (results/bench-batched), CONFIGS (configs/full.toml configs/minikv.toml),
# Q8 (1: also minikv with `--activations q8`), ISA (native; avx2: both
# sides without AVX-512, as in scripts/bench-llamacpp.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-assets/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
NPP=${NPP:-1024}
NTG=${NTG:-64}
NPL=${NPL:-1,4,16}
OUT=${OUT:-results/bench-batched}
CONFIGS=${CONFIGS:-configs/full.toml configs/minikv.toml}
Q8=${Q8:-1}
ISA=${ISA:-native}
if grep -q amx_int8 /proc/cpuinfo 2>/dev/null; then REPACK=${REPACK:-0}; else REPACK=${REPACK:-1}; fi
NR=()
[ "$REPACK" = 0 ] && NR=(-nr)
mkdir -p "$OUT"
[ -f "$MODEL" ] || ./scripts/fetch-assets.sh >&2
BIN=$(ISA=$ISA ./scripts/build-llamacpp.sh)
MK=$(ISA=$ISA ./scripts/build-minikv.sh)
[ "$ISA" = avx2 ] && export MINIKV_MAX_ISA=avx2
maxpl=$(echo "$NPL" | tr ',' '\n' | sort -n | tail -1)
CTX=$(( maxpl * (NPP + NTG) ))
# Result files are kept: a rerun measures only what is missing.
for fa in 0 1; do
  f="$OUT/llamacpp-fa$fa.jsonl"
  [ -s "$f" ] && continue
  echo "bench-batched: llama-batched-bench -fa $fa" >&2
  "$BIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -c "$CTX" -b 2048 -ub 512 \
    -npp "$NPP" -ntg "$NTG" -npl "$NPL" -fa "$([ $fa = 1 ] && echo on || echo off)" \
    "${NR[@]}" --output-format jsonl > "$f.part" 2> "$OUT/llamacpp-fa$fa.log"
  mv "$f.part" "$f"
done
CFG_ARGS=()
for c in $CONFIGS; do CFG_ARGS+=(--config "$c"); done
for act in f32 q8; do
  [ "$act" = q8 ] && [ "$Q8" != 1 ] && continue
  for p in $(echo "$NPL" | tr ',' ' '); do
    f="$OUT/minikv-$act-$p.json"
    [ -s "$f" ] && continue
    echo "bench-batched: minikv bench throughput, $p sequences, activations $act" >&2
    RAYON_NUM_THREADS=$THREADS $MK bench throughput --model "$MODEL" "${CFG_ARGS[@]}" \
      --activations "$act" --kv-budget 64GiB --prompt "$NPP" --gen "$NTG" \
      --requests "$p" --max-batch "$p" --max-prefills "$p" --json > "$f.part"
    mv "$f.part" "$f"
  done
done
python3 - "$OUT" "$NPL" <<'PY'
import json, sys, glob, os
out, npl = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
ll = {}
for fa in (0, 1):
    for line in open(os.path.join(out, f"llamacpp-fa{fa}.jsonl")):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "pl" not in r:
            continue
        best = ll.get(r["pl"])
        if best is None or r["speed_tg"] > best[0]:
            ll[r["pl"]] = (r["speed_tg"], fa, r["speed_pp"])
mk = {}
for f in glob.glob(os.path.join(out, "minikv-*.json")):
    d = json.load(open(f))
    for r in d["results"]:
        mk[(d["activations"], r["config"], r["requests"])] = r["decode_tok_per_s"]
cfgs = sorted({k[1] for k in mk})
acts = sorted({k[0] for k in mk})
head = ["parallel", "llama.cpp S_TG (fa)"] + [f"minikv {c} {a}" for a in acts for c in cfgs]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for p in npl:
    s, fa, _ = ll.get(p, (float("nan"), -1, 0))
    row = [str(p), f"{s:.1f} (fa {fa})"]
    for a in acts:
        for c in cfgs:
            v = mk.get((a, c, p))
            row.append("-" if v is None else f"{v:.1f} (x{v / s:.2f})")
    print("| " + " | ".join(row) + " |")
PY
