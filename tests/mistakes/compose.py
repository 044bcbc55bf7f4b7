"""Plausible wrong bodies for the solution regions of compose.py and layouts/compose_budget.py (see
tests/mistakes/__init__.py)."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake(
        region="compose.layout_groups",
        name="the optimizer over the data-parallel replicas only",
        message="MuonZeRO's group must hold every rank of the stage",
        edits=(
            (
                "stage, _ = launch.new_subgroups_by_enumeration(mesh.mesh.flatten(1).tolist())",
                'stage = mesh["dp"].get_group()',
            ),
        ),
    ),
    Mistake(
        region="compose.layout_groups",
        name="one process group for both pipeline directions",
        message="the pipeline needs two process groups",
        edits=(
            ("pipelines = mesh.mesh.permute(1, 2, 0).reshape(-1, pp).tolist()", ""),
            ("  # each (c, d)'s stages\n", ""),
            ("backward, _ = launch.new_subgroups_by_enumeration(pipelines)\n", ""),
            ('"backward": backward}', '"backward": mesh["pp"].get_group()}'),
        ),
    ),
    Mistake(
        region="compose.layout_groups",
        name="the mesh's dimensions in the wrong order (pp innermost)",
        message="dp innermost",
        edits=(
            ('(pp, cp, dp), ("pp", "cp", "dp")', '(dp, cp, pp), ("dp", "cp", "pp")'),
            ("mesh.mesh.permute(1, 2, 0).reshape(-1, pp)", "mesh.mesh.reshape(-1, pp)"),
            ("mesh.mesh.flatten(1).tolist()", "mesh.mesh.permute(2, 0, 1).flatten(1).tolist()"),
            (
                "return Layout(pp, cp, dp, tuple(mesh.get_coordinate()),",
                "d, c, p = mesh.get_coordinate()\nreturn Layout(pp, cp, dp, (p, c, d),",
            ),
        ),
    ),
    Mistake(
        region="compose.layout_groups",
        name="each backward pipeline read off the flat mesh, not one (c, d)'s stages",
        message="its pipeline is ranks",
        edits=(("mesh.mesh.permute(1, 2, 0).reshape(-1, pp)", "mesh.mesh.reshape(-1, pp)"),),
    ),
    Mistake(
        region="compose.layout_groups",
        name="the coordinates reversed, (d, c, p)",
        message="sits at (p, c, d)",
        edits=(("tuple(mesh.get_coordinate())", "tuple(reversed(mesh.get_coordinate()))"),),
    ),
    Mistake(
        region="compose.layout_groups",
        name="the CP group taken from the data-parallel dimension",
        message="its CP group is",
        edits=(('mesh["cp"].get_group(), stage)', 'mesh["dp"].get_group(), stage)'),),
    ),
]


# ==== the budget (compose_budget.link_bytes) ====================================================

BUDGET_MISTAKES = [
    Mistake(
        region="compose_budget.link_bytes",
        name="pp_send in one direction only (the gradients forgotten)",
        message="pp_send: an interior stage sends n_micro streams forward and n_micro gradients",
        edits=(
            (
                "directions = (where.p < pp - 1) + (where.p > 0)",
                "directions = int(where.p < pp - 1)",
            ),
        ),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="the paper's m halo rows instead of halo_rows",
        message="cp_halo: per attention layer and sequence the halo is cp_compress.halo_rows",
        edits=(
            (
                'sent["cp_halo"] += sequences * halo_directions * halo_bytes(cfg, kind)',
                """ratio = cfg.csa_ratio if kind == "csa" else cfg.hca_ratio
    sets, ch = (2, cfg.head_dim + cfg.index_dim) if kind == "csa" else (1, cfg.head_dim)
    row = (ratio * 2 * sets * ch + (cfg.window - 1) * cfg.head_dim) * FP32
    sent["cp_halo"] += sequences * halo_directions * row""",
            ),
        ),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="all-gather counted to all cp ranks, itself included",
        message="cp_gather: each rank sends its s/m + 1 entry buffer to the cp - 1 others",
        edits=(("sequences * 2 * (cp - 1) * gather", "sequences * 2 * cp * gather"),),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="gradients sent in fp32 although grad_sync is bf16_sr",
        message="grad_reduce_scatter: MuonZeRO sends each of the G - 1 peers its padded chunk",
        edits=(('grad_item = BF16 if grad_sync == "bf16_sr" else FP32', "grad_item = FP32"),),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="an end stage's stream over the whole sequence, not its T/cp tokens",
        message="pp_send: an end stage sends n_micro streams [B/n_micro, T/cp, n_hc, C]",
        edits=(("micro_stream_bytes(cfg, cp)", "micro_stream_bytes(cfg, 1)"),),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="parameters gathered in the gradients' bf16",
        message="param_all_gather: every updated chunk goes to the G - 1 peers in fp32",
        edits=(("(G - 1) * experts) * FP32", "(G - 1) * experts) * grad_item"),),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="AdamW's gradients sent in the Muon gradients' bf16",
        message="grad_reduce_scatter: MuonZeRO sends each of the G - 1 peers its padded chunk",
        edits=(("plan.adamw_chunk_numel * FP32", "plan.adamw_chunk_numel * grad_item"),),
    ),
    Mistake(
        region="compose_budget.link_bytes",
        name="AdamW's updated tensors never gathered",
        message="param_all_gather: every updated chunk goes to the G - 1 peers in fp32",
        edits=(("* experts) * FP32 + adamw", "* experts) * FP32"),),
    ),
]
# ==== end of the budget's block

MISTAKES = MISTAKES + BUDGET_MISTAKES
