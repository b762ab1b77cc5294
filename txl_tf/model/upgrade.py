"""Weights written before the attention's projections became Keras layers, read into today's model.

Until 2026-11-26 each attention layer held raw kernels: `qkv_kernel` [d, 3*N*D] (q | k | v), `o_kernel`
[N*D, d] and xl's `r_kernel` [d, N*D]. They are now the Dense sublayers `query`, `key`, `value`,
`attention_output` and `position` (`txl_tf.model.attention`), which keras-hub's LoRA and Keras' int8 quantization
reach. Run folders, `best/`, `averaged/` and converted checkpoints (tf.train checkpoints) and presets of the
earlier format (`model.weights.h5`) written before still load: the old file is translated into a temporary one of
today's layout, which is then restored as strictly as any other (every weight must match).

    legacy_checkpoint(prefix)           whether a tf.train checkpoint has the old attention kernels
    upgraded_checkpoint(prefix, dir)    today's layout of its `model` variables, written under dir; the new prefix
    legacy_weights_file(path)           whether a Keras .weights.h5 file has the old attention kernels
    upgraded_weights_file(path, dir)    today's layout of it, written under dir; the new path

Only the old files are read; nothing is written outside `dir` (a temporary directory of the caller's).
"""

from __future__ import annotations

import os

import numpy as np

_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
_LEGACY_KERNELS = ("qkv_kernel", "o_kernel", "r_kernel")


def legacy_checkpoint(prefix: str) -> bool:
    """Whether the checkpoint `prefix` holds a model whose attention layers keep the old raw kernels."""
    import tensorflow as tf

    return any(name.endswith("/attention/qkv_kernel" + _VALUE) for name, _ in tf.train.list_variables(prefix))


def upgraded_checkpoint(prefix: str, directory: str) -> str:
    """Writes the `model` of the old-layout checkpoint `prefix` in today's layout under `directory`; returns the new
    checkpoint's prefix (restore it as `tf.train.Checkpoint(model=model)`).

    The checkpoint's own object graph is rebuilt, every object (also those without variables, e.g. dropout layers)
    and every variable kept, except that each attention's `qkv_kernel`, `o_kernel` and `r_kernel` become the
    `_kernel` of its `query` | `key` | `value`, `attention_output` and `position` sublayers.
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    reader = tf.train.load_checkpoint(prefix)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    built: dict[int, object] = {}  # node id -> object: an object reached twice stays one object

    def value_of(node_id):
        for attribute in graph.nodes[node_id].attributes:
            if attribute.name == "VARIABLE_VALUE":
                return reader.get_tensor(attribute.checkpoint_key)
        return None

    def build(node_id):
        if node_id in built:
            return built[node_id]
        value = value_of(node_id)
        if value is not None:
            built[node_id] = tf.Variable(value, trainable=False)
            return built[node_id]
        node = built[node_id] = tf.__internal__.tracking.AutoTrackable()
        children = {child.local_name: child.node_id for child in graph.nodes[node_id].children}
        legacy = "qkv_kernel" in children
        for name, child_id in children.items():
            if not (legacy and name in _LEGACY_KERNELS):
                setattr(node, name, build(child_id))
        if legacy:
            parts = dict(zip(("query", "key", "value"), np.split(value_of(children["qkv_kernel"]), 3, axis=1),
                             strict=True))
            parts["attention_output"] = value_of(children["o_kernel"])
            if "r_kernel" in children:
                parts["position"] = value_of(children["r_kernel"])
            for name, kernel in parts.items():
                layer = tf.__internal__.tracking.AutoTrackable()
                layer._kernel = tf.Variable(kernel, trainable=False)
                setattr(node, name, layer)
        return node

    model_id = next(child.node_id for child in graph.nodes[0].children if child.local_name == "model")
    return tf.train.Checkpoint(model=build(model_id)).save(os.path.join(directory, "upgraded"))  # with save_counter


def _legacy_groups(h5) -> list[str]:
    """The attention groups (".../attention") of an open .weights.h5 that keep the old kernels in `vars`."""
    found = []

    def visit(name, obj):
        if name.endswith("/attention/vars") and len(obj.keys()) >= 2:
            first = obj["0"]
            if len(first.shape) == 2 and first.shape[1] % 3 == 0 and "query" not in obj.parent:
                found.append(obj.parent.name)

    h5.visititems(visit)
    return found


def legacy_weights_file(path: str) -> bool:
    """Whether the Keras weights file `path` (.weights.h5) keeps the old attention kernels."""
    import h5py

    with h5py.File(path, "r") as h5:
        return bool(_legacy_groups(h5))


def upgraded_weights_file(path: str, directory: str) -> str:
    """Writes a copy of the old-layout weights file `path` in today's layout under `directory`; returns its path.

    An old attention group keeps [qkv, o] (rope, alibi, vaswani, al_rfou), [qkv, r, o] (xl) or [qkv, table, o]
    (shaw, whose learned table stays the attention's own variable) in `vars`, in creation order.
    """
    import h5py

    target = os.path.join(directory, os.path.basename(path))
    with h5py.File(path, "r") as old, h5py.File(target, "w") as new:
        for key in old.keys():
            old.copy(old[key], new, name=key)
        for attr, value in old.attrs.items():
            new.attrs[attr] = value
        for group_name in _legacy_groups(new):
            group = new[group_name]
            kernels = [np.asarray(group["vars"][str(i)]) for i in range(len(group["vars"].keys()))]
            qkv, middle, out = kernels[0], kernels[1:-1], kernels[-1]
            del group["vars"]
            own = group.create_group("vars")
            parts = dict(zip(("query", "key", "value"), np.split(qkv, 3, axis=1), strict=True))
            parts["attention_output"] = out
            for kernel in middle:
                if kernel.ndim == 3:  # shaw's relative table [max_position, N, D]: the layer's own variable
                    own.create_dataset("0", data=kernel)
                else:  # xl's W_R
                    parts["position"] = kernel
            for name, kernel in parts.items():
                group.create_group(name).create_group("vars").create_dataset("0", data=kernel)
    return target
