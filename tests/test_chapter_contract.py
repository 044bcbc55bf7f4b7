"""docs/CHAPTERS.md's table is what tools/chapters.py measures in the chapters now."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import chapters  # noqa: E402


def doc_table():
    with open(os.path.join(ROOT, "docs", "CHAPTERS.md")) as f:
        text = f.read()
    assert chapters.BEGIN in text and chapters.END in text, (
        f"docs/CHAPTERS.md lost its table markers {chapters.BEGIN} ... {chapters.END}"
    )
    return text.split(chapters.BEGIN, 1)[1].split(chapters.END, 1)[0].strip()


def test_chapters_table_matches_the_files():
    measured = chapters.contract_table()
    written = doc_table()
    stale = sorted(set(written.splitlines()) ^ set(measured.splitlines()))
    assert written == measured, (
        "docs/CHAPTERS.md's chapter table is stale; paste `python tools/chapters.py --contract` "
        "between its markers. Rows that differ:\n" + "\n".join(stale)
    )


REACH_BACK = """import sys


def run(kernels=None):
    kernels = kernels or sys.modules[__name__]
    return kernels.step()
"""


CALL_BACK = """import launch


def plan(x):
    return x


def build(groups):
    launch.agree(groups, None, None, plan)
"""


ANOTHER_MODULE = """import sys


def loaded():
    return sys.modules.get("numpy") is not None
"""


def test_the_measure_sees_a_call_back_and_a_reach_back():
    # the two breaches the contract names must show up, or the table could say 0 for anything
    planted = chapters.contract("planted.py", CALL_BACK)
    assert planted[5] == ["plan"], f"a chapter function handed to a guard went unseen: {planted}"
    handed = {name: chapters.contract(name)[5] for name in ("muon_zero.py", "mhc.py")}
    assert not any(handed.values()), f"chapters hand their functions to helpers: {handed}"
    planted = chapters.contract("planted.py", REACH_BACK)
    assert planted[4] == 1, f"a sys.modules reach-back went unseen: counted {planted[4]}"
    planted = chapters.contract("planted.py", ANOTHER_MODULE)
    assert planted[4] == 0, f"numpy looked up in sys.modules counted as a reach-back: {planted}"
    reaching = {name: chapters.contract(name)[4] for name in chapters.CHAPTERS}
    assert not any(reaching.values()), f"chapters reach back through sys.modules: {reaching}"


GOOD_CHAPTER = '''"""A technique.

What the standard tool assumes. One thing.

What V4 violates. Another.

The fix. Two steps.
"""

import launch


# ---- 1. the math -------------------------------------------------------------------------------
def step(x):
    return x


# ---- 2. the protocol ---------------------------------------------------------------------------
def protocol(x):
    return step(x)


# ---- appendix: the demo ------------------------------------------------------------------------
def parse_args(argv=None):
    return argv


def demo(args, rank, world, device):
    return protocol(args)


if __name__ == "__main__":
    launch.run(demo, parse_args())
'''


def test_every_chapter_keeps_the_files_shape():
    missing = {name: chapters.shape_problems(name) for name in chapters.CHAPTERS}
    assert not any(missing.values()), f"chapters miss the contract's shape: {missing}"


def test_the_shape_check_finds_each_part_a_file_misses():
    assert chapters.shape_problems("good.py", GOOD_CHAPTER) == [], "a chapter kept to the shape"
    breaches = {
        "three beats": GOOD_CHAPTER.replace("What V4 violates", "What it breaks"),
        "the appendix fence": GOOD_CHAPTER.replace("# ---- appendix: the demo", "# ---- the demo"),
        "numbered": GOOD_CHAPTER.replace("# ---- 2. the protocol", "# ---- 3. the protocol"),
        "demo(args, rank, world, device)": GOOD_CHAPTER.replace(
            "rank, world, device", "rank, cp, device"
        ),
        "parse_args(argv=None)": GOOD_CHAPTER.replace("def parse_args(", "def parse("),
        "below the fence": GOOD_CHAPTER.replace(
            "# ---- appendix: the demo", "# ---- 3. more"
        ).replace(
            "    return protocol(args)\n", "    return protocol(args)\n\n\n# ---- appendix: end\n"
        ),
        "launch.run(demo, parse_args())": GOOD_CHAPTER.replace(
            "launch.run(demo, parse_args())", "demo()"
        ),
    }
    for words, text in breaches.items():
        said = chapters.shape_problems("planted.py", text)
        assert any(words in p for p in said), f"a file missing {words!r} went unseen: {said}"


def top_imports(path):
    """The first name of every module a Python file imports (static imports only)."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_nothing_outside_tests_imports_tests_and_no_chapter_imports_the_tools():
    """tests/ is imported from tests/ alone (the notebooks and benchmarks take the spawner from
    tools/); a chapter imports neither tests/, tools/ nor benchmarks/."""
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    outside = [f for f in files if not f.startswith("tests/")]
    assert outside, "git ls-files found no Python file outside tests/"
    offenders = [f for f in outside if "tests" in top_imports(os.path.join(ROOT, f))]
    assert not offenders, f"{offenders} import tests/: move what they need out of tests/"
    for chapter in ("muon_zero.py", "mhc.py", "cp_compress.py", "tensor_ckpt.py", "compose.py"):
        found = top_imports(os.path.join(ROOT, chapter)) & {"tests", "tools", "benchmarks"}
        assert not found, f"{chapter} imports {sorted(found)}"
