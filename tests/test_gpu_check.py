"""The one-GPU check's plan and its behaviour without a GPU (it cannot run here: CUDA is hidden)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_check  # noqa: E402


def test_plan_covers_every_item_within_the_budget():
    checks = gpu_check.plan("cuda")
    names = [c.name for c in checks]
    assert sum(n.startswith("(a)") for n in names) == len(gpu_check.TECHNIQUES)
    assert sum(n.startswith("(b, e)") for n in names) == 3 * len(gpu_check.TECHNIQUES)
    assert any(n.startswith("(c)") for n in names) and any(n.startswith("(d)") for n in names)
    assert all(c.replay for c in checks if c.name.startswith("(b, e)"))
    for c in checks:
        command = " ".join(c.cmd)
        assert "--device cuda" in command
        if c.name.startswith("(a)"):
            assert "--nproc_per_node=1" in command and "--backend nccl" in command
        if c.name.startswith("(b, e)"):
            assert "--backend gloo" in command and "nccl_rules.py record" in command
    assert gpu_check.BUDGET_S <= 420  # 7 minutes, all checks together


def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA GPU" in out[0]


def test_dry_run_prints_each_command(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("torch.distributed.run") == 4 + 12 and "bench_mhc.py --curve" in out
