"""fsdp2.py: the loss curve of gpt2.py train in both reshard modes (2 and 4 ranks) and with HSDP (2 x 2), the
same parameters as torch's fully_shard (2 and 4 ranks, padded slices at 4, HSDP on a 2 x 2 mesh), 1/N slices,
gathered weights freed after forward in ZeRO-3, at most 2 units gathered and 2 reduce-scatters in flight, the
traffic formulas, both --mp-policy choices against gpt2.py in bf16, --compile = eager, the exported state dict,
a diverged last update refused before anything is written, FullyShardedModel as an nn.Module on a toy model
(SGD(fsdp.parameters()) = one process = fully_shard), and bad input."""
import math
import os

import pytest
import torch
import torch.distributed as dist

import fsdp2
import gpt2
from harness import max_rel_diff, read_metrics, run_cli, run_distributed, train_losses

STEPS = 12
TINY = ["--model", "tiny", "--n-layer", "2", "--n-embd", "42", "--n-head", "2", "--seq-len", "16", "--device", "cpu",
        "--dtype", "float32", "--eval-every", "0", "--warmup", "3", "--lr", "3e-3", "--steps", str(STEPS)]


def param_rel_diff(a, b):
    """max over tensors of ||a - b|| / ||b||. AdamW divides each gradient by its own running RMS, so
    an element whose gradient nearly cancels turns fp32 reordering noise into a visible step: the
    same single process run as 2 micro-steps of 4 already differs from 1 of 8 by ~1e-4. Any
    real mistake (a wrong slice, a missing rank) moves the parameters by tens of percent."""
    assert sorted(a) == sorted(b)
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)


@pytest.fixture(scope="module")
def baseline(shakespeare, tmp_path_factory):
    """The single-process run every sharded run must reproduce: 12 steps of 8 sequences."""
    out = str(tmp_path_factory.mktemp("base"))
    run_cli(["gpt2.py", "train", *TINY, "--data", shakespeare, "--batch-size", "8", "--out", out])
    return out


def fully_shard_train(args, rank, world, reshard_after_forward, replicate=1):
    """The same model, batches and loop with PyTorch's FSDP2: a unit per Block plus the root; with
    --dtype bfloat16, bf16 gathers and fp32 reductions under CPU autocast, as fsdp2.py does; with
    replicate > 1, HSDP on a (replicate, world / replicate) DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard")) \
        if replicate > 1 else init_device_mesh("cpu", (world,))
    bf16 = args.dtype == "bfloat16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    model = gpt2.build_model(args)
    for block in model.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, torch.device("cpu"))
    loader, _ = gpt2.make_loaders(args, rank, world)
    losses = []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = gpt2.lr_at(step, args)
        x, y = loader.next_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}, losses


def ours_vs_fully_shard(rank, world, argv, reshard, other_mode_out=None):
    """Train with fsdp2.train (the CLI path, in this process group; optionally the other reshard mode
    too, into other_mode_out), look inside (2 ranks), then train fully_shard on the same batches.
    Rank 0 returns the largest parameter difference, both loss curves and what the inspection found."""
    if other_mode_out:
        fsdp2.train(argv + ["--reshard-after-forward", str(1 - reshard), "--out", other_mode_out])
    fsdp, opt = fsdp2.train(argv + ["--reshard-after-forward", str(reshard)])
    out = argv[argv.index("--out") + 1]
    ours_losses = train_losses(out) if rank == 0 else None
    found = inspect_sharding(fsdp, opt) if world == 2 else {"max_gathered_trained": fsdp.max_gathered_units}
    args = gpt2.make_parser("").parse_args(argv)
    theirs, their_losses = fully_shard_train(args, rank, world, bool(reshard))
    if world == 2:  # mixed precision: bf16 gathers, fp32 reductions, against fully_shard's policy; and
        # the autocast policy (fp32 gathers); and --compile at steps 0-2 (warmup 3: the same lr as the 12-step run)
        argv_bf16 = argv + ["--dtype", "bfloat16", "--steps", "4", "--out", out + "_bf16"]
        fsdp_bf16, _ = fsdp2.train(argv_bf16 + ["--reshard-after-forward", str(reshard)])
        found["gathered_dtype_bf16"] = str(fsdp_bf16.root.full[0].dtype)
        found["fully_shard_bf16_losses"] = fully_shard_train(gpt2.make_parser("").parse_args(argv_bf16), rank, world, bool(reshard))[1]
        fsdp_ac, _ = fsdp2.train(argv_bf16 + ["--mp-policy", "autocast", "--out", out + "_autocast"])
        found["gathered_dtype_autocast"] = str(fsdp_ac.root.full[0].dtype)
        if other_mode_out:
            fsdp2.train(argv + ["--compile", "--steps", "3", "--out", out + "_compiled"])
        found["toy"] = toy_vs_one_process_and_fully_shard(rank, world)  # any module, in this process group
        found["diverged"] = diverging_run(argv, out + "_diverged")
    if world == 4:  # HSDP: 2 replicas x 2 shards, against fully_shard on a 2 x 2 DeviceMesh
        hsdp, _ = fsdp2.train(argv + ["--replicate", "2", "--out", out + "_hsdp"])
        found["n_total"] = sum(math.prod(s) for u in hsdp.all_units for s in u.shapes)
        found["n_root"] = sum(math.prod(s) for s in hsdp.root.shapes)
        theirs_hsdp, found["fully_shard_hsdp_losses"] = fully_shard_train(args, rank, world, True, replicate=2)
    if rank != 0:
        return None
    ours = torch.load(os.path.join(out, "model.pt"), weights_only=True)["model"]
    if world == 4:
        found["hsdp_param_diff"] = param_rel_diff(torch.load(os.path.join(out + "_hsdp", "model.pt"), weights_only=True)["model"],
                                                  theirs_hsdp)
    return param_rel_diff(ours, theirs), ours_losses, their_losses, found


def diverging_run(argv, out):
    """A run whose last update makes the weights NaN (its losses are finite): every rank checks its own
    slices before anything is written, and the run ends as bad input does, in one line on rank 0, exit 2,
    no model.pt (in this process group: the check is collective, so the ranks stay in step)."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            gpt2.run_main(fsdp2.train, argv + ["--grad-clip", "0", "--lr", "1e8", "--warmup", "0", "--steps", "2",
                                              "--out", out])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue(), os.path.exists(os.path.join(out, "model.pt"))


