"""txl_tf.training.distribute: the strategy factory and per-replica values (2 logical CPU devices from conftest)."""

import numpy as np
import pytest
import tensorflow as tf

from txl_tf.training import distribute


def test_factory_builds_each_local_strategy():
    assert distribute.make_strategy("default") is tf.distribute.get_strategy()
    one = distribute.make_strategy("one_device")
    assert isinstance(one, tf.distribute.OneDeviceStrategy) and one.num_replicas_in_sync == 1
    mirrored = distribute.make_strategy("mirrored")
    assert isinstance(mirrored, tf.distribute.MirroredStrategy)
    assert mirrored.num_replicas_in_sync == 2  # the two logical CPUs


def test_factory_errors_name_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="one of default, one_device, mirrored"):
        distribute.make_strategy("horovod")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="launch_local_multiworker.sh"):
        distribute.make_strategy("multi_worker_mirrored")


def test_replica_values_and_gather_keep_stream_order():
    strategy = distribute.make_strategy("mirrored")
    full = tf.reshape(tf.range(2 * 6 * 3, dtype=tf.float32), [2, 6, 3])  # [n, B, d]: 3 streams per replica
    per_replica = distribute.replica_values(strategy, lambda r: full[:, 3 * r:3 * r + 3])
    local = strategy.experimental_local_results(per_replica)
    assert [v.device.endswith(f"CPU:{i}") for i, v in enumerate(local)] == [True, True]
    np.testing.assert_array_equal(local[1].numpy(), full[:, 3:].numpy())
    np.testing.assert_array_equal(distribute.gather_replicas(strategy, per_replica, axis=1).numpy(), full.numpy())


def test_single_process_is_chief_and_writes_to_model_dir(tmp_path):
    strategy = distribute.make_strategy("default")
    assert distribute.is_chief(strategy)
    assert distribute.worker_dir(str(tmp_path), strategy) == str(tmp_path)
    distribute.cleanup_worker_dir(str(tmp_path), strategy)
    assert tmp_path.exists()  # the chief's directory is never removed


def test_broadcast_from_chief_takes_the_first_replicas_value_once():
    mirrored = distribute.make_strategy("mirrored")  # two replicas: a sum over both would double it
    assert distribute.broadcast_from_chief(mirrored, 5) == 5
    assert distribute.broadcast_from_chief(distribute.make_strategy("default"), 3) == 3
