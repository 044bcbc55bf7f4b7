"""Is each chapter faster than what one would use instead? One run, every chapter, as ratios.

    python benchmarks/run_all.py            # quick sizes (make bench): minutes on 2 cores
    python benchmarks/run_all.py --full     # the full tables too: every bench_*.py (FULL=1)
    python benchmarks/run_all.py --only muon_zero,mhc

Each comparison runs ours and theirs in the same process or launch, interleaved (the order
rotated each round), one thread per process, and reports medians and their ratio (ours /
theirs: below 1 is faster, or smaller). The machine, threads and versions head the output;
benchmarks/results.json holds every number and benchmarks/RESULTS.md the tables, generated.
Each chapter runs in a process of its own: one that fails is reported and the rest still run.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "benchmarks")
CHAPTERS = ("muon_zero", "tensor_ckpt", "cp_compress", "mhc", "compose")
# the full tables of each chapter's own script (--full), with its launcher
FULL_SCRIPTS = [
    [sys.executable, "benchmarks/bench_muon_zero.py", "--threads", "1"],
    [sys.executable, "benchmarks/bench_muon_zero.py", "--threads", "1", "--agreement"],
    [sys.executable, "benchmarks/bench_tensor_ckpt.py"],
    [sys.executable, "benchmarks/bench_cp_compress.py"],
    [sys.executable, "benchmarks/bench_mhc.py"],
    [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "benchmarks/bench_compose.py",
        "--cp",
        "2",
    ],
    [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "benchmarks/bench_agreement.py",
    ],
]


def machine():
    import torch

    return dict(
        machine=platform.machine(),
        cpu=platform.processor() or platform.machine(),
        cores=os.cpu_count(),
        threads_per_process=1,
        python=platform.python_version(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )


# ---- one chapter each, run in a child process: `run_all.py --chapter NAME --out PATH` ----------


def chapter_muon_zero(full):
    import bench_muon_zero as b

    rows = b.vs_torch_one_process(full, repeats=7 if full else 5)
    ranks = b.vs_ddp_two_ranks(full, repeats=7 if full else 3)
    r = ranks[0]
    table = [
        [
            f"{x['model']}: step, 1 process",
            f"{x['ours_ms']:.0f} ms",
            f"{x['torch_ms']:.0f} ms",
            x["ratio"],
            "<= 1.0",
        ]
        for x in rows
    ]
    table.append(
        [
            "a few large dense: step, 2 ranks (slowest)",
            f"{r['ours_ms']:.0f} ms",
            f"{r['ddp_ms']:.0f} ms",
            r["ours_ms"] / r["ddp_ms"],
            "<= 0.6",
        ]
    )
    for k, (what, unit) in {
        "muon_state": ("Muon momentum per rank", "KiB"),
        "state": ("optimizer state per rank (Muon's and AdamW's)", "KiB"),
        "sent": ("bytes sent per rank", "KiB"),
    }.items():
        for rank, x in enumerate(ranks):
            table.append(
                [
                    f"a few large dense: {what}, rank {rank}",
                    f"{x['ours_' + k] / 1024:.0f} {unit}",
                    f"{x['ddp_' + k] / 1024:.0f} {unit}",
                    x["ours_" + k] / x["ddp_" + k],
                    f"<= {(x['ddp_' + k] / 2 + x[pad]) / x['ddp_' + k]:.2f} (1/2 + padding)"
                    if (pad := {"muon_state": "padding", "state": "state_padding"}.get(k))
                    else "",
                ]
            )
    return dict(
        title="MuonZeRO vs torch.optim.Muon + AdamW (5 NS steps in bf16 on both); at 2 gloo "
        "ranks vs an all-reduce of the gradients + the same on every rank",
        columns=["comparison", "ours", "theirs", "ratio", "target"],
        rows=table,
        raw=dict(one_process=rows, two_ranks=ranks),
    )


NAMES = {"none": "no checkpointing", "module": "torch.utils.checkpoint per layer"}


def chapter_tensor_ckpt(full):
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tensor_ckpt_{os.getpid()}.json")
    cmd = [sys.executable, "benchmarks/bench_tensor_ckpt.py", "--json", path]
    cmd += [] if full else ["--quick", "--bisect", "3", "--reps", "9"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)
    with open(path) as f:
        rows = json.load(f)
    os.remove(path)
    ours, table = rows["tensor_ckpt"], []
    for name, r in rows.items():
        if name == "tensor_ckpt":
            continue
        held = ours["held"] / r["held"] if r["held"] else float("nan")
        table.append(
            [
                f"tensor_ckpt vs {NAMES.get(name, name)}",
                f"{ours['held'] / 2**20:.2f} / {r['held'] / 2**20:.2f}" if r["held"] else "-",
                f"{ours['ms']:.1f} / {r['ms']:.1f}",
                held,
                ours["ms"] / r["ms"],
            ]
        )
    return dict(
        title="tensor_ckpt vs torch.utils.checkpoint, selective AC (SAC) and torch.compile's "
        "min-cut at tensor_ckpt's activation budget (targets vs SAC: memory <= 1, time <= 1)",
        columns=[
            "comparison",
            "activations MiB (ours / theirs)",
            "step ms (ours / theirs)",
            "memory ratio",
            "time ratio",
        ],
        rows=table,
        raw=rows,
    )


def chapter_cp_compress(full):
    import bench_cp_compress as b

    total = 4096 if full else 1024
    table, raw = [], {}
    for name, r in zip(b.LAYERS, b.run(2, [(name, total) for name in b.LAYERS])):
        worst = r  # the largest rank's bytes, the slowest rank's time
        ours, theirs = worst["context_parallel"], worst["allgather_baseline"]
        raw[name] = worst
        table.append(
            [
                f"{name}, cp=2, T={total}",
                f"{ours['bytes'] / 1024:.1f} / {theirs['bytes'] / 1024:.1f}",
                f"{1e3 * ours['time']:.1f} / {1e3 * theirs['time']:.1f}",
                ours["bytes"] / theirs["bytes"],
                ours["time"] / theirs["time"],
            ]
        )
    return dict(
        title="cp_compress's two stages vs all-gathering the raw compressor rows (per rank, the "
        "largest; time: fwd+bwd, slowest rank)",
        columns=[
            "layer",
            "KiB sent (ours / theirs)",
            "ms (ours / theirs)",
            "bytes ratio",
            "time ratio",
        ],
        rows=table,
        raw=raw,
    )


def chapter_mhc(full):
    import bench_mhc as b

    dims = (256, 512, 1024, 2048) if full else (256, 512)
    modes = ("eager", "compiled") if full else ("eager",)  # compiling takes minutes here
    table, raw = [], {}
    for dim in dims:
        _, median, compile_s, saved = b.curve_point(
            dim, 2, 9 if full else 5, "cpu", modes, lambda text: print(text, file=sys.stderr)
        )
        raw[dim] = dict(
            ms={f"{k[0]} {k[1]}": 1e3 * v for k, v in median.items()},
            saved={f"{k[0]} {k[1]}": v for k, v in saved.items()},
        )
        for mode in modes:
            o, n = ("optimised", mode), ("naive", mode)
            table.append(
                [
                    f"C={dim}, {mode}",
                    f"{1e3 * median[o]:.1f} / {1e3 * median[n]:.1f}",
                    f"{saved[o] / 2**20:.2f} / {saved[n] / 2**20:.2f}",
                    median[o] / median[n],
                    saved[o] / saved[n],
                ]
            )
    return dict(
        title="mHC optimised (fused mixing + selective recomputation) vs naive mHC, 4 layers, "
        "T=128, batch 2 (target: time ratio <= 1 at every C); compiled in the full run only",
        columns=[
            "C, mode",
            "step ms (ours / naive)",
            "saved MiB (ours / naive)",
            "time ratio",
            "memory ratio",
        ],
        rows=table,
        raw=raw,
    )


def _compose_rank(rank, world, steps, plain):
    """compose's training step on this layout (1x1xW), or (plain) its one-process reference:
    the same model trained with torch.optim.Muon + AdamW and none of the techniques. -> median
    seconds per step after the first, the slowest rank's."""
    import statistics

    import torch
    import torch.distributed as dist

    import compose
    import muon_zero

    torch.set_num_threads(1)
    cfg, train = compose.ComposeConfig(), compose.Training(steps)
    seconds = []
    if plain:  # compose.reference_training's steps, one by one: the reference the tests prove
        model, opts, experts = compose.reference_model(cfg, train)
        with muon_zero.torch_muon_newton_schulz_in(train.ns_dtype):
            for step in range(steps):
                began = time.perf_counter()
                tokens = compose.batch_tokens(cfg, cfg.batch, step, train.seed)
                compose.reference_step(model, opts, experts, tokens)
                seconds.append(time.perf_counter() - began)
        return statistics.median(seconds[1:])

    def on_step(step, layout, model, opt, run):
        dist.barrier()
        began = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - began)
        return out

    compose.run_layout(cfg, train, 1, 1, world, on_step=on_step)
    t = torch.tensor(statistics.median(seconds[1:]), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def chapter_compose(full):
    from tools.spawn import run_ranks

    steps, repeats = (6, 3) if full else (4, 2)
    times = {"plain": [], "1x1x1": [], "1x1x2": []}
    for _ in range(repeats):  # interleaved
        times["plain"].append(_compose_rank(0, 1, steps, True))
        times["1x1x1"].append(run_ranks(_compose_rank, 1, args=(steps, False), timeout=900)[0])
        times["1x1x2"].append(run_ranks(_compose_rank, 2, args=(steps, False), timeout=900)[0])
    ms = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}
    # dp=2 trains twice the rows per step: the ideal is the same step time as one rank's
    kept = ms["1x1x1"] / ms["1x1x2"]
    return dict(
        title="compose: 1x1x1 vs its plain reference (the same model, torch.optim.Muon + AdamW "
        "with Newton-Schulz in compose's dtype, none of the techniques), and 2 data-parallel "
        "ranks (twice the rows) vs 1 rank",
        columns=["comparison", "ours ms/step", "theirs ms/step", "ratio", "target"],
        rows=[
            [
                "1x1x1 vs plain one-process reference",
                f"{ms['1x1x1']:.0f}",
                f"{ms['plain']:.0f}",
                ms["1x1x1"] / ms["plain"],
                "<= 1.2",
            ],
            [
                "1x1x2 (2 ranks, 2x rows) vs 1x1x1: share of the ideal 2x speed-up kept",
                f"{ms['1x1x2']:.0f}",
                f"{ms['1x1x1']:.0f}",
                kept,
                "1.0 ideal",
            ],
        ],
        raw=dict(ms=ms, times=times),
    )


