"""Relative Effective Context Length (RECL; Dai et al., 2019, section 4.3 and appendix C).

RECL is defined on a *group* of models scored on the same tokens at several context lengths. With
`l_i(c, t)` the loss of model i on token t given c tokens of context:

    b(c, t)     = min_i l_i(c, t)                               the group's best short-context loss
    T(c)        = the top-r fraction of positions t with the largest b(c, t)   (the "hard" tokens)
    f_i(c, c')  = mean_{t in T(c)} min(b(c, t), l_i(c', t))     only improvements over b count
    g_i(c, c')  = (exp f_i(c, c) - exp f_i(c, c')) / exp f_i(c, c)     relative perplexity gain

Starting from the shortest context c and c' = c + step, while g_i(c, c') >= threshold (0.01) the search moves
on to (c', c' + step); the first pair whose gain falls below the threshold gives RECL_i = c. Note that
`f_i(c, c) = mean_T b(c, t)` is the same for every model: all of them must improve on one shared baseline.

The paper reports r = 0.1, 0.5 and 1.0 (Table 6) on a grid of context lengths spaced 100 tokens apart. Per-token
losses in corpus order come from `python -m txl_tf.evaluate --token_losses=FILE` run once per context length.

    python -m txl_tf.analysis.recl --contexts=100,200,300,400 \
        --model='xl=runs/xl/nll_c{c}.npy' --model='vanilla=runs/vanilla/nll_c{c}.npy'
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
from absl import flags

from txl_tf.base import cli
from txl_tf.base.errors import ConfigError

PAPER_RATIOS = (0.1, 0.5, 1.0)
PAPER_STEP = 100
GAIN_THRESHOLD = 0.01


@dataclasses.dataclass
class ReclResult:
    """RECL of every model of a group for one ratio `r`.

    Attributes:
      recl: [N] the RECL of each model (a context length from `contexts`).
      gains: [N, C - 1] g_i(contexts[k], contexts[k + 1]) for every consecutive pair.
      truncated: [N] True where the gain never fell below the threshold, so RECL is only a lower bound
        (the longest context evaluated).
    """

    r: float
    contexts: tuple
    recl: list
    gains: np.ndarray
    truncated: list


def load_token_losses(path: str) -> np.ndarray:
    """Reads per-token losses written by `txl_tf.evaluate --token_losses`: `.npy`, or text (one per line)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"token-loss file {path} does not exist; write it with "
                                "`python -m txl_tf.evaluate ... --token_losses={path}`")
    if path.endswith(".npy"):
        losses = np.load(path, allow_pickle=False)
    else:
        losses = np.loadtxt(path, dtype=np.float64, ndmin=1)
    losses = np.asarray(losses, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(losses)):
        raise ValueError(f"token-loss file {path} contains non-finite values")
    return losses


def _top_r_positions(baseline: np.ndarray, r: float) -> np.ndarray:
    """Indices of the ceil(r * T) positions with the largest baseline loss."""
    count = max(1, math.ceil(r * baseline.shape[0] - 1e-9))
    if count >= baseline.shape[0]:
        return np.arange(baseline.shape[0])
    return np.argpartition(-baseline, count - 1)[:count]


def relative_gains(losses: np.ndarray, r: float) -> np.ndarray:
    """g_i(c_k, c_{k+1}) for each model i and each consecutive pair of context lengths.

    Args:
      losses: [N, C, T] per-token losses of N models at C context lengths (ascending) on the same T tokens.
      r: fraction of hardest positions (by the group baseline at the shorter context) that are compared.

    Returns:
      [N, C - 1] relative perplexity gains.
    """
    losses = np.asarray(losses, dtype=np.float64)
    if losses.ndim != 3:
        raise ValueError(f"losses must be [models, contexts, tokens]; got shape {losses.shape}")
    if not 0.0 < r <= 1.0:
        raise ValueError(f"r must be in (0, 1]; got {r}")
    n_models, n_contexts, _ = losses.shape
    gains = np.zeros([n_models, n_contexts - 1])
    for k in range(n_contexts - 1):
        baseline = losses[:, k, :].min(axis=0)  # [T] b(c, t)
        positions = _top_r_positions(baseline, r)
        f_short = baseline[positions].mean()  # f_i(c, c), identical for every model
        f_long = np.minimum(baseline[positions], losses[:, k + 1, positions]).mean(axis=1)  # [N] f_i(c, c')
        gains[:, k] = (math.exp(f_short) - np.exp(f_long)) / math.exp(f_short)
    return gains


