"""The serving benchmark: real servers, the engines' own benchmark clients, one backend flag apart.

For each GDN backend the harness starts the engine's real server (``vllm serve`` or
``python -m sglang.launch_server``) with only the backend flag changed (CUDA graphs,
torch.compile, chunked prefill and prefix caching as the engine ships them), waits until
``/health`` answers, sends the agreement prompts (greedy, token ids in and out), drives the
server with the engine's own client (``vllm bench serve`` / ``python -m sglang.bench_serving``,
random dataset, fixed input and output lengths) over each workload and concurrency, stops it
and moves on. One results file per engine and TP size::

    e2e_bench/results/<date>-<gpu>-serve-<engine>-tp<N>.json   {"meta": {...}, "rows": [...]}
    ... .md (a table per workload) and -<workload>.png (throughput and TTFT against concurrency)

Models (``e2e_bench/models/*.json``) carry the released per-layer shapes; ``--layers`` cuts the
layer count to fit the GPUs (stated in the results). Weights are dummy, with GDN gates re-drawn
so that state carries over hundreds of tokens (vLLM: load format ``qla_dummy``), so a state bug
changes the greedy tokens. A tokenizer of whitespace-separated words (``w0 w1 ...``) is written
beside the config, so the clients' random dataset round-trips exactly and nothing is downloaded.

    python -m e2e_bench.serve --engine vllm --model qwen3.5-397b-a17b --layers 4 \\
        --workloads chat short --concurrency 1 32 128 --out-dir "$OUT"
    python -m e2e_bench.serve ... --dry-run            # the commands, nothing started
    python -m e2e_bench.serve report FILE.json ...     # table and plots from results files
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import pathlib
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from .agreement import agree_fraction, distinct_tokens
from .gpu_clocks import ClockSampler
from .host_load import HostSampler

HERE = pathlib.Path(__file__).resolve().parent
MODELS_DIR = HERE / "models"
RESULTS_DIR = HERE / "results"

# name: (input tokens, output tokens); the issue's names, used verbatim in the results.
WORKLOADS: dict[str, tuple[int, int]] = {
    "long": (32768, 256),
    "retrieval": (8192, 512),
    "chat": (2048, 1024),
    "short": (1024, 128),
}
ENGINES = ("vllm", "sglang")
#: read by the servers' dummy-weight hooks (qla_serving.bench.weights.WEIGHTS_ENV; the harness runs
#: where only the engine imports qla_serving)
WEIGHTS_ENV = "QLA_BENCH_WEIGHTS"
# Our backends and what each sets in the server's environment (every one under QLA_STRICT=1):
# flashqla-classic is flashqla with vLLM's own input preparation before the classic prefill
# kernels (QLA_PREFILL_PACKED=0), for A/B runs against the default packed-inputs prefill;
# flashqla-bound runs a step's later GDN layers on the first one's bound launches (QLA_BOUND_LAUNCH=1);
# flashqla-fault is flashqla with a state fault (vLLM's qla_dummy weights only), the stress harness's
# positive control (qla_serving.bench.faults); flashqla-one-token-prefill keeps the chunked prefill's
# answer for a new one-token prompt that vLLM's split made a prefill row (QLA_FRESH_ON_DECODE=0);
# flashqla-batch-invariant gives each sequence the same bits whatever its batch (QLA_BATCH_INVARIANT=1);
# flashqla-cp-per-sequence keeps AutoCP but splits each sequence as if alone (QLA_CP_PER_SEQUENCE=1).
OURS = {"flashqla": {}, "flashqla-classic": {"QLA_PREFILL_PACKED": "0"}, "flashqla-bound": {"QLA_BOUND_LAUNCH": "1"},
        "flashqla-fault": {"QLA_BENCH_FAULT": "swap-decode-slots"},
        "flashqla-one-token-prefill": {"QLA_FRESH_ON_DECODE": "0"},
        "flashqla-batch-invariant": {"QLA_BATCH_INVARIANT": "1"},
        "flashqla-cp-per-sequence": {"QLA_CP_PER_SEQUENCE": "1"}}
DEFAULT_BACKENDS = ("flashqla", "default", "flashinfer", "triton")
BACKENDS = DEFAULT_BACKENDS + tuple(o for o in OURS if o not in DEFAULT_BACKENDS)
TOKENIZER_WORDS = 32000  # word ids 0..31999; the end-of-text token comes after them
EOS_TEXT = "<|endoftext|>"
# `vllm` as this interpreter runs it (the GPU machine carries vLLM on PYTHONPATH, no console script)
VLLM_CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
# each engine's benchmark client as a command; its own arguments follow
CLIENT_CLI = {"vllm": [*VLLM_CLI, "bench", "serve"], "sglang": [sys.executable, "-m", "sglang.bench_serving"]}
ROW_KEYS = ("engine", "backend", "tp", "workload", "input_len", "output_len", "concurrency",
            "num_prompts", "request_throughput", "total_tok_s", "output_tok_s", "mean_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "agree_fraction", "startup_s",
            "sm_clock_mhz_median", "sm_clock_mhz_min", "power_w_mean", "clock_limits", "host_busy_pct",
            "host_steal_pct", "server_cpus")


def log(msg: str) -> None:
    print(f"[serve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt(v: float | None, d: int = 1) -> str:
    """A table cell: ``v`` with ``d`` decimals, a dash where there is no value."""
    return "—" if v is None else f"{v:.{d}f}"


def cpu_set() -> str:
    """The CPUs this process (and the servers it starts) may run on, as ranges: servers side by
    side share the host, and a concurrency-1 step is host-bound (docs/e2e.md, "Host time")."""
    cpus = sorted(os.sched_getaffinity(0))
    ranges, start = [], None
    for i, c in enumerate(cpus):
        start = c if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            ranges.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return f"{','.join(ranges)} ({len(cpus)})"


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list (``0-3,8,10-11``) as CPU numbers."""
    out: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def gpu_local_cpus(gpus: list[int], bus_ids: dict[int, str], allowed: set[int],
                   pci_root: str = "/sys/bus/pci/devices") -> list[int]:
    """The CPUs of ``allowed`` on the NUMA node(s) of ``gpus`` (``bus_ids``: GPU index to its PCI bus
    id as ``nvidia-smi`` prints it): servers that take turns on the same GPUs then run on the same
    CPUs, the ones nearest their GPUs. Raises ValueError naming the GPU whose CPUs are unknown."""
    local: set[int] = set()
    for g in gpus:
        if g not in bus_ids:
            raise ValueError(f"GPU {g}: no PCI bus id (nvidia-smi lists GPUs {sorted(bus_ids)})")
        dom, _, rest = bus_ids[g].strip().lower().partition(":")
        # nvidia-smi's 00000000:9A:00.0 is sysfs's 0000:9a:00.0
        path = pathlib.Path(pci_root) / f"{dom[-4:]}:{rest}" / "local_cpulist"
        try:
            local |= set(parse_cpu_list(path.read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"GPU {g}: no CPU list at {path} ({e})") from None
    cpus = sorted(local & allowed)
    if not cpus:
        raise ValueError(f"GPUs {gpus}: none of their local CPUs {sorted(local)} is allowed here")
    return cpus


def local_cpus_of(gpus: str) -> str:
    """``gpu_local_cpus`` for a slot's GPUs (``0,1``) on this machine, as a ``taskset`` list; the bus
    ids from ``nvidia-smi``, the CPU lists from sysfs (``QLA_PCI_ROOT`` stands in for it)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    rows = (line.partition(",") for line in out.splitlines() if "," in line)
    bus_ids = {int(i): bus.strip() for i, _, bus in rows}
    cpus = gpu_local_cpus([int(g) for g in gpus.split(",")], bus_ids, set(os.sched_getaffinity(0)),
                          os.environ.get("QLA_PCI_ROOT", "/sys/bus/pci/devices"))
    return ",".join(map(str, cpus))


# ----------------------------------------------------------------------------- models


def model_spec(name: str) -> dict:
    path = MODELS_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in MODELS_DIR.glob("*.json"))
        raise SystemExit(f"serve: no model {name!r}; known: {', '.join(known)}")
    return json.loads(path.read_text())


def layer_types(num_layers: int, interval: int) -> list[str]:
    """Every ``interval``-th layer is full attention, the rest GDN (the released layout)."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def hf_config(spec: dict, num_layers: int, max_len: int, text_only: bool = False) -> dict:
    """``config.json`` of ``spec`` cut to ``num_layers`` layers (a multiple of the interval). With
    ``text_only`` a ``...ForConditionalGeneration`` model is written as its language model's own
    config (the ``...ForCausalLM`` architecture, no vision tower)."""
    interval = spec["full_attention_interval"]
    if num_layers < interval or num_layers % interval:
        raise ValueError(f"--layers {num_layers}: must be a positive multiple of the full-attention "
                         f"interval {interval} (so the cut model keeps the released GDN:attention ratio)")
    vocab = spec["vocab_size"]
    text = {
        "vocab_size": vocab, "hidden_size": spec["hidden_size"], "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": num_layers, "layer_types": layer_types(num_layers, interval),
        "full_attention_interval": interval,
        "num_attention_heads": spec["num_attention_heads"], "num_key_value_heads": spec["num_key_value_heads"],
        "head_dim": spec["head_dim"],
        **{k: spec[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                                "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")},
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": max_len,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": TOKENIZER_WORDS, "pad_token_id": None, "dtype": "bfloat16",
        "torch_dtype": "bfloat16", "router_aux_loss_coef": 0.0, "output_router_logits": False,
    }
    rope = {"rope_type": "default", "rope_theta": spec["rope_theta"],
            "partial_rotary_factor": spec["partial_rotary_factor"]}
    if spec["model_type"] == "qwen3_next":
        text.update(model_type="qwen3_next", rope_theta=spec["rope_theta"], num_nextn_predict_layers=1,
                    partial_rotary_factor=spec["partial_rotary_factor"], rope_parameters=rope,
                    architectures=[spec["architecture"]])
        return text
    text.update(model_type=f"{spec['model_type']}_text", mtp_num_hidden_layers=1,
                rope_parameters={**rope, "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    if spec.get("state_dtype"):
        text["mamba_ssm_dtype"] = spec["state_dtype"]
    if text_only:
        # a text-only model gets no M-RoPE positions: plain partial RoPE (as SGLang's offline harness)
        text.update(architectures=[spec["architecture"].replace("ForConditionalGeneration", "ForCausalLM")],
                    rope_parameters=rope, rope_theta=spec["rope_theta"],
                    partial_rotary_factor=spec["partial_rotary_factor"])
        return text
    # vLLM builds the vision tower even with --language-model-only and splits its heads over the
    # TP ranks: 16 heads (the released count) of 64 divide by every TP size up to 16.
    vision = {"model_type": f"{spec['model_type']}_vision", "depth": 1, "hidden_size": 1024, "num_heads": 16,
              "intermediate_size": 128, "out_hidden_size": spec["hidden_size"], "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    return {"architectures": [spec["architecture"]], "model_type": spec["model_type"],
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
            "image_token_id": vocab - 4, "video_token_id": vocab - 3,
            "vision_start_token_id": vocab - 6, "vision_end_token_id": vocab - 5}


def tokenizer_json(words: int = TOKENIZER_WORDS, vocab_size: int = 0) -> dict:
    """A word-level tokenizer: ``w<i>`` is id ``i``, whitespace splits, decoding joins with spaces,
    so any id sequence decodes and re-encodes to itself (the clients' random dataset relies on it).
    The end-of-text token is id ``words``; ``vocab_size`` > ``words`` + 1 adds ``w<i>`` for the ids
    after it, so that every id the model can generate decodes to a word (SGLang's client times the
    first token at the first chunk whose text is not empty)."""
    vocab = {f"w{i}": i for i in range(words)}
    vocab[EOS_TEXT] = words
    vocab.update({f"w{i}": i for i in range(words + 1, vocab_size)})
    special = {"id": words, "content": EOS_TEXT, "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [special],
            "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},  # joins words with spaces
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": EOS_TEXT}}


def tokenizer_dir(model_dir: str) -> str:
    return str(pathlib.Path(model_dir) / "tokenizer")


def write_model(spec: dict, num_layers: int, max_len: int, directory: str | os.PathLike,
                full_vocab: bool = False, text_only: bool = False) -> str:
    """Write config.json into ``directory`` and the tokenizer into its ``tokenizer/`` (apart, since
    transformers would otherwise build the model type's own tokenizer class); weights stay dummy.
    ``full_vocab``: the tokenizer has a word for every id of the model's vocabulary (SGLang's
    client, :func:`tokenizer_json`); without it, ids past the end-of-text token decode to nothing.
    ``text_only``: :func:`hf_config`'s language-model config of a multimodal model."""
    path = pathlib.Path(directory)
    tok = pathlib.Path(tokenizer_dir(str(path)))
    tok.mkdir(parents=True, exist_ok=True)
    write_whole(path / "config.json", json.dumps(hf_config(spec, num_layers, max_len, text_only), indent=1) + "\n")
    words = tokenizer_json(vocab_size=spec["vocab_size"] if full_vocab else 0)
    write_whole(tok / "tokenizer.json", json.dumps(words))
    write_whole(tok / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TEXT, "model_max_length": max_len,
        "clean_up_tokenization_spaces": False}))
    return str(path)


def engine_model(spec: dict, engine: str, num_layers: int, max_len: int,
                 directory: str | os.PathLike) -> dict:
    """Write the model files as ``engine`` serves them; returns the :class:`Setup` fields they imply
    (``model_dir``, ``multimodal``, ``text_model``). vLLM reads the released
    ``...ForConditionalGeneration`` config with ``--language-model-only``; SGLang has no such switch
    (it would build the model's image processor), so it gets the language model's own
    ``...ForCausalLM`` config, the same layers, and a word for every id (its detokenizer decodes every
    output)."""
    sglang = engine == "sglang"
    conditional = spec["architecture"].endswith("ForConditionalGeneration")
    model_dir = write_model(spec, num_layers, max_len, directory, full_vocab=sglang, text_only=sglang)
    return {"model_dir": model_dir, "multimodal": conditional and not sglang, "text_model": conditional and sglang}


def write_whole(path: pathlib.Path, text: str) -> None:
    """Write ``path`` by renaming a finished file over it: servers started side by side (one per
    GPU, ``scripts/gpu_session.sh serve-split``) read the model files while another run rewrites them."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # runs may be threads too
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- commands


@dataclasses.dataclass
class Setup:
    engine: str
    model_dir: str
    tp: int
    max_len: int
    port: int = 8321
    multimodal: bool = False  # a ...ForConditionalGeneration config: serve the language model only
    # SGLang: a multimodal release's language model as its own ...ForCausalLM (engine_model)
    text_model: bool = False


def server_command(s: Setup, backend: str, extra: list[str] = ()) -> list[str]:
    """The server's command line: identical for every backend except the backend flag."""
    if s.engine == "vllm":
        cmd = [*VLLM_CLI, "serve", s.model_dir, "--served-model-name", "bench", "--port", str(s.port),
               "--host", "127.0.0.1", "--tokenizer", tokenizer_dir(s.model_dir), "--load-format", "qla_dummy", "--max-model-len", str(s.max_len),
               "--tensor-parallel-size", str(s.tp), "--seed", "0"]
        if s.multimodal:
            cmd.append("--language-model-only")
        if s.tp > 1:
            # the same all-reduce for every backend (NCCL); docs/e2e.md, "Tensor parallelism"
            cmd.append("--disable-custom-all-reduce")
        if backend in OURS:
            cmd += ["--linear-attn-backend", "flashqla"]
        elif backend != "default":
            cmd += ["--gdn-prefill-backend", backend]
    elif s.engine == "sglang":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", s.model_dir,
               "--tokenizer-path", tokenizer_dir(s.model_dir), "--served-model-name", "bench", "--port", str(s.port),
               "--host", "127.0.0.1", "--load-format", "dummy", "--context-length", str(s.max_len), "--tp-size", str(s.tp),
               "--random-seed", "0"]
        if s.tp > 1:
            cmd.append("--disable-custom-all-reduce")
        if sglang_fa3_library() is None:
            # SGLang's default full attention on Hopper is FA3, from sgl-kernel's flash_ops, which
            # the GPU machine's bundle leaves out (1.1 GB); the same for every backend
            cmd += ["--attention-backend", "triton"]
        if backend in OURS:
            cmd += ["--linear-attn-backend", "flashqla"]
        elif backend != "default":
            cmd += ["--linear-attn-backend", backend]
        if s.text_model:
            # SGLang resolves the hybrid radix cache's strategy for the released architectures only
            # (0.5.17: not the text-only Qwen3_5MoeForCausalLM): what it resolves for them, by backend
            # (its flashinfer GDN kernels take no extra buffer)
            cmd += (["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]
                    if backend == "flashinfer" else ["--mamba-radix-cache-strategy", "extra_buffer"])
    else:
        raise ValueError(f"engine {s.engine!r}: expected one of {ENGINES}")
    return cmd + list(extra)


def sglang_fa3_library() -> str | None:
    """sgl-kernel's FA3 library (``flash_ops``), found without importing sgl_kernel; None if absent."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("sgl_kernel")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    found = sorted(pathlib.Path(spec.origin).parent.glob("flash_ops*.so"))
    return str(found[0]) if found else None


def num_prompts(concurrency: int, per_concurrency: int, minimum: int) -> int:
    return max(minimum, per_concurrency * concurrency)


def client_command(s: Setup, workload: str, concurrency: int, prompts: int, result_file: str,
                   warmups: int, seed: int = 0) -> list[str]:
    """The engine's own benchmark client on its random dataset at fixed lengths."""
    input_len, output_len = WORKLOADS[workload]
    base = f"http://127.0.0.1:{s.port}"
    if s.engine == "vllm":
        out = pathlib.Path(result_file)
        return [*CLIENT_CLI["vllm"], "--backend", "vllm", "--base-url", base, "--model", "bench",
                "--tokenizer", tokenizer_dir(s.model_dir), "--dataset-name", "random", "--random-input-len", str(input_len),
                "--random-output-len", str(output_len), "--random-range-ratio", "0", "--num-prompts",
                str(prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
                "--num-warmups", str(warmups), "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
                "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
                "--result-filename", out.name, "--disable-tqdm"]
    # "random-ids": random token ids; SGLang's "random" samples ShareGPT prompts, downloaded from the Hub.
    # --flush-cache: the client empties the radix cache after its warm-up, which SGLang keeps on by
    # default: the warm-up sends the point's first prompt, and one seed gives every point the same
    # first prompts, so without it the measured requests would start from cached prefixes.
    return [*CLIENT_CLI["sglang"], "--backend", "sglang", "--base-url", base,
            "--model", "bench", "--tokenizer", tokenizer_dir(s.model_dir), "--dataset-name", "random-ids",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", "1", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--warmup-requests", str(warmups), "--flush-cache", "--seed", str(seed),
            "--output-file", result_file, "--disable-tqdm"]


def parse_client_result(engine: str, path: str) -> dict:
    """The row fields from a client's saved result (vLLM: one JSON; SGLang: JSON lines, last)."""
    text = pathlib.Path(path).read_text().strip()
    data = json.loads(text.splitlines()[-1]) if engine == "sglang" else json.loads(text)
    get = lambda *names: next((float(data[n]) for n in names if data.get(n) is not None), None)  # noqa: E731
    return {
        "request_throughput": get("request_throughput"),
        "total_tok_s": get("total_token_throughput", "total_throughput"),
        "output_tok_s": get("output_throughput"),
        "mean_ttft_ms": get("mean_ttft_ms"), "p99_ttft_ms": get("p99_ttft_ms"),
        "mean_tpot_ms": get("mean_tpot_ms"), "p99_tpot_ms": get("p99_tpot_ms"),
        "mean_itl_ms": get("mean_itl_ms"),
        "completed": int(data.get("completed", 0) or 0),
    }


# ----------------------------------------------------------------------------- agreement


def agreement_prompts(n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """``n`` token-id prompts of lengths spread over ``[min_len, max_len]`` (word ids only)."""
    import random

    rng = random.Random(seed)
    lens = [min_len + (max_len - min_len) * i // max(1, n - 1) for i in range(n)]
    return [[rng.randrange(TOKENIZER_WORDS) for _ in range(length)] for length in lens]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def greedy_tokens(s: Setup, prompts: list[list[int]], max_tokens: int, timeout: float = 300) -> list[list[int]]:
    """Greedy output ids of each prompt, one request at a time (token ids in, token ids out)."""
    outs = []
    for p in prompts:
        if s.engine == "vllm":
            r = _post(f"http://127.0.0.1:{s.port}/v1/completions",
                      {"model": "bench", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}, timeout)
            outs.append(list(r["choices"][0]["token_ids"]))
        else:
            r = _post(f"http://127.0.0.1:{s.port}/generate",
                      {"input_ids": p, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                           "ignore_eos": True}}, timeout)
            outs.append(list(r["output_ids"]))
    return outs


# ----------------------------------------------------------------------------- server lifecycle


class Client:
    """The engine's benchmark client in one long-lived process (e2e_bench/serve_client.py): the
    engine is imported once per server, not once per point."""

    def __init__(self, engine: str, env: dict):
        self.engine, self.env, self.proc = engine, env, None

    def run(self, cmd: list[str], log_path: pathlib.Path) -> tuple[int, str]:
        prefix = len(CLIENT_CLI[self.engine])
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "e2e_bench.serve_client", self.engine],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
                                         cwd=str(HERE.parent))
            if "ready" not in (self.proc.stdout.readline() or ""):
                return 1, "the benchmark client did not start"
        self.proc.stdin.write(json.dumps({"argv": cmd[prefix:], "log": str(log_path)}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            return 1, "the benchmark client exited"
        a = json.loads(answer)
        return a["rc"], a.get("error", "")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(2)
    return False


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM the server's process group (it owns its workers), then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: str | os.PathLike, lines: int = 40) -> str:
    try:
        return "\n".join(pathlib.Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# an exception line of a server's log ("ValueError: max_num_seqs (1024) exceeds ..."), with vLLM's and
# SGLang's process prefixes ("(EngineCore pid=8868) ", "[2026-11-27 10:32:48 TP0] ") in front of it
_EXCEPTION_LINE = re.compile(r"^(?:\(\w+ pid=\d+\)\s+|\[[^\]]*\]\s+)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b:?.*)$")
# the engines' wrappers around the error that stopped the start, which say nothing of their own
_WRAPPER_ERRORS = ("Engine core initialization failed", "Initialization failed", "Rank 0 scheduler is dead")


def start_failure(path: str | os.PathLike) -> str:
    """Why a server did not start, in one line: the first exception its log names that is not one of
    the engine's wrappers around it (``server did not start`` alone when the log names none)."""
    try:
        lines = pathlib.Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "server did not start (no log)"
    found = [m.group(1).strip() for line in lines if (m := _EXCEPTION_LINE.match(line.strip()))]
    causes = [c for c in found if not any(w in c for w in _WRAPPER_ERRORS)] or found
    return f"server did not start: {causes[0][:300]}" if causes else "server did not start"


DEFAULT_LOG_PATTERNS = {
    # vLLM: "Using FlashInfer GDN prefill kernel (requested=auto, ...)"
    "vllm": re.compile(r"Using (FlashInfer|CuteDSL|Triton/FLA) GDN prefill kernel \(requested=auto"),
    # SGLang 0.5.17-0.5.23 (model runner, rank 0): "Linear attention kernel backend: decode=triton,
    # prefill=triton, verify=triton"
    "sglang": re.compile(r"Linear attention kernel backend: decode=(\w+), prefill=(\w+)"),
}
ENGINE_NAMES = {"FlashInfer": "flashinfer", "CuteDSL": "cutedsl", "Triton/FLA": "triton"}
# what a fallback of ours to the engine's kernels says in the server's log
FALLBACK_MARKS = ("falling back", "GDN kernels run instead")


# What the server sized itself to, from its own start-up lines: a backend whose start leaves less
# memory for the KV cache (or the state slots) serves fewer requests at once, which shows in every
# throughput row without being the kernels' doing.
CAPACITY_PATTERNS = {
    "vllm": {"kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
             "max_concurrency": re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")},
    "sglang": {"kv_cache_tokens": re.compile(r"max_total_num_tokens=(\d+)"),
               "max_running_requests": re.compile(r"max_running_requests=(\d+)"),
               "chunked_prefill_size": re.compile(r"chunked_prefill_size=(-?\d+)")},
}


def server_capacity(engine: str, log_text: str) -> dict:
    """The KV-cache capacity lines of a server log (first match each; absent lines left out)."""
    out = {}
    for name, pattern in CAPACITY_PATTERNS[engine].items():
        m = pattern.search(log_text)
        if m:
            value = m.group(1).replace(",", "")
            out[name] = float(value) if "." in value else int(value)
    return out


# The engines' own generation throughput lines: SGLang's scheduler every 40 decode steps, vLLM's
# stat logger every 10 s (its window's prompt throughput beside it).
ENGINE_RATE_PATTERNS = {
    "sglang": re.compile(r"Decode batch, #running-req: (?P<running>\d+),.*?gen throughput \(token/s\): (?P<rate>[\d.]+)"),
    "vllm": re.compile(r"Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, Avg generation throughput: "
                       r"(?P<rate>[\d.]+) tokens/s, Running: (?P<running>\d+) reqs"),
}


def engine_decode_rate(engine: str, log_text: str, running: int) -> dict:
    """The engine's own decode rate over a point: the median of its logged generation throughput
    where it held ``running`` requests (the point's concurrency, a full batch) and, for vLLM, took
    no prompt tokens in the window. It is the steps' pace without the client's ramp-up and tail,
    which move a point's throughput between two runs of one server by several percent. Returns
    ``engine_decode_tok_s`` and ``engine_decode_lines`` (how many lines), or {} when none qualify."""
    rates = [float(m["rate"]) for m in ENGINE_RATE_PATTERNS[engine].finditer(log_text)
             if int(m["running"]) == running and float(m.groupdict().get("prompt") or 0) == 0]
    return {"engine_decode_tok_s": statistics.median(rates), "engine_decode_lines": len(rates)} if rates else {}


def read_from(path: pathlib.Path, offset: int) -> str:
    """The text a log gained after byte ``offset``."""
    if not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def resolve_default(engine: str, log_text: str) -> str | None:
    """The GDN backend the engine picked with no flag, read from its log (SGLang: one name when
    decode and prefill agree, else ``<prefill> prefill, <decode> decode``)."""
    m = DEFAULT_LOG_PATTERNS[engine].search(log_text)
    if not m:
        return None
    if engine == "sglang":
        decode, prefill = m.group(1).lower(), m.group(2).lower()
        return prefill if prefill == decode else f"{prefill} prefill, {decode} decode"
    return ENGINE_NAMES.get(m.group(1), m.group(1).lower())


# ----------------------------------------------------------------------------- the run


class Server:
    """One engine server in its own process group, its output in ``log_path``."""

    def __init__(self, cmd: list[str], env: dict, log_path: pathlib.Path, port: int):
        self.cmd, self.env, self.log_path, self.port = cmd, env, log_path, port
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self, timeout: float) -> bool:
        """Start it and wait for ``/health``; False if it exits or does not answer in time."""
        self.started = time.monotonic()
        with open(self.log_path, "w") as lf:
            self.proc = subprocess.Popen(self.cmd, stdout=lf, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return wait_healthy(self.port, self.proc, timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def crashed(self, wait: float = 20) -> bool:
        """Whether it died: its process exited, or exits or stops answering ``/health`` within
        ``wait`` s (an engine whose worker failed takes its process tree down over a few seconds,
        so the requests it dropped can all have returned while its process is still there)."""
        return not self.alive() or not wait_healthy(self.port, self.proc, wait)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


# The engines' all-reduce + RMSNorm fusion at TP > 1 (docs/e2e.md, "Tensor parallelism"): "trtllm"
# keeps it (vLLM's pass on FlashInfer's trtllm backend, backend_env; SGLang's own choice); "off" turns
# it off, for every backend alike (no FlashInfer communication kernels to build at a cold start).
ALLREDUCE_FUSION = ("trtllm", "off")


def add_allreduce_fusion_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allreduce-fusion", choices=ALLREDUCE_FUSION, default="trtllm",
                   help="at TP > 1: the engine's all-reduce + RMSNorm fusion (vLLM: on FlashInfer's trtllm backend; "
                        "SGLang: as it chooses), or off")


def add_weights_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=("dummy", "random"), default="dummy",
                   help="the servers' weights: the engine's dummy ones (GDN gates re-drawn; their greedy tokens are "
                        "one token repeated, so agreement tells little) or random ones whose every token depends "
                        f"on the GDN state ({WEIGHTS_ENV}=random: qla_serving.bench.weights)")


def allreduce_fusion_args(engine: str, tp: int, mode: str) -> list[str]:
    """Server arguments for ``--allreduce-fusion mode`` (none where the pass does not run)."""
    if tp == 1 or mode == "trtllm":
        return []
    if engine == "sglang":
        return ["--enforce-disable-flashinfer-allreduce-fusion"]
    return ["--compilation-config", json.dumps({"pass_config": {"fuse_allreduce_rms": False}})]


def backend_env(backend: str, tp: int = 1, engine: str = "vllm") -> dict:
    env = dict(os.environ)
    if engine == "sglang":
        # everything is local; SGLang's client would otherwise look "bench" up on the Hub (its
        # chat-template check) on every point, which on a machine without internet may hang
        env.setdefault("HF_HUB_OFFLINE", "1")
    if tp > 1:
        # FlashInfer's mnnvl all-reduce fusion needs NVLink multicast, which the lent machines keep
        # off: it faults in vLLM's profiling run (docs/e2e.md, "Tensor parallelism")
        env.setdefault("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "trtllm")
    env["QLA_BENCH_GDN_GATES"] = "1"  # SGLang's dummy weights with gates that remember (vLLM: qla_dummy)
    if backend in OURS:
        env["QLA_STRICT"] = "1"  # a fallback is an error: the row is ours or absent
        env.update(OURS[backend])
    return env


class Lockstep:
    """Servers side by side (serve-split) measure each point at the same time, or in turns.

    A concurrency-1 step is host-bound, and servers on one host slow each other down: a point
    measured while the other slot's server still compiles at start-up, or after it has stopped,
    is not comparable with that server's (docs/e2e.md, "Host time"). With ``--lockstep ID:N``
    each of the N slots waits, before its warm-up, every point and its profile, until all N
    have arrived there or left (a slot whose server failed, or that ran out of budget, leaves),
    through files in ``WORK/lockstep-ID``. With ``--lockstep ID:N:turns`` (servers sharing their
    GPUs) the slots then measure the point one after another while the others idle, the order
    rotating from point to point; a slot's turn at a point ends when it arrives at the next one.
    """

    def __init__(self, spec: str, work: pathlib.Path, me: str):
        self.n, self.turns, self.calls, self.last = 0, False, 0, ""
        self.turn: int | None = None  # in turns: this slot's place at the last point (0: first)
        if spec:
            parts = spec.split(":")
            self.turns = parts[-1] == "turns"
            if self.turns:
                parts.pop()
            if len(parts) != 2 or not parts[0] or not parts[1].isdigit() or int(parts[1]) < 1:
                raise ValueError(f"--lockstep {spec!r}: expected ID:N or ID:N:turns (N slots, at least 1)")
            self.n, self.dir, self.me = int(parts[1]), work / f"lockstep-{parts[0]}", me
            self.dir.mkdir(parents=True, exist_ok=True)

    def _gone(self) -> set[str]:
        return {p.name[len("gone-"):] for p in self.dir.glob("gone-*")}

    def _done(self, key: str) -> None:
        if key:
            done = self.dir / f"{key}.done"
            done.mkdir(parents=True, exist_ok=True)
            (done / self.me).touch()

    def wait(self, key: str, deadline: float) -> float | None:
        """Arrive at ``key`` and wait for the others (in turns: and for the slots before this one);
        the seconds waited (None when off or when the deadline came first, which the log names)."""
        if not self.n:
            return None
        self._done(self.last)  # in turns: this slot's measurement of the previous point is over
        self.last, self.calls = key, self.calls + 1
        t0 = time.monotonic()
        order = self._arrive(key, deadline, "going on")
        if order is None:
            return None
        if self.turns:
            order.sort()
            shift = (self.calls - 1) % len(order)
            order = order[shift:] + order[:shift]
            self.turn = order.index(self.me)
            if not self._after(order[:self.turn], key, deadline,
                               f"lockstep: {key}: the turns before this slot not over by the deadline; going on"):
                return None
        return round(time.monotonic() - t0, 1)

    def wait_start(self, deadline: float) -> float | None:
        """In turns: arrive at the start and wait until the slots before this one (by port, as the
        split numbers them) have started their servers or left, so that a server that sizes its pools
        from the GPU memory free at its start (SGLang: ``--mem-fraction-static`` of what is free) sees
        the others' memory taken. The seconds waited; None when not in turns or at the deadline."""
        if not self.turns:
            return None
        t0 = time.monotonic()
        order = self._arrive("start", deadline, "starting")
        if order is None:
            return None
        order.sort(key=_slot_order)
        if not self._after(order[:order.index(self.me)], "start", deadline,
                           "lockstep: the servers before this slot not up by the deadline; starting"):
            return None
        return round(time.monotonic() - t0, 1)

    def _arrive(self, key: str, deadline: float, then: str) -> list[str] | None:
        """Mark this slot at ``key`` and wait until every slot is there or gone: the names there, or
        None at the deadline (logged, ending with ``then``)."""
        here = self.dir / key
        here.mkdir(parents=True, exist_ok=True)
        (here / self.me).touch()
        while len({p.name for p in here.iterdir()} | self._gone()) < self.n:
            if time.monotonic() > deadline:
                log(f"lockstep: {key} reached by {len(list(here.iterdir()))} of {self.n} slots by the deadline; {then}")
                return None
            time.sleep(0.2)
        return [p.name for p in here.iterdir()]

    def _after(self, before: list[str], key: str, deadline: float, late: str) -> bool:
        """Wait until every slot in ``before`` is done with ``key`` or gone; False (and ``late``
        logged) at the deadline."""
        done = self.dir / f"{key}.done"
        while not set(before) <= ({p.name for p in done.iterdir()} if done.is_dir() else set()) | self._gone():
            if time.monotonic() > deadline:
                log(late)
                return False
            time.sleep(0.2)
        return True

    def started(self) -> None:
        """This slot's server is up: the next slot's may start (:meth:`wait_start`)."""
        if self.turns:
            self._done("start")

    def leave(self) -> None:
        """This slot measures nothing more: the others stop waiting for it."""
        if self.n:
            (self.dir / f"gone-{self.me}").touch()


def _slot_order(name: str) -> tuple[int, str]:
    """A lockstep slot's place at the start: its port (``...-portNNNN``, the split's slot order), then its name."""
    head, _, port = name.rpartition("-port")
    return (int(port), name) if head and port.isdigit() else (0, name)


def run_backend(s: Setup, backend: str, args, work: pathlib.Path, prompts: list[list[int]],
                budget_end: float) -> tuple[list[dict], dict]:
    """Start one server, measure every point, stop it. Returns (rows, info)."""
    sfx = sample_suffix(args.server_sample)
    logf = work / f"server-{backend}{sfx}.log"
    cmd = server_command(s, backend, args.server_arg + profiler_args(s, args, work / f"trace-{backend}{sfx}"))
    env = backend_env(backend, s.tp, s.engine)
    env[WEIGHTS_ENV] = args.weights
    if args.profile and s.engine == "vllm":
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # the model runner's host scopes in the trace
    log(f"start {s.engine} {backend} tp{s.tp}: {shlex.join(cmd)}")
    server = Server(cmd, env, logf, s.port)
    proc = None
    info: dict = {"backend": backend, "sample": args.server_sample, "command": shlex.join(cmd),
                  "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES") or "all", "cpus": cpu_set()}
    rows: list[dict] = []
    client = Client(s.engine, env)
    lockstep = Lockstep(args.lockstep, work, f"{backend}{sfx}-port{s.port}")
    deadline = budget_end if budget_end != float("inf") else time.monotonic() + 3600
    try:
        if lockstep.turns and s.engine == "sglang":
            # SGLang sizes its pools from the memory free when it starts: in turns on shared GPUs the
            # servers start one after another (their pools pinned by --max-total-tokens and
            # --max-mamba-cache-size, so that both get the same)
            log("lockstep: in turns, this SGLang server starts once the slots before it have started theirs")
            info["start_waited_s"] = lockstep.wait_start(deadline)
        healthy = server.start(min(args.start_timeout, max(0, budget_end - time.monotonic())))
        proc, t0 = server.proc, server.started
        if not healthy:
            info["error"] = start_failure(logf)
            log(f"FAILED start {backend} after {time.monotonic() - t0:.0f} s ({info['error']}); log tail:\n{tail(logf)}")
            return rows, info
        info["startup_s"] = round(time.monotonic() - t0, 1)
        log(f"healthy {backend} after {info['startup_s']} s")
        lockstep.started()
        if prompts:
            try:
                info["tokens"] = greedy_tokens(s, prompts, args.agree_tokens)
            except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
                info["agree_error"] = f"{type(e).__name__}: {e}"
                log(f"agreement requests failed on {backend}: {info['agree_error']}")
        if args.server_warmup and args.workloads and args.concurrency:
            lockstep.wait("warm-up", deadline)
            warm_up_server(s, backend, args, work, client, info, sfx)
        # every point once per round, the rounds one after another: a drift over the server's life
        # spreads over all points instead of landing on the last ones
        for rnd in range(args.repeats):
            for workload in args.workloads:
                for conc in args.concurrency:
                    point = f"{workload} c{conc}" + (f" round {rnd + 1}/{args.repeats}" if args.repeats > 1 else "")
                    # (in lockstep the wait ends at the budget at the latest: checked after it)
                    waited = lockstep.wait(f"r{rnd + 1}-{workload}-c{conc}", deadline)
                    if time.monotonic() > budget_end:
                        log(f"budget spent: {backend} {point} left out")
                        info.setdefault("left_out", []).append(f"{workload}@{conc}" + (f"#{rnd + 1}" if rnd else ""))
                        continue
                    n = num_prompts(conc, args.prompts_per_concurrency, args.min_prompts)
                    name = f"{backend}-{workload}-c{conc}{sfx}" + (f"-r{rnd + 1}" if args.repeats > 1 else "")
                    res = work / f"client-{name}.json"
                    ccmd = client_command(s, workload, conc, n, str(res), warmups=min(conc, args.warmups))
                    res.unlink(missing_ok=True)  # an earlier call's file must not stand in for this point
                    t1 = time.monotonic()
                    log_at = logf.stat().st_size if logf.is_file() else 0
                    with ClockSampler(work / f"clocks-{name}.csv") as clocks, HostSampler(getattr(proc, "pid", None)) as host:
                        rc, err = client.run(ccmd, work / f"client-{name}.log")
                    input_len, output_len = WORKLOADS[workload]
                    row = {"engine": s.engine, "backend": backend, "tp": s.tp, "workload": workload,
                           "input_len": input_len, "output_len": output_len, "concurrency": conc, "num_prompts": n,
                           "startup_s": info["startup_s"], "sample": args.server_sample, "round": rnd + 1,
                           **({"lockstep": args.lockstep, "lockstep_wait_s": waited} if lockstep.n else {}),
                           **({"lockstep_turn": lockstep.turn} if lockstep.turns else {})}
                    if rc != 0 or not res.is_file():
                        row["error"] = f"client exit {rc}: {err or ''} {tail(work / f'client-{name}.log', 5)}"
                    else:
                        row.update(parse_client_result(s.engine, str(res)), **clocks.summary, **host.summary,
                                   **engine_decode_rate(s.engine, read_from(logf, log_at), conc))
                    if not row.get("error") and row["completed"] < n:  # the clients count failed requests, exit 0
                        row["error"] = f"{row['completed']} of {n} requests completed"
                    if row.get("error"):
                        log(f"FAILED point {backend} {point}: {row['error'][-200:]}")
                    else:
                        log(f"point {backend} {point} n={n}: {row['total_tok_s']:.0f} tok/s total, "
                            f"{row['output_tok_s']:.0f} out, TTFT {row['mean_ttft_ms']:.0f} ms, "
                            f"TPOT {row['mean_tpot_ms']:.2f} ms, SM {row.get('sm_clock_mhz_median')} MHz "
                            f"({time.monotonic() - t1:.0f} s)")
                    if proc.poll() is not None:
                        row["error"] = row.get("error", "") + " server exited"
                    rows.append(row)
                    if proc.poll() is not None:
                        log(f"server {backend} died; log tail:\n{tail(logf)}")
                        info["error"] = "server died"
                        return rows, info
        if args.profile and proc.poll() is None:
            if budget_end - time.monotonic() > PROFILE_MIN_S:
                lockstep.wait("profile", deadline)
                info["profile"] = profile_point(s, backend, args, work, client)
            else:
                log(f"budget spent: the {args.profile} profile of {backend} left out")
                info.setdefault("left_out", []).append(f"profile {args.profile}")
    finally:
        lockstep.leave()
        text = server.log_text()
        info["resolved"] = resolve_default(s.engine, text) if backend == "default" else backend
        info["fallback"] = any(mark in text for mark in FALLBACK_MARKS)
        info["capacity"] = server_capacity(s.engine, text)
        server.stop()
        client.close()
    return rows, info


def warm_up_server(s: Setup, backend: str, args, work: pathlib.Path, client: Client, info: dict, sfx: str) -> None:
    """The first workload at the highest concurrency once, unmeasured: a fresh server's first batch
    shapes pay one-time work (kernels compiled or tuned on first use) that would otherwise land on
    whichever point runs first (up to 40% of its throughput). One wave of `concurrency` prompts
    meets those shapes; a second wave only spends the call's budget (long at 32: 20 s of 40)."""
    workload, conc = args.workloads[0], max(args.concurrency)
    n = conc
    res = work / f"client-{backend}-warmup{sfx}.json"
    t1 = time.monotonic()
    rc, _ = client.run(client_command(s, workload, conc, n, str(res), warmups=0, seed=1),
                       work / f"client-{backend}-warmup{sfx}.log")
    info["warmup"] = {"workload": workload, "concurrency": conc, "num_prompts": n, "client_rc": rc,
                      "seconds": round(time.monotonic() - t1, 1)}
    log(f"warm-up {backend} {workload} c{conc} n={n} (unmeasured): rc {rc}, {info['warmup']['seconds']} s")


PROFILE_MIN_S = 90  # the profile point runs the point again, then writes and reads the trace


def profiler_args(s: Setup, args, trace_dir: pathlib.Path) -> list[str]:
    """vLLM's torch profiler over a window of engine steps (nothing without --profile)."""
    if not args.profile or s.engine != "vllm":
        return []
    cfg = {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()), "torch_profiler_with_stack": False,
           "ignore_frontend": True, "delay_iterations": args.profile_delay, "max_iterations": args.profile_steps}
    return ["--profiler-config", json.dumps(cfg)]


def profile_point(s: Setup, backend: str, args, work: pathlib.Path, client: Client) -> dict:
    """The --profile point once more with the client's --profile (start/stop_profile), summarised."""
    from . import trace_summary as prof

    workload, conc = args.profile.split(":")
    conc = int(conc)
    n = num_prompts(conc, args.prompts_per_concurrency, args.min_prompts)
    name = f"{backend}{sample_suffix(args.server_sample)}"
    res = work / f"client-{name}-profile.json"
    trace_dir = work / f"trace-{name}"
    cmd = client_command(s, workload, conc, n, str(res), warmups=0) + ["--profile"]
    if s.engine == "sglang":  # SGLang's window: the first steps after the client's start_profile
        cmd += ["--profile-num-steps", str(args.profile_steps), "--profile-output-dir", str(trace_dir.resolve())]
        log(f"profile {backend} {workload} c{conc}: its first {args.profile_steps} steps")
    else:
        log(f"profile {backend} {workload} c{conc}: {args.profile_steps} steps after {args.profile_delay}")
    rc, _ = client.run(cmd, work / f"client-{name}-profile.log")
    time.sleep(5)  # the worker writes its trace after stop_profile returns
    out = {"client_rc": rc}
    texts = []
    ranks = []
    for t in prof.find_traces(trace_dir):
        summ = prof.summarize(prof.load_trace(t))
        if summ["kernel_us_total"]:
            ranks.append((t.name, summ))
            texts.append(prof.markdown(f"{backend} {workload} c{conc} — {t.name}", summ, args.profile_steps))
            if "trace" in out:
                continue  # the numbers below are the first rank's (every rank's are in the markdown)
            per = 1e3 * args.profile_steps
            host_steps = summ["host_steps"] or args.profile_steps  # the scopes count the steps they saw
            out.update(trace=t.name, kernel_ms_per_step=summ["kernel_us_total"] / per,
                       gpu_span_ms_per_step=summ["gpu_span_us"] / per, no_kernel_ms_per_step=summ["gpu_idle_us"] / per,
                       gdn_ms_per_step={k: v / per for k, v in summ["gdn_us"].items()},
                       gdn_op_host_us=summ["gdn_op_host_us"], host_steps=summ["host_steps"],
                       step_period_ms=None if summ["step_period_us"] is None else summ["step_period_us"] / 1e3,
                       host_ms_per_step={k: v / 1e3 / host_steps for k, v in summ["host_scopes_us"].items()},
                       runtime_per_step={k: [us / 1e3 / host_steps, c / host_steps]
                                         for k, (us, c) in summ["runtime_us"].items()},
                       steps_by_kind={kind: {"steps": d["steps"], **{k[:-3] + "_ms": None if v is None else v / 1e3
                                                                     for k, v in d.items() if k.endswith("_us")}}
                                      for kind, d in summ["steps_by_kind"].items()})
    if len(ranks) > 1:
        texts.insert(0, prof.ranks_table(ranks, args.profile_steps))
        out["ranks_ms_per_step"] = {name: {"kernels": s["kernel_us_total"] / 1e3 / args.profile_steps,
                                           "collectives": s["comm_us"] / 1e3 / args.profile_steps,
                                           "no_kernel": s["gpu_idle_us"] / 1e3 / args.profile_steps}
                                    for name, s in ranks}
    table = trace_dir / "profiler_out_0.txt"
    stem = results_stem(gpu_name(), s.engine, s.tp, args.tag)
    pathlib.Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.out_dir) / f"{stem}-profile-{name}.md").write_text(
        "\n".join(texts) + ("\n```\n" + "\n".join(table.read_text().splitlines()[:60]) + "\n```\n"
                            if table.is_file() else ""))
    log(f"profile {backend}: {out}")
    return out


def sample_suffix(sample: int) -> str:
    """File-name suffix of a backend's server sample (none for the first)."""
    return "" if sample <= 1 else f"-s{sample}"


def save_backend(work: pathlib.Path, key: dict, rows: list[dict], info: dict) -> None:
    name = f"backend-{info['backend']}{sample_suffix(info.get('sample', 1))}.json"
    (work / name).write_text(json.dumps({"key": key, "rows": rows, "info": info}))


def load_backend(work: pathlib.Path, backend: str, key: dict, sample: int = 1) -> dict | None:
    path = work / f"backend-{backend}{sample_suffix(sample)}.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved if saved.get("key") == key else None


def load_samples(work: pathlib.Path, backend: str, key: dict) -> list[dict]:
    """Every server sample of ``backend`` saved for this setup, in sample order."""
    numbers = [1] + sorted(int(m.group(1)) for p in work.glob(f"backend-{backend}-s*.json")
                           if (m := re.fullmatch(rf"backend-{re.escape(backend)}-s(\d+)\.json", p.name)))
    return [saved for k in numbers if (saved := load_backend(work, backend, key, k))]


# per point, the value of each of these is the median over the point's runs (servers x rounds)
MEDIAN_KEYS = ("request_throughput", "total_tok_s", "output_tok_s", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
               "p99_tpot_ms", "mean_itl_ms", "startup_s", "sm_clock_mhz_median", "sm_clock_mhz_min", "power_w_mean",
               "host_busy_pct", "host_steal_pct", "server_cpus", "engine_decode_tok_s")
SPREAD_KEYS = ("total_tok_s", "mean_ttft_ms", "mean_tpot_ms")


def median_rows(runs: list[dict]) -> list[dict]:
    """One row per (backend, workload, concurrency): the median of its successful runs, with
    ``runs`` (how many), ``failed_runs`` and ``spread`` (min and max of the throughput and latency
    means); a point whose every run failed keeps its first run's error."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["backend"], r["workload"], r["concurrency"]), []).append(r)
    out = []
    for group in groups.values():
        ok = [r for r in group if not r.get("error")]
        row = {k: v for k, v in (ok or group)[0].items() if k not in ("sample", "round")}
        row["runs"], row["failed_runs"] = len(ok), len(group) - len(ok)
        if ok:
            for k in MEDIAN_KEYS:
                vals = [r[k] for r in ok if r.get(k) is not None]
                row[k] = statistics.median(vals) if vals else None
            row["clock_limits"] = sorted({lim for r in ok for lim in (r.get("clock_limits") or [])})
            if len(ok) > 1:
                row["spread"] = {k: [min(r[k] for r in ok), max(r[k] for r in ok)] for k in SPREAD_KEYS
                                 if all(r.get(k) is not None for r in ok)}
                # the mean of all runs beside the median: servers of one backend differ by more than
                # its rounds do, and a backend with more servers weighs each of them the same way
                row["run_mean"] = {k: statistics.fmean(r[k] for r in ok) for k in row["spread"]}
        out.append(row)
    return out


def reference_backend(infos: list[dict], reference: str) -> str | None:
    """The backend agreement is measured against: ``reference`` when one of its servers has tokens,
    else the first built-in backend that has (a run of named backends only, without ``default``)."""
    have = [i["backend"] for i in infos if i.get("tokens")]
    for backend in (reference, "default", "flashinfer", "triton"):
        if backend in have:
            return backend
    return None


def finish_rows(rows: list[dict], infos: list[dict], reference: str) -> str | None:
    """agree_fraction of every backend and its rows: its server's greedy tokens against the
    reference backend's (``reference_backend``, which is returned)."""
    used = reference_backend(infos, reference)
    ref = next((i["tokens"] for i in infos if i["backend"] == used and i.get("tokens")), None)
    by_backend: dict[str, float | None] = {}
    for info in infos:
        info["agree_fraction"] = a = agree_fraction(ref, info.get("tokens"))
        if a is not None:  # a backend measured by several servers: its lowest
            prev = by_backend.get(info["backend"])
            by_backend[info["backend"]] = a if prev is None else min(prev, a)
        else:
            by_backend.setdefault(info["backend"], None)
    for r in rows:
        r["agree_fraction"] = by_backend.get(r["backend"])
        for k in ROW_KEYS:
            r.setdefault(k, None)
    return used


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else "unknown"


def versions(engine: str) -> dict:
    import importlib.metadata as md

    names = ["qla-serving", "torch", "triton", "tilelang", "apache-tvm-ffi", "flashinfer-python", "fla-core"]
    names.insert(0, "vllm" if engine == "vllm" else "sglang")
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = None
    return out


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def results_stem(gpu: str, engine: str, tp: int, tag: str = "") -> str:
    date = _dt.date.today().isoformat()
    return f"{date}-{slug(gpu)}-serve-{engine}-tp{tp}" + (f"-{tag}" if tag else "")


# ----------------------------------------------------------------------------- report


def markdown(meta: dict, rows: list[dict], runs: list[dict] | None = None) -> str:
    lines = [f"# Serving benchmark: {meta.get('engine')} TP {meta.get('tp')} on {meta.get('gpus')} x {meta.get('gpu')}",
             "", f"Model: {meta.get('model')}", "", f"Versions: {json.dumps(meta.get('versions'))}", "",
             f"Command: `{meta.get('command')}`", ""]
    if meta.get("backends"):
        # servers run side by side on GPUs of their own (serve-split) name their GPUs
        pinned = any(b.get("visible_gpus", "all") != "all" for b in meta["backends"])
        lines += ["| backend | resolved | start-up s | fallback | agreement with the reference | server capacity |"
                  + (" sample | GPUs |" if pinned else ""), "|---|---|---|---|---|---|" + ("---|---|" if pinned else "")]
        for b in meta["backends"]:
            cap = ", ".join(f"{k} {v}" for k, v in (b.get("capacity") or {}).items()) or "—"
            lines.append(f"| {b['backend']} | {b.get('resolved')} | {b.get('startup_s')} | {b.get('fallback')} | "
                         f"{b.get('agree_fraction')} | {cap} |"
                         + (f" {b.get('sample', 1)} | {b.get('visible_gpus', 'all')} |" if pinned else ""))
        distinct = meta.get("reference_distinct_tokens")
        lines += ["", f"Reference for agreement: {meta.get('reference')}; {meta.get('agreement')}"
                  + (f"; the reference's answers hold {distinct} distinct token(s) each (median)"
                     + (": one token repeated, so agreement says little about the state (--weights random)"
                        if distinct == 1 else "") if distinct is not None else "") + ".", ""]
    variants = [(o, None) for o in OURS] + [(o, "flashqla") for o in OURS if o != "flashqla"]
    for ours, versus in variants:
        ratios = against_best(rows, ours, versus)
        if not ratios:
            continue
        lines += [f"## {ours} against {versus or 'the best built-in backend'}", "",
                  f"Throughput over {versus}'s, latencies over {versus}'s." if versus else
                  "Throughput over the built-in backend with the highest total throughput (named), output "
                  "throughput over the highest built-in one, latencies over the lowest built-in ones.", "",
                  (f"| workload | conc | {versus or 'best built-in'} | total tok/s | output tok/s | mean TTFT | "
                   "mean TPOT | engine's decode tok/s |"), "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {a['workload']} | {a['concurrency']} | {a['best']} | {a['total_tok_s']:.3f}x | "
                  f"{a['output_tok_s']:.3f}x | {a['mean_ttft']:.3f}x | {a['mean_tpot']:.3f}x | "
                  f"{fmt(a.get('engine_decode_tok_s'), 3)}{'x' if a.get('engine_decode_tok_s') else ''} |" for a in ratios]
        lines.append("")
    paired = paired_ratios(runs or [])
    if paired:
        lines += ["## flashqla against each built-in backend, measured together", "",
                  "Each pair is one run of ours and one of the other backend in the same round of the same "
                  "lockstep run (`--lockstep`: servers side by side, every point at the same time, or in turns where "
                  "they share GPUs); a "
                  "server's absolute numbers move with the host, the pair's ratio much less. Medians over "
                  "the pairs (lowest-highest).", "",
                  "| workload | conc | versus | pairs | total tok/s | mean TTFT | mean TPOT | engine's decode tok/s |",
                  "|---|---|---|---|---|---|---|---|"]
        rng = lambda a: f"{a['median']:.3f}x ({a['min']:.3f}-{a['max']:.3f})" if a else "—"  # noqa: E731
        lines += [f"| {a['workload']} | {a['concurrency']} | {a['versus']} | {a['pairs']} | {rng(a['total_tok_s'])} | "
                  f"{rng(a['mean_ttft'])} | {rng(a['mean_tpot'])} | {rng(a.get('engine_decode_tok_s'))} |" for a in paired]
        if any(a.get("engine_decode_tok_s") for a in paired):
            lines.append("")
            lines.append("Engine's decode tok/s: the engine's own generation throughput lines (SGLang every 40 decode "
                         "steps, vLLM every 10 s) while it held the point's concurrency, median per run: the "
                         "steps' pace without the client's ramp-up and tail.")
        lines.append("")
    lines += profiles_markdown(meta)
    lines += bound_markdown(meta, rows, runs)
    spread = [r for r in rows if r.get("spread")]
    if spread:
        lines += ["## Spread over runs", "",
                  f"Each point above is the median of its runs: {meta.get('repeats', 1)} per server, "
                  f"servers per backend {json.dumps(meta.get('server_samples'))}.", "",
                  ("| backend | workload | conc | runs (failed) | total tok/s min-max (mean) | "
                   "mean TTFT ms min-max (mean) | mean TPOT ms min-max (mean) |"), "|---|---|---|---|---|---|---|"]

        def rng(r, k, d):
            if k not in r["spread"]:
                return "—"
            mean = (r.get("run_mean") or {}).get(k)
            return "-".join(f"{v:.{d}f}" for v in r["spread"][k]) + ("" if mean is None else f" ({mean:.{d}f})")
        for r in spread:
            lines.append(f"| {r['backend']} | {r['workload']} | {r['concurrency']} | {r['runs']} ({r['failed_runs']}) | "
                         f"{rng(r, 'total_tok_s', 0)} | {rng(r, 'mean_ttft_ms', 1)} | {rng(r, 'mean_tpot_ms', 2)} |")
        lines.append("")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        sub = [r for r in rows if r["workload"] == workload]
        lines += [f"## {workload} ({sub[0]['input_len']} in / {sub[0]['output_len']} out)", "",
                  "| backend | conc | prompts | total tok/s | output tok/s | req/s | mean TTFT ms | p99 TTFT ms | "
                  "mean TPOT ms | p99 TPOT ms | agree | SM MHz median (min) | power W | clock limits | "
                  "host busy % (steal) | server CPUs | engine's decode tok/s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(sub, key=lambda r: (r["concurrency"], r["backend"])):
            if r.get("error"):
                lines.append(f"| {r['backend']} | {r['concurrency']} | {r.get('num_prompts')} | failed: "
                             f"{r['error'][:80]} | | | | | | | | | | | | | |")
                continue
            lines.append(f"| {r['backend']} | {r['concurrency']} | {r['num_prompts']} | {fmt(r['total_tok_s'], 0)} | "
                         f"{fmt(r['output_tok_s'], 0)} | {fmt(r['request_throughput'], 2)} | "
                         f"{fmt(r['mean_ttft_ms'])} | {fmt(r['p99_ttft_ms'])} | {fmt(r['mean_tpot_ms'], 2)} | "
                         f"{fmt(r['p99_tpot_ms'], 2)} | {fmt(r['agree_fraction'], 3)} | "
                         f"{fmt(r.get('sm_clock_mhz_median'), 0)} ({fmt(r.get('sm_clock_mhz_min'), 0)}) | "
                         f"{fmt(r.get('power_w_mean'), 0)} | {', '.join(r.get('clock_limits') or []) or '—'} | "
                         f"{fmt(r.get('host_busy_pct'), 0)} ({fmt(r.get('host_steal_pct'), 1)}) | "
                         f"{fmt(r.get('server_cpus'), 2)} | {fmt(r.get('engine_decode_tok_s'), 0)} |")
        lines.append("")
    return "\n".join(lines)


def profiles_markdown(meta: dict) -> list[str]:
    """The profiled servers side by side (``--profile``): GPU and host time per step, first rank."""
    profiled = [b for b in meta.get("backends") or [] if (b.get("profile") or {}).get("trace")]
    if not profiled:
        return []
    scopes = list(dict.fromkeys(k for b in profiled for k in b["profile"].get("host_ms_per_step") or {}))
    label = lambda b: b["backend"] + (f" (sample {b['sample']})" if b.get("sample", 1) != 1 else "")  # noqa: E731
    lines = [f"## Profiles ({meta.get('profile')}, ms per step, first rank)", "",
             "GPU: kernel time, the span from the first kernel to the last and its time with no kernel "
             "running, the GDN recurrence (prefill and decode). Host: the median period from one step's "
             "start to the next and vLLM's model-runner scopes.", "",
             "| backend | GPUs | kernels | GPU span | no kernel | GDN recurrence | step period | "
             + " | ".join(scopes) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(scopes)]
    for b in profiled:
        pr = b["profile"]
        rec = sum(v for k, v in (pr.get("gdn_ms_per_step") or {}).items() if k.startswith("recurrence"))
        host = pr.get("host_ms_per_step") or {}
        lines.append(f"| {label(b)} | {b.get('visible_gpus', 'all')} | {fmt(pr.get('kernel_ms_per_step'), 3)} | "
                     f"{fmt(pr.get('gpu_span_ms_per_step'), 3)} | {fmt(pr.get('no_kernel_ms_per_step'), 3)} | {fmt(rec, 3)} | "
                     f"{fmt(pr.get('step_period_ms'), 3)} | " + " | ".join(fmt(host.get(k), 3) for k in scopes) + " |")
    kinds = [(b, kind, d) for b in profiled for kind, d in (b["profile"].get("steps_by_kind") or {}).items()]
    if kinds:  # the window's steps with a GDN prefill and those without, told apart
        lines += ["", ("| backend | steps (median per step) | count | period | kernels | GDN recurrence | "
                       "collectives | GPU span |"), "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {label(b)} | {kind} | {d['steps']} | {fmt(d.get('period_ms'), 3)} | {fmt(d.get('kernel_ms'), 3)} | "
                  f"{fmt(d.get('recurrence_ms'), 3)} | {fmt(d.get('comm_ms'), 3)} | {fmt(d.get('span_ms'), 3)} |"
                  for b, kind, d in kinds]
    # the calls that take the most host time on any server (each server's first 8), every server's cell
    calls = list(dict.fromkeys(k for b in profiled for k in list(b["profile"].get("runtime_per_step") or {})[:8]))
    if calls:
        lines += ["", "| CUDA runtime call: host ms (calls) per step | " + " | ".join(label(b) for b in profiled)
                  + " |", "|---|" + "---|" * len(profiled)]
        for c in calls:
            cells = []
            for b in profiled:
                v = (b["profile"].get("runtime_per_step") or {}).get(c)
                cells.append("—" if v is None else f"{v[0]:.3f} ({v[1]:.1f})")
            lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
    return lines + [""]


BOUND_MIN = 1.01  # below it, a point's own noise is larger than what the kernels allow


def _kind_gdn_ms(pr: dict) -> dict[str, float] | None:
    """A profile's GDN kernel time per step of each kind ("with prefill", "decode only") and the
    count of each in its window: the recurrence per kind as measured, the other GDN parts (conv,
    preparation: token-proportional, so a prefill's) on the prefill steps. None without both kinds."""
    kinds = pr.get("steps_by_kind") or {}
    p, d = kinds.get("with prefill"), kinds.get("decode only")
    if not p or not d or not p.get("steps") or p.get("recurrence_ms") is None or d.get("recurrence_ms") is None:
        return None
    steps = p["steps"] + d["steps"]
    parts = pr.get("gdn_ms_per_step") or {}
    other = sum(v for k, v in parts.items() if not k.startswith("recurrence")) * steps
    return {"prefill": p["recurrence_ms"] + other / p["steps"], "decode": d["recurrence_ms"],
            "prefill_steps": p["steps"]}


def request_bound(mine: list[dict], theirs: list[dict], row: dict | None, chunk: int | None) -> dict | None:
    """At concurrency 1, what the GDN kernels allow for one request of the point: its prefill chunks
    and decode steps (``output_len - 1``), each saving what ours saves on a step of that kind (the
    profiles' steps by kind, median over a backend's servers), taken off the other backend's measured
    request (mean TTFT plus the decode steps at its mean TPOT): ``bound = request / (request - saved)``,
    and the TTFT it allows, ``(ttft - saved in the prefill) / ttft``. The chunk count is the prompt
    over the engine's chunk size where the results hold it (SGLang's), else the profile window's
    prefill steps (the window starts with the request and, holding both kinds, reached its decode).
    The step bound weighs steps as the profile window holds them (20 steps of a 260-step request are
    a fifth prefill); this one as the request does. None without both kinds in both profiles."""
    if row is None or not mine or not theirs:
        return None
    m, t = [k for k in map(_kind_gdn_ms, mine) if k], [k for k in map(_kind_gdn_ms, theirs) if k]
    if not m or not t or None in (row.get("mean_ttft_ms"), row.get("mean_tpot_ms"), row.get("output_len")):
        return None
    def med(ks: list[dict], f: str) -> float:
        return statistics.median(k[f] for k in ks)

    chunks = med(t, "prefill_steps") if chunk is None else -(-row["input_len"] // chunk)
    saved_prefill = chunks * (med(t, "prefill") - med(m, "prefill"))
    saved = saved_prefill + (row["output_len"] - 1) * (med(t, "decode") - med(m, "decode"))
    request = row["mean_ttft_ms"] + (row["output_len"] - 1) * row["mean_tpot_ms"]
    ttft = row["mean_ttft_ms"]
    return {"chunks": chunks, "saved_request_ms": saved, "request_ms": request,
            "bound_request": request / (request - saved) if request > saved else None,
            "bound_ttft": (ttft - saved_prefill) / ttft if ttft > saved_prefill else None}


def kernel_bound(meta: dict, rows: list[dict], runs: list[dict] | None = None, ours: str = "flashqla") -> list[dict]:
    """What the GDN kernels allow at the profiled point (``--profile``), per built-in backend with a
    profile beside ours: the GDN kernel time per step ours saves against it, taken off its step,
    ``bound = step / (step - saved)``, once with its step period (what a step took) and once with
    its GPU kernel time alone (the most a purely GPU-bound step could gain); beside them the gain
    measured at that point (the paired median where measured together, else the medians' ratio)
    and the share of the step-period bound it reached. Each value is the median over the servers
    of a backend; the first rank's profile."""
    if not meta.get("profile"):
        return []
    workload, conc = meta["profile"].split(":")
    conc = int(conc)
    profiles: dict[str, list[dict]] = {}
    for b in meta.get("backends") or []:
        if (b.get("profile") or {}).get("trace"):
            profiles.setdefault(b["backend"] if b["backend"] in OURS else b.get("resolved") or b["backend"], []).append(b["profile"])
    if ours not in profiles:
        return []

    def med(prs: list[dict], f) -> float | None:
        vals = [v for v in map(f, prs) if v is not None]
        return statistics.median(vals) if vals else None

    gdn = lambda pr: sum((pr.get("gdn_ms_per_step") or {}).values())  # noqa: E731
    host = lambda pr: (pr.get("gdn_op_host_us") or {}).get("median")  # noqa: E731
    paired = {a["versus"]: a["total_tok_s"]["median"] for a in paired_ratios(runs or [], ours)
              if (a["workload"], a["concurrency"]) == (workload, conc)}
    point = {(r.get("backend_resolved") or r["backend"]): r for r in rows
             if (r["workload"], r["concurrency"]) == (workload, conc) and not r.get("error")}
    mine, mine_host = med(profiles[ours], gdn), med(profiles[ours], host)
    out = []
    for versus, prs in profiles.items():
        if versus in OURS:
            continue
        theirs = med(prs, gdn)
        saved = theirs - mine
        step, kernels = med(prs, lambda pr: pr.get("step_period_ms")), med(prs, lambda pr: pr.get("kernel_ms_per_step"))
        bound = lambda t: t / (t - saved) if t is not None and t > saved else None  # noqa: E731
        if versus in paired:
            measured, how = paired[versus], "paired"
        elif ours in point and versus in point:
            measured, how = point[ours]["total_tok_s"] / point[versus]["total_tok_s"], "medians"
        else:
            measured, how = None, None
        b_step = bound(step)
        chunk = next((b["capacity"].get("chunked_prefill_size") for b in meta.get("backends") or []
                      if (b.get("resolved") or b["backend"]) == versus and b.get("capacity")), None)
        per_request = request_bound(profiles[ours], prs, point.get(versus), chunk) if conc == 1 else None
        # the share is of the bound that weighs the point's own steps: its requests' where known
        b_share = (per_request or {}).get("bound_request") or b_step
        out.append({"workload": workload, "concurrency": conc, "versus": versus,
                    "gdn_ms_ours": mine, "gdn_ms_versus": theirs, "saved_ms": saved,
                    "gdn_host_us_ours": mine_host, "gdn_host_us_versus": med(prs, host),
                    "step_ms": step, "kernel_ms": kernels, "bound_step": b_step, "bound_gpu": bound(kernels),
                    **({"bound_request": None, "bound_ttft": None} | (per_request or {})),
                    "measured": measured, "measured_from": how,
                    "measured_ttft": (point[ours]["mean_ttft_ms"] / point[versus]["mean_ttft_ms"]
                                      if ours in point and versus in point else None),
                    "bound_of_share": b_share,
                    # a bound under 1% is below what one point can resolve: no share of it
                    "reached": None if measured is None or b_share is None or b_share < BOUND_MIN
                    else (measured - 1) / (b_share - 1)})
    return out


def bound_markdown(meta: dict, rows: list[dict], runs: list[dict] | None = None) -> list[str]:
    """``kernel_bound``'s table (nothing without profiles of ours and a built-in backend)."""
    bounds = kernel_bound(meta, rows, runs)
    if not bounds:
        return []
    lines = [f"## What the GDN kernels allow ({meta['profile']})", "",
             "GDN kernel time per step (ms, first rank, median over a backend's servers) from the profiles; "
             "the time ours saves taken off the other backend's step period (bound) and off its GPU kernel "
             "time alone (GPU-only bound, the most a step with no host time could gain); at concurrency 1 the "
             "same for one request of the point (request bound: its prefill chunks and decode steps each saving "
             "what ours saves on a step of that kind, taken off the other backend's measured request, TTFT "
             "plus decode; TTFT bound: the lowest TTFT ratio the prefill's saving allows); the measured gain in "
             "total tok/s at this point (paired: measured together; medians: each backend's median), its TTFT "
             "ratio, and the share of the bound it reached (of the request bound where there is one). GDN host "
             "us: our op's host time per layer call (none where the step replays a CUDA graph).", "",
             "| versus | GDN ms ours | GDN ms theirs | saved ms | their step ms | their kernels ms | bound | "
             "GPU-only bound | request bound | TTFT bound | measured | measured TTFT | share of the bound | "
             "GDN host us ours / theirs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    x = lambda v: "—" if v is None else f"{v:.3f}x"  # noqa: E731
    for a in bounds:
        share = (f"{100 * a['reached']:.0f}%" if a["reached"] is not None
                 else "bound under 1%" if a["bound_of_share"] is not None and a["bound_of_share"] < BOUND_MIN
                 else "—")
        lines.append(f"| {a['versus']} | {fmt(a['gdn_ms_ours'], 3)} | {fmt(a['gdn_ms_versus'], 3)} | {fmt(a['saved_ms'], 3)} | "
                     f"{fmt(a['step_ms'], 3)} | {fmt(a['kernel_ms'], 3)} | {x(a['bound_step'])} | {x(a['bound_gpu'])} | "
                     f"{x(a.get('bound_request'))} | {x(a.get('bound_ttft'))} | "
                     f"{x(a['measured'])}{'' if a['measured_from'] is None else ' (' + a['measured_from'] + ')'} | "
                     f"{x(a.get('measured_ttft'))} | {share} | "
                     f"{fmt(a['gdn_host_us_ours'], 1)} / {fmt(a['gdn_host_us_versus'], 1)} |")
    return lines + [""]


def paired_ratios(runs: list[dict], ours: str = "flashqla") -> list[dict]:
    """``ours`` over each built-in backend per point, from runs measured together: the same
    lockstep run and round (every pair of such runs, ours against the other)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r.get("lockstep") and not r.get("error"):
            groups.setdefault((r["workload"], r["concurrency"], r["lockstep"], r.get("round", 1)), []).append(r)
    pairs: dict[tuple, list[dict]] = {}
    for (w, c, _, _), group in groups.items():
        for mine in (r for r in group if r["backend"] == ours):
            for other in (r for r in group if r["backend"] not in OURS):
                ratio = {"total_tok_s": mine["total_tok_s"] / other["total_tok_s"],
                         "mean_ttft": mine["mean_ttft_ms"] / other["mean_ttft_ms"],
                         "mean_tpot": mine["mean_tpot_ms"] / other["mean_tpot_ms"]}
                if mine.get("engine_decode_tok_s") and other.get("engine_decode_tok_s"):
                    ratio["engine_decode_tok_s"] = mine["engine_decode_tok_s"] / other["engine_decode_tok_s"]
                pairs.setdefault((w, c, other.get("backend_resolved") or other["backend"]), []).append(ratio)
    out = []
    for (w, c, versus), vals in pairs.items():
        stats = {}
        for name in ("total_tok_s", "mean_ttft", "mean_tpot", "engine_decode_tok_s"):
            xs = [v[name] for v in vals if name in v]
            if xs:
                stats[name] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "pairs": len(xs)}
        out.append({"workload": w, "concurrency": c, "versus": versus, "pairs": len(vals), **stats})
    return out


def against_best(rows: list[dict], ours: str = "flashqla", versus: str | None = None) -> list[dict]:
    """Per workload and concurrency: ``ours`` over the best built-in backend (highest total
    throughput) on throughput, over the lowest built-in TTFT/TPOT on latency, and over the highest
    built-in engine decode rate where the rows have one; with ``versus``, over that backend's rows
    instead (an A/B of two of ours)."""
    out = []
    ok = [r for r in rows if not r.get("error")]
    for w, c in dict.fromkeys((r["workload"], r["concurrency"]) for r in ok):
        pt = [r for r in ok if (r["workload"], r["concurrency"]) == (w, c)]
        mine = next((r for r in pt if r["backend"] == ours), None)
        built_in = [r for r in pt if (r["backend"] == versus if versus else r["backend"] not in OURS)]
        if mine is None or not built_in:
            continue
        best = max(built_in, key=lambda r: r["total_tok_s"])
        name = lambda r: r.get("backend_resolved") or r["backend"]  # noqa: E731
        out.append({"workload": w, "concurrency": c, "best": name(best),
                    "total_tok_s": mine["total_tok_s"] / best["total_tok_s"],
                    "output_tok_s": mine["output_tok_s"] / max(r["output_tok_s"] for r in built_in),
                    "mean_ttft": mine["mean_ttft_ms"] / min(r["mean_ttft_ms"] for r in built_in),
                    "mean_tpot": mine["mean_tpot_ms"] / min(r["mean_tpot_ms"] for r in built_in)})
        rates = [r["engine_decode_tok_s"] for r in built_in if r.get("engine_decode_tok_s")]
        if mine.get("engine_decode_tok_s") and rates:  # over the highest built-in engine rate
            out[-1]["engine_decode_tok_s"] = mine["engine_decode_tok_s"] / max(rates)
    return out


def plot(meta: dict, rows: list[dict], stem: pathlib.Path) -> list[str]:
    """One PNG per workload: total tok/s and mean TTFT against concurrency, a line per backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plots (run `python -m e2e_bench.serve report FILE.json` elsewhere)")
        return []
    written = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for backend in dict.fromkeys(r["backend"] for r in rows):
            pts = sorted((r["concurrency"], r["total_tok_s"], r["mean_ttft_ms"]) for r in rows
                         if r["workload"] == workload and r["backend"] == backend and not r.get("error"))
            if not pts:
                continue
            c, tok, ttft = zip(*pts)
            resolved = next((r.get("backend_resolved") for r in rows if r["backend"] == backend), None)
            label = f"{backend} ({resolved})" if resolved and resolved != backend else backend
            ax1.plot(c, tok, marker="o", label=label)
            ax2.plot(c, ttft, marker="o", label=backend)
        for ax, title in ((ax1, "total throughput (tok/s)"), (ax2, "mean TTFT (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        ax1.legend()
        fig.suptitle(f"{meta.get('engine')} TP{meta.get('tp')} {workload} {WORKLOADS[workload]} · "
                     f"{meta.get('model_name')} · {meta.get('gpu')}", fontsize=9)
        fig.tight_layout()
        path = f"{stem}-{workload}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def write_results(out_dir: pathlib.Path, stem: str, meta: dict, rows: list[dict],
                  runs: list[dict] | None = None) -> pathlib.Path:
    """``rows``: one per point (the median of its runs); ``runs``: every run, when a point has several."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    data = {"meta": meta, "rows": rows, **({"runs": runs} if runs else {})}
    path.write_text(json.dumps(data, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(meta, rows, runs) + "\n")
    plot(meta, rows, out_dir / stem)
    return path


# ----------------------------------------------------------------------------- CLI


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m e2e_bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--model", default="qwen3.5-397b-a17b", help="a name in e2e_bench/models/")
    p.add_argument("--layers", type=int, default=4, help="layers kept (a multiple of the full-attention interval)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(DEFAULT_BACKENDS),
                   help="'default' is the engine's own choice, resolved from its log and recorded by name; "
                        "an explicit backend equal to it is not run twice")
    p.add_argument("--reference", default="default", choices=BACKENDS, help="agree_fraction is measured against it")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    # a concurrency-1 point of four requests spans 16-54% in TPOT between runs of one backend
    # (docs/e2e.md, "Side by side"): eight is the least that ranks anything there
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--warmups", type=int, default=4, help="client warm-up requests per point (at most the concurrency)")
    p.add_argument("--server-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="before the first point, run the first workload at the highest concurrency once, unmeasured")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every point this many times per server (all points once per round); the "
                        "results give each point's median and its spread")
    p.add_argument("--server-sample", type=int, default=1, metavar="K",
                   help="this call's server is sample K of its backends: the calls of samples 1..K add up "
                        "in the work directory, and each point's median is over every sample's runs")
    p.add_argument("--agree-prompts", type=int, default=8)
    p.add_argument("--agree-tokens", type=int, default=64)
    p.add_argument("--max-len", type=int, default=0, help="max model length (default: the longest workload + 1024)")
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--start-timeout", type=float, default=480)
    p.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: none); points past it are left out")
    p.add_argument("--server-arg", action="append", default=[], help="one more server argument (repeatable)")
    add_weights_argument(p)
    add_allreduce_fusion_argument(p)
    p.add_argument("--profile", default="", metavar="WORKLOAD:CONC",
                   help="run this point once more under the engine's torch profiler (a window of --profile-steps "
                        "steps: vLLM's after --profile-delay, SGLang's from the point's first step) and summarise "
                        "the traces (e2e_bench/trace_summary.py)")
    p.add_argument("--profile-delay", type=int, default=None, help="vLLM only (default 40)")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--lockstep", default="", metavar="ID:N[:turns]",
                   help="one of N servers side by side (serve-split sets it): wait for the others before the "
                        "warm-up, each point and the profile, so that all measure at the same time; with "
                        ":turns (servers sharing GPUs) one after another, the order rotating by point")
    p.add_argument("--tag", default="")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--work-dir", default="", help="servers' logs, client results and each backend's rows; "
                   "default /tmp/qla-serve-<engine>-<model>-tp<N>, so calls of one backend each add up")
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands; start nothing")
    p.add_argument("--collect", action="store_true",
                   help="start nothing: write the results of what the work directory holds for this setup "
                        "(the servers of calls run side by side, one per GPU: scripts/gpu_session.sh serve-split)")
    args = p.parse_args(argv)
    for c in args.concurrency:
        if c < 1:
            p.error(f"--concurrency {c}: must be >= 1")
    if args.tp < 1:
        p.error(f"--tp {args.tp}: must be >= 1")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be >= 1")
    if args.server_sample < 1:
        p.error(f"--server-sample {args.server_sample}: must be >= 1")
    if args.profile_delay is not None and args.engine == "sglang":
        # (SGLang's start_step counts forward steps from the server's start, not the point's)
        p.error("--profile-delay: SGLang's window starts at the profiled point's first step")
    if args.profile_delay is None:
        args.profile_delay = 40 if args.engine == "vllm" else 0
    return args


def report(paths: list[str]) -> int:
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        stem = pathlib.Path(path).with_suffix("")
        # files written before the rows kept their runs' mean get it from their runs
        means = {(r["backend"], r["workload"], r["concurrency"]): r["run_mean"]
                 for r in median_rows(data.get("runs") or []) if r.get("run_mean")}
        for r in data["rows"]:
            r.setdefault("run_mean", means.get((r["backend"], r["workload"], r["concurrency"])))
        stem.with_suffix(".md").write_text(markdown(data["meta"], data["rows"], data.get("runs")) + "\n")
        for png in plot(data["meta"], data["rows"], stem):
            log(f"wrote {png}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":
        return report(argv[1:])
    args = parse_args(argv)
    args.server_arg = args.server_arg + allreduce_fusion_args(args.engine, args.tp, args.allreduce_fusion)
    spec = model_spec(args.model)
    max_len = args.max_len or max(i + o for i, o in (WORKLOADS[w] for w in args.workloads)) + 1024
    work = pathlib.Path(args.work_dir or f"/tmp/qla-serve-{args.engine}-{args.model}-tp{args.tp}")
    work.mkdir(parents=True, exist_ok=True)
    s = Setup(args.engine, tp=args.tp, max_len=max_len, port=args.port,
              **engine_model(spec, args.engine, args.layers, max_len, work / "model"))
    backends = list(dict.fromkeys(args.backends))
    if args.reference in backends:  # the reference first: its tokens are what the others are compared to
        backends.remove(args.reference)
        backends.insert(0, args.reference)
    gdn_layers = layer_types(args.layers, spec["full_attention_interval"]).count("linear_attention")
    model_text = (f"{spec['name']} per-layer shapes ({spec['source']}), {args.layers} of {spec['num_hidden_layers']} "
                  f"layers ({gdn_layers} GDN), GDN heads {spec['linear_num_key_heads']}/{spec['linear_num_value_heads']} "
                  f"({spec['linear_num_key_heads'] // args.tp}/{spec['linear_num_value_heads'] // args.tp} per rank), "
                  f"{spec['num_experts']} experts top-{spec['num_experts_per_tok']}, {args.weights} weights with GDN gates "
                  f"re-drawn, state dtype {spec.get('state_dtype') or 'engine default'}")
    log(f"CPUs: {cpu_set()}")
    if args.dry_run:
        log(f"model: {model_text}")
        if args.lockstep:
            Lockstep(args.lockstep, work, "dry-run")  # a malformed spec fails here, not after start-up
            log(f"lockstep: {args.lockstep}")
        for b in backends:
            print(shlex.join(server_command(s, b, args.server_arg)))
        for w in args.workloads:
            for c in args.concurrency:
                n = num_prompts(c, args.prompts_per_concurrency, args.min_prompts)
                print(shlex.join(client_command(s, w, c, n, str(work / f"client-{w}-c{c}.json"),
                                                warmups=min(c, args.warmups))))
        return 0
    start = time.monotonic()
    budget_end = start + args.budget if args.budget else float("inf")
    prompts = agreement_prompts(args.agree_prompts, 200, 4000, seed=1) if args.agree_prompts else []
    gpu = gpu_name()
    # calls add up only for the same setup and points (a backend's file holds its latest call)
    key = {"engine": args.engine, "model": args.model, "layers": args.layers, "tp": args.tp, "gpu": gpu,
           "workloads": args.workloads, "concurrency": args.concurrency, "server_args": args.server_arg,
           "repeats": args.repeats}
    if args.weights != "dummy":  # (keys of runs before the choice stay valid)
        key["weights"] = args.weights
    command = shlex.join(["python", "-m", "e2e_bench.serve", *argv])
    for backend in [] if args.collect else backends:
        resolved_default = (load_backend(work, "default", key) or {}).get("info", {}).get("resolved")
        if backend != "default" and backend == resolved_default:
            log(f"skip {backend}: it is the engine's default, measured as 'default'")
            continue
        if time.monotonic() > budget_end:
            log(f"budget spent: {backend} not started")
            save_backend(work, key, [], {"backend": backend, "sample": args.server_sample,
                                         "error": "left out (budget)", "call": command})
            continue
        r, info = run_backend(s, backend, args, work, prompts, budget_end)
        info["call"] = command
        save_backend(work, key, r, info)
    # every backend measured into this work directory for the same setup, this call's and earlier
    # calls' (a run split over several commands, one server each)
    runs, infos = [], []
    for backend in BACKENDS:
        for saved in load_samples(work, backend, key):
            if backend == "default":
                for row in saved["rows"]:
                    row["backend_resolved"] = saved["info"].get("resolved")
            runs += saved["rows"]
            infos.append(saved["info"])
    if args.collect and not infos:
        log(f"--collect: {work} holds no backend measured for this setup")
        return 1
    reference = finish_rows(runs, infos, args.reference)
    if reference != args.reference:
        log(f"agreement: no server of the reference backend {args.reference!r} has tokens; "
            + (f"measured against {reference!r}" if reference else "not measured"))
    rows = median_rows(runs)
    meta = {
        "gpu": gpu, "gpus": args.tp, "engine": args.engine, "tp": args.tp, "versions": versions(args.engine),
        "model": model_text, "model_name": spec["name"],
        "command": command, "calls": list(dict.fromkeys(i.get("call") for i in infos if i.get("call"))),
        "server_commands": {i["backend"]: i.get("command") for i in infos},
        "backends": [{k: v for k, v in i.items() if k not in ("tokens", "command", "call")} for i in infos],
        "reference": reference or f"{args.reference} (not run: no agreement)", "agreement": f"{args.agree_prompts} prompts of 200-4000 tokens x "
                                                   f"{args.agree_tokens} greedy tokens, one request at a time",
        "reference_distinct_tokens": distinct_tokens(next((i["tokens"] for i in infos if i["backend"] == reference
                                                           and i.get("tokens")), [])),
        "prompts": f"max({args.min_prompts}, {args.prompts_per_concurrency} x concurrency) per point, "
                   f"{args.warmups} warm-up requests (at most the concurrency)",
        "repeats": args.repeats, "profile": args.profile or None,
        "server_warmup": (f"{args.workloads[0]} at concurrency {max(args.concurrency)}, {max(args.concurrency)} prompts, "
                          "once per server, unmeasured"
                          if args.server_warmup else "none"),
        "server_samples": {b: n for b in BACKENDS if (n := sum(i["backend"] == b for i in infos))},
        "wall_s": round(time.monotonic() - start, 1),
    }
    (work / "tokens.json").write_text(json.dumps({i["backend"]: i.get("tokens") for i in infos}))
    path = write_results(pathlib.Path(args.out_dir), results_stem(gpu, args.engine, args.tp, args.tag), meta, rows,
                         runs if len(runs) > len(rows) else None)
    log(f"wrote {path}")
    failed = [i["backend"] for i in infos if i.get("error")] + [r["backend"] for r in rows if r.get("error")]
    return 1 if failed else 0


def exit_on_sigterm() -> None:
    """A SIGTERM (a command's time limit) ends the run through its ``finally`` blocks, which stop the
    servers: they run in sessions of their own and would outlive the run otherwise."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
