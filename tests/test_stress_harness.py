"""The stress harness (e2e_bench/stress.py) on the CPU: its request plan, HTTP client (against a
local stand-in server speaking vLLM's and SGLang's request shapes), metrics parsing, oracle
comparison, and a run split over calls by --phase (stand-in servers). The engines' own parsers
read its server commands in tests/vllm and tests/sglang."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import tarfile
import threading
import time
from typing import ClassVar

import pytest

from e2e_bench import serve, stress


def _flags(**kw) -> list[str]:
    return [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _args(**kw):
    return stress.parse_args(["--engine", "vllm", *_flags(**kw)])


def test_plan_covers_every_scenario():
    args = _args(requests=50, max_prompt=4096, longest=8192, aborts=4, suffixes=3)
    plan = stress.plan_requests(args)
    assert set(plan) == {"load", "abort", "prefix"}
    load = plan["load"]
    assert len(load) == 50 and len(load[-1]["prompt"]) == 8192
    assert all(1 <= len(r["prompt"]) <= 4096 for r in load[:-1])
    assert [r["at"] for r in load] == sorted(r["at"] for r in load) and load[0]["at"] == 0
    assert sum(1 for r in plan["abort"] if r.get("abort")) == 4
    assert {r["abort"] for r in plan["abort"] if r.get("abort")} == {"prefill", "decode"}
    # the new requests come after the aborted ones, on the slots those let go of
    assert all(r["at"] == stress.AFTER_ABORT_S for r in plan["abort"] if not r.get("abort"))
    assert {len(r["prompt"]) for r in plan["abort"] if r.get("abort") == "prefill"} == {
        min(stress.ABORT_PREFILL_PROMPT, 4096)}
    pre = plan["prefix"]
    assert len(pre) == 3 * len(stress.BLOCK_UNALIGNED_PREFIXES)
    plen = stress.BLOCK_UNALIGNED_PREFIXES[2]
    group = [r["prompt"] for r in pre if r["id"].startswith("prefix-2-")]
    assert all(g[:plen] == group[0][:plen] for g in group) and len({len(g) for g in group}) == 3
    assert all(p % 16 for p in stress.BLOCK_UNALIGNED_PREFIXES)  # never a multiple of a block size
    assert stress.plan_requests(args)["load"][3]["prompt"] == load[3]["prompt"]  # deterministic


def test_arrivals_average_the_rate():
    at = stress.poisson_arrivals(4000, 20.0, seed=3)
    assert 4000 / at[-1] == pytest.approx(20.0, rel=0.1)


@pytest.mark.parametrize("engine", serve.ENGINES)
def test_bad_requests_are_what_the_issue_lists(engine):
    names = [n for n, _ in stress.bad_requests(1000, engine)]
    assert names == ["empty prompt", "prompt over max_model_len", "max_tokens 0", "max_tokens huge",
                     "malformed JSON", "not UTF-8"]
    bodies = dict(stress.bad_requests(1000, engine))
    with pytest.raises(ValueError):
        json.loads(bodies["malformed JSON"])
    with pytest.raises(UnicodeDecodeError):
        bodies["not UTF-8"].decode("utf-8")
    prompt, tokens = ("prompt", "max_tokens") if engine == "vllm" else ("input_ids", "max_new_tokens")
    over = json.loads(bodies["prompt over max_model_len"])
    assert len(over[prompt]) > 1000
    # each in the shape of the engine's endpoint (SGLang's /generate would ignore vLLM's fields and
    # answer every one "no input", testing nothing); SGLang's own dataclasses read them in tests/sglang
    params = (lambda b: b) if engine == "vllm" else (lambda b: b["sampling_params"])
    assert params(json.loads(bodies["max_tokens 0"]))[tokens] == 0
    assert params(json.loads(bodies["max_tokens huge"]))[tokens] == 10**9
    assert json.loads(bodies["empty prompt"])[prompt] == []


def test_parse_metrics_sums_label_sets():
    text = """# HELP vllm:num_preemptions_total preemptions
vllm:num_preemptions_total{engine="0",model_name="bench"} 3.0
vllm:prefix_cache_hits_total{engine="0"} 1200.0
vllm:prefix_cache_queries_total{engine="0"} 5000.0
vllm:request_success_total{finished_reason="length"} 40.0
vllm:request_success_total{finished_reason="stop"} 2.0
vllm:num_requests_running{engine="0"} 1.0
"""
    m = stress.parse_metrics(text)
    assert m == {"preemptions": 3.0, "prefix_cache_hits": 1200.0, "prefix_cache_queries": 5000.0,
                 "requests_ok": 42.0, "spec_draft_tokens": 0.0, "spec_accepted_tokens": 0.0}
    assert stress.drafts_accepted(m) == "—"


def test_parse_metrics_sglang_names():
    """SGLang's counters as its multiprocess Prometheus collector prints them (names checked against
    SGLang's own collectors in tests/sglang)."""
    text = """# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{engine_type="unified",model_name="bench",pp_rank="0",tp_rank="0"} 2.0
sglang:cached_tokens_total{cache_source="device",model_name="bench"} 900.0
sglang:cached_tokens_total{cache_source="host",model_name="bench"} 100.0
sglang:prompt_tokens_total{is_streaming="false",model_name="bench"} 4000.0
sglang:prompt_tokens_total{is_streaming="true",model_name="bench"} 1000.0
sglang:num_requests_total{is_streaming="false",model_name="bench"} 30.0
sglang:num_aborted_requests_total{model_name="bench"} 4.0
sglang:num_retracted_reqs{model_name="bench"} 1.0
sglang:cache_hit_rate{model_name="bench"} 0.2
"""
    assert stress.parse_metrics(text, "sglang") == {
        "preemptions": 2.0, "prefix_cache_hits": 1000.0, "prefix_cache_queries": 5000.0, "requests_ok": 30.0,
        "requests_aborted": 4.0, "spec_accept_length": 0.0}


def test_compare_counts_early_divergence():
    oracle = {"a": {"tokens": list(range(32))}, "b": {"tokens": list(range(32))}, "c": {"tokens": list(range(32))}}
    got = {"a": {"tokens": list(range(32))}, "b": {"tokens": [0, 1, 2, 99] + list(range(4, 32))},
           "c": {"tokens": None}}
    r = stress.compare(oracle, got, ["a", "b", "c", "missing"])
    assert r == {"compared": 2, "mean_tokens_before_divergence": (32 + 3) / 2, "diverged_within_16": 1,
                 "identical": 1, "oracle_distinct_tokens": 32}
    # answers of one token repeated (the dummy weights' kind) say so: the median over those compared
    flat = {k: {"tokens": [k * 10] * 32} for k in (1, 2, 3)}
    assert stress.compare(flat, {**flat, 3: {"tokens": [30] * 31 + [5]}}, [1, 2, 3])["oracle_distinct_tokens"] == 1
    mixed = {1: {"tokens": [1] * 32}, 2: {"tokens": list(range(32))}, 3: {"tokens": [7, 8] * 16}}
    assert stress.compare(mixed, mixed, [1, 2, 3])["oracle_distinct_tokens"] == 2


def test_compare_in_probability_tells_near_ties_from_clear_divergences():
    """With logprobs: drift over the shared tokens, and whether the parting was a near tie."""
    def lps(chosen, tops):
        return [[c, [[t, v] for t, v in top.items()]] for c, top in zip(chosen, tops)]
    toks = [5, 6, 7, 8]
    oracle = {"a": {"tokens": toks, "logprobs": lps([-1.0, -0.5, -2.0, -0.1], [{5: -1.0, 9: -1.1}, {6: -0.5},
                                                                             {7: -2.0, 3: -2.05}, {8: -0.1}])},
              "b": {"tokens": toks, "logprobs": lps([-1.0, -0.5, -2.0, -0.1], [{5: -1.0}, {6: -0.5, 4: -3.0},
                                                                             {7: -2.0}, {8: -0.1}])}}
    got = {  # a: parts at a near tie after a small drift; b: parts where the oracle's token is far down
        "a": {"tokens": [5, 6, 3, 1], "logprobs": lps([-1.02, -0.49, -2.01, -0.3], [{5: -1.02}, {6: -0.49},
                                                                                  {3: -2.01, 7: -2.03}, {1: -0.3}])},
        "b": {"tokens": [5, 4, 0, 0], "logprobs": lps([-1.0, -0.2, -1.0, -1.0], [{5: -1.0}, {4: -0.2}, {0: -1.0},
                                                                               {0: -1.0}])}}
    r = stress.compare(oracle, got, ["a", "b"], {"a": 3})
    assert r["mean_tokens_before_divergence"] == (2 + 1) / 2
    assert r["logprob_compared"] == 2 and r["divergences"] == 2
    assert r["divergences_not_near_tie"] == 1  # b: its server had no 6 in its top tokens
    assert abs(r["logprob_drift_max"] - 0.02) < 1e-9
    assert stress.logprob_cells(r) == "0.020 / 0.020 | 1 of 2"
    assert r["per_request"] == {"a": {"agreeing": 2, "drift": 0.02, "drift_at": 0, "gap": 0.05, "prompt_tokens": 3},
                                "b": {"agreeing": 1, "drift": 0.0, "drift_at": 0, "gap": "outside top"}}
    # answers without logprobs (an earlier oracle) are compared in tokens only
    assert "logprob_drift_max" not in stress.compare({"a": {"tokens": toks}}, got, ["a"])


