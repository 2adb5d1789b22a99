"""Precompiled kernel libraries: the kernels launched without TileLang.

A library is a directory with ``manifest.json`` and one shared object built by
:mod:`qla_serving.library_build` (TileLang and nvcc at build time only). The shared object holds
every kernel of its manifest compiled for sm_90a, each with the host code TileLang generates for
it (TMA descriptors, launch configuration) behind three C functions ``<symbol>_init``,
``<symbol>_call`` and ``<symbol>_get_last_error``; it links the CUDA runtime statically and
needs nothing at run time but the NVIDIA driver (``libcuda``, CUDA 13 or newer).

Libraries are searched in order: the directories in ``QLA_KERNEL_LIBRARY`` (``:``-separated),
the user's (``~/.cache/qla-serving/kernels``, where ``qla-serving compile`` writes), and the one
shipped inside the package (``qla_serving/kernels/shipped``). A library built from other kernel
sources than the installed ones (its ``source_digest``) is skipped with one warning: its kernels
would not be the ones this code describes.

The manifest's key of a kernel is :func:`kernel_key` of its kind (``decode``, ``prep``,
``chunk_fwd``) and the static configuration the kernel module keys its cache on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import pathlib
import threading
import tokenize

import torch

logger = logging.getLogger("qla_serving")

MANIFEST = "manifest.json"
FORMAT = 1
SHIPPED_DIR = pathlib.Path(__file__).with_name("shipped")
USER_DIR = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "qla-serving" / "kernels"
# The files whose code decides what the kernels compile to (the builders and the constants they
# read); with PREFILL_CONFIGS, the one tuning table not in a kernel's key. Any edit to their code
# makes a library stale (rebuild it with the edit); comments and blank lines are not digested.
SOURCE_FILES = ("chunk_prefill_program.py", "decode_program.py", "decode_tiles.py")  # beside this file, and constants.py

# C types of a ``call`` parameter as TileLang's host code declares them -> ctypes.
_SCALAR_CTYPES = {"int": ctypes.c_int32, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
                  "float": ctypes.c_float, "double": ctypes.c_double, "bool": ctypes.c_bool,
                  "uint8_t": ctypes.c_uint8, "int8_t": ctypes.c_int8}


def kernel_key(kind: str, config) -> str:
    """The manifest key of kernel ``kind`` for a static configuration (a NamedTuple or a frozen
    dataclass of ints, strings, bools and nested tuples)."""
    fields = dataclasses.astuple(config) if dataclasses.is_dataclass(config) else tuple(config)
    return json.dumps([kind, fields], separators=(",", ":"))


def source_digest(files: list[pathlib.Path] | None = None) -> str:
    """SHA-256 (16 hex digits) of the kernel sources a library is built from."""
    from .. import constants
    from .configs import PREFILL_CONFIGS

    if files is None:
        here = pathlib.Path(__file__).parent
        files = [here / name for name in SOURCE_FILES] + [pathlib.Path(constants.__file__)]
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + _code_text(path.read_text()).encode() + b"\0")
    h.update(repr(sorted(PREFILL_CONFIGS.items())).encode())
    return h.hexdigest()[:16]


def _code_text(source: str) -> str:
    """``source`` without its comments, trailing blanks and empty lines: what a digest of the
    code reads (the same on every Python version; tokenize's comment positions are stable)."""
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def parse_signature(lib_code: str, entry: str = "call") -> list[tuple[str, str]]:
    """``(C type, name)`` of each parameter of TileLang's host entry ``entry`` in ``lib_code``,
    the trailing stream excluded. Pointers have type ``ptr``."""
    head = f'extern "C" TL_EXPORT int {entry}('
    start = lib_code.find(head)
    if start < 0:
        raise ValueError(f"no `{head}...)` in the generated host code")
    start += len(head)
    end = lib_code.find(")", start)
    params = []
    for raw in lib_code[start:end].split(","):
        decl = raw.split("=")[0].strip()
        if not decl:
            continue
        *type_words, name = decl.replace("*", " * ").split()
        if name == "stream" and "cudaStream_t" in type_words:
            continue
        if "*" in type_words:
            params.append(("ptr", name))
        else:
            ctype = " ".join(w for w in type_words if w not in ("const", "__restrict__"))
            if ctype not in _SCALAR_CTYPES:
                raise ValueError(f"parameter {name}: C type {ctype!r} has no ctypes equivalent here")
            params.append((ctype, name))
    return params


class Span:
    """What a library kernel's launcher reads of a tensor argument: its data pointer, the shape
    TileLang's host code takes its shape variables from, and its device. The kernel entries hand
    one to a :class:`LibraryKernel` where a TileLang-compiled kernel needs a strided view of an
    engine buffer: the same launch arguments without building the view (a torch op of a
    microsecond or two of host time each, several per layer call)."""

    __slots__ = ("_ptr", "shape", "device")

    def __init__(self, ptr: int, shape: tuple[int, ...], device: torch.device):
        self._ptr, self.shape, self.device = ptr, shape, device

    def data_ptr(self) -> int:
        return self._ptr


def launch_arg(x: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...],
               span_device: torch.device | None) -> "Span | torch.Tensor":
    """``x`` read as ``shape``/``strides`` from its first element: a :class:`Span` on
    ``span_device`` for a library kernel, the strided view for a TileLang-compiled one (None)."""
    if span_device is not None:
        return Span(x.data_ptr(), shape, span_device)
    return torch.as_strided(x, shape, strides)


