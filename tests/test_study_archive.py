"""A scored model's archive (txl_tf.study.archive): the section's figures from it equal those from the per-token
losses, it reads back what was written, and a file that is not what it claims is one StudyError naming it, never
a crash or a pickled object run. The whole study from its archives alone is checked in tests/test_study.py."""

import io
import json
import os
import zipfile

import numpy as np
import pytest

from txl_tf.base.errors import UserError
from txl_tf.study import archive, runs

BLOCK = 10
FACTS = {"dataset": "toy", "block": BLOCK, "subset_tokens": 40, "memories": [8, 16]}
DIGEST = "0123456789abcdef"


def _losses(seed: int, n: int = 437) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.gamma(2.0, 0.7, size=n).astype(np.float32)


def _scores() -> dict:
    subset = np.arange(100, 140)
    cells = {("valid", 8, -1): archive.Cell.of(_losses(1), BLOCK),
             ("test", 8, -1): archive.Cell.of(_losses(2), BLOCK, subset),
             ("test", 16, 24): archive.Cell.of(_losses(3), BLOCK, subset)}
    probe = {8: {"128": {"copy": -0.25, "copy_low": -0.3, "copy_high": -0.2}}}
    return {"cells": cells, "probe": probe, "checkpoints": {5: {("test", 8, -1): archive.Cell.of(_losses(4), BLOCK)}},
            "checkpoint_tokens": {5: 640}}


