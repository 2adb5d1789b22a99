"""Helpers shared by the benchmarks."""

import os
import stat

from qla_serving.bench import common


def _fake_nvidia_smi(tmp_path, body: str):
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\n" + body + "\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_gpu_clock_state_reads_clock_and_throttle_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, 'echo "1755, 0x0000000000000004"') + os.pathsep
                       + os.environ["PATH"])
    assert common.gpu_clock_state() == {"sm_mhz": 1755, "throttle": "0x0000000000000004"}


def test_gpu_clock_state_is_empty_without_a_usable_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    assert common.gpu_clock_state() == {}
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, 'echo "[N/A]"'))
    assert common.gpu_clock_state() == {}
