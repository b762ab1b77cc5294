"""A scored model of the ablation or a context study, kept small enough to commit: the study resumes on a machine
that has neither its checkpoints nor its cached per-token losses.

A study's runs (checkpoints, per-token losses under runs/<run>/evals) take ~50 MB per model and stay on the machine
that trained them. What a section of results.json is computed from is much less (txl_tf.study.context_results,
txl_tf.study.ablation):

    a cell's mean loss            the tables, each model's best memory (chosen on the validation split)
    its sums over blocks          the paired block bootstraps over every kept token (blocks of `block` tokens, the
                                  same blocks runs.paired_bootstrap resamples)
    its losses on the subset      the comparisons with the vanilla model and RECL (per token: RECL takes
                                  per-token minima across models), test cells only
    the probe's summaries         per memory (txl_tf.study.probe.summarize; the context studies)

so each finished model is written as ARCHIVE/<run>.json (the run's record, the settings it was scored under and
the cells' means) and ARCHIVE/<run>.npz (the block sums and subset losses), 1-2 MB. The JSON is written last: its
presence marks a complete archive. Reading one back treats both files as untrusted input: regular files, bounded
sizes, the schema and every array's shape checked against the settings, finite numbers, no pickled objects.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import zipfile

import numpy as np

from txl_tf.base import paths, untrusted
from txl_tf.study import runs

SCHEMA = 1
JSON_LIMIT = 4 * untrusted.MIB
NPZ_LIMIT = 64 * untrusted.MIB
UNPACKED_LIMIT = 256 * untrusted.MIB  # what the arrays of one archive may unpack to (a 2.2 MB archive: ~2.5 MB)
LN2 = math.log(2.0)


@dataclasses.dataclass
class Cell:
    """One evaluation (a split at one memory and clamp) reduced to what the section needs.

    Attributes:
      mean: mean loss in nats over every scored token (float64 sum).
      count: scored tokens.
      block_sums: [count // block] float64 sums of consecutive blocks of `block` tokens (a tail shorter than a
        block is left out, as runs.paired_bootstrap leaves it out).
      subset: [S] float32 per-token losses on the vanilla subset (test cells), or None.
    """

    mean: float
    count: int
    block_sums: np.ndarray
    subset: np.ndarray | None = None

    @classmethod
    def of(cls, losses: np.ndarray, block: int, subset: np.ndarray | None = None) -> Cell:
        """The cell of per-token `losses` [count]; `subset`: indices into them to keep per token (or None)."""
        losses = np.asarray(losses, np.float32)
        usable = (losses.shape[0] // block) * block
        sums = losses[:usable].astype(np.float64).reshape(-1, block).sum(axis=1)
        return cls(float(np.mean(losses, dtype=np.float64)), int(losses.shape[0]), sums,
                   None if subset is None else losses[subset])

    def bits(self) -> float:
        return self.mean / LN2

    def subset_bits(self) -> float:
        return float(np.mean(self.subset, dtype=np.float64) / LN2)


def compare(plus: list, minus: list, block: int) -> dict:
    """mean(sum(plus) - sum(minus)) in bits per token over every kept token, with the 95% interval of the paired
    block bootstrap (runs.paired_bootstrap on the per-token losses, computed from the cells' block sums)."""
    mean = sum(c.mean for c in plus) - sum(c.mean for c in minus)
    blocks = (sum(c.block_sums for c in plus) - sum(c.block_sums for c in minus)) / block
    return {k: v / LN2 for k, v in runs.bootstrap_blocks(mean, blocks).items()}


def compare_subset(plus: list, minus: list, block: int) -> dict:
    """As `compare`, on the subset's per-token losses (the vanilla model on one side)."""
    a = sum(c.subset.astype(np.float64) for c in plus)
    b = sum(c.subset.astype(np.float64) for c in minus)
    return {k: v / LN2 for k, v in runs.paired_bootstrap(a, b, block=block).items()}


def _key_text(key: tuple) -> str:
    split, memory, clamp = key
    return f"{split}/{memory}/{clamp}"


def _parse_key(text: str, what: str) -> tuple:
    try:
        split, memory, clamp = text.split("/")
        if split not in ("valid", "test"):
            raise ValueError(split)
        return split, int(memory), int(clamp)
    except ValueError:
        raise runs.StudyError(f"{what}: the cell {text!r} is not split/memory/clamp; remove the archive to score "
                              "the model again") from None


def _check_sizes(data: bytes, npz_path: str, fix: str) -> None:
    """Bounds what the archive's arrays unpack to before any is built: the members' sizes in the zip directory
    add up to at most UNPACKED_LIMIT, and each .npy header's shape fits its member (numpy allocates the shape a
    header claims before it reads the data)."""
    with zipfile.ZipFile(io.BytesIO(data)) as packed:
        members = packed.infolist()
        total = sum(m.file_size for m in members)
        if total > UNPACKED_LIMIT:
            raise runs.StudyError(f"{npz_path} unpacks to {untrusted.size_text(total)}, more than the "
                                  f"{untrusted.size_text(UNPACKED_LIMIT)} an archive may hold; {fix}")
        for member in members:
            with packed.open(member) as f:
                version = np.lib.format.read_magic(f)
                header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                          else np.lib.format.read_array_header_2_0)(f)
            shape, dtype = header[0], header[2]
            if int(np.prod(shape, dtype=np.float64)) * dtype.itemsize > member.file_size:
                raise runs.StudyError(f"{npz_path}: {member.filename} claims shape {shape} of {dtype}, more than "
                                      f"its {member.file_size:,} bytes; {fix}")


