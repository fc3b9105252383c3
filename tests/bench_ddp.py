"""Benchmark ddp.DataParallel against torch.nn.parallel.DistributedDataParallel, same model, same batches.

    torchrun --nproc_per_node=2 tests/bench_ddp.py --data data/shakespeare_char   # CPU, gloo, the course model
    torchrun --nproc_per_node=2 tests/bench_ddp.py --data data/shakespeare_char --zero    # + ZeRO-1, ZeRO-2
    torchrun --nproc_per_node=8 tests/bench_ddp.py --model gpt2 --batch-size 16 --seq-len 1024 --bucket-mb 25
    python tests/bench_ddp.py --per-rank-124m     # GPT-2 124M at 8 ranks: bytes and memory per rank (no GPU)

A step is forward, backward, gradient sync, clip, AdamW. The variants run in interleaved rounds (so
background load hits them alike); the table gives each one's median step time and its ratio to torch's
DDP, the wait after backward (exposed communication), the bytes each rank sent per step and the largest
weight difference to torch's DDP at the end. Overlap is told apart from bucketing by the same buckets
launched after backward (no_sync holds them) and by --naive (every gradient on its own, after backward).
"""
import contextlib
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:  # under pytest --impl DIR, DIR stays first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddp  # noqa: E402
import gpt2  # noqa: E402


