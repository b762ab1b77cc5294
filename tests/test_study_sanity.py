"""The study's sanity check on a model's cells (txl_tf.study.sanity): it fails on the archived vanilla model of the
context study, which scored worse at its own 256-character training window than at 128 (issue 54), and passes on
the archived recurrent models of the same study. The studies run it on every vanilla model's validation cells and
report it beside every verdict that involves the model (docs/study_plan_v3.md; version 2 stopped on it); the
ablation scores its vanilla model at the window chosen on validation."""

import json
import math
import pathlib
import shutil

import numpy as np
import pytest

from txl_tf.study import ablation, archive, context, sanity
from txl_tf.study.runs import StudyError

ARCHIVE = pathlib.Path(__file__).absolute().parents[1] / "studies" / "archive"
PLAN_V1 = ARCHIVE / "plan_v1"  # the vanilla models of study v3 (docs/study_plan_v3.md)


def _path(run: str, suffix: str = ".json") -> pathlib.Path:
    return (PLAN_V1 if run.endswith("al_rfou") else ARCHIVE) / f"{run}{suffix}"
LN2 = math.log(2.0)


def _means(run: str) -> dict:
    """{(split, window, clamp): mean nats} of an archive's final cells, read from its JSON."""
    index = json.loads(_path(run).read_text())
    out = {}
    for cell in index["cells"]["final"]:
        split, window, clamp = cell["key"].split("/")
        out[(split, int(window), int(clamp))] = cell["mean"]
    return out


def test_the_archived_vanilla_model_fails_the_check():
    cells = _means("context_al_rfou")
    assert round(cells[("test", 256, -1)] / LN2, 4) == 2.7671 and round(cells[("test", 128, -1)] / LN2, 4) == 2.5881
    problems = sanity.own_window_problems(cells, 256, name="al_rfou")
    assert len(problems) == 6  # 64, 128 and 192 on valid and on test
    assert ("al_rfou is 0.1790 bpc worse at its own training window 256 (2.7671) than at 128 (2.5881) on test"
            in problems)
    report = sanity.vanilla_report(cells, 256, name="al_rfou")
    assert not report["passed"] and len(report["problems"]) == 3  # the validation split only
    assert report["worst"]["low"] is None  # plain means: no interval


@pytest.mark.parametrize("run, own", [("context_xl", 128), ("context_no_recurrence", 128)])
def test_the_archived_recurrent_models_pass(run, own):
    """Their own window is the training memory (128; segments of 128 make the training span 256)."""
    cells = _means(run)
    assert any(window < own for _, window, _ in cells)  # there is a shorter window to compare with
    assert sanity.own_window_problems(cells, own, name=run) == []


def test_only_shorter_windows_of_the_same_split_and_clamp_count_and_noise_is_tolerated():
    bpc = {("valid", 64, -1): 2.000, ("valid", 128, -1): 2.005, ("valid", 256, -1): 1.5,  # longer and better: fine
           ("test", 64, 8): 1.0, ("test", 128, -1): 2.3,  # another clamp: not compared
           ("test", 32, -1): 2.2}
    cells = {key: value * LN2 for key, value in bpc.items()}
    assert sanity.own_window_problems(cells, 128, name="m") == [
        "m is 0.1000 bpc worse at its own training window 128 (2.3000) than at 32 (2.2000) on test"]
    assert sanity.own_window_problems(cells, 128, name="m", tolerance=0.2) == []
    assert sanity.own_window_problems(cells, 512, name="m") == []  # its own window was not scored
    assert sanity.own_window_problems({("valid", 64, 3): 2.0 * LN2, ("valid", 128, 3): 2.1 * LN2}, 128,
                                      name="m") == ["m is 0.1000 bpc worse at its own training window 128 (2.1000) "
                                                    "than at 64 (2.0000) on valid, clamp 3"]


# ---- the check in the studies (docs/study_plan_v2.md): on the vanilla model's validation cells ----------------------

def _archived(run: str) -> tuple[dict, dict]:
    """(the archive's index, its (record, scores) as the study reads them back), under its own digest and facts."""
    index = json.loads(_path(run).read_text())
    return index, archive.load(str(_path(run).parent), run, index["facts"], index["digest"])


def _cells(bpc: dict, block: int = 10, blocks: int = 20) -> dict:
    """{key: archive.Cell} of `blocks` x `block` tokens, every one's loss bpc[key]."""
    return {key: archive.Cell.of(np.full(blocks * block, value * LN2), block) for key, value in bpc.items()}


