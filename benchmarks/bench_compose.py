"""compose.py measured against its budget: what each rank holds at the peak and sends per link.

    torchrun --nproc_per_node=4 benchmarks/bench_compose.py --pp 2 --cp 2 --dp 1
    torchrun --nproc_per_node=4 benchmarks/bench_compose.py --steps 3 --json out.json  # records
    python benchmarks/bench_compose.py --help

compose.run_layout trains the layout; the first --record steps run under memory_timeline's
recorder (this stage's parameters, gradients, optimizer state, activations; recorded steps are
not timed), and every step's collectives are counted where they are called (count_sent_bytes).
Before any work compose_budget.check_layout_fits refuses a layout whose predicted peak cannot fit
this machine; then rank 0 prints compose_budget's table of every layout of the world, runs, and
prints measured / predicted per rank. --json writes every rank's record (and each recorded timeline
beside it, for notebook 05). Every option of compose.py (--check, --save, --resume, --v4,
--float64 ...) works here too.
"""

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's files, before any other on the path
import compose  # noqa: E402
import launch  # noqa: E402
import mhc  # noqa: E402
from layouts import compose_budget  # noqa: E402
from memory.memory_timeline import MemoryTimeline  # noqa: E402

LINKS = (*compose_budget.SENT, "control")


@contextlib.contextmanager
def count_sent_bytes(sent, where):
    """Count, where each call is made, the bytes this rank sends, into sent {link: bytes}; where()
    names the phase ("forward": the pipeline's CP traffic, "optimizer": MuonZeRO's), as the CP
    and stage groups can be one group. StageLinks counts the pipeline's sends itself. A collective
    of n ranks sends what leaves this rank: all-gather (n-1) x its input, reduce-scatter and
    all-to-all (n-1)/n of it, all-reduce 2 (n-1)/n (a ring). Guard traffic and the loss: control."""
    names = (
        "batch_isend_irecv",
        "all_gather_single",
        "reduce_scatter_single",
        "all_to_all_single",
        "all_reduce",
    )
    originals = {n: getattr(dist, n) for n in names}
    links = {
        ("forward", "batch_isend_irecv"): "cp_halo",
        ("forward", "all_gather_single"): "cp_gather",
        ("forward", "reduce_scatter_single"): "cp_gather",
        ("optimizer", "all_gather_single"): "param_all_gather",
        ("optimizer", "all_to_all_single"): "grad_reduce_scatter",
        ("optimizer", "all_reduce"): "grad_reduce_scatter",
    }

    def wrap(name, fn):
        def call(*args, **kwargs):
            if name == "batch_isend_irecv":
                tensors = [op.tensor for op in args[0] if op.op is dist.isend]
                share = 1.0  # point to point: what it sends
            else:
                tensors = [args[1] if "single" in name else args[0]]
                n = dist.get_world_size(kwargs.get("group"))
                share = {"all_gather_single": n - 1, "all_reduce": 2 * (n - 1) / n}.get(
                    name, (n - 1) / n
                )
            small = name == "all_reduce" and not (
                args[0].is_floating_point() and args[0].numel() > 1
            )
            link = "control" if small else links.get((where(), name), "control")
            for t in tensors:
                sent[link] = sent.get(link, 0) + int(t.numel() * t.element_size() * share)
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield sent
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class StepRecorder:
    """on_step for compose.run_layout: the first `record` steps it runs (after a resume, too)
    under memory_timeline's recorder (peaks, categories), the others timed; every step's sent
    bytes counted per link."""

    def __init__(self, record, device):
        self.record, self.device = record, device
        self.timeline, self.step_s, self.sent = None, [], []

    def __call__(self, step, layout, model, opt, run):
        sent, where = {}, ["control"]

        @contextlib.contextmanager
        def phase(name):  # what the meter is counting, and the recorder's phase
            where[0] = name
            with self.timeline.phase(name, ran + 1) if recording else contextlib.nullcontext():
                yield
            where[0] = "control"

        ran = len(self.step_s)  # steps this run has taken: a resumed run starts at its own 1
        recording = ran < self.record
        if recording and self.timeline is None:  # this stage's weights; others' not counted
            held, _ = compose.stage_parameters(model, layout)
            self.timeline = MemoryTimeline(held, opt, self.device)
            self.recording = self.timeline.record()
            self.recording.__enter__()
        with count_sent_bytes(sent, lambda: where[0]):
            began = mhc.clock(self.device)
            out = run(phase)
            took = mhc.clock(self.device) - began
        self.step_s.append(None if recording else took)  # the recorder runs Python per op
        if recording:
            self.timeline.tag(opt.local_state_tensors(), "optimizer_state")  # momenta too
            if ran + 1 == self.record:
                self.recording.__exit__(None, None, None)
        stats = out[1]  # StageLinks counts the pipeline's sends itself
        sent["pp_send"] = stats.bytes_sent_forward + stats.bytes_sent_backward
        self.sent.append(sent)
        return out

    def summary(self, rank, coords, losses):
        tl, steps = self.timeline, range(1, self.record + 1)
        held = {}
        if tl is not None:
            busy = tl.series("activations") + tl.series("temporaries")
            held = {
                "parameters": tl.peak("parameters"),
                "gradients": tl.peak("gradients"),
                "optimizer": tl.peak("optimizer_state"),
                "activations": max(int(busy[a:b].max()) for a, b in tl.window(phase="forward")),
            }
        return {
            "rank": rank,
            "coords": list(coords),
            "losses": losses,
            "step_s": self.step_s,
            "peak_bytes": [tl.peak(step=s) for s in steps] if tl is not None else [],
            "held_bytes": held,
            "sent_bytes": {k: self.sent[-1].get(k, 0) for k in LINKS},
        }


