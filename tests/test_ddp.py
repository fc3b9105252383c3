"""ddp.py: the 2-rank run reproduces `gpt2.py train` step by step (plain; ZeRO-2 with grad accumulation,
fp32; ZeRO-1 with grad accumulation in bf16, within a stated tolerance; --compile equal to eager), sends
the closed-form bytes, and its memory per rank equals the closed form; DataParallel and ShardedOptimizer
on a toy model with tied, frozen and unused parameters match non-parallel training and torch's
DistributedDataParallel."""
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
    # what holds (issue 24): the first steps agree to ~1e-7 (fp32, only the summation order differs), and
    # the difference compounds with the steps (8.6e-6 after 200 steps on Shakespeare), so the curve is within 1e-5
    assert max_rel_diff(train_losses(out)[:3], train_losses(baseline)[:3]) <= 3e-7
    assert max_rel_diff(train_losses(out), train_losses(baseline)) <= 1e-5
    assert max_rel_diff(val_losses(out), val_losses(baseline)) <= 1e-5 and len(val_losses(out)) == 2
    recs = [r for r in read_metrics(out) if "loss" in r]
    ring = 2 * (2 - 1) / 2 * gradient_mb()  # the ring all-reduce minimum for 2 ranks
    assert len(recs) == 12 and all(abs(r["comm_mb"] - ring) <= 0.1 * ring for r in recs), (recs[0]["comm_mb"], ring)
    assert abs(recs[0]["opt_state_mb"] - 2 * gradient_mb()) <= 0.01 * gradient_mb()  # exp_avg + exp_avg_sq, all
    assert "| 2 buckets" in proc.stdout and "overlap: forward+backward+sync" in proc.stdout
    g = gradient_mb()  # params 4P, grads 4P, AdamW 8P: measured from the tensors DataParallel allocated
    assert f"memory per rank (plain, MB): params {g:.3f} (closed {g:.3f}) | grads {g:.3f} (closed {g:.3f}) | " \
           f"optim {2 * g:.3f} (closed {2 * g:.3f})" in proc.stdout, proc.stdout
    # rank 0 saved the weights where `gpt2.py sample --init-from OUT/model.pt` reads them
    ours = gpt2.load_for_inference(os.path.join(out, "model.pt"), torch.device("cpu")).state_dict()
    ref = gpt2.load_for_inference(os.path.join(baseline, "model.pt"), torch.device("cpu")).state_dict()
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


def test_zero2_with_grad_accum_matches_one_process(random_data, baseline, tmp_path):
    out = str(tmp_path / "zero2")
    proc = run_cli(["ddp.py"] + CFG + ["--data", random_data, "--steps", "12", "--batch-size", "2", "--grad-accum", "2",
                                       "--zero", "2", "--bucket-mb", "2", "--overlap-steps", "0", "--out", out],
                   nproc=2)
    assert max_rel_diff(train_losses(out), train_losses(baseline)) <= 1e-5
    recs = [r for r in read_metrics(out) if "loss" in r]
    g = gradient_mb()
    closed = (2 + 1) * (2 - 1) / 2 * g  # a reduce-scatter per micro-step (no no_sync in ZeRO-2) + one all-gather
    assert len(recs) == 12 and all(abs(r["comm_mb"] - closed) <= 0.02 * closed for r in recs), recs[0]["comm_mb"]
    # gradients: 4P/N kept + the bucket being reduced (the largest: wte, 50304 x 32 fp32, alone) + the two
    # before it still in flight (small here); plain and ZeRO-1 keep 4P
    wte = 4 * 50304 * 32 / 1e6
    assert g / 2 + wte <= recs[0]["grad_peak_mb"] <= g / 2 + wte + 0.05 * g, (recs[0]["grad_peak_mb"], g)
    assert abs(recs[0]["opt_state_mb"] - g) <= 0.05 * g
    assert "memory per rank (ZeRO-2, MB)" in proc.stdout