def inspect_sharding(fsdp, opt):
    """The slices, the freeing of gathered weights, in both modes, on a trained FullyShardedGPT."""
    res = {"max_gathered_trained": fsdp.max_gathered_units, "max_reduces_in_flight": fsdp.max_reduces_in_flight}
    # 1. each rank persistently holds 1/world of every parameter (plus padding rows), and its AdamW
    #    state is exactly its slice: 2 fp32 tensors per slice
    res["n_total"] = sum(math.prod(s) for u in fsdp.all_units for s in u.shapes)
    res["n_root"] = sum(math.prod(s) for s in fsdp.root.shapes)
    res["shard_numel"] = sum(s.numel() for s in fsdp.parameters())
    res["adam_numel"] = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k != "step")
    res["nothing_gathered_after_step"] = all(p.untyped_storage().nbytes() == 0 for u in fsdp.all_units for p in u.padded)
    # 2. gathered weights are freed after forward in ZeRO-3 and kept in ZeRO-2 (no optimizer step
    #    here: the parameters stay those of model.pt)
    x = torch.randint(0, 50257, (4, 16))
    for mode in (1, 0):
        if mode:  # ZeRO-3: the core's after_forward again
            fsdp.__dict__.pop("after_forward", None)
        else:
            fsdp2.keep_gathered_until_backward(fsdp)
        fsdp.max_gathered_units = 0
        loss = fsdp(x, x)
        res[f"blocks_alive_after_forward_{mode}"] = [sum(p.untyped_storage().nbytes() for p in u.padded) for u in fsdp.units]
        res[f"root_alive_after_forward_{mode}"] = all(p.untyped_storage().nbytes() > 0 for p in fsdp.root.padded)
        loss.backward()  # ends reduced: the autograd engine calls fsdp.finish_backward
        res[f"freed_after_backward_{mode}"] = all(p.untyped_storage().nbytes() == 0 for u in fsdp.all_units for p in u.padded)
        res[f"max_gathered_{mode}"] = fsdp.max_gathered_units
        res[f"full_grads_dropped_{mode}"] = all(p.grad is None for u in fsdp.all_units for p in u.full)
        opt.zero_grad(set_to_none=True)
    return res


