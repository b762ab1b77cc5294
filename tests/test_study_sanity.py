"""The study's sanity check on a model's cells (txl_tf.study.sanity): it fails on the archived vanilla model of the
context study, which scored worse at its own 256-character training window than at 128 (issue 54), and passes on
the archived recurrent models of the same study. The studies run it on every vanilla model's validation cells, and
the old vanilla archives stop them (docs/study_plan_v2.md)."""

import json
import math
import pathlib
import shutil

import numpy as np
import pytest

from txl_tf.study import ablation, archive, context, sanity
from txl_tf.study.runs import StudyError

ARCHIVE = pathlib.Path(__file__).absolute().parents[1] / "studies" / "archive"
LN2 = math.log(2.0)


def _means(run: str) -> dict:
    """{(split, window, clamp): mean nats} of an archive's final cells, read from its JSON."""
    index = json.loads((ARCHIVE / f"{run}.json").read_text())
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
    with pytest.raises(StudyError, match=r"^al_rfou is .* at 128 \(2\.5881\) on test;") as raised:
        sanity.check_own_window(cells, 256, name="al_rfou")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("run, own", [("context_xl", 128), ("context_no_recurrence", 128)])
def test_the_archived_recurrent_models_pass(run, own):
    """Their own window is the training memory (128; segments of 128 make the training span 256)."""
    cells = _means(run)
    assert any(window < own for _, window, _ in cells)  # there is a shorter window to compare with
    sanity.check_own_window(cells, own, name=run)


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
    index = json.loads((ARCHIVE / f"{run}.json").read_text())
    return index, archive.load(str(ARCHIVE), run, index["facts"], index["digest"])


def _cells(bpc: dict, block: int = 10, blocks: int = 20) -> dict:
    """{key: archive.Cell} of `blocks` x `block` tokens, every one's loss bpc[key]."""
    return {key: archive.Cell.of(np.full(blocks * block, value * LN2), block) for key, value in bpc.items()}


def test_the_archived_vanilla_model_stops_the_context_study(tmp_path, monkeypatch):
    """Read back from its archive as the study reads it (train_and_score), the old vanilla model fails on its
    validation cells: one line, naming the validation split only."""
    index, (record, scores) = _archived("context_al_rfou")
    model = next(m for m in context.MODELS if m.name == "al_rfou")
    with pytest.raises(StudyError, match=r"^context_al_rfou is .* on valid;") as raised:
        context.check_sanity(model, "context_al_rfou", scores["cells"], context.FULL)
    assert "\n" not in str(raised.value) and " on test" not in str(raised.value)
    # The same through train_and_score, with the archive under the current spec (its gin bindings changed since).
    spec = context.run_spec(model, context.FULL, "data/enwik8_sample", quick=False)
    for suffix in (".json", ".npz"):
        shutil.copy(ARCHIVE / f"context_al_rfou{suffix}", tmp_path / f"context_al_rfou{suffix}")
    (tmp_path / "context_al_rfou.json").write_text(json.dumps(index | {"digest": spec.digest(portable=True)}))
    monkeypatch.setattr(context, "archive_facts", lambda *args: index["facts"])
    with pytest.raises(StudyError, match=r"^context_al_rfou is .* worse at its own training window 256"):
        context.train_and_score(model, str(tmp_path / "out"), "data/enwik8_sample", None, context.FULL, quick=False,
                                archive_dir=str(tmp_path))
    # A recurrent model's archive passes through (it chooses its memory on the validation split).
    _, (_, xl) = _archived("context_xl")
    context.check_sanity(context.MODELS[0], "context_xl", xl["cells"], context.FULL)


