"""The metadata builder: fed a real CommonAttentionMetadata, it attaches our prefill plan."""

from __future__ import annotations

import random

import pytest
import torch
from qla_vllm_helpers import build_gdn_layer, common_metadata, metadata_builder

from qla_serving.plan import plan_prefill


@pytest.fixture
def layer(flashqla_config, distributed, monkeypatch):
    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    return build_gdn_layer(flashqla_config)


def random_batch(num_decodes: int, num_prefills: int, rng: random.Random):
    """Decodes first (one token, some history), then prefills of random length and history."""
    query = [1] * num_decodes + [rng.randint(2, 300) for _ in range(num_prefills)]
    context = [rng.randint(1, 500) for _ in range(num_decodes)] + [
        rng.choice([0, rng.randint(1, 900)]) for _ in range(num_prefills)]
    slots = rng.sample(range(1, 64), num_decodes + num_prefills)
    return query, context, slots


@pytest.mark.parametrize("num_decodes, num_prefills", [(0, 1), (0, 4), (3, 2), (5, 5)])
def test_builder_attaches_the_plan_of_the_prefill_rows(layer, flashqla_config, num_decodes, num_prefills):
    from qla_serving.integrations.vllm.metadata import QlaGDNAttentionMetadata

    rng = random.Random(torch.initial_seed())
    query, context, slots = random_batch(num_decodes, num_prefills, rng)
    builder = metadata_builder(layer, flashqla_config)
    md = builder.build(0, common_metadata(query, context, slots))

    assert isinstance(md, QlaGDNAttentionMetadata)
    assert (md.num_decodes, md.num_prefills) == (num_decodes, num_prefills)
    prefill_lens = query[num_decodes:]
    want = plan_prefill(torch.tensor([0] + prefill_lens).cumsum(0))
    plan = md.qla_plan
    assert torch.equal(plan.cu_seqlens_cpu, want.cu_seqlens_cpu)
    assert torch.equal(plan.cu_seqlens.cpu(), want.cu_seqlens)
    assert torch.equal(plan.chunk_indices.cpu(), want.chunk_indices)
    assert torch.equal(plan.chunk_offsets.cpu(), want.chunk_offsets)
    assert plan.total_tokens == md.num_prefill_tokens == sum(prefill_lens)
    # the plan agrees with vLLM's own device-side prefill offsets
    assert torch.equal(md.prefill_query_start_loc.cpu().long(), plan.cu_seqlens_cpu)
    assert md.qla_prefill_state_indices.tolist() == slots[num_decodes:]
    assert md.qla_prefill_has_initial_state.tolist() == [c > 0 for c in context[num_decodes:]]


def test_decode_only_step_has_no_plan(layer, flashqla_config):
    md = metadata_builder(layer, flashqla_config).build(0, common_metadata([1, 1, 1], [5, 9, 2], [4, 7, 9]))
    assert md.num_prefills == 0 and md.qla_plan is None


def test_our_metadata_is_vllms_with_our_fields_at_their_defaults(layer, flashqla_config):
    """The builder hands vLLM's step metadata on as ours without re-running the dataclass: every
    vLLM field the same object, ours at their defaults (the step's own bound-launch dict), as the
    dataclass would have made it from vLLM's fields."""
    import dataclasses

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from qla_serving.integrations.vllm.metadata import QlaGDNAttentionMetadata, as_qla_metadata

    builder = metadata_builder(layer, flashqla_config)
    m = common_metadata([1, 1, 37], [5, 9, 0], [4, 7, 9])
    md = GDNAttentionMetadataBuilder.build(builder, 0, m)
    ours = as_qla_metadata(md)
    made = QlaGDNAttentionMetadata(**{f.name: getattr(md, f.name) for f in dataclasses.fields(md)})
    assert isinstance(ours, QlaGDNAttentionMetadata)
    for f in dataclasses.fields(QlaGDNAttentionMetadata):
        got, want = getattr(ours, f.name), getattr(made, f.name)
        assert got is want or (f.name == "qla_bound" and got == want == {}), f.name
    assert ours.qla_bound is not as_qla_metadata(md).qla_bound  # a dict per step, not shared
    ours.qla_plan = "set on ours"
    assert not hasattr(md, "qla_plan")  # vLLM's object untouched
    assert dataclasses.replace(ours).num_prefill_tokens == md.num_prefill_tokens == 37