def test_requests_ask_for_logprobs_and_read_them_by_token_id():
    req = {"id": "x", "prompt": [1, 2], "max_tokens": 2}
    body = json.loads(stress.completion_body("vllm", req, logprobs=3)[1])
    assert body["logprobs"] == 3 and body["return_tokens_as_token_ids"] is True
    assert "logprobs" not in json.loads(stress.completion_body("vllm", req, stream=True, logprobs=3)[1])
    body = json.loads(stress.completion_body("sglang", req, logprobs=3)[1])
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 3
    vllm_answer = json.dumps({"choices": [{"token_ids": [7, 9], "logprobs": {
        "token_logprobs": [-0.1, -0.7], "tokens": ["token_id:7", "token_id:9"],
        "top_logprobs": [{"token_id:7": -0.1, "token_id:2": -2.5}, {"token_id:9": -0.7}]}}]}).encode()
    assert stress.output_logprobs("vllm", vllm_answer) == [[-0.1, [[7, -0.1], [2, -2.5]]], [-0.7, [[9, -0.7]]]]
    sglang_answer = json.dumps({"output_ids": [7, 9], "meta_info": {
        "output_token_logprobs": [[-0.1, 7, None], [-0.7, 9, None]],
        "output_top_logprobs": [[[-0.1, 7, None], [-2.5, 2, None]], [[-0.7, 9, None]]]}}).encode()
    assert stress.output_logprobs("sglang", sglang_answer) == [[-0.1, [[7, -0.1], [2, -2.5]]], [-0.7, [[9, -0.7]]]]
    assert stress.output_logprobs("vllm", b'{"choices": [{"token_ids": [1]}]}') is None


def _tokens(prompt, n):
    return [t % 7 for t in prompt[:n]]


SGLANG_METRICS = b"""sglang:num_retracted_requests_total{model_name="bench"} 1.0
sglang:cached_tokens_total{cache_source="device",model_name="bench"} 96.0
sglang:prompt_tokens_total{is_streaming="false",model_name="bench"} 500.0
"""


class _Fake:
    """A stand-in HTTP server: vLLM's /v1/completions and SGLang's /generate (200 with token ids,
    400 for bad JSON or an empty prompt, streams held open until the client drops them),
    SGLang's /abort_request, /health, /metrics."""

    def __init__(self, broken: bool = False, forcing: bool = False, skewed: bool = False):
        self.forcing = forcing  # started with the forced-answers logits processor: honours vllm_xargs
        self.skewed = skewed  # a wrong state's kind: from the second token on, other logits
        self.bodies: list[dict] = []
        self.closed_early = 0
        self.aborted: list[str] = []
        self.broken = broken  # every request a 500, as from a server whose worker died
        self.finished = 0  # requests answered 200: its sglang:num_requests counter

    async def handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")), b"0"))
        body = await reader.readexactly(length) if length else b""
        path = head.split(b" ")[1].decode()
        try:
            req = json.loads(body) if body else {}
            bad = False
        except ValueError:
            req, bad = {}, True
        if self.broken and path not in ("/health", "/metrics"):
            out = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
        elif path == "/health":
            out = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        elif path == "/metrics":
            text = SGLANG_METRICS + b'sglang:num_requests_total{model_name="bench"} %d.0\n' % self.finished
            out = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text)
        elif path == "/abort_request":
            self.aborted.append(req["rid"])
            out = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        elif bad or req.get("prompt") == [] or req.get("input_ids") == []:
            msg = b'{"error": "bad request"}'
            out = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(msg), msg)
        elif req.get("stream"):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b'data: {"x": 1}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(1), 2)
            except asyncio.TimeoutError:
                pass
            self.closed_early += 1
            writer.close()
            return
        elif path == "/generate":
            self.finished += 1
            toks = _tokens(req["input_ids"], req["sampling_params"]["max_new_tokens"])
            msg = json.dumps({"text": "", "output_ids": toks, "meta_info": {"finish_reason": {"type": "length"}}}).encode()
            out = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(msg), msg)
        else:
            self.bodies.append(req)
            toks = _tokens(req["prompt"], req["max_tokens"])
            lps = [-0.1 - 0.01 * i for i in range(len(toks))]
            if self.skewed:  # its own greedy choice and probabilities from the second token on
                toks = toks[:1] + [(t + 1) % 7 for t in toks[1:]]
                lps = lps[:1] + [-2.0] * (len(toks) - 1)
            forced = (req.get("vllm_xargs") or {}).get(stress.FORCED_KEY) if self.forcing else None
            if forced is not None:
                toks = list(forced)
            choice = {"token_ids": toks, "finish_reason": "length"}
            if req.get("logprobs"):
                choice["logprobs"] = {"token_logprobs": lps, "top_logprobs": [{f"token_id:{t}": v}
                                                                             for t, v in zip(toks, lps)]}
            msg = json.dumps({"choices": [choice]}).encode()
            out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(msg), msg)
        writer.write(out)
        await writer.drain()
        writer.close()


def _client_run(engine: str):
    """The stress client's requests (one to completion, one dropped mid-decode, one mid-prefill),
    the bad requests and a /metrics read, against a stand-in server speaking ``engine``'s API."""
    async def scenario():
        fake = _Fake()
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reqs = [{"id": "ok", "prompt": [8, 9, 10, 11], "max_tokens": 3, "at": 0.01},
                {"id": "drop", "prompt": [1] * 10, "max_tokens": 5, "abort": "decode"},
                {"id": "early", "prompt": [1] * 10, "max_tokens": 5, "abort": "prefill"}]
        got = await stress.run_requests(engine, port, reqs, concurrent=True)
        bad = await stress.run_bad(engine, port, 64)
        _, text = await stress.http(port, "GET", "/metrics")
        server.close()
        return fake, got, bad, text

    fake, got, bad, text = asyncio.run(scenario())
    assert got["ok"] == {"status": 200, "tokens": [1, 2, 3], "finish": "length"}
    by = {b["request"]: b for b in bad}
    assert by["empty prompt"]["status"] == 400 and by["malformed JSON"]["status"] == 400
    assert all(b["healthy_after"] and b["serves_after"] for b in bad)
    return fake, got, text


def test_http_client_against_a_stand_in_server():
    _, got, _ = _client_run("vllm")
    assert got["drop"]["status"] == 0 and got["early"]["status"] == 0
    assert "abort_status" not in got["drop"]  # vLLM aborts on the disconnect alone
    assert asyncio.run(stress.http(1, "GET", "/health", timeout=2)) == (-1, b"")  # nothing listens


def test_sglang_client_against_a_stand_in_server():
    """SGLang's shape: /generate with input_ids, output_ids back, and a dropped stream also aborted
    through /abort_request under the request's own rid."""
    fake, got, text = _client_run("sglang")
    assert got["drop"] == {"status": 0, "tokens": None, "finish": None, "abort_status": 200}
    assert got["early"]["abort_status"] == 200
    assert sorted(fake.aborted) == ["stress-drop", "stress-early"]
    metrics = stress.parse_metrics(text.decode(), "sglang")
    assert metrics["preemptions"] == 1.0 and metrics["prefix_cache_hits"] == 96.0


def test_an_engines_own_abort_is_not_a_completion():
    """A 200 whose finish reason is "abort" (the engine gave up on it) is a failure, not compared."""
    plan = {"load": [{"id": "a", "prompt": [1], "max_tokens": 4}, {"id": "b", "prompt": [2], "max_tokens": 4}]}
    oracle = {"a": {"status": 200, "tokens": [1, 2, 3, 4]}, "b": {"status": 200, "tokens": [1, 2, 3, 4]}}
    got = {"a": {"status": 200, "tokens": [1, 2, 3, 4], "finish": "length"},
           "b": {"status": 200, "tokens": [1], "finish": "abort"}}
    row = stress.summarize("sglang", plan, oracle, got, "load")
    assert (row["completed"], row["failed_other"], row["aborted_by_server"], row["compared"]) == (1, 1, 1, 1)
    assert row["diverged_within_16"] == 0


def test_spec_server_arguments():
    assert json.loads(stress.spec_args("vllm", "qwen3_next", 4)[1]) == {"method": "qwen3_next_mtp",
                                                                       "num_speculative_tokens": 4}
    assert json.loads(stress.spec_args("vllm", "qwen3_5_moe", 2)[1])["method"] == "mtp"
    assert stress.spec_args("sglang", "qwen3_next", 3) == [
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]
    with pytest.raises(SystemExit):
        stress.parse_args(["--engine", "vllm", "--spec-tokens", "9"])
    assert json.loads(stress.spec_args("vllm", "qwen3_next", 3, "ngram")[1]) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert stress.spec_tag("ngram", 3) == "ngram3" and stress.spec_tag("mtp", 3) == "spec3"
    with pytest.raises(SystemExit):
        stress.parse_args(["--engine", "sglang", "--spec-method", "ngram"])


