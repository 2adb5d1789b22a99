"""The serving benchmark's SM clock sampler (e2e_bench/gpu_clocks.py), against a stand-in nvidia-smi."""

import os
import random
import stat
import time

from e2e_bench import gpu_clocks, serve


def test_summary_takes_median_min_power_and_frequent_reasons():
    rng = random.Random(7)
    mhz = [rng.randrange(1400, 1981) for _ in range(40)]
    power = [rng.uniform(300, 700) for _ in range(40)]
    # power cap in 10 of 40 samples (counts), HW slowdown in 2 (does not), idle everywhere (never named)
    bits = [0x1 | (0x4 if i < 10 else 0) | (0x8 if i in (20, 21) else 0) for i in range(40)]
    lines = [f"{i % 2}, {m}, {p:.2f}, 0x{b:016x}" for i, (m, p, b) in enumerate(zip(mhz, power, bits))]
    lines += ["", "Failed to query something", "0, [N/A], 1.0, 0x0"]  # not samples
    s = gpu_clocks.summarise(lines)
    assert s["clock_samples"] == 40
    assert s["sm_clock_mhz_median"] == sorted(mhz)[19] / 2 + sorted(mhz)[20] / 2
    assert s["sm_clock_mhz_min"] == min(mhz)
    assert abs(s["power_w_mean"] - sum(round(p, 2) for p in power) / 40) < 0.06
    assert s["clock_limits"] == ["SW power cap"]
    assert gpu_clocks.summarise(["garbage"]) == {}


def test_sampler_runs_nvidia_smi_while_the_point_runs(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    args_file = tmp_path / "args"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args_file}\n"
                    "while true; do echo '0, 1755, 612.50, 0x0000000000000004'; sleep 0.05; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    with gpu_clocks.ClockSampler(tmp_path / "clocks.csv", interval_ms=50) as clocks:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (tmp_path / "clocks.csv").read_text().count("\n") < 3:
            time.sleep(0.05)
    assert clocks.proc.poll() is not None  # stopped with the point
    assert "--query-gpu=" + gpu_clocks.QUERY in args_file.read_text()
    assert clocks.summary["sm_clock_mhz_median"] == 1755 and clocks.summary["clock_limits"] == ["SW power cap"]
    assert clocks.summary["power_w_mean"] == 612.5 and clocks.summary["clock_samples"] >= 3


def test_a_server_pinned_to_some_gpus_samples_those_only(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    args_file = tmp_path / "args"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args_file}\nwhile true; do sleep 0.05; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")

    def sampled_ids(**kw):
        args_file.unlink(missing_ok=True)
        with gpu_clocks.ClockSampler(tmp_path / "clocks.csv", interval_ms=50, **kw):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not args_file.exists():
                time.sleep(0.05)
        return [a for a in args_file.read_text().split() if a.startswith("--id")]

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert sampled_ids() == ["--id=2,3"]
    assert sampled_ids(gpus="1") == ["--id=1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert sampled_ids() == []  # every GPU


def test_without_nvidia_smi_the_summary_is_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with gpu_clocks.ClockSampler(tmp_path / "clocks.csv") as clocks:
        pass
    assert clocks.summary == {} and not (tmp_path / "clocks.csv").exists()


def test_results_table_shows_the_clock_columns():
    row = dict.fromkeys(serve.ROW_KEYS)
    row.update(engine="vllm", backend="flashqla", tp=1, workload="chat", input_len=2048, output_len=1024,
               concurrency=128, num_prompts=256, total_tok_s=1.0, output_tok_s=1.0, request_throughput=1.0,
               mean_ttft_ms=1.0, p99_ttft_ms=1.0, mean_tpot_ms=1.0, p99_tpot_ms=1.0,
               sm_clock_mhz_median=1710.0, sm_clock_mhz_min=1530.0, power_w_mean=655.0, clock_limits=["SW power cap"])
    old = dict(row, sm_clock_mhz_median=None, sm_clock_mhz_min=None, power_w_mean=None, clock_limits=None,
               backend="triton")  # a results file from before the sampler
    text = serve.markdown({"engine": "vllm", "tp": 1}, [row, old])
    assert "| 1710 (1530) | 655 | SW power cap |" in text
    assert "| — (—) | — | — |" in text
