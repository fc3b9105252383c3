"""Workshop exercises: re-implement a technique's core, then let the project's own tests check your copy.

    python tests/exercise.py ddp.py --out mine          # writes mine/ddp.py with the key functions emptied
    # ... write them (each raises NotImplementedError("exercise N: what to write") until you do) ...
    python -m pytest -q --impl mine tests/test_ddp.py    # exactly the tests that check ours, on your copy

    python tests/exercise.py ddp.py --core --out handout  # handout/ddp.py: the core alone (it trains), + gpt2.py
    python tests/exercise.py ddp.py --bug list           # the bug zoo: plausible bugs, each with its symptom
    python tests/exercise.py ddp.py --bug 2 --out zoo    # zoo/ddp.py with bug 2 planted: find it

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
    "fsdp2.py": [
        ("ShardedUnit.unshard", "wait for the unit's all-gather (start_gather issues it), give each padded "
                                "parameter its storage back and copy every rank's rows into it"),
        ("ShardedUnit.reshard", "free each padded parameter's storage (resize it to 0 bytes), keeping the tensor"),
        ("ShardedUnit.reduce_scatter_grads", "lay the full gradients out as the gathered buffer (row k = rank k's "
                                             "rows, fp32) and reduce-scatter (SUM) it asynchronously; return "
                                             "(work, out, buf)"),
    ],
    "tensor_parallel.py": [
        ("CopyToTP.backward", "f's backward: all-reduce (sum) the input gradient over the TP group"),
        ("ReduceFromTP.forward", "g's forward: all-reduce (sum) the partial outputs over the TP group"),
        ("ParallelBlock.forward", "the block written literally: f -> column matmul -> attention -> row matmul -> g, "
                                  "then the bias once, twice (attention, MLP), with the residuals"),
        ("VocabParallelCrossEntropy.forward", "the mean cross-entropy from (N, V/t) logit shards: all-reduce the "
                                              "row max (MAX), then [sum of exp, target logit] (SUM); save the "
                                              "softmax for backward"),
    ],
    "pipeline.py": [
        ("one_f_one_b", "1F1B's op list for one rank: P-1-rank warm-up forwards, then one forward one backward, "
                        "then the remaining backwards"),
        ("Pipeline.run", "one step: issue the receives planned before the first op, then for each op: receive, "
                         "compute, send (with the batch planned after it); wait for the sends; return the loss"),
    ],
    "moe_ep.py": [
        ("AllToAll.backward", "the gradient of a received row goes back to its sender: the same exchange with the "
                              "splits swapped"),
        ("plan_dispatch", "sort the assignments by expert (keep_within_capacity), exchange the per-expert counts "
                          "(all_to_all_single), and derive send/recv splits and rows per local expert: the Plan"),
        ("combine_tokens", "the reverse exchange (splits swapped), then put each row back at its assignment "
                           "(index_copy into zeros: dropped assignments stay 0)"),
    ],
    "muon.py": [
        ("muon_update", "update the momentum (EMA form: lerp towards grad), take the Nesterov look-ahead, and "
                        "orthogonalise it as `parts` stacked row blocks"),
        ("Muon.reduce_scatter_grads", "copy each gradient into its owner's slab of self.flat, reduce-scatter "
                                      "into self.own and divide by the world size: the owners' mean gradients"),
        ("Muon.all_gather_params", "all-gather every owner's updated matrices (self.send -> self.recv) and copy "
                                   "the ones this rank does not own into the parameters"),
    ],
    "checkpoint.py": [
        ("write_durably", "write path.tmp, fsync it, rename it to path, fsync the directory; return (bytes, crc32)"),
        ("SyncCheckpointer.commit", "rank 0, once every shard is durable: the manifest (shards with their global "
                                    "[lo, hi), bytes, crc32; step, world, loader position, schedule) written last"),
        ("SyncCheckpointer.read_slices", "for this rank's [lo, hi): copy the overlap of every shard that covers "
                                         "it (any number of writers), and this rank's RNG state"),
        ("SyncCheckpointer.resume", "the slices into the weights (then all-gather) and AdamW's moments with "
                                    "their step count, the RNG states, the loader position; return the step"),
        ("AsyncCheckpointer.save", "wait for the previous save, take the snapshot on the training thread, then "
                                   "write_and_commit it in a thread (self.thread) while training goes on"),
    ],
    "fp8.py": [
        ("quantize_1x128", "one scale per row per 128 columns: amax / 448 (powers of 2 when pow2), e4m3 values"),
        ("_fp8_matmul_emulated", "for each 128-wide K chunk: the fp8 chunk product in fp32, scaled by the row's "
                                 "and the column's chunk scales, accumulated in fp32"),
    ],
}

# test module -> what a difference from the reference usually means
HINTS = {
    "test_ddp": "a loss that differs from step 1 on: are gradients divided by the world size (a mean, not a sum), "
                "and every bucket waited for before the optimizer step? A hang or a timeout: do all ranks launch "
                "the buckets in the same order?",
    "test_fsdp2": "different from step 1 on: is the reduce-scatter a SUM then divided by the world size, and does "
                  "each rank's row k hold rank k's rows of every gradient? A crash in backward ('modified by an "
                  "inplace operation'): refill the padded tensor through .data, keep the tensor, free its storage.",
    "test_tensor_parallel": "wrong from step 0: f and g are conjugates (f: identity forward, all-reduce backward; g: "
                            "all-reduce forward, identity backward) and the row-parallel bias is added once, after g; "
                            "the loss needs the global row max and the global sum of exp.",
    "test_pipeline": "a hang: every receive must be issued in the batch the plan gives it (plan[rank][i + 1] after "
                     "op i); a wrong loss: the last stage scales each micro-batch's loss by 1/M.",
    "test_moe_ep": "EP differs from one rank: combine must swap dispatch's splits, and backward is the same "
                   "exchange with the splits swapped; a hang: every rank exchanges counts before rows.",
    "test_muon": "one rank already differs from torch.optim.Muon: the momentum is an EMA (lerp) and Nesterov "
                 "looks ahead from it; several ranks differ from one: each owner must get the MEAN gradient "
                 "(reduce-scatter, then / world) and every rank must copy back the matrices it does not own.",
    "test_checkpoint": "a resume that is not bit-exact: AdamW's step count (bias correction), the RNG state and "
                       "the loader position are part of the state, and the snapshot must be a copy; a durability "
                       "failure: write path.tmp, fsync it, rename, fsync the directory, and rank 0 commits the "
                       "manifest only after the all-gather of every rank's (bytes, crc32).",
    "test_fp8": "errors far above the figures: one scale per 1x128 tile (amax over the 128 values of a row), and the "
                "GEMM scales each 128-wide chunk's product before adding it into the fp32 accumulator.",
}


# The round trip a course maintainer runs (`--check`): one test per file, a copy with one deliberate bug each
# (the original line, the bug), expected to fail with a `what differs` section or the hint.
CHECKS = {
    "ddp.py": ("two_ranks_match_one_process", ("1.0 / self.world", "1.0")),  # gradients summed, not averaged
    "fsdp2.py": ("both_modes_match", ("out /= dist.get_world_size()", "out /= 1")),  # reduce-scatter summed
    "tensor_parallel.py": ("parallel_layers_dtensor", ("return all_reduce(grad.contiguous(), ctx.grid), None",
                                                       "return grad, None")),  # f's backward without its all-reduce
    "pipeline.py": ("two_ranks_every_schedule", ("out = self.model.head_loss(h, ys[mb]) * self.scale",
                                                 "out = self.model.head_loss(h, ys[mb])")),  # losses not scaled by 1/M
    "moe_ep.py": ("expert_parallel_equals_one_process", ("    flat /= world\n", "    flat /= n\n")),  # / EP group
    "fp8.py": ("fp8_matmul_vs_fp64", ("acc += partial * a_scales[:, k, None] * b_rows[None, :, k]",
                                      "acc += partial * a_scales[:, k, None] * b_rows[None, :, 0]")),  # every chunk, chunk 0's scale
    "muon.py": ("distributed_muon_equals_one_rank", ("self.own /= self.world", "self.own /= 1")),  # owners sum
    "checkpoint.py": ("bit_exact_resume_on_two_ranks", ('loader.load_state_dict(man["loader"])', "pass")),  # data
}


# The bug zoo: file -> [(name, the original text (unique in the file), the bug, the symptom a student sees,
# the test that catches it as a pytest -k expression, a phrase its `what differs` or failure message contains)].
# Workshop material ("find the bug") and the measure of the tests: `--check` proves each is caught and named.
BUGS = {
    "ddp.py": [
    ],

    "fsdp2.py": [
    ],

    "tensor_parallel.py": [
    ],

    "pipeline.py": [
    ],

    "moe_ep.py": [
    ],

    "fp8.py": [
    ],

    "muon.py": [
    ],

    "checkpoint.py": [
        ("the rename before the fsync",
         "        os.fsync(f.fileno())  # the bytes on disk before the name: a crash never leaves `path` half-written\n"
         "    os.replace(path + \".tmp\", path)  # atomic: path is the old file or the new one, never a mix\n",
         "        os.replace(path + \".tmp\", path)  # atomic: path is the old file or the new one, never a mix\n"
         "        os.fsync(f.fileno())  # the bytes on disk before the name: a crash never leaves `path` half-written\n",
         "training and resuming look fine; after a power loss a committed name can point at empty or torn bytes",
         "fsynced_then_renamed", "were not fsynced before the rename"),
        ("no fsync of the directory after the rename",
         "    fsync_dir(os.path.dirname(path))  # the rename itself durable\n", "",
         "training and resuming look fine; after a power loss the rename (the commit itself) can be undone",
         "fsynced_then_renamed", "was not fsynced after the rename"),
        ("rank 0 commits before the other shards are durable",
         "        with self.timeline.compute(\"gather\", \"all_gather\"):  # every rank's (bytes, crc32) to every rank\n"
         "            reports = report.repeat(self.ctx.world, 1)\n"
         "            if self.group is not None:  # returns once every shard is durable\n"
         "                all_gather_single(reports.view(-1), report, group=self.group)\n"
         "        if self.ctx.master:\n"
         "            with self.timeline.compute(f\"commit {step}\", \"io\"):\n"
         "                self.commit(step, d, reports, meta[\"loader\"])\n",
         "        reports = report.repeat(self.ctx.world, 1)\n"
         "        if self.ctx.master:\n"
         "            with self.timeline.compute(f\"commit {step}\", \"io\"):\n"
         "                self.commit(step, d, reports, meta[\"loader\"])\n"
         "        with self.timeline.compute(\"gather\", \"all_gather\"):  # every rank's (bytes, crc32) to every rank\n"
         "            if self.group is not None:  # returns once every shard is durable\n"
         "                all_gather_single(reports.view(-1), report, group=self.group)\n",
         "resumes work; a crash between the commit and a slow rank's write leaves a committed checkpoint with a "
         "missing shard, and the manifest lists rank 0's checksum for every shard",
         "fsynced_then_renamed", "renamed into place before rank 1's shard was durable"),
        ("gradients summed over the ranks, not averaged",
         "            self.grad_shard.div_(self.world)\n", "",
         "the loss curve stays close to gpt2.py's (AdamW divides a constant scale away); the moments are N times too big",
         "mean_gradient", "the reduce-scatter SUMs the ranks"),
        ("AdamW's step count not restored",
         "torch.tensor(float(step))", "torch.tensor(0.0)",
         "the resumed loss jumps at the first step after the resume (the bias correction starts over)",
         "every_piece", "AdamW's step count"),
        ("the RNG state not restored",
         "            torch.set_rng_state(rng[\"rng_cpu\"])\n", "            pass\n",
         "nothing visible here (no dropout); with dropout or sampling the resumed run leaves the straight one",
         "every_piece", "CPU RNG state"),
        ("the loader position not restored",
         "loader.load_state_dict(man[\"loader\"])  # a token offset", "pass  # a token offset",
         "the resumed curve differs from the straight one from the first resumed step: it trains on data seen before",
         "every_piece", "loader position"),
        ("the snapshot a view of the live state",
         "out = {k: v.to(\"cpu\", copy=True) for k, v in out.items()}", "out = {k: v.to(\"cpu\") for k, v in out.items()}",
         "on CPU, a checkpoint holds weights from a later step than its name says; a resume from it is not bit-exact",
         "snapshot_is_a_copy and Async", "not a copy"),
        ("resharding reads each shard at this rank's offset",
         "tensors[k][a - sh[\"lo\"]: b - sh[\"lo\"]]", "tensors[k][a - z.lo: b - z.lo]",
         "a resume on as many ranks as wrote it works; on another world size it crashes or loads the wrong weights",
         "every_piece", "read_slices"),
    ],
}

BANNER = "# ---- Beyond the core ----"


def core_copy(source):
    """The file cut at the banner, started by its core's own main(): the handout (issue 30: the core runs alone)."""
    assert source.count(BANNER) == 1, "no '# ---- Beyond the core ----' banner"
    core = source[: source.index(BANNER)].rstrip("\n")
    return core + '\n\n\nif __name__ == "__main__":\n    gpt2.run_main(main)\n'


