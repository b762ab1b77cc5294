"""The training step's speed and memory on an accelerator that has XLA but no TensorFlow (a benchmark, not a test).

    # here, with TensorFlow: write the XLA programs of the trainer's gradient step
    python scripts/benchmark_hlo.py --dump=DIR [--cases=enwik8_base,wt103_base,wt103_nvbase] [--modes=f32,bf16]
    # there, with JAX (and PyTorch for --peer) but no TensorFlow, from the repository's root:
    PYTHONPATH=. python3 scripts/benchmark_hlo.py --time=DIR [--steps=20] [--peer=PEER_DIR]

Why: TensorFlow's wheel (over 500 MB, built for one CUDA) cannot travel to a machine whose Python image has JAX and
PyTorch but no TensorFlow. The program XLA compiles for our step can: it is the same HLO whichever framework hands
it to XLA.

--dump: builds each case's `txl_tf.training.trainer.timing_trainer` on the XLA path (mode f32: float32; bf16:
mixed_bfloat16) and writes the HLO of its compiled gradient function (`txl_tf.training.trainer.gradient_hlo`: the
forward pass with the memory, the token-weighted NLL and the backward pass; the clipping and the Adam update run
outside XLA in the trainer and are not in it) as a serialized HloModuleProto per case and mode, and `meta.json`
(tokens and matmul FLOPs per step from `txl_tf.model.flops`). Two rewrites make the module load in a current XLA and
time the same inputs again: each `copy` instruction is replaced by its operand (the HLO-to-StableHLO import of
newer XLA refuses `copy`), and the input/output aliasing (the dropout streams' seeds, updated in place) is
cleared. DIR is replaced whole only when it holds an earlier dump (--overwrite).

--time: in a child process per module (so each memory figure is its own), measures the device's square-matmul
peak (bfloat16, and float32 at XLA's default precision, TF32 on NVIDIA GPUs), compiles each module with JAX's XLA
client, feeds random inputs (tokens in range, every float N(0, 0.02)) and prints: seconds per step (median of
--steps after 2 untimed), tokens/s, matmul TFLOP/s and MFU against the measured peak of the mode's precision, the
step's device memory from XLA's buffer assignment (arguments + outputs + temporaries), and the NLL per token beside
the NLL of uniform targets at zero logits ("at 0": ln(vocabulary), or its adaptive-softmax form), which it must be
near for such small weights (the layer norms' scales are drawn too): a check that the program computed the loss.

--peer=PEER_DIR (a directory made by `../shared/peer/setup.sh`; its code/ folder is imported, its venv is not
needed): also times the authors' PyTorch MemTransformerLM of each case on the same device: forward + backward,
and the whole step with clip_grad_norm_ and Adam, float32 with TF32 matmuls allowed and bfloat16 autocast, with
PyTorch's peak allocated memory; its weights are drawn close to how the authors' train.py initialises them
(normal 0.02, zero biases, unit layer-norm scales; that code is not in their model's file). Ours / theirs compares our fwd+bwd with
theirs.

Cases: enwik8_base (the paper's: 12 layers, d_model 512, tgt_len = mem_len = 512, batch 22), wt103_base (the
paper's: 16 layers, d_model 410, 10 x 41 heads, adaptive softmax, tgt_len = mem_len = 150, batch 60) and
wt103_nvbase (NVIDIA DeepLearningExamples' base: d_model 512, 8 x 64 heads, d_inner 2048, tgt_len = mem_len = 192,
32 per GPU, the setting of its published throughput table).
"""

from __future__ import annotations

import gc
import gzip
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
import zlib

# First: txl_tf.base.cli quiets TensorFlow's start-up (when --dump imports it) and runs main with one-line errors.
from txl_tf.base import cli

# isort: split
from absl import flags

from txl_tf.base import paths, untrusted
from txl_tf.base.errors import UserError

FLAGS = flags.FLAGS
KIND = "hlo benchmark"
MODES = ("f32", "bf16")
ENWIK8 = dict(n_token=204, n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, cutoffs=(), div_val=1)
WT103 = dict(n_token=267735, n_layer=16, d_model=410, n_head=10, d_head=41, d_inner=2100,
             cutoffs=(20000, 40000, 200000), div_val=1)
