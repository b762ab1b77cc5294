"""The model's own training step on JAX (the layers in keras.ops), on the device JAX has: a lent GPU, or this CPU
(a benchmark, not a test).

    # here: the wheels the GPU machine lacks into FOLDER (inside the repository, ignored by git), the size of what
    # would travel checked against the device tool's 64 MiB, and the command to run there printed (a dry run)
    python scripts/benchmark_jax_step.py --prepare=FOLDER [--cases=...]
    # there (JAX and PyTorch, no TensorFlow), from the repository's root:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site FOLDER/*.whl && \\
        PYTHONPATH=/tmp/site:. KERAS_BACKEND=jax python3 scripts/benchmark_jax_step.py --measure [--peer=PEER]

--measure: for each case (`benchmark_hlo.CASES`: the paper's enwik8 base, its WikiText-103 base, NVIDIA's base) and
mode (f32: float32 weights and compute, XLA's default matmul precision, TF32 on NVIDIA; bf16: Keras's
"mixed_bfloat16" policy), one jitted step of `TransformerXL` on random tokens in a fresh process: the forward
pass with the memory carried from the last step, the mean NLL, its gradient (`jax.value_and_grad` over the model's
variables in a `keras.StatelessScope`), clipping by global norm 0.25 and `keras.optimizers.Adam`'s
`stateless_apply`: what the TensorFlow trainer's step does. It prints seconds per step (the median of --steps
after 2 untimed), tokens/s, TFLOP/s and MFU (`txl_tf.model.flops`: 3 x the forward matmuls) against the square
matmul peak measured in the same run (`benchmark_hlo`'s), the device memory XLA assigns the step, and the loss
beside ln(vocabulary) (random weights: the loss must be near it). `--peer=DIR` also times the authors' PyTorch
code of the same case and batch on the same device (`benchmark_hlo.py --child=peer`), fwd+bwd and the whole step.

No TensorFlow runs here: the script refuses to start if anything imported it (the layers' TensorFlow-only parts,
the fused CPU kernels and recomputation, are not on this path).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")  # before txl_tf (which would choose TensorFlow) and keras

# isort: split
from absl import flags

from txl_tf.base import cli, paths
from txl_tf.base.errors import UserError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_hlo  # noqa: E402  (the cases, the matmul peak, the peer)

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRY_LIMIT = 64 << 20  # what the device tool carries: the working tree and the carried paths together
# What the GPU machine's image lacks of Keras's requirements (its list: absl-py, h5py, ml-dtypes, numpy, packaging,
# rich are there): pinned to the versions this checkout runs with.
WHEELS = ("keras", "namex", "optree")


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_string("prepare", None, "here: download the wheels the device lacks into this folder (inside the "
                        "repository, ignored by git) and print the command to run there", flag_values=fv)
    flags.DEFINE_bool("measure", False, "time the step on JAX's first device", flag_values=fv)
    flags.DEFINE_list("cases", ["enwik8_base", "wt103_nvbase"], f"of {sorted(benchmark_hlo.CASES)}", flag_values=fv)
    flags.DEFINE_list("modes", ["bf16", "f32"], "f32 and/or bf16 (mixed_bfloat16)", flag_values=fv)
    flags.DEFINE_list("batches", [], "batch sizes instead of each case's own (empty: the case's)", flag_values=fv)
    flags.DEFINE_integer("steps", 10, "timed steps (after 2 untimed); the median counts", lower_bound=1,
                         upper_bound=1000, flag_values=fv)
    flags.DEFINE_integer("matmul_size", 8192, "square matmul size for the peak", lower_bound=16, upper_bound=32768,
                         flag_values=fv)
    flags.DEFINE_string("peer", None, "a directory made by ../shared/peer/setup.sh: also time the authors' PyTorch "
                        "code", flag_values=fv)
    flags.DEFINE_string("child", None, "internal: time one case:mode:batch in this process, print JSON",
                        flag_values=fv)


def _model(case: str, mode: str):
    """The case's TransformerXL (random weights: keras.utils.set_random_seed would import TensorFlow where it is
    installed) and its keyword arguments."""
    from txl_tf.model.transformer_xl import TransformerXL

    arch, _, length = benchmark_hlo.CASES[case]
    kwargs = dict(arch, mem_len=length, dropout=0.1, dropatt=0.0, untie_r=case.startswith("wt103"))
    return TransformerXL(**kwargs, dtype="mixed_bfloat16" if mode == "bf16" else "float32"), kwargs


def stateless_step(model, optimizer, inputs, targets):
    """The training step as a pure function for `jax.jit`: step(weights, non-trainable values, optimizer slots,
    memory) -> (the new four, loss): the forward pass with the memory, the mean NLL, `jax.value_and_grad` over the
    weights in a `keras.StatelessScope`, clipping by global norm 0.25, `optimizer.stateless_apply` (built)."""
    import jax
    import jax.numpy as jnp
    import keras

    from txl_tf.model.state import Memory

    trainable, other = model.trainable_variables, model.non_trainable_variables

    def loss_fn(weights, others, memory):
        mapping = [*zip(trainable, weights, strict=True), *zip(other, others, strict=True)]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            hidden, state = model(inputs, Memory(memory), training=True)
            loss = jnp.mean(model.nll(hidden, targets))
        updated = [scope.get_current_value(v) for v in other]
        others = [o if u is None else u for o, u in zip(others, updated, strict=True)]
        return loss, (others, state.hidden.astype(memory.dtype))

    def step(weights, others, slots, memory):
        (loss, (others, memory)), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights, others, memory)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads))
        grads = [g * jnp.minimum(1.0, 0.25 / (norm + 1e-6)) for g in grads]
        weights, slots = optimizer.stateless_apply(slots, grads, weights)
        return weights, others, slots, memory, loss

    return step


def child_step(case: str, mode: str, batch: int, steps: int) -> dict:
    """Builds the case's model on JAX and times its jitted training step (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np

    from txl_tf.model.flops import model_flops_per_token
    from txl_tf.model.state import Memory

    if keras.backend.backend() != "jax":
        raise UserError(f"KERAS_BACKEND is {keras.backend.backend()!r}; this benchmark runs the layers on JAX")
    arch, _, length = benchmark_hlo.CASES[case]
    model, kwargs = _model(case, mode)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, arch["n_token"], (batch, length + 1)), jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    memory = model.initial_memory(batch).hidden
    model(inputs[:, :1], Memory(memory))  # builds every weight
    if "tensorflow" in sys.modules:
        raise UserError("something imported TensorFlow: this benchmark times the layers on JAX alone")
    optimizer = keras.optimizers.Adam(2.5e-4)
    optimizer.build(model.trainable_variables)
    trainable, other = model.trainable_variables, model.non_trainable_variables
    step = stateless_step(model, optimizer, inputs, targets)
    state = ([v.value for v in trainable], [v.value for v in other], [v.value for v in optimizer.variables], memory)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(*state).compile()
    compile_seconds = time.perf_counter() - start
    memory_stats = compiled.memory_analysis()
    times, losses = [], []
    for i in range(steps + 2):
        start = time.perf_counter()
        *state, loss = compiled(*state)
        losses.append(float(loss))  # waits for the step
        if i >= 2:
            times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    flops = model_flops_per_token(**kwargs, tgt_len=length, batch_size=batch) * batch * length
    device = jax.devices()[0]
    used = None
    if memory_stats is not None:
        used = (memory_stats.argument_size_in_bytes + memory_stats.output_size_in_bytes
                + memory_stats.temp_size_in_bytes)
    return dict(seconds=seconds, compile_seconds=compile_seconds, tokens=batch * length, flops_per_step=flops,
                loss=losses[0], memory=used, device=str(getattr(device, "device_kind", device)),
                parameters=int(sum(math.prod(v.shape) for v in trainable)))


