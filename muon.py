"""
muon.py - Muon on the matrices inside the blocks, AdamW on the rest (embeddings, head, biases,
LayerNorm), data parallel, each matrix's Newton-Schulz done by ONE owner rank.

The update of one block matrix W (rows x cols), per step (Jordan et al. 2024; torch.optim.Muon):
    g = mean over ranks of dL/dW, times the global clip coefficient
    M = beta M + (1 - beta) g          momentum (EMA form), kept by W's owner only
    u = (1 - beta) g + beta M          Nesterov look-ahead (--no-nesterov: u = M)
    O = NS5(u) ~ U V^T for u = U S V^T 5 Newton-Schulz steps: every singular value -> about 1,
                                       so rare directions learn as fast as dominant ones
    W = (1 - lr wd) W - lr s O         s = sqrt(max(1, rows/cols)), or match_rms_adamw
NS needs the WHOLE matrix: we cut data parallelism's all-reduce in its halves, and in between one
owner holds each whole matrix (owners balance the NS FLOPs, largest first):

    rank 0 grads [c_attn.0 | c_proj.1 | c_fc.0]    rank 1 grads [c_attn.0 | c_proj.1 | c_fc.0]
         '-------- reduce-scatter (SUM), then / N: slab r goes to owner r --------'
    rank 0 owns c_attn.0, c_proj.1: mean g,        rank 1 owns c_fc.0: mean g,
           momentum, NS5, update                          momentum, NS5, update
         '-------- all-gather of the slabs: every rank holds every matrix again ---'

Who sums what (N data-parallel ranks)
    Muon gradients   reduce-scatter SUM over N, then / N on the owner: the MEAN   Muon.reduce_grads
    AdamW gradients  one flat all-reduce SUM over N (+ the loss), then / N        all_reduce_grads
    clip norm        owners' squared norms all-reduced (each matrix once) + the   Muon.grad_sq_norm
                     replicated AdamW part: ||g|| of the whole model, as on one rank
    --naive          every Muon gradient all-reduced, / N; every rank runs NS on every matrix
Owners send an all-reduce's bytes (2(N-1)/N x S, + slab padding) and save compute: each rank runs NS
on ~1/N of the matrices. Newton-Schulz runs in the run's dtype (fp32 with --dtype float32: exact).
The run ends with the payoff: NS GFLOP per step on rank 0 vs every matrix (what --naive runs on
every rank), and the stable rank of one matrix's momentum u and of its update NS5(u): a few
directions carry u, nearly all carry NS5(u).
    torchrun --nproc_per_node=2 muon.py --steps 30 --seq-len 128 --data data/shakespeare_char \\
        --out out/m
prints (its loss falls 4.17 -> 2.75; AdamW's to 2.82 with --optimizer adamw and a new --out):
    saved out/m | Newton-Schulz per step: 1.2583 GFLOP on rank 0, 2.5166 for every matrix (what
    --naive runs on every rank)
    Muon's update of h.0.mlp.c_proj.weight: stable rank 3.8 for the momentum u, 77.5 for NS5(u),
    of 128 directions
Read first: Muon.reduce_grads, Muon.update, Muon.all_gather_params, train. References: the appendix.
"""
import argparse
import functools
import math
import os

import torch
import torch.distributed as dist

import gpt2
from gpt2 import all_gather_single, print0, reduce_scatter_single

# Jordan's quintic s -> a s + b s^3 + c s^5: 5 fp32 steps take singular values in [2e-3, 1] into
# [0.68, 1.21].
QUINTIC = (3.4445, -4.7750, 2.0315)


def newton_schulz(G, steps=5, dtype=None, coefficients=None, eps=1e-7):
    """About U V^T for G = U S V^T, (..., rows, cols), returned in G's dtype; computed in dtype, by
    default bf16 on CUDA (tensor cores; the iteration corrects its own rounding), fp32 elsewhere.
    coefficients: (a, b, c) per step, default QUINTIC."""
    dtype = dtype or (torch.bfloat16 if G.is_cuda else torch.float32)
    X = G.to(dtype).reshape(-1, *G.shape[-2:])  # (k, rows, cols)
    tall = G.size(-2) > G.size(-1)  # the wide orientation: the Gram matrix X X^T is the small one
    X = X.mT if tall else X  # (k, min, max)
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # ||X||_2 <= ||X||_F: s in [0, 1]
    for a, b, c in coefficients or [QUINTIC] * steps:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2, one fused kernel
        X = torch.baddbmm(X, B, X, beta=a)  # (a + b XX^T + c (XX^T)^2) X: odd in the values s
    return (X.mT if tall else X).reshape(G.shape).to(G.dtype)


