"""Load the mHC weights of a DeepSeek-V4 checkpoint (transformers' DeepseekV4Model names) into
mhc.Transformer: the layout changes between V4's tensors and mhc.py's, nothing else.

V4 name (layer l)                  shape          -> mhc.py              layout change
layers.l.attn_hc.fn                [(2+n)n, nC]   hcs[2l].proj           transpose; comb rows
                                                                         (j,i) -> (i,j)
layers.l.attn_hc.base              [(2+n)n]       hcs[2l].bias_pre, bias_post, bias_res
                                                                         split n|n|n^2; comb^T
layers.l.attn_hc.scale             [3]            hcs[2l].gate           none (pre, post, comb)
layers.l.ffn_hc.{fn,base,scale}    as above       hcs[2l+1].*            as above
hc_head.hc_fn                      [n, nC]        hyper_head.proj        transpose
hc_head.hc_base                    [n]            hyper_head.bias        none
hc_head.hc_scale                   [1]            hyper_head.gate        none

V4 keeps comb = B^T (it computes comb^T X), hence the transposes of the comb block.
"""

import torch


def hc_params_from_v4(fn, base, scale, n):
    """One V4 HyperConnection (fn [(2+n)n, nC], base [(2+n)n], scale [3]) -> {name: tensor} of
    mhc.HyperConnection's parameters."""
    nc = fn.shape[1]
    comb_rows = fn[2 * n :].reshape(n, n, nc).transpose(0, 1).reshape(n * n, nc)  # (j,i) -> (i,j)
    return {
        "proj": torch.cat([fn[: 2 * n], comb_rows]).T,
        "gate": scale,
        "bias_pre": base[:n],
        "bias_post": base[n : 2 * n],
        "bias_res": base[2 * n :].reshape(n, n).T,
    }


def from_v4_state_dict(model, state_dict):
    """Copy the mHC weights of a V4 state dict into model (an mhc.Transformer, hyper=True).

    A leading "model." is accepted. Only mHC weights: F here is not V4's attention or MoE, so its
    weights stay as they are. Returns the list of the model's parameter names that were set.
    """
    if not model.hyper:
        raise ValueError("from_v4_state_dict needs an mHC model (hyper=True)")
    n = model.cfg.n_hc
    sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
    targets = {}
    for i in range(model.cfg.n_layers):
        prefix = f"layers.{i // 2}.{'attn_hc' if i % 2 == 0 else 'ffn_hc'}."
        names = [prefix + s for s in ("fn", "base", "scale")]
        missing = [name for name in names if name not in sd]
        if missing:
            raise ValueError(f"V4 state dict lacks {missing} for this model's layer {i}")
        for key, value in hc_params_from_v4(*(sd[name] for name in names), n).items():
            targets[f"hcs.{i}.{key}"] = value
    for src, dst in (("hc_fn", "proj"), ("hc_base", "bias"), ("hc_scale", "gate")):
        if f"hc_head.{src}" not in sd:
            raise ValueError(f"V4 state dict lacks hc_head.{src}")
        value = sd[f"hc_head.{src}"]
        targets[f"hyper_head.{dst}"] = value.T if dst == "proj" else value
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in targets.items():
            if params[name].shape != value.shape:
                raise ValueError(
                    f"{name}: V4 gives shape {tuple(value.shape)}, model has "
                    f"{tuple(params[name].shape)} (n_hc and dim must match the checkpoint)"
                )
            params[name].copy_(value)
    return list(targets)
