"""The hottest SASS lines of an Nsight Compute source page (``ncu -i R --page source --csv
--print-source sass``), from stdin or a file (``.xz`` read as such).

Prints, per kernel in the page, the lines with the most warp-stall samples and, for each, the
sample columns that are not zero (the stall reasons ncu names), so a session can see where a
kernel waits without opening the report. Column names are matched loosely (ncu versions
differ): a column counts as samples when its name contains "Sampl".

    python scripts/ncu_hot.py profile-2-8-sass.csv.xz [--top 25]
"""

import argparse
import csv
import io
import lzma
import sys


def _rows(text: str):
    """(kernel name or '', header, rows) per CSV table in the page. ncu 2025 prints one table per
    kernel after a ``"Kernel Name","<name>",`` row; older pages put the bare name on a line of
    its own, tables separated by blank lines."""
    tables, kernel, lines = [], "", []

    def close():
        nonlocal lines
        if lines:
            tables.append((kernel, lines))
            lines = []

    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            close()
            kernel = next(csv.reader([line]))[1].strip()
            continue
        if line.startswith(('"', "Address")) or (lines and line):
            lines.append(line)
            continue
        close()
        if line.strip():
            kernel = line.strip()
    close()
    for kernel, block in tables:
        reader = csv.reader(io.StringIO("\n".join(block)))
        header = next(reader, None)
        if header:
            yield kernel, header, list(reader)


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?", default="-")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.path == "-":
        text = sys.stdin.read()
    else:
        opener = lzma.open if args.path.endswith(".xz") else open
        with opener(args.path, "rt") as f:
            text = f.read()
    found = False
    for kernel, header, rows in _rows(text):
        samples = [i for i, h in enumerate(header) if "Sampl" in h]
        if not samples:
            continue
        found = True
        total_col = samples[0]
        src = next((i for i, h in enumerate(header) if h.strip() == "Source"), None)
        total = sum(_num(r[total_col]) for r in rows if len(r) > total_col) or 1.0
        print(f"== {kernel or '(kernel)'}: {len(rows)} lines, {total:.0f} samples in '{header[total_col]}'")
        # per-reason columns (stall_barrier, stall_long_sb, ...), the issued and not-issued ones
        reasons_cols = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
        if reasons_cols:
            sums = {header[i]: sum(_num(r[i]) for r in rows if len(r) > i) for i in reasons_cols}
            top = sorted(sums.items(), key=lambda kv: -kv[1])[:8]
            print("   by reason: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in top if v))
        hot = sorted((r for r in rows if len(r) > total_col), key=lambda r: -_num(r[total_col]))[: args.top]
        for r in hot:
            per = sorted(((header[i][6:], _num(r[i])) for i in reasons_cols if len(r) > i and _num(r[i])),
                         key=lambda kv: -kv[1])[:3]
            if per:  # the line's top stall reasons where the page has them, else its other sample columns
                reasons = ", ".join(f"{k} {v:.0f}" for k, v in per)
            else:
                reasons = ", ".join(f"{header[i]}={r[i]}" for i in samples[1:] if _num(r[i]))
            text_col = r[src] if src is not None else ""
            print(f"{100 * _num(r[total_col]) / total:5.1f}%  {text_col[:70]:<70}  {reasons[:160]}")
    if not found:
        print("no sample columns found (is this `--page source --csv --print-source sass` output?)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
