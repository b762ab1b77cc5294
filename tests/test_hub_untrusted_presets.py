"""A keras-hub preset someone sends (issue 52, items 1, 4, 5, 7 and 10).

txl_tf.lm.hub's classes never write outside the folder they are given nor read a file the preset did not ship
(keras-hub's `config_file` field); every file of a local preset is checked before keras-hub reads it when loading
goes through txl_tf's classes (`TransformerXLCausalLM.from_preset` and the others, and through them keras-hub's
generic loaders wherever txl_tf's code runs before the file is opened: docs/python.md); a FIFO or a device where
weights or a checkpoint belong is one line; the vocabulary is checked against the model; the preset's fields are
validated. Real keras-hub loaders, real FIFOs and links to /dev/zero; where a regression would hang (a FIFO) or
read without end (/dev/zero), the loads run in a subprocess with a time limit and a memory limit, so that the test
fails instead of stalling the suite.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap

import keras
import keras_hub
import numpy as np
import pytest
from train_utils import REPO_ROOT, make_run, subprocess_env

from txl_tf.base.errors import ConfigError, UserError
from txl_tf.configs import EvalConfig, ModelConfig
from txl_tf.data import corpora, prepare
from txl_tf.data.vocab import Vocab
from txl_tf.lm.hub import (
    TransformerXLBackbone,
    TransformerXLCausalLM,
    TransformerXLCausalLMPreprocessor,
    TransformerXLTokenizer,
)

VOCAB = Vocab([10] + list(range(32, 127)), "char")  # 96 symbols
ASSET = os.path.join("assets", "tokenizer", "vocab.json")
NOT_REGULAR = "is not a regular file (a device, FIFO or socket)"


def make_lm(sequence_length=24):
    keras.utils.set_random_seed(1)
    model_config = ModelConfig(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, dropout=0.0, mem_len=8,
                               n_token=len(VOCAB))
    eval_config = EvalConfig(tgt_len=4, mem_len=8, clamp_len=-1, same_length=False)
    preprocessor = TransformerXLCausalLMPreprocessor(TransformerXLTokenizer(VOCAB), sequence_length=sequence_length)
    return TransformerXLCausalLM(TransformerXLBackbone(model_config, eval_config), preprocessor)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A keras-hub preset written by save_to_preset (the tests damage copies of it)."""
    path = tmp_path_factory.mktemp("saved") / "preset"
    make_lm().save_to_preset(str(path))
    return path


@pytest.fixture
def preset(saved, tmp_path):
    copy = tmp_path / "preset"
    shutil.copytree(saved, copy)
    return copy


