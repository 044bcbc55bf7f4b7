"""The chapter contract (docs/CHAPTERS.md), measured: what each chapter's path sends a reader to,
and whether the file keeps the contract's shape.

    python tools/chapters.py             # the table, then what each file misses of the shape
    python tools/chapters.py --check     # exit 1 when a chapter misses part of the shape
    python tools/chapters.py --contract  # docs/CHAPTERS.md's table, to paste between its markers
    python tools/chapters.py --check new_chapter.py   # a chapter being written, before it is listed

No line cap: a chapter is as long as its technique; the table says how far its path runs.
"""

import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = ("# ---- appendix", "# ==== appendix")
BEATS = ("What the standard tool assumes", "What V4", "The fix")
SECTION = re.compile(r"# ---- (\d+)\. ")  # a numbered section of the technique


# ---- the chapter contract (docs/CHAPTERS.md): what the technique's path sends a reader to ----

CHAPTERS = ["muon_zero.py", "mhc.py", "cp_compress.py", "tensor_ckpt.py", "compose.py"]
SHARED = {"launch.py"}  # the one module every chapter may lean on
BEGIN, END = "<!-- chapter-contract:begin -->", "<!-- chapter-contract:end -->"


def project_file(module, name=None):
    """'interop.x' (and an imported name) -> the project file a reader opens, or None (not ours)."""
    base = os.path.join(ROOT, *module.split("."))
    candidates = [os.path.join(base, name + ".py")] if name else []
    candidates += [base + ".py", os.path.join(base, "__init__.py")]
    for c in candidates:
        if os.path.exists(c):
            return os.path.relpath(c, ROOT)
    return None


def bindings(tree, fence):
    """{local name: project file} for every import before the fence (top level or inside a def)."""
    bound = {}
    for node in ast.walk(tree):
        if getattr(node, "lineno", fence) >= fence:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                path = project_file(a.name)
                if path:
                    bound[a.asname or a.name.split(".")[0]] = path
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                path = project_file(node.module, a.name)
                if path:
                    bound[a.asname or a.name] = path
    return bound


def read(name, text=None):
    """A chapter's source (``text`` instead of the file's: the tests' planted files), its lines and
    the line of its appendix fence, or None."""
    if text is None:
        with open(os.path.join(ROOT, name)) as f:
            text = f.read()
    lines = text.splitlines()
    return text, lines, next((i for i, line in enumerate(lines, 1) if line.startswith(FENCE)), None)


def contract(name, text=None):
    """One chapter's row: (path lines, fence or None, {file: uses before the fence},
    (longest function, its lines), sys.modules reach-backs before the fence, the chapter's own
    functions handed to another project file: a helper that calls back into the chapter).
    text: the source to measure instead of the file's (the tests' planted breaches)."""
    text, lines, fence = read(name, text)
    end = fence or len(lines) + 1
    tree = ast.parse(text)
    bound = bindings(tree, end)
    uses = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in bound and node.lineno < end:
            uses[bound[node.id]] = uses.get(bound[node.id], 0) + 1
    funcs = [
        (n.end_lineno - n.lineno + 1, n.name)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno < end
    ]
    longest = max(funcs) if funcs else (0, "-")
    reach = sum(1 for n in ast.walk(tree) if reaches_back(n) and n.lineno < end)
    own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    handed = sorted(
        {
            a.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and n.lineno < end and calls_into(n.func, bound)
            for a in n.args + [k.value for k in n.keywords]
            if isinstance(a, ast.Name) and a.id in own
        }
    )
    return end - 1, fence, uses, (longest[1], longest[0]), reach, handed


def reaches_back(node):
    """sys.modules[__name__] or sys.modules.get(__name__): the module reaching back into itself
    (another module looked up there, numpy's if it is loaded, is no reach-back)."""
    if isinstance(node, ast.Subscript):
        table, key = node.value, node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        table, key = node.func.value if node.func.attr == "get" else None, node.args[0]
    else:
        return False
    is_modules = (
        isinstance(table, ast.Attribute)
        and table.attr == "modules"
        and isinstance(table.value, ast.Name)
        and table.value.id == "sys"
    )
    return is_modules and isinstance(key, ast.Name) and key.id == "__name__"


