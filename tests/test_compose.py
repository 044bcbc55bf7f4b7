"""Tests for compose.py: K training steps on a layout pp x cp x dp equal K steps of
compose.reference_training, one process with none of the four techniques (plain mHC layers,
attention over the whole sequence, nothing forgotten, torch.optim.Muon + torch.optim.AdamW).

The proof that can fail runs in float64 (float64 parameters, exact gradient sync, float64
Newton-Schulz on both sides): the parameters' change from the initial weights,
||delta - delta_ref|| / ||delta_ref|| over the whole model, within 1e-6. float64 reassociation is
~1e-16 per op; through 3 steps of Muon's polar factor and AdamW's division the measured error is
~1e-12 (the gradients that vanish in exact arithmetic, below, get 1e-17 of noise: AdamW's eps
and Newton-Schulz's bounded slope keep it there). A learning rate 1% off is ~3e-3 away: it fails.

Tolerances, fp32 (fp32 gradient sync, fp32 Newton-Schulz on both sides):
- losses: 1e-5 relative. They differ only by summation order (per-rank partial sums, CP's
  reduce-scatter of the entries' gradients, 1F1B's micro-batch sums): fp32 reassociation, ~1e-7.
- parameters: the change from the initial weights, ||delta - delta_ref|| / ||delta_ref|| over the
  whole model, 1e-2. The same reassociation, amplified by what both optimizers do to a gradient
  rounding dominates: at init every lane of the stream is equal, so some gradients (the first
  layer's A and B biases, the HyperHead's lane weights in one direction) vanish in exact arithmetic;
  AdamW divides such a gradient by its own size and Muon's polar factor turns its smallest singular
  direction into a unit one. Those few tensors move by noise on both sides alike; the rest agree
  to ~1e-5.
- V4's numerics (bf16 stochastic-rounding gradient sync, bf16 Newton-Schulz) against the bf16
  torch.optim.Muon: losses within 1e-2 relative (bf16 keeps 8 mantissa bits).
"""

import math
from dataclasses import replace

import pytest
import torch

import compose
import cp_compress
import muon_zero
from tools.spawn import RankFailure, RankTimeout, run_ranks

