"""Plausible wrong bodies for cp_compress.py's solution regions (see tests/mistakes/__init__.py)."""

from tests.mistakes import Mistake

HALO_MSG = "the halo must carry 2m-1 rows under CSA's overlap"

MISTAKES = [
    # ---- halo_rows ----
    Mistake(
        region="cp_compress.halo_rows",
        name="the paper's m rows under overlap",
        message=HALO_MSG,
        edits=(("2 * ratio - 1", "ratio"),),
    ),
    Mistake(
        region="cp_compress.halo_rows",
        name="2m rows: one too many under overlap",
        message=HALO_MSG,
        edits=(("ratio - 1 if overlap", "ratio if overlap"),),
    ),
    Mistake(
        region="cp_compress.halo_rows",
        name="m rows without overlap (the block's own token counted)",
        message="without overlap (HCA) the halo is m-1 rows",
        edits=(("else ratio - 1", "else ratio"),),
    ),
    # ---- compress_local ----
    Mistake(
        region="cp_compress.compress_local",
        name="document boundaries ignored: prev_rows == -1 not masked",
        message="an entry that starts its document has no previous block",
        edits=(
            (
                (
                    "    has_prev = (prev_rows >= 0)[..., None]\n"
                    "    kv_prev = ext_kv[prev_rows.clamp(min=0), 1] * has_prev"
                ),
                "    kv_prev = ext_kv[prev_rows.clamp(min=0), 1]",
            ),
            ("    logit_prev = logit_prev.masked_fill(~has_prev, -math.inf)\n", ""),
        ),
    ),
    Mistake(
        region="cp_compress.compress_local",
        name="padding at the front of the buffer",
        message="the buffer holds the",
        edits=(("(0, 0, 0, slots - pooled.shape[0])", "(0, 0, slots - pooled.shape[0], 0)"),),
    ),
    Mistake(
        region="cp_compress.compress_local",
        name="softmax over the channels instead of the window's rows",
        message="softmax over the window's rows",
        edits=(("logit_win.softmax(dim=1)", "logit_win.softmax(dim=-1)"),),
    ),
    # ---- select_and_pad ----
    Mistake(
        region="cp_compress.select_and_pad",
        name="padding at the wrong end",
        message="padding rows belong at the tail",
        body="""cp, slots, C = gathered.shape
valid = torch.cat([gathered[r, : int(n)] for r, n in enumerate(counts)])
return torch.cat([gathered.new_zeros(total - valid.shape[0], C), valid])
""",
    ),
    Mistake(
        region="cp_compress.select_and_pad",
        name="each rank's last counts[r] rows instead of its first",
        message="rank r's valid entries are the FIRST counts[r] rows of its buffer",
        body="""cp, slots, C = gathered.shape
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
        edits=(("entry_end[None, :] <= query_pos", "entry_end[None, :] < query_pos"),),
    ),
    Mistake(
        region="cp_compress.visibility",
        name="document boundaries ignored",
        message="a query sees only entries of its own document",
        edits=(
            (
                (
                    "same_doc = query_doc_start[:, None] == entry_doc_start[None, :]\n"
                    "return same_doc & (entry_end[None, :] <= query_pos[:, None])"
                ),
                "return entry_end[None, :] <= query_pos[:, None]",
            ),
        ),
    ),
    Mistake(
        region="cp_compress.visibility",
        name="an incomplete block visible one token early",
        message="a block is visible only once complete",
        edits=(("query_pos[:, None])", "query_pos[:, None] + 1)"),),
    ),
    # ---- context_parallel_compress ----
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="s/m entries assumed on every rank",
        message="counts must be the entries whose block ENDS on each rank",
        edits=(("entries_per_rank(ends, s, cp).tolist()", "[s // ratio] * cp"),),
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="the paper's m-row halo hard-coded",
        message=HALO_MSG,
        edits=(("halo_rows(ratio, overlap)", "ratio"),),
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="no halo exchange: the previous rank's rows taken as zeros",
        message="entries whose pooling window starts on the previous rank differ",
        edits=(("halo_from_previous(raw, halo, group),", "raw.new_zeros(halo, *raw.shape[1:]),"),),
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="visibility from local positions",
        message="visibility must use global positions",
        edits=(("rank * s + torch.arange(s,", "torch.arange(s,"),),
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="padding entries given end 0 and document 0: visible",
        message="padding entries must never be visible",
        edits=(
            ("new_full((pad,), cp * s)])", "new_zeros(pad)])"),
            ("new_full((pad,), -1)])", "new_zeros(pad)])"),
        ),
    ),
    Mistake(
        region="cp_compress.context_parallel_compress",
        name="halo by a bare exchange_halo: no gradient back to the previous rank",
        message="gradients must flow back through the halo",
        edits=(("halo_from_previous(raw, halo,", "exchange_halo(raw[s - halo :].detach(),"),),
    ),
    # ---- exchange_halo ----
    Mistake(
        region="cp_compress.exchange_halo",
        name="a ring: rank 0 receives the last rank's rows",
        message="rank 0 has no previous rank: its halo must be zeros",
        edits=(
            (
                "dst, src = (rank + 1, rank - 1) if to_next else (rank - 1, rank + 1)",
                (
                    "step = 1 if to_next else -1\n"
                    "dst, src = (rank + step) % world, (rank - step) % world"
                ),
            ),
            (
                (
                    "ops = []\n"
                    "if 0 <= dst < world:\n"
                    "    ops.append(dist.P2POp(dist.isend, send.contiguous(),"
                    " _peer(group, dst), group))\n"
                    "if 0 <= src < world:\n"
                    "    ops.append(dist.P2POp(dist.irecv, recv, _peer(group, src), group))\n"
                    "for work in dist.batch_isend_irecv(ops) if ops else []:"
                ),
                (
                    "ops = [\n"
                    "    dist.P2POp(dist.isend, send.contiguous(), _peer(group,"
                    " dst), group),\n"
                    "    dist.P2POp(dist.irecv, recv, _peer(group, src), group),\n"
                    "]\n"
                    "for work in dist.batch_isend_irecv(ops):"
                ),
            ),
        ),
    ),
    Mistake(
        region="cp_compress.exchange_halo",
        name="to_next ignored: the gradient also travels forward",
        message="to_next=False is the backward pass",
        edits=(
            ("(rank + 1, rank - 1) if to_next else (rank - 1, rank + 1)", "rank + 1, rank - 1"),
        ),
    ),
    Mistake(
        region="cp_compress.exchange_halo",
        name="directions swapped: the halo comes from the next rank",
        message="the halo comes from the PREVIOUS rank",
        edits=(
            (
                "(rank + 1, rank - 1) if to_next else (rank - 1, rank + 1)",
                "(rank - 1, rank + 1) if to_next else (rank + 1, rank - 1)",
            ),
        ),
    ),
    Mistake(
        region="cp_compress.exchange_halo",
        name="group rank used as the global rank: wrong peers on a CP subgroup",
        message="peers must be addressed by global rank",
        edits=(
            ("_peer(group, dst),", "dst,"),
            ("_peer(group, src),", "src,"),
        ),
    ),
]
