"""Study `ptb`: Penn Treebank (word level) on 2 CPU cores, Transformer-XL against the vanilla model.

Transformer-XL trains with the recipe `gin/ptb_cpu.gin`; the vanilla model of Al-Rfou et al.
(`gin/study/ptb_vanilla.gin`) trains with the same sizes, regularisation, steps and words per step. For each,
the weights of the last `average_last` checkpoints are averaged (`txl_tf.average`, as the paper did for PTB)
and the whole test split is scored with the gin file's evaluation protocol: segments with memory for
Transformer-XL, a window shifted by one word for the vanilla model. Both score every word after the first, so
their per-word losses pair up for a bootstrap interval of the difference.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from txl_tf.study import runs

LN2 = math.log(2.0)
AVERAGED_DIR = "averaged"


@dataclasses.dataclass(frozen=True)
class PTBSettings:
    average_last: int = 5
    eval_tokens: int = 0  # 0 = the whole test split (and the whole validation split for the sweep)
    sweep_memories: tuple = (35, 70, 140, 210, 280, 350, 420)  # evaluation memories tried on the validation split
    bootstrap_block: int = 100
    params: tuple = ()
    vanilla_params: tuple = ()


FULL = PTBSettings()
QUICK = PTBSettings(
    eval_tokens=600, bootstrap_block=20, sweep_memories=(4, 8, 16, 24),
    params=("ModelConfig.n_layer = 2", "ModelConfig.d_model = 32", "ModelConfig.n_head = 2", "ModelConfig.d_head = 16",
            "ModelConfig.d_inner = 64", "ModelConfig.mem_len = 8", "TrainConfig.batch_size = 4",
            "TrainConfig.tgt_len = 8", "TrainConfig.train_steps = 25", "TrainConfig.warmup_steps = 5",
            "TrainConfig.steps_per_loop = 5", "TrainConfig.log_every = 5", "TrainConfig.checkpoint_every = 5",
            "TrainConfig.eval_every = 0", "TrainConfig.measure_mfu = False", *runs.PINNED_PATH, "EvalConfig.tgt_len = 8",
            "EvalConfig.mem_len = 16", "EvalConfig.batch_size = 2"),
    vanilla_params=("ModelConfig.mem_len = 0", "ModelConfig.max_position = 16", "TrainConfig.batch_size = 2",
                    "TrainConfig.tgt_len = 16", "EvalConfig.tgt_len = 16", "EvalConfig.batch_size = 8"),
)
MODELS = (("xl", "Transformer-XL (gin/ptb_cpu.gin)", ("ptb_cpu.gin",)),
          ("vanilla", "vanilla Transformer, same budget (gin/study/ptb_vanilla.gin)", ("study/ptb_vanilla.gin",)))


def run_spec(name: str, label: str, gin_files: tuple, data_dir: str, settings: PTBSettings) -> runs.RunSpec:
    params = (f"DATA_DIR = '{data_dir}'", *settings.params, *(settings.vanilla_params if name == "vanilla" else ()))
    return runs.RunSpec(name=name, gin_files=gin_files, gin_params=params, label=label)


def _averaged_dir(run_dir: str, count: int) -> str:
    """run_dir/averaged: the mean of the last `count` checkpoints (made once)."""
    from txl_tf import average

    output = os.path.join(run_dir, AVERAGED_DIR)
    if not os.path.exists(os.path.join(output, average.RECORD_FILE)):
        average.average(average.last_checkpoints(run_dir, count), output, model_dir=run_dir, overwrite=True)
    return output


def _score(model_dir: str, run_dir: str, key: str, tokens: np.ndarray, mem_len: int | None = None):
    """Per-word losses of the model in model_dir with its run's evaluation protocol (cached under run_dir);
    `mem_len` replaces the protocol's memory (the validation sweep)."""
    from txl_tf.evaluation import loops as evaluation

    def compute():
        model, configs = runs.load_run_model(model_dir)
        e = configs.eval
        if mem_len is not None:
            e = dataclasses.replace(e, mem_len=mem_len)
        if e.protocol == "vanilla":
            result = evaluation.evaluate_vanilla(model, tokens, window=e.tgt_len, batch_size=e.batch_size,
                                                 clamp_len=e.clamp_len, return_token_losses=True)
        else:
            result = evaluation.evaluate_tokens(
                model, tokens, tgt_len=e.tgt_len, protocol=e.attention_protocol(), batch_size=e.batch_size,
                return_token_losses=True)
        losses = result.token_losses
        return losses, {"protocol": result.protocol, "seconds": round(result.seconds, 2), "tokens": int(losses.size),
                        "ppl": float(math.exp(np.mean(losses, dtype=np.float64)))}

    return runs.cached_eval(run_dir, key, compute)


