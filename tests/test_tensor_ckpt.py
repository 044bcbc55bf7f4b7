"""tensor_ckpt.py against references that share none of its code; the graded tests are in
tests/graded/test_tensor_ckpt.py.

References: the same module run eagerly with no checkpointing (forget() is the identity there), and
torch.utils.checkpoint. Gradients are compared with torch.equal: recomputation re-runs the same fp32
kernels on the same inputs, so anything short of bitwise equality is a bug, not rounding. Memory is
measured by memory_timeline (storages alive at the end of forward), never read off the plan; FLOPs
by FlopCounterMode over the backward. The one tolerance: data-parallel gradients against one process
on the whole batch, where the batch sum is split differently (fp32, rtol 1e-5).
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tensor_ckpt as tc
from benchmarks.ckpt_meters import activation_bytes as meter_bytes
from memory.memory_timeline import MemoryTimeline
from tensor_ckpt import checkpoint_tensors, flops_text, forget
from tools import spawn
from tools.spawn import run_ranks, run_torchrun

B, T, C, H = 2, 16, 32, 4
F32 = 4  # bytes


class MLP(nn.Module):
    def __init__(self, shared=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.fc3 = nn.Linear(4 * C, C) if shared else None
        self.shared = shared

    def forward(self, x):
        h = forget(F.gelu(self.fc1(x)))
        # shared: two gradients need h
        return self.fc2(h) + self.fc3(h) if self.shared else self.fc2(h)


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(C, 4 * C), nn.Linear(4 * C, C), nn.Dropout(0.3)

    def forward(self, x):
        return self.fc2(forget(self.drop(F.gelu(self.fc1(x)))))


def grads_of(module, x, fn, create_graph=False):
    """Output, then gradients of every parameter and of the input, for loss = sum(out * weights)."""
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    w = torch.linspace(-1, 1, out.numel()).view_as(out)  # not all-ones: each element its own weight
    params = [p for p in module.parameters()]
    gs = torch.autograd.grad((out * w).sum(), params + [x], create_graph=create_graph)
    return out.detach(), list(gs)


def assert_bitwise(a, b, why=""):
    out_a, grads_a = a
    out_b, grads_b = b
    why = f"{why}: " if why else ""
    assert torch.equal(out_a, out_b), f"{why}outputs differ by {(out_a - out_b).abs().max():.3g}"
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        assert torch.equal(ga, gb), f"{why}gradient {i} differs by {(ga - gb).abs().max():.3g}"


def activation_bytes(model, fn, x):
    """Measured: bytes one forward leaves alive for backward (memory_timeline's 'activations')."""
    tl = MemoryTimeline(model=model, name="fwd")
    tl.tag([x, *model.buffers()], "other")  # made before recording: not activations
    with tl.record():
        with tl.phase("forward", 0):
            out = fn(x)
        with tl.phase("backward", 0):
            out.sum().backward()
    return tl.peak("activations", step=0, phase="forward")


# -------------------------------------------------------------------------------------------------
# exactness
# -------------------------------------------------------------------------------------------------


def test_double_backward_matches_plain():
    # A gradient penalty: autograd re-attaches the graph to what the unpack hook returns, so the
    # recomputed (graph-free) tensor still differentiates correctly.
    model = MLP()
    x = torch.randn(B, T, C)
    ckpt = checkpoint_tensors(model, (x.requires_grad_(),))

    def penalty(fn):
        _, grads = grads_of(model, x, fn, create_graph=True)
        penalty = sum(g.square().sum() for g in grads)
        # allow_unused: fc2's bias gradient does not depend on any weight
        return torch.autograd.grad(penalty, list(model.parameters()), allow_unused=True)

    plain, ours = penalty(model), penalty(ckpt)
    assert sum(g is not None for g in plain) == 3
    for a, b in zip(plain, ours):
        assert (a is None and b is None) or torch.equal(a, b)


# -------------------------------------------------------------------------------------------------
# refused cases: each names the tensor and the fix
# -------------------------------------------------------------------------------------------------


class InplaceOnForgotten(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x):
        h = forget(torch.tanh(self.fc1(x)))
        h.mul_(2)
        return self.fc2(h)


class InplaceOnRecomputeInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x):
        a = self.fc1(x)
        h = forget(torch.sigmoid(a) * a)  # recomputed from a ...
        a.add_(1)  # ... which is then changed in place
        return self.fc2(h) + a


