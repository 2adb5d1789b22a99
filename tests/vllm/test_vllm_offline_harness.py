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

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "e2e_bench" / "vllm_offline.py"


@pytest.fixture(scope="module")
def vo():
    spec = importlib.util.spec_from_file_location("qla_e2e_vllm_offline", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the metric


def test_agreeing_prefix_counts_tokens_before_first_divergence(vo):
    ref = [10, 11, 12, 13, 14, 15, 16, 17]
    assert vo.agreeing_prefix(ref, [10, 11, 12, 13, 14, 99, 16, 17]) == 5  # diverges at position 5
    assert vo.agreeing_prefix(ref, list(ref)) == 8
    assert vo.agreeing_prefix(ref, [0] + ref[1:]) == 0
    assert vo.agreeing_prefix(ref, ref[:3]) == 3  # shorter, agreeing as far as it goes
    assert vo.agreeing_prefix([], []) == 0


def test_agreement_sums_over_prompts(vo):
    ref = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 1], [5, 6, 7]]
    out = [[1, 2, 3, 4, 5, 0, 7, 8], [1, 1, 1, 1], [9, 6, 7]]  # 5 + 4 + 0; later matches do not count
    a = vo.agreement(ref, out)
    assert a["agree_tokens"] == 9
    assert a["total_tokens"] == 15
    assert a["exact_prompts"] == 1
    assert a["prompts"] == 3
    assert a["first_divergence"] == [5, None, 0]
    assert a["agree_frac"] == round(9 / 15, 4)
    with pytest.raises(ValueError):
        vo.agreement(ref, out[:2])


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


def test_prompt_sets(vo):
    prompts = vo.agreement_prompts(16, 17, 3000, 8192, seed=0)
    assert prompts == vo.agreement_prompts(16, 17, 3000, 8192, seed=0)  # deterministic
    lens = sorted(map(len, prompts))
    assert len(prompts) == 16 and lens[0] == 17 and lens[-1] == 3000
    assert len(set(lens)) >= 12  # mixed lengths
    assert all(0 <= t < 8192 - vo.PROMPT_ID_LIMIT for p in prompts for t in p)
    shared = [j for j in range(8, 16) if prompts[j][:256] == prompts[j - 8][:256]]
    assert shared, "some prompts share a prefix, for prefix caching to hit"
    tp = vo.throughput_prompts(16, 8192, 8192, seed=1)
    assert len(tp) == 16 and {len(p) for p in tp} == {8192}
    assert tp != vo.throughput_prompts(16, 8192, 8192, seed=2)


# ----------------------------------------------------------------------------- vLLM's config machinery


def test_model_config_is_read_by_vllm(vo, tmp_path, registered):
    model_dir = vo.write_model(tmp_path / "m", num_layers=8, linear_v_heads=48)
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
