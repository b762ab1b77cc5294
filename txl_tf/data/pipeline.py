"""Input pipeline: a prepared split -> `batch_size` contiguous streams -> [B, L] segments that keep memory valid.

The split (N tokens) is cut into B streams of S = N // B consecutive tokens (the last N mod B tokens are unused,
as in the authors' code). Stream b is row b of every batch. Step s of an epoch gives every stream its next
`tgt_len` tokens: inputs = stream[s*L : s*L+L], targets = stream[s*L+1 : s*L+L+1], so row b of step s+1
continues row b of step s, and the memory a model carries for row b matches its input.

The last segment of an epoch may be shorter than L (S - 1 is rarely a multiple of L). `drop_remainder=True`
(training default) drops it, so every batch is [B, L]; `drop_remainder=False` (evaluation) yields it too, so every
token of the streams is scored once; evaluation then weights each segment's mean loss by its length.

With `repeat=True` global step t is step t mod steps_per_epoch of epoch t // steps_per_epoch. Optionally
(`rotate_seed`) each epoch reads the split cyclically rotated by a pseudo-random offset that depends only on
(seed, epoch), so segment boundaries change between epochs. Either way the batch of step t is a pure function
of t: resuming at `start_step` gives exactly the batches an uninterrupted run would have seen.

Distribution: replica r of R owns streams [r*B/R, (r+1)*B/R) for the whole run (no automatic sharding, which
would break memory continuity). `distribute_datasets_from_function` gives each worker one pipeline and deals its
elements to the worker's local replicas in turn, so the per-worker dataset yields, for every step, one batch per
local replica in replica order.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np

from txl_tf.data import records
from txl_tf.data.vocab import Vocab

_M31 = (1 << 31) - 1  # modulus of the rotation hash (a Park-Miller generator)
_INT64_MAX = (1 << 63) - 1


# ---- prepared data --------------------------------------------------------------------------------------
def load_metadata(data_dir: str) -> dict:
    """The validated metadata.json of a prepared data_dir (clear error when missing or incompatible)."""
    return records.read_metadata(data_dir)


def load_vocab(data_dir: str) -> Vocab:
    """The vocabulary of a prepared data_dir, checked against its metadata."""
    meta = load_metadata(data_dir)
    path = os.path.join(data_dir, meta.get("vocab_file", "vocab.json"))
    vocab = Vocab.load(path)
    if len(vocab) != meta["vocab_size"] or vocab.level != meta["level"]:
        raise ValueError(f"{path} ({vocab.level}, {len(vocab)} symbols) does not match metadata "
                         f"({meta['level']}, {meta['vocab_size']}); {records.REPREPARE}")
    return vocab


def read_split(data_dir: str, split: str) -> np.ndarray:
    """A whole split as int32 [N], read through tf.data from its TFRecords and validated."""
    return records.read_split_records(data_dir, load_metadata(data_dir), split)


def check_vocab_size(data_dir: str, n_token: int) -> int:
    """Raises unless the data's vocabulary size equals the model's `n_token`; returns the size."""
    meta = load_metadata(data_dir)
    if meta["vocab_size"] != n_token:
        raise ValueError(f"the model's n_token={n_token} does not match the vocabulary of {data_dir} "
                         f"({meta['vocab_size']} symbols, dataset {meta['dataset']!r}); set n_token to "
                         f"{meta['vocab_size']} (or leave it unset) or use data prepared for this model")
    return n_token


# ---- stream layout (shared by the NumPy core and the tf.data pipeline) ----------------------------------
@dataclasses.dataclass(frozen=True)
class StreamLayout:
    """How N tokens become `batch_size` streams and per-step segments of `tgt_len`."""

    n_tokens: int
    batch_size: int
    tgt_len: int
    drop_remainder: bool = True

    def __post_init__(self):
        if self.batch_size < 1 or self.tgt_len < 1:
            raise ValueError(f"batch_size ({self.batch_size}) and tgt_len ({self.tgt_len}) must be >= 1")
        need = self.batch_size * (self.tgt_len + 1) if self.drop_remainder else 2 * self.batch_size
        if self.n_tokens < need:
            raise ValueError(
                f"a split of {self.n_tokens} tokens is too short for batch_size={self.batch_size} streams "
                f"with tgt_len={self.tgt_len} (needs at least {need} tokens for one segment per stream); "
                "lower batch_size or tgt_len, or use a longer split")

    @property
    def stream_len(self) -> int:
        return self.n_tokens // self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.n_tokens, self.batch_size, self.tgt_len,
                               drop_remainder=self.drop_remainder)


def steps_per_epoch(n_tokens: int, batch_size: int, tgt_len: int, *, drop_remainder: bool = True) -> int:
    """Segments per epoch: full ones only, or (drop_remainder=False) also the final shorter one."""
    predictable = n_tokens // batch_size - 1  # positions of a stream that have a next token
    if predictable <= 0:
        return 0
    return predictable // tgt_len if drop_remainder else -(-predictable // tgt_len)


def rotation_offset(seed: int, epoch: int, n_tokens: int) -> int:
    """The rotation of `epoch` (deterministic in seed and epoch); the tf.data pipeline computes the same."""
    x = (seed * 1_000_003 + epoch * 7919 + 12345) % _M31
    for _ in range(3):
        x = (x * 48271) % _M31
    return x % n_tokens


def _segment_positions(layout: StreamLayout, step: int, rows: np.ndarray, rotate_seed: Optional[int]):
    spe = layout.steps_per_epoch
    epoch, s = divmod(step, spe)
    length = min(layout.tgt_len, layout.stream_len - 1 - s * layout.tgt_len)
    offset = rotation_offset(rotate_seed, epoch, layout.n_tokens) if rotate_seed is not None else 0
    start = rows.astype(np.int64) * layout.stream_len + s * layout.tgt_len + offset  # [B]
    return (start[:, None] + np.arange(length + 1)[None, :]) % layout.n_tokens  # [B, l+1]


def batch_for_step(
    tokens: np.ndarray,
    batch_size: int,
    tgt_len: int,
    step: int,
    *,
    drop_remainder: bool = True,
    rows: Optional[Sequence[int]] = None,
    rotate_seed: Optional[int] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The pure-function core: global step -> (inputs [B', l], targets [B', l]) int32 for streams `rows`.

    `l` is tgt_len except for the final segment of an epoch with drop_remainder=False. Steps past the first
    epoch wrap around (repeat).
    """
    layout = StreamLayout(len(tokens), batch_size, tgt_len, drop_remainder)
    rows = np.arange(batch_size) if rows is None else np.asarray(rows)
    window = np.asarray(tokens)[_segment_positions(layout, step, rows, rotate_seed)].astype(np.int32)
    return window[:, :-1], window[:, 1:]