def calls_into(func, bound):
    """True when a call's callee is a name imported from a project file (or an attribute of one)."""
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id in bound


def shape_problems(name, text=None):
    """What a chapter file misses of the contract's shape ("The file, top to bottom"): the
    docstring's three beats in order, numbered sections before the fence, the fence, then
    ``parse_args`` and ``demo(args, rank, world, device)``, and last ``launch.run(demo,
    parse_args())`` under ``if __name__ == "__main__"``. -> [] when it keeps all of it."""
    text, lines, fence = read(name, text)
    tree, problems = ast.parse(text), []
    doc = ast.get_docstring(tree) or ""
    at = [doc.find(beat) for beat in BEATS]
    if -1 in at or at != sorted(at):
        problems.append(f"the module docstring's three beats, in order: {', '.join(BEATS)}")
    if fence is None:
        problems.append("the appendix fence: a line starting '# ---- appendix'")
    numbers = [int(m[1]) for line in lines[: fence or len(lines)] if (m := SECTION.match(line))]
    if not numbers or numbers != list(range(1, len(numbers) + 1)):
        problems.append(
            f"sections '# ---- 1. title' before the fence, numbered in order: {numbers}"
        )
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    demo, parse = defs.get("demo"), defs.get("parse_args")
    if demo is None or [a.arg for a in demo.args.args] != ["args", "rank", "world", "device"]:
        problems.append("demo(args, rank, world, device), the entry launch.run calls")
    if parse is None:
        problems.append("parse_args(argv=None), every argument checked before any process group")
    if fence and any(f is not None and f.lineno < fence for f in (demo, parse)):
        problems.append("parse_args and demo below the fence")
    last = tree.body[-1] if tree.body else None
    runs = last is not None and isinstance(last, ast.If) and "__main__" in ast.unparse(last.test)
    if not (runs and "launch.run(demo, parse_args())" in ast.unparse(last)):
        problems.append('last: if __name__ == "__main__": launch.run(demo, parse_args())')
    return problems


def contract_table():
    """The markdown table docs/CHAPTERS.md carries between its markers, generated here."""
    rows = [
        "| chapter | path (lines before the fence) | fence | other files the path sends a "
        "reader to (uses before the fence) | count beyond launch.py | longest function on the path "
        "| sys.modules reach-backs | chapter functions handed out (call-backs) "
        "| the file's shape (tools/chapters.py --check) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in CHAPTERS:
        path, fence, uses, (fn, length), reach, handed = contract(name)
        sent = ", ".join(f"{f} ({n})" for f, n in sorted(uses.items())) or "-"
        beyond = sum(1 for f in uses if f not in SHARED)
        back = ", ".join(handed) or "-"
        shape = "; ".join(shape_problems(name)) or "kept"
        rows.append(
            f"| {name} | {path} | {fence or 'none'} | {sent} | {beyond} "
            f"| {fn} ({length}) | {reach} | {back} | {shape} |"
        )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help=f"chapter files (default: {' '.join(CHAPTERS)})")
    parser.add_argument("--check", action="store_true", help="exit 1 when a file misses the shape")
    parser.add_argument(
        "--contract", action="store_true", help="print docs/CHAPTERS.md's table and stop"
    )
    args = parser.parse_args(argv)
    if args.contract:
        print(contract_table())
        return 0
    missed = 0
    for name in args.files or CHAPTERS:
        path, fence, uses, (fn, length), reach, handed = contract(name)
        beyond = sorted(f for f in uses if f not in SHARED)
        print(f"{name}: path {path} lines, fence {fence}, other files {beyond or '-'}, ", end="")
        print(f"longest function {fn} ({length})")
        for problem in shape_problems(name) + [f"a call-back handed out: {h}" for h in handed]:
            print(f"  MISSES {problem}")
            missed += 1
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
