"""The mHC benchmark's accounting: the bytes it counts per layer (the mHC paper's counts) and
for the optimised kernels (quoted in docs/mhc.md), and the stubs that measure the floor in the
model."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_mhc  # noqa: E402


def test_floor_counts_each_kernels_least_bytes():
    assert set(bench_mhc.KERNEL_TRAFFIC) == set(bench_mhc.KERNELS)
    cfg = bench_mhc.mhc.Config(dim=1024, n_layers=4, n_heads=16, seq_len=128)
    calls = dict(mix_in=4, mix_out=7, mix_out_backward=4, mix_in_backward=4)
    calls.update(collapse=1, collapse_backward=1)
    per_mib = 1 / bench_mhc.MiB  # 1 s per MiB read, 2 s per MiB written
    ms, read, written = bench_mhc.stream_floor(cfg, 2, calls, (per_mib, 2 * per_mib))
    # batch 2 x T 128 = 256 tokens: the stream S = 256 x 4 lanes x 1024 x 4 B = 4 MiB, a lane
    # s = 1 MiB. Read: mix_in S, mix_out S + s, mix_out_backward S + s, mix_in_backward 2S + s,
    # collapse S, its backward S + s; written: s, S, S + s (the post-mix's dX and df), S, s, S.
    assert read == 4 * 4 + 7 * 5 + 4 * 5 + 4 * 9 + 4 + 5 == 116
    assert written == 4 * 1 + 7 * 4 + 4 * 5 + 4 * 4 + 1 + 4 == 73
    assert ms == 1e3 * (116 + 2 * 73)


def test_cold_stream_cost_is_measured():
    per_read, per_write = bench_mhc.cold_stream_cost("cpu", repeats=1)
    assert per_read > 0 and per_write >= 0


def _flat(out):
    """Nested tuples of tensors -> [tensor, ...] in order."""
    return [out] if isinstance(out, torch.Tensor) else [t for item in out for t in _flat(item)]


def _layout(out):
    """Nested tuples of tensors -> [(shape, dtype), ...] in order."""
    return [(tuple(t.shape), t.dtype) for t in _flat(out)]


def test_stubs_return_what_the_kernels_return_and_floor_stubs_move_only_the_counted_tensors():
    """The stand-ins (STUBS) time in the kernels' place only if each returns the real kernel's
    shapes and dtypes; the floor stubs stand for the floor only if they read and write exactly the
    n*C- and C-sized tensors KERNEL_TRAFFIC counts: every stream-sized input it counts changes the
    output, every one it does not count leaves the output alone, and the stream-sized outputs are
    what it writes."""
    mhc = bench_mhc.mhc
    torch.manual_seed(0)
    n, dim, tokens = 4, 32, 6
    lanes, lane = torch.randn(2, 3, n, dim), torch.randn(2, 3, dim)
    stream, grad_out, f, grad_h = lanes, torch.randn_like(lanes), lane, torch.randn_like(lane)
    sized = {tuple(lanes.shape), tuple(lane.shape)}  # what the floor counts: n*C or C per token
    params = mhc.hc_params(mhc.HyperConnection(n, dim))
    head = mhc.head_params(mhc.HyperHead(n, dim))
    with torch.no_grad():
        _, kept = mhc.mix_in(stream, params, 20)
        grad_b, grad_x, grad_c, _ = mhc.mix_out_backward(grad_out, stream, kept, f)
        _, head_kept = mhc.collapse(stream, head)
        args = {  # every kernel's arguments, as RecomputedBlock passes them
            "mix_in": (stream, params, 20),
            "mix_out": (stream, kept, f),
            "mix_out_backward": (grad_out, stream, kept, f),
            "mix_in_backward": (grad_h, grad_b, grad_c, grad_x, stream, kept, params, 20),
            "collapse": (stream, head),
            "collapse_backward": (grad_h, stream, head_kept, head),
        }
        assert set(bench_mhc.STUBS) == {"floor", "passes"}
        for name in bench_mhc.KERNELS:
            real = getattr(mhc, name)(*args[name])
            for which, stubs in bench_mhc.STUBS.items():
                assert _layout(stubs[name](*args[name])) == _layout(real), (which, name)
            stub = bench_mhc.STUBS["floor"][name]
            out = stub(*args[name])
            read = 0
            for i, arg in enumerate(args[name]):
                if not isinstance(arg, torch.Tensor) or tuple(arg.shape) not in sized:
                    continue
                moved = list(args[name])
                moved[i] = arg + 1.0
                changed = any(
                    not torch.equal(a, b) for a, b in zip(_flat(out), _flat(stub(*moved)))
                )
                read += arg.numel() if changed else 0
            written = sum(t.numel() for t in _flat(out) if tuple(t.shape) in sized)
            counted = bench_mhc.KERNEL_TRAFFIC[name](n * dim, dim)
            assert (read, written) == (tokens * counted[0], tokens * counted[1]), name


def test_pass_stubs_drop_only_the_coefficient_math():
    """The passes set is the kernels without gates and Sinkhorn: with those taken out of the real
    mix_in (A, B, C replaced by the stub's sigmoid), the pre-mix and kept projection agree."""
    mhc = bench_mhc.mhc
    for name in ("mix_out", "mix_out_backward", "collapse", "collapse_backward"):
        assert bench_mhc.STUBS["passes"][name] is getattr(mhc, name)  # no coefficient math
    torch.manual_seed(0)
    stream, params = torch.randn(2, 3, 4, 32), mhc.hc_params(mhc.HyperConnection(4, 32))
    h, (a, _, _, projected, inv_rms) = bench_mhc.STUBS["passes"]["mix_in"](stream, params, 20)
    want_projected, want_inv_rms = mhc.norm_then_project(stream.flatten(-2), params[0])
    torch.testing.assert_close(projected, want_projected)
    torch.testing.assert_close(inv_rms, want_inv_rms)
    torch.testing.assert_close(a, torch.sigmoid(want_projected[..., :4]))
    torch.testing.assert_close(h, (a.unsqueeze(-1) * stream).sum(-2))


def test_mixing_bytes_match_the_paper_counts():
    n, dim = 4, 1024
    naive = bench_mhc.mixing_bytes_per_token(n, dim, False, 1)
    fused = bench_mhc.mixing_bytes_per_token(n, dim, True, 1)
    assert naive["post_mix"] == ((3 * n + 1) * dim, 3 * n * dim)  # mHC paper: (3n+1)C, 3nC
    assert fused["post_mix"] == ((n + 1) * dim, n * dim)  # -> (n+1)C reads, nC writes
    assert fused["pre_mix"] == (n * dim, dim)
    assert naive["pre_mix"] == (2 * n * dim, (n + 1) * dim)
    assert fused["coefficients"][0] == n * dim and naive["coefficients"][0] == 3 * n * dim
    assert bench_mhc.mixing_bytes_per_token(n, dim, True, 4)["pre_mix"] == (4 * n * dim, 4 * dim)
    small, big = bench_mhc.expected_overhead(4, 128, 64), bench_mhc.expected_overhead(4, 1024, 64)
    assert big.ratio < small.ratio / 4  # mixing ~ n C, F ~ C^2


def test_written_pairs_time_the_same_math():
    """The parts table's 'fused' column runs mhc.py's pure forward and written-out backward."""
    mhc = bench_mhc.mhc
    gen = torch.Generator().manual_seed(0)
    b = torch.rand(2, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    c = torch.rand(2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    f = torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    fn = bench_mhc.written(mhc.post_mix, mhc.post_mix_backward)
    assert torch.autograd.gradcheck(fn, (b, x, c, f))
    sinkhorn = bench_mhc.written(*bench_mhc.SINKHORN, iters=5)
    assert torch.autograd.gradcheck(sinkhorn, (torch.randn(2, 4, 4, dtype=torch.float64,
                                                           requires_grad=True),))  # fmt: skip
