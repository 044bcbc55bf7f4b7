"""Context parallelism for compressed attention (CSA / HCA): V4's two-stage protocol (V4 §3.4.3).

What the standard tool assumes. Context parallelism splits one long sequence into contiguous shards
of s tokens, one per rank. Keys and values are per token, so a rank that needs another rank's past
simply fetches those tokens' K/V (ring attention, or the simple all-gather of raw KV).

What V4 violates. V4 attends to compressed entries, not tokens (V4 §2.3). Every m raw tokens of a
document are pooled into one entry: CSA (m = 4) pools each block together with the block before it,
HCA (m' = 128) pools blocks without overlap. Packed documents are compressed on their own and
trailing tokens short of a block are dropped. So a pooling window can straddle a rank boundary, and
the number of entries a rank produces depends on where the documents start: it is not s/m.

The fix, in two stages. (1) Rank i sends the raw rows rank i+1 needs (the halo) point-to-point;
every rank pools the blocks that END on it into a fixed buffer of s/m + 1 entries, zero-padded
locally. (2) One all-gather of those equal-sized buffers, then a select-and-pad (one index_select)
assembles exactly cp_size*s/m entries, identical entry for entry to the single-device compressed
sequence, padding at the tail. Queries stay local. What a query may see is computed by rule from
global positions (HCA, and the indexer's candidates) and, for CSA, carried by the top-k indices.
The protocol is one function, `context_parallel_compress`, directly after the compressor.

Counting the halo (don't take "m" on trust). A rank owns the entries whose block ends on it; such a
block starts at most m-1 tokens before the rank's first token. Without overlap (HCA) that is the
halo: m-1 rows. With overlap (CSA) the entry also pools the whole block before its own, so the
earliest row is 2m-1 tokens back: the halo is 2m-1 rows (the paper's "m" is the unpacked case,
where blocks align with rank boundaries). We ship exactly that fixed size, and require it to come
from one neighbour (s >= 2m for CSA). At most s/m blocks end on a rank, so the s/m + 1 buffer always
has a spare slot. The sliding-window branch needs its own halo of window-1 raw K/V rows.

Visibility rule (we follow the public V4 code): query t sees entry e only if e comes from t's
document and e's block has been read completely, end(e) <= t. (The paper writes e < floor(t/m):
strictly earlier blocks; the public code, (t+1)//m, also lets the last token of a block see it.)

Fidelity to the public V4 code (transformers' DeepseekV4 attention; tests/test_cp_v4_oracle.py).
With the same weights, loaded by `from_v4_state_dict`, the compressed entries (CSA main and indexer
channels, HCA), the window K/V, the visibility sets, the indexer scores and its top-k are equal: the
compressor RMSNorms carry V4's learned weights (kv_norm) and eps 1e-6; the indexer's constant weight
scale Hi^-1/2 is folded into w_index. Left out of V4's attention, so its weights load only in part:
the low-rank query path (q_a_proj -> RMSNorm -> q_b_proj -> unweighted RMSNorm; here one matrix wq),
the indexer's query from that same low-rank residual (here wq_index), partial RoPE on queries,
window K/V, compressed entries and indexer queries and keys (and its inverse on the output), the
grouped low-rank output projection, and the indexer's training loss (its scores are returned; tests
backpropagate through them). All are per token or per entry at a known global position, so none
changes what crosses a rank boundary; leaving them out keeps the file about the protocol. One
deliberate difference: packed documents. The public code pools across document boundaries and lets
a query see entries of other documents; this file compresses each document on its own.

Run:
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 cp_compress.py   # N = 1..4; gloo on CPU, or NCCL
    python cp_compress.py                                          # one process, world size 1
    python cp_compress.py --help                                   # sequence length, m, top-k, ...
"""

import argparse
import datetime
import gc
import hashlib
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

RMS_EPS = 1e-6  # V4's rms_norm_eps (F.rms_norm's default, the dtype's machine eps, differs)


# --------------------------------------------------------------------------------------------------
# The compressor (V4 §2.3): softmax pooling of blocks of m raw rows, one document at a time
# --------------------------------------------------------------------------------------------------


