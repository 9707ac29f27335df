#!/usr/bin/env bash
# Drives `minikv serve` with the official `openai` Python client (pinned,
# installed into the git-ignored venv .venv-openai from PyPI): completions,
# chat, streaming, logprobs, 64 concurrent streaming clients, cancellation,
# bad inputs; greedy answers must equal `minikv generate` with the same
# config (scripts/openai_client_check.py). The server listens on a free
# loopback port and is stopped when the checks end.
# Knobs (env): BIN (target/release/minikv if built, else target/debug/minikv,
# built when missing), CONFIG (configs/minikv.toml), PY (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
OPENAI_VERSION=3.57.0
CONFIG=${CONFIG:-configs/minikv.toml}
[ -f assets/SmolLM2-135M-Instruct.Q4_1.gguf ] || ./scripts/fetch-assets.sh >&2
if [ -z "${BIN:-}" ]; then
  if [ -x target/release/minikv ]; then BIN=target/release/minikv
  else cargo build -q -p minikv-cli; BIN=target/debug/minikv; fi
fi
VENV=.venv-openai
if ! "$VENV/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  "${PY:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install -q "openai==$OPENAI_VERSION"
fi
LOG=$(mktemp)
"$BIN" serve --config "$CONFIG" --port 0 --kv-budget 512MiB >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -f "$LOG"' EXIT
URL=""
for _ in $(seq 1 300); do
  URL=$(grep -o 'listening on http://[0-9.:]*' "$LOG" | head -1 | sed 's/listening on //') || true
  [ -n "$URL" ] && break
  kill -0 $PID 2>/dev/null || { cat "$LOG" >&2; echo "openai-client-test: the server exited" >&2; exit 1; }
  sleep 0.2
done
[ -n "$URL" ] || { echo "openai-client-test: the server did not start" >&2; exit 1; }
"$VENV/bin/python" scripts/openai_client_check.py "$URL" "$BIN" "$CONFIG"
