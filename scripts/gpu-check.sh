#!/usr/bin/env bash
# The one unattended check for a machine with an NVIDIA GPU and its driver,
# written to run there without network and without a Rust toolchain:
#   0. binaries: gpu-bundle/ when present (built on another machine by
#      scripts/gpu-bundle.sh: stripped, portable x86-64-v3, CUBINs for
#      sm_80..sm_100, so the GPU needs neither NVRTC nor a PTX JIT); else
#      built here with cargo (then NVRTC from third_party/cuda compiles the
#      CUBIN at load);
#   1. the machine: GPU, driver, CPU flags and glibc against the bundle's
#      needs (a clear line instead of an obscure crash);
#   2. the CUDA backend's parity checks against minikv's CPU reference, with
#      every launch synchronized and checked (MINIKV_CUDA_CHECK=1): small
#      and model-sized shapes (32 query / 8 KV heads, d = 128, 32K tokens);
#      the device's info (driver, image loaded, registers and local bytes
#      per kernel as the driver reports them, memory bandwidth bound, a
#      measured device-to-device copy); prefill with A_cumul at 32K tokens
#      on tensor cores, their pipelined form and the scalar f32 kernels
#      (tokens/s, attention TFLOP/s, host transfers included; on tensor
#      cores also the kernels alone, operands on the device, beside
#      FlashAttention-2's published figures; every prefill check runs on each, the
#      pipelined rows also saying whether they have the plain tensor-core
#      kernel's bits); a failing group of checks
#      is reported and the others still run;
#   3. ptxas registers, static shared memory and spills (from the bundle,
#      computed at build);
#   4. decode attention (bench attention, 32/8 heads, d = 128) at 16K and
#      128K tokens on cuda (the fast decode kernel, its staged form and the
#      general kernel: MINIKV_CUDA_DECODE; the fast one also with synchronous
#      copies, MINIKV_CUDA_PINNED=0) and on the CPU: us/token and
#      achieved bandwidth
#      (bytes read per token / time) against the device's bound and the
#      measured copy, and the marginal bandwidth from 16K to 128K (the
#      kernels' own, without the fixed host round trip of a call);
#   4b. where Nsight Compute can read the counters: each decode kernel's
#      own duration and DRAM bytes at 128K tokens (fast, staged, general),
#      and the combination's with up to 32 split lanes and with 4; then the
#      fast and staged kernels' instructions, occupancy and stall reasons;
#   5. with the real model (assets/, else the bundle's first blocks of
#      it): MiniKV 2-bit generation with backend = "cuda" (fast and staged
#      decode) against backend = "tiled" (same greedy tokens); then many
#      sequences at once: `minikv serve` on cuda answers three requests
#      sent together, each as `generate` answers it alone, decoded in
#      shared engine steps (scripts/serve-check.py);
#   6. last, the small shapes again under compute-sanitizer (memcheck) when
#      the machine has it and it can attach (gVisor refuses it), and the
#      small decode and pipelined prefill cases under its racecheck
#      (shared-memory hazards).
# Writes $OUT (or results/gpu-check/): one file per step and summary.json,
# and prints a short report. Budget: under 8 minutes (GPUCHECK_BUDGET, 470
# seconds: past it, the optional timings are skipped first, each with a
# line that says so). GPUCHECK_QUICK=1
# (a rerun after a kernel change, when device time is short): steps 4 and
# 4b time only the fast and the staged kernel (no general kernel, no CPU).
QUICK=${GPUCHECK_QUICK:-0}
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-results/gpu-check}
mkdir -p "$OUTDIR"
status=0
fail() { echo "  FAILED: $*"; status=1; }
# The whole check's budget in seconds (GPUCHECK_BUDGET; the goal is under 8
# minutes, and a device run is cut at 9). within LIMIT RESERVE: a step's
# timeout, at most LIMIT, leaving RESERVE seconds to the steps after it; 0
# (the step is skipped, with a line that says so) when under 15 would be
# left. The optional timings give way first, so that the real model's
# tokens and the sanitizers' verdicts come back from a run that runs long.
BUDGET=${GPUCHECK_BUDGET:-470}
within() {
  local t=$((BUDGET - SECONDS - $2))
  [ "$t" -gt "$1" ] && t=$1
  [ "$t" -lt 15 ] && t=0
  echo "$t"
}
# The bundle carries its binaries gzipped (scripts/gpu-bundle.sh).
if [ -f gpu-bundle/bin.tar.gz ] && [ ! -x gpu-bundle/bin/minikv ]; then
  tar xzf gpu-bundle/bin.tar.gz -C gpu-bundle || { echo "gpu-check: cannot unpack gpu-bundle/bin.tar.gz" >&2; exit 1; }
