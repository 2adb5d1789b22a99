"""Shared helpers of the vLLM plugin tests (a plain module: conftest is not importable by name)."""

from __future__ import annotations

# A Qwen3.5-shaped text config (GDN layers with K = V = 128 and GVA 2 -> 4 heads), small.
QWEN35_TEXT = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=1024,
    layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=4096,
)


def engine_config(model_dir: str, **kwargs):
    """``EngineArgs(...).create_engine_config()`` for the tiny model, on vLLM's real code path."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                max_model_len=4096, enforce_eager=True, language_model_only=True)
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


