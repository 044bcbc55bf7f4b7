"""Graded: cp_compress.py against references computed here, never from the submitted code: scalar
loops for the compressor's pooling, the visibility rule spelled out per (query, entry), and one
process's plain attention over the whole sequence (F.scaled_dot_product_attention, autograd) for
the protocol's entries, output and gradients. The submitted code runs in sandboxed workers
(tests/graded/probes/cp_compress.py) and sends back plain values.

Tolerances. The layer runs in fp32; the references here in float64 from its fp32 weights. fp32
keeps 24 bits (~6e-8 per op); we allow 1e-5 relative to the largest magnitude of the reference,
while every mistake of the catalogue is off by 1e-2 or more. Entry counts, visibility and every
boundary-value check are integers or copies and must match exactly.
"""

import pytest
import torch
from sandbox import StudentCodeError, call, on_ranks

from graded.expected import DRAW, case_seed, generator, hidden, stored
from graded.references_cp_compress import close, entry_windows, layouts, shard

H = hidden("cp_compress")  # the scalar pooling and the plain attention: only in the autograder zip

# The private suite runs these in its slow tier: CI grades the reference with every graded
# test (make grade-fit); test_sandbox.py and test_memory_timeline.py stay in its default tier.
pytestmark = pytest.mark.slow

S = 24  # tokens per rank: a multiple of m = 4 (CSA) and m' = 8 (HCA in tests)
M, M_HCA = 4, 8
WINDOW, TOP_K = 6, 10**3  # top_k above the entry count: every visible entry is attended
D = 8  # head_dim


# --------------------------------------------------------------------------------------------------
# Pure functions, one process
# --------------------------------------------------------------------------------------------------


@pytest.mark.grade(points=2, solution="cp_compress.halo_rows")
def test_halo_rows_counts_the_overlap():
    ms = (1, 4, 8, 128)
    got = call("cp_compress:halo_rows", [(m, o) for m in ms for o in (True, False)])
    for k, m in enumerate(ms):
        assert got[2 * k] == 2 * m - 1, (
            f"the halo must carry 2m-1 rows under CSA's overlap (the entry's own block may start "
            f"m-1 tokens back, and it also pools the whole block before): halo_rows({m}, "
            f"overlap=True) returned {got[2 * k]}, expected {2 * m - 1}"
        )
        assert got[2 * k + 1] == m - 1, (
            f"without overlap (HCA) the halo is m-1 rows (a block ending on a rank starts at most "
            f"m-1 tokens before it): halo_rows({m}, overlap=False) returned {got[2 * k + 1]}, "
            f"expected {m - 1}"
        )