fi
if [ -x gpu-bundle/bin/minikv ] && [ -x gpu-bundle/bin/minikv-kernels-gpucheck ]; then
  BIN=gpu-bundle/bin
  CHECK=$BIN/minikv-kernels-gpucheck
  echo "== binaries: gpu-bundle ($(python3 -c 'import json;m=json.load(open("gpu-bundle/MANIFEST.json"));print(m["git_revision"], m["cpu_baseline"], "glibc>=" + m["needs_glibc"])' 2>/dev/null))"
elif command -v cargo >/dev/null; then
  TOOLS=$(./scripts/fetch-cuda-tools.sh) || exit 1
  export LD_LIBRARY_PATH="$PWD/$TOOLS/lib:${LD_LIBRARY_PATH:-}"
  cargo build --release -q -p minikv-kernels --bins --example gpucheck || exit 1
  cargo build --release -q -p minikv-cli || exit 1
  BIN=target/release
  CHECK=$BIN/examples/gpucheck
  echo "== binaries: built here"
else
  echo "gpu-check: no gpu-bundle/ (scripts/gpu-bundle.sh makes one) and no cargo to build with" >&2
  exit 1
fi
[ -d third_party/cuda/lib ] && export LD_LIBRARY_PATH="$PWD/third_party/cuda/lib:${LD_LIBRARY_PATH:-}"

echo "== machine"
{
  uname -m
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv,noheader 2>&1 || echo "nvidia-smi: not found"
  ldd --version 2>&1 | head -1
  grep -m1 -o -w -E 'avx2|fma|f16c' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
} | tee "$OUTDIR/machine.txt"
if [ "$(uname -m)" != x86_64 ]; then fail "the binaries are x86_64, this machine is $(uname -m)"; fi
for f in avx2 fma f16c; do
  grep -q -w "$f" /proc/cpuinfo || fail "the CPU lacks $f (the bundle is built for x86-64-v3)"
done

# Parity and the real-model run check every launch (a synchronization and
# an error check after each); the timings below run without it.
echo "== parity on the device (every launch synchronized and checked)"
export MINIKV_CUDA_CHECK=1
timeout 240 "$CHECK" > "$OUTDIR/device.json" 2> "$OUTDIR/device.log" || fail "parity (exit $?: $(tail -2 "$OUTDIR/device.log"))"
[ -s "$OUTDIR/device.json" ] && python3 - "$OUTDIR/device.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
i = r.get("info", {})
print(f"device: {r['device']}  image: {i.get('image')}  bound: {i.get('peak_bandwidth_gb_s')} GB/s  ok: {r['ok']}")
for c in r["checks"]:
    errs = {k: v for k, v in c.items() if k.endswith("err") or k.endswith("equal") or k.endswith("values") or k.startswith("same_bits") or k in ("tokens", "t", "path", "kernel", "split", "error")}
    print(f"  {'ok ' if c['ok'] else 'BAD'} {c['check']}: {errs}")
print("  registers (driver):", {k: v.get("registers") for k, v in sorted(i.get("kernels", {}).items())})
for path, p in r["prefill"].items():
    if "error" in p:
        print(f"  prefill on {path}: FAILED: {p['error']}")
        continue
    print(f"  prefill on {path}, {p['tokens']} tokens (32/8 heads, d=128, A_cumul): "
          f"{p['tokens_per_s']:.0f} tokens/s, {p['attention_tflop_s']:.1f} attention TFLOP/s"
          f" (without A_cumul: {p['tokens'] / p['seconds_without_cumulative']:.0f} tokens/s, "
          f"{p['attention_tflop_s_without_cumulative']:.1f} TFLOP/s)")
    k = p.get("kernels")
    if k:
        t = k["times"]
        print(f"    kernels alone (operands on the device, best of {t['runs']}): "
              f"{t['forward_kernel']} {t['forward_seconds'] * 1e3:.1f} ms = {k['forward_tflop_s']:.1f} TFLOP/s; "
              f"{t['column_sums_kernel']} {(t['column_sums_seconds'] or 0) * 1e3:.1f} ms; together "
              f"{k['tokens_per_s']:.0f} tokens/s, {100 * k['share_of_call']:.0f}% of the call "
              f"(the rest: uploads, host fp16 conversions, the download)")
        print(f"    FlashAttention-2's published forward: 160-230 TFLOP/s on an A100 (50-73% of 312), "
              f"up to 335 on an H100: the forward kernel is at {k['forward_tflop_s'] / 335:.0%} of the H100 figure")
