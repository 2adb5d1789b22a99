"""Per-warpgroup clock timelines of chunk_fwd's state role (its two warpgroups apart).

    python scripts/trace/state_timeline.py 16:64:8x4096 4:16:1x32768 [--compile-only]

``prefill_timeline.py`` stamps one thread per warpgroup into one slot per stamp, so the state
role's two warpgroups overwrite each other there. Here each state stamp has two slots, the
second warpgroup's at slot + 16 (the P role's and the producer's stamps are left out to make
room), plus one after the first products' issue. (Stamps cannot go inside the kernel's macros,
such as the output store's.) Prints, per cell, the period (the first
warpgroup's chunk starts, chunks 4..23 of every work item) and each stamp's median offset from
the first warpgroup's chunk start, in time order. Run on the GPU machine after
scripts/gpu_stage.sh. Measurement only.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants

STAMPS = [s for s in variants.FWD_STAMPS if s[1] < 16] + [
    ("T.named_barrier_arrive(TURN + 1 - wg, 2 * WG)", 15, 1, False),
]
NAMES = {**variants.FWD_NAMES, 15: "first products issued"}


def source() -> str:
    """The kernel module with the state role's stamps, each warpgroup its own slots."""
    saved = list(variants.FWD_STAMPS)
    variants.FWD_STAMPS[:] = STAMPS
    try:
        src = variants.traced_source()
    finally:
        variants.FWD_STAMPS[:] = saved
    for _, slot, _, _ in STAMPS:
        src = src.replace(f"stamp(trace, wi, hv, c, {slot})", f"stamp(trace, wi, hv, c, {slot} + 16 * (tx // WG))")
    return src


def main(argv):
    mod = variants.load("qla_prefill_state_timeline", source())
    cells = [a for a in argv if not a.startswith("--")]
    if "--compile-only" in argv:
        for cell in cells:
            mod.warmup(*variants.cell_heads(cell))
        return 0
    for cell in cells:
        fwd, _ = variants.run_traced(mod, cell)
        period = (fwd[:, 1:, 0] - fwd[:, :-1, 0]).double().median().item()
        rel = (fwd - fwd[:, :, :1]).double()
        print(f"== {cell}: {period:.0f} cycles per chunk ({fwd.shape[0]} blocks traced)")
        rows = []
        for _, slot, _, _ in STAMPS:
            for w in (0, 1):
                if (fwd[:, :, slot + 16 * w] != 0).any():
                    rows.append((rel[:, :, slot + 16 * w].median().item(), f"WG{w} {NAMES[slot]}"))
        for v, name in sorted(rows):
            print(f"  {name:28s} {v:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
