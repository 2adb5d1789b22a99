"""The stress harness's SGLang side (e2e_bench/stress.py --engine sglang) against SGLang's own code.

No server starts. Every server command the harness starts (oracle, stress server, one speculative
server per draft length, for every backend) goes through SGLang's server-argument parser with our
plugin loaded; the speculative servers also through SGLang's resolution (on the CPU, with the radix
cache off: the CPU platform has no ``extra_buffer`` mamba cache -- scripts/sglang_bundle_check.py
resolves the commands as they are over an emulated SM90 GPU) and its draft-model resolution; the
request bodies through SGLang's request dataclasses; the ``/metrics`` parsing against what SGLang's
own metrics collectors print.
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from e2e_bench import serve, stress

SPEC_TOKENS = (1, 2, 4, 8)  # the draft lengths the stress harness runs by default


@pytest.fixture(scope="module")
def stress_setup(tmp_path_factory):
    """What main() builds for a small run: arguments, the model directory, the servers' Setup."""
    args = stress.parse_args(["--engine", "sglang", "--requests", "8", "--max-prompt", "2048", "--longest", "4096",
                              "--aborts", "2", "--suffixes", "2", "--spec-tokens", *map(str, SPEC_TOKENS)])
    spec = serve.model_spec(args.model)
    plan = stress.plan_requests(args)
    max_len = stress.max_model_len(args, plan)
    d = serve.write_model(spec, args.layers, max_len, tmp_path_factory.mktemp("stress"), full_vocab=True)
    return args, serve.Setup("sglang", d, 1, max_len), spec


def _parser():
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p


@pytest.mark.parametrize("backend", serve.BACKENDS)
def test_stress_commands_parse_with_sglangs_parser(sglang_plugins, stress_setup, backend):
    args, s, spec = stress_setup
    p = _parser()
    cmds = stress.server_commands(s, backend, args, spec["model_type"])
    assert list(cmds) == ["oracle", "stress", *(f"spec{k}" for k in SPEC_TOKENS)]
    for tag, cmd in cmds.items():
        assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
        assert "--mamba-scheduler-strategy" not in cmd  # deprecated in 0.5.17, gone from 0.5.20
        a = p.parse_args(cmd[3:])
        assert a.model_path == s.model_dir and a.load_format == "dummy" and a.context_length == s.max_len
        expected = "flashqla" if backend in serve.OURS else backend  # our variants differ in environment only
        assert a.linear_attn_backend == (p.get_default("linear_attn_backend") if backend == "default" else expected)
        if tag == "oracle":  # every request from scratch, as on a fresh server
            assert a.disable_radix_cache and not a.enable_metrics and a.speculative_algorithm is None
        elif tag == "stress":
            assert not a.disable_radix_cache and a.enable_metrics and a.speculative_algorithm is None
            # SGLang refuses extra_buffer with its flashinfer GDN kernels (no_buffer only)
            strategy = p.get_default("mamba_radix_cache_strategy") if backend == "flashinfer" else "extra_buffer"
            assert a.mamba_radix_cache_strategy == strategy
        else:
            k = int(tag[4:])
            assert a.enable_metrics and not a.disable_radix_cache
            assert (a.speculative_algorithm, a.speculative_num_steps, a.speculative_eagle_topk,
                    a.speculative_num_draft_tokens) == ("NEXTN", k, 1, k + 1)
            assert a.speculative_draft_model_path is None  # the target's own config, its MTP layer


