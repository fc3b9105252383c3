"""Benchmark: our distributed Muon against torch.optim.Muon behind a data-parallel all-reduce, on the
block matrices of a GPT-2-shaped model. Both start from the same weights and per-rank gradients.

    torch.optim.Muon + DDP:  all-reduce every gradient, EVERY rank orthogonalises EVERY matrix
    ours (muon.Muon):        reduce-scatter, each rank orthogonalises the matrices it owns, all-gather

    torchrun --nproc_per_node=2 tests/bench_muon.py                         # CPU, gloo: 2 x 128 blocks
    torchrun --nproc_per_node=8 tests/bench_muon.py --n-layer 12 --n-embd 768   # GPUs: GPT-2 124M blocks
    python tests/bench_muon.py compare --muon OUT_A --adamw OUT_B --out DIR # val curves -> DIR/muon_vs_adamw.png
    python tests/bench_muon.py experiment --data D --out DIR   # muon.py's flags on the tiny experiment, 3 seeds
    python tests/bench_muon.py --per-rank-124m                 # GPT-2 124M at 8 ranks: bytes and memory per rank

The experiment (08:40 UTC, 2 loaded CPU cores, ~5 min per run), val loss mean +- std over seeds 1-3:
| variant | step 50 | 100 | 150 | 200 | 250 | 300 | peak max logit |
| default | 7.3215 +- 0.0158 | 6.9697 +- 0.0225 | 6.8604 +- 0.0189 | 6.8125 +- 0.0239 | 6.7383 +- 0.0068 | 6.6927 +- 0.0088 | 10.91 |
| polar_express | 7.3115 +- 0.0129 | 6.9825 +- 0.0378 | 6.8589 +- 0.0127 | 6.7998 +- 0.0165 | 6.7497 +- 0.0202 | 6.6922 +- 0.0203 | 11.25 |
| momentum_warmup_100 | 7.2879 +- 0.0074 | 6.9272 +- 0.0191 | 6.8578 +- 0.0230 | 6.7781 +- 0.0116 | 6.7287 +- 0.0149 | 6.6635 +- 0.0148 | 8.90 |
| muon_wd_0.1 | 7.3194 +- 0.0154 | 6.9685 +- 0.0271 | 6.8639 +- 0.0253 | 6.8014 +- 0.0229 | 6.7278 +- 0.0169 | 6.6899 +- 0.0258 | 8.58 |
| qk_clip 5.21 (seed 1) | 7.3166 | 6.9876 | 6.8625 | 6.8294 | 6.7410 | 6.6945 | 6.07 (default seed 1: 10.43) |

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

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:  # under pytest --impl DIR, DIR stays first
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

    keller = block_matrices(args.n_layer, args.n_embd, device)
    comm = gpt2.CommMeter()
    opt = muon.Muon(ours, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16, rank=rank, world=world, comm=comm)
    opt_keller = KellerMuon(keller, rank, world, comm)
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")

    def step_ours():
        for p, gr in zip(ours, grads):
            p.grad = gr
        opt.reduce_grads()
        opt.step(0.02)
        opt.all_gather_params()

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

    def step_keller():
        for p, gr in zip(keller, grads):
            p.grad = gr
        all_reduce_all(keller, world, comm)
        opt_keller.step()

    f, S_pad = (world - 1) / world, world * opt.slab * 4
    closed = {"torch": 2 * f * n_bytes, "keller": 3 * f * n_bytes, "ours": 2 * f * S_pad}
    rows = []
    own_mom = sum(b.numel() for b in opt.momentum_buf.values()) * 4
    for name, key, fn, n_ns, mom in (("torch.optim.Muon + all-reduce", "torch", step_torch, len(theirs), n_bytes),
                                     ("KellerJordan/Muon: all-reduce / own / all-gather", "keller", step_keller,
                                      len(opt_keller.mine), _mb(opt_keller.momentum_buf.values()) * 1e6),
                                     ("ours: reduce-scatter / own / all-gather", "ours", step_ours, len(opt.mine), own_mom)):
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
        rows.append((name, 1e3 * statistics.median(times), int(n_ns_max.item()), mb, closed[key] / 1e6, mom / 1e6))
    diff = max((p - q).abs().max().item() for p, q in zip(ours, theirs))
    scale = max(q.abs().max().item() for q in theirs)
    if rank == 0:
        print(f"{args.n_layer} blocks x 4 matrices, width {args.n_embd}, {n_bytes / 1e6:.1f} MB of fp32 matrices, "
              f"{world} ranks, {device.type}, padding {world * opt.slab - n_bytes // 4} floats")
        print(f"| method | step ms | NS matrices / rank (max) | comm MB / rank / step | closed form | momentum MB / rank |")
        print("|---|---|---|---|---|---|")
        for name, ms, n_ns, mb, mb_closed, mom in rows:
            print(f"| {name} | {ms:.1f} | {n_ns} | {mb:.3f} | {mb_closed:.3f} | {mom:.2f} |")
        print(f"closed forms: 2(N-1)/N x S (torch), 3(N-1)/N x S (KellerJordan/Muon, no padding), 2(N-1)/N x S_padded (ours), "
              f"S = {n_bytes / 1e6:.3f} MB, S_padded = {S_pad / 1e6:.3f} MB")
        print(f"speedup {rows[0][1] / rows[2][1]:.2f}x | max |param ours - torch| after {args.warmup + args.iters} steps: "
              f"{diff:.2e} (params up to {scale:.2e})")


class KellerMuon:
    """KellerJordan/Muon's distributed step behind DDP, for its bytes and time: the gradients arrive
    all-reduced (every rank gets every matrix's gradient); the matrices, sorted by size, are dealt out
    round-robin in rounds of `world`; in each round rank r updates the r-th and the round is all-gathered
    (unequal shapes: one broadcast per matrix, the same bytes). No slabs, so no padding: f x S."""

    def __init__(self, params, rank, world, comm, lr=0.02, weight_decay=0.1, momentum=0.95):
        self.params = sorted(params, key=lambda p: tuple(p.shape), reverse=True)
        self.rank, self.world, self.comm = rank, world, comm
        self.lr, self.weight_decay, self.momentum = lr, weight_decay, momentum
        self.mine = self.params[rank::world]
        self.momentum_buf = {id(p): torch.zeros_like(p) for p in self.mine}

    @torch.no_grad()
    def step(self):
        for base in range(0, len(self.params), self.world):
            chunk = self.params[base:base + self.world]
            if self.rank < len(chunk):
                p = chunk[self.rank]
                buf = self.momentum_buf[id(p)]
                buf.lerp_(p.grad, 1 - self.momentum)
                o = muon.newton_schulz(p.grad.lerp(buf, self.momentum), 5, torch.bfloat16)
                p.mul_(1 - self.lr * self.weight_decay)
                p.add_(o, alpha=-self.lr * muon.update_scale(*p.shape, "original"))
            if self.world > 1:
                if all(q.shape == chunk[0].shape for q in chunk) and len(chunk) == self.world:
                    dist.all_gather(list(chunk), chunk[self.rank])
                else:
                    for r, q in enumerate(chunk):
                        dist.broadcast(q, src=r)
                self.comm.all_gather(sum(q.numel() * q.element_size() for q in chunk), self.world)


def all_reduce_all(params, world, comm):
    """DDP's gradient all-reduce, one flat buffer of every gradient (averaged)."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    comm.all_reduce(flat.numel() * flat.element_size(), world)
    flat /= world
    pos = 0
    for p in params:
        p.grad = flat[pos: pos + p.numel()].view_as(p)
        pos += p.numel()


# ----------------------------------------------------------------------------------------------------
# GPT-2 124M at `world` ranks: bytes per step and memory per rank, measured on one process with torch's fake
# process group (collectives are no-ops that still count) and the meta device (shapes without data)


def _mb(tensors):
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def saved_bytes(batch, seq_len):
    """Bytes autograd saves for backward in one bf16-autocast forward of GPT-2 124M on the CPU (parameters and
    repeated storages not counted), measured with saved_tensors_hooks."""
    torch.manual_seed(0)
    model = gpt2.GPT(gpt2.MODELS["gpt2"])
    idx = torch.randint(0, 50257, (batch, seq_len))
    with gpt2.SavedBytes(exclude=model.parameters()) as counted, torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, idx)
    return counted.bytes