def test_stress_server_asks_for_the_prefix_cache():
    assert stress.cache_args("vllm") == ["--enable-prefix-caching"]
    # SGLang 0.5.17 names it --mamba-radix-cache-strategy (--mamba-scheduler-strategy: a deprecated
    # alias there, gone from 0.5.20); its flashinfer GDN kernels take no extra_buffer
    assert stress.cache_args("sglang") == ["--mamba-radix-cache-strategy", "extra_buffer"]
    assert stress.cache_args("sglang", "triton") == stress.cache_args("sglang", "default") == stress.cache_args("sglang")
    assert stress.cache_args("sglang", "flashinfer") == []


def _setup(tmp_path, engine="sglang", **kw):
    kw = {"requests": 10, "max_prompt": 2048, "longest": 0, **kw}
    args = stress.parse_args(["--engine", engine, "--spec-tokens", "1", "4", *_flags(**kw)])
    spec = serve.model_spec(args.model)
    plan = stress.plan_requests(args)
    d = serve.write_model(spec, args.layers, stress.max_model_len(args, plan), tmp_path / "m", full_vocab=True)
    return args, serve.Setup(engine, d, 1, stress.max_model_len(args, plan)), spec


def test_sglang_server_commands(tmp_path):
    """Oracle without the radix cache (each request from scratch), stress server with it and with
    /metrics, one speculative server per k; the serving benchmark's command under each."""
    args, s, spec = _setup(tmp_path)
    cmds = stress.server_commands(s, "flashqla", args, spec["model_type"])
    assert list(cmds) == ["oracle", "stress", "spec1", "spec4"]
    base = serve.server_command(s, "flashqla")
    assert all(c[:len(base)] == base for c in cmds.values())
    assert cmds["oracle"][len(base):] == ["--disable-radix-cache"]
    assert cmds["stress"][len(base):] == ["--mamba-radix-cache-strategy", "extra_buffer", "--enable-metrics"]
    assert cmds["spec4"][len(base):] == stress.spec_args("sglang", "qwen3_next", 4) + ["--enable-metrics"]
    # --server-arg comes last (wins)
    args.server_arg = ["--max-total-tokens", "40000"]
    assert all(c[-2:] == ["--max-total-tokens", "40000"] for c in stress.server_commands(s, "default", args, "qwen3_next").values())
    # vLLM: as before (no oracle or metrics flags)
    args, s, spec = _setup(tmp_path / "v", engine="vllm")
    cmds = stress.server_commands(s, "flashqla", args, spec["model_type"])
    assert cmds["oracle"] == serve.server_command(s, "flashqla")
    assert cmds["stress"] == serve.server_command(s, "flashqla", ["--enable-prefix-caching"])


def test_max_model_len_holds_every_request():
    args = _args(requests=60, max_prompt=8192, longest=32768, aborts=6, suffixes=2)
    plan = stress.plan_requests(args)
    assert stress.max_model_len(args, plan) == 32768 + 32 + 64  # the vLLM run of record's context
    args = _args(requests=10, max_prompt=16384, longest=0, aborts=2)
    plan = stress.plan_requests(args)
    assert stress.max_model_len(args, plan) == stress.ABORT_PREFILL_PROMPT + stress.ABORT_MAX_TOKENS + 64


class _StandInServer:
    """serve.Server's interface over a _Fake in a thread (what --phase runs start, by tag)."""

    starts: ClassVar[list[str]] = []
    fail: ClassVar[set[str]] = set()
    broken: ClassVar[set[str]] = set()  # tags whose server answers every request with a 500
    skewed: ClassVar[set[str]] = set()  # tags whose server answers as with a wrong state
    fakes: ClassVar[dict[str, _Fake]] = {}

    def __init__(self, cmd, env, log_path, port):
        self.cmd, self.env, self.log_path, self.port = cmd, env, pathlib.Path(log_path), port
        self.started, self.loop, self.thread = 0.0, None, None
        self.tag = self.log_path.stem.split(".")[0].split("-")[-1]

    def start(self, timeout):
        _StandInServer.starts.append(self.log_path.stem)
        self.log_path.write_text("Linear attention kernel backend: decode=triton, prefill=triton, verify=triton\n")
        if self.tag in _StandInServer.fail:
            return False
        ready = threading.Event()

        def serve_forever():
            self.loop = asyncio.new_event_loop()
            fake = _Fake(broken=self.tag in _StandInServer.broken, skewed=self.tag in _StandInServer.skewed,
                         forcing="--logits-processors" in self.cmd)
            _StandInServer.fakes[self.tag] = fake
            srv = self.loop.run_until_complete(asyncio.start_server(fake.handle, "127.0.0.1", self.port))
            ready.set()
            self.loop.run_forever()
            srv.close()

        self.thread = threading.Thread(target=serve_forever, daemon=True)
        self.thread.start()
        return ready.wait(10)

    def alive(self):
        return self.thread is not None and self.thread.is_alive()

    def crashed(self, wait=20):
        return not self.alive()

    def log_text(self):
        return self.log_path.read_text()

    def stop(self):
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_run_split_by_phase_adds_up(tmp_path, monkeypatch):
    """--phase oracle, then stress, then spec (three device calls): the oracle runs once, each
    later call reuses it, and the last call's results file holds every part; a server that does
    not start is a row of the results too."""
    monkeypatch.setattr(serve, "Server", _StandInServer)
    monkeypatch.setattr(serve, "gpu_name", lambda: "Stand-in GPU")
    monkeypatch.setattr(stress, "AFTER_ABORT_S", 0.05)
    _StandInServer.starts, _StandInServer.fail, _StandInServer.broken = [], {"spec4"}, set()
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--engine", "sglang", "--layers", "4", "--requests", "12", "--rate", "200", "--max-prompt", "300",
              "--longest", "0", "--aborts", "2", "--suffixes", "2", "--flood", "2", "--max-tokens", "4",
              "--backends", "default", "--port", str(_free_port()), "--work-dir", str(work), "--out-dir", str(out)]

    assert stress.main([*common, "--phase", "oracle"]) == 0
    assert _StandInServer.starts == ["server-default-oracle"] and not list(out.glob("*.json"))
    assert stress.main([*common, "--phase", "stress"]) == 0
    assert stress.main([*common, "--phase", "spec", "--spec-tokens", "1", "4"]) == 1  # spec4 did not start
    assert _StandInServer.starts == ["server-default-oracle", "server-default-stress", "server-default-spec1",
                                     "server-default-spec4"]
    (path,) = out.glob("*-stand-in-gpu-stress-sglang-tp1.json")
    data = json.loads(path.read_text())
    rows = {r["scenario"]: r for r in data["rows"]}
    assert list(rows) == ["bad", "abort", "load", "prefix", "prefix-after-eviction", "spec-1", "spec4"]
    assert rows["bad"]["no_5xx"] == rows["bad"]["served_after"] == 6
    assert rows["abort"]["abort_endpoint_ok"] == 2 and rows["abort"]["completed"] == 2
    for name in ("abort", "load", "prefix", "prefix-after-eviction", "spec-1"):
        r = rows[name]
        assert r["compared"] == r["completed"] > 0 and r["diverged_within_16"] == 0, r
        assert r["mean_tokens_before_divergence"] == 4
    assert rows["load"]["server_metrics"]["preemptions"] == 1.0
    # each stress row counts what its own requests did to the server's counters
    assert rows["load"]["scenario_metrics"]["requests_ok"] == 12 and rows["load"]["scenario_metrics"]["preemptions"] == 0
    assert rows["prefix"]["scenario_metrics"]["requests_ok"] == rows["prefix"]["sent"]
    assert rows["prefix-after-eviction"]["scenario_metrics"]["requests_ok"] == rows["prefix"]["sent"] + 2  # + the flood
    assert "| load | 12 | 12 | 0 | 0 | 0 | False | 12 | 4.0 | 0 | 0.0 | 0.0 |" in path.with_suffix(".md").read_text()
    assert rows["spec4"]["error"] == "server did not start"
    meta = data["meta"]["backends"]["default"]
    assert meta["resolved"] == "triton"
    assert set(meta["server_commands"]) == {"stress", "spec1", "spec4"}
    assert "--enable-metrics" in meta["server_commands"]["spec1"]
    assert len(data["meta"]["calls"]) == 2 and "failed: server did not start" in path.with_suffix(".md").read_text()

    # a later call that gets the server up replaces its failure
    _StandInServer.fail = set()
    assert stress.main([*common, "--phase", "spec", "--spec-tokens", "4"]) == 0
    rows = {r["scenario"]: r for r in json.loads(path.read_text())["rows"]}
    assert "spec4" not in rows and rows["spec-4"]["compared"] > 0 and "spec-1" in rows
    # a server the budget leaves out that an earlier call measured keeps its rows (and the call passes)
    n = len(_StandInServer.starts)
    assert stress.main([*common, "--phase", "spec", "--spec-tokens", "1", "--budget", "60"]) == 0
    assert len(_StandInServer.starts) == n
    rows = [r["scenario"] for r in json.loads(path.read_text())["rows"]]
    assert rows.count("spec-1") == 1 and "spec1" not in rows
    # another plan is another run: nothing of these is reused
    assert stress.main([*common, "--phase", "oracle", "--seed", "1"]) == 0
    assert _StandInServer.starts[-1] == "server-default-oracle"


