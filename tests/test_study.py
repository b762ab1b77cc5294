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

from txl_tf.study import ablation, archive, report, runs, studies, tables


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

    # Re-running trains nothing and re-scores nothing; a run whose record and archive are gone resumes at its last
    # checkpoint.
    os.remove(os.path.join(out, "runs", "shaw", runs.RUN_RECORD))
    for path in archive.paths_of(os.path.join(out, "archive"), "ablation_shaw"):
        os.remove(path)
    again = studies.run(["ablation"], out, quick=True, data_root=data_root)["studies"]["ablation"]
    for name in names:
        attempts = json.load(open(os.path.join(out, "runs", name, runs.ATTEMPTS_FILE)))["attempts"]
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


def test_a_claim_over_two_seeds_reads_both_and_is_undecided_when_they_disagree():
    rng = np.random.default_rng(1)
    base = rng.normal(2.0, 0.5, size=2000)
    shift = {"xl": -0.02, "xl_seed2": -0.10, "no_recurrence": 0.0, "no_recurrence_seed2": 0.0}  # nats per token
    block = ablation.QUICK.bootstrap_block
    cells = {name: {("test", 16, -1): archive.Cell.of(base + delta + rng.normal(0, 0.01, size=2000), block)}
             for name, delta in shift.items()}
    seeds = {"xl": ["xl", "xl_seed2"], "no_recurrence": ["no_recurrence", "no_recurrence_seed2"]}
    c = ablation._compare_seeds(cells, seeds, "xl", "no_recurrence", 16, ablation.QUICK, frozenset())
    first, second = (ablation._compare(cells, (x, 16), (y, 16), ablation.QUICK, frozenset())["mean"]
                     for x, y in (("xl", "no_recurrence"), ("xl_seed2", "no_recurrence_seed2")))
    assert c["seeds"] == [first, second]
    assert math.isclose(c["mean"], (first + second) / 2, rel_tol=1e-9)
    assert math.isclose(c["mean"], -0.06 / math.log(2.0), rel_tol=0.05)  # both seeds, not the first alone
    assert c["low"] < c["mean"] < c["high"] < 0 and tables.seeded_verdict(c) == "reproduced"
    assert tables.seeded_verdict({**c, "seeds": [first, -first]}) == "not reproduced (the seeds disagree)"
    assert tables.seeded_verdict({"mean": 0.1, "low": 0.01, "high": 0.2}) == "reversed"  # one seed: the interval


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


def test_candidate_tokens_are_the_first_train_share_numbered_densely():
    from txl_tf.study import corpus_choice

    data = bytes(range(200, 256)) * 10 + b"abc" * 100 + b"z" * 90  # 950 bytes; "z" only in the last 10%
    ids, vocab_size = corpus_choice.candidate_tokens(data, max_tokens=10_000)
    assert ids.size == 855 and vocab_size == 60 and ids.min() == 0 and ids.max() == 59
    assert (np.unique(ids[:560]) == np.arange(4, 60)).all() and ids[560:563].tolist() == [0, 1, 2]
    assert 3 not in ids  # "z" is in the vocabulary but not in the measured 90%
    capped, capped_size = corpus_choice.candidate_tokens(data, max_tokens=100)
    assert capped.tolist() == ids[:100].tolist() and capped_size == 60


def test_readme_block_has_one_row_per_claim_and_a_column_per_corpus():
    """The README's block: the ablation's and PTB's claims one a line; each context claim once, with each corpus'
    own verdict and figure in its column (here a second corpus where Transformer-XL's longer memory hurts)."""
    from txl_tf.study import context, report_context

    document = runs.read_results(str(pathlib.Path(REPO_ROOT) / "docs" / report.PUBLISHED_NAME / "results.json"))
    first = document["studies"]["context"]
    second = json.loads(json.dumps(first))
    second["setup"]["dataset"], second["key"] = "networkx_code", "context_code"
    second["comparisons"]["xl_longer"] = {"mean": 0.0123, "low": 0.0101, "high": 0.0145}
    document["studies"]["context_code"] = second
    block = report.summary(document)
    assert "[networkx_code]" not in block
    general = _table_rows(block, "| claim of the paper |")
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
        assert [row[column].split(": ")[0] for row in rows] == [result for *_, result in expected]
    assert rows[0][1].startswith("reproduced: -") and rows[0][2].startswith("reversed: +0.0123 bpc [+0.0101, +0.0145]")


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
    assert claims[0].startswith("A longer memory at evaluation")
    recl_rows = [c for c in claims if "Transformer-XL has the longest RECL" in c]
    assert recl_rows == ["Transformer-XL has the longest RECL (appendix C, the paper's group)",
                         "[networkx_code] Transformer-XL has the longest RECL (appendix C, the paper's group)"]
    for prefix in ("", "[networkx_code] "):  # RoPE and ALiBi against the paper's encoding, stated either way
        for name in ("RoPE", "ALiBi"):
            row = next(r for r in rows if r[0].startswith(f"{prefix}{name} + recurrence vs. the paper's"))
            assert row[3] in (f"{name.lower()} beats XL", f"{name.lower()} loses to XL",
                              f"{name.lower()} matches XL (within noise)")
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
