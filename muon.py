"""
muon.py - Muon (MomentUm Orthogonalized by Newton-schulz) on the matrices inside the blocks, AdamW on the
rest, trained data-parallel with each matrix's optimizer work done by one owner rank.

The idea. Adam scales each coordinate of the gradient on its own; Muon treats a weight matrix as a linear
map. It keeps a Nesterov momentum M of the gradient and steps along the nearest semi-orthogonal matrix,
O = U V^T for M = U S V^T: every direction the matrix maps moves by the same amount, so rare directions
(small singular values, which Adam barely moves) learn as fast as dominant ones. Five Newton-Schulz steps,
a few matmuls, approximate O. Only hidden 2-D matrices use it: embeddings, head, biases and LayerNorm stay
on AdamW. Newton-Schulz needs the WHOLE matrix, so instead of sharding each matrix (ZeRO) we split data
parallelism's all-reduce in its two halves and let one rank own each whole matrix in between:

    rank 0          rank 1           each rank: gradients of ALL parameters on its rows of the batch
    [c_attn.0 g]    [c_attn.0 g]     reduce-scatter one flat buffer of N slabs (slab r: rank r's matrices)
    [c_fc.0   g]    [c_fc.0   g]       -> rank 0 holds the mean grads of c_attn.0, c_proj.1; rank 1 of c_fc.0
    [c_proj.1 g]    [c_proj.1 g]     owner: momentum + Newton-Schulz + step (momentum lives with the owner)
         |               |           all-gather the updated matrices -> every rank holds every matrix again
    AdamW parameters: all-reduced gradients, AdamW replicated. Owners balance Newton-Schulz FLOPs.

Bytes each rank sends per step for the Muon matrices, S their fp32 bytes, N ranks (ring; measured = closed
form by tests/bench_muon.py and test_distributed_muon_equals_one_rank):
    this file (reduce-scatter + all-gather)                     2(N-1)/N x S  (+ padding of unequal slabs)
    KellerJordan/Muon behind DDP (all-reduce + all-gather)      3(N-1)/N x S
    Moonlight 2.3 (ZeRO-1 rows; gather momentum, gather params) 3(N-1)/N x S, Newton-Schulz on all N ranks
    torch.optim.Muon behind DDP (all-reduce)                    2(N-1)/N x S, Newton-Schulz on all N ranks
Memory per rank: 4 B params + 4 B grads of every parameter + 8 B AdamW state of its parameters + 4 B
momentum of the owned matrices + fp32 buffers of N slabs and one slab. GPT-2 124M: tests/README.md.

    python muon.py --data D --lr 3e-3            # Muon at 0.02 on the blocks, AdamW at 3e-3 on the rest
    torchrun --nproc_per_node=2 muon.py --data D --lr 3e-3 --batch-size 4   # the same curve, two ranks

References: K. Jordan et al. 2024, kellerjordan.github.io/posts/muon, github.com/KellerJordan/Muon; J. Liu
et al., "Muon is Scalable for LLM Training" (arXiv 2502.16982), 2.2 (update scale), 2.3 (ZeRO-1 Muon);
modded-nanogpt and nanochat (whole-matrix owners, Polar Express coefficients, momentum warmup); Kimi Team,
"Kimi K2" (arXiv 2507.20534), 2.1 (MuonClip, QK-clip); N. Amsel et al., "The Polar Express" (2505.16932).
Uses from gpt2.py: make_parser, check_args, check_range, fail, model_config, build_model, make_loaders,
setup, make_adamw, set_lr, accumulate_grads, evaluate, check_finite(_weights), save_model, CommMeter,
Metrics, Profiler, run_main.
"""
import argparse
import math
import os

import torch
import torch.distributed as dist

import gpt2
from gpt2 import all_gather_single, print0, reduce_scatter_single

# One Newton-Schulz step maps each singular value s of X through p(s) = a s + b s^3 + c s^5, singular vectors
# kept. Jordan's quintic maximises the slope at 0 (small singular values grow ~3.4x a step) and settles in a
# band around 1 instead of at 1: 5 fp32 steps take every singular value of G/||G||_F in [2e-3, 1] into
# [0.68, 1.21] (the scalar map; tested over 24 seeds), which trains as well as U V^T. Smaller ones end lower.
QUINTIC = (3.4445, -4.7750, 2.0315)


