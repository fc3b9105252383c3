"""
muon.py - Muon (MomentUm Orthogonalized by Newton-schulz) for the matrices inside the blocks, AdamW for
everything else, trained data-parallel with the matrices' optimizer work split across ranks.

The idea. Adam scales each coordinate of the gradient on its own; Muon treats a weight matrix as what it
is, a linear map. It keeps a Nesterov momentum M of the gradient and replaces it by the nearest
semi-orthogonal matrix, O = U V^T for M = U S V^T, before stepping: every direction the matrix maps gets
the same step size, so rare directions (small singular values, which Adam barely moves) learn as fast
as dominant ones. An SVD per step is too slow, so O comes from five steps of a Newton-Schulz iteration,
a few bf16 matmuls on the tensor cores. Muon is only meant for hidden 2-D matrices: the embedding, the
head, biases and LayerNorm gains stay on AdamW (Jordan et al. 2024; Liu et al. 2025, section 2).

Distributed Muon. Newton-Schulz needs the WHOLE matrix, so we cannot shard each matrix like ZeRO does.
Instead the gradient all-reduce of plain data parallelism is split in its two halves, and each rank does
the optimizer work of the whole matrices it owns in between:

    rank 0          rank 1                    each rank computes grads of ALL params on its rows
    [c_attn.0 g]    [c_attn.0 g]
    [c_fc.0   g]    [c_fc.0   g]      reduce-scatter  ->  rank 0 holds summed grads of the matrices
    [c_proj.1 g]    [c_proj.1 g]      (one flat         it owns (c_attn.0, c_proj.1), rank 1 of its
    [  ...    ]     [  ...    ]        buffer)          own (c_fc.0, ...): ownership balances NS FLOPs
          |               |
    momentum + Newton-Schulz + step    on owned matrices only (momentum buffers are sharded too)
          |               |
    all-gather the updated matrices   ->  every rank holds every matrix again
    embeddings, head, biases, LN: all-reduced grads, AdamW replicated on every rank

Lineage. This is whole-matrix ownership as modded-nanogpt's speedrun and nanochat's DistMuon run it:
reduce-scatter the gradients, orthogonalise what you own, all-gather the parameters. Keller Jordan's Muon
repository owns whole matrices too, but behind DDP's all-reduce, so each rank first receives every
gradient it then ignores. Moonlight (Liu et al. 2025, section 2.3) is different: it starts from ZeRO-1's
row shards, all-gathers the momentum so every rank of the data-parallel group orthogonalises every full
matrix (redundant NS work), keeps its own rows, and all-gathers the parameters. Bytes each rank sends per
step for the Muon matrices, S their fp32 bytes, N ranks (ring model; each measured = its closed form by
tests/bench_muon.py, torchrun table and --per-rank-124m; ours also in test_distributed_muon_equals_one_rank):

    this file (reduce-scatter + all-gather)            2(N-1)/N x S   (+ the padding of unequal shares)
    KellerJordan/Muon under DDP (all-reduce + gather)   3(N-1)/N x S
    Moonlight 2.3 (reduce-scatter + gather momentum + gather params)   3(N-1)/N x S, and NS on all N ranks
    torch.optim.Muon under DDP (all-reduce only)        2(N-1)/N x S, and NS on all N ranks

So Muon's extra compute is divided by N for the bytes of plain data parallelism. In a bf16 run the
updated matrices travel in bf16: (N-1)/N x S + (N-1)/N x S/2 = 1.5(N-1)/N x S (the owner keeps the fp32
master; the other ranks' bf16 copies are exactly what their autocast forward would round to).

GPT-2 124M at 8 ranks, per rank (`python tests/bench_muon.py --per-rank-124m`: fake process group, meta
device; measured = closed form). Muon matrices S = 84.9M params = 339.7 MB fp32; the owner slabs are
balanced by Newton-Schulz FLOPs, not bytes, so 8 slabs = 358.6 MB (5.6% padding). AdamW: 39.5M params.
    bytes per step  904.4 MB = AdamW all-reduce 2(7/8) 158.2 MB (276.8) + Muon 2(7/8) 358.6 MB (627.6)
                    bf16 run 747.5 MB (the gather in bf16: 313.8 + 156.9); KellerJordan/Muon 1168.6 MB
                    (ddp.py's all-reduce of all 497.9 MB: 871.3, + its unpadded all-gather 7/8 x 339.7: 297.2)
    memory          params 497.9 + grads 497.9 + optimizer 358.8 (AdamW 2 x 4 B x 39.5M = 316.3, momentum
                    of the ~10.6M owned Muon params 42.5; ddp.py's AdamW on everything: 995.8) = 1354.6 MB,
                    + 403.4 MB communication buffers (the 8-slab flat buffer 358.6 + own slab 44.8)
    activations     8821 MB at B=16, T=1024, bf16 autocast (measured per sequence at B=1,2; as ddp.py)

Uses from gpt2.py: make_parser/check_args/fail, model_config/build_model, make_loaders, setup, make_adamw,
set_lr, accumulate_grads, evaluate, check_finite, CommMeter, Metrics, Profiler, reduce_scatter_single,
all_gather_single, run_main.

Beyond the references (each off by default, measured in `tests/bench_muon.py experiment`):
--qk-clip TAU is Kimi K2's QK-clip (after a step whose max attention logit of a head exceeded TAU, scale
that head's W_q and W_k rows by sqrt(TAU / max)); all of MuonClip is QK-clip with Moonlight's update scale
and weight decay, here --muon-scale match_rms_adamw --muon-weight-decay 0.1, --ns-coefficients polar_express the Polar Express
per-step quintics, --momentum-warmup N the speedrun's 0.85 -> 0.95 momentum ramp. Muon's weight decay
is its own flag, --muon-weight-decay (0, as in reference Muon); --weight-decay is AdamW's alone.
Measured (tiny, 2 x 64 wide, T=32, B=4, 300 steps, AdamW 3e-3, Muon 0.02; val loss at step 300, mean +- std
of 3 seeds): default 6.693 +- 0.009; --momentum-warmup 100 6.664 +- 0.015 (better at every evaluation);
polar_express 6.692 +- 0.020 (band [0.85, 1.15] vs [0.68, 1.21], no gain this short); muon wd 0.1
6.690 +- 0.026 (no gain, weights and peak logit smaller: 8.6 vs 10.9). --qk-clip 5.21 (half the default's
peak, seed 1): peak logit 6.07 vs 10.43, val 6.695 vs 6.698.
The README's experiment (tiny, T=64, B=8, 300 steps, one seed): Muon weight decay 0 (now the default)
ends at val 5.686, 0.1 (the earlier default, through --weight-decay) at 5.692.

Launch (the learning rates are the ones tuned for the tiny model on tinyshakespeare, see the README):
    python muon.py --data D --lr 3e-3                        # Muon at 0.02 on the blocks, AdamW at 3e-3 on the rest
    torchrun --nproc_per_node=2 muon.py --data D --lr 3e-3 --batch-size 4   # the same curve, two ranks
    python muon.py --data D --optimizer adamw --lr 1e-3      # the AdamW-only baseline, same loop
    torchrun --nproc_per_node=8 muon.py --model gpt2 --data data/fineweb10B --batch-size 16 \\
        --grad-accum 4 --seq-len 1024 --lr 6e-4 --compile      # on GPUs: bf16 autocast, NS in bf16
    python muon.py --data D --lr 3e-3 --qk-clip 5 --log-max-logit   # QK-clip; max_logit per step in metrics.jsonl
    python tests/bench_muon.py experiment --data D          # the flags side by side, 3 seeds -> table + max_logit.png

References: K. Jordan et al., "Muon: an optimizer for hidden layers in neural networks" (2024 blog post,
kellerjordan.github.io/posts/muon) and github.com/KellerJordan/Muon; J. Liu et al., "Muon is Scalable
for LLM Training" (Moonlight, arXiv 2502.16982): section 2.2 (update RMS matching 0.2*sqrt(max(A,B))),
section 2.3 (their ZeRO-1 distributed Muon, contrasted above); github.com/KellerJordan/modded-nanogpt and
github.com/karpathy/nanochat (the ownership design used here, Polar Express, momentum warmup); Kimi Team,
"Kimi K2: Open Agentic Intelligence" (arXiv 2507.20534), section 2.1 (MuonClip, of which --qk-clip is the QK-clip part); Amsel et al., "The Polar
Express" (arXiv 2505.16932); Bernstein & Newhouse 2024, "Old optimizer, new norm" (why orthogonalise).
"""
import argparse
import math
import os

