"""The same model on each Keras backend, side by side on this machine: a training step and the keras-hub model's
greedy decoding (a benchmark, not a test).

    python scripts/benchmark_backends.py                       # TensorFlow, JAX and PyTorch: the table
    python scripts/benchmark_backends.py --backends=jax --arch=2,128,2,64,512 --train_batch=4

For each backend of --backends, one fresh process with KERAS_BACKEND set builds a `TransformerXL` of --arch (random
weights, dropout 0.1) and times, on random tokens:
  train: one training step on [--train_batch, --tgt_len] tokens with the memory (--mem_len) carried from the step
    before: the forward pass, the mean NLL, its gradient, clipping by global norm 0.25 and Keras's Adam. TensorFlow: a
    `tf.function` around a GradientTape (the layers' graph; not the trainer's tuned path, which
    `scripts/benchmark_model.py` times); JAX: `jax.jit` of the stateless step (`jax.value_and_grad` in a
    `keras.StatelessScope`, Adam's `stateless_apply`); PyTorch: eagerly, autograd. The median of --steps after 2
    untimed.
  decode: the keras-hub model (`TransformerXLCausalLM` around that network, `compile(sampler="greedy")`, each
    backend's default generate function) on rows of --context prompt tokens: tokens/s = rows x (--new_tokens - 1) /
    (the time of --new_tokens new tokens minus that of one), the fastest of --repeats after a warm-up, so that the
    prompt and the call's fixed costs cancel; the two lengths take turns, and a cell whose longer call was not the
    slower is timed again (up to RETRIES more rounds) before it is an error.
The CPU's name heads the table; only figures of one run compare.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

from txl_tf.base import cli
from txl_tf.base.errors import UserError

# isort: split
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_hlo  # noqa: E402  (run_child: a child process, its last line as JSON)
from benchmark_memory import cpu_name  # noqa: E402

FLAGS = flags.FLAGS
BACKENDS = ("tensorflow", "jax", "torch")
RETRIES = 2  # more rounds of a decode cell whose longer call was not the slower


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_list("backends", list(BACKENDS), f"of {list(BACKENDS)}", flag_values=fv)
    flags.DEFINE_string("arch", "4,192,3,64,768", "n_layer,d_model,n_head,d_head,d_inner of the random model "
                        "(default: the `make run` sample model's)", flag_values=fv)
    flags.DEFINE_integer("n_token", 204, "vocabulary size", lower_bound=2, upper_bound=1 << 20, flag_values=fv)
    flags.DEFINE_integer("tgt_len", 128, "segment length of the training step", lower_bound=1, upper_bound=4096,
                         flag_values=fv)
    flags.DEFINE_integer("mem_len", 128, "memory length", lower_bound=0, upper_bound=4096, flag_values=fv)
    flags.DEFINE_integer("train_batch", 8, "rows of the training step", lower_bound=1, upper_bound=1024,
                         flag_values=fv)
    flags.DEFINE_integer("steps", 5, "timed training steps (after 2 untimed); the median counts", lower_bound=1,
                         upper_bound=1000, flag_values=fv)
    flags.DEFINE_list("decode_batches", ["1", "8"], "rows of the decoding runs", flag_values=fv)
    flags.DEFINE_integer("context", 100, "prompt tokens per decoding row", lower_bound=1, upper_bound=4096,
                         flag_values=fv)
    flags.DEFINE_integer("new_tokens", 33, "new tokens of the timed generation", lower_bound=2, upper_bound=4096,
                         flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed generations per length; the fastest counts", lower_bound=1,
                         upper_bound=100, flag_values=fv)
    flags.DEFINE_string("child", None, "internal: time one backend in this process, print JSON", flag_values=fv)


def _arch(value: str) -> dict:
    try:
        n_layer, d_model, n_head, d_head, d_inner = (int(v) for v in value.split(","))
    except ValueError:
        raise UserError(f"--arch={value[:60]} must be five whole numbers: n_layer,d_model,n_head,d_head,"
                        "d_inner (e.g. 4,192,3,64,768)") from None
    if not (1 <= n_layer <= 64 and 1 <= d_model <= 8192 and 1 <= n_head <= 128 and 1 <= d_head <= 1024
            and 1 <= d_inner <= 65536):
        raise UserError(f"--arch={value}: a size out of range (layers <= 64, d_model <= 8192, heads <= "
                        "128, d_head <= 1024, d_inner <= 65536); give a smaller model")
    return dict(n_layer=n_layer, d_model=d_model, n_head=n_head, d_head=d_head, d_inner=d_inner)


def _train_step(model, optimizer, inputs, targets):
    """step(memory) -> (loss, new memory) on the process's backend (see the module docstring)."""
    import keras

    from txl_tf.model.state import Memory

    backend = keras.backend.backend()
    variables = model.trainable_variables
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def step(memory):
            with tf.GradientTape() as tape:
                hidden, state = model(inputs, Memory(memory), training=True)
                loss = tf.reduce_mean(model.nll(hidden, targets))
            grads, _ = tf.clip_by_global_norm(tape.gradient(loss, variables), 0.25)
            optimizer.apply_gradients(zip(grads, variables, strict=True))
            return loss, state.hidden

        return step
    if backend == "torch":
        import torch

        def step(memory):
            hidden, state = model(inputs, Memory(memory), training=True)
            loss = keras.ops.mean(model.nll(hidden, targets))
            for variable in variables:
                variable.value.grad = None
            loss.backward()
            grads = [variable.value.grad for variable in variables]
            norm = torch.sqrt(sum(torch.sum(g.float() ** 2) for g in grads))
            with torch.no_grad():
                grads = [g * torch.clamp(0.25 / (norm + 1e-6), max=1.0) for g in grads]
                optimizer.apply(grads, variables)
            return loss.detach(), state.hidden.detach()

        return step
    import benchmark_jax_step  # its jitted step (the GPU's), here on this CPU
    import jax

    jitted = jax.jit(benchmark_jax_step.stateless_step(model, optimizer, inputs, targets))
    others = model.non_trainable_variables
    state = [[v.value for v in variables], [v.value for v in others], [v.value for v in optimizer.variables]]

    def step(memory):
        *new, memory, loss = jitted(*state, memory)
        state[:] = new
        return loss, memory

    return step


