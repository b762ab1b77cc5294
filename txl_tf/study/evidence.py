"""How a comparison of trained models becomes a verdict (docs/study_plan.md, sections 2, 3 and 6).

Seeds are the unit: a claim "A beats B" gets one paired difference per seed (seed k of A against seed k of B on
the same scored characters), and its interval is Student's t over those differences, so it covers training noise.
Within a table (a family of claims) the p-values are Holm-corrected, and a claim is "reproduced" or "reversed"
only when its corrected p-value is below alpha and every seed agrees in sign; otherwise it is "undecided".

    seed_interval   per-seed differences -> mean, t interval, p-value
    holm            p-values of a family -> Holm-adjusted p-values
    decide          one family of claims -> each with its adjusted p-value and verdict
    longest_recl_verdict  "XL has the longest RECL" over seeds
    furthest_copy   the longest probe distance a model copies from
    same_leader     the model strictly ahead in every seed ("which encoding reaches furthest"), or none
    recl_noise_share  the share of a RECL gain earned at steps where the model's own mean loss got worse
    recl_with_noise   one seed's RECL at the paper's ratios with each model's noise share

Pure functions of NumPy arrays and floats: nothing here trains, scores or reads a file.
"""

from __future__ import annotations

import math

import numpy as np

ALPHA = 0.05
MIN_SEEDS = 3  # the plan's seeds per model: fewer is "undecided" whatever the figures
REPRODUCED, REVERSED, UNDECIDED = "reproduced", "reversed", "undecided"


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with `df` (a positive integer) degrees of freedom.

    The closed forms for integer degrees of freedom (Abramowitz & Stegun 26.7.3 and 26.7.4), with
    theta = atan(|t| / sqrt(df)): for odd df, P(|T| < t) = (2 / pi)(theta + sin(theta) cos(theta) S), for even df
    P(|T| < t) = sin(theta) S', S and S' the finite series in cos(theta)^2 below.
    """
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, not {df}")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:
        series, term = 0.0, 1.0
        if df > 1:
            series = 1.0
            for k in range(1, (df - 1) // 2):
                term *= c2 * (2 * k) / (2 * k + 1)
                series += term
        inside = 2.0 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
    else:
        series, term = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            series += term
        inside = math.sin(theta) * series
    return min(1.0, max(0.0, 1.0 - inside))


def t_quantile(level: float, df: int) -> float:
    """The two-sided critical value q with P(|T| < q) = level (bisection on t_two_sided_p)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), not {level}")
    low, high = 0.0, 1.0
    while t_two_sided_p(high, df) > 1.0 - level:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if t_two_sided_p(mid, df) > 1.0 - level:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


def seed_interval(differences, level: float = 0.95) -> dict:
    """The mean of per-seed differences, its Student-t interval at `level` and two-sided p-value against 0.

    With one seed, or seeds that agree exactly, the spread between seeds is unknown: the interval is
    (-inf, +inf) and p = 1 (nothing is claimed), never a zero-width interval.
    """
    d = np.asarray(differences, dtype=np.float64).reshape(-1)
    if d.size == 0 or not np.isfinite(d).all():
        raise ValueError(f"per-seed differences must be finite and non-empty, got {d.tolist()}")
    mean, n = float(d.mean()), int(d.size)
    out = {"mean": mean, "n": n, "seeds": d.tolist(), "level": level}
    sd = float(d.std(ddof=1)) if n > 1 else 0.0
    if n < 2 or sd == 0.0:
        return out | {"low": -math.inf, "high": math.inf, "p": 1.0}
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return out | {"low": mean - half, "high": mean + half, "p": t_two_sided_p(mean / (sd / math.sqrt(n)), n - 1)}


def holm(pvalues: dict) -> dict:
    """Holm's step-down adjusted p-values of one family ({claim: p} -> {claim: adjusted p}): the k-th smallest
    p times (m - k + 1), made monotone, capped at 1."""
    ordered = sorted(pvalues, key=lambda key: (pvalues[key], str(key)))
    m, running, out = len(ordered), 0.0, {}
    for k, key in enumerate(ordered):
        running = max(running, min(1.0, (m - k) * pvalues[key]))
        out[key] = running
    return out


def verdict(entry: dict, adjusted_p: float, alpha: float = ALPHA, min_seeds: int = MIN_SEEDS) -> str:
    """"reproduced" (the claim's direction: a negative difference, A's loss below B's) or "reversed" when the
    Holm-adjusted p-value is below alpha, every seed has the mean's sign and there are `min_seeds` seeds;
    otherwise "undecided"."""
    seeds = entry["seeds"]
    if len(seeds) < min_seeds or adjusted_p >= alpha:
        return UNDECIDED
    sign = math.copysign(1.0, entry["mean"])
    if entry["mean"] == 0.0 or any(math.copysign(1.0, x) != sign or x == 0.0 for x in seeds):
        return UNDECIDED
    return REPRODUCED if sign < 0 else REVERSED


