"""A results.json of the wrong shape (issue 52, item 13): `python -m txl_tf.study --study=report` names the file, the
first wrong field and the fix in one line, before anything is written, instead of a traceback from the report."""

import copy
import json
import os
import pathlib
import subprocess
import sys

import pytest

from txl_tf.study import results_schema, runs, studies

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED = pathlib.Path(REPO) / "docs" / "reproduction" / "results.json"
FIX = runs.RESULTS_FIX


def published() -> dict:
    return json.loads(PUBLISHED.read_text())


def write(folder: pathlib.Path, document) -> str:
    folder.mkdir(exist_ok=True)
    path = folder / "results.json"
    path.write_text(json.dumps(document))
    return str(path)


def without(document: dict, *keys) -> dict:
    out = copy.deepcopy(document)
    node = out
    for key in keys[:-1]:
        node = node[key]
    del node[keys[-1]]
    return out


def replaced(document: dict, keys: tuple, value) -> dict:
    out = copy.deepcopy(document)
    node = out
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return out


def test_the_published_results_have_the_shape_the_report_reads():
    document = results_schema.read(str(PUBLISHED))
    assert set(document["studies"]) == {"ablation", "context", "context_code", "corpora", "ptb"}


def _cases() -> dict:
    doc = published()
    first_length = str(doc["studies"]["ablation"]["setup"]["lengths"][0])
    lengths = doc["studies"]["ablation"]["setup"]["lengths"]
    models = doc["studies"]["context"]["setup"]["models"]
    return {  # name -> (document, the field and what is wrong with it)
        "a list": ([doc], "the document is a list, not an object"),
        "no studies": ({"schema": 1}, "studies is missing"),
        "studies a list": ({"schema": 1, "studies": []}, "studies is a list, not an object"),
        "a section a list": (replaced(doc, ("studies", "ablation"), []), "studies.ablation is a list, not an object"),
        "no runs": (without(doc, "studies", "ablation", "runs"), "studies.ablation.runs is missing"),
        "no machine": (without(doc, "studies", "ptb", "machine"), "studies.ptb.machine is missing"),
        "evals a list": (replaced(doc, ("studies", "ablation", "runs", "xl", "evals"), []),
                         "studies.ablation.runs.xl.evals is a list, not an object"),
        "a figure a string": (replaced(doc, ("studies", "ablation", "runs", "xl", "evals", first_length, "bpc"),
                                       "2.1"),
                              f"studies.ablation.runs.xl.evals['{first_length}'].bpc is the string '2.1', not a "
                              "number"),
        "a length not scored": (replaced(doc, ("studies", "ablation", "setup", "lengths"), [*lengths, 99999]),
                                "studies.ablation.runs.xl.evals['99999'] is missing (setup.lengths names it)"),
        "a model not trained": (replaced(doc, ("studies", "context", "setup", "models"),
                                         [*models, {"name": "ghost", "vanilla": False}]),
                                "studies.context.runs.ghost is missing (setup.models names it)"),
        "a corpus row a number": (replaced(doc, ("studies", "corpora", "corpora", 1), 7),
                                  "studies.corpora.corpora[1] is 7, not an object"),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_a_wrong_shape_is_one_line_naming_the_file_and_field(tmp_path, case):
    document, problem = _cases()[case]
    path = write(tmp_path / "out", document)
    with pytest.raises(runs.StudyError) as raised:
        studies.run(["report"], str(tmp_path / "out"), data_root=str(tmp_path / "data"))
    assert str(raised.value) == f"{path} is not a study's results.json as this version reads it: {problem}; {FIX}"
    assert os.listdir(tmp_path / "out") == ["results.json"]  # no report, no plot


def test_the_command_on_a_wrong_shape_prints_one_line(tmp_path):
    path = write(tmp_path / "out", without(published(), "studies", "ablation", "comparisons"))
    proc = subprocess.run([sys.executable, "-m", "txl_tf.study", "--study=report", f"--output_dir={tmp_path / 'out'}",
                           f"--data_root={tmp_path / 'data'}"], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {path} is not a study's results.json as this version reads it: studies.ablation.comparisons is "
        f"missing; {FIX}"], proc.stderr[-3000:]
    assert os.listdir(tmp_path / "out") == ["results.json"]


def test_a_study_does_not_start_on_a_wrong_results_json(tmp_path):
    """Checked before any study runs (hours of training would otherwise end in the refusal)."""
    path = write(tmp_path / "out", replaced(published(), ("studies", "ptb", "machine"), []))
    with pytest.raises(runs.StudyError, match="studies.ptb.machine is a list, not an object"):
        studies.run(["ptb"], str(tmp_path / "out"), data_root=str(tmp_path / "data"))
    assert os.listdir(tmp_path) == ["out"] and os.listdir(tmp_path / "out") == ["results.json"]  # nothing prepared
    write(tmp_path / "out", {"schema": 1, "studies": []})
    with pytest.raises(runs.StudyError, match=f"^{path} is not a study's results.json as this version reads it: "
                                              "studies is a list, not an object"):
        runs.write_results(str(tmp_path / "out"), "ptb", {"machine": {}})  # nor merged into
