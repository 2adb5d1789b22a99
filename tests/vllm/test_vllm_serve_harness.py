"""The serving benchmark (e2e_bench/serve.py) against real vLLM: its parsers, configs, dataset and loader.

No server starts here: the commands the harness would run are parsed by vLLM's own `vllm serve`
and `vllm bench serve` parsers, the engine config is built from them, the client's random dataset
samples prompts with the harness's tokenizer, and the benchmark load format runs on a module.
"""

from __future__ import annotations

import json

import pytest

from e2e_bench import serve


def _serve_parser():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # `vllm serve`'s parser (moved in vLLM 0.32)
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


@pytest.fixture(scope="module", params=["qwen3.5-397b-a17b", "qwen3-next-80b-a3b"])
def setup(request, tmp_path_factory):
    spec = serve.model_spec(request.param)
    d = serve.write_model(spec, 4, 4096, tmp_path_factory.mktemp(request.param))
    return spec, serve.Setup("vllm", d, 1, 4096, multimodal=spec["architecture"].endswith("ForConditionalGeneration"))


@pytest.mark.parametrize("backend,expected", [("flashqla", "flashqla"), ("default", None),
                                              ("flashinfer", "flashinfer"), ("triton", "triton")])
def test_server_command_parses_and_builds_the_engine_config(registered, setup, backend, expected):
    """Each backend's command differs only in its flag, and vLLM builds the engine config from it."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    spec, s = setup
    cmd = serve.server_command(s, backend)
    n = len(serve.VLLM_CLI)
    assert cmd[: n + 2] == [*serve.VLLM_CLI, "serve", s.model_dir]
    args = _serve_parser().parse_args(cmd[n + 1:])
    args.model = args.model_tag
    assert args.gdn_prefill_backend == expected
    assert args.load_format == "qla_dummy" and args.tensor_parallel_size == 1
    assert args.tokenizer == serve.tokenizer_dir(s.model_dir)
    assert not args.enforce_eager  # CUDA graphs and torch.compile as vLLM ships them
    cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    text = cfg.model_config.hf_text_config
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (
        spec["linear_num_key_heads"], spec["linear_num_value_heads"])
    assert (text.num_experts, text.num_experts_per_tok, text.hidden_size) == (
        spec["num_experts"], spec["num_experts_per_tok"], spec["hidden_size"])
    assert list(text.layer_types).count("linear_attention") == 3
    assert cfg.load_config.load_format == "qla_dummy"
    got = (cfg.additional_config or {}).get("gdn_prefill_backend")
    assert got == (expected or got)  # vLLM fills the default itself


def test_other_backends_differ_only_in_the_flag(setup):
    _, s = setup
    base = serve.server_command(s, "default")
    for b in ("flashqla", "flashinfer", "triton"):
        cmd = serve.server_command(s, b)
        assert cmd[: len(base)] == base and len(cmd) == len(base) + 2


def test_tp_command_disables_custom_all_reduce(registered, setup):
    _, s = setup
    s4 = serve.Setup(**{**s.__dict__, "tp": 4})
    args = _serve_parser().parse_args(serve.server_command(s4, "flashqla")[len(serve.VLLM_CLI) + 1:])
    assert args.tensor_parallel_size == 4 and args.disable_custom_all_reduce


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_vision_heads_divide_over_tp_ranks(registered, setup, tp):
    """vLLM builds the vision tower even with --language-model-only and splits its attention heads
    over the TP ranks (a 2-head tower failed TP 4 at model load): the heads of the config vLLM
    reads divide by every TP size."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    spec, s = setup
    if not s.multimodal:
        pytest.skip(f"{spec['name']} has no vision tower")
    args = _serve_parser().parse_args(serve.server_command(serve.Setup(**{**s.__dict__, "tp": tp}), "flashqla")[len(serve.VLLM_CLI) + 1:])
    args.model = args.model_tag
    vision = AsyncEngineArgs.from_cli_args(args).create_model_config().hf_config.vision_config
    assert vision.num_heads % tp == 0 and vision.hidden_size % vision.num_heads == 0


