"""Show that a precompiled kernel library holds the same machine code as TileLang's JIT.

For every kernel in a library's manifest (or the first ``--limit``), compile the same static
configuration with TileLang's default (JIT) path, capture the cubin nvcc returns, and compare
``cuobjdump -sass`` of both with the kernel names and line-info comments taken out. No GPU needed:
TileLang 0.1.15 and nvcc on the machine. Run from a directory outside the checkout, with the
staged tree first on PYTHONPATH (``scripts/gpu_stage.sh``):

    python scripts/library_sass.py LIBRARY_DIR [--sample N]   # N kernels spread over the library
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile


def sass_at(binary_path: str, tool: str = "cuobjdump") -> list[list[tuple[int, str]]]:
    """The SASS of each function in a binary as ``(address, instruction)`` (encodings taken out); a
    library holds many functions of one name, one per kernel."""
    out = subprocess.run([tool, "-sass", binary_path], check=True, capture_output=True, text=True).stdout
    funcs: list[list[tuple[int, str]]] = []
    for line in out.splitlines():
        if re.match(r"\s*Function : \S+", line):
            funcs.append([])
            continue
        if not funcs:
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.+?)\s*;", line)  # an instruction: /*addr*/ TEXT ;
        if m:
            funcs[-1].append((int(m.group(1), 16), m.group(2)))
    return funcs


def sass(binary_path: str) -> list[list[str]]:
    """The SASS of each function in a binary, instructions only (addresses and encodings taken out)."""
    return [[text for _, text in func] for func in sass_at(binary_path)]


def capture_jit_cubins() -> list[bytes]:
    """From here on, every kernel is compiled by TileLang's JIT (no library, no cache) and each
    cubin nvcc returns is appended to the list returned."""
    os.environ["QLA_KERNEL_LIBRARY_OFF"] = "1"
    os.environ["TILELANG_CACHE_DIR"] = tempfile.mkdtemp(prefix="tl-cache-")
    import tilelang
    import tilelang.contrib.nvcc as tl_nvcc

    captured: list[bytes] = []
    real = tl_nvcc.compile_cuda

    def capture(*a, **kw):
        binary = real(*a, **kw)
        captured.append(bytes(binary))
        return binary

    tl_nvcc.compile_cuda = capture
    tilelang.disable_cache()
    return captured


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("library")
    ap.add_argument("--sample", type=int, default=0, help="check N kernels spread evenly over the manifest")
    args = ap.parse_args()
    lib = pathlib.Path(args.library)
    manifest = json.loads((lib / "manifest.json").read_text())
    captured = capture_jit_cubins()
    from qla_serving.kernels import chunk_prefill, decode
    from qla_serving.kernels.decode_tiles import DecodeTile

    ours = sass(str(lib / manifest["library"]))
    keys = list(manifest["kernels"].items())
    if args.sample and args.sample < len(keys):
        keys = [keys[round(i * (len(keys) - 1) / (args.sample - 1))] for i in range(args.sample)]
    same = differ = 0
    for key, entry in keys:
        kind, fields = json.loads(key)
        captured.clear()
        if kind == "decode":
            decode._cache.clear()
            decode._get_kernel(decode.DecodeStaticConfig(*fields[:-1], DecodeTile(*fields[-1])))
            jit_bin = captured[-1]
        else:
            chunk_prefill._kernels.clear()
            # (JSON gives the packed inputs' dtype pair as a list; the config is hashed)
            chunk_prefill._kernel_set(chunk_prefill.PrefillStaticConfig(
                *(tuple(f) if isinstance(f, list) else f for f in fields)))
            jit_bin = captured[0 if kind == "prep" else 1]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(jit_bin)
            f.flush()
            (jit_code,) = sass(f.name)
        ok = jit_code in ours
        same += ok
        differ += not ok
        print(f"{'same' if ok else 'DIFFERS'}  {kind} {fields}  ({len(jit_code)} instructions)", flush=True)
    print(f"{same} kernels with the JIT's SASS, {differ} differing")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
