"""Tracing models nobody here wrote, for tensor_ckpt: forwards TorchFX cannot take as they are.

FX turns every argument of forward into a proxy, so ``**kwargs``, a decorator, an optional argument
steering an ``if`` (``mask=None``) or a tuple of tensors (``position_embeddings=(cos, sin)``) break
the trace, and so does Python arithmetic on a shape (``(*x.shape[:-1], -1)``). ``Arguments`` says
which arguments a trace takes and gives it a generated forward of the same class that takes their
tensors one by one and passes ``concrete_args`` {name: value} by keyword; it takes every later call
apart the same way, refusing one whose fixed arguments are not as they were traced.
``ShapeFallback``, mixed into the tracer, traces again with proxies that answer shape, dtype and
device from the example inputs, as HF's old tracer did: the graph then holds for inputs shaped like
the examples.
The refusal for code FX cannot trace lives here too.
"""

import contextlib
import inspect
import sys

import torch
import torch.fx as fx
import torch.utils._pytree as pytree  # torch has no public pytree (flatten nested arguments)


class Arguments:
    """Which of forward's arguments a trace takes (``names``), their example tensors flattened
    (``examples``, one per placeholder) and structure (``spec``: a tensor each, or a tuple, list
    or dict of tensors), and the ``concrete_args`` fixed for every call."""

    def __init__(self, module, example_inputs, concrete_args=None):
        compiled = sys.modules.get("torch._dynamo.eval_frame")  # loaded by torch.compile
        if compiled is not None and isinstance(module, compiled.OptimizedModule):
            raise ValueError(
                "tensor_ckpt: the module is already compiled, and FX cannot trace a compiled "
                "forward. Fix: checkpoint the plain module, then compile the result: "
                "torch.compile(checkpoint_tensors(model, ...))."
            )
        self.module, self.fixed = module, dict(concrete_args or {})
        self.signature = inspect.signature(module.forward)
        params = self.signature.parameters.values()
        positional = [
            p.name
            for p in params
            if p.name not in self.fixed and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if isinstance(example_inputs, dict):  # {argument name: value}, for arguments not first
            named = dict(example_inputs)
            if unknown := [n for n in named if n not in positional]:
                raise ValueError(
                    f"tensor_ckpt: example input {unknown[0]!r} is no argument of "
                    f"{type(module).__name__}.forward that can be traced; pick from "
                    f"{positional}."
                )
        elif len(example_inputs) > len(positional):
            raise ValueError(
                f"tensor_ckpt: expected {len(positional)} inputs ({positional}), got "
                f"{len(example_inputs)}. Pass one value per argument of forward."
            )
        else:
            named = dict(zip(positional, example_inputs))
        for name, value in named.items():
            refuse_non_tensor(name, value)
        self.names = [n for n in positional if n in named]  # forward's order
        self.examples, self.spec = pytree.tree_flatten(tuple(named[n] for n in self.names))
        forward = type(module).forward
        plain = not (forward.__code__.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS))
        self.direct = (
            plain
            and not self.fixed
            and not hasattr(forward, "__wrapped__")
            and self.names == positional
            and len(self.examples) == len(self.names)
        )

    def leaf_names(self):  # one per placeholder: `x`, or `position_embeddings_0`, `..._1`
        values = pytree.tree_unflatten(list(self.examples), self.spec)  # one per name
        return [
            name if isinstance(v, torch.Tensor) else f"{name}_{i}"
            for name, v in zip(self.names, values)
            for i in range(len(pytree.tree_leaves(v)))
        ]

    def root(self):
        """The module itself when FX can take its forward as it is; otherwise an object of a
        subclass of its class, sharing its ``__dict__``, whose forward takes the leaf tensors."""
        if self.direct:
            return self.module
        cls, params = type(self.module), self.leaf_names()
        scope = {
            "forward": cls.forward,
            "fixed": self.fixed,
            "names": self.names,
            "spec": self.spec,
            "unflatten": pytree.tree_unflatten,
        }
        exec(
            f"def bound(self, {', '.join(params)}):\n"
            f" values = unflatten([{', '.join(params)}], spec)\n"
            " return forward(self, **dict(zip(names, values)), **fixed)",
            scope,
        )
        root = object.__new__(type(cls.__name__, (cls,), {"forward": scope["bound"]}))
        root.__dict__ = self.module.__dict__
        return root

    def flatten(self, args, kwargs):
        """The traced values of a call, as the trace's placeholders take them; every other argument
        must be as it was traced (by value: tensors, and tuples, lists and dicts of them)."""
        if self.direct and not kwargs:
            if len(args) != len(self.names):
                raise ValueError(
                    f"tensor_ckpt: expected {len(self.names)} inputs ({self.names}), "
                    f"got {len(args)}. Pass one value per argument of forward."
                )
            return list(args)
        try:
            given = self.signature.bind(*args, **kwargs).arguments
        except TypeError as err:
            raise ValueError(f"tensor_ckpt: {err}; the trace takes {self.names}.") from None
        for p in self.signature.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                given.update(given.pop(p.name, {}))
        if missing := [n for n in self.names if n not in given]:
            raise ValueError(
                f"tensor_ckpt: argument '{missing[0]}' was traced as an input; pass "
                "it in every call."
            )
        values = tuple(given.pop(n) for n in self.names)
        leaves, spec = pytree.tree_flatten(values)
        if spec != self.spec:
            as_traced = pytree.tree_unflatten(list(self.examples), self.spec)
            raise ValueError(
                f"tensor_ckpt: the traced arguments {self.names} came as {described(values)}; "
                f"the trace took {described(as_traced)}. Pass them as traced."
            )
        for name, value in given.items():
            p = self.signature.parameters.get(name)
            traced = self.fixed.get(name, p.default if p is not None else "not passed")
            if not same(value, traced):
                raise ValueError(
                    f"tensor_ckpt: argument '{name}' ({described(value)}) differs from the value "
                    f"the trace fixed ({described(traced)}). Fix: pass it in concrete_args="
                    f"{{'{name}': ...}} with this value, or trace it as an example input."
                )
        return leaves

    def tracers(self, tracer_class, *args):
        """examples -> a tracer_class(*args) with ShapeFallback mixed in, one per trace, falling
        back to the shapes of ``examples`` (one tensor per placeholder)."""
        adapted = type("Adapted" + tracer_class.__name__, (ShapeFallback, tracer_class), {})
        return lambda examples: adapted(*args, arguments=self, examples=examples)

    def fixed_at_none(self):  # arguments concrete_args fixed to None
        return [name for name, value in self.fixed.items() if value is None]

    def left_at_none(self):  # arguments neither traced nor fixed whose default is None
        return [
            p.name
            for p in self.signature.parameters.values()
            if p.default is None and p.name not in self.names and p.name not in self.fixed
        ]


