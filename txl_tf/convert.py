"""Converts a checkpoint written by the authors' TF code (`tf/model.py`) into a native txl_tf checkpoint.

    python -m txl_tf.convert --checkpoint=PREFIX --output_dir=DIR [--gin_file=F.gin] [--gin_param=...]

Architecture: without gin, everything the checkpoint's shapes determine is inferred from them (n_layer, d_model,
n_head, d_head, d_inner, n_token, d_embed, cutoffs, div_val, untie_r, tie_projs, proj_same_dim); the rest
(dropout, dropatt, mem_len, same_length, clamp_len, ...) takes the `ModelConfig` defaults. With `--gin_file`,
the bound `ModelConfig` is used as given (n_token from the checkpoint when unset) and must fit the checkpoint.
Writes `DIR/ckpt-1` (`tf.train.Checkpoint(model=model)`), `DIR/model_config.json` (the `TransformerXL`
arguments) and `DIR/model.gin` (the same as `ModelConfig` bindings), staged beside DIR and renamed into place; DIR
must be new or empty, or hold an earlier conversion and `--overwrite` be given (`txl_tf.base.paths.replaceable_dir`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

# First: txl_tf.base.cli quiets TensorFlow's start-up (it must come before TensorFlow's import).
from txl_tf.base import cli

# isort: split
import numpy as np
import tensorflow as tf
from absl import flags

from txl_tf.base.errors import ConfigError, UserError, one_line
from txl_tf.model.transformer_xl import TransformerXL

SCOPE = "transformer/"
KIND = "converted checkpoint"  # the kind of output in the folder's manifest (txl_tf.base.paths)
# Variables written by the original training code that are not model weights.
_IGNORED = re.compile(r"(^global_step$|/Adam(_\d+)?$|^beta\d_power$|^_CHECKPOINTABLE_OBJECT_GRAPH$)")


class OriginalCheckpointError(ConfigError):
    """The original checkpoint does not fit the requested architecture (one line: the command exits with status 2)."""


class CheckpointReadError(UserError):
    """The --checkpoint given to convert is not a TensorFlow checkpoint that can be read."""


_ORIGINAL = "give the prefix of a checkpoint of the authors' TF code, e.g. --checkpoint=PATH/model.ckpt-400000 " \
    "(its files are PREFIX.index and PREFIX.data-*)"


def _read_checkpoint(prefix):
    from txl_tf.runs import run_dir

    problem = run_dir.checkpoint_problem(prefix)  # regular files before TensorFlow opens them (a FIFO would hang)
    if problem:
        raise CheckpointReadError(f"--checkpoint={prefix}: {problem}; {_ORIGINAL}")
    try:
        reader = tf.train.load_checkpoint(prefix)
        variables = reader.get_variable_to_shape_map()
    except (tf.errors.OpError, ValueError) as error:  # a missing prefix, a damaged or foreign file
        raise CheckpointReadError(f"--checkpoint={prefix} cannot be read as a TensorFlow checkpoint "
                                  f"({type(error).__name__}: {one_line(error)}); {_ORIGINAL}") from None
    if any(name.endswith("/.ATTRIBUTES/VARIABLE_VALUE") for name in variables) and not any(
            name.startswith(SCOPE) for name in variables):
        raise OriginalCheckpointError(
            f"--checkpoint={prefix} is a txl_tf checkpoint, not one of the authors' TF code: it needs no conversion; "
            "pass its run folder as --model_dir to evaluate, export or generate (or as TrainConfig.init_checkpoint)")
    shapes = {name: shape for name, shape in variables.items() if not _IGNORED.search(name)}
    unknown = sorted(n for n in shapes if not n.startswith(SCOPE))
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise OriginalCheckpointError(f"--checkpoint={prefix} has unknown variables outside '{SCOPE}' ({shown}): not a "
                                      f"checkpoint of the authors' TF code; {_ORIGINAL}")
    return reader, {name[len(SCOPE) :]: shape for name, shape in shapes.items()}


def infer_architecture(shapes):
    """Model arguments that the original checkpoint's variable shapes determine."""
    n_layer = len({m.group(1) for n in shapes if (m := re.match(r"layer_(\d+)/", n))})
    if n_layer == 0 or "r_w_bias" not in shapes:
        raise OriginalCheckpointError("not a Transformer-XL checkpoint: no layer_*/ or r_w_bias variables")
    qkv = shapes["layer_0/rel_attn/qkv/kernel"]
    r_w = shapes["r_w_bias"]
    arch = {
        "n_layer": n_layer,
        "d_model": qkv[0],
        "n_head": r_w[-2],
        "d_head": r_w[-1],
        "d_inner": shapes["layer_0/ff/layer_1/kernel"][1],
        "untie_r": len(r_w) == 3,
    }
    if "adaptive_embed/lookup_table" in shapes:
        n_token, d_embed = shapes["adaptive_embed/lookup_table"]
        arch.update(n_token=n_token, d_embed=d_embed, div_val=1)
        n_bins = len([n for n in shapes if re.match(r"adaptive_softmax/cutoff_\d+/b$", n)])
        cutoffs = []
        if n_bins:  # div_val == 1 with cutoffs: bin sizes come from the softmax biases
            sizes = [shapes[f"adaptive_softmax/cutoff_{i}/b"][0] for i in range(n_bins)]
            cutoffs = list(np.cumsum(sizes[:-1]).tolist())
    else:
        n_bins = len([n for n in shapes if re.match(r"adaptive_embed/cutoff_\d+/lookup_table$", n)])
        tables = [shapes[f"adaptive_embed/cutoff_{i}/lookup_table"] for i in range(n_bins)]
        sizes = [t[0] for t in tables]
        div_val = tables[0][1] // tables[1][1] if n_bins > 1 else 1
        arch.update(n_token=sum(sizes), d_embed=tables[0][1], div_val=div_val,
                    proj_same_dim="adaptive_embed/cutoff_0/proj_W" in shapes or tables[0][1] != arch["d_model"])
        cutoffs = list(np.cumsum(sizes[:-1]).tolist())
    arch["cutoffs"] = tuple(int(c) for c in cutoffs)
    if arch["cutoffs"]:
        arch["tie_projs"] = tuple(
            f"adaptive_softmax/cutoff_{i}/proj" not in shapes for i in range(len(arch["cutoffs"]) + 1)
        )
    return arch


