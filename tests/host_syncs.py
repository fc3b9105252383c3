"""Count, per file, the operations in one optimizer step that would make a CUDA host wait for the GPU.

    python tests/host_syncs.py                 # every file, a table
    python tests/host_syncs.py ddp.py --json   # [{"file", "syncs_per_step", "budget", "ops", "where"}]
    python tests/host_syncs.py ddp.py --where  # each sync at its line

Each file trains 3 steps at --grad-accum 2 (tiny model, 2 ranks under torchrun; gpt2.py in one process) with two
counters installed around it: a TorchDispatchMode sees every aten op, in forward and in autograd's backward, and a
TorchFunctionMode sees the Python calls that never reach the dispatcher. The count runs from the start of step 1 to
the start of step 2 (gpt2.Metrics.start_step marks both), so it holds step 1's clipping, logging and saving
(checkpoint.py saves every step here) and nothing of setup or evaluation. torch.optim's own steps are not counted
(AdamW runs fused on CUDA: no host sync; its CPU path reads step counts on the host). On CPU nothing waits, so this
counts what WOULD wait on CUDA:
    .item(), a tensor's truth value, float()/int() of a tensor   aten._local_scalar_dense
    printing or formatting a tensor (print, str, f"{t}")           its values are read on the host
    .tolist(), .numpy(), .cpu(), .to("cpu"), copy_ into a host tensor   a device -> host copy
    torch.equal                                                     a Python bool from device data
    nonzero, boolean-mask indexing, masked_select, unique           an output size only the data knows
    bincount, repeat_interleave without output_size                 likewise
    torch.cuda.synchronize(), dist.barrier(), object collectives    the host waits for the device (NCCL; not on
                                                                    a group made with backend="gloo")
    a copy of a host tensor to the device without non_blocking=True from pinned memory (.to, .cuda, copy_,
    torch.tensor(data, device=...), t.new_tensor(data))             a pageable copy: the host waits for it
    any of these in a branch only CUDA takes (`if x.device.type == "cuda":`, `torch.cuda.is_available()`,
    `dist.get_backend() == "nccl"`), when the step reaches that branch's test and the test would pass on CUDA
Not counted: `t[mask] = number` (CUDA fills through the mask without reading it on the host), anything done to a
host tensor (made by torch.tensor / from_numpy / a factory without a device in the project's code, or computed from
host tensors only), and copies with non_blocking=True from or into pinned memory.
Budget: each file's measured count (below); a new sync anywhere in a step fails test_host_syncs.py, which names it.
The worst rank is reported (pipeline stages differ).
"""
import argparse
import ast
import glob
import json
import os
import runpy
import subprocess
import sys
import tempfile

from harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--steps", "3", "--grad-accum", "2", "--eval-every", "0", "--batch-size", "4", "--seq-len", "64"]
# file -> (processes, extra flags); every block of moe_ep's tiny model is a MoE layer (4)
RUNS = {
    "gpt2.py": (1, ["train"]),
    "ddp.py": (2, []),
    "fsdp2.py": (2, []),
    "tensor_parallel.py": (2, ["--tp", "2"]),
    "pipeline.py": (2, []),
    "moe_ep.py": (2, ["--ep", "2"]),
    "fp8.py": (2, []),
    "muon.py": (2, []),
    "checkpoint.py": (2, ["--save-every", "1"]),
}
# The measured syncs of one step at --grad-accum 2 (the worst rank), each file's budget: one more fails the test.
# The loss (and gradient norm) read once a step; moe_ep: each MoE layer's split sizes per micro-step (4 x 2) and
# the step's figures; checkpoint.py's saving step: its 3 blocking device -> host snapshot copies. pipeline.py: 1 is its
# loss; it measured 5 (its micro-batches copied to the device from pageable host memory, 4 waits on CUDA).
BUDGET = {"gpt2.py": 1, "ddp.py": 1, "fsdp2.py": 1, "tensor_parallel.py": 1, "pipeline.py": 1, "moe_ep.py": 9,
          "fp8.py": 1, "muon.py": 1, "checkpoint.py": 4}  # measured again on main 6027c6f