def parse_args(argv=None):
    """compose's options and the benchmark's, checked at the door: a --json folder that is
    missing, and a layout whose predicted peak cannot fit (compose_budget.check_layout_fits)."""
    parser = argparse.ArgumentParser(
        description="compose.py on the layout --pp x --cp x --dp of the torchrun ranks, its "
        "memory and bytes per link measured against compose_budget's prediction."
    )
    add = parser.add_argument
    add("--record", type=launch.at_least(0), default=2, help="first steps recorded, not timed (2)")
    add("--json", metavar="PATH", help="write every rank's record here (rank 0)")
    add("--device-memory", type=launch.positive, default=80.0, help="GiB per device (80)")
    add("--intra-bw", type=launch.positive, default=100.0, help="GB/s within a node (100)")
    add("--inter-bw", type=launch.positive, default=25.0, help="GB/s between nodes (25)")
    args = compose.parse_args(argv, parser)
    folder = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    if args.json and (not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
        parser.error(f"--json {args.json}: the folder {folder} is missing or not writable")
    args.device_bytes = int(args.device_memory * 2**30)
    args.intra_bw, args.inter_bw = args.intra_bw * 1e9, args.inter_bw * 1e9  # bytes per second
    compose_budget.check_layout_fits(parser, args, int(os.environ.get("WORLD_SIZE", "1")))
    return args


def measured_table(records, predicted):
    """Measured / predicted per rank: MiB held at the peak by category, KiB sent per link."""
    lines = [
        "measured / predicted by the budget: MiB held at the peak, KiB sent per step",
        f"{'rank':>4} {'p,c,d':>6} {'peak':>13} "
        + " ".join(f"{k:>13}" for k in compose_budget.HELD)
        + "   "
        + " ".join(compose_budget.SENT),
    ]
    for r in records:
        held, want = r["held_bytes"], predicted.held[r["rank"]]

        def pair(got, bytes_, unit):
            return f"{got / unit:.1f}/{bytes_ / unit:.1f}"

        cells = " ".join(f"{pair(held.get(k, 0), want[k], 2**20):>13}" for k in compose_budget.HELD)
        sent = " ".join(
            pair(r["sent_bytes"][k], predicted.sent[r["rank"]][k], 2**10)
            for k in compose_budget.SENT
        )
        peak = pair(max(r["peak_bytes"], default=0), sum(want.values()), 2**20)
        lines.append(
            f"{r['rank']:>4} {','.join(map(str, r['coords'])):>6} {peak:>13} {cells}   {sent}"
        )
    return "\n".join(lines)


def main(args, rank, world, device):
    cfg, train = args.cfg, compose.training(args)
    launch.say(compose.describe(args, train))
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    grad_sync = "bf16_sr" if args.v4 else "exact"
    rows = compose_budget.budget_table(
        cfg, world, args.device_bytes, args.intra_bw, args.inter_bw, ranks_per_node, grad_sync
    )
    launch.say(compose_budget.format_budget(rows))
    recorder = StepRecorder(min(args.record, args.steps - args.start), device)
    saving = dict(save=args.save, save_every=args.save_every or 0, resume=args.resume)
    run = compose.run_layout(cfg, train, args.pp, args.cp, args.dp, device, recorder, **saving)
    losses, params, layout, *_ = run
    for ran, (loss, took) in enumerate(zip(losses, recorder.step_s)):
        when = "memory recorded (not timed)" if took is None else f"{1e3 * took:.0f} ms"
        launch.say(f"step {args.start + ran + 1}: loss {loss:.4f}, {when}")
    records = [None] * world if rank == 0 else None
    dist.gather_object(recorder.summary(rank, layout.coords, losses), records, dst=0)
    timelines = [None] * world if rank == 0 else None
    dist.gather_object(recorder.timeline, timelines, dst=0)
    predicted = next(row for row in rows if row.name == f"{args.pp}x{args.cp}x{args.dp}")
    launch.say("\n" + measured_table(records or [], predicted))
    if args.check:
        compose.compare_with_reference(cfg, args.dp, train, losses, params, rank, world)
    if rank == 0 and args.json:
        base = os.path.splitext(args.json)[0]
        for r, tl in zip(records, timelines):
            if tl is not None:
                r["timeline"] = f"{base}.rank{r['rank']}.timeline.pt"
                torch.save(tl, r["timeline"])
        layout_json = {"pp": args.pp, "cp": args.cp, "dp": args.dp}
        with open(args.json, "w") as f:
            json.dump({"layout": layout_json, "config": asdict(cfg), "ranks": records}, f)
        print(f"wrote {args.json}", flush=True)


if __name__ == "__main__":
    try:
        launch.run(main, parse_args())
    except (compose.Refused, launch.Stopped) as err:  # the same line on every rank
        raise SystemExit(str(err)) from None