def test_the_archived_vanilla_model_is_reported_not_a_stop(tmp_path, monkeypatch):
    """Read back from its archive as the study reads it (train_and_score), the old vanilla model fails on its
    validation cells: the record says so with one line naming the validation split only, and the study goes on
    (docs/study_plan_v3.md: reported beside its verdicts, no longer a stop)."""
    index, (record, scores) = _archived("context_al_rfou")
    model = next(m for m in context.MODELS if m.name == "al_rfou")
    report = context.check_sanity(model, "context_al_rfou", scores["cells"], context.FULL)
    assert not report["passed"] and report["own"] == 256 and report["split"] == "valid"
    assert len(report["problems"]) >= 1
    assert all(line.startswith("context_al_rfou is ") and line.endswith(" on valid") for line in report["problems"])
    worst = report["worst"]
    assert worst["window"] < 256 and worst["worse_bpc"] > sanity.TOLERANCE
    assert 0.0 < worst["low"] <= worst["worse_bpc"] <= worst["high"]  # beyond the noise: the interval excludes 0
    line = sanity.report_line(report)
    assert line.startswith("sanity check FAILED on validation: +") and "\n" not in line
    # The same through train_and_score, with the archive under the current spec (its gin bindings changed since).
    spec = context.run_spec(model, context.FULL, "data/enwik8_sample", quick=False)
    for suffix in (".json", ".npz"):
        shutil.copy(_path("context_al_rfou", suffix), tmp_path / f"context_al_rfou{suffix}")
    (tmp_path / "context_al_rfou.json").write_text(json.dumps(index | {"digest": spec.digest(portable=True)}))
    monkeypatch.setattr(context, "archive_facts", lambda *args: index["facts"])
    read, _ = context.train_and_score(model, str(tmp_path / "out"), "data/enwik8_sample", None, context.FULL,
                                      quick=False, archive_dir=str(tmp_path))
    assert read["sanity"] == report
    # A recurrent model's archive passes through unchecked (it chooses its memory on the validation split).
    _, (_, xl) = _archived("context_xl")
    assert context.check_sanity(context.MODELS[0], "context_xl", xl["cells"], context.FULL) is None


def test_a_good_vanilla_model_passes_and_noise_is_not_a_failure():
    model = next(m for m in context.MODELS if m.name == "al_rfou")
    good = _cells({("valid", 64, -1): 2.2, ("valid", 128, -1): 2.1, ("valid", 256, -1): 2.0,
                   ("test", 128, -1): 1.0, ("test", 256, -1): 2.0})  # the test split is not read
    report = context.check_sanity(model, "al_rfou", good, context.FULL)
    assert report["passed"] and report["problems"] == []
    assert report["worst"]["window"] == 128 and report["worst"]["worse_bpc"] == pytest.approx(-0.1)
    assert sanity.report_line(report).startswith("sanity check passed on validation: -0.1000 bpc at its own window "
                                                 "256 against 128")
    # 0.02 bpc worse at 256 on every block: beyond the noise.
    steady = _cells({("valid", 128, -1): 2.0, ("valid", 256, -1): 2.02})
    report = context.check_sanity(model, "al_rfou", steady, context.FULL)
    assert not report["passed"] and "0.0200 bpc worse" in report["problems"][0]
    # 0.02 bpc worse on average, but the paired blocks scatter by far more: within the evaluation noise.
    rng = np.random.default_rng(0)
    scatter = rng.normal(scale=0.5, size=200)
    noisy = {("valid", 128, -1): archive.Cell.of(2.0 * LN2 + scatter, 10),
             ("valid", 256, -1): archive.Cell.of(2.02 * LN2 + scatter[::-1], 10)}
    assert sanity.own_window_problems(noisy, 256, name="al_rfou") == []
    report = sanity.vanilla_report(noisy, 256, name="al_rfou", block=10)
    assert report["passed"] and report["worst"]["low"] < 0.0 < report["worst"]["high"]


