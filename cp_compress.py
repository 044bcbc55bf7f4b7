"""Context parallelism for compressed attention (CSA / HCA): V4's two-stage protocol (V4 §3.4.3).

What the standard tool assumes. Context parallelism splits one long sequence into contiguous shards
of s tokens, one per rank. Keys and values are per token, so a rank that needs another rank's past
fetches those tokens' K/V (ring attention, or an all-gather of raw K/V).

What V4 violates. V4 attends to compressed entries, not tokens (V4 §2.3): every m raw tokens of a
document are pooled into one entry; CSA (m = 4) pools each block together with the one before it,
HCA (m' = 128) without overlap. Packed documents are compressed on their own, a trailing partial
block dropped. So a pooling window can straddle a rank boundary, and how many entries a rank
produces depends on where the documents start: it is not s/m.

The fix, in two phases (the report's "two stages"; in this project a stage is a pipeline stage).
(1) Rank i sends rank i+1 the raw rows it needs (the halo, `halo_rows`); every rank pools the blocks
that END on it into a zero-padded buffer of s/m + 1 entries. (2) One all-gather of those equal
buffers, then a select-and-pad (one index_select) gives the cp_size*s/m entries of the single-device
compressed sequence. Queries stay local: what a query may see follows by rule from global positions
(`visibility`) and, for CSA, from the indexer's top-k. The protocol is one function,
`context_parallel_compress`. The public V4 attention (transformers) loads through
`interop.v4_attention` and agrees (tests/test_cp_v4_oracle.py), but pools across documents.

Run:
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 cp_compress.py   # N = 1..4; gloo on CPU, or NCCL
    python cp_compress.py [--help]                                 # one process; the options
"""

import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import launch

RMS_EPS = 1e-6  # V4's rms_norm_eps (F.rms_norm's default, the dtype's machine eps, differs)


# ---- V4's RMSNorm ------------------------------------------------------------------------------
def rms_norm(x, weight):
    """V4's RMSNorm over the last dim: x / sqrt(mean(x^2) + 1e-6) * weight (a learned weight)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps=RMS_EPS)


# ---- 1. Under CP: which blocks end on which rank, and which raw rows they pool -------------------
def halo_rows(ratio, overlap):
    """Raw rows rank i+1 needs from rank i to pool every block that ends on it: such a block starts
    at most m-1 tokens before the rank's first token, and with overlap (CSA) the entry also pools
    the block before its own. The paper's "m" is the unpacked case. One neighbour: s >= halo."""
    ### BEGIN SOLUTION
    return 2 * ratio - 1 if overlap else ratio - 1
    ### END SOLUTION


def compressed_entry_ends(cu_seqlens, ratio):
    """Every compressed entry of a packed sequence, in order. cu_seqlens: [D+1] document bounds
    (0, ..., T); document [a, b) yields (b-a)//ratio entries, entry j pools [a + j*m, a + (j+1)*m).
    -> (ends [N], doc_starts [N]): each entry's last token and its document's start, global."""
    ends, starts = [], []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        n = (b - a) // ratio
        ends.append(a - 1 + ratio * torch.arange(1, n + 1))
        starts.append(torch.full((n,), a))
    return torch.cat(ends).to(cu_seqlens.device), torch.cat(starts).to(cu_seqlens.device)


