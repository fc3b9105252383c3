"""checkpoint.py: ZeRO-1 matches gpt2.py, bit-exact resume on 2 ranks, 2 -> 1 resharding, a corrupt
shard falls back to the previous checkpoint, SIGKILL mid-save leaves a resumable checkpoint, and a
torchrun --max-restarts job whose worker dies finishes on the uninterrupted curve."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import checkpoint
import gpt2
from harness import ROOT, free_port, max_rel_diff, read_metrics, run_distributed, train_losses

STEPS = 20


def flags(data, out, batch_size, *extra):
    return ["--data", data, "--n-layer", "2", "--n-embd", "32", "--seq-len", "32", "--steps", str(STEPS),
            "--batch-size", str(batch_size), "--device", "cpu", "--dtype", "float32", "--eval-every", "0", "--warmup", "5", "--lr", "3e-3",
            "--out", out, *extra]


def _straight_then_resume(rank, world, data, root):
    """2 ranks: 20 steps straight (saving at 10 and 20), then a fresh run resumed from the step-10 checkpoint."""
    checkpoint.main(flags(data, f"{root}/straight", 4, "--ckpt-dir", f"{root}/ck_straight", "--save-every", "10",
                          "--eval-every", "10", "--eval-steps", "2"))
    if rank == 0:
        shutil.copytree(f"{root}/ck_straight/step_000010", f"{root}/ck_resume/step_000010")
    dist.barrier()
    checkpoint.main(flags(data, f"{root}/resumed", 4, "--ckpt-dir", f"{root}/ck_resume", "--save-every", "10",
                          "--eval-every", "10", "--eval-steps", "2"))


@pytest.fixture(scope="module")
def straight(shakespeare, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    run_distributed(_straight_then_resume, 2, shakespeare, root, timeout=300)
    return root


def test_bit_exact_resume_on_two_ranks_and_zero1_matches_gpt2(straight, shakespeare, tmp_path):
    full = read_metrics(f"{straight}/straight")
    resumed = read_metrics(f"{straight}/resumed")
    full_loss = [r["loss"] for r in full if "loss" in r]
    assert len(full_loss) == STEPS and [r["step"] for r in resumed if "loss" in r] == list(range(10, STEPS))
    assert [r["loss"] for r in resumed if "loss" in r] == full_loss[10:]  # bit-exact, step by step
    assert [r["val_loss"] for r in resumed if "val_loss" in r] == [r["val_loss"] for r in full if "val_loss" in r][1:]
    assert full_loss[-1] < full_loss[0] - 0.5  # it trained
    assert all(r["comm_mb"] > 0 for r in full if "loss" in r)
    # a checkpoint holds 3 fp32 copies (params, exp_avg, exp_avg_sq) of the flat parameters, split by rank
    d = f"{straight}/ck_straight/step_000020"
    n = sum(p.numel() for p in gpt2.GPT(gpt2.GPTConfig(block_size=256, n_layer=2, n_head=4, n_embd=32)).parameters())
    data_bytes = sum(os.path.getsize(f"{d}/{f}") for f in os.listdir(d) if f.endswith(".safetensors"))
    assert 3 * 4 * n < data_bytes < 3 * 4 * n + 2 * 8192
    # ZeRO-1 on 2 ranks equals one process with plain AdamW (in the warmup a 4-step run is a prefix)
    gpt2.train(flags(shakespeare, str(tmp_path / "gpt2"), 8, "--steps", "4"))
    assert max_rel_diff(full_loss[:4], train_losses(str(tmp_path / "gpt2"))) < 1e-5


def test_corrupt_shard_falls_back_and_resharding_2_to_1(straight, shakespeare, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(f"{straight}/ck_straight", ck)
    assert sorted(os.listdir(ck)) == ["step_000010", "step_000020"]  # --keep 2
    checkpoint.main(flags(shakespeare, str(tmp_path / "done"), 8, "--ckpt-dir", ck))
    out = capsys.readouterr().out
    assert "resumed from step 20" in out and "nothing left to train" in out
    os.makedirs(f"{ck}/step_000025")  # a save that died before its commit: a half-written shard, no manifest
    with open(f"{ck}/step_000025/rank00000-of-00002.safetensors.tmp", "wb") as f:
        f.write(b"\0" * 1000)
    shard = f"{ck}/step_000020/rank00001-of-00002.safetensors"
    with open(shard, "r+b") as f:  # flip one byte deep inside the tensor data
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    out_dir = str(tmp_path / "one_rank")
    checkpoint.main(flags(shakespeare, out_dir, 8, "--ckpt-dir", ck, "--save-every", "5"))
    out = capsys.readouterr().out
    assert "checkpoint step 25 is unusable" in out and "never committed" in out
    assert "checkpoint step 20 is unusable" in out and "crc32" in out
    assert "resharding: written by 2 ranks, loaded by 1" in out and "resumed from step 10" in out
    ones = [r for r in read_metrics(out_dir) if "loss" in r]
    assert [r["step"] for r in ones] == list(range(10, STEPS))
    assert max_rel_diff([r["loss"] for r in ones], train_losses(f"{straight}/straight")[10:]) < 1e-5
    assert sorted(os.listdir(ck)) == ["step_000015", "step_000020"]  # rewritten by 1 rank, older pruned
    with pytest.raises(ValueError, match="--save-every without a directory"):
        checkpoint.main(flags(shakespeare, out_dir, 8, "--save-every", "2"))


def test_sigkill_while_saving_leaves_a_resumable_checkpoint(straight, shakespeare, tmp_path, capsys):
    ck, port = str(tmp_path / "ck"), free_port()
    cmd = [sys.executable, "checkpoint.py"] + flags(shakespeare, str(tmp_path / "killed"), 4, "--ckpt-dir", ck, "--save-every", "2")
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)]
    def saving():  # a save of step >= 14 has begun (its directory exists) but is not committed yet
        ds = os.listdir(ck) if os.path.isdir(ck) else []
        return [d for d in ds if int(d[5:]) >= 14 and not os.path.exists(f"{ck}/{d}/manifest.json")]

    try:
        deadline = time.time() + 300
        while not saving():
            assert time.time() < deadline and all(p.poll() is None for p in procs), "the job ended before the kill"
            time.sleep(0.002)
    finally:
        for p in procs:  # the whole job at once, as a node failure would
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
    committed = [int(d[5:]) for d in os.listdir(ck) if os.path.exists(f"{ck}/{d}/manifest.json")]
    uncommitted = [int(d[5:]) for d in os.listdir(ck) if int(d[5:]) > max(committed)]
    assert 12 <= max(committed) < STEPS
    out_dir = str(tmp_path / "killed")
    checkpoint.main(flags(shakespeare, out_dir, 8, "--ckpt-dir", ck))  # resume on 1 rank, same --out
    out = capsys.readouterr().out
    assert f"resumed from step {max(committed)}" in out
    assert all(f"discarding {ck}/step_{s:06d}" in out for s in uncommitted)
    after = train_losses(out_dir)
    assert len(after) == STEPS  # the killed run's steps before the checkpoint, then ours
    assert max_rel_diff(after[max(committed):], train_losses(f"{straight}/straight")[max(committed):]) < 1e-5


def test_torchrun_max_restarts_after_a_worker_dies(straight, shakespeare, tmp_path):
    out_dir = str(tmp_path / "elastic")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.1", "checkpoint.py"] + \
        flags(shakespeare, out_dir, 4, "--ckpt-dir", str(tmp_path / "ck"), "--save-every", "4", "--fail-at", "13")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see checkpoint.py
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "--fail-at 13: exiting abruptly" in log
    assert "resumed from step 12" in log or "resumed from step 8" in log, log[-3000:]
    losses = train_losses(out_dir)
    assert losses == train_losses(f"{straight}/straight")  # all 20 steps, bit-exact, final loss included
