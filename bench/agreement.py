"""Greedy agreement of two runs of the same prompts: how often their tokens match, and how close
the log-probabilities of the tokens they pick are until they part."""

from __future__ import annotations

from bench.stats import mean


def greedy_rows(outputs: list) -> list[list[tuple[int, float, list[int], float]]]:
    """Per sequence and position: ``(token, its log-prob, the top-5 tokens, top-1 minus top-2 log-prob)``."""
    rows = []
    for completion in (o.outputs[0] for o in outputs):
        row = []
        for token, top in zip(completion.token_ids, completion.logprobs):
            ranked = sorted(top, key=top.get, reverse=True)
            row.append((token, top[token], ranked, top[ranked[0]] - top[ranked[1]]))
        rows.append(row)
    return rows


def agreement(one: list, two: list) -> dict[str, float]:
    """How two runs' greedy outputs (:func:`greedy_rows`) agree: ``agreement`` (share of positions
    with the same token), ``max_logprob_diff`` and ``mean_logprob_diff`` (|Δ log-prob| of the
    picked token before a sequence's first disagreement), ``disagreements_in_top5`` (share of
    first disagreements where each side's token is in the other's top 5)."""
    same = total = near = flips = 0
    diffs = []
    for a, b in zip(one, two):
        diverged = False
        for (ta, la, top_a, _), (tb, lb, top_b, _) in zip(a, b):
            total += 1
            same += ta == tb
            if ta != tb and not diverged:
                flips += 1
                near += tb in top_a and ta in top_b
                diverged = True
            if not diverged:
                diffs.append(abs(la - lb))
    return {"agreement": same / total, "max_logprob_diff": max(diffs, default=0.0),
            "mean_logprob_diff": mean(diffs) if diffs else 0.0,
            "disagreements_in_top5": near / flips if flips else 1.0}
