"""The mHC benchmark's floor: the bytes it counts for the optimised kernels (quoted in README)."""

import os
import sys

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
    # collapse S, its backward S + s; written: s, S, s, S, s, S.
    assert read == 4 * 4 + 7 * 5 + 4 * 5 + 4 * 9 + 4 + 5 == 116
    assert written == 4 * 1 + 7 * 4 + 4 * 1 + 4 * 4 + 1 + 4 == 57
    assert ms == 1e3 * (116 + 2 * 57)


def test_cold_stream_cost_is_measured():
    per_read, per_write = bench_mhc.cold_stream_cost("cpu", repeats=1)
    assert per_read > 0 and per_write >= 0
