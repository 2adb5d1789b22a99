"""The plugin's wiring against the real vLLM: entry point, flags, layer resolution, fallback."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from qla_vllm_helpers import QWEN35_TEXT, build_gdn_layer, engine_config, metadata_builder

from qla_serving.backend import KernelUnavailable


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def qla_warnings(monkeypatch):
    """Warnings on vLLM's logger from the plugin, with its once-per-reason memory cleared."""
    from qla_serving.integrations.vllm import support

    monkeypatch.setattr(support, "_warned", set())
    handler = _Records()
    logger = logging.getLogger("vllm.qla_serving")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_entry_point_is_installed_and_vllm_loads_it():
    """The package metadata names register() under vllm.general_plugins, and vLLM's own
    loader finds and runs it (VLLM_PLUGINS unset: every plugin loads)."""
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
           if ep.value == "qla_serving.integrations.vllm:register"]
    assert eps, ("no vllm.general_plugins entry point 'qla_serving.integrations.vllm:register' in the "
                 "installed metadata: add it to pyproject.toml and reinstall")
    from vllm.plugins import load_plugins_by_group

    loaded = load_plugins_by_group("vllm.general_plugins")
    assert eps[0].name in loaded
    from qla_serving.integrations.vllm import register

    assert loaded[eps[0].name] is register
    loaded[eps[0].name]()  # idempotent: vLLM calls it in every process, maybe more than once
    from qla_serving.integrations.vllm.layer import QlaChunkGatedDeltaRule, QlaGatedDeltaNetAttention
    from vllm.model_executor.custom_op import op_registry_oot

    assert op_registry_oot["QwenGatedDeltaNetAttention"] is QlaGatedDeltaNetAttention
    assert op_registry_oot["ChunkGatedDeltaRule"] is QlaChunkGatedDeltaRule


@pytest.mark.parametrize("first", ["vllm", "ours"])
def test_register_leaves_model_code_unimported_until_vllm_imports_it(first):
    """vLLM calls register() in every process, the API server's included, which never builds the
    model: register() imports neither vLLM's GDN layer module nor its model-loader registry (seconds
    of imports at every server start). Once either is imported (by vLLM's model code, or through our
    layer module first), our classes and the benchmark load format are registered."""
    imports = {
        "vllm": "import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
        "ours": "import qla_serving.integrations.vllm.layer",
    }[first]
    code = textwrap.dedent(f"""
        import sys
        from qla_serving.integrations.vllm import register
        register()
        heavy = ["vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
                 "vllm.model_executor.model_loader", "qla_serving.integrations.vllm.layer"]
        print("after register:", [m for m in heavy if m in sys.modules])
        {imports}
        from vllm.model_executor.custom_op import op_registry_oot
        from qla_serving.integrations.vllm.layer import QlaChunkGatedDeltaRule, QlaGatedDeltaNetAttention
        assert op_registry_oot["QwenGatedDeltaNetAttention"] is QlaGatedDeltaNetAttention
        assert op_registry_oot["ChunkGatedDeltaRule"] is QlaChunkGatedDeltaRule
        from vllm.model_executor import model_loader
        assert "qla_dummy" in model_loader._LOAD_FORMAT_TO_MODEL_LOADER
        print("registered")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "after register: []" in r.stdout and "registered" in r.stdout, r.stdout


def test_seams_present_in_installed_vllm():
    from qla_serving.integrations.vllm import compat

    assert compat.missing_seams() == []
    assert compat.version_in_range(compat.check_vllm())
    assert compat.parse_version("0.27.1rc2.dev5+gabc") == (0, 27, 1)
    assert not compat.version_in_range("0.33.0") and not compat.version_in_range("0.25.1")


@pytest.mark.parametrize("flag", ["--linear-attn-backend", "--gdn-prefill-backend"])
def test_flags_parse_and_reach_engine_config(registered, qwen35_model_dir, flag):
    """Both flags parse through vLLM's serve parser and land in additional_config."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # `vllm serve`'s parser (moved in vLLM 0.32)
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args([qwen35_model_dir, flag, "flashqla", "--skip-tokenizer-init",
                              "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096",
                              "--enforce-eager", "--language-model-only"])
    args.model = args.model_tag
    assert args.gdn_prefill_backend == "flashqla"
    cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.additional_config["gdn_prefill_backend"] == "flashqla"


def test_flag_choices(registered):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    gdn = next(a for a in parser._actions if "--gdn-prefill-backend" in a.option_strings)
    alias = next(a for a in parser._actions if "--linear-attn-backend" in a.option_strings)
    assert "flashqla" in gdn.choices and {"flashinfer", "triton"} <= set(gdn.choices)
    assert alias.dest == gdn.dest and set(alias.choices) == set(gdn.choices)
    assert parser.parse_args(["--linear-attn-backend", "triton"]).gdn_prefill_backend == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["--linear-attn-backend", "nonsense"])


