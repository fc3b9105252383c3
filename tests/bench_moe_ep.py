"""Benchmark moe_ep.py on CPU/gloo (or CUDA/NCCL): the hand-written differentiable all-to-all against PyTorch's
functional all_to_all_single_autograd, then tokens/s of expert parallelism (EP=2) against replicated experts
(EP=1, plain data parallel) on the same 2 ranks, and the share of the step spent in all-to-all.

    torchrun --nproc_per_node=2 tests/bench_moe_ep.py                     # CPU, a few minutes
    torchrun --nproc_per_node=2 tests/bench_moe_ep.py --device cuda --model gpt2 --experts 8 --batch-size 8
    python tests/bench_moe_ep.py --per-rank-124m    # GPT-2 124M MoE at 8 ranks: bytes and memory per rank (CPU, ~1 min)
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

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:  # under pytest --impl DIR, DIR stays first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2  # noqa: E402
import moe_ep  # noqa: E402


def mirrored_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """all_to_all_single for rank 0 of a fake process group (whose collectives do nothing): rank 0 receives
    from rank s what it sends to rank -s, as if every rank routed like rank 0 with the expert ids rotated.
    The splits stay consistent, so dispatch, experts and combine run for real on rank 0's tokens."""
    n = dist.get_world_size(group)
    ins = input.split(input_split_sizes or [input.size(0) // n] * n)
    outs = output.split(output_split_sizes or [output.size(0) // n] * n)
    for j in range(n):
        outs[j].copy_(ins[(-j) % n])

    class Done:
        def wait(self):
            return True
    return Done() if async_op else None


class A2ATimer:
    """The all-to-alls' time, issue to completion (CUDA events on the stream, since an NCCL call returns
    before the data moves; the host clock on CPU): wraps torch.distributed.all_to_all_single while entered.
    moe_ep's core counts the bytes (moe_ep.moved), not the time: timing is the bench's business."""

    def __init__(self, device):
        self.cuda, self.spans = device.type == "cuda", []

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __enter__(self):
        self.real = dist.all_to_all_single

        def timed(*args, **kw):
            start = self.now()
            out = self.real(*args, **kw)
            self.spans.append((start, self.now()))
            return out
        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.real

    def take_ms(self):
        if self.cuda:
            torch.cuda.synchronize()
        ms = sum(s.elapsed_time(e) if self.cuda else 1e3 * (e - s) for s, e in self.spans)
        self.spans = []
        return ms


def per_rank_124m(world=8, batch_size=16, seq_len=1024, probe_tokens=128) -> list[dict]:
    """The file's MoE GPT-2 at GPT-2 124M shapes (12 layers, D=768): every MLP -> 8 experts (top-2, sigmoid gates,
    aux-loss-free bias) + 1 shared expert, --ep 8 on 8 ranks (one routed expert per rank per layer). One real
    optimizer step of our functions on rank 0 of torch's fake process group (CommMeter / A2AMeter count the
    calls issued; the all-to-alls mirrored, see mirrored_all_to_all), bf16 autocast, 1 x probe_tokens tokens:
    the token-proportional bytes and the saved activations are scaled to batch_size x seq_len (activations
    from the difference of probe_tokens and probe_tokens/2 forwards). --dispatch rank moves no tensor that
    persists, so the same model and optimizer give its row."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    real_a2a, dist.all_to_all_single = dist.all_to_all_single, mirrored_all_to_all
    try:
        flags = ["--model", "gpt2", "--device", "cpu", "--ep", str(world), "--experts", str(world), "--top-k", "2",
                 "--gate", "sigmoid", "--balance", "bias", "--shared-expert", "--batch-size", "1"]
        parser = moe_ep.make_parser()
        moe_ep.add_options(parser)
        args = parser.parse_args(flags + ["--seq-len", str(probe_tokens)])
        moe_ep.option_defaults(args)
        moe_ep.check_args(args, world)
        ep_group, expert_dp_group = moe_ep.make_groups(0, world, world)
        moved, comm = moe_ep.moved, moe_ep.comm  # moe_ep's meters: the core counts beside every collective
        moved.take_mb(), comm.take_mb()
        model = gpt2.build_model(args)
        for i, block in enumerate(model.h):
            block.mlp = moe_ep.DeepSeekMoE(model.config, args, i, model.init_weights, 0, ep_group)
        cfg, moes = model.config, [b.mlp for b in model.h]
        experts = [p for m in moes for p in m.experts.parameters()]
        dense = [p for p in model.parameters() if id(p) not in {id(e) for e in experts}]
        opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, torch.device("cpu"))
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def step(tokens, backward=True):
            """One training micro-step as moe_ep.train runs it; returns the bytes saved for backward."""
            seen = {}

            def pack(t):
                if t.untyped_storage().data_ptr() not in weights:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            idx = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(idx, idx)[1]
            if backward:
                counts = torch.stack([torch.stack([m.stats["routed"], m.stats["kept"]]) for m in moes])
                dist.all_reduce(counts)
                aux = sum(m.balance_loss(c, args) for m, c in zip(moes, counts))
                (loss + aux).backward()
                moe_ep.all_reduce_grads(dense, None, world, world)
                moe_ep.all_reduce_grads(experts, expert_dp_group, 1, world)
                moe_ep.clip_global_grad_norm(dense, experts, args.grad_clip, ep_group, world)
            return sum(seen.values())

        # params per rank: GPT-2 (V*D + T*D + L*(12D^2 + 13D) + 2D) with each MLP (8D^2 + 5D) replaced by E/ep
        # routed experts + 1 shared expert + a router (E*D); x16 bytes = fp32 weights, grads, AdamW's 2 moments
        D, L, mlp = cfg.n_embd, cfg.n_layer, 8 * cfg.n_embd ** 2 + 5 * cfg.n_embd
        dense_gpt2 = cfg.padded_vocab * D + cfg.block_size * D + L * (12 * D * D + 13 * D) + 2 * D
        closed_params = dense_gpt2 + L * (args.experts // world + 1 - 1) * mlp + L * args.experts * D
        half = step(probe_tokens // 2, backward=False)
        moved.take_mb(), comm.take_mb()
        rows = []
        for dispatch in ("expert", "rank"):
            for m in moes:
                m.dispatch = dispatch
            full = step(probe_tokens)  # the same weights for both: the optimizer steps after the last
            act = (full - half) / (probe_tokens - probe_tokens // 2) * batch_size * seq_len / 1e6
            if dispatch == "rank":
                params = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
                grads = sum({p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                             for p in model.parameters()}.values()) / 1e6  # views of the two flat all-reduce buffers
                opt.step()  # AdamW's moments come into being here
                optim = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()) / 1e6
            opt.zero_grad(set_to_none=True)
            scale = batch_size * seq_len / probe_tokens
            counts = cfg.n_layer * (world - 1) * 8 * (1 if dispatch == "rank" else args.experts // world)  # not per token
            raw_a2a = moved.take_mb()
            a2a_mb = (raw_a2a - counts / 1e6) * scale + counts / 1e6
            args.dispatch = dispatch
            a2a_closed = cfg.n_layer * moe_ep.a2a_bytes_uniform(args, batch_size * seq_len, cfg.n_embd * 2) / 1e6
            ring = lambda nbytes: 2 * (world - 1) / world * nbytes / 1e6
            dense_bytes = sum(p.numel() for p in dense) * 4
            closed = (a2a_closed + ring(dense_bytes) + ring(cfg.n_layer * 2 * args.experts * 8)
                      + 2 * (world - 1) / world * 4 / 1e6)
            rows.append({"setup": "moe_ep.py --ep 8 --experts 8 --top-k 2 --shared-expert" +
                         (" --dispatch rank" if dispatch == "rank" else ""),
                         "comm_MB": a2a_mb + comm.take_mb(), "comm_MB_closed": closed, "act_MB": act,
                         "how": f"fake PG rank 0 of {world}, all-to-alls mirrored; one real CPU bf16 step at "
                                f"1x{probe_tokens} tokens, token bytes and activations scaled to {batch_size}x{seq_len}"})
        for r in rows:  # the dispatch moves no persistent tensor: one model, one optimizer, the same memory
            r.update(params_MB=params, grads_MB=grads, optim_MB=optim, mem_MB_closed=16 * closed_params / 1e6)
        return rows
    finally:
        dist.all_to_all_single = real_a2a


def print_per_rank_124m():
    rows = per_rank_124m()
    print(f"{'setup':62s} {'comm MB':>9s} {'closed':>9s} {'params':>8s} {'grads':>8s} {'AdamW':>8s} {'p+g+o':>8s} "
          f"{'closed':>8s} {'act bf16':>9s}")
    for r in rows:
        print(f"{r['setup']:62s} {r['comm_MB']:9.1f} {r['comm_MB_closed']:9.1f} {r['params_MB']:8.1f} {r['grads_MB']:8.1f} "
              f"{r['optim_MB']:8.1f} {r['params_MB'] + r['grads_MB'] + r['optim_MB']:8.1f} {r['mem_MB_closed']:8.1f} "
              f"{r['act_MB']:9.1f}")
    print(f"(MB per rank per optimizer step; {rows[0]['how']})")


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


def time_options(world, rank, device, dtype, a, iters=5):
    """DeepSeek-V3's options on one MoE layer (D = --width, E = --experts, top-k, batch x seq tokens per rank,
    a shared expert), forward + backward: median ms, the all-to-all's bytes and wait, side by side."""
    import argparse as ap
    cfg = gpt2.GPTConfig(block_size=a.seq_len, n_layer=1, n_head=1, n_embd=a.width)
    h = torch.randn(a.batch_size, a.seq_len, a.width, generator=torch.Generator().manual_seed(rank)).to(device, dtype)
    results = []
    for name, kw in (("--dispatch expert (today)", {}), ("--dispatch rank", dict(dispatch="rank")),
                     ("--grouped-gemm", dict(grouped_gemm=True)), ("--shared-expert", dict(shared_expert=True)),
                     ("--shared-expert --overlap-shared", dict(shared_expert=True, overlap_shared=True))):
        args = ap.Namespace(**{**dict(experts=a.experts, ep=world, top_k=a.top_k, gate="softmax", capacity_factor=0.0,
                                      seed=0, shared_expert=False), **kw})
        timer = A2ATimer(device)
        Layer = moe_ep.DeepSeekMoE if moe_ep.uses_deepseek(args) else moe_ep.MoE
        layer = Layer(cfg, args, 0, gpt2.GPT(cfg).init_weights, rank, dist.group.WORLD).to(device, dtype).train()
        times, waits, mbs = [], [], []
        for i in range(iters + 2):
            x = h.clone().requires_grad_()
            moe_ep.moved.take_mb(), timer.take_ms()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with timer:
                layer(x).square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
                waits.append(timer.take_ms() / 1e3)
                mbs.append(moe_ep.moved.take_mb())
        results.append((name, statistics.median(times) * 1e3, statistics.median(waits) * 1e3, statistics.median(mbs)))
    return results


def main():
    if "--per-rank-124m" in sys.argv:
        return print_per_rank_124m()
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
    group = dist.group.WORLD
    ours = lambda x, s, r: moe_ep.AllToAll.apply(x, s, r, group)
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
              "--eval-every", "0", "--device", a.device]
    options = time_options(world, rank, device, dtype, a)
    rows_out = []
    for ep in (1, world):
        timer = A2ATimer(device)
        with timer:
            recs = moe_ep.cli(common + ["--ep", str(ep), "--out", os.path.join(out, f"ep{ep}")])
        a2a_ms = timer.take_ms() / a.steps  # the mean per step, the first 2 included
        timed = [r for r in recs if "loss" in r][2:]
        theory, cfg = argparse.Namespace(ep=ep, experts=a.experts, top_k=a.top_k, activation_checkpointing=False), gpt2.MODELS[a.model]
        for r in timed:  # the all-to-all bytes if routing were uniform (dropless)
            r["a2a_mb_theory"] = cfg.n_layer * moe_ep.a2a_bytes_uniform(theory, a.batch_size * a.seq_len,
                                                                        cfg.n_embd * dtype.itemsize) / 1e6
        med = lambda k: statistics.median(r[k] for r in timed)
        rows_out.append((ep, med("tok_per_s"), med("dt_ms"), a2a_ms, med("exchange_mb"), med("a2a_mb_theory"),
                         med("comm_mb")))

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
        print(f"\none MoE layer, D={a.width}, {a.experts} experts top-{a.top_k}, EP={world}, {a.batch_size}x{a.seq_len} tokens "
              f"per rank, fwd+bwd (median of 5; a2a wait = time blocked on the exchanges):")
        print(f"  {'option':36s} {'ms':>8s} {'a2a wait ms':>11s} {'a2a MB':>8s}")
        for name, ms, wait, mb in options:
            print(f"  {name:36s} {ms:8.1f} {wait:11.1f} {mb:8.3f}")
        (_, t_sync, w_sync, _), (_, t_over, w_over, _) = options[-2], options[-1]
        print(f"  overlap: the shared expert hid {w_sync - w_over:.1f} ms of all-to-all wait "
              f"({t_sync - t_over:+.1f} ms per layer step)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
