"""cp_compress.py: the two-stage CP protocol equals single-device compressed attention.

Tolerances. Everything runs in fp32. CP and the reference compute the same sums in a different
order (gathered vs. dense-masked softmax, a rank's buffer vs. a per-document view, or any order a
student's own pooling picks), so values agree to a few ulps (fp32 keeps 24 bits, ~6e-8): we allow
1e-5 relative to the largest magnitude of the reference, over 100x that, while every mistake the
catalogue (tests/mistakes/cp_compress.py) holds is off by 1e-2 or more. Top-k indices, entry counts,
visibility and every boundary-value check are integers or copies and must match exactly; the test
inputs keep the k-th and (k+1)-th indexer scores at least 2e-5 apart (relative), so no fp32 op
order can swap a selection.

The graded tests are in tests/graded/test_cp_compress.py (the submitted code in a sandbox, the
references in the grading process). These name the quantity, expected vs got and how far, in their
first line; a multi-rank test raises the failing rank's message first (`ranks` below).
"""

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from graded.hidden.references_cp_compress import naive_compress
from graded.references_cp_compress import close, layouts

import cp_compress as cpc
from benchmarks.bench_cp_compress import allgather_baseline
from tools.spawn import RankFailure, run_ranks

S = 24  # tokens per rank: a multiple of m = 4 (CSA) and m' = 8 (HCA in tests)
M, M_HCA = 4, 8
WINDOW, TOP_K = 6, 5


def make_layer(kind):
    torch.manual_seed(1234)
    if kind == "csa":
        return cpc.CompressedAttention(
            "csa",
            dim=16,
            heads=2,
            head_dim=8,
            ratio=M,
            window=WINDOW,
            top_k=TOP_K,
            index_heads=2,
            index_dim=4,
        )
    return cpc.CompressedAttention("hca", dim=16, heads=2, head_dim=8, ratio=M_HCA, window=WINDOW)


def first_line(traceback_text):
    """The last exception's first line of a formatted traceback."""
    lines = traceback_text.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    tail = lines[starts[-1] + 1 :] if starts else lines
    return next((x for x in tail if x and not x[0].isspace()), lines[-1] if lines else "")


def ranks(fn, world_size, args=(), timeout=120):
    """run_ranks, but a failing rank's own message is the failure's first line."""
    try:
        return run_ranks(fn, world_size, args=args, timeout=timeout)
    except RankFailure as failure:  # the rank that failed first, not a peer it left waiting
        own = [(r, t) for r, t in failure.errors.items() if "AssertionError" in first_line(t)]
        rank, text = (own or list(failure.errors.items()))[0]
        raise AssertionError(
            f"{first_line(text).removeprefix('AssertionError: ')} (rank {rank} of {world_size})"
            f"\n{failure}"
        ) from None


# --------------------------------------------------------------------------------------------------
# Pure functions, one process
# --------------------------------------------------------------------------------------------------


def test_compressed_entry_ends_per_document():
    # documents [0,6) [6,7) [7,20): 1 entry, none (shorter than a block), 3 entries
    ends, starts = cpc.compressed_entry_ends(torch.tensor([0, 6, 7, 20]), 4)
    assert ends.tolist() == [3, 10, 14, 18]
    assert starts.tolist() == [0, 7, 7, 7]


def test_entries_per_rank():
    assert cpc.entries_per_rank(torch.tensor([3, 10, 14, 18]), 8, 3).tolist() == [1, 2, 1]


def test_local_entry_rows_worst_case():
    # s = 8, m = 4, rank 1 starts at 8; a document starts at 1 = 8 - (2m-1): its entry 1 ends at 8
    cu = torch.tensor([0, 1, 16])
    ends, starts = cpc.compressed_entry_ends(cu, 4)
    assert ends.tolist() == [4, 8, 12]
    own, prev = cpc.local_entry_rows(ends, starts, 1, 8, 4, overlap=True)
    offset = 8 - 7  # ext row = global position - offset
    assert (own + offset).tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert (prev + offset).tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert prev.min() == 0  # the halo is used to its first row
    own0, prev0 = cpc.local_entry_rows(ends, starts, 0, 8, 4, overlap=True)
    assert (own0 - 7).tolist() == [[1, 2, 3, 4]] and prev0.tolist() == [
        [-1] * 4
    ]  # first entry: padded
    own_h, prev_h = cpc.local_entry_rows(ends, starts, 1, 8, 4, overlap=False)
    assert prev_h is None and (own_h + 8 - 3).tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]


