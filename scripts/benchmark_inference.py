"""Serving latency: per-token generation latency and tokens/s, and per-segment scoring latency, for the Python
model and its SavedModel, at batch 1 and 32 and at contexts from 100 tokens to the memory length.

    python scripts/benchmark_inference.py --model_dir=runs/sample --mem_len=2000 --contexts=100,500,1000,2000
    python scripts/benchmark_inference.py --arch=2,64,2,32,128 --n_token=50 --mem_len=64 --contexts=16,64

The model is a trained run (--model_dir: its checkpoint and EvalConfig.tgt_len) or random weights of --arch.
The protocol is mem_len = --mem_len (or EvalConfig.mem_len), clamp_len from EvalConfig (-1 for --arch),
same_length off (generation's). The SavedModel is written by `txl_tf.export` into a temporary directory and
loaded back, so both paths serve the same weights with the same keys/values cache.

For every path, batch and context (a random prompt of that many tokens, consumed first):
  per-token latency: --tokens single-token calls, each from Python and waited for (the call, then a greedy pick
    on the host): p50 / p90 / p99 in ms. This is what a serving loop that returns every token sees.
  tokens/s: rows over the seconds per new token of generation (`txl_tf.generation.Generator`: keras-hub's loop,
    sampling in the graph), the slope of the time of 1, --tokens / 2 + 1 and --tokens new tokens, so that the
    prompt cancels; each the fastest of --repeats after a warm-up, the two paths taking turns: the Python model's
    generator, the SavedModel's `generate` signature (the same function, traced at export).
Then the bound the machine's memory reads put on decoding (the ring's bytes per step over the read bandwidth
measured in the same run), and per-segment scoring latency: --segments calls of `score` with max_len tokens and
the state carried.
Timings are wall times of this process on this machine; only figures from one run compare.
"""

from __future__ import annotations

import os
import tempfile
import time

from absl import flags

# txl_tf.cli sets TF_CPP_MIN_LOG_LEVEL before TensorFlow is imported (lazily, in the functions).
from txl_tf import cli

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    fv = flag_values
    cli.define(fv, "model_dir")  # a trained run (default: random weights of --arch)
    flags.DEFINE_string("arch", "4,256,4,64,1024", "n_layer,d_model,n_head,d_head,d_inner of the random model.",
                        flag_values=fv)
    flags.DEFINE_integer("n_token", 204, "Vocabulary size of the random model.", flag_values=fv)
    flags.DEFINE_integer("max_len", 128, "Longest segment of the random model's calls (a run uses "
                         "EvalConfig.tgt_len).", flag_values=fv)
    flags.DEFINE_integer("mem_len", None, "Memory length (default: the run's EvalConfig.mem_len; 2000 for --arch).",
                         flag_values=fv)
    flags.DEFINE_list("contexts", ["100", "500", "1000", "2000"], "Context lengths (prompt tokens) to time at.",
                      flag_values=fv)
    flags.DEFINE_list("batches", ["1", "32"], "Batch sizes.", flag_values=fv)
    flags.DEFINE_integer("tokens", 64, "Tokens timed per cell (after 3 warm-up tokens).", flag_values=fv)
    flags.DEFINE_integer("segments", 10, "Scoring segments timed per cell (after one warm-up).", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "Decode loops timed per cell; the fastest counts.", flag_values=fv)
    flags.DEFINE_enum("dtype", "float32", ["float32", "mixed_bfloat16"], "Compute dtype.", flag_values=fv)

