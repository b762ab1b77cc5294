"""Generation (`txl_tf.lm.generation`, keras-hub's loop): deterministic under a seed, greedy equals a step-by-step
oracle, a batch of prompts of different lengths continues each as alone, top-k and top-p through keras-hub's
sampler, and the SavedModel's, the command line's and the Python path's text are the same."""

import itertools
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from train_utils import REPO_ROOT, prepare_tiny_corpus, run_training, subprocess_env, tiny_params

from txl_tf import export
from txl_tf.configs import ModelConfig
from txl_tf.lm import generation
from txl_tf.model.protocol import Protocol

N_TOKEN = 11
PROMPT = np.array([[1, 4, 2, 7, 3], [5, 0, 9, 9, 6]], np.int32)  # [B=2, P=5]


@pytest.fixture(scope="module")
def model():
    tf.keras.utils.set_random_seed(3)
    return ModelConfig(n_layer=2, d_model=10, n_head=2, d_head=5, d_inner=14, dropout=0.0, dropatt=0.0,
                       mem_len=9).build(N_TOKEN)


def _generate(model, **kwargs):
    args = dict(max_tokens=6, temperature=1.0, top_k=0, seed=0, segment_len=3)
    return generation.generate_from_model(model, PROMPT, **{**args, **kwargs})


def test_same_seed_same_tokens(model):
    first = _generate(model, seed=42, temperature=1.5)
    again = _generate(model, seed=42, temperature=1.5)
    other = _generate(model, seed=43, temperature=1.5)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert first.tokens.shape == (2, 6) and first.tokens.dtype == np.int32
    assert not np.array_equal(first.tokens, other.tokens)
    assert first.tokens_per_second > 0


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_greedy_matches_step_by_step_oracle(model):
    result = _generate(model, temperature=0.0)
    # Oracle: plain model calls; the prompt in segments of 3, then one token per call with memory, the memory
    # empty at first (each call attends to the positions before it: `memory_lengths`; it keeps 9).
    read = lambda n: np.full([2], n, np.int32)  # noqa: E731
    hidden, mems = model(PROMPT[:, :3], model.initial_memory(2), memory_lengths=read(0))
    hidden, mems = model(PROMPT[:, 3:], mems, memory_lengths=read(3))
    expected = []
    for step in range(6):
        token = np.argmax(model.log_probs(hidden[:, -1:]).numpy()[:, 0], axis=-1).astype(np.int32)
        expected.append(token)
        hidden, mems = model(token[:, None], mems, memory_lengths=read(5 + step))
    np.testing.assert_array_equal(result.tokens, np.stack(expected, axis=1))
    np.testing.assert_array_equal(_generate(model, top_k=1, seed=5).tokens, result.tokens)
    np.testing.assert_array_equal(_generate(model, top_p=1e-6, seed=5).tokens, result.tokens)


@pytest.mark.slow  # ~26 s: each prompt generated alone and in the batch; CI's slow phase
def test_prompts_of_different_lengths_continue_as_alone(model):
    """Each prompt of a batch (7, 2 and 4 tokens, right-padded) gets the greedy continuation it gets alone."""
    prompts = [[1, 4, 2, 7, 3, 8, 8], [5, 0], [9, 9, 6, 2]]
    batch = generation.generate_from_model(model, prompts, max_tokens=5, temperature=0.0, segment_len=3)
    for row, prompt in enumerate(prompts):
        alone = generation.generate_from_model(model, [prompt], max_tokens=5, temperature=0.0, segment_len=3)
        np.testing.assert_array_equal(batch.tokens[row], alone.tokens[0])


def _draws(seeds=8, **settings):
    """The tokens keras-hub's top-p sampler (`generation.Sampling`) draws for 256 rows of probabilities 0.1, 0.5,
    0.15, 0.25, under each of `seeds` seeds."""
    sampling = generation.Sampling()
    logits = tf.math.log(tf.constant([[0.1, 0.5, 0.15, 0.25]] * 256))
    draws = set()
    for seed in range(seeds):
        sampling.set(settings.get("temperature", 1.0), settings.get("top_k", 0), settings.get("top_p", 1.0), seed)
        draws |= set(sampling.get_next_token(sampling.compute_probabilities(logits)).numpy().tolist())
    return draws


