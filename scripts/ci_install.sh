#!/usr/bin/env bash
# CI: the install lines resolve. Each Dockerfile's pip line, and the README's, with the engine
# version its FROM line (or README comment) names, through `pip install --dry-run` of this
# checkout (the wheel carries the same requirements), and nothing of the plugin pins TileLang.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
flags=(--disable-pip-version-check --progress-bar off -q --dry-run --ignore-installed --report)
check() {  # extra engine==version
  local extra=$1 engine=$2 report
  report=$(mktemp)
  echo "== pip install --dry-run '.[$extra]' '$engine'"
  "$python" -m pip install "${flags[@]}" "$report" ".[$extra]" "$engine"
  "$python" - "$report" "$engine" <<'PY'
import json, sys
report, engine = json.load(open(sys.argv[1])), sys.argv[2]
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
name, want = engine.split("==")
assert got.get(name) == want, f"{engine} resolved to {name} {got.get(name)}"
print(f"   resolves: {name} {got[name]}, tilelang {got.get('tilelang')}, qla-serving {got.get('qla-serving')}")
PY
  rm -f "$report"
}
for f in docker/Dockerfile.vllm docker/Dockerfile.sglang; do
  grep -q 'pip install --no-cache-dir "$(ls /opt/qla-serving/qla_serving-\*.whl)\[' "$f" || { echo "$f: pip line changed; update $0"; exit 1; }
  if grep -q '^FROM vllm/vllm-openai:v' "$f"; then
    check vllm "vllm==$(sed -n 's/^FROM vllm\/vllm-openai:v\([0-9.]*\).*/\1/p' "$f")"
  else
    check sglang "sglang==$(sed -n 's/^FROM lmsysorg\/sglang:v\([0-9.]*\).*/\1/p' "$f")"
  fi
done
# README: "vLLM 0.26-0.32" and "SGLang 0.5.17-0.5.23": the newest of each range resolves too
check vllm "vllm==0.32.0"
check sglang "sglang==0.5.23"
