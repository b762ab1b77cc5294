"""Sanity checks on a scored model's cells, before any verdict reads them.

    own_window_problems   where a model is worse at its own training window than at a shorter one
    vanilla_report        own_window_problems on a vanilla model's validation cells, as the record the studies
                          archive and print for every model scored with a fixed window (docs/study_plan_v3.md:
                          reported beside each verdict that involves it, no longer a stop)
    report_line, seeds_line
                          one record, or every seed's, as one line of the reports
    choose_window         the window of lowest validation bpc among candidates (docs/study_plan_v3.md)

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


def _shorter(cells: Mapping, own: int):
    """(split, window, clamp, mine, value, worse) for each cell at a window shorter than `own` whose split and clamp
    were also scored at `own`, in key order: `worse` is mine - value in bits per token."""
    for (split, window, clamp), value in sorted(cells.items()):
        mine = cells.get((split, own, clamp))
        if window < own and mine is not None:
            yield split, window, clamp, mine, value, _bits(mine) - _bits(value)


def own_window_problems(cells: Mapping, own: int, *, name: str, tolerance: float = TOLERANCE) -> list[str]:
    """One line per (split, clamp, shorter window) where `name` at window `own` is more than `tolerance` bpc worse
    than at the shorter window (all of them, in key order); [] when none is, or when `own` was not scored."""
    problems = []
    for split, window, clamp, mine, value, worse in _shorter(cells, own):
        if worse > tolerance and not _within_noise(mine, value):
            where = split if clamp == -1 else f"{split}, clamp {clamp}"
            problems.append(f"{name} is {worse:.4f} bpc worse at its own training window {own} "
                            f"({_bits(mine):.4f}) than at {window} ({_bits(value):.4f}) on {where}")
    return problems


def vanilla_report(cells: Mapping, own: int, *, name: str, block: int | None = None,
                   tolerance: float = TOLERANCE) -> dict:
    """The sanity check of docs/study_plan_v2.md on the validation cells of a model scored with a fixed window,
    never the test split, as a record (docs/study_plan_v3.md): {"split": "valid", "own": own, "passed",
    "problems": own_window_problems' lines, "worst": None or {"window": the shorter window it is most worse
    than, "worse_bpc", "low", "high": the 95% paired block bootstrap of that difference in bits per token where
    the cells are archive Cells of the same tokens and `block` (their tokens per block) is given, else None}}."""
    valid = {key: value for key, value in cells.items() if key[0] == "valid"}
    problems = own_window_problems(valid, own, name=name, tolerance=tolerance)
    shorter = list(_shorter(valid, own))
    if not shorter:
        return {"split": "valid", "own": int(own), "passed": not problems, "problems": problems, "worst": None}
    _, window, _, mine, value, worse = max(shorter, key=lambda entry: entry[5])  # the first of equals, as before
    low = high = None
    a, b = getattr(mine, "block_sums", None), getattr(value, "block_sums", None)
    if block and a is not None and b is not None and a.shape == b.shape and a.size:
        interval = bootstrap_blocks(0.0, (a - b) / block)
        low, high = interval["low"] / math.log(2.0), interval["high"] / math.log(2.0)
    return {"split": "valid", "own": int(own), "passed": not problems, "problems": problems,
            "worst": {"window": int(window), "worse_bpc": float(worse), "low": low, "high": high}}


def report_line(report: dict) -> str:
    """One line of a vanilla_report, as the study prints it and the report shows it beside a verdict."""
    worst = report["worst"]
    if worst is None:
        return f"sanity check: own window {report['own']} not scored against a shorter one"
    where = f"{worst['worse_bpc']:+.4f} bpc at its own window {report['own']} against {worst['window']}"
    if worst["low"] is not None:
        where += f" (95% paired block bootstrap {worst['low']:+.4f} to {worst['high']:+.4f})"
    return f"sanity check {'passed' if report['passed'] else 'FAILED'} on validation: {where}"


def seeds_line(reports) -> str:
    """Every seed's check on one line, as the reports show it beside a vanilla verdict (docs/study_plan_v3.md):
    "seed 1: sanity check passed ...; seed 2: ..." (a seed without a record says so)."""
    return "; ".join(f"seed {k}: {report_line(r)}" if r else f"seed {k}: no check recorded"
                     for k, r in enumerate(reports, start=1))


def choose_window(cells: Mapping, windows) -> int:
    """The window among `windows` of lowest bpc on the validation cells (unclamped), ties to the longer one
    (docs/study_plan_v3.md, section 2); a StudyError naming the missing windows when some were not scored."""
    missing = [w for w in windows if ("valid", w, -1) not in cells]
    if missing:
        raise StudyError(f"the validation split was not scored at window(s) {missing}: cannot choose the window")
    return min(windows, key=lambda w: (_bits(cells[("valid", w, -1)]), -w))