def edit(path, change) -> None:
    """Rewrites the JSON file `path` with `change(data)` applied."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_everywhere(preset, component: str, change) -> None:
    """Applies `change` to the config of `component` ("preprocessor" or "tokenizer") in every file that holds it
    (task.json, preprocessor.json, tokenizer.json), so that the files still agree."""
    def task(data):
        inner = data["config"]["preprocessor"]["config"]
        change(inner if component == "preprocessor" else inner["tokenizer"]["config"])

    edit(preset / "task.json", task)
    if component == "preprocessor":
        edit(preset / "preprocessor.json", lambda data: change(data["config"]))
    else:
        edit(preset / "preprocessor.json", lambda data: change(data["config"]["tokenizer"]["config"]))
        edit(preset / "tokenizer.json", lambda data: change(data["config"]))


def snapshot(folder, skip=()) -> dict:
    """{relative path: bytes (or the link's target)} of everything under `folder`, `skip`'s top-level names left
    out."""
    found = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if os.path.relpath(os.path.join(root, d), folder) not in skip]
        for name in files:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative.split(os.sep)[0] not in skip:
                found[relative] = os.readlink(path) if os.path.islink(path) else open(path, "rb").read()
    return found


# ---- item 1: config_file never names a file outside the folder -------------------------------------------------
def test_a_presets_config_file_names_never_take_save_or_the_vocabulary_outside_its_folder(preset, tmp_path):
    """keras-hub keeps each JSON file's `config_file` and joins the output folder with it on save, and reads the
    tokenizer's assets from assets/<config_file without .json>/: an absolute and a ../ name in every file of a
    preset, with another vocabulary waiting where the absolute name points."""
    outside = tmp_path / "outside"
    (outside / "tok").mkdir(parents=True)
    for name in ("rel.json", "tok.json"):
        (outside / name).write_text("the user's file\n")
    Vocab(list(reversed(VOCAB.symbols)), "char").save(str(outside / "tok" / "vocab.json"))
    edit_everywhere(preset, "preprocessor", lambda config: config.update(config_file="../../outside/rel.json"))
    edit_everywhere(preset, "tokenizer", lambda config: config.update(config_file=str(outside / "tok.json")))
    before = snapshot(tmp_path, skip=("out",))

    lm = keras_hub.models.CausalLM.from_preset(str(preset))
    tokenizer = lm.preprocessor.tokenizer
    assert (lm.preprocessor.config_file, tokenizer.config_file) == ("preprocessor.json", "tokenizer.json")
    assert tokenizer.vocab == VOCAB  # the preset's own, not the one outside
    assert keras_hub.tokenizers.Tokenizer.from_preset(str(preset)).vocab == VOCAB
    lm.save_to_preset(str(tmp_path / "out"))

    assert snapshot(tmp_path, skip=("out",)) == before  # nothing outside the output folder changed
    out = tmp_path / "out"
    assert {"config.json", "task.json", "preprocessor.json", "tokenizer.json", "metadata.json",
            "model.weights.h5", "assets"} <= set(os.listdir(out))
    assert Vocab.load(str(out / ASSET)) == VOCAB
    assert json.loads((out / "preprocessor.json").read_text())["config"]["config_file"] == "preprocessor.json"
    assert json.loads((out / "tokenizer.json").read_text())["config"]["config_file"] == "tokenizer.json"
    assert keras_hub.models.CausalLM.from_preset(str(out)).preprocessor.tokenizer.vocab == VOCAB


def test_config_file_cannot_be_set_and_a_tokenizer_config_may_not_name_a_vocabulary_file(tmp_path):
    tokenizer = TransformerXLTokenizer(VOCAB)
    with pytest.raises(ConfigError, match="saved as tokenizer.json only"):
        tokenizer.config_file = "/etc/profile"
    assert tokenizer.config_file == "tokenizer.json"
    VOCAB.save(str(tmp_path / "vocab.json"))
    config = {**tokenizer.get_config(), "vocabulary": str(tmp_path / "vocab.json")}
    with pytest.raises(ConfigError, match="names the vocabulary file"):
        TransformerXLTokenizer.from_config(config)


# ---- items 4 and 5: what a loader opens is checked first ------------------------------------------------------
RUNNER = textwrap.dedent("""
    import json, sys
    import keras_hub
    import txl_tf
    from txl_tf.base import errors
    from txl_tf.lm import hub
    loaders = {
        "TransformerXLCausalLM": hub.TransformerXLCausalLM.from_preset,
        "TransformerXLBackbone": hub.TransformerXLBackbone.from_preset,
        "TransformerXLTokenizer": hub.TransformerXLTokenizer.from_preset,
        "TransformerXLCausalLMPreprocessor": hub.TransformerXLCausalLMPreprocessor.from_preset,
        "keras_hub.models.CausalLM": keras_hub.models.CausalLM.from_preset,
        "keras_hub.models.Backbone": keras_hub.models.Backbone.from_preset,
        "txl_tf.TransformerXLCausalLM": txl_tf.TransformerXLCausalLM.from_preset,
    }
    for loader, path in json.loads(sys.argv[1]):
        print("START", loader, path, flush=True)
        try:
            loaders[loader](path)
            outcome = "loaded"
        except errors.UserError as error:
            outcome = type(error).__name__ + ": " + str(error)
        except BaseException as error:
            outcome = "RAW " + type(error).__name__ + ": " + str(error)[:300]
        print("RESULT " + json.dumps([loader, path, outcome]), flush=True)
""")


def _limit_memory():
    """The child's address space: 8 GB (a read without end fails there instead of filling the machine)."""
    resource.setrlimit(resource.RLIMIT_AS, (8_000_000_000, 8_000_000_000))


def load_in_subprocess(cases, timeout=150) -> dict:
    """{(loader, path): outcome} of each load in one fresh process; a load that does not end fails the test."""
    try:
        result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], cwd=REPO_ROOT,
                                env=subprocess_env(), capture_output=True, text=True, timeout=timeout,
                                preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired as error:
        output = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        started = [line for line in output.splitlines() if line.startswith("START")]
        pytest.fail(f"a load did not end within {timeout} s: {started[-1] if started else 'before the first'}")
    outcomes = {}
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            loader, path, outcome = json.loads(line[len("RESULT "):])
            outcomes[(loader, path)] = outcome
    assert len(outcomes) == len(cases), result.stdout + result.stderr
    return outcomes


def damaged(saved, root, name, kind) -> str:
    """A copy of the preset under `root` whose file `name` is a FIFO, a link to /dev/zero, or JSON nested 200,000
    levels deep ("deep"); returns its path."""
    copy = root / f"{name}-{kind}"
    shutil.copytree(saved, copy)
    path = copy / name
    if path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # a reader waits for a writer forever
    elif kind == "zero":
        os.symlink("/dev/zero", path)  # a reader never reaches the end
    else:
        path.write_text("[" * 200_000 + "]" * 200_000)
    if name == "model.weights.json":  # the sharded index is read when there is no model.weights.h5
        (copy / "model.weights.h5").unlink()
    return str(copy)


TXL_LOADERS = ("TransformerXLCausalLM", "TransformerXLBackbone", "TransformerXLTokenizer",
               "TransformerXLCausalLMPreprocessor")


def test_txl_tfs_loaders_check_every_file_of_a_preset_before_keras_hub_reads_it(saved, tmp_path):
    """Each JSON file a FIFO, a link to /dev/zero or 200,000 levels deep: each of txl_tf.lm.hub's four from_preset
    refuses it in one line naming the file (keras-hub's own loaders read config.json, task.json, preprocessor.json
    and tokenizer.json before any txl_tf code runs: docs/python.md)."""
    presets = {
        "config.json": damaged(saved, tmp_path, "config.json", "zero"),
        "task.json": damaged(saved, tmp_path, "task.json", "fifo"),
        "task.json deep": damaged(saved, tmp_path, "task.json", "deep"),
        "preprocessor.json": damaged(saved, tmp_path, "preprocessor.json", "fifo"),
        "tokenizer.json": damaged(saved, tmp_path, "tokenizer.json", "zero"),
        "metadata.json": damaged(saved, tmp_path, "metadata.json", "fifo"),
        "model.weights.json": damaged(saved, tmp_path, "model.weights.json", "fifo"),
    }
    cases = [(loader, path) for path in presets.values() for loader in TXL_LOADERS]
    outcomes = load_in_subprocess(cases)
    for what, path in presets.items():
        name = what.split()[0]
        for loader in TXL_LOADERS:
            outcome = outcomes[(loader, path)]
            assert "\n" not in outcome and os.path.join(path, name) in outcome, (loader, what, outcome)
            expected = "nests deeper than 64 levels" if what.endswith("deep") else NOT_REGULAR
            assert outcome.startswith("UntrustedFileError: ") and expected in outcome, (loader, what, outcome)


def test_a_fifo_or_a_device_as_the_weights_is_one_line_for_every_loader(saved, tmp_path):
    """model.weights.h5 a FIFO or a link to /dev/zero: keras-hub's CausalLM and Backbone loaders (their load_weights
    is the backbone's), txl_tf.lm.hub's and txl_tf's from_preset (the earlier preset format). keras-hub's CausalLM
    loader also reaches txl_tf's checks (through the tokenizer) before it reads the sharded index and the other
    files keras-hub itself does not read."""
    from legacy_presets import write_legacy_preset

    lm = make_lm()
    legacy = tmp_path / "legacy"
    write_legacy_preset(legacy, lm.backbone.transformer_xl, VOCAB, lm.backbone.model_config, lm.backbone.eval_config)
    cases, expected = [], {}
    for kind in ("fifo", "zero"):
        path = damaged(saved, tmp_path, "model.weights.h5", kind)
        for loader in ("keras_hub.models.CausalLM", "keras_hub.models.Backbone", "TransformerXLCausalLM"):
            cases.append((loader, path))
            expected[(loader, path)] = os.path.join(path, "model.weights.h5")
        old = tmp_path / f"legacy-{kind}"
        shutil.copytree(legacy, old)
        (old / "model.weights.h5").unlink()
        os.mkfifo(old / "model.weights.h5") if kind == "fifo" else os.symlink("/dev/zero", old / "model.weights.h5")
        cases.append(("txl_tf.TransformerXLCausalLM", str(old)))
        expected[("txl_tf.TransformerXLCausalLM", str(old))] = str(old / "model.weights.h5")
    for name, kind in (("model.weights.json", "fifo"), ("tokenizer.json", "fifo"), ("metadata.json", "zero")):
        path = damaged(saved, tmp_path, name, kind)
        cases.append(("keras_hub.models.CausalLM", path))
        expected[("keras_hub.models.CausalLM", path)] = os.path.join(path, name)
    outcomes = load_in_subprocess(cases)
    for case, named in expected.items():
        outcome = outcomes[case]
        assert outcome.startswith("UntrustedFileError: ") and f"{named} {NOT_REGULAR}" in outcome, (case, outcome)
        assert "\n" not in outcome, outcome


def test_a_fifo_or_a_device_in_a_run_folders_checkpoints_is_one_line(tmp_path):
    """`python -m txl_tf.evaluate` on a run folder whose newest checkpoint's .index is a FIFO and whose older one's
    .data shard is a link to /dev/zero (and whose state file is a FIFO), and `python -m txl_tf.convert` of a prefix
    whose .index is a FIFO: one line each, within the time limit (TensorFlow's reader would wait forever)."""
    run = tmp_path / "run"
    make_run(run, [0.0, 1.0])  # ckpt-10 and ckpt-20
    (tmp_path / "corpus.txt").write_text("abcdefghij\n" * 300)  # the run's 11 symbols, so evaluate reaches the weights
    data_dir = tmp_path / "data"
    prepare.prepare("text", str(data_dir), corpora.PrepareSettings(source=str(tmp_path / "corpus.txt"), level="char",
                                                            cache_dir=str(tmp_path)))
    (run / "ckpt-20.index").unlink()
    os.mkfifo(run / "ckpt-20.index")
    (run / "ckpt-10.data-00000-of-00001").unlink()
    os.symlink("/dev/zero", run / "ckpt-10.data-00000-of-00001")
    (run / "checkpoint").unlink()
    os.mkfifo(run / "checkpoint")
    original = tmp_path / "original"
    original.mkdir()
    os.mkfifo(original / "model.ckpt-5.index")
    (original / "model.ckpt-5.data-00000-of-00001").write_bytes(b"\0" * 64)
    commands = {
        "evaluate": [sys.executable, "-m", "txl_tf.evaluate", f"--model_dir={run}",
                     f"--gin_param=DataConfig.data_dir='{data_dir}'"],
        "convert": [sys.executable, "-m", "txl_tf.convert", f"--checkpoint={original / 'model.ckpt-5'}",
                    f"--output_dir={tmp_path / 'converted'}"],
    }
    for what, command in commands.items():
        try:
            result = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                                    timeout=120, preexec_fn=_limit_memory)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what} did not end within 120 s")
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1, (what, result.stderr[-2000:])
        assert "Traceback" not in result.stderr, result.stderr[-2000:]
        if what == "evaluate":
            assert f"{run / 'ckpt-20.index'} {NOT_REGULAR}" in errors[0], errors[0]
            assert f"{run / 'ckpt-10.data-00000-of-00001'} {NOT_REGULAR}" in errors[0], errors[0]
        else:
            assert f"{original / 'model.ckpt-5.index'} {NOT_REGULAR}" in errors[0], errors[0]
    assert not (tmp_path / "converted").exists()


