"""The study pipeline end to end (`--quick`: real corpora, real training runs, real evaluations), its resume,
and the published report: docs/reproduction.md must be exactly what the generator renders from its results.json."""

import json
import math
import os
import pathlib
import re
import shutil

import numpy as np
import pytest
from train_utils import REPO_ROOT

from txl_tf.study import ablation, archive, evidence, report, report_context, runs, studies, tables


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))  # corpora prepared by the study itself (fetched once per cache)


def _table_rows(markdown: str, header_start: str) -> list[list[str]]:
    """The body rows of the first Markdown table whose header starts with `header_start`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


# slow: ~45 s (the quick study trains its group); CI runs it in its slow phase
@pytest.mark.slow
def test_ablation_quick_end_to_end_and_resume(tmp_path, data_root):
    out = str(tmp_path / "study")
    document = studies.run(["recl"], out, quick=True, data_root=data_root)
    section = document["studies"]["ablation"]
    names = [v.name for v in ablation.VARIANTS]
    assert set(names) <= set(section["runs"])
    for name in names:
        run = section["runs"][name]
        assert run["steps"] == 30 and run["parameters"] > 0
        assert all(math.isfinite(run["evals"][str(length)]["bpc"]) for length in ablation.QUICK.lengths)
    assert section["setup"]["parameter_deviation"] <= ablation.PARAMETER_TOLERANCE
    assert section["recl"]["models"] == names and set(section["recl"]["ratios"]) == {"0.1", "0.5", "1.0"}
    # Table 5 scores every kept token of the split (the vanilla model its subset), the same tokens in every cell.
    setup, quick = section["setup"], ablation.QUICK
    stream = (quick.max_tokens - 1) // quick.eval_batch
    assert setup["kept_tokens"] == quick.eval_batch * (stream - quick.n_layer * 256) and "eval_tokens" not in setup
    for name in names:
        expected = setup["vanilla_subset_tokens"] if name == "al_rfou" else setup["kept_tokens"]
        assert {e["tokens"] for e in section["runs"][name]["evals"].values()} == {expected}, name
    assert section["recl"]["tokens"] == setup["vanilla_subset_tokens"]
    # Every variant trains every seed; each claim reads them (docs/study_plan.md), undecided short of three.
    assert section["seeds"] == {n: [runs.seed_name(n, k) for k in quick.seeds] for n in names}
    for other in names[1:]:
        claim = section["comparisons"][f"xl_vs_{other}_seeds"]
        assert claim["runs"] == [[runs.seed_name("xl", k), runs.seed_name(other, k)] for k in quick.seeds]
        assert claim["verdict"] == "undecided" and claim["family_size"] == len(names) - 1
    assert [e["runs"] for e in section["recl"]["by_seed"]] == [
        [runs.seed_name(n, k) for n in tables.PAPER_GROUP] for k in quick.seeds]
    # The vanilla variant: its window chosen on validation, its test split scored there, its check recorded, and
    # its verdict under plans v3 (the headline) and v2 (docs/study_plan_v3.md).
    chosen = [section["runs"][r]["window"] for r in section["seeds"]["al_rfou"]]
    assert all(w in quick.valid_windows for w in chosen)
    for r, w in zip(section["seeds"]["al_rfou"], chosen, strict=True):
        assert str(w) in section["runs"][r]["evals"] and isinstance(section["runs"][r]["sanity"]["passed"], bool)
    v3, v2 = section["comparisons"]["xl_vs_al_rfou_seeds"], section["comparisons"]["xl_vs_al_rfou_seeds_v2"]
    assert v3["plan"] == 3 and v3["windows"] == chosen and [c["b"][1] for c in v3["per_seed"]] == chosen
    assert v2["plan"] == 2 and [c["b"][1] for c in v2["per_seed"]] == [quick.train_attention] * len(quick.seeds)
    assert v2["withheld"] == [r for r in section["seeds"]["al_rfou"] if not section["runs"][r]["sanity"]["passed"]]
    assert "xl_vs_al_rfou_v1" not in section["comparisons"]  # no plan_v1 archive in this output folder

    text = open(os.path.join(out, "report.md")).read()
    bpc_rows = _table_rows(text, "| variant | 32 (1x)")
    labels = [v.label for v in ablation.VARIANTS]
    assert [row[0] for row in bpc_rows[:len(labels)]] == labels  # one row per variant, in order
    for row in bpc_rows[:len(labels)]:
        assert len(row) == 1 + len(ablation.QUICK.lengths)
        assert all(math.isfinite(float(re.match(r"[0-9.]+", cell).group())) for cell in row[1:])
    assert len(_table_rows(text, "| model | r = 0.1")) == len(names)
    assert f"The first {quick.max_tokens:,} characters of the test split are scored in {quick.eval_batch} streams" \
        in text and "warm-up" not in text
    for png in ("ablation_bpc.png", "recl_gains.png"):
        with open(os.path.join(out, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert text == report.render(runs.read_results(os.path.join(out, "results.json")))
    assert "the window chosen on validation" in text and "(plan v2: at its own window 32)" in text
    assert text.count("sanity check ") >= len(quick.seeds)
    verdicts = {row[0]: row[3] for row in report._ablation_claims(section)}  # beside the vanilla plan v2 row too
    for _, claim, other in report.CLAIMS:
        assert verdicts[claim] == tables.seeds_verdict(section["comparisons"][f"xl_vs_{other}_seeds"]), claim

    # Re-running trains nothing and re-scores nothing; a run whose record and archive are gone resumes at its last
    # checkpoint.
    os.remove(os.path.join(out, "runs", "shaw", runs.RUN_RECORD))
    for path in archive.paths_of(os.path.join(out, "archive"), "ablation_shaw"):
        os.remove(path)
    again = studies.run(["ablation"], out, quick=True, data_root=data_root)["studies"]["ablation"]
    for name in names:
        attempts = json.load(open(os.path.join(out, "runs", name, runs.ATTEMPTS_FILE)))["attempts"]  # seed 1
        assert attempts == (2 if name == "shaw" else 1), name
        assert again["runs"][name]["evals"] == section["runs"][name]["evals"]
    assert "recl" in again  # kept: an earlier `recl` study asked for it
    assert "resumed from" in open(os.path.join(out, "runs", "shaw", runs.TRAIN_LOG)).read()


def test_a_changed_run_is_refused_not_reused(tmp_path):
    spec = runs.RunSpec("xl", ("study/ablation_xl.gin",), ("TrainConfig.seed = 1",))
    run_dir = tmp_path / "xl"
    run_dir.mkdir()
    record = {"digest": "0" * 16, "gin_files": ["study/ablation_xl.gin"], "gin_params": ["TrainConfig.seed = 2"]}
    (run_dir / runs.RUN_RECORD).write_text(json.dumps(record))
    with pytest.raises(runs.StudyError, match="another configuration"):
        runs.train_run(spec, str(run_dir))


# slow: ~11 s; CI runs it in its slow phase
@pytest.mark.slow
def test_ptb_quick_end_to_end(tmp_path, data_root):
    out = str(tmp_path / "study")
    document = studies.run(["ptb"], out, quick=True, data_root=data_root)
    section = document["studies"]["ptb"]
    for name in ("xl", "vanilla"):
        run = section["runs"][name]
        assert run["steps"] == 25 and math.isfinite(run["test_ppl"])
        averaged = json.load(open(os.path.join(out, "runs", f"ptb_{name}", "averaged", "averaged.json")))
        assert averaged["mean_of"] == 5
    assert math.isfinite(section["runs"]["xl"]["test_ppl_last"]) and section["runs"]["vanilla"]["test_ppl_last"] is None
    assert section["runs"]["xl"]["eval"]["protocol"]["protocol"] == "xl"
    assert section["runs"]["vanilla"]["eval"]["protocol"]["protocol"] == "vanilla"
    # The evaluation memory is chosen on the validation split, and the test split is read at that memory only.
    from txl_tf.study import ptb

    sweep = section["runs"]["xl"]["memory_sweep"]
    assert set(sweep["valid_ppl"]) == {str(m) for m in ptb.QUICK.sweep_memories}
    assert sweep["chosen"] == min(ptb.QUICK.sweep_memories, key=lambda m: sweep["valid_ppl"][str(m)])
    assert section["runs"]["xl"]["test_ppl"] == sweep["test_ppl"]
    evals = os.listdir(os.path.join(out, "runs", "ptb_xl", runs.EVAL_DIR))
    assert [e for e in evals if e.startswith("test_averaged5_mem")] == [
        e for e in evals if e.startswith(f"test_averaged5_mem{sweep['chosen']}_")]
    report_text = open(os.path.join(out, "report.md")).read()
    assert f"memory {sweep['chosen']}, test ppl {sweep['test_ppl']:.2f}" in report_text
    rows = _table_rows(open(os.path.join(out, "report.md")).read(), "| model | parameters | training minutes")
    assert [row[0] for row in rows[:2]] == [section["runs"]["xl"]["label"], section["runs"]["vanilla"]["label"]]
    assert rows[2][4] == "141.2" and rows[3][4] == "114.5"


def test_verdicts_follow_the_interval():
    assert report.verdict({"mean": -0.1, "low": -0.2, "high": -0.01}) == "reproduced"
    assert report.verdict({"mean": 0.1, "low": 0.01, "high": 0.2}) == "reversed"
    assert report.verdict({"mean": -0.1, "low": -0.2, "high": 0.05}).startswith("not reproduced")


def _seeded_cells(shifts: dict, tokens: int = 3000) -> tuple[dict, dict]:
    """Archived cells of XL's seeds and the other variants' seeds at attention length 16: each run's per-token
    losses are one shared text's plus the run's shift (nats per token) plus a little noise of its own."""
    rng = np.random.default_rng(7)
    base = rng.normal(2.0, 0.5, size=tokens)
    block = ablation.QUICK.bootstrap_block
    cells, seeds = {}, {}
    for variant, values in shifts.items():
        for seed, delta in enumerate(values, start=1):
            name = runs.seed_name(variant, seed)
            losses = base + delta + rng.normal(0, 0.01, size=tokens)
            cells[name] = {("test", 16, -1): archive.Cell.of(losses, block)}
            seeds.setdefault(variant, []).append(name)
    return cells, seeds


def test_a_claim_whose_seeds_disagree_in_sign_is_undecided():
    cells, seeds = _seeded_cells({"xl": [-0.10, -0.08, 0.03], "no_recurrence": [0.0, 0.0, 0.0]})
    claim = ablation.seed_claims(cells, seeds, 16, ablation.QUICK, frozenset())["no_recurrence"]
    assert [c["high"] < 0 for c in claim["per_seed"]] == [True, True, False]  # seeds 1 and 2 alone: "reproduced"
    assert claim["per_seed"][2]["low"] > 0  # and seed 3 alone: "reversed"
    assert claim["n"] == 3 and claim["seeds"] == [c["mean"] for c in claim["per_seed"]]
    assert claim["verdict"] == "undecided" and evidence.why(claim) == "the seeds disagree in sign"
    assert claim["runs"] == [["xl", "no_recurrence"], ["xl_seed2", "no_recurrence_seed2"],
                             ["xl_seed3", "no_recurrence_seed3"]]


def test_one_seed_excluding_zero_is_not_a_verdict_when_the_seeds_interval_covers_it():
    cells, seeds = _seeded_cells({"xl": [-0.12, -0.004, -0.002], "no_recurrence": [0.0, 0.0, 0.0]})
    claim = ablation.seed_claims(cells, seeds, 16, ablation.QUICK, frozenset())["no_recurrence"]
    first = claim["per_seed"][0]
    assert first["high"] < 0  # seed 1's block bootstrap over the scored tokens excludes zero ...
    assert claim["low"] < 0 < claim["high"]  # ... the interval over the seeds does not
    assert all(x < 0 for x in claim["seeds"]) and claim["verdict"] == "undecided"
    assert math.isclose(claim["mean"], np.mean(claim["seeds"]), rel_tol=1e-12)


def test_a_family_of_claims_is_decided_with_holm_and_every_seed():
    cells, seeds = _seeded_cells({"xl": [-0.05, -0.051, -0.049], "no_recurrence": [0.0, 0.0, 0.0],
                                  "shaw": [-0.1, -0.1, -0.1], "vaswani": [-0.2, -0.2, -0.2]})
    claims = ablation.seed_claims(cells, seeds, 16, ablation.QUICK, frozenset())
    assert set(claims) == {"no_recurrence", "shaw", "vaswani"}  # the variants with seeds, XL against each
    assert claims["no_recurrence"]["verdict"] == "reproduced"  # XL 0.05 nats below in every seed
    assert claims["shaw"]["verdict"] == "reversed"  # Shaw 0.05 below XL in every seed
    assert claims["vaswani"]["verdict"] == "reversed"
    assert all(c["family_size"] == 3 and c["p_holm"] >= c["p"] for c in claims.values())
    two, _ = _seeded_cells({"xl": [-0.05, -0.051], "no_recurrence": [0.0, 0.0]})
    short = ablation.seed_claims(two, {"xl": ["xl", "xl_seed2"], "no_recurrence": ["no_recurrence",
                                                                                    "no_recurrence_seed2"]},
                                 16, ablation.QUICK, frozenset())["no_recurrence"]
    assert short["verdict"] == "undecided" and evidence.why(short) == "2 of the plan's 3 seeds"


def test_paired_bootstrap_brackets_the_true_difference():
    rng = np.random.default_rng(0)
    base = rng.normal(2.0, 1.0, size=4000)
    stats = runs.paired_bootstrap(base - 0.05 + rng.normal(0, 0.1, size=4000), base, block=50)
    assert stats["low"] < -0.05 < stats["high"] and stats["high"] < 0
    same = runs.paired_bootstrap(base, base, block=50)
    assert same["low"] == same["high"] == 0.0


def test_published_report_is_what_the_generator_renders():
    """docs/reproduction.md is written by the study only: rendering its results.json gives it byte for byte."""
    root = pathlib.Path(REPO_ROOT)
    docs = root / "docs"
    results = docs / report.PUBLISHED_NAME / "results.json"
    document = runs.read_results(str(results))
    assert not any(section.get("quick") for section in document["studies"].values())
    expected = report.render(document, images=report.PUBLISHED_NAME + "/",
                             source=f"{report.PUBLISHED_NAME}/results.json")
    assert (docs / f"{report.PUBLISHED_NAME}.md").read_text() == expected
    pngs = ["ablation_bpc.png", "recl_gains.png"]
    for key in report.CONTEXT_SECTIONS:  # every plot each context section's text links to
        if key in document["studies"]:
            section = document["studies"][key]
            pngs += [f"{key}_bpc.png", f"{key}_probe.png"]
            pngs += [f"{key}_gain.png"] if "gain_curve" in section else []
            pngs += [f"{key}_recl.png"] if "recl" in section else []
    for png in pngs:
        assert (docs / report.PUBLISHED_NAME / png).exists() and f"({report.PUBLISHED_NAME}/{png})" in expected
    readme = (root / "README.md").read_text()
    assert report.replace_summary(readme, document) == readme  # the README's block is the generator's too
    # The ablation's attention-length and RECL tables say they are superseded exactly when the context study ran.
    without = {**document, "studies": {k: v for k, v in document["studies"].items() if k != "context"}}
    assert (report.SUPERSEDED in expected) == ("context" in document["studies"])
    assert report.SUPERSEDED not in report.render(without)


def test_an_ablation_claim_over_seeds_keeps_its_own_verdict_beside_the_vanilla_plans_rows():
    """The vanilla claim's rows under plans v2 and v1 sit among the claims: the claim after them (the half loss,
    over its three seeds) keeps the verdict its seeds give, and only the rows after the claims (seed 1 alone, or
    study v3's one seed) are marked as read from fewer seeds than the plan's, once each."""
    document = runs.read_results(str(pathlib.Path(REPO_ROOT) / "docs" / report.PUBLISHED_NAME / "results.json"))
    section = document["studies"]["ablation"]
    rows = {row[0]: row[3] for row in report._ablation_claims(section)}
    comparisons = section["comparisons"]
    over_seeds = [(text, other) for _, text, other in report.CLAIMS if f"xl_vs_{other}_seeds" in comparisons]
    assert [other for _, other in over_seeds] == ["no_recurrence", "shaw", "vaswani", "al_rfou", "half_loss"]
    for text, other in over_seeds:
        assert rows[text] == tables.seeds_verdict(comparisons[f"xl_vs_{other}_seeds"]), (text, rows[text])
    for verdict in rows.values():
        assert verdict.count("the plan needs") <= 1, verdict


def test_a_sections_machine_line_names_the_commits_its_archived_runs_were_trained_from():
    """The ablation's runs were trained on other days and machines than the study that read them from
    studies/archive: its machine line names their commits; PTB's two runs trained where it ran: no such words."""
    document = runs.read_results(str(pathlib.Path(REPO_ROOT) / "docs" / report.PUBLISHED_NAME / "results.json"))
    ablation_section, ptb = document["studies"]["ablation"], document["studies"]["ptb"]
    line = report._machine(ablation_section)
    trained = sorted({r["commit"] for r in ablation_section["runs"].values()})
    assert len(trained) > 1 and f"from the scores of its {len(ablation_section['runs'])} runs" in line, line
    assert f"commits {', '.join(f'`{c}`' for c in trained)} and read from studies/archive" in line, line
    assert report._machine(ptb).startswith("Measured on ") and "studies/archive" not in report._machine(ptb)


def test_candidate_tokens_are_the_first_train_share_numbered_densely():
    from txl_tf.study import corpus_choice

    data = bytes(range(200, 256)) * 10 + b"abc" * 100 + b"z" * 90  # 950 bytes; "z" only in the last 10%
    ids, vocab_size = corpus_choice.candidate_tokens(data, max_tokens=10_000)
    assert ids.size == 855 and vocab_size == 60 and ids.min() == 0 and ids.max() == 59
    assert (np.unique(ids[:560]) == np.arange(4, 60)).all() and ids[560:563].tolist() == [0, 1, 2]
    assert 3 not in ids  # "z" is in the vocabulary but not in the measured 90%
    capped, capped_size = corpus_choice.candidate_tokens(data, max_tokens=100)
    assert capped.tolist() == ids[:100].tolist() and capped_size == 60


def test_a_rise_past_the_training_span_is_explained_with_the_clamped_cell():
    """The report says why a model's unclamped bpc rises past the training span (RoPE's: 2.04 -> 4.57 bpc) and what
    its cell clamped at the span shows: the rise gone (distances it never trained on), still there, or not scored."""
    import copy

    from txl_tf.study import report_context

    document = runs.read_results(str(pathlib.Path(REPO_ROOT) / "docs" / report.PUBLISHED_NAME / "results.json"))
    section = document["studies"]["context"]
    lines = report_context._past_the_span_lines(section)
    assert [line for line in lines if line] == [
        "RoPE + recurrence: 2.0343 bpc at memory 256, 4.0750 at 384 unclamped. With same_length a query reads back "
        "as far as the memory, and past memory 256 that is further than any distance a training query reached "
        "(255): scores at distances it never trained on. Clamped at 256 (every longer distance scored as 256) it "
        "reads 2.0370 at 384: the distances it never trained on make the rise, not the further text."]
    for clamped, says in ((None, " It was not scored clamped at 256 in these runs."),
                          (4.0, " Clamped at 256 it still reads 4.0000 at 384: the clamp does not remove the rise.")):
        changed = copy.deepcopy(section)
        if clamped is None:
            del changed["runs"]["rope"]["test"]["256"]
        else:
            changed["runs"]["rope"]["test"]["256"] = {"384": clamped}
        (line,) = [line for line in report_context._past_the_span_lines(changed) if line]
        assert line.endswith("scores at distances it never trained on." + says), line
    flat = copy.deepcopy(section)
    flat["runs"]["rope"]["test"]["-1"]["384"] = 2.0343 + 0.0999  # under the threshold: nothing to explain
    assert report_context._past_the_span_lines(flat) == []


def test_readme_block_has_one_row_per_claim_and_a_column_per_corpus():
    """The README's block: the ablation's and PTB's claims one a line; each context claim once, with each corpus'
    own verdict and figure in its column (here a second corpus where Transformer-XL's longer memory hurts)."""
    from txl_tf.study import context, report_context

    document = runs.read_results(str(pathlib.Path(REPO_ROOT) / "docs" / report.PUBLISHED_NAME / "results.json"))
    first = document["studies"]["context"]
    second = json.loads(json.dumps(first))
    second["setup"]["dataset"], second["key"] = "networkx_code", "context_code"
    beyond = second["by_seed"]["claims"]["longer_beyond_xl"]
    beyond.update(mean=0.0123, low=0.0101, high=0.0145, seeds=[0.0121, 0.0123, 0.0125], p_holm=0.01,
                  verdict="reversed")
    document["studies"]["context_code"] = second
    block = report.summary(document)
    assert "[networkx_code]" not in block
    general = _table_rows(block, "| claim (of the paper, unless marked")
    assert [row[0] for row in general] == [
        row[0] for row in report.claims({**document, "studies": {k: v for k, v in document["studies"].items()
                                                                  if k in ("ablation", "ptb")}})
        if not row[0].startswith(report_context.REPLACED_CLAIMS)]
    header = next(line for line in block.splitlines() if line.startswith("| claim |"))
    assert header == f"| claim | {context.CORPORA[0].title} | {context.CORPORA[1].title} |"
    rows = _table_rows(block, "| claim |")
    for section, column in ((first, 1), (second, 2)):
        expected = report_context.claims(section, tagged=False)
        assert [row[0] for row in rows] == [claim for claim, *_ in expected]
        assert all(row[column].startswith(result + ": ") for row, (*_, result) in zip(rows, expected, strict=True))
    assert rows[0][0].startswith("A longer memory beyond the training span (256) helps Transformer-XL")
    assert rows[0][1].startswith("undecided (Holm-adjusted p = 1): -0.0001 bpc [-0.0006, +0.0004] over 3 seeds: ")
    assert rows[0][2] == "reversed: +0.0123 bpc [+0.0101, +0.0145] over 3 seeds: +0.0121, +0.0123, +0.0125"


@pytest.mark.slow  # CI's slow phase: the fast suite stays near 10 minutes on 2 cores
def test_context_quick_end_to_end(tmp_path, data_root):
    """Studies `corpora`, `context` and `context_code` (--quick): what each corpus repeats, then six runs on each
    corpus, the memory axis on the same kept tokens, RECL, the probe, the report with both corpora; a second study
    call trains and scores nothing again."""
    from txl_tf.study import context, corpus_choice

    out = str(tmp_path / "study")
    document = studies.run(["corpora", "context", "context_code"], out, quick=True, data_root=data_root)
    rows = document["studies"]["corpora"]["corpora"]
    assert [r["dataset"] for r in rows] == ["enwik8_sample", "networkx_code", "django_code"]
    assert rows[2]["candidate"]["wheel"] == "Django==5.2.8" and rows[2]["tokens"] == corpus_choice.QUICK.max_tokens
    for row in document["studies"]["corpora"]["corpora"]:
        fractions = [f for _, f in sorted((int(w), f) for w, f in row["recurrence"]["fraction"].items())]
        assert fractions == sorted(fractions) and 0 < fractions[-1] < 1  # a wider window finds more copies
        assert row["bits"]["short_range_bits"] > 0
    code = document["studies"]["context_code"]
    assert code["setup"]["dataset"] == "networkx_code" and code["key"] == "context_code"
    assert set(code["runs"]) == {m.name for m in context.MODELS}
    assert all(r["name"] == f"context_code_{n}" for n, r in code["runs"].items())
    section = document["studies"]["context"]
    settings = context.QUICK
    names = [m.name for m in context.MODELS]
    assert list(section["runs"]) == sorted(names)
    kept = section["setup"]["kept_tokens"]["test"]
    assert kept == settings.eval_batch * ((settings.max_tokens - 1) // settings.eval_batch - settings.drop)
    for name in names:
        run = section["runs"][name]
        assert run["steps"] == 30
        table = run["test"][str(context.UNCLAMPED)]
        assert set(table) == {str(m) for m in settings.memories}
        assert all(math.isfinite(v) for v in table.values())
        assert run["best"]["memory"] in settings.memories
    # The vanilla model's window stops at its training span: every longer memory scores the same.
    vanilla = section["runs"]["al_rfou"]["test"][str(context.UNCLAMPED)]
    assert len({vanilla[str(m)] for m in settings.memories if m >= settings.train_span}) == 1
    # Clamping at the training span changes nothing where no distance reaches it, and is kept apart elsewhere;
    # the encodings that clamp_len does not touch are scored unclamped only.
    for model in context.MODELS:
        by_clamp = section["runs"][model.name]["test"]
        if model.clamped and not model.vanilla:
            assert set(by_clamp[str(settings.train_span)]) == {str(m) for m in settings.memories
                                                               if settings.clamp_matters(m)}
        else:
            assert list(by_clamp) == [str(context.UNCLAMPED)]
    assert [p["step"] for p in section["gain_curve"]] == [10, 20, 30]
    assert section["recl"]["paper_group"]["models"] == list(tables.PAPER_GROUP)
    assert section["recl"]["paper_group"]["tokens"] == section["setup"]["vanilla_subset_tokens"]
    distances = [str(d) for d in settings.probe.distances]
    assert set(section["probe"]["xl"][str(settings.memories[0])]) == set(distances)
    for name in ("xl", "al_rfou"):
        cell = section["probe"][name][str(settings.memories[-1])][distances[0]]
        assert cell["copy_low"] <= cell["copy"] <= cell["copy_high"] and math.isfinite(cell["control"])

    text = open(os.path.join(out, "report.md")).read()
    assert text == report.render(runs.read_results(os.path.join(out, "results.json")))
    assert "## A corpus where long context pays" in text and "| networkx_code | 200,000 |" in text
    rows = report.claims(runs.read_results(os.path.join(out, "results.json")))
    claims = [row[0] for row in rows]
    # Every model trained its seeds (the quick study: 2); the verdicts read them and stay undecided short of 3.
    by_seed = section["by_seed"]
    assert by_seed["seeds"] == {m.name: len(settings.seeds) for m in context.MODELS}
    assert len(by_seed["claims"]["xl_vs_no_recurrence"]["seeds"]) == len(settings.seeds) == 2
    assert [e["seed"] for e in by_seed["recl"]] == [1, 2] and by_seed["recl_grid"] == [32, 64]
    # The vanilla model's check on every seed, beside its verdict under plans v3 and v2 (docs/study_plan_v3.md).
    assert [r["own"] for r in by_seed["sanity"]["al_rfou"]] == [settings.train_span] * 2
    vanilla_rows = [r for r in rows if r[0].startswith("Transformer-XL beats the vanilla Transformer")]
    assert [r[0] for r in vanilla_rows] == ["Transformer-XL beats the vanilla Transformer (make-run size, each at its "
                                            "best memory)", "Transformer-XL beats the vanilla Transformer (make-run "
                                            "size, each at its best memory) (plan v2)"]
    assert "(plan v3; seed 1: sanity check " in vanilla_rows[0][2] and "; seed 2: sanity check " in vanilla_rows[0][2]
    assert "xl_vs_al_rfou_v1" not in section["comparisons"]  # no plan_v1 archive in this output folder
    assert claims[0].startswith(f"A longer memory beyond the training span ({settings.train_span}) helps")
    assert rows[0][3] == "undecided (2 of the plan's 3 seeds)"
    recl_rows = [c for c in claims if "Transformer-XL has the longest RECL" in c]
    assert recl_rows == ["Transformer-XL has the longest RECL (appendix C, grid 32, 64, the paper's group)",
                         "[networkx_code] Transformer-XL has the longest RECL (appendix C, grid 32, 64, the paper's "
                         "group)"]
    for prefix in ("", "[networkx_code] "):  # RoPE and ALiBi against the paper's encoding, over the seeds
        for name in ("RoPE", "ALiBi"):
            row = next(r for r in rows if r[0].startswith(f"{prefix}{name} + recurrence vs. the paper's"))
            assert row[3] == "undecided (2 of the plan's 3 seeds)" and "over 2 seeds: " in row[2]
        assert any(c.startswith(f"{prefix}Which recurrent encoding copies from furthest back") for c in claims)
    for key in ("context", "context_code"):
        for png in ("bpc", "gain", "recl", "probe"):
            with open(os.path.join(out, f"{key}_{png}.png"), "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    evals = os.path.join(out, "runs", "context_xl", runs.EVAL_DIR)
    before = sorted(os.listdir(evals))
    again = studies.run(["context_xl"], out, quick=True, data_root=data_root)["studies"]["context"]
    assert sorted(os.listdir(evals)) == before and again["runs"]["xl"]["test"] == section["runs"]["xl"]["test"]
    assert json.load(open(os.path.join(out, "runs", "context_xl", runs.ATTEMPTS_FILE)))["attempts"] == 1

    # On another machine, with the archives (txl_tf.study.archive) but none of the runs: the same sections, and
    # nothing trained.
    shutil.rmtree(os.path.join(out, "runs"))
    moved = studies.run(["context", "context_code"], str(tmp_path / "elsewhere"), quick=True, data_root=data_root,
                        archive_dir=os.path.join(out, "archive"))
    assert not os.path.exists(str(tmp_path / "elsewhere" / "runs"))
    for key in ("context", "context_code"):
        assert moved["studies"][key] == document["studies"][key] | {"machine": moved["studies"][key]["machine"]}


def _context_scores(test_bits: dict, valid_bits: dict, copy: float = -0.1) -> dict:
    """One seed's scores of a context model (txl_tf.study.context.QUICK axes) from {memory: bpc} per split, every
    cell unclamped, each cell's per-token losses constant at its figure (the subset: every test cell's first 4)."""
    ln2 = math.log(2.0)
    cells = {}
    for split, table in (("valid", valid_bits), ("test", test_bits)):
        for memory, bits in table.items():
            losses = np.full(80, bits * ln2)
            cells[(split, memory, -1)] = archive.Cell.of(losses, 20, np.arange(4) if split == "test" else None)
    return {"cells": cells, "probe": {64: {"64": {"copy": copy}}}}


def test_a_memory_gain_splits_at_the_training_span_and_the_beyond_part_is_chosen_on_validation():
    from txl_tf.study import context, context_seeds

    settings = context.QUICK  # memories 8, 16, 32, 64; training memory 16, span 32
    xl = _context_scores({8: 2.10, 16: 2.00, 32: 1.90, 64: 1.85}, {8: 2.1, 16: 2.0, 32: 1.9, 64: 1.95})
    parts = context_seeds.parts(xl["cells"], settings)
    assert math.isclose(parts["inside"], 1.90 - 2.00, abs_tol=1e-6) and parts["best"] == [32, -1]
    # the beyond part at the memory >= 32 best on validation (32), not the test split's best (64)
    assert parts["beyond_at"] == [32, -1] and parts["beyond"] == 0.0
    seeds = {"xl": [xl, _context_scores({8: 2.1, 16: 2.0, 32: 1.9, 64: 1.8}, {8: 2, 16: 2, 32: 1.9, 64: 1.8}),
                    _context_scores({8: 2.1, 16: 2.0, 32: 1.9, 64: 1.7}, {8: 2, 16: 2, 32: 1.9, 64: 1.7})],
             "no_recurrence": [_context_scores({m: v for m in (8, 16, 32, 64)}, {m: v for m in (8, 16, 32, 64)})
                               for v in (2.30, 2.21, 2.09)]}
    claims, split = context_seeds.family(seeds, settings)
    assert [round(x, 6) for x in claims["longer_beyond_xl"]] == [0.0, -0.1, -0.2]
    assert [round(x, 6) for x in claims["longer_beyond_xl_vs_no_recurrence"]] == [0.0, -0.1, -0.2]
    assert [round(x, 6) for x in claims["xl_vs_no_recurrence"]] == [-0.4, -0.41, -0.39]  # each at its valid best
    assert claims["probe_xl"] == [-0.1, -0.1, -0.1]
    decided = context_seeds.section(seeds, settings)["claims"]
    assert decided["xl_vs_no_recurrence"]["verdict"] == "reproduced"
    assert decided["longer_beyond_xl"]["verdict"] == "undecided"  # seed 1 gains nothing beyond the span


def test_which_model_rows_read_every_seed_and_a_recl_earned_by_noise_is_named():
    """The context rows that pick a maximum ("which encoding reaches furthest") read every seed and name a model
    only when it leads alone in each (docs/study_plan.md, section 3); the RECL verdict says when the models ahead
    of XL earned their RECL where their own mean bpc rose (section 6)."""
    document = runs.read_results(str(pathlib.Path(REPO_ROOT) / "docs" / report.PUBLISHED_NAME / "results.json"))
    for key in report.CONTEXT_SECTIONS:
        section = document["studies"][key]
        by_seed = section["by_seed"]
        rows = {row[0]: row for row in report_context.claims(section, tagged=False)}
        copies = rows["Which recurrent encoding copies from furthest back (copy probe, memory 1024)"]
        reach = by_seed["furthest_copy"]
        assert all(len(v) == 3 for v in reach.values())
        leader = evidence.same_leader([{n: reach[n][k] for n in reach} for k in range(3)])
        assert copies[3] == (f"{leader}, in every seed" if leader else copies[3])
        assert leader is not None or copies[3].startswith("no verdict: no model ahead in every seed (seed 1: ")
        for n, values in reach.items():  # every model's three distances in the row
            assert f"{n} {'/'.join(str(v or 'none') for v in values)}" in copies[2]
        recl_row = next(row for claim, row in rows.items() if claim.startswith("Transformer-XL has the longest RECL"))
        assert recl_row[3].startswith(by_seed["recl_verdict"])
        shares = {n: [e["ratios"]["0.1"]["noise_share"][e["models"].index(n)] for e in by_seed["recl"]]
                  for n in by_seed["recl"][0]["models"]}
        assert min(shares["shaw"]) >= 0.5 and "by noise: shaw's longer RECL" in recl_row[3]  # published: 100% each
    synthetic = [{"seed": k, "models": ["xl", "shaw"], "ratios": {"0.1": {"recl": [256, 1024], "noise_share": [0.0, s],
                                                                          "truncated": [False, True]}}}
                 for k, s in ((1, 1.0), (2, 0.9), (3, 0.2))]
    assert report_context._by_noise(synthetic) == ""  # seed 3's longer RECL is mostly a better mean
    assert "by noise: shaw" in report_context._by_noise(synthetic[:2])


def test_the_report_names_the_commits_of_the_plans_versions():
    """The analysis plan's versions are named by the commits that added them (issue 54: the plan's commit named in
    the report), as the study recorded them from git, so a reader can check that they precede the runs."""
    document = runs.read_results(str(pathlib.Path(REPO_ROOT) / "docs" / report.PUBLISHED_NAME / "results.json"))
    recorded = document["studies"]["context"]["by_seed"]["plan_commits"]
    assert sorted(recorded) == sorted(runs.PLAN_PAGES)
    text = report.render(document)
    assert ("Verdicts follow [the analysis plan](study_plan.md) (version 1 committed at `94f7105` on 2026-11-28, "
            "version 2 committed at `16e5a51` on 2026-11-28, version 3 committed at `45d6a89` on 2026-11-28, before "
            "the runs they govern") in text
    here = runs.plan_commits()  # {} outside a git checkout (an installed package, a sandbox)
    assert here in ({}, recorded)