class InplaceInsideSubgraph(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x):
        a = self.fc1(x)
        b = a * 2
        b.add_(1)  # inside the recompute subgraph of h
        h = forget(torch.exp(b))
        return self.fc2(h)


class ForgetsOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        return forget(F.gelu(self.fc(x)))


class ForgetsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        return self.fc(forget(x.view(-1, C)))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent: FX cannot trace it
            h = h * 2
        return forget(h) + 1


class Gate(nn.Module):
    def forward(self, h):
        return h * 2 if h.sum() > 0 else h


class BranchInLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.gate, self.out = nn.Linear(C, C), Gate(), nn.Linear(C, C)

    def forward(self, x):
        return self.out(forget(self.gate(F.gelu(self.fc(x)))))


@pytest.mark.parametrize(
    "model, words",
    [
        (InplaceOnForgotten, ["'tanh'", "in-place", "mul_"]),
        (InplaceOnRecomputeInput, ["'mul'", "'fc1'", "add_", "out-of-place"]),
        (InplaceInsideSubgraph, ["'exp'", "'mul'", "'add_'", "in-place"]),
        (ForgetsOutput, ["'gelu'", "output"]),
        (ForgetsInput, ["'view'", "'x'", "input"]),
        (Branchy, ["control flow", "leaf_modules"]),
    ],
)
def test_refused_cases_raise_clear_errors(model, words):
    x = torch.randn(B, T, C, requires_grad=True)
    with pytest.raises(ValueError) as err:
        checkpoint_tensors(model(), (x,))
    for w in words:
        assert w in str(err.value), f"{w!r} missing from: {err.value}"


class ForgetsASize(nn.Module):
    def forward(self, x):
        return x * forget(x.size(-1))


def test_bad_arguments_are_refused():
    x = torch.randn(B, T, C, requires_grad=True)
    with pytest.raises(ValueError, match="forget\\(\\) needs a tensor"):
        checkpoint_tensors(ForgetsASize(), (x,))
    with pytest.raises(ValueError, match="no node named"):
        checkpoint_tensors(MLP(), (x,), names=["nonexistent"])
    with pytest.raises(ValueError, match="1 inputs"):
        checkpoint_tensors(MLP(), (x, x))
    ckpt = checkpoint_tensors(MLP(), (x,))
    with pytest.raises(ValueError, match="expected 1 inputs"):
        ckpt(x, x)


class GeluOfInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        return self.fc(forget(F.gelu(x)))  # recomputed from x, which the caller could still change


def test_changes_after_forward_are_caught_in_backward_like_autograd_does():
    model = GeluOfInput()
    x = torch.randn(B, T, C, requires_grad=True)
    ckpt = checkpoint_tensors(model, (x,))
    out = ckpt(x)
    with torch.no_grad():
        x.add_(1)  # what the GELU is redone from
    with pytest.raises(RuntimeError, match="modified in place after forward"):
        out.sum().backward()
    # a kept saved tensor changed in place: plain autograd refuses; hooks would silently skip the
    # check
    out = ckpt(x)
    with torch.no_grad():
        model.fc.weight.mul_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# -------------------------------------------------------------------------------------------------
# data parallel: each rank checkpoints its own replica
# -------------------------------------------------------------------------------------------------