def paths_of(archive_dir: str, run_name: str) -> tuple[str, str]:
    return os.path.join(archive_dir, run_name + ".json"), os.path.join(archive_dir, run_name + ".npz")


def save(archive_dir: str, run_name: str, digest: str, record: dict, scores: dict, facts: dict) -> str:
    """Writes the archive of one scored model (`scores` as context.train_and_score returns it, cells as Cell);
    returns the JSON's path. `digest` (the run's portable RunSpec digest) and `facts` (the settings the cells were
    scored under) must match for the archive to be used."""
    json_path, npz_path = paths_of(archive_dir, run_name)
    arrays, groups = {}, {}
    for group, cells in [("final", scores["cells"])] + [(f"ckpt{s}", c) for s, c in
                                                        sorted(scores.get("checkpoints", {}).items())]:
        listed = []
        for i, (key, cell) in enumerate(sorted(cells.items())):
            arrays[f"{group}_{i}_blocks"] = cell.block_sums
            if cell.subset is not None:
                arrays[f"{group}_{i}_subset"] = cell.subset
            listed.append({"key": _key_text(key), "mean": cell.mean, "count": cell.count,
                           "subset": cell.subset is not None})
        groups[group] = listed
    index = {"schema": SCHEMA, "run": run_name, "digest": digest, "record": record, "facts": facts, "cells": groups,
             "probe": {str(m): summary for m, summary in scores["probe"].items()},
             "checkpoint_tokens": {str(s): int(t) for s, t in scores.get("checkpoint_tokens", {}).items()}}
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    with paths.atomic_file(npz_path, "wb") as f:
        f.write(buffer.getvalue())
    runs.write_json(json_path, index)  # last: marks the archive complete
    return json_path


def plan_v1_cells(archive_dir: str, run_name: str, facts: dict, ignore: tuple = ()) -> dict | None:
    """The cells of archive_dir/plan_v1/<run_name>, an archive kept for plan v1's verdicts (docs/study_plan_v3.md),
    read under its own digest and facts (today's study no longer builds its spec), every other check of `load`
    made; None when there is none, or when its facts differ from `facts` outside the keys `ignore` (it was scored
    on other tokens: said in the log)."""
    directory = os.path.join(archive_dir, "plan_v1")
    json_path, _ = paths_of(directory, run_name)
    if not os.path.lexists(json_path):
        return None
    index = untrusted.load_json(json_path, max_bytes=JSON_LIMIT, what="the study's archive", finite=False)
    if not isinstance(index, dict) or not isinstance(index.get("facts"), dict) or \
            not isinstance(index.get("digest"), str):
        raise runs.StudyError(f"{json_path} is not an archive (schema {SCHEMA}) of {run_name}; restore it from the "
                              "repository or remove it")
    kept = {k: v for k, v in index["facts"].items() if k not in ignore}
    if kept != {k: v for k, v in facts.items() if k not in ignore}:
        runs.log(f"{json_path} was scored under other settings than today's: no plan-v1 verdict from it")
        return None
    return load(directory, run_name, index["facts"], index["digest"])[1]["cells"]