def stream_batches(
    tokens: np.ndarray,
    batch_size: int,
    tgt_len: int,
    *,
    start_step: int = 0,
    num_steps: Optional[int] = None,
    repeat: bool = False,
    drop_remainder: bool = True,
    rows: Optional[Sequence[int]] = None,
    rotate_seed: Optional[int] = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """NumPy iterator over `batch_for_step(t)` for t = start_step, start_step+1, ...

    Without `repeat` it stops at the end of the epoch; `num_steps` caps the number of batches.
    """
    layout = StreamLayout(len(tokens), batch_size, tgt_len, drop_remainder)
    end = None if repeat else layout.steps_per_epoch
    if num_steps is not None:
        end = start_step + num_steps if end is None else min(end, start_step + num_steps)
    step = start_step
    while end is None or step < end:
        yield batch_for_step(tokens, batch_size, tgt_len, step, drop_remainder=drop_remainder, rows=rows,
                             rotate_seed=rotate_seed)
        step += 1


# ---- tf.data --------------------------------------------------------------------------------------------
def _tf_rotation_offset(seed: int, epoch, n_tokens: int):
    import tensorflow as tf

    x = tf.math.floormod(seed * 1_000_003 + epoch * 7919 + 12345, _M31)
    for _ in range(3):
        x = tf.math.floormod(x * 48271, _M31)
    return tf.math.floormod(x, n_tokens)


def _segment_fn(tokens, layout: StreamLayout, rotate_seed: Optional[int]):
    """A tf function (global step, first row, rows) -> (inputs, targets) mirroring `batch_for_step`."""
    import tensorflow as tf

    spe, stream_len, tgt_len = layout.steps_per_epoch, layout.stream_len, layout.tgt_len

    def segment(step, first_row, n_rows):
        epoch, s = step // spe, step % spe
        if layout.drop_remainder:
            length = tf.constant(tgt_len, tf.int64)
        else:
            length = tf.minimum(tf.constant(tgt_len, tf.int64), stream_len - 1 - s * tgt_len)
        offset = (_tf_rotation_offset(rotate_seed, epoch, layout.n_tokens) if rotate_seed is not None
                  else tf.constant(0, tf.int64))
        rows = first_row + tf.range(n_rows, dtype=tf.int64)  # [B']
        start = rows * stream_len + s * tgt_len + offset  # [B']
        positions = tf.math.floormod(start[:, None] + tf.range(length + 1)[None, :], layout.n_tokens)
        window = tf.gather(tokens, positions)  # [B', l+1]
        width = tgt_len if layout.drop_remainder else None
        inputs = tf.ensure_shape(window[:, :-1], [n_rows, width])  # [B', L]
        targets = tf.ensure_shape(window[:, 1:], [n_rows, width])  # [B', L]
        return inputs, targets

    return segment


def _options():
    import tensorflow as tf

    options = tf.data.Options()
    options.deterministic = True
    # Never let tf.distribute shard by file or element: each replica owns fixed streams.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return options


def _step_range(layout: StreamLayout, start_step: int, repeat: bool) -> tuple[int, int]:
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    if repeat:
        return start_step, _INT64_MAX
    if start_step > layout.steps_per_epoch:
        raise ValueError(f"start_step={start_step} is past the end of the split ({layout.steps_per_epoch} "
                         "steps per epoch) and repeat=False")
    return start_step, layout.steps_per_epoch


def _load_tokens(data_dir: str, split: str, tokens: Optional[np.ndarray]) -> np.ndarray:
    return read_split(data_dir, split) if tokens is None else np.asarray(tokens, np.int32)


def make_dataset(
    data_dir: Optional[str],
    split: str,
    batch_size: int,
    tgt_len: int,
    *,
    start_step: int = 0,
    repeat: bool = True,
    drop_remainder: bool = True,
    rotate_seed: Optional[int] = None,
    tokens: Optional[np.ndarray] = None,
):
    """tf.data.Dataset of (inputs [B, L] int32, targets [B, L] int32), starting at global step `start_step`.

    Its iterator is checkpointable (`tf.train.Checkpoint(iterator=iter(ds))`). `tokens` (int32 [N]) replaces
    reading `split` from `data_dir`. With drop_remainder=False the last batch of an epoch may be [B, l < L].
    """
    import tensorflow as tf

    tokens = _load_tokens(data_dir, split, tokens)
    layout = StreamLayout(len(tokens), batch_size, tgt_len, drop_remainder)
    first, end = _step_range(layout, start_step, repeat)
    segment = _segment_fn(tf.constant(tokens, tf.int32), layout, rotate_seed)
    dataset = tf.data.Dataset.range(first, end).map(lambda t: segment(t, tf.constant(0, tf.int64), batch_size))
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(_options())


def distribute_dataset(
    strategy,
    data_dir: Optional[str],
    split: str,
    global_batch_size: int,
    tgt_len: int,
    *,
    start_step: int = 0,
    repeat: bool = True,
    drop_remainder: bool = True,
    rotate_seed: Optional[int] = None,
    tokens: Optional[np.ndarray] = None,
):
    """A distributed dataset: replica r of R gets streams [r*B/R, (r+1)*B/R) at every step.

    Built with `strategy.distribute_datasets_from_function`, no auto-sharding. Distributed iterators are not
    checkpointable: resume with `start_step` (the batch of step t is a pure function of t).
    """
    import tensorflow as tf

    tokens = _load_tokens(data_dir, split, tokens)
    layout = StreamLayout(len(tokens), global_batch_size, tgt_len, drop_remainder)
    n_replicas = strategy.num_replicas_in_sync
    if global_batch_size % n_replicas:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by the {n_replicas} "
                         "replicas; every replica must own the same number of streams")
    first, end = _step_range(layout, start_step, repeat)

    def dataset_fn(context: tf.distribute.InputContext):
        local = n_replicas // context.num_input_pipelines  # replicas fed by this worker's pipeline
        per_replica = context.get_per_replica_batch_size(global_batch_size)
        first_replica = context.input_pipeline_id * local
        segment = _segment_fn(tf.constant(tokens, tf.int32), layout, rotate_seed)

        def element(k):  # k-th element of this pipeline: step k // local for local replica k % local
            replica = first_replica + k % local
            return segment(k // local, replica * per_replica, per_replica)

        last = end if end == _INT64_MAX else end * local
        dataset = tf.data.Dataset.range(first * local, last).map(element)
        return dataset.prefetch(tf.data.AUTOTUNE).with_options(_options())

    return strategy.distribute_datasets_from_function(dataset_fn)
