"""Benchmark: per schedule, the measured bubble beside its simulation and closed form, and the peak memory
per rank with and without this file's memory hygiene; our 1F1B's step time vs PyTorch's Schedule1F1B on the
very same stages, in one run (CPU gloo here; --device cuda on GPUs).

    torchrun --nproc_per_node=2 tests/bench_pipeline.py
    torchrun --nproc_per_node=4 tests/bench_pipeline.py
    torchrun --nproc_per_node=4 tests/bench_pipeline.py --n-layer 8 --n-embd 256 --micro-batches 16 --steps 8
    python tests/bench_pipeline.py --per-rank-124m      # GPT-2 124M at 8 ranks, fake process group, meta device

A step here is forward + backward of one batch through the pipeline (no optimizer). "bubble" is the mean
over ranks of the idle share of the step, from the op timeline of the last step; "sim" runs the schedule's
op lists with the measured mean duration of each (op kind, stage) and free communication: the ideal for
these stages on this hardware; "sim F&B" (DualPipe, DualPipeV) the same with each F&B pair run as one unit,
as DeepSeek's executor does. The closed forms assume equal stages; on small models the last stage's
50304-wide head is far slower than a block, so they are met only where the model is large enough.
"peak MB" is, per rank, the most memory held above the step's start, sampled after every op (GPU: the
allocator's peak; CPU: resident memory, with glibc told to return every block over 64 KB at once):
"now" is pipeline.py, "before" the same run keeping what it used to keep (every sent stage output until
the end of the step, the logits on the I/W tape, fp32 messages).
"""
import copy
import ctypes
import gc
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


def memory_now(device):
    """Bytes in use by this process now: the CUDA allocator's count, or the resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Before(pl.Pipeline):
    """pipeline.py as it was before its memory hygiene: every stage output it sends stays referenced until
    the end of the step, the I/W tape keeps each matmul's output (the logits among them), messages are fp32."""

    def __init__(self, *a):
        super().__init__(*a)
        self.wire_dtype, self.kept = torch.float32, []

    def _send(self, key, tensor):
        self.kept.append(tensor)
        super()._send(key, tensor)

    def _record_inputs(self, module):
        super()._record_inputs(module)
        recorded = module.forward

        def keep_output(x):
            y = recorded(x)
            if self._tape is not None:
                self.kept.append(y)
            return y
        module.forward = keep_output

    def run(self, *a, **k):
        out = super().run(*a, **k)
        self.kept = []
        return out


def peak_memory(pipe, x, y, M, device):
    """Run one step, sampling memory after every op; returns the peak above the step's start in MB."""
    ops = {name: getattr(pipe, name) for name in ("_forward", "_backward", "_weight")}
    peak = [0]

    def sampled(fn):
        def run(*a):
            fn(*a)
            peak[0] = max(peak[0], memory_now(device))
        return run
    for name, fn in ops.items():
        setattr(pipe, name, sampled(fn))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    start = peak[0] = memory_now(device)
    pipe.run(x, y, 1.0 / M, timed=False)
    if device.type == "cuda":
        peak[0] = torch.cuda.max_memory_allocated(device)
    for name in ops:
        delattr(pipe, name)
    pipe.model.zero_grad(set_to_none=True)
    return (peak[0] - start) / 1e6


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


def legal_m(name, P, M):
    """The --micro-batches closest to M that the schedule accepts at P ranks."""
    if name == "interleaved":
        return max(P, M // P * P)
    if name in ("dualpipe", "dualpipev"):
        return max(2 * P, M + M % 2)
    return max(M, P) if name in ("1f1b", "zbh1") else M


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
    if ctx.device.type == "cpu":  # glibc: return freed blocks over 64 KB at once, so resident memory tracks use
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    rows, M0 = [], M
    for name in pl.SCHEDULE_NAMES:
        if name == "dualpipe" and P % 2:
            continue
        args.schedule, args.micro_batches = name, legal_m(name, P, M0)
        M = args.micro_batches
        if args.n_layer % pl.num_stages(name, P, args.virtual_stages):
            continue
        pl.check_args(args, world)
        mem = {}
        for kind, cls in (("before", Before), ("now", pl.Pipeline)):
            pipe = cls(args, ctx, P, gpt2.CommMeter())
            peak_memory(pipe, x, y, M, ctx.device)  # warm-up: first-touch allocations
            mem[kind] = peak_memory(pipe, x, y, M, ctx.device)

        def step():
            pipe.run(x, y, 1.0 / M, align=True)
            pipe.model.zero_grad(set_to_none=True)
        ms = time_steps(step, args.steps, ctx.device)
        st = pl.bubble_stats(name, P, M, gather_spans(pipe), args.virtual_stages)
        peaks = [None] * world
        dist.all_gather_object(peaks, (mem["before"], mem["now"]))
        rows.append((name, M, ms, st, peaks[:P]))
        if name == "1f1b":
            ours_1f1b, ours_pipe = ms, pipe
    M = args.micro_batches = legal_m("1f1b", P, M0)

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
        print(f"\npipeline bench: P={P} | {args.n_layer} layers x {args.n_embd} wide, batch {args.batch_size} x "
              f"{args.seq_len} | {ctx.device} {ctx.dtype} | median of {args.steps - 1} steps")
        print(f"{'schedule':11s} {'M':>3s} {'step ms':>8s} {'bubble':>7s} {'sim':>6s} {'sim F&B':>7s}  "
              f"{'peak MB per rank, before -> now':34s} closed form")
        for name, M, ms, st, peaks in rows:
            paired = f"{st['simulated_paired']:7.3f}" if "simulated_paired" in st else f"{'-':>7s}"
            mem = " ".join(f"{b:.1f}->{n:.1f}" for b, n in peaks)
            print(f"{name:11s} {M:3d} {ms:8.1f} {st['bubble']:7.3f} {st['simulated']:6.3f} {paired}  {mem:34s} "
                  f"{st['closed']}")
        print(f"1f1b step: ours {ours_1f1b:.1f} ms | torch Schedule1F1B {torch_ms:.1f} ms | ours/torch {ours_1f1b / torch_ms:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
