"""Average attention over relative distance, per head and layer (Dai et al., 2019, appendix D, figure 5).

For every attention head of every layer, the attention distributions of all query tokens of an evaluation set
are averaged after re-indexing keys by their distance to the query (0 = the token itself, 1 = the previous
token, ...). Each row of the map is a head (layer-major, as in figure 5: 160 rows for 16 layers x 10 heads),
each column a relative distance, and a row sums to the attention mass inside the plotted window (exactly 1
when the window covers every key).

Shapes: n_layer layers, B batch, N heads, L queries, M memory, K = M + L keys, D distances plotted.

    python -m txl_tf.analysis.attention_maps --model_dir=runs/sample --split=valid --max_segments=20 \
        --output=docs/attention_map.png --logdir=runs/sample/analysis
"""

from __future__ import annotations

import io
import os

# First: txl_tf.base.cli quiets TensorFlow's start-up (it must come before TensorFlow's import).
from txl_tf.base import cli

# isort: split
import numpy as np
import tensorflow as tf
from absl import flags

from txl_tf.base import errors, paths
from txl_tf.model.protocol import Protocol
from txl_tf.runs import loading


def distance_sums(probs: tf.Tensor, max_distance: int) -> tf.Tensor:
    """Sums attention probabilities by query-key distance over batch and queries.

    Args:
      probs: [n_layer, B, N, L, K] attention probabilities; query i sits at key position K - L + i.
      max_distance: D, the number of distances kept (0 .. D - 1).

    Returns:
      [n_layer, N, D] float32: sum over batch and queries of the probability at each distance (zero where a
      query has no key that far back).
    """
    probs = tf.convert_to_tensor(probs, tf.float32)
    qlen, klen = tf.shape(probs)[3], tf.shape(probs)[4]
    query_pos = tf.range(qlen)[:, None] + (klen - qlen)  # [L, 1]
    key_index = query_pos - tf.range(max_distance)[None, :]  # [L, D] key j = query position - distance
    valid = tf.cast(key_index >= 0, tf.float32)  # [L, D]
    by_query = tf.transpose(probs, [3, 0, 1, 2, 4])  # [L, n_layer, B, N, K]
    gathered = tf.gather(by_query, tf.maximum(key_index, 0), axis=4, batch_dims=1)  # [L, n_layer, B, N, D]
    gathered *= valid[:, None, None, None, :]
    return tf.reduce_sum(gathered, axis=[0, 2])  # [n_layer, N, D]


class AttentionMapAccumulator:
    """Accumulates `distance_sums` over segments; `result()` is the average attention per distance.

    Args:
      max_distance: D, the number of relative distances kept.
    """

    def __init__(self, max_distance: int):
        if max_distance < 1:
            raise ValueError(f"max_distance must be positive; got {max_distance}")
        self.max_distance = int(max_distance)
        self.sums = None  # [n_layer, N, D] float64
        self.num_queries = 0

    def add_sums(self, sums, num_queries: int) -> None:
        """Adds precomputed [n_layer, N, D] sums over `num_queries` query tokens (e.g. from a tf.function)."""
        sums = np.asarray(sums, np.float64)
        self.sums = sums if self.sums is None else self.sums + sums
        self.num_queries += int(num_queries)

    def update(self, probs) -> None:
        """Adds a batch of attention probabilities [n_layer, B, N, L, K]."""
        shape = tf.shape(probs)
        self.add_sums(distance_sums(probs, self.max_distance), int(shape[1]) * int(shape[3]))

    def result(self) -> np.ndarray:
        """[n_layer, N, D] mean attention probability at each distance, averaged over all query tokens."""
        if not self.num_queries:
            raise ValueError("no attention probabilities were accumulated")
        return self.sums / self.num_queries


