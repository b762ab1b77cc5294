"""The shape of results.json that the report reads, checked when the file is read (`check`), so that a document of
another shape (a hand edit, another version's section, a list where an object belongs) is one line naming the file,
the first wrong field and the fix, not a traceback from deep inside the report.

A schema here is a leaf (`INT`, `NUM`, `STR`, `BOOL`, `Nullable`), an `Obj` (required and optional fields; other
fields are allowed), a `Map` (any keys, one value schema) or a `List`. Each section names the fields the report reads
unconditionally; `_crossed` checks that the names the section lists (variants, models, lengths) have their entries.
Fields a newer study adds are optional here and read by the report only where present.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from txl_tf.study import context, runs

CONTEXT_SECTIONS = tuple(corpus.key for corpus in context.CORPORA)


@dataclasses.dataclass(frozen=True)
class Leaf:
    what: str
    fits: Callable[[object], bool]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # NaN and ±inf: undefined figures


INT = Leaf("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
NUM = Leaf("a number", _number)
STR = Leaf("a string", lambda v: isinstance(v, str))
BOOL = Leaf("true or false", lambda v: isinstance(v, bool))


def Nullable(leaf: Leaf) -> Leaf:  # noqa: N802 (reads as a type)
    return Leaf(f"{leaf.what} or null", lambda v: v is None or leaf.fits(v))


@dataclasses.dataclass(frozen=True)
class Obj:
    required: dict
    optional: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Map:
    value: object


@dataclasses.dataclass(frozen=True)
class List:
    item: object


MACHINE = Obj({"cpu": STR, "isa": STR, "cores": INT, "date": STR, "commit": STR, "tensorflow": STR, "python": STR})
COMPARISON = Obj({"mean": NUM, "low": NUM, "high": NUM})
RECL_GROUP = Obj({"models": List(STR), "contexts": List(INT),
                  "ratios": Map(Obj({"recl": List(INT), "truncated": List(BOOL)}, {"gains": List(List(NUM))}))})
TRAINED = {"label": STR, "parameters": INT, "commit": STR}
COMMON = {"machine": MACHINE}
OPTIONAL = {"quick": BOOL}

ABLATION = Obj({
    **COMMON,
    "setup": Obj({"lengths": List(INT), "variants": List(Obj({"name": STR})), "dataset": STR,
                  "parameter_deviation": NUM, "train_attention": INT, "eval_tgt_len": INT, "split": STR}),
    "runs": Map(Obj({**TRAINED, "train_tokens": INT, "wall_seconds": NUM, "cpu_seconds": NUM,
                     "final_train_loss": NUM, "evals": Map(Obj({"bpc": NUM}))})),
    "comparisons": Map(COMPARISON),
    "best_length": Map(INT),
    "ranking": List(STR),
}, {**OPTIONAL, "seeds": Map(List(STR)), "second_seed": Obj({"ran": BOOL, "runs": Map(List(STR))}),
    "tried": Map(Obj({"run": STR, "clamp_len": INT, "bpc": Map(NUM)})),
    "recl": Obj({**RECL_GROUP.required, "scored_at": Map(List(INT))}, {"paper_group": RECL_GROUP, "tokens": INT})})

CONTEXT_RECL = Obj({"models": List(STR), "contexts": List(INT), "tokens": INT, "bpc": Map(List(NUM)),
                    "ratios": Map(Obj({"recl": List(INT), "truncated": List(BOOL), "low": List(INT),
                                       "high": List(INT), "longest": List(NUM)}, {"gains": List(List(NUM))}))})
CELL = Obj({"copy": NUM, "copy_low": NUM, "copy_high": NUM, "difference": NUM, "low": NUM, "high": NUM})
MEMORY_CLAMP = Obj({"memory": INT, "clamp": INT})
CONTEXT = Obj({
    **COMMON,
    "setup": Obj({"models": List(Obj({"name": STR, "vanilla": BOOL}, {"clamped": BOOL})), "memories": List(INT),
                  "train_memory": INT, "train_span": INT, "eval_tgt_len": INT, "dataset": STR,
                  "parameter_deviation": NUM, "split_tokens": Obj({"test": INT}), "streams": INT,
                  "dropped_per_stream": INT, "kept_tokens": Obj({"test": INT}), "vanilla_subset_tokens": INT,
                  "bootstrap_block": INT,
                  "probe": Obj({"distances": List(INT), "examples": INT, "seed": INT, "span": INT})},
                 {"corpus": STR}),
    "runs": Map(Obj({**TRAINED, "train_tokens": INT, "wall_seconds": NUM, "cpu_seconds": NUM,
                     "best": MEMORY_CLAMP, "init": MEMORY_CLAMP},
                    {"test": Map(Map(NUM)), "test_subset": Map(Map(NUM))})),
    "comparisons": Map(COMPARISON),
    "probe": Map(Map(Map(CELL))),
}, {**OPTIONAL, "key": STR,
    "recl": Obj({}, {"paper_group": CONTEXT_RECL, "recurrent": CONTEXT_RECL}),
    "gain_curve": List(Obj({"mean": NUM, "low": NUM, "high": NUM, "tokens": INT, "step": INT, "init_bpc": NUM,
                            "best_memory": INT, "best_bpc": NUM}))})

PTB_RUN = Obj({**TRAINED, "train_minutes": NUM, "test_ppl": NUM, "test_ppl_last": Nullable(NUM)},
              {"memory_sweep": Obj({"valid_words": INT, "chosen": INT, "test_ppl": NUM, "valid_ppl": Map(NUM)}),
               "test_ppl_recipe": NUM})
PTB = Obj({**COMMON, "setup": Obj({"gin_file": STR, "train_steps": INT, "average_last": INT}),
           "runs": Obj({"xl": PTB_RUN}, {"vanilla": PTB_RUN})}, {**OPTIONAL, "comparison": COMPARISON})

CORPORA = Obj({
    **COMMON, "max_tokens": INT, "split": STR,
    "corpora": List(Obj({
        "dataset": STR, "data_dir": STR, "tokens": INT, "split": STR,
        "recurrence": Obj({"fraction": Map(NUM), "distance_quartiles": List(INT), "length": INT, "positions": INT,
                           "seed": INT}),
        "bits": Obj({"order": INT, "min_match": INT, "short_range_bits": NUM,
                     "windows": Map(Obj({"bits_per_token": NUM, "saving": NUM}))})})),
}, OPTIONAL)

SECTIONS = {"ablation": ABLATION, "corpora": CORPORA, "ptb": PTB, **{key: CONTEXT for key in CONTEXT_SECTIONS}}
ANY_SECTION = Obj(COMMON, OPTIONAL)  # a section this version does not render: the summary reads its machine


def _field(path: tuple) -> str:
    """`studies.ablation.runs.xl.evals["512"].bpc` for the path ("studies", "ablation", ..., "bpc")."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_]\w*", part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out


