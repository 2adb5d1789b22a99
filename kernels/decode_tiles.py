"""The decode kernel's tiles: what a tile is, and which one a call gets.

A :class:`DecodeTile` says how one CTA covers its share of a ``V x K`` state (kernels/decode_program.py's
docstring); ``DECODE_CONFIGS`` (kernels/configs.py) chooses one per pool dtype and number of
(sequence, value head) pairs, and :class:`force_tile` overrides the choice for tile sweeps.
"""

# No `from __future__ import annotations`: DecodeTile.parse's return annotation names the class.
import re
from typing import NamedTuple

from ..constants import HEAD_DIM
from .configs import DECODE_CONFIGS

LANES_PER_ROW = 8  # default lanes sharing one state row (3-step butterfly reductions)


class DecodeTile(NamedTuple):
    """How one CTA covers its share of a ``V x K`` state (see the module docstring).

    rows_per_cta: state rows per CTA (divides V = 128).
    threads: threads per CTA (a multiple of 32).
    lanes_per_row: consecutive lanes sharing one row (4, 8, 16 or 32; bf16 pools at most 16,
        so each lane holds at least one 16-byte vector).
    min_blocks: CTAs per SM promised to the compiler through ``__launch_bounds__`` (caps
        registers per thread); 0 leaves the compiler's default.
    stream: for single-token steps that update the pool in place, keep the loaded rows in
        the pool dtype and convert, update and store them one row at a time (bf16: twice the
        bytes in flight per register); other calls ignore it.
    """

    rows_per_cta: int
    threads: int
    lanes_per_row: int = LANES_PER_ROW
    min_blocks: int = 0
    stream: bool = False

    def __str__(self) -> str:
        text = f"{self.rows_per_cta}x{self.threads}"
        if self.lanes_per_row != LANES_PER_ROW:
            text += f"l{self.lanes_per_row}"
        if self.min_blocks:
            text += f"b{self.min_blocks}"
        if self.stream:
            text += "s"
        return text

    @classmethod
    def parse(cls, text: str) -> "DecodeTile":
        """``ROWSxTHREADS[lLANES][bMINBLOCKS][s]``, e.g. ``32x64``, ``64x128l16``, ``32x64b8s``."""
        m = re.fullmatch(r"(\d+)x(\d+)(?:l(\d+))?(?:b(\d+))?(s)?", text.strip())
        if m is None:
            raise ValueError(
                f"decode tile {text!r}: expected ROWSxTHREADS[lLANES][bMINBLOCKS][s], e.g. 32x64l16s"
            )
        rows, threads, lanes, blocks, stream = m.groups()
        return cls(
            int(rows),
            int(threads),
            int(lanes) if lanes else LANES_PER_ROW,
            int(blocks) if blocks else 0,
            stream is not None,
        )

    def check(self, pool_dtype: str) -> None:
        """Raise ValueError naming the broken constraint, for a pool dtype "float32" or "bfloat16"."""
        vec = 16 // (4 if pool_dtype == "float32" else 2)
        lanes = self.lanes_per_row
        if lanes not in (4, 8, 16, 32):
            raise ValueError(f"decode tile {self}: lanes_per_row must be 4, 8, 16 or 32")
        if (HEAD_DIM // lanes) % vec:
            raise ValueError(
                f"decode tile {self}: with a {pool_dtype} pool a lane must hold whole 16-byte "
                f"vectors ({vec} values), so lanes_per_row <= {HEAD_DIM // vec}"
            )
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"decode tile {self}: threads must be a multiple of 32 in [32, 1024]")
        rows_per_pass = self.threads // lanes
        if HEAD_DIM % self.rows_per_cta or self.rows_per_cta % rows_per_pass:
            raise ValueError(
                f"decode tile {self}: rows_per_cta must divide {HEAD_DIM} and be a multiple of "
                f"threads / lanes_per_row = {rows_per_pass}"
            )
        if self.min_blocks < 0:
            raise ValueError(f"decode tile {self}: min_blocks must be >= 0")


