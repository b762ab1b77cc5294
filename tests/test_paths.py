"""Every path a user gives goes through one check (txl_tf.base.paths): an empty path, the working directory or a folder
above it, home and / are never a folder to replace; a writer replaces only what it wrote itself (its manifest); no
output follows a link. Real commands in subprocesses, real files, a listing with checksums before and after."""

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO_ROOT
from train_utils import prepare_tiny_corpus, run_training, subprocess_env, tiny_params

from txl_tf.base import paths
from txl_tf.base.errors import UserError

BAD_VALUES = ("", ".", "..", "link")  # "link": a symbolic link in the working directory to a folder elsewhere


def listing(*roots) -> dict:
    """{path: sha256 of the content, or the link's target, or 'dir'} of everything under `roots` (links not
    followed)."""
    found = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            found[folder] = "dir"
            for name in dirs + files:
                path = os.path.join(folder, name)
                if os.path.islink(path):
                    found[path] = "-> " + os.readlink(path)
                elif os.path.isfile(path):
                    with open(path, "rb") as f:
                        found[path] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.fixture
def world(tmp_path, monkeypatch):
    """tmp/world/work (the working directory, with a user's file and `link` -> tmp/world/elsewhere); returns
    (world, work)."""
    world = tmp_path / "world"
    work, elsewhere = world / "work", world / "elsewhere"
    work.mkdir(parents=True)
    elsewhere.mkdir()
    (work / "precious.txt").write_text("the user's work")
    (elsewhere / "other.txt").write_text("another folder's file")
    (work / "link").symlink_to(elsewhere, target_is_directory=True)
    monkeypatch.chdir(work)
    return world, work


# ---- the one check ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", BAD_VALUES)
def test_output_dir_refuses_the_working_directory_its_parents_an_empty_path_and_links(world, value):
    with pytest.raises(paths.PathError) as raised:
        paths.output_dir(value, "--out")
    assert "\n" not in str(raised.value) and str(raised.value).startswith("--out")


def test_output_dir_refuses_home_and_root_and_accepts_a_new_folder(world, monkeypatch):
    monkeypatch.setenv("HOME", str(world[0] / "home"))
    for value in (str(world[0] / "home"), os.sep, str(world[0])):
        with pytest.raises(paths.PathError):
            paths.output_dir(value, "--out")
    assert paths.output_dir("new/run", "--out") == "new/run"
    with pytest.raises(paths.PathError, match="must be a path"):
        paths.given(b"out", "--out")


def test_replaceable_dir_replaces_only_what_its_kind_wrote(world):
    from txl_tf.base import staging

    with staging.staged_dir("out", kind="export") as tmp:
        with open(os.path.join(tmp, "saved_model.pb"), "w") as f:
            f.write("x")
    assert paths.read_manifest("out")["files"] == ["saved_model.pb"]
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        paths.replaceable_dir("out", "--export_dir", kind="export", overwrite=False)
    assert paths.replaceable_dir("out", "--export_dir", kind="export", overwrite=True) == "out"
    with pytest.raises(FileExistsError, match="holds no preset written by txl_tf"):
        paths.replaceable_dir("out", "--dir", kind="preset", overwrite=True)
    with open("out/NOTES.txt", "w") as f:
        f.write("mine")
    with pytest.raises(FileExistsError, match=r"did not write there \(NOTES.txt\)"):
        paths.replaceable_dir("out", "--export_dir", kind="export", overwrite=True)


# ---- data loss: an empty path replaced the working directory -----------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data_dir, run_dir): a tiny prepared corpus and a run trained on it for 3 steps."""
    root = tmp_path_factory.mktemp("trained")
    data_dir = prepare_tiny_corpus(str(root))
    run = str(root / "run")
    run_training(run, tiny_params(data_dir, **{"TrainConfig.train_steps": 3}))
    return data_dir, run