CEILING, PER_MOE_LAYER = 4, 1  # issue 29: at most 4 a step, moe_ep 1 more per MoE layer per micro-step
WHERE = os.environ.get("HOST_SYNCS_WHERE") == "1"  # --where: count each op at its line too

# Python calls that sync whatever the tensor (Tensor methods / torch functions, by name) -> the kind counted
READS = {"tolist": "tolist", "numpy": "numpy", "cpu": "device -> host copy", "__repr__": "print a tensor",
         "__str__": "print a tensor", "__format__": "print a tensor"}
# factories: a tensor made without a device in the project's code lives in host memory (so does one made from it)
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "randperm", "linspace",
             "logspace", "eye", "tensor", "as_tensor"}
# collectives that make the host wait for the device on NCCL (the object ones pickle through a host copy)
HOST_GROUPS = set()  # id() of the groups made with backend="gloo" (even on CUDA: a checkpoint writer's host group)
BLOCKING_COLLECTIVES = ("barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
                        "gather_object", "scatter_object_list")


def host_target(args, kwargs):
    """A .to()/factory device argument that names host memory: the string "cpu" (a torch.device is the run's
    device: on these CPU runs torch.device("cpu") stands for the GPU)."""
    device = kwargs.get("device", next((a for a in args if isinstance(a, str)), None))
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def device_target(args, kwargs):
    import torch
    return any(isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] == "cuda")
               for a in (*args, kwargs.get("device")))


