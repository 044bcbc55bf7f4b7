"""mhc.py against the public DeepSeek-V4 code: the same weights must give the same numbers.

The oracle is Hugging Face transformers' own DeepSeek-V4 implementation (a test-only dependency):
DeepseekV4HyperConnection, DeepseekV4HyperHead, and DeepseekV4DecoderLayer.forward, whose mixing
(post * F + comb^T X) is run as written; only its attention, MoE and pre-norms are swapped for
mhc.py's F modules (F is not what is compared, the hyper-connections are). Tiny random V4 modules
are built, their weights loaded into mhc.py by interop/v4_mhc.py's from_v4_state_dict, and compared:
A, B, C of every layer, the stream after each of several layers (reference, fused and recomputed
paths), the head's lane collapse, and B at logits of +-60 (where Sinkhorn without eps gives NaN).

Tolerances: fp32 1e-6 absolute for coefficients (values <= 2, fp32 rounding ~1e-7 per op, the
Sinkhorn sums reassociate), 1e-5 for streams after several layers (values ~1-10, errors grow with
depth); float64 1e-12. V4 casts to fp32 with .float() (its model runs in bf16): for the float64
comparison .float() is made to keep float64 tensors as they are, so the same code runs in float64.

    from oracles.v4_mhc import comparison_rows    # notebook 02a: the table
"""

import contextlib

import torch
import torch.nn as nn

import mhc
from interop import v4_mhc

N_HC, DIM, LAYERS, BATCH, SEQ = 4, 16, 3, 2, 8  # LAYERS V4 decoder layers = 2 * LAYERS mHC layers