def test_qwen35_layer_resolves_to_ours(flashqla_config, distributed, monkeypatch):
    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")  # run our path on the CPU reference
    from qla_serving.integrations.vllm.layer import QlaChunkGatedDeltaRule, QlaGatedDeltaNetAttention
    from qla_serving.integrations.vllm.metadata import QlaGDNAttentionBackend, QlaGDNAttentionMetadataBuilder

    layer = build_gdn_layer(flashqla_config)
    assert type(layer) is QlaGatedDeltaNetAttention
    assert layer.qla_active
    assert (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim) == (2, 4, 128, 128)
    assert isinstance(layer.chunk_gated_delta_rule, QlaChunkGatedDeltaRule)
    assert layer.chunk_gated_delta_rule.gdn_prefill_backend == "flashqla"
    assert layer.get_attn_backend() is QlaGDNAttentionBackend
    assert QlaGDNAttentionBackend.get_builder_cls() is QlaGDNAttentionMetadataBuilder
    # the config is left as the user set it after the chunk op resolved vLLM's default
    assert flashqla_config.additional_config["gdn_prefill_backend"] == "flashqla"


def test_without_flashqla_the_layer_is_vllms(registered, qwen35_model_dir, distributed):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

    cfg = engine_config(qwen35_model_dir)
    layer = build_gdn_layer(cfg)
    assert not layer.qla_requested and not layer.qla_active
    assert layer.get_attn_backend() is GDNAttentionBackend


def test_unsupported_device_falls_back_with_one_warning(flashqla_config, distributed, qla_warnings, monkeypatch):
    """On this CPU machine the kernels cannot run: vLLM's default, one warning for many layers."""
    monkeypatch.delenv("QLA_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("QLA_STRICT", raising=False)
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import _resolve_gdn_prefill_backend

    layers = [build_gdn_layer(flashqla_config) for _ in range(3)]
    assert not any(layer.qla_active for layer in layers)
    assert len(qla_warnings) == 1, qla_warnings
    assert "cpu" in qla_warnings[0] and "falling back to vLLM's default" in qla_warnings[0]
    # vLLM's default: what its resolver picks when nothing is requested
    flashqla_config.additional_config["gdn_prefill_backend"] = "auto"
    try:
        _, default = _resolve_gdn_prefill_backend(flashqla_config)
    finally:
        flashqla_config.additional_config["gdn_prefill_backend"] = "flashqla"
    assert all(layer.chunk_gated_delta_rule.gdn_prefill_backend == default for layer in layers)


@pytest.mark.parametrize("change, needle", [
    (dict(text=dict(linear_key_head_dim=64, linear_value_head_dim=64)), "K=64"),
    (dict(dtype="float32"), "float32"),
])
def test_unsupported_model_falls_back_or_raises_in_strict(registered, distributed, tmp_path, qla_warnings,
                                                          monkeypatch, change, needle):
    from transformers import Qwen3_5Config

    text = dict(QWEN35_TEXT, **change.get("text", {}))
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=64, num_heads=2,
                                                             intermediate_size=128, out_hidden_size=256))
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.save_pretrained(tmp_path)
    vllm_config = engine_config(str(tmp_path), gdn_prefill_backend="flashqla",
                                dtype=change.get("dtype", "bfloat16"))
    monkeypatch.delenv("QLA_STRICT", raising=False)
    layer = build_gdn_layer(vllm_config)
    assert not layer.qla_active
    assert len(qla_warnings) == 1 and needle in qla_warnings[0], qla_warnings

    monkeypatch.setenv("QLA_STRICT", "1")
    with pytest.raises(KernelUnavailable, match=needle):
        build_gdn_layer(vllm_config)


def test_unsupported_reasons():
    from qla_serving.integrations.vllm import support

    bf16, f32 = torch.bfloat16, torch.float32
    assert "K=64" in support.unsupported_reason("cuda", 64, 128, bf16, f32)
    assert "float32" in support.unsupported_reason("cuda", 128, 128, f32, f32)
    assert "float16" in support.unsupported_reason("cuda", 128, 128, bf16, torch.float16)
    assert "cpu" in support.unsupported_reason("cpu", 128, 128, bf16, f32)