def _memory_sweep(model_dir: str, run_dir: str, valid: np.ndarray, test: np.ndarray, settings: PTBSettings):
    """The averaged model's validation perplexity at every memory of the sweep, then the test split at the best
    one; returns ({"valid_ppl": {memory: ppl}, "chosen": memory, "test_ppl": ppl}, test losses at it)."""
    n = settings.average_last
    ppl = {}
    for memory in settings.sweep_memories:
        ppl[str(memory)] = _score(model_dir, run_dir, f"valid_averaged{n}_mem{memory}_n{valid.size}", valid,
                                  mem_len=memory)[1]["ppl"]
        runs.log(f"[ptb] validation ppl {ppl[str(memory)]:.2f} at evaluation memory {memory}")
    chosen = min(settings.sweep_memories, key=lambda m: ppl[str(m)])
    losses, info = _score(model_dir, run_dir, f"test_averaged{n}_mem{chosen}_n{test.size}", test, mem_len=chosen)
    runs.log(f"[ptb] memory {chosen} chosen on validation: test ppl {info['ppl']:.2f}")
    return {"valid_ppl": ppl, "chosen": chosen, "test_ppl": info["ppl"], "valid_words": int(valid.size - 1)}, losses


def run(output_dir: str, data_dir: str, *, quick: bool = False) -> dict:
    """Trains and scores both models; returns the study's section of results.json."""
    from txl_tf.data import pipeline

    settings = QUICK if quick else FULL
    tokens = pipeline.read_split(data_dir, "test")
    valid = pipeline.read_split(data_dir, "valid")
    if settings.eval_tokens:
        tokens, valid = tokens[: settings.eval_tokens + 1], valid[: settings.eval_tokens + 1]
    records, losses = {}, {}
    for index, (name, label, gin_files) in enumerate(MODELS):
        spec = run_spec(name, label, gin_files, data_dir, settings)
        run_dir = os.path.join(output_dir, "runs", "ptb_" + name)
        position = f"[ptb {index + 1}/{len(MODELS)}] {name}"
        runs.log(f"{position}: training ({', '.join(gin_files)}) in {run_dir}")
        record = dict(runs.train_run(spec, run_dir))
        runs.log(f"{position}: trained {record['steps']} steps in {record['wall_seconds'] / 60:.1f} min")
        model, configs = runs.load_run_model(run_dir)
        record["parameters"] = runs.num_parameters(model)
        record["train_tokens"] = record["steps"] * configs.train.batch_size * configs.train.tgt_len
        record["train_minutes"] = record["wall_seconds"] / 60
        del model
        last_ppl = None
        if configs.eval.protocol != "vanilla":  # a sliding-window pass costs minutes: only the averaged weights
            last_ppl = _score(run_dir, run_dir, f"test_last_n{tokens.size}", tokens)[1]["ppl"]
        averaged_dir = _averaged_dir(run_dir, settings.average_last)
        averaged, info = _score(averaged_dir, run_dir, f"test_averaged{settings.average_last}_n{tokens.size}", tokens)
        record.update(test_ppl_last=last_ppl, test_ppl=info["ppl"], eval=info, averaged_checkpoints=settings.average_last)
        if configs.eval.protocol != "vanilla":  # the evaluation memory, chosen on the validation split
            record["memory_sweep"], averaged = _memory_sweep(averaged_dir, run_dir, valid, tokens, settings)
            record["test_ppl_recipe"], record["test_ppl"] = info["ppl"], record["memory_sweep"]["test_ppl"]
        runs.log(f"{position}: test ppl {info['ppl']:.2f} (mean of the last {settings.average_last} checkpoints)"
                 + (f", {last_ppl:.2f} (last checkpoint)" if last_ppl else "")
                 + f"; {info['tokens']:,} words in {info['seconds']:.0f} s")
        records[name], losses[name] = record, averaged
        import keras

        keras.backend.clear_session()
    stats = runs.paired_bootstrap(losses["xl"], losses["vanilla"], block=settings.bootstrap_block)
    return {
        "quick": quick,
        "machine": runs.machine(),
        "setup": {"gin_file": "gin/ptb_cpu.gin", "train_steps": records["xl"]["steps"],
                  "average_last": settings.average_last, "test_words": int(tokens.size - 1)},
        "runs": records,
        "comparison": {"a": ["xl", "averaged"], "b": ["vanilla", "averaged"],
                       **{k: v / LN2 for k, v in stats.items()}},
    }
