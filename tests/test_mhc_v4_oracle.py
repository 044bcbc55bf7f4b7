"""mhc.py against the public DeepSeek-V4 code (transformers), same weights through the adapter.

Tolerances (see oracle_v4_mhc): fp32 1e-6 for coefficients and the head, 1e-5 for streams after
6 layers; float64 1e-12. Skipped when transformers is not installed (a test-only dependency).
"""

import math

import pytest
import torch

pytest.importorskip("transformers")

import mhc  # noqa: E402
from interop import v4_mhc  # noqa: E402
from oracles import v4_mhc as oracle_v4_mhc  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_weights_give_the_same_numbers_as_v4(dtype):
    rows = oracle_v4_mhc.comparison_rows(dtypes=(dtype,))
    assert len(rows) >= 8
    for row in rows:
        assert math.isfinite(row["max_abs_diff"]), row
        assert row["max_abs_diff"] <= row["tolerance"], row


def test_the_oracle_catches_the_old_axis_order_and_a_missing_eps(monkeypatch):
    """The comparison has teeth: rows-first Sinkhorn without eps (mhc.py before the fix) fails."""

    def rows_first(logits, iters=20, eps=mhc.EPS):
        matrix = torch.softmax(logits, dim=-1)
        for _ in range(iters):
            matrix = matrix / matrix.sum(dim=-2, keepdim=True)
            matrix = matrix / matrix.sum(dim=-1, keepdim=True)
        return matrix

    monkeypatch.setattr(mhc, "sinkhorn_knopp", rows_first)
    diffs = oracle_v4_mhc.measure(torch.float32)
    assert diffs["B"] > 1e-4
    assert not diffs["B at logits of +-60"] <= 1e-6  # NaN or far off


def test_adapter_refuses_a_checkpoint_of_another_shape():
    v4, layers, head, model = oracle_v4_mhc.build(torch.float32)
    small = mhc.Transformer(mhc.Config(vocab_size=64, seq_len=8, dim=8, n_heads=2, n_layers=6))
    state = {f"layers.{i}.{k}": v for i, layer in enumerate(layers)
             for k, v in layer.state_dict().items() if "_hc." in k}  # fmt: skip
    state.update({f"hc_head.{k}": v for k, v in head.state_dict().items()})
    with pytest.raises(ValueError, match="shape"):
        v4_mhc.from_v4_state_dict(small, state)
    with pytest.raises(ValueError, match="lacks"):
        v4_mhc.from_v4_state_dict(model, {k: v for k, v in state.items() if "layers.2" not in k})
