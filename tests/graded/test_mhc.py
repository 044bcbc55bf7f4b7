"""Graded: mhc.py against references computed here, never from the submitted code: V4's equations
in float64 (a plain mHC transformer written out below: attention over the whole sequence, each
layer B X + C F(A X), autograd, no recomputation, no pipeline), autograd of the plain post-mix,
and the 1F1B schedule's properties. The submitted code runs in sandboxed workers
(tests/graded/probes/mhc.py) and sends back plain values.

Tolerances, and why:
  float64: 1e-12 for one layer or one kernel (the same math in another order), 1e-9 relative for a
           model's gradients (6-12 layers of reassociation); a dropped term or a wrong transpose
           shows at 1e-3.
  float32 against the float64 reference: 1e-5 on the loss and 1e-4 relative to each gradient's
           scale. fp32 rounds at 6e-8 per op, but the gradients of B's logits go through 40
           Sinkhorn normalisations whose sums cancel strongly, and the head's gate gradient is one
           scalar summed over every token; measured worst case ~4e-5. Gradients that are exactly
           zero in exact arithmetic (layer 0's B logits: the expanded lanes are identical) are
           compared against 1e-3 of the model's largest gradient.
"""

import pytest
import torch
from sandbox import call, on_ranks

from graded.expected import case_seed, generator, hidden, stored

H = hidden("mhc")  # V4's model written out in float64: only in the autograder zip

# The private suite runs these in its slow tier: CI grades the reference with every graded
# test (make grade-fit); test_sandbox.py and test_memory_timeline.py stay in its default tier.
pytestmark = pytest.mark.slow

EPS = 1e-6
N, DIM, HEADS = 4, 16, 2
FP64 = dict(loss=1e-12, grads=1e-9)
FP32 = dict(loss=1e-5, grads=1e-4)


VOCAB = 64


def mhc_params(n_layers, seed=0, hyper_head=True):
    """Every parameter of the probes' model (mhc.Transformer on probes/mhc.py's SMALL config),
    drawn here: the worker loads exactly these, so the reference never reads a value it chose.
    Linear weights as nn.Linear draws them, HC parameters away from their init (the lanes differ,
    every mixing gradient is large enough to check). Each tensor comes from a generator of its
    own, seeded by a hash of the draw, the case (``seed``, ``n_layers``) and its name: a stage
    that works a generator's state out from the values it was given learns nothing of the tensors
    it was not, and what one case hands whole to a stage is nothing another case splits."""
    params = {}

    def gen(name):  # moves with the draw, at grading time
        return generator("mhc", seed, n_layers, name)

    def linear(name, rows, cols):
        params[name] = (torch.rand(rows, cols, generator=gen(name)) * 2 - 1) / cols**0.5

    def normal(name, *shape, std=1.0, mean=0.0):
        params[name] = mean + torch.randn(*shape, generator=gen(name)) * std

    normal("embed.weight", VOCAB, DIM)
    for i in range(n_layers):
        normal(f"sublayers.{i}.norm.weight", DIM, mean=1.0, std=0.1)
        if i % 2 == 0:
            linear(f"sublayers.{i}.qkv.weight", 3 * DIM, DIM)
            linear(f"sublayers.{i}.out.weight", DIM, DIM)
        else:
            linear(f"sublayers.{i}.up.weight", 4 * DIM, DIM)
            linear(f"sublayers.{i}.down.weight", DIM, 4 * DIM)
    for i in range(n_layers):
        normal(f"hcs.{i}.proj", N * DIM, (2 + N) * N, std=1 / (N * DIM) ** 0.5)
        params[f"hcs.{i}.gate"] = torch.rand(3, generator=gen(f"hcs.{i}.gate")) * 0.5 + 0.5
        normal(f"hcs.{i}.bias_pre", N, std=1.2)
        normal(f"hcs.{i}.bias_post", N, std=1.2)
        normal(f"hcs.{i}.bias_res", N, N, mean=1.0, std=1.5)
    if hyper_head:
        normal("hyper_head.proj", N * DIM, N, std=1 / (N * DIM) ** 0.5)
        params["hyper_head.gate"] = torch.full((1,), 0.7)
        normal("hyper_head.bias", N)
    normal("norm.weight", DIM, mean=1.0, std=0.1)
    linear("lm_head.weight", VOCAB, DIM)
    return params