def test_the_window_is_chosen_on_validation():
    """docs/study_plan_v3.md, section 2: the lowest validation bpc among the candidates, ties to the longer window;
    the test split is not read; a candidate not scored is one line."""
    windows = (32, 64, 96, 112, 128)
    bpc = {32: 2.3, 64: 2.1, 96: 2.05, 112: 2.07, 128: 2.09}
    cells = _means_of({("valid", w, -1): b for w, b in bpc.items()} | {("test", 32, -1): 0.1})
    assert sanity.choose_window(cells, windows) == 96
    assert sanity.choose_window(cells | _means_of({("valid", 112, -1): 2.05}), windows) == 112  # a tie
    with pytest.raises(StudyError, match=r"^the validation split was not scored at window\(s\) \[112\]"):
        sanity.choose_window({k: v for k, v in cells.items() if k[1] != 112}, windows)


def _means_of(bpc: dict) -> dict:
    return {key: value * LN2 for key, value in bpc.items()}


def _ablation_vanilla(tmp_path, valid_bpc: dict, test_windows) -> tuple:
    """(spec, scored, valid, contexts, settings) with an archive of the quick vanilla variant whose validation
    cells have `valid_bpc` and whose test cells are at `test_windows` (every one 2.0 nats a token)."""
    settings = ablation.QUICK
    tokens = np.arange(settings.max_tokens) % 7
    scored = ablation.scored_tokens(tokens, settings)
    valid = ablation.scored_tokens(tokens, settings, "valid")
    variant = next(v for v in ablation.VARIANTS if v.vanilla)
    spec = ablation.run_spec(variant, settings, "data", quick=True)
    contexts = tuple(sorted(set(settings.lengths) | set(settings.recl_contexts)))
    facts = ablation._facts(scored, settings, contexts, (), valid)
    n = len(scored.subset())
    cells = {("test", c, -1): archive.Cell.of(np.full(n, 2.0), settings.bootstrap_block, np.arange(n))
             for c in test_windows}
    cells |= _cells({("valid", w, -1): b for w, b in valid_bpc.items()}, block=settings.bootstrap_block, blocks=4)
    record = {"commit": "0123456789ab", "protocol": "vanilla"}
    archive.save(str(tmp_path), "ablation_al_rfou", spec.digest(portable=True), record, {"cells": cells, "probe": {}},
                 facts)
    return spec, scored, valid, contexts, settings


def test_the_ablation_chooses_the_vanilla_window_on_validation_and_reports_the_check(tmp_path):
    """The ablation's vanilla variant also scores the validation split at settings.valid_windows (the quick
    settings: 8 to 32): the lowest chooses the window its test split is scored at, and the sanity check at its
    training window 32 is recorded, not a stop (docs/study_plan_v3.md)."""
    settings = ablation.QUICK
    assert settings.valid_windows == (8, 16, 24, 28, 32) and ablation.FULL.valid_windows == (32, 64, 96, 112, 128)
    worse_at_own = {8: 2.6, 16: 2.0, 24: 2.1, 28: 2.3, 32: 2.5}
    spec, scored, valid, contexts, _ = _ablation_vanilla(tmp_path, worse_at_own, set(contexts_of(settings)) | {16})
    assert spec.gin_params[-1] == "ModelConfig.max_position = 31"  # after the quick model's 32: a window of 32
    facts = ablation._facts(scored, settings, contexts, (), valid)
    assert facts["sanity"]["windows"] == [8, 16, 24, 28, 32] and facts["sanity"]["plan"] == 3
    record, read = ablation._train_and_score(spec, str(tmp_path / "out"), scored, settings, contexts, "[1/1]",
                                             str(tmp_path), valid=valid)
    assert record["window"] == 16
    assert not record["sanity"]["passed"] and record["sanity"]["worst"]["window"] == 16
    assert record["sanity"]["problems"][0].startswith("ablation_al_rfou is 0.5000 bpc worse at its own training "
                                                      "window 32")
    assert ("test", 16, -1) in read
    # An archive without the test cell at its chosen window is refused with one line naming it.
    spec, scored, valid, contexts, _ = _ablation_vanilla(tmp_path, worse_at_own, contexts_of(settings))
    with pytest.raises(StudyError, match=r"ablation_al_rfou\.json has no test cell at window 16, the window chosen "
                                         r"on validation; remove the archive"):
        ablation._train_and_score(spec, str(tmp_path / "out"), scored, settings, contexts, "[1/1]", str(tmp_path),
                                  valid=valid)
    # A model best at its own window keeps it and passes.
    best_at_own = {8: 2.6, 16: 2.5, 24: 2.4, 28: 2.3, 32: 2.0}
    spec, scored, valid, contexts, _ = _ablation_vanilla(tmp_path, best_at_own, contexts_of(settings))
    record, _ = ablation._train_and_score(spec, str(tmp_path / "out"), scored, settings, contexts, "[1/1]",
                                          str(tmp_path), valid=valid)
    assert record["window"] == 32 and record["sanity"]["passed"]