def compute_recl(losses: np.ndarray, contexts: Sequence[int], r: float = 0.1,
                 threshold: float = GAIN_THRESHOLD) -> ReclResult:
    """RECL of each model of a group (appendix C's thresholding algorithm).

    Args:
      losses: [N, C, T] per-token losses, `losses[i, k]` scored with context length `contexts[k]`.
      contexts: C ascending context lengths, normally evenly spaced by the step size.
      r: ratio of hardest positions compared (paper: 0.1, 0.5, 1.0).
      threshold: relative gain below which a longer context no longer counts (paper: 0.01).
    """
    contexts = tuple(int(c) for c in contexts)
    losses = np.asarray(losses, dtype=np.float64)
    if len(contexts) < 2:
        raise ValueError("RECL needs losses at two or more context lengths")
    if losses.ndim != 3 or losses.shape[1] != len(contexts):
        raise ValueError(f"losses must be [models, {len(contexts)} contexts, tokens]; got {losses.shape}")
    if any(b <= a for a, b in pairwise(contexts)):
        raise ValueError(f"context lengths must be strictly ascending; got {contexts}")
    gains = relative_gains(losses, r)
    recls, truncated = [], []
    for model_gains in gains:
        below = np.flatnonzero(model_gains < threshold)
        if below.size:
            recls.append(contexts[below[0]])
            truncated.append(False)
        else:  # still improving at the longest pair: the longest context is a lower bound
            recls.append(contexts[-1])
            truncated.append(True)
    return ReclResult(r=r, contexts=contexts, recl=recls, gains=gains, truncated=truncated)


