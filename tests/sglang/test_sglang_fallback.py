"""Binding to a model runner: fallback to SGLang's triton kernel with one warning, strict mode,
start-up compilation. The dispatcher is SGLang's real one, built from real LinearAttnBackends."""

import logging
import types

import pytest
import torch

from qla_serving import backend as qla_backend


@pytest.fixture
def server_args(publish_args):
    return publish_args("--linear-attn-backend", "flashqla")


@pytest.fixture
def dispatcher(server_args, build_dispatcher):
    return build_dispatcher(server_args)[1]


def runner(head_dim=128, dtype=torch.bfloat16, pool_dtype=torch.float32, device="cpu", draft_tokens=None):
    """The attributes of SGLang's ModelRunner that binding reads (a real one needs a GPU and weights)."""
    temporal = torch.zeros(3, 5, 4, head_dim, head_dim, dtype=pool_dtype)  # [layers, slots, HV, V, K]
    pool = types.SimpleNamespace(
        mamba_pool=types.SimpleNamespace(mamba_cache=types.SimpleNamespace(temporal=temporal))
    )
    layer = torch.nn.Module()
    layer.num_k_heads, layer.num_v_heads, layer.head_k_dim = 2, 4, head_dim
    layer.A_log = torch.nn.Parameter(torch.zeros(4))
    layer.dt_bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    return types.SimpleNamespace(
        req_to_token_pool=pool,
        dtype=dtype,
        device=device,
        model=layer,
        server_args=types.SimpleNamespace(speculative_num_draft_tokens=draft_tokens),
    )


def gdn_backend_with(dispatcher):
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    backend = object.__new__(GDNAttnBackend)
    backend.kernel_dispatcher = dispatcher
    return backend


def kernel_types(d):
    return {type(d.decode_kernel).__name__, type(d.extend_kernel).__name__, type(d.verify_kernel).__name__}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    from qla_serving.integrations.sglang import kernel

    monkeypatch.setattr(kernel, "_fallback_warned", set())
    monkeypatch.delenv("QLA_STRICT", raising=False)
    monkeypatch.delenv("QLA_FORCE_REFERENCE", raising=False)


def test_unsupported_device_falls_back_to_triton_with_one_warning(dispatcher, caplog):
    from qla_serving.integrations.sglang import patch

    assert kernel_types(dispatcher) == {"FlashQLAGDNKernel"}
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        # SGLang's GDNAttnBackend.__init__ runs this hook after building the dispatcher.
        patch._backend_init_after(None, gdn_backend_with(dispatcher), runner())
        second = patch.our_kernel(dispatcher)
    assert second is None
    assert kernel_types(dispatcher) == {"TritonGDNKernel"}
    assert dispatcher.supports_packed_decode == dispatcher.decode_kernel.supports_packed_decode
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tensors are on cpu" in warnings[0].getMessage()
    assert "triton" in warnings[0].getMessage()


