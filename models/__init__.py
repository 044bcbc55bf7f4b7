"""Models the chapters' demos train (tiny_moe: muon_zero.py's)."""