STEPS = 3
# every sublayer kind on 4 layers (CSA, MoE, HCA, MoE); T = 64 shards over 2 or 4 CP ranks, 96
# over 3 (a shard must hold whole blocks of m = 8); 6 layers over 3 stages
FAST = dict(n_layers=4, seq_len=64, hca_ratio=8)
LAYOUTS = [(p, c, w // (p * c)) for w in (1, 2, 3, 4) for p in range(1, w + 1)
           for c in range(1, w // p + 1) if w % (p * c) == 0]  # fmt: skip
DEFAULT = [(1, 2, 1), (2, 2, 1)]  # the slow tier has the rest


FP64 = dict(grad_sync="exact", ns_dtype=torch.float64, dtype=torch.float64)
FP64_TOL = 1e-6


def config(pp, cp):
    return compose.ComposeConfig(**FAST | {"n_layers": 6 if pp == 3 else 4,
                                           "seq_len": 96 if cp == 3 else 64})  # fmt: skip


def train_on_layout(rank, world, pp, cp, dp, train):
    losses, params, *_ = compose.run_layout(config(pp, cp), train, pp, cp, dp)
    return losses, {n: p.clone() for n, p in params.items()}


REFERENCES = {}


def reference(pp, cp, dp, train):
    """The one-process run with train's numerics at the default learning rates (cached)."""
    right = replace(train, lr_muon=compose.Training.lr_muon, lr_adamw=compose.Training.lr_adamw)
    key = (config(pp, cp).seq_len, config(pp, cp).n_layers, dp, repr(right))
    if key not in REFERENCES:
        REFERENCES[key] = compose.reference_training(config(pp, cp), dp, right)
    return REFERENCES[key]


def compare(layout, train=compose.Training(STEPS), on_ranks=train_on_layout):
    """-> (max relative loss error, relative parameter-change error), over every rank, against
    the reference with the same numerics and the default learning rates. on_ranks: the rank
    function that trains the layout (a variant injects a mistake on the distributed side only)."""
    pp, cp, dp = layout
    results = run_ranks(on_ranks, pp * cp * dp, args=(*layout, train), timeout=300)
    ref_losses, ref_params = reference(pp, cp, dp, train)
    start = dict(compose.make_model(config(pp, cp)).to(dtype=train.dtype).named_parameters())
    loss_err = max(abs(a - b) / abs(b) for losses, _ in results for a, b in zip(losses, ref_losses))
    got = {n: t for _, params in results for n, t in params.items()}  # each stage's own
    trained = [n for n, p in start.items() if p.requires_grad]
    missing = set(trained) - set(got)
    assert not missing, f"no rank holds {sorted(missing)}: a stage lost its parameters"
    num = sum(((got[n] - ref_params[n]) ** 2).sum() for n in trained)
    den = sum(((ref_params[n] - start[n].detach()) ** 2).sum() for n in trained)
    return loss_err, (num / den).sqrt().item()


def _ids(layouts):
    return [f"pp{p}_cp{c}_dp{d}" for p, c, d in layouts]


@pytest.mark.parametrize("layout", DEFAULT, ids=_ids(DEFAULT))
def test_layout_equals_one_process(layout):
    loss_err, param_err = compare(layout, compose.Training(STEPS, **FP64))
    assert param_err < FP64_TOL, (
        f"{layout}: parameters differ from one process by {param_err:.2e} of their change (float64)"
    )
    assert loss_err < FP64_TOL, f"{layout}: losses differ from one process by {loss_err:.2e}"


def test_layout_equals_one_process_in_fp32():
    layout = (2, 2, 1)
    loss_err, param_err = compare(layout)
    assert loss_err < 1e-5, f"{layout}: losses differ from one process by {loss_err:.2e} (fp32)"
    assert param_err < 1e-2, f"{layout}: parameters differ from one process by {param_err:.2e}"


@pytest.mark.slow  # every factorisation of 1-4 ranks; the default tier has DEFAULT's
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
def test_every_layout_equals_one_process(layout):
    loss_err, param_err = compare(layout, compose.Training(STEPS, **FP64))
    assert param_err < FP64_TOL, f"{layout}: parameters {param_err:.2e} off (float64)"
    loss_err, param_err = compare(layout)
    assert loss_err < 1e-5, f"{layout}: losses differ from one process by {loss_err:.2e} (fp32)"
    assert param_err < 1e-2, f"{layout}: parameters differ from one process by {param_err:.2e}"


@pytest.mark.parametrize("wrong", [dict(lr_adamw=3e-3 * 1.01),
                                   pytest.param(dict(lr_muon=0.02 * 1.01), marks=pytest.mark.slow)],
                         ids=["adamw_lr", "muon_lr"])  # fmt: skip
def test_float64_check_fails_a_learning_rate_one_percent_off(wrong):
    """The float64 comparison can fail: a learning rate 1% off, on one process."""
    _, param_err = compare((1, 1, 1), compose.Training(STEPS, **FP64, **wrong))
    assert param_err > 100 * FP64_TOL, (
        f"a learning rate 1% off ({wrong}) passes as {param_err:.2e}: the check is blind"
    )


def train_without_the_halos_gradient(rank, world, pp, cp, dp, train):
    """train_on_layout with CP's halos detached: their gradient never reaches the previous rank."""
    exchange = cp_compress.halo_from_previous
    cp_compress.halo_from_previous = lambda x, rows, group=None: exchange(x, rows, group).detach()
    return train_on_layout(rank, world, pp, cp, dp, train)


def train_without_weight_decay_on_one_matrix(rank, world, pp, cp, dp, train):
    """train_on_layout with the first trained Muon matrix in a param group of weight decay 0."""
    split = muon_zero.muon_param_groups

    def muon_param_groups(model):
        groups = split(model)
        dense = next(g for g in groups if g["role"] == "dense")
        one = next(p for p in dense["params"] if p.requires_grad)
        dense["params"] = [p for p in dense["params"] if p is not one]
        return [*groups, {"params": [one], "role": "dense", "weight_decay": 0.0}]

    muon_zero.muon_param_groups = muon_param_groups
    return train_on_layout(rank, world, pp, cp, dp, train)


# the same layout without the mistake passes: test_layout_equals_one_process[pp1_cp2_dp1]
@pytest.mark.parametrize(
    "mistake",
    [
        train_without_the_halos_gradient,
        pytest.param(train_without_weight_decay_on_one_matrix, marks=pytest.mark.slow),
    ],
    ids=lambda m: m.__name__,
)
def test_float64_check_fails_a_mistake_on_the_distributed_side(mistake):
    """The float64 comparison can fail on 2 CP ranks: a dropped halo gradient, or one Muon
    matrix without weight decay."""
    _, param_err = compare((1, 2, 1), compose.Training(STEPS, **FP64), on_ranks=mistake)
    assert param_err > 100 * FP64_TOL, (
        f"{mistake.__name__} passes as {param_err:.2e} (tolerance {FP64_TOL:g}): the check is blind"
    )
    print(f"{mistake.__name__}: parameters {param_err:.2e} off")


def test_v4_numerics_within_bf16():
    v4 = compose.Training(STEPS, grad_sync="bf16_sr", ns_dtype=torch.bfloat16)
    loss_err, _ = compare((1, 2, 2), v4)
    assert loss_err < 1e-2, f"bf16_sr sync + bf16 NS: losses {loss_err:.2e} from bf16 torch Muon"


def _other_batch_on_rank_1(rank, world, pp, cp, dp, at_step):
    """Rank 1 draws another seed's rows from step `at_step` on. -> ("refused", line) or losses."""
    draw = compose.batch_tokens

    def batch(cfg, rows, step, seed=0):
        return draw(cfg, rows, step, seed + (rank == 1 and step >= at_step))

    compose.batch_tokens = batch
    try:
        return compose.run_layout(config(pp, cp), compose.Training(2), pp, cp, dp)[0]
    except compose.Refused as err:
        return ("refused", str(err))


# the refusal along cp stays in the default tier, along pp it is a slow case
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param((2, 1, 1), marks=pytest.mark.slow),
        (1, 2, 1),
        pytest.param((1, 1, 2), marks=pytest.mark.slow),
    ],
    ids=["pp", "cp", "dp"],
)
def test_a_rank_with_another_batch(layout):
    """Along the pipeline and CP every rank of a replica holds the same rows: one that differs is
    refused (at step 2, after the pipeline's own first-step check), with the same line on every
    rank. Along dp, replicas hold different rows by design: ordinary data parallelism."""
    out = run_ranks(_other_batch_on_rank_1, 2, args=(*layout, 1), timeout=120)
    if layout[2] == 2:
        assert all(isinstance(o, list) and len(o) == 2 for o in out), (
            f"dp=2 with different rows per replica is ordinary data parallelism, got {out}"
        )
        return
    said = "compose: step 2: the stages and CP shards of replica d=0 hold different batches"
    for rank, o in enumerate(out):
        assert isinstance(o, tuple) and o[1].startswith(said), f"rank {rank} trained on: {o}"
        assert "\n" not in o[1], f"rank {rank}: the refusal is not one line: {o[1]!r}"


def _non_finite(rank, world, where, allow):
    """1x2x1; at step 2 rank 1 poisons its loss (a NaN weight in the LM head of every rank) or one
    gradient (+inf in sublayers.1.router's)."""
    cfg, train = config(1, 2), compose.Training(2, allow_nonfinite=allow)

    def on_step(step, layout, model, opt, run):
        if step == 1 and where == "loss":
            with torch.no_grad():
                model.lm_head.weight[0, 0] = float("nan")
        if step == 1 and where == "gradient" and rank == 1:
            model.sublayers[1].router.register_hook(lambda g: g + float("inf"))
        return run()

    try:
        return compose.run_layout(cfg, train, 1, 2, 1, on_step=on_step)[0]
    except compose.Refused as err:
        return ("refused", str(err))


@pytest.mark.parametrize("where", ["loss", pytest.param("gradient", marks=pytest.mark.slow)])
def test_non_finite_stops_every_rank_naming_the_step_and_where(where):
    said = {
        "loss": "compose: step 2: the loss is nan (not finite)",
        "gradient": "compose: step 2: the gradient of sublayers.1.router is not finite (rank 1)",
    }[where]
    for rank, o in enumerate(run_ranks(_non_finite, 2, args=(where, False), timeout=120)):
        assert isinstance(o, tuple) and o[1].startswith(said), f"rank {rank}: {o}, not {said!r}"
    if where == "loss":  # on purpose: the run goes on and says what it got
        for rank, o in enumerate(run_ranks(_non_finite, 2, args=(where, True), timeout=120)):
            assert isinstance(o, list) and math.isnan(o[1]), f"rank {rank}: {o}"


@pytest.mark.parametrize("argv", [["--seq-len", "100000000"], ["--save", "/missing/dir/ckpt"]])
def test_options_that_would_fail_late_are_refused_first(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        compose.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "error:" in err, f"exit {stop.value.code}: {err}"
    assert argv[1] in err, f"the error does not name {argv[1]}: {err}"


class Boom(RuntimeError):
    pass


def _one_rank_raises(rank, world, pp, cp, dp):
    cfg, train = config(pp, cp), compose.Training(2)

    def explode(*_):
        raise Boom("rank 1 broke in the middle of its forward")

    def on_step(step, layout, model, opt, run):
        if step == 1 and rank == 1:  # its last F, as tensor_ckpt runs it
            model.forgetting[max(model.forgetting)].register_forward_hook(explode)
        return run()

    compose.run_layout(cfg, train, pp, cp, dp, on_step=on_step)


@pytest.mark.slow  # the other ranks wait out an abort
@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_raises_mid_step_every_rank_says_so(world):
    layout = (2, 1, 1) if world == 2 else (2, 2, 1)
    with pytest.raises(RankFailure) as failure:
        run_ranks(_one_rank_raises, world, args=layout, timeout=120)
    assert not isinstance(failure.value, RankTimeout), "a rank waited for the one that raised"
    said = "compose: step 2 stopped on every rank: rank 1 raised Boom: rank 1 broke"
    for rank in range(world):
        assert said in failure.value.errors.get(rank, ""), f"rank {rank} did not say {said!r}"


def test_run_layers_variants_mean_what_mhc_variants_mean(monkeypatch):
    """ComposeModel.run_layers takes mhc.VARIANTS with mhc's meanings: "fused" runs each layer as
    its own block (L_r = 1), "optimised" in blocks of mhc's default L_r, and both give the plain
    layers' stream (float64, 1e-12: the same sums, in another order)."""
    cfg = compose.ComposeConfig(**FAST)
    torch.manual_seed(0)
    model = compose.ComposeModel(cfg).double()
    model.attend(compose.documents(cfg))
    stream = torch.randn(2, cfg.seq_len, cfg.n_hc, cfg.dim, dtype=torch.float64)
    blocks, run = [], compose.mhc.run_recomputed_layers
    monkeypatch.setattr(
        compose.mhc, "run_recomputed_layers",
        lambda s, layers, block, **kw: blocks.append(block) or run(s, layers, block, **kw),
    )  # fmt: skip
    plain = model.run_layers(stream, 0, cfg.n_layers, "naive")
    for variant, block in [
        ("fused", 1),
        ("optimised", compose.mhc.default_recompute_block(cfg.n_hc, cfg.n_layers)),
    ]:
        out = model.run_layers(stream, 0, cfg.n_layers, variant)
        assert blocks.pop() == block, f'"{variant}" ran blocks of another L_r than mhc does'
        torch.testing.assert_close(out, plain, rtol=1e-12, atol=1e-12, msg=f'"{variant}" differs')
