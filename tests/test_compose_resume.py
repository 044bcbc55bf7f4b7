"""compose.py saves at one layout and resumes at another, through torch.distributed.checkpoint.

The proof: 2 steps at 2x1x1 saved, then the 2 more steps to 4 at 1x1x2, on one process and at
2x1x1 again (the pipeline compares every rank's whole model on its first step), each
against the uninterrupted 4-step compose.reference_training (one process, none of the four
techniques, torch.optim.Muon + AdamW) in float64, at test_compose's tolerance for an uninterrupted
run: the parameters' change within 1e-6 of its norm (measured ~1.5e-12), the resumed steps' losses
within 1e-6 relative. The check can fail: a resume that drops the optimizer's state (momenta, AdamW
moments, step counts) is far outside it. Around it: a different model or setting refuses with one
line naming the field; a save killed half-way leaves the previous checkpoint the newest loadable
one; an incomplete step-<k>.tmp is never read; the resumed run's first line says what it resumed.
The slow tier (tests/conftest.py) saves at 4 ranks: the CLI at 2x2x1, resumed on one process with
--check, and 2x2x1 resumed at 1x1x4.
"""

import dataclasses
import os
import shutil

import pytest
import torch

import compose
from layouts import compose_checkpoint
from tools.spawn import RankFailure, run_ranks, run_torchrun

# CLI-expressible (--layers 4 --seq-len 128): every sublayer kind, whole HCA entries per document
CFG = compose.ComposeConfig(n_layers=4, seq_len=128)
FP64 = dict(grad_sync="exact", ns_dtype=torch.float64, dtype=torch.float64)
SAVED, TOTAL, TOL = 2, 4, 1e-6
CLI = ["--layers", "4", "--seq-len", "128", "--float64"]


def _train(rank, world, layout, steps, save=None, resume=None, save_every=0):
    train = compose.Training(steps, **FP64)
    saving = dict(save=save, resume=resume, save_every=save_every)
    losses, params, *_ = compose.run_layout(CFG, train, *layout, **saving)
    return losses, {n: p.clone() for n, p in params.items()}


def _resume_without_optimizer_state(rank, world, resume):
    """A resume that loads the parameters and the step but keeps a fresh optimizer."""
    from torch.distributed.checkpoint import state_dict

    state_dict.set_optimizer_state_dict = lambda *args, **kwargs: None
    return _train(rank, world, (1, 1, 1), TOTAL, resume=resume)


def _stopped_while_saving(rank, world, root, how):
    """Resume root's step 2 at 2x1x1 and save at step 3; rank 1 raises (or dies) in the save."""
    import torch.distributed.checkpoint as dcp

    save = dcp.save

    def failing(*args, **kwargs):
        if rank == 1 and how == "dies":
            os._exit(9)
        if rank == 1:
            raise OSError("no space left on device")
        return save(*args, **kwargs)

    dcp.save = failing
    return _train(rank, world, (2, 1, 1), SAVED + 1, save=root, resume=root)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """SAVED steps at 2x1x1, saved after each, into a folder that held an older checkpoint (step-0,
    gone once step-2 is saved) and also holds an incomplete save (step-9.tmp)."""
    root = str(tmp_path_factory.mktemp("compose_ckpt") / "run")
    os.makedirs(os.path.join(root, "step-0"))
    run_ranks(_train, 2, args=((2, 1, 1), SAVED, root, None, 1), timeout=240)
    os.makedirs(os.path.join(root, "step-9.tmp"))  # a save that never finished: never read
    with open(os.path.join(root, "step-9.tmp", "compose.json"), "w") as f:
        f.write("{not json")
    return root


@pytest.fixture(scope="module")
def reference():
    losses, params = compose.reference_training(CFG, 1, compose.Training(TOTAL, **FP64))
    start = dict(compose.make_model(CFG).to(dtype=torch.float64).named_parameters())
    return losses, params, start


def errors(results, reference):
    """-> (relative loss error of the resumed steps, parameter-change error) over every rank."""
    ref_losses, ref, start = reference
    got = {n: t for _, params in results for n, t in params.items()}
    trained = [n for n, p in start.items() if p.requires_grad]
    assert not set(trained) - set(got), f"no rank holds {sorted(set(trained) - set(got))}"
    num = sum(((got[n] - ref[n]) ** 2).sum() for n in trained)
    den = sum(((ref[n] - start[n].detach()) ** 2).sum() for n in trained)
    loss = max(
        abs(a - b) / abs(b) for losses, _ in results for a, b in zip(losses, ref_losses[SAVED:])
    )
    return loss, (num / den).sqrt().item()