plain, pipe = r["prefill"].get("tensor_cores", {}), r["prefill"].get("tensor_cores_pipelined", {})
if "seconds" in plain and "seconds" in pipe:
    print(f"  pipelined against plain tensor cores: x{plain['seconds'] / pipe['seconds']:.2f} with A_cumul, "
          f"x{plain['seconds_without_cumulative'] / pipe['seconds_without_cumulative']:.2f} without "
          f"(above 1: the pipelined kernels are faster)")
    kp, kq = plain.get("kernels"), pipe.get("kernels")
    if kp and kq:
        a, b = kp["times"], kq["times"]
        print(f"  kernels alone, pipelined against plain: forward x{a['forward_seconds'] / b['forward_seconds']:.2f}, "
              f"A_cumul x{(a['column_sums_seconds'] or 0) / (b['column_sums_seconds'] or 1):.2f}")
PY

echo "== ptxas (sm_80, sm_90)"
PTXAS_JSON=gpu-bundle/ptxas.json
if [ "$BIN" != gpu-bundle/bin ]; then
  "$BIN/minikv-kernels-check" --ptxas "$TOOLS/bin/ptxas" --out "$OUTDIR/ptx" > "$OUTDIR/ptxas.json" || fail "ptxas"
  PTXAS_JSON=$OUTDIR/ptxas.json
fi
[ -s "$PTXAS_JSON" ] && python3 - "$PTXAS_JSON" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for arch in ("sm_80", "sm_90"):
    ks = r.get(arch, {})
    print(arch, ", ".join(f"{k}: {v.get('registers')} regs, {v.get('shared_bytes')} B smem, {v.get('spill_stores')} B spilled" for k, v in ks.items()))
PY

echo "== decode attention (32/8 heads, d = 128): cuda and the CPU"
# Each step decodes several layers' caches in turn (--layers), so that a
# step's data (16K: 8 x 17-67 MB; 128K: 2 x 134-537 MB) is well past the
# GPU's L2 cache (50-60 MB) and the time is that of reading device memory.
unset MINIKV_CUDA_CHECK
for tl in 16384:8 131072:2; do
  t=${tl%:*} layers=${tl#*:}
  # cuda-staged: the fast kernel's staged form (MINIKV_CUDA_DECODE=staged);
  # cuda-general: the general decode kernel (MINIKV_CUDA_DECODE=general),
  # the fast one's baseline.
  # cuda-sync: the fast kernel with synchronous copies from pageable memory
  # (MINIKV_CUDA_PINNED=0), the host path before the pinned one.
  # cuda-lanes4: the fast kernel with the splits' combination in blocks of
  # 4 split lanes whatever the split count (MINIKV_CUDA_COMBINE_LANES=4),
  # as it was before it took up to 32.
  backends="cuda cuda-staged cuda-sync cuda-lanes4 cuda-general tiled"
  [ "$QUICK" = 1 ] && backends="cuda cuda-staged"
  for be in $backends; do
    kernel=fast pinned=1 lanes=
    case $be in cuda-sync) pinned=0 ;; cuda-lanes4) lanes=4 ;; cuda-*) kernel=${be#cuda-} ;; esac
    # The fast and staged rows always run; the others leave 260 seconds to
    # the fast and staged kernels' counters, the real model and the sanitizers.
    limit=150
    case $be in cuda | cuda-staged) ;; *) limit=$(within 150 260) ;; esac
    if [ "$limit" = 0 ]; then
      echo "  (bench attention $be $t: skipped, too little is left of the budget of $BUDGET s)"
      continue
    fi
    MINIKV_CUDA_DECODE=$kernel MINIKV_CUDA_PINNED=$pinned MINIKV_CUDA_COMBINE_LANES=$lanes timeout "$limit" \
      "$BIN/minikv" bench attention --tokens "$t" --q-heads 32 --kv-heads 8 --head-dim 128 \
      --layers "$layers" --backend "${be%%-*}" --seconds 1 --json > "$OUTDIR/bench-attention-$be-$t.json" 2>> "$OUTDIR/bench.log" \
      || fail "bench attention $be $t (exit $?)"
  done
