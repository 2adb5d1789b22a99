# Source on a GPU machine that has torch but not this package installed (the device machine):
#   . scripts/gpu_stage.sh && cd "$QLA_STAGE" && python3 -m pytest -m gpu
# Lays the checkout out as `pip install` would (kernels/ and integrations/ under
# qla_serving/) in $QLA_STAGE, with tests/ and e2e_bench/ beside it, and puts it on PYTHONPATH.
_qla_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export QLA_STAGE=${QLA_STAGE:-/tmp/qla-stage}
rm -rf "$QLA_STAGE" && mkdir -p "$QLA_STAGE"
cp -r "$_qla_root/qla_serving" "$_qla_root/tests" "$_qla_root/e2e_bench" "$_qla_root/pyproject.toml" "$QLA_STAGE/"
cp -r "$_qla_root/kernels" "$QLA_STAGE/qla_serving/kernels"
cp -r "$_qla_root/integrations" "$QLA_STAGE/qla_serving/integrations"
export PYTHONPATH=$QLA_STAGE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