def rms_norm(x, weight):
    """V4's RMSNorm over the last dim: x / sqrt(mean(x^2) + 1e-6) * weight (a learned weight)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps=RMS_EPS)


def compress_reference(kv, score, ape, cu_seqlens, ratio, overlap):
    """Single-device compression of a packed sequence, document by document.

    kv, score: [T, sets, C] raw rows (sets = 2 with overlap: set 0 pools an entry's own block, set 1
    the block after, i.e. it is read by the next entry; 1 without). ape: [ratio, sets, C] positional
    bias on the logits. Entry j of a document: per-channel softmax over the 2m (or m) rows of blocks
    j-1 and j; block -1 is padding (logit -inf, value 0). -> entries [T//ratio, C], zero rows at the
    tail.
    """
    T, _, C = kv.shape
    pooled = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        n = (b - a) // ratio
        if n == 0:
            continue
        kv_blocks = kv[a : a + n * ratio].unflatten(0, (n, ratio))  # [n, m, sets, C]
        logit_blocks = score[a : a + n * ratio].unflatten(0, (n, ratio)) + ape
        if overlap:
            kv_pad = kv.new_zeros(1, ratio, C)
            logit_pad = kv.new_full((1, ratio, C), float("-inf"))
            kv_prev = torch.cat([kv_pad, kv_blocks[:-1, :, 1]])
            logit_prev = torch.cat([logit_pad, logit_blocks[:-1, :, 1]])
            kv_win = torch.cat([kv_prev, kv_blocks[:, :, 0]], dim=1)  # [n, 2m, C]
            logit_win = torch.cat([logit_prev, logit_blocks[:, :, 0]], dim=1)
        else:
            kv_win, logit_win = kv_blocks[:, :, 0], logit_blocks[:, :, 0]
        pooled.append((kv_win * logit_win.softmax(dim=1)).sum(dim=1))
    entries = torch.cat(pooled) if pooled else kv.new_zeros(0, C)
    return torch.cat([entries, kv.new_zeros(T // ratio - entries.shape[0], C)])


# --------------------------------------------------------------------------------------------------
# Where the entries live under CP: which blocks end on which rank, and which raw rows they pool
# --------------------------------------------------------------------------------------------------


def halo_rows(ratio, overlap):
    """Raw rows rank i+1 needs from rank i to pool every block that ends on it (see docstring)."""
    ### BEGIN SOLUTION
    return 2 * ratio - 1 if overlap else ratio - 1
    ### END SOLUTION


def compressed_entry_ends(cu_seqlens, ratio):
    """Every compressed entry of a packed sequence, in order.

    cu_seqlens: [D+1] document boundaries (0, ..., T). Document [a, b) yields (b-a)//ratio entries;
    entry j pools tokens [a + j*ratio, a + (j+1)*ratio). -> (ends [N], doc_starts [N]): the global
    position of each entry's last token and the start of its document.
    """
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
    """Rows of the halo-extended shard that each of this rank's entries pools.

    The extended shard is [halo rows | own s rows], so global position p is row p - (rank*s - halo).
    -> own_rows [n, ratio] (the entry's block) and prev_rows [n, ratio] (the block before it, -1
    where the entry is its document's first and the previous block is padding), or prev_rows None
    without overlap. n = entries whose block ends on this rank (<= s/ratio).
    """
    first = rank * seq_per_rank
    mine = (ends >= first) & (ends < first + seq_per_rank)
    block_start = ends[mine] - ratio + 1
    offset = first - halo_rows(ratio, overlap)
    own_rows = block_start[:, None] + torch.arange(ratio, device=ends.device) - offset
    if not overlap:
        return own_rows, None
    has_prev = (block_start - ratio >= doc_starts[mine])[:, None]
    prev_rows = torch.where(has_prev, own_rows - ratio, -1)
    return own_rows, prev_rows


def compress_local(ext_kv, ext_score, ape, own_rows, prev_rows, slots):
    """Pool this rank's entries from its halo-extended shard into a fixed buffer (stage 1).

    ext_kv, ext_score: [halo + s, sets, C]; own_rows / prev_rows from local_entry_rows.
    -> [slots, C]: the n valid entries first, zero rows after, so every rank sends an equal buffer.
    """
    # hint: the same pooling as compress_reference, but the windows are given as row indices
    ### BEGIN SOLUTION
    kv_win = ext_kv[own_rows, 0]  # [n, m, C]
    logit_win = ext_score[own_rows, 0] + ape[:, 0]
    if prev_rows is not None:
        has_prev = (prev_rows >= 0)[..., None]
        kv_prev = ext_kv[prev_rows.clamp(min=0), 1] * has_prev
        logit_prev = ext_score[prev_rows.clamp(min=0), 1] + ape[:, 1]
        logit_prev = logit_prev.masked_fill(~has_prev, float("-inf"))
        kv_win = torch.cat([kv_prev, kv_win], dim=1)  # [n, 2m, C]
        logit_win = torch.cat([logit_prev, logit_win], dim=1)
    pooled = (kv_win * logit_win.softmax(dim=1)).sum(dim=1)
    assert pooled.shape[0] <= slots, "at most s/m blocks end on a rank; the buffer has s/m + 1"
    return F.pad(pooled, (0, 0, 0, slots - pooled.shape[0]))
    ### END SOLUTION


def select_and_pad(gathered, counts, total):
    """Stage 2's fused select-and-pad: [cp, slots, C] buffers -> [total, C] global entries.

    Rank r's first counts[r] rows, in rank order, then zero rows up to `total`: one index_select.
    """
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
    """[Tq, N] bool: query t sees entry e iff same document and e's block is complete (end <= t)."""
    ### BEGIN SOLUTION
    same_doc = query_doc_start[:, None] == entry_doc_start[None, :]
    return same_doc & (entry_end[None, :] <= query_pos[:, None])
    ### END SOLUTION


# --------------------------------------------------------------------------------------------------
# The distributed protocol: halo exchange -> local compression -> all-gather -> select-and-pad
# --------------------------------------------------------------------------------------------------


@dataclass
class CompressedShard:
    entries: torch.Tensor  # [cp*s/m, C] the whole sequence's entries, padding rows at the tail
    visible: torch.Tensor  # [s, cp*s/m] bool: which entries each local query may see
    counts: list  # entries computed on each rank (before padding)
    bytes_sent: dict  # bytes this rank handed to each stage


def context_parallel_compress(kv, gate, ape, norm, cu_seqlens, ratio, overlap, group=None):
    """V4's two-stage protocol, on one rank: its shard of raw compressor rows -> every entry of the
    whole packed sequence, identical to compressing it on one device, and local visibility.

    kv, gate: [s, sets, C] this rank's raw rows and logits (rank r holds tokens [r*s, (r+1)*s));
    ape [ratio, sets, C]; norm: entries [n, C] -> [n, C] (the compressor's RMSNorm);
    cu_seqlens [D+1] of the whole sequence, on kv's device. -> CompressedShard.
    """
    # hint: four steps, each a function above; counts and visibility come from global positions
    ### BEGIN SOLUTION
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    s = kv.shape[0]
    slots, total = s // ratio + 1, cp * s // ratio

    # stage 1a, halo exchange: the previous rank's last raw rows, those the blocks ending here pool
    halo = halo_rows(ratio, overlap)
    raw = torch.stack([kv, gate], dim=1)  # [s, 2, sets, C]
    ext = torch.cat([halo_from_previous(raw, halo, group), raw])  # [halo + s, 2, sets, C]

    # stage 1b, local compression: the blocks that END on this rank, into s/m + 1 slots
    ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
    own_rows, prev_rows = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
    buffer = norm(compress_local(ext[:, 0], ext[:, 1], ape, own_rows, prev_rows, slots))

    # stage 2: all-gather the equal-sized buffers, keep each rank's valid prefix, pad at the tail
    counts = entries_per_rank(ends, s, cp).tolist()
    entries = select_and_pad(all_gather_entries(buffer, group), counts, total)

    # visibility by rule, from global positions; padding entries end "after the sequence"
    pos = rank * s + torch.arange(s, device=kv.device)
    pad = total - ends.numel()
    entry_end = torch.cat([ends, ends.new_full((pad,), cp * s)])
    entry_doc = torch.cat([doc_starts, doc_starts.new_full((pad,), -1)])
    visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)

    size = raw.element_size()
    sent = {
        "stage1_halo": halo * raw[0].numel() * size if rank + 1 < cp else 0,
        "stage2_allgather": (cp - 1) * buffer.numel() * size,  # a ring all-gather, per rank
    }
    return CompressedShard(entries, visible, counts, sent)
    ### END SOLUTION


# --- the two communication steps, as autograd functions (forward and backward, picotron-style) ---


def exchange_halo(send, group=None, to_next=True):
    """Send `send` [rows, ...] to the next rank; return what the previous rank sent (zeros on rank
    0). to_next=False runs the reverse direction (the backward pass). One batch_isend_irecv: NCCL
    ignores tags and does not buffer sends, so a batched pair cannot deadlock in any issue order.
    """
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
    """Forward: the previous rank's last `rows` rows (zeros on rank 0, which nothing reads).
    Backward: their gradient goes back to the previous rank, added onto its last rows."""

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
    """Forward: every rank's [slots, C] buffer -> [cp, slots, C]. Backward: each rank's queries
    made a gradient for every buffer; a buffer's gradient is their sum over ranks: a
    reduce-scatter."""

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


# --------------------------------------------------------------------------------------------------
# Selection and attention (V4 §2.3): the lightning indexer, top-k, attention with a sink
# --------------------------------------------------------------------------------------------------


def index_scores(q_index, w_index, k_index):
    """Lightning indexer: I[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e] / sqrt(d)).

    V4 writes w = weights_proj(x) * Hi^-1/2: a constant scale, folded into w_index here.
    q_index [T, Hi, Di], w_index [T, Hi], k_index [N, Di] -> [T, N].
    """
    dots = torch.einsum("thd,nd->thn", q_index, k_index) / math.sqrt(q_index.shape[-1])
    return torch.einsum("th,thn->tn", w_index, dots.relu())


def top_k_visible(scores, visible, top_k):
    """[T, min(top_k, N)] indices of the best visible entries per query, ascending, -1 where fewer
    are visible (V4's indexer: k = min(top_k, entries), -1 for empty slots).

    Ties go to the earlier entry (a stable sort, not topk, whose tie order is unspecified): relu
    makes exact-zero scores common, and every rank must pick what the single-device run picks.
    """
    masked = scores.masked_fill(~visible, float("-inf"))
    values, idx = masked.sort(dim=-1, descending=True, stable=True)
    values, idx = values[:, :top_k], idx[:, :top_k]
    return torch.where(values == float("-inf"), -1, idx).sort(dim=-1).values


def chosen_mask(chosen, n_entries):
    """[T, n_entries] bool from top-k indices [T, k] (-1 = none): the dense form of a selection."""
    slot = torch.where(chosen >= 0, chosen, n_entries)  # -1 goes to a spare column, then dropped
    mask = torch.zeros(chosen.shape[0], n_entries + 1, dtype=torch.bool, device=chosen.device)
    return mask.scatter_(1, slot, True)[:, :n_entries]


def attention_reference(q, entries, raw_kv, entry_allowed, raw_allowed, sink):
    """Dense single-device attention with a mask (the reference). Keys double as values (MQA).

    q [T, H, D], entries [N, D], raw_kv [T, D], entry_allowed [T, N], raw_allowed [T, T] bool,
    sink [H] (a per-head logit in the softmax denominator with a zero value). -> [T, H, D]
    """
    keys = torch.cat([entries, raw_kv])
    allowed = torch.cat([entry_allowed, raw_allowed], dim=1)
    logits = torch.einsum("thd,nd->htn", q, keys) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~allowed, float("-inf"))
    logits = torch.cat([logits, sink[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1]
    return torch.einsum("htn,nd->thd", probs, keys)


def attention_gathered(q, keys, allowed, sink):
    """Attention over per-query gathered keys (the CP path): q [s, H, D], keys [s, K, D],
    allowed [s, K]. Explicit softmax with the sink as an extra logit. -> [s, H, D]
    """
    logits = torch.einsum("shd,skd->shk", q, keys) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    logits = torch.cat([logits, sink[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1]
    return torch.einsum("shk,skd->shd", probs, keys)


# --------------------------------------------------------------------------------------------------
# The layer: one set of weights, three ways to run it
# --------------------------------------------------------------------------------------------------


@dataclass
class Projections:
    """Everything a layer computes per token from x [T, dim]: no communication needed."""

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
    bytes_sent: dict = field(default_factory=dict)  # bytes this rank sent, per stage


class CompressedAttention(nn.Module):
    """A CSA (overlap, indexer + top-k) or HCA (no overlap, dense) layer with a window and a sink.

    Per token: q [H, D] for attention, a raw K/V row [D] for the window, and the compressor's rows:
    kv and gate logits [sets, C], C = D (+ the indexer's Di for CSA; per-channel pooling lets one
    compressor carry both, normalised separately). Every projection is per token: no communication.
    """

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
        self.ratio = ratio or (4 if kind == "csa" else 128)
        self.heads, self.head_dim, self.window = heads, head_dim, window
        self.top_k = top_k if self.overlap else None
        self.index_heads, self.index_dim = index_heads, index_dim
        sets = 2 if self.overlap else 1
        channels = head_dim + (index_dim if self.overlap else 0)

        def init(*shape):
            return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[0]))

        self.wq = init(dim, heads * head_dim)
        self.wkv_window = init(dim, head_dim)
        self.wkv_compress = init(dim, sets * channels)
        self.wgate_compress = init(dim, sets * channels)
        self.ape = nn.Parameter(0.1 * torch.randn(self.ratio, sets, channels))
        self.sink = nn.Parameter(torch.zeros(heads))
        # V4's RMSNorms carry a learned weight (kv_norm on the window K/V and on the compressor's
        # output; the indexer has its own), eps 1e-6
        self.norm_window = nn.Parameter(torch.ones(head_dim))
        self.norm_compress = nn.Parameter(torch.ones(head_dim))
        if self.overlap:
            self.wq_index = init(dim, index_heads * index_dim)
            self.w_index = init(dim, index_heads)  # V4's weights_proj times Hi^-1/2, folded in
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

    # --- context parallel: the protocol above, then the sliding window and attention -----------
    def context_parallel(self, x, cu_seqlens, group=None):
        """x [s, dim]: this rank's contiguous shard; cu_seqlens [D+1] of the whole packed sequence.
        -> ([s, H, D] for the local queries, Extras with the global entries and bytes sent)."""
        check_inputs(self, x, cu_seqlens, group)  # every rank, before any data moves (appendix)
        rank, s = dist.get_rank(group), x.shape[0]
        cu_seqlens = cu_seqlens.to(x.device)
        proj = self.project(x)
        shard = context_parallel_compress(
            proj.kv,
            proj.gate,
            self.ape,
            self.normalise,
            cu_seqlens,
            self.ratio,
            self.overlap,
            group,
        )
        # the sliding window needs window-1 raw K/V rows from the previous rank
        window_halo = halo_from_previous(proj.window_kv, self.window - 1, group)
        window_ext = torch.cat([window_halo, proj.window_kv])
        out, extras = self._attend_local(
            proj, shard.entries, shard.visible, window_ext, rank * s, cu_seqlens
        )
        extras.counts = shard.counts
        last = rank + 1 == dist.get_world_size(group)
        window_sent = 0 if last else window_halo.numel() * window_halo.element_size()
        extras.bytes_sent = {**shard.bytes_sent, "window_halo": window_sent}
        return out, extras

    def _attend_local(self, proj, entries, visible, window_ext, first, cu_seqlens):
        """Local queries [first, first+s) against the global entries [N, C] and the window rows
        window_ext [window-1+s, D]. CSA carries its choice to the sparse attention as top-k
        indices; HCA attends to every visible entry."""
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
            extras.top_k, extras.scores = chosen, scores.masked_fill(~visible, float("-inf"))
        else:
            entry_keys, entry_allowed = entries[None, :, :D].expand(s, -1, -1), visible
        out = attention_gathered(
            proj.q,
            torch.cat([entry_keys, window_keys], dim=1),
            torch.cat([entry_allowed, window_allowed], dim=1),
            self.sink,
        )
        return out, extras

    # --- single device, full sequence: the reference ---------------------------------------------
    def reference(self, x, cu_seqlens):
        """x [T, dim], cu_seqlens [D+1] -> ([T, H, D], Extras). No communication, dense masks."""
        T, D, m = x.shape[0], self.head_dim, self.ratio
        validate_layout(T, cu_seqlens, 1, m, self.overlap, self.top_k, self.window)
        proj = self.project(x)
        entries = self.normalise(
            compress_reference(proj.kv, proj.gate, self.ape, cu_seqlens, m, self.overlap)
        )
        # this document-by-document walk is the reference's own bookkeeping
        doc_of_token = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff())
        ends, docs = [], []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            ends += [a + (j + 1) * m - 1 for j in range((b - a) // m)]
            docs += [a] * ((b - a) // m)
        pad = T // m - len(ends)  # padding entries: never visible
        entry_end = torch.tensor(ends + [T] * pad, device=x.device)
        entry_doc = torch.tensor(docs + [-1] * pad, device=x.device)
        pos = torch.arange(T, device=x.device)
        visible = visibility(pos, doc_of_token, entry_end, entry_doc)
        same_doc = doc_of_token[:, None] == doc_of_token[None, :]
        in_window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        extras = Extras(entries=entries)
        if self.overlap:
            scores = index_scores(proj.q_index, proj.w_index, entries[:, D:])
            chosen = top_k_visible(scores, visible, self.top_k)
            entry_allowed = chosen_mask(chosen, T // m)
            extras.top_k, extras.scores = chosen, scores.masked_fill(~visible, float("-inf"))
        else:
            entry_allowed = visible
        out = attention_reference(
            proj.q, entries[:, :D], proj.window_kv, entry_allowed, same_doc & in_window, self.sink
        )
        return out, extras

    # --- the simple baseline: all-gather every raw row, compress the whole sequence everywhere ----
    def allgather_baseline(self, x, cu_seqlens, group=None):
        """Same result as context_parallel, by all-gathering the raw compressor rows (and window
        K/V) of every token and compressing the whole sequence on every rank; the attention is the
        same code. -> ([s, H, D], Extras with bytes_sent). The benchmark prices the protocol
        against it."""
        check_inputs(self, x, cu_seqlens, group, entry="allgather_baseline")
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        s, D, m = x.shape[0], self.head_dim, self.ratio
        cu_seqlens = cu_seqlens.to(x.device)
        proj = self.project(x)
        raw_local = torch.stack([proj.kv, proj.gate], dim=1)
        raw = all_gather_entries(raw_local, group).flatten(0, 1)  # [T, 2, sets, C]
        window_all = all_gather_entries(proj.window_kv, group).flatten(0, 1)  # [T, D]
        entries = self.normalise(
            compress_reference(raw[:, 0], raw[:, 1], self.ape, cu_seqlens, m, self.overlap)
        )
        ends, doc_starts = compressed_entry_ends(cu_seqlens, m)
        pos = rank * s + torch.arange(s, device=x.device)
        pad = cp * s // m - ends.numel()
        entry_end = torch.cat([ends, ends.new_full((pad,), cp * s)])
        entry_doc = torch.cat([doc_starts, doc_starts.new_full((pad,), -1)])
        visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)
        window_all = torch.cat([window_all.new_zeros(self.window - 1, D), window_all])
        window_ext = window_all[rank * s : rank * s + s + self.window - 1]
        out, extras = self._attend_local(proj, entries, visible, window_ext, rank * s, cu_seqlens)
        size = raw.element_size()
        extras.bytes_sent = {
            "allgather_raw": (cp - 1) * raw_local.numel() * size,
            "allgather_window": (cp - 1) * proj.window_kv.numel() * size,
        }
        return out, extras


def shard_sequence(x, cp_size, rank):
    """The contiguous shard of x [T, ...] held by `rank`: rows [rank*s, (rank+1)*s), s = T/cp."""
    if x.shape[0] % cp_size:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by cp_size={cp_size}; "
            f"pad the packed sequence to a multiple of {cp_size} tokens"
        )
    s = x.shape[0] // cp_size
    return x[rank * s : (rank + 1) * s]


# ---- appendix: agreement guard, validation, loading V4 weights, demo, set-up --------------------


def validate_layout(seq_per_rank, cu_seqlens, cp_size, ratio, overlap, top_k, window):
    """Raise ValueError (saying how to fix it) unless the protocol supports this shard layout.

    Local to one rank: no collective. `top_k` may exceed the number of entries (V4's 512 with a
    short packed batch): the selection then pads with -1, as V4's indexer does.
    """
    s = seq_per_rank
    cu = cu_seqlens
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        shape = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [0, ..., T], got shape {shape}")
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [0, ..., T], got dtype {cu.dtype}"
        )
    if ratio < 1:
        raise ValueError(f"the compression ratio m must be >= 1, got {ratio}")
    if window < 1:
        raise ValueError(
            f"window must be >= 1 (the sliding window includes the query's own token), "
            f"got window={window}"
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got top_k={top_k}")
    if s <= 0 or s % ratio:
        raise ValueError(
            f"each rank holds s={s} tokens, which is not a positive multiple of the "
            f"compression ratio m={ratio}; pad the sequence so s is a multiple of {ratio}"
        )
    if cp_size > 1 and halo_rows(ratio, overlap) > s:
        raise ValueError(
            f"the compression halo ({halo_rows(ratio, overlap)} rows for m={ratio}"
            f"{' with overlap' if overlap else ''}) is longer than a shard (s={s}): it "
            f"would have to come from more than one rank; use s >= {2 * ratio} or fewer "
            f"ranks"
        )
    if cp_size > 1 and window - 1 > s:
        raise ValueError(
            f"the sliding window ({window}) needs {window - 1} rows from the previous "
            f"rank but a shard has only s={s}; use s >= {window - 1} or fewer ranks"
        )
    if cu[0] != 0 or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0 and strictly increase, got {cu.tolist()}")
    total = cp_size * s
    if cu[-1] != total:
        raise ValueError(
            f"document lengths sum to {int(cu[-1])} tokens but cp_size*s = {cp_size}*{s}"
            f" = {total}; the last entry of cu_seqlens must be the full packed length"
        )


def validate_input(layer, x, cu_seqlens, cp_size):
    """This rank's own input, checked before the guard: shapes and dtypes the layer can take."""
    dim = layer.wq.shape[0]
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != dim:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"x must be [tokens, features] with features = the layer's dim = {dim}, "
            f"got shape {shape}"
        )
    if x.dtype != layer.wq.dtype:
        raise ValueError(
            f"x has dtype {x.dtype} but the layer's weights are {layer.wq.dtype}; "
            f"cast one to the other"
        )
    validate_layout(
        x.shape[0], cu_seqlens, cp_size, layer.ratio, layer.overlap, layer.top_k, layer.window
    )


def agreement_fields(layer, x, cu_seqlens):
    """Everything that must be equal on every rank, as readable values (in the order reported).

    Built from any input, even one validation refused, so a bad rank can still join the guard.
    """
    fields = {
        "tokens per rank": x.shape[0] if x.dim() else None,
        "x features": tuple(x.shape[1:]),
        "x dtype": str(x.dtype),
        "cu_seqlens": cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens,
    }
    for name in (
        "kind",
        "ratio",
        "window",
        "top_k",
        "heads",
        "head_dim",
        "index_heads",
        "index_dim",
    ):
        fields[name] = getattr(layer, name)
    fields["dim"] = layer.wq.shape[0]
    # a cheap checksum of every weight: its exact float64 sum and sum of squares, one sync in all
    params = dict(layer.named_parameters())
    sums = torch.stack(
        [torch.stack([p.double().sum(), p.double().square().sum()]) for p in params.values()]
    ).tolist()
    for (name, p), (total, squares) in zip(params.items(), sums):
        fields[f"weight {name}"] = f"{p.dtype} {list(p.shape)} sum {total!r} sum sq {squares!r}"
    return fields


def _short(value, limit=120):
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def agreement_guard(fields, local_error, group=None):
    """All ranks, before the first collective: exchange a digest and the readable fields, compare
    exactly, and raise on EVERY rank the same ValueError naming what differs and where.

    A rank whose own validation failed (local_error) still joins, so no rank is left waiting.
    (It runs on every call here for safety; a training loop would check once per batch layout.)
    """
    digest = hashlib.sha256(repr(list(fields.items())).encode()).hexdigest()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (digest, fields, local_error), group=group)
    problems = []
    if len({d for d, _, _ in everyone}) > 1:
        # every field any rank sent, in first-seen order: the same list, so the same text, on all
        for name in dict.fromkeys(name for _, f, _ in everyone for name in f):
            values = [f.get(name, "<missing>") for _, f, _ in everyone]
            ranks_by_value = {}
            for r, v in enumerate(values):
                ranks_by_value.setdefault(repr(v), []).append(r)
            if len(ranks_by_value) == 1:
                continue
            parts = [
                f"rank {','.join(map(str, ranks))} {'have' if len(ranks) > 1 else 'has'} "
                f"{_short(values[ranks[0]])}"
                for ranks in ranks_by_value.values()
            ]
            problems.append(f"{name} differs across ranks: {', '.join(parts)}")
    problems += [
        f"rank {r} refused its input: {err}" for r, (_, _, err) in enumerate(everyone) if err
    ]
    if problems:
        raise ValueError(
            "; ".join(problems) + " (every rank must hold an equal contiguous shard "
            "of the same packed sequence, with the same layer and weights)"
        )


def check_inputs(layer, x, cu_seqlens, group=None, entry="context_parallel"):
    """Validate this rank's input, then run the agreement guard: every rank raises or none does."""
    try:
        validate_input(layer, x, cu_seqlens, dist.get_world_size(group))
        error = None
    except ValueError as err:
        error = str(err)
    try:
        fields = {"entry point": entry, **agreement_fields(layer, x, cu_seqlens)}
    except Exception as err:  # an input too odd to describe still joins the guard, with its error
        fields, error = {"entry point": entry}, error or f"unreadable input: {err!r}"
    agreement_guard(fields, error, group)


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
    layer = CompressedAttention(
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


# --- the demo ----------------------------------------------------------------------------------


def packed_boundaries(seq_len, seq_per_rank, ratio, seed=0):
    """cu_seqlens of a packed batch with documents starting where it hurts: m-1 tokens before a rank
    boundary (a straddling block), 2m-1 before (with overlap, the halo is used to its first row), a
    1-token document just after each boundary, and a few random cuts."""
    g = torch.Generator().manual_seed(seed)
    cuts = {0, seq_len}
    for i, boundary in enumerate(range(seq_per_rank, seq_len, seq_per_rank)):
        cuts |= {
            boundary - (ratio - 1 if i % 2 == 0 else 2 * ratio - 1),
            boundary + 2,
            boundary + 3,
        }
    cuts |= set(torch.randint(1, seq_len, (max(1, seq_len // (32 * ratio)),), generator=g).tolist())
    return torch.tensor(sorted(c for c in cuts if 0 <= c <= seq_len))


def probe_loss(out, extras, grad_out, grad_scores):
    """A random linear function of the output and of the visible indexer scores, so backward
    reaches every weight (the top-k choice is not differentiable; V4 trains the indexer on its
    scores)."""
    loss = (out * grad_out).sum()
    if extras.scores is not None:
        loss = (
            loss + torch.where(extras.scores.isfinite(), extras.scores, 0.0).mul(grad_scores).sum()
        )
    return loss


def _demo_layer(layer, x_full, cu_seqlens, device):
    """Reference and CP forward+backward -> (max relative error of entries and output, of every
    gradient, the CP Extras, seconds)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    T = x_full.shape[0]
    grad_out = torch.randn(T, layer.heads, layer.head_dim, generator=g).to(device)
    grad_scores = torch.randn(T, T // layer.ratio, generator=g).to(device)
    x_ref = x_full.clone().requires_grad_()
    out_ref, ex_ref = layer.reference(x_ref, cu_seqlens)
    probe_loss(out_ref, ex_ref, grad_out, grad_scores).backward()
    ref_grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for n, p in layer.named_parameters()
    }
    layer.zero_grad()

    def mine(t):
        return shard_sequence(t, cp, rank)

    x_cp = mine(x_full).clone().requires_grad_()
    t0 = time.perf_counter()
    out_cp, extras = layer.context_parallel(x_cp, cu_seqlens)
    probe_loss(out_cp, extras, mine(grad_out), mine(grad_scores)).backward()
    elapsed = time.perf_counter() - t0

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

    out_err = max(rel(out_cp, mine(out_ref)), rel(extras.entries, ex_ref.entries))
    grad_err = rel(x_cp.grad, mine(x_ref.grad))
    for n, p in layer.named_parameters():  # each rank holds its own queries' share of a gradient
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        dist.all_reduce(grad)
        grad_err = max(grad_err, rel(grad, ref_grads[n]))
    layer.zero_grad()
    return out_err, grad_err, extras, elapsed


def demo_layers(args, dim=64):
    """The demo's two layers, built from the command line (same weights on every rank)."""
    return {
        f"CSA (m={args.m_csa}, top-k {args.top_k})": CompressedAttention(
            "csa", dim=dim, ratio=args.m_csa, top_k=args.top_k, window=args.window
        ),
        f"HCA (m'={args.m_hca})": CompressedAttention(
            "hca", dim=dim, ratio=args.m_hca, window=args.window
        ),
    }


def report(name, layer, cu, seq_per_rank, rows, compared):
    """Rank 0 prints one layer's table: bytes each rank SENDS per stage (rank r+1 receives the
    halo rank r sends), entries computed per rank, errors against the reference, time."""
    cp, m = len(rows), layer.ratio
    print(
        f"\n{name}: {cu.numel() - 1} packed documents, {cp * seq_per_rank // m} compressed slots "
        f"({cp} x s/m = {cp} x {seq_per_rank // m}), buffer s/m+1 = {seq_per_rank // m + 1} per "
        f"rank; compared {compared} entries"
    )
    print(
        f"{'rank':>4} {'halo sent B':>11} {'window halo sent B':>18} {'all-gather sent B':>17} "
        f"{'entries computed':>16} {'out rel err':>11} {'grad rel err':>12} {'fwd+bwd s':>9}"
    )
    for r, v in enumerate(rows):
        print(
            f"{r:>4} {int(v[0]):>11} {int(v[1]):>18} {int(v[2]):>17} {int(v[3]):>16} "
            f"{v[4]:>11.2e} {v[5]:>12.2e} {v[6]:>9.3f}"
        )
    worst = max(max(v[4], v[5]) for v in rows)
    print(
        f"matches the single-device reference: {'yes' if worst < 1e-5 else 'NO'} "
        f"(worst relative error {worst:.2e}, fp32; errors are max|cp - ref| / max|ref|)"
    )


def parse_args(argv=None):
    """The command line, every argument checked here, before any process group exists."""
    parser = argparse.ArgumentParser(
        description="V4's two-stage context parallelism for compressed attention (CSA and HCA): "
        "runs the protocol and the single-device reference, prints bytes and errors."
    )
    parser.add_argument(
        "--seq-per-rank",
        type=int,
        default=512,
        help="tokens per rank, s: a multiple of both m values (default 512)",
    )
    parser.add_argument("--m-csa", type=int, default=4, help="CSA compression ratio m (default 4)")
    parser.add_argument(
        "--m-hca", type=int, default=128, help="HCA compression ratio m' (default 128)"
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=64,
        help="CSA indexer top-k; may exceed the number of entries (default 64)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=32,
        help="sliding-window length in tokens, the query's own included (default 32)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of weights and inputs (default 0)"
    )
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default=None,
        help="process-group backend (default: NCCL when every rank has a GPU, else gloo)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where tensors live (default: cuda with NCCL, else cpu)",
    )
    args = parser.parse_args(argv)
    s, world = args.seq_per_rank, int(os.environ.get("WORLD_SIZE", "1"))
    for name in ("m_csa", "m_hca", "top_k", "window", "seq_per_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for m in (args.m_csa, args.m_hca):
        if s % m:
            parser.error(f"--seq-per-rank {s} is not a multiple of m={m}; try {s - s % m + m}")
    if world > 1 and (2 * args.m_csa - 1 > s or args.m_hca - 1 > s or args.window - 1 > s):
        parser.error(
            f"--seq-per-rank {s} is shorter than a halo (CSA {2 * args.m_csa - 1} rows, "
            f"HCA {args.m_hca - 1}, window {args.window - 1}); use more tokens per rank"
        )
    for m in (args.m_csa, args.m_hca):
        ends, _ = compressed_entry_ends(packed_boundaries(world * s, s, m, args.seed), m)
        if ends.numel() == 0:  # a comparison of nothing would print "yes" and prove nothing
            parser.error(
                f"with --seq-per-rank {s} the demo's packing leaves no entry for m={m}: "
                f"nothing to compare; use more tokens per rank"
            )
    return args


# ---- set-up: the same block in every technique file, copied so each file stands alone ----


def choose_backend(backend=None, device=None):
    """Pick (backend, device type) for this launch and say why, in one line.

    Defaults: NCCL on CUDA when every local rank can have a GPU of its own, else gloo on the CPU.
    gloo with --device cuda lets several ranks share a GPU (a one-GPU machine can run N = 4).
    Refuses combinations that cannot work, before any process group exists.
    """
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"--backend must be gloo or nccl, got {backend!r}")
    if device is None:
        device = "cuda" if backend != "gloo" and 0 < local_ranks <= gpus else "cpu"
        if device == "cuda":
            why = f"{gpus} GPU(s) for {local_ranks} local rank(s)"
        elif backend == "gloo" or gpus == 0:
            why = "--backend gloo" if backend == "gloo" else "no GPU visible"
        else:
            why = f"{gpus} GPU(s) are too few for {local_ranks} local ranks"
    else:
        why = f"--device {device}"
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible; pass --device cpu")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl moves only CUDA tensors: pass --device cuda, or gloo")
    if backend == "nccl" and local_ranks > gpus:
        raise ValueError(
            f"NCCL needs one GPU per local rank: {local_ranks} ranks, {gpus} GPU(s); "
            "launch fewer ranks, or pass --backend gloo to share GPUs"
        )
    return backend, device, f"backend {backend}, device {device} ({why})"


def setup(backend=None, device=None, seed=0, timeout_s=120):
    """Join torchrun's process group, or make a group of one when run as plain `python FILE`.

    Returns (rank, world_size, device). The CUDA device is set before the group is created, so
    NCCL binds each rank to its own GPU.
    """
    backend, device_type, why = choose_backend(backend, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if device_type == "cuda" else 1
    dev = torch.device("cuda", local_rank % gpus) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # launched by torchrun: its environment carries the rendezvous
        dist.init_process_group(
            backend, timeout=timeout, device_id=dev if backend == "nccl" else None
        )
    else:  # plain `python FILE`: a group of one, no network
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    torch.manual_seed(seed)
    if dist.get_rank() == 0:
        print(f"[setup] {dist.get_world_size()} rank(s), {why}", flush=True)
    return dist.get_rank(), dist.get_world_size(), dev


def teardown():
    """Collect cycles that hold communicators, then destroy the group (torch warns otherwise)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    rank, cp, device = setup(args.backend, args.device, seed=args.seed)
    s, dim, t_start = args.seq_per_rank, 64, time.perf_counter()
    torch.manual_seed(args.seed)  # same weights and inputs on every rank
    layers = demo_layers(args, dim)
    x = torch.randn(cp * s, dim).to(device)
    if rank == 0:
        print(
            f"cp_size={cp}, {s} tokens per rank, window {args.window}; bytes are what each rank "
            f"sends"
        )
    for name, layer in layers.items():
        layer.to(device)
        cu = packed_boundaries(cp * s, s, layer.ratio, args.seed).to(device)
        out_err, grad_err, ex, elapsed = _demo_layer(layer, x, cu, device)
        sent = ex.bytes_sent
        row = torch.tensor(
            [
                sent["stage1_halo"],
                sent["window_halo"],
                sent["stage2_allgather"],
                ex.counts[rank],
                out_err,
                grad_err,
                elapsed,
            ],
            dtype=torch.float64,
            device=device,
        )
        rows = [torch.zeros_like(row) for _ in range(cp)]
        dist.all_gather(rows, row)
        if rank == 0:
            report(name, layer, cu, s, [r.tolist() for r in rows], sum(ex.counts))
            print(f"[{time.perf_counter() - t_start:.1f} s] {name} done", flush=True)
    teardown()


if __name__ == "__main__":
    main()