class Counter:
    """One tally {kind: count} (and {"@kind at file:line": count} under --where), switched on by `on`, fed by
    `dispatch` and `function` (the two modes, entered together), by the wrapped synchronize and blocking
    collectives, and by `branches` (the CUDA-only branches, see cuda_branches)."""

    def __init__(self):
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        self.tally, self.on, self.quiet = {}, False, 0
        self.host = {}  # storage id -> the storage, held so that its address is never reused while marked
        self.optim_dir = os.path.join(os.path.dirname(torch.__file__), "optim")
        self.torch_dir = os.path.dirname(torch.__file__)
        counter, aten = self, torch.ops.aten
        always = {aten._local_scalar_dense.default: "item/bool/float", aten.nonzero.default: "nonzero",
                  aten.masked_select.default: "masked_select", aten.bincount.default: "bincount",
                  aten._unique2.default: "unique", aten.unique_consecutive.default: "unique",
                  aten.unique_dim.default: "unique", aten.equal.default: "equal"}
        masked = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                all_host = bool(tensors) and all(counter.is_host(t) for t in tensors)
                if counter.on and not counter.quiet and not all_host:
                    what = None
                    if func in always:
                        what = always[func]
                    elif func in masked:
                        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                            what = "boolean mask index"
                    elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                        what = "repeat_interleave without output_size"
                    elif func is aten.copy_.default:
                        what = counter.copy_kind(args[0], args[1], args[2] if len(args) > 2 else
                                                 kwargs.get("non_blocking", False))
                    if what:
                        counter.count(what)
                out = func(*args, **kwargs)
                if all_host:  # computed from host tensors only: a host tensor too
                    for t in tree_leaves(out):
                        counter.mark_host(t)
                return out

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                first = args[0] if args else None
                on_device = isinstance(first, torch.Tensor) and not counter.is_host(first)
                what, host_out = None, False
                if name in READS and on_device:
                    what = READS[name]
                elif name == "__setitem__" and isinstance(args[2], (int, float, bool)) and any(
                        isinstance(i, torch.Tensor) and i.dtype == torch.bool
                        for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
                    return counter.quietly(func, args, kwargs)  # masked_fill on CUDA: nothing read on the host
                elif name in FACTORIES and not isinstance(first, torch.Tensor):
                    if kwargs.get("device") is not None and not host_target((), kwargs):
                        what = "pageable host copy" if name in ("tensor", "as_tensor") else None
                    else:
                        host_out = name in ("tensor", "as_tensor") or host_target((), kwargs) or \
                            counter.called_from_project()
                elif name == "new_tensor":
                    if on_device or device_target((), kwargs):
                        what = "pageable host copy"  # Python data copied to the device
                    else:
                        host_out = True
                elif name in ("to", "cuda") and isinstance(first, torch.Tensor):
                    if not on_device and (name == "cuda" or device_target(args[1:], kwargs)):
                        pinned = kwargs.get("non_blocking") and counter.pinned(first)
                        out = counter.quietly(func, args, kwargs, None if pinned else "pageable host copy")
                        # on CPU .to() hands back the same host tensor: a copy stands for the device's
                        return counter.device_copy(out) if counter.is_host(out) else out
                    if on_device and host_target(args[1:], kwargs):
                        return counter.to_host(func, args, kwargs, None if kwargs.get("non_blocking")
                                               else "device -> host copy")
                if name == "cpu" and on_device:
                    return counter.to_host(func, args, kwargs, what)
                out = counter.quietly(func, args, kwargs, what) if what else func(*args, **kwargs)
                if host_out:
                    for t in out if isinstance(out, (tuple, list)) else (out,):
                        counter.mark_host(t)
                return out

        self.dispatch, self.function = Dispatch(), Function()

    def count(self, what, at=None):
        if not self.on or self.quiet or self.inside_torch_optim():
            return
        self.tally[what] = self.tally.get(what, 0) + 1
        if WHERE:
            if at is None:  # the innermost frame of a project file: where to look
                import traceback
                frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(ROOT)
                          and "/tests/" not in f.filename]
                at = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
            key = f"@{what} at {at}"
            self.tally[key] = self.tally.get(key, 0) + 1

    def quietly(self, func, args, kwargs, what=None):
        """func(*args, **kwargs), counted once as `what` (if any), the ops it runs inside not counted again."""
        if what:
            self.count(what)
        self.quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.quiet -= 1

    def inside_torch_optim(self):
        """torch.optim's own step: on CUDA AdamW runs fused (fused=True, state on the device, no host sync); its CPU
        fallback reads step counts on the host, which would be counted here for a wait CUDA never makes."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.optim_dir):
                return True
            frame = frame.f_back
        return False

    def called_from_project(self):
        """A factory called by the project's code (not by torch's own, e.g. nn.Linear's weights, moved later)."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if not name.startswith(self.torch_dir) and name != __file__:
                return name.startswith(ROOT) and "/tests/" not in name
            frame = frame.f_back
        return False

    def mark_host(self, t):
        import torch
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
            storage = t.untyped_storage()
            self.host[storage._cdata] = storage

    def is_host(self, t):
        try:
            return bool(self.host) and t.device.type == "cpu" and t.untyped_storage()._cdata in self.host
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, DTensor): not host memory
            return False

    def device_copy(self, t):
        """A copy of host tensor t that stands for device memory."""
        out = self.quietly(t.clone, (), {})
        self.host.pop(out.untyped_storage()._cdata, None)
        return out

    def to_host(self, func, args, kwargs, what):
        """A device tensor copied to host memory (.cpu(), .to("cpu")): counted as `what`; on CPU the result may be
        the device tensor itself, so a copy of it is what gets marked as host memory."""
        out = self.quietly(func, args, kwargs, what)
        if out.untyped_storage()._cdata == args[0].untyped_storage()._cdata:
            out = self.quietly(out.clone, (), {})
        self.mark_host(out)
        return out

    @staticmethod
    def pinned(t):
        try:
            return t.is_pinned()
        except RuntimeError:  # no accelerator: nothing is pinned
            return False

    def copy_kind(self, dst, src, non_blocking):
        """copy_ between host and device memory: the host waits unless non_blocking with pinned host memory."""
        import torch
        if not isinstance(src, torch.Tensor):
            return None
        if self.is_host(dst) and not self.is_host(src):
            return None if non_blocking and self.pinned(dst) else "device -> host copy"
        if self.is_host(src) and not self.is_host(dst) and src.dim() > 0:
            return None if non_blocking and self.pinned(src) else "pageable host copy"
        return None

    def wrap(self, owner, name, what):
        """owner.name counted as one `what` per call (its own ops not counted again); once per process."""
        fn = getattr(owner, name)
        if hasattr(fn, "counted_as"):
            return

        def counted(*a, **k):
            if id(k.get("group")) in HOST_GROUPS:  # a gloo group made as such: hosts wait for hosts, not the GPU
                return counted.original(*a, **k)
            return Counter.active.quietly(counted.original, a, k, what)

        counted.original, counted.counted_as = fn, what
        setattr(owner, name, counted)

    def install(self):
        import torch
        import torch.distributed as dist
        Counter.active = self  # the wrappers, installed once per process, feed the newest counter
        from_numpy = torch.from_numpy

        def tracked_from_numpy(array):
            out = from_numpy(array)
            Counter.active.mark_host(out)
            return out

        if not hasattr(torch.from_numpy, "counted_as"):
            tracked_from_numpy.counted_as = "host memory"
            torch.from_numpy = tracked_from_numpy
        self.wrap(torch.cuda, "synchronize", "cuda.synchronize")
        for name in BLOCKING_COLLECTIVES:
            if hasattr(dist, name):
                self.wrap(dist, name, f"dist.{name}")
        if not hasattr(dist.new_group, "counted_as"):
            new_group = dist.new_group

            def tracked_new_group(*a, **k):
                group = tracked_new_group.original(*a, **k)
                if k.get("backend") == "gloo":
                    HOST_GROUPS.add(id(group))
                return group

            tracked_new_group.counted_as, tracked_new_group.original = "host group", new_group
            dist.new_group = tracked_new_group
        return self


