"""The GPU acceptance harness (e2e_bench/vllm_offline.py) on the CPU, against real vLLM config objects.

The engines themselves need a GPU; here: the agreement metric on hand-made token lists, the
aggregation and results files, the prompt sets, and that vLLM's own config machinery accepts
the harness's model config and engine arguments for every backend and prefix-caching setting.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

import pytest

from e2e_bench import agreement as metric
from e2e_bench import offline_inputs, waves

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "e2e_bench" / "vllm_offline.py"
_WAVES = _SCRIPT.with_name("waves.py")


@pytest.fixture(scope="module")
def vo():
    spec = importlib.util.spec_from_file_location("qla_e2e_vllm_offline", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the metric


def test_agreeing_prefix_counts_tokens_before_first_divergence():
    ref = [10, 11, 12, 13, 14, 15, 16, 17]
    assert metric.agreeing_prefix(ref, [10, 11, 12, 13, 14, 99, 16, 17]) == 5  # diverges at position 5
    assert metric.agreeing_prefix(ref, list(ref)) == 8
    assert metric.agreeing_prefix(ref, [0] + ref[1:]) == 0
    assert metric.agreeing_prefix(ref, ref[:3]) == 3  # shorter, agreeing as far as it goes
    assert metric.agreeing_prefix([], []) == 0


def test_agreement_sums_over_prompts():
    ref = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 1], [5, 6, 7]]
    out = [[1, 2, 3, 4, 5, 0, 7, 8], [1, 1, 1, 1], [9, 6, 7]]  # 5 + 4 + 0; later matches do not count
    a = metric.agreement(ref, out)
    assert a["agree_tokens"] == 9
    assert a["total_tokens"] == 15
    assert a["exact_prompts"] == 1
    assert a["prompts"] == 3
    assert a["first_divergence"] == [5, None, 0]
    assert a["agree_frac"] == round(9 / 15, 4)
    with pytest.raises(ValueError):
        metric.agreement(ref, out[:2])


def _raw(backend, pc, outs, s=2.0, ok=True, **extra):
    return {"backend": backend, "prefix_caching": pc, "ok": ok, "init_s": 1.0,
            "agreement": {f"pass{i + 1}": o for i, o in enumerate(outs)},
            "throughput": {"cold": {"tokens": 1000, "s": s, "prompts": 2, "prompt_len": 500},
                           "warm": {"tokens": 1000, "s": s / 2, "prompts": 2, "prompt_len": 500}}, **extra}


def test_aggregate_compares_every_pass_with_the_triton_reference(vo):
    ref = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    results = [
        _raw("triton", "off", [ref]),
        _raw("flashqla", "on", [[[1, 2, 3, 4, 5, 0], [7, 8, 9]], [[1, 2, 0, 4, 5, 6], [7, 8, 9]]]),
    ]
    rows = vo.aggregate(results)
    agree = {(r["impl"], r["mode"], r["pass"]): r for r in rows if r["op"] == "vllm-agreement"}
    assert agree[("triton", "pc-off", "pass1")]["agree_tokens"] == 9
    assert agree[("flashqla", "pc-on", "pass1")]["agree_tokens"] == 5 + 3
    assert agree[("flashqla", "pc-on", "pass2")]["agree_tokens"] == 2 + 3
    tput = {(r["impl"], r["phase"]): r["tokens_per_s"] for r in rows if r["op"] == "vllm-prefill"}
    assert tput[("flashqla", "cold")] == 500.0 and tput[("flashqla", "warm")] == 1000.0
    assert [r["ok"] for r in rows if r["op"] == "vllm-engine"] == [True, True]


def test_aggregate_without_reference_says_so(vo):
    rows = vo.aggregate([_raw("flashqla", "off", [[[1, 2]]])])
    (row,) = [r for r in rows if r["op"] == "vllm-agreement"]
    assert "no reference run" in row["error"]
    assert "no reference run" in vo.markdown({"versions": {}}, rows)


def test_aggregate_keeps_failed_runs(vo):
    rows = vo.aggregate([_raw("triton", "off", [[[1]]]),
                         {"backend": "flashqla", "prefix_caching": "off", "ok": False, "error": "boom"}])
    eng = [r for r in rows if r["op"] == "vllm-engine" and r["impl"] == "flashqla"]
    assert eng[0]["ok"] is False and eng[0]["error"] == "boom"


def test_qla_checks(vo):
    good = {"prefill_calls": 10, "decode_calls": 4, "measured_prefill_calls": 8, "measured_decode_calls": 0,
            "prefill_compiles_before": 1, "prefill_compiles_after": 1, "decode_kernels_before": 2,
            "decode_kernels_after": 2, "fallback_warnings": []}
    assert vo.qla_problems(good) == []
    assert any("compiled while serving" in p for p in vo.qla_problems({**good, "decode_kernels_after": 3}))
    assert any("prefill op never ran" in p for p in vo.qla_problems({**good, "measured_prefill_calls": 0}))
    assert any("fallback" in p for p in vo.qla_problems({**good, "fallback_warnings": ["falling back"]}))
    none_built = {**good, "prefill_compiles_before": 0, "prefill_compiles_after": 0, "decode_kernels_before": 0,
                  "decode_kernels_after": 0}
    assert any("no kernel" in p for p in vo.qla_problems(none_built))


# ----------------------------------------------------------------------------- prompts


def test_prompt_sets():
    prompts = offline_inputs.agreement_prompts(16, 17, 3000, 8192, seed=0)
    assert prompts == offline_inputs.agreement_prompts(16, 17, 3000, 8192, seed=0)  # deterministic
    lens = sorted(map(len, prompts))
    assert len(prompts) == 16 and lens[0] == 17 and lens[-1] == 3000
    assert len(set(lens)) >= 12  # mixed lengths
    assert all(0 <= t < 8192 - offline_inputs.PROMPT_ID_LIMIT for p in prompts for t in p)
    shared = [j for j in range(8, 16) if prompts[j][:256] == prompts[j - 8][:256]]
    assert shared, "some prompts share a prefix, for prefix caching to hit"
    tp = offline_inputs.throughput_prompts(16, 8192, 8192, seed=1)
    assert len(tp) == 16 and {len(p) for p in tp} == {8192}
    assert tp != offline_inputs.throughput_prompts(16, 8192, 8192, seed=2)


# ----------------------------------------------------------------------------- vLLM's config machinery


def test_model_config_is_read_by_vllm(vo, tmp_path, registered):
    model_dir = offline_inputs.write_model(tmp_path / "m", num_layers=8, linear_v_heads=48)
    kwargs = vo.llm_kwargs(model_dir, "flashqla", True, enforce_eager=False, seed=0, max_model_len=8192 + 96)
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(kwargs) <= fields, set(kwargs) - fields  # every LLM kwarg is an engine argument
    cfg = vo.check_engine_config(kwargs)
    assert cfg.model_config.architecture == "Qwen3_5ForConditionalGeneration"
    assert cfg.additional_config["gdn_prefill_backend"] == "flashqla"
    assert cfg.cache_config.enable_prefix_caching
    text = cfg.model_config.hf_text_config
    assert text.layer_types.count("linear_attention") == 6 and text.layer_types.count("full_attention") == 2
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (16, 48)
    assert (text.linear_key_head_dim, text.linear_value_head_dim) == (128, 128)
    assert vo.plugin_config_reason(cfg) is None
    from qla_serving.integrations.vllm.args import flashqla_requested

    assert flashqla_requested(cfg)
    off = vo.check_engine_config(vo.llm_kwargs(model_dir, "triton", False, enforce_eager=True, seed=0,
                                               max_model_len=4096))
    assert off.additional_config["gdn_prefill_backend"] == "triton"
    assert not off.cache_config.enable_prefix_caching


def test_dry_run_writes_results(vo, tmp_path, registered):
    out, work = tmp_path / "out", tmp_path / "work"
    rc = vo.main(["--dry-run", "--out-dir", str(out), "--work-dir", str(work), "--backends", "triton", "flashqla",
                  "--num-prompts", "4", "--max-len", "300", "--tp-prompts", "2", "--tp-len", "512"])
    assert rc == 0
    (path,) = out.glob("*-vllm-offline.json")
    data = json.loads(path.read_text())
    assert set(data) == {"meta", "rows"}
    meta = data["meta"]
    assert {"gpu", "versions", "command", "date"} <= set(meta)
    assert meta["versions"]["vllm"]
    assert set(meta["dry_run"]["engine_configs"]) == {"triton-pcoff", "triton-pcon", "flashqla-pcoff", "flashqla-pcon"}
    assert meta["dry_run"]["engine_configs"]["flashqla-pcon"]["gdn_prefill_backend"] == "flashqla"
    agree = [r for r in data["rows"] if r["op"] == "vllm-agreement"]
    assert len(agree) == 2 * (1 + 2)  # two backends: one pass without prefix caching, two with
    ref = next(r for r in agree if r["impl"] == "triton" and r["mode"] == "pc-off")
    assert ref["agree_tokens"] == ref["total_tokens"] == 4 * 32
    qla = next(r for r in agree if r["impl"] == "flashqla")
    assert qla["agree_tokens"] == 3 * 32 + 16  # the synthetic divergence sits at position 16
    assert (work / "model" / "config.json").exists()
    assert path.with_suffix(".md").read_text().startswith("# vLLM offline acceptance")
    assert path.with_name(path.stem + "-tokens.json").exists()


def test_dry_run_state_dtype_memory_and_throughput_runs(vo, tmp_path, registered):
    out, work = tmp_path / "out", tmp_path / "work"
    rc = vo.main(["--dry-run", "--out-dir", str(out), "--work-dir", str(work), "--backends", "triton", "flashqla",
                  "--num-prompts", "2", "--max-len", "300", "--tp-prompts", "2", "--tp-len", "512", "--parallel", "2",
                  "--tag", "Side by side"])
    assert rc == 0
    (path,) = out.glob("*-vllm-offline-side-by-side.json")
    assert path.with_suffix(".md").exists()
    data = json.loads(path.read_text())
    configs = data["meta"]["dry_run"]["engine_configs"]
    # The released Qwen3.5 checkpoints keep the recurrent state in float32 (mamba_ssm_dtype).
    assert {c["state_dtype"] for c in configs.values()} == {"float32"}
    # Side by side: a fixed cache (no profiling) and a share of the GPU each.
    assert {c["kv_cache_memory_bytes"] for c in configs.values()} == {8 * 2**30}
    assert {c["max_num_seqs"] for c in configs.values()} == {32}
    assert data["meta"]["settings"]["gpu_memory_utilization"] == 0.45
    # Throughput only in the runs without prefix caching (--throughput-pc off, the default).
    tput = {(r["impl"], r["mode"]) for r in data["rows"] if r["op"] == "vllm-prefill"}
    assert tput == {("triton", "pc-off"), ("flashqla", "pc-off")}


def test_memory_settings(vo):
    one = vo.parse_args([])
    assert vo._memory_settings(one) == {"gpu_memory_utilization": 0.85, "kv_cache_gib": 0, "max_num_seqs": 32}
    three = vo.parse_args(["--parallel", "3", "--kv-cache-gib", "4"])
    assert vo._memory_settings(three) == {"gpu_memory_utilization": 0.3, "kv_cache_gib": 4.0, "max_num_seqs": 32}
    kw = vo.llm_kwargs("/m", "triton", False, enforce_eager=True, seed=0, max_model_len=100, kv_cache_gib=1.5,
                       max_num_seqs=8)
    assert kw["kv_cache_memory_bytes"] == int(1.5 * 2**30) and kw["max_num_seqs"] == 8
    plain = vo.llm_kwargs("/m", "triton", False, enforce_eager=True, seed=0, max_model_len=100)
    assert "kv_cache_memory_bytes" not in plain and "max_num_seqs" not in plain


# ----------------------------------------------------------------------------- GDN gates


def test_gate_values_follow_the_qwen3_next_initialisation(vo):
    import math

    import torch

    A_log, dt_bias = vo.gdn_gate_values(4096, seed=7)
    assert A_log.shape == dt_bias.shape == (4096,) and A_log.dtype == dt_bias.dtype == torch.float32
    A = A_log.double().exp()
    dt = torch.nn.functional.softplus(dt_bias.double())
    assert A.min() >= 1.0 - 1e-5 and A.max() <= 16.0 + 1e-4
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    # Spread over the ranges (log-uniform dt: about half the heads below the geometric mean 0.01).
    assert A.max() - A.min() > 14.0
    assert 0.4 < (dt < 0.01).double().mean() < 0.6
    # Per-token decay exp(-A * dt) from short memory to about a thousand tokens.
    decay = torch.exp(-A * dt)
    assert decay.min() < math.exp(-1.0) and decay.max() > math.exp(-2e-3)
    assert torch.equal(vo.gdn_gate_values(4096, seed=7)[0], A_log)  # deterministic
    assert not torch.equal(vo.gdn_gate_values(4096, seed=8)[0], A_log)


def test_init_gdn_gates_rewrites_every_gdn_layer(vo):
    import torch

    class Gdn(torch.nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.empty(heads).uniform_(-1e-3, 1e-3))
            self.dt_bias = torch.nn.Parameter(torch.ones(heads, dtype=torch.bfloat16))

    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"layers": torch.nn.ModuleList([Gdn(32), torch.nn.Linear(4, 4), Gdn(32)])})

    m1, m2 = model(), model()
    assert vo.init_gdn_gates(m1) == 2
    vo.init_gdn_gates(m2)
    g0, g2 = m1["layers"][0], m1["layers"][2]
    assert g0.dt_bias.dtype == torch.bfloat16  # written in the parameter's own dtype
    assert not torch.equal(g0.A_log, g2.A_log)  # seeded by the layer's name
    assert torch.equal(g0.A_log, m2["layers"][0].A_log)  # the same in every engine
    A_log, dt_bias = vo.gdn_gate_values(32, __import__("zlib").crc32(b"layers.2"))
    assert torch.equal(g2.A_log.data, A_log) and torch.equal(g2.dt_bias.data, dt_bias.bfloat16())
    bad = torch.nn.ModuleDict({"x": Gdn(4)})
    bad["x"].dt_bias = torch.nn.Parameter(torch.ones(5))
    with pytest.raises(ValueError, match="A_log"):
        vo.init_gdn_gates(bad)


# ----------------------------------------------------------------------------- the schedule


def test_ordered_runs_put_the_reference_run_and_no_prefix_caching_first(vo):
    runs = vo.ordered_runs(["flashinfer", "flashqla", "triton"], ["off", "on"])
    assert runs == [("triton", "off"), ("flashinfer", "off"), ("flashqla", "off"),
                    ("flashinfer", "on"), ("flashqla", "on"), ("triton", "on")]
    assert vo.ordered_runs(["flashqla"], ["on"]) == [("flashqla", "on")]


_FAKE_WORKER = """
import importlib.util, json, sys, time
spec_mod = importlib.util.spec_from_file_location("waves", {script!r})
waves = importlib.util.module_from_spec(spec_mod)
spec_mod.loader.exec_module(waves)
spec = json.load(open(sys.argv[1]))
def note(event):
    with open(spec["log"], "a") as f:
        f.write(json.dumps([spec["label"], event, time.monotonic()]) + "\\n")