def load_model():
    """(model, Protocol, max_len, description)."""
    from txl_tf.protocol import Protocol

    if FLAGS.model_dir:
        from txl_tf import loading

        dtype = None if FLAGS.dtype == "float32" else FLAGS.dtype
        model, configs, prefix = loading.load_model(FLAGS.model_dir, dtype=dtype)
        e = configs.eval
        protocol = Protocol(FLAGS.mem_len or e.mem_len, e.clamp_len, same_length=False)
        return model, protocol, e.tgt_len, prefix
    from txl_tf.loading import dtype_policy
    from txl_tf.model import TransformerXL

    n_layer, d_model, n_head, d_head, d_inner = (int(x) for x in FLAGS.arch.split(","))
    with dtype_policy(FLAGS.dtype):
        model = TransformerXL(n_token=FLAGS.n_token, n_layer=n_layer, d_model=d_model, n_head=n_head, d_head=d_head,
                              d_inner=d_inner, dropout=0.0, dropatt=0.0, mem_len=FLAGS.mem_len or 2000)
    return model, Protocol(FLAGS.mem_len or 2000), FLAGS.max_len, f"random weights, arch {FLAGS.arch}"


def percentiles(seconds) -> tuple:
    import numpy as np

    return tuple(float(np.percentile(np.asarray(seconds) * 1000, q)) for q in (50, 90, 99))


def model_step(recurrent):
    """(tokens, lengths, state) -> (log-probs [B, V] after each row's last token, state) of the Python model."""
    def step(tokens, lengths, state):
        return recurrent.next_log_probs(tokens, state, lengths)
    return step


def saved_model_step(loaded):
    """The same step through the SavedModel's `next_token_logits` signature (the state by name)."""
    import tensorflow as tf

    from txl_tf.state import from_named

    signature = loaded.signatures["next_token_logits"]

    def step(tokens, lengths, state):
        if lengths is None:
            lengths = tf.fill([tf.shape(tokens)[0]], tf.shape(tokens)[1])
        out = signature(tokens=tokens, lengths=lengths, **state.named())
        return out["logits"], from_named({name: out[name] for name in state.named()})
    return step


def consume(step, prompt, state, max_len):
    """(log-probs after the prompt, state): the prompt [B, P] in segments of max_len."""
    import tensorflow as tf

    for start in range(0, prompt.shape[1], max_len):
        log_probs, state = step(tf.constant(prompt[:, start:start + max_len]), None, state)
    return log_probs, state


def token_latency(step, state, log_probs, tokens):
    """p50/p90/p99 ms of single-token calls from Python (3 warm-up calls first)."""
    import numpy as np
    import tensorflow as tf

    token = tf.constant(np.argmax(log_probs.numpy(), axis=-1)[:, None], tf.int32)
    times = []
    for index in range(tokens + 3):
        start = time.perf_counter()
        log_probs, state = step(token, None, state)
        token = tf.constant(np.argmax(log_probs.numpy(), axis=-1)[:, None], tf.int32)  # waits for the call
        if index >= 3:
            times.append(time.perf_counter() - start)
    return percentiles(times)


