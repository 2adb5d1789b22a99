"""GPU acceptance run of the vLLM plugin: offline vLLM on a tiny Qwen3.5-shaped model.

For each GDN prefill backend (``triton``, ``flashinfer``, ``flashqla``) and each prefix-caching
setting, a fresh subprocess builds ``vllm.LLM`` on a Qwen3.5-shaped config with dummy weights
(no download, no tokenizer: prompts are token ids; the GDN gates re-drawn so heads remember
from a few to about a thousand tokens, see :func:`init_gdn_gates`) and measures

* agreement: ``--num-prompts`` prompts of mixed lengths x ``--max-tokens`` greedy tokens; the
  metric is, per run, the sum over prompts of the tokens generated before the first token that
  differs from the reference run (``triton``, prefix caching off);
* prefill-heavy throughput (in the runs without prefix caching, ``--throughput-pc``):
  ``--tp-prompts`` prompts x ``--tp-len`` tokens, ``max_tokens=1``, prompt tokens per second,
  cold (the first generate call of the process) and warm (a second call on different prompts
  of the same shape, so prefix caching cannot hit).

For ``flashqla`` the subprocess runs with ``QLA_STRICT=1`` (a fallback is an error), counts the
plugin's op calls, reads the kernel compile counters before and after the measured runs, and
fails (exit 3) if the ops did not run, anything compiled while serving, or a fallback was logged.
vLLM's own JIT monitor (kernels compiled or autotuned after its warm-up) is recorded per run.

``--parallel N`` builds up to N engines side by side (building is mostly CPU work: imports,
Triton/CuTe/TileLang compiles) and then lets them measure one at a time, each only while the
others sit idle (:func:`run_waves`); the default runs order puts the three runs without prefix
caching in the first wave. ``--enforce-eager`` skips torch.compile and CUDA-graph capture.

Results: ``<date>-<gpu>-vllm-offline.json`` (``{"meta", "rows"}`` as in
``qla_serving.bench.common``), a markdown table beside it and the generated token ids
(``...-tokens.json``), under ``--out-dir``. Raw per-run results stay in ``--work-dir`` so a
run split over several commands can be resumed (``--reuse``) and aggregated at the end.

``--dry-run`` needs no GPU: it writes the model config, has vLLM's own config machinery accept
it for every backend and setting (``EngineArgs(...).create_engine_config()``), builds the
prompt sets and runs the aggregation on synthetic outputs.

    python e2e_bench/vllm_offline.py --enforce-eager --parallel 3 --out-dir "$OUT"  # on an H100/H200
    python e2e_bench/vllm_offline.py --dry-run --out-dir /tmp/x                     # anywhere with vLLM
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import pathlib
import random
import re
import shlex
import sys
import tempfile
import time

# run as a script (and as its own worker processes): its folder's modules are importable by name
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from agreement import agreement  # noqa: E402
from offline_inputs import add_prompt_args, agreement_prompts, model_config, throughput_prompts, write_model  # noqa: E402
from waves import run_waves, signal_ready, wait_for_go  # noqa: E402

BACKENDS = ("triton", "flashinfer", "flashqla")
REFERENCE = ("triton", "off")  # (backend, prefix caching) every run is compared with
QLA_BACKEND = "flashqla"
EXIT_QLA_CHECK = 3

# ----------------------------------------------------------------------------- GDN gates

# The gate re-draw lives in the package so vLLM's workers can apply it at load time too
# (the serving benchmark's load format ``qla_dummy``). Imported on first use: the package pulls
# in torch, and this script's processes must start fast (run_waves times their start-up).
_GATE_NAMES = ("GATE_A_RANGE", "GATE_DT_RANGE", "gdn_gate_values", "init_gdn_gates")


def _gates():
    from qla_serving.bench import gates

    return gates


def __getattr__(name):
    if name in _GATE_NAMES:
        return getattr(_gates(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- aggregation


def run_label(backend: str, prefix_caching: str) -> str:
    return f"{backend}-pc{prefix_caching}"


def aggregate(results: list[dict], reference: tuple[str, str] = REFERENCE) -> list[dict]:
    """Result rows from the raw per-run results (one dict per worker subprocess).

    A raw result holds ``backend``, ``prefix_caching`` ("on"/"off"), ``ok``, ``init_s``,
    ``agreement`` (``{pass name: [token ids per prompt]}``), ``throughput``
    (``{"cold"|"warm": {"tokens", "s"}}``) and, for flashqla, ``qla`` (the counters). Agreement
    rows compare every pass of every run with the reference run's first pass.
    """
    by_run = {(r["backend"], r["prefix_caching"]): r for r in results}
    ref_run = by_run.get(reference)
    ref = None
    if ref_run is not None and ref_run.get("agreement"):
        ref = next(iter(ref_run["agreement"].values()))
    rows: list[dict] = []
    for r in results:
        mode = f"pc-{r['prefix_caching']}"
        base = {"impl": r["backend"], "mode": mode}
        engine = {"op": "vllm-engine", **base, "ok": r.get("ok", False), "init_s": r.get("init_s"),
                  "measure_s": r.get("measure_s"), "gdn_layers_gated": r.get("gdn_layers_gated"),
                  "jit_events": r.get("jit_events"), "error": r.get("error")}
        if "qla" in r:
            engine["qla"] = r["qla"]
        rows.append(engine)
        for name, outs in (r.get("agreement") or {}).items():
            row = {"op": "vllm-agreement", **base, "pass": name}
            if ref is None:
                row["error"] = f"no reference run ({run_label(*reference)})"
            else:
                row.update(agreement(ref, outs))
            rows.append(row)
        for phase, t in (r.get("throughput") or {}).items():
            rows.append({"op": "vllm-prefill", **base, "phase": phase, "prompts": t["prompts"],
                         "prompt_len": t["prompt_len"], "s": round(t["s"], 4),
                         "tokens_per_s": round(t["tokens"] / t["s"], 1) if t["s"] > 0 else None})
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# vLLM offline acceptance ({meta.get('date', '')})", "",
             f"- GPU: {meta.get('gpu')}", f"- command: `{meta.get('command')}`",
             f"- versions: {', '.join(f'{k} {v}' for k, v in meta.get('versions', {}).items())}",
             f"- model: {meta.get('model', {}).get('summary', '')}",
             (f"- reference: {run_label(*REFERENCE)}, first pass; agreement = tokens generated before the "
             "first divergence, summed over prompts"), ""]
    agree = [r for r in rows if r["op"] == "vllm-agreement"]
    if agree:
        lines += ["## Agreement", "", "| backend | prefix caching | pass | agree tokens | of | fraction | exact prompts |",
                  "|---|---|---|---|---|---|---|"]
        for r in agree:
            if "error" in r:
                lines.append(f"| {r['impl']} | {r['mode']} | {r['pass']} | – | – | – | {r['error']} |")
            else:
                lines.append(f"| {r['impl']} | {r['mode']} | {r['pass']} | {r['agree_tokens']} | {r['total_tokens']} "
                             f"| {r['agree_frac']:.3f} | {r['exact_prompts']}/{r['prompts']} |")
        lines.append("")
    tput = [r for r in rows if r["op"] == "vllm-prefill"]
    if tput:
        lines += ["## Prefill-heavy throughput (prompt tokens/s, max_tokens=1)", "",
                  "| backend | prefix caching | phase | prompts x len | s | tokens/s |", "|---|---|---|---|---|---|"]
        for r in tput:
            tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "–"
            lines.append(f"| {r['impl']} | {r['mode']} | {r['phase']} | {r['prompts']} x {r['prompt_len']} "
                         f"| {r['s']:.3f} | {tps} |")
        lines.append("")
    eng = [r for r in rows if r["op"] == "vllm-engine"]
    lines += ["## Engines", "", "| backend | prefix caching | ok | init s | notes |", "|---|---|---|---|---|"]
    for r in eng:
        note = r.get("error") or ""
        if r.get("jit_events"):
            note = f"vLLM JIT monitor after warm-up: {len(r['jit_events'])} event(s), first: {r['jit_events'][0]}; " + note
        if "qla" in r:
            q = r["qla"]
            note = (f"qla prefill calls {q.get('prefill_calls')}, decode calls {q.get('decode_calls')} "
                    f"(measured {q.get('measured_prefill_calls')}/{q.get('measured_decode_calls')}), "
                    f"prefill configs built {q.get('prefill_compiles_before')}->{q.get('prefill_compiles_after')}, "
                    f"decode kernels {q.get('decode_kernels_before')}->{q.get('decode_kernels_after')}, "
                    f"fallback warnings {len(q.get('fallback_warnings', []))}; " + note)
        init = f"{r['init_s']:.1f}" if r.get("init_s") is not None else "–"
        lines.append(f"| {r['impl']} | {r['mode']} | {r['ok']} | {init} | {note} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- engine arguments


def llm_kwargs(model_dir: str, backend: str, prefix_caching: bool, *, enforce_eager: bool, seed: int,
               max_model_len: int, gpu_memory_utilization: float = 0.85, kv_cache_gib: float = 0,
               max_num_seqs: int = 0) -> dict:
    """The ``vllm.LLM`` / ``EngineArgs`` keyword arguments of one run.

    ``gdn_prefill_backend`` is vLLM's own engine field (what ``--gdn-prefill-backend`` and the
    plugin's ``--linear-attn-backend`` write); ``create_engine_config`` copies it into
    ``additional_config["gdn_prefill_backend"]``, where vLLM and the plugin read it.
    ``kv_cache_gib`` > 0 fixes the cache size (``kv_cache_memory_bytes``): vLLM then skips its
    free-memory profiling, which asserts when another engine on the same GPU frees memory
    meanwhile (engines started side by side, ``--parallel``). ``max_num_seqs`` > 0 caps the
    batch (vLLM's default on an H100 is 1024 sequences; the harness never has more than
    ``--num-prompts`` / ``--tp-prompts`` in flight).
    """
    kwargs = {
        "model": model_dir, "load_format": "dummy", "skip_tokenizer_init": True, "language_model_only": True,
        "dtype": "bfloat16", "seed": seed, "enforce_eager": enforce_eager, "enable_prefix_caching": prefix_caching,
        "max_model_len": max_model_len, "gdn_prefill_backend": backend,
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    if kv_cache_gib > 0:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if max_num_seqs > 0:
        kwargs["max_num_seqs"] = max_num_seqs
    return kwargs


def select_cpu_platform() -> None:
    """On a machine without a GPU, make vLLM resolve its CPU platform (dry run; tests/vllm).

    The CUDA build of vLLM finds no platform without a GPU; vLLM's seam for choosing one is a
    ``vllm.platform_plugins`` entry point. This writes one into a private metadata directory on
    ``sys.path`` before vLLM resolves its platform. Nothing is installed. Does nothing when a
    GPU is present or vLLM's platform is already resolved (a test process that chose it).
    """
    import torch

    if torch.cuda.is_available():
        return
    platforms = sys.modules.get("vllm.platforms")
    if platforms is not None and getattr(platforms, "_current_platform", None) is not None:
        return
    root = tempfile.mkdtemp(prefix="qla_vllm_offline_platform_")
    info = os.path.join(root, "qla_vllm_offline_cpu-0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: qla-vllm-offline-cpu\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.platform_plugins]\nqla_offline_cpu = qla_vllm_offline_platform:cpu_platform\n")
    with open(os.path.join(root, "qla_vllm_offline_platform.py"), "w") as f:
        f.write("def cpu_platform():\n    return 'vllm.platforms.cpu.CpuPlatform'\n")
    sys.path.insert(0, root)


def check_engine_config(kwargs: dict):
    """vLLM's ``EngineArgs(**kwargs).create_engine_config()`` (its config machinery, no engine).

    Returns the ``VllmConfig``; raises whatever vLLM raises for a config it does not accept.
    """
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**kwargs).create_engine_config()


def plugin_config_reason(vllm_config) -> str | None:
    """Why qla-serving's kernels could not run the GDN layers of ``vllm_config``'s model (the
    model-side limits only: head dims and activation dtype; the device is checked on the GPU)."""
    from qla_serving.backend import config_unsupported_reason

    text = vllm_config.model_config.hf_text_config
    return config_unsupported_reason(text.linear_key_head_dim, text.linear_value_head_dim,
                                     vllm_config.model_config.dtype)


# ----------------------------------------------------------------------------- the worker


class _WarningLog(logging.Handler):
    """Collects warnings of the plugin's and the ops' loggers (a fallback is one)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "fall" in msg.lower() or "reference" in msg.lower() or "cannot run" in msg.lower():
            self.messages.append(msg)