CASES = {  # name: (architecture, batch, tgt_len = mem_len)
    "enwik8_base": (ENWIK8, 22, 512),
    "wt103_base": (WT103, 60, 150),
    "wt103_nvbase": (dict(WT103, d_model=512, n_head=8, d_head=64, d_inner=2048, cutoffs=(19997, 39997, 199997)),
                     32, 192),
    "tiny": (dict(ENWIK8, n_layer=1, n_token=1000, cutoffs=(100, 400)), 4, 16),  # for the test
}
MODULE_LIMIT = 1 << 30  # one serialized module; enwik8_base's is ~32 MB
META_LIMIT = 1 << 20


def define_flags(flag_values) -> None:
    fv = flag_values
    flags.DEFINE_string("dump", None, "write the XLA programs to this folder (needs TensorFlow)", flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "--dump may replace an earlier dump in its folder", flag_values=fv)
    flags.DEFINE_list("cases", ["enwik8_base", "wt103_base", "wt103_nvbase"], f"--dump: of {sorted(CASES)}",
                      flag_values=fv)
    flags.DEFINE_list("modes", list(MODES), "--dump: f32 and/or bf16 (mixed_bfloat16)", flag_values=fv)
    flags.DEFINE_string("time", None, "time the programs of this folder (needs JAX, not TensorFlow)", flag_values=fv)
    flags.DEFINE_integer("steps", 20, "--time: timed steps per module (after 2 untimed); the median counts",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("matmul_size", 8192, "--time: square matmul size for the peak", lower_bound=16,
                         flag_values=fv)
    flags.DEFINE_string("peer", None, "--time: directory made by ../shared/peer/setup.sh: also time the authors' "
                        "PyTorch code on the same device", flag_values=fv)
    flags.DEFINE_string("child", None, "internal: time one thing in this process and print it as JSON",
                        flag_values=fv)


# ---- --dump (TensorFlow) ---------------------------------------------------------------------------------------
def strip_module(blob: bytes) -> bytes:
    """The module with each `copy` replaced by its operand and without input/output aliasing (see the docstring)."""
    from tensorflow.compiler.xla.service import hlo_pb2

    module = hlo_pb2.HloModuleProto()
    module.ParseFromString(blob)
    module.ClearField("input_output_alias")
    for computation in module.computations:
        source = {}
        for instruction in computation.instructions:
            if instruction.opcode == "copy":
                operand = instruction.operand_ids[0]
                source[instruction.id] = source.get(operand, operand)
        if not source:
            continue
        kept = [i for i in computation.instructions if i.id not in source]
        for instruction in kept:
            instruction.operand_ids[:] = [source.get(o, o) for o in instruction.operand_ids]
        computation.root_id = source.get(computation.root_id, computation.root_id)
        del computation.instructions[:]
        computation.instructions.extend(kept)
    return module.SerializeToString()


def dump(folder: str, cases: list, modes: list, overwrite: bool = False) -> None:
    import keras

    from txl_tf.base import staging
    from txl_tf.configs import ModelConfig, TrainConfig
    from txl_tf.model.flops import config_flops_per_token
    from txl_tf.training import autotune
    from txl_tf.training import trainer as trainer_lib

    meta = {}
    with staging.staged_dir(folder, kind=KIND, name="--dump", overwrite=overwrite) as tmp:
        for case in cases:
            arch, batch, length = CASES[case]
            kwargs = dict(arch, mem_len=length, dropout=0.1, dropatt=0.0, untie_r=case.startswith("wt103"))
            for mode in modes:
                keras.utils.set_random_seed(0)
                path = autotune.TrainPath(mode == "bf16", True, "tf")
                trainer = trainer_lib.timing_trainer(kwargs, TrainConfig(tgt_len=length), batch, path)
                blob = trainer_lib.gradient_hlo(trainer)
                name = f"{case}_{mode}"
                with open(os.path.join(tmp, f"{name}.pb.gz"), "wb") as f:
                    f.write(gzip.compress(strip_module(blob), mtime=0))
                per_token = config_flops_per_token(ModelConfig(**kwargs), arch["n_token"], tgt_len=length,
                                                   batch_size=batch)
                meta[name] = dict(case=case, mode=mode, batch=batch, tgt_len=length, mem_len=length,
                                  n_token=arch["n_token"], cutoffs=list(arch["cutoffs"]), tokens=batch * length,
                                  flops_per_step=per_token * batch * length, parameters=trainer.num_parameters())
                print(f"{name}: {len(blob) / 1e6:.1f} MB of HLO, {trainer.num_parameters():,} parameters, "
                      f"{meta[name]['flops_per_step'] / 1e12:.2f} TFLOP per step", flush=True)
                del trainer
                gc.collect()  # a Trainer is a reference cycle (its tf.functions): free its weights before the next
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    print(f"wrote {len(meta)} modules to {folder}; time them with: PYTHONPATH=. python3 scripts/benchmark_hlo.py "
          f"--time={folder}")


# ---- --time (JAX; PyTorch for the peer) -----------------------------------------------------------------------
def _positive_int(entry: dict, key: str, what: str, limit: int = 1 << 40) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise UserError(f"{what}: {key}={value!r} is not a positive integer; write the folder again with --dump")
    return value


def read_meta(folder: str) -> dict:
    """meta.json of a dump, schema-checked: {name: entry}; each module file is a plain name in `folder`."""
    path = os.path.join(paths.given(folder, "--time"), "meta.json")
    if not os.path.isfile(path):
        raise UserError(f"--time={folder} holds no meta.json; write it with --dump={folder} where TensorFlow runs")
    meta = untrusted.load_json(path, max_bytes=META_LIMIT, what=f"{path}")
    if not isinstance(meta, dict) or not meta:
        raise UserError(f"{path} is not a non-empty object of modules; write the folder again with --dump")
    for name, entry in meta.items():
        what = f"{path}, module {name!r}"
        if not re.fullmatch(r"[a-z0-9_]+", name) or not isinstance(entry, dict) or entry.get("mode") not in MODES \
                or entry.get("case") not in CASES:
            raise UserError(f"{what} is not a module written by --dump (name, mode, case); write the folder again")
        for key in ("batch", "tgt_len", "mem_len", "n_token", "tokens", "parameters"):
            _positive_int(entry, key, what)
        cutoffs = entry.get("cutoffs")
        if not isinstance(cutoffs, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in cutoffs) \
                or sorted(set(cutoffs)) != cutoffs or (cutoffs and not 0 < cutoffs[0] <= cutoffs[-1] < entry["n_token"]):
            raise UserError(f"{what}: cutoffs={cutoffs!r} are not increasing token ids below n_token; write the "
                            "folder again with --dump")
        flops = entry.get("flops_per_step")
        if not isinstance(flops, (int, float)) or not math.isfinite(flops) or flops <= 0:
            raise UserError(f"{what}: flops_per_step={flops!r} is not a positive number; write the folder again")
    return meta


def read_module(folder: str, name: str) -> bytes:
    """The serialized module `name` of a dump: its gzip file read within MODULE_LIMIT, and inflated within it."""
    path = os.path.join(folder, f"{name}.pb.gz")
    packed = untrusted.read_bytes(path, max_bytes=MODULE_LIMIT, what=f"the module {name}")
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip
    try:
        blob = inflate.decompress(packed, MODULE_LIMIT)
    except zlib.error as e:
        raise UserError(f"{path} is not a gzip file ({e}); write the folder again with --dump") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise UserError(f"{path} inflates past {MODULE_LIMIT >> 20} MiB or is cut short; write the folder again with "
                        "--dump")
    return blob


def zero_logit_nll(n_token: int, cutoffs: list) -> float:
    """The mean NLL of uniformly drawn targets when every logit is 0: ln(vocabulary) for a full softmax; with an
    adaptive softmax, ln(head size) plus, for a tail cluster's token, ln(cluster size)."""
    bounds = [0, *cutoffs, n_token]
    head = bounds[1] + len(cutoffs)
    total = 0.0
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        total += (hi - lo) / n_token * (math.log(head) + (math.log(hi - lo) if i else 0.0))
    return total


def _peak(jax, jnp, dtype, n: int) -> float:
    import numpy as np

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)) / n**0.5, dtype)
    product = jax.jit(lambda x: x @ x)
    product(a).block_until_ready()
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(10):
            out = product(a)
        out.block_until_ready()
        best = max(best, 20 * n**3 / (time.perf_counter() - start))
    return best


