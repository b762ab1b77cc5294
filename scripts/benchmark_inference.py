"""Serving latency: per-token generation latency and tokens/s, and per-segment scoring latency, for the Python
model and its SavedModel, at batch 1 and 32 and at contexts from 100 tokens to the memory length; with --peer=gpt2,
keras-hub's GPT-2 of the same shape beside them.

    python scripts/benchmark_inference.py --model_dir=runs/sample --mem_len=2000 --contexts=100,500,1000,2000
    python scripts/benchmark_inference.py --arch=2,64,2,32,128 --n_token=50 --mem_len=64 --contexts=16,64
    python scripts/benchmark_inference.py --arch=4,192,4,48,768 --n_token=200 --peer=gpt2

The model is a trained run (--model_dir: its checkpoint and EvalConfig.tgt_len) or random weights of --arch.
The protocol is mem_len = --mem_len (or EvalConfig.mem_len), clamp_len from EvalConfig (-1 for --arch),
same_length off (generation's). The SavedModel is written by `txl_tf.export` into a temporary directory and
loaded back, so both paths serve the same weights with the same keys/values cache.

For every path, batch and context (a random prompt of that many tokens, consumed first):
  per-token latency: --tokens single-token calls, each from Python and waited for (the call, then a greedy pick
    on the host): p50 / p90 / p99 in ms. This is what a serving loop that returns every token sees.
  decode-loop tokens/s, greedy: rows x (N - 1) over the loop's time of N - 1 new tokens, the time of one call
    that generates N new tokens minus that of one that generates 1, so that the prompt's processing (the same
    work in both calls) cancels; the first calls of each shape (tracing, XLA compilation) are made before any
    timing. The Python path and GPT-2 are timed alike: keras-hub's generate function of the task compiled greedy
    (Transformer-XL: `TransformerXLCausalLM.around` the model, the `generate_step` that
    `txl_tf.lm.generation.Generator` runs; GPT-2: `GPT2CausalLM`, `jit_compile=True`), token ids context + N wide,
    the prompt first; the call of 1 new token is the same call stopped by keras-hub's stop check after its first
    token (the rows' first tokens as the stop tokens), so both calls read the same prompt into the same cache
    (Transformer-XL: the same ring, for min(mem_len, context + N) + 1 positions) and differ by N - 1 loop steps only.
    The SavedModel path: its `generate` signature (no stop tokens there), calls of N + context and 1 + context
    wide. N is --tokens, except where a Transformer-XL call's prompt takes more than half of that loop and the
    ring is the memory's whatever N is (context + --tokens >= mem_len: batch 32 at context 2,000, ~7 s of prompt
    against ~1 s of 63 tokens): then N is raised, from one pair timed after the compiling pair, until the loop
    takes about twice the prompt's time (at most --most_tokens), so that the calls' own variation (seconds there
    on a shared 2-core machine) does not decide the difference. Below the memory, N stays --tokens: a larger N
    would decode over a larger ring, a different cell. The line printed for each cell gives N and the median time
    of each call.
  --peer=gpt2: keras-hub's `GPT2CausalLM` with random weights and no preprocessor (built offline from a
    `GPT2Backbone` of --arch's layers, width, heads and feed-forward, --n_token tokens, dropout 0, positions for
    the longest context + --tokens), timed as above: its forward pass over the prompt runs over the whole padded
    width and every step attends over that width.
  Each of --repeats rounds times every path's pair of calls in turn, the paths taking turns so that a slow
  moment of a shared machine hits all; a short pair is timed again within its round until its calls take ~0.5 s
  (at most 9 pairs; the round's difference is that of the medians), and a round whose longer call was not the
  slower is timed again, up to 3 times; a cell is the median of its rounds, printed with their min and max.
  streaming (batch 1, the Python path): `Generator.stream` making --stream_tokens new tokens greedily,
    --stream_chunk a piece and then in pieces sized by time (the default: one token, then about
    sampling.PIECE_SECONDS each), one compiled call a piece with the decoding state kept between calls: the ms per
    token after the first piece (what a reader of the stream waits per token) against the decode loop's making
    as many new tokens after the same prompt (the same width and ring; timed as above).
Then the bound the machine's memory reads put on decoding (the ring's bytes per step over the read bandwidth
measured in the same run) beside the Python loop's tokens/s; at each batch timed at two or more contexts, the line
through the loop's seconds a step against its ring slots: its slope the ring's reads' rate (against the bandwidth
measured), its intercept what a step costs whatever the ring's size, which a share of the bound cannot go past;
beside it the same line through the ring's two batched products alone, timed at the same ring sizes (XLA's CPU
dot runs them one matrix-vector product a row and head, 2 x layers x batch x heads a step, each with its own
cost: at batch 32 about half of the step's intercept, 2026-12-02); and what the step's dense work (projections,
feed-forward, logits: `dense_flops`) costs at the matmul peak measured in the run (the share of the bound a step
that reads at the bandwidth can reach at most) and timed alone with the model's layers (`dense_seconds`). Then
per-segment scoring latency: --segments calls of `score` with max_len tokens and the state carried.
Timings are wall times of this process on this machine; only figures from one run compare.

Before 2026-11-28 a cell was the least-squares slope of the fastest of --repeats timings at each of 1, N / 2 + 1
and N new tokens, the fastest of each length taken from whichever round was fastest for it. At batch 32 and
context 2,000 a call is ~7 s of prompt (16 segments of 32 x 128 tokens) and ~1 s of loop, and the same call
varied by 0.1-3 s between repeats (7.1-9.4 s for 1 new token, 7.7-8.1 s for 64; the fastest call of 63 tokens
faster than that of 3): the slope measured the prompt's variation, 257 tokens/s in one run and 4,571 (above the
memory-read bound) in the next (issue 55). No retrace or cache hit: the compiling calls took 15-18 s, every
later call 7-10 s. A round now pairs its two calls, N grows where the prompt dominates, and the spread shows
what a cell's figure is worth. Until 2026-11-29 the Python path's pair was two `Generator.generate` calls of
1 + context and N + context positions with N raised at any context where the prompt outweighed the loop: at batch
1 and context 100 the prompt's ~55 ms (a memory of mem_len masked slots, since cut) raised N to 300-500 tokens by
one noisy pair's estimate, and the ring, and with it the step's cost, changed from run to run (4,666 and 7,610
tokens/s in two runs, issue 55). GPT-2's short call was the same width with N - 1 more prompt tokens.
"""