import torch
import torch.distributed as dist

import gpt2
from gpt2 import all_gather_single, print0, reduce_scatter_single

# ----------------------------------------------------------------------------------------------------
# Newton-Schulz orthogonalisation

# One step maps each singular value s of X (in [0, 1] after normalising) through p(s) = a s + b s^3 + c s^5
# and keeps the singular vectors. The classic cubic (1.5, -0.5) converges to 1 but slowly near 0. These
# quintic coefficients (Jordan 2024) maximise the slope at zero (a = 3.4445, so small singular values grow
# ~3.4x per step) under the constraint that the iterate stays in a band around 1 instead of converging
# exactly: after 5 fp32 steps every singular value of G/||G||_F in [2e-3, 1] lands in [0.68, 1.21] (the scalar
# map, tested over 24 seeds), which trains as well as exact U V^T; smaller ones (square matrices) end lower.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel et al. 2025, arXiv 2505.16932): a different quintic at each step, each the minimax-optimal
# one for the interval the singular values are known to lie in after the previous steps, so the band shrinks
# towards 1 step by step: singular values of G/||G||_F in [2e-3, 1] land in [0.85, 1.15] after 5 fp32 steps
# (tested). These are NOT the paper's published list: they are modded-nanogpt's speedrun coefficients, made
# with the paper's algorithm for cushion 0.02 and inputs scaled by 1/(1.02 ||X||_F) (safety 1.02, bf16).
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))