def _problem(value, schema, path: tuple) -> tuple[tuple, str] | None:
    """(path, what is wrong) of the first field of `value` that does not fit `schema`, or None."""
    if isinstance(schema, Leaf):
        return None if schema.fits(value) else (path, f"is {runs.json_kind(value)}, not {schema.what}")
    if isinstance(schema, List):
        if not isinstance(value, list):
            return path, f"is {runs.json_kind(value)}, not a list"
        items = enumerate(value)
    else:
        if not isinstance(value, dict):
            return path, f"is {runs.json_kind(value)}, not an object"
        if isinstance(schema, Obj):
            missing = [key for key in schema.required if key not in value]
            if missing:
                return (*path, missing[0]), "is missing"
            fields = {**schema.required, **{k: s for k, s in schema.optional.items() if k in value}}
            items = ((key, value[key]) for key in fields)
        else:
            items = value.items()
    for key, item in items:
        inner = schema.item if isinstance(schema, List) else schema.value if isinstance(schema, Map) else \
            fields[key]
        found = _problem(item, inner, (*path, key))
        if found:
            return found
    return None


def _crossed(key: str, section: dict) -> tuple[tuple, str] | None:
    """The first entry a section's own lists name but it lacks (runs of its variants or models, a length's eval)."""
    path = ("studies", key)
    trained = section.get("runs", {})
    if key == "ablation":
        setup = section["setup"]
        seeds = section["seeds"] if "seeds" in section else section.get("second_seed", {}).get("runs", {})
        for variant in (v["name"] for v in setup["variants"]):
            if variant not in section["best_length"]:
                return (*path, "best_length", variant), "is missing (setup.variants names it)"
            for name in seeds.get(variant, [variant]):
                if name not in trained:
                    return (*path, "runs", name), "is missing (setup.variants or the seeds name it)"
                for length in setup["lengths"]:
                    if str(length) not in trained[name]["evals"]:
                        return (*path, "runs", name, "evals", str(length)), "is missing (setup.lengths names it)"
    elif key in CONTEXT_SECTIONS:
        for model in section["setup"]["models"]:
            name = model["name"]
            table = "test_subset" if model["vanilla"] else "test"
            if name not in trained:
                return (*path, "runs", name), "is missing (setup.models names it)"
            if table not in trained[name]:
                return (*path, "runs", name, table), "is missing (setup.models names the model)"
            if name not in section["probe"]:
                return (*path, "probe", name), "is missing (setup.models names it)"
    return None


def check(document: dict, path: str) -> dict:
    """`document` (results.json at `path`, as `runs.read_results` returns it) when its sections have the shape the
    report reads; a StudyError naming the file, the first wrong field and the fix otherwise."""
    for key, section in document["studies"].items():
        found = _problem(section, SECTIONS.get(key, ANY_SECTION), ("studies", key))
        found = found or (_crossed(key, section) if key in SECTIONS else None)
        if found:
            raise runs.results_error(path, _field(found[0]), found[1])
    return document


def read(path: str) -> dict:
    """results.json at `path`, its shape checked (`runs.read_results`, then `check`)."""
    return check(runs.read_results(path), path)
