"""GPU acceptance run of the SGLang plugin: offline ``sglang.Engine`` on a tiny Qwen3.5-shaped model.

For each GDN backend (``triton``, ``flashinfer``, ``flashqla``, SGLang's ``--linear-attn-backend``)
a fresh subprocess builds ``sglang.Engine`` on a text-only Qwen3.5 config
(``Qwen3_5ForCausalLM``: the layer layout and GDN head shapes of ``e2e_bench/offline_inputs.py``'s
model, without the vision tower and M-RoPE), dummy weights, token-id prompts and no tokenizer;
full attention on SGLang's ``triton`` backend (sgl-kernel's FA3 library is not carried to the GPU
machine). After start-up the GDN gates are re-drawn through SGLang's own
``Engine.update_weights_from_tensor`` (``load_format="direct"``: by exact parameter name), since
the dummy loader's A_log ~ dt_bias ~ 0 would make every head forget within ~10 tokens (see
``qla_serving.bench.gates``). Then:

* pass ``cold``: ``--num-prompts`` prompts of ``--min-len``..``--max-len`` tokens x
  ``--max-tokens`` greedy tokens; with the radix cache on (default), pass ``cached`` runs the
  same prompts again from SGLang's mamba radix cache;
* agreement with the reference (``triton``, pass ``cold``): per run and pass, the sum over
  prompts of the tokens generated before the first token that differs.

The acceptance check (exit 4 when it fails): every ``flashqla`` pass agrees with triton at least
as far as ``flashinfer``'s cold pass does; exit 5 when flashinfer did not run (no bar: its error
and flashqla's agreement are reported). ``flashqla`` runs with ``QLA_STRICT=1`` (any fallback raises) and must log the
adapter's binding of ``FlashQLAGDNKernel`` for prefill and decode (exit 3 otherwise).

Results: ``<date>-<gpu>-sglang-offline.json`` (``{"meta", "rows"}``), a markdown table beside it,
the generated ids (``-tokens.json``) and the end of each engine's log (``sglang-engines.log``) under
``--out-dir``; whole logs and per-run results in ``--work-dir`` (``--reuse`` keeps its successful
runs, so the backends can be split over several commands).

    python e2e_bench/sglang_offline.py --out-dir "$OUT"           # on an H100/H200, bundles loaded
    python e2e_bench/sglang_offline.py --dry-run --out-dir /tmp/x # anywhere SGLang imports: config only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import zlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from agreement import agreement  # noqa: E402
from offline_inputs import add_prompt_args, agreement_prompts, model_config  # noqa: E402

BACKENDS = ("triton", "flashinfer", "flashqla")
REFERENCE = "triton"
EXIT_QLA_CHECK, EXIT_AGREEMENT, EXIT_INCOMPLETE = 3, 4, 5
# patch.py logs this line when the dispatcher is built with our kernel in a phase
QLA_BINDING = re.compile(
    r"qla-serving: GDN kernel dispatcher uses FlashQLAGDNKernel for ([\w, ]+) \(decode=(\w+), extend=(\w+)"
)


def text_model_config(**shape) -> dict:
    """``config.json`` of a text-only Qwen3.5 model with ``offline_inputs.model_config``'s shapes.

    SGLang maps ``qwen3_5_text`` to its ``Qwen3_5TextConfig`` (a ``Qwen3NextConfig``, so the
    model gets the hybrid GDN backend and the mamba state pool). Plain RoPE (partial 0.25) instead
    of M-RoPE: a text-only model gets no M-RoPE positions.
    """
    text = dict(model_config(**shape)["text_config"])
    # Plain RoPE parameters in place of the M-RoPE ones: SGLang's Qwen3_5TextConfig reads
    # rope_theta from rope_parameters (an empty dict there is a KeyError at model build).
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    text["rope_parameters"] = rope
    # SGLang's Qwen3NextConfig lays the layers out from full_attention_interval (as Qwen3-Next
    # and Qwen3.5 checkpoints write it), not from layer_types: give it the period of ours.
    full = [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    interval = full[0] + 1
    if [i for i in range(len(text["layer_types"])) if (i + 1) % interval == 0] != full:
        raise ValueError(f"layer_types {text['layer_types']} is not one full-attention layer every k")
    text["full_attention_interval"] = interval
    text.update(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        torch_dtype="bfloat16",
    )
    return text


def gdn_layer_ids(config: dict) -> list[int]:
    return [i for i, t in enumerate(config["layer_types"]) if t == "linear_attention"]


def gate_tensors(config: dict) -> list:
    """``[(checkpoint name, float32 CPU tensor)]``: A_log and dt_bias of every GDN layer, drawn as
    ``qla_serving.bench.gates.gdn_gate_values`` does (seeded by the layer's module name, so every backend's
    engine gets the same gates)."""
    from qla_serving.bench.gates import gdn_gate_values

    out = []
    for i in gdn_layer_ids(config):
        module = f"model.layers.{i}.linear_attn"
        A_log, dt_bias = gdn_gate_values(config["linear_num_value_heads"], zlib.crc32(module.encode()))
        out += [(f"{module}.A_log", A_log), (f"{module}.dt_bias", dt_bias)]
    return out


def engine_kwargs(
    model_dir: str,
    backend: str,
    *,
    prefix_caching: bool,
    cuda_graph: bool,
    seed: int,
    context_length: int,
    mem_fraction: float,
    device: str | None = None,
) -> dict:
    """``sglang.Engine`` / ``ServerArgs`` keyword arguments of one run."""
    kwargs = {
        "model_path": model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "attention_backend": "triton",
        "linear_attn_backend": backend,
        "mamba_ssm_dtype": "float32",
        "random_seed": seed,
        "disable_cuda_graph": not cuda_graph,
        "disable_radix_cache": not prefix_caching,
        "context_length": context_length,
        "mem_fraction_static": mem_fraction,
        "log_level": "info",
        # SGLang 0.5.17 builds a mamba radix cache for this model (its config is a Qwen3NextConfig)
        # but resolves the cache strategy only for the architectures it lists, which leave out
        # the text-only Qwen3_5ForCausalLM: set what it resolves for Qwen3-Next without paging.
        "disable_overlap_schedule": True,
    }
    if prefix_caching:
        kwargs["mamba_radix_cache_strategy"] = "no_buffer"
    if device is not None:
        kwargs["device"] = device
    return kwargs


def run_engine_kwargs(args, model_dir: str, backend: str, device: str | None = None) -> dict:
    """:func:`engine_kwargs` of one run, from this command's arguments (dry run and GPU run alike)."""
    return engine_kwargs(
        model_dir,
        backend,
        prefix_caching=args.prefix_caching == "on",
        cuda_graph=args.cuda_graph,
        seed=args.seed,
        context_length=args.context_length,
        mem_fraction=args.mem_fraction,
        device=device,
    )


