"""cp_compress.py against the public DeepSeek-V4 attention (transformers): same weights, same
numbers.

The comparison itself lives in oracles/v4_attention.py (notebook 03 prints it as a table); each
row carries its tolerance and why (fp32: 1e-6 on entries, 1e-5 on indexer scores, integers exact).
One document only: the public code pools across document boundaries, cp_compress does not (on
purpose), so packed batches are compared against the project's own full-sequence reference instead.
"""

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

import cp_compress as cpc  # noqa: E402
from interop.v4_attention import V4_NOT_LOADED, from_v4_state_dict  # noqa: E402
from oracles.v4_attention import comparison_rows, random_v4_attention, v4_config  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return comparison_rows()


def test_every_quantity_within_its_tolerance(rows):
    assert len(rows) == 12
    bad = [r for r in rows if not r["max_abs_diff"] <= r["tolerance"]]
    assert not bad, bad


def test_the_comparison_sees_a_wrong_eps(rows, monkeypatch):
    """The oracle is sharp enough to see F.rms_norm's default-style eps instead of V4's 1e-6."""
    monkeypatch.setattr(cpc, "RMS_EPS", 1e-5)
    entries = [
        r
        for r in comparison_rows()
        if r["quantity"].startswith(("CSA m=4 entries", "HCA")) and r["tolerance"] > 0
    ]
    assert all(r["max_abs_diff"] > r["tolerance"] for r in entries), entries


def test_adapter_reports_what_it_cannot_load():
    attn = random_v4_attention(v4_config(), 0, seed=3)
    layer, skipped = from_v4_state_dict(attn.state_dict(), "csa", 4, 8, top_k=5)
    assert set(skipped) == set(V4_NOT_LOADED)
    loaded = {k for k in attn.state_dict() if k not in skipped}
    assert len(loaded) == 12  # every other V4 weight has a place here
    assert torch.equal(layer.sink, attn.sinks)
