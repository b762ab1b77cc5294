"""Training throughput of TransformerXL on this machine (a benchmark, not a test).

    python scripts/benchmark_model.py [--batch=2 --tgt_len=512 --mem_len=512 --steps=5 --modes=f32,bf16,...]

Times one training step (forward, per-token NLL, backward, Adam update) of the enwik8 base architecture
(12 layers, d_model 512, 8x64 heads, d_inner 2048, vocab 204) with memory carried between steps, in each mode
(float32 / mixed_bfloat16, with / without XLA), and reports tokens/s and model FLOPs utilisation (MFU) against
the best square-matmul peak it measures itself in `tf.function` for the same precision (with or without XLA).

FLOP count: `txl_tf.flops` (matmul FLOPs as executed, attention and the memory's key/value projections included,
training = 3 x forward), the same count the trainer's start-up MFU line uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from txl_tf import TransformerXL  # noqa: E402
from txl_tf.flops import measure_matmul_peak, model_flops_per_token  # noqa: E402

flags.DEFINE_integer("batch", 2, "batch size")
flags.DEFINE_integer("tgt_len", 512, "segment length")
flags.DEFINE_integer("mem_len", 512, "memory length")
flags.DEFINE_integer("n_layer", 12, "layers (enwik8 base: 12)")
flags.DEFINE_integer("steps", 5, "timed steps per mode (after 2 warm-up steps)")
flags.DEFINE_list("modes", ["f32", "bf16", "f32_xla", "bf16_xla"], "modes to time")
flags.DEFINE_integer("matmul_size", 4096, "square matmul size for the peak measurement")
flags.DEFINE_string("child_mode", None, "internal: time only this mode and print the result as JSON")
FLAGS = flags.FLAGS

ARCH = dict(n_token=204, d_model=512, n_head=8, d_head=64, d_inner=2048, dropout=0.1, dropatt=0.0)


def train_flops_per_step(batch, qlen, mlen, n_layer, n_token, d_model, n_head, d_head, d_inner, **_):
    """Matmul FLOPs of one training step: txl_tf.flops, the one place the formula lives (see its docstring)."""
    per_token = model_flops_per_token(batch_size=batch, tgt_len=qlen, mem_len=mlen, n_layer=n_layer,
                                      n_token=n_token, d_model=d_model, n_head=n_head, d_head=d_head,
                                      d_inner=d_inner)
    return per_token * batch * qlen


def matmul_peak(dtype, size, jit_compile=False, repeats=10):
    """Best FLOP/s of a square matmul in a tf.function (txl_tf.flops.measure_matmul_peak)."""
    return measure_matmul_peak(dtype, size=size, repeats=repeats, jit_compile=jit_compile)


def time_training(mode, batch, qlen, mlen, n_layer, steps):
    """Seconds per training step (median of `steps`) in `mode`."""
    keras.config.set_dtype_policy("mixed_bfloat16" if mode.startswith("bf16") else "float32")
    try:
        keras.utils.set_random_seed(0)
        model = TransformerXL(n_layer=n_layer, mem_len=mlen, **ARCH)
        optimizer = keras.optimizers.Adam(2.5e-4)
        optimizer.build(model.trainable_variables)
    finally:
        keras.config.set_dtype_policy("float32")

    @tf.function(jit_compile=mode.endswith("xla"))
    def train_step(tokens, targets, mems):
        with tf.GradientTape() as tape:
            hidden, new_mems = model(tokens, mems, training=True)
            loss = tf.reduce_mean(model.nll(hidden, targets))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss, new_mems

    data = tf.random.uniform([batch, qlen + 1], 0, ARCH["n_token"], tf.int32, seed=1)
    mems = model.initial_mems(batch)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        loss, mems = train_step(data[:, :-1], data[:, 1:], mems)
        loss.numpy()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def time_in_subprocess(mode):
    """Times `mode` in a fresh process, so modes do not share thread pools, caches or Keras global state."""
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--child_mode={mode}", f"--batch={FLAGS.batch}",
         f"--tgt_len={FLAGS.tgt_len}", f"--mem_len={FLAGS.mem_len}", f"--n_layer={FLAGS.n_layer}",
         f"--steps={FLAGS.steps}"],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"timing {mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds"]


def main(argv):
    del argv
    if FLAGS.child_mode:
        seconds = time_training(FLAGS.child_mode, FLAGS.batch, FLAGS.tgt_len, FLAGS.mem_len, FLAGS.n_layer,
                                FLAGS.steps)
        print(json.dumps({"mode": FLAGS.child_mode, "seconds": seconds}))
        return
    print(f"load average before: {os.getloadavg()}")
    peaks = {
        "f32": matmul_peak(tf.float32, FLAGS.matmul_size),
        "bf16": matmul_peak(tf.bfloat16, FLAGS.matmul_size),
        "f32_xla": matmul_peak(tf.float32, FLAGS.matmul_size, jit_compile=True),
        "bf16_xla": matmul_peak(tf.bfloat16, FLAGS.matmul_size, jit_compile=True),
    }
    for name, peak in peaks.items():
        print(f"matmul peak {name:9s} {peak / 1e9:7.1f} GFLOP/s ({FLAGS.matmul_size}^3, tf.function)")
    flops = train_flops_per_step(FLAGS.batch, FLAGS.tgt_len, FLAGS.mem_len, FLAGS.n_layer, **ARCH)
    tokens = FLAGS.batch * FLAGS.tgt_len
    print(f"model: {FLAGS.n_layer} layers, batch {FLAGS.batch}, tgt_len {FLAGS.tgt_len}, mem_len {FLAGS.mem_len}; "
          f"{flops / tokens / 1e6:.0f} MFLOP per trained token")
    # MFU against the best measured peak of the precision, with or without XLA (XLA's matmuls are the faster
    # ones on some CPUs, e.g. AVX2-only ones, and the slower ones where oneDNN uses AMX).
    best = {precision: max(peaks[precision], peaks[f"{precision}_xla"]) for precision in ("f32", "bf16")}
    print(f"MFU against the best peak of each precision: f32 {best['f32'] / 1e9:.1f}, "
          f"bf16 {best['bf16'] / 1e9:.1f} GFLOP/s")
    print(f"{'mode':9s} {'s/step':>8s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'MFU(prec. peak)':>16s} {'MFU(bf16 peak)':>15s}")
    for mode in FLAGS.modes:
        seconds = time_in_subprocess(mode)
        rate = flops / seconds
        precision_peak = best["bf16" if mode.startswith("bf16") else "f32"]
        print(f"{mode:9s} {seconds:8.3f} {tokens / seconds:9.1f} {rate / 1e9:8.1f} {rate / precision_peak:15.1%} "
              f"{rate / best['bf16']:14.1%}", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    app.run(main)