# ----------------------------------------------------------------------------- the worker


def worker(spec: dict) -> dict:
    """One engine: start, re-draw the gates, run the passes. Runs in a fresh subprocess."""
    result = {"backend": spec["backend"], "ok": False}
    t0 = time.perf_counter()
    import sglang

    engine = sglang.Engine(**spec["engine"])
    try:
        result["init_s"] = round(time.perf_counter() - t0, 1)
        config = json.loads(pathlib.Path(spec["engine"]["model_path"], "config.json").read_text())
        # "direct": by exact parameter name (a name the model lacks is an error, not a skip)
        answer = engine.update_weights_from_tensor(gate_tensors(config), load_format="direct")
        if isinstance(answer, tuple) and answer and answer[0] is False:
            raise RuntimeError(f"SGLang refused the gate update: {answer}")
        result["gdn_layers_gated"] = len(gdn_layer_ids(config))
        params = {"temperature": 0.0, "max_new_tokens": spec["max_tokens"], "ignore_eos": True}
        result["passes"] = {}
        t1 = time.perf_counter()
        for name in spec["passes"]:
            outs = engine.generate(input_ids=spec["prompts"], sampling_params=params)
            result["passes"][name] = [list(o["output_ids"]) for o in outs]
        result["measure_s"] = round(time.perf_counter() - t1, 2)
        result["ok"] = True
    finally:
        engine.shutdown()
    return result


