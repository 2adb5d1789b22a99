"""Host (CPU) work that is qla-serving's own, per GDN layer call, on the real adapter code path.

An investigation tool (issue #24; not run by CI): it drives one engine step the way the engine
does, with CPU tensors and every kernel launch replaced by a no-op at the narrowest point, and
reports microseconds of host time per GDN layer call (median over many repetitions, after
warm-up; the repetitions run in 5 blocks and the lowest block median is reported, so a block that
shared the CPU with another process does not count), split into the per-step planning (once per
step, shared by every GDN layer) and the per-layer work. The layer call is recorded once (the
second layer of the step) level by level: adapter (vLLM's layer / SGLang's kernel object) -> op ->
kernel module entry -> launcher. The total is the real call; each level's own time is its recorded
calls replayed with the levels below stubbed (returning what they returned).

    # vLLM 0.26 (its own venv: the CPU machine's vLLM build), both batches:
    ~/.cache/qla-serving/venv-vllm-0.26.0/bin/python scripts/host_overhead.py vllm
    # SGLang (its own venv):
    ~/.cache/qla-serving/sglang-0.5.23-venv/bin/python scripts/host_overhead.py sglang
    # --profile: cProfile of the per-layer call; --json FILE: the numbers; --tree DIR: measure
    # the qla-serving of another checkout (a worktree of the commit before a change)

What runs for real: the engine's metadata objects (vLLM's ``CommonAttentionMetadata`` and GDN
metadata builder, our builder subclass and plan; SGLang's ``ForwardBatch``/``ForwardMetadata``/
``GDNAttnBackend`` and our ``begin_batch``), our layer's ``_forward_core`` (vLLM) or kernel object's
``extend`` (SGLang), the ops with all their checks, the kernel modules' entry points (kernel
lookup, decode tile choice, workspaces, pool views) and the precompiled-library launcher
(``LibraryKernel.__call__``: argument marshalling through ctypes) into a C function that returns 0.
The kernel signatures come from the shipped library's manifest (``kernels/shipped``, present
after ``qla-serving compile --shipped``); without it the kernels are Python no-ops and it says so.

What the GPU path does that a CPU run cannot show, emulated: the device decision says SM90
(``backend.device_unsupported_reason`` -> None), index checks run as on CUDA (skipped unless
``QLA_CHECK_INDICES=1``), the planner sees 132 SMs (H100 SXM: AutoCP decides as there), and the
engine's own preparation (vLLM's causal conv and ``fused_post_conv_prep``) returns ready tensors of
the shapes and dtypes it returns on the GPU. glibc keeps freed large blocks (the process re-executes
itself with ``MALLOC_*`` settings), as the CUDA caching allocator keeps its blocks.

Torch ops on the device path (every op on a tensor that is on the GPU in serving) are logged in a
first pass with the level they run in and counted: on a GPU each is a kernel launch. While timing,
those that move data (slower than 5 us on this CPU: the state snapshot, q/k/v copies) run as
allocate-only shims registered for the CPU (``torch.library``): their dispatch stays in the numbers,
their data movement (GPU work in serving) does not; the light ones run as they are. Either way a
device op costs here its CPU dispatch (1-3 us), less than a CUDA launch costs the host (3-6 us).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import gc
import io
import itertools
import json
import os
import pathlib
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

# Qwen3-Next-80B-A3B's GDN layers at TP 1 (the serving benchmark of record's shapes).
QK_HEADS, V_HEADS, HEAD_DIM = 16, 32, 128
NUM_SLOTS = 160
H100_SMS = 132
DECODES = 63

NOT_MEASURED = (
    "Not measured: the CUDA launch latency of the real kernels (driver calls, TMA descriptor encoding "
    "in the library's host code) and the launch cost of every device op counted above beyond its CPU "
    "dispatch (3-6 us each on a GPU against 1-3 us here); the engine's own causal conv1d, gating and "
    "q/k/v split kernels (stubbed: they return ready tensors); the CUDA caching allocator (glibc's heap "
    "stands in); the pinned host->device copy of the plan's tables (once per step)."
)


# ----------------------------------------------------------------------------- the no-op launcher


def _noop_library() -> ctypes.CDLL | None:
    """A shared object with ``int qla_noop(void)`` returning 0 (built once with the C compiler)."""
    cache = pathlib.Path(tempfile.gettempdir()) / "qla_host_overhead"
    so = cache / "libqla_noop.so"
    if not so.is_file():
        cache.mkdir(exist_ok=True)
        src = cache / "noop.c"
        src.write_text('int qla_noop(void) { return 0; }\nconst char *qla_noop_error(void) { return ""; }\n')
        try:
            subprocess.run(
                ["cc", "-O2", "-shared", "-fPIC", "-o", str(so), str(src)], check=True, capture_output=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
    return ctypes.CDLL(str(so))


class _NoopLib:
    """Stands in for a kernel library's CDLL: every ``<symbol>_call``/``_init`` is the no-op C
    function (a separate function pointer per symbol, so each keeps its own argtypes)."""

    def __init__(self, noop: ctypes.CDLL):
        self._ok = ctypes.cast(noop.qla_noop, ctypes.c_void_p).value
        self._err = ctypes.cast(noop.qla_noop_error, ctypes.c_void_p).value
        self._funcs: dict[str, object] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        fn = self._funcs.get(name)
        if fn is None:
            addr = self._err if name.endswith("_get_last_error") else self._ok
            fn = ctypes.CFUNCTYPE(ctypes.c_int)(addr)
            self._funcs[name] = fn
        return fn


class _Templates(dict):
    """A manifest's kernel table that also answers keys it lacks with the signature of the kernel
    of the same kind whose static configuration shares the most fields with the one asked for
    (the launch path is the same for every configuration of a signature; a variant with other
    inputs, such as the packed-inputs prefill, has a signature of its own)."""

    def __init__(self, kernels: dict):
        super().__init__(kernels)
        self._by_kind: dict[str, list[tuple[list, dict]]] = {}
        for key, entry in kernels.items():
            kind, fields = json.loads(key)
            self._by_kind.setdefault(kind, []).append((fields, entry))
        self._chosen: dict[str, dict] = {}

    def __contains__(self, key) -> bool:
        return super().__contains__(key) or json.loads(key)[0] in self._by_kind

    def __getitem__(self, key):
        if super().__contains__(key):
            return super().__getitem__(key)
        if key not in self._chosen:
            kind, fields = json.loads(key)
            shared = lambda other: sum(a == b for a, b in zip(fields, other))  # noqa: E731
            self._chosen[key] = max(self._by_kind[kind], key=lambda fe: shared(fe[0]))[1]
        return self._chosen[key]


class _PyNoop:
    def __call__(self, *args) -> None:
        return None


def install_noop_kernels() -> str:
    """Kernel launches become no-ops at the launcher; returns a description of what stands in."""
    from qla_serving.kernels import library

    library._current_stream = lambda device: 0  # torch.cuda.current_stream needs a GPU
    library._on_device = lambda device: contextlib.nullcontext()  # (the per-device init, once)
    manifest_path = library.SHIPPED_DIR / library.MANIFEST
    noop = _noop_library()
    if manifest_path.is_file() and noop is not None:
        manifest = json.loads(manifest_path.read_text())
        manifest["kernels"] = _Templates(manifest["kernels"])
        library._libraries = [library.Library(library.SHIPPED_DIR, manifest, _NoopLib(noop))]
        return (
            "precompiled-library launcher (LibraryKernel.__call__: ctypes marshalling of the shipped "
            "manifest's signatures) into a C function returning 0"
        )
    library.lookup = lambda kind, config: _PyNoop()
    why = "no shipped manifest" if not manifest_path.is_file() else "no C compiler for the no-op"
    return f"Python no-op kernels ({why}): the launcher's ctypes marshalling is NOT measured"


def emulate_sm90() -> None:
    """The decisions the GPU path takes, on CPU tensors (see the module docstring)."""
    from qla_serving import backend, plan
    from qla_serving.ops.gated_delta_rule import checks

    backend.device_unsupported_reason = lambda device: None
    checks.indices_checked = lambda x: os.environ.get("QLA_CHECK_INDICES") == "1"
    plan._sm_count = lambda device: H100_SMS


# ----------------------------------------------------------------------------- timing


BLOCKS = 5  # a measurement's repetitions run in blocks; the lowest block median is reported


def median_us(fn, reps: int, warmup: int) -> float:
    """Microseconds per call of ``fn``: the median of each of ``BLOCKS`` blocks of ``reps / BLOCKS``
    timed calls (after ``warmup`` untimed ones), the lowest of those medians (a block that shared
    the CPU with another process reads high; the lowest is the uncontended cost)."""
    for _ in range(warmup):
        fn()
    gc.collect()
    gc.disable()
    try:
        clock = time.perf_counter_ns
        medians = []
        for _ in range(BLOCKS):
            samples = []
            for _ in range(max(1, reps // BLOCKS)):
                t0 = clock()
                fn()
                samples.append(clock() - t0)
            medians.append(statistics.median(samples))
    finally:
        gc.enable()
    return min(medians) / 1000.0


# The levels of one GDN layer call, outermost first: the adapter (vLLM's layer, SGLang's kernel
# object) calls the ops, an op calls its kernel module's entry point, which calls the launcher.
ADAPTER = "adapter"


class Recorder:
    """One pass through the layer call with every level's calls recorded (function and arguments,
    so each level can be timed alone with exactly the arguments the level above gave it) and every
    torch op on the device path logged with the level it ran in.

    ``host_tensors``: tensors that live on the host in serving too (the plan's and the engine's CPU
    tables); an op whose tensor arguments are all host tensors (or results of such ops) is host
    work, every other op would run on the GPU in serving.
    """

    VIEWS = {
        "scalar_tensor",
        "view",
        "_unsafe_view",
        "slice",
        "select",
        "as_strided",
        "unsqueeze",
        "squeeze",
        "transpose",
        "t",
        "alias",
        "_reshape_alias",
        "expand",
        "detach",
        "permute",
        "split",
        "split_with_sizes",
        "unbind",
        "narrow",
        "diagonal",
        "lift_fresh",
        "chunk",
    }
    ALLOCS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}

    def __init__(self, host_tensors):
        self.calls: dict[str, list] = {}  # level -> [(function, args, kwargs)]
        self.device_ops: dict[str, list] = {}  # level -> [(aten op, args, kwargs)]
        self.ops = {"kernels": {}, "allocations": 0, "syncs": 0}
        self.parent: dict[str, str] = {}
        self.targets: dict[str, tuple] = {}  # label -> (owner, attribute, original function)
        self._stack = [ADAPTER]
        self._undo = []
        self._host = {t.untyped_storage().data_ptr() for t in host_tensors if t is not None}

    def _enter(self, label: str, fn, args, kwargs):
        self.parent.setdefault(label, self._stack[-1])
        record = [fn, args, kwargs, None]
        self.calls.setdefault(label, []).append(record)
        self._stack.append(label)
        try:
            record[3] = fn(*args, **kwargs)
            return record[3]
        finally:
            self._stack.pop()

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def recording(*args, **kwargs):
            return self._enter(label, original, args, kwargs)

        setattr(owner, attr, recording)
        self._undo.append((owner, attr, original))
        self.targets[label] = (owner, attr, original)

    def wrap_launcher(self, cls) -> None:
        original = cls.__call__

        def recording(kernel, *args):
            label = f"launcher ({self._stack[-1].split(': ')[-1]})"
            self.targets.setdefault(label, (cls, "__call__", original))
            return self._enter(label, original, (kernel, *args), {})

        cls.__call__ = recording
        self._undo.append((cls, "__call__", original))

    @contextlib.contextmanager
    def stubbed(self, labels):
        """The functions of ``labels`` replaced by stubs that return, in order, what the recorded
        calls returned: the level above runs its own code only."""
        saved = []
        for label in labels:
            owner, attr, original = self.targets[label]
            results = itertools.cycle([r[3] for r in self.calls[label]])
            saved.append((owner, attr, getattr(owner, attr)))
            if attr == "__call__":
                setattr(owner, attr, lambda kernel, *args, _r=results: next(_r))
            else:
                setattr(owner, attr, lambda *args, _r=results, **kwargs: next(_r))
        try:
            yield
        finally:
            for owner, attr, fn in reversed(saved):
                setattr(owner, attr, fn)

    def run(self, fn) -> None:
        """Run ``fn`` once under the recorder, logging the device path's torch ops."""
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        rec = self
        local_scalar = torch.ops.aten._local_scalar_dense.default

        def is_host(x):
            return x.untyped_storage().data_ptr() in rec._host or x.numel() == 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                result = func(*args, **kwargs)
                tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                name = func.overloadpacket.__name__
                if tensors and all(is_host(t) for t in tensors):
                    for r in tree_leaves(result):
                        if isinstance(r, torch.Tensor):
                            rec._host.add(r.untyped_storage().data_ptr())
                elif func is local_scalar:
                    rec.ops["syncs"] += 1
                elif name in Recorder.ALLOCS:
                    rec.ops["allocations"] += 1
                elif name not in Recorder.VIEWS:
                    rec.ops["kernels"][name] = rec.ops["kernels"].get(name, 0) + 1
                    rec.device_ops.setdefault(rec._stack[-1], []).append((func, args, kwargs))
                return result

        try:
            with Mode():
                fn()
        finally:
            for owner, attr, original in reversed(self._undo):
                setattr(owner, attr, original)
            self._undo.clear()

    def replay(self, label: str, device_ops: bool = False):
        calls = (self.device_ops if device_ops else self.calls).get(label, [])

        def run():
            for fn, args, kwargs, *_ in calls:
                fn(*args, **kwargs)

        return run

    def children(self, label: str) -> list[str]:
        return [c for c, p in self.parent.items() if p == label]


