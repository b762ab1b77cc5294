"""The keras-hub face where a keras-hub user met raw errors or surprises (issue 53, items 7 and 8): `export` without
an input signature, `from_preset(..., sequence_length=)` for keras-hub presets as for run folders, a run folder
loaded from another working directory, `detokenize` of one sequence, tokens as str, and the padding id."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from hub_utils import VOCAB, tiny_lm
from train_utils import REPO_ROOT, subprocess_env, tiny_params, tiny_text, train_command

from txl_tf.base.errors import ConfigError, UserError
from txl_tf.data import corpora, prepare
from txl_tf.data.vocab import Vocab
from txl_tf.lm.hub import TransformerXLCausalLM, TransformerXLTokenizer


# ---- item 8: the tokenizer ----------------------------------------------------------------------------------------
def test_detokenize_of_one_sequence_is_one_string():
    tokenizer = TransformerXLTokenizer(VOCAB)
    ids = tokenizer.tokenize("hello world")
    assert ids.shape.rank == 1
    assert tokenizer.detokenize(ids) == "hello world"
    assert tokenizer.detokenize(ids.numpy().tolist()) == "hello world"
    assert tokenizer.detokenize(tokenizer.tokenize(["ab", "cde"])) == ["ab", "cde"]


def test_tokens_are_str_at_character_level_and_go_back_to_their_ids():
    vocab = Vocab([10, 32, 90, 97, 195, 169], "char")  # "é" is the bytes 195, 169 in UTF-8
    tokenizer = TransformerXLTokenizer(vocab)
    tokens = tokenizer.get_vocabulary()
    assert tokens[:4] == ["\n", " ", "Z", "a"] and all(isinstance(token, str) for token in tokens)
    assert tokenizer.id_to_token(2) == "Z"
    assert [tokenizer.token_to_id(token) for token in tokens] == list(range(len(vocab)))
    assert tokenizer.detokenize(tokenizer.tokenize("a é")) == "a é"


def test_padding_id_zero_is_a_real_symbol_that_padding_never_cuts():
    """The pad id is 0, which is a real symbol (a trained vocabulary has no spare id): padding is told by the
    padding mask, never by its id. Here id 0 is the space: the shorter prompt is padded with 0s, and every space
    of both prompts and of the continuations is kept."""
    spaced = Vocab([32, 10] + list(range(33, 127)), "char")
    lm = tiny_lm()
    lm.preprocessor.tokenizer.set_vocabulary(spaced)
    assert lm.preprocessor.tokenizer.pad_token_id == 0 and spaced.encode(" ") == [0]
    lm.compile(sampler="greedy")
    prompts = ["a b c", "hello  world  again"]
    batch = lm.generate(prompts, max_length=24)
    for prompt, text in zip(prompts, batch, strict=True):
        assert text.startswith(prompt) and text == lm.generate(prompt, max_length=24)


# ---- item 7: export, sequence_length, a run from elsewhere -------------------------------------------------------
def test_export_needs_no_input_signature(tmp_path):
    lm = tiny_lm()
    ids = np.array([VOCAB.encode("hello world!")], np.int32)
    expected = lm({"token_ids": ids, "padding_mask": np.ones_like(ids)}).numpy()
    lm.export(str(tmp_path / "exported"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "exported"))
    got = served.serve({"token_ids": ids, "padding_mask": np.ones_like(ids)}).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_from_preset_takes_sequence_length_for_a_keras_hub_preset(tmp_path):
    directory = tiny_lm(sequence_length=24).save_to_preset(str(tmp_path / "preset"))
    assert TransformerXLCausalLM.from_preset(directory).preprocessor.sequence_length == 24
    lm = TransformerXLCausalLM.from_preset(directory, sequence_length=10)
    assert lm.preprocessor.sequence_length == 10
    assert len(lm.generate("hello", max_length=None)) == 10
    with pytest.raises(ConfigError, match=r"^from_preset's sequence_length must be a whole number.*got '-3'"):
        TransformerXLCausalLM.from_preset(directory, sequence_length=-3)


@pytest.fixture(scope="module")
def relative_run(tmp_path_factory):
    """A run trained in its own folder with DATA_DIR relative to it, as `python -m txl_tf.train` is usually run."""
    root = tmp_path_factory.mktemp("elsewhere") / "project"
    root.mkdir()
    (root / "corpus.txt").write_text(tiny_text(200))
    prepare.prepare("text", str(root / "data" / "tiny"),
                    corpora.PrepareSettings(source=str(root / "corpus.txt"), level="char", cache_dir=str(root)))
    params = [p for p in tiny_params("data/tiny", **{"TrainConfig.train_steps": 2,
                                                     "TrainConfig.checkpoint_every": 2}) if not p.startswith("DATA_DIR")]
    command = train_command("runs/tiny", params + ["DATA_DIR='data/tiny'"],
                            gin_file=os.path.join(REPO_ROOT, "gin", "sample.gin"))
    result = subprocess.run(command, cwd=root, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_a_run_folder_loads_from_another_working_directory(relative_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where data/tiny does not exist
    lm = TransformerXLCausalLM.from_preset(str(relative_run / "runs" / "tiny"), sequence_length=12)
    assert lm.preprocessor.tokenizer.vocab.symbols == Vocab.load(
        str(relative_run / "data" / "tiny" / "vocab.json")).symbols
    assert len(lm.generate("the ", max_length=12)) == 12


def test_a_moved_project_finds_its_data_beside_the_run_only_with_the_recorded_vocabulary(relative_run, tmp_path,
                                                                                       monkeypatch):
    """The project moved (the vocabulary's recorded path is gone): DATA_DIR is looked for under the run folder's
    parents, and a prepared folder there is taken only if its vocabulary has the fingerprint the run recorded."""
    import json
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(relative_run / "runs", moved / "runs")
    record = moved / "runs" / "tiny" / "vocab_fingerprint.json"
    fields = json.loads(record.read_text())
    record.write_text(json.dumps({**fields, "vocab_file": str(tmp_path / "gone" / "vocab.json")}))
    (moved / "corpus.txt").write_text("zzz qqq\n" * 200)  # another corpus where DATA_DIR points
    prepare.prepare("text", str(moved / "data" / "tiny"),
                    corpora.PrepareSettings(source=str(moved / "corpus.txt"), level="char", cache_dir=str(moved)))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"DataConfig.data_dir='data/tiny', which holds none"):
        TransformerXLCausalLM.from_preset(str(moved / "runs" / "tiny"))
    shutil.rmtree(moved / "data" / "tiny")
    shutil.copytree(relative_run / "data" / "tiny", moved / "data" / "tiny")  # the run's own data, moved along
    lm = TransformerXLCausalLM.from_preset(str(moved / "runs" / "tiny"), sequence_length=12)
    assert len(lm.generate("the ", max_length=12)) == 12


# ---- item 6: one class per name, one engine, one protocol --------------------------------------------------------
def test_one_class_per_name():
    """Each public name is one class: txl_tf's top-level names are the keras-hub classes, and no two modules of the
    package define a class of the same name (a reader, a traceback or `isinstance` never meets two Settings)."""
    import re

    import keras

    import txl_tf
    from txl_tf.lm import hub

    defined = []
    for folder, _, files in os.walk(os.path.join(REPO_ROOT, "txl_tf")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    defined += re.findall(r"^class (\w+)\b", f.read(), re.M)
    twice = sorted({name for name in defined if defined.count(name) > 1})
    assert not twice, f"classes defined in more than one module of txl_tf: {twice}"
    assert "TransformerXLCausalLM" in defined
    for name in txl_tf.HUB_CLASSES:
        assert getattr(txl_tf, name) is getattr(hub, name)
    assert issubclass(txl_tf.TransformerXLCausalLM, keras.Model)


def test_generation_drops_same_length_in_one_place():
    from txl_tf.configs import EvalConfig
    from txl_tf.lm import generation
    from txl_tf.model.protocol import Protocol

    protocol = Protocol(mem_len=6, clamp_len=3, same_length=True)
    assert protocol.for_generation() == Protocol(mem_len=6, clamp_len=3, same_length=False)
    eval_config = EvalConfig(tgt_len=4, mem_len=6, clamp_len=3, same_length=True)
    assert eval_config.generation_protocol() == protocol.for_generation()
    lm = tiny_lm()
    model = lm.transformer_xl
    assert generation.generation_protocol(model, protocol) == protocol.for_generation()  # a caller's same_length too
    assert lm.backbone.protocol == lm.eval_config.generation_protocol()


def test_generate_with_settings_is_the_command_lines_engine_and_adds_no_weights(tmp_path):
    """`generate(..., temperature=, top_k=, seed=)` gives the tokens of `generation.generate_from_model` (what
    `python -m txl_tf.generate` and the trainer run) for the same seed; its sampler's variables are no weights of
    the model, so the preset saved afterwards loads and holds the same weights."""
    from txl_tf.lm import generation

    lm = tiny_lm()
    weights = len(lm.weights)
    settings = dict(temperature=0.8, top_k=20, top_p=0.95, seed=7)
    texts = lm.generate(["hello world", "ab"], max_length=20, **settings)
    ids = [VOCAB.encode("hello world"), VOCAB.encode("ab")]
    expected = generation.generate_from_model(lm.transformer_xl, ids, max_tokens=20 - 2,
                                              protocol=lm.eval_config.attention_protocol(),
                                              segment_len=lm.backbone.segment_len, **settings)
    for text, prompt, row in zip(texts, ids, expected.tokens, strict=True):
        assert text == VOCAB.decode(prompt + row[:20 - len(prompt)].tolist())
    assert lm.generate("ab", max_length=20, **settings) != lm.generate("ab", max_length=20, **{**settings, "seed": 8})
    assert len(lm.weights) == weights
    lm.save_to_preset(tmp_path / "preset")
    loaded = TransformerXLCausalLM.from_preset(tmp_path / "preset")  # a PathLike
    assert len(loaded.weights) == weights
    assert loaded.generate(["hello world", "ab"], max_length=20, **settings) == texts
    greedy = loaded.generate("hello", max_length=16, temperature=0.0)
    loaded.compile(sampler="greedy")
    assert loaded.generate("hello", max_length=16) == greedy  # keras-hub's greedy sampler: the same engine


@pytest.mark.parametrize("bad", [dict(seed=-1), dict(seed=2**31), dict(seed=1.5), dict(temperature=float("nan")),
                                 dict(top_k=1000), dict(top_k=2.5), dict(temperature="hot"), dict(top_p=0.0),
                                 dict(seed=1, stop_token_ids=[3])])
def test_generate_settings_out_of_range_are_one_line(bad):
    lm = tiny_lm()
    with pytest.raises(ConfigError) as raised:
        lm.generate("ab", max_length=8, **bad)
    assert "\n" not in str(raised.value)


def test_from_preset_of_a_missing_path_or_a_file_is_one_line(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    for path in (tmp_path / "missing", tmp_path / "file.txt", str(tmp_path / "missing")):
        with pytest.raises(UserError, match="from_preset expects a preset directory") as raised:
            TransformerXLCausalLM.from_preset(path)
        assert "\n" not in str(raised.value)


# ---- item 9: importing the package from Python ---------------------------------------------------------------------
def test_importing_txl_tf_hub_prints_no_tensorflow_start_up_lines():
    """`import txl_tf.lm.hub` in a user's Python (TensorFlow's log level left unset) prints nothing: TensorFlow's
    start-up notices are set aside as for the commands; TXL_TF_TF_LOGS=1 keeps them."""
    env = dict(subprocess_env())
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    code = "import txl_tf.lm.hub, tensorflow as tf; print(tf.constant(2).numpy())"
    quiet = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert quiet.returncode == 0 and quiet.stdout == "2\n" and quiet.stderr == "", quiet.stderr[-2000:]
    loud = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**env, "TXL_TF_TF_LOGS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert loud.returncode == 0 and loud.stdout == "2\n"