def plant(source, bug):
    """The source with one zoo bug planted."""
    name, original, buggy = bug[:3]
    assert source.count(original) == 1, f"bug {name!r}: its original text is not unique in the file: {original!r}"
    return source.replace(original, buggy)


def run_pytest(root, impl, test, basetemp, k=None):
    import subprocess
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
                           "--impl", impl, test, *(["-k", k] if k else [])], cwd=root, capture_output=True, text=True,
                          timeout=1200)


def check_zoo(name, root, work, only=None):
    """Each zoo bug of `name` fails its test, and the failure names it (its phrase appears in the output).
    Returns [(bug number, bug name, caught, named, the first line of `what differs` or of the failure)]."""
    with open(os.path.join(root, name)) as f:
        source = f.read()
    rows = []
    for n, bug in enumerate(BUGS[name], 1):
        if only and n != only:
            continue
        bug_name, _, _, _, test, phrase = bug
        d = os.path.join(work, f"{name[:-3]}_bug{n}")
        os.makedirs(d)
        with open(os.path.join(d, name), "w") as f:
            f.write(plant(source, bug))
        out = run_pytest(root, d, f"tests/test_{name[:-3]}.py", f"{d}/tmp", test)
        text = out.stdout + out.stderr
        lines = text[text.find("what differs -"):].splitlines()[1:2] if "what differs -" in text else \
            [next((l for l in text.splitlines() if l.startswith("E ")), "")]
        rows.append((n, bug_name, out.returncode == 1, phrase in text, (lines or [""])[0][:200]))
    return rows


