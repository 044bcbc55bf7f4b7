"""Two-stage CP for compressed attention vs. the baseline that all-gathers raw rows (V4 §3.4.3).

    python benchmarks/bench_cp_compress.py            # spawns its ranks itself; gloo on CPU
    python benchmarks/bench_cp_compress.py --quick    # smaller sequences
    python benchmarks/bench_cp_compress.py --backend nccl --device cuda   # one GPU per rank

For a CSA layer (m = 4) and an HCA layer (m' = 128), on 1, 2 and 4 ranks at a fixed total sequence
length, then on 4 ranks at a growing one, it prints side by side, per rank:
- bytes sent: the two-stage protocol (stage-1 halo + window halo + stage-2 all-gather of compressed
  entries) and the baseline (all-gather of every raw compressor row + the window K/V);
- the ratio, and the stage-2 all-gather against an all-gather of raw K/V alone (C floats a token,
  the main and indexer channels, no gate logits): the paper's "1/m", here (s/m + 1)/s;
- forward+backward time (median of 3, the slowest rank) and peak memory (the slowest rank's peak of
  storages allocated during the step, from memory_timeline; a separate, untimed run).
Bytes are exact counts of what each rank sends (hands to the collectives). Time on a shared CPU
is noisy. Backend and device are chosen as the technique files choose them (launch.choose_backend):
NCCL on CUDA when every rank can have a GPU of its own, else gloo on the CPU. The baseline,
`allgather_baseline`, lives here: it is what the protocol is priced against.
"""

import argparse
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
if ROOT not in sys.path:  # appended: a graded submission earlier on the path stays first
    sys.path.append(ROOT)
import cp_compress as cpc  # noqa: E402
import launch  # noqa: E402
from memory.memory_timeline import MemoryTimeline  # noqa: E402

DIM = 64
LAYERS = {
    "CSA m=4": dict(
        kind="csa",
        dim=DIM,
        heads=4,
        head_dim=32,
        ratio=4,
        top_k=64,
        window=32,
        index_heads=4,
        index_dim=16,
    ),
    "HCA m'=128": dict(kind="hca", dim=DIM, heads=4, head_dim=32, ratio=128, window=32),
}


def allgather_baseline(layer, x, cu_seqlens, group=None):
    """The simple baseline: all-gather the raw compressor rows (and window K/V) of every token and
    compress the whole sequence on every rank; the attention is the layer's own. Same result as
    layer.context_parallel. -> ([s, H, D], Extras)."""
    cpc.agree_inputs(layer, x, cu_seqlens, group, entry="allgather_baseline")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    s, D, m = x.shape[0], layer.head_dim, layer.ratio
    cu_seqlens = cu_seqlens.to(x.device)
    proj = layer.project(x)
    raw_local = torch.stack([proj.kv, proj.gate], dim=1)
    raw = cpc.all_gather_entries(raw_local, group).flatten(0, 1)  # [T, 2, sets, C]
    window_all = cpc.all_gather_entries(proj.window_kv, group).flatten(0, 1)  # [T, D]
    entries = layer.normalise(
        cpc.compress_reference(raw[:, 0], raw[:, 1], layer.ape, cu_seqlens, m, layer.overlap)
    )
    ends, doc_starts = cpc.compressed_entry_ends(cu_seqlens, m)
    pos = rank * s + torch.arange(s, device=x.device)
    visible = cpc.visibility(pos, cpc.doc_start_of(pos, cu_seqlens), ends, doc_starts)
    padding = visible.new_zeros(s, world * s // m - ends.numel())  # the tail: never visible
    visible = torch.cat([visible, padding], dim=1)
    window_all = torch.cat([window_all.new_zeros(layer.window - 1, D), window_all])
    window_ext = window_all[rank * s : rank * s + s + layer.window - 1]
    return layer.attend_local(proj, entries, visible, window_ext, rank * s, cu_seqlens)


def bytes_sent(layer, method, s, world, rank):
    """Bytes this rank hands to the collectives, per stage, for one step of `method`."""
    if method == "context_parallel":
        return cpc.phase_bytes(layer, s, world, rank)
    channels = layer.head_dim + (layer.index_dim if layer.overlap else 0)
    sets = 2 if layer.overlap else 1
    return {
        "allgather_raw": (world - 1) * s * 2 * sets * channels * 4,
        "allgather_window": (world - 1) * s * layer.head_dim * 4,
    }


METHODS = {
    "context_parallel": lambda layer, x, cu: layer.context_parallel(x, cu),
    "allgather_baseline": allgather_baseline,
}


def step(layer, method, x, cu):
    out, extras = METHODS[method](layer, x, cu)
    out.square().mean().backward()
    return extras


def recorded_step(layer, method, x, cu, name):
    """step(), recorded as step 1 of a memory timeline (steps count from 1 in every printout):
    -> (the finished timeline, the method's Extras)."""
    tl = MemoryTimeline(model=layer, name=name)
    with tl.record():
        with tl.phase("forward", 1):
            out, extras = METHODS[method](layer, x, cu)
            loss = out.square().mean()
        with tl.phase("backward", 1):
            loss.backward()
    return tl, extras


def build_inputs(rank, world, layer_name, total, device="cpu"):
    """The same layer and packed sequence on every rank; this rank's shard of it, as a leaf."""
    torch.manual_seed(0)
    layer = cpc.CompressedAttention(**LAYERS[layer_name]).to(device)
    s = total // world
    cu = cpc.packed_boundaries(total, s, layer.ratio).to(device)
    x = cpc.shard_sequence(torch.randn(total, DIM), world, rank).to(device).requires_grad_()
    return layer, s, cu, x


def measure(rank, world, layer_name, total, device, reps=3):
    """This rank's numbers for both methods at one (layer, sequence length)."""
    layer, s, cu, x = build_inputs(rank, world, layer_name, total, device)
    row = {}
    for method in ("context_parallel", "allgather_baseline"):
        step(layer, method, x, cu)  # warm-up
        detail = bytes_sent(layer, method, s, world, rank)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            step(layer, method, x, cu)
            times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        tl, _ = recorded_step(layer, method, x, cu, name=method)
        row[method] = dict(
            bytes=sum(detail.values()),
            detail=detail,
            time=statistics.median(times),
            peak=tl.peak(),
        )
    channels = layer.head_dim + (layer.index_dim if layer.overlap else 0)
    row["raw_kv_allgather"] = (
        (world - 1) * s * channels * 4
    )  # raw K/V alone: C floats a token, fp32
    row["entries_allgather"] = row["context_parallel"]["detail"]["phase2_allgather"]
    return row


def rank_profile(rank, world, layer_name, total, record=True):
    """For the notebook (run under spawn.run_ranks): per method, this rank's bytes sent and,
    with `record`, the memory timeline of one forward+backward step."""
    layer, s, cu, x = build_inputs(rank, world, layer_name, total)
    out = {}
    for method in ("context_parallel", "allgather_baseline"):
        if record:
            tl, extras = recorded_step(layer, method, x, cu, name=f"rank {rank}: {method}")
        else:
            tl, extras = None, step(layer, method, x, cu)
        out[method] = dict(
            bytes=bytes_sent(layer, method, s, world, rank), timeline=tl, counts=extras.counts
        )
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return out


def worker(rank, world, port, jobs, queue, backend, device):
    # the rank's device is set before the group is created, as in the technique files' set-up
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    backend, device_type, _ = launch.choose_backend(backend, device)
    dev = torch.device("cpu")
    if device_type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
        device_id=dev if backend == "nccl" else None,
    )
    results, t0 = [], time.perf_counter()
    for layer_name, total in jobs:
        results.append(measure(rank, world, layer_name, total, dev))
        if rank == 0:
            print(
                f"  [{time.perf_counter() - t0:6.1f} s] cp={world} {layer_name} T={total} done",
                flush=True,
            )
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        queue.put(everyone)
    del results, everyone
    gc.collect()  # drop cycles that reach gloo state now, not at interpreter shutdown (can abort)
    dist.destroy_process_group()


