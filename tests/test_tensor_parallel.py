"""tensor_parallel.py: every parallel layer vs the unsplit layer, our block vs DTensor's, and whole runs
(TP=2, TP=2 + SP, TP=2 x DP=2 + SP) vs `gpt2.py train` step by step."""
import contextlib
import copy
import io
import os

import pytest
import torch

import gpt2
import tensor_parallel as tp
from harness import assert_close, read_metrics, run_distributed, train_losses

CFG = gpt2.GPTConfig(block_size=16, n_layer=1, n_head=4, n_embd=32)
TINY = ["--model", "tiny", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--steps", "12",
        "--device", "cpu", "--dtype", "float32", "--eval-every", "0"]


def diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def grid_for(world, rank, sp=False, overlap=False):
    """One TP group of all ranks, with the Grid subclass the cli picks for these flags."""
    cls = (tp.OverlapSequenceParallelGrid if overlap else tp.SequenceParallelGrid) if sp else \
        tp.OverlapCommGrid if overlap else tp.Grid
    return tp.make_grid(world, rank, world, cls)


def model_for(full, grid):
    """The TensorParallelGPT subclass the cli picks for this grid."""
    cls = tp.SequenceParallelGPT if isinstance(grid, tp.SequenceParallelGrid) else \
        tp.OverlapCommGPT if isinstance(grid, tp.OverlapCommGrid) else tp.TensorParallelGPT
    return cls(full, grid)


def sum_replicated(model, grid):
    """SP: the replicated parameters' grads saw T/t tokens on each rank: add them over TP (as
    SequenceParallelGPT.sync_grads does)."""
    for p in model.parameters():
        if p.grad is not None and not hasattr(p, "tp_split"):
            tp.all_reduce(p.grad, grid)


