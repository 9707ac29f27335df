#!/usr/bin/env bash
# Records the fidelity and perplexity numbers of every preset in configs/ on the
# real model, one JSON line per (preset, task), for before/after comparisons of
# a refactor: `scripts/preset-numbers.sh > before.jsonl`, change the code,
# `scripts/preset-numbers.sh > after.jsonl`, then
# `scripts/preset-numbers.sh --compare before.jsonl after.jsonl` (tolerance
# 1e-6 relative; wall-clock fields, `*_seconds`, are not compared).
#
# `scripts/preset-numbers.sh --check` (what CI runs) records the tasks in
# TASKS (default: fidelity) for every preset and compares them with the
# committed record, scripts/preset-numbers.jsonl; a change that moves a
# preset's numbers on purpose rewrites that record (`> scripts/preset-numbers.jsonl`)
# and says why in its commit.
# Knobs (env): CONTEXT (384), TOKENS (24), TASKS ("fidelity perplexity"),
# BIN (target/release/minikv).
set -euo pipefail
cd "$(dirname "$0")/.."
compare() {
  python3 - "$1" "$2" "${3:-}" <<'PY'
import json, sys
def load(p):
    return {(r["config"], r["task"]): r["metrics"] for r in map(json.loads, open(p))}
a, b = load(sys.argv[1]), load(sys.argv[2])
subset = sys.argv[3] == "subset"  # only the rows of the second file
bad = 0
for k in sorted(set(b) if subset else set(a) | set(b)):
    if k not in a or k not in b:
        print("missing", k); bad += 1; continue
    for m in sorted(set(a[k]) | set(b[k])):
        if m.endswith("_seconds"):
            continue
        x, y = a[k].get(m), b[k].get(m)
        if (x is None) != (y is None):
            print(f"DIFF {k} {m}: {x} -> {y}"); bad += 1; continue
        if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
            continue
        if abs(x - y) > 1e-6 * max(1.0, abs(x)):
            print(f"DIFF {k} {m}: {x} -> {y}"); bad += 1
n = len(b) if subset else len(a)
print(f"{n} rows compared, {bad} differences")
sys.exit(1 if bad else 0)
PY
}
if [ "${1:-}" = "--compare" ]; then
  compare "$2" "$3"
  exit
fi
record() {
  local bin=${BIN:-target/release/minikv}
  local ctx=${CONTEXT:-384} toks=${TOKENS:-24}
  for cfg in configs/*.toml; do
    for task in $1; do
      "$bin" eval --config "$cfg" --task "$task" --context "$ctx" --tokens "$toks" --json \
        | python3 -c '
import json, sys
r = json.load(sys.stdin)
m = {k: v for k, v in r["metrics"].items() if isinstance(v, (int, float))}
print(json.dumps({"config": sys.argv[1], "task": sys.argv[2], "metrics": m}, sort_keys=True))' "$cfg" "$task"
    done
  done
}
if [ "${1:-}" = "--check" ]; then
  out=$(mktemp)
  trap 'rm -f "$out"' EXIT
  record "${TASKS:-fidelity}" > "$out"
  compare scripts/preset-numbers.jsonl "$out" subset
  exit
fi
record "${TASKS:-fidelity perplexity}"
