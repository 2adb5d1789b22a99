"""Timing, machine ceilings and the results file shared by the benchmarks.

Results format (one file per run, ``e2e_bench/results/<date>-<gpu>-<op>.json``)::

    {"meta": {"gpu", "versions", "command", "copy_gbs", "bf16_tflops"},
     "rows": [{"op", "hqk", "hv", "batch", "impl", "mode", "ms", ...}, ...]}

The markdown table next to it is generated from the JSON by :func:`write_results`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import pathlib
import re
import shlex
import statistics
import sys
from typing import Callable, Iterable

import torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[2] / "e2e_bench" / "results"


def parse_heads(text: str) -> tuple[int, int]:
    """``"Hqk/Hv"`` -> ``(H, HV)``, an argparse type; HV must be a positive multiple of H (GVA)."""
    try:
        h, hv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"heads {text!r}: expected Hqk/Hv, e.g. 16/48") from None
    if h <= 0 or hv <= 0 or hv % h:
        raise argparse.ArgumentTypeError(f"heads {text}: HV must be a positive multiple of H")
    return h, hv


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (counts of iterations, sequences, tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return value


def require_cuda(parser: argparse.ArgumentParser) -> None:
    """A GPU benchmark on a machine whose torch sees no CUDA device ends in one usage line."""
    if not torch.cuda.is_available():
        parser.error(f"needs a CUDA GPU; this torch ({torch.__version__}) sees none")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm of the error over the norm of the reference, in float64 on the CPU; ``inf`` when ``x``
    holds a non-finite value (an unwritten element or an overflow), so it fails every tolerance."""
    x, ref = x.double().cpu(), ref.double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def median_ms(fn: Callable[[], object], *, warmup: int = 10, iters: int = 100, graph: bool = False) -> float:
    """Median time of ``fn()`` in milliseconds, from CUDA events around each call.

    Eager mode counts the host overhead of each call, as an engine running eagerly pays it;
    ``graph=True`` captures one call in a CUDA graph and times its replays.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # allocations made on the capture stream before capture
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
        for _ in range(3):
            run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def nvidia_smi_query(fields: str, *, units: bool = True) -> str | None:
    """One ``nvidia-smi --query-gpu`` reading of ``fields`` (comma-separated names) for the
    current CUDA device, as nvidia-smi prints it (CSV, with units unless ``units=False``);
    None where nvidia-smi is missing or prints nothing."""
    import subprocess

    cmd = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader" + ("" if units else ",nounits")]
    if torch.cuda.is_available():
        cmd.append(f"--id={torch.cuda.current_device()}")
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def gpu_clock_state() -> dict:
    """The GPU's SM clock (MHz) and active clock-throttle reasons (NVML bit mask, e.g. 0x4 the
    software power cap) read now, right after a measurement; empty where nvidia-smi is missing.

    Our prefill kernels can run under the power cap where other libraries do not (H200:
    ~1.75 GHz after ours, 1.98 GHz after FlashInfer's at 16/64 heads,
    ``e2e_bench/results/2026-11-22-nvidia-h200-prefill-power-check.log``): the results rows
    carry the reading so that a grid shows it.
    """
    line = nvidia_smi_query("clocks.sm,clocks_throttle_reasons.active", units=False)
    try:
        mhz, reasons = (x.strip() for x in (line or "").split(","))
        return {"sm_mhz": int(mhz), "throttle": reasons}
    except ValueError:
        return {}


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=5, iters=30)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def bf16_tflops(n: int = 8192) -> float:
    """Dense bf16 matrix-product rate in TFLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: a @ b, warmup=5, iters=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def library_versions(extra: Iterable[str] = ()) -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("qla-serving", "triton", "tilelang", "fla-core", "flashinfer-python", "flash_qla", "vllm", "sglang", *extra):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def machine_meta() -> dict:
    """GPU name, library versions, exact command and the two measured ceilings."""
    return {
        "gpu": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "versions": library_versions(),
        "command": " ".join(shlex.quote(a) for a in ["qla-serving", *sys.argv[1:]]),
        "date": _dt.date.today().isoformat(),
        "copy_gbs": round(copy_bandwidth_gbs(), 1),
        "bf16_tflops": round(bf16_tflops(), 1),
    }


def results_path(op: str, gpu: str, out_dir: pathlib.Path | str | None = None) -> pathlib.Path:
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    directory = pathlib.Path(out_dir) if out_dir else RESULTS_DIR
    return directory / f"{_dt.date.today().isoformat()}-{slug}-{op}.json"


def markdown_table(rows: list[dict], key_cols: list[str], impls: list[str], value: str = "ms") -> str:
    """One line per key, one column per implementation and mode, plus ours-vs-others ratios."""
    modes = sorted({r["mode"] for r in rows})
    table: dict[tuple, dict] = {}
    for r in rows:
        table.setdefault(tuple(r.get(c) for c in key_cols), {})[(r["impl"], r["mode"])] = r[value]
    cols = [f"{i} {m}" for m in modes for i in impls]
    ratio_cols = [f"{o}/qla {m}" for m in modes for o in impls if o != "qla"] if "qla" in impls else []
    lines = ["| " + " | ".join(key_cols + cols + ratio_cols) + " |", "|" + "---|" * (len(key_cols) + len(cols) + len(ratio_cols))]
    for key, vals in table.items():
        cells = [str(k) for k in key]
        cells += [f"{vals[(i, m)]:.3f}" if (i, m) in vals else "–" for m in modes for i in impls]
        for m in modes:
            for o in impls:
                if o == "qla" or "qla" not in impls:
                    continue
                a, b = vals.get((o, m)), vals.get(("qla", m))
                cells.append(f"{a / b:.2f}x" if a and b else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(path: pathlib.Path, meta: dict, rows: list[dict], key_cols: list[str], impls: list[str],
                  notes: str = "") -> None:
    """Write the JSON results file and the markdown table generated from it beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    header = [f"# {path.stem}", "", f"- GPU: {meta['gpu']}", f"- command: `{meta['command']}`",
              f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
              f"- measured ceilings: copy {meta['copy_gbs']} GB/s, bf16 {meta['bf16_tflops']} TFLOP/s",
              (f"- times: median ms of {meta.get('iters', '?')} timed runs per cell after warm-up; "
               "ratios > 1 mean qla is faster"), ""]
    md = "\n".join(header) + markdown_table(rows, key_cols, impls) + "\n" + (f"\n{notes}\n" if notes else "")
    path.with_suffix(".md").write_text(md)
