"""Streams that keep memory continuous: the NumPy core, tf.data, checkpoint/resume and 2 real replicas."""

import numpy as np
import pytest
import tensorflow as tf

from txl_tf.data import pipeline
from txl_tf.data.pipeline import batch_for_step, make_dataset, stream_batches

N, B, L = 1003, 4, 7  # stream length S = 250: 249 predictable positions = 35 full segments + 4 tokens


def positions():
    return np.arange(N, dtype=np.int32)  # token value == its position: batches show where they come from


def test_oracle_segments_and_continuity():
    tokens = positions()
    stream_len = N // B
    assert pipeline.steps_per_epoch(N, B, L) == (stream_len - 1) // L == 35
    for t in (0, 1, 34):
        x, y = batch_for_step(tokens, B, L, t)
        expect = np.arange(B)[:, None] * stream_len + t * L + np.arange(L)[None, :]
        np.testing.assert_array_equal(x, expect)
        np.testing.assert_array_equal(y, expect + 1)
    # row b of step t+1 continues row b of step t; rows are disjoint contiguous blocks
    batches = list(stream_batches(tokens, B, L))
    rows = np.concatenate([x for x, _ in batches], axis=1)  # [B, 35 * L]
    for b in range(B):
        np.testing.assert_array_equal(rows[b], np.arange(b * stream_len, b * stream_len + 35 * L))


def test_final_short_segment_scores_every_token_once():
    tokens = positions()
    batches = list(stream_batches(tokens, B, L, drop_remainder=False))
    assert len(batches) == pipeline.steps_per_epoch(N, B, L, drop_remainder=False) == 36
    assert batches[-1][0].shape == (B, 4)
    targets = np.concatenate([y for _, y in batches], axis=1)
    stream_len = N // B
    np.testing.assert_array_equal(targets, np.arange(B)[:, None] * stream_len + 1 + np.arange(stream_len - 1))