_forced_tile: DecodeTile | None = None  # set by force_tile (tile sweeps); None: DECODE_CONFIGS decides


# Parsed bands per pool dtype, with the table and entry they were parsed from: tile_for runs on
# every decode call, the table changes only when it is replaced (tests, tile sweeps).
_parsed: dict[str, tuple] = {}


def _configured_tiles(pool_dtype: str) -> list[tuple[int | None, DecodeTile]]:
    """DECODE_CONFIGS' tiles for one pool dtype as (max_pairs or None for no limit, tile), in order
    (parsed once per table entry).

    Two forms are read: ``"bands": [(max_pairs, "ROWSxTHREADS[lLANES][bMINBLOCKS]"), ...,
    (None, "...")]`` (first band whose max_pairs >= the call's (sequence, head) pairs wins), or
    the keys ``rows_per_cta``/``threads`` with ``small_rows_per_cta``/``small_threads`` up to
    ``DECODE_CONFIGS["small_max_pairs"]`` (8 lanes per row unless ``lanes_per_row`` /
    ``small_lanes_per_row`` say otherwise).
    """
    cfg = DECODE_CONFIGS[pool_dtype]
    hit = _parsed.get(pool_dtype)
    if hit is not None and hit[0] is DECODE_CONFIGS and hit[1] is cfg:
        return list(hit[2])
    bands = _parse_bands(pool_dtype, cfg)
    _parsed[pool_dtype] = (DECODE_CONFIGS, cfg, tuple(bands))
    return bands


def _parse_bands(pool_dtype: str, cfg: dict) -> list[tuple[int | None, DecodeTile]]:
    if "bands" in cfg:
        bands = [
            (limit, DecodeTile.parse(t) if isinstance(t, str) else DecodeTile(*t))
            for limit, t in cfg["bands"]
        ]
    else:
        small = DecodeTile(
            cfg["small_rows_per_cta"],
            cfg["small_threads"],
            cfg.get("small_lanes_per_row", LANES_PER_ROW),
            cfg.get("small_min_blocks", 0),
        )
        large = DecodeTile(
            cfg["rows_per_cta"],
            cfg["threads"],
            cfg.get("lanes_per_row", LANES_PER_ROW),
            cfg.get("min_blocks", 0),
        )
        bands = [(DECODE_CONFIGS["small_max_pairs"], small), (None, large)]
    if not bands or bands[-1][0] is not None:
        raise ValueError(f"DECODE_CONFIGS[{pool_dtype!r}]: the last band must have no pair limit (None)")
    for _, tile in bands:
        tile.check(pool_dtype)
    return bands


def tile_for(num_pairs: int, pool_dtype: str) -> DecodeTile:
    """The tile for a call with ``num_pairs`` (sequence, value head) pairs and a pool dtype
    ("float32" or "bfloat16"): smaller tiles (more CTAs) when there are few pairs."""
    if _forced_tile is not None:
        return _forced_tile
    for limit, tile in _configured_tiles(pool_dtype):
        if limit is None or num_pairs <= limit:
            return tile
    raise AssertionError("unreachable: the last band has no limit")


def tiles_to_compile(pool_dtype: str) -> set[DecodeTile]:
    """Every tile :func:`tile_for` can give for a pool dtype (the forced one during a sweep)."""
    if _forced_tile is not None:
        return {_forced_tile}
    return {t for _, t in _configured_tiles(pool_dtype)}


class force_tile:
    """Context manager: every call inside uses ``tile`` (a DecodeTile or its text), whatever
    DECODE_CONFIGS says. For tile sweeps; not thread-safe, not for serving."""

    def __init__(self, tile):
        self.tile = DecodeTile.parse(tile) if isinstance(tile, str) else DecodeTile(*tile)

    def __enter__(self):
        global _forced_tile
        self.saved, _forced_tile = _forced_tile, self.tile
        return self.tile

    def __exit__(self, *exc):
        global _forced_tile
        _forced_tile = self.saved
        return False