class Columns:
    """Variables [I, O_1], [I, O_2], ... standing for one matrix [I, sum O] (the original's fused `qkv` kernel, q | k
    | v): `assign` splits the columns among them."""

    def __init__(self, *variables):
        self.variables = variables
        self.shape = (variables[0].shape[0], sum(v.shape[1] for v in variables))
        self.path = " | ".join(v.path for v in variables)

    def assign(self, value):
        for var, part in zip(self.variables, np.split(value, np.cumsum([v.shape[1] for v in self.variables])[:-1],
                                                       axis=1), strict=True):
            var.assign(part)


def _name_map(model):
    """{original name (without 'transformer/'): model variable} for `model`."""
    names = {}
    if model.attn_type != "xl":
        raise OriginalCheckpointError(f"the original TF code only has attn_type='xl', not {model.attn_type!r}")
    names["r_w_bias"] = model.r_w_bias
    names["r_r_bias"] = model.r_r_bias
    emb, soft = model.embedding, model.softmax
    if model.div_val == 1:
        names["adaptive_embed/lookup_table"] = emb.tables[0]
        if emb.projections[0] is not None:
            names["adaptive_embed/proj_W"] = emb.projections[0]
    else:
        for i, (table, proj) in enumerate(zip(emb.tables, emb.projections, strict=True)):
            names[f"adaptive_embed/cutoff_{i}/lookup_table"] = table
            if proj is not None:
                names[f"adaptive_embed/cutoff_{i}/proj_W"] = proj
    if not model.cutoffs:
        names["adaptive_softmax/bias"] = soft.bias
        if soft.own_projections[0] is not None:
            names["adaptive_softmax/proj"] = soft.own_projections[0]
    else:
        names["adaptive_softmax/cutoff_0/cluster_W"] = soft.cluster_kernel
        names["adaptive_softmax/cutoff_0/cluster_b"] = soft.cluster_bias
        for i, proj in enumerate(soft.own_projections):
            if proj is not None:
                names[f"adaptive_softmax/cutoff_{i}/proj"] = proj
    for i, block in enumerate(model.blocks):
        att, ff = block.attention, block.feed_forward
        names.update({
            f"layer_{i}/rel_attn/qkv/kernel": Columns(att.query.kernel, att.key.kernel, att.value.kernel),
            f"layer_{i}/rel_attn/r/kernel": att.position.kernel,
            f"layer_{i}/rel_attn/o/kernel": att.attention_output.kernel,
            f"layer_{i}/rel_attn/LayerNorm/gamma": att.layer_norm.gamma,
            f"layer_{i}/rel_attn/LayerNorm/beta": att.layer_norm.beta,
            f"layer_{i}/ff/layer_1/kernel": ff.inner.kernel,
            f"layer_{i}/ff/layer_1/bias": ff.inner.bias,
            f"layer_{i}/ff/layer_2/kernel": ff.outer.kernel,
            f"layer_{i}/ff/layer_2/bias": ff.outer.bias,
            f"layer_{i}/ff/LayerNorm/gamma": ff.layer_norm.gamma,
            f"layer_{i}/ff/LayerNorm/beta": ff.layer_norm.beta,
        })
    return names