done
python3 - "$OUTDIR" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
bound = copy = None
try:
    dj = json.load(open(os.path.join(out, "device.json")))
    bound = dj["info"].get("peak_bandwidth_gb_s")
    copy = dj.get("copy_bandwidth", {}).get("copy_gb_s")
except Exception:
    pass
if copy:
    print(f"  device-to-device copy: {copy:.0f} GB/s (read + written), datasheet bound {bound} GB/s")
rows = []
for f in sorted(glob.glob(os.path.join(out, "bench-attention-*.json"))):
    try:
        r = json.load(open(f))
    except Exception:
        continue
    label = os.path.basename(f)[len("bench-attention-"):].rsplit("-", 1)[0]
    gpu = label.startswith("cuda")
    for x in r["results"]:
        if not x.get("seconds_per_token"):
            continue
        gbs = x["bytes_read_per_token"] / x["seconds_per_token"] / 1e9
        frac = f"{100 * gbs / bound:5.1f}% of {bound:.0f} GB/s" if bound and gpu else ""
        if copy and gpu:
            frac += f", {100 * gbs / copy:5.1f}% of copy"
        print(f"  {label:<12} {r['tokens']:>7} {x['cache'][:44]:<44} {x['seconds_per_token'] * 1e6:9.1f} us/token {gbs:8.1f} GB/s {frac}")
        rows.append({"backend": label, "tokens": r["tokens"], "cache": x["cache"],
                     "us_per_token": x["seconds_per_token"] * 1e6, "gb_s": gbs,
                     "fraction_of_bound": gbs / bound if bound and gpu else None,
                     "fraction_of_copy": gbs / copy if copy and gpu else None})
# Every cuda call pays a fixed host round trip (query up, output down, two
# launches); the marginal bandwidth between the two depths, extra bytes over
# extra time, is the kernels' own.
marginal = {}
for x in rows:
    if not x["backend"].startswith("cuda") or x["tokens"] != 16384:
        continue
    y = next((z for z in rows if z["backend"] == x["backend"] and z["tokens"] == 131072 and z["cache"] == x["cache"]), None)
    if not y or y["us_per_token"] <= x["us_per_token"]:
        continue
    b16, b128 = x["gb_s"] * x["us_per_token"] * 1e3, y["gb_s"] * y["us_per_token"] * 1e3
    gbs = (b128 - b16) / ((y["us_per_token"] - x["us_per_token"]) * 1e3)
    key = f"{x['backend']}: {x['cache']}"
    marginal[key] = {"gb_s": gbs, "overhead_us": x["us_per_token"] - b16 / gbs / 1e3,
                     "fraction_of_bound": gbs / bound if bound else None,
                     "fraction_of_copy": gbs / copy if copy else None}
    print(f"  {x['backend']:<12} marginal 16K->128K {x['cache'][:40]:<40} {gbs:8.1f} GB/s"
          + (f" ({100 * gbs / bound:.1f}% of bound" if bound else " (")
          + (f", {100 * gbs / copy:.1f}% of copy)" if copy else ")")
          + f"; fixed cost per call {marginal[key]['overhead_us']:.1f} us")
json.dump({"bandwidth_bound_gb_s": bound, "copy_gb_s": copy, "decode": rows, "marginal": marginal}, open(os.path.join(out, "decode-bandwidth.json"), "w"), indent=1)
PY

