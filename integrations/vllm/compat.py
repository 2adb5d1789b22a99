"""Which vLLM versions the plugin supports, a start-up check of the seams it uses, and the
hook that runs the plugin's registrations where vLLM imports the modules they replace.

The plugin hooks vLLM through registration seams (``PluggableLayer.register_oot``,
``CustomOp.register_oot``, a layer's ``get_attn_backend``) and one unavoidable patch (the CLI
parser, see :mod:`.args`). Every name it touches is checked once per process, where its module
is imported, so an incompatible vLLM fails with one clear message instead of an AttributeError
mid-serving.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import sys
import threading
from collections.abc import Callable

# Read against the source of every release in this range (docs/vllm.md lists the differences).
MIN_VLLM = (0, 26)
MAX_VLLM_EXCLUSIVE = (0, 33)
TESTED_VLLM = "0.26.0"

# vLLM's GDN layer module and its model-loader registry: imported by the processes that build
# the model, not by the API server, so the plugin registers its classes when they are imported.
GDN_LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
GDN_BACKEND_MODULE = "vllm.v1.attention.backends.gdn_attn"
MODEL_LOADER_MODULE = "vllm.model_executor.model_loader"
ARG_MODULE = "vllm.engine.arg_utils"

# (module, attribute path) pairs the plugin relies on; all exist from 0.26.0 to 0.32.0.
REQUIRED_SEAMS: tuple[tuple[str, str], ...] = (
    ("vllm.engine.arg_utils", "EngineArgs.add_cli_args"),
    ("vllm.engine.arg_utils", "EngineArgs.gdn_prefill_backend"),
    ("vllm.model_executor.custom_op", "PluggableLayer.register_oot"),
    ("vllm.model_executor.custom_op", "CustomOp.register_oot"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention._forward_core"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention.get_attn_backend"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "ChunkGatedDeltaRule"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "_resolve_gdn_prefill_backend"),
    ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionBackend.get_builder_cls"),
    ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder.build"),
    ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadata"),
)


class VllmIncompatible(RuntimeError):
    """The installed vLLM lacks a seam the plugin needs, or is outside the supported range."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.26.0"`` / ``"0.27.1rc1.dev3+g…"`` -> ``(0, 26, 0)`` / ``(0, 27, 1)``."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def installed_vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        import vllm  # an in-tree checkout without metadata

        return getattr(vllm, "__version__", "0.0.0")


def supported_range_text() -> str:
    lo = ".".join(map(str, MIN_VLLM))
    hi = ".".join(map(str, MAX_VLLM_EXCLUSIVE))
    return f">={lo}, <{hi}"


def version_in_range(version: str) -> bool:
    return MIN_VLLM <= parse_version(version)[:2] < MAX_VLLM_EXCLUSIVE


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def missing_seams(modules: tuple[str, ...] | None = None) -> list[str]:
    """The ``module:attribute`` names of :data:`REQUIRED_SEAMS` (those in ``modules``, default
    all) the installed vLLM lacks."""
    missing = []
    for module, path in REQUIRED_SEAMS:
        if modules is not None and module not in modules:
            continue
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}:{path}")
    return missing


def check_vllm(modules: tuple[str, ...] | None = None) -> str:
    """Check the installed vLLM's seams in ``modules`` (default: all of them, importing each);
    returns its version.

    Raises:
        VllmIncompatible: a seam is missing. A version outside the tested range whose seams
            all exist only logs a warning (the caller's job): the seams are what matter.
    """
    version = installed_vllm_version()
    missing = missing_seams(modules)
    if missing:
        raise VllmIncompatible(
            f"qla-serving's vLLM plugin supports vLLM {supported_range_text()}; the installed vLLM "
            f"{version} lacks {', '.join(missing)}. Install a supported vLLM "
            f"(pip install 'qla-serving[vllm]') or uninstall qla-serving to run vLLM without it."
        )
    return version


class _AfterImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that runs callbacks right after named modules are executed.

    It finds nothing itself: for a watched name it asks the other finders for the spec and wraps
    that spec's loader's ``exec_module`` (the loader instance is the module's own; its type and
    its other methods, ``get_source`` included, stay as they are)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable]] = {}

    def find_spec(self, name, path, target=None):
        callbacks = self.callbacks.pop(name, None)
        if callbacks is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            self.callbacks[name] = callbacks  # not found (the import fails): a later import still runs them
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            self.callbacks[name] = callbacks  # a namespace package: nothing to run after
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module
        return spec


_after_import = _AfterImport()
_after_import_lock = threading.Lock()


def after_import(module: str, callback: Callable) -> None:
    """Run ``callback(module object)`` once ``module`` is imported in this process: now if it is
    already, else right after vLLM (or anyone) imports it. An exception from the callback is the
    import's exception."""
    with _after_import_lock:
        loaded = sys.modules.get(module)
        if loaded is None:
            _after_import.callbacks.setdefault(module, []).append(callback)
            if _after_import not in sys.meta_path:
                sys.meta_path.insert(0, _after_import)
            return
    callback(loaded)
