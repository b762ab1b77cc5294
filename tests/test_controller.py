"""txl_tf.training.controller (the loop and its actions): cadence, actions at their steps, checkpoints (latest and best/),
resume, summaries, the non-finite stop and a stop request, with real trainers on real TFRecords."""

import glob
import os
import signal

import numpy as np
import pytest
import tensorflow as tf
from train_utils import in_memory_trainer, prepare_tiny_corpus, tiny_controller, tiny_trainer

from txl_tf.runs import loading, run_dir
from txl_tf.training.controller import Action, CheckpointManagers, Controller
from txl_tf.training.trainer import NonFiniteLossError


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("data")), "char")


class Recorder(Action):
    """Records (name, step, optimizer steps done, latest checkpoint) at each call; returns {name: step}."""

    def __init__(self, name, every, calls):
        super().__init__(every)
        self.name, self.calls = name, calls

    def __call__(self, controller, step):
        latest = tf.train.latest_checkpoint(controller.model_dir)
        done = int(controller.trainer.optimizer.iterations.numpy())
        self.calls.append((self.name, step, done, latest and os.path.basename(latest)))
        return {self.name: step}


def weights(trainer):
    return [v.numpy() for v in trainer.model.trainable_variables]


def test_host_loops_end_at_every_cadence_boundary(char_data, tmp_path):
    trainer = tiny_trainer(char_data, train_steps=20, steps_per_loop=5, log_every=3, checkpoint_every=4)
    controller = tiny_controller(trainer, tmp_path, actions=[Recorder("a", 7, [])])
    step, ends = 0, []
    while step < 20:
        step = controller.next_boundary(step)
        ends.append(step)
    assert ends == [3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 15, 16, 18, 20]
    controller.actions.append(Recorder("b", 11, []))
    assert controller.next_boundary(10) == 11 and controller.next_boundary(18) == 20  # never past train_steps


def test_actions_run_at_their_steps_in_order_before_the_checkpoint(char_data, tmp_path):
    calls = []
    trainer = tiny_trainer(char_data, train_steps=7, steps_per_loop=4, log_every=7, checkpoint_every=3)
    controller = tiny_controller(trainer, tmp_path, actions=[Recorder("a", 3, calls), Recorder("b", 2, calls)])
    metrics = controller.train()
    assert calls == [("b", 2, 2, None), ("a", 3, 3, None), ("b", 4, 4, "ckpt-3"), ("a", 6, 6, "ckpt-3"),
                     ("b", 6, 6, "ckpt-3"), ("a", 7, 7, "ckpt-6"), ("b", 7, 7, "ckpt-6")]
    assert metrics["a"] == metrics["b"] == metrics["step"] == 7 and np.isfinite(metrics["loss"])
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-7")


class SaveBest(Action):
    """Saves with the controller's best-checkpoint manager at its steps (as the evaluation does on a new best)."""

    def __call__(self, controller, step):
        controller.save(step, controller.checkpoints.best)
        return {}


def _steps(directory):
    return sorted(int(name[5:-6]) for name in os.listdir(directory) if name.endswith(".index"))


def test_the_controller_saves_through_the_checkpoint_managers_it_is_given(tmp_path):
    """Managers over folders of the test's choosing (not model_dir) and an in-memory trainer: the periodic
    checkpoints go to `latest` (pruned to its max_to_keep), the best ones to `best`; they restore the step."""
    trainer = in_memory_trainer(train_steps=4, steps_per_loop=1, checkpoint_every=1)
    latest, best = tmp_path / "latest", tmp_path / "kept"
    checkpoints = CheckpointManagers(
        latest=tf.train.CheckpointManager(trainer.checkpoint, str(latest), max_to_keep=2,
                                          step_counter=trainer.step_var),
        best=tf.train.CheckpointManager(trainer.checkpoint, str(best), max_to_keep=1, step_counter=trainer.step_var))
    lines = []
    metrics = Controller(trainer, checkpoints, model_dir=str(tmp_path / "run"), level="word",
                         actions=[SaveBest(every=3)], log=lines.append).train()
    assert metrics["step"] == 4 and np.isfinite(metrics["ppl"])
    assert _steps(latest) == [3, 4] and _steps(best) == [4]
    assert not glob.glob(str(tmp_path / "run" / "ckpt-*"))
    assert [line.split(" |")[0] for line in lines if line.startswith("step")] == [f"step {s:>7d}/4" for s in range(1, 5)]
    again = in_memory_trainer(train_steps=4)
    again.restore_checkpoint(str(best / "ckpt-4"))
    assert int(again.step_var.numpy()) == 4 and int(again.optimizer.iterations.numpy()) == 4


def _event_tags(directory):
    tags = set()
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(value.tag for value in event.summary.value)
    return tags


