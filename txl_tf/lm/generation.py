"""Generation from a built `TransformerXL` with txl_tf's settings (temperature, top_k, top_p, seed).

`generator(model, protocol, segment_len)` is the model's `txl_tf.lm.sampling.Generator`: the keras-hub task wrapped
around the model (`txl_tf.lm.hub.TransformerXLCausalLM.around`, its weights, not a copy) and its one decoding engine,
`generate_step`. `python -m txl_tf.generate`, the trainer's samples and the SavedModel's `generate` signature
(`txl_tf.export`) run it; `txl_tf.TransformerXLCausalLM.generate(..., temperature=...)` runs the same Generator of
its own task. The protocol of generation is derived in one place, `Protocol.for_generation` (no same_length).
"""

from __future__ import annotations

from txl_tf.configs import EvalConfig, check_generation_size
from txl_tf.lm.sampling import (  # the engine's driver and host-side helpers, here for the callers of this module
    GenerationResult,
    Generator,
    Sampling,
    check_settings,
    generate_with,
    padded,
    text_pieces,
    with_prompt,
)
from txl_tf.model.protocol import Protocol

__all__ = ["GenerationResult", "Generator", "Sampling", "check_settings", "generate_from_model", "generate_text",
           "generate_with", "generation_protocol", "generator", "padded", "text_pieces", "with_prompt"]


def generator(model, protocol: Protocol | None = None, segment_len: int = 64) -> Generator:
    """The `Generator` of `model` under `generation_protocol(model, protocol)`, prompts consumed in segments of
    `segment_len`; made once per protocol and segment length and kept on the model (outside Keras's tracking): a
    later call traces nothing again (the trainer samples every few hundred steps)."""
    # keras-hub's task (hub imports nothing of this module)
    from txl_tf.lm.hub import TransformerXLCausalLM

    protocol = generation_protocol(model, protocol)
    made = model.__dict__.setdefault("_txl_tf_generators", {})
    key = (protocol, int(segment_len))
    if key not in made:
        eval_config = EvalConfig(tgt_len=int(segment_len), mem_len=protocol.mem_len, clamp_len=protocol.clamp_len,
                                 same_length=False)
        made[key] = Generator(TransformerXLCausalLM.around(model, eval_config))
    return made[key]


def generation_protocol(model, protocol: Protocol | None = None) -> Protocol:
    """The protocol of generation: `protocol` (default: the model's lengths) without same_length, every token
    seeing the whole state (`Protocol.for_generation`)."""
    return (protocol or model.protocol).for_generation()


def generate_from_model(model, prompts, *, max_tokens: int, protocol: Protocol | None = None,
                        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                        segment_len: int = 64) -> GenerationResult:
    """`generate_with` the `generator` of a Python TransformerXL. A length, batch, segment or memory that would not
    fit in the memory this process can allocate is a ConfigError before any tensor is made
    (`configs.check_generation_size`)."""
    protocol = generation_protocol(model, protocol)
    longest = max((len(prompt) for prompt in prompts), default=0)
    check_generation_size(model, batch_size=len(prompts), length=longest + max_tokens, given=max_tokens,
                          name="max_tokens", segment_len=segment_len, mem_len=protocol.mem_len)
    return generate_with(generator(model, protocol, segment_len).generate, [list(p) for p in prompts],
                         max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def generate_text(model, vocab, prompt: str, *, max_tokens: int = 200, **kwargs) -> str:
    """Samples a continuation of `prompt` (a string) and returns it decoded with `vocab` (the trainer's samples)."""
    ids = list(vocab.encode(prompt))
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; give a longer prompt")
    result = generate_from_model(model, [ids], max_tokens=max_tokens, **kwargs)
    return vocab.decode(result.tokens[0].tolist())
