"""checkpoint.py: ZeRO-1 matches gpt2.py, bit-exact resume on 2 ranks, 2 -> 1 resharding, a corrupt
shard falls back to the previous checkpoint, SIGKILL mid-save leaves a resumable checkpoint, and a
torchrun --max-restarts job whose worker dies finishes on the uninterrupted curve. Faults (one process,
injected by monkeypatching): a locked --ckpt-dir, a read error, corrupt-only, a malformed manifest, a
changed schedule, a failed background save - each a one-line error or a fallback, no checkpoint lost.
Issue 25/24/22: a diverged step is never committed (the last finite one is kept), Ctrl-C is one line and resumes
bit-exact, the snapshot is a copy taken before the next step mutates the state, a lock on another host is kept."""
import errno
import json
import os
import re
import socket
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch
import torch.distributed as dist

import checkpoint
import gpt2
from harness import ROOT, default_sigint, free_port, launch_env, max_rel_diff, read_metrics, run_distributed, script, train_losses

STEPS = 20


def flags(data, out, batch_size, *extra):
    return ["--data", data, "--n-layer", "2", "--n-embd", "32", "--seq-len", "32", "--steps", str(STEPS),
            "--batch-size", str(batch_size), "--device", "cpu", "--dtype", "float32", "--eval-every", "0", "--warmup", "5", "--lr", "3e-3",
            "--out", out, *extra]


def steps_in(ck):
    return sorted(d for d in os.listdir(ck) if d.startswith("step_"))


def _straight_then_resume(rank, world, data, root):
    """2 ranks: 20 steps straight (saving at 10 and 20), then a fresh run resumed from the step-10 checkpoint."""
    checkpoint.main(flags(data, f"{root}/straight", 4, "--ckpt-dir", f"{root}/ck_straight", "--save-every", "10",
                          "--eval-every", "10", "--eval-steps", "2"))
    if rank == 0:
        shutil.copytree(f"{root}/ck_straight/step_000010", f"{root}/ck_resume/step_000010")
    dist.barrier()
    checkpoint.main(flags(data, f"{root}/resumed", 4, "--ckpt-dir", f"{root}/ck_resume", "--save-every", "10",
                          "--eval-every", "10", "--eval-steps", "2"))
    # faults on one rank only: both ranks must stop at the same point, with one error each, nothing moved
    faults, read, write = {}, checkpoint.read_bytes, checkpoint.write_shard
    checkpoint.READ_BACKOFF_S = 0.01

    def eio(path):
        if rank == 1 and "step_000020/rank00001" in path:
            raise OSError(errno.EIO, "Input/output error")
        return read(path)

    def no_space(path, tensors, meta):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, tensors, meta)

    for name, attr, fault, extra in (("read", "read_bytes", eio, ["--ckpt-dir", f"{root}/ck_straight"]),
                                     ("save", "write_shard", no_space, ["--ckpt-dir", f"{root}/ck_nospace", "--save-every",
                                                                        "1", "--steps", "3"])):
        setattr(checkpoint, attr, fault)
        try:
            checkpoint.main(flags(data, f"{root}/faults", 4, *extra))
        except gpt2.UsageError as e:
            faults[name] = [str(e), e.local]
        finally:
            setattr(checkpoint, attr, {"read_bytes": read, "write_shard": write}[attr])
    return faults