def same(a, b):
    """Equal by value: tensors by dtype, shape and elements; tuples, lists, dicts item by item."""
    if a is b:
        return True
    (left, a_spec), (right, b_spec) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    return a_spec == b_spec and all(map(_same_leaf, left, right))


def _same_leaf(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and torch.equal(a, b)
        )
    try:
        return a is b or bool(a == b)
    except Exception:  # a value with no truth value for ==
        return False


def described(value):  # a value in a line: tensors by dtype and shape
    tensors = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    if not tensors:
        return f"{type(value).__name__} {value!r:.60}"
    return f"{type(value).__name__} of tensors " + ", ".join(
        f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}" for t in tensors
    )


def refuse_non_tensor(name, value):
    """An example input is a tensor, or a tuple, list or dict of tensors; anything else would
    become a proxy that Python code cannot branch on: it belongs in ``concrete_args``."""
    leaves = pytree.tree_leaves(value)
    if not leaves or not all(isinstance(v, torch.Tensor) for v in leaves):
        raise ValueError(
            f"tensor_ckpt: example input '{name}' is {value!r:.60}, not a tensor (or a tuple, list "
            f"or dict of tensors): a traced argument becomes a proxy, so `if {name} is None` "
            f"would take the wrong branch. Fix: concrete_args={{'{name}': {value!r:.60}}}."
        )


