"""txl_tf.model.flops: the closed-form count against the matmuls TensorFlow actually runs in the model's forward graph."""

import numpy as np
import pytest
import tensorflow as tf

from txl_tf import TransformerXL
from txl_tf.configs import ModelConfig
from txl_tf.model import encodings
from txl_tf.model.flops import (
    config_flops_per_token,
    forward_flops_per_segment,
    measure_matmul_peak,
    model_flops_per_token,
    utilisation_line,
)
from txl_tf.model.state import Memory


def graph_matmul_flops(model, batch, qlen, mlen):
    """2 x multiply-adds of every MatMul / BatchMatMul in the traced forward pass + NLL (an independent oracle)."""

    @tf.function
    def forward(tokens, mems):
        hidden, _ = model(tokens, Memory(mems), training=False)
        return model.nll(hidden, tokens)

    graph = forward.get_concrete_function(
        tf.TensorSpec([batch, qlen], tf.int32),
        tf.TensorSpec([model.n_layer, batch, mlen, model.d_model], tf.float32)).graph
    total = 0

    def visit(g):
        nonlocal total
        for op in g.get_operations():
            if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3"):
                a, b = (t.shape.as_list() for t in op.inputs)
                out = op.outputs[0].shape.as_list()
                adj_a = op.get_attr("transpose_a" if op.type == "MatMul" else "adj_x")
                inner = a[-2] if adj_a else a[-1]
                total += 2 * int(np.prod(out)) * inner
            for name in ("then_branch", "else_branch", "body", "f"):
                if name in op.node_def.attr:
                    func = g._get_function(op.get_attr(name).name)  # noqa: SLF001
                    if func is not None:
                        visit(func.graph)

    visit(graph)
    return total


ARCHS = {
    "char": dict(n_token=23, n_layer=2, d_model=12, n_head=3, d_head=5, d_inner=17),
    "adaptive_div4": dict(n_token=41, n_layer=1, d_model=16, n_head=2, d_head=6, d_inner=9, cutoffs=(9, 20),
                          div_val=2, d_embed=16),
    "adaptive_div1_proj": dict(n_token=37, n_layer=1, d_model=10, n_head=2, d_head=4, d_inner=11, cutoffs=(13,),
                               div_val=1, d_embed=6),
}


@pytest.mark.parametrize("name", sorted(ARCHS) + [f"char_{name}" for name in encodings.NAMES if name != "xl"])
def test_forward_count_equals_the_traced_graph(name):
    """Every architecture, and every position encoding (each counts its own FLOPs: `Encoding.flops`)."""
    arch = ARCHS[name] if name in ARCHS else dict(ARCHS["char"], d_head=6, attn_type=name[len("char_"):])
    batch, qlen, mlen = 3, 7, 5
    model = TransformerXL(dropout=0.0, dropatt=0.0, mem_len=mlen, **arch)
    expected = graph_matmul_flops(model, batch, qlen, mlen)
    assert forward_flops_per_segment(batch_size=batch, tgt_len=qlen, mem_len=mlen, **arch) == expected


def test_training_is_three_forwards_per_token_and_config_helper_agrees():
    arch = dict(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, n_token=204)
    forward = forward_flops_per_segment(batch_size=2, tgt_len=512, mem_len=512, **arch)
    per_token = model_flops_per_token(batch_size=2, tgt_len=512, mem_len=512, **arch)
    assert per_token == pytest.approx(3 * forward / 1024)
    config = ModelConfig(mem_len=512)  # the enwik8 base architecture by default
    assert config_flops_per_token(config, 204, tgt_len=512, batch_size=2) == pytest.approx(per_token)
    assert 350e6 < per_token < 450e6  # ~415 MFLOP per trained token were counted for the authors' PyTorch step


def test_matmul_peak_is_a_plausible_rate_and_the_line_reports_mfu():
    peak = measure_matmul_peak("float32", size=256, repeats=2)
    assert 1e8 < peak < 1e14
    line = utilisation_line(1000.0, 2e6, 4e9, "float32")
    assert "1,000 tokens/s" in line and "2.0 GFLOP/s" in line and "MFU 50.0%" in line
