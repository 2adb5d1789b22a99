"""The shared start-up compile loop: specs per phase, tolerant of missing modules, strict on failures."""

import logging

import pytest
import torch

from qla_serving import warmup
from qla_serving.backend import KernelUnavailable


def _cfg(**over):
    return warmup.WarmupConfig(**{**dict(num_qk_heads=2, num_v_heads=8, dtype=torch.bfloat16,
                                         pool_dtype=torch.float32), **over})


def test_specs_follow_the_phases_and_the_kernel_warmup_signatures():
    import inspect

    from qla_serving.kernels import chunk_prefill, decode

    specs = warmup.kernel_warmup_specs(_cfg(verify_tokens=4, prefill_qk_l2norm=False))
    assert [s[0] for s in specs] == ["prefill", "decode", "verify T=4"]
    for label, module, function, kwargs in specs:
        fn = {"prefill": chunk_prefill.warmup}.get(label, decode.warmup)
        inspect.signature(fn).bind(**kwargs)  # the kwargs fit the real kernel warm-up functions
    assert specs[0][3]["use_qk_l2norm"] is False and specs[0][3]["beta_dtype"] == torch.float32
    assert specs[2][3]["intermediate_states"] and not specs[2][3]["inplace_final_state"]
    assert [s[0] for s in warmup.kernel_warmup_specs(_cfg(phases=frozenset({"decode"}), verify_tokens=4))] == ["decode"]
    assert [s[0] for s in warmup.kernel_warmup_specs(_cfg(verify_tokens=1))] == ["prefill", "decode"]


calls = []


def fake_warmup(**kwargs):
    calls.append(kwargs)


def test_missing_modules_are_logged_and_skipped(caplog):
    calls.clear()
    specs = [("a", __name__, "fake_warmup", {"x": 1}), ("b", "qla_serving", "no_such_warmup", {}),
             ("c", "qla_serving.no_such_module", "warmup", {})]
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        steps = warmup.resolve_steps(specs)
    assert [label for label, _ in steps] == ["a"]
    assert warmup.run_warmup(steps) == 0 and calls == [{"x": 1}]
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "qla_serving has no no_such_warmup()" in messages
    assert "qla_serving.no_such_module does not import" in messages


def test_failed_step_counts_or_raises_in_strict(monkeypatch):
    done = []

    def boom():
        raise RuntimeError("compiler exploded")

    steps = [("ok", lambda: done.append(1)), ("boom", boom), ("ok again", lambda: done.append(2))]
    monkeypatch.delenv("QLA_STRICT", raising=False)
    assert warmup.run_warmup(steps) == 1 and done == [1, 2]
    monkeypatch.setenv("QLA_STRICT", "1")
    with pytest.raises(KernelUnavailable, match="compiler exploded"):
        warmup.run_warmup(steps)


def test_warm_up_reports_clean_steps(monkeypatch):
    calls.clear()
    monkeypatch.setattr(warmup, "kernel_warmup_specs", lambda cfg: [("a", __name__, "fake_warmup", {"cfg": cfg})])
    assert warmup.warm_up(_cfg()) == 1
    assert calls and calls[0]["cfg"].num_v_heads == 8