def _layers(rank, world):
    """Each piece on rank r of 2 against the unsplit gpt2 piece, same weights, same input, same upstream grad."""
    torch.manual_seed(0)
    full = gpt2.GPT(CFG)
    with torch.no_grad():  # non-zero biases: a row-parallel bias added on every rank must show
        for name, p in full.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    B, T, E, t = 2, 8, CFG.n_embd, world
    x = torch.randn(B, T, E)
    out = {}
    for sp in (False, True):
        grid = grid_for(world, rank, sp)
        seq = slice(rank * T // t, (rank + 1) * T // t) if sp else slice(None)

        # column-parallel c_attn (q, k, v each cut): f then the local matmul
        ref = full.h[0].attn.c_attn
        xf = x.clone().requires_grad_()
        y_full = ref(xf)
        gy = torch.randn_like(y_full)
        (y_full * gy).sum().backward()
        col = tp.ColumnParallelLinear(ref, grid, pieces=3)
        col = tp.RegatherColumnLinear(col) if sp else col
        xl = x[:, seq].clone().requires_grad_()
        y = col(tp.enter_tp(xl, grid))
        (y * tp.shard(gy, grid, 2, 3)).sum().backward()
        out[f"column_out_sp{sp}"] = diff(y, tp.shard(y_full.detach(), grid, 2, 3))
        out[f"column_dx_sp{sp}"] = diff(xl.grad, xf.grad[:, seq])
        out[f"column_dw_sp{sp}"] = diff(col.weight.grad, tp.shard(ref.weight.grad, grid, 0, 3))
        ref.zero_grad()

        # row-parallel c_fc->c_proj: the local matmul then g, bias once
        ref = full.h[0].mlp.c_proj
        h = torch.randn(B, T, 4 * E)
        hf = h.clone().requires_grad_()
        y_full = ref(hf)
        gy = torch.randn_like(y_full)
        (y_full * gy).sum().backward()
        row = tp.RowParallelLinear(ref, grid)
        hl = h[..., rank * 4 * E // t:(rank + 1) * 4 * E // t].clone().requires_grad_()
        y = row(hl)
        (y * gy[:, seq]).sum().backward()
        if sp:  # each rank saw its tokens only: the replicated bias's grad is summed over TP
            tp.all_reduce(row.bias.grad, grid)
        out[f"row_out_sp{sp}"] = diff(y, y_full.detach()[:, seq])
        out[f"row_dx_sp{sp}"] = diff(hl.grad, hf.grad[..., rank * 4 * E // t:(rank + 1) * 4 * E // t])
        out[f"row_dw_sp{sp}"] = diff(row.weight.grad, tp.shard(ref.weight.grad, grid, 1))
        out[f"row_db_sp{sp}"] = diff(row.bias.grad, ref.bias.grad)
        ref.zero_grad()

        # the whole block, twice (the second block's input is the first one's output)
        blk = tp.ParallelBlock(copy.deepcopy(full.h[0]), grid)
        if sp:
            tp.wrap_columns([blk], tp.RegatherColumnLinear)
        xf = x.clone().requires_grad_()
        y_full = full.h[0](full.h[0](xf))
        gy = torch.randn_like(y_full)
        (y_full * gy).sum().backward()
        xl = x[:, seq].clone().requires_grad_()
        y = blk(blk(xl))
        (y * gy[:, seq]).sum().backward()
        if sp:
            sum_replicated(blk, grid)
        out[f"block_out_sp{sp}"] = diff(y, y_full.detach()[:, seq])
        out[f"block_dx_sp{sp}"] = diff(xl.grad, xf.grad[:, seq])
        out[f"block_dln_sp{sp}"] = diff(blk.ln_1.weight.grad, full.h[0].ln_1.weight.grad)
        out[f"block_dfc_sp{sp}"] = diff(blk.mlp.c_fc.weight.grad, tp.shard(full.h[0].mlp.c_fc.weight.grad, grid))
        full.zero_grad()

        # vocab-parallel embedding and cross-entropy, with ids on both shards and near the padding
        idx = torch.tensor([[0, 25151, 25152, 50256, 7, 30000, 3, 50000]] * B)
        wte = tp.split_param(full.wte.weight, grid)
        e = tp.vocab_parallel_embedding(idx, wte, grid)
        hidden = torch.randn(B, T, E)
        hl = hidden[:, seq].clone().requires_grad_()
        logits = torch.nn.functional.linear(tp.enter_tp(full.ln_f(hl), grid), wte)
        loss = tp.vocab_parallel_cross_entropy(logits, idx.flip(1), grid, CFG.vocab_size)
        (loss + (e * x[:, seq]).sum()).backward()
        hf = hidden.clone().requires_grad_()
        loss_full = gpt2.cross_entropy(full.logits(hf), idx.flip(1))
        e_full = full.wte(idx)
        (loss_full + (e_full * x).sum()).backward()
        out[f"embed_out_sp{sp}"] = diff(e, e_full.detach()[:, seq])
        out[f"loss_sp{sp}"] = abs(loss.item() - loss_full.item()) / loss_full.item()
        out[f"loss_dh_sp{sp}"] = diff(hl.grad, hf.grad[:, seq])
        out[f"loss_dwte_sp{sp}"] = diff(wte.grad, tp.shard(full.wte.weight.grad, grid))
        full.zero_grad()
        # logits with a large offset (OpenAI's weights give logits near 1000): the row max must be subtracted
        big = tp.vocab_parallel_cross_entropy(logits.detach() + 1000.0, idx.flip(1), grid, CFG.vocab_size)
        ref_big = gpt2.cross_entropy(full.logits(hf).detach() + 1000.0, idx.flip(1))
        out[f"loss_offset1000_sp{sp}"] = abs(big.item() - ref_big.item()) / ref_big.item()
    out["clip_norm"] = _clip_norm(rank, world, full)
    return out


def _layers_then_the_rest(rank, world):
    out = _layers(rank, world)
    torch.manual_seed(0)
    full = gpt2.GPT(CFG)
    x = torch.randn(2, 8, CFG.n_embd)
    return out, {"dtensor": _dtensor_block(rank, world, full, x), "overlap": _overlap_comm(rank, world),
                 "toy": _toy_model(rank, world), "activations": _activations(rank, world)}


def _clip_norm(rank, world, full):
    """clip_grad_norm's global norm of a 2-block TensorParallelGPT vs torch's clip_grad_norm_ on gpt2.GPT: sharded
    squares summed over TP, replicated ones (LayerNorms, biases, wpe) counted once. Relative difference."""
    torch.manual_seed(5)
    full = gpt2.GPT(gpt2.GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 50257, (2, 8), generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(full)
    ref(idx, idx.roll(1, 1))[1].backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
    model = tp.TensorParallelGPT(full, grid_for(world, rank))
    model(idx, idx.roll(1, 1)).backward()
    return abs(tp.clip_grad_norm(model, model.grid, 1e9).item() - expected) / expected


def _activations(rank, world):
    """The bytes a TensorParallelGPT keeps for backward (fp32, CPU) vs activation_bytes_closed_form, for
    TP and TP + SP at two batch shapes: measured - closed, in bytes, per part (embedding + blocks, head)."""
    torch.manual_seed(0)
    cfg = gpt2.GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32)
    full = gpt2.GPT(cfg)
    out = {}
    for B, T in ((2, 16), (3, 32)):
        idx = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(B))
        for sp in (False, True):
            model = model_for(copy.deepcopy(full), grid_for(world, rank, sp))
            blocks, head, _ = tp.saved_activation_bytes(model, idx, idx)
            closed = model.activation_bytes_closed_form(B, T)
            out[(B, T, sp)] = (blocks - closed[0], head - closed[1], blocks)
    return out


def _overlap_comm(rank, world):
    """--overlap-comm moves dX's all-reduce (SP: the input's re-gather) under a matmul: every gradient of
    a 2-block TensorParallelGPT must be bit-identical to the run without it, with and without SP."""
    torch.manual_seed(0)
    full = gpt2.GPT(gpt2.GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 50257, (2, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    for sp in (False, True):
        grads = []
        for overlap in (False, True):
            model = model_for(copy.deepcopy(full), grid_for(world, rank, sp, overlap))
            model(idx, idx.roll(1, 1)).backward()
            model.sync_grads()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        out[f"sp{sp}"] = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
        out[f"sp{sp}_n"] = len(grads[0])
    return out


class Toy(torch.nn.Module):
    """Not a GPT: an embedding, a residual two-layer MLP, an LM head tied to the embedding, and an unused
    Linear. Vocabulary 64, width 16."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight
        self.unused = torch.nn.Linear(16, 16)

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class ToyTP(torch.nn.Module):
    """The toy cut with tensor_parallel.py's pieces, as a course would write it."""

    def __init__(self, toy, grid):
        super().__init__()
        self.grid = grid
        self.emb = tp.split_param(toy.emb.weight, grid)  # (64/t, 16): the embedding and the head
        self.fc1 = tp.ColumnParallelLinear(toy.fc1, grid)
        if isinstance(grid, (tp.SequenceParallelGrid, tp.OverlapCommGrid)):  # the column matmul of the extension
            self.fc1 = (tp.RegatherColumnLinear if isinstance(grid, tp.SequenceParallelGrid) else
                        tp.OverlapColumnLinear)(self.fc1)
        self.fc2 = tp.RowParallelLinear(toy.fc2, grid)
        self.unused = toy.unused

    def forward(self, idx, targets):
        x = tp.vocab_parallel_embedding(idx, self.emb, self.grid)  # (B, T, 16), SP: (B, T/t, 16)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(tp.enter_tp(x, self.grid))))
        h = tp.enter_tp(x, self.grid)
        fn = tp.LinearRegatherInput if isinstance(self.grid, tp.SequenceParallelGrid) else \
            tp.LinearOverlapAllReduce if isinstance(self.grid, tp.OverlapCommGrid) else None
        logits = tp.column_function(fn, h, self.emb, None, self.grid) if fn else \
            torch.nn.functional.linear(h, self.emb)  # (B, T, 64/t)
        return tp.vocab_parallel_cross_entropy(logits, targets, self.grid)


def _toy_model(rank, world):
    """ToyTP (plain, SP, overlap) vs the unsplit Toy over 3 AdamW steps (losses, then every gradient of
    a 4th batch), and vs DTensor's ColwiseParallel/RowwiseParallel + loss_parallel on the same weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
    torch.manual_seed(0)
    toy = Toy()
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (2, 9), generator=gen) for _ in range(4)]
    out = {}
    for sp, overlap in ((False, False), (True, False), (False, True)):
        grid = grid_for(world, rank, sp, overlap)
        ref, ours = copy.deepcopy(toy), ToyTP(copy.deepcopy(toy), grid)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
        for i, b in enumerate(batches):
            losses = [ref(b[:, :8], b[:, 1:]), ours(b[:, :8], b[:, 1:])]
            for model, loss in zip((ref, ours), losses):
                loss.backward()
            if sp:
                sum_replicated(ours, grid)
            out[f"sp{sp}_ov{overlap}_loss{i}"] = abs(losses[1].item() - losses[0].item()) / losses[0].item()
            if i == 3:
                break
            for opt in opts:
                opt.step()
                opt.zero_grad()
        pairs = {"emb": (ours.emb.grad, tp.shard(ref.emb.weight.grad, grid)),
                 "fc1": (ours.fc1.weight.grad, tp.shard(ref.fc1.weight.grad, grid)),
                 "fc1_b": (ours.fc1.bias.grad, tp.shard(ref.fc1.bias.grad, grid)),
                 "fc2": (ours.fc2.weight.grad, tp.shard(ref.fc2.weight.grad, grid, 1)),
                 "fc2_b": (ours.fc2.bias.grad, ref.fc2.bias.grad)}
        out.update({f"sp{sp}_ov{overlap}_{k}": diff(a, b) for k, (a, b) in pairs.items()})
        assert ours.unused.weight.grad is None and ref.unused.weight.grad is None
    # DTensor: the same cut through parallelize_module; the head re-tied to the distributed embedding
    ref, ours = copy.deepcopy(toy), ToyTP(copy.deepcopy(toy), tp.make_grid(world, rank, world))
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(ref, mesh, {"emb": RowwiseParallel(input_layouts=Replicate()), "fc1": ColwiseParallel(),
                                   "fc2": RowwiseParallel(),
                                   "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    ref.head.weight = ref.emb.weight
    b = batches[0]
    with loss_parallel():
        loss_ref = ref(b[:, :8], b[:, 1:])
        loss_ref.backward()
    loss = ours(b[:, :8], b[:, 1:])
    loss.backward()
    loss_ref = loss_ref.full_tensor() if hasattr(loss_ref, "full_tensor") else loss_ref
    out["dtensor_loss"] = abs(loss.item() - loss_ref.item()) / loss.item()
    out["dtensor_emb"] = diff(ours.emb.grad, ref.emb.weight.grad.to_local())
    out["dtensor_fc1"] = diff(ours.fc1.weight.grad, ref.fc1.weight.grad.to_local())
    out["dtensor_fc2"] = diff(ours.fc2.weight.grad, ref.fc2.weight.grad.to_local())
    out["dtensor_fc2_b"] = diff(ours.fc2.bias.grad, ref.fc2.bias.grad.full_tensor())
    return out


def _dtensor_block(rank, world, full, x):
    """Our block vs PyTorch's parallelize_module(ColwiseParallel/RowwiseParallel) on the same weights.
    DTensor cuts c_attn's 3E rows contiguously, so first reorder them to [q0 k0 v0 | q1 k1 v1]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    E = CFG.n_embd
    ref = copy.deepcopy(full.h[0])
    perm = torch.arange(3 * E).view(3, world, E // world).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        ref.attn.c_attn.weight.copy_(ref.attn.c_attn.weight[perm])
        ref.attn.c_attn.bias.copy_(ref.attn.c_attn.bias[perm])
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(ref, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                   "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    ours = tp.ParallelBlock(copy.deepcopy(full.h[0]), tp.make_grid(world, rank, world))
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yo = ref(xr), ours(xo)
    yr.pow(2).sum().backward()
    yo.pow(2).sum().backward()
    return {"out": diff(yo, yr.detach()), "dx": diff(xo.grad, xr.grad),
            "dqkv": diff(ours.attn.c_attn.weight.grad, ref.attn.c_attn.weight.grad.to_local()),
            "dproj": diff(ours.mlp.c_proj.weight.grad, ref.mlp.c_proj.weight.grad.to_local()),
            "dbias": diff(ours.attn.c_proj.bias.grad, ref.attn.c_proj.bias.grad.full_tensor())}


def test_bad_sizes_fail_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    base = ["--device", "cpu", "--model", "tiny"]
    with pytest.raises(ValueError, match="--tp 3 does not divide the 4 ranks"):
        tp.cli(base + ["--tp", "3"])
    with pytest.raises(ValueError, match="3 heads cannot be split over 2 ranks"):
        tp.cli(base + ["--tp", "2", "--n-head", "3", "--n-embd", "96"])
    with pytest.raises(ValueError, match="--seq-len 30 is not divisible"):
        tp.cli(base + ["--tp", "4", "--sequence-parallel", "--seq-len", "30"])
    # 50304 = 2^7 * 3 * 131 divides by 2, 3, 4, 6, 8 ranks, not by 5
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(ValueError, match="padded vocabulary 50304 is not divisible by 5"):
        tp.cli(base + ["--tp", "5", "--n-head", "5", "--n-embd", "40"])


def _train(rank, world, runs):
    """tensor_parallel.main on this process group for each (argv), rank 0's printed lines returned."""
    printed = []
    for argv in runs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            tp.cli(argv)
        printed.append(buf.getvalue())
    return printed


def _dp_grads(rank, world):
    """TP=2 x DP=2: each DP rank's batch through its TP group, then sync_grads; every gradient vs gpt2.GPT's on
    both batches (the mean loss over the 4 sequences): relative difference per tensor."""
    torch.manual_seed(0)
    full = gpt2.GPT(gpt2.GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 50257, (4, 8), generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(full)
    ref(idx, idx.roll(1, 1))[1].backward()
    model = tp.TensorParallelGPT(full, tp.make_grid(world, rank, 2))
    rows = slice(2 * model.grid.dp_rank, 2 * model.grid.dp_rank + 2)
    model(idx[rows], idx.roll(1, 1)[rows]).backward()
    model.sync_grads()
    refs = dict(ref.named_parameters())
    out = {}
    for name, p in model.named_parameters():  # the names of gpt2.GPT's, but wte's bare Parameter
        r = refs[name if "." in name else name + ".weight"].grad
        r = tp.shard(r, model.grid, *p.tp_split) if hasattr(p, "tp_split") else r
        out[name] = diff(p.grad, r)
    return out


def test_parallel_layers_dtensor_overlap_toy_vs_unsplit():
    """Per layer first (2 ranks): every parallel piece vs the unsplit gpt2 piece (non-zero biases, logits offset
    by +1000, the clip norm), with and without SP; then our block vs DTensor's, --overlap-comm's gradients, a
    toy model, and the activations' closed form. Then TP=2 x DP=2 (4 ranks): every gradient after sync_grads."""
    torch.set_num_threads(1)
    for rank, (res, rest) in enumerate(run_distributed(_layers_then_the_rest, 2, timeout=300)):
        bad = {k: f"{v:.1e}" for k, v in res.items() if not v < 1e-5}
        assert not bad, f"rank {rank}: per-layer relative difference from the unsplit layer above 1e-5: {bad}"
        assert len(res) == 2 * 16 + 1, sorted(res)
        dt, overlap, toy, acts = rest["dtensor"], rest["overlap"], rest["toy"], rest["activations"]
        assert all(v < 1e-5 for v in dt.values()), f"rank {rank}: our block vs DTensor's above 1e-5: {dt}"
        assert overlap == {"spFalse": 0.0, "spFalse_n": 28, "spTrue": 0.0, "spTrue_n": 28}, \
            f"rank {rank}: --overlap-comm's gradients differ from the plain run (expected 0.0, 28 tensors): {overlap}"
        assert len(toy) == 3 * 9 + 5 and all(v < 1e-5 for v in toy.values()), f"rank {rank} toy above 1e-5: {toy}"
        # activations vs their closed form: tolerance 0 bytes (measured: exact, both parts, TP and SP)
        assert len(acts) == 4 and all(a[:2] == (0, 0) and a[2] > 0 for a in acts.values()), \
            f"rank {rank}: activation bytes measured - closed form (expected 0, 0): {acts}"
    for rank, res in enumerate(run_distributed(_dp_grads, 4, timeout=300)):
        bad = {k: f"{v:.2e}" for k, v in res.items() if not v < 1e-5}
        assert not bad, f"rank {rank}: gradient after sync_grads vs gpt2's on the whole batch (the DP mean), " \
                        f"relative difference above 1e-5 (2.0e+00 = summed, not averaged): {bad}"


def _train_and_draw(rank, world, runs):
    """_train, and the labels the first run's timeline drew."""
    printed = []
    for i, argv in enumerate(runs):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            model, _ = tp.cli(argv)
        printed.append(buf.getvalue())
        if i == 0:
            labels = sorted({span[0] for span in model.grid.timeline.spans})
    return printed, labels


def test_training_matches_gpt2(random_data, tmp_path, monkeypatch):
    """Whole runs, same seed, same global batch of 8: TP=2 and TP=2 + SP at --grad-accum 2 (2 ranks) and
    TP=2 x DP=2 + SP (4 ranks) vs gpt2.py train's losses, final weights and bytes per step; TP=2 in bf16
    (3 steps, vs `gpt2.py train --dtype bfloat16`), with --compile (3 steps, vs the eager run's steps 0-2), and
    a 60-step curve (batch 2) vs gpt2.py's. The first run draws OUT/timeline.png with each block's f and g."""
    data, base, base_bf16 = ["--data", random_data], str(tmp_path / "base"), str(tmp_path / "base_bf16")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    gpt2.train(["--batch-size", "8", "--out", base] + TINY + data)
    short = ["--tp", "2", "--batch-size", "8", "--steps", "3"]
    gpt2.train(["--batch-size", "8", "--out", base_bf16] + TINY + data + short[2:] + ["--dtype", "bfloat16"])
    long = ["--batch-size", "2", "--steps", "60", "--warmup", "5"]
    gpt2.train(TINY + data + long + ["--out", str(tmp_path / "base_long")])
    runs = {"tp2": ["--tp", "2", "--batch-size", "8"],
            "tp2_sp": ["--tp", "2", "--sequence-parallel", "--batch-size", "4", "--grad-accum", "2"],
            "tp2_dp2_sp": ["--tp", "2", "--sequence-parallel", "--batch-size", "4"],
            "tp2_bf16": short + ["--dtype", "bfloat16"],
            "tp2_compile": short + ["--compile"],
            "tp2_long": ["--tp", "2"] + long}
    argv = {k: TINY + data + v + ["--out", str(tmp_path / k)] for k, v in runs.items()}
    two = run_distributed(_train_and_draw, 2, [argv[k] for k in ("tp2", "tp2_sp", "tp2_bf16", "tp2_compile",
                                                                 "tp2_long")], timeout=600)
    printed = two[0][0][:2] + run_distributed(_train, 4, [argv["tp2_dp2_sp"]], timeout=240)[0]

    ref = torch.load(os.path.join(base, "model.pt"))["model"]
    for (name, out), stdout in zip(list(argv.items())[:3], printed):
        out = out[-1]
        assert_close(f"train loss, tensor_parallel.py {name} fp32 vs gpt2.py", train_losses(out), train_losses(base),
                     1e-4, hint="per-layer checks passed, so look at the loop: sync_grads, clip_grad_norm, grad-accum")
        recs = [r for r in read_metrics(out) if "loss" in r]
        line = next(l for l in stdout.splitlines() if l.startswith("communication per step per rank"))
        closed = float(line.split(" MB closed form")[0].rsplit(" ", 1)[1])  # printed to 3 decimals
        sent = [r["comm_mb"] for r in recs]
        assert all(abs(m - closed) <= 5e-4 for m in sent), f"{name}: bytes per step {sent} MB measured vs " \
                                                          f"{closed} MB closed form ({line})"
        assert recs[0]["comm_mb"] > 0
        # the TP group's gathered weights are gpt2's. The key bias is excluded: its true gradient is 0
        # (a constant added to every key shifts all scores of a query equally), so its grad is rounding
        # noise that Adam normalises into lr-sized steps of random sign.
        got = torch.load(os.path.join(out, "model.pt"))["model"]
        assert got.keys() == ref.keys()
        for k in ref:
            keep = torch.ones(ref[k].shape[0], dtype=torch.bool)
            if k.endswith("attn.c_attn.bias"):
                keep[ref[k].numel() // 3: 2 * ref[k].numel() // 3] = False
            worst = (got[k][keep] - ref[k][keep]).abs().max().item()
            assert worst <= 1e-5, f"{name}: final weight {k} differs from gpt2.py's by {worst:.1e} (tolerance 1e-5)"
        # the payoff: the activations beside their closed form (fp32: equal to the printed digit), and the
        # summary record holds the printed figures
        line = next(l for l in stdout.splitlines() if l.startswith("activations per rank"))
        summary = next(r["summary"] for r in read_metrics(out) if "summary" in r)
        for part in ("blocks", "head"):  # tolerance 0 bytes (measured: exact, TP and SP)
            got, want = summary[f"activation_mb_{part}"], summary[f"activation_mb_{part}_closed_form"]
            assert got == want and f"{got:.2f} MB" in line, f"{name}: activations of the {part}: " \
                                                            f"{got} MB measured, {want} MB closed form ({line})"
        assert summary["activation_mb_blocks"] < summary["activation_mb_blocks_tp1"], summary
        assert abs(summary["comm_mb_per_step"] - closed) <= 5e-4 and summary["params_per_rank"] > 0, summary
        # grad_norm: the pre-clip global norm every step, gpt2.py's (same batches, same weights)
        norms = [r.get("grad_norm") for r in recs]
        assert all(n is not None and n > 0 for n in norms), f"{name}: grad_norm not recorded every step: {norms}"
        ref_norms = [r.get("grad_norm") for r in read_metrics(base) if "loss" in r]
        if all(n is not None for n in ref_norms):
            assert_close(f"grad_norm, tensor_parallel.py {name} vs gpt2.py", norms, ref_norms, 1e-4)

    # 60 steps (batch 2, warmup 5): the curve holds (measured max relative difference: see tests/README.md)
    assert_close("train loss, tensor_parallel.py --tp 2 fp32 vs gpt2.py, 60 steps batch 2",
                 train_losses(tmp_path / "tp2_long"), train_losses(tmp_path / "base_long"), 1e-4)
    # bf16: within 3e-5 of gpt2.py's bf16 losses (measured 3.1e-6: the partial sums of the row-parallel
    # matmuls are rounded to bf16 before the all-reduce adds them); the probe shows bf16's halved activations
    assert_close("train loss, tensor_parallel.py --tp 2 bf16 vs gpt2.py bf16", train_losses(tmp_path / "tp2_bf16"),
                 train_losses(base_bf16), 3e-5)
    mb = [float(next(l for l in out.splitlines() if l.startswith("activations per rank")).split(": ")[1]
                .split(" MB")[0]) for out in (two[0][0][0], two[0][0][2])]
    assert mb[1] < 0.75 * mb[0], f"activation MB fp32 run, bf16 run: {mb} (bf16 expected below 0.75x)"
    # --compile: the same losses as eager at steps 0-2 (measured: identical)
    assert_close("train loss, tensor_parallel.py --tp 2 --compile vs eager", train_losses(tmp_path / "tp2_compile"),
                 train_losses(tmp_path / "tp2")[:3], 1e-6)
    # the picture: each block's compute, the all-reduces over TP (f, g, the loss's) below
    labels = two[0][1]
    expected = {"block 0", "block 1", "all-reduce tp"}
    assert expected <= set(labels), f"timeline labels {labels} lack {sorted(expected - set(labels))}"
    for picture in ("timeline.png", "timeline_forward.png"):
        assert (tmp_path / "tp2" / picture).stat().st_size > 10_000, f"OUT/{picture} missing or empty"


def _diverge(rank, world, argv):
    """gpt2.run_main(tensor_parallel.main) as the CLI runs it: (exit code, what this rank printed to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            gpt2.run_main(tp.cli, argv)
        except SystemExit as e:
            return e.code, err.getvalue()
    return 0, err.getvalue()


def test_diverging_run_saves_nothing(shakespeare, tmp_path):
    """--lr 1e3 without clipping: step 1's loss is still finite (7e7), the update after it is not. Every rank
    checks its weights before the gathered model.pt is written: exit 2, one line, no model.pt."""
    out = tmp_path / "diverged"
    argv = ["--model", "tiny", "--tp", "2", "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--eval-every", "0",
            "--device", "cpu", "--dtype", "float32", "--lr", "1e3", "--grad-clip", "0", "--warmup", "0",
            "--data", shakespeare, "--out", str(out)]
    (code, err), (code1, err1) = run_distributed(_diverge, 2, argv, timeout=240)
    assert (code, code1, err1) == (2, 2, ""), (code, code1, err1)
    assert err.count("\n") == 1 and "error: the weights are not finite after step 1" in err, err
    assert (out / "metrics.jsonl").exists() and not (out / "model.pt").exists()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_tp_larger_than_a_node_is_warned(monkeypatch, capsys):
    """TP belongs inside a node: --tp above torchrun's LOCAL_WORLD_SIZE (processes of one node) gets one line
    on rank 0; within a node, nothing."""
    monkeypatch.setenv("RANK", "0")
    for tp_size, local, lines in ((4, 2, 1), (2, 2, 0), (2, 4, 0)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        tp.warn_tp_across_nodes(tp_size)
        out = capsys.readouterr().out
        assert out.count("\n") == lines and (not lines or out.startswith(f"warning: --tp {tp_size} is larger")), out
    monkeypatch.setenv("RANK", "1")
    tp.warn_tp_across_nodes(4)
    assert capsys.readouterr().out == ""


def test_overlap_comm_orders_cuda_work(monkeypatch, capsys):
    """--overlap-comm needs CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM) for dX's all-reduce to run before the
    dW matmul: set while CUDA has not started and the user set nothing; otherwise one warning line."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    tp.order_comm_before_compute()
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and capsys.readouterr().out == ""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # the user's own value is kept, and warned about
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tp.order_comm_before_compute()
    out = capsys.readouterr().out
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and out.count("\n") == 1 and out.startswith("warning: "), out


def test_overlap_comm_sets_cuda_connections_before_setup(monkeypatch, tmp_path):
    """cli --overlap-comm: CUDA_DEVICE_MAX_CONNECTIONS=1 is in the environment when gpt2.setup (the first
    thing that may start CUDA) is called, and CUDA has not started by then."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    seen = {}

    def setup(args, *a, **k):
        seen["env"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        raise KeyboardInterrupt  # stop here: nothing else to run

    monkeypatch.setattr(gpt2, "setup", setup)
    with pytest.raises(KeyboardInterrupt):
        tp.cli(["--tp", "1", "--overlap-comm", "--device", "cpu", "--out", str(tmp_path / "o")])
    assert seen == {"env": "1"}, f"CUDA_DEVICE_MAX_CONNECTIONS when setup ran: {seen} (expected 1)"


def _trace(rank, world, runs):
    """tensor_parallel.cli for each argv under a dispatch mode: (model class, grid class, the op trace of
    the recorded step (mm outputs' shapes, collectives by name) from its first backward op on)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    out = []
    for argv in runs:
        trace, state = [], {"on": False}

        class Trace(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                name = str(func)
                if state["on"] and (name.startswith("c10d.") or name == "aten.mm.default"):
                    trace.append((name, tuple(result.shape) if name == "aten.mm.default" else None))
                return result

        start_step, log_step = gpt2.Metrics.start_step, gpt2.Metrics.log_step

        def marked_start(self):
            state["on"] = len(self.records) == 1  # step 1: the timeline's recorded step
            return start_step(self)

        def marked_log(self, *a, **k):
            state["on"] = False
            return log_step(self, *a, **k)

        gpt2.Metrics.start_step, gpt2.Metrics.log_step = marked_start, marked_log
        try:
            with contextlib.redirect_stdout(io.StringIO()), Trace():
                model, _ = tp.cli(argv)
        finally:
            gpt2.Metrics.start_step, gpt2.Metrics.log_step = start_step, log_step
        columns = {tuple(m.weight.shape) for b in model.h for m in (b.attn.c_attn, b.mlp.c_fc)}
        out.append((type(model).__name__, type(model.grid).__name__, trace, columns | {tuple(model.wte.shape)}))
    return out


def dw_after_all_reduce(trace, column_shapes):
    """How many column matmuls' dW products come right after an all-reduce, before any other product:
    --overlap-comm's order (dX, all-reduce issued, dW), never the plain one's (dX, dW, then f's all-reduce)."""
    n = 0  # a product, the all-reduce, a product of a column weight's shape: not the loss's all-reduces
    for (before, _), (op, _), (after, shape) in zip(trace, trace[1:], trace[2:]):
        n += (before, op, after) == ("aten.mm.default", "c10d.allreduce_.default", "aten.mm.default") and \
            shape in column_shapes
    return n


def test_each_flag_changes_what_it_must(random_data, tmp_path):
    """A flag read but not applied passes every curve comparison (the math is the same): each documented
    flag must change what it exists to change, on 2 ranks, 2 steps each. --tp: this rank's parameters
    (1 = DP over the whole model); --sequence-parallel: all-gathers and reduce-scatters replace the
    all-reduces, the blocks' activations fall, the loss stays; --overlap-comm: every column matmul's dW
    comes after its dX all-reduce is issued (plain: before), the loss stays; --activation-checkpointing:
    the recomputed attention's g (bytes per step, as the closed form says); --grad-clip 0: no clipping
    (same pre-clip norm at step 0, other weights after it); --grad-accum 2 at half the batch: one batch's
    norm. B*T = 96 is no column weight's row count (48, 64), so no dX product reads as a dW."""
    base = TINY + ["--steps", "2", "--warmup", "0", "--data", random_data]
    runs = {"tp2": ["--tp", "2", "--batch-size", "6"], "tp1": ["--tp", "1", "--batch-size", "3"],
            "sp": ["--tp", "2", "--batch-size", "6", "--sequence-parallel"],
            "overlap": ["--tp", "2", "--batch-size", "6", "--overlap-comm"],
            "ckpt": ["--tp", "2", "--batch-size", "6", "--activation-checkpointing"],
            "noclip": ["--tp", "2", "--batch-size", "6", "--grad-clip", "0"],
            "accum": ["--tp", "2", "--batch-size", "3", "--grad-accum", "2"]}
    argv = [base + v + ["--out", str(tmp_path / k)] for k, v in runs.items()]
    traced = dict(zip(runs, run_distributed(_trace, 2, argv, timeout=600)[0]))
    recs = {k: [r for r in read_metrics(tmp_path / k) if "loss" in r] for k in runs}
    summary = {k: next(r["summary"] for r in read_metrics(tmp_path / k) if "summary" in r) for k in runs}
    losses = {k: [r["loss"] for r in v] for k, v in recs.items()}

    assert summary["tp1"]["params_per_rank"] > 1.9 * summary["tp2"]["params_per_rank"], \
        f"--tp 1 vs --tp 2: parameters on rank 0 {summary['tp1']['params_per_rank']} vs " \
        f"{summary['tp2']['params_per_rank']} (expected about 2x: --tp not applied?)"
    ops = {k: {op for op, _ in traced[k][2] if op.startswith("c10d.")} for k in runs}
    assert {"c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"} <= ops["sp"] and \
        traced["sp"][:2] == ("SequenceParallelGPT", "SequenceParallelGrid"), \
        f"--sequence-parallel: collectives {sorted(ops['sp'])}, classes {traced['sp'][:2]}"
    # per layer sbh(16/t) with SP against sbh(4 + 12/t) without: 0.8x at t = 2, and exactly the closed form
    sp, plain = summary["sp"], summary["tp2"]
    assert sp["activation_mb_blocks"] == sp["activation_mb_blocks_closed_form"] \
        < 0.85 * plain["activation_mb_blocks"], \
        f"--sequence-parallel: blocks' activations {sp['activation_mb_blocks']} MB (closed form " \
        f"{sp['activation_mb_blocks_closed_form']}) vs {plain['activation_mb_blocks']} MB without (expected 0.8x)"
    n_columns = 2 * 2 + 1  # c_attn and c_fc of 2 blocks, and the head
    overlapped = {k: dw_after_all_reduce(traced[k][2], traced[k][3]) for k in ("tp2", "overlap")}
    assert overlapped == {"tp2": 0, "overlap": n_columns}, \
        f"column matmuls whose dW follows their dX all-reduce: {overlapped} (expected 0 plain, {n_columns} " \
        f"with --overlap-comm: the flag must move each all-reduce before its dW)"
    for k in ("sp", "overlap", "ckpt"):  # the same math: the same losses as plain TP
        assert_close(f"train loss, --tp 2 with {k} vs plain", losses[k], losses["tp2"], 1e-5)
    extra = summary["ckpt"]["comm_mb_per_step"] - summary["tp2"]["comm_mb_per_step"]
    assert extra > 0 and abs(summary["ckpt"]["comm_mb_per_step"] - summary["ckpt"]["comm_mb_closed_form"]) < 1e-9, \
        f"--activation-checkpointing: {extra} MB more per step (expected > 0, the recomputed g's), {summary['ckpt']}"
    # clipping: AdamW's first update is nearly scale-free, the second mixes two differently clipped steps
    norm0 = [recs[k][0]["grad_norm"] for k in ("tp2", "noclip")]
    weights = [torch.load(tmp_path / k / "model.pt")["model"] for k in ("tp2", "noclip")]
    moved = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])
    assert norm0[0] == norm0[1] > 1.0 and moved > 0, \
        f"--grad-clip 0 vs 1: step 0 norms {norm0} (expected equal, above 1), final weights differ by {moved} " \
        f"(expected > 0: the clip applied with the flag only)"
    # fp32 sums in another order (two micro-batches): a relative 1e-5 (measured: ~1e-7); a loss not divided by
    # --grad-accum gives 2x
    assert_close("grad_norm, --batch-size 2 --grad-accum 2 vs --batch-size 4", [r["grad_norm"] for r in recs["accum"]],
                 [r["grad_norm"] for r in recs["tp2"]], 1e-5)


def _clip_syncs(rank, world):
    """The host syncs (tests/host_syncs.py's counters) of grad_norm and clip_grad_norm on a 2-block
    TensorParallelGPT after one backward: CUDA would wait for none (the loop reads the norm with the loss)."""
    from host_syncs import counters
    torch.manual_seed(0)
    model = tp.TensorParallelGPT(gpt2.GPT(gpt2.GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32)),
                                 grid_for(world, rank))
    idx = torch.randint(0, 50257, (2, 8), generator=torch.Generator().manual_seed(1))
    model(idx, idx.roll(1, 1)).backward()
    counter = counters()
    counter.on = True
    with counter.dispatch, counter.function:
        norm = tp.grad_norm(model, model.grid)
        clipped = tp.clip_grad_norm(model, model.grid, 0.5)
    counter.on = False
    return dict(counter.tally), norm.item(), clipped.item(), tp.grad_norm(model, model.grid).item()


def test_norm_and_clip_add_no_host_sync():
    """The clip's coefficient stays a tensor (CUDA: no wait): zero host syncs in grad_norm and
    clip_grad_norm (a norm.item() or a Python min() there is counted), and the clip does clip."""
    for rank, (tally, norm, clipped, after) in enumerate(run_distributed(_clip_syncs, 2, timeout=120)):
        assert tally == {}, f"rank {rank}: host syncs in grad_norm/clip_grad_norm: {tally} (expected none)"
        assert norm == clipped > 0.5 and abs(after - 0.5) < 1e-5, (norm, clipped, after)


def test_bench_offline_without_data_is_one_line(tmp_path):
    """tests/bench_tensor_parallel.py without --data, offline (the download goes to a closed proxy port), in a
    directory without data/: every rank stops with exit 2, rank 0 prints one line naming --data DIR, no
    traceback (it was urllib's), and the --out it made is gone."""
    import subprocess
    import sys

    from harness import ROOT, free_port, launch_env
    env = launch_env({"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "",
                      "NO_PROXY": ""})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           os.path.join(ROOT, "tests", "bench_tensor_parallel.py"), "--steps", "1", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # torchrun reports the exit code with its own traceback (elastic's ChildFailedError): none of the bench's
    ours = [line for line in proc.stderr.splitlines() if "bench_tensor_parallel.py\", line" in line or "urllib" in line]
    assert proc.returncode != 0 and not ours and len(errors) == 1, proc.stderr[-3000:]
    assert "--data DIR" in errors[0], errors[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "data" / "shakespeare" / "input.txt").exists()
