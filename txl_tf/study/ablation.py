"""Studies `ablation` and `recl`: the paper's Tables 5 and 6 at character level on enwik8_sample.

Six variants (gin/study/ablation_<name>.gin) with the same parameter count (checked to +-5%), the same training
attention length and the same number of training tokens:

    xl             Transformer-XL: relative encoding + recurrence
    no_recurrence  the same without memory in training (the paper's "w/o recurrence")
    shaw           Shaw et al. (2018) learned relative encoding + recurrence
    vaswani        Vaswani et al. (2017) absolute sinusoid encoding + recurrence
    al_rfou        the vanilla model of Al-Rfou et al. (2018): learned absolute positions, no memory
    half_loss      Transformer-XL trained with the loss over the recent half of each segment

Every model is scored on the whole test split, as the context study scores it (txl_tf.study.scoring): the split in
`eval_batch` streams through the cached state, the first n_layer x the longest attention length predictions of
every stream dropped, so every length scores the same kept tokens (~260,000 characters) with a full context. The
vanilla model costs a forward pass per token, so it is scored on evenly spaced blocks of those tokens
(`vanilla_blocks` x `block`), and every comparison or RECL group that includes it pairs the others' losses there.
The attention length A at evaluation is the memory length of the recurrent protocol (EvalConfig.tgt_len-token
segments, same_length: every query attends A previous positions and itself) and the window of the vanilla one
(shifted by one token per prediction). Training attends up to `train_attention` positions (64-token segments +
64 memory, or 128-token segments without memory), so A = 1x, 2x, 4x and 8x of it are evaluated.

`recl` computes the relative effective context length (appendix C) of the six first-seed models as one group,
from per-token losses at the contexts of a grid (txl_tf.analysis.recl).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from txl_tf.model.protocol import Protocol
from txl_tf.study import runs
from txl_tf.study.tables import PAPER_GROUP


@dataclasses.dataclass(frozen=True)
class Variant:
    """A variant of the ablation: `vanilla` scores it with a sliding window, trains it with `vanilla_params` and
    runs the sanity check on it."""

    name: str
    label: str
    recurrent: bool
    quick_params: tuple = ()
    vanilla: bool = False


def vanilla_params(window: int) -> list[str]:
    """The bindings of the studies' vanilla model trained on windows of `window` tokens (docs/study_plan_v2.md): a
    learned table of window - 1 rows, so the window's last two positions share its last row (al_rfou's rule for
    positions past the table). With `window` rows, the last row learned from the window's last prediction alone
    (no other query attends to its key) and the model scored worse at its own window, the position the sliding
    window scores, than at shorter ones (issue 54). The gin files bind the same; the binding is in the run's spec
    too, so its digest (which sees the bindings, not the files' text) tells the old model's archives apart."""
    return [f"ModelConfig.max_position = {window - 1}"]


VARIANTS = (
    Variant("xl", "Transformer-XL (ours + recurrence)", True),
    Variant("no_recurrence", "w/o recurrence", False),
    Variant("shaw", "Shaw et al. encoding + recurrence", True),
    Variant("vaswani", "Vaswani et al. encoding + recurrence", True, ("ModelConfig.d_inner = 80",)),
    Variant("al_rfou", "Al-Rfou et al. vanilla (sliding window)", False, vanilla=True),
    Variant("half_loss", "Transformer-XL, half loss", True),
)
BASELINE = "xl"
PARAMETER_TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class AblationSettings:
    """Sizes of the evaluation; `quick` shrinks everything so the pipeline runs in the test suite."""

    train_attention: int = 128
    lengths: tuple = (128, 256, 512, 1024)  # evaluation attention lengths of the table: 1x, 2x, 4x, 8x
    recl_contexts: tuple = (128, 256, 384, 512, 640, 768)  # evenly spaced (appendix C's step), up to 6x
    eval_tgt_len: int = 64
    eval_batch: int = 10  # streams of the split
    n_layer: int = 4  # the dropped predictions per stream are n_layer x the longest attention length
    vanilla_blocks: int = 200  # 20,000 tokens
    vanilla_batch: int = 10
    bootstrap_block: int = 100
    max_tokens: int = 0  # 0 = the whole split
    seeds: tuple = (1, 2, 3)  # every variant, every seed (docs/study_plan.md)
    # The vanilla variant's windows on the validation split (docs/study_plan_v3.md): the lowest bpc chooses the
    # window its test split is scored at (ties to the longer), and the sanity check (docs/study_plan_v2.md) reads
    # the last, its training window, against the shorter ones.
    valid_windows: tuple = (32, 64, 96, 112, 128)
    train_params: tuple = ()
    recurrent_params: tuple = ()
    nonrecurrent_params: tuple = ()


FULL = AblationSettings()
QUICK = AblationSettings(
    train_attention=32, lengths=(32, 64, 128, 256), recl_contexts=(32, 64, 128, 192, 256), eval_tgt_len=16,
    eval_batch=4, n_layer=2, vanilla_blocks=4, bootstrap_block=20, max_tokens=6001, seeds=(1, 2),
    valid_windows=(8, 16, 24, 28, 32),
    train_params=("ModelConfig.n_layer = 2", "ModelConfig.d_model = 32", "ModelConfig.n_head = 2",
                  "ModelConfig.d_head = 16", "ModelConfig.d_inner = 64", "ModelConfig.max_position = 32",
                  "TrainConfig.train_steps = 30", "TrainConfig.warmup_steps = 5", "TrainConfig.steps_per_loop = 10",
                  "TrainConfig.log_every = 10", "TrainConfig.checkpoint_every = 15",
                  "TrainConfig.measure_mfu = False", *runs.PINNED_PATH),
    recurrent_params=("ModelConfig.mem_len = 16", "TrainConfig.batch_size = 4", "TrainConfig.tgt_len = 16"),
    nonrecurrent_params=("ModelConfig.mem_len = 0", "TrainConfig.batch_size = 2", "TrainConfig.tgt_len = 32"),
)


def _drop(settings: AblationSettings) -> int:
    return settings.n_layer * max(max(settings.lengths), max(settings.recl_contexts))


def scored_tokens(tokens: np.ndarray, settings: AblationSettings, split: str = "test"):
    """The kept tokens of a split (txl_tf.study.scoring.ScoredTokens), checked to leave some."""
    from txl_tf.study import scoring

    if settings.max_tokens:
        tokens = tokens[:settings.max_tokens]
    scored = scoring.ScoredTokens(tokens, settings.eval_batch, _drop(settings), settings.bootstrap_block,
                                  settings.vanilla_blocks)
    try:
        scored.check()
        scored.subset()
    except ValueError as e:
        raise runs.StudyError(f"the {split} split is too short for the ablation: {e}") from None
    return scored


def settings_for(quick: bool) -> AblationSettings:
    return QUICK if quick else FULL


def run_spec(variant: Variant, settings: AblationSettings, data_dir: str, quick: bool, seed: int = 1) -> runs.RunSpec:
    params = [f"DATA_DIR = '{data_dir}'", *settings.train_params]
    if quick:
        params += settings.recurrent_params if variant.recurrent else settings.nonrecurrent_params
        params += variant.quick_params
    if variant.vanilla:
        params += vanilla_params(settings.train_attention)
    params += runs.seed_params(seed)
    return runs.RunSpec(name=runs.seed_name(variant.name, seed), gin_files=(f"study/ablation_{variant.name}.gin",), gin_params=tuple(params),
                        label=variant.label)


def _evaluate(run_dir: str, model, configs, scored, length: int, settings: AblationSettings, clamp_len: int = -1,
              split: str = "test"):
    """Per-token losses (nats) at attention length `length`: [count] kept tokens (recurrent), [subset] (vanilla);
    `scored` is the test split's unless `split` says otherwise (its cache keys then start with the split)."""
    import time

    from txl_tf.study import scoring

    vanilla = configs.eval.protocol == "vanilla"
    clamp = f"_clamp{clamp_len}" if clamp_len > 0 else ""
    where = f"b{scored.batch_size}_d{scored.drop}_n{scored.tokens.shape[0]}"
    key = ("" if split == "test" else f"{split}_") + (f"window{length}_{where}_blocks{scored.subset_blocks}x{scored.block}" if vanilla
           else f"mem{length}{clamp}_t{settings.eval_tgt_len}_{where}")

    def compute():
        if vanilla:
            start = time.perf_counter()
            losses = scoring.score_windows(model, scored.tokens, scored.positions()[scored.subset()], window=length,
                                           batch_size=settings.vanilla_batch)
            seconds, protocol = time.perf_counter() - start, {"protocol": "vanilla", "window": length}
        else:
            losses, result = scoring.score_recurrent(
                model, scored, tgt_len=settings.eval_tgt_len,
                protocol=Protocol(mem_len=length, clamp_len=clamp_len, same_length=True))
            seconds, protocol = result.seconds, result.protocol
        return losses, {"protocol": protocol, "seconds": round(seconds, 2), "tokens": int(losses.size),
                        "bpc": scoring.bits(losses)}

    return runs.cached_eval(run_dir, key, compute)


def _facts(scored, settings: AblationSettings, contexts: tuple, clamped: tuple, valid=None) -> dict:
    """The settings a variant's cells are scored under (txl_tf.study.archive), as JSON reads them back; `valid`
    (the validation split's scored tokens) for a vanilla variant, whose sanity check scores it."""
    import json

    facts = {"study": "ablation", "contexts": contexts, "clamped": clamped, "clamp_len": settings.train_attention,
             "eval_tgt_len": settings.eval_tgt_len, "streams": scored.batch_size, "drop": scored.drop,
             "block": settings.bootstrap_block, "split_tokens": int(scored.tokens.shape[0]),
             "subset_tokens": int(scored.subset().shape[0])}
    if valid is not None:
        facts["sanity"] = {"split": "valid", "windows": settings.valid_windows, "plan": 3,
                           "split_tokens": int(valid.tokens.shape[0]), "subset_tokens": int(valid.subset().shape[0])}
    return json.loads(json.dumps(facts))


def _train_and_score(spec: runs.RunSpec, output_dir: str, scored, settings: AblationSettings, contexts: tuple,
                     position: str, archive_dir: str, clamped: tuple = (), clean: bool = False, valid=None
                     ) -> tuple[dict, dict]:
    """Trains one run (or finds it finished, or reads it from `archive_dir` as ablation_<run>) and scores it at
    `contexts`, and at `clamped` with clamp_len = the training attention length; returns (record,
    {(split, length, clamp): archive.Cell}), every test cell with its losses on the vanilla subset. `valid`: the
    validation split of a vanilla variant, scored at settings.valid_windows (docs/study_plan_v3.md): the window
    of its lowest bpc there is the one its test split is scored at too (record["window"]), and the sanity check's
    result is printed and recorded (record["sanity"]), not a stop."""
    from txl_tf.study import archive

    facts = _facts(scored, settings, contexts, clamped, valid)
    name = f"ablation_{spec.name}"
    archived = archive.load(archive_dir, name, facts, spec.digest(portable=True), clean=clean)
    if archived is not None:
        runs.log(f"{position} {spec.name}: scores read from {archive.paths_of(archive_dir, name)[0]}")
        record, cells = archived[0], archived[1]["cells"]
        if valid is not None:
            record = record | vanilla_window(cells, settings, spec.name, position)
            if ("test", record["window"], -1) not in cells:
                raise runs.StudyError(f"{archive.paths_of(archive_dir, name)[0]} has no test cell at window "
                                      f"{record['window']}, the window chosen on validation; remove the archive to "
                                      "score the model again")
        return record, cells
    run_dir = os.path.join(output_dir, "runs", spec.name)
    runs.log(f"{position} {spec.name}: training ({', '.join(spec.gin_files)}) in {run_dir}")
    record = dict(runs.train_run(spec, run_dir, clean=clean))
    runs.log(f"{position} {spec.name}: trained {record['steps']} steps in {record['wall_seconds'] / 60:.1f} min "
             f"(final training loss {record['final_train_loss']:.4f})")
    model, configs = runs.load_run_model(run_dir)
    record["parameters"] = runs.num_parameters(model)
    record["train_tokens"] = record["steps"] * configs.train.batch_size * configs.train.tgt_len
    record["protocol"] = configs.eval.protocol
    vanilla = configs.eval.protocol == "vanilla"
    subset = np.arange(len(scored.subset())) if vanilla else scored.subset()
    cells, record["evals"] = {}, {}
    for length in settings.valid_windows if valid is not None else ():
        losses, info = _evaluate(run_dir, model, configs, valid, length, settings, split="valid")
        cells[("valid", length, -1)] = archive.Cell.of(losses, settings.bootstrap_block)
        runs.log(f"{position} {spec.name}: validation, window {length}: {info['bpc']:.4f} bpc")
    if valid is not None:
        record |= vanilla_window(cells, settings, spec.name, position)
        contexts = tuple(sorted(set(contexts) | {record["window"]}))
    for length in contexts:
        losses, info = _evaluate(run_dir, model, configs, scored, length, settings)
        cells[("test", length, -1)] = archive.Cell.of(losses, settings.bootstrap_block, subset)
        record["evals"][str(length)] = info
        runs.log(f"{position} {spec.name}: attention {length}: {info['bpc']:.4f} bpc "
                 f"({info['tokens']:,} tokens, {info['seconds']:.1f} s)")
    clamp = settings.train_attention
    for length in clamped:
        losses, info = _evaluate(run_dir, model, configs, scored, length, settings, clamp_len=clamp)
        cells[("test", length, clamp)] = archive.Cell.of(losses, settings.bootstrap_block, subset)
        runs.log(f"{position} {spec.name}: attention {length}, clamp_len {clamp}: {info['bpc']:.4f} bpc")
    import keras

    del model
    keras.backend.clear_session()
    path = archive.save(archive_dir, name, spec.digest(portable=True), record, {"cells": cells, "probe": {}}, facts)
    runs.log(f"{position} {spec.name}: archived in {path}")
    return record, cells


def vanilla_window(cells: dict, settings: AblationSettings, run: str, position: str) -> dict:
    """{"window": the window of lowest validation bpc among settings.valid_windows (sanity.choose_window),
    "sanity": the sanity check's record at the training window (sanity.vanilla_report)}, each printed as one line
    (docs/study_plan_v3.md)."""
    from txl_tf.study import sanity

    window = sanity.choose_window(cells, settings.valid_windows)
    report = sanity.vanilla_report(cells, settings.valid_windows[-1], name=f"ablation_{run}",
                                   block=settings.bootstrap_block)
    runs.log(f"{position} {run}: window {window} chosen on validation (of {', '.join(map(str, settings.valid_windows))}); "
             f"{sanity.report_line(report)}")
    return {"window": window, "sanity": report}


def plan_v1_claim(cells: dict, archive_dir: str, facts: dict, settings: AblationSettings) -> dict | None:
    """XL (seed 1) against study v3's vanilla model at the training length, under docs/study_plan.md (version 1):
    the archive archive_dir/plan_v1/ablation_al_rfou, read under its own spec (txl_tf.study.archive.
    plan_v1_cells), with its sanity check (docs/study_plan_v3.md, section 2). None when there is no such
    archive, or when it was scored on other tokens than today's (its facts differ, the sanity windows aside)."""
    from txl_tf.study import archive, sanity

    if BASELINE not in cells:
        return None
    old_cells = archive.plan_v1_cells(archive_dir, "ablation_al_rfou", facts, ignore=("sanity",))
    if old_cells is None:
        return None
    old = "al_rfou_plan_v1"
    length = settings.train_attention
    report = sanity.vanilla_report(old_cells, length, name=old, block=settings.bootstrap_block)
    claim = _compare({BASELINE: cells[BASELINE], old: old_cells}, (BASELINE, length), (old, length), settings,
                     frozenset({old}))
    return claim | {"plan": 1, "sanity": report}


def _subset_losses(cells: dict, names) -> dict:
    """{name: {length: losses on the vanilla subset}} (unclamped test cells): the tokens every variant is scored
    on."""
    return {n: {length: cell.subset for (split, length, clamp), cell in cells[n].items()
                if split == "test" and clamp == -1} for n in names}


def _compare(cells: dict, a: tuple, b: tuple, settings: AblationSettings, vanilla: frozenset) -> dict:
    """a - b in bits per token with a 95% block-bootstrap interval; a and b are (run, length), on every kept
    token, or on the vanilla subset when either side is a vanilla run (scored on that subset only)."""
    from txl_tf.study import archive

    both = [cells[a[0]][("test", a[1], -1)]], [cells[b[0]][("test", b[1], -1)]]
    on_subset = not vanilla.isdisjoint({a[0], b[0]})
    stats = (archive.compare_subset if on_subset else archive.compare)(*both, settings.bootstrap_block)
    return {"a": list(a), "b": list(b), **stats}


def seed_claims(cells: dict, seeds: dict, length: int, settings: AblationSettings, vanilla: frozenset,
                windows: dict | None = None) -> dict:
    """The ablation's family of claims (docs/study_plan.md): XL against each other variant at attention length
    `length`, one paired difference per seed (seed k against seed k), decided together (evidence.decide: t
    interval over seeds, Holm within the family, every seed's sign). Each entry keeps every seed's own block
    bootstrap over the scored characters under "per_seed" (the evaluation noise, not the claim's interval).
    `windows`: {run: its window} for runs scored at another length than `length` (the vanilla model's window
    chosen on validation, docs/study_plan_v3.md); "b" then lists each seed's."""
    from txl_tf.study import evidence

    per_seed, family = {}, {}
    for variant in VARIANTS[1:]:
        n = variant.name
        if BASELINE not in seeds or n not in seeds:
            continue
        pairs = list(zip(seeds[BASELINE], seeds[n], strict=True))
        at = {y: (windows or {}).get(y, length) for _, y in pairs}
        per_seed[n] = [_compare(cells, (x, length), (y, at[y]), settings, vanilla) for x, y in pairs]
        family[n] = [c["mean"] for c in per_seed[n]]
    decided = evidence.decide(family)
    out = {}
    for n in family:
        lengths = sorted({c["b"][1] for c in per_seed[n]})
        out[n] = decided[n] | {"a": [BASELINE, length], "b": [n, lengths[0] if len(lengths) == 1 else lengths],
                               "per_seed": per_seed[n],
                               "runs": [list(pair) for pair in zip(seeds[BASELINE], seeds[n], strict=True)]}
    return out


def vanilla_windows(records: dict, seeds: dict) -> dict:
    """{run: the window chosen on its validation split} of every vanilla seed that has one (docs/study_plan_v3.md)."""
    return {run: records[run]["window"] for v in VARIANTS if v.vanilla for run in seeds.get(v.name, ())
            if "window" in records[run]}


def vanilla_claims(cells: dict, records: dict, seeds: dict, settings: AblationSettings, vanilla: frozenset) -> dict:
    """{comparison name: claim} of XL against the vanilla variant under docs/study_plan_v3.md (the headline): the
    vanilla model of each seed at the window chosen on its validation split, every seed's sanity check beside
    it; and under docs/study_plan_v2.md, `..._v2`: at its own training window, "withheld" where a seed fails the
    sanity check. Each is decided within its own whole family (seed_claims): the headline's is the family the
    other variants' claims are read from."""
    names = [v.name for v in VARIANTS if v.vanilla and v.name in seeds and BASELINE in seeds]
    if not names:
        return {}
    windows = vanilla_windows(records, seeds)
    v3 = seed_claims(cells, seeds, settings.train_attention, settings, vanilla, windows)
    v2 = seed_claims(cells, seeds, settings.train_attention, settings, vanilla)
    out = {}
    for n in names:
        reports = [records[run].get("sanity") for run in seeds[n]]
        failed = [run for run, r in zip(seeds[n], reports, strict=True) if r is not None and not r["passed"]]
        out[f"{BASELINE}_vs_{n}_seeds"] = v3[n] | {"plan": 3, "sanity": reports,
                                                   "windows": [windows.get(run) for run in seeds[n]]}
        out[f"{BASELINE}_vs_{n}_seeds_v2"] = v2[n] | {"plan": 2, "sanity": reports, "withheld": failed}
    return out


def _best_length(cells: dict, name: str, lengths) -> int:
    """The length of `name`'s lowest mean loss (on its own tokens: every length of a run scores the same ones)."""
    return min(lengths, key=lambda length: cells[name][("test", length, -1)].mean)


def _check_parameters(records: dict) -> float:
    return runs.check_parameters(records, BASELINE, PARAMETER_TOLERANCE, "gin/study/ablation_*.gin")


def train_variants(output_dir: str, data_dir: str, names, *, quick: bool = False,
                   archive_dir: str | None = None) -> tuple[dict, dict, dict]:
    """Trains and scores every seed of the variants `names` (settings.seeds; each scored at the table's lengths
    and the RECL contexts, the baseline also clamped), or reads them from `archive_dir`; returns (records,
    {run: cells}, {variant: [run names by seed]}). The full study requires a clean tree (runs.require_clean_tree)
    and refuses archives trained from uncommitted code; the quick one does not."""
    from txl_tf.data import pipeline

    settings = settings_for(quick)
    archive_dir = archive_dir or os.path.join(output_dir, "archive")
    scored = scored_tokens(pipeline.read_split(data_dir, "test"), settings)
    contexts = tuple(sorted(set(settings.lengths) | set(settings.recl_contexts)))
    clamped = tuple(length for length in settings.lengths if length > settings.train_attention)
    chosen = [v for v in VARIANTS if v.name in names]
    valid = scored_tokens(pipeline.read_split(data_dir, "valid"), settings, "valid") if any(v.vanilla for v in chosen) else None
    records, losses, seeds = {}, {}, {}
    total, done = len(chosen) * len(settings.seeds), 0
    for variant in chosen:
        for seed in settings.seeds:
            done += 1
            spec = run_spec(variant, settings, data_dir, quick, seed=seed)
            records[spec.name], losses[spec.name] = _train_and_score(
                spec, output_dir, scored, settings, contexts, f"[{done}/{total}]", archive_dir,
                clamped if variant.name == BASELINE else (), clean=not quick, valid=valid if variant.vanilla else None)
            records[spec.name]["variant"], records[spec.name]["seed"] = variant.name, seed
            seeds.setdefault(variant.name, []).append(spec.name)
    return records, losses, seeds


def run(output_dir: str, data_dir: str, *, quick: bool = False, with_recl: bool = True,
        archive_dir: str | None = None) -> dict:
    """Trains and scores the six variants, every seed (train_variants), and returns the study's section. Each
    scored run is archived in `archive_dir` (default OUTPUT_DIR/archive) and read back from there.

    Every variant is scored at the RECL contexts too (whether or not this call reports RECL), so that its archive
    serves both studies."""
    from txl_tf.data import pipeline

    settings = settings_for(quick)
    scored = scored_tokens(pipeline.read_split(data_dir, "test"), settings)
    subset = scored.subset()
    clamped = tuple(length for length in settings.lengths if length > settings.train_attention)
    records, losses, seeds = train_variants(output_dir, data_dir, [v.name for v in VARIANTS], quick=quick,
                                            archive_dir=archive_dir)
    first = {v.name: records[v.name] for v in VARIANTS}
    deviation = _check_parameters(first)
    vanilla = frozenset(name for name, record in records.items() if record["protocol"] == "vanilla")

    # The ranking of the first seeds at their best lengths (descriptive: read off the test split).
    best = {v.name: _best_length(losses, v.name, settings.lengths) for v in VARIANTS}
    on_subset = _subset_losses(losses, list(best))  # ranked on the tokens every variant is scored on
    ranked = sorted(best, key=lambda n: float(np.mean(on_subset[n][best[n]], dtype=np.float64)))
    top = _compare(losses, (ranked[0], best[ranked[0]]), (ranked[1], best[ranked[1]]), settings, vanilla)

    tried = {"xl_clamp": {"run": BASELINE, "clamp_len": settings.train_attention,
                          "bpc": {str(length): losses[BASELINE][("test", length, settings.train_attention)].bits()
                                  for length in clamped}}}

    comparisons = {"top_two": top}
    for variant in VARIANTS[1:]:
        n = variant.name
        comparisons[f"{BASELINE}_vs_{n}"] = _compare(losses, (BASELINE, best[BASELINE]), (n, best[n]), settings,
                                                     vanilla)
        comparisons[f"{BASELINE}_vs_{n}_init"] = _compare(
            losses, (BASELINE, settings.train_attention), (n, settings.train_attention), settings, vanilla)
    windows = vanilla_windows(records, seeds)
    for n, claim in seed_claims(losses, seeds, settings.train_attention, settings, vanilla, windows).items():
        comparisons[f"{BASELINE}_vs_{n}_seeds"] = claim
    comparisons.update(vanilla_claims(losses, records, seeds, settings, vanilla))
    old = plan_v1_claim(losses, archive_dir or os.path.join(output_dir, "archive"),
                        _facts(scored, settings, tuple(sorted(set(settings.lengths) | set(settings.recl_contexts))),
                               ()), settings)
    if old is not None:
        comparisons[f"{BASELINE}_vs_al_rfou_v1"] = old
    for variant in VARIANTS:  # does a longer attention at evaluation help? (best length against the training one)
        n = variant.name
        comparisons[f"{n}_longer"] = _compare(losses, (n, best[n]), (n, settings.train_attention), settings,
                                              vanilla)

    section = {
        "quick": quick,
        "machine": runs.machine(),
        "setup": {"dataset": os.path.basename(os.path.normpath(data_dir)), "split": "test",
                  "train_attention": settings.train_attention, "lengths": list(settings.lengths),
                  "split_tokens": int(scored.tokens.shape[0]), "whole_split": not settings.max_tokens,
                  "streams": scored.batch_size, "dropped_per_stream": scored.drop, "kept_tokens": scored.count,
                  "vanilla_subset_tokens": int(subset.shape[0]), "bootstrap_block": settings.bootstrap_block,
                  "eval_tgt_len": settings.eval_tgt_len, "parameter_deviation": deviation,
                  "variants": [dataclasses.asdict(v) | {"quick_params": list(v.quick_params)} for v in VARIANTS]},
        "runs": records,
        "best_length": best,
        "ranking": ranked,
        "seeds": seeds,
        "plan": "docs/study_plan.md, version 1, docs/study_plan_v2.md and docs/study_plan_v3.md (the vanilla "
                "baseline)",
        "comparisons": comparisons,
        "tried": tried,
    }
    if with_recl:
        from txl_tf.study import evidence

        section["recl"] = recl_section(_subset_losses(losses, [v.name for v in VARIANTS]), settings)
        section["recl"]["tokens"] = int(subset.shape[0])
        section["recl"]["by_seed"] = recl_by_seed(losses, seeds, settings)
        section["recl"]["verdict"] = evidence.longest_recl_verdict(section["recl"]["by_seed"], BASELINE)
    return section


def _recl_group(losses: dict, names, contexts, best_up_to: bool) -> dict:
    """RECL at r = 0.1, 0.5, 1.0 of a group.

    best_up_to: score each model at context c with the attention length <= c that gives its lowest mean loss (a
    model can always use less context than it is offered; the paper scores its vanilla Transformer at its
    training window); otherwise at exactly c, as appendix C reads.
    """
    from txl_tf.analysis import recl

    scored_at = {}
    for n in names:
        means = {c: float(np.mean(losses[n][c], dtype=np.float64)) for c in contexts}
        scored_at[n] = [min((x for x in contexts if x <= c), key=means.get) if best_up_to else c for c in contexts]
    group = np.stack([np.stack([losses[n][c] for c in scored_at[n]]) for n in names])  # [models, C, T]
    out = {"contexts": list(contexts), "models": list(names), "best_up_to": best_up_to, "scored_at": scored_at,
           "ratios": {}}
    for r in recl.PAPER_RATIOS:
        result = recl.compute_recl(group, contexts, r=r)
        out["ratios"][str(r)] = {"recl": [int(x) for x in result.recl], "truncated": [bool(x) for x in result.truncated],
                                 "gains": np.round(result.gains, 6).tolist()}
    return out


def recl_by_seed(losses: dict, seeds: dict, settings: AblationSettings, names=PAPER_GROUP) -> list[dict]:
    """RECL of the group `names` once per seed (the group of seed k of every model), each at exactly each context
    of the grid as appendix C reads, with each model's noise share (evidence.recl_noise_share), and the verdict
    "XL has the longest RECL" at r = 0.1 over the seeds (docs/study_plan.md, section 6)."""
    from txl_tf.study import evidence

    contexts = tuple(settings.recl_contexts)
    out = []
    for k in range(min(len(seeds[n]) for n in names)):
        runs_k = [seeds[n][k] for n in names]
        on_subset = _subset_losses(losses, runs_k)
        group = np.stack([np.stack([on_subset[run][c] for c in contexts]) for run in runs_k])  # [models, C, T]
        out.append({"seed": k + 1, "models": list(names), "runs": runs_k, "contexts": list(contexts),
                    "ratios": evidence.recl_with_noise(group, contexts)})
    return out


def recl_section(losses: dict, settings: AblationSettings) -> dict:
    """RECL of the six first-seed models as appendix C reads, and of the paper's Table 6 group (PAPER_GROUP) with
    every model at its best attention length up to each context."""
    contexts = tuple(settings.recl_contexts)
    out = _recl_group(losses, [v.name for v in VARIANTS], contexts, best_up_to=False)
    out["paper_group"] = _recl_group(losses, PAPER_GROUP, contexts, best_up_to=True)
    return out