def test_demo_runs_under_torchrun():
    out = run_torchrun("tensor_ckpt.py", nproc=2, args=["--steps", "2"], timeout=240).stdout
    assert "gradients bitwise equal to the plain model: True" in out
    assert "tensor_ckpt plan:" in out and "saved" in out


# -------------------------------------------------------------------------------------------------
# state captured at trace time (issue 9, items 16-19)
# -------------------------------------------------------------------------------------------------


class ModeDependent(nn.Module):
    """The two ways a forward reads its mode as a Python value, which FX freezes at trace time."""

    def __init__(self, p=0.3):
        super().__init__()
        self.p = p
        self.qkv, self.fc = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4).unbind(0)
        dropout_p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        h = forget(F.dropout(F.gelu(y.transpose(1, 2).reshape(B, T, C)), self.p, self.training))
        return self.fc(h)


def seeded(fn, seed=5):
    torch.manual_seed(seed)
    return fn()


def test_plan_built_in_eval_and_run_in_train_gives_exact_gradients():
    model = DropoutMLP().eval()
    x = torch.randn(B, T, C, requires_grad=True)
    ckpt = checkpoint_tensors(model, (x,))
    model.train()
    plain = seeded(lambda: grads_of(model, x, model))
    ours = seeded(lambda: grads_of(model, x, ckpt))
    assert_bitwise(plain, ours)
    assert ckpt.plan.units[0].random_nodes == ["drop"]  # the train-mode plan replays the mask


@pytest.mark.parametrize("built_in", ["train", "eval"])
def test_mode_read_as_a_python_value_follows_the_module(built_in):
    torch.manual_seed(0)
    model = ModeDependent()
    getattr(model, built_in)()
    x = torch.randn(B, T, C, requires_grad=True)
    ckpt = checkpoint_tensors(model, (x,))
    for mode in ("eval", "train", "eval"):
        getattr(ckpt, mode)()  # the wrapper's mode is the model's mode
        assert model.training == (mode == "train")
        assert_bitwise(
            seeded(lambda: grads_of(model, x, model)), seeded(lambda: grads_of(model, x, ckpt))
        )
        with torch.no_grad():
            assert torch.equal(seeded(lambda: model(x)), seeded(lambda: ckpt(x)))
    model.eval()
    assert torch.equal(ckpt(x), ckpt(x)), "the checkpointed model must not drop out in eval()"


class ScaledDropout(DropoutMLP):
    def forward(self, x):
        return self.fc2(forget(self.drop(F.gelu(self.fc1(x))) * 2))  # recompute: gelu, drop, mul


def test_randomness_is_found_in_the_graph_not_only_in_the_example_run():
    # Dropout(p=0) draws nothing in the example run; p raised afterwards must still replay its mask.
    model = ScaledDropout().train()
    model.drop.p = 0.0
    x = torch.randn(B, T, C, requires_grad=True)
    ckpt = checkpoint_tensors(model, (x,))
    model.drop.p = 0.5
    assert_bitwise(
        seeded(lambda: grads_of(model, x, model)), seeded(lambda: grads_of(model, x, ckpt))
    )


class NormedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn, self.fc1, self.fc2 = nn.BatchNorm1d(T), nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        return self.fc2(forget(F.gelu(self.fc1(self.bn(x)))))


def test_checkpoint_tensors_leaves_the_models_state_alone():
    model = NormedMLP().train()
    x = torch.randn(B, T, C, requires_grad=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = checkpoint_tensors(model, (x,))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by checkpoint_tensors"
    model.eval()  # a plan built lazily for a new mode must not touch the state either
    ckpt(x).sum().backward()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by the eval-mode plan"
    model.train()  # and one real training forward updates the statistics exactly once
    reference = NormedMLP().train()
    reference.load_state_dict(before)
    reference(x)
    ckpt(x)
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference.state_dict()[k]), f"{k} updated other than once"