@pytest.mark.parametrize("layout", [(1, 1, 2), (1, 1, 1), (2, 1, 1)],
                         ids=["1x1x2", "one_process", "2x1x1"])  # fmt: skip
def test_resumed_run_equals_the_uninterrupted_reference(saved, reference, layout):
    world = layout[0] * layout[1] * layout[2]
    results = run_ranks(_train, world, args=(layout, TOTAL, None, saved), timeout=240)
    assert all(len(losses) == TOTAL - SAVED for losses, _ in results), (
        f"saved at step {SAVED}, a resume to {TOTAL} must take {TOTAL - SAVED} steps: "
        f"{[losses for losses, _ in results]}"
    )
    loss_err, param_err = errors(results, reference)
    assert param_err < TOL, (
        f"saved at 2x1x1, resumed at {layout}: the parameters are {param_err:.2e} of their change "
        f"from the uninterrupted 4-step reference (float64)"
    )
    assert loss_err < TOL, f"resumed at {layout}: the losses of steps 3-4 are {loss_err:.2e} off"


def test_a_resume_without_the_optimizer_state_fails_the_check(saved, reference):
    results = run_ranks(_resume_without_optimizer_state, 1, args=(saved,), timeout=240)
    _, param_err = errors(results, reference)
    assert param_err > 100 * TOL, (
        f"a resume with a fresh optimizer passes as {param_err:.2e}: the check is blind"
    )


@pytest.mark.parametrize("how", ["raises", pytest.param("dies", marks=pytest.mark.slow)])
def test_a_save_stopped_half_way_leaves_the_previous_checkpoint(saved, tmp_path, how):
    """A rank that raises in its save (every rank stops) or dies there (its peer waits out the
    process-group timeout: the slow tier): step-3.tmp stays incomplete, step-2 the newest."""
    root = str(tmp_path / "run")
    shutil.copytree(saved, root)
    with pytest.raises(RankFailure):
        run_ranks(_stopped_while_saving, 2, args=(root, how), timeout=20)
    assert f"step-{SAVED + 1}.tmp" in os.listdir(root), "the stopped save never began"
    step, path, record = compose_checkpoint.latest_checkpoint(root)
    assert (step, record["step"]) == (SAVED, SAVED), (
        f"after a save stopped at step {SAVED + 1}, the newest complete checkpoint is {path}"
    )
    results = run_ranks(_train, 1, args=((1, 1, 1), SAVED + 1, None, root), timeout=120)
    assert len(results[0][0]) == 1, "the previous checkpoint did not resume"


