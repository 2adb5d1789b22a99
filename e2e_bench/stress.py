"""Reliability under load: the serving benchmark's servers pushed where GDN state meets the scheduler.

For each backend (``flashqla`` and the engine's default, same model and flags as
``e2e_bench/serve.py``) the harness runs

* an **oracle** server: every request of every scenario sent alone, one after another, greedy;
* a **stress** server, through the scenarios:

  - ``bad``: empty prompt, prompt over the model length, ``max_tokens`` 0 and huge, malformed
    JSON, a body that is not UTF-8 — each answered, none with a 5xx, and the server still serves;
  - ``abort``: streaming requests dropped by the client mid-prefill and mid-decode, then new
    requests on the freed state slots;
  - ``load``: requests with prompt lengths log-uniform over 1..``--max-prompt`` (plus one of
    ``--longest`` tokens), Poisson arrivals at ``--rate`` per second (above capacity, so the
    scheduler queues and preempts);
  - ``prefix``: shared prefixes of lengths that are not multiples of the block size, each with
    several suffixes, sent once to fill the prefix cache, again after a burst of unrelated long
    prompts (eviction under memory pressure);

* a **speculative** server per ``--spec-tokens`` value (vLLM ``qwen3_next_mtp`` / ``mtp``;
  SGLang ``NEXTN``, the model's own MTP layer as the draft): greedy speculative decoding is
  lossless, so its tokens must equal the oracle's.

Every request's greedy tokens are compared with the oracle's: tokens before the first
divergence, and how many requests diverge within their first 16 tokens (bf16 numerics under
other batch shapes may diverge late; a state bug diverges early or produces garbage). The engine's
``/metrics`` give preemptions (SGLang: retracted requests) and prefix-cache hits (tokens), read
before and after each scenario so that each row counts its own. Results::

    e2e_bench/results/<date>-<gpu>-stress-<engine>-tp<N>.json / .md

    python -m e2e_bench.stress --engine vllm --model qwen3-next-80b-a3b --layers 8 --out-dir "$OUT"
    python -m e2e_bench.stress ... --dry-run     # the plan: requests per scenario, server commands

``--phase`` splits a run over several commands (device calls): ``oracle`` (the oracle servers only),
``stress`` (the stress servers), ``spec`` (the speculative servers); each later phase reuses the
oracle's tokens and earlier phases' rows from the work directory, and every results file holds all
the rows measured there for the same plan. Runs side by side on one machine (one per GPU or GPU
group, ``scripts/gpu_session.sh stress-split``) share the work directory: a ``stress`` run makes a
backend's oracle first, a ``spec`` run with ``--wait-oracle S`` starts its server at once and waits
for that oracle only to compare, and ``--collect`` writes the results of them all.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import pathlib
import random
import re
import shlex
import sys
import time
from collections import Counter

from . import serve
from .agreement import STATE_NATS, TIE_NATS, agreeing_prefix, distinct_tokens, logprob_agreement

#: --forced: the stress server's logits processor and the request key it reads
#: (qla_serving.integrations.vllm.forced's LOGITS_PROCESSOR and FORCED_KEY; the harness runs where
#: only the engine imports qla_serving)
FORCED_PROCESSOR = "qla_serving.integrations.vllm.forced:ForcedTokens"
FORCED_KEY = "qla_forced_tokens"

SCENARIOS = ("bad", "abort", "load", "prefix")
LOAD_SENDS = ("arrivals", "one-at-a-time", "together", "behind-prefill", "ahead-of-prefill")
# --load-send behind- / ahead-of-prefill: each request sent with a new prompt of this many tokens,
# PAIR_GAP_S apart (the first sent first), a pair every PAIR_SPACING_S. With a token budget of 2048
# per step (--stress-server-arg=--max-num-batched-tokens=2048) the companion's prefill takes three
# steps, the second and third of them as a chunked-prefill continuation, which vLLM's batch order
# puts before every new request: a request sent behind it joins the third step behind its row.
COMPANION_PROMPT, PAIR_GAP_S, PAIR_SPACING_S = 6000, 0.005, 0.25
LOAD_SENDING = {"load_send": "arrivals", "load_max_prompt": 0}  # the plan's load as planned
PHASES = ("all", "oracle", "stress", "spec")
EARLY = 16  # a divergence within a request's first EARLY tokens counts as early
BLOCK_UNALIGNED_PREFIXES = (97, 1000, 1537, 4099, 12345)
# abort: prompt lengths of requests dropped before their first token (long, so that the abort can
# land while the prefill runs: chunked prefill takes it in several steps) and after it; the tokens
# each asks for (never reached: the abort comes first)
ABORT_PREFILL_PROMPT, ABORT_DECODE_PROMPT, ABORT_MAX_TOKENS = 16384, 512, 1024
# abort: the new requests go this long after the aborted ones (SGLang's own abort of a
# disconnected stream comes 2 s after the disconnect; the explicit /abort_request lands at once)
AFTER_ABORT_S = 3.0
# --budget: no server is started with less than this left (a start is 2-5 minutes)
SERVER_MIN_S = 180.0
# a run waiting for an oracle (--wait-oracle) stops once no run has been making it for this long
ORACLE_MAKER_GRACE_S = 60.0


# ----------------------------------------------------------------------------- requests


def load_lengths(n: int, max_prompt: int, longest: int, seed: int) -> list[int]:
    """``n`` prompt lengths, log-uniform over ``[1, max_prompt]``, the last one ``longest`` (if > 0)."""
    rng = random.Random(seed)
    lens = [max(1, min(max_prompt, int(math.exp(rng.uniform(0, math.log(max_prompt)))))) for _ in range(n)]
    if longest:
        lens[-1] = longest
    return lens


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of ``n`` requests at ``rate`` per second, exponential gaps."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(serve.TOKENIZER_WORDS) for _ in range(n)]


def plan_requests(args) -> dict[str, list[dict]]:
    """Every scenario's requests: ``{"id", "prompt", "max_tokens", ...}``; the oracle runs them all."""
    rng = random.Random(args.seed)
    plan: dict[str, list[dict]] = {}
    if "load" in args.scenarios:
        lens = load_lengths(args.requests, args.max_prompt, args.longest, args.seed)
        at = poisson_arrivals(args.requests, args.rate, args.seed + 1)
        plan["load"] = [{"id": f"load-{i}", "prompt": ids(rng, n), "max_tokens": args.max_tokens, "at": t}
                        for i, (n, t) in enumerate(zip(lens, at))]
    if "abort" in args.scenarios:
        reqs = []
        for i in range(args.aborts):
            # dropped after the first streamed token (mid-decode) or before any (mid-prefill)
            when = "prefill" if i % 2 == 0 else "decode"
            n = min(ABORT_PREFILL_PROMPT, args.max_prompt) if when == "prefill" else ABORT_DECODE_PROMPT
            reqs.append({"id": f"abort-{i}", "prompt": ids(rng, n), "max_tokens": ABORT_MAX_TOKENS, "abort": when})
        # then new requests, once the aborted ones have let go of their state slots
        reqs += [{"id": f"after-abort-{i}", "prompt": ids(rng, 300 + 37 * i), "max_tokens": args.max_tokens,
                  "at": AFTER_ABORT_S} for i in range(args.aborts)]
        plan["abort"] = reqs
    if "prefix" in args.scenarios:
        reqs = []
        for p, plen in enumerate(BLOCK_UNALIGNED_PREFIXES):
            prefix = ids(rng, plen)
            for j in range(args.suffixes):
                reqs.append({"id": f"prefix-{p}-{j}", "prompt": prefix + ids(rng, 17 + 29 * j),
                             "max_tokens": args.max_tokens})
        plan["prefix"] = reqs
    return plan


def bad_requests(max_len: int, engine: str = "vllm") -> list[tuple[str, bytes]]:
    """(name, raw JSON body) of each malformed request, in the engine's request shape (vLLM's
    ``/v1/completions``, SGLang's ``/generate``: :func:`request_path`)."""
    if engine == "sglang":
        def body(prompt, max_tokens):
            return json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens,
                                                                        "temperature": 0}}).encode()
        malformed = b'{"input_ids": [1, 2,'
        not_utf8 = b'{"text": "\xff\xfe\xfa", "sampling_params": {"max_new_tokens": 4}}'
    else:
        def body(prompt, max_tokens):
            return json.dumps({"model": "bench", "temperature": 0, "prompt": prompt, "max_tokens": max_tokens}).encode()
        malformed = b'{"model": "bench", "prompt": [1, 2,'
        not_utf8 = b'{"model": "bench", "prompt": "\xff\xfe\xfa", "max_tokens": 4}'

    return [
        ("empty prompt", body([], 8)),
        ("prompt over max_model_len", body([5] * (max_len + 16), 8)),
        ("max_tokens 0", body([5, 6, 7], 0)),
        ("max_tokens huge", body([5, 6, 7], 10**9)),
        ("malformed JSON", malformed),
        ("not UTF-8", not_utf8),
    ]


# ----------------------------------------------------------------------------- HTTP


