"""The stress harness (e2e_bench/stress.py) on the CPU: its request plan, HTTP client (against a
local stand-in server), metrics parsing and oracle comparison. The engines' parsers read its
server commands in tests/vllm."""

from __future__ import annotations

import asyncio
import json

import pytest

from e2e_bench import stress


def _args(**kw):
    return stress.parse_args(["--engine", "vllm", *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in kw.items()), [])])


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


def test_bad_requests_are_what_the_issue_lists():
    names = [n for n, _ in stress.bad_requests(1000)]
    assert names == ["empty prompt", "prompt over max_model_len", "max_tokens 0", "max_tokens huge",
                     "malformed JSON", "not UTF-8"]
    bodies = dict(stress.bad_requests(1000))
    with pytest.raises(ValueError):
        json.loads(bodies["malformed JSON"])
    with pytest.raises(UnicodeDecodeError):
        bodies["not UTF-8"].decode("utf-8")
    assert len(json.loads(bodies["prompt over max_model_len"])["prompt"]) > 1000


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
                 "requests_ok": 42.0}


def test_compare_counts_early_divergence():
    oracle = {"a": {"tokens": list(range(32))}, "b": {"tokens": list(range(32))}, "c": {"tokens": list(range(32))}}
    got = {"a": {"tokens": list(range(32))}, "b": {"tokens": [0, 1, 2, 99] + list(range(4, 32))},
           "c": {"tokens": None}}
    r = stress.compare(oracle, got, ["a", "b", "c", "missing"])
    assert r == {"compared": 2, "mean_tokens_before_divergence": (32 + 3) / 2, "diverged_within_16": 1}


class _Fake:
    """A stand-in HTTP server: 200 with token ids, 400 for bad JSON, chunked streams, /metrics."""

    def __init__(self):
        self.closed_early = 0

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
        if path == "/health":
            out = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        elif bad or req.get("prompt") == []:
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
        else:
            toks = [t % 7 for t in req["prompt"][: req["max_tokens"]]]
            msg = json.dumps({"choices": [{"token_ids": toks}]}).encode()
            out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(msg), msg)
        writer.write(out)
        await writer.drain()
        writer.close()


def test_http_client_against_a_stand_in_server():
    async def scenario():
        fake = _Fake()
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reqs = [{"id": "ok", "prompt": [8, 9, 10, 11], "max_tokens": 3, "at": 0.01},
                {"id": "drop", "prompt": [1] * 10, "max_tokens": 5, "abort": "decode"},
                {"id": "early", "prompt": [1] * 10, "max_tokens": 5, "abort": "prefill"}]
        got = await stress.run_requests("vllm", port, reqs, concurrent=True)
        bad = await stress.run_bad("vllm", port, 64)
        refused = await stress.http(1, "GET", "/health", timeout=2)
        server.close()
        return got, bad, refused

    got, bad, refused = asyncio.run(scenario())
    assert got["ok"] == {"status": 200, "tokens": [1, 2, 3]}
    assert got["drop"]["status"] == 0 and got["early"]["status"] == 0
    by = {b["request"]: b for b in bad}
    assert by["empty prompt"]["status"] == 400 and by["malformed JSON"]["status"] == 400
    assert all(b["healthy_after"] and b["serves_after"] for b in bad)
    assert refused == (-1, b"")


def test_spec_server_arguments():
    assert json.loads(stress.spec_args("vllm", "qwen3_next", 4)[1]) == {"method": "qwen3_next_mtp",
                                                                       "num_speculative_tokens": 4}
    assert json.loads(stress.spec_args("vllm", "qwen3_5_moe", 2)[1])["method"] == "mtp"
    assert stress.spec_args("sglang", "qwen3_next", 3)[:2] == ["--speculative-algorithm", "NEXTN"]
    with pytest.raises(SystemExit):
        stress.parse_args(["--engine", "vllm", "--spec-tokens", "9"])


def test_stress_server_asks_for_the_prefix_cache():
    assert stress.cache_args("vllm") == ["--enable-prefix-caching"]
    assert stress.cache_args("sglang") == ["--mamba-scheduler-strategy", "extra_buffer"]
