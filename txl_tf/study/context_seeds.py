"""A context section's claims over seeds (docs/study_plan.md, sections 2-4 and 6), from every seed's scores.

Each seed k of a model gives one value per claim, read at cells chosen on the validation split (per seed):

    best      the (memory, clamp) with the lowest validation loss
    inside    L(span) - L(init): the gain of a memory growing up to the training span (memory 256 = the longest
              context a training query saw), both unclamped
    beyond    L(m*) - L(span): m* the (memory >= span, clamp) with the lowest validation loss; the title-claim
              verdicts read this part

and the claims of one corpus form one family (evidence.decide: t interval over the seeds, Holm, every seed's
sign). RECL is computed per seed on the plan's grid (the span and its multiples), with each model's noise share.
Everything here is a function of the scores (txl_tf.study.context.train_and_score) and the settings.
"""

from __future__ import annotations

import numpy as np

from txl_tf.study import archive, evidence
from txl_tf.study.context import BASELINE, MODELS, UNCLAMPED, ContextSettings

LATER = ("rope", "alibi")


def recl_grid(settings: ContextSettings) -> tuple:
    """The plan's RECL grid: the training span and its multiples up to the longest scored context."""
    return tuple(c for c in settings.recl_contexts if c % settings.train_span == 0)


def _bits(cell: archive.Cell, on_subset: bool = False) -> float:
    return cell.subset_bits() if on_subset else cell.bits()


def _best(cells: dict, memories=None) -> tuple[int, int]:
    """(memory, clamp) with the lowest validation loss, among `memories` (default all)."""
    options = sorted((m, c) for (split, m, c) in cells if split == "valid" and (memories is None or m in memories))
    return min(options, key=lambda key: cells[("valid", *key)].mean)


def parts(cells: dict, settings: ContextSettings) -> dict:
    """One seed's {best, inside, beyond, beyond_at} of a recurrent model (bits per character on test)."""
    span, init = settings.train_span, settings.train_memory
    test = {key[1:]: cell for key, cell in cells.items() if key[0] == "test"}
    at_span = test[(span, UNCLAMPED)].bits()
    beyond_at = _best(cells, [m for m in settings.memories if m >= span])
    return {"best": list(_best(cells)), "beyond_at": list(beyond_at),
            "inside": at_span - test[(init, UNCLAMPED)].bits(), "beyond": test[beyond_at].bits() - at_span}


def family(seed_scores: dict, settings: ContextSettings) -> tuple[dict, dict]:
    """({claim: per-seed differences}, {model: [parts per seed]}) of one corpus.

    `seed_scores`: {model: [scores of seed 1, seed 2, ...]} (each as context.train_and_score returns it). A claim
    between two models pairs seed k with seed k over the seeds both have. Differences are "XL minus the other"
    (negative: XL better); "longer_beyond_*" is a model's beyond part (negative: the longer memory helps).
    """
    vanilla = {m.name for m in MODELS if m.vanilla}
    split = {n: [parts(s["cells"], settings) for s in seeds] for n, seeds in seed_scores.items() if n not in vanilla}
    claims: dict[str, list] = {}
    if BASELINE not in seed_scores:
        return claims, split

    def seeds_of(other: str) -> range:
        return range(min(len(seed_scores[BASELINE]), len(seed_scores[other])))

    claims["longer_beyond_xl"] = [p["beyond"] for p in split[BASELINE]]
    for other in ("shaw", "no_recurrence"):
        if other in split:
            claims[f"longer_beyond_xl_vs_{other}"] = [split[BASELINE][k]["beyond"] - split[other][k]["beyond"]
                                                      for k in seeds_of(other)]
    for other in ("no_recurrence", "shaw", "al_rfou", *LATER):
        if other in seed_scores:
            on_subset = other in vanilla
            values = []
            for k in seeds_of(other):
                xl, them = seed_scores[BASELINE][k]["cells"], seed_scores[other][k]["cells"]
                values.append(_bits(xl[("test", *_best(xl))], on_subset) - _bits(them[("test", *_best(them))],
                                                                                   on_subset))
            claims[f"xl_vs_{other}"] = values
    for name in LATER:
        if name in split:
            claims[f"longer_beyond_{name}"] = [p["beyond"] for p in split[name]]
    memory, distance = max(settings.memories), str(2 * settings.train_span)
    copies = [s["probe"].get(memory, {}).get(distance) for s in seed_scores[BASELINE]]
    if copies and all(c is not None for c in copies):
        claims["probe_xl"] = [c["copy"] for c in copies]  # second copy minus control, bits per character
    return claims, split


def recl_by_seed(seed_scores: dict, settings: ContextSettings, names) -> list[dict]:
    """RECL of the group `names` per seed on the plan's grid, on the vanilla subset, each at exactly each context,
    with every model's noise share; as many seeds as every model of the group has."""
    grid = recl_grid(settings)
    out = []
    for k in range(min(len(seed_scores[n]) for n in names)):
        group = np.stack([np.stack([seed_scores[n][k]["cells"][("test", c, UNCLAMPED)].subset for c in grid])
                          for n in names])
        out.append({"seed": k + 1, "models": list(names), "contexts": list(grid),
                    "ratios": evidence.recl_with_noise(group, grid)})
    return out


def section(seed_scores: dict, settings: ContextSettings) -> dict:
    """The `by_seed` part of a context section: the decided claims, each model's inside/beyond parts per seed,
    and RECL per seed (the paper's group when all four models are there, else the recurrent ones)."""
    from txl_tf.study import sanity
    from txl_tf.study.tables import PAPER_GROUP

    claims, split = family(seed_scores, settings)
    out = {"plan": "docs/study_plan.md, version 1, docs/study_plan_v2.md and docs/study_plan_v3.md (the vanilla "
                   "baseline)",
           "seeds": {n: len(s) for n, s in seed_scores.items()},
           "claims": evidence.decide(claims) if claims else {}, "parts": split, "recl_grid": list(recl_grid(settings))}
    recurrent = [m.name for m in MODELS if m.name in seed_scores and not m.vanilla]
    group = [n for n in PAPER_GROUP if n in seed_scores]
    if len(group) < len(PAPER_GROUP):
        group = recurrent
    gridded = len(recl_grid(settings)) > 1
    if BASELINE in group and len(group) > 1 and gridded:
        out["recl"] = recl_by_seed(seed_scores, settings, group)
        out["recl_verdict"] = evidence.longest_recl_verdict(out["recl"], BASELINE)
    # "Which recurrent encoding reaches furthest" per seed (descriptive: plan, section 3): RECL of the recurrent
    # models on the plan's grid, and the longest probe distance each copies from at the longest memory
    if len(recurrent) > 1 and any(n in LATER for n in recurrent):
        if gridded:
            out["recl_recurrent"] = out["recl"] if group == recurrent and "recl" in out else recl_by_seed(
                seed_scores, settings, recurrent)
        memory = max(settings.memories)
        out["furthest_copy"] = {n: [evidence.furthest_copy(s["probe"][memory], settings.probe.distances)
                                    for s in seed_scores[n]] for n in recurrent}
    # Every vanilla seed's sanity check, shown beside its verdicts (docs/study_plan_v3.md; plan v2 withholds them)
    out["sanity"] = {m.name: [sanity.vanilla_report(s["cells"], settings.train_span, name=f"{m.name} seed {k}",
                                                    block=settings.block)
                              for k, s in enumerate(seed_scores[m.name], start=1)]
                     for m in MODELS if m.vanilla and m.name in seed_scores}
    return out