from __future__ import annotations

import os
import tempfile
import time

from absl import app, flags

# txl_tf.base.cli sets TF_CPP_MIN_LOG_LEVEL before TensorFlow is imported (lazily, in the functions).
from txl_tf.base import cli

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
    flags.DEFINE_integer("tokens", 64, "Single-token calls timed per cell (after 3 warm-up calls); new tokens of the "
                         "decode loop's longer call (>= 2).", flag_values=fv)
    flags.DEFINE_integer("segments", 10, "Scoring segments timed per cell (after one warm-up).", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "Rounds of decode-loop timings per cell: the median counts, min and max "
                         "printed.", flag_values=fv)
    flags.DEFINE_enum("dtype", "float32", ["float32", "mixed_bfloat16"], "Compute dtype.", flag_values=fv)
    flags.DEFINE_integer("most_tokens", 512, "Most new tokens of a Transformer-XL decode-loop call where the prompt "
                         "would outweigh --tokens' loop.", flag_values=fv)
    flags.DEFINE_integer("stream_chunk", 16, "New tokens per piece of the streamed generation timed at batch 1 "
                         "(`Generator.stream`), beside its default pieces sized by time.", flag_values=fv)
    flags.DEFINE_integer("stream_tokens", 256, "New tokens of each streamed generation (at least 2 x "
                         "--stream_chunk: one piece after the first).", flag_values=fv)
    # A string, as every script's --peer (tests/test_cli.py): the one value taken here is checked in main.
    flags.DEFINE_string("peer", None, "gpt2: also time keras-hub's GPT2CausalLM of --arch's shape (random weights, "
                        "built offline; not with --model_dir) and print the ratios.", flag_values=fv)


def load_model():
    """(model, Protocol, max_len, description)."""
    from txl_tf.model.protocol import Protocol

    if FLAGS.model_dir:
        from txl_tf.runs import loading

        dtype = None if FLAGS.dtype == "float32" else FLAGS.dtype
        model, configs, prefix = loading.load_model(FLAGS.model_dir, dtype=dtype)
        e = configs.eval
        protocol = Protocol(FLAGS.mem_len or e.mem_len, e.clamp_len, same_length=False)
        return model, protocol, e.tgt_len, prefix
    from txl_tf.model.transformer_xl import TransformerXL
    from txl_tf.runs.loading import dtype_policy

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

    from txl_tf.model.state import from_named

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


def txl_timer(generate, prompt):
    """(new, n) -> seconds of one `generate` call (the SavedModel's signature, greedy) making `new` tokens after
    `prompt` [B, P] (the prompt's processing included), `new` + P wide whatever `n`."""
    from txl_tf.lm import generation

    rows = [list(row) for row in prompt]
    return lambda new, n: generation.generate_with(generate, rows, max_tokens=new, temperature=0.0).seconds


