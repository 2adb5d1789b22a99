"""The serving benchmark's SGLang commands (e2e_bench/serve.py), parsed by SGLang's own parsers.

No server starts: `sglang.launch_server`'s command goes through SGLang's server-argument parser
(with our plugin loaded, as in every SGLang process) and `sglang.bench_serving`'s through the
client's own `cli_main`, stopped where it would start benchmarking.
"""

from __future__ import annotations

import sys

import pytest

from e2e_bench import serve


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    spec = serve.model_spec("qwen3-next-80b-a3b")
    d = serve.write_model(spec, 4, 4096, tmp_path_factory.mktemp("qwen3next"), full_vocab=True)  # as main() does
    return serve.Setup("sglang", d, 1, 4096)


@pytest.mark.parametrize("backend,expected", [("flashqla", "flashqla"), ("default", None),
                                              ("flashinfer", "flashinfer"), ("triton", "triton")])
def test_server_command_parses_with_sglangs_parser(sglang_plugins, setup, backend, expected):
    import argparse

    from sglang.srt.server_args import ServerArgs

    cmd = serve.server_command(setup, backend)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = p.parse_args(cmd[3:])
    assert args.model_path == setup.model_dir and args.tokenizer_path == serve.tokenizer_dir(setup.model_dir)
    assert args.load_format == "dummy" and args.tp_size == 1 and args.context_length == 4096
    assert args.linear_attn_backend == (expected or p.get_default("linear_attn_backend"))
    assert not getattr(args, "disable_cuda_graph", False)  # CUDA graphs as SGLang ships them


def test_without_fa3_the_server_gets_triton_attention(sglang_plugins, setup, monkeypatch):
    import argparse

    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(serve, "sglang_fa3_library", lambda: None)  # the GPU machine's bundle
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    for backend in serve.BACKENDS:
        args = p.parse_args(serve.server_command(setup, backend)[3:])
        assert args.attention_backend == "triton"
    # a --server-arg comes later and wins
    args = p.parse_args(serve.server_command(setup, "triton", ["--attention-backend", "flashinfer"])[3:])
    assert args.attention_backend == "flashinfer"


def test_default_backend_is_read_from_sglangs_own_log_line(publish_args, capfd):
    """resolve_default reads the line SGLang's own backend resolution logs (its handler writes to stderr)."""
    from sglang.srt.layers.attention.linear import utils

    for flags, expected in (((), "triton"), (("--linear-attn-backend", "flashinfer"), "flashinfer"),
                            (("--linear-attn-prefill-backend", "flashinfer"), "flashinfer prefill, triton decode")):
        args = publish_args(*flags)
        capfd.readouterr()
        if hasattr(utils, "resolve_linear_attn_backends"):  # SGLang >= 0.5.18
            utils.resolve_linear_attn_backends()
        else:  # 0.5.17
            utils.initialize_linear_attn_config(args)
        err = capfd.readouterr().err
        assert serve.resolve_default("sglang", err) == expected, err


def test_tp_command(sglang_plugins, setup):
    import argparse

    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = p.parse_args(serve.server_command(serve.Setup(**{**setup.__dict__, "tp": 4}), "flashqla")[3:])
    assert args.tp_size == 4 and args.disable_custom_all_reduce
    assert not args.enforce_disable_flashinfer_allreduce_fusion  # SGLang's own choice by default