note("start")
print("output of", spec["label"], flush=True)
time.sleep(spec["build_s"])
if spec.get("fail_build"):
    sys.exit(5)
waves.signal_ready(spec)
waves.wait_for_go(spec, poll_s=0.01)
note("measure")
time.sleep(spec["measure_s"])
note("end")
"""


def _fake_jobs(tmp_path, runs):
    import sys

    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE_WORKER.format(script=str(_WAVES)))
    log = tmp_path / "events.jsonl"
    jobs = []
    for label, extra in runs:
        spec = {"label": label, "log": str(log), "build_s": 0.2, "measure_s": 0.2,
                "ready_file": str(tmp_path / f"{label}.ready"), "go_file": str(tmp_path / f"{label}.go"), **extra}
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(spec))
        jobs.append({"label": label, "cmd": [sys.executable, str(script), str(path)], "env": None,
                     "ready_file": spec["ready_file"], "go_file": spec["go_file"],
                     "log": str(tmp_path / f"{label}.out")})
    return jobs, log


def _events(log):
    ev = {}
    for line in log.read_text().splitlines():
        label, what, t = json.loads(line)
        ev.setdefault(label, {})[what] = t
    return ev


def test_run_waves_builds_side_by_side_and_measures_one_at_a_time(tmp_path):
    # The slowest builder starts first: with a barrier nobody measures before it is built.
    runs = [("a", {"build_s": 1.0}), ("b", {}), ("c", {"measure_s": 0.4}), ("d", {}), ("e", {})]
    jobs, log = _fake_jobs(tmp_path, runs)
    status = waves.run_waves(jobs, 3, init_timeout=60, measure_timeout=60, log=lambda m: None)
    assert {k: v["status"] for k, v in status.items()} == dict.fromkeys("abcde", "done")
    assert all(v["rc"] == 0 for v in status.values())
    ev = _events(log)
    wave1, wave2 = ["a", "b", "c"], ["d", "e"]
    # Within a wave: every engine started before any measurement, and every build ended first.
    assert max(ev[x]["start"] for x in wave1) < min(ev[x]["measure"] for x in wave1)
    assert ev["a"]["start"] + 1.0 <= min(ev[x]["measure"] for x in wave1)
    # Measurements never overlap, and keep the start order.
    spans = sorted((ev[x]["measure"], ev[x]["end"], x) for x in ev)
    assert [x for _, _, x in spans] == list("abcde")
    assert all(end <= nxt for (_, end, _), (nxt, _, _) in zip(spans, spans[1:]))
    # Waves do not overlap.
    assert max(ev[x]["end"] for x in wave1) < min(ev[x]["start"] for x in wave2)
    # Each worker's output went to its own file.
    assert all((tmp_path / f"{x}.out").read_text() == f"output of {x}\n" for x in "abcde")


def test_run_waves_failures_timeouts_and_deadline(tmp_path):
    import time

    runs = [("ok", {}), ("dies", {"fail_build": True}), ("hangs", {"build_s": 30})]
    jobs, log = _fake_jobs(tmp_path, runs)
    t0 = time.monotonic()
    status = waves.run_waves(jobs, 3, init_timeout=2, measure_timeout=60, log=lambda m: None)
    assert time.monotonic() - t0 < 20  # the hanging build was killed at init_timeout
    assert status["ok"]["status"] == "done" and status["ok"]["rc"] == 0
    assert status["dies"]["status"] == "exited" and status["dies"]["rc"] == 5
    assert status["hangs"]["status"] == "timeout-init" and status["hangs"]["rc"] == 124
    ev = _events(log)
    assert "measure" in ev["ok"] and "measure" not in ev["hangs"]
    # The deadline cuts a measurement short, and a wave too close to it does not start.
    other = tmp_path / "deadline"
    other.mkdir()
    jobs, log = _fake_jobs(other, [("slow", {"measure_s": 30}), ("late", {})])
    t0 = time.monotonic()
    status = waves.run_waves(jobs, 1, init_timeout=60, measure_timeout=60, deadline=t0 + 5, min_left=3,
                          log=lambda m: None)
    assert status["slow"]["status"] == "timeout-measure" and status["slow"]["rc"] == 124
    assert time.monotonic() - t0 < 15
    assert status["late"] == {"rc": None, "status": "not-started", "s": 0.0}