def pool_arg(state_pool: torch.Tensor, span_device: torch.device | None) -> "Span | torch.Tensor":
    """The engine's ``[num_slots, HV, V, K]`` pool read as one flat buffer from slot 0 to the end of
    the last slot, its slot stride kept as it is (the kernels index slots by that stride)."""
    n, hv, vd, kd = state_pool.shape
    if state_pool.stride()[1:] != (vd * kd, kd, 1):
        raise ValueError("state_pool's inner three dims [HV, V, K] must be contiguous")
    return launch_arg(state_pool, ((n - 1) * state_pool.stride(0) + hv * vd * kd,), (1,), span_device)


class LibraryKernel:
    """One precompiled kernel, called like the TileLang kernel it was built from: the prim
    function's parameters in order (tensors, then Python scalars), on the current stream.

    The manifest entry gives the C parameters of ``<symbol>_call``: first the prim function's
    parameters, then the shape variables TileLang reads from them (``dynamic``: name,
    parameter index, dimension).
    """

    def __init__(self, lib: ctypes.CDLL, entry: dict, source: str):
        self.symbol = entry["symbol"]
        self.source = source
        params = entry["params"]
        self._num_args = entry["num_args"]
        self._dynamic = [(int(i), int(d)) for _, i, d in entry["dynamic"]]
        if len(params) != self._num_args + len(self._dynamic):
            raise ValueError(f"{source}: {self.symbol}: {len(params)} C parameters for {self._num_args} "
                             f"arguments and {len(self._dynamic)} shape variables")
        self._ptr = tuple(t == "ptr" for t, _ in params[: self._num_args])
        if True not in self._ptr:
            raise ValueError(f"{source}: {self.symbol}: no tensor parameter to take the device from")
        self._first_ptr = self._ptr.index(True)
        self._call = getattr(lib, f"{self.symbol}_call")
        self._call.restype = ctypes.c_int
        self._call.argtypes = [ctypes.c_void_p if t == "ptr" else _SCALAR_CTYPES[t] for t, _ in params] + [
            ctypes.c_void_p]
        self._init = getattr(lib, f"{self.symbol}_init")
        self._init.restype = ctypes.c_int
        self._error = getattr(lib, f"{self.symbol}_get_last_error")
        self._error.restype = ctypes.c_char_p
        self._ready: set[int] = set()
        self._lock = threading.Lock()

    def _ensure_init(self, device: int) -> None:
        # init sets the kernels' dynamic shared-memory limits, per device
        with self._lock:
            if device in self._ready:
                return
            with _on_device(device):
                if self._init() != 0:
                    raise RuntimeError(f"{self.source}: {self.symbol} init failed: "
                                       f"{self._error().decode(errors='replace')}")
            self._ready.add(device)

    def _marshal(self, args) -> tuple[int, list]:
        """``args`` as the C launcher takes them (the stream last, left 0) and their device."""
        if len(args) != self._num_args:
            raise TypeError(f"{self.symbol}: {len(args)} arguments, the kernel takes {self._num_args}")
        device = args[self._first_ptr].device.index
        c_args = [a.data_ptr() if is_ptr else a for is_ptr, a in zip(self._ptr, args)]
        c_args += [args[i].shape[d] for i, d in self._dynamic]
        if device not in self._ready:
            self._ensure_init(device)
        c_args.append(0)
        return device, c_args

    def _launch(self, device: int, c_args: list) -> None:
        """Call the C launcher with ``c_args`` (as :meth:`_marshal` gives them) on the current stream."""
        c_args[-1] = _current_stream(device)
        if self._call(*c_args) != 0:
            raise RuntimeError(f"{self.symbol}: launch failed: {self._error().decode(errors='replace')}")

    def __call__(self, *args) -> None:
        self._launch(*self._marshal(args))

    def bind(self, args, slots: dict[int, int]) -> "BoundKernel":
        """This launch with every argument fixed but the pointer arguments at ``slots``'
        positions: ``{argument position: index into the pointer list given at launch}``."""
        for pos in slots:
            if not self._ptr[pos]:
                raise ValueError(f"{self.symbol}: argument {pos} is not a pointer")
        device, c_args = self._marshal(args)
        return BoundKernel(self, device, c_args, tuple(slots.items()))


