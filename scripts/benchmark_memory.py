"""Peak memory of a training step, with and without activation recomputation, beside the authors' code.

    python scripts/benchmark_memory.py [--gin_file=gin/enwik8.gin (the default)] [--batch=2 --tgt_len=512 --mem_len=512]
        [--modes=f32,bf16,...] [--recompute=none,block] [--peer=DIR] [--budget_gib=4]

Each row runs in a fresh process: the trainer's step (`txl_tf.training.trainer.Trainer` under the default strategy on an
in-memory batch of random tokens, memory carried from step to step) of the gin file's model (enwik8 base by
default: 12 x 512, 8x64 heads, d_inner 2048, vocabulary 204, dropout 0.1), one warm-up step (tracing included)
and then `--steps` timed steps, in each mode (f32 / bf16 = mixed_bfloat16, `_xla` = jit_compile) with each
`TrainConfig.recompute` value. A row reports:

  peak      on CPU the process's peak resident memory (the child's ru_maxrss, as the kernel counted it; VmHWM);
            on a GPU `tf.config.experimental.get_memory_info("GPU:0")["peak"]` (torch.cuda.max_memory_allocated
            for the peer)
  over base the peak minus the memory the process held once the model and optimizer were built (on CPU the
            resident memory then: the runtime, the weights and Adam's slots), i.e. what the steps added
  tokens/s  the timed steps' tokens over their wall time (so the speed cost of recomputation shows)

--peer=DIR (a directory made by `../shared/peer/setup.sh`): also the authors' PyTorch `MemTransformerLM` of the
same sizes, fp32, driven by a small program of this script (`PEER_CHILD`: it imports their model from DIR/code and
runs Adam steps with gradient clipping at the given batch and lengths; their own train_step.py runs only
tgt_len = mem_len = 512).

--budget_gib=G: for each row, the longest tgt_len = mem_len (a multiple of 64) whose steps fit in G GiB: doubling
from --tgt_len, then bisection, each probe a fresh process of one warm-up and one timed step. A CPU probe fits
when it ends with a peak resident memory within the budget; the parent polls the child's VmRSS and kills it once
it is above the budget, or after --probe_timeout seconds (then the probe counts as not fitting, and says so). On a
GPU the child's allocator is limited to the budget instead (TensorFlow's logical-device memory limit, torch's
per-process memory fraction).

Goals printed against (issue 26): recompute's peak <= 0.5x the peer's at the same setting, its speed at most a
third below the plain step's, and its longest segment in the budget >= 2x the peer's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

# First: txl_tf.base.cli sets TF_CPP_MIN_LOG_LEVEL (and txl_tf the Keras backend) before TensorFlow starts.
from txl_tf.base import cli

# isort: split
from absl import app, flags

from txl_tf import configs
from txl_tf.model.policy import RECOMPUTE
from txl_tf.training.autotune import cpu_model

FLAGS = flags.FLAGS

N_TOKEN = 204  # enwik8's vocabulary (bytes seen in the corpus)
MODES = ("f32", "bf16", "f32_xla", "bf16_xla")
GIB = 1 << 30
POLL_SECONDS = 0.05


def define_flags(flag_values) -> None:
    fv = flag_values
    cli.define(fv, "gin_file", "gin_param")
    flags.DEFINE_list("batch", ["2"], "batch size (one; a list as in scripts/benchmark_model.py)", flag_values=fv)
    flags.DEFINE_integer("tgt_len", 512, "segment length (and the budget search's first length)", flag_values=fv)
    flags.DEFINE_integer("mem_len", None, "memory length (default: --tgt_len)", flag_values=fv)
    flags.DEFINE_integer("steps", 3, "timed steps per row (after one warm-up step)", flag_values=fv)
    flags.DEFINE_list("modes", ["f32"], f"our modes: of {', '.join(MODES)}", flag_values=fv)
    flags.DEFINE_list("recompute", list(RECOMPUTE), "TrainConfig.recompute values, one row per mode each",
                      flag_values=fv)
    flags.DEFINE_list("kernels", ["tf"], "TrainConfig.kernels of our rows without XLA: tf or fused (one)",
                      flag_values=fv)
    flags.DEFINE_string("peer", None, "directory made by ../shared/peer/setup.sh: also the authors' PyTorch code",
                        flag_values=fv)
    flags.DEFINE_float("budget_gib", None, "also find each row's longest tgt_len = mem_len within this many GiB",
                       flag_values=fv)
    flags.DEFINE_integer("max_length", 16384, "the budget search's longest length probed", flag_values=fv)
    flags.DEFINE_integer("probe_timeout", 900, "seconds a probe may run before it is killed (and does not fit)",
                         flag_values=fv)
    flags.DEFINE_string("child", None, "internal: run one row (a JSON spec) and print its result as JSON",
                        flag_values=fv)


# ---- the children ---------------------------------------------------------------------------------------------
def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A memory line of /proc/PID/status (VmRSS, VmHWM) in bytes, or None where there is none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_ours(spec: dict) -> dict:
    """One row of ours in this process: the trainer's steps; {"peak", "baseline", "tokens_per_s", "device"}."""
    import numpy as np
    import tensorflow as tf

    from txl_tf.training.trainer import Trainer

    gpus = tf.config.list_physical_devices("GPU")
    if gpus and spec.get("budget"):  # the allocator refuses what the budget does not hold
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=spec["budget"] // (1 << 20))])
    parsed = configs.parse_configs(spec["gin_file"], spec["gin_param"])
    batch, length, mem_len, mode = spec["batch"], spec["tgt_len"], spec["mem_len"], spec["mode"]
    model_config = dataclasses.replace(parsed.model, mem_len=mem_len)
    train_config = dataclasses.replace(
        parsed.train, batch_size=batch, tgt_len=length, grad_accum_steps=1, eval_every=0, checkpoint_every=0,
        sample_tokens=0, measure_mfu=False, mixed_precision=mode.startswith("bf16"), jit_compile=mode.endswith("xla"),
        kernels="tf" if mode.endswith("xla") else spec["kernels"], recompute=spec["recompute"])
    streams = np.random.default_rng(0).integers(0, N_TOKEN, [batch, length + 1]).astype(np.int32)
    batch_data = tf.data.Dataset.from_tensors((streams[:, :-1], streams[:, 1:])).repeat()
    trainer = Trainer(model_config, train_config, strategy=tf.distribute.get_strategy(), n_token=N_TOKEN,
                      dataset_fn=lambda step: batch_data)
    trainer.start(0)
    if gpus:
        baseline = tf.config.experimental.get_memory_info("GPU:0")["current"]
    else:
        baseline = status_bytes("VmRSS")
    trainer.train_loop(1)  # tracing and the first step
    stats = trainer.train_loop(spec["steps"])
    if not np.isfinite(stats.loss):
        raise RuntimeError(f"the steps' loss is {stats.loss}")
    if gpus:
        peak, device = tf.config.experimental.get_memory_info("GPU:0")["peak"], "GPU"
    else:
        peak, device = status_bytes("VmHWM"), "CPU"
    return {"peak": peak, "baseline": baseline, "tokens_per_s": stats.steps * batch * length / stats.seconds,
            "device": device}