def test_both_modes_match_single_process_and_fully_shard_2_ranks(baseline, shakespeare, tmp_path):
    """2 ranks x 4 sequences = gpt2.py train with 8, ZeRO-3 and SHARD_GRAD_OP; SHARD_GRAD_OP also against
    fully_shard(reshard_after_forward=False), in fp32 and in bf16 mixed precision; then 1/N slices,
    the freeing, the traffic formulas, both --mp-policy choices vs gpt2.py bf16, --compile, a toy model."""
    out, out3 = str(tmp_path / "zero2"), str(tmp_path / "zero3")
    argv = [*TINY, "--data", shakespeare, "--batch-size", "4", "--out", out]
    diff, ours, theirs, r = run_distributed(ours_vs_fully_shard, 2, argv, 0, out3, timeout=300)[0]
    ref = train_losses(baseline)
    assert ref[-1] < ref[0] - 0.3  # it really trains, so agreeing is not just agreeing on noise
    for got in (ours, train_losses(out3)):
        assert len(got) == STEPS and max_rel_diff(got, ref) <= 1e-5, (got, ref)
    # the exported full state dict (model.pt, gathered on rank 0) loads into gpt2.GPT and is the
    # single-process model
    a = torch.load(os.path.join(baseline, "model.pt"), weights_only=True)["model"]
    b = gpt2.load_for_inference(os.path.join(out3, "model.pt"), torch.device("cpu")).state_dict()
    assert param_rel_diff(b, a) < 1e-3
    assert diff <= 1e-3 and max_rel_diff(ours, theirs) <= 1e-5, (diff, ours, theirs)
    # every dim 0 of the 42-wide model divides by 2: the slices are exactly half, AdamW's m and v too
    assert r["shard_numel"] * 2 == r["n_total"] and r["adam_numel"] == 2 * r["shard_numel"]
    assert r["nothing_gathered_after_step"]
    assert r["blocks_alive_after_forward_1"] == [0, 0] and r["root_alive_after_forward_1"]
    assert all(b > 0 for b in r["blocks_alive_after_forward_0"]) and r["root_alive_after_forward_0"]
    assert r["freed_after_backward_1"] and r["freed_after_backward_0"]
    assert r["full_grads_dropped_1"] and r["full_grads_dropped_0"]
    assert r["max_gathered_1"] == 2 and r["max_gathered_0"] == 2  # prefetch: this unit + the next
    # traffic per step, (n-1)/n of the full fp32 bytes per collective, plus the two 4-byte
    # all-reduces (grad norm, loss): ZeRO-2 gathers every unit once = DDP's all-reduce volume;
    # ZeRO-3 gathers the blocks twice (the root once, it stays until its backward)
    # --dtype bfloat16: gathers of 2-byte weights, reductions still 4-byte fp32
    P, n_root = r["n_total"], r["n_root"]
    for path, gathers, pbytes in ((out, 1, 4), (out3, 2, 4), (out + "_bf16", 1, 2)):
        theory = (0.5 * (pbytes * (gathers * (P - n_root) + n_root) + 4 * P) + 2 * 2 * 0.5 * 4) / 1e6
        comm = [rec["comm_mb"] for rec in read_metrics(path) if "loss" in rec]
        assert len(comm) in (STEPS, 4) and all(abs(c - theory) < 1e-9 for c in comm), (comm, theory)
    assert r["gathered_dtype_bf16"] == "torch.bfloat16" and r["gathered_dtype_autocast"] == "torch.float32"
    bf16 = train_losses(out + "_bf16")
    assert max_rel_diff(bf16, r["fully_shard_bf16_losses"]) <= 1e-3 and max_rel_diff(bf16, ref[:4]) > 1e-6
    # --mp-policy against gpt2.py train --dtype bfloat16 (same global batch, 4 steps): autocast gathers fp32
    # and autocast casts per op, gpt2.py's numerics, so only the reduction order differs (measured 4e-6);
    # bf16-gather makes the embeddings, LayerNorms and residual stream bf16 (measured ~3e-5, several
    # times further). Tolerances: 2e-5 and 3e-4.
    ref_bf16 = str(tmp_path / "ref_bf16")
    run_cli(["gpt2.py", "train", *TINY, "--data", shakespeare, "--batch-size", "8", "--dtype", "bfloat16",
             "--steps", "4", "--out", ref_bf16])
    ref_bf16 = train_losses(ref_bf16)
    d_autocast, d_gather = max_rel_diff(train_losses(out + "_autocast"), ref_bf16), max_rel_diff(bf16, ref_bf16)
    print(f"bf16 vs gpt2.py train --dtype bfloat16: autocast {d_autocast:.2e}, bf16-gather {d_gather:.2e}")
    assert d_autocast <= 2e-5 and d_gather <= 3e-4 and d_gather > 2 * d_autocast, (d_autocast, d_gather)
    theory = (0.5 * (4 * (2 * (P - n_root) + n_root) + 4 * P) + 2 * 2 * 0.5 * 4) / 1e6  # autocast: fp32 gathers, ZeRO-3
    assert all(abs(rec["comm_mb"] - theory) < 1e-9 for rec in read_metrics(out + "_autocast") if "loss" in rec)
    # FullyShardedModel on a toy model (not a GPT): = one-process training and = fully_shard, tied weight
    # and unused parameter included (the unused one keeps its initial value, as in one process)
    toy = r["toy"]
    print("toy model, 3 SGD steps, relative parameter difference from one process:", toy)
    assert toy["ours"] <= 1e-5 and toy["fully_shard"] <= 1e-5 and toy["all_ranks"] <= 1e-5 and toy["trained"] > 1e-2, toy
    assert toy["ours_unused_kept"] and toy["one_unused_kept"] and toy["units"] == 3 and toy["module"]
    assert toy["with_grad"][0] == toy["with_grad"][1] > 0  # .grad set on the shards when backward ends
    assert toy["n_parameters"][0] == toy["n_parameters"][1] == 18  # parameters() = one shard per parameter, no more
    # a diverged last update is refused before anything is written (the losses were finite)
    code, err, saved = r["diverged"]
    assert code == 2 and not saved and err.count("\n") == 1, (code, err, saved)
    assert err.startswith("error: the weights are not finite after step 1 (") and "(--lr): nothing was saved" in err
    assert r["max_reduces_in_flight"] == 2  # the memory formula's two fp32 reduce buffers
    # --compile (each Block's forward and the head compiled, hooks eager) = eager at steps 0-2
    compiled = train_losses(out + "_compiled")
    assert len(compiled) == 3 and max_rel_diff(compiled, train_losses(out3)[:3]) <= 1e-6, compiled