def stop_timer(lm, prompt, n_token: int):
    """(new, n) -> seconds of one call of keras-hub's generate function of `lm` (a CausalLM compiled greedy: its
    tf.function) over token ids P + n wide, the prompt [B, P] first: making n new tokens (`new` = n), or the same
    call stopped by keras-hub's stop check after its first new token (`new` = 1: the rows' first new tokens are the
    stop tokens, the padding an id none of them is). Both calls read the same prompt into the same cache (the same
    ring), so their difference is n - 1 loop steps, less the stop check's few ops. Checked: the stopped call wrote
    one token a row."""
    import numpy as np
    import tensorflow as tf

    generate = lm.make_generate_function()
    batch, context = prompt.shape
    made = {}

    def call(inputs, stops):
        return generate(inputs, stop_token_ids=stops)["token_ids"].numpy()

    def inputs(n):
        if n not in made:
            token_ids = np.zeros([batch, context + n], np.int32)
            token_ids[:, :context] = prompt
            mask = np.zeros_like(token_ids, bool)
            mask[:, :context] = True
            first = call({"token_ids": tf.constant(token_ids), "padding_mask": tf.constant(mask)}, None)[:, context]
            stops = tuple(sorted(set(first.tolist())))
            pad = min(set(range(n_token)) - set(stops))
            token_ids[:, context:] = pad
            made[n] = ({"token_ids": tf.constant(token_ids), "padding_mask": tf.constant(mask)}, stops)
            stopped = call(*made[n])
            if not (np.array_equal(stopped[:, context], first) and (stopped[:, context + 1:] == pad).all()):
                raise RuntimeError("keras-hub's stop check did not end the call after one new token a row")
        return made[n]

    def run(new, n):
        x, stops = inputs(n)
        start = time.perf_counter()
        call(x, None if new == n else stops)
        return time.perf_counter() - start
    return run


def stream_timing(generator, prompt, tokens: int, chunk: int | None, repeats: int) -> tuple[list, list]:
    """([ms per token after the first piece, per round], [ms to the first piece, per round]) of `generator.stream`
    (greedy) making `tokens` new tokens after one prompt [P], `chunk` at a time (None: pieces sized by time); a
    first call compiles."""
    row = [int(x) for x in prompt]
    list(generator.stream(row, max_tokens=tokens, chunk=chunk, temperature=0.0))
    per_token, first = [], []
    for _ in range(repeats):
        start, stamps = time.perf_counter(), []
        for piece in generator.stream(row, max_tokens=tokens, chunk=chunk, temperature=0.0):
            stamps.append((time.perf_counter(), len(piece)))
        first.append(1000 * (stamps[0][0] - start))
        after = sum(count for _, count in stamps[1:])
        per_token.append(1000 * (stamps[-1][0] - stamps[0][0]) / after if after else float("nan"))
    return per_token, first


def gpt2_model(n_token: int, sequence_length: int):
    """keras-hub's GPT2CausalLM of --arch's shape, random weights, no preprocessor, greedy under XLA."""
    import keras_hub

    n_layer, d_model, n_head, _, d_inner = (int(x) for x in FLAGS.arch.split(","))
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=n_token, num_layers=n_layer, num_heads=n_head,
                                             hidden_dim=d_model, intermediate_dim=d_inner, dropout=0.0,
                                             max_sequence_length=sequence_length, dtype=FLAGS.dtype)
    lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    lm.compile(sampler="greedy", jit_compile=True)
    return lm


RETRIES = 3  # times a decode-loop round lost in noise is timed again (`decode_speeds`)
ROUND_SECONDS = 0.5  # a round times a path's pair of calls again until its calls take about this long
MOST_PAIRS = 9  # and at most this many times


def decode_speeds(timers: dict, rows: int, tokens: int, repeats: int, most: int) -> tuple[dict, dict]:
    """({name: [tokens/s of each round]}, {name: (N, median seconds of the calls making 1, making N)}): rows x
    (N - 1) over the time of a call making N new tokens minus that of one making 1. `timers`: name -> ((new, N) ->
    seconds, whether N may grow). N is `tokens`, or where it may grow (where the ring is the memory's whatever N
    is) and a call's prompt takes more than half its loop (estimated from one pair after the compiling pair),
    enough tokens for the loop to take twice the prompt's time, at most `most`: the difference of two calls is then
    mostly loop, not the prompt's variation between calls. The paths take turns in every round so that a slow
    moment of a shared machine hits all of them, the order of a pair alternating. Where a pair is short (batch 1 at
    context 100: ~60 ms, its 63 steps ~20 ms of it), a round times it again, up to `MOST_PAIRS` times, until its
    calls take `ROUND_SECONDS`, and its difference is that of the medians of its short and of its long calls: one
    slow call no longer makes the round (2026-12-02: a cell of single pairs spread 1,292-4,593 tokens/s). A round
    whose difference is not positive (the calls' noise larger than their N - 1 steps: a tiny model on a busy
    machine) is timed again, up to `RETRIES` times, then counts as nan."""
    import math

    import numpy as np

    lengths, pairs = {}, {}
    for name, (run, grows) in timers.items():
        run(1, tokens), run(tokens, tokens)  # tracing and compiling
        short, long = run(1, tokens), run(tokens, tokens)
        new = tokens
        if grows:
            step = (long - short) / (tokens - 1)
            wanted = most if step <= 0 else math.ceil(2 * short / step) + 1
            new = max(tokens, min(most, wanted))
            if new > tokens:
                run(1, new), run(new, new)  # compiling the longer calls
                short, long = run(1, new), run(new, new)
        lengths[name] = new
        pairs[name] = max(1, min(MOST_PAIRS, math.ceil(ROUND_SECONDS / max(short + long, 1e-9))))
    rates = {name: [] for name in timers}
    calls = {name: [] for name in timers}
    for round_ in range(repeats):
        for name, (run, _) in timers.items():
            new = lengths[name]
            for _ in range(1 + RETRIES):
                shorts, longs = [], []
                for k in range(pairs[name]):
                    if (round_ + k) % 2:  # the order alternates: what one call leaves behind for the next
                        shorts.append(run(1, new))
                        longs.append(run(new, new))
                    else:
                        longs.append(run(new, new))
                        shorts.append(run(1, new))
                short, long = float(np.median(shorts)), float(np.median(longs))
                if long > short:
                    break
            calls[name].append((short, long))
            rates[name].append(rows * (new - 1) / (long - short) if long > short else float("nan"))
    return rates, {name: (lengths[name], *np.median(np.asarray(pairs), axis=0)) for name, pairs in calls.items()}


