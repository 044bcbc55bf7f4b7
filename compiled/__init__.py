"""mhc.py's lane-mixing kernels under torch.compile (mhc_compiled.py)."""
