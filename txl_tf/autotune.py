"""The training path chosen by measurement: `TrainConfig.mixed_precision`, `jit_compile` and `kernels` = "auto".

Which path trains fastest differs by machine, and a CPU flag does not say which (measured: on an Intel Xeon with
AVX-512 BF16 but no AMX, bfloat16 trains 29% slower than float32; on an AVX2-only AMD EPYC, XLA trains 20% faster
than TensorFlow's ops; on an AMD EPYC with AVX-512 BF16, bfloat16 with the fused kernels is fastest;
docs/performance.md). So "auto" times the candidate paths on this process's device, at the run's own model and
per-replica batch, and trains with the fastest:

    mixed_precision = "auto"   float32 and mixed_bfloat16 (on a GPU or TPU: mixed_bfloat16, native there)
    jit_compile = "auto"       without and with XLA (on a TPU: without; the TPU compiles everything anyway)
    kernels = "auto"           TensorFlow's ops and the fused CPU kernels (`txl_tf.fused`; not with XLA, only on
                               CPUs, only where the kernels build)

A field set to a value is not measured. Each candidate is one real training step of the run's model (forward,
NLL, backward, clipping, Adam) on random tokens, a warm-up step then the median of `steps`; the global random
state is restored afterwards (a run with "auto" draws the same initial weights whatever was measured). A choice
is kept in `choices.json` of the cache folder ($TXL_TF_CACHE, else ~/.cache/txl_tf), keyed by the CPU, the
TensorFlow version, the devices, the model and the step's shape, so a machine measures a setting once. The run's
config.gin records the chosen path (`txl_tf.train.with_path`) and a resumed run trains on it without measuring.

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
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

AUTO = "auto"
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


# ---- timing one training step ------------------------------------------------------------------------------
def training_step(model_kwargs: dict, path: TrainPath, *, recompute: str = "none", train_config=None):
    """(model, step): `TransformerXL(**model_kwargs)` on `path` and a `tf.function` `step(tokens, targets,
    memory) -> (loss, new memory)` doing what the trainer's step does on one replica: forward, mean NLL,
    backward, clipping by global norm and the trainer's Adam (`train_config`'s settings; TrainConfig's defaults
    when None)."""
    import tensorflow as tf

    from txl_tf import loading, schedules
    from txl_tf.configs import TrainConfig
    from txl_tf.model import TransformerXL

    train_config = train_config or TrainConfig()
    extra = {"recompute": recompute} if recompute != "none" else {}
    with loading.dtype_policy("mixed_bfloat16" if path.mixed_precision else "float32"):
        model = TransformerXL(**model_kwargs, fused_kernels=path.kernels == "fused", **extra)
        optimizer = schedules.make_optimizer(train_config, train_config.learning_rate)
        optimizer.build(model.trainable_variables)
    clip = train_config.clip_norm

    @tf.function(jit_compile=path.jit_compile)
    def step(tokens, targets, memory):
        with tf.GradientTape() as tape:
            hidden, new_memory = model(tokens, memory, training=True)
            loss = tf.reduce_mean(model.nll(hidden, targets))
        grads = tape.gradient(loss, model.trainable_variables)
        grads, _ = tf.clip_by_global_norm(grads, clip)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss, new_memory

    return model, step


def step_seconds(model_kwargs: dict, path: TrainPath, batch: int, tgt_len: int, *, steps: int = 3,
                 warmup: int = 1, recompute: str = "none", train_config=None) -> float:
    """Median seconds of a `training_step` at [batch, tgt_len] on random tokens with the memory carried; the
    first `warmup` steps (tracing, XLA's compilation) are not timed."""
    import tensorflow as tf

    model, step = training_step(model_kwargs, path, recompute=recompute, train_config=train_config)
    data = tf.random.stateless_uniform([batch, tgt_len + 1], [7, 11], 0, model_kwargs["n_token"], tf.int32)
    memory = model.initial_memory(batch)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss, memory = step(data[:, :-1], data[:, 1:], memory)
        loss.numpy()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


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


def _read_cache() -> dict:
    try:
        with open(cache_file()) as f:
            value = json.load(f)  # plain JSON: reading it runs nothing
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    """Adds `entry` under `key` (atomically; a cache that cannot be written is skipped: the next run measures)."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _read_cache()
        cache[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".choices-")
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def _key(kind: str, **parts) -> str:
    import tensorflow as tf

    parts = dict(parts, kind=kind, cpu=cpu_name(), tf=tf.__version__, onednn=os.environ.get(ONEDNN_ENV, "default"))
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def choose(model_kwargs: dict, train_config, batch: int, *, accelerators: Sequence[str] = (),
           fused_why: str | None = None, log: Callable[[str], None] = print, steps: int = 3,
           use_cache: bool = True) -> tuple[TrainPath, dict]:
    """(the fastest path among `candidates`, {path description: tokens/s measured, or "cached"}) for a step of
    `model_kwargs` at the per-replica `batch` and TrainConfig `train_config`'s tgt_len. One candidate: no
    measurement. Logs one line per measured candidate (progress) and one for the choice."""
    paths = candidates(train_config, accelerators=accelerators, fused_why=fused_why)
    if len(paths) == 1:
        return paths[0], {}
    tgt_len = train_config.tgt_len
    recompute = getattr(train_config, "recompute", "none")
    key = _key("path", model=model_kwargs, batch=batch, tgt_len=tgt_len, recompute=recompute,
               accelerators=sorted(accelerators), candidates=[dataclasses.asdict(p) for p in paths])
    cached = _read_cache().get(key) if use_cache else None
    if isinstance(cached, dict) and cached.get("choice") in [dataclasses.asdict(p) for p in paths]:
        path = TrainPath(**cached["choice"])
        log(f"training path (auto, measured earlier on this machine; {cache_file()}): {path.describe()}")
        return path, cached.get("tokens_per_second", {})
    log(f"choosing the training path (auto): timing {len(paths)} candidates at batch {batch} x {tgt_len} tokens")
    rates = {}
    for i, path in enumerate(paths, 1):
        start = time.perf_counter()
        try:
            seconds = step_seconds(model_kwargs, path, batch, tgt_len, steps=steps, recompute=recompute,
                                   train_config=train_config)
        except Exception as error:  # noqa: BLE001  (a candidate that cannot run here is not chosen)
            log(f"  [{i}/{len(paths)}] {path.describe()}: cannot run here ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:200] if str(error) else ''})")
            continue
        rates[path] = batch * tgt_len / seconds
        log(f"  [{i}/{len(paths)}] {path.describe()}: {rates[path]:,.0f} tokens/s "
            f"({time.perf_counter() - start:.0f} s with compilation)")
    if not rates:
        raise RuntimeError("no candidate training path ran; set TrainConfig.mixed_precision, jit_compile and "
                           "kernels explicitly")
    best = max(rates, key=rates.get)
    table = {p.describe(): round(r, 1) for p, r in rates.items()}
    _write_cache(key, {"choice": dataclasses.asdict(best), "tokens_per_second": table,
                       "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_name()})
    log(f"training path (auto): {best.describe()} ({rates[best]:,.0f} tokens/s, the fastest of {len(rates)})")
    return best, table


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