def run(world, jobs, backend=None, device=None):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, world, port, jobs, queue, backend, device))
        for r in range(world)
    ]
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
    head = (
        f"{'layer':<11} {'cp':>2} {'T':>6} | {'2-stage sent KiB':>16} {'baseline sent KiB':>17} "
        f"{'ratio':>6} {'entries/rawKV':>13} | {'2-stage ms':>10} {'baseline ms':>11} | "
        f"{'2-stage MiB':>11} {'baseline MiB':>12}"
    )
    print(head)
    print("-" * len(head))
    for (layer_name, world, total), r in rows:
        two, base = r["context_parallel"], r["allgather_baseline"]
        ratio = two["bytes"] / base["bytes"] if base["bytes"] else float("nan")
        per_m = (
            r["entries_allgather"] / r["raw_kv_allgather"]
            if r["raw_kv_allgather"]
            else float("nan")
        )
        print(
            f"{layer_name:<11} {world:>2} {total:>6} | {two['bytes'] / 1024:>16.1f} "
            f"{base['bytes'] / 1024:>17.1f} {ratio:>6.3f} {per_m:>13.4f} | "
            f"{two['time'] * 1e3:>10.1f} {base['time'] * 1e3:>11.1f} | "
            f"{two['peak'] / 2**20:>11.2f} {base['peak'] / 2**20:>12.2f}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sequences (about a minute)")
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default=None,
        help="process-group backend (default: NCCL when every rank has a GPU)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where tensors live (default: cuda with NCCL, else cpu)",
    )
    args = parser.parse_args()
    os.environ["LOCAL_WORLD_SIZE"] = "4"  # the largest run decides, and fails before any work
    backend, device, why = launch.choose_backend(args.backend, args.device)
    fixed = 1024 if args.quick else 4096
    growing = [512, 1024, 2048] if args.quick else [2048, 4096, 8192]
    print(
        f"torch {torch.__version__}, {why}, {os.cpu_count()} cores; bytes sent and MiB are per "
        f"rank (the largest rank), ms = median fwd+bwd of the slowest rank",
        flush=True,
    )
    fixed_rows, growing_rows = [], []
    t0 = time.perf_counter()
    for world in (1, 2, 4):
        print(
            f"[{time.perf_counter() - t0:6.1f} s] cp={world}: starting {world} rank(s)", flush=True
        )
        jobs = [(name, fixed) for name in LAYERS]
        if world == 4:
            jobs += [(name, t) for t in growing if t != fixed for name in LAYERS]
        for job, r in zip(jobs, run(world, jobs, backend, device)):
            (fixed_rows if job[1] == fixed else growing_rows).append(((job[0], world, job[1]), r))
            if world == 4 and job[1] == fixed:
                growing_rows.append(((job[0], world, job[1]), r))
    table(f"Fixed total sequence length T={fixed}, cp_size 1, 2, 4", fixed_rows)
    table(
        "Growing sequence length, cp_size 4",
        sorted(growing_rows, key=lambda row: (row[0][0], row[0][2])),
    )


if __name__ == "__main__":
    main()