def muon_update(grad, momentum, beta=0.95, nesterov=True, parts=1, orthogonalize=newton_schulz):
    """Muon's direction for one matrix, before its scale: the momentum updated in place (EMA form:
    NS removes the scale), the Nesterov look-ahead, orthogonalised as `parts` stacked row blocks
    (q, k, v: 3 maps)."""
    momentum.lerp_(grad, 1 - beta)
    u = grad.lerp(momentum, beta) if nesterov else momentum
    rows = grad.size(0) // parts
    return orthogonalize(u.view(parts, rows, grad.size(1))).view_as(grad)  # (parts, rows, cols)


def update_scale(rows, cols, mode):
    """Step multiplier of an orthogonalised update (entries of RMS 1/sqrt(max(rows, cols))):
    'original' (Jordan) keeps tall matrices from being under-stepped; 'match_rms_adamw' (Moonlight
    2.2) gives AdamW's RMS 0.2."""
    if mode not in ("original", "match_rms_adamw"):
        raise ValueError(f"unknown Muon scale {mode!r}: use original or match_rms_adamw")
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def ns_flops(shape, parts=1):
    """Matmul FLOPs of one NS step on `parts` row blocks (m = min, n = max side): X X^T 2m^2n,
    A A 2m^3, B X 2m^2n."""
    m, n = sorted((shape[0] // parts, shape[1]))
    return parts * (4 * m * m * n + 2 * m ** 3)


def assign_owners(costs, world):
    """Each matrix to one rank, balancing Newton-Schulz work: largest first to the least-loaded rank
    (Graham's LPT rule, within 4/3 of the best split). Deterministic: every rank gets the same."""
    load, owner = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + costs[i]
    return owner


def all_reduce(t, comm, op=dist.ReduceOp.SUM):  # each collective counts its bytes (ring)
    dist.all_reduce(t, op=op)
    comm.all_reduce(t.numel() * t.element_size(), dist.get_world_size())


def reduce_scatter(out, inp, comm):
    reduce_scatter_single(out, inp)
    comm.reduce_scatter(inp.numel() * inp.element_size(), dist.get_world_size())


def all_gather(out, inp, comm):
    all_gather_single(out, inp)
    comm.all_gather(out.numel() * out.element_size(), dist.get_world_size())


# The naive version (--naive): every rank all-reduces every gradient, then runs one-rank Muon
# (world=1, below) on EVERY matrix itself: the same bytes as the owners' reduce-scatter +
# all-gather, N x their Newton-Schulz.
def naive_all_reduce(params, world, comm):
    for p in params:  # one all-reduce per matrix: SUM over the ranks, then / N = the mean gradient
        all_reduce(p.grad, comm)
        p.grad /= world


class Muon:
    """The real version: each matrix updated by one owner rank (world = 1: plain Muon); parts[i]
    = 3: three stacked row blocks. Per step: reduce_grads(), grad_sq_norm() (clip), step(lr,
    clip), all_gather_params()."""

    def __init__(self, params, parts=None, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True,
                 ns_steps=5, scale="original", ns_dtype=None, rank=0, world=1, comm=None):
        self.params = list(params)
        self.parts = list(parts or [1] * len(self.params))
        self.lr, self.weight_decay, self.momentum = lr, weight_decay, momentum
        self.nesterov, self.ns_steps, self.scale = nesterov, ns_steps, scale
        self.ns_dtype = ns_dtype
        self.rank, self.world, self.comm = rank, world, comm or gpt2.CommMeter()
        # One flat buffer of `world` equal slabs; slab r holds rank r's matrices back to back,
        # padded to the largest share: one reduce-scatter brings the gradients in, one
        # all-gather the matrices out.
        costs = [ns_flops(p.shape, k) for p, k in zip(self.params, self.parts)]
        self.owner = assign_owners(costs, world)
        used, self.offset = [0] * world, []
        for p, r in zip(self.params, self.owner):
            self.offset.append(used[r])
            used[r] += p.numel()
        self.slab = max(used) if self.params else 0
        self.mine = [i for i, r in enumerate(self.owner) if r == rank]
        dev = self.params[0].device
        self.flat = torch.zeros(world * self.slab, device=dev)  # (N x slab,) grads in, params out
        own = self.flat[:self.slab] if world == 1 else torch.zeros_like(self.flat[:self.slab])
        self.own = own  # (slab,): this rank's matrices
        self.momentum_buf = {i: torch.zeros_like(self.params[i]) for i in self.mine}  # owned only
        self.stats, self.flops = {}, 0  # numbers the loop logs; Newton-Schulz FLOPs this rank ran

    def _view(self, buf, i, base=0):  # matrix i in a buffer of slabs (base: its owner's slab start)
        start = base + self.offset[i]
        return buf[start: start + self.params[i].numel()].view_as(self.params[i])

    def reduce_grads(self):
        """Reduce-scatter: each owner ends with the MEAN gradient of its matrices (SUM, / N)."""
        for i, p in enumerate(self.params):
            self._view(self.flat, i, self.owner[i] * self.slab).copy_(p.grad)
        if self.world > 1 and self.slab:
            reduce_scatter(self.own, self.flat, self.comm)
            self.own /= self.world

    def grad_sq_norm(self):
        """||g||^2 over every Muon matrix: each owner's sum of squares, all-reduced (each once)."""
        squares = (self._view(self.own, i).float().square().sum() for i in self.mine)
        sq = sum(squares, self.own.new_zeros(()))
        if self.world > 1:
            all_reduce(sq, self.comm)
        return sq

    def orthogonalize(self, u):  # (parts, rows, cols) -> the same shape, about U V^T of each block
        return newton_schulz(u, self.ns_steps, self.ns_dtype)

    def update(self, i, lr, clip_coef):
        """One owned matrix: p <- (1 - lr wd) p - lr x scale x O (decoupled weight decay)."""
        p, g, k = self.params[i], self._view(self.own, i).mul_(clip_coef), self.parts[i]
        m = self.momentum_buf[i]
        o = muon_update(g, m, self.momentum, self.nesterov, k, self.orthogonalize)
        scale = update_scale(p.size(0) // k, p.size(1), self.scale)
        p.mul_(1 - lr * self.weight_decay).add_(o, alpha=-lr * scale)
        self.flops += self.ns_steps * ns_flops(p.shape, k)

    @torch.no_grad()
    def step(self, lr, clip_coef=1.0):
        """The owners' half: update each owned matrix (the others wait for all_gather_params)."""
        for i in self.mine:
            self.update(i, lr, clip_coef)
        self.stats = {"muon_lr": lr, "momentum": self.momentum}

    @torch.no_grad()
    def all_gather_params(self):
        """Every rank receives every updated matrix from its owner (its slab), copies others in."""
        if self.world == 1 or not self.slab:
            return
        for i in self.mine:
            self._view(self.own, i).copy_(self.params[i])
        all_gather(self.flat, self.own, self.comm)
        for i, p in enumerate(self.params):
            if self.owner[i] != self.rank:
                p.copy_(self._view(self.flat, i, self.owner[i] * self.slab))


def all_reduce_grads(params, loss_sum, world, comm):
    """Average the AdamW parameters' gradients and the step's loss over ranks in one all-reduce."""
    if world == 1:
        return loss_sum
    grads = [p.grad.reshape(-1) for p in params]
    flat = torch.cat(grads + [loss_sum.reshape(1).float()])  # (n_adamw + 1,)
    all_reduce(flat, comm)
    flat /= world
    for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))
    return flat[-1]


def split_params(model, optimizer):
    """(Muon's block matrices, their parts: 3 for c_attn's q, k, v as modded-nanogpt, the AdamW
    parameters)."""
    named = []
    if optimizer == "muon":
        named = [(n, p) for b in model.h for n, p in b.named_parameters() if p.dim() == 2]
    ids = {id(p) for _, p in named}
    parts = [3 if n == "attn.c_attn.weight" else 1 for n, _ in named]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    return [p for _, p in named], parts, rest


def make_muon(args, model, params, parts, ctx, comm, cls=Muon):  # --naive: one-rank Muon everywhere
    lr = args.muon_lr
    if lr is None:
        lr = 0.02 if args.muon_scale == "original" else args.lr
    return cls(params, parts, lr=lr, weight_decay=args.muon_weight_decay, momentum=args.momentum,
                nesterov=args.nesterov, ns_steps=args.ns_steps, scale=args.muon_scale,
                ns_dtype=ctx.dtype, comm=comm,  # the run's dtype: fp32 runs are exact on a GPU too
                rank=0 if args.naive else ctx.rank, world=1 if args.naive else ctx.world)


def stable_rank(X):  # ||X||_F^2 / ||X||_2^2 of each block, averaged: how many directions carry it
    s = torch.linalg.svdvals(X.float())  # (parts, min(rows, cols))
    return ((s ** 2).sum(-1) / s[:, 0] ** 2).mean().item()


@torch.no_grad()
def update_spread(muon, names):
    """The payoff on the last step's state: the largest owned matrix's momentum u (the direction an
    SGD step would follow) and Muon's update NS5(u), by their stable ranks: u is carried by a few
    directions, NS5(u) by nearly all (every singular value about 1)."""
    i = max(muon.mine, key=lambda i: muon.params[i].numel())
    p, k = muon.params[i], muon.parts[i]
    u = muon.momentum_buf[i].view(k, p.size(0) // k, p.size(1))  # (parts, rows, cols)
    return names[i], {"momentum_stable_rank": stable_rank(u),
                      "update_stable_rank": stable_rank(muon.orthogonalize(u)),
                      "directions": min(p.size(0) // k, p.size(1))}


def train(args, make_muon=make_muon):
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    vocab = gpt2.model_config(args).vocab_size
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, vocab)  # the data fits?
    ctx = gpt2.setup(args)
    model = gpt2.build_model(args).to(ctx.device)
    cfg = model.config
    comm, timeline = gpt2.CommMeter(), gpt2.Timeline(ctx)
    muon_params, parts, adamw_params = split_params(model, args.optimizer)
    muon = make_muon(args, model, muon_params, parts, ctx, comm) if muon_params else None
    matrices = [p for p in adamw_params if p.dim() >= 2]
    vectors = [p for p in adamw_params if p.dim() < 2]
    adamw = gpt2.make_adamw([{"params": matrices, "weight_decay": args.weight_decay},
                             {"params": vectors, "weight_decay": 0.0}], args, ctx.device)
    fwd = torch.compile(model) if args.compile else model
    tokens = args.batch_size * args.seq_len * args.grad_accum * ctx.world
    metrics = gpt2.Metrics(args, ctx, cfg, model.num_params(), tokens)
    profiler = gpt2.Profiler(args, ctx)

    def loss_fn(x, y):
        with ctx.autocast():
            return fwd(x, y)[1]

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        timeline.start_step(step)
        lr = gpt2.set_lr(adamw, step, args)
        with timeline.compute("forward + backward"):
            loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)
        t0 = timeline.now()
        if muon and args.naive and ctx.world > 1:
            naive_all_reduce(muon_params, ctx.world, comm)
        if muon:  # the owners' half of the all-reduce: each gets its matrices' mean gradient
            muon.reduce_grads()
        timeline.comm_span("Muon grads", t0, "all_reduce" if args.naive else "reduce_scatter")
        t0 = timeline.now()
        loss_sum = all_reduce_grads(adamw_params, loss_sum, ctx.world, comm)
        timeline.comm_span("AdamW grads all-reduce", t0, "all_reduce")
        clip = 1.0
        with timeline.compute("clip + AdamW step"):
            # ||g|| of ALL parameters, as on one rank: Muon's part global, AdamW's replicated
            sq = sum((p.grad.float().square().sum() for p in adamw_params),
                     muon.grad_sq_norm() if muon else torch.zeros((), device=ctx.device))
            norm = sq.sqrt()
            if args.grad_clip > 0:
                clip = (args.grad_clip / (norm + 1e-6)).clamp(max=1.0)  # a tensor: no host sync
                torch._foreach_mul_([p.grad for p in adamw_params], clip)
            adamw.step()
        if muon:  # Muon rides AdamW's warmup + cosine schedule; owners update, then the all-gather
            what = f"owner {ctx.rank}: Newton-Schulz"
            what = "Newton-Schulz, every matrix" if args.naive else what
            with timeline.compute(what):
                muon.step(muon.lr * lr / args.lr, clip)
            t0 = timeline.now()
            muon.all_gather_params()  # --naive: world=1, nothing to gather
            timeline.comm_span(f"owner {ctx.rank} gather", t0, "all_gather")
        model.zero_grad(set_to_none=True)
        loss_val, norm_val = torch.stack([loss_sum, norm]).tolist()  # the step's one host sync
        gpt2.check_finite(loss_val, step)
        metrics.log_step(step, loss_val, lr, comm_mb=comm.take_mb(), grad_norm=norm_val,
                         **(muon.stats if muon else {}))
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
    gpt2.check_finite_weights(model.parameters(), args.steps - 1)  # every rank, before any write
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, model.state_dict())
    metrics.plot()
    timeline.save(os.path.join(args.out, "timeline.png"), "one Muon step: compute (upper bar), "
                  "collectives (lower)")
    every = sum(args.ns_steps * ns_flops(p.shape, k) for p, k in zip(muon_params, parts)) / 1e9
    mine = muon.flops / args.steps / 1e9 if muon else 0.0
    print0(f"saved {args.out} | Newton-Schulz per step: {mine:.4f} GFLOP on rank 0, {every:.4f} "
           f"for every matrix (what --naive runs on every rank)")
    figures = {"ns_gflop_rank0": mine, "ns_gflop_every_matrix": every}
    if muon:
        names = [n for n, p in model.named_parameters() if any(p is q for q in muon_params)]
        name, spread = update_spread(muon, names)
        figures.update(spread)
        print0(f"Muon's update of {name}: stable rank {spread['momentum_stable_rank']:.1f} for "
               f"the momentum u, {spread['update_stable_rank']:.1f} for NS5(u), of "
               f"{spread['directions']} directions")
    metrics.log_summary(figures)
    return metrics.records  # gpt2.run_main destroys the process group


MUON_FLAGS = ("naive", "muon_lr", "muon_weight_decay", "momentum", "nesterov", "ns_steps",
              "muon_scale")  # what acts on Muon alone


def make_parser():
    p = gpt2.make_parser("Train GPT-2 with Muon on the block matrices (--muon-*) and AdamW "
                         "(--lr) on the rest.")
    a = p.add_argument
    a("--optimizer", default="muon", choices=["muon", "adamw"], help="muon = Muon + AdamW; adamw = "
      "AdamW only")
    a("--naive", action="store_true", help="the naive version: all-reduce every gradient, "
      "every rank runs every NS")
    a("--muon-lr", type=float, help="Muon's peak lr, on --lr's schedule (default 0.02; --lr with "
      "match_rms_adamw)")
    a("--muon-weight-decay", type=float, default=0.0, help="Muon's decoupled weight decay, "
      "p *= 1 - muon_lr * wd")
    a("--momentum", type=float, default=0.95, help="Muon's momentum")
    a("--nesterov", action=argparse.BooleanOptionalAction, default=True, help="Nesterov momentum")
    a("--ns-steps", type=int, default=5, help="Newton-Schulz iterations")
    a("--muon-scale", default="original", choices=["original", "match_rms_adamw"],
      help="Jordan's, or Moonlight 2.2's")
    return p


def refuse_idle_flags(args, parser, flags=MUON_FLAGS):
    """--optimizer adamw trains no matrix with Muon: a Muon flag there would do nothing."""
    idle = [f for f in flags if getattr(args, f) != parser.get_default(f)]
    if args.optimizer == "adamw" and idle:
        flag = "--no-nesterov" if idle[0] == "nesterov" else "--" + idle[0].replace("_", "-")
        gpt2.fail(f"{flag} with --optimizer adamw: no matrix is trained by Muon", flag,
                  "drop it, or use --optimizer muon")


def main(argv=None):  # the core alone: its flags, Muon (or --naive); cli() adds extensions
    parser = make_parser()
    args = parser.parse_args(argv)
    gpt2.check_args(args)  # before the first collective: a bad flag fails every rank, none hangs
    refuse_idle_flags(args, parser)
    return train(args)


# ---- Beyond the core ----
# Each extension is a subclass of Muon that overrides one method, or a wrapper around the optimizer; the
# appendix's cli() picks them with plain ifs. Measured side by side: `python tests/bench_muon.py experiment`.


# Polar Express (Amsel et al. 2025): a different quintic at each step, each the minimax-optimal one for the
# interval the singular values are known to be in after the steps before, so the band shrinks towards 1:
# singular values of G/||G||_F in [2e-3, 1] land in [0.85, 1.15] after 5 fp32 steps (tested). These are NOT
# the paper's published list: they are modded-nanogpt's coefficients, made with the paper's algorithm for a
# cushion of 0.02 and inputs scaled by 1/(1.02 ||G||_F) (safety 1.02, for bf16), the 1.02 folded into step 1.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))


def polar_express(G, steps=5, dtype=None):
    """newton_schulz with Polar Express's per-step quintics (at most its 5 published steps)."""
    if steps > len(POLAR_EXPRESS):
        raise ValueError(f"Polar Express has {len(POLAR_EXPRESS)} published steps, asked for {steps}")
    (a, b, c), rest = POLAR_EXPRESS[0], POLAR_EXPRESS[1:steps]
    return newton_schulz(G, dtype=dtype, coefficients=[(a / 1.02, b / 1.02 ** 3, c / 1.02 ** 5), *rest])


class PolarExpress(Muon):
    """--ns-coefficients polar_express: Polar Express instead of the one quintic (modded-nanogpt)."""

    def orthogonalize(self, u):
        return polar_express(u, self.ns_steps, self.ns_dtype)


class Bf16Gather(Muon):
    """bf16 runs on several ranks: the updated matrices travel in bf16, (N-1)/N x S/2 instead of S (modded-nanogpt).
    The owner keeps its fp32 master; the others hold bf16-rounded copies, all their bf16 autocast forward reads
    (it rounds the owner's copy the same way). The last of `steps` gathers is fp32: every rank saves the masters."""

    def __init__(self, *a, steps, **k):
        super().__init__(*a, **k)
        self.gathers_left = steps
        self.own16 = torch.zeros(self.slab, device=self.flat.device, dtype=torch.bfloat16)  # (slab,)
        self.flat16 = torch.zeros(self.world * self.slab, device=self.flat.device, dtype=torch.bfloat16)  # (N x slab,)

    @torch.no_grad()
    def all_gather_params(self):
        self.gathers_left -= 1
        if self.world == 1 or not self.slab or self.gathers_left == 0:
            return super().all_gather_params()  # fp32
        for i in self.mine:
            self._view(self.own16, i).copy_(self.params[i])
        all_gather(self.flat16, self.own16, self.comm)
        for i, p in enumerate(self.params):
            if self.owner[i] != self.rank:
                p.copy_(self._view(self.flat16, i, self.owner[i] * self.slab))


class PolarExpressBf16Gather(PolarExpress, Bf16Gather):
    """Both: Polar Express's orthogonalize, Bf16Gather's all_gather_params (each overrides its own method)."""


def momentum_at(step, warmup, final):
    """The speedrun's momentum warmup: 0.85 -> final linearly over `warmup` steps, then constant."""
    frac = min(step / warmup, 1.0) if warmup else 1.0
    return (1 - frac) * 0.85 + frac * final


class MomentumWarmup:
    """--momentum-warmup N: a schedule for Muon's momentum, 0.85 up to --momentum over N steps (modded-nanogpt),
    set before each step as torch's LR schedulers set a param group's lr. Everything else is the optimizer's."""

    def __init__(self, muon, warmup):
        self.muon, self.warmup, self.final, self.t = muon, warmup, muon.momentum, 0

    def __getattr__(self, name):  # reduce_grads, grad_sq_norm, all_gather_params, lr, stats, flops
        return getattr(self.muon, name)

    def step(self, lr, clip_coef=1.0):
        self.muon.momentum = momentum_at(self.t, self.warmup, self.final)
        self.t += 1
        self.muon.step(lr, clip_coef)


# QK-clip, the logit cap of MuonClip (Kimi K2 report, section 2.1; MuonClip also carries Moonlight's update
# scale and weight decay: --muon-scale match_rms_adamw --muon-weight-decay 0.1). Muon lets attention logits
# grow until a head's softmax saturates. After each step, every head whose largest logit of the step exceeded
# tau has its query and key rows scaled by sqrt(tau / max), so that logit comes out at tau next time. Kimi
# K2's attention has no q, k biases; GPT-2's has, scaled with their rows: every logit of the head scales by
# exactly tau / max (tested). Each rank scales its copy before the owners' all-gather: the owner's is sent.


class MaxLogitProbe:
    """Each head's largest pre-softmax logit q.k/sqrt(d) of the training forwards since the last take():
    S_max in Kimi K2's notation. A forward hook on c_attn recomputes q k^T (causal part) from its output:
    the flash-attention kernel never materialises the logits. Shape (n_layer, n_head)."""

    def __init__(self, model):
        cfg = model.config
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.max = torch.full((cfg.n_layer, cfg.n_head), float("-inf"), device=model.wte.weight.device)
        for layer, block in enumerate(model.h):
            block.attn.c_attn.register_forward_hook(lambda mod, inp, out, layer=layer: self.record(layer, mod, out))

    @torch.no_grad()
    def record(self, layer, module, qkv):
        if not module.training:  # evaluation forwards do not count
            return
        B, T, _ = qkv.shape
        q, k, _ = qkv.detach().float().chunk(3, dim=-1)  # (B, T, C) each
        q, k = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k))  # (B, H, T, D)
        future = torch.ones(T, T, dtype=torch.bool, device=qkv.device).triu(1)
        for b in range(B):  # one sequence at a time: (H, T, T) logits, never (B, H, T, T)
            logits = (q[b] @ k[b].mT) * self.head_dim ** -0.5
            self.max[layer] = torch.maximum(self.max[layer], logits.masked_fill(future, float("-inf")).amax(dim=(1, 2)))

    @torch.no_grad()
    def take(self, world, comm):
        """The step's S_max over all ranks' micro-batches (one small all-reduce MAX), and a reset."""
        s_max = self.max.clone()
        if world > 1:
            all_reduce(s_max, comm, dist.ReduceOp.MAX)
        self.max.fill_(float("-inf"))
        return s_max


