"""Plausible wrong bodies for the solution regions of compose.py and compose_budget.py (see
tests/mistakes/__init__.py)."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake(
        region="compose.layout_groups",
        name="the optimizer over the data-parallel replicas only",
        message="MuonZeRO's group must hold every rank of the stage",
        body="""
### BEGIN SOLUTION
mesh = launch.device_mesh(device_type, (pp, cp, dp), ("pp", "cp", "dp"))
pipelines = mesh.mesh.permute(1, 2, 0).reshape(-1, pp).tolist()
backward, _ = launch.new_subgroups_by_enumeration(pipelines)
pipeline = {"forward": mesh["pp"].get_group(), "backward": backward}
stage = mesh["dp"].get_group()
return Layout(pp, cp, dp, tuple(mesh.get_coordinate()), pipeline, mesh["cp"].get_group(),
              stage)
### END SOLUTION
""",
    ),
    Mistake(
        region="compose.layout_groups",
        name="one process group for both pipeline directions",
        message="the pipeline needs two process groups",
        body="""
### BEGIN SOLUTION
mesh = launch.device_mesh(device_type, (pp, cp, dp), ("pp", "cp", "dp"))
pipeline = {"forward": mesh["pp"].get_group(), "backward": mesh["pp"].get_group()}
stage, _ = launch.new_subgroups_by_enumeration(mesh.mesh.flatten(1).tolist())
return Layout(pp, cp, dp, tuple(mesh.get_coordinate()), pipeline, mesh["cp"].get_group(),
              stage)
### END SOLUTION
""",
    ),
    Mistake(
        region="compose.layout_groups",
        name="the mesh's dimensions in the wrong order (pp innermost)",
        message="dp innermost",
        body="""
### BEGIN SOLUTION
mesh = launch.device_mesh(device_type, (dp, cp, pp), ("dp", "cp", "pp"))
pipelines = mesh.mesh.reshape(-1, pp).tolist()
backward, _ = launch.new_subgroups_by_enumeration(pipelines)
pipeline = {"forward": mesh["pp"].get_group(), "backward": backward}
stage, _ = launch.new_subgroups_by_enumeration(mesh.mesh.permute(2, 0, 1).flatten(1).tolist())
d, c, p = mesh.get_coordinate()
return Layout(pp, cp, dp, (p, c, d), pipeline, mesh["cp"].get_group(), stage)
### END SOLUTION
""",
    ),
    Mistake(
        region="compose.layout_groups",
        name="each backward pipeline read off the flat mesh, not one (c, d)'s stages",
        message="its pipeline is ranks",
        body="""
### BEGIN SOLUTION
mesh = launch.device_mesh(device_type, (pp, cp, dp), ("pp", "cp", "dp"))
pipelines = mesh.mesh.reshape(-1, pp).tolist()
backward, _ = launch.new_subgroups_by_enumeration(pipelines)
pipeline = {"forward": mesh["pp"].get_group(), "backward": backward}
stage, _ = launch.new_subgroups_by_enumeration(mesh.mesh.flatten(1).tolist())
return Layout(pp, cp, dp, tuple(mesh.get_coordinate()), pipeline, mesh["cp"].get_group(),
              stage)
### END SOLUTION
""",
    ),
    Mistake(
        region="compose.layout_groups",
        name="the coordinates reversed, (d, c, p)",
        message="sits at (p, c, d)",
        body="""
### BEGIN SOLUTION
mesh = launch.device_mesh(device_type, (pp, cp, dp), ("pp", "cp", "dp"))
pipelines = mesh.mesh.permute(1, 2, 0).reshape(-1, pp).tolist()
backward, _ = launch.new_subgroups_by_enumeration(pipelines)
pipeline = {"forward": mesh["pp"].get_group(), "backward": backward}
stage, _ = launch.new_subgroups_by_enumeration(mesh.mesh.flatten(1).tolist())
return Layout(pp, cp, dp, tuple(reversed(mesh.get_coordinate())), pipeline,
              mesh["cp"].get_group(), stage)
### END SOLUTION
""",
    ),
    Mistake(
        region="compose.layout_groups",
        name="the CP group taken from the data-parallel dimension",
        message="its CP group is",
        body="""
### BEGIN SOLUTION
mesh = launch.device_mesh(device_type, (pp, cp, dp), ("pp", "cp", "dp"))
pipelines = mesh.mesh.permute(1, 2, 0).reshape(-1, pp).tolist()
backward, _ = launch.new_subgroups_by_enumeration(pipelines)
pipeline = {"forward": mesh["pp"].get_group(), "backward": backward}
stage, _ = launch.new_subgroups_by_enumeration(mesh.mesh.flatten(1).tolist())
return Layout(pp, cp, dp, tuple(mesh.get_coordinate()), pipeline, mesh["dp"].get_group(),
              stage)
