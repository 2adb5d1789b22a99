"""The one place that touches SGLang: a start-up check, the backend name, and three hooks.

SGLang's ``GDNKernelDispatcher`` builds a kernel object per phase but raises
``Unsupported GDN ... backend: CUSTOM`` for a name it does not know (0.5.17 to 0.5.23 all do),
so selecting an out-of-tree GDN kernel needs a patch. It is applied with SGLang's own plugin
``HookRegistry`` (the framework's sanctioned mechanism) on ``gdn_backend``:

1. ``GDNKernelDispatcher.__init__`` (AROUND): phases configured as ``flashqla`` are built as
   triton first (so SGLang's own wiring runs unchanged), then get our kernel object.
2. ``GDNAttnBackend.__init__`` (AFTER): binds our kernel to the model (head counts, dtypes,
   pool), decides whether the kernels can run there — if not, puts SGLang's triton kernel
   back with one warning (``QLA_STRICT=1``: raise) — and compiles them up front.
3. ``GDNAttnBackend.init_forward_metadata`` (AFTER): once per forward batch, builds the
   prefill plan from SGLang's CPU-side lengths, shared by every GDN layer.
4. ``arg_groups.overrides.supports_mamba_cache_extra_buffer`` (AROUND): SGLang allows the
   ``extra_buffer`` mamba radix-cache strategy (and with it the overlap scheduler) only when
   ``--linear-attn-backend`` is ``triton``; ``flashqla`` keeps the same state-tracking contract
   (in-place pool, chunk-boundary snapshots), so it gets triton's answer. Without this hook
   ``--linear-attn-backend flashqla`` would silently switch the server to ``no_buffer`` and
   turn overlap scheduling off.

:func:`check_sglang` runs first and refuses versions or layouts these hooks were not
written for, with an error that says what differs.
"""

from __future__ import annotations

import inspect
import logging
import os
import re

from ...constants import BACKEND_NAME

logger = logging.getLogger("qla_serving")

#: Oldest and newest SGLang whose seams were checked (docs/sglang.md).
MIN_VERSION = (0, 5, 17)
MAX_VERSION = (0, 5, 23)
#: Set to 1 to run on an SGLang outside [MIN_VERSION, MAX_VERSION] (the structural checks still run).
ALLOW_UNTESTED_ENV = "QLA_SGLANG_ALLOW_UNTESTED"

GDN_MODULE = "sglang.srt.layers.attention.linear.gdn_backend"
DISPATCHER_INIT = f"{GDN_MODULE}.GDNKernelDispatcher.__init__"
BACKEND_INIT = f"{GDN_MODULE}.GDNAttnBackend.__init__"
BACKEND_METADATA = f"{GDN_MODULE}.GDNAttnBackend.init_forward_metadata"
EXTRA_BUFFER_CHECK = "sglang.srt.arg_groups.overrides.supports_mamba_cache_extra_buffer"
DUMMY_LOAD = "sglang.srt.model_loader.loader.DummyModelLoader.load_model"
#: Set to 1 (the serving benchmark does) to re-draw the GDN gates of `--load-format dummy` models,
#: as vLLM's `--load-format qla_dummy` does: dummy gates forget within ~10 tokens, so a wrong state
#: would not change the outputs.
BENCH_GATES_ENV = "QLA_BENCH_GDN_GATES"

_installed = False


class IncompatibleSGLang(RuntimeError):
    """The installed SGLang lacks a seam the adapter relies on."""


def _parse_version(text: str) -> tuple[int, ...]:
    nums = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(n) for n in nums)


def sglang_version() -> str:
    import sglang

    return getattr(sglang, "__version__", "unknown")


def check_sglang() -> str:
    """Check that SGLang has every seam the hooks need; return its version.

    Raises:
        IncompatibleSGLang: naming the version range or the missing piece.
    """
    version = sglang_version()
    parsed = _parse_version(version)
    if not (MIN_VERSION <= parsed <= MAX_VERSION) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        lo, hi = (".".join(map(str, v)) for v in (MIN_VERSION, MAX_VERSION))
        raise IncompatibleSGLang(
            f"qla-serving's SGLang adapter supports sglang {lo} to {hi}, found {version}; "
            f"install a supported version or set {ALLOW_UNTESTED_ENV}=1 to try anyway"
        )
    try:
        from sglang.srt.layers.attention.linear import gdn_backend
        from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase
        from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401
        from sglang.srt.server_args import add_linear_attn_kernel_backend_choices  # noqa: F401
    except ImportError as e:
        raise IncompatibleSGLang(f"sglang {version}: a module the adapter needs does not import: {e}") from e
    if LinearAttnKernelBackend(BACKEND_NAME) is not getattr(LinearAttnKernelBackend, "CUSTOM", None):
        raise IncompatibleSGLang(f"sglang {version}: LinearAttnKernelBackend('{BACKEND_NAME}') is not CUSTOM")
    for method in ("decode", "extend", "target_verify"):
        if not callable(getattr(LinearAttnKernelBase, method, None)):
            raise IncompatibleSGLang(f"sglang {version}: LinearAttnKernelBase has no {method}()")
    params = list(inspect.signature(gdn_backend.GDNKernelDispatcher.__init__).parameters)
    if params[1:3] != ["decode_backend", "prefill_backend"]:
        raise IncompatibleSGLang(
            f"sglang {version}: GDNKernelDispatcher.__init__ takes {params[1:]}, "
            "expected (decode_backend, prefill_backend[, verify_backend])"
        )
    for name in ("__init__", "init_forward_metadata", "forward_extend", "forward_decode"):
        if not hasattr(gdn_backend.GDNAttnBackend, name):
            raise IncompatibleSGLang(f"sglang {version}: GDNAttnBackend has no {name}")
    return version


