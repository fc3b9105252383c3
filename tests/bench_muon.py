"""Benchmark: our distributed Muon against torch.optim.Muon behind a data-parallel all-reduce, on the
block matrices of a GPT-2-shaped model. Both start from the same weights and per-rank gradients.

    torch.optim.Muon + DDP:  all-reduce every gradient, EVERY rank orthogonalises EVERY matrix
    ours (muon.Muon):        reduce-scatter, each rank orthogonalises the matrices it owns, all-gather

    torchrun --nproc_per_node=2 tests/bench_muon.py                         # CPU, gloo: 2 x 128 blocks
    torchrun --nproc_per_node=8 tests/bench_muon.py --n-layer 12 --n-embd 768   # GPUs: GPT-2 124M blocks
    python tests/bench_muon.py compare --muon OUT_A --adamw OUT_B --out DIR # val curves -> DIR/muon_vs_adamw.png

Columns: optimizer step time (median, including communication), Newton-Schulz matrices per rank, bytes
sent per rank per step (ring model, gpt2.CommMeter), momentum memory per rank, and the largest difference
of the parameters from torch's after the timed steps (same bf16 Newton-Schulz in both).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2  # noqa: E402
import muon  # noqa: E402


def block_matrices(n_layer, E, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3 * E, E), (E, E), (4 * E, E), (E, 4 * E)] * n_layer  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)) for s in shapes]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def bench(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else "cpu")
    ours, theirs = block_matrices(args.n_layer, args.n_embd, device), block_matrices(args.n_layer, args.n_embd, device)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own gradients, as in data parallelism
    grads = [(torch.randn(p.shape, generator=g)).to(device) for p in ours]
    n_bytes = sum(p.numel() for p in ours) * 4

    comm = gpt2.CommMeter()
    opt = muon.Muon(ours, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16, rank=rank, world=world, comm=comm)
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")

    def step_ours():
        for p, gr in zip(ours, grads):
            p.grad = gr
        opt.reduce_scatter_grads()
        opt.step()

    def step_torch():
        flat = torch.cat([gr.reshape(-1) for gr in grads])
        dist.all_reduce(flat)
        flat /= world
        comm.all_reduce(flat.numel() * 4, world)
        pos = 0
        for p in theirs:
            p.grad = flat[pos: pos + p.numel()].view_as(p)
            pos += p.numel()
        ref.step()

    rows = []
    for name, fn, n_ns, mom in (("torch.optim.Muon + all-reduce", step_torch, len(theirs), n_bytes),
                                ("ours: reduce-scatter / own / all-gather", step_ours, len(opt.mine),
                                 sum(b.numel() for b in opt.momentum_buf.values()) * 4)):
        times = []
        for i in range(args.warmup + args.iters):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        mb = comm.take_mb() / (args.warmup + args.iters)
        n_ns_max = torch.tensor(float(n_ns), device=device)
        dist.all_reduce(n_ns_max, op=dist.ReduceOp.MAX)
        rows.append((name, 1e3 * statistics.median(times), int(n_ns_max.item()), mb, mom / 1e6))
    diff = max((p - q).abs().max().item() for p, q in zip(ours, theirs))
    scale = max(q.abs().max().item() for q in theirs)
    if rank == 0:
        print(f"{args.n_layer} blocks x 4 matrices, width {args.n_embd}, {n_bytes / 1e6:.1f} MB of fp32 matrices, "
              f"{world} ranks, {device.type}, padding {opt.padding} floats")
        print(f"| method | step ms | NS matrices / rank (max) | comm MB / rank / step | momentum MB / rank |")
        print("|---|---|---|---|---|")
        for name, ms, n_ns, mb, mom in rows:
            print(f"| {name} | {ms:.1f} | {n_ns} | {mb:.2f} | {mom:.2f} |")
        print(f"speedup {rows[0][1] / rows[1][1]:.2f}x | max |param ours - torch| after {args.warmup + args.iters} steps: "
              f"{diff:.2e} (params up to {scale:.2e})")


# ----------------------------------------------------------------------------------------------------
# The experiment's picture: val loss of a Muon run and an AdamW run (metrics.jsonl of each)


def val_curve(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return [(r["step"] + 1, r["val_loss"]) for r in recs if "val_loss" in r]


def steps_to_reach(curve, target):
    """First step at which the curve is at or below target, linearly interpolated between evaluations."""
    prev = None
    for s, v in curve:
        if v <= target:
            if prev is None:
                return s
            (s0, v0) = prev
            return s0 + (s - s0) * (v0 - target) / (v0 - v)
        prev = (s, v)
    return None


def compare(argv):
    p = argparse.ArgumentParser(prog="bench_muon.py compare", description="Muon vs AdamW val-loss curves in one picture.")
    p.add_argument("--muon", required=True, help="OUT directory of the Muon run")
    p.add_argument("--adamw", required=True, help="OUT directory of the AdamW run")
    p.add_argument("--others", nargs="*", default=[], help="more OUT directories (other LRs), drawn thin")
    p.add_argument("--out", default="out", help="where muon_vs_adamw.png goes")
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m, w = val_curve(a.muon), val_curve(a.adamw)
    target = w[-1][1]
    reach = steps_to_reach(m, target)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for d in a.others:
        ax.plot(*zip(*val_curve(d)), "-", lw=0.8, alpha=0.5, label=os.path.basename(d.rstrip("/")))
    ax.plot(*zip(*w), "o-", color="C0", lw=2, label=f"AdamW ({os.path.basename(a.adamw.rstrip('/'))})")
    ax.plot(*zip(*m), "o-", color="C3", lw=2, label=f"Muon ({os.path.basename(a.muon.rstrip('/'))})")
    ax.axhline(target, color="gray", ls=":", lw=1)
    if reach:
        ax.axvline(reach, color="C3", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title("tiny GPT-2 on tinyshakespeare: Muon vs AdamW")
    ax.set_ylim(top=min(ax.get_ylim()[1], w[0][1] + 0.5))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(a.out, exist_ok=True)
    fig.savefig(os.path.join(a.out, "muon_vs_adamw.png"), dpi=110)
    steps = w[-1][0]
    print("| run | final val loss | steps to AdamW's final val loss |")
    print("|---|---|---|")
    for d in [a.adamw, a.muon] + a.others:
        c = val_curve(d)
        r = steps_to_reach(c, target)
        print(f"| {os.path.basename(d.rstrip('/'))} | {c[-1][1]:.4f} | {f'{r:.0f}' if r else f'> {steps}'} |")
    if reach:
        print(f"Muon reaches AdamW's final val loss {target:.4f} at step {reach:.0f} of {steps}: {steps / reach:.2f}x fewer steps")
    print(f"wrote {os.path.join(a.out, 'muon_vs_adamw.png')}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        return compare(sys.argv[2:])
    p = argparse.ArgumentParser(description="distributed Muon vs torch.optim.Muon + all-reduce")
    p.add_argument("--n-layer", type=int, default=2, help="blocks (4 matrices each)")
    p.add_argument("--n-embd", type=int, default=128, help="model width")
    p.add_argument("--iters", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"], help="device")
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        bench(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
