"""Adapters between the chapters and code written elsewhere: the public DeepSeek-V4 weights
(transformers' naming; v4_attention, v4_mhc) and forwards TorchFX cannot trace as they are
(fx_models, for tensor_ckpt)."""