def test_allreduce_fusion_off_reaches_vllms_pass_config(registered, setup):
    """--allreduce-fusion off: the server arguments turn vLLM's all-reduce + RMSNorm fusion pass
    off at TP > 1 (parsed by `vllm serve`'s parser); nothing changes at TP 1 or for trtllm."""
    _, s = setup
    s2 = serve.Setup(**{**s.__dict__, "tp": 2})
    extra = serve.allreduce_fusion_args("vllm", 2, "off")
    args = _serve_parser().parse_args(serve.server_command(s2, "flashqla", extra)[len(serve.VLLM_CLI) + 1:])
    assert args.compilation_config.pass_config.fuse_allreduce_rms is False
    plain = _serve_parser().parse_args(serve.server_command(s2, "flashqla")[len(serve.VLLM_CLI) + 1:])
    assert plain.compilation_config.pass_config.fuse_allreduce_rms is None  # vLLM decides (on at TP > 1)
    assert serve.allreduce_fusion_args("vllm", 1, "off") == serve.allreduce_fusion_args("vllm", 2, "trtllm") == []
    assert "--compilation-config" not in serve.allreduce_fusion_args("sglang", 2, "off")  # SGLang's own flag


def test_client_command_parses_with_vllms_bench_parser(setup, tmp_path):
    import argparse

    from vllm.benchmarks.serve import add_cli_args

    _, s = setup
    p = argparse.ArgumentParser()
    add_cli_args(p)
    for workload, (i, o) in serve.WORKLOADS.items():
        cmd = serve.client_command(s, workload, 32, 64, str(tmp_path / "r.json"), warmups=4)
        n = len(serve.VLLM_CLI)
        assert cmd[: n + 2] == [*serve.VLLM_CLI, "bench", "serve"]
        a = p.parse_args(cmd[n + 2:])
        assert (a.random_input_len, a.random_output_len, a.max_concurrency, a.num_prompts) == (i, o, 32, 64)
        assert a.ignore_eos and a.save_result and a.dataset_name == "random" and float(a.random_range_ratio) == 0
        assert a.tokenizer == serve.tokenizer_dir(s.model_dir) and a.result_filename == "r.json"


def test_random_dataset_gets_exact_lengths_from_the_tokenizer(setup):
    """vLLM's random dataset decodes sampled ids and re-encodes them: the word tokenizer keeps
    every prompt at exactly the workload's length."""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import RandomDataset

    _, s = setup
    tok = AutoTokenizer.from_pretrained(serve.tokenizer_dir(s.model_dir))
    assert tok.vocab_size == serve.TOKENIZER_WORDS + 1
    ids = [5, 31999, 0, 77, 12345]
    assert tok(tok.decode(ids), add_special_tokens=False).input_ids == ids
    reqs = RandomDataset(random_seed=0).sample(tokenizer=tok, num_requests=3, input_len=1024, output_len=16,
                                               range_ratio=0.0)
    assert [r.prompt_len for r in reqs] == [1024] * 3
    assert all(len(tok(r.prompt, add_special_tokens=False).input_ids) == 1024 for r in reqs)


def test_parse_client_result_reads_vllms_keys(tmp_path):
    """The keys vLLM's `bench serve --save-result` writes (vllm/benchmarks/serve.py)."""
    import inspect

    import vllm.benchmarks.serve as vs

    src = inspect.getsource(vs)
    keys = ["request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "completed"]
    for k in ("request_throughput", "output_throughput", "total_token_throughput", "completed"):
        assert f'"{k}"' in src
    for k in ("ttft", "tpot", "itl"):
        assert 'f"mean_{metric_attribute_name}_ms"' in src or f'"mean_{k}_ms"' in src
    data = {k: float(i + 1) for i, k in enumerate(keys)}
    (tmp_path / "r.json").write_text(json.dumps(data))
    row = serve.parse_client_result("vllm", str(tmp_path / "r.json"))
    assert row["total_tok_s"] == 3.0 and row["p99_ttft_ms"] == 5.0 and row["completed"] == 9


def test_benchmark_load_format_redraws_the_gates(registered):
    import torch
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from qla_serving.bench.gates import GATE_A_RANGE
    from qla_serving.integrations.vllm.bench_loader import LOAD_FORMAT

    loader = get_model_loader(LoadConfig(load_format=LOAD_FORMAT))

    class Gdn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.zeros(8))
            self.dt_bias = torch.nn.Parameter(torch.zeros(8))
            self.proj = torch.nn.Linear(4, 4)

    model = torch.nn.Sequential(Gdn(), Gdn())
    cfg = type("M", (), {"seed": 0, "dtype": torch.float32})()
    loader.load_weights(model, cfg)
    a = model[0].A_log.exp()
    assert bool(((a >= GATE_A_RANGE[0]) & (a <= GATE_A_RANGE[1])).all())
    assert not torch.equal(model[0].A_log, model[1].A_log)  # seeded by the module name
    assert model[0].proj.weight.abs().max() <= 1e-3 + 1e-9  # the rest stays vLLM's dummy weights


