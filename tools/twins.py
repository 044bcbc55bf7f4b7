"""The release's behavioural leak search: a function anywhere in the student repository that gives
a graded region's answer, whatever its text.

The text search (tools/release.py: solution lines, a region's token shape) finds copies. An
independent implementation (a Sinkhorn in another memory layout, a pooling indexed another way)
reads differently and answers the same. So each pure graded region is called here, in the reference
repository, on inputs drawn from a seed; then every function of the student repository whose
signature takes the same arguments is called on them, and one that returns the same answer is an
answer shipped beside the stub. Two draws per region, so a coincidence on one input does not count.

Usage: python tools/twins.py STUDENT_DIR  (prints one line per twin; exit 1 if any)
"""

import copy
import json
import os
import subprocess
import sys
import tempfile
from contextlib import redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAPTERS = ("mhc", "muon_zero", "cp_compress")  # the files whose pure regions are called
REGIONS = (  # the pure regions regions() draws inputs for
    "mhc.sinkhorn_knopp", "mhc.mhc_coefficients", "mhc.post_mix_backward", "mhc.one_f_one_b",
    "muon_zero.newton_schulz", "muon_zero.split_experts", "cp_compress.compress_local",
    "cp_compress.select_and_pad", "cp_compress.visibility", "cp_compress.halo_rows",
)  # fmt: skip
# the folders searched, besides the root's own modules: the chapters' helpers, benchmarks and the
# public kit (never tools/, whose scripts act at import, nor notebooks/, jupytext scripts)
SEARCHED = ("compiled", "interop", "layouts", "memory", "models", "benchmarks",
            os.path.join("tests", "graded"))  # fmt: skip
SECONDS = 5  # a candidate that runs longer is not an answer to a small input