@pytest.mark.parametrize("overlap", [True, False])
def test_compress_reference_matches_scalar_loops(overlap):
    g = torch.Generator().manual_seed(0)
    sets = 2 if overlap else 1
    kv, score = torch.randn(24, sets, 3, generator=g), torch.randn(24, sets, 3, generator=g)
    ape = torch.randn(4, sets, 3, generator=g)
    cu = torch.tensor([0, 3, 13, 14, 24])
    got = cpc.compress_reference(kv, score, ape, cu, 4, overlap)
    assert got.shape == (6, 3)
    assert got[4:].abs().max() == 0  # 4 valid entries, zero padding at the tail
    close(got, naive_compress(kv, score, ape, cu, 4, overlap), "compress_reference")


def test_index_scores_and_top_k():
    g = torch.Generator().manual_seed(2)
    q, w, k = (
        torch.randn(5, 3, 4, generator=g),
        torch.randn(5, 3, generator=g),
        torch.randn(6, 4, generator=g),
    )
    naive = torch.tensor(
        [
            [
                sum(float(w[t, h]) * max(0.0, float(q[t, h] @ k[e]) / 2) for h in range(3))
                for e in range(6)
            ]
            for t in range(5)
        ]
    )
    scores = cpc.index_scores(q, w, k)
    close(scores, naive, "index_scores")
    scores[0] = torch.tensor([5.0, 1.0, 4.0, 1.0, 0.0, 1.0])  # a three-way tie for 3rd place
    visible = torch.tensor(
        [
            [True] * 6,
            [True, True, False, False, False, False],
            [False] * 6,
            [True] * 6,
            [False, False, False, False, False, True],
        ]
    )
    chosen = cpc.top_k_visible(scores, visible, 3)
    for t in range(5):
        vis_idx = visible[t].nonzero().flatten()
        best = sorted(
            sorted(vis_idx.tolist(), key=lambda e: (-scores[t, e].item(), e))[:3]
        )  # ties: earlier
        assert chosen[t].tolist() == [-1] * (3 - len(best)) + best
    assert chosen[0].tolist() == [0, 1, 2]  # ties go to the earlier entry
    mask = cpc.chosen_mask(chosen, 6)
    assert mask.sum(1).tolist() == [3, 2, 0, 3, 1] and bool((mask <= visible).all())


def test_attention_matches_sdpa_and_sink_only_rescales():
    g = torch.Generator().manual_seed(3)
    T, N, H, D = 7, 5, 2, 8
    q, ent, raw = (
        torch.randn(T, H, D, generator=g),
        torch.randn(N, D, generator=g),
        torch.randn(T, D, generator=g),
    )
    ent_ok = torch.rand(T, N, generator=g) > 0.5
    raw_ok = torch.ones(T, T, dtype=torch.bool).tril()
    keys, allowed = torch.cat([ent, raw]), torch.cat([ent_ok, raw_ok], 1)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.expand(H, -1, -1), keys.expand(H, -1, -1), attn_mask=allowed
    ).transpose(0, 1)
    no_sink = torch.full((H,), float("-inf"))
    close(
        cpc.attention_reference(q, ent, raw, ent_ok, raw_ok, no_sink),
        sdpa,
        "attention_reference vs SDPA",
    )
    sink = torch.tensor([0.5, -1.0])
    # a sink adds exp(sink) to the denominator only: out = sdpa * Z / (Z + exp(sink))
    logits = (
        torch.einsum("thd,nd->htn", q, keys).div(math.sqrt(D)).masked_fill(~allowed, float("-inf"))
    )
    lse = logits.logsumexp(-1).T  # [T, H]
    shrink = torch.sigmoid(lse - sink)[..., None]  # Z / (Z + e^sink)
    close(cpc.attention_reference(q, ent, raw, ent_ok, raw_ok, sink), sdpa * shrink, "sink")
    gathered = cpc.attention_gathered(q, keys.expand(T, -1, -1), allowed, sink)
    close(gathered, sdpa * shrink, "attention_gathered")