def test_tf_dataset_equals_numpy_core_with_repeat_and_rotation():
    tokens = np.random.default_rng(0).integers(0, 50, N).astype(np.int32)
    ds = make_dataset(None, "train", B, L, tokens=tokens, rotate_seed=11)
    assert ds.element_spec[0].shape == (B, L) and ds.element_spec[0].dtype == tf.int32
    expected = stream_batches(tokens, B, L, repeat=True, num_steps=80, rotate_seed=11)
    for t, ((x, y), (ex, ey)) in enumerate(zip(ds.take(80), expected, strict=True)):
        np.testing.assert_array_equal(x.numpy(), ex, err_msg=f"step {t}")
        np.testing.assert_array_equal(y.numpy(), ey, err_msg=f"step {t}")
    # rotation: deterministic per (seed, epoch), different between epochs and seeds
    offsets = [pipeline.rotation_offset(11, e, N) for e in range(4)]
    assert len(set(offsets)) == 4 and offsets == [pipeline.rotation_offset(11, e, N) for e in range(4)]
    assert pipeline.rotation_offset(12, 0, N) != offsets[0]
    x35, _ = batch_for_step(tokens, B, L, 35, rotate_seed=11)  # first step of epoch 1
    start = (offsets[1] + np.arange(B) * (N // B)) % N
    np.testing.assert_array_equal(x35[:, 0], tokens[start])


def test_eval_dataset_ends_with_short_segment():
    tokens = positions()
    ds = make_dataset(None, "test", B, L, tokens=tokens, repeat=False, drop_remainder=False)
    got = list(ds.as_numpy_iterator())
    assert len(got) == 36 and got[-1][0].shape == (B, 4) and got[0][0].shape == (B, L)
    for (x, y), (ex, ey) in zip(got, stream_batches(tokens, B, L, drop_remainder=False), strict=True):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def test_iterator_checkpoint_and_start_step_resume(tmp_path):
    tokens = positions()
    iterator = iter(make_dataset(None, "train", B, L, tokens=tokens))
    for _ in range(5):
        next(iterator)
    checkpoint = tf.train.Checkpoint(iterator=iterator)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    after = [next(iterator)[0].numpy() for _ in range(40)]  # crosses the epoch boundary at step 35
    checkpoint.restore(path)
    np.testing.assert_array_equal(np.stack([next(iterator)[0].numpy() for _ in range(40)]), np.stack(after))
    resumed = make_dataset(None, "train", B, L, tokens=tokens, start_step=5).take(40)
    np.testing.assert_array_equal(np.stack([x.numpy() for x, _ in resumed]), np.stack(after))


def test_two_replicas_each_keep_their_streams():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    tokens = np.random.default_rng(1).integers(0, 97, 2000).astype(np.int32)
    global_batch, seg = 6, 5

    @tf.function
    def step(iterator):
        def fn(inputs, targets):
            ctx = tf.distribute.get_replica_context()
            return ctx.replica_id_in_sync_group, inputs, targets

        return strategy.run(fn, args=next(iterator))

    def run(start_step, n_steps):
        iterator = iter(pipeline.distribute_dataset(strategy, None, "train", global_batch, seg,
                                                    tokens=tokens, start_step=start_step, rotate_seed=5))
        out = []
        for _ in range(n_steps):
            rid, x, y = (strategy.experimental_local_results(v) for v in step(iterator))
            out.append([(int(r), a.numpy(), b.numpy()) for r, a, b in zip(rid, x, y, strict=True)])
        return out

    steps_per_epoch = pipeline.steps_per_epoch(len(tokens), global_batch, seg)  # 66
    full = run(0, steps_per_epoch + 3)
    for t, per_replica in enumerate(full):
        for r, (rid, x, y) in enumerate(per_replica):
            assert rid == r and x.shape == (3, seg)
            ex, ey = batch_for_step(tokens, global_batch, seg, t, rows=range(3 * r, 3 * r + 3), rotate_seed=5)
            np.testing.assert_array_equal(x, ex, err_msg=f"step {t} replica {r}")
            np.testing.assert_array_equal(y, ey, err_msg=f"step {t} replica {r}")
    resumed = run(steps_per_epoch - 1, 4)
    for a, b in zip(resumed, full[steps_per_epoch - 1:], strict=True):
        for (ra, xa, _), (rb, xb, _) in zip(a, b, strict=True):
            assert ra == rb
            np.testing.assert_array_equal(xa, xb)


def test_distribute_needs_divisible_batch():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(ValueError, match="not divisible by the 2 replicas"):
        pipeline.distribute_dataset(strategy, None, "train", 5, 3, tokens=positions())


def test_split_too_short_for_one_segment_per_stream():
    with pytest.raises(ValueError, match=r"too short for batch_size=10 streams with tgt_len=100"):
        make_dataset(None, "valid", 10, 100, tokens=positions())
    with pytest.raises(ValueError, match="past the end"):
        make_dataset(None, "valid", B, L, tokens=positions(), repeat=False, start_step=36)


WORKER = r"""
import json
import numpy as np
import tensorflow as tf
from txl_tf.data import pipeline

strategy = tf.distribute.MultiWorkerMirroredStrategy()
tokens = np.arange(3001, dtype=np.int32)
iterator = iter(pipeline.distribute_dataset(strategy, None, "train", 6, 4, tokens=tokens, start_step=2))

@tf.function
def step(iterator):
    def fn(inputs, targets):
        return tf.distribute.get_replica_context().replica_id_in_sync_group, inputs
    return strategy.run(fn, args=next(iterator))

seen = []
for _ in range(3):
    rid, x = (strategy.experimental_local_results(v)[0] for v in step(iterator))
    seen.append([int(rid), x.numpy().tolist()])
print("RESULT" + json.dumps(seen))
"""


@pytest.mark.slow
def test_two_workers_each_keep_their_streams(tmp_path):
    """MultiWorkerMirroredStrategy with 2 local processes: worker w (replica w) gets streams [3w, 3w+3)."""
    import json
    import os
    import socket
    import subprocess
    import sys

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for index in range(2):
        env = {**os.environ, "PYTHONPATH": repo, "CUDA_VISIBLE_DEVICES": "",
               "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    oracle_tokens = np.arange(3001, dtype=np.int32)
    for worker, proc in enumerate(procs):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        seen = json.loads(out.split("RESULT")[-1])
        for t, (rid, x) in enumerate(seen, start=2):
            assert rid == worker
            expect, _ = batch_for_step(oracle_tokens, 6, 4, t, rows=range(3 * worker, 3 * worker + 3))
            np.testing.assert_array_equal(np.array(x), expect)
