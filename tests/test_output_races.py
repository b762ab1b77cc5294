"""Two writers into one new folder (issue 52, item 2): exactly one succeeds, the other is refused in one line naming
the folder, and the folder holds the successful writer's output, whole, with nothing staged left beside it.

Two real worker processes import once and then race round after round, each round into a new folder, meeting at a
barrier of files before each call: txl_tf.base.staging itself (fast), and the real save_to_preset of both faces, prepare
and average (each worker saving or computing something different, so the folder shows whose it is)."""

import json
import os
import subprocess
import sys

import h5py
import pytest
from train_utils import REPO_ROOT, make_run, subprocess_env, tiny_text

from txl_tf.base import paths, staging

ROUNDS = 20

WORKER = r"""
import json, os, sys, time, traceback

root, role, rounds, commands = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
sync = os.path.join(root, "sync")


def barrier(name):
    open(os.path.join(sync, f"{name}.{role}"), "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(sync, f"{name}.{1 - role}")):
        if time.monotonic() > deadline:
            sys.exit(f"worker {role}: the other worker never reached {name}")
        time.sleep(0.0005)


def staging_writer():
    from txl_tf.base import paths, staging

    def write(target):  # as every command does: the check, the work, then the staged write
        paths.replaceable_dir(target, "--export_dir", kind="export", overwrite=False)
        with staging.staged_dir(target, kind="export", name="--export_dir") as tmp:
            with open(os.path.join(tmp, "saved_model.pb"), "w") as f:
                f.write(f"writer {role}")
            time.sleep(0.02)  # a writer takes a while: the other one comes meanwhile
    return write


def hub_preset_writer():
    from txl_tf.configs import EvalConfig, ModelConfig
    from txl_tf.data.vocab import Vocab
    from txl_tf.lm.hub import (TransformerXLBackbone, TransformerXLCausalLM, TransformerXLCausalLMPreprocessor,
                            TransformerXLTokenizer)

    vocab = Vocab(list(range(97, 117)), "char")
    config = ModelConfig(n_layer=1 + role, d_model=8 * (1 + role), n_head=2, d_head=4, d_inner=12, mem_len=4,
                         n_token=len(vocab), dropout=0.0)
    backbone = TransformerXLBackbone(config, EvalConfig(tgt_len=4, mem_len=4, clamp_len=-1, same_length=False))
    lm = TransformerXLCausalLM(backbone, TransformerXLCausalLMPreprocessor(TransformerXLTokenizer(vocab),
                                                                          sequence_length=8))
    return lm.save_to_preset


def prepare_writer():
    from txl_tf.data import corpora, prepare

    settings = corpora.PrepareSettings(source=os.path.join(root, f"source-{role}.txt"), level="char",
                                cache_dir=os.path.join(root, f"cache-{role}"))
    return lambda target: prepare.prepare("text", target, settings)


def average_writer():
    from txl_tf import average

    run = os.path.join(root, "run")
    prefixes = average.last_checkpoints(run, 1 if role == 0 else 3)  # --last=1 and --last=3
    return lambda target: average.average(prefixes, target, model_dir=run)


from txl_tf.base import errors

with open(os.path.join(root, f"results-{role}.jsonl"), "w") as results:
    for command in commands:
        write = globals()[f"{command}_writer"]()
        os.makedirs(os.path.join(root, command), exist_ok=True)
        for round in range(rounds):
            target = os.path.join(root, command, f"round-{round}")
            barrier(f"{command}-{round}")
            try:
                write(target)
                outcome = {"ok": True}
            except Exception as error:
                if errors.is_expected(error):
                    outcome = {"ok": False, "message": str(error), "type": type(error).__name__}
                else:
                    outcome = {"ok": False, "crash": traceback.format_exc()}
            results.write(json.dumps({"command": command, "round": round, "target": target, **outcome}) + "\n")
            results.flush()
"""


def _race(root, commands, rounds=ROUNDS) -> dict:
    """Runs the two workers; returns {(command, round): [worker 0's outcome, worker 1's]}."""
    (root / "sync").mkdir()
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(role), str(rounds), ",".join(commands)],
                                cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for role in (0, 1)]
    logs = [worker.communicate(timeout=600)[0] for worker in workers]
    for role, worker in enumerate(workers):
        assert worker.returncode == 0, f"worker {role} failed:\n{logs[role]}"
    outcomes = {}
    for role in (0, 1):
        for line in (root / f"results-{role}.jsonl").read_text().splitlines():
            outcome = json.loads(line)
            outcomes.setdefault((outcome["command"], outcome["round"]), [None, None])[role] = outcome
    assert len(outcomes) == len(commands) * rounds and all(None not in pair for pair in outcomes.values())
    return outcomes


def _winner(pair) -> int:
    """The one worker that succeeded; the other's refusal is one line naming the folder."""
    for outcome in pair:
        assert "crash" not in outcome, outcome["crash"]
    succeeded = [role for role, outcome in enumerate(pair) if outcome["ok"]]
    assert len(succeeded) == 1, f"{pair[0]['command']} round {pair[0]['round']}: workers {succeeded} both succeeded"
    refused = pair[1 - succeeded[0]]
    assert "\n" not in refused["message"].strip() and refused["target"] in refused["message"], refused
    return succeeded[0]