def record_levels(layer_call, adapter_ops: list[tuple[object, str, str]], host_tensors) -> Recorder:
    """One call of ``layer_call`` with the op, kernel-entry and launcher levels recorded: the second
    layer of the step (the first also makes what a plan keeps for every later layer)."""
    layer_call()
    from qla_serving.kernels import chunk_prefill, library
    from qla_serving.kernels import decode as kdecode

    rec = Recorder(host_tensors)
    for owner, attr, label in adapter_ops:
        rec.wrap(owner, attr, label)
    rec.wrap(kdecode, "gated_delta_rule_decode_fwd", "kernel entry: decode")
    rec.wrap(chunk_prefill, "chunk_gated_delta_rule_fwd", "kernel entry: prefill")
    rec.wrap(chunk_prefill, "chunk_gated_delta_rule_fwd_packed", "kernel entry: prefill (packed)")
    rec.wrap_launcher(library.LibraryKernel)
    rec.wrap_launcher(_PyNoop)
    rec.run(layer_call)
    return rec


def _shape_cat(tensors, dim=0):
    dim = dim % tensors[0].dim()
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return tensors[0].new_empty(shape)


def _shape_index_select(x, dim, index):
    shape = list(x.shape)
    shape[dim % x.dim()] = index.numel()
    return x.new_empty(shape)