def test_the_warning_is_given_once_per_reason(server_args, build_dispatcher, caplog):
    from qla_serving.integrations.sglang.kernel import bind_to_runner
    from qla_serving.integrations.sglang.patch import our_kernel

    # (published by the fixture: SGLang re-installs the root log handlers when it publishes)
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        for _ in range(3):  # target and draft runners, restarts in one process
            _, d = build_dispatcher(server_args)
            assert bind_to_runner(our_kernel(d), d, gdn_backend_with(d), runner()) is not None
            assert kernel_types(d) == {"TritonGDNKernel"}
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_a_runner_the_adapter_cannot_read_falls_back_unless_strict(
    server_args, build_dispatcher, monkeypatch, caplog
):
    from qla_serving.integrations.sglang import patch

    odd_runner = types.SimpleNamespace(device="cuda")  # no req_to_token_pool: an SGLang we do not know
    _, d = build_dispatcher(server_args)
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        patch._backend_init_after(None, gdn_backend_with(d), odd_runner)
    assert kernel_types(d) == {"TritonGDNKernel"}
    assert any("could not bind" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("QLA_STRICT", "1")
    _, d = build_dispatcher(server_args)
    with pytest.raises(AttributeError):
        patch._backend_init_after(None, gdn_backend_with(d), odd_runner)


def test_strict_mode_raises_instead(dispatcher, monkeypatch):
    from qla_serving.integrations.sglang import patch

    monkeypatch.setenv("QLA_STRICT", "1")
    with pytest.raises(qla_backend.KernelUnavailable, match="QLA_STRICT=1"):
        patch._backend_init_after(None, gdn_backend_with(dispatcher), runner())


@pytest.mark.parametrize(
    "config, reason",
    [
        (dict(head_dim=64), "K=64, V=64"),
        (dict(dtype=torch.float32), "activations are torch.float32"),
    ],
)
def test_unsupported_model_config_on_a_supported_gpu(dispatcher, monkeypatch, caplog, config, reason):
    from qla_serving.integrations.sglang.kernel import bind_to_runner
    from qla_serving.integrations.sglang.patch import our_kernel

    # Pretend the device itself is fine (an SM90 GPU with TileLang) so the model's config decides.
    monkeypatch.setattr(qla_backend, "device_unsupported_reason", lambda device: None)
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        got = bind_to_runner(
            our_kernel(dispatcher), dispatcher, gdn_backend_with(dispatcher), runner(**config)
        )
    assert reason in got
    assert kernel_types(dispatcher) == {"TritonGDNKernel"}
    assert any(reason in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("QLA_STRICT", "1")
    with pytest.raises(qla_backend.KernelUnavailable, match=reason.split(",")[0]):
        bind_to_runner(object(), dispatcher, None, runner(**config))


def test_supported_config_keeps_our_kernel_and_compiles_at_start_up(dispatcher, monkeypatch):
    from qla_serving.integrations.sglang import warmup
    from qla_serving.integrations.sglang.kernel import bind_to_runner
    from qla_serving.integrations.sglang.patch import our_kernel

    monkeypatch.setattr(qla_backend, "device_unsupported_reason", lambda device: None)
    monkeypatch.setattr(qla_backend, "missing_kernels_reason", lambda specs: None)  # a library or TileLang has them
    compiled = []
    monkeypatch.setattr(warmup, "warmup_kernels", lambda **cfg: compiled.append(cfg) or 0)
    kernel = our_kernel(dispatcher)
    assert bind_to_runner(kernel, dispatcher, gdn_backend_with(dispatcher), runner(draft_tokens=4)) is None
    assert kernel_types(dispatcher) == {"FlashQLAGDNKernel"}
    assert len(compiled) == 1
    cfg = dict(compiled[0])
    assert "device" in cfg  # the device calls run where the model does
    cfg.pop("device")
    assert (
        cfg["phases"] == {"decode", "prefill", "verify"}
        and cfg["num_qk_heads"] == 2
        and cfg["num_v_heads"] == 4
    )
    assert cfg["dtype"] == torch.bfloat16 and cfg["pool_dtype"] == torch.float32 and cfg["draft_tokens"] == 4
    specs = warmup.warmup_specs(**cfg)
    assert [s[0] for s in specs] == ["prefill", "decode", "verify T=4"]
    verify_kwargs = specs[2][3]
    assert (
        verify_kwargs["T"] == 4
        and verify_kwargs["intermediate_states"]
        and not verify_kwargs["inplace_final_state"]
    )


def tp_sharded_model(total_k, total_v, tp, head_dim=128):
    """SGLang's GDN layer as it is built at TP ``tp``: the model's total head counts on the layer
    (``Qwen3GatedDeltaNet``), the per-rank ones on its real ``RadixLinearAttention`` child."""
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

    layer = torch.nn.Module()
    layer.num_k_heads, layer.num_v_heads, layer.head_k_dim = total_k, total_v, head_dim
    layer.A_log = torch.nn.Parameter(torch.zeros(total_v // tp))
    layer.dt_bias = torch.nn.Parameter(torch.zeros(total_v // tp, dtype=torch.bfloat16))
    layer.attn = RadixLinearAttention(
        layer_id=0, num_q_heads=total_k // tp, num_k_heads=total_k // tp, num_v_heads=total_v // tp,
        head_q_dim=head_dim, head_k_dim=head_dim, head_v_dim=head_dim, A_log=layer.A_log, dt_bias=layer.dt_bias)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    return model


@pytest.mark.parametrize("total_k, total_v, tp", [(16, 64, 4), (16, 32, 2), (16, 64, 8), (16, 32, 1)])
def test_head_counts_are_the_ranks_at_every_tp(dispatcher, monkeypatch, total_k, total_v, tp):
    from qla_serving.integrations.sglang import warmup
    from qla_serving.integrations.sglang.kernel import bind_to_runner
    from qla_serving.integrations.sglang.patch import our_kernel

    monkeypatch.setattr(qla_backend, "device_unsupported_reason", lambda device: None)
    checked = []
    monkeypatch.setattr(qla_backend, "missing_kernels_reason", lambda specs: checked.append(specs) and None)
    compiled = []
    monkeypatch.setattr(warmup, "warmup_kernels", lambda **cfg: compiled.append(cfg) or 0)
    r = runner()
    r.req_to_token_pool.mamba_pool.mamba_cache.temporal = torch.zeros(3, 5, total_v // tp, 128, 128)
    r.model = tp_sharded_model(total_k, total_v, tp)
    assert bind_to_runner(our_kernel(dispatcher), dispatcher, gdn_backend_with(dispatcher), r) is None
    assert (compiled[0]["num_qk_heads"], compiled[0]["num_v_heads"]) == (total_k // tp, total_v // tp)
    label, _, _, kwargs = checked[0][0]  # the kernels looked up in the libraries: the ranks' too
    assert label == "prefill" and (kwargs["num_qk_heads"], kwargs["num_v_heads"]) == (total_k // tp, total_v // tp)


def test_more_draft_tokens_than_the_decode_op_takes_compile_no_verify(dispatcher, monkeypatch):
    from qla_serving.constants import MAX_DECODE_TOKENS
    from qla_serving.integrations.sglang import warmup
    from qla_serving.integrations.sglang.kernel import bind_to_runner
    from qla_serving.integrations.sglang.patch import our_kernel

    monkeypatch.setattr(qla_backend, "device_unsupported_reason", lambda device: None)
    checked = []
    monkeypatch.setattr(qla_backend, "missing_kernels_reason", lambda specs: checked.append(specs) and None)
    monkeypatch.setattr(warmup, "warmup_kernels", lambda **cfg: 0)
    for drafts, verify in ((MAX_DECODE_TOKENS, [f"verify T={MAX_DECODE_TOKENS}"]), (MAX_DECODE_TOKENS + 1, [])):
        checked.clear()
        assert bind_to_runner(our_kernel(dispatcher), dispatcher, gdn_backend_with(dispatcher),
                              runner(draft_tokens=drafts)) is None
        assert [s[0] for s in checked[0] if s[0].startswith("verify")] == verify


def test_force_reference_keeps_our_kernel(dispatcher, monkeypatch):
    from qla_serving.integrations.sglang.kernel import bind_to_runner
    from qla_serving.integrations.sglang.patch import our_kernel

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    assert bind_to_runner(our_kernel(dispatcher), dispatcher, gdn_backend_with(dispatcher), runner()) is None
    assert kernel_types(dispatcher) == {"FlashQLAGDNKernel"}


calls = []


def fake_warmup(**kwargs):
    calls.append(kwargs)


def test_warmup_runs_what_exists_and_logs_what_does_not(monkeypatch, caplog):
    from qla_serving.integrations.sglang import warmup

    calls.clear()
    specs = [
        ("decode", __name__, "fake_warmup", {"T": 1}),
        ("prefill", "qla_serving", "no_such_warmup", {}),
        ("verify", "qla_serving.no_such_module", "warmup", {}),
    ]
    monkeypatch.setattr(warmup, "warmup_specs", lambda **cfg: specs)
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        done = warmup.warmup_kernels(
            phases={"decode"}, num_qk_heads=2, num_v_heads=4, dtype=torch.bfloat16, pool_dtype=torch.float32
        )
    assert done == 1 and calls == [{"T": 1}]
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "qla_serving has no no_such_warmup()" in messages
    assert "qla_serving.no_such_module does not import" in messages


def test_kernels_in_no_library_without_tilelang_fall_back(dispatcher, monkeypatch, caplog, tmp_path):
    """SGLang's own TileLang and no library for the model's heads: triton stays, one warning
    names the first missing kernel (an error under QLA_STRICT)."""
    from qla_serving.integrations.sglang.kernel import bind_to_runner
    from qla_serving.integrations.sglang.patch import our_kernel
    from qla_serving.kernels import library

    monkeypatch.setattr(qla_backend, "device_unsupported_reason", lambda device: None)
    monkeypatch.setattr(library, "tilelang_unsupported_reason", lambda: "TileLang 0.1.12 is installed but ...")
    monkeypatch.setattr(library, "search_path", lambda: [tmp_path])
    library.reset()
    try:
        kernel = our_kernel(dispatcher)
        with caplog.at_level(logging.WARNING, logger="qla_serving"):
            got = bind_to_runner(kernel, dispatcher, gdn_backend_with(dispatcher), runner())
        assert "in no precompiled kernel library" in got and "TileLang 0.1.12" in got
        assert kernel_types(dispatcher) == {"TritonGDNKernel"}
        monkeypatch.setenv("QLA_STRICT", "1")
        with pytest.raises(qla_backend.KernelUnavailable, match="in no precompiled kernel library"):
            bind_to_runner(kernel, dispatcher, None, runner())
    finally:
        library.reset()


def test_warmup_calls_the_ops_on_a_cuda_device(monkeypatch):
    """SGLang's own warm-up request is a few tokens: the long-prefill (AutoCP) path and the kernels'
    first launch are ours to run at start-up, on the model's CUDA device (not on other devices)."""
    from qla_serving.integrations.sglang import warmup

    ran, synced = [], []
    monkeypatch.setattr(warmup, "warmup_specs", lambda **cfg: [("decode", __name__, "fake_warmup", {"T": 1})])
    monkeypatch.setattr(warmup, "device_call_steps",
                        lambda cfg, device: [("long prefill call", lambda: ran.append((cfg.num_v_heads, device)))])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    config = {"phases": {"prefill", "decode"}, "num_qk_heads": 2, "num_v_heads": 4, "dtype": torch.bfloat16,
              "pool_dtype": torch.float32}
    assert warmup.warmup_kernels(device=torch.device("cuda", 0), **config) == 2
    assert ran == [(4, torch.device("cuda", 0))] and synced == [torch.device("cuda", 0)]
    ran.clear()
    assert warmup.warmup_kernels(device=torch.device("cpu"), **config) == 1 and ran == []


@pytest.mark.parametrize("invariant", ["0", "1"])
def test_the_dispatcher_line_says_when_batch_invariant(server_args, build_dispatcher, monkeypatch, caplog, invariant):
    """QLA_BATCH_INVARIANT=1 (no AutoCP) is named in the line SGLang's
    dispatcher logs when it takes our kernel."""
    monkeypatch.setenv("QLA_BATCH_INVARIANT", invariant)
    with caplog.at_level(logging.INFO, logger="qla_serving"):
        build_dispatcher(server_args)
    msgs = [r.getMessage() for r in caplog.records if "GDN kernel dispatcher uses FlashQLAGDNKernel" in r.getMessage()]
    assert msgs
    assert all(("batch-invariant (QLA_BATCH_INVARIANT=1)" in m) == (invariant == "1") for m in msgs)
