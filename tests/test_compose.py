"""Tests for compose.py: K training steps on a layout pp x cp x dp equal K steps of
compose.reference_training, one process with none of the four techniques (plain mHC layers,
attention over the whole sequence, nothing forgotten, torch.optim.Muon + torch.optim.AdamW).

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

import functools

import pytest
import torch
from harness import RankFailure, RankTimeout, run_ranks

import compose

STEPS = 3
# every sublayer kind on 4 layers (CSA, MoE, HCA, MoE); T = 64 shards over 2 or 4 CP ranks, 96
# over 3 (a shard must hold whole blocks of m = 8); 6 layers over 3 stages
FAST = dict(n_layers=4, seq_len=64, hca_ratio=8)
LAYOUTS = [(p, c, w // (p * c)) for w in (1, 2, 3, 4) for p in range(1, w + 1)
           for c in range(1, w // p + 1) if w % (p * c) == 0]  # fmt: skip
DEFAULT = [(1, 2, 1), (2, 2, 1), (1, 2, 2)]  # the slow tier has the rest


def config(pp, cp):
    return compose.ComposeConfig(**FAST | {"n_layers": 6 if pp == 3 else 4,
                                           "seq_len": 96 if cp == 3 else 64})  # fmt: skip


def train_on_layout(rank, world, pp, cp, dp, grad_sync, ns_dtype):
    cfg, train = config(pp, cp), compose.Training(STEPS, grad_sync=grad_sync, ns_dtype=ns_dtype)
    losses, params, *_ = compose.run_layout(cfg, train, pp, cp, dp)
    return losses, {n: p.clone() for n, p in params.items()}


@functools.cache
def reference(pp, cp, dp, ns_dtype):
    train = compose.Training(STEPS, ns_dtype=ns_dtype)
    return compose.reference_training(config(pp, cp), dp, train)


def compare(layout, grad_sync="fp32", ns_dtype=torch.float32):
    """-> (max relative loss error, relative parameter-change error), over every rank."""
    pp, cp, dp = layout
    results = run_ranks(train_on_layout, pp * cp * dp, args=(*layout, grad_sync, ns_dtype),
                        timeout=300)  # fmt: skip
    ref_losses, ref_params = reference(pp, cp, dp, ns_dtype)
    start = dict(compose.make_model(config(pp, cp)).named_parameters())
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
    loss_err, param_err = compare(layout)
    assert loss_err < 1e-5, f"{layout}: losses differ from one process by {loss_err:.2e} (fp32)"
    assert param_err < 1e-2, f"{layout}: parameters differ from one process by {param_err:.2e}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
def test_every_layout_equals_one_process(layout):
    loss_err, param_err = compare(layout)
    assert loss_err < 1e-5, f"{layout}: losses differ from one process by {loss_err:.2e} (fp32)"
    assert param_err < 1e-2, f"{layout}: parameters differ from one process by {param_err:.2e}"


def test_v4_numerics_within_bf16():
    loss_err, _ = compare((1, 2, 2), "bf16_sr", torch.bfloat16)
    assert loss_err < 1e-2, f"bf16_sr sync + bf16 NS: losses {loss_err:.2e} from bf16 torch Muon"


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


@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_raises_mid_step_every_rank_says_so(world):
    layout = (2, 1, 1) if world == 2 else (2, 2, 1)
    with pytest.raises(RankFailure) as failure:
        run_ranks(_one_rank_raises, world, args=layout, timeout=120)
    assert not isinstance(failure.value, RankTimeout), "a rank waited for the one that raised"
    said = "compose: step 2 stopped on every rank: rank 1 raised Boom: rank 1 broke"
    for rank in range(world):
        assert said in failure.value.errors.get(rank, ""), f"rank {rank} did not say {said!r}"
