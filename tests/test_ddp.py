"""ddp.py: the 2-rank run reproduces `gpt2.py train` step by step (plain, ZeRO-1, grad accumulation),
sends the ring all-reduce minimum, and matches torch's DistributedDataParallel parameter for parameter
on a toy model with tied, frozen and unused parameters and on GPT-2."""
import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import ddp
import gpt2
from harness import max_rel_diff, read_metrics, run_cli, run_distributed, train_losses

CFG = ["--model", "tiny", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16",
       "--device", "cpu", "--dtype", "float32", "--eval-every", "6", "--eval-steps", "2"]


def gradient_mb():
    """fp32 gradient bytes of the CFG model, the tied wte/lm_head counted once, computed here."""
    m = gpt2.GPT(gpt2.GPTConfig(block_size=256, n_layer=2, n_head=2, n_embd=32))
    return 4 * sum(p.numel() for p in m.parameters()) / 1e6


@pytest.fixture(scope="module")
def baseline(random_data, tmp_path_factory):
    """`gpt2.py train` in this process with a global batch of 8 rows, 12 steps."""
    out = str(tmp_path_factory.mktemp("base"))
    gpt2.train(CFG + ["--data", random_data, "--batch-size", "8", "--steps", "12", "--out", out])
    return out


def val_losses(out):
    return [r["val_loss"] for r in read_metrics(out) if "val_loss" in r]


def test_two_ranks_match_one_process(random_data, baseline, tmp_path):
    out = str(tmp_path / "ddp")
    proc = run_cli(["ddp.py"] + CFG + ["--data", random_data, "--steps", "12", "--batch-size", "4",
                                       "--bucket-mb", "2", "--overlap-steps", "2", "--out", out], nproc=2)
    assert max_rel_diff(train_losses(out), train_losses(baseline)) <= 1e-5
    assert max_rel_diff(val_losses(out), val_losses(baseline)) <= 1e-5 and len(val_losses(out)) == 2
    recs = [r for r in read_metrics(out) if "loss" in r]
    ring = 2 * (2 - 1) / 2 * gradient_mb()  # the ring all-reduce minimum for 2 ranks
    assert len(recs) == 12 and all(abs(r["comm_mb"] - ring) <= 0.1 * ring for r in recs), (recs[0]["comm_mb"], ring)
    assert abs(recs[0]["opt_state_mb"] - 2 * gradient_mb()) <= 0.01 * gradient_mb()  # exp_avg + exp_avg_sq, all
    assert "| 2 buckets" in proc.stdout and "overlap: forward+backward+sync" in proc.stdout
    # rank 0 saved the weights where `gpt2.py sample --init-from OUT/model.pt` reads them
    ours = gpt2.load_for_inference(os.path.join(out, "model.pt"), torch.device("cpu")).state_dict()
    ref = gpt2.load_for_inference(os.path.join(baseline, "model.pt"), torch.device("cpu")).state_dict()
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


def test_zero1_with_grad_accum_matches_one_process(random_data, baseline, tmp_path):
    # 2 ranks x 2 rows x 2 micro-steps: micro-step m reads global rows [4m, 4m+4) of the 8-row batch
    out = str(tmp_path / "zero1")
    proc = run_cli(["ddp.py"] + CFG + ["--data", random_data, "--steps", "12", "--batch-size", "2", "--grad-accum", "2",
                                       "--zero1", "--bucket-mb", "2", "--overlap-steps", "0", "--out", out], nproc=2)
    assert max_rel_diff(train_losses(out), train_losses(baseline)) <= 1e-5  # (val batches are 2 rows here, not 4)
    recs = [r for r in read_metrics(out) if "loss" in r]
    ring = 2 * (2 - 1) / 2 * gradient_mb()
    # reduce-scatter + all-gather = one all-reduce, and no_sync keeps it to one per step, not per micro-step
    assert len(recs) == 12 and all(abs(r["comm_mb"] - ring) <= 0.1 * ring for r in recs), (recs[0]["comm_mb"], ring)
    assert abs(recs[0]["opt_state_mb"] - gradient_mb()) <= 0.05 * gradient_mb()  # half the replicated state
    assert "(ZeRO-1)" in proc.stdout


def test_one_process_and_bad_input(random_data, baseline, tmp_path, monkeypatch):
    # without torchrun ddp.py is the single-process trainer (world 1: no collective at all); the first
    # 3 steps lie in the warmup, so their learning rates do not depend on --steps
    ddp.main(CFG + ["--data", random_data, "--steps", "3", "--batch-size", "8", "--eval-every", "0", "--zero1",
                    "--out", str(tmp_path / "one")])
    assert max_rel_diff(train_losses(str(tmp_path / "one")), train_losses(baseline)[:3]) <= 1e-5
    # bad sizes raise before the process group exists, so no rank waits for a peer that has quit
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    base = CFG + ["--data", random_data, "--timeout", "5", "--out", str(tmp_path / "bad")]
    with pytest.raises(ValueError, match="--bucket-mb"):
        ddp.main(base + ["--bucket-mb", "0"])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ddp.main(base + ["--batch-size", "700"])  # 2 x 700 x 16 > the 20k-token shard
    assert not dist.is_initialized()