def test_plan_is_built_once_per_step_for_all_groups(layer, flashqla_config):
    """Two KV-cache groups (two builders) of one step share one plan object."""
    m = common_metadata([1, 40, 90], [3, 0, 10], [2, 5, 8])
    first = metadata_builder(layer, flashqla_config).build(0, m)
    second = metadata_builder(layer, flashqla_config).build(0, m)
    assert first.qla_plan is second.qla_plan


def test_zero_length_rows_are_left_out_of_the_plan(layer, flashqla_config):
    """A padded (zero-token) request owns no chunk and no slot in the plan."""
    m = common_metadata([1, 70, 20, 0], [4, 0, 30, 0], [3, 6, 9, 0])
    md = metadata_builder(layer, flashqla_config).build(0, m)
    assert md.qla_plan.seq_lens == [70, 20]
    assert md.qla_prefill_state_indices.tolist() == [6, 9]
    assert md.qla_prefill_has_initial_state.tolist() == [False, True]


def test_without_flashqla_the_builder_is_vllms(registered, qwen35_model_dir, distributed):
    from qla_vllm_helpers import engine_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata, GDNAttentionMetadataBuilder

    cfg = engine_config(qwen35_model_dir)
    layer = build_gdn_layer(cfg)
    builder = metadata_builder(layer, cfg)
    assert type(builder) is GDNAttentionMetadataBuilder
    md = builder.build(0, common_metadata([1, 40], [3, 0], [2, 5]))
    assert type(md) is GDNAttentionMetadata


def test_prefix_caching_align_mode_writes_the_block_of_the_last_token(registered, qwen35_model_dir, distributed,
                                                                      monkeypatch):
    """With --enable-prefix-caching vLLM caches GDN layers in "align" mode: the state a step ends
    with belongs to the block holding the step's last token. The plan's slots are exactly those
    (what vLLM's own FlashInfer/Triton prefill writes)."""
    from qla_vllm_helpers import engine_config

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    cfg = engine_config(qwen35_model_dir, gdn_prefill_backend="flashqla", enable_prefix_caching=True)
    assert cfg.cache_config.mamba_cache_mode == "align"
    layer = build_gdn_layer(cfg)
    block = layer.get_kv_cache_spec(cfg).block_size
    rng = random.Random(torch.initial_seed())
    query = [1, 1] + [rng.randint(2, 3 * block) for _ in range(3)]
    context = [rng.randint(1, 2 * block) for _ in range(2)] + [rng.choice([0, block, 2 * block]) for _ in range(3)]
    columns = -(-4096 // block)
    table = torch.randperm(len(query) * columns).view(len(query), columns).add(1).to(torch.int32)
    m = common_metadata(query, context, table[:, 0].tolist())
    m = m.replace(block_table_tensor=table)  # the full per-request block table of "align" mode
    md = metadata_builder(layer, cfg).build(0, m)
    seq = [q + c for q, c in zip(query, context)]
    want = [int(table[i, (seq[i] - 1) // block]) for i in range(2, len(query))]
    assert md.qla_prefill_state_indices.tolist() == want == md.prefill_state_indices.tolist()
    assert md.qla_plan.seq_lens == query[2:]


def test_builder_gives_the_planner_the_value_heads(layer, flashqla_config, monkeypatch):
    """The builder reads the GDN value heads per GPU from vLLM's real MambaSpec (the recurrent
    state's shape) and plans AutoCP with them: a long prefill is cut into segments when the
    plan's device has multiprocessors (faked here: the CPU has none)."""
    from qla_serving import plan as plan_mod
    from qla_serving.integrations.vllm import metadata as md_mod

    builder = metadata_builder(layer, flashqla_config)
    spec = layer.get_kv_cache_spec(flashqla_config)
    assert builder.qla_num_v_heads == spec.shapes[1][0] == layer.num_v_heads // layer.tp_size
    monkeypatch.setattr(plan_mod, "_sm_count", lambda device: 132)
    monkeypatch.setattr(md_mod, "_last_plan", None)
    md = builder.build(0, common_metadata([16384], [0], [3]))
    cp = md.qla_plan.context_parallel
    assert cp is not None and len(cp.segments[0]) > 1
    assert md.qla_plan.work_items_cpu.shape[0] == len(cp.segments[0])
