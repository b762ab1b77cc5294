"""Gin-configurable settings shared by the entry points (train, evaluate, export, generate).

The library layers stay plain Keras; gin only reaches them through these small dataclasses, which the
entry points instantiate. Every `gin/<setup>.gin` file binds them (see `gin/common.gin`).

    ModelConfig  architecture + regularisation (argument names as in the authors' code)
    DataConfig   which prepared corpus to read (written by `python -m txl_tf.data.prepare`)
    TrainConfig  optimisation, loop and logging
    EvalConfig   the evaluation protocol (its own tgt_len, long mem_len, clamp_len, same_length, batch)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import gin


@gin.configurable
@dataclasses.dataclass
class ModelConfig:
    """Architecture of `txl_tf.TransformerXL`; `n_token=None` takes the vocabulary size of the data."""

    n_layer: int = 12
    d_model: int = 512
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048
    dropout: float = 0.1
    dropatt: float = 0.0
    mem_len: int = 512
    n_token: Optional[int] = None
    d_embed: Optional[int] = None
    cutoffs: tuple = ()
    div_val: int = 1
    tie_projs: Optional[tuple] = None
    proj_same_dim: bool = True
    untie_r: bool = False
    same_length: bool = False
    clamp_len: int = -1
    attn_type: str = "xl"
    pre_lnorm: bool = False
    layer_norm_epsilon: float = 1e-12
    init_std: float = 0.02
    proj_init_std: float = 0.01
    max_position: int = 1024  # rows of the learned tables of attn_type "shaw" (distances) and "al_rfou" (positions)

    def model_kwargs(self, n_token: Optional[int] = None) -> dict:
        """Keyword arguments for `TransformerXL`; `n_token` fills in when the config leaves it unset."""
        kwargs = dataclasses.asdict(self)
        if kwargs["n_token"] is None:
            if n_token is None:
                raise ValueError("ModelConfig.n_token is unset and no vocabulary size was given")
            kwargs["n_token"] = n_token
        elif n_token is not None and kwargs["n_token"] != n_token:
            raise ValueError(
                f"ModelConfig.n_token={kwargs['n_token']} does not match the data's vocabulary size "
                f"{n_token}; remove the n_token binding or point DataConfig.data_dir at matching data"
            )
        kwargs["cutoffs"] = tuple(kwargs["cutoffs"])
        if kwargs["tie_projs"] is not None:
            kwargs["tie_projs"] = tuple(kwargs["tie_projs"])
        return kwargs

    def build(self, n_token: Optional[int] = None):
        from txl_tf.model import TransformerXL  # imported late: keeps this module light

        return TransformerXL(**self.model_kwargs(n_token))


@gin.configurable
@dataclasses.dataclass
class DataConfig:
    """A corpus prepared by `python -m txl_tf.data.prepare --dataset=NAME --data_dir=DIR`."""

    dataset: str = "enwik8_sample"
    data_dir: str = "data/enwik8_sample"


@gin.configurable
@dataclasses.dataclass
class TrainConfig:
    """Optimisation (Adam, warm-up + cosine decay to a floor, global-norm clipping) and the loop."""

    batch_size: int = 22  # global batch = number of contiguous streams
    tgt_len: int = 512
    train_steps: int = 400_000
    learning_rate: float = 2.5e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.004  # cosine floor as a fraction of learning_rate
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    clip_norm: float = 0.25
    grad_accum_steps: int = 1  # the batch is split into this many chunks, each with its own memory
    loss_recent_half: bool = False  # ablation: loss only over the most recent half of each segment
    # keras mixed_bfloat16 policy: True, False, or "auto" (on where bfloat16 matmuls are native: GPU, TPU, a CPU
    # with AMX or AVX-512 BF16; txl_tf.distribute.has_fast_bfloat16)
    mixed_precision: bool | str = False
    jit_compile: bool = False  # XLA (slower than oneDNN for bf16 on CPUs with AMX; faster on GPU/TPU)
    steps_per_loop: int = 10
    log_every: int = 10
    eval_every: int = 1000
    eval_steps: int = 0  # 0 = the whole validation split
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    nonfinite: str = "stop"  # or "skip"
    rotate_streams: bool = False  # random per-epoch rotation of the training streams
    seed: int = 1234
    deterministic: bool = False  # tf.config.experimental.enable_op_determinism()
    sample_tokens: int = 200  # length of the text sample generated at each evaluation (0 = none)
    measure_mfu: bool = True  # time a square matmul at start-up and report model FLOPs utilisation
    checkpoint_memory: bool = True  # save every stream's memory (exact resume; n_layer*B*M*d values per checkpoint)
    # Fine-tuning: start from these weights (a `txl_tf.convert` output dir, a run dir or a checkpoint prefix) with a
    # fresh optimizer, step 0 and zero memory; ignored when model_dir has a checkpoint of its own (that resumes).
    init_checkpoint: Optional[str] = None


@gin.configurable
@dataclasses.dataclass
class EvalConfig:
    """The evaluation protocol: published defaults live in each `gin/<setup>.gin`."""

    tgt_len: int = 80
    mem_len: int = 2100
    clamp_len: int = 820
    same_length: bool = True
    batch_size: int = 10
    max_steps: int = 0  # 0 = the whole split
    protocol: str = "xl"  # "xl": segments + memory; "vanilla": al_rfou window of tgt_len shifted by one token
    compute_dtype: str = "float32"  # or "mixed_bfloat16" (faster on CPUs with AMX, GPUs, TPUs)
    layout: str = "corpus"  # "corpus": every token scored once; "original": the authors' batching
    kv_cache: bool = True  # carry the memory's keys/values (txl_tf.kv_cache; same numbers, faster; xl only)