# ----------------------------------------------------------------------------- the parent


def rows_from(results: list[dict]) -> list[dict]:
    ref_run = next((r for r in results if r["backend"] == REFERENCE and r.get("passes")), None)
    ref = ref_run["passes"]["cold"] if ref_run else None
    rows = []
    for r in results:
        rows.append(
            {
                "op": "sglang-engine",
                "impl": r["backend"],
                "ok": r.get("ok", False),
                "init_s": r.get("init_s"),
                "measure_s": r.get("measure_s"),
                "qla_binding": r.get("qla_binding"),
                "error": r.get("error"),
            }
        )
        for name, outs in (r.get("passes") or {}).items():
            row = {"op": "sglang-agreement", "impl": r["backend"], "pass": name}
            row.update(agreement(ref, outs) if ref else {"error": f"no reference run ({REFERENCE})"})
            rows.append(row)
    return rows


def verdict(rows: list[dict]) -> tuple[int, str]:
    """(exit status, sentence): flashqla agrees with triton at least as far as flashinfer does."""
    eng = {r["impl"]: r for r in rows if r["op"] == "sglang-engine"}
    agree = {(r["impl"], r["pass"]): r for r in rows if r["op"] == "sglang-agreement" and "error" not in r}
    q = eng.get("flashqla")
    if q is None:
        return 0, "flashqla not run"
    binding = q.get("qla_binding") or ""
    if not q["ok"] or "decode=FlashQLAGDNKernel" not in binding or "extend=FlashQLAGDNKernel" not in binding:
        return (
            EXIT_QLA_CHECK,
            f"flashqla did not run on our kernels: {q.get('error') or binding or 'no binding logged'}",
        )
    fi = agree.get(("flashinfer", "cold"))
    qla = [r for (impl, _), r in agree.items() if impl == "flashqla"]
    if not qla:
        return EXIT_AGREEMENT, "no flashqla agreement (reference missing?)"
    worst = min(r["agree_tokens"] for r in qla)
    if fi is None:
        why = (eng.get("flashinfer") or {}).get("error") or "not run"
        return EXIT_INCOMPLETE, (
            f"flashqla worst pass {worst} of {qla[0]['total_tokens']} agreeing tokens; no flashinfer bar ({why})"
        )
    ok = worst >= fi["agree_tokens"]
    return (0 if ok else EXIT_AGREEMENT), (
        f"flashqla worst pass {worst} agreeing tokens vs flashinfer's {fi['agree_tokens']} "
        f"(of {fi['total_tokens']}): {'PASS' if ok else 'FAIL'}"
    )


