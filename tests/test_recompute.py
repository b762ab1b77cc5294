"""Activation recomputation (`TrainConfig.recompute="block"`, `tf.recompute_grad` per block): with dropout on, the
loss, gradients, new memory and dropout streams equal the plain step's, in a tf.function, under XLA, with the fused
kernels, under MirroredStrategy on 2 logical CPUs (conftest), with gradient accumulation and in mixed bfloat16;
and the backward pass does recompute (the step's graph runs every block's dropouts twice)."""

import numpy as np
import pytest
import tensorflow as tf
from train_utils import B, L, make_trainer, prepare_tiny_corpus, tiny_train_config

from txl_tf import configs
from txl_tf.base.errors import ConfigError
from txl_tf.configs import ModelConfig
from txl_tf.model import fused
from txl_tf.model.policy import TrainingPolicy
from txl_tf.model.state import Memory
from txl_tf.model.transformer_xl import TransformerXL

V, NL, M = 13, 2, 6  # vocabulary, layers, memory (with B=4, L=5: pairwise distinct)
MODEL = dict(n_layer=NL, d_model=16, n_head=2, d_head=8, d_inner=24, mem_len=M, dropout=0.3, dropatt=0.2)
FLOAT32 = dict(mixed_precision=False, jit_compile=False, kernels="tf", adam_epsilon=1e-4)  # see test_trainer.py


def _model(**kwargs):
    tf.keras.utils.set_random_seed(5)
    return TransformerXL(n_token=V, **MODEL, **kwargs)


def _policy(recompute, kernels="tf"):
    return TrainingPolicy.of(kernels, recompute)


def _inputs():
    rng = np.random.default_rng(0)
    tokens = tf.constant(rng.integers(0, V, [B, L]), tf.int32)
    memory = Memory(tf.constant(rng.normal(size=[NL, B, M, MODEL["d_model"]]), tf.float32))
    return tokens, memory


def _step_fn(model, policy, jit_compile=False):
    @tf.function(jit_compile=jit_compile)
    def step(tokens, memory):
        with tf.GradientTape() as tape:
            hidden, new_memory = model(tokens, memory, training=True, policy=policy)
            loss = tf.reduce_mean(model.nll(hidden, tokens))
        return loss, tape.gradient(loss, model.trainable_variables), new_memory.hidden

    return step


def _dropout_states(model):
    return [v.numpy() for v in model.variables if "seed_generator_state" in v.path]