def newton_schulz(G, steps=5, dtype=None, coefficients=None, eps=1e-7):
    """About U V^T for G = U S V^T, (..., rows, cols), returned in G's dtype; bf16 on CUDA (tensor cores; the
    iteration corrects its own rounding), fp32 elsewhere. coefficients: (a, b, c) per step, default QUINTIC."""
    dtype = dtype or (torch.bfloat16 if G.is_cuda else torch.float32)
    X = G.to(dtype).reshape(-1, *G.shape[-2:])  # (k, rows, cols)
    tall = G.size(-2) > G.size(-1)
    if tall:  # the wide orientation: the Gram matrix X X^T is the small (min x min) one
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # ||X||_2 <= ||X||_F: singular values in [0, 1]
    for a, b, c in coefficients or [QUINTIC] * steps:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2, one fused kernel
        X = torch.baddbmm(X, B, X, beta=a)  # (a + b XX^T + c (XX^T)^2) X: odd polynomial in the singular values
    return (X.mT if tall else X).reshape(G.shape).to(G.dtype)


def muon_update(grad, momentum, beta=0.95, nesterov=True, parts=1, orthogonalize=newton_schulz):
    """Muon's direction for one matrix, before its scale: the momentum buffer is updated in place (the EMA
    form of M = beta M + g: same direction, Newton-Schulz removes the scale), the Nesterov look-ahead, then
    orthogonalised as `parts` stacked row blocks (GPT-2's packed q, k, v are three maps)."""
    momentum.lerp_(grad, 1 - beta)
    u = grad.lerp(momentum, beta) if nesterov else momentum
    return orthogonalize(u.view(parts, grad.size(0) // parts, grad.size(1))).view_as(grad)


def update_scale(rows, cols, mode):
    """Step multiplier for an orthogonalised (rows x cols) update, whose entries have RMS 1/sqrt(max(rows, cols)).
    'original' (Jordan): sqrt(max(1, rows/cols)), so tall matrices are not under-stepped.
    'match_rms_adamw' (Moonlight 2.2): 0.2 sqrt(max(rows, cols)), an update RMS of 0.2 like AdamW's."""
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown Muon scale {mode!r}: use original or match_rms_adamw")


def ns_flops(shape, parts=1):
    """Matmul FLOPs of one Newton-Schulz step on a (rows x cols) matrix orthogonalised as `parts` row
    blocks: with m = min, n = max side, X X^T costs 2 m^2 n, A A 2 m^3, B X 2 m^2 n."""
    m, n = sorted((shape[0] // parts, shape[1]))
    return parts * (4 * m * m * n + 2 * m ** 3)


def assign_owners(costs, world):
    """Give each matrix to one rank so the ranks' Newton-Schulz work is balanced: largest first to the
    least-loaded rank (Graham's LPT rule, within 4/3 of the best split). Deterministic on every rank."""
    load, owner = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + costs[i]
    return owner


class Muon:
    """Muon on a list of 2-D parameters, each matrix updated by one owner rank (world = 1: plain Muon).
    parts[i] = 3 orthogonalises parameter i as three stacked row blocks. Per step: reduce_scatter_grads(),
    (grad_sq_norm() for the clip), step(lr, clip_coef); finish() once before saving."""

    def __init__(self, params, parts=None, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5,
                 scale="original", ns_dtype=None, rank=0, world=1, comm=None):
        self.params = list(params)
        self.parts = list(parts or [1] * len(self.params))
        for p, k in zip(self.params, self.parts):
            if p.dim() != 2 or p.size(0) % k:
                raise ValueError(f"Muon needs 2-D parameters whose rows split in {k}; got shape {tuple(p.shape)}")
        self.lr, self.weight_decay, self.momentum, self.nesterov = lr, weight_decay, momentum, nesterov
        self.ns_steps, self.scale, self.ns_dtype = ns_steps, scale, ns_dtype
        self.rank, self.world, self.comm = rank, world, comm or gpt2.CommMeter()
        update_scale(1, 1, scale)  # reject a bad mode now, not at the first step
        # One flat buffer of `world` equal slabs; slab r holds rank r's matrices back to back, padded to the
        # largest share, so one reduce-scatter brings the gradients in and one all-gather the matrices out.
        self.owner = assign_owners([ns_flops(p.shape, k) for p, k in zip(self.params, self.parts)], world)
        used, self.offset = [0] * world, []
        for p, r in zip(self.params, self.owner):
            self.offset.append(used[r])
            used[r] += p.numel()
        self.slab = max(used) if self.params else 0
        self.padding = sum(self.slab - u for u in used)  # elements sent that are not parameters
        self.mine = [i for i, r in enumerate(self.owner) if r == rank]
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.flat = torch.zeros(world * self.slab, device=dev)  # (N x slab,) fp32: all grads in, all params out
        self.own = self.flat[:self.slab] if world == 1 else torch.zeros(self.slab, device=dev)
        self.send, self.recv = self.own, self.flat  # the slab that brought my grads in carries my params out
        self.momentum_buf = {i: torch.zeros_like(self.params[i]) for i in self.mine}
        self.stats = {}  # numbers the loop logs after each step

    def _view(self, buf, i, base=0):
        p = self.params[i]
        return buf[base + self.offset[i]: base + self.offset[i] + p.numel()].view_as(p)

    @torch.no_grad()
    def reduce_scatter_grads(self):
        """Each rank ends up with the mean gradient of the matrices it owns."""
        for i, p in enumerate(self.params):
            self._view(self.flat, i, self.owner[i] * self.slab).copy_(p.grad)
        if self.world > 1 and self.slab:
            reduce_scatter(self.own, self.flat, self.comm)
            self.own /= self.world

    def grad_sq_norm(self):
        """Sum of squares of the owned (reduced) gradients; summed over ranks, each matrix counted once."""
        return sum((self._view(self.own, i).float().square().sum() for i in self.mine), torch.zeros((), device=self.own.device))

    def orthogonalize(self, u):  # (parts, rows, cols) -> the same shape, about U V^T of each block
        return newton_schulz(u, self.ns_steps, self.ns_dtype)

    def update(self, i, lr, clip_coef):
        """One owned matrix: p <- (1 - lr wd) p - lr x scale x O (decoupled weight decay, as torch.optim.Muon)."""
        p, g = self.params[i], self._view(self.own, i).mul_(clip_coef)
        o = muon_update(g, self.momentum_buf[i], self.momentum, self.nesterov, self.parts[i], self.orthogonalize)
        p.mul_(1 - lr * self.weight_decay)
        p.add_(o, alpha=-lr * update_scale(p.size(0) // self.parts[i], p.size(1), self.scale))

    @torch.no_grad()
    def step(self, lr=None, clip_coef=1.0):
        lr = self.lr if lr is None else lr
        for i in self.mine:
            self.update(i, lr, clip_coef)
            if self.world > 1:
                self._view(self.send, i).copy_(self.params[i])
        self.all_gather_params()
        self.stats = {"muon_lr": lr, "momentum": self.momentum}

    @torch.no_grad()
    def all_gather_params(self):
        """Every rank receives every updated matrix from its owner."""
        if self.world == 1 or not self.slab:
            return
        all_gather(self.recv, self.send, self.comm)
        for i, p in enumerate(self.params):
            if self.owner[i] != self.rank:
                p.copy_(self._view(self.recv, i, self.owner[i] * self.slab))

    def finish(self):
        """Before saving: every rank already holds the owner's matrices (an extension may override this)."""


# Data-parallel plumbing for the AdamW parameters (and the loss)


@torch.no_grad()
def all_reduce_grads(params, loss_sum, world, comm):
    """Average the AdamW parameters' gradients and the step's loss over ranks in one flat all-reduce."""
    if world == 1:
        return loss_sum
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss_sum.reshape(1).float()])
    all_reduce(flat, comm)
    flat /= world
    pos = 0
    for p in params:
        p.grad.copy_(flat[pos: pos + p.numel()].view_as(p))
        pos += p.numel()
    return flat[-1]


@torch.no_grad()
def clip_coefficient(muon, adamw_params, max_norm, world, comm):
    """max_norm / ||g|| (at most 1) over ALL parameters, as clip_grad_norm_ computes it on one rank: the
    Muon part lives sharded (one all-reduce of a scalar), the AdamW part is replicated."""
    sq = muon.grad_sq_norm() if muon else torch.zeros((), device=adamw_params[0].device)
    if muon and world > 1:
        all_reduce(sq, comm)
    sq = sq + sum(p.grad.float().square().sum() for p in adamw_params)
    return (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # a tensor: no GPU->CPU sync inside the step


def split_params(model, optimizer):
    """Muon takes the 2-D matrices inside the blocks; embeddings/head (tied), biases and LayerNorm go to AdamW.
    parts: 3 for c_attn (q, k, v are three maps, as in modded-nanogpt), 1 for the others."""
    if optimizer == "adamw":
        return [], [], [p for p in model.parameters() if p.requires_grad]
    muon, parts = [], []
    for block in model.h:
        for name, p in block.named_parameters():
            if p.dim() == 2:
                muon.append(p)
                parts.append(3 if name == "attn.c_attn.weight" else 1)
    ids = {id(p) for p in muon}
    return muon, parts, [p for p in model.parameters() if p.requires_grad and id(p) not in ids]


# The training loop: gpt2.train step for step, with the Muon matrices' all-reduce split around their update


def main(argv=None):
    args = make_parser().parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cfg = validate(args, world)
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, cfg.vocab_size)  # checks the data fits
    ctx = gpt2.setup(args)
    model = gpt2.build_model(args).to(ctx.device)
    comm = gpt2.CommMeter()
    muon_params, parts, adamw_params = split_params(model, args.optimizer)
    # Muon(muon_params, parts, lr=--muon-lr, momentum=--momentum, ...), or it with the extensions' subclasses
    muon = make_muon(args, model, muon_params, parts, ctx, comm) if muon_params else None
    adamw = gpt2.make_adamw([{"params": [p for p in adamw_params if p.dim() >= 2], "weight_decay": args.weight_decay},
                             {"params": [p for p in adamw_params if p.dim() < 2], "weight_decay": 0.0}], args, ctx.device)
    fwd = torch.compile(model) if args.compile else model
    metrics = gpt2.Metrics(args, ctx, cfg, model.num_params(), args.batch_size * args.seq_len * args.grad_accum * ctx.world)
    profiler = gpt2.Profiler(args, ctx)
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | {ctx.world} ranks | Muon "
           f"{sum(p.numel() for p in muon_params) / 1e6:.2f}M params in {len(muon_params)} matrices, AdamW "
           f"{sum(p.numel() for p in adamw_params) / 1e6:.2f}M")

    def loss_fn(x, y):
        with ctx.autocast():
            return fwd(x, y)[1]

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(adamw, step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)
        if muon:
            muon.reduce_scatter_grads()
        loss_sum = all_reduce_grads(adamw_params, loss_sum, ctx.world, comm)
        clip = 1.0
        if args.grad_clip > 0:
            clip = clip_coefficient(muon, adamw_params, args.grad_clip, ctx.world, comm)
            torch._foreach_mul_([p.grad for p in adamw_params], clip)
        adamw.step()
        if muon:  # Muon rides AdamW's warmup + cosine schedule; owners update, then the all-gather
            muon.step(muon.lr * lr / args.lr, clip)
        model.zero_grad(set_to_none=True)
        loss_val = loss_sum.item()
        gpt2.check_finite(loss_val, step)
        metrics.log_step(step, loss_val, lr, comm_mb=comm.take_mb(), **(muon.stats if muon else {}))
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
    if muon:
        muon.finish()
    gpt2.check_finite_weights(model.parameters(), args.steps - 1)  # every rank, before anything is written
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, model.state_dict())
    metrics.plot()
    print0(f"saved {args.out}/model.pt and {args.out}/loss.png")
    return metrics.records  # gpt2.run_main destroys the process group


# ---- Beyond the core ----
# Each extension is a subclass of Muon, switched on by its flag in make_muon (appendix); several combine by
# multiple inheritance. Measured side by side by `python tests/bench_muon.py experiment` (tests/README.md).


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


def momentum_at(step, warmup, final):
    """The speedrun's momentum warmup: 0.85 -> final linearly over `warmup` steps, then constant."""
    frac = min(step / warmup, 1.0) if warmup else 1.0
    return (1 - frac) * 0.85 + frac * final


class MomentumWarmup(Muon):
    """--momentum-warmup N: Muon's momentum from 0.85 up to --momentum over N steps (modded-nanogpt)."""

    def __init__(self, *a, momentum_warmup=0, **k):
        super().__init__(*a, **k)
        self.warmup, self.final, self.t = momentum_warmup, self.momentum, 0

    def step(self, lr=None, clip_coef=1.0):
        self.momentum = momentum_at(self.t, self.warmup, self.final)
        self.t += 1
        super().step(lr, clip_coef)


class Bf16Gather(Muon):
    """bf16 runs: the updated matrices travel in bf16, (N-1)/N x S/2 instead of S (modded-nanogpt). The owner
    keeps its fp32 master; the others hold bf16-rounded copies, all their bf16 autocast forward reads (it
    rounds the owner's copy the same way). finish() sends fp32 once, so every rank saves the master."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        if self.world > 1:
            self.send = torch.zeros(self.slab, device=self.flat.device, dtype=torch.bfloat16)
            self.recv = torch.zeros(self.world * self.slab, device=self.flat.device, dtype=torch.bfloat16)

    @torch.no_grad()
    def finish(self):
        self.send, self.recv = self.own, self.flat
        for i in self.mine:
            self._view(self.own, i).copy_(self.params[i])
        self.all_gather_params()


# QK-clip, the logit cap of MuonClip (Kimi K2 report, section 2.1; MuonClip also carries Moonlight's update
# scale and weight decay: --muon-scale match_rms_adamw --muon-weight-decay 0.1). Muon lets attention logits
# grow until a head's softmax saturates. After each step, every head whose largest logit of the step exceeded
# tau has its query and key rows scaled by sqrt(tau / max), so that logit comes out at tau next time. Kimi
# K2's attention has no q, k biases; GPT-2's has, scaled with their rows: every logit of the head scales by
# exactly tau / max (tested). The owner scales its fp32 matrix before the all-gather.


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


class QKClip(Muon):
    """--qk-clip TAU: QK-clip after each step; --log-max-logit (TAU = 0): only log the step's max logit."""

    def __init__(self, *a, model=None, tau=0.0, **k):
        super().__init__(*a, **k)
        self.model, self.tau, self.probe, self.factors = model, tau, MaxLogitProbe(model), None
        index = {id(p): i for i, p in enumerate(self.params)}
        self.c_attn = {index[id(b.attn.c_attn.weight)]: layer for layer, b in enumerate(model.h)}  # Muon index -> layer

    @torch.no_grad()
    def update(self, i, lr, clip_coef):
        super().update(i, lr, clip_coef)
        if self.factors is not None and i in self.c_attn:
            self.params[i].mul_(self.factors[self.c_attn[i]][:, None])

    @torch.no_grad()
    def step(self, lr=None, clip_coef=1.0):
        s_max = self.probe.take(self.world, self.comm)  # (n_layer, n_head), the same on every rank
        self.factors = qk_clip_factors(s_max, self.tau, self.probe.head_dim) if self.tau else None
        super().step(lr, clip_coef)
        self.stats["max_logit"] = s_max.max().item()
        if self.factors is not None:  # the q, k biases (AdamW's, replicated) scale with their rows
            for block, f in zip(self.model.h, self.factors):
                block.attn.c_attn.bias.mul_(f)
            self.stats["clipped_heads"] = int((s_max > self.tau).sum())


# ---- Appendix ----
# The collectives, metered where they are called (gpt2.CommMeter, ring model); Muon with its extensions;
# the command line and its checks.


def all_reduce(t, comm, op=dist.ReduceOp.SUM):
    dist.all_reduce(t, op=op)
    comm.all_reduce(t.numel() * t.element_size(), dist.get_world_size())


def reduce_scatter(out, inp, comm):
    reduce_scatter_single(out, inp)
    comm.reduce_scatter(inp.numel() * inp.element_size(), dist.get_world_size())


def all_gather(out, inp, comm):
    all_gather_single(out, inp)
    comm.all_gather(out.numel() * out.element_size(), dist.get_world_size())


def make_muon(args, model, params, parts, ctx, comm):
    """Muon with the flags' options, as the subclass that combines the extensions switched on."""
    extensions = [cls for cls, on in ((QKClip, args.qk_clip or args.log_max_logit),
                                      (MomentumWarmup, args.momentum_warmup),
                                      (PolarExpress, args.ns_coefficients == "polar_express"),
                                      (Bf16Gather, ctx.dtype == torch.bfloat16 and ctx.world > 1)) if on]
    kw = {}
    if QKClip in extensions:
        kw.update(model=model, tau=args.qk_clip)
    if MomentumWarmup in extensions:
        kw["momentum_warmup"] = args.momentum_warmup
    cls = type("Muon", (*extensions, Muon), {}) if extensions else Muon
    if args.qkv == "packed":
        parts = [1] * len(params)
    muon = cls(params, parts, lr=args.muon_lr, weight_decay=args.muon_weight_decay, momentum=args.momentum,
               nesterov=args.nesterov, ns_steps=args.ns_steps, scale=args.muon_scale, rank=ctx.rank,
               world=ctx.world, comm=comm, **kw)
    if ctx.world > 1:
        print0(f"Muon shares: rank 0 owns {len(muon.mine)} matrices, slab {muon.slab} floats, padding {muon.padding} "
               f"({100 * muon.padding / max(1, ctx.world * muon.slab):.1f}% of the reduce-scatter), gathered in "
               f"{muon.recv.dtype}{' | ' + ', '.join(c.__name__ for c in extensions) if extensions else ''}")
    return muon


def make_parser():
    p = gpt2.make_parser("Train GPT-2 with Muon on the block matrices and AdamW on the rest, data parallel. "
                         "--lr and --weight-decay are AdamW's; Muon has --muon-lr and --muon-weight-decay.")
    a = p.add_argument
    a("--optimizer", default="muon", choices=["muon", "adamw"], help="muon = Muon + AdamW; adamw = AdamW only (the baseline)")
    a("--muon-lr", type=float, help="Muon's peak lr, on the same warmup/cosine schedule as --lr "
      "(default: 0.02 with --muon-scale original, --lr with match_rms_adamw)")
    a("--muon-weight-decay", type=float, default=0.0, help="Muon's decoupled weight decay, p *= 1 - muon_lr * wd "
      "(0 as in reference Muon; Moonlight uses 0.1 with --muon-scale match_rms_adamw)")
    a("--momentum", type=float, default=0.95, help="Muon's momentum")
    a("--momentum-warmup", type=int, default=0, help="raise Muon's momentum linearly from 0.85 to --momentum over "
      "this many steps (the speedrun: 300); 0 = constant")
    a("--nesterov", action=argparse.BooleanOptionalAction, default=True, help="Nesterov momentum for Muon")
    a("--ns-steps", type=int, default=5, help="Newton-Schulz iterations")
    a("--ns-coefficients", default="quintic", choices=["quintic", "polar_express"],
      help="one quintic (3.4445, -4.7750, 2.0315) every step (Jordan), or modded-nanogpt's Polar Express "
      "per-step quintics (at most 5 steps)")
    a("--muon-scale", default="original", choices=["original", "match_rms_adamw"],
      help="update scale: sqrt(max(1,rows/cols)) (Jordan) or 0.2*sqrt(max(rows,cols)) (Moonlight)")
    a("--qkv", default="split", choices=["split", "packed"],
      help="orthogonalise c_attn's q, k, v blocks separately (split: they are three maps, as in modded-nanogpt; "
      "measured 5.69 vs 5.74 val loss after 300 tiny steps, for 7%% more Newton-Schulz FLOPs) or as one 3E x E matrix")
    a("--qk-clip", type=float, default=0.0, metavar="TAU", help="QK-clip (Kimi K2, the logit cap of MuonClip): after "
      "each step scale the q and k rows of every head whose max attention logit exceeded TAU (Kimi K2: 100); 0 = off")
    a("--log-max-logit", action="store_true", help="log the step's largest attention logit (max_logit in metrics.jsonl)")
    return p


def validate(args, world):
    """Every check that can fail runs here, on every rank, before the process group exists."""
    cfg = gpt2.model_config(args)
    if args.muon_lr is None:
        args.muon_lr = 0.02 if args.muon_scale == "original" else args.lr
    gpt2.check_args(args)
    if not args.muon_lr > 0:
        gpt2.fail(f"--muon-lr is {args.muon_lr}", "--muon-lr", "give a positive learning rate (0.02 is Muon's)")
    gpt2.check_range(args.muon_lr, "--muon-lr", 0, 10, "give a positive learning rate (0.02 is Muon's)")
    gpt2.check_range(args.muon_weight_decay, "--muon-weight-decay", 0, 1 / args.muon_lr,
                     f"give 0 (off) up to 1/--muon-lr = {1 / args.muon_lr:g} (p *= 1 - lr x wd stays >= 0)")
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
    n_matrices = 4 * cfg.n_layer if args.optimizer == "muon" else 0
    if world > n_matrices and n_matrices:
        print0(f"note: {world} ranks but {n_matrices} Muon matrices: {world - n_matrices} ranks own none")
    return cfg


if __name__ == "__main__":
    gpt2.run_main(main)
