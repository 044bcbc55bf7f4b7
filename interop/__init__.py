"""Adapters that load the public DeepSeek-V4 weights (transformers' naming) into the chapters."""
