#!/usr/bin/env bash
# The tests, in one command on a fresh clone: fetches what they need (the
# real model and texts, checksummed; idempotent), then runs every crate's
# tests. Extra arguments go to `cargo test` (e.g. `-p minikv-server`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-assets.sh >&2
cargo test --workspace "$@"
