"""Correct bodies for the regions of compose.py and layouts/compose_budget.py, each unlike the
reference."""

from tests.alternatives import Alternative

ALTERNATIVES = [
    Alternative(
        region="compose.layout_groups",
        name="rank arithmetic and enumerated subgroups, no device mesh",
        body="""
### BEGIN SOLUTION
rank = dist.get_rank()
p, c, d = rank // (cp * dp), rank // dp % cp, rank % dp

def at(i, j, k):
    return (i * cp + j) * dp + k

lines = [[at(i, j, k) for i in range(pp)] for j in range(cp) for k in range(dp)]
forward, _ = launch.new_subgroups_by_enumeration(lines)
backward, _ = launch.new_subgroups_by_enumeration(lines)
rings = [[at(i, j, k) for j in range(cp)] for i in range(pp) for k in range(dp)]
cp_group, _ = launch.new_subgroups_by_enumeration(rings)
stages = [[at(i, j, k) for j in range(cp) for k in range(dp)] for i in range(pp)]
stage_group, _ = launch.new_subgroups_by_enumeration(stages)
pipeline = {"forward": forward, "backward": backward}
return Layout(pp, cp, dp, (p, c, d), pipeline, cp_group, stage_group)
### END SOLUTION
""",
    ),
    Alternative(
        region="compose_budget.link_bytes",
        name="per-direction sums, layers filtered first",
        body="""
### BEGIN SOLUTION
out = {link: 0 for link in SENT}
G = where.cp * where.dp
neighbours = int(where.p + 1 < where.pp) + int(where.p > 0)
out["pp_send"] = neighbours * cfg.n_micro * micro_stream_bytes(cfg, where.cp)
first, stop = mhc.stage_layers(cfg.n_layers, where.pp, where.p)
attention = [sublayer_kind(i) for i in range(first, stop) if sublayer_kind(i) != "moe"]
if where.cp > 1:
    sequences = (cfg.batch // cfg.n_micro) * cfg.n_micro
    halos = int(where.c + 1 < where.cp) + int(where.c > 0)
    for kind in attention:
        out["cp_halo"] += halos * halo_bytes(cfg, kind) * sequences
        buffer = gather_buffer_bytes(cfg, kind, where.cp)
        out["cp_gather"] += 2 * (where.cp - 1) * buffer * sequences
item = {"bf16_sr": BF16}.get(grad_sync, FP32)
chunks = (plan.zero_width - 1) * plan.dense_bucket_numel
chunks += (G - 1) * plan.expert_chunk_numel
adamw_bytes = FP32 * plan.adamw_chunk_numel * (G - 1)
out["grad_reduce_scatter"] = chunks * item + adamw_bytes
out["param_all_gather"] = chunks * FP32 + adamw_bytes
return out
### END SOLUTION
""",
    ),
]