HLO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark_hlo.py")


def time_all(cases: list, modes: list, batches: list, steps: int, size: int, peer: str | None) -> None:
    peaks = benchmark_hlo.run_child(HLO, "--child=peaks", f"--matmul_size={size}")
    print(f"device: {peaks['device']} (JAX {peaks['jax']}); matmul peak {peaks['bf16'] / 1e12:.3g} TFLOP/s bf16, "
          f"{peaks['f32'] / 1e12:.3g} TFLOP/s f32 at default precision ({size}^3)", flush=True)
    print(f"{'case':<14} {'mode':<5} {'batch':>5} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'memory GB':>9} {'loss':>6} {'at 0':>5}" + ("  peer fwd+bwd tok/s, step tok/s   ours/peer" if peer else ""))
    for case, rows in ((c, b) for c in cases for b in (batches or [benchmark_hlo.CASES[c][1]])):
        arch = benchmark_hlo.CASES[case][0]
        theirs = {}
        if peer:
            runs = benchmark_hlo.run_child(HLO, f"--child=peer:{case}:{rows}", f"--peer={peer}",
                                           f"--steps={min(steps, 10)}")
            theirs = {(r["mode"], r["whole"]): r for r in runs}
        for mode in modes:
            got = benchmark_hlo.run_child(__file__, f"--child={case}:{mode}:{rows}", f"--steps={steps}",
                                          KERAS_BACKEND="jax")
            flops = got["flops_per_step"] / got["seconds"]
            memory = f"{got['memory'] / 1e9:9.2f}" if got["memory"] else f"{'-':>9}"
            line = (f"{case:<14} {mode:<5} {rows:>5} {got['seconds']:8.4f} {got['tokens'] / got['seconds']:10,.0f} "
                    f"{flops / 1e12:8.3g} {flops / peaks[mode]:6.1%} {memory} {got['loss']:6.3f} "
                    f"{benchmark_hlo.zero_logit_nll(arch['n_token'], list(arch['cutoffs'])):5.2f}")
            if peer:
                fwd, whole = theirs[(mode, False)], theirs[(mode, True)]
                line += (f"  {fwd['tokens'] / fwd['seconds']:12,.0f} {whole['tokens'] / whole['seconds']:10,.0f}"
                         f"   {whole['seconds'] / got['seconds']:5.2f}x")
            print(line, flush=True)
    print("ours: TransformerXL's layers on JAX, one jitted step: forward with the memory, mean NLL, gradient, "
          "clipping, Adam; memory: XLA's buffer assignment of the step; loss: the first step's, at 0: uniform "
          "targets' NLL at zero logits")
    if peer:
        print("peer: the authors' PyTorch MemTransformerLM (fp32 with TF32 matmuls / bf16 autocast); ours/peer: their "
              "whole step's time over ours")