def test_same_parameters_as_fully_shard_and_single_process_4_ranks(baseline, shakespeare, tmp_path):
    """4 ranks x 2 sequences, ZeRO-3: the 42-wide model's biases, LayerNorms and c_attn rows do not
    divide by 4, so this run pads. Then HSDP, 2 replicas x 2 shards, against fully_shard's HSDP."""
    out = str(tmp_path / "fs4")
    argv = [*TINY, "--data", shakespeare, "--batch-size", "2", "--out", out]
    diff, ours, theirs, r = run_distributed(ours_vs_fully_shard, 4, argv, 1, timeout=300)[0]
    assert max_rel_diff(ours, train_losses(baseline)) <= 1e-5
    assert diff <= 1e-3 and max_rel_diff(ours, theirs) <= 1e-5, (diff, ours, theirs)
    assert r["max_gathered_trained"] == 2
    # HSDP (--replicate 2: shards of 2 ranks, replicated twice) = gpt2.py train and fully_shard on a 2 x 2 mesh
    hsdp = train_losses(out + "_hsdp")
    assert max_rel_diff(hsdp, train_losses(baseline)) <= 1e-5 and max_rel_diff(hsdp, r["fully_shard_hsdp_losses"]) <= 1e-5
    assert r["hsdp_param_diff"] <= 1e-3, r["hsdp_param_diff"]
    # bytes per step: gathers (blocks twice, root once) + reduce-scatter inside 2 ranks, the reduced half
    # all-reduced across 2 replicas, grad-norm all-reduce over 2, loss all-reduce over 4 (no padding at S = 2)
    P, n_root = r["n_total"], r["n_root"]
    theory = (0.5 * (4 * (2 * (P - n_root) + n_root) + 4 * P) + 2 * 0.5 * 4 * P / 2 + 2 * 0.5 * 4 + 2 * 0.75 * 4) / 1e6
    comm = [rec["comm_mb"] for rec in read_metrics(out + "_hsdp") if "loss" in rec]
    assert len(comm) == STEPS and all(abs(c - theory) < 1e-9 for c in comm), (comm, theory)