def _shape_clone(x, memory_format=None):
    import torch

    return torch.empty_like(x, memory_format=memory_format or torch.preserve_format)


# Allocate-only stand-ins of the data-moving ops (same result shape, dtype and layout, no data).
SHIMS = {
    "cat": _shape_cat,
    "index_select": _shape_index_select,
    "clone": _shape_clone,
    "copy_": lambda x, src, non_blocking=False: x,
    "index_select.out": lambda x, dim, index, *, out: out,  # a bound prefill's AutoCP snapshot refresh
}
HEAVY_US = 5.0  # device ops slower than this on the CPU are data work: timed as shims


class DataShims:
    """While active, the given aten ops run as allocate-only Python kernels on the CPU, so the
    timings hold their dispatch (about what a launch costs the host on a GPU) but not the data
    movement, which is GPU work in serving."""

    def __init__(self, names):
        self.names = sorted(names)

    def __enter__(self):
        import warnings

        import torch

        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in self.names:
                self.lib.impl(name, SHIMS[name], "CPU")
        return self

    def __exit__(self, *exc):
        self.lib._destroy()
        return False


def time_levels(layer_call, rec: Recorder, reps: int, warmup: int) -> dict:
    """Per level: its own host time per layer call (``own_host_us``: the level's calls with the
    levels below stubbed, returning what they returned) and its time with everything below it
    (``host_inclusive_us``: its recorded calls replayed). Device ops that move data (slower than
    ``HEAVY_US`` here) run as allocate-only shims meanwhile; the rest run as they are (their CPU
    dispatch stands in for a launch). The total is the real call, unstubbed."""
    heavy, unshimmable = set(), set()
    for calls in rec.device_ops.values():
        for func, args, kwargs in calls:
            if median_us(lambda: func(*args, **kwargs), 20, 2) > HEAVY_US:
                name = func.overloadpacket.__name__
                if func._overloadname != "default":
                    name += f".{func._overloadname}"
                (heavy if name in SHIMS else unshimmable).add(name)
    levels = [ADAPTER] + [k for k in rec.calls if rec.calls[k]]
    rows = {}
    with DataShims(heavy):
        total = median_us(layer_call, reps, warmup)
        for label in levels:
            run = layer_call if label == ADAPTER else rec.replay(label)
            with rec.stubbed(rec.children(label)):
                own = median_us(run, reps, warmup)
            inclusive = total if label == ADAPTER else median_us(run, reps, warmup)
            rows[label] = {
                "calls": len(rec.calls.get(label, [None])),
                "own_host_us": own,
                "host_inclusive_us": inclusive,
                "device_ops": len(rec.device_ops.get(label, [])),
            }
    rows["total"] = {
        "host_us": total,
        "sum_of_own_us": sum(r["own_host_us"] for r in rows.values()),
        "device_ops": sum(r["device_ops"] for r in rows.values()),
        "shimmed": sorted(heavy),
        "data_work_left_in": sorted(unshimmable),
    }
    return rows


