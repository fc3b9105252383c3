"""Benchmark: per schedule, the measured bubble beside its simulation and closed form, and the peak memory
per rank with and without this file's memory hygiene; our 1F1B's step time vs PyTorch's Schedule1F1B on the
very same stages, in one run (CPU gloo here; --device cuda on GPUs).

    torchrun --nproc_per_node=2 tests/bench_pipeline.py
    torchrun --nproc_per_node=4 tests/bench_pipeline.py
    torchrun --nproc_per_node=4 tests/bench_pipeline.py --n-layer 8 --n-embd 256 --micro-batches 16 --steps 8
    torchrun --nproc_per_node=4 tests/bench_pipeline.py --quick   # peak memory per rank only (about a minute)
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
the end of the step, the logits on the I/W tape, fp32 messages). "W state MB" is, per rank, the most bytes
the I/W tape held for deferred weight gradients (each matmul's input and output gradient, storages counted
once): ZB-H1's last stage holds lm_head's logits-sized output gradient (B/M x T x 50304) for up to P
micro-batches, the other ranks only C-wide tensors. --quick: peak memory per rank only (no "before", no torch).
"""
import collections
import copy
import ctypes
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:  # under pytest --impl DIR, DIR stays first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2  # noqa: E402
import pipeline as pl  # noqa: E402
from test_pipeline import TorchStage  # noqa: E402


def gather_spans(pipe, x, y):
    """One step timed op by op (pipeline.py's own measurement) -> every pipeline rank's [(op, start, end)]."""
    measured = pl.timed_spans(pipe, x, y)
    return [[(pl.Op(*op), a, b) for op, a, b in g["spans"]] for g in measured[: pipe.P]]


