"""Greedy-token agreement between two runs of the same prompts: the tokens generated before the
first divergence (bf16 numerics under other batch shapes may diverge late; a state bug diverges
early). Shared by the serving benchmark, the stress harness and the offline acceptance run."""

from __future__ import annotations


def agreeing_prefix(ref: list[int], out: list[int]) -> int:
    """Tokens of ``out`` before the first position where it differs from ``ref``.

    A divergence at position 5 (0-based) counts 5; identical lists count their length; a shorter
    list that agrees with the other as far as it goes counts its own length.
    """
    n = 0
    for a, b in zip(ref, out):
        if a != b:
            break
        n += 1
    return n


def agreement(ref: list[list[int]], out: list[list[int]]) -> dict:
    """The agreement of one run with the reference run, prompt by prompt.

    Returns ``agree_tokens`` (the metric: the sum over prompts of :func:`agreeing_prefix`),
    ``total_tokens`` (the reference's generated tokens), ``agree_frac``, ``exact_prompts``
    (prompts identical to the reference) and ``first_divergence`` (per prompt, the position of
    the first differing token, ``None`` where the prompt agrees throughout).
    """
    if len(ref) != len(out):
        raise ValueError(f"{len(out)} outputs against {len(ref)} reference outputs")
    prefixes = [agreeing_prefix(r, o) for r, o in zip(ref, out)]
    total = sum(len(r) for r in ref)
    same = [p == len(r) == len(o) for p, r, o in zip(prefixes, ref, out)]
    return {
        "agree_tokens": sum(prefixes),
        "total_tokens": total,
        "agree_frac": round(sum(prefixes) / total, 4) if total else 1.0,
        "exact_prompts": sum(same),
        "prompts": len(ref),
        "first_divergence": [None if s else p for s, p in zip(same, prefixes)],
    }


def agree_fraction(ref: list[list[int]], out: list[list[int]]) -> float | None:
    """Tokens generated before the first divergence from ``ref``, over all of ``ref``'s tokens."""
    if not ref or not out or len(ref) != len(out):
        return None
    total = sum(len(r) for r in ref)
    return sum(agreeing_prefix(r, o) for r, o in zip(ref, out)) / total if total else None


def distinct_tokens(answers: list[list[int]]) -> int | None:
    """The median count of different tokens in one answer of ``answers``: 1 when each answer is one
    token repeated (the engines' dummy weights), which agreement can hardly tell from a wrong state."""
    counts = sorted(len(set(a)) for a in answers if a)
    return counts[len(counts) // 2] if counts else None