def print_levels(rows: dict) -> None:
    print(f"      {'level':<26} {'calls':>5} {'own host':>11} {'host incl.':>11} {'device ops':>11}")
    for label, r in rows.items():
        if label == "total":
            continue
        print(
            f"      {label:<26} {r['calls']:>5} {r['own_host_us']:>8.1f} us "
            f"{r['host_inclusive_us']:>8.1f} us {r['device_ops']:>11}"
        )
    total = rows["total"]
    print(
        f"      => HOST WORK PER GDN LAYER CALL: {total['host_us']:.1f} us (sum of the levels' own: "
        f"{total['sum_of_own_us']:.1f} us), {total['device_ops']} device ops in it (data-moving ones as "
        f"allocate-only shims: {', '.join(total['shimmed']) or 'none'})"
    )
    if total["data_work_left_in"]:
        print(
            f"      !! device ops with data work and no shim (their CPU execution is in the numbers): "
            f"{', '.join(total['data_work_left_in'])}"
        )


def print_step(rows: dict) -> None:
    for label, us in rows.items():
        print(f"      {label:<66} {us:8.1f} us")


def ops_summary(ops: dict) -> str:
    kernels = sum(ops["kernels"].values())
    detail = ", ".join(f"{k} {v}" for k, v in sorted(ops["kernels"].items(), key=lambda kv: -kv[1]))
    return (
        f"{kernels} device ops [{detail or '-'}], {ops['allocations']} device allocations, "
        f"{ops['syncs']} device->host syncs"
    )


