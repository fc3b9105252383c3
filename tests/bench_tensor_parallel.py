"""Step time of tensor_parallel.py vs PyTorch's DTensor tensor parallelism on the same model, weights and
batches, in one run. The DTensor model: parallelize_module with ColwiseParallel/RowwiseParallel on the
blocks (c_attn's rows reordered so each rank's contiguous slice is [q_r; k_r; v_r]), a RowwiseParallel
vocab-parallel embedding, a ColwiseParallel head sharded on the vocabulary and loss_parallel().

    torchrun --nproc_per_node=2 tests/bench_tensor_parallel.py                        # CPU gloo, tiny
    torchrun --nproc_per_node=2 tests/bench_tensor_parallel.py --overlap-comm         # + a row with it on
    torchrun --nproc_per_node=8 tests/bench_tensor_parallel.py --model gpt2 --seq-len 1024 --batch-size 8 --compile
    python tests/bench_tensor_parallel.py --per-rank-124m      # GPT-2 124M at 8 ranks, fake process group

All must also agree on the loss (same math): the last column is |loss - ours| / ours at the last step.
--overlap-comm adds "tensor_parallel.py --overlap-comm" (same weights and batches) to the same interleaved
run, so before and after see the same machine load.
"""
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:  # under pytest --impl DIR, DIR stays first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2  # noqa: E402
import tensor_parallel as tp  # noqa: E402