async def http(port: int, method: str, path: str, body: bytes = b"", timeout: float = 600,
               abort_after: str | None = None, before_close=None) -> tuple[int, bytes]:
    """One HTTP/1.1 request on its own connection; ``abort_after`` "prefill" drops it once the
    response has begun (the server has the request) and before any token, "decode" after the first
    streamed chunk (the client's disconnect); ``before_close`` (a coroutine function) is awaited
    just before the drop (SGLang: its ``/abort_request``). Returns (status, body); status 0 for a
    dropped request, -1 for a connection error."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    except (OSError, asyncio.TimeoutError):
        return -1, b""
    try:
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head + body)
        await writer.drain()
        if abort_after == "prefill":
            if before_close is not None:
                # SGLang sends a stream's headers at once and takes the request up as the body
                # starts: wait for them, so that the abort finds the request
                try:
                    await asyncio.wait_for(reader.readline(), 0.5)
                except asyncio.TimeoutError:
                    pass
            await asyncio.sleep(0.05)
            if before_close is not None:
                await before_close()
            return 0, b""
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        if abort_after == "decode":
            await asyncio.wait_for(reader.readuntil(b"data:"), timeout)
            if before_close is not None:
                await before_close()
            return 0, b""
        data = await asyncio.wait_for(reader.read(), timeout)
        status = int(status_line.split()[1]) if status_line.startswith(b"HTTP/") else -1
        payload = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else data
        if b"transfer-encoding: chunked" in data.split(b"\r\n\r\n", 1)[0].lower():
            payload = dechunk(payload)
        return status, payload
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ValueError, IndexError):
        return -1, b""
    finally:
        writer.close()


def dechunk(raw: bytes) -> bytes:
    out, rest = b"", raw
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def request_path(engine: str) -> str:
    return "/v1/completions" if engine == "vllm" else "/generate"


def rid(req: dict) -> str:
    """The request id the harness gives SGLang (its ``/abort_request`` takes it)."""
    return f"stress-{req['id']}"


def completion_body(engine: str, req: dict, stream: bool = False, logprobs: int = 0) -> tuple[str, bytes]:
    """The request's HTTP path and body; with ``logprobs`` (not streamed) the answer also carries
    each generated token's logprob and the ``logprobs`` most likely tokens, by token id."""
    if engine == "vllm":
        body = {"model": "bench", "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": stream}
        if logprobs and not stream:
            body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
        if req.get("forced") is not None:  # --forced: the answer is these tokens
            body["vllm_xargs"] = {FORCED_KEY: req["forced"]}
        return request_path(engine), json.dumps(body).encode()
    body = {"input_ids": req["prompt"], "stream": stream, "sampling_params": {
        "max_new_tokens": req["max_tokens"], "temperature": 0, "ignore_eos": True}}
    if logprobs and not stream:
        body.update(return_logprob=True, top_logprobs_num=logprobs)
    if req.get("abort"):
        body["rid"] = rid(req)
    return request_path(engine), json.dumps(body).encode()