def _found(value, key):
    """Every value of `key` in a nested JSON document."""
    if isinstance(value, dict):
        return [v for k, v in value.items() if k == key] + [x for v in value.values() for x in _found(v, key)]
    if isinstance(value, list):
        return [x for v in value for x in _found(v, key)]
    return []


def _weight_widths(weights_file) -> set:
    """The sizes of the weights' dimensions in an .h5 weights file (16 only in the model of d_model 16)."""
    widths = set()
    with h5py.File(weights_file, "r") as f:
        f.visititems(lambda name, item: widths.update(item.shape) if isinstance(item, h5py.Dataset) else None)
    return widths


def _whose(command, target) -> int:
    """Which worker's output `target` holds, from its content (each worker writes something different)."""
    if command == "staging":
        return int((target / "saved_model.pb").read_text().split()[-1])
    if command == "hub_preset":
        d_models = set(_found(json.loads((target / "config.json").read_text()), "d_model"))
        assert len(d_models) == 1, d_models
        role = {8: 0, 16: 1}[d_models.pop()]
        assert int(16 in _weight_widths(target / "model.weights.h5")) == role  # its weights too (only 1's have 16)
        return role
    if command == "prepare":
        return _prepared_by(json.loads((target / "metadata.json").read_text()))
    if command == "average":
        return {1: 0, 3: 1}[json.loads((target / "averaged.json").read_text())["mean_of"]]
    raise AssertionError(command)


def _prepared_by(meta) -> int:
    return {SOURCE_TOKENS[0]: 0, SOURCE_TOKENS[1]: 1}[sum(meta["token_counts"].values())]


SOURCE_TOKENS = (len(tiny_text(400, seed=0)), len(tiny_text(300, seed=1)))  # characters of the two sources


def _check(root, commands, outcomes):
    for command in commands:
        folder = root / command
        winners = []
        for round in range(ROUNDS):
            winners.append(_winner(outcomes[(command, round)]))
            assert _whose(command, folder / f"round-{round}") == winners[-1], (command, round)
        assert sorted(os.listdir(folder)) == sorted(f"round-{r}" for r in range(ROUNDS)), "staging left behind"
        refusal = outcomes[(command, 0)][1 - winners[0]]["message"].strip()
        print(f"{command}: {ROUNDS} rounds, exactly one writer succeeded in each (worker 0 {winners.count(0)}, "
              f"worker 1 {winners.count(1)}); the folder held the winner's output each time; refused: {refusal}")


def test_two_writers_of_one_new_folder_one_succeeds_one_is_refused(tmp_path):
    """txl_tf.base.staging alone (no TensorFlow): 20 rounds of two writers that each take 20 ms."""
    outcomes = _race(tmp_path, ["staging"])
    _check(tmp_path, ["staging"], outcomes)


KILLED = r"""
import sys
from txl_tf.base import staging

with staging.staged_dir(sys.argv[1], kind="export", name="--export_dir") as tmp:
    print("claimed", flush=True)
    sys.stdin.readline()  # killed here, holding the claim
"""


def test_a_killed_writers_claim_does_not_hold_back_the_next_writer(tmp_path):
    target = tmp_path / "out"
    writer = subprocess.Popen([sys.executable, "-c", KILLED, str(target)], cwd=REPO_ROOT, env=subprocess_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "claimed\n"
        with pytest.raises(paths.PathError) as raised:  # while it lives: refused, naming it
            with staging.staged_dir(str(target), kind="export", name="--export_dir"):
                pass
        assert "\n" not in str(raised.value) and f"--export_dir={target} is being written by another writer (pid " \
            f"{writer.pid}" in str(raised.value)
    finally:
        writer.kill()
        writer.wait()
    with staging.staged_dir(str(target), kind="export", name="--export_dir") as tmp:
        with open(os.path.join(tmp, "saved_model.pb"), "w") as f:
            f.write("after")
    assert (target / "saved_model.pb").read_text() == "after" and sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("kind", [None, "export"])
def test_a_folder_written_meanwhile_by_a_writer_without_the_lock_is_kept(tmp_path, kind):
    """Another program (no txl_tf lock) fills the new folder while txl_tf stages: txl_tf's rename refuses in one line
    and removes what it staged; the other program's files stay."""
    target = tmp_path / "out"
    with pytest.raises(paths.OutputExistsError) as raised:
        with staging.staged_dir(str(target), kind=kind, name="--export_dir") as tmp:
            with open(os.path.join(tmp, "saved_model.pb"), "w") as f:
                f.write("txl_tf's")
            target.mkdir()
            (target / "theirs.txt").write_text("theirs")
    line = str(raised.value)
    assert "\n" not in line and f"--export_dir={target}" in line and "meanwhile" in line, line
    assert os.listdir(target) == ["theirs.txt"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_save_to_preset_prepare_and_average_racing_into_one_new_folder(tmp_path):
    """~10 s on 2 cores: two workers importing TensorFlow, then 3 x 20 rounds of real writes."""
    (tmp_path / "source-0.txt").write_text(tiny_text(400, seed=0))
    (tmp_path / "source-1.txt").write_text(tiny_text(300, seed=1))
    make_run(tmp_path / "run", [0.0, 0.5, 1.0])
    commands = ["hub_preset", "prepare", "average"]
    outcomes = _race(tmp_path, commands)
    _check(tmp_path, commands, outcomes)
