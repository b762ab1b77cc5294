r"""Why the vanilla Transformer (Al-Rfou et al.) trains worse than the model without recurrence (issue 54).

In the context study both models see the same 256-character windows, the same steps, learning rate and data;
they differ only in how they encode positions. This script trains, from the study's own gin files, models that
differ in that alone (and the vanilla model on the paper's half loss), for a short budget, then scores each on the
same validation windows by window position:

    relative           gin/study/context_no_recurrence.gin: Transformer-XL's relative encoding, no memory
    learned_absolute   gin/study/context_al_rfou.gin: the study's vanilla model (a learned table per layer)
    sinusoid_absolute  the relative model's file with attn_type 'vaswani': fixed sinusoids added to the input,
                       absolute like the vanilla model, with nothing to learn
    learned_absolute_half_loss  the vanilla model trained on the loss of each window's second half only, as the
                       paper trains its Table 5 vanilla row ("absolute encodings only work well with half losses")

If sinusoid_absolute trains like relative, the vanilla model's learned table is what costs it; if it trains like
learned_absolute, absolute positions themselves cost it at this size and budget (no bug: tests/test_vanilla_baseline.py
checks the table and the sliding scorer). The table by window position shows where the loss goes (the half-loss
model's last training bpc is over the second halves only: compare it by position).

    python scripts/diagnose_vanilla.py --output_dir=/tmp/vanilla --data_root=data --steps=1000

Each run is an ordinary run directory under OUTPUT_DIR (resumable: a second call trains nothing finished again).
"""

from __future__ import annotations

import math
import os

import numpy as np
from absl import flags

from txl_tf.base import cli, paths
from txl_tf.study import ablation, runs
from txl_tf.study.scoring import bits

FLAGS = flags.FLAGS
WINDOW = 256  # the context study's training window (its training span)
MODELS = (  # (name, gin file, extra bindings)
    ("relative", "study/context_no_recurrence.gin", ()),
    ("learned_absolute", "study/context_al_rfou.gin", tuple(ablation.vanilla_params(WINDOW))),
    ("sinusoid_absolute", "study/context_no_recurrence.gin", ("ModelConfig.attn_type = 'vaswani'",)),
    ("learned_absolute_half_loss", "study/context_al_rfou.gin",
     (*ablation.vanilla_params(WINDOW), "TrainConfig.loss_recent_half = True")),
)
BUCKETS = ((0, 16), (16, 64), (64, 128), (128, 192), (192, 255), (255, 256))  # window positions [lo, hi)
QUICK_PARAMS = ("ModelConfig.n_layer = 2", "ModelConfig.d_model = 16", "ModelConfig.n_head = 2",
                "ModelConfig.d_head = 8", "ModelConfig.d_inner = 24", "TrainConfig.batch_size = 2",
                *runs.PINNED_PATH)


def define_flags(flag_values) -> None:
    flags.DEFINE_string("output_dir", None, "Where the runs go (a run directory each).", flag_values=flag_values)
    flags.DEFINE_string("data_root", "data", "The prepared corpus is DATA_ROOT/enwik8_sample (prepared when "
                        "missing).", flag_values=flag_values)
    flags.DEFINE_integer("steps", 1000, "Training steps of each model (the cosine schedule spans them).",
                         lower_bound=1, upper_bound=100_000, flag_values=flag_values)
    flags.DEFINE_integer("valid_windows", 400, "Validation windows of 256 characters scored per model.", lower_bound=1,
                         upper_bound=10_000, flag_values=flag_values)
    flags.DEFINE_integer("seed", 1, "Training seed k (TrainConfig.seed = 1233 + k, as the study's seeds).",
                         lower_bound=1, upper_bound=1000, flag_values=flag_values)
    flags.DEFINE_boolean("quick", False, "A tiny model (the test suite's check of the pipeline).",
                         flag_values=flag_values)
    flags.mark_flags_as_required(["output_dir"], flag_values=flag_values)


def spec(name: str, gin_file: str, extra: tuple, data_dir: str, steps: int, seed: int, quick: bool) -> runs.RunSpec:
    params = [f"DATA_DIR = '{data_dir}'", f"TrainConfig.train_steps = {steps}",
              f"TrainConfig.log_every = {max(1, steps // 10)}", f"TrainConfig.checkpoint_every = {steps}",
              f"TrainConfig.steps_per_loop = {min(50, steps)}", *extra, *runs.seed_params(seed)]
    params += QUICK_PARAMS if quick else ()
    return runs.RunSpec(name=f"{name}_seed{seed}", gin_files=(gin_file,), gin_params=tuple(params), label=name)


def window_losses(run_dir: str, tokens: np.ndarray, count: int) -> np.ndarray:
    """[count, WINDOW] losses (nats) of the first `count` non-overlapping validation windows (count * WINDOW + 1
    tokens at most), each scored alone (no memory), as the
    training loss is: position p predicts from the p + 1 characters of its window up to it."""
    from txl_tf.evaluation import loops as evaluation
    from txl_tf.model.protocol import Protocol

    model, _ = runs.load_run_model(run_dir)
    starts = np.arange(count) * WINDOW
    streams = tokens[starts[:, None] + np.arange(WINDOW + 1)[None, :]]  # [count, WINDOW + 1]
    result = evaluation.evaluate_streams(model, streams, tgt_len=WINDOW, protocol=Protocol(mem_len=0),
                                         return_token_losses=True)
    return result.token_losses.reshape(count, WINDOW)


def main(argv) -> None:
    cli.no_arguments(argv)
    from txl_tf.data import pipeline
    from txl_tf.study.studies import prepared_data

    output_dir = paths.output_dir(FLAGS.output_dir, "--output_dir")
    data_dir = prepared_data(paths.output_dir(FLAGS.data_root, "--data_root"), "enwik8_sample")
    valid = np.asarray(pipeline.read_split(data_dir, "valid"), np.int32)
    windows = min(FLAGS.valid_windows, (len(valid) - 1) // WINDOW)  # as many as the split holds
    rows = []
    for name, gin_file, extra in MODELS:
        run = spec(name, gin_file, extra, data_dir, FLAGS.steps, FLAGS.seed, FLAGS.quick)
        run_dir = os.path.join(output_dir, run.name)
        done = runs.read_record(run_dir) is not None
        runs.log(f"{run.name}: {'trained already' if done else f'training {FLAGS.steps} steps'} in {run_dir}")
        record = runs.train_run(run, run_dir, echo=False)  # a finished run of other settings is one error line
        losses = window_losses(run_dir, valid, windows)
        rows.append([name, f"{record['final_train_loss'] / math.log(2.0):.4f}", f"{bits(losses):.4f}",
                     *[f"{bits(losses[:, lo:hi]):.4f}" for lo, hi in BUCKETS]])
    machine = runs.machine()
    print(f"\n{FLAGS.steps} steps each, seed {FLAGS.seed}, on {machine['cpu']} ({machine['isa']}, "
          f"{machine['cores']} cores), {machine['date']}, commit {machine['commit']}; validation: "
          f"{windows} windows of {WINDOW}, each alone; bits per character\n")
    header = ["model", "last training bpc", "valid bpc", *[f"positions {lo}-{hi - 1}" for lo, hi in BUCKETS]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    cli.run(main, define_flags)
