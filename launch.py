"""The launch plumbing the four chapters share, as picotron's process-group manager is theirs:
backend and device choice (with a one-line reason), set-up and teardown, the agreement guard (what
every rank must hold alike, compared exactly before the first collective, so bad input raises the
same ValueError on every rank; for a call that runs many times, compared again whenever it changes
on any rank: `agree_when_changed`), the launch options and the check that a run fits in memory,
printing on rank 0. Nothing technique-specific.
One timeout rule for every file: a collective waits `--timeout` seconds ($PG_TIMEOUT_S, else 60)
for a silent peer, then every rank still answering stops with one line saying so (`run`,
`stop_together`). Every group made after the world keeps the world's timeout: make groups with
`new_group` (`named_group`: made once per world), `new_subgroups_by_enumeration` and
`device_mesh` below (torch's own give a new group torch's default, 30 minutes for gloo, whatever
the world was given)."""

import argparse
import contextlib
import datetime
import gc
import hashlib
import math
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "PG_TIMEOUT_S"
FAILED_KEY = "launch/failed"  # stop_together: the first failure, in the world's store
STOP_GRACE_S = 5.0  # stop_together, after a timeout: no rank coming for this long ends the wait
_AGREED = weakref.WeakKeyDictionary()  # owner -> {(group, key): digest of what its ranks agreed on}
_NAMED_GROUPS = weakref.WeakKeyDictionary()  # the world group -> {name: a group over every rank}


def choose_backend(backend=None, device=None):
    """(backend, device type, why): NCCL on CUDA when every local rank can have a GPU of its own,
    else gloo on the CPU (gloo with cuda lets ranks share a GPU); refuses what cannot work."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device not in (None, "cpu", "cuda") or backend not in (None, "gloo", "nccl"):
        raise ValueError(
            f"--backend takes gloo or nccl and --device cpu or cuda, got {backend!r} and {device!r}"
        )
    if device is not None:
        why = f"--device {device}"
    elif backend != "gloo" and 0 < local_ranks <= gpus:
        device, why = "cuda", f"{gpus} GPU(s) for {local_ranks} local rank(s)"
    else:
        device = "cpu"
        why = f"{gpus} GPU(s) are too few for {local_ranks} local ranks"
        if backend == "gloo" or gpus == 0:
            why = "--backend gloo" if backend == "gloo" else "no GPU visible"
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible; pass --device cpu")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl moves only CUDA tensors: pass --device cuda, or gloo")
    if backend == "nccl" and local_ranks > gpus:
        raise ValueError(
            f"NCCL needs one GPU per local rank: {local_ranks} ranks, {gpus} GPU(s);"
            " launch fewer ranks, or pass --backend gloo to share GPUs"
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
    """Join torchrun's group, or make a group of one for `python FILE`: (rank, world, device).
    The CUDA device is set first, so NCCL binds each rank to its own GPU."""
    backend, device_type, why = choose_backend(backend, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cpu")
    if device_type == "cuda":
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_seconds(timeout_s))
    torchrun = "RANK" in os.environ  # its environment carries the rendezvous
    alone = {} if torchrun else dict(store=dist.HashStore(), rank=0, world_size=1)  # no network
    nccl_device = dev if torchrun and backend == "nccl" else None
    dist.init_process_group(backend, timeout=timeout, device_id=nccl_device, **alone)
    torch.manual_seed(seed)
    say(f"[setup] {dist.get_world_size()} rank(s), {why}")
    return dist.get_rank(), dist.get_world_size(), dev


def teardown():
    """Collect cycles that hold communicators, then destroy the group (torch warns otherwise)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(demo, args):
    """setup -> demo(args, rank, world, device) -> teardown, for a file's main(). A peer that
    stops answering times the waiting collective out: one line on stderr, exit status 1. A rank
    whose links the first rank to time out closed (its abort) ends the same way."""
    rank, world, device = setup(args.backend, args.device, getattr(args, "seed", 0), args.timeout)
    try:
        demo(args, rank, world, device)
    except (RuntimeError, dist.DistError) as err:
        first = None if isinstance(err, Stopped) else peer_failure()
        if first is not None and not timed_out(first):
            stop_together(err, "the run")  # a peer's own error stopped it first: say that one
        if not timed_out(first or err):
            raise
        # said before the wait (torchrun ends every rank once one leaves), in one write so that
        # the ranks' lines do not interleave
        line = (
            f"rank {rank}: a peer did not answer within the {timeout_seconds(args.timeout):g} "
            f"s process-group timeout (it crashed, hangs or was stopped); set --timeout or "
            f"${TIMEOUT_ENV} to wait longer\n"
        )
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), line.encode())
        if world > 1 and not isinstance(err, Stopped):  # so that every rank can say it too
            with contextlib.suppress(Stopped):
                stop_together(err, "the run")
        sys.exit(1)
    finally:
        teardown()


