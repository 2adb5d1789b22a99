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

* a **speculative** server per ``--spec-tokens`` value (vLLM ``qwen3_next_mtp`` / ``mtp``):
  greedy speculative decoding is lossless, so its tokens must equal the oracle's.

Every request's greedy tokens are compared with the oracle's: tokens before the first
divergence, and how many requests diverge within their first 16 tokens (bf16 numerics under
other batch shapes may diverge late; a state bug diverges early or produces garbage). The engine's
``/metrics`` give preemptions and prefix-cache hits. Results::

    e2e_bench/results/<date>-<gpu>-stress-<engine>[-tp<N>].json / .md

    python -m e2e_bench.stress --engine vllm --model qwen3-next-80b-a3b --layers 8 --out-dir "$OUT"
    python -m e2e_bench.stress ... --dry-run     # the plan: requests per scenario, server commands
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pathlib
import random
import re
import shlex
import sys
import time

from . import serve
from .vllm_offline import agreeing_prefix

SCENARIOS = ("bad", "abort", "load", "prefix")
EARLY = 16  # a divergence within a request's first EARLY tokens counts as early
BLOCK_UNALIGNED_PREFIXES = (97, 1000, 1537, 4099, 12345)


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
            reqs.append({"id": f"abort-{i}", "prompt": ids(rng, 4096 if when == "prefill" else 512),
                         "max_tokens": 256, "abort": when})
        reqs += [{"id": f"after-abort-{i}", "prompt": ids(rng, 300 + 37 * i), "max_tokens": args.max_tokens}
                 for i in range(args.aborts)]
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


def bad_requests(max_len: int) -> list[tuple[str, bytes]]:
    """(name, raw JSON body) of each malformed request, for ``/v1/completions``."""
    def body(**kw):
        return json.dumps({"model": "bench", "temperature": 0, **kw}).encode()

    return [
        ("empty prompt", body(prompt=[], max_tokens=8)),
        ("prompt over max_model_len", body(prompt=[5] * (max_len + 16), max_tokens=8)),
        ("max_tokens 0", body(prompt=[5, 6, 7], max_tokens=0)),
        ("max_tokens huge", body(prompt=[5, 6, 7], max_tokens=10**9)),
        ("malformed JSON", b'{"model": "bench", "prompt": [1, 2,'),
        ("not UTF-8", b'{"model": "bench", "prompt": "\xff\xfe\xfa", "max_tokens": 4}'),
    ]


# ----------------------------------------------------------------------------- HTTP


async def http(port: int, method: str, path: str, body: bytes = b"", timeout: float = 600,
               abort_after: str | None = None) -> tuple[int, bytes]:
    """One HTTP/1.1 request on its own connection; ``abort_after`` "prefill" closes it right after
    sending, "decode" after the first streamed chunk (the client's disconnect). Returns (status, body);
    status 0 for an aborted request, -1 for a connection error."""
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
            await asyncio.sleep(0.05)
            return 0, b""
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        if abort_after == "decode":
            await asyncio.wait_for(reader.readuntil(b"data:"), timeout)
            return 0, b""
        data = await asyncio.wait_for(reader.read(), timeout)
        status = int(status_line.split()[1]) if status_line.startswith(b"HTTP/") else -1
        payload = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else data
        if b"transfer-encoding: chunked" in data.split(b"\r\n\r\n", 1)[0].lower():
            payload = dechunk(payload)
        return status, payload
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
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


