"""The model: Transformer-XL's layers, its recurrent state, the encodings, the dtype policy, the evaluation protocol and the fused CPU kernels. Imports only the model and the base."""
