"""`qla-serving check` runs the ops and compares them with the oracle."""

import pytest
import torch

from qla_serving import cli


def test_check_small_batch_passes(capsys):
    rc = cli.main(["check", "--heads", "2/6", "--lengths", "1,64,70", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "prefill o" in out and "decode states" in out and "FAIL" not in out
    assert "8 passed, 0 failed" in out


def test_check_rows_fail_on_wrong_results():
    rows = cli.run_check((1, 2), (5, 70), device="cpu")
    assert all(r.ok for r in rows)
    bad = cli.CheckRow("x", "y", "z", float("nan"), 1.0, 0.0)
    assert not bad.ok and "FAIL" in cli.format_table([bad])


def test_bench_needs_an_op():
    with pytest.raises(SystemExit):
        cli.main(["bench"])


@pytest.mark.parametrize("heads,message", [("3/8", "HV must be a positive multiple of H"), ("16x48", "expected Hqk/Hv")])
def test_heads_argument_names_the_constraint(capsys, heads, message):
    _one_line_usage_error(capsys, ["check", "--heads", heads], message)


def _one_line_usage_error(capsys, argv, message):
    """``argv`` ends in exit status 2 and one ``qla-serving ...: error:`` line naming the
    constraint, not a traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("qla-serving")]
    assert len(errors) == 1 and "error:" in errors[0], err


@pytest.mark.parametrize("argv,message", [
    (["check", "--heads", "16/0"], "HV must be a positive multiple of H"),
    (["check", "--lengths", "1,x"], "expected positive integers"),
    (["check", "--lengths", "1+x"], "expected positive integers"),  # the table's form, mistyped
    (["check", "--lengths", "1,0,5"], "at least one token"),
    (["check", "--device", "tpu"], "expected cpu or cuda"),
    (["compile", "--heads", "2/8", "--jobs", "0"], "--jobs: 0: must be >= 1"),
    (["bench", "prefill", "--batches", "8y4096"], "expected NxLEN or LEN+LEN"),
    (["bench", "prefill", "--iters", "0"], "--iters: 0: must be >= 1"),
    (["bench", "prefill", "--heads", "16/0"], "HV must be a positive multiple of H"),
    (["bench", "decode", "--batch", "0"], "--batch: 0: must be >= 1"),
    (["bench", "decode", "--sweep-tiles", "zz"], "expected ROWSxTHREADS"),
])
def test_bad_arguments_end_in_one_line(capsys, argv, message):
    _one_line_usage_error(capsys, argv, message)


@pytest.mark.parametrize("argv,message", [
    (["check", "--device", "cuda"], "sees no CUDA device; use --device cpu"),
    (["bench", "prefill"], "needs a CUDA GPU; this torch"),
    (["bench", "decode"], "needs a CUDA GPU; this torch"),
])
def test_cuda_commands_without_cuda_are_usage_errors(capsys, monkeypatch, argv, message):
    """On a CPU-only torch these ended in `AssertionError: Torch not compiled with CUDA enabled`."""
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    _one_line_usage_error(capsys, argv, message)


def test_lengths_take_the_form_the_table_prints(capsys):
    assert cli.parse_lengths("1+63+64") == cli.parse_lengths("1,63,64") == (1, 63, 64)
    rc = cli.main(["check", "--heads", "1/2", "--lengths", "1+63", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and "lengths 1+63" in out and "ms (warm)" in out


def test_help_names_the_subcommands_plainly(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "qla-serving: check the ops" in out
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "rest" not in out and "decode: the decode step" in out


def test_compile_plans_per_rank_heads_from_a_model_config(tmp_path):
    from qla_serving import compile as qc

    cfg = tmp_path / "config.json"
    cfg.write_text('{"text_config": {"linear_num_key_heads": 16, "linear_num_value_heads": 64}}')
    assert qc.model_heads(cfg) == (16, 64)
    assert [qc.per_rank((16, 64), tp) for tp in (1, 2, 4, 8)] == [(16, 64), (8, 32), (4, 16), (2, 8)]
    with pytest.raises(ValueError, match="does not divide the GDN heads 16/64"):
        qc.per_rank((16, 64), 3)
    configs = qc.plan_configs([(4, 16), (2, 8)], engine="vllm", dtypes=["bf16"], states=["fp32", "bf16"],
                              verify_tokens=[3])
    assert len(configs) == 2 * 2 * 3  # heads x states x (serving, verify, packed prefill)
    assert all(c.prefill_qk_l2norm is False for c in configs)  # vLLM normalises q and k itself
    verify = [c for c in configs if c.verify_tokens == 3]
    assert len(verify) == 4 and all(c.phases == frozenset({"verify"}) for c in verify)
    packed = [c for c in configs if c.prefill_packed]  # what vLLM serves with by default
    assert len(packed) == 4 and all(c.phases == frozenset({"prefill"}) and c.verify_tokens is None for c in packed)
    assert qc.plan_configs([(2, 8)], engine="sglang", dtypes=["fp16"], states=["fp32"])[0].prefill_qk_l2norm


def test_compile_builds_a_library_of_the_planned_configs(monkeypatch, capsys, tmp_path):
    from qla_serving import compile as qc

    built = []

    def fake_build(configs, out, jobs=None):
        built.append((configs, out))
        (tmp_path / "lib.so").write_bytes(b"x" * 2048)
        return {"library": "lib.so", "kernels": {"a": {}, "b": {}}}

    monkeypatch.setattr(qc, "build", fake_build)
    cfg = tmp_path / "config.json"
    cfg.write_text('{"linear_num_key_heads": 16, "linear_num_value_heads": 32}')
    assert cli.main(["compile", "--model-config", str(cfg), "--tp", "4", "8", "--state", "bf16",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"4 configuration(s) (vllm, heads 4/8, 2/4) into {tmp_path}" in out and "2 kernels" in out
    (configs, where), = built
    assert where == str(tmp_path)
    assert [(c.num_qk_heads, c.num_v_heads, c.prefill_packed) for c in configs] == [
        (4, 8, False), (4, 8, True), (2, 4, False), (2, 4, True)]
    assert all(c.bias_dtype == torch.bfloat16 and c.gate_dtype == torch.float32 for c in configs)


def test_compile_reports_a_failed_build(monkeypatch, capsys):
    from qla_serving import compile as qc

    def fail(*args, **kwargs):
        raise RuntimeError("building kernels needs nvcc")

    monkeypatch.setattr(qc, "build", fail)
    assert cli.main(["compile", "--heads", "2/8", "--out", "/nonexistent"]) == 1
    assert "qla-serving compile: building kernels needs nvcc" in capsys.readouterr().err


def test_shipped_set_covers_released_heads_at_every_tp():
    from qla_serving import compile as qc

    configs = qc.shipped_configs()
    full = {(c.num_qk_heads, c.num_v_heads) for c in configs if c.phases == frozenset({"prefill", "decode", "verify"})}
    assert {(16, 32), (8, 16), (4, 8), (2, 4), (16, 64), (2, 8), (4, 12)} <= full
    sglang = [c for c in configs if c.prefill_qk_l2norm]
    assert sglang and all(c.phases == frozenset({"prefill"}) for c in sglang)  # decode is shared with vLLM's
    packed = {(c.num_qk_heads, c.num_v_heads, c.dtype, c.pool_dtype) for c in configs if c.prefill_packed}
    assert packed == {(c.num_qk_heads, c.num_v_heads, c.dtype, c.pool_dtype) for c in configs
                      if c.phases == frozenset({"prefill", "decode", "verify"})}
    assert {c.verify_tokens for c in configs if c.phases == frozenset({"verify"})} == {2, 3, 4, 5, 9}
    assert {c.dtype for c in configs} == {torch.bfloat16, torch.float16}


@pytest.mark.parametrize("argv,message", [
    (["compile"], "give --heads, --model-config or --shipped"),
    (["compile", "--heads", "2/8", "--verify-tokens", "17"], "each must be in 1..16"),
    (["compile", "--heads", "2/8", "--tp", "0"], "each must be >= 1"),
    (["compile", "--heads", "2/7"], "HV must be a positive multiple of H"),
])
def test_compile_arguments(capsys, argv, message):
    _one_line_usage_error(capsys, argv, message)


def test_compile_names_a_bad_model_config(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_attention_heads": 8}')
    assert cli.main(["compile", "--model-config", str(cfg)]) == 2
    assert "not a hybrid Qwen (GDN) model config" in capsys.readouterr().err


def test_info_says_where_kernels_come_from(capsys, monkeypatch, tmp_path):
    from qla_serving.kernels import library

    monkeypatch.setattr(library, "search_path", lambda: [tmp_path])
    monkeypatch.setattr(library, "tilelang_unsupported_reason", lambda: "TileLang is not installed")
    library.reset()
    try:
        assert cli.main(["info"]) == 0
    finally:
        library.reset()
    out = capsys.readouterr().out
    assert f"kernel library       none ({tmp_path} (none))" in out
    assert "TileLang compiles    no: TileLang is not installed" in out
    assert "path (bf16, K=V=128) PyTorch reference:" in out  # no CUDA here
