"""docs/python.md and examples/quickstart.ipynb run as written.

Both read the prepared data at `data/enwik8_sample`, relative to the working directory, and train their own quick
model (`runs/quick`) from it. The tests prepare a tiny character-level corpus at that path in a temporary
directory, then:
  - run every code block of docs/python.md, in order, as one script in a fresh Python process (```python blocks as
    they are, ```bash blocks through bash at that point of the script, with this Python's `python` on PATH);
  - execute the notebook with nbclient in a real ipykernel kernel of this Python.
"""

import os
import pathlib
import re
import shutil
import string
import subprocess
import sys

import pytest
from train_utils import REPO_ROOT, subprocess_env, tiny_text

DOC = pathlib.Path(REPO_ROOT) / "docs" / "python.md"
NOTEBOOK = pathlib.Path(REPO_ROOT) / "examples" / "quickstart.ipynb"
DATA_DIR = "data/enwik8_sample"  # where the doc and the notebook look (what `make run` prepares)
LANGUAGES = ("python", "bash")
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of `markdown`, in order."""
    return [(match.group(1).strip(), match.group(2)) for match in _FENCE.finditer(markdown)]


def doc_script(blocks: list[tuple[str, str]]) -> str:
    """One Python script of the blocks: python ones as they are, bash ones run by bash where they stand."""
    parts = ["import subprocess as _subprocess\n"]
    for number, (language, code) in enumerate(blocks, 1):
        parts.append(f"# ---- block {number} ({language})\n")
        if language == "bash":
            parts.append(f"_subprocess.run({code!r}, shell=True, executable='/bin/bash', check=True)\n")
        else:
            parts.append(code)
    return "".join(parts)


def example_env() -> dict:
    """The environment of the doc's script and the notebook's kernel: the repository importable, this Python's
    `python` first on PATH, TensorFlow's start-up lines quiet."""
    env = subprocess_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    """A directory with a tiny `data/enwik8_sample` (every printable ASCII character in its vocabulary, so that any
    English text can be fine-tuned on)."""
    from txl_tf.data import corpora, prepare

    root = tmp_path_factory.mktemp("sample")
    source = root / "corpus.txt"
    source.write_text(tiny_text(300) + string.ascii_letters + string.digits + string.punctuation + " \t\n")
    data_dir = str(root / DATA_DIR)
    prepare.prepare("text", data_dir, corpora.PrepareSettings(source=str(source), level="char", cache_dir=str(root)))
    source.unlink()
    return root


@pytest.fixture
def workdir(sample_dir, tmp_path):
    """A fresh copy of `sample_dir` (the doc and the notebook write exports and runs beside the sample)."""
    work = tmp_path / "work"
    shutil.copytree(sample_dir, work)
    return work


def test_the_doc_has_code_blocks_and_every_one_runs_in_a_known_language():
    blocks = code_blocks(DOC.read_text())
    assert sum(language == "python" for language, _ in blocks) >= 5, blocks
    assert {language for language, _ in blocks} <= set(LANGUAGES), [language for language, _ in blocks]


def test_the_notebook_is_valid_with_its_outputs_cleared():
    import nbformat

    notebook = nbformat.read(str(NOTEBOOK), as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


def test_code_blocks_and_script():
    blocks = code_blocks("text\n```python\nx = 1\n```\n\n```bash\necho 'hi'\n```\n```\nplain\n```\n")
    assert blocks == [("python", "x = 1\n"), ("bash", "echo 'hi'\n"), ("", "plain\n")]
    script = doc_script(blocks[:2])
    assert "x = 1\n" in script and "_subprocess.run(\"echo 'hi'\\n\", shell=True" in script


@pytest.mark.slow
def test_every_code_block_of_the_python_doc_runs(workdir):
    script = workdir / "python_md.py"
    script.write_text(doc_script(code_blocks(DOC.read_text())))
    result = subprocess.run([sys.executable, str(script)], cwd=workdir, env=example_env(), capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"docs/python.md failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"


@pytest.mark.slow
def test_the_quickstart_notebook_runs_in_a_jupyter_kernel(workdir, monkeypatch):
    import nbclient
    import nbformat

    for name, value in example_env().items():
        monkeypatch.setenv(name, value)  # the kernel inherits this process's environment
    notebook = nbformat.read(str(NOTEBOOK), as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