def test_a_good_vanilla_model_passes_and_noise_is_not_a_failure():
    model = next(m for m in context.MODELS if m.name == "al_rfou")
    good = _cells({("valid", 64, -1): 2.2, ("valid", 128, -1): 2.1, ("valid", 256, -1): 2.0,
                   ("test", 128, -1): 1.0, ("test", 256, -1): 2.0})  # the test split is not read
    context.check_sanity(model, "al_rfou", good, context.FULL)
    # 0.02 bpc worse at 256 on every block: beyond the noise.
    steady = _cells({("valid", 128, -1): 2.0, ("valid", 256, -1): 2.02})
    with pytest.raises(StudyError, match="0.0200 bpc worse"):
        context.check_sanity(model, "al_rfou", steady, context.FULL)
    # 0.02 bpc worse on average, but the paired blocks scatter by far more: within the evaluation noise.
    rng = np.random.default_rng(0)
    scatter = rng.normal(scale=0.5, size=200)
    noisy = {("valid", 128, -1): archive.Cell.of(2.0 * LN2 + scatter, 10),
             ("valid", 256, -1): archive.Cell.of(2.02 * LN2 + scatter[::-1], 10)}
    assert sanity.own_window_problems(noisy, 256, name="al_rfou") == []


def test_the_ablation_scores_the_vanilla_validation_split_and_stops_on_it(tmp_path):
    """The ablation scores the test split only, at windows >= the training one; its vanilla variant also scores the
    validation split at settings.sanity_windows for the check, archived with it, and a failing archive stops the
    study (here the quick settings: windows 16 and 32)."""
    settings = ablation.QUICK
    tokens = np.arange(settings.max_tokens) % 7
    scored = ablation.scored_tokens(tokens, settings)
    valid = ablation.scored_tokens(tokens, settings, "valid")
    variant = next(v for v in ablation.VARIANTS if v.vanilla)
    assert variant.name == "al_rfou"
    spec = ablation.run_spec(variant, settings, "data", quick=True)
    assert spec.gin_params[-1] == "ModelConfig.max_position = 31"  # after the quick model's 32: a window of 32
    contexts = tuple(sorted(set(settings.lengths) | set(settings.recl_contexts)))
    facts = ablation._facts(scored, settings, contexts, (), valid)
    assert facts["sanity"]["windows"] == [16, 32]
    n = len(scored.subset())
    cells = {("test", c, -1): archive.Cell.of(np.full(n, 2.0), settings.bootstrap_block, np.arange(n))
             for c in contexts}
    bad = cells | _cells({("valid", 16, -1): 2.0, ("valid", 32, -1): 2.5}, block=settings.bootstrap_block, blocks=4)
    record = {"commit": "0123456789ab", "protocol": "vanilla"}
    archive.save(str(tmp_path), "ablation_al_rfou", spec.digest(portable=True), record, {"cells": bad, "probe": {}},
                 facts)
    with pytest.raises(StudyError, match=r"^ablation_al_rfou is 0\.5000 bpc worse at its own training window 32"):
        ablation._train_and_score(spec, str(tmp_path / "out"), scored, settings, contexts, "[1/1]", str(tmp_path),
                                  valid=valid)
    good = cells | _cells({("valid", 16, -1): 2.5, ("valid", 32, -1): 2.0}, block=settings.bootstrap_block, blocks=4)
    archive.save(str(tmp_path), "ablation_al_rfou", spec.digest(portable=True), record, {"cells": good, "probe": {}},
                 facts)
    _, read = ablation._train_and_score(spec, str(tmp_path / "out"), scored, settings, contexts, "[1/1]",
                                        str(tmp_path), valid=valid)
    assert set(ablation._subset_losses({"al_rfou": read}, ["al_rfou"])["al_rfou"]) == set(contexts)  # test only


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
        index = json.loads((ARCHIVE / f"{run}.json").read_text())
        assert index["digest"] != spec.digest(portable=True), run
    xl = json.loads((ARCHIVE / "context_xl.json").read_text())
    assert xl["digest"] == context.run_spec(context.MODELS[0], context.FULL, "x", quick=False).digest(portable=True)