@pytest.mark.parametrize("settings", [{}, {"top_k": 4}, {"top_p": 0.999}, {"top_k": 3, "top_p": 0.95}])
def test_draws_follow_the_probabilities_with_and_without_the_sort(settings):
    """Without top_k or top_p (or top_k = the vocabulary) a token is drawn from the probabilities as they are,
    without sorting them; top_p < 1 goes through keras-hub's sorted nucleus, top_k < V through the renormalised
    mask. Each way, 4,096 draws follow the distribution (5 standard deviations)."""
    sampling = generation.Sampling()
    probabilities = np.array([0.1, 0.5, 0.15, 0.25])
    if settings.get("top_k") == 3:
        probabilities = np.array([0.0, 0.5, 0.15, 0.25]) / 0.9  # 0.1 is outside the top 3; 0.95 keeps the rest
    logits = tf.math.log(tf.constant([[0.1, 0.5, 0.15, 0.25]] * 512))
    counts = np.zeros(4)
    for seed in range(8):
        sampling.set(1.0, settings.get("top_k", 0), settings.get("top_p", 1.0), seed)
        counts += np.bincount(sampling.get_next_token(sampling.compute_probabilities(logits)).numpy(), minlength=4)
    expected = probabilities * counts.sum()
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected * (1 - probabilities)) + 1e-9), (counts, expected)


def test_a_draw_never_picks_a_token_of_zero_probability():
    """Zeros before, between and after the tokens that have probability (a softmax that underflowed)."""
    sampling = generation.Sampling()
    probabilities = tf.constant([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]] * 512 + [[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]] * 8)
    for seed in range(4):
        sampling.set(1.0, 0, 1.0, seed)
        tokens = sampling.get_next_token(probabilities).numpy()
        assert set(tokens[:512].tolist()) == {1, 3} and set(tokens[512:].tolist()) == {5}


def test_top_k_restricts_choices():
    assert _draws(top_k=2) == {1, 3}
    assert _draws(top_k=0) == {0, 1, 2, 3}


