"""Probes for tests/graded/test_cp_compress.py: each runs the submitted cp_compress.py in a
sandboxed worker and returns plain values; the verdicts are computed in the test."""

import torch
import torch.distributed as dist

import cp_compress as cpc


def halo_rows(cases):
    """[(m, overlap), ...] -> [halo_rows(m, overlap), ...]"""
    return [cpc.halo_rows(m, overlap) for m, overlap in cases]


def compress_local(ext_kv, ext_score, ape, own, prev, slots):
    return cpc.compress_local(ext_kv, ext_score, ape, own, prev, slots)


def select_and_pad(cases):
    """[(gathered, counts, total), ...] -> [select_and_pad(...), ...]"""
    return [cpc.select_and_pad(gathered, counts, total) for gathered, counts, total in cases]


def visibility(pos, doc, ends, starts):
    return cpc.visibility(pos, doc, ends, starts)


def make_layer(kind, m, window, top_k):
    """The layer the tests compare, its sink -inf and its norms away from 1 (SDPA has no sink),
    top_k above the entry count: every visible entry is attended."""
    torch.manual_seed(1234)
    if kind == "csa":
        layer = cpc.CompressedAttention(
            "csa", dim=16, heads=2, head_dim=8, ratio=m, window=window, top_k=top_k,
            index_heads=2, index_dim=4,
        )  # fmt: skip
    else:
        layer = cpc.CompressedAttention("hca", dim=16, heads=2, head_dim=8, ratio=m, window=window)
    with torch.no_grad():
        layer.sink.fill_(float("-inf"))
        for norm in (layer.norm_window, layer.norm_compress):
            norm.uniform_(0.5, 1.5)
    return layer


def layer_runs(rank, world_size, cases, window, top_k, shards):
    """For each (kind, m, cu, params) (params: the layer's, drawn by the test) with this rank's
    (x, grad_out) in ``shards`` (its rows alone: the other ranks' reach it only through the
    protocol): the protocol's output on this rank (counts, entries, visible, the halo sizes it
    asked for), then the layer's output and the gradients of sum(out * grad_out) (input, params)."""
    out = []
    real = cpc.halo_from_previous
    for (kind, m, cu, params), (x, grad_out) in zip(cases, shards, strict=True):
        layer = make_layer(kind, m, window, top_k)
        layer.load_state_dict(params, strict=True)  # the test's: its reference reads the same
        shipped = []

        def recording(t, rows, group=None):
            shipped.append(rows)
            return real(t, rows, group)

        cpc.halo_from_previous = recording
        try:
            with torch.no_grad():
                proj = layer.project(x)
                shard = cpc.context_parallel_compress(
                    proj.kv, proj.gate, layer.ape, layer.normalise, cu, m, layer.overlap
                )
        except Exception as error:  # rows indexed past a halo of the wrong size: say its size
            out.append({"error": f"{type(error).__name__}: {error}", "halos": shipped})
            return out
        finally:
            cpc.halo_from_previous = real
        x_cp = x.clone().requires_grad_()
        y, _ = layer.context_parallel(x_cp, cu)
        (y * grad_out).sum().backward()
        out.append(
            {
                "counts": [int(c) for c in shard.counts],
                "entries": shard.entries,
                "visible": shard.visible,
                "halos": shipped,
                "out": y.detach(),
                "grad_x": x_cp.grad,
                "grads": {n: p.grad for n, p in layer.named_parameters() if p.grad is not None},
            }
        )
    return out


def boundary_values(rank, world_size, s, m, members=None, tags=None):
    """Raw values tag*10000 + local position through halo_from_previous (forward and backward) on
    the CP group of ``members`` (default: the world), the rows local_entry_rows picks from
    [halo | own rows], and all_gather_entries forward and backward. tags: this rank's own numbers
    (value, weight, fill, mult), drawn by the test and handed to this rank alone: another rank's
    reach it only through the exchange."""
    group = dist.new_group(members) if members else None
    if members and rank not in members:
        return None
    me, cp = dist.get_rank(group), dist.get_world_size(group)
    value = (tags["value"] * 10000 + torch.arange(s, dtype=torch.float32))[:, None]
    value.requires_grad_()
    out = {"rank": me, "by_overlap": []}
    for overlap in (True, False):
        h = cpc.halo_rows(m, overlap)
        halo = cpc.halo_from_previous(value, h, group)
        weight = (tags["weight"] * 100 + torch.arange(halo.shape[0], dtype=torch.float32))[:, None]
        (halo * weight).sum().backward()
        grad, value.grad = value.grad.flatten().tolist(), None
        cu = torch.tensor(sorted({0, cp * s} | {b - (2 * m - 1) for b in range(s, cp * s, s)}))
        ends, starts = cpc.compressed_entry_ends(cu, m)
        own, prev = cpc.local_entry_rows(ends, starts, me, s, m, overlap)
        ext = torch.cat([halo.detach(), value.detach()]).flatten()
        mine = ends[(ends >= me * s) & (ends < me * s + s)].tolist()
        sources = []
        for e, end in enumerate(mine):
            before = ext[prev[e]].tolist() if prev is not None and prev[e, 0] >= 0 else None
            sources.append({"end": end, "own": ext[own[e]].tolist(), "prev": before})
        out["by_overlap"].append(
            {"halo": halo.detach().flatten().tolist(), "grad": grad, "sources": sources}
        )
    buf = torch.full((3, 2), float(tags["fill"])).requires_grad_()
    gathered = cpc.all_gather_entries(buf, group)
    (gathered * tags["mult"]).sum().backward()
    out["gathered"], out["gather_grad"] = gathered.detach(), buf.grad
    return out