def ns_schedule(name, steps):
    """(a, b, c) for each of `steps` Newton-Schulz steps, and the safety factor of the input scaling."""
    if name == "quintic":
        return [NS_COEFFICIENTS] * steps, 1.0
    if name == "polar_express":
        if steps > len(POLAR_EXPRESS):
            raise ValueError(f"Polar Express has {len(POLAR_EXPRESS)} published steps, asked for {steps}")
        return list(POLAR_EXPRESS[:steps]), 1.02
    raise ValueError(f"unknown Newton-Schulz coefficients {name!r}: use quintic or polar_express")


def newton_schulz(G, steps=5, dtype=None, eps=1e-7, coefficients="quintic"):
    """Approximately U V^T for G = U S V^T (a matrix or a batch of them, (..., rows, cols)), returned in
    G's dtype. Runs in bf16 on CUDA (the iteration is self-correcting, tensor cores make it cheap) and
    fp32 elsewhere unless `dtype` says otherwise. coefficients: quintic (Jordan) or polar_express."""
    schedule, safety = ns_schedule(coefficients, steps)
    dtype = dtype or (torch.bfloat16 if G.is_cuda else torch.float32)
    X = G.to(dtype).reshape(-1, *G.shape[-2:])  # a batch of matrices, (k, rows, cols)
    tall = G.size(-2) > G.size(-1)
    if tall:  # work with the wide orientation so the Gram matrix X X^T is the small (min x min) one
        X = X.mT
    # the Frobenius norm bounds the spectral norm, so this puts every singular value in [0, 1]
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * safety).clamp(min=eps)
    for a, b, c in schedule:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2, one fused kernel
        X = torch.baddbmm(X, B, X, beta=a)  # (a + b XX^T + c (XX^T)^2) X: odd polynomial in the singular values
    if tall:
        X = X.mT
    return X.reshape(G.shape).to(G.dtype)


