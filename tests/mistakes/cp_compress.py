"""Plausible wrong bodies for cp_compress.py's solution regions (see tests/mistakes/__init__.py)."""

from tests.mistakes import Mistake

HALO_MSG = "the halo must carry 2m-1 rows under CSA's overlap"

MISTAKES = [
    # ---- halo_rows ----
    Mistake(
        region="cp_compress.halo_rows",
        name="the paper's m rows under overlap",
        message=HALO_MSG,
        body="return ratio if overlap else ratio - 1\n",
    ),
    Mistake(
        region="cp_compress.halo_rows",
        name="2m rows: one too many under overlap",
        message=HALO_MSG,
        body="return 2 * ratio if overlap else ratio - 1\n",
    ),
    Mistake(
        region="cp_compress.halo_rows",
        name="m rows without overlap (the block's own token counted)",
        message="without overlap (HCA) the halo is m-1 rows",
        body="return 2 * ratio - 1 if overlap else ratio\n",
    ),
    # ---- compress_local ----
    Mistake(
        region="cp_compress.compress_local",
        name="document boundaries ignored: prev_rows == -1 not masked",
        message="an entry that starts its document has no previous block",
        body="""\
kv_win = ext_kv[own_rows, 0]
logit_win = ext_score[own_rows, 0] + ape[:, 0]
if prev_rows is not None:
    kv_prev = ext_kv[prev_rows.clamp(min=0), 1]
    logit_prev = ext_score[prev_rows.clamp(min=0), 1] + ape[:, 1]
    kv_win = torch.cat([kv_prev, kv_win], dim=1)
    logit_win = torch.cat([logit_prev, logit_win], dim=1)
pooled = (kv_win * logit_win.softmax(dim=1)).sum(dim=1)
return F.pad(pooled, (0, 0, 0, slots - pooled.shape[0]))
""",
    ),
    Mistake(
        region="cp_compress.compress_local",
        name="padding at the front of the buffer",
        message="the buffer holds the",
        body="""\
kv_win = ext_kv[own_rows, 0]
logit_win = ext_score[own_rows, 0] + ape[:, 0]
if prev_rows is not None:
    has_prev = (prev_rows >= 0)[..., None]
    kv_prev = ext_kv[prev_rows.clamp(min=0), 1] * has_prev
    logit_prev = ext_score[prev_rows.clamp(min=0), 1] + ape[:, 1]
    logit_prev = logit_prev.masked_fill(~has_prev, -math.inf)
    kv_win = torch.cat([kv_prev, kv_win], dim=1)
    logit_win = torch.cat([logit_prev, logit_win], dim=1)
pooled = (kv_win * logit_win.softmax(dim=1)).sum(dim=1)
return F.pad(pooled, (0, 0, slots - pooled.shape[0], 0))
""",
    ),
    Mistake(
        region="cp_compress.compress_local",
        name="softmax over the channels instead of the window's rows",
        message="softmax over the window's rows",
        body="""\
kv_win = ext_kv[own_rows, 0]
logit_win = ext_score[own_rows, 0] + ape[:, 0]
if prev_rows is not None:
    has_prev = (prev_rows >= 0)[..., None]
    kv_prev = ext_kv[prev_rows.clamp(min=0), 1] * has_prev
    logit_prev = ext_score[prev_rows.clamp(min=0), 1] + ape[:, 1]
    logit_prev = logit_prev.masked_fill(~has_prev, -math.inf)
    kv_win = torch.cat([kv_prev, kv_win], dim=1)
    logit_win = torch.cat([logit_prev, logit_win], dim=1)
pooled = (kv_win * logit_win.softmax(dim=-1)).sum(dim=1)
return F.pad(pooled, (0, 0, 0, slots - pooled.shape[0]))
""",
    ),
    # ---- select_and_pad ----
    Mistake(
        region="cp_compress.select_and_pad",
        name="padding at the wrong end",
        message="padding rows belong at the tail",
        body="""\
cp, slots, C = gathered.shape
valid = torch.cat([gathered[r, : int(n)] for r, n in enumerate(counts)])
return torch.cat([gathered.new_zeros(total - valid.shape[0], C), valid])
""",
    ),
    Mistake(
        region="cp_compress.select_and_pad",
        name="each rank's last counts[r] rows instead of its first",
        message="rank r's valid entries are the FIRST counts[r] rows of its buffer",
        body="""\
cp, slots, C = gathered.shape
valid = torch.cat([gathered[r, slots - int(n) :] for r, n in enumerate(counts)])
return torch.cat([valid, gathered.new_zeros(total - valid.shape[0], C)])
""",
    ),
    Mistake(
        region="cp_compress.select_and_pad",
        name="counts ignored: every buffer row kept, cut to total",
        message="only rank r's first counts[r] rows are entries",
        body="""\
return gathered.flatten(0, 1)[:total]
""",
    ),
    # ---- visibility ----
    Mistake(
        region="cp_compress.visibility",
        name="the paper's strict rule: end(e) < t",
        message="the last token of a block sees that block",
        body="""\
same_doc = query_doc_start[:, None] == entry_doc_start[None, :]
return same_doc & (entry_end[None, :] < query_pos[:, None])
""",
    ),
    Mistake(
        region="cp_compress.visibility",
        name="document boundaries ignored",
        message="a query sees only entries of its own document",
        body="""\
return entry_end[None, :] <= query_pos[:, None]
""",
    ),
    Mistake(
        region="cp_compress.visibility",
        name="an incomplete block visible one token early",
        message="a block is visible only once complete",
        body="""\
same_doc = query_doc_start[:, None] == entry_doc_start[None, :]
return same_doc & (entry_end[None, :] <= query_pos[:, None] + 1)
""",
    ),
    # ---- context_parallel_compress ----
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="s/m entries assumed on every rank",
        message="counts must be the entries whose block ENDS on each rank",
        body="""\
rank, cp = dist.get_rank(group), dist.get_world_size(group)
s = kv.shape[0]
slots, total = s // ratio + 1, cp * s // ratio
halo = halo_rows(ratio, overlap)
raw = torch.stack([kv, gate], dim=1)
ext = torch.cat([halo_from_previous(raw, halo, group), raw])
ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
own_rows, prev_rows = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
buffer = norm(compress_local(ext[:, 0], ext[:, 1], ape, own_rows, prev_rows, slots))
counts = [s // ratio] * cp
entries = select_and_pad(all_gather_entries(buffer, group), counts, total)
pos = rank * s + torch.arange(s, device=kv.device)
pad = total - ends.numel()
entry_end = torch.cat([ends, ends.new_full((pad,), cp * s)])
entry_doc = torch.cat([doc_starts, doc_starts.new_full((pad,), -1)])
visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)
return CompressedShard(entries, visible, counts)
""",
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="the paper's m-row halo hard-coded",
        message=HALO_MSG,
        body="""\
rank, cp = dist.get_rank(group), dist.get_world_size(group)
s = kv.shape[0]
slots, total = s // ratio + 1, cp * s // ratio
halo = ratio
raw = torch.stack([kv, gate], dim=1)
ext = torch.cat([halo_from_previous(raw, halo, group), raw])
ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
own_rows, prev_rows = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
buffer = norm(compress_local(ext[:, 0], ext[:, 1], ape, own_rows, prev_rows, slots))
counts = entries_per_rank(ends, s, cp).tolist()
entries = select_and_pad(all_gather_entries(buffer, group), counts, total)
pos = rank * s + torch.arange(s, device=kv.device)
pad = total - ends.numel()
entry_end = torch.cat([ends, ends.new_full((pad,), cp * s)])
entry_doc = torch.cat([doc_starts, doc_starts.new_full((pad,), -1)])
visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)
return CompressedShard(entries, visible, counts)
""",
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="no halo exchange: the previous rank's rows taken as zeros",
        message="entries whose pooling window starts on the previous rank differ",
        body="""\
rank, cp = dist.get_rank(group), dist.get_world_size(group)
s = kv.shape[0]
slots, total = s // ratio + 1, cp * s // ratio
halo = halo_rows(ratio, overlap)
raw = torch.stack([kv, gate], dim=1)
ext = torch.cat([raw.new_zeros(halo, *raw.shape[1:]), raw])
ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
own_rows, prev_rows = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
buffer = norm(compress_local(ext[:, 0], ext[:, 1], ape, own_rows, prev_rows, slots))
counts = entries_per_rank(ends, s, cp).tolist()
entries = select_and_pad(all_gather_entries(buffer, group), counts, total)
pos = rank * s + torch.arange(s, device=kv.device)
pad = total - ends.numel()
entry_end = torch.cat([ends, ends.new_full((pad,), cp * s)])
entry_doc = torch.cat([doc_starts, doc_starts.new_full((pad,), -1)])
visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)
return CompressedShard(entries, visible, counts)
""",
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="visibility from local positions",
        message="visibility must use global positions",
        body="""\
rank, cp = dist.get_rank(group), dist.get_world_size(group)
s = kv.shape[0]
slots, total = s // ratio + 1, cp * s // ratio
halo = halo_rows(ratio, overlap)
raw = torch.stack([kv, gate], dim=1)
ext = torch.cat([halo_from_previous(raw, halo, group), raw])
ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
own_rows, prev_rows = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
buffer = norm(compress_local(ext[:, 0], ext[:, 1], ape, own_rows, prev_rows, slots))
counts = entries_per_rank(ends, s, cp).tolist()
entries = select_and_pad(all_gather_entries(buffer, group), counts, total)
pos = torch.arange(s, device=kv.device)
pad = total - ends.numel()
entry_end = torch.cat([ends, ends.new_full((pad,), cp * s)])
entry_doc = torch.cat([doc_starts, doc_starts.new_full((pad,), -1)])
visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)
return CompressedShard(entries, visible, counts)
""",
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="padding entries given end 0 and document 0: visible",
        message="padding entries must never be visible",
        body="""\
rank, cp = dist.get_rank(group), dist.get_world_size(group)
s = kv.shape[0]
slots, total = s // ratio + 1, cp * s // ratio
halo = halo_rows(ratio, overlap)
raw = torch.stack([kv, gate], dim=1)
ext = torch.cat([halo_from_previous(raw, halo, group), raw])
ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
own_rows, prev_rows = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
buffer = norm(compress_local(ext[:, 0], ext[:, 1], ape, own_rows, prev_rows, slots))
counts = entries_per_rank(ends, s, cp).tolist()
entries = select_and_pad(all_gather_entries(buffer, group), counts, total)
pos = rank * s + torch.arange(s, device=kv.device)
pad = total - ends.numel()
entry_end = torch.cat([ends, ends.new_zeros(pad)])
entry_doc = torch.cat([doc_starts, doc_starts.new_zeros(pad)])
visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)
return CompressedShard(entries, visible, counts)
""",
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="halo by a bare exchange_halo: no gradient back to the previous rank",
        message="gradients must flow back through the halo",
        body="""\
rank, cp = dist.get_rank(group), dist.get_world_size(group)
s = kv.shape[0]
slots, total = s // ratio + 1, cp * s // ratio
halo = halo_rows(ratio, overlap)
raw = torch.stack([kv, gate], dim=1)
ext = torch.cat([exchange_halo(raw[s - halo :].detach(), group), raw])
ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
own_rows, prev_rows = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
buffer = norm(compress_local(ext[:, 0], ext[:, 1], ape, own_rows, prev_rows, slots))
counts = entries_per_rank(ends, s, cp).tolist()
entries = select_and_pad(all_gather_entries(buffer, group), counts, total)
pos = rank * s + torch.arange(s, device=kv.device)
pad = total - ends.numel()
entry_end = torch.cat([ends, ends.new_full((pad,), cp * s)])
entry_doc = torch.cat([doc_starts, doc_starts.new_full((pad,), -1)])
visible = visibility(pos, doc_start_of(pos, cu_seqlens), entry_end, entry_doc)
return CompressedShard(entries, visible, counts)
""",
    ),
    # ---- exchange_halo ----
    Mistake(
        region="cp_compress.exchange_halo",
        name="a ring: rank 0 receives the last rank's rows",
        message="rank 0 has no previous rank: its halo must be zeros",
        body="""\
rank, world = dist.get_rank(group), dist.get_world_size(group)
step = 1 if to_next else -1
dst, src = (rank + step) % world, (rank - step) % world
recv = torch.zeros_like(send)
ops = [
    dist.P2POp(dist.isend, send.contiguous(), _peer(group, dst), group),
    dist.P2POp(dist.irecv, recv, _peer(group, src), group),
]
for work in dist.batch_isend_irecv(ops):
    work.wait()
return recv
""",
    ),
    Mistake(
        region="cp_compress.exchange_halo",
        name="to_next ignored: the gradient also travels forward",
        message="to_next=False is the backward pass",
        body="""\
rank, world = dist.get_rank(group), dist.get_world_size(group)
dst, src = rank + 1, rank - 1
recv = torch.zeros_like(send)
ops = []
if 0 <= dst < world:
    ops.append(dist.P2POp(dist.isend, send.contiguous(), _peer(group, dst), group))
if 0 <= src < world:
    ops.append(dist.P2POp(dist.irecv, recv, _peer(group, src), group))
for work in dist.batch_isend_irecv(ops) if ops else []:
    work.wait()
return recv
""",
    ),
    Mistake(
        region="cp_compress.exchange_halo",
        name="directions swapped: the halo comes from the next rank",
        message="the halo comes from the PREVIOUS rank",
        body="""\
rank, world = dist.get_rank(group), dist.get_world_size(group)
dst, src = (rank - 1, rank + 1) if to_next else (rank + 1, rank - 1)
recv = torch.zeros_like(send)
ops = []
if 0 <= dst < world:
    ops.append(dist.P2POp(dist.isend, send.contiguous(), _peer(group, dst), group))
if 0 <= src < world:
    ops.append(dist.P2POp(dist.irecv, recv, _peer(group, src), group))
for work in dist.batch_isend_irecv(ops) if ops else []:
    work.wait()
return recv
""",
    ),
    Mistake(
        region="cp_compress.exchange_halo",
        name="group rank used as the global rank: wrong peers on a CP subgroup",
        message="peers must be addressed by global rank",
        body="""\
rank, world = dist.get_rank(group), dist.get_world_size(group)
dst, src = (rank + 1, rank - 1) if to_next else (rank - 1, rank + 1)
recv = torch.zeros_like(send)
ops = []
if 0 <= dst < world:
    ops.append(dist.P2POp(dist.isend, send.contiguous(), dst, group))
if 0 <= src < world:
    ops.append(dist.P2POp(dist.irecv, recv, src, group))
for work in dist.batch_isend_irecv(ops) if ops else []:
    work.wait()
return recv
""",
    ),
]
