"""txl_tf.TransformerXLCausalLM (the keras-hub task) as the model with its evaluation protocol: the golden fixture
through from_preset, `stream_text` equal to one `score_text`, presets that reload bitwise, one-line errors, presets
of the earlier format that still load, and (slow) a tiny trained run whose `generate` and `score_text` give the
CLI's text and evaluate's figures."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from golden_utils import FIXTURE_DIR, convert_golden, eval_gin, golden_data
from legacy_presets import write_legacy_preset
from train_utils import REPO_ROOT, prepare_tiny_corpus, run_training, subprocess_env, tiny_params

from txl_tf import TransformerXLCausalLM, evaluate
from txl_tf.base.errors import ConfigError, UserError
from txl_tf.configs import EvalConfig, ModelConfig
from txl_tf.data.pipeline import read_split
from txl_tf.data.vocab import Vocab
from txl_tf.evaluation import loops as evaluation
from txl_tf.lm import generation
from txl_tf.model.protocol import Protocol
from txl_tf.runs import loading


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(converted directory, its gin file: data and the fixture's protocol, the fixture's mean NLL)."""
    tmp = tmp_path_factory.mktemp("golden")
    (tmp / "converted").mkdir()
    directory = convert_golden(tmp / "converted")
    data_dir, expected = golden_data(tmp / "data")
    gin_file = tmp / "eval.gin"
    gin_file.write_text(eval_gin(data_dir))
    return directory, str(gin_file), expected


@pytest.fixture(scope="module")
def golden_lm(converted):
    directory, gin_file, _ = converted
    return TransformerXLCausalLM.from_preset(directory, gin_file=gin_file)


def golden_texts(vocab):
    """The fixture's 3 streams of 16 tokens as texts (the vocabulary's symbol i is byte i)."""
    tokens = np.load(FIXTURE_DIR / "golden.npz")["tokens"].T  # [3, 16]
    return [vocab.decode(row.tolist()) for row in tokens]


def test_converted_golden_fixture_reproduces_its_nll(converted, golden_lm):
    """The converted checkpoint with the setup's gin file (data, protocol) scores each golden stream as the
    authors' code did: per token and in the mean, within 1e-5."""
    golden = np.load(FIXTURE_DIR / "golden.npz")
    results = golden_lm.score_text(golden_texts(golden_lm.vocab))
    per_token = np.concatenate([golden[f"nll_{s}"] for s in range(3)]).T  # [3 streams, 15]
    np.testing.assert_allclose(np.stack([-r.log_probs for r in results]), per_token, atol=1e-5, rtol=0)
    mean = sum(r.nats for r in results) / sum(r.num_tokens for r in results)
    assert mean == pytest.approx(converted[2], abs=1e-5)
    assert results[0].level == "char" and results[0].bpc == pytest.approx(results[0].loss / np.log(2))