### END SOLUTION
""",
    ),
]


# ==== the budget (compose_budget.link_bytes) ====================================================

BUDGET_MISTAKES = [
    Mistake(
        region="compose_budget.link_bytes",
        name="pp_send in one direction only (the gradients forgotten)",
        message="pp_send: an interior stage sends n_micro streams forward and n_micro gradients",
        body="""\
pp, cp, G = where.pp, where.cp, where.cp * where.dp
micro = micro_stream_bytes(cfg, cp)
directions = int(where.p < pp - 1)
sent = dict.fromkeys(SENT, 0)
sent["pp_send"] = directions * cfg.n_micro * micro

sequences = cfg.n_micro * (cfg.batch // cfg.n_micro)
first, stop = mhc.stage_layers(cfg.n_layers, pp, where.p)
for kind in (sublayer_kind(i) for i in range(first, stop)):
    if kind == "moe" or cp == 1:
        continue
    halo_directions = (where.c < cp - 1) + (where.c > 0)
    sent["cp_halo"] += sequences * halo_directions * halo_bytes(cfg, kind)
    sent["cp_gather"] += sequences * 2 * (cp - 1) * gather_buffer_bytes(cfg, kind, cp)

grad_item = BF16 if grad_sync == "bf16_sr" else FP32
Z = plan.zero_width
dense, experts = plan.dense_bucket_numel, plan.expert_chunk_numel
adamw = sum(t.numel for t in tensors if t.role == "adamw" and t.trains)
sent["grad_reduce_scatter"] = ((Z - 1) * dense + (G - 1) * experts) * grad_item
sent["grad_reduce_scatter"] += 2 * (G - 1) * adamw * FP32 // G
sent["param_all_gather"] = ((Z - 1) * dense + (G - 1) * experts) * FP32
return sent
""",
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="the paper's m halo rows instead of halo_rows",
        message="cp_halo: per attention layer and sequence the halo is cp_compress.halo_rows",
        body="""\
pp, cp, G = where.pp, where.cp, where.cp * where.dp
micro = micro_stream_bytes(cfg, cp)
directions = (where.p < pp - 1) + (where.p > 0)
sent = dict.fromkeys(SENT, 0)
sent["pp_send"] = directions * cfg.n_micro * micro

sequences = cfg.n_micro * (cfg.batch // cfg.n_micro)
first, stop = mhc.stage_layers(cfg.n_layers, pp, where.p)
for kind in (sublayer_kind(i) for i in range(first, stop)):
    if kind == "moe" or cp == 1:
        continue
    halo_directions = (where.c < cp - 1) + (where.c > 0)
    ratio = cfg.csa_ratio if kind == "csa" else cfg.hca_ratio
    sets, ch = (2, cfg.head_dim + cfg.index_dim) if kind == "csa" else (1, cfg.head_dim)
    row = (ratio * 2 * sets * ch + (cfg.window - 1) * cfg.head_dim) * FP32
    sent["cp_halo"] += sequences * halo_directions * row
    sent["cp_gather"] += sequences * 2 * (cp - 1) * gather_buffer_bytes(cfg, kind, cp)

grad_item = BF16 if grad_sync == "bf16_sr" else FP32
Z = plan.zero_width
dense, experts = plan.dense_bucket_numel, plan.expert_chunk_numel
adamw = sum(t.numel for t in tensors if t.role == "adamw" and t.trains)
sent["grad_reduce_scatter"] = ((Z - 1) * dense + (G - 1) * experts) * grad_item
sent["grad_reduce_scatter"] += 2 * (G - 1) * adamw * FP32 // G
sent["param_all_gather"] = ((Z - 1) * dense + (G - 1) * experts) * FP32
return sent
""",
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="all-gather counted to all cp ranks, itself included",
        message="cp_gather: each rank sends its s/m + 1 entry buffer to the cp - 1 others",
        body="""\
pp, cp, G = where.pp, where.cp, where.cp * where.dp
micro = micro_stream_bytes(cfg, cp)
directions = (where.p < pp - 1) + (where.p > 0)
sent = dict.fromkeys(SENT, 0)
sent["pp_send"] = directions * cfg.n_micro * micro

sequences = cfg.n_micro * (cfg.batch // cfg.n_micro)
first, stop = mhc.stage_layers(cfg.n_layers, pp, where.p)
for kind in (sublayer_kind(i) for i in range(first, stop)):
    if kind == "moe" or cp == 1:
        continue
    halo_directions = (where.c < cp - 1) + (where.c > 0)
    sent["cp_halo"] += sequences * halo_directions * halo_bytes(cfg, kind)
    sent["cp_gather"] += sequences * 2 * cp * gather_buffer_bytes(cfg, kind, cp)

grad_item = BF16 if grad_sync == "bf16_sr" else FP32
Z = plan.zero_width
dense, experts = plan.dense_bucket_numel, plan.expert_chunk_numel
adamw = sum(t.numel for t in tensors if t.role == "adamw" and t.trains)
sent["grad_reduce_scatter"] = ((Z - 1) * dense + (G - 1) * experts) * grad_item
sent["grad_reduce_scatter"] += 2 * (G - 1) * adamw * FP32 // G
sent["param_all_gather"] = ((Z - 1) * dense + (G - 1) * experts) * FP32
return sent
""",
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="gradients sent in fp32 although grad_sync is bf16_sr",
        message="grad_reduce_scatter: MuonZeRO sends each of the G - 1 peers its padded chunk",
        body="""\
pp, cp, G = where.pp, where.cp, where.cp * where.dp
micro = micro_stream_bytes(cfg, cp)
directions = (where.p < pp - 1) + (where.p > 0)
sent = dict.fromkeys(SENT, 0)
sent["pp_send"] = directions * cfg.n_micro * micro

sequences = cfg.n_micro * (cfg.batch // cfg.n_micro)
first, stop = mhc.stage_layers(cfg.n_layers, pp, where.p)
for kind in (sublayer_kind(i) for i in range(first, stop)):
    if kind == "moe" or cp == 1:
        continue
    halo_directions = (where.c < cp - 1) + (where.c > 0)
    sent["cp_halo"] += sequences * halo_directions * halo_bytes(cfg, kind)
    sent["cp_gather"] += sequences * 2 * (cp - 1) * gather_buffer_bytes(cfg, kind, cp)

grad_item = FP32
Z = plan.zero_width
dense, experts = plan.dense_bucket_numel, plan.expert_chunk_numel
adamw = sum(t.numel for t in tensors if t.role == "adamw" and t.trains)
sent["grad_reduce_scatter"] = ((Z - 1) * dense + (G - 1) * experts) * grad_item
sent["grad_reduce_scatter"] += 2 * (G - 1) * adamw * FP32 // G
sent["param_all_gather"] = ((Z - 1) * dense + (G - 1) * experts) * FP32
return sent
""",
    ),
]
# the reference's body, for the mistakes below that change one line of it
LINK_BODY = """\
pp, cp, G = where.pp, where.cp, where.cp * where.dp
micro = micro_stream_bytes(cfg, cp)
directions = (where.p < pp - 1) + (where.p > 0)
sent = dict.fromkeys(SENT, 0)
sent["pp_send"] = directions * cfg.n_micro * micro

sequences = cfg.n_micro * (cfg.batch // cfg.n_micro)
first, stop = mhc.stage_layers(cfg.n_layers, pp, where.p)
for kind in (sublayer_kind(i) for i in range(first, stop)):
    if kind == "moe" or cp == 1:
        continue
    halo_directions = (where.c < cp - 1) + (where.c > 0)
    sent["cp_halo"] += sequences * halo_directions * halo_bytes(cfg, kind)
    sent["cp_gather"] += sequences * 2 * (cp - 1) * gather_buffer_bytes(cfg, kind, cp)

grad_item = BF16 if grad_sync == "bf16_sr" else FP32
Z = plan.zero_width
dense, experts = plan.dense_bucket_numel, plan.expert_chunk_numel
adamw = sum(t.numel for t in tensors if t.role == "adamw" and t.trains)
sent["grad_reduce_scatter"] = ((Z - 1) * dense + (G - 1) * experts) * grad_item
sent["grad_reduce_scatter"] += 2 * (G - 1) * adamw * FP32 // G
sent["param_all_gather"] = ((Z - 1) * dense + (G - 1) * experts) * FP32
return sent
"""


def changed(old, new):
    assert LINK_BODY.count(old) == 1, old
    return LINK_BODY.replace(old, new)


BUDGET_MISTAKES += [
    Mistake(
        region="compose_budget.link_bytes",
        name="an end stage's stream over the whole sequence, not its T/cp tokens",
        message="pp_send: an end stage sends n_micro streams [B/n_micro, T/cp, n_hc, C]",
        body=changed("micro_stream_bytes(cfg, cp)", "micro_stream_bytes(cfg, 1)"),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="parameters gathered in the gradients' bf16",
        message="param_all_gather: every updated chunk goes to the G - 1 peers in fp32",
        body=changed("(G - 1) * experts) * FP32", "(G - 1) * experts) * grad_item"),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="AdamW's frozen tensors all-reduced too",
        message="grad_reduce_scatter: MuonZeRO sends each of the G - 1 peers its padded chunk",
        body=changed('t.role == "adamw" and t.trains', 't.role == "adamw"'),
    ),
]
# ==== end of the budget's block

MISTAKES = MISTAKES + BUDGET_MISTAKES
