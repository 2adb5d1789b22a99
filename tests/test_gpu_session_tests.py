"""scripts/gpu_session.sh tests: the GPU suite's shards on the GPUs QLA_TEST_GPUS names, so that the
suite can run beside a server on the machine's other GPUs (here a stand-in nvidia-smi of four GPUs
and a stand-in pytest that logs the GPU each shard saw)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(tmp_path: pathlib.Path, **env) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/sh\ncase "$*" in -L) for i in 0 1 2 3; do echo "GPU $i: Stand-in (UUID: GPU-$i)"; done;; '
        '*) echo "Stand-in GPU, 0, 1 MiB";; esac\n')
    # pytest stands in: the collection lists six tests, a shard writes the GPU it saw and its tests
    (bin_dir / "python3").write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m pytest" ]; then
  case "$*" in
    *--collect-only*) for i in 0 1 2 3 4 5; do echo "tests/test_x.py::test_$i"; done ;;
    *qla_serving.cli*) ;;
    *) echo "gpu=[${{CUDA_VISIBLE_DEVICES-unset}}] $(echo "$*" | grep -o 'test_[0-9]' | tr '\\n' ' ')" ;;
  esac
  exit 0
fi
if [ "$1 $2" = "-m qla_serving.cli" ]; then echo "check gpu=[${{CUDA_VISIBLE_DEVICES-unset}}]"; exit 0; fi
exec {sys.executable} "$@"
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    e = {**os.environ, "OUT": str(out), "QLA_STAGE": str(tmp_path / "stage"), "PATH": f"{bin_dir}:{os.environ['PATH']}",
         **env}
    e.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_session.sh"), "tests", "check"], env=e, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    shards = (out / "gpu-tests-shards.log").read_text() if (out / "gpu-tests-shards.log").exists() else ""
    return {"stdout": r.stdout, "shards": shards, "check": (out / "check.log").read_text()}


def test_shards_use_every_gpu_by_default(tmp_path):
    r = _run(tmp_path, QLA_TEST_SHARDS="4")
    lines = sorted(r["shards"].splitlines())
    assert lines == ["gpu=[0] test_0 test_4 ", "gpu=[1] test_1 test_5 ", "gpu=[2] test_2 ", "gpu=[3] test_3 "], r
    assert "check gpu=[unset]" in r["check"]


def test_shards_and_check_stay_on_the_named_gpus(tmp_path):
    r = _run(tmp_path, QLA_TEST_SHARDS="3", QLA_TEST_GPUS="2,3")
    lines = sorted(r["shards"].splitlines())
    # shard i on the i-th named GPU, round robin: 0 and 2 on GPU 2, 1 on GPU 3; none on 0 or 1
    assert lines == ["gpu=[2] test_0 test_3 ", "gpu=[2] test_2 test_5 ", "gpu=[3] test_1 test_4 "], r
    assert "6 tests over 3 processes on 2 GPUs" in r["stdout"]
    assert "check gpu=[2,3]" in r["check"]
    # one process: pytest itself sees only the named GPUs
    r = _run(tmp_path, QLA_TEST_SHARDS="1", QLA_TEST_GPUS="3")
    assert "gpu=[3]" in r["stdout"], r
