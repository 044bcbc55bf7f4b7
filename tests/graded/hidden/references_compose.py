"""The independent reference for tests/graded/test_compose.py's layouts: every rank's coordinates
and groups, listed from the mesh's coordinates. It ships only in the autograder zip: in the
student repository it would be an answer for compose.layout_groups (each list made a group);
there the tests check the groups' properties alone."""

import itertools


def expected_view(shape, rank):
    """Rank `rank`'s coordinates and groups, from the mesh's coordinates listed dp innermost."""
    at = list(itertools.product(*(range(n) for n in shape)))  # at[rank] = (p, c, d)
    p, c, d = at[rank]
    return {
        "coords": (p, c, d),
        "pipeline": [r for r, (_, c2, d2) in enumerate(at) if (c2, d2) == (c, d)],
        "cp": [r for r, (p2, _, d2) in enumerate(at) if (p2, d2) == (p, d)],
        "stage": [r for r, (p2, _, _) in enumerate(at) if p2 == p],
    }


# ---- link_bytes: the bytes each link carries per step, from the tensors' shapes ----------------
FP32, BF16 = 4, 2


def stage_kinds(cfg, pp, p):
    """The sublayer kinds stage p of pp holds: an equal contiguous share of the layers, CSA at
    i % 4 == 0, HCA at i % 4 == 2, MoE at odd i (compose_budget.sublayer_kind)."""
    share = cfg["n_layers"] // pp
    return ["moe" if i % 2 else "csa" if i % 4 == 0 else "hca"
            for i in range(p * share, (p + 1) * share)]  # fmt: skip


def needed_raw_rows(m, overlap):
    """Raw rows before a CP rank's first token that the entries ending on that rank pool, over
    every block alignment (packed documents start anywhere): a block of m rows ending at or after
    the first token, and under overlap the block before it too."""
    rows = 0
    for start in range(-2 * m, 1):  # a block's first row, the rank's first token at 0
        if start + m - 1 >= 0:  # it ends on this rank
            rows = max(rows, -(start - m if overlap else start))
    return rows


def halo_per_direction(cfg, kind):
    """One attention layer's halo for one sequence: raw kv and gate rows [rows, 2, sets, ch] and
    the window's window - 1 raw K/V rows [head_dim], fp32. CSA pools two overlapping sets of
    head_dim + index_dim channels, HCA one set of head_dim."""
    m = cfg["csa_ratio"] if kind == "csa" else cfg["hca_ratio"]
    sets, ch = (2, cfg["head_dim"] + cfg["index_dim"]) if kind == "csa" else (1, cfg["head_dim"])
    compressor = needed_raw_rows(m, kind == "csa") * 2 * sets * ch
    return FP32 * (compressor + (cfg["window"] - 1) * cfg["head_dim"])


def expected_links(cfg, rank, plan, grad_sync):
    """What compose_budget.link_bytes must give for ``rank`` = (p, c, d, pp, cp, dp)."""
    p, c, _, pp, cp, dp = rank
    micro, attention = (
        cfg["batch"] // cfg["n_micro"],
        [k for k in stage_kinds(cfg, pp, p) if k != "moe"],
    )
    stream = FP32 * micro * (cfg["seq_len"] // cp) * cfg["n_hc"] * cfg["dim"]
    pp_send = ((p > 0) + (p < pp - 1)) * cfg["n_micro"] * stream if pp > 1 else 0
    directions = (c < cp - 1) + (c > 0)  # forward to c + 1, its gradient back to c - 1
    cp_halo = cfg["batch"] * directions * sum(halo_per_direction(cfg, k) for k in attention)
    buffers = 0  # one sequence's stage-2 buffers, s/m + 1 entries of every attention layer
    for kind in attention:
        m = cfg["csa_ratio"] if kind == "csa" else cfg["hca_ratio"]
        ch = cfg["head_dim"] + (cfg["index_dim"] if kind == "csa" else 0)
        buffers += (cfg["seq_len"] // cp // m + 1) * ch * FP32
    cp_gather = cfg["batch"] * 2 * (cp - 1) * buffers  # the all-gather, then its reduce-scatter
    G = cp * dp
    chunk = plan["dense_bucket_numel"] + plan["expert_chunk_numel"]  # one peer's share
    adamw = (G - 1) * plan["adamw_chunk_numel"] * FP32  # AdamW's chunk, always fp32
    item = BF16 if grad_sync == "bf16_sr" else FP32
    return {
        "pp_send": pp_send,
        "cp_halo": cp_halo if cp > 1 else 0,
        "cp_gather": cp_gather,
        "grad_reduce_scatter": (G - 1) * chunk * item + adamw,
        "param_all_gather": (G - 1) * chunk * FP32 + adamw,
    }