def assert_plain(value, kind, what):
    """A value from a worker is of the kind the test reads: a forged one fails here, by name."""
    assert isinstance(value, kind), f"{what} must be a {kind.__name__}, got {type(value).__name__}"
    return value


def assert_grads_close(got, ref, rtol, what=""):
    scale = max(g.abs().max().item() for g in ref.values())
    assert_plain(got, dict, f"{what}: the gradients")
    missing = sorted(ref.keys() - got.keys())
    assert not missing, f"{what}: {missing[0]} got no gradient"
    for name in ref:
        floor = max(ref[name].abs().max().item(), 1e-3 * scale)
        g = assert_plain(got[name], torch.Tensor, f"{what}: the gradient of {name}")
        assert g.shape == ref[name].shape, f"{what}: the gradient of {name} has shape {g.shape}"
        err = (g.double() - ref[name]).abs().max().item() / floor
        assert err < rtol, f"{what}: gradient of {name} differs by {err:.2e}, tolerance {rtol:.0e}"


def assert_loss_close(got, ref, rtol, what):
    assert_plain(got, float, f"{what}: the loss")
    assert abs(got - ref) < rtol * abs(ref), f"{what}: loss {got:.8f} differs from {ref:.8f}"


# ---- Sinkhorn-Knopp ------------------------------------------------------------------------------

NEEDS_LAYER = ("mhc.sinkhorn_knopp", "mhc.mhc_coefficients")  # the plain model's regions
NEEDS_KERNELS = (*NEEDS_LAYER, "mhc.post_mix_backward")  # and the kernels' (mix_out_backward)


@pytest.mark.grade(points=2, solution="mhc.sinkhorn_knopp")
def test_sinkhorn_matches_v4_and_is_doubly_stochastic():
    gen = torch.Generator().manual_seed(case_seed(0, "mhc", "sinkhorn"))
    logits = torch.randn(64, 4, 4, dtype=torch.float64, generator=gen)
    # float32, where exp(-120) underflows to 0: without eps a row or column of zeros gives 0/0
    extreme = 60.0 * torch.randn(256, 4, 4, generator=gen).sign()
    # without eps: the Sinkhorn limit depends on exp(logits) only up to row and column scalings
    shift = torch.randn(64, 4, 1, dtype=torch.float64) + torch.randn(64, 1, 4, dtype=torch.float64)
    k = torch.tensor([[2.0, 0.5], [-1.0, 0.3]], dtype=torch.float64)
    b, extreme, limit, shifted, got = call(
        "mhc:sinkhorn",
        [(logits, 20, EPS), (extreme, 20, EPS), (logits, 200, 0), (logits + shift, 200, 0),
         (k, 200, 0)],
    )  # fmt: skip
    assert b.shape == logits.shape, f"B must keep the logits' shape {logits.shape}, got {b.shape}"
    assert torch.isfinite(extreme).all(), (
        "B has NaN or inf at logits of +-60 (float32): add eps after the softmax and to every "
        "sum, as V4 does (sum + eps)"
    )
    # V4 fixes the order (the docstring says so): compared to float64 rounding, 1e-12
    want = stored("mhc", "sinkhorn", lambda: H.v4_sinkhorn(logits))
    transposed = stored("mhc", "sinkhorn rows first", lambda: H.v4_sinkhorn(logits.mT).mT)
    assert not (b - transposed).abs().max().item() < 1e-12, (
        "B is normalised rows first (softmax along rows, columns last): V4 starts with a softmax "
        "down each column (dim=-2) and ends every round on the rows"
    )
    rows, cols = (b.sum(-1) - 1).abs().max().item(), (b.sum(-2) - 1).abs().max().item()
    assert rows < 2e-6, (
        f"rows of B must sum to 1 (to eps), worst |row sum - 1| = {rows:.1e}: every round ends "
        f"with the row step (sum over dim=-1), after the column step (dim=-2)"
    )
    # 20 rounds leave the columns as far from 1 as V4's own Sinkhorn leaves them for these logits
    # (up to 1.1e-5 at some draws), never much further
    v4_cols = (want.sum(-2) - 1).abs().max().item()
    assert cols < max(1e-5, 2 * v4_cols), (
        f"columns of B must sum to 1 after 20 rounds, worst error {cols:.1e} (V4's: {v4_cols:.1e})"
    )
    err = (b - want).abs().max().item()
    assert err < 1e-12, (
        f"B differs from V4's Sinkhorn by {err:.1e}: V4's order is a softmax down each column "
        f"(dim=-2) + eps, a row step, then iters - 1 rounds of (columns, rows), each sum + eps"
    )
    moved = (shifted - limit).abs().max().item()
    assert moved < 1e-10, f"at eps=0 the limit moved by {moved:.1e} under row/column scalings"
    # the 2 x 2 limit in closed form: [[p, 1-p], [1-p, p]], p = 1 / (1 + sqrt(K12 K21 / (K11 K22)))
    p = 1 / (1 + torch.exp((k[0, 1] + k[1, 0] - k[0, 0] - k[1, 1]) / 2))
    expected = torch.stack([torch.stack([p, 1 - p]), torch.stack([1 - p, p])])
    assert torch.allclose(got, expected, atol=1e-12), f"2 x 2 limit: got {got}, want {expected}"


