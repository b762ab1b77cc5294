"""The training path chosen by measurement: `TrainConfig.mixed_precision`, `jit_compile` and `kernels` = "auto".

Which path trains fastest differs by machine, and a CPU flag does not say which (measured: on an Intel Xeon with
AVX-512 BF16 but no AMX, bfloat16 trains 29% slower than float32; on an AVX2-only AMD EPYC, XLA trains 20% faster
than TensorFlow's ops; on an AMD EPYC with AVX-512 BF16, bfloat16 with the fused kernels is fastest;
docs/performance.md). So "auto" times the candidate paths on this process's device, at the run's own model and
per-replica batch, and trains with the fastest:

    mixed_precision = "auto"   float32 and mixed_bfloat16 (on a GPU or TPU: mixed_bfloat16, native there)
    jit_compile = "auto"       without and with XLA (on a TPU: without; the TPU compiles everything anyway)
    kernels = "auto"           TensorFlow's ops and the fused CPU kernels (`txl_tf.model.fused`; not with XLA, only on
                               CPUs, only where the kernels build)

A field set to a value is not measured. Each candidate is timed by the caller's `time_step`: the trainer's own
step (`txl_tf.training.trainer.choose_path`: a `Trainer` on that path, fed random tokens, its `train_loop` timed after a
warm-up step; this module does not import the trainer, which imports it); the trainer seeds the global random
state again afterwards (a run with "auto" draws the same initial weights whatever was measured). A choice
is kept in `choices.json` of the cache folder ($TXL_TF_CACHE, else ~/.cache/txl_tf), keyed by the CPU, the
TensorFlow version, the devices, the model and the step's shape; `choose` says how noise is kept from deciding
for later runs (passes in alternating order, an unclear ranking not cached, a cached choice checked). The run's
config.gin records the chosen path (`txl_tf.train.with_path`) and a resumed run trains on it without measuring.

The cache is untrusted input: it is read only when it and every folder above it are safe from other users
(`untrusted_path`, the check the fused kernels' cache uses too), through `txl_tf.base.untrusted` (a regular file, at
most 4 MiB, strict JSON with finite numbers), and only when every entry fits the schema (`_cache_problem`: a
choice among the known paths, finite positive rates named by the known paths). A cache that fails is ignored with
one warning line and measured again; its text never reaches a config file (`with_path` writes only the names of
`PATH_NAMES` and numbers it formats itself).

oneDNN: TensorFlow's Linux build turns its oneDNN matmuls on by default only on CPUs with AVX512_VNNI,
AVX512_BF16, AVX_VNNI or AMX (`DefaultOneDnnPolicy` in tensorflow/core/util/port.cc); elsewhere (AVX2-only CPUs)
matmuls run on Eigen. `choose_onednn` measures the square-matmul peak with TF_ENABLE_ONEDNN_OPTS=0 and =1 in two
child processes (once per CPU and TensorFlow version; cached) and the training entry point sets the faster before
TensorFlow starts, unless the user set the variable.

This module imports TensorFlow only inside its functions: `choose_onednn` runs before TensorFlow is imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
import platform
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from txl_tf.base import untrusted as untrusted_files
from txl_tf.base.errors import UserError, one_line
from txl_tf.model.policy import AUTO  # "auto": the value of a field to measure
from txl_tf.model.policy import KERNELS as KERNEL_CHOICES  # the choices of TrainConfig.kernels

FIELDS = ("mixed_precision", "jit_compile", "kernels")
CHOICES_FILE = "choices.json"
ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"


@dataclasses.dataclass(frozen=True)
class TrainPath:
    """One way to run the training step: precision, compilation and elementwise kernels."""

    mixed_precision: bool
    jit_compile: bool
    kernels: str  # "tf" or "fused"

    def describe(self) -> str:
        precision = "mixed_bfloat16" if self.mixed_precision else "float32"
        kernels = "the fused kernels" if self.kernels == "fused" else "TensorFlow's ops"
        return f"{precision}, {'XLA' if self.jit_compile else 'no XLA'}, {kernels}"

    def bindings(self) -> dict:
        """The TrainConfig fields of this path."""
        return dataclasses.asdict(self)


# Every path's description: the only names of a path a cache entry may hold and a config file may record.
PATH_NAMES = frozenset(TrainPath(p, j, k).describe() for p in (False, True) for j in (False, True)
                       for k in KERNEL_CHOICES)


def auto_fields(config) -> tuple[str, ...]:
    """The fields of TrainConfig `config` that are "auto"."""
    return tuple(f for f in FIELDS if getattr(config, f) == AUTO)


def with_recorded_path(config, saved):
    """`config` (this command's TrainConfig) with its "auto" fields replaced by the values a run directory's saved
    config (`saved`, its TrainConfig, None for a new run) recorded, where those are concrete: a resumed run keeps
    the path it trained on."""
    if saved is None:
        return config
    recorded = {f: getattr(saved, f) for f in auto_fields(config) if getattr(saved, f) != AUTO}
    return dataclasses.replace(config, **recorded) if recorded else config


def candidates(config, *, accelerators: Sequence[str] = (), fused_why: str | None = None) -> list[TrainPath]:
    """The paths "auto" chooses among for TrainConfig `config` on a strategy computing on `accelerators` ("GPU",
    "TPU"; empty for CPUs), where the fused kernels cannot run for reason `fused_why` (None: they can).

    A concrete field keeps its value (kernels="fused" stays, and the trainer falls back from it as before).
    """
    on_tpu, on_accelerator = "TPU" in accelerators, bool(accelerators)
    if config.mixed_precision == AUTO:
        precisions = (True,) if on_accelerator else (False, True)
    else:
        precisions = (bool(config.mixed_precision),)
    if config.jit_compile == AUTO:
        jits = (False,) if on_tpu else (False, True)
    else:
        jits = (bool(config.jit_compile),)
    if config.kernels == AUTO:
        kernels = ("tf",) if on_accelerator or fused_why else ("tf", "fused")
    else:
        kernels = (config.kernels,)
    paths = [TrainPath(p, j, k) for p in precisions for j in jits for k in kernels]
    return [p for p in paths if not (p.jit_compile and p.kernels == "fused")] or \
        [TrainPath(precisions[0], False, kernels[-1])]


# ---- the cache of choices ----------------------------------------------------------------------------------
def cache_file() -> pathlib.Path:
    base = os.environ.get("TXL_TF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "txl_tf")
    return pathlib.Path(base) / CHOICES_FILE


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first), else the platform's processor."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of the first CPU in `cpuinfo` (Linux's format); empty where it is unreadable.
    For the record of a run and the cache key (which CPU measured it), not for choosing a path."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    """The cache's name of this CPU: model name, a digest of its instruction-set flags and the core count."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{cpu_model()} [{flags}] x{os.cpu_count()}"


# ---- the cache of choices: reading (untrusted), validating, writing ------------------------------------------
_MAX_TEXT = 200  # "measured" and "cpu": a date and a CPU's name
_warned: set = set()


def _warn_cache(path, why: str, consequence: str) -> None:
    """One warning line per cache file and reason in a process."""
    if (str(path), why) not in _warned:
        _warned.add((str(path), why))
        logging.warning("txl_tf: ignoring the autotune cache %s (%s); %s", path, why, consequence)


def _rate_problem(value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{type(value).__name__} where a number belongs"
    try:
        if not (math.isfinite(float(value)) and 0 <= value < 1e18):
            return f"{value!r} is not a rate"
    except OverflowError:
        return "an integer too large for a rate"
    return None


def _entry_problem(entry) -> str | None:
    """Why one cache entry does not fit the schema of a path entry or a oneDNN entry, or None."""
    if not isinstance(entry, dict):
        return f"{type(entry).__name__} where an object belongs"
    choice = entry.get("choice")
    if isinstance(choice, dict):  # a training path
        fields, rates = {"choice", "tokens_per_second", "measured", "cpu"}, entry.get("tokens_per_second", {})
        if set(choice) != set(FIELDS):
            return f"its choice has the fields {sorted(choice)}, not {list(FIELDS)}"
        for name in ("mixed_precision", "jit_compile"):
            if not isinstance(choice[name], bool):
                return f"its choice's {name} is {type(choice[name]).__name__}, not true or false"
        if not isinstance(choice["kernels"], str) or choice["kernels"] not in KERNEL_CHOICES:
            return f"its choice's kernels is not one of {', '.join(KERNEL_CHOICES)}"
        if not isinstance(rates, dict):
            return f"its tokens_per_second is {type(rates).__name__}, not an object"
        for name, rate in rates.items():
            if name not in PATH_NAMES:
                return f"its tokens_per_second names an unknown path ({len(name)} characters)"
            problem = _rate_problem(rate)
            if problem:
                return f"its tokens_per_second of {name} is {problem}"
    elif isinstance(choice, str) and choice in ("0", "1"):  # oneDNN off or on
        fields, gflops = {"choice", "gflops", "cpu"}, entry.get("gflops", {})
        if not isinstance(gflops, dict) or not set(gflops) <= {"0", "1"}:
            return "its gflops is not an object of \"0\" and \"1\""
        problem = next(filter(None, map(_rate_problem, gflops.values())), None)
        if problem:
            return f"its gflops holds {problem}"
    else:
        return "its choice is neither a training path nor a oneDNN setting"
    extra = set(entry) - fields
    if extra:
        return f"it has unknown fields ({len(extra)})"
    for name in ("measured", "cpu"):
        if name in entry and not (isinstance(entry[name], str) and len(entry[name]) <= _MAX_TEXT):
            return f"its {name} is not a text of at most {_MAX_TEXT} characters"
    return None


def _cache_problem(value) -> str | None:
    """Why the parsed cache `value` does not fit the schema, or None: an object of entries keyed by hex digests."""
    if not isinstance(value, dict):
        return "it is not a JSON object"
    for key, entry in value.items():
        name = key.removeprefix("onednn:")
        if not (len(name) == 24 and all(c in "0123456789abcdef" for c in name)):
            return f"a key is not a cache key ({len(key)} characters)"
        problem = _entry_problem(entry)
        if problem:
            return f"entry {key}: {problem}"
    return None


def _cache_folder_problem(path: pathlib.Path) -> str | None:
    """Why the folder of the cache file `path` may be another user's (`untrusted_path`), or None; None too when it
    does not exist yet."""
    try:
        return untrusted_files.untrusted_path(path.parent)
    except FileNotFoundError:
        return None


_NOT_WRITTEN = "measuring again without caching (set TXL_TF_CACHE to a folder only you can write)"
_REWRITTEN = "measuring again and rewriting it"


def _read_cache() -> dict:
    """The validated cache; {} when missing, or (one warning line) unsafe or invalid."""
    path = cache_file()
    try:
        problem = _cache_folder_problem(path)
        if problem:
            _warn_cache(path, problem, _NOT_WRITTEN)
            return {}
        info = os.lstat(path)
        reason = "a symbolic link" if stat.S_ISLNK(info.st_mode) else (
            untrusted_files.owner_problem(info) if hasattr(os, "getuid") else None)
        if reason:
            _warn_cache(path, f"{path} is {reason}", _REWRITTEN)
            return {}
        what = "the autotune cache"
        value = untrusted_files.load_json(path, max_bytes=untrusted_files.JSON_LIMIT, what=what)
    except FileNotFoundError:
        return {}
    except untrusted_files.UntrustedFileError as error:  # not a regular file, too large, not strict JSON
        text = one_line(error)
        stripped = text.removeprefix(f"{what} {path} ")
        why = f"it {stripped.rpartition('; ')[0] or stripped}" if stripped != text else text
        _warn_cache(path, why, _REWRITTEN)
        return {}
    except OSError as error:  # unreadable: measured again, not rewritten
        _warn_cache(path, f"cannot read it: {error.strerror or error}", "measuring again")
        return {}
    problem = _cache_problem(value)
    if problem:
        _warn_cache(path, problem, _REWRITTEN)
        return {}
    return value


def _write_cache(key: str, entry: dict) -> None:
    """Adds `entry` under `key` (atomically; a cache that cannot be written, or is in a folder other users could
    write, is skipped: the next run measures)."""
    path = cache_file()
    try:
        untrusted_files.make_private_dirs(path.parent)
        if _cache_folder_problem(path):
            return
        cache = _read_cache()
        cache[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".choices-")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def _key(kind: str, **parts) -> str:
    import tensorflow as tf

    parts = dict(parts, kind=kind, cpu=cpu_name(), tf=tf.__version__, onednn=os.environ.get(ONEDNN_ENV, "default"))
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


MEASURE_ENV = "TXL_TF_AUTOTUNE"  # "measure": time every candidate again, whatever the cache holds
NOISE = 0.10  # a candidate's passes may differ by this share of its rate and still read as one rate
PASSES = 3  # at most: two passes over the candidates in opposite orders, a third when the ranking is not clear
CHECK_SHARE = 0.85  # a cached choice timed below this share of its recorded rate (or below the runner-up) is redone


def _top_two(rates: list) -> list:
    """A candidate's two fastest passes (one outlier of three passes is let go: noise only slows)."""
    return sorted(rates)[-2:]


def clear_ranking(rates: dict) -> bool:
    """Whether the passes `rates` ({path: [tokens/s of each pass]}, candidates that ran) rank the candidates
    clearly: the fastest's second-fastest pass (its only one after one pass) beats every other candidate's fastest,
    or every candidate's two fastest passes agree within NOISE (then the best of each is its rate, and near-equal
    candidates may come either way)."""
    ran = {p: r for p, r in rates.items() if r}
    best = max(ran, key=lambda p: max(ran[p]))
    if all(min(_top_two(ran[best])) > max(r) for p, r in ran.items() if p != best):
        return True
    return all(max(_top_two(r)) <= (1 + NOISE) * min(_top_two(r)) for r in ran.values())


def spread(rates: dict) -> float:
    """The largest share by which one candidate's two fastest passes differ (0.25: 25% apart)."""
    return max((1 - min(_top_two(r)) / max(r) for r in rates.values() if r), default=0.0)


def choose(model_kwargs: dict, train_config, batch: int, *, time_step: Callable[[TrainPath, int], float],
           accelerators: Sequence[str] = (), fused_why: str | None = None, log: Callable[[str], None] = print,
           steps: int = 3, use_cache: bool = True) -> tuple[TrainPath, dict]:
    """(the fastest path among `candidates`, {path description: tokens/s}) for a step of `model_kwargs` at the
    per-replica `batch` and TrainConfig `train_config`'s tgt_len. `time_step(path, steps)`: the median seconds of one
    step on `path` over `steps` timed ones (`txl_tf.training.trainer.choose_path` passes the trainer's). One candidate: no
    measurement.

    So that one noisy minute cannot decide for every later run:
    - the candidates are timed in passes, the second in the opposite order of the first (a slow spell hits
      different candidates), a third pass when the ranking is not clear (`clear_ranking`); each candidate's rate is
      its fastest pass (noise only slows). A ranking still unclear after PASSES passes trains on the fastest but is
      not cached, and the log says by how much the passes moved: the next run measures again;
    - a cached choice is checked when a run starts: its path and the runner-up are timed once, and the choice
      stands only when it runs at CHECK_SHARE of its recorded rate or more and no slower than the runner-up;
      otherwise every candidate is measured again. $TXL_TF_AUTOTUNE=measure skips the cache.
    Logs one line per timing (progress) and one saying where the choice came from. When no candidate runs a step, a
    UserError names the first one's reason in one line (out of memory: lower the batch)."""
    paths = candidates(train_config, accelerators=accelerators, fused_why=fused_why)
    if len(paths) == 1:
        return paths[0], {}
    tgt_len = train_config.tgt_len
    recompute = getattr(train_config, "recompute", "none")
    key = _key("path", model=model_kwargs, batch=batch, tgt_len=tgt_len, recompute=recompute,
               accelerators=sorted(accelerators), candidates=[dataclasses.asdict(p) for p in paths])
    use_cache = use_cache and os.environ.get(MEASURE_ENV, "").strip().lower() != "measure"
    cached = _read_cache().get(key) if use_cache else None
    if cached is not None:
        checked = _check_cached(cached, key, paths, batch, tgt_len, time_step, steps, log)
        if checked is not None:
            return checked
    return _measure_all(paths, key, batch, tgt_len, time_step, steps, log)


def _rate(path: TrainPath, batch: int, tgt_len: int, time_step, steps: int) -> float:
    return batch * tgt_len / time_step(path, steps)


def _check_cached(cached: dict, key: str, paths: list, batch: int, tgt_len: int, time_step, steps: int,
                  log) -> tuple[TrainPath, dict] | None:
    """The cached choice and its rates when it still holds (`choose`), else None (measure every candidate)."""
    path = next((p for p in paths if p.bindings() == cached["choice"]), None)
    rates = cached.get("tokens_per_second", {})
    names = {p.describe() for p in paths}
    if path is None or not set(rates) <= names or path.describe() not in rates:
        _warn_cache(cache_file(), f"entry {key} names a path that is not among this run's candidates", _REWRITTEN)
        return None
    table = {p.describe(): float(rates[p.describe()]) for p in paths if p.describe() in rates}
    recorded = table[path.describe()]
    others = sorted((p for p in paths if p != path and p.describe() in table), key=lambda p: -table[p.describe()])
    when = cached.get("measured", "an earlier run")
    log(f"checking the training path cached on {when} ({cache_file()}): {path.describe()}, recorded at "
        f"{recorded:,.0f} tokens/s" + (f", against the runner-up {others[0].describe()}" if others else ""))
    now = {}
    for candidate in [path, *others[:1]]:
        try:
            now[candidate] = _rate(candidate, batch, tgt_len, time_step, steps)
        except Exception as error:  # noqa: BLE001  (a path that cannot run now does not stand)
            log(f"  {candidate.describe()}: cannot run here ({type(error).__name__}: {one_line(error)[:200]})")
            now[candidate] = 0.0
            continue
        log(f"  {candidate.describe()}: {now[candidate]:,.0f} tokens/s now")
    runner_up = now.get(others[0], 0.0) if others else 0.0
    if now[path] >= CHECK_SHARE * recorded and now[path] >= runner_up:
        log(f"training path (auto, cached on {when}, checked now at {now[path]:,.0f} tokens/s): {path.describe()} "
            f"(to measure every candidate again: {MEASURE_ENV}=measure)")
        return path, table
    why = (f"it ran at {now[path]:,.0f} tokens/s, under {CHECK_SHARE:.0%} of the {recorded:,.0f} recorded"
           if now[path] < CHECK_SHARE * recorded else
           f"the runner-up ran faster ({runner_up:,.0f} against {now[path]:,.0f} tokens/s)")
    log(f"the cached training path does not hold now ({why}); measuring every candidate again")
    return None


def _measure_all(paths: list, key: str, batch: int, tgt_len: int, time_step, steps: int,
                 log) -> tuple[TrainPath, dict]:
    """Every candidate timed in passes (`choose`); the fastest, cached when the ranking is clear."""
    log(f"choosing the training path (auto): timing {len(paths)} candidates at batch {batch} x {tgt_len} tokens, "
        f"in 2 passes (a third if the ranking is not clear)")
    rates, failed, first_failure = {p: [] for p in paths}, set(), None
    for done in range(PASSES):
        order = paths if done % 2 == 0 else paths[::-1]
        for i, path in enumerate(order, 1):
            if path in failed:
                continue
            start = time.perf_counter()
            try:
                rate = _rate(path, batch, tgt_len, time_step, steps)
            except Exception as error:  # noqa: BLE001  (a candidate that cannot run here is not chosen)
                reason = f"{type(error).__name__}: {one_line(error)[:200]}"
                first_failure = first_failure or (path, error, reason)
                failed.add(path)
                log(f"  [pass {done + 1}, {i}/{len(paths)}] {path.describe()}: cannot run here ({reason})")
                continue
            rates[path].append(rate)
            log(f"  [pass {done + 1}, {i}/{len(paths)}] {path.describe()}: {rate:,.0f} tokens/s "
                f"({time.perf_counter() - start:.0f} s with compilation)")
        if not any(rates.values()):
            raise _none_ran(paths, batch, tgt_len, *first_failure)
        if done >= 1 and clear_ranking(rates):
            break
    ran = {p: r for p, r in rates.items() if r}
    best = max(ran, key=lambda p: max(ran[p]))
    table = {p.describe(): round(max(r), 1) for p, r in ran.items()}
    if not clear_ranking(ran):
        log(f"training path (auto): {best.describe()} ({max(ran[best]):,.0f} tokens/s, the fastest of {len(ran)}), "
            f"not cached: the passes moved by up to {spread(ran):.0%} and left the ranking unclear (a busy "
            "machine?); the next run measures again")
        return best, table
    _write_cache(key, {"choice": dataclasses.asdict(best), "tokens_per_second": table,
                       "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_name()})
    log(f"training path (auto, measured now; cached in {cache_file()}): {best.describe()} "
        f"({max(ran[best]):,.0f} tokens/s, the fastest of {len(ran)} over {len(max(ran.values(), key=len))} passes)")
    return best, table


def _none_ran(paths, batch: int, tgt_len: int, first: TrainPath, error: Exception, reason: str) -> UserError:
    """The one-line error when no candidate path ran: the first failure's reason and the fix."""
    out_of_memory = type(error).__name__ in ("ResourceExhaustedError", "MemoryError") or "OOM" in reason
    fix = ("lower TrainConfig.batch_size or tgt_len, or raise TrainConfig.grad_accum_steps (it runs the batch in "
           "smaller chunks)" if out_of_memory else
           "fix that, or set TrainConfig.mixed_precision, jit_compile and kernels to values to see the full error")
    return UserError(f"none of the {len(paths)} candidate training paths ran a step at batch {batch} x {tgt_len} "
                     f"tokens; the first, {first.describe()}, failed with {reason}; {fix}")


# ---- oneDNN ------------------------------------------------------------------------------------------------
_MATMUL_PEAK = """
import time, tensorflow as tf
best = 0.0
for dtype in (tf.float32, tf.bfloat16):
    a = tf.cast(tf.random.stateless_normal([{n}, {n}], seed=[1, 2]) / {n} ** 0.5, dtype)
    f = tf.function(lambda x: tf.reduce_sum(tf.cast(tf.matmul(x, x)[:1, :1], tf.float32)))
    f(a).numpy()
    for _ in range(5):
        start = time.perf_counter(); f(a).numpy()
        best = max(best, 2 * {n} ** 3 / (time.perf_counter() - start))
print(best)
"""


def onednn_peaks(size: int = 1536, timeout: float = 120.0) -> dict:
    """{"0": FLOP/s, "1": FLOP/s}: the best square-matmul peak (float32 or bfloat16) with TF_ENABLE_ONEDNN_OPTS=0
    and =1, each in a child process (the variable is read once, when TensorFlow starts)."""
    peaks = {}
    for value in ("0", "1"):
        env = dict(os.environ, **{ONEDNN_ENV: value, "TF_CPP_MIN_LOG_LEVEL": "3"})
        try:
            result = subprocess.run([sys.executable, "-c", _MATMUL_PEAK.format(n=size)], capture_output=True,
                                    text=True, env=env, timeout=timeout, check=True)
            peaks[value] = float(result.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError):
            continue
    return peaks


def choose_onednn(log: Callable[[str], None] = print) -> str | None:
    """Sets TF_ENABLE_ONEDNN_OPTS to the faster setting on this CPU (measured once, then cached) and returns it;
    leaves a value the user set alone (returns None). It takes effect in this process when TensorFlow is not
    imported yet (call it first), and in the child processes started afterwards."""
    if os.environ.get(ONEDNN_ENV) is not None:
        return None
    key = "onednn:" + hashlib.sha256(f"{cpu_name()}|{_tf_version()}".encode()).hexdigest()[:24]
    cached = _read_cache().get(key)
    if isinstance(cached, dict) and cached.get("choice") in ("0", "1"):
        value = cached["choice"]
    else:
        log("measuring TensorFlow's matmul with oneDNN off and on (once per CPU and TensorFlow version)")
        peaks = onednn_peaks()
        if len(peaks) < 2:
            return None
        value = max(peaks, key=peaks.get)
        _write_cache(key, {"choice": value, "gflops": {k: round(v / 1e9, 1) for k, v in peaks.items()},
                           "cpu": cpu_name()})
        log(f"oneDNN {'on' if value == '1' else 'off'}: square-matmul peak {peaks[value] / 1e9:.1f} GFLOP/s "
            f"against {peaks['1' if value == '0' else '0'] / 1e9:.1f}")
    os.environ[ONEDNN_ENV] = value
    return value


def _tf_version() -> str:
    """TensorFlow's installed version, read without importing it."""
    from importlib import metadata

    for name in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"