def load_original_weights(model, prefix):
    """Assigns every weight of `model` from the original checkpoint at `prefix`, checking names and shapes."""
    reader, shapes = _read_checkpoint(prefix)
    names = _name_map(model)
    split_bias = bool(model.cutoffs)  # the original keeps one bias per bin: adaptive_softmax/cutoff_i/b
    bias_names = [f"adaptive_softmax/cutoff_{i}/b" for i in range(len(model.cutoffs) + 1)] if split_bias else []
    expected = set(names) | set(bias_names)
    missing = sorted(expected - set(shapes))
    unexpected = sorted(set(shapes) - expected)
    if missing or unexpected:
        raise OriginalCheckpointError(
            f"{prefix} does not fit the model: missing variables {[SCOPE + n for n in missing]}, "
            f"unexpected variables {[SCOPE + n for n in unexpected]} (check cutoffs/div_val/tie_projs/untie_r)"
        )
    for name, var in names.items():
        value = reader.get_tensor(SCOPE + name)
        if tuple(value.shape) != tuple(var.shape):
            raise OriginalCheckpointError(
                f"{prefix}: variable {SCOPE + name} has shape {list(value.shape)}, the model expects "
                f"{list(var.shape)} (for {var.path})"
            )
        var.assign(value)
    if split_bias:
        for i, name in enumerate(bias_names):
            size = model.softmax.edges[i + 1] - model.softmax.edges[i]
            if shapes[name] != [size]:
                raise OriginalCheckpointError(
                    f"{prefix}: variable {SCOPE + name} has shape {shapes[name]}, the model expects [{size}]"
                )
        model.softmax.bias.assign(np.concatenate([reader.get_tensor(SCOPE + n) for n in bias_names]))
    return model


def from_original_tf(checkpoint_prefix, **model_kwargs):
    """A `TransformerXL` holding the weights of an original TF checkpoint.

    Architecture arguments not given in `model_kwargs` are inferred from the checkpoint's shapes; arguments the
    shapes cannot tell (dropout, dropatt, mem_len, same_length, clamp_len, ...) must be given or take defaults
    (dropout=dropatt=0, mem_len=0).
    """
    _, shapes = _read_checkpoint(checkpoint_prefix)
    kwargs = {"dropout": 0.0, "dropatt": 0.0, "mem_len": 0, **infer_architecture(shapes), **model_kwargs}
    model = TransformerXL(**kwargs)
    return load_original_weights(model, checkpoint_prefix)


def _model_config_from_flags(shapes, gin_files, gin_params):
    import gin

    from txl_tf.configs import ModelConfig, check_gin

    arch = infer_architecture(shapes)
    if gin_files or gin_params:
        check_gin(gin_files, gin_params)  # no `import` runs from a gin file; syntax errors are one line
        gin.parse_config_files_and_bindings(gin_files, gin_params, skip_unknown=True)
        config = ModelConfig()
        return config, config.model_kwargs(n_token=arch["n_token"])
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(**{k: v for k, v in arch.items() if k in fields})
    return config, config.model_kwargs()


def _gin_text(config):
    lines = [f"ModelConfig.{k} = {v!r}" for k, v in dataclasses.asdict(config).items()]
    return "\n".join(lines) + "\n"


def define_flags(flag_values) -> None:
    cli.define(flag_values, "checkpoint", "gin_file", "gin_param")
    flags.DEFINE_string("output_dir", None, "Where to write the native checkpoint and the model config.",
                        flag_values=flag_values)
    flags.DEFINE_bool("overwrite", False, "Replace a conversion this command wrote before in --output_dir (never "
                      "another folder, e.g. a training run).", flag_values=flag_values)
    flags.mark_flags_as_required(["checkpoint", "output_dir"], flag_values=flag_values)


def main(argv):
    from txl_tf.base import paths, staging
    from txl_tf.configs import architecture
    from txl_tf.runs import run_dir

    cli.no_arguments(argv)
    flag_values = flags.FLAGS
    output_dir = paths.output_dir(flag_values.output_dir, "--output_dir")
    staging.remove_stale(output_dir)
    paths.replaceable_dir(output_dir, "--output_dir", kind=KIND, overwrite=flag_values.overwrite)
    reader_shapes = _read_checkpoint(flag_values.checkpoint)[1]
    config, kwargs = _model_config_from_flags(reader_shapes, flag_values.gin_file, flag_values.gin_param)
    model = load_original_weights(TransformerXL(**kwargs), flag_values.checkpoint)
    # whole or not at all, like every other writer (checked again under its claim)
    with staging.staged_dir(output_dir, kind=KIND, name="--output_dir", overwrite=flag_values.overwrite) as tmp:
        path = tf.train.Checkpoint(model=model).save(os.path.join(tmp, "ckpt"))
        with open(os.path.join(tmp, "model_config.json"), "w") as f:
            json.dump({k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}, f, indent=1)
        run_dir.write_config(tmp, _gin_text(config), name=run_dir.CONVERTED_CONFIG_FILE)
        run_dir.record_architecture(tmp, architecture(model))  # what a load with the setup's gin file must build
    n_params = sum(int(np.prod(v.shape)) for v in model.weights)
    print(f"converted {flag_values.checkpoint} ({n_params:,} parameters) -> "
          f"{os.path.join(output_dir, os.path.basename(path))}")


if __name__ == "__main__":
    cli.run(main, define_flags)