def update_scale(rows, cols, mode):
    """Step multiplier for an orthogonalised (rows x cols) update, whose entries have RMS 1/sqrt(max(rows, cols)).
    'original' (Jordan): sqrt(max(1, rows/cols)), so tall matrices are not under-stepped.
    'match_rms_adamw' (Moonlight, section 2.2): 0.2 sqrt(max(rows, cols)) gives the update an RMS of 0.2,
    like a typical AdamW update, so AdamW's learning rate and weight decay carry over."""
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


# ----------------------------------------------------------------------------------------------------
# Distributed Muon: each rank owns whole matrices


class Muon:
    """Muon on a list of 2-D parameters, the optimizer work split by whole matrices over `world` ranks.

    parts[i] = 3 orthogonalises parameter i as three stacked row blocks (GPT-2's packed q, k, v).
    Per step: reduce_scatter_grads() -> (clip with grad_sq_norm()) -> step(lr, clip_coef).
    With world = 1 there is no communication and it is plain Muon. gather_dtype=torch.bfloat16 sends the
    updated matrices in bf16 (half the bytes): the owner keeps its fp32 master copy, the other ranks hold
    bf16-rounded copies, which is all a bf16 autocast forward reads (it rounds the owner's copy the same way)."""

    def __init__(self, params, parts=None, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5,
                 scale="original", ns_dtype=None, ns_coefficients="quintic", gather_dtype=torch.float32,
                 rank=0, world=1, comm=None):
        self.params = list(params)
        self.parts = list(parts or [1] * len(self.params))
        for p, k in zip(self.params, self.parts):
            if p.dim() != 2 or p.size(0) % k:
                raise ValueError(f"Muon needs 2-D parameters whose rows split in {k}; got shape {tuple(p.shape)}")
        self.lr, self.weight_decay, self.momentum, self.nesterov = lr, weight_decay, momentum, nesterov
        self.ns_steps, self.scale, self.ns_dtype, self.ns_coefficients = ns_steps, scale, ns_dtype, ns_coefficients
        self.rank, self.world, self.comm = rank, world, comm or gpt2.CommMeter()
        update_scale(1, 1, scale)  # reject a bad mode now, not at the first step
        ns_schedule(ns_coefficients, ns_steps)

        # Layout: one flat buffer of world equal slabs; slab r holds rank r's matrices back to back, padded
        # to the largest share, so one reduce-scatter / all-gather moves them all.
        self.owner = assign_owners([ns_flops(p.shape, k) for p, k in zip(self.params, self.parts)], world)
        used, self.offset = [0] * world, []
        for p, r in zip(self.params, self.owner):
            self.offset.append(used[r])
            used[r] += p.numel()
        self.slab = max(used) if self.params else 0
        self.padding = sum(self.slab - u for u in used)  # elements sent that are not parameters
        self.mine = [i for i, r in enumerate(self.owner) if r == rank]
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.flat = torch.zeros(world * self.slab, device=dev)  # all grads in (fp32), all updated params out
        self.own = self.flat[rank * self.slab:(rank + 1) * self.slab] if world == 1 else torch.zeros(self.slab, device=dev)
        self.gather_dtype = gather_dtype
        if world > 1 and gather_dtype != torch.float32:  # the params go out in their own, narrower buffers
            self.send = torch.zeros(self.slab, device=dev, dtype=gather_dtype)
            self.recv = torch.zeros(world * self.slab, device=dev, dtype=gather_dtype)
        else:  # fp32: the slab that brought the grads in carries the updated params out
            self.send, self.recv = self.own, self.flat
        self.momentum_buf = {i: torch.zeros_like(self.params[i]) for i in self.mine}

    def _view(self, buf, i, base=0):
        p = self.params[i]
        return buf[base + self.offset[i]: base + self.offset[i] + p.numel()].view_as(p)

    @torch.no_grad()
    def reduce_scatter_grads(self):
        """Sum the ranks' gradients so each rank ends up with the mean gradient of its own matrices."""
        for i, p in enumerate(self.params):
            self._view(self.flat, i, self.owner[i] * self.slab).copy_(p.grad)
        if self.world > 1 and self.slab:
            reduce_scatter_single(self.own, self.flat)
            self.own /= self.world
            self.comm.reduce_scatter(self.flat.numel() * self.flat.element_size(), self.world)

    def grad_sq_norm(self):
        """Sum of squares of the owned (already reduced) gradients: summed over ranks it is the squared norm
        of all the Muon gradients, each counted once."""
        return sum((self._view(self.own, i).float().square().sum() for i in self.mine), torch.zeros((), device=self.own.device))

    @torch.no_grad()
    def step(self, lr=None, clip_coef=1.0, momentum=None, row_scale=None):
        """One Muon step on the owned matrices, then the all-gather. momentum overrides self.momentum (warmup);
        row_scale {matrix index: (rows,) factors} multiplies rows after the update (QK-clip), on the owner."""
        lr = self.lr if lr is None else lr
        momentum = self.momentum if momentum is None else momentum
        for i in self.mine:
            p, k, g = self.params[i], self.parts[i], self._view(self.own, i)
            g.mul_(clip_coef)
            # Nesterov momentum as an EMA (same update direction as M = mu M + g, g + mu M; NS removes the scale)
            buf = self.momentum_buf[i]
            buf.lerp_(g, 1 - momentum)
            u = g.lerp(buf, momentum) if self.nesterov else buf
            rows, cols = p.size(0) // k, p.size(1)
            o = newton_schulz(u.view(k, rows, cols), self.ns_steps, self.ns_dtype, coefficients=self.ns_coefficients)
            p.mul_(1 - lr * self.weight_decay)  # decoupled weight decay (Loshchilov & Hutter), as torch does
            p.add_(o.view_as(p), alpha=-lr * update_scale(rows, cols, self.scale))
            if row_scale is not None and i in row_scale:
                p.mul_(row_scale[i][:, None])
            if self.world > 1:
                self._view(self.send, i).copy_(p)  # the owned slab now carries the updated parameters
        self.all_gather_params()

    @torch.no_grad()
    def all_gather_params(self, full_precision=False):
        """Every rank receives every updated matrix. full_precision: send fp32 even when gather_dtype is
        narrower (once, before saving, so every rank's copy equals the owner's master)."""
        if self.world == 1 or not self.slab:
            return
        send, recv = self.send, self.recv
        if full_precision and self.gather_dtype != torch.float32:
            send, recv = self.own, self.flat
            for i in self.mine:
                self._view(send, i).copy_(self.params[i])
        all_gather_single(recv, send)
        self.comm.all_gather(recv.numel() * recv.element_size(), self.world)
        for i, p in enumerate(self.params):
            if self.owner[i] != self.rank:
                p.copy_(self._view(recv, i, self.owner[i] * self.slab))


