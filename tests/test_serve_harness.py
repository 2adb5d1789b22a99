"""The serving benchmark's planning, metric, merging and reports, without an engine (CPU).

The commands it builds are parsed by the engines' own parsers in tests/vllm and tests/sglang.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import shutil
import subprocess
import time
import sys

import pytest

from e2e_bench import serve
from e2e_bench import trace_summary as profile

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_workloads_are_the_issues():
    assert serve.WORKLOADS == {"long": (32768, 256), "retrieval": (8192, 512), "chat": (2048, 1024),
                               "short": (1024, 128)}


@pytest.mark.parametrize("name", ["qwen3.5-397b-a17b", "qwen3-next-80b-a3b"])
def test_model_configs_keep_the_released_layout(name):
    spec = serve.model_spec(name)
    cfg = serve.hf_config(spec, 8, 4096)
    text = cfg.get("text_config", cfg)
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert text["num_hidden_layers"] == 8 and text["max_position_embeddings"] == 4096
    assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128
    assert text["eos_token_id"] == serve.TOKENIZER_WORDS
    with pytest.raises(ValueError, match="multiple of the full-attention interval 4"):
        serve.hf_config(spec, 6, 4096)
    with pytest.raises(SystemExit, match="no model 'nope'"):
        serve.model_spec("nope")


def test_tokenizer_decodes_words_with_spaces(tmp_path):
    tok = serve.tokenizer_json(5)
    assert tok["model"]["vocab"] == {"w0": 0, "w1": 1, "w2": 2, "w3": 3, "w4": 4, serve.EOS_TEXT: 5}
    d = serve.write_model(serve.model_spec("qwen3-next-80b-a3b"), 4, 2048, tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file()
    assert not (tmp_path / "m" / "tokenizer.json").exists()  # apart from the config, see write_model
    assert json.loads((tmp_path / "m" / "tokenizer" / "tokenizer.json").read_text())["decoder"]["type"] == "WordPiece"
    assert serve.tokenizer_dir(d) == str(tmp_path / "m" / "tokenizer")


def test_sglang_tokenizer_has_a_word_for_every_model_id(tmp_path):
    """SGLang's client times the first token at the first chunk with text: every id the model can
    generate must decode to a word, the end-of-text token keeping its id."""
    tok = serve.tokenizer_json(5, vocab_size=8)
    assert tok["model"]["vocab"] == {"w0": 0, "w1": 1, "w2": 2, "w3": 3, "w4": 4, serve.EOS_TEXT: 5, "w6": 6, "w7": 7}
    assert serve.tokenizer_json(5, vocab_size=3) == serve.tokenizer_json(5)
    spec = serve.model_spec("qwen3-next-80b-a3b")
    d = serve.write_model(spec, 4, 2048, tmp_path / "m", full_vocab=True)
    vocab = json.loads((tmp_path / "m" / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(spec["vocab_size"])) and vocab[serve.EOS_TEXT] == serve.TOKENIZER_WORDS
    assert json.loads((tmp_path / "m" / "config.json").read_text())["eos_token_id"] == serve.TOKENIZER_WORDS
    assert serve.tokenizer_dir(d) == str(tmp_path / "m" / "tokenizer")


def test_sglang_gets_triton_attention_without_fa3(tmp_path, monkeypatch):
    """SGLang's default full attention on Hopper is FA3 (sgl-kernel's flash_ops), which the GPU
    machine's bundle leaves out: then every SGLang server gets --attention-backend triton."""
    s = serve.Setup("sglang", str(tmp_path), 1, 4096)
    monkeypatch.setattr(serve, "sglang_fa3_library", lambda: None)
    for b in serve.BACKENDS:
        cmd = serve.server_command(s, b)
        assert cmd[cmd.index("--attention-backend") + 1] == "triton"
    assert "--attention-backend" not in serve.server_command(serve.Setup("vllm", str(tmp_path), 1, 4096), "triton")
    monkeypatch.setattr(serve, "sglang_fa3_library", lambda: "/x/sgl_kernel/flash_ops.abi3.so")
    assert "--attention-backend" not in serve.server_command(s, "flashqla")


def test_fa3_library_is_found_without_importing_sgl_kernel(tmp_path, monkeypatch):
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert serve.sglang_fa3_library() is None
    (pkg / "flash_ops.abi3.so").write_bytes(b"")
    assert serve.sglang_fa3_library() == str(pkg / "flash_ops.abi3.so")


