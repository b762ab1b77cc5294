"""The golden fixture (a checkpoint of the authors' TF code, `original_tf_char_small`) converted the way
`python -m txl_tf.convert` does it, and its tokens as a tiny prepared data_dir."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURE_DIR

# The fixture's architecture (n_token 50, mem_len 7 as it was run) and the protocol it was run with: its 3 streams
# of 16 tokens, laid end to end, are exactly the authors' batching ("original" layout) of a 48-token split.
ARCHITECTURE = dict(n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32)
MEM_LEN = 7
PROTOCOL = dict(tgt_len=5, mem_len=MEM_LEN, clamp_len=-1, same_length=False, batch_size=3, layout="original")


def golden_model():
    """The fixture's checkpoint as a TransformerXL (skips the test when the shared fixtures are absent)."""
    from txl_tf import convert

    if not (FIXTURE_DIR / "golden.npz").exists():
        pytest.skip(f"golden fixtures not found at {FIXTURE_DIR} (set TXL_SHARED_DIR to the shared/ folder)")
    return convert.from_original_tf(str(FIXTURE_DIR / "model.ckpt"), mem_len=MEM_LEN)


def convert_golden(directory) -> str:
    """`directory`/ckpt-1 (key `model`) and model.gin, as the converter writes them; returns `directory`."""
    import tensorflow as tf

    model = golden_model()
    tf.train.Checkpoint(model=model).save(f"{directory}/ckpt")
    bindings = {**ARCHITECTURE, "n_token": 50, "mem_len": MEM_LEN}
    with open(f"{directory}/model.gin", "w") as f:
        f.write("".join(f"ModelConfig.{k} = {v!r}\n" for k, v in bindings.items()))
    return str(directory)


def golden_data(data_dir, symbols=tuple(range(50))) -> tuple[str, float]:
    """The fixture's 3 streams of 16 tokens end to end as the `test` split of a char-level data_dir whose 50
    symbols are `symbols`; returns (data_dir, the fixture's mean NLL under its own protocol)."""
    from txl_tf.data.records import write_prepared
    from txl_tf.data.vocab import Vocab

    golden = np.load(FIXTURE_DIR / "golden.npz")
    write_prepared(str(data_dir), dataset="golden", vocab=Vocab(list(symbols), "char"),
                   splits={"test": golden["tokens"].T.reshape(-1).astype(np.int32)}, source={}, options={})
    return str(data_dir), float(np.mean([golden[f"nll_{s}"].mean() for s in range(3)]))


def eval_gin(data_dir) -> str:
    """Gin bindings: DataConfig.data_dir and the fixture's PROTOCOL as EvalConfig."""
    return f"DataConfig.data_dir = {str(data_dir)!r}\n" + "".join(
        f"EvalConfig.{k} = {v!r}\n" for k, v in PROTOCOL.items())
