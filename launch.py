"""The launch plumbing the four chapters share, and nothing about any one technique.

picotron's parallelism files import one process-group manager; these import this module for the
same four jobs:
- choose the backend and device (with a one-line reason), join torchrun's group or make a group
  of one for `python FILE`, and tear it down;
- the agreement guard: what every rank must hold alike, compared exactly before the first
  collective, so a bad input raises the same ValueError on every rank and none is left waiting;
- the shared launch options (--backend, --device, --timeout) and checked argument types;
- printing on rank 0.

The timeout rule, one for every file: a collective that waits longer than `--timeout` seconds
(default 60, or the PG_TIMEOUT_S environment variable) for a peer that crashed, hung or was stopped
ends on every waiting rank with one line saying so (see `run`).
"""

import argparse
import datetime
import gc
import hashlib
import os
import sys

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "PG_TIMEOUT_S"


# ---- backend, device, set-up ---------------------------------------------------------------------


def choose_backend(backend=None, device=None):
    """(backend, device type, why): NCCL on CUDA when every local rank can have a GPU of its own,
    else gloo on the CPU. gloo with device cuda lets ranks share a GPU. Refuses what cannot work,
    before any process group exists."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"--backend must be gloo or nccl, got {backend!r}")
    if device is None:
        device = "cuda" if backend != "gloo" and 0 < local_ranks <= gpus else "cpu"
        if device == "cuda":
            why = f"{gpus} GPU(s) for {local_ranks} local rank(s)"
        elif backend == "gloo" or gpus == 0:
            why = "--backend gloo" if backend == "gloo" else "no GPU visible"
        else:
            why = f"{gpus} GPU(s) are too few for {local_ranks} local ranks"
    else:
        why = f"--device {device}"
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible; pass --device cpu")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl moves only CUDA tensors: pass --device cuda, or gloo")
    if backend == "nccl" and local_ranks > gpus:
        raise ValueError(
            f"NCCL needs one GPU per local rank: {local_ranks} ranks, {gpus} GPU(s); "
            "launch fewer ranks, or pass --backend gloo to share GPUs"
        )
    return backend, device, f"backend {backend}, device {device} ({why})"


def timeout_seconds(timeout_s=None):
    """The one timeout rule: the value given, else $PG_TIMEOUT_S, else 60 s."""
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if not timeout_s > 0:
        raise ValueError(f"the process-group timeout must be > 0 seconds, got {timeout_s}")
    return timeout_s


def setup(backend=None, device=None, seed=0, timeout_s=None):
    """Join torchrun's process group, or make a group of one for plain `python FILE`.

    Returns (rank, world_size, device). The CUDA device is set before the group exists, so NCCL
    binds each rank to its own GPU."""
    backend, device_type, why = choose_backend(backend, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if device_type == "cuda" else 1
    dev = torch.device("cuda", local_rank % gpus) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_seconds(timeout_s))
    if "RANK" in os.environ:  # launched by torchrun: its environment carries the rendezvous
        dist.init_process_group(
            backend, timeout=timeout, device_id=dev if backend == "nccl" else None
        )
    else:  # plain `python FILE`: a group of one, no network
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    torch.manual_seed(seed)
    say(f"[setup] {dist.get_world_size()} rank(s), {why}")
    return dist.get_rank(), dist.get_world_size(), dev


def teardown():
    """Collect cycles that hold communicators, then destroy the group (torch warns otherwise)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(demo, args):
    """setup -> demo(args, rank, world, device) -> teardown, for a file's main().

    A peer that stops answering (crashed, hung, SIGSTOPped) makes the waiting collective time out
    after args.timeout seconds; that ends here in one line on stderr and exit status 1."""
    rank, world, device = setup(args.backend, args.device, getattr(args, "seed", 0), args.timeout)
    try:
        demo(args, rank, world, device)
    except (RuntimeError, dist.DistError) as err:
        if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
            raise
        timeout = timeout_seconds(args.timeout)
        print(
            f"rank {rank}: a peer did not answer within the {timeout:g} s process-group timeout "
            f"(it crashed, hangs or was stopped); set --timeout or ${TIMEOUT_ENV} to wait longer",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    finally:
        teardown()


def say(*args, **kwargs):
    """print on rank 0 only (and always when no group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


# ---- the agreement guard ----------------------------------------------------------------------


def weights_digest(named_tensors):
    """16 hex digits of sha256 over every (name, tensor)'s dtype, shape and bytes: any bit differs,
    the digest differs (a float sum would miss a swap)."""
    digest = hashlib.sha256()
    for name, t in named_tensors:
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        data = t.detach().cpu().contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()[:16]


def fields_digest(fields):
    """56 bits of sha256 over the fields' exact texts: fits an int64 and its negation, so one
    all_reduce(MAX) of (digest, -digest) tells whether every rank holds the same fields."""
    text = repr(sorted((name, repr(value)) for name, value in fields.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _short(text, limit=120):
    return text if len(text) <= limit else text[: limit - 3] + "..."


def agree(fields, error=None, group=None, who=""):
    """Every rank runs this before its first collective; every rank raises the same ValueError.

    fields: {name: value} that must be equal on every rank (compared by repr, exactly).
    error: this rank's own validation failure, or None; it travels in the same all_gather, so a
    rank that failed alone still joins and no rank is left waiting. who: the message's prefix."""
    mine = {name: repr(value) for name, value in fields.items()}
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [(mine, error)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (mine, error), group=group)
    prefix = f"{who}: " if who else ""
    failed = [(rank, e) for rank, (_, e) in enumerate(gathered) if e]
    if failed:
        if len(failed) == world and len({e for _, e in failed}) == 1:
            raise ValueError(prefix + failed[0][1])
        raise ValueError(prefix + "; ".join(f"rank {rank}: {e}" for rank, e in failed))
    problems = []
    for name in dict.fromkeys(name for f, _ in gathered for name in f):  # first-seen order
        ranks_by_value = {}
        for rank, (theirs, _) in enumerate(gathered):
            ranks_by_value.setdefault(theirs.get(name, "<missing>"), []).append(rank)
        if len(ranks_by_value) > 1:
            parts = [
                f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} "
                f"{'have' if len(rs) > 1 else 'has'} {_short(value)}"
                for value, rs in ranks_by_value.items()
            ]
            problems.append(f"{name} differs across ranks: " + ", ".join(parts))
    if problems:
        raise ValueError(prefix + "; ".join(problems))