def contexts_of(settings) -> tuple:
    return tuple(sorted(set(settings.lengths) | set(settings.recl_contexts)))


def test_the_vanilla_verdict_under_plans_v2_and_v3():
    """XL against the vanilla model over seeds: under plan v3 each vanilla seed at its validation-chosen window,
    with every seed's check beside it; under plan v2 at its own window, withheld where a seed fails the check."""
    settings = ablation.QUICK
    block, n = settings.bootstrap_block, 200
    rng = np.random.default_rng(3)

    def cell(mean):
        losses = (mean + 0.05 * rng.normal(size=n)).astype(np.float32)
        return archive.Cell.of(losses, block, np.arange(n))

    own = settings.train_attention
    cells, records, seeds = {}, {}, {}
    for k, (chosen, passed) in enumerate(((16, False), (32, True)), start=1):
        for name, at in (("xl", {own: 1.0}), ("al_rfou", {own: 1.6, 16: 1.3})):
            run = name if k == 1 else f"{name}_seed{k}"
            cells[run] = {("test", w, -1): cell(m) for w, m in at.items()}
            records[run] = {"protocol": "vanilla" if name == "al_rfou" else "xl"}
            if name == "al_rfou":
                records[run] |= {"window": chosen,
                                 "sanity": {"passed": passed, "problems": [] if passed else ["worse"]}}
            seeds.setdefault(name, []).append(run)
    claims = ablation.vanilla_claims(cells, records, seeds, settings, frozenset({"al_rfou", "al_rfou_seed2"}))
    v3, v2 = claims["xl_vs_al_rfou_seeds"], claims["xl_vs_al_rfou_seeds_v2"]
    assert v3["plan"] == 3 and v3["windows"] == [16, 32] and v3["b"] == ["al_rfou", [16, 32]]
    assert [c["b"] for c in v3["per_seed"]] == [["al_rfou", 16], ["al_rfou_seed2", 32]]
    assert v3["per_seed"][0]["mean"] == pytest.approx(-0.3 / LN2, abs=0.02)
    assert v3["per_seed"][1]["mean"] == pytest.approx(-0.6 / LN2, abs=0.02)
    assert [r["passed"] for r in v3["sanity"]] == [False, True]
    assert v2["plan"] == 2 and v2["withheld"] == ["al_rfou"] and v2["b"] == ["al_rfou", own]
    assert all(c["mean"] == pytest.approx(-0.6 / LN2, abs=0.02) for c in v2["per_seed"])


def test_the_old_vanilla_archives_are_not_reused_for_the_new_model():
    """The fix is a gin binding of the vanilla runs' specs (a table of one row fewer than the window, as their gin
    files bind it), so their digests differ from the archives' (an archive of the old model is refused, never read
    as the new one); the other models' specs are unchanged."""
    gin_dir = pathlib.Path(__file__).absolute().parents[1] / "gin" / "study"
    for gin_file, window in (("ablation_al_rfou.gin", 128), ("context_al_rfou.gin", 256)):
        text = (gin_dir / gin_file).read_text()
        assert f"TrainConfig.tgt_len = {window}\n" in text
        assert f"{ablation.vanilla_params(window)[0]}\n" in text
    vanilla = next(m for m in context.MODELS if m.vanilla)
    for run, window, spec in (
            ("context_al_rfou", 256, context.run_spec(vanilla, context.FULL, "data/enwik8_sample", quick=False)),
            ("ablation_al_rfou", 128, ablation.run_spec(next(v for v in ablation.VARIANTS if v.vanilla),
                                                        ablation.FULL, "data/enwik8_sample", quick=False))):
        assert spec.gin_params[-1] == f"ModelConfig.max_position = {window - 1}"
        index = json.loads(_path(run).read_text())
        assert index["digest"] != spec.digest(portable=True), run
        # The old archive moved to plan_v1/, so a study here trains the new model; an archive of that new model
        # (plan v3's runs, seed 1 under the plain name) may stand in its place, never the old one.
        current = ARCHIVE / f"{run}.json"
        assert not current.exists() or json.loads(current.read_text())["digest"] == spec.digest(portable=True), run
    xl = json.loads((ARCHIVE / "context_xl.json").read_text())
    assert xl["digest"] == context.run_spec(context.MODELS[0], context.FULL, "x", quick=False).digest(portable=True)


