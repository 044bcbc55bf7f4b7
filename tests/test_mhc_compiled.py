"""compiled/mhc_compiled.py against the plain autograd model: the same numbers, F run once.

The reference is the eager model with the plain autograd layer (mhc.mhc_layer_reference): no fused
ops, no recomputation, no compiler. Compile time is the cost here: Inductor writes and builds C++
for each of the ~10 graphs of the optimised path (forward and backward, per F type and region),
about a minute cold on 2 cores. So most tests use backend="aot_eager": the same dynamo graphs, the
same AOTAutograd-derived backward and the same recompute bookkeeping, without code generation (a
few seconds); one test, marked slow, trains through Inductor's generated code. Shapes are tiny and
Sinkhorn runs 3 rounds to keep the graphs small.

Tolerances, and why:
  float64: 1e-10 relative. The compiled path does the same math in another order (fused loops,
           derived backward, recomputed lane states); in float64 a real difference (a dropped term,
           a wrong transpose) shows at 1e-3 or larger, rounding at ~1e-14.
  float32: 3e-5 relative to each gradient's scale, over 3 SGD steps. fp32 reassociation is ~1e-7
           per op; the B-logit gradients go through 2 x 3 Sinkhorn normalisations whose sums cancel
           (measured worst: 1.3e-5 on hcs.1.bias_pre, step 1), so the bound is 3e-5.
           Gradients that are zero in exact arithmetic (layer 0's B logits: its lanes are copies)
           are compared against 1e-3 of the model's largest gradient.
"""

import copy

import pytest
import torch

import mhc
from compiled.mhc_compiled import CompiledModel

SMALL = dict(vocab_size=32, seq_len=8, dim=16, n_heads=2, n_hc=4, n_layers=4, sinkhorn_iters=3)


def build(hyper=True, dtype=torch.float32, seed=0):
    """A small model whose HC parameters are moved off their init, so every mixing gradient is large
    enough to be checked (at init the gates are 0.01 and B is close to the identity)."""
    torch.manual_seed(seed)
    model = mhc.Transformer(mhc.Config(**SMALL), hyper=hyper).to(dtype)
    if hyper:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for hc in model.hcs:
                hc.gate.copy_(torch.rand(3, generator=gen) * 0.5 + 0.5)
                for p in (hc.bias_pre, hc.bias_post, hc.bias_res):
                    p.add_(torch.randn(p.shape, generator=gen).to(dtype))
    return model


def batch(step, size=2):
    gen = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, SMALL["vocab_size"], (size, SMALL["seq_len"] + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def grads_of(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_grads_close(got, ref, rtol, what):
    scale = max(g.abs().max().item() for g in ref.values())
    assert got.keys() == ref.keys()
    for name in ref:
        floor = max(ref[name].abs().max().item(), 1e-3 * scale)
        err = (got[name] - ref[name]).abs().max().item() / floor
        assert err < rtol, f"{what}: gradient of {name} differs by {err:.2e} (tolerance {rtol:.0e})"


def count_calls(runner):
    """Wrap each compiled F of an optimised CompiledModel in a counter (outside compiled code)."""
    calls = [0]

    def counted(fn):
        def run(h):
            calls[0] += 1
            return fn(h)

        return run

    runner.f = [counted(fn) for fn in runner.f]
    return calls


@pytest.mark.parametrize("variant", ["optimised", *(pytest.param(v, marks=pytest.mark.slow)
                                                    for v in ("fused", "naive"))])  # fmt: skip
def test_compiled_matches_reference_float64(variant):
    reference = build(dtype=torch.float64)
    model = copy.deepcopy(reference)
    block = 2 if variant == "optimised" else None  # 2 blocks of 2
    runner = CompiledModel(model, variant, block=block, backend="aot_eager")
    idx, tgt = batch(0)
    ref_loss = reference(idx, tgt)
    ref_loss.backward()
    loss = runner(idx, tgt)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-10 * abs(ref_loss.item())
    assert_grads_close(grads_of(model), grads_of(reference), 1e-10, f"compiled {variant}, float64")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_optimised_trains_like_reference_fp32_and_runs_f_once(backend):
    reference = build()
    model = copy.deepcopy(reference)
    runner = CompiledModel(model, block=2, backend=backend)
    calls = count_calls(runner)
    # SGD, not Adam: Adam divides by sqrt(v), so on gradients that are zero in exact arithmetic it
    # turns 1e-9 of rounding into a full-size step, and the two models would part for no real reason
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(3):
        idx, tgt = batch(step)
        ref_loss, loss = reference(idx, tgt), runner(idx, tgt)
        assert abs(loss.item() - ref_loss.item()) < 3e-5 * abs(ref_loss.item()), f"step {step}"
        ref_loss.backward()
        loss.backward()
        assert_grads_close(grads_of(model), grads_of(reference), 3e-5, f"{backend} step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    # selective recomputation rebuilds the lane states in backward but never calls F again
    assert calls[0] == 3 * SMALL["n_layers"], f"F ran {calls[0]} times in 3 steps of 4 layers"
    for name, p in reference.named_parameters():
        q = dict(model.named_parameters())[name]
        assert (p - q).abs().max() < 3e-5 * max(p.abs().max().item(), 1.0), name


def test_compiled_residual_and_no_grad_forward():
    reference = build(hyper=False)
    idx, tgt = batch(0)
    loss = CompiledModel(copy.deepcopy(reference), backend="aot_eager")(idx, tgt)
    assert abs(loss.item() - reference(idx, tgt).item()) < 1e-5 * loss.item()
    hyper = build()
    runner = CompiledModel(hyper, block=2, backend="aot_eager")
    with torch.no_grad():  # the inference graphs alone, no autograd.Function
        assert abs(runner(idx, tgt).item() - hyper(idx, tgt).item()) < 1e-5 * loss.item()


def test_compiled_model_refuses_mismatched_variants():
    with pytest.raises(ValueError, match="hyper=True"):
        CompiledModel(build(hyper=False), "optimised")
    with pytest.raises(ValueError, match="variant must be one of"):
        CompiledModel(build(), "residual")
    with pytest.raises(ValueError, match="L_r"):
        CompiledModel(build(), "naive", block=2)
