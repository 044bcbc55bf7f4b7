"""The independent reference for tests/graded/test_memory_timeline.py's drawn models: the bytes a
forward leaves as activations, found by autograd's saved-tensor hooks rather than by a timeline of
allocations. It ships only in the autograder zip; the student repository's public model has its
formula written out in the test instead."""

import torch

from graded.models_memory_timeline import small_model


def bytes_held_for_backward(layers, batch):
    """Bytes of the storages one forward of small_model(layers) on a [batch, 256] batch makes
    and autograd saves for backward, plus the loss's: what is alive as that forward ends."""
    model = small_model(layers=layers)
    x = torch.randn(batch, 256)
    before = {p.untyped_storage().data_ptr() for p in [x, *model.parameters()]}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in before:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    return sum(saved.values()) + loss.untyped_storage().nbytes()