def load(archive_dir: str, run_name: str, facts: dict, digest: str, *, clean: bool = False
         ) -> tuple[dict, dict] | None:
    """(record, scores) of an archived model, or None when there is none. An archive of another configuration
    (spec digest) or other settings (`facts`), or one that fails a check, is one StudyError naming the file;
    `clean`: so is one whose run was trained from uncommitted code (runs.clean_commit)."""
    json_path, npz_path = paths_of(archive_dir, run_name)
    if not os.path.lexists(json_path):
        return None
    what = "the study's archive"
    index = untrusted.load_json(json_path, max_bytes=JSON_LIMIT, what=what, finite=False)
    fix = f"remove {json_path} and {npz_path} to train and score the model again"
    if not isinstance(index, dict) or index.get("schema") != SCHEMA or index.get("run") != run_name:
        raise runs.StudyError(f"{json_path} is not an archive (schema {SCHEMA}) of {run_name}; {fix}")
    record = index.get("record")
    if not isinstance(record, dict) or index.get("digest") != digest:
        raise runs.StudyError(f"{json_path} archives another configuration of {run_name} (its gin files or "
                              f"bindings differ); {fix}")
    if index.get("facts") != facts:
        differ = sorted(k for k in set(facts) | set(index.get("facts") or {})
                        if (index.get("facts") or {}).get(k) != facts.get(k))
        raise runs.StudyError(f"{json_path} was scored under other settings ({', '.join(differ)}); {fix}")
    if clean and not runs.clean_commit(str(record.get("commit", ""))):
        raise runs.StudyError(f"{json_path} was trained from {record.get('commit')!r}, not a committed tree, so "
                              f"nobody can rebuild it; {fix} from a clean checkout")
    try:
        data = untrusted.read_bytes(npz_path, max_bytes=NPZ_LIMIT, what=what)
        _check_sizes(data, npz_path, fix)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except FileNotFoundError:
        raise runs.StudyError(f"{npz_path} is missing beside {json_path}; {fix}") from None
    except (ValueError, zipfile.BadZipFile) as error:  # not an npz, or an object array (pickle refused)
        raise runs.StudyError(f"{npz_path} is not a valid archive ({error}); {fix}") from None
    block, subset_size = facts["block"], facts["subset_tokens"]

    def cells_of(group: str) -> dict:
        listed = index["cells"].get(group) if isinstance(index.get("cells"), dict) else None
        if not isinstance(listed, list):
            raise runs.StudyError(f"{json_path} has no cell list {group!r}; {fix}")
        out = {}
        for i, entry in enumerate(listed):
            key = _parse_key(str(entry.get("key")) if isinstance(entry, dict) else "", json_path)
            count, mean = entry.get("count"), entry.get("mean")
            if not isinstance(count, int) or count <= 0 or not isinstance(mean, float) or not math.isfinite(mean):
                raise runs.StudyError(f"{json_path}: cell {entry['key']} has no finite mean or count; {fix}")
            blocks = arrays.get(f"{group}_{i}_blocks")
            subset = arrays.get(f"{group}_{i}_subset") if entry.get("subset") else None
            if blocks is None or blocks.dtype != np.float64 or blocks.shape != (count // block,):
                raise runs.StudyError(f"{npz_path}: the block sums of cell {entry['key']} are not "
                                      f"[{count // block}] float64; {fix}")
            if entry.get("subset") and (subset is None or subset.dtype != np.float32 or
                                        subset.shape != (subset_size,)):
                raise runs.StudyError(f"{npz_path}: the subset losses of cell {entry['key']} are not "
                                      f"[{subset_size}] float32; {fix}")
            if not np.isfinite(blocks).all() or (subset is not None and not np.isfinite(subset).all()):
                raise runs.StudyError(f"{npz_path}: cell {entry['key']} holds a non-finite loss; {fix}")
            out[key] = Cell(mean, count, blocks, subset)
        return out

    scores = {"cells": cells_of("final"), "probe": {}}
    probe = index.get("probe")
    if not isinstance(probe, dict):
        raise runs.StudyError(f"{json_path} has no probe summaries; {fix}")
    for memory, summary in probe.items():
        if not memory.isdigit() or not isinstance(summary, dict):
            raise runs.StudyError(f"{json_path}: the probe entry {memory!r} is not a memory and its summary; {fix}")
        scores["probe"][int(memory)] = summary
    tokens = index.get("checkpoint_tokens") or {}
    if not isinstance(tokens, dict) or not all(s.isdigit() and isinstance(t, int) for s, t in tokens.items()):
        raise runs.StudyError(f"{json_path}: checkpoint_tokens is not {{step: tokens}}; {fix}")
    if tokens:
        scores["checkpoints"] = {int(s): cells_of(f"ckpt{s}") for s in tokens}
        scores["checkpoint_tokens"] = {int(s): t for s, t in tokens.items()}
    return record, scores
