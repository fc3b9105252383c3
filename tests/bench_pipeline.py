"""Benchmark: measured bubble of every schedule vs its closed form, and our 1F1B's step time vs PyTorch's
Schedule1F1B on the very same stages, in one run (CPU gloo here; --device cuda on GPUs).

    torchrun --nproc_per_node=2 tests/bench_pipeline.py
    torchrun --nproc_per_node=4 tests/bench_pipeline.py
    torchrun --nproc_per_node=4 tests/bench_pipeline.py --n-layer 8 --n-embd 256 --micro-batches 16 --steps 8

A step here is forward + backward of one batch through the pipeline (no optimizer). "bubble" is the mean
over ranks of the idle share of the step, from the op timeline of the last step; "sim" runs the schedule's
op lists with the measured mean duration of each (op kind, stage) and free communication: the ideal for
these stages on this hardware. The closed forms assume equal stages; on small models the last stage's
50304-wide head is far slower than a block, so they are met only where the model is large enough.
"""
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2  # noqa: E402
import pipeline as pl  # noqa: E402
from test_pipeline import TorchStage  # noqa: E402


def gather_spans(pipe):
    mine = [(op, a, b) for op, a, b in pipe.timeline.spans()]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out[: pipe.P]


def time_steps(fn, steps, device):
    times = []
    for _ in range(steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3  # the first is a warm-up


def main():
    p = pl.make_parser()
    p.set_defaults(n_layer=8, n_embd=64, seq_len=32, batch_size=16, micro_batches=8, steps=5, out="out/bench_pipeline")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    ctx = gpt2.setup(args)
    P, M = world, args.micro_batches
    torch.manual_seed(0)
    x = torch.randint(0, 50257, (args.batch_size, args.seq_len))
    y = torch.randint(0, 50257, (args.batch_size, args.seq_len))
    rows = []
    for name in pl.SCHEDULE_NAMES:
        args.schedule = name
        pl.check_args(args, world)
        pipe = pl.Pipeline(args, ctx, P, gpt2.CommMeter())

        def step():
            pipe.run(pipe.orders, x, y, 1.0 / M, align=True)
            pipe.model.zero_grad(set_to_none=True)
        ms = time_steps(step, args.steps, ctx.device)
        st = pl.bubble_stats(name, P, M, gather_spans(pipe))
        rows.append((name, ms, st["bubble"], st["idle_ms"], st["simulated"], st["closed"]))
        if name == "1f1b":
            ours_1f1b = ms
            ours_pipe = pipe

    # PyTorch's Schedule1F1B on the same stages (same layers, same micro-batches, same loss scaling)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    pipe = ours_pipe
    s = pipe.pp_rank
    mod = TorchStage(pl.keep_only(copy.deepcopy(gpt2.build_model(args)), set(range(*pipe.layers[s])), s == 0, s == P - 1),
                     *pipe.layers[s], s == 0, s == P - 1).to(ctx.device)
    stage = PipelineStage(mod, s, P, ctx.device)
    sched = Schedule1F1B(stage, M, loss_fn=lambda out, tgt: gpt2.cross_entropy(out, tgt) / M, scale_grads=False)
    xd, yd = x.to(ctx.device), y.to(ctx.device)

    def torch_step():
        with ctx.autocast():
            sched.step(*((xd,) if s == 0 else ()), **({"target": yd, "losses": []} if s == P - 1 else {}))
        mod.zero_grad(set_to_none=True)
    torch_ms = time_steps(torch_step, args.steps, ctx.device)

    if ctx.master:
        print(f"\npipeline bench: P={P} M={M} | {args.n_layer} layers x {args.n_embd} wide, batch {args.batch_size} x "
              f"{args.seq_len} | {ctx.device} {ctx.dtype} | median of {args.steps - 1} steps")
        print(f"{'schedule':10s} {'step ms':>8s} {'bubble':>7s} {'idle ms':>8s} {'sim':>6s}  closed form")
        for name, ms, bub, idle, sim, closed in rows:
            print(f"{name:10s} {ms:8.1f} {bub:7.3f} {idle:8.1f} {sim:6.3f}  {closed}")
        print(f"1f1b step: ours {ours_1f1b:.1f} ms | torch Schedule1F1B {torch_ms:.1f} ms | ours/torch {ours_1f1b / torch_ms:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