def test_sglang_client_and_server_stay_off_the_hub(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert serve.backend_env("triton", engine="sglang")["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in serve.backend_env("triton")  # vLLM's servers as before
    cmd = serve.client_command(serve.Setup("sglang", "/m", 1, 4096), "short", 1, 4, "/r.jsonl", warmups=1)
    # SGLang's "random" dataset samples ShareGPT prompts (downloaded); "random-ids" draws token ids
    assert cmd[cmd.index("--dataset-name") + 1] == "random-ids"


def test_sglang_client_imports_without_hf_datasets(monkeypatch):
    """SGLang's client imports HF datasets (its MMMU module) though the random-ids dataset never uses
    it: where datasets does not import, a stand-in that raises on use takes its place."""
    from e2e_bench import serve_client

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    assert "datasets" in serve_client._datasets_or_stand_in()
    from datasets import load_dataset

    with pytest.raises(ImportError, match="stand-in"):
        load_dataset("x")


def test_agreement_counts_tokens_before_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert serve.agree_fraction(ref, ref) == 1.0
    assert serve.agree_fraction(ref, [[1, 2, 9, 4], [5, 6, 7, 8]]) == 6 / 8  # the 4 after a divergence don't count
    assert serve.agree_fraction(ref, [[0, 2, 3, 4], [0, 6, 7, 8]]) == 0.0
    assert serve.agree_fraction(ref, None) is None and serve.agree_fraction(ref, ref[:1]) is None
    prompts = serve.agreement_prompts(4, 200, 4000, seed=1)
    assert [len(p) for p in prompts] == [200, 1466, 2733, 4000]
    assert prompts == serve.agreement_prompts(4, 200, 4000, seed=1)
    assert all(0 <= t < serve.TOKENIZER_WORDS for p in prompts for t in p)


def test_server_capacity_from_the_engines_log_lines():
    # vLLM 0.26's kv_cache_utils lines and SGLang 0.5.17's scheduler line, as the servers print them
    vllm_log = ("(EngineCore pid=1) INFO 11-27 01:50:01 [kv_cache_utils.py:2177] GPU KV cache size: 1,234,567 tokens\n"
                "(EngineCore pid=1) INFO 11-27 01:50:01 [kv_cache_utils.py:2178] Maximum concurrency for 4,096 "
                "tokens per request: 301.41x\n")
    assert serve.server_capacity("vllm", vllm_log) == {"kv_cache_tokens": 1234567, "max_concurrency": 301.41}
    sglang_log = ("[2026-11-27 01:51:43 TP0] max_total_num_tokens=15697688, chunked_prefill_size=8192, "
                  "max_prefill_tokens=16384, max_running_requests=1797, context_len=34048, available_gpu_mem=10.00 GB")
    assert serve.server_capacity("sglang", sglang_log) == {
        "kv_cache_tokens": 15697688, "max_running_requests": 1797, "chunked_prefill_size": 8192}
    assert serve.server_capacity("vllm", "no such lines") == {}
    md = serve.markdown({"engine": "vllm", "tp": 1, "gpus": 1, "gpu": "H100", "backends": [
        {"backend": "flashqla", "resolved": "flashqla", "startup_s": 1.0, "fallback": False, "agree_fraction": 1.0,
         "capacity": {"kv_cache_tokens": 1234567, "max_concurrency": 301.41}}]}, [])
    assert "| kv_cache_tokens 1234567, max_concurrency 301.41 |" in md


def test_default_backend_is_read_from_the_engine_log():
    log = "INFO ... Using FlashInfer GDN prefill kernel (requested=auto, head_k_dim=128).\n"
    assert serve.resolve_default("vllm", log) == "flashinfer"
    assert serve.resolve_default("vllm", log.replace("FlashInfer", "Triton/FLA")) == "triton"
    assert serve.resolve_default("vllm", "Using FlashInfer GDN prefill kernel (requested=flashinfer") is None
    assert serve.resolve_default("vllm", "") is None
    sg = ("server_args=ServerArgs(..., attention_backend='triton', linear_attn_backend='triton', ...)\n"
          "[2026-11-26 TP0] Linear attention kernel backend: decode=triton, prefill=triton, verify=triton\n")
    assert serve.resolve_default("sglang", sg) == "triton"
    assert serve.resolve_default("sglang", sg.replace("prefill=triton", "prefill=flashinfer")) == (
        "flashinfer prefill, triton decode")
    assert serve.resolve_default("sglang", sg.splitlines()[0]) is None  # the arguments alone are not the choice


def test_sglang_result_takes_the_last_json_line(tmp_path):
    lines = [{"total_throughput": 1.0, "output_throughput": 2.0}, {"total_throughput": 10.0,
             "output_throughput": 20.0, "mean_ttft_ms": 3.0, "request_throughput": 0.5, "completed": 8}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    row = serve.parse_client_result("sglang", str(tmp_path / "r.jsonl"))
    assert row["total_tok_s"] == 10.0 and row["output_tok_s"] == 20.0 and row["completed"] == 8
    assert row["p99_tpot_ms"] is None


def test_backends_saved_by_separate_calls_are_merged(tmp_path):
    key = {"engine": "vllm", "model": "m", "layers": 4, "tp": 1, "gpu": "g"}
    serve.save_backend(tmp_path, key, [{"backend": "triton", "x": 1}], {"backend": "triton", "tokens": [[1]]})
    assert serve.load_backend(tmp_path, "triton", key)["rows"] == [{"backend": "triton", "x": 1}]
    assert serve.load_backend(tmp_path, "triton", {**key, "tp": 2}) is None  # another setup: not merged
    assert serve.load_backend(tmp_path, "flashqla", key) is None


def _rows():
    rows = []
    for b, tok in (("triton", 100.0), ("flashqla", 120.0)):
        for c in (1, 32):
            rows.append({"engine": "vllm", "backend": b, "tp": 1, "workload": "chat", "input_len": 2048,
                         "output_len": 1024, "concurrency": c, "num_prompts": 4, "request_throughput": 0.1,
                         "total_tok_s": tok * c, "output_tok_s": tok, "mean_ttft_ms": 10.0, "p99_ttft_ms": 20.0,
                         "mean_tpot_ms": 5.0, "p99_tpot_ms": 6.0, "mean_itl_ms": 5.0, "agree_fraction": 1.0,
                         "startup_s": 100.0})
    rows.append({**rows[0], "concurrency": 128, "error": "client exit 1: boom"})
    return rows


def test_results_files_table_and_plots(tmp_path):
    meta = {"engine": "vllm", "tp": 1, "gpu": "H100", "gpus": 1, "model": "m", "model_name": "m", "command": "c",
            "backends": [{"backend": "triton", "resolved": "triton", "startup_s": 90.0}]}
    path = serve.write_results(tmp_path, "stem", meta, _rows())
    data = json.loads(path.read_text())
    assert data["meta"]["engine"] == "vllm" and len(data["rows"]) == 5
    md = (tmp_path / "stem.md").read_text()
    assert "## chat (2048 in / 1024 out)" in md and "| flashqla | 32 | 4 | 3840 |" in md
    assert "failed: client exit 1: boom" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "stem-chat.png").stat().st_size > 1000
    assert serve.report([str(path)]) == 0


def test_cli_rejects_bad_arguments(capsys):
    for argv, msg in ((["--engine", "vllm", "--concurrency", "0"], "--concurrency 0"),
                      (["--engine", "vllm", "--tp", "0"], "--tp 0"),
                      (["--engine", "nope"], "invalid choice"),
                      (["--engine", "vllm", "--repeats", "0"], "--repeats 0"),
                      (["--engine", "vllm", "--server-sample", "0"], "--server-sample 0")):
        with pytest.raises(SystemExit):
            serve.parse_args(argv)
        assert msg in capsys.readouterr().err


def test_profile_summary_splits_gdn_kernels_from_the_rest(tmp_path):
    ev = [
        {"ph": "X", "cat": "kernel", "name": "gdn_decode_kernel", "ts": 0, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "_causal_conv1d_update_kernel", "ts": 300, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 320, "dur": 680},
        {"ph": "X", "cat": "cpu_op", "name": profile.GDN_OP, "ts": 0, "dur": 40},
        {"ph": "X", "cat": "cpu_op", "name": profile.GDN_OP, "ts": 50, "dur": 60},
        {"ph": "i", "cat": "kernel", "name": "ignored"},
    ]
    d = tmp_path / "trace"
    d.mkdir()
    with gzip.open(d / "rank0.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    traces = profile.find_traces(tmp_path)
    s = profile.summarize(profile.load_trace(traces[0]))
    assert s["kernel_us_total"] == 1000 and s["gpu_span_us"] == 1000
    assert s["gdn_us"] == {"recurrence (decode)": 300, "conv1d": 20}
    assert s["gdn_share"] == pytest.approx(0.32)
    assert s["gdn_op_host_us"]["calls"] == 2 and s["gdn_op_host_us"]["median"] == 50
    md = profile.markdown("x", s, steps=2)
    assert "0.50 ms per step over 2 steps" in md and "GDN core share 32.0%" in md
    assert s["comm_us"] == 0 and s["gpu_idle_us"] == 0
    assert profile.main([str(tmp_path), "--out", str(tmp_path / "p.md")]) == 0


def test_profile_summary_names_the_rank_that_waits_in_collectives(tmp_path):
    """At TP > 1 each worker's trace is summarised: time in collectives, time with no kernel
    running (overlapping kernels of two streams counted once), and one table over the ranks."""
    late = [  # waits for nobody: its all-reduce is short, it starts each step late
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 400, "dur": 500},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 900, "dur": 100},
    ]
    early = [  # starts at once, then waits in the all-reduce; a copy on a second stream overlaps
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 0, "dur": 500},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 100, "dur": 200},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 500, "dur": 500},
        {"ph": "X", "cat": "kernel", "name": "cross_device_reduce_1stage", "ts": 1200, "dur": 100},
    ]
    for rank, ev in ((0, early), (1, late)):
        with gzip.open(tmp_path / f"rank{rank}.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": ev}, f)
    s0, s1 = (profile.summarize(profile.load_trace(t)) for t in profile.find_traces(tmp_path))
    assert s0["comm_us"] == 600 and s0["gpu_span_us"] == 1300 and s0["gpu_idle_us"] == 200
    assert s1["comm_us"] == 100 and s1["gpu_idle_us"] == 0
    table = profile.ranks_table([("rank0", s0), ("rank1", s1)], steps=2)
    assert "| `rank0` | 0.650 | 0.300 | 0.100 | 0.650 |" in table
    out = tmp_path / "p.md"
    assert profile.main([str(tmp_path), "--steps", "2", "--out", str(out)]) == 0
    assert out.read_text().startswith("| trace |") and "collectives 0.6 ms" in out.read_text()