# ---- item 7: the vocabulary is the model's ---------------------------------------------------------------------
@pytest.mark.parametrize("vocabulary,problem", [
    (Vocab(list(reversed(VOCAB.symbols)), "char"), "is another vocabulary than the model was saved with"),
    (Vocab([f"w{i}" for i in range(len(VOCAB))], "word"), "is another vocabulary than the model was saved with"),
    (Vocab(list(range(50)), "char"), "holds 50 symbols but its model has n_token=96"),
    (Vocab([f"w{i}" for i in range(150)], "word"), "holds 150 symbols but its model has n_token=96"),
], ids=["reversed", "words-for-characters", "fewer", "more"])
def test_a_vocabulary_that_is_not_the_models_is_refused_by_every_loader(preset, vocabulary, problem):
    vocabulary.save(str(preset / ASSET))
    loaders = [TransformerXLCausalLM.from_preset, keras_hub.models.CausalLM.from_preset,
               keras_hub.tokenizers.Tokenizer.from_preset, keras_hub.models.CausalLMPreprocessor.from_preset]
    for loader in loaders:
        with pytest.raises(UserError, match=problem) as caught:
            loader(str(preset))
        assert "\n" not in str(caught.value) and str(preset / ASSET) in str(caught.value)


def test_a_preset_saved_before_the_fingerprint_loads_when_the_size_agrees(preset):
    """A preset written before presets recorded the vocabulary's fingerprint (metadata.json without "txl_tf"):
    its vocabulary is checked by its size alone (such a preset records no level either)."""
    edit(preset / "metadata.json", lambda data: data.pop("txl_tf"))
    lm = keras_hub.models.CausalLM.from_preset(str(preset))
    assert lm.preprocessor.tokenizer.vocab == VOCAB
    Vocab(list(range(50)), "char").save(str(preset / ASSET))
    with pytest.raises(UserError, match="holds 50 symbols but its model has n_token=96"):
        keras_hub.models.CausalLM.from_preset(str(preset))


