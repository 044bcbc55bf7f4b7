"""mhc.py against independent references: plain autograd math, one process, no recomputation.

Tolerances, and why:
  float64: 1e-9 relative. The optimised paths do the same math in another order; in float64 any real
           difference (a dropped term, a wrong transpose) shows up at 1e-3 or larger.
  float32: 2e-5 relative to each gradient's scale. Ordinary fp32 reassociation is ~1e-7 per op, but the
           gradients of the B logits go through 40 Sinkhorn normalisations and their sums cancel
           strongly; measured worst case ~6e-6. Gradients that are exactly zero in exact arithmetic
           (layer 0's B logits: the expanded lanes are identical, and a row-stochastic B cannot change
           a mean of identical lanes) are compared against 1e-3 of the model's largest gradient.
"""
import copy

import pytest
import torch

import mhc
from harness import RankFailure, run_ranks, run_torchrun

SMALL = dict(vocab_size=64, seq_len=8, dim=16, n_heads=2, n_hc=4)


def build(n_layers=6, hyper=True, seed=0, dtype=torch.float32):
    """A small model whose HC parameters are moved away from their init, so the lanes differ and every
    mixing gradient is large enough to be checked (at init the lanes are copies of each other)."""
    torch.manual_seed(seed)
    model = mhc.Transformer(mhc.Config(n_layers=n_layers, **SMALL), hyper=hyper).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    if hyper:
        with torch.no_grad():
            for hc in model.hcs:
                hc.gate.copy_(torch.rand(3, generator=gen) * 0.5 + 0.5)
                for p in (hc.bias_pre, hc.bias_post, hc.bias_res):
                    p.add_(torch.randn(p.shape, generator=gen).to(dtype))
    return model


def batch(step, size=4, seq_len=8, vocab=64):
    data = torch.randint(0, vocab, (size, seq_len + 1), generator=torch.Generator().manual_seed(100 + step))
    return data[:, :-1], data[:, 1:]


def assert_grads_close(got, ref, rtol, what=""):
    scale = max(g.abs().max().item() for g in ref.values())
    assert got.keys() == ref.keys()
    for name in ref:
        assert got[name] is not None, f"{what}: {name} got no gradient"
        err = (got[name] - ref[name]).abs().max().item() / max(ref[name].abs().max().item(), 1e-3 * scale)
        assert err < rtol, f"{what}: gradient of {name} differs by {err:.2e} (relative), tolerance {rtol:.0e}"


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- Sinkhorn-Knopp

def test_sinkhorn_is_doubly_stochastic_and_differentiable():
    logits = torch.randn(64, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    b = mhc.sinkhorn_knopp(logits, iters=20)
    assert (b > 0).all()
    # rows are normalised last, so they are exact to rounding; columns converge geometrically: after 20
    # rounds on N(0, 1) logits the worst column is within 1e-6 of 1 (measured 4e-8 for this seed).
    assert (b.sum(-1) - 1).abs().max() < 1e-12
    assert (b.sum(-2) - 1).abs().max() < 1e-6
    # an independent property of the Sinkhorn limit: it depends on exp(logits) only up to row and column
    # scalings, i.e. adding a constant to a row or a column of the logits changes nothing.
    shifted = logits + torch.randn(64, 4, 1, dtype=torch.float64) + torch.randn(64, 1, 4, dtype=torch.float64)
    assert (mhc.sinkhorn_knopp(shifted, iters=200) - mhc.sinkhorn_knopp(logits, iters=200)).abs().max() < 1e-10
    # the 2 x 2 limit in closed form: [[p, 1-p], [1-p, p]] with p = 1 / (1 + sqrt(K12 K21 / (K11 K22)))
    k = torch.tensor([[2.0, 0.5], [-1.0, 0.3]], dtype=torch.float64)
    p = 1 / (1 + torch.exp((k[0, 1] + k[1, 0] - k[0, 0] - k[1, 1]) / 2))
    assert torch.allclose(mhc.sinkhorn_knopp(k, iters=200), torch.stack([torch.stack([p, 1 - p]), torch.stack([1 - p, p])]), atol=1e-12)
    small = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: mhc.sinkhorn_knopp(x, 20), (small,))
    assert torch.autograd.gradcheck(lambda x: mhc.SinkhornReplay.apply(x, 20), (small,))
    with pytest.raises(ValueError, match="iters"):
        mhc.sinkhorn_knopp(logits, iters=0)


