"""tensor_ckpt with the tools practitioners combine it with: torch.compile, transformers' Llama,
concrete arguments compared by value, and data parallelism that agrees once.

References share none of tensor_ckpt's code: the same model run eagerly with no checkpointing, and
for memory the bytes a compiled graph of the plain model saves, counted by walking its autograd
graph. Tolerances: aot_eager runs the same aten kernels eagerly, so anything short of bitwise is a
bug; Inductor generates its own fused kernels (other summation orders), so it is compared in
float64, where reordering moves results by ~1e-15 and a wrong recompute by far more than 1e-9.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tensor_ckpt as tc
from benchmarks.ckpt_meters import saved_by_graph
from tensor_ckpt import checkpoint_tensors, forget
from tools.spawn import run_ranks

B, T, C, H = 2, 8, 32, 4


@pytest.fixture(autouse=True)
def fresh_dynamo():  # each checkpointed module compiles its own graphs: stay under the cache limit
    torch._dynamo.reset()


def outputs_and_grads(module, fn, *inputs, **kwargs):
    """Output and the gradients of every parameter and input, for loss = sum(out * weights)."""
    module.zero_grad(set_to_none=True)
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs, **kwargs)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return [out.detach()] + [p.grad for p in module.parameters()] + [x.grad for x in inputs]


def assert_bitwise(reference, ours, what):
    for i, (a, b) in enumerate(zip(reference, ours, strict=True)):
        assert torch.equal(a, b), f"{what}: tensor {i} differs by {(a - b).abs().max():.3g}"


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(C, 4 * C), nn.Linear(4 * C, C), nn.Dropout(0.3)

    def forward(self, x):
        h = forget(self.drop(F.gelu(self.fc1(x))))  # the backward's recompute replays the mask
        return self.fc2(forget(h * h))


class Graphs:
    """A torch.compile backend that records the FX graphs Dynamo hands it."""

    def __init__(self, backend):
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

    def compiled_the_forgetting(self):  # the checkpointed region Dynamo traced, not run eagerly
        return any("tag_activation_checkpoint" in gm.code for gm in self.graphs)


# -------------------------------------------------------------------------------------------------
# torch.compile(checkpoint_tensors(model)): the plan becomes the compiler's recompute policy
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["block", pytest.param("dropout", marks=pytest.mark.slow)])
def test_compiled_aot_eager_is_bitwise_with_the_plain_eager_model_and_forgets(model):
    torch.manual_seed(0)
    module = (tc.MarkedLayer(C, H) if model == "block" else DropoutMLP()).train()
    x = torch.randn(B, T, C)
    ckpt = checkpoint_tensors(module, (x,))
    graphs = Graphs("aot_eager")
    compiled = torch.compile(ckpt, backend=graphs)
    torch.manual_seed(1)
    plain = outputs_and_grads(module, module, x)
    torch.manual_seed(1)
    assert_bitwise(plain, outputs_and_grads(module, compiled, x), f"compiled {model}")
    assert graphs.compiled_the_forgetting(), "Dynamo ran the forgetting region eagerly"
    # memory, counted on the compiled graphs' own saved tensors: the plain model compiled the same
    # way keeps the plan's bytes more, less what the compiled graph keeps to replay a dropout's
    # mask (a fifth of the forgotten bytes here); forgetting one unit too few would fail
    params = [x, *module.parameters()]
    kept_plain = saved_by_graph(torch.compile(module, backend="aot_eager")(x), params)
    kept_ours = saved_by_graph(compiled(x), params)
    freed = sum(u.bytes_freed for u in ckpt.plan.units)
    assert kept_plain - kept_ours >= 0.75 * freed > 0, (kept_plain, kept_ours, freed)


@pytest.mark.slow
def test_compiled_inductor_equals_the_plain_model_in_float64():
    torch.manual_seed(0)
    stack = nn.Sequential(tc.MarkedLayer(C, H), tc.MarkedLayer(C, H)).double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    graphs = Graphs("inductor")
    ours = outputs_and_grads(
        stack, torch.compile(checkpoint_tensors(stack, (x,)), backend=graphs), x
    )
    assert graphs.compiled_the_forgetting()
    # dropout: Inductor draws its own masks, so the reference is the plain model compiled alike
    torch.manual_seed(0)
    dropout = DropoutMLP().double()
    compiled = torch.compile(checkpoint_tensors(dropout, (x,)), backend="inductor")
    torch.manual_seed(1)
    ours_dropout = outputs_and_grads(dropout, compiled, x)
    torch.manual_seed(1)
    plain_dropout = outputs_and_grads(dropout, torch.compile(dropout, backend="inductor"), x)
    pairs = zip(
        outputs_and_grads(stack, stack, x) + plain_dropout, ours + ours_dropout, strict=True
    )
    for i, (a, b) in enumerate(pairs):
        # float64: Inductor's fused kernels reorder sums (~1e-15); a wrong recompute is O(1e-1)
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9, msg=f"tensor {i}")
    stack, x = (
        stack.float(),
        x.float(),
    )  # and in float32, as trained: rounding of values ~1 is ~1e-6
    ours = outputs_and_grads(stack, torch.compile(checkpoint_tensors(stack, (x,))), x)
    for i, (a, b) in enumerate(zip(outputs_and_grads(stack, stack, x), ours, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"float32 tensor {i}")


class Switched(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.use_sin = nn.Linear(C, 4 * C), nn.Linear(4 * C, C), False

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(forget(torch.sin(h) if self.use_sin else F.gelu(h)))


@pytest.mark.slow
def test_compiled_model_re_plans_when_a_traced_flag_changes():
    torch.manual_seed(0)
    module, x = Switched(), torch.randn(B, T, C)
    ckpt = checkpoint_tensors(module, (x,))
    compiled = torch.compile(ckpt, backend="aot_eager")
    for flag in (False, True):  # the first plan recomputes GELU: it must not run once sin is on
        module.use_sin = flag
        plain = outputs_and_grads(module, module, x)
        assert_bitwise(plain, outputs_and_grads(module, compiled, x), f"use_sin={flag}")
    assert len(ckpt.plans) == 2


def test_compiled_the_two_ways_that_cannot_work_say_why_and_what_to_do():
    module, x = Switched(), torch.randn(B, T, C)
    with pytest.raises(ValueError, match=r"already compiled.*torch.compile\(checkpoint_tensors"):
        checkpoint_tensors(torch.compile(module, backend="aot_eager"), (x,))
    with pytest.raises(Exception, match="graph break .*compile it without fullgraph=True"):
        torch.compile(checkpoint_tensors(module, (x,)), backend="aot_eager", fullgraph=True)(x)


# -------------------------------------------------------------------------------------------------
# transformers' Llama: rotary position_embeddings as an input, shapes read as Python values
# -------------------------------------------------------------------------------------------------

FORGOTTEN = ["mul_1", "mul_7", "silu", "mul_8"]  # both RMSNorm outputs, SiLU, SiLU(gate) * up


def _llama(layers=1):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=C,
        intermediate_size=2 * C,
        num_attention_heads=H,
        num_key_value_heads=H // 2,
        num_hidden_layers=layers,
        vocab_size=64,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).train()
    return model, lambda h, t: model.rotary_emb(h, torch.arange(t).unsqueeze(0))


def test_llama_decoder_layer_bitwise_with_position_embeddings_as_an_input():
    model, rotary = _llama()
    layer, x = model.layers[0], torch.randn(B, T, C)
    cos, sin = rotary(x, T)
    ckpt = checkpoint_tensors(
        layer, {"hidden_states": x, "position_embeddings": (cos, sin)}, names=FORGOTTEN
    )
    assert [u.name for u in ckpt.plan.units] == FORGOTTEN and ckpt.plan.recompute_flops == 0
    plain = outputs_and_grads(layer, layer, x, position_embeddings=(cos, sin))
    ours = outputs_and_grads(layer, ckpt, x, position_embeddings=(cos.clone(), sin.clone()))
    assert_bitwise(plain, ours, "LlamaDecoderLayer")
    assert ckpt.recomputations == len(FORGOTTEN)
    # the attention reshapes with Python ints read off x.shape: another length is traced anew
    x, (cos, sin) = torch.randn(B, 2 * T, C), rotary(x, 2 * T)
    plain = outputs_and_grads(layer, layer, x, position_embeddings=(cos, sin))
    assert_bitwise(plain, outputs_and_grads(layer, ckpt, x, position_embeddings=(cos, sin)), "2T")
    assert len(ckpt.plans) == 2 and "for these input shapes only" in str(ckpt.plan)


def test_llama_decoder_layer_without_position_embeddings_says_which_argument_in_one_line():
    model, _ = _llama()
    x = torch.randn(B, T, C)
    with pytest.raises(ValueError) as refused:
        checkpoint_tensors(model.layers[0], (x,))
    text = str(refused.value)
    assert "\n" not in text and "position_embeddings" in text and "left at None" in text, text
    assert "LlamaAttention" in text and "cannot unpack non-iterable NoneType" in text, text
    assert "model.rotary_emb(hidden_states, position_ids)" in text, text  # what to pass
    # fixed to None, it is still the one to pass (not the last argument left at None)
    with pytest.raises(ValueError, match="pass 'position_embeddings' as an example input"):
        checkpoint_tensors(model.layers[0], (x,), concrete_args={"position_embeddings": None})


@pytest.mark.slow
def test_llama_model_bitwise_with_every_layer_checkpointed_and_concrete_args_by_value():
    model, rotary = _llama(layers=2)
    plain, tokens = copy.deepcopy(model), torch.randint(0, 64, (B, T))
    h, position_ids = torch.randn(B, T, C), torch.arange(T).unsqueeze(0)
    for i, layer in enumerate(model.layers):  # LlamaModel passes a new, equal position_ids
        model.layers[i] = checkpoint_tensors(
            layer,
            {"hidden_states": h, "position_embeddings": rotary(h, T)},
            names=FORGOTTEN,
            concrete_args={"position_ids": position_ids},
        )

    def run(lm):
        lm.zero_grad(set_to_none=True)
        out = lm(tokens, use_cache=False).last_hidden_state
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out.detach()] + [p.grad for p in lm.parameters()]

    assert_bitwise(run(plain), run(model), "LlamaModel")
    assert [layer.recomputations for layer in model.layers] == [len(FORGOTTEN)] * 2


class Scaled(nn.Module):
    """Tuple, list and dict arguments a trace fixes with concrete_args."""

    def forward(self, x, pair=None, items=None, table=None):
        return forget(x * pair[0] + pair[1] + items[0] * table["w"]).sin()


def test_concrete_args_compare_tuples_lists_and_dicts_of_tensors_by_value():
    x, w = torch.randn(B, T, C), torch.randn(C)
    fixed = {"pair": (w, w + 1), "items": [w * 2], "table": {"w": w - 1}}
    ckpt = checkpoint_tensors(Scaled(), (x,), concrete_args=fixed)
    copies = {k: torch.utils._pytree.tree_map(torch.clone, v) for k, v in fixed.items()}
    plain = outputs_and_grads(ckpt, Scaled(), x, **fixed)
    assert_bitwise(plain, outputs_and_grads(ckpt, ckpt, x, **copies), "equal copies")
    for name, other in [
        ("pair", (w, w + 2)),
        ("items", [w * 2, w]),
        ("table", {"v": w - 1}),
        ("items", [(w * 2).double()]),
    ]:
        with pytest.raises(ValueError, match=f"argument '{name}' .*differs from the value"):
            ckpt(x, **{**copies, name: other})


# -------------------------------------------------------------------------------------------------
# agree once: every rank agrees when the replica is built, each call checks only what is local
# -------------------------------------------------------------------------------------------------


def _steps_without_agreement(rank, world_size):
    import torch.distributed as dist

    import launch

    torch.manual_seed(0)
    model, x = tc.MarkedLayer(C, H), torch.randn(B, T, C) + rank
    ddp = tc.checkpoint_data_parallel(model, (x,), {"lr": 1e-3})

    def refuse(*args, **kwargs):
        raise AssertionError("an agreement collective ran after the replica was built")

    launch.agree = dist.all_gather_object = dist.broadcast_object_list = refuse
    for mode in ("train", "eval", "train"):  # a re-plan for a new state is local too
        getattr(model, mode)()
        ddp(x).square().sum().backward()
    with pytest.raises(ValueError, match="expected 1 inputs"):  # refused locally, no collective
        ddp(x, x)
    return len(ddp.module.plans)


def test_data_parallel_agrees_once_and_checks_each_call_locally():
    assert run_ranks(_steps_without_agreement, 2, timeout=120) == [2, 2]


def test_no_file_reaches_back_into_the_chapter():
    import ast
    import pathlib

    root = pathlib.Path(tc.__file__).parent

    def imports(path):
        tree = ast.parse((root / path).read_text())
        return {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
            n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
        }

    assert not [m for m in imports("tensor_ckpt.py") if m.startswith(("benchmarks", "tests"))]
    assert "tensor_ckpt" not in imports("interop/fx_models.py"), "fx_models imports the chapter"
    # the FX adapter is settled at the door: trace and plan_for see a plain root, flat tensors
    # and a tracer; no function of the chapter but checkpoint_tensors names fx_models
    tree = ast.parse((root / "tensor_ckpt.py").read_text())
    naming = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.ClassDef))
        for n in ast.walk(f)
        if isinstance(n, ast.Name) and n.id == "fx_models"
    }
    assert naming <= {"checkpoint_tensors"}, f"the FX adapter is entered from {sorted(naming)}"