def profile_text(fn, reps: int, lines: int = 30) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


def report(name, per_step, per_layer, ops, prof, plan) -> None:
    print(f"\n== {name}")
    if plan is not None:
        cp = plan.context_parallel
        print(
            f"   plan: {plan.num_seqs} sequences, {plan.num_chunks} chunks, "
            f"{plan.work_items_cpu.shape[0]} work items (AutoCP {'on' if cp else 'off'} at {H100_SMS} SMs)"
        )
    print("   per step (once, shared by every GDN layer):")
    print_step(per_step)
    print("   per GDN layer call:")
    print_levels(per_layer)
    print(f"      device path: {ops_summary(ops)}")
    if prof:
        print(prof)


def plan_host_tensors(plan) -> list:
    if plan is None:
        return []
    return [plan.cu_seqlens_cpu, plan.chunk_offsets_cpu, plan.checkpoint_offsets_cpu, plan.work_items_cpu]


# ----------------------------------------------------------------------------- vLLM


def run_vllm(args) -> dict:
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    import qla_vllm_helpers as helpers  # the vLLM tests' own constructors

    helpers.register_cpu_platform()
    import torch
    import vllm

    emulate_sm90()
    launcher = install_noop_kernels()
    helpers.register_plugin()
    model_dir = helpers.write_qwen35_model_dir(
        tempfile.mkdtemp(prefix="qla_host_overhead_"),
        linear_num_key_heads=QK_HEADS,
        linear_num_value_heads=V_HEADS,
    )
    config = helpers.engine_config(model_dir, gdn_prefill_backend="flashqla")
    helpers.init_cpu_distributed(config)
    os.environ["QLA_FORCE_REFERENCE"] = "1"  # so the layer is built active on a CPU machine
    try:
        layer = helpers.build_gdn_layer(config)
    finally:
        del os.environ["QLA_FORCE_REFERENCE"]
    assert layer.qla_active

    conv_shape, ssm_shape = layer.get_state_shape()[:2]
    conv_dtype, ssm_dtype = layer.get_state_dtype()[:2]
    layer.kv_cache = (
        torch.zeros(NUM_SLOTS, *conv_shape, dtype=conv_dtype),
        torch.zeros(NUM_SLOTS, *ssm_shape, dtype=ssm_dtype),
    )
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    dtype = config.model_config.dtype

    # The engine's own preparation: on the GPU vLLM's causal conv kernels and fused_post_conv_prep,
    # here ready tensors of the shapes and dtypes they return (their cost is not ours).
    prepared = {}

    def engine_prefill_inputs(x, a, b):
        n = x.shape[0]
        if n not in prepared:
            prepared[n] = (
                torch.empty(n, H, K, dtype=dtype),
                torch.empty(n, H, K, dtype=dtype),
                torch.empty(n, HV, V, dtype=dtype),
                torch.empty(n, HV, dtype=torch.float32),
                torch.empty(n, HV, dtype=torch.float32),
                False,
            )
        return prepared[n]

    layer._qla_conv_prefill = lambda x, conv_state, md: x
    layer._qla_conv_decode = lambda x, conv_state, md: x
    layer._qla_prefill_inputs = engine_prefill_inputs

    print(
        f"vLLM {vllm.__version__}, torch {torch.__version__}, Python {platform.python_version()}; "
        f"GDN layer H={H} HV={HV} K={K} V={V}, {dtype} activations, {ssm_dtype} state pool"
    )
    print(f"kernels: {launcher}")
    results = {
        "engine": f"vllm {vllm.__version__}",
        "launcher": launcher,
        "state_dtype": str(ssm_dtype),
        "scenarios": {},
    }
    for name, query, context in (
        (
            f"mixed: 1 prefill chunk of 2048 tokens + {DECODES} decodes",
            [1] * DECODES + [2048],
            [700 + 13 * i for i in range(DECODES)] + [2048],
        ),
        ("prefill: 8 sequences of 1024 tokens", [1024] * 8, [0, 0, 0, 0, 512, 512, 1024, 4096]),
        # pure decode: replayed in vLLM's FULL graphs, where only the per-step metadata build is host work
        ("decode: 1 sequence", [1], [8192]),
        (f"decode: {DECODES + 1} sequences", [1] * (DECODES + 1), [700 + 13 * i for i in range(DECODES + 1)]),
    ):
        results["scenarios"][name] = vllm_scenario(layer, config, name, query, context, args)
    return results


