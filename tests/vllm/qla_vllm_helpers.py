"""Shared helpers of the vLLM plugin tests (a plain module: conftest is not importable by name)."""

from __future__ import annotations

import dataclasses
import itertools
import socket

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


def register_cpu_platform() -> None:
    """Make vLLM resolve its real CPU platform on a machine without a GPU (before vLLM's
    platform is first resolved).

    The CUDA build of vLLM finds no platform here ("unspecified", which cannot even build a
    config). The GPU harness's ``select_cpu_platform`` writes a ``vllm.platform_plugins``
    entry point into a private metadata directory on ``sys.path`` before vLLM is first
    imported (vLLM's own seam for choosing a platform). Nothing is installed.
    """
    import importlib.util
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[2] / "e2e_bench" / "vllm_offline.py"
    spec = importlib.util.spec_from_file_location("qla_e2e_vllm_offline_platform", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # standard library imports only; vLLM is not imported
    module.select_cpu_platform()


def write_qwen35_model_dir(path, **text_overrides) -> str:
    """Write the config.json of a tiny Qwen3.5 model (``QWEN35_TEXT`` with ``text_overrides``)
    into ``path``; no weights: vLLM's config and layer construction read only the config."""
    from transformers import Qwen3_5Config

    cfg = Qwen3_5Config(
        text_config={**QWEN35_TEXT, **text_overrides},
        vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=256),
    )
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.save_pretrained(path)
    return str(path)


def register_plugin() -> None:
    """Register the plugin in this process, as vLLM's plugin loader would do it."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from qla_serving.integrations.vllm.layer import QlaGatedDeltaNetAttention

    if op_registry_oot.get("QwenGatedDeltaNetAttention") is not QlaGatedDeltaNetAttention:
        # vLLM's loader found no entry point (package metadata without it): register directly
        # so the remaining tests still exercise the plugin; test_entry_point reports the gap.
        from qla_serving.integrations.vllm import register

        register()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_cpu_distributed(vllm_config) -> None:
    """vLLM's tensor-parallel groups for one CPU process (gloo), as its own CPU tests set up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ensure_model_parallel_initialized(1, 1)


def common_metadata(query_lens, context_lens, slots, device="cpu", prefilling=None):
    """A real vLLM ``CommonAttentionMetadata`` for one step.

    Args:
        query_lens: tokens each request schedules this step (decodes first, as vLLM orders them).
        context_lens: tokens each request had computed before this step.
        slots: the state slot (mamba block) of each request, or a row of slots per request
            (a speculative server's block table: one per draft position).
        prefilling: whether each request is still in its prompt (vLLM's ``is_prefilling``);
            default: the rows of more than one token and those with nothing computed yet.
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
        max_seq_len=int(seq.max()), block_table_tensor=torch.tensor(slots, dtype=torch.int32).view(len(query_lens), -1).to(device),
        slot_mapping=torch.zeros(n_tok, dtype=torch.int64, device=device), _seq_lens_cpu=seq,
        seq_lens_cpu_upper_bound=seq,
        is_prefilling=(torch.tensor(prefilling, dtype=torch.bool) if prefilling is not None
                       else (q > 1) | (torch.tensor(context_lens) == 0)),
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
