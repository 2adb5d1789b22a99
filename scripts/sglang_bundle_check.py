"""CPU-side check of the SGLang bundle (run by ``scripts/sglang_bundle.sh --check``).

    sglang_bundle_check.py image OUT_DIR PACKAGE_LIST SITE...   # emulate the GPU image
    python3.11 -S sglang_bundle_check.py import SITE...          # import what the GPU run needs,
                                                                 # then the serving benchmark's steps
    python3 sglang_bundle_check.py gpu                           # the same imports on the GPU machine
    python3 sglang_bundle_check.py serve                         # and the serving steps there
    python3 sglang_bundle_check.py stress                        # and the stress harness's steps

``image`` links into OUT_DIR the top-level entries of every distribution that PACKAGE_LIST (the
image's package names, as KINDS.md lists them) names, taking each from the first SITE that has
it, so an import that works here does not lean on a package the GPU machine lacks.

``import`` puts the SITEs on ``sys.path`` in the given order (first wins, as the stacked bundles
do on the GPU machine), pretends an SM90 GPU so the import-time ``if _is_cuda:`` branches of
SGLang and sgl_kernel run, and imports :data:`MODULES`; then it runs what the serving benchmark
(``e2e_bench/serve.py --engine sglang``) does on the CPU side before and around its servers
(:func:`check_serving`): the harness's server command through SGLang's own argument resolution
for every backend (with the plugin loaded), the model config and model class SGLang resolves, the
tokenizer and grammar backend the scheduler builds at start, and the harness's client command
through ``sglang.bench_serving``'s parser and random dataset. Exit status 1 names each failure.

``import`` then runs the stress harness's steps too (:func:`check_stress`, ``e2e_bench/stress.py
--engine sglang`` as docs/e2e.md's call sequence runs it): each server it starts (oracle without
the radix cache, stress server with the ``extra_buffer`` radix cache and ``/metrics``, one MTP
server per draft length) through SGLang's full argument resolution, the speculative servers' draft
model class, the modules the speculative worker and the metrics collectors import, the harness's
request bodies through SGLang's request dataclasses, and its metrics parsing against what SGLang's
own collectors print.

``gpu`` imports :data:`MODULES` as they are (bundles loaded, real GPU) and says which sgl_kernel
library loaded; ``serve`` does the same and then :func:`check_serving` (a pre-flight of the
serving benchmark on the GPU machine, from the staged checkout: ``scripts/gpu_stage.sh``);
``stress`` the same and :func:`check_stress` (the stress harness's pre-flight).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import traceback
import types

# What tests/sglang/test_sglang_gpu.py and the adapter import from SGLang, and what SGLang's own
# plugin loader and argument parser (conftest.py's fixtures) import.
MODULES = [
    "sgl_kernel",
    "xgrammar",  # SGLang imports it inside try/except in places: a broken build would hide there
    "flashinfer",
    "sglang.srt.layers.attention.linear.kernels.gdn_triton",
    "sglang.srt.layers.attention.linear.gdn_backend",
    "sglang.srt.layers.attention.linear.utils",
    "sglang.srt.layers.attention.linear.kernels.kernel_backend",
    "sglang.srt.server_args",
    "sglang.srt.runtime_context",
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "qla_serving.integrations.sglang.kernel",
    "qla_serving.integrations.sglang.patch",
    # what an offline sglang.Engine of a Qwen3.5-shaped model imports (e2e_bench/sglang_offline.py)
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.qwen3_5_text",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.hybrid_linear_attn_backend",
    "sglang.srt.layers.attention.linear.kernels.gdn_flashinfer",
    # the serving benchmark (e2e_bench/serve.py --engine sglang): `python -m sglang.launch_server`
    # and its HTTP server (FastAPI: form fields need python-multipart at import; the transcription
    # route needs soundfile), the processes it starts, what they import lazily on the way for
    # Qwen3-Next / Qwen3.5 MoE (model classes -- SGLang's registry skips a model file that fails
    # to import --, MoE, the mamba state pool and radix cache, CUDA-graph runners, the grammar
    # backend the scheduler builds at start, the start-up warm-up), and the client
    # `python -m sglang.bench_serving` that e2e_bench/serve_client.py imports (HF datasets)
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.openai.serving_completions",
    "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.entrypoints.warmup",
    "sglang.srt.parser.template_manager",
    "sglang.srt.managers.multi_tokenizer_mixin",
    "sglang.srt.managers.data_parallel_controller",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.io_struct",
    "sglang.srt.constrained.xgrammar_backend",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.qwen3_next",
    "sglang.srt.models.qwen3_5",
    "sglang.srt.layers.moe.fused_moe_triton.layer",
    "sglang.srt.layers.moe.moe_runner.triton",
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe",
    "sglang.srt.layers.attention.mamba.mamba",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.mamba_radix_cache",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    "sglang.srt.layers.sampler",
    "sglang.benchmark.serving",
    "sglang.bench_serving",
    "e2e_bench.serve",
]
# e2e_bench/models/ name and layer count of the serving benchmark's first SGLang run
SERVE_MODEL = ("qwen3-next-80b-a3b", 8)
# the stress harness's arguments in docs/e2e.md's SGLang call sequence ("Reliability under load"),
# less --backends, --phase and --budget (the check covers both backends and every phase)
STRESS_ARGS = ["--engine", "sglang", "--model", SERVE_MODEL[0], "--layers", str(SERVE_MODEL[1]),
               "--requests", "60", "--rate", "40", "--max-prompt", "8192", "--longest", "32768", "--aborts", "6",
               "--suffixes", "2", "--flood", "4", "--spec-requests", "32", "--spec-tokens", "1", "2", "4", "8",
               "--server-arg=--max-total-tokens=524288"]
STRESS_BACKENDS = ("flashqla", "default")
# what the stress harness's servers import past the serving benchmark's: the MTP draft model, the
# speculative (EAGLE v2) worker SGLang runs NEXTN with and what it imports when it captures its
# graphs, and the /metrics collectors
STRESS_MODULES = [
    "sglang.srt.models.qwen3_next_mtp",
    "sglang.srt.speculative.spec_info",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.eagle_info",
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner",
    "sglang.srt.speculative.draft_worker_common",
    # imported while the EAGLE v2 worker captures its draft-extend graphs (for an isinstance check):
    # the DSA backend imports DeepGEMM on CUDA
    "sglang.srt.layers.attention.dsa_backend",
    "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.layers.attention.flashmla_backend",
    "sglang.srt.observability.metrics_collector",
    "prometheus_client",
    "e2e_bench.stress",
]
# SGLang's full-attention backends that need sgl-kernel's FA3 library, which the bundle leaves out
FA3_BACKENDS = {"fa3", "fa4"}
VERSIONS = [
    "torch",
    "triton",
    "tilelang",
    "sglang",
    "sglang-kernel",
    "transformers",
    "tokenizers",
    "apache-tvm-ffi",
    "flashinfer-python",
]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def build_image(out_dir: str, package_list: str, sites: list[str]) -> None:
    with open(package_list) as f:
        text = f.read()
    names, _, pinned = text.partition("\n")
    wanted = {_norm(n) for n in re.findall(r"[A-Za-z0-9_.-]+", names)}
    # versions seen on the machine ("name version, ..."): a site holding that version wins
    seen = {_norm(n): v for n, v in re.findall(r"([A-Za-z0-9_.-]+) ([0-9][^,\s]*)", pinned)}
    dists = [(d, s) for s in sites for d in importlib.metadata.distributions(path=[s])]
    dists.sort(key=lambda ds: seen.get(_norm(ds[0].metadata["Name"])) != ds[0].version)  # stable
    found: set[str] = set()
    for dist, site_dir in dists:
        name = _norm(dist.metadata["Name"])
        if name not in wanted or name in found:
            continue
        found.add(name)
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}
        for top in tops:
            src, dst = os.path.join(site_dir, top), os.path.join(out_dir, top)
            if os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
    print(f"image emulation: {len(found)} of {len(wanted)} listed packages found locally")


def _pretend_sm90() -> None:
    """Make torch report one H100, for import-time branches only (nothing runs on it)."""
    import torch

    props = types.SimpleNamespace(
        major=9,
        minor=0,
        name="NVIDIA H100 80GB HBM3",
        total_memory=80 << 30,
        multi_processor_count=132,
        L2_cache_size=50 << 20,
        gcnArchName="",
        warp_size=32,
        shared_memory_per_block_optin=232448,
        uuid="0",
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.mem_get_info = lambda *a, **k: (props.total_memory - (1 << 30), props.total_memory)


def check_imports(sites: list[str] | None) -> int:
    """Import :data:`MODULES`; ``sites`` None: as the interpreter is set up (the GPU machine)."""
    import site

    if sites is not None:
        sys.path[:] = [p for p in sys.path if "site-packages" not in p and "dist-packages" not in p]
        for site_dir in reversed(sites):  # addsitedir appends; insert so the first SITE wins
            before = list(sys.path)
            site.addsitedir(site_dir)
            added = [p for p in sys.path if p not in before]
            sys.path[:] = added + before
        _pretend_sm90()
    failures = 0
    for module in MODULES:
        try:
            importlib.import_module(module)
            print(f"ok    {module}")
        except BaseException as e:  # noqa: BLE001 -- report every failure, keep going
            failures += 1
            print(f"FAIL  {module}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=-4)
    for dist in VERSIONS:
        try:
            print(f"      {dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"      {dist} (not found)")
    ops = getattr(sys.modules.get("sgl_kernel"), "common_ops", None)
    print(f"      sgl_kernel library: {getattr(ops, '__file__', None)}")
    if sites is None:
        import torch

        print(f"      GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    print(f"{len(MODULES) - failures} of {len(MODULES)} modules import")
    return 1 if failures else 0


class Steps:
    """Runs the check's steps: ``ok`` or ``FAIL`` and the error per step, every step run whatever
    failed before it; ``failures`` counts them."""

    def __init__(self):
        self.failures = 0

    def __call__(self, label, fn):
        try:
            print(f"ok    {label}: {fn()}")
        except BaseException as e:  # noqa: BLE001 -- report every failure, keep going
            self.failures += 1
            print(f"FAIL  {label}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=-6)


def check_serving() -> int:
    """The serving benchmark's CPU-side steps for SGLang, with the bundle's SGLang (see the module
    docstring). Returns 1 if one fails."""
    import tempfile

    from e2e_bench import serve

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as serve.backend_env sets it for SGLang
    name, layers = SERVE_MODEL
    spec = serve.model_spec(name)
    max_len = max(i + o for i, o in serve.WORKLOADS.values()) + 1024
    # not named qla-serve-*: gpu_session.sh packs those directories
    scratch = tempfile.TemporaryDirectory(prefix="qla-check-serving-")
    files = serve.engine_model(spec, "sglang", layers, max_len, scratch.name)
    model_dir = files["model_dir"]
    setup = serve.Setup("sglang", tp=1, max_len=max_len, **files)
    step = Steps()

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()  # as `python -m sglang.launch_server` does before it parses its arguments
    fa3 = serve.sglang_fa3_library()
    resolved = {}

    def server_args(backend):
        cmd = serve.server_command(setup, backend)
        sa = resolved[backend] = prepare_server_args(cmd[3:])
        attention = {sa.attention_backend, sa.prefill_attention_backend, sa.decode_attention_backend}
        if fa3 is None and attention & FA3_BACKENDS:
            raise RuntimeError(f"full attention resolves to {sorted(attention & FA3_BACKENDS)} without "
                               f"sgl-kernel's FA3 library (command: {' '.join(cmd[3:])})")
        if backend != "default" and sa.linear_attn_backend != backend:
            raise RuntimeError(f"--linear-attn-backend resolves to {sa.linear_attn_backend}")
        return (f"attention {sa.attention_backend}, linear {sa.linear_attn_backend}, mamba cache "
                f"{getattr(sa, 'mamba_radix_cache_strategy', '?')}, overlap "
                f"{'off' if sa.disable_overlap_schedule else 'on'}, mem fraction {sa.mem_fraction_static}")

    print(f"      sgl-kernel FA3 library: {fa3}")
    for backend in serve.DEFAULT_BACKENDS:
        step(f"server args ({backend})", lambda backend=backend: server_args(backend))

    def model():
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.models.registry import ModelRegistry

        mc = ModelConfig.from_server_args(resolved["default"])
        cls, arch = ModelRegistry.resolve_model_cls(mc.hf_config.architectures)
        return (f"{arch} -> {cls.__module__}.{cls.__name__}, {mc.num_hidden_layers} layers, "
                f"vocab {mc.vocab_size}")

    step(f"model config and class ({name}, {layers} layers)", model)

    tokenizer = {}

    def tokenizer_and_grammar():
        from sglang.srt.constrained.base_grammar_backend import create_grammar_backend
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        sa = resolved["default"]
        tok = tokenizer["server"] = get_tokenizer(sa.tokenizer_path, tokenizer_mode=sa.tokenizer_mode,
                                                  trust_remote_code=sa.trust_remote_code)
        grammar = create_grammar_backend(sa, tok, spec["vocab_size"], {serve.TOKENIZER_WORDS})
        words = [tok.decode([i]) for i in (0, serve.TOKENIZER_WORDS + 1, spec["vocab_size"] - 1)]
        if not all(words):
            raise RuntimeError(f"ids past the end-of-text token decode to nothing: {words}")
        return f"{type(tok).__name__} ({len(tok)} ids), grammar backend {type(grammar).__name__}"

    step("server tokenizer and grammar backend", tokenizer_and_grammar)

    def client():
        import numpy as np
        from sglang.benchmark import serving
        from sglang.benchmark.datasets import get_dataset

        from e2e_bench import serve_client

        stand_in = serve_client._datasets_or_stand_in()
        run = serve_client._sglang()  # what the harness's client process runs per point
        seen = []
        real, serving.run_benchmark = serving.run_benchmark, seen.append
        try:
            out = []
            for workload in ("short", "chat"):
                result = os.path.join(model_dir, "r.jsonl")
                cmd = serve.client_command(setup, workload, 2, 4, result, warmups=1)
                run(cmd[len(serve.CLIENT_CLI["sglang"]):])
                args = seen[-1]
                np.random.seed(args.seed)
                tok = serving.get_tokenizer(args.tokenizer)
                rows = get_dataset(args, tok, "bench")
                lens = {len(tok.encode(r.prompt)) for r in rows}
                if lens != {serve.WORKLOADS[workload][0]} or len(rows) != 4:
                    raise RuntimeError(f"{workload}: {len(rows)} prompts of {lens} tokens, "
                                       f"expected 4 of {serve.WORKLOADS[workload][0]}")
                out.append(f"{workload} {len(rows)} x {lens.pop()} tokens")
        finally:
            serving.run_benchmark = real
        note = f" (HF datasets stand-in: {stand_in})" if stand_in else ""
        return f"{args.dataset_name} dataset: " + ", ".join(out) + note

    step("client command and dataset", client)
    scratch.cleanup()
    return 1 if step.failures else 0


def check_stress() -> int:
    """The stress harness's CPU-side steps for SGLang (see the module docstring). Returns 1 if one
    fails."""
    import json
    import tempfile

    from e2e_bench import serve

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    step = Steps()

    for module in STRESS_MODULES:
        step(f"import {module}", lambda module=module: importlib.import_module(module).__name__)
    if step.failures:
        return 1
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from e2e_bench import stress

    load_plugins()
    args = stress.parse_args(STRESS_ARGS)
    spec = serve.model_spec(args.model)
    plan = stress.plan_requests(args)
    max_len = stress.max_model_len(args, plan)
    scratch = tempfile.TemporaryDirectory(prefix="qla-check-stress-")  # not qla-stress-*: gpu_session.sh packs those
    setup = serve.Setup("sglang", tp=1, max_len=max_len,
                        **serve.engine_model(spec, "sglang", args.layers, max_len, scratch.name))
    fa3 = serve.sglang_fa3_library()

    def resolve(backend, tag, cmd):
        sa = prepare_server_args(cmd[3:])
        attention = {sa.attention_backend, sa.prefill_attention_backend, sa.decode_attention_backend}
        if fa3 is None and attention & FA3_BACKENDS:
            raise RuntimeError(f"full attention resolves to {sorted(attention & FA3_BACKENDS)} without sgl-kernel's "
                               "FA3 library")
        if backend != "default" and sa.linear_attn_backend != backend:
            raise RuntimeError(f"--linear-attn-backend resolves to {sa.linear_attn_backend}")
        strategy = getattr(sa, "mamba_radix_cache_strategy", "?")
        if tag == "oracle":
            if not sa.disable_radix_cache:
                raise RuntimeError("the oracle keeps the radix cache")
            what = "radix cache off"
        elif not sa.enable_metrics:
            raise RuntimeError("/metrics off")
        elif strategy != "extra_buffer":
            raise RuntimeError(f"mamba radix cache {strategy}, expected extra_buffer")
        else:
            what = f"radix cache {strategy}, metrics on"
        if tag.startswith("spec"):
            from sglang.srt.configs.model_config import ModelConfig
            from sglang.srt.models.registry import ModelRegistry

            k = int(tag[4:])
            got = (sa.speculative_algorithm, sa.speculative_num_steps, sa.speculative_eagle_topk,
                   sa.speculative_num_draft_tokens)
            if got != ("EAGLE", k, 1, k + 1):
                raise RuntimeError(f"speculative decoding resolves to {got}, expected ('EAGLE', {k}, 1, {k + 1})")
            draft = ModelConfig.from_server_args(sa, model_path=sa.speculative_draft_model_path, is_draft_model=True)
            cls, arch = ModelRegistry.resolve_model_cls(draft.hf_config.architectures)
            if arch != "Qwen3NextForCausalLMMTP":
                raise RuntimeError(f"the draft model resolves to {arch}")
            what += (f", {sa.speculative_algorithm} {k} steps / {k + 1} tokens, draft {cls.__name__} "
                     f"({sa.speculative_draft_load_format or sa.load_format}), max running {sa.max_running_requests}")
        return (f"{what}; attention {sa.attention_backend}, linear {sa.linear_attn_backend}, overlap "
                f"{'off' if sa.disable_overlap_schedule else 'on'}, KV pool {sa.max_total_tokens or 'as sized'}")

    print(f"      stress servers' context length {max_len}")
    for backend in STRESS_BACKENDS:
        for tag, cmd in stress.server_commands(setup, backend, args, spec["model_type"]).items():
            step(f"stress server args ({backend} {tag})", lambda b=backend, t=tag, c=cmd: resolve(b, t, c))

    def bodies():
        from sglang.srt.managers.io_struct import AbortReq, GenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = {"id": "abort-0", "prompt": [5, 6, 7], "max_tokens": 4, "abort": "prefill"}
        obj = GenerateReqInput(**json.loads(stress.completion_body("sglang", req, stream=True)[1]))
        obj.normalize_batch_and_arguments()
        SamplingParams(**obj.sampling_params).verify(spec["vocab_size"])
        AbortReq(rid=obj.rid)
        refused = []
        for name, body in stress.bad_requests(max_len, "sglang"):
            try:
                bad = GenerateReqInput(**json.loads(body))
            except ValueError:  # malformed JSON, not UTF-8: FastAPI's 4xx
                refused.append(name)
                continue
            try:
                bad.normalize_batch_and_arguments()
            except ValueError:
                refused.append(name)
        return f"/generate, /abort_request and bad bodies read; refused before the tokenizer manager: {refused}"

    step("stress request bodies", bodies)

    def metrics():
        import prometheus_client
        from sglang.srt import runtime_context
        from sglang.srt.observability import metrics_collector as mc

        sa = prepare_server_args(stress.server_commands(setup, "default", args, spec["model_type"])["stress"][3:])
        runtime_context.publish(sa, role="scheduler")
        labels = {"model_name": "bench", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}
        mc.SchedulerMetricsCollector(labels=labels, server_args=sa).increment_retracted_reqs(3, 700, 20)
        tok = mc.TokenizerMetricsCollector(server_args=sa, labels={"model_name": "bench"})
        tok.observe_one_finished_request({"model_name": "bench"}, prompt_tokens=1000, generation_tokens=32,
                                         cached_tokens=96, e2e_latency=0.5, has_grammar=False)
        tok.observe_one_aborted_request({"model_name": "bench"})
        got = stress.parse_metrics(prometheus_client.generate_latest().decode(), "sglang")
        want = {"preemptions": 3.0, "prefix_cache_hits": 96.0, "prefix_cache_queries": 1000.0, "requests_ok": 1.0,
                "requests_aborted": 1.0}
        if got != want:
            raise RuntimeError(f"parsed {got}, expected {want}")
        return got

    step("stress metrics names", metrics)
    scratch.cleanup()
    return 1 if step.failures else 0


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "image":
        build_image(args[0], args[1], args[2:])
    elif mode == "import":
        status = check_imports(args)
        sys.exit(max(status, check_serving(), check_stress()))
    elif mode == "gpu":
        sys.exit(check_imports(None))
    elif mode == "serve":
        status = check_imports(None)
        sys.exit(max(status, check_serving()))
    elif mode == "stress":
        status = check_imports(None)
        sys.exit(max(status, check_serving(), check_stress()))
    else:
        sys.exit(f"unknown mode {mode!r}: image | import | gpu | serve | stress")
