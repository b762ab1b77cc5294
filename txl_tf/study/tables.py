"""What the studies and their report share: the paper's figures and groups, and how a comparison reads.

    PAPER        the paper's figures quoted next to ours (report.py and report_context.py)
    PAPER_GROUP  the paper's Table 6 group (ablation.py and context_results.py compute its RECL)
    verdict      "A is better than B" from the 95% interval of A - B
    interval, label, markdown_table   the report's cells and Markdown tables

Nothing here imports another module of the study: each of them imports this one, so the modules of the study
import each other one way only (tests/test_build_targets.py checks the package has no import circle).
"""

from __future__ import annotations

# The paper's figures quoted next to ours (Dai et al., 2019): WikiText-103 perplexities of Table 5 (128M models,
# training attention length 128; "init" is the training memory, "best" the best evaluation memory), RECL of Table 6
# at r = 0.1, Penn Treebank of Table 3 and the baselines the issue names. The ablation's rows quote each variant;
# the context study's rows (`xl_vs_*`, `longer_memory_*`, `probe`) quote Transformer-XL against it.
PAPER = {
    "xl": "26.77 ppl (27.02 at the training length)",
    "no_recurrence": "29.02 ppl (29.59)",
    "shaw": "27.94 ppl (27.94)",
    "vaswani": "no figure with recurrence (30.97 ppl without, half loss)",
    "al_rfou": "31.16 ppl (window 120)",
    "half_loss": "28.33 ppl (28.69)",
    "longer_xl": "27.02 -> 26.77 ppl when the attention grows from 128 to 500",
    "longer_others": "Shaw 27.94 at 128 and 256; vanilla best at its window (120)",
    "recl": "XL 700 > Shaw 400 > w/o recurrence 300 > Transformer 128 (r = 0.1)",
    "ptb_xl": "54.52 test ppl, 24M parameters (GPU, long training)",
    "ptb_kn5": 141.2,
    "ptb_lstm": 114.5,
    "longer_memory_xl": "27.02 -> 26.77 ppl (memory 128 -> 500; base model 23.43 at 150 -> 23.09 at 640)",
    "longer_memory_others": "Shaw 27.94 -> 27.94; w/o recurrence 29.59 -> 29.02",
    "xl_vs_no_recurrence": "26.77 vs. 29.02 ppl",
    "xl_vs_shaw": "26.77 vs. 27.94 ppl",
    "xl_vs_al_rfou": "26.77 vs. 31.16 ppl",
    "probe": "(not in the paper: recurrence with relative encodings is claimed to reach beyond the training span)",
}
# The paper's Table 6 group at this size: Transformer-XL, the Shaw encoding, no recurrence and the vanilla Transformer.
PAPER_GROUP = ("xl", "shaw", "no_recurrence", "al_rfou")


def verdict(comparison: dict) -> str:
    """'reproduced' / 'reversed' / 'not reproduced (within noise)' for "a is better than b"."""
    if comparison["high"] < 0:
        return "reproduced"
    if comparison["low"] > 0:
        return "reversed"
    return "not reproduced (within noise)"


TIMES = ("Wall min: the elapsed time of the training attempts, which also counts any time the process was stopped or "
         "waiting for the cores (a study paused while other work ran); CPU min: the process's own time on all cores.")


def seeded_verdict(comparison: dict) -> str:
    """`verdict` of a comparison over seeds; never 'reproduced' or 'reversed' when its seeds differ in sign."""
    if len({x > 0 for x in comparison.get("seeds", ())}) > 1:
        return "not reproduced (the seeds disagree)"
    return verdict(comparison)


def seeds_text(claim: dict, digits: int = 4, unit: str = " bpc") -> str:
    """A claim decided over seeds (txl_tf.study.evidence.decide): "-0.0250 bpc [-0.0700, +0.0200] over 3 seeds:
    -0.0039, -0.0461, -0.0250", with no interval when the seeds cannot give one (no parenthesis: the README's short
    form keeps all of it)."""
    seeds = ", ".join(f"{x:+.{digits}f}" for x in claim["seeds"])
    n = len(claim["seeds"])
    if claim["low"] == float("-inf"):
        return f"{claim['mean']:+.{digits}f}{unit}, no interval from {n} seed{'s' if n > 1 else ''}: {seeds}"
    return (f"{claim['mean']:+.{digits}f}{unit} [{claim['low']:+.{digits}f}, {claim['high']:+.{digits}f}] over "
            f"{n} seeds: {seeds}")


def one_seed(verdict_text: str, seeds: int = 1) -> str:
    """The verdict of a claim read from fewer seeds than the plan's (docs/study_plan.md): undecided, with what
    the seeds alone read (an interval over characters, not over training runs)."""
    from txl_tf.study import evidence

    return (f"undecided ({seeds} seed{'s' if seeds > 1 else ''}, the plan needs {evidence.MIN_SEEDS}; "
            f"alone: {verdict_text})")


def seeds_verdict(claim: dict) -> str:
    """The verdict of a claim decided over seeds, with why when it is undecided."""
    from txl_tf.study import evidence

    reason = evidence.why(claim)
    return claim["verdict"] + (f" ({reason})" if reason else "")


def interval(comparison: dict, digits: int = 4, unit: str = " bpc") -> str:
    """A comparison's mean and 95% interval: "+0.0123 bpc [+0.0100, +0.0150]"."""
    c = comparison
    return f"{c['mean']:+.{digits}f}{unit} [{c['low']:+.{digits}f}, {c['high']:+.{digits}f}]"


def label(section: dict, name: str) -> str:
    """The label of run `name` of a study's section (its name when it has none)."""
    return section["runs"][name]["label"] or name


def markdown_table(header: list[str], rows: list) -> list[str]:
    """The lines of a Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines
