"""Checks a chapter runs on every rank before its collectives (muon_zero_guard: MuonZeRO's;
tensor_ckpt_guard: the refusals of marks that cannot be recomputed exactly; compose_guard: the
agreement of every rank on each training step's batch and finiteness)."""
