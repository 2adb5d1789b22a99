#!/usr/bin/env bash
# Replay a Dockerfile's install into a fresh virtual environment that holds the engine version its
# FROM line names (no Docker engine runs on the project's machines), then `pip check` it and
# import the plugin the way the engine does. Needs the built wheel in dist/ (QLA_DIST_DIR) and a
# reachable index (several GB of wheels); not part of CI, which only resolves the same lines
# (scripts/ci_install.sh).
#
#   bash scripts/docker_replay.sh docker/Dockerfile.vllm [VENV]
#
# QLA_REPLAY_OFFLINE=1 is the GPU machine's way, which has no index: the base image's packages are
# the ones this python already sees (its site-packages, and the engine's bundle on its path), put
# under the fresh environment instead of installed into it; the engine there must be the FROM
# line's version; the Dockerfile's pip line then runs unchanged but for PIP_NO_INDEX and the
# wheel's folder as PIP_FIND_LINKS, so it resolves against what the image holds, as in a build.
# `gpu_session.sh install` with QLA_DOCKERFILE serves through that environment.
#
# An image that lacks some of the engine's own requirements (the GPU machine: its bundles carry
# what the engine imports, not all its metadata asks for) cannot resolve the line: the replay
# lists every gap (scripts/requirements_gap.py) and stops, unless QLA_REPLAY_RESOLVED names what
# the same line resolved to against the engine's complete environment (a replay elsewhere with
# QLA_REPLAY_REPORT=FILE writes it); then exactly those distributions go in, from the wheel's
# folder, after a check that the image satisfies their own requirements.
set -euo pipefail
cd "$(dirname "$0")/.."
dockerfile=$1
venv=${2:-/tmp/qla-replay-$(basename "$dockerfile" | tr . -)}
python=${PYTHON:-python3}
from=$(sed -n 's/^FROM //p' "$dockerfile")
case $from in
  vllm/vllm-openai:v*) engine="vllm==${from#vllm/vllm-openai:v}" plugin=qla_serving.integrations.vllm ;;
  lmsysorg/sglang:v*) v=${from#lmsysorg/sglang:v}; engine="sglang==${v%%-*}" plugin=qla_serving.integrations.sglang ;;
  *) echo "$dockerfile: FROM $from: no engine this script knows" >&2; exit 2 ;;
