"""The one-GPU check: what a CPU cannot prove, run on a machine with one CUDA GPU in under 7 min.

    python tools/gpu_check.py            # make gpu-check: needs a GPU, else says so in one line
    python tools/gpu_check.py --dry-run  # print the plan's commands, run nothing
    python tools/gpu_check.py --cpu      # run the same plan on the CPU at tiny sizes

Checks, each with its own timeout inside one overall budget (cheapest and most telling first):
  (a) each technique file under torchrun at N=1 with --backend nccl --device cuda;
  (c) the CUDA memory timeline of notebook 00's run (the small GPT trained with AdamW) recorded by
      memory_timeline's MemoryTimeline on cuda, measured memory_reserved beside the modelled line,
      saved as a PNG, with the predicted and measured step-2 jump;
  (d) benchmarks/bench_mhc.py --curve --device cuda;
  (b) each file at N=2, 3, 4 with --backend gloo --device cuda (the ranks share the GPU), run under
      the NCCL-rules recorder, and (e) each of those logs replayed under NCCL's rules with
      --device cuda (a CPU tensor handed to a collective is reported).
Writes build/gpu_check/summary.md (per check: pass/fail, seconds, the last line of a failure) and
each check's full output under build/gpu_check/logs/.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)
sys.path.append(ROOT)  # the files at the root; appended, so a graded submission stays first
import nccl_rules  # noqa: E402

TECHNIQUES = ("muon_zero.py", "mhc.py", "cp_compress.py", "tensor_ckpt.py")
BUDGET_S = 400  # 7 minutes, less the time to start and to write the summary
OUT = os.path.join(ROOT, "build", "gpu_check")


@dataclass
class Check:
    name: str
    cmd: list
    timeout_s: float
    replay: str = None  # a recorded log folder to replay after the run, for check (e)


def torchrun(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *args]


def plan(device):
    """The checks, in the order they run; ``device`` is cuda, or cpu for --cpu."""
    backend_one = "nccl" if device == "cuda" else "gloo"
    checks = []
    for name in TECHNIQUES:
        args = ["--backend", backend_one, "--device", device, *nccl_rules.demo_args(name)]
        checks.append(Check(f"(a) {name} N=1 {backend_one}/{device}", torchrun(1, name, *args), 90))
    png = os.path.join(OUT, f"timeline_{device}.png")
    timeline = [sys.executable, os.path.abspath(__file__), "--timeline", png, "--device", device]
    checks.append(Check(f"(c) memory timeline of notebook 00's run on {device}", timeline, 120))
    bench = [sys.executable, "benchmarks/bench_mhc.py", "--curve", "--device", device]
    checks.append(Check(f"(d) bench_mhc.py --curve on {device}", bench, 150))
    for name in TECHNIQUES:
        for n in (2, 3, 4):
            log = os.path.join(OUT, "nccl", f"{name[:-3]}-{n}")
            args = ["--backend", "gloo", "--device", device, *nccl_rules.demo_args(name)]
            record = ["tools/nccl_rules.py", "record", "--out", log, "--", name, *args]
            label = f"(b, e) {name} N={n} gloo/{device}, replayed by NCCL's rules"
            checks.append(Check(label, torchrun(n, *record), 90, replay=log))
    return checks


def run_check(check, deadline, device):
    """Run one check within its timeout and the overall deadline; return (ok, seconds, note)."""
    left = deadline - time.monotonic()
    if left < 15:
        return None, 0.0, "skipped: the overall time budget is spent"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    try:
        proc = subprocess.run(
            check.cmd, cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=min(check.timeout_s, left), start_new_session=True,
        )  # fmt: skip
        output, ok = proc.stdout + proc.stderr, proc.returncode == 0
        note = "" if ok else f"exit {proc.returncode}: {_last_line(output)}"
    except subprocess.TimeoutExpired as error:
        output, ok = _text(error.stdout) + _text(error.stderr), False
        note = f"timed out after {time.monotonic() - start:.0f} s"
    if ok and check.replay:
        problems = nccl_rules.replay(nccl_rules.load(check.replay), device=device)
        output += "\nNCCL-rules replay:\n" + ("\n".join(problems) or "no problems found")
        ok, note = not problems, (problems[0].splitlines()[0] if problems else "")
    seconds = time.monotonic() - start
    os.makedirs(os.path.join(OUT, "logs"), exist_ok=True)
    log = "".join(c if c.isalnum() else "_" for c in check.name).strip("_") + ".txt"
    with open(os.path.join(OUT, "logs", log), "w") as f:
        f.write(f"$ {shlex.join(check.cmd)}\n{output}")
    return ok, seconds, note


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _last_line(output):
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


def timeline(png, device):
    """(c): notebook 00's run recorded on ``device``; measured reserved beside the modelled line."""
    import matplotlib

    matplotlib.use("Agg")
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import memory.memory_timeline as mt
    import memory.plots as mt_plots

    class PlainLayer(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
            q, k, v = qkv.transpose(1, 3).unbind(2)  # each (b, heads, t, d/heads)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    torch.manual_seed(0)
    vocab, d, seq, batch = 4096, 128, 128, (16 if device == "cuda" else 2)
    embed = nn.Embedding(vocab, d)
    layers = (PlainLayer(d, 4), PlainLayer(d, 4))
    model = nn.Sequential(embed, *layers, nn.LayerNorm(d), nn.Linear(d, vocab))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    predict = getattr(mt, "predicted_optimizer_state_bytes", None)
    predicted = predict(opt, torch.device(device)) if predict else None
    tl = mt.MemoryTimeline(model, opt, name=f"notebook 00's run, AdamW on {device}")
    with tl.record():
        for step in range(1, 4):
            with tl.phase("forward", step):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            with tl.phase("backward", step):
                loss.backward()
            with tl.phase("optimizer", step):
                opt.step()
                opt.zero_grad(set_to_none=True)
    peaks = [tl.peak(step=s) for s in (1, 2, 3)]
    print("peak allocated per step (MiB):", " ".join(f"{p / 2**20:.3f}" for p in peaks))
    if predicted is not None:
        print(f"step-2 jump: predicted {predicted:,} B, measured {peaks[1] - peaks[0]:,} B")
    reserved = getattr(tl, "cuda_reserved", None)
    if reserved is not None:
        print(f"measured memory_reserved peak: {reserved.max() / 2**20:.3f} MiB")
    ax = mt_plots.plot_timeline(tl, show_reserved=True)
    ax.figure.tight_layout()
    os.makedirs(os.path.dirname(png), exist_ok=True)
    ax.figure.savefig(png, dpi=120)
    print(f"plot saved to {os.path.relpath(png, ROOT)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--cpu", action="store_true", help="run the plan on the CPU (no GPU)")
    parser.add_argument("--timeline", metavar="PNG", help=argparse.SUPPRESS)  # check (c) itself
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.timeline:
        timeline(args.timeline, args.device)
        return 0
    device = "cpu" if args.cpu else "cuda"
    checks = plan(device)
    if args.dry_run:
        for check in checks:
            print(f"# {check.name} (timeout {check.timeout_s:.0f} s)")
            print(shlex.join(check.cmd))
        return 0
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU is visible here; nothing to check (--dry-run shows the plan)")
        return 0
    deadline, rows, start = time.monotonic() + BUDGET_S, [], time.monotonic()
    for check in checks:
        ok, seconds, note = run_check(check, deadline, device)
        verdict = {True: "pass", False: "FAIL", None: "skipped"}[ok]
        print(f"{verdict:<7} {seconds:6.1f} s  {check.name}  {note}", flush=True)
        rows.append((check.name, verdict, seconds, note))
    total = time.monotonic() - start
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (--cpu run)"
    lines = [
        "# One-GPU check",
        "",
        f"GPU: {gpu}; torch {torch.__version__}; {total:.0f} s in all (budget {BUDGET_S} s).",
        "",
        "| check | result | seconds | note |",
        "|---|---|---:|---|",
        *(f"| {n} | {v} | {s:.1f} | {note.replace('|', '/')} |" for n, v, s, note in rows),
    ]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    failed = sum(v != "pass" for _, v, _, _ in rows)
    print(f"\n{len(rows) - failed} of {len(rows)} checks passed in {total:.0f} s; ", end="")
    print(f"summary in {os.path.relpath(os.path.join(OUT, 'summary.md'), ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