def qk_clip_factors(s_max, tau, head_dim):
    """(n_layer, 3C) row factors for c_attn: sqrt(tau / S_max) on the q and k rows of each head above tau
    (> 0), 1 elsewhere, also for negative or -inf maxima; v rows untouched. Kimi K2 splits the factor evenly
    (alpha = 0.5) between W_q and W_k."""
    gamma = torch.where(s_max > tau, (tau / s_max).sqrt(), torch.ones_like(s_max))  # (L, H)
    qk = gamma.repeat_interleave(head_dim, dim=1)  # (L, C): one factor per q (or k) row
    return torch.cat([qk, qk, torch.ones_like(qk)], dim=1)


class QKClip:
    """--qk-clip TAU: QK-clip after each Muon step; --log-max-logit (TAU = 0): only log the step's max logit.
    Wraps the optimizer: its step, then the scaling; everything else is the optimizer's."""

    def __init__(self, muon, model, tau):
        self.muon, self.model, self.tau, self.probe = muon, model, tau, MaxLogitProbe(model)

    def __getattr__(self, name):  # reduce_grads, grad_sq_norm, all_gather_params, lr, world, comm, flops
        return getattr(self.muon, name)

    @torch.no_grad()
    def step(self, lr, clip_coef=1.0):
        s_max = self.probe.take(self.world, self.comm)  # (n_layer, n_head), the same on every rank
        self.muon.step(lr, clip_coef)
        self.stats = {**self.muon.stats, "max_logit": s_max.max().item()}
        if self.tau:  # c_attn's q, k rows: the weights (Muon's; the owner's copy is gathered) and biases (AdamW's)
            factors = qk_clip_factors(s_max, self.tau, self.probe.head_dim)  # (n_layer, 3C)
            for block, f in zip(self.model.h, factors):
                block.attn.c_attn.weight.mul_(f[:, None])
                block.attn.c_attn.bias.mul_(f)
            self.stats["clipped_heads"] = int((s_max > self.tau).sum())