def activation_mb(batch_size, seq_len):
    """Activations at batch_size from two small measurements: saved(B) = fixed + B x per_sequence, where fixed
    is autocast's bf16 copies of the weights (saved too, but not activations). Returns (act MB, fixed MB)."""
    one, two = saved_bytes(1, seq_len), saved_bytes(2, seq_len)
    return (two - one) * batch_size / 1e6, (2 * one - two) / 1e6


def per_rank_124m(world=8, batch_size=16, seq_len=1024):
    """One dict per setup muon.py offers (see COMMON.md): bytes this rank sends per optimizer step (counted
    by gpt2.CommMeter at the real collective calls) and persistent memory per rank, for GPT-2 124M."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    act, weight_copies = activation_mb(batch_size, seq_len)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    rows = []
    try:
        args = muon.make_parser().parse_args(["--model", "gpt2"])
        for setup, gather_dtype, keller in (("muon.py (fp32)", torch.float32, False),
                                             ("muon.py, bf16 run (bf16 gather)", torch.bfloat16, False),
                                             ("KellerJordan/Muon under DDP (all-reduce + all-gather)", torch.float32, True)):
            with torch.device("meta"):
                model = gpt2.GPT(gpt2.model_config(args))
            m, parts, rest = muon.split_params(model, "muon")
            comm = gpt2.CommMeter()
            opt = muon.Bf16Gather(m, parts, rank=0, world=world, comm=comm, steps=2) if gather_dtype == torch.bfloat16 \
                else muon.Muon(m, parts, rank=0, world=world, comm=comm)  # Bf16Gather: this step's gather in bf16
            adamw = torch.optim.AdamW(rest, lr=1e-3)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            if keller:  # DDP's all-reduce of every gradient, then its own rounds of all-gathers (no slabs)
                km = KellerMuon(m, 0, world, comm)
                all_reduce_all(list(model.parameters()), world, comm)
                km.step()
            else:
                opt.reduce_grads()
                muon.all_reduce_grads(rest, torch.zeros((), device="meta"), world, comm)
                opt.grad_sq_norm()  # the clip norm's scalar all-reduce
                opt.step(0.02)
                opt.all_gather_params()
            adamw.step()
            comm_mb = comm.take_mb()
            n, n_adamw, f = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in rest), (world - 1) / world
            S, S_pad = 4 * sum(p.numel() for p in m), 4 * world * opt.slab  # Muon matrices' fp32 bytes, and as sent
            if keller:
                closed = 2 * f * 4 * n + f * S
            else:
                closed = 2 * f * 4 * (n_adamw + 1) + f * S_pad + f * S_pad * (2 if gather_dtype == torch.bfloat16 else 4) / 4 + 2 * f * 4
            momentum = list((km if keller else opt).momentum_buf.values())
            optim = [t for st in adamw.state.values() for t in st.values() if t.dim() > 0] + momentum
            buffers = [] if keller else {id(t): t for t in (opt.flat, opt.own, *([opt.own16, opt.flat16] if gather_dtype
                                                                                  == torch.bfloat16 else []))}.values()
            closed_mem = 4 * n + 4 * n + 8 * n_adamw + 4 * sum(t.numel() for t in momentum)
            rows.append({"setup": setup, "comm_MB": comm_mb, "comm_MB_closed": closed / 1e6,
                         "params_MB": _mb(model.parameters()), "grads_MB": _mb(p.grad for p in model.parameters()),
                         "optim_MB": _mb(optim), "act_MB": act, "mem_MB_closed": closed_mem / 1e6,
                         "buffers_MB": _mb(buffers), "muon_MB": S / 1e6, "padding": S_pad // 4 - S // 4,
                         "how": f"fake PG rank 0 of {world}, meta device; act: CPU bf16 autocast at B=1,2, linear in B "
                                f"(+{weight_copies:.0f} MB autocast weight copies not counted)"})
    finally:
        dist.destroy_process_group()
    return rows


def print_per_rank_124m():
    rows = per_rank_124m()
    keys = ["comm_MB", "comm_MB_closed", "params_MB", "grads_MB", "optim_MB", "act_MB", "mem_MB_closed", "buffers_MB"]
    print("GPT-2 124M, 8 ranks, B=16, T=1024, per rank (MB)")
    print("| setup | " + " | ".join(keys) + " | how |")
    print("|---|" + "---|" * (len(keys) + 1))
    for r in rows:
        print(f"| {r['setup']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + f" | {r['how']} |")
    r = rows[0]
    print(f"Muon matrices S = {r['muon_MB']:.1f} MB fp32, padding {r['padding']} floats; buffers = the flat "
          f"reduce-scatter/all-gather buffer (N x slab) + own slab (+ bf16 send/recv)")


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


# ----------------------------------------------------------------------------------------------------
# The flags on the tiny experiment: val loss vs steps over 3 seeds, each variant against the default


EXPERIMENT = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--seq-len", "32", "--batch-size", "4",
              "--steps", "300", "--warmup", "20", "--lr", "3e-3", "--eval-every", "50", "--val-tokens", "8192",
              "--device", "cpu", "--dtype", "float32", "--log-max-logit"]
VARIANTS = {"default": [], "polar_express": ["--ns-coefficients", "polar_express"],
            "momentum_warmup_100": ["--momentum-warmup", "100"], "muon_wd_0.1": ["--muon-weight-decay", "0.1"]}


def run_variant(data, out, flags, seed):
    import subprocess
    if os.path.exists(os.path.join(out, "model.pt")):  # already run: reuse it
        return
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "muon.py"),
           *EXPERIMENT, *flags, "--seed", str(seed), "--data", data, "--out", out]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def experiment(argv):
    """Each variant x 3 seeds on the tiny experiment, then QK-clip at tau = half the default run's peak logit."""
    p = argparse.ArgumentParser(prog="bench_muon.py experiment", description="Muon's flags on the tiny experiment")
    p.add_argument("--data", required=True, help="prepared tinyshakespeare")
    p.add_argument("--out", default="out/muon_experiment", help="one directory per run, and the pictures")
    p.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3])
    p.add_argument("--qk-clip-seeds", type=int, nargs="*", default=[1], help="seeds of the QK-clip run")
    a = p.parse_args(argv)
    for seed in a.seeds:
        for name, flags in VARIANTS.items():
            run_variant(a.data, os.path.join(a.out, f"{name}_s{seed}"), flags, seed)
            print(f"done {name} seed {seed}", flush=True)
    base = records(os.path.join(a.out, f"default_s{a.seeds[0]}"))
    peak = max(r["max_logit"] for r in base if "max_logit" in r)
    tau = round(peak / 2, 2)
    for seed in a.qk_clip_seeds:
        run_variant(a.data, os.path.join(a.out, f"qk_clip_s{seed}"), ["--qk-clip", str(tau)], seed)
        print(f"done qk_clip seed {seed}", flush=True)
    summarize(a.out, a.seeds, tau, a.qk_clip_seeds)


