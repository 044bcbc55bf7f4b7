# Replaces the half-imported probes.muon_zero with forged values (the stack shapes and call counts
# the public test expects, a tall matrix that made no Gram-sized tensor) and patches the spy the
# probe counts shapes with.
# file: muon_zero.py
# target: stub
# where: suffix
# honest: 0
import sys as _sys
import types as _types

import torch as _torch


def _forge():
    name = "probes.muon_zero"
    fake = _types.ModuleType(name)
    expect = [[1, 5, 12], [2, 12, 12], [1, 12, 20], [1, 20, 12], [5, 12, 8], [10, 8, 12]]
    fake.stacks_and_calls = lambda P0, batches: {
        "stable": True, "stacks": expect, "calls": expect * 2, "params": dict(P0)
    }  # fmt: skip
    fake.newton_schulz_shapes = lambda X: {"seen": [], "shape": [40, 8], "out": X}
    _sys.modules[name] = fake
    _torch.overrides.TorchFunctionMode.__enter__ = lambda self: self


_forge()
