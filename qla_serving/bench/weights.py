"""Random weights whose greedy outputs depend on the GDN state: what the stress harness's oracle
compares with ``QLA_BENCH_WEIGHTS=random``.

The engines' dummy loaders fill every parameter with U(-1e-3, 1e-3). Pre-norm layers whose
weights are that small add almost nothing to the residual, and the GDN layers' gated RMSNorm
(output = norm(o) * weight) scales their output by ~1e-3 on top: the served model's greedy tokens
are one token repeated, fixed by the prompt (docs/e2e.md, "What agreement on dummy weights
shows"), so a GDN state carried wrongly from step to step could go unseen. This re-draws the weights
the way a freshly initialised transformer has them (Hugging Face's ``initializer_range`` 0.02),
with norms at their identity value, so every layer, the GDN layers included, moves the residual and
each step's token depends on the state it reads.

Deterministic in each parameter's name and shape, so every backend's server of one engine, model
and tensor-parallel size holds the same weights (each rank of a sharded parameter gets the same
values: a valid random model, the same for every backend).
"""

from __future__ import annotations

#: the environment variable the engines' dummy-weight hooks read (vLLM's ``qla_dummy`` load format,
#: SGLang's ``--load-format dummy`` through the plugin)
WEIGHTS_ENV = "QLA_BENCH_WEIGHTS"
#: standard deviation of every weight matrix, embedding and expert (``initializer_range``)
WEIGHT_STD = 0.02
#: fan-in below which a weight is a short filter (the GDN depthwise conv: width 4), drawn
#: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as torch initialises convolutions, so it passes its input on
SHORT_FAN_IN = 64
#: values drawn per slice (float32 temporaries of 256 MiB at most)
CHUNK_VALUES = 1 << 26


def random_weights_requested() -> bool:
    """Whether ``QLA_BENCH_WEIGHTS=random`` asks for :func:`init_random_weights`."""
    import os

    value = os.environ.get(WEIGHTS_ENV, "dummy").strip().lower()
    if value not in ("dummy", "random"):
        raise ValueError(f"{WEIGHTS_ENV}={value!r}: expected 'dummy' (the engine's) or 'random'")
    return value == "random"


def _norm_value(module) -> float | None:
    """The identity value of a norm module's 1-D weight: 0 for zero-centred (Gemma-style,
    ``x * (1 + w)``) norms, 1 for the others (``x * w``); None for a module that is no norm."""
    name = type(module).__name__
    if "Norm" not in name:
        return None
    return 0.0 if "Gemma" in name else 1.0


def init_random_weights(model) -> dict:
    """Re-draw every floating-point parameter of ``model`` (an ``nn.Module``) in place, except the
    GDN gates (``A_log``, ``dt_bias``: :func:`qla_serving.bench.gates.init_gdn_gates` draws them):

    * a norm's 1-D weight: its identity value (0 for Gemma-style norms, else 1);
    * any other 1-D parameter (a bias): 0;
    * a parameter of two or more dimensions, fan-in its last dimension: N(0, WEIGHT_STD), or
      U(-1/sqrt(fan_in), 1/sqrt(fan_in)) when the fan-in is below SHORT_FAN_IN.

    Returns the count of parameters per kind (``norm``, ``bias``, ``matrix``, ``filter``).
    """
    import math
    import zlib

    import torch

    counts = {"norm": 0, "bias": 0, "matrix": 0, "filter": 0}
    seen = set()  # a parameter shared by two modules (SGLang hands A_log to an inner module) once
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if (id(p) in seen or not torch.is_floating_point(p) or p.device.type == "meta"
                    or pname in ("A_log", "dt_bias")):
                continue
            seen.add(id(p))
            name = f"{module_name}.{pname}" if module_name else pname
            seed = zlib.crc32(f"{name}:{tuple(p.shape)}".encode())
            with torch.no_grad():
                if p.dim() == 1:
                    value = _norm_value(module) if pname == "weight" else None
                    p.fill_(0.0 if value is None else value)
                    counts["bias" if value is None else "norm"] += 1
                    continue
                short = p.shape[-1] < SHORT_FAN_IN
                counts["filter" if short else "matrix"] += 1
                # drawn on the parameter's device in slices of the first dimension, each seeded by
                # its offset: an expert tensor of 10^9 values needs no CPU copy or whole temporary
                rows = max(1, CHUNK_VALUES // max(1, p[0].numel()))
                for start in range(0, p.shape[0], rows):
                    part = p[start:start + rows]
                    gen = torch.Generator(device=p.device).manual_seed(seed + start)
                    if short:
                        bound = 1.0 / math.sqrt(p.shape[-1])
                        values = (torch.rand(part.shape, generator=gen, device=p.device) * 2 - 1) * bound
                    else:
                        values = torch.randn(part.shape, generator=gen, device=p.device) * WEIGHT_STD
                    part.copy_(values)
    return counts


def init_requested_weights(model) -> str | None:
    """What the engines' dummy-weight hooks run: with ``QLA_BENCH_WEIGHTS=random``,
    :func:`init_random_weights` on ``model`` and a line for the engine's log saying what it drew;
    None (nothing done) otherwise."""
    if not random_weights_requested():
        return None
    counts = init_random_weights(model)
    return f"{WEIGHTS_ENV}=random: re-drew the weights (" + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ")"
