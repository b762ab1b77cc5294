r"""Reproduce the paper's findings at CPU scale: training runs, evaluations, results.json and a report.

    python -m txl_tf.study --study=ablation --output_dir=studies/cpu          # 6 variants x 3 seeds x 4 lengths
    python -m txl_tf.study --study=ablation_shaw --output_dir=studies/cpu     # one variant's seeds, archived
    python -m txl_tf.study --study=recl --output_dir=studies/cpu              # the same runs + RECL
    python -m txl_tf.study --study=ptb --output_dir=studies/cpu               # Penn Treebank recipe + vanilla
    python -m txl_tf.study --study=report --output_dir=studies/cpu --publish=docs --readme=README.md
    python -m txl_tf.study --study=context_code_rope --output_dir=studies/cpu --archive_dir=studies/archive
    python -m txl_tf.study --study=ablation --quick --output_dir=/tmp/q      # tiny: checks the pipeline (~2 min)

The verdicts follow docs/study_plan.md (three seeds per model, a t interval over the seeds, Holm within a table);
the full study trains only from committed code. Each study writes DIR/results.json (its own section, merged with the others'), DIR/report.md and PNG plots. Re-running
skips finished runs and cached evaluations and resumes an interrupted run from its latest checkpoint. Corpora are
prepared under --data_root when missing. The ablation and the context studies archive each scored model
(--archive_dir, 1-2 MB each: txl_tf.study.archive); the repository's studies/archive holds the published ones, so
a study given it on another machine trains and scores only the models that are missing. `--publish=DOCS` also writes DOCS/reproduction.md and
DOCS/reproduction/{results.json, *.png}, the report the README links to, and nothing outside DOCS; `--readme=FILE`
rewrites the study summary block of FILE (between report.SUMMARY_BEGIN and report.SUMMARY_END). Both are checked
before anything runs or is written: a folder that cannot be written or a README without the block is one error line.
"""

from __future__ import annotations

import os

from absl import flags

from txl_tf.base import cli, errors, paths
from txl_tf.study import report
from txl_tf.study.runs import log
from txl_tf.study.studies import STUDIES, run

FLAGS = flags.FLAGS


def define_flags(flag_values) -> None:
    flags.DEFINE_list("study", None, f"Studies to run, in order: {', '.join(STUDIES)}.", flag_values=flag_values)
    flags.DEFINE_string("output_dir", None, "Where the runs, results.json, report.md and plots go.",
                        flag_values=flag_values)
    flags.DEFINE_boolean("quick", False, "Tiny models and a few steps: checks the whole pipeline in ~2 minutes.",
                         flag_values=flag_values)
    flags.DEFINE_string("data_root", "data", "Prepared corpora live in DATA_ROOT/<dataset> (prepared when "
                        "missing).", flag_values=flag_values)
    flags.DEFINE_string("archive_dir", None, "The ablation and context studies read finished models' scores from "
                        "here and archive each model they score here (1-2 MB each; default OUTPUT_DIR/archive). The "
                        "repository's studies/archive holds the published models: a study given it trains only "
                        "what is missing.",
                        flag_values=flag_values)
    flags.DEFINE_string("publish", None, "Also write PUBLISH/reproduction.md and PUBLISH/reproduction/ (e.g. docs), "
                        "and nothing else.", flag_values=flag_values)
    flags.DEFINE_string("readme", None, "Also rewrite the study summary block of this file (e.g. README.md).",
                        flag_values=flag_values)
    flags.mark_flags_as_required(["study", "output_dir"], flag_values=flag_values)


def main(argv):
    cli.no_arguments(argv)
    errors.require("matplotlib", "the study", "analysis")  # the report's plots; checked before any run
    paths.output_dir(FLAGS.output_dir, "--output_dir")
    paths.output_dir(FLAGS.data_root, "--data_root")
    report.check_publish(FLAGS.publish, FLAGS.readme)  # before any run: nothing is written when one is wrong
    if FLAGS.archive_dir is not None:
        paths.output_dir(FLAGS.archive_dir, "--archive_dir")
    document = run(FLAGS.study, FLAGS.output_dir, quick=FLAGS.quick, data_root=FLAGS.data_root,
                   archive_dir=FLAGS.archive_dir)
    if FLAGS.publish or FLAGS.readme:
        for path in report.publish(document, os.path.join(FLAGS.output_dir, "results.json"), FLAGS.publish,
                                   readme=FLAGS.readme):
            log(f"published {path}")


if __name__ == "__main__":
    cli.run(main, define_flags)