# ---- the layer, from the equations ---------------------------------------------------------------

FORMULAS = {
    "A": "A = sigmoid(alpha_pre * x_hat W_pre + S_pre) + eps",
    "B": "B = sinkhorn_knopp(alpha_res * x_hat W_res (row-major n x n) + S_res)",
    "C": "C = 2 sigmoid(alpha_post * x_hat W_post + S_post)",
}


@pytest.mark.grade(points=3, solution="mhc.mhc_coefficients", needs=("mhc.sinkhorn_knopp",))
def test_layer_matches_the_equations_token_by_token():
    """V4 §2.2 for one token at a time (float64: 1e-12), independently of mhc_coefficients."""
    gen = torch.Generator().manual_seed(case_seed(3, "mhc"))
    stream = torch.randn(2, 8, N, DIM, dtype=torch.float64, generator=gen)
    params = {k: v.double() for k, v in mhc_params(1, seed=3).items()}
    out = call("mhc:one_layer", stream, params)
    got = assert_plain(out["coeffs"], list, "mhc_coefficients' (A, B, C)")
    coeffs = stored("mhc", "coefficients", lambda: H.coefficients_by_token(params, stream))
    assert len(got) == 3, "mhc_coefficients must return (A, B, C)"
    for i, name in enumerate("ABC"):
        expected = coeffs[i]
        assert got[i].shape == expected.shape, (
            f"{name} must have shape {tuple(expected.shape)}, got {tuple(got[i].shape)}"
        )
        err = (got[i] - expected).abs().max().item()
        assert err < 1e-12, (
            f"{name} differs from V4 §2.2 by {err:.1e}: {FORMULAS[name]}, x_hat = vec(X) / "
            f"rms(vec(X)) over all n*C numbers of a token, W = hc.proj"
        )
    layer = assert_plain(out["layer"], torch.Tensor, "the layer's output")
    assert layer.shape == stream.shape, f"the layer's output has shape {tuple(layer.shape)}"
    err = (layer - stored("mhc", "layer", lambda: H.v4_layer(params, 0, stream))).abs().max().item()
    assert err < 1e-12, f"the layer B X + C F(A X) differs from the equations by {err:.1e}"


DERIVATIVES = {  # which gradient, by what it is the gradient of (the formula is the exercise)
    "dB": "the gradient of the mixing matrix B, [n, n] per token",
    "dX": "the gradient of the input lanes X, [n, C] per token",
    "dC": "the gradient of the coefficients C, one per lane",
    "df": "the gradient of the sublayer's output f, [C] per token",
}


