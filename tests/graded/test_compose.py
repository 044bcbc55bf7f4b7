"""Graded tests of compose.py's layout_groups (the mesh's process groups) and
layouts/compose_budget.py's link_bytes (what each link carries per step). The probes
(tests/graded/probes/compose.py) run the student's code in a worker and hand back group ranks and
byte counts; every expected value is worked out here: the mesh's groups by their properties
(coordinates round-trip through the global rank, each group's size and shared coordinates; the list
of every group ships only in the autograder), the bytes from the tensors' shapes by a reference that
ships only in the autograder too (the student repository reads its values for the public cases
from tests/graded/stored/compose.pt: written out here, the formulas would be link_bytes' answer).

layout_groups runs on 2 real gloo ranks (4 in the ungraded tier) and, for the meshes of 4 and 8
ranks whose dimensions' order shows, rank by rank on torch's fake process group in one process.
link_bytes is arithmetic: no rank runs.
"""

import itertools
import math
import random

import pytest
from sandbox import call, on_ranks

from graded.expected import DRAW, case_seed, hidden, stored

# The private suite runs these in its slow tier: CI grades the reference with every graded
# test (make grade-fit); test_sandbox.py and test_memory_timeline.py stay in its default tier.
pytestmark = pytest.mark.slow

# link_bytes calls cp_compress.halo_rows wherever cp > 1
LINK_NEEDS = ("cp_compress.halo_rows",)
# at grading time (DRAW > 0) the configurations, the plan's sizes and the larger meshes' layouts
# are drawn; 0 is the student repository's public cases
RNG = random.Random(case_seed(0, "compose"))
H = hidden("compose")  # every rank's groups and links' bytes: only in the autograder zip


# ---- layout_groups ----------------------------------------------------------------------------


def shapes_of(world):
    """Every (pp, cp, dp) with pp * cp * dp = world."""
    return [s for s in itertools.product(range(1, world + 1), repeat=3) if math.prod(s) == world]


def check_views(shape, views):
    """Every rank's view of layout ``shape``, by properties alone: each rank's coordinates
    round-trip through global rank = (p * cp + c) * dp + d, and each group holds the rank, has the
    group's size, and its ranks (by the coordinates they report) share what the group shares;
    the hidden reference (autograder only) also lists every group."""
    pp, cp, dp = shape
    world, layout = pp * cp * dp, f"layout pp={pp} cp={cp} dp={dp}"
    assert len(views) == world, f"{layout}: {len(views)} views, not {world}"
    coords = [tuple(v["coords"]) for v in views]
    for rank, (p, c, d) in enumerate(coords):
        assert (p * cp + c) * dp + d == rank and 0 <= p < pp and 0 <= c < cp and 0 <= d < dp, (
            f"{layout}, rank {rank} sits at (p, c, d) = {(p, c, d)}; with dp innermost, global "
            "rank = (p * cp + c) * dp + d"
        )

    def holds(rank, ranks, size, shared):
        """``ranks`` are ``size`` distinct ranks, ``rank`` among them, all sharing its
        coordinates at the indices ``shared``."""
        mine = [coords[rank][i] for i in shared]
        return (
            rank in ranks
            and len(set(ranks)) == len(ranks) == size
            and all([coords[r][i] for i in shared] == mine for r in ranks)
        )

    for rank, got in enumerate(views):
        where = f"{layout}, rank {rank}"
        for link in ("forward", "backward"):
            assert holds(rank, got[link], pp, (1, 2)), (
                f"{where}: its pipeline is ranks the {pp} stages holding its (c, d) = "
                f"{coords[rank][1:]}, itself among them; got {got[link]} for the {link} link"
            )
        assert not got["one_group"], (
            f"{where}: the pipeline needs two process groups, one per direction (activations "
            "forward, gradients backward), so no issue order can deadlock under NCCL"
        )
        assert holds(rank, got["cp"], cp, (0, 2)), (
            f"{where}: its CP group is the {cp} ranks sharing its (p, d) = "
            f"{coords[rank][::2]} (dp innermost), itself among them; got {got['cp']}"
        )
        assert holds(rank, got["stage"], cp * dp, (0,)), (
            f"{where}: MuonZeRO's group must hold every rank of the stage, the cp x dp = "
            f"{cp * dp} ranks at p = {coords[rank][0]}; got {got['stage']}"
        )
        if H is not None:
            want = H.expected_view(shape, rank)
            for kind, mine in (("pipeline", got["forward"]), ("CP group", got["cp"])):
                key = "pipeline" if kind == "pipeline" else "cp"
                assert mine == want[key], f"{where}: its {kind} is ranks {want[key]}, got {mine}"
            assert got["stage"] == want["stage"], (
                f"{where}: MuonZeRO's group must hold every rank of the stage, {want['stage']}, "
                f"got {got['stage']}"
            )