# ---- Appendix ----
# Bytes each rank sends per step for the Muon matrices, S their fp32 bytes, N ranks (ring; measured = closed
# form by tests/bench_muon.py and test_distributed_muon_equals_one_rank):
#     this file (reduce-scatter + all-gather)                     2(N-1)/N x S  (+ padding of unequal slabs)
#     --naive (all-reduce of each matrix)                         2(N-1)/N x S, Newton-Schulz on all N ranks
#     KellerJordan/Muon behind DDP (all-reduce + all-gather)      3(N-1)/N x S
#     Moonlight 2.3 (ZeRO-1 rows; gather momentum, gather params) 3(N-1)/N x S, Newton-Schulz on all N ranks
#     torch.optim.Muon behind DDP (all-reduce)                    2(N-1)/N x S, Newton-Schulz on all N ranks
# Memory per rank: 4 B params + 4 B grads of every parameter + 8 B AdamW state of its parameters + 4 B
# momentum of the owned matrices + fp32 buffers of N slabs and one slab. GPT-2 124M: tests/README.md.
# References: K. Jordan et al. 2024, kellerjordan.github.io/posts/muon, github.com/KellerJordan/Muon; J. Liu
# et al., "Muon is Scalable for LLM Training" (arXiv 2502.16982), 2.2 (update scale), 2.3 (ZeRO-1 Muon);
# modded-nanogpt and nanochat (whole-matrix owners, Polar Express coefficients, momentum warmup); Kimi Team,
# "Kimi K2" (arXiv 2507.20534), 2.1 (MuonClip, QK-clip); N. Amsel et al., "The Polar Express" (2505.16932).