# ----------------------------------------------------------------------------------------------------
# QK-clip (the logit cap of MuonClip, Kimi K2 technical report, section 2.1): Muon lets attention logits grow until a head's
# softmax saturates and the loss spikes. After each step, for every head whose largest logit of the step
# exceeded tau, scale its query and key rows by sqrt(tau / max), so that logit comes out at tau next time.
# Kimi K2's attention has no q, k biases; GPT-2's has, and they are scaled with their rows, so every logit
# of the head scales by exactly tau / max (tested). The owner scales its fp32 matrix before the all-gather.


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
            dist.all_reduce(s_max, op=dist.ReduceOp.MAX)
            comm.all_reduce(s_max.numel() * s_max.element_size(), world)
        self.max.fill_(float("-inf"))
        return s_max


def qk_clip_factors(s_max, tau, head_dim):
    """(n_layer, 3C) row factors for c_attn: sqrt(tau / S_max) on the q and k rows of each head above tau,
    1 elsewhere (v rows untouched). Kimi K2 splits the factor evenly (alpha = 0.5) between W_q and W_k."""
    # only heads above tau (> 0) are scaled; a negative or -inf maximum (all logits below zero) keeps factor 1
    gamma = torch.where(s_max > tau, (tau / s_max).sqrt(), torch.ones_like(s_max))  # (L, H)
    qk = gamma.repeat_interleave(head_dim, dim=1)  # (L, C): one factor per q (or k) row
    return torch.cat([qk, qk, torch.ones_like(qk)], dim=1)