def completion_body(engine: str, req: dict, stream: bool = False) -> tuple[str, bytes]:
    if engine == "vllm":
        return "/v1/completions", json.dumps({
            "model": "bench", "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}).encode()
    return "/generate", json.dumps({"input_ids": req["prompt"], "stream": stream, "sampling_params": {
        "max_new_tokens": req["max_tokens"], "temperature": 0, "ignore_eos": True}}).encode()


def output_tokens(engine: str, payload: bytes) -> list[int] | None:
    try:
        data = json.loads(payload)
        return list(data["choices"][0]["token_ids"]) if engine == "vllm" else list(data["output_ids"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def run_requests(engine: str, port: int, reqs: list[dict], concurrent: bool) -> dict[str, dict]:
    """Send ``reqs`` (at their ``at`` times when concurrent, else one after another)."""
    results: dict[str, dict] = {}

    async def one(req):
        if concurrent and req.get("at"):
            await asyncio.sleep(req["at"])
        path, body = completion_body(engine, req, stream=bool(req.get("abort")))
        status, payload = await http(port, "POST", path, body, abort_after=req.get("abort"))
        results[req["id"]] = {"status": status, "tokens": output_tokens(engine, payload) if status == 200 else None}

    if concurrent:
        await asyncio.gather(*(one(r) for r in reqs))
    else:
        for r in reqs:
            await one(r)
    return results


async def run_bad(engine: str, port: int, max_len: int) -> list[dict]:
    """Each bad request, then ``/health`` and one good request: the server must keep serving."""
    out = []
    good = {"id": "good", "prompt": [11, 12, 13], "max_tokens": 4}
    for name, body in bad_requests(max_len):
        path = "/v1/completions" if engine == "vllm" else "/generate"
        status, payload = await http(port, "POST", path, body, timeout=120)
        health, _ = await http(port, "GET", "/health", timeout=60)
        gpath, gbody = completion_body(engine, good)
        gstatus, _ = await http(port, "POST", gpath, gbody, timeout=120)
        out.append({"request": name, "status": status, "detail": payload[:200].decode(errors="replace"),
                    "healthy_after": health == 200, "serves_after": gstatus == 200})
    return out


METRICS = {"preemptions": "vllm:num_preemptions", "prefix_cache_hits": "vllm:prefix_cache_hits",
           "prefix_cache_queries": "vllm:prefix_cache_queries", "requests_ok": "vllm:request_success"}


def parse_metrics(text: str) -> dict[str, float]:
    """Sums of the engine's Prometheus counters we report (all label sets)."""
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:]+?)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", line.strip())
        if not m:
            continue
        for key, name in METRICS.items():
            if m.group(1) == name:
                out[key] += float(m.group(2))
    return out


# ----------------------------------------------------------------------------- comparison


def compare(oracle: dict[str, dict], got: dict[str, dict], ids_: list[str]) -> dict:
    """Agreement of ``got`` with ``oracle`` over the request ids both completed."""
    before, early, compared = [], 0, 0
    for rid in ids_:
        o, g = (oracle.get(rid) or {}).get("tokens"), (got.get(rid) or {}).get("tokens")
        if not o or g is None:
            continue
        compared += 1
        n = agreeing_prefix(o, g)
        before.append(n)
        if n < min(EARLY, len(o)):
            early += 1
    return {"compared": compared, "mean_tokens_before_divergence": (sum(before) / len(before)) if before else None,
            "diverged_within_16": early}


def summarize(engine: str, plan: dict, oracle: dict, got: dict, scenario: str) -> dict:
    reqs = plan[scenario]
    st = [got.get(r["id"], {}).get("status") for r in reqs if not r.get("abort")]
    row = {"scenario": scenario, "sent": len(reqs), "completed": sum(s == 200 for s in st),
           "aborted": sum(1 for r in reqs if r.get("abort")),
           "failed_clean": sum(1 for s in st if s is not None and 400 <= s < 500),
           "failed_other": sum(1 for s in st if s is None or s < 0 or s >= 500)}
    row.update(compare(oracle, got, [r["id"] for r in reqs if not r.get("abort")]))
    return row


# ----------------------------------------------------------------------------- the run


def cache_args(engine: str) -> list[str]:
    """The stress server's prefix cache: vLLM 0.26 leaves it off for hybrid GDN models (its "align"
    mode must be asked for); SGLang's radix cache is on, with the mamba strategy the issue names."""
    if engine == "vllm":
        return ["--enable-prefix-caching"]
    return ["--mamba-scheduler-strategy", "extra_buffer"]


def spec_args(engine: str, model_type: str, k: int) -> list[str]:
    if engine == "vllm":
        method = "qwen3_next_mtp" if model_type == "qwen3_next" else "mtp"
        return ["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": k})]
    return ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(k),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1)]


