"""compose.py's checkpoints: saved at one layout pp x cp x dp, resumed at any other.

What the standard tool assumes. torch.distributed.checkpoint (dcp) saves what each rank holds and
loads it into whatever the new ranks hold, as long as every tensor is named the same everywhere.

What compose needs on top. A stage's modules are named by the stage ("layer3"), MuonZeRO keeps
each matrix's momentum on one owner, batch_tokens draws step k's rows from (seed, k) alone, and
a run must not mistake a half-written folder, or another model, for its checkpoint.

The fix, torchtitan's recipe: every rank hands dcp.save its stage's parameters under the model's
own names ("sublayers.3.w_up") and MuonZeRO's state through get_optimizer_state_dict; beside them,
compose.json: the step (the data position), the layout, the global batch and the settings a
resume must match. DIR/step-<k> is written as step-<k>.tmp and renamed by rank 0 once every rank
has written its share, so it is complete or absent. compose.run_layout calls resume_from,
load_checkpoint and save_checkpoint; nothing here imports compose.
"""

import json
import os
import shutil
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

RESUMED_FIELDS = ("seed", "dtype", "grad_sync", "ns_dtype", "lr_muon", "lr_adamw", "weight_decay")


def dcp():
    """torch.distributed.checkpoint and its state_dict helpers, imported on first use: a second of
    import every rank that never saves or resumes is spared. -> (dcp, state_dict, options)."""
    import torch.distributed.checkpoint as checkpoint
    import torch.distributed.checkpoint.state_dict as state

    options = state.StateDictOptions(flatten_optimizer_state_dict=True)  # groups keyed by name
    return checkpoint, state, options


def latest_checkpoint(root):
    """-> (step, path, compose.json's record) of the newest complete checkpoint in root, or
    ValueError. A step-<k>.tmp (a save that did not finish) is never read."""
    steps = (
        [int(n[5:]) for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit()]
        if os.path.isdir(root)
        else []
    )
    if not steps:
        raise ValueError(f"--resume {root}: no complete checkpoint (a step-<k> folder) there")
    path = os.path.join(root, f"step-{max(steps)}")
    with open(os.path.join(path, "compose.json")) as f:
        return max(steps), path, json.load(f)


def _setting(value):
    return str(value) if isinstance(value, torch.dtype) else value


def resume_config(saved, cfg, train, pp, cp, dp):
    """The configuration that continues `saved` (compose.json) on pp x cp x dp: the model's fields
    and train's settings must match (ValueError naming the first that differs); the global batch
    stays the checkpoint's, each of the dp replicas taking its share. -> (cfg, start step)."""
    mine = {**asdict(cfg), **{k: _setting(getattr(train, k)) for k in RESUMED_FIELDS}}
    theirs = {**saved["config"], **saved["training"]}
    for field, value in mine.items():
        if field not in ("batch", "n_micro") and theirs.get(field) != value:
            raise ValueError(
                f"--resume: the checkpoint has {field}={theirs.get(field)!r}, this run "
                f"{value!r}; resume with the model and settings it was saved with"
            )
    rows, step = saved["global_batch"], saved["step"]
    if rows % dp:
        raise ValueError(
            f"--resume: the checkpoint's global batch of {rows} sequences does not split over "
            f"dp={dp} replicas"
        )
    batch = rows // dp
    micro = [m for m in range(min(cfg.n_micro, batch), 0, -1) if batch % m == 0 and m >= pp]
    if not micro:
        raise ValueError(
            f"--resume: {batch} sequences per replica cannot fill pp={pp} stages' micro-batches "
            f"(1F1B needs at least pp)"
        )
    if step >= train.steps:
        raise ValueError(
            f"--resume: the checkpoint is at step {step} already; --steps {train.steps} asks "
            f"for no more"
        )
    return replace(cfg, batch=batch, n_micro=micro[0]), step


def resume_from(root, cfg, train, pp, cp, dp):
    """The newest checkpoint in root, and the configuration that continues it on pp x cp x dp.
    -> (start step, its path, cfg, the layout it was saved at), or ValueError."""
    _, path, saved = latest_checkpoint(root)
    cfg, start = resume_config(saved, cfg, train, pp, cp, dp)
    return start, path, cfg, tuple(saved["layout"])


def checkpoint_state(model, held, opt, whole=False):
    """What dcp.save writes from this rank and dcp.load fills: the stage's parameters (held, the
    stage's modules; whole: every parameter, as every rank builds the whole model and the pipeline
    compares it) under the model's names, MuonZeRO's state (a collective: on a fresh optimizer
    torch takes one empty step), torch's generator."""
    _, state, options = dcp()
    names = {id(p): n for n, p in model.named_parameters()}
    params = model.parameters() if whole else held.parameters()
    return {
        "model": {names[id(p)]: p.detach() for p in params},
        "optim": state.get_optimizer_state_dict(model, opt, options=options),
        "rng": torch.get_rng_state(),
    }


def save_checkpoint(root, step, model, held, opt, cfg, train, layout):
    """DIR/step-<step>, complete or absent; the older ones are removed once it is visible."""
    rank, final = dist.get_rank(), os.path.join(root, f"step-{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier save that stopped half-way
        os.makedirs(tmp)
        record = dict(
            step=step,
            layout=[layout.pp, layout.cp, layout.dp],
            config=asdict(cfg),
            global_batch=cfg.batch * layout.dp,
            training={k: _setting(getattr(train, k)) for k in RESUMED_FIELDS},
        )
        with open(os.path.join(tmp, "compose.json"), "w") as f:
            json.dump(record, f)
    dist.barrier()
    dcp()[0].save(checkpoint_state(model, held, opt), checkpoint_id=tmp)
    dist.barrier()  # every rank's share is on disk
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for name in os.listdir(root):
            if name.startswith("step-") and name[5:].isdigit() and int(name[5:]) != step:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()


def load_checkpoint(path, model, held, opt):
    """Fill this rank's stage and optimizer from the checkpoint at path, whatever its layout."""
    checkpoint, state_dict, options = dcp()
    state = checkpoint_state(model, held, opt, whole=True)
    checkpoint.load(state, checkpoint_id=path)  # the parameters in place; the optimizer's template
    state_dict.set_optimizer_state_dict(model, opt, state["optim"], options=options)
    torch.set_rng_state(state["rng"])
