"""Tracing models nobody here wrote, for tensor_ckpt: forwards TorchFX cannot take as they are.

FX turns every argument of forward into a proxy, so ``**kwargs``, a decorator, an optional
argument steering an ``if`` (``mask=None``) break the trace. ``fixed_forward`` gives the trace a
generated forward of the same class and attributes that takes only the traced arguments and
passes ``concrete_args`` {name: value} by keyword; ``bound_inputs`` takes a later call apart the
same way and refuses one whose fixed arguments are not as they were traced. The refusals for a
non-tensor example input and for code FX cannot trace live here too, and ``python_state``: what
a trace may have frozen into its graph, so tensor_ckpt keeps one plan per state.
"""

import inspect

import torch
import torch.nn as nn


def traced_arguments(module, concrete_args, n_inputs=None):
    """The names of forward's arguments a trace takes: the first ``n_inputs`` (default: those
    without a default) not fixed by ``concrete_args``; the rest keep their defaults."""
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.name not in concrete_args and p.kind in (p.POSITIONAL_ONLY,
                                                            p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    return [p.name for p in params if n_inputs is not None or p.default is p.empty][:n_inputs]


def fixed_forward(module, concrete_args, n_inputs):
    """An object of a subclass of ``module``'s class, sharing its ``__dict__`` (submodules,
    parameters, buffers, names), whose forward takes only ``traced_arguments``."""
    cls, forward = type(module), type(module).forward
    names = traced_arguments(module, concrete_args, n_inputs)
    scope, call = {"forward": forward, "fixed": concrete_args}, [f"{n}={n}" for n in names]
    exec(f"def bound(self, {', '.join(names)}):\n return forward(self, {', '.join(call)}, **fixed)",
         scope)  # fmt: skip
    root = object.__new__(type(cls.__name__, (cls,), {"forward": scope["bound"]}))
    root.__dict__ = module.__dict__
    return root


def _same(a, b):
    try:
        return a is b or bool(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
    except Exception:  # a tensor against a non-tensor, a value with no truth value for ==
        return False


def bound_inputs(module, concrete_args, n_inputs, args, kwargs):
    """The traced arguments of a call, in order; every other one must be as it was traced."""
    signature = inspect.signature(module.forward)
    given = signature.bind(*args, **kwargs).arguments
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            given.update(given.pop(p.name, {}))
    traced = traced_arguments(module, concrete_args, n_inputs)
    inputs = tuple(given.pop(name) for name in traced if name in given)
    for name, value in given.items():
        p = signature.parameters.get(name)
        fixed = concrete_args.get(name, p.default if p is not None else "not passed")
        if not _same(value, fixed):
            raise ValueError(
                f"tensor_ckpt: argument '{name}' is {type(value).__name__} {value!r:.60}, "
                f"but the trace fixed it at {fixed!r:.60}. Fix: pass it in concrete_args="
                f"{{'{name}': ...}} with this value, or trace it as an example input."
            )
    return inputs


def refuse_examples(module, concrete_args, example_inputs):
    """A non-tensor example input would become a proxy: it belongs in ``concrete_args``."""
    names = [n for n in inspect.signature(module.forward).parameters if n not in concrete_args]
    for name, v in zip(names, example_inputs):
        if not isinstance(v, torch.Tensor):
            raise ValueError(
                f"tensor_ckpt: example input '{name}' is {v!r}, not a tensor: a traced argument "
                f"becomes a proxy, so `if {name} is None` would take the wrong branch. "
                f"Fix: concrete_args={{'{name}': {v!r}}}."
            )


def untraceable(module, err):
    """The refusal for code FX cannot trace, naming the innermost module it failed in."""
    path, cls = getattr(err, "inside", ("", type(module)))
    where = f"inside '{path}' ({cls.__name__})" if path else type(module).__name__
    return ValueError(
        f"tensor_ckpt: torch.fx cannot trace {where}: {str(err).splitlines()[0]}\n"
        "Python control flow on a traced value (an `if`/`while` on a tensor, len() of a tensor) "
        f"has no graph form. Fix: pass leaf_modules=({cls.__name__},) so it runs as one opaque "
        "node (nothing inside it can then be forgotten), fix the arguments that steer it with "
        "concrete_args={name: value}, or express the branch with tensor ops (torch.where)."
    )


def refuse_names(unknown, nodes, tensor_names):
    """``names=`` that are no node of the graph; a torch.nn module is traced whole unless asked."""
    leaves = [n.target for n in nodes if n.op == "call_module" and
              any(u.startswith(n.target + ".") for u in unknown)]  # fmt: skip
    inside = (f" '{unknown[0]}' is inside the leaf module '{leaves[0]}': FX keeps torch.nn "
              "modules whole; pass its class in trace_into=(...) to trace inside it."
              if leaves else "")  # fmt: skip
    raise ValueError(
        f"tensor_ckpt: no node named {unknown} in the traced graph.{inside} "
        f"Pick from: {tensor_names}"
    )


def python_state(module):
    """What a trace may have frozen into the graph: the plain attributes of every submodule
    (``training``, a dropout's ``p``) and of the objects they hold (a config); autocast's state."""
    plain = (bool, int, float, str, type(None), torch.dtype, torch.device)

    def is_plain(v):
        return isinstance(v, plain) or (isinstance(v, (tuple, list)) and all(map(is_plain, v)))

    state, seen = [], set()
    for name, m in module.named_modules():
        held = [v for v in vars(m).values() if hasattr(v, "__dict__") and not callable(v)]
        for obj in [m, *(v for v in held if not isinstance(v, (nn.Module, torch.Tensor)))]:
            if id(obj) not in seen:
                seen.add(id(obj))
                state += [(name, k, repr(v)) for k, v in vars(obj).items() if is_plain(v)]
    autocast = (
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return tuple(state), tuple(autocast)