@pytest.mark.parametrize("k", SPEC_TOKENS)
def test_speculative_servers_resolve_to_the_models_mtp_layer(sglang_plugins, stress_setup, k):
    """SGLang takes NEXTN as EAGLE over a linear chain of k steps (k + 1 tokens verified), and the
    draft model is Qwen3-Next's own MTP class built from the target's config, with dummy weights."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import prepare_server_args

    try:
        from sglang.srt.arg_groups.overrides import resolved_view
    except ImportError:  # pragma: no cover - moved in later releases
        from sglang.srt.arg_groups.model_override_base import resolved_view

    args, s, spec = stress_setup
    cmd = stress.server_commands(s, "flashqla", args, spec["model_type"])[f"spec{k}"]
    sa = prepare_server_args([*cmd[3:], "--device", "cpu", "--disable-radix-cache"])
    view = resolved_view(sa)
    if view.speculative_algorithm != "NEXTN":  # resolved here (0.5.17-0.5.22); 0.5.23 resolves at launch
        assert view.speculative_algorithm == "EAGLE"
        assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (
            k, 1, k + 1)
    assert sa.load_format == "dummy" and sa.speculative_draft_load_format in (None, "dummy")  # None: the target's
    draft = ModelConfig.from_server_args(sa, model_path=sa.speculative_draft_model_path, is_draft_model=True)
    cls, arch = ModelRegistry.resolve_model_cls(draft.hf_config.architectures)
    assert arch == "Qwen3NextForCausalLMMTP" and cls.__module__ == "sglang.srt.models.qwen3_next_mtp"
    assert draft.hf_config.num_nextn_predict_layers == 1


def test_request_bodies_are_sglangs(sglang_plugins):
    """The harness's /generate, /abort_request and bad-request bodies read by SGLang's own request
    dataclasses: every field one SGLang knows (an unknown one is a TypeError here; FastAPI would drop
    it and the request would test nothing), greedy, and the empty prompt refused as bad input."""
    from sglang.srt.managers.io_struct import AbortReq, GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    vocab = serve.model_spec("qwen3-next-80b-a3b")["vocab_size"]
    req = {"id": "abort-1", "prompt": [5, 6, 7], "max_tokens": 9, "abort": "decode"}
    for stream in (False, True):
        path, body = stress.completion_body("sglang", req, stream=stream)
        assert path == "/generate"
        obj = GenerateReqInput(**json.loads(body))
        obj.normalize_batch_and_arguments()
        assert obj.input_ids == [5, 6, 7] and obj.stream is stream and obj.rid == stress.rid(req)
        sp = SamplingParams(**obj.sampling_params)
        sp.verify(vocab)
        assert sp.max_new_tokens == 9 and sp.ignore_eos and sp.top_k == 1  # temperature 0: greedy
    assert AbortReq(rid=stress.rid(req)).rid == "stress-abort-1"

    bodies = dict(stress.bad_requests(1000, "sglang"))
    for name in ("malformed JSON", "not UTF-8"):
        with pytest.raises(ValueError):  # FastAPI answers 4xx before SGLang sees it
            json.loads(bodies[name])
    parsed = {n: GenerateReqInput(**json.loads(b)) for n, b in bodies.items() if n not in ("malformed JSON", "not UTF-8")}
    with pytest.raises(ValueError, match="empty"):  # the server's 400
        parsed["empty prompt"].normalize_batch_and_arguments()
    for name in ("prompt over max_model_len", "max_tokens 0", "max_tokens huge"):
        obj = parsed[name]
        obj.normalize_batch_and_arguments()  # what is wrong here is the tokenizer manager's to refuse
        SamplingParams(**obj.sampling_params).verify(vocab)
    assert len(parsed["prompt over max_model_len"].input_ids) == 1016


@pytest.fixture(scope="module")
def sglang_metrics_text(tmp_path_factory):
    """What SGLang's scheduler and tokenizer-manager metrics collectors print after one retraction,
    two finished requests (one with a cache-source breakdown, one without) and one abort."""
    import prometheus_client
    from sglang.srt import runtime_context
    from sglang.srt.observability import metrics_collector as mc
    from sglang.srt.server_args import prepare_server_args

    d = serve.write_model(serve.model_spec("qwen3-next-80b-a3b"), 4, 4096, tmp_path_factory.mktemp("m"))
    sa = prepare_server_args(["--model-path", d, "--skip-tokenizer-init", "--device", "cpu", "--disable-radix-cache",
                              "--enable-metrics"])
    runtime_context.publish(sa, role="scheduler")  # what the collectors read their settings from (>= 0.5.23)
    labels = {"model_name": "bench", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}
    sched = mc.SchedulerMetricsCollector(labels=labels, server_args=sa)
    tok = mc.TokenizerMetricsCollector(server_args=sa, labels={"model_name": "bench"})
    sched.increment_retracted_reqs(3, 700, 20)
    tok.observe_one_finished_request({"model_name": "bench"}, prompt_tokens=1000, generation_tokens=32, cached_tokens=96,
                                     e2e_latency=0.5, has_grammar=False, cached_tokens_details={"device": 64, "host": 32})
    tok.observe_one_finished_request({"model_name": "bench"}, prompt_tokens=500, generation_tokens=32, cached_tokens=10,
                                     e2e_latency=0.5, has_grammar=False)
    tok.observe_one_aborted_request({"model_name": "bench"})
    sched.spec_accept_length.labels(**labels).set(2.25)  # what its stats logging sets after verify steps
    return prometheus_client.generate_latest().decode()


def test_metrics_are_read_from_sglangs_own_names(sglang_metrics_text):
    m = stress.parse_metrics(sglang_metrics_text, "sglang")
    assert m == {"preemptions": 3.0, "prefix_cache_hits": 106.0, "prefix_cache_queries": 1500.0, "requests_ok": 2.0,
                 "requests_aborted": 1.0, "spec_accept_length": 2.25}, [ln for ln in sglang_metrics_text.splitlines() if ln.startswith("sglang:")]
