"""The runs of a study: ordinary training runs (gin files + bindings, one model_dir each) and cached evaluations.

Layout of a study's output directory:

    DIR/runs/<run>/             an ordinary txl_tf run directory (config.gin, ckpt-N, TensorBoard logs)
    DIR/runs/<run>/study.json   written when the run finished: its spec, parameters, wall and CPU time
    DIR/runs/<run>/train.log    the trainer's console output, every attempt appended
    DIR/runs/<run>/evals/       per-token losses (<key>.npy, corpus order) and <key>.json for each evaluation
    DIR/results.json            every figure with the configuration and commit that produced it
    DIR/report.md, DIR/*.png    written from results.json by txl_tf.study.report

Re-running a study skips finished runs and cached evaluations; an interrupted run resumes from its latest
checkpoint (the trainer's own resume: same data position, memory and RNG state). A finished run whose spec
(gin files, bindings) differs from the current one is an error, never silently reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import io
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from txl_tf.base import paths, untrusted
from txl_tf.base.errors import UserError
from txl_tf.training.autotune import cpu_flags, cpu_model

RUN_RECORD = "study.json"
RESULTS_LIMIT = 64 * untrusted.MIB  # results.json and a run's study.json (the published results.json is ~0.1 MiB)
# The quick studies (the test suite's) pin the training path instead of timing candidates (txl_tf.training.autotune).
PINNED_PATH = ("TrainConfig.mixed_precision = False", "TrainConfig.jit_compile = False", "TrainConfig.kernels = 'tf'")
TRAIN_LOG = "train.log"
EVAL_DIR = "evals"
ATTEMPTS_FILE = "attempts.json"


class StudyError(UserError):
    """An expected failure of a study (a stale run directory, data that cannot be prepared): one line."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run of a study.

    Attributes:
      name: directory name under DIR/runs and key in results.json.
      gin_files: gin files (paths relative to the shipped gin/ folder resolve as in txl_tf.train).
      gin_params: bindings applied after the files.
      label: how the report names it.
    """

    name: str
    gin_files: tuple
    gin_params: tuple = ()
    label: str = ""

    def digest(self, portable: bool = False) -> str:
        """A hash of the gin files and bindings; `portable` leaves out where the data lies (the DATA_DIR binding),
        for what is compared across machines (txl_tf.study.archive)."""
        params = [p for p in self.gin_params if not (portable and p.startswith("DATA_DIR ="))]
        text = json.dumps({"gin_files": list(self.gin_files), "gin_params": params})
        return hashlib.sha256(text.encode()).hexdigest()[:16]


SEED_BASE = 1233  # seed k trains with TrainConfig.seed = SEED_BASE + k: seed 1 is gin/common.gin's 1234


def seed_params(seed: int) -> list[str]:
    """The bindings of a study run's seed k (none for seed 1, the shipped configuration)."""
    if seed < 1:
        raise ValueError(f"seeds count from 1, not {seed}")
    return [] if seed == 1 else [f"TrainConfig.seed = {SEED_BASE + seed}"]


def seed_name(name: str, seed: int) -> str:
    """A study run's name for seed k: NAME for seed 1 (the archives before seeds were the unit), NAME_seedK."""
    return name if seed == 1 else f"{name}_seed{seed}"


def log(message: str) -> None:
    """A progress line of the study (stdout, flushed; plain text so it reads the same in a log file)."""
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[study {stamp}] {message}", flush=True)


def repository_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


DIRTY_SUFFIX = "+changes"


def clean_commit(commit_text: str) -> bool:
    """Whether a recorded commit names a committed tree: not "unknown", not HEAD with uncommitted changes."""
    return bool(commit_text) and commit_text != "unknown" and not commit_text.endswith(DIRTY_SUFFIX)


def require_clean_tree(what: str) -> str:
    """The clean HEAD commit a study's result is made from; a StudyError when txl_tf/ or gin/ have uncommitted
    changes (a published archive must be reproducible from a commit: docs/study_plan.md)."""
    head = commit()
    if not clean_commit(head):
        raise StudyError(f"{what} would be made from {head} (txl_tf/ or gin/ differ from a commit); commit or "
                         "stash the changes first (the quick study runs from any tree)")
    return head


PLAN_PAGES = ("docs/study_plan.md", "docs/study_plan_v2.md", "docs/study_plan_v3.md")  # the analysis plan's versions


def plan_commits() -> dict:
    """{page: {"commit", "date"}} of the commit that added each version of the analysis plan (PLAN_PAGES), for the
    report to name beside the verdicts; {} outside git or where a page was never committed."""
    out = {}
    for page in PLAN_PAGES:
        try:
            lines = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h %ad", "--date=short", "--", page],
                                   cwd=repository_root(), capture_output=True, text=True,
                                   check=True).stdout.splitlines()
        except (OSError, subprocess.CalledProcessError):
            return {}
        added = [line.split() for line in lines if line.strip()]
        if added:  # the first time the page was added (the oldest line)
            out[page] = {"commit": added[-1][0], "date": added[-1][1]}
    return out


