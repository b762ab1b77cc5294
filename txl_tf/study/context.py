"""Study `context`: the paper's title claim measured the way the paper measures it (Tables 5 and 6, appendix C),
and the encodings that came after it on the same protocol.

Six models at the size of the `make run` model (gin/study/context_<name>.gin), trained with a memory of 128 and
128-token segments (training span 256), with parameter counts within 5%:

    xl             Transformer-XL: relative encoding + recurrence (checkpoints at 1/3 and 2/3 scored too)
    shaw           Shaw et al. (2018) learned relative encoding + recurrence
    no_recurrence  Transformer-XL trained without memory (256-token segments), scored with a memory
    al_rfou        the vanilla model of Al-Rfou et al. (2018): learned absolute positions, a 256-token window
    rope           RoPE (Su et al., 2021) + recurrence: queries and keys rotated by their positions in the window
    alibi          ALiBi (Press et al., 2022) + recurrence: a per-head penalty linear in the distance

on each corpus of CORPORA: `enwik8_sample` (studies `context`, `context_<model>`; results.json section `context`)
and `networkx_code`, Python source where strings recur thousands of characters apart (`context_code`,
`context_code_<model>`; section `context_code`).

The length axis is the paper's attention length at evaluation: the memory (64 ... 1,024: half the training memory
to 8x it), "init" being the training memory (128), with one segment length (128) and same_length for every
memory, relative distances unclamped and clamped at the training span side by side for the encodings where
clamp_len means something (Transformer-XL's sinusoids, ALiBi's penalty, RoPE's rotations, which beyond the clamp
score every key at the clamp's rotation). The vanilla model's axis is its window,
min(memory, 256): like the paper's Transformer row it cannot look further than it was trained to.

Scoring: the whole split in 10 streams through the cached state, every stream's first n_layer x 1,024 predictions
dropped (txl_tf.study.scoring), so every cell scores the same tokens with a full context. Each model's best
(memory, clamp) is chosen on the validation split and then reported on the test split; intervals are paired block
bootstraps (runs.paired_bootstrap). The vanilla model is scored on a fixed subset of blocks of those tokens (one
forward pass per token) and compared with the others on that subset.

Also: RECL (appendix C) at the memories as contexts, of the paper's four-model group (on the vanilla subset, the
vanilla model at its window up to 256) and of the five recurrent models (on the same subset: RECL takes per-token
minima across models, and the subset's per-token losses are what a model's archive keeps), each model scored at
exactly c, and the copy probe (txl_tf.study.probe) per model and memory. Each model is its own study
(`context_xl`, `context_code_rope`, ...) so that each fits well under an hour; a scored model is archived
(txl_tf.study.archive: 1-2 MB, committed under studies/archive), and every study re-assembles its corpus' section
from the archived models and the finished runs there are (`txl_tf.study.context_results.run`, which computes the
section of results.json from what this module trains and scores).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from txl_tf.model.protocol import Protocol
from txl_tf.study import ablation, runs, sanity, scoring
from txl_tf.study import probe as probe_lib

UNCLAMPED = -1


@dataclasses.dataclass(frozen=True)
class Model:
    """One model of the study.

    Attributes:
      name, label: the run's name (gin/study/context_NAME.gin) and the report's.
      vanilla: a sliding-window model without memory (scored one forward pass per token).
      clamped: clamp_len changes its scores (else the clamped cells would repeat the unclamped ones).
      recurrent: trains with a memory (the quick study's sizes follow).
      quick_params: gin bindings of the quick study that keep its parameter count near Transformer-XL's.
    """

    name: str
    label: str
    vanilla: bool = False
    clamped: bool = True
    recurrent: bool = True
    quick_params: tuple = ()


# The encodings without position weights get the quick model's 2 x 32 x 32 weights of W_R back in the feed-forward.
_NO_POSITION_WEIGHTS = ("ModelConfig.d_inner = 80",)
MODELS = (
    Model("xl", "Transformer-XL (ours + recurrence)"),
    Model("shaw", "Shaw et al. encoding + recurrence", clamped=False),
    Model("no_recurrence", "w/o recurrence", recurrent=False),
    Model("al_rfou", "Al-Rfou et al. vanilla (sliding window)", vanilla=True, clamped=False, recurrent=False),
    Model("rope", "RoPE + recurrence", quick_params=_NO_POSITION_WEIGHTS),
    Model("alibi", "ALiBi + recurrence", quick_params=_NO_POSITION_WEIGHTS),
)
BASELINE = "xl"
PARAMETER_TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A corpus of the study: `key` names its results.json section, its studies (KEY, KEY_<model>) and runs."""

    key: str
    dataset: str
    title: str


CORPORA = (
    Corpus("context", "enwik8_sample", "Wikipedia XML (`enwik8_sample`)"),
    Corpus("context_code", "networkx_code", "Python source (`networkx_code`)"),
)


def studies() -> dict:
    """{study name: (corpus, model names or None for all)}: `context`, `context_xl`, `context_code_rope`, ..."""
    out = {}
    for corpus in CORPORA:
        out[corpus.key] = (corpus, None)
        out.update({f"{corpus.key}_{m.name}": (corpus, (m.name,)) for m in MODELS})
    return out


@dataclasses.dataclass(frozen=True)
class ContextSettings:
    """The study's axes and sizes; `quick` shrinks everything so the pipeline runs in the test suite."""

    memories: tuple = (64, 128, 192, 256, 384, 512, 768, 1024)
    train_memory: int = 128
    train_span: int = 256
    recl_contexts: tuple = (64, 128, 192, 256, 384, 512, 768, 1024)  # the memories: their scores are shared
    eval_tgt_len: int = 128
    eval_batch: int = 10
    n_layer: int = 4
    block: int = 100
    vanilla_blocks: int = 200  # 20,000 tokens
    vanilla_batch: int = 32
    max_tokens: int = 0  # 0 = the whole split
    checkpoint_fractions: tuple = (3, 3)  # (numerator limit, denominator): checkpoints at 1/3 and 2/3
    seeds: tuple = (1, 2, 3)  # every model, every seed (docs/study_plan.md)
    probe: probe_lib.Probe = probe_lib.Probe()
    train_params: tuple = ()
    recurrent_params: tuple = ()
    nonrecurrent_params: tuple = ()

    @property
    def drop(self) -> int:
        return self.n_layer * max(max(self.memories), max(self.recl_contexts))

    @property
    def clamps(self) -> tuple:
        return (UNCLAMPED, self.train_span)

    def clamp_matters(self, memory: int) -> bool:
        """Whether clamping at the training span changes anything: some distance (up to memory + segment - 1)
        exceeds it."""
        return memory + self.eval_tgt_len - 1 > self.train_span

    def window(self, memory: int) -> int:
        return min(memory, self.train_span)


FULL = ContextSettings()
QUICK = ContextSettings(
    memories=(8, 16, 32, 64), train_memory=16, train_span=32, recl_contexts=tuple(range(8, 65, 8)),
    eval_tgt_len=16, eval_batch=4, n_layer=2, block=20, vanilla_blocks=4, vanilla_batch=16, max_tokens=3001, seeds=(1, 2),
    probe=probe_lib.Probe(distances=(16, 32, 64, 128, 256), span=8, examples=3, lead=80),
    train_params=(*ablation.QUICK.train_params, "TrainConfig.checkpoint_every = 10"),  # the same tiny model
    recurrent_params=ablation.QUICK.recurrent_params, nonrecurrent_params=ablation.QUICK.nonrecurrent_params,
)


def settings_for(quick: bool) -> ContextSettings:
    return QUICK if quick else FULL


def run_spec(model: Model, settings: ContextSettings, data_dir: str, quick: bool, corpus: Corpus = CORPORA[0],
             seed: int = 1) -> runs.RunSpec:
    params = [f"DATA_DIR = '{data_dir}'", *settings.train_params]
    if corpus.dataset != CORPORA[0].dataset:  # the gin files name enwik8_sample
        params.append(f"DataConfig.dataset = '{corpus.dataset}'")
    if quick:
        params += settings.recurrent_params if model.recurrent else settings.nonrecurrent_params
        params += model.quick_params
    if model.vanilla:  # a table of one row fewer than its window (docs/study_plan_v2.md)
        params += ablation.vanilla_params(settings.train_span)
    params += runs.seed_params(seed)
    return runs.RunSpec(name=runs.seed_name(f"{corpus.key}_{model.name}", seed),
                        gin_files=(f"study/context_{model.name}.gin",), gin_params=tuple(params), label=model.label)


@dataclasses.dataclass
class Splits:
    """The scored tokens of the validation and test splits and the raw test split (the probe's text)."""

    valid: scoring.ScoredTokens
    test: scoring.ScoredTokens
    test_tokens: np.ndarray


def splits(data_dir: str, settings: ContextSettings) -> Splits:
    from txl_tf.data import pipeline

    out = {}
    for split in ("valid", "test"):
        tokens = pipeline.read_split(data_dir, split)
        if settings.max_tokens:
            tokens = tokens[:settings.max_tokens]
        out[split] = scoring.ScoredTokens(tokens, settings.eval_batch, settings.drop, settings.block,
                                          settings.vanilla_blocks)
        out[split].check()
    return Splits(out["valid"], out["test"], out["test"].tokens)


class Scorer:
    """Per-token losses of one model (a run's checkpoint), cached under the run's evals/ (runs.cached_eval)."""

    def __init__(self, run_dir: str, model, spec: Model, settings: ContextSettings, prefix: str = ""):
        self.run_dir, self.model, self.settings, self.prefix = run_dir, model, settings, prefix
        # The study's list and the model's encoding must both say clamp_len changes its scores (shaw ignores it,
        # and TransformerXL refuses a clamp it would ignore).
        self.vanilla = spec.vanilla
        self.clamped = spec.clamped and model.encoding.clamps and not spec.vanilla

    def _key(self, split: str, scored: scoring.ScoredTokens, length: int, clamp: int) -> str:
        where = f"b{scored.batch_size}_d{scored.drop}_n{scored.tokens.shape[0]}"
        if self.vanilla:
            return f"{self.prefix}{split}_window{length}_{where}_blocks{scored.subset_blocks}x{scored.block}"
        return f"{self.prefix}{split}_mem{length}_clamp{clamp}_t{self.settings.eval_tgt_len}_{where}"

    def losses(self, split: str, scored: scoring.ScoredTokens, memory: int, clamp: int = UNCLAMPED) -> np.ndarray:
        """Kept losses [count] (recurrent) or [subset] (vanilla, window min(memory, span)) in nats."""
        s = self.settings
        if clamp != UNCLAMPED and not (self.clamped and s.clamp_matters(memory)):
            clamp = UNCLAMPED  # no distance reaches the clamp, or clamp_len does not apply: the same numbers
        length = s.window(memory) if self.vanilla else memory

        def compute():
            if self.vanilla:
                positions = scored.positions()[scored.subset()]
                import time

                start = time.perf_counter()
                losses = scoring.score_windows(self.model, scored.tokens, positions, window=length,
                                               batch_size=s.vanilla_batch)
                seconds = time.perf_counter() - start
                protocol = {"protocol": "vanilla", "window": length}
            else:
                losses, result = scoring.score_recurrent(
                    self.model, scored, tgt_len=s.eval_tgt_len,
                    protocol=Protocol(mem_len=memory, clamp_len=clamp, same_length=True))
                seconds, protocol = result.seconds, result.protocol
            info = {"protocol": protocol, "seconds": round(seconds, 2), "tokens": int(losses.size),
                    "bpc": scoring.bits(losses)}
            runs.log(f"  {os.path.basename(self.run_dir)} {self.prefix}{split} "
                     f"{'window' if self.vanilla else 'memory'} {length}"
                     f"{'' if clamp == UNCLAMPED or self.vanilla else f' clamp {clamp}'}: {info['bpc']:.4f} bpc "
                     f"({info['tokens']:,} tokens, {info['seconds']:.0f} s)")
            return losses, info

        return runs.cached_eval(self.run_dir, self._key(split, scored, length, clamp), compute)[0]

    def probe(self, tokens: np.ndarray, memory: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """([B, P] x 3) losses on the two copies of the probe and on its control at this memory (window for the
        vanilla model)."""
        s, p = self.settings, self.settings.probe
        length = s.window(memory) if self.vanilla else memory
        key = (f"{self.prefix}probe_{'window' if self.vanilla else 'mem'}{length}_d{'-'.join(map(str, p.distances))}"
               f"_s{p.span}_e{p.examples}_l{p.lead}_seed{p.seed}_n{tokens.shape[0]}_controlled")

        def compute():
            if self.vanilla:
                losses = probe_lib.score_vanilla(self.model, p, tokens, window=length, batch_size=s.vanilla_batch)
            else:
                losses = probe_lib.score_recurrent(
                    self.model, p, tokens, tgt_len=s.eval_tgt_len,
                    protocol=Protocol(mem_len=memory, clamp_len=UNCLAMPED, same_length=True))
            stacked = np.stack(losses)
            summary = probe_lib.summarize(*losses, p)
            runs.log(f"  {os.path.basename(self.run_dir)} {self.prefix}probe {'window' if self.vanilla else 'memory'} "
                     f"{length}: second copy minus control, bpc by distance: "
                     + ", ".join(f"{d} {summary[str(d)]['copy']:+.3f}" for d in p.distances))
            return stacked.reshape(-1), {"shape": list(stacked.shape), "bpc_second": scoring.bits(losses[1])}

        flat, info = runs.cached_eval(self.run_dir, key, compute)
        both = flat.reshape(info["shape"])
        return both[0], both[1], both[2]


def _grid(scorer: Scorer, data: Splits, settings: ContextSettings, *, memories=None, clamps=None, recl: bool = True) -> dict:
    """{(split, memory, clamp): losses}: both splits at every memory and clamp, and the RECL contexts on test."""
    memories = memories or settings.memories
    clamps = clamps or (settings.clamps if scorer.clamped else (UNCLAMPED,))
    cells = {}
    for split, scored in (("valid", data.valid), ("test", data.test)):
        for memory in memories:
            for clamp in clamps:
                if clamp != UNCLAMPED and not settings.clamp_matters(memory):
                    continue
                cells[(split, memory, clamp)] = scorer.losses(split, scored, memory, clamp)
    if recl:
        for context in settings.recl_contexts:
            cells[("test", context, UNCLAMPED)] = scorer.losses("test", data.test, context)
    return cells


def _check_clamped_cells(model: Model, cells: dict, settings: ContextSettings, paths: tuple) -> None:
    """A StudyError naming the archive when it lacks a clamped cell that `_grid` scores for `model` (an archive of
    an encoding scored before it clamped: rope before its clamp_len)."""
    if not model.clamped:
        return
    missing = [f"{split}/{memory}/{settings.train_span}" for split in ("valid", "test") for memory in settings.memories
               if settings.clamp_matters(memory) and (split, memory, settings.train_span) not in cells]
    if missing:
        raise runs.StudyError(f"{paths[0]} has no clamped cells ({', '.join(missing[:3])}, ...), which the study "
                              f"scores for {model.name}; remove {paths[0]} and {paths[1]} to train and score the "
                              "model again")


def _checkpoint_steps(train_steps: int, settings: ContextSettings) -> list[int]:
    limit, denominator = settings.checkpoint_fractions
    return [train_steps * k // denominator for k in range(1, limit)]


def archive_facts(data: Splits, settings: ContextSettings, corpus: Corpus) -> dict:
    """The settings a model's cells are scored under (txl_tf.study.archive): an archive is reused only where they
    match, as JSON reads them back."""
    import json

    facts = {"dataset": corpus.dataset, "memories": settings.memories, "recl_contexts": settings.recl_contexts,
             "train_span": settings.train_span, "eval_tgt_len": settings.eval_tgt_len, "block": settings.block,
             "streams": settings.eval_batch, "drop": settings.drop,
             "split_tokens": {"valid": int(data.valid.tokens.shape[0]), "test": int(data.test.tokens.shape[0])},
             "subset_tokens": int(data.test.subset().shape[0]), "probe": dataclasses.asdict(settings.probe)}
    return json.loads(json.dumps(facts))


def _cells(losses: dict, settings: ContextSettings, data: Splits, vanilla: bool) -> dict:
    """{(split, memory, clamp): archive.Cell}: the test cells keep their losses on the vanilla subset (a vanilla
    model's test losses are that subset)."""
    from txl_tf.study import archive

    subset = data.test.subset()
    out = {}
    for key, x in losses.items():
        keep = None if key[0] != "test" else np.arange(x.shape[0]) if vanilla else subset
        out[key] = archive.Cell.of(x, settings.block, keep)
    return out


def check_sanity(model: Model, run: str, cells: dict, settings: ContextSettings) -> dict | None:
    """The sanity check of docs/study_plan_v2.md: a model scored with a fixed window (the vanilla one, its window
    the training span) should not be worse at that window than at a shorter one on the validation split. Its
    record (txl_tf.study.sanity.vanilla_report) is printed as one line and returned, and a failure is reported
    beside every verdict that involves the model, no longer a stop (docs/study_plan_v3.md). Recurrent models
    choose their memory on the validation split and are not checked (None)."""
    if not model.vanilla:
        return None
    report = sanity.vanilla_report(cells, settings.train_span, name=run, block=settings.block)
    runs.log(f"  {run}: {sanity.report_line(report)}")
    return report


def train_and_score(model: Model, output_dir: str, data_dir: str, data: Splits, settings: ContextSettings,
                    quick: bool, corpus: Corpus = CORPORA[0], archive_dir: str | None = None, seed: int = 1
                    ) -> tuple[dict, dict]:
    """Trains one seed of a model (or finds it finished) and computes (or reads back) every score the section
    needs; a model in `archive_dir` (default OUTPUT_DIR/archive) is read from there without its run, and a model
    scored here is archived there. The full study trains from committed code only and refuses archives that were
    not (runs.require_clean_tree); the baseline's early checkpoints are scored for its first seed.

    Returns (record with parameters and training tokens, scores: {"cells": {(split, memory, clamp): archive.Cell},
    "probe": {memory: probe summary}, and for the baseline "checkpoints": {step: cells}, "checkpoint_tokens"}).
    """
    import keras

    from txl_tf.study import archive

    archive_dir = archive_dir or os.path.join(output_dir, "archive")
    spec = run_spec(model, settings, data_dir, quick, corpus, seed)
    facts = archive_facts(data, settings, corpus)
    archived = archive.load(archive_dir, spec.name, facts, spec.digest(portable=True), clean=not quick)
    if archived is not None:
        _check_clamped_cells(model, archived[1]["cells"], settings, archive.paths_of(archive_dir, spec.name))
        runs.log(f"[{corpus.key}] {spec.name}: scores read from {archive.paths_of(archive_dir, spec.name)[0]}")
        report = check_sanity(model, spec.name, archived[1]["cells"], settings)
        return (archived[0] | {"sanity": report} if report else archived[0]), archived[1]
    run_dir = os.path.join(output_dir, "runs", spec.name)
    runs.log(f"[{corpus.key}] {spec.name}: training ({', '.join(spec.gin_files)}) in {run_dir}")
    record = dict(runs.train_run(spec, run_dir, clean=not quick))
    runs.log(f"[{corpus.key}] {spec.name}: trained {record['steps']} steps in {record['wall_seconds'] / 60:.1f} min; "
             "scoring")
    loaded, configs = runs.load_run_model(run_dir)
    tokens_per_step = configs.train.batch_size * configs.train.tgt_len
    record["parameters"] = runs.num_parameters(loaded)
    record["train_tokens"] = record["steps"] * tokens_per_step
    scorer = Scorer(run_dir, loaded, model, settings)
    scores = {"cells": _cells(_grid(scorer, data, settings), settings, data, model.vanilla),
              "probe": {m: probe_lib.summarize(*scorer.probe(data.test_tokens, m), settings.probe)
                        for m in settings.memories}}
    if model.name == BASELINE and seed == 1:
        scores["checkpoints"], scores["checkpoint_tokens"] = {}, {}
        for step in _checkpoint_steps(record["steps"], settings):
            early, _ = runs.load_run_model(run_dir, checkpoint=os.path.join(run_dir, f"ckpt-{step}"))
            grid = _grid(Scorer(run_dir, early, model, settings, prefix=f"ckpt{step}_"), data, settings,
                         clamps=(UNCLAMPED,), recl=False)
            scores["checkpoints"][step] = {k: archive.Cell.of(x, settings.block) for k, x in grid.items()}
            scores["checkpoint_tokens"][step] = step * tokens_per_step
    keras.backend.clear_session()
    report = check_sanity(model, spec.name, scores["cells"], settings)
    if report:
        record["sanity"] = report
    path = archive.save(archive_dir, spec.name, spec.digest(portable=True), record, scores, facts)
    runs.log(f"[{corpus.key}] {spec.name}: archived in {path}")
    return record, scores