def plan_key(plan: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def run_backend(s: serve.Setup, backend: str, args, plan: dict, work: pathlib.Path, model_type: str) -> list[dict]:
    env = serve.backend_env(backend, s.tp)
    rows = []
    everything = [r for reqs in plan.values() for r in reqs if not r.get("abort")]

    def server(tag, extra):
        cmd = serve.server_command(s, backend, args.server_arg + extra)
        serve.log(f"start {backend} {tag}: {shlex.join(cmd)}")
        return serve.Server(cmd, env, work / f"server-{backend}-{tag}.log", s.port)

    # the oracle: each request alone on a fresh server (kept in the work directory, so a run can be
    # split into an oracle call and a stress call)
    oracle_file = work / f"oracle-{backend}.json"
    key = plan_key(plan)
    saved = json.loads(oracle_file.read_text()) if oracle_file.is_file() else {}
    if saved.get("key") == key:
        oracle = saved["results"]
        serve.log(f"oracle {backend}: reusing {oracle_file}")
    else:
        srv = server("oracle", [])
        try:
            if not srv.start(args.start_timeout):
                serve.log(f"FAILED oracle start {backend}:\n{serve.tail(srv.log_path)}")
                return [{"backend": backend, "scenario": "oracle", "error": "server did not start"}]
            oracle = asyncio.run(run_requests(s.engine, s.port, everything, concurrent=False))
            oracle_file.write_text(json.dumps({"key": key, "results": oracle}))
            serve.log(f"oracle {backend}: {sum(v['status'] == 200 for v in oracle.values())} of {len(everything)}")
        finally:
            srv.stop()
    if args.phase == "oracle":
        return []

    srv = server("stress", cache_args(s.engine) if "prefix" in args.scenarios else [])
    try:
        if not srv.start(args.start_timeout):
            return [{"backend": backend, "scenario": "stress", "error": "server did not start"}]
        for scenario in args.scenarios:
            t0 = time.monotonic()
            if scenario == "bad":
                bad = asyncio.run(run_bad(s.engine, s.port, s.max_len))
                rows.append({"backend": backend, "scenario": "bad", "sent": len(bad),
                             "no_5xx": sum(0 < b["status"] < 500 for b in bad),
                             "served_after": sum(b["healthy_after"] and b["serves_after"] for b in bad),
                             "requests": bad, "crashed": not srv.alive()})
            else:
                concurrent = scenario != "prefix"
                got = asyncio.run(run_requests(s.engine, s.port, plan[scenario], concurrent))
                if scenario == "prefix":  # again, after unrelated long prompts push the cache out
                    flood = [{"id": f"flood-{i}", "prompt": ids(random.Random(i), args.max_prompt),
                              "max_tokens": 1} for i in range(args.flood)]
                    asyncio.run(run_requests(s.engine, s.port, flood, concurrent=True))
                    again = asyncio.run(run_requests(s.engine, s.port, plan[scenario], concurrent=True))
                    row2 = summarize(s.engine, plan, oracle, again, scenario)
                    row2.update(backend=backend, scenario="prefix-after-eviction", crashed=not srv.alive())
                row = summarize(s.engine, plan, oracle, got, scenario)
                row.update(backend=backend, crashed=not srv.alive())
                rows.append(row)
                if scenario == "prefix":
                    rows.append(row2)
            rows[-1]["seconds"] = round(time.monotonic() - t0, 1)
            serve.log(f"{backend} {scenario}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'requests'})}")
            if not srv.alive():
                serve.log(f"server {backend} died in {scenario}:\n{serve.tail(srv.log_path)}")
                break
        status, text = asyncio.run(http(s.port, "GET", "/metrics", timeout=60))
        metrics = parse_metrics(text.decode(errors="replace")) if status == 200 else {}
        for r in rows:
            r["server_metrics"] = metrics
    finally:
        srv.stop()

    for k in args.spec_tokens:
        srv = server(f"spec{k}", spec_args(s.engine, model_type, k))
        try:
            if not srv.start(args.start_timeout):
                rows.append({"backend": backend, "scenario": f"spec-{k}", "error": "server did not start",
                             "log_tail": serve.tail(srv.log_path, 20)})
                continue
            # mixed batches: requests with and without drafts come from one concurrent stream
            reqs = [r for r in everything if len(r["prompt"]) <= args.spec_max_prompt][: args.spec_requests]
            got = asyncio.run(run_requests(s.engine, s.port, [{**r, "at": 0.02 * i} for i, r in enumerate(reqs)],
                                           concurrent=True))
            row = summarize(s.engine, {"spec": reqs}, oracle, got, "spec")
            row.update(backend=backend, scenario=f"spec-{k}", crashed=not srv.alive())
            rows.append(row)
            serve.log(f"{backend} spec-{k}: {json.dumps(row)}")
        finally:
            srv.stop()
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Stress: {meta['engine']} TP {meta['tp']} on {meta['gpu']}", "", f"Model: {meta['model']}", "",
             f"Command: `{meta['command']}`", "",
             "| backend | scenario | sent | completed | aborted | failed 4xx | failed other | crashed | compared | "
             "mean tokens before divergence | diverged within 16 | preemptions | prefix hits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.get("server_metrics") or {}
        if r["scenario"] == "bad":
            lines.append(f"| {r['backend']} | bad | {r['sent']} | {r['no_5xx']} without 5xx | | | | {r['crashed']} | "
                         f"served after each: {r['served_after']} | | | | |")
            continue
        if r.get("error"):
            lines.append(f"| {r['backend']} | {r['scenario']} | failed: {r['error']} | | | | | | | | | | |")
            continue
        mean = r.get("mean_tokens_before_divergence")
        lines.append(f"| {r['backend']} | {r['scenario']} | {r['sent']} | {r['completed']} | {r['aborted']} | "
                     f"{r['failed_clean']} | {r['failed_other']} | {r['crashed']} | {r['compared']} | "
                     f"{'—' if mean is None else f'{mean:.1f}'} | {r['diverged_within_16']} | "
                     f"{m.get('preemptions', '—')} | {m.get('prefix_cache_hits', '—')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m e2e_bench.stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=serve.ENGINES, required=True)
    p.add_argument("--model", default="qwen3-next-80b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--backends", nargs="+", choices=("flashqla", "default", "flashinfer", "triton"),
                   default=["flashqla", "default"])
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
    p.add_argument("--spec-requests", type=int, default=64)
    p.add_argument("--spec-max-prompt", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--start-timeout", type=float, default=480)
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--out-dir", default=str(serve.RESULTS_DIR))
    p.add_argument("--work-dir", default="")
    p.add_argument("--phase", choices=("all", "oracle"), default="all",
                   help="oracle: run only the oracle servers (their tokens stay in the work dir for the next call)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    for name in ("requests", "aborts", "suffixes", "max_prompt", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.rate <= 0:
        p.error(f"--rate {args.rate}: must be > 0")
    if any(k < 1 or k > 8 for k in args.spec_tokens):
        p.error(f"--spec-tokens {args.spec_tokens}: each must be in 1..8")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    spec = serve.model_spec(args.model)
    longest_prompt = max(args.max_prompt, args.longest)
    max_len = longest_prompt + args.max_tokens + 64
    work = pathlib.Path(args.work_dir or f"/tmp/qla-stress-{args.engine}-{args.model}-tp{args.tp}")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = serve.write_model(spec, args.layers, max_len, work / "model")
    s = serve.Setup(args.engine, model_dir, args.tp, max_len, args.port,
                    multimodal=spec["architecture"].endswith("ForConditionalGeneration"))
    plan = plan_requests(args)
    if args.dry_run:
        for name, reqs in plan.items():
            lens = [len(r["prompt"]) for r in reqs]
            serve.log(f"{name}: {len(reqs)} requests, prompts {min(lens)}..{max(lens)} tokens")
        for b in args.backends:
            print(shlex.join(serve.server_command(s, b, args.server_arg)))
            for k in args.spec_tokens:
                print(shlex.join(serve.server_command(s, b, args.server_arg + spec_args(args.engine, spec["model_type"], k))))
        return 0
    rows = []
    for backend in args.backends:
        rows += run_backend(s, backend, args, plan, work, spec["model_type"])
    if args.phase == "oracle":
        return 0
    gpu = serve.gpu_name()
    meta = {"gpu": gpu, "engine": args.engine, "tp": args.tp, "versions": serve.versions(args.engine),
            "model": f"{spec['name']}, {args.layers} layers, dummy weights, GDN gates re-drawn",
            "command": shlex.join(["python", "-m", "e2e_bench.stress", *argv])}
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{serve.results_stem(gpu, args.engine, args.tp).replace('-serve-', '-stress-')}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(meta, rows))
    serve.log(f"wrote {out / stem}.json")
    bad = [r for r in rows if r.get("error") or r.get("crashed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
