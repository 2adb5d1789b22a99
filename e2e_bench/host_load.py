"""How busy the host was while a benchmark point ran, and how much of it the server used.

A concurrency-1 serving step is host-bound: the same server, with the same GPU work per step, runs
its host side at very different speeds depending on what else the host is doing (docs/e2e.md,
"Host time, and servers measured together"). So a point records the host's load beside the GPU
clocks: from ``/proc/stat`` the share of all CPUs busy and stolen by the hypervisor over the
point, and from ``/proc/<pid>/stat`` the CPU time of the server's process tree (API server, engine
core, workers) as CPUs' worth of work.

    with HostSampler(server_pid) as host:
        ...                           # the point
    row.update(host.summary)          # {} where /proc is absent
"""

from __future__ import annotations

import os
import pathlib
import time

PROC = pathlib.Path("/proc")


def cpu_times(proc: pathlib.Path = PROC) -> tuple[int, int, int] | None:
    """``(total, idle, steal)`` jiffies over all CPUs (the first line of ``/proc/stat``)."""
    try:
        fields = (proc / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    total = sum(v[:8])
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    steal = v[7] if len(v) > 7 else 0
    return total, idle, steal


def _stat_fields(proc: pathlib.Path, pid: int) -> list[str] | None:
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    return text[text.rindex(")") + 2:].split()


def process_tree(pid: int, proc: pathlib.Path = PROC) -> list[int]:
    """``pid`` and every process descended from it."""
    parent: dict[int, int] = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            f = _stat_fields(proc, int(d.name))
            if f:
                parent[int(d.name)] = int(f[1])  # field 4, ppid
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [c for c, p in parent.items() if p in frontier]
        tree += frontier
    return tree


def tree_cpu_seconds(pids: list[int], proc: pathlib.Path = PROC) -> float:
    """User and system CPU seconds of ``pids`` (those still alive)."""
    ticks = 0
    for pid in pids:
        f = _stat_fields(proc, pid)
        if f:
            ticks += int(f[11]) + int(f[12])  # fields 14 and 15: utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


class HostSampler:
    """Host CPU load over a ``with`` block, and the CPU time of one process tree in it."""

    def __init__(self, pid: int | None = None, proc: pathlib.Path = PROC):
        self.pid, self.proc = pid, proc
        self.summary: dict = {}

    def __enter__(self) -> "HostSampler":
        self._t0 = time.monotonic()
        self._cpu0 = cpu_times(self.proc)
        self._tree = process_tree(self.pid, self.proc) if self.pid and self._cpu0 else []
        self._server0 = tree_cpu_seconds(self._tree, self.proc) if self._tree else None
        return self

    def __exit__(self, *exc) -> None:
        cpu1 = cpu_times(self.proc)
        wall = time.monotonic() - self._t0
        if self._cpu0 is None or cpu1 is None or wall <= 0:
            return
        total = cpu1[0] - self._cpu0[0]
        if total <= 0:
            return
        self.summary = {
            "host_busy_pct": round(100 * (1 - (cpu1[1] - self._cpu0[1]) / total), 1),
            "host_steal_pct": round(100 * (cpu1[2] - self._cpu0[2]) / total, 2),
        }
        if self._server0 is not None:
            # CPUs' worth of work: 1.0 is one CPU busy for the whole point
            self.summary["server_cpus"] = round((tree_cpu_seconds(self._tree, self.proc) - self._server0) / wall, 2)