def timed_out(err):
    """Whether an error (or its text) is a collective that waited out its timeout."""
    return "timed out" in str(err).lower() or "timeout" in str(err).lower()


# ---- groups: every one made after the world keeps the world's timeout ----------------------------


def world_options():
    """The world group's backend options, its timeout among them (torch keeps both private)."""
    world = dist.group.WORLD
    return world._get_backend(world._device_types[0]).options


def group_timeout():
    """The world group's timeout (launch's --timeout, or what a test harness gave its world)."""
    return world_options()._timeout


def new_group(ranks=None, **kwargs):
    """torch.distributed.new_group with the world's timeout; the same arguments otherwise."""
    return dist.new_group(ranks, timeout=group_timeout(), **kwargs)


def new_subgroups_by_enumeration(ranks_per_subgroup):
    """torch's new_subgroups_by_enumeration with the world's timeout: (this rank's group, all)."""
    return dist.new_subgroups_by_enumeration(ranks_per_subgroup, timeout=group_timeout())


def named_group(name):
    """A group over every rank with the world's timeout, made on the first call for `name` in this
    world (every rank calls it then: making a group is collective), the same group after."""
    made = _NAMED_GROUPS.setdefault(dist.group.WORLD, {})
    if name not in made:
        made[name] = new_group()
    return made[name]


def device_mesh(device_type, shape, names):
    """torch's init_device_mesh, each dimension's groups with the world's timeout. DeviceMesh
    reads a timeout only from backend options: each dimension gets fresh ones of the world
    backend's kind (making a group writes into them), with the world's timeout."""
    kind, timeout = type(world_options()), group_timeout()
    override = {name: kind() for name in names}
    for options in override.values():
        options._timeout = timeout
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)