def test_cells_give_the_bootstrap_of_the_per_token_losses():
    a, b, c, d = (_losses(s) for s in range(4))
    cells = [archive.Cell.of(x, BLOCK, np.arange(50, 90)) for x in (a, b, c, d)]
    a, b, c, d = (x.astype(np.float64) for x in (a, b, c, d))
    expected = {k: v / archive.LN2 for k, v in runs.paired_bootstrap(a + d, b + c, block=BLOCK).items()}
    got = archive.compare([cells[0], cells[3]], [cells[1], cells[2]], BLOCK)
    assert got == pytest.approx(expected, abs=1e-9)
    on_subset = {k: v / archive.LN2 for k, v in runs.paired_bootstrap(a[50:90], b[50:90], block=BLOCK).items()}
    assert archive.compare_subset([cells[0]], [cells[1]], BLOCK) == pytest.approx(on_subset, abs=1e-9)
    assert cells[0].bits() == pytest.approx(float(np.mean(a, dtype=np.float64)) / archive.LN2)
    assert cells[0].block_sums.shape == (437 // BLOCK,)  # the 7-token tail: in the mean, not in a block


def test_an_archive_reads_back_what_was_written(tmp_path):
    scores = _scores()
    record = {"name": "toy_xl", "steps": 5, "parameters": 1234}
    path = archive.save(str(tmp_path), "toy_xl", DIGEST, record, scores, FACTS)
    assert path == str(tmp_path / "toy_xl.json")
    got_record, got = archive.load(str(tmp_path), "toy_xl", FACTS, DIGEST)
    assert got_record == record and got["probe"] == scores["probe"] and got["checkpoint_tokens"] == {5: 640}
    for key, cell in scores["cells"].items():
        back = got["cells"][key]
        assert back.mean == cell.mean and back.count == cell.count
        np.testing.assert_array_equal(back.block_sums, cell.block_sums)
        if cell.subset is None:
            assert back.subset is None
        else:
            np.testing.assert_array_equal(back.subset, cell.subset)
    np.testing.assert_array_equal(got["checkpoints"][5][("test", 8, -1)].block_sums,
                                  scores["checkpoints"][5][("test", 8, -1)].block_sums)
    assert archive.load(str(tmp_path), "toy_rope", FACTS, DIGEST) is None  # not archived: trained and scored


def _saved(tmp_path) -> tuple[str, str]:
    archive.save(str(tmp_path), "toy_xl", DIGEST, {"name": "toy_xl"}, _scores(), FACTS)
    return archive.paths_of(str(tmp_path), "toy_xl")


def _refusal(tmp_path, facts=FACTS, digest=DIGEST) -> str:
    with pytest.raises(runs.StudyError) as error:
        archive.load(str(tmp_path), "toy_xl", facts, digest)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_an_archive_of_other_settings_or_another_configuration_is_refused(tmp_path):
    json_path, npz_path = _saved(tmp_path)
    message = _refusal(tmp_path, facts={**FACTS, "memories": [8, 16, 32]})
    assert json_path in message and "(memories)" in message and f"remove {json_path} and {npz_path}" in message
    assert "another configuration" in _refusal(tmp_path, digest="fedcba9876543210")


@pytest.mark.parametrize("commit", ["0123456789ab+changes", "unknown", ""])
def test_an_archive_trained_from_uncommitted_code_is_refused_by_the_full_study(tmp_path, commit):
    archive.save(str(tmp_path), "toy_xl", DIGEST, {"name": "toy_xl", "commit": commit}, _scores(), FACTS)
    assert archive.load(str(tmp_path), "toy_xl", FACTS, DIGEST) is not None  # the quick study reads it
    with pytest.raises(runs.StudyError) as error:
        archive.load(str(tmp_path), "toy_xl", FACTS, DIGEST, clean=True)
    assert "not a committed tree" in str(error.value) and "\n" not in str(error.value)
    archive.save(str(tmp_path), "toy_xl", DIGEST, {"name": "toy_xl", "commit": "0123456789ab"}, _scores(), FACTS)
    assert archive.load(str(tmp_path), "toy_xl", FACTS, DIGEST, clean=True) is not None


def test_seed_k_trains_with_its_own_seed_and_name():
    assert runs.seed_params(1) == [] and runs.seed_name("xl", 1) == "xl"  # seed 1: the archived runs' names
    assert runs.seed_params(3) == ["TrainConfig.seed = 1236"] and runs.seed_name("xl", 3) == "xl_seed3"
    with pytest.raises(ValueError):
        runs.seed_params(0)


@pytest.mark.parametrize("damage", ["garbage", "missing", "pickled", "shape", "nonfinite", "dtype", "huge"])
def test_a_damaged_array_file_is_one_line_naming_it(tmp_path, damage):
    json_path, npz_path = _saved(tmp_path)
    with np.load(npz_path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    if damage == "huge":  # a header that claims 10^12 floats over a few bytes: refused before numpy allocates
        name = next(k for k in sorted(arrays) if k.endswith("_subset"))
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                      "shape": (10**12,)})
        with zipfile.ZipFile(npz_path, "a") as packed:
            packed.writestr(name + "_extra.npy", header.getvalue() + b"\0" * 64)
    elif damage == "garbage":
        with open(npz_path, "wb") as f:
            f.write(b"not an archive at all")
    elif damage == "missing":
        os.remove(npz_path)
    else:
        name = next(k for k in sorted(arrays) if k.endswith("_subset"))
        arrays[name] = {"pickled": np.array([{"x": 1}], dtype=object),
                        "shape": arrays[name][:-1],
                        "nonfinite": np.where(np.arange(arrays[name].size) == 3, np.nan, arrays[name]).astype(
                            np.float32),
                        "dtype": arrays[name].astype(np.float64)}[damage]
        np.savez(npz_path, **arrays)
    message = _refusal(tmp_path)
    assert npz_path in message and "remove" in message
    assert ("claims shape (1000000000000,)" in message) == (damage == "huge")


def test_a_damaged_index_is_one_line_naming_it(tmp_path):
    json_path, _ = _saved(tmp_path)
    index = json.load(open(json_path))
    index["cells"]["final"][0]["key"] = "train/8"
    json.dump(index, open(json_path, "w"))
    assert json_path in _refusal(tmp_path)
    index["cells"]["final"][0]["key"] = "valid/8/-1"
    index["cells"]["final"][0]["mean"] = "1.5"
    json.dump(index, open(json_path, "w"))
    assert "no finite mean" in _refusal(tmp_path)
    with open(json_path, "w") as f:
        f.write("{not json")
    with pytest.raises(UserError) as error:  # untrusted.load_json's one-line error
        archive.load(str(tmp_path), "toy_xl", FACTS, DIGEST)
    assert json_path in str(error.value)