esac
dist=${QLA_DIST_DIR:-dist}
[[ $dist == /* ]] || dist=$PWD/$dist
ls "$dist"/qla_serving-*.whl >/dev/null || { echo "no built wheel in $dist" >&2; exit 2; }
line=$(grep -E '^RUN pip install' "$dockerfile")
line=${line#RUN }
written=$line  # as the Dockerfile has it
# the Dockerfile copies dist/ to /opt/qla-serving/: point its pip line at the wheel's folder
line=${line//\/opt\/qla-serving\//$dist/}
echo "== $dockerfile: fresh venv $venv with $engine, then: $line"
rm -rf "$venv"
if [[ ${QLA_REPLAY_OFFLINE:-} == 1 ]]; then
  # the image's packages under the venv (a .pth of this python's site directories), its pip and
  # setuptools among them: a venv's own would shadow the image's (torch asks for setuptools >= 77)
  "$python" -m venv --without-pip "$venv"
  printf '#!/bin/sh\nexec "%s/bin/python" -m pip "$@"\n' "$venv" >"$venv/bin/pip" && chmod +x "$venv/bin/pip"
  site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  "$python" -c 'import site, sys; print(*[p for p in sys.path if p.endswith("-packages")], sep="\n")' >"$site/base-image.pth"
  have=$("$venv/bin/python" -c "import importlib.metadata as md; print(md.version('${engine%%==*}'))" 2>/dev/null || echo none)
  [[ $have == "${engine#*==}" ]] || { echo "offline replay: ${engine%%==*} here is $have, the Dockerfile's FROM is ${engine#*==}" >&2; exit 2; }
  echo "   offline: ${engine%%==*} $have and the image's packages from $(wc -l <"$site/base-image.pth") site directories, no index"
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=$dist
  gap=$("$venv/bin/python" scripts/requirements_gap.py "$engine") && image_gaps=0 || image_gaps=$(wc -l <<<"$gap")
  ((image_gaps == 0)) || image_gaps=$((image_gaps - 1))  # (its last line is the count)
else
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "$engine"
  image_gaps=0
fi
if ((image_gaps == 0)); then
  run=$line
  [[ -z ${QLA_REPLAY_REPORT:-} ]] || run+=" --report $QLA_REPLAY_REPORT.pip"
  PATH=$venv/bin:$PATH bash -c "$run"
  "$venv/bin/pip" check
  if [[ -n ${QLA_REPLAY_REPORT:-} ]]; then  # what the line resolved to, for a replay on an incomplete image
    "$venv/bin/python" - "$QLA_REPLAY_REPORT" "$dockerfile" "$engine" "$written" <<'PY'
import json, sys
out, dockerfile, engine, line = sys.argv[1:]
report = json.load(open(out + ".pip"))
install = [{"name": i["metadata"]["name"], "version": i["metadata"]["version"],
            "requested_extras": i.get("requested_extras") or []} for i in report["install"]]
json.dump({"dockerfile": dockerfile, "engine": engine, "line": line, "install": install}, open(out, "w"), indent=1)
print(f"   resolution written to {out}: " + ", ".join(f"{i['name']} {i['version']}" for i in install))
PY
    rm -f "$QLA_REPLAY_REPORT.pip"
  fi
else
  echo "   this image lacks $image_gaps of ${engine}'s requirements (so pip cannot resolve the line here):"
  sed 's/^/     /' <<<"$gap"
  resolved=${QLA_REPLAY_RESOLVED:-}
  [[ -n $resolved ]] || { echo "   give QLA_REPLAY_RESOLVED=<the line's resolution against a complete ${engine} (QLA_REPLAY_REPORT of a replay there)> to install what it resolved to" >&2; exit 2; }
  wheels=$("$venv/bin/python" - "$resolved" "$dockerfile" "$engine" "$dist" <<'PY'
import json, pathlib, sys
try:
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # an image without packaging: pip's copy
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
res, dockerfile, engine, dist = json.load(open(sys.argv[1])), *sys.argv[2:]
if (res["dockerfile"], res["engine"]) != (dockerfile, engine):
    sys.exit(f"resolution {sys.argv[1]} is of {res['dockerfile']} with {res['engine']}, not {dockerfile} with {engine}")
wheels = {(canonicalize_name(n), str(v)): w for w in pathlib.Path(dist).glob("*.whl") for n, v, *_ in [parse_wheel_filename(w.name)]}
for i in res["install"]:
    w = wheels.get((canonicalize_name(i["name"]), i["version"]))
    if w is None:
        sys.exit(f"resolution names {i['name']} {i['version']}: no such wheel in {dist}")
    extras = f"[{','.join(i['requested_extras'])}]" if i["requested_extras"] else ""
    print(f"{w}\t{i['name']}{extras}")
PY
  ) || exit 2
  mapfile -t wanted <<<"$wheels"
  for w in "${wanted[@]}"; do
    echo "   resolved elsewhere: ${w#*$'\t'} from ${w%%$'\t'*}"
    "$venv/bin/pip" install -q --no-deps --no-cache-dir "${w%%$'\t'*}"
    "$venv/bin/python" scripts/requirements_gap.py --direct "${w#*$'\t'}" || { echo "   the image does not satisfy ${w#*$'\t'}'s own requirements" >&2; exit 1; }
  done
  # pip check: the image's own gaps (above) stay; none may name what went in
  names=$(printf '%s\n' "${wanted[@]}" | cut -f2 | sed 's/\[.*//' | tr '\n' '|')
  problems=$("$venv/bin/pip" check 2>&1 || true)
  ours=$(grep -i -E "^(${names%|}) " <<<"$problems" || true)
  echo "   pip check: $(grep -c . <<<"$problems") line(s) about the image's gaps, $(grep -c . <<<"$ours") about what went in"
  [[ -z $ours ]] || { echo "$ours" >&2; exit 1; }
fi
cd /tmp  # the checkout's qla_serving must not stand in for the installed one
"$venv/bin/python" - "$plugin" "$engine" <<'PY'
import importlib, importlib.metadata as md, sys
plugin, engine = sys.argv[1], sys.argv[2]
group = "vllm.general_plugins" if engine.startswith("vllm") else "sglang.srt.plugins"
eps = [e for e in md.entry_points(group=group) if e.name == "qla_serving"]
assert eps, "qla-serving's entry point is not installed"
importlib.import_module(plugin)
from qla_serving.kernels import library
libs = library.libraries()
name = engine.split("==")[0]
print(f"{engine}: {name} {md.version(name)}, tilelang {md.version('tilelang')}, qla-serving {md.version('qla-serving')}, "
      f"entry point {eps[0].value}, kernel library {libs[0].path if libs else 'NONE'} "
      f"({len(libs[0].manifest['kernels']) if libs else 0} kernels)")
# with the engine's own TileLang, every kernel of a shipped configuration comes from the library
import torch
from qla_serving import backend, compile as qc
from qla_serving.warmup import kernel_warmup_specs
print("TileLang for compiling:", backend.tilelang_unsupported_reason() or "usable")
for cfg in qc.plan_configs([(16, 32), (2, 8)], engine=name, dtypes=["bf16"], states=["fp32", "bf16"], verify_tokens=[3]):
    reason = backend.missing_kernels_reason(kernel_warmup_specs(cfg))
    assert reason is None, reason
print("shipped configurations (16/32, 2/8; bf16; fp32/bf16 state; verify 3): every kernel in the library")
odd = qc.plan_configs([(3, 9)], engine=name, dtypes=["bf16"], states=["fp32"])[0]
print("an unshipped one (3/9 heads):", backend.missing_kernels_reason(kernel_warmup_specs(odd)))
PY