def output_tokens(engine: str, payload: bytes) -> list[int] | None:
    try:
        data = json.loads(payload)
        return list(data["choices"][0]["token_ids"]) if engine == "vllm" else list(data["output_ids"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def output_logprobs(engine: str, payload: bytes) -> list | None:
    """Per generated token ``[logprob, [[token, logprob], ...]]`` (the chosen token's, then the top
    tokens'), or None when the answer has none."""
    try:
        data = json.loads(payload)
        if engine == "vllm":
            lp = data["choices"][0]["logprobs"]
            return [[c, [[int(t.rsplit(":", 1)[1]), v] for t, v in (top or {}).items()]]
                    for c, top in zip(lp["token_logprobs"], lp["top_logprobs"])]
        meta = data["meta_info"]
        return [[c[0], [[t[1], t[0]] for t in top or []]]
                for c, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def finish_reason(engine: str, payload: bytes) -> str | None:
    """Why the engine ended the request ("length", "stop", "abort", ...), None if it does not say.
    An engine that aborts a request itself (out of memory, say) still answers 200 with the tokens
    it made: :func:`summarize` counts those as failed, not compared."""
    try:
        data = json.loads(payload)
        if engine == "vllm":
            return data["choices"][0].get("finish_reason")
        reason = data["meta_info"]["finish_reason"]
        return reason.get("type") if isinstance(reason, dict) else reason
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


async def run_requests(engine: str, port: int, reqs: list[dict], concurrent: bool,
                       deadline: float | None = None, logprobs: int = 0) -> dict[str, dict]:
    """Send ``reqs`` (at their ``at`` times when concurrent, else one after another), each with a
    600 s timeout that ends at ``deadline`` (``time.monotonic()``) at the latest. SGLang's dropped
    requests are also aborted through its ``/abort_request`` (vLLM aborts on the disconnect;
    SGLang does too, but 2 s later)."""
    results: dict[str, dict] = {}

    async def one(req):
        if concurrent and req.get("at"):
            await asyncio.sleep(req["at"])
        timeout = 600.0 if deadline is None else max(1.0, min(600.0, deadline - time.monotonic()))
        path, body = completion_body(engine, req, stream=bool(req.get("abort")), logprobs=logprobs)
        out: dict = {}
        before_close = None
        if engine == "sglang" and req.get("abort"):
            async def before_close():
                out["abort_status"], _ = await http(port, "POST", "/abort_request",
                                                    json.dumps({"rid": rid(req)}).encode(), timeout=30)
        status, payload = await http(port, "POST", path, body, timeout=timeout, abort_after=req.get("abort"),
                                     before_close=before_close)
        ok = status == 200
        results[req["id"]] = {"status": status, "tokens": output_tokens(engine, payload) if ok else None,
                              "finish": finish_reason(engine, payload) if ok else None, **out}
        if ok and logprobs and not req.get("abort"):
            results[req["id"]]["logprobs"] = output_logprobs(engine, payload)

    if concurrent:
        await asyncio.gather(*(one(r) for r in reqs))
    else:
        for r in reqs:
            await one(r)
    return results


async def run_bad(engine: str, port: int, max_len: int, deadline: float | None = None) -> list[dict]:
    """Each bad request, then ``/health`` and one good request: the server must keep serving. With
    ``deadline`` (``time.monotonic()``) every wait ends by then, and no request starts after it."""

    def timeout(most: float) -> float:
        return most if deadline is None else max(1.0, min(most, deadline - time.monotonic()))

    out = []
    good = {"id": "good", "prompt": [11, 12, 13], "max_tokens": 4}
    for name, body in bad_requests(max_len, engine):
        if deadline is not None and time.monotonic() >= deadline:
            serve.log(f"budget: bad requests from {name} on not sent")
            break
        status, payload = await http(port, "POST", request_path(engine), body, timeout=timeout(120))
        health, _ = await http(port, "GET", "/health", timeout=timeout(60))
        gpath, gbody = completion_body(engine, good)
        gstatus, _ = await http(port, "POST", gpath, gbody, timeout=timeout(120))
        out.append({"request": name, "status": status, "detail": payload[:200].decode(errors="replace"),
                    "healthy_after": health == 200, "serves_after": gstatus == 200})
    return out


# Prometheus counters per engine (summed over label sets; a counter's ``_total`` suffix is dropped
# before matching). vLLM counts prefix-cache queries and hits in tokens; SGLang counts the prompt
# tokens of every finished request and, of those, the ones its radix cache supplied
# (``cached_tokens``, by cache source), and calls a preemption a retraction (decode out of memory:
# the request goes back to the queue and is recomputed). SGLang's ``num_requests`` counts every
# finished request, aborted ones included (those also in ``num_aborted_requests``).
METRICS = {
    "vllm": {"preemptions": "vllm:num_preemptions", "prefix_cache_hits": "vllm:prefix_cache_hits",
             "prefix_cache_queries": "vllm:prefix_cache_queries", "requests_ok": "vllm:request_success",
             "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
             "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"},
    "sglang": {"preemptions": "sglang:num_retracted_requests", "prefix_cache_hits": "sglang:cached_tokens",
               "prefix_cache_queries": "sglang:prompt_tokens", "requests_ok": "sglang:num_requests",
               "requests_aborted": "sglang:num_aborted_requests",
               # a gauge: the mean accepted length of the recent verify steps (drafts + 1 at most)
               "spec_accept_length": "sglang:spec_accept_length"},
}


def drafts_accepted(m: dict) -> str:
    """A speculative server's draft acceptance for the results table: vLLM's accepted of drafted
    tokens, SGLang's mean accepted length per verify step ('—' where the engine reported none)."""
    if m.get("spec_draft_tokens"):
        return f"{m.get('spec_accepted_tokens', 0):.0f} of {m['spec_draft_tokens']:.0f}"
    if m.get("spec_accept_length"):
        return f"length {m['spec_accept_length']:.2f}"
    return "—"


def parse_metrics(text: str, engine: str = "vllm") -> dict[str, float]:
    """Sums of the engine's Prometheus counters we report (all label sets)."""
    names = METRICS[engine]
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*?)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$", line.strip())
        if not m:
            continue
        for key, name in names.items():
            if m.group(1) == name:
                out[key] += float(m.group(2))
    return out


# ----------------------------------------------------------------------------- comparison


def compare(oracle: dict[str, dict], got: dict[str, dict], ids_: list[str],
            prompt_tokens: dict[str, int] | None = None) -> dict:
    """Agreement of ``got`` with ``oracle`` over the request ids both completed; where both carry
    logprobs (``--logprobs``), also how far apart in probability (``agreement.logprob_agreement``):
    the largest logprob drift over the tokens they share (median and max over requests, and how
    many requests drifted ``TIE_NATS`` or more), how many of the divergences were not near ties (a
    gap of ``TIE_NATS`` or more), and each request's numbers (``per_request``: tokens agreeing,
    drift and the generated token where it is largest, gap or "outside top", its prompt's length
    where ``prompt_tokens`` gives it, and at ``STATE_NATS`` or more the drift at every token).
    ``identical``: answers equal to the oracle's throughout (with ``--forced``, every compared one
    unless the forcing failed)."""
    before, early, compared, answers, drifts, gaps, detail, identical = [], 0, 0, [], [], [], {}, 0
    for rid_ in ids_:
        o_res, g_res = oracle.get(rid_) or {}, got.get(rid_) or {}
        o, g = o_res.get("tokens"), g_res.get("tokens")
        if not o or g is None or g_res.get("finish") == "abort":
            continue
        compared += 1
        answers.append(o)
        n = agreeing_prefix(o, g)
        before.append(n)
        identical += n == len(o) == len(g)
        if n < min(EARLY, len(o)):
            early += 1
        lp = logprob_agreement(o, o_res.get("logprobs"), g, g_res.get("logprobs"))
        if lp is not None:
            drifts.append(lp["drift"])
            if lp["gap"] is not None:
                gaps.append(lp["gap"])
            detail[rid_] = {"agreeing": n, "drift": round(lp["drift"], 4), "drift_at": lp["drift_at"],
                            "gap": None if lp["gap"] is None else (round(lp["gap"], 4) if math.isfinite(lp["gap"])
                                                                   else "outside top")}
            if prompt_tokens and rid_ in prompt_tokens:
                detail[rid_]["prompt_tokens"] = prompt_tokens[rid_]
            if lp["drift"] >= STATE_NATS:  # past the state line: the drift token by token, to read its shape
                detail[rid_]["drifts"] = [round(x, 3) for x in lp["drifts"]]
    row = {"compared": compared, "mean_tokens_before_divergence": (sum(before) / len(before)) if before else None,
           "diverged_within_16": early, "identical": identical, "oracle_distinct_tokens": distinct_tokens(answers)}
    if drifts:
        drifts.sort()
        row.update(logprob_compared=len(drifts), logprob_drift_median=drifts[len(drifts) // 2],
                   logprob_drift_max=drifts[-1], logprob_drift_over_tie=sum(d >= TIE_NATS for d in drifts),
                   divergences=len(gaps),
                   divergences_not_near_tie=sum(gap >= TIE_NATS for gap in gaps),
                   divergence_gap_median=sorted(gaps)[len(gaps) // 2] if gaps else None,
                   per_request=detail)
    return row


def summarize(engine: str, plan: dict, oracle: dict, got: dict, scenario: str) -> dict:
    reqs = plan[scenario]
    res = [got.get(r["id"], {}) for r in reqs if not r.get("abort")]
    st = [g.get("status") for g in res]
    served_abort = sum(1 for g in res if g.get("status") == 200 and g.get("finish") == "abort")
    row = {"scenario": scenario, "sent": len(reqs), "completed": sum(s == 200 for s in st) - served_abort,
           "aborted": sum(1 for r in reqs if r.get("abort")),
           "failed_clean": sum(1 for s in st if s is not None and 400 <= s < 500),
           "failed_other": sum(1 for s in st if s is None or s < 0 or s >= 500) + served_abort}
    if served_abort:
        row["aborted_by_server"] = served_abort
    calls = [got.get(r["id"], {}).get("abort_status") for r in reqs if r.get("abort")]
    if any(c is not None for c in calls):
        row["abort_endpoint_ok"] = sum(c == 200 for c in calls)
    row.update(compare(oracle, got, [r["id"] for r in reqs if not r.get("abort")],
                       {r["id"]: len(r["prompt"]) for r in reqs}))
    return row


# ----------------------------------------------------------------------------- servers


def oracle_args(engine: str) -> list[str]:
    """The oracle server computes every request from scratch: SGLang's radix cache is on by
    default and would serve the prefix scenario's shared prefixes from the cache (vLLM 0.26 leaves
    its prefix cache off for hybrid GDN models)."""
    return ["--disable-radix-cache"] if engine == "sglang" else []


def cache_args(engine: str, backend: str = "flashqla") -> list[str]:
    """The stress server's prefix cache: vLLM 0.26 leaves it off for hybrid GDN models (its "align"
    mode must be asked for); SGLang's radix cache is on, with the mamba strategy the issue names
    (``extra_buffer``; the flag was ``--mamba-scheduler-strategy`` before SGLang 0.5.17 renamed it,
    and 0.5.20 dropped the old name). SGLang refuses ``extra_buffer`` for its flashinfer GDN
    kernels (``no_buffer`` only), so that backend keeps SGLang's own choice."""
    if engine == "vllm":
        return ["--enable-prefix-caching"]
    return [] if backend == "flashinfer" else ["--mamba-radix-cache-strategy", "extra_buffer"]


def metrics_args(engine: str) -> list[str]:
    """SGLang serves ``/metrics`` only when asked (vLLM always does)."""
    return ["--enable-metrics"] if engine == "sglang" else []


# a speculative server's name by proposer: its tag is the name and k (``spec2``, ``ngram2``), its
# rows' scenario the name, a dash and k (``spec-2``)
SPEC_NAMES = {"mtp": "spec", "ngram": "ngram"}
SPEC_METHODS = tuple(SPEC_NAMES)


def spec_tag(method: str, k: int) -> str:
    return f"{SPEC_NAMES[method]}{k}"


def spec_args(engine: str, model_type: str, k: int, method: str = "mtp") -> list[str]:
    """MTP speculative decoding with ``k`` draft tokens per step. SGLang: ``NEXTN`` (which it
    resolves to ``EAGLE``) loads the target's own config as the draft, as
    ``Qwen3NextForCausalLMMTP`` (one MTP layer; ``--load-format dummy`` applies to it too);
    ``k`` steps of a linear chain verify ``k + 1`` tokens.

    ``ngram`` (vLLM): drafts of up to ``k`` tokens looked up in the request's own tokens (the
    tokens after an earlier occurrence of its last 1 to 4), none when they do not recur, so steps
    mix rows with drafts of every length and rows without. (On the benchmark's random prompts a
    single token recurs often enough to draft; whether a draft is accepted is the model's.)"""
    if method == "ngram":
        if engine != "vllm":
            raise ValueError("--spec-method ngram: vLLM's proposer; SGLang's speculative servers run NEXTN")
        return ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": k,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 4})]
    if engine == "vllm":
        method = "qwen3_next_mtp" if model_type == "qwen3_next" else "mtp"
        return ["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": k})]
    return ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(k),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1)]


def server_commands(s: serve.Setup, backend: str, args, model_type: str) -> dict[str, list[str]]:
    """Every server one backend's run starts, by tag: ``oracle``, ``stress``, ``spec<k>``
    (``serve.server_command``: the serving benchmark's command, backend flag and all, plus these
    servers' own arguments; ``--server-arg`` comes last and wins, on the stress server before its
    own ``--stress-server-arg``, on the speculative ones before their ``--spec-server-arg``)."""
    e = s.engine
    stress = (cache_args(e, backend) if "prefix" in args.scenarios else []) + metrics_args(e)
    if args.forced:
        stress += ["--logits-processors", FORCED_PROCESSOR]
    cmds = {"oracle": serve.server_command(s, backend, oracle_args(e) + args.server_arg),
            "stress": serve.server_command(s, backend, stress + args.server_arg + args.stress_server_arg)}
    for k in args.spec_tokens:
        cmds[spec_tag(args.spec_method, k)] = serve.server_command(
            s, backend, spec_args(e, model_type, k, args.spec_method) + metrics_args(e)
                                                + args.server_arg + args.spec_server_arg)
    return cmds


def digest(what) -> str:
    """A short stable key of a JSON-able value (a plan, the arguments a saved part is valid for)."""
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def plan_key(plan: dict) -> str:
    return digest(plan)


def oracle_key(args, plan: dict) -> str:
    """What the oracle's tokens are valid for: the plan and the servers' arguments (not the stress
    server's own, ``--stress-server-arg``)."""
    what = {"plan": plan_key(plan), "engine": args.engine, "model": args.model, "layers": args.layers,
            "tp": args.tp, "server_args": args.server_arg}
    if args.weights != "dummy":  # (keys of runs before the choice stay valid)
        what["weights"] = args.weights
    if args.logprobs:  # an oracle without them cannot be compared in probability
        what["logprobs"] = args.logprobs
    return digest(what)


