"""Models the chapters' demos train (tiny_moe: muon_zero.py's) and how MuonZeRO routes their
tensors (param_roles)."""