def summarize(out, seeds, tau, qk_clip_seeds):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [*VARIANTS, "qk_clip"]
    steps = [r["step"] + 1 for r in records(os.path.join(out, f"default_s{seeds[0]}")) if "val_loss" in r]
    print(f"val loss (mean +- std over seeds {seeds}) at steps {steps}; QK-clip tau = {tau}")
    print("| variant | " + " | ".join(str(s) for s in steps) + " | peak max logit |")
    print("|---|" + "---|" * (len(steps) + 1))
    for name in names:
        runs = [records(os.path.join(out, f"{name}_s{s}")) for s in (qk_clip_seeds if name == "qk_clip" else seeds)]
        curves = torch.tensor([[r["val_loss"] for r in rs if "val_loss" in r] for rs in runs])  # (seeds, evals)
        peaks = [max(r["max_logit"] for r in rs if "max_logit" in r) for rs in runs]
        sds = curves.std(0).tolist() if len(runs) > 1 else [float("nan")] * curves.size(1)
        cells = [f"{m:.4f} +- {sd:.4f}" for m, sd in zip(curves.mean(0).tolist(), sds)]
        print(f"| {name} ({len(runs)} seeds) | " + " | ".join(cells) + f" | {statistics.mean(peaks):.2f} |")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, color in (("default", "C0"), ("qk_clip", "C3")):
        for i, s in enumerate(qk_clip_seeds):
            rs = records(os.path.join(out, f"{name}_s{s}"))
            ax.plot([r["step"] for r in rs if "max_logit" in r], [r["max_logit"] for r in rs if "max_logit" in r],
                    color=color, lw=1, alpha=0.8, label=(name if name == "default" else f"--qk-clip {tau}") if i == 0 else None)
    ax.axhline(tau, color="gray", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("max attention logit of the step")
    ax.set_title("tiny GPT-2, Muon: largest attention logit with and without QK-clip")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "max_logit.png"), dpi=110)
    print(f"wrote {os.path.join(out, 'max_logit.png')}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        return compare(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "experiment":
        return experiment(sys.argv[2:])
    if "--per-rank-124m" in sys.argv:
        return print_per_rank_124m()
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
