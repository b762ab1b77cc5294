"""Greedy generation in every Keras dtype policy (issue 53, item 2): a preset loaded with `dtype=` generates, and
in mixed_bfloat16 gives the text of the plain model in the same policy (decoded by its own calls)."""

import keras_hub
import pytest
from hub_utils import PROMPTS, plain_greedy, tiny_lm

MAX_LENGTH = 24


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dtypes") / "preset")
    tiny_lm().save_to_preset(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "mixed_bfloat16", "float16"])
def test_a_preset_loaded_in_any_dtype_policy_generates_greedily(preset, dtype):
    lm = keras_hub.models.CausalLM.from_preset(preset, dtype=dtype)
    assert lm.backbone.transformer_xl.dtype_policy.name == dtype
    lm.compile(sampler="greedy", generate_jit_compile=False)
    out = lm.generate(PROMPTS, max_length=MAX_LENGTH)
    assert [text[:len(prompt)] for text, prompt in zip(out, PROMPTS, strict=True)] == PROMPTS
    assert [len(text) for text in out] == [MAX_LENGTH] * len(PROMPTS)
    if dtype in ("float32", "mixed_bfloat16"):  # float32 arithmetic where it matters: no tie flips the argmax
        assert out == plain_greedy(lm, PROMPTS, MAX_LENGTH)


def test_mixed_bfloat16_generates_under_xla_as_in_the_graph(preset):
    """The default compile (XLA for the relative encodings) against the plain graph: the same text."""
    lm = keras_hub.models.CausalLM.from_preset(preset, dtype="mixed_bfloat16")
    lm.compile(sampler="greedy")
    compiled = lm.generate(PROMPTS, max_length=MAX_LENGTH)
    lm.compile(sampler="greedy", generate_jit_compile=False)
    assert compiled == lm.generate(PROMPTS, max_length=MAX_LENGTH)
