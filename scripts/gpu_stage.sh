# Source on a GPU machine that has torch but not this package installed (the device machine):
#   . scripts/gpu_stage.sh && cd "$QLA_STAGE" && python3 -m pytest -m gpu
# Lays the checkout out as `pip install` would (kernels/ and integrations/ under
# qla_serving/, plus a dist-info with the entry points, so vLLM and SGLang find the plugin),
# with tests/ and e2e_bench/ beside it, and puts it on PYTHONPATH.
_qla_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export QLA_STAGE=${QLA_STAGE:-/tmp/qla-stage}
rm -rf "$QLA_STAGE" && mkdir -p "$QLA_STAGE"
cp -r "$_qla_root/qla_serving" "$_qla_root/tests" "$_qla_root/e2e_bench" "$_qla_root/scripts" "$_qla_root/pyproject.toml" "$QLA_STAGE/"
cp -r "$_qla_root/kernels" "$QLA_STAGE/qla_serving/kernels"
cp -r "$_qla_root/integrations" "$QLA_STAGE/qla_serving/integrations"
python3 - "$QLA_STAGE" <<'PY'
import pathlib, sys, tomllib
stage = pathlib.Path(sys.argv[1])
project = tomllib.loads((stage / "pyproject.toml").read_text())["project"]
info = stage / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
groups = dict(project.get("entry-points", {}), console_scripts=project.get("scripts", {}))
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) + "\n"
    for group, eps in groups.items()))
PY
export PYTHONPATH=$QLA_STAGE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