def _assert_steps_equal(plain, recomputed, atol=1e-6):
    (loss_a, grads_a, memory_a), (loss_b, grads_b, memory_b) = plain, recomputed
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
    assert len(grads_b) == len(grads_a) and all(g is not None for g in grads_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        np.testing.assert_allclose(tf.convert_to_tensor(b), tf.convert_to_tensor(a), rtol=1e-6, atol=atol)
    np.testing.assert_array_equal(memory_b, memory_a)


@pytest.mark.parametrize("jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)],  # xla: ~10 s
                         ids=["graph", "xla"])
def test_gradients_memory_and_dropout_streams_equal_the_plain_step(jit_compile):
    tokens, memory = _inputs()
    models = {name: _model() for name in ("none", "block")}
    steps = {name: _step_fn(model, _policy(name), jit_compile) for name, model in models.items()}
    for _ in range(2):  # the second step draws new masks: both paths advance the dropout generators alike
        results = {name: step(tokens, memory) for name, step in steps.items()}
        _assert_steps_equal(results["none"], results["block"])
        for a, b in zip(_dropout_states(models["none"]), _dropout_states(models["block"]), strict=True):
            np.testing.assert_array_equal(b, a)
    grads = results["none"][1]
    assert max(float(tf.reduce_max(tf.abs(g))) for g in grads) > 1e-3  # a real gradient was compared


def _ops(step, tokens, memory, op_type):
    graph = step.get_concrete_function(tokens, memory).graph
    return sum(op.type == op_type for op in graph.get_operations())


def test_the_backward_pass_recomputes_each_block_and_inference_does_not():
    tokens, memory = _inputs()
    plain, recomputed = (_step_fn(_model(), _policy(name)) for name in ("none", "block"))
    random_ops = "StatelessRandomUniformFullIntV2"
    per_block = 4  # attention probabilities and output, feed-forward inner and output
    assert _ops(recomputed, tokens, memory, random_ops) == _ops(plain, tokens, memory, random_ops) + NL * per_block

    model = _model()
    inference = tf.function(lambda tokens, memory: model(tokens, memory, training=False, policy=_policy("block")))
    assert _ops(inference, tokens, memory, random_ops) == 0
    assert _ops(inference, tokens, memory, "IdentityN") == 0  # no custom gradient in the graph


def test_eager_calls_run_the_plain_call_with_the_same_gradients():
    """tf.recompute_grad does not see the variables an eager call reads: the block runs its plain call there."""
    tokens, memory = _inputs()
    results = []
    for name in ("none", "block"):
        model = _model()
        with tf.GradientTape() as tape:
            hidden, new_memory = model(tokens, memory, training=True, policy=_policy(name))
            loss = tf.reduce_mean(model.nll(hidden, tokens))
        results.append((loss, tape.gradient(loss, model.trainable_variables), new_memory.hidden))
    _assert_steps_equal(*results)


@pytest.mark.skipif(fused.unavailable() is not None, reason=f"fused kernels unavailable: {fused.unavailable()}")
def test_fused_kernels_recompute_the_same_masks():
    tokens, memory = _inputs()
    results = [_step_fn(_model(), _policy(name, "fused"))(tokens, memory) for name in ("none", "block")]
    _assert_steps_equal(*results)


def test_the_config_field_reaches_the_trainers_policy_not_the_architecture():
    assert configs.TrainConfig().recompute == "none"
    with pytest.raises(ConfigError, match="TrainConfig.recompute='layer' must be one of"):
        configs.TrainConfig(recompute="layer")
    with pytest.raises(ValueError, match="recompute must be one of"):
        _policy("all")
    assert "recompute" not in _model().get_config() and "recompute" not in _model().blocks[0].get_config()


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


def _trainer_steps(data_dir, strategy, recompute, steps=2, **train):
    trainer = make_trainer(ModelConfig(**MODEL), tiny_train_config(recompute=recompute, **{**FLOAT32, **train}),
                           data_dir, strategy)
    assert trainer.policy.recompute == (recompute == "block")
    trainer.start(0)
    stats = trainer.train_loop(steps)
    trainer.sync_checkpoint(steps)
    weights = [v.numpy() for v in trainer.model.trainable_variables]
    return stats.loss, weights, trainer.saved_mems.numpy().astype(np.float32)


@pytest.mark.parametrize("strategy, train, atol", [
    ("default", {}, 1e-6),
    # slow (CI's slow phase): ~13 s and ~7 s; the model-level test above covers XLA in the default run
    pytest.param("default", dict(jit_compile=True), 1e-6, marks=pytest.mark.slow),
    pytest.param("default", dict(grad_accum_steps=2), 1e-6, marks=pytest.mark.slow),
    # slow: ~56 s (two CPU devices, a strategy each for the plain and the recomputed trainer)
    pytest.param("mirrored", {}, 1e-6, marks=pytest.mark.slow),
    ("default", dict(mixed_precision=True), 1e-3),  # bfloat16 activations: Adam moves weights by ~1e-3 a step
], ids=["tf.function", "xla", "grad_accum", "mirrored_2_cpus", "mixed_bfloat16"])
def test_a_trainer_step_equals_the_plain_one(char_data, strategy, train, atol):
    plain = _trainer_steps(char_data, strategy, "none", **train)
    recomputed = _trainer_steps(char_data, strategy, "block", **train)
    np.testing.assert_allclose(recomputed[0], plain[0], rtol=10 * atol)
    for a, b in zip(plain[1], recomputed[1], strict=True):
        np.testing.assert_allclose(b, a, atol=atol)
    np.testing.assert_allclose(recomputed[2], plain[2], atol=atol)
    assert np.abs(plain[2]).max() > 0
