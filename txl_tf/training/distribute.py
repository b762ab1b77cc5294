"""A small `tf.distribute` strategy factory and the helpers the trainer needs around it.

    default                 the default strategy (one replica on the default device)
    one_device              OneDeviceStrategy on the first GPU, else the CPU
    mirrored                MirroredStrategy over all GPUs, else over all logical CPU devices (synchronous
                            data parallelism on one machine)
    multi_worker_mirrored   MultiWorkerMirroredStrategy; the cluster comes from TF_CONFIG (see
                            scripts/launch_local_multiworker.sh)
    tpu                     TPUStrategy on the TPU named by --tpu (or the local one)

Every replica owns a fixed block of the global batch's streams (txl_tf.data.pipeline.distribute_dataset) and its
own memory, created with `replica_values`. Non-chief workers of a multi-worker run write their checkpoints and
summaries into temporary directories (`worker_dir`) that are removed at the end: only the chief's are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Optional

import tensorflow as tf

from txl_tf.base.cli import STRATEGIES

_MIRRORED: dict = {}


def make_strategy(name: str = "default", tpu: Optional[str] = None) -> tf.distribute.Strategy:
    """The strategy called `name` (one of STRATEGIES); `tpu` is the TPU address or name for "tpu"."""
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        devices = tuple(d.name for d in tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))
        # One instance per device set and process: separate MirroredStrategy objects number their collective
        # ops from the same keys, and a second one would collide with the first's (an INTERNAL abort).
        if devices not in _MIRRORED:
            _MIRRORED[devices] = tf.distribute.MirroredStrategy(list(devices))
        return _MIRRORED[devices]
    if name == "multi_worker_mirrored":
        if "TF_CONFIG" not in os.environ:
            raise ValueError("--strategy=multi_worker_mirrored needs the TF_CONFIG environment variable "
                             "(cluster and task); start workers with scripts/launch_local_multiworker.sh")
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")


def device_kinds(strategy: tf.distribute.Strategy) -> set[str]:
    """The kinds ("CPU", "GPU", "TPU") of the devices this worker's replicas of `strategy` compute on; for the
    default strategy, where ops go: the first GPU if there is one, else the CPU."""
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # the default strategy
        devices = [d.name for d in tf.config.list_logical_devices("GPU")[:1]] or ["/device:CPU:0"]
    return {tf.DeviceSpec.from_string(d).device_type for d in devices}


def broadcast_from_chief(strategy: tf.distribute.Strategy, value: int) -> int:
    """The chief's `value` (a non-negative int) on every worker: one all-reduce in which only the first replica
    contributes. Workers that measured something each (`txl_tf.training.autotune`) agree on the chief's result."""
    def contribution():
        first = tf.distribute.get_replica_context().replica_id_in_sync_group == 0
        return tf.where(first, tf.constant(value, tf.int64), tf.constant(0, tf.int64))

    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(contribution), axis=None)
    return int(total.numpy())


def task_info(strategy: tf.distribute.Strategy) -> tuple[Optional[str], int]:
    """(task type, task id) of this process: (None, 0) outside a multi-worker cluster."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return None, 0
    return resolver.task_type, int(resolver.task_id or 0)


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True on the process that owns model_dir: the chief, else worker 0 of a cluster without a chief."""
    task_type, task_id = task_info(strategy)
    if task_type is None or task_type == "chief":
        return True
    if task_type == "worker" and task_id == 0:
        cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
        return "chief" not in cluster
    return False


def worker_dir(model_dir: str, strategy: tf.distribute.Strategy) -> str:
    """model_dir on the chief; a per-worker temporary directory inside it elsewhere (see `cleanup_worker_dir`)."""
    if is_chief(strategy):
        return model_dir
    task_type, task_id = task_info(strategy)
    return os.path.join(model_dir, f".tmp_{task_type}_{task_id}")


def cleanup_worker_dir(model_dir: str, strategy: tf.distribute.Strategy) -> None:
    """Removes a non-chief worker's temporary directory."""
    directory = worker_dir(model_dir, strategy)
    if directory != model_dir:
        shutil.rmtree(directory, ignore_errors=True)


