"""Build a precompiled kernel library (:mod:`qla_serving.kernels.library`): TileLang and nvcc
at build time, nothing of either at serving time.

For each static configuration the engines' warm-up would compile (:mod:`qla_serving.warmup`),
the kernel modules build their TileLang programs as usual; ``tilelang.compile`` is taken over so
that TileLang lowers each one with its C host code (the ``cython`` backend's: TMA descriptors and
launch configuration, which need nothing of TileLang to run) and hands back the generated source
and its nvcc command instead of building and loading a module of its own. Each source is
compiled to an object with that command, its entry points renamed to a symbol of its own and
every other global made local, and all objects are linked into one shared object beside a
``manifest.json``. Configurations build in parallel processes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import hashlib
import json
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from .warmup import WarmupConfig, kernel_warmup_specs, resolve_steps

LIBRARY_NAME = "libqla_gdn_sm90a.so"


class _Captured(Exception):
    """Raised from inside TileLang's library build to carry its source and command out."""


@dataclasses.dataclass
class _Program:
    """What ``tilelang.compile`` returned to a kernel module during a build."""

    lib_code: str
    command: list
    prim_func: object


def _capture_compile(func, *args, **kwargs):
    """``tilelang.compile`` as a build sees it: lower with the cython backend's host code and return
    a :class:`_Program` instead of compiling."""
    import importlib

    libgen = importlib.import_module("tilelang.jit.adapter.libgen")

    class _Run:
        @staticmethod
        def run(command, **_):
            src = next(c for c in command if c.endswith(".cu"))
            raise _Captured(pathlib.Path(src).read_text(), list(command))

    libgen.subprocess = _Run
    try:
        kwargs["execution_backend"] = "cython"
        _capture_compile.real(func, *args, **kwargs)
    except Exception as e:  # TileLang may wrap the capture in errors of its own
        cause = e
        while cause is not None and not isinstance(cause, _Captured):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return _Program(cause.args[0], cause.args[1], func)
    finally:
        libgen.subprocess = subprocess
    raise RuntimeError("tilelang.compile built a module without running nvcc (a cached one?)")


def _programs(cfg: WarmupConfig) -> list[tuple[str, object, _Program]]:
    """``(kind, static config, program)`` of every kernel ``cfg``'s warm-up compiles."""
    from .kernels import chunk_prefill, decode

    decode._cache.clear()
    chunk_prefill._kernels.clear()
    for _, fn in resolve_steps(kernel_warmup_specs(cfg)):
        fn()
    out = [("decode", key, prog) for key, prog in decode._cache.items()]
    for pcfg, (prep, fwd) in chunk_prefill._kernels.items():
        out += [("prep", pcfg, prep), ("chunk_fwd", pcfg, fwd)]
    return out


def _dynamic_vars(prim_func) -> dict[str, tuple[int, int]]:
    """Shape variable name -> (parameter index, dimension) of its first occurrence."""
    import tvm

    tir = getattr(tvm, "tirx", None) or tvm.tir  # TileLang 0.1.15's TVM names it tirx
    found: dict[str, tuple[int, int]] = {}
    for i, param in enumerate(prim_func.params):
        buf = prim_func.buffer_map.get(param)
        if buf is None:
            continue
        for d, dim in enumerate(buf.shape):
            if isinstance(dim, tir.Var):
                found.setdefault(dim.name, (i, d))
    return found


def _object_command(command: list, src: str, obj: str) -> list:
    """TileLang's shared-library nvcc command turned into one that compiles ``src`` to ``obj``."""
    out, skip = [], False
    for c in command:
        if skip:
            skip = False
            continue
        if c == "-o":
            skip = True
            continue
        if c in ("--shared", "-lcuda") or c.startswith("-L") or c.endswith(".cu"):
            continue
        out.append(c)
    return [*out, "-c", src, "-o", obj]