def commit() -> str:
    """The repository's HEAD commit, with "+changes" when txl_tf/ or gin/ differ from it ("unknown" outside git)."""
    root = repository_root()
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "txl_tf", "gin"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (DIRTY_SUFFIX if dirty else "")


def machine() -> dict:
    """Where and when the figures were measured (the report prints it next to every table)."""
    import tensorflow as tf

    flags = cpu_flags()
    isa = "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else \
        "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "isa": isa, "cores": cores, "date": datetime.date.today().isoformat(),
            "commit": commit(), "tensorflow": tf.__version__, "python": platform.python_version()}


class _Tee(io.TextIOBase):
    """Writes to a log file and, when `echo`, to the original stream too."""

    def __init__(self, stream, path: str, echo: bool):
        self.stream, self.file, self.echo = stream, open(path, "a"), echo  # noqa: SIM115 (closed in close())

    def write(self, text: str) -> int:
        self.file.write(text)
        if self.echo:
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def isatty(self) -> bool:  # plain log lines, not a progress bar
        return False

    def close(self) -> None:
        self.file.close()


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    # A study records NaN for a figure that is undefined (an interval of one run): not a finite-only file.
    return untrusted.load_json(path, max_bytes=RESULTS_LIMIT, what="the study's record", finite=False)


def write_json(path: str, value) -> None:
    """`value` as indented JSON in a new file renamed onto `path` (paths.atomic_file)."""
    with paths.atomic_file(path) as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")


def read_record(run_dir: str) -> dict | None:
    """The record (study.json) of a finished run, or None."""
    return _read_json(os.path.join(run_dir, RUN_RECORD))


def train_run(spec: RunSpec, run_dir: str, *, echo: bool = True, clean: bool = False) -> dict:
    """Trains `spec` into `run_dir` unless already finished; returns its record (study.json).

    Training runs in this process through `txl_tf.train.run` (gin cleared before and after), its console output
    appended to run_dir/train.log. Wall and CPU seconds add up over interrupted attempts. `clean`: refuse to
    train from uncommitted code (require_clean_tree), or to reuse a finished run that was.
    """
    import gin
    import keras

    from txl_tf import train

    record_path = os.path.join(run_dir, RUN_RECORD)
    record = _read_json(record_path)
    if record is not None:
        if record["digest"] != spec.digest():
            raise StudyError(
                f"{run_dir} holds a finished run of another configuration ({record['gin_files']} "
                f"{record['gin_params']}); remove it or choose another --output_dir")
        if clean and not clean_commit(str(record.get("commit", ""))):
            raise StudyError(f"{run_dir} was trained from {record.get('commit')!r}, not a committed tree; remove "
                             "it to train it again from a clean checkout")
        return record
    if clean:
        require_clean_tree(f"training {spec.name}")
    os.makedirs(run_dir, exist_ok=True)
    attempts_path = os.path.join(run_dir, ATTEMPTS_FILE)
    attempts = _read_json(attempts_path) or {"wall_seconds": 0.0, "cpu_seconds": 0.0, "attempts": 0}
    wall, cpu = time.perf_counter(), time.process_time()
    tee = _Tee(sys.stdout, os.path.join(run_dir, TRAIN_LOG), echo)
    gin.clear_config()
    try:
        with contextlib.redirect_stdout(tee):
            metrics = train.run(list(spec.gin_files), list(spec.gin_params), model_dir=run_dir)
    finally:
        gin.clear_config()
        tee.close()
        attempts["wall_seconds"] += time.perf_counter() - wall
        attempts["cpu_seconds"] += time.process_time() - cpu
        attempts["attempts"] += 1
        write_json(attempts_path, attempts)
        keras.backend.clear_session()
    from txl_tf.runs.run_dir import read_configs

    planned = read_configs(run_dir).train.train_steps
    gin.clear_config()
    if int(metrics["step"]) < planned:  # stopped on request (SIGTERM, Ctrl-C): resumable, not finished
        raise StudyError(f"{spec.name} stopped at step {metrics['step']} of {planned} (checkpoint saved in "
                         f"{run_dir}); re-run the study to resume it")
    record = {"name": spec.name, "label": spec.label, "gin_files": list(spec.gin_files),
              "gin_params": list(spec.gin_params), "digest": spec.digest(), "commit": commit(),
              "steps": int(metrics["step"]), "final_train_loss": float(metrics.get("loss", float("nan"))),
              "wall_seconds": round(attempts["wall_seconds"], 1), "cpu_seconds": round(attempts["cpu_seconds"], 1),
              "attempts": attempts["attempts"]}
    write_json(record_path, record)
    return record