def test_default_actions_evaluate_keep_the_best_and_sample_and_the_list_extends(char_data, tmp_path):
    lines, calls = [], []
    config_str = "ModelConfig.n_layer = 2\n"
    trainer = tiny_trainer(char_data, train_steps=4, eval_every=2, checkpoint_every=2, sample_tokens=5)
    controller = tiny_controller(trainer, tmp_path, char_data, config_str=config_str, log=lines.append)
    controller.actions.append(Recorder("extra", 4, calls))
    metrics = controller.train()
    assert metrics["step"] == 4 and np.isfinite(metrics["valid_bpc"]) and calls == [("extra", 4, 4, "ckpt-2")]
    valid = [line for line in lines if line.startswith("valid step")]
    assert [line.split(":")[0] for line in valid] == ["valid step 2", "valid step 4"] and "new best" in valid[0]
    assert len([line for line in lines if line.startswith("sample: '[")]) == 2
    with open(tmp_path / "config.gin") as f:
        assert config_str in f.read()
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-4")
    best = run_dir.find_checkpoint(str(tmp_path), "best")
    assert os.path.dirname(best) == str(tmp_path / "best")
    reader = tf.train.load_checkpoint(best)
    assert reader.get_tensor("best_valid_loss/.ATTRIBUTES/VARIABLE_VALUE") == float(trainer.best_loss.numpy())
    # The pinned key `model`: evaluate's restore rebuilds the model and gets the trained weights.
    model = loading.build_model(trainer.model_config, trainer.n_token)
    loading.restore_weights(model, tf.train.latest_checkpoint(str(tmp_path)))
    for a, b in zip(model.trainable_variables, trainer.model.trainable_variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert {"loss", "bpc", "learning_rate", "grad_norm", "tokens_per_second", "step_time", "config"} <= \
        _event_tags(str(tmp_path / "train"))
    assert {"loss", "bpc", "sample"} <= _event_tags(str(tmp_path / "valid"))


def test_resume_restores_step_memory_and_optimizer(char_data, tmp_path):
    first = tiny_trainer(char_data, train_steps=2, checkpoint_every=2)
    tiny_controller(first, tmp_path, char_data).train()
    saved = (first.saved_mems.numpy(), weights(first), int(first.optimizer.iterations.numpy()))
    second = tiny_trainer(char_data, train_steps=2)
    tiny_controller(second, tmp_path, char_data)
    assert int(second.step_var.numpy()) == 2
    np.testing.assert_array_equal(second.saved_mems.numpy(), saved[0])
    for a, b in zip(weights(second), saved[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(second.optimizer.iterations.numpy()) == saved[2] == 2


def test_nonfinite_stop_raises_and_writes_no_checkpoint(char_data, tmp_path):
    trainer = tiny_trainer(char_data, model=dict(init_std=1e30, proj_init_std=1e30), checkpoint_every=1)
    with pytest.raises(NonFiniteLossError, match="nonfinite='skip'"):
        tiny_controller(trainer, tmp_path, char_data).train()
    assert tf.train.latest_checkpoint(str(tmp_path)) is None


class Terminate(Action):
    """Sends this process SIGTERM once (as a preemption would), after checking the controller handles it."""

    def __init__(self, every, before):
        super().__init__(every)
        self.before = before

    def __call__(self, controller, step):
        if signal.getsignal(signal.SIGTERM) is self.before:  # not installed: SIGTERM would end pytest
            raise AssertionError("the controller's SIGTERM handler is not installed")
        if step == self.every:
            os.kill(os.getpid(), signal.SIGTERM)
        return {}


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_sigterm_saves_at_the_host_loop_boundary_and_puts_the_handler_back(char_data, tmp_path):
    lines = []
    before = signal.getsignal(signal.SIGTERM)
    trainer = tiny_trainer(char_data, train_steps=50, steps_per_loop=1)
    metrics = tiny_controller(trainer, tmp_path, actions=[Terminate(2, before)], log=lines.append).train()
    assert metrics["step"] == 2 and tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-2")
    assert lines[-1].startswith("stopped at step 2 on request") and "Re-run the same command" in lines[-1]
    assert signal.getsignal(signal.SIGTERM) is before
    resumed = tiny_trainer(char_data, train_steps=50)
    tiny_controller(resumed, tmp_path, char_data)
    assert int(resumed.step_var.numpy()) == 2


@pytest.mark.parametrize("measured,said", [(1e12, 1), (1.0, 0)], ids=["far below", "at the rate"])
def test_training_well_below_the_rate_its_path_was_measured_at_is_said_once(tmp_path, measured, said):
    """The trainer's own tokens/s against the autotuner's rate of its path (issue 55): said once, from the second
    logged window on, when it runs below 70% of it; nothing when it holds."""
    from txl_tf.training import autotune

    trainer = in_memory_trainer(train_steps=5, steps_per_loop=1, log_every=1)
    trainer.path_measured = {trainer.path.describe(): measured}
    lines = []
    tiny_controller(trainer, tmp_path / "run", actions=[], log=lines.append).train()
    lines = [line for line in lines if "was measured at" in line]
    assert len(lines) == said
    if said:
        assert lines[0].startswith("training at ") and f"below the 1,000,000,000,000 its path ({trainer.path.describe()})" \
            in lines[0] and lines[0].endswith(f"({autotune.MEASURE_ENV}=measure times every candidate again)")
