"""The independent references for tests/graded/test_cp_compress.py: the compressor's pooling by
scalar loops (naive_compress) and per entry (pooled_entries), and one process's plain attention
over the whole sequence (F.scaled_dot_product_attention, autograd). They ship only in the
autograder zip: in the student repository each would be an answer (the pooling, entry by
entry); there the tests read the values they gave, stored by `make expected`
(tests/graded/expected.py)."""

import math

import torch
import torch.nn.functional as F

from graded.references_cp_compress import entry_windows

WINDOW = 6
D = 8  # head_dim
# helpers whose code the released files hold too (a probe draws the same batches): the
# release's leak search leaves them out
SHARED = ("rms",)


def pooled_entries(kv, gate, ape, cu, m, overlap):
    """[T/m, C] differentiable: each entry the per-channel softmax(gate + ape) average of its
    window's kv rows, zero rows after the valid ones."""
    T, C = kv.shape[0], kv.shape[2]
    rows = []
    for _, _, window in entry_windows(cu, m, overlap):
        logits = torch.stack([gate[p, k] + ape[i, k] for p, k, i in window])  # [rows, C]
        values = torch.stack([kv[p, k] for p, k, _ in window])
        rows.append((torch.softmax(logits, dim=0) * values).sum(0))
    rows += [kv.new_zeros(C)] * (T // m - len(rows))
    return torch.stack(rows)


def rms(x, weight):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def plain_attention(p, x, cu, m, overlap, heads=2):
    """One process, the whole sequence, float64, written from the spec and nothing of cp_compress
    but the weights: compressed entries, the visibility rule spelled out per (query, entry), the
    window spelled out, then F.scaled_dot_product_attention (keys double as values; no sink).
    -> (output [T, H, D], entries [T/m, C] normalised as the protocol's)."""
    T, sets = x.shape[0], 2 if overlap else 1
    q = (x @ p["wq"]).view(T, heads, D)
    window_kv = rms(x @ p["wkv_window"], p["norm_window"])
    kv, gate = (
        (x @ p["wkv_compress"]).view(T, sets, -1),
        (x @ p["wgate_compress"]).view(T, sets, -1),
    )
    pooled = pooled_entries(kv, gate, p["ape"], cu, m, overlap)
    entries = rms(pooled[:, :D], p["norm_compress"])
    normalised = (
        torch.cat([entries, rms(pooled[:, D:], p["norm_index"])], 1) if overlap else entries
    )
    docs = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    info = [(end, doc) for end, doc, _ in entry_windows(cu, m, overlap)]
    allowed = torch.zeros(T, T // m + T, dtype=torch.bool)
    for a, b in docs:
        for t in range(a, b):
            for e, (end, doc) in enumerate(info):
                allowed[t, e] = doc == a and end <= t  # same document, block complete
            for j in range(max(a, t - WINDOW + 1), t + 1):
                allowed[t, T // m + j] = True  # the sliding window, own token included
    keys = torch.cat([entries, window_kv])[None].expand(heads, -1, -1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, keys, attn_mask=allowed)
    return out.transpose(0, 1), normalised, info


USED = ("wq", "wkv_window", "norm_window", "wkv_compress", "wgate_compress", "ape", "norm_compress")


def layer_reference(params, x, cu, m, overlap, grad_out):
    """plain_attention in float64 from the layer's ``params`` and its gradients of
    sum(out * grad_out): (out, entries, d input, [d params in USED's order])."""
    params = {n: t.double().requires_grad_() for n, t in params.items()}
    x64 = x.double().requires_grad_()
    out, entries, _ = plain_attention(params, x64, cu, m, overlap)
    used = [params[n] for n in USED]
    grad_x, *grads = torch.autograd.grad((out * grad_out.double()).sum(), [x64, *used])
    return out.detach(), entries.detach(), grad_x, grads


def naive_compress(kv, score, ape, cu, m, overlap):
    """Scalar loops, entry by entry and channel by channel (float64)."""
    T, _, C = kv.shape
    out = torch.zeros(T // m, C, dtype=torch.float64)
    n = 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for j in range((b - a) // m):
            for c in range(C):
                rows = [(a + j * m + i, 0, i) for i in range(m)]
                if overlap and j > 0:
                    rows += [(a + (j - 1) * m + i, 1, i) for i in range(m)]
                logits = [float(score[p, k, c] + ape[i, k, c]) for p, k, i in rows]
                z = sum(math.exp(v - max(logits)) for v in logits)
                out[n, c] = sum(
                    math.exp(v - max(logits)) / z * float(kv[p, k, c])
                    for v, (p, k, i) in zip(logits, rows)
                )
            n += 1
    return out
