"""Every attention type of the paper's ablations trains and evaluates with the shipped configuration: gin/sample.gin
with only ModelConfig.attn_type changed, its periodic evaluation and `python -m txl_tf.evaluate`'s code with
the default EvalConfig (kv_cache=True: the keys/values cache, which every type has), and the cache gives the
hidden memory's numbers."""

import math

import pytest
from train_utils import prepare_tiny_corpus, tiny_params

from txl_tf import evaluate, train


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    return prepare_tiny_corpus(str(tmp_path_factory.mktemp("variants")), "char", n_lines=120)


@pytest.mark.parametrize("attn_type", ["xl", "shaw", "vaswani", "al_rfou"])
@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_variant_trains_and_evaluates_with_the_shipped_configuration(attn_type, char_data, tmp_path):
    model_dir = str(tmp_path / attn_type)
    params = tiny_params(char_data, **{"ModelConfig.attn_type": repr(attn_type), "ModelConfig.max_position": 32,
                                       "TrainConfig.eval_every": 3})
    metrics = train.run(gin_files=["gin/sample.gin"], gin_params=params, model_dir=model_dir)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["valid_loss"])  # the periodic evaluation ran
    cached = evaluate.run(model_dir, split="valid", progress=False)
    memory = evaluate.run(model_dir, split="valid", progress=False, gin_params=["EvalConfig.kv_cache = False"])
    assert cached.protocol["state"] == "cache" and memory.protocol["state"] == "memory"
    assert math.isfinite(cached.loss) and abs(cached.loss - memory.loss) < 1e-5