# The peer's row: run by DIR/venv/bin/python in DIR/code with a JSON spec; prints one JSON line like run_ours.
PEER_CHILD = r"""
import json, sys, time
import torch
from mem_transformer import MemTransformerLM

def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

spec = json.loads(sys.argv[1])
gpu = spec["device"] == "GPU" and torch.cuda.is_available()
device = torch.device("cuda" if gpu else "cpu")
if gpu and spec.get("budget"):
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, spec["budget"] / torch.cuda.get_device_properties(0).total_memory))
torch.manual_seed(0)
batch, length, mem_len = spec["batch"], spec["tgt_len"], spec["mem_len"]
model = MemTransformerLM(spec["n_token"], spec["n_layer"], spec["n_head"], spec["d_model"], spec["d_head"],
                         spec["d_inner"], spec["dropout"], spec["dropatt"], tgt_len=length, mem_len=mem_len,
                         ext_len=0).to(device)
with torch.no_grad():  # parameters MemTransformerLM leaves uninitialised (torch.Tensor(...)): ours' initialisers
    for name, parameter in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("r_w_bias", "r_r_bias", "r_emb", "r_bias"):
            parameter.normal_(0.0, spec["init_std"])
        elif "projs" in name:
            parameter.normal_(0.0, spec["proj_init_std"])
optimizer = torch.optim.Adam(model.parameters(), lr=spec["learning_rate"])
model.train()
data = torch.randint(0, spec["n_token"], (length + 1, batch), device=device)  # [L + 1, B]: time first
baseline = torch.cuda.memory_allocated() if gpu else status_bytes("VmRSS")

def step(mems):
    out = model(data[:-1], data[1:], *mems)
    loss, mems = out[0].float().mean(), out[1:]
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip_norm"])
    optimizer.step()
    if not torch.isfinite(loss):
        raise RuntimeError(f"the loss is {loss}")
    return mems

mems = step(())
if gpu:
    torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(spec["steps"]):
    mems = step(mems)
if gpu:
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
peak = torch.cuda.max_memory_allocated() if gpu else status_bytes("VmHWM")
print(json.dumps({"peak": peak, "baseline": baseline, "tokens_per_s": spec["steps"] * batch * length / seconds,
                  "device": "GPU" if gpu else "CPU"}))
"""