def spread(rates) -> tuple:
    """(median, min, max) of a cell's rounds (nan-free; all nan where every round was lost in noise)."""
    import numpy as np

    finite = np.asarray([r for r in rates if np.isfinite(r)])
    if not finite.size:
        return (float("nan"),) * 3
    return float(np.median(finite)), float(finite.min()), float(finite.max())


def cell(rates) -> str:
    """'median (min-max)' tokens/s of a cell's rounds."""
    median, low, high = spread(rates)
    return f"{median:,.0f} ({low:,.0f}-{high:,.0f})"


def ratio_cell(ratios) -> str:
    """'median x (min-max)' of a cell's per-round ratios (nan where a round was lost in noise)."""
    median, low, high = spread(ratios)
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


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


def ring_slots(protocol, positions: int | None = None) -> int:
    """The ring's slots for a generation that ends at `positions` (prompt and new tokens): min(mem_len,
    positions) + 1, generation's memory starting empty: the positions a step attends to (the greedy loop's ring,
    `TransformerXLCausalLM._block_decode`, has that many rounded up to a multiple of its block, and reads the
    block's side buffer too: the bound counts what a step must read); None: mem_len + 1."""
    return (protocol.mem_len if positions is None else min(protocol.mem_len, positions)) + 1


def ring_bytes(model, protocol, batch: int, positions: int | None = None) -> int | None:
    """Bytes a decoding step reads at the least: each layer's keys and values of the ring (batch x `ring_slots`
    positions) and its position keys (shared by the rows), in the compute dtype. None where the loop does not
    decode in a ring (encodings without cached position keys)."""
    if not (model.encoding.position_keys_cached and model.supports_cache(protocol) and protocol.mem_len > 0):
        return None
    width = model.n_head * model.d_head * (2 if "16" in model.compute_dtype else 4)
    return model.n_layer * ring_slots(protocol, positions) * width * (2 * batch + 1)


def ring_fits(model, protocol, ring_rows) -> list:
    """(batch, fixed seconds, seconds a slot, bytes a second of the slots' reads, the fixed cost's share of the
    longest ring's step) per batch whose contexts gave rings of at least two sizes: the least-squares line through
    (ring slots, the Python loop's median seconds a step). Where a step's cost grows with the ring only through
    its reads, the slope is their rate; the intercept is the rest of the step. Cells lost in noise are left out."""
    import numpy as np

    fits = []
    for batch in sorted({row[0] for row in ring_rows}):
        points = []
        for _, _, positions, rates in (row for row in ring_rows if row[0] == batch):
            median, size = spread(rates)[0], ring_bytes(model, protocol, batch, positions)
            if size is not None and np.isfinite(median) and median > 0:
                points.append((ring_slots(protocol, positions), batch / median, size))
        if len({slots for slots, _, _ in points}) < 2:
            continue
        slots, seconds, sizes = (np.asarray(column, float) for column in zip(*points, strict=True))
        per_slot, fixed = np.polyfit(slots, seconds, 1)
        longest = int(np.argmax(slots))
        rate = sizes[longest] / slots[longest] / per_slot if per_slot > 0 else float("nan")
        fits.append((batch, float(fixed), float(per_slot), float(rate), float(fixed / seconds[longest])))
    return fits


def ring_products(model, batch: int, slots: int, steps: int = 32, repeats: int = 5) -> float:
    """Median seconds a step of the ring's two products alone, as the block loop's step runs them
    (`decode_block`): every layer's scores of one query a row and head against the ring's keys [B, N, D, S], a
    softmax, and the values [B, N, D, S] weighted by it; in an XLA loop of `steps` steps (random numbers in the
    compute dtype, each layer's own ring, one warm-up)."""
    import tensorflow as tf

    dtype = model.compute_dtype
    shape = [batch, model.n_head, model.d_head, slots]
    rings = [(tf.random.normal(shape, dtype=dtype), tf.random.normal(shape, dtype=dtype))
             for _ in range(model.n_layer)]

    def body(i, q):
        for keys, values in rings:
            probs = tf.cast(tf.nn.softmax(tf.cast(tf.matmul(q, keys), tf.float32), axis=-1), dtype)
            q = tf.matmul(probs, values, transpose_b=True) * tf.cast(0.01, dtype)  # [B, N, 1, D]
        return i + 1, q

    return loop_seconds(body, tf.random.normal([batch, model.n_head, 1, model.d_head], dtype=dtype), steps,
                        repeats)