# The decode kernels alone, from the hardware counters where Nsight Compute
# can read them (not on gVisor): duration and DRAM bytes of each launch of
# the fp16 row (8 steps: 3 warm-up, 5 timed) and then the 2-bit row at 128K
# tokens, for the fast kernel, its staged form and the general one; with
# them each step's combination of the splits (mk_decode_combine), so that a
# call's time outside the decode kernel splits into that kernel and the
# host's share.
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  echo "== decode kernels under Nsight Compute (128K tokens, 32/8 heads, d = 128)"
  # KERNEL[-int8]: -int8 runs the 2-bit row with integer key products
  # (--arithmetic int8) instead of exact ones; fast-lanes4 times the
  # combination in blocks of 4 split lanes (MINIKV_CUDA_COMBINE_LANES=4).
  # In order of what the next decisions need; each leaves 180 seconds to
  # the real model and the sanitizers.
  kinds="fast staged staged-int8 fast-lanes4 fast-int8 general"
  [ "$QUICK" = 1 ] && kinds="fast staged staged-int8"
  for k in $kinds; do
    arith=exact lanes=
    case $k in *-int8) arith=int8 ;; *-lanes4) lanes=4 ;; esac
    limit=$(within 150 180)
    if [ "$limit" = 0 ]; then
      echo "  (ncu $k: skipped, too little is left of the budget of $BUDGET s)"
      continue
    fi
    MINIKV_CUDA_DECODE=${k%%-*} MINIKV_CUDA_COMBINE_LANES=$lanes timeout "$limit" "$NCU" --clock-control none \
      --kernel-name regex:'mk_decode_(fast|staged|partial|combine)' --launch-count 32 --csv \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      "$BIN/minikv" bench attention --tokens 131072 --q-heads 32 --kv-heads 8 --head-dim 128 \
      --backend cuda --bits 2 --arithmetic $arith --seconds 0.001 > "$OUTDIR/ncu-$k.csv" 2> "$OUTDIR/ncu-$k.log" \
      || echo "  (ncu $k: exit $?; $(tail -1 "$OUTDIR/ncu-$k.log"))"
  done
  # Why a decode kernel takes the time it takes, for the next change to
  # it: warp instructions executed (against docs/performance.md's counts),
  # issue activity, achieved occupancy and the stall reasons (cycles a warp
  # waits per issued instruction, by reason), the fp16 row then the 2-bit
  # row. A run of its own (ncu-diag-KIND), so that a metric this version
  # of Nsight Compute lacks costs these lines only.
  diag=sm__inst_executed.sum,smsp__issue_active.avg.per_cycle_active
  diag=$diag,sm__warps_active.avg.pct_of_peak_sustained_active
  diag=$diag,smsp__average_warps_active_per_issue_active.ratio
  for why in long_scoreboard short_scoreboard barrier mio_throttle lg_throttle math_pipe_throttle wait not_selected; do
    diag=$diag,smsp__average_warps_issue_stalled_${why}_per_issue_active.ratio
  done
  dkinds="staged fast staged-int8"
  [ "$QUICK" = 1 ] && dkinds="staged"
  for k in $dkinds; do
    arith=exact
    case $k in *-int8) arith=int8 ;; esac
    limit=$(within 120 180)
    if [ "$limit" = 0 ]; then
      echo "  (ncu diag $k: skipped, too little is left of the budget of $BUDGET s)"
      continue
    fi
    MINIKV_CUDA_DECODE=${k%%-*} timeout "$limit" "$NCU" --clock-control none \
      --kernel-name regex:'mk_decode_(fast|staged)' --launch-count 16 --csv --metrics "$diag" \
      "$BIN/minikv" bench attention --tokens 131072 --q-heads 32 --kv-heads 8 --head-dim 128 \
      --backend cuda --bits 2 --arithmetic $arith --seconds 0.001 > "$OUTDIR/ncu-diag-$k.csv" 2> "$OUTDIR/ncu-diag-$k.log" \
      || echo "  (ncu diag $k: exit $?; $(tail -1 "$OUTDIR/ncu-diag-$k.log"))"
  done
  python3 "$(dirname "$0")/ncu-summary.py" "$OUTDIR"
else
  echo "== (Nsight Compute not on this machine: kernel counters skipped)"
fi

# The real model; a device run that cannot carry it (98 MB) uses the bundle's
# copy of its first blocks (scripts/gpu-bundle.sh): the same weights, fewer
# layers, enough to compare two backends token for token.
MODEL=assets/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || MODEL=gpu-bundle/model.gguf
if [ -f "$MODEL" ]; then
  echo "== MiniKV 2-bit on the real model ($MODEL): cuda against tiled"
  export MINIKV_CUDA_CHECK=1
  PROMPT="Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do"
  # cuda-staged: backend = "cuda" with MINIKV_CUDA_DECODE=staged.
  for be in cuda cuda-staged tiled; do
    { echo "backend = \"${be%%-*}\""; cat configs/minikv.toml; } > "$OUTDIR/minikv-$be.toml"
    kernel=fast
    [ "$be" = cuda-staged ] && kernel=staged
    MINIKV_CUDA_DECODE=$kernel timeout 120 "$BIN/minikv" generate --model "$MODEL" --config "$OUTDIR/minikv-$be.toml" --prompt "$PROMPT" --max-tokens 32 --json > "$OUTDIR/generate-$be.json" || fail "generate $be"
  done
  [ -s "$OUTDIR/generate-cuda.json" ] && python3 - "$OUTDIR/generate-tiled.json" "$OUTDIR/generate-cuda.json" "$OUTDIR/generate-cuda-staged.json" <<'PY' || fail "greedy tokens differ"
