#!/usr/bin/env bash
# CI for the vLLM plugin: vLLM's own virtual environment (it pins torch 2.11, the main suite
# does not), the package installed into it, and the plugin's tests against the real vLLM.
#
# Works from a clean clone on a CPU machine (Python 3.11, PyPI reachable, no GPU); called by
# .ci/run. A venv left by an earlier run is reused when it holds the same vLLM.
#
# Environment:
#   QLA_VLLM_VENV     the venv to create or reuse (default: ~/.cache/qla-serving/venv-vllm-<version>)
#   QLA_VLLM_VERSION  the vLLM to test against (default 0.26.0, the version CI pins)
#   PYTHON            the interpreter that creates the venv (default python3)
#
# Exits non-zero when the install fails, a test fails, or no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

vllm_version=${QLA_VLLM_VERSION:-0.26.0}
venv=${QLA_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/qla-serving/venv-vllm-$vllm_version}
python=${PYTHON:-python3}
pip_flags=(--disable-pip-version-check --progress-bar off)
start=$SECONDS

venv_matches() {  # the venv runs and holds exactly the wanted vLLM
  [[ -x $venv/bin/python ]] || return 1
  local have
  have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null) || return 1
  [[ $have == "$vllm_version" ]]
}

if venv_matches; then
  echo "== reusing $venv (vllm $vllm_version)"
else
  echo "== creating $venv with vllm==$vllm_version (several GB of wheels on a cold machine)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install "${pip_flags[@]}" -q --upgrade pip
  "$venv/bin/python" -m pip install "${pip_flags[@]}" -q "vllm==$vllm_version"
  echo "   vllm installed after $((SECONDS - start)) s"
fi

# The package itself: editable and without dependencies (its only hard one, torch, comes
# with vLLM at vLLM's version); pytest for the run. Re-run every time: cheap, and it
# refreshes the entry points from pyproject.toml.
"$venv/bin/python" -m pip install "${pip_flags[@]}" -q --no-deps -e "$repo"
"$venv/bin/python" -m pip install "${pip_flags[@]}" -q pytest

report=$(mktemp -d)/vllm-tests.xml
echo "== QLA_REQUIRE_VLLM=1 python -m pytest tests/vllm -q (vllm $vllm_version)"
set +e
QLA_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest tests/vllm -q -p no:cacheprovider --junitxml="$report"
status=$?
set -e
if [[ $status -ne 0 ]]; then
  echo "vLLM plugin tests failed (pytest exit $status)" >&2
  exit "$status"
fi

# All skipped counts as a failure: CI must have exercised the plugin.
ran=$("$venv/bin/python" - "$report" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))
EOF
)
if [[ $ran -lt 1 ]]; then
  echo "no vLLM plugin test ran" >&2
  exit 1
fi
echo "== vLLM plugin: $ran tests ran and passed in $((SECONDS - start)) s"