def loop_seconds(body, start, steps: int, repeats: int) -> float:
    """Median seconds a step of `body(i, x) -> (i + 1, x)` from `start` in an XLA while loop of `steps` steps,
    over `repeats` timed loops (one warm-up)."""
    import numpy as np
    import tensorflow as tf

    loop = tf.function(lambda x: tf.while_loop(lambda i, x: i < steps, body, (0, x))[1], jit_compile=True)
    loop(start).numpy()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        loop(start).numpy()
        times.append((time.perf_counter() - began) / steps)
    return float(np.median(times))


def product_fits(model, protocol, fits, ring_rows) -> dict:
    """{batch: (fixed seconds, seconds a slot)} of the ring's products alone (`ring_products`) at the ring sizes
    of each batch `ring_fits` drew a line for: the same line through their medians, so the step's fixed cost
    splits into the products' own and the rest."""
    import numpy as np

    out = {}
    for batch in (fit[0] for fit in fits):
        slots = sorted({ring_slots(protocol, row[2]) for row in ring_rows if row[0] == batch})
        seconds = [ring_products(model, batch, s) for s in slots]
        per_slot, fixed = np.polyfit(np.asarray(slots, float), np.asarray(seconds, float), 1)
        out[batch] = (float(fixed), float(per_slot))
    return out


def dense_flops(model, batch: int) -> int:
    """Matmul FLOPs a decoding step does besides reading the ring: every layer's projections of the new token (q,
    k, v, output) and feed-forward, the embedding's and the softmax's products (`forward_flops_per_segment` of a
    one-token segment with no memory: its scores against the token itself are a few FLOPs a head)."""
    from txl_tf.model import flops

    return flops.forward_flops_per_segment(**{**model.get_config(), "tgt_len": 1, "mem_len": 0,
                                              "batch_size": batch})


def dense_seconds(model, batch: int, steps: int = 32, repeats: int = 5) -> float:
    """Median seconds a step of the dense work alone (`dense_flops`), as the decoding step runs it with the
    model's own layers: the token's embedding, every layer's query and key/value projections, its output
    projection and residual (`_decoded`, the heads' values replaced by the projections: no ring read) and
    feed-forward, the log-probabilities and a greedy pick; at batch 1 through the layers' row kernels
    (`projection.dense_row`), as batch 1's ring step; in an XLA loop of `steps` steps (one warm-up)."""
    import tensorflow as tf

    from txl_tf.model.projection import dense_row

    rows = [(block.attention.row_kernels(), block.feed_forward.row_kernels()) if batch == 1 else (None, None)
            for block in model.blocks]

    def body(i, token):
        h = model.embedding(token)  # [B, 1, d]
        for block, (attention_rows, feed_forward_rows) in zip(model.blocks, rows, strict=True):
            attention = block.attention
            h_in = attention.layer_norm(h) if attention.pre_lnorm else h
            if attention_rows is None:
                queries, keys_values = attention._queries(h_in), attention._keys_values(h_in)
            else:
                queries, keys_values = dense_row(h_in, attention_rows[0]), dense_row(h_in, attention_rows[1])
            keys, values = tf.split(keys_values, 2, axis=-1)  # all used: XLA drops dead work
            heads = tf.reshape(queries + keys + values, [batch, attention.n_head, 1, attention.d_head])
            h = attention._decoded(h, heads, attention_rows)
            h = (block.feed_forward(h) if feed_forward_rows is None else
                 block.feed_forward.decode_row(h, feed_forward_rows))
        return i + 1, tf.argmax(model.log_probs(h), axis=-1, output_type=tf.int32)  # [B, 1]

    return loop_seconds(body, tf.zeros([batch, 1], tf.int32), steps, repeats)


