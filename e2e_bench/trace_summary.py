"""Where a serving step's GPU time goes: a summary of the engine's own torch-profiler traces.

``python -m e2e_bench.serve ... --profile chat:128`` starts each server with vLLM's torch
profiler (``--profiler-config``, a window of engine steps in the middle of that point) and this
module reads the Chrome traces it writes (``*.pt.trace.json.gz``): GPU kernel time by kernel
name, the GDN layer's share (the kernels that :data:`GDN_PATTERNS` name), kernel time per engine
step, the host time of each GDN custom-op call (``vllm::qwen_gdn_attention_core``, on the
host only where the step runs outside a full CUDA graph), and the host side of a step: vLLM's
model-runner scopes (``gpu_model_runner: preprocess`` ..., recorded with
``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, which the serving harness sets when it profiles), the
period between two steps' starts (vLLM's ``preprocess`` scope or SGLang's ``step[...]`` span),
and the CUDA runtime calls (a device-to-host sync shows there as ``cudaStreamSynchronize``,
``cudaMemcpy`` or ``cudaEventSynchronize`` time). Each kernel
belongs to the step whose host side launched it (its launch call's ``correlation``; a CUDA graph's
kernels carry their ``cudaGraphLaunch``'s), so a window of prefill and decode steps is also told
apart: steps with a GDN prefill kernel and steps without, each kind's median period, kernel time,
GDN recurrence, collectives and GPU span.

    python -m e2e_bench.trace_summary TRACE_DIR [--label flashqla] [--out summary.md]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import pathlib
import re
import statistics
import sys

# Kernels of the GDN core (conv, preparation, recurrence, layout copies around it), by backend.
GDN_PATTERNS = {
    "conv1d": re.compile(r"causal_conv1d", re.I),
    # vLLM's decode of a mixed step is fused_sigmoid_gating_delta_rule_update: decode, not prefill
    "recurrence (decode)": re.compile(r"gdn_decode|fused_recurrent|recurrent_gated_delta|packed_decode|"
                                      r"sigmoid_gating_delta_rule_update", re.I),
    "recurrence (prefill)": re.compile(r"chunk_fwd|prep_kernel|chunk_gated_delta|chunk_scaled_dot|"
                                       r"solve_tril|recompute_w_u|chunk_fwd_kernel|gdn_prefill|delta_rule|"
                                       r"chunk_local_cumsum|kkt", re.I),
    # the GDN gate kernels by name: a bare "gating" would take the MoE router's topkGating too
    "post-conv prep": re.compile(r"post_conv|l2norm|gdn_gating", re.I),
}
GDN_OP = "vllm::qwen_gdn_attention_core"
# Collective kernels (NCCL's, vLLM's and FlashInfer's all-reduce): at TP > 1 a rank whose step
# starts late holds the others inside these, so their time says which rank waits.
COMM_PATTERN = re.compile(r"nccl|all_?reduce|cross_device_reduce|allgather|reduce_?scatter", re.I)
# vLLM's model-runner scopes: one "preprocess" per engine step starts the step on the host
RUNNER_SCOPE = "gpu_model_runner: "
STEP_SCOPE = RUNNER_SCOPE + "preprocess"
# SGLang's span around each forward step ("step[EXTEND bs=1 toks=8192]", "step[DECODE bs=32]")
SGLANG_STEP = "step["
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")


def load_trace(path: pathlib.Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", data) if isinstance(data, dict) else data


def classify(name: str) -> str | None:
    for group, pat in GDN_PATTERNS.items():
        if pat.search(name):
            return group
    return None


def summarize(events: list[dict], top: int = 25) -> dict:
    kernels = collections.Counter()
    counts = collections.Counter()
    gdn = collections.Counter()
    first = last = None
    comm = 0.0
    spans = []
    host = []
    scopes = collections.Counter()
    runtime = collections.Counter()
    runtime_calls = collections.Counter()
    step_starts = []
    launched = {}  # correlation -> host time of the runtime call that launched it
    device = []  # (correlation, start, end, GDN part, collective) of each GPU event
    for e in events:  # one pass: a trace holds millions of events
        if e.get("ph") != "X":
            continue
        cat, name, dur = e.get("cat"), e.get("name", "?"), float(e.get("dur", 0.0))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[name] += dur
            counts[name] += 1
            group = classify(name)
            if group:
                gdn[group] += dur
            collective = bool(COMM_PATTERN.search(name))
            if collective:
                comm += dur
            ts = float(e.get("ts", 0.0))
            spans.append((ts, ts + dur))
            device.append(((e.get("args") or {}).get("correlation"), ts, ts + dur, group, collective))
            first = ts if first is None else min(first, ts)
            last = ts + dur if last is None else max(last, ts + dur)
        elif cat in ("cpu_op", "user_annotation") and name == GDN_OP:
            host.append(dur)
        elif cat == "user_annotation" and name.startswith(RUNNER_SCOPE):
            scopes[name[len(RUNNER_SCOPE):]] += dur
            if name == STEP_SCOPE:
                step_starts.append(float(e.get("ts", 0.0)))
        elif cat == "user_annotation" and name.startswith(SGLANG_STEP):
            step_starts.append(float(e.get("ts", 0.0)))
        elif cat in RUNTIME_CATS:
            runtime[name] += dur
            runtime_calls[name] += 1
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launched[corr] = float(e.get("ts", 0.0))
    step_starts.sort()
    periods = [b - a for a, b in zip(step_starts, step_starts[1:])]
    total = sum(kernels.values())
    span = (last - first) if first is not None else 0.0
    return {
        "kernel_us_total": total,
        "gpu_span_us": span,
        "comm_us": comm,
        # the span's time with no kernel running (kernels on several streams counted once)
        "gpu_idle_us": span - busy_time(spans),
        "gdn_us": dict(gdn),
        "gdn_share": (sum(gdn.values()) / total) if total else 0.0,
        "top": [(n, kernels[n], counts[n]) for n, _ in kernels.most_common(top)],
        "gdn_op_host_us": {"calls": len(host), "median": statistics.median(host) if host else None,
                           "mean": statistics.fmean(host) if host else None},
        # host side: vLLM's runner scopes (us, summed), steps seen by them and the median
        # period between two steps' starts, CUDA runtime calls (us, calls)
        "host_scopes_us": dict(scopes.most_common()),
        "host_steps": len(step_starts),
        "step_period_us": statistics.median(periods) if periods else None,
        "runtime_us": {n: (us, runtime_calls[n]) for n, us in runtime.most_common(top)},
        "steps_by_kind": steps_by_kind(step_starts, launched, device),
    }


STEP_KINDS = ("with prefill", "decode only")


def steps_by_kind(step_starts: list[float], launched: dict, device: list[tuple]) -> dict:
    """Each step's GPU events (those its host side launched, between its start and the next
    step's), the steps split by whether a GDN prefill kernel ran in them, and per kind the median
    over its steps (us): period (to the next step's start; the last step has none), kernel time,
    GDN recurrence, collectives, and the span from its first GPU event to its last."""
    steps: dict[int, dict] = {}
    for corr, start, end, group, collective in device:
        host = launched.get(corr)
        i = bisect.bisect_right(step_starts, host) - 1 if host is not None else -1
        if i < 0:
            continue  # launched before the window's first step, or without a launch on record
        st = steps.setdefault(i, {"kernel": 0.0, "recurrence": 0.0, "comm": 0.0, "prefill": False,
                                  "first": start, "last": end})
        st["kernel"] += end - start
        st["recurrence"] += (end - start) if group and group.startswith("recurrence") else 0.0
        st["comm"] += (end - start) if collective else 0.0
        st["prefill"] |= group == "recurrence (prefill)"
        st["first"], st["last"] = min(st["first"], start), max(st["last"], end)
    med = lambda vals: statistics.median(vals) if vals else None  # noqa: E731
    out = {}
    for kind in STEP_KINDS:
        mine = [i for i in sorted(steps) if steps[i]["prefill"] == (kind == "with prefill")]
        if not mine:
            continue
        out[kind] = {"steps": len(mine),
                     "period_us": med([step_starts[i + 1] - step_starts[i] for i in mine if i + 1 < len(step_starts)]),
                     "kernel_us": med([steps[i]["kernel"] for i in mine]),
                     "recurrence_us": med([steps[i]["recurrence"] for i in mine]),
                     "comm_us": med([steps[i]["comm"] for i in mine]),
                     "span_us": med([steps[i]["last"] - steps[i]["first"] for i in mine])}
    return out


def busy_time(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    busy, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy


def markdown(label: str, s: dict, steps: int | None = None) -> str:
    per = f" ({s['kernel_us_total'] / steps / 1e3:.2f} ms per step over {steps} steps)" if steps else ""
    lines = [f"### {label}", "",
             f"GPU kernel time {s['kernel_us_total'] / 1e3:.1f} ms{per}, GPU span {s['gpu_span_us'] / 1e3:.1f} ms "
             f"(no kernel running for {s['gpu_idle_us'] / 1e3:.1f} ms of it), collectives {s['comm_us'] / 1e3:.1f} ms; "
             f"GDN core share {100 * s['gdn_share']:.1f}%", "",
             "| GDN part | kernel ms |", "|---|---|"]
    lines += [f"| {k} | {v / 1e3:.2f} |" for k, v in sorted(s["gdn_us"].items())]
    h = s["gdn_op_host_us"]
    if h["calls"]:
        lines += ["", f"`{GDN_OP}` host time: {h['calls']} calls, median {h['median']:.1f} us, mean {h['mean']:.1f} us"]
    lines += host_markdown(s)
    lines += ["", "| kernel | ms | calls | GDN part |", "|---|---|---|---|"]
    lines += [f"| `{n[:90]}` | {us / 1e3:.2f} | {c} | {classify(n) or ''} |" for n, us, c in s["top"]]
    return "\n".join(lines) + "\n"


def host_markdown(s: dict) -> list[str]:
    """The host side of the window: vLLM's runner scopes and CUDA runtime calls, per step where
    the scopes counted the steps."""
    steps = s.get("host_steps") or 0
    div, unit = (steps, "per step") if steps else (1, "in all")
    lines = []
    if steps:
        period = s.get("step_period_us")
        lines += ["", f"Host: {steps} steps, median {period / 1e3:.3f} ms from one step's start to the next"
                  if period else f"Host: {steps} steps"]
    if s.get("host_scopes_us"):
        lines += ["", f"| vLLM runner scope | host ms {unit} |", "|---|---|"]
        lines += [f"| {n} | {us / div / 1e3:.3f} |" for n, us in s["host_scopes_us"].items()]
    if s.get("runtime_us"):
        lines += ["", f"| CUDA runtime call | host ms {unit} | calls {unit} |", "|---|---|---|"]
        lines += [f"| `{n}` | {us / div / 1e3:.3f} | {c / div:.1f} |" for n, (us, c) in s["runtime_us"].items()]
    if s.get("steps_by_kind"):
        ms = lambda us: "—" if us is None else f"{us / 1e3:.3f}"  # noqa: E731
        lines += ["", ("| steps (median per step) | steps | period ms | kernels ms | GDN recurrence ms | "
                       "collectives ms | GPU span ms |"), "|---|---|---|---|---|---|---|"]
        lines += [f"| {kind} | {k['steps']} | {ms(k['period_us'])} | {ms(k['kernel_us'])} | {ms(k['recurrence_us'])} | "
                  f"{ms(k['comm_us'])} | {ms(k['span_us'])} |" for kind, k in s["steps_by_kind"].items()]
    return lines


def ranks_table(summaries: list[tuple[str, dict]], steps: int | None = None) -> str:
    """One line per trace (a TP rank's worker): per step when ``steps`` is known. At TP > 1 the
    rank with the least time in collectives is the one the others wait for."""
    div, unit = (steps * 1e3, "ms per step") if steps else (1e3, "ms")
    lines = [f"| trace | kernels ({unit}) | collectives | no kernel running | GPU span |", "|---|---|---|---|---|"]
    for name, s in summaries:
        lines.append(f"| `{name}` | {s['kernel_us_total'] / div:.3f} | {s['comm_us'] / div:.3f} | "
                     f"{s['gpu_idle_us'] / div:.3f} | {s['gpu_span_us'] / div:.3f} |")
    return "\n".join(lines) + "\n"


def find_traces(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in directory.rglob("*.json*") if "trace" in p.name and p.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e_bench.trace_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir")
    p.add_argument("--label", default="")
    p.add_argument("--steps", type=int, default=None, help="engine steps in the window (per-step time)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    traces = find_traces(pathlib.Path(args.trace_dir))
    if not traces:
        print(f"profile: no torch-profiler trace under {args.trace_dir}", file=sys.stderr)
        return 1
    text = ""
    ranks = []
    for t in traces:
        # the workers' traces hold the GPU kernels; the front-end's holds none
        s = summarize(load_trace(t))
        if not s["kernel_us_total"]:
            continue
        ranks.append((t.name, s))
        text += markdown(f"{args.label or t.parent.name} — {t.name}", s, args.steps) + "\n"
    if len(ranks) > 1:
        text = ranks_table(ranks, args.steps) + "\n" + text
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
