"""Fine-tuning: a new text prepared in an existing vocabulary (`prepare --vocab_from`) and a run started from a
converted checkpoint (`TrainConfig.init_checkpoint`: weights only, fresh optimizer, step 0, zero memory)."""

import re

import numpy as np
import pytest
from golden_utils import ARCHITECTURE, MEM_LEN, PROTOCOL, convert_golden, golden_data, golden_model
from train_utils import make_trainer, tiny_controller, tiny_text

from txl_tf.configs import EvalConfig, ModelConfig, TrainConfig
from txl_tf.data import corpora, pipeline, prepare
from txl_tf.data.sources import SourceError
from txl_tf.data.vocab import Vocab
from txl_tf.evaluation import loops as evaluation
from txl_tf.model.protocol import Protocol
from txl_tf.training.controller import default_actions

# 50 byte values, one per id of the golden fixture's 50-token vocabulary.
SYMBOLS = list(b"\n .abcdefghijklmnopqrstuvwxyz0123456789,;:!?'-()AT")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(converted dir, base data_dir with the 50-symbol vocabulary, fine-tuning data_dir prepared in it)."""
    tmp = tmp_path_factory.mktemp("finetune")
    converted = convert_golden(tmp / "converted")
    base, _ = golden_data(tmp / "base", SYMBOLS)
    text = tmp / "text"
    text.mkdir()
    for split, (lines, seed) in {"train": (300, 0), "valid": (30, 1), "test": (30, 2)}.items():
        (text / f"{split}.txt").write_text(tiny_text(lines, seed))
    data = str(tmp / "data")
    prepare.prepare("text", data, corpora.PrepareSettings(source=str(text), vocab_from=base, cache_dir=str(tmp)))
    return converted, base, data


def make_run(data_dir, model_dir, lines=None, **train):
    """A Controller (the loop) around a Trainer (the step) of the golden architecture."""
    settings = dict(batch_size=3, tgt_len=5, train_steps=20, warmup_steps=0, learning_rate=3e-3, steps_per_loop=5,
                    log_every=5, eval_every=0, checkpoint_every=0, sample_tokens=0, measure_mfu=False,
                    mixed_precision=False, jit_compile=False, kernels="tf")
    settings.update(train)
    trainer = make_trainer(ModelConfig(**ARCHITECTURE, mem_len=MEM_LEN, dropout=0.0, dropatt=0.0),
                           TrainConfig(**settings), data_dir)
    actions = default_actions(trainer, EvalConfig(**PROTOCOL), data_dir=data_dir, vocab=pipeline.load_vocab(data_dir))
    return tiny_controller(trainer, model_dir, data_dir, actions=actions,
                           log=(lines.append if lines is not None else lambda line: None))


def valid_loss(model, data_dir):
    tokens = pipeline.read_split(data_dir, "valid")
    return evaluation.evaluate_tokens(model, tokens, tgt_len=5, protocol=Protocol(7), batch_size=3).loss


def test_vocab_from_gives_the_base_vocabulary(setup):
    _, base, data = setup
    assert Vocab.load(f"{data}/vocab.json") == Vocab.load(f"{base}/vocab.json")
    ids = pipeline.read_split(data, "valid")
    assert Vocab.load(f"{data}/vocab.json").decode(ids) == tiny_text(30, 1)


def test_init_checkpoint_sets_the_weights_only(setup, tmp_path):
    converted, _, data = setup
    run = make_run(data, tmp_path / "run", init_checkpoint=str(converted))
    trainer = run.trainer
    assert run.init_weights(str(converted)).endswith("ckpt-1")
    for mine, theirs in zip(trainer.model.trainable_variables, golden_model().trainable_variables, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy(), err_msg=mine.path)
    assert int(trainer.optimizer.iterations.numpy()) == 0 and int(trainer.step_var.numpy()) == 0


def test_finetuning_the_converted_fixture_lowers_the_loss(setup, tmp_path):
    converted, _, data = setup
    lines = []
    run = make_run(data, tmp_path / "run", lines, init_checkpoint=str(converted))
    before = valid_loss(golden_model(), data)
    run.train()
    after = valid_loss(run.trainer.model, data)
    assert any(line.startswith("fine-tuning: weights from") and "ckpt-1" in line for line in lines), lines
    train_losses = [float(m.group(1)) for line in lines if (m := re.search(r"\| loss ([\d.]+)", line))]
    assert len(train_losses) == 4 and train_losses[-1] < train_losses[0], lines
    assert after < before - 0.2, (before, after)  # 3.92 -> 3.62 nats in 20 steps


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_a_resumed_run_ignores_init_checkpoint(setup, tmp_path):
    converted, _, data = setup
    make_run(data, tmp_path / "run", train_steps=2, steps_per_loop=2, log_every=2).train()
    lines = []
    make_run(data, tmp_path / "run", lines, train_steps=4, steps_per_loop=2, log_every=2,
                 init_checkpoint=str(converted)).train()
    assert any("init_checkpoint" in line and "ignored: resuming" in line for line in lines), lines
    assert not any(line.startswith("fine-tuning") for line in lines)


# ---- unknown symbols under --vocab_from ----------------------------------------------------------------------
TEXTS = {"train": b"a b c\nd c\n", "valid": b"a\n", "test": b"b\n"}


def test_unknown_words_become_unk_where_the_vocabulary_has_one(capsys):
    vocab = Vocab(["<eos>", "<unk>", "a", "b"], "word", eos="<eos>", unk="<unk>")
    splits = corpora.encode_in_vocab(vocab, TEXTS, "base")
    assert splits["train"].tolist() == [2, 3, 1, 0, 1, 1, 0]
    assert "3 occurrences of 2 words not in the vocabulary of base become '<unk>'" in capsys.readouterr().err


def test_unknown_words_without_unk_are_named_with_the_count():
    vocab = Vocab(["<eos>", "a", "b"], "word", eos="<eos>")
    with pytest.raises(SourceError, match=r"3 occurrences of 2 words .* no unknown symbol; e.g. 'c' \(2\), 'd' \(1\)$"):
        corpora.encode_in_vocab(vocab, TEXTS, "base")


def test_unknown_bytes_are_named_with_the_count():
    vocab = Vocab(list(b"ab \n"), "char")
    with pytest.raises(SourceError, match=r"3 occurrences of 2 bytes .* e.g. 'c' \(2\), 'd' \(1\)$"):
        corpora.encode_in_vocab(vocab, TEXTS, "base")