def plot_attention_map(attention: np.ndarray, path: str | None = None, *, title: str | None = None,
                       scale: str = "linear") -> bytes:
    """Renders a [n_layer, N, D] map (rows = heads, layer-major; columns = distance) as PNG bytes.

    Darker means more attention, as in the paper's figure 5. `scale="log"` helps when nearby tokens dominate.
    Writes the PNG to `path` when given.
    """
    matplotlib = errors.require("matplotlib", "the attention map", "analysis")
    matplotlib.use("Agg")
    from matplotlib import colors
    from matplotlib import pyplot as plt

    n_layer, n_head, max_distance = attention.shape
    rows = attention.reshape(n_layer * n_head, max_distance)
    if scale == "log":
        norm = colors.LogNorm(vmin=max(float(rows[rows > 0].min(initial=1.0)), 1e-6), vmax=float(rows.max()))
    elif scale == "linear":
        norm = colors.Normalize(vmin=0.0, vmax=float(rows.max()))
    else:
        raise ValueError(f"scale must be 'linear' or 'log'; got {scale!r}")
    height = min(12.0, 1.5 + 0.12 * rows.shape[0])
    fig, ax = plt.subplots(figsize=(10, height), dpi=100)
    image = ax.imshow(np.maximum(rows, 1e-12) if scale == "log" else rows, aspect="auto", cmap="Greys",
                      norm=norm, interpolation="nearest")
    ax.set_xlabel("relative distance (tokens back)")
    ax.set_ylabel("head (layer-major)")
    if n_layer > 1:
        ticks = np.arange(n_layer) * n_head + (n_head - 1) / 2
        ax.set_yticks(ticks, [f"L{i + 1}" for i in range(n_layer)])
        for boundary in np.arange(1, n_layer) * n_head - 0.5:
            ax.axhline(boundary, color="tab:red", linewidth=0.4)
    ax.set_title(title or f"average attention by relative distance ({n_layer} layers x {n_head} heads)")
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02, label="mean attention probability")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    png = buffer.getvalue()
    if path:
        with paths.atomic_file(paths.output_file(path, "the attention map's path", "attention_map.png"), "wb") as f:
            f.write(png)
    return png


def write_summary(png: bytes, logdir: str, step: int = 0, name: str = "attention_map") -> None:
    """Writes the rendered map to TensorBoard (`tf.summary.image`) under `logdir`."""
    image = tf.image.decode_png(png, channels=4)[None]  # [1, H, W, 4]
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default():
        tf.summary.image(name, image, step=step)
    writer.flush()
    writer.close()


def make_attention_step(recurrent, max_distance: int):
    """tf.function (tokens [B, L], state) -> (sums [n_layer, N, D], new state): probabilities stay in the graph.

    recurrent: a `txl_tf.model.inference.Recurrent` (model, protocol, state form).
    """

    @tf.function
    def step(tokens, state):
        _, new_state, probs = recurrent.forward(tokens, state, return_probs=True)  # probs [n_layer, B, N, L, K]
        return distance_sums(probs, max_distance), new_state

    return step


