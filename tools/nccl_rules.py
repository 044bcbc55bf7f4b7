"""Would a run work under NCCL? Record each rank's communication on gloo, replay it by NCCL's rules.

gloo forgives what NCCL does not: gloo buffers sends and matches point-to-point messages by tag,
so a schedule that posts its receives ahead works on a CPU and hangs on GPUs. This tool logs each
rank's torch.distributed calls during a real (gloo) run, then replays the logs under NCCL's rules:

- each process group has one NCCL stream for collectives and one per peer pair for point-to-point;
  a rank's launches run in issue order on their stream, and a launch also waits for every
  operation the rank waited on (Work.wait(), or a blocking call) before issuing it;
- point-to-point messages between a pair match in issue order, without tags, and a send finishes
  only when its receive is running (nothing is buffered);
- the operations of one batch_isend_irecv run together, as one NCCL group;
- a collective runs when every member of its group has reached it, in the same order, with the
  same operation, element count and dtype.

It reports a deadlock (which rank waits on what, and what its peer is doing instead), size/dtype
mismatches, and tensors on a device other than the run's (`--device cuda` runs on a GPU).

    torchrun --nproc_per_node=4 tools/nccl_rules.py record --out DIR -- mhc.py --steps 2
    python tools/nccl_rules.py replay DIR
    python tools/nccl_rules.py static FILE...   # no device chosen from the backend's name

Not seen: calls made from C++ (DistributedDataParallel's gradient all-reduces run in its Reducer,
the same sequence on every rank), and timing (the replay checks order, not speed).
"""

import argparse
import ast
import functools
import inspect
import json
import os
import runpy
import sys
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field

# ---- the recorder: wrap torch.distributed's communication calls in each rank ----

P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "new_group",
)
# the argument whose size must agree across ranks, per collective (None: only the op must agree)
SIZE_ARG = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "output",
    "gather": "tensor",
    "scatter": "tensor",
}


class Recorder:
    """Appends one JSON line per communication call to DIR/rank{R}.jsonl, flushed at once."""

    def __init__(self, out):
        import torch.distributed as dist

        self.dist, self.out, self.file, self.seq, self.batch = dist, out, None, 0, 0
        self.local = threading.local()  # inside batch_isend_irecv: its own calls are not logged

    def open(self):
        """The rank's log, made at once: a rank that calls nothing still leaves an empty log."""
        os.makedirs(self.out, exist_ok=True)
        rank = os.environ.get("RANK", "0")  # torchrun's; the group does not exist yet
        self.file = open(os.path.join(self.out, f"rank{rank}.jsonl"), "w")

    def write(self, record):
        record["seq"] = self.seq
        self.seq += 1
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def ranks(self, group):
        dist = self.dist
        return list(dist.get_process_group_ranks(group or dist.group.WORLD))

    def gid(self, group):
        """The group's identity: two groups over the same ranks are two NCCL communicators."""
        return str((group or self.dist.group.WORLD).group_name)

    @staticmethod
    def tensor_fields(tensors):
        tensors = [t for t in tensors if t is not None and hasattr(t, "numel")]
        return {
            "numel": sum(t.numel() for t in tensors),
            "dtype": str(tensors[0].dtype).replace("torch.", "") if tensors else None,
            "devices": sorted({t.device.type for t in tensors}),
        }

    def p2p_record(self, name, tensor, peer, group, batch=None):
        direction = "send" if name in ("send", "isend") else "recv"
        fields = self.tensor_fields([tensor])
        return dict(
            kind="p2p", op=name, dir=direction, peer=peer, group=self.ranks(group),
            gid=self.gid(group), batch=batch, **fields,
        )  # fmt: skip

    def install(self):
        """Replace each communication call in torch.distributed (and c10d) by a logging wrapper."""
        import torch.distributed.distributed_c10d as c10d

        for name in P2P + COLLECTIVES + ("batch_isend_irecv",):
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self.wrap(name, original)
            for module in (self.dist, c10d):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)

    def wrap(self, name, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if getattr(self.local, "inside", False):
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            first = self.seq
            if name == "batch_isend_irecv":
                self.batch += 1
                for op in a["p2p_op_list"]:
                    kind = "isend" if op.op.__name__ == "isend" else "irecv"
                    self.write(self.p2p_record(kind, op.tensor, op.peer, op.group, self.batch))
            elif name in P2P:
                peer = a.get("dst") if name in ("send", "isend") else a.get("src")
                group_peer = a.get("group_dst") if name in ("send", "isend") else a.get("group_src")
                if peer is None and group_peer is not None:
                    peer = self.dist.get_global_rank(a["group"], group_peer)
                self.write(self.p2p_record(name, a.get("tensor"), peer, a.get("group")))
            else:
                self.write(self.collective_record(name, a))
            seqs = list(range(first, self.seq))
            self.local.inside = True
            try:
                result = original(*args, **kwargs)
            finally:
                self.local.inside = False
            if name == "batch_isend_irecv":
                return [_Work(w, [q], self) for w, q in zip(result, seqs)]
            if name in ("isend", "irecv") or a.get("async_op"):
                return _Work(result, seqs, self) if result is not None else result
            self.write({"kind": "wait", "on": seqs})  # a blocking call waits for itself
            return result

        return wrapper

    def collective_record(self, name, a):
        if name == "new_group":  # every rank of the world calls it, in the same order...
            ranks = sorted(a.get("ranks") or range(self.dist.get_world_size()))
            if a.get("use_local_synchronization"):  # ...unless only its members take part
                return dict(
                    kind="coll", op=name, group=ranks, gid="new_group(local) " + str(ranks),
                    size=ranks, devices=[],
                )  # fmt: skip
            return dict(
                kind="coll", op=name, group=self.ranks(None), gid=self.gid(None), size=ranks,
                devices=[],
            )  # fmt: skip
        tensors = []
        for key in ("tensor", "input_tensor", "output_tensor", "output", "input"):
            if hasattr(a.get(key), "numel"):
                tensors.append(a[key])
        for key in ("tensor_list", "input_list", "output_tensor_list", "input_tensor_list"):
            tensors += [t for t in a.get(key) or [] if hasattr(t, "numel")]
        fields = self.tensor_fields(tensors)
        size_arg = SIZE_ARG.get(name)
        size = None
        if size_arg and hasattr(a.get(size_arg), "numel"):
            size = [a[size_arg].numel(), str(a[size_arg].dtype).replace("torch.", "")]
        elif name == "all_to_all_single":
            size = [None, fields["dtype"]]  # uneven splits are allowed; the dtype must agree
        group = a.get("group")
        return dict(
            kind="coll", op=name, group=self.ranks(group), gid=self.gid(group), size=size, **fields
        )


class _Work:
    """A torch.distributed Work whose wait() is logged: the compute stream waits for the op."""

    def __init__(self, work, seqs, recorder):
        self._work, self._seqs, self._recorder = work, seqs, recorder

    def wait(self, *args, **kwargs):
        self._recorder.write({"kind": "wait", "on": self._seqs})
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def record(out, file, args):
    """Install the recorder, then run FILE as __main__ with ARGS (in this torchrun rank)."""
    recorder = Recorder(out)
    recorder.open()
    recorder.install()
    sys.argv = [file, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(file)))
    try:
        runpy.run_path(file, run_name="__main__")
    finally:
        recorder.file.close()


