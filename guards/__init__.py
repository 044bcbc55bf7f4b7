"""Checks a chapter runs on every rank before its collectives (muon_zero_guard: MuonZeRO's)."""
