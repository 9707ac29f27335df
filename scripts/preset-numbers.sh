#!/usr/bin/env bash
# Records the fidelity and perplexity numbers of every preset in configs/ on the
# real model, one JSON line per (preset, task), for before/after comparisons of
# a refactor: `scripts/preset-numbers.sh > before.jsonl`, change the code,
# `scripts/preset-numbers.sh > after.jsonl`, then
# `scripts/preset-numbers.sh --compare before.jsonl after.jsonl` (tolerance 1e-6).
# Knobs (env): CONTEXT (384), TOKENS (24), BIN (target/release/minikv).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--compare" ]; then
  python3 - "$2" "$3" <<'PY'
import json, sys
def load(p):
    return {(r["config"], r["task"]): r["metrics"] for r in map(json.loads, open(p))}
a, b = load(sys.argv[1]), load(sys.argv[2])
bad = 0
for k in sorted(set(a) | set(b)):
    if k not in a or k not in b:
        print("missing", k); bad += 1; continue
    for m in sorted(set(a[k]) | set(b[k])):
        x, y = a[k].get(m), b[k].get(m)
        if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
            continue
        if abs(x - y) > 1e-6 * max(1.0, abs(x)):
            print(f"DIFF {k} {m}: {x} -> {y}"); bad += 1
print(f"{len(a)} rows compared, {bad} differences")
sys.exit(1 if bad else 0)
PY
  exit
fi
bin=${BIN:-target/release/minikv}
ctx=${CONTEXT:-384}; toks=${TOKENS:-24}
for cfg in configs/*.toml; do
  for task in fidelity perplexity; do
    "$bin" eval --config "$cfg" --task "$task" --context "$ctx" --tokens "$toks" --json \
      | python3 -c '
import json, sys
r = json.load(sys.stdin)
m = {k: v for k, v in r["metrics"].items() if isinstance(v, (int, float))}
print(json.dumps({"config": sys.argv[1], "task": sys.argv[2], "metrics": m}, sort_keys=True))' "$cfg" "$task"
  done
done