def regions(mods, seed):
    """{region qualname: (args, kwargs)} drawn from ``seed``, built from the modules ``mods``
    (the reference's or the student's: the same inputs either way)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mhc, mz = mods["mhc"], mods["muon_zero"]
    n, d, tokens = 4, 8, 6
    stream = torch.randn(tokens, n, d, generator=g, dtype=torch.float64)
    hc = mhc.HyperConnection(n, d).double()
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    b = torch.softmax(torch.randn(tokens, n, n, generator=g, dtype=torch.float64), -1)
    c, f = torch.rand(tokens, n, generator=g).double(), torch.randn(tokens, d, generator=g).double()
    m, s = 4, 16
    halo = 2 * m - 1
    ext = torch.randn(halo + s, 2, 3, generator=g)
    own = torch.arange(halo, halo + s).reshape(s // m, m)
    prev = torch.where(torch.arange(s // m)[:, None] > 0, own - m, -1)
    counts = torch.tensor([2, 0, 3])
    return {
        "mhc.sinkhorn_knopp": ((torch.randn(3, n, n, generator=g, dtype=torch.float64), 20), {}),
        "mhc.mhc_coefficients": ((stream, hc, 20), {}),
        "mhc.post_mix_backward": ((torch.randn_like(stream), b, stream, c, f), {}),
        "mhc.one_f_one_b": ((4, seed % 4, 6), {}),
        "muon_zero.newton_schulz": (
            (torch.randn(2, 12, 20, generator=g), mz.STANDARD_NS_COEFFICIENTS, torch.float32),
            {},
        ),
        "cp_compress.compress_local": (
            (
                ext,
                torch.randn(halo + s, 2, 3, generator=g),
                torch.randn(m, 2, 3, generator=g),
                own,
                prev,
                s // m + 1,
            ),
            {},
        ),  # fmt: skip
        "cp_compress.select_and_pad": ((torch.randn(3, 4, 5, generator=g), counts, 8), {}),
        "cp_compress.visibility": (
            (
                torch.arange(8),
                torch.tensor([0] * 5 + [5] * 3),
                torch.tensor([1, 3, 6, 7]),
                torch.tensor([0, 0, 5, 5]),
            ),
            {},
        ),  # fmt: skip
        "cp_compress.halo_rows": ((m + seed % 3, bool(seed % 2)), {}),
        "muon_zero.split_experts": (([5, 3, 8, 2, 7, 1][: 4 + seed % 3], 2 + seed % 2), {}),
    }


def _same(a, b):
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-6)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _modules(root):
    """Every searched module of ``root``, imported by path: {dotted name: module}."""
    import importlib

    names = [f[:-3] for f in os.listdir(root) if f.endswith(".py")]
    for top in SEARCHED:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            rel = os.path.relpath(folder, root)
            dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d != "hidden"]
            for f in files:
                if f.endswith(".py") and not f.startswith(("test_", "conftest")):
                    names.append(os.path.join(rel, f[:-3]).replace(os.sep, "."))
    out = {}
    for name in sorted(names):
        try:
            out[name] = importlib.import_module(name)
        except BaseException:  # a module that cannot import here (a GPU one) answers nothing
            pass
    return out


def _no_processes():
    """Nothing a candidate does may start a process or join a process group."""
    import _posixsubprocess
    import multiprocessing
    import os as _os
    import subprocess as _subprocess

    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise RuntimeError("no processes in the twin search")

    _os.fork = _os.system = _os.execv = _os.execvp = _os.posix_spawn = _os.posix_spawnp = refuse
    _posixsubprocess.fork_exec = refuse
    _subprocess.Popen.__init__ = multiprocessing.Process.start = refuse
    dist.init_process_group = refuse


def chapters(root):
    """{name: module} of CHAPTERS, imported from ``root`` (the first on the path)."""
    import importlib

    if root not in sys.path:
        sys.path.insert(0, root)
    return {name: importlib.import_module(name) for name in CHAPTERS}


def _too_long(signum, frame):
    raise TimeoutError(f"a candidate ran over {SECONDS} s")


def _child(root, mode, path):
    """In a child process: the reference's answers (mode "answers") or the student repository's
    twins of them (mode "twins", answers read from ``path``)."""
    import inspect
    import signal

    import torch

    for extra in ("tests/graded/probes", "tests/graded", "tests", ""):
        sys.path.insert(0, os.path.join(root, extra))
    sys.path = list(dict.fromkeys(sys.path))
    mods = chapters(root)
    if mode == "answers":
        answers = {}
        for seed in (1, 2):
            for region, (args, kwargs) in regions(mods, seed).items():
                module, _, qualname = region.partition(".")
                answers[f"{region}@{seed}"] = getattr(mods[module], qualname)(*args, **kwargs)
        torch.save(answers, path)
        return
    answers = torch.load(path, weights_only=False)
    _no_processes()
    searched = _modules(root)
    signal.signal(signal.SIGALRM, _too_long)
    found = {}
    for seed in (1, 2):
        inputs = regions(mods, seed)
        for name, module in searched.items():
            for fname, fn in inspect.getmembers(module, inspect.isfunction):
                if fn.__module__ != module.__name__:
                    continue
                for region, (args, kwargs) in inputs.items():
                    module_name, _, qualname = region.partition(".")
                    if fn is getattr(mods[module_name], qualname):  # the stub itself
                        continue
                    try:
                        inspect.signature(fn).bind(*args, **kwargs)
                    except (TypeError, ValueError):
                        continue
                    signal.alarm(SECONDS)
                    try:  # on copies: a candidate that writes into its inputs spoils no other
                        mine_args, mine_kwargs = copy.deepcopy((args, kwargs))
                        with open(os.devnull, "w") as quiet, redirect_stdout(quiet):
                            got = fn(*mine_args, **mine_kwargs)
                    except BaseException:
                        continue
                    finally:
                        signal.alarm(0)
                    if _same(got, answers[f"{region}@{seed}"]):
                        found.setdefault(f"{name}.{fname}", set()).add((region, seed))
    twins = sorted(
        (where, region)
        for where, hits in found.items()
        for region in {r for r, _ in hits}
        if {(region, 1), (region, 2)} <= hits
    )
    with open(path + ".json", "w") as f:
        json.dump(twins, f)


def twins(student, root=ROOT):
    """[(student module.function, region)]: each function of ``student`` that answers a graded
    region on both draws."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "answers.pt")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GRADE_DRAW": "0", "PYTHONWARNINGS": "ignore"}
        me = os.path.abspath(__file__)
        for where, mode in ((root, "answers"), (os.path.abspath(student), "twins")):
            subprocess.run(
                [sys.executable, me, "--child", where, mode, path],
                check=True, env=env, cwd=tmp, timeout=600,
            )  # fmt: skip
        with open(path + ".json") as f:
            return [tuple(t) for t in json.load(f)]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(*argv[1:4])
    found = twins(argv[0])
    for where, region in found:
        print(f"TWIN {where}: answers {region}")
    print(f"twin search: {len(found)} functions of the student repository answer a graded region")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