def configured_backend_names() -> dict[str, str | None] | None:
    """The raw ``--linear-attn-*-backend`` strings of this process, or None if not published.

    ``LinearAttnKernelBackend`` folds every unknown name into ``CUSTOM``, so the dispatcher
    cannot tell ``flashqla`` from another plugin's backend; the published config can.
    """
    try:
        from sglang.srt.runtime_context import get_exec

        mamba = get_exec().mamba
        return {
            "base": mamba.linear_attn_backend,
            "decode": mamba.linear_attn_decode_backend,
            "prefill": mamba.linear_attn_prefill_backend,
            "verify": mamba.linear_attn_verify_backend,
        }
    except Exception:  # not published (unit tests, tools): the caller decides from the enums alone
        return None


def phases_for_flashqla(decode_backend, prefill_backend) -> set[str]:
    """Which of ``{"decode", "prefill", "verify"}`` this runner should run on our kernel.

    A phase is ours when its enum is ``CUSTOM`` and its configured name is ``flashqla``.
    Verify follows decode when ``--linear-attn-verify-backend`` is unset (as SGLang's
    flashinfer does); SGLang's verify flag has a frozen choice list that never includes
    plugin names, and its resolver turns "unset" into triton, so the raw config decides.
    """
    names = configured_backend_names()
    phases = set()
    if names is None:
        if decode_backend.is_custom():
            phases |= {"decode", "verify"}
        if prefill_backend.is_custom():
            phases.add("prefill")
        return phases
    base = names["base"]
    if decode_backend.is_custom() and (names["decode"] or base) == BACKEND_NAME:
        phases.add("decode")
    if prefill_backend.is_custom() and (names["prefill"] or base) == BACKEND_NAME:
        phases.add("prefill")
    if names["verify"] == BACKEND_NAME or (names["verify"] is None and "decode" in phases):
        phases.add("verify")
    return phases


def _dispatcher_init_around(original, self, *args, **kwargs):
    """Build the dispatcher with triton in our phases, then hand those phases our kernel."""
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    bound = inspect.signature(original).bind(self, *args, **kwargs)
    decode_backend = bound.arguments["decode_backend"]
    prefill_backend = bound.arguments["prefill_backend"]
    phases = phases_for_flashqla(decode_backend, prefill_backend)
    if not phases:
        return original(*bound.args, **bound.kwargs)
    if "decode" in phases:
        bound.arguments["decode_backend"] = LinearAttnKernelBackend.TRITON
    if "prefill" in phases:
        bound.arguments["prefill_backend"] = LinearAttnKernelBackend.TRITON
    original(*bound.args, **bound.kwargs)

    from qla_serving import backend as qla_backend

    from .kernel import DETERMINISTIC_FLAG, FlashQLAGDNKernel

    kernel = FlashQLAGDNKernel(fallback=self.tree_verify_kernel, phases=phases)
    if "decode" in phases:
        self.decode_kernel = kernel
    if "prefill" in phases:
        self.extend_kernel = kernel
    if "verify" in phases:
        self.verify_kernel = kernel
        self.verify_kernel_is_flashinfer = False
    self.supports_packed_decode = getattr(self.decode_kernel, "supports_packed_decode", False)
    logger.info(
        "qla-serving: GDN kernel dispatcher uses FlashQLAGDNKernel for %s (decode=%s, extend=%s, verify=%s)%s",
        ", ".join(sorted(phases)),
        type(self.decode_kernel).__name__,
        type(self.extend_kernel).__name__,
        type(self.verify_kernel).__name__,
        qla_backend.batch_invariant_note(DETERMINISTIC_FLAG if kernel.cp_per_sequence else None),
    )