def memory_now(device):
    """Bytes in use by this process now: the CUDA allocator's count, or the resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def before(cls):
    """cls as pipeline.py was before its memory hygiene: every stage output it sends stays referenced until
    the end of the step, the I/W tape keeps each matmul's output (the logits among them), messages are fp32.
    exchange: the core's loops; send: the planned executor's."""
    class Before(cls):
        def __init__(self, *a):
            self.kept = []
            super().__init__(*a)
            self.wire_dtype = torch.float32

        def exchange(self, send_to=None, tensor=None, recv_from=None):
            if send_to is not None:
                self.kept.append(tensor)
            return super().exchange(send_to, tensor, recv_from)

        def send(self, message, batch):
            if message is not None:
                self.kept.append(message[1])
            super().send(message, batch)

        if issubclass(cls, pl.SplitBackward):
            def record(self, module, inputs, output):
                super().record(module, inputs, output)
                if self.tape is not None:
                    self.kept.append(output)

        def step(self, *a, **k):
            out = super().step(*a, **k)
            self.kept = []
            return out
    return Before


def w_state_bytes(pipe):
    """Bytes the I/W tape holds now for deferred weight gradients: (input, output gradient) pairs, storages once."""
    storages = {}
    for pairs in getattr(pipe, "deferred", {}).values():
        for _, x, dy in pairs:
            for t in (x, dy):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def peak_memory(pipe, x, y, M, device):
    """Run one step, sampling memory after every op; returns (peak above the step's start, peak W state) in MB."""
    ops = {name: getattr(pipe, name) for name in ("forward", "backward")}
    peak, w_peak = [0], [0]

    def sampled(fn):
        def run(*a):
            out = fn(*a)
            peak[0] = max(peak[0], memory_now(device))
            w_peak[0] = max(w_peak[0], w_state_bytes(pipe))
            return out
        return run
    for name, fn in ops.items():
        setattr(pipe, name, sampled(fn))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    start = peak[0] = memory_now(device)
    pipe.step(x, y, 1.0 / M)
    if device.type == "cuda":
        peak[0] = torch.cuda.max_memory_allocated(device)
    for name in ops:
        delattr(pipe, name)
    pipe.model.zero_grad(set_to_none=True)
    return (peak[0] - start) / 1e6, w_peak[0] / 1e6


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
    p = pl.make_cli_parser()
    p.set_defaults(n_layer=8, n_embd=64, seq_len=32, batch_size=16, micro_batches=8, steps=5, out="out/bench_pipeline")
    p.add_argument("--quick", action="store_true", help="peak memory per rank only: no 'before', no timing, no torch")
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
        pl.check_cli_args(args, world)
        mem = {"before": (float("nan"), float("nan"))}
        for kind, cls in (("before", before(pl.pipeline_class(name))), ("now", pl.pipeline_class(name)))[args.quick:]:
            pipe = cls(args, ctx, P)
            peak_memory(pipe, x, y, M, ctx.device)  # warm-up: first-touch allocations
            mem[kind] = peak_memory(pipe, x, y, M, ctx.device)
        peaks = [None] * world
        dist.all_gather_object(peaks, (mem["before"][0], *mem["now"]))
        if args.quick:
            rows.append((name, M, None, None, peaks[:P]))
            continue

        def step():
            pipe.step(x, y, 1.0 / M)
            pipe.model.zero_grad(set_to_none=True)
        ms = time_steps(step, args.steps, ctx.device)
        st = pl.bubble_stats(name, P, M, gather_spans(pipe, x, y), args.virtual_stages)
        rows.append((name, M, ms, st, peaks[:P]))
        if name == "1f1b":
            ours_1f1b, ours_pipe = ms, pipe
    if args.quick:
        if ctx.master:
            print(f"\npipeline memory: P={P} | {args.n_layer} layers x {args.n_embd} wide, batch {args.batch_size} x "
                  f"{args.seq_len} | {ctx.device} {ctx.dtype} | MB per rank (rank 0 .. {P - 1})")
            print(f"{'schedule':11s} {'M':>3s}  {'peak MB above step start':32s} W state MB (I/W tape)")
            for name, M, _, _, peaks in rows:
                print(f"{name:11s} {M:3d}  {' '.join(f'{n:.1f}' for _, n, _ in peaks):32s} "
                      f"{' '.join(f'{w:.2f}' for _, _, w in peaks)}")
        dist.destroy_process_group()
        return
    M = args.micro_batches = legal_m("1f1b", P, M0)

    # PyTorch's Schedule1F1B on the same stages (same layers, same micro-batches, same loss scaling)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    pipe = ours_pipe
    s = pipe.stage
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
              f"{'peak MB per rank, before -> now':34s} {'W state MB':16s} closed form")
        for name, M, ms, st, peaks in rows:
            paired = f"{st['simulated_paired']:7.3f}" if "simulated_paired" in st else f"{'-':>7s}"
            mem = " ".join(f"{b:.1f}->{n:.1f}" for b, n, _ in peaks)
            w = " ".join(f"{w:.2f}" for _, _, w in peaks)
            print(f"{name:11s} {M:3d} {ms:8.1f} {st['bubble']:7.3f} {st['simulated']:6.3f} {paired}  {mem:34s} {w:16s} "
                  f"{st['closed']}")
        print(f"1f1b step: ours {ours_1f1b:.1f} ms | torch Schedule1F1B {torch_ms:.1f} ms | "
              f"ours/torch {ours_1f1b / torch_ms:.2f}")
    dist.destroy_process_group()


