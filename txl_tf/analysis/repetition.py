"""How much a long context can pay on a corpus, measured without training anything: how often strings recur
within a window, and the bits a cheap long-range model saves over a short-range one.

    python -m txl_tf.analysis.repetition --data_dir=data/enwik8_sample,data/OTHER \
        [--split=train] [--windows=256,1024,8192,65536] [--max_tokens=6000000] [--json=corpora.json]

Both measurements read the first --max_tokens tokens of a split of each prepared data folder (one table row per
folder); at char level a token is a byte of the corpus (as the model sees it: enwik8_sample's newlines dropped).

1. **Recurrence.** At --positions random positions p (seeded; drawn from [max W, n - length) so every window is
   full), whether the --length tokens starting at p occurred before, wholly inside the previous W tokens: an earlier
   copy starting at q with p - W <= q and q + length <= p.
2. **Bits saved by a match model.** The short-range model is an interpolated order-k context model (Witten-Bell:
   P_k(x | c) = (n(c, x) + u(c) P_{k-1}(x)) / (n(c) + u(c)), u(c) the number of distinct tokens seen after c,
   down to a uniform order -1; every count covers all the tokens read so far, so it is adaptive and needs no
   training). The long-range model adds a match model: where the last --min_match tokens (or 2x, 4x as many,
   the longest that does) occurred within the previous W tokens, it predicts the token that followed their most
   recent occurrence there. The two are mixed by an adaptive table (an SSE): in the context (match length, order-k
   probability of the predicted token), the predicted token gets q = (hits + 2 p) / (tries + 2) from the counts
   of that context so far, and every other token its order-k probability scaled by (1 - q) / (1 - p). Both models
   score every token (bits per token: bits per character at char level); the saving is the short-range model's
   bits minus the mixture's. The order-k model's statistics are unbounded, as a trained model's weights are; only
   the match model's reach (the "context") depends on W.

Counts "so far" are computed for all positions at once by stable sorting (a running count within each group), so
~6M tokens take about a minute per corpus on one core. `--json=PATH` writes every figure.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Sequence

import numpy as np
from absl import flags

from txl_tf.base import cli, paths
from txl_tf.base.errors import ConfigError, UserError

WINDOWS = (256, 1024, 8192, 65536)
LENGTH = 20
POSITIONS = 20_000
MAX_TOKENS = 6_000_000
ORDER = 3
MIN_MATCH = 8
MAX_MATCH = 64  # match lengths are counted up to this
LENGTH_EDGES = (12, 16, 24, 32, 48, 64)  # SSE buckets of the match length (below the first: min_match..11)
PROBABILITY_BINS = 16  # SSE buckets of the order-k probability (its stretch ln(p / (1 - p)) in [-8, 8])
PRIOR = 2.0  # pseudo-count of the order-k probability in the SSE
_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


# ---- running counts -------------------------------------------------------------------------------------
def _groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, sorted keys, start) with `order` a stable argsort of `keys` and start[j] the first index in sorted
    order of the group of sorted element j."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    new = np.ones(keys.size, bool)
    new[1:] = ordered[1:] != ordered[:-1]
    start = np.maximum.accumulate(np.where(new, np.arange(keys.size), 0))
    return order, ordered, start


def prior_counts(keys: np.ndarray) -> np.ndarray:
    """counts[i] = how many j < i have keys[j] == keys[i]."""
    order, _, start = _groups(keys)
    counts = np.empty(keys.size, np.int64)
    counts[order] = np.arange(keys.size) - start
    return counts


def prior_sums(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """sums[i] = the sum of values[j] over j < i with keys[j] == keys[i]."""
    order, _, start = _groups(keys)
    ordered = values[order].astype(np.int64)
    inclusive = np.cumsum(ordered)
    before_group = inclusive[start] - ordered[start]
    sums = np.empty(keys.size, np.int64)
    sums[order] = inclusive - ordered - before_group
    return sums


def previous_occurrence(keys: np.ndarray) -> np.ndarray:
    """prev[i] = the largest j < i with keys[j] == keys[i], or -1."""
    order, ordered, _ = _groups(keys)
    prev = np.full(keys.size, -1, np.int64)
    same = ordered[1:] == ordered[:-1]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def hash_before(tokens: np.ndarray, m: int) -> np.ndarray:
    """h[i] = a 64-bit hash of tokens[i - m:i] for i >= m (h[i] for i < m is arbitrary; callers mask it)."""
    n = tokens.size
    h = np.zeros(n + 1, np.uint64)
    if n < m:
        return h[:n]
    values = tokens.astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        acc = np.zeros(n - m + 1, np.uint64)
        for t in range(m):
            acc = acc * _HASH_MULTIPLIER + values[t:n - m + 1 + t]
            acc ^= acc >> np.uint64(29)
    h[m:] = acc
    return h[:n]


# ---- 1. recurrence --------------------------------------------------------------------------------------
def recurrence(tokens: np.ndarray, windows: Sequence[int], length: int = LENGTH, positions: int = POSITIONS,
               seed: int = 0) -> dict:
    """For each window W, the fraction of `positions` random positions p whose `length` tokens have an earlier copy
    wholly inside the previous W tokens; also the sampled distances' quartiles (copies found within max W)."""
    n = tokens.size
    widest = max(windows)
    if n - length <= widest:
        raise UserError(f"{n:,} tokens are too few to sample positions with a full window of {widest:,} (needs "
                        f"more than {widest + length:,}); give a longer split or smaller --windows")
    starts_hash = hash_before(tokens, length)[length:]  # hash of tokens[p:p + length], p in [0, n - length)
    prev = previous_occurrence(starts_hash)
    p = np.random.default_rng(seed).integers(widest, n - length, size=positions)
    q = prev[p]
    for _ in range(length):  # skip copies overlapping the string itself (q > p - length)
        overlap = (q >= 0) & (p - q < length)
        if not overlap.any():
            break
        q[overlap] = prev[q[overlap]]
    found = q >= 0
    offsets = np.arange(length)
    same = np.all(tokens[p[found, None] + offsets] == tokens[q[found, None] + offsets], axis=1)
    found[np.flatnonzero(found)[~same]] = False  # a hash collision: no copy
    distance = np.where(found, p - q, np.iinfo(np.int64).max)
    fractions = {int(w): float(np.mean(distance <= w)) for w in windows}
    near = distance[distance <= widest]
    quartiles = [int(v) for v in np.percentile(near, [25, 50, 75], method="lower")] if near.size else []
    return {"fraction": fractions, "distance_quartiles": quartiles}


