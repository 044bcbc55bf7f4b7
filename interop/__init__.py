"""Adapters that load the public DeepSeek-V4 weights into the chapters' modules."""
