"""The study's sanity check on a model's cells (txl_tf.study.sanity): it fails on the archived vanilla model of the
context study, which scored worse at its own 256-character training window than at 128 (issue 54), and passes on
the archived recurrent models of the same study."""

import json
import math
import pathlib

import pytest

from txl_tf.study import sanity
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
