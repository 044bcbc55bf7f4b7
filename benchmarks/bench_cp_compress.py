"""Two-stage CP for compressed attention vs. the simple baseline that all-gathers raw rows (V4 §3.4.3).

    python benchmarks/bench_cp_compress.py            # spawns the gloo ranks itself, CPU
    python benchmarks/bench_cp_compress.py --quick    # smaller sequences

For a CSA layer (m = 4) and an HCA layer (m' = 128), on 1, 2 and 4 ranks at a fixed total sequence
length, then on 4 ranks at a growing one, it prints side by side, per rank:
- bytes sent: the two-stage protocol (stage-1 halo + window halo + stage-2 all-gather of compressed
  entries) and the baseline (all-gather of every raw compressor row + the window K/V);
- the ratio, and the stage-2 all-gather against an all-gather of raw K/V alone (C floats a token, the
  main and indexer channels, no gate logits): the paper's "1/m", here (s/m + 1)/s;
- forward+backward time (median of 3, the slowest rank) and peak memory (the slowest rank's peak of
  storages allocated during the step, from memory_timeline; a separate, untimed run).
Bytes are exact counts of what each rank hands to the collectives. Time on a shared CPU is noisy.
"""
import datetime
import gc
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cp_compress as cpc  # noqa: E402
from memory_timeline import MemoryTimeline  # noqa: E402

DIM = 64
LAYERS = {"CSA m=4": dict(kind="csa", dim=DIM, heads=4, head_dim=32, ratio=4, top_k=64, window=32,
                          index_heads=4, index_dim=16),
          "HCA m'=128": dict(kind="hca", dim=DIM, heads=4, head_dim=32, ratio=128, window=32)}


def step(layer, method, x, cu):
    out, extras = getattr(layer, method)(x, cu)
    out.square().mean().backward()
    return extras


def recorded_step(layer, method, x, cu, name):
    """step(), inside a memory timeline: -> (the finished timeline, the method's Extras)."""
    tl = MemoryTimeline(model=layer, name=name)
    with tl.record():
        with tl.phase("forward"):
            out, extras = getattr(layer, method)(x, cu)
            loss = out.square().mean()
        with tl.phase("backward"):
            loss.backward()
    return tl, extras


def setup(rank, world, layer_name, total):
    """The same layer and packed sequence on every rank; this rank's shard of it, as a leaf."""
    torch.manual_seed(0)
    layer = cpc.CompressedAttention(**LAYERS[layer_name])
    s = total // world
    cu = cpc.packed_boundaries(total, s, layer.ratio)
    x = cpc.shard_sequence(torch.randn(total, DIM), world, rank).clone().requires_grad_()
    return layer, s, cu, x


def measure(rank, world, layer_name, total, reps=3):
    """This rank's numbers for both methods at one (layer, sequence length)."""
    layer, s, cu, x = setup(rank, world, layer_name, total)
    row = {}
    for method in ("context_parallel", "allgather_baseline"):
        extras = step(layer, method, x, cu)                      # warm-up, and the byte counts
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            step(layer, method, x, cu)
            times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        tl, _ = recorded_step(layer, method, x, cu, name=method)
        row[method] = dict(bytes=sum(extras.bytes_sent.values()), detail=extras.bytes_sent,
                           time=statistics.median(times), peak=tl.peak())
    channels = layer.normalise(torch.zeros(1, layer.wkv_compress.shape[1] // (2 if layer.overlap else 1))).shape[1]
    row["raw_kv_allgather"] = (world - 1) * s * channels * 4   # raw K/V alone: C floats a token, fp32
    row["entries_allgather"] = row["context_parallel"]["detail"]["stage2_allgather"]
    return row


def rank_profile(rank, world, layer_name, total, record=True):
    """For the notebook (run under tests/harness.run_ranks): per method, this rank's bytes sent and,
    with `record`, the memory timeline of one forward+backward step."""
    layer, s, cu, x = setup(rank, world, layer_name, total)
    out = {}
    for method in ("context_parallel", "allgather_baseline"):
        if record:
            tl, extras = recorded_step(layer, method, x, cu, name=f"rank {rank}: {method}")
        else:
            tl, extras = None, step(layer, method, x, cu)
        out[method] = dict(bytes=extras.bytes_sent, timeline=tl,
                           counts=getattr(extras, "counts", None))
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return out


def worker(rank, world, port, jobs, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    results = []
    for layer_name, total in jobs:
        results.append(measure(rank, world, layer_name, total))
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        queue.put(everyone)
    del results, everyone
    gc.collect()  # drop cycles that still reach gloo state now, not during interpreter shutdown (it can abort)
    dist.destroy_process_group()


def run(world, jobs):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, jobs, queue)) for r in range(world)]
    for p in procs:
        p.start()
    everyone = queue.get(timeout=1800)
    for p in procs:
        p.join()
    return [worst_rank([ranks[j] for ranks in everyone]) for j in range(len(jobs))]


def worst_rank(rows):
    """One job's rows from every rank -> the largest byte count, slowest time, largest peak."""
    out = {key: max(r[key] for r in rows) for key in ("raw_kv_allgather", "entries_allgather")}
    for method in ("context_parallel", "allgather_baseline"):
        out[method] = {f: max(r[method][f] for r in rows) for f in ("bytes", "time", "peak")}
    return out


def table(title, rows):
    print(f"\n{title}")
    head = (f"{'layer':<11} {'cp':>2} {'T':>6} | {'2-stage KiB':>11} {'baseline KiB':>12} {'ratio':>6} "
            f"{'entries/rawKV':>13} | {'2-stage ms':>10} {'baseline ms':>11} | {'2-stage MiB':>11} {'baseline MiB':>12}")
    print(head)
    print("-" * len(head))
    for (layer_name, world, total), r in rows:
        two, base = r["context_parallel"], r["allgather_baseline"]
        ratio = two["bytes"] / base["bytes"] if base["bytes"] else float("nan")
        per_m = r["entries_allgather"] / r["raw_kv_allgather"] if r["raw_kv_allgather"] else float("nan")
        print(f"{layer_name:<11} {world:>2} {total:>6} | {two['bytes'] / 1024:>11.1f} {base['bytes'] / 1024:>12.1f} "
              f"{ratio:>6.3f} {per_m:>13.4f} | {two['time'] * 1e3:>10.1f} {base['time'] * 1e3:>11.1f} | "
              f"{two['peak'] / 2**20:>11.2f} {base['peak'] / 2**20:>12.2f}")


def main():
    quick = "--quick" in sys.argv
    fixed = 1024 if quick else 4096
    growing = [512, 1024, 2048] if quick else [2048, 4096, 8192]
    print(f"torch {torch.__version__}, gloo on CPU, {os.cpu_count()} cores; bytes and MiB are per rank "
          f"(the largest rank), ms = median fwd+bwd of the slowest rank")
    fixed_rows, growing_rows = [], []
    for world in (1, 2, 4):
        jobs = [(name, fixed) for name in LAYERS]
        if world == 4:
            jobs += [(name, t) for t in growing if t != fixed for name in LAYERS]
        for job, r in zip(jobs, run(world, jobs)):
            (fixed_rows if job[1] == fixed else growing_rows).append(((job[0], world, job[1]), r))
            if world == 4 and job[1] == fixed:
                growing_rows.append(((job[0], world, job[1]), r))
    table(f"Fixed total sequence length T={fixed}, cp_size 1, 2, 4", fixed_rows)
    table("Growing sequence length, cp_size 4", sorted(growing_rows, key=lambda row: (row[0][0], row[0][2])))


if __name__ == "__main__":
    main()