def test_tilelang_reasons(monkeypatch):
    """No TileLang, or a TileLang other than the one the kernels are built for."""
    import importlib.util

    from qla_serving import backend

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tilelang" else real_find_spec(name, *a))
    assert "not installed" in backend.tilelang_unsupported_reason()
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    from qla_serving.kernels import library

    monkeypatch.setattr(library, "TILELANG_VERSION", "99.0.0")
    if real_find_spec("tilelang") is not None:
        assert "99.0.0" in backend.tilelang_unsupported_reason()
        monkeypatch.setenv("QLA_ALLOW_TILELANG", "1")
        assert backend.tilelang_unsupported_reason() is None


def test_strict_mode_raises_on_cpu(flashqla_config, distributed, monkeypatch):
    monkeypatch.delenv("QLA_FORCE_REFERENCE", raising=False)
    monkeypatch.setenv("QLA_STRICT", "1")
    with pytest.raises(KernelUnavailable, match="QLA_STRICT=1"):
        build_gdn_layer(flashqla_config)


def test_a_configuration_no_library_holds_falls_back_without_tilelang(flashqla_config, distributed, monkeypatch,
                                                                      tmp_path, caplog):
    """On a usable GPU but with the engine's TileLang and no library for the layer's heads, the
    layer stays vLLM's, with one warning naming the missing kernel (an error under QLA_STRICT)."""
    from qla_serving import backend
    from qla_serving.integrations.vllm import support
    from qla_serving.integrations.vllm.layer import QlaGatedDeltaNetAttention
    from qla_serving.kernels import library

    monkeypatch.setattr(support, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(library, "tilelang_unsupported_reason", lambda: "TileLang 0.1.9 is installed but ...")
    monkeypatch.setattr(library, "search_path", lambda: [tmp_path])
    library.reset()
    support._warned.clear()
    try:
        with caplog.at_level(logging.WARNING):
            layer = build_gdn_layer(flashqla_config)
        assert type(layer) is QlaGatedDeltaNetAttention and not layer.qla_active
        msgs = [r.getMessage() for r in caplog.records if "in no precompiled kernel library" in r.getMessage()]
        assert len(msgs) == 1 and "prep PrefillStaticConfig(num_qk_heads=2, num_v_heads=4" in msgs[0]
        assert "falling back to vLLM's default GDN backend" in msgs[0]
        monkeypatch.setenv("QLA_STRICT", "1")
        with pytest.raises(backend.KernelUnavailable, match="in no precompiled kernel library"):
            build_gdn_layer(flashqla_config)
    finally:
        library.reset()


def test_more_speculative_tokens_than_the_decode_op_takes_fall_back(flashqla_config, distributed, monkeypatch,
                                                                    caplog):
    """Verify runs num_speculative_tokens + 1 tokens per sequence through the decode op: past its
    limit the layer stays vLLM's, with one warning naming the limit (an error under QLA_STRICT)."""
    import types

    from qla_serving import backend
    from qla_serving.constants import MAX_DECODE_TOKENS
    from qla_serving.integrations.vllm import support
    from qla_serving.integrations.vllm.layer import QlaGatedDeltaNetAttention

    monkeypatch.delenv("QLA_FORCE_REFERENCE", raising=False)
    monkeypatch.setattr(support, "unsupported_reason", lambda *a: None)
    checked = []
    monkeypatch.setattr(backend, "missing_kernels_reason", lambda specs: checked.append(specs))
    support._warned.clear()
    k = MAX_DECODE_TOKENS
    monkeypatch.setattr(flashqla_config, "speculative_config", types.SimpleNamespace(num_speculative_tokens=k))
    with caplog.at_level(logging.WARNING):
        layer = build_gdn_layer(flashqla_config)
    assert type(layer) is QlaGatedDeltaNetAttention and not layer.qla_active and not checked
    msgs = [r.getMessage() for r in caplog.records if "speculative tokens" in r.getMessage()]
    assert len(msgs) == 1 and f"{k} speculative tokens verify {k + 1} tokens per sequence" in msgs[0]
    monkeypatch.setattr(flashqla_config, "speculative_config", types.SimpleNamespace(num_speculative_tokens=k - 1))
    layer = build_gdn_layer(flashqla_config)
    assert layer.qla_active and checked[-1][-1][0] == f"verify T={k}"


def test_after_import_keeps_its_callbacks_through_an_import_that_fails(tmp_path, monkeypatch):
    """A watched module that no finder finds yet (its import raises) keeps its callbacks: they run
    at the import that succeeds."""
    import importlib
    import sys

    from qla_serving.integrations.vllm import compat

    name = "qla_after_import_probe"
    seen = []
    monkeypatch.delitem(sys.modules, name, raising=False)
    compat.after_import(name, lambda module: seen.append(module.VALUE))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
    (tmp_path / f"{name}.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    importlib.import_module(name)
    assert seen == [7]
    monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("bound", ["0", "1"])
def test_the_start_up_line_names_how_later_layers_launch(flashqla_config, distributed, monkeypatch, caplog, bound):
    """The engine's log says whether a step's later GDN layers rerun the first one's bound
    launches (QLA_BOUND_LAUNCH), so a server's log tells which path it ran."""
    from qla_serving.integrations.vllm import layer as qla_layer

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    monkeypatch.setenv("QLA_BOUND_LAUNCH", bound)
    monkeypatch.setattr(qla_layer, "_announced", False)
    with caplog.at_level(logging.INFO, logger="vllm.qla_serving"):
        built = build_gdn_layer(flashqla_config)
    assert built.qla_active and built.qla_bound_launch == (bound == "1")
    msgs = [r.getMessage() for r in caplog.records if "GDN layers run on flashqla" in r.getMessage()]
    assert len(msgs) == 1
    said = "rerun the first one's bound launches (QLA_BOUND_LAUNCH=1)" in msgs[0]
    assert said == (bound == "1") and ("every GDN layer calls the ops" in msgs[0]) == (bound == "0")


@pytest.mark.parametrize("fresh", [None, "0", "1"])
def test_new_one_token_rows_go_to_the_decode_kernel_unless_turned_off(flashqla_config, distributed, monkeypatch,
                                                                      caplog, fresh):
    """A new one-token prompt that vLLM's split makes a prefill row runs on the decode kernel by
    default (the builder's flag, and the start-up line says so); QLA_FRESH_ON_DECODE=0 keeps the
    prefill's answer and the line names the variable."""
    from qla_serving.integrations.vllm import layer as qla_layer

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    if fresh is None:
        monkeypatch.delenv("QLA_FRESH_ON_DECODE", raising=False)
    else:
        monkeypatch.setenv("QLA_FRESH_ON_DECODE", fresh)
    monkeypatch.setattr(qla_layer, "_announced", False)
    with caplog.at_level(logging.INFO, logger="vllm.qla_serving"):
        layer = build_gdn_layer(flashqla_config)
    assert metadata_builder(layer, flashqla_config).qla_fresh_on_decode == (fresh != "0")
    msgs = [r.getMessage() for r in caplog.records if "GDN layers run on flashqla" in r.getMessage()]
    assert len(msgs) == 1
    assert ("a new one-token prompt behind a prefill row runs on the decode kernel" in msgs[0]) == (fresh != "0")
    assert ("keeps the prefill's answer (QLA_FRESH_ON_DECODE=0)" in msgs[0]) == (fresh == "0")


def test_random_bench_weights_let_the_gdn_layer_reach_the_residual(flashqla_config, distributed):
    """QLA_BENCH_WEIGHTS=random on vLLM's own GDN layer: with the engine's dummy weights the layer's
    gated norm (weight ~1e-3) and output projection shrink its output to ~4e-6 of its input, so
    the state it reads barely moves the residual; the random weights give the output the scale of
    the input, every norm its identity, the conv a pass-through filter, and the gates are left to
    init_gdn_gates."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import initialize_dummy_weights

    from qla_serving.bench.weights import WEIGHT_STD, init_random_weights

    torch.manual_seed(0)
    T = 8
    layer = build_gdn_layer(flashqla_config)
    HV, V = layer.num_v_heads // layer.tp_size, layer.head_v_dim
    core = torch.randn(T, HV, V).to(flashqla_config.model_config.dtype)
    z = torch.randn(T, HV, V).to(flashqla_config.model_config.dtype)

    initialize_dummy_weights(layer, flashqla_config.model_config)
    a_log = layer.A_log.detach().clone()
    def output():  # the layer's _output_projection: its gated norm, then out_proj's weight
        normed = layer.norm(core.reshape(-1, V), z.reshape(-1, V)).reshape(T, HV * V)
        return torch.nn.functional.linear(normed.float(), layer.out_proj.weight.float())

    with set_current_vllm_config(flashqla_config):
        dummy = output().pow(2).mean().sqrt().item()
        counts = init_random_weights(layer)
        out = output()
    rms = out.pow(2).mean().sqrt().item()
    assert dummy < 1e-3 and rms > 0.1, (dummy, rms)
    assert torch.equal(layer.A_log, a_log)  # the gates are init_gdn_gates' to draw
    assert bool((layer.norm.weight == 1).all())
    conv = layer.conv1d.weight.float()
    assert conv.shape[-1] < 64 and conv.abs().max() <= 1 / conv.shape[-1] ** 0.5 + 1e-3 and conv.std() > 0.2
    assert abs(layer.out_proj.weight.float().std().item() - WEIGHT_STD) < 2e-3
    assert counts["norm"] >= 1 and counts["filter"] == 1 and counts["matrix"] >= 3
    # the same weights in a second layer of the same name and shapes: every backend's server alike
    again = build_gdn_layer(flashqla_config)
    init_random_weights(again)
    for (n1, p1), (n2, p2) in zip(layer.named_parameters(), again.named_parameters()):
        if n1 not in ("A_log", "dt_bias"):
            assert torch.equal(p1, p2), n1


def test_random_bench_weights_put_gemma_norms_at_zero(flashqla_config, distributed, monkeypatch):
    """Zero-centred norms (vLLM's GemmaRMSNorm, x * (1 + w), Qwen3-Next's layer norms) get 0, the
    identity; QLA_BENCH_WEIGHTS takes 'dummy' or 'random' and names anything else."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    from qla_serving.bench import weights

    with set_current_vllm_config(flashqla_config):
        norm = GemmaRMSNorm(64)
    torch.nn.init.uniform_(norm.weight, -1e-3, 1e-3)
    assert weights.init_random_weights(torch.nn.Sequential(norm)) == {"norm": 1, "bias": 0, "matrix": 0, "filter": 0}
    assert bool((norm.weight == 0).all())
    monkeypatch.delenv(weights.WEIGHTS_ENV, raising=False)
    assert not weights.random_weights_requested()
    assert weights.init_requested_weights(torch.nn.Sequential(norm)) is None  # the engine's weights kept
    monkeypatch.setenv(weights.WEIGHTS_ENV, "random")
    assert weights.random_weights_requested()
    assert weights.init_requested_weights(torch.nn.Sequential(norm)) == (
        "QLA_BENCH_WEIGHTS=random: re-drew the weights (1 norm, 0 bias, 0 matrix, 0 filter)")
    monkeypatch.setenv(weights.WEIGHTS_ENV, "xavier")
    with pytest.raises(ValueError, match="QLA_BENCH_WEIGHTS='xavier'"):
        weights.random_weights_requested()


@pytest.mark.parametrize("invariant", ["0", "1"])
def test_the_start_up_line_says_when_batch_invariant(flashqla_config, distributed, monkeypatch, caplog, invariant):
    """QLA_BATCH_INVARIANT=1 (no AutoCP) is named in the engine's log."""
    from qla_serving.integrations.vllm import layer as qla_layer

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    monkeypatch.setenv("QLA_BATCH_INVARIANT", invariant)
    monkeypatch.setattr(qla_layer, "_announced", False)
    with caplog.at_level(logging.INFO, logger="vllm.qla_serving"):
        build_gdn_layer(flashqla_config)
    msgs = [r.getMessage() for r in caplog.records if "GDN layers run on flashqla" in r.getMessage()]
    assert len(msgs) == 1
    assert ("batch-invariant (QLA_BATCH_INVARIANT=1)" in msgs[0]) == (invariant == "1")


def test_batch_invariant_mode_is_refused_as_vllm_refuses_its_own_gdn(registered, qwen35_model_dir, flashqla_config,
                                                                     distributed, monkeypatch):
    """``VLLM_BATCH_INVARIANT=1``: vLLM's own GDN backend is refused by its mamba backend selector;
    our layer, which names its backend class itself, refuses the same way (at construction, naming
    the variable) instead of passing the selector by. Without the mode both build as before."""
    from vllm import envs
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

    from qla_serving.integrations.vllm.metadata import QlaGDNAttentionBackend

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    selector._cached_get_mamba_attn_backend.cache_clear()
    try:
        vllms = build_gdn_layer(engine_config(qwen35_model_dir))
        with pytest.raises(RuntimeError, match="batch_invariant mode is not supported"):
            vllms.get_attn_backend()
        with pytest.raises(RuntimeError, match="flashqla does not support VLLM_BATCH_INVARIANT=1"):
            build_gdn_layer(flashqla_config)
        assert not QlaGDNAttentionBackend.supports_batch_invariance()
        monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False, raising=False)
        selector._cached_get_mamba_attn_backend.cache_clear()
        assert build_gdn_layer(flashqla_config).get_attn_backend() is QlaGDNAttentionBackend
        assert build_gdn_layer(engine_config(qwen35_model_dir)).get_attn_backend() is GDNAttentionBackend
    finally:
        selector._cached_get_mamba_attn_backend.cache_clear()
