"""Optimizer state that outlives a run: MuonZeRO's checkpoints (muon_zero_checkpoint)."""
