r"""Evaluation sweep: one model scored under a grid of Transformer-XL protocols, as one table.

    python -m txl_tf.sweep --model_dir=runs/sample --split=test \
        --grid=tgt_len=64,128 --grid=mem_len=0,160,640 --grid=clamp_len=-1,400 --grid=same_length=true,false
    python -m txl_tf.sweep --checkpoint=converted/wt103 --gin_file=gin/wt103.gin --grid=mem_len=160,640,1600 \
        --markdown=docs/sweep.md --json=sweep.json

Each `--grid=FIELD=v1,v2,...` names an EvalConfig field (tgt_len, mem_len, clamp_len, same_length, batch_size);
every combination is evaluated on the split (the model is loaded once; fields not on the grid keep their
EvalConfig values from model_dir/config.gin, --gin_file and --gin_param, e.g. EvalConfig.max_steps for a quick
look). The markdown table is printed on stdout, ready to paste; the best row is in bold and the row equal to the
configured protocol is marked. Which settings give the published numbers is a question this answers directly:
see docs/released_models.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Sequence

from absl import flags

from txl_tf.base import cli, paths
from txl_tf.base.errors import ConfigError
from txl_tf.configs import check_clamp
from txl_tf.runs import loading, run_dir

AXES = ("tgt_len", "mem_len", "clamp_len", "same_length", "batch_size")
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def parse_grid(specs: Sequence[str]) -> dict:
    """["mem_len=0,160", "same_length=true,false"] -> {"mem_len": [0, 160], "same_length": [True, False]}."""
    grid = {}
    for spec in specs:
        field, sep, values = spec.partition("=")
        field = field.strip()
        if not sep or field not in AXES:
            raise ConfigError(f"--grid={spec!r}: expected FIELD=v1,v2,... with FIELD one of {', '.join(AXES)}")
        if field in grid:
            raise ConfigError(f"--grid names {field} twice; list all its values in one --grid")
        try:
            parsed = [_BOOLEANS[v.strip().lower()] if field == "same_length" else int(v)
                      for v in values.split(",") if v.strip()]
        except (KeyError, ValueError):
            raise ConfigError(f"--grid={spec!r}: {field} takes "
                             + ("true/false" if field == "same_length" else "integers")) from None
        if not parsed:
            raise ConfigError(f"--grid={spec!r} lists no values")
        grid[field] = parsed
    return grid


def protocols(base, grid: dict) -> list:
    """Every combination of the grid's values (in the order given) over the EvalConfig `base`."""
    axes = list(grid)
    return [dataclasses.replace(base, **dict(zip(axes, values, strict=True)))
            for values in itertools.product(*(grid[a] for a in axes))]


def run(model_dir=None, checkpoint=None, *, which="latest", gin_files=(), gin_params=(), split="test",
        grid: dict | None = None, log=None) -> dict:
    """Loads the model once and evaluates `split` under every protocol of `grid`; returns the sweep as a dict
    (`rows` with the protocol fields, loss, metric, tokens, seconds; `config`: the configured protocol)."""
    from txl_tf.data.pipeline import load_vocab, read_split
    from txl_tf.evaluation import loops as evaluation

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    configs = run_dir.read_configs(model_dir, gin_files, gin_params, checkpoint=checkpoint)
    base = configs.eval
    if base.protocol != "xl":
        raise ConfigError(f"the sweep varies the Transformer-XL protocol; EvalConfig.protocol={base.protocol!r}")
    points = protocols(base, grid or {})
    for clamp_len in (grid or {}).get("clamp_len", ()):  # EvalConfig's own was checked with the configs
        check_clamp(configs.model.attn_type, clamp_len, "--grid clamp_len")
    evaluation.check_split(configs.data.data_dir, split, sorted({p.batch_size for p in points}), base.layout,
                           name="batch_size")  # EvalConfig.batch_size or a --grid value
    dtype = None if base.compute_dtype == "float32" else base.compute_dtype
    model, configs, prefix = loading.load_model(model_dir, checkpoint, which=which, gin_files=gin_files,
                                                gin_params=gin_params, dtype=dtype)
    tokens = read_split(configs.data.data_dir, split)
    level = load_vocab(configs.data.data_dir).level
    rows = []
    for index, protocol in enumerate(points, 1):
        result = evaluation.evaluate_tokens(
            model, tokens, tgt_len=protocol.tgt_len, protocol=protocol.attention_protocol(),
            batch_size=protocol.batch_size, max_steps=protocol.max_steps, layout=protocol.layout,
            kv_cache=protocol.kv_cache)
        metric = result.bpc if level == "char" else result.perplexity
        rows.append({**{axis: getattr(protocol, axis) for axis in AXES}, "loss": result.loss, "metric": metric,
                     "tokens": result.num_tokens, "seconds": result.seconds,
                     "configured": all(getattr(protocol, a) == getattr(base, a) for a in AXES)})
        log(f"[{index}/{len(points)}] " + ", ".join(f"{a}={getattr(protocol, a)}" for a in AXES)
            + f": {'bpc' if level == 'char' else 'ppl'} {metric:.4f} ({result.seconds:.1f} s)")
    return {"checkpoint": prefix, "data_dir": configs.data.data_dir, "split": split, "level": level,
            "metric": "bpc" if level == "char" else "ppl", "grid": grid or {},
            "config": {a: getattr(base, a) for a in (*AXES, "max_steps", "layout", "compute_dtype")}, "rows": rows}


