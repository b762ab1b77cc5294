"""txl_tf.configs: ModelConfig.model_kwargs (n_token filling, its errors), gin binding of the dataclasses, and the
checks of every config: finite floats, a seed NumPy takes, model sizes and evaluation lengths bounded by the
machine's memory before anything is built."""

import dataclasses
import glob
import os

import gin
import pytest

from txl_tf import configs
from txl_tf.base.errors import ConfigError
from txl_tf.configs import GIN_DIR, DataConfig, EvalConfig, ModelConfig, TrainConfig, parse_configs


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_model_kwargs_fills_unset_n_token_from_the_data():
    kwargs = ModelConfig(n_layer=3, d_model=24).model_kwargs(n_token=205)
    assert kwargs["n_token"] == 205
    assert (kwargs["n_layer"], kwargs["d_model"]) == (3, 24)
    # Every field reaches the model, nothing else does.
    assert set(kwargs) == {f.name for f in dataclasses.fields(ModelConfig)}


def test_model_kwargs_keeps_a_bound_n_token_that_matches():
    assert ModelConfig(n_token=267).model_kwargs(n_token=267)["n_token"] == 267
    assert ModelConfig(n_token=267).model_kwargs()["n_token"] == 267


def test_model_kwargs_mismatch_names_both_sizes_and_the_fix():
    with pytest.raises(ValueError) as err:
        ModelConfig(n_token=204).model_kwargs(n_token=27)
    message = str(err.value)
    assert "n_token=204" in message and "27" in message
    assert "DataConfig.data_dir" in message


def test_model_kwargs_without_any_vocabulary_size_fails():
    with pytest.raises(ValueError, match="n_token is unset"):
        ModelConfig().model_kwargs()


def test_model_kwargs_turns_gin_lists_into_tuples():
    kwargs = ModelConfig(n_token=31, cutoffs=[7, 19], tie_projs=[False, True, True]).model_kwargs()
    assert kwargs["cutoffs"] == (7, 19)
    assert kwargs["tie_projs"] == (False, True, True)
    assert ModelConfig(n_token=31).model_kwargs()["tie_projs"] is None


def test_gin_bindings_reach_every_config(clean_gin):
    gin.parse_config(
        """
        ModelConfig.n_layer = 2
        ModelConfig.cutoffs = [11, 23]
        DataConfig.dataset = 'wt103'
        TrainConfig.batch_size = 6
        TrainConfig.mixed_precision = True
        EvalConfig.mem_len = 37
        """
    )
    model = ModelConfig()
    assert (model.n_layer, model.cutoffs, model.d_model) == (2, [11, 23], 512)
    assert DataConfig().dataset == "wt103"
    train = TrainConfig()
    assert (train.batch_size, train.mixed_precision, train.tgt_len) == (6, True, 512)
    assert EvalConfig().mem_len == 37
    # An explicit argument still wins over the binding.
    assert ModelConfig(n_layer=5).n_layer == 5


def test_gin_rejects_a_field_that_does_not_exist(clean_gin):
    with pytest.raises(ValueError, match="n_layers"):
        gin.parse_config("ModelConfig.n_layers = 2")


# ---- issue 34: every float finite, every size bounded before anything is built ----------------------------------
def _float_fields():
    import typing

    for cls in (ModelConfig, DataConfig, TrainConfig, EvalConfig):
        for field in dataclasses.fields(cls):
            if float in typing.get_args(typing.get_type_hints(cls)[field.name]) + (
                    typing.get_type_hints(cls)[field.name],):
                yield cls, field.name


FLOAT_FIELDS = list(_float_fields())


@pytest.mark.parametrize("cls,name", FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_every_float_field_must_be_finite(cls, name, value):
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{name}={value!r} must be a finite number; fix the "
                                          rf"binding `{cls.__name__}\.{name} = \.\.\.`"):
        cls(**{name: value})


def test_float_fields_are_the_ones_expected():
    """The finiteness check covers every float field (a new one is covered without a new test)."""
    assert {f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS} >= {
        "ModelConfig.layer_norm_epsilon", "ModelConfig.init_std", "ModelConfig.proj_init_std", "ModelConfig.dropout",
        "TrainConfig.learning_rate", "TrainConfig.clip_norm", "TrainConfig.adam_epsilon"}