def make_extended_muon(args, model, params, parts, ctx, comm):
    """The core's make_muon with the class the flags pick, then the wrappers they switch on. No extension flag
    and an fp32 run (or one rank): the core's Muon."""
    polar = args.ns_coefficients == "polar_express"
    bf16 = ctx.dtype == torch.bfloat16 and ctx.world > 1  # bf16 runs on several ranks gather in bf16
    if args.qkv == "packed":  # c_attn orthogonalised as one 3E x E matrix
        parts = [1] * len(params)
    if polar and bf16:
        cls = functools.partial(PolarExpressBf16Gather, steps=args.steps)
    elif bf16:
        cls = functools.partial(Bf16Gather, steps=args.steps)
    elif polar:
        cls = PolarExpress
    else:
        cls = Muon
    muon = make_muon(args, model, params, parts, ctx, comm, cls)
    if ctx.world > 1:
        padding = ctx.world * muon.slab - sum(p.numel() for p in params)
        print0(f"Muon shares: rank 0 owns {len(muon.mine)} matrices, slab {muon.slab} floats, padding {padding} "
               f"({100 * padding / max(1, ctx.world * muon.slab):.1f}% of the reduce-scatter), {type(muon).__name__}")
    if args.momentum_warmup:
        muon = MomentumWarmup(muon, args.momentum_warmup)
    if args.qk_clip or args.log_max_logit:
        muon = QKClip(muon, model, args.qk_clip)
    return muon