def cached_eval(run_dir: str, key: str, compute: Callable[[], tuple[np.ndarray, dict]]) -> tuple[np.ndarray, dict]:
    """Per-token losses and facts of one evaluation, computed once: (losses [T] float32, info dict)."""
    directory = os.path.join(run_dir, EVAL_DIR)
    losses_path, info_path = os.path.join(directory, key + ".npy"), os.path.join(directory, key + ".json")
    info = _read_json(info_path)
    if info is not None and os.path.exists(losses_path):
        return np.load(losses_path), info
    losses, info = compute()
    os.makedirs(directory, exist_ok=True)
    np.save(losses_path + ".tmp.npy", np.asarray(losses, np.float32))
    os.replace(losses_path + ".tmp.npy", losses_path)
    write_json(info_path, info)  # written last: its presence marks a complete evaluation
    return np.asarray(losses, np.float32), info


def load_run_model(run_dir: str, gin_params: Sequence[str] = (), checkpoint: str | None = None):
    """(model, configs) of a finished run, float32, from its config.gin and latest checkpoint (or `checkpoint`, a
    prefix such as run_dir/ckpt-500)."""
    from txl_tf.runs.loading import load_model

    model, configs, _ = load_model(run_dir, checkpoint, gin_params=gin_params)
    return model, configs


def num_parameters(model) -> int:
    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


def check_parameters(records: dict, baseline: str, tolerance: float, gin_files: str) -> float:
    """The largest relative deviation of the runs' parameter counts from `baseline`'s; a StudyError above
    `tolerance` (the sizes in `gin_files` need fixing)."""
    base = records[baseline]["parameters"]
    deviation = max(abs(r["parameters"] - base) / base for r in records.values())
    if deviation > tolerance:
        counts = ", ".join(f"{n} {r['parameters']:,}" for n, r in records.items())
        raise StudyError(f"the runs' parameter counts differ by {deviation:.1%} (> {tolerance:.0%}): {counts}; "
                         f"fix the sizes in {gin_files}")
    return deviation


def paired_bootstrap(a: np.ndarray, b: np.ndarray, *, samples: int = 2000, seed: int = 0,
                     block: int = 100) -> dict:
    """Mean of a - b (per-token losses on the same tokens) with a 95% interval from a block bootstrap.

    Neighbouring tokens' losses are correlated, so blocks of `block` consecutive tokens are resampled (a tail
    shorter than a block is left out of the resampling, not of the mean).
    """
    diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    usable = (diff.shape[0] // block) * block
    blocks = diff[:usable].reshape(-1, block).mean(axis=1) if usable else diff[None]
    return bootstrap_blocks(float(diff.mean()), blocks, samples=samples, seed=seed)


def bootstrap_blocks(mean: float, blocks: np.ndarray, *, samples: int = 2000, seed: int = 0) -> dict:
    """`mean` with the 95% interval of the means of `blocks` (per-block means of a difference) resampled."""
    rng = np.random.default_rng(seed)
    means = blocks[rng.integers(0, blocks.shape[0], size=(samples, blocks.shape[0]))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": float(mean), "low": float(low), "high": float(high)}


def write_results(output_dir: str, study: str, section: dict) -> dict:
    """Merges one study's section into output_dir/results.json (`read_results` when there is one); returns the
    whole document."""
    path = os.path.join(output_dir, "results.json")
    document = read_results(path) if os.path.lexists(path) else {"schema": 1, "studies": {}}
    document["studies"][study] = section
    write_json(path, document)
    return document


RESULTS_FIX = ("re-run the study that writes that section (python -m txl_tf.study --study=NAME --output_dir=DIR), "
               "or restore the file")


def json_kind(value) -> str:
    """What a JSON value is, for an error line: "a list", "the string 'abc'", "null", "3.5"."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return "null" if value is None else json.dumps(value)


def results_error(path: str, field: str, problem: str) -> StudyError:
    """The one line for a results.json of the wrong shape: the file, the first wrong field, the fix."""
    return StudyError(f"{path} is not a study's results.json as this version reads it: {field} {problem}; "
                      f"{RESULTS_FIX}")


def read_results(path: str) -> dict:
    """The results document at `path`: an object {"schema": int, "studies": {name: object}} (a `results_error`
    otherwise; the sections' own shape is txl_tf.study.results_schema's to check)."""
    if not os.path.lexists(path):
        raise StudyError(f"{path} does not exist; run a study first (python -m txl_tf.study --study=ablation ...)")
    document = _read_json(path)
    if not isinstance(document, dict):
        raise results_error(path, "the document", f"is {json_kind(document)}, not an object")
    for key, what in (("schema", "an integer"), ("studies", "an object")):
        value = document.get(key)
        if key not in document:
            raise results_error(path, key, "is missing")
        if (isinstance(value, bool) or not isinstance(value, int)) if key == "schema" else not isinstance(value, dict):
            raise results_error(path, key, f"is {json_kind(value)}, not {what}")
    for name, section in document["studies"].items():
        if not isinstance(section, dict):
            raise results_error(path, f"studies.{name}", f"is {json_kind(section)}, not an object")
    return document