def test_shard_sequence():
    x = torch.arange(12)
    assert cpc.shard_sequence(x, 3, 1).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="must be divisible by cp_size=5"):
        cpc.shard_sequence(x, 5, 0)


def test_validate_packing_refuses_bad_input():
    cu = torch.tensor([0, 10, 32])
    cpc.check_packing(16, cu, 2, 4, True, 8, 6)  # fine
    with pytest.raises(
        ValueError, match="must be a positive multiple of the compression ratio m=4"
    ):
        cpc.check_packing(18, torch.tensor([0, 36]), 2, 4, True, 8, 6)
    with pytest.raises(ValueError, match="halo"):
        cpc.check_packing(4, torch.tensor([0, 8]), 2, 4, True, 1, 2)  # 2m-1 = 7 rows > s = 4
    with pytest.raises(ValueError, match=r"must sum to cp_size\*s = 2\*16 = 32 tokens, got 30"):
        cpc.check_packing(16, torch.tensor([0, 10, 30]), 2, 4, True, 8, 6)
    with pytest.raises(ValueError, match="strictly increase"):
        cpc.check_packing(16, torch.tensor([0, 10, 10, 32]), 2, 4, True, 8, 6)
    cpc.check_packing(16, cu, 2, 4, True, 512, 6)  # top_k > T/m: allowed, padded with -1
    with pytest.raises(ValueError, match="window must be >= 1"):
        cpc.check_packing(16, cu, 2, 4, True, 8, 0)
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D integer tensor"):
        cpc.check_packing(16, cu[None], 2, 4, True, 8, 6)
    with pytest.raises(ValueError, match="sliding window"):
        cpc.check_packing(16, cu, 2, 4, True, 8, 20)


# --------------------------------------------------------------------------------------------------
# Multi-rank: the protocol against the single-device reference, forward and backward
# --------------------------------------------------------------------------------------------------


def check_halo_size(shipped, h, m, overlap, err=None):
    """Name a halo of the wrong size, from the row counts asked of halo_from_previous."""
    wrong = [rows for rows in shipped if rows != h]
    rule = "2m-1 rows under CSA's overlap" if overlap else "m-1 rows without overlap (HCA)"
    assert not wrong, (
        f"the halo must carry {rule}: the protocol shipped {wrong[0]} rows for m={m}, expected {h}"
        + (f" ({type(err).__name__}: {err})" if err else "")
    )


