"""Prepared-data layout on disk: TFRecord shards of fixed-size token chunks, vocab.json, metadata.json.

    DATA_DIR/
      metadata.json                      written last; its presence marks a complete data_dir
      vocab.json                         the Vocab (JSON)
      train-00000-of-00002.tfrecord ...  one tf.train.Example per chunk of `chunk_size` tokens
      valid-00000-of-00001.tfrecord
      test-00000-of-00001.tfrecord

Each record holds `tokens` (raw little-endian bytes, uint16 when the vocabulary fits, else int32), `index` (the
chunk's position in the split) and `length`. Nothing depends on batch size, tgt_len or the number of devices:
a split is just its token sequence. A data_dir is built in a temporary sibling directory and renamed into place
when complete, so an interrupted preparation never leaves a directory that looks prepared.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import numpy as np

from txl_tf.base import staging
from txl_tf.base.errors import UserError
from txl_tf.data.progress import Progress
from txl_tf.data.vocab import VOCAB_FILE, Vocab

FORMAT = "txl_tf.prepared_data"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
KIND = "prepared dataset"  # the kind of output in the folder's manifest (txl_tf.base.paths)
DEFAULT_CHUNK_SIZE = 1 << 16  # tokens per record
DEFAULT_SHARD_CHUNKS = 256  # records per shard: 16M tokens, 32-64 MB
REPREPARE = "re-run `python -m txl_tf.data.prepare --dataset=NAME --data_dir=DIR --overwrite`"


class DataError(UserError, ValueError):
    """A prepared data directory is damaged or incomplete (the message names the file and how to rebuild it)."""


class DataMissingError(UserError, FileNotFoundError):
    """A file of a prepared data directory (or the directory itself) is missing."""


def vocab_sha256(vocab: Vocab) -> str:
    """The fingerprint of a vocabulary: the SHA-256 of its level and symbols in order, as canonical JSON. Two
    vocabularies have the same one exactly when every id means the same symbol in both (what a model's weights
    depend on); the options of encoding (eos, bos, unk, dropped bytes) do not enter it."""
    text = json.dumps({"level": vocab.level, "symbols": list(vocab.symbols)}, ensure_ascii=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def token_dtype(vocab_size: int) -> str:
    return "<u2" if vocab_size <= 1 << 16 else "<i4"


def _crc32(ids: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(ids, "<i4").view(np.uint8)) & 0xFFFFFFFF


def _example(tokens: bytes, index: int, length: int) -> bytes:
    import tensorflow as tf

    feature = {
        "tokens": tf.train.Feature(bytes_list=tf.train.BytesList(value=[tokens])),
        "index": tf.train.Feature(int64_list=tf.train.Int64List(value=[index])),
        "length": tf.train.Feature(int64_list=tf.train.Int64List(value=[length])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_split(
    directory: str,
    split: str,
    ids: np.ndarray,
    vocab_size: int,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    shard_chunks: int = DEFAULT_SHARD_CHUNKS,
) -> dict:
    """Writes one split's token sequence as TFRecord shards in `directory`; returns its metadata entry."""
    import tensorflow as tf

    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0:
        raise DataError(f"split {split!r} is empty or not a 1-D token sequence (shape {ids.shape}); give a "
                        "longer corpus")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise DataError(f"split {split!r} has ids outside [0, {vocab_size})")
    dtype = token_dtype(vocab_size)
    data = ids.astype(dtype)
    n_chunks = -(-data.size // chunk_size)
    n_shards = -(-n_chunks // shard_chunks)
    shards = []
    progress = Progress(f"writing {split}", data.size, unit="tokens")
    for s in range(n_shards):
        name = f"{split}-{s:05d}-of-{n_shards:05d}.tfrecord"
        first, last = s * shard_chunks, min((s + 1) * shard_chunks, n_chunks)
        with tf.io.TFRecordWriter(os.path.join(directory, name)) as writer:
            for c in range(first, last):
                chunk = data[c * chunk_size:(c + 1) * chunk_size]
                writer.write(_example(chunk.tobytes(), c, chunk.size))
                progress.update(chunk.size)
        n_tok = min(last * chunk_size, data.size) - first * chunk_size
        shards.append({"file": name, "num_chunks": last - first, "num_tokens": int(n_tok),
                       "bytes": os.path.getsize(os.path.join(directory, name))})
    progress.close()
    return {"num_tokens": int(data.size), "crc32": _crc32(ids), "shards": shards}


def read_split_records(data_dir: str, meta: dict, split: str) -> np.ndarray:
    """Reads and checks one split (chunk order, counts, CRC32 of the tokens): int32 [num_tokens]."""
    import tensorflow as tf

    if split not in meta["splits"]:
        raise KeyError(f"{data_dir} has no split {split!r}; it has {sorted(meta['splits'])}")
    info = meta["splits"][split]
    dtype = np.dtype(meta["dtype"])
    spec = {
        "tokens": tf.io.FixedLenFeature([], tf.string),
        "index": tf.io.FixedLenFeature([], tf.int64),
        "length": tf.io.FixedLenFeature([], tf.int64),
    }
    parts, next_index = [], 0
    for shard in info["shards"]:
        path = os.path.join(data_dir, shard["file"])
        if not os.path.exists(path):
            raise DataMissingError(f"TFRecord shard {path} is missing; {REPREPARE}")
        if os.path.getsize(path) != shard["bytes"]:
            raise DataError(f"TFRecord shard {path} has {os.path.getsize(path)} bytes, metadata says "
                             f"{shard['bytes']} (truncated or replaced); {REPREPARE}")
        dataset = tf.data.TFRecordDataset(path).batch(64).map(lambda s: tf.io.parse_example(s, spec))
        shard_tokens = 0
        try:
            for batch in dataset.as_numpy_iterator():
                for raw, index, length in zip(batch["tokens"], batch["index"], batch["length"], strict=True):
                    chunk = np.frombuffer(raw, dtype)
                    if index != next_index or chunk.size != length:
                        raise DataError(f"TFRecord shard {path}: record {index} (length {length}, "
                                         f"{chunk.size} tokens) where chunk {next_index} was expected; "
                                         f"{REPREPARE}")
                    parts.append(chunk)
                    next_index += 1
                    shard_tokens += chunk.size
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
            raise DataError(f"TFRecord shard {path} is corrupt ({err.message.splitlines()[0]}); "
                             f"{REPREPARE}") from None
        if shard_tokens != shard["num_tokens"]:
            raise DataError(f"TFRecord shard {path} holds {shard_tokens} tokens, metadata says "
                             f"{shard['num_tokens']}; {REPREPARE}")
    ids = np.concatenate(parts).astype(np.int32) if parts else np.zeros([0], np.int32)
    if ids.size != info["num_tokens"]:
        raise DataError(f"split {split!r} in {data_dir} has {ids.size} tokens, metadata says "
                         f"{info['num_tokens']}; {REPREPARE}")
    if _crc32(ids) != info["crc32"]:
        raise DataError(f"split {split!r} in {data_dir}: token checksum mismatch; {REPREPARE}")
    if ids.size and (ids.min() < 0 or ids.max() >= meta["vocab_size"]):
        bad = int(ids[(ids < 0) | (ids >= meta["vocab_size"])][0])
        raise DataError(f"split {split!r} in {data_dir} has token id {bad} outside the vocabulary "
                         f"[0, {meta['vocab_size']}); {REPREPARE}")
    return ids


def read_metadata(data_dir: str) -> dict:
    """Loads and checks metadata.json (format, version, required fields)."""
    path = os.path.join(data_dir, METADATA_FILE)
    if not os.path.exists(path):
        hint = (" (it looks like an unfinished preparation)" if os.path.isdir(data_dir) and os.listdir(data_dir)
                else "")
        raise DataMissingError(f"{path} not found{hint}: {data_dir} is not a prepared data directory; run "
                                "`python -m txl_tf.data.prepare --dataset=NAME --data_dir=DIR`")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid JSON ({err}); {REPREPARE}") from None
    if meta.get("format") != FORMAT:
        raise DataError(f"{path} is not txl_tf prepared-data metadata (format={meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path} has format_version {meta.get('format_version')}, this txl_tf reads "
                         f"version {FORMAT_VERSION}; {REPREPARE}")
    missing = [k for k in ("dataset", "level", "vocab_size", "dtype", "splits") if k not in meta]
    if missing:
        raise DataError(f"{path} lacks {missing}; {REPREPARE}")
    return meta


def write_prepared(
    data_dir: str,
    *,
    dataset: str,
    vocab: Vocab,
    splits: dict,
    source: dict,
    options: dict,
    overwrite: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    shard_chunks: int = DEFAULT_SHARD_CHUNKS,
) -> dict:
    """Writes a complete data_dir atomically (temporary sibling + rename); returns the metadata."""
    from txl_tf.base.version import __version__

    if os.path.exists(data_dir) and os.listdir(data_dir) and not overwrite:
        raise FileExistsError(f"{data_dir} already exists; pass --overwrite to replace it")
    with staging.staged_dir(data_dir, kind=KIND, name="--data_dir", overwrite=overwrite) as tmp:
        vocab.save(os.path.join(tmp, VOCAB_FILE))
        split_meta = {
            name: write_split(tmp, name, ids, len(vocab), chunk_size=chunk_size, shard_chunks=shard_chunks)
            for name, ids in splits.items()
        }
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dataset": dataset,
            "level": vocab.level,
            "vocab_size": len(vocab),
            "vocab_file": VOCAB_FILE,
            "chunk_size": chunk_size,
            "dtype": token_dtype(len(vocab)),
            "token_counts": {name: m["num_tokens"] for name, m in split_meta.items()},
            "splits": split_meta,
            "source": source,
            "options": options,
            "created_with": f"txl_tf {__version__}",
        }
        with open(os.path.join(tmp, METADATA_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.write("\n")
    return meta


def remove_stale_temporaries(data_dir: str) -> list:
    """Removes DATA_DIR.tmp-* / .old-* directories left by killed preparations (txl_tf.base.staging.remove_stale)."""
    return staging.remove_stale(data_dir)


def verify(data_dir: str, meta: dict) -> None:
    """Reads every split and the vocabulary of a prepared data_dir; raises DataError naming a damaged file."""
    path = os.path.join(data_dir, meta.get("vocab_file", VOCAB_FILE))
    try:
        Vocab.load(path)
    except (ValueError, FileNotFoundError) as error:
        raise DataError(f"{error}".rstrip(".") if path in str(error) else f"{path}: {error}") from None
    for split in meta["splits"]:
        read_split_records(data_dir, meta, split)