# The smallest demo of each file that still runs every collective and point-to-point path at
# N = 1..4 (the replay cares about the order and sizes of calls, not about training quality).
DEMO_ARGS = {
    "compose.py": ["--steps", "2", "--layers", "4", "--seq-len", "64"],
    "muon_zero.py": ["--steps", "2", "--seq", "8"],
    "mhc.py": ["--steps", "1", "--layers", "12", "--dim", "32", "--seq-len", "8", "--batch", "24"],
    "cp_compress.py": ["--seq-per-rank", "128", "--m-hca", "16"],
    "tensor_ckpt.py": [
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--dim",
        "32",
        "--layers",
        "2",
    ],
}


def demo_args(name, root=None):
    """Arguments that keep a technique file's demo short (its defaults for any other file)."""
    return list(DEMO_ARGS.get(os.path.basename(name), []))


# ---- the replay: NCCL's semantics on the logs ----


@dataclass
class Unit:
    """What one NCCL launch runs: one op, or one batch_isend_irecv (posted together)."""

    rank: int
    ops: list
    stream: tuple = ()
    after: frozenset = frozenset()  # ops the rank waited on before issuing this one
    matched: list = field(default_factory=list)

    def describe(self):
        parts = []
        for op in self.ops:
            if op["kind"] == "p2p":
                way = "to" if op["dir"] == "send" else "from"
                parts.append(f"{op['op']} {way} rank {op['peer']} ({_size(op)})")
            else:
                parts.append(f"{op['op']} on ranks {op['group']} ({_size(op)})")
        where = f"op #{self.ops[0]['seq']}"
        if len(self.ops) > 1:
            return f"a batch_isend_irecv of [{'; '.join(parts)}] ({where})"
        return f"{parts[0]} ({where})"


def _size(op):
    if op.get("numel") is None:
        return "no tensor"
    return f"{op['numel']} x {op.get('dtype')}"


def load(directory):
    """rank -> list of records, from DIR/rank{R}.jsonl."""
    logs = {}
    for name in os.listdir(directory):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                logs[int(name[4:-6])] = [json.loads(line) for line in f if line.strip()]
    return logs