@pytest.mark.grade(points=2, solution="mhc.post_mix_backward")
def test_fused_post_mix_merge_backward():
    """The four gradients of X' = B X + C f against autograd of the plain expression, float64
    (any op order or loop agrees to 1e-12)."""
    gen = torch.Generator().manual_seed(1)
    b, stream = (torch.rand(2, 3, 4, 4, generator=gen, dtype=torch.float64),
                 torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64))  # fmt: skip
    c, f = (torch.rand(2, 3, 4, generator=gen, dtype=torch.float64),
            torch.randn(2, 3, 5, generator=gen, dtype=torch.float64))  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (b, stream, c, f)]
    lb, ls, lc, lf = leaves
    reference = (lb.unsqueeze(-1) * ls.unsqueeze(-3)).sum(-2) + lc.unsqueeze(-1) * lf.unsqueeze(-2)
    grad_out = torch.randn(reference.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(reference, leaves, grad_out)
    got = call("mhc:post_mix_backward", grad_out, b, stream, c, f)
    assert len(got) == 4, "post_mix_backward must return (dB, dX, dC, df)"
    for (name, what), g, e in zip(DERIVATIVES.items(), got, expected, strict=True):
        assert g.shape == e.shape, f"{name} must have shape {tuple(e.shape)}, got {tuple(g.shape)}"
        err = (g - e).abs().max().item()
        assert err < 1e-12, f"{name} differs from autograd by {err:.1e}: {name} is {what}"


# ---- the whole model, every path -----------------------------------------------------------------

PATHS = {
    "fused": dict(variant="fused"),
    "optimised L_r=2": dict(variant="optimised", block=2),
    "optimised L_r=4": dict(variant="optimised", block=4),
    "optimised L_r=3": dict(variant="optimised", block=3),
    "optimised, default L_r": dict(variant="optimised"),
}


@pytest.mark.grade(points=4, solution="mhc.RecomputedBlock.backward", needs=NEEDS_KERNELS)
def test_every_optimised_path_equals_the_reference_in_float64():
    params = mhc_params(6)
    out = call("mhc:every_path", PATHS, params)
    [(ref_loss, ref)] = stored("mhc", "every path", lambda: H.reference_steps(params, 6, 1, 4))
    paths = assert_plain(out["paths"], dict, "the paths")
    assert sorted(paths) == sorted(PATHS), f"paths {sorted(paths)}, expected {sorted(PATHS)}"
    for name, got in out["paths"].items():
        assert_loss_close(got["loss"], ref_loss, FP64["loss"], f"variant {name}")
        assert_grads_close(got["grads"], ref, FP64["grads"], f"variant {name}")


@pytest.mark.grade(points=2, solution="mhc.RecomputedBlock.backward", needs=NEEDS_KERNELS)
@pytest.mark.parametrize("with_head", [False, True])
def test_one_recomputed_block_layer_by_layer(with_head):
    """One block of 3 layers against the plain layers in float64 (1e-9), each gradient named by
    its layer, and F run once per layer (its graph is kept, never rebuilt)."""
    gen = torch.Generator().manual_seed(case_seed(4, "mhc"))
    stream = torch.randn(2, 8, N, DIM, dtype=torch.float64, generator=gen)
    shape = (2, 8, DIM) if with_head else (2, 8, N, DIM)
    weight = torch.randn(shape, generator=gen, dtype=torch.float64)
    every = mhc_params(3, seed=4)
    names = [n for n in every if n.startswith(("sublayers.", "hcs."))]
    names += [n for n in every if n.startswith("hyper_head.")] if with_head else []
    sent = {k: v.double() for k, v in every.items()}
    out = call("mhc:recomputed_block", stream, weight, with_head, sent)
    assert out["calls"] == 3, (
        f"F must run once per layer: it ran {out['calls']} times for 3 layers; backward must use "
        f"the graph forward kept for each F output, not run F again"
    )
    ref_x, ref = stored(
        "mhc",
        f"block, head {with_head}",
        lambda: H.block_gradients({n: sent[n] for n in names}, stream, weight, with_head),
    )
    scale = max(g.abs().max().item() for g in ref.values())
    layer = {n: None if n.startswith("hyper_head.") else int(n.split(".")[1]) for n in names}
    for name in sorted(names, key=lambda n: -1 if layer[n] is None else -layer[n]):
        i = layer[name]  # checked in backward's order: head, layer 2, 1, 0
        assert name in out["grads"], f"{name} got no gradient"
        r, g = ref[name], assert_plain(out["grads"][name], torch.Tensor, f"the gradient of {name}")
        assert g.shape == r.shape, f"the gradient of {name} has shape {tuple(g.shape)}"
        err = (g - r).abs().max().item() / max(r.abs().max().item(), 1e-3 * scale)
        if i is None:
            hint = "with a head, rebuild X_L as well and start from kernels.collapse_backward"
        elif i == 2:
            hint = (f"layer {i}'s backward must read its own input X_{i} (rebuilt from X_0"
                    f" by the post-mix of the layers before), its coefficients, f_{i}")  # fmt: skip
        else:
            hint = (f"the layers after it are right, so the gradient passed down from layer "
                    f"{i + 1} is wrong: it is B^T dX' (mix_out_backward's dX) plus the pre-mix's "
                    f"and the norm's terms (mix_in_backward)")  # fmt: skip
        label = "hyper_head" if i is None else f"layer {i}"
        assert err < 1e-9, (
            f"{label} {name}: gradient differs from the plain layers by {err:.1e}: {hint}"
        )
    got_x = assert_plain(out["stream"], torch.Tensor, "the block input's gradient")
    assert got_x.shape == ref_x.shape, f"dX_0 has shape {tuple(got_x.shape)}"
    err = (got_x - ref_x).abs().max().item() / ref_x.abs().max().item()
    assert err < 1e-9, f"the block input's gradient dX_0 differs by {err:.1e}"


@pytest.mark.grade(points=1, solution="mhc.RecomputedBlock.backward", needs=NEEDS_KERNELS)
@pytest.mark.parametrize("path", [p for p in PATHS if p.startswith("optimised L")])
def test_recomputed_training_tracks_the_reference_over_steps_fp32(path):
    params = mhc_params(6)
    out = call("mhc:training", PATHS[path], params)
    reference = stored("mhc", "training", lambda: H.reference_steps(params, 6, 3, 4))
    steps = assert_plain(out["steps"], list, "the steps")
    assert len(steps) == 3, f"3 steps were asked for, {len(steps)} came back"
    for step, (got, (ref_loss, ref)) in enumerate(zip(steps, reference, strict=True)):
        assert_loss_close(got["loss"], ref_loss, FP32["loss"], f"{path} step {step}")
        assert_grads_close(got["grads"], ref, FP32["grads"], f"{path} step {step}")
        assert got["calls"] == (step + 1) * 6, (
            f"F must run once per layer per step: {got['calls']} runs after {step + 1} steps of 6 "
            f"layers; backward must use the graph forward kept, not run F again"
        )


# ---- the 1F1B schedule ---------------------------------------------------------------------------


def peak_in_flight(order, where):
    """The most micro-batches whose forward ran and whose backward has not."""
    in_flight, peak = set(), 0
    for kind, i in order:
        if kind == "F":
            in_flight.add(i)
        else:
            assert i in in_flight, f"{where}: backward {i} before its forward"
            in_flight.remove(i)
        peak = max(peak, len(in_flight))
    return peak


@pytest.mark.grade(points=2, solution="mhc.one_f_one_b")
def test_one_f_one_b_schedule():
    cases = [(4, 6), (1, 3), (2, 2), (4, 4), (4, 7), (3, 5)]
    cases = [(n_stages, stage, n_micro) for n_stages, n_micro in cases for stage in range(n_stages)]
    orders = call("mhc:one_f_one_b", cases)
    for (n_stages, stage, n_micro), order in zip(cases, orders, strict=True):
        order = [tuple(e) for e in order]
        where = f"stage {stage} of {n_stages}, {n_micro} micro-batches"
        every = [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]
        assert sorted(order) == sorted(every), (
            f"{where}: every micro-batch must run one forward and one backward, got {order}"
        )
        warmup = n_stages - stage - 1
        leading = next(k for k, (kind, _) in enumerate(order) if kind == "B")
        assert leading == warmup + 1, (
            f"{where}: {leading} forwards before the first backward, expected {warmup + 1}: "
            + ("the warm-up is n_stages - stage - 1 forwards"
               if leading > warmup + 1 else "the steady state runs a forward, then a backward")
        )  # fmt: skip
        steady = order[warmup : 2 * n_micro - warmup]
        assert [k for k, _ in steady] == ["F", "B"] * (n_micro - warmup), (
            f"{where}: after the warm-up, the steady state runs a forward, then a backward, "
            f"until the forwards are done; got {order}"
        )
        peak = peak_in_flight(order, where)
        assert peak == min(n_stages - stage, n_micro), f"{where}: holds {peak} micro-batches"
        assert [i for k, i in order if k == "B"] == list(range(n_micro)), (
            f"{where}: backwards must run in micro-batch order, got {order}"
        )
    # written out by hand: 4 stages, 6 micro-batches, stage 1 has 2 warm-up forwards
    expected = [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2),
                ("F", 5), ("B", 3), ("B", 4), ("B", 5)]  # fmt: skip
    got = [tuple(e) for e in orders[cases.index((4, 1, 6))]]
    assert got == expected, f"stage 1 of 4, 6 micro-batches: got {got}, want {expected}"