def child(backend: str) -> dict:
    import keras
    import numpy as np

    from txl_tf.configs import EvalConfig, ModelConfig
    from txl_tf.lm.hub import TransformerXLBackbone, TransformerXLCausalLM

    if keras.backend.backend() != backend:
        raise UserError(f"KERAS_BACKEND is {keras.backend.backend()!r}, not {backend!r}")
    config = ModelConfig(**_arch(FLAGS.arch), n_token=FLAGS.n_token, dropout=0.1, dropatt=0.0,
                         mem_len=FLAGS.mem_len)
    backbone = TransformerXLBackbone(config, EvalConfig(tgt_len=FLAGS.tgt_len, mem_len=FLAGS.mem_len, clamp_len=-1,
                                                        same_length=False))
    model = backbone.transformer_xl
    rng = np.random.default_rng(0)
    shape = (FLAGS.train_batch, FLAGS.tgt_len + 1)
    tokens = keras.ops.convert_to_tensor(rng.integers(0, FLAGS.n_token, shape), "int32")
    optimizer = keras.optimizers.Adam(2.5e-4)
    optimizer.build(model.trainable_variables)
    step = _train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    memory = model.initial_memory(FLAGS.train_batch).hidden
    times, losses = [], []
    for i in range(FLAGS.steps + 2):
        start = time.perf_counter()
        loss, memory = step(memory)
        losses.append(float(keras.ops.convert_to_numpy(loss)))  # waits for the step
        if i >= 2:
            times.append(time.perf_counter() - start)
    train_seconds = sorted(times)[len(times) // 2]

    lm = TransformerXLCausalLM(backbone)
    lm.compile(sampler="greedy")
    decode = {}
    for rows in (int(b) for b in FLAGS.decode_batches):
        context = rng.integers(0, FLAGS.n_token, (rows, FLAGS.context)).astype("int32")
        best, prompts = {}, {}
        for new in (1, FLAGS.new_tokens):  # token ids without a preprocessor: the prompt's width is max_length
            prompts[new] = {"token_ids": np.pad(context, [(0, 0), (0, new)]),
                            "padding_mask": np.pad(np.ones_like(context, bool), [(0, 0), (0, new)])}
            lm.generate(prompts[new])  # warm-up (and the function's compilation)
        # The two lengths take turns, the order alternating, so that a slow moment of a shared machine hits both;
        # where the longer call's best is still not the slower (a tiny model, whose new tokens cost less than the
        # calls' noise), up to RETRIES more rounds of --repeats.
        for _ in range(1 + RETRIES):
            for i in range(FLAGS.repeats):
                for new in (1, FLAGS.new_tokens) if i % 2 else (FLAGS.new_tokens, 1):
                    start = time.perf_counter()
                    lm.generate(prompts[new])
                    best[new] = min(best.get(new, float("inf")), time.perf_counter() - start)
            if best[FLAGS.new_tokens] > best[1]:
                break
        extra = best[FLAGS.new_tokens] - best[1]
        if extra <= 0:
            raise UserError(f"{backend}, batch {rows}: {FLAGS.new_tokens} new tokens took no longer than 1 "
                            f"({best[FLAGS.new_tokens]:.4f} s against {best[1]:.4f} s); raise --new_tokens or "
                            "--repeats")
        decode[rows] = rows * (FLAGS.new_tokens - 1) / extra
    return dict(train_seconds=train_seconds, train_tokens_per_s=FLAGS.train_batch * FLAGS.tgt_len / train_seconds,
                loss=losses[0], decode=decode)


def main(argv) -> None:
    del argv
    if FLAGS.child:
        print(json.dumps(child(FLAGS.child)))
        return
    for backend in FLAGS.backends:
        if backend not in BACKENDS:
            raise UserError(f"--backends: {backend!r} is none of {', '.join(BACKENDS)}; choose among them")
    _arch(FLAGS.arch)
    rows = [int(b) for b in FLAGS.decode_batches]
    print(f"CPU: {cpu_name()}; model {FLAGS.arch}, n_token {FLAGS.n_token}; train [{FLAGS.train_batch}, "
          f"{FLAGS.tgt_len}] with memory {FLAGS.mem_len}; decode after {FLAGS.context} prompt tokens", flush=True)
    print(f"{'backend':<11} {'train s/step':>12} {'train tok/s':>12} {'loss':>6}  "
          + "  ".join(f"{f'decode b{r} tok/s':>17}" for r in rows), flush=True)
    passed = [arg for arg in sys.argv[1:] if not arg.startswith("--backends")]
    for backend in FLAGS.backends:
        got = benchmark_hlo.run_child(__file__, *passed, f"--child={backend}", KERAS_BACKEND=backend,
                                      JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
        print(f"{backend:<11} {got['train_seconds']:>12.3f} {got['train_tokens_per_s']:>12,.0f} {got['loss']:>6.2f}  "
              + "  ".join(f"{got['decode'][str(r)]:>17,.0f}" for r in rows), flush=True)


if __name__ == "__main__":
    cli.run(main, define_flags)