def object_cache_dir() -> pathlib.Path | None:
    """Where compiled objects are kept between builds ($QLA_BUILD_CACHE, default the user's cache;
    ``off`` for none): a rebuild after an edit compiles only the kernels whose source changed."""
    from .kernels import library

    where = os.environ.get("QLA_BUILD_CACHE", "")
    if where == "off":
        return None
    return pathlib.Path(where) if where else library.USER_DIR.parent / "build-objects"  # beside the user's libraries


def _compile_object(command: list, src: str, obj: str, what: str) -> bool:
    """Run ``command`` (nvcc: ``src`` to ``obj``), or copy its object from the cache when the same
    source went through the same command and compiler before. Returns whether it was cached."""
    cache = object_cache_dir()
    path = None
    if cache is not None:
        h = hashlib.sha256(pathlib.Path(src).read_bytes())
        # the command with this build's directory taken out (the source's name stays: the object
        # names its kernels' cubins after it, and scripts/kernel_resources.py finds them by it),
        # and the compiler's own version
        for c in command:
            h.update(b"\0" + (os.path.basename(src).encode() if c == src else b"<obj>" if c == obj else str(c).encode()))
        h.update(_compiler_version(command[0]).encode())
        path = cache / f"{h.hexdigest()[:32]}.o"
        if path.is_file():
            shutil.copyfile(path, obj)
            return True
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"nvcc failed for {what}:\n{run.stdout}{run.stderr}")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(obj, tmp)
        os.replace(tmp, path)  # whole or absent: parallel builds share the cache
    return False


@functools.cache
def _compiler_version(compiler: str) -> str:
    run = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return run.stdout + run.stderr


def _localize(obj: str, symbol: str) -> None:
    """Rename the object's entry points to ``<symbol>_*`` and make its other strong globals local,
    so that many kernels link into one library."""
    listing = subprocess.run(["nm", "-g", "--defined-only", obj], check=True, capture_output=True, text=True).stdout
    args = []
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[1] not in "TDBR":
            continue  # weak (template, inline) definitions stay: the linker folds them
        name = parts[2]
        if name in ("call", "init", "get_last_error"):
            args.append(f"--redefine-sym={name}={symbol}_{name}")
        else:
            args.append(f"--localize-symbol={name}")
    subprocess.run(["objcopy", *args, obj], check=True)


def _build_config(cfg: WarmupConfig, work: str, index: int) -> list[dict]:
    """Build the objects of one configuration (in a worker process); returns their manifest rows."""
    import tilelang

    from .kernels import library

    os.environ["QLA_KERNEL_LIBRARY_OFF"] = "1"  # a library on the search path must not stand in
    tilelang.disable_cache()
    if not hasattr(_capture_compile, "real"):
        _capture_compile.real = tilelang.compile
        tilelang.compile = _capture_compile
    rows = []
    for j, (kind, key, prog) in enumerate(_programs(cfg)):
        symbol = f"qla_{index}_{j}_{kind}"
        src = os.path.join(work, f"{symbol}.cu")
        obj = os.path.join(work, f"{symbol}.o")
        pathlib.Path(src).write_text(prog.lib_code)
        _compile_object(_object_command(prog.command, src, obj), src, obj, f"{kind} {key}")
        _localize(obj, symbol)
        params = library.parse_signature(prog.lib_code)
        num_args = len(prog.prim_func.params)
        shape_vars = _dynamic_vars(prog.prim_func)
        dynamic = []
        for _, name in params[num_args:]:
            if name not in shape_vars:
                raise RuntimeError(f"{kind} {key}: host parameter {name} is neither an argument nor a shape variable")
            dynamic.append([name, *shape_vars[name]])
        rows.append(dict(key=library.kernel_key(kind, key), symbol=symbol, object=obj, num_args=num_args,
                         params=[list(p) for p in params], dynamic=dynamic))
    return rows


def _versions() -> dict:
    import tilelang
    import torch

    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    return {"tilelang": str(getattr(tilelang, "__version__", "?")), "nvcc": nvcc[-1] if nvcc else "?",
            "torch": torch.__version__, "python": sys.version.split()[0]}


