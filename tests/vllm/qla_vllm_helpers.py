"""Shared helpers of the vLLM plugin tests (a plain module: conftest is not importable by name)."""

from __future__ import annotations

import dataclasses
import itertools

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
                max_model_len=4096, enforce_eager=True, language_model_only=True,
                enable_prefix_caching=False)  # mamba cache mode "none": one state slot per request
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()




def common_metadata(query_lens, context_lens, slots, device="cpu"):
    """A real vLLM ``CommonAttentionMetadata`` for one step.

    Args:
        query_lens: tokens each request schedules this step (decodes first, as vLLM orders them).
        context_lens: tokens each request had computed before this step.
        slots: the state slot (mamba block) of each request.
    """
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = torch.tensor(query_lens, dtype=torch.int32)
    seq = q + torch.tensor(context_lens, dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = q.cumsum(0)
    n_tok = int(qsl[-1])
    fields = dict(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
        num_reqs=len(query_lens), num_actual_tokens=n_tok, max_query_len=int(q.max()),
        max_seq_len=int(seq.max()), block_table_tensor=torch.tensor(slots, dtype=torch.int32).view(-1, 1).to(device),
        slot_mapping=torch.zeros(n_tok, dtype=torch.int64, device=device), _seq_lens_cpu=seq,
        seq_lens_cpu_upper_bound=seq,
    )
    # The optional host copies vary between vLLM versions: pass those this one has.
    known = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in known})


def metadata_builder(layer, vllm_config, device="cpu"):
    """The metadata builder vLLM would create for ``layer``'s KV-cache group."""
    import torch

    spec = layer.get_kv_cache_spec(vllm_config)
    builder_cls = layer.get_attn_backend().get_builder_cls()
    return builder_cls(spec, [layer.prefix], vllm_config, torch.device(device))


_layer_ids = itertools.count()


def build_gdn_layer(vllm_config):
    """vLLM's ``QwenGatedDeltaNetAttention`` built the way Qwen3.5's decoder layer builds it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    with set_current_vllm_config(vllm_config):
        return QwenGatedDeltaNetAttention(
            vllm_config.model_config.hf_text_config, vllm_config,
            prefix=f"model.layers.{next(_layer_ids)}.linear_attn", gqa_interleaved_layout=False,
        )