# ---- 2. order-k context model ---------------------------------------------------------------------------
class ContextModel:
    """The interpolated (Witten-Bell) order-k model's probability of every token given all that came before, and
    of any other token at chosen positions (`probability_of`)."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, order: int):
        self.n = tokens.size
        self.vocab = int(vocab_size)
        radix = np.int64(self.vocab + 1)
        padded = np.concatenate([np.full(order, self.vocab, np.int64), tokens.astype(np.int64)])
        self.levels = []
        context = np.zeros(self.n, np.int64)
        p = np.full(self.n, 1.0 / self.vocab)
        for k in range(order + 1):
            if k:
                raw = context * radix + padded[order - k:order - k + self.n]
                context = np.unique(raw, return_inverse=True)[1].reshape(-1).astype(np.int64)
            pairs = context * radix + tokens
            order_, ordered, start = _groups(pairs)
            seen = np.empty(self.n, np.int64)
            seen[order_] = np.arange(self.n) - start  # n(c, x) so far
            total = prior_counts(context)  # n(c) so far
            distinct = prior_sums(context, seen == 0)  # u(c) so far
            p = np.where(total > 0, (seen + distinct * p) / np.maximum(total + distinct, 1), p)
            group = np.cumsum(np.r_[True, ordered[1:] != ordered[:-1]]) - 1
            self.levels.append({"context": context.astype(np.int32), "total": total.astype(np.int32),
                                "distinct": distinct.astype(np.int32), "ordered": ordered,
                                "key": group * np.int64(self.n + 1) + order_})
        self.p = p

    def probability_of(self, positions: np.ndarray, symbols: np.ndarray) -> np.ndarray:
        """P_k(symbols[j] | the tokens before positions[j]) from the counts of the tokens before positions[j]."""
        radix = np.int64(self.vocab + 1)
        p = np.full(positions.size, 1.0 / self.vocab)
        for level in self.levels:
            ordered, key = level["ordered"], level["key"]
            raw = level["context"][positions].astype(np.int64) * radix + symbols
            first = np.searchsorted(ordered, raw)
            exists = first < ordered.size
            exists[exists] = ordered[first[exists]] == raw[exists]
            seen = np.zeros(positions.size, np.int64)
            hit = np.flatnonzero(exists)
            group_key = (key[first[hit]] // np.int64(self.n + 1)) * np.int64(self.n + 1)
            seen[hit] = np.searchsorted(key, group_key + positions[hit]) - first[hit]
            total, distinct = level["total"][positions], level["distinct"][positions]
            p = np.where(total > 0, (seen + distinct * p) / np.maximum(total + distinct, 1), p)
        return p


# ---- 2. match model within a window ---------------------------------------------------------------------
def match_candidates(tokens: np.ndarray, min_match: int) -> list[tuple[int, np.ndarray]]:
    """[(m, prev)] for m = min_match, 2 min_match, 4 min_match: prev[i] = the most recent j < i whose m preceding
    tokens hash like the m tokens before i (-1 if none)."""
    out = []
    for m in (min_match, 2 * min_match, 4 * min_match):
        h = hash_before(tokens, m)
        prev = previous_occurrence(h)
        prev[:m] = -1
        prev[prev < m] = -1
        out.append((m, prev))
    return out


def match_lengths(tokens: np.ndarray, positions: np.ndarray, sources: np.ndarray, cap: int = MAX_MATCH) -> np.ndarray:
    """How many tokens before positions[j] equal those before sources[j] (counted backwards, at most `cap`)."""
    length = np.zeros(positions.size, np.int64)
    alive = np.ones(positions.size, bool)
    for t in range(1, cap + 1):
        ok = alive & (sources - t >= 0)
        idx = np.flatnonzero(ok)
        same = tokens[positions[idx] - t] == tokens[sources[idx] - t]
        alive[:] = False
        alive[idx[same]] = True
        length += alive
        if not alive.any():
            break
    return length


def _stretch_bin(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1.0 - 1e-12)
    stretch = np.log(p) - np.log1p(-p)
    edges = np.linspace(-8.0, 8.0, PROBABILITY_BINS + 1)[1:-1]
    return np.digitize(stretch, edges)


def match_mixture(tokens: np.ndarray, model: ContextModel, candidates: list, window: int, min_match: int) -> dict:
    """Bits per token of the order-k model mixed with the match model reaching `window` tokens back."""
    n = tokens.size
    index = np.arange(n)
    source = np.full(n, -1, np.int64)
    for _, prev in candidates:  # ascending m: a longer match found within the window wins
        ok = (prev >= 0) & (index - prev <= window)
        source[ok] = prev[ok]
    positions = np.flatnonzero(source >= 0)
    lengths = match_lengths(tokens, positions, source[positions])
    valid = lengths >= min_match  # a hash collision otherwise
    positions, lengths = positions[valid], lengths[valid]
    predicted = tokens[source[positions]]
    hit = tokens[positions] == predicted
    p_pred = model.probability_of(positions, predicted)
    context = np.digitize(lengths, LENGTH_EDGES) * PROBABILITY_BINS + _stretch_bin(p_pred)
    tries = prior_counts(context)
    hits = prior_sums(context, hit)
    q = np.minimum((hits + PRIOR * p_pred) / (tries + PRIOR), 1.0 - 1e-12)  # a miss is never impossible
    p_actual = model.p[positions]
    # 1 - p_pred >= p_actual for a token other than the predicted one (rounding may make p_pred 1.0)
    mixed = np.where(hit, q, (1.0 - q) * p_actual / np.maximum(1.0 - p_pred, p_actual))
    bits = -np.log2(model.p)
    bits[positions] = -np.log2(mixed)
    return {"bits_per_token": float(bits.mean()), "matched": float(positions.size / n),
            "match_right": float(hit.mean()) if hit.size else 0.0}


def measure_bits(tokens: np.ndarray, vocab_size: int, windows: Sequence[int], order: int = ORDER,
                 min_match: int = MIN_MATCH) -> dict:
    """The order-k model's bits per token and, for each window, the mixture's and the saving."""
    model = ContextModel(tokens, vocab_size, order)
    base = float(-np.log2(model.p).mean())
    candidates = match_candidates(tokens, min_match)
    per_window = {}
    for window in windows:
        result = match_mixture(tokens, model, candidates, int(window), min_match)
        result["saving"] = base - result["bits_per_token"]
        per_window[int(window)] = result
    return {"order": order, "min_match": min_match, "short_range_bits": base, "windows": per_window}


# ---- a corpus -------------------------------------------------------------------------------------------
def measure_tokens(tokens: np.ndarray, vocab_size: int, *, windows: Sequence[int] = WINDOWS, length: int = LENGTH,
                   positions: int = POSITIONS, seed: int = 0, order: int = ORDER, min_match: int = MIN_MATCH) -> dict:
    """Both measurements on one token sequence (ids in [0, vocab_size))."""
    tokens = np.asarray(tokens).astype(np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise UserError(f"token ids must lie in [0, {vocab_size}); got {tokens.min()}..{tokens.max()}")
    return {"tokens": int(tokens.size), "vocab_size": int(vocab_size),
            "recurrence": {"length": length, "positions": positions, "seed": seed,
                           **recurrence(tokens, windows, length, positions, seed)},
            "bits": measure_bits(tokens, vocab_size, windows, order, min_match)}


def measure_corpus(data_dir: str, split: str, max_tokens: int, **options) -> dict:
    """Both measurements on the first `max_tokens` tokens of a prepared split."""
    from txl_tf.data import pipeline

    meta = pipeline.load_metadata(data_dir)
    if split not in meta["token_counts"]:
        raise ConfigError(f"{data_dir} has no {split!r} split (it has {', '.join(sorted(meta['token_counts']))})")
    tokens = pipeline.read_split(data_dir, split)[:max_tokens]
    result = measure_tokens(tokens, meta["vocab_size"], **options)
    return {"data_dir": data_dir, "dataset": meta["dataset"], "level": meta["level"], "split": split,
            "split_tokens": int(meta["token_counts"][split]), **result}


def _window(w: int) -> str:
    return f"{w:,}"


def format_tables(results: Sequence[dict]) -> str:
    """Two markdown tables: recurrence within each window, and bits per token with the match model's saving."""
    windows = sorted(int(w) for w in results[0]["recurrence"]["fraction"])  # int keys, or strings from JSON
    first = results[0]
    lines = [f"Recurrence: a {first['recurrence']['length']}-token string whose earlier copy lies within the previous "
             f"W tokens, at {first['recurrence']['positions']:,} random positions (seed {first['recurrence']['seed']})",
             "",
             "| corpus | tokens read | " + " | ".join(f"W = {_window(w)}" for w in windows) + " | median distance |",
             "|---" * (len(windows) + 3) + "|"]
    for r in results:
        quartiles = r["recurrence"]["distance_quartiles"]
        median = _window(quartiles[1]) if quartiles else "-"
        fraction = {int(w): v for w, v in r["recurrence"]["fraction"].items()}
        cells = " | ".join(f"{100 * fraction[w]:.1f}%" for w in windows)
        lines.append(f"| {_name(r)} | {r['tokens']:,} | {cells} | {median} |")
    bits = first["bits"]
    lines += ["", f"Bits per token: an order-{bits['order']} context model alone, and mixed with a match model "
              f"(>= {bits['min_match']} tokens) that reaches W tokens back; saving = order-{bits['order']} minus "
              "mixture", "",
              f"| corpus | order-{bits['order']} | " + " | ".join(f"W = {_window(w)}" for w in windows)
              + " | " + " | ".join(f"saving @ {_window(w)}" for w in windows) + " |",
              "|---" * (2 * len(windows) + 2) + "|"]
    for r in results:
        per = {int(w): v for w, v in r["bits"]["windows"].items()}
        cells = " | ".join(f"{per[w]['bits_per_token']:.3f}" for w in windows)
        savings = " | ".join(f"{per[w]['saving']:.3f}" for w in windows)
        lines.append(f"| {_name(r)} | {r['bits']['short_range_bits']:.3f} | {cells} | {savings} |")
    return "\n".join(lines)


