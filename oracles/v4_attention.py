"""The public DeepSeek-V4 attention (Hugging Face transformers) as an oracle for cp_compress.py.

Tiny random V4 attention layers are built from transformers' own DeepSeek-V4 classes, their
weights are loaded into cp_compress through `interop.v4_attention.from_v4_state_dict`, and the two
compute, for ONE document (the public code has no notion of packed documents: it pools across
document boundaries and lets a query see entries of other documents; cp_compress compresses each
document on its own, deliberately):

- the compressed entries of CSA (m = 4; main channels and the indexer's) and HCA (m' = 8 and V4's
  128), read at the output of V4's kv_norm, i.e. before V4 applies RoPE (which cp_compress leaves
  out), and the window K/V;
- the indexer's entries after V4's RoPE (the project's entries rotated with V4's own function);
- the visibility sets (which entries each query may see);
- the indexer's scores, for V4's queries and keys (cp_compress has no low-rank query path and no
  RoPE, so the queries come from V4; the weights w come from the adapter, Hi^-1/2 folded in);
- the indexer's top-k, as sets per query, up to exact ties.

Tolerances, fp32 throughout: 1e-6 absolute on the entries and the window K/V (unit-RMS times the
norm weight; measured bit-equal: the same pooling order and the same norm); 1e-5 on the indexer
scores (sums over heads of O(1) products, taken in a different order; measured ~7e-7). A float64
run cannot do better than fp32: V4 computes its compressor softmax, its RMSNorm and its indexer
scores in fp32 whatever the input dtype. Integer quantities (visibility, top-k) match exactly.

    from oracles.v4_attention import comparison_rows
    rows = comparison_rows()   # [{quantity, max_abs_diff, tolerance}, ...]
"""

import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

import cp_compress as cpc
from interop.v4_attention import from_v4_state_dict

DIM, HEADS, HEAD_DIM, Q_RANK = 32, 2, 16, 24
INDEX_HEADS, INDEX_DIM, TOP_K = 2, 8, 5
M_CSA, M_HCA, WINDOW, T = 4, 8, 8, 64
TOL_FP32 = 1e-6  # entries, window K/V
TOL_SCORES = 1e-5  # indexer scores


def v4_config():
    return DeepseekV4Config(
        hidden_size=DIM,
        num_attention_heads=HEADS,
        head_dim=HEAD_DIM,
        q_lora_rank=Q_RANK,
        index_n_heads=INDEX_HEADS,
        index_head_dim=INDEX_DIM,
        index_topk=TOP_K,
        compress_rates={
            "compressed_sparse_attention": M_CSA,
            "heavily_compressed_attention": M_HCA,
        },
        num_hidden_layers=2,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        sliding_window=WINDOW,
        partial_rotary_factor=0.5,
        o_groups=2,
        o_lora_rank=8,
    )


def random_v4_attention(config, layer_idx, seed):
    """A V4 attention layer with every weight random (norm weights too, so they matter)."""
    torch.manual_seed(seed)
    attn = v4.DeepseekV4Attention(config, layer_idx).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0))
    return attn


class Capture:
    """Forward hooks that keep a module's (inputs, output)."""

    def __init__(self, *modules):
        self.seen = {}
        self.handles = [m.register_forward_hook(self._hook(m)) for m in modules]

    def _hook(self, module):
        def hook(mod, inputs, output):
            self.seen[module] = (inputs, output)

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def v4_run(attn, x):
    """Run V4's compressor of `attn` on x [T, dim] as V4's attention forward does (no cache)."""
    hidden = x[None]
    position_ids = torch.arange(x.shape[0])[None]
    q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
    comp = attn.compressor
    mods = [comp.kv_norm] + (
        [comp.indexer, comp.indexer.kv_norm, comp.indexer.scorer]
        if hasattr(comp, "indexer")
        else []
    )
    cap = Capture(*mods)
    with torch.no_grad():
        _, block_bias = comp(hidden, q_residual, position_ids, None, attn.layer_idx)
        window_kv = attn.kv_norm(attn.kv_proj(hidden))[0]
    cap.close()
    return cap.seen, block_bias, window_kv


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def top_k_mismatch(mine, theirs, scores):
    """Queries whose chosen sets differ by more than an exact tie at the k-th score (0 = equal)."""
    bad = 0
    for t in range(mine.shape[0]):
        a = set(mine[t][mine[t] >= 0].tolist())
        b = set(theirs[t][theirs[t] >= 0].tolist())
        if a == b:
            continue
        swapped = [scores[t, e].item() for e in a ^ b]
        kth = min(scores[t, e].item() for e in a) if a else None
        if len(a) != len(b) or any(v != kth for v in swapped):
            bad += 1
    return bad


