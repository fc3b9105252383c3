"""Run code on N gloo processes, or a command line under torchrun, with a timeout so a hang fails.

    run_distributed(fn, world, *args)   -> [fn(rank, world, *args) for each rank]   (fn at module level)
    run_cli(["ddp.py", ...], nproc=2)   -> the metrics.jsonl records the run wrote
"""
import json
import multiprocessing as mp
import os
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


def _worker(fn, rank, world, port, args, queue):
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


def run_distributed(fn, world, *args, timeout=120):
    """fn(rank, world, *args) on `world` spawned processes with a gloo group; returns the results by rank.
    Raises with the failing rank's traceback, or after `timeout` seconds if a rank hangs."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, queue)) for r in range(world)]
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


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir):
    return [r["loss"] for r in read_metrics(out_dir) if "loss" in r]


def max_rel_diff(a, b):
    """Largest relative difference of two loss curves, a = ours, b = the reference."""
    assert len(a) == len(b) and len(a) > 0, f"{len(a)} values vs {len(b)} in the reference: did every step run?"
    COMPARED.append((list(a), list(b)))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def first_differences(rel=1e-6):
    """For each curve compared in this test, the first step where ours leaves the reference by more than rel."""
    lines = []
    for ours, ref in COMPARED:
        for i, (x, y) in enumerate(zip(ours, ref)):
            if abs(x - y) > rel * abs(y):
                where = "; steps before it agree" if i else ": already the first step differs"
                lines.append(f"step {i}: loss {x:.6f} vs reference {y:.6f} (relative {abs(x - y) / abs(y):.1e}){where}")
                break
    return lines