def test_bad_input_fails_before_any_collective(shakespeare, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = [*TINY, "--data", shakespeare, "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="exceeds the model's context"):
        fsdp2.train(base + ["--seq-len", "999"])
    with pytest.raises(ValueError, match=r"--grad-accum is 0 \(--grad-accum\)"):
        fsdp2.train(base + ["--grad-accum", "0"])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        fsdp2.train(base + ["--batch-size", "20000"])
    with pytest.raises(ValueError, match=r"--replicate 3 does not divide the 2 ranks \(--replicate\)"):
        fsdp2.train(base + ["--replicate", "3"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="torchrun"):
        fsdp2.train(base)
    assert not dist.is_initialized()


class Toy(torch.nn.Module):
    """A course-style model, not a GPT: an embedding tied to the head (17 rows: 2 ranks pad), three
    residual blocks (RMSNorm, Linear, GELU, Linear) in an nn.ModuleList, and a Linear that forward never
    calls (no gradient: the optimizer must leave it alone)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(17, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.RMSNorm(8), torch.nn.Linear(8, 12),
                                                              torch.nn.GELU(), torch.nn.Linear(12, 8)) for _ in range(3))
        self.head = torch.nn.Linear(8, 17, bias=False)
        self.head.weight = self.emb.weight
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, idx, targets):
        x = self.emb(idx)  # (B, T, 8)
        for layer in self.layers:
            x = x + layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).view(-1, 17), targets.reshape(-1))


def toy_vs_one_process_and_fully_shard(rank, world):
    """3 SGD steps of Toy on a global batch of 4 x 6 tokens (each rank its 2 rows): in one process, as
    FullyShardedModel(model) used like fully_shard (default units: the ModuleList's blocks; the root:
    the tied embedding/head and the unused Linear; SGD(fsdp.parameters()), nothing else called), and with
    fully_shard on the same units. Rank 0 returns the comparisons; full_state_dict(all_ranks=True) is
    checked on every rank (the largest difference of any rank)."""
    from torch.distributed.fsdp import fully_shard
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 17, (4, 7), generator=g) for _ in range(3)]
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)

    def run(params, loss_of):
        opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
        for batch in data:
            loss_of(batch).backward()
            with_grad = sum(p.grad is not None for p in opt.param_groups[0]["params"])
            opt.step()
            opt.zero_grad(set_to_none=True)
        return with_grad

    torch.manual_seed(1)
    one = Toy()
    one_with_grad = run(list(one.parameters()), lambda b: one(b[:, :-1], b[:, 1:]))
    torch.manual_seed(1)
    model = Toy()
    fsdp = fsdp2.FullyShardedModel(model)
    ours_with_grad = run(list(fsdp.parameters()), lambda b: fsdp(b[rows, :-1], b[rows, 1:]))
    ours, everywhere = fsdp2.full_state_dict(fsdp), fsdp2.full_state_dict(fsdp, all_ranks=True)
    torch.manual_seed(1)
    theirs = Toy()
    for layer in theirs.layers:
        fully_shard(layer)
    fully_shard(theirs)
    run(list(theirs.parameters()), lambda b: theirs(b[rows, :-1], b[rows, 1:]))
    theirs = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    torch.manual_seed(1)
    init = Toy().state_dict()
    one_params, one = list(one.parameters()), one.state_dict()
    everywhere_diff = torch.tensor(param_rel_diff(everywhere, one))
    dist.all_reduce(everywhere_diff, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    return {"ours": param_rel_diff(ours, one), "fully_shard": param_rel_diff(theirs, one),
            "all_ranks": everywhere_diff.item(), "units": len(fsdp.units), "module": fsdp.module is model,
            "n_parameters": (len(list(fsdp.parameters())), len(list(one_params))),
            "with_grad": (ours_with_grad, one_with_grad),
            "trained": ((one["emb.weight"] - init["emb.weight"]).norm() / init["emb.weight"].norm()).item(),
            "ours_unused_kept": torch.equal(ours["unused.weight"], init["unused.weight"]),
            "one_unused_kept": torch.equal(one["unused.weight"], init["unused.weight"])}
