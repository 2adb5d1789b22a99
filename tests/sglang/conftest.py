"""Tests of the SGLang adapter against the real installed SGLang (its own virtual environment).

Without SGLang (the main CPU run) the directory is skipped; with ``QLA_REQUIRE_SGLANG=1``
(``scripts/ci_sglang.sh``) a missing or broken SGLang fails the run instead.
"""

import importlib.util
import os

import pytest

REQUIRE = os.environ.get("QLA_REQUIRE_SGLANG", "0") == "1"

# The tests publish SGLang configs for a tiny local model dir; never reach for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _sglang_problem() -> str | None:
    spec = importlib.util.find_spec("sglang")
    # This directory is on sys.path as a namespace package named "sglang" when the real one is
    # missing (a regular package always wins the path scan), so require a real module origin.
    if spec is None or spec.origin is None:
        return "sglang is not installed"
    try:
        import sglang  # noqa: F401
    except Exception as e:  # a broken install must be visible
        return f"sglang does not import: {type(e).__name__}: {e}"
    return None


_problem = _sglang_problem()
if _problem is not None:
    if REQUIRE:
        raise RuntimeError(f"QLA_REQUIRE_SGLANG=1 but {_problem}")
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    if _problem is not None:
        return f"tests/sglang: skipped ({_problem})"
    import sglang

    return f"tests/sglang: sglang {getattr(sglang, '__version__', '?')}"


# A Qwen3-Next config (no weights): enough for SGLang to resolve and publish server args.
TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def sglang_plugins():
    """SGLang's own plugin loader, run once: discovers our entry point and applies the hooks."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("tiny_qwen3_next")
    (path / "config.json").write_text(json.dumps(TINY_QWEN3_NEXT))
    return str(path)


@pytest.fixture
def parse_args(sglang_plugins, tiny_model_dir):
    """Parse CLI flags (after the tiny model's CPU ones) with SGLang's own parser."""
    from sglang.srt.server_args import prepare_server_args

    def parse(*flags: str):
        return prepare_server_args(
            [
                "--model-path",
                tiny_model_dir,
                "--skip-tokenizer-init",
                "--device",
                "cpu",
                # the CPU platform has no extra_buffer mamba cache (irrelevant here)
                "--disable-radix-cache",
                *flags,
            ]
        )

    return parse


@pytest.fixture
def publish_args(parse_args):
    """Parse CLI flags with SGLang's parser and publish them as this process's runtime config."""
    from sglang.srt import runtime_context

    def publish(*flags: str):
        args = parse_args(*flags)
        runtime_context.publish(args, role="scheduler")
        return args

    yield publish


@pytest.fixture
def build_dispatcher():
    """SGLang's GDNKernelDispatcher built the way GDNAttnBackend builds it, for these server args.

    Returns ``(backends, dispatcher)``; ``backends`` has ``decode``/``prefill``/``verify``
    ``LinearAttnKernelBackend`` values from SGLang's own resolver.
    """
    import types

    from sglang.srt.layers.attention.linear import utils
    from sglang.srt.layers.attention.linear.gdn_backend import GDNKernelDispatcher

    def build(server_args):
        if hasattr(utils, "resolve_linear_attn_backends"):  # SGLang >= 0.5.18: LinearAttnBackends
            backends = utils.resolve_linear_attn_backends()
            return backends, GDNKernelDispatcher(backends.decode, backends.prefill, backends.verify)
        utils.initialize_linear_attn_config(server_args)  # SGLang 0.5.17: module-level choice
        backends = types.SimpleNamespace(
            decode=utils.get_linear_attn_decode_backend(),
            prefill=utils.get_linear_attn_prefill_backend(),
            verify=utils.get_linear_attn_verify_backend(),
        )
        return backends, GDNKernelDispatcher(backends.decode, backends.prefill)

    return build