# ---- pipeline parallelism ------------------------------------------------------------------------

NEEDS_PIPELINE = ("mhc.one_f_one_b", "mhc.RecomputedBlock.backward", *NEEDS_KERNELS)
N_MICRO = 4


def stage_share(n_layers, world_size, stage):
    """Layers [first, stop) of ``stage``: an equal contiguous share, as the docstring says."""
    size = n_layers // world_size
    return stage * size, (stage + 1) * size


def stage_params(params, n_layers, world_size, stage):
    """``params`` as stage ``stage`` gets them: its own layers, the embedding on the first stage
    and the head on the last keep their values; every other tensor is drawn anew (here, at
    grading time, a generator per tensor), so no stage can run the others' part alone."""
    first, stop = stage_share(n_layers, world_size, stage)

    def owned(name):
        part, _, rest = name.partition(".")
        if part in ("sublayers", "hcs"):
            return first <= int(rest.split(".")[0]) < stop
        if part == "embed":
            return stage == 0
        return stage == world_size - 1  # the head: hyper_head, norm, lm_head

    def other(name, shape):  # a value this stage never reads
        return torch.randn(shape, generator=generator("mhc", "other", stage, name))

    return {n: value if owned(n) else other(n, value.shape) for n, value in params.items()}


def check_pipeline(results, ref_steps, world_size, n_layers):
    for step, (ref_loss, ref_grads) in enumerate(ref_steps):
        merged = {}
        for rank, result in enumerate(results):
            first, stop = stage_share(n_layers, world_size, rank)
            assert len(result["steps"]) == len(ref_steps), f"rank {rank}: a step is missing"
            got = result["steps"][step]
            where = f"stage {rank} of {world_size}, step {step}"
            peak = peak_in_flight([tuple(e) for e in got["order"]], where)
            assert peak <= world_size - rank, (
                f"{where} held {peak} micro-batches' activations at once: 1F1B holds at most "
                f"n_stages - stage = {world_size - rank} (every forward, then every backward, is "
                f"GPipe); run the order one_f_one_b gives; order: {got['order']}"
            )
            ran = sorted(tuple(e) for e in got["order"])
            assert ran == sorted((k, i) for k in "FB" for i in range(N_MICRO)), (
                f"{where}: each of the {N_MICRO} micro-batches must run this stage's layers "
                f"(model.run_layers) forward once and backward once; got {got['order']}"
            )
            assert (got["loss"] is not None) == (rank == world_size - 1), (
                f"{where}: the loss is returned on the last stage only, None elsewhere"
            )
            owned = {n for n in got["grads"] if n.startswith(("sublayers.", "hcs."))}
            layers = {int(n.split(".")[1]) for n in owned}
            assert layers == set(range(first, stop)), (
                f"{where}: gradients for layers {sorted(layers)}, expected {first}..{stop - 1}"
            )
            both = sorted(merged.keys() & got["grads"].keys())
            assert not both, f"two stages made the gradient of {both[0]}"
            merged.update(got["grads"])
            stream_bytes = N_MICRO * 2 * 8 * N * DIM * 4  # 4 micro-batches of [2, 8, n=4, 16] fp32
            if rank < world_size - 1:
                sent = got["stats"]["bytes_sent_forward"]
                assert sent == stream_bytes, f"{where}: sent {sent} bytes forward, {stream_bytes}"
            if rank > 0:
                sent = got["stats"]["bytes_sent_backward"]
                assert sent == stream_bytes, f"{where}: sent {sent} bytes backward, {stream_bytes}"
        loss = results[-1]["steps"][step]["loss"]
        assert abs(loss / ref_loss - N_MICRO) > 1e-3, (
            f"the last stage's loss is n_micro = 4 times one process's ({loss:.4f} vs "
            f"{ref_loss:.4f}): divide each micro-batch's loss by n_micro (the mean over the batch)"
        )
        assert abs(loss - ref_loss) < FP32["loss"] * abs(ref_loss), (
            f"step {step}: the last stage's loss {loss:.6f} differs from one process's "
            f"{ref_loss:.6f}: each micro-batch's idx and targets must stay paired, and each "
            f"stage runs only its own layers (this test gives a stage other values for the rest)"
        )
        assert_grads_close(merged, ref_grads, FP32["grads"], f"{world_size} stages, step {step}")