@pytest.fixture(scope="module")
def straight(shakespeare, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    faults = run_distributed(_straight_then_resume, 2, shakespeare, root, timeout=300)
    with open(f"{root}/faults.json", "w") as f:
        json.dump(faults, f)
    return root


def test_a_fault_on_one_rank_stops_both_ranks_together(straight):
    with open(f"{straight}/faults.json") as f:
        rank0, rank1 = json.load(f)
    # rank 1 cannot read its shard: it says why (local), rank 0 names rank 1; nothing moved (the step 20
    # directory is still there, committed, for the tests below)
    assert rank1["read"] == [f"cannot read checkpoint step 20: {straight}/ck_straight/step_000020/rank00001-of-00002."
                             f"safetensors: Input/output error after 3 tries (--ckpt-dir): nothing was moved or deleted; fix "
                             f"the filesystem and relaunch, or move {straight}/ck_straight/step_000020 out of "
                             f"{straight}/ck_straight to resume from an older checkpoint", True]
    assert rank0["read"][0].startswith("rank 1 cannot read checkpoint step 20 (--ckpt-dir)") and not rank0["read"][1]
    assert os.path.exists(f"{straight}/ck_straight/step_000020/manifest.json")
    # rank 1 cannot write its shard of step 1: the handshake tells rank 0, both stop at the next step
    assert rank1["save"] == ["checkpoint save of step 1 failed on rank 1: OSError: [Errno 28] No space left on device "
                             f"(--ckpt-dir): nothing was committed; fix {straight}/ck_nospace (space, permissions) and "
                             "relaunch to resume", True]
    assert rank0["save"] == ["checkpoint save of step 1 failed: rank(s) [1] could not write their shard (--ckpt-dir): "
                             f"nothing was committed; fix {straight}/ck_nospace (space, permissions) and relaunch to resume",
                             False]
    assert not os.path.exists(f"{straight}/ck_nospace/step_000001/manifest.json")


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


def test_corrupt_or_malformed_falls_back_and_resharding_2_to_1(straight, shakespeare, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(f"{straight}/ck_straight", ck)
    assert steps_in(ck) == ["step_000010", "step_000020"]  # --keep 2
    checkpoint.main(flags(shakespeare, str(tmp_path / "done"), 8, "--ckpt-dir", ck))
    out = capsys.readouterr().out
    assert "resumed from step 20" in out and "nothing left to train" in out
    os.makedirs(f"{ck}/step_000025")  # a save that died before its commit: a half-written shard, no manifest
    with open(f"{ck}/step_000025/rank00000-of-00002.safetensors.tmp", "wb") as f:
        f.write(b"\0" * 1000)
    shutil.copytree(f"{ck}/step_000020", f"{ck}/step_000030")  # a committed step 30 whose manifest lacks a key
    with open(f"{ck}/step_000030/manifest.json") as f:
        man = json.load(f)
    del man["layout"]
    with open(f"{ck}/step_000030/manifest.json", "w") as f:
        json.dump(dict(man, step=30), f)
    shard = f"{ck}/step_000020/rank00001-of-00002.safetensors"
    with open(shard, "r+b") as f:  # flip one byte deep inside the tensor data
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    out_dir = str(tmp_path / "one_rank")
    checkpoint.main(flags(shakespeare, out_dir, 8, "--ckpt-dir", ck, "--save-every", "5"))
    out = capsys.readouterr().out
    assert f"checkpoint step 30 is corrupt: {ck}/step_000030/manifest.json: malformed manifest (KeyError: 'layout')" in out
    assert "checkpoint step 25 was never committed (no manifest.json): skipped, left in place" in out
    assert "checkpoint step 20 is corrupt" in out and "crc32" in out
    assert f"checkpoint step 20 renamed aside to {ck}/step_000020.corrupt; trying the previous one" in out
    assert "resharding: written by 2 ranks, loaded by 1" in out and "resumed from step 10" in out
    ones = [r for r in read_metrics(out_dir) if "loss" in r]
    assert [r["step"] for r in ones] == list(range(10, STEPS))
    # another world size: not bit-exact (fp32 sums in another order), about 1e-7 (measured 9.8e-8 over steps 10-19)
    assert max_rel_diff([r["loss"] for r in ones], train_losses(f"{straight}/straight")[10:]) < 2e-7
    # rewritten by 1 rank, older pruned; the corrupt one kept aside, the uncommitted newer one left in place
    assert steps_in(ck) == ["step_000015", "step_000020", "step_000020.corrupt", "step_000025", "step_000030.corrupt"]
    with pytest.raises(ValueError, match="--save-every without a directory"):
        checkpoint.main(flags(shakespeare, out_dir, 8, "--save-every", "2"))


def test_sigkill_while_saving_leaves_a_resumable_checkpoint(straight, shakespeare, tmp_path, capsys):
    ck, port = str(tmp_path / "ck"), free_port()
    cmd = [sys.executable, script("checkpoint.py")] + flags(shakespeare, str(tmp_path / "killed"), 4, "--ckpt-dir", ck, "--save-every", "2")
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=launch_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                              "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})) for r in range(2)]
    def saving():  # a save of step >= 14 has begun (its directory exists) but is not committed yet
        ds = steps_in(ck) if os.path.isdir(ck) else []
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
    committed = [int(d[5:]) for d in steps_in(ck) if os.path.exists(f"{ck}/{d}/manifest.json")]
    uncommitted = [int(d[5:]) for d in steps_in(ck) if int(d[5:]) > max(committed)]
    assert 12 <= max(committed) < STEPS
    out_dir = str(tmp_path / "killed")
    checkpoint.main(flags(shakespeare, out_dir, 8, "--ckpt-dir", ck))  # resume on 1 rank, same --out
    out = capsys.readouterr().out
    assert f"resumed from step {max(committed)}" in out
    assert all(f"checkpoint step {s} was never committed (no manifest.json): skipped, left in place" in out
               and os.path.isdir(f"{ck}/step_{s:06d}") for s in uncommitted)  # a resume never removes newer ones
    after = train_losses(out_dir)
    assert len(after) == STEPS  # the killed run's steps before the checkpoint, then ours
    assert max_rel_diff(after[max(committed):], train_losses(f"{straight}/straight")[max(committed):]) < 1e-5


def test_torchrun_max_restarts_after_a_worker_dies(straight, shakespeare, tmp_path):
    out_dir = str(tmp_path / "elastic")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.1", script("checkpoint.py")] + \
        flags(shakespeare, out_dir, 4, "--ckpt-dir", str(tmp_path / "ck"), "--save-every", "4", "--fail-at", "13")
    env = launch_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # see checkpoint.py
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "--fail-at 13: exiting abruptly" in log
    assert "resumed from step 12" in log or "resumed from step 8" in log, log[-3000:]
    losses = train_losses(out_dir)
    assert losses == train_losses(f"{straight}/straight")  # all 20 steps, bit-exact, final loss included


# ----------------------------------------------------------------------------------------------------
# Faults, one process, through the real entry point (gpt2.run_main: one line on stderr, exit 2)


def cli(argv, capsys):
    """checkpoint.py's command line in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        gpt2.run_main(checkpoint.main, argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def tree(ck):
    """Every file under ck with its size and CRC-32: what 'left in place' means."""
    return {os.path.relpath(os.path.join(d, f), ck): (os.path.getsize(os.path.join(d, f)),
            zlib.crc32(open(os.path.join(d, f), "rb").read())) for d, _, fs in os.walk(ck) for f in fs if f != "LOCK"}


def test_a_locked_ckpt_dir_is_refused(shakespeare, tmp_path, capsys):
    ck, host = str(tmp_path / "ck"), socket.gethostname()
    os.makedirs(f"{ck}/step_000005")  # the holder's in-flight save
    holder = subprocess.Popen(["sleep", "60"])  # a live process that holds the directory
    try:
        with open(f"{ck}/LOCK", "w") as f:
            f.write(f"{host} {holder.pid}")
        code, out, err = cli(flags(shakespeare, str(tmp_path / "out"), 8, "--ckpt-dir", ck, "--save-every", "5"), capsys)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and err == (f"error: {ck} is in use by another run (pid {holder.pid} on {host}) (--ckpt-dir): wait "
                                 f"for it to finish or choose another --ckpt-dir; remove {ck}/LOCK if that run is gone\n")
    assert sorted(os.listdir(ck)) == ["LOCK", "step_000005"] and os.listdir(f"{ck}/step_000005") == []
    # a lock names its host: on a shared filesystem a pid that is not alive here may be alive on that host, so
    # the lock is not taken over (issue 22); a dead pid of this host is
    dead = subprocess.Popen(["true"])
    dead.wait()
    for holder_host, refused in (("node7.cluster", True), (host, False)):
        with open(f"{ck}/LOCK", "w") as f:
            f.write(f"{holder_host} {dead.pid}")
        code, _, err = cli(flags(shakespeare, str(tmp_path / f"out_{refused}"), 8, "--ckpt-dir", ck, "--steps", "1"), capsys)
        assert (code, err.startswith(f"error: {ck} is in use by another run (pid {dead.pid} on {holder_host})")) == \
            ((2, True) if refused else (0, False)), err


def test_a_read_error_is_retried_then_stops_the_run_with_every_checkpoint_in_place(straight, shakespeare, tmp_path,
                                                                                 capsys, monkeypatch):
    ck = str(tmp_path / "ck")
    shutil.copytree(f"{straight}/ck_straight", ck)
    before = tree(ck)
    monkeypatch.setattr(checkpoint, "READ_BACKOFF_S", 0.01)
    real, calls = checkpoint.read_bytes, []

    def flaky(path, fail_times):  # EIO on step 20's second shard, the first fail_times reads
        if "step_000020/rank00001" in path and len(calls) < fail_times:
            calls.append(path)
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(checkpoint, "read_bytes", lambda path: flaky(path, 99))
    code, out, err = cli(flags(shakespeare, str(tmp_path / "out"), 8, "--ckpt-dir", ck), capsys)
    shard = f"{ck}/step_000020/rank00001-of-00002.safetensors"
    assert code == 2 and len(calls) == 3 and out.count("retrying") == 2
    assert err == (f"error: cannot read checkpoint step 20: {shard}: Input/output error after 3 tries (--ckpt-dir): "
                   f"nothing was moved or deleted; fix the filesystem and relaunch, or move {ck}/step_000020 out of "
                   f"{ck} to resume from an older checkpoint\n")
    assert tree(ck) == before  # every checkpoint in place, byte for byte
    calls.clear()  # a transient error: the second try succeeds and the newest checkpoint is resumed
    monkeypatch.setattr(checkpoint, "read_bytes", lambda path: flaky(path, 1))
    code, out, err = cli(flags(shakespeare, str(tmp_path / "out"), 8, "--ckpt-dir", ck), capsys)
    assert code == 0 and len(calls) == 1 and "resumed from step 20" in out and tree(ck) == before


def test_corrupt_only_refuses_a_fresh_start_unless_allowed(straight, shakespeare, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(f"{straight}/ck_straight/step_000020", f"{ck}/step_000020")
    shard = f"{ck}/step_000020/rank00000-of-00002.safetensors"
    with open(shard, "r+b") as f:  # one flipped bit in the tensor data
        f.seek(os.path.getsize(shard) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    kept = tree(ck)
    argv = flags(shakespeare, str(tmp_path / "out"), 8, "--ckpt-dir", ck)
    refusal = (f"error: 1 checkpoint(s) in {ck} are corrupt (renamed aside as *.corrupt) and none verifies (--ckpt-dir): "
               f"inspect them, or pass --allow-fresh-start to train from step 0 (they stay aside), or give another --ckpt-dir\n")
    code, out, err = cli(argv, capsys)
    assert code == 2 and err == refusal and "crc32" in out
    assert steps_in(ck) == ["step_000020.corrupt"]  # renamed aside, every byte kept
    assert tree(ck) == {k.replace("step_000020", "step_000020.corrupt"): v for k, v in kept.items()}
    assert cli(argv, capsys)[:3:2] == (2, refusal)  # a relaunch does not slip past the evidence
    code, out, err = cli(argv + ["--allow-fresh-start", "--steps", "3"], capsys)  # nothing left to compare --steps with
    assert code == 0 and "starting from step 0 (--allow-fresh-start)" in out and steps_in(ck) == ["step_000020.corrupt"]
    assert max_rel_diff(train_losses(str(tmp_path / "out")), train_losses(f"{straight}/straight")[:3]) < 1e-5


def test_a_changed_schedule_or_batch_is_refused_on_resume(straight, shakespeare, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(f"{straight}/ck_straight", ck)
    before, out_dir = tree(ck), str(tmp_path / "out")
    todo = "resume with the checkpoint's values (a different world size with the same global batch is fine), or give another --ckpt-dir"
    code, _, err = cli(flags(shakespeare, out_dir, 8, "--ckpt-dir", ck, "--lr", "1e-3"), capsys)
    assert code == 2 and err == f"error: {ck}/step_000020 was written with --lr 0.003, this run has --lr 0.001 (--lr): {todo}\n"
    code, _, err = cli(flags(shakespeare, out_dir, 8, "--ckpt-dir", ck, "--steps", "30", "--warmup", "2"), capsys)
    assert code == 2 and err.startswith(f"error: {ck}/step_000020 was written with --warmup 5 --steps 20, this run has "
                                        f"--warmup 2 --steps 30 (--warmup --steps): ")
    code, _, err = cli(flags(shakespeare, out_dir, 4, "--ckpt-dir", ck), capsys)
    assert code == 2 and "global batch 8, this run has --batch-size/--grad-accum global batch 4 = 1 ranks x 4 x 1" in err
    code, _, err = cli(flags(shakespeare, out_dir, 8, "--ckpt-dir", ck, "--n-embd", "64"), capsys)
    assert code == 2 and "written with --n-embd n_embd=32, this run has --n-embd n_embd=64 (--n-embd)" in err
    assert tree(ck) == before


def test_a_failed_background_save_fails_the_next_step(shakespeare, tmp_path, capsys, monkeypatch):
    def no_space(path, tensors, meta):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_shard", no_space)
    ck = str(tmp_path / "ck")
    code, out, err = cli(flags(shakespeare, str(tmp_path / "out"), 8, "--ckpt-dir", ck, "--save-every", "1",
                               "--steps", "4"), capsys)
    assert code == 2 and err == ("error: checkpoint save of step 1 failed on rank 0: OSError: [Errno 28] No space left on "
                                 f"device (--ckpt-dir): nothing was committed; fix {ck} (space, permissions) and "
                                 "relaunch to resume\n")
    assert len(train_losses(str(tmp_path / "out"))) <= 2  # stopped at step 1 or, if the writer was slow, step 2


def test_compile_and_bf16_one_process(straight, shakespeare, tmp_path):
    # --compile (the whole model; its parameters are views into the flat ZeRO-1 buffer) equals eager at steps
    # 0-1 and commits its checkpoint; the first steps lie in the warmup, so --steps 2 is a prefix of the 20
    compiled, ref = str(tmp_path / "compiled"), train_losses(f"{straight}/straight")
    checkpoint.main(flags(shakespeare, compiled, 8, "--steps", "2", "--compile", "--ckpt-dir", str(tmp_path / "ck"),
                          "--save-every", "2"))
    assert max_rel_diff(train_losses(compiled), ref[:2]) <= 1e-6  # measured <= 8.9e-8 (steps 0-2)
    assert os.path.exists(f"{tmp_path}/ck/step_000002/manifest.json")
    # --dtype bfloat16 (autocast; fp32 master weights, gradients and moments) vs gpt2.py's bf16 run, same global batch
    checkpoint.main(flags(shakespeare, str(tmp_path / "ck16"), 8, "--steps", "3", "--dtype", "bfloat16"))
    gpt2.train(flags(shakespeare, str(tmp_path / "gpt2_16"), 8, "--steps", "3", "--dtype", "bfloat16"))
    assert max_rel_diff(train_losses(str(tmp_path / "ck16")), train_losses(str(tmp_path / "gpt2_16"))) <= 1e-5  # 1.8e-7


def committed_tensors(d):
    """Every shard of the committed checkpoint in step directory d, read and verified."""
    with open(f"{d}/manifest.json") as f:
        man = json.load(f)
    return [checkpoint.parse_shard(checkpoint.read_bytes(f"{d}/{sh['file']}"))[0] for sh in man["shards"]
            if zlib.crc32(checkpoint.read_bytes(f"{d}/{sh['file']}")) == sh["crc32"]]


def test_a_diverged_step_is_never_committed_and_the_last_finite_one_is_kept(shakespeare, tmp_path, capsys):
    # issue 25's command (the default tiny model): the update of step 1 leaves 669,440 weights non-finite while
    # its loss, computed before that update, is finite (232664.9); --keep 1 used to prune step 1 for the NaN step 2
    ck = str(tmp_path / "ck")
    code, out, err = cli(["--data", shakespeare, "--seq-len", "64", "--batch-size", "4", "--device", "cpu", "--dtype",
                          "float32", "--eval-every", "0", "--out", str(tmp_path / "out"), "--ckpt-dir", ck, "--save-every",
                          "1", "--keep", "1", "--grad-clip", "0", "--lr", "1e3", "--steps", "2"], capsys)
    assert code == 2 and err == ("error: the weights are not finite after step 1 (5 of 5 tensors on rank 0 hold NaN or Inf) "
                                 "(--lr): step 1, the newest committed checkpoint, is finite and kept; lower --lr (with "
                                 "another --ckpt-dir), keep --grad-clip on, or raise --warmup\n"), err
    assert steps_in(ck) == ["step_000001"]  # nothing of step 2 was written, and step 1 was not pruned
    (shard,) = committed_tensors(f"{ck}/step_000001")
    assert all(shard[k].isfinite().all() for k in ("params", "exp_avg", "exp_avg_sq"))


def test_ctrl_c_is_one_line_releases_the_locks_and_resumes_bit_exact(shakespeare, tmp_path, capsys):
    ck, out_dir = str(tmp_path / "ck"), str(tmp_path / "out")
    argv = flags(shakespeare, out_dir, 8, "--ckpt-dir", ck, "--save-every", "2", "--steps", "8")
    proc = subprocess.Popen([sys.executable, script("checkpoint.py"), *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=launch_env(),
                            preexec_fn=default_sigint)
    try:
        deadline = time.time() + 300
        while not os.path.exists(f"{ck}/step_000002/manifest.json"):  # a checkpoint is committed: training goes on
            assert time.time() < deadline and proc.poll() is None, "the run ended before Ctrl-C"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, err
    assert re.fullmatch(rf"interrupted after step \d+: rerun the same command; it resumes from the newest committed "
                        rf"checkpoint in {re.escape(ck)}", lines[0]), lines[0]
    assert not os.path.exists(f"{ck}/LOCK") and not os.path.exists(f"{out_dir}/LOCK")
    # an --out holding that run is refused when there is nothing to resume it from
    for extra in (["--ckpt-dir", str(tmp_path / "empty")], []):
        code, _, err = cli(flags(shakespeare, out_dir, 8, *extra), capsys)
        assert code == 2 and err.startswith(f"error: {out_dir} holds an earlier run (metrics.jsonl) and ") and \
            err.count("\n") == 1 and "(--out): choose a new --out" in err, err
    # the same command resumes and ends on the uninterrupted curve, bit for bit (one thread, as the killed run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli(argv, capsys)[0] == 0
        checkpoint.main(flags(shakespeare, str(tmp_path / "straight"), 8, "--steps", "8"))
    finally:
        torch.set_num_threads(threads)
    assert train_losses(out_dir) == train_losses(str(tmp_path / "straight"))


@pytest.mark.parametrize("kind", ["AsyncCheckpointer", "SafeCheckpointer"])  # the core's copy, main()'s pinned one
def test_the_snapshot_is_a_copy_taken_before_the_next_step(kind, shakespeare, tmp_path, monkeypatch):
    # the background write of step 2 is held until the optimizer step after it has run: a snapshot that were a
    # live view of the training state (not a copy) would commit step 3's state under step 2's name
    updates, at_save = [], {}
    cls = getattr(checkpoint, kind)
    snapshot, write, zero_grad = cls.snapshot, checkpoint.write_shard, checkpoint.Zero1.zero_grad

    def record(self, opt):  # the training state at the save: this rank's slice and its two moments, copied here
        z = self.zero
        at_save[len(updates)] = {"params": z.flat[z.lo: z.hi].clone()} | {
            k: torch.cat([opt.state[p][k] for p in z.params]) for k in ("exp_avg", "exp_avg_sq")}
        return snapshot(self, opt)

    def held(path, tensors, meta):
        deadline = time.time() + 120
        while meta["step"] == 2 and len(updates) < 3:  # step 2's update (the third) has changed the state
            assert time.time() < deadline, "the training thread never reached the next step"
            time.sleep(0.01)
        return write(path, tensors, meta)

    monkeypatch.setattr(cls, "snapshot", record)
    monkeypatch.setattr(checkpoint, "write_shard", held)
    monkeypatch.setattr(checkpoint.Zero1, "zero_grad", lambda self: (zero_grad(self), updates.append(1)))
    ck = str(tmp_path / "ck")
    args = checkpoint.parse_args(flags(shakespeare, str(tmp_path / "out"), 8, "--steps", "4", "--ckpt-dir", ck,
                                       "--save-every", "2"))
    checkpoint.train(args, cls)
    (shard,) = committed_tensors(f"{ck}/step_000002")
    assert not torch.equal(at_save[2]["params"], at_save[4]["params"])  # the state did move on after the save
    for k in ("params", "exp_avg", "exp_avg_sq"):
        assert torch.equal(shard[k], at_save[2][k]), k
