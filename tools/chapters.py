"""How each chapter reads: total lines, where the appendix fence sits, where its protocol starts.

    python tools/chapters.py          # the table, with each file's targets
    python tools/chapters.py --check  # exit 1 when a file misses a target
    python tools/chapters.py --contract  # docs/CHAPTERS.md's table, measured

A chapter is judged by how soon a reader meets the technique's heart and its distributed step:
the line where each protocol function is defined, against the target for that file.
"""

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = ("# ---- appendix", "# ==== appendix")
# file: (most lines, [(protocol function or class, starts before line)])
TARGETS = {
    "muon_zero.py": (650, [("sharded_step", 400)]),
    "mhc.py": (800, [("RecomputedBlock", 400), ("pipeline_step", 650)]),
    "cp_compress.py": (650, [("context_parallel_compress", 400)]),
    "tensor_ckpt.py": (700, [("run_forgetting", 400)]),
    "memory/memory_timeline.py": (600, []),
    "launch.py": (200, []),
}


def stats(path, protocols):
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    fence = next((i for i, line in enumerate(lines, 1) if line.startswith(FENCE)), None)
    tree = ast.parse(text)
    defined = {
        node.name: node.lineno
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    doc = ast.get_docstring(tree) or ""
    return len(lines), fence, len(doc.splitlines()), [(p, defined.get(p), b) for p, b in protocols]


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


def contract(name, text=None):
    """One chapter's row: (path lines, fence or None, {file: uses before the fence},
    (longest function, its lines), sys.modules reach-backs before the fence, the chapter's own
    functions handed to another project file: a helper that calls back into the chapter).
    text: the source to measure instead of the file's (the tests' planted breaches)."""
    if text is None:
        with open(os.path.join(ROOT, name)) as f:
            text = f.read()
    lines = text.splitlines()
    fence = next((i for i, line in enumerate(lines, 1) if line.startswith(FENCE)), None)
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
    reach = sum(1 for n in ast.walk(tree) if n_reaches_back(n) and n.lineno < end)
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


def n_reaches_back(node):
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


def contract_table():
    """The markdown table docs/CHAPTERS.md carries between its markers, generated here."""
    rows = [
        "| chapter | path (lines before the fence) | fence | other files the path sends a "
        "reader to (uses before the fence) | count beyond launch.py | longest function on the path "
        "| sys.modules reach-backs | chapter functions handed out (call-backs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in CHAPTERS:
        path, fence, uses, (fn, length), reach, handed = contract(name)
        sent = ", ".join(f"{f} ({n})" for f, n in sorted(uses.items())) or "-"
        beyond = sum(1 for f in uses if f not in SHARED)
        back = ", ".join(handed) or "-"
        rows.append(
            f"| {name} | {path} | {fence or 'none'} | {sent} | {beyond} "
            f"| {fn} ({length}) | {reach} | {back} |"
        )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--contract", action="store_true", help="print docs/CHAPTERS.md's table and stop"
    )
    args = parser.parse_args(argv)
    if args.contract:
        print(contract_table())
        return 0
    missed = []
    print(f"{'file':<28}{'lines':>7}{'target':>8}{'fence':>7}{'docstring':>11}  protocol (line)")
    for name, (most, protocols) in TARGETS.items():
        path = os.path.join(ROOT, name)
        if not os.path.exists(path):
            missed.append(f"{name}: missing")
            continue
        total, fence, doc, where = stats(path, protocols)
        shown = ", ".join(f"{p} {line} (< {before})" for p, line, before in where)
        print(f"{name:<28}{total:>7}{most:>8}{fence or '-':>7}{doc:>11}  {shown}")
        if total > most:
            missed.append(f"{name}: {total} lines, target {most}")
        for p, line, before in where:
            if line is None or line >= before:
                missed.append(f"{name}: {p} at line {line}, target before {before}")
    for m in missed:
        print("MISSED", m)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