def child_peaks(size: int) -> dict:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    return dict(bf16=_peak(jax, jnp, jnp.bfloat16, size), f32=_peak(jax, jnp, jnp.float32, size),
                device=str(getattr(device, "device_kind", device)), jax=jax.__version__)


def child_module(folder: str, name: str, steps: int) -> dict:
    """Compiles and times one module on JAX's first device."""
    import jax
    import numpy as np
    from jax._src.lib import xla_client

    jax.config.update("jax_enable_x64", True)  # the dropout seeds are int64
    entry = read_meta(folder)[name]
    blob = read_module(folder, name)
    device = jax.devices()[0]
    computation = xla_client.XlaComputation(blob)
    if "custom-call" in computation.as_hlo_text():  # a call into code outside XLA's own ops: not what --dump writes
        raise UserError(f"the module {name} in {folder} calls custom code; time only what --dump writes")
    shapes = computation.program_shape().parameter_shapes()
    needed = sum(math.prod(s.dimensions()) * np.dtype(s.numpy_dtype()).itemsize for s in shapes)
    if needed > untrusted.machine_memory() // 2:
        raise UserError(f"the module {name} in {folder} takes {untrusted.size_text(needed)} of inputs, over half "
                        "this machine's memory; write the folder again with --dump")
    start = time.perf_counter()
    executable = device.client.compile_and_load(xla_client._xla.mlir.hlo_to_stablehlo(blob),
                                                xla_client.DeviceList((device,)), xla_client.CompileOptions())
    compile_seconds = time.perf_counter() - start
    rng = np.random.default_rng(0)
    arguments = []
    for shape in shapes:
        dims, dtype = shape.dimensions(), shape.numpy_dtype()
        if np.issubdtype(dtype, np.integer):
            value = rng.integers(0, entry["n_token"], dims).astype(dtype)
        else:
            value = (rng.standard_normal(dims) * 0.02).astype(dtype)
        arguments.append(jax.device_put(value, device))

    def step():
        outputs = executable.execute_sharded(arguments).disassemble_into_single_device_arrays()
        for [array] in outputs:
            array.block_until_ready()
        return outputs

    nll_sum = float(np.asarray(step()[0][0]))
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    memory = executable.get_compiled_memory_stats()
    return dict(seconds=seconds, compile_seconds=compile_seconds, nll_per_token=nll_sum / entry["tokens"],
                memory=memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes,
                device=str(getattr(device, "device_kind", device)))