def dtensor_model(args, ctx, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = gpt2.build_model(args).to(ctx.device)
    cfg, E = model.config, model.config.n_embd
    perm = torch.arange(3 * E, device=ctx.device).view(3, world, E // world).transpose(0, 1).reshape(-1)
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, b in enumerate(model.h):
        with torch.no_grad():
            b.attn.c_attn.weight.copy_(b.attn.c_attn.weight[perm])
            b.attn.c_attn.bias.copy_(b.attn.c_attn.bias[perm])
        plan.update({f"h.{i}.attn.c_attn": ColwiseParallel(), f"h.{i}.attn.c_proj": RowwiseParallel(),
                     f"h.{i}.mlp.c_fc": ColwiseParallel(), f"h.{i}.mlp.c_proj": RowwiseParallel()})
    mesh = init_device_mesh(ctx.device.type, (world,))
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.wte.weight  # both Shard(0) of (V, E): re-tie after distribution
    pad = torch.zeros(cfg.padded_vocab, device=ctx.device)
    pad[cfg.vocab_size:] = float("-inf")
    return model, distribute_tensor(pad, mesh, [Shard(0)])


def dtensor_step(model, pad, x, y, ctx):
    from torch.distributed.tensor.parallel import loss_parallel
    with loss_parallel():
        with ctx.autocast():
            h = model.forward_blocks(model.embed(x))
            logits = model.lm_head(model.ln_f(h)) + pad
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
    return loss.detach()


def dtensor_clip(model, max_norm):
    from torch.distributed.tensor import DTensor
    norms = [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    for p in model.parameters():
        p.grad.mul_(coef)


def main(argv=None):
    p = gpt2.make_parser("bench: tensor_parallel.py vs DTensor")
    p.add_argument("--sequence-parallel", action="store_true", help="ours with SP (DTensor side stays plain TP)")
    p.add_argument("--overlap-comm", action="store_true", help="add a row: ours with --overlap-comm")
    p.add_argument("--per-rank-124m", action="store_true", help="print the GPT-2 124M per-rank table and exit")
    p.set_defaults(steps=10, batch_size=8, seq_len=64, n_layer=2, eval_every=0, device="auto", out="out/bench_tp")
    args = p.parse_args(argv)
    if args.per_rank_124m:
        print_table(per_rank_124m())
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    args.tp = None  # all ranks form one TP group
    args.tp = tp.validate(args, gpt2.model_config(args), world)
    ctx = gpt2.setup(args)
    cfg = gpt2.model_config(args)
    # the data first: offline without --data, one line naming --data DIR, before any model is built
    loaders = {name: gpt2.make_loaders(args, 0, 1, cfg.vocab_size)[0] for name in ("ours", "ours_overlap", "dtensor")}
    sp = args.sequence_parallel  # the classes tensor_parallel.cli picks for these flags
    grid = tp.make_grid(world, ctx.rank, world, tp.SequenceParallelGrid if sp else tp.Grid)
    model_class = tp.SequenceParallelGPT if sp else tp.TensorParallelGPT
    models = {"ours": model_class(gpt2.build_model(args).to(ctx.device), grid)}
    grids = {"ours": grid}
    if args.overlap_comm:
        grids["ours_overlap"] = tp.make_grid(world, ctx.rank, world,
                                             tp.OverlapSequenceParallelGrid if sp else tp.OverlapCommGrid)
        models["ours_overlap"] = (tp.SequenceParallelGPT if sp else tp.OverlapCommGPT)(
            gpt2.build_model(args).to(ctx.device), grids["ours_overlap"])
    models["dtensor"], pad = dtensor_model(args, ctx, world)
    opts, times, losses = {}, {k: [] for k in models}, {k: [] for k in models}
    for name, model in models.items():
        if args.compile:
            for b in model.h:
                b.attn.compile()
                b.mlp.compile()
        opts[name] = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
    for step in range(args.steps):  # interleaved, so both see the same machine load
        for name, model in models.items():
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for g in opts[name].param_groups:
                g["lr"] = gpt2.lr_at(step, args)
            x, y = (t.to(ctx.device) for t in loaders[name].next_batch())
            if name in grids:
                with ctx.autocast():
                    loss = model(x, y)
                loss.backward()
                model.sync_grads()  # SP: LayerNorm/bias/wpe grads summed over TP
                tp.clip_grad_norm(model, grids[name], args.grad_clip)
            else:
                loss = dtensor_step(model, pad, x, y, ctx)
                dtensor_clip(model, args.grad_clip)
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            losses[name].append(loss.item())
            times[name].append(time.perf_counter() - t0)
    results = {k: (statistics.median(times[k][2:]) * 1e3, losses[k][-1]) for k in models}
    tokens = args.batch_size * args.seq_len
    gpt2.print0(f"\nTP={world} {args.model} (L={gpt2.model_config(args).n_layer}) B={args.batch_size} T={args.seq_len} "
                f"{ctx.device.type} {ctx.dtype}, median of steps 2..{args.steps - 1}")
    gpt2.print0(f"| {'implementation':<40} | step ms | tok/s   | loss at last step | rel diff vs ours |")
    gpt2.print0(f"|{'-' * 42}|---------|---------|-------------------|------------------|")
    for name, (ms, loss) in results.items():
        label = ("tensor_parallel.py" + (" + SP" if args.sequence_parallel else "") +
                 (" --overlap-comm" if name == "ours_overlap" else "")) if name in grids else "DTensor parallelize_module"
        gpt2.print0(f"| {label:<40} | {ms:7.1f} | {tokens / ms * 1e3:7.0f} | {loss:17.6f} | "
                    f"{abs(loss - results['ours'][1]) / results['ours'][1]:16.2e} |")
    if "ours_overlap" in results:  # beside each other, as ddp.py's overlap line: the same steps, interleaved
        on, off = results["ours_overlap"][0], results["ours"][0]
        gpt2.print0(f"overlap: {on:.1f} ms a step with --overlap-comm vs {off:.1f} ms without ({off / on:.2f}x); "
                    f"only backward's dX all-reduces can hide, the forward ones stay exposed")


def per_rank_124m(world=8, batch_size=16, seq_len=1024):
    """GPT-2 124M per rank at `world` ranks for TP=4 x DP=2 and TP=2 x DP=4 (TP=8 does not divide 12 heads),
    with and without sequence parallelism,
    on rank 0 of torch's fake process group (collectives are no-ops; our CommMeter counts every call).
    One bf16-autocast training step at B=1, T=seq_len on CPU: the bytes of each micro-step collective and
    the saved activations scale linearly with B, so both are measured at B=1 and multiplied by batch_size;
    the per-step collectives (gradient sync, norm, loss) are measured as they are."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    args = gpt2.make_parser("").parse_args(["--model", "gpt2", "--batch-size", str(batch_size),
                                            "--seq-len", str(seq_len), "--device", "cpu"])
    cfg = gpt2.model_config(args)
    torch.manual_seed(args.seed)
    full = gpt2.GPT(cfg)
    E, L, V, t_idx = cfg.n_embd, cfg.n_layer, cfg.padded_vocab, torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=t_idx)
    x, y = idx[:, :-1], idx[:, 1:]
    rows = []
    # TP=8 cannot cut GPT-2 124M's 12 heads (validate refuses it): the TP sizes that divide both
    sizes = [t for t in (world, world // 2, world // 4) if t > 1 and cfg.n_head % t == 0 and world % t == 0]
    for tp_size, sp in [(t, sp) for t in sizes for sp in (False, True)]:
        grid = tp.make_grid(world, 0, tp_size, tp.SequenceParallelGrid if sp else tp.Grid)
        model = (tp.SequenceParallelGPT if sp else tp.TensorParallelGPT)(copy.deepcopy(full), grid)
        opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, torch.device("cpu"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            blocks, head, loss = tp.saved_activation_bytes(model, x, y)
        loss.backward()
        micro_mb = grid.meter.take_mb()  # one micro-step at B=1
        model.sync_grads()
        tp.clip_grad_norm(model, grid, args.grad_clip)
        opt.step()
        tp.all_reduce(loss.detach(), grid, group="dp")
        step_mb = grid.meter.take_mb()
        n_local = sum(p.numel() for p in model.parameters())
        # closed form of this rank's parameters: the cut matmuls and wte over t, the rest whole
        n_closed = L * (12 * E * E + 7 * E) // tp_size + L * 6 * E + V * E // tp_size + cfg.block_size * E + 2 * E
        assert n_closed == n_local, (n_closed, n_local)
        mb = lambda tensors: sum(t.numel() * t.element_size() for t in tensors) / 1e6
        rows.append({
            "setup": f"tensor_parallel.py --tp {tp_size}" + (" --sequence-parallel" if sp else "")
                     + (f" (DP={world // tp_size})" if tp_size < world else ""),
            "comm_MB": batch_size * micro_mb + step_mb,
            "comm_MB_closed": model.comm_bytes_per_step(args, 2) / 1e6,
            "params_MB": mb(model.parameters()),
            "grads_MB": mb(p.grad for p in model.parameters()),
            "optim_MB": mb(v for s in opt.state.values() for v in s.values() if v.dim() > 0),
            "act_MB": batch_size * (blocks + head) / 1e6,
            "mem_MB_closed": 16 * n_closed / 1e6,
            "how": f"fake PG rank 0 of {world}, CPU bf16 autocast, one step at B=1 scaled x{batch_size}"})
        del model, opt
    if own:
        dist.destroy_process_group()
    return rows


def print_table(rows):
    keys = ["comm_MB", "comm_MB_closed", "params_MB", "grads_MB", "optim_MB", "act_MB", "mem_MB_closed"]
    print(f"| {'setup':<52} | " + " | ".join(f"{k:>14}" for k in keys) + " |")
    print(f"|{'-' * 54}|" + "|".join("-" * 16 for _ in keys) + "|")
    for r in rows:
        print(f"| {r['setup']:<52} | " + " | ".join(f"{r[k]:14.1f}" for k in keys) + " |")
    print(rows[0]["how"])


if __name__ == "__main__":
    gpt2.run_main(main)  # a mistake (offline without --data, a bad flag) is one line, as in every file