def average_attention(model, tokens, *, tgt_len: int, protocol: Protocol, batch_size: int = 10,
                      max_segments: int = 20, warmup_segments: int | None = None, max_distance: int | None = None,
                      progress: bool = False) -> np.ndarray:
    """Average attention [n_layer, N, D] by relative distance over `max_segments` segments of a split.

    The split (1-D tokens) is cut into `batch_size` streams as for evaluation, and fed through the model with
    `protocol`'s lengths. The first `warmup_segments` (default: enough to fill the memory) only fill the memory,
    so zero-memory keys do not enter the average. `max_distance` defaults to every reachable distance:
    mem_len + 1 with same_length, else mem_len + tgt_len.
    """
    from txl_tf.evaluation import loops as evaluation
    from txl_tf.model.inference import Recurrent, run_segments

    mem_len = protocol.mem_len
    max_distance = max_distance or (mem_len + 1 if protocol.same_length else mem_len + tgt_len)
    if warmup_segments is None:
        warmup_segments = -(-mem_len // tgt_len)
    streams, _ = evaluation.corpus_streams(tokens, batch_size)
    needed = (warmup_segments + max_segments) * tgt_len
    if streams.shape[1] - 1 < needed:
        raise ValueError(f"the split gives {streams.shape[1] - 1} tokens per stream; {warmup_segments} warm-up + "
                         f"{max_segments} segments of {tgt_len} need {needed}: lower max_segments or batch_size")
    acc = AttentionMapAccumulator(max_distance)
    recurrent = Recurrent(model, protocol, max_len=tgt_len)
    bar = evaluation._Progress(warmup_segments + max_segments, progress)
    done = [0]

    def add(sums):
        if done[0] >= warmup_segments:
            acc.add_sums(sums, batch_size * tgt_len)
        done[0] += 1
        bar.update(1)

    run_segments(make_attention_step(recurrent, max_distance), recurrent.initial_state(batch_size),
                 streams[:, :needed], tgt_len, on_output=add)
    return acc.result()


def define_flags(flag_values) -> None:
    fv = flag_values
    cli.define_model_flags(fv)
    flags.DEFINE_string("split", "valid", "Split to average over.", flag_values=fv)
    flags.DEFINE_integer("max_segments", 20, "Segments averaged (after the memory is filled).", flag_values=fv)
    flags.DEFINE_integer("max_distance", 0, "Distances plotted (0: every reachable one, mem_len + 1 with "
                         "same_length, else mem_len + tgt_len).", flag_values=fv)
    flags.DEFINE_enum("scale", "log", ["linear", "log"], "Colour scale (log shows far-reaching heads).",
                      flag_values=fv)
    flags.DEFINE_string("output", "attention_map.png", "PNG path (the array is saved beside it as .npy).",
                        flag_values=fv)
    flags.DEFINE_string("logdir", None, "TensorBoard directory (default: model_dir/analysis).", flag_values=fv)


def main(argv):
    from txl_tf.data.pipeline import read_split

    cli.no_arguments(argv)
    errors.require("matplotlib", "the attention map", "analysis")  # before the model is loaded and run
    cfg = flags.FLAGS
    paths.output_file(cfg.output, "--output", "attention_map.png")
    if cfg.logdir is not None:
        paths.output_dir(cfg.logdir, "--logdir")
    model, configs, prefix = loading.load_model_from_flags(cfg)
    protocol = configs.eval
    tokens = read_split(configs.data.data_dir, cfg.split)
    attention = average_attention(
        model, tokens, tgt_len=protocol.tgt_len, protocol=protocol.attention_protocol(),
        batch_size=protocol.batch_size, max_segments=cfg.max_segments, max_distance=cfg.max_distance or None,
        progress=True)
    title = (f"{os.path.basename(os.path.normpath(cfg.model_dir or cfg.checkpoint))} [{cfg.split}]: average "
             f"attention by distance (mem_len {protocol.mem_len}, {cfg.max_segments} x {protocol.batch_size} x "
             f"{protocol.tgt_len} tokens)")
    png = plot_attention_map(attention, cfg.output, title=title, scale=cfg.scale)
    with paths.atomic_file(os.path.splitext(cfg.output)[0] + ".npy", "wb") as f:
        np.save(f, attention.astype(np.float32))
    logdir = cfg.logdir or os.path.join(cfg.model_dir or os.path.dirname(prefix), "analysis")
    write_summary(png, logdir)
    near = attention[..., :10].sum(-1)  # [n_layer, N] mass on the 10 nearest tokens
    print(f"{prefix}: attention map [{attention.shape[0]} layers x {attention.shape[1]} heads x "
          f"{attention.shape[2]} distances] -> {cfg.output} (+ .npy), TensorBoard image in {logdir}")
    for layer in range(attention.shape[0]):
        print(f"  layer {layer + 1}: mass on the 10 nearest tokens per head: "
              + " ".join(f"{m:.2f}" for m in near[layer]))


if __name__ == "__main__":
    cli.run(main, define_flags)
