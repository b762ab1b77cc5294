"""Decoding speed of the keras-hub path (`txl_tf.lm.hub.TransformerXLCausalLM`): the graph, XLA, and the ring of
keys/values, in one run on one machine.

    python scripts/benchmark_generate.py --model_dir=runs/sample
    python scripts/benchmark_generate.py --arch=4,192,3,64,768 --n_token=204 --mem_len=128 --tgt_len=128

The model is a trained run (--model_dir: its checkpoint and EvalConfig) or random weights of --arch. For each
batch size, rows of --context random prompt tokens, then --tokens new tokens, greedy. Decode tokens/s = rows x
(--tokens - 1) / (the time of a generation of --tokens new tokens minus that of one new token): the prompt and
the calls' fixed costs cancel. The fastest of --repeats after a warm-up, the paths taking turns:
  keras-hub graph, memory moved: keras-hub's GreedySampler loop in `generate_function` (a tf.function), each new
    token's step keeping the last mem_len keys/values by moving them (`compile(generate_jit_compile=False,
    generate_ring=False)`; the way txl_tf's earlier hand-written decoder went);
  keras-hub XLA, memory moved: the same compiled with XLA;
  keras-hub XLA: the default for the relative encodings (xl and shaw decode into a ring of keys/values, a slot
    written per token at batch 1, once per block of tokens over more rows: `TransformerXLCausalLM._block_decode`);
  txl_tf.lm.generation (XLA): `txl_tf.lm.generation.Generator`, what `python -m txl_tf.generate` and the SavedModel's
    `generate` signature run (keras-hub's loop with the sampler chosen per call).
The same tokens come out of every path (checked). Only figures from one run compare.
"""

from __future__ import annotations

import time

from absl import flags

from txl_tf.base import cli

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    fv = flag_values
    cli.define(fv, "model_dir")  # a trained run (default: random weights of --arch)
    flags.DEFINE_string("arch", "4,192,3,64,768", "n_layer,d_model,n_head,d_head,d_inner of the random model "
                        "(default: the `make run` sample model's).", flag_values=fv)
    flags.DEFINE_integer("n_token", 204, "Vocabulary size of the random model.", flag_values=fv)
    flags.DEFINE_integer("mem_len", 128, "Memory length of the random model.", flag_values=fv)
    flags.DEFINE_integer("tgt_len", 128, "Prompt segment length of the random model.", flag_values=fv)
    flags.DEFINE_integer("context", 100, "Prompt tokens per row.", flag_values=fv)
    flags.DEFINE_integer("tokens", 64, "New tokens per row.", flag_values=fv)
    flags.DEFINE_list("batches", ["1", "32"], "Batch sizes.", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "Timed runs per path and length; the fastest counts.", flag_values=fv)


def load_lm():
    """(keras-hub TransformerXLCausalLM, description)."""
    from txl_tf.lm.hub import TransformerXLCausalLM

    if FLAGS.model_dir:
        return TransformerXLCausalLM.from_preset(FLAGS.model_dir), FLAGS.model_dir
    import keras

    from txl_tf.base.errors import UserError
    from txl_tf.configs import EvalConfig, ModelConfig
    from txl_tf.data.vocab import Vocab
    from txl_tf.lm.hub import (
        TransformerXLBackbone,
        TransformerXLCausalLMPreprocessor,
        TransformerXLTokenizer,
    )

    keras.utils.set_random_seed(0)
    n_layer, d_model, n_head, d_head, d_inner = (int(x) for x in FLAGS.arch.split(","))
    if not 2 <= FLAGS.n_token <= 256:
        raise UserError(f"--n_token={FLAGS.n_token}: the random model's vocabulary is bytes; give 2 .. 256")
    vocab = Vocab(list(range(FLAGS.n_token)), "char")
    backbone = TransformerXLBackbone(
        ModelConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, d_head=d_head, d_inner=d_inner, dropout=0.0,
                    mem_len=FLAGS.mem_len, n_token=FLAGS.n_token),
        EvalConfig(tgt_len=FLAGS.tgt_len, mem_len=FLAGS.mem_len, clamp_len=-1, same_length=False))
    preprocessor = TransformerXLCausalLMPreprocessor(TransformerXLTokenizer(vocab))
    return TransformerXLCausalLM(backbone, preprocessor), f"random weights, arch {FLAGS.arch}"


def main(argv):
    del argv
    import numpy as np
    import tensorflow as tf

    from txl_tf.lm import generation

    lm, what = load_lm()
    model, backbone = lm.backbone.transformer_xl, lm.backbone
    batches = [int(b) for b in FLAGS.batches]
    print(f"model: {what}; mem_len {backbone.protocol.mem_len}, prompt segments of {backbone.segment_len}; "
          f"{FLAGS.context} prompt tokens, {FLAGS.tokens} new tokens, greedy", flush=True)

    def hub_path(jit, ring=None):
        lm.compile(sampler="greedy", generate_jit_compile=jit, generate_ring=ring)
        function = lm.make_generate_function()

        def run(prompts, new):
            rows, context = prompts.shape
            ids = np.zeros([rows, context + new], np.int32)
            ids[:, :context] = prompts
            mask = np.zeros_like(ids, bool)
            mask[:, :context] = True
            out = function({"token_ids": tf.constant(ids), "padding_mask": tf.constant(mask)}, stop_token_ids=None)
            return out["token_ids"].numpy()[:, context:]
        return run

    def generator_path(prompts, new):  # what python -m txl_tf.generate and the SavedModel run
        generate = generation.generator(model, backbone.protocol, backbone.segment_len).generate
        return generation.generate_with(generate, list(prompts), max_tokens=new, temperature=0.0).tokens

    base = "keras-hub graph, memory moved"
    paths = {base: hub_path(False, ring=False), "keras-hub XLA, memory moved": hub_path(True, ring=False),
             "keras-hub XLA": hub_path(True), "txl_tf.lm.generation (XLA)": generator_path}
    print(f"\n| path | batch | tokens/s | ms per token step | same tokens as {base}'s |")
    print("|---|---:|---:|---:|---|")
    rng, ratios = np.random.default_rng(0), []
    for batch in batches:
        prompts = rng.integers(0, model.n_token, size=[batch, FLAGS.context]).astype(np.int32)
        outputs, best = {}, {}
        for name, run in paths.items():  # warm-up: traces and compiles
            outputs[name] = run(prompts, FLAGS.tokens)
            run(prompts, 1)
            best[name] = [float("inf"), float("inf")]
        for _ in range(FLAGS.repeats):
            for name, run in paths.items():
                for slot, new in enumerate((1, FLAGS.tokens)):
                    start = time.perf_counter()
                    run(prompts, new)
                    best[name][slot] = min(best[name][slot], time.perf_counter() - start)
        speeds = {}
        for name in paths:
            seconds = max(best[name][1] - best[name][0], 1e-9)
            steps = FLAGS.tokens - 1
            speeds[name] = batch * steps / seconds
            same = np.array_equal(outputs[name], outputs[base])
            print(f"| {name} | {batch} | {speeds[name]:,.0f} | {1000 * seconds / steps:.2f} | "
                  f"{'yes' if same else 'NO'} |", flush=True)
        ratios.append((batch, {name: speed / speeds[base] for name, speed in speeds.items()}))
    print()
    for batch, ratio in ratios:
        print(f"batch {batch}: tokens/s against the {base}: " +
              ", ".join(f"{name} {value:.2f}x" for name, value in ratio.items() if name != base))


if __name__ == "__main__":
    cli.run(main, define_flags)
