"""What agreeing across ranks on every call costs compose's training step, against agreeing once.

cp_compress.agree_inputs used to hash every weight and run an all_gather_object on every call of
context_parallel (compose calls it once per sequence row, in every attention layer, forward and
recomputation), and mhc.agree_pipeline_step ran one on every step. Both now agree when a model or
layer first runs on a group, or its settings change on any rank, and otherwise compare one digest
(launch.agree_when_changed: one all_reduce of three numbers). This
times compose's step both ways, interleaved in one run, at 1x2x1 (CP) and 2x1x1 (the pipeline):

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/bench_agreement.py [--steps 4]

"every call" is today's code with each agreement forgotten before each check (mhc's initial
parameters are still compared only on the first step, as before). The first step of each run
agrees both ways and is not timed; the time is the slowest rank's median step.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # appended: a graded submission earlier on the path stays first
    sys.path.append(ROOT)
import compose  # noqa: E402
import cp_compress  # noqa: E402
import launch  # noqa: E402
import mhc  # noqa: E402


@contextlib.contextmanager
def agreeing_every_call():
    """The old path: each check forgets what was agreed, so every call compares across ranks."""
    agree_inputs, check_step = cp_compress.agree_inputs, mhc.agree_pipeline_step

    def agree_inputs_every_call(layer, *args, **kwargs):
        launch._AGREED.pop(layer, None)  # weights' digests and all, as every call did
        return agree_inputs(layer, *args, **kwargs)

    def check_step_every_step(model, *args):
        agreed = launch._AGREED.get(model, {})
        for key in agreed:  # settings forgotten; the mark that the parameters were compared stays
            agreed[key] = None
        return check_step(model, *args)

    cp_compress.agree_inputs, mhc.agree_pipeline_step = (
        agree_inputs_every_call,
        check_step_every_step,
    )
    try:
        yield
    finally:
        cp_compress.agree_inputs, mhc.agree_pipeline_step = agree_inputs, check_step


@contextlib.contextmanager
def measuring_checks(counts, spent):
    """Count launch.agree's calls and time the two checks, into the last entry of each list."""
    agree, agree_inputs, check_step = (
        launch.agree,
        cp_compress.agree_inputs,
        mhc.agree_pipeline_step,
    )

    def counted(*args, **kwargs):
        counts[-1] += 1
        return agree(*args, **kwargs)

    def timed(check):
        def call(*args, **kwargs):
            began = time.perf_counter()
            try:
                return check(*args, **kwargs)
            finally:
                spent[-1] += time.perf_counter() - began

        return call

    launch.agree = counted
    cp_compress.agree_inputs, mhc.agree_pipeline_step = timed(agree_inputs), timed(check_step)
    try:
        yield
    finally:
        launch.agree = agree
        cp_compress.agree_inputs, mhc.agree_pipeline_step = agree_inputs, check_step


def step_times(layout, steps, every_call):
    """compose's steps on the layout, each after the first: (seconds per step, seconds in the
    checks per step), the slowest rank's, and the agreements per step."""
    cfg, train = compose.ComposeConfig(), compose.Training(steps)
    seconds, counts, spent = [], [0], [0.0]  # counts, spent: the set-up's, then each step's

    def on_step(step, layout_, model, opt, run):
        counts.append(0)
        spent.append(0.0)
        dist.barrier()
        began = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - began)
        return out

    with agreeing_every_call() if every_call else contextlib.nullcontext():
        with measuring_checks(counts, spent):
            compose.run_layout(cfg, train, *layout, on_step=on_step)
    slowest = torch.tensor([seconds[1:], spent[2:]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return *slowest.tolist(), counts[2:]


def demo(args, rank, world, device):
    launch.say(
        f"compose's step on {world} ranks: the slowest rank's median over {args.steps - 1} steps "
        f"x {args.repeats} runs each way, interleaved; checks = time inside agree_inputs and "
        "agree_pipeline_step"
    )
    columns = ("layout", 7), ("agreements/step", 16), ("checks ms/step", 15)
    columns += ("step ms: every call", 20), ("once", 6), ("ratio", 6)
    launch.say(" ".join(f"{name:>{width}}" for name, width in columns))
    for layout in ((1, 2, 1), (2, 1, 1)):
        steps, checks, agreements = {True: [], False: []}, {True: [], False: []}, {}
        for _ in range(args.repeats):
            for every_call in (True, False):
                seconds, spent, counts = step_times(layout, args.steps, every_call)
                steps[every_call] += seconds
                checks[every_call] += spent
                agreements[every_call] = max(counts)
        old, new = (1e3 * statistics.median(steps[k]) for k in (True, False))
        spent = " -> ".join(f"{1e3 * statistics.median(checks[k]):.0f}" for k in (True, False))
        name, counts = "x".join(map(str, layout)), f"{agreements[True]} -> {agreements[False]}"
        launch.say(f"{name:>7} {counts:>16} {spent:>15} {old:>20.0f} {new:>6.0f} {old / new:>6.2f}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=launch.at_least(2), default=4, help="steps per run (4)")
    parser.add_argument("--repeats", type=launch.at_least(1), default=2, help="runs each way (2)")
    args = launch.check_launch_options(parser, launch.add_launch_options(parser).parse_args(argv))
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        parser.error("run on 2 ranks: torchrun --nproc_per_node=2 benchmarks/bench_agreement.py")
    return args


if __name__ == "__main__":
    launch.run(demo, parse_args())