def _name(result: dict) -> str:
    base = os.path.basename(os.path.normpath(result["data_dir"]))
    return result["dataset"] if base == result["dataset"] else f"{result['dataset']} ({base})"


def _cpu() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else the machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        text = ""
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    return (names[0] if names else platform.machine())[:200]


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ConfigError(f"--{name} must be at least 1, got {value}")
    return value


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_string("data_dir", None, "A prepared data folder, or several separated by commas (one table row "
                        "each).", flag_values=fv)
    flags.DEFINE_string("split", "train", "Which split to read.", flag_values=fv)
    flags.DEFINE_list("windows", [str(w) for w in WINDOWS], "Window sizes W (tokens).", flag_values=fv)
    flags.DEFINE_integer("length", LENGTH, "Length of the strings whose recurrence is counted.", flag_values=fv)
    flags.DEFINE_integer("positions", POSITIONS, "Random positions sampled for the recurrence.", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Seed of the sampled positions.", flag_values=fv)
    flags.DEFINE_integer("max_tokens", MAX_TOKENS, "Read the first this many tokens of the split.", flag_values=fv)
    flags.DEFINE_integer("order", ORDER, "Order k of the short-range context model.", flag_values=fv)
    flags.DEFINE_integer("min_match", MIN_MATCH, "Shortest context the match model matches.", flag_values=fv)
    flags.DEFINE_string("json", None, "Also write every figure to this JSON file.", flag_values=fv)
    flags.mark_flag_as_required("data_dir", flag_values=fv)


def main(argv):
    cli.no_arguments(argv)
    cfg = flags.FLAGS
    try:
        windows = sorted({int(w) for w in cfg.windows})
    except ValueError:
        raise ConfigError(f"--windows must be integers, got {','.join(cfg.windows)}") from None
    if not windows or windows[0] < 1:
        raise ConfigError(f"--windows must be positive integers, got {','.join(cfg.windows)}")
    for name in ("length", "positions", "max_tokens", "min_match"):
        _positive(name, getattr(cfg, name))
    if cfg.order < 0:
        raise ConfigError(f"--order must be at least 0, got {cfg.order}")
    json_path = paths.output_file(cfg.json, "--json", "repetition.json") if cfg.json else None
    options = {"windows": windows, "length": cfg.length, "positions": cfg.positions, "seed": cfg.seed,
               "order": cfg.order, "min_match": cfg.min_match}
    results = []
    data_dirs = [d for d in cfg.data_dir.split(",") if d]
    if not data_dirs:
        raise ConfigError(f"--data_dir names no folder: {cfg.data_dir!r}")
    for data_dir in data_dirs:
        results.append(measure_corpus(data_dir, cfg.split, cfg.max_tokens, **options))
        print(f"measured {data_dir}: {results[-1]['tokens']:,} tokens of {cfg.split}", flush=True)
    print()
    print(format_tables(results))
    if json_path:
        report = {"command": "python -m txl_tf.analysis.repetition", "split": cfg.split,
                  "max_tokens": cfg.max_tokens, "date": datetime.date.today().isoformat(),
                  "cpu": _cpu(), "corpora": results}
        with paths.atomic_file(json_path) as f:
            json.dump(report, f, indent=1, allow_nan=False)
            f.write("\n")
        print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    cli.run(main, define_flags)