def v4_modules():
    """transformers' DeepSeek-V4 module classes and a tiny config (imports transformers lazily)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    config = DeepseekV4Config(
        hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=2, vocab_size=64,
        hc_mult=N_HC, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    )  # fmt: skip
    return v4, config


@contextlib.contextmanager
def float_keeps_float64():
    """V4 calls .float() on its mHC inputs and weights; in this context float64 stays float64."""
    original = torch.Tensor.float
    torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else original(t, *a, **k)
    try:
        yield
    finally:
        torch.Tensor.float = original


@contextlib.contextmanager
def capture_first_sigmoid(record):
    """V4 consumes A ("pre") inside its forward; its first sigmoid is A - eps. Record it."""
    original = torch.sigmoid

    def sigmoid(x, *a, **k):
        out = original(x, *a, **k)
        record.append(out)
        return out

    torch.sigmoid = sigmoid
    try:
        yield
    finally:
        torch.sigmoid = original


class _Attention(nn.Module):  # V4's self_attn returns (output, weights)
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x, **_):
        return self.f(x), None


class _MLP(nn.Module):  # V4's mlp takes input_ids for hash routing
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x, input_ids=None):
        return self.f(x)


def build(dtype, seed=0):
    """Tiny random V4 decoder layers (mHC parts real, F = mhc.py's) and mhc.py's Transformer with
    the same weights. Returns (v4 module, v4 layers, v4 head, project model)."""
    v4, config = v4_modules()
    gen = torch.Generator().manual_seed(seed)
    model = mhc.Transformer(
        mhc.Config(vocab_size=64, seq_len=SEQ, dim=DIM, n_heads=2, n_layers=2 * LAYERS, n_hc=N_HC)
    ).to(dtype)
    layers, state = [], {}
    for i in range(LAYERS):
        layer = v4.DeepseekV4DecoderLayer.__new__(v4.DeepseekV4DecoderLayer)
        nn.Module.__init__(layer)  # only the parts the mixing needs; no V4 attention or MoE
        layer.attn_hc, layer.ffn_hc = (
            v4.DeepseekV4HyperConnection(config),
            v4.DeepseekV4HyperConnection(config),
        )
        layer.self_attn, layer.mlp = (
            _Attention(model.sublayers[2 * i]),
            _MLP(model.sublayers[2 * i + 1]),
        )
        layer.input_layernorm = layer.post_attention_layernorm = nn.Identity()
        for hc in (layer.attn_hc, layer.ffn_hc):
            randomise(hc.fn, hc.base, hc.scale, gen)
        layer.to(dtype)
        layers.append(layer)
        for name, value in layer.state_dict().items():
            if "_hc." in name:
                state[f"model.layers.{i}.{name}"] = value
    head = v4.DeepseekV4HyperHead(config)
    randomise(head.hc_fn, head.hc_base, head.hc_scale, gen)
    head.to(dtype)
    state.update({f"model.hc_head.{k}": v for k, v in head.state_dict().items()})
    v4_mhc.from_v4_state_dict(model, state)
    return v4, layers, head, model


def randomise(fn, base, scale, gen):
    """Weights that make B far from the identity (logit std ~1-2), so layouts and orders matter."""
    with torch.no_grad():
        fn.copy_(torch.randn(fn.shape, generator=gen) * fn.shape[1] ** -0.5)
        base.copy_(torch.randn(base.shape, generator=gen))
        scale.copy_(torch.rand(scale.shape, generator=gen) + 0.5)


def v4_coefficients(hc, stream):
    """(A, B, C) as V4 computes them: A = pre, B = comb^T (V4 applies comb^T X), C = post."""
    record = []
    with capture_first_sigmoid(record):
        post, comb, _ = hc(stream)
    return record[0] + hc.hc_eps, comb.transpose(-1, -2), post


def measure(dtype):
    """Max |V4 - mhc.py| per quantity, for one dtype: {quantity: diff}."""
    torch.manual_seed(1)
    _, layers, head, model = build(dtype)
    stream = torch.randn(BATCH, SEQ, N_HC, DIM, dtype=dtype)
    diffs = {"A": 0.0, "B": 0.0, "C": 0.0}
    context = float_keeps_float64() if dtype == torch.float64 else contextlib.nullcontext()
    with torch.no_grad(), context:
        v4_stream, ours = stream, {"reference": stream, "fused": stream, "recomputed": stream}
        per_layer = {name: 0.0 for name in ours}
        for i, layer in enumerate(layers):
            for j, hc in enumerate((layer.attn_hc, layer.ffn_hc)):  # coefficients at V4's stream
                state = v4_stream if j == 0 else v4_after_attention(layer, v4_stream)
                expected = v4_coefficients(hc, state)
                got = mhc.mhc_coefficients(state, model.hcs[2 * i + j], 20)
                for key, e, g in zip("ABC", expected, got):
                    diffs[key] = max(diffs[key], (e - g).abs().max().item())
            v4_stream = layer.forward(v4_stream)
            ours["reference"] = model.run_layers(ours["reference"], 2 * i, 2 * i + 2)
            ours["fused"] = model.run_layers(ours["fused"], 2 * i, 2 * i + 2, "fused")
            ours["recomputed"] = model.run_layers(
                ours["recomputed"], 2 * i, 2 * i + 2, "optimised", 2
            )
            for name in ours:
                per_layer[name] = max(per_layer[name], (ours[name] - v4_stream).abs().max().item())
        for name, value in per_layer.items():
            diffs[f"stream after each of {2 * LAYERS} layers, {name}"] = value
        diffs["head: lanes collapsed"] = (
            (head(v4_stream) - model.hyper_head(v4_stream)).abs().max().item()
        )
        hc = layers[0].attn_hc
        with torch.no_grad():  # comb logits = base: rows of +-60 (no eps: NaN)
            hc.scale[2] = 0.0
            sign = torch.randn(N_HC, N_HC, generator=torch.Generator().manual_seed(7)).sign()
            hc.base[2 * N_HC :] = 60.0 * sign.reshape(-1)
            for key, value in v4_mhc.hc_params_from_v4(hc.fn, hc.base, hc.scale, N_HC).items():
                getattr(model.hcs[0], key).copy_(value)
        expected_b = v4_coefficients(hc, stream)[1]
        got_b = mhc.mhc_coefficients(stream, model.hcs[0], 20)[1]
        diffs["B at logits of +-60"] = (expected_b - got_b).abs().max().item()
        if not torch.isfinite(got_b).all():
            diffs["B at logits of +-60"] = float("nan")
    return diffs


def v4_after_attention(layer, stream):
    """V4's stream between its attention and MLP sublayers (its decoder layer's first half)."""
    post, comb, collapsed = layer.attn_hc(stream)
    out, _ = layer.self_attn(layer.input_layernorm(collapsed))
    dtype = stream.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), stream
    )


TOLERANCES = {  # (fp32, float64); see the module docstring for why
    "coefficient": (1e-6, 1e-12),
    "stream": (1e-5, 1e-12),
}


def tolerance(quantity, dtype):
    kind = "stream" if quantity.startswith("stream") else "coefficient"
    return TOLERANCES[kind][0 if dtype == torch.float32 else 1]


def comparison_rows(dtypes=(torch.float32, torch.float64)):
    """The comparison as a table: [{'quantity', 'max_abs_diff', 'tolerance'}, ...]."""
    rows = []
    for dtype in dtypes:
        label = "fp32" if dtype == torch.float32 else "float64"
        for quantity, diff in measure(dtype).items():
            rows.append(
                {"quantity": f"{quantity} ({label})", "max_abs_diff": diff,
                 "tolerance": tolerance(quantity, dtype)}
            )  # fmt: skip
    return rows