def test_plan_counts_the_rng_snapshot_it_keeps():
    model = DropoutMLP().train()
    x = torch.randn(B, T, C, requires_grad=True)
    ckpt = checkpoint_tensors(model, (x,))
    saved = seeded(lambda: meter_bytes(model, x)[0]) - seeded(lambda: meter_bytes(ckpt, x)[0])
    assert ckpt.plan.rng_bytes == torch.get_rng_state().nbytes > 0
    assert ckpt.plan.bytes_freed == saved == B * T * 4 * C * F32 - ckpt.plan.rng_bytes
    timeline = seeded(lambda: activation_bytes(model, model, x)) - seeded(
        lambda: activation_bytes(model, ckpt, x)
    )
    assert timeline == saved  # memory_timeline sees the snapshot too


def test_an_empty_example_batch_is_refused():
    with pytest.raises(ValueError, match="empty"):
        checkpoint_tensors(MLP(), (torch.randn(0, T, C),))


def test_forgetting_a_view_of_attention_warns_with_the_op_and_its_flops():
    x = torch.randn(B, T, C, requires_grad=True)
    with pytest.warns(UserWarning) as record:
        ckpt = checkpoint_tensors(tc.MarkedLayer(C, H), (x,), names=["reshape"])
    text = str(record[0].message)
    flops = ckpt.plan.units[0].op_flops
    sdpa = dict(flops)["scaled_dot_product_attention"]
    assert "'reshape'" in text and "scaled_dot_product_attention" in text
    assert flops_text(sdpa) in text and sdpa > 0
    with warnings.catch_warnings():  # the V4 marks recompute no matmul: no warning
        warnings.simplefilter("error")
        checkpoint_tensors(tc.MarkedLayer(C, H), (x,))


# -------------------------------------------------------------------------------------------------
# fault matrix: data-parallel replicas at 2 and 3 ranks end with a named error, never a hang
# -------------------------------------------------------------------------------------------------


def _replica_step(rank, world_size, bad_rank, fault):
    """One data-parallel step of tc.MarkedLayer; ``bad_rank`` gets ``fault``."""
    torch.manual_seed(0)
    seq, dtype, lr, seed = T, torch.float32, 1e-3, 0
    if rank == bad_rank:
        seq = T // 2 if fault == "shape" else 0 if fault == "empty" else seq
        dtype = torch.float64 if fault == "dtype" else dtype
        lr = 2e-3 if fault == "lr" else lr
        seed = 1 if fault == "init" else seed
    torch.manual_seed(seed)
    model = tc.MarkedLayer(C, H).to(dtype)
    x = torch.randn(B, seq, C, dtype=dtype)
    ddp = tc.checkpoint_data_parallel(model, (x,), dict(lr=lr))
    out = ddp(x)
    if rank == bad_rank and fault == "raise":
        raise RuntimeError(f"rank {rank} fails mid-step")
    out.square().sum().backward()
    return True


FIELD_OF_FAULT = {
    "shape": "example input shapes",
    "dtype": "example input dtypes",
    "lr": "lr",
    "init": "initial parameter values",
    "empty": "empty",
}


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_rank_that_raises_mid_step_is_reported_not_waited_for(world_size):
    bad = world_size - 1
    with pytest.raises(spawn.RankFailure) as err:
        run_ranks(_replica_step, world_size, args=(bad, "raise"), timeout=60)
    assert f"rank {bad} fails mid-step" in err.value.errors[bad]


def _every_fault(rank, world_size):
    """Each fault in turn in one launch (starting ranks is the slow part): the errors seen."""
    seen = {}
    for fault in FIELD_OF_FAULT:
        try:
            _replica_step(rank, world_size, 1, fault)
            seen[fault] = "no error"
        except ValueError as err:
            seen[fault] = str(err)
    return seen


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_rank_with_different_input_makes_every_rank_raise_the_same_error(world_size):
    seen = run_ranks(_every_fault, world_size, timeout=90)  # a hang would be a RankTimeout
    for fault, field in FIELD_OF_FAULT.items():
        messages = {rank_seen[fault] for rank_seen in seen}
        assert len(messages) == 1, messages  # the same ValueError on every rank
        (message,) = messages
        assert field in message, (fault, message)
        assert "rank 1 has" in message or fault == "empty", message


