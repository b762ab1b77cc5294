"""What `txl_tf.TransformerXLCausalLM.from_preset` loads besides keras-hub's presets: a run directory (its newest or
best checkpoint, or averaged/), a directory converted from the authors' checkpoint, or a preset of txl_tf's earlier
format (read only: the package writes keras-hub's presets), as a built model with its vocabulary and configs.

A preset's config.json is untrusted input (`read_preset_config`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from typing import NamedTuple

from txl_tf.base import errors, paths, untrusted
from txl_tf.base.errors import ConfigError, UserError
from txl_tf.configs import (
    EvalConfig,
    ModelConfig,
    architecture,
    check_clamp,
    check_inference_size,
    differing_architecture,
)
from txl_tf.data.vocab import VOCAB_FILE, Vocab
from txl_tf.lm import hub_files
from txl_tf.model import upgrade
from txl_tf.runs import loading, run_dir

PRESET_CONFIG = "config.json"
PRESET_WEIGHTS = "model.weights.h5"  # Keras' weights format (model.save_weights)
PRESET_VOCAB = VOCAB_FILE
PRESET_FORMAT = "txl_tf.preset"
PRESET_KIND = "preset"  # the kind of output in the folder's manifest (txl_tf.base.paths)
PRESET_VERSION = 1
_EXPECTED = ("a preset directory (config.json from save_to_preset), a run directory (config.gin and ckpt-N; its "
             "best/ with which='best', or the averaged/ of `python -m txl_tf.average`), or a converted checkpoint "
             "directory (ckpt-1 and model.gin from `python -m txl_tf.convert`)")


class Loaded(NamedTuple):
    """A loaded model (`txl_tf.TransformerXL`, weights restored), its vocabulary and configs."""

    model: object
    vocab: Vocab
    model_config: ModelConfig
    eval_config: EvalConfig


def load(path, *, which: str = "latest", gin_file: str | Sequence[str] = (), gin_param: str | Sequence[str] = (),
         dtype: str | None = None) -> Loaded:
    """The model of a preset directory, a run directory or a converted checkpoint directory, with its vocabulary
    and configs (what `txl_tf.TransformerXLCausalLM.from_preset` loads through `from_txl`).

    Args:
      path: a directory written by `save_to_preset`; a run directory of `python -m txl_tf.train` (its newest
        checkpoint that restores intact; `which="best"` its best/), or the averaged/ of `txl_tf.average`; or
        a directory converted by `python -m txl_tf.convert` (ckpt-1 + model.gin), whose vocabulary and
        protocol come from `gin_file` (the setup's gin file, e.g. "enwik8.gin") as for the CLI.
      which: "latest" or "best" checkpoint of a run directory.
      gin_file, gin_param: gin files and bindings read after the directory's own config (run and converted
        directories), as `--gin_file` / `--gin_param`; e.g. "EvalConfig.mem_len = 3800".
      dtype: Keras dtype policy of the layers (e.g. "mixed_bfloat16"); None: EvalConfig.compute_dtype.
    """
    path = paths.given(path, "the preset path")
    gin_files = [gin_file] if isinstance(gin_file, str) else list(gin_file)
    gin_params = [gin_param] if isinstance(gin_param, str) else list(gin_param)
    if not os.path.isdir(path):
        raise UserError(f"{path} is not a directory; from_preset expects {_EXPECTED}")
    if os.path.exists(os.path.join(path, PRESET_CONFIG)):
        if gin_files or gin_params:
            raise ConfigError(f"{path} is a preset: its config.json is complete and takes no gin_file or "
                              "gin_param; drop them (or load the run directory the preset was saved from)")
        return _from_preset_dir(path, dtype)
    if os.path.exists(os.path.join(path, run_dir.CONFIG_FILE)):
        return _from_checkpoints(path, None, which, gin_files, gin_params, dtype)
    if os.path.exists(os.path.join(path, run_dir.CONVERTED_CONFIG_FILE)):
        return _from_checkpoints(None, path, which, gin_files, gin_params, dtype)
    raise UserError(f"{path} holds no model to load (no {PRESET_CONFIG}, {run_dir.CONFIG_FILE} or "
                    f"{run_dir.CONVERTED_CONFIG_FILE}); from_preset expects {_EXPECTED}")


def _from_checkpoints(model_dir, checkpoint, which, gin_files, gin_params, dtype) -> Loaded:
    import gin

    source = model_dir or checkpoint
    try:
        configs = run_dir.read_configs(model_dir, gin_files, gin_params, checkpoint=checkpoint)
        data_dir = _recorded_data_dir(model_dir, configs.data.data_dir) if model_dir else configs.data.data_dir
        if data_dir != configs.data.data_dir:  # the run's own prepared data, found from another directory
            configs = dataclasses.replace(configs, data=dataclasses.replace(configs.data, data_dir=data_dir))
        vocab = _data_vocab(data_dir, source, converted=checkpoint is not None)
        dtype = dtype or _compute_dtype(configs.eval)
        model, configs, _ = loading.load_model(model_dir, checkpoint, which=which, dtype=dtype,
                                               configs=configs)
    finally:
        gin.clear_config()  # the configs are values now; leave no bindings behind for the caller's code
    model_config = dataclasses.replace(configs.model, n_token=model.n_token)
    return Loaded(model, vocab, model_config, configs.eval)


def _from_preset_dir(path: str, dtype: str | None) -> Loaded:
    model_config, eval_config = read_preset_config(path)
    weights = os.path.join(path, PRESET_WEIGHTS)
    if not os.path.exists(weights):
        raise UserError(f"the preset {path} has no {PRESET_WEIGHTS}; save it again with save_to_preset")
    hub_files.check_weights(weights)  # a regular file within the machine's memory, before h5py opens it
    try:
        vocab = Vocab.load(os.path.join(path, PRESET_VOCAB))
    except (OSError, ValueError, untrusted.UntrustedFileError) as error:
        problem = errors.one_line(error)
        if isinstance(error, UserError):  # its own advice ends it: the preset's is to save it again
            problem = problem.rsplit("; ", 1)[0]
        raise UserError(f"the preset {path} has no readable vocabulary ({problem}); save it again with "
                        "save_to_preset") from None
    if len(vocab) != model_config.n_token:  # before the model is built
        raise UserError(f"the preset {path} does not fit together: its {PRESET_CONFIG} has model n_token="
                        f"{model_config.n_token} but its {PRESET_VOCAB} holds {len(vocab)} symbols; save the "
                        "preset again with save_to_preset")
    _check_architecture(path, model_config)
    model = loading.build_model(model_config, dtype=dtype or _compute_dtype(eval_config))
    try:
        if upgrade.legacy_weights_file(weights):  # written before the attention's projections were layers
            with tempfile.TemporaryDirectory(prefix="txl_tf-upgrade-") as tmp:
                model.load_weights(upgrade.upgraded_weights_file(weights, tmp))
        else:
            # exactly the model's variables: none of the file's left unread (Keras would skip them without a word)
            loading.check_weights_file(model.weights, weights, f"it does not fit the model of "
                                       f"{os.path.join(path, PRESET_CONFIG)}: save the preset again with save_to_preset")
            model.load_weights(weights)
    except UserError:
        raise
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"{weights} does not fit the model of {os.path.join(path, PRESET_CONFIG)} "
                        f"({errors.one_line(error)}); save the preset again with save_to_preset") from None
    return Loaded(model, vocab, model_config, eval_config)


def read_preset_config(path: str) -> tuple[ModelConfig, EvalConfig]:
    """The ModelConfig and EvalConfig of a preset's config.json (one-line UserError when it does not read).

    The file is untrusted input (`txl_tf.base.untrusted`: a regular file of at most JSON_LIMIT bytes, finite numbers,
    bounded nesting); its fields are validated, and the model's sizes and the evaluation's lengths are checked
    against the machine's memory (ConfigError naming the field) before anything is built.
    """
    config_path = os.path.join(path, PRESET_CONFIG)
    try:  # a regular file of at most JSON_LIMIT bytes, strict JSON (finite numbers, nesting bounded)
        config = untrusted.load_json(config_path, max_bytes=untrusted.JSON_LIMIT, what="the preset's config.json")
    except OSError as error:
        raise UserError(f"{config_path} does not read ({errors.one_line(error)}); save the preset again with "
                        "save_to_preset") from None
    if not isinstance(config, dict) or config.get("format") != PRESET_FORMAT \
            or config.get("version") != PRESET_VERSION:
        found = f"{_clipped(config.get('format'))}, version {_clipped(config.get('version'))}" \
            if isinstance(config, dict) else type(config).__name__
        raise UserError(f"{config_path} is not a {PRESET_FORMAT} v{PRESET_VERSION} config (found {found}); save the "
                        "preset again with save_to_preset")
    made = []
    for key, kind in (("model", ModelConfig), ("eval", EvalConfig)):
        fields = config.get(key)
        known = {field.name for field in dataclasses.fields(kind)}
        if not isinstance(fields, dict) or set(fields) - known:
            unknown = sorted(set(fields) - known)[:5] if isinstance(fields, dict) else type(fields).__name__
            raise UserError(f"{config_path}: {key!r} must map {kind.__name__} fields to values (unknown: "
                            f"{unknown}); save the preset again with save_to_preset")
        try:
            made.append(kind(**fields))
        except ConfigError as error:
            problem = errors.one_line(error)
            if "; fix the binding" in problem:  # the file holds no gin binding
                problem = problem.split("; fix the binding")[0] + "; correct it, or save the preset again"
            raise ConfigError(f"{config_path}: {problem}") from None
    if made[0].n_token is None:
        raise UserError(f"{config_path} has no model n_token; save the preset again with save_to_preset")
    try:  # the evaluation's lengths with one row (what every use needs), before the model is built
        check_inference_size(made[0], batch_size=1, tgt_len=made[1].tgt_len, mem_len=made[1].mem_len)
        check_clamp(made[0].attn_type, made[1].clamp_len)  # no clamp the encoding ignores
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    return made[0], made[1]


def _check_architecture(path: str, model_config: ModelConfig) -> None:
    """config.json's "architecture" (what the weights were saved from; presets saved since the record exists) must
    be its "model" (one line naming the field and both values): a model edited to another encoding would load the
    weights as another function."""
    config_path = os.path.join(path, PRESET_CONFIG)
    recorded = untrusted.load_json(config_path, max_bytes=untrusted.JSON_LIMIT,
                                   what="the preset's config.json").get("architecture")
    if recorded is None:
        return
    difference = differing_architecture(recorded, architecture(model_config)) if isinstance(recorded, dict) \
        else f"its 'architecture' is a {type(recorded).__name__}, not a mapping"
    if difference:
        raise ConfigError(f"{config_path}: its 'model' is not the architecture its weights were saved from "
                          f"({difference}); save the preset again with save_to_preset")


def _compute_dtype(eval_config: EvalConfig) -> str | None:
    """The layers' dtype policy evaluate uses: None (float32) or EvalConfig.compute_dtype."""
    return None if eval_config.compute_dtype == "float32" else eval_config.compute_dtype