def test_save_to_preset_of_an_empty_path_leaves_the_working_directory_alone(world, trained):
    from txl_tf import TransformerXLCausalLM

    lm = TransformerXLCausalLM.from_preset(trained[1])
    before = listing(world[0])
    for value in BAD_VALUES:
        with pytest.raises(UserError):
            lm.save_to_preset(value, overwrite=True)
    assert listing(world[0]) == before
    lm.save_to_preset("preset")
    (world[1] / "preset" / "NOTES.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="NOTES.txt"):
        lm.save_to_preset("preset", overwrite=True)
    assert (world[1] / "preset" / "NOTES.txt").read_text() == "mine"


def _user_env(home) -> dict:
    """A user's environment: TensorFlow's log level left to txl_tf.base.cli (a test's TF_CPP_MIN_LOG_LEVEL shows CUDA
    notices a user never sees), HOME elsewhere (Keras writes ~/.keras)."""
    env = dict(subprocess_env(), HOME=str(home))
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    return env


def test_every_path_argument_of_the_python_api_refuses_bad_paths_in_one_line(world, trained):
    import tensorflow as tf

    from txl_tf import TransformerXLCausalLM, TransformerXLTokenizer, average, export, train
    from txl_tf.data import corpora, prepare
    from txl_tf.model.protocol import Protocol
    from txl_tf.study import report, studies

    data_dir, run = trained
    lm = TransformerXLCausalLM.from_preset(run)
    document = json.loads((REPO_ROOT / "docs" / "reproduction" / "results.json").read_text())
    calls = {
        "TransformerXLCausalLM.from_preset": lambda v: TransformerXLCausalLM.from_preset(v),
        "save_to_preset": lambda v: lm.save_to_preset(v, overwrite=True),
        "train.run(model_dir)": lambda v: train.run(["gin/sample.gin"], tiny_params(data_dir), model_dir=v),
        "train.run(gin_files)": lambda v: train.run([v], tiny_params(data_dir), model_dir="new_run"),
        "export.export_model": lambda v: export.export_model(lm.transformer_xl, v, protocol=Protocol(3), max_len=2),
        "export.write_export": lambda v: export.write_export(lambda d: None, v),
        "prepare.prepare": lambda v: prepare.prepare("enwik8_sample", v, corpora.PrepareSettings(), overwrite=True),
        "average.average": lambda v: average.average([tf.train.latest_checkpoint(run)], v, model_dir=run,
                                                     overwrite=True),
        "TransformerXLTokenizer.from_data_dir": lambda v: TransformerXLTokenizer.from_data_dir(v),
        "studies.run(output_dir)": lambda v: studies.run(["report"], v),
        "report.publish": lambda v: report.publish(document, "results.json", v),
    }
    before = listing(world[0], data_dir, run)
    for name, call in calls.items():
        for value in BAD_VALUES:
            with pytest.raises(UserError) as raised:
                try:
                    call(value)
                except UserError:
                    raise
                except BaseException as error:
                    raise AssertionError(f"{name}({value!r}) raised {error!r}") from error
                else:
                    raise AssertionError(f"{name}({value!r}) did not raise")
            assert "\n" not in str(raised.value).strip(), (name, value, str(raised.value))
    assert listing(world[0], data_dir, run) == before


def _command(module: str, *args, cwd, home) -> subprocess.CompletedProcess:
    env = _user_env(home)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_empty_output_flags_are_one_line_and_change_nothing(world, trained, tmp_path):
    work = world[1]
    before = listing(world[0])
    for module, args in (("txl_tf.data.prepare", ["--dataset=enwik8_sample", "--data_dir=", "--overwrite"]),
                         ("txl_tf.export", [f"--model_dir={trained[1]}", "--export_dir=", "--overwrite"])):
        line = _one_error_line(_command(module, *args, cwd=work, home=tmp_path / "home"))
        assert "is empty" in line
    assert listing(world[0]) == before


def test_prepare_overwrite_keeps_the_users_files_and_refuses_a_source_inside(world, tmp_path):
    from txl_tf.data import corpora
    from txl_tf.data import prepare as prep

    mydata = world[1] / "mydata"
    settings = corpora.PrepareSettings(source=str(tmp_path / "corpus.txt"), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "corpus.txt").write_text("some text to prepare\n" * 100)
    prep.prepare("text", str(mydata), settings)
    inside = mydata / "corpus.txt"
    inside.write_text("some other text\n" * 100)
    with pytest.raises(UserError, match="lies inside --data_dir"):
        prep.prepare("text", str(mydata), corpora.PrepareSettings(source=str(inside), cache_dir=str(tmp_path / "c")),
                     overwrite=True)
    inside.unlink()
    (mydata / "NOTES.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="NOTES.txt"):
        prep.prepare("text", str(mydata), settings, overwrite=True)
    assert (mydata / "NOTES.txt").read_text() == "mine"


def test_convert_refuses_a_training_run(fixture_dir, trained, tmp_path):
    before = listing(trained[1])
    line = _one_error_line(_command("txl_tf.convert", f"--checkpoint={fixture_dir / 'model.ckpt'}",
                                    f"--output_dir={trained[1]}", cwd=REPO_ROOT, home=tmp_path))
    assert "holds no converted checkpoint written by txl_tf" in line
    assert listing(trained[1]) == before


# ---- study --readme and --publish: never in place, never through a link ------------------------------------------
_PUBLISH = textwrap.dedent("""
    import json, resource, signal, sys
    from txl_tf.study import report
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
    document = json.load(open(sys.argv[1]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
    report.publish(document, sys.argv[1], None, readme=sys.argv[2])
""")


def test_study_readme_on_a_full_disk_keeps_the_readme_whole(tmp_path):
    readme = tmp_path / "README.md"
    text = (REPO_ROOT / "README.md").read_text() + "\nThe user's text after the block.\n" + "x" * 20000
    readme.write_text(text)
    results = REPO_ROOT / "docs" / "reproduction" / "results.json"
    result = subprocess.run([sys.executable, "-c", _PUBLISH, str(results), str(readme), str(4096)], cwd=REPO_ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "File too large" in result.stderr, result.stderr
    assert readme.read_text() == text
    assert resource.RLIMIT_FSIZE and signal.SIGXFSZ  # the test's means exist on this platform


def test_study_publish_never_follows_a_link(tmp_path):
    from txl_tf.study import report

    docs, victim, victim_dir = tmp_path / "docs", tmp_path / "victim.md", tmp_path / "victim"
    docs.mkdir()
    victim_dir.mkdir()
    victim.write_text("not the report's")
    (docs / "reproduction.md").symlink_to(victim)
    with pytest.raises(paths.PathError, match="symbolic link"):
        report.check_publish(str(docs), None)
    (docs / "reproduction.md").unlink()
    (docs / "reproduction").symlink_to(victim_dir, target_is_directory=True)
    with pytest.raises(paths.PathError, match="symbolic link"):
        report.check_publish(str(docs), None)
    assert victim.read_text() == "not the report's" and not os.listdir(victim_dir)


# ---- acceptance: every path flag of every command, given "", ".", ".." and a link ---------------------------------
_DRIVER = textwrap.dedent("""
    import contextlib, importlib, io, json, sys, traceback
    from txl_tf.base import cli, errors
    from absl import flags
    module = importlib.import_module(sys.argv[1])
    FLAGS = flags.FLAGS
    module.define_flags(FLAGS)
    results = []
    for argv in json.loads(sys.argv[2]):
        FLAGS.unparse_flags()
        err, code = io.StringIO(), 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rest = errors._parse_flags([sys.argv[1]] + argv)
                errors.guard(lambda a: (cli.check_path_flags(FLAGS), module.main(a)))(rest)
            except SystemExit as stop:
                code = stop.code
            except BaseException:
                code = "traceback"
                err.write(traceback.format_exc())
        results.append([argv, code, err.getvalue()])
    print(json.dumps(results))
""")


def _commands(data_dir: str, run: str, source: str) -> dict:
    """{module: (arguments that work, {path flag: how it is given})} for every command that takes a path."""
    model = [f"--model_dir={run}"]
    return {
        "txl_tf.data.prepare": (["--dataset=text", f"--source={source}", "--data_dir=new_data"],
                                ["data_dir", "source", "cache_dir", "vocab_from"]),
        "txl_tf.train": (["--gin_file=gin/sample.gin", "--model_dir=new_run"], ["model_dir", "gin_file"]),
        "txl_tf.evaluate": (model + ["--token_losses=losses.npy"], ["model_dir", "checkpoint", "gin_file",
                                                                    "token_losses"]),
        "txl_tf.generate": (model + ["--max_tokens=2"], ["model_dir", "checkpoint", "gin_file", "saved_model"]),
        "txl_tf.export": (model + ["--export_dir=new_export"], ["model_dir", "checkpoint", "gin_file",
                                                               "export_dir"]),
        "txl_tf.average": (model + ["--last=1", "--output_dir=new_average"], ["model_dir", "checkpoints",
                                                                             "output_dir"]),
        "txl_tf.convert": (["--checkpoint=missing.ckpt", "--output_dir=new_converted"], ["checkpoint",
                                                                                        "gin_file", "output_dir"]),
        "txl_tf.sweep": (model + ["--grid=mem_len=4"], ["model_dir", "checkpoint", "gin_file", "markdown",
                                                        "json"]),
        "txl_tf.analysis.attention_maps": (model + ["--output=map.png"], ["model_dir", "checkpoint", "gin_file",
                                                                          "output", "logdir"]),
        "txl_tf.study.__main__": (["--study=report", "--output_dir=new_study", f"--data_root={os.path.dirname(data_dir)}"],
                         ["output_dir", "data_root", "publish", "readme"]),
    }


def _with(base: list, flag: str, value: str) -> list:
    """`base` with --flag=value (and without the flags that exclude it)."""
    drop = {"checkpoint": ("--model_dir=",), "saved_model": ("--model_dir=",), "checkpoints": ("--last=",)}
    kept = [a for a in base if not a.startswith((f"--{flag}=", *drop.get(flag, ())))]
    return kept + [f"--{flag}={value}"]


@pytest.mark.slow  # ten commands in subprocesses, 4 values of each of their 36 path flags (~2 minutes on 2 cores)
def test_every_path_flag_of_every_command_refuses_bad_paths_in_one_line(world, trained, tmp_path):
    world_dir, work = world
    source = tmp_path / "corpus.txt"
    source.write_text("some text to prepare\n" * 100)
    before = listing(world_dir, trained[0], trained[1])
    failures = []
    for module, (base, flags) in _commands(trained[0], trained[1], str(source)).items():
        cases = [_with(base, flag, value) for flag in flags for value in BAD_VALUES]
        result = subprocess.run([sys.executable, "-c", _DRIVER, module, json.dumps(cases)], cwd=work,
                                env=_user_env(tmp_path / "home"), capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        for argv, code, stderr in json.loads(result.stdout.splitlines()[-1]):
            lines = [line for line in stderr.splitlines() if line.strip()]
            if code != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
                failures.append(f"{module} {argv}: exit {code}: {stderr[-600:]}")
    assert not failures, "\n".join(failures)
    assert listing(world_dir, trained[0], trained[1]) == before