def test_a_task_of_a_model_and_a_vocabulary_of_another_size_is_refused():
    lm = make_lm()
    other = TransformerXLCausalLMPreprocessor(TransformerXLTokenizer(Vocab(list(range(50)), "char")))
    with pytest.raises(ConfigError, match="holds 50 symbols but the backbone's model has n_token=96"):
        TransformerXLCausalLM(lm.backbone, other)


# ---- item 10: the preset's fields ------------------------------------------------------------------------------
def test_a_preset_without_eval_config_is_refused(preset):
    """EvalConfig's defaults (memory 2,100, clamp 820) are the published large models', not this one's."""
    edit(preset / "config.json", lambda data: data["config"].pop("eval_config"))
    for loader in (TransformerXLBackbone.from_preset, keras_hub.models.Backbone.from_preset):
        with pytest.raises(ConfigError, match="has no eval_config") as caught:
            loader(str(preset))
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="has no eval_config"):
        TransformerXLBackbone(make_lm().backbone.model_config)
    edit(preset / "config.json", lambda data: data["config"].update(eval_config={"tgt_len": 4, "clamp_len": -1}))
    with pytest.raises(ConfigError, match="eval_config has no mem_len"):
        TransformerXLBackbone.from_preset(str(preset))
    with pytest.raises(ConfigError, match="has an eval_config without mem_len"):
        keras_hub.models.Backbone.from_preset(str(preset))