def peer_failure():
    """The first failure a rank recorded in stop_together (its text), or None: no group, or none
    failed yet. The first rank records it before it aborts its links, so a peer whose wait failed
    because they closed finds it here."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = dist.group.WORLD.get_group_store()
    with contextlib.suppress(RuntimeError, dist.DistError):
        if store.check([FAILED_KEY]):
            return store.get(FAILED_KEY).decode()
    return None


class Stopped(RuntimeError):
    """What every rank raises after stop_together: the first failure, the same text everywhere."""


def stop_together(err, what):
    """For a rank that fails mid-run: every rank ends with one error, "{what} stopped on every
    rank: rank R raised ...", R the first to fail; none is left waiting on another.

    Each rank that fails comes here and the first's error goes to the store. A gloo peer blocked
    on a rank that failed fails when that rank exits (its links close) or at its own timeout.
    Under torchrun, which ends every rank once one exits, all stay until every rank has come, at
    most the timeout, so each can say why; after a timeout only until none has come for
    STOP_GRACE_S (a stopped peer never comes). Elsewhere the store lives on rank 0: it stays
    until every rank has read it, and the others leave at once."""
    if not dist.is_initialized():
        raise err
    rank, world, timeout = dist.get_rank(), dist.get_world_size(), group_timeout().total_seconds()
    store = dist.group.WORLD.get_group_store()
    mine = f"rank {rank} raised {type(err).__name__}: {err}"
    first = store.compare_set(FAILED_KEY, "", mine).decode()
    if first == mine:
        for group in list(dist.distributed_c10d._world.pg_map):  # torch lists them nowhere public
            group.abort()  # where a backend closes links on abort, peers blocked on them fail now
        dist.destroy_process_group()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent holds it
        stays, grace = True, min(timeout, STOP_GRACE_S) if timed_out(first) else timeout
    else:
        stays, grace = rank == 0, timeout
    arrived = store.add("launch/stopped", 1)
    began = last = time.monotonic()
    while stays and arrived < world and time.monotonic() < min(began + timeout, last + grace):
        time.sleep(0.05)
        if (count := store.add("launch/stopped", 0)) > arrived:  # one more came: wait on
            arrived, last = count, time.monotonic()
    raise Stopped(f"{what} stopped on every rank: {first}") from err


def say(*args, **kwargs):
    """print, on rank 0 only (or with no group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def weights_digest(named_tensors):
    """sha256 (16 hex digits) of each (name, tensor)'s dtype, shape and bytes: exact."""
    digest = hashlib.sha256()
    for name, t in named_tensors:
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        data = t.detach().cpu().contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def fields_digest(fields):
    """56 bits of sha256 over the fields' texts: one all_reduce(MAX) of (digest, -digest) in int64
    tells whether every rank holds the same fields."""
    text = repr(sorted((name, repr(value)) for name, value in fields.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def agree(fields, error=None, group=None, who="", fix=""):
    """Every rank runs this before its first collective; every rank raises the same ValueError.

    fields: {name: value} that must be equal on every rank (compared by repr, exactly). error:
    this rank's own validation failure, or None; it travels in the same all_gather, so a rank that
    failed alone still joins and none is left waiting. who: the message's prefix."""
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
    problems = []  # every field any rank sent, in first-seen order: the same text on every rank
    for name in dict.fromkeys(name for f, _ in gathered for name in f):
        ranks_by_value = {}
        for rank, (theirs, _) in enumerate(gathered):
            ranks_by_value.setdefault(theirs.get(name, "<missing>"), []).append(rank)
        if len(ranks_by_value) > 1:
            parts = [
                f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} "
                f"{'have' if len(rs) > 1 else 'has'} {value[:117] + '...' * (len(value) > 120)}"
                for value, rs in ranks_by_value.items()
            ]
            problems.append(f"{name} differs across ranks: " + ", ".join(parts))
    if problems:
        raise ValueError(prefix + "; ".join(problems) + (f"; {fix}" if fix else ""))


def agree_when_changed(
    owner, fields, device, error=None, group=None, who="", key=None, costly=None
):
    """agree() for a call that runs many times (a layer's forward, a pipeline step): the ranks
    compare on the owner's first call on a group, then again whenever any rank's fields or error
    change. Every rank decides alike whether to compare, so a rank that changes its input alone
    gets the same ValueError as the others, instead of entering the comparison alone.

    Each call costs one all_reduce(MAX) of three int64 on device (this rank's digest of its fields
    and error, the digest negated, whether it differs from the last agreed one); on a GPU a
    device-to-host copy too. All equal and none changed: no comparison, and this rank's error (the
    same on every rank) is raised. owner: what the ranks agree about (a layer, a model), held
    weakly; device: where its data lives; key: which of its entry points. costly(first) ->
    {name: value}: compared only when the ranks compare (first: on the owner's first comparison),
    for what is too costly to read on every call (a sha256 of the weights)."""
    mine = fields_digest({**fields, "(error)": error})
    agreed = _AGREED.setdefault(owner, {})
    first, changed = not agreed, agreed.get((group, key)) != mine
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        votes = torch.tensor([mine, -mine, int(changed)], device=device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        highest, minus_lowest, any_changed = votes.tolist()
        changed = bool(any_changed) or highest != -minus_lowest
    if changed:
        fix = "pass these alike on every rank, and change them on every rank at the same call"
        agree({**fields, **(costly(first) if costly else {})}, error, group, who, fix)
        agreed[(group, key)] = mine
    elif error:
        raise ValueError(f"{who}: {error}" if who else error)


def at_least(low, kind=int, above=False):
    """An argparse type: a finite `kind` >= low (> low when above), else a one-line usage error."""

    def check(text):
        try:
            value = kind(text)
            ok = math.isfinite(value) and (value > low if above else value >= low)
        except ValueError:
            ok = False
        if not ok:
            sign = ">" if above else ">="
            raise argparse.ArgumentTypeError(f"must be {kind.__name__} {sign} {low}, got {text!r}")
        return value

    return check


positive = at_least(0.0, float, above=True)  # an argparse type: a finite float > 0


def add_launch_options(parser):  # the same --backend, --device and --timeout in every file
    add = parser.add_argument
    add(
        "--backend",
        choices=("gloo", "nccl"),
        help="collective backend (default: nccl when every rank has a GPU, else gloo)",
    )
    add(
        "--device",
        choices=("cpu", "cuda"),
        help="where tensors live (default: cuda with nccl, else cpu)",
    )
    add(
        "--timeout",
        type=positive,
        help="seconds a collective waits for a silent peer before "
        f"every rank stops (default: ${TIMEOUT_ENV} or {DEFAULT_TIMEOUT_S:g})",
    )
    return parser


def check_fits(parser, args, need_bytes, what):
    """A run that cannot fit is a one-line usage error before any work: need_bytes, a lower bound
    of one rank's peak memory, times the ranks sharing this machine's memory (or one GPU's)."""
    _, device, _ = choose_backend(args.backend, args.device)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device == "cuda":  # this rank's GPU, as setup will pick it
        gpus, local_rank = torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0"))
        have = torch.cuda.get_device_properties(local_rank % gpus).total_memory
        sharing = -(-ranks // gpus)
    else:
        have, sharing = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), ranks
    if need_bytes * sharing > have:
        parser.error(
            f"{what}: the run needs at least {need_bytes / 2**30:.1f} GiB per rank, and "
            f"{sharing} rank(s) share this {device}'s {have / 2**30:.1f} GiB; choose smaller sizes"
        )


def check_launch_options(parser, args):
    """A launch that cannot work is a one-line usage error, before any process group exists."""
    try:
        choose_backend(args.backend, args.device)
        timeout_seconds(args.timeout)
    except ValueError as err:
        parser.error(str(err))
    return args
