"""Sanity checks on a scored model's cells, before any verdict reads them.

    own_window_problems   where a model is worse at its own training window than at a shorter one
    check_own_window      the same as one StudyError line
    check_vanilla         check_own_window on a vanilla model's validation cells: what the studies run on every
                          model scored with a fixed window (docs/study_plan_v2.md)

A model scored at its training window has seen exactly that context in training, so a shorter window (less
context, the same scored tokens) should not beat it by more than noise. The vanilla model of the context study
once did (test: 2.7671 bpc at its 256-character window, 2.5881 at 128): a model trained with learned absolute
positions is worst at the last row of its table, the only row no later query attends to, and the sliding window
scores only that position. A baseline in that state is not the baseline a comparison needs.

Cells are `{(split, window, clamp): mean loss in nats}` (an `archive.Cell` works too: its `mean` is read), the
keys as the study's archives hold them: "window" is the vanilla model's window and a recurrent model's memory.
A shorter window counts as beyond noise when it wins by more than `tolerance` bpc and, where both cells are
`archive.Cell`s of the same tokens, the 95% paired block bootstrap of the difference excludes zero (plan v1,
section 5: "beyond its evaluation noise"); plain means are judged by the tolerance alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from txl_tf.study.runs import StudyError, bootstrap_blocks

TOLERANCE = 0.01  # bpc a shorter window may beat the model's own by before the check fails (paired noise)


def _bits(value) -> float:
    return float(getattr(value, "mean", value)) / math.log(2.0)


def _within_noise(mine, value) -> bool:
    """Whether the paired block bootstrap of mine - value (archive Cells of the same tokens) reaches zero; False
    when either is a plain mean."""
    a, b = getattr(mine, "block_sums", None), getattr(value, "block_sums", None)
    if a is None or b is None or a.shape != b.shape or not a.size:
        return False
    return bootstrap_blocks(0.0, a - b)["low"] <= 0.0


def own_window_problems(cells: Mapping, own: int, *, name: str, tolerance: float = TOLERANCE) -> list[str]:
    """One line per (split, clamp, shorter window) where `name` at window `own` is more than `tolerance` bpc worse
    than at the shorter window (all of them, in key order); [] when none is, or when `own` was not scored."""
    problems = []
    for (split, window, clamp), value in sorted(cells.items()):
        mine = cells.get((split, own, clamp))
        if window >= own or mine is None:
            continue
        worse = _bits(mine) - _bits(value)
        if worse > tolerance and not _within_noise(mine, value):
            where = split if clamp == -1 else f"{split}, clamp {clamp}"
            problems.append(f"{name} is {worse:.4f} bpc worse at its own training window {own} "
                            f"({_bits(mine):.4f}) than at {window} ({_bits(value):.4f}) on {where}")
    return problems


def check_own_window(cells: Mapping, own: int, *, name: str, tolerance: float = TOLERANCE) -> None:
    """Raises a one-line StudyError listing `own_window_problems`, if any."""
    problems = own_window_problems(cells, own, name=name, tolerance=tolerance)
    if problems:
        raise StudyError("; ".join(problems) + f" (by more than {tolerance} bpc): a comparison with it would rest on "
                         "a score its own training context makes worse; diagnose the model before comparing with it")


def check_vanilla(cells: Mapping, own: int, *, name: str, tolerance: float = TOLERANCE) -> None:
    """`check_own_window` on the validation cells of a model scored with a fixed window (the vanilla protocol):
    the split the studies choose on, never the test split (docs/study_plan_v2.md)."""
    check_own_window({key: value for key, value in cells.items() if key[0] == "valid"}, own, name=name,
                     tolerance=tolerance)