def vllm_scenario(layer, config, name, query, context, args) -> dict:
    import qla_vllm_helpers as helpers
    import torch
    from qla_serving.integrations.vllm import metadata as qla_md
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    import qla_serving

    common = helpers.common_metadata(query, context, list(range(1, len(query) + 1)))
    builder = helpers.metadata_builder(layer, config)
    plain = GDNAttentionMetadataBuilder(
        layer.get_kv_cache_spec(config), [layer.prefix], config, torch.device("cpu")
    )

    def build_fresh():
        qla_md._last_plan = None  # a step whose lengths differ from the previous step's
        return builder.build(0, common)

    engine = median_us(lambda: plain.build(0, common), args.reps, args.warmup)
    fresh = median_us(build_fresh, args.reps, args.warmup)
    reused = median_us(lambda: builder.build(0, common), args.reps, args.warmup)
    per_step = {
        "vLLM's own GDN metadata build (engine, for reference)": engine,
        "our builder (vLLM's build + ours), plan built": fresh,
        "our builder (vLLM's build + ours), plan reused (same lengths)": reused,
        "OURS PER STEP (plan built) = difference": fresh - engine,
    }
    md = build_fresh()
    T = sum(query)
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    dtype = config.model_config.dtype
    mixed_qkv = torch.zeros(T, 2 * H * K + HV * V, dtype=dtype)
    a, b = torch.zeros(T, HV, dtype=dtype), torch.zeros(T, HV, dtype=dtype)
    out = torch.empty(T, HV, V, dtype=dtype)

    def layer_call():
        layer._forward_core(mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=out)

    host = [common.query_start_loc_cpu] + plan_host_tensors(md.qla_plan)
    with set_forward_context({layer.prefix: md}, config):
        rec = record_levels(
            layer_call,
            [
                (qla_serving, "gated_delta_rule_decode", "op: decode"),
                (qla_serving, "chunk_gated_delta_rule_pool", "op: prefill"),
                (qla_serving, "chunk_gated_delta_rule_pool_packed", "op: prefill (packed)"),
            ],
            host,
        )
        per_layer = time_levels(layer_call, rec, args.reps, args.warmup)
        with DataShims(per_layer["total"]["shimmed"]):
            prof = profile_text(layer_call, args.reps) if args.profile else None
    report(name, per_step, per_layer, rec.ops, prof, md.qla_plan)
    return {"per_step_us": per_step, "per_layer": per_layer, "device_ops": rec.ops}