def _recorded_data_dir(model_dir: str, data_dir: str) -> str:
    """`data_dir` as the run's config.gin names it, or, when that relative path holds no prepared data from this
    working directory (a run loaded from elsewhere than where it trained), the prepared data the run recorded:
    the folder of the vocabulary it recorded (`run_dir.record_vocabulary`, an absolute path), else `data_dir`
    under the run folder's ancestors. A folder is taken only if its vocabulary has the recorded fingerprint."""
    if not data_dir or os.path.isabs(data_dir) or os.path.isdir(data_dir):
        return data_dir
    record = run_dir.recorded_vocabulary(model_dir)
    if record is None:
        return data_dir
    candidates = [os.path.dirname(str(record.get("vocab_file") or ""))]
    folder = os.path.dirname(os.path.abspath(model_dir))
    while True:
        candidates.append(os.path.join(folder, data_dir))
        if os.path.dirname(folder) == folder:
            break
        folder = os.path.dirname(folder)
    for candidate in candidates:
        if not (candidate and os.path.isdir(candidate)):
            continue
        try:
            if run_dir.data_vocabulary(candidate)["sha256"] == record["sha256"]:
                return candidate
        except (OSError, ValueError, UserError):
            continue
    return data_dir


def _data_vocab(data_dir: str, source: str, converted: bool) -> Vocab:
    from txl_tf.data.pipeline import load_vocab

    try:
        return load_vocab(data_dir)
    except (OSError, ValueError) as error:
        fix = ("pass gin_file= the setup's gin file (its DataConfig.data_dir names the prepared data)" if converted
               else "prepare the data again, or pass gin_param=\"DataConfig.data_dir = '...'\"")
        raise UserError(f"the vocabulary of {source} is read from DataConfig.data_dir={data_dir!r}, which holds "
                        f"none ({errors.one_line(error)}); {fix}") from None


def _clipped(value) -> str:
    """The repr of a value read from a file, at most 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