def our_kernel(dispatcher):
    """The :class:`FlashQLAGDNKernel` a dispatcher holds in some phase, or None."""
    from .kernel import FlashQLAGDNKernel

    for name in ("extend_kernel", "decode_kernel", "verify_kernel"):
        kernel = getattr(dispatcher, name, None)
        if isinstance(kernel, FlashQLAGDNKernel):
            return kernel
    return None


def _dummy_load_after(result, *args, **kwargs):
    """After SGLang's dummy loader: random weights (``QLA_BENCH_WEIGHTS=random``) and GDN gates
    that remember, when the benchmark asks for them."""
    from qla_serving.bench.weights import init_requested_weights

    if result is not None and (drawn := init_requested_weights(result)):
        logger.info("qla-serving: %s", drawn)
    if os.environ.get(BENCH_GATES_ENV) == "1" and result is not None:
        from qla_serving.bench.gates import init_gdn_gates

        logger.info("qla-serving: %s=1: re-drew the gates of %d GDN layers", BENCH_GATES_ENV, init_gdn_gates(result))
    return None


def _backend_init_after(result, self, model_runner, *args, **kwargs):
    """Bind our kernel to the model; fall back to triton (or raise) where it cannot run."""
    dispatcher = getattr(self, "kernel_dispatcher", None)
    kernel = our_kernel(dispatcher) if dispatcher is not None else None
    if kernel is None:
        return
    from qla_serving import backend as qla_backend

    from .kernel import bind_to_runner, restore_triton

    try:
        bind_to_runner(kernel, dispatcher, self, model_runner)
    except qla_backend.KernelUnavailable:
        raise
    except Exception as e:  # an adapter/SGLang mismatch must not take the server down unless strict
        if qla_backend.strict_mode():
            raise
        logger.warning(
            "qla-serving: could not bind FlashQLAGDNKernel to this SGLang model runner "
            "(%s: %s); SGLang's triton GDN kernels run instead",
            type(e).__name__,
            e,
        )
        restore_triton(dispatcher, str(e))
    return


def _metadata_after(result, self, forward_batch, *args, **kwargs):
    """Once per forward batch: let our kernel build the plan every GDN layer will share."""
    dispatcher = getattr(self, "kernel_dispatcher", None)
    kernel = dispatcher is not None and getattr(dispatcher, "extend_kernel", None)
    from .kernel import FlashQLAGDNKernel

    if isinstance(kernel, FlashQLAGDNKernel):
        kernel.begin_batch(self, forward_batch)


class _ViewAsTriton:
    """A read-only view of SGLang's resolved args that reports ``linear_attn_backend='triton'``."""

    def __init__(self, view):
        object.__setattr__(self, "_view", view)

    def __getattr__(self, name):
        if name == "linear_attn_backend":
            return "triton"
        return getattr(object.__getattribute__(self, "_view"), name)


def _extra_buffer_around(original, view, *args, **kwargs):
    """``flashqla`` supports SGLang's extra_buffer mamba cache exactly where triton does."""
    result = original(view, *args, **kwargs)
    if result or getattr(view, "linear_attn_backend", None) != BACKEND_NAME:
        return result
    return original(_ViewAsTriton(view), *args, **kwargs)


def install() -> None:
    """Check SGLang, add ``flashqla`` to the backend choices and register the hooks (once)."""
    global _installed
    if _installed:
        return
    version = check_sglang()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_linear_attn_kernel_backend_choices

    try:
        from sglang.srt.arg_groups.choices import LINEAR_ATTN_KERNEL_BACKEND_CHOICES as choices
    except ImportError:  # before 0.5.20 the list lived in server_args
        from sglang.srt.server_args import LINEAR_ATTN_KERNEL_BACKEND_CHOICES as choices
    if BACKEND_NAME not in choices:
        add_linear_attn_kernel_backend_choices([BACKEND_NAME])
    HookRegistry.register(DISPATCHER_INIT, _dispatcher_init_around, HookType.AROUND)
    HookRegistry.register(BACKEND_INIT, _backend_init_after, HookType.AFTER)
    HookRegistry.register(BACKEND_METADATA, _metadata_after, HookType.AFTER)
    HookRegistry.register(DUMMY_LOAD, _dummy_load_after, HookType.AFTER)
    try:
        from sglang.srt.arg_groups import overrides

        has_extra_buffer_check = callable(getattr(overrides, "supports_mamba_cache_extra_buffer", None))
    except ImportError:
        has_extra_buffer_check = False
    if has_extra_buffer_check:
        HookRegistry.register(EXTRA_BUFFER_CHECK, _extra_buffer_around, HookType.AROUND)
    else:
        logger.info(
            "qla-serving: sglang %s has no %s; the mamba cache strategy is SGLang's default",
            version,
            EXTRA_BUFFER_CHECK,
        )
    _installed = True
    logger.info("qla-serving: registered GDN backend '%s' with sglang %s", BACKEND_NAME, version)