def markdown(sweep: dict) -> str:
    """The sweep as a markdown table (best row in bold, the configured protocol marked) with a caption line."""
    metric = sweep["metric"]
    best = min(range(len(sweep["rows"])), key=lambda i: sweep["rows"][i]["loss"]) if sweep["rows"] else -1
    config = sweep["config"]
    caption = (f"{sweep['checkpoint']} on {sweep['split']} of {sweep['data_dir']} "
               f"({sweep['rows'][0]['tokens']:,} tokens scored per row" if sweep["rows"] else "(no rows")
    caption += (f"; layout {config['layout']}, {config['compute_dtype']}"
                + (f", first {config['max_steps']} segments" if config["max_steps"] else "") + ")")
    header = [*AXES, "loss", metric, "tokens/s", ""]
    lines = [caption, "", "| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * (len(header) - 1)) + "|---|"]
    for i, row in enumerate(sweep["rows"]):
        value = f"{row['metric']:.4f}" if metric == "bpc" else f"{row['metric']:.2f}"
        cells = [str(row[a]).lower() if a == "same_length" else str(row[a]) for a in AXES]
        cells += [f"{row['loss']:.4f}", f"**{value}**" if i == best else value,
                  f"{row['tokens'] / row['seconds']:,.0f}" if row["seconds"] > 0 else "",
                  "configured" if row["configured"] else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def define_flags(flag_values) -> None:
    cli.define_model_flags(flag_values)
    flags.DEFINE_string("split", "test", "Split of the prepared data to evaluate.", flag_values=flag_values)
    flags.DEFINE_multi_string("grid", [], "FIELD=v1,v2,... for an EvalConfig field in " + ", ".join(AXES) + ".",
                              flag_values=flag_values)
    flags.DEFINE_string("markdown", None, "Also write the table to this markdown file.", flag_values=flag_values)
    flags.DEFINE_string("json", None, "Also write the sweep (every row and setting) to this JSON file.",
                        flag_values=flag_values)


def main(argv) -> None:
    import logging

    logging.getLogger("tensorflow").setLevel(logging.ERROR)  # retracing warnings: each grid point has new shapes
    fv = flags.FLAGS
    cli.no_arguments(argv)
    if not fv.model_dir and not fv.checkpoint:
        raise ConfigError("give --model_dir (or --checkpoint with --gin_file)")
    for flag in ("markdown", "json"):
        if fv[flag].value:
            paths.output_file(fv[flag].value, f"--{flag}", "sweep.md" if flag == "markdown" else "sweep.json")
    start = time.perf_counter()
    sweep = run(fv.model_dir, fv.checkpoint, which=fv.which, gin_files=fv.gin_file, gin_params=fv.gin_param,
                split=fv.split, grid=parse_grid(fv.grid))
    table = markdown(sweep)
    print(table, end="")
    print(f"{len(sweep['rows'])} evaluations in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if fv.markdown:
        with paths.atomic_file(fv.markdown, encoding="utf-8") as f:
            f.write(table)
    if fv.json:
        with paths.atomic_file(fv.json, encoding="utf-8") as f:
            json.dump(sweep, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    cli.run(main, define_flags, verbosity="error")  # retracing warnings: each grid point has new shapes