def test_zero1_bf16_with_grad_accum_near_gpt2_bf16(random_data, tmp_path):
    # bf16 autocast, fp32 master weights and gradients: 2 ranks x 2 rows x 2 micro-steps, so the matmuls
    # see 2 rows instead of 8 and the bf16 rounding may differ a little from one process (measured 7.0e-7
    # relative over 3 steps; 5e-5 allowed). --zero 1: ZeRO1DataParallel, the fused reduce-scatter path.
    base = str(tmp_path / "base16")
    gpt2.train(CFG + ["--data", random_data, "--batch-size", "8", "--steps", "3", "--eval-every", "0",
                      "--dtype", "bfloat16", "--out", base])
    out = str(tmp_path / "zero1")
    proc = run_cli(["ddp.py"] + CFG + ["--data", random_data, "--steps", "3", "--batch-size", "2", "--grad-accum", "2",
                                       "--eval-every", "0", "--dtype", "bfloat16", "--zero", "1",
                                       "--overlap-steps", "0",
                                       "--out", out], nproc=2)
    assert max_rel_diff(train_losses(out), train_losses(base)) <= 5e-5
    recs = [r for r in read_metrics(out) if "loss" in r]
    ring = 2 * (2 - 1) / 2 * gradient_mb()
    # reduce-scatter + all-gather = one all-reduce, and no_sync keeps it to one per step, not per micro-step
    assert len(recs) == 3 and all(abs(r["comm_mb"] - ring) <= 0.1 * ring for r in recs), (recs[0]["comm_mb"], ring)
    assert abs(recs[0]["opt_state_mb"] - gradient_mb()) <= 0.05 * gradient_mb()  # half the replicated state
    assert "| ZeRO1DataParallel |" in proc.stdout


def test_one_process_and_bad_input(random_data, baseline, tmp_path, monkeypatch):
    # without torchrun ddp.py is the single-process trainer (world 1: no collective at all); the first
    # 3 steps lie in the warmup, so their learning rates do not depend on --steps
    ddp.main(CFG + ["--data", random_data, "--steps", "3", "--batch-size", "8", "--eval-every", "0", "--zero", "1",
                    "--out", str(tmp_path / "one")])
    assert max_rel_diff(train_losses(str(tmp_path / "one")), train_losses(baseline)[:3]) <= 1e-5
    # --compile (block by block, hooks and buckets around it) equals eager at steps 0-2 (measured: bitwise)
    ddp.main(CFG + ["--data", random_data, "--steps", "3", "--batch-size", "8", "--eval-every", "0", "--compile",
                    "--zero", "2", "--out", str(tmp_path / "compiled")])
    assert max_rel_diff(train_losses(str(tmp_path / "compiled")), train_losses(baseline)[:3]) <= 1e-6
    # bad sizes raise before the process group exists, so no rank waits for a peer that has quit
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    base = CFG + ["--data", random_data, "--timeout", "5", "--out", str(tmp_path / "bad")]
    with pytest.raises(ValueError, match="--bucket-mb"):
        ddp.main(base + ["--bucket-mb", "-1"])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ddp.main(base + ["--batch-size", "700"])  # 2 x 700 x 16 > the 20k-token shard
    assert not dist.is_initialized()