@pytest.mark.grade(points=3, solution="compose.layout_groups")
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.ungraded)])
def test_layout_groups_follow_the_mesh(world):
    """Every layout of the world on real gloo ranks: each rank's coordinates and the ranks of its
    pipeline links, CP group and stage group. At 2 ranks every layout has groups of one rank
    beside groups of the world (pp=2: CP and stage groups of one rank; cp=2: one-rank pipelines)."""
    shapes = shapes_of(world)
    per_rank = on_ranks("compose:layouts", world, shapes, timeout=120)
    assert len(per_rank) == world, f"{len(per_rank)} ranks answered, not {world}"
    for i, shape in enumerate(shapes):
        check_views(shape, [views[i] for views in per_rank])


@pytest.mark.grade(points=3, solution="compose.layout_groups")
def test_layout_groups_of_larger_meshes_rank_by_rank():
    """The meshes of 4 and 8 ranks, where the order of the mesh's dimensions shows (at 2 ranks
    only one dimension exceeds 1), every rank's view in turn on torch's fake process group
    (groups are bookkeeping there: one process, nothing sent)."""
    eight = [(2, 2, 2), (2, 1, 4), (4, 2, 1)] if DRAW == 0 else RNG.sample(shapes_of(8), 3)
    for world, shapes in ((4, shapes_of(4)), (8, eight)):
        views = call("compose:layouts_on_a_fake_world", world, shapes, timeout=120)
        assert len(views) == world and all(len(v) == len(shapes) for v in views), (
            f"{world} ranks x {len(shapes)} layouts expected, got {[len(v) for v in views]}"
        )
        for i, shape in enumerate(shapes):
            check_views(shape, [v[i] for v in views])


# ---- link_bytes -------------------------------------------------------------------------------

CFG = dict(dim=64, n_layers=12, seq_len=256, batch=4, n_micro=4, n_hc=4, n_heads=4, head_dim=16,
           csa_ratio=4, hca_ratio=16, window=16, index_dim=16)  # fmt: skip
ODD = CFG | dict(dim=32, n_hc=3, n_heads=2, head_dim=8, index_dim=8, window=8, seq_len=192,
                 batch=6, n_micro=3)  # fmt: skip


def drawn(cfg):
    """``cfg`` at DRAW 0, else sizes drawn within what the chapter allows: n_layers a multiple of
    pp (up to 4), seq_len of cp (up to 4) times hca_ratio, batch of n_micro (>= pp for 1F1B)."""
    if DRAW == 0:
        return cfg
    n_micro = RNG.choice([4, 6])
    return cfg | dict(
        dim=RNG.choice([32, 48, 64, 96]),
        n_layers=RNG.choice([8, 12, 16]),
        seq_len=4 * cfg["hca_ratio"] * RNG.choice([2, 3, 4]),
        batch=n_micro * RNG.choice([1, 2]),
        n_micro=n_micro,
        n_hc=RNG.choice([2, 3, 4]),
        head_dim=RNG.choice([8, 16, 24]),
        index_dim=RNG.choice([8, 16]),
        window=RNG.choice([8, 12, 16]),
    )


CFG, ODD = drawn(CFG), drawn(ODD)
# MuonZeRO's plan as link_bytes reads it (compose_budget.PlanSizes), for a group of G ranks
PLAN = dict(dense_bucket_numel=12_345, expert_chunk_numel=6_789, adamw_chunk_numel=321)
if DRAW:
    PLAN = {key: RNG.randrange(1, 50_000) for key in PLAN}


def query(cfg, layout, p, c, grad_sync="bf16_sr"):
    """One link_bytes call at rank (p, c, 0) of layout (pp, cp, dp)."""
    pp, cp, dp = layout
    plan = dict(PLAN, zero_width=cp * dp)
    return cfg, (p, c, 0, pp, cp, dp), plan, grad_sync


def link_bytes(*queries):
    return call("compose:link_bytes", list(queries), timeout=60)


def expected(key, queries):
    """What link_bytes must give for each query: worked out from the tensors' shapes by the
    reference in the autograder zip (tests/graded/hidden/), stored for the public cases."""
    return stored("compose", key, lambda: [H.expected_links(*q) for q in queries])