def entries_per_rank(ends, seq_per_rank, cp_size):
    """[cp_size] entries whose block ends on each rank (the compressed length before padding)."""
    return torch.bincount(ends // seq_per_rank, minlength=cp_size)


def local_entry_rows(ends, doc_starts, rank, seq_per_rank, ratio, overlap):
    """Rows of the halo-extended shard [halo rows | own s rows] that each of this rank's entries
    pools: global position p is row p - (rank*s - halo). -> own_rows [n, ratio] (the entry's block)
    and prev_rows [n, ratio] (the block before it, -1 where the entry is its document's first), or
    prev_rows None without overlap. n = entries whose block ends on this rank (<= s/ratio)."""
    first = rank * seq_per_rank
    mine = (ends >= first) & (ends < first + seq_per_rank)
    block_start = ends[mine] - ratio + 1
    offset = first - halo_rows(ratio, overlap)
    own_rows = block_start[:, None] + torch.arange(ratio, device=ends.device) - offset
    if not overlap:
        return own_rows, None
    has_prev = (block_start - ratio >= doc_starts[mine])[:, None]
    return own_rows, torch.where(has_prev, own_rows - ratio, -1)


def compress_local(ext_kv, ext_score, ape, own_rows, prev_rows, slots):
    """Pool this rank's entries from its halo-extended shard into a fixed buffer (phase 1).
    ext_kv, ext_score: [halo + s, sets, C]; own_rows / prev_rows from local_entry_rows (set 0 of an
    entry's own block, set 1 of the block before). -> [slots, C]: the n valid entries first, in the
    order of own_rows, zero rows after, so every rank sends an equal buffer."""
    # hint: gather each window's rows by index, then a softmax over the window's rows per channel
    ### BEGIN SOLUTION
    kv_win = ext_kv[own_rows, 0]  # [n, m, C]
    logit_win = ext_score[own_rows, 0] + ape[:, 0]
    if prev_rows is not None:
        has_prev = (prev_rows >= 0)[..., None]
        kv_prev = ext_kv[prev_rows.clamp(min=0), 1] * has_prev
        logit_prev = ext_score[prev_rows.clamp(min=0), 1] + ape[:, 1]
        logit_prev = logit_prev.masked_fill(~has_prev, -math.inf)
        kv_win = torch.cat([kv_prev, kv_win], dim=1)  # [n, 2m, C]
        logit_win = torch.cat([logit_prev, logit_win], dim=1)
    pooled = (kv_win * logit_win.softmax(dim=1)).sum(dim=1)
    assert pooled.shape[0] <= slots, "at most s/m blocks end on a rank; the buffer has s/m + 1"
    return F.pad(pooled, (0, 0, 0, slots - pooled.shape[0]))
    ### END SOLUTION


def compress_reference(kv, score, ape, cu_seqlens, ratio, overlap):
    """Single-device compression of a packed sequence: the protocol's phase 1 at one rank that
    holds all T rows (its halo is rows of nothing before the first document). kv, score:
    [T, sets, C] raw rows (with overlap, sets = 2: set 0 pools an entry's own block, set 1 is read
    by the next entry); ape: [ratio, sets, C] a bias on the logits. Entry j of a document is a
    per-channel softmax over the rows of blocks j-1 and j (block -1: logit -inf, value 0).
    -> entries [T//ratio, C], document by document, zero rows at the tail."""
    T, halo = kv.shape[0], halo_rows(ratio, overlap)
    ends, starts = compressed_entry_ends(cu_seqlens, ratio)
    own_rows, prev_rows = local_entry_rows(ends, starts, 0, T, ratio, overlap)
    ext_kv, ext_score = (torch.cat([t.new_zeros(halo, *t.shape[1:]), t]) for t in (kv, score))
    return compress_local(ext_kv, ext_score, ape, own_rows, prev_rows, T // ratio)


def select_and_pad(gathered, counts, total):
    """Phase 2's fused select-and-pad: [cp, slots, C] buffers -> [total, C] global entries: rank
    r's first counts[r] rows, in rank order, then zero rows up to `total` (one index_select)."""
    ### BEGIN SOLUTION
    cp, slots, C = gathered.shape
    flat = torch.cat([gathered.flatten(0, 1), gathered.new_zeros(1, C)])  # last row: the padding
    source = torch.full((total,), cp * slots, dtype=torch.long, device=gathered.device)
    valid = [r * slots + torch.arange(int(n), device=gathered.device) for r, n in enumerate(counts)]
    valid = torch.cat(valid)
    source[: valid.numel()] = valid
    return flat.index_select(0, source)
    ### END SOLUTION


def doc_start_of(positions, cu_seqlens):
    """[n] start of the document that holds each global position."""
    return cu_seqlens[torch.searchsorted(cu_seqlens, positions, right=True) - 1]


def visibility(query_pos, query_doc_start, entry_end, entry_doc_start):
    """[Tq, N] bool: query t sees entry e iff e comes from t's document and e's block has been read
    completely, end(e) <= t. This is the public V4 code's rule ((t+1)//m blocks: the last token of
    a block sees it); the paper writes the stricter e < floor(t/m).
    query_pos [Tq] global positions, query_doc_start [Tq], entry_end [N], entry_doc_start [N]."""
    ### BEGIN SOLUTION
    same_doc = query_doc_start[:, None] == entry_doc_start[None, :]
    return same_doc & (entry_end[None, :] <= query_pos[:, None])
    ### END SOLUTION


# ---- 2. The protocol: halo exchange -> local compression -> all-gather -> select-and-pad ---------
@dataclass
class CompressedShard:
    entries: torch.Tensor  # [cp*s/m, C] the whole sequence's entries, padding rows at the tail
    visible: torch.Tensor  # [s, cp*s/m] bool: which entries each local query may see
    counts: list  # entries computed on each rank (before padding)


def context_parallel_compress(kv, gate, ape, norm, cu_seqlens, ratio, overlap, group=None):
    """V4's two-phase protocol, on one rank: its shard of raw compressor rows -> every entry of the
    whole packed sequence, identical to compressing it on one device, and local visibility.
    kv, gate: [s, sets, C] this rank's raw rows and logits (rank r holds tokens [r*s, (r+1)*s));
    ape [ratio, sets, C]; norm: the compressor's RMSNorm, [n, C] -> [n, C]; cu_seqlens [D+1] of the
    whole sequence, on kv's device. -> CompressedShard. Gradients must flow back to kv and gate on
    every rank: move rows with halo_from_previous and all_gather_entries (below), differentiable."""
    # hint: halo, local pooling, all-gather + select-and-pad; counts and visibility by global rule
    ### BEGIN SOLUTION
    rank, cp, s = dist.get_rank(group), dist.get_world_size(group), kv.shape[0]
    slots, total = s // ratio + 1, cp * s // ratio

    # phase 1a, halo exchange: the previous rank's last raw rows, those the blocks ending here pool
    halo = halo_rows(ratio, overlap)
    raw = torch.stack([kv, gate], dim=1)  # [s, 2, sets, C]
    ext = torch.cat([halo_from_previous(raw, halo, group), raw])  # [halo + s, 2, sets, C]

    # phase 1b, local compression: the blocks that END on this rank, into s/m + 1 slots
    ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
    own_rows, prev_rows = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
    buffer = norm(compress_local(ext[:, 0], ext[:, 1], ape, own_rows, prev_rows, slots))

    # phase 2: all-gather the equal-sized buffers, keep each rank's valid prefix, pad at the tail
    counts = entries_per_rank(ends, s, cp).tolist()
    entries = select_and_pad(all_gather_entries(buffer, group), counts, total)

    # visibility by rule, from global positions; padding entries end "after the sequence"
    pos = rank * s + torch.arange(s, device=kv.device)
    pad = total - ends.numel()
    entry_end = torch.cat([ends, ends.new_full((pad,), cp * s)])
    entry_doc = torch.cat([doc_starts, doc_starts.new_full((pad,), -1)])
    visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)
    return CompressedShard(entries, visible, counts)
    ### END SOLUTION


# --- the two communication steps, as autograd functions (forward and backward, picotron-style) ---
def exchange_halo(send, group=None, to_next=True):
    """Send `send` [rows, ...] to the next rank; return what the previous rank sent (zeros on rank
    0). to_next=False runs the reverse direction (the backward pass). One batch_isend_irecv: NCCL
    ignores tags and does not buffer sends, so a batched pair cannot deadlock in any issue order."""
    # hint: who is my destination, who is my source, and what do the two ends of the line do?
    ### BEGIN SOLUTION
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dst, src = (rank + 1, rank - 1) if to_next else (rank - 1, rank + 1)
    recv = torch.zeros_like(send)
    ops = []
    if 0 <= dst < world:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), _peer(group, dst), group))
    if 0 <= src < world:
        ops.append(dist.P2POp(dist.irecv, recv, _peer(group, src), group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return recv
    ### END SOLUTION


def _peer(group, rank):
    return rank if group is None else dist.get_global_rank(group, rank)


class _HaloFromPrevious(torch.autograd.Function):
    """Forward: the previous rank's last `rows` rows. Backward: their gradient, sent back."""

    @staticmethod
    def forward(ctx, x, rows, group):
        ctx.rows, ctx.group, ctx.shape = rows, group, x.shape
        return exchange_halo(x[x.shape[0] - rows :], group, to_next=True)

    @staticmethod
    def backward(ctx, grad_halo):
        grad_x = grad_halo.new_zeros(ctx.shape)
        grad_x[ctx.shape[0] - ctx.rows :] = exchange_halo(grad_halo, ctx.group, to_next=False)
        return grad_x, None, None


def halo_from_previous(x, rows, group=None):
    """[rows, ...]: the previous rank's last `rows` rows of x (zeros on rank 0); differentiable."""
    if rows == 0 or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x.new_zeros(rows, *x.shape[1:])
    return _HaloFromPrevious.apply(x, rows, group)


class _AllGather(torch.autograd.Function):
    """Forward: all-gather. Backward: each buffer's gradient summed over ranks: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group), *x.shape)
        dist.all_gather_single(out.view(-1), x.contiguous().view(-1), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(mine.view(-1), grad.contiguous().view(-1), group=ctx.group)
        return mine, None


def all_gather_entries(x, group=None):
    """[cp, *x.shape]: every rank's x, in rank order; differentiable."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x[None]
    return _AllGather.apply(x, group)


# ---- 3. Selection and attention (V4 §2.3): the lightning indexer, top-k, a sink ------------------
def index_scores(q_index, w_index, k_index):
    """Lightning indexer: I[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e] / sqrt(d)). V4 writes
    w = weights_proj(x) * Hi^-1/2: a constant scale, folded into w_index here.
    q_index [T, Hi, Di], w_index [T, Hi], k_index [N, Di] -> [T, N]."""
    dots = torch.einsum("thd,nd->thn", q_index, k_index) / math.sqrt(q_index.shape[-1])
    return torch.einsum("th,thn->tn", w_index, dots.relu())


def top_k_visible(scores, visible, top_k):
    """[T, min(top_k, N)] indices of the best visible entries per query, ascending, -1 where fewer
    are visible (V4's indexer: k = min(top_k, entries), -1 for empty slots). Ties go to the
    earlier entry (a stable sort, not topk, whose tie order is unspecified): relu makes exact-zero
    scores common, and every rank must pick what the single-device run picks."""
    values, idx = scores.masked_fill(~visible, -math.inf).sort(dim=-1, descending=True, stable=True)
    values, idx = values[:, :top_k], idx[:, :top_k]
    return torch.where(values == -math.inf, -1, idx).sort(dim=-1).values


def chosen_mask(chosen, n_entries):
    """[T, n_entries] bool from top-k indices [T, k] (-1 = none): the dense form of a selection."""
    slot = torch.where(chosen >= 0, chosen, n_entries)  # -1 goes to a spare column, then dropped
    mask = torch.zeros(chosen.shape[0], n_entries + 1, dtype=torch.bool, device=chosen.device)
    return mask.scatter_(1, slot, True)[:, :n_entries]


def attention_reference(q, entries, raw_kv, entry_allowed, raw_allowed, sink):
    """Dense single-device attention with a mask (the reference): q [T, H, D], entries [N, D],
    raw_kv [T, D], entry_allowed [T, N], raw_allowed [T, T] bool, sink [H]. -> [T, H, D]"""
    keys = torch.cat([entries, raw_kv])
    allowed = torch.cat([entry_allowed, raw_allowed], dim=1)
    logits = torch.einsum("thd,nd->htn", q, keys) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~allowed, -math.inf)
    logits = torch.cat([logits, sink[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    return torch.einsum("htn,nd->thd", logits.softmax(dim=-1)[..., :-1], keys)


def attention_gathered(q, keys, allowed, sink):
    """Attention over per-query gathered keys, which double as values (MQA): q [s, H, D], keys
    [s, K, D], allowed [s, K] bool, sink [H] (a logit in the denominator, value 0). -> [s, H, D]"""
    logits = torch.einsum("shd,skd->shk", q, keys) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~allowed[:, None, :], -math.inf)
    logits = torch.cat([logits, sink[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
    return torch.einsum("shk,skd->shd", logits.softmax(dim=-1)[..., :-1], keys)


# ---- 4. The layer: one set of weights, two ways to run it ----------------------------------------
@dataclass
class Projections:  # what a layer computes per token from x [T, dim]: no communication needed
    q: torch.Tensor  # [T, H, D] attention queries
    window_kv: torch.Tensor  # [T, D] the sliding window's K/V (keys double as values)
    kv: torch.Tensor  # [T, sets, C] the compressor's raw rows
    gate: torch.Tensor  # [T, sets, C] the compressor's logits
    q_index: torch.Tensor = None  # [T, Hi, Di] the indexer's queries (CSA)
    w_index: torch.Tensor = None  # [T, Hi] the indexer's head weights (CSA)


@dataclass
class Extras:
    entries: torch.Tensor  # [T/m, C] the global compressed sequence (main, then indexer channels)
    top_k: torch.Tensor = None  # [Tq, k] selected global entry indices, -1 = none (CSA)
    scores: torch.Tensor = None  # [Tq, T/m] indexer scores, -inf where not visible (CSA)
    counts: list = None  # entries computed on each rank, before padding


class CompressedAttention(nn.Module):
    """A CSA (overlap, indexer + top-k) or HCA (no overlap, dense) layer with a window and a sink.
    Per token: q [H, D], a raw K/V row [D] for the window, and the compressor's kv and gate logits
    [sets, C], C = D (+ the indexer's Di for CSA: per-channel pooling lets one compressor carry
    both, normalised apart). ratio: m, by default V4's (4 for CSA, 128 for HCA)."""

    def __init__(
        self,
        kind="csa",
        dim=64,
        heads=4,
        head_dim=32,
        ratio=None,
        window=16,
        top_k=16,
        index_heads=4,
        index_dim=16,
    ):
        super().__init__()
        if kind not in ("csa", "hca"):
            raise ValueError(f"kind must be 'csa' or 'hca', got {kind!r}")
        self.kind, self.overlap = kind, kind == "csa"
        self.ratio = (4 if self.overlap else 128) if ratio is None else ratio
        self.window, self.top_k = window, top_k if self.overlap else None
        self.heads, self.head_dim = heads, head_dim
        self.index_heads, self.index_dim = index_heads, index_dim
        sets, C = (2, head_dim + index_dim) if self.overlap else (1, head_dim)
        init = lambda *shape: nn.Parameter(torch.randn(*shape) / math.sqrt(shape[0]))  # noqa: E731
        self.wq, self.wkv_window = init(dim, heads * head_dim), init(dim, head_dim)
        self.wkv_compress, self.wgate_compress = init(dim, sets * C), init(dim, sets * C)
        self.ape = nn.Parameter(0.1 * torch.randn(self.ratio, sets, C))
        self.sink = nn.Parameter(torch.zeros(heads))
        self.norm_window = nn.Parameter(torch.ones(head_dim))  # V4's RMSNorms: a learned weight
        self.norm_compress = nn.Parameter(torch.ones(head_dim))
        if self.overlap:
            self.wq_index, self.w_index = init(dim, index_heads * index_dim), init(dim, index_heads)
            self.norm_index = nn.Parameter(torch.ones(index_dim))

    def project(self, x):
        """Per-token projections of x [T, dim] -> Projections."""
        T, sets = x.shape[0], 2 if self.overlap else 1
        proj = Projections(
            q=(x @ self.wq).view(T, self.heads, self.head_dim),
            window_kv=rms_norm(x @ self.wkv_window, self.norm_window),
            kv=(x @ self.wkv_compress).view(T, sets, -1),
            gate=(x @ self.wgate_compress).view(T, sets, -1),
        )
        if self.overlap:
            proj.q_index = (x @ self.wq_index).view(T, self.index_heads, self.index_dim)
            proj.w_index = x @ self.w_index
        return proj

    def normalise(self, pooled):
        """RMS-normalise the main and the indexer channels of pooled entries separately."""
        main = rms_norm(pooled[:, : self.head_dim], self.norm_compress)
        if not self.overlap:
            return main
        return torch.cat([main, rms_norm(pooled[:, self.head_dim :], self.norm_index)], dim=1)

    def context_parallel(self, x, cu_seqlens, group=None):
        """Under CP: x [s, dim] is this rank's contiguous shard, cu_seqlens [D+1] the whole packed
        sequence's. -> ([s, H, D] for the local queries, Extras with global entries and counts)."""
        agree_inputs(self, x, cu_seqlens, group)  # every rank, before any data moves (appendix)
        first, cu = dist.get_rank(group) * x.shape[0], cu_seqlens.to(x.device)
        proj = self.project(x)
        shard = context_parallel_compress(
            proj.kv, proj.gate, self.ape, self.normalise, cu, self.ratio, self.overlap, group
        )
        window_halo = halo_from_previous(proj.window_kv, self.window - 1, group)
        window_ext = torch.cat([window_halo, proj.window_kv])
        out, extras = self.attend_local(proj, shard.entries, shard.visible, window_ext, first, cu)
        extras.counts = shard.counts
        return out, extras

    def attend_local(self, proj, entries, visible, window_ext, first, cu_seqlens):
        """Local queries [first, first+s) against the global entries [N, C] and the window rows
        window_ext [window-1+s, D]: CSA attends to its top-k entries, HCA to every visible one."""
        s, D, device = proj.q.shape[0], self.head_dim, entries.device
        pos = first + torch.arange(s, device=device)
        window_keys = window_ext.unfold(0, self.window, 1).transpose(1, 2)  # [s, window, D]
        window_pos = pos[:, None] - self.window + 1 + torch.arange(self.window, device=device)
        window_allowed = window_pos >= doc_start_of(pos, cu_seqlens)[:, None]
        extras = Extras(entries=entries)
        if self.overlap:
            scores = index_scores(proj.q_index, proj.w_index, entries[:, D:])
            chosen = top_k_visible(scores, visible, self.top_k)
            entry_keys, entry_allowed = entries[chosen.clamp(min=0), :D], chosen >= 0
            extras.top_k, extras.scores = chosen, scores.masked_fill(~visible, -math.inf)
        else:
            entry_keys, entry_allowed = entries[None, :, :D].expand(s, -1, -1), visible
        keys = torch.cat([entry_keys, window_keys], dim=1)
        allowed = torch.cat([entry_allowed, window_allowed], dim=1)
        return attention_gathered(proj.q, keys, allowed, self.sink), extras

    def reference(self, x, cu_seqlens):
        """On one device: x [T, dim], cu_seqlens [D+1] -> ([T, H, D], Extras); dense masks."""
        T, D, m = x.shape[0], self.head_dim, self.ratio
        check_packing(T, cu_seqlens, 1, m, self.overlap, self.top_k, self.window)
        proj = self.project(x)
        pooled = compress_reference(proj.kv, proj.gate, self.ape, cu_seqlens, m, self.overlap)
        entries = self.normalise(pooled)
        docs = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
        info = [(a + (j + 1) * m - 1, a) for a, b in docs for j in range((b - a) // m)]
        info += [(T, -1)] * (T // m - len(info))  # padding entries: never visible
        entry_end, entry_doc = torch.tensor(info, device=x.device).reshape(-1, 2).T
        pos = torch.arange(T, device=x.device)
        doc = doc_start_of(pos, cu_seqlens)  # [T] each token's document
        visible = visible_by_rule = visibility(pos, doc, entry_end, entry_doc)
        in_window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        raw_allowed = in_window & (doc[:, None] == doc[None, :])
        extras = Extras(entries=entries)
        if self.overlap:
            scores = index_scores(proj.q_index, proj.w_index, entries[:, D:])
            chosen = top_k_visible(scores, visible, self.top_k)
            visible, extras.top_k = chosen_mask(chosen, T // m), chosen
            extras.scores = scores.masked_fill(~visible_by_rule, -math.inf)
        keys = (entries[:, :D], proj.window_kv)
        return attention_reference(proj.q, *keys, visible, raw_allowed, self.sink), extras


def shard_sequence(x, cp_size, rank):
    """The contiguous shard of x [T, ...] held by `rank`: rows [rank*s, (rank+1)*s), s = T/cp."""
    if x.shape[0] % cp_size:
        raise ValueError(
            f"the sequence length must be divisible by cp_size={cp_size}, got {x.shape[0]}; "
            f"pad the packed sequence to a multiple of {cp_size} tokens"
        )
    s = x.shape[0] // cp_size
    return x[rank * s : (rank + 1) * s]


# ==== appendix: validation and the agreement guard, then the demo =================================
def check_packing(seq_per_rank, cu_seqlens, cp_size, ratio, overlap, top_k, window):
    """Raise ValueError, saying how to fix it, unless the protocol supports this packing. Local to
    one rank, no collective; top_k may exceed the entries (the selection pads with -1, as V4's)."""
    s, cu, ints = seq_per_rank, cu_seqlens, (torch.int64, torch.int32, torch.int16, torch.int8)
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in ints:
        got = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu)
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [0, ..., T], got {got}")
    if ratio < 1:
        raise ValueError(f"the compression ratio m must be >= 1, got {ratio}")
    halo, lap = (halo_rows(ratio, overlap) if cp_size > 1 else 0), " with overlap" * overlap
    if window < 1:
        raise ValueError(f"window must be >= 1 (it includes the query's own token), got {window}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if s <= 0 or s % ratio:
        raise ValueError(
            f"tokens per rank must be a positive multiple of the compression ratio m={ratio}, "
            f"got s={s}; pad the sequence so s is a multiple of {ratio}"
        )
    if halo > s:
        raise ValueError(
            f"the compression halo must come from one rank: {halo} rows for m={ratio}{lap}, "
            f"got s={s}; use s >= {halo} or fewer ranks"
        )
    if cp_size > 1 and window - 1 > s:
        raise ValueError(
            f"the sliding window's {window - 1} rows must come from one rank, got s={s}; use "
            f"s >= {window - 1} or fewer ranks"
        )
    if cu[0] != 0 or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0 and strictly increase, got {cu.tolist()}")
    if cu[-1] != cp_size * s:
        raise ValueError(
            f"document lengths must sum to cp_size*s = {cp_size}*{s} = {cp_size * s} tokens, got "
            f"{int(cu[-1])}; the last entry of cu_seqlens is the full packed length"
        )


def agree_inputs(layer, x, cu_seqlens, group=None, entry="context_parallel"):
    """Validate this rank's input on every call (local: shapes, dtypes, the packing), then
    launch.agree_when_changed: the ranks compare when the layer first runs on a group and whenever
    any rank's packing changes: the settings, the packing and, the first time, each
    weight's digest; the verdict travels as one more field, so a refusal is reported beside the
    field that caused it, on every rank."""
    dim, error = layer.wq.shape[0], None
    try:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be [tokens, features] with features = dim = {dim}, got {got}")
        if x.dtype != layer.wq.dtype:
            raise ValueError(f"x must have the weights' dtype {layer.wq.dtype}, got {x.dtype}")
        sizes = (layer.ratio, layer.overlap, layer.top_k, layer.window)
        check_packing(x.shape[0], cu_seqlens, dist.get_world_size(group), *sizes)
    except ValueError as err:
        error = str(err)
    # any input, even one validation refused, is described: what is not a tensor by its type
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else repr(cu_seqlens)
    if isinstance(x, torch.Tensor):
        shape = {
            "tokens per rank": x.shape[0] if x.dim() else None,
            "x features": tuple(x.shape[1:]),
        }
        fields = {"entry point": entry, **shape, "x dtype": str(x.dtype), "cu_seqlens": cu}
    else:
        fields = {"entry point": entry, "x": type(x).__name__, "cu_seqlens": cu}
    settings = "kind ratio window top_k heads head_dim index_heads index_dim".split()
    fields |= {"dim": dim} | {name: getattr(layer, name) for name in settings}

    def weights(first):  # the layer's first comparison: each weight's digest, exactly
        named = layer.named_parameters() if first else []
        return {f"weight {n}": launch.weights_digest([(n, p)]) for n, p in named}

    fields |= {"validation": error or "passed"}
    device = layer.wq.device  # where the layer's data lives, whatever x is
    launch.agree_when_changed(layer, fields, device, None, group, "cp_compress", entry, weights)
    if error:  # the same on every rank: the fields agreed
        raise ValueError(f"cp_compress: {error}")


def packed_boundaries(seq_len, seq_per_rank, ratio, seed=0):
    """cu_seqlens of a packed batch whose documents start where it hurts: m-1 and 2m-1 tokens before
    a rank boundary (a straddling block; the whole halo), a 1-token one after it, random cuts."""
    cuts, g = {0, seq_len}, torch.Generator().manual_seed(seed)
    for i, boundary in enumerate(range(seq_per_rank, seq_len, seq_per_rank)):
        back = ratio - 1 if i % 2 == 0 else 2 * ratio - 1
        cuts |= {boundary - back, boundary + 2, boundary + 3}
    if seq_len > 1:
        random_cuts = torch.randint(1, seq_len, (max(1, seq_len // (32 * ratio)),), generator=g)
        cuts |= set(random_cuts.tolist())
    return torch.tensor(sorted(c for c in cuts if 0 <= c <= seq_len))


def probe_loss(out, extras, grad_out, grad_scores):
    """A random linear function of the output and of the visible indexer scores, so backward
    reaches every weight (top-k is not differentiable; V4 trains the indexer on its scores)."""
    loss = (out * grad_out).sum()
    if extras.scores is not None:  # -inf where a query may not look: no gradient there
        loss = loss + (extras.scores.nan_to_num(neginf=0.0) * grad_scores).sum()
    return loss


def phase_bytes(layer, seq_per_rank, cp_size, rank, itemsize=4):
    """Bytes this rank sends in each phase of context_parallel (rank r+1 receives the halos rank r
    sends): the halo's raw kv and gate rows, the window's K/V rows, the all-gather's buffer."""
    sets, C = (2, layer.head_dim + layer.index_dim) if layer.overlap else (1, layer.head_dim)
    sends = rank + 1 < cp_size  # the last rank sends no halo
    return {
        "phase1_halo": sends * halo_rows(layer.ratio, layer.overlap) * 2 * sets * C * itemsize,
        "window_halo": sends * (layer.window - 1) * layer.head_dim * itemsize,
        "phase2_allgather": (cp_size - 1) * (seq_per_rank // layer.ratio + 1) * C * itemsize,
    }


def compare_with_reference(layer, x_full, cu_seqlens):
    """Reference and CP forward+backward of one layer -> (max relative error of the entries and the
    output, max relative error of every gradient, the entries computed on each rank)."""
    rank, cp, T = dist.get_rank(), dist.get_world_size(), x_full.shape[0]
    weights = list(layer.parameters())
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(T, layer.heads, layer.head_dim, generator=g).to(x_full.device)
    grad_scores = torch.randn(T, T // layer.ratio, generator=g).to(x_full.device)
    this_rank = lambda t: shard_sequence(t, cp, rank)  # noqa: E731
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()  # noqa: E731
    x_ref, x_cp = x_full.clone().requires_grad_(), this_rank(x_full).clone().requires_grad_()
    out_ref, ex_ref = layer.reference(x_ref, cu_seqlens)
    loss = probe_loss(out_ref, ex_ref, grad_out, grad_scores)
    dx_ref, *ref_grads = torch.autograd.grad(loss, [x_ref, *weights])
    out_cp, ex = layer.context_parallel(x_cp, cu_seqlens)
    loss = probe_loss(out_cp, ex, this_rank(grad_out), this_rank(grad_scores))
    dx_cp, *cp_grads = torch.autograd.grad(loss, [x_cp, *weights])
    out_err = max(rel(out_cp, this_rank(out_ref)), rel(ex.entries, ex_ref.entries))
    grad_err = rel(dx_cp, this_rank(dx_ref))
    for cp_grad, ref_grad in zip(cp_grads, ref_grads):  # each rank holds its queries' share
        total = cp_grad.contiguous()  # autograd may hand back a strided view: gloo sums it wrong
        dist.all_reduce(total)
        grad_err = max(grad_err, rel(total, ref_grad))
    return out_err, grad_err, ex.counts


def demo(args, rank, world, device):
    """Both layers on a packed batch; rank 0 prints each rank's bytes sent, entries and errors."""
    cp = world  # every rank holds one shard of the sequence
    s, window = args.seq_per_rank, args.window
    labels = (
        "rank",
        "halo sent B",
        "window halo sent B",
        "all-gather sent B",
        "entries computed",
        "out rel err",
        "grad rel err",
    )
    torch.manual_seed(args.seed)  # same weights and inputs on every rank
    csa = CompressedAttention("csa", ratio=args.m_csa, top_k=args.top_k, window=window)
    hca = CompressedAttention("hca", ratio=args.m_hca, window=window)
    layers = {f"CSA (m={args.m_csa}, top-k {args.top_k})": csa, f"HCA (m'={args.m_hca})": hca}
    x = torch.randn(cp * s, 64).to(device)  # the layers' default dim
    launch.say(
        f"cp_size={cp}, {s} tokens per rank, window {window}; bytes are what each rank sends"
    )
    for name, layer in layers.items():
        m, cu = layer.ratio, packed_boundaries(cp * s, s, layer.ratio, args.seed).to(device)
        out_err, grad_err, counts = compare_with_reference(layer.to(device), x, cu)
        sent = phase_bytes(layer, s, cp, rank, x.element_size())
        local = torch.tensor([*sent.values(), counts[rank], out_err, grad_err], dtype=torch.float64)
        table = [torch.empty_like(local, device=device) for _ in range(cp)]
        dist.all_gather(table, local.to(device))
        launch.say(
            f"\n{name}: {cu.numel() - 1} packed documents, {cp * s // m} compressed slots "
            f"({cp} x s/m = {cp} x {s // m}), buffer s/m+1 = {s // m + 1} per rank; compared "
            f"{sum(counts)} entries\n" + " ".join(labels)
        )
        for r, row in enumerate(torch.stack(table).tolist()):
            cells = [r, *map(int, row[:4]), *(f"{e:.2e}" for e in row[4:])]
            launch.say(" ".join(f"{c:>{len(label)}}" for c, label in zip(cells, labels)))
        worst = torch.stack(table)[:, 4:].max().item()
        launch.say(
            f"matches the single-device reference: {'yes' if worst < 1e-5 else 'NO'} "
            f"(worst relative error {worst:.2e}, fp32; errors are max|cp - ref| / max|ref|)"
        )


def parse_args(argv=None):
    """The command line, every value checked before any process group exists."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default, low, text in (
        ("--seq-per-rank", 512, 1, "tokens per rank, s: a multiple of both m values"),
        ("--m-csa", 4, 1, "CSA compression ratio m"),
        ("--m-hca", 128, 1, "HCA compression ratio m'"),
        ("--top-k", 64, 1, "CSA indexer top-k; may exceed the number of entries"),
        ("--window", 32, 1, "sliding-window length in tokens, the query's own included"),
        ("--seed", 0, 0, "seed of weights and inputs"),
    ):
        parser.add_argument(
            flag, type=launch.at_least(low), default=default, help=f"{text} (default {default})"
        )
    args = launch.check_launch_options(parser, launch.add_launch_options(parser).parse_args(argv))
    s, world = args.seq_per_rank, int(os.environ.get("WORLD_SIZE", "1"))
    with torch.device("meta"):  # the demo's layers have the default heads
        heads = CompressedAttention().heads
    dense = 4 * heads * (world * s) ** 2  # the reference's fp32 logits [H, T, T + T/m], at least
    launch.check_fits(parser, args, dense, f"--seq-per-rank {s} on {world} rank(s)")
    for m, overlap in ((args.m_csa, True), (args.m_hca, False)):
        cu = packed_boundaries(world * s, s, m, args.seed)
        try:  # the layers' own checks, as a usage error before any process group exists
            check_packing(s, cu, world, m, overlap, args.top_k, args.window)
        except ValueError as err:
            parser.error(f"--seq-per-rank {s}, m={m}: {err}")
        if compressed_entry_ends(cu, m)[0].numel() == 0:  # "yes" about nothing would prove nothing
            parser.error(f"--seq-per-rank must leave the demo an entry for m={m}, got {s}")
    return args


if __name__ == "__main__":
    launch.run(demo, parse_args())
