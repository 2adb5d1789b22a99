"""Installs a kernel library built elsewhere (the GPU host's `gpu_session.sh library`) as the one the
wheel ships, after checking it was built from these sources.

The device's 64 cores build the shipped set in about 6 minutes against an hour or two on this
machine's two; its `library` step returns the library as pieces ``qla-lib.tar.xz.NN`` (xz of the
directory, a few MiB: the cubins repeat each other). This joins the pieces in name order, unpacks
them, refuses a library whose ``source_digest`` is not the digest of the kernel sources here (a
stale library is skipped at serve time with a warning, so shipping one would mean compiling or
falling back), then replaces the target directory:

    python scripts/library_unpack.py /work/.device/3/qla-lib.tar.xz.* [--into kernels/shipped]
    pip wheel . --no-deps -w dist

Exit status 1 with the reason when a piece is missing, the archive holds no library, or the
digests differ.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import pathlib
import shutil
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sources_digest() -> str:
    """The digest of the kernel sources of this checkout (what `qla-serving compile` writes)."""
    from qla_serving.kernels import library  # the installed package (the editable install of ROOT)

    return library.source_digest()


def unpack(pieces: list[pathlib.Path], into: pathlib.Path, digest: str) -> dict:
    """Joins ``pieces`` (name order), unpacks the tar.xz and replaces ``into`` with it.

    pieces: the archive's parts, ``qla-lib.tar.xz.00`` ... in any order.
    into: the library directory to replace (``kernels/shipped``).
    digest: the source digest the library must carry (16 hex digits).
    Returns the library's manifest. Raises ValueError naming what is wrong; ``into`` is untouched then.
    """
    if not pieces:
        raise ValueError("no archive pieces given")
    pieces = sorted(pieces, key=lambda p: p.name)
    missing = [p for p in pieces if not p.is_file()]
    if missing:
        raise ValueError(f"missing archive pieces: {', '.join(map(str, missing))}")
    data = b"".join(p.read_bytes() for p in pieces)
    try:
        raw = lzma.decompress(data)
    except lzma.LZMAError as e:
        raise ValueError(f"{pieces[0].name}...: not a complete xz archive ({e}); are all pieces there?") from None
    into = into.resolve()
    with tempfile.TemporaryDirectory(dir=into.parent) as tmp:
        stage = pathlib.Path(tmp) / "library"
        stage.mkdir()
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            tar.extractall(stage, filter="data")
        manifest_path = stage / "manifest.json"
        if not manifest_path.is_file():
            raise ValueError("the archive holds no manifest.json: not a kernel library")
        manifest = json.loads(manifest_path.read_text())
        so = stage / manifest.get("library", "")
        if not manifest.get("library") or not so.is_file():
            raise ValueError(f"the manifest names shared object {manifest.get('library')!r}, not in the archive")
        if manifest.get("source_digest") != digest:
            raise ValueError(f"library built from other kernel sources: digest {manifest.get('source_digest')}, "
                             f"these sources {digest} (rebuild it from this checkout)")
        old = pathlib.Path(tmp) / "old"
        if into.exists():
            into.rename(old)
        shutil.move(str(stage), str(into))
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pieces", nargs="+", type=pathlib.Path, help="qla-lib.tar.xz.NN pieces")
    p.add_argument("--into", type=pathlib.Path, default=ROOT / "kernels" / "shipped", help="library directory to replace")
    args = p.parse_args(argv)
    try:
        m = unpack(args.pieces, args.into, sources_digest())
    except ValueError as e:
        print(f"library_unpack: {e}", file=sys.stderr)
        return 1
    print(f"library {m['source_digest']}: {len(m.get('kernels', {}))} kernels, built {m.get('built')} with "
          f"{m.get('built_with')}, in {args.into}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
