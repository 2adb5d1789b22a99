"""The engine's own benchmark client, imported once and run point after point.

``vllm bench serve`` and ``python -m sglang.bench_serving`` spend 15-25 s importing the engine
before they send a request; a sweep of ten points would spend minutes on imports. This driver
imports the client once, then reads one JSON line per point from stdin (``{"argv": [...],
"log": path}``, ``argv`` the client's arguments as its command line takes them), runs the
client's own entry point on them with output to ``log``, and answers ``{"rc": 0}`` or
``{"rc": 1, "error": ...}`` on stdout. The parsing and the benchmark code are the engine's.

    python -m e2e_bench.serve_client vllm|sglang
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback


def _vllm():
    import argparse

    from vllm.benchmarks.serve import add_cli_args, main

    def run(argv):
        p = argparse.ArgumentParser(prog="vllm bench serve")
        add_cli_args(p)
        main(p.parse_args(argv))

    return run


def _datasets_or_stand_in() -> str | None:
    """HF ``datasets``, or a stand-in if it does not import (None, or the reason).

    ``sglang.benchmark.serving`` imports its MMMU dataset module, which imports ``datasets`` at
    import time; the harness's ``random-ids`` dataset never calls it. On a machine whose pyarrow or
    fsspec ``datasets`` does not take, a stand-in whose ``load_dataset`` raises lets the client run."""
    try:
        import datasets  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- any failure: ImportError, a pyarrow API it lacks, ...
        import types

        reason = f"{type(e).__name__}: {e}"
        stand_in = types.ModuleType("datasets")

        def load_dataset(*args, **kwargs):
            raise ImportError(f"HF datasets does not import here ({reason}); e2e_bench/serve_client.py put a "
                              "stand-in in its place for SGLang's client")

        stand_in.load_dataset = load_dataset
        sys.modules["datasets"] = stand_in
        print(f"serve_client: HF datasets does not import ({reason}); a stand-in takes its place", file=sys.stderr)
        return reason
    return None


def _sglang():
    _datasets_or_stand_in()
    from sglang.benchmark import serving

    def run(argv):
        saved = sys.argv
        sys.argv = ["sglang.bench_serving", *argv]
        try:
            serving.cli_main()
        finally:
            sys.argv = saved

    return run


def main() -> int:
    # Answers go to the original stdout alone; whatever the engine prints (its loggers write to
    # stdout) goes to stderr from here on.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    run = {"vllm": _vllm, "sglang": _sglang}[sys.argv[1]]()
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        point = json.loads(line)
        with open(point["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                run(point["argv"])
                answer = {"rc": 0}
            except SystemExit as e:  # argparse errors and the clients' own exits
                answer = {"rc": int(e.code or 0) if isinstance(e.code, int) else 1, "error": str(e.code)}
            except Exception as e:  # noqa: BLE001 - reported to the harness, which records the point as failed
                traceback.print_exc()
                answer = {"rc": 1, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
