"""Benchmark: checkpoint.py's sharded asynchronous checkpoint vs torch.distributed.checkpoint (DCP),
saving and loading the very same ZeRO-1 state (each rank's slice of the fp32 params, exp_avg, exp_avg_sq).

    torchrun --nproc_per_node=2 tests/bench_checkpoint.py                        # tiny model, CPU gloo
    torchrun --nproc_per_node=8 tests/bench_checkpoint.py --model gpt2 --device cuda --bench-dir /scratch/b

Columns: blocked = time the training loop waits for a save to return; durable = time until the
checkpoint is committed on every rank (fsync'd); load = read (+ verify) back into the live state;
MB = bytes on disk. Median over --repeats, the slowest rank each time.

    python tests/bench_checkpoint.py --per-rank-124m    # GPT-2 124M at 8 ranks, one process, fake process group
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:  # under pytest --impl DIR, DIR stays first
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


def saved_activation_mb(model, batch_size, seq_len, probe_t=128):
    """Bytes autograd saves for backward under CPU bf16 autocast, counted once per storage by
    saved_tensors_hooks, measured at B=1 and B=2 with T=probe_t: the difference is one sequence's share,
    scaled linearly to batch_size x seq_len (the CPU SDPA path saves O(T) per token: 68.9 MB at T=128 and
    137.8 MB at T=256 per sequence for GPT-2 124M). The rest is the bf16 copies of the weights autocast
    makes once per forward. Returns (activations MB at batch_size x seq_len, weight copies MB)."""
    def saved_mb(b):
        x = torch.randint(0, 50257, (b, probe_t))
        with torch.autocast("cpu", dtype=torch.bfloat16), gpt2.SavedBytes(exclude=model.parameters()) as counted:
            model(x, x)  # persistent parameters are not activations: excluded
        return counted.bytes / 1e6

    one, two = saved_mb(1), saved_mb(2)
    return (two - one) * batch_size * seq_len / probe_t, one - (two - one)


def per_rank_124m(world=8, batch_size=16, seq_len=1024):
    """checkpoint.py at GPT-2 124M, rank 0 of `world` under torch's fake process group (collectives are
    no-ops, the CommMeter counts what they would send): the real Zero1 buffers and AdamW state, one
    optimizer step's collectives, and one real save of rank 0's shard (snapshot + write + fsync) and the
    manifest into a temporary directory."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    args = gpt2.make_parser("").parse_args(["--model", "gpt2", "--batch-size", str(batch_size), "--seq-len", str(seq_len),
                                            "--device", "cpu", "--steps", "1"])
    ctx = gpt2.Context(0, world, 0, torch.device("cpu"), torch.bfloat16, True)
    comm = gpt2.CommMeter()
    model = gpt2.build_model(args)
    zero = checkpoint.Zero1(model, args, ctx, comm)
    opt = gpt2.make_adamw(zero.optimizer_groups, args, ctx.device)
    opt.step()  # allocates AdamW's moments for this rank's slice
    comm.take_mb()
    # one optimizer step's collectives, the calls main() makes
    zero.reduce_scatter_grads()
    zero.clip_grads(zero.grad_norm(), args.grad_clip)
    zero.all_gather_params()
    comm.all_reduce(8, world)  # train(): the loss, and SafeCheckpointer's failed-save flag (4 B each)
    comm_mb = comm.take_mb()
    P, n = zero.numel, zero.shard
    state_mb = sum(t.nbytes for s in opt.state.values() for t in s.values()) / 1e6
    act_mb, casts_mb = saved_activation_mb(model, batch_size, seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        args.ckpt_dir, args.keep = tmp, 1
        with mock.patch.object(dist, "new_group", lambda *a, **k: None):  # the writer's gloo group: not under fake
            ck = checkpoint.SafeCheckpointer(args, ctx, zero, gpt2.Timeline(ctx))
        tensors, meta = ck.snapshot(1, opt, FixedLoader())
        snapshot_mb = sum(t.nbytes for t in ck.buffers.values()) / 1e6
        d = checkpoint.step_dir(tmp, 1)
        report = ck.write(d, tensors, meta)
        ck.commit(1, d, report.repeat(world, 1), {"shard": 0, "pos": 0})
        manifest_kb = os.path.getsize(os.path.join(d, "manifest.json")) / 1e3
        shard_mb = os.path.getsize(os.path.join(d, f"rank00000-of-{world:05d}.pt")) / 1e6
    if own:
        dist.destroy_process_group()
    return [{"setup": "checkpoint.py (ZeRO-1, async sharded saves)",
             "comm_MB": comm_mb, "comm_MB_closed": (2 * (world - 1) / world * 4 * n * world + 2 * (world - 1) / world * 12) / 1e6,
             "params_MB": zero.flat.nbytes / 1e6, "grads_MB": (zero.grad.nbytes + zero.grad_shard.nbytes) / 1e6,
             "optim_MB": state_mb, "act_MB": act_mb, "mem_MB_closed": (4 * P + 4 * P + 4 * n + 8 * n) / 1e6,
             "ckpt_MB": shard_mb, "ckpt_MB_closed": 12 * n / 1e6, "manifest_KB": manifest_kb,
             "snapshot_MB": snapshot_mb, "snapshot_MB_closed": 12 * n / 1e6, "bf16_weight_copies_MB": casts_mb,
             "how": f"fake PG rank 0 of {world}, CPU tensors; activations at B=1,2 T=128 scaled; a real save of rank 0's shard"}]


def print_per_rank_124m():
    t0 = time.perf_counter()
    for r in per_rank_124m():
        for k, v in r.items():
            print(f"{k:22s} {v:.2f}" if isinstance(v, float) else f"{k:22s} {v}")
    print(f"({time.perf_counter() - t0:.0f} s)")


def main():
    p = gpt2.make_parser("Save/load time and size: checkpoint.py vs torch.distributed.checkpoint.")
    p.add_argument("--bench-dir", default="/tmp/bench_checkpoint", help="where the checkpoints are written")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per method (median reported)")
    args = p.parse_args()
    args.ckpt_dir, args.keep, args.out = os.path.join(args.bench_dir, "ours"), 1, os.path.join(args.bench_dir, "out")
    args.fail_at, args.allow_fresh_start, args.save_every = -1, False, 0  # checkpoint.py's own flags, off
    ctx = gpt2.setup(args)
    if ctx.world < 2:
        sys.exit("run it under torchrun with >= 2 processes: DCP's sharded save needs a process group")
    if ctx.master:
        for d in os.listdir(args.bench_dir):  # an earlier bench's checkpoints; not out/, which setup() holds
            if d != "out":
                shutil.rmtree(os.path.join(args.bench_dir, d), ignore_errors=True)
    dist.barrier()
    comm = gpt2.CommMeter()
    model = gpt2.build_model(args).to(ctx.device)
    zero = checkpoint.Zero1(model, args, ctx, comm)
    opt = gpt2.make_adamw(zero.optimizer_groups, args, ctx.device)
    x = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), device=ctx.device)
    with ctx.autocast():
        model(x, x)[1].backward()
    zero.reduce_scatter_grads()
    opt.step()  # one step, so AdamW's moments exist
    zero.all_gather_params()
    loader = FixedLoader()
    rows = {}

    # ours: snapshot to CPU, write + fsync + crc32 in a thread, rank 0 commits the manifest
    ck = checkpoint.SafeCheckpointer(args, ctx, zero, gpt2.Timeline(ctx))
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
        assert ck.load_latest(opt, loader) == r + 1
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
    print_per_rank_124m() if "--per-rank-124m" in sys.argv else main()