def test_the_plan_v1_verdict_reads_the_old_vanilla_archive():
    """Plan v1's vanilla verdict (docs/study_plan_v3.md, section 2) reads study v3's model from
    studies/archive/plan_v1 under its own spec: XL's first seed against it at the training length, on the vanilla
    subset; an archive scored on other tokens gives none."""
    index, (_, xl) = _archived("ablation_xl")
    facts = index["facts"] | {"clamped": []}  # the vanilla variant's facts: no clamped cells
    claim = ablation.plan_v1_claim({"xl": xl["cells"]}, str(ARCHIVE), facts, ablation.FULL)
    _, (_, old) = _archived("ablation_al_rfou")
    expected = archive.compare_subset([xl["cells"][("test", 128, -1)]], [old["cells"][("test", 128, -1)]], 100)
    assert claim["plan"] == 1 and claim["a"] == ["xl", 128] and claim["b"] == ["al_rfou_plan_v1", 128]
    assert claim["mean"] == pytest.approx(expected["mean"]) and claim["low"] < claim["mean"] < claim["high"]
    assert claim["sanity"]["worst"] is None  # study v3's ablation scored no validation windows
    assert ablation.plan_v1_claim({"xl": xl["cells"]}, str(ARCHIVE), facts | {"split_tokens": 1}, ablation.FULL) is None
    assert ablation.plan_v1_claim({"xl": xl["cells"]}, str(ARCHIVE / "nowhere"), facts, ablation.FULL) is None


def test_the_context_study_reports_each_vanilla_verdict_under_plans_v3_v2_v1(monkeypatch):
    """The context study's vanilla verdict: the headline (plan v3) with every seed's check beside it, plan v2's
    withheld where a seed fails, and plan v1's from study v3's archive in studies/archive/plan_v1 (XL's first
    seed against it, each at its best memory on validation, on the vanilla subset)."""
    from txl_tf.study import context_results, evidence, report_context

    index, (_, xl) = _archived("context_xl")
    old_index, (_, old) = _archived("context_al_rfou")
    monkeypatch.setattr(context, "archive_facts", lambda *args: old_index["facts"])
    claim = context_results.plan_v1_claim({"xl": xl}, str(ARCHIVE), None, context.FULL, "data/enwik8_sample",
                                          False, context.CORPORA[0])
    expected = archive.compare_subset([xl["cells"][("test", *context_results._best(xl["cells"], context.FULL))]],
                                      [old["cells"][("test", *context_results._best(old["cells"], context.FULL))]],
                                      context.FULL.block)
    assert claim["plan"] == 1 and claim["mean"] == pytest.approx(expected["mean"]) and claim["mean"] < 0
    assert not claim["sanity"]["passed"]  # study v3's vanilla model fails it (the test above)
    monkeypatch.setattr(context, "archive_facts", lambda *args: old_index["facts"] | {"block": 7})
    assert context_results.plan_v1_claim({"xl": xl}, str(ARCHIVE), None, context.FULL, "data/enwik8_sample",
                                         False, context.CORPORA[0]) is None

    good = sanity.vanilla_report(_cells({("valid", 128, -1): 2.1, ("valid", 256, -1): 2.0}), 256, name="s1", block=10)
    bad = sanity.vanilla_report(_cells({("valid", 128, -1): 2.0, ("valid", 256, -1): 2.1}), 256, name="s2", block=10)
    decided = evidence.decide({"xl_vs_al_rfou": [-0.5, -0.6, -0.55]})["xl_vs_al_rfou"]
    section = {"by_seed": {"sanity": {"al_rfou": [good, bad, good]}}, "comparisons": {"xl_vs_al_rfou_v1": claim}}
    rows = report_context._vanilla_rows(section, "XL beats vanilla", "paper", decided)
    assert [r[0] for r in rows] == ["XL beats vanilla", "XL beats vanilla (plan v2)",
                                    "XL beats vanilla (plan v1: study v3's vanilla model, seed 1)"]
    assert rows[0][3] == decided["verdict"] and "seed 2: sanity check FAILED on validation" in rows[0][2]
    assert rows[1][3] == "no verdict: the baseline fails its sanity check (seed 2)"
    assert rows[2][3].startswith("undecided (1 seed, the plan needs 3; alone: ")
