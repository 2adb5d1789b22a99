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


# Where two servers' answers part, a gap below this (nats, both ways) is a near tie that bf16
# rounding can flip: logits of a few units carry about 0.03 of rounding per bf16 step, and a
# step's many sums add a few of those.
TIE_NATS = 0.25
# A forced answer (the oracle's context at every position) this far from its oracle's logprob at
# some position had another state: rounding under another batch moves it by a few 1/64-nat steps
# (0.44 at most on the clean servers of docs/e2e.md "Forced answers, served"), a swapped or stale
# state by 3-6.
STATE_NATS = 1.0


def logprob_agreement(ref: list[int], ref_lp: list, out: list[int], out_lp: list) -> dict | None:
    """How closely two greedy answers to one prompt agree in probability, not only in tokens.

    ``ref_lp`` / ``out_lp``: per generated token ``[logprob of the chosen token, [[token, logprob],
    ...] of the server's top tokens]``. Over the tokens both answers share (the same context for
    both servers) ``drift`` is the largest difference of the chosen token's logprob: bf16 numerics
    keep it near 0, a wrong state moves it; ``drift_at`` is the generated token where it is largest
    (None when they share none), ``drifts`` the difference at each shared token. Where the answers
    part, ``gap`` is how decided each server was against the other's token (the larger of the two;
    infinite when the other's token is not among a server's top tokens): below :data:`TIE_NATS` the
    two tokens were a near tie. None when either answer has no logprobs.
    """
    if not ref_lp or not out_lp:
        return None
    n = agreeing_prefix(ref, out)
    shared = min(n, len(ref_lp), len(out_lp))
    drifts = [abs(ref_lp[i][0] - out_lp[i][0]) for i in range(shared)]
    drift = max(drifts, default=0.0)
    drift_at = drifts.index(drift) if drifts else None
    gap = None
    if n < min(len(ref), len(out)) and n < min(len(ref_lp), len(out_lp)):
        def margin(lp, other):
            top = dict((int(t), v) for t, v in lp[1])
            return lp[0] - top[other] if other in top else float("inf")
        gap = max(margin(ref_lp[n], out[n]), margin(out_lp[n], ref[n]))
    return {"drift": drift, "drift_at": drift_at, "drifts": drifts, "gap": gap}