def per_rank_124m(world=8, batch_size=16, seq_len=1024) -> list[dict]:
    """GPT-2 124M at `world` ranks, pipeline rank 0 (the one holding the embedding), one dict per schedule.
    Torch's fake process group (collectives are no-ops, so received tensors are garbage: only sizes matter).
    Parameters, gradients and AdamW state are measured from the tensors this rank allocates; bytes sent are
    counted by the file's CommMeter over one step at M micro-batches of ONE row of seq_len tokens each (the
    point-to-point part scaled linearly to batch_size rows, the all-reduces measured as they are);
    activations are the bytes saved for backward (torch.autograd.graph.saved_tensors_hooks, parameters
    and autocast's bf16 copies of them excluded, bf16 autocast) at the peak of micro-batches held, scaled
    the same way (rows are independent, so both are exactly linear in them)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    layouts = [("gpipe", 4, 4, 2), ("1f1b", 4, 4, 2), ("zbh1", 4, 4, 2), ("interleaved", 4, 4, 3),
               ("dualpipe", 4, 8, 2), ("dualpipev", 2, 4, 2)]  # (schedule, P, M, V): 12 layers split evenly
    rows, T = [], seq_len
    for name, P, M, V in layouts:
        D = world // P
        args = pl.make_cli_parser().parse_args([
            "--model", "gpt2", "--schedule", name, "--micro-batches", str(M), "--virtual-stages", str(V),
            "--batch-size", str(M), "--seq-len", str(T), "--dp", str(D), "--device", "cpu",
            "--dtype", "bfloat16", "--out", os.path.join("out", "per_rank_124m")])
        ctx = gpt2.Context(0, world, 0, torch.device("cpu"), torch.bfloat16, True)
        pipe = pl.pipeline_class(name, D)(args, ctx, P)
        comm = pipe.comm
        params = list(pipe.model.parameters())
        param_ptrs = {p.data_ptr() for p in params}
        param_shapes = {tuple(p.shape) for p in params}  # and their bf16 copies that autocast saves
        saved, per_mb = {}, collections.Counter()

        def pack(t):
            if t.data_ptr() not in param_ptrs and tuple(t.shape) not in param_shapes and (key := pipe.current) is not None:
                saved.setdefault(key, {})[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        pipe.current = None
        forward = pipe.forward

        def counted(s, mb, h):
            pipe.current = (s, mb)
            out = forward(s, mb, h)
            pipe.current = None
            return out
        pipe.forward = counted
        x = torch.randint(0, 50257, (M, T))
        scale = batch_size / M * seq_len / T
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pipe.step(x, x, 1.0 / M)
        p2p = comm.take_mb() * scale
        pipe.sync_grads()  # allocates the gradients and counts the tied-embedding and replica all-reduces
        opt = gpt2.make_adamw(gpt2.optimizer_groups(pipe.model, 0.1), args, ctx.device)
        opt.step()  # AdamW allocates its state on the first step
        ar = comm.take_mb()
        for (stage, mb), storages in saved.items():
            per_mb[stage] = max(per_mb[stage], sum(storages.values()))
        mb_bytes = sum(per_mb.values())  # one micro-batch through all of this rank's stages
        held = pipe.peak_held / len(getattr(pipe, "my_stages", (0,)))
        n = sum(p.numel() for p in params)
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
        # messages rank 0 sends per step, in batches of (batch_size, seq_len, 768) bf16: 1f1b & co. one activation
        # batch; interleaved V activations and V-1 gradients; dualpipe half a batch each way; dualpipev two
        sends = {"interleaved": 2 * V - 1, "dualpipe": 1, "dualpipev": 2}.get(name, 1)
        copies = D * (2 if name == "dualpipe" else 1)  # ranks holding the same parameters
        rows.append({
            "setup": f"pipeline.py --schedule {name} (P={P} x D={D}" + (f", V={V})" if name == "interleaved" else ")"),
            "comm_MB": p2p + ar,
            "comm_MB_closed": sends * batch_size * seq_len * 768 * 2 / 1e6 + 2 * (copies - 1) / copies * n * 4 / 1e6
            + (50304 * 768 * 4 / 1e6 if name not in ("dualpipe", "dualpipev") else 0),
            "params_MB": n * 4 / 1e6, "grads_MB": sum(p.grad.numel() * 4 for p in params) / 1e6,
            "optim_MB": state / 1e6,
            "act_MB": mb_bytes * held * scale / 1e6,
            "mem_MB_closed": 16 * n / 1e6,
            "how": f"fake PG rank 0 of {world}, CPU, M={M} micro-batches of 1 x {T} tokens, scaled x{scale:g}"})
    dist.destroy_process_group()
    return rows


if __name__ == "__main__" and "--per-rank-124m" in sys.argv:
    keys = ["comm_MB", "comm_MB_closed", "params_MB", "grads_MB", "optim_MB", "act_MB", "mem_MB_closed"]
    print(f"{'setup':44s} " + " ".join(f"{k:>14s}" for k in keys) + "  how")
    for row in per_rank_124m():
        print(f"{row['setup']:44s} " + " ".join(f"{row[k]:14.1f}" for k in keys) + f"  {row['how']}")
    sys.exit(0)

if __name__ == "__main__":
    main()
