"""The host-load sampler of a serving point (e2e_bench/host_load.py), on this machine's /proc and on
a /proc written out here."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from e2e_bench import host_load

pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/stat").is_file(), reason="needs /proc")


def test_a_busy_process_tree_counts_its_children_and_the_host_its_load():
    """A parent that starts a child spinning on one CPU: the tree's CPU time is the child's, about
    one CPU's worth over the block, and the host was at least that busy."""
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass\n"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"])
    try:
        time.sleep(0.5)  # the child is running
        assert len(host_load.process_tree(parent.pid)) >= 2
        with host_load.HostSampler(parent.pid) as host:
            time.sleep(1.5)
        s = host.summary
        assert 0.6 <= s["server_cpus"] <= 1.3, s
        ncpu = os.cpu_count() or 1
        assert s["host_busy_pct"] >= 100 * 0.6 / ncpu, s
        assert 0 <= s["host_steal_pct"] <= 100
    finally:
        parent.kill()
        parent.wait()


def test_the_numbers_come_from_proc_as_the_kernel_writes_it(tmp_path, monkeypatch):
    """Steal and idle shares from two /proc/stat snapshots; a command name with spaces and
    parentheses does not shift the fields."""
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "43").mkdir()

    def write(user, idle, steal, utime42, utime43):
        # user nice system idle iowait irq softirq steal guest guest_nice
        (proc / "stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 {steal} 0 0\ncpu0 1 2 3 4\n")
        (proc / "42" / "stat").write_text(f"42 (vllm serve) S 1 42 42 0 -1 0 0 0 0 0 {utime42} 0 0 0 20 0 1\n")
        (proc / "43" / "stat").write_text(f"43 (a (b) c) S 42 42 42 0 -1 0 0 0 0 0 {utime43} 5 0 0 20 0 1\n")

    write(1000, 1000, 0, 100, 100)
    assert host_load.process_tree(42, proc) == [42, 43]
    tick = os.sysconf("SC_CLK_TCK")
    assert host_load.tree_cpu_seconds([42, 43], proc) == pytest.approx((100 + 100 + 5) / tick)
    clock = iter([10.0, 12.0, 0.0, 0.0])  # the block lasts 2 s
    monkeypatch.setattr(host_load.time, "monotonic", lambda: next(clock))
    sampler = host_load.HostSampler(42, proc)
    with sampler:
        write(1600, 1200, 200, 100 + tick, 100 + tick)  # 1000 jiffies: 200 idle, 200 stolen
    s = sampler.summary
    assert s["host_busy_pct"] == 80.0 and s["host_steal_pct"] == 20.0
    assert s["server_cpus"] == 1.0  # 2 CPU seconds (one per process) over the 2 s block
    with host_load.HostSampler(None, tmp_path / "none") as missing:  # no /proc: no numbers
        pass
    assert missing.summary == {}