def decode_speeds(generators: dict, prompt, tokens: int, repeats: int) -> dict:
    """Tokens/s of each path's generation (temperature 1): rows over the seconds per new token, the least-squares
    slope of the time of 1, tokens // 2 + 1 and `tokens` new tokens (the prompt, the same in each, is the
    intercept; a slope over three lengths is steadier than the difference of two timings when the prompt takes
    seconds), each time the fastest of `repeats` runs after a warm-up, the paths taking turns so that a slow moment
    of a shared machine hits both."""
    import numpy as np

    from txl_tf import generation

    rows = [list(row) for row in prompt]
    lengths = sorted({1, tokens // 2 + 1, tokens})
    for generate in generators.values():  # the first call of each length traces and compiles
        for new in lengths:
            generation.generate_with(generate, rows, max_tokens=new)
    best = {name: [float("inf")] * len(lengths) for name in generators}
    for _ in range(repeats):
        for name, generate in generators.items():
            for slot, new in enumerate(lengths):
                seconds = generation.generate_with(generate, rows, max_tokens=new).seconds
                best[name][slot] = min(best[name][slot], seconds)
    out = {}
    for name, seconds in best.items():
        slope = np.polyfit(lengths, seconds, 1)[0] if len(lengths) > 1 else float("nan")
        out[name] = len(rows) / slope if slope > 0 else float("nan")  # nan: lost in noise
    return out


def read_bandwidth(megabytes: int = 400, repeats: int = 5) -> float:
    """GB/s at which this machine reads memory in this run: the fastest of `repeats` passes over a float32 array
    of `megabytes` (more than any CPU cache here) by two XLA kernels, a sum along rows and a matrix-vector product
    (both cores read)."""
    import tensorflow as tf

    values = tf.ones([megabytes * 2**20 // 4], tf.float32)
    kernels = [tf.function(lambda x: tf.reduce_sum(tf.reshape(x, [16, -1]), axis=1), jit_compile=True),
               tf.function(lambda x: tf.linalg.matvec(tf.reshape(x, [-1, 1024]), tf.ones([1024])), jit_compile=True)]
    best = float("inf")
    for kernel in kernels:
        kernel(values).numpy()
        for _ in range(repeats):
            start = time.perf_counter()
            kernel(values).numpy()
            best = min(best, time.perf_counter() - start)
    return megabytes * 2**20 / best / 1e9


def ring_bytes(model, protocol, batch: int) -> int | None:
    """Bytes a decoding step reads at the least: each layer's keys and values of the ring (batch x (mem_len + 1)
    positions) and its position keys (shared by the rows), in the compute dtype. None where the loop does not
    decode in a ring (encodings without cached position keys)."""
    if not (model.encoding.position_keys_cached and model.supports_cache(protocol) and protocol.mem_len > 0):
        return None
    width = model.n_head * model.d_head * (2 if "16" in model.compute_dtype else 4)
    return model.n_layer * (protocol.mem_len + 1) * width * (2 * batch + 1)


def score_latency(score, state, batch, max_len, segments, n_token):
    """p50/p90/p99 ms of `score` calls of [batch, max_len] tokens with the state carried (one warm-up)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(2)
    times = []
    for index in range(segments + 1):
        tokens = tf.constant(rng.integers(0, n_token, [batch, max_len + 1]), tf.int32)
        start = time.perf_counter()
        nll, state = score(tokens[:, :-1], tokens[:, 1:], state)
        nll.numpy()
        if index:
            times.append(time.perf_counter() - start)
    return percentiles(times)


def main(argv):
    del argv
    import numpy as np
    import tensorflow as tf

    from txl_tf import export, generation
    from txl_tf.inference import Recurrent

    model, protocol, max_len, source = load_model()
    contexts, batches = [int(c) for c in FLAGS.contexts], [int(b) for b in FLAGS.batches]
    print(f"{source}; {model.count_params():,} parameters, {FLAGS.dtype}; protocol {protocol}, max_len {max_len}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    recurrent = Recurrent(model, protocol, max_len=max_len)
    with tempfile.TemporaryDirectory(prefix="txl_tf_bench_") as tmp:  # loaded into memory, then removed
        export.export_model(model, os.path.join(tmp, "saved"), protocol=protocol, max_len=max_len)
        loaded = tf.saved_model.load(os.path.join(tmp, "saved"))
    score_signature = loaded.signatures["score"]
    state_names = tuple(recurrent.initial_state(1).named())

    def served_score(tokens, targets, state):
        from txl_tf.state import from_named

        out = score_signature(tokens=tokens, targets=targets, **state.named())
        return out["nll"], from_named({name: out[name] for name in state_names})

    def served_initial(batch):
        from txl_tf.state import from_named

        out = loaded.signatures["initial_state"](batch_size=tf.constant(batch, tf.int32))
        return from_named({name: out[name] for name in state_names})

    paths = {
        "Python": (model_step(recurrent), recurrent.initial_state, recurrent.score,
                   generation.generator(model, protocol, max_len).generate),
        "SavedModel": (saved_model_step(loaded), served_initial, served_score, loaded.signatures["generate"]),
    }
    rng = np.random.default_rng(1)
    rows, score_rows = [], []
    for batch in batches:
        for context in contexts:
            prompt = rng.integers(0, model.n_token, [batch, context]).astype(np.int32)
            latencies = {}
            for name, (step, initial_state, _, _) in paths.items():
                log_probs, state = consume(step, prompt, initial_state(batch), max_len)
                latencies[name] = token_latency(step, state, log_probs, FLAGS.tokens)
            speeds = decode_speeds({name: path[3] for name, path in paths.items()}, prompt, FLAGS.tokens,
                                   FLAGS.repeats)
            for name, latency in latencies.items():
                rows.append((name, batch, context, latency, speeds[name]))
                print(f"{name:10s} batch {batch:3d} context {context:5d}: per token p50 {latency[0]:.2f} / p90 "
                      f"{latency[1]:.2f} / p99 {latency[2]:.2f} ms; decode loop {speeds[name]:,.0f} tokens/s",
                      flush=True)
        for name, (_, initial_state, score, _) in paths.items():
            latency = score_latency(score, initial_state(batch), batch, max_len, FLAGS.segments, model.n_token)
            score_rows.append((name, batch, latency))
            print(f"{name:10s} batch {batch:3d} scoring a segment of {max_len}: p50 {latency[0]:.1f} / p90 "
                  f"{latency[1]:.1f} / p99 {latency[2]:.1f} ms", flush=True)

    print(f"\nGeneration (mem_len {protocol.mem_len}; per-token latency of single calls, decode-loop throughput):\n")
    print("| path | batch | context | p50 ms | p90 ms | p99 ms | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, batch, context, (p50, p90, p99), speed in rows:
        print(f"| {name} | {batch} | {context} | {p50:.2f} | {p90:.2f} | {p99:.2f} | {speed:,.0f} |")
    print("\nRatios: SavedModel / Python tokens/s; per-token p50 at the longest context / at the shortest:\n")
    print("| batch | context | SavedModel / Python tokens/s |")
    print("|---:|---:|---:|")
    speeds = {(name, batch, context): speed for name, batch, context, _, speed in rows}
    p50 = {(name, batch, context): latency[0] for name, batch, context, latency, _ in rows}
    for batch in batches:
        for context in contexts:
            ratio = speeds["SavedModel", batch, context] / speeds["Python", batch, context]
            print(f"| {batch} | {context} | {ratio:.2f} |")
    for name in paths:
        for batch in batches:
            ratio = p50[name, batch, contexts[-1]] / p50[name, batch, contexts[0]]
            print(f"{name} batch {batch}: p50 at context {contexts[-1]} / at {contexts[0]} = {ratio:.2f}")
    bandwidth = read_bandwidth()
    print(f"\nDecoding bound by memory reads: a step reads at least the ring's keys and values (and the position "
          f"keys) of every layer once; this machine read {bandwidth:.1f} GB/s in this run (XLA kernels over 400 MB). "
          "A ring that fits in the CPU's last-level cache is read faster than this.\n")
    print("| batch | MB read per step | bound tokens/s |")
    print("|---:|---:|---:|")
    for batch in batches:
        size = ring_bytes(model, protocol, batch)
        if size is not None:
            print(f"| {batch} | {size / 1e6:,.3f} | {batch * bandwidth * 1e9 / size:,.0f} |")
    print(f"\nScoring a segment of {max_len} tokens with the state carried:\n")
    print("| path | batch | p50 ms | p90 ms | p99 ms | tokens/s at p50 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, batch, (p50_ms, p90_ms, p99_ms) in score_rows:
        print(f"| {name} | {batch} | {p50_ms:.1f} | {p90_ms:.1f} | {p99_ms:.1f} | "
              f"{batch * max_len / (p50_ms / 1000):,.0f} |")


if __name__ == "__main__":
    cli.run(main, define_flags)
