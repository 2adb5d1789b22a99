"""The inputs both offline acceptance runs share (``vllm_offline.py``, ``sglang_offline.py``):
the config of a small Qwen3.5-shaped model and the prompt sets, as token ids (no tokenizer)."""

from __future__ import annotations

import json
import os
import pathlib
import random


def model_config(num_layers: int = 8, linear_v_heads: int = 32, hidden: int = 1024, vocab: int = 8192,
                 max_positions: int = 16384, state_dtype: str = "float32") -> dict:
    """The config.json of a small Qwen3.5-shaped model (``Qwen3_5ForConditionalGeneration``).

    The GDN layers have the production head layout (16 q/k heads, ``linear_v_heads`` value
    heads, head dims 128); every fourth layer is full attention (head dim 256, partial M-RoPE as
    in Qwen3.5). Hidden size, MLP and vocabulary are small. vLLM serves only the language model
    (``language_model_only=True``); the vision tower is the smallest transformers accepts.
    ``state_dtype`` is ``mamba_ssm_dtype``, which vLLM 0.26+ turns into the recurrent-state
    cache dtype of a Qwen3.5 model (``float32`` as in the released checkpoints; without it the
    cache would take the activation dtype).
    """
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": num_layers, "layer_types": layer_types,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": linear_v_heads,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": max_positions,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "bos_token_id": None, "eos_token_id": vocab - 1, "pad_token_id": None, "dtype": "bfloat16",
        "mamba_ssm_dtype": state_dtype,
    }
    vision = {
        "model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 64, "num_heads": 2,
        "intermediate_size": 128, "out_hidden_size": hidden, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
        # Special ids at the top of the small vocabulary; prompts never use them.
        "image_token_id": vocab - 4, "video_token_id": vocab - 3,
        "vision_start_token_id": vocab - 6, "vision_end_token_id": vocab - 5,
    }


def write_model(directory: str | os.PathLike, **shape) -> str:
    """Write ``config.json`` (and nothing else: dummy weights, no tokenizer) into ``directory``."""
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config(**shape), indent=1) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- prompts

PROMPT_ID_LIMIT = 16  # prompts use ids in [0, vocab - PROMPT_ID_LIMIT): no special ids


def add_prompt_args(parser) -> None:
    """The arguments of the agreement prompt set (:func:`agreement_prompts`), one definition for both
    offline runs, so that by default they send the same prompts."""
    parser.add_argument("--seed", type=int, default=0, help="prompts and engine (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=17)
    parser.add_argument("--max-len", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default: %(default)s)")


def agreement_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids with lengths spread over ``[min_len, max_len]``.

    Lengths are log-spaced with jitter (short and long prompts both present, the extremes
    included). Every second prompt of the second half repeats the first 1024 tokens of a
    first-half prompt (where both are long enough), so prefix caching has prefixes to hit.
    """
    rng = random.Random(seed)
    hi = vocab - PROMPT_ID_LIMIT
    lengths = []
    for i in range(n):
        if n == 1:
            lengths.append(max_len)
            continue
        base = min_len * (max_len / min_len) ** (i / (n - 1))
        jitter = 1.0 if i in (0, n - 1) else rng.uniform(0.85, 1.15)
        lengths.append(max(min_len, min(max_len, round(base * jitter))))
    rng.shuffle(lengths)
    prompts = [[rng.randrange(hi) for _ in range(length)] for length in lengths]
    half = n // 2
    for j in range(half, n, 2):
        src = prompts[j - half]
        shared = min(1024, len(src), len(prompts[j]) - 1)
        if shared >= 256:
            prompts[j][:shared] = src[:shared]
    return prompts


def throughput_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = vocab - PROMPT_ID_LIMIT
    return [[rng.randrange(hi) for _ in range(length)] for _ in range(n)]
