"""Probes for tests/graded/test_compose.py: they run the regions of compose.py and
layouts/compose_budget.py in a worker and return what came out as plain values (group ranks,
byte counts); the tests decide."""

import datetime
import types

import torch.distributed as dist

import compose
import launch
from layouts import compose_budget


def _view(pp, cp, dp):
    """This rank's Layout of pp x cp x dp, its groups as lists of global ranks."""
    got = compose.layout_groups(pp, cp, dp)
    forward, backward = got.pipeline["forward"], got.pipeline["backward"]
    ranks = dist.get_process_group_ranks
    return {
        "coords": tuple(got.coords),
        "forward": ranks(forward),
        "backward": ranks(backward),
        "one_group": forward is backward,
        "cp": ranks(got.cp_group),
        "stage": ranks(got.stage_group),
    }


def layouts(rank, world_size, shapes):
    """layout_groups on real gloo ranks, one Layout per (pp, cp, dp) in shapes."""
    out = []
    for shape in shapes:
        out.append(_view(*shape))
        dist.barrier()  # no rank leaves while a peer is still connecting that layout's groups
    return out


def layouts_on_a_fake_world(world_size, shapes):
    """Every rank's Layouts of a world of world_size ranks, in this one process: torch's fake
    process group (its test backend: groups are bookkeeping, nothing is sent) joined as each rank
    in turn. -> [rank][layout] views."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # the fake backend has no options to carry a timeout: launch's helpers get a plain one
    launch.world_options = lambda: types.SimpleNamespace(_timeout=datetime.timedelta(seconds=60))
    launch.device_mesh = lambda kind, shape, names: init_device_mesh(
        kind, shape, mesh_dim_names=names
    )
    out = []
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            out.append([_view(*shape) for shape in shapes])
        finally:
            dist.destroy_process_group()
    return out


def link_bytes(queries):
    """compose_budget.link_bytes for each query: (config fields, (p, c, d, pp, cp, dp), plan sizes
    {zero_width, dense_bucket_numel, expert_chunk_numel, adamw_chunk_numel}, grad_sync). The plan
    is handed over as layout_budget hands it (compose_budget.PlanSizes)."""
    out = []
    for fields, where, plan, grad_sync in queries:
        cfg = compose.ComposeConfig(**fields)
        sizes = compose_budget.PlanSizes(**plan)
        sent = compose_budget.link_bytes(cfg, compose_budget.Rank(*where), sizes, grad_sync)
        out.append(dict(sent))
    return out