# ----------------------------------------------------------------------------------------------------
# Data-parallel plumbing for the AdamW parameters (and the loss)


@torch.no_grad()
def all_reduce_grads(params, loss_sum, world, comm):
    """Average the AdamW parameters' gradients and the step's loss over ranks in one flat all-reduce."""
    if world == 1:
        return loss_sum
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss_sum.reshape(1).float()])
    dist.all_reduce(flat)
    flat /= world
    comm.all_reduce(flat.numel() * flat.element_size(), world)
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
        dist.all_reduce(sq)
        comm.all_reduce(sq.element_size(), world)
    sq = sq + sum(p.grad.float().square().sum() for p in adamw_params)
    return (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # a tensor: no GPU->CPU sync inside the step


def split_params(model, optimizer):
    """Muon takes the 2-D matrices inside the blocks; embeddings/head (tied), biases and LayerNorm go to AdamW."""
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


# ----------------------------------------------------------------------------------------------------
# Training loop (mirrors gpt2.train step for step)


def momentum_at(step, args):
    """Muon's momentum at a step: the speedrun's warmup 0.85 -> 0.95 over its first 300 steps, or constant."""
    if args.momentum_warmup == 0:
        return args.momentum
    frac = min(step / args.momentum_warmup, 1.0)
    return (1 - frac) * 0.85 + frac * args.momentum


def main(argv=None):
    args = make_parser().parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cfg = validate(args, world)
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, cfg.vocab_size)  # checks the data fits
    ctx = gpt2.setup(args)
    model = gpt2.build_model(args).to(ctx.device)
    comm = gpt2.CommMeter()
    muon_params, parts, adamw_params = split_params(model, args.optimizer)
    if args.qkv == "packed":
        parts = [1] * len(muon_params)
    # bf16 runs send the updated matrices in bf16: what every rank's autocast forward reads anyway
    gather_dtype = torch.bfloat16 if ctx.dtype == torch.bfloat16 else torch.float32
    muon = Muon(muon_params, parts, lr=args.muon_lr, weight_decay=args.muon_weight_decay, momentum=args.momentum,
                nesterov=args.nesterov, ns_steps=args.ns_steps, scale=args.muon_scale,
                ns_coefficients=args.ns_coefficients, gather_dtype=gather_dtype,
                rank=ctx.rank, world=ctx.world, comm=comm) if muon_params else None
    adamw = gpt2.make_adamw([{"params": [p for p in adamw_params if p.dim() >= 2], "weight_decay": args.weight_decay},
                             {"params": [p for p in adamw_params if p.dim() < 2], "weight_decay": 0.0}], args, ctx.device)
    probe = MaxLogitProbe(model) if args.qk_clip or args.log_max_logit else None
    index = {id(p): i for i, p in enumerate(muon_params)}
    c_attn = [index.get(id(block.attn.c_attn.weight)) for block in model.h]  # Muon's index of each layer's W_qkv
    fwd = torch.compile(model) if args.compile else model
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * ctx.world
    metrics = gpt2.Metrics(args, ctx, cfg, model.num_params(), tokens_per_step)
    profiler = gpt2.Profiler(args, ctx)
    n_muon = sum(p.numel() for p in muon_params)
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | {ctx.world} ranks | "
           f"Muon {n_muon / 1e6:.2f}M params in {len(muon_params)} matrices, AdamW {sum(p.numel() for p in adamw_params) / 1e6:.2f}M")
    if muon and ctx.world > 1:
        print0(f"Muon shares: rank 0 owns {len(muon.mine)} matrices, slab {muon.slab} floats, padding {muon.padding} "
               f"({100 * muon.padding / max(1, ctx.world * muon.slab):.1f}% of the reduce-scatter), gathered in {gather_dtype}")

    def loss_fn(x, y):
        with ctx.autocast():
            return fwd(x, y)[1]

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(adamw, step, args)
        muon_lr = args.muon_lr * lr / args.lr  # Muon rides the same warmup + cosine schedule
        momentum = momentum_at(step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)
        extra, factors = {}, None
        if probe:
            s_max = probe.take(ctx.world, comm)  # (n_layer, n_head), the same on every rank
            extra["max_logit"] = s_max.max().item()
            if args.qk_clip:
                factors = qk_clip_factors(s_max, args.qk_clip, cfg.n_embd // cfg.n_head)  # (n_layer, 3C)
                extra["clipped_heads"] = int((s_max > args.qk_clip).sum())
        if muon:
            muon.reduce_scatter_grads()
        loss_sum = all_reduce_grads(adamw_params, loss_sum, ctx.world, comm)
        clip = 1.0
        if args.grad_clip > 0:
            clip = clip_coefficient(muon, adamw_params, args.grad_clip, ctx.world, comm)
            torch._foreach_mul_([p.grad for p in adamw_params], clip)
        adamw.step()
        if muon:  # momentum + Newton-Schulz on owned matrices (+ QK-clip of W_q, W_k rows), then all-gather
            muon.step(muon_lr, clip, momentum, row_scale=None if factors is None else dict(zip(c_attn, factors)))
        if factors is not None:
            with torch.no_grad():  # the q, k biases (AdamW's, replicated) scale with their rows, so q.k scales exactly
                for block, f in zip(model.h, factors):
                    block.attn.c_attn.bias.mul_(f)
        model.zero_grad(set_to_none=True)
        loss_val = loss_sum.item()
        gpt2.check_finite(loss_val, step)
        metrics.log_step(step, loss_val, lr, comm_mb=comm.take_mb(), muon_lr=muon_lr if muon else None,
                         momentum=momentum if muon else None, **extra)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
    if muon and gather_dtype != torch.float32:
        muon.all_gather_params(full_precision=True)  # bf16 runs: every rank's copy becomes the owner's fp32 master
    gpt2.check_finite_weights(model.parameters(), args.steps - 1)  # every rank, before anything is written
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, model.state_dict())
    metrics.plot()
    print0(f"saved {args.out}/model.pt and {args.out}/loss.png")
    return metrics.records  # gpt2.run_main destroys the process group


