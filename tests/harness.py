"""Run code on N gloo processes, or a command line under torchrun, with a timeout so a hang fails.

    run_distributed(fn, world, *args)   -> [fn(rank, world, *args) for each rank]   (fn at module level)
    run_cli(["ddp.py", ...], nproc=2)   -> the CompletedProcess; read_metrics(out) -> the records it wrote
"""
import concurrent.futures
import contextlib
import importlib
import io
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import traceback
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARED = []  # (ours, reference) of every curve compared in the running test: a failure shows the first difference


def script(name):
    """The file a launch runs: under `pytest --impl DIR`, DIR/name when DIR has it (a student's copy)."""
    impl = os.environ.get("GPT2_IMPL")
    return os.path.join(impl, name) if impl and os.path.exists(os.path.join(impl, name)) else name


def default_sigint():
    """preexec_fn of a run a test will Ctrl-C: a shell's background job starts with SIGINT ignored, and Python
    keeps it ignored, so the run would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch_env(env=None):
    """Environment of a launched file: one thread per rank, and the repository importable (gpt2.py) when the
    file runs from a student's directory."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, queue, env):
    os.environ.clear()  # the caller's environment now, as spawn would give (the fork server keeps its first one)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_context():
    """Where ranks come from: a fork server that imported numpy, torch and torch's compiler once; a rank forked
    from it starts in ~0.1 s instead of ~2.5 s of imports on 2 cores. Each rank gets the caller's sys.path and
    environment and imports the test module afresh, as spawn would give it."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "torch", "torch._dynamo", "torch.distributed"])
    return ctx


def run_distributed(fn, world, *args, timeout=120):
    """fn(rank, world, *args) on `world` spawned processes with a gloo group; returns the results by rank.
    Raises with the failing rank's traceback, or after `timeout` seconds if a rank hangs."""
    ctx = rank_context()
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, queue, dict(os.environ))) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def run_cli(argv, nproc=1, timeout=300, env=None, check=True):
    """Run `python FILE args` (nproc=1) or `torchrun --nproc_per_node=nproc FILE args` in the repo root.
    Returns the CompletedProcess; read_metrics(out_dir) gives what it logged."""
    argv = [script(argv[0]), *argv[1:]]
    if nproc == 1:
        cmd = [sys.executable] + argv
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}"] + argv
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_clis(*runs, **kw):
    """Independent launches at the same time, each run an (argv, nproc) pair as run_cli takes them: on 2 busy cores
    ~20% less wall time than one after another (one run's start-up and teardown overlap another's steps).
    Returns their CompletedProcesses in order."""
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: run_cli(run[0], nproc=run[1], **kw), runs))


def two_at_a_time(request, test, param, fn):
    """For a module fixture (`yield from`): fn(value) for the `param` of every selected `test` (after -k), two at
    a time in threads; yields {value: future}. What has not started when the module ends (a failure under -x) is
    dropped."""
    selected = sorted({item.callspec.params[param] for item in request.session.items
                       if getattr(item, "originalname", "") == test})
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        yield {value: pool.submit(fn, value) for value in selected}
    finally:
        pool.shutdown(cancel_futures=True)


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir):
    return [r["loss"] for r in read_metrics(out_dir) if "loss" in r]


def compare(what, ours, ref, tol, steps=None, hint=None):
    """Record that curve `what` (e.g. "train loss, ddp.py 2 ranks fp32 vs gpt2.py") was compared with tolerance
    `tol` (relative); returns the largest relative difference. `steps`: the training step of each value (val
    losses are logged at their step, not at their index). A failing test prints, in `what differs`, the first
    value over the tolerance with its step, and `hint` (what that usually means) before the file's own hint."""
    ours, ref = [float(v) for v in ours], [float(v) for v in ref]
    assert len(ours) == len(ref) and ours, f"{what}: {len(ours)} values vs {len(ref)} in the reference: did every step run?"
    COMPARED.append({"what": what, "ours": ours, "ref": ref, "tol": tol, "steps": steps or list(range(len(ours))),
                     "hint": hint})
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(ours, ref))


def assert_close(what, ours, ref, tol, hint=None, steps=None):
    """compare(), then assert with the measured and expected figures in the message."""
    worst = compare(what, ours, ref, tol, steps, hint)
    assert worst <= tol, f"{what}: relative difference {worst:.2e} > tolerance {tol:.0e}" + (f" ({hint})" if hint else "")
    return worst


def max_rel_diff(a, b, what="train loss vs the reference", tol=1e-6):
    """Largest relative difference of two loss curves, a = ours, b = the reference."""
    return compare(what, a, b, tol)


def first_differences(rel=None):
    """For each comparison made in this test, the first value where ours leaves the reference by more than its
    tolerance (or `rel`), named by its curve and its training step, then the comparisons' hints."""
    lines = []
    for c in COMPARED:
        tol = rel if rel is not None else c["tol"]
        for i, (x, y, step) in enumerate(zip(c["ours"], c["ref"], c["steps"])):
            diff = abs(x - y) / max(abs(y), 1e-30)
            if diff > tol:
                where = "; the values before it agree" if i else ": already the first value differs"
                lines.append(f"{c['what']}: step {step}: {x:.6f} vs reference {y:.6f} (relative {diff:.1e} > "
                             f"tolerance {tol:.0e}){where}")
                if c["hint"]:
                    lines.append(f"  which usually means: {c['hint']}")
                break
    return lines


def file_flags(name):
    """The flags `python FILE --help` lists (`gpt2.py train --help`), asked in this process: no launch per file."""
    module = importlib.import_module(name[:-3])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            module.run_main(module.train, ["--help"]) if name == "gpt2.py" else module.cli(["--help"])
        except SystemExit as stop:
            assert stop.code in (0, None), f"{name} --help exited {stop.code}"
    return set(re.findall(r"--[a-z0-9][a-z0-9-]*", out.getvalue()))