class BoundKernel:
    """A library kernel's launch with everything fixed but some pointers (:meth:`LibraryKernel.bind`):
    what a step's later GDN layers rerun with their own tensors' addresses, where the rest of
    the arguments (the step's plan, slots, workspaces, sizes) are the same for every layer."""

    __slots__ = ("kernel", "device", "_c_args", "_slots")

    def __init__(self, kernel: LibraryKernel, device: int, c_args: list, slots: tuple):
        self.kernel, self.device, self._c_args, self._slots = kernel, device, c_args, slots

    def __call__(self, ptrs) -> None:
        """Launch with ``ptrs[i]`` (device addresses) at the positions bound to ``i``, on the
        current stream."""
        c_args = self._c_args.copy()
        for pos, i in self._slots:
            c_args[pos] = ptrs[i]
        self.kernel._launch(self.device, c_args)


def _on_device(device: int):
    return torch.cuda.device(device)


# The current stream's handle as an int, as torch's Inductor-generated code reads it
# (get_raw_stream): no Stream object built per launch. CUDA builds of torch have it.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


@dataclasses.dataclass
class Library:
    path: pathlib.Path
    manifest: dict
    lib: ctypes.CDLL | None = None

    def kernel(self, key: str) -> LibraryKernel:
        """The kernel under ``key`` of this library's manifest (the shared object loads on first use)."""
        if self.lib is None:
            self.lib = ctypes.CDLL(str(self.path / self.manifest["library"]))
        return LibraryKernel(self.lib, self.manifest["kernels"][key], str(self.path))


class KernelUnavailable(RuntimeError):
    """The kernels cannot run this configuration (no library holds it and TileLang cannot compile
    it, or strict mode forbids a fallback)."""


# The TileLang the kernels are written and tested for; pyproject's `compile` extra pins the same
# (tests/test_packaging.py checks). The engines pin older ones (vLLM 0.26: 0.1.9; vLLM
# 0.27-0.32 and SGLang 0.5.20-0.5.23: 0.1.12), so a mismatch is a likely configuration.
TILELANG_VERSION = "0.1.15"


def _installed_tilelang() -> str | None:
    """The version of the TileLang that imports (a copy on PYTHONPATH can differ from the one
    pip installed, so ask the module first, then the metadata)."""
    try:
        import tilelang

        version = getattr(tilelang, "__version__", None)
        if version:
            return str(version)
    except Exception:  # a TileLang that does not even import: let the kernels report it
        return None
    try:
        return importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        return None


def tilelang_unsupported_reason() -> str | None:
    """Why the installed TileLang cannot build the kernels, or None.

    ``QLA_ALLOW_TILELANG=1`` skips the version comparison (to try another TileLang on purpose).
    """
    if importlib.util.find_spec("tilelang") is None:
        return "TileLang is not installed"
    if os.environ.get("QLA_ALLOW_TILELANG") == "1":
        return None
    have = _installed_tilelang()
    if have is not None and have.split("+")[0] != TILELANG_VERSION:
        return (f"TileLang {have} is installed but the kernels are built for TileLang {TILELANG_VERSION} "
                "(QLA_ALLOW_TILELANG=1 to try it anyway)")
    return None