def markdown(meta: dict, rows: list[dict], sentence: str) -> str:
    lines = [
        f"# SGLang offline acceptance ({meta['date']})",
        "",
        f"- GPU: {meta.get('gpu')}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta.get('versions', {}).items())}",
        f"- model: {meta['model']}",
        f"- command: `{meta['command']}`",
        f"- reference: {REFERENCE}, pass cold; agreement = tokens before the first divergence, summed over prompts",
        f"- verdict: {sentence}",
        "",
        "| backend | pass | agree tokens | of | fraction | exact prompts |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["op"] == "sglang-agreement" and "error" not in r:
            lines.append(
                f"| {r['impl']} | {r['pass']} | {r['agree_tokens']} | {r['total_tokens']} | "
                f"{r['agree_frac']:.3f} | {r['exact_prompts']}/{r['prompts']} |"
            )
    lines += ["", "| backend | ok | init s | measure s | notes |", "|---|---|---|---|---|"]
    for r in rows:
        if r["op"] == "sglang-engine":
            note = (f"binding: {r['qla_binding']}; " if r.get("qla_binding") else "") + (r.get("error") or "")
            lines.append(f"| {r['impl']} | {r['ok']} | {r.get('init_s')} | {r.get('measure_s')} | {note} |")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in (
        "sglang",
        "sglang-kernel",
        "torch",
        "triton",
        "tilelang",
        "flashinfer-python",
        "transformers",
    ):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def dry_run(args, model_dir: str, prompts) -> int:
    """SGLang's own ServerArgs and ModelConfig accept every run's arguments; the model is a
    hybrid GDN model whose heads our kernels take; the gate names exist in the model's layout."""
    import qla_serving.integrations.sglang as plugin
    from sglang.srt.configs import hybrid_arch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    from qla_serving.backend import config_unsupported_reason

    plugin.register()  # `flashqla` becomes a valid --linear-attn-backend, as SGLang's loader does
    for backend in args.backends:
        server_args = ServerArgs(**run_engine_kwargs(args, model_dir, backend, device="cpu"))
        resolved = ModelConfig.from_server_args(server_args)
        text = hybrid_arch.hybrid_gdn_config(resolved)
        if text is None:
            raise SystemExit(f"{backend}: SGLang does not see a hybrid GDN model in {model_dir}")
        reason = config_unsupported_reason(
            text.linear_key_head_dim, text.linear_value_head_dim, resolved.dtype
        )
        if reason:
            raise SystemExit(f"{backend}: our kernels would not run this model: {reason}")
        # The layer layout the model code builds (a config property; the 0.5.17 engine run
        # failed here on the GPU while the dry run passed).
        built = [t == "linear_attention" for t in text.layers_block_type]
        wanted = [t == "linear_attention" for t in json.loads(pathlib.Path(model_dir, "config.json").read_text())["layer_types"]]
        if built != wanted:
            raise SystemExit(f"{backend}: SGLang puts GDN layers at {built}, the config at {wanted}")
        print(
            f"dry-run {backend}: {resolved.hf_config.architectures[0]} ({type(text).__name__}), "
            f"linear_attn_backend={server_args.linear_attn_backend}, attention_backend={server_args.attention_backend}, "
            f"radix cache {'off' if server_args.disable_radix_cache else server_args.mamba_radix_cache_strategy}"
        )
    names = [n for n, _ in gate_tensors(json.loads(pathlib.Path(model_dir, "config.json").read_text()))]
    print(
        f"dry-run: {len(prompts)} prompts, {sum(map(len, prompts))} tokens; gates {names[0]} .. {names[-1]}"
    )
    fake = [
        {"backend": b, "ok": True, "passes": {"cold": [[1] * args.max_tokens for _ in prompts]}}
        for b in args.backends
    ]
    fake[0]["passes"]["cold"][0][-1] = 2  # the aggregation must see a divergence
    for r in fake:
        if r["backend"] == "flashqla":
            r["qla_binding"] = "decode, prefill (decode=FlashQLAGDNKernel, extend=FlashQLAGDNKernel)"
    print("dry-run verdict on synthetic outputs:", verdict(rows_from(fake))[1])
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS), type=lambda s: [b for b in s.split(",") if b])
    add_prompt_args(p)
    p.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default="on",
        help="on: SGLang's radix cache, and a second pass of the same prompts from it",
    )
    p.add_argument("--cuda-graph", action="store_true", help="capture CUDA graphs (off: shorter start-up)")
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--timeout", type=int, default=300, help="seconds per engine run")
    p.add_argument("--out-dir", default="e2e_bench/results")
    p.add_argument("--work-dir", default="/tmp/qla-sglang-offline")
    p.add_argument(
        "--reuse", action="store_true", help="keep the successful runs of an earlier command (--work-dir)"
    )
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(pathlib.Path(args.worker).read_text())
        pathlib.Path(spec["result"]).write_text(json.dumps(worker(spec)))
        return 0
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}; choose from {BACKENDS}")
    work, out = pathlib.Path(args.work_dir), pathlib.Path(args.out_dir)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    config = text_model_config()
    model_dir = work / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    prompts = agreement_prompts(
        args.num_prompts, args.min_len, args.max_len, config["vocab_size"], args.seed
    )
    if args.dry_run:
        return dry_run(args, str(model_dir), prompts)

    results = []
    for backend in args.backends:
        done = work / f"{backend}.json"
        if args.reuse and done.exists() and json.loads(done.read_text()).get("ok"):
            print(f"== {backend}: reusing {done}", flush=True)
            results.append(json.loads(done.read_text()))
            continue
        spec = {
            "backend": backend,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "passes": ["cold", "cached"] if args.prefix_caching == "on" else ["cold"],
            "result": str(work / f"{backend}.json"),
            "engine": run_engine_kwargs(args, str(model_dir), backend),
        }
        spec_path = work / f"{backend}.spec.json"
        spec_path.write_text(json.dumps(spec))
        pathlib.Path(spec["result"]).unlink(missing_ok=True)
        env = dict(os.environ, QLA_STRICT="1" if backend == "flashqla" else os.environ.get("QLA_STRICT", "0"))
        log_path = work / f"{backend}.log"  # $OUT takes 8 files at most: the tails go to one file
        t0 = time.perf_counter()
        print(f"== {backend}: engine run (log {log_path})", flush=True)
        with open(log_path, "w") as log:
            # Own process group: a timed-out engine's scheduler and detokenizer go with it
            # instead of holding the GPU for the next backend.
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                rc = f"timeout after {args.timeout} s"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the engine left running
            proc.wait()
        text = log_path.read_text(errors="replace")
        try:
            r = json.loads(pathlib.Path(spec["result"]).read_text())
        except FileNotFoundError:
            tail = [ln for ln in text.splitlines() if ln.strip()][-3:]
            r = {"backend": backend, "ok": False, "error": f"exit {rc}: " + " / ".join(tail)[-600:]}
        m = QLA_BINDING.search(text)
        r["qla_binding"] = f"{m.group(1)} (decode={m.group(2)}, extend={m.group(3)})" if m else None
        print(
            f"   {backend}: ok={r['ok']} in {time.perf_counter() - t0:.0f}s {r.get('error') or ''}",
            flush=True,
        )
        pathlib.Path(spec["result"]).write_text(json.dumps(r))  # with the binding, for --reuse
        results.append(r)

    with open(out / "sglang-engines.log", "w") as f:
        for backend in args.backends:
            log_path = work / f"{backend}.log"
            if log_path.exists():
                lines = log_path.read_text(errors="replace").splitlines()
                f.write(f"===== {backend}: last {min(len(lines), 300)} of {len(lines)} lines of {log_path}\n")
                f.write("\n".join(lines[-300:]) + "\n")
    rows = rows_from(results)
    status, sentence = verdict(rows)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {
        "date": _dt.date.today().isoformat(),
        "gpu": gpu,
        "versions": versions(),
        "command": " ".join(sys.argv),
        "model": (
            f"Qwen3_5ForCausalLM, {config['num_hidden_layers']} layers ({len(gdn_layer_ids(config))} GDN, "
            f"{config['linear_num_key_heads']} qk / {config['linear_num_value_heads']} v heads of 128), "
            "dummy weights, gates re-drawn"
        ),
        "verdict": sentence,
    }
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")  # as the vLLM harness and the benches name it
    stem = out / f"{meta['date']}-{slug}-sglang-offline"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(markdown(meta, rows, sentence))
    pathlib.Path(f"{stem}-tokens.json").write_text(
        json.dumps({r["backend"]: r.get("passes") for r in results})
    )
    print(markdown(meta, rows, sentence))
    return status


if __name__ == "__main__":
    sys.exit(main())
