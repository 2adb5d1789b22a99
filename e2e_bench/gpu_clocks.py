"""SM clock, power and clock-limit reasons of the GPUs while a benchmark point runs.

A kernel that pulls the clock down (the power cap) slows every other kernel of the step with it,
so a serving point records what the GPUs ran at: ``nvidia-smi`` samples every ``interval_ms``
in the background while the point runs, and :func:`summarise` reduces the samples to the median
and lowest SM clock, the mean power and the limit reasons active in at least a tenth of them.

    with ClockSampler(path) as clocks:
        ...                           # the point
    row.update(clocks.summary)        # {} where nvidia-smi is absent or printed nothing
"""

from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import subprocess

QUERY = "index,clocks.sm,power.draw,clocks_event_reasons.active"
# nvidia-smi's clocks_event_reasons bits (``nvidia-smi --help-query-gpu``); idle is left out
REASONS = {
    0x2: "applications clocks",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal",
    0x40: "HW thermal",
    0x80: "HW power brake",
    0x100: "display clocks",
}
MIN_SHARE = 0.1  # a reason counts when this share of the samples had it


def parse_line(line: str) -> tuple[int, float, float | None, int] | None:
    """``(gpu index, SM MHz, power W or None, reason bits)`` of one csv,noheader,nounits line."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        index, mhz = int(parts[0]), float(parts[1])
        power = float(parts[2]) if parts[2] not in ("[N/A]", "N/A", "") else None
        reasons = int(parts[3], 16) if parts[3].startswith("0x") else int(parts[3])
    except ValueError:
        return None
    return index, mhz, power, reasons


def summarise(lines: list[str]) -> dict:
    """Median and lowest SM clock, mean power and frequent limit reasons over every GPU's samples
    (``{}`` when no line parses)."""
    samples = [s for s in map(parse_line, lines) if s is not None]
    if not samples:
        return {}
    mhz = [s[1] for s in samples]
    power = [s[2] for s in samples if s[2] is not None]
    counts = {name: sum(1 for s in samples if s[3] & bit) for bit, name in REASONS.items()}
    return {
        "sm_clock_mhz_median": statistics.median(mhz),
        "sm_clock_mhz_min": min(mhz),
        "power_w_mean": round(statistics.fmean(power), 1) if power else None,
        "clock_limits": [name for name, n in counts.items() if n >= MIN_SHARE * len(samples)],
        "clock_samples": len(samples),
    }


class ClockSampler:
    """``nvidia-smi`` sampling into ``path`` between ``__enter__`` and ``__exit__``; the summary
    is in :attr:`summary` afterwards. ``gpus``: the GPUs sampled (nvidia-smi ids, comma-separated);
    by default the process's ``CUDA_VISIBLE_DEVICES``, else every GPU (nvidia-smi itself ignores
    that variable, so a server pinned to one GPU would otherwise be summarised with its idle
    neighbours)."""

    def __init__(self, path: str | pathlib.Path, interval_ms: int = 250, smi: str = "nvidia-smi",
                 gpus: str | None = None):
        self.path, self.interval_ms, self.smi = pathlib.Path(path), interval_ms, smi
        self.gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() if gpus is None else gpus
        self.proc: subprocess.Popen | None = None
        self.summary: dict = {}

    def __enter__(self) -> ClockSampler:
        exe = shutil.which(self.smi)
        if exe is not None:
            self._out = open(self.path, "w")
            self.proc = subprocess.Popen(
                [exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}",
                 *([f"--id={self.gpus}"] if self.gpus else [])],
                stdout=self._out, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self.summary = summarise(self.path.read_text().splitlines())