def _gid(op):
    """A process group's identity in the logs (its name; the rank list in older logs)."""
    return op.get("gid") or str(op["group"])


def _stream(rank, ops):
    """NCCL's stream for a launch: per process group, one for collectives and one per peer pair."""
    group = _gid(ops[0])
    if ops[0]["kind"] == "coll":
        return (group, "collectives")
    peers = {op["peer"] for op in ops}
    if len(peers) > 1:
        return (group, "collectives")  # a batch over several peers runs as one group launch
    return (group, tuple(sorted((rank, peers.pop()))))


def units_of(events, rank):
    """A rank's launches in issue order; each knows its stream and the waits issued before it."""
    units, batches, waited = [], {}, set()
    for event in events:
        if event["kind"] == "wait":
            waited.update(event["on"])
            continue
        if event.get("batch") is not None and event["batch"] in batches:
            batches[event["batch"]].ops.append(event)
            continue
        unit = Unit(rank, [event], after=frozenset(waited))
        units.append(unit)
        if event.get("batch") is not None:
            batches[event["batch"]] = unit
    for unit in units:
        unit.stream = _stream(rank, unit.ops)
        unit.matched = [False] * len(unit.ops)
    return units


def replay(logs, device=None):
    """Replay the logs under NCCL's rules; return a list of problems (empty when all is well).

    Each rank's launches queue on their NCCL stream (per process group: one for collectives, one
    per peer pair) and run in order there; a launch also waits for every op the rank had waited
    on before issuing it (Work.wait(), or a blocking call, makes the compute stream wait, and each
    NCCL launch waits for the compute stream). A launch is running when it heads its stream and
    those ops are done; a send and its receive complete together only when both are running.
    """
    problems = []
    world = sorted(logs)
    for rank in world:
        for op in logs[rank]:
            if op["kind"] == "p2p" and op["peer"] is None:
                problems.append(f"rank {rank}: {op['op']} from any source (NCCL needs a peer)")
            bad = [d for d in op.get("devices", []) if device and d != device]
            if bad:
                problems.append(
                    f"rank {rank}: {op['op']} (op #{op['seq']}) is given a {bad[0]} tensor; "
                    f"this run computes on {device}"
                )
    problems += _static_matching(logs)
    streams = defaultdict(deque)  # (rank, stream) -> launches in issue order
    number, counters = {}, defaultdict(int)  # each message's index on its (group, src, dst)
    for r in world:
        for unit in units_of(logs[r], r):
            streams[(r, unit.stream)].append(unit)
            for op in unit.ops:
                if op["kind"] == "p2p":
                    src, dst = (r, op["peer"]) if op["dir"] == "send" else (op["peer"], r)
                    key = (_gid(op), src, dst, op["dir"])
                    number[(r, op["seq"])] = counters[key]
                    counters[key] += 1
    done = {r: set() for r in world}
    channel_next = defaultdict(int)
    while any(streams.values()):
        running = [
            q[0] for (r, _), q in streams.items() if q and q[0].after <= done[r]
        ]  # fmt: skip
        by_rank = defaultdict(list)
        for unit in running:
            by_rank[unit.rank].append(unit)
        progress = False
        for unit in running:  # point-to-point: the channel's next message, both ends running
            for i, op in enumerate(unit.ops):
                if op["kind"] != "p2p" or op["dir"] != "send" or unit.matched[i]:
                    continue
                k = number[(unit.rank, op["seq"])]
                channel = (_gid(op), unit.rank, op["peer"])
                if channel_next[channel] != k:
                    continue
                for other in by_rank.get(op["peer"], []):
                    for j, theirs in enumerate(other.ops):
                        if (
                            theirs["kind"] == "p2p"
                            and theirs["dir"] == "recv"
                            and theirs["peer"] == unit.rank
                            and _gid(theirs) == channel[0]
                            and number[(other.rank, theirs["seq"])] == k
                        ):
                            unit.matched[i] = other.matched[j] = True
                            channel_next[channel] += 1
                            progress = True
        for unit in running:  # a collective: every member's collectives stream is at it
            op = unit.ops[0]
            if op["kind"] != "coll" or unit.matched[0]:
                continue
            members = [
                next((u for u in by_rank.get(m, []) if u.stream == unit.stream), None)
                for m in op["group"]
            ]
            if all(m is not None for m in members):
                for m in members:
                    m.matched[0] = True
                progress = True
        for unit in running:
            if all(unit.matched):
                streams[(unit.rank, unit.stream)].popleft()
                done[unit.rank].update(op["seq"] for op in unit.ops)
                progress = True
        if not progress:
            problems.append(_deadlock(streams, done))
            break
    return problems