@pytest.mark.parametrize("k", [1, 4, 8])
def test_stress_speculative_server_builds_vllms_config(registered, tmp_path, k):
    """The stress harness's MTP servers: vLLM parses the command and builds its speculative config."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from e2e_bench import stress

    spec = serve.model_spec("qwen3-next-80b-a3b")
    s = serve.Setup("vllm", serve.write_model(spec, 4, 4096, tmp_path / "m"), 1, 4096)
    cmd = serve.server_command(s, "flashqla", stress.spec_args("vllm", spec["model_type"], k))
    args = _serve_parser().parse_args(cmd[len(serve.VLLM_CLI) + 1:])
    args.model = args.model_tag
    cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.speculative_config.num_speculative_tokens == k
    assert cfg.speculative_config.method in ("qwen3_next_mtp", "mtp")


def test_stress_server_turns_vllms_prefix_cache_on(registered, setup):
    from vllm.engine.arg_utils import AsyncEngineArgs

    from e2e_bench import stress

    _, s = setup
    args = _serve_parser().parse_args(serve.server_command(s, "flashqla", stress.cache_args("vllm"))[len(serve.VLLM_CLI) + 1:])
    args.model = args.model_tag
    cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.cache_config.enable_prefix_caching


def test_forced_stress_server_loads_the_forced_answers_processor(registered, setup):
    """--forced: vLLM parses the stress server's command, keeps the processor in its model config,
    and its own loader resolves the name to the plugin's class (the harness mirrors the names)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

    from e2e_bench import stress
    from qla_serving.integrations.vllm import forced

    assert (stress.FORCED_PROCESSOR, stress.FORCED_KEY) == (forced.LOGITS_PROCESSOR, forced.FORCED_KEY)
    spec, s = setup
    args = stress.parse_args(["--engine", "vllm", "--forced", "--logprobs", "2", "--spec-tokens"])
    cmd = stress.server_commands(s, "flashqla", args, spec["model_type"])["stress"]
    parsed = _serve_parser().parse_args(cmd[len(serve.VLLM_CLI) + 1:])
    parsed.model = parsed.model_tag
    cfg = AsyncEngineArgs.from_cli_args(parsed).create_engine_config()
    assert cfg.model_config.logits_processors == [forced.LOGITS_PROCESSOR]
    assert _load_logitsprocs_by_fqcns(cfg.model_config.logits_processors) == [forced.ForcedTokens]


def test_stress_reads_vllms_own_draft_acceptance_counters(registered, tmp_path):
    """The stress table's 'drafts accepted' of a speculative server: vLLM's own spec-decode counters,
    as its Prometheus logger prints them after two verify steps."""
    import prometheus_client
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    from e2e_bench import stress

    spec = serve.model_spec("qwen3-next-80b-a3b")
    s = serve.Setup("vllm", serve.write_model(spec, 4, 4096, tmp_path / "m"), 1, 4096)
    args = _serve_parser().parse_args(
        serve.server_command(s, "flashqla", stress.spec_args("vllm", spec["model_type"], 4))[len(serve.VLLM_CLI) + 1:])
    args.model = args.model_tag
    cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    prom = SpecDecodingProm(cfg.speculative_config, ["model_name", "engine"], {0: ["bench", "0"]})
    stats = SpecDecodingStats.new(4)
    stats.observe_draft(num_draft_tokens=4, num_accepted_tokens=3)
    stats.observe_draft(num_draft_tokens=4, num_accepted_tokens=1)
    prom.observe(stats)
    m = stress.parse_metrics(prometheus_client.generate_latest().decode(), "vllm")
    assert (m["spec_draft_tokens"], m["spec_accepted_tokens"]) == (8.0, 4.0)
    assert stress.drafts_accepted(m) == "4 of 8"