def test_command_line_help_and_arguments_checked_before_any_work(capsys):
    with pytest.raises(SystemExit) as helped:
        tc.parse_args(["--help"])
    assert helped.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--steps",
        "--batch",
        "--seq",
        "--dim",
        "--heads",
        "--lr",
        "--backend",
        "--device",
    ):
        assert option in text
    cases = [(["--dim", "130"], "multiple of --heads"), (["--lr", "nan"], "--lr"),
             (["--steps", "0"], "--steps"), (["--device", "cuda"], "no CUDA GPU")]  # fmt: skip
    for args, words in cases:  # refused by argparse, before setup() makes a process group
        with pytest.raises(SystemExit) as bad:
            tc.parse_args(args)
        assert bad.value.code == 2
        assert words in capsys.readouterr().err, args


# -------------------------------------------------------------------------------------------------
# the seams (issue 29): stale traces, models nobody here wrote, autocast
# -------------------------------------------------------------------------------------------------


class Switched(nn.Module):
    """Python values read in forward, which a trace freezes: a flag and a dropout probability."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.use_tanh, self.p = False, 0.0

    def forward(self, x):
        h = self.fc1(x)
        h = torch.tanh(h) if self.use_tanh else F.gelu(h)
        return self.fc2(forget(F.dropout(h, self.p, self.training) * 2))


def test_a_flag_or_dropout_p_changed_after_tracing_re_plans():
    model = Switched().train()
    x = torch.randn(B, T, C, requires_grad=True)
    ckpt = checkpoint_tensors(model, (x,))
    assert_bitwise(grads_of(model, x, model), grads_of(model, x, ckpt))
    model.use_tanh = True  # the first trace ran F.gelu: it must not be replayed
    assert_bitwise(grads_of(model, x, model), grads_of(model, x, ckpt))
    assert "gelu" not in [n.name for n in ckpt.plan.units[0].nodes]  # a new trace, a new plan
    model.p = 0.4  # traced at p = 0: now the mask must be drawn, and replayed in backward
    assert_bitwise(
        seeded(lambda: grads_of(model, x, model)), seeded(lambda: grads_of(model, x, ckpt))
    )
    assert ckpt.plan.units[0].random_nodes == ["dropout"]


def _gpt2(**overrides):
    transformers = pytest.importorskip("transformers")
    config = dict(n_layer=2, n_embd=C, n_head=H, vocab_size=64, n_positions=T, bos_token_id=0,
                  eos_token_id=0)  # fmt: skip
    return transformers.GPT2Config(**{**config, **overrides})


def test_gpt2_block_bitwise_with_its_layer_norm_and_gelu_forgotten():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Block

    torch.manual_seed(0)
    block = GPT2Block(_gpt2()).train()  # dropout on: the masks must be the plain run's
    x = torch.randn(B, T, C, requires_grad=True)
    # GPT2Attention reads shapes as Python values: traced knowing the example's, for that shape
    ckpt = checkpoint_tensors(block, (x,), names=["ln_2"])
    assert ckpt.gm.meta["shapes"] and "for these input shapes only" in str(ckpt.plan)
    assert_bitwise(
        seeded(lambda: grads_of(block, x, block)), seeded(lambda: grads_of(block, x, ckpt))
    )
    ckpt = checkpoint_tensors(block, (x,), names=["ln_2", "mul_3"], leaf_modules=(GPT2Attention,))
    assert not ckpt.gm.meta["shapes"]  # traced symbolically: any shape
    assert [u.name for u in ckpt.plan.units] == ["ln_2", "mul_3"]
    assert ckpt.plan.bytes_freed > 0 and ckpt.plan.recompute_flops == 0
    assert_bitwise(
        seeded(lambda: grads_of(block, x, block)), seeded(lambda: grads_of(block, x, ckpt))
    )


def test_gpt2_lm_head_model_bitwise_with_every_block_checkpointed():
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_gpt2()).train()
    tokens = torch.randint(0, 64, (B, T))
    plain = copy.deepcopy(model)
    h = torch.randn(B, T, C)
    fixed = dict(use_cache=False, position_ids=torch.arange(T).unsqueeze(0))  # as GPT2Model calls
    for i, block in enumerate(model.transformer.h):
        model.transformer.h[i] = checkpoint_tensors(
            block, (h,), names=["ln_1", "ln_2", "mul_3"], leaf_modules=(GPT2Attention,),
            concrete_args=fixed,
        )  # fmt: skip

    def run(lm):
        lm.zero_grad(set_to_none=True)
        logits = lm(tokens, use_cache=False).logits
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        return logits.detach(), [p.grad for p in lm.parameters()]

    assert_bitwise(seeded(lambda: run(plain)), seeded(lambda: run(model)))
    assert all(b.recomputations == 3 for b in model.transformer.h)


def test_transformer_encoder_layer_traced_inside_bitwise():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(C, H, 2 * C, dropout=0.1, batch_first=True).train()
    x = torch.randn(B, T, C, requires_grad=True)
    with pytest.raises(ValueError, match="concrete_args=\\{'src_mask': None\\}"):
        checkpoint_tensors(layer, (x, None))  # an optional argument would become a proxy
    with pytest.raises(ValueError, match="inside the leaf module 'self_attn'.*trace_into"):
        checkpoint_tensors(layer, (x,), names=["self_attn.out_proj"])
    ckpt = checkpoint_tensors(layer, (x,), names=["norm1", "dropout"])  # the mask is replayed
    assert ckpt.plan.units[1].random_nodes == ["dropout"]
    assert_bitwise(
        seeded(lambda: grads_of(layer, x, layer)), seeded(lambda: grads_of(layer, x, ckpt))
    )
    stack = nn.Sequential(nn.Linear(C, C), layer)  # inside a container: a torch.nn leaf by default
    with pytest.raises(ValueError, match="trace_into"):
        checkpoint_tensors(stack, (x,), names=["1.norm1"])
    ckpt = checkpoint_tensors(
        stack, (x,), names=["_1_norm1"], trace_into=(nn.TransformerEncoderLayer,)
    )
    assert_bitwise(
        seeded(lambda: grads_of(stack, x, stack)), seeded(lambda: grads_of(stack, x, ckpt))
    )


def test_autocast_is_re_entered_for_the_recompute():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(B, T, C, requires_grad=True)
    ckpt = checkpoint_tensors(model, (x,), names=["fc1", "gelu"])  # the recompute runs fc1's matmul

    def autocast(fn):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(x)

        return run

    plain, ours = grads_of(model, x, autocast(model)), grads_of(model, x, autocast(ckpt))
    assert plain[0].dtype == torch.bfloat16
    assert_bitwise(plain, ours)  # the same bf16 kernels on the same inputs: bitwise, not 1e-2
    assert ckpt.recomputations == 2


# -------------------------------------------------------------------------------------------------
# side effects: a buffer update, a hook, a Python-level draw happen as often as in the plain model
# -------------------------------------------------------------------------------------------------


class FunctionalNorm(nn.Module):
    """A norm of its own: F.batch_norm on its buffers, its counter updated by forward."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(T) + 0.5), nn.Parameter(torch.randn(T))
        self.register_buffer("running_mean", torch.zeros(T))
        self.register_buffer("running_var", torch.ones(T))
        self.register_buffer("num_batches_tracked", torch.tensor(0))

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
        w, b, m, v = self.weight, self.bias, self.running_mean, self.running_var
        return F.batch_norm(x, m, v, w, b, self.training, 0.1, 1e-5)