def test_profile_summary_times_the_host_side_of_a_step(tmp_path):
    """vLLM's model-runner scopes per step, the period between two steps' starts and the CUDA
    runtime calls (a sync shows there), from the worker's host events."""
    ev = []
    for step, start in enumerate((0, 3000, 6500)):
        ev += [{"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: preprocess", "ts": start, "dur": 200},
               {"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: forward", "ts": start + 200, "dur": 100},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": start + 210, "dur": 30},
               {"ph": "X", "cat": "gpu_user_annotation", "name": "gpu_model_runner: forward", "ts": start, "dur": 900}]
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 7000, "dur": 600})
    ev.append({"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 0, "dur": 900})
    s = profile.summarize(ev)
    assert s["host_steps"] == 3 and s["step_period_us"] == 3250
    assert s["host_scopes_us"] == {"preprocess": 600, "forward": 300}  # the GPU-side annotation is not host time
    assert s["runtime_us"]["cudaGraphLaunch"] == (90, 3) and s["runtime_us"]["cudaStreamSynchronize"] == (600, 1)
    md = profile.markdown("x", s, steps=3)
    assert "median 3.250 ms from one step's start to the next" in md
    assert "| preprocess | 0.200 |" in md and "| `cudaStreamSynchronize` | 0.200 | 0.3 |" in md


@pytest.mark.parametrize("step_span", ["gpu_model_runner: preprocess", "step[EXTEND bs=1 toks=8192]"])
def test_profile_summary_tells_prefill_steps_from_decode_steps(step_span):
    """Each GPU event belongs to the step whose host side launched it (the launch call's
    correlation; a CUDA graph's kernels carry their cudaGraphLaunch's), whenever it runs: two
    prefill steps (a chunk_fwd among their kernels) and three decode steps (a graph replay each),
    each kind's median period, kernel time, GDN recurrence, collectives and span. Steps start at
    vLLM's preprocess scope or SGLang's step span."""
    ev, corr = [], iter(range(1, 100))

    def launch(host_ts, kernels, call="cudaLaunchKernel"):
        c = next(corr)
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": call, "ts": host_ts, "dur": 5, "args": {"correlation": c}})
        ev.extend({"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d, "args": {"correlation": c}}
                  for n, t, d in kernels)

    starts = (0, 10000, 20000, 23000, 26500)
    for i, start in enumerate(starts):
        ev.append({"ph": "X", "cat": "user_annotation", "name": step_span, "ts": start, "dur": 100})
        if i < 2:  # a prefill step: its kernels run well after the host launched them
            launch(start + 200, [("chunk_fwd_kernel", start + 3000, 400)])
            launch(start + 300, [("sm90_gemm", start + 3400, 5000), ("ncclDevKernel_AllReduce", start + 8400, 600)])
        else:  # a decode step: one graph, its kernels all under the cudaGraphLaunch's correlation
            launch(start + 150, [("_causal_conv1d_update_kernel", start + 400, 10), ("gdn_decode_kernel", start + 410, 3),
                                 ("sm90_gemm", start + 413, 2000 + 100 * i), ("ncclDevKernel_AllReduce", start + 2600, 50)],
                   call="cudaGraphLaunch")
    ev.append({"ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 40000, "dur": 7})  # no launch on record
    s = profile.summarize(ev)
    kinds = s["steps_by_kind"]
    assert list(kinds) == ["with prefill", "decode only"]
    assert kinds["with prefill"] == {"steps": 2, "period_us": 10000, "kernel_us": 6000, "recurrence_us": 400,
                                     "comm_us": 600, "span_us": 6000}
    assert kinds["decode only"] == {"steps": 3, "period_us": 3250, "kernel_us": 2363, "recurrence_us": 3,
                                    "comm_us": 50, "span_us": 2313}
    md = profile.markdown("x", s, steps=5)
    assert "Host: 5 steps, median 6.750 ms from one step's start to the next" in md
    assert ("| vLLM runner scope |" in md) == step_span.startswith("gpu_model_runner")
    assert "| with prefill | 2 | 10.000 | 6.000 | 0.400 | 0.600 | 6.000 |" in md
    assert "| decode only | 3 | 3.250 | 2.363 | 0.003 | 0.050 | 2.313 |" in md
    assert profile.summarize([e for e in ev if e["cat"] != "cuda_runtime"])["steps_by_kind"] == {}


@pytest.mark.parametrize("name, part", [
    ("void vllm::moe::topkGating<16, 512, 4, 16, 32, int, __nv_bfloat16>", None),  # the MoE router
    ("fused_gdn_gating_kernel", "post-conv prep"),
    ("_fused_post_conv_kernel", "post-conv prep"),
    ("fused_sigmoid_gating_delta_rule_update_kernel", "recurrence (decode)"),  # vLLM's decode in a mixed step
    ("fused_recurrent_gated_delta_rule_packed_decode_kernel", "recurrence (decode)"),
    ("gdn_decode_kernel", "recurrence (decode)"),
    ("kernel_cutlass_kernel_flashinfergdn_kernelsdelta_rule_dsldelta_rule_sm90_FullyFusedDeltaRu",
     "recurrence (prefill)"),
    ("chunk_fwd_kernel", "recurrence (prefill)"),
    ("_causal_conv1d_update_kernel", "conv1d"),
])
def test_profile_summary_names_each_gdn_kernel_part(name, part):
    assert profile.classify(name) == part


def test_flashqla_is_compared_with_the_best_built_in_backend():
    rows = _rows()[:4]  # triton at 100/3200 tok/s, flashqla at 120/3840
    rows.append({**rows[0], "backend": "default", "backend_resolved": "flashinfer", "total_tok_s": 150.0,
                 "output_tok_s": 90.0, "mean_ttft_ms": 8.0, "mean_tpot_ms": 4.0})
    by = {(a["workload"], a["concurrency"]): a for a in serve.against_best(rows)}
    a = by[("chat", 1)]
    assert a["best"] == "flashinfer" and a["total_tok_s"] == pytest.approx(120 / 150)
    assert a["output_tok_s"] == pytest.approx(120 / 100)  # the highest built-in output throughput is triton's
    assert a["mean_ttft"] == pytest.approx(10 / 8) and a["mean_tpot"] == pytest.approx(5 / 4)
    assert by[("chat", 32)]["best"] == "triton" and by[("chat", 32)]["total_tok_s"] == pytest.approx(1.2)
    assert serve.against_best([r for r in rows if r["backend"] != "flashqla"]) == []


def test_classic_variant_is_ours_with_its_flag_and_never_a_built_in(tmp_path, monkeypatch):
    """flashqla-classic: the same plugin backend, QLA_PREFILL_PACKED=0 in its server's environment
    only, compared with the built-in backends as flashqla is, never counted among them."""
    monkeypatch.delenv("QLA_PREFILL_PACKED", raising=False)
    for engine in ("vllm", "sglang"):
        cmd = serve.server_command(serve.Setup(engine, str(tmp_path), 1, 4096), "flashqla-classic")
        assert cmd[cmd.index("--linear-attn-backend") + 1] == "flashqla"
    env = serve.backend_env("flashqla-classic")
    assert env["QLA_PREFILL_PACKED"] == "0" and env["QLA_STRICT"] == "1"
    assert "QLA_PREFILL_PACKED" not in serve.backend_env("flashqla")
    assert "flashqla-classic" not in serve.DEFAULT_BACKENDS
    bound = serve.backend_env("flashqla-bound")  # the bound launches' A/B variant, the same way
    assert bound["QLA_BOUND_LAUNCH"] == "1" and bound["QLA_STRICT"] == "1" and "QLA_BOUND_LAUNCH" not in serve.backend_env("flashqla")
    assert "flashqla-bound" in serve.BACKENDS and "flashqla-bound" not in serve.DEFAULT_BACKENDS
    prefill = serve.backend_env("flashqla-one-token-prefill")  # the one-token rows' A/B variant
    assert prefill["QLA_FRESH_ON_DECODE"] == "0" and "QLA_FRESH_ON_DECODE" not in serve.backend_env("flashqla")
    invariant = serve.backend_env("flashqla-batch-invariant")  # the batch-invariant mode's A/B variant
    assert invariant["QLA_BATCH_INVARIANT"] == "1" and "QLA_BATCH_INVARIANT" not in serve.backend_env("flashqla")
    rows = _rows()[:4]  # triton at 100/3200 tok/s, flashqla at 120/3840
    rows += [{**r, "backend": "flashqla-classic", "total_tok_s": r["total_tok_s"] * 1.5}
             for r in rows if r["backend"] == "flashqla"]
    packed = {(a["workload"], a["concurrency"]): a for a in serve.against_best(rows)}
    classic = {(a["workload"], a["concurrency"]): a for a in serve.against_best(rows, "flashqla-classic")}
    assert classic[("chat", 32)]["best"] == packed[("chat", 32)]["best"] == "triton"
    assert classic[("chat", 32)]["total_tok_s"] == pytest.approx(1.5 * packed[("chat", 32)]["total_tok_s"])
    ab = serve.against_best(rows, "flashqla-classic", versus="flashqla")
    assert {a["best"] for a in ab} == {"flashqla"} and all(a["total_tok_s"] == pytest.approx(1.5) for a in ab)
    md = serve.markdown({"engine": "vllm"}, rows)
    assert "## flashqla against the best" in md and "## flashqla-classic against the best" in md
    assert "## flashqla-classic against flashqla" in md


def test_finish_rows_gives_each_backend_and_its_rows_one_agreement():
    rows = [{"backend": b, "workload": "chat"} for b in ("default", "flashqla", "triton")]
    infos = [{"backend": "default", "tokens": [[1, 2, 3, 4]]}, {"backend": "flashqla", "tokens": [[1, 2, 9, 4]]},
             {"backend": "triton"}]
    serve.finish_rows(rows, infos, "default")
    assert [r["agree_fraction"] for r in rows] == [i["agree_fraction"] for i in infos] == [1.0, 0.5, None]
    assert all(set(serve.ROW_KEYS) <= set(r) for r in rows)


def test_gdn_gates_are_drawn_once_per_layer_when_an_inner_module_shares_them():
    """SGLang's Qwen3-Next layer passes its A_log / dt_bias on to its attention module: one layer,
    one draw, seeded by the outer module's name (the engines' shared naming)."""
    import zlib

    import torch

    from qla_serving.bench.gates import gdn_gate_values, init_gdn_gates

    class Inner(torch.nn.Module):
        def __init__(self, A_log, dt_bias):
            super().__init__()
            self.A_log, self.dt_bias = A_log, dt_bias

    class Gdn(torch.nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.zeros(heads))
            self.dt_bias = torch.nn.Parameter(torch.zeros(heads))
            self.attn = Inner(self.A_log, self.dt_bias)

    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([Gdn(8), Gdn(8)])})
    assert init_gdn_gates(model) == 2
    A_log, dt_bias = gdn_gate_values(8, zlib.crc32(b"layers.1"))
    assert torch.equal(model["layers"][1].A_log.data, A_log)
    assert torch.equal(model["layers"][1].attn.dt_bias.data, dt_bias)


def _run(backend, conc, tok, tpot, sample=1, rnd=1, error=None):
    r = {**_rows()[0], "backend": backend, "concurrency": conc, "total_tok_s": tok, "output_tok_s": tok / 2,
         "mean_tpot_ms": tpot, "sample": sample, "round": rnd, "clock_limits": ["SW power cap"] if rnd == 2 else []}
    if error:
        r["error"] = error
    return r


def test_a_point_measured_several_times_reports_its_median_and_spread():
    runs = [_run("flashqla", 1, tok, tpot, s, r) for (s, r), tok, tpot in
            zip([(1, 1), (1, 2), (2, 1), (2, 2)], (100.0, 140.0, 90.0, 120.0), (3.0, 4.4, 3.2, 3.1))]
    runs.append(_run("flashqla", 1, 0.0, 0.0, 2, 3, error="client exit 1: boom"))
    runs += [_run("triton", 1, 0.0, 0.0, error="client exit 1: a"), _run("triton", 1, 0.0, 0.0, rnd=2, error="b")]
    rows = serve.median_rows(runs)
    ours, theirs = rows
    assert ours["total_tok_s"] == 110.0 and ours["output_tok_s"] == 55.0 and ours["mean_tpot_ms"] == pytest.approx(3.15)
    assert ours["runs"] == 4 and ours["failed_runs"] == 1 and "error" not in ours
    assert ours["spread"] == {"total_tok_s": [90.0, 140.0], "mean_ttft_ms": [10.0, 10.0], "mean_tpot_ms": [3.0, 4.4]}
    assert ours["run_mean"]["total_tok_s"] == 112.5 and ours["run_mean"]["mean_tpot_ms"] == pytest.approx(3.425)
    text = serve.markdown({"engine": "vllm", "tp": 1, "gpus": 1, "gpu": "H100", "repeats": 2}, rows)
    assert "| flashqla | chat | 1 | 4 (1) | 90-140 (112) | 10.0-10.0 (10.0) | 3.00-4.40 (3.43) |" in text
    assert ours["clock_limits"] == ["SW power cap"] and "sample" not in ours and "round" not in ours
    assert theirs["error"] == "client exit 1: a" and theirs["runs"] == 0 and theirs["failed_runs"] == 2
    single = serve.median_rows([_run("triton", 32, 7.0, 2.0)])[0]
    assert single["total_tok_s"] == 7.0 and single["runs"] == 1 and "spread" not in single


def test_server_samples_add_up_and_agreement_is_a_backends_worst(tmp_path):
    key = {"engine": "vllm", "model": "m", "tp": 1, "repeats": 2}
    serve.save_backend(tmp_path, key, [_run("flashqla", 1, 100.0, 3.0)], {"backend": "flashqla", "tokens": [[1, 2]]})
    serve.save_backend(tmp_path, key, [_run("flashqla", 1, 80.0, 3.0, sample=3)],
                       {"backend": "flashqla", "sample": 3, "tokens": [[1, 3]]})
    serve.save_backend(tmp_path, {**key, "repeats": 1}, [], {"backend": "flashqla", "sample": 2})  # another setup
    samples = serve.load_samples(tmp_path, "flashqla", key)
    assert [s["info"].get("sample", 1) for s in samples] == [1, 3]
    assert serve.load_samples(tmp_path, "triton", key) == []
    infos = [s["info"] for s in samples] + [{"backend": "default", "tokens": [[1, 2]]}]
    runs = [r for s in samples for r in s["rows"]]
    serve.finish_rows(runs, infos, "default")
    assert [r["agree_fraction"] for r in runs] == [0.5, 0.5]


def _fake_engine(monkeypatch, calls: list) -> None:
    """Servers that start at once and a client that writes a result per point (``calls`` gets
    each result file's name), no nvidia-smi: run_backend and main without an engine."""

    class FakeProc:
        def poll(self):
            return None

    class FakeServer:
        def __init__(self, cmd, env, log_path, port):
            self.proc, self.started = FakeProc(), 0.0

        def start(self, timeout):
            return True

        def log_text(self):
            return ""

        def stop(self):
            pass

    class FakeClient:
        def __init__(self, engine, env):
            pass

        def run(self, cmd, log_path):
            out = pathlib.Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
            calls.append(out.name)
            out.write_text(json.dumps({"completed": int(cmd[cmd.index("--num-prompts") + 1]),
                                       "total_token_throughput": 10.0 * len(calls), "output_throughput": 1.0,
                                       "mean_ttft_ms": 1.0, "mean_tpot_ms": 1.0}))
            return 0, ""

        def close(self):
            pass

    class NoClocks:
        summary: dict = {}

        def __init__(self, path):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(serve, "Server", FakeServer)
    monkeypatch.setattr(serve, "Client", FakeClient)
    monkeypatch.setattr(serve, "ClockSampler", NoClocks)


def test_repeats_run_every_point_once_per_round_in_one_server(tmp_path, monkeypatch):
    calls = []
    _fake_engine(monkeypatch, calls)
    args = serve.parse_args(["--engine", "vllm", "--workloads", "short", "chat", "--concurrency", "1", "32",
                             "--repeats", "2", "--server-sample", "2", "--agree-prompts", "0"])
    s = serve.Setup("vllm", str(tmp_path / "model"), 1, 4096)
    rows, info = serve.run_backend(s, "flashqla", args, tmp_path, [], float("inf"))
    # the warm-up first (the first workload at the highest concurrency, other prompts), unmeasured
    assert calls == ["client-flashqla-warmup-s2.json"] + [
        f"client-flashqla-{w}-c{c}-s2-r{r}.json" for r in (1, 2) for w in ("short", "chat") for c in (1, 32)]
    assert info["warmup"]["workload"] == "short" and info["warmup"]["concurrency"] == 32
    assert info["warmup"]["num_prompts"] == 32  # one wave, where a measured point at 32 sends more
    assert [(r["workload"], r["concurrency"], r["round"], r["sample"]) for r in rows][:5] == [
        ("short", 1, 1, 2), ("short", 32, 1, 2), ("chat", 1, 1, 2), ("chat", 32, 1, 2), ("short", 1, 2, 2)]
    assert info["sample"] == 2 and not info.get("error")
    assert len(rows) == 8 and all(r["total_tok_s"] > 10.0 for r in rows)  # the warm-up is no row
    medians = serve.median_rows(rows)
    assert len(medians) == 4 and medians[0]["total_tok_s"] == 40.0 and medians[0]["runs"] == 2  # calls 2 and 6


def test_random_weights_reach_the_servers_and_make_another_setup(tmp_path, monkeypatch):
    """--weights random: each server gets QLA_BENCH_WEIGHTS=random, the results say so, and a
    work directory measured on the dummy weights has nothing to collect for it."""
    calls, envs = [], []
    _fake_engine(monkeypatch, calls)
    fake = serve.Server
    monkeypatch.setattr(serve, "Server", lambda cmd, env, log_path, port: envs.append(env.get(serve.WEIGHTS_ENV))
                        or fake(cmd, env, log_path, port))
    common = ["--engine", "vllm", "--model", "qwen3-next-80b-a3b", "--layers", "4", "--workloads", "short",
              "--concurrency", "128", "--agree-prompts", "0", "--work-dir", str(tmp_path / "work"),
              "--backends", "flashqla"]
    assert serve.main([*common, "--out-dir", str(tmp_path / "dummy")]) == 0
    assert serve.main([*common, "--collect", "--weights", "random", "--out-dir", str(tmp_path / "none")]) == 1
    assert serve.main([*common, "--weights", "random", "--out-dir", str(tmp_path / "random")]) == 0
    assert envs == ["dummy", "random"]
    data = json.loads(next((tmp_path / "random").glob("*-serve-vllm-tp1.json")).read_text())
    assert "random weights with GDN gates re-drawn" in data["meta"]["model"]


def test_servers_run_side_by_side_are_collected_into_one_results_file(tmp_path, monkeypatch):
    calls = []
    _fake_engine(monkeypatch, calls)
    monkeypatch.setattr(serve, "greedy_tokens", lambda s, prompts, n: [[7] * n for _ in prompts])
    common = ["--engine", "vllm", "--model", "qwen3-next-80b-a3b", "--layers", "4", "--workloads", "short",
              "--concurrency", "128", "--agree-prompts", "2", "--work-dir", str(tmp_path / "work")]
    # what serve-split runs: one call per GPU, each with its backend, sample and port
    for gpu, backend, sample in (("0", "flashqla", 1), ("1", "default", 1), ("3", "flashqla", 2)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpu)
        assert serve.main([*common, "--backends", backend, "--server-sample", str(sample),
                           "--out-dir", str(tmp_path / f"part-{gpu}")]) == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert serve.main([*common, "--collect", "--out-dir", str(tmp_path / "out")]) == 0
    assert len(calls) == 6  # a warm-up and a point per server: --collect started nothing
    data = json.loads(next((tmp_path / "out").glob("*-serve-vllm-tp1.json")).read_text())
    assert {(b["backend"], b["sample"], b["visible_gpus"]) for b in data["meta"]["backends"]} == {
        ("flashqla", 1, "0"), ("flashqla", 2, "3"), ("default", 1, "1")}
    assert data["meta"]["server_samples"] == {"flashqla": 2, "default": 1}
    ours = next(r for r in data["rows"] if r["backend"] == "flashqla")
    assert ours["runs"] == 2 and ours["agree_fraction"] == 1.0
    md = next((tmp_path / "out").glob("*-serve-vllm-tp1.md")).read_text()
    assert "| sample | GPUs |" in md and "| 2 | 3 |" in md
    # the stand-in's answers are one token repeated, and the results say what that agreement is worth
    assert data["meta"]["reference_distinct_tokens"] == 1
    assert "hold 1 distinct token(s) each (median): one token repeated, so agreement says little" in md
    # another setup's work directory holds nothing to collect: an error, not an empty file
    assert serve.main([*common[:-1], str(tmp_path / "empty"), "--collect", "--out-dir", str(tmp_path / "o2")]) == 1


def test_results_with_runs_show_the_spread(tmp_path):
    runs = [_run("flashqla", 1, 100.0, 3.0, rnd=1), _run("flashqla", 1, 120.0, 3.5, rnd=2)]
    meta = {"engine": "vllm", "tp": 1, "gpu": "H100", "gpus": 1, "model": "m", "model_name": "m", "command": "c",
            "repeats": 2, "server_samples": {"flashqla": 1}}
    path = serve.write_results(tmp_path, "stem", meta, serve.median_rows(runs), runs)
    data = json.loads(path.read_text())
    assert len(data["rows"]) == 1 and len(data["runs"]) == 2 and data["rows"][0]["total_tok_s"] == 110.0
    md = (tmp_path / "stem.md").read_text()
    assert "## Spread over runs" in md and "| flashqla | chat | 1 | 2 (0) | 100-120 (110) | 10.0-10.0 (10.0) | 3.00-3.50 (3.25) |" in md
    # a file written before the rows kept their runs' mean: the report takes it from the runs
    for r in data["rows"]:
        del r["run_mean"]
    path.write_text(json.dumps(data))
    assert serve.report([str(path)]) == 0
    assert "| 100-120 (110) | 10.0-10.0 (10.0) | 3.00-3.50 (3.25) |" in (tmp_path / "stem.md").read_text()


def test_profile_point_reports_the_first_rank_and_keeps_every_rank(tmp_path, monkeypatch):
    def trace(rank, kernel_us):
        d = tmp_path / "work" / "trace-flashqla-s2"
        d.mkdir(parents=True, exist_ok=True)
        ev = [{"ph": "X", "cat": "kernel", "name": "gdn_decode_kernel", "ts": 0, "dur": 10},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 10, "dur": kernel_us - 10}]
        with gzip.open(d / f"dp0_pp0_tp{rank}_rank{rank}.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": ev}, f)

    class FakeClient:
        def run(self, cmd, log_path):
            trace(1, 5000)  # the workers write their traces while the client runs
            trace(0, 1000)
            return 0, ""

    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    args = serve.parse_args(["--engine", "vllm", "--profile", "retrieval:1", "--profile-steps", "10",
                             "--server-sample", "2", "--out-dir", str(tmp_path / "out")])
    s = serve.Setup("vllm", str(tmp_path / "model"), 4, 4096)
    out = serve.profile_point(s, "flashqla", args, tmp_path / "work", FakeClient())
    assert out["trace"].startswith("dp0_pp0_tp0") and out["kernel_ms_per_step"] == pytest.approx(0.1)
    assert out["gdn_ms_per_step"] == {"recurrence (decode)": pytest.approx(0.001)}
    md = next((tmp_path / "out").glob("*-profile-flashqla-s2.md")).read_text()
    assert "dp0_pp0_tp0" in md and "dp0_pp0_tp1" in md
    # every rank's collectives per step, side by side (rank 1 sat in its all-reduce 10x longer)
    ranks = out["ranks_ms_per_step"]
    assert ranks[next(n for n in ranks if "tp1" in n)]["collectives"] == pytest.approx(0.499)
    assert ranks[next(n for n in ranks if "tp0" in n)]["collectives"] == pytest.approx(0.099)
    assert md.startswith("| trace |")
    assert out["gpu_span_ms_per_step"] == pytest.approx(0.1) and out["step_period_ms"] is None
    assert out["steps_by_kind"] == {}  # no step scopes nor launches in these traces: no split


def test_an_sglang_profile_takes_the_points_first_steps_into_the_work_directory(tmp_path, monkeypatch):
    """SGLang's client starts the server's profiler for --profile-steps forward steps and names the
    directory (it writes the traces in a folder of its own under it, one per TP rank); the summary
    splits the steps at SGLang's step spans. SGLang cannot start the window later (its start_step
    counts from the server's start): --profile-delay is refused."""
    seen = []

    class FakeClient:
        def run(self, cmd, log_path):
            seen.append(cmd)
            out = pathlib.Path(cmd[cmd.index("--profile-output-dir") + 1]) / "1795870170.1"
            out.mkdir(parents=True)
            ev = [{"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=1]", "ts": t, "dur": 50}
                  for t in (0, 3000, 6000)]
            ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t + 60, "dur": 5,
                    "args": {"correlation": t + 1}} for t in (0, 3000, 6000)]
            ev += [{"ph": "X", "cat": "kernel", "name": "gdn_decode_kernel", "ts": t + 100, "dur": 3,
                    "args": {"correlation": t + 1}} for t in (0, 3000, 6000)]
            with gzip.open(out / "1795870170.1-TP-0.trace.json.gz", "wt") as f:
                json.dump({"traceEvents": ev}, f)
            return 0, ""

    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    args = serve.parse_args(["--engine", "sglang", "--profile", "chat:1", "--profile-steps", "3",
                             "--out-dir", str(tmp_path / "out")])
    assert args.profile_delay == 0 and serve.parse_args(["--engine", "vllm"]).profile_delay == 40
    s = serve.Setup("sglang", str(tmp_path / "model"), 4, 4096)
    out = serve.profile_point(s, "flashqla", args, tmp_path / "work", FakeClient())
    cmd = seen[0]
    assert "--profile" in cmd and cmd[cmd.index("--profile-num-steps") + 1] == "3"
    assert cmd[cmd.index("--profile-output-dir") + 1] == str((tmp_path / "work" / "trace-flashqla").resolve())
    assert out["trace"].endswith("-TP-0.trace.json.gz") and out["step_period_ms"] == pytest.approx(3.0)
    assert out["steps_by_kind"] == {"decode only": {"steps": 3, "period_ms": 3.0, "kernel_ms": 0.003,
                                                    "recurrence_ms": 0.003, "comm_ms": 0.0, "span_ms": 0.003}}
    with pytest.raises(SystemExit):
        serve.parse_args(["--engine", "sglang", "--profile", "chat:1", "--profile-delay", "8"])


