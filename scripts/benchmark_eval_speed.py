"""Reproduces the paper's Table 7 on this machine: per-token evaluation time, vanilla vs Transformer-XL.

    python scripts/benchmark_eval_speed.py                       # 800, 1800, 2800, 3800; float32
    python scripts/benchmark_eval_speed.py --attn_lens=800,1800 --dtype=mixed_bfloat16

Both models use the enwik8 base architecture (12 layers, d_model 512, 8x64 heads, d_inner 2048, 204 symbols)
with random weights (the time does not depend on them), batch 1, and the evaluation code of
`txl_tf.evaluation`:
  vanilla (Al-Rfou et al., attn_type="al_rfou", no memory): a window of the attention length, one prediction per
    forward pass (`make_window_step`); time per token = time per pass.
  Transformer-XL: segments of 80 tokens with memory of (attention length - 80) carried between compiled steps,
    time per token = time per segment / 80, measured twice: with the model's call (`make_score_step`: keys,
    values and position keys recomputed every segment, as in the authors' code) and with `txl_tf.kv_cache`
    (the memory's keys/values carried and the position keys computed once; same numbers).
A subset of tokens is timed (--vanilla_passes windows, --xl_segments segments) after one warm-up call each;
the fastest call counts (the machine may be shared: the load average is printed before and after).
The paper's ratios (one GPU) and the authors' PyTorch code on the 2-core AMX machine (docs/performance.md) are printed beside.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("attn_lens", ["800", "1800", "2800", "3800"], "Attention lengths to compare.")
flags.DEFINE_integer("tgt_len", 80, "Transformer-XL segment length (memory = attention length - tgt_len).")
flags.DEFINE_integer("xl_segments", 6, "Transformer-XL segments timed per attention length.")
flags.DEFINE_integer("vanilla_passes", 2, "Vanilla forward passes (= predicted tokens) timed per length.")
flags.DEFINE_enum("dtype", "float32", ["float32", "mixed_bfloat16"], "Compute dtype of both models.")
flags.DEFINE_bool("jit_compile", False, "XLA (slower for bf16 on CPUs with AMX; faster on GPUs).")
flags.DEFINE_string("arch", "12,512,8,64,2048", "n_layer,d_model,n_head,d_head,d_inner (enwik8 base).")
flags.DEFINE_integer("n_token", 204, "Vocabulary size (enwik8).")

PAPER_RATIO = {800: 363, 1800: 773, 2800: 1409, 3800: 1874}
# The authors' PyTorch code as measured on the 2-core AMX machine (docs/performance.md): (vanilla s/token, XL ms/token).
AUTHORS_ON_THIS_CPU = {800: (1.235, 3.31), 1800: (4.61, 7.53)}


def build_models(attn_lens, arch, n_token, dtype):
    """(vanilla al_rfou model with positions for the longest window, Transformer-XL model)."""
    from txl_tf.model import TransformerXL
    from txl_tf.restore import dtype_policy

    n_layer, d_model, n_head, d_head, d_inner = arch
    common = dict(n_token=n_token, n_layer=n_layer, d_model=d_model, n_head=n_head, d_head=d_head,
                  d_inner=d_inner, dropout=0.0, dropatt=0.0)
    with dtype_policy(dtype):  # every sublayer in the compute dtype
        vanilla = TransformerXL(**common, mem_len=0, attn_type="al_rfou", max_position=max(attn_lens))
        xl = TransformerXL(**common, mem_len=max(attn_lens), attn_type="xl")
    return vanilla, xl


class Timing(tuple):
    """(wall seconds, CPU seconds of this process) of the fastest call; divides by a token count."""

    def __new__(cls, wall, cpu):
        return super().__new__(cls, (wall, cpu))

    def __truediv__(self, count):
        return Timing(self[0] / count, self[1] / count)


def _timed(fn, repeats):
    """Wall and CPU time of the fastest of `repeats` calls of `fn` (returns a tensor), after a warm-up call.

    The fastest call is the best estimate of the uncontended cost on a shared machine; every call waits for
    its result, so nothing overlaps between calls. CPU time (all of this process's threads) is reported too:
    other processes inflate wall time much more than it.
    """
    fn().numpy()
    walls, cpus = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn().numpy()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    return Timing(min(walls), min(cpus))


def time_vanilla(model, window, passes, jit_compile=False):
    """Seconds per predicted token: one forward pass of a `window`-token context per prediction."""
    import numpy as np
    import tensorflow as tf

    from txl_tf import evaluation

    step = evaluation.make_window_step(model, jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    windows = tf.constant(rng.integers(0, model.n_token, [1, window]), tf.int32)
    targets = tf.constant(rng.integers(0, model.n_token, [1]), tf.int32)
    with evaluation.eval_protocol(model, mem_len=0, clamp_len=-1, same_length=False):
        return _timed(lambda: step(windows, targets), passes)


def time_xl(model, attn_len, tgt_len, segments, jit_compile=False, cached=False):
    """Seconds per token: segments of `tgt_len` with memory `attn_len - tgt_len` carried between steps.

    cached=False: the model's call (hidden-state memory; keys, values and position keys recomputed every
    segment, as the authors' code does). cached=True: `txl_tf.kv_cache` (memory keys/values carried,
    position keys computed once).
    """
    import numpy as np
    import tensorflow as tf

    from txl_tf import evaluation
    from txl_tf.kv_cache import CachedScorer

    rng = np.random.default_rng(1)
    tokens = tf.constant(rng.integers(0, model.n_token, [1, tgt_len + 1]), tf.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with evaluation.eval_protocol(model, mem_len=attn_len - tgt_len, clamp_len=-1, same_length=False):
        if cached:
            step = CachedScorer(model, jit_compile=jit_compile)
            state = {"memory": step.initial_state(1)}
        else:
            step = evaluation.make_score_step(model, jit_compile=jit_compile)
            state = {"memory": model.initial_mems(1)}

        def one_segment():
            nll, state["memory"] = step(inputs, targets, state["memory"])  # memory carried as tensors
            return nll

        return _timed(one_segment, segments) / tgt_len


def format_table(rows) -> str:
    """Markdown table: rows of (attention length, vanilla, XL, cached XL) Timings per token."""
    lines = ["| attn len | vanilla s/token | XL ms/token | ratio | XL cached K/V ms/token | ratio | "
             "ratios by CPU time (XL, cached) | paper | authors' PyTorch here |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for attn_len, vanilla, xl, cached in rows:
        authors = AUTHORS_ON_THIS_CPU.get(attn_len)
        authors_ratio = f"{authors[0] / (authors[1] / 1000):.0f}x" if authors else "-"
        paper = f"{PAPER_RATIO[attn_len]}x" if attn_len in PAPER_RATIO else "-"
        lines.append(f"| {attn_len} | {vanilla[0]:.4g} | {xl[0] * 1000:.4g} | {vanilla[0] / xl[0]:.0f}x | "
                     f"{cached[0] * 1000:.4g} | {vanilla[0] / cached[0]:.0f}x | {vanilla[1] / xl[1]:.0f}x, "
                     f"{vanilla[1] / cached[1]:.0f}x | {paper} | {authors_ratio} |")
    return "\n".join(lines)


def main(argv):
    del argv
    import tensorflow as tf

    attn_lens = [int(a) for a in FLAGS.attn_lens]
    arch = [int(x) for x in FLAGS.arch.split(",")]
    if min(attn_lens) <= FLAGS.tgt_len:
        raise app.UsageError(f"attention lengths must exceed --tgt_len={FLAGS.tgt_len}")
    load = os.getloadavg()
    print(f"TF {tf.__version__}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"dtype {FLAGS.dtype}, jit_compile {FLAGS.jit_compile}, arch {arch}", flush=True)
    vanilla, xl = build_models(attn_lens, arch, FLAGS.n_token, FLAGS.dtype)
    rows = []
    for attn_len in attn_lens:
        xl_s = time_xl(xl, attn_len, FLAGS.tgt_len, FLAGS.xl_segments, FLAGS.jit_compile)
        cached_s = time_xl(xl, attn_len, FLAGS.tgt_len, FLAGS.xl_segments, FLAGS.jit_compile, cached=True)
        vanilla_s = time_vanilla(vanilla, attn_len, FLAGS.vanilla_passes, FLAGS.jit_compile)
        rows.append((attn_len, vanilla_s, xl_s, cached_s))
        print(f"attn {attn_len}: vanilla {vanilla_s[0]:.3f} s/token; Transformer-XL {xl_s[0] * 1000:.3f} ms/token "
              f"({vanilla_s[0] / xl_s[0]:.0f}x), with cached K/V {cached_s[0] * 1000:.3f} ms/token "
              f"({vanilla_s[0] / cached_s[0]:.0f}x)", flush=True)
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (the machine is shared)")
    print(format_table(rows))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
    app.run(main)