_libraries: list[Library] | None = None
_lock = threading.Lock()
loaded = 0  # kernels this process took from a library


def search_path() -> list[pathlib.Path]:
    """The directories searched for libraries, in order."""
    extra = [pathlib.Path(p) for p in os.environ.get("QLA_KERNEL_LIBRARY", "").split(os.pathsep) if p]
    return [*extra, USER_DIR, SHIPPED_DIR]


def _read(path: pathlib.Path, digest: str) -> Library | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("qla-serving: kernel library %s unreadable (%s); skipped", path, e)
        return None
    if manifest.get("format") != FORMAT:
        logger.warning("qla-serving: kernel library %s has format %s, this version reads %s; skipped",
                       path, manifest.get("format"), FORMAT)
        return None
    if manifest.get("source_digest") != digest:
        logger.warning("qla-serving: kernel library %s was built from other kernel sources (digest %s, "
                       "installed %s); skipped. Rebuild it with `qla-serving compile`",
                       path, manifest.get("source_digest"), digest)
        return None
    need, have = manifest.get("min_driver"), _driver_version()
    if need and have is not None and have < need:
        logger.warning("qla-serving: kernel library %s needs a driver for CUDA %d.%d, this one supports %d.%d; skipped",
                       path, need // 1000, need % 1000 // 10, have // 1000, have % 1000 // 10)
        return None
    if not (path / manifest.get("library", "")).is_file():
        logger.warning("qla-serving: kernel library %s: %s is missing; skipped", path, manifest.get("library"))
        return None
    return Library(path, manifest)


def _driver_version() -> int | None:
    """The CUDA version the driver supports (e.g. 13000), or None without a driver."""
    try:
        return int(torch._C._cuda_getDriverVersion()) if torch.cuda.is_available() else None
    except (AttributeError, RuntimeError):
        return None


def libraries() -> list[Library]:
    """The usable libraries on :func:`search_path` (read once per process)."""
    global _libraries
    if _libraries is None:
        with _lock:
            if _libraries is None:
                digest = source_digest()
                found = [lib for p in dict.fromkeys(search_path()) if (lib := _read(p, digest)) is not None]
                _libraries = found
    return _libraries


def reset() -> None:
    """Forget the libraries read so far (tests, or after ``qla-serving compile`` in-process)."""
    global _libraries
    with _lock:
        _libraries = None


def _holder(kind: str, config) -> tuple[Library | None, str]:
    """The first library whose manifest holds kernel ``kind`` of ``config`` (None when none does or
    ``QLA_KERNEL_LIBRARY_OFF=1``), and the kernel's key."""
    key = kernel_key(kind, config)
    if os.environ.get("QLA_KERNEL_LIBRARY_OFF") == "1":
        return None, key
    return next((lib for lib in libraries() if key in lib.manifest["kernels"]), None), key


def lookup(kind: str, config) -> LibraryKernel | None:
    """The precompiled kernel ``kind`` of ``config`` from the first library holding it, or None."""
    global loaded
    lib, key = _holder(kind, config)
    if lib is None:
        return None
    loaded += 1
    return lib.kernel(key)


def tilelang_for(what: str):
    """TileLang, to compile ``what`` (a kernel no library holds); raises
    :class:`~qla_serving.backend.KernelUnavailable` naming why when it cannot."""
    reason = tilelang_unsupported_reason()
    if reason is not None:
        raise KernelUnavailable(f"qla-serving: the {what} is in no precompiled kernel library "
                                f"({describe_search_path()}) and cannot be compiled: {reason}")
    import tilelang

    return tilelang


def describe_search_path() -> str:
    """The library search path for messages: each directory, and whether a usable library is there."""
    usable = {lib.path for lib in libraries()}
    return ", ".join(f"{p}{'' if p in usable else ' (none)'}" for p in dict.fromkeys(search_path()))


def has(kind: str, config) -> bool:
    """Whether a library holds kernel ``kind`` of ``config`` (loads nothing)."""
    return _holder(kind, config)[0] is not None


__all__ = ["FORMAT", "TILELANG_VERSION", "BoundKernel", "KernelUnavailable", "LibraryKernel", "describe_search_path", "has",
           "kernel_key", "libraries", "lookup", "parse_signature", "reset", "search_path", "source_digest",
           "tilelang_for", "tilelang_unsupported_reason"]
