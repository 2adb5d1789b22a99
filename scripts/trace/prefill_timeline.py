"""Where a prefill chunk's cycles go: clock64 timelines of chunk_fwd's roles and prep's phases.

    python scripts/trace/prefill_timeline.py 16:64:8x4096 2:8:1x8192:nocp [--compile-only]

Cells are HQK:HV:BATCH[:nocp] (BATCH as in the bench, e.g. 8x4096 or 24576+8192). For each
cell: chunk_fwd's median cycles per chunk (the state role's chunk-to-chunk period, chunks 4..23
of every work item) and each stamp's median offset from the chunk's start; prep's median
cycles per block and per phase. Run on the GPU machine after scripts/gpu_stage.sh; JSON goes to
$OUT/prefill-timeline.json when OUT is set. --compile-only fills TileLang's cache here.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants


def main(argv):
    compile_only = "--compile-only" in argv
    cells = [a for a in argv if not a.startswith("--")]
    mod = variants.load("qla_prefill_traced", variants.traced_source())
    if compile_only:
        for cell in cells:
            mod.warmup(*variants.cell_heads(cell))
        return 0
    res = {}
    for cell in cells:
        fwd, prep = variants.run_traced(mod, cell)
        period = (fwd[:, 1:, 0] - fwd[:, :-1, 0]).double().median().item()
        rel = (fwd - fwd[:, :, :1]).double()
        stamps = {name: rel[:, :, s].median().item() for s, name in variants.FWD_NAMES.items() if (fwd[:, :, s] != 0).any()}
        prep = prep[:, :len(variants.PREP_NAMES)].double()
        prel = prep - prep[:, :1]
        phases = {name: prel[:, s].median().item() for s, name in enumerate(variants.PREP_NAMES)}
        print(f"== {cell}: chunk_fwd {period:.0f} cycles per chunk ({fwd.shape[0]} blocks traced)")
        for name, v in sorted(stamps.items(), key=lambda kv: kv[1]):
            print(f"  {name:16s} {v:8.0f}")
        print(f"   prep {phases['end']:.0f} cycles per block")
        prev = 0.0
        for name, v in phases.items():
            print(f"  {name:16s} {v:8.0f}  (+{v - prev:.0f})")
            prev = v
        res[cell] = {"chunk_fwd_cycles_per_chunk": period, "chunk_fwd_stamps": stamps, "prep_phases": phases}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prefill-timeline.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
