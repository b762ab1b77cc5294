"""Training throughput of TransformerXL on this machine, beside the authors' code (a benchmark, not a test).

    python scripts/benchmark_model.py [--batch=2,8 --tgt_len=512 --mem_len=512 --steps=5 --modes=f32,bf16,...]
        [--kernels=tf,fused] [--peer=DIR] [--profile]

Times the trainer's own training step (`txl_tf.training.trainer.timing_trainer`: a `Trainer` under the default strategy
on one in-memory batch of random tokens, its `train_loop` one step at a time: forward, token-weighted NLL,
backward, clipping by global norm, Adam update, the non-finite check; the peer's step does the same but the last)
of the enwik8 base architecture (12 layers, d_model 512, 8x64 heads, d_inner 2048, vocab 204) with memory carried
between steps, in each mode
(float32 / mixed_bfloat16, with / without XLA) and batch, each in a fresh process, and reports tokens/s and model
FLOPs utilisation (MFU) against two peaks measured in the same run: TensorFlow's best square-matmul peak of the
mode's precision (`tf.function`, with or without XLA), and the best bfloat16 peak of the CPU (the larger of
TensorFlow's and, with --peer, PyTorch's).

--kernels: the training step's kernels (`TrainConfig.kernels`) each mode without XLA is timed with: `tf`
(TensorFlow's ops, the trainer's default) and/or `fused` (the C++ CPU kernels of `txl_tf/model/fused.py`; rows
`MODE+fused`). XLA cannot run the fused kernels, so the XLA modes are timed with TensorFlow's ops only.

--peer=DIR: also times the authors' PyTorch code (a directory made by `../shared/peer/setup.sh`; it runs
`DIR/code/train_step.py BATCH` with `DIR/venv/bin/python` right after our modes of that batch, and measures
PyTorch's square-matmul peaks), and prints its tokens/s beside ours and the ratio. Its script supports only
tgt_len = mem_len = 512.

--profile: each mode's child also records three steps with TensorFlow's profiler (`tf.profiler.experimental`)
and prints how the step's wall time splits into time in which a matmul runs (and the matmul GFLOP/s over it) and
time in which none runs, of which host/idle is the part with no op at all (Python, tf.function dispatch, the
executor between ops); then where the op time goes (matmuls, attention elementwise work, dropout, layer norm,
casts, optimizer (clipping and Adam), other), summed over the executor threads.

FLOP count: `txl_tf.model.flops` (matmul FLOPs as executed, attention and the memory's key/value projections included,
training = 3 x forward), the same count the trainer's start-up MFU line uses.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# First: txl_tf.base.cli sets TF_CPP_MIN_LOG_LEVEL (and txl_tf the Keras backend) before TensorFlow starts.
from txl_tf.base import cli

# isort: split
import keras
import tensorflow as tf
from absl import app, flags

from txl_tf.configs import TrainConfig
from txl_tf.model import fused
from txl_tf.model.flops import measure_matmul_peak, model_flops_per_token
from txl_tf.training import autotune
from txl_tf.training import trainer as trainer_lib

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_list("batch", ["2"], "batch sizes (comma-separated)", flag_values=fv)
    flags.DEFINE_integer("tgt_len", 512, "segment length", flag_values=fv)
    flags.DEFINE_integer("mem_len", 512, "memory length", flag_values=fv)
    flags.DEFINE_integer("n_layer", 12, "layers (enwik8 base: 12)", flag_values=fv)
    flags.DEFINE_integer("steps", 5, "timed steps per mode (after 2 warm-up steps); the median counts",
                         flag_values=fv)
    flags.DEFINE_list("modes", list(MODES), "modes to time: auto (the path the trainer's 'auto' chooses here, "
                      "measured as the trainer measures it) and fixed ones", flag_values=fv)
    flags.DEFINE_list("kernels", ["tf"], "the step's kernels to time each mode without XLA with: "
                      "tf (TensorFlow's ops) and/or fused (txl_tf/model/fused.py); XLA modes run TensorFlow's ops only",
                      flag_values=fv)
    flags.DEFINE_integer("matmul_size", 4096, "square matmul size for the peak measurement", flag_values=fv)
    flags.DEFINE_string("peer", None, "directory made by ../shared/peer/setup.sh: also time the authors' PyTorch "
                        "code", flag_values=fv)
    flags.DEFINE_bool("profile", False, "record 3 steps per mode with TensorFlow's profiler and print the breakdown",
                      flag_values=fv)
    flags.DEFINE_string("child_mode", None, "internal: time only this mode and print the result as JSON",
                        flag_values=fv)


MODES = ("auto", "f32", "bf16", "f32_xla", "bf16_xla")
ARCH = dict(n_token=204, d_model=512, n_head=8, d_head=64, d_inner=2048, dropout=0.1, dropatt=0.0)
PEER_LENGTH = 512  # the peer's train_step.py runs tgt_len = mem_len = 512
CATEGORIES = ("matmul", "attention elementwise", "dropout", "layer norm", "feed-forward elementwise", "casts",
              "optimizer", "embedding and softmax", "other")


def train_flops_per_step(batch, qlen, mlen, n_layer, n_token, d_model, n_head, d_head, d_inner, **_):
    """Matmul FLOPs of one training step: txl_tf.model.flops, the one place the formula lives (see its docstring)."""
    per_token = model_flops_per_token(batch_size=batch, tgt_len=qlen, mem_len=mlen, n_layer=n_layer,
                                      n_token=n_token, d_model=d_model, n_head=n_head, d_head=d_head,
                                      d_inner=d_inner)
    return per_token * batch * qlen


def mode_path(mode: str, kernels: str = "tf") -> autotune.TrainPath:
    """The training path of a fixed mode ("f32", "bf16", "f32_xla", "bf16_xla") with `kernels`."""
    return autotune.TrainPath(mode.startswith("bf16"), mode.endswith("xla"), kernels)


def model_kwargs(mlen, n_layer) -> dict:
    return dict(ARCH, n_layer=n_layer, mem_len=mlen)


def time_training(mode, batch, qlen, mlen, n_layer, steps, profile_dir=None, kernels="tf"):
    """(seconds per training step (median of `steps`), the profile breakdown when asked, the path timed, the
    candidates' tokens/s when "auto" measured) in `mode` with `kernels`: the trainer's step
    (`txl_tf.training.trainer.timing_trainer`), the first 2 steps untimed; mode "auto" times the path the trainer picks
    (`txl_tf.training.trainer.choose_path`)."""
    measured, config = {}, TrainConfig(tgt_len=qlen)
    if mode == "auto":
        path, measured = trainer_lib.choose_path(model_kwargs(mlen, n_layer), config, batch,
                                                 fused_why=fused.unavailable(),
                                                 log=lambda line: print(line, file=sys.stderr))
    else:
        path = mode_path(mode, kernels)
    keras.utils.set_random_seed(0)
    trainer = trainer_lib.timing_trainer(model_kwargs(mlen, n_layer), config, batch, path)
    seconds = trainer_lib.step_seconds(trainer, steps, warmup=2)
    breakdown = None
    if profile_dir:
        profiled = 3
        tf.profiler.experimental.start(profile_dir)
        wall = trainer.train_loop(profiled).seconds
        tf.profiler.experimental.stop()
        breakdown = profile_breakdown(profile_dir, profiled, wall)
    return seconds, breakdown, path, measured


def _category(scope: str, op: str) -> str:
    if "MatMul" in op:  # wherever it is: grappler renames some (ArithmeticOptimizer/FoldTransposeIntoMatMul_...)
        return "matmul"
    scope = re.sub(r"[a-z]+optimizer/", "", scope.lower())  # grappler's rewrites keep their op's place
    if "adam" in scope or "optimizer" in scope or "global_norm" in scope or "Apply" in op:  # clipping and Adam
        return "optimizer"
    if "dropout" in scope or "Random" in op:
        return "dropout"
    if op == "Cast":
        return "casts"
    if "layer_norm" in scope:
        return "layer norm"
    if "attention" in scope:
        return "attention elementwise"
    if "feed_forward" in scope:
        return "feed-forward elementwise"
    if "embedding" in scope or "softmax" in scope or "nll" in scope or "sparse" in scope:
        return "embedding and softmax"
    return "other"


def profile_breakdown(logdir: str, steps: int, wall: float) -> dict:
    """Per-step op time by category (ms, summed over TF's concurrent executor threads) and the idle share.

    Reads the XSpace the profiler wrote: every TF op executed on the host's `tf_Compute` threads is one event named
    "scope:OpType". `busy` is the union of those events over time; wall - busy is time no op ran (host).
    `matmul_busy` is the union of the matmul events alone: op times overlap (TF runs independent ops side by side),
    so the categories do not say what the step waits for; wall - matmul_busy is the wall time in which no matmul
    runs, the most that speeding up everything but the matmuls can save.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    sums, intervals, matmuls = collections.Counter(), [], []
    for plane in space.planes:
        names = plane.event_metadata
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = names[event.metadata_id].name
                scope, _, op = name.rpartition(":")
                if not scope or "::" in name:
                    continue  # executor bookkeeping (ExecutorState::Process, ParallelFor), not an op
                sums[_category(scope, op)] += event.duration_ps
                begin = line.timestamp_ns * 1000 + event.offset_ps
                intervals.append((begin, begin + event.duration_ps))
                if "MatMul" in op:
                    matmuls.append(intervals[-1])
    return {"ms": {k: sums[k] / 1e9 / steps for k in CATEGORIES}, "busy_ms": _covered_ps(intervals) / 1e9 / steps,
            "matmul_busy_ms": _covered_ps(matmuls) / 1e9 / steps, "wall_ms": wall * 1e3 / steps}


def _covered_ps(intervals: list) -> int:
    """Length of the union of (begin, end) intervals."""
    covered, end = 0, None
    for begin, finish in sorted(intervals):
        if end is None or begin > end:
            covered += finish - begin
            end = finish
        elif finish > end:
            covered += finish - end
            end = finish
    return covered


def precision_of(path: dict) -> str:
    """"bf16" or "f32": the precision whose matmul peak a path's MFU is taken against."""
    return "bf16" if path["mixed_precision"] else "f32"


def path_label(path: dict) -> str:
    """A short name of a timed path: bf16_xla, f32+fused, ..."""
    return (("bf16" if path["mixed_precision"] else "f32") + ("_xla" if path["jit_compile"] else "")
            + ("+fused" if path["kernels"] == "fused" else ""))


def row_label(mode: str, path: dict) -> str:
    """A table row's name: the path, as "auto=<path>" for the auto mode."""
    return f"auto={path_label(path)}" if mode == "auto" else path_label(path)


def time_in_subprocess(mode, batch, kernels):
    """Times `mode` with `kernels` in a fresh process, so modes do not share thread pools, caches or Keras global
    state."""
    args = [sys.executable, os.path.abspath(__file__), f"--child_mode={mode}", f"--kernels={kernels}",
            f"--batch={batch}",
            f"--tgt_len={FLAGS.tgt_len}", f"--mem_len={FLAGS.mem_len}", f"--n_layer={FLAGS.n_layer}",
            f"--steps={FLAGS.steps}", f"--profile={FLAGS.profile}"]
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"timing {mode} failed:\n{result.stderr[-3000:]}")
    for line in result.stderr.splitlines():  # the autotuner's lines ("auto"): what it timed and where the choice came from
        if line.startswith(AUTOTUNE_LINES) or line.startswith("  ") and ("tokens/s" in line or "cannot run" in line):
            print(line, file=sys.stderr)
    return json.loads(result.stdout.strip().splitlines()[-1])


AUTOTUNE_LINES = ("choosing the training path", "checking the training path", "the cached training path",
                  "training path (auto")


PEER_PEAK = """
import sys, time, torch
n = int(sys.argv[1])
for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16))[:int(sys.argv[2])]:
    a = torch.randn(n, n).to(dtype)
    torch.matmul(a, a)  # warm-up
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        torch.matmul(a, a)
        best = min(best, time.perf_counter() - start)
    print(name, 2 * n ** 3 / best)
"""


def _peer_python(peer: str) -> tuple[str, str]:
    peer = os.path.abspath(peer)  # the peer's scripts run with their code directory as the working directory
    python, code = os.path.join(peer, "venv", "bin", "python"), os.path.join(peer, "code")
    if not os.path.exists(python) or not os.path.exists(os.path.join(code, "train_step.py")):
        raise app.UsageError(f"--peer={peer} is not a directory made by ../shared/peer/setup.sh (no venv/bin/python "
                             "or code/train_step.py); run `../shared/peer/setup.sh GIT_DIR DIR` first")
    return python, code


# CPU flags of a bfloat16 dot-product unit (AMX, AVX-512 BF16). Without one PyTorch emulates bfloat16 matmuls
# (one run took over 10 minutes for its 4096^3 peak), so the peer's bfloat16 is skipped there, and said so.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
PEER_TIMEOUT = 900  # seconds for one of the peer's programs


def peer_bf16_native() -> bool:
    return bool(autotune.cpu_flags() & set(NATIVE_BF16_FLAGS))


def peer_peaks(peer: str, size: int) -> dict:
    """PyTorch's best square-matmul FLOP/s in float32 and, where the CPU has a bfloat16 unit, bfloat16 (the peer's
    virtualenv)."""
    python, code = _peer_python(peer)
    out = subprocess.run([python, "-c", PEER_PEAK, str(size), "2" if peer_bf16_native() else "1"],
                         capture_output=True, text=True, check=True, cwd=code, timeout=PEER_TIMEOUT).stdout
    return {line.split()[0]: float(line.split()[1]) for line in out.strip().splitlines()}


def peer_tokens_per_second(peer: str, batch: int) -> dict:
    """The authors' PyTorch train step at `batch`: {"f32": tokens/s, "bf16": tokens/s}. Its script times fp32,
    then bf16 autocast; without a bfloat16 unit it is stopped after fp32, and any run is bounded in time."""
    python, code = _peer_python(peer)
    pattern = re.compile(r"PyTorch (fp32|bf16): ([\d.]+) s/step")
    found = {}
    process = subprocess.Popen([python, "train_step.py", str(batch)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=code)
    deadline = time.monotonic() + PEER_TIMEOUT
    try:
        for line in process.stdout:
            match = pattern.search(line)
            if match:
                found["f32" if match[1] == "fp32" else "bf16"] = batch * PEER_LENGTH / float(match[2])
            if ("f32" in found and not peer_bf16_native()) or time.monotonic() > deadline:
                break
    finally:
        process.kill()
        stderr = process.stderr.read()
        process.wait()
    if "f32" not in found:
        raise RuntimeError(f"the peer's train_step.py printed no fp32 step:\n{stderr[-3000:]}")
    if "bf16" not in found:
        print(f"peer at batch {batch}: bf16 not timed ("
              + ("no bfloat16 unit on this CPU: PyTorch would emulate it)" if not peer_bf16_native()
                 else f"over {PEER_TIMEOUT} s)"), flush=True)
    return found


def print_breakdown(mode: str, batch: int, breakdown: dict, flops: float, peak: float) -> None:
    """The profile of one mode: the wall time's split into matmul-running and matmul-free time, then op time."""
    total = sum(breakdown["ms"].values())
    wall, busy, matmul = breakdown["wall_ms"], breakdown["busy_ms"], breakdown["matmul_busy_ms"]
    if matmul <= 0:
        raise RuntimeError(f"the profile of {mode} at batch {batch} holds no MatMul op events: TensorFlow's op "
                           "names in the XSpace changed; update profile_breakdown")
    rate = flops / (matmul / 1e3)
    print(f"profile {mode} batch {batch}: {wall:.0f} ms/step wall; a matmul runs during {matmul:.0f} ms of it "
          f"({rate / 1e9:.0f} GFLOP/s then, {rate / peak:.0%} of the peak); no matmul runs for {wall - matmul:.0f} ms "
          f"({(wall - matmul) / wall:.0%}: the other ops and {wall - busy:.0f} ms of host/idle)")
    print(f"  op time {total:.0f} ms/step, summed over executor threads (ops overlap):")
    for name in CATEGORIES:
        ms = breakdown["ms"][name]
        print(f"  {name:26s} {ms:8.1f} ms {ms / total:6.1%}")


def main(argv):
    del argv
    if FLAGS.child_mode:
        batch = int(FLAGS.batch[0])
        with tempfile.TemporaryDirectory() as logdir:
            seconds, breakdown, path, measured = time_training(FLAGS.child_mode, batch, FLAGS.tgt_len, FLAGS.mem_len,
                                                     FLAGS.n_layer, FLAGS.steps, logdir if FLAGS.profile else None,
                                                     FLAGS.kernels[0])
        print(json.dumps({"mode": FLAGS.child_mode, "seconds": seconds, "breakdown": breakdown,
                          "path": path.bindings(), "measured": measured}))
        return
    if FLAGS.peer and (FLAGS.tgt_len != PEER_LENGTH or FLAGS.mem_len != PEER_LENGTH):
        raise app.UsageError(f"--peer times the authors' code at tgt_len = mem_len = {PEER_LENGTH} only; got "
                             f"--tgt_len={FLAGS.tgt_len} --mem_len={FLAGS.mem_len}")
    unknown = sorted(set(FLAGS.kernels) - set(fused.KERNELS))
    if unknown:
        raise app.UsageError(f"--kernels={','.join(FLAGS.kernels)}: {', '.join(unknown)} is not one of "
                             f"{', '.join(fused.KERNELS)}")
    why = fused.unavailable() if "fused" in FLAGS.kernels else None
    if why:
        raise app.UsageError(f"--kernels=fused: the fused CPU kernels cannot run here ({why}); time --kernels=tf")
    # (mode, kernels) pairs, in order: the XLA modes with TensorFlow's ops only.
    unknown = sorted(set(FLAGS.modes) - set(MODES))
    if unknown:
        raise app.UsageError(f"--modes={','.join(FLAGS.modes)}: {', '.join(unknown)} is not one of {', '.join(MODES)}")
    runs = list(dict.fromkeys((mode, "tf" if mode.endswith("xla") or mode == "auto" else kernels)
                              for mode in FLAGS.modes for kernels in FLAGS.kernels))
    batches = [int(b) for b in FLAGS.batch]
    print(f"load average before: {os.getloadavg()}")
    print("timed: " + "; ".join("auto: the path the trainer's 'auto' chooses (txl_tf.training.autotune)" if mode == "auto"
                                else f"{path_label(mode_path(mode, kernels).bindings())} with {fused.describe(kernels)}"
                                for mode, kernels in runs))
    onednn = autotune.choose_onednn()
    print(f"TF_ENABLE_ONEDNN_OPTS={os.environ.get(autotune.ONEDNN_ENV, 'unset')} in the timed children"
          + (" (measured: txl_tf.training.autotune.choose_onednn, as the trainer sets it)" if onednn else ""))
    peaks = {
        "f32": measure_matmul_peak(tf.float32, FLAGS.matmul_size),
        "bf16": measure_matmul_peak(tf.bfloat16, FLAGS.matmul_size),
        "f32_xla": measure_matmul_peak(tf.float32, FLAGS.matmul_size, jit_compile=True),
        "bf16_xla": measure_matmul_peak(tf.bfloat16, FLAGS.matmul_size, jit_compile=True),
    }
    for name, peak in peaks.items():
        print(f"TensorFlow matmul peak {name:9s} {peak / 1e9:7.1f} GFLOP/s ({FLAGS.matmul_size}^3, tf.function)")
    torch_peaks = peer_peaks(FLAGS.peer, FLAGS.matmul_size) if FLAGS.peer else {}
    for name, peak in torch_peaks.items():
        print(f"PyTorch matmul peak    {name:9s} {peak / 1e9:7.1f} GFLOP/s ({FLAGS.matmul_size}^3, the peer's venv)")
    # MFU against TensorFlow's best measured peak of the precision, with or without XLA (XLA's matmuls are the
    # faster ones on some CPUs, e.g. AVX2-only ones, and the slower ones where oneDNN uses AMX), and against the
    # best bfloat16 peak any framework reached on this CPU.
    best = {precision: max(peaks[precision], peaks[f"{precision}_xla"]) for precision in ("f32", "bf16")}
    cpu_bf16 = max([best["bf16"], *torch_peaks.values()])
    print(f"MFU against TensorFlow's best peak of each precision (f32 {best['f32'] / 1e9:.1f}, bf16 "
          f"{best['bf16'] / 1e9:.1f} GFLOP/s) and against the CPU's best bf16 peak ({cpu_bf16 / 1e9:.1f} GFLOP/s)")
    header = (f"{'mode':15s} {'batch':>5s} {'s/step':>8s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'MFU(TF peak)':>13s} "
              f"{'MFU(CPU bf16)':>14s}" + (f" {'peer tokens/s':>14s} {'ratio':>6s}" if FLAGS.peer else ""))
    rows, profiles = [], []
    for batch in batches:
        flops = train_flops_per_step(batch, FLAGS.tgt_len, FLAGS.mem_len, FLAGS.n_layer, **ARCH)
        tokens = batch * FLAGS.tgt_len
        print(f"model: {FLAGS.n_layer} layers, batch {batch}, tgt_len {FLAGS.tgt_len}, mem_len {FLAGS.mem_len}; "
              f"{flops / tokens / 1e6:.0f} MFLOP per trained token", flush=True)
        ours = {}
        for mode, kernels in runs:
            result = time_in_subprocess(mode, batch, kernels)
            ours[mode, kernels] = result
            if result["measured"]:
                print(f"auto at batch {batch} chose {path_label(result['path'])} of (tokens/s, the trainer's "
                      f"measurement): " + "; ".join(f"{k}: {v}" for k, v in result["measured"].items()), flush=True)
            if result["breakdown"]:
                profiles.append((row_label(mode, result["path"]), batch, result["breakdown"], flops,
                                 best[precision_of(result["path"])]))
        peer = peer_tokens_per_second(FLAGS.peer, batch) if FLAGS.peer else {}
        for (mode, _), result in ours.items():
            seconds = result["seconds"]
            rate = flops / seconds
            precision = precision_of(result["path"])
            line = (f"{row_label(mode, result['path']):15s} {batch:5d} {seconds:8.3f} {tokens / seconds:9.1f} "
                    f"{rate / 1e9:8.1f} {rate / best[precision]:12.1%} {rate / cpu_bf16:13.1%}")
            if FLAGS.peer:
                theirs = peer.get(precision, float("nan"))
                line += f" {theirs:14.1f} {tokens / seconds / theirs:5.2f}x"
            rows.append(line)
    print(header)
    print("\n".join(rows))
    if FLAGS.peer:
        print("peer: the authors' PyTorch MemTransformerLM (torch.optim.Adam, clip_grad_norm_), fp32 and bf16 "
              "autocast, compared with our mode of the same precision; ratio = ours / theirs")
    for profile in profiles:
        print_breakdown(*profile)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    cli.run(main, define_flags)
