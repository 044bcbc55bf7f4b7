"""Probes for tests/graded/test_mhc.py: each runs the submitted mhc.py in a sandboxed worker and
returns plain values (tensors, numbers, lists, dicts); the verdicts are computed in the test."""

import torch

import mhc

SMALL = dict(vocab_size=64, seq_len=8, dim=16, n_heads=2, n_hc=4)


def build(n_layers=6, hyper=True, seed=0, dtype=torch.float32, params=None):
    """A small model whose HC parameters are moved away from their init, so the lanes differ and
    every mixing gradient is large enough to check (at init the lanes are copies of each other);
    with ``params`` (the graded test's, every one named), exactly those."""
    torch.manual_seed(seed)
    model = mhc.Transformer(mhc.Config(n_layers=n_layers, **SMALL), hyper=hyper).to(dtype)
    if params is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in params.items()}, strict=True)
        return model
    gen = torch.Generator().manual_seed(seed + 1)
    if hyper:
        with torch.no_grad():
            for hc in model.hcs:
                hc.gate.copy_(torch.rand(3, generator=gen) * 0.5 + 0.5)
                for p in (hc.bias_pre, hc.bias_post, hc.bias_res):
                    p.add_(torch.randn(p.shape, generator=gen).to(dtype))
            model.hyper_head.gate.fill_(0.7)
            model.hyper_head.bias.add_(torch.randn(4, generator=gen).to(dtype))
    return model


def batch(step, size=4, seq_len=8, vocab=64):
    gen = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, vocab, (size, seq_len + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def sinkhorn(cases):
    """[(logits, iters, eps), ...] -> [sinkhorn_knopp(logits, iters, eps), ...]"""
    return [mhc.sinkhorn_knopp(logits, iters, eps) for logits, iters, eps in cases]


def one_layer(stream, params):
    """One float64 HC layer with ``params`` on ``stream`` [batch, T, n, d]: mhc_coefficients'
    (A, B, C) and the plain layer's output."""
    model = build(n_layers=1, dtype=torch.float64, params=params)
    with torch.no_grad():
        coeffs = mhc.mhc_coefficients(stream, model.hcs[0], 20)
        layer = mhc.mhc_layer_reference(stream, model.sublayers[0], model.hcs[0])
    return {"coeffs": list(coeffs), "layer": layer}


def post_mix_backward(grad_out, b, stream, c, f):
    return list(mhc.post_mix_backward(grad_out, b, stream, c, f))


def every_path(paths, params, step=0):
    """A 6-layer float64 model's loss and gradients on one batch for each path's options."""
    model = build(dtype=torch.float64, params=params)
    idx, tgt = batch(step)
    out = {"paths": {}}
    for name, options in paths.items():
        model.zero_grad(set_to_none=True)
        loss = model(idx, tgt, **options)
        loss.backward()
        out["paths"][name] = {"loss": loss.item(), "grads": grads(model)}
    return out


def count_f_calls(model):
    calls = [0]
    for sublayer in model.sublayers:
        sublayer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def recomputed_block(stream, weight, with_head, params):
    """One block of 3 float64 layers (and the head) by run_recomputed_block: the gradients of
    sum(out * weight) for the block input and each parameter, and how often F ran."""
    model = build(n_layers=3, dtype=torch.float64, params=params)
    layers = list(zip(model.sublayers, model.hcs))
    head = model.hyper_head if with_head else None
    calls = count_f_calls(model)
    stream = stream.clone().requires_grad_()
    out = mhc.run_recomputed_block(stream, layers, 20, head=head)
    (out * weight).sum().backward()
    return {"stream": stream.grad, "grads": grads(model), "calls": calls[0]}


def training(options, params, steps=3):
    """A 6-layer fp32 model from ``params`` trained with SGD(lr=0.1) along ``options``' path:
    each step's loss, gradients and F calls so far."""
    model = build(params=params)
    calls = count_f_calls(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        idx, tgt = batch(step)
        loss = model(idx, tgt, **options)
        loss.backward()
        out.append({"loss": loss.item(), "grads": grads(model), "calls": calls[0]})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"steps": out}


def one_f_one_b(cases):
    """[(n_stages, stage, n_micro), ...] -> each one_f_one_b order, as lists [kind, i]."""
    return [[list(e) for e in mhc.one_f_one_b(*case)] for case in cases]


def logged_run_layers(model, log):
    """model.run_layers that logs ("F", i) when micro-batch i's forward starts on this stage and
    ("B", i) when its backward reaches this stage's output."""
    run = model.run_layers

    def logged(*args, **kwargs):
        i = sum(kind == "F" for kind, _ in log)
        log.append(("F", i))
        out = run(*args, **kwargs)
        if out.requires_grad:
            out.register_hook(lambda grad: log.append(("B", i)))
        return out

    model.run_layers = logged


def pipeline(rank, world_size, n_layers, steps, overlap, params):
    """pipeline_step (optimised, L_r = 2, 4 micro-batches of a batch of 8) for ``steps`` SGD
    steps on this rank, from this stage's ``params`` (true values only for what it runs): per
    step the loss, the gradients it made, its stats and the order its micro-batches' forwards
    and backwards ran in."""
    model = build(n_layers=n_layers, params=params)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        idx, tgt = batch(step, size=8)
        log = []
        logged_run_layers(model, log)
        loss, stats = mhc.pipeline_step(model, idx, tgt, 4, "optimised", 2, overlap=overlap)
        del model.run_layers
        out.append(
            {
                "loss": None if loss is None else loss.item(),
                "grads": grads(model),
                "stats": stats,
                "order": [list(e) for e in log],
            }
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"steps": out}


def saved_bytes(model, run):
    """Bytes of the distinct non-parameter storages autograd saves for backward in run()."""
    params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(size for ptr, size in seen.items() if ptr not in params)


def variant_saved_bytes(params):
    """At one stage, from ``params``: what pipeline_step(variant=...) and model(variant=...) keep
    for backward, and the loss pipeline_step returned."""
    idx, tgt = batch(0, size=8)
    saved = {}
    for variant, block in (("naive", None), ("optimised", 2)):
        model, losses = build(n_layers=4, params=params), []
        saved[variant] = saved_bytes(
            model, lambda: losses.append(mhc.pipeline_step(model, idx, tgt, 1, variant, block)[0])
        )
        saved[variant + " loss"] = None if losses[0] is None else losses[0].item()
        saved[variant + " model"] = saved_bytes(model, lambda: model(idx, tgt, variant, block))
    return saved