# ----------------------------------------------------------------------------- the layer, from the equations

def test_layer_matches_the_equations_token_by_token():
    """V4 §2.2 written out for one token at a time, independently of mhc_coefficients and the einsums."""
    model = build(n_layers=1, dtype=torch.float64)
    hc, sublayer, n, dim = model.hcs[0], model.sublayers[0], 4, 16
    stream = torch.randn(2, 8, n, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    f = sublayer(torch.stack([torch.stack([sum(
        torch.sigmoid(hc.gate[0] * (stream[b, t].reshape(-1) / stream[b, t].reshape(-1).pow(2).mean().add(1e-6).sqrt()
                                    @ hc.proj[:, i]) + hc.bias_pre[i]) * stream[b, t, i] for i in range(n))
        for t in range(8)]) for b in range(2)]))
    expected = torch.empty_like(stream)
    for b in range(2):
        for t in range(8):
            x_hat = stream[b, t].reshape(-1) / stream[b, t].reshape(-1).pow(2).mean().add(1e-6).sqrt()
            logits = x_hat @ hc.proj
            c = 2 * torch.sigmoid(hc.gate[1] * logits[n:2 * n] + hc.bias_post)
            mix = mhc.sinkhorn_knopp(hc.gate[2] * logits[2 * n:].reshape(n, n) + hc.bias_res, 20)
            for i in range(n):   # output lane i = sum_j B_ij X_j + C_i f
                expected[b, t, i] = sum(mix[i, j] * stream[b, t, j] for j in range(n)) + c[i] * f[b, t]
    with torch.no_grad():
        assert (mhc.mhc_layer_reference(stream, sublayer, hc) - expected).abs().max() < 1e-12
        assert (mhc.mhc_layer_fused(stream, sublayer, hc) - expected).abs().max() < 1e-12
        assert (mhc.run_recomputed_block(stream, [(sublayer, hc)]) - expected).abs().max() < 1e-12


def test_streams_expand_once_and_collapse_once():
    model = build(n_layers=2)
    idx, tgt = batch(0)
    stream = model.embed_stream(idx)
    assert stream.shape == (4, 8, 4, 16) and all(torch.equal(stream[..., i, :], model.embed(idx)) for i in range(4))
    lanes = torch.randn(4, 8, 4, 16)
    expected = torch.nn.functional.cross_entropy(model.head(model.norm(lanes.mean(-2))).reshape(-1, 64), tgt.reshape(-1))
    assert torch.allclose(model.head_loss(lanes, tgt), expected)
    residual = build(n_layers=2, hyper=False)
    x = residual.embed(idx)
    for sublayer in residual.sublayers:
        x = x + sublayer(x)
    assert torch.allclose(residual(idx, tgt), torch.nn.functional.cross_entropy(
        residual.head(residual.norm(x)).reshape(-1, 64), tgt.reshape(-1)))


# ----------------------------------------------------------------------------- fused lane mixing

def test_fused_ops_match_plain_math_and_gradcheck():
    gen = torch.Generator().manual_seed(0)
    a, stream = torch.rand(2, 3, 4, generator=gen, dtype=torch.float64), torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    b, c, f = torch.rand(2, 3, 4, 4, generator=gen, dtype=torch.float64), torch.rand(2, 3, 4, generator=gen, dtype=torch.float64), torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    plain_pre = sum(a[..., i, None] * stream[..., i, :] for i in range(4))
    plain_post = torch.stack([sum(b[..., i, j, None] * stream[..., j, :] for j in range(4)) + c[..., i, None] * f
                              for i in range(4)], dim=-2)
    assert torch.allclose(mhc.FusedPreMix.apply(a, stream), plain_pre, atol=1e-12)
    assert torch.allclose(mhc.FusedPostMixMerge.apply(b, stream, c, f), plain_post, atol=1e-12)
    weight = torch.randn(20, 24, generator=gen, dtype=torch.float64)
    flat = stream.flatten(-2)
    plain_logits = (flat / flat.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()) @ weight
    assert torch.allclose(mhc.NormThenProject.apply(flat, weight), plain_logits, atol=1e-12)
    assert torch.autograd.gradcheck(mhc.NormThenProject.apply, (flat.clone().requires_grad_(), weight.requires_grad_()))
    inputs = [t.clone().requires_grad_() for t in (a, stream, b, c, f)]
    assert torch.autograd.gradcheck(mhc.FusedPreMix.apply, (inputs[0], inputs[1]))
    assert torch.autograd.gradcheck(mhc.FusedPostMixMerge.apply, (inputs[2], inputs[1], inputs[3], inputs[4]))


def test_mixing_bytes_match_the_paper_counts():
    n, dim = 4, 1024
    naive, fused = mhc.mixing_bytes_per_token(n, dim, False, 1), mhc.mixing_bytes_per_token(n, dim, True, 1)
    assert naive["post_mix"] == ((3 * n + 1) * dim, 3 * n * dim)      # mHC paper: (3n+1)C reads, 3nC writes
    assert fused["post_mix"] == ((n + 1) * dim, n * dim)              # -> (n+1)C reads, nC writes
    assert fused["pre_mix"] == (n * dim, dim)
    assert naive["pre_mix"] == (2 * n * dim, (n + 1) * dim)
    assert fused["coefficients"][0] == n * dim and naive["coefficients"][0] == 3 * n * dim
    assert mhc.mixing_bytes_per_token(n, dim, True, 4)["pre_mix"] == (4 * n * dim, 4 * dim)


# ----------------------------------------------------------------------------- the whole model, every path

PATHS = {"fused": dict(fused=True), "recomputed": dict(recompute=2),
         "recomputed L_r=4": dict(recompute=4), "fused+recomputed": dict(fused=True, recompute=3)}


def test_every_optimised_path_equals_the_reference_in_float64():
    model = build(dtype=torch.float64)
    idx, tgt = batch(0)
    model(idx, tgt).backward()
    ref_loss, ref = model(idx, tgt).detach(), grads_of(model)
    for name, options in PATHS.items():
        model.zero_grad(set_to_none=True)
        loss = model(idx, tgt, **options)
        loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 1e-12, name
        assert_grads_close(grads_of(model), ref, 1e-9, name)


@pytest.mark.parametrize("path", list(PATHS))
def test_optimised_training_tracks_the_reference_over_steps_fp32(path):
    reference, optimised = build(), build()
    calls = [0]
    for sublayer in optimised.sublayers:
        sublayer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(optimised.parameters(), lr=0.1)
    for step in range(3):
        idx, tgt = batch(step)
        ref_loss, loss = reference(idx, tgt), optimised(idx, tgt, **PATHS[path])
        ref_loss.backward()
        loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 1e-6 * abs(ref_loss.item()), (step, loss.item(), ref_loss.item())
        assert_grads_close(grads_of(optimised), grads_of(reference), 2e-5, f"{path} step {step}")
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad(set_to_none=True)
        assert calls[0] == (step + 1) * len(optimised.sublayers), "F must run exactly once per layer per step"


def test_recomputation_keeps_only_block_inputs_and_f_outputs():
    model = build(n_layers=8)
    idx, tgt = batch(0)
    rows, n, dim = idx.numel(), model.cfg.n_hc, model.cfg.dim
    _, naive = mhc.saved_activation_bytes(model, lambda: model(idx, tgt))
    _, fused = mhc.saved_activation_bytes(model, lambda: model(idx, tgt, fused=True))
    _, recomputed = mhc.saved_activation_bytes(model, lambda: model(idx, tgt, fused=True, recompute=4))
    _, per_layer = mhc.saved_activation_bytes(model, lambda: model(idx, tgt, fused=True, recompute=1))
    assert recomputed < fused < naive
    # going from blocks of 4 to blocks of 1 adds exactly 6 more block inputs (n*C each) and nothing else
    assert per_layer - recomputed == 6 * rows * n * dim * 4
    # and versus storing every layer: the stream (n*C per layer) is gone, so >= 8 - 2 streams are saved
    assert fused - recomputed >= 6 * rows * n * dim * 4


def test_recompute_blocks_stay_inside_stages_and_default_block_size():
    assert mhc.default_recompute_block(4, 8) == 2            # sqrt(4*8/6) = 2.31
    assert mhc.default_recompute_block(4, 43) == 5           # V4-Flash depth: sqrt(4*43/6) = 5.35
    assert mhc.default_recompute_block(1, 1) == 1
    for n_layers, n_stages, block in [(12, 4, 2), (12, 3, 5), (8, 2, 3), (6, 1, 4)]:
        covered = []
        for stage in range(n_stages):
            first, stop = mhc.stage_layers(n_layers, n_stages, stage)
            blocks = mhc.recompute_blocks(first, stop, block)
            assert all(first <= a < b <= stop and b - a <= block for a, b in blocks)
            covered += [layer for a, b in blocks for layer in range(a, b)]
        assert covered == list(range(n_layers))


def test_one_f_one_b_schedule():
    for n_stages, n_micro in [(1, 3), (2, 2), (4, 4), (4, 7), (3, 5)]:
        for stage in range(n_stages):
            order = mhc.one_f_one_b(n_stages, stage, n_micro)
            assert sorted(order) == sorted([("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)])
            in_flight, peak = set(), 0
            for kind, i in order:
                if kind == "F":
                    in_flight.add(i)
                else:
                    assert i in in_flight, "backward before its forward"
                    in_flight.remove(i)
                peak = max(peak, len(in_flight))
            assert peak == min(n_stages - stage, n_micro), "1F1B holds at most (stages - stage) micro-batches"
            assert [i for k, i in order if k == "B"] == list(range(n_micro))


# ----------------------------------------------------------------------------- pipeline parallelism

def _pipeline_rank(rank, world_size, n_layers, hyper, steps, overlap=True):
    model = build(n_layers=n_layers, hyper=hyper)
    first, stop = mhc.stage_layers(n_layers, world_size, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        idx, tgt = batch(step, size=8)
        loss, stats = mhc.pipeline_step(model, idx, tgt, n_micro=4, fused=True,
                                          recompute=2 if hyper else 0, overlap=overlap)
        mine = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((None if loss is None else loss.item(), mine, stats))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (first, stop), out


@pytest.mark.parametrize("world_size,overlap", [(1, True), (2, True), (2, False), (3, True), (4, True)])
def test_pipeline_equals_single_process(world_size, overlap):
    n_layers, steps = 12, 2
    reference = build(n_layers=n_layers)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_steps = []
    for step in range(steps):
        idx, tgt = batch(step, size=8)
        loss = reference(idx, tgt)
        loss.backward()
        ref_steps.append((loss.item(), grads_of(reference)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    results = run_ranks(_pipeline_rank, world_size, args=(n_layers, True, steps, overlap), timeout=120)
    for step, (ref_loss, ref_grads) in enumerate(ref_steps):
        merged = {}
        for rank, ((first, stop), per_step) in enumerate(results):
            loss, mine, stats = per_step[step]
            assert (loss is not None) == (rank == world_size - 1)
            owned = {n for n in mine if n.startswith(("sublayers.", "hcs."))}
            assert {int(n.split(".")[1]) for n in owned} == set(range(first, stop)), "a stage touched layers it does not hold"
            assert not (merged.keys() & mine.keys()), "two stages produced a gradient for the same parameter"
            merged.update(mine)
            if rank < world_size - 1:   # 4 micro-batches of [2, 8, n=4, 16] fp32 go forward, the same comes back
                assert stats["bytes_sent_forward"] == 4 * 2 * 8 * 4 * 16 * 4
            if rank > 0:
                assert stats["bytes_sent_backward"] == 4 * 2 * 8 * 4 * 16 * 4
        assert abs(results[-1][1][step][0] - ref_loss) < 1e-6 * abs(ref_loss)
        assert_grads_close(merged, ref_grads, 2e-5, f"{world_size} stages, step {step}")


def test_residual_pipeline_sends_n_times_less():
    results = run_ranks(_pipeline_rank, 2, args=(4, False, 1), timeout=60)
    assert results[0][1][0][2]["bytes_sent_forward"] == 4 * 2 * 8 * 16 * 4   # [2, 8, C] per micro-batch


# ----------------------------------------------------------------------------- bad input

def test_bad_input_single_process():
    with pytest.raises(ValueError, match="n_hc"):
        mhc.Config(n_hc=0)
    model = build(n_layers=2)
    hc, sublayer = model.hcs[0], model.sublayers[0]
    for shape in [(2, 8, 3, 16), (2, 8, 4, 15), (16,)]:
        with pytest.raises(ValueError, match="n_hc=4, dim=16"):
            mhc.mhc_layer_reference(torch.randn(shape), sublayer, hc)
        with pytest.raises(ValueError, match="n_hc=4, dim=16"):
            mhc.mhc_layer_fused(torch.randn(shape), sublayer, hc)
        with pytest.raises(ValueError, match="n_hc=4, dim=16"):
            mhc.run_recomputed_block(torch.randn(shape), [(sublayer, hc)])
    with pytest.raises(ValueError, match="L_r"):
        model(*batch(0), recompute=-1)
    with pytest.raises(ValueError, match="L_r"):
        mhc.recompute_blocks(0, 4, 0)
    with pytest.raises(ValueError, match="divides"):
        mhc.stage_layers(6, 4, 0)
    with pytest.raises(ValueError, match="at most"):
        mhc.stage_layers(2, 4, 0)
    with pytest.raises(ValueError, match="micro-batches"):
        mhc.one_f_one_b(4, 0, 3)


def _bad_pipeline_rank(rank, world_size, n_layers, n_micro):
    model = build(n_layers=n_layers)
    try:
        mhc.pipeline_step(model, *batch(0, size=8), n_micro=n_micro)
    except ValueError as e:
        return str(e)
    return None


def test_bad_pipeline_input_fails_on_every_rank_without_hanging():
    messages = run_ranks(_bad_pipeline_rank, 2, args=(4, 1), timeout=60)           # 1 micro-batch < 2 stages
    assert all(m and "micro-batches" in m for m in messages)
    messages = run_ranks(_bad_pipeline_rank, 3, args=(4, 4), timeout=60)           # 3 stages, 4 layers
    assert all(m and "cannot split 4 layers" in m for m in messages)
    messages = run_ranks(_bad_pipeline_rank, 2, args=(4, 3), timeout=60)           # batch 8 into 3 micro-batches
    assert all(m and "equal micro-batches" in m for m in messages)


# ----------------------------------------------------------------------------- the demo

def test_demo_runs_under_torchrun_on_two_stages():
    out = run_torchrun("mhc.py", nproc=2, args=["--dim", "32", "--layers", "4", "--steps", "2"], timeout=240).stdout
    assert "pipeline: 2 stage(s)" in out and "bytes sent" in out and "last stage loss" in out