def test_a_different_model_or_setting_refuses_naming_the_field(saved, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cases = [
        (["--layers", "8", "--seq-len", "128", "--float64"], "n_layers=4"),
        (["--layers", "4", "--seq-len", "256", "--float64"], "seq_len=128"),
        (["--layers", "4", "--seq-len", "128"], "dtype='torch.float64'"),
        (CLI + ["--seed", "1"], "seed=0"),
        (CLI + ["--steps", "2"], "at step 2 already"),
    ]
    for argv, said in cases:
        with pytest.raises(SystemExit):
            compose.parse_args(argv + ["--resume", saved])
        err = capsys.readouterr().err.strip().splitlines()
        assert said in err[-1] and "error:" in err[-1], f"{argv}: {err[-1]!r} does not name {said}"
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        compose.parse_args(CLI + ["--dp", "3", "--resume", saved])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "global batch of 4 sequences does not split over dp=3" in err, err


def test_the_first_line_says_what_was_resumed(saved, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = compose.parse_args(CLI + ["--dp", "2", "--resume", saved])
    assert (args.start, args.cfg.batch, args.cfg.n_micro) == (SAVED, 2, 2), vars(args)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "resumed step 2 saved at 2x1x1, now 1x1x2", out
    with pytest.raises(ValueError, match="no complete checkpoint"):
        compose_checkpoint.latest_checkpoint(os.path.join(saved, "step-9.tmp"))


DAMAGE = {  # how a checkpoint is damaged (a lost file, a cut copy, a full disk) -> what is said
    "no compose.json": "compose.json is missing",
    "cut compose.json": "compose.json is damaged",
    "no .metadata": ".metadata is missing",
    "a rank's file missing": "__1_0.distcp is missing",
    "a truncated shard": "__1_0.distcp is truncated",
}


def _damage(path, kind):
    shard = os.path.join(path, "__1_0.distcp")
    if kind == "no compose.json":
        os.remove(os.path.join(path, "compose.json"))
    elif kind == "cut compose.json":
        with open(os.path.join(path, "compose.json"), "r+") as f:
            f.truncate(10)
    elif kind == "no .metadata":
        os.remove(os.path.join(path, ".metadata"))
    elif kind == "a rank's file missing":
        os.remove(shard)
    elif kind == "a truncated shard":
        os.truncate(shard, os.path.getsize(shard) // 2)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_names_the_file_and_the_previous_one(saved, tmp_path, kind):
    """A damaged newest checkpoint is one line at the door naming the file and the complete
    previous checkpoint (kept beside it by the save), which --resume then takes by name."""
    root = str(tmp_path / "run")
    shutil.copytree(saved, root)
    _damage(os.path.join(root, f"step-{SAVED}"), kind)
    with pytest.raises(ValueError) as info:
        compose_checkpoint.latest_checkpoint(root)
    said, previous = str(info.value), os.path.join(root, f"step-{SAVED - 1}")
    assert DAMAGE[kind] in said, f"{kind}: the error does not say {DAMAGE[kind]!r}: {said}"
    assert f"--resume {previous}" in said, (
        f"{kind}: the error does not offer the previous checkpoint: {said}; the folder holds "
        f"{sorted(os.listdir(root))} (a save keeps the previous one and removes the older)"
    )
    assert "step-0" not in os.listdir(root), "a save kept a checkpoint older than the previous"
    step, path, record = compose_checkpoint.latest_checkpoint(previous)
    assert (step, path, record["step"]) == (SAVED - 1, previous, SAVED - 1)


def test_the_cli_refuses_a_damaged_checkpoint_in_one_line(saved, tmp_path, capsys, monkeypatch):
    root = str(tmp_path / "run")
    shutil.copytree(saved, root)
    os.remove(os.path.join(root, f"step-{SAVED}", ".metadata"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        compose.parse_args(CLI + ["--resume", root])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --resume:" in err and ".metadata is missing" in err, err


@pytest.mark.slow
def test_a_shard_read_back_wrong_names_the_checkpoint(saved, tmp_path):
    """A shard whose bytes changed but not its length passes the door and fails in dcp.load: every
    rank says which checkpoint could not be read and which one to resume instead."""
    root = str(tmp_path / "run")
    shutil.copytree(saved, root)
    shard = os.path.join(root, f"step-{SAVED}", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.write(b"\0" * os.path.getsize(shard))
    with pytest.raises(RankFailure) as info:
        run_ranks(_train, 1, args=((1, 1, 1), SAVED + 1, None, root), timeout=120)
    text = info.value.errors[0]
    assert f"step-{SAVED} could not be read" in text, text
    assert f"--resume {os.path.join(root, f'step-{SAVED - 1}')}" in text, text


@pytest.mark.slow
def test_cli_saves_at_four_ranks_and_resumes_on_one_with_check(tmp_path):
    """torchrun at 2x2x1 --save, then `python compose.py --resume --check` on one process."""
    root = str(tmp_path / "run")
    run_torchrun("compose.py", 4, CLI + ["--pp", "2", "--cp", "2", "--steps", "2", "--save", root])
    out = run_torchrun("compose.py", 1, CLI + ["--steps", "4", "--resume", root, "--check"]).stdout
    assert out.splitlines()[0] == "resumed step 2 saved at 2x2x1, now 1x1x1", out
    change = float(out.split("their change within ")[1].split()[0])
    assert change < TOL, f"resumed on one process: {change:.2e} of the change off (float64)"


@pytest.mark.slow
def test_saved_at_2x2x1_resumed_at_1x1x4(tmp_path, reference):
    root = str(tmp_path / "run")
    run_ranks(_train, 4, args=((2, 2, 1), SAVED, root), timeout=300)
    results = run_ranks(_train, 4, args=((1, 1, 4), TOTAL, None, root), timeout=300)
    _, param_err = errors(results, reference)
    assert param_err < TOL, f"2x2x1 -> 1x1x4: {param_err:.2e} of the change off (float64)"


def test_grad_sync_is_spelled_exact_and_a_checkpoint_saved_as_fp32_resumes():
    train = compose.Training(4)
    assert train.grad_sync == "exact", f"Training defaults to {train.grad_sync!r}, not 'exact'"
    fields = {
        k: compose_checkpoint._setting(getattr(train, k)) for k in compose_checkpoint.RESUMED_FIELDS
    }
    saved = dict(step=1, global_batch=CFG.batch, config=dataclasses.asdict(CFG))
    saved["training"] = {**fields, "grad_sync": "fp32"}  # the old name, in an older checkpoint
    assert compose_checkpoint.resume_config(saved, CFG, train, 1, 1, 1)[1] == 1
    saved["training"]["grad_sync"] = "bf16_sr"
    with pytest.raises(ValueError, match="grad_sync='bf16_sr'"):
        compose_checkpoint.resume_config(saved, CFG, train, 1, 1, 1)
