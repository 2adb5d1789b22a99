#!/usr/bin/env bash
# CPU CI for the SGLang adapter: the real SGLang in its own virtual environment (SGLang and
# vLLM pin different torch versions), then tests/sglang with QLA_REQUIRE_SGLANG=1 so a broken
# SGLang install fails instead of skipping.
#
# Usage: scripts/ci_sglang.sh            (from anywhere inside a clone)
# Env:
#   QLA_SGLANG_VENV     venv path (default: ~/.cache/qla-serving/sglang-<version>-venv); reused
#                       when it has this SGLang version on Python 3.11, rebuilt otherwise
#   QLA_SGLANG_VERSION  SGLang to test against (default 0.5.23, the newest supported)
#   PYTHON              interpreter for a new venv (default: python3.11, else python3)
#   QLA_SGLANG_MATRIX=1 also run tests/sglang against the Python code of every older supported
#                       SGLang (0.5.17 .. 0.5.22), laid over the venv's dependencies (the
#                       transformers/tokenizers that 0.5.17-0.5.19 pin are side-loaded for them).
#                       Downloads ~170 MB of wheels once; adds a few minutes.
# Exit status: non-zero if the install fails, a test fails, or no test passed.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${QLA_SGLANG_VERSION:-0.5.23}"
venv="${QLA_SGLANG_VENV:-$HOME/.cache/qla-serving/sglang-${version}-venv}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
start=$SECONDS

step() { echo "== [$((SECONDS - start))s] $*"; }

venv_matches() {
    [ -x "$venv/bin/python" ] || return 1
    "$venv/bin/python" - "$version" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
ok = sys.version_info[:2] == (3, 11) and md.version("sglang") == sys.argv[1]
md.version("pytest")
sys.exit(0 if ok else 1)
EOF
}

if venv_matches; then
    step "reusing $venv (sglang $version)"
else
    "$python" - <<'EOF' || { echo "SGLang $version ships cp311 wheels: need Python 3.11 (set PYTHON=)"; exit 2; }
import sys
sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)
EOF
    step "creating $venv with $("$python" --version)"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    step "installing sglang==$version (pulls its CUDA torch: several GB)"
    "$venv/bin/python" -m pip install -q "sglang==$version" pytest
fi

step "installing qla-serving from $repo (no deps: the venv's torch stays SGLang's)"
"$venv/bin/python" -m pip install -q --no-deps -e "$repo"

step "running tests/sglang"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
(cd "$repo" && QLA_REQUIRE_SGLANG=1 "$venv/bin/python" -m pytest tests/sglang -q -p no:cacheprovider \
    -W ignore::DeprecationWarning) 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
    step "FAILED (pytest exit $status)"
    exit "$status"
fi
if ! grep -Eq "[1-9][0-9]* passed" "$log"; then
    step "FAILED: no test passed"
    exit 1
fi

if [ "${QLA_SGLANG_MATRIX:-0}" = 1 ]; then
    cache="$(dirname "$venv")/sglang-matrix"
    old_deps="$cache/deps-transformers-5.12.1"
    if [ ! -d "$old_deps/transformers" ]; then
        step "side-loading transformers 5.12.1 / tokenizers 0.22.2 (pinned by sglang 0.5.17-0.5.19)"
        "$venv/bin/python" -m pip install -q --no-deps --target "$old_deps" transformers==5.12.1 tokenizers==0.22.2
    fi
    for old in 0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22; do
        src="$cache/sglang-$old"
        if [ ! -d "$src/sglang" ]; then
            "$venv/bin/python" -m pip download -q --no-deps "sglang==$old" -d "$cache/wheels"
            "$venv/bin/python" -c 'import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/sglang-{sys.argv[2]}-*.whl")[0])
z.extractall(sys.argv[3], [n for n in z.namelist() if n.startswith("sglang/")])' "$cache/wheels" "$old" "$src"
        fi
        path="$src"
        case "$old" in 0.5.17|0.5.18|0.5.19) path="$src:$old_deps" ;; esac
        got=$(cd "$repo" && PYTHONPATH="$path" "$venv/bin/python" -c 'import sglang; print(sglang.__version__)' 2>/dev/null | tail -1)
        if [ "$got" != "$old" ]; then
            step "FAILED: the overlay imports sglang '$got', not $old"
            exit 1
        fi
        step "tests/sglang against sglang $old's code"
        set +e
        (cd "$repo" && PYTHONPATH="$path" QLA_REQUIRE_SGLANG=1 "$venv/bin/python" -m pytest tests/sglang -q \
            -p no:cacheprovider -W ignore::DeprecationWarning) > "$log" 2>&1
        status=$?
        set -e
        tail -1 "$log"
        if [ "$status" -ne 0 ] || ! grep -Eq "[1-9][0-9]* passed" "$log"; then
            cat "$log"
            step "FAILED against sglang $old (pytest exit $status)"
            exit 1
        fi
    done
fi
step "ok"