def replica_values(strategy: tf.distribute.Strategy, fn: Callable[[int], tf.Tensor]):
    """A per-replica value: `fn(global replica id)`, placed on each local replica's device."""
    try:
        devices = strategy.extended.worker_devices  # this worker's replicas, in replica order
    except RuntimeError:  # the default strategy: one replica on the default device
        devices = (None,)

    def value(ctx):
        replica = ctx.replica_id_in_sync_group
        with tf.device(devices[replica % len(devices)]):
            return tf.identity(fn(replica))

    return strategy.experimental_distribute_values_from_function(value)


# Dtypes that CPU collectives gather (the CPU all-gather kernel takes no bfloat16 / bool / int8).
_GATHERED = (tf.float32, tf.float16, tf.float64, tf.int32, tf.int64)


def gather_replicas(strategy: tf.distribute.Strategy, value, axis: int) -> tf.Tensor:
    """Concatenates a per-replica value of every replica (all workers) along `axis`, in replica order.

    A bfloat16 value travels as float32 (exact both ways), since CPU collectives do not gather bfloat16.
    """
    if strategy.num_replicas_in_sync == 1:
        local = strategy.experimental_local_results(value)
        return tf.convert_to_tensor(local[0])
    dtype = strategy.experimental_local_results(value)[0].dtype
    if dtype in _GATHERED:
        return strategy.gather(value, axis=axis)
    if not dtype.is_floating:
        raise TypeError(f"cannot gather a {dtype.name} value across replicas; cast it to int32 or float32")
    wide = strategy.run(lambda v: tf.cast(v, tf.float32), args=(value,))
    return tf.cast(strategy.gather(wide, axis=axis), dtype)


# ---- a lost worker ----------------------------------------------------------------------------------------
# What a multi-worker run gets when a peer dies or hangs: TensorFlow's coordination service (which
# MultiWorkerMirroredStrategy starts) expects a heartbeat from every task; a task silent for its heartbeat timeout
# (about 10 s in TF 2.21; a stopped or vanished machine) is reported unhealthy to the others, and their pending
# collectives abort with UnavailableError. A killed process resets its connections and aborts them at once.
_PEER_FAILURES = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
                  tf.errors.DeadlineExceededError, tf.errors.InternalError)
_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def is_multi_worker(strategy: tf.distribute.Strategy) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and task_info(strategy)[0] is not None


def lost_worker(error: BaseException, strategy: tf.distribute.Strategy) -> Optional[str]:
    """A short description of the peer that a collective's failure names ("worker 1 (127.0.0.1:2222) stopped
    sending heartbeats"), or None when `error` is not a multi-worker run's lost peer."""
    if not isinstance(error, _PEER_FAILURES) or not is_multi_worker(strategy):
        return None
    text = str(error)
    lower = text.lower()
    if "aborted" not in lower and "unavailable" not in lower and not isinstance(error, tf.errors.UnavailableError):
        return None
    cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
    if "refused" in lower or "reset by peer" in lower or "socket closed" in lower:
        why = "ended (its connections were refused or reset)"
    elif "coordinationservice/heartbeat" in lower:  # this worker's heartbeat to the service's host timed out
        why = "stopped answering heartbeats"
    elif "heartbeat" in lower:
        why = "stopped sending heartbeats"
    else:
        why = "stopped answering"

    def describe(job: str, index: int) -> str:
        addresses = cluster.get(job, [])
        return f"{job} {index}" + (f" ({addresses[index]})" if index < len(addresses) else "") + f" {why}"

    mine = task_info(strategy)
    for job, index in _TASK.findall(text):
        if (job, int(index)) != mine:
            return describe(job, int(index))
    if "CoordinationService/Heartbeat" in text:  # the coordination service's host (chief, else worker 0) is silent
        return describe("chief" if "chief" in cluster else "worker", 0)
    return f"a peer worker {why}"