# ---- the driver --------------------------------------------------------------------------------


def cell(x):
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def markdown(results):
    m = results["machine"]
    lines = [
        "# Benchmark results (generated by `make bench`; do not edit)",
        "",
        f"{m['date']}: {m['cores']} cores ({m['cpu']}), {m['threads_per_process']} thread "
        f"per process, Python {m['python']}, torch {m['torch']}; "
        f"{'full' if results['full'] else 'quick'} run, {results['seconds']:.0f} s.",
        "",
        "Ratios are ours / theirs, medians of interleaved runs in one process or launch: "
        "below 1 is faster (or smaller). Times on a shared machine are noisy; the ratios are "
        "what to compare.",
        "",
    ]
    for name, r in results["chapters"].items():
        lines += [f"## {name}", ""]
        if "error" in r:
            lines += [f"failed: {r['error']}", ""]
            continue
        lines += [r["title"], ""]
        lines += ["| " + " | ".join(r["columns"]) + " |", "|" + "---|" * len(r["columns"])]
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in r["rows"]]
        lines.append("")
    return "\n".join(lines)


def text_table(r):
    rows = [r["columns"]] + [[cell(c) for c in row] for row in r["rows"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(r["columns"]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="full sizes, then every bench_*.py")
    parser.add_argument("--only", default=",".join(CHAPTERS), help="chapters, comma-separated")
    parser.add_argument("--json", default=os.path.join(HERE, "results.json"))
    parser.add_argument("--markdown", default=os.path.join(HERE, "RESULTS.md"))
    parser.add_argument("--chapter", help=argparse.SUPPRESS)  # the child: one chapter
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.chapter:
        import torch

        torch.set_num_threads(1)
        sys.path[:0] = [ROOT, HERE]
        result = globals()[f"chapter_{args.chapter}"](args.full)
        with open(args.out, "w") as f:
            json.dump(result, f, default=str)
        return
    only = [c for c in args.only.split(",") if c]
    unknown = [c for c in only if c not in CHAPTERS]
    if unknown:
        parser.error(f"--only: unknown chapters {unknown}; pick from {', '.join(CHAPTERS)}")
    start, results = time.time(), dict(machine=machine(), full=args.full, chapters={})
    m = results["machine"]
    print(
        f"{m['cores']} cores ({m['cpu']}), 1 thread per process, Python {m['python']}, "
        f"torch {m['torch']}",
        flush=True,
    )
    for name in only:
        began, out = time.time(), f"{args.json}.{name}.part"
        print(f"\n=== {name} ({began - start:.0f} s elapsed)", flush=True)
        cmd = [sys.executable, __file__, "--chapter", name, "--out", out]
        done = subprocess.run(cmd + (["--full"] if args.full else []), cwd=ROOT)
        if done.returncode == 0:
            with open(out) as f:
                results["chapters"][name] = json.load(f)
            os.remove(out)
            print(text_table(results["chapters"][name]), flush=True)
        else:
            results["chapters"][name] = {"error": f"exit {done.returncode}"}
            print(f"{name}: FAILED (exit {done.returncode}); the other chapters still run")
        results["chapters"][name]["seconds"] = time.time() - began
    results["seconds"] = time.time() - start
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(args.markdown, "w") as f:
        f.write(markdown(results) + "\n")
    print(f"\nwrote {args.json} and {args.markdown} ({results['seconds']:.0f} s)")
    failed = [n for n, r in results["chapters"].items() if "error" in r]
    if args.full:
        for cmd in FULL_SCRIPTS:
            print(f"\n=== {' '.join(cmd[1:])}", flush=True)
            if subprocess.run(cmd, cwd=ROOT).returncode:
                failed.append(" ".join(cmd[1:]))
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