def ceilings(model, protocol, fits, ring_rows, bandwidth: float, peak: float) -> list:
    """(batch, slots, bound seconds, dense FLOPs, dense seconds at `peak`, the most of the bound a step can reach)
    at each fitted batch's longest ring: a step that reads the ring at `bandwidth` and does its dense work
    (`dense_flops`) at the matmul `peak`, one after the other, takes bound + dense seconds, so it reaches at most
    bound / (bound + dense) of the memory-read bound, whatever the kernel that reads the ring."""
    out = []
    for batch in (fit[0] for fit in fits):
        positions = max(row[2] for row in ring_rows if row[0] == batch)
        size = ring_bytes(model, protocol, batch, positions)
        bound, work = size / (bandwidth * 1e9), dense_flops(model, batch)
        out.append((batch, ring_slots(protocol, positions), bound, work, work / peak, bound / (bound + work / peak)))
    return out


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

    from txl_tf import export
    from txl_tf.configs import EvalConfig
    from txl_tf.lm import generation
    from txl_tf.lm.hub import TransformerXLCausalLM
    from txl_tf.lm.sampling import PIECE_SECONDS
    from txl_tf.model.inference import Recurrent

    model, protocol, max_len, source = load_model()
    contexts, batches = [int(c) for c in FLAGS.contexts], [int(b) for b in FLAGS.batches]
    if FLAGS.tokens < 2:
        raise app.UsageError("--tokens must be at least 2 (the decode loop: N new tokens against 1)")
    if FLAGS.stream_chunk < 1 or FLAGS.stream_tokens < 2 * FLAGS.stream_chunk:
        raise app.UsageError(f"--stream_tokens={FLAGS.stream_tokens} must be at least 2 x --stream_chunk="
                             f"{FLAGS.stream_chunk} (>= 1): the streamed ms a token are timed after the first piece")
    if FLAGS.peer not in (None, "gpt2"):
        raise app.UsageError(f"--peer={FLAGS.peer}: the peer this benchmark builds is gpt2 (keras-hub's GPT2CausalLM)")
    if FLAGS.peer and FLAGS.model_dir:
        raise app.UsageError("--peer=gpt2 builds GPT-2 of --arch's shape: not with --model_dir")
    gpt2 = gpt2_model(model.n_token, max(contexts) + FLAGS.tokens) if FLAGS.peer else None
    if gpt2 is not None:
        print(f"GPT-2 (keras-hub GPT2CausalLM, greedy, XLA): {gpt2.count_params():,} parameters, "
              f"{max(contexts) + FLAGS.tokens} positions", flush=True)
    print(f"{source}; {model.count_params():,} parameters, {FLAGS.dtype}; protocol {protocol}, max_len {max_len}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    recurrent = Recurrent(model, protocol, max_len=max_len)
    with tempfile.TemporaryDirectory(prefix="txl_tf_bench_") as tmp:  # loaded into memory, then removed
        export.export_model(model, os.path.join(tmp, "saved"), protocol=protocol, max_len=max_len)
        loaded = tf.saved_model.load(os.path.join(tmp, "saved"))
    score_signature = loaded.signatures["score"]
    state_names = tuple(recurrent.initial_state(1).named())

    def served_score(tokens, targets, state):
        from txl_tf.model.state import from_named

        out = score_signature(tokens=tokens, targets=targets, **state.named())
        return out["nll"], from_named({name: out[name] for name in state_names})

    def served_initial(batch):
        from txl_tf.model.state import from_named

        out = loaded.signatures["initial_state"](batch_size=tf.constant(batch, tf.int32))
        return from_named({name: out[name] for name in state_names})

    python_generator = generation.generator(model, protocol, max_len)
    # The Python path's decode loop: the keras-hub task's generate function, as GPT-2's (the same generate_step
    # as python_generator's, whose checks and sampler switch it leaves out)
    hub_lm = TransformerXLCausalLM.around(model, EvalConfig(tgt_len=max_len, mem_len=protocol.mem_len,
                                                            clamp_len=protocol.clamp_len, same_length=False))
    hub_lm.compile(sampler="greedy")
    paths = {
        "Python": (model_step(recurrent), recurrent.initial_state, recurrent.score),
        "SavedModel": (saved_model_step(loaded), served_initial, served_score),
    }
    rng = np.random.default_rng(1)
    rows, score_rows, peer_rows, stream_rows, ring_rows = [], [], [], [], []
    for batch in batches:
        for context in contexts:
            prompt = rng.integers(0, model.n_token, [batch, context]).astype(np.int32)
            latencies = {}
            for name, (step, initial_state, _) in paths.items():
                log_probs, state = consume(step, prompt, initial_state(batch), max_len)
                latencies[name] = token_latency(step, state, log_probs, FLAGS.tokens)
            grows = context + FLAGS.tokens >= protocol.mem_len  # the ring is the memory's whatever N
            timers = {"Python": (stop_timer(hub_lm, prompt, model.n_token), grows),
                      "SavedModel": (txl_timer(loaded.signatures["generate"], prompt), grows)}
            if gpt2 is not None:
                timers["GPT-2"] = (stop_timer(gpt2, prompt, model.n_token), False)
            speeds, calls = decode_speeds(timers, batch, FLAGS.tokens, FLAGS.repeats, FLAGS.most_tokens)
            # The long call's last position, and the Python loop's rounds (against the bound below)
            ring_rows.append((batch, context, context + calls["Python"][0], speeds["Python"]))

            loop = {name: f"decode loop {cell(speeds[name])} tokens/s (a call of 1 / {calls[name][0]} new tokens: "
                          f"{calls[name][1]:.3f} / {calls[name][2]:.3f} s)" for name in speeds}
            for name, latency in latencies.items():
                rows.append((name, batch, context, latency, speeds[name]))
                print(f"{name:10s} batch {batch:3d} context {context:5d}: per token p50 {latency[0]:.2f} / p90 "
                      f"{latency[1]:.2f} / p99 {latency[2]:.2f} ms; {loop[name]}", flush=True)
            if batch == 1:
                tokens = FLAGS.stream_tokens
                # The loop the stream is read against makes the stream's new tokens after the same prompt: the same
                # width, the same ring (at context 100 the loop of --tokens=64 reads 165 slots, a stream of 256
                # tokens 357, and a step over the wider ring cost 1.5x as much on an Intel Xeon with AMX)
                stream_loop = speeds["Python"]
                if tokens != FLAGS.tokens:
                    same_width = {"Python": (stop_timer(hub_lm, prompt, model.n_token),
                                             context + tokens >= protocol.mem_len)}
                    stream_loop = decode_speeds(same_width, 1, tokens, FLAGS.repeats,
                                                max(tokens, FLAGS.most_tokens))[0]["Python"]
                for chunk in (FLAGS.stream_chunk, None):
                    per_token, first = stream_timing(python_generator, prompt[0], tokens, chunk, FLAGS.repeats)
                    pieces = "by time" if chunk is None else str(chunk)
                    stream_rows.append((context, pieces, tokens, per_token, first, stream_loop))
                    print(f"{'stream':10s} batch   1 context {context:5d}: {spread(per_token)[0]:.3f} ms a token "
                          f"after the first piece, pieces of {pieces} ({spread(first)[0]:.1f} ms to it); the loop making "
                          f"{tokens}: {1000 / spread(stream_loop)[0]:.3f} ms a token", flush=True)
            if gpt2 is not None:
                peer_rows.append((batch, context, speeds["GPT-2"], speeds["Python"], speeds["SavedModel"]))
                print(f"{'GPT-2':10s} batch {batch:3d} context {context:5d}: {loop['GPT-2']}", flush=True)
        for name, (_, initial_state, score) in paths.items():
            latency = score_latency(score, initial_state(batch), batch, max_len, FLAGS.segments, model.n_token)
            score_rows.append((name, batch, latency))
            print(f"{name:10s} batch {batch:3d} scoring a segment of {max_len}: p50 {latency[0]:.1f} / p90 "
                  f"{latency[1]:.1f} / p99 {latency[2]:.1f} ms", flush=True)

    print(f"\nGeneration (mem_len {protocol.mem_len}; per-token latency of single calls; decode-loop tokens/s, "
          f"greedy: the median (min-max) of {FLAGS.repeats} rounds; the loop's new tokens in the lines above):\n")
    print("| path | batch | context | p50 ms | p90 ms | p99 ms | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, batch, context, (p50, p90, p99), speed in rows:
        print(f"| {name} | {batch} | {context} | {p50:.2f} | {p90:.2f} | {p99:.2f} | {cell(speed)} |")
    print("\nRatios: SavedModel / Python tokens/s; per-token p50 at the longest context / at the shortest:\n")
    print("| batch | context | SavedModel / Python tokens/s |")
    print("|---:|---:|---:|")
    speeds = {(name, batch, context): spread(speed)[0] for name, batch, context, _, speed in rows}
    p50 = {(name, batch, context): latency[0] for name, batch, context, latency, _ in rows}
    for batch in batches:
        for context in contexts:
            ratio = speeds["SavedModel", batch, context] / speeds["Python", batch, context]
            print(f"| {batch} | {context} | {ratio:.2f} |")
    for name in paths:
        for batch in batches:
            ratio = p50[name, batch, contexts[-1]] / p50[name, batch, contexts[0]]
            print(f"{name} batch {batch}: p50 at context {contexts[-1]} / at {contexts[0]} = {ratio:.2f}")
    if peer_rows:
        print("\nAgainst keras-hub's GPT-2 of the same shape (GPT2CausalLM, greedy, XLA), decode-loop tokens/s, "
              f"the median (min-max) of {FLAGS.repeats} rounds; ratio: Transformer-XL's tokens/s over GPT-2's in the "
              "same round (their calls timed one after the other), the median (min-max) over the rounds: a drift of "
              "the machine between runs moves both models' figures, less their ratio:\n")
        print("| batch | context | GPT-2 | Transformer-XL Python | Transformer-XL SavedModel | ratio Python | "
              "ratio SavedModel |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for batch, context, peer, python, saved in peer_rows:
            ratios = [ratio_cell([ours / theirs for ours, theirs in zip(path, peer, strict=True)])
                      for path in (python, saved)]
            print(f"| {batch} | {context} | {cell(peer)} | {cell(python)} | {cell(saved)} | {ratios[0]} | "
                  f"{ratios[1]} |")
    if stream_rows:
        print(f"\nStreaming at batch 1 (`Generator.stream`, greedy, {FLAGS.stream_chunk} new tokens a piece, then "
              f"pieces sized by time, the default: one token, then about {PIECE_SECONDS * 1000:.0f} ms each; one "
              "compiled call per piece, the state kept between calls): ms per token after the first piece and to the "
              f"first piece (the prompt and one piece), the median (min-max) of {FLAGS.repeats} rounds, against the "
              "decode loop's ms per token making the stream's new tokens after the same prompt (1,000 / the Python "
              "path's median tokens/s, timed as above with N = the new tokens):\n")
        print("| context | pieces | new tokens | streamed ms/token | first piece ms | loop ms/token | streamed / loop |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for context, pieces, tokens, per_token, first, loop in stream_rows:
            median, low, high = spread(per_token)
            loop_ms = 1000 / spread(loop)[0]
            first_median, first_low, first_high = spread(first)
            print(f"| {context} | {pieces} | {tokens} | {median:.3f} ({low:.3f}-{high:.3f}) | {first_median:.1f} "
                  f"({first_low:.1f}-{first_high:.1f}) | {loop_ms:.3f} | {median / loop_ms:.2f}x |")
    bandwidth = read_bandwidth()
    print(f"\nDecoding bound by memory reads: a step reads at least the ring's keys and values (and the position "
          f"keys) of every layer once; this machine read {bandwidth:.1f} GB/s in this run (XLA kernels over 400 MB). "
          "The ring of the decode loop's longer call: min(mem_len, context + its new tokens) + 1 slots (generation's "
          "memory starts empty). A ring that fits in the CPU's last-level cache is read faster than this.\n")
    print("| batch | context | ring slots | MB read per step | bound tokens/s | Python loop tokens/s | of the bound |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch, context, positions, rates in ring_rows:
        size = ring_bytes(model, protocol, batch, positions)
        if size is not None:
            bound = batch * bandwidth * 1e9 / size
            print(f"| {batch} | {context} | {ring_slots(protocol, positions):,} | {size / 1e6:,.3f} | {bound:,.0f} | "
                  f"{cell(rates)} | {spread(rates)[0] / bound:.0%} |")
    fits = ring_fits(model, protocol, ring_rows)
    if fits:
        products = product_fits(model, protocol, fits, ring_rows)
        print("\nThe Python loop's step against its ring (least squares over the contexts' medians: a step's seconds "
              "= fixed + per slot x ring slots): the per-slot cost is the reads' rate, the fixed cost what a step "
              "spends whatever the ring's size. Beside it the same line through the ring's two products alone "
              "(`ring_products`: scores and weighted values, every layer, in an XLA loop): XLA's CPU dot runs a "
              "batched product as one small matrix-vector product a row and head, so part of the fixed cost is "
              "theirs; the rest is the layers' own products, the small ops and the sampler:\n")
        print("| batch | fixed ms a step | us a ring slot | reads at GB/s | of the measured bandwidth | "
              "fixed share of the longest ring's step | products alone: fixed ms, us a slot | fixed ms not theirs |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for batch, fixed, per_slot, rate, share in fits:
            own_fixed, own_slot = products[batch]
            print(f"| {batch} | {fixed * 1e3:.2f} | {per_slot * 1e6:.3f} | {rate / 1e9:.1f} | "
                  f"{rate / 1e9 / bandwidth:.0%} | {share:.0%} | {own_fixed * 1e3:.2f}, {own_slot * 1e6:.3f} | "
                  f"{(fixed - own_fixed) * 1e3:.2f} |")
        from txl_tf.model.flops import measure_matmul_peak

        peak = measure_matmul_peak(model.compute_dtype, jit_compile=True)
        print(f"\nThe ceiling a step's other work puts on the share of the bound (issue 55's goal: 90% at batch 32): "
              f"a step also does its dense work (the new token's projections and feed-forward, the logits), "
              f"compute-bound; at the {model.compute_dtype} matmul peak measured in this run ({peak / 1e9:.1f} "
              "GFLOP/s, XLA, 2048-square products) it takes the time below. A step that reads the ring at the "
              "measured bandwidth and then does that work at the peak reaches at most bound / (bound + dense) of "
              "the bound; beside it the fit's fixed cost, what the loop's step spends besides the ring now, and the "
              "dense work timed alone with the model's layers (XLA's kernels of these small products run well below "
              "the peak):\n")
        print("| batch | ring slots | bound ms a step | dense MFLOP a step | dense ms at the peak | at most of the "
              "bound | fixed ms a step (fit) | dense work alone, ms (`dense_seconds`) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for (batch, slots, bound, work, seconds, most), fit in zip(
                ceilings(model, protocol, fits, ring_rows, bandwidth, peak), fits, strict=True):
            print(f"| {batch} | {slots:,} | {bound * 1e3:.2f} | {work / 1e6:.1f} | {seconds * 1e3:.2f} | {most:.0%} | "
                  f"{fit[1] * 1e3:.2f} | {dense_seconds(model, batch) * 1e3:.2f} |")
    print(f"\nScoring a segment of {max_len} tokens with the state carried:\n")
    print("| path | batch | p50 ms | p90 ms | p99 ms | tokens/s at p50 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, batch, (p50_ms, p90_ms, p99_ms) in score_rows:
        print(f"| {name} | {batch} | {p50_ms:.1f} | {p90_ms:.1f} | {p99_ms:.1f} | "
              f"{batch * max_len / (p50_ms / 1000):,.0f} |")


if __name__ == "__main__":
    cli.run(main, define_flags)
