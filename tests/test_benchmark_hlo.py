"""scripts/benchmark_hlo.py end to end on a one-layer model with an adaptive softmax: TensorFlow writes the trainer's
XLA gradient program, JAX (here on the CPU) compiles and runs it, and the NLL it computes is the one the model must
give at its small random weights; the folder and file checks answer in one line."""

import gzip
import json
import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "benchmark_hlo.py")
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
# A meta.json entry as --dump writes it.
ENTRY = dict(case="tiny", mode="f32", batch=1, tgt_len=1, mem_len=1, n_token=10, tokens=1, parameters=1, cutoffs=[],
             flops_per_step=1.0)


def run(*args, cwd=REPO):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=600)


def one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in line, line
    return line


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hlo") / "tiny")
    proc = run(f"--dump={folder}", "--cases=tiny", "--batches=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def test_dump_writes_loadable_modules(dumped):
    from tensorflow.compiler.xla.service import hlo_pb2

    meta = json.load(open(os.path.join(dumped, "meta.json")))
    assert sorted(meta) == ["tiny_b2_bf16", "tiny_b2_f32", "tiny_bf16", "tiny_f32"]  # the case's batch, and --batches
    assert meta["tiny_f32"]["tokens"] == 64 and meta["tiny_f32"]["cutoffs"] == [100, 400]
    assert meta["tiny_b2_f32"]["batch"] == 2 and meta["tiny_b2_f32"]["tokens"] == 32
    assert meta["tiny_b2_f32"]["flops_per_step"] < meta["tiny_f32"]["flops_per_step"]
    for name in meta:
        module = hlo_pb2.HloModuleProto()
        module.ParseFromString(gzip.decompress(open(os.path.join(dumped, f"{name}.pb.gz"), "rb").read()))
        opcodes = {i.opcode for c in module.computations for i in c.instructions}
        assert "dot" in opcodes and "copy" not in opcodes  # the model's matmuls; no copies left for the import
        assert not module.input_output_alias.entries  # the same inputs can be fed again
    again = run(f"--dump={dumped}", "--cases=tiny")
    one_line_error(again, f"--dump={dumped} already holds a hlo benchmark", "--overwrite")


def test_time_runs_the_modules_under_jax(dumped, tmp_path):
    profile = tmp_path / "profile"
    proc = run(f"--time={dumped}", "--steps=2", "--matmul_size=64", f"--profile_dir={profile}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^(tiny_\w+)\s+([\d.]+)\s+([\d,]+)\s+\S+\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      proc.stdout, re.M)
    assert [r[0] for r in rows] == ["tiny_f32", "tiny_bf16", "tiny_b2_f32", "tiny_b2_bf16"], proc.stdout
    for name, seconds, tokens_per_second, mfu, memory, nll, at_zero in rows:
        tokens = 32 if "_b2_" in name else 64
        rate, seconds = float(tokens_per_second.replace(",", "")), float(seconds)  # printed to 0.1 ms and 1 token/s
        assert tokens / (seconds + 5e-5) - 1 <= rate <= tokens / max(seconds - 5e-5, 1e-9) + 1
        assert 0 < float(mfu) and float(memory) > 0
        # head of 100 + 2 clusters; uniform targets: 10% ln 102, 30% ln 102 + ln 300, 60% ln 102 + ln 600
        expected = math.log(102) + 0.3 * math.log(300) + 0.6 * math.log(600)
        assert float(at_zero) == pytest.approx(expected, abs=0.006)
        assert abs(float(nll) - expected) < 0.6 * (64 / tokens) ** 0.5  # NLL spread ~1.9: ~2.5 standard errors
    # --profile_dir: JAX's profiler traced real steps (here the CPU's XLA thunks), each traced instruction found in the
    # optimized module, the matmuls among them, the layers' ops grouped, the backward pass told by its op names
    tables = json.load(open(profile / "profile.json"))
    assert sorted(tables) == sorted(r[0] for r in rows)
    for name, table in tables.items():
        assert table["busy_us"] > 0 and table["top"] and not table["device_events"]
        assert "matmul" in table["classes"] and {"forward", "backward"} <= set(table["passes"])
        assert any("feed_forward/inner/MatMul" in group for group in table["groups"]), list(table["groups"])[:10]
        assert all(row["opcode"] for row in table["top"])  # every traced instruction is in the module's text
        with gzip.open(profile / f"{name}.hlo.txt.gz", "rt") as f:
            assert f.read().startswith("HloModule")
    assert re.search(r"^  tiny_f32: \d+% of the step's [\d.]+ ms in host XLA thunks; .*matmul \d+%", proc.stdout, re.M)
    again = run(f"--time={dumped}", "--steps=1", "--matmul_size=16", f"--profile_dir={tmp_path}")
    one_line_error(again, f"--profile_dir={tmp_path} exists and holds no hlo profile")


def test_time_refuses_a_meta_json_it_did_not_write(tmp_path):
    one_line_error(run(f"--time={tmp_path}"), f"--time={tmp_path} holds no meta.json")
    for bad, fragment in ((dict(ENTRY, batch=0), "batch=0 is not a positive integer"),
                          (dict(ENTRY, cutoffs=[5, 3]), "cutoffs=[5, 3] are not increasing"),
                          (dict(ENTRY, mode="fp8"), "is not a module written by --dump")):
        (tmp_path / "meta.json").write_text(json.dumps({"tiny_f32": bad}))
        one_line_error(run(f"--time={tmp_path}"), str(tmp_path / "meta.json"), fragment)
    (tmp_path / "meta.json").write_text('{"tiny_f32": {"flops_per_step": NaN}}')
    one_line_error(run(f"--time={tmp_path}"), "meta.json")
    (tmp_path / "meta.json").write_text(json.dumps({"tiny_f32": ENTRY}))
    (tmp_path / "tiny_f32.pb.gz").write_bytes(b"not gzip")
    one_line_error(run(f"--time={tmp_path}", "--matmul_size=16"), str(tmp_path / "tiny_f32.pb.gz"), "not a gzip file")


def test_paths_and_flags_are_one_line_errors(tmp_path):
    one_line_error(run("--dump="), "--dump is empty")
    one_line_error(run("--dump=."), "--dump=. is the working directory")
    one_line_error(run(f"--dump={tmp_path / 'x'}", "--cases=nope"), "unknown ['nope']")
    one_line_error(run(f"--dump={tmp_path / 'x'}", "--batches=0"), "--batches: '0' is not a batch size")
    one_line_error(run(), "give exactly one of --dump=DIR")
    (tmp_path / "meta.json").write_text(json.dumps({"tiny_f32": ENTRY}))
    one_line_error(run(f"--time={tmp_path}", f"--peer={tmp_path}"),
                   f"--peer={tmp_path} is not a directory made by ../shared/peer/setup.sh")


def test_gradient_hlo_needs_the_xla_path():
    from txl_tf.configs import TrainConfig
    from txl_tf.training import autotune
    from txl_tf.training import trainer as trainer_lib

    arch = dict(n_token=10, n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=16, mem_len=4)
    trainer = trainer_lib.timing_trainer(arch, TrainConfig(tgt_len=4), 1, autotune.TrainPath(False, False, "tf"))
    with pytest.raises(ValueError, match="does not compile with XLA; give it jit_compile"):
        trainer_lib.gradient_hlo(trainer)