def check(name, root, work):
    """The exercise copy fails with its own message, the bug copy fails saying what differs, the reference
    copy passes: each under `pytest --impl` on the file's CHECKS test. Returns [(kind, exit code, line)]."""
    import subprocess
    test, (line, bug) = CHECKS[name]
    with open(os.path.join(root, name)) as f:
        source = f.read()
    assert source.count(line) == 1, f"{name}: the bug's line is not unique: {line!r}"
    rows = []
    for kind, text in (("exercise", cut(source, EXERCISES[name])), ("bug", source.replace(line, bug)),
                       ("reference", source)):
        d = os.path.join(work, name[:-3], kind)
        os.makedirs(d)
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--basetemp={d}/tmp",
                              "--impl", d, f"tests/test_{name[:-3]}.py", "-k", test], cwd=root, capture_output=True,
                             text=True, timeout=1200)
        key = {"exercise": "NotImplementedError: exercise", "bug": "what differs -", "reference": " passed"}[kind]
        lines = out.stdout[out.stdout.find(key):].splitlines() if key in out.stdout else [""]
        rows.append((kind, out.returncode, (lines[1] if kind == "bug" and len(lines) > 1 else lines[0])[:200]))
    return rows


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
    p = argparse.ArgumentParser(description="Write a technique file with its core's key functions to re-implement, "
                                            "its core alone (--core), or a copy with a planted bug (--bug).")
    p.add_argument("file", nargs="?", choices=sorted(EXERCISES), help="the technique file")
    p.add_argument("--out", help="directory for your copy (then: pytest --impl DIR)")
    p.add_argument("--list", action="store_true", help="print every file's exercises")
    p.add_argument("--core", action="store_true", help="write the core alone (cut at the banner) and gpt2.py: the handout")
    p.add_argument("--bug", help="N: write a copy with zoo bug N planted; list: list FILE's zoo (every file's without FILE)")
    p.add_argument("--check", action="store_true", help="for maintainers: the round trip of FILE (or every file) and "
                                                        "every zoo bug caught by its test")
    a = p.parse_args(argv)
    if a.check:
        import tempfile
        failed = 0
        with tempfile.TemporaryDirectory() as work:
            for name in [a.file] if a.file else EXERCISES:
                for kind, code, line in check(name, root, work):
                    failed += (code == 0) != (kind == "reference")
                    print(f"{name} {kind}: exit {code} | {line}", flush=True)
                for n, bug_name, caught, named, line in check_zoo(name, root, work):
                    failed += not (caught and named)
                    print(f"{name} bug {n} ({bug_name}): {'caught' if caught else 'MISSED'}"
                          f"{'' if named or not caught else ', NOT NAMED'} | {line}", flush=True)
        sys.exit(1 if failed else 0)
    if a.bug == "list" or (a.bug is None and (a.list or not a.file) and not a.core):
        if a.bug == "list":
            for f in [a.file] if a.file else BUGS:
                for n, (bug_name, _, _, symptom, test, _) in enumerate(BUGS[f], 1):
                    print(f"{f} bug {n}: {bug_name}: {symptom} (caught by -k {test})")
            return
        for f, items in EXERCISES.items():
            print(f)
            for n, (dotted, what) in enumerate(items, 1):
                print(f"  exercise {n}: {dotted}: {what}")
        return
    if not a.file:
        sys.exit("error: which file (FILE): give a technique file, e.g. ddp.py")
    if not a.out:
        sys.exit("error: where to write your copy (--out): give a directory, e.g. --out mine")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        sys.exit(f"error: {a.out} is a file (--out): give a directory")
    dst = os.path.join(a.out, a.file)
    if os.path.exists(dst):
        sys.exit(f"error: {dst} exists (--out): your work is never overwritten; choose another directory")
    with open(os.path.join(root, a.file)) as f:
        source = f.read()
    if a.bug is not None:
        if not a.bug.isdigit() or not 1 <= int(a.bug) <= len(BUGS[a.file]):
            sys.exit(f"error: --bug {a.bug} (--bug): give 1..{len(BUGS[a.file])} or list")
        text, what = plant(source, BUGS[a.file][int(a.bug) - 1]), f"bug {a.bug} planted (symptom: " \
            f"{BUGS[a.file][int(a.bug) - 1][3]})"
    elif a.core:
        text, what = core_copy(source), "its core alone"
    else:
        text, what = cut(source, EXERCISES[a.file]), f"{len(EXERCISES[a.file])} exercises"
    os.makedirs(a.out, exist_ok=True)
    with open(dst, "w") as f:
        f.write(text)
    if a.core:
        import shutil
        if not os.path.exists(os.path.join(a.out, "gpt2.py")):
            shutil.copy(os.path.join(root, "gpt2.py"), os.path.join(a.out, "gpt2.py"))
        print(f"wrote {dst} ({what}, {text.count(chr(10))} lines) and {a.out}/gpt2.py; run it with: "
              f"torchrun --nproc_per_node=2 {dst}")
        return
    print(f"wrote {dst} with {what}; test it with: python -m pytest -q --impl {a.out} tests/test_{a.file[:-3]}.py")


if __name__ == "__main__":
    main()
