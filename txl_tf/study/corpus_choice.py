"""Study `corpora`: why the context study's second corpus is `networkx_code` — measured before training anything.

For each corpus of txl_tf.study.context.CORPORA, txl_tf.analysis.repetition's two measurements on the first
6M characters of the training split: how often a 20-character string recurs within the previous 256 / 1,024 /
8,192 / 65,536 characters, and the bits per character a match model reaching that far back saves over an adaptive
order-3 context model. The section of results.json holds every figure; the report renders its tables.
"""

from __future__ import annotations

import dataclasses

from txl_tf.analysis import repetition
from txl_tf.study import runs


@dataclasses.dataclass(frozen=True)
class Settings:
    max_tokens: int = repetition.MAX_TOKENS
    positions: int = repetition.POSITIONS
    windows: tuple = repetition.WINDOWS


FULL = Settings()
QUICK = Settings(max_tokens=200_000, positions=2_000, windows=(256, 1024, 8192))


def run(data_dirs: dict, *, quick: bool = False) -> dict:
    """The `corpora` section: {dataset: prepared folder} measured in order."""
    settings = QUICK if quick else FULL
    measured = []
    for dataset, data_dir in data_dirs.items():
        runs.log(f"[corpora] measuring {dataset}: the first {settings.max_tokens:,} characters of its training split")
        result = repetition.measure_corpus(data_dir, "train", settings.max_tokens, windows=settings.windows,
                                           positions=settings.positions)
        result["data_dir"] = dataset  # the table's row name; no path of this machine in results.json
        measured.append(result)
    return {"quick": quick, "machine": runs.machine(), "split": "train", "max_tokens": settings.max_tokens,
            "corpora": measured}


def section_lines(section: dict, machine: str) -> list[str]:
    """The report's part: what was measured and the two tables."""
    rows = {r["dataset"]: r for r in section["corpora"]}
    out = ["## A corpus where long context pays", "", machine, "",
           "A long memory can only pay where the text repeats itself far apart. Before training anything, "
           "`txl_tf.analysis.repetition` measures each corpus on the first "
           f"{section['max_tokens']:,} characters of its {section['split']} split: how often a string recurs within "
           "a window, and the bits per character that a match model reaching that window back saves over an "
           "adaptive order-3 context model (the module's docstring defines both). `networkx_code` is the `.py` "
           "files of the pinned networkx 3.7 wheel (`docs/data.md` has its recipe, checksum and licence, and "
           "figures for Django's source and two public-domain books).", ""]
    out += repetition.format_tables([rows[d] for d in rows]).splitlines()
    return out + ["", *_comparison(rows), ""]


def _comparison(rows: dict) -> list[str]:
    """One generated sentence: how much more the other corpora repeat than enwik8_sample at the widest window."""
    base = rows.get("enwik8_sample")
    if base is None or len(rows) < 2:
        return []
    window = max(int(w) for w in base["recurrence"]["fraction"])

    def figures(row: dict) -> tuple[float, float]:
        fraction = {int(w): v for w, v in row["recurrence"]["fraction"].items()}
        saving = {int(w): v["saving"] for w, v in row["bits"]["windows"].items()}
        return fraction[window], saving[window]

    share, saving = figures(base)
    parts = []
    for name, row in rows.items():
        if name != "enwik8_sample":
            other_share, other_saving = figures(row)
            parts.append(f"`{name}`: {other_share:.1%} of strings recur ({other_share / max(share, 1e-12):.1f}x "
                         f"`enwik8_sample`'s {share:.1%}) and the match model saves {other_saving:.3f} bits per "
                         f"character (against {saving:.3f})")
    return [f"Within {window:,} characters, " + "; ".join(parts) + "."]