def test_task_json_and_config_json_that_disagree_are_refused(preset):
    """keras-hub's CausalLM reads the backbone from task.json, its Backbone from config.json."""
    edit(preset / "task.json", lambda data: data["config"]["backbone"]["config"]["eval_config"].update(mem_len=5))
    for loader in (TransformerXLCausalLM.from_preset, keras_hub.models.CausalLM.from_preset):
        with pytest.raises(UserError, match=r"the backbone in its task.json differs from its config.json \(at "
                                            r"config.eval_config.mem_len: 5 against 8\)") as caught:
            loader(str(preset))
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize("value", [-5, 0, "abc", 2.5, True, None])
def test_a_sequence_length_that_is_not_a_positive_whole_number_is_refused(preset, value):
    with pytest.raises(ConfigError, match="sequence_length must be a whole number of tokens >= 1"):
        TransformerXLCausalLMPreprocessor(TransformerXLTokenizer(VOCAB), sequence_length=value)
    edit_everywhere(preset, "preprocessor", lambda config: config.update(sequence_length=value))
    for loader in (keras_hub.models.CausalLM.from_preset, keras_hub.models.CausalLMPreprocessor.from_preset):
        with pytest.raises(ConfigError, match="sequence_length must be a whole number of tokens >= 1") as caught:
            loader(str(preset))
        assert "\n" not in str(caught.value)


def test_generate_refuses_a_max_length_below_one():
    """keras-hub takes max_length=0 for "not given" (it generated the preprocessor's 24 tokens)."""
    lm = make_lm()
    lm.compile(sampler="greedy", generate_jit_compile=False)
    for value in (0, -3, 2.5):
        with pytest.raises(ConfigError, match="max_length must be a whole number of tokens >= 1"):
            lm.generate("ab", max_length=value)
    assert len(lm.generate("ab", max_length=np.int64(6))) == 6
