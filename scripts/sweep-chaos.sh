#!/usr/bin/env bash
# Kills, corrupts and races sweeps on one results file, then checks that the
# file ends with exactly one row per key of the grid and that every bad line
# was moved to <file>.rejected. Bounded: ROUNDS (4) rounds of 3 concurrent
# sweeps, each killed at a random moment, garbage appended between rounds.
# Usage: scripts/sweep-chaos.sh [OUT_DIR]   (BIN, ROUNDS, SEED from env)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-target/release/minikv}
[ -x "$bin" ] || cargo build --release -q -p minikv-cli
out=${1:-$(mktemp -d)}
mkdir -p "$out"
f="$out/chaos.jsonl"
rm -f "$f" "$f.rejected" "$f.lock"
rounds=${ROUNDS:-4}
RANDOM=${SEED:-7}
grid=(sweep configs/minikv.toml --set cache.heavy=0.05,0.1,0.15,0.2,0.25,0.3 --seeds 2
      --task fidelity --context 64 --tokens 4 --quiet --out "$f")
for r in $(seq 1 "$rounds"); do
  pids=()
  for _ in 1 2 3; do "$bin" "${grid[@]}" 2>/dev/null & pids+=($!); done
  sleep "0.$((RANDOM % 9 + 1))"
  kill -9 "${pids[$((RANDOM % 3))]}" 2>/dev/null || true
  for p in "${pids[@]}"; do wait "$p" || true; done
  # Corrupt: a junk line, a torn row, bytes that are not UTF-8.
  printf 'junk %s\n{"key": "torn' "$r" >> "$f"
  printf '\n\xff\xfe\n' >> "$f"
  echo "round $r: $(wc -l < "$f") lines" >&2
done
"$bin" "${grid[@]}"
python3 - "$f" <<'PY'
import collections, json, sys
f = sys.argv[1]
keys = collections.Counter(json.loads(l)["key"] for l in open(f, encoding="utf-8"))
rej = sum(1 for _ in open(f + ".rejected", encoding="utf-8"))
want = 6 * 2
dups = {k: n for k, n in keys.items() if n > 1}
print(f"{len(keys)} keys (want {want}), duplicates {dups or 'none'}, {rej} lines moved aside")
sys.exit(0 if len(keys) == want and not dups else 1)
PY