def _min_driver(nvcc_line: str) -> int:
    """The driver's CUDA version the statically linked runtime of this nvcc needs (13.0 -> 13000)."""
    import re

    m = re.search(r"cuda_(\d+)\.(\d+)", nvcc_line) or re.search(r"release (\d+)\.(\d+)", nvcc_line)
    return int(m.group(1)) * 1000 + int(m.group(2)) * 10 if m else 0


def build_library(configs: list[WarmupConfig], out_dir: str | os.PathLike, *, jobs: int | None = None,
                  progress: bool = True) -> dict:
    """Build every kernel ``configs`` need into a library at ``out_dir`` (replaced if present).

    Args:
        configs: the static configurations (:func:`qla_serving.compile.plan_configs`).
        out_dir: the library directory (``manifest.json`` and the shared object go there).
        jobs: parallel build processes (default: CPU count).
        progress: show a progress bar.

    Returns:
        the manifest written.

    Raises:
        RuntimeError: TileLang is missing or not the version the kernels are written for, or a
            kernel failed to build (the library is then left as it was).
    """
    from . import backend
    from .kernels import library

    reason = backend.tilelang_unsupported_reason()
    if reason is not None:
        raise RuntimeError(f"building kernels needs TileLang {backend.TILELANG_VERSION}: {reason}")
    if shutil.which("nvcc") is None:
        raise RuntimeError("building kernels needs nvcc (CUDA 13) on PATH")
    out = pathlib.Path(out_dir)
    configs = list(dict.fromkeys(configs))
    jobs = max(1, jobs or os.cpu_count() or 1)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    with tempfile.TemporaryDirectory(prefix="qla-build-") as work:
        rows: list[dict] = []
        bar = tqdm(total=len(configs), desc="qla-serving: building kernels", unit="config") if (tqdm and progress) else None
        ctx = multiprocessing.get_context("spawn")  # no CUDA or TileLang state forked
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_build_config, cfg, work, i) for i, cfg in enumerate(configs)]
            for fut in concurrent.futures.as_completed(futures):
                rows += fut.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        kernels, objects = {}, []
        for row in sorted(rows, key=lambda r: r["symbol"]):
            if row["key"] in kernels:
                continue  # two configurations share a kernel (e.g. a verify length in both)
            objects.append(row.pop("object"))
            kernels[row.pop("key")] = row
        staged = pathlib.Path(work) / "library"
        staged.mkdir()
        link = subprocess.run(["nvcc", "--shared", "-Xcompiler", "-fPIC", "-o", str(staged / LIBRARY_NAME), *objects],
                              capture_output=True, text=True)
        if link.returncode:
            raise RuntimeError(f"linking {LIBRARY_NAME} failed:\n{link.stdout}{link.stderr}")
        subprocess.run(["strip", "--strip-unneeded", str(staged / LIBRARY_NAME)], check=True)
        manifest = {
            "format": library.FORMAT, "arch": "sm_90a", "library": LIBRARY_NAME,
            "source_digest": library.source_digest(),
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "built_with": (versions := _versions()),
            "min_driver": _min_driver(versions["nvcc"]),
            "configs": [_describe(c) for c in configs],
            "kernels": kernels,
        }
        (staged / library.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        out.mkdir(parents=True, exist_ok=True)
        for name in (LIBRARY_NAME, library.MANIFEST):
            shutil.copyfile(staged / name, out / (name + ".new"))
        for name in (LIBRARY_NAME, library.MANIFEST):  # the manifest last: a reader never sees it early
            os.replace(out / (name + ".new"), out / name)
    library.reset()
    return manifest


def _describe(cfg: WarmupConfig) -> dict:
    """``cfg`` as JSON: dtypes by name, phases sorted."""
    out = {}
    for k, v in dataclasses.asdict(cfg).items():
        if k == "phases":
            v = sorted(v)
        elif not isinstance(v, (int, bool, type(None))):
            v = str(v).removeprefix("torch.")
        out[k] = v
    return out


__all__ = ["LIBRARY_NAME", "build_library"]