def test_results_put_the_profiled_servers_side_by_side():
    meta = {"engine": "vllm", "tp": 1, "profile": "retrieval:1", "backends": [
        {"backend": "flashqla", "visible_gpus": "0", "profile": {
            "trace": "t0", "kernel_ms_per_step": 2.0, "gpu_span_ms_per_step": 2.5, "no_kernel_ms_per_step": 0.5,
            "gdn_ms_per_step": {"recurrence (decode)": 0.02, "conv1d": 0.01}, "step_period_ms": 2.6,
            "host_ms_per_step": {"preprocess": 0.4, "forward": 0.1},
            "runtime_per_step": {"cudaGraphLaunch": [0.03, 1.0]}}},
        {"backend": "triton", "visible_gpus": "1", "sample": 2, "profile": {
            "trace": "t1", "kernel_ms_per_step": 2.0, "gpu_span_ms_per_step": 2.3, "no_kernel_ms_per_step": 0.3,
            "gdn_ms_per_step": {"recurrence (decode)": 0.03}, "step_period_ms": 2.4,
            "host_ms_per_step": {"preprocess": 0.3, "sample": 0.2}, "runtime_per_step": {}}},
        {"backend": "flashinfer", "visible_gpus": "2"}]}
    md = "\n".join(serve.profiles_markdown(meta))
    assert "## Profiles (retrieval:1, ms per step, first rank)" in md
    assert "| flashqla | 0 | 2.000 | 2.500 | 0.500 | 0.020 | 2.600 | 0.400 | 0.100 | — |" in md
    assert "| triton (sample 2) | 1 | 2.000 | 2.300 | 0.300 | 0.030 | 2.400 | 0.300 | — | 0.200 |" in md
    assert "| CUDA runtime call: host ms (calls) per step | flashqla | triton (sample 2) |" in md
    assert "| `cudaGraphLaunch` | 0.030 (1.0) | — |" in md and "flashinfer" not in md
    assert "steps (median per step)" not in md  # profiles without the split say nothing of it
    meta["backends"][0]["profile"]["steps_by_kind"] = {
        "with prefill": {"steps": 2, "period_ms": 10.0, "kernel_ms": 6.0, "recurrence_ms": 0.4, "comm_ms": 0.6,
                         "span_ms": 6.0},
        "decode only": {"steps": 3, "period_ms": None, "kernel_ms": 2.5, "recurrence_ms": 0.003, "comm_ms": 0.05,
                        "span_ms": 2.25}}
    md = "\n".join(serve.profiles_markdown(meta))
    assert "| flashqla | with prefill | 2 | 10.000 | 6.000 | 0.400 | 0.600 | 6.000 |" in md
    assert "| flashqla | decode only | 3 | — | 2.500 | 0.003 | 0.050 | 2.250 |" in md
    assert serve.profiles_markdown({"backends": [{"backend": "triton"}]}) == []