def activation_mb(cfg, batch_size, seq_len, probe_tokens=128):
    """Bytes saved for backward, bf16 autocast, counted with saved_tensors_hooks (each storage once,
    parameters excluded) in real CPU forwards of 1 x probe_tokens and 1 x probe_tokens/2 tokens. The
    difference is the per-token part (CPU SDPA is a flash kernel: out + logsumexp, no T x T), scaled to
    batch_size x seq_len; what does not scale is autocast's bf16 copy of the weights (2P), returned apart."""
    model = gpt2.GPT(cfg)

    def saved(tokens):
        idx = torch.randint(0, cfg.vocab_size, (1, tokens))
        with gpt2.SavedBytes(exclude=model.parameters()) as counted, torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx, idx)
        return counted.bytes

    full, half = saved(probe_tokens), saved(probe_tokens // 2)
    per_token = (full - half) / (probe_tokens - probe_tokens // 2)
    return per_token * batch_size * seq_len / 1e6, (full - per_token * probe_tokens) / 1e6


def per_rank_124m(world=8, batch_size=16, seq_len=1024) -> list[dict]:
    """GPT-2 124M, fp32 master weights + AdamW, at `world` ranks: one real optimizer step of our classes
    on rank 0 of torch's fake process group (collectives are no-ops; CommMeter counts the bytes of the
    calls really issued), with a 1 x 32-token batch (the bytes and buffers do not depend on the batch)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    assert dist.get_world_size() == world, "an existing process group has another world size"
    torch.manual_seed(0)
    cfg = gpt2.MODELS["gpt2"]
    act, weight_copies = activation_mb(cfg, batch_size, seq_len)
    args = gpt2.make_parser("").parse_args(["--model", "gpt2", "--device", "cpu"])
    rows = []
    for zero in (0, 1, 2):
        model = gpt2.GPT(cfg)
        meter = gpt2.CommMeter()
        dp = (ddp.DataParallel, ddp.ZeRO1DataParallel, ddp.ZeRO2DataParallel)[zero](model, 25.0, meter)
        P = sum(p.numel() for p in dp.params)
        groups = gpt2.optimizer_groups(model, args.weight_decay)
        adamw = lambda g: gpt2.make_adamw(g, args, torch.device("cpu"))  # noqa: E731
        opt = dp.make_optimizer(groups, adamw) if zero else adamw(groups)
        meter.take_mb()  # the start-up broadcast is not a step
        idx = torch.randint(0, cfg.vocab_size, (1, 32))
        dp(idx, idx)[1].backward()
        dp.finish_grad_sync()
        dp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        measured, closed = ddp.memory_per_rank(dp, opt)
        ring = 2 * (world - 1) / world * 4 * P / 1e6  # all-reduce = reduce-scatter + all-gather: 2(N-1)/N x 4P
        rows.append({"setup": "ddp.py" + (f" --zero {zero}" if zero else ""), "comm_MB": meter.take_mb(),
                     "comm_MB_closed": ring, "params_MB": measured["params"], "grads_MB": measured["grads"],
                     "optim_MB": measured["optim"], "act_MB": act, "mem_MB_closed": sum(closed.values()),
                     "how": f"fake PG rank 0 of {world}, one real CPU step (grads: peak of the buffers); "
                            f"act: bf16 CPU forwards of 128 and 64 tokens, per-token part x{batch_size * seq_len} "
                            f"(+ {weight_copies:.0f} MB bf16 weight copies, not per token)"})
        dp.close()
        del model, dp, opt
        gc.collect()
    if own_group:  # the caller may run other files' fake groups next
        dist.destroy_process_group()
    return rows


def print_per_rank_124m():
    rows = per_rank_124m()
    print(f"{'setup':18s} {'comm MB':>9s} {'closed':>9s} {'params':>8s} {'grads':>8s} {'AdamW':>8s} {'p+g+o':>8s} "
          f"{'closed':>8s} {'act bf16':>9s}")
    for r in rows:
        total = r["params_MB"] + r["grads_MB"] + r["optim_MB"]
        print(f"{r['setup']:18s} {r['comm_MB']:9.1f} {r['comm_MB_closed']:9.1f} {r['params_MB']:8.1f} "
              f"{r['grads_MB']:8.1f} {r['optim_MB']:8.1f} {total:8.1f} {r['mem_MB_closed']:8.1f} {r['act_MB']:9.1f}")
    print(f"(MB per rank per optimizer step; {rows[0]['how']})")


VARIANTS = ("torch DDP", "ours", "ours: buckets, no overlap", "ours --naive")
ZERO_VARIANTS = ("ours + ZeRO-1", "ours + ZeRO-2", "ours + ZeRO-2, 1 bucket in flight")


def build(name, args, ctx):
    """The variant's model (rank 0's weights everywhere), the module to call, its optimizer, our wrapper."""
    model = gpt2.build_model(args).to(ctx.device)
    meter = gpt2.CommMeter()
    adamw = lambda g: gpt2.make_adamw(g, args, ctx.device)  # noqa: E731
    groups = gpt2.optimizer_groups(model, args.weight_decay)
    if name == "torch DDP":
        return dict(model=model, fwd=nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb),
                    opt=adamw(groups), dp=None, meter=meter)
    if name == "ours --naive":
        dp = ddp.NaiveDataParallel(model, meter)
    else:
        wrapper = ddp.ZeRO2DataParallel if "ZeRO-2" in name else ddp.ZeRO1DataParallel if "ZeRO-1" in name \
            else ddp.DataParallel
        dp = wrapper(model, args.bucket_mb, meter=meter)
        if "1 bucket in flight" in name:
            dp.in_flight = 1  # backward waits for the previous bucket's reduce-scatter
    opt = dp.make_optimizer(groups, adamw) if hasattr(dp, "make_optimizer") else adamw(groups)
    return dict(model=model, fwd=dp, opt=opt, dp=dp, meter=meter, hold="no overlap" in name)


def main():
    if "--per-rank-124m" in sys.argv:
        return print_per_rank_124m()
    p = gpt2.make_parser("ours vs torch DDP step time")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size of both DDPs (the course model: "
                                                                "~3.4 MB of gradients, so 1 MB gives 4 buckets)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    p.add_argument("--zero", action="store_true", help="also ZeRO-1 and ZeRO-2 (2 and 1 buckets in flight)")
    p.set_defaults(steps=4, batch_size=4, seq_len=64)  # --steps: timed steps per variant per round
    args = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", 1)) < 2:
        sys.exit("launch with torchrun --nproc_per_node=2 (or more): see the docstring")
    ctx = gpt2.setup(args)
    variants = {name: build(name, args, ctx) for name in VARIANTS + (ZERO_VARIANTS if args.zero else ())}
    vocab = variants["ours"]["model"].config.vocab_size
    g = torch.Generator().manual_seed(1234 + ctx.rank)
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g) for _ in range(args.steps)]
    for v in variants.values():
        v["meter"].take_mb()  # the start-up broadcast is not a step
        v["times"], v["exposed"] = [], []

    def step(v, batch):
        x, y = batch[:, :-1].to(ctx.device), batch[:, 1:].to(ctx.device)
        with ctx.autocast():
            loss = v["fwd"](x, y)[1]
        with v["dp"].no_sync() if v.get("hold") else contextlib.nullcontext():  # no_sync: launch after backward
            loss.backward()
        if v["dp"] is None:  # torch's DDP waits inside backward (its last hook)
            torch.nn.utils.clip_grad_norm_(v["model"].parameters(), args.grad_clip)
        else:
            t0 = ddp.clock(ctx.device)
            v["dp"].finish_grad_sync()
            v["exposed"].append((t0, ddp.clock(ctx.device)))
            v["dp"].clip_grad_norm_(args.grad_clip)
        v["opt"].step()
        v["opt"].zero_grad(set_to_none=True)

    for v in variants.values():  # warm up (allocations, thread pools)
        step(v, batches[0])
        v["exposed"].clear()
        if isinstance(v["dp"], ddp.ZeRO2DataParallel):
            v["dp"].blocked.clear()
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
    n_steps, timed = 1 + args.rounds * args.steps, args.rounds * args.steps
    ref = variants["torch DDP"]
    t_ref = statistics.median(ref["times"])
    cfg = ref["model"].config
    grad_mb = sum(q.numel() * q.element_size() for q in ref["model"].parameters()) / 1e6
    gpt2.print0(f"\n{ctx.world} ranks, {ctx.device} {ctx.dtype}, {dist.get_backend()} | model {args.model} n_layer "
                f"{cfg.n_layer} n_embd {cfg.n_embd} vocab {cfg.vocab_size} ({grad_mb:.2f} MB of gradients) | batch "
                f"{args.batch_size}x{args.seq_len} per rank | buckets {args.bucket_mb:g} MB | {args.rounds}x"
                f"{args.steps} timed steps each, interleaved")
    gpt2.print0(f"{'variant':36s} {'step ms':>9s} {'/ torch':>8s} {'exposed ms':>11s} {'MB/step':>9s} "
                f"{'max |w - torch w|':>18s} {'blocked ms':>11s}")
    med = {}
    for name, v in variants.items():
        med[name] = t = statistics.median(v["times"])
        mb = v["meter"].take_mb() / n_steps if v["dp"] is not None else 2 * (ctx.world - 1) / ctx.world * grad_mb
        diff = max((a - b).abs().max().item() for a, b in zip(v["model"].parameters(), ref["model"].parameters()))
        exposed = f"{statistics.median(ddp.elapsed_s(a, b) for a, b in v['exposed']) * 1e3:11.1f}" \
            if v["exposed"] else f"{'':11s}"
        blocked = f"{v['dp'].blocked_s() / timed * 1e3:11.1f}" if hasattr(v["dp"], "blocked_s") else f"{'':11s}"
        gpt2.print0(f"{name:36s} {t * 1e3:9.1f} {t / t_ref:8.3f} {exposed} {mb:9.2f} {diff:18.2e} {blocked}")
    per_round = lambda name: [statistics.median(variants[name]["times"][r * args.steps:(r + 1) * args.steps])
                              for r in range(args.rounds)]  # noqa: E731
    rounds = " ".join(f"{a / b:.2f}" for a, b in zip(per_round("ours"), per_round("torch DDP")))
    gpt2.print0(f"ours / torch DDP: {med['ours'] / t_ref:.3f}x the step time (round by round: {rounds})")
    exposed = {n: statistics.median(ddp.elapsed_s(a, b) for a, b in variants[n]["exposed"]) * 1e3
               for n in ("ours", "ours: buckets, no overlap", "ours --naive")}
    gpt2.print0(f"overlap gain: exposed after backward, naive {exposed['ours --naive']:.1f} ms | buckets, no "
                f"overlap {exposed['ours: buckets, no overlap']:.1f} ms | overlapped {exposed['ours']:.1f} ms; "
                f"step time without overlap / with {med['ours: buckets, no overlap'] / med['ours']:.2f}x, naive "
                f"/ overlapped {med['ours --naive'] / med['ours']:.2f}x")
    if args.zero:
        gpt2.print0(f"ZeRO-2, 1 bucket in flight / 2: {med['ours + ZeRO-2, 1 bucket in flight'] / med['ours + ZeRO-2']:.2f}x")
    gpt2.print0("(step ms: median; exposed ms: median wait in finish_grad_sync after backward (host clock on CPU, "
                "CUDA events on GPU); torch DDP waits inside backward, so it has none; its MB/step is the ring "
                "minimum 2(N-1)/N x gradient bytes, which it sends; blocked ms: per step backward waited on an "
                "earlier bucket's reduce-scatter, ZeRO-2 only)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
