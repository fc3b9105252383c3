"""Workshop exercises: re-implement a technique's core, then let the project's own tests check your copy.

    python tests/exercise.py ddp.py --out mine          # writes mine/ddp.py with the key functions emptied
    # ... write them (each raises NotImplementedError("exercise N: what to write") until you do) ...
    python -m pytest -q --impl mine tests/test_ddp.py    # exactly the tests that check ours, on your copy

`pytest --impl DIR` runs every technique test on the files in DIR (the repository's own for those DIR lacks),
imported in-process and launched under torchrun alike; a failing test also says which step's loss differs
first from its reference and what that usually means (the hints below). `python tests/exercise.py --list`
shows every file's exercises. The functions to write are listed here, not marked in the lesson.
"""
import argparse
import ast
import os
import sys

# file -> [(function or Class.method, what to write)], in the order a reader meets them
EXERCISES = {
    "ddp.py": [
        ("DataParallel.take_grad", "copy p.grad into its slice of the bucket, divided by the world size (a mean), "
                                   "then drop p.grad and mark the slice ready"),
        ("DataParallel._launch_ready_buckets", "launch every complete bucket, strictly in index order (every rank "
                                               "must issue the same all-reduces in the same order)"),
        ("DataParallel.launch", "start the bucket's all-reduce asynchronously (async_op=True), keep the work "
                                "in b.work, count its bytes with self.meter.all_reduce"),
        ("DataParallel.wait", "wait for the bucket's all-reduce, if one is in flight, and forget its work"),
    ],
}

# test module -> what a difference from the reference usually means
HINTS = {
    "test_ddp": "a loss that differs from step 1 on: are gradients divided by the world size (a mean, not a sum), "
                "and every bucket waited for before the optimizer step? A hang or a timeout: do all ranks launch "
                "the buckets in the same order?",
}


def hint_for(test_module):
    return HINTS.get(test_module.rsplit(".", 1)[-1])


def find(tree, dotted):
    """The FunctionDef of `name` or `Class.name` at the top level of a module."""
    scope = tree.body
    *outer, name = dotted.split(".")
    for cls in outer:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls).body
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise KeyError(f"{dotted} not found")


def cut(source, exercises):
    """The source with each listed function's body (its docstring kept) replaced by a NotImplementedError."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    spans = []
    for n, (dotted, what) in enumerate(exercises, 1):
        fn = find(tree, dotted)
        body = fn.body
        keep_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str)
        first = body[1] if keep_doc and len(body) > 1 else None if keep_doc else body[0]
        indent = " " * body[0].col_offset
        stub = f'{indent}raise NotImplementedError("exercise {n}: {dotted}: {what}")\n'
        if first is None:
            spans.append((body[0].end_lineno, body[0].end_lineno, stub))
        else:
            spans.append((first.lineno - 1, fn.end_lineno, stub))
    for start, end, stub in sorted(spans, reverse=True):
        lines[start:end] = [stub]
    return "".join(lines)


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description="Write a technique file with its core's key functions to re-implement.")
    p.add_argument("file", nargs="?", choices=sorted(EXERCISES), help="the technique file")
    p.add_argument("--out", help="directory for your copy (then: pytest --impl DIR)")
    p.add_argument("--list", action="store_true", help="print every file's exercises")
    a = p.parse_args(argv)
    if a.list or not a.file:
        for f, items in EXERCISES.items():
            print(f)
            for n, (dotted, what) in enumerate(items, 1):
                print(f"  exercise {n}: {dotted}: {what}")
        return
    if not a.out:
        sys.exit("error: where to write your copy (--out): give a directory, e.g. --out mine")
    dst = os.path.join(a.out, a.file)
    if os.path.exists(dst):
        sys.exit(f"error: {dst} exists (--out): your work is never overwritten; choose another directory")
    with open(os.path.join(root, a.file)) as f:
        text = cut(f.read(), EXERCISES[a.file])
    os.makedirs(a.out, exist_ok=True)
    with open(dst, "w") as f:
        f.write(text)
    print(f"wrote {dst} with {len(EXERCISES[a.file])} exercises; test it with: "
          f"python -m pytest -q --impl {a.out} tests/test_{a.file[:-3]}.py")


if __name__ == "__main__":
    main()