def test_agreement_falls_back_to_a_built_in_backend_when_the_reference_did_not_run():
    """A side-by-side run of named backends only (flashqla, triton, flashinfer; no 'default' server)
    still measures agreement, against the first built-in backend that has tokens, and says so."""
    rows = [{"backend": b, "workload": "short"} for b in ("flashqla", "flashinfer", "triton")]
    infos = [{"backend": "flashqla", "tokens": [[1, 2, 3, 4]]}, {"backend": "triton", "tokens": [[1, 2, 3, 5]]},
             {"backend": "flashinfer", "tokens": [[1, 2, 3, 4]]}]
    assert serve.finish_rows(rows, infos, "default") == "flashinfer"
    assert [r["agree_fraction"] for r in rows] == [1.0, 1.0, 0.75]
    assert serve.finish_rows(rows, infos[:1], "default") is None  # ours alone: nothing to agree with
    assert rows[0]["agree_fraction"] is None
    text = serve.markdown({"engine": "vllm", "tp": 1, "gpus": 1, "gpu": "H100", "reference": "flashinfer",
                           "agreement": "8 prompts", "backends": [{"backend": "flashqla"}]}, [])
    assert "Reference for agreement: flashinfer; 8 prompts." in text


@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs taskset and two CPUs")
def test_servers_side_by_side_get_cpus_of_their_own(tmp_path):
    """serve-split with QLA_SPLIT_CPUS=even: each slot's harness (and the server it starts) runs on
    an equal share of the CPUs, disjoint from the other slots' (here dry runs, which log their set)."""
    cpus = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "QLA_STAGE": str(tmp_path / "stage"), "QLA_SPLIT_CPUS": "even",
           "QLA_SERVE_SPLIT": "0:flashqla 1:triton",
           "QLA_SERVE_ARGS": ("--engine vllm --model qwen3-next-80b-a3b --layers 8 --workloads short --concurrency 1 "
                              f"--dry-run --work-dir {tmp_path / 'work'}")}
    run = lambda: subprocess.run(["bash", str(REPO / "scripts/gpu_session.sh"), "serve-split"], env=env,  # noqa: E731
                                 capture_output=True, text=True, timeout=300, check=False)
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    per = len(cpus) // 2
    sets = [line.split("CPUs: ")[1] for line in r.stdout.splitlines() if "] CPUs: " in line]
    assert sets[:2] == [_cpu_text(cpus[:per]), _cpu_text(cpus[per:2 * per])], r.stdout
    assert all(":turns" not in line for line in r.stdout.splitlines() if "lockstep: " in line), r.stdout
    # slots sharing GPUs (two TP 2 servers on the same two GPUs) measure in turns
    env["QLA_SERVE_SPLIT"] = "0,1:flashqla 0,1:triton"
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    modes = [line.split("lockstep: ")[1] for line in r.stdout.splitlines() if "] lockstep: " in line]
    assert len(modes) == 2 and all(m.endswith(":2:turns") for m in modes), r.stdout
    # local: each slot on its GPUs' NUMA node (a stand-in nvidia-smi and sysfs), slots in turns on the same CPUs
    bin_dir, pci = tmp_path / "bin", tmp_path / "pci"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\ncase "$*" in *pci.bus_id*) printf "0, 00000000:18:00.0\\n'
                                        '1, 00000000:9A:00.0\\n";; *) echo "Stand-in GPU, 0, 1 MiB";; esac\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    half = len(cpus) // 2
    for bus, node in (("0000:18:00.0", cpus[:half]), ("0000:9a:00.0", cpus[half:])):
        (pci / bus).mkdir(parents=True)
        (pci / bus / "local_cpulist").write_text(",".join(map(str, node)) + "\n")
    env.update(QLA_SPLIT_CPUS="local", QLA_PCI_ROOT=str(pci), PATH=f"{bin_dir}:{env['PATH']}",
               QLA_SERVE_SPLIT="1:flashqla 0:triton")
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    by_log, log = {}, None  # each slot's log (named by its GPU) and the CPUs it logged
    for line in r.stdout.splitlines():
        log = line[3:] if line.startswith("-- ") else log
        if "] CPUs: " in line:
            by_log.setdefault(log, line.split("CPUs: ")[1])
    assert by_log == {"qla-serve-split-gpu1-flashqla.log": _cpu_text(cpus[half:]),
                      "qla-serve-split-gpu0-triton.log": _cpu_text(cpus[:half])}, r.stdout
    env["QLA_SERVE_SPLIT"] = "0:flashqla 0:triton"
    r = run()
    sets = [line.split("CPUs: ")[1] for line in r.stdout.splitlines() if "] CPUs: " in line]
    assert r.returncode == 0 and sets[:2] == [_cpu_text(cpus[:half])] * 2, r.stdout
    env["QLA_SERVE_SPLIT"] = "2:flashqla"  # a GPU nvidia-smi does not list: a clear refusal
    r = run()
    assert r.returncode != 0 and "no CPUs local to GPUs 2" in r.stdout, r.stdout
    env["QLA_SPLIT_CPUS"] = "odd"
    r = run()
    assert r.returncode != 0 and "'even' (an equal share per slot) or 'local'" in r.stdout