@pytest.mark.grade(points=5, solution="mhc.pipeline_step", needs=NEEDS_PIPELINE)
@pytest.mark.parametrize(
    "world_size,overlap",
    [
        pytest.param(1, True, marks=pytest.mark.slow),
        (2, True),
        (2, False),
        pytest.param(3, True, marks=pytest.mark.ungraded),
        pytest.param(4, True, marks=(pytest.mark.ungraded, pytest.mark.slow)),
    ],
)
def test_pipeline_equals_single_process(world_size, overlap):
    """Stages of 12 layers, 2 SGD steps, 4 micro-batches: the merged gradients and the loss equal
    the plain model's on one process, and each stage holds at most n_stages - stage micro-batches
    (1F1B's point: GPipe's order gives the same numbers and holds all of them). Each stage is
    given true values only for what it runs (stage_params)."""
    n_layers, steps = 12, 2
    params = mhc_params(n_layers, seed=10 * world_size + overlap)  # every case its own model
    own = [{"params": stage_params(params, n_layers, world_size, s)} for s in range(world_size)]
    results = on_ranks("mhc:pipeline", world_size, n_layers, steps, overlap, per_rank=own,
                       timeout=120)  # fmt: skip
    key = f"pipeline {world_size} {overlap}"
    ref_steps = stored("mhc", key, lambda: H.reference_steps(params, n_layers, steps, 8))
    assert len(results) == world_size, f"{len(results)} stages answered, {world_size} ran"
    check_pipeline(results, ref_steps, world_size, n_layers)