def bootstrap_recl(losses: np.ndarray, contexts: Sequence[int], r: float = 0.1, threshold: float = GAIN_THRESHOLD,
                   *, samples: int = 200, block: int = 100, seed: int = 0) -> dict:
    """How firmly the data fix each model's RECL: RECL recomputed on block-bootstrap resamples of the tokens.

    The per-token `min(b, l)` of the gain credits a model for every token where it happens to dip below the
    group's baseline, so a noisy model can cross the threshold by chance, and a group whose models all stop at the
    first pair ties by construction. Resampling blocks of `block` consecutive tokens (neighbours' losses are
    correlated) and recomputing RECL says how often each ordering holds.

    Returns:
      {"low": [N], "high": [N]} the 2.5 / 97.5 percentiles of each model's RECL and "longest": [N] the fraction
      of resamples in which the model's RECL is strictly longer than every other's.
    """
    losses = np.asarray(losses, dtype=np.float64)
    usable = (losses.shape[2] // block) * block
    if usable == 0:
        raise ValueError(f"{losses.shape[2]} tokens are fewer than one block of {block}")
    blocks = losses[:, :, :usable].reshape(losses.shape[0], losses.shape[1], -1, block)
    rng = np.random.default_rng(seed)
    drawn = []
    for _ in range(samples):
        picked = blocks[:, :, rng.integers(0, blocks.shape[2], size=blocks.shape[2])]
        drawn.append(compute_recl(picked.reshape(losses.shape[0], losses.shape[1], -1), contexts, r=r,
                                  threshold=threshold).recl)
    drawn = np.array(drawn)  # [samples, N]
    others = np.stack([np.delete(drawn, i, axis=1).max(axis=1) for i in range(drawn.shape[1])], axis=1)
    return {"low": np.percentile(drawn, 2.5, axis=0, method="lower").astype(int).tolist(),
            "high": np.percentile(drawn, 97.5, axis=0, method="higher").astype(int).tolist(),
            "longest": (drawn > others).mean(axis=0).tolist()}


def load_group(patterns: dict, contexts: Sequence[int]) -> np.ndarray:
    """Loads {model name: file pattern with `{c}`} at every context length into [N, C, T]."""
    rows = []
    for name, pattern in patterns.items():
        if "{c}" not in pattern:
            raise ValueError(f"the file pattern of model {name!r} ({pattern}) must contain '{{c}}', "
                             "which is replaced by each context length")
        per_context = [load_token_losses(pattern.format(c=c)) for c in contexts]
        rows.append(per_context)
    lengths = {arr.shape[0] for row in rows for arr in row}
    if len(lengths) != 1:
        detail = ", ".join(f"{name}@{c}: {arr.shape[0]}" for name, row in zip(patterns, rows, strict=True)
                           for c, arr in zip(contexts, row, strict=True))
        raise ValueError("every token-loss file must score the same tokens; lengths differ: " + detail)
    return np.stack([np.stack(row) for row in rows])


def format_table(names: Sequence[str], results: Sequence[ReclResult]) -> str:
    """A Table-6 style text table: one row per model, one column per r ('>=' marks lower bounds)."""
    header = f"{'model':<24}" + "".join(f"{'r = ' + str(res.r):>12}" for res in results)
    lines = [header, "-" * len(header)]
    for i, name in enumerate(names):
        cells = "".join(f"{('>=' if res.truncated[i] else '') + str(res.recl[i]):>12}" for res in results)
        lines.append(f"{name:<24}{cells}")
    return "\n".join(lines)


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_multi_string("model", None, "NAME=PATTERN; PATTERN is a token-loss file path with {c} for "
                              "the context length (.npy or text, one loss per line, corpus order).", flag_values=fv)
    flags.DEFINE_list("contexts", [], "Context lengths (ascending); default: range(start, stop + 1, step).",
                      flag_values=fv)
    flags.DEFINE_integer("start", PAPER_STEP, "Shortest context length when --contexts is not given.",
                         flag_values=fv)
    flags.DEFINE_integer("stop", 1000, "Longest context length when --contexts is not given.", flag_values=fv)
    flags.DEFINE_integer("step", PAPER_STEP, "Step between context lengths (the paper's Delta).", flag_values=fv)
    flags.DEFINE_list("r", [str(r) for r in PAPER_RATIOS], "Ratios of hardest tokens compared.", flag_values=fv)
    flags.DEFINE_float("threshold", GAIN_THRESHOLD, "Relative gain below which the search stops.", flag_values=fv)
    flags.mark_flag_as_required("model", flag_values=fv)


def main(argv):
    cli.no_arguments(argv)
    cfg = flags.FLAGS
    if cfg.contexts:
        contexts = [int(c) for c in cfg.contexts]
    else:
        contexts = list(range(cfg.start, cfg.stop + 1, cfg.step))
    patterns = {}
    for spec in cfg.model:
        name, sep, pattern = spec.partition("=")
        if not sep or not name or not pattern:
            raise ConfigError(f"--model must be NAME=PATTERN (PATTERN with {{c}}); got {spec!r}")
        patterns[name] = pattern
    losses = load_group(patterns, contexts)
    print(f"{losses.shape[0]} models, context lengths {contexts}, {losses.shape[2]} tokens each")
    results = [compute_recl(losses, contexts, r=float(r), threshold=cfg.threshold) for r in cfg.r]
    for res in results:
        print(f"\nrelative gains g(c, c + step) for r = {res.r}:")
        print(f"{'model':<24}" + "".join(f"{f'{a}->{b}':>12}" for a, b in pairwise(contexts)))
        for name, row in zip(patterns, res.gains, strict=True):
            print(f"{name:<24}" + "".join(f"{g:>12.4f}" for g in row))
    print("\nRECL:")
    print(format_table(list(patterns), results))


if __name__ == "__main__":
    cli.run(main, define_flags)