# ---- launch options -----------------------------------------------------------------------------


def _number(kind, low, text, name):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be {kind.__name__} >= {low}, got {text!r}")
    if not (value >= low and value == value and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{name} must be >= {low} and finite, got {text!r}")
    return value


def at_least(low, kind=int):
    """An argparse type: a number of `kind` >= low, else a one-line usage error."""
    name = f"an {kind.__name__}" if kind is int else f"a {kind.__name__}"

    def check(text):
        return _number(kind, low, text, name)

    check.__name__ = f"{kind.__name__} >= {low}"
    return check


def positive(text):
    """An argparse type: a finite float > 0."""
    value = _number(float, 0.0, text, "a float")
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def add_launch_options(parser):
    """--backend, --device and --timeout, the same in every file."""
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="collective backend (default: nccl when every rank has a GPU, else gloo)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where tensors live (default: cuda with nccl, else cpu)",
    )
    parser.add_argument(
        "--timeout",
        type=positive,
        default=None,
        help=f"seconds a collective waits for a silent peer before every rank stops "
        f"(default: ${TIMEOUT_ENV} or {DEFAULT_TIMEOUT_S:g})",
    )
    return parser


def check_launch_options(parser, args):
    """A launch that cannot work is a one-line usage error, before any process group exists."""
    try:
        choose_backend(args.backend, args.device)
        timeout_seconds(args.timeout)
    except ValueError as err:
        parser.error(str(err))
    return args