# ====================================================================================================
# Appendix: argument checks and the command line
# ====================================================================================================


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
      help="one quintic (3.4445, -4.7750, 2.0315) every step (Jordan), or Polar Express's per-step quintics (at most 5 steps)")
    a("--muon-scale", default="original", choices=["original", "match_rms_adamw"],
      help="update scale: sqrt(max(1,rows/cols)) (Jordan) or 0.2*sqrt(max(rows,cols)) (Moonlight)")
    a("--qkv", default="split", choices=["split", "packed"],
      help="orthogonalise c_attn's q, k, v blocks separately (split: they are three maps, as in modded-nanogpt; "
      "measured 5.69 vs 5.74 val loss after 300 tiny steps, for 7%% more Newton-Schulz FLOPs) or as one 3E x E matrix")
    a("--qk-clip", type=float, default=0.0, metavar="TAU", help="QK-clip (Kimi K2, part of MuonClip): after each step scale the q and k "
      "rows of every head whose max attention logit exceeded TAU (Kimi K2: 100); 0 = off")
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
    if args.qk_clip and args.optimizer != "muon":
        gpt2.fail("--qk-clip with --optimizer adamw", "--qk-clip", "QK-clip acts on Muon's matrices: use it with --optimizer muon")
    if (args.qk_clip or args.log_max_logit) and args.compile:
        gpt2.fail("--qk-clip/--log-max-logit with --compile", "--qk-clip/--log-max-logit",
                  "the max-logit probe is an eager forward hook on c_attn: drop --compile for these runs")
    n_matrices = 4 * cfg.n_layer if args.optimizer == "muon" else 0
    if world > n_matrices and n_matrices:
        print0(f"note: {world} ranks but {n_matrices} Muon matrices: {world - n_matrices} ranks own none")
    return cfg


if __name__ == "__main__":
    gpt2.run_main(main)