def counters():
    """A Counter with its wrappers installed (the modes are entered by the caller)."""
    return Counter().install()


# ---- CUDA-only branches: never taken on CPU, so read from the source and counted when the step reaches them

SYNC_CALLS = {"item": "item/bool/float", "tolist": "tolist", "numpy": "numpy", "cpu": "device -> host copy",
              "synchronize": "synchronize", "barrier": "dist.barrier", "nonzero": "nonzero", "equal": "equal",
              "bincount": "bincount", "unique": "unique", "masked_select": "masked_select",
              "all_gather_object": "dist.all_gather_object", "broadcast_object_list": "dist.broadcast_object_list"}


class OnCuda(ast.NodeTransformer):
    """A branch test as it evaluates on CUDA: `X == "cuda"`, `X.is_cuda`, `torch.cuda.is_available()`,
    `dist.get_backend() == "nccl"` become True (`!=`: False), and so do the names (`cuda`, `self.cuda`) the file
    assigns such a test to (`flags`). `found` says whether the test had any."""

    def __init__(self, flags=()):
        self.found, self.flags = False, set(flags)

    def visit_Name(self, node):
        if node.id in self.flags and isinstance(node.ctx, ast.Load):
            self.found = True
            return ast.copy_location(ast.Constant(True), node)
        return node

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
            consts = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
            consts += [e.value for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                       for e in c.elts if isinstance(e, ast.Constant)]
            if "cuda" in consts or "nccl" in consts:
                self.found = True
                return ast.copy_location(ast.Constant(isinstance(node.ops[0], (ast.Eq, ast.In))), node)
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr == "is_cuda" or node.attr in self.flags and isinstance(node.ctx, ast.Load):
            self.found = True
            return ast.copy_location(ast.Constant(True), node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("is_available", "is_initialized") and \
                isinstance(f.value, ast.Attribute) and f.value.attr == "cuda":
            self.found = True
            return ast.copy_location(ast.Constant(True), node)
        return node


def syncs_in(stmts):
    """[(kind, line)] of the calls in `stmts` that sync on CUDA, by their names (see SYNC_CALLS)."""
    found = []
    for node in (n for s in stmts for n in ast.walk(s)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        blocking = not any(k.arg == "non_blocking" and not (isinstance(k.value, ast.Constant) and not k.value.value)
                           for k in node.keywords)
        if name in SYNC_CALLS:
            found.append((SYNC_CALLS[name], node.lineno))
        elif name == "to" and blocking and any(isinstance(a, ast.Constant) and a.value == "cpu"
                                               for a in (*node.args, *(k.value for k in node.keywords))):
            found.append(("device -> host copy", node.lineno))
    return found


def cuda_branches(path):
    """{line of the test: (the test compiled as on CUDA, [(kind, line)] of the syncs its CUDA branch holds)} for
    every `if`/`elif`/conditional expression of `path` that tests for CUDA and whose CUDA side syncs."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    flags = set()  # names assigned a CUDA test: `cuda = x.device.type == "cuda"`, `self.cuda = ...`
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Compare, ast.BoolOp, ast.Attribute)):
            probe = OnCuda()
            probe.visit(ast.parse(ast.unparse(node.value), mode="eval"))
            if probe.found:
                flags |= {t.id if isinstance(t, ast.Name) else t.attr for t in node.targets
                          if isinstance(t, (ast.Name, ast.Attribute))}
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.If, ast.IfExp)):
            continue
        on_cuda = OnCuda(flags)
        test = on_cuda.visit(ast.parse(ast.unparse(node.test), mode="eval"))
        if not on_cuda.found:
            continue
        body, orelse = (node.body, node.orelse) if isinstance(node, ast.If) else ([node.body], [node.orelse])
        syncs_if_true, syncs_if_false = syncs_in(body), syncs_in(orelse)
        if syncs_if_true or syncs_if_false:
            code = compile(ast.fix_missing_locations(test), path, "eval")
            out[node.test.lineno] = (code, syncs_if_true, syncs_if_false)
    return out


class BranchTracer:
    """While on: at each line of a project file that is a CUDA test's, evaluate the test as on CUDA in the frame
    and count the syncs of the side CUDA would take (the CPU run takes the other side, or none)."""

    def __init__(self, counter, paths=None):
        self.counter = counter
        self.files = {}
        for path in paths or glob.glob(os.path.join(ROOT, "*.py")):
            branches = cuda_branches(path)
            if branches:
                self.files[path] = branches

    def local(self, frame, event, arg):
        if event == "line":
            branch = self.files[frame.f_code.co_filename].get(frame.f_lineno)
            if branch:
                code, if_true, if_false = branch
                try:
                    taken = bool(eval(code, frame.f_globals, dict(frame.f_locals)))
                except Exception:  # noqa: BLE001 - a test that cannot be evaluated here: assume CUDA takes it
                    taken = True
                name = os.path.basename(frame.f_code.co_filename)
                for kind, line in if_true if taken else if_false:
                    self.counter.count(f"CUDA-only branch: {kind}", at=f"{name}:{line}")
        return self.local

    def enter(self, frame, event, arg):
        return self.local if frame.f_code.co_filename in self.files else None

    def start(self, frame):
        """Trace from now on: new frames, and the project's frames already running (the training loop's)."""
        sys.settrace(self.enter)
        while frame is not None:
            if frame.f_code.co_filename in self.files:
                frame.f_trace = self.local
            frame = frame.f_back

    @staticmethod
    def stop():
        sys.settrace(None)


def worker(name, argv, result):
    """One rank: run `name` as __main__ with both modes on, counting from step 1's start to step 2's."""
    sys.path.insert(0, ROOT)
    import torch
    import gpt2
    counter = counters()
    tracer = BranchTracer(counter)
    start_step = gpt2.Metrics.start_step
    seen = {"steps": 0}

    def marked_start_step(self):
        seen["steps"] += 1
        counter.on = seen["steps"] == 2  # step index 1 (the second call) is counted, step 2 stops it
        if counter.on:
            tracer.start(sys._getframe(1))
        elif seen["steps"] == 3:
            tracer.stop()
        return start_step(self)

    gpt2.Metrics.start_step = marked_start_step
    next_batch = gpt2.DataLoader.next_batch

    def next_batch_on_device(self, device=None):
        """next_batch(device) hands back device memory on CUDA (its pinned copy runs in a CUDA-only branch): fresh
        storages here, not host memory."""
        x, y = next_batch(self, device)
        if device is None:
            return x, y
        counter.quiet += 1
        try:
            buf = torch.empty(2, *x.shape, dtype=x.dtype, device=device)
            buf[0].copy_(x)
            buf[1].copy_(y)
        finally:
            counter.quiet -= 1
        return buf[0], buf[1]

    gpt2.DataLoader.next_batch = next_batch_on_device
    sys.argv = [os.path.join(ROOT, name), *argv]
    try:
        with counter.dispatch, counter.function:
            if name == "gpt2.py":  # run as __main__ it would be a second gpt2 module, without the marks
                gpt2.run_main(gpt2.train, argv[1:])
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        tracer.stop()
        rank = int(os.environ.get("RANK", 0))
        with open(f"{result}.rank{rank}", "w") as f:
            json.dump({"tally": counter.tally, "steps_seen": seen["steps"]}, f)


def count_file(name, grad_accum=2):
    nproc, extra = RUNS[name]
    with tempfile.TemporaryDirectory() as tmp:
        argv = [*extra, *TINY, "--data", DATA, "--out", os.path.join(tmp, "out")]
        if name == "checkpoint.py":
            argv += ["--ckpt-dir", os.path.join(tmp, "ckpt")]
        argv[argv.index("--grad-accum") + 1] = str(grad_accum)
        result = os.path.join(tmp, "syncs")
        me = [os.path.abspath(__file__), "--worker", name, "--result", result, "--"] + argv
        cmd = [sys.executable] + me if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"] + me
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HOST_SYNCS_WHERE": "1"}  # lines: cheap
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"{name} failed under the counter:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        ranks = []
        for r in range(nproc):
            with open(f"{result}.rank{r}") as f:
                ranks.append(json.load(f))
    for r in ranks:
        r["where"] = {k[1:]: v for k, v in r["tally"].items() if k.startswith("@")}
        r["tally"] = {k: v for k, v in r["tally"].items() if not k.startswith("@")}
    worst = max(ranks, key=lambda r: sum(r["tally"].values()))
    layers = 4 if name == "moe_ep.py" else 0  # gpt2.MODELS["tiny"].n_layer blocks, each MLP a MoE layer
    if min(r["steps_seen"] for r in ranks) < 3:
        raise RuntimeError(f"{name}: gpt2.Metrics.start_step ran {min(r['steps_seen'] for r in ranks)} times in 3 "
                           f"steps: the count needs it called at the start of every step")
    return {"file": name, "syncs_per_step": sum(worst["tally"].values()), "moe_layers": layers,
            "grad_accum": grad_accum, "ops": worst["tally"], "where": worst["where"], "budget": BUDGET[name],
            "ceiling": CEILING + PER_MOE_LAYER * layers * grad_accum}


DATA = None


def prepare_data(tmp):
    """A small random-token corpus (the count does not depend on the text)."""
    import numpy as np
    sys.path.insert(0, ROOT)
    import gpt2
    rng = np.random.default_rng(0)
    gpt2.write_shard(os.path.join(tmp, "train_000000.bin"), rng.integers(0, 50257, 40_000))
    gpt2.write_shard(os.path.join(tmp, "val_000000.bin"), rng.integers(0, 50257, 5_000))
    return tmp


def main(argv=None):
    global DATA
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help=f"files to count (default: all of {', '.join(RUNS)})")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--where", action="store_true", help="also list each sync at its line of the project's files")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    if argv is None:
        argv = sys.argv[1:]
    if "--worker" in argv:  # --worker NAME --result PATH -- FLAGS...
        cut = argv.index("--")
        a = p.parse_args(argv[:cut])
        return worker(a.worker, argv[cut + 1:], a.result)
    a = p.parse_args(argv)
    bad = [f for f in a.files if f not in RUNS]
    if bad:
        sys.exit(f"error: {bad[0]} is not one of the project's files (FILE): give one of {', '.join(RUNS)}")
    with tempfile.TemporaryDirectory() as tmp:
        DATA = prepare_data(tmp)
        rows = [count_file(f, a.grad_accum) for f in a.files or RUNS]
    if a.json:
        print(json.dumps(rows))
        return rows
    print(f"host syncs in one optimizer step at --grad-accum {a.grad_accum} (the worst rank)")
    for r in rows:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items(), key=lambda kv: -kv[1]))
        over = "  OVER BUDGET" if r["syncs_per_step"] > r["budget"] else ""
        print(f"{r['file']:20s} {r['syncs_per_step']:4d} (budget {r['budget']}){over}  {ops}")
        for at, n in sorted(r["where"].items(), key=lambda kv: -kv[1]) if a.where else ():
            print(f"{'':25s}{n:4d}  {at}")
    return rows


if __name__ == "__main__":
    main()
