"""The `context` section of results.json, computed from the models' per-token losses (txl_tf.study.context).

`run` trains and scores the models through txl_tf.study.context and returns the section (`section`).

Every figure is in bits per token on the kept tokens of txl_tf.study.scoring; comparisons are paired block
bootstraps (runs.paired_bootstrap) on the same tokens: all kept tokens between recurrent models, the vanilla
subset when the vanilla model is one side; RECL is computed on the vanilla subset (it takes per-token minima
across models, and the subset's per-token losses are what a model's archive keeps: txl_tf.study.archive). A
model's best (memory, clamp) is chosen on the validation split; only then is the test split read for it.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from txl_tf.study import archive, context, runs
from txl_tf.study.context import (
    BASELINE,
    MODELS,
    PARAMETER_TOLERANCE,
    UNCLAMPED,
    ContextSettings,
    Corpus,
)
from txl_tf.study.tables import PAPER_GROUP

BOOTSTRAP_SAMPLES = 200


def _init(name: str, settings: ContextSettings) -> tuple[int, int]:
    vanilla = next(m for m in MODELS if m.name == name).vanilla
    return (settings.train_span if vanilla else settings.train_memory), UNCLAMPED


def _best(cells: dict, settings: ContextSettings) -> tuple[int, int]:
    """(memory, clamp) with the lowest validation loss (the first such in the axis' order)."""
    options = [(m, c) for (split, m, c) in cells if split == "valid"]
    options.sort()
    return min(options, key=lambda key: cells[("valid", *key)].mean)


def _table(cells: dict, split: str, settings: ContextSettings, on_subset: bool = False) -> dict:
    """{clamp: {memory: bpc}} of one split (string keys), on every kept token or on the vanilla subset."""
    out = {}
    for (s, memory, clamp), cell in sorted(cells.items()):
        if s == split and memory in settings.memories:
            out.setdefault(str(clamp), {})[str(memory)] = cell.subset_bits() if on_subset else cell.bits()
    return out


def _check_parameters(records: dict) -> float:
    if BASELINE not in records:
        return 0.0
    return runs.check_parameters(records, BASELINE, PARAMETER_TOLERANCE, "gin/study/context_*.gin")


def _gain_curve(scores: dict, final_steps: int, final_tokens: int, settings: ContextSettings) -> list[dict]:
    """Transformer-XL's (best - init) on test at each kept checkpoint and at the end (unclamped memories)."""
    points = [(step, scores["checkpoints"][step], scores["checkpoint_tokens"][step])
              for step in sorted(scores.get("checkpoints", {}))]
    final = {k: v for k, v in scores["cells"].items() if k[2] == UNCLAMPED and k[1] in settings.memories}
    points.append((final_steps, final, final_tokens))
    curve = []
    for step, cells, tokens in points:
        best = _best(cells, settings)
        init = ("test", settings.train_memory, UNCLAMPED)
        curve.append({"step": step, "tokens": tokens, "best_memory": best[0],
                      "init_bpc": cells[init].bits(), "best_bpc": cells[("test", *best)].bits(),
                      **archive.compare([cells[("test", *best)]], [cells[init]], settings.block)})
    return curve


def _recl(scores: dict, names: list, settings: ContextSettings) -> dict:
    """RECL (appendix C) of `names` on the vanilla subset, each at exactly each context (the vanilla model at its
    window up to the training span)."""
    from txl_tf.analysis import recl

    contexts = tuple(settings.recl_contexts)
    rows = [np.stack([scores[n]["cells"][("test", c, UNCLAMPED)].subset for c in contexts]) for n in names]
    group = np.stack(rows)  # [models, C, T]
    out = {"contexts": list(contexts), "models": list(names), "tokens": int(group.shape[2]), "ratios": {}}
    for r in recl.PAPER_RATIOS:
        result = recl.compute_recl(group, contexts, r=r)
        spread = recl.bootstrap_recl(group, contexts, r=r, samples=BOOTSTRAP_SAMPLES, block=settings.block)
        out["ratios"][str(r)] = {"recl": [int(x) for x in result.recl], "truncated": [bool(x) for x in result.truncated],
                                 "gains": np.round(result.gains, 6).tolist(), **spread}
    out["bpc"] = {n: [float(np.mean(row[k], dtype=np.float64) / archive.LN2) for k in range(len(contexts))]
                  for n, row in zip(names, rows, strict=True)}
    return out


def section(records: dict, scores: dict, data, settings: ContextSettings, *, quick: bool, corpus: Corpus) -> dict:
    """The study's section of results.json from the models there are (`records`, `scores` of
    context.train_and_score)."""
    names = [m.name for m in MODELS if m.name in records]
    vanilla = {m.name for m in MODELS if m.vanilla}
    subset = data.test.subset()
    block = settings.block

    def test(name: str, key: tuple) -> archive.Cell:
        return scores[name]["cells"][("test", *key)]

    def compare(plus: list, minus: list, on_subset: bool) -> dict:
        return (archive.compare_subset if on_subset else archive.compare)(plus, minus, block)

    out_runs, best, comparisons = {}, {}, {}
    for name in names:
        cells = scores[name]["cells"]
        best[name] = _best(cells, settings)
        record = dict(records[name])
        record.update(valid=_table(cells, "valid", settings), test=_table(cells, "test", settings),
                      test_subset=_table(cells, "test", settings, on_subset=True),
                      best={"memory": best[name][0], "clamp": best[name][1]},
                      init={"memory": _init(name, settings)[0], "clamp": UNCLAMPED})
        out_runs[name] = record
        comparisons[f"{name}_longer"] = compare([test(name, best[name])], [test(name, _init(name, settings))],
                                                name in vanilla) | {"a": [name, *best[name]],
                                                                    "b": [name, *_init(name, settings)]}
    if BASELINE in names:
        for name in names:
            if name == BASELINE:
                continue
            on_subset = name in vanilla
            xl_best, xl_init = test(BASELINE, best[BASELINE]), test(BASELINE, _init(BASELINE, settings))
            other_best, other_init = test(name, best[name]), test(name, _init(name, settings))
            comparisons[f"xl_vs_{name}"] = compare([xl_best], [other_best], on_subset) | {"subset": on_subset}
            comparisons[f"xl_vs_{name}_init"] = compare([xl_init], [other_init], on_subset) | {"subset": on_subset}
            comparisons[f"xl_gain_vs_{name}"] = compare([xl_best, other_init], [xl_init, other_best], on_subset) | \
                {"subset": on_subset}  # (xl_best - xl_init) - (other_best - other_init)
    out = {
        "key": corpus.key,
        "quick": quick,
        "machine": runs.machine(),
        "setup": {"dataset": corpus.dataset, "corpus": corpus.title, "memories": list(settings.memories),
                  "train_memory": settings.train_memory, "train_span": settings.train_span,
                  "eval_tgt_len": settings.eval_tgt_len,
                  "streams": settings.eval_batch, "dropped_per_stream": settings.drop,
                  "kept_tokens": {"valid": data.valid.count, "test": data.test.count},
                  "split_tokens": {"valid": int(data.valid.tokens.shape[0]), "test": int(data.test.tokens.shape[0])},
                  "vanilla_subset_tokens": int(subset.shape[0]), "bootstrap_block": block,
                  "clamps": list(settings.clamps), "recl_contexts": list(settings.recl_contexts),
                  "probe": dataclasses.asdict(settings.probe) | {"distances": list(settings.probe.distances)},
                  "parameter_deviation": _check_parameters(records),
                  "models": [dataclasses.asdict(m) for m in MODELS if m.name in names]},
        "runs": out_runs,
        "comparisons": comparisons,
        "probe": {n: {str(m): scores[n]["probe"][m] for m in settings.memories} for n in names},
    }
    if BASELINE in names:
        out["gain_curve"] = _gain_curve(scores[BASELINE], records[BASELINE]["steps"],
                                        records[BASELINE]["train_tokens"], settings)
    recurrent = [n for n in names if n not in vanilla]
    if len(recurrent) > 1:
        out["recl"] = {"recurrent": _recl(scores, recurrent, settings)}
        group = [n for n in PAPER_GROUP if n in names]
        if len(group) == len(PAPER_GROUP):
            out["recl"]["paper_group"] = _recl(scores, group, settings)
    return out


def _finished(output_dir: str, archive_dir: str, model: context.Model, settings: ContextSettings, data_dir: str,
              quick: bool, corpus: Corpus, seed: int = 1) -> bool:
    """Whether seed `seed` of `model` is archived (checked when it is read) or its run here is finished."""
    spec = context.run_spec(model, settings, data_dir, quick, corpus, seed)
    if os.path.lexists(archive.paths_of(archive_dir, spec.name)[0]):
        return True
    record = runs.read_record(os.path.join(output_dir, "runs", spec.name))
    return record is not None and record["digest"] == spec.digest()


def run(output_dir: str, data_dir: str, *, models=None, quick: bool = False,
        corpus: Corpus = context.CORPORA[0], archive_dir: str | None = None) -> dict:
    """Trains and scores every seed of `models` (names; default all six) on `corpus` (prepared in `data_dir`),
    then assembles the corpus' section from every model seed that is archived in `archive_dir` (default
    OUTPUT_DIR/archive) or whose run is finished here (scores read back from the archive or the cache, or computed
    now): the first seeds' tables and comparisons, and the claims over every seed (`by_seed`:
    txl_tf.study.context_seeds)."""
    from txl_tf.study import context_seeds

    settings = context.settings_for(quick)
    data = context.splits(data_dir, settings)
    archive_dir = archive_dir or os.path.join(output_dir, "archive")
    records, scores, seed_scores, seed_runs = {}, {}, {}, {}
    for model in MODELS:
        for seed in settings.seeds:  # seeds in order: a model's seeds are 1..k
            if not ((models is None or model.name in models) or _finished(
                    output_dir, archive_dir, model, settings, data_dir, quick, corpus, seed)):
                break
            record, scored = context.train_and_score(model, output_dir, data_dir, data, settings, quick, corpus,
                                                     archive_dir, seed)
            if seed == 1:
                records[model.name], scores[model.name] = record, scored
            seed_scores.setdefault(model.name, []).append(scored)
            seed_runs.setdefault(model.name, []).append({"name": record["name"], "commit": record["commit"]})
    out = section(records, scores, data, settings, quick=quick, corpus=corpus)
    out["by_seed"] = {**context_seeds.section(seed_scores, settings), "runs": seed_runs,
                      "plan_commits": runs.plan_commits()}
    old = plan_v1_claim(scores, archive_dir, data, settings, data_dir, quick, corpus)
    if old is not None:
        out["comparisons"]["xl_vs_al_rfou_v1"] = old
    return out


def plan_v1_claim(scores: dict, archive_dir: str, data, settings: ContextSettings, data_dir: str, quick: bool,
                  corpus: Corpus) -> dict | None:
    """XL (seed 1) against study v3's vanilla model, each at its best memory on validation, on the vanilla subset,
    under docs/study_plan.md (version 1): the archive archive_dir/plan_v1/<its run>, read under its own spec
    (archive.plan_v1_cells), with its sanity check (docs/study_plan_v3.md, section 2). None when there is no
    such archive or no XL, or when it was scored under other settings than today's."""
    from txl_tf.study import sanity

    if BASELINE not in scores:
        return None
    model = next(m for m in MODELS if m.vanilla)
    name = context.run_spec(model, settings, data_dir, quick, corpus).name
    old = archive.plan_v1_cells(archive_dir, name, context.archive_facts(data, settings, corpus))
    if old is None:
        return None
    xl = scores[BASELINE]["cells"]
    plus, minus = xl[("test", *_best(xl, settings))], old[("test", *_best(old, settings))]
    return archive.compare_subset([plus], [minus], settings.block) | {
        "plan": 1, "subset": True, "sanity": sanity.vanilla_report(old, settings.train_span, name=name,
                                                                   block=settings.block)}
