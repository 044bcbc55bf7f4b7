"""Grade the reference inside Gradescope's default container limits and say whether it fits.

    python tools/measure_grading.py                      # 768 MB, half a CPU (make grade-fit)
    python tools/measure_grading.py --memory-mb 650      # the margin: the same run under 650 MB
    python tools/measure_grading.py --autograder DIR     # DIR/run_autograder, as Gradescope runs it

Gradescope's default autograder machine has 768 MB of memory and half a virtual CPU, and stops a
grading after 10 minutes. This runs tools/grade.py on the reference (or an unpacked autograder's
run_autograder on the reference files) in a fresh control group limited the same way (cgroup v1
memory and cpu controllers, or v2, writable as root), samples its memory every 0.2 s, and prints
the wall time, the CPU time, the peak working set (memory in use less the page cache the kernel can
drop, what `docker stats` shows), the peak including all page cache, and whether the kernel ever
killed a process for memory. It exits 1 unless the reference scores full marks with no
out-of-memory kill, the peak working set is at most --max-mb (650) and the time at most --max-s
(360). Needs root (it makes the control group).
"""

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
V1 = "/sys/fs/cgroup"


def _v1_root(controller):
    """Where this process's cgroup v1 ``controller`` hierarchy is (ours, to nest in), or None."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if controller in controllers.split(","):
                base = os.path.join(V1, controller)
                return base + path if os.path.isdir(base + path) else base
    return None


def _write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


def _read(path, default=None):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


@contextlib.contextmanager
def cgroup(memory_bytes, cpus, name=None):
    """A fresh control group with these limits; yields an object whose ``join()`` moves the
    calling process into it (call it in a child before exec) and whose ``stats()`` reads it."""
    name = name or f"grading-{os.getpid()}-{int(time.time())}"
    memory, cpu = _v1_root("memory"), _v1_root("cpu")
    if memory is None or not os.path.exists(os.path.join(memory, "memory.limit_in_bytes")):
        raise SystemExit("measure: no writable cgroup v1 memory controller here (root needed)")
    paths = {"memory": os.path.join(memory, name)}
    if cpu is not None:
        paths["cpu"] = os.path.join(cpu, name)
    for path in paths.values():
        os.makedirs(path, exist_ok=True)
    _write(os.path.join(paths["memory"], "memory.limit_in_bytes"), memory_bytes)
    swap = os.path.join(paths["memory"], "memory.memsw.limit_in_bytes")
    if os.path.exists(swap):
        _write(swap, memory_bytes)
    if "cpu" in paths:
        _write(os.path.join(paths["cpu"], "cpu.cfs_period_us"), 100_000)
        _write(os.path.join(paths["cpu"], "cpu.cfs_quota_us"), int(cpus * 100_000))

    class Group:
        def join(self):
            for path in paths.values():
                _write(os.path.join(path, "cgroup.procs"), os.getpid())

        def stats(self):
            stat = {}
            for line in (
                _read(os.path.join(paths["memory"], "memory.stat"), "") or ""
            ).splitlines():
                key, _, value = line.partition(" ")
                stat[key] = int(value)
            usage = int(_read(os.path.join(paths["memory"], "memory.usage_in_bytes"), "0"))
            oom = _read(os.path.join(paths["memory"], "memory.oom_control"), "")
            kills = [int(x.split()[1]) for x in oom.splitlines() if x.startswith("oom_kill ")]
            cpu_ns = _read(os.path.join(_v1_root("cpuacct") or "", name, "cpuacct.usage"))
            return {
                "usage": usage,
                "working_set": usage - stat.get("total_inactive_file", 0),
                "rss": stat.get("total_rss", 0) + stat.get("total_mapped_file", 0),
                "max_usage": int(
                    _read(os.path.join(paths["memory"], "memory.max_usage_in_bytes"), "0")
                ),
                "failcnt": int(_read(os.path.join(paths["memory"], "memory.failcnt"), "0")),
                "oom_kills": kills[0] if kills else 0,
                "cpu_s": int(cpu_ns) / 1e9 if cpu_ns and cpu_ns.strip().isdigit() else None,
            }

        def procs(self):
            text = _read(os.path.join(paths["memory"], "cgroup.procs"), "") or ""
            return [int(p) for p in text.split()]

    group = Group()
    acct = _v1_root("cpuacct")
    if acct is not None:
        os.makedirs(os.path.join(acct, name), exist_ok=True)
        paths["cpuacct"] = os.path.join(acct, name)
    try:
        yield group
    finally:
        for _ in range(50):
            left = group.procs()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            time.sleep(0.1)
        for path in paths.values():
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _left_in(group, wait_s=2.0):
    """The processes still in ``group`` once those killed a moment ago have had ``wait_s`` to go."""
    end = time.monotonic() + wait_s
    while group.procs() and time.monotonic() < end:
        time.sleep(0.05)
    return group.procs()


def run_limited(cmd, memory_bytes, cpus, env=None, cwd=None, timeout=900):
    """Run ``cmd`` in a fresh control group; returns (exit code, output, peaks dict, seconds).
    ``peaks["left"]``: the processes still in the group after ``cmd`` returned (each its child
    or grandchild, wherever it moved in the process tree), before they are killed."""
    with cgroup(memory_bytes, cpus) as group:
        peaks = {"working_set": 0, "rss": 0, "usage": 0}
        done = threading.Event()

        def sample():
            while not done.is_set():
                now = group.stats()
                for key in peaks:
                    peaks[key] = max(peaks[key], now[key])
                time.sleep(0.2)

        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=group.join,
        )
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        lines = []
        deadline = start + timeout
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            print(line, end="", flush=True)
            lines.append(line)
            if time.monotonic() > deadline:
                proc.kill()
        proc.wait()
        seconds = time.monotonic() - start
        done.set()
        sampler.join()
        final = group.stats()
        peaks.update(final_max_usage=final["max_usage"], oom_kills=final["oom_kills"])
        peaks.update(failcnt=final["failcnt"], cpu_s=final["cpu_s"], left=_left_in(group))
        return proc.returncode, "".join(lines), peaks, seconds


def _graded_files(root):
    sys.path.insert(0, TOOLS)
    import release

    return [f for f in release.graded_test_files(root) if "/probes/" not in f]


def argparse_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-mb", type=float, default=768, help="the memory limit")
    parser.add_argument("--cpus", type=float, default=0.5, help="the CPU limit, in CPUs")
    parser.add_argument("--max-mb", type=float, default=650, help="the largest peak that passes")
    parser.add_argument("--max-s", type=float, default=360, help="the longest grading that passes")
    parser.add_argument("--autograder", help="an unpacked autograder folder (its run_autograder)")
    return parser


def main(argv=None):
    args = argparse_parser().parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("measure: needs root (it makes a control group)")
    if not _graded_files(ROOT):
        print("measure: no graded test under tests/graded/ yet: nothing to measure")
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADE_NOTICE_S="60")
    work = tempfile.mkdtemp(prefix="measure-")
    out = os.path.join(work, "results.json")
    if args.autograder:
        root = os.path.abspath(args.autograder)
        submission = os.path.join(root, "submission")
        shutil.rmtree(submission, ignore_errors=True)
        os.makedirs(submission)
        sys.path.insert(0, TOOLS)
        import assignments

        for name in assignments.assignment_files(ROOT):
            shutil.copy(os.path.join(ROOT, name), submission)
        env.update(AUTOGRADER_ROOT=root, AUTOGRADER_RESULTS=work)
        cmd = ["bash", os.path.join(root, "source", "run_autograder")]
    else:
        cmd = [sys.executable, os.path.join(TOOLS, "grade.py"), "--out", out]
    limit = int(args.memory_mb * 2**20)
    code, text, peaks, seconds = run_limited(cmd, limit, args.cpus, env=env)
    try:
        with open(out) as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {"score": 0, "max_score": None, "output": "no results.json"}
    shutil.rmtree(work, ignore_errors=True)
    mb = 2**20
    cpu = f", {peaks['cpu_s']:.0f} s of CPU" if peaks.get("cpu_s") is not None else ""
    print(
        f"\nmeasure: {args.memory_mb:.0f} MB, {args.cpus:g} CPU: {report['score']}/"
        f"{report.get('max_score')} points in {seconds:.0f} s{cpu}; peak working set "
        f"{peaks['working_set'] / mb:.0f} MB (rss and mapped files {peaks['rss'] / mb:.0f} MB, "
        f"with all page cache {peaks['final_max_usage'] / mb:.0f} MB), out-of-memory kills "
        f"{peaks['oom_kills']}"
    )
    problems = []
    if report.get("score") != report.get("max_score") or not report.get("max_score"):
        problems.append("not full marks")
    if peaks["oom_kills"]:
        problems.append("the kernel killed a process for memory")
    if peaks["working_set"] > args.max_mb * mb:
        problems.append(f"peak working set over {args.max_mb:.0f} MB")
    if seconds > args.max_s:
        problems.append(f"over {args.max_s:.0f} s")
    first = (report.get("output") or "").splitlines()[:1]
    if problems:
        print("measure: FAILED: " + "; ".join(problems) + (f" ({first[0]})" if first else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