def run_key(args, plan: dict) -> str:
    """What the saved rows are valid for: the oracle's key and the stress server's own arguments."""
    key = oracle_key(args, plan)
    sending = {name: getattr(args, name) for name in LOAD_SENDING}
    if not args.stress_server_arg and sending == LOAD_SENDING:  # (keys of runs before the options stay valid)
        return key
    what = {"oracle": key, "stress_server_args": args.stress_server_arg}
    if sending != LOAD_SENDING:
        what.update(sending)
    return digest(what)


def spec_key(args, key: str) -> str:
    """What the speculative servers' saved rows are valid for: the run's ``key`` and, where given,
    their own ``--spec-server-arg``."""
    if not args.spec_server_arg:  # (keys of runs before the option stay valid)
        return key
    what = {"run": key, "spec_server_args": args.spec_server_arg}
    return digest(what)


# ----------------------------------------------------------------------------- saved parts


def load_requests(args, reqs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The load scenario's requests as the stress server gets them (``--load-send``), and all it is
    sent: the plan's, or (``--load-max-prompt``) those whose prompts are that short, at their
    arrival times, one at a time, or all at once; or each beside a new prompt of its own
    (``companion-<id>``, one token asked, not compared) sent ``PAIR_GAP_S`` before it
    (``behind-prefill``: the request's row comes after the companion's prefill row in vLLM's batch
    order) or after it (``ahead-of-prefill``: the request is scheduled first), a pair every
    ``PAIR_SPACING_S``."""
    if args.load_max_prompt:
        reqs = [r for r in reqs if len(r["prompt"]) <= args.load_max_prompt]
    if args.load_send == "together":
        reqs = [{**r, "at": 0.0} for r in reqs]
    if args.load_send not in ("behind-prefill", "ahead-of-prefill"):
        return reqs, reqs
    behind = args.load_send == "behind-prefill"
    reqs = [{**r, "at": i * PAIR_SPACING_S + (PAIR_GAP_S if behind else 0.0)} for i, r in enumerate(reqs)]
    sent = []
    for i, r in enumerate(reqs):
        companion = {"id": f"companion-{r['id']}", "prompt": ids(random.Random(f"companion-{i}"), COMPANION_PROMPT),
                     "max_tokens": 1, "at": i * PAIR_SPACING_S + (0.0 if behind else PAIR_GAP_S)}
        sent += [companion, r] if behind else [r, companion]
    return reqs, sent


def part_path(work: pathlib.Path, backend: str, part: str) -> pathlib.Path:
    return work / f"rows-{backend}-{part}.json"


def save_part(work: pathlib.Path, key: str, backend: str, part: str, rows: list[dict], info: dict) -> None:
    serve.write_whole(part_path(work, backend, part), json.dumps({"key": key, "rows": rows, "info": info}))


def saved_for(path: pathlib.Path, key: str) -> dict | None:
    """What ``path`` holds when it was saved for ``key`` (this plan and servers), else None."""
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return saved if saved.get("key") == key else None


def has_part(work: pathlib.Path, key: str, backend: str, part: str) -> bool:
    """Whether ``work`` holds ``part`` of ``backend`` saved for ``key`` (this plan)."""
    return saved_for(part_path(work, backend, part), key) is not None


def shard_suffix(shard: tuple[int, int]) -> str:
    """What names one shard's files (``--oracle-shard I/N``): its oracle's, its server's log; "" whole."""
    return f".shard-{shard[0]}-of-{shard[1]}" if shard != (1, 1) else ""


def shard_path(work: pathlib.Path, backend: str, shard: tuple[int, int]) -> pathlib.Path:
    """Where one shard of ``backend``'s oracle is kept (``--oracle-shard I/N``)."""
    return work / f"oracle-{backend}{shard_suffix(shard)}.json"


def saved_oracle(work: pathlib.Path, backend: str, key: str) -> dict | None:
    """The oracle's results for ``key`` saved in ``work`` (None when absent or for another plan): the
    whole oracle, or every shard of one split over servers side by side, merged into it."""
    path = work / f"oracle-{backend}.json"
    if (saved := saved_for(path, key)) is not None:
        return saved["results"]
    by_count: dict[int, dict[int, dict]] = {}
    for shard in work.glob(f"oracle-{backend}.shard-*-of-*.json"):
        i, _, n = shard.stem.split(".shard-")[1].partition("-of-")
        if (part := saved_for(shard, key)) is not None:
            by_count.setdefault(int(n), {})[int(i)] = part
    for n, parts in by_count.items():
        if len(parts) == n:
            results = {rid: r for i in sorted(parts) for rid, r in parts[i]["results"].items()}
            serve.write_whole(path, json.dumps({"key": key, "results": results,
                                                "info": {"shards": [parts[i]["info"] for i in sorted(parts)]}}))
            return results
    return None


def maker_path(work: pathlib.Path, backend: str, shard: tuple[int, int] = (1, 1)) -> pathlib.Path:
    """Where a run making ``backend``'s oracle (or a shard of it) says so, with its key and process,
    for runs waiting beside it."""
    return work / (f"oracle-{backend}.making" + (f"-{shard[0]}-of-{shard[1]}" if shard != (1, 1) else ""))


def oracle_being_made(work: pathlib.Path, backend: str, key: str) -> bool:
    """Whether a live process is making ``backend``'s oracle (or a shard of it) for ``key`` in ``work``."""
    for path in work.glob(f"oracle-{backend}.making*"):
        try:
            maker = json.loads(path.read_text())
            os.kill(int(maker["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if maker.get("key") == key:
            return True
    return False


def part_key(part: str, key: str, okey: str | None, skey: str | None = None) -> str:
    """The key a saved part is valid for: a failed oracle's is the oracle's (``okey``, where given),
    a speculative server's its own (``skey``, where given), the stress server's the run's (``key``)."""
    if part == "oracle":
        return okey or key
    return skey if skey and part != "stress" else key


def load_parts(work: pathlib.Path, key: str, backends, okey: str | None = None, skey: str | None = None) -> list[dict]:
    """Every part saved in ``work`` for ``key``: a failed oracle (saved for ``okey``, the oracle's
    key, where it differs), the stress server, then MTP and ngram servers by k (saved for ``skey``,
    their own key, where it differs)."""
    found = []
    names = list(SPEC_NAMES.values())
    for backend in backends:
        for path in work.glob(f"rows-{backend}-*.json"):
            part = path.stem[len(f"rows-{backend}-"):]
            spec = re.fullmatch(rf"({'|'.join(names)})(\d+)", part)
            # (rows-flashqla-fault-stress.json is flashqla-fault's stress, not a part of flashqla)
            if part not in ("oracle", "stress") and not spec:
                continue
            if (saved := saved_for(path, part_key(part, key, okey, skey))) is not None:
                order = {"oracle": (0, 0), "stress": (1, 0)}.get(part) or (2 + names.index(spec[1]), int(spec[2]))
                found.append((order, {"backend": backend, "part": part, **saved}))
    return [p for _, p in sorted(found, key=lambda t: (list(backends).index(t[1]["backend"]), t[0]))]


# ----------------------------------------------------------------------------- the run


class Budget:
    """Seconds left of ``--budget`` (0: none)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds if seconds else float("inf")

    def left(self) -> float:
        return self.end - time.monotonic()

    def timeout(self, most: float) -> float:
        return max(1.0, min(most, self.left() - 15))

    def deadline(self) -> float | None:
        """When requests must have answered (15 s before the end), None without a budget."""
        return None if self.end == float("inf") else self.end - 15


def run_backend(s: serve.Setup, backend: str, args, plan: dict, work: pathlib.Path, model_type: str,
                key: str, budget: Budget, okey: str | None = None) -> list[dict]:
    """This call's phases for one backend; each server's rows are saved in ``work`` as they come
    for ``key``, its oracle for ``okey`` (default ``key``). Returns the rows of servers that could
    not run (errors, or left out for the budget)."""
    okey, skey = okey or key, spec_key(args, key)
    env = serve.backend_env(backend, s.tp, s.engine)
    env[serve.WEIGHTS_ENV] = args.weights
    cmds = server_commands(s, backend, args, model_type)
    problems: list[dict] = []
    everything = [r for reqs in plan.values() for r in reqs if not r.get("abort")]
    began = time.monotonic()

    def info(tag, srv) -> dict:
        text = srv.log_text()
        call = shlex.join(["python", "-m", "e2e_bench.stress", *getattr(args, "argv", [])])
        return {"command": shlex.join(cmds[tag]), "call": call,
                "resolved": serve.resolve_default(s.engine, text) if backend == "default" else backend,
                "fallback": any(mark in text for mark in serve.FALLBACK_MARKS)}

    def failed(tag, srv, error) -> None:
        """A failure is saved like a part (a later call that gets further replaces it), so that the
        results file of a split run still shows it."""
        row = {"backend": backend, "scenario": tag, "error": error, "crashed": not srv.alive(),
               "log_tail": serve.tail(srv.log_path, 20)}
        problems.append(row)  # (the call fails; its results file shows the part, not this twice)
        save_part(work, part_key(tag, key, okey, skey), backend, tag, [row], info(tag, srv))

    def start(tag) -> serve.Server | None:
        if budget.left() < SERVER_MIN_S:
            serve.log(f"budget: {backend} {tag} left out ({budget.left():.0f} s left)")
            row = {"backend": backend, "scenario": tag, "error": "left out (budget)"}
            problems.append(row)
            # saved like a part, so that --collect shows it, unless an earlier call measured it
            k = part_key(tag, key, okey, skey)
            if not has_part(work, k, backend, tag):
                save_part(work, k, backend, tag, [row], {})
            return None
        serve.log(f"start {backend} {tag}: {shlex.join(cmds[tag])}")
        # each oracle shard's server a log of its own (the shards' servers run side by side in one work directory)
        shard = shard_suffix(args.oracle_shard) if tag == "oracle" else ""
        srv = serve.Server(cmds[tag], env, work / f"server-{backend}-{tag}{shard}.log", s.port)
        if srv.start(budget.timeout(args.start_timeout)):
            serve.log(f"healthy {backend} {tag} after {time.monotonic() - srv.started:.0f} s")
            return srv
        why = serve.start_failure(srv.log_path)
        serve.log(f"FAILED {backend} {tag} start ({why}):\n{serve.tail(srv.log_path)}")
        failed(tag, srv, why)  # crashed: it exited (else it did not answer in time)
        srv.stop()
        return None

    def metrics() -> dict:
        status, text = asyncio.run(http(s.port, "GET", "/metrics", timeout=budget.timeout(60)))
        return parse_metrics(text.decode(errors="replace"), s.engine) if status == 200 else {}

    # the oracle: each request alone on a fresh server (kept in the work directory, so a run can be
    # split into an oracle call and later calls, or made by a run beside this one: --wait-oracle)
    oracle_file = work / f"oracle-{backend}.json"
    oracle = saved_oracle(work, backend, okey)
    if oracle is not None:
        serve.log(f"oracle {backend}: reusing {oracle_file}")
    elif args.wait_oracle and args.phase in ("stress", "spec"):
        serve.log(f"oracle {backend}: made by the run beside this one; compared once {oracle_file} is there")
    elif args.oracle_shard != (1, 1) and saved_for(shard_path(work, backend, args.oracle_shard), okey):
        serve.log(f"oracle {backend}: reusing {shard_path(work, backend, args.oracle_shard)}")
    else:
        # this run's share of the oracle's requests: all of them, or every N-th from the I-th
        i, n = args.oracle_shard
        mine = everything[i - 1::n]
        what = f"oracle {backend}" + (f" shard {i}/{n}" if n > 1 else "")
        # an earlier call's failed oracle would tell a run waiting beside this one to stop waiting
        part_path(work, backend, "oracle").unlink(missing_ok=True)
        maker = maker_path(work, backend, args.oracle_shard)
        serve.write_whole(maker, json.dumps({"key": okey, "pid": os.getpid()}))
        srv = start("oracle")
        if srv is None:
            maker.unlink(missing_ok=True)
            return problems
        try:
            got = asyncio.run(run_requests(s.engine, s.port, mine, concurrent=False, deadline=budget.deadline(),
                                           logprobs=args.logprobs))
            if n == 1:  # (a partial one still scores this run's rows)
                oracle = got
            done = sum(v["status"] == 200 for v in got.values())
            serve.log(f"{what}: {done} of {len(mine)}")
            if done == len(mine):  # a partial oracle is not kept: the next call redoes it
                saved = json.dumps({"key": okey, "results": got, "info": info("oracle", srv)})
                if n == 1:
                    serve.write_whole(oracle_file, saved)
                else:  # the last shard to finish merges them (saved_oracle)
                    serve.write_whole(shard_path(work, backend, args.oracle_shard), saved)
                    oracle = saved_oracle(work, backend, okey)
                part_path(work, backend, "oracle").unlink(missing_ok=True)
            else:
                failed("oracle", srv, f"{what}: {done} of {len(mine)} oracle requests answered")
        finally:
            srv.stop()
            maker.unlink(missing_ok=True)
    if args.phase == "oracle":
        return problems

    def the_oracle() -> dict | None:
        """This backend's oracle, waited for (up to --wait-oracle seconds and the budget) while a run
        beside this one makes it."""
        nonlocal oracle
        end = min(time.monotonic() + args.wait_oracle, budget.deadline() or float("inf"))
        while oracle is None:
            making = oracle_being_made(work, backend, okey)  # read before the oracle: it ends after saving it
            oracle = saved_oracle(work, backend, okey)
            if oracle is None:
                if has_part(work, okey, backend, "oracle"):
                    serve.log(f"oracle {backend}: the run making it failed ({part_path(work, backend, 'oracle')}); "
                              "its rows are not compared")
                    break
                if not making and time.monotonic() - began > ORACLE_MAKER_GRACE_S:
                    other = (json.loads(oracle_file.read_text()).get("key") if oracle_file.is_file() else None)
                    serve.log(f"oracle {backend}: no run is making it for this plan and these server arguments "
                              f"(key {okey}" + (f"; {oracle_file.name} holds key {other}" if other else "") +
                              "); its rows are not compared")
                    break
                if time.monotonic() >= end:
                    serve.log(f"oracle {backend}: none in {oracle_file}; its rows are not compared")
                    break
                time.sleep(5)
        return oracle

    forcing = None
    if args.phase in ("all", "stress") and args.forced:
        forcing = the_oracle()
        if forcing is None:
            row = {"backend": backend, "scenario": "stress", "error": "--forced: no oracle answers to force"}
            problems.append(row)
            save_part(work, key, backend, "stress", [row], {})

    if args.phase in ("all", "stress") and (forcing is not None or not args.forced):
        srv = start("stress")
        if srv is not None:
            # every scenario's row in order; the request scenarios' answers are scored against the
            # oracle after the last one (a run beside this one may still be making it)
            rows, unscored = [], []  # unscored: (row, the plan's scenario, the answers, the requests sent)
            counted = [metrics()]  # the server's counters before the scenarios, then after each row

            def count(row: dict) -> None:
                """The row's own preemptions and prefix hits: the counters' change while it ran."""
                if row["crashed"]:
                    return
                now = metrics()
                row["scenario_metrics"] = metrics_delta(counted[-1], now)
                counted.append(now)

            try:
                for scenario in args.scenarios:
                    t0 = time.monotonic()
                    deadline = budget.deadline()
                    if deadline is not None and t0 >= deadline:
                        serve.log(f"budget: {backend} {scenario} left out")
                        rows.append({"backend": backend, "scenario": scenario, "error": "left out (budget)"})
                        continue
                    if scenario == "bad":
                        bad = asyncio.run(run_bad(s.engine, s.port, s.max_len, deadline))
                        rows.append({"backend": backend, "scenario": "bad", "sent": len(bad),
                                     "no_5xx": sum(0 < b["status"] < 500 for b in bad),
                                     "served_after": sum(b["healthy_after"] and b["serves_after"] for b in bad),
                                     "requests": bad, "crashed": srv.crashed(),
                                     "seconds": round(time.monotonic() - t0, 1)})
                        count(rows[-1])
                        serve.log(f"{backend} bad: {rows[-1]['no_5xx']} of {len(bad)} without a 5xx, "
                                  f"served after {rows[-1]['served_after']}")
                    else:
                        concurrent = scenario != "prefix"
                        sent = to_send = plan[scenario]
                        if scenario == "load":
                            sent, to_send = load_requests(args, sent)
                            concurrent = args.load_send != "one-at-a-time"
                        reqs = forced_requests(to_send, forcing)
                        got = asyncio.run(run_requests(s.engine, s.port, reqs, concurrent,
                                                       deadline=budget.deadline(), logprobs=args.logprobs))
                        rows.append({"scenario": scenario, "crashed": srv.crashed(),
                                     "seconds": round(time.monotonic() - t0, 1)})
                        count(rows[-1])
                        unscored.append((rows[-1], scenario, got, sent))
                        if scenario == "prefix":  # again, after unrelated long prompts push the cache out
                            t0 = time.monotonic()
                            flood = [{"id": f"flood-{i}", "prompt": ids(random.Random(i), args.max_prompt),
                                      "max_tokens": 1} for i in range(args.flood)]
                            asyncio.run(run_requests(s.engine, s.port, flood, concurrent=True,
                                                     deadline=budget.deadline()))
                            again = asyncio.run(run_requests(s.engine, s.port, reqs, concurrent=True,
                                                             deadline=budget.deadline(), logprobs=args.logprobs))
                            rows.append({"scenario": "prefix-after-eviction", "crashed": srv.crashed(),
                                         "seconds": round(time.monotonic() - t0, 1)})
                            count(rows[-1])  # the flood's requests included
                            unscored.append((rows[-1], scenario, again, sent))
                        serve.log(f"{backend} {scenario}: {sum(g.get('status') == 200 for g in got.values())} "
                                  f"of {len(got)} answered 200 ({rows[-1]['seconds']} s)")
                    if rows[-1]["crashed"]:
                        serve.log(f"server {backend} died in {scenario}:\n{serve.tail(srv.log_path)}")
                        break
                # the server's totals: the last reading (no request ran after it)
                m = {} if rows and rows[-1].get("crashed") else counted[-1]
                orc = the_oracle() if unscored else oracle
                for row, scenario, got, sent in unscored:
                    # the summary's own scenario name gives way to the row's (prefix-after-eviction)
                    row.update({**compared(summarize(s.engine, {scenario: sent}, orc or {}, got, scenario), orc),
                                **row, "backend": backend})
                    if forcing is not None:
                        row["forced"] = True
                for row in rows:
                    row["server_metrics"] = m
                    serve.log(f"{backend} {row['scenario']}: "
                              f"{json.dumps({k: v for k, v in row.items() if k not in ('requests', 'per_request')})}")
                save_part(work, key, backend, "stress", rows, info("stress", srv))
            finally:
                srv.stop()

    if args.phase in ("all", "spec"):
        # Each speculative server's rows are saved as soon as it stops (uncompared when the oracle
        # is not there yet) and compared once every server has run: no server holds its GPU idle
        # while the oracle is made beside it.
        measured = []  # (tag, the row's fields, the requests, the answers, info)
        for k in args.spec_tokens:
            tag = spec_tag(args.spec_method, k)
            srv = start(tag)
            if srv is None:
                continue
            try:
                # mixed batches: requests with and without drafts come from one concurrent stream
                reqs = [r for r in everything if len(r["prompt"]) <= args.spec_max_prompt][: args.spec_requests]
                got = asyncio.run(run_requests(s.engine, s.port, [{**r, "at": 0.02 * i} for i, r in enumerate(reqs)],
                                               concurrent=True, deadline=budget.deadline(), logprobs=args.logprobs))
                crashed = srv.crashed()
                if crashed:
                    serve.log(f"server {backend} {tag} died:\n{serve.tail(srv.log_path)}")
                fields = {"backend": backend, "scenario": f"{SPEC_NAMES[args.spec_method]}-{k}", "crashed": crashed,
                          "server_metrics": {} if crashed else metrics()}
                measured.append((tag, fields, reqs, got, info(tag, srv)))
                early = spec_row(s.engine, fields, reqs, got, oracle)
                if oracle is None:  # compared below, once the oracle is there
                    early.pop("error", None)
                    early["pending"] = "waiting for the oracle's tokens"
                save_part(work, skey, backend, tag, [early], measured[-1][4])
            finally:
                srv.stop()
        if measured:
            orc = the_oracle()
            for tag, fields, reqs, got, tag_info in measured:
                row = spec_row(s.engine, fields, reqs, got, orc)
                serve.log(f"{backend} {fields['scenario']}: "
                          f"{json.dumps({k: v for k, v in row.items() if k != 'per_request'})}")
                save_part(work, skey, backend, tag, [row], tag_info)
    return problems


def compared(row: dict, orc: dict | None) -> dict:
    """``row`` (a summary against ``orc``), marked an error when there were no oracle tokens."""
    if orc is None:
        row["error"] = ("no oracle tokens to compare with (none saved for this plan and these server "
                        "arguments, and the run making them, if any, did not finish)")
    return row


def forced_requests(reqs: list[dict], oracle: dict | None) -> list[dict]:
    """``reqs`` with each compared request's answer forced to its oracle's tokens (``--forced``);
    as they are without an oracle. Dropped requests and those the oracle did not answer go free."""
    if oracle is None:
        return reqs
    out = []
    for r in reqs:
        tokens = (oracle.get(r["id"]) or {}).get("tokens")
        out.append({**r, "forced": tokens} if tokens and not r.get("abort") else r)
    return out


def spec_row(engine: str, fields: dict, reqs: list[dict], got: dict, orc: dict | None) -> dict:
    """A speculative server's row: its answers against the oracle's tokens (an error when there are none)."""
    return {**compared(summarize(engine, {"spec": reqs}, orc or {}, got, "spec"), orc), **fields}


def metrics_delta(before: dict, after: dict) -> dict:
    """What each counter of :func:`parse_metrics` gained from ``before`` to ``after`` (a counter
    missing on either side is left out: a failed read says nothing)."""
    return {k: after[k] - before[k] for k in after if k in before}


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Stress: {meta['engine']} TP {meta['tp']} on {meta['gpu']}", "", f"Model: {meta['model']}", "",
             f"Command: `{meta['command']}`", ""]
    if meta.get("backends"):
        lines += ["| backend | resolved | fallback |", "|---|---|---|"]
        lines += [f"| {b} | {i.get('resolved')} | {i.get('fallback')} |" for b, i in meta["backends"].items()]
        lines.append("")
    lines += [("| backend | scenario | sent | completed | aborted | failed 4xx | failed other | crashed | compared | "
               "mean tokens before divergence | diverged within 16 | preemptions | prefix hits | drafts accepted | "
               "oracle's distinct tokens | logprob drift, median / max | divergences not near a tie |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        # a stress-server row's own counts; a speculative server's (and earlier runs') the server's
        m = r.get("scenario_metrics") or r.get("server_metrics") or {}
        if r["scenario"] == "bad":
            lines.append(f"| {r['backend']} | bad | {r['sent']} | {r['no_5xx']} without 5xx | | | | {r['crashed']} | "
                         f"served after each: {r['served_after']} | | | | | | | | |")
            continue
        if r.get("error") or r.get("pending"):
            what = f"failed: {r['error']}" if r.get("error") else f"pending: {r['pending']}"
            lines.append(f"| {r['backend']} | {r['scenario']} | {what} | | | | | | | | | | | | | | |")
            continue
        mean = r.get("mean_tokens_before_divergence")
        scenario = r["scenario"] + (" (forced)" if r.get("forced") else "")
        lines.append(f"| {r['backend']} | {scenario} | {r['sent']} | {r['completed']} | {r['aborted']} | "
                     f"{r['failed_clean']} | {r['failed_other']} | {r['crashed']} | {r['compared']} | "
                     f"{'—' if mean is None else f'{mean:.1f}'} | {r['diverged_within_16']} | "
                     f"{m.get('preemptions', '—')} | {m.get('prefix_cache_hits', '—')} | "
                     f"{drafts_accepted(m) if r['scenario'].startswith(tuple(SPEC_NAMES.values())) else ''} | "
                     f"{r.get('oracle_distinct_tokens') if r.get('oracle_distinct_tokens') is not None else '—'} | "
                     f"{logprob_cells(r)} |")
    lines += by_prompt_length(rows)
    lines += paired_markdown(rows)
    lines += ["", ("Preemptions and prefix hits (tokens): the stress server's counters while the row ran (prefix-after-"
               "eviction with its flood of unrelated prompts), a speculative server's in all; rows without "
               "`scenario_metrics` in the JSON show the server's totals. Drafts accepted: vLLM's accepted of "
               "drafted tokens, SGLang's mean accepted length per verify step (its gauge at the end). Oracle's "
               "distinct tokens: the median count of different tokens in the oracle's answers compared (1: each "
               "answer one token repeated, which agreement can hardly tell from a wrong state; --weights random). "
               "With --logprobs, over the tokens a request's answer shares with its oracle (the same context on "
               "both servers): the largest difference of the chosen token's logprob, median and max over the "
               f"requests (bf16 numerics keep it near 0, a wrong state moves it); and of the requests that "
               f"diverge, how many parted where either server was {TIE_NATS} nats or more from the other's token "
               "or did not have it among its top tokens (a near tie flips under bf16 rounding; a wrong state "
               "does not need one). Forced rows (--forced): each answer forced to its oracle's tokens, so the "
               "drift covers every position; the counts after it are the requests that drifted "
               f"{TIE_NATS} nats or more and those that drifted {STATE_NATS:g} or more (named): rounding "
               "stays under the second, a state that is not the request's does not.")]
    return "\n".join(lines) + "\n"


# prompt lengths the load table groups by: one token, below AutoCP's shortest split (2048), up to
# the engines' usual chunk (8192), longer
LENGTH_GROUPS = ((1, 1), (2, 2047), (2048, 8191), (8192, None))


def in_length_group(d: dict, lo: int, hi: int | None) -> bool:
    """Whether a per-request record's prompt length lies in the ``LENGTH_GROUPS`` entry (lo, hi)."""
    return "prompt_tokens" in d and lo <= d["prompt_tokens"] and (hi is None or d["prompt_tokens"] <= hi)


def length_span(lo: int, hi: int | None) -> str:
    """A ``LENGTH_GROUPS`` entry as the tables name it: ``1``, ``2-2047``, ``8192+``."""
    return f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi else f"{lo}+")


def by_prompt_length(rows: list[dict]) -> list[str]:
    """The load rows' agreement by prompt length, per backend (from ``per_request``, where the
    requests carry logprobs): how often the first token (the prefill's) differs from the oracle's,
    the mean tokens before divergence and the drift; none without such rows."""
    loads = [r for r in rows if r.get("scenario") == "load" and any(
        "prompt_tokens" in d for d in (r.get("per_request") or {}).values())]
    if not loads:
        return []
    lines = ["", ("Load by prompt length (per request: first token differs from the oracle's, tokens before the "
                  "first divergence, logprob drift over the shared tokens):"), "",
             ("| backend | prompt tokens | requests | first token differs | mean tokens before divergence | "
              "drift median / max |"), "|---|---|---|---|---|---|"]
    for r in loads:
        for lo, hi in LENGTH_GROUPS:
            group = [d for d in r["per_request"].values() if in_length_group(d, lo, hi)]
            if not group:
                continue
            drifts = sorted(d["drift"] for d in group)
            span = length_span(lo, hi)
            first = sum(d["agreeing"] == 0 for d in group)
            lines.append(f"| {r['backend']} | {span} | {len(group)} | {first} ({first / len(group):.0%}) | "
                         f"{sum(d['agreeing'] for d in group) / len(group):.1f} | "
                         f"{drifts[len(drifts) // 2]:.3f} / {drifts[-1]:.3f} |")
    return lines


def paired_with_default(rows: list[dict], draws: int = 2000, seed: int = 0) -> list[dict]:
    """Each of our backends against the default, request by request: per scenario (the load also by
    prompt length, ``LENGTH_GROUPS``), over the requests both answered, how much closer to its own
    oracle ours came than the default did to its own: tokens before the first divergence (ours
    minus the default's), or, in forced rows (every answer the oracle's), the logprob drift (the
    default's minus ours, nats). Mean with a bootstrap 95% interval (``draws`` resamples, seeded)
    and how many requests came closer on each side; positive is ours closer. The interval says
    whether "at least as close as the default" is told apart from the requests' own scatter."""
    rng = random.Random(seed)

    def key(r: dict) -> tuple[str, bool]:
        return r["scenario"], bool(r.get("forced"))

    default = {key(r): r["per_request"] for r in rows if r.get("backend") == "default" and r.get("per_request")}
    out = []
    for r in rows:
        theirs = default.get(key(r)) if r.get("backend") != "default" and r.get("per_request") else None
        if not theirs:
            continue
        forced = key(r)[1]
        groups = [(None, None)] + (list(LENGTH_GROUPS) if r["scenario"] == "load" else [])
        for lo, hi in groups:
            ids = [k for k, d in r["per_request"].items() if k in theirs and (lo is None or in_length_group(d, lo, hi))]
            if forced:
                ids = [k for k in ids if r["per_request"][k].get("drift") is not None and theirs[k].get("drift") is not None]
                diffs = [theirs[k]["drift"] - r["per_request"][k]["drift"] for k in ids]
            else:
                diffs = [r["per_request"][k]["agreeing"] - theirs[k]["agreeing"] for k in ids]
            if not ids:
                continue
            means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(draws))
            out.append({"backend": r["backend"], "scenario": key(r)[0] + (" (forced)" if forced else ""),
                        "prompt_tokens": "all" if lo is None else length_span(lo, hi),
                        "measure": "drift, nats" if forced else "tokens", "requests": len(ids),
                        "mean_diff": sum(diffs) / len(diffs),
                        "low": means[int(0.025 * draws)], "high": means[int(0.975 * draws) - 1],
                        "ours_closer": sum(x > 0 for x in diffs), "default_closer": sum(x < 0 for x in diffs)})
    return out


def paired_markdown(rows: list[dict]) -> list[str]:
    """:func:`paired_with_default` as a table (none without both backends' per-request rows)."""
    paired = paired_with_default(rows)
    if not paired:
        return []
    lines = ["", ("Request by request against the default (the same requests, each backend against its own "
                  "oracle): how much closer ours came, mean and bootstrap 95% interval, in tokens before the "
                  "first divergence (ours minus the default's) or, forced, in logprob drift (the default's minus "
                  "ours); an interval below 0 is ours farther beyond the requests' scatter."), "",
             "| backend | scenario | prompt tokens | requests | measure | ours closer by (95%) | closer: ours / default |",
             "|---|---|---|---|---|---|---|"]
    digits = {"tokens": 2, "drift, nats": 4}
    for a in paired:
        d = digits[a["measure"]]
        lines.append(f"| {a['backend']} | {a['scenario']} | {a['prompt_tokens']} | {a['requests']} | {a['measure']} | "
                     f"{a['mean_diff']:+.{d}f} ({a['low']:+.{d}f}..{a['high']:+.{d}f}) | "
                     f"{a['ours_closer']} / {a['default_closer']} |")
    return lines


def state_drifts(r: dict) -> list[str]:
    """The requests of a forced row that drifted ``STATE_NATS`` or more, most first."""
    far = [(d["drift"], k) for k, d in (r.get("per_request") or {}).items()
           if isinstance(d.get("drift"), (int, float)) and d["drift"] >= STATE_NATS]
    return [k for _, k in sorted(far, key=lambda t: (-t[0], t[1]))]


def logprob_cells(r: dict) -> str:
    """The two logprob columns of a row (— without logprobs)."""
    if r.get("logprob_drift_max") is None:
        return "— | —"
    over = ""
    if r.get("forced") and "logprob_drift_over_tie" in r:
        far = state_drifts(r)
        per = r.get("per_request") or {}

        def name(k: str) -> str:  # the request, with its prompt's length and where it drifted most
            d = per[k]
            where = [f"prompt {d['prompt_tokens']}"] if "prompt_tokens" in d else []
            where += [f"token {d['drift_at']}"] if d.get("drift_at") is not None else []
            return f"{k} ({', '.join(where)})" if where else k

        named = ", ".join(map(name, far[:6])) + (f" and {len(far) - 6} more" if len(far) > 6 else "")
        lengths = Counter(per[k]["prompt_tokens"] for k in far if "prompt_tokens" in per[k])
        if len(far) > 6 and lengths:  # what the requests named and unnamed have in common
            named += "; prompts of " + ", ".join(f"{n} token{'s' * (n != 1)}: {c}"
                                                  for n, c in sorted(lengths.items(), key=lambda t: -t[1])[:3])
        over = f" ({r['logprob_drift_over_tie']} at {TIE_NATS}+, {len(far)} at {STATE_NATS:g}+{': ' + named if far else ''})"
    return (f"{r['logprob_drift_median']:.3f} / {r['logprob_drift_max']:.3f}{over} | "
            f"{r['divergences_not_near_tie']} of {r['divergences']}")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m e2e_bench.stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=serve.ENGINES, required=True)
    p.add_argument("--model", default="qwen3-next-80b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    serve.add_allreduce_fusion_argument(p)
    p.add_argument("--backends", nargs="+", choices=serve.BACKENDS, default=["flashqla", "default"])
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--requests", type=int, default=2000, help="load: requests")
    p.add_argument("--rate", type=float, default=40.0, help="load: Poisson arrivals per second")
    p.add_argument("--max-prompt", type=int, default=65536)
    p.add_argument("--longest", type=int, default=131072, help="load: one prompt this long (0: none)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--aborts", type=int, default=16)
    p.add_argument("--suffixes", type=int, default=4)
    p.add_argument("--flood", type=int, default=8, help="prefix: unrelated long prompts sent to evict")
    p.add_argument("--spec-tokens", nargs="*", type=int, default=[1, 2, 4, 8])
    p.add_argument("--logprobs", type=int, default=0, metavar="K",
                   help="every compared request also returns its tokens' logprobs and its top K tokens: agreement "
                        "in probability (drift, near ties at divergences) beside the tokens'")
    p.add_argument("--forced", action="store_true",
                   help="vLLM: the stress server's compared requests are forced to their oracle's answers (a "
                        "logits processor of the plugin), so that their logprobs meet the oracle's on the same "
                        "context at every position, not only before a first divergence; needs --logprobs")
    p.add_argument("--spec-method", choices=SPEC_METHODS, default="mtp",
                   help="the speculative servers' proposer: the model's MTP layer, or vLLM's ngram lookup")
    p.add_argument("--spec-requests", type=int, default=64)
    p.add_argument("--spec-max-prompt", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--start-timeout", type=float, default=480)
    p.add_argument("--budget", type=float, default=0,
                   help=f"seconds for this call (0: none): no server starts with less than {SERVER_MIN_S:.0f} s "
                        "left, and the requests' timeouts end with it")
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--stress-server-arg", action="append", default=[],
                   help="the stress server's own arguments, after --server-arg and outside the oracle's key: a "
                        "KV pool small enough that the load preempts, beside an oracle made with a larger one "
                        "(the oracle answers each request alone, so its pool does not change its answers)")
    p.add_argument("--spec-server-arg", action="append", default=[],
                   help="the speculative servers' own arguments, after --server-arg and outside the oracle's key: "
                        "a KV pool large enough for the draft model's state beside the target's (as the stress "
                        "server's own pool, it does not change what the oracle answers)")
    p.add_argument("--load-send", choices=LOAD_SENDS, default=LOAD_SENDING["load_send"],
                   help="the stress server's load scenario: its requests at their Poisson arrival times, one "
                        "at a time, all at once, or each with a new 6000-token prompt sent just before it "
                        "(behind-prefill: with --stress-server-arg=--max-num-batched-tokens=2048 its row comes "
                        "after that prefill's continuation in vLLM's batch order) or just after it (outside the "
                        "oracle's key: the same requests, the same oracle, another batching; the companions "
                        "are not compared)")
    p.add_argument("--load-max-prompt", type=int, default=LOAD_SENDING["load_max_prompt"], metavar="N",
                   help="the stress server's load scenario sends only the requests whose prompts have at most "
                        "N tokens (0: all; outside the oracle's key)")
    serve.add_weights_argument(p)
    p.add_argument("--out-dir", default=str(serve.RESULTS_DIR))
    p.add_argument("--work-dir", default="")
    p.add_argument("--phase", choices=PHASES, default="all",
                   help="oracle: the oracle servers only (their tokens stay in the work dir for the next call); "
                        "stress / spec: the stress or the speculative servers only (after the oracle, reused "
                        "or run first); the results file holds every part measured in the work dir")
    p.add_argument("--oracle-shard", default="1/1", metavar="I/N",
                   help="oracle: answer every N-th of the oracle's requests from the I-th, on this run's server "
                        "(N runs side by side in one work directory make the oracle N times sooner; the last "
                        "to finish merges the shards)")
    p.add_argument("--wait-oracle", type=float, default=0, metavar="S",
                   help="stress / spec: the oracle's tokens come from a run beside this one in the same work "
                        "directory (scripts/gpu_session.sh stress-split): start at once, and wait up to S seconds "
                        "(and the budget) for them before comparing")
    p.add_argument("--oracles-from", metavar="DIR",
                   help="oracles made on another machine (a folder of oracle-<backend>.json): each copied into the "
                        "work directory where it holds none of that name (an oracle made for other requests or "
                        "servers is keyed so and not used)")
    p.add_argument("--oracle-as", action="append", default=[], metavar="FROM:TO",
                   help="backend TO's oracle is FROM's, where the work directory holds none for TO: backends that "
                        "answer a request alone alike (flashqla-cp-per-sequence:flashqla: one sequence alone gets "
                        "the same plan either way)")
    p.add_argument("--collect", action="store_true",
                   help="start nothing: write the results of every part the work directory holds for this plan")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    for name in ("requests", "aborts", "suffixes", "max_prompt", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.load_max_prompt < 0:
        p.error(f"--load-max-prompt {args.load_max_prompt}: must be >= 0 (0: every request)")
    if args.rate <= 0:
        p.error(f"--rate {args.rate}: must be > 0")
    if any(k < 1 or k > 8 for k in args.spec_tokens):
        p.error(f"--spec-tokens {args.spec_tokens}: each must be in 1..8")
    if "flashqla-fault" in args.backends and args.engine != "vllm":
        p.error("flashqla-fault: the fault is installed by vLLM's qla_dummy load format only")
    if args.forced and (args.engine != "vllm" or args.logprobs < 1):
        p.error("--forced: vLLM only (its logits processors), with --logprobs K (the comparison it is for)")
    if args.spec_method == "ngram" and args.engine != "vllm":
        p.error("--spec-method ngram: vLLM's proposer only (SGLang's speculative servers run NEXTN)")
    i, _, n = args.oracle_shard.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        p.error(f"--oracle-shard {args.oracle_shard}: must be I/N with 1 <= I <= N")
    args.oracle_shard = (int(i), int(n))
    if args.oracle_shard != (1, 1) and args.phase != "oracle":
        p.error(f"--oracle-shard {i}/{n}: only with --phase oracle (a stress or spec run reads the merged oracle)")
    for alias in args.oracle_as:
        src, _, dst = alias.partition(":")
        if not src or not dst or ":" in dst or src == dst:
            p.error(f"--oracle-as {alias}: must be FROM:TO, two backends' names")
    args.argv = list(argv)
    return args


def max_model_len(args, plan: dict) -> int:
    """The servers' context: the longest request of any scenario with its tokens, and some slack."""
    need = [len(r["prompt"]) + r["max_tokens"] for reqs in plan.values() for r in reqs]
    return max([max(args.max_prompt, args.longest) + args.max_tokens, *need]) + 64


def carry_oracles(work: pathlib.Path, source: str | None, aliases: list[str]) -> None:
    """``--oracles-from`` and ``--oracle-as``: oracle files into ``work`` where it has none of that
    name (never over one made here), each written whole (slots side by side start together)."""
    if source:
        found = sorted(pathlib.Path(source).glob("oracle-*.json"))
        if not found:
            raise SystemExit(f"--oracles-from {source}: no oracle-<backend>.json there")
        for path in found:
            if not (work / path.name).exists():
                serve.write_whole(work / path.name, path.read_text())
                serve.log(f"oracle: {path.name} carried from {source}")
    for alias in aliases:
        src, dst = (work / f"oracle-{b}.json" for b in alias.split(":", 1))
        if src.exists() and not dst.exists():
            serve.write_whole(dst, src.read_text())
            serve.log(f"oracle: {dst.name} is {src.name} (--oracle-as {alias})")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.server_arg = args.server_arg + serve.allreduce_fusion_args(args.engine, args.tp, args.allreduce_fusion)
    spec = serve.model_spec(args.model)
    plan = plan_requests(args)
    max_len = max_model_len(args, plan)
    work = pathlib.Path(args.work_dir or f"/tmp/qla-stress-{args.engine}-{args.model}-tp{args.tp}")
    work.mkdir(parents=True, exist_ok=True)
    if not args.dry_run:
        carry_oracles(work, args.oracles_from, args.oracle_as)
    s = serve.Setup(args.engine, tp=args.tp, max_len=max_len, port=args.port,
                    **serve.engine_model(spec, args.engine, args.layers, max_len, work / "model"))
    backends = list(dict.fromkeys(args.backends))
    if args.dry_run:
        for name, reqs in plan.items():
            lens = [len(r["prompt"]) for r in reqs]
            serve.log(f"{name}: {len(reqs)} requests, prompts {min(lens)}..{max(lens)} tokens")
        beside = args.wait_oracle and args.phase in ("stress", "spec")  # the oracle is another run's
        if beside:
            serve.log(f"oracle: made by the run beside this one (--wait-oracle {args.wait_oracle:g})")
        for b in backends:
            for tag, cmd in server_commands(s, b, args, spec["model_type"]).items():
                if (tag == "oracle" and not beside) or args.phase in ("all", tag.rstrip("0123456789")):
                    print(f"# {b} {tag}\n{shlex.join(cmd)}")
        return 0
    key, okey = run_key(args, plan), oracle_key(args, plan)
    budget = Budget(args.budget)
    problems = []
    for backend in [] if args.collect else backends:
        problems += run_backend(s, backend, args, plan, work, spec["model_type"], key, budget, okey)
    if args.phase == "oracle" and not args.collect:
        return 1 if problems else 0
    # every part measured into this work directory for this plan, this call's and earlier calls'
    parts = load_parts(work, key, [b for b in serve.BACKENDS if b in backends] +
                       [b for b in serve.BACKENDS if b not in backends], okey, spec_key(args, key))
    if args.collect and not parts:
        serve.log(f"--collect: {work} holds no part measured for this plan")
        return 1
    # a server left out for the budget here may have been measured by an earlier call
    measured = {(p["backend"], p["part"]) for p in parts}
    rows = [r for p in parts for r in p["rows"]] + [r for r in problems if (r["backend"], r["scenario"]) not in measured]
    gpu = serve.gpu_name()
    infos: dict[str, dict] = {}
    for p in parts:
        i = infos.setdefault(p["backend"], {"resolved": p["info"].get("resolved"), "fallback": False,
                                            "server_commands": {}})
        i["fallback"] = i["fallback"] or bool(p["info"].get("fallback"))
        i["server_commands"][p["part"]] = p["info"].get("command")
    meta = {"gpu": gpu, "engine": args.engine, "tp": args.tp, "versions": serve.versions(args.engine),
            "model": f"{spec['name']}, {args.layers} layers, {args.weights} weights, GDN gates re-drawn",
            "command": shlex.join(["python", "-m", "e2e_bench.stress", *argv]),
            "calls": list(dict.fromkeys(p["info"].get("call") for p in parts if p["info"].get("call"))),
            "backends": infos, "max_model_len": max_len}
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{serve.results_stem(gpu, args.engine, args.tp).replace('-serve-', '-stress-')}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(meta, rows))
    serve.log(f"wrote {out / stem}.json")
    # a part still waiting for its oracle belongs to a run beside this one, which compares it and
    # answers for it; only --collect (the record) fails on it
    return 1 if any(row_failed(r) for r in rows if args.collect or not r.get("pending")) else 0


def row_failed(row: dict) -> bool:
    """A row that fails the run: an error, a part still waiting for its oracle, a crash, a request
    that failed other than with a 4xx (a 5xx, no answer, or ended by the server), or a bad request
    answered with a 5xx (or not at all) or after which the server stopped serving."""
    if row.get("error") or row.get("pending") or row.get("crashed") or row.get("failed_other"):
        return True
    return row.get("scenario") == "bad" and not row["no_5xx"] == row["served_after"] == row["sent"]


if __name__ == "__main__":
    serve.exit_on_sigterm()
    sys.exit(main())
