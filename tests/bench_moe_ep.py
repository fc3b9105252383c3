"""Benchmark moe_ep.py on CPU/gloo (or CUDA/NCCL): the hand-written differentiable all-to-all against PyTorch's
functional all_to_all_single_autograd, then tokens/s of expert parallelism (EP=2) against replicated experts
(EP=1, plain data parallel) on the same 2 ranks, and the share of the step spent in all-to-all.

    torchrun --nproc_per_node=2 tests/bench_moe_ep.py                     # CPU, a few minutes
    torchrun --nproc_per_node=2 tests/bench_moe_ep.py --device cuda --model gpt2 --experts 8 --batch-size 8
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2  # noqa: E402
import moe_ep  # noqa: E402


def time_a2a(fn, rows, send, recv, iters, device):
    """Median seconds of forward + backward of one uneven all-to-all."""
    times = []
    for i in range(iters + 2):
        x = rows.clone().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        y = fn(x, send, recv)
        y.backward(torch.ones_like(y))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), y.detach(), x.grad


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--model", default="tiny", help="gpt2.MODELS entry for the training comparison")
    p.add_argument("--experts", type=int, default=8, help="experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=8, help="training steps per run (the first 2 are not timed)")
    p.add_argument("--rows", type=int, default=4096, help="rows per rank in the all-to-all micro-benchmark")
    p.add_argument("--width", type=int, default=768, help="row width in the all-to-all micro-benchmark")
    a = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if a.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    # 1) the all-to-all alone: uneven splits as a skewed router makes them
    g = torch.Generator().manual_seed(rank)
    w = torch.rand(world, generator=g) + 0.5
    send = (w / w.sum() * a.rows).long()
    send[-1] = a.rows - send[:-1].sum()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send, recv = send.tolist(), recv.tolist()
    rows = torch.randn(a.rows, a.width, generator=g).to(device, dtype)
    group, meter = dist.group.WORLD, moe_ep.A2AMeter()
    ours = lambda x, s, r: moe_ep.AllToAll.apply(x, s, r, group, meter)
    theirs = lambda x, s, r: funcol.all_to_all_single_autograd(x, r, s, group)
    t_ours, y1, g1 = time_a2a(ours, rows, send, recv, 10, device)
    t_theirs, y2, g2 = time_a2a(theirs, rows, send, recv, 10, device)
    same = torch.equal(y1, y2) and torch.equal(g1, g2)
    mb = a.rows * a.width * rows.element_size() / 1e6

    # 2) training: EP=2 (experts split) vs EP=1 (experts replicated, data parallel), same global batch
    data = os.path.join(tempfile.gettempdir(), "bench_moe_ep_data")
    if rank == 0 and not os.path.exists(os.path.join(data, "val_000000.bin")):
        rng = np.random.default_rng(0)
        gpt2.write_shard(os.path.join(data, "train_000000.bin"), rng.integers(0, 50257, 400_000))
        gpt2.write_shard(os.path.join(data, "val_000000.bin"), rng.integers(0, 50257, 20_000))
    dist.barrier()
    out = tempfile.mkdtemp(prefix="bench_moe_ep_")
    common = ["--model", a.model, "--data", data, "--steps", str(a.steps), "--batch-size", str(a.batch_size),
              "--seq-len", str(a.seq_len), "--experts", str(a.experts), "--top-k", str(a.top_k),
              "--eval-every", "0", "--device", a.device, "--time-a2a"]
    rows_out = []
    for ep in (1, world):
        recs = moe_ep.train(common + ["--ep", str(ep), "--out", os.path.join(out, f"ep{ep}")])
        timed = [r for r in recs if "loss" in r][2:]
        med = lambda k: statistics.median(r[k] for r in timed)
        rows_out.append((ep, med("tok_per_s"), med("dt_ms"), med("a2a_ms"), med("a2a_mb"), med("a2a_mb_theory"), med("comm_mb")))

    if rank == 0:
        print(f"\nall-to-all, {world} ranks, {a.rows} rows x {a.width} ({mb:.1f} MB per rank), uneven splits, fwd+bwd, "
              f"{device.type} {str(dtype).removeprefix('torch.')}:")
        print(f"  {'implementation':42s} {'ms':>8s} {'GB/s out':>9s}")
        for name, t in (("moe_ep.AllToAll (hand-written)", t_ours), ("torch funcol.all_to_all_single_autograd", t_theirs)):
            print(f"  {name:42s} {t * 1e3:8.2f} {2 * mb / 1e3 / t:9.2f}")
        print(f"  identical outputs and gradients: {same}")
        print(f"\ntraining {a.model}, {world} ranks, {a.experts} experts top-{a.top_k}, batch {a.batch_size}x{a.seq_len} per rank "
              f"(median of steps 2..{a.steps - 1}):")
        print(f"  {'layout':24s} {'tok/s':>8s} {'step ms':>8s} {'a2a ms':>8s} {'a2a share':>9s} {'a2a MB':>8s} {'closed form':>11s} {'comm MB':>8s}")
        for ep, tok, dt, a2a_ms, a2a_mb, th, comm in rows_out:
            name = f"EP={ep} x DP={world // ep}" + (" (replicated)" if ep == 1 else "")
            print(f"  {name:24s} {tok:8.0f} {dt:8.1f} {a2a_ms:8.1f} {100 * a2a_ms / dt:8.1f}% {a2a_mb:8.2f} {th:11.2f} {comm:8.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