def test_preset_reloads_bitwise_without_gin_or_data(golden_lm, tmp_path):
    preset = golden_lm.save_to_preset(tmp_path / "preset")  # keras-hub's layout, the one format written
    assert sorted(p.name for p in (tmp_path / "preset").iterdir()) == [
        ".txl_tf-manifest.json", "assets", "config.json", "metadata.json", "model.weights.h5", "preprocessor.json",
        "task.json", "tokenizer.json"]
    reloaded = TransformerXLCausalLM.from_preset(preset)
    assert reloaded.vocab == golden_lm.vocab and reloaded.eval_config == golden_lm.eval_config
    tokens = np.load(FIXTURE_DIR / "golden.npz")["tokens"].T[:, :5]
    before, after = golden_lm.transformer_xl, reloaded.transformer_xl
    np.testing.assert_array_equal(after.log_probs(after(tokens)[0]).numpy(),
                                  before.log_probs(before(tokens)[0]).numpy())
    texts = golden_texts(golden_lm.vocab)
    np.testing.assert_array_equal(reloaded.score_text(texts[1]).log_probs, golden_lm.score_text(texts[1]).log_probs)
    # A preset is replaced only with overwrite=True, and a folder that holds anything else never.
    with pytest.raises(FileExistsError, match="already holds a keras-hub preset; pass overwrite=True"):
        golden_lm.save_to_preset(preset)
    golden_lm.save_to_preset(preset, overwrite=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no keras-hub preset written by txl_tf"):
        golden_lm.save_to_preset(tmp_path / "other", overwrite=True)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("protocol", [
    [],  # the fixture's: mem_len 7, tgt_len 5, the keys/values cache
    ["EvalConfig.same_length = True", "EvalConfig.kv_cache = False", "EvalConfig.tgt_len = 4"],
])
def test_streaming_in_pieces_equals_one_call(converted, protocol):
    directory, gin_file, _ = converted
    lm = TransformerXLCausalLM.from_preset(directory, gin_file=gin_file, gin_param=protocol)
    text = "".join(golden_texts(lm.vocab))  # 48 tokens
    whole = lm.score_text(text)
    stream = lm.stream_text()
    cuts = [0, 1, 1, 3, 4, 9, 10, 17, 22, 23, 35, 40, 48]  # pieces of 1 token, none, inside and across segments
    pieces = [stream.score(text[start:end]) for start, end in zip(cuts, cuts[1:], strict=False)]
    assert [p.num_tokens for p in pieces] == [0, 0, 2, 1, 5, 1, 7, 5, 1, 12, 5, 8]
    np.testing.assert_allclose(np.concatenate([p.log_probs for p in pieces]), whole.log_probs, atol=1e-5, rtol=0)
    assert sum(p.nats for p in pieces) == pytest.approx(whole.nats, abs=1e-5)
    assert stream.result().nats == pytest.approx(whole.nats, abs=1e-5)
    stream.reset()  # a new text: zero memory again
    np.testing.assert_allclose(stream.score(text[:20]).log_probs, lm.score_text(text[:20]).log_probs, atol=1e-5, rtol=0)


@pytest.mark.slow  # ~17 s: the golden model's generation traced; CI's slow phase
def test_generate_text_in_text_out(golden_lm):
    prompts = ["\x01\x02\x03", "\x04"]
    out = golden_lm.generate(prompts, max_length=7, seed=5, temperature=0.8, top_k=10)
    assert isinstance(out, list) and [len(golden_lm.vocab.encode(t)) for t in out] == [7, 7]
    assert [t[:len(p)] for t, p in zip(out, prompts, strict=True)] == prompts
    assert golden_lm.generate(prompts, max_length=7, seed=5, temperature=0.8, top_k=10) == out  # same seed
    one = golden_lm.generate("\x04", max_length=7, seed=5, temperature=0.8, top_k=10)
    assert isinstance(one, str) and len(one) == 7


def test_tokenizer_layer_gives_the_ids_of_encode(golden_lm):
    text = golden_texts(golden_lm.vocab)[0]
    assert golden_lm.preprocessor.tokenizer(text).numpy().tolist() == golden_lm.encode(text).tolist()


def test_one_line_errors(converted, golden_lm, tmp_path, monkeypatch):
    directory, gin_file, _ = converted
    monkeypatch.chdir(tmp_path)  # the default DataConfig.data_dir is relative: make sure nothing is there
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    for path in (tmp_path / "empty", tmp_path / "file.txt", tmp_path / "missing"):
        with pytest.raises(UserError, match=f"^{re.escape(str(path))} .*from_preset expects a preset directory"):
            TransformerXLCausalLM.from_preset(path)
    with pytest.raises(UserError, match="vocabulary of .*pass gin_file= the setup's gin file"):
        TransformerXLCausalLM.from_preset(directory)
    preset = golden_lm.save_to_preset(tmp_path / "preset")
    with pytest.raises(ConfigError, match="is a keras-hub preset: it takes no gin_param"):
        TransformerXLCausalLM.from_preset(preset, gin_param=["EvalConfig.mem_len = 3"])
    (tmp_path / "preset" / "config.json").write_text('{"format": "something else"}')
    with pytest.raises(UserError, match=r"config.json is not a txl_tf.preset v1 config"):
        TransformerXLCausalLM.from_preset(preset)
    with pytest.raises(ConfigError, match=r"max_length=3 must be above the longest prompt's 3 tokens"):
        golden_lm.generate(["\x01\x02\x03", "\x04"], max_length=3, seed=1)
    with pytest.raises(ConfigError, match="--temperature=-1"):
        golden_lm.generate("\x01", max_length=3, temperature=-1)
    with pytest.raises(ConfigError, match="has a symbol outside the char-level vocabulary"):
        golden_lm.score_text("\x01z")
    with pytest.raises(ConfigError, match="encodes to 1 token"):
        golden_lm.score_text("\x01")


# slow: ~22 s on 2 cores (a tiny training run and one generate in subprocesses)
@pytest.mark.slow
def test_tiny_run_generates_the_cli_text_and_scores_evaluate_figures(tmp_path):
    data_dir = prepare_tiny_corpus(str(tmp_path), "char", n_lines=120)
    model_dir = str(tmp_path / "run")
    run_training(model_dir, tiny_params(data_dir))
    lm = TransformerXLCausalLM.from_preset(model_dir)

    # generate: the CLI's text for the same seed. --max_tokens counts new tokens per row, max_length all of a row's
    # tokens: the shortest prompt gets the CLI's count, the longer one a prefix of the CLI's row (one token is one
    # character of this ASCII corpus).
    prompts, new_tokens = ["3 the memory ", "0 a"], 13
    settings = dict(seed=11, temperature=0.9, top_p=0.95)
    command = [sys.executable, "-m", "txl_tf.generate", f"--model_dir={model_dir}", f"--max_tokens={new_tokens}",
               *[f"--prompt={p}" for p in prompts], *[f"--{k}={v}" for k, v in settings.items()]]
    cli = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    printed = cli.stdout.split("\n", 1)[1].rsplit("\n# ", 1)[0]  # the rows, between the two "# " lines
    texts = lm.generate(prompts, max_length=len(prompts[1]) + new_tokens, **settings)
    first_row = printed[:len(prompts[0]) + new_tokens]
    assert printed == first_row + "\n" + texts[1], (printed, texts)
    assert first_row.startswith(texts[0]) and len(texts[0]) == len(prompts[1]) + new_tokens

    # score: evaluate's figures on the test split (one stream, the whole split).
    tokens = read_split(data_dir, "test")
    text = lm.vocab.decode(tokens.tolist())
    assert lm.vocab.encode(text) == tokens.tolist()
    expected = evaluate.run(model_dir, gin_params=["EvalConfig.batch_size = 1", "EvalConfig.max_steps = 0"],
                            token_losses=str(tmp_path / "losses.npy"), progress=False)
    result = lm.score_text(text)
    assert result.num_tokens == expected.num_tokens == len(tokens) - 1
    assert result.loss == pytest.approx(expected.loss, abs=1e-5)
    np.testing.assert_allclose(-result.log_probs, np.load(tmp_path / "losses.npy"), atol=1e-5, rtol=0)


# ---- issue 34: a preset's sizes, lengths, numbers and files are untrusted input ---------------------------------
TINY_MODEL = dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128, mem_len=8, n_token=200, dropout=0.0)


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory):
    """A preset of the earlier format (its config.json's "model" and "eval" sections are edited below) of an
    untrained tiny model (2 layers, d_model 64) with a 200-symbol char vocabulary."""
    config = ModelConfig(**TINY_MODEL)
    return write_legacy_preset(tmp_path_factory.mktemp("tiny") / "preset", loading.build_model(config),
                               Vocab(list(range(200)), "char"), config, EvalConfig(tgt_len=8, mem_len=16, batch_size=2))