# ----------------------------------------------------------------------------- SGLang


def run_sglang(args) -> dict:
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "sglang")]
    import sglang
    import torch

    emulate_sm90()
    launcher = install_noop_kernels()
    from qla_serving.integrations.sglang import kernel as sgl_kernel
    from test_sglang_kernel import extend_batch, make_kernel  # the SGLang tests' own batch objects

    version = getattr(sglang, "__version__", "?")
    pool_dtype = torch.bfloat16 if args.state == "bf16" else torch.float32
    print(
        f"SGLang {version}, torch {torch.__version__}, Python {platform.python_version()}; GDN layer "
        f"H={QK_HEADS} HV={V_HEADS} K=V={HEAD_DIM}, bf16 activations, {pool_dtype} state pool"
    )
    print(f"kernels: {launcher}")
    results = {
        "engine": f"sglang {version}",
        "launcher": launcher,
        "state_dtype": str(pool_dtype),
        "scenarios": {},
    }
    ssm_states = torch.zeros(NUM_SLOTS, V_HEADS, HEAD_DIM, HEAD_DIM, dtype=pool_dtype)
    for name, lens in (
        (
            f"mixed (--enable-mixed-chunk): 1 prefill chunk of 2048 tokens + {DECODES} decodes",
            [2048] + [1] * DECODES,
        ),
        ("prefill: 8 sequences of 1024 tokens", [1024] * 8),
    ):
        kernel = make_kernel()
        kernel.num_v_heads = V_HEADS
        fb, md, attn_backend = extend_batch(lens, list(range(1, len(lens) + 1)))
        T = sum(lens)
        # On the GPU SGLang's fused_qkv_split_gdn_prefill gives contiguous q, k, v; its gating gives g, beta.
        q = torch.zeros(1, T, QK_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        k = torch.zeros_like(q)
        v = torch.zeros(1, T, V_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        g = torch.zeros(1, T, V_HEADS, dtype=torch.float32)
        beta = torch.zeros(1, T, V_HEADS, dtype=torch.float32)
        output = torch.empty(1, T, V_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        kwargs = dict(
            ssm_states=ssm_states,
            cache_indices=md.mamba_cache_indices,
            query_start_loc=md.query_start_loc,
            state_checkpoint_cu_starts=None,
            num_state_checkpoints=None,
            state_checkpoint_every_n_tokens=None,
            output=output,
            layer_id=0,
            extend_prefix_lens=None,
            track_state=None,
            track_chunk_idx=None,
        )

        def begin():
            kernel._batches = []
            kernel.begin_batch(attn_backend, fb)

        per_step = {"OURS PER STEP: begin_batch (plan built)": median_us(begin, args.reps, args.warmup)}
        begin()

        def layer_call():
            kernel.extend(q, k, v, g, beta, **kwargs)

        plan = kernel._batches[0].plan
        rec = record_levels(
            layer_call,
            [
                (sgl_kernel, "chunk_gated_delta_rule_pool", "op: prefill"),
                (sgl_kernel, "gated_delta_rule_decode", "op: decode"),
            ],
            plan_host_tensors(plan),
        )
        per_layer = time_levels(layer_call, rec, args.reps, args.warmup)
        with DataShims(per_layer["total"]["shimmed"]):
            prof = profile_text(layer_call, args.reps) if args.profile else None
        report(name, per_step, per_layer, rec.ops, prof, plan)
        results["scenarios"][name] = {"per_step_us": per_step, "per_layer": per_layer, "device_ops": rec.ops}
    return results


# ----------------------------------------------------------------------------- main


def use_tree(tree: pathlib.Path) -> None:
    """Import qla-serving from another checkout (e.g. a worktree of the commit before a change),
    laid out as the package is installed (``kernels/`` is ``qla_serving.kernels``, ``integrations/``
    is ``qla_serving.integrations``), ahead of the installed one."""
    import importlib.abc
    import importlib.util

    layout = {
        "qla_serving": "qla_serving",
        "qla_serving.kernels": "kernels",
        "qla_serving.integrations": "integrations",
    }

    class TreeFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in layout:
                return None
            where = tree / layout[name]
            return importlib.util.spec_from_file_location(
                name, where / "__init__.py", submodule_search_locations=[str(where)]
            )

    sys.meta_path.insert(0, TreeFinder())


# glibc hands blocks above its mmap threshold (128 KiB by default) straight back to the kernel, so a
# CPU run would pay mmap/munmap and page faults for every workspace the CUDA caching allocator
# serves from its cache: keep freed blocks in the heap instead.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(2**30),
    "MALLOC_TRIM_THRESHOLD_": str(2**31),
    "MALLOC_TOP_PAD_": str(2**28),
}


def main(argv=None) -> int:
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=("vllm", "sglang"))
    parser.add_argument("--reps", type=int, default=3000, help="timed repetitions per measurement (median)")
    parser.add_argument("--warmup", type=int, default=300, help="untimed repetitions first")
    parser.add_argument(
        "--state",
        choices=("bf16", "fp32"),
        default="bf16",
        help="SGLang's state pool dtype (vLLM's comes from its config)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the per-layer call (tottime)")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument(
        "--tree",
        type=pathlib.Path,
        help="measure the qla-serving of this checkout (default: the installed one)",
    )
    args = parser.parse_args(argv)
    if args.tree is not None:
        use_tree(args.tree.resolve())
    os.environ.pop("QLA_CHECK_INDICES", None)
    os.environ.pop("QLA_FORCE_REFERENCE", None)
    import torch

    torch.set_num_threads(1)
    results = run_vllm(args) if args.engine == "vllm" else run_sglang(args)
    import qla_serving

    tree = pathlib.Path(qla_serving.__file__).resolve().parent.parent
    print(
        f"\nqla-serving from {tree}; CPU {_cpu_name()}; each number: {args.warmup} warm-up calls, then "
        f"{BLOCKS} blocks of {args.reps // BLOCKS} timed calls, the lowest block median"
    )
    print(NOT_MEASURED)
    results.update(
        tree=str(tree),
        cpu=_cpu_name(),
        python=platform.python_version(),
        torch=torch.__version__,
        reps=args.reps,
        warmup=args.warmup,
        not_measured=NOT_MEASURED,
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
