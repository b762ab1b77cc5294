"""The language model as keras-hub's classes (hub), their presets, tokenizer, decoding engine and text scoring."""