def test_an_infinite_gin_binding_is_one_line(clean_gin):
    with pytest.raises(ConfigError, match=r"^ModelConfig\.init_std=inf must be a finite number"):
        parse_configs(["gin/sample.gin"], ["DATA_DIR = 'unused'", "ModelConfig.init_std = 1e999"])


def test_seed_must_be_one_numpy_takes(clean_gin):
    with pytest.raises(ConfigError, match=r"^TrainConfig\.seed=99999999999999999999999 must be in \[0, 4294967295\]"):
        TrainConfig(seed=99999999999999999999999)
    with pytest.raises(ConfigError, match=r"^TrainConfig\.seed=-1 must be in \[0, 4294967295\]"):
        TrainConfig(seed=-1)
    assert TrainConfig(seed=2**32 - 1).seed == 2**32 - 1
    with pytest.raises(ConfigError, match=r"^TrainConfig\.seed=99999999999999999999999 must be in"):
        parse_configs(["gin/sample.gin"], ["DATA_DIR = 'unused'", "TrainConfig.seed = 99999999999999999999999"])


TINY = dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128)
# Sizes far from any machine's memory (hundreds of TiB and more), so that every outcome is the same everywhere.
SIZES = [
    ("n_layer", dict(n_layer=1_000_000), r"^ModelConfig\.n_layer=1000000 must be in \[1, 1024\]; fix the binding"),
    ("n_head", dict(n_head=10**400),
     r"^ModelConfig\.n_head=10{56}\.\.\. must be in \[1, 2147483647\]; fix the binding"),
    ("d_model", dict(d_model=10**9), r"^ModelConfig\.d_model=1000000000: a model of these sizes needs about [\d,.]+ "
                                     r"TiB of memory, more than the [\d,.]+ [GT]iB of this machine; lower "
                                     r"ModelConfig\.d_model \(its binding in the gin file or --gin_param, or the "
                                     r"preset's config\.json\)"),
    ("n_token", dict(n_token=10**9, d_model=65536),
     r"^ModelConfig\.n_token=1000000000: a model of these sizes needs about [\d,.]+ TiB of memory"),
    ("d_inner", dict(d_inner=2**31 - 1, d_model=4096),
     r"^ModelConfig\.d_inner=2147483647: a model of these sizes needs about [\d,.]+ TiB of memory"),
]


@pytest.mark.parametrize("sizes,message", [s[1:] for s in SIZES], ids=[s[0] for s in SIZES])
def test_model_sizes_are_bounded_before_building(sizes, message):
    with pytest.raises(ConfigError, match=message) as raised:
        ModelConfig(**{**TINY, **sizes})
    assert len(str(raised.value).split("\n")[0]) < 300  # one line (gin adds its "In call to configurable" below)


def test_a_vocabulary_too_large_for_the_model_is_refused_before_building():
    config = ModelConfig(**{**TINY, "d_model": 65536})
    with pytest.raises(ConfigError, match=r"^the vocabulary's 1000000000 symbols \(ModelConfig\.n_token\): a model of "
                                          r"these sizes needs about [\d,.]+ TiB of memory, more than the .*; use "
                                          r"data with a smaller vocabulary"):
        config.model_kwargs(n_token=10**9)
    assert config.model_kwargs(n_token=200)["n_token"] == 200


def test_gin_bindings_of_oversized_models_are_one_line(clean_gin):
    with pytest.raises(ConfigError, match=r"^ModelConfig\.n_layer=1000000 must be in \[1, 1024\]"):
        parse_configs(["gin/sample.gin"], ["DATA_DIR = 'unused'", "ModelConfig.n_layer = 1000000"])
    with pytest.raises(ConfigError, match=r"^ModelConfig\.d_model=1000000000: a model of these sizes needs"):
        parse_configs(["gin/sample.gin"], ["DATA_DIR = 'unused'", "ModelConfig.d_model = 1000000000"])


