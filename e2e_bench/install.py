"""The install proof: an engine with the TileLang it pins serves ``flashqla`` from the precompiled
kernel library, compiling nothing, and starts as fast as with its default backend.

For each backend and run (``cold``: TileLang's, Triton's, FlashInfer's and vLLM's compile caches
emptied first; ``warm``: a restart with what the cold run left), one real server (``vllm serve`` or
``python -m sglang.launch_server``) of the serving benchmark's model (``e2e_bench.serve``: same command line, dummy weights, ``flashqla``
under ``QLA_STRICT=1``) is timed from spawn to ``/health``, then one long request (greedy, token
ids in) is sent twice: the first on the fresh engine, the second on the warm one. Kernel compiles
are counted from the server's log: qla-serving's warm-up line (kernels from the library, kernels
compiled with TileLang) and TileLang's own compile lines.

    python -m e2e_bench.install --engine vllm --backends flashqla default --runs cold warm --out-dir DIR

Rows of separate calls add up in ``--work-dir`` (one or two servers per 10-minute call);
``e2e_bench/results/<date>-<gpu>-install.{json,md}`` is written from all rows there, and from the
rows of earlier results files named with ``--merge`` (another engine's, from another machine).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pathlib
import random
import re
import shutil
import sys
import time
from collections import Counter

from . import serve

CACHES = ("~/.cache/vllm/torch_compile_cache", "~/.triton/cache", "~/.cache/flashinfer", "~/.cache/tvm-ffi")
LIBRARY_LINE = re.compile(r"warm-up steps done in [\d.]+ s: (\d+) kernels from precompiled libraries, (\d+) compiled with TileLang")
TILELANG_COMPILE_LINE = re.compile(r"TileLang begins to compile kernel")
# The servers' first timestamped log line: vLLM "INFO 11-26 21:59:23 [...]", SGLang "[2026-11-26 19:14:41] ..."
VLLM_STAMP = re.compile(r"(?:INFO|WARNING|ERROR|DEBUG) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[")
SGLANG_STAMP = re.compile(r"^\[(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\]", re.M)
# vLLM's own engine initialisation (profiling run, KV cache, CUDA graphs)
VLLM_ENGINE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def empty_caches(tilelang_cache: pathlib.Path) -> list[str]:
    """Remove the compile caches a cold start must not find; returns what was there."""
    removed = []
    for path in [tilelang_cache, *(pathlib.Path(os.path.expanduser(p)) for p in CACHES)]:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def count_compiles(log_text: str) -> dict:
    library = compiled = 0
    for m in LIBRARY_LINE.finditer(log_text):
        library += int(m.group(1))
        compiled += int(m.group(2))
    return {"library_kernels": library, "qla_tilelang_compiles": compiled,
            "tilelang_compile_lines": len(TILELANG_COMPILE_LINE.findall(log_text))}


def startup_parts(log_text: str, launched: float) -> dict:
    """Where a start-up went, from the server's log: ``first_log_s``, seconds from the launch
    (``launched``, wall-clock epoch) to the first timestamped line (process start, imports and the
    plugins' registration; the stamps have whole seconds), and ``engine_init_s``, vLLM's own
    engine initialisation (None for SGLang, which logs no such total)."""
    start = _dt.datetime.fromtimestamp(launched)
    stamps = []
    m = VLLM_STAMP.search(log_text)
    if m:  # vLLM's stamps have no year: the launch's
        stamps.append((m.start(), _dt.datetime(start.year, *map(int, m.groups()))))
    m = SGLANG_STAMP.search(log_text)
    if m:
        stamps.append((m.start(), _dt.datetime(*map(int, m.groups()))))
    first = min(stamps)[1] if stamps else None
    init = VLLM_ENGINE_INIT.search(log_text)
    return {"first_log_s": None if first is None else round(max((first - start).total_seconds(), 0.0), 1),
            "engine_init_s": float(init.group(1)) if init else None}


def timed_request(s: serve.Setup, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = serve.greedy_tokens(s, [prompt], max_tokens)
    return time.perf_counter() - t0, out[0]


def triton_kernels(root: pathlib.Path | None = None) -> Counter:
    """Kernels in Triton's compile cache (``TRITON_CACHE_DIR``, else ``~/.triton/cache``), by name:
    each compiled kernel leaves ``<hash>/<name>.json`` there (``__grp__<name>.json`` indexes a
    group). What a request adds to it is what that request compiled."""
    if root is None:
        root = pathlib.Path(os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache"))
    if not root.is_dir():
        return Counter()
    return Counter(f.stem for f in root.glob("*/*.json") if not f.name.startswith("__grp__"))


def compiled_between(before: Counter, after: Counter) -> dict[str, int]:
    """The kernels ``after`` holds beyond ``before``: name -> how many new compilations."""
    return {name: n for name, n in sorted((after - before).items())}


def run_one(s: serve.Setup, backend: str, run: str, work: pathlib.Path, prompt: list[int], max_tokens: int,
            timeout: float) -> dict:
    tilelang_cache = work / "tilelang-cache"
    env = serve.backend_env(backend, engine=s.engine)
    env["TILELANG_CACHE_DIR"] = str(tilelang_cache)
    removed = empty_caches(tilelang_cache) if run == "cold" else []
    log_path = work / f"server-{s.engine}-{backend}-{run}.log"
    server = serve.Server(serve.server_command(s, backend), env, log_path, s.port)
    serve.log(f"start {backend} ({run}): {' '.join(server.cmd)}")
    row = {"backend": backend, "run": run, "caches_emptied": removed}
    try:
        launched = time.time()
        ok = server.start(timeout)
        row["startup_s"] = round(time.monotonic() - server.started, 1)
        row.update(startup_parts(server.log_text(), launched))
        if not ok:
            row["error"] = serve.start_failure(log_path)
            serve.log(f"FAILED start {backend} ({run}: {row['error']}); log tail:\n{serve.tail(log_path)}")
            return row
        # what each request compiles (the cache grows while a kernel is built: an engine's own Triton
        # JIT in the first request is the usual gap between a cold and a warm first request)
        started = triton_kernels()
        first_s, first = timed_request(s, prompt, max_tokens)
        after_first = triton_kernels()
        second_s, second = timed_request(s, prompt, max_tokens)
        row.update(first_request_s=round(first_s, 3), warm_request_s=round(second_s, 3),
                   first_over_warm=round(first_s / second_s, 3), same_tokens=first == second,
                   first_request_triton_compiles=compiled_between(started, after_first),
                   warm_request_triton_compiles=compiled_between(after_first, triton_kernels()))
        text = server.log_text()
        row.update(count_compiles(text))
        if backend == "default":
            row["resolved"] = serve.resolve_default(s.engine, text)
        serve.log(f"{backend} ({run}): start {row['startup_s']} s, first request {first_s:.2f} s, "
                  f"warm {second_s:.2f} s, {row['library_kernels']} library kernels, "
                  f"{row['qla_tilelang_compiles']} qla TileLang compiles, {row['tilelang_compile_lines']} TileLang compile lines")
    finally:
        server.stop()
    return row


def library_info() -> dict:
    try:
        from qla_serving.kernels import library
    except ImportError as e:
        return {"error": str(e)}
    libs = library.libraries()
    return {"search_path": [str(p) for p in library.search_path()],
            "libraries": [{"path": str(lib.path), "kernels": len(lib.manifest["kernels"]),
                           "size_mib": round((lib.path / lib.manifest["library"]).stat().st_size / 2**20, 1),
                           "built_with": lib.manifest.get("built_with")} for lib in libs]}


def engine_meta(meta: dict) -> dict:
    """{engine: {"versions", "command", "notes"}} of a results file's meta (one engine per file
    before the SGLang rows joined: "engine", "versions", "command", "notes" at the top)."""
    if "engines" in meta:
        return meta["engines"]
    return {meta["engine"]: {k: meta[k] for k in ("versions", "command", "notes") if k in meta}}


def merge(meta: dict, rows: list[dict], earlier: list[dict]) -> tuple[dict, list[dict]]:
    """This run's meta and rows joined with earlier results files' (their engines' rows replaced
    by this run's where both have the engine)."""
    engines, all_rows = {}, []
    for old in earlier:
        for engine, em in engine_meta(old["meta"]).items():
            engines[engine] = em
            all_rows += [dict(r, engine=r.get("engine", engine)) for r in old["rows"]
                         if r.get("engine", engine) == engine]
        meta.setdefault("pip_check", old["meta"].get("pip_check", []))
    for engine in engine_meta(meta):
        all_rows = [r for r in all_rows if r["engine"] != engine]
    engines.update(engine_meta(meta))
    all_rows += rows
    all_rows.sort(key=lambda r: (r["engine"] != "vllm", r["engine"], r["backend"] != "flashqla", r["backend"],
                                 r["run"] != "cold"))
    out = {k: v for k, v in meta.items() if k not in ("engine", "versions", "command", "notes")}
    out["engines"] = engines
    return out, all_rows


def markdown(meta: dict, rows: list[dict]) -> str:
    engines = engine_meta(meta)
    names = ", ".join(f"{e} {m['versions'].get(e)}" for e, m in engines.items())
    lines = [f"# Install proof: {names} serving "
             f"from the wheel's kernel library, on {meta['gpu']}", "",
             f"- kernel library: {json.dumps(meta['library'])}",
             f"- model: {meta['model']} ({meta['layers']} layers), request: {meta['prompt_len']} prompt tokens, "
             f"{meta['max_tokens']} out"]
    for engine, m in engines.items():
        v = m["versions"]
        lines.append(f"- {engine}: versions (as the server imports them, TileLang {v.get('tilelang')}): "
                     f"{', '.join(f'{k} {x}' for k, x in v.items())}; command: `{m['command']}`")
        lines += [f"- {engine}: {n}" for n in m.get("notes", [])]
    lines += [f"- `pip check` on the CPU, fresh venv with {c['install']}: {c['result']} ({c['versions']})"
              for c in meta.get("pip_check", [])]
    lines += ["", "| engine | backend | run | start-up s | first log line s | engine init s | first request s | "
              "same request, warm s | first / warm | library kernels | qla TileLang compiles | TileLang compile lines |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["backend"] + (f" ({r['resolved']})" if r.get("resolved") else "")
        lines.append(f"| {r.get('engine', next(iter(engines)))} | {name} | {r['run']} | {r.get('startup_s')} | "
                     f"{r.get('first_log_s', '-')} | {r.get('engine_init_s', '-')} | "
                     f"{r.get('first_request_s', r.get('error'))} | {r.get('warm_request_s')} | "
                     f"{r.get('first_over_warm')} | {r.get('library_kernels')} | "
                     f"{r.get('qla_tilelang_compiles')} | {r.get('tilelang_compile_lines')} |")
    jit = [(r, r["first_request_triton_compiles"]) for r in rows if r.get("first_request_triton_compiles")]
    if jit:
        lines += ["", "Triton kernels compiled during the first request (Triton's cache before and after it; "
                      "name x compilations):", ""]
        lines += [f"- {r.get('engine', next(iter(engines)))} {r['backend']} ({r['run']}): "
                  + ", ".join(f"{k} x{n}" for k, n in compiled.items()) for r, compiled in jit]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=list(serve.ENGINES), default="vllm")
    p.add_argument("--model", default="qwen3-next-80b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--backends", nargs="+", default=["flashqla", "default"])
    p.add_argument("--runs", nargs="+", choices=["cold", "warm"], default=["cold", "warm"])
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--start-timeout", type=float, default=420)
    p.add_argument("--work-dir", default="/tmp/qla-install")
    p.add_argument("--out-dir", default="e2e_bench/results")
    p.add_argument("--merge", nargs="*", default=[], metavar="FILE.json",
                   help="earlier results files whose other engines' rows join this one")
    p.add_argument("--note", action="append", default=[], help="a line about this engine's run (repeatable)")
    args = p.parse_args(argv)
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    max_len = args.prompt_len + 2 * args.max_tokens + 64
    model_dir = work / f"model-{args.engine}"
    s = serve.Setup(engine=args.engine, tp=1, max_len=max_len,
                    **serve.engine_model(serve.model_spec(args.model), args.engine, args.layers, max_len, model_dir))
    prompt = [random.Random(0).randrange(10, serve.TOKENIZER_WORDS - 10) for _ in range(args.prompt_len)]
    for backend in args.backends:
        for run in args.runs:
            row = dict(run_one(s, backend, run, work, prompt, args.max_tokens, args.start_timeout), engine=args.engine)
            (work / f"row-{args.engine}-{backend}-{run}.json").write_text(json.dumps(row))
    rows = [json.loads(f.read_text()) for f in sorted(work.glob(f"row-{args.engine}-*.json"))]
    meta = {"engine": args.engine, "gpu": serve.gpu_name(), "versions": serve.versions(args.engine),
            "library": library_info(), "model": args.model, "layers": args.layers, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "date": _dt.date.today().isoformat(), "notes": args.note,
            "command": "python -m e2e_bench.install " + " ".join(sys.argv[1:] if argv is None else argv)}
    meta, rows = merge(meta, rows, [json.loads(pathlib.Path(f).read_text()) for f in args.merge])
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['date']}-{serve.slug(meta['gpu'])}-install"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
