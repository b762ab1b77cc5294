"""Study `corpora`: why the context study's second corpus is `networkx_code` — measured before training anything.

For each corpus of txl_tf.study.context.CORPORA, txl_tf.analysis.repetition's two measurements on the first
6M characters of the training split: how often a 20-character string recurs within the previous 256 / 1,024 /
8,192 / 65,536 characters, and the bits per character a match model reaching that far back saves over an adaptive
order-3 context model. The same for each of CANDIDATES, corpora measured but never trained on: the `.py` files of
a pinned PyPI wheel (checksum verified), read as `networkx_code` is (txl_tf.data.corpora.python_sources), its
first 90% standing for a training split. The section of results.json holds every figure; the report renders its
tables.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from txl_tf.analysis import repetition
from txl_tf.study import runs


@dataclasses.dataclass(frozen=True)
class CorpusChoiceSettings:
    max_tokens: int = repetition.MAX_TOKENS
    positions: int = repetition.POSITIONS
    windows: tuple = repetition.WINDOWS


@dataclasses.dataclass(frozen=True)
class CorpusCandidate:
    """Python source measured as a candidate corpus: the `.py` files of one pinned pure-Python wheel."""

    name: str
    wheel: str  # a pip requirement pinned with ==
    sha256: str  # of the wheel file
    licence: str


CANDIDATES = (
    # https://pypi.org/project/Django/5.2.8/ (883 .py files, 5.66 MB)
    CorpusCandidate("django_code", "Django==5.2.8", "37e687f7bd73ddf043e2b6b97cfe02fcbb11f2dbb3adccc6a2b18c6daa054d7f",
              "BSD-3-Clause"),
)
TRAIN_SHARE = 0.9  # the share a prepared char corpus trains on (txl_tf.data.corpora: 90/5/5)
FULL = CorpusChoiceSettings()
QUICK = CorpusChoiceSettings(max_tokens=200_000, positions=2_000, windows=(256, 1024, 8192))


def run(data_dirs: dict, *, quick: bool = False, cache_dir: str | None = None) -> dict:
    """The `corpora` section: {dataset: prepared folder} measured in order, then each of CANDIDATES (its wheel
    fetched into `cache_dir`, default txl_tf.data.sources.default_cache_dir(), unless cached there)."""
    settings = QUICK if quick else FULL
    measured = []
    for dataset, data_dir in data_dirs.items():
        runs.log(f"[corpora] measuring {dataset}: the first {settings.max_tokens:,} characters of its training split")
        result = repetition.measure_corpus(data_dir, "train", settings.max_tokens, windows=settings.windows,
                                           positions=settings.positions)
        result["data_dir"] = dataset  # the table's row name; no path of this machine in results.json
        measured.append(result)
    for candidate in CANDIDATES:
        measured.append(measure_candidate(candidate, settings, cache_dir))
    return {"quick": quick, "machine": runs.machine(), "split": "train", "max_tokens": settings.max_tokens,
            "corpora": measured}


def candidate_tokens(data: bytes, max_tokens: int) -> tuple[np.ndarray, int]:
    """Char-level ids of the first TRAIN_SHARE of `data`, at most `max_tokens` of them, and the vocabulary size:
    the bytes that occur anywhere in `data` (as a prepared corpus' vocabulary covers all its splits), numbered in
    byte order (the measurements depend on the symbols, not on their ids)."""
    symbols, ids = np.unique(np.frombuffer(data, dtype=np.uint8), return_inverse=True)
    return ids[:int(len(data) * TRAIN_SHARE)][:max_tokens].astype(np.int64), int(symbols.size)


def measure_candidate(candidate: CorpusCandidate, settings: CorpusChoiceSettings, cache_dir: str | None = None) -> dict:
    """Both measurements on a candidate's source, with where it came from."""
    from txl_tf.data import corpora, sources

    cache_dir = cache_dir or sources.default_cache_dir()
    path = sources.cached_pypi_wheel(candidate.wheel, cache_dir, sha256=candidate.sha256,
                                     platform_args=corpora.NETWORKX_PLATFORM)
    data = corpora.python_sources(corpora.Archive(path))
    tokens, vocab_size = candidate_tokens(data, settings.max_tokens)
    runs.log(f"[corpora] measuring {candidate.name} (candidate, {candidate.wheel}): the first {tokens.size:,} "
             f"characters of its .py files ({len(data):,})")
    result = repetition.measure_tokens(tokens, vocab_size, windows=settings.windows, positions=settings.positions)
    return {"data_dir": candidate.name, "dataset": candidate.name, "level": "char",
            "split": f"first {TRAIN_SHARE:.0%}", "split_tokens": int(len(data) * TRAIN_SHARE),
            "candidate": {"wheel": candidate.wheel, "sha256": candidate.sha256, "licence": candidate.licence,
                          "source_bytes": len(data)},
            **result}


def section_lines(section: dict, machine: str) -> list[str]:
    """The report's part: what was measured and the two tables."""
    rows = {r["dataset"]: r for r in section["corpora"]}
    out = ["## A corpus where long context pays", "", machine, "",
           "A long memory can only pay where the text repeats itself far apart. Before training anything, "
           "`txl_tf.analysis.repetition` measures each corpus on the first "
           f"{section['max_tokens']:,} characters of its {section['split']} split: how often a string recurs within "
           "a window, and the bits per character that a match model reaching that window back saves over an "
           "adaptive order-3 context model (the module's docstring defines both). `networkx_code` is the `.py` "
           "files of the pinned networkx 3.7 wheel (`docs/data.md` has its recipe, checksum and licence)."]
    candidates = [r for r in section["corpora"] if "candidate" in r]
    if candidates:
        out[-1] += (" Measured the same way as candidates, never trained on: " + "; ".join(
            f"`{r['dataset']}`, the `.py` files of the `{r['candidate']['wheel']}` wheel ({r['candidate']['licence']}, "
            f"sha256 `{r['candidate']['sha256'][:12]}…` verified), their first {r['split'].split()[-1]} as its "
            "training split" for r in candidates) + ".")
    out += [""]
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
