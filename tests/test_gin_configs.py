"""Every shipped gin file (gin/**/*.gin, found by glob so new files are covered) parses, trains one step and runs its
own evaluation protocol for one segment, with a tiny model on tiny data prepared by the real data pipeline; the
config.gin it writes rebuilds the same configuration through txl_tf.runs.run_dir."""

import glob
import math
import os

import gin
import pytest
from train_utils import REPO_ROOT, prepare_tiny_corpus

from txl_tf import train
from txl_tf.configs import DataConfig, EvalConfig, ModelConfig, TrainConfig, parse_gin
from txl_tf.model.policy import AUTO
from txl_tf.runs import run_dir
from txl_tf.study.runs import PINNED_PATH
from txl_tf.training.autotune import FIELDS as PATH_FIELDS

GIN_FILES = sorted(glob.glob(os.path.join(REPO_ROOT, "gin", "**", "*.gin"), recursive=True))  # gin/study too
WORD_DATASETS = ("wt103", "wt2", "ptb", "lm1b")
PUBLISHED = ("enwik8", "enwik8_large", "text8", "text8_large", "wt103", "wt103_large", "lm1b", "lm1b_large",
             "ptb", "sample")


@pytest.fixture(scope="module")
def tiny_corpora(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("data"))
    return {level: prepare_tiny_corpus(directory, level, n_lines=300) for level in ("char", "word")}


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_every_published_setup_has_a_file():
    names = {os.path.splitext(os.path.basename(p))[0] for p in GIN_FILES}
    assert set(PUBLISHED) | {"common"} <= names


def _setup(path):
    """(dataset, cutoffs, the training-path fields left "auto") the file binds, read with a placeholder DATA_DIR."""
    parse_gin([path], ["DATA_DIR = 'unused'", "DataConfig.dataset = 'text'"] if path.endswith("common.gin")
                    else ["DATA_DIR = 'unused'"])
    dataset, cutoffs, train_config = DataConfig().dataset, ModelConfig().cutoffs, TrainConfig()
    gin.clear_config()
    return dataset, cutoffs, {f for f in PATH_FIELDS if getattr(train_config, f) == AUTO}


def _pinned(auto_fields):
    """PINNED_PATH's bindings of the fields a file leaves "auto". Timing the candidate paths (txl_tf.training.autotune, ~15 s
    a model where the choices cache lacks it, as on a fresh machine) is left to common.gin here and to
    tests/test_autotune.py; the other files keep every value they set themselves."""
    return [b for b in PINNED_PATH if any(b.startswith(f"TrainConfig.{field} =") for field in auto_fields)]


# The large setups and lm1b (~7-9 s each: their vocabularies' adaptive softmax) train in CI's slow phase.
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow)
                                  if "_large" in os.path.basename(p) or os.path.basename(p) == "lm1b.gin" else p
                                  for p in GIN_FILES], ids=[os.path.basename(p) for p in GIN_FILES])
def test_gin_file_trains_one_step_and_evaluates(path, tiny_corpora, tmp_path, clean_gin):
    dataset, cutoffs, auto_fields = _setup(path)
    data_dir = tiny_corpora["word" if dataset in WORD_DATASETS else "char"]
    params = [
        f"DATA_DIR = '{data_dir}'",
        # Tiny sizes; everything else (cutoffs' count, div_val, tie_projs, untie_r, dropout, precision, the
        # evaluation protocol's lengths) stays as the file sets it.
        "ModelConfig.n_layer = 1", "ModelConfig.d_model = 64", "ModelConfig.n_head = 2", "ModelConfig.d_head = 8",
        "ModelConfig.d_inner = 32", "ModelConfig.mem_len = 5", "ModelConfig.d_embed = None",
        "TrainConfig.batch_size = 4", "TrainConfig.tgt_len = 6", "TrainConfig.train_steps = 1",
        "TrainConfig.warmup_steps = 0", "TrainConfig.eval_every = 1", "TrainConfig.eval_steps = 1",
        "TrainConfig.log_every = 1", "TrainConfig.sample_tokens = 0", "TrainConfig.measure_mfu = False",
        "EvalConfig.batch_size = 3",
    ]
    if cutoffs:  # as many adaptive bins as the file, scaled to the tiny vocabulary
        params.append(f"ModelConfig.cutoffs = {tuple(10 * (i + 1) for i in range(len(cutoffs)))}")
    if path.endswith("common.gin"):
        params.append("DataConfig.dataset = 'text'")
        assert auto_fields == set(PATH_FIELDS)  # so this one run chooses its path by measurement (or the cache)
    else:
        params.extend(_pinned(auto_fields))
    metrics = train.run([path], params, model_dir=str(tmp_path))
    assert metrics["step"] == 1
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["valid_loss"])
    expected = (ModelConfig(), EvalConfig())
    configs = run_dir.read_configs(str(tmp_path))  # the written config.gin alone
    assert (configs.model, configs.eval) == expected
    assert configs.data.data_dir == data_dir
