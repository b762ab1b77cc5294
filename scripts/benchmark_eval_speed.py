"""Reproduces the paper's Table 7 on this machine: per-token evaluation time, vanilla vs Transformer-XL.

    python scripts/benchmark_eval_speed.py                        # 800 .. 3800, float32 and bfloat16
    python scripts/benchmark_eval_speed.py --dtypes=float32 --attn_lens=800,1800
    python scripts/benchmark_eval_speed.py --peer=../txl_peer     # + the authors' PyTorch code, same run

Both models use the enwik8 base architecture (12 layers, d_model 512, 8x64 heads, d_inner 2048, 204 symbols)
with random weights (the time does not depend on them), batch 1, and the evaluation code of
`txl_tf.evaluation.loops` / `txl_tf.model.inference`:
  vanilla (Al-Rfou et al., attn_type="al_rfou", no memory): a window of the attention length, one prediction per
    forward pass (`evaluation.make_window_step`); time per token = time per pass.
  Transformer-XL: segments of 80 tokens with a memory of (attention length - 80) carried between compiled steps;
    time per token = time per segment / 80, in both state forms: the hidden-state memory (keys, values and
    position keys projected again every segment, as in the authors' code) and the keys/values cache (only the
    segment's tokens projected). Same numbers (tests/test_model.py).
A subset of tokens is timed (--vanilla_passes windows, --xl_segments segments) after one warm-up call each; the
fastest call counts. Each time is measured as wall time and as CPU time of this process: the ratios that the
table's "CPU" columns give are the ones other processes on a shared machine disturb least. The load average is
printed before and after.

--peer=DIR runs the authors' PyTorch code (`DIR` made by ../shared/peer/setup.sh from a fetched
kimiyoung/transformer-xl; their code stays out of this repository) on the same lengths right after ours, in a
child process, and prints its figures beside ours. Without --peer no peer figure is printed: figures from another
machine or another hour do not compare.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

from absl import app, flags

# txl_tf.base.cli sets TF_CPP_MIN_LOG_LEVEL before TensorFlow is imported (lazily, in the functions).
from txl_tf.base import cli

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_list("attn_lens", ["800", "1800", "2800", "3800"], "Attention lengths to compare.", flag_values=fv)
    flags.DEFINE_integer("tgt_len", 80, "Transformer-XL segment length (memory = attention length - tgt_len).",
                         flag_values=fv)
    flags.DEFINE_integer("xl_segments", 6, "Transformer-XL segments timed per attention length.", flag_values=fv)
    flags.DEFINE_integer("vanilla_passes", 2, "Vanilla forward passes (= predicted tokens) timed per length.",
                         flag_values=fv)
    flags.DEFINE_list("dtypes", ["float32", "mixed_bfloat16"], "Compute dtypes, each a table: float32, "
                      "mixed_bfloat16.", flag_values=fv)
    flags.DEFINE_bool("jit_compile", False, "XLA (slower for bf16 on CPUs with AMX; faster on GPUs).", flag_values=fv)
    flags.DEFINE_string("arch", "12,512,8,64,2048", "n_layer,d_model,n_head,d_head,d_inner (enwik8 base).",
                        flag_values=fv)
    flags.DEFINE_integer("n_token", 204, "Vocabulary size (enwik8).", flag_values=fv)
    flags.DEFINE_string("peer", None, "A directory made by ../shared/peer/setup.sh: also time the authors' PyTorch "
                        "code (its table7.py) in this run.", flag_values=fv)

PAPER_RATIO = {800: 363, 1800: 773, 2800: 1409, 3800: 1874}
PEER_DTYPE = {"float32": "fp32", "mixed_bfloat16": "bf16"}
PEER_LINE = re.compile(r"A=(\d+): vanilla ([\d.]+) s/token, XL ([\d.]+) ms/token")


def build_models(attn_lens, arch, n_token, dtype):
    """(vanilla al_rfou model with positions for the longest window, Transformer-XL model)."""
    from txl_tf.model.transformer_xl import TransformerXL
    from txl_tf.runs.loading import dtype_policy

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

    Every call waits for its result, so nothing overlaps between calls.
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

    from txl_tf.evaluation import loops as evaluation
    from txl_tf.model.protocol import Protocol

    step = evaluation.make_window_step(model, Protocol(mem_len=0), jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    windows = tf.constant(rng.integers(0, model.n_token, [1, window]), tf.int32)
    targets = tf.constant(rng.integers(0, model.n_token, [1]), tf.int32)
    return _timed(lambda: step(windows, targets), passes)


def time_xl(model, attn_len, tgt_len, segments, use_cache, jit_compile=False):
    """Seconds per token: segments of `tgt_len` with memory `attn_len - tgt_len` carried between steps, in the
    cache form (use_cache) or the hidden-memory form."""
    import numpy as np
    import tensorflow as tf

    from txl_tf.model.inference import Recurrent
    from txl_tf.model.protocol import Protocol

    rng = np.random.default_rng(1)
    tokens = tf.constant(rng.integers(0, model.n_token, [1, tgt_len + 1]), tf.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    recurrent = Recurrent(model, Protocol(mem_len=attn_len - tgt_len), max_len=tgt_len, use_cache=use_cache,
                          jit_compile=jit_compile)
    state = {"value": recurrent.initial_state(1)}

    def one_segment():
        nll, state["value"] = recurrent.score(inputs, targets, state["value"])  # state carried as tensors
        return nll

    return _timed(one_segment, segments) / tgt_len


def run_peer(peer_dir, dtype, attn_lens):
    """{attention length: (vanilla s/token, XL s/token)} of the authors' PyTorch code, run now in a child process."""
    code, python = os.path.join(peer_dir, "code"), os.path.join(peer_dir, "venv", "bin", "python")
    if not (os.path.exists(os.path.join(code, "table7.py")) and os.path.exists(python)):
        raise app.UsageError(f"--peer={peer_dir} is not a directory made by ../shared/peer/setup.sh (no code/table7.py "
                             "or venv/bin/python); run setup.sh GIT_DIR that directory first")
    proc = subprocess.run([python, "table7.py", PEER_DTYPE[dtype], ",".join(map(str, attn_lens))], cwd=code,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the peer's table7.py failed: {proc.stderr.strip().splitlines()[-1:]}")
    print(proc.stdout.strip(), flush=True)
    return {int(m[1]): (float(m[2]), float(m[3]) / 1000) for m in PEER_LINE.finditer(proc.stdout)}


def format_table(rows, peer=None) -> str:
    """Markdown table: rows of (attention length, vanilla, XL memory, XL cache) Timings per token."""
    header = ("| attn len | vanilla s/token | XL memory ms/token | ratio | XL cache ms/token | ratio | "
              "CPU-time ratio (memory, cache) | paper |")
    align = "|---:|---:|---:|---:|---:|---:|---:|---:|"
    if peer is not None:
        header += " authors' PyTorch (same run): XL ms/token, ratio |"
        align += "---:|"
    lines = [header, align]
    for attn_len, vanilla, xl, cached in rows:
        paper = f"{PAPER_RATIO[attn_len]}x" if attn_len in PAPER_RATIO else "-"
        line = (f"| {attn_len} | {vanilla[0]:.4g} | {xl[0] * 1000:.4g} | {vanilla[0] / xl[0]:.0f}x | "
                f"{cached[0] * 1000:.4g} | {vanilla[0] / cached[0]:.0f}x | {vanilla[1] / xl[1]:.0f}x, "
                f"**{vanilla[1] / cached[1]:.0f}x** | {paper} |")
        if peer is not None:
            theirs = peer.get(attn_len)
            line += f" {theirs[1] * 1000:.4g}, {theirs[0] / theirs[1]:.0f}x |" if theirs else " - |"
        lines.append(line)
    return "\n".join(lines)


def _machine() -> str:
    """The CPU and its widest matrix instructions (txl_tf.study.runs.machine, which the study reports use too)."""
    from txl_tf.study.runs import machine

    info = machine()
    return f"{info['cpu']} ({info['isa']})"


def main(argv):
    del argv
    import tensorflow as tf

    attn_lens = [int(a) for a in FLAGS.attn_lens]
    arch = [int(x) for x in FLAGS.arch.split(",")]
    if min(attn_lens) <= FLAGS.tgt_len:
        raise app.UsageError(f"attention lengths must exceed --tgt_len={FLAGS.tgt_len}")
    for dtype in FLAGS.dtypes:
        if dtype not in PEER_DTYPE:
            raise app.UsageError(f"--dtypes: {dtype!r} is not one of {', '.join(PEER_DTYPE)}")
    load = os.getloadavg()
    print(f"TF {tf.__version__}, {_machine()}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; jit_compile {FLAGS.jit_compile}, arch {arch}", flush=True)
    tables = []
    for dtype in FLAGS.dtypes:
        vanilla, xl = build_models(attn_lens, arch, FLAGS.n_token, dtype)
        rows = []
        for attn_len in attn_lens:
            memory_s = time_xl(xl, attn_len, FLAGS.tgt_len, FLAGS.xl_segments, False, FLAGS.jit_compile)
            cached_s = time_xl(xl, attn_len, FLAGS.tgt_len, FLAGS.xl_segments, True, FLAGS.jit_compile)
            vanilla_s = time_vanilla(vanilla, attn_len, FLAGS.vanilla_passes, FLAGS.jit_compile)
            rows.append((attn_len, vanilla_s, memory_s, cached_s))
            print(f"{dtype} attn {attn_len}: vanilla {vanilla_s[0]:.3f} s/token; Transformer-XL memory "
                  f"{memory_s[0] * 1000:.3f} ms/token ({vanilla_s[0] / memory_s[0]:.0f}x), cache "
                  f"{cached_s[0] * 1000:.3f} ms/token ({vanilla_s[0] / cached_s[0]:.0f}x; by CPU time "
                  f"{vanilla_s[1] / cached_s[1]:.0f}x)", flush=True)
        peer = run_peer(FLAGS.peer, dtype, attn_lens) if FLAGS.peer else None
        tables.append((dtype, rows, peer))
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for dtype, rows, peer in tables:
        print(f"\n{dtype}, batch 1, segments of {FLAGS.tgt_len}:\n")
        print(format_table(rows, peer))


if __name__ == "__main__":
    cli.run(main, define_flags)