class KnownProxy(fx.Proxy):
    """A proxy that answers shape questions with the example run's value, as the forward sees
    them when it runs: ``x.shape``, ``x.size()``, ``x.dim()``, ``x.ndim``, ``x.dtype``,
    ``x.device``, ``len(x)``. A tensor's contents stay symbolic: ``if x.sum() > 0`` still fails."""

    def _known(self, attr):  # the example value's attribute, or FX's symbolic one
        value = self.tracer.values.get(self.node)
        if isinstance(value, torch.Tensor):
            return getattr(value, attr)
        return fx.Proxy.__getattr__(self, attr)

    shape = property(lambda self: self._known("shape"))
    ndim = property(lambda self: self._known("ndim"))
    dtype = property(lambda self: self._known("dtype"))
    device = property(lambda self: self._known("device"))

    def size(self, *dim):
        return self._known("size")(*dim)

    def dim(self):
        return self._known("dim")()

    def __len__(self):
        value = self.tracer.values.get(self.node)
        return len(value) if isinstance(value, torch.Tensor) else super().__len__()


class ShapeFallback:
    """Mixed in before a tracer class (tensor_ckpt's, at its door): ``trace(root)`` as that class
    does, and where FX cannot take the forward as it is, once more with proxies that know the
    shapes of ``examples`` (one tensor per placeholder), every node run on them as it is recorded
    (no gradients, generators forked, inputs copied); ``knows_shapes`` then says so. Where both
    fail it raises ``untraceable``'s error for ``arguments.module``."""

    def __init__(self, *args, arguments, examples, **kwargs):
        super().__init__(*args, **kwargs)
        self.arguments, self.examples, self.knows_shapes = arguments, examples, False
        self.excused = contextlib.nullcontext  # set by whoever watches the trace for side effects

    def trace(self, root, concrete_args=None):
        try:
            return super().trace(root, concrete_args)
        except Exception:  # TraceError, or what a Proxy raises in len(), iter(), bool()...
            pass
        self.knows_shapes, self.values = True, {}  # node -> its value in the example run
        self.interpreter = fx.Interpreter(root, graph=fx.Graph())
        self.interpreter.env = self.values
        self.interpreter.args_iter = iter([t.detach().clone() for t in self.examples])
        devices = [t.device for t in self.examples if t.device.type == "cuda"]
        with torch.random.fork_rng(devices):
            try:
                return super().trace(root, concrete_args)
            except Exception as err:
                raise untraceable(self.arguments.module, err, self.arguments) from err

    def proxy(self, node):
        return KnownProxy(node, self) if self.knows_shapes else super().proxy(node)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self.knows_shapes and kind != "output":
            try:  # FX's patches of Module.__call__ lifted: real modules run (no public way exists)
                with torch.no_grad(), fx._symbolic_trace._maybe_revert_all_patches():
                    with self.excused():  # a recorded node: it runs in every call
                        self.values[node] = self.interpreter.run_node(node)
            except Exception:  # a value it cannot compute stays symbolic
                pass
        return node


def untraceable(module, err, arguments=None):
    """The refusal for code FX cannot trace, naming the innermost module it failed in and the fix:
    an argument left at None that the code reads, or control flow on a traced value."""
    path, cls = getattr(err, "inside", ("", type(module)))
    where = f"inside '{path}' ({cls.__name__})" if path else type(module).__name__
    first = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    nones = [*arguments.left_at_none(), *arguments.fixed_at_none()] if arguments else []
    if "NoneType" in str(err) and nones:
        needed = next((n for n in nones if n == "position_embeddings"), nones[-1])
        rotary = (  # transformers' decoder layers take the model's rotary embedding
            "; for a transformers decoder layer that is (cos, sin) from its model's rotary "
            "embedding: model.rotary_emb(hidden_states, position_ids)"
            if needed == "position_embeddings"
            else ""
        )
        return ValueError(
            f"tensor_ckpt: tracing {type(module).__name__} failed {where} with {first}, an "
            f"argument left at None read as a value (left at None: {', '.join(nones)}). Fix: pass "
            f"{needed!r} as an example input (a tensor, or a tuple, list or dict of tensors: "
            f"example_inputs={{{arguments.names[0]!r}: ..., {needed!r}: ...}}){rotary}, or a "
            "value in concrete_args={name: value}."
        )

    return ValueError(
        f"tensor_ckpt: torch.fx cannot trace {where}: {first}. Python control flow on a traced "
        "value (an `if`/`while` on a tensor, len() of a tensor) has no graph form. Fix: pass "
        f"leaf_modules=({cls.__name__},) so it runs as one opaque node (nothing inside it can then "
        "be forgotten), fix the arguments that steer it with concrete_args={name: value}, or "
        "express the branch with tensor ops (torch.where)."
    )
