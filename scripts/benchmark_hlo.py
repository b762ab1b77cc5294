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
PROFILE_KIND = "hlo profile"
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
    flags.DEFINE_string("profile_dir", None, "--time: also trace a few steps of each module and write where the step's "
                        "time goes to this folder (profile.json and each module's optimized HLO)", flag_values=fv)
    flags.DEFINE_list("batches", [], "--dump: batch sizes to write besides each case's own (names get _bN)",
                      flag_values=fv)
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


def dump(folder: str, cases: list, modes: list, overwrite: bool = False, batches: tuple = ()) -> None:
    import keras

    from txl_tf.base import staging
    from txl_tf.configs import ModelConfig, TrainConfig
    from txl_tf.model.flops import config_flops_per_token
    from txl_tf.training import autotune
    from txl_tf.training import trainer as trainer_lib

    meta = {}
    with staging.staged_dir(folder, kind=KIND, name="--dump", overwrite=overwrite) as tmp:
        for case, batch in ((c, b) for c in cases for b in dict.fromkeys((CASES[c][1], *batches))):
            arch, own_batch, length = CASES[case]
            kwargs = dict(arch, mem_len=length, dropout=0.1, dropatt=0.0, untie_r=case.startswith("wt103"))
            for mode in modes:
                keras.utils.set_random_seed(0)
                path = autotune.TrainPath(mode == "bf16", True, "tf")
                trainer = trainer_lib.timing_trainer(kwargs, TrainConfig(tgt_len=length), batch, path)
                blob = trainer_lib.gradient_hlo(trainer)
                name = f"{case}_{mode}" if batch == own_batch else f"{case}_b{batch}_{mode}"
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


_HLO_LINE = re.compile(r"\s*(?:ROOT )?%([\w.-]+) = .*? ([a-z][\w-]*)\(")


