"""Runs studies by name and writes results.json and the report into the output folder (publishing it is
`txl_tf.study.report.publish`)."""

from __future__ import annotations

import os

from txl_tf.study import ablation, context

CONTEXT_STUDIES = tuple(context.studies())  # context, context_xl, ..., context_code, context_code_xl, ...
# ablation_xl, ablation_shaw, ...: one variant's seeds trained, scored and archived (the section needs all six)
ABLATION_VARIANT_STUDIES = tuple(f"ablation_{v.name}" for v in ablation.VARIANTS)
STUDIES = ("ablation", "recl", *ABLATION_VARIANT_STUDIES, "corpora", *CONTEXT_STUDIES, "ptb", "report")


def prepared_data(data_root: str, dataset: str) -> str:
    """DATA_ROOT/dataset, prepared with the default settings when it is not there yet."""
    from txl_tf.data import corpora, prepare, records

    data_dir = os.path.join(data_root, dataset)
    if not os.path.exists(os.path.join(data_dir, records.METADATA_FILE)):
        from txl_tf.study.runs import log

        log(f"preparing {dataset} in {data_dir}")
        prepare.prepare(dataset, data_dir, corpora.PrepareSettings())
    return data_dir


def run(studies, output_dir: str, *, quick: bool = False, data_root: str = "data", archive_dir: str | None = None
        ) -> dict:
    """Runs the studies in order, then writes the report; returns the results document. The ablation's and the
    context studies' scored models are read from and written to `archive_dir` (default OUTPUT_DIR/archive:
    txl_tf.study.archive)."""
    from txl_tf.base import paths
    from txl_tf.study import report, results_schema, runs

    paths.output_dir(output_dir, "--output_dir")
    paths.output_dir(data_root, "--data_root")
    if archive_dir is not None:
        paths.output_dir(archive_dir, "--archive_dir")
    unknown = [s for s in studies if s not in STUDIES]
    if unknown:
        raise runs.StudyError(f"unknown study {unknown[0]!r}; choose from {', '.join(STUDIES)}")
    os.makedirs(output_dir, exist_ok=True)
    results_path = os.path.join(output_dir, "results.json")
    if os.path.lexists(results_path):  # a results.json of the wrong shape is refused before any study runs
        results_schema.read(results_path)
    for study in studies:
        if study in ("ablation", "recl"):
            previous = runs.read_results(results_path)["studies"].get("ablation", {}) \
                if os.path.exists(results_path) else {}
            with_recl = study == "recl" or "recl" in previous
            data_dir = prepared_data(data_root, "enwik8_sample")
            section = ablation.run(output_dir, data_dir, quick=quick, with_recl=with_recl, archive_dir=archive_dir)
            runs.write_results(output_dir, "ablation", section)
        elif study in ABLATION_VARIANT_STUDIES:
            variant = study[len("ablation_"):]
            ablation.train_variants(output_dir, prepared_data(data_root, "enwik8_sample"), [variant], quick=quick,
                                    archive_dir=archive_dir)
            continue
        elif study == "corpora":
            from txl_tf.study import corpus_choice

            data_dirs = {c.dataset: prepared_data(data_root, c.dataset) for c in context.CORPORA}
            runs.write_results(output_dir, "corpora", corpus_choice.run(data_dirs, quick=quick))
        elif study in CONTEXT_STUDIES:
            from txl_tf.study import context_results

            corpus, models = context.studies()[study]
            section = context_results.run(output_dir, prepared_data(data_root, corpus.dataset), models=models,
                                          quick=quick, corpus=corpus, archive_dir=archive_dir)
            runs.write_results(output_dir, corpus.key, section)
        elif study == "ptb":
            from txl_tf.study import ptb

            section = ptb.run(output_dir, prepared_data(data_root, "ptb"), quick=quick)
            runs.write_results(output_dir, "ptb", section)
    if not os.path.exists(results_path):  # only variants trained (ablation_<variant>): no section yet
        runs.log(f"no results.json in {output_dir} yet: the report waits for a section")
        return {"schema": 1, "studies": {}}
    document = results_schema.read(results_path)
    path = report.write(document, output_dir)
    runs.log(f"wrote {path}")
    return document