def _edited(preset, tmp_path, section=None, fields=None, config_text=None):
    """A copy of `preset` whose config.json has `fields` set in `section` ("model" or "eval"), or is
    `config_text`."""
    copy = str(tmp_path / "edited")
    shutil.copytree(preset, copy)
    path = os.path.join(copy, "config.json")
    if config_text is None:
        with open(path) as f:
            config = json.load(f)
        config[section].update(fields)
        config_text = json.dumps(config)
    with open(path, "w") as f:
        f.write(config_text)
    return copy


# Sizes far from any machine's memory (terabytes and more), so that every outcome is the same everywhere.
@pytest.mark.parametrize("fields,message", [
    ({"n_layer": 1_000_000}, r"config\.json: ModelConfig\.n_layer=1000000 must be in \[1, 1024\]; correct it, or save "
                             r"the preset again$"),
    ({"d_model": 10**9}, r"config\.json: ModelConfig\.d_model=1000000000: a model of these sizes needs about "
                         r"[\d,.]+ TiB of memory, more than the [\d,.]+ [GT]iB of this machine; lower "
                         r"ModelConfig\.d_model"),
    ({"n_token": 10**9}, r"n_token=1000000000"),  # the memory estimate, or (on a huge machine) the vocabulary's size
    ({"n_head": 10**400}, r"config\.json: ModelConfig\.n_head=10{56}\.\.\. must be in \[1, 2147483647\]"),
], ids=["n_layer", "d_model", "n_token", "n_head"])
def test_preset_sizes_are_refused_before_the_model_is_built(tiny_preset, tmp_path, fields, message):
    with pytest.raises(UserError, match=message) as raised:
        TransformerXLCausalLM.from_preset(_edited(tiny_preset, tmp_path, "model", fields))
    assert "\n" not in str(raised.value)


