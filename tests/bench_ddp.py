"""Benchmark ddp.DataParallel against torch.nn.parallel.DistributedDataParallel, same model, same batches.

    torchrun --nproc_per_node=2 tests/bench_ddp.py                     # CPU, gloo (tiny GPT-2, 4 layers)
    torchrun --nproc_per_node=8 tests/bench_ddp.py --model gpt2 --batch-size 16 --seq-len 1024

A step is forward, backward, gradient sync, clip, AdamW. The variants run in interleaved rounds (so
background load hits them alike); the table gives each one's median step time and its ratio to torch's
DDP, plus the bytes each rank sent per step and the largest weight difference to torch's DDP at the end.
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp  # noqa: E402
import gpt2  # noqa: E402


def main():
    p = gpt2.make_parser("ours vs torch DDP step time")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of both DDPs")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.set_defaults(steps=3, batch_size=4, seq_len=64)  # --steps: timed steps per variant per round
    args = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", 1)) < 2:
        sys.exit("launch with torchrun --nproc_per_node=2 (or more): see the docstring")
    ctx = gpt2.setup(args)
    g = torch.Generator().manual_seed(1234 + ctx.rank)
    batches = [torch.randint(0, 50257, (args.batch_size, args.seq_len + 1), generator=g) for _ in range(args.steps)]

    variants = {}
    for name in ("torch DDP", "ours", "ours, one bucket after backward", "ours + ZeRO-1"):
        model = gpt2.build_model(args).to(ctx.device)
        meter = gpt2.CommMeter()
        if name == "torch DDP":
            fwd = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
            opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
            dp = None
        else:
            mb = float("inf") if "one bucket" in name else args.bucket_mb
            dp = ddp.DataParallel(model, mb, zero1="ZeRO" in name, meter=meter)
            fwd, opt = model, dp.make_optimizer(args, ctx.device)
        variants[name] = dict(model=model, fwd=fwd, opt=opt, dp=dp, meter=meter, times=[])
    for v in variants.values():
        v["meter"].take_mb()  # the start-up broadcast is not a step

    def step(v, batch):
        x, y = batch[:, :-1].to(ctx.device), batch[:, 1:].to(ctx.device)
        with ctx.autocast():
            loss = v["fwd"](x, y)[1]
        loss.backward()
        if v["dp"] is None:
            torch.nn.utils.clip_grad_norm_(v["model"].parameters(), args.grad_clip)
        else:
            v["dp"].finish_grad_sync()
            v["dp"].clip_grad_norm_(args.grad_clip)
        v["opt"].step()
        if v["dp"] is not None:
            v["dp"].all_gather_params()
        v["opt"].zero_grad(set_to_none=True)

    for v in variants.values():  # warm up (allocations, thread pools)
        step(v, batches[0])
    for _ in range(args.rounds):
        for v in variants.values():
            for b in batches:
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                step(v, b)
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
                v["times"].append(time.perf_counter() - t0)
    n_steps = 1 + args.rounds * args.steps
    ref = variants["torch DDP"]
    t_ref = statistics.median(ref["times"])
    grad_mb = sum(q.numel() * q.element_size() for q in ref["model"].parameters()) / 1e6
    gpt2.print0(f"\n{ctx.world} ranks, {ctx.device} {ctx.dtype}, {dist.get_backend()} | model {args.model} "
                f"n_layer {ref['model'].config.n_layer} n_embd {ref['model'].config.n_embd} | batch {args.batch_size}x"
                f"{args.seq_len} per rank | buckets {args.bucket_mb:g} MB | {args.rounds}x{args.steps} timed steps each")
    gpt2.print0(f"{'variant':34s} {'step ms':>9s} {'/ torch':>8s} {'MB/step':>9s} {'max |w - torch w|':>18s}")
    for name, v in variants.items():
        t = statistics.median(v["times"])
        mb = v["meter"].take_mb() / n_steps if v["dp"] is not None else 2 * (ctx.world - 1) / ctx.world * grad_mb
        diff = max((a - b).abs().max().item() for a, b in zip(v["model"].parameters(), ref["model"].parameters()))
        gpt2.print0(f"{name:34s} {t * 1e3:9.1f} {t / t_ref:8.3f} {mb:9.2f} {diff:18.2e}")
    gpt2.print0("(torch DDP's MB/step is the ring minimum 2(N-1)/N x gradient bytes, which it sends)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
