"""Correct bodies for cp_compress.py's regions, each written unlike the reference."""

from tests.alternatives import Alternative

ALTERNATIVES = [
    Alternative(
        region="cp_compress.halo_rows",
        name="the block's m - 1 rows plus one more block with overlap",
        body="""
### BEGIN SOLUTION
return ratio - 1 + (ratio if overlap else 0)
### END SOLUTION
""",
    ),
    Alternative(
        region="cp_compress.compress_local",
        name="a loop over entries, the previous block concatenated only where it exists",
        body="""
### BEGIN SOLUTION
out = ext_kv.new_zeros(slots, ext_kv.shape[-1])
for e in range(own_rows.shape[0]):
    values = ext_kv[own_rows[e], 0]
    scores = ext_score[own_rows[e], 0] + ape[:, 0]
    if prev_rows is not None and bool(prev_rows[e, 0] >= 0):
        values = torch.cat([ext_kv[prev_rows[e], 1], values])
        scores = torch.cat([ext_score[prev_rows[e], 1] + ape[:, 1], scores])
    out[e] = (torch.softmax(scores, dim=0) * values).sum(0)
return out
### END SOLUTION
""",
    ),
    Alternative(
        region="cp_compress.select_and_pad",
        name="slices and a cat instead of one index_select",
        body="""
### BEGIN SOLUTION
C = gathered.shape[-1]
kept = [gathered[r, : int(n)] for r, n in enumerate(counts)]
body = torch.cat(kept) if kept else gathered.new_zeros(0, C)
return torch.cat([body, gathered.new_zeros(total - body.shape[0], C)])
### END SOLUTION
""",
    ),
    Alternative(
        region="cp_compress.visibility",
        name="torch.le and torch.eq on unsqueezed operands, logical_and",
        body="""
### BEGIN SOLUTION
done = torch.le(entry_end.unsqueeze(0), query_pos.unsqueeze(1))
same = torch.eq(entry_doc_start.unsqueeze(0), query_doc_start.unsqueeze(1))
return done.logical_and(same)
### END SOLUTION
""",
    ),
    Alternative(
        region="cp_compress.context_parallel_compress",
        name="separate halos for kv and gate, padding columns appended as never visible",
        body="""
### BEGIN SOLUTION
rank, cp = dist.get_rank(group), dist.get_world_size(group)
s = kv.shape[0]
halo = halo_rows(ratio, overlap)
ext_kv = torch.cat([halo_from_previous(kv, halo, group), kv])
ext_gate = torch.cat([halo_from_previous(gate, halo, group), gate])
ends, doc_starts = compressed_entry_ends(cu_seqlens, ratio)
own, prev = local_entry_rows(ends, doc_starts, rank, s, ratio, overlap)
local = norm(compress_local(ext_kv, ext_gate, ape, own, prev, s // ratio + 1))
counts = [int(c) for c in entries_per_rank(ends, s, cp)]
total = cp * s // ratio
entries = select_and_pad(all_gather_entries(local, group), counts, total)
pos = torch.arange(rank * s, (rank + 1) * s, device=kv.device)
seen = visibility(pos, doc_start_of(pos, cu_seqlens), ends, doc_starts)
visible = torch.cat([seen, seen.new_zeros(s, total - ends.numel())], dim=1)
return CompressedShard(entries, visible, counts)
### END SOLUTION
""",
    ),
    Alternative(
        region="cp_compress.exchange_halo",
        name="receive posted first, peers from one step sign (still one batch_isend_irecv)",
        body="""
### BEGIN SOLUTION
rank, world = dist.get_rank(group), dist.get_world_size(group)
step = 1 if to_next else -1
out = send.new_zeros(send.shape)
ops = []
if 0 <= rank - step < world:
    ops.append(dist.P2POp(dist.irecv, out, _peer(group, rank - step), group))
if 0 <= rank + step < world:
    ops.append(dist.P2POp(dist.isend, send.contiguous(), _peer(group, rank + step), group))
if ops:
    for work in dist.batch_isend_irecv(ops):
        work.wait()
return out
### END SOLUTION
""",
    ),
]
