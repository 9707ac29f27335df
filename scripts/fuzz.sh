#!/usr/bin/env bash
# Coverage-guided fuzzing of every input minikv reads, for a bounded time:
#   scripts/fuzz.sh [SECONDS] [TARGET...]      (default: 600 s each, every target)
# Targets (fuzz/fuzz_targets/, bodies in fuzz/src/):
#   gguf         the GGUF reader, dequantization, model and tokenizer construction
#   config       TOML (or JSON) configs: parse, validate, build, prefill, decode
#   config_json  JSON configs, deep nesting included
#   report       `minikv report` on arbitrary results files (CSV checked)
#   dataset      the QA dataset reader (rows checked, write/read round trip)
#   cli          every command's flags, run in-process on the real model
# libFuzzer through libfuzzer-sys on the stable toolchain (no cargo-fuzz, no
# nightly): coverage instrumentation is passed in RUSTFLAGS, debug assertions
# and overflow checks are on (fuzz/Cargo.toml). Corpora grow in fuzz/corpus/
# (git-ignored); a finding is written to fuzz/artifacts/TARGET/ and makes the
# script exit 1 after the other targets ran. Reproduce one with
#   fuzz/target/*/release/TARGET fuzz/artifacts/TARGET/crash-...
# (with MINIKV_FUZZ_VERBOSE=1 the commands' output is shown; with
# MINIKV_FUZZ_LOG=FILE the cli target logs each command line and outcome).
# FUZZ_SEED=N fixes libFuzzer's seed (CI does, so its brief run is repeatable).
# FUZZ_JOBS=N runs N targets at once (default: one per core).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
shift || true
targets=("$@")
all=(gguf config config_json report dataset cli)
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
for t in "${targets[@]}"; do
  [[ " ${all[*]} " == *" $t "* ]] || { echo "unknown target $t (one of: ${all[*]})" >&2; exit 2; }
done
[ -f assets/SmolLM2-135M-Instruct.Q4_1.gguf ] || ./scripts/fetch-assets.sh

host=$(rustc -vV | sed -n 's/^host: //p')
echo "== building the fuzz targets ($host)"
# --target keeps the instrumentation off build scripts and proc macros;
# RUSTFLAGS replaces .cargo/config.toml's, so target-cpu=native is repeated
# (the SIMD paths users run are the ones fuzzed).
(cd fuzz && RUSTFLAGS="--cfg fuzzing -Ctarget-cpu=native -Cpasses=sancov-module \
  -Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
  -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares" \
  cargo build --release --bins --target "$host" ${CARGO_TERM_COLOR:+--color "$CARGO_TERM_COLOR"})
bin=$PWD/fuzz/target/$host/release

# Seed corpora, rebuilt each run (cheap): real files and the committed seeds.
seeds=$PWD/fuzz/target/seeds
rm -rf "$seeds"
mkdir -p "$seeds"/{gguf,config,config_json,report,dataset,cli}
model=assets/SmolLM2-135M-Instruct.Q4_1.gguf
for n in 64 512 4096 65536 1785700; do head -c $n "$model" > "$seeds/gguf/head_$n"; done
cp configs/*.toml "$seeds/config/"
python3 - "$seeds/config_json" configs/*.toml <<'PY'
import json, sys, tomllib, pathlib
out = pathlib.Path(sys.argv[1])
for p in sys.argv[2:]:
    with open(p, "rb") as f:
        out.joinpath(pathlib.Path(p).stem + ".json").write_text(json.dumps(tomllib.load(f)))
# Wrappers nested around a scorer, at and past the depth limit.
for depth in (8, 31, 40, 200):
    s = {"type": "snapkv"}
    for _ in range(depth):
        s = {"type": "chunk_kv", "chunk": 4, "scorer": s}
    out.joinpath(f"nested_{depth}.json").write_text(json.dumps({"cache": {"heavy": 0.1, "recent": 0.1, "scorer": s}}))
PY
cp fuzz/seeds/report/* "$seeds/report/"
cp fuzz/seeds/dataset/* "$seeds/dataset/"

# One target: its libFuzzer run, filtered, into fuzz/target/logs/T.log, its
# exit status into T.rc.
logs=$PWD/fuzz/target/logs
rm -rf "$logs"
mkdir -p "$logs"
run_target() {
  local t=$1 opts
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  case $t in
    gguf) opts=(-max_len=2000000 -timeout=30) ;;
    cli) opts=(-max_len=4096 -timeout=300) ;;
    report) opts=(-max_len=65536 -timeout=30) ;;
    *) opts=(-max_len=16384 -timeout=30) ;;
  esac
  set +e
  # Absolute paths: the cli target runs in a scratch folder.
  "$bin/$t" "$PWD/fuzz/corpus/$t" "$seeds/$t" -max_total_time="$secs" -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$PWD/fuzz/artifacts/$t/" "${opts[@]}" \
    ${FUZZ_SEED:+-seed="$FUZZ_SEED"} 2>&1 \
    | grep -v -e '^#[0-9]' -e '^"' -e 'NEW_FUNC' -e '^WARNING: Failed to find' | tail -n 30 \
    > "$logs/$t.log"
  echo "${PIPESTATUS[0]}" > "$logs/$t.rc"
  set -e
}
# FUZZ_JOBS targets at once (default: one per core); their reports are
# printed in the targets' order once all have run.
jobs_max=${FUZZ_JOBS:-$(nproc)}
[[ "$jobs_max" =~ ^[1-9][0-9]*$ ]] || { echo "FUZZ_JOBS must be a positive integer, not $jobs_max" >&2; exit 2; }
echo "== ${#targets[@]} targets, $secs s each, $jobs_max at a time"
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  run_target "$t" &
done
wait
found=()
for t in "${targets[@]}"; do
  echo "== $t: $secs s"
  cat "$logs/$t.log" 2>/dev/null || echo "(no log)"
  [ "$(cat "$logs/$t.rc" 2>/dev/null)" = 0 ] || found+=("$t")
done
if [ ${#found[@]} -gt 0 ]; then
  echo "findings in: ${found[*]} (see fuzz/artifacts/)" >&2
  exit 1
fi
echo "no findings (${targets[*]}, $secs s each)"