def test_preset_vocabulary_must_match_the_model_before_it_is_built(tiny_preset, tmp_path):
    with pytest.raises(UserError, match=r"^the preset .*edited does not fit together: its config\.json has model "
                                        r"n_token=300 but its vocab\.json holds 200 symbols; save the preset again"):
        TransformerXLCausalLM.from_preset(_edited(tiny_preset, tmp_path, "model", {"n_token": 300}))


@pytest.mark.parametrize("field,value", [("mem_len", 2**31 - 1), ("tgt_len", 10**9)])
def test_preset_evaluation_lengths_are_refused_when_loaded(tiny_preset, tmp_path, field, value):
    with pytest.raises(ConfigError, match=rf"config\.json: EvalConfig\.{field}={value}: scoring 1 row\(s\) .* needs "
                                          rf"about [\d,.]+ TiB of memory, more than the .* of this machine; lower "
                                          rf"EvalConfig\.{field}$"):
        TransformerXLCausalLM.from_preset(_edited(tiny_preset, tmp_path, "eval", {field: value}))


def test_score_generate_evaluate_bound_their_lengths_before_any_tensor(tiny_preset):
    lm = TransformerXLCausalLM.from_preset(tiny_preset)
    named = (r"^EvalConfig\.mem_len=2147483647: .* TiB of memory, more than the .* of this machine; lower "
             r"EvalConfig\.mem_len$")
    text = "".join(chr(i) for i in range(1, 40))
    with pytest.raises(ConfigError, match=named):  # the task's lengths, before it is built
        TransformerXLCausalLM.around(lm.transformer_xl, dataclasses.replace(lm.eval_config, mem_len=2**31 - 1),
                                     lm.vocab)
    protocol = Protocol(mem_len=2**31 - 1, clamp_len=-1, same_length=False)
    tokens = lm.encode(text)
    with pytest.raises(ConfigError, match=named):
        evaluation.evaluate_tokens(lm.transformer_xl, tokens, tgt_len=8, protocol=protocol, batch_size=2)
    with pytest.raises(ConfigError, match=named):
        generation.generate_from_model(lm.transformer_xl, [tokens.tolist()], max_tokens=2, protocol=protocol, segment_len=8)
    assert lm.score_text(text).num_tokens == 38  # the preset's own lengths fit


def test_an_infinite_number_in_a_preset_is_refused(tiny_preset, tmp_path):
    with open(os.path.join(tiny_preset, "config.json")) as f:
        text = f.read()
    assert '"layer_norm_epsilon": 1e-12' in text
    edited = _edited(tiny_preset, tmp_path, config_text=text.replace('"layer_norm_epsilon": 1e-12',
                                                                     '"layer_norm_epsilon": Infinity'))
    with pytest.raises(UserError, match=r"config\.json .*edited/config\.json is not valid JSON \(Infinity is not a "
                                        r"finite number\)"):
        TransformerXLCausalLM.from_preset(edited)


@pytest.mark.parametrize("call", ["generate", "generate_list", "score", "generate_ids",
                                  *(pytest.param(c, marks=pytest.mark.slow) for c in ("encode", "stream"))])
def test_text_must_be_str_and_anything_else_is_refused_by_type(tiny_preset, call):
    lm = TransformerXLCausalLM.from_preset(tiny_preset)
    run, message = {  # keras-hub's generate and txl_tf's settings (seed=) check text alike
        "generate": (lambda: lm.generate(b"abc", max_length=6), r"^generate's prompt is text: got bytes; decode it"),
        "generate_list": (lambda: lm.generate(["ab", b"abc"], max_length=6, seed=1),
                          r"^generate's prompt \[1\] must be a str; got bytes"),
        "score": (lambda: lm.score_text(b"abc"), r"^texts must be a str or a list of str; got bytes"),
        "encode": (lambda: lm.encode(b"abc"), r"^the text must be a str; got bytes"),
        "stream": (lambda: lm.stream_text().score(b"abc"), r"^the piece must be a str; got bytes"),
        "generate_ids": (lambda: lm.generate(97, max_length=6, seed=1),
                         r"^generate's inputs must be a str or a list of str; got int$"),
    }[call]
    with pytest.raises(TypeError, match=message):
        run()
    if call == "generate":  # a str array is fine (one case: each generate traces keras-hub's loop, ~7 s)
        assert lm.generate(np.array(["\x01\x02"]), max_length=4, seed=1)[0].startswith("\x01\x02")
