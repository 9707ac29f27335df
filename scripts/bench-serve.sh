#!/usr/bin/env bash
# Load tests of `minikv serve` beside llama.cpp's llama-server (built from the
# pinned sdist by scripts/build-llamacpp.sh): the same GGUF, the same threads,
# the same token-id prompts, driven by `minikv bench serve` (concurrent
# streaming clients, `ignore_eos`, greedy) against 127.0.0.1 only. Every run
# is bounded (--deadline) and every server is stopped when its run ends.
#
# Scenarios (SCENARIOS, default "short long budget"):
#   short   64 clients, 512-token prompts, 128 generated; llama-server with 64
#           slots (flash attention on and off), minikv full and MiniKV with a
#           budget that admits all.
#   long    16 clients, 4096-token prompts, 128 generated; llama-server with 16
#           slots, minikv full with a budget that admits all.
#   budget  the same 16 clients at one KV budget: llama-server's context sized
#           to BUDGET_SEQS (4) full sequences of 4224 tokens (f16 K and V) and
#           that many slots; minikv MiniKV (and full) with --kv-budget the same
#           bytes.
# On a CPU that advertises AMX inside a VM that does not grant AMX state,
# llama.cpp's repacked (AMX) weight buffers die with SIGILL (llama-server
# then exits while loading); REPACK=0, the default when the CPU lists
# amx_int8, passes -nr (llama.cpp's plain CPU kernels), its fastest setting
# that runs there.
# Rows (JSON, one per run) are appended to OUT (results/serve-bench.jsonl).
# Knobs (env): THREADS (2), FA_LONG (on), SCENARIOS, OUT, PORT (18080).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
SCENARIOS=${SCENARIOS:-"short long budget"}
OUT=${OUT:-results/serve-bench.jsonl}
PORT=${PORT:-18080}
FA_LONG=${FA_LONG:-on}
BUDGET_SEQS=${BUDGET_SEQS:-4}
MODEL=assets/SmolLM2-135M-Instruct.Q4_1.gguf
if grep -q amx_int8 /proc/cpuinfo 2>/dev/null; then REPACK=${REPACK:-0}; else REPACK=${REPACK:-1}; fi
NR=()
[ "$REPACK" = 0 ] && NR=(-nr)
[ -f "$MODEL" ] || ./scripts/fetch-assets.sh >&2
LLAMA=$(./scripts/build-llamacpp.sh)
cargo build --release -q -p minikv-cli
MINIKV=target/release/minikv
mkdir -p "$(dirname "$OUT")"
URL="http://127.0.0.1:$PORT"
PID=""
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=""; }
trap cleanup EXIT

wait_up() {
  for _ in $(seq 1 600); do
    if curl -sf "$URL/health" >/dev/null 2>&1; then return 0; fi
    kill -0 "$PID" 2>/dev/null || { echo "bench-serve: the server exited" >&2; return 1; }
    sleep 0.2
  done
  echo "bench-serve: the server did not come up" >&2; return 1
}

llama() { # label slots ctx fa
  "$LLAMA/llama-server" -m "$MODEL" -t "$THREADS" -tb "$THREADS" --parallel "$2" -c "$3" -fa "$4" "${NR[@]}" \
    --host 127.0.0.1 --port "$PORT" --log-disable >/dev/null 2>&1 &
  PID=$!
  wait_up
}

minikv() { # label config budget
  local cfg=()
  [ "$2" != full ] && cfg=(--config "configs/$2.toml")
  "$MINIKV" serve "${cfg[@]}" --kv-budget "$3" --port "$PORT" >/dev/null 2>&1 &
  PID=$!
  wait_up
}

load() { # label clients prompt
  "$MINIKV" bench serve --url "$URL" --clients "$2" --prompt "$3" --gen 128 --deadline 3000 --label "$1" --json \
    | tee -a "$OUT"
  cleanup
}

F16_PER_TOKEN=$((30 * 2 * 3 * 64 * 2)) # layers x (K, V) x KV heads x head dim x 2 bytes
for s in $SCENARIOS; do
  case "$s" in
    short)
      for fa in on off; do llama x 64 $((64 * 640)) "$fa"; load "llama-server fa=$fa, 64 slots" 64 512; done
      minikv x full 4GiB; load "minikv full" 64 512
      minikv x minikv 4GiB; load "minikv MiniKV" 64 512
      ;;
    long)
      llama x 16 $((16 * 4224)) "$FA_LONG"; load "llama-server fa=$FA_LONG, 16 slots" 16 4096
      minikv x full 4GiB; load "minikv full" 16 4096
      ;;
    budget)
      CTX=$((BUDGET_SEQS * 4224))
      BYTES=$((CTX * F16_PER_TOKEN))
      llama x "$BUDGET_SEQS" "$CTX" "$FA_LONG"; load "llama-server fa=$FA_LONG, $BUDGET_SEQS slots, KV $BYTES B" 16 4096
      minikv x minikv "$BYTES"; load "minikv MiniKV, KV budget $BYTES B" 16 4096
      minikv x full "$BYTES"; load "minikv full, KV budget $BYTES B" 16 4096
      ;;
    *) echo "bench-serve: unknown scenario $s" >&2; exit 2 ;;
  esac
done