def _peer_code(peer: str) -> str:
    code = os.path.join(paths.given(peer, "--peer"), "code")
    if not os.path.isfile(os.path.join(code, "mem_transformer.py")):
        raise UserError(f"--peer={peer} is not a directory made by ../shared/peer/setup.sh (no code/"
                        "mem_transformer.py); run `../shared/peer/setup.sh GIT_DIR DIR` first")
    return code


def child_peer(peer: str, case: str, steps: int) -> list:
    """The authors' MemTransformerLM of `case` on PyTorch's first device: one row per precision and step kind."""
    code = _peer_code(peer)
    sys.path[:0] = [code, os.path.join(code, "utils")]
    import torch
    from mem_transformer import MemTransformerLM

    arch, batch, length = CASES[case]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True  # XLA's default precision on NVIDIA GPUs, and NVIDIA's TF32 rows
    torch.manual_seed(0)
    model = MemTransformerLM(
        arch["n_token"], arch["n_layer"], arch["n_head"], arch["d_model"], arch["d_head"], arch["d_inner"], 0.1, 0.0,
        div_val=arch["div_val"], tie_projs=[False] + [True] * len(arch["cutoffs"]), tgt_len=length, mem_len=length,
        ext_len=0, cutoffs=list(arch["cutoffs"])).to(device)
    with torch.no_grad():  # near the authors' train.py: N(0, 0.02) weights, zero biases, unit LN scales
        for name, parameter in model.named_parameters():
            if "layer_norm" in name:
                parameter.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias") and parameter.dim() == 1:
                parameter.zero_()
            else:
                parameter.normal_(0.0, 0.02)
    optimizer = torch.optim.Adam(model.parameters(), lr=2.5e-4)
    model.train()
    data = torch.randint(0, arch["n_token"], (length, batch), device=device)
    target = torch.randint(0, arch["n_token"], (length, batch), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for mode in MODES:
        for whole in (False, True):
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            mems, times = (), []
            for _ in range(steps + 2):
                sync()
                start = time.perf_counter()
                with torch.autocast(device, dtype=torch.bfloat16, enabled=mode == "bf16"):
                    out = model(data, target, *mems)
                loss, mems = out[0].float().mean(), [m.detach() for m in out[1:]]
                optimizer.zero_grad()
                loss.backward()
                if whole:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
                    optimizer.step()
                sync()
                times.append(time.perf_counter() - start)
            seconds = sorted(times[2:])[len(times[2:]) // 2]
            rows.append(dict(mode=mode, whole=whole, seconds=seconds, tokens=batch * length,
                             memory=torch.cuda.max_memory_allocated() if device == "cuda" else None,
                             nll_per_token=float(loss.detach())))
    return rows


def _child(*args: str) -> object:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # each child's memory is its own
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, capture_output=True,
                          text=True)
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"{' '.join(args)} failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_all(folder: str, steps: int, size: int, peer: str | None) -> None:
    meta = read_meta(folder)
    if peer:
        _peer_code(peer)
    peaks = _child("--child=peaks", f"--matmul_size={size}")
    print(f"device: {peaks['device']} (JAX {peaks['jax']}); matmul peak {peaks['bf16'] / 1e12:.3g} TFLOP/s bf16, "
          f"{peaks['f32'] / 1e12:.3g} TFLOP/s f32 at default precision ({size}^3)", flush=True)
    theirs = {}
    header = (f"{'module':<20} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'memory GB':>9} "
              f"{'NLL/tok':>7} {'at 0':>5}" + ("  peer fwd+bwd tok/s, step tok/s, GB   ours/peer" if peer else ""))
    print(header)
    for name, entry in meta.items():
        got = _child(f"--child=module:{name}", f"--time={folder}", f"--steps={steps}")
        flops = entry["flops_per_step"] / got["seconds"]
        line = (f"{name:<20} {got['seconds']:8.4f} {entry['tokens'] / got['seconds']:10,.0f} {flops / 1e12:8.3g} "
                f"{flops / peaks[entry['mode']]:6.1%} {got['memory'] / 1e9:9.2f} {got['nll_per_token']:7.3f} "
                f"{zero_logit_nll(entry['n_token'], entry['cutoffs']):5.2f}")
        if peer:
            if entry["case"] not in theirs:
                theirs[entry["case"]] = _child(f"--child=peer:{entry['case']}", f"--peer={peer}",
                                               f"--steps={min(steps, 10)}")
            rows = {(r["mode"], r["whole"]): r for r in theirs[entry["case"]]}
            fwd, whole = rows[(entry["mode"], False)], rows[(entry["mode"], True)]
            peer_memory = f"{whole['memory'] / 1e9:.2f}" if whole["memory"] else "-"
            line += (f"  {fwd['tokens'] / fwd['seconds']:12,.0f} {whole['tokens'] / whole['seconds']:10,.0f} "
                     f"{peer_memory:>6}   {fwd['seconds'] / got['seconds']:5.2f}x")
        print(line, flush=True)
    print("ours: the trainer's XLA gradient program (forward, NLL, backward; no clipping or Adam); memory: XLA's "
          "buffer assignment (arguments + outputs + temporaries); NLL/tok: the step's, at 0: uniform targets' "
          "NLL at zero logits")
    if peer:
        print("peer: the authors' PyTorch MemTransformerLM, fp32 (TF32 matmuls) / bf16 autocast; step = with "
              "clip_grad_norm_ and Adam; GB: PyTorch's peak allocated; ours/peer: fwd+bwd time ratio (theirs / ours)")


def main(argv) -> None:
    cli.no_arguments(argv)
    if FLAGS.child:
        kind, _, name = FLAGS.child.partition(":")
        if kind == "peaks":
            result = child_peaks(FLAGS.matmul_size)
        elif kind == "module":
            result = child_module(FLAGS.time, name, FLAGS.steps)
        else:
            result = child_peer(FLAGS.peer, name, FLAGS.steps)
        print(json.dumps(result))
        return
    if (FLAGS.dump is None) == (FLAGS.time is None):
        raise UserError("give exactly one of --dump=DIR (write the programs, with TensorFlow) and --time=DIR (time "
                        "them, with JAX)")
    if FLAGS.dump is not None:
        unknown = sorted(set(FLAGS.cases) - set(CASES)) + sorted(set(FLAGS.modes) - set(MODES))
        if unknown:
            raise UserError(f"--cases/--modes: unknown {unknown}; cases are {sorted(CASES)}, modes {list(MODES)}")
        paths.replaceable_dir(FLAGS.dump, "--dump", kind=KIND, overwrite=FLAGS.overwrite)
        dump(FLAGS.dump, FLAGS.cases, FLAGS.modes, FLAGS.overwrite)
    else:
        time_all(FLAGS.time, FLAGS.steps, FLAGS.matmul_size, FLAGS.peer)


if __name__ == "__main__":
    cli.run(main, define_flags)
