"""``qla-serving bench summary``: the prefill issue's targets read off one or more result files.

A grid too long for one device command runs as several ``bench prefill`` calls (a few head
configs each); this reads their JSON files together and prints, in markdown:

* the targets: geomean and slowest cell against FLA over every cell, geomean against
  FlashInfer over the cells of >= 8192 tokens, and how many of those are below 1.0;
* each cell of >= 8192 tokens where FlashInfer is faster, with the DRAM bound of a two-kernel
  split beside it (:func:`qla_serving.bench.prefill.split_bytes` at the run's measured copy
  bandwidth): where FlashInfer's time is below that bound, and by more than L2 could hold, no
  kernel pair of that shape can match it however fast its arithmetic.

Reads files only: no GPU needed.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

from .prefill import batch_lens, min_bytes, split_bytes

BIG_TOKENS = 8192  # the long-prompt cells, where the prefill target against FlashInfer is judged


def load_runs(paths: list[str | pathlib.Path]) -> tuple[dict, list[dict]]:
    """Read prefill result files. Returns ``(times, metas)``: ``times[(hqk, hv, batch, impl,
    mode)] = ms`` over all files, and each file's ``meta`` with ``path`` added.

    Raises ValueError for a file of another op, a cell measured twice (two runs of the same
    head config would make the summary depend on the order of the files) or runs on
    different GPUs."""
    times, metas = {}, []
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        meta = dict(data["meta"], path=str(path))
        for row in data["rows"]:
            if row.get("op") != "prefill":
                raise ValueError(f"{path}: row of op {row.get('op')!r}; the summary reads prefill results")
            key = (row["hqk"], row["hv"], row["batch"], row["impl"], row["mode"])
            if key in times:
                raise ValueError(f"{path}: {key} is in an earlier file too; give each cell once")
            times[key] = row["ms"]
        metas.append(meta)
    gpus = {m["gpu"] for m in metas}
    if len(gpus) > 1:
        raise ValueError(f"runs on different GPUs ({', '.join(sorted(gpus))}): summarise each GPU alone")
    return times, metas


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summarize(times: dict, metas: list[dict], mode: str = "graph") -> dict:
    """Ratios (theirs / ours, > 1: ours faster) for ``mode``, the targets and the cells below
    FlashInfer with their split bounds. Cells where an implementation has no time (a failed or
    skipped run) are left out of that implementation's ratios and listed under ``missing``."""
    copy_gbs = sum(m["copy_gbs"] for m in metas) / len(metas)
    cells = sorted({k[:3] for k in times}, key=lambda c: (c[0], c[1], -sum(batch_lens(c[2])), c[2]))
    fla, fi_big, below, missing = {}, {}, [], []
    for cell in cells:
        ours, by_fla, by_fi = (times.get((*cell, impl, mode)) for impl in ("qla", "fla", "flashinfer"))
        missing += [(*cell, impl) for impl, t in (("qla", ours), ("fla", by_fla), ("flashinfer", by_fi)) if t is None]
        if ours is None:
            continue
        if by_fla is not None:
            fla[cell] = by_fla / ours
        lens, (hqk, hv) = batch_lens(cell[2]), cell[:2]
        if by_fi is None or sum(lens) < BIG_TOKENS:
            continue
        fi_big[cell] = by_fi / ours
        if by_fi < ours:
            base, least = min_bytes(lens, hqk, hv), split_bytes(lens, hqk, hv, least=True)
            to_ms = 1e3 / (copy_gbs * 1e9)
            below.append(dict(
                hqk=hqk, hv=hv, batch=cell[2], qla=ours, flashinfer=by_fi, ratio=by_fi / ours,
                floor=base * to_ms, split=(base + split_bytes(lens, hqk, hv)) * to_ms,
                least=(base + least) * to_ms, least_extra_mb=least / 1e6,
                # the bytes beyond the floor's that FlashInfer's time leaves at copy bandwidth: the
                # least split ties only if L2 keeps least_extra_mb - slack_mb of its bytes off DRAM
                slack_mb=(by_fi / to_ms - base) / 1e6))
    return dict(
        gpu=metas[0]["gpu"], mode=mode, copy_gbs=copy_gbs, files=[m["path"] for m in metas],
        commands=[m.get("command", "") for m in metas],
        fla_geomean=_geomean(list(fla.values())), fla_min=min(fla.values(), default=float("nan")),
        fla_cells=len(fla), fi_big_geomean=_geomean(list(fi_big.values())), fi_big_cells=len(fi_big),
        below=below, missing=missing)


def render(s: dict) -> str:
    """The summary as markdown."""
    out = [f"# Prefill summary: {s['gpu']}, {s['mode']} timings", ""]
    out += [f"- `{f}`: `{c}`" for f, c in zip(s["files"], s["commands"])]
    out += [f"- copy bandwidth (mean of the runs' measurements): {s['copy_gbs']:.0f} GB/s", ""]
    out += [
        "| target | asked | measured |", "|---|---|---|",
        f"| FLA / ours, geomean over {s['fla_cells']} cells | >= 2.5x | {s['fla_geomean']:.2f}x |",
        f"| FLA / ours, slowest cell | > 1.0x | {s['fla_min']:.2f}x |",
        (f"| FlashInfer / ours, geomean over {s['fi_big_cells']} cells of >= {BIG_TOKENS} tokens | >= 1.1x "
         f"| {s['fi_big_geomean']:.2f}x |"),
        f"| cells of >= {BIG_TOKENS} tokens below FlashInfer | 0 | {len(s['below'])} |", ""]
    if s["below"]:
        out += [
            ("Cells below FlashInfer. `floor`: the least bytes any implementation moves, at the copy "
             "bandwidth; `split`: those plus what our two kernels pass between them and read twice; "
             "`least split`: those plus the least any two-kernel split passing the inverse moves "
             "(`qla_serving.bench.prefill.split_bytes`). FlashInfer / bound < 1: FlashInfer finishes "
             "before a split of that shape could move its bytes at copy bandwidth, unless L2 keeps "
             "part of them out of DRAM; `least extra` less `slack` (what FlashInfer's time leaves "
             "beyond the floor's bytes) is what L2 would have to hold for the least split to tie."), "",
            ("| heads | batch | ours ms | FlashInfer ms | FlashInfer / ours | floor ms | split ms "
             "| FlashInfer / split | least split ms | FlashInfer / least split | least extra MB | slack MB |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for b in s["below"]:
            out.append(
                f"| {b['hqk']}/{b['hv']} | {b['batch']} | {b['qla']:.3f} | {b['flashinfer']:.3f} | {b['ratio']:.2f}x "
                f"| {b['floor']:.3f} | {b['split']:.3f} | {b['flashinfer'] / b['split']:.2f} | {b['least']:.3f} "
                f"| {b['flashinfer'] / b['least']:.2f} | {b['least_extra_mb']:.0f} | {b['slack_mb']:.0f} |")
        out.append("")
    if s["missing"]:
        out += ["Missing times (left out of the ratios): "
                + ", ".join(f"{h}/{hv} {b} {impl}" for h, hv, b, impl in s["missing"]), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qla-serving bench summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="prefill result JSON files of one GPU (e2e_bench/results/...)")
    ap.add_argument("--mode", choices=["graph", "eager"], default="graph")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    try:
        times, metas = load_runs(args.files)
    except (OSError, ValueError, KeyError) as e:
        print(f"qla-serving bench summary: {e}", file=sys.stderr)
        return 2
    text = render(summarize(times, metas, args.mode))
    print(text, end="")
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