# ---- running a child under the budget -----------------------------------------------------------------------
@dataclasses.dataclass
class Probe:
    """What a child did: `result` (its JSON) when it finished, `peak` (bytes: its ru_maxrss, or on a GPU the
    result's), and `problem` (None, or why it has no result: over the budget, too slow, failed)."""

    result: dict | None
    peak: int | None
    problem: str | None = None

    def fits(self, budget: int) -> bool:
        return self.problem is None and self.peak is not None and self.peak <= budget


def run_child(argv: list, cwd: str | None, budget: int | None, timeout: float) -> Probe:
    """Runs `argv`, killing it once its VmRSS is above `budget` bytes (if given) or after `timeout` seconds."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, text=True)
        start, problem = time.monotonic(), None
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:  # ended (and reaped here: `usage` is its own)
                child.returncode = os.waitstatus_to_exitcode(status)
                break
            if problem is None:
                rss = status_bytes("VmRSS", child.pid)
                if budget is not None and rss is not None and rss > budget:
                    problem = f"over the budget (resident {rss / GIB:.2f} GiB; killed)"
                elif time.monotonic() - start > timeout:
                    problem = f"still running after {timeout:.0f} s (killed)"
                if problem:
                    os.kill(child.pid, signal.SIGKILL)
            time.sleep(POLL_SECONDS)
        peak = usage.ru_maxrss * 1024  # KiB on Linux
        if problem:
            return Probe(None, peak, problem)
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        if child.returncode != 0 or not lines:
            tail = err.read().strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
            return Probe(None, peak, f"failed: {tail[0][:300]}")
        result = json.loads(lines[-1])
        return Probe(result, result["peak"] if result["device"] == "GPU" else max(peak, result["peak"]))


@dataclasses.dataclass(frozen=True)
class Row:
    """A table row: ours in `mode` with `recompute`, or the peer (mode "peer")."""

    mode: str
    recompute: str = "none"

    @property
    def label(self) -> str:
        return "peer/fp32" if self.mode == "peer" else f"{self.mode}/{self.recompute}"


def probe(row: Row, length: int, mem_len: int, steps: int, budget: int | None, device: str = "CPU") -> Probe:
    """One row at one length in a fresh process."""
    spec = {"batch": batch_size(), "tgt_len": length, "mem_len": mem_len, "steps": steps, "budget": budget}
    if row.mode == "peer":
        model = configs.parse_configs(gin_files(), FLAGS.gin_param)
        spec.update({name: getattr(model.model, name) for name in
                     ("n_layer", "n_head", "d_model", "d_head", "d_inner", "dropout", "dropatt", "init_std",
                      "proj_init_std")},
                    n_token=N_TOKEN, learning_rate=model.train.learning_rate, clip_norm=model.train.clip_norm,
                    device=device)
        peer = os.path.abspath(FLAGS.peer)
        argv = [os.path.join(peer, "venv", "bin", "python"), "-c", PEER_CHILD, json.dumps(spec)]
        cwd = os.path.join(peer, "code")
    else:
        spec.update(mode=row.mode, recompute=row.recompute, kernels=kernels(), gin_file=gin_files(),
                    gin_param=FLAGS.gin_param)
        argv, cwd = [sys.executable, os.path.abspath(__file__), f"--child={json.dumps(spec)}"], None
    return run_child(argv, cwd, budget if device == "CPU" else None, FLAGS.probe_timeout)


def longest_within(row: Row, budget: int, device: str, log) -> tuple[int, list]:
    """The longest tgt_len = mem_len (a multiple of 64, at most --max_length) whose steps fit in `budget` bytes,
    and the probes made: [(length, fits, peak or None, problem or None)]; 0 when 64 does not fit."""
    probes = []

    def fits(length):
        result = probe(row, length, length, 1, budget, device)
        probes.append((length, result.fits(budget), result.peak, result.problem))
        log(f"  probe {row.label} length {length}: "
            + (f"peak {result.peak / GIB:.2f} GiB" if result.peak else "") + (f" {result.problem}" if result.problem
                                                                              else ""))
        return result.fits(budget)

    low, high = 0, None  # the longest length seen to fit, the shortest seen not to
    length = max(64, FLAGS.tgt_len // 64 * 64)
    if fits(length):  # doubling up
        low = length
        while high is None and low * 2 <= FLAGS.max_length:
            if fits(low * 2):
                low *= 2
            else:
                high = low * 2
        if high is None:
            return low, probes
    else:  # halving down
        high = length
        while low == 0 and high > 64:
            half = max(64, high // 2 // 64 * 64)
            if fits(half):
                low = half
            else:
                high = half
        if low == 0:
            return 0, probes
    while high - low > 64:  # bisection
        middle = (low + high) // 2 // 64 * 64
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, probes


# ---- the parent -------------------------------------------------------------------------------------------------
def cpu_name() -> str:
    """The CPU's model name as lscpu prints it (else /proc/cpuinfo's: `txl_tf.training.autotune.cpu_model`)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:")]
    return names[0] if names else cpu_model()


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