def _count_ops(counts: dict) -> None:
    """Wrap the two ops the plugin's layer calls (``qla_serving.<op>``, looked up at call time)."""
    import qla_serving

    for key, name in (("prefill_calls", "chunk_gated_delta_rule_pool"), ("decode_calls", "gated_delta_rule_decode")):
        inner = getattr(qla_serving, name)

        def counted(*a, _inner=inner, _key=key, **kw):
            counts[_key] += 1
            return _inner(*a, **kw)

        setattr(qla_serving, name, counted)


def _kernel_counters() -> dict:
    from qla_serving.kernels import chunk_prefill, decode

    return {"prefill": chunk_prefill.compile_count(), "decode": decode.compiled_kernels()}


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    import torch
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


class _JitMonitorLog(logging.Handler):
    """Collects vLLM's own JIT-monitor warnings (a kernel compiled or autotuned after vLLM's
    warm-up; the monitor exists from vLLM 0.26). Informative for every backend."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage()[:300])


def worker(spec: dict) -> int:
    """One engine in this process: build it, re-draw the GDN gates, say ready, wait for go, then
    throughput cold and warm (where ``spec["throughput"]``), agreement; writes ``spec["out"]``."""
    backend, pc = spec["backend"], spec["prefix_caching"]
    is_qla = backend == QLA_BACKEND
    result: dict = {"backend": backend, "prefix_caching": pc, "ok": False}
    out = pathlib.Path(spec["out"])
    counts = {"prefill_calls": 0, "decode_calls": 0}
    warnings = _WarningLog()
    for name in ("vllm.qla_serving", "qla_serving"):
        logging.getLogger(name).addHandler(warnings)
    jit = _JitMonitorLog()
    logging.getLogger("vllm.utils.jit_monitor").addHandler(jit)
    try:
        if is_qla:
            _count_ops(counts)
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(**spec["llm_kwargs"])
        result["init_s"] = time.perf_counter() - t0
        if spec.get("init_gates", True):
            result["gdn_layers_gated"] = sum(llm.apply_model(_gates().init_gdn_gates))
            if result["gdn_layers_gated"] <= 0:
                raise RuntimeError("no GDN layer (A_log, dt_bias) found to re-draw the gates of")
        if is_qla:
            before = _kernel_counters()
            calls_before = dict(counts)
        jit_at_ready = len(jit.messages)
        signal_ready(spec)
        result["wait_s"] = wait_for_go(spec)
        print(f"[{run_label(backend, pc)}] engine ready after {result['init_s']:.1f} s, measuring", flush=True)
        t_measure = time.perf_counter()
        tp = spec.get("throughput")
        result["throughput"] = {}
        for phase, prompts in (tp or {}).items():
            _, s = _generate(llm, prompts, 1)
            result["throughput"][phase] = {"tokens": sum(map(len, prompts)), "s": s, "prompts": len(prompts),
                                           "prompt_len": len(prompts[0])}
            print(f"[{run_label(backend, pc)}] throughput {phase}: {result['throughput'][phase]['tokens'] / s:.0f} tok/s",
                  flush=True)
        result["agreement"] = {}
        for k in range(spec["agreement_passes"]):
            toks, s = _generate(llm, spec["agreement_prompts"], spec["max_tokens"])
            result["agreement"][f"pass{k + 1}"] = toks
            print(f"[{run_label(backend, pc)}] agreement pass {k + 1}: {s:.2f} s", flush=True)
        result["measure_s"] = time.perf_counter() - t_measure
        result["jit_events"] = jit.messages[jit_at_ready:][:20]
        result["ok"] = True
        if is_qla:
            after = _kernel_counters()
            q = {
                "prefill_calls": counts["prefill_calls"], "decode_calls": counts["decode_calls"],
                "measured_prefill_calls": counts["prefill_calls"] - calls_before["prefill_calls"],
                "measured_decode_calls": counts["decode_calls"] - calls_before["decode_calls"],
                "prefill_compiles_before": before["prefill"], "prefill_compiles_after": after["prefill"],
                "decode_kernels_before": before["decode"], "decode_kernels_after": after["decode"],
                "fallback_warnings": warnings.messages, "strict": os.environ.get("QLA_STRICT"),
            }
            result["qla"] = q
            problems = qla_problems(q)
            if problems:
                result["ok"] = False
                result["error"] = "flashqla check failed: " + "; ".join(problems)
    except BaseException as e:  # noqa: BLE001 - recorded, then the exit status says it failed
        result["error"] = f"{type(e).__name__}: {e}"
        import traceback

        traceback.print_exc()
    out.write_text(json.dumps(result) + "\n")
    print(f"[{run_label(backend, pc)}] {'ok' if result['ok'] else 'FAILED: ' + result.get('error', '')}", flush=True)
    if result["ok"]:
        return 0
    return EXIT_QLA_CHECK if "flashqla check failed" in result.get("error", "") else 1


def qla_problems(q: dict) -> list[str]:
    """Why a flashqla run does not show the kernels serving (empty when it does)."""
    problems = []
    if q["measured_prefill_calls"] <= 0:
        problems.append("the prefill op never ran during the measured runs")
    if q["decode_calls"] <= 0:
        problems.append("the decode op never ran (not even at CUDA-graph capture)")
    if q["prefill_compiles_after"] <= 0 and q["decode_kernels_after"] <= 0:
        problems.append("no kernel was ever built or loaded")
    if q["prefill_compiles_after"] != q["prefill_compiles_before"]:
        problems.append(f"prefill kernels compiled while serving ({q['prefill_compiles_before']} -> "
                        f"{q['prefill_compiles_after']})")
    if q["decode_kernels_after"] != q["decode_kernels_before"]:
        problems.append(f"decode kernels compiled while serving ({q['decode_kernels_before']} -> "
                        f"{q['decode_kernels_after']})")
    if q["fallback_warnings"]:
        problems.append(f"fallback logged: {q['fallback_warnings'][0]}")
    return problems


# ----------------------------------------------------------------------------- the schedule


def ordered_runs(backends, modes) -> list[tuple[str, str]]:
    """``(backend, prefix caching)`` in the order the runs start: every backend without prefix
    caching first, the reference backend first of all; then every backend with prefix caching,
    the reference backend last (its prefix-cached run is the least needed: the acceptance
    compares the others with the reference's run without the cache). A command cut short by
    its budget has then done the runs that matter most."""
    ref_first = sorted(backends, key=lambda b: b != REFERENCE[0])  # stable: the rest keep their order
    ref_last = sorted(backends, key=lambda b: b == REFERENCE[0])
    return [(b, pc) for pc in modes for b in (ref_first if pc == REFERENCE[1] else ref_last)]


# ----------------------------------------------------------------------------- the parent


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), help="GDN prefill backends (default: %(default)s)")
    p.add_argument("--prefix-caching", choices=("off", "on", "both"), default="both")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")
    p.add_argument("--out-dir", default=None, help="results folder (default e2e_bench/results)")
    p.add_argument("--tag", default="", help="appended to the results' file names (a second run of the same day)")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "qla-vllm-offline"),
                   help="model config and raw per-run results (default: %(default)s)")
    p.add_argument("--reuse", action="store_true", help="skip runs whose raw result in --work-dir is ok")
    p.add_argument("--aggregate-only", action="store_true", help="run nothing; aggregate the raw results")
    p.add_argument("--dry-run", action="store_true", help="no GPU: config check, prompts, synthetic aggregation")
    add_prompt_args(p)
    p.add_argument("--tp-prompts", type=int, default=16)
    p.add_argument("--tp-len", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--linear-v-heads", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="per engine; with --parallel N at most 0.9/N is used (default: %(default)s)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="fixed KV-cache size per engine (vLLM's kv_cache_memory_bytes; skips its memory "
                        "profiling); default: 8 with --parallel > 1, else vLLM sizes it")
    p.add_argument("--max-num-seqs", type=int, default=32,
                   help="vLLM's max_num_seqs (0: vLLM's default, 1024 on an H100) (default: %(default)s)")
    p.add_argument("--parallel", type=int, default=1,
                   help="engines built side by side (one wave); measurements still run one at a time "
                        "(default: %(default)s)")
    p.add_argument("--throughput-pc", choices=("off", "on", "both"), default="off",
                   help="the prefix-caching setting(s) whose runs also measure throughput (default: %(default)s)")
    p.add_argument("--dummy-gates", action="store_true",
                   help="keep vLLM's dummy A_log/dt_bias (every head forgets within ~10 tokens) instead of "
                        "re-drawing them (see init_gdn_gates)")
    p.add_argument("--timeout", type=int, default=300,
                   help="seconds a worker may take to build its engine, and again to measure (default: %(default)s)")
    p.add_argument("--budget", type=int, default=0,
                   help="seconds this command may take (0: no limit); a run that cannot get 120 s is left "
                        "for a later command with --reuse, and the results written cover the runs done")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _pc_modes(arg: str) -> list[str]:
    return ["off", "on"] if arg == "both" else [arg]


def _shape(args) -> dict:
    return {"num_layers": args.layers, "linear_v_heads": args.linear_v_heads, "hidden": args.hidden, "vocab": args.vocab,
                "max_positions": max(16384, args.tp_len + 512)}


def _memory_settings(args) -> dict:
    """``llm_kwargs``'s memory arguments: with engines side by side each takes a share of the
    GPU and a fixed KV cache (vLLM's profiling would see the others' memory come and go)."""
    parallel = max(1, args.parallel)
    kv = args.kv_cache_gib if args.kv_cache_gib is not None else (8.0 if parallel > 1 else 0)
    util = args.gpu_memory_utilization if parallel == 1 else min(args.gpu_memory_utilization, 0.9 / parallel)
    return {"gpu_memory_utilization": round(util, 3), "kv_cache_gib": kv, "max_num_seqs": args.max_num_seqs}


def _max_model_len(args) -> int:
    return max(args.tp_len, args.max_len) + args.max_tokens + 64


def _meta(args, argv, gpu: str | None) -> dict:
    from qla_serving.bench.common import library_versions

    cfg = model_config(**_shape(args))["text_config"]
    meta = {
        "gpu": gpu or "none (dry run)",
        "versions": library_versions(),
        "command": " ".join(shlex.quote(a) for a in ["python", "e2e_bench/vllm_offline.py", *argv]),
        "date": _dt.date.today().isoformat(),
        "model": {
            "summary": (f"Qwen3.5-shaped, {cfg['num_hidden_layers']} layers ({cfg['layer_types'].count('linear_attention')} GDN), "
                        f"GDN {cfg['linear_num_key_heads']} q/k x {cfg['linear_num_value_heads']} v heads of 128, "
                        f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}, dummy weights, bf16"),
            "config": cfg,
        },
        "settings": {"enforce_eager": args.enforce_eager, "seed": args.seed, "num_prompts": args.num_prompts,
                     "prompt_lens": [args.min_len, args.max_len], "max_tokens": args.max_tokens,
                     "throughput": [args.tp_prompts, args.tp_len], "throughput_pc": args.throughput_pc,
                     "max_model_len": _max_model_len(args), "parallel": args.parallel, **_memory_settings(args),
                     "gdn_gates": ("vLLM dummy (decay ~0.5 per token)" if args.dummy_gates else
                                   f"re-drawn: A ~ U{_gates().GATE_A_RANGE}, softplus(dt_bias) ~ log-U{_gates().GATE_DT_RANGE}")},
    }
    if gpu:
        try:
            import torch

            props = torch.cuda.get_device_properties(0)
            meta["sm_count"] = props.multi_processor_count
        except Exception as e:  # noqa: BLE001 - metadata only
            meta["sm_count"] = f"unknown ({e})"
    return meta


def write_outputs(out_dir: str | os.PathLike, meta: dict, rows: list[dict], tokens: dict, tag: str = "") -> pathlib.Path:
    """``<date>-<gpu>-vllm-offline[-<tag>].json`` (+ ``.md``, + ``-tokens.json``) under ``out_dir``."""
    slug = re.sub(r"[^a-z0-9]+", "-", meta["gpu"].lower()).strip("-")
    suffix = re.sub(r"[^a-z0-9]+", "-", tag.lower()).strip("-")
    directory = pathlib.Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{meta['date']}-{slug}-vllm-offline{'-' + suffix if suffix else ''}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(meta, rows))
    path.with_name(path.stem + "-tokens.json").write_text(json.dumps(tokens) + "\n")
    return path


def _synthetic_results(backends, modes, prompts, max_tokens, tp, tp_modes=("off", "on")) -> list[dict]:
    """Made-up worker results for the dry run: the reference agrees with itself, the others
    diverge at a known position on some prompts."""
    rng = random.Random(1)
    ref = [[rng.randrange(1000) for _ in range(max_tokens)] for _ in prompts]
    results = []
    for bi, b in enumerate(backends):
        for pc in modes:
            passes = {}
            for k in range(2 if pc == "on" else 1):
                outs = [list(r) for r in ref]
                if (b, pc) != REFERENCE:
                    outs[bi % len(outs)][max_tokens // 2] += 1  # one divergence at max_tokens // 2
                passes[f"pass{k + 1}"] = outs
            results.append({"backend": b, "prefix_caching": pc, "ok": True, "init_s": 0.0, "agreement": passes,
                            "throughput": {ph: {"tokens": tp[0] * tp[1], "s": 1.0 + bi, "prompts": tp[0],
                                                "prompt_len": tp[1]} for ph in ("cold", "warm")} if pc in tp_modes
                            else {}})
    return results


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(pathlib.Path(args.worker).read_text()))

    out_dir = args.out_dir or str(pathlib.Path(__file__).resolve().parent / "results")
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = write_model(work / "model", **_shape(args))
    modes = _pc_modes(args.prefix_caching)
    runs = ordered_runs(args.backends, modes)
    prompts = agreement_prompts(args.num_prompts, args.min_len, args.max_len, args.vocab, args.seed)
    tp = {"cold": throughput_prompts(args.tp_prompts, args.tp_len, args.vocab, args.seed + 1),
          "warm": throughput_prompts(args.tp_prompts, args.tp_len, args.vocab, args.seed + 2)}

    def kwargs_of(backend, pc):
        return llm_kwargs(model_dir, backend, pc == "on", enforce_eager=args.enforce_eager, seed=args.seed,
                          max_model_len=_max_model_len(args), **_memory_settings(args))

    if args.dry_run:
        select_cpu_platform()
        checked = {}
        for b, pc in runs:
            cfg = check_engine_config(kwargs_of(b, pc))
            checked[run_label(b, pc)] = {
                "gdn_prefill_backend": cfg.additional_config.get("gdn_prefill_backend"),
                "architecture": cfg.model_config.architecture,
                "prefix_caching": cfg.cache_config.enable_prefix_caching,
                "mamba_cache_mode": str(getattr(cfg.cache_config, "mamba_cache_mode", None)),
                "state_dtype": str(cfg.cache_config.mamba_ssm_cache_dtype),
                "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
                "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            }
            print(f"[dry-run] {run_label(b, pc)}: vLLM accepts the config: {checked[run_label(b, pc)]}")
            if b == QLA_BACKEND:
                reason = plugin_config_reason(cfg)
                if reason is not None:
                    raise SystemExit(f"[dry-run] the plugin would not run this model's GDN layers: {reason}")
        results = _synthetic_results(args.backends, modes, prompts, args.max_tokens, (args.tp_prompts, args.tp_len),
                                     _pc_modes(args.throughput_pc))
        meta = _meta(args, argv, None)
        meta["dry_run"] = {"engine_configs": checked,
                           "prompt_lens": [len(p) for p in prompts]}
        rows = aggregate(results)
        path = write_outputs(out_dir, meta, rows, {run_label(r["backend"], r["prefix_caching"]): r["agreement"]
                                                   for r in results}, tag=args.tag)
        print(f"[dry-run] wrote {path} (synthetic outputs)")
        return 0

    failed = []
    if not args.aggregate_only:
        deadline = time.monotonic() + args.budget - 20 if args.budget else None  # 20 s kept for the results
        jobs = []
        for b, pc in runs:
            label = run_label(b, pc)
            raw = work / f"{label}.json"
            if args.reuse and raw.exists() and json.loads(raw.read_text()).get("ok"):
                print(f"[{label}] reusing {raw}")
                continue
            raw.unlink(missing_ok=True)
            spec = {"backend": b, "prefix_caching": pc, "out": str(raw), "llm_kwargs": kwargs_of(b, pc),
                    "agreement_prompts": prompts, "max_tokens": args.max_tokens,
                    "throughput": tp if pc in _pc_modes(args.throughput_pc) else None,
                    # With prefix caching a second pass runs the same prompts from the cache.
                    "agreement_passes": 2 if pc == "on" else 1,
                    "init_gates": not args.dummy_gates,
                    "ready_file": str(work / f"{label}.ready"), "go_file": str(work / f"{label}.go")}
            spec_path = work / f"{label}-spec.json"
            spec_path.write_text(json.dumps(spec))
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1",
                       # Engines started side by side look for their torch.distributed port from
                       # distinct starts instead of racing for the same free one.
                       VLLM_PORT=str(31000 + 100 * len(jobs)))
            if b == QLA_BACKEND:
                env["QLA_STRICT"] = "1"
            jobs.append({"label": label, "cmd": [sys.executable, os.path.abspath(__file__), "--worker", str(spec_path)],
                         "env": env, "ready_file": spec["ready_file"], "go_file": spec["go_file"],
                         "log": str(work / f"{label}.log")})
        status = run_waves(jobs, args.parallel, init_timeout=args.timeout, measure_timeout=args.timeout,
                           deadline=deadline, log=lambda m: print(m, flush=True))
        for job in jobs:
            st, log_path = status.get(job["label"], {}), pathlib.Path(job["log"])
            if st.get("rc") not in (0, None) and log_path.exists():
                tail = log_path.read_text(errors="replace").splitlines()[-40:]
                print(f"[{job['label']}] exit {st['rc']}; the end of its output:\n  " + "\n  ".join(tail), flush=True)
        for (b, pc), label in ((r, run_label(*r)) for r in runs):
            st, raw = status.get(label), work / f"{label}.json"
            if st is None or st["status"] == "not-started" or raw.exists():
                continue
            error = (f"timed out ({st['status']}) after {st['s']:.0f} s" if st["rc"] == 124
                     else f"worker exited {st['rc']} without a result")
            raw.write_text(json.dumps({"backend": b, "prefix_caching": pc, "ok": False, "error": error}) + "\n")

    results = []
    for b, pc in runs:
        raw = work / f"{run_label(b, pc)}.json"
        if raw.exists():
            r = json.loads(raw.read_text())
            results.append(r)
            if not r.get("ok"):
                failed.append(f"{run_label(b, pc)}: {r.get('error')}")
        else:
            failed.append(f"{run_label(b, pc)}: no result in {work}")
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown-gpu"
    meta = _meta(args, argv, gpu)
    rows = aggregate(results)
    path = write_outputs(out_dir, meta, rows, {run_label(r["backend"], r["prefix_caching"]): r.get("agreement")
                                               for r in results}, tag=args.tag)
    worker_logs = [(label, work / f"{label}.log") for label in (run_label(*r) for r in runs)]
    with open(path.with_name(path.stem + "-workers.log"), "w") as f:  # every engine's output, one after another
        for label, log_path in worker_logs:
            if log_path.exists():
                f.write(f"===== {label} =====\n{log_path.read_text(errors='replace')}\n")
    print(path.with_suffix(".md").read_text())
    print(f"wrote {path} (+ .md, -tokens.json, -workers.log)")
    if failed:
        print("FAILED runs:\n  " + "\n  ".join(failed), file=sys.stderr)
        qla_failed = any(f.startswith(QLA_BACKEND) and "flashqla check failed" in f for f in failed)
        return EXIT_QLA_CHECK if qla_failed else 1
    return 0


if __name__ == "__main__":
    exit_status = main()
    if "--worker" in sys.argv:
        # The result file is written: leave without vLLM's exit handlers, which can hang an
        # in-process engine's shutdown and would spend the command's time limit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_status)
    sys.exit(exit_status)