def test_weights_not_finite_after_the_last_update_save_nothing(random_data, tmp_path, capsys):
    # step 0's loss is computed before the update (finite); AdamW's decoupled decay, times (1 - lr * wd) = -1e41,
    # then overflows fp32 in the 2-D weights
    out = tmp_path / "inf"
    with pytest.raises(SystemExit) as e:
        gpt2.run_main(ddp.main, CFG + ["--data", random_data, "--steps", "1", "--batch-size", "2", "--eval-every", "0",
                                       "--lr", "1e37", "--weight-decay", "1e4", "--warmup", "0", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: the weights are not finite after step 0")
    assert (out / "metrics.jsonl").exists() and not (out / "model.pt").exists()


def test_sharded_optimizer_refuses_optimizers_that_are_not_elementwise():
    def run(cls, sharded, **kw):  # one process: ShardedOptimizer flattens the matrices into 1-D pieces
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = ddp.ShardedOptimizer(model.parameters(), cls, elementwise=True, **kw) if sharded \
            else cls(model.parameters(), **kw)
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    for cls, kw in ((torch.optim.AdamW, dict(lr=1e-2)), (torch.optim.SGD, dict(lr=0.1, momentum=0.9))):
        assert (run(cls, True, **kw) - run(cls, False, **kw)).abs().max() <= 1e-7, cls
    # why they are refused: Adafactor's row/column statistics of a matrix are not those of a flat piece
    drift = (run(torch.optim.Adafactor, True, lr=1e-2) - run(torch.optim.Adafactor, False, lr=1e-2)).abs().max()
    assert drift > 1e-4, drift
    with pytest.raises(gpt2.UsageError, match=r"cannot shard Adafactor: .*\(SGD, Adam, AdamW, .*elementwise=True"):
        ddp.ShardedOptimizer(nn.Linear(4, 4).parameters(), torch.optim.Adafactor, lr=1e-2)
    ddp.ShardedOptimizer(nn.Linear(4, 4).parameters(), torch.optim.SGD, lr=1e-2)  # accepted without the flag


# -- the building blocks on a toy model: vs one process and vs torch's DistributedDataParallel ----------

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


STEPS, ACCUM = 3, 2


def toy_data(rank):
    """Rank r's micro-batches: different on each rank, (4, 5) tokens each."""
    g = torch.Generator().manual_seed(100 + rank)
    return [[torch.randint(0, 16, (4, 5), generator=g) for _ in range(ACCUM)] for _ in range(STEPS)]


def toy_loss(net, idx, rank):
    return nn.functional.cross_entropy(net(idx, rank == 1).view(-1, 16), idx.view(-1)) / ACCUM


def make_opt(kind, params):
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW, groups, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    return torch.optim.SGD, groups, dict(lr=0.5, momentum=0.9)


def numpy(state):
    """Tensors leave a spawned process by value (shared-memory tensors die with the process)."""
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def train_reference(optim):
    """One process, the global batch (both ranks' micro-batches, the mean of their losses), rank 0's init."""
    torch.manual_seed(0)
    model = Toy()
    cls, groups, kw = make_opt(optim, [p for p in model.parameters() if p.requires_grad])
    opt = cls(groups, **kw)
    data = [toy_data(0), toy_data(1)]
    for step in range(STEPS):
        for micro in range(ACCUM):
            sum(toy_loss(model, data[r][step][micro], r) for r in range(2)).div(2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # small enough to clip: the norm must be global
        opt.step()
        opt.zero_grad(set_to_none=True)
    return numpy(model.state_dict())


def train_toy(rank, world, kind, bucket_mb=0.0004, optim="adamw"):
    """kind: torch (DistributedDataParallel), plain / zero1 / zero2 (our DataParallel, ZeRO1DataParallel,
    ZeRO2DataParallel with its make_optimizer), sharded (our DataParallel + a ShardedOptimizer with its own
    layout), torch+sharded (torch's DDP averages, our ShardedOptimizer steps)."""
    torch.manual_seed(rank)  # different on each rank: the broadcast from rank 0 must fix it
    model = Toy()
    if rank == 1:
        model.scale.fill_(2.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    cls, groups, kw = make_opt(optim, trainable)
    dp = None
    if kind.startswith("torch"):
        net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        wrapper = {"zero1": ddp.ZeRO1DataParallel, "zero2": ddp.ZeRO2DataParallel}.get(kind, ddp.DataParallel)
        net = dp = wrapper(model, bucket_mb=bucket_mb)
    if kind.startswith("zero"):
        opt = dp.make_optimizer(groups, cls, **kw)  # the ShardedOptimizer laid out on the buckets
    elif kind.endswith("sharded"):
        opt = ddp.ShardedOptimizer(groups, cls, bucket_mb=0.0002, **kw)  # a layout unlike the buckets
    else:
        opt = cls(groups, **kw)
    data = toy_data(rank)
    for step in range(STEPS):
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            # ZeRO-2's no_sync cannot skip the sync: it reduce-scatters each micro-step, finishing on exit
            with net.no_sync() if not last else contextlib.nullcontext():
                toy_loss(net, data[step][micro], rank).backward()
            if dp is not None and last:
                dp.finish_grad_sync()
        if isinstance(opt, ddp.ShardedOptimizer):
            opt.clip_grad_norm_(0.05)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state_numel = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    buckets = len(dp.buckets) if dp is not None else None
    return numpy(model.state_dict()), state_numel, buckets


def check_module_api(rank, world):
    """DataParallel is the module: same parameters, same state_dict keys, same output."""
    torch.manual_seed(0)
    model = Toy()
    dp = ddp.DataParallel(model)
    idx = torch.arange(10).view(2, 5)
    same_out = bool(torch.equal(dp(idx, True), model(idx, True)))
    same_params = [id(p) for p in dp.parameters()] == [id(p) for p in model.parameters()]
    same_keys = list(dp.state_dict()) == list(model.state_dict())
    dp.load_state_dict(model.state_dict())
    try:
        ddp.DataParallel(model)  # a second wrapper would steal the first one's gradients
        refused = False
    except ValueError:
        refused = True
    dp.close()
    return same_out and same_params and same_keys and refused


TOY = [("torch", 0, "adamw"), ("plain", 0.0, "adamw"), ("plain", 0.0004, "adamw"), ("plain", 25.0, "adamw"),
       ("plain", None, "adamw"), ("zero1", 0.0004, "adamw"), ("zero2", 0.0, "adamw"), ("zero2", 0.0004, "adamw"),
       ("zero2", None, "adamw"), ("sharded", 25.0, "adamw"), ("sharded", 25.0, "sgd"), ("zero1", 0.0004, "sgd"),
       ("torch+sharded", 0, "sgd")]


def train_gpt(rank, world, kind, steps=2):
    torch.manual_seed(rank)
    model = gpt2.GPT(gpt2.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))
    args = SimpleNamespace(lr=1e-3, beta2=0.95, weight_decay=0.1)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, 0.1), args, torch.device("cpu"))
    net = nn.parallel.DistributedDataParallel(model) if kind == "torch" else ddp.DataParallel(model, bucket_mb=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(0, 50257, (2, 16), generator=g)
        net(idx, idx)[1].backward()
        if kind != "torch":
            net.finish_grad_sync()
            assert len(net.buckets) >= 4
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return numpy(model.state_dict())


def building_blocks(rank, world):
    import time
    t0 = time.perf_counter()
    out = {"reference": {o: train_reference(o) for o in ("adamw", "sgd")},
            "toy": {v: train_toy(rank, world, *v) for v in TOY},
            "api": check_module_api(rank, world),
            "gpt": {kind: train_gpt(rank, world, kind) for kind in ("torch", "ours")}}
    print("TIME", time.perf_counter() - t0, flush=True)
    return out


def test_building_blocks_match_one_process_and_torch_ddp():
    results = run_distributed(building_blocks, 2)
    diff = lambda a, b: max(float(abs(a[k] - b[k]).max()) for k in a)
    torch.manual_seed(0)
    init = numpy(Toy().state_dict())  # rank 0's initial values (the broadcast makes them everyone's)
    n_trainable = sum(p.numel() for p in Toy().parameters() if p.requires_grad)  # the tied one once
    for r in range(2):
        res = results[r]
        assert res["api"]
        ref = res["reference"]
        torch_state = res["toy"][("torch", 0, "adamw")][0]
        assert diff(torch_state, ref["adamw"]) <= 1e-6  # torch's DDP = one process, to start with
        for v in TOY[1:]:
            ours, state_numel, buckets = res["toy"][v]
            assert diff(ours, ref[v[2]]) <= 1e-6, (v, r, diff(ours, ref[v[2]]))
            if v[2] == "adamw":
                assert diff(ours, torch_state) <= 1e-6, (v, r)
            assert diff(ours, results[0]["toy"][v][0]) == 0, v  # the replicas are identical
            assert (ours["frozen.weight"] == init["frozen.weight"]).all()  # rank 0's, never trained
            assert (ours["scale"] == init["scale"]).all()  # rank 0's buffer
            # nobody used it: grad None, so not even weight decay touched it (a zero grad would have)
            assert (ours["never.weight"] == init["never.weight"]).all()
            assert (ours["sometimes.weight"] != init["sometimes.weight"]).all()  # rank 1 used it
            assert (ours["emb.weight"] != init["emb.weight"]).any()
            if v[0] != "torch+sharded":  # our DataParallel's buckets
                assert buckets == {0.0: 7, None: 1}.get(v[1], buckets)  # 0: one per parameter (tied: once)
                assert buckets > (3 if v[1] == 0.0004 else 0)
            if v[0] in ("zero1", "zero2", "sharded", "torch+sharded"):  # each element's state on one rank only
                used = n_trainable - 8 * 8 - 8  # `never` has no gradient, so no state
                per_elem = 2 if v[2] == "adamw" else 1  # AdamW: exp_avg, exp_avg_sq; SGD: momentum
                both = state_numel + results[1 - r]["toy"][v][1]
                assert both == per_elem * used and 0 < state_numel < both, (v, r, state_numel, used)
        assert diff(res["gpt"]["ours"], res["gpt"]["torch"]) <= 1e-6
        assert diff(res["gpt"]["ours"], results[0]["gpt"]["ours"]) == 0