def comparison_rows(seed=0):
    """Every compared quantity: [{"quantity", "max_abs_diff", "tolerance"}, ...] (fp32)."""
    config = v4_config()
    x = torch.randn(T, DIM, generator=torch.Generator().manual_seed(seed + 1))
    cu = torch.tensor([0, T])  # one document
    pos = torch.arange(T)
    rows = []

    def row(quantity, diff, tol):
        rows.append(dict(quantity=quantity, max_abs_diff=float(diff), tolerance=tol))

    # CSA, m = 4: main and indexer entries, window K/V, visibility, scores, top-k
    attn = random_v4_attention(config, 0, seed)
    seen, _, window_v4 = v4_run(attn, x)
    layer, _ = from_v4_state_dict(attn.state_dict(), "csa", M_CSA, WINDOW, top_k=TOP_K)
    with torch.no_grad():
        proj = layer.project(x)
        entries = layer.normalise(
            cpc.compress_reference(proj.kv, proj.gate, layer.ape, cu, M_CSA, True)
        )
    comp = attn.compressor
    row(
        "CSA m=4 entries, main channels",
        _max_diff(entries[:, :HEAD_DIM], seen[comp.kv_norm][1][0]),
        TOL_FP32,
    )
    index_keys_v4 = seen[comp.indexer.kv_norm][1][0]
    row(
        "CSA m=4 entries, indexer channels",
        _max_diff(entries[:, HEAD_DIM:], index_keys_v4),
        TOL_FP32,
    )
    row("window K/V (before RoPE)", _max_diff(proj.window_kv, window_v4), TOL_FP32)

    (q_rope, keys_rope, _), scores_v4 = seen[comp.indexer.scorer]
    positions = (torch.arange(T // M_CSA) * M_CSA)[None]
    cos, sin = comp.indexer.rotary_emb(entries[None], position_ids=positions, layer_type="compress")
    rotated = v4.apply_rotary_pos_emb(entries[None, None, :, HEAD_DIM:], cos, sin)[0, 0]
    row("CSA indexer keys after V4's RoPE", _max_diff(rotated, keys_rope[0]), TOL_FP32)

    ends, starts = cpc.compressed_entry_ends(cu, M_CSA)
    visible = cpc.visibility(pos, torch.zeros(T, dtype=torch.long), ends, starts)
    v4_visible = torch.arange(T // M_CSA)[None] < ((pos + 1) // M_CSA)[:, None]  # V4's future mask
    row("CSA visibility (query, entry) pairs that differ", (visible != v4_visible).sum(), 0)

    with torch.no_grad():
        scores = cpc.index_scores(q_rope[0], x @ layer.w_index, keys_rope[0])
    row("indexer scores (V4's queries and keys)", _max_diff(scores, scores_v4[0]), TOL_SCORES)
    chosen_v4 = seen[comp.indexer][1][0]
    chosen = cpc.top_k_visible(scores_v4[0], visible, TOP_K)
    row(
        "indexer top-k: queries whose sets differ (beyond exact ties)",
        top_k_mismatch(chosen, chosen_v4, scores_v4[0]),
        0,
    )
    everything = cpc.top_k_visible(scores_v4[0], visible, 10**6)  # k >= entries: the visible set
    v4_all = v4_visible & (torch.arange(T // M_CSA)[None] < T // M_CSA)
    row(
        "indexer top-k with k > entries: pairs that differ from the visible set",
        (cpc.chosen_mask(everything, T // M_CSA) != v4_all).sum(),
        0,
    )

    # HCA at a small ratio and at V4's m' = 128 (on 4 blocks): entries and visibility
    for m_hca in (M_HCA, 128):
        length = max(T, 4 * m_hca)
        x_hca = torch.randn(length, DIM, generator=torch.Generator().manual_seed(seed + 2))
        cfg = v4_config()
        cfg.compress_rates["heavily_compressed_attention"] = m_hca
        attn = random_v4_attention(cfg, 1, seed + 7)
        seen, block_bias, _ = v4_run(attn, x_hca)
        layer, _ = from_v4_state_dict(attn.state_dict(), "hca", m_hca, WINDOW)
        cu_hca, pos_hca = torch.tensor([0, length]), torch.arange(length)
        with torch.no_grad():
            proj = layer.project(x_hca)
            entries = layer.normalise(
                cpc.compress_reference(proj.kv, proj.gate, layer.ape, cu_hca, m_hca, False)
            )
        row(
            f"HCA m'={m_hca} entries",
            _max_diff(entries, seen[attn.compressor.kv_norm][1][0]),
            TOL_FP32,
        )
        ends, starts = cpc.compressed_entry_ends(cu_hca, m_hca)
        visible = cpc.visibility(pos_hca, torch.zeros(length, dtype=torch.long), ends, starts)
        row(
            f"HCA m'={m_hca} visibility (query, entry) pairs that differ",
            (visible != block_bias[0, 0].isfinite()).sum(),
            0,
        )
    return rows


if __name__ == "__main__":
    for r in comparison_rows():
        print(f"{r['quantity']:<66} {r['max_abs_diff']:>10.2e} {r['tolerance']:>8g}")