def _rows_for_one_rank(cu, m, overlap, halo):
    """own/prev row indices into [halo rows | s rows] for one rank holding the whole sequence,
    built here from the definitions, and which entries start a document."""
    own, prev, first = [], [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for j in range((b - a) // m):
            start = halo + a + j * m
            own.append(list(range(start, start + m)))
            prev.append(list(range(start - m, start)) if j > 0 else [-1] * m)
            first.append(j == 0)
    own = torch.tensor(own, dtype=torch.long).reshape(-1, m)
    prev = torch.tensor(prev, dtype=torch.long).reshape(-1, m) if overlap else None
    return own, prev, first


@pytest.mark.grade(points=2, solution="cp_compress.compress_local")
@pytest.mark.parametrize("overlap", [True, False])
def test_compress_local_on_one_rank_matches_reference(overlap):
    g = torch.Generator().manual_seed(case_seed(1, "cp_compress"))  # moves at grading
    sets, m, s, C, halo = (2 if overlap else 1), 4, 24, 3, 5
    kv, score = torch.randn(s, sets, C, generator=g), torch.randn(s, sets, C, generator=g)
    ape = torch.randn(m, sets, C, generator=g)
    cu = torch.tensor([0, 3, 15, 16, 24])  # 3 entries, then 2; documents shorter than a block
    # halo rows of random values: an entry that starts its document must not read them
    ext_kv = torch.cat([torch.randn(halo, sets, C, generator=g), kv])
    ext_score = torch.cat([torch.randn(halo, sets, C, generator=g), score])
    own, prev, starts_doc = _rows_for_one_rank(cu, m, overlap, halo)
    n, slots = own.shape[0], s // m + 1
    buf = call("cp_compress:compress_local", ext_kv, ext_score, ape, own, prev, slots)
    assert tuple(buf.shape) == (slots, C), (
        f"compress_local must return [slots, C] = {(slots, C)}, got {tuple(buf.shape)}"
    )
    assert torch.isfinite(buf).all(), "compress_local returned NaN or inf"
    tail = buf[n:].abs().max().item()
    assert tail == 0, (
        f"the buffer holds the {n} valid entries first and zero rows after (padding at the tail): "
        f"rows {n}..{slots - 1} are not zero (max |row| = {tail:.3e})"
    )
    expected = stored(
        "cp_compress",
        f"compress_local, overlap {overlap}",
        lambda: H.naive_compress(kv, score, ape, cu, m, overlap)[:n],
    )
    scale = expected.abs().max().item()
    errors = (buf[:n].double() - expected).abs().amax(dim=1)
    bad = [e for e in range(n) if not errors[e] <= 1e-5 * scale]  # NaN is never close
    if overlap and bad and all(starts_doc[e] for e in bad):
        raise AssertionError(
            f"an entry that starts its document has no previous block (prev_rows == -1: padding, "
            f"logit -inf, value 0), so it pools only its own m rows: entries {bad} differ, max "
            f"|got - expected| = {errors.max():.3e} (tolerance {1e-5 * scale:.1e})"
        )
    assert not bad, (
        f"entry {bad[0]} differs from the per-channel softmax pooling of its window (own block "
        f"from set 0{', the block before from set 1' if overlap else ''}, softmax over the "
        f"window's rows): max |got - expected| = {errors[bad[0]]:.3e} (tolerance "
        f"{1e-5 * scale:.1e}), {len(bad)} of {n} entries off"
    )


@pytest.mark.grade(points=2, solution="cp_compress.select_and_pad")
def test_select_and_pad():
    cases = []
    for cp, slots, C, counts, total in (
        (3, 3, 1, [2, 0, 1], 6),
        (4, 5, 2, [4, 3, 5, 1], 16),
        (2, 4, 3, [0, 0], 6),
    ):
        gathered = torch.arange(1, cp * slots * C + 1, dtype=torch.float32).view(cp, slots, C)
        cases.append((gathered, counts, total))
    for (gathered, counts, total), out in zip(
        cases, call("cp_compress:select_and_pad", cases), strict=True
    ):
        slots, C = gathered.shape[1:]
        assert tuple(out.shape) == (total, C), (
            f"select_and_pad must return [total, C] = {(total, C)}, got {tuple(out.shape)}"
        )
        picked = [(r, j) for r, n in enumerate(counts) for j in range(n)]
        expected = torch.zeros(total, C)
        for i, (r, j) in enumerate(picked):
            expected[i] = gathered[r, j]
        if torch.equal(out, expected):
            continue
        n = len(picked)
        assert not torch.equal(out[total - n :], expected[:n]) or n == total, (
            f"padding rows belong at the tail: the {n} valid entries must be rows 0..{n - 1}, "
            f"zero rows after, but they sit at rows {total - n}..{total - 1} (counts {counts})"
        )
        last = [gathered[r, slots - n_r + j] for r, n_r in enumerate(counts) for j in range(n_r)]
        assert not (n and torch.equal(out[:n], torch.stack(last))), (
            f"rank r's valid entries are the FIRST counts[r] rows of its buffer, got the last ones "
            f"(counts {counts}, {slots} slots per rank)"
        )
        assert not torch.equal(out, gathered.flatten(0, 1)[:total]), (
            f"only rank r's first counts[r] rows are entries (the rest of its buffer is padding): "
            f"the buffers were kept whole, cut to total (counts {counts}, {slots} slots per rank)"
        )
        row = next(i for i in range(total) if not torch.equal(out[i], expected[i]))
        what = f"rank {picked[row][0]}'s buffer row {picked[row][1]}" if row < n else "a zero row"
        raise AssertionError(
            f"row {row} must be {what} (rank r's first counts[r] rows, in rank order, then zero "
            f"rows): expected {expected[row].tolist()}, got {out[row].tolist()} (counts {counts})"
        )


@pytest.mark.grade(points=2, solution="cp_compress.visibility")
def test_visibility_rule():
    cu, m = torch.tensor([0, 9, 16, 17, 30]), 4  # doc 0: ends 3, 7; doc 1: 12; doc 3: 20..28
    info = [(end, doc) for end, doc, _ in entry_windows(cu, m, False)] + [(30, -1)] * 2
    ends, starts = torch.tensor(info).T  # two padding entries: never visible
    pos = torch.arange(30)
    doc = torch.tensor([max(a for a in cu[:-1].tolist() if a <= t) for t in range(30)])
    got = call("cp_compress:visibility", pos, doc, ends, starts)
    assert tuple(got.shape) == (30, ends.numel()), (
        f"visibility must return [queries, entries] = {(30, ends.numel())}, got {tuple(got.shape)}"
    )
    assert got.dtype == torch.bool, (
        f"visibility must return a bool tensor (the layer masks with ~visible), got {got.dtype}"
    )
    for t in range(30):
        for e in range(ends.numel()):
            end, own = int(ends[e]), int(starts[e]) == int(doc[t])
            want = own and end <= t
            if bool(got[t, e]) == want:
                continue
            where = f"query {t} (document starting at {int(doc[t])}), entry {e} ending at {end}"
            if not own and int(starts[e]) < 0:
                raise AssertionError(f"padding entries must never be visible: {where} is visible")
            assert own, (
                f"a query sees only entries of its own document: {where} of the document "
                f"starting at {int(starts[e])} is visible"
            )
            assert not (want and end == t), (
                f"the last token of a block sees that block (end(e) <= t, the public V4 code's "
                f"rule; the paper's strict e < floor(t/m) is not this file's): {where} is not "
                f"visible"
            )
            assert want, (
                f"a block is visible only once complete (end(e) <= t): {where} is visible "
                f"{end - t} token(s) early"
            )
            raise AssertionError(
                f"a query sees every complete block of its own document: {where} is not visible"
            )


# --------------------------------------------------------------------------------------------------
# The protocol on 1-2 ranks against one process's plain attention
# --------------------------------------------------------------------------------------------------

PROTOCOL_NEEDS = (
    "cp_compress.halo_rows",
    "cp_compress.compress_local",
    "cp_compress.select_and_pad",
    "cp_compress.visibility",
    "cp_compress.exchange_halo",
)
_RUNS = {}


def layer_params(kind, m, g):
    """Every parameter of the probe's CompressedAttention (dim 16, 2 heads of 8; CSA: an indexer
    of 2 heads of 4), drawn here: the worker loads them, the reference reads the same. The sink
    is -inf (SDPA has none), the norms away from 1."""
    sets, index = (2, 4) if kind == "csa" else (1, 0)
    width = sets * (D + index)
    shapes = {"wq": (16, 16), "wkv_window": (16, D), "wkv_compress": (16, width),
              "wgate_compress": (16, width), "ape": (m, sets, D + index)}  # fmt: skip
    params = {n: torch.randn(shape, generator=g) * 0.25 for n, shape in shapes.items()}
    params["ape"] *= 0.4
    params["sink"] = torch.full((2,), float("-inf"))
    for name, size in (("norm_window", D), ("norm_compress", D)) + (
        (("wq_index", None), ("w_index", None), ("norm_index", index)) if index else ()
    ):
        if name == "wq_index":
            params[name] = torch.randn(16, 2 * index, generator=g) * 0.25
        elif name == "w_index":
            params[name] = torch.randn(16, 2, generator=g) * 0.25
        else:
            params[name] = torch.rand(size, generator=g) + 0.5
    return params


def layer_runs(world_size):
    """Every (kind, layout) run once per world size on the ranks, and its references here."""
    if world_size not in _RUNS:
        cases = []
        for kind, m in (("csa", M), ("hca", M_HCA)):
            for cu in layouts(world_size, S, m):
                # DRAW moves the inputs at grading time; each rank is handed only its shard,
                # drawn from a generator of its own (what every rank gets, from another)
                g = torch.Generator().manual_seed(case_seed(int(cu.sum()), "cp_compress", kind))
                own = [generator("cp_compress", kind, cu.tolist(), r) for r in range(world_size)]
                x = torch.cat([torch.randn(S, 16, generator=o) for o in own])
                grad_out = torch.cat([torch.randn(S, 2, D, generator=o) for o in own])
                cases.append((kind, m, cu, x, grad_out, layer_params(kind, m, g)))
        shared = [(kind, m, cu, params) for kind, m, cu, _, _, params in cases]

        def rank_rows(r):  # rank r's rows of x and grad_out, case by case
            return [(shard(x, world_size, r), shard(dy, world_size, r)) for *_, x, dy, _ in cases]

        own = [{"shards": rank_rows(r)} for r in range(world_size)]
        runs = on_ranks("cp_compress:layer_runs", world_size, shared, WINDOW, TOP_K,
                        per_rank=own, timeout=120)  # fmt: skip
        _RUNS[world_size] = cases, runs
    return _RUNS[world_size]


def check_protocol(got, expected, info, cu, m, overlap, rank, world_size):
    """The protocol's counts, entries, padding and visibility on one rank against the
    definitions; raises with the first mistake, named."""
    T = world_size * S
    s, h, n = S, 2 * m - 1 if overlap else m - 1, len(info)
    wrong = [rows for rows in got["halos"] if rows != h]
    rule = "2m-1 rows under CSA's overlap" if overlap else "m-1 rows without overlap (HCA)"
    raised = f" ({got['error']})" if "error" in got else ""
    assert not wrong, (
        f"the halo must carry {rule}: the protocol shipped {wrong[0]} rows for m={m}, expected "
        f"{h}{raised}"
    )
    assert not raised, f"context_parallel_compress raised {got['error']} (rank {rank})"
    counts = [sum(1 for end, _ in info if end // s == r) for r in range(world_size)]
    assert got["counts"] == counts, (
        f"counts must be the entries whose block ENDS on each rank (they follow where documents "
        f"start, not s/m): got {got['counts']}, expected {counts} for cu_seqlens {cu.tolist()}"
    )
    entries = got["entries"]
    assert tuple(entries.shape) == tuple(expected.shape), (
        f"the shard's entries must be the whole sequence's cp*s/m = {T // m} rows, padding at the "
        f"tail: got shape {tuple(entries.shape)}, expected {tuple(expected.shape)}"
    )
    scale = expected.abs().max().item()
    errors = (entries.double() - expected).abs().amax(dim=1)
    bad = [e for e in range(T // m) if not errors[e] <= 1e-5 * scale]  # NaN is never close
    if bad:
        assert bad[0] < n, (
            f"padding entries (after the {n} valid ones) must be zero rows at the tail: row "
            f"{bad[0]} holds max |x| = {entries[bad[0]].abs().max():.3e}"
        )
        end, doc = info[bad[0]]
        first_row = end - m + 1 - (m if overlap and end - 2 * m + 1 >= doc else 0)
        owner = end // s
        assert first_row >= owner * s, (
            f"entries whose pooling window starts on the previous rank differ: the halo must "
            f"bring rank {owner - 1}'s last {h} raw rows (kv and gate); entry {bad[0]} pools "
            f"global rows {first_row}..{end} and is owned by rank {owner}: max |cp - ref| = "
            f"{errors[bad[0]]:.3e} (tolerance {1e-5 * scale:.1e})"
        )
        raise AssertionError(
            f"entry {bad[0]} (block ending at global position {end}, owned by rank {owner}) "
            f"differs from the single-device compressed sequence: max |cp - ref| = "
            f"{errors[bad[0]]:.3e} (tolerance {1e-5 * scale:.1e}), {len(bad)} entries off"
        )
    padded = info + [(T, -1)] * (T // m - n)
    docs = cu[:-1].tolist()

    def rule(positions):  # [len, T/m]: same document and the block complete, from the definition
        doc_of = {t: max(a for a in docs if a <= t) for t in positions}
        rows = [[d == doc_of[t] and end <= t for end, d in padded] for t in positions]
        return torch.tensor(rows, dtype=torch.bool).reshape(len(positions), T // m)

    want, visible = rule(range(rank * s, rank * s + s)), got["visible"]
    assert tuple(visible.shape) == (s, T // m) and visible.dtype == torch.bool, (
        f"visible must be a bool [s, cp*s/m] = {(s, T // m)} tensor, got {visible.dtype} "
        f"{tuple(visible.shape)}"
    )
    if not torch.equal(visible, want):
        t, e = (visible != want).nonzero()[0].tolist()
        where = f"local query {t} (global {rank * s + t}), entry {e} ending at {padded[e][0]}"
        assert not (e >= n and visible[t, e]), f"padding entries must never be visible: {where}"
        assert not (rank > 0 and torch.equal(visible, rule(range(s)))), (
            f"visibility must use global positions (query i of rank r is token r*s + i): {where} "
            f"is {'visible' if visible[t, e] else 'not visible'}"
        )
        raise AssertionError(
            f"visibility: {where} must be {'visible' if want[t, e] else 'not visible'} (same "
            f"document and end(e) <= t), got the opposite"
        )


USED = ("wq", "wkv_window", "norm_window", "wkv_compress", "wgate_compress", "ape", "norm_compress")


def check_layer(world_size, gradients):
    """Each rank's protocol, output and (gradients=True) d input and d parameters against one
    process's plain attention in float64 with autograd."""
    cases, runs = layer_runs(world_size)
    assert len(runs) == world_size, f"{len(runs)} ranks answered, {world_size} ran"
    for k, (kind, m, cu, x, grad_out, drawn) in enumerate(cases):
        overlap = kind == "csa"
        for rank, r in enumerate(runs):  # a rank that raised on this case: its halo, then why
            if len(r) == k + 1 and "error" in r[k]:
                check_protocol(r[k], None, [], cu, m, overlap, rank, world_size)
            assert len(r) == len(cases), f"rank {rank} returned {len(r)} of {len(cases)} cases"
        out, entries, grad_x, grads = stored(
            "cp_compress",
            f"layer {kind} W={world_size} cu={cu.tolist()}",
            lambda: H.layer_reference(drawn, x, cu, m, overlap, grad_out),
        )
        info = [(end, doc) for end, doc, _ in entry_windows(cu, m, overlap)]
        where = f"{kind} W={world_size} cu={cu.tolist()}"
        for rank, run in enumerate(r[k] for r in runs):
            at = f"{where} rank={rank}"
            check_protocol(run, entries, info, cu, m, overlap, rank, world_size)
            close(run["out"], shard(out, world_size, rank), f"output vs SDPA ({at})")
            if gradients:
                flow = "gradients must flow back through the halo and the all-gather to every rank"
                close(run["grad_x"], shard(grad_x, world_size, rank), f"{flow}: d input ({at})")
        if gradients:
            for name, ref in zip(USED, grads, strict=True):
                mine = [r[k]["grads"].get(name) for r in runs]
                assert all(g is not None for g in mine), f"{name} got no gradient ({where})"
                close(sum(mine), ref, f"{flow}: d {name}, summed over ranks ({where})")


@pytest.mark.grade(points=1, solution="cp_compress.context_parallel_compress", needs=PROTOCOL_NEEDS)
@pytest.mark.parametrize(
    "world_size",
    [
        1,
        2,
        pytest.param(3, marks=pytest.mark.ungraded),
        pytest.param(4, marks=pytest.mark.ungraded),
    ],
)
def test_cp_gradients_equal_plain_attention(world_size):
    """d input on each rank and d parameters summed over ranks equal autograd of one process's
    plain attention: they flow back through the halo and the all-gather."""
    check_layer(world_size, gradients=True)


@pytest.mark.grade(points=2, solution="cp_compress.context_parallel_compress", needs=PROTOCOL_NEEDS)
@pytest.mark.parametrize(
    "world_size",
    [
        pytest.param(1, marks=pytest.mark.slow),
        2,
        pytest.param(3, marks=pytest.mark.ungraded),
        pytest.param(4, marks=(pytest.mark.ungraded, pytest.mark.slow)),
    ],
)
def test_cp_matches_plain_sdpa_attention(world_size):
    check_layer(world_size, gradients=False)


# --------------------------------------------------------------------------------------------------
# The halo exchange, by values that say where they came from
# --------------------------------------------------------------------------------------------------


def boundary_tags(cp):
    """Each group rank's numbers for boundary_values: {"value", "weight", "fill", "mult"} -> a
    list by group rank. The kit's are the group ranks themselves; at grading time they are drawn
    (distinct values 1-99, so a halo's rows name the rank they came from)."""
    if DRAW == 0:
        return {"value": list(range(cp)), "weight": list(range(cp)), "fill": list(range(cp)),
                "mult": [g + 1 for g in range(cp)]}  # fmt: skip
    g = torch.Generator().manual_seed(case_seed(11, "cp_compress"))
    draw = [(torch.randperm(99, generator=g)[:cp] + 1).tolist() for _ in range(4)]
    return dict(zip(("value", "weight", "fill", "mult"), draw, strict=True))


def check_boundaries(results, s, m, tags):
    """Raw values tag*10000 + local position: what crossed each boundary, both ways."""
    results = [r for r in results if r is not None]
    cp = len(results)
    assert sorted(r["rank"] for r in results) == list(range(cp)), "each group rank answers once"
    owner = {t: g for g, t in enumerate(tags["value"])}  # a row's tag -> its group rank

    def expect(p):
        return tags["value"][p // s] * 10000 + p % s  # the value of global position p

    final = next(r for r in results if r["rank"] == cp - 1)
    for res in results:
        rank = res["rank"]
        for k, (overlap, got) in enumerate(zip((True, False), res["by_overlap"], strict=True)):
            h = 2 * m - 1 if overlap else m - 1
            halo = [int(v) for v in got["halo"]]
            # at 2 ranks a ring also hands rank 0 rank 1's rows; then the last rank's halo is right
            last_ok = cp > 1 and [int(v) for v in final["by_overlap"][k]["halo"]] == [
                expect(p) for p in range((cp - 1) * s - h, (cp - 1) * s)
            ]
            came_from_next = any(halo) and owner.get(halo[0] // 10000) == rank + 1
            assert not (came_from_next and not (rank == 0 and last_ok)), (
                f"the halo comes from the PREVIOUS rank (exchange_halo sends to rank + 1 and "
                f"receives from rank - 1): rank {rank} received rows of rank {rank + 1}"
            )
            if rank == 0:
                assert not any(halo), (
                    f"rank 0 has no previous rank: its halo must be zeros (the line does not wrap "
                    f"around like a ring), got values of rank {owner.get(max(halo) // 10000)}"
                )
            else:
                want = [expect(p) for p in range(rank * s - h, rank * s)]
                assert halo == want, (
                    f"rank {rank}'s halo must be rank {rank - 1}'s last {h} rows (values "
                    f"{want[0]}..{want[-1]}), got {halo[:2]}..{halo[-2:]} (group ranks, not "
                    f"global ranks, number the line: address peers by dist.get_global_rank)"
                )
            grad = [int(v) for v in got["grad"]]
            last = rank + 1 == cp
            after = [tags["weight"][rank + 1] * 100 + i for i in range(h)] if not last else []
            want = [0] * s if last else [0] * (s - h) + after
            assert grad == want, (
                f"to_next=False is the backward pass: rank {rank + 1} sends the halo's gradient "
                f"back to rank {rank}, onto its last {h} rows"
                f"{' (the last rank: none)' if last else ''}: rank {rank}'s gradient rows "
                f"{s - h}.. are {grad[s - h : s - h + 3]}..., expected {want[s - h : s - h + 3]}..."
            )
            cu = sorted({0, cp * s} | {b - (2 * m - 1) for b in range(s, cp * s, s)})
            ends = [a + (j + 1) * m - 1 for a, b in zip(cu, cu[1:]) for j in range((b - a) // m)]
            mine = [end for end in ends if rank * s <= end < rank * s + s]
            assert [e["end"] for e in got["sources"]] == mine, (
                f"rank {rank}: entries ending at {[e['end'] for e in got['sources']]}, expected "
                f"{mine}"
            )
            for e in got["sources"]:
                end = e["end"]
                assert e["own"] == [expect(p) for p in range(end - m + 1, end + 1)], (
                    f"rank {rank}: the entry ending at {end} must pool rows {end - m + 1}..{end}, "
                    f"got values {e['own']}"
                )
                if e["prev"] is not None:
                    assert e["prev"] == [expect(p) for p in range(end - 2 * m + 1, end - m + 1)], (
                        f"rank {rank}: the entry ending at {end} must pool the block before, "
                        f"rows {end - 2 * m + 1}..{end - m}, got values {e['prev']}"
                    )
        gathered = res["gathered"]
        assert gathered[:, 0, 0].tolist() == tags["fill"], (
            f"all_gather_entries must stack the ranks' buffers in rank order: got "
            f"{gathered[:, 0, 0].tolist()}"
        )
        total = sum(tags["mult"])
        assert torch.equal(res["gather_grad"], torch.full((3, 2), total)), (
            f"all_gather_entries' backward sums every rank's gradient for a buffer: expected "
            f"{total}, got {res['gather_grad'].flatten()[:2].tolist()}"
        )


@pytest.mark.grade(points=3, solution="cp_compress.exchange_halo", needs=("cp_compress.halo_rows",))
@pytest.mark.parametrize(
    "world_size,members",
    [
        (2, None),
        pytest.param(4, None, marks=pytest.mark.ungraded),
        (3, [1, 2]),  # a CP subgroup: its group ranks differ from the global ranks
    ],
)
def test_boundary_values_show_exactly_what_crossed(world_size, members):
    s, m = 16, 4
    group = members or list(range(world_size))
    tags = boundary_tags(len(group))
    own = [{"tags": {k: v[group.index(r)] for k, v in tags.items()} if r in group else None}
           for r in range(world_size)]  # fmt: skip
    if members is None:
        results = on_ranks("cp_compress:boundary_values", world_size, s, m, members,
                           per_rank=own, timeout=60)  # fmt: skip
    else:
        try:
            results = on_ranks("cp_compress:boundary_values", world_size, s, m, members,
                               per_rank=own, timeout=60)  # fmt: skip
        except StudentCodeError as e:
            if e.kind == "budget":  # the file's time ran out: no verdict on the code
                raise
            why = str(e).splitlines()[0] if str(e) else e.kind
            raise AssertionError(
                f"exchange_halo on a CP group {members} of a {world_size}-rank world failed "
                f"({why}): peers must be addressed by global rank (dist.get_global_rank(group, r))"
                f"\n{e}"
            ) from None
    check_boundaries(results, s, m, tags)
    # the second rank's first entry (ends at 16): 7 rows from the first (9..15), its own row 0
    second = next(r for r in results if r is not None and r["rank"] == 1)
    first = second["by_overlap"][0]["sources"][0]
    want = [tags["value"][0] * 10000 + p for p in range(9, 16)] + [tags["value"][1] * 10000]
    assert first["prev"] + first["own"] == want, (
        f"group rank 1's first entry (ending at 16) pools rows 9..15 of rank 0 and its own row 0: "
        f"values {want}, got {first['prev'] + first['own']}"
    )