@pytest.mark.grade(points=2, solution="compose_budget.link_bytes", needs=LINK_NEEDS)
def test_graded_pp_send_counts_both_directions():
    cfg = CFG
    cases = [((4, 1, 1), p, 0) for p in range(4)] + [((2, 2, 1), p, 1) for p in (0, 1)]
    cases.append(((1, 1, 4), 0, 0))
    queries = [query(cfg, layout, p, c) for layout, p, c in cases]
    got, wants = link_bytes(*queries), expected("links pp_send", queries)
    for (layout, p, c), sent, want in zip(cases, got, wants, strict=True):
        pp, cp, _ = layout
        neighbours = (p > 0) + (p < pp - 1)
        if pp == 1:
            assert sent["pp_send"] == 0, f"pp_send: one stage sends nothing, got {sent['pp_send']}"
        elif neighbours == 2:
            assert sent["pp_send"] == want["pp_send"], (
                f"pp_send: an interior stage sends n_micro streams forward and n_micro gradients "
                f"backward: got {sent['pp_send']} bytes at stage {p} of {pp}, expected "
                f"{want['pp_send']}"
            )
        else:
            assert sent["pp_send"] == want["pp_send"], (
                f"pp_send: an end stage sends n_micro streams [B/n_micro, T/cp, n_hc, C] in one "
                f"direction: got {sent['pp_send']} bytes at stage {p} of {pp} (cp = {cp}), "
                f"expected {want['pp_send']}"
            )


@pytest.mark.grade(points=2, solution="compose_budget.link_bytes", needs=LINK_NEEDS)
@pytest.mark.parametrize("name", ["default", "odd-sizes"])
def test_graded_cp_halo_is_the_chapters_halo(name):
    cfg = CFG if name == "default" else ODD
    cases = [((1, cp, 1), 0, c) for cp in (2, 4) for c in range(cp)]
    cases += [((2, 2, 1), 1, c) for c in (0, 1)] + [((1, 1, 1), 0, 0)]
    queries = [query(cfg, layout, p, c) for layout, p, c in cases]
    got, wants = link_bytes(*queries), expected(f"links cp_halo {name}", queries)
    for (layout, p, c), sent, want in zip(cases, got, wants, strict=True):
        pp, cp, _ = layout
        if cp == 1:
            assert sent["cp_halo"] == 0, f"cp_halo: cp = 1 sends no halo, got {sent['cp_halo']}"
            continue
        assert sent["cp_halo"] == want["cp_halo"], (
            f"cp_halo: per attention layer and sequence the halo is cp_compress.halo_rows raw "
            f"rows of kv and gate plus window - 1 K/V rows, sent forward by every CP rank but the "
            f"last and back by every one but the first: got {sent['cp_halo']} bytes at CP rank "
            f"{c} of {cp}, stage {p} of {pp}, expected {want['cp_halo']}"
        )


@pytest.mark.grade(points=2, solution="compose_budget.link_bytes", needs=LINK_NEEDS)
def test_graded_cp_gather_is_the_buffer_to_every_peer():
    cfg = ODD
    cases = [((1, cp, 1), 0, c) for cp in (2, 4) for c in (0, cp - 1)] + [((1, 1, 1), 0, 0)]
    queries = [query(cfg, layout, p, c) for layout, p, c in cases]
    got, wants = link_bytes(*queries), expected("links cp_gather", queries)
    for (layout, p, c), sent, want in zip(cases, got, wants, strict=True):
        _, cp, _ = layout
        assert sent["cp_gather"] == want["cp_gather"], (
            f"cp_gather: each rank sends its s/m + 1 entry buffer to the cp - 1 others (the "
            f"all-gather) and as much in backward (its reduce-scatter): got {sent['cp_gather']} "
            f"bytes at CP rank {c} of {cp}, expected {want['cp_gather']}"
        )


@pytest.mark.grade(points=2, solution="compose_budget.link_bytes", needs=LINK_NEEDS)
def test_graded_gradients_travel_in_bf16_parameters_in_fp32():
    cases = [((1, 1, 4), "bf16_sr"), ((2, 2, 1), "bf16_sr"), ((1, 2, 2), "bf16_sr"),
             ((1, 2, 2), "exact"), ((4, 1, 1), "bf16_sr")]  # fmt: skip
    queries = [query(CFG, layout, 0, 0, sync) for layout, sync in cases]
    got, wants = link_bytes(*queries), expected("links grads", queries)
    for (layout, sync), sent, want in zip(cases, got, wants, strict=True):
        G = layout[1] * layout[2]
        assert sent["grad_reduce_scatter"] == want["grad_reduce_scatter"], (
            f"grad_reduce_scatter: MuonZeRO sends each of the G - 1 peers its padded chunk in "
            f"bf16 under grad_sync bf16_sr (2 bytes; fp32 under exact) and its padded AdamW chunk "
            f"in fp32: got {sent['grad_reduce_scatter']}, expected "
            f"{want['grad_reduce_scatter']} at G = {G}, grad_sync {sync}"
        )
        assert sent["param_all_gather"] == want["param_all_gather"], (
            f"param_all_gather: every updated chunk goes to the G - 1 peers in fp32, AdamW's "
            f"too: got {sent['param_all_gather']}, expected {want['param_all_gather']} at "
            f"G = {G}"
        )