def test_random_weights_reach_every_server_and_make_another_oracle(tmp_path, monkeypatch):
    """--weights random: every server of the run gets QLA_BENCH_WEIGHTS=random (the engines' dummy
    hooks read it), the results say so, and an oracle made on the dummy weights is not reused."""
    envs = []

    class Recording(_StandInServer):
        def __init__(self, cmd, env, log_path, port):
            super().__init__(cmd, env, log_path, port)
            envs.append((self.log_path.stem, env.get(serve.WEIGHTS_ENV)))

    monkeypatch.setattr(serve, "Server", Recording)
    monkeypatch.setattr(serve, "gpu_name", lambda: "Stand-in GPU")
    monkeypatch.setattr(stress, "AFTER_ABORT_S", 0.05)
    _StandInServer.starts, _StandInServer.fail, _StandInServer.broken = [], set(), set()
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--engine", "vllm", "--layers", "4", "--requests", "6", "--rate", "200", "--max-prompt", "300",
              "--longest", "0", "--aborts", "1", "--suffixes", "2", "--flood", "1", "--max-tokens", "4",
              "--backends", "default", "--port", str(_free_port()), "--work-dir", str(work), "--out-dir", str(out),
              "--scenarios", "load"]
    assert stress.main([*common, "--phase", "oracle"]) == 0
    assert stress.main([*common, "--phase", "stress", "--weights", "random"]) == 0
    assert envs == [("server-default-oracle", "dummy"), ("server-default-oracle", "random"),
                    ("server-default-stress", "random")]  # a new oracle, on the random weights
    (path,) = out.glob("*-stress-vllm-tp1.json")
    assert "4 layers, random weights" in json.loads(path.read_text())["meta"]["model"]


