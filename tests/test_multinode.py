"""Several machines, tried on one (issue 22): two torchrun launchers, as two nodes would start them
(`--nnodes 2 --node-rank 0|1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT`, 2 processes each), run the
same job one launcher of 4 runs. Each must reproduce gpt2.py's one-process curve (which the 4-rank run of
each file reproduces, tested in its own file) to the tolerance the file already uses.

Then a node dies: the second launcher is SIGKILLed mid-run; the first node's ranks stop with one line
naming the lost peer and the checkpoint to resume from, and the newest committed checkpoint resumes on
one launcher of 2 processes (2x2 -> 1x2).

The commands are README's "Several machines" commands, with localhost for the head node's address.
"""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from harness import ROOT, free_port, launch_env, max_rel_diff, read_metrics, run_cli, script, train_losses

CFG = ["--model", "tiny", "--n-layer", "4", "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--device", "cpu",
       "--dtype", "float32", "--eval-every", "0", "--steps", "4", "--warmup", "1", "--lr", "3e-3"]
GLOBAL_BATCH = 8  # sequences per step, for every run below

# file, flags (the per-rank --batch-size gives the global batch of 8 on 4 ranks), tolerance of its own tests
JOBS = {
    "ddp": (["ddp.py", "--batch-size", "2"], 1e-5),
    "fsdp2": (["fsdp2.py", "--batch-size", "2", "--replicate", "2"], 1e-5),  # HSDP: shard in a node, replicate across
    "tensor_parallel": (["tensor_parallel.py", "--tp", "2", "--batch-size", "4"], 1e-5),  # TP in a node, DP across
    "pipeline": (["pipeline.py", "--schedule", "1f1b", "--micro-batches", "4", "--batch-size", "8"], 1e-5),  # P=4
}


def launch_node(node_rank, port, argv, out):
    """One node's launcher, as README's 'Several machines' gives it (the head node's address: localhost)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "test", script(argv[0]), *argv[1:]]
    log = open(os.path.join(out, f"node{node_rank}.log"), "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=launch_env())


def launch_two_nodes(argv, tmp):
    """The head node first: its launcher hosts the rendezvous store at HEAD:PORT, as on a real cluster where
    HEAD is node 0 (whichever launcher binds the port first hosts it; killing that one ends the job)."""
    os.makedirs(tmp, exist_ok=True)
    port = free_port()
    head = launch_node(0, port, argv, tmp)
    deadline = time.time() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert time.time() < deadline and head.poll() is None, "the head node's launcher did not start"
        time.sleep(0.1)
    return [head, launch_node(1, port, argv, tmp)]


def run_two_nodes(argv, tmp, timeout=300):
    nodes = launch_two_nodes(argv, tmp)
    try:
        codes = [n.wait(timeout=timeout) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    logs = [open(os.path.join(tmp, f"node{n}.log")).read() for n in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    return logs


@pytest.fixture(scope="module")
def reference(random_data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpt2"))
    run_cli(["gpt2.py", "train", *CFG, "--data", random_data, "--batch-size", str(GLOBAL_BATCH), "--out", out])
    return out


@pytest.mark.parametrize("name", list(JOBS))
def test_two_nodes_match_one_process(name, reference, random_data, tmp_path):
    argv, tol = JOBS[name]
    out = str(tmp_path / "out")
    run_two_nodes([*argv, *CFG, "--data", random_data, "--out", out], str(tmp_path))
    diff = max_rel_diff(train_losses(out), train_losses(reference))
    print(f"{name}: 2 nodes x 2 processes vs gpt2.py, max relative loss difference {diff:.1e}")
    assert diff <= tol, (name, diff)


def committed_steps(ckpt):
    return [int(d[5:]) for d in os.listdir(ckpt) if d.startswith("step_") and d[5:].isdigit()] if os.path.isdir(ckpt) else []


def test_a_node_dies_and_the_job_resumes_on_fewer_ranks(random_data, tmp_path):
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    flags = [*CFG[:CFG.index("--steps")], "--steps", "12", "--warmup", "1", "--lr", "3e-3", "--data", random_data,
             "--ckpt-dir", ckpt, "--save-every", "1", "--timeout", "30", "--safe", "--out", out]  # --safe: a peer lost
    # in the writer's handshake is a recorded failure, not a thread's traceback
    nodes = launch_two_nodes(["checkpoint.py", *flags, "--batch-size", "2"], str(tmp_path))
    try:
        deadline = time.time() + 240
        while max(committed_steps(ckpt), default=0) < 2:  # let it commit a checkpoint or two
            assert time.time() < deadline and nodes[0].poll() is None, open(tmp_path / "node0.log").read()[-3000:]
            time.sleep(0.1)
        os.killpg(nodes[1].pid, signal.SIGKILL)  # the second machine is gone: its launcher and its 2 ranks
        t0 = time.time()
        code = nodes[0].wait(timeout=120)
        stopped = time.time() - t0
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    log = open(tmp_path / "node0.log").read()
    ours = [ln for ln in log.splitlines() if ln.startswith("error: ")]
    print(f"node 1 killed: node 0 stopped in {stopped:.1f} s (exit {code}), newest checkpoint "
          f"{max(committed_steps(ckpt))}: {ours}")
    assert code != 0 and len(ours) == 1 and "another rank of the job is gone" in ours[0], log[-3000:]
    assert ckpt in ours[0], ours  # the line says where the job resumes from
    assert 'File "' + os.path.join(ROOT, "checkpoint.py") not in log  # no traceback of ours
    # the newest committed checkpoint resumes on one launcher of 2 processes, the global batch kept (2x2 -> 1x2)
    newest = max(committed_steps(ckpt))
    run_cli(["checkpoint.py", *flags, "--batch-size", "4"], nproc=2)
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == list(range(12)), steps  # the earlier steps kept, the rest trained after the resume
    assert newest >= 2