def add_extension_flags(p):
    a = p.add_argument
    a("--momentum-warmup", type=int, default=0, help="raise Muon's momentum linearly from 0.85 to --momentum over "
      "this many steps (the speedrun: 300); 0 = constant")
    a("--ns-coefficients", default="quintic", choices=["quintic", "polar_express"],
      help="one quintic (3.4445, -4.7750, 2.0315) every step (Jordan), or modded-nanogpt's Polar Express "
      "per-step quintics (at most 5 steps)")
    a("--qkv", default="split", choices=["split", "packed"],
      help="orthogonalise c_attn's q, k, v blocks separately (split: they are three maps, as in modded-nanogpt; "
      "measured 5.69 vs 5.74 val loss after 300 tiny steps, for 7%% more Newton-Schulz FLOPs) or as one 3E x E matrix")
    a("--qk-clip", type=float, default=0.0, metavar="TAU", help="QK-clip (Kimi K2, the logit cap of MuonClip): after "
      "each step scale the q and k rows of every head whose max attention logit exceeded TAU (Kimi K2: 100); 0 = off")
    a("--log-max-logit", action="store_true", help="log the step's largest attention logit (max_logit in metrics.jsonl)")


def check_args(args, world):
    """Every check that can fail runs here, on every rank, before the process group exists."""
    cfg = gpt2.model_config(args)
    gpt2.check_args(args)
    lr = args.muon_lr if args.muon_lr is not None else 0.02 if args.muon_scale == "original" else args.lr
    if not 0 < lr <= 10:
        gpt2.fail(f"--muon-lr is {lr}", "--muon-lr", "give a learning rate in (0, 10] (Muon's usual: 0.02)")
    gpt2.check_range(args.muon_weight_decay, "--muon-weight-decay", 0, 1 / lr,
                     f"give 0 (off) up to 1/--muon-lr = {1 / lr:g} (p *= 1 - lr x wd stays >= 0)")
    gpt2.check_range(args.momentum, "--momentum", 0, 1 - 1e-9, "give a value in [0, 1), e.g. 0.95")
    gpt2.check_range(args.momentum_warmup, "--momentum-warmup", 0, math.inf, "give 0 (off) or a number of steps")
    gpt2.check_range(args.ns_steps, "--ns-steps", 1, 100, "give 1 to 100 Newton-Schulz steps (5 is usual)")
    if args.ns_coefficients == "polar_express" and args.ns_steps > len(POLAR_EXPRESS):
        gpt2.fail(f"--ns-steps {args.ns_steps} with Polar Express", "--ns-steps",
                  f"Polar Express has {len(POLAR_EXPRESS)} published steps: give at most that many")
    gpt2.check_range(args.qk_clip, "--qk-clip", 0, math.inf, "give 0 (off) or a logit bound such as 100")
    if (args.qk_clip or args.log_max_logit) and args.optimizer != "muon":
        gpt2.fail("--qk-clip/--log-max-logit with --optimizer adamw", "--qk-clip/--log-max-logit",
                  "the logit probe rides on Muon's step: use them with --optimizer muon")
    if (args.qk_clip or args.log_max_logit) and args.compile:
        gpt2.fail("--qk-clip/--log-max-logit with --compile", "--qk-clip/--log-max-logit",
                  "the max-logit probe is an eager forward hook on c_attn: drop --compile for these runs")
    extensions = [f for f, on in (("--momentum-warmup", args.momentum_warmup), ("--qk-clip", args.qk_clip),
                                  ("--log-max-logit", args.log_max_logit), ("--qkv packed", args.qkv == "packed"),
                                  ("--ns-coefficients", args.ns_coefficients != "quintic")) if on]
    if args.naive and extensions:
        gpt2.fail(f"--naive with {', '.join(extensions)}", "--naive", "the naive version is the core alone: drop one")
    n_matrices = 4 * cfg.n_layer if args.optimizer == "muon" else 0
    if world > n_matrices and n_matrices:
        print0(f"note: {world} ranks but {n_matrices} Muon matrices: {world - n_matrices} ranks own none")


def cli(argv=None):
    """The whole command line: the core's flags and the extensions', checked before any collective; the
    core's loop with the optimizer the flags pick (make_extended_muon; --naive: the core's make_muon)."""
    p = make_parser()
    add_extension_flags(p)
    args = p.parse_args(argv)
    check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    refuse_idle_flags(args, p, MUON_FLAGS + ("momentum_warmup", "ns_coefficients", "qkv"))
    return train(args, make_muon if args.naive else make_extended_muon)


if __name__ == "__main__":
    gpt2.run_main(cli)
