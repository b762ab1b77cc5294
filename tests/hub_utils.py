"""A tiny Transformer-XL as txl_tf.lm.hub's keras-hub classes, for the tests of the keras-hub face."""

import keras
import numpy as np

from txl_tf.configs import EvalConfig, ModelConfig
from txl_tf.data.vocab import Vocab

VOCAB = Vocab([10] + list(range(32, 127)), "char")  # "\n" and printable ASCII: 96 symbols
PROMPTS = ["hello world", "ab"]


def tiny_lm(seed=3, tgt_len=4, mem_len=8, sequence_length=24, preprocessor=True, **architecture):
    """A TransformerXLCausalLM of random weights (init_std 0.5: a greedy text far from ties) and VOCAB."""
    from txl_tf.lm.hub import (
        TransformerXLBackbone,
        TransformerXLCausalLM,
        TransformerXLCausalLMPreprocessor,
        TransformerXLTokenizer,
    )

    keras.utils.set_random_seed(seed)
    fields = dict(n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, dropout=0.0, mem_len=mem_len,
                  n_token=len(VOCAB), init_std=0.5)
    model_config = ModelConfig(**{**fields, **architecture})
    backbone = TransformerXLBackbone(model_config, EvalConfig(tgt_len=tgt_len, mem_len=mem_len, clamp_len=-1,
                                                              same_length=False))
    if not preprocessor:
        return TransformerXLCausalLM(backbone)
    tokenizer = TransformerXLTokenizer(VOCAB)
    return TransformerXLCausalLM(backbone, TransformerXLCausalLMPreprocessor(tokenizer,
                                                                             sequence_length=sequence_length))


def plain_greedy(lm, prompts, max_length, vocab=VOCAB, empty_start=True):
    """The greedy continuation by plain calls of the backbone's model: each prompt alone in segments, then one
    token a call with the hidden-state memory (the paper's recurrence), the memory empty at first (generation's
    convention: each call attends to the positions read before it, `memory_lengths`); `empty_start=False`: a zero
    memory every call attends to (the authors' TF code, and txl_tf's generation before 2026-11-29)."""
    model, protocol, segment = lm.backbone.transformer_xl, lm.backbone.protocol, lm.backbone.segment_len
    texts = []
    for text in prompts:
        ids = vocab.encode(text)
        read = (lambda n: np.array([n], np.int32)) if empty_start else (lambda n: None)  # noqa: E731
        memory = model.initial_memory(1, protocol)
        for start in range(0, len(ids), segment):
            hidden, memory = model(np.array([ids[start:start + segment]], np.int32), memory, protocol=protocol,
                                   memory_lengths=read(start))
        while len(ids) < max_length:
            ids.append(int(np.argmax(keras.ops.convert_to_numpy(model.log_probs(hidden[:, -1:]))[0, 0])))
            hidden, memory = model(np.array([ids[-1:]], np.int32), memory, protocol=protocol,
                                   memory_lengths=read(len(ids) - 1))
        texts.append(vocab.decode(ids))
    return texts
