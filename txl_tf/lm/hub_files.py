"""The files of a keras-hub preset of `txl_tf.lm.hub` as untrusted input, and the vocabulary record that travels in it.

    checked = hub_files.check(preset)         # every file, before keras-hub reads any of it
    checked.vocab                             # assets/tokenizer/vocab.json, checked against the model

A preset folder someone sends is read as untrusted input (`txl_tf.base.untrusted`): every JSON file (config.json,
task.json, preprocessor.json, tokenizer.json, metadata.json, the sharded index model.weights.json) is a regular file
of at most JSON_LIMIT bytes holding strict, shallow JSON of the shape keras-hub reads (a txl_tf.lm.hub class by its
registered name, its config a mapping); the weights (model.weights.h5, or the shards the index names, each a plain
file name in the folder) are regular files no larger than the machine's memory; the files agree with each other
(task.json holds the very backbone config.json holds, and the preprocessor and tokenizer their own files hold); and
the vocabulary (assets/tokenizer/vocab.json) is the model's: as many symbols as its n_token and, in presets that
record it, the fingerprint saved with the model (`record_vocabulary`: metadata.json's "txl_tf" entry). Each
problem is one UserError line naming the file and the fix.

The file names are keras-hub's and fixed: nothing read from a preset's files (keras-hub's `config_file` field) ever
names a file to read or write.
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple

from txl_tf.base import untrusted
from txl_tf.base.errors import ConfigError, UserError
from txl_tf.data.vocab import Vocab

CONFIG = "config.json"
TASK = "task.json"
PREPROCESSOR = "preprocessor.json"
TOKENIZER = "tokenizer.json"
METADATA = "metadata.json"
WEIGHTS = "model.weights.h5"
SHARDED_INDEX = "model.weights.json"
TOKENIZER_ASSETS = os.path.join("assets", "tokenizer")  # keras-hub's assets/<tokenizer.json without .json>/
VOCAB_ASSET = "vocab.json"
JSON_FILES = (CONFIG, TASK, PREPROCESSOR, TOKENIZER, METADATA, SHARDED_INDEX)
# The class each file holds, by its Keras registered name (txl_tf.lm.hub registers them under package "txl_tf.hub").
CLASSES = {CONFIG: "txl_tf.hub>TransformerXLBackbone", TASK: "txl_tf.hub>TransformerXLCausalLM",
           PREPROCESSOR: "txl_tf.hub>TransformerXLCausalLMPreprocessor", TOKENIZER: "txl_tf.hub>TransformerXLTokenizer"}
RECORD_KEY = "txl_tf"  # metadata.json: {"txl_tf": {"vocabulary": {"sha256", "level", "size"}}}
_FIX = "save the preset again with save_to_preset"


class Checked(NamedTuple):
    """What `check` read: the parsed JSON files by name, and the vocabulary (None: the preset holds no tokenizer)."""

    files: dict
    vocab: Vocab | None


def is_local(preset) -> bool:
    """Whether `preset` is a folder on this machine (what `check` reads; a kaggle:// or hf:// handle is not)."""
    return isinstance(preset, (str, os.PathLike)) and os.path.isdir(preset)


def check(preset, *, load_weights: bool = True, tokenizer: bool = False) -> Checked:
    """Every file of the local keras-hub preset `preset`, before keras-hub reads any (see the module docstring).

    load_weights: the weights must be there (model.weights.h5, or model.weights.json and its shards).
    tokenizer: the vocabulary must be there (it is read and checked whenever the preset holds a tokenizer).
    """
    preset = os.fspath(preset)
    files = {}
    for name in JSON_FILES:
        path = os.path.join(preset, name)
        if os.path.lexists(path):
            files[name] = untrusted.load_json(path, max_bytes=untrusted.JSON_LIMIT, what=f"the preset's {name}")
    if CONFIG not in files:
        raise UserError(f"{preset} has no {CONFIG}: not a keras-hub preset; {_FIX}")
    for name, registered in CLASSES.items():
        if name in files:
            _check_object(preset, name, files[name], registered)
    _check_backbone(preset, files[CONFIG]["config"])
    _check_agreement(preset, files)
    weights = os.path.join(preset, WEIGHTS)
    if os.path.lexists(weights):
        check_weights(weights)
    elif os.path.lexists(os.path.join(preset, SHARDED_INDEX)):
        check_weights(os.path.join(preset, SHARDED_INDEX))
    elif load_weights:
        raise UserError(f"the preset {preset} has no {WEIGHTS} (nor a sharded {SHARDED_INDEX}); {_FIX}, or load "
                        "it with load_weights=False for random weights")
    vocab = None
    vocab_path = os.path.join(preset, TOKENIZER_ASSETS, VOCAB_ASSET)
    if tokenizer or os.path.lexists(vocab_path) or _holds_tokenizer(files):
        vocab = load_vocabulary(preset)
        check_vocabulary(preset, files, vocab)
    return Checked(files, vocab)


def _check_object(preset: str, name: str, data, registered: str) -> None:
    """A serialized Keras object of the class `registered` (what keras-hub indexes without checking)."""
    where = os.path.join(preset, name)
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise UserError(f"{where} is not a serialized Keras object (a mapping with a 'config' mapping); {_FIX}")
    if data.get("registered_name") != registered:
        raise UserError(f"{where} holds {_clipped(data.get('registered_name'))}, not txl_tf's {registered}: not a "
                        "preset of txl_tf.lm.hub; load another program's preset with keras-hub's own classes")


def _check_backbone(preset: str, config: dict) -> None:
    where = os.path.join(preset, CONFIG)
    for field in ("model_config", "eval_config"):
        if field not in config or config[field] is None:
            what = ("the evaluation protocol the model was trained for (EvalConfig: tgt_len, mem_len, clamp_len); "
                    "EvalConfig's defaults (memory 2,100, clamp 820) would be another model's" if field == "eval_config"
                    else "the architecture (ModelConfig)")
            raise ConfigError(f"{where} has no {field}, {what}; {_FIX}")
        if not isinstance(config[field], dict):
            raise ConfigError(f"{where}: {field} must be a mapping of fields to values, got "
                              f"{type(config[field]).__name__}; {_FIX}")
    missing = sorted({"tgt_len", "mem_len", "clamp_len"} - set(config["eval_config"]))
    if missing:
        raise ConfigError(f"{where}: eval_config has no {', '.join(missing)} (EvalConfig's defaults, memory 2,100 "
                          f"and clamp 820, would be another model's); {_FIX}")


def _holds_tokenizer(files: dict) -> bool:
    task = files.get(TASK)
    return TOKENIZER in files or PREPROCESSOR in files or bool(task and task["config"].get("preprocessor"))


def _check_agreement(preset: str, files: dict) -> None:
    """task.json's backbone is config.json's, its preprocessor preprocessor.json's, and the tokenizer in each is
    tokenizer.json's: keras-hub's CausalLM loads task.json, its Backbone config.json, its CausalLMPreprocessor
    preprocessor.json and its Tokenizer tokenizer.json, which must not be different models."""
    task, preprocessor = files.get(TASK), files.get(PREPROCESSOR)
    pairs = [(TASK, "backbone", _nested(task, "config", "backbone"), CONFIG),
             (TASK, "preprocessor", _nested(task, "config", "preprocessor"), PREPROCESSOR),
             (TASK, "preprocessor's tokenizer", _nested(task, "config", "preprocessor", "config", "tokenizer"),
              TOKENIZER),
             (PREPROCESSOR, "tokenizer", _nested(preprocessor, "config", "tokenizer"), TOKENIZER)]
    for holder, part, nested, name in pairs:
        if holder not in files or name not in files or (nested is None and part != "backbone"):
            continue
        difference = _difference(nested, files[name], "")
        if difference is not None:
            path, here, there = difference
            raise UserError(f"the preset {preset} does not fit together: the {part} in its {holder} differs from its "
                            f"{name} (at {path or 'the top'}: {_clipped(here)} against {_clipped(there)}), so "
                            f"keras-hub's loaders would build different models from it; {_FIX}")


def _nested(data, *keys):
    """data[keys[0]][keys[1]]... where each is a mapping, else None."""
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _difference(a, b, path: str):
    """(path, a's value, b's value) of the first place where `a` and `b` differ, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{path}.{key}".lstrip("."), a.get(key, "nothing"), b.get(key, "nothing")
            found = _difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    same = a == b and type(a) is type(b)
    return None if same else (path.lstrip("."), a, b)


# ---- the weights ---------------------------------------------------------------------------------------------
def check_weights(path) -> None:
    """A weights file before Keras opens it: model.weights.h5 (or any .h5) a regular file no larger than the
    machine's memory; a sharded index (.json) strict JSON whose weight_map names plain files of the same folder,
    each such a file. A link to /dev/zero, a FIFO or a sparse file of a terabyte is one UserError line."""
    path = os.fspath(path)
    limit = untrusted.machine_memory()
    if not path.endswith(".json"):
        untrusted.check_regular(path, max_bytes=limit, what="the weights file")
        return
    index = untrusted.load_json(path, max_bytes=untrusted.JSON_LIMIT, what="the sharded weights index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise UserError(f"the sharded weights index {path} has no 'weight_map' mapping; {_FIX}")
    names = set()
    for value in weight_map.values():
        for name in value if isinstance(value, list) else [value]:
            if not (isinstance(name, str) and name == os.path.basename(name) and name not in ("", ".", "..")
                    and "\0" not in name and not name.startswith(".")):
                raise UserError(f"the sharded weights index {path} names {_clipped(name)} as a shard: a shard is a "
                                f"plain file name in the index's folder; {_FIX}")
            names.add(name)
    for name in sorted(names):
        try:
            untrusted.check_regular(os.path.join(os.path.dirname(path), name), max_bytes=limit,
                                    what="the weights shard")
        except FileNotFoundError:
            raise UserError(f"the sharded weights index {path} names {name}, which is not there; {_FIX}") from None


# ---- the vocabulary ------------------------------------------------------------------------------------------
def load_vocabulary(preset) -> Vocab:
    """assets/tokenizer/vocab.json of the preset (`Vocab.load`: a regular file, bounded, its schema checked)."""
    path = os.path.join(os.fspath(preset), TOKENIZER_ASSETS, VOCAB_ASSET)
    try:
        return Vocab.load(path)
    except FileNotFoundError:
        raise UserError(f"the preset {os.fspath(preset)} has a tokenizer but no {path}; {_FIX}") from None


def vocabulary_record(vocab: Vocab) -> dict:
    """{"sha256", "level", "size"}: the fingerprint of a vocabulary (`txl_tf.data.records.vocab_sha256`: its level
    and symbols in order), as run folders record it."""
    from txl_tf.data import records

    return {"sha256": records.vocab_sha256(vocab), "level": vocab.level, "size": len(vocab)}


def record_vocabulary(preset: str, vocab: Vocab) -> None:
    """Adds the vocabulary's fingerprint to metadata.json of a preset being saved (keras-hub wrote the file)."""
    path = os.path.join(preset, METADATA)
    metadata = untrusted.load_json(path, max_bytes=untrusted.JSON_LIMIT, what=f"the preset's {METADATA}") \
        if os.path.exists(path) else {}
    metadata[RECORD_KEY] = {**metadata.get(RECORD_KEY, {}), "vocabulary": vocabulary_record(vocab)}
    with open(path, "w") as f:
        f.write(json.dumps(metadata, indent=4))


def check_vocabulary(preset: str, files: dict, vocab: Vocab) -> None:
    """The vocabulary is the model's: as many symbols as config.json's n_token, and the fingerprint metadata.json
    recorded when the preset was saved (a preset saved before the record: the size alone)."""
    where = os.path.join(preset, TOKENIZER_ASSETS, VOCAB_ASSET)
    n_token = files[CONFIG]["config"]["model_config"].get("n_token")
    if len(vocab) != n_token:
        raise UserError(f"the preset {preset} does not fit together: its {where} holds {len(vocab)} symbols but its "
                        f"model has n_token={_clipped(n_token)} ({CONFIG}); put back the preset's own vocabulary, or "
                        f"{_FIX}")
    metadata = files.get(METADATA)
    record = metadata.get(RECORD_KEY, {}).get("vocabulary") if isinstance(metadata, dict) \
        and isinstance(metadata.get(RECORD_KEY), dict) else None
    if record is None:
        return  # saved before presets recorded it: the size agrees
    if not (isinstance(record, dict) and isinstance(record.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", record["sha256"])):
        raise UserError(f"{os.path.join(preset, METADATA)}: {RECORD_KEY}.vocabulary is not a fingerprint written by "
                        f"txl_tf (no \"sha256\" of 64 hex digits); {_FIX}")
    found = vocabulary_record(vocab)
    if found["sha256"] != record["sha256"]:
        raise UserError(
            f"the preset {preset} does not fit together: its {where} ({found['size']} {found['level']}-level symbols, "
            f"sha256 {found['sha256'][:16]}...) is another vocabulary than the model was saved with ("
            f"{_clipped(record.get('size'))} {_clipped(record.get('level'))}-level symbols, sha256 "
            f"{record['sha256'][:16]}..., recorded in {METADATA}): its ids would mean other symbols to the model; "
            f"put back the preset's own vocabulary, or {_FIX}")


def _clipped(value) -> str:
    """The repr of a value read from a file, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["Checked", "check", "check_vocabulary", "check_weights", "is_local", "load_vocabulary",
           "record_vocabulary", "vocabulary_record"]