DEFAULT_GIN = ["gin/enwik8.gin"]


def batch_size() -> int:
    """The one --batch value."""
    if len(FLAGS.batch) != 1 or not FLAGS.batch[0].isdigit() or int(FLAGS.batch[0]) < 1:
        raise app.UsageError(f"--batch={','.join(FLAGS.batch)}: give one batch size, e.g. --batch=2")
    return int(FLAGS.batch[0])


def kernels() -> str:
    """The one --kernels value."""
    if len(FLAGS.kernels) != 1 or FLAGS.kernels[0] not in ("tf", "fused"):
        raise app.UsageError(f"--kernels={','.join(FLAGS.kernels)}: give one of tf, fused")
    return FLAGS.kernels[0]


def gin_files() -> list:
    """--gin_file, else the enwik8 base setup."""
    return FLAGS.gin_file or DEFAULT_GIN


def main(argv):
    if FLAGS.child:
        cli.no_arguments(argv)
        print(json.dumps(run_ours(json.loads(FLAGS.child))))
        return
    cli.no_arguments(argv)
    unknown = sorted(set(FLAGS.modes) - set(MODES)) + sorted(set(FLAGS.recompute) - set(RECOMPUTE))
    if unknown:
        raise app.UsageError(f"--modes / --recompute: {', '.join(unknown)} is not one of "
                             f"{', '.join(MODES)} / {', '.join(RECOMPUTE)}")
    if FLAGS.peer and not os.path.exists(os.path.join(FLAGS.peer, "code", "mem_transformer.py")):
        raise app.UsageError(f"--peer={FLAGS.peer} is not a directory made by ../shared/peer/setup.sh (no "
                             "code/mem_transformer.py); run `../shared/peer/setup.sh GIT_DIR DIR` first")
    parsed = configs.parse_configs(gin_files(), FLAGS.gin_param)
    model, mem_len = parsed.model, FLAGS.mem_len or FLAGS.tgt_len
    rows = [Row(mode, recompute) for mode in FLAGS.modes for recompute in FLAGS.recompute]
    rows += [Row("peer")] if FLAGS.peer else []
    print(f"cpu: {cpu_name()} ({os.cpu_count()} cores); load average before: {os.getloadavg()}")
    print(f"model: {', '.join(gin_files())} {' '.join(FLAGS.gin_param)}: {model.n_layer} layers, d_model "
          f"{model.d_model}, {model.n_head}x{model.d_head} heads, d_inner {model.d_inner}, vocabulary {N_TOKEN}, "
          f"dropout {model.dropout}; batch {batch_size()}, tgt_len {FLAGS.tgt_len}, mem_len {mem_len}; "
          f"{FLAGS.steps} timed steps after one warm-up step; our rows: the trainer's step, kernels {kernels()} "
          "(XLA: tf)", flush=True)
    results, device = {}, "CPU"
    for row in rows:
        found = probe(row, FLAGS.tgt_len, mem_len, FLAGS.steps, None, device)
        if found.problem:
            raise RuntimeError(f"{row.label}: {found.problem}")
        results[row] = found
        device = found.result["device"]  # the peer runs where ours ran
    peer = results.get(Row("peer"))
    memory_word = "GPU memory (allocator peak)" if device == "GPU" else "peak resident memory of the process"
    print(f"device: {device}; peak = {memory_word}; over base = peak minus the memory held after the model and "
          "optimizer were built")
    print(f"{'row':14s} {'peak_GiB':>9s} {'over_base_GiB':>14s} {'tokens/s':>9s} {'peak_vs_peer':>13s} "
          f"{'speed_vs_none':>14s}")
    for row, found in results.items():
        plain = results.get(Row(row.mode, "none")) if row.mode != "peer" else None
        print(f"{row.label:14s} {found.peak / GIB:9.3f} {(found.peak - found.result['baseline']) / GIB:14.3f} "
              f"{found.result['tokens_per_s']:9.1f} {_ratio(found.peak, peer and peer.peak):>13s} "
              f"{_ratio(found.result['tokens_per_s'], plain and plain.result['tokens_per_s']):>14s}")
    for mode in FLAGS.modes:
        recomputed, plain = results.get(Row(mode, "block")), results.get(Row(mode, "none"))
        if recomputed and peer:
            ratio = recomputed.peak / peer.peak
            print(f"goal: {mode}/block peak <= 0.5x the peer's: {ratio:.2f}x ({'met' if ratio <= 0.5 else 'not met'})")
        if recomputed and plain:
            cost = 1 - recomputed.result["tokens_per_s"] / plain.result["tokens_per_s"]
            print(f"goal: {mode}/block at most a third slower than {mode}/none: {cost:.0%} slower "
                  f"({'met' if cost <= 1 / 3 else 'not met'})")
    if FLAGS.budget_gib:
        budget = int(FLAGS.budget_gib * GIB)
        print(f"budget {FLAGS.budget_gib:g} GiB: the longest tgt_len = mem_len (a multiple of 64, at most "
              f"{FLAGS.max_length}) whose warm-up and timed step fit, per row", flush=True)
        longest = {row: longest_within(row, budget, device, lambda line: print(line, flush=True))[0]
                   for row in rows}
        print(f"{'row':14s} {'longest':>8s} {'vs_peer':>8s}")
        for row, length in longest.items():
            print(f"{row.label:14s} {length:8d} {_ratio(length, longest.get(Row('peer'))):>8s}")
        for mode in FLAGS.modes:
            if Row(mode, "block") in longest and Row("peer") in longest and longest[Row("peer")]:
                ratio = longest[Row(mode, "block")] / longest[Row("peer")]
                print(f"goal: {mode}/block's longest segment >= 2x the peer's: {ratio:.2f}x "
                      f"({'met' if ratio >= 2 else 'not met'})")
    print(f"load average after: {os.getloadavg()}; peak of this parent: "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20):.2f} GiB")


if __name__ == "__main__":
    cli.run(main, define_flags)