import json, sys
b = json.load(open(sys.argv[1]))
same_all = True
for p in sys.argv[2:]:
    try:
        a = json.load(open(p))
    except Exception as e:
        print(f"  {p}: {e}")
        same_all = False
        continue
    same = a["tokens"] == b["tokens"]
    same_all &= same
    print(f"  {p.rsplit('generate-', 1)[1][:-5]}: same greedy tokens as tiled: {same}; kv bytes {a['memory']['kv_bytes']} vs {b['memory']['kv_bytes']}; "
          f"decode {a['decode_tokens_per_s']:.1f} vs {b['decode_tokens_per_s']:.1f} tok/s")
sys.exit(0 if same_all else 1)
PY
  # Many sequences at once: the server on the device answers three requests
  # sent together (the engine's sequences calling the backend from their
  # own threads), each as `generate` answers it alone. A residual of 16
  # tokens, so that requests of about 50 prompt tokens write and read 2-bit
  # codes.
  limit=$(within 90 180)
  if [ "$limit" = 0 ]; then
    echo "== (minikv serve on cuda: skipped, too little is left of the budget of $BUDGET s)"
  else
    echo "== many sequences at once: minikv serve (cuda), three requests together, each against generate alone"
    sed 's/^residual = 128$/residual = 16/' "$OUTDIR/minikv-cuda.toml" > "$OUTDIR/serve-cuda.toml"
    grep -q '^residual = 16$' "$OUTDIR/serve-cuda.toml" || fail "serve config: no residual line to shorten"
    timeout "$limit" python3 "$(dirname "$0")/serve-check.py" "$BIN/minikv" "$MODEL" "$OUTDIR/serve-cuda.toml" \
      || fail "serve on cuda (exit $?)"
  fi
else
  echo "== (no model: the real-model comparison is skipped; ./scripts/fetch-assets.sh fetches it)"
fi
# Last, as the slowest step: the small shapes again under the memory checker
# (every launch checked for out-of-bounds and misaligned accesses).
export MINIKV_CUDA_CHECK=1
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
# sanitize NAME TOOL TIMEOUT [VAR=VALUE...]: the check binary under the
# sanitizer's TOOL, its report in NAME.json / NAME.log.
sanitize() {
  local name=$1 tool=$2 limit=$3 rc
  shift 3
  if [ "$limit" = 0 ]; then
    echo "-- compute-sanitizer $tool: skipped, too little is left of the budget of $BUDGET s"
    return
  fi
  env "$@" timeout "$limit" "$SANITIZER" --tool "$tool" --error-exitcode 9 "$CHECK" \
    > "$OUTDIR/$name.json" 2> "$OUTDIR/$name.log"
  rc=$?
  tail -3 "$OUTDIR/$name.log"
  if [ "$rc" != 0 ]; then
    # Some virtualized machines (gVisor) refuse the sanitizer: no verdict.
    if grep -q -i "device not supported" "$OUTDIR/$name.log"; then
      echo "-- compute-sanitizer cannot attach on this machine (exit $rc): skipped"
    else
      fail "compute-sanitizer $tool (exit $rc; $OUTDIR/$name.log)"
    fi
  fi
}
if [ -n "$SANITIZER" ]; then
  echo "== small shapes under compute-sanitizer --tool memcheck ($SANITIZER)"
  sanitize sanitizer memcheck "$(within 150 60)" GPUCHECK_TOKENS=2048 GPUCHECK_PREFILL=1024
  # The kernels that fill shared memory by asynchronous copies again under
  # the race checker: mk_decode_staged (which reuses it for its final sums)
  # and mk_prefill_mma_pipe (two tiles, each refilled while the other is
  # read); only the small cases: racecheck is slow.
  echo "== small decode and pipelined prefill cases under compute-sanitizer --tool racecheck"
  sanitize racecheck racecheck "$(within 120 0)" GPUCHECK_ONLY=staged
else
  echo "== (compute-sanitizer not on this machine: skipped)"
fi
python3 - "$OUTDIR" "$status" <<'PY'
import json, os, sys
out, status = sys.argv[1], int(sys.argv[2])
s = {"passed": status == 0}
for name in ("device", "decode-bandwidth"):
    try:
        s[name] = json.load(open(os.path.join(out, name + ".json")))
    except Exception as e:
        s[name] = f"missing: {e}"
json.dump(s, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
echo "== $SECONDS s of the budget's $BUDGET"
if [ "$status" = 0 ]; then echo "gpu-check: passed"; else echo "gpu-check: FAILED"; fi
exit "$status"