def _git_files() -> list:
    out = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    return [name for name in out.split("\0") if name]


def prepare(folder: str) -> None:
    """Downloads the wheels of WHEELS (this checkout's versions, for the device's Python 3.12 on x86-64) into
    `folder`, checks that they and the working tree fit the device tool's 64 MiB, and prints the command."""
    from importlib import metadata

    text = paths.output_dir(folder, "--prepare")
    inside = os.path.relpath(os.path.abspath(text), REPO)
    if inside.startswith(".."):
        raise UserError(f"--prepare={folder} is outside the repository; the device tool carries only paths inside it")
    ignored = subprocess.run(["git", "-C", REPO, "check-ignore", "-q", inside + "/"]).returncode == 0
    if not ignored:
        raise UserError(f"--prepare={folder} is not ignored by git: add it to .git/info/exclude (or choose an "
                        "ignored folder) so that the wheels travel only when carried")
    os.makedirs(text, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [f"--platform=manylinux{tag}_x86_64" for tag in ("_2_28", "_2_27", "_2_17", "2014", "1")]
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "--python-version=3.12", "--implementation=cp", *platforms, "-d", text, *pins],
                          capture_output=True, text=True)
    if proc.returncode:
        raise UserError(f"pip download {' '.join(pins)} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    wheels = sorted(name for name in os.listdir(text) if name.endswith(".whl"))
    carried = sum(os.path.getsize(os.path.join(text, name)) for name in wheels)
    tree = sum(os.path.getsize(os.path.join(REPO, name)) for name in _git_files()
               if os.path.isfile(os.path.join(REPO, name)))
    print(f"wheels in {inside}: {', '.join(wheels)} ({carried / 2**20:.1f} MiB)")
    print(f"working tree {tree / 2**20:.1f} MiB + wheels {carried / 2**20:.1f} MiB = "
          f"{(tree + carried) / 2**20:.1f} MiB of the device tool's {CARRY_LIMIT >> 20} MiB")
    if tree + carried > CARRY_LIMIT:
        raise UserError(f"the working tree and the wheels come to {(tree + carried) / 2**20:.1f} MiB, over "
                        f"{CARRY_LIMIT >> 20} MiB: carry less")
    cases = ",".join(FLAGS.cases)
    print(f"carry: [{inside!r}]; command there:\n  python3 -m pip install -q --no-index --no-deps --no-compile "
          f"--target /tmp/site {inside}/*.whl && PYTHONPATH=/tmp/site:. KERAS_BACKEND=jax PYTHONUNBUFFERED=1 "
          f"python3 scripts/benchmark_jax_step.py --measure --cases={cases} --modes={','.join(FLAGS.modes)}")


def main(argv) -> None:
    cli.no_arguments(argv)
    if FLAGS.child:
        case, mode, batch = FLAGS.child.split(":")
        print(json.dumps(child_step(case, mode, int(batch), FLAGS.steps)))
        return
    unknown = sorted(set(FLAGS.cases) - set(benchmark_hlo.CASES)) + sorted(set(FLAGS.modes) - {"f32", "bf16"})
    if unknown:
        raise UserError(f"--cases/--modes: unknown {unknown}; cases are {sorted(benchmark_hlo.CASES)}, modes f32, bf16")
    if (FLAGS.prepare is None) == (not FLAGS.measure):
        raise UserError("give exactly one of --prepare=FOLDER (here) and --measure (on the device)")
    if FLAGS.prepare is not None:
        prepare(FLAGS.prepare)
    else:
        if FLAGS.peer:
            benchmark_hlo._peer_code(FLAGS.peer)
        time_all(FLAGS.cases, FLAGS.modes, list(benchmark_hlo.batch_sizes(FLAGS.batches)), FLAGS.steps,
                 FLAGS.matmul_size, FLAGS.peer)


if __name__ == "__main__":
    cli.run(main, define_flags)