class SubclassedNorm(nn.BatchNorm1d):  # defined outside torch.nn (timm's way): traced through
    def forward(self, x):
        return super().forward(x) * 1.5


class Averaged(nn.Module):
    """A layer keeping an EMA of its input and a call counter, both updated in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.register_buffer("ema", torch.zeros(C))
        self.register_buffer("calls", torch.tensor(0))

    def forward(self, x):
        self.calls += 1
        self.ema.mul_(0.9).add_(x.detach().mean((0, 1)), alpha=0.1)
        return F.gelu(self.fc(x))  # GELU saves its input: forgetting it recomputes no matmul


class Stateful(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(C, C), norm, nn.Linear(C, C)

    def forward(self, x):
        return self.fc2(F.gelu(forget(self.norm(self.fc1(x)))))  # the norm's output recomputed


@pytest.mark.parametrize("norm", [FunctionalNorm, SubclassedNorm, Averaged])
def test_buffers_updated_in_forward_change_once_per_step_as_in_the_plain_model(norm):
    torch.manual_seed(0)
    plain = Stateful(norm(T) if norm is SubclassedNorm else norm()).train()
    model = copy.deepcopy(plain)
    x = torch.randn(B, T, C)
    ckpt = checkpoint_tensors(model, (x,))
    for step in range(3):
        assert_bitwise(grads_of(plain, x, plain), grads_of(model, x, ckpt), f"step {step}")
    assert ckpt.recomputations == 3, "the norm's output was not forgotten: nothing was tested"
    for (name, a), b in zip(plain.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b), f"buffer {name}: {b.flatten()[:3]} after 3 steps, plain {a}"
    assert_bitwise(grads_of(plain.eval(), x, plain), grads_of(model.eval(), x, ckpt), "eval")


class Assigned(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.register_buffer("calls", torch.tensor(0))
        self.steps = torch.zeros(())  # a tensor attribute, not a buffer

    def forward(self, x, how="assign"):
        if how == "assign":
            self.calls = self.calls + 1
        else:
            self.steps.add_(1)
        return self.fc(forget(torch.tanh(x)))


@pytest.mark.parametrize(
    "how, says",
    [("assign", "assigns a new tensor to 'calls'"), ("attribute", "changes 'steps' in place")],
)
def test_a_state_change_the_trace_cannot_record_is_refused_and_left_as_it_was(how, says):
    model = Assigned()
    with pytest.raises(ValueError, match=says) as refused:
        checkpoint_tensors(model, (torch.randn(B, T, C),), concrete_args={"how": how})
    assert "\n" not in str(refused.value) and "in place" in str(refused.value)
    assert model.calls is model._buffers["calls"] and int(model.calls) == 0
    assert isinstance(model.calls, torch.Tensor)


def test_forgetting_what_a_torch_nn_norm_computes_is_refused_naming_its_statistics():
    # nn.BatchNorm1d runs whole: its recompute would update its statistics a second time
    model = Stateful(nn.BatchNorm1d(T)).train()
    with pytest.raises(ValueError, match=r"re-runs 'norm', which updates 'norm\.") as refused:
        checkpoint_tensors(model, (torch.randn(B, T, C),))
    assert "trace_into" in str(refused.value)
    ckpt = checkpoint_tensors(model, (torch.randn(B, T, C),), trace_into=(nn.BatchNorm1d,))
    assert ckpt.plan.units[0].name == "batch_norm"  # traced inside, it can be forgotten


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.inner = nn.Linear(C, C), nn.Linear(C, C), MLP()

    def forward(self, x):
        return self.inner(self.fc2(forget(torch.tanh(self.fc1(x)))))


@pytest.mark.filterwarnings("ignore:tensor_ckpt. forgetting 'tanh' recomputes 'fc1'")
def test_hooks_run_as_on_the_plain_model_or_are_refused():
    torch.manual_seed(0)
    model, x, calls = Counted(), torch.randn(B, T, C), []
    ckpt = checkpoint_tensors(model, (x,))
    model.register_forward_hook(lambda m, args, out: calls.append(out.shape) or out * 2)
    pre = model.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    assert_bitwise(grads_of(model, x, model), grads_of(model, x, ckpt), "root hooks")
    assert len(calls) == 2, f"the root's forward hook ran {len(calls)}x for 2 forwards"
    pre.remove()
    ours = grads_of(model, x, ckpt)
    assert_bitwise(grads_of(model, x, model), ours, "the pre-hook removed after wrapping")
    # a leaf's hook runs once per forward; on a module the trace went through it is refused
    seen = []
    model.fc2.register_forward_hook(lambda m, args, out: seen.append(1))
    assert_bitwise(grads_of(model, x, model), grads_of(model, x, ckpt), "leaf hook")
    assert len(seen) == 2, f"fc2's hook ran {len(seen)}x for 2 forwards"
    handle = model.inner.register_forward_pre_hook(lambda m, args: (args[0] * 3,))
    with pytest.raises(ValueError, match=r"'inner' \(MLP\) has forward or backward hooks.*leaf"):
        ckpt(x)
    handle.remove()
    model.fc1.register_forward_hook(lambda m, args, out: seen.append(1))
    with pytest.raises(ValueError, match="re-runs 'fc1', which runs the hooks of 'fc1'"):
        ckpt(x)  # forgetting tanh recomputes fc1 (warned at wrap): its hook would run again


class LayerDrop(nn.Module):
    def __init__(self, draw):
        super().__init__()
        self.fc, self.draw = nn.Linear(C, C), draw

    def forward(self, x):
        h = forget(torch.tanh(self.fc(x)))
        return x if self.draw() < 0.5 else x + h


@pytest.mark.parametrize("draw, name", [("random", "random.random()"), ("numpy", "rand()")])
def test_a_python_level_draw_frozen_by_the_trace_is_refused(draw, name):
    import random

    np = pytest.importorskip("numpy")
    state = random.getstate()
    model = LayerDrop((lambda: random.random()) if draw == "random" else (lambda: np.random.rand()))
    with pytest.raises(ValueError, match="torch.rand") as refused:
        checkpoint_tensors(model, (torch.randn(B, T, C),))
    assert name in str(refused.value) and "test_tensor_ckpt.py" in str(refused.value)
    assert random.getstate() == state, "the refused trace moved Python's generator"


class Drawn(nn.Module):  # run whole (a leaf): it draws anew in every forward, as in the plain model
    def forward(self, x):
        import random

        return x * random.choice([0.5, 2.0])


class Redrawn(nn.Module):
    def __init__(self, recomputed):
        super().__init__()
        self.drawn, self.fc, self.recomputed = Drawn(), nn.Linear(C, C), recomputed

    def forward(self, x):  # tanh saves its output, not its input: its recompute re-runs the draw
        h = self.drawn(x)
        return self.fc(forget(torch.tanh(h) if self.recomputed else F.gelu(h)))


def test_a_leaf_drawing_from_python_random_is_refused_where_a_recompute_would_redraw():
    import random

    torch.manual_seed(0)
    model, x = Redrawn(recomputed=False), torch.randn(B, T, C, requires_grad=True)
    ckpt = checkpoint_tensors(model, (x,), leaf_modules=(Drawn,))
    runs = [(random.seed(3), grads_of(model, x, fn))[1] for fn in (model, ckpt)]
    assert_bitwise(*runs, "a draw in every forward")
    with pytest.raises(ValueError, match="re-runs 'drawn', which draws from Python's or NumPy's"):
        checkpoint_tensors(Redrawn(recomputed=True), (x,), leaf_modules=(Drawn,))