def test_allreduce_fusion_off_reaches_sglangs_parser(sglang_plugins, setup):
    """--allreduce-fusion off at TP > 1: SGLang's FlashInfer all-reduce fusion is disabled by its own
    flag, parsed by its own parser; nothing at TP 1 or with trtllm."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    extra = serve.allreduce_fusion_args("sglang", 4, "off")
    args = p.parse_args(serve.server_command(serve.Setup(**{**setup.__dict__, "tp": 4}), "flashqla", extra)[3:])
    assert args.enforce_disable_flashinfer_allreduce_fusion is True
    assert serve.allreduce_fusion_args("sglang", 1, "off") == serve.allreduce_fusion_args("sglang", 4, "trtllm") == []


def test_client_command_parses_with_sglangs_bench_serving(setup, tmp_path, monkeypatch):
    from sglang.benchmark import serving

    seen = []
    monkeypatch.setattr(serving, "run_benchmark", seen.append)
    for workload, (i, o) in serve.WORKLOADS.items():
        cmd = serve.client_command(setup, workload, 8, 16, str(tmp_path / "r.jsonl"), warmups=2)
        assert cmd[:3] == [sys.executable, "-m", "sglang.bench_serving"]
        monkeypatch.setattr(sys, "argv", ["bench_serving", *cmd[3:]])
        serving.cli_main()
        a = seen[-1]
        assert (a.random_input_len, a.random_output_len, a.max_concurrency, a.num_prompts) == (i, o, 8, 16)
        assert a.dataset_name == "random-ids" and float(a.random_range_ratio) == 1.0 and a.warmup_requests == 2
        assert a.output_file == str(tmp_path / "r.jsonl") and a.tokenizer == serve.tokenizer_dir(setup.model_dir)
        assert a.backend == "sglang" and a.request_rate == float("inf") and a.disable_tqdm
        assert a.flush_cache  # the radix cache emptied after the warm-up (test below: why)


def test_client_prompts_are_exact_and_offline(setup, tmp_path, monkeypatch):
    """The client's own dataset code on our tokenizer: random token ids (no ShareGPT download),
    each prompt re-encoding to exactly the workload's input length, and every id the model can
    generate decoding to text (SGLang's client times the first token at the first non-empty text)."""
    import numpy as np
    from sglang.benchmark import serving
    from sglang.benchmark.datasets import get_dataset

    seen = []
    monkeypatch.setattr(serving, "run_benchmark", seen.append)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for workload in ("short", "long"):
        cmd = serve.client_command(setup, workload, 2, 4, str(tmp_path / "r.jsonl"), warmups=1)
        monkeypatch.setattr(sys, "argv", ["bench_serving", *cmd[3:]])
        serving.cli_main()
        args = seen[-1]
        np.random.seed(args.seed)
        tokenizer = serving.get_tokenizer(args.tokenizer)
        rows = get_dataset(args, tokenizer, "bench")
        i, o = serve.WORKLOADS[workload]
        assert len(rows) == 4 and {(r.prompt_len, r.output_len) for r in rows} == {(i, o)}
        assert all(isinstance(r.prompt, str) and len(tokenizer.encode(r.prompt)) == i for r in rows)
    spec = serve.model_spec("qwen3-next-80b-a3b")
    assert tokenizer.vocab_size == spec["vocab_size"]
    assert all(tokenizer.decode([t]) for t in (0, serve.TOKENIZER_WORDS + 1, spec["vocab_size"] - 1))


def test_points_share_their_first_prompts_so_the_cache_is_flushed(setup, tmp_path, monkeypatch):
    """One seed gives every point the same first prompts (and the warm-up sends the first): with
    SGLang's radix cache on, a point would measure prompts an earlier point or its own warm-up
    left in the cache. The client's --flush-cache empties it after the warm-up."""
    import numpy as np
    from sglang.benchmark import serving
    from sglang.benchmark.datasets import get_dataset

    seen = []
    monkeypatch.setattr(serving, "run_benchmark", seen.append)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = {}
    for conc, n in ((1, 4), (32, 64)):
        cmd = serve.client_command(setup, "short", conc, n, str(tmp_path / "r.jsonl"), warmups=min(conc, 4))
        monkeypatch.setattr(sys, "argv", ["bench_serving", *cmd[3:]])
        serving.cli_main()
        args = seen[-1]
        np.random.seed(args.seed)
        prompts[conc] = [r.prompt for r in get_dataset(args, serving.get_tokenizer(args.tokenizer), "bench")]
        assert args.flush_cache
    assert prompts[32][:4] == prompts[1]


def test_dummy_weights_get_gates_that_remember(sglang_plugins, monkeypatch):
    """The benchmark's SGLang servers (QLA_BENCH_GDN_GATES=1) re-draw the GDN gates after SGLang's
    dummy loader, as vLLM's qla_dummy load format does; without the variable nothing changes."""
    import importlib

    import torch

    from qla_serving.bench.gates import GATE_A_RANGE
    from qla_serving.integrations.sglang import patch

    module, cls, meth = patch.DUMMY_LOAD.rsplit(".", 2)
    assert callable(getattr(getattr(importlib.import_module(module), cls), meth))  # the hook's target exists

    class Gdn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.zeros(4))
            self.dt_bias = torch.nn.Parameter(torch.zeros(4))

    model = torch.nn.Sequential(Gdn())
    monkeypatch.delenv(patch.BENCH_GATES_ENV, raising=False)
    assert patch._dummy_load_after(model, None) is None and torch.equal(model[0].A_log, torch.zeros(4))
    monkeypatch.setenv(patch.BENCH_GATES_ENV, "1")
    assert patch._dummy_load_after(model, None) is None
    a = model[0].A_log.exp()
    assert bool(((a >= GATE_A_RANGE[0]) & (a <= GATE_A_RANGE[1])).all())
    assert serve.backend_env("triton")["QLA_BENCH_GDN_GATES"] == "1"
    # QLA_BENCH_WEIGHTS=random re-draws the other weights too, SGLang's own norms at their identity
    from sglang.kernels.ops.attention.fla.layernorm_gated import RMSNorm as RMSNormGated
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    from qla_serving.bench.weights import WEIGHTS_ENV

    model = torch.nn.Sequential(Gdn(), torch.nn.Linear(256, 512, bias=False), GemmaRMSNorm(512), RMSNormGated(512))
    for p in model.parameters():
        torch.nn.init.uniform_(p, -1e-3, 1e-3)
    gates = model[0].A_log.detach().clone()
    monkeypatch.delenv(patch.BENCH_GATES_ENV)
    monkeypatch.setenv(WEIGHTS_ENV, "random")
    assert patch._dummy_load_after(model, None) is None
    assert torch.equal(model[0].A_log, gates)  # the gates: QLA_BENCH_GDN_GATES's
    assert 0.015 < model[1].weight.std().item() < 0.025
    assert bool((model[2].weight == 0).all()) and bool((model[3].weight == 1).all())


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "qwen3.5-397b-a17b"])
def test_model_files_load_as_sglangs_model_config(name, tmp_path):
    """The harness's model files (either released shape, cut to 8 layers) read as SGLang's own model
    config: the architecture it serves, the GDN heads and the linear / full-attention layer split."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    from sglang.srt.model_loader.utils import get_model_architecture

    spec = serve.model_spec(name)
    files = serve.engine_model(spec, "sglang", 8, 4096, tmp_path)
    d, multimodal = files["model_dir"], files["multimodal"]
    mc = ModelConfig.from_server_args(ServerArgs(model_path=d, tokenizer_path=serve.tokenizer_dir(d),
                                                 load_format="dummy", context_length=4096))
    text = mc.hf_text_config
    # a multimodal release is served as its language model's own causal LM: no image processor to build
    arch = spec["architecture"].replace("ForConditionalGeneration", "ForCausalLM")
    assert mc.hf_config.architectures == [arch] and not mc.is_multimodal and not multimodal
    model_cls, resolved = get_model_architecture(mc)
    assert resolved == arch and model_cls.__name__ == arch
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (
        spec["linear_num_key_heads"], spec["linear_num_value_heads"])
    interval = spec["full_attention_interval"]
    assert text.full_attention_layer_ids == [i for i in range(8) if (i + 1) % interval == 0]
    assert text.linear_layer_ids == [i for i in range(8) if (i + 1) % interval]


def test_a_multimodal_release_is_served_as_its_text_model(sglang_plugins, tmp_path):
    """Qwen3.5's language model as SGLang's own causal LM: plain partial RoPE (no M-RoPE positions
    for text), and the hybrid radix cache's strategy set as SGLang resolves it for the released
    architecture, by backend (no extra buffer for its flashinfer GDN kernels); Qwen3-Next unchanged."""
    import argparse
    import json

    from sglang.srt.server_args import ServerArgs

    spec = serve.model_spec("qwen3.5-397b-a17b")
    files = serve.engine_model(spec, "sglang", 4, 4096, tmp_path / "q35")
    assert files["text_model"] and not files["multimodal"]
    cfg = json.loads((tmp_path / "q35" / "config.json").read_text())
    assert "vision_config" not in cfg and "mrope_section" not in cfg["rope_parameters"]
    assert cfg["partial_rotary_factor"] == spec["partial_rotary_factor"]
    s = serve.Setup("sglang", tp=1, max_len=4096, **files)
    for backend, expected in (("flashqla", ["extra_buffer"]), ("triton", ["extra_buffer"]),
                              ("default", ["extra_buffer"]), ("flashinfer", ["no_buffer", "--disable-overlap-schedule"])):
        cmd = serve.server_command(s, backend)
        i = cmd.index("--mamba-radix-cache-strategy")
        assert cmd[i + 1: i + 1 + len(expected)] == expected
        p = argparse.ArgumentParser()
        ServerArgs.add_cli_args(p)
        args = p.parse_args(cmd[3:])  # SGLang's own parser takes them
        assert args.mamba_radix_cache_strategy == expected[0]
        assert args.disable_overlap_schedule == (backend == "flashinfer")
    nxt = serve.engine_model(serve.model_spec("qwen3-next-80b-a3b"), "sglang", 4, 4096, tmp_path / "next")
    assert not nxt["text_model"] and "--mamba-radix-cache-strategy" not in serve.server_command(
        serve.Setup("sglang", tp=1, max_len=4096, **nxt), "flashqla")