@pytest.mark.parametrize("lengths,named", [
    (dict(batch_size=1, tgt_len=8, mem_len=2**31 - 1), "EvalConfig.mem_len=2147483647"),
    (dict(batch_size=1, tgt_len=10**9, mem_len=16), "EvalConfig.tgt_len=1000000000"),
    (dict(batch_size=10**9, tgt_len=80, mem_len=16), "EvalConfig.batch_size=1000000000"),
], ids=["mem_len", "tgt_len", "batch_size"])
def test_evaluation_lengths_are_bounded(lengths, named):
    model = ModelConfig(**{**TINY, "d_model": 4096}, n_token=200)
    with pytest.raises(ConfigError, match=rf"^{named}: scoring .* needs about [\d,.]+ TiB of memory, more than the "
                                          rf"[\d,.]+ [GT]iB of this machine; lower {named.split('=')[0]}$"):
        configs.check_inference_size(model, **lengths)
    defaults = EvalConfig()  # fit
    configs.check_inference_size(ModelConfig(**TINY, n_token=200), batch_size=defaults.batch_size,
                                 tgt_len=defaults.tgt_len, mem_len=defaults.mem_len)


def test_the_shipped_setups_are_far_from_the_bounds(clean_gin):
    """The estimates of every shipped setup (gin/**/*.gin at full size, with its corpus's vocabulary) stay far below
    a machine's memory: the largest model is ~3 GiB of weights, the largest evaluation ~10 GiB (enwik8_large)."""
    from txl_tf.data.corpora import EXPECTED

    for path in sorted(glob.glob(os.path.join(GIN_DIR, "**", "*.gin"), recursive=True)):
        if os.path.basename(path) == "common.gin":
            continue
        made = parse_configs([path], ["DATA_DIR = 'unused'"])
        n_token = made.model.n_token or EXPECTED.get(made.data.dataset, {}).get("vocab_size", 256)
        assert configs.model_bytes(made.model, n_token) < 4 * 2**30, path
        assert configs.inference_bytes(made.model, n_token=n_token, batch_size=made.eval.batch_size,
                               tgt_len=made.eval.tgt_len, mem_len=made.eval.mem_len) < 12 * 2**30, path


def test_the_rules_read_each_list_of_choices_where_it_lives():
    """Every `one of` rule holds the very tuple of the module that acts on the field (a literal copy in configs.py
    would drift from it), and configs.py stays free of TensorFlow while reading them."""
    import ast
    import subprocess
    import sys

    from txl_tf.model import encodings, policy, protocol

    owners = {("ModelConfig", "attn_type"): encodings.NAMES, ("TrainConfig", "nonfinite"): policy.NONFINITE_MODES,
              ("TrainConfig", "recompute"): policy.RECOMPUTE, ("EvalConfig", "protocol"): protocol.PROTOCOLS,
              ("EvalConfig", "compute_dtype"): protocol.COMPUTE_DTYPES, ("EvalConfig", "layout"): protocol.LAYOUTS}
    choices = {(config, field): getattr(check, "__self__", None)
               for config, rules in configs._RULES.items() for field, (check, _) in rules.items()}
    listed = {key for key, value in choices.items() if isinstance(value, tuple)}
    assert listed == {*owners, ("TrainConfig", "kernels")}
    for key, tuple_ in owners.items():
        assert choices[key] is tuple_, key
    assert choices[("TrainConfig", "kernels")] == (*policy.KERNELS, policy.AUTO)
    for field in ("mixed_precision", "jit_compile"):
        assert configs._RULES["TrainConfig"][field][0](policy.AUTO)
    # No literal inside a `_one_of(...)` of the rules: the lists are named, never spelt out.
    tree = ast.parse(open(configs.__file__).read())
    rules = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "_RULES" for t in node.targets))
    spelt = [ast.unparse(node) for node in ast.walk(rules) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "_one_of"
             and any(isinstance(n, ast.Constant) for n in ast.walk(node) if n is not node.func)]
    assert spelt == []
    code = "import sys, txl_tf.configs; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(configs.__file__)),
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "False"), result.stderr


def test_the_half_loss_needs_two_positions_when_the_config_is_made():
    with pytest.raises(ConfigError, match=r"^TrainConfig\.loss_recent_half=True needs TrainConfig\.tgt_len >= 2 "
                                          r"\(got 1\)"):
        TrainConfig(loss_recent_half=True, tgt_len=1)
    assert TrainConfig(loss_recent_half=True, tgt_len=2).loss_recent_half
