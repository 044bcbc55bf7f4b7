"""The public DeepSeek-V4 attention's weights (transformers' naming) in cp_compress's layer.

With the same weights, loaded by `from_v4_state_dict`, the compressed entries (CSA main and indexer
channels, HCA), the window K/V, the visibility sets, the indexer scores and its top-k are equal
(tests/test_cp_v4_oracle.py; notebook 03 prints the table): the compressor RMSNorms carry V4's
learned weights (kv_norm) and eps 1e-6; the indexer's constant weight scale Hi^-1/2 is folded into
w_index. Left out of V4's attention, so its weights load only in part: the low-rank query path
(q_a_proj -> RMSNorm -> q_b_proj -> unweighted RMSNorm; there one matrix wq), the indexer's query
from that same low-rank residual (there wq_index), partial RoPE on queries, window K/V, compressed
entries and indexer queries and keys (and its inverse on the output), the grouped low-rank output
projection, and the indexer's training loss (its scores are returned; tests backpropagate through
them). All are per token or per entry at a known global position, so none changes what crosses a
rank boundary; leaving them out keeps the chapter about the protocol. One deliberate difference:
packed documents. The public code pools across document boundaries and lets a query see entries of
other documents; cp_compress compresses each document on its own.
"""

import torch

import cp_compress as cpc

V4_NOT_LOADED = {  # V4 attention parameters this file has no place for, and why
    "q_a_proj.weight": "the low-rank query path (q_a_proj, q_a_norm, q_b_proj, then an unweighted "
    "RMSNorm and RoPE): per token, so CP does not touch it; wq stays as built",
    "q_a_norm.weight": "low-rank query path (see q_a_proj.weight)",
    "q_b_proj.weight": "low-rank query path (see q_a_proj.weight)",
    "compressor.indexer.q_b_proj.weight": "the indexer's query comes from the same low-rank "
    "residual, with RoPE; wq_index stays as built",
    "o_a_proj.weight": "the grouped low-rank output projection: per token, after attention",
    "o_b_proj.weight": "the grouped low-rank output projection: per token, after attention",
}


def from_v4_state_dict(state_dict, kind, ratio, window, top_k=None, prefix=""):
    """A CompressedAttention holding the weights of one V4 attention layer (transformers'
    DeepseekV4Attention naming, nn.Linear layout [out, in]); -> (layer, {V4 name: why not loaded}).

    V4 name (under `prefix`)                 shape          -> here (x @ W layout [in, out])
    kv_proj.weight                           [D, dim]       -> wkv_window = W.T
    kv_norm.weight                           [D]            -> norm_window
    sinks                                    [H]            -> sink
    compressor.kv_proj.weight    CSA         [2D, dim]      rows D: (Cb, pools its own block)
                                                            -> wkv_compress set 0, channels :D;
                                                            rows :D (Ca, read by the next entry)
                                                            -> set 1, channels :D
                                 HCA         [D, dim]       -> wkv_compress (one set)
    compressor.gate_proj.weight                             -> wgate_compress, split as kv_proj
    compressor.position_bias     CSA         [m, 2D]        -> ape[:, 0, :D] = [:, D:],
                                                               ape[:, 1, :D] = [:, :D]
                                 HCA         [m, D]         -> ape[:, 0]
    compressor.kv_norm.weight                [D]            -> norm_compress
    compressor.indexer.kv_proj.weight        [2Di, dim]     -> wkv_compress channels D: (the
    compressor.indexer.gate_proj.weight                        indexer's channels ride in the same
    compressor.indexer.position_bias         [m, 2Di]          compressor), split as above
    compressor.indexer.kv_norm.weight        [Di]           -> norm_index
    compressor.indexer.scorer.weights_proj   [Hi, dim]      -> w_index = W.T * Hi^-1/2 (V4's
      .weight                                                  constant scale, folded in)
    Not loaded (V4_NOT_LOADED): the low-rank query paths of attention and indexer, the output
    projection. The layer computes the same compressed entries, window K/V, visibility and
    indexer scores for the same queries; RoPE is not applied (see the module docstring).
    """
    sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    wkv_window = sd["kv_proj.weight"]
    head_dim, dim = wkv_window.shape
    heads = sd["sinks"].shape[0]
    extra = {}
    if kind == "csa":
        index_heads = sd["compressor.indexer.scorer.weights_proj.weight"].shape[0]
        index_dim = sd["compressor.indexer.kv_norm.weight"].shape[0]
        extra = dict(top_k=top_k, index_heads=index_heads, index_dim=index_dim)
    layer = cpc.CompressedAttention(
        kind, dim=dim, heads=heads, head_dim=head_dim, ratio=ratio, window=window, **extra
    )

    def two_sets(w, d):  # V4 [.., 2d] as (Ca | Cb) -> here [.., set, d] with set 0 = Cb
        return torch.stack([w[..., d:], w[..., :d]], dim=-2)

    if kind == "csa":
        kv = torch.cat(
            [
                two_sets(sd["compressor.kv_proj.weight"].T, head_dim),
                two_sets(sd["compressor.indexer.kv_proj.weight"].T, index_dim),
            ],
            -1,
        )
        gate = torch.cat(
            [
                two_sets(sd["compressor.gate_proj.weight"].T, head_dim),
                two_sets(sd["compressor.indexer.gate_proj.weight"].T, index_dim),
            ],
            -1,
        )
        ape = torch.cat(
            [
                two_sets(sd["compressor.position_bias"], head_dim),
                two_sets(sd["compressor.indexer.position_bias"], index_dim),
            ],
            -1,
        )
    else:
        kv, gate = (
            sd["compressor.kv_proj.weight"].T[:, None],
            sd["compressor.gate_proj.weight"].T[:, None],
        )
        ape = sd["compressor.position_bias"][:, None]
    mine = dict(
        wkv_window=wkv_window.T,
        norm_window=sd["kv_norm.weight"],
        sink=sd["sinks"],
        wkv_compress=kv.flatten(-2),
        wgate_compress=gate.flatten(-2),
        ape=ape,
        norm_compress=sd["compressor.kv_norm.weight"],
    )
    if kind == "csa":
        weights_proj = sd["compressor.indexer.scorer.weights_proj.weight"]
        mine.update(
            w_index=weights_proj.T * index_heads**-0.5,
            norm_index=sd["compressor.indexer.kv_norm.weight"],
        )
    with torch.no_grad():
        for name, value in mine.items():
            param = getattr(layer, name)
            if param.shape != value.shape:
                raise ValueError(
                    f"V4 weights for {name} have shape {tuple(value.shape)}, the layer "
                    f"expects {tuple(param.shape)}"
                )
            param.copy_(value)
    skipped = {k: V4_NOT_LOADED[k] for k in sd if k in V4_NOT_LOADED}
    return layer, skipped