# Every p sits at least 0.04 from the cumulative probabilities 0.5, 0.75 and 0.9: at a boundary (p = 0.5) whether
# the boundary token is kept depends on the softmax's last bit, which differs between CPUs' vector paths.
@pytest.mark.parametrize("top_p,allowed", [(0.3, {1}), (0.46, {1}), (0.54, {1, 3}), (0.71, {1, 3}),
                                           (0.79, {1, 3, 2}), (0.86, {1, 3, 2}), (0.94, {1, 3, 2, 0}),
                                           (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, allowed):
    """Probabilities 0.5, 0.25, 0.15, 0.1 (cumulative 0.5, 0.75, 0.9, 1): the nucleus holds the likeliest tokens
    up to the one crossing p."""
    assert _draws(top_p=top_p) == allowed


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_saved_model_gives_the_python_text(model, tmp_path):
    """The SavedModel's `generate` signature is the Python generator's function: the same tokens, greedy and
    sampled, for prompts of different lengths, and for one prompt (the signature's batch is unknown: one row
    takes the loop traced for one row, `Generator._checked`)."""
    protocol = Protocol(mem_len=9)
    export.export_model(model, str(tmp_path / "saved"), protocol=protocol, max_len=3)
    loaded = tf.saved_model.load(str(tmp_path / "saved"))
    for prompts, settings in itertools.product(
            ([[1, 4, 2, 7, 3], [5, 0]], [[1, 4, 2, 7, 3]]),
            (dict(temperature=0.0), dict(temperature=1.3, top_k=5, top_p=0.9, seed=4))):
        served = generation.generate_with(loaded.signatures["generate"], prompts, max_tokens=7, **settings)
        python = generation.generate_from_model(model, prompts, max_tokens=7, protocol=protocol, segment_len=3,
                                                **settings)
        np.testing.assert_array_equal(served.tokens, python.tokens)


def test_text_roundtrip_and_errors(model):
    from txl_tf.data.vocab import Vocab
    vocab = Vocab([ord(c) for c in "abcdefghij "], "char")
    text = generation.generate_text(model, vocab, "bad cafe", max_tokens=7, seed=1)
    assert len(text) == 7 and set(text) <= set("abcdefghij ")
    with pytest.raises(ValueError, match="no tokens"):
        generation.generate_text(model, vocab, "", max_tokens=3)
    with pytest.raises(ValueError, match="max_tokens"):
        _generate(model, max_tokens=0)
    for settings, flag in ((dict(top_p=0.0), "--top_p"), (dict(top_p=1.5), "--top_p"), (dict(top_k=12), "--top_k"),
                           (dict(temperature=-1.0), "--temperature")):
        with pytest.raises(ValueError, match=flag):
            generation.check_settings(vocab, ["abc"], **{**dict(max_tokens=3, temperature=1.0, top_k=0), **settings})
    with pytest.raises(ValueError, match="--prompt='xyz'"):
        generation.check_settings(vocab, ["abc", "xyz"], max_tokens=3, temperature=1.0, top_k=0)
    assert generation.check_settings(vocab, ["abc", "j"], max_tokens=3, temperature=1.0, top_k=0) == [[0, 1, 2], [9]]


# slow: ~30 s of subprocesses (train, generate twice, export); CI runs it in its slow phase
@pytest.mark.slow
def test_cli_model_dir_and_saved_model_print_the_same_text(tmp_path):
    """`python -m txl_tf.generate` on a run and on its export (`python -m txl_tf.export`): the same text for the same
    seed, for a batch of two prompts, and greedily the text Python gives; word level prints a space between prompt
    and continuation."""
    data_dir = prepare_tiny_corpus(str(tmp_path), "word", n_lines=200)
    model_dir = str(tmp_path / "run")
    run_training(model_dir, tiny_params(data_dir))

    def run(*args):
        result = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, env=subprocess_env(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    sampling = ["--prompt=the memory", "--prompt=a", "--max_tokens=6", "--seed=3", "--temperature=0.9",
                "--top_p=0.95"]
    def texts(output):  # what follows the settings line, up to the timing line (a sampled <eos> adds lines)
        lines = output.splitlines()
        assert lines[0].startswith("# ") and lines[-1].startswith("# "), output
        return "\n".join(lines[1:-1])

    from_run = texts(run("txl_tf.generate", f"--model_dir={model_dir}", *sampling))
    run("txl_tf.export", f"--model_dir={model_dir}", f"--export_dir={tmp_path / 'saved'}")
    served = texts(run("txl_tf.generate", f"--saved_model={tmp_path / 'saved'}", *sampling))
    assert from_run == served
    assert from_run.startswith("the memory ") and not from_run.startswith("the memory  "), from_run
    assert "\na " in from_run, from_run
    # Greedy: the command line from the run and from its SavedModel, and Python, give one text.
    greedy = ["--prompt=the memory", "--max_tokens=6", "--temperature=0"]
    from_run = texts(run("txl_tf.generate", f"--model_dir={model_dir}", *greedy))
    assert texts(run("txl_tf.generate", f"--saved_model={tmp_path / 'saved'}", *greedy)) == from_run
    from txl_tf import TransformerXLCausalLM

    assert TransformerXLCausalLM.from_preset(model_dir).generate("the memory", max_length=2 + 6,
                                                                 temperature=0.0) == from_run
    # --stream prints the same text as it is made (three pieces of 2 tokens), and is refused for a batch.
    one = ["--prompt=the memory", "--max_tokens=6", "--seed=3", "--temperature=0.9", "--top_p=0.95"]
    streamed = run("txl_tf.generate", f"--model_dir={model_dir}", *one, "--stream=2")
    assert texts(streamed) == texts(run("txl_tf.generate", f"--model_dir={model_dir}", *one)), streamed
    assert streamed.splitlines()[0].endswith("2 tokens at a time"), streamed
    timed = run("txl_tf.generate", f"--model_dir={model_dir}", *one, "--stream=auto")  # pieces sized by time
    assert texts(timed) == texts(streamed) and timed.splitlines()[0].endswith("pieces of about 25 ms"), timed
    bad = subprocess.run([sys.executable, "-m", "txl_tf.generate", f"--model_dir={model_dir}", *one, "--stream=fast"],
                         cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "error: --stream=fast must be auto (pieces sized by time), 1 to 4096 new tokens per printed piece, or 0 "
        "(off)"), bad.stderr
    refused = subprocess.run([sys.executable, "-m", "txl_tf.generate", f"--model_dir={model_dir}", *sampling,
                              "--stream=2"], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "error: --stream prints one --prompt from --model_dir as it is made, not 2 prompts; give one --prompt and "
        "--model_dir, or drop --stream"), refused.stderr


@pytest.mark.parametrize("attn_type", ["xl", "vaswani"])
def test_a_stream_gives_the_tokens_of_one_call_chunk_by_chunk(model, attn_type):
    """`Generator.stream` (the decoding state kept between its calls: xl's ring, the vanilla encodings' cache):
    the tokens of one `generate` call for the same settings and seed, in chunks of any size, past the memory (9);
    the chunk loop is traced once for every chunk size and both settings."""
    if attn_type != "xl":
        tf.keras.utils.set_random_seed(4)
        model = ModelConfig(n_layer=2, d_model=10, n_head=2, d_head=5, d_inner=14, dropout=0.0, dropatt=0.0,
                            mem_len=9, attn_type=attn_type, max_position=64).build(N_TOKEN)
    prompt = PROMPT[0].tolist()
    generator = generation.generator(model, None, 3)
    for settings in (dict(temperature=0.0), dict(temperature=1.3, top_k=6, top_p=0.9, seed=7)):
        whole = generation.generate_from_model(model, [prompt], max_tokens=13, segment_len=3, **settings).tokens[0]
        for chunk in (1, 5, 13, 40):
            pieces = list(generator.stream(prompt, max_tokens=13, chunk=chunk, **settings))
            assert [len(piece) for piece in pieces] == [min(chunk, 13 - i) for i in range(0, 13, chunk)]
            np.testing.assert_array_equal(np.concatenate(pieces), whole)
        # The default: pieces sized by time (one token first, then growing), the same tokens.
        pieces = list(generator.stream(prompt, max_tokens=13, **settings))
        assert len(pieces[0]) == 1 and sum(len(piece) for piece in pieces) == 13, pieces
        np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert generator._advance.experimental_get_tracing_count() == 1
    assert generator._start.experimental_get_tracing_count() == 1
    # Two streams read in turn, with a generate call between their chunks: each keeps its settings and random state.
    first = dict(temperature=1.3, top_k=6, seed=7)
    second = dict(temperature=0.8, top_p=0.9, seed=8)
    alone = [generation.generate_from_model(model, [prompt], max_tokens=13, segment_len=3, **s).tokens[0]
             for s in (first, second)]
    streams = [generator.stream(prompt, max_tokens=13, chunk=4, **s) for s in (first, second)]
    made = [[], []]
    for _ in range(4):
        for i, stream in enumerate(streams):
            made[i].append(next(stream))
        generation.generate_from_model(model, [prompt], max_tokens=3, segment_len=3, temperature=2.0, seed=99)
    for tokens, expected in zip(made, alone, strict=True):
        np.testing.assert_array_equal(np.concatenate(tokens), expected)


def test_a_time_sized_streams_pieces_take_about_piece_seconds_growing_at_most_8_times():
    """`next_piece`: the tokens that take PIECE_SECONDS at the last piece's rate, at least 1, at most 8 times the
    last piece and MOST_PIECE; a slow piece makes the next one short again."""
    from txl_tf.lm.sampling import MOST_PIECE, PIECE_SECONDS, next_piece

    assert next_piece(1, 0.001) == 8  # the rate says 25 tokens: at most 8 times the last piece
    assert next_piece(8, 0.002) == 64
    assert next_piece(64, 0.008) == round(8000 * PIECE_SECONDS)  # 200 tokens at 8,000 a second
    assert next_piece(200, 0.5) == 10  # a slow piece (400 a second): 10 next
    assert next_piece(1, 1.0) == 1  # slower than PIECE_SECONDS a token: one at a time
    assert next_piece(4000, 0.0) == MOST_PIECE  # no time measured: the most, not a division by zero


def test_generating_again_traces_nothing_again(model):
    """The trainer samples every few hundred steps: a second generation of the same shape, with other settings,
    reuses the traced function (no tf.function retracing warning in the training log)."""
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    first = generation.generate_from_model(model, prompts, max_tokens=4, temperature=0.0, segment_len=4)
    generator = generation.generator(model, None, 4)
    traced = (generator.generate.experimental_get_tracing_count(), generator._loop.experimental_get_tracing_count())
    assert traced == (1, 1)
    again = generation.generate_from_model(model, prompts, max_tokens=4, temperature=0.0, segment_len=4)
    generation.generate_from_model(model, prompts, max_tokens=4, temperature=0.7, top_k=3, seed=2, segment_len=4)
    assert (generator.generate.experimental_get_tracing_count(),
            generator._loop.experimental_get_tracing_count()) == traced
    np.testing.assert_array_equal(first.tokens, again.tokens)
