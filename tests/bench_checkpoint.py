"""Benchmark: checkpoint.py's sharded asynchronous checkpoint vs torch.distributed.checkpoint (DCP),
saving and loading the very same ZeRO-1 state (each rank's slice of the fp32 params, exp_avg, exp_avg_sq).

    torchrun --nproc_per_node=2 tests/bench_checkpoint.py                        # tiny model, CPU gloo
    torchrun --nproc_per_node=8 tests/bench_checkpoint.py --model gpt2 --device cuda --bench-dir /scratch/b

Columns: blocked = time the training loop waits for a save to return; durable = time until the
checkpoint is committed on every rank (fsync'd); load = read (+ verify) back into the live state;
MB = bytes on disk. Median over --repeats, the slowest rank each time.
"""
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import gpt2  # noqa: E402


class FixedLoader:  # the checkpoint stores a loader position; the benchmark has no data
    def state_dict(self):
        return {"shard": 0, "pos": 0}

    def load_state_dict(self, state):
        pass


def slowest(t, ctx):
    t = torch.tensor([t], dtype=torch.float64, device=ctx.device)
    if ctx.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def dir_mb(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 1e6


def main():
    p = gpt2.make_parser("Save/load time and size: checkpoint.py vs torch.distributed.checkpoint.")
    p.add_argument("--bench-dir", default="/tmp/bench_checkpoint", help="where the checkpoints are written")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per method (median reported)")
    args = p.parse_args()
    args.ckpt_dir, args.keep, args.out = os.path.join(args.bench_dir, "ours"), 1, os.path.join(args.bench_dir, "out")
    ctx = gpt2.setup(args)
    if ctx.world < 2:
        sys.exit("run it under torchrun with >= 2 processes: DCP's sharded save needs a process group")
    if ctx.master:
        shutil.rmtree(args.bench_dir, ignore_errors=True)
    dist.barrier()
    comm = gpt2.CommMeter()
    model = gpt2.build_model(args).to(ctx.device)
    zero = checkpoint.Zero1(model, args, ctx, comm)
    opt = gpt2.make_adamw(zero.optimizer_groups(), args, ctx.device)
    x = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), device=ctx.device)
    with ctx.autocast():
        model(x, x)[1].backward()
    zero.reduce_scatter_grads()
    opt.step()  # one step, so AdamW's moments exist
    zero.all_gather_params()
    loader = FixedLoader()
    rows = {}

    # ours: snapshot to CPU, write + fsync + crc32 in a thread, rank 0 commits the manifest
    ck = checkpoint.AsyncCheckpointer(args, ctx, zero, comm)
    blocked, durable, load = [], [], []
    for r in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        ck.save(r + 1, opt, loader)
        t1 = time.perf_counter()
        ck.wait()
        t2 = time.perf_counter()
        blocked.append(slowest(t1 - t0, ctx))
        durable.append(slowest(t2 - t0, ctx))
        dist.barrier()
        t0 = time.perf_counter()
        assert checkpoint.load_latest(args, zero, opt, loader, ctx) == r + 1
        load.append(slowest(time.perf_counter() - t0, ctx))
    rows["checkpoint.py (async, crc32)"] = (blocked, durable, load, dir_mb(checkpoint.step_dir(args.ckpt_dir, args.repeats)))

    # DCP: the same slices as DTensors sharded on a 1-D mesh (padded equally, as ZeRO-1 pads them)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    lo, n = ctx.rank * zero.shard, zero.shard

    def state():
        m, v = torch.zeros(n, device=ctx.device), torch.zeros(n, device=ctx.device)
        for p_, (a, b, _) in zip(zero.params, zero.pieces):
            m[a - lo: b - lo], v[a - lo: b - lo] = opt.state[p_]["exp_avg"], opt.state[p_]["exp_avg_sq"]
        shard = lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(n * ctx.world,), stride=(1,))
        # a copy of the params: DCP's async staging rejects a view into a larger storage (torch 2.13)
        return {"params": shard(zero.flat[lo: lo + n].clone()), "exp_avg": shard(m), "exp_avg_sq": shard(v)}

    for name, save in (("torch DCP save", dcp.save), ("torch DCP async_save", dcp.async_save)):
        blocked, durable, load = [], [], []
        for r in range(args.repeats):
            path = os.path.join(args.bench_dir, f"dcp_{save.__name__}_{r}")
            st = state()
            dist.barrier()
            t0 = time.perf_counter()
            fut = save(st, checkpoint_id=path)
            t1 = time.perf_counter()
            if save is dcp.async_save:
                fut.result()
            t2 = time.perf_counter()
            blocked.append(slowest(t1 - t0, ctx))
            durable.append(slowest(t2 - t0, ctx))
            dist.barrier()
            st = state()
            t0 = time.perf_counter()
            dcp.load(st, checkpoint_id=path)
            load.append(slowest(time.perf_counter() - t0, ctx))
            assert torch.equal(st["params"].to_local(), zero.flat[lo: lo + n])
        rows[name] = (blocked, durable, load, dir_mb(path))

    gpt2.print0(f"\n{args.model} model ({zero.numel / 1e6:.2f}M params), {ctx.world} ranks, {ctx.device.type}: "
                f"state = 3 x fp32 x params = {3 * 4 * zero.numel / 1e6:.1f} MB; median of {args.repeats}")
    gpt2.print0(f"| {'method':32s} | blocked ms | durable ms | load ms |     MB |")
    gpt2.print0(f"|{'-' * 34}|-----------:|-----------:|--------:|-------:|")
    for name, (b, d, l, mb) in rows.items():
        med = statistics.median
        gpt2.print0(f"| {name:32s} | {1e3 * med(b):10.1f} | {1e3 * med(d):10.1f} | {1e3 * med(l):7.1f} | {mb:6.1f} |")
    dist.barrier()
    if ctx.master:
        shutil.rmtree(args.bench_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
