"""Engine processes in waves: the parent starts up to N workers, lets them build side by side,
then lets each measure alone (a start barrier of two files per worker). Used by
``vllm_offline.py``; the worker side is :func:`signal_ready` and :func:`wait_for_go`."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time


def signal_ready(spec: dict) -> None:
    """Worker side of the start barrier: the engine is built (see :func:`run_waves`)."""
    if spec.get("ready_file"):
        pathlib.Path(spec["ready_file"]).write_text(f"{os.getpid()}\n")


def wait_for_go(spec: dict, poll_s: float = 0.1) -> float:
    """Worker side of the start barrier: wait until the parent lets this run measure; returns
    the seconds waited. Exits if the parent is gone (nobody would ever say go)."""
    go = spec.get("go_file")
    if not go:
        return 0.0
    parent, t0 = os.getppid(), time.perf_counter()
    while not os.path.exists(go):
        if os.getppid() != parent:
            raise SystemExit("the parent process is gone")
        time.sleep(poll_s)
    return time.perf_counter() - t0


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the worker and whatever it started
    except ProcessLookupError:
        pass
    proc.wait()


def run_waves(jobs: list[dict], parallel: int, *, init_timeout: float, measure_timeout: float,
              deadline: float | None = None, min_left: float = 120.0, poll_s: float = 0.2, log=print) -> dict:
    """Run worker processes in waves of up to ``parallel``: engines build side by side, measure one at a time.

    Args:
        jobs: in start order, each a dict with ``label``, ``cmd`` (argv), ``env`` (or None),
            ``ready_file`` and ``go_file`` (paths; the worker writes the first once its engine
            is built, :func:`signal_ready`, and measures once the second exists, :func:`wait_for_go`),
            and optionally ``log`` (a file for the worker's stdout and stderr, so engines side by
            side do not interleave their output).
        parallel: processes per wave (1: one run after another).
        init_timeout: seconds a wave may take until every member is ready or has exited.
        measure_timeout: seconds one run may take after its go.
        deadline: a ``time.monotonic()`` value no wait goes past; a wave with less than
            ``min_left`` seconds before it is not started.

    Building an engine is mostly CPU work (imports, kernel compiles, vLLM's profiling pass), so
    overlapping it saves wall time; a run measures only when every other member of its wave
    is built and idle, and waves do not overlap, so no measurement shares the GPU with work.

    Returns:
        ``{label: {"rc": exit status or None, "status": one of done, exited (before its go),
        timeout-init, timeout-measure, not-started, "s": seconds since its start}}``.
    """
    status: dict[str, dict] = {}
    step = max(1, int(parallel))
    for w in range(0, len(jobs), step):
        wave = jobs[w:w + step]
        if deadline is not None and deadline - time.monotonic() < min_left:
            for j in wave:
                status[j["label"]] = {"rc": None, "status": "not-started", "s": 0.0}
                log(f"[{j['label']}] not started: {deadline - time.monotonic():.0f} s left before the deadline; "
                    "run again with --reuse")
            continue
        procs = []
        for j in wave:
            for f in (j["ready_file"], j["go_file"]):
                pathlib.Path(f).unlink(missing_ok=True)
            log(f"[{j['label']}] starting" + (f" (output: {j['log']})" if j.get("log") else ""))
            out = open(j["log"], "w") if j.get("log") else None  # noqa: SIM115 - the child holds it
            try:
                proc = subprocess.Popen(j["cmd"], env=j.get("env"), start_new_session=True, stdout=out,
                                        stderr=subprocess.STDOUT if out else None)
            finally:
                if out is not None:
                    out.close()
            procs.append((j, proc, time.monotonic()))
        init_end = time.monotonic() + init_timeout
        if deadline is not None:
            init_end = min(init_end, deadline)
        while True:
            building = [(j, p, t) for j, p, t in procs if p.poll() is None and not os.path.exists(j["ready_file"])]
            if not building:
                break
            if time.monotonic() >= init_end:
                for j, p, t in building:
                    _kill(p)
                    status[j["label"]] = {"rc": 124, "status": "timeout-init", "s": time.monotonic() - t}
                    log(f"[{j['label']}] killed: engine not built in time")
                break
            time.sleep(poll_s)
        for j, p, t in procs:
            if j["label"] in status:
                continue
            if p.poll() is not None:
                status[j["label"]] = {"rc": p.returncode, "status": "exited", "s": time.monotonic() - t}
                log(f"[{j['label']}] exit {p.returncode} before measuring, after {time.monotonic() - t:.0f} s")
                continue
            limit = measure_timeout if deadline is None else min(measure_timeout, deadline - time.monotonic())
            if limit < 1:
                _kill(p)
                status[j["label"]] = {"rc": 124, "status": "timeout-measure", "s": time.monotonic() - t}
                log(f"[{j['label']}] killed before measuring: the deadline has passed")
                continue
            pathlib.Path(j["go_file"]).write_text("go\n")
            try:
                rc, state = p.wait(timeout=limit), "done"
            except subprocess.TimeoutExpired:
                _kill(p)
                rc, state = 124, "timeout-measure"
            status[j["label"]] = {"rc": rc, "status": state, "s": time.monotonic() - t}
            log(f"[{j['label']}] exit {rc} after {time.monotonic() - t:.0f} s")
    return status