def test_budget_leaves_servers_out(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "Server", _StandInServer)
    monkeypatch.setattr(serve, "gpu_name", lambda: "Stand-in GPU")
    _StandInServer.starts, _StandInServer.fail = [], set()
    rc = stress.main(["--engine", "sglang", "--layers", "4", "--requests", "4", "--max-prompt", "100", "--longest", "0",
                      "--backends", "flashqla", "--budget", "60", "--port", str(_free_port()),
                      "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path / "o")])
    assert rc == 1 and _StandInServer.starts == []
    # the left-out server is saved like a part: a --collect of the work directory shows it
    assert stress.main(["--engine", "sglang", "--layers", "4", "--requests", "4", "--max-prompt", "100",
                        "--longest", "0", "--backends", "flashqla", "--collect", "--work-dir", str(tmp_path / "w"),
                        "--out-dir", str(tmp_path / "c")]) == 1
    (path,) = (tmp_path / "c").glob("*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["scenario"] == "oracle" and row["error"] == "left out (budget)"


def test_a_failed_oracle_ends_the_wait_beside_it_and_bad_requests_keep_the_deadline(tmp_path, monkeypatch):
    """A spec run waiting for an oracle stops waiting once the run making it has failed (its part is
    saved), instead of holding the call to --wait-oracle; no bad request is sent past the deadline."""
    monkeypatch.setattr(serve, "Server", _StandInServer)
    monkeypatch.setattr(serve, "gpu_name", lambda: "Stand-in GPU")
    _StandInServer.starts, _StandInServer.fail = [], {"oracle"}
    common = ["--engine", "vllm", "--layers", "4", "--requests", "4", "--rate", "200", "--max-prompt", "100",
              "--longest", "0", "--max-tokens", "4", "--backends", "flashqla", "--work-dir", str(tmp_path / "w"),
              "--port", str(_free_port()), "--out-dir", str(tmp_path / "o")]
    assert stress.main([*common, "--phase", "oracle"]) == 1
    _StandInServer.fail = set()
    t0 = time.monotonic()
    assert stress.main([*common, "--phase", "spec", "--spec-tokens", "1", "--wait-oracle", "120"]) == 1
    assert time.monotonic() - t0 < 30
    rows = {r["scenario"]: r for r in json.loads(next((tmp_path / "o").glob("*.json")).read_text())["rows"]}
    assert rows["oracle"]["error"] == "server did not start" and rows["spec-1"]["error"].startswith("no oracle tokens")
    assert rows["spec-1"]["completed"] > 0  # measured, saved, only not compared

    assert asyncio.run(stress.run_bad("vllm", _free_port(), 64, deadline=time.monotonic() - 1)) == []


def _stand_in_runs(monkeypatch, work, requests: int, max_prompt: int) -> list[str]:
    """Stand-in servers (no engine), fast aborts, and the arguments of a small vLLM plan of
    ``flashqla`` in ``work``: what the side-by-side tests share."""
    monkeypatch.setattr(serve, "Server", _StandInServer)
    monkeypatch.setattr(serve, "gpu_name", lambda: "Stand-in GPU")
    monkeypatch.setattr(stress, "AFTER_ABORT_S", 0.05)
    _StandInServer.starts, _StandInServer.fail = [], set()
    return ["--engine", "vllm", "--layers", "4", "--requests", str(requests), "--rate", "200", "--max-prompt",
            str(max_prompt), "--longest", "0", "--aborts", "2", "--suffixes", "2", "--flood", "2", "--max-tokens", "4",
            "--backends", "flashqla", "--work-dir", str(work)]


def _failed_rows(out_dir) -> str:
    """The rows of a stand-in run's results that failed it (for an assertion's message)."""
    rows = [r for path in pathlib.Path(out_dir).glob("*.json") for r in json.loads(path.read_text()).get("rows", [])]
    return json.dumps([r for r in rows if stress.row_failed(r)] or rows or "no results file", indent=1)[:4000]


def test_runs_side_by_side_share_the_oracle_and_are_collected(tmp_path, monkeypatch):
    """stress-split: a spec server starts at once beside the run that makes the oracle, and waits for
    its tokens only to compare; --collect then writes every part; without an oracle a row fails."""
    work = tmp_path / "work"
    common = _stand_in_runs(monkeypatch, work, requests=8, max_prompt=300)
    spec_rc = []
    beside = threading.Thread(target=lambda: spec_rc.append(stress.main(
        [*common, "--phase", "spec", "--spec-tokens", "2", "--wait-oracle", "60", "--port", str(_free_port()),
         "--out-dir", str(tmp_path / "part-1")])))
    beside.start()
    deadline = time.monotonic() + 30
    while "server-flashqla-spec2" not in _StandInServer.starts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _StandInServer.starts == ["server-flashqla-spec2"]  # no oracle server of its own
    rc = stress.main([*common, "--phase", "stress", "--port", str(_free_port()), "--out-dir", str(tmp_path / "part-0")])
    assert rc == 0, _failed_rows(tmp_path / "part-0")
    beside.join(60)
    assert spec_rc == [0], _failed_rows(tmp_path / "part-1")
    assert sorted(_StandInServer.starts) == ["server-flashqla-oracle", "server-flashqla-spec2", "server-flashqla-stress"]
    n = len(_StandInServer.starts)
    assert stress.main([*common, "--collect", "--out-dir", str(tmp_path / "out")]) == 0
    assert len(_StandInServer.starts) == n  # --collect starts nothing
    (path,) = (tmp_path / "out").glob("*-stress-vllm-tp1.json")
    rows = {r["scenario"]: r for r in json.loads(path.read_text())["rows"]}
    assert {"bad", "load", "prefix", "spec-2"} <= set(rows)
    assert rows["spec-2"]["compared"] == rows["spec-2"]["completed"] > 0 and rows["spec-2"]["diverged_within_16"] == 0

    # another plan: the oracle never comes, so the spec row is a failure, not a silent pass
    assert stress.main([*common, "--seed", "3", "--phase", "spec", "--spec-tokens", "1", "--wait-oracle", "0.2",
                        "--port", str(_free_port()), "--out-dir", str(tmp_path / "o3")]) == 1
    (path,) = (tmp_path / "o3").glob("*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["scenario"] == "spec-1" and row["error"].startswith("no oracle tokens") and row["compared"] == 0


def test_a_part_waiting_for_its_oracle_fails_only_the_record(tmp_path, monkeypatch):
    """A spec part saved before its oracle came (its run beside this one compares it later) does
    not fail a run that collects it meanwhile; --collect, the record, fails on it."""
    work = tmp_path / "work"
    common = _stand_in_runs(monkeypatch, work, requests=8, max_prompt=300)
    assert stress.main([*common, "--phase", "stress", "--port", str(_free_port()), "--out-dir", str(tmp_path / "a")]) == 0
    key = json.loads((work / "rows-flashqla-stress.json").read_text())["key"]
    waiting = {"backend": "flashqla", "scenario": "spec-2", "sent": 4, "completed": 4, "aborted": 0, "failed_clean": 0,
               "failed_other": 0, "crashed": False, "compared": 0, "pending": "waiting for the oracle's tokens"}
    stress.save_part(work, key, "flashqla", "spec2", [waiting], {})
    assert stress.main([*common, "--phase", "stress", "--port", str(_free_port()), "--out-dir", str(tmp_path / "b")]) == 0
    (md,) = (tmp_path / "b").glob("*.md")
    assert "| flashqla | spec-2 | pending: waiting for the oracle's tokens |" in md.read_text()
    assert stress.main([*common, "--collect", "--out-dir", str(tmp_path / "c")]) == 1


def test_a_bad_request_answered_with_a_5xx_fails_the_run():
    ok = {"backend": "flashqla", "scenario": "bad", "sent": 6, "no_5xx": 6, "served_after": 6, "crashed": False}
    assert not stress.row_failed(ok)
    assert stress.row_failed({**ok, "no_5xx": 5})  # one 5xx (or no answer)
    assert stress.row_failed({**ok, "served_after": 5})  # the server stopped serving after one
    assert stress.row_failed({**ok, "crashed": True})
    assert stress.row_failed({"scenario": "spec-1", "error": "server did not start"})
    assert not stress.row_failed({"scenario": "load", "crashed": False, "compared": 3})


def test_failed_requests_fail_the_run():
    """Requests that failed other than cleanly (a 5xx, no answer) fail the run, like a crash: the
    SGLang run of record returned 0 with every request of two speculative servers failed."""
    row = {"scenario": "spec-4", "sent": 32, "completed": 0, "failed_clean": 0, "failed_other": 32,
           "crashed": False, "compared": 0}
    assert stress.row_failed(row)
    assert not stress.row_failed({**row, "completed": 32, "failed_other": 0, "compared": 32})
    assert not stress.row_failed({**row, "completed": 31, "failed_other": 0, "failed_clean": 1, "compared": 31})


def test_a_speculative_server_answering_5xx_fails_its_row(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "Server", _StandInServer)
    monkeypatch.setattr(serve, "gpu_name", lambda: "Stand-in GPU")
    _StandInServer.starts, _StandInServer.fail, _StandInServer.broken = [], set(), {"spec8"}
    common = ["--engine", "sglang", "--layers", "4", "--requests", "4", "--rate", "200", "--max-prompt", "100",
              "--longest", "0", "--max-tokens", "4", "--spec-requests", "3", "--backends", "default",
              "--port", str(_free_port()), "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path / "o")]
    try:
        assert stress.main([*common, "--phase", "oracle"]) == 0
        assert stress.main([*common, "--phase", "spec", "--spec-tokens", "1", "8"]) == 1
    finally:
        _StandInServer.broken = set()
    rows = {r["scenario"]: r for r in json.loads(next((tmp_path / "o").glob("*.json")).read_text())["rows"]}
    assert rows["spec-8"]["failed_other"] == rows["spec-8"]["sent"] == 3 and rows["spec-8"]["compared"] == 0
    assert rows["spec-1"]["compared"] == 3 and not stress.row_failed(rows["spec-1"])


def _python_server(tmp_path, body: str, port: int) -> serve.Server:
    script = tmp_path / "server.py"
    script.write_text(body)
    import sys

    return serve.Server([sys.executable, str(script), str(port)], env=None, log_path=tmp_path / "server.log",
                        port=port)


HEALTHY = """import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_that_stops_answering_is_crashed_before_its_process_is_gone(tmp_path):
    """The SGLang servers of record that died of an out-of-memory error in their first prefill
    were still in the process table when their requests had all failed, and were counted as not
    crashed: a process that exits within the wait, or that stops answering /health, is crashed."""
    port = _free_port()
    srv = _python_server(tmp_path, HEALTHY, port)
    assert srv.start(30) and srv.alive()
    try:
        assert not srv.crashed(wait=5)
    finally:
        srv.stop()
    assert srv.crashed(wait=1)  # stopped: its process is gone

    # alive for two more seconds, answering nothing (a worker died; the tree is being torn down)
    dying = _python_server(tmp_path, "import time; time.sleep(2)", _free_port())
    assert not dying.start(0.01) and dying.alive()
    t0 = time.monotonic()
    assert dying.crashed(wait=20) and time.monotonic() - t0 < 15
    dying.stop()


def test_metrics_delta_is_what_each_counter_gained():
    assert stress.metrics_delta({"preemptions": 1.0, "prefix_cache_hits": 96.0}, {"preemptions": 3.0,
                                "prefix_cache_hits": 96.0, "requests_ok": 5.0}) == {"preemptions": 2.0,
                                                                                    "prefix_cache_hits": 0.0}
    assert stress.metrics_delta({}, {"preemptions": 3.0}) == {}


def test_a_wait_for_an_oracle_nobody_makes_ends_after_the_grace(tmp_path, monkeypatch):
    """A spec run told to wait for an oracle that no run is making for its plan and server arguments
    (an oracle saved under other server arguments, nothing beside it) stops waiting once the grace has
    passed, instead of holding its call to --wait-oracle; the log says which key it had."""
    monkeypatch.setattr(stress, "ORACLE_MAKER_GRACE_S", 0.5)
    common = _stand_in_runs(monkeypatch, tmp_path / "w", requests=4, max_prompt=100) + [
        "--port", str(_free_port()), "--out-dir", str(tmp_path / "o")]
    assert stress.main([*common, "--phase", "oracle"]) == 0
    assert not stress.maker_path(tmp_path / "w", "flashqla").exists()  # the maker's mark goes with it
    logs = []
    monkeypatch.setattr(serve, "log", logs.append)
    t0 = time.monotonic()
    assert stress.main([*common, "--server-arg=--max-num-seqs=256", "--phase", "spec", "--spec-tokens", "1",
                        "--wait-oracle", "120"]) == 1
    assert time.monotonic() - t0 < 30
    assert any("no run is making it" in line and "holds key" in line for line in logs), logs
    (row,) = json.loads(next((tmp_path / "o").glob("*.json")).read_text())["rows"]
    assert row["scenario"] == "spec-1" and row["error"].startswith("no oracle tokens") and row["completed"] > 0


def test_oracle_being_made_needs_a_live_maker_of_the_same_key(tmp_path):
    work = tmp_path
    assert not stress.oracle_being_made(work, "flashqla", "k1")
    stress.maker_path(work, "flashqla").write_text(json.dumps({"key": "k1", "pid": os.getpid()}))
    assert stress.oracle_being_made(work, "flashqla", "k1")
    assert not stress.oracle_being_made(work, "flashqla", "k2")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stress.maker_path(work, "flashqla").write_text(json.dumps({"key": "k1", "pid": dead.pid}))
    assert not stress.oracle_being_made(work, "flashqla", "k1")


def test_start_failure_names_the_engines_own_error(tmp_path):
    """A server that did not start is reported with the error its log names (vLLM's engine core
    error, not the API server's wrapper around it), so the call's output says what to change."""
    log = tmp_path / "server.log"
    log.write_text(
        "(EngineCore pid=8868) INFO 11-27 10:32:40 [core.py:100] starting\n"
        "(EngineCore pid=8868)     raise ValueError(\n"
        "(EngineCore pid=8868) ValueError: max_num_seqs (1024) exceeds available Mamba cache blocks (936).\n"
        "[rank0]:[W1127 10:32:48.890056620 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group()\n"
        "(APIServer pid=7213) RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert serve.start_failure(log) == ("server did not start: ValueError: max_num_seqs (1024) exceeds available "
                                        "Mamba cache blocks (936).")
    log.write_text("[2026-11-27 10:00:00 TP0] Scheduler hit an exception\n"
                   "[2026-11-27 10:00:00 TP0] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n")
    assert serve.start_failure(log).endswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")
    log.write_text("INFO nothing wrong here\n")
    assert serve.start_failure(log) == "server did not start"
    assert serve.start_failure(tmp_path / "absent.log") == "server did not start (no log)"


def test_an_oracle_split_over_servers_side_by_side_is_merged_and_used(tmp_path, monkeypatch):
    """--oracle-shard I/N: N oracle servers side by side each answer every N-th request; the last to
    finish merges the shards into the backend's oracle, which a later stress run reuses and
    compares against; a shard run asks its own server for its share only."""
    work = tmp_path / "w"
    common = _stand_in_runs(monkeypatch, work, requests=9, max_prompt=200) + ["--out-dir", str(tmp_path / "o")]
    rcs = []
    runs = [threading.Thread(target=lambda i=i: rcs.append(stress.main(
        [*common, "--phase", "oracle", "--oracle-shard", f"{i}/2", "--port", str(_free_port())]))) for i in (1, 2)]
    for r in runs:
        r.start()
    for r in runs:
        r.join(60)
    # each shard's server writes a log of its own
    assert rcs == [0, 0] and sorted(_StandInServer.starts) == [f"server-flashqla-oracle.shard-{i}-of-2" for i in (1, 2)]
    args = stress.parse_args(common)
    plan = stress.plan_requests(args)
    everything = [r["id"] for reqs in plan.values() for r in reqs if not r.get("abort")]
    shards = [json.loads(stress.shard_path(work, "flashqla", (i, 2)).read_text())["results"] for i in (1, 2)]
    assert sorted(shards[0]) == sorted(everything[0::2]) and sorted(shards[1]) == sorted(everything[1::2])
    merged = json.loads((work / "oracle-flashqla.json").read_text())
    assert sorted(merged["results"]) == sorted(everything) and len(merged["info"]["shards"]) == 2
    assert not list(work.glob("oracle-flashqla.making*"))
    # a later stress run reuses the merged oracle (no oracle server of its own) and compares against it
    assert stress.main([*common, "--phase", "stress", "--port", str(_free_port())]) == 0
    assert _StandInServer.starts[2:] == ["server-flashqla-stress"]
    rows = {r["scenario"]: r for r in json.loads(next((tmp_path / "o").glob("*.json")).read_text())["rows"]}
    assert rows["load"]["compared"] == rows["load"]["completed"] == 9


def test_oracle_shard_is_checked():
    base = ["--engine", "vllm", "--phase", "oracle"]
    assert stress.parse_args([*base, "--oracle-shard", "2/3"]).oracle_shard == (2, 3)
    for bad in ("0/2", "3/2", "x", "1/0"):
        with pytest.raises(SystemExit):
            stress.parse_args([*base, "--oracle-shard", bad])
    with pytest.raises(SystemExit):  # a stress run reads the merged oracle; it makes none in shards
        stress.parse_args(["--engine", "vllm", "--phase", "stress", "--oracle-shard", "1/2"])


def test_a_backend_whose_name_extends_another_keeps_its_own_parts(tmp_path):
    """``flashqla-fault``'s saved parts (``rows-flashqla-fault-stress.json``) are its own: collecting
    ``flashqla`` beside it lists each part once, under the backend that ran it."""
    key = "k"
    for backend, part in [("flashqla", "stress"), ("flashqla", "spec2"), ("flashqla", "ngram4"),
                          ("flashqla-fault", "stress"), ("default", "stress")]:
        stress.save_part(tmp_path, key, backend, part, [{"backend": backend, "scenario": part}], {})
    parts = stress.load_parts(tmp_path, key, ["flashqla", "flashqla-fault", "default"])
    assert [(p["backend"], p["part"]) for p in parts] == [
        ("flashqla", "stress"), ("flashqla", "spec2"), ("flashqla", "ngram4"),
        ("flashqla-fault", "stress"), ("default", "stress")]


def test_forced_answers_compare_every_position(tmp_path, monkeypatch):
    """--forced: the stress server (and only it) loads the forced-answers processor, its compared
    requests carry their oracle's tokens, every answer equals its oracle's, and a server whose
    probabilities differ from the second token on is seen at every request, where free answers
    part from the oracle at once and compare one token."""
    def run(tag_skewed, out, forced=True):
        _StandInServer.skewed = tag_skewed
        common = _stand_in_runs(monkeypatch, tmp_path / f"work-{out}", requests=8, max_prompt=300)
        assert stress.main([*common, "--logprobs", "2", *(["--forced"] if forced else []), "--port", str(_free_port()),
                            "--spec-tokens", "--out-dir", str(tmp_path / out)]) == 0, _failed_rows(tmp_path / out)
        (path,) = (tmp_path / out).glob("*.json")
        return {r["scenario"]: r for r in json.loads(path.read_text())["rows"]}

    rows = run(set(), "clean")
    stress_cmd = json.loads((tmp_path / "clean").joinpath(next((tmp_path / "clean").glob("*.json")).name)
                            .read_text())["meta"]["backends"]["flashqla"]["server_commands"]["stress"]
    assert f"--logits-processors {stress.FORCED_PROCESSOR}" in stress_cmd
    oracle_bodies, stress_bodies = _StandInServer.fakes["oracle"].bodies, _StandInServer.fakes["stress"].bodies
    assert not any("vllm_xargs" in b for b in oracle_bodies)
    assert any(b.get("vllm_xargs", {}).get(stress.FORCED_KEY) for b in stress_bodies)
    for name in ("load", "prefix", "prefix-after-eviction"):
        r = rows[name]
        assert r["forced"] and r["identical"] == r["compared"] > 0 and r["logprob_drift_max"] == 0, r
        assert r["logprob_drift_over_tie"] == 0

    rows = run({"stress"}, "skewed")
    plan = stress.plan_requests(stress.parse_args(_stand_in_runs(monkeypatch, tmp_path / "plan", requests=8,
                                                                 max_prompt=300)))
    for name in ("load", "prefix", "prefix-after-eviction"):
        r = rows[name]
        assert r["identical"] == r["compared"] > 0  # forced: the same tokens,
        assert r["logprob_drift_over_tie"] == r["compared"]  # other probabilities at every request
        assert abs(r["logprob_drift_median"] - 1.89) < 0.02, r
        assert len(stress.state_drifts(r)) == r["compared"]  # each at 1.89 nats: past the state line
        # each request with its prompt's length (the plan's) and where it drifted: its second token
        lengths = {q["id"]: len(q["prompt"]) for q in plan[name if name != "prefix-after-eviction" else "prefix"]}
        for rid_, d in r["per_request"].items():
            assert d["drift_at"] == 1 and d["prompt_tokens"] == lengths[rid_], (rid_, d)
            assert d["drifts"][0] == 0 and min(d["drifts"][1:]) >= stress.STATE_NATS, d  # from the second token on
        cells = stress.logprob_cells(r)
        first = min(r["per_request"])
        assert f"{r['compared']} at 1+: " in cells and f"{first} (prompt {lengths[first]}, token 1)" in cells, cells
        if r["compared"] > 6:  # past the six named, what they all have in common: their prompts' lengths
            assert "; prompts of " in cells, cells
    rows = run({"stress"}, "skewed-free", forced=False)
    for name in ("load", "prefix", "prefix-after-eviction"):
        r = rows[name]  # free: each answer parts at its second token, and the one shared token agrees
        assert "forced" not in r and r["mean_tokens_before_divergence"] == 1 and r["logprob_drift_max"] == 0, r
    with pytest.raises(SystemExit):
        stress.parse_args(["--engine", "vllm", "--forced"])  # nothing to compare without logprobs
    with pytest.raises(SystemExit):
        stress.parse_args(["--engine", "sglang", "--forced", "--logprobs", "2"])


def test_the_stress_servers_own_arguments_keep_the_oracle(tmp_path, monkeypatch):
    """--stress-server-arg (a pool small enough to preempt): only the stress server gets it, after
    --server-arg; the oracle made without it is reused, not made again, and the rows measured with
    it are another run's (a collect without it does not mix them in)."""
    common = _stand_in_runs(monkeypatch, tmp_path / "work", requests=8, max_prompt=300)
    common += ["--server-arg=--kv-cache-memory-bytes=2147483648", "--spec-tokens"]
    out = tmp_path / "out"
    assert stress.main([*common, "--phase", "oracle", "--port", str(_free_port())]) == 0
    small = ["--stress-server-arg=--kv-cache-memory-bytes=805306368"]
    assert stress.main([*common, *small, "--phase", "stress", "--port", str(_free_port()),
                        "--out-dir", str(out)]) == 0, _failed_rows(out)
    assert _StandInServer.starts == ["server-flashqla-oracle", "server-flashqla-stress"]
    (path,) = out.glob("*.json")
    cmds = json.loads(path.read_text())["meta"]["backends"]["flashqla"]["server_commands"]
    assert cmds["stress"].endswith("--kv-cache-memory-bytes=2147483648 --kv-cache-memory-bytes=805306368")
    rows = {r["scenario"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["load"]["compared"] == rows["load"]["completed"] > 0
    args = stress.parse_args(common)
    with_small = stress.parse_args([*common, *small])
    plan = stress.plan_requests(args)
    assert stress.oracle_key(args, plan) == stress.oracle_key(with_small, plan) == stress.run_key(args, plan)
    assert stress.run_key(with_small, plan) != stress.run_key(args, plan)
    assert "805306368" not in " ".join(stress.server_commands(
        serve.Setup("vllm", model_dir="m", tp=1, max_len=1024), "flashqla", with_small,
        "qwen3_next")["oracle"])
    # the rows of the small pool are not the default pool's: a collect without the option finds none
    assert stress.main([*common, "--collect", "--out-dir", str(tmp_path / "other")]) == 1


def test_the_speculative_servers_own_arguments_keep_the_oracle(tmp_path, monkeypatch):
    """--spec-server-arg (a pool large enough for the draft's state): only the speculative servers get
    it, after --server-arg; the oracle made without it is reused, and their rows are another run's
    (a collect without it does not mix them in), while the stress rows keep the run's key."""
    common = _stand_in_runs(monkeypatch, tmp_path / "work", requests=8, max_prompt=300)
    common += ["--server-arg=--kv-cache-memory-bytes=2147483648"]
    out = tmp_path / "out"
    assert stress.main([*common, "--spec-tokens", "--phase", "oracle", "--port", str(_free_port())]) == 0
    big = ["--spec-server-arg=--kv-cache-memory-bytes=4294967296"]
    assert stress.main([*common, *big, "--spec-tokens", "2", "--phase", "spec", "--port", str(_free_port()),
                        "--out-dir", str(out)]) == 0, _failed_rows(out)
    assert _StandInServer.starts == ["server-flashqla-oracle", "server-flashqla-spec2"]
    (path,) = out.glob("*.json")
    result = json.loads(path.read_text())
    cmds = result["meta"]["backends"]["flashqla"]["server_commands"]
    assert cmds["spec2"].endswith("--kv-cache-memory-bytes=2147483648 --kv-cache-memory-bytes=4294967296")
    (row,) = result["rows"]
    assert row["compared"] == row["completed"] > 0 and not stress.row_failed(row), row
    args, with_big = stress.parse_args([*common, "--spec-tokens", "2"]), stress.parse_args([*common, *big, "--spec-tokens", "2"])
    plan = stress.plan_requests(args)
    key = stress.run_key(args, plan)
    assert stress.oracle_key(with_big, plan) == stress.oracle_key(args, plan) and stress.run_key(with_big, plan) == key
    assert stress.spec_key(args, key) == key != stress.spec_key(with_big, key)
    setup = serve.Setup("vllm", model_dir="m", tp=1, max_len=1024)
    assert not any("4294967296" in " ".join(c) for tag, c in stress.server_commands(setup, "flashqla", with_big,
                                                                                     "qwen3_next").items()
                   if tag in ("oracle", "stress"))
    assert stress.part_key("spec2", key, None, "s") == "s" and stress.part_key("stress", key, None, "s") == key
    # the rows of the larger pool are not the plain run's: a collect without the option finds none
    assert stress.main([*common, "--spec-tokens", "2", "--collect", "--out-dir", str(tmp_path / "other")]) == 1


def test_oracles_carried_from_another_machine_are_used(tmp_path, monkeypatch):
    """--oracles-from DIR / --oracle-as FROM:TO: an oracle made elsewhere (saved under another
    backend's name) is copied into a fresh work directory and used, no oracle server started; one
    made here is never overwritten; an oracle for another plan is carried but not used; bad
    arguments are refused."""
    common = _stand_in_runs(monkeypatch, tmp_path / "made", requests=8, max_prompt=300) + ["--spec-tokens"]
    assert stress.main([*common, "--phase", "oracle", "--port", str(_free_port())]) == 0
    carried = tmp_path / "carried"
    carried.mkdir()
    made = (tmp_path / "made" / "oracle-flashqla.json").read_text()
    (carried / "oracle-flashqla-cp-per-sequence.json").write_text(made)
    fresh = [a if a != str(tmp_path / "made") else str(tmp_path / "fresh") for a in common]
    _StandInServer.starts = []
    out = tmp_path / "out"
    assert stress.main([*fresh, "--phase", "stress", "--oracles-from", str(carried),
                        "--oracle-as", "flashqla-cp-per-sequence:flashqla", "--port", str(_free_port()),
                        "--out-dir", str(out)]) == 0, _failed_rows(out)
    assert _StandInServer.starts == ["server-flashqla-stress"]  # no oracle server: the carried one answered
    assert (tmp_path / "fresh" / "oracle-flashqla.json").read_text() == made
    rows = {r["scenario"]: r for r in json.loads(next(out.glob("*.json")).read_text())["rows"]}
    assert rows["load"]["compared"] == rows["load"]["completed"] > 0
    # never over an oracle made here
    (carried / "oracle-flashqla.json").write_text('{"key": "another plan", "results": {}}')
    stress.carry_oracles(tmp_path / "fresh", str(carried), ["flashqla-cp-per-sequence:flashqla"])
    assert (tmp_path / "fresh" / "oracle-flashqla.json").read_text() == made
    # a carried oracle of another plan is keyed so: the stress run makes its own first
    other = tmp_path / "other"
    other.mkdir()
    (other / "oracle-flashqla.json").write_text('{"key": "another plan", "results": {}}')
    _StandInServer.starts = []
    elsewhere = [a if a != str(tmp_path / "made") else str(tmp_path / "third") for a in common]
    assert stress.main([*elsewhere, "--phase", "stress", "--oracles-from", str(other), "--port", str(_free_port()),
                        "--out-dir", str(tmp_path / "out3")]) == 0
    assert _StandInServer.starts == ["server-flashqla-oracle", "server-flashqla-stress"]
    with pytest.raises(SystemExit, match="no oracle"):
        stress.carry_oracles(tmp_path / "fresh", str(tmp_path / "empty-dir-that-is-not-there"), [])
    for bad in ("flashqla", "a:", ":b", "a:a"):
        with pytest.raises(SystemExit):
            stress.parse_args(["--engine", "vllm", "--oracle-as", bad])


def test_the_load_sent_another_way_keeps_the_oracle_and_scores_what_was_sent(tmp_path, monkeypatch):
    """--load-max-prompt / --load-send (the short prompts alone, one at a time or all at once):
    the oracle of the plan is reused, only the chosen requests reach the stress server, the load
    row counts and compares those, and the rows are another run's."""
    common = _stand_in_runs(monkeypatch, tmp_path / "work", requests=40, max_prompt=300)
    common += ["--spec-tokens", "--logprobs", "2", "--forced"]
    assert stress.main([*common, "--phase", "oracle", "--port", str(_free_port())]) == 0
    args = stress.parse_args(common)
    plan = stress.plan_requests(args)
    short = [r for r in plan["load"] if len(r["prompt"]) <= 20]
    assert 0 < len(short) < len(plan["load"])
    for how in ("one-at-a-time", "together", "behind-prefill", "ahead-of-prefill"):
        out = tmp_path / how
        sending = ["--load-max-prompt", "20", "--load-send", how]
        assert stress.main([*common, *sending, "--phase", "stress", "--port", str(_free_port()),
                            "--out-dir", str(out)]) == 0, _failed_rows(out)
        rows = {r["scenario"]: r for r in json.loads(next(out.glob("*.json")).read_text())["rows"]}
        load = rows["load"]
        assert load["sent"] == load["completed"] == load["compared"] == len(short), load
        assert load["identical"] == len(short) and set(load["per_request"]) == {r["id"] for r in short}
        load_prompts = {tuple(r["prompt"]) for r in plan["load"]}
        bodies = _StandInServer.fakes["stress"].bodies
        sent = [tuple(b["prompt"]) for b in bodies if tuple(b.get("prompt", ())) in load_prompts]
        assert sorted(sent) == sorted(tuple(r["prompt"]) for r in short)
        companions = [b for b in bodies if len(b.get("prompt", ())) == stress.COMPANION_PROMPT]
        if how.endswith("prefill"):  # one new prompt beside each, asked for one token, not compared
            assert len(companions) == len(short) and {b["max_tokens"] for b in companions} == {1}
            assert not any(k.startswith("companion-") for k in load["per_request"])
        else:
            assert not companions
        with_sending = stress.parse_args([*common, *sending])
        assert stress.oracle_key(with_sending, plan) == stress.oracle_key(args, plan)
        assert stress.run_key(with_sending, plan) != stress.run_key(args, plan)
    assert _StandInServer.starts == ["server-flashqla-oracle"] + ["server-flashqla-stress"] * 4
    assert stress.load_requests(stress.parse_args([*common, "--load-send", "together"]), short)[0][-1]["at"] == 0.0
    assert stress.load_requests(args, plan["load"]) == (plan["load"], plan["load"])  # as planned by default
    for how, first in (("behind-prefill", "companion-"), ("ahead-of-prefill", "load-")):
        scored, sent = stress.load_requests(stress.parse_args([*common, "--load-send", how]), short)
        assert [r["id"] for r in scored] == [r["id"] for r in short] and len(sent) == 2 * len(short)
        # a pair every PAIR_SPACING_S, its second request PAIR_GAP_S after the first, in the order asked
        assert all(a["at"] == pytest.approx(i * stress.PAIR_SPACING_S) and b["at"] == pytest.approx(a["at"] + stress.PAIR_GAP_S)
                   for i, (a, b) in enumerate(zip(sent[::2], sent[1::2])))
        assert all(a["id"].startswith(first) for a in sent[::2])
    with pytest.raises(SystemExit):
        stress.parse_args([*common, "--load-max-prompt", "-1"])


def test_stress_runs_side_by_side(tmp_path):
    """gpu_session.sh stress-runs: harness runs side by side, run i on GPU i, each with its part of
    QLA_STRESS_RUNS after the common arguments, its own work directory and port (here dry runs,
    which print the servers they would start); the servers' logs come back."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "QLA_STAGE": str(tmp_path / "stage"),
           "QLA_STRESS_RUNS_DIR": str(tmp_path / "run"),
           "QLA_STRESS_ARGS": "--engine vllm --layers 4 --requests 10 --max-prompt 300 --longest 0 --dry-run",
           "QLA_STRESS_RUNS": ("--load-send behind-prefill --backends flashqla|--load-send ahead-of-prefill "
                               "--backends default|--backends flashqla-one-token-prefill "
                               "--oracle-as flashqla:flashqla-one-token-prefill")}
    repo = pathlib.Path(__file__).resolve().parents[1]
    (tmp_path / "run-1").mkdir()
    (tmp_path / "run-1" / "server-default-stress.log").write_text("a server's log\n")
    r = subprocess.run(["bash", str(repo / "scripts/gpu_session.sh"), "stress-runs"], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(tmp_path / "out" / "stress-runs-logs.tar.xz") as tar:
        assert tar.getnames() == ["run-1/server-default-stress.log"]
    assert not list((tmp_path / "out").glob("s[0-9]*")), "the runs' folders go back packed"
    with tarfile.open(tmp_path / "out" / "stress-runs-results.tar.xz") as tar:
        logs = [tar.extractfile(f"s{i}/stress.log").read().decode() for i in (0, 1, 2)]
    for i, (log, backend) in enumerate(zip(logs, ("flashqla", "default", "flashqla-one-token-prefill"))):
        assert f"{tmp_path / f'run-{i}'}/model" in log and f"--port {8321 + 100 * i}" in log, log
        assert f"# {backend} stress" in log and log.count(" stress\n") == 1, log
    env["QLA_STRESS_ARGS"] += " --load-send sideways"  # a bad argument fails the step
    r = subprocess.run(["bash", str(repo / "scripts/gpu_session.sh"), "stress-runs"], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode != 0


def _stress_split_with_stand_in(tmp_path, engine: str, slots: str) -> dict[int, dict[str, float]]:
    """gpu_session.sh stress-split over a stand-in harness (a ``python3`` that answers ``-m
    e2e_bench.stress``): each slot's run notes when it started and when its server was up (0.6 s
    after its start), then ends 0.6 s later. Start and up times by port."""
    bin_dir, times = tmp_path / "bin", tmp_path / "times"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m e2e_bench.stress" ]; then
  case "$*" in *--dry-run*|*--collect*) exit 0 ;; esac
  port=$(echo "$*" | sed 's/.*--port \\([0-9]*\\).*/\\1/')
  echo "$port start $(date +%s.%N)" >>{times}
  sleep 0.6; echo "[serve 00:00:00] healthy stand-in oracle after 1 s"; echo "$port up $(date +%s.%N)" >>{times}
  sleep 0.6; exit 0
fi
exec {sys.executable} "$@"
""")
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "QLA_STAGE": str(tmp_path / "stage"),
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "QLA_STRESS_SPLIT": slots,
           "QLA_STRESS_ARGS": f"--engine {engine} --layers 4 --tp 2 --work-dir {tmp_path / 'work'}"}
    r = subprocess.run(["bash", str(pathlib.Path(__file__).resolve().parents[1] / "scripts/gpu_session.sh"),
                        "stress-split"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    out: dict[int, dict[str, float]] = {}
    for line in times.read_text().splitlines():
        port, what, t = line.split()
        out.setdefault(int(port), {})[what] = float(t)
    return out


def test_sglang_slots_sharing_gpus_start_one_after_another(tmp_path):
    """stress-split on SGLang: a slot whose GPUs an earlier slot uses starts once that slot's server is
    up (SGLang sizes its pools from the memory free at its start), so both backends' oracles can share a
    machine's GPU pairs in one call; slots on other GPUs start at once, and vLLM's are not held back."""
    slots = "0,1:flashqla:oracle:1/2 2,3:flashqla:oracle:2/2 0,1:default:oracle:1/2 2,3:default:oracle:2/2"
    t = _stress_split_with_stand_in(tmp_path, "sglang", slots)
    assert sorted(t) == [8321, 8421, 8521, 8621]
    assert abs(t[8421]["start"] - t[8321]["start"]) < 0.5  # GPUs 2,3 do not wait for 0,1
    assert t[8521]["start"] >= t[8321]["up"]  # default 1/2 after flashqla 1/2 on GPUs 0,1
    assert t[8621]["start"] >= t[8421]["up"]  # and 2/2 after flashqla 2/2 on GPUs 2,3
    t = _stress_split_with_stand_in(tmp_path / "vllm", "vllm", slots)
    assert max(v["start"] for v in t.values()) < min(v["up"] for v in t.values())


def test_stress_slots_beside_their_oracle_wait_for_it(tmp_path):
    """gpu_session.sh stress-split: a stress slot beside an oracle slot of its backend starts no
    oracle server of its own (it waits for that one's tokens); one without such a slot makes its
    oracle first (here dry runs, which print the servers they would start)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "QLA_STAGE": str(tmp_path / "stage"),
           "QLA_STRESS_ARGS": ("--engine vllm --layers 4 --requests 10 --max-prompt 300 --longest 0 --dry-run "
                               f"--work-dir {tmp_path / 'work'}"),
           "QLA_STRESS_SPLIT": "0:flashqla:oracle 1:flashqla:stress 2:default:stress"}
    repo = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run(["bash", str(repo / "scripts/gpu_session.sh"), "stress-split"], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    beside = pathlib.Path("/tmp/qla-stress-split-1-flashqla-stress.log").read_text()
    alone = pathlib.Path("/tmp/qla-stress-split-2-default-stress.log").read_text()
    assert "made by the run beside this one" in beside and "# flashqla oracle" not in beside, beside
    assert "# flashqla stress" in beside
    assert "# default oracle" in alone and "# default stress" in alone and "made by the run" not in alone, alone


def test_the_load_table_by_prompt_length():
    """The markdown groups the load row's requests by prompt length per backend: first tokens that
    differ, mean tokens before divergence, drift median / max; nothing without per-request lengths."""
    per = {"load-0": {"agreeing": 0, "drift": 0.5, "prompt_tokens": 1},
           "load-1": {"agreeing": 32, "drift": 0.1, "prompt_tokens": 1},
           "load-2": {"agreeing": 10, "drift": 0.2, "prompt_tokens": 3000},
           "load-3": {"agreeing": 4, "drift": 0.3, "prompt_tokens": 9000}}
    rows = [{"backend": "flashqla", "scenario": "load", "per_request": per},
            {"backend": "flashqla", "scenario": "prefix", "per_request": per}]
    lines = stress.by_prompt_length(rows)
    assert "| flashqla | 1 | 2 | 1 (50%) | 16.0 | 0.500 / 0.500 |" in lines
    assert "| flashqla | 2048-8191 | 1 | 0 (0%) | 10.0 | 0.200 / 0.200 |" in lines
    assert "| flashqla | 8192+ | 1 | 0 (0%) | 4.0 | 0.300 / 0.300 |" in lines
    assert not any("2-2047" in line for line in lines) and sum("| flashqla |" in line for line in lines) == 3
    assert stress.by_prompt_length([{"backend": "x", "scenario": "load", "per_request": {"a": {"agreeing": 1, "drift": 0}}}]) == []
    row = {**rows[0], "sent": 4, "completed": 4, "aborted": 0, "failed_clean": 0, "failed_other": 0, "crashed": False,
           "compared": 4, "mean_tokens_before_divergence": 11.5, "diverged_within_16": 3}
    md = stress.markdown({"engine": "sglang", "tp": 1, "gpu": "g", "model": "m", "command": "c"}, [row])
    assert "Load by prompt length" in md and "| flashqla | 8192+ | 1 | 0 (0%) | 4.0 | 0.300 / 0.300 |" in md


def test_ours_against_the_default_request_by_request():
    """Fresh random requests: where ours parts 3 tokens sooner on every request the interval lies
    below 0; where ours has the default's counts on other requests it holds 0; requests only one side answered,
    rows without a default, and the default itself are left out."""
    rng = random.Random()
    lengths = [rng.choice([1, 500, 3000, 20000]) for _ in range(400)]
    default = {f"load-{i}": {"agreeing": rng.randint(4, 32), "prompt_tokens": n} for i, n in enumerate(lengths)}
    sooner = {k: {**d, "agreeing": d["agreeing"] - 3} for k, d in default.items()}
    shuffled = [d["agreeing"] for d in default.values()]
    rng.shuffle(shuffled)  # the same counts on other requests: the mean difference is 0
    alike = {k: {**d, "agreeing": a} for (k, d), a in zip(default.items(), shuffled)}
    alike["only-ours"] = {"agreeing": 0, "prompt_tokens": 1}
    rows = [{"backend": "flashqla", "scenario": "load", "per_request": sooner},
            {"backend": "flashqla-batch-invariant", "scenario": "load", "per_request": alike},
            {"backend": "default", "scenario": "load", "per_request": default},
            {"backend": "flashqla", "scenario": "abort", "per_request": sooner}]  # no default row: left out
    paired = {(a["backend"], a["prompt_tokens"]): a for a in stress.paired_with_default(rows)}
    assert {b for b, _ in paired} == {"flashqla", "flashqla-batch-invariant"}
    for span in ("all", "1", "2-2047", "2048-8191", "8192+"):
        a = paired[("flashqla", span)]
        assert a["mean_diff"] == -3 and a["high"] == -3 and a["ours_closer"] == 0 and a["default_closer"] == a["requests"]
    a = paired[("flashqla-batch-invariant", "all")]
    assert a["requests"] == 400 and a["mean_diff"] == 0 and a["low"] < 0 < a["high"]
    assert sum(paired[("flashqla", s)]["requests"] for s in ("1", "2-2047", "2048-8191", "8192+")) == 400
    md = "\n".join(stress.paired_markdown(rows))
    assert "| flashqla | load | all | 400 | tokens | -3.00 (-3.00..-3.00) | 0 / 400 |" in md
    assert stress.paired_markdown(rows[:2]) == []
    # forced rows (every answer the oracle's): the drift, the default's minus ours
    drift = {k: {**d, "agreeing": 32, "drift": 0.05} for k, d in default.items()}
    less = {k: {**d, "drift": d["drift"] - 0.01} for k, d in drift.items()}
    forced = [{"backend": "flashqla", "scenario": "load", "forced": True, "per_request": less},
              {"backend": "default", "scenario": "load", "forced": True, "per_request": drift}]
    (a,) = [a for a in stress.paired_with_default(forced) if a["prompt_tokens"] == "all"]
    assert a["scenario"] == "load (forced)" and a["measure"] == "drift, nats"
    assert a["mean_diff"] == pytest.approx(0.01) and a["ours_closer"] == 400
