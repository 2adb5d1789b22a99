"""Registers, stack and local-memory traffic of the GDN kernels, from their machine code (no GPU).

A kernel whose hot loop touches local memory (``LDL``/``STL``: registers spilled) runs its chain
slower than its twin without; ``ptxas`` decides that per kernel, so a change in one dtype's code
path can spill where the others do not. For each kernel: registers and stack frame
(``cuobjdump --dump-resource-usage``), and per loop that issues tensor-core products (``HGMMA``),
its instructions and local accesses (``cuobjdump -sass``; loops are the backward branches before
the last ``EXIT``, the out-of-line barrier retries after it left out).

    # a built library: every kernel of the kinds given
    python scripts/kernel_resources.py --library kernels/shipped --kinds chunk_fwd
    # prefill configurations compiled now with TileLang (the staged tree first on PYTHONPATH)
    python scripts/kernel_resources.py --prefill '[[16, 32, "bfloat16", "float32", "bfloat16", true, null]]'

Exit status 1 when a kernel's loop touches local memory.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from library_sass import capture_jit_cubins, sass_at  # beside this script

BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
LOCAL = re.compile(r"\b(LDL|STL)\b")


def cuobjdump() -> str:
    """$CUOBJDUMP, cuobjdump from PATH, else the copy Triton's NVIDIA backend ships."""
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    import triton

    path = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not path.is_file():
        raise SystemExit("cuobjdump: not on PATH and not in Triton's NVIDIA backend")
    return str(path)


def loops(sass_lines: list[tuple[int, str]]) -> list[dict]:
    """The loops of one function that issue HGMMA: instruction and local-access counts."""
    last_exit = max((a for a, t in sass_lines if re.search(r"\bEXIT\b", t)), default=0)
    out = []
    for a, t in sass_lines:
        m = BRANCH.search(t)
        target = int(m.group(1), 16) if m else a
        if a < last_exit and target < a:
            body = [x for b, x in sass_lines if target <= b <= a]
            mma = sum("HGMMA" in x for x in body)
            if mma:
                out.append({"instructions": len(body), "hgmma": mma, "local": sum(bool(LOCAL.search(x)) for x in body)})
    return out


def analyse(binary: str, tool: str) -> list[dict]:
    """Per function of ``binary``: registers, stack, local accesses, HGMMA loops."""
    usage = subprocess.run([tool, "--dump-resource-usage", binary], capture_output=True, text=True, check=True).stdout
    regs = [(int(r), int(s)) for r, s in re.findall(r"REG:(\d+) STACK:(\d+)", usage)]
    funcs = sass_at(binary, tool)
    if len(regs) != len(funcs):
        raise SystemExit(f"{binary}: {len(regs)} resource entries for {len(funcs)} functions")
    return [{"registers": r, "stack": s, "local": sum(bool(LOCAL.search(t)) for _, t in f), "loops": loops(f)}
            for f, (r, s) in zip(funcs, regs)]


def from_library(path: pathlib.Path, kinds: list[str], tool: str) -> list[tuple[str, dict]]:
    """Every kernel of ``kinds`` in a library, named by its manifest key."""
    manifest = json.loads((path / "manifest.json").read_text())
    by_symbol = {v["symbol"]: json.loads(k) for k, v in manifest["kernels"].items()}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        # every kernel's cubin at once (one cuobjdump over the whole library per kernel is minutes)
        subprocess.run([tool, "-xelf", "all", str((path / manifest["library"]).resolve())], cwd=tmp,
                       capture_output=True, check=True)
        for cubin in sorted(pathlib.Path(tmp).glob("*.cubin")):
            key = by_symbol.get(cubin.name.split(".")[0])
            if key is not None and key[0] in kinds:
                (entry,) = analyse(str(cubin), tool)
                out.append((json.dumps(key), entry))
    return out


def from_prefill_configs(configs: list[list], tool: str) -> list[tuple[str, dict]]:
    """Each prefill configuration's two kernels compiled now with TileLang (nothing cached)."""
    captured = capture_jit_cubins()
    from qla_serving.kernels import chunk_prefill

    out = []
    for fields in configs:
        captured.clear()
        chunk_prefill._kernels.clear()
        chunk_prefill._kernel_set(chunk_prefill.PrefillStaticConfig(*(tuple(f) if isinstance(f, list) else f for f in fields)))
        for kind, binary in zip(("prep", "chunk_fwd"), captured):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(binary)
                f.flush()
                (entry,) = analyse(f.name, tool)
            out.append((json.dumps([kind, fields]), entry))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--library", type=pathlib.Path, help="a built library's directory")
    src.add_argument("--prefill", help="JSON list of PrefillStaticConfig field lists, compiled now")
    ap.add_argument("--kinds", nargs="+", default=["prep", "chunk_fwd", "decode"], help="with --library")
    args = ap.parse_args()
    tool = cuobjdump()
    rows = from_library(args.library, args.kinds, tool) if args.library else from_prefill_configs(json.loads(args.prefill), tool)
    spilling = 0
    for key, e in rows:
        hot = [lp for lp in e["loops"] if lp["local"]]
        spilling += bool(hot)
        loops_text = "; ".join(f"{lp['instructions']} instrs {lp['hgmma']} HGMMA {lp['local']} local" for lp in e["loops"])
        print(f"{'LOCAL IN LOOP' if hot else 'ok'}  {key}: {e['registers']} registers, stack {e['stack']} B, "
              f"{e['local']} local accesses; loops: {loops_text or 'none with HGMMA'}", flush=True)
    print(f"{len(rows)} kernels, {spilling} with local memory in a tensor-core loop")
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