def test_local_cpus_are_the_gpus_numa_nodes_within_the_allowed(tmp_path):
    """gpu_local_cpus: the sysfs CPU list of each GPU's PCI device (bus id as nvidia-smi prints it),
    united over a slot's GPUs and cut to the CPUs this process may use; a clear error otherwise."""
    for bus, text in (("0000:18:00.0", "0-3,8-9\n"), ("0000:9a:00.0", "4-7\n")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "local_cpulist").write_text(text)
    ids = {0: "00000000:18:00.0", 1: "00000000:9A:00.0"}
    assert serve.parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert serve.gpu_local_cpus([0], ids, set(range(16)), str(tmp_path)) == [0, 1, 2, 3, 8, 9]
    assert serve.gpu_local_cpus([0, 1], ids, set(range(6)), str(tmp_path)) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="GPU 2: no PCI bus id"):
        serve.gpu_local_cpus([2], ids, set(range(16)), str(tmp_path))
    with pytest.raises(ValueError, match="none of their local CPUs"):
        serve.gpu_local_cpus([1], ids, {0, 1}, str(tmp_path))
    with pytest.raises(ValueError, match="GPU 0: no CPU list"):
        serve.gpu_local_cpus([0], ids, {0}, str(tmp_path / "elsewhere"))


def _cpu_text(cpus: list[int]) -> str:
    """The expected log text of a CPU set: ranges of consecutive CPUs, then the count."""
    ranges, start = [], cpus[0]
    for a, b in zip(cpus, cpus[1:] + [None]):
        if b != a + 1:
            ranges.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return f"{','.join(ranges)} ({len(cpus)})"


def test_the_harness_names_its_cpus_as_ranges(monkeypatch):
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 8, 10, 11})
    assert serve.cpu_set() == "0-3,8,10-11 (7)"


def test_servers_side_by_side_measure_each_point_together(tmp_path):
    """--lockstep ID:N: a slot waits at each point until every slot has arrived there or left; a
    slot whose server failed leaves at once and is not waited for; a deadline ends a wait."""
    import threading

    ls = {name: serve.Lockstep("run1:3", tmp_path, name) for name in ("a", "b", "c")}
    ls["c"].leave()  # its server did not start
    waited = {}
    late = threading.Thread(target=lambda: (time.sleep(1.0), waited.update(b=ls["b"].wait("r1-chat-c1", time.monotonic() + 30))))
    late.start()
    waited["a"] = ls["a"].wait("r1-chat-c1", time.monotonic() + 30)
    late.join()
    assert waited["a"] >= 0.8 and waited["b"] is not None and waited["b"] < 0.5  # a waited for b, b for nobody
    # the next point: b has left (its budget ran out), so a goes on alone
    ls["b"].leave()
    assert ls["a"].wait("r1-chat-c32", time.monotonic() + 30) < 0.5
    # another run's files (another ID) count for nothing; a wait ends at its deadline
    other = serve.Lockstep("run2:2", tmp_path, "a")
    assert other.wait("r1-chat-c1", time.monotonic() + 0.5) is None
    assert serve.Lockstep("", tmp_path, "a").wait("x", 0) is None  # off
    with pytest.raises(ValueError, match="ID:N"):
        serve.Lockstep("run3", tmp_path, "a")