# -- against torch.nn.parallel.DistributedDataParallel ------------------------------------------------

class Toy(nn.Module):
    """Tied embedding/head, a frozen layer, a layer only rank 1 uses, one nobody uses, a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.sometimes = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, idx, use_sometimes):
        x = torch.tanh(self.body(self.emb(idx))) + self.frozen(self.emb(idx)) * self.scale
        if use_sometimes:
            x = x + self.sometimes(x)
        return self.head(x)


def numpy(state):
    """Tensors leave a spawned process by value (shared-memory tensors die with the process)."""
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def train_toy(rank, world, kind, steps=3, accum=2):
    torch.manual_seed(rank)  # different on each rank: the broadcast from rank 0 must fix it
    model = Toy()
    if rank == 1:
        model.scale.fill_(2.0)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    args = SimpleNamespace(lr=1e-2, beta2=0.95, weight_decay=0.1)
    if kind == "torch":
        wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = gpt2.make_adamw(gpt2.optimizer_groups(model, 0.1), args, torch.device("cpu"))
        no_sync, fwd = wrapped.no_sync, wrapped
    else:
        dp = ddp.DataParallel(model, bucket_mb=0.0004, zero1=kind == "zero1")  # 400 B: several buckets
        opt, no_sync, fwd = dp.make_optimizer(args, torch.device("cpu")), dp.no_sync, model
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        for micro in range(accum):
            idx = torch.randint(0, 16, (4, 5), generator=g)
            with no_sync() if micro < accum - 1 else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(fwd(idx, rank == 1).view(-1, 16), idx.view(-1)) / accum
                loss.backward()
        if kind == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        else:
            dp.finish_grad_sync()
            dp.clip_grad_norm_(0.05)  # small enough to clip: the global norm must be right
        opt.step()
        if kind != "torch":
            dp.all_gather_params()
        opt.zero_grad(set_to_none=True)
    for v in init.values():
        dist.broadcast(v, 0)  # rank 0's initial values, to compare with
    return numpy(model.state_dict()), numpy(init)


def train_gpt(rank, world, kind, steps=2):
    torch.manual_seed(rank)
    model = gpt2.GPT(gpt2.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))
    args = SimpleNamespace(lr=1e-3, beta2=0.95, weight_decay=0.1)
    if kind == "torch":
        fwd = nn.parallel.DistributedDataParallel(model)
        opt = gpt2.make_adamw(gpt2.optimizer_groups(model, 0.1), args, torch.device("cpu"))
    else:
        dp = ddp.DataParallel(model, bucket_mb=0.05)
        fwd, opt = model, dp.make_optimizer(args, torch.device("cpu"))
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(0, 50257, (2, 16), generator=g)
        fwd(idx, idx)[1].backward()
        if kind != "torch":
            dp.finish_grad_sync()
            assert len(dp.buckets) >= 4
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return numpy(model.state_dict())


def against_torch_ddp(rank, world):
    return {kind: train_toy(rank, world, kind) for kind in ("torch", "ours", "zero1")}, \
        {kind: train_gpt(rank, world, kind) for kind in ("torch", "ours")}


def test_matches_torch_ddp_tied_frozen_unused_and_gpt2():
    results = run_distributed(against_torch_ddp, 2)
    toy, gpt = [r[0] for r in results], [r[1] for r in results]
    diff = lambda a, b: max(float(abs(a[k] - b[k]).max()) for k in a)
    for r in range(2):
        ref, init = toy[r]["torch"]
        for kind in ("ours", "zero1"):
            ours, _ = toy[r][kind]
            assert diff(ours, ref) <= 1e-6, (kind, r, diff(ours, ref))
            assert diff(ours, toy[0][kind][0]) == 0  # the replicas are identical
            assert (ours["frozen.weight"] == init["frozen.weight"]).all()  # rank 0's, never trained
            assert (ours["scale"] == init["scale"]).all()  # rank 0's buffer
            # nobody used it: grad None, so not even weight decay touched it (a zero grad would have)
            assert (ours["never.weight"] == init["never.weight"]).all()
            assert (ours["sometimes.weight"] != init["sometimes.weight"]).all()  # rank 1 used it
            assert (ours["emb.weight"] != init["emb.weight"]).any()
        assert diff(gpt[r]["ours"], gpt[r]["torch"]) <= 1e-6
        assert diff(gpt[r]["ours"], gpt[0]["ours"]) == 0
