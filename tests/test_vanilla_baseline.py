"""The vanilla model of Al-Rfou et al. (attn_type "al_rfou") is what it claims to be, so that its weakness in the
studies is the model's and not a bug (issue 54):

  - each layer adds row p of its learned table at window position p, to the attention's inputs and to the residual,
    the memory's positions first; without memory every call starts again at row 0;
  - the sliding-window scorer of the studies (txl_tf.study.scoring.score_windows) scores the prediction at every
    window position exactly as a full pass over the window does, so a window of W tokens is scored at table
    row W - 1 as in training;
  - a training step (the trainer's fused kernels) reaches every row the window uses and no other, and the last row
    of a window learns from the last prediction alone: no other prediction attends to its key. That is why a
    trained model scores its last position worst, the one position the sliding window scores.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from txl_tf import TransformerXL
from txl_tf.model.attention import attention_bias
from txl_tf.model.block import TransformerXLBlock
from txl_tf.model.policy import TrainingPolicy
from txl_tf.model.state import LayerMemory, Memory
from txl_tf.study.scoring import score_windows

B, L, M, N, D, DM, DI, V, NL = 2, 3, 5, 4, 6, 11, 9, 13, 2  # pairwise distinct where they meet
TABLE = 10  # rows of the learned table: more than M + L, so rows past the window exist


def _blocks():
    """An al_rfou block with a random table, and a block without positions (vaswani's: its positions are the
    model's) holding the same weights otherwise."""
    keras.utils.set_random_seed(4)
    absolute = TransformerXLBlock(DM, N, D, DI, attn_type="al_rfou", max_position=TABLE, name="block")
    plain = TransformerXLBlock(DM, N, D, DI, attn_type="vaswani", name="block")
    absolute.build((None, None, DM))
    plain.build((None, None, DM))
    rng = np.random.default_rng(0)
    table = rng.normal(size=(TABLE, DM)).astype(np.float32)  # of the inputs' scale, so a wrong row shows
    own = {w.path: w for w in plain.weights}
    for weight in absolute.weights:
        if "absolute_positions" in weight.path:
            weight.assign(table)
        else:
            value = rng.normal(scale=0.3, size=weight.shape).astype(np.float32)
            weight.assign(value)
            own.pop(weight.path).assign(value)
    assert not own  # every weight of the plain block was set
    return absolute, plain, table


def test_each_layer_adds_row_p_of_its_table_at_window_position_p():
    absolute, plain, table = _blocks()
    rng = np.random.default_rng(1)
    h = tf.constant(rng.normal(size=(B, L, DM)), tf.float32)
    mem = tf.constant(rng.normal(size=(B, M, DM)), tf.float32)
    # With memory: the memory at rows 0 .. M-1, the segment at rows M .. M+L-1.
    got = absolute(h, LayerMemory(mem), mem_len=M, attention_bias=attention_bias(L, M))
    want = plain(h + table[M:M + L], LayerMemory(mem + table[:M]), mem_len=M, attention_bias=attention_bias(L, M))
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(got[1].hidden.numpy(), np.concatenate([mem, h], 1)[:, -M:], atol=0)  # kept raw
    # Without memory (the vanilla windows): rows 0 .. L-1 again.
    got = absolute(h, None, attention_bias=attention_bias(L, 0))[0]
    np.testing.assert_allclose(got.numpy(), plain(h + table[:L], None, attention_bias=attention_bias(L, 0))[0].numpy(),
                               atol=1e-5)


def _model(max_position):
    keras.utils.set_random_seed(7)
    return TransformerXL(n_token=V, n_layer=NL, d_model=DM, n_head=N, d_head=D, d_inner=DI, dropout=0.0,
                         dropatt=0.0, mem_len=0, attn_type="al_rfou", max_position=max_position)


def test_the_sliding_scorer_scores_every_window_position_as_a_full_pass():
    window = 7
    model = _model(window)
    for block in model.blocks:  # a table far from its initial N(0, 0.02): a wrong row changes the losses
        block.absolute_positions.assign(np.random.default_rng(2).normal(size=(window, DM)).astype(np.float32))
    tokens = np.random.default_rng(3).integers(0, V, size=23).astype(np.int32)
    start = 9
    hidden, _ = model(tf.constant(tokens[None, start:start + window]))
    full = model.nll(hidden, tf.constant(tokens[None, start + 1:start + window + 1])).numpy()[0]  # [W]
    # Position i of the window predicts token start + i + 1 from the i + 1 tokens before it: a window of i + 1.
    slid = [score_windows(model, tokens, np.array([start + i + 1]), window=i + 1)[0] for i in range(window)]
    np.testing.assert_allclose(slid, full, atol=1e-5)
    assert np.ptp(full) > 0.05  # the positions differ, so a shifted row could not pass


@pytest.mark.parametrize("kernels", [False, True])
def test_a_training_step_reaches_the_rows_of_the_window_and_the_last_row_only_from_the_last_prediction(kernels):
    model = _model(TABLE)
    x = tf.constant(np.random.default_rng(5).integers(0, V, size=(B, L + 3)), tf.int32)  # 6 < TABLE positions
    y = tf.constant(np.random.default_rng(6).integers(0, V, size=(B, L + 3)), tf.int32)
    tables = [block.absolute_positions for block in model.blocks]
    empty = Memory(tf.zeros([NL, B, 0, DM]))  # the trainer's memory of a model without one

    @tf.function
    def gradients():
        with tf.GradientTape(persistent=True) as tape:
            hidden, _ = model(x, empty, training=True, policy=TrainingPolicy(kernels=kernels))
            nll = model.nll(hidden, y)  # [B, 6]
            every, all_but_last = tf.reduce_sum(nll), tf.reduce_sum(nll[:, :-1])
        return ([tf.convert_to_tensor(g) for g in tape.gradient(every, tables)],
                [tf.convert_to_tensor(g) for g in tape.gradient(all_but_last, tables)])

    every, all_but_last = gradients()
    width = L + 3
    for g, h in zip(every, all_but_last, strict=True):
        rows = np.linalg.norm(g.numpy(), axis=1)  # [TABLE]
        assert (rows[:width] > 1e-6).all() and (rows[width:] == 0).all()
        rows = np.linalg.norm(h.numpy(), axis=1)
        assert (rows[:width - 1] > 1e-6).all() and rows[width - 1] == 0  # the last row: its own prediction only
