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
has written its share, so it is complete or absent, and the previous one is kept beside it: a
resume checks the files before any collective (`damage`) and names the one missing or damaged
and the checkpoint to resume instead. compose.run_layout calls resume_from,
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


RECORD_FIELDS = ("step", "layout", "config", "global_batch", "training")


def checkpoint_steps(root):
    """{k: DIR/step-<k>} of the complete checkpoints in root (a step-<k>.tmp never finished)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = [int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()]
    return {k: os.path.join(root, f"step-{k}") for k in sorted(steps)}


def damage(path):
    """What is missing or damaged in the checkpoint at path, in one line, or None: compose.json
    (present, JSON, every field), dcp's .metadata (present, readable) and each file .metadata
    indexes (present, as long as the index says). Reads no tensor, so a shard whose bytes changed
    but not its length passes here and fails in dcp.load."""
    record = os.path.join(path, "compose.json")
    try:
        with open(record) as f:
            saved = json.load(f)
        missing = [k for k in RECORD_FIELDS if k not in saved]
        if missing:
            return f"{record} is damaged: it lacks {', '.join(missing)}"
    except FileNotFoundError:
        return f"{record} is missing"
    except (OSError, ValueError) as err:
        return f"{record} is damaged: {err}"
    try:
        metadata = dcp()[0].FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        return f"{os.path.join(path, '.metadata')} is missing"
    except Exception as err:  # an unpickling error can be of any type
        return f"{os.path.join(path, '.metadata')} is damaged: {type(err).__name__}: {err}"
    need = {}  # file -> the bytes the index reads from it
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, end in sorted(need.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            return f"{shard} is missing"
        if os.path.getsize(shard) < end:
            return f"{shard} is truncated: {os.path.getsize(shard)} bytes, .metadata reads {end}"
    return None


def previous_advice(path):
    """Where to resume from instead of the damaged checkpoint at path, in one line."""
    root, name = os.path.split(os.path.normpath(path))
    steps = checkpoint_steps(root).items()
    earlier = [p for k, p in steps if k < int(name[5:]) and not damage(p)]
    if not earlier:
        return f"no complete earlier checkpoint is kept in {root}; train again from step 0"
    return f"the previous checkpoint is complete: resume from it with --resume {earlier[-1]}"


def latest_checkpoint(root):
    """-> (step, path, compose.json's record) of the newest checkpoint in root (or of root itself,
    a step-<k> folder), or ValueError: none there, or the newest is damaged (which file, and
    which earlier checkpoint can be resumed instead)."""
    name = os.path.basename(os.path.normpath(root))
    if name.startswith("step-") and name[5:].isdigit():  # a step named: that checkpoint
        path = root
    elif steps := checkpoint_steps(root):
        path = steps[max(steps)]
    else:
        raise ValueError(f"--resume {root}: no complete checkpoint (a step-<k> folder) there")
    if problem := damage(path):
        raise ValueError(f"--resume: {problem}; {previous_advice(path)}")
    with open(os.path.join(path, "compose.json")) as f:
        saved = json.load(f)
    return saved["step"], path, saved


def _setting(value):
    if value == "fp32":  # grad_sync's old name of "exact": checkpoints saved under it resume
        return "exact"
    return str(value) if isinstance(value, torch.dtype) else value


def resume_config(saved, cfg, train, pp, cp, dp):
    """The configuration that continues `saved` (compose.json) on pp x cp x dp: the model's fields
    and train's settings must match (ValueError naming the first that differs); the global batch
    stays the checkpoint's, each of the dp replicas taking its share. -> (cfg, start step)."""
    mine = {**asdict(cfg), **{k: _setting(getattr(train, k)) for k in RESUMED_FIELDS}}
    theirs = {**saved["config"], **{k: _setting(v) for k, v in saved["training"].items()}}
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
    """DIR/step-<step>, complete or absent. Once it is visible every other checkpoint goes but the
    previous one, so that a newest one damaged later has a complete predecessor. The previous one
    is not kept until the new one has been loaded: a run that never resumes never loads, and
    reading each save back would double its I/O."""
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
        others = [k for k in checkpoint_steps(root) if k != step]
        previous = max((k for k in others if k < step), default=None)
        for k in others:  # the previous one stays; later ones are another run's, from before
            if k != previous:
                shutil.rmtree(os.path.join(root, f"step-{k}"), ignore_errors=True)
    dist.barrier()


def load_checkpoint(path, model, held, opt):
    """Fill this rank's stage and optimizer from the checkpoint at path, whatever its layout."""
    checkpoint, state_dict, options = dcp()
    state = checkpoint_state(model, held, opt, whole=True)
    try:  # the parameters in place; the optimizer's template
        checkpoint.load(state, checkpoint_id=path)
    except checkpoint.api.CheckpointException as err:  # dcp gathers every rank's: all raise it
        first = {f"{type(e).__name__}: {e}".splitlines()[0] for e, _ in err.failures.values()}
        raise ValueError(
            f"--resume: {path} could not be read ({'; '.join(sorted(first))}); "
            f"{previous_advice(path)}"
        ) from err
    state_dict.set_optimizer_state_dict(model, opt, state["optim"], options=options)
    torch.set_rng_state(state["rng"])