def decide(family: dict, alpha: float = ALPHA, min_seeds: int = MIN_SEEDS) -> dict:
    """One table's claims ({claim: per-seed differences}) -> {claim: seed_interval + "p_holm" + "verdict"}."""
    entries = {key: seed_interval(d) for key, d in family.items()}
    adjusted = holm({key: e["p"] for key, e in entries.items()})
    return {key: e | {"p_holm": adjusted[key], "family_size": len(family),
                      "verdict": verdict(e, adjusted[key], alpha, min_seeds)} for key, e in entries.items()}


def longest_recl_verdict(per_seed: list[dict], model: str, r: str = "0.1", min_seeds: int = MIN_SEEDS) -> str:
    """"XL has the longest RECL" over seeds: "reproduced" when `model`'s RECL is strictly the longest of its group
    in every seed, "reversed" when in every seed another model's is strictly longer, else "undecided" (so too with
    fewer than `min_seeds` seeds). `per_seed`: [{"models": [...], "ratios": {r: {"recl": [...]}}}]."""
    if len(per_seed) < min_seeds:
        return UNDECIDED
    longest, shorter = [], []
    for entry in per_seed:
        values = dict(zip(entry["models"], entry["ratios"][r]["recl"], strict=True))
        others = [v for n, v in values.items() if n != model]
        longest.append(values[model] > max(others))
        shorter.append(values[model] < max(others))
    return REPRODUCED if all(longest) else REVERSED if all(shorter) else UNDECIDED


def furthest_copy(cells: dict, distances) -> int:
    """The longest copy-probe distance at which the second copy is significantly cheaper than the control (its 95%
    interval over the examples below zero; 0: at none). `cells`: {distance (str): probe summary}."""
    return max([d for d in distances if cells[str(d)]["copy_high"] < 0], default=0)


def same_leader(per_seed: list[dict], min_seeds: int = MIN_SEEDS) -> str | None:
    """The model that is strictly ahead in every seed, or None (docs/study_plan.md, section 3: a row that picks a
    maximum over many noisy tests names a model only when the same one wins in every seed). `per_seed`: one
    {model: value} per seed, larger = further; a tie at the top is no leader, and so are fewer than `min_seeds`
    seeds."""
    if len(per_seed) < min_seeds:
        return None
    leaders = set()
    for values in per_seed:
        top = max(values.values())
        first = [n for n, v in values.items() if v == top]
        if len(first) != 1:
            return None
        leaders.add(first[0])
    return leaders.pop() if len(leaders) == 1 else None


def why(entry: dict, min_seeds: int = MIN_SEEDS) -> str:
    """Why a claim is undecided, in a few words ("" when it is decided)."""
    if entry["verdict"] != UNDECIDED:
        return ""
    if len(entry["seeds"]) < min_seeds:
        return f"{len(entry['seeds'])} of the plan's {min_seeds} seeds"
    if len({x > 0 for x in entry["seeds"]}) > 1:
        return "the seeds disagree in sign"
    return f"Holm-adjusted p = {entry['p_holm']:.2g}"


def recl_noise_share(losses: np.ndarray, r: float, steps) -> np.ndarray:
    """For each model of a RECL group, the share of its counted RECL gain earned at grid steps where its own mean
    loss got worse (docs/study_plan.md, section 6).

    RECL counts a step from c to c' as long as the model's relative gain g(c, c') over the group's baseline stays
    above the threshold, and only improvements over the baseline count (min(b, l)): a model whose per-token losses
    scatter can earn a step while its own mean loss rises. This is the sum of g over the counted steps at which
    the model's mean loss over the scored tokens rose from c to c', divided by the sum of g over all its counted
    steps.

    Args:
      losses: [N, C, T] per-token losses of the group at the grid's C contexts (txl_tf.analysis.recl).
      r: the ratio of hard tokens (as in the RECL).
      steps: [N] or an int: how many steps count for each model (the index of its RECL in the grid).

    Returns [N] shares in [0, 1] (0 where a model counted no gain).
    """
    from txl_tf.analysis.recl import relative_gains

    losses = np.asarray(losses, dtype=np.float64)
    gains = relative_gains(losses, r)  # [N, C - 1]
    means = losses.mean(axis=2)  # [N, C]
    worse = means[:, 1:] > means[:, :-1]  # [N, C - 1]
    counted = np.arange(gains.shape[1])[None, :] < np.asarray(steps).reshape(-1, 1)
    credited = np.where(counted, np.maximum(gains, 0.0), 0.0)
    total = credited.sum(axis=1)
    return np.divide((credited * worse).sum(axis=1), total, out=np.zeros(gains.shape[0]), where=total > 0)


def recl_with_noise(group: np.ndarray, contexts) -> dict:
    """{r: {"recl", "truncated", "noise_share"}} of one seed's group [models, C, T] at the paper's ratios, each
    model at exactly each context of the grid `contexts` (appendix C)."""
    from txl_tf.analysis import recl

    contexts = tuple(contexts)
    out = {}
    for r in recl.PAPER_RATIOS:
        result = recl.compute_recl(group, contexts, r=r)
        share = recl_noise_share(group, r, [contexts.index(x) for x in result.recl])
        out[str(r)] = {"recl": [int(x) for x in result.recl], "truncated": [bool(x) for x in result.truncated],
                       "noise_share": np.round(share, 4).tolist()}
    return out
