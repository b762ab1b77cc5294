"""`python -m txl_tf.evaluate` on the converted golden fixture, fed as a tiny prepared dataset."""

import os
import subprocess
import sys

import gin
import numpy as np
import pytest
import tensorflow as tf

from txl_tf import evaluate
from txl_tf.data.records import write_prepared
from txl_tf.data.vocab import Vocab

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The fixture's lengths: tgt_len 5, mem_len 7, batch 3, same_length False, clamp_len -1. Its 3 streams of 16
# tokens, laid end to end, are exactly the authors' batching ("original" layout) of a 48-token split.
CONFIG = """
DATA_DIR = '{data_dir}'
DataConfig.data_dir = %DATA_DIR
DataConfig.dataset = 'golden'
EvalConfig.tgt_len = 5
EvalConfig.mem_len = 7
EvalConfig.clamp_len = -1
EvalConfig.same_length = False
EvalConfig.batch_size = 3
EvalConfig.layout = 'original'
"""


@pytest.fixture(autouse=True)
def _clean_gin():
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def golden_model_dir(tmp_path_factory, fixture_dir_module):
    from txl_tf import convert

    tmp = tmp_path_factory.mktemp("golden")
    golden = np.load(fixture_dir_module / "golden.npz")
    vocab = Vocab(list(range(50)), "char")  # ids 0..49 are the fixture's tokens
    write_prepared(str(tmp / "data"), dataset="golden", vocab=vocab,
                   splits={"test": golden["tokens"].T.reshape(-1).astype(np.int32)}, source={}, options={})
    model = convert.from_original_tf(str(fixture_dir_module / "model.ckpt"), mem_len=7)
    converted = tmp / "converted"
    tf.train.Checkpoint(model=model).save(str(converted / "ckpt"))
    fields = ("n_token", "n_layer", "d_model", "n_head", "d_head", "d_inner")
    (converted / "model.gin").write_text("".join(f"ModelConfig.{k} = {getattr(model, k)}\n" for k in fields))
    (tmp / "eval.gin").write_text(CONFIG.format(data_dir=tmp / "data"))
    expected = np.mean([golden[f"nll_{s}"].mean() for s in range(3)])
    return tmp, expected, golden


@pytest.fixture(scope="module")
def fixture_dir_module():
    from conftest import FIXTURE_DIR

    if not (FIXTURE_DIR / "golden.npz").exists():
        pytest.skip(f"golden fixtures not found at {FIXTURE_DIR}")
    return FIXTURE_DIR


def test_cli_gives_golden_mean_nll(golden_model_dir):
    tmp, expected, golden = golden_model_dir
    losses = tmp / "nll.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "txl_tf.evaluate", f"--checkpoint={tmp / 'converted'}",
         f"--gin_file={tmp / 'eval.gin'}", "--split=test", f"--token_losses={losses}", "--noprogress"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("loss "))
    assert abs(float(line.split()[1]) - expected) < 1e-5, proc.stdout
    assert "tokens 45" in line
    assert "protocol: protocol=xl, tgt_len=5, mem_len=7, clamp_len=-1, same_length=False, batch_size=3" in proc.stdout
    per_token = np.concatenate([golden[f"nll_{s}"] for s in range(3)]).T.reshape(-1)  # stream by stream
    np.testing.assert_allclose(np.loadtxt(losses), per_token, atol=1e-5)


def test_run_overrides_by_gin_param(golden_model_dir):
    tmp, expected, _ = golden_model_dir
    common = dict(checkpoint=str(tmp / "converted"), gin_files=[str(tmp / "eval.gin")], progress=False)
    cached = evaluate.run(**common, gin_params=["EvalConfig.kv_cache = False"])
    assert abs(cached.loss - expected) < 1e-5 and cached.protocol["state"] == "memory"
    longer = evaluate.run(**common, gin_params=["EvalConfig.mem_len = 12", "EvalConfig.layout = 'corpus'"])
    assert longer.protocol["mem_len"] == 12 and longer.num_tokens == 47  # every token after the first
    with pytest.raises(ValueError, match="EvalConfig.protocol"):
        evaluate.run(**common, gin_params=["EvalConfig.protocol = 'sliding'"])
