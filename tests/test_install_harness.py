"""The install proof's bookkeeping (e2e_bench/install.py): compile counts read from the servers'
logs, and one results file holding several engines' rows (no server is started here)."""

import datetime
import json
import pathlib

from e2e_bench import install

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "e2e_bench" / "results"


def test_compile_counts_from_the_warm_up_line_and_tilelang_log():
    log = ("[2026-11-26 17:30:12] qla-serving: 2 of 2 warm-up steps done in 26.5 s: 0 kernels from precompiled "
           "libraries, 4 compiled with TileLang\n"
           "2026-11-26 17:29:50  [TileLang:tilelang.jit.kernel:INFO] (kernel.py:145): TileLang begins to compile kernel "
           "`prep`\n"
           "(EngineCore pid=1) INFO [warmup.py:135] qla-serving: 4 of 4 warm-up steps done in 0.0 s: 4 kernels from "
           "precompiled libraries, 0 compiled with TileLang\n")
    assert install.count_compiles(log) == {"library_kernels": 4, "qla_tilelang_compiles": 4, "tilelang_compile_lines": 1}


def test_startup_parts_from_each_engines_log_stamps():
    """Launch -> first timestamped line, and vLLM's own engine-init total; the earliest stamp wins
    whichever engine's format it has, and a log with neither stamp gives None."""
    launched = datetime.datetime(2026, 11, 26, 21, 58, 50).timestamp()
    vllm_log = ("/tmp/x/warnings.py:1: UserWarning: no stamp here\n"
                "INFO 11-26 21:59:23 [__init__.py:112] Registered model loader `qla_dummy`\n"
                "(EngineCore pid=1539) INFO 11-26 22:00:30 [core.py:340] init engine (profile, create kv cache, "
                "warmup model) took 32.59 s (compilation: 2.30 s)\n")
    assert install.startup_parts(vllm_log, launched) == {"first_log_s": 33.0, "engine_init_s": 32.59}
    sglang_log = ("launch_server.py:56: UserWarning: 'sglang serve' is the recommended entrypoint\n"
                  "[2026-11-26 21:59:13] server_args=ServerArgs(...)\n"
                  "[2026-11-26 21:59:40] INFO 11-26 21:59:40 [x.py:1] a vLLM-style line later on\n")
    assert install.startup_parts(sglang_log, launched) == {"first_log_s": 23.0, "engine_init_s": None}
    assert install.startup_parts("no stamps at all\n", launched) == {"first_log_s": None, "engine_init_s": None}


def _meta(engine, versions, notes=()):
    return {"engine": engine, "gpu": "NVIDIA H100 80GB HBM3", "versions": versions, "library": {"libraries": []},
            "model": "qwen3-next-80b-a3b", "layers": 8, "prompt_len": 8192, "max_tokens": 16, "date": "2026-11-26",
            "notes": list(notes), "command": f"python -m e2e_bench.install --engine {engine}"}


def test_a_second_engine_joins_the_first_engines_file():
    vllm_file = {"meta": _meta("vllm", {"vllm": "0.26.0", "tilelang": "0.1.9"}, ["pins first"]),
                 "rows": [{"backend": "default", "run": "warm", "startup_s": 82.0},
                          {"backend": "flashqla", "run": "cold", "startup_s": 262.1}]}
    rows = [{"engine": "sglang", "backend": "flashqla", "run": "cold", "startup_s": 120.0, "library_kernels": 4}]
    meta, merged = install.merge(_meta("sglang", {"sglang": "0.5.17", "tilelang": "0.1.11"}), rows, [vllm_file])
    assert set(meta["engines"]) == {"vllm", "sglang"} and "versions" not in meta
    assert meta["engines"]["vllm"]["notes"] == ["pins first"]
    assert [(r["engine"], r["backend"], r["run"]) for r in merged] == [
        ("vllm", "flashqla", "cold"), ("vllm", "default", "warm"), ("sglang", "flashqla", "cold")]
    text = install.markdown(meta, merged)
    assert "vllm 0.26.0, sglang 0.5.17" in text.splitlines()[0]
    assert "| sglang | flashqla | cold | 120.0 |" in text and "TileLang 0.1.11" in text
    # the same engine measured again replaces its earlier rows, and the merged file merges again
    again, merged2 = install.merge(_meta("vllm", {"vllm": "0.26.0", "tilelang": "0.1.9"}),
                                   [{"engine": "vllm", "backend": "flashqla", "run": "warm", "startup_s": 80.0}],
                                   [{"meta": meta, "rows": merged}])
    assert [(r["engine"], r["run"]) for r in merged2] == [("vllm", "warm"), ("sglang", "cold")]
    assert again["engines"]["vllm"]["notes"] == []


def test_the_results_file_of_record_reads_back():
    record = json.loads((RESULTS / "2026-11-26-nvidia-h100-80gb-hbm3-install.json").read_text())
    assert {r["engine"] for r in record["rows"]} == {"vllm", "sglang"} == set(record["meta"]["engines"])
    # a new SGLang run replaces the record's SGLang rows and keeps the vLLM ones
    meta, rows = install.merge(_meta("sglang", {"sglang": "0.5.17"}), [], [record])
    vllm_rows = [r for r in record["rows"] if r["engine"] == "vllm"]
    assert rows == vllm_rows and set(meta["engines"]) == {"vllm", "sglang"}
    assert install.markdown(meta, rows).count("| vllm |") == len(rows)


def test_the_kernels_a_request_compiles_come_from_tritons_cache(tmp_path, monkeypatch):
    """Triton leaves <hash>/<name>.json per compiled kernel (and __grp__<name>.json beside it): the
    first request's compilations are what its run adds to the cache, named in the results."""
    def compiled(name, key):
        d = tmp_path / "cache" / key
        d.mkdir(parents=True)
        (d / f"{name}.json").write_text("{}")
        (d / f"__grp__{name}.json").write_text("{}")
        (d / f"{name}.cubin").write_bytes(b"")

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert install.triton_kernels() == {}  # no cache yet
    compiled("_causal_conv1d_fwd_kernel", "a1")
    before = install.triton_kernels()
    compiled("_causal_conv1d_fwd_kernel", "b2")  # another specialisation of the same kernel
    compiled("fused_moe_kernel", "c3")
    after = install.triton_kernels()
    assert install.compiled_between(before, after) == {"_causal_conv1d_fwd_kernel": 1, "fused_moe_kernel": 1}
    assert install.compiled_between(after, after) == {}
    row = {"engine": "vllm", "backend": "default", "run": "cold", "first_request_s": 0.4, "warm_request_s": 0.08,
           "first_request_triton_compiles": install.compiled_between(before, after)}
    text = install.markdown(_meta("vllm", {"vllm": "0.26.0"}), [row])
    assert "- vllm default (cold): _causal_conv1d_fwd_kernel x1, fused_moe_kernel x1" in text
