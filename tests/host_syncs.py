"""Count, per file, the operations in one optimizer step that would make a CUDA host wait for the GPU.

    python tests/host_syncs.py                 # every file, a table
    python tests/host_syncs.py ddp.py --json   # [{"file", "syncs_per_step", "moe_layers", "grad_accum", "ops"}]

Each file trains 3 steps at --grad-accum 2 (tiny model, 2 ranks under torchrun; gpt2.py in one process) with two
counters installed around it: a TorchDispatchMode sees every aten op, in forward and in autograd's backward, and a
TorchFunctionMode sees the Python calls that never reach the dispatcher. The count runs from the start of step 1 to
the start of step 2 (gpt2.Metrics.start_step marks both), so it holds the logging of step 1 and nothing of setup,
evaluation or saving. torch.optim's own steps are not counted (AdamW runs fused on CUDA: no host sync; its CPU
path reads step counts on the host). On CPU nothing waits, so this counts what WOULD wait on CUDA:
    .item(), a tensor's truth value, float()/int() of a tensor   aten._local_scalar_dense
    .tolist(), .numpy(), .cpu()                                     a device -> host copy
    nonzero, boolean-mask indexing, masked_select, unique           an output size only the data knows
    bincount, repeat_interleave without output_size                 likewise
    torch.cuda.synchronize()                                        the host waits for everything
    .to(device) of a host tensor without non_blocking=True         a pageable copy: the host waits for it
Budget (issue 29): at most 4 per step for every file; moe_ep may add 1 per MoE layer per micro-step (the
all-to-all's split sizes, which NCCL needs on the host). The worst rank is reported (pipeline stages differ).
"""
import argparse
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
BUDGET, PER_MOE_LAYER = 4, 1
WHERE = os.environ.get("HOST_SYNCS_WHERE") == "1"  # --where: count each op at its line too


def counters():
    """The two modes, sharing one tally {what: count}, and a switch."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    tally, state = {}, {"on": False}

    optim_dir = os.path.join(os.path.dirname(torch.__file__), "optim")

    def count(what):
        if state["on"] and not inside_torch_optim():
            tally[what] = tally.get(what, 0) + 1
            if WHERE:  # the innermost frame of a project file: where to look
                import traceback
                frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(ROOT)
                          and "/tests/" not in f.filename]
                at = f"{what} at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else what
                tally["@" + at] = tally.get("@" + at, 0) + 1

    def inside_torch_optim():
        """torch.optim's own step: on CUDA AdamW runs fused (fused=True, state on the device, no host sync); its CPU
        fallback reads step counts on the host, which would be counted here for a wait CUDA never makes."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(optim_dir):
                return True
            frame = frame.f_back
        return False

    aten = torch.ops.aten
    always = {aten._local_scalar_dense.default: "item/bool/float", aten.nonzero.default: "nonzero",
              aten.masked_select.default: "masked_select", aten.bincount.default: "bincount",
              aten._unique2.default: "unique", aten.unique_consecutive.default: "unique",
              aten.unique_dim.default: "unique"}

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in always:
                count(always[func])
            elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []) if i is not None):
                    count("boolean mask index")
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                count("repeat_interleave without output_size")
            return func(*args, **kwargs)

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if name in ("tolist", "numpy", "cpu"):
                count(name)
            elif name in ("tensor", "as_tensor") and not (args and isinstance(args[0], torch.Tensor)):
                if kwargs.get("device") is not None:
                    count("pageable host copy")  # Python numbers to the device: a blocking copy on CUDA
                else:
                    out = func(*args, **kwargs)
                    born_on_host(out)
                    return out
            elif name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor) and is_host(args[0]):
                wants_device = name == "cuda" or "device" in kwargs or any(
                    isinstance(a, (torch.device, str)) for a in args[1:])
                if wants_device and not kwargs.get("non_blocking") and not args[0].is_pinned():
                    count("pageable host copy")
            return func(*args, **kwargs)

    # On CPU every tensor is a host tensor; a copy "to the device" would be one on CUDA only for tensors born on
    # the host (the loader's numpy batches, torch.tensor of Python data) and their views, tracked by storage.
    host_storages = set()

    def key(t):
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def born_on_host(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            host_storages.add(key(t))

    def is_host(t):
        return t.device.type == "cpu" and key(t) in host_storages

    from_numpy = torch.from_numpy

    def tracked_from_numpy(array):
        out = from_numpy(array)
        born_on_host(out)
        return out

    torch.from_numpy = tracked_from_numpy

    sync = torch.cuda.synchronize

    def counted_synchronize(*a, **k):
        count("cuda.synchronize")
        return sync(*a, **k)

    counted_synchronize.__wrapped__ = sync
    if not hasattr(torch.cuda.synchronize, "__wrapped__"):  # once per process
        torch.cuda.synchronize = counted_synchronize
    return tally, state, Dispatch(), Function()


def worker(name, argv, result):
    """One rank: run `name` as __main__ with both modes on, counting from step 1's start to step 2's."""
    sys.path.insert(0, ROOT)
    import gpt2
    tally, state, dispatch, function = counters()
    start_step = gpt2.Metrics.start_step
    seen = {"steps": 0, "moe_layers": 0}

    def marked_start_step(self):
        seen["steps"] += 1
        state["on"] = seen["steps"] == 2  # step index 1 (the second call) is counted, step 2 stops it
        return start_step(self)

    gpt2.Metrics.start_step = marked_start_step
    next_batch = gpt2.DataLoader.next_batch

    def next_batch_on_device(self, device=None):
        """next_batch(device) hands back device memory on CUDA: fresh storages here, no longer host-born."""
        x, y = next_batch(self, device)
        return (x.clone(), y.clone()) if device is not None else (x, y)

    gpt2.DataLoader.next_batch = next_batch_on_device
    sys.argv = [os.path.join(ROOT, name), *argv]
    try:
        with dispatch, function:
            if name == "gpt2.py":  # run as __main__ it would be a second gpt2 module, without the marks
                gpt2.run_main(gpt2.train, argv[1:])
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        rank = int(os.environ.get("RANK", 0))
        with open(f"{result}.rank{rank}", "w") as f:
            json.dump({"tally": tally, "steps_seen": seen["steps"]}, f)


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
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
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
            "grad_accum": grad_accum, "ops": worst["tally"], "where": worst["where"],
            "budget": BUDGET + PER_MOE_LAYER * layers * grad_accum}


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
    if a.where:
        os.environ["HOST_SYNCS_WHERE"] = "1"
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
        for at, n in sorted(r["where"].items(), key=lambda kv: -kv[1]):
            print(f"{'':25s}{n:4d}  {at}")
    return rows


if __name__ == "__main__":
    main()
