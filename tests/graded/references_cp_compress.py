"""The checks and scalar references that cp_compress.py's tests share, graded and private alike.

close compares a tensor to its reference relative to the reference's largest magnitude; layouts
draws document boundaries where the protocol's halos and straddling blocks are at their worst.
The scalar pooling (naive_compress) ships only in the autograder zip: tests/graded/hidden/.
"""

import torch


def close(actual, expected, what, rel=1e-5):
    """max |got - ref| <= rel * max |ref| (each test module says why rel)."""
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    )
    scale = max(expected.abs().max().item(), 1e-30)
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rel * scale, f"{what}: max |got - ref| = {err:.3e} > {rel:g} * {scale:.3e}"


def layouts(world_size, s, ratio):
    """cu_seqlens with document boundaries everywhere that matters for this world size."""
    T = world_size * s
    boundaries = list(range(s, T, s)) or [s // 2]  # one rank: still test an inner boundary
    worst_overlap = {b - (2 * ratio - 1) for b in boundaries}  # a block ending at b: 2m-1 back
    worst_straddle = {b - (ratio - 1) for b in boundaries}  # a document starting m-1 before b
    short_docs = {b + 2 for b in boundaries} | {b + 3 for b in boundaries}  # a 1-token document
    g = torch.Generator().manual_seed(world_size * 100 + ratio)
    random_cuts = set(torch.randint(1, T, (T // 8,), generator=g).tolist())
    out = []
    for cuts in (set(), worst_overlap, worst_straddle | short_docs, set(boundaries) | {1, 2},
                 random_cuts):  # fmt: skip
        out.append(torch.tensor(sorted({c for c in cuts if 0 < c < T} | {0, T})))
    return out


def shard(t, world_size, rank):
    s = t.shape[0] // world_size
    return t[rank * s : (rank + 1) * s]


def entry_windows(cu, m, overlap):
    """(end, document start, [(row, set, offset), ...]) of every entry, from the definition."""
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for j in range((b - a) // m):
            rows = [(a + j * m + i, 0, i) for i in range(m)]
            rows += [(a + (j - 1) * m + i, 1, i) for i in range(m)] if overlap and j > 0 else []
            out.append((a + (j + 1) * m - 1, a, rows))
    return out
