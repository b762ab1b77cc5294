r"""Reproduce the paper's findings at CPU scale: training runs, evaluations, results.json and a report.

    python -m txl_tf.study --study=ablation --output_dir=studies/cpu          # 6 variants x 4 attention lengths
    python -m txl_tf.study --study=recl --output_dir=studies/cpu              # the same runs + RECL
    python -m txl_tf.study --study=ptb --output_dir=studies/cpu               # Penn Treebank recipe + vanilla
    python -m txl_tf.study --study=report --output_dir=studies/cpu --publish=docs   # docs/reproduction.md
    python -m txl_tf.study --study=ablation --quick --output_dir=/tmp/q      # tiny: checks the pipeline (~2 min)

Each study writes DIR/results.json (its own section, merged with the others'), DIR/report.md and PNG plots. Re-running
skips finished runs and cached evaluations and resumes an interrupted run from its latest checkpoint. Corpora are
prepared under --data_root when missing. `--publish=DOCS` also writes DOCS/reproduction.md and
DOCS/reproduction/{results.json, *.png}, the report the README links to.
"""

from __future__ import annotations

import os
import shutil

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

STUDIES = ("ablation", "recl", "ptb", "report")
PUBLISHED_NAME = "reproduction"

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list("study", None, f"Studies to run, in order: {', '.join(STUDIES)}.")
    flags.DEFINE_string("output_dir", None, "Where the runs, results.json, report.md and plots go.")
    flags.DEFINE_boolean("quick", False, "Tiny models and a few steps: checks the whole pipeline in ~2 minutes.")
    flags.DEFINE_string("data_root", "data", "Prepared corpora live in DATA_ROOT/<dataset> (prepared when missing).")
    flags.DEFINE_string("publish", None, "Also write PUBLISH/reproduction.md and PUBLISH/reproduction/ (e.g. docs).")
    flags.mark_flags_as_required(["study", "output_dir"])


def prepared_data(data_root: str, dataset: str) -> str:
    """DATA_ROOT/dataset, prepared with the default settings when it is not there yet."""
    from txl_tf.data import corpora, prepare, records

    data_dir = os.path.join(data_root, dataset)
    if not os.path.exists(os.path.join(data_dir, records.METADATA_FILE)):
        from txl_tf.study.runs import log

        log(f"preparing {dataset} in {data_dir}")
        prepare.prepare(dataset, data_dir, corpora.Settings())
    return data_dir


def run(studies, output_dir: str, *, quick: bool = False, data_root: str = "data", publish: str | None = None) -> dict:
    """Runs the studies in order, then writes the report; returns the results document."""
    from txl_tf.study import report, runs

    unknown = [s for s in studies if s not in STUDIES]
    if unknown:
        raise runs.StudyError(f"unknown study {unknown[0]!r}; choose from {', '.join(STUDIES)}")
    os.makedirs(output_dir, exist_ok=True)
    results_path = os.path.join(output_dir, "results.json")
    for study in studies:
        if study in ("ablation", "recl"):
            from txl_tf.study import ablation

            previous = runs.read_results(results_path)["studies"].get("ablation", {}) \
                if os.path.exists(results_path) else {}
            with_recl = study == "recl" or "recl" in previous
            data_dir = prepared_data(data_root, "enwik8_sample")
            section = ablation.run(output_dir, data_dir, quick=quick, with_recl=with_recl)
            runs.write_results(output_dir, "ablation", section)
        elif study == "ptb":
            from txl_tf.study import ptb

            section = ptb.run(output_dir, prepared_data(data_root, "ptb"), quick=quick)
            runs.write_results(output_dir, "ptb", section)
    document = runs.read_results(results_path)
    path = report.write(document, output_dir)
    runs.log(f"wrote {path}")
    if publish:
        target = os.path.join(publish, PUBLISHED_NAME)
        os.makedirs(target, exist_ok=True)
        shutil.copyfile(results_path, os.path.join(target, "results.json"))
        path = report.write(document, target, markdown_path=os.path.join(publish, PUBLISHED_NAME + ".md"),
                            images=PUBLISHED_NAME + "/", source=f"{PUBLISHED_NAME}/results.json")
        runs.log(f"published {path}")
    return document


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    from txl_tf.study.runs import StudyError

    try:
        run(FLAGS.study, FLAGS.output_dir, quick=FLAGS.quick, data_root=FLAGS.data_root, publish=FLAGS.publish)
    except StudyError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    define_flags()
    app.run(main)