@pytest.mark.grade(points=1, solution="mhc.pipeline_step", needs=NEEDS_PIPELINE)
def test_pipeline_step_runs_the_variant_it_is_given():
    """At one stage, pipeline_step(variant=...) keeps what model(idx, targets, variant=...) keeps
    (summed over its micro-batches): 'optimised' keeps far less than 'naive'."""
    params = mhc_params(4)
    saved = call("mhc:variant_saved_bytes", params)
    # one stage holds every layer: its loss is the plain model's (what a forged count cannot give)
    [(ref_loss, _)] = stored("mhc", "variant", lambda: H.reference_steps(params, 4, 1, 8))
    for variant in ("naive", "optimised"):
        assert_loss_close(saved[f"{variant} loss"], ref_loss, FP32["loss"], f"variant {variant}")
    for key in ("naive", "optimised", "optimised model"):
        assert_plain(saved[key], int, f"the bytes kept by {key}")
    assert saved["optimised"] < saved["naive"], (
        f"pipeline_step ignored variant='optimised': it kept {saved['optimised']} bytes for "
        f"backward, not less than 'naive' ({saved['naive']}); pass variant and block to "
        f"model.run_layers"
    )
    assert saved["optimised"] == saved["optimised model"], (
        f"one stage must keep what the model keeps: {saved['optimised']} bytes, the model "
        f"{saved['optimised model']}"
    )