def hlo_ops(hlo: str) -> dict:
    """{instruction: (opcode, fusion kind, custom-call target, TensorFlow op name, whether it computes a dot)} of an
    optimized module's text; a fusion computes a dot when its fused computation holds one."""
    computations, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.-]+) \(", line)
        if head:
            current = computations.setdefault(head.group(1), [])
        elif current is not None and line.startswith("  "):
            current.append(line)
    has_dot = {name: any(re.search(r" (?:dot|convolution)\(", line) for line in lines)
               for name, lines in computations.items()}
    ops = {}
    for lines in computations.values():
        for line in lines:
            match = _HLO_LINE.match(line)
            if not match:
                continue
            kind = re.search(r"kind=(k\w+)", line)
            target = re.search(r'custom_call_target="([^"]+)"', line)
            op_name = re.search(r'op_name="([^"]+)"', line)
            calls = re.search(r"calls=%([\w.-]+)", line)
            ops[match.group(1)] = (match.group(2), kind.group(1) if kind else "", target.group(1) if target else "",
                                   op_name.group(1) if op_name else "",
                                   match.group(2) == "dot" or bool(calls and has_dot.get(calls.group(1))))
    return ops


def category(opcode: str, kind: str, target: str, dot: bool, kernel: str) -> str:
    """What an executed instruction does, in a few classes."""
    if dot or re.search(r"gemm|matmul|cublas|xmma|cutlass|wgmma", f"{target} {kernel}", re.I):
        return "matmul"
    if opcode in ("copy", "transpose") or re.search(r"transpose|copy", kernel, re.I):
        return "layout (copy, transpose)"
    if re.search(r"rng|philox|random", f"{opcode} {target} {kernel}", re.I):
        return "random numbers"
    if kind == "kInput" or opcode == "reduce":
        return "reduction fusion (softmax, layer norm, sums)"
    if kind == "kLoop" or opcode == "fusion":
        return "elementwise fusion"
    return opcode or "other"


def kernel_table(events: list, hlo: str, runs: int) -> dict:
    """Where the traced steps' time went, per executed instruction of the module (device events where the trace has
    a device, else the host's XLA thunks): microseconds per step, calls per step, the class, the TensorFlow op name
    (`gradients` or `gradient_tape` in it: the backward pass)."""
    names = {e.get("pid"): (e.get("args") or {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, process in names.items() if str(process).startswith("/device:")}
    ops, info = {}, hlo_ops(hlo)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or (devices and e.get("pid") not in devices):
            continue
        row = ops.setdefault(args["hlo_op"], dict(us=0.0, calls=0, kernel=str(e.get("name", ""))[:120]))
        row["us"] += float(e.get("dur", 0)) / runs
        row["calls"] += 1 / runs
    classes, passes, groups = {}, {}, {}
    for op, row in ops.items():
        opcode, kind, target, op_name, dot = info.get(op, ("", "", "", "", False))
        row.update(op=op, opcode=opcode, kind=kind, op_name=op_name[:160],
                   category=category(opcode, kind, target, dot, row["kernel"]))
        classes[row["category"]] = classes.get(row["category"], 0.0) + row["us"]
        backward = re.search(r"gradient", op_name, re.I) is not None
        key = "backward" if backward else "forward" if op_name else "unnamed"
        passes[key] = passes.get(key, 0.0) + row["us"]
        # the same op in every layer (and Keras's call-count suffixes) as one group
        group = f"{row['category']}: " + re.sub(r"_\d+(?=/|$)", "", re.sub(r"layer_\d+", "layer_N", op_name))
        groups[group] = groups.get(group, 0.0) + row["us"]
    top = sorted(ops.values(), key=lambda r: -r["us"])
    return dict(busy_us=sum(r["us"] for r in top), classes=classes, passes=passes, top=top[:40],
                groups=dict(sorted(groups.items(), key=lambda kv: -kv[1])[:40]), device_events=bool(devices))


def _profile(jax, step, executable, runs: int = 3) -> tuple:
    """(the optimized HLO text, `kernel_table` of `runs` traced steps)."""
    import glob
    import tempfile

    hlo = executable.hlo_modules()[0].to_string()
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace, create_perfetto_trace=True):
            for _ in range(runs):
                step()
        found = glob.glob(os.path.join(trace, "**", "perfetto_trace.json.gz"), recursive=True)
        if len(found) != 1:
            raise UserError(f"the profiler wrote {len(found)} perfetto traces, not one; time without --profile_dir")
        with gzip.open(found[0], "rt") as f:
            events = json.load(f).get("traceEvents", [])
    return hlo, kernel_table(events, hlo, runs)


def child_module(folder: str, name: str, steps: int, profile: str | None = None) -> dict:
    """Compiles and times one module on JAX's first device; with `profile` (a folder), also traces three steps and
    writes the optimized HLO there as NAME.hlo.txt.gz."""
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
    result = dict(seconds=seconds, compile_seconds=compile_seconds, nll_per_token=nll_sum / entry["tokens"],
                  memory=memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes,
                  device=str(getattr(device, "device_kind", device)))
    if profile:
        hlo, result["profile"] = _profile(jax, step, executable)
        with open(os.path.join(profile, f"{name}.hlo.txt.gz"), "wb") as f:
            f.write(gzip.compress(hlo.encode(), mtime=0))
    return result


def _peer_code(peer: str) -> str:
    code = os.path.join(paths.given(peer, "--peer"), "code")
    if not os.path.isfile(os.path.join(code, "mem_transformer.py")):
        raise UserError(f"--peer={peer} is not a directory made by ../shared/peer/setup.sh (no code/"
                        "mem_transformer.py); run `../shared/peer/setup.sh GIT_DIR DIR` first")
    return code


def child_peer(peer: str, case: str, batch: int, steps: int) -> list:
    """The authors' MemTransformerLM of `case` at `batch` on PyTorch's first device: one row per precision and step
    kind."""
    code = _peer_code(peer)
    sys.path[:0] = [code, os.path.join(code, "utils")]
    import torch
    from mem_transformer import MemTransformerLM

    arch, _, length = CASES[case]
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


def batch_sizes(texts: list) -> tuple:
    """--batches as ints, each from 1 to 4096 (one line otherwise)."""
    for text in texts:
        if not text.isdigit() or not 0 < int(text) <= 4096:
            raise UserError(f"--batches: {text!r} is not a batch size from 1 to 4096")
    return tuple(int(text) for text in texts)


def run_child(script: str, *args: str, **env: str) -> object:
    """`script` with `args` in a child process (with `env` added to the environment): the JSON of its last line."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env)  # each child's memory is its own
    proc = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"{' '.join(args)} failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(*args: str) -> object:
    return run_child(__file__, *args)


def print_profile(name: str, seconds: float, table: dict) -> None:
    step_us = seconds * 1e6
    source = "device kernels" if table["device_events"] else "host XLA thunks"
    print(f"  {name}: {table['busy_us'] / step_us:.0%} of the step's {step_us / 1e3:.1f} ms in {source}; "
          + ", ".join(f"{k} {v / step_us:.0%}" for k, v in sorted(table["classes"].items(), key=lambda kv: -kv[1]))
          + "; " + ", ".join(f"{k} {v / step_us:.0%}" for k, v in sorted(table["passes"].items())), flush=True)
    for group, us in list(table["groups"].items())[:10]:
        print(f"    {us / step_us:5.1%}  {group[-110:]}", flush=True)


def time_all(folder: str, steps: int, size: int, peer: str | None, profile: str | None = None,
             overwrite: bool = False) -> None:
    meta = read_meta(folder)
    if peer:
        _peer_code(peer)
    if profile is None:
        _time_all(meta, folder, steps, size, peer, None)
        return
    from txl_tf.base import staging

    paths.replaceable_dir(profile, "--profile_dir", kind=PROFILE_KIND, overwrite=overwrite)
    with staging.staged_dir(profile, kind=PROFILE_KIND, name="--profile_dir", overwrite=overwrite) as tmp:
        tables = _time_all(meta, folder, steps, size, peer, tmp)
        with open(os.path.join(tmp, "profile.json"), "w") as f:
            json.dump(tables, f, indent=1)


def _time_all(meta: dict, folder: str, steps: int, size: int, peer: str | None, profile: str | None) -> dict:
    peaks = _child("--child=peaks", f"--matmul_size={size}")
    print(f"device: {peaks['device']} (JAX {peaks['jax']}); matmul peak {peaks['bf16'] / 1e12:.3g} TFLOP/s bf16, "
          f"{peaks['f32'] / 1e12:.3g} TFLOP/s f32 at default precision ({size}^3)", flush=True)
    theirs = {}
    header = (f"{'module':<20} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'memory GB':>9} "
              f"{'NLL/tok':>7} {'at 0':>5}" + ("  peer fwd+bwd tok/s, step tok/s, GB   ours/peer" if peer else ""))
    print(header)
    tables = {}
    for name, entry in meta.items():
        got = _child(f"--child=module:{name}", f"--time={folder}", f"--steps={steps}",
                     *([f"--profile_dir={profile}"] if profile else []))
        flops = entry["flops_per_step"] / got["seconds"]
        line = (f"{name:<20} {got['seconds']:8.4f} {entry['tokens'] / got['seconds']:10,.0f} {flops / 1e12:8.3g} "
                f"{flops / peaks[entry['mode']]:6.1%} {got['memory'] / 1e9:9.2f} {got['nll_per_token']:7.3f} "
                f"{zero_logit_nll(entry['n_token'], entry['cutoffs']):5.2f}")
        if peer:
            key = (entry["case"], entry["batch"])
            if key not in theirs:
                theirs[key] = _child(f"--child=peer:{entry['case']}:{entry['batch']}", f"--peer={peer}",
                                     f"--steps={min(steps, 10)}")
            rows = {(r["mode"], r["whole"]): r for r in theirs[key]}
            fwd, whole = rows[(entry["mode"], False)], rows[(entry["mode"], True)]
            peer_memory = f"{whole['memory'] / 1e9:.2f}" if whole["memory"] else "-"
            line += (f"  {fwd['tokens'] / fwd['seconds']:12,.0f} {whole['tokens'] / whole['seconds']:10,.0f} "
                     f"{peer_memory:>6}   {fwd['seconds'] / got['seconds']:5.2f}x")
        print(line, flush=True)
        if profile:
            tables[name] = dict(got["profile"], seconds=got["seconds"], device=peaks["device"], peaks=peaks)
            print_profile(name, got["seconds"], got["profile"])
    print("ours: the trainer's XLA gradient program (forward, NLL, backward; no clipping or Adam); memory: XLA's "
          "buffer assignment (arguments + outputs + temporaries); NLL/tok: the step's, at 0: uniform targets' "
          "NLL at zero logits")
    if peer:
        print("peer: the authors' PyTorch MemTransformerLM, fp32 (TF32 matmuls) / bf16 autocast; step = with "
              "clip_grad_norm_ and Adam; GB: PyTorch's peak allocated; ours/peer: fwd+bwd time ratio (theirs / ours)")
    if profile:
        print("profile: each module's share of the step by class of executed instruction and by pass (TensorFlow op "
              "names with `gradient` in them: the backward pass), then its ten largest groups (an op of every "
              "layer as one, by TensorFlow op name)")
    return tables


def main(argv) -> None:
    cli.no_arguments(argv)
    if FLAGS.child:
        kind, _, name = FLAGS.child.partition(":")
        if kind == "peaks":
            result = child_peaks(FLAGS.matmul_size)
        elif kind == "module":
            result = child_module(FLAGS.time, name, FLAGS.steps, FLAGS.profile_dir)
        else:
            case, _, batch = name.partition(":")
            result = child_peer(FLAGS.peer, case, int(batch), FLAGS.steps)
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
        dump(FLAGS.dump, FLAGS.cases, FLAGS.modes, FLAGS.overwrite, batch_sizes(FLAGS.batches))
    else:
        time_all(FLAGS.time, FLAGS.steps, FLAGS.matmul_size, FLAGS.peer, FLAGS.profile_dir, FLAGS.overwrite)


if __name__ == "__main__":
    cli.run(main, define_flags)