def _static_matching(logs):
    """Per channel and per group, the k-th operations must agree in op, size and dtype."""
    problems, sends, recvs, colls = [], defaultdict(list), defaultdict(list), defaultdict(dict)
    for rank, ops in logs.items():
        for op in ops:
            if op["kind"] == "p2p" and op["peer"] is not None:
                group = _gid(op)
                if op["dir"] == "send":
                    sends[(rank, op["peer"], group)].append(op)
                else:
                    recvs[(op["peer"], rank, group)].append(op)
            elif op["kind"] == "coll":
                colls[(_gid(op), tuple(op["group"]))].setdefault(rank, []).append(op)
    for pair in sorted(set(sends) | set(recvs)):
        s, r = sends.get(pair, []), recvs.get(pair, [])
        if len(s) != len(r):
            problems.append(
                f"rank {pair[0]} sends {len(s)} message(s) to rank {pair[1]}, "
                f"which receives {len(r)} from it"
            )
        for k, (a, b) in enumerate(zip(s, r)):
            if (a["numel"], a["dtype"]) != (b["numel"], b["dtype"]):
                problems.append(
                    f"message {k} from rank {pair[0]} to rank {pair[1]}: sent {_size(a)} "
                    f"(op #{a['seq']}), received into {_size(b)} (op #{b['seq']})"
                )
    for (_, group), per_rank in sorted(colls.items()):
        counts = {r: len(ops) for r, ops in per_rank.items()}
        missing = [m for m in group if m not in per_rank]
        if missing or len(set(counts.values())) > 1:
            problems.append(
                f"group {list(group)}: collectives entered per rank {counts}"
                + (f"; ranks {missing} never enter one" if missing else "")
            )
        for k, row in enumerate(zip(*per_rank.values())):
            kinds = {(op["op"], json.dumps(op.get("size"))) for op in row}
            if len(kinds) > 1:
                seen = ", ".join(
                    f"rank {r}: {op['op']} {op.get('size')} (op #{op['seq']})"
                    for r, op in zip(per_rank, row)
                )
                problems.append(f"collective {k} on group {list(group)} differs: {seen}")
                break
    return problems


def _deadlock(streams, done):
    lines = ["deadlock under NCCL's rules:"]
    ranks = sorted({r for r, _ in streams})
    for r in ranks:
        heads = [q[0] for (rank, _), q in sorted(streams.items(), key=str) if rank == r and q]
        if not heads:
            lines.append(f"  rank {r} has finished")
        for unit in heads:
            missing = sorted(unit.after - done[r])
            if missing:
                lines.append(
                    f"  rank {r} cannot start {unit.describe()}: "
                    f"it first waited on op #{missing[0]}"
                )
            else:
                lines.append(f"  rank {r} waits in {unit.describe()}")
    return "\n".join(lines)


# ---- the static check: no device chosen from the backend's name ----

ALLOWED = {"choose_backend", "setup"}  # the shared set-up block decides backend and device


def static_check(path):
    """Comparisons with "nccl"/"gloo" or get_backend() outside the set-up block, as problems."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    problems = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Compare) and function not in ALLOWED:
            parts = [node.left, *node.comparators]
            named = any(isinstance(p, ast.Constant) and p.value in ("nccl", "gloo") for p in parts)
            called = any(
                isinstance(p, ast.Call)
                and getattr(p.func, "attr", getattr(p.func, "id", "")) == "get_backend"
                for p in parts
            )
            if named or called:
                problems.append(
                    f"{os.path.basename(path)}:{node.lineno}: behaviour chosen from the backend's "
                    f"name in {function or 'module level'}; take the device from the tensors"
                )
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="under torchrun: log each rank's calls, run FILE")
    rec.add_argument("--out", required=True, help="folder for rank{R}.jsonl")
    rec.add_argument("file", help="the script to run, then its arguments after --")
    rec.add_argument("args", nargs=argparse.REMAINDER, help="arguments for FILE")
    rep = sub.add_parser("replay", help="replay a recorded folder under NCCL's rules")
    rep.add_argument("dir", help="folder written by record")
    rep.add_argument("--device", choices=("cpu", "cuda"), help="flag tensors on other devices")
    sta = sub.add_parser("static", help="find devices chosen from the backend's name")
    sta.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "record":
        extra = args.args[1:] if args.args[:1] == ["--"] else args.args
        record(args.out, args.file, extra)
        return 0
    if args.command == "static":
        problems = [p for f in args.files for p in static_check(f)]
    else:
        logs = load(args.dir)
        if not logs:
            print(f"replay: no rank*.jsonl in {args.dir}")
            return 1
        problems = replay(logs, args.device)
        count = sum(len(v) for v in logs.values())
        print(f"replayed {count} operations of {len(logs)} ranks under NCCL's rules")
    for p in problems:
        print(p)
    print("no problems found" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
