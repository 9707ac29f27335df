#!/usr/bin/env bash
# Prebuilt binaries for scripts/gpu-check.sh on a GPU machine that has no
# network and may have no Rust toolchain, written to gpu-bundle/ (git-ignored;
# it travels with the working tree, under 60 MB):
#   bin.tar.gz                   bin/minikv, the CLI (bench attention,
#                                generate), and bin/minikv-kernels-gpucheck
#                                (parity checks, device info, prefill
#                                timing), gzipped (22 MB to about 7:
#                                scripts/gpu-check.sh unpacks them)
#   cubin/minikv-<hash>.sm_XY.cubin  the kernels compiled here by NVRTC for
#                                sm_80/86/89/90/100 (the GPU needs no NVRTC
#                                and no PTX JIT; the hash is the source's, so
#                                a stale CUBIN is never loaded)
#   ptxas.json                   registers/spills per kernel (ptxas, here)
#   model.gguf                   when assets/ has the real model: its first
#                                MODEL_BLOCKS (default 2) blocks, by
#                                scripts/gguf-truncate.py (the whole model,
#                                98 MB, is more than a device run carries;
#                                the embedding table is most of the 36 MB)
#   MANIFEST.json                git revision, source hash, CPU baseline,
#                                newest glibc symbol needed, sizes
# Portable code: x86-64-v3 (AVX2, FMA, F16C: every x86 server CPU since
# 2015), not target-cpu=native; stripped, no debug info.
# Usage: ./scripts/gpu-bundle.sh   (~10 min cold: its own target dir)
# A device run carries it with `carry: ["gpu-bundle"]` (64 MiB with the
# tracked tree, about 5 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=$(./scripts/fetch-cuda-tools.sh)
CPU=x86-64-v3
export CARGO_TARGET_DIR=target/gpu-bundle
export RUSTFLAGS="-C target-cpu=$CPU"
export CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols
cargo build --release -q -p minikv-cli
cargo build --release -q -p minikv-kernels --bins --example gpucheck
R=$CARGO_TARGET_DIR/release
OUT=gpu-bundle
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp/bin" "$OUT.tmp/cubin"
cp "$R/minikv" "$OUT.tmp/bin/minikv"
cp "$R/examples/gpucheck" "$OUT.tmp/bin/minikv-kernels-gpucheck"
LD_LIBRARY_PATH="$PWD/$TOOLS/lib" "$R/minikv-kernels-check" --ptxas "$TOOLS/bin/ptxas" \
  --out "$OUT.tmp/ptx" --cubin-out "$OUT.tmp/cubin" > "$OUT.tmp/ptxas.json"
rm -rf "$OUT.tmp/ptx"
MODEL=assets/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$MODEL" ]; then
  python3 scripts/gguf-truncate.py "$MODEL" "$OUT.tmp/model.gguf" "${MODEL_BLOCKS:-2}" >&2
fi
python3 - "$OUT.tmp" "$CPU" "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" <<'PY'
import json, os, re, subprocess, sys
out, cpu, rev = sys.argv[1:4]
import shutil, tarfile
glibc = "0"
for b in ("bin/minikv", "bin/minikv-kernels-gpucheck"):
    syms = subprocess.run(["objdump", "-T", os.path.join(out, b)], capture_output=True, text=True).stdout
    for v in re.findall(r"GLIBC_([0-9.]+)", syms):
        if tuple(map(int, v.split("."))) > tuple(map(int, glibc.split("."))):
            glibc = v
with tarfile.open(os.path.join(out, "bin.tar.gz"), "w:gz", compresslevel=9) as t:
    t.add(os.path.join(out, "bin"), arcname="bin")
shutil.rmtree(os.path.join(out, "bin"))
files = {}
for root, _, names in os.walk(out):
    for n in names:
        p = os.path.join(root, n)
        files[os.path.relpath(p, out)] = os.path.getsize(p)
total = sum(files.values())
cubins = sorted(f for f in files if f.endswith(".cubin"))
m = {"git_revision": rev, "cpu_baseline": cpu, "needs_glibc": glibc, "cubins": cubins,
     "bytes": total, "files": files}
json.dump(m, open(os.path.join(out, "MANIFEST.json"), "w"), indent=1)
print(f"gpu-bundle: {total / 1e6:.1f} MB, glibc >= {glibc}, {len(cubins)} CUBINs", file=sys.stderr)
if total > 60e6:
    sys.exit(f"gpu-bundle: {total / 1e6:.1f} MB is over the 60 MB a device run can carry")
PY
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