def test_servers_sharing_gpus_measure_each_point_in_turns(tmp_path):
    """--lockstep ID:N:turns: at each point the slots measure one after another (a slot's turn ends
    when it arrives at the next point), the first slot rotating from point to point; a slot that
    leaves ends its turns."""
    import threading

    keys = ["warm-up", "r1-long-c1", "r1-long-c32", "r2-long-c1"]
    spans: dict[str, list[tuple[str, float, float]]] = {k: [] for k in keys}
    lock = threading.Lock()

    turns: dict[str, list[int]] = {}

    def slot(name, stop_after=None):
        ls = serve.Lockstep("run1:3:turns", tmp_path, name)
        for i, key in enumerate(keys):
            if i == stop_after:
                break
            assert ls.wait(key, time.monotonic() + 30) is not None
            t0 = time.monotonic()
            time.sleep(0.15 if name != "b" else 0.25)
            with lock:
                spans[key].append((name, t0, time.monotonic()))
                turns.setdefault(name, []).append(ls.turn)
        ls.leave()

    threads = [threading.Thread(target=slot, args=a) for a in (("a",), ("b",), ("c", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    firsts = []
    for key in keys:
        got = sorted(spans[key], key=lambda r: r[1])
        for (_, _, end), (_, start, _) in zip(got, got[1:]):
            assert start >= end - 0.01, (key, got)  # one at a time
        firsts.append(got[0][0])
    assert firsts[:3] == ["a", "b", "c"], firsts  # the order rotates by point
    assert turns["a"][:3] == [0, 2, 1] and turns["c"] == [2, 1, 0], turns  # each slot's place, as rows record it
    assert sorted(r[0] for r in spans[keys[-1]]) == ["a", "b"]  # c left before the last point
    with pytest.raises(ValueError, match="ID:N"):
        serve.Lockstep("run1:2:taking-turns", tmp_path, "a")


def test_servers_in_turns_start_one_after_another_in_slot_order(tmp_path):
    """Lockstep.wait_start in turns: a slot's server starts once every slot before it (by port, the
    split's order, not by name) has started its server or left; without turns nothing waits."""
    import threading

    names = ["triton-port8321", "default-port8421", "flashqla-port8521"]
    ls = {n: serve.Lockstep("run1:3:turns", tmp_path, n) for n in names}
    events: list[str] = []
    lock = threading.Lock()

    def slot(name, up_after, fail=False):
        waited = ls[name].wait_start(time.monotonic() + 30)
        with lock:
            events.append(f"start {name}")
        time.sleep(up_after)
        if fail:
            ls[name].leave()  # its server did not come up: the next one starts anyway
        else:
            ls[name].started()
        with lock:
            events.append(f"up {name}" if not fail else f"gone {name}")
        return waited

    threads = [threading.Thread(target=slot, args=a) for a in
               ((names[2], 0.1), (names[1], 0.4, True), (names[0], 0.3))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert events == ["start triton-port8321", "up triton-port8321", "start default-port8421",
                      "gone default-port8421", "start flashqla-port8521", "up flashqla-port8521"], events
    assert serve._slot_order("a") == (0, "a") and serve._slot_order("x-port9") == (9, "x-port9")
    assert serve.Lockstep("run2:2", tmp_path, "a").wait_start(time.monotonic() + 1) is None  # not in turns
    assert serve.Lockstep("", tmp_path, "a").wait_start(0) is None  # off
    # a slot that never arrives: the wait ends at the deadline, and the server starts
    assert serve.Lockstep("run3:2:turns", tmp_path, "b-port2").wait_start(time.monotonic() + 0.5) is None


def test_a_slot_that_starts_late_is_waited_for_before_any_point(tmp_path, monkeypatch):
    """Two run_backend calls in lockstep, one server healthy a second after the other: neither
    measures a point (nor its warm-up) before both are up, and they measure each point together."""
    import threading

    calls = []
    _fake_engine(monkeypatch, calls)
    began: dict[str, float] = {}
    BaseServer, BaseClient = serve.Server, serve.Client

    class LateServer(BaseServer):
        def __init__(self, cmd, env, log_path, port):
            super().__init__(cmd, env, log_path, port)
            self.port = port

        def start(self, timeout):
            time.sleep(1.0 if self.port == 8421 else 0.0)
            began[f"healthy-{self.port}"] = time.monotonic()
            return True

    class TimedClient(BaseClient):
        def run(self, cmd, log_path):
            began[cmd[cmd.index("--result-filename") + 1]] = time.monotonic()
            return super().run(cmd, log_path)

    monkeypatch.setattr(serve, "Server", LateServer)
    monkeypatch.setattr(serve, "Client", TimedClient)
    results = {}

    def slot(backend, port):
        args = serve.parse_args(["--engine", "vllm", "--workloads", "short", "--concurrency", "1", "32",
                                 "--agree-prompts", "0", "--port", str(port), "--lockstep", "t1:2"])
        s = serve.Setup("vllm", str(tmp_path / "model"), 1, 4096, port=port)
        results[backend] = serve.run_backend(s, backend, args, tmp_path, [], time.monotonic() + 60)

    threads = [threading.Thread(target=slot, args=a) for a in (("flashqla", 8321), ("triton", 8421))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    late = began["healthy-8421"]
    for point in ("warmup", "short-c1", "short-c32"):
        ours, theirs = (began[f"client-{b}-{point}.json"] for b in ("flashqla", "triton"))
        assert ours >= late and abs(ours - theirs) < 0.5, (point, ours - late, theirs - late)
    rows = results["flashqla"][0]
    assert rows[0]["lockstep_wait_s"] is not None and all(not r.get("error") for r in rows)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_sglang_servers_in_turns_start_one_after_another(tmp_path, monkeypatch, engine):
    """run_backend in turns: SGLang's servers start one at a time, the second slot's once the first
    is healthy (SGLang sizes its pools from the memory free at its start); vLLM's, whose pools are
    given in bytes, start together."""
    import threading

    _fake_engine(monkeypatch, [])
    spans: dict[int, tuple[float, float]] = {}
    BaseServer = serve.Server

    class SlowServer(BaseServer):
        def __init__(self, cmd, env, log_path, port):
            super().__init__(cmd, env, log_path, port)
            self.port = port

        def start(self, timeout):
            t0 = time.monotonic()
            time.sleep(0.5)
            spans[self.port] = (t0, time.monotonic())
            return True

    monkeypatch.setattr(serve, "Server", SlowServer)
    infos = {}

    def slot(port):
        args = serve.parse_args(["--engine", engine, "--agree-prompts", "0", "--port", str(port),
                                 "--lockstep", f"{engine}:2:turns"])
        args.workloads = []  # the start only
        s = serve.Setup(engine, str(tmp_path / "model"), 4, 4096, port=port)
        infos[port] = serve.run_backend(s, "flashqla" if port == 8321 else "triton", args, tmp_path, [],
                                        time.monotonic() + 60)[1]

    threads = [threading.Thread(target=slot, args=(port,)) for port in (8421, 8321)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    (first_begin, first_up), (second_begin, _) = spans[8321], spans[8421]
    if engine == "sglang":
        assert second_begin >= first_up - 0.01, spans  # the slot of the higher port waited for the first
        assert infos[8421]["start_waited_s"] >= 0.4 and infos[8321]["start_waited_s"] < 0.4
    else:
        assert abs(second_begin - first_begin) < 0.3 and "start_waited_s" not in infos[8421], spans


def test_ratios_come_from_runs_measured_together():
    """The paired table: ours over each built-in per (lockstep run, round); a run from another
    lockstep run or outside any, or a failed one, pairs with nothing."""
    def run(backend, tok, tpot, rnd, lockstep="A:2", **kw):
        return {**_run(backend, 1, tok, tpot, rnd=rnd, **kw), "lockstep": lockstep, "mean_ttft_ms": tok / 100}

    runs = [run("flashqla", 110.0, 3.0, 1), run("triton", 100.0, 3.3, 1),  # round 1: 1.10x
            run("flashqla", 90.0, 3.6, 2), run("triton", 75.0, 4.0, 2),  # round 2: the host slower, 1.20x
            run("triton", 200.0, 1.0, 1, lockstep="B:2"),  # another call: no partner of ours there
            run("flashqla", 500.0, 1.0, 3, lockstep=None), run("triton", 1.0, 1.0, 3, lockstep=None),
            run("flashqla", 1.0, 1.0, 4, error="client exit 1"), run("triton", 100.0, 1.0, 4)]
    (p,) = serve.paired_ratios(runs)
    assert (p["workload"], p["versus"], p["pairs"]) == ("chat", "triton", 2)
    assert p["total_tok_s"]["median"] == pytest.approx(1.15)
    assert (p["total_tok_s"]["min"], p["total_tok_s"]["max"]) == (pytest.approx(1.1), pytest.approx(1.2))
    assert p["mean_tpot"]["max"] == pytest.approx(0.909, abs=1e-3)
    rows = serve.median_rows(runs)
    md = serve.markdown({"engine": "vllm", "tp": 1}, rows, runs)
    assert "## flashqla against each built-in backend, measured together" in md
    assert "| chat | 1 | triton | 2 | 1.150x (1.100-1.200) |" in md
    assert "measured together" not in serve.markdown({"engine": "vllm", "tp": 1}, rows)


SGLANG_DECODE_LINE = ("[2026-11-28 16:18:20] Decode batch, #running-req: {n}, #full token: 377472, full token usage: "
                      "0.03, mamba num: 256, mamba usage: 0.16, cuda graph: True, gen throughput (token/s): {rate}, "
                      "#queue-req: 0\n")
VLLM_STATS_LINE = ("(APIServer pid=1) INFO 11-28 16:18:20 [loggers.py:259] Engine 000: Avg prompt throughput: {prompt} "
                   "tokens/s, Avg generation throughput: {rate} tokens/s, Running: {n} reqs, Waiting: 0 reqs, "
                   "GPU KV cache usage: 3.1%, Prefix cache hit rate: 0.0%\n")


def test_the_engines_decode_rate_is_the_median_of_its_full_batch_lines():
    """SGLang's decode lines and vLLM's stat lines at the point's concurrency; vLLM's windows that
    took prompt tokens and every line of a smaller batch are left out."""
    text = "".join(SGLANG_DECODE_LINE.format(n=n, rate=r) for n, r in
                   ((1, 9.3), (128, 16269.0), (128, 16508.2), (127, 99999.0), (128, 16255.5)))
    assert serve.engine_decode_rate("sglang", text, 128) == {"engine_decode_tok_s": 16269.0, "engine_decode_lines": 3}
    assert serve.engine_decode_rate("sglang", text, 64) == {}
    text = "".join(VLLM_STATS_LINE.format(prompt=p, rate=r, n=n) for p, r, n in
                   ((2048.0, 900.0, 128), (0.0, 5000.0, 128), (0.0, 5200.0, 128), (0.0, 8000.0, 100)))
    assert serve.engine_decode_rate("vllm", text, 128) == {"engine_decode_tok_s": 5100.0, "engine_decode_lines": 2}


def test_a_points_engine_rate_comes_from_the_log_lines_written_during_it(tmp_path, monkeypatch):
    """Lines the server logged before a point (the start-up, the warm-up, the point before) do not
    count for it; the medians, the pairs and both tables carry the rate."""
    calls = []
    _fake_engine(monkeypatch, calls)
    logf = tmp_path / "server-flashqla.log"
    logf.write_text(VLLM_STATS_LINE.format(prompt=0.0, rate=1.0, n=32))  # before any point
    during = iter([[7.0], [100.0, 300.0, 200.0], [50.0]])  # warm-up, round 1, round 2
    fake = serve.Client

    class LoggingClient(fake):
        def run(self, cmd, log_path):
            out = super().run(cmd, log_path)
            with open(logf, "a") as f:
                f.writelines(VLLM_STATS_LINE.format(prompt=0.0, rate=r, n=32) for r in next(during))
            return out

    monkeypatch.setattr(serve, "Client", LoggingClient)
    args = serve.parse_args(["--engine", "vllm", "--workloads", "short", "--concurrency", "32", "--repeats", "2",
                             "--agree-prompts", "0", "--lockstep", "A:1"])
    rows, _ = serve.run_backend(serve.Setup("vllm", str(tmp_path / "model"), 1, 4096), "flashqla", args, tmp_path,
                                [], float("inf"))
    assert [(r["engine_decode_tok_s"], r["engine_decode_lines"]) for r in rows] == [(200.0, 3), (50.0, 1)]
    rows = [{**r, "agree_fraction": 1.0} for r in rows]  # (main adds it)
    assert serve.median_rows(rows)[0]["engine_decode_tok_s"] == 125.0
    theirs = [{**r, "backend": "triton", "engine_decode_tok_s": 100.0} for r in rows]
    (p,) = serve.paired_ratios(rows + theirs)
    assert p["engine_decode_tok_s"] == {"median": 1.25, "min": 0.5, "max": 2.0, "pairs": 2}
    md = serve.markdown({"engine": "vllm", "tp": 1}, serve.median_rows(rows + theirs), rows + theirs)
    assert "| 1.000x (1.000-1.000) | 1.250x (0.500-2.000) |" in md
    # against the best built-in backend, by the medians: 125 over 100
    (best,) = serve.against_best(serve.median_rows(rows + theirs))
    assert best["engine_decode_tok_s"] == 1.25 and "| 1.000x | 1.250x |" in md
    # the per-point table's last cell
    assert any(line.startswith("| flashqla | 32 |") and line.endswith("| 125 |") for line in md.splitlines())


def _profiled(backend, gdn, step, kernels, resolved=None, host_us=None, sample=1):
    return {"backend": backend, "resolved": resolved or backend, "sample": sample, "profile": {
        "trace": f"t-{backend}-{sample}", "kernel_ms_per_step": kernels, "step_period_ms": step,
        "gdn_ms_per_step": gdn, "gdn_op_host_us": {"calls": 0 if host_us is None else 6, "median": host_us}}}


def test_at_concurrency_1_the_bound_weighs_the_steps_as_one_request_does():
    """A profile window of 4 prefill and 16 decode steps weighs prefill as a fifth of the steps; a
    32768-token request of 256 output tokens has 4 chunks and 255 decode steps. The request bound
    takes what ours saves per step of each kind (the recurrence per kind, the other GDN parts on
    the prefill steps) over the other backend's measured request (TTFT + 255 TPOTs), and the TTFT
    the prefill's saving allows; the share of the bound is of it."""
    def prof(backend, rec_p, rec_d, parts):
        b = _profiled(backend, {"recurrence (prefill)": rec_p * 4 / 20, "recurrence (decode)": rec_d * 16 / 20, **parts},
                      6.0, 3.0)
        b["profile"]["steps_by_kind"] = {"with prefill": {"steps": 4, "recurrence_ms": rec_p},
                                         "decode only": {"steps": 16, "recurrence_ms": rec_d}}
        b["capacity"] = {"chunked_prefill_size": 8192}
        return b

    meta = {"profile": "long:1", "backends": [prof("flashqla", 1.0, 0.01, {"conv1d": 0.05}),
                                              prof("triton", 2.0, 0.03, {"conv1d": 0.05, "post-conv prep": 0.02})]}
    rows = [{"backend": b, "workload": "long", "concurrency": 1, "input_len": 32768, "output_len": 256,
             "total_tok_s": tok, "mean_ttft_ms": ttft, "mean_tpot_ms": 3.0}
            for b, tok, ttft in (("flashqla", 1014.0, 230.0), ("triton", 1000.0, 240.0))]
    (t,) = serve.kernel_bound(meta, rows, [])
    # per prefill step ours 1.0 + 0.05 * 20 / 4, theirs 2.0 + 0.07 * 20 / 4: 1.1 ms saved; per decode 0.02
    saved = 4 * 1.1 + 255 * 0.02
    assert t["chunks"] == 4 and t["saved_request_ms"] == pytest.approx(saved)
    assert t["request_ms"] == pytest.approx(240.0 + 255 * 3.0)
    assert t["bound_request"] == pytest.approx(1005.0 / (1005.0 - saved))
    assert t["bound_ttft"] == pytest.approx((240.0 - 4.4) / 240.0) and t["measured_ttft"] == pytest.approx(230 / 240)
    assert t["bound_request"] < serve.BOUND_MIN and t["reached"] is None  # under 1%: no share
    assert t["bound_step"] > serve.BOUND_MIN  # the window's mix alone would have given one
    md = "\n".join(serve.bound_markdown(meta, rows, []))
    assert f"| {t['bound_request']:.3f}x | 0.982x | 1.014x (medians) | 0.958x | bound under 1% |" in md
    # a larger decode saving clears 1%: the share is of the request bound
    meta["backends"][1]["profile"]["steps_by_kind"]["decode only"]["recurrence_ms"] = 0.1
    (t,) = serve.kernel_bound(meta, rows, [])
    b = 1005.0 / (1005.0 - (4.4 + 255 * 0.09))
    assert t["bound_request"] == pytest.approx(b) and t["reached"] == pytest.approx(0.014 / (b - 1))
    # the engine's chunk size, where the results hold it, sets the chunks (16384: 2), else the window's
    meta["backends"][1]["capacity"] = {"chunked_prefill_size": 16384}
    assert serve.kernel_bound(meta, rows, [])[0]["chunks"] == 2
    del meta["backends"][1]["capacity"]
    assert serve.kernel_bound(meta, rows, [])[0]["chunks"] == 4
    # a window without decode steps has no per-kind saving: the step bound alone
    del meta["backends"][0]["profile"]["steps_by_kind"]["decode only"]
    (t,) = serve.kernel_bound(meta, rows, [])
    assert t["bound_request"] is None and t["reached"] == pytest.approx(0.014 / (t["bound_step"] - 1))


def test_the_bound_is_the_gdn_time_ours_saves_taken_off_the_other_step():
    """Issue #24's bound at the profiled point: bound = step / (step - saved), saved the other
    backend's GDN kernel time per step less ours (all GDN parts, median over a backend's servers);
    the measured gain beside it, paired where the runs were measured together."""
    meta = {"profile": "long:32", "backends": [
        _profiled("flashqla", {"recurrence (prefill)": 1.0, "conv1d": 0.5}, 20.0, 15.0, host_us=40.0),
        _profiled("flashqla", {"recurrence (prefill)": 1.4, "conv1d": 0.5}, 22.0, 15.0, host_us=50.0, sample=2),
        _profiled("triton", {"recurrence (prefill)": 4.0, "conv1d": 0.5}, 24.0, 18.0, host_us=30.0),
        _profiled("default", {"recurrence (prefill)": 2.2, "conv1d": 0.5}, 21.0, 16.0, resolved="flashinfer"),
        {"backend": "triton", "sample": 2}]}  # a server without a profile counts for nothing here
    runs = [{**_run(b, 32, tok, 10.0), "workload": "long", "lockstep": "A:3", "mean_ttft_ms": 100.0}
            for b, tok in (("flashqla", 1050.0), ("triton", 1000.0), ("default", 1020.0))]
    for r in runs:
        r["backend_resolved"] = "flashinfer" if r["backend"] == "default" else r["backend"]
    got = {a["versus"]: a for a in serve.kernel_bound(meta, serve.median_rows(runs), runs)}
    assert set(got) == {"triton", "flashinfer"}
    ours = (1.5 + 1.9) / 2  # the median of our two servers' GDN time per step
    t = got["triton"]
    assert t["gdn_ms_ours"] == pytest.approx(ours) and t["saved_ms"] == pytest.approx(4.5 - ours)
    assert t["bound_step"] == pytest.approx(24.0 / (24.0 - (4.5 - ours)))
    assert t["bound_gpu"] == pytest.approx(18.0 / (18.0 - (4.5 - ours)))
    assert (t["measured"], t["measured_from"]) == (pytest.approx(1.05), "paired")
    assert t["reached"] == pytest.approx(0.05 / (t["bound_step"] - 1))
    assert (t["gdn_host_us_ours"], t["gdn_host_us_versus"]) == (pytest.approx(45.0), pytest.approx(30.0))
    f = got["flashinfer"]  # 2.7 - 1.7 = 1.0 ms of a 21 ms step: under 5%
    assert f["bound_step"] == pytest.approx(21.0 / 20.0) and f["measured"] == pytest.approx(1050 / 1020)
    md = "\n".join(serve.bound_markdown(meta, serve.median_rows(runs), runs))
    assert "## What the GDN kernels allow (long:32)" in md
    assert ("| flashinfer | 1.700 | 2.700 | 1.000 | 21.000 | 16.000 | 1.050x | 1.067x | — | — | 1.029x (paired) | "
            "1.000x | 59% |") in md  # at concurrency 32 no request bound
    # without a lockstep the measured gain is the medians' ratio; a bound under 1% has no share
    solo = [{k: v for k, v in r.items() if k != "lockstep"} for r in runs]
    meta["backends"][2]["profile"]["gdn_ms_per_step"] = {"recurrence (prefill)": 1.8}
    t = next(a for a in serve.kernel_bound(meta, serve.median_rows(solo), solo) if a["versus"] == "triton")
    assert t["measured_from"] == "medians" and t["measured"] == pytest.approx(1.05)
    assert t["bound_step"] < serve.BOUND_MIN and t["reached"] is None
    assert "bound under 1%" in "\n".join(serve.bound_markdown(meta, serve.median_rows(solo), solo))
    # nothing profiled of ours, or no --profile: no table
    assert serve.kernel_bound({**meta, "backends": meta["backends"][2:]}, [], []) == []
    assert serve.bound_markdown({"backends": meta["backends"]}, [], []) == []


def test_a_wait_that_runs_into_the_budget_leaves_the_points_out(tmp_path, monkeypatch):
    """In lockstep with a slot that never comes, the wait ends at the budget, and what the budget
    no longer holds is left out, not measured late."""
    calls = []
    _fake_engine(monkeypatch, calls)
    args = serve.parse_args(["--engine", "vllm", "--workloads", "short", "--concurrency", "1", "32",
                             "--agree-prompts", "0", "--no-server-warmup", "--lockstep", "t2:2"])
    s = serve.Setup("vllm", str(tmp_path / "model"), 1, 4096)
    t0 = time.monotonic()
    rows, info = serve.run_backend(s, "flashqla", args, tmp_path, [], t0 + 0.6)
    assert rows == [] and calls == [] and info["left_out"] == ["short@1", "short@32"]
    assert 0.5 < time.monotonic() - t0 < 5