def check_protocol(layer, x, cu, rank, world_size):
    """context_parallel_compress on its own, against what is computed here from the definitions:
    the counts per rank, every entry (the whole sequence compressed on one device), the padding,
    and which entries each local query sees. Raises with the first mistake, named."""
    T, m, overlap = x.shape[0], layer.ratio, layer.overlap
    s, h = T // world_size, 2 * m - 1 if overlap else m - 1
    shipped, real = [], cpc.halo_from_previous

    def recording(t, rows, group=None):
        shipped.append(rows)
        return real(t, rows, group)

    cpc.halo_from_previous = recording  # only read to name a mistake once a check has failed
    try:
        with torch.no_grad():
            proj = layer.project(cpc.shard_sequence(x, world_size, rank))
            args = (layer.ape, layer.normalise, cu, m, overlap)
            try:
                shard = cpc.context_parallel_compress(proj.kv, proj.gate, *args)
            except Exception as err:  # rows indexed past a halo of the wrong size, say
                check_halo_size(shipped, h, m, overlap, err)
                raise
            full = layer.project(x)
            expected = layer.normalise(
                cpc.compress_reference(full.kv, full.gate, *args[:1], cu, m, overlap)
            )
    finally:
        cpc.halo_from_previous = real
    docs = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    entries = [(a + (j + 1) * m - 1, a, j > 0) for a, b in docs for j in range((b - a) // m)]
    n = len(entries)
    counts = [sum(1 for end, _, _ in entries if end // s == r) for r in range(world_size)]
    got_counts = [int(c) for c in shard.counts]
    assert got_counts == counts, (
        f"counts must be the entries whose block ENDS on each rank (they follow where documents "
        f"start, not s/m): got {got_counts}, expected {counts} for cu_seqlens {cu.tolist()}"
    )
    assert tuple(shard.entries.shape) == tuple(expected.shape), (
        f"the shard's entries must be the whole sequence's cp*s/m = {T // m} rows, padding at the "
        f"tail: got shape {tuple(shard.entries.shape)}, expected {tuple(expected.shape)}"
    )
    scale = expected.abs().max().item()
    errors = (shard.entries - expected).abs().amax(dim=1)
    bad = [e for e in range(T // m) if errors[e] > 1e-5 * scale]
    if bad:
        check_halo_size(shipped, h, m, overlap)
        assert bad[0] < n, (
            f"padding entries (after the {n} valid ones) must be zero rows at the tail: row "
            f"{bad[0]} holds max |x| = {shard.entries[bad[0]].abs().max():.3e}"
        )
        end, doc, has_prev = entries[bad[0]]
        first_row = end - m + 1 - (m if overlap and has_prev else 0)
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
    padded = entries + [(T, -1, False)] * (T // m - n)

    def rule(positions):  # [len, T/m]: same document and the block complete, from the definition
        doc_of = {t: max(a for a, _ in docs if a <= t) for t in positions}
        rows = [[d == doc_of[t] and end <= t for end, d, _ in padded] for t in positions]
        return torch.tensor(rows, dtype=torch.bool).reshape(len(positions), T // m)

    want, got = rule(range(rank * s, rank * s + s)), shard.visible
    assert tuple(got.shape) == (s, T // m) and got.dtype == torch.bool, (
        f"visible must be a bool [s, cp*s/m] = {(s, T // m)} tensor, got {got.dtype} "
        f"{tuple(got.shape)}"
    )
    if not torch.equal(got, want):
        t, e = (got != want).nonzero()[0].tolist()
        where = f"local query {t} (global {rank * s + t}), entry {e} ending at {padded[e][0]}"
        assert not (e >= n and got[t, e]), f"padding entries must never be visible: {where}"
        assert not (rank > 0 and torch.equal(got, rule(range(s)))), (
            f"visibility must use global positions (query i of rank r is token r*s + i): {where} "
            f"is {'visible' if got[t, e] else 'not visible'}"
        )
        raise AssertionError(
            f"visibility: {where} must be {'visible' if want[t, e] else 'not visible'} (same "
            f"document and end(e) <= t), got the opposite"
        )


def _equivalence(rank, world_size):
    """For CSA and HCA and every layout: the protocol's own output, then the layer's entries,
    top-k, scores, output and all gradients against the single-device reference."""
    checked = []
    for kind, ratio in (("csa", M), ("hca", M_HCA)):
        layer = make_layer(kind)
        for cu in layouts(world_size, S, ratio):
            T = world_size * S
            g = torch.Generator().manual_seed(int(cu.sum()))  # same inputs on every rank
            x = torch.randn(T, 16, generator=g)
            grad_out = torch.randn(T, layer.heads, layer.head_dim, generator=g)
            grad_scores = torch.randn(T, T // ratio, generator=g)
            check_protocol(layer, x, cu, rank, world_size)

            x_ref = x.clone().requires_grad_()
            out_ref, ex_ref = layer.reference(x_ref, cu)
            cpc.probe_loss(out_ref, ex_ref, grad_out, grad_scores).backward()
            ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
            layer.zero_grad()

            def mine(t):
                return cpc.shard_sequence(t, world_size, rank)

            x_cp = mine(x).clone().requires_grad_()
            out_cp, ex = layer.context_parallel(x_cp, cu)
            cpc.probe_loss(out_cp, ex, mine(grad_out), mine(grad_scores)).backward()
            where = f"{kind} W={world_size} rank={rank} cu={cu.tolist()}"

            close(ex.entries, ex_ref.entries, f"the layer's entries ({where})")
            close(out_cp, mine(out_ref), f"the layer's output ({where})")
            if kind == "csa":
                finite = ex.scores.isfinite()
                assert torch.equal(finite, mine(ex_ref.scores).isfinite()), (
                    f"the indexer's visible set differs from the reference ({where})"
                )
                assert torch.equal(ex.top_k, mine(ex_ref.top_k)), f"top-k differs ({where})"
                close(ex.scores[finite], mine(ex_ref.scores)[finite], f"index scores ({where})")
            flow = "gradients must flow back through the halo and the all-gather to every rank"
            close(x_cp.grad, mine(x_ref.grad), f"{flow}: d input ({where})")
            for name, p in layer.named_parameters():
                dist.all_reduce(p.grad)  # each rank holds its queries' share
                assert ref_grads[name].abs().max() > 0, f"{name} got no gradient in the reference"
                close(p.grad, ref_grads[name], f"{flow}: d {name} ({where})")
            layer.zero_grad()

            # the simple baseline (all-gather raw rows) computes the same thing
            out_base, _ = allgather_baseline(layer, mine(x), cu)
            close(out_base, mine(out_ref.detach()), f"baseline output {where}")
            checked.append((kind, len(cu) - 1))
    return checked


@pytest.mark.parametrize(
    "world_size",
    [pytest.param(1, marks=pytest.mark.slow), 2, 3, pytest.param(4, marks=pytest.mark.slow)],
)
def test_cp_equals_single_device_reference(world_size):
    results = ranks(_equivalence, world_size, timeout=120)
    assert all(len(r) == 10 for r in results)  # 2 layer kinds x 5 layouts on every rank


def _bad_inputs(rank, world_size):
    """Each case must raise the same ValueError on every rank, and leave no rank waiting."""
    layer = make_layer("csa")
    s = S
    T = world_size * s
    x = torch.randn(s, 16)
    cases = {
        "mismatched shards": (torch.randn(s + (4 if rank == 1 else 0), 16), torch.tensor([0, T])),
        "s not a multiple of m": (torch.randn(s - 2, 16), torch.tensor([0, world_size * (s - 2)])),
        "lengths do not sum": (x, torch.tensor([0, 5, T - 1])),
    }
    messages = {}
    for case, (x_in, cu) in cases.items():
        try:
            layer.context_parallel(x_in, cu)
            messages[case] = None
        except ValueError as err:
            messages[case] = str(err)
    alive = torch.ones(1)
    dist.all_reduce(alive)  # every rank got here: nobody is stuck in a collective
    assert alive.item() == world_size
    return messages


def test_bad_input_raises_on_every_rank():
    results = run_ranks(_bad_inputs, 3, timeout=60)
    for msgs in results:
        assert "tokens per rank differs across ranks" in msgs["mismatched shards"]
        assert (
            "must be a positive multiple of the compression ratio m=4"
            in msgs["s not a multiple of m"]
        )
        assert "document lengths must sum to" in msgs["lengths do not sum"]


# --------------------------------------------------------------------------------------------------
# Agreement guard and validation (issue 9 items 11-15) and the fault matrix
# --------------------------------------------------------------------------------------------------

GUARD_S = 16  # tokens per rank in the guard tests: a multiple of m = 4, >= 2m and >= window - 1


def _guard_inputs(rank, world_size, case):
    """(layer, x, cu_seqlens) for one rank; the last rank gets the odd input of `case`."""
    T = world_size * GUARD_S
    odd = rank == world_size - 1
    dim = 20 if case == "feature dim" and odd else 16
    torch.manual_seed(1234)
    layer = cpc.CompressedAttention(
        "csa",
        dim=dim,
        heads=2,
        head_dim=8,
        ratio=M,
        window=WINDOW,
        top_k=TOP_K,
        index_heads=2,
        index_dim=4,
    )
    x = torch.randn(T, dim, generator=torch.Generator().manual_seed(5))[rank::world_size][:GUARD_S]
    cu = torch.tensor([0, 4, 9, 12, T])
    if odd and case == "cu_seqlens":
        cu = torch.tensor([0, 5, 7, 13, T])  # the same length, total and weighted sum as above
    if odd and case == "x features":
        x = torch.randn(GUARD_S, 20)
    if odd and case == "dtype":
        layer, x = layer.double(), x.double()
    if odd and case == "tokens per rank":
        x = torch.randn(GUARD_S + M, 16)
    if odd and case == "window":
        layer.window = WINDOW + 2
    if odd and case == "top_k":
        layer.top_k = TOP_K + 1
    if odd and case == "init":
        with torch.no_grad():
            layer.wkv_compress[0, 0] += 1e-3
    if case == "window=0":
        layer.window = 0
    if odd and case == "x not a tensor":
        x = x.tolist()
    if case == "2-D cu_seqlens" or (case == "2-D cu_seqlens on one rank" and odd):
        cu = cu[None]
    return layer, x, cu


GUARD_CASES = {  # case -> what every rank's error must say
    "cu_seqlens": "cu_seqlens differs across ranks",
    "feature dim": "dim differs across ranks",
    "x features": "features",
    "dtype": "dtype differs across ranks",
    "tokens per rank": "tokens per rank differs across ranks",
    "window": "window differs across ranks",
    "top_k": "top_k differs across ranks",
    "init": "wkv_compress differs across ranks",
    "window=0": "window must be >= 1",
    "2-D cu_seqlens": "cu_seqlens must be a 1-D integer tensor",
    "2-D cu_seqlens on one rank": "cu_seqlens",
    "x not a tensor": "x must be [tokens, features]",
    "entry point": "entry point differs across ranks",
}


def _guard_all_cases(rank, world_size):
    """Every case in turn: each must raise a ValueError on every rank and leave no rank behind."""
    messages = {}
    for case in GUARD_CASES:
        layer, x, cu = _guard_inputs(rank, world_size, case)
        try:
            odd = rank == world_size - 1
            if case == "entry point" and odd:
                allgather_baseline(layer, x, cu)
            else:
                layer.context_parallel(x, cu)
            messages[case] = None
        except ValueError as err:
            messages[case] = str(err)
    alive = torch.ones(1)
    dist.all_reduce(alive)  # every rank got here: nobody is stuck in a collective
    assert alive.item() == world_size
    return messages


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_guard_every_rank_raises_the_same_error_naming_the_cause(world_size):
    results = run_ranks(_guard_all_cases, world_size, timeout=60)
    for case, expected in GUARD_CASES.items():
        seen = [msgs[case] for msgs in results]
        assert all(m is not None and expected in m for m in seen), (case, seen)
        assert len(set(seen)) == 1, f"{case}: ranks raised different errors: {seen}"


def test_guard_names_the_ranks_and_values():
    results = run_ranks(_guard_all_cases, 3, timeout=60)
    msg = results[0]["cu_seqlens"]
    assert "ranks 0,1 have [0, 4, 9, 12, 48]" in msg and "rank 2 has [0, 5, 7, 13, 48]" in msg, msg


def _one_case(rank, world_size, case):
    layer, x, cu = _guard_inputs(rank, world_size, case)
    layer.context_parallel(x, cu)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "case", ["feature dim", "cu_seqlens", "init", "2-D cu_seqlens on one rank"]
)
def test_fault_matrix_different_input_fails_every_rank(world_size, case):
    """(b) one rank gets different input: RankFailure (no timeout), every rank's ValueError."""
    with pytest.raises(RankFailure) as info:
        run_ranks(_one_case, world_size, args=(case,), timeout=60)
    errors = info.value.errors
    assert sorted(errors) == list(range(world_size)), errors
    for text in errors.values():
        assert "ValueError" in text and GUARD_CASES[case] in text, text


def _agreements_over_calls(rank, world_size):
    """How often context_parallel compares across ranks (once per layer and layout), and what a
    new packing does: on every rank, a comparison and the reference's output; on one rank alone,
    the same ValueError on every rank, none left waiting in a collective."""
    calls = []
    agree = cpc.launch.agree
    cpc.launch.agree = lambda *a, **k: calls.append(1) or agree(*a, **k)
    layer, x, cu = _guard_inputs(rank, world_size, "none")
    for _ in range(3):
        layer.context_parallel(x, cu)
    new = torch.tensor([0, 4, 8, 12, cu[-1]])  # a new packing on every rank: compared
    out, _ = layer.context_parallel(x, new)
    full = torch.randn(int(cu[-1]), 16, generator=torch.Generator().manual_seed(5))
    full = torch.cat([full[r::world_size] for r in range(world_size)])  # _guard_inputs' shards
    expected = cpc.shard_sequence(layer.reference(full, new)[0], world_size, rank)
    close(out, expected, "output after every rank changed its packing")
    alone = torch.tensor([0, 6, cu[-1]]) if rank == 1 else new  # rank 1 changes its mind alone
    try:
        layer.context_parallel(x, alone)
        refused = None
    except ValueError as err:
        refused = str(err)
    alive = torch.ones(1)
    dist.all_reduce(alive)  # every rank got here: nobody is stuck in a collective
    return len(calls), refused


def test_ranks_agree_once_per_layout_and_together_when_one_changes():
    """compose calls context_parallel once per sequence row: agreement (weights' digests and an
    all_gather_object) is for a new layer or layout, the calls in between check locally. Whether
    to compare is decided alike on every rank: a packing changed on one rank alone is one clear
    error on every rank (it used to enter the comparison alone and time out in gloo)."""
    results = run_ranks(_agreements_over_calls, 2, timeout=20)
    assert [count for count, _ in results] == [3, 3], f"agreements per rank: {results}"
    messages = [refused for _, refused in results]
    assert messages[0] is not None and len(set(messages)) == 1, f"not one error: {messages}"
    assert "cu_seqlens differs across ranks" in messages[0], messages[0]
    assert "rank 1 has [0, 6, 32]" in messages[0] and "every rank" in messages[0], messages[0]


def _raise_mid_step(rank, world_size):
    layer, x, cu = _guard_inputs(rank, world_size, "none")
    if rank == world_size - 1:

        def broken(*args, **kwargs):
            raise RuntimeError(f"injected failure on rank {rank}")

        cpc.compress_local = broken  # fails after the halo exchange, before the all-gather
    layer.context_parallel(x, cu)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fault_matrix_one_rank_raises_mid_step(world_size):
    """(a) one rank raises inside the protocol: the harness reports it well within the timeout."""
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_mid_step, world_size, timeout=60)
    assert time.monotonic() - t0 < 30
    last = world_size - 1
    assert f"injected failure on rank {last}" in info.value.errors[last]


def _top_k_beyond_entries(rank, world_size):
    """V4's top-k (512) exceeds T/m for short packed batches: allowed, the extra slots hold -1."""
    layer = make_layer("csa")
    layer.top_k = 512
    T = world_size * S
    cu = torch.tensor([0, 5, T // 2 + 3, T])
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(9))
    out_ref, ex_ref = layer.reference(x, cu)

    def mine(t):
        return cpc.shard_sequence(t, world_size, rank)

    out_cp, ex = layer.context_parallel(mine(x), cu)
    close(out_cp, mine(out_ref), "output with top_k > T/m")
    assert torch.equal(ex.top_k, mine(ex_ref.top_k))
    assert ex.top_k.shape[1] == T // M and bool((ex.top_k == -1).any())


@pytest.mark.parametrize("world_size", [1, 2])
def test_top_k_larger_than_entries_pads_with_minus_one(world_size):
    run_ranks(_top_k_beyond_entries, world_size, timeout=60)


def _one_token_per_rank(rank, world_size):
    """compare_with_reference at s = m = window = top-k = 1, as the demo runs it."""
    torch.manual_seed(0)
    errors = {}
    for kind in ("csa", "hca"):
        layer = cpc.CompressedAttention(kind, ratio=1, top_k=1, window=1)
        x, cu = torch.randn(world_size, 64), cpc.packed_boundaries(world_size, 1, 1)
        errors[kind] = cpc.compare_with_reference(layer, x, cu)[:2]
    return errors


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "world_size", [pytest.param(1, marks=SLOW), 2, pytest.param(3, marks=SLOW)]
)
def test_one_token_per_rank_matches_the_reference(world_size):
    """The sink's gradient comes back from autograd as a strided view, which gloo's in-place
    all-reduce sums wrongly: the comparison must reduce a contiguous copy (fp32: 1e-5)."""
    for rank, errors in enumerate(run_ranks(_one_token_per_rank, world_size, timeout=60)):
        for kind, (out_err, grad_err) in errors.items():
            assert out_err < 1e-5 and grad_err < 1e-5, (rank, kind, out_err, grad_err)


# slow: the demo at 2 ranks stays (test_nccl_rules replays it)
@pytest.mark.slow
def test_demo_hca_compares_entries_at_three_ranks():
    from tools.spawn import run_torchrun

    out = run_torchrun("cp_compress.py", nproc=3, timeout=240).stdout
    assert out.count("matches the single-device reference: yes") == 2, out
    hca = out[out.index("HCA") :]
    compared = int(hca.split("compared ")[1].split()[0])
    assert compared > 0, out


def test_command_line_checks_arguments_before_any_work(capsys, monkeypatch):
    """parse_args runs before any process group exists: a bad value exits 2 with one line."""
    with pytest.raises(SystemExit):
        cpc.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for option in (
        "--seq-per-rank",
        "--m-csa",
        "--m-hca",
        "--top-k",
        "--window",
        "--seed",
        "--backend",
        "--device",
        "--timeout",
    ):
        assert option in help_text
    monkeypatch.setenv("WORLD_SIZE", "3")
    for argv, says in (
        (["--seq-per-rank", "130"], "must be a positive multiple of the compression ratio m=4"),
        (["--window", "0"], "must be int >= 1"),
        (["--seq-per-rank", "128", "--m-hca", "128"], "an entry for m=128"),
        (["--seq-per-rank", "4", "--m-hca", "4"], "halo must come from one rank"),
        (["--seq-per-rank", "100000000"], "choose smaller sizes"),  # T x T: never fits
    ):
        with pytest.raises(SystemExit) as info:
            cpc.parse_args(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and says in err and "Traceback" not in err, (argv, err)
    assert not dist.is_initialized()


def _bytes_on_the_wire(rank, world_size):
    """What the forward hands to the point-to-point sends and to the all-gather, counted."""
    sent = {"p2p": 0, "all_gather": 0}
    batch, gather = dist.batch_isend_irecv, dist.all_gather_single

    def counting_batch(ops):
        sent["p2p"] += sum(o.tensor.nbytes for o in ops if o.op is dist.isend)
        return batch(ops)

    def counting_gather(out, inp, *args, **kwargs):
        sent["all_gather"] += (world_size - 1) * inp.nbytes  # a ring: each rank passes on cp-1
        return gather(out, inp, *args, **kwargs)

    dist.batch_isend_irecv, dist.all_gather_single = counting_batch, counting_gather
    results = []
    for kind, ratio in (("csa", M), ("hca", M_HCA)):
        layer = make_layer(kind)
        cu = layouts(world_size, S, ratio)[2]
        x = torch.randn(world_size * S, 16, generator=torch.Generator().manual_seed(3))
        sent.update(p2p=0, all_gather=0)
        with torch.no_grad():
            layer.context_parallel(cpc.shard_sequence(x, world_size, rank), cu)
        expected = cpc.phase_bytes(layer, S, world_size, rank)
        results.append((dict(sent), expected))
    return results


def test_phase_bytes_counts_what_the_forward_sends():
    for rank_results in run_ranks(_bytes_on_the_wire, 3, timeout=60):
        for sent, expected in rank_results:
            assert sent["p2p"] == expected["phase1_halo"] + expected["window_halo"], (
                sent,
                expected,
            )
            assert sent["all_gather"] == expected["phase2_allgather"], (sent, expected)
