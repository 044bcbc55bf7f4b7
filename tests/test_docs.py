"""The docs stay true: every link and anchor resolves (here and in the student kit), every count is
the tree's, every evidence-ledger entry's "where" exists, and every number a notebook states in a
takeaway or under a figure carries its evidence tag.

All default tier and cheap (files read, ASTs parsed, nothing run) but the test counts, which need
pytest's collection of the whole suite (slow tier).
"""

import ast
import contextlib
import functools
import glob
import io
import os
import re
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import assignments  # noqa: E402
import docs_counts  # noqa: E402
import release  # noqa: E402

TAGS = ("PAPER", "DERIVED", "IMPLEMENTED", "MEASURED", "INFERRED", "UNKNOWN")
TAG = re.compile(r"\[(?:%s)\b" % "|".join(TAGS))
DOCS = ["README.md", "ASSIGNMENTS.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT))]
NOTEBOOKS = sorted(glob.glob("notebooks/*.ipynb", root_dir=ROOT))
LEDGER = "docs/EVIDENCE.md"
# a stated figure: a number with a unit, a percentage, a ratio, a decimal or a power of ten
NUMBER = re.compile(
    r"(?<![\w.§/-])\d[\d,]*(?:\.\d+)?(?:e-?\d+)?\s*"
    r"(?:%|MiB|GiB|KiB|MB|GB|bytes?\b|B\b|ms\b|s\b|×(?!\s*\d)|GFLOP|ulp)"
    r"|(?<![\w.§/-])\d+\.\d+(?![\w.])|\b\d(?:\.\d+)?e-\d+"
)


# ---- markdown: links and anchors ----


def _prose(text):
    """``text`` without fenced code blocks and code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text):
    """Every link target in markdown ``text``: inline `[x](t)` and reference `[x]: t`."""
    prose = _prose(text)
    inline = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)
    refs = re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", prose, flags=re.M)
    return inline + refs


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text):
    """Every anchor a markdown ``text``'s headings make (duplicates numbered as GitHub does)."""
    seen, found = {}, set()
    for line in re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return found


def markdown_of(path):
    """The markdown text of a file: a .md as it is, a notebook's markdown cells joined."""
    if path.endswith(".ipynb"):
        nb = nbformat.read(path, as_version=4)
        return "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    with open(path) as f:
        return f.read()


def broken_links(files, root, exists, text_of):
    """'file: target (why)' for each relative link of ``files`` that does not resolve in ``root``:
    ``exists(rel)`` says whether a file is there, ``text_of(rel)`` gives its markdown."""
    broken = []
    for name in files:
        for target in links(text_of(name)):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
            if rel.startswith(".."):
                broken.append(f"{name}: {target} (outside the repository)")
            elif not exists(rel):
                broken.append(f"{name}: {target} (no file {rel})")
            elif anchor and rel.endswith((".md", ".ipynb")) and anchor not in anchors(text_of(rel)):
                broken.append(f"{name}: {target} (no heading makes #{anchor} in {rel})")
    return broken


def test_every_link_and_anchor_resolves_in_the_repository():
    def exists(rel):
        return os.path.exists(os.path.join(ROOT, rel))

    def text_of(rel):
        return markdown_of(os.path.join(ROOT, rel))

    broken = broken_links(DOCS + NOTEBOOKS, ROOT, exists, text_of)
    assert not broken, "dead links or anchors:\n" + "\n".join(broken)


def test_every_link_and_anchor_resolves_in_the_student_kit():
    """Statically: the kit's files are release.py's list (building it takes a while); its README is
    the student template, ASSIGNMENTS.md and the chapter guides do not ship."""
    shipped = {p for p in release.SUPPORT if os.path.exists(os.path.join(ROOT, p))}
    shipped |= set(assignments.assignment_files(ROOT)) | set(NOTEBOOKS) | {"README.md", "Makefile"}
    with open(os.path.join(release.TEMPLATES, "README.md")) as f:
        student_readme = f.read().replace("{{ASSIGNMENTS}}", release._assignment_prose(ROOT))

    def text_of(rel):
        return student_readme if rel == "README.md" else markdown_of(os.path.join(ROOT, rel))

    docs = [p for p in sorted(shipped) if p.endswith((".md", ".ipynb"))]
    broken = broken_links(docs, ROOT, shipped.__contains__, text_of)
    assert not broken, "dead links or anchors in the student kit:\n" + "\n".join(broken)
    assert {"docs/GLOSSARY.md", LEDGER, "docs/assignments.md"} <= shipped, "the kit must ship them"


def test_the_link_checker_finds_a_dead_file_and_a_dead_anchor():
    texts = {"a.md": "# Top heading\n[ok](b.md#the-end) [gone](c.md) [bad](b.md#nowhere)\n"}
    texts["b.md"] = "## The end\n`[not a link](x.md)`\n"
    broken = broken_links(["a.md", "b.md"], "", texts.__contains__, texts.__getitem__)
    assert broken == ["a.md: c.md (no file c.md)", "a.md: b.md#nowhere (no heading makes "
                      "#nowhere in b.md)"], broken  # fmt: skip
    heading = "2. `muon_zero.py`: Muon's update (V4 §3.4.1)"
    assert slug(heading) == "2-muon_zeropy-muons-update-v4-341"


# ---- counts ----


def test_every_count_in_the_docs_is_the_trees():
    stale = docs_counts.stale(docs_counts.cheap_counts())
    assert not stale, "run `python tools/docs_counts.py`:\n" + "\n".join(stale)
    stated = [name for doc in DOCS for name, _ in docs_counts.spans(markdown_of(doc))]
    assert "regions" in stated and "exercises" in stated, "the README states its counts in spans"


@pytest.mark.slow  # collects the whole suite (~15 s)
def test_every_test_count_in_the_docs_is_the_suites():
    stale = docs_counts.stale(docs_counts.cheap_counts() | docs_counts.collected_counts())
    assert not stale, "run `python tools/docs_counts.py --tests`:\n" + "\n".join(stale)


# ---- the evidence ledger ----


def ledger_rows():
    """(id, tag cell, where cell) of every row of the ledger's claim tables."""
    rows = []
    for line in markdown_of(os.path.join(ROOT, LEDGER)).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and re.match(r"^[A-Z]\w*\.\d+$", cells[0]) and len(cells) >= 4:
            rows.append((cells[0], cells[2], cells[3]))
    return rows


@functools.cache
def _module_body(path):
    with open(path) as f:
        return ast.parse(f.read()).body


def _defines(path, qualname):
    """Whether the Python file at ``path`` defines ``qualname`` (Class.method, function, name)."""
    body = _module_body(path)
    for part in qualname.split("."):
        found = None
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name == part:
                    found = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def where_problems(kind, value):
    """Why a ledger "where" does not exist ([] when it does)."""
    if kind == "fn":
        parts = value.split(".")
        for i in range(len(parts) - 1, 0, -1):
            path = os.path.join(ROOT, *parts[:i]) + ".py"
            if os.path.exists(path):
                return [] if _defines(path, ".".join(parts[i:])) else [f"{value}: not defined"]
        return [f"{value}: no module"]
    if kind == "test":
        path, _, name = value.partition("::")
        name = name.split("[")[0]
        if not os.path.exists(os.path.join(ROOT, path)):
            return [f"{value}: no file {path}"]
        return [] if _defines(os.path.join(ROOT, path), name) else [f"{value}: no test {name}"]
    if kind == "make":
        with open(os.path.join(ROOT, "Makefile")) as f:
            found = re.search(rf"^{re.escape(value)}:", f.read(), re.M)
        return [] if found else [f"make {value}: no such target"]
    if kind == "cmd":
        if value.startswith("make "):
            return where_problems("make", value.split()[1])
        words = value.split()
        scripts = [w for w in words if w.endswith(".py") or w.startswith((".ci/", "tools/"))]
        scripts += [w.replace(".", "/") + ".py" for a, w in zip(words, words[1:]) if a == "-m"]
        missing = [s for s in scripts if not os.path.exists(os.path.join(ROOT, s))]
        if not scripts:
            return [f"{value}: names no script"]
        return [f"{value}: no file {m}" for m in missing]
    if kind == "file":
        found = os.path.exists(os.path.join(ROOT, value.split("#")[0]))
        return [] if found else [f"no file {value}"]
    return [f"{kind} {value}: unknown kind"]


WHERE = re.compile(r"\b(fn|test|make|cmd|file) `([^`]+)`")


def test_every_ledger_entry_has_a_tag_and_a_where_that_exists():
    rows = ledger_rows()
    assert len(rows) >= 40, f"the ledger's claim tables hold {len(rows)} rows: is it parsed?"
    problems = []
    for ident, tags, where in rows:
        named = re.findall(r"\b(%s)\b" % "|".join(TAGS), tags)
        if not named:
            problems.append(f"{ident}: no tag in {tags!r}")
        found = WHERE.findall(where)
        if {"IMPLEMENTED", "MEASURED"} & set(named) and not found:
            problems.append(f"{ident}: {'/'.join(named)} needs a where (fn, test, cmd, file)")
        if "IMPLEMENTED" in named and not any(k == "test" for k, _ in found):
            problems.append(f"{ident}: IMPLEMENTED needs the test that proves it")
        if "UNKNOWN" in named and "gpu-check" not in where and "establish" not in where.lower():
            problems.append(f"{ident}: UNKNOWN must say what would establish it")
        for kind, value in found:
            problems += [f"{ident}: {p}" for p in where_problems(kind, value)]
    assert not problems, "ledger entries:\n" + "\n".join(problems)
    assert len({r[0] for r in rows}) == len(rows), "ledger ids repeat"


def test_the_ledger_check_fails_on_a_missing_where():
    assert where_problems("fn", "muon_zero.newton_schulz") == []
    assert where_problems("fn", "memory.memory_timeline.MemoryTimeline._held_for_backward") == []
    assert where_problems("fn", "muon_zero.no_such_function")
    assert where_problems("test", "tests/test_muon_zero.py::test_no_such_test")
    assert where_problems("make", "gpu-check") == [] and where_problems("make", "no-such-target")
    assert where_problems("cmd", "python benchmarks/no_such_bench.py")


def test_the_ledger_defines_the_six_tags_as_the_specification_does():
    text = markdown_of(os.path.join(ROOT, LEDGER))
    spec = {
        "PAPER": "stated by DeepSeek",
        "DERIVED": "mathematically implied",
        "IMPLEMENTED": "reproduced in this project",
        "MEASURED": "observed in our experiments",
        "INFERRED": "our interpretation",
        "UNKNOWN": "not established",
    }
    for tag, words in spec.items():
        assert re.search(rf"\*\*{tag}\*\*[^\n]*{words}", text), f"the ledger must define {tag}"


# ---- tags in the lessons ----


def _takeaway_and_captions(nb):
    """(label, markdown) of a notebook's takeaway and of the cell that reads each figure."""
    found, cells = [], nb.cells
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown" and "## Takeaway" in cell.source:
            found.append((f"cell {i} (takeaway)", cell.source.split("## Exercises")[0]))
        images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        if cell.cell_type == "code" and images:
            after = range(i + 1, len(cells))
            j = next((j for j in after if cells[j].cell_type == "markdown"), None)
            if j is not None:
                found.append((f"cell {j} (reads the figure of cell {i})", cells[j].source))
    return found


def test_every_number_in_a_takeaway_or_a_figure_caption_carries_its_tag():
    untagged = []
    for path in NOTEBOOKS:
        nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
        for label, text in _takeaway_and_captions(nb):
            numbers = NUMBER.findall(_prose(text))
            if numbers and not TAG.search(text):
                untagged.append(f"{path} {label}: states {numbers[:3]} without a tag")
    assert not untagged, "numbers without an evidence tag:\n" + "\n".join(untagged)
    assert NUMBER.findall("a jump of 11.7 MiB, 9.7× faster, 1.2e-12") and not NUMBER.findall(
        "step 2 of a 2 x 2 x 1 layout, V4 §3.4.1"
    )


# ---- tags in the docs' prose ----

# a figure in prose: a number followed by a unit or %, not a count ("4 steps") nor a setting
# ("60 s by default"); the grader's documents state its settings (limits, timeouts, thresholds)
UNIT_FIGURE = re.compile(
    r"(?<![\w.§/-])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*(?:%|[KMGT]iB\b|[KMGT]B\b|Gb/s|"
    r"bytes?\b|B\b|ms\b|µs\b|s\b|×(?!\s*\d)|[MGT]?FLOP\b|ulp\b)(?!\s*by default)"
)
SETTINGS = {"docs/grading.md", "docs/assignments.md", "ASSIGNMENTS.md"}
SENTENCE_END = re.compile(r"(?<=[.!?])(?<!e\.g\.)(?<!i\.e\.)(?<!vs\.)\s+(?=[A-Z(\[*`\"])")


def prose_sentences(text):
    """The sentences of markdown ``text``'s paragraphs and list items: code blocks, HTML comments,
    headings and tables (tagged per table) left out, line breaks joined."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", text):
        if not block.lstrip().startswith(("|", "#")):
            yield from SENTENCE_END.split(" ".join(block.split()))


def untagged_figures(text):
    """Each sentence of ``text`` that states a figure with a unit or % and carries no tag."""
    return [
        s
        for s in prose_sentences(text)
        if UNIT_FIGURE.search(re.sub(r"`[^`]*`", "", s)) and not TAG.search(s)
    ]


def test_every_sentence_of_the_docs_that_states_a_figure_carries_its_tag():
    """V4's figures and ours are told apart in prose as in the tables: a sentence of the README
    or a chapter's document that states a number with a unit or % carries [PAPER], [MEASURED],
    ... inline (the ledger says where each comes from)."""
    untagged = []
    for doc in DOCS:
        if doc not in SETTINGS:
            found = untagged_figures(markdown_of(os.path.join(ROOT, doc)))
            untagged += [f"{doc}: {s[:160]}" for s in found]
    assert not untagged, "figures without an evidence tag:\n" + "\n".join(untagged)


def test_the_sentence_check_finds_an_untagged_figure_and_skips_code_tables_and_settings():
    text = (
        "# Title 4 MiB\n\nIt ran 1.22× its reference [MEASURED]. V4 reports 6.7%, e.g. on a GPU.\n"
        "A count of 4 steps, a timeout of 60 s by default, `python x.py  # 9 MiB`.\n\n"
        "| layout | 12 MiB |\n|---|---|\n\n```\nprint('5 GiB')\n```\n- Kept 49 bytes [DERIVED].\n"
        "- Saved 3.77 MiB\nacross two lines.\n"
    )
    assert untagged_figures(text) == [
        "V4 reports 6.7%, e.g. on a GPU.",
        "- Saved 3.77 MiB across two lines.",
    ]


# ---- statements the docs make about the code ----


def test_the_syllabus_mapping_is_the_same_in_the_readme_and_the_assignments():
    readme = markdown_of(os.path.join(ROOT, "README.md"))
    guide = markdown_of(os.path.join(ROOT, "docs/assignments.md"))
    lines = re.findall(r"^Syllabus: (.*?)\n(?=- )", guide, flags=re.M | re.S)
    stated = {i: re.findall(r"\b(\d\d) ", line) for i, line in enumerate(lines)}
    rows = re.findall(r"^\| `[^|]*\|[^|]*\| (\d\d .*) \|$", readme, flags=re.M)
    readme_topics = [re.findall(r"\b(\d\d) ", r) for r in rows]
    assert readme_topics == list(stated.values()), (
        f"README's 'What teaches what' topics {readme_topics} differ from docs/assignments.md's "
        f"Syllabus lines {list(stated.values())}"
    )


# what a checkout holds that git does not (.gitignore): make's outputs and Python's cache
UNTRACKED = {"build", "results", "__pycache__"}


def layout_names(readme):
    """The names README's Layout block lists in its first column: files, folders/, .ci/run."""
    block = re.search(r"^## Layout\n\n```\n(.*?)^```", readme, flags=re.M | re.S).group(1)
    names = set()
    for line in block.splitlines():
        for word in re.split(r"\s{2,}", line.strip()):
            if re.fullmatch(r"[\w.-]+(/|\.\w+)|Makefile|\.ci/run", word):
                names.add(word.rstrip("/").split("/")[0])
    return names


def test_the_readme_layout_is_the_root_as_it_is():
    """Every entry of the repository root is in README's Layout block, and nothing else is."""
    listed = layout_names(markdown_of(os.path.join(ROOT, "README.md")))
    root = {n for n in os.listdir(ROOT) if n not in UNTRACKED and not n.startswith(".")}
    root |= {".ci"}  # the one hidden entry a reader needs: CI's script
    assert listed == root, (
        f"README's Layout block differs from the root: not listed {sorted(root - listed)}, "
        f"listed but absent {sorted(listed - root)}"
    )


def test_the_imports_each_chapter_is_said_to_have_are_its_imports():
    """docs/running.md's table names each technique file's imports from this repository."""
    text = markdown_of(os.path.join(ROOT, "docs/running.md"))
    local = {p.split(".")[0] for p in os.listdir(ROOT)}
    for name in ("muon_zero.py", "mhc.py", "cp_compress.py", "tensor_ckpt.py"):
        row = re.search(rf"^\| `{re.escape(name)}` \| (.*) \|$", text, flags=re.M)
        assert row, f"docs/running.md's imports table has no row for {name}"
        stated = set(re.findall(r"`([\w./]+?)/?`", row.group(1)))
        with open(os.path.join(ROOT, name)) as f:
            tree = ast.parse(f.read())
        actual = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                actual |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                actual.add(node.module.split(".")[0])
        actual = {a + ".py" if os.path.exists(os.path.join(ROOT, a + ".py")) else a for a in actual}
        actual = {a for a in actual if a.split(".")[0] in local}
        assert stated == actual, f"{name} imports {sorted(actual)}, docs/running.md says {stated}"


@pytest.mark.parametrize("name", ["muon_zero", "mhc", "cp_compress", "tensor_ckpt", "compose"])
def test_help_prints_one_default_per_option(name):
    module = __import__(name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.parse_args(["--help"])
    options = re.split(r"\n  -", out.getvalue())
    doubled = [o.split()[0] for o in options if len(re.findall(r"\bdefault\b", o)) > 1]
    assert not doubled, f"{name}.py --help prints two defaults for {doubled}"


def test_the_assignments_are_listed_in_the_notebooks_order():
    """Assignment 1 is memory_timeline (notebook 00): every later notebook measures memory with
    its recorder, so the generated table and its order list it first, as docs/assignments.md."""
    text = markdown_of(os.path.join(ROOT, "ASSIGNMENTS.md"))
    order = re.findall(r"^- `([\w/.]+\.py)`: ", text, flags=re.M)
    assert order and order[0] == "memory_timeline.py", f"the order to implement lists {order}"
    guide = markdown_of(os.path.join(ROOT, "docs/assignments.md"))
    headings = re.findall(r"^## \d\. `([\w/.]+)`", guide, flags=re.M)
    files = [os.path.basename(f) for f in assignments.ASSIGNMENT_FILES]
    assert [os.path.basename(h) for h in headings] == files[: len(headings)], (headings, files)
