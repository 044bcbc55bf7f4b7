"""Would a run work under NCCL? Record each rank's communication on gloo, replay it by NCCL's rules.

gloo forgives what NCCL does not: gloo buffers sends and matches point-to-point messages by tag,
so a schedule that posts its receives ahead works on a CPU and hangs on GPUs. This tool logs each
rank's torch.distributed calls during a real (gloo) run, then replays the logs under NCCL's rules:

- each rank's operations run in issue order, one at a time, as on one CUDA stream;
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
            kind="p2p", op=name, dir=direction, peer=peer, group=self.ranks(group), batch=batch,
            **fields,
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
            self.local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self.local.inside = False

        return wrapper

    def collective_record(self, name, a):
        if name == "new_group":  # every rank of the world calls it, in the same order
            ranks = sorted(a.get("ranks") or range(self.dist.get_world_size()))
            return dict(kind="coll", op=name, group=self.ranks(None), size=ranks, devices=[])
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
        return dict(kind="coll", op=name, group=self.ranks(a.get("group")), size=size, **fields)


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


def demo_args(name, root=None):
    """Arguments that keep a technique file's demo short: the options it declares are given."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, name)) as f:
        source = f.read()
    args = ["--steps", "1"] if '"--steps"' in source else []
    if name == "cp_compress.py" and '"--seq-per-rank"' not in source:
        args = ["128"]  # an older command line: tokens per rank as its only argument
    return args


# ---- the replay: NCCL's semantics on the logs ----


@dataclass
class Unit:
    """What a rank's stream runs as one step: one op, or one batch_isend_irecv."""

    rank: int
    ops: list
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


def units_of(ops, rank):
    units, batches = [], {}
    for op in ops:
        if op.get("batch") is not None:
            if op["batch"] not in batches:
                batches[op["batch"]] = Unit(rank, [])
                units.append(batches[op["batch"]])
            batches[op["batch"]].ops.append(op)
        else:
            units.append(Unit(rank, [op]))
    for unit in units:
        unit.matched = [False] * len(unit.ops)
    return units


def replay(logs, device=None):
    """Replay the logs under NCCL's rules; return a list of problems (empty when all is well)."""
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
    queues = {r: deque(units_of(logs[r], r)) for r in world}
    channel_next = defaultdict(int)  # (src, dst) -> index of the next message to match
    sent = defaultdict(int)  # counters to number each message on its channel
    received = defaultdict(int)
    number = {}
    for r in world:
        for unit in queues[r]:
            for op in unit.ops:
                if op["kind"] == "p2p":
                    pair = (r, op["peer"]) if op["dir"] == "send" else (op["peer"], r)
                    counter = sent if op["dir"] == "send" else received
                    number[(r, op["seq"])] = counter[pair]
                    counter[pair] += 1
    group_next = defaultdict(int)
    while any(queues.values()):
        progress = False
        heads = {r: q[0] for r, q in queues.items() if q}
        # point-to-point: the next message of a channel matches when both its ends are running
        for r, unit in heads.items():
            for i, op in enumerate(unit.ops):
                if op["kind"] != "p2p" or op["dir"] != "send" or unit.matched[i]:
                    continue
                pair, k = (r, op["peer"]), number[(r, op["seq"])]
                peer_unit = heads.get(op["peer"])
                if channel_next[pair] != k or peer_unit is None:
                    continue
                for j, other in enumerate(peer_unit.ops):
                    if (
                        other["kind"] == "p2p"
                        and other["dir"] == "recv"
                        and other["peer"] == r
                        and number[(op["peer"], other["seq"])] == k
                    ):
                        unit.matched[i] = peer_unit.matched[j] = True
                        channel_next[pair] += 1
                        progress = True
        # collectives: run when every member's stream is at the group's next collective
        for r, unit in heads.items():
            op = unit.ops[0]
            if op["kind"] != "coll" or unit.matched[0]:
                continue
            group = tuple(op["group"])
            members = [heads.get(m) for m in group]
            if all(
                m is not None and m.ops[0]["kind"] == "coll" and tuple(m.ops[0]["group"]) == group
                for m in members
            ):
                for m in members:
                    m.matched[0] = True
                group_next[group] += 1
                progress = True
        for r in list(heads):
            if all(queues[r][0].matched):
                queues[r].popleft()
                progress = True
        if not progress:
            problems.append(_deadlock(queues))
            break
    return problems


def _static_matching(logs):
    """Per channel and per group, the k-th operations must agree in op, size and dtype."""
    problems, sends, recvs, colls = [], defaultdict(list), defaultdict(list), defaultdict(dict)
    for rank, ops in logs.items():
        for op in ops:
            if op["kind"] == "p2p" and op["peer"] is not None:
                if op["dir"] == "send":
                    sends[(rank, op["peer"])].append(op)
                else:
                    recvs[(op["peer"], rank)].append(op)
            elif op["kind"] == "coll":
                colls[tuple(op["group"])].setdefault(rank, []).append(op)
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
    for group, per_rank in sorted(colls.items()):
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


def _deadlock(queues):
    lines = ["deadlock under NCCL's rules:"]
    for r, q in sorted(queues.items()):
        if q:
            lines.append(f"  rank {r} waits in {q[0].describe()}")
        else:
            lines.append(f"  rank {r} has finished")
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
