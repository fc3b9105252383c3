"""
moe_ep.py - a Mixture-of-Experts GPT-2 trained with expert parallelism (EP). Every block's MLP
becomes E expert MLPs and a router sending each token to its top k: E times the MLP's parameters
for k times its FLOPs (Shazeer et al. 2017). Rank r of an EP group of ep ranks (--ep, default: all
ranks) holds experts [r E/ep, (r+1) E/ep) only; the rest is data parallel over all W ranks.

    W = 4, --ep 2, E = 4: rank 0 [e0 e1]   rank 1 [e2 e3]  |  rank 2 [e0 e1]   rank 3 [e2 e3]
    --naive (NaiveMoE):   all-gather the group's tokens ==> each rank runs its experts on all of
                          them (0 where not chosen) ==> reduce-scatter: each token its k outputs
    all-to-all (MoE):     route -> top-k -> sort by expert -> a2a "counts" -> a2a rows "dispatch"
                          ==> experts on the rows that chose them ==> a2a back "combine" -> sum_k
    backward:             the same exchanges transposed: a row's gradient goes back where it came

Who sums what (W ranks; EP groups of ep ranks; W/ep replicas of each expert, one per EP group):
    gradient    summed by                                      over              then
    dense       all_reduce_grads                               all W ranks       / W
    an expert   the backward exchange (every token of its EP   its EP group,     / W
                group that chose it), then all_reduce_grads    then W/ep replicas
    aux loss    f_i from the counts, all-reduced over W; P_i this rank's mean, made the global
                batch's by the / W of the router's gradient: every layout reproduces one process
    clip norm   ||dense||^2 (equal everywhere) + ||experts||^2 summed over the EP group
Host syncs: one .tolist() per MoE layer per micro-step (the all-to-all's splits; --naive: none),
one per step (the log). Below the banners: DeepSeek-V3's options (sigmoid gates, bias balancing,
a shared expert, dispatch by rank, node-limited routing, grouped GEMMs), model.pt, sampling.
Read first: NaiveMoE.forward, plan_dispatch, AllToAll, MoE.forward, all_reduce_grads, train.
    torchrun --nproc_per_node=2 moe_ep.py --data data/shakespeare_char --steps 20 --out out/moe
prints each step's loss (4.2156 at step 0) and routing, and ends (--naive: the same losses, and
`all-gather + reduce-scatter: 25.297 MB per step, closed form 25.297 MB ...`):
    step    19 | loss 3.0403 | norm 1.4267 | lr 1.00e-03 | ...
          moe | aux 0.04824 | drop 0.00% | max/mean load 1.98 | all-to-all 16.890 MB
    all-to-all: 16.796 MB per step, closed form 16.777 MB (all-to-all, uniform routing: ...
References: GShard (2020) sec. 2.2; Switch (2021) sec. 2.2, eq. 4; ST-MoE (2022) sec. 3;
DeepSeek-V3 (2024) sec. 2.1.2.
"""
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpt2
from gpt2 import print0

moved = gpt2.CommMeter()  # bytes of the token exchanges that leave this rank, read every step
comm = gpt2.CommMeter()  # bytes of the all-reduces (gradients, counts, the logged losses)
timeline = gpt2.Timeline(gpt2.Context(0, 1, 0, torch.device("cpu"), torch.float32, True))


def seeded(seed, make):
    """make() under its own seed, global RNG untouched: every layout builds identical experts."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # CPU's only: modules are built on the CPU
        return make()


def keep_within_capacity(expert_idx, num_experts, capacity):
    """Assignment ids sorted by expert, those within `capacity` per expert first (stable: first
    choices, then earlier tokens, GShard 2.2's priority), the rest last; counts per expert before
    and after the cut. Fixed shapes: no host sync."""
    order = torch.argsort(expert_idx, stable=True)
    experts = torch.arange(num_experts, device=expert_idx.device)
    routed = (expert_idx[:, None] == experts).sum(0)  # (E,) a bincount without its host sync
    if capacity is None:
        return order, routed, routed
    first = torch.cumsum(routed, 0) - routed  # where each expert's run starts in `order`
    slot = torch.arange(order.numel(), device=order.device) - first[expert_idx[order]]
    order = order[torch.argsort((slot >= capacity).long(), stable=True)]  # dropped: to the end
    return order, routed, routed.clamp(max=capacity)


class AllGather(torch.autograd.Function):
    """The EP group's rows, rank after rank. Backward: a reduce-scatter (sum): every rank's
    experts used every row, and each rank keeps the gradient of its own rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, n = group, dist.get_world_size(group)
        out = x.new_empty((n * x.size(0), *x.shape[1:]))
        gpt2.all_gather_single(out, x.contiguous(), group=group)
        moved.all_gather(out.nbytes, n)
        return out

    @staticmethod
    def backward(ctx, grad):
        return ReduceScatter.apply(grad, ctx.group), None


class ReduceScatter(torch.autograd.Function):
    """Rank r gets block r of the sum over the EP group. Backward: all-gather the blocks' grads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, n = group, dist.get_world_size(group)
        out = x.new_empty((x.size(0) // n, *x.shape[1:]))
        gpt2.reduce_scatter_single(out, x.contiguous(), group=group)
        moved.reduce_scatter(x.nbytes, n)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllGather.apply(grad, ctx.group), None


class NaiveMoE(nn.Module):
    """Drop-in for gpt2.MLP: (B, T, D) -> (B, T, D), a router and this rank's experts. The naive
    exchange has no routing-dependent sizes (no host sync), but every rank's experts run on the
    whole group's tokens and the reduce-scatter moves k rows per token from every rank."""
    exchange = "all-gather + reduce-scatter"

    def __init__(self, cfg, args, layer, init, ep_rank=0, group=None):
        super().__init__()
        E, ep = args.experts, args.ep  # this rank's experts: [ep_rank * E/ep, (ep_rank+1) * E/ep)
        self.E, self.k, self.cf, self.layer = E, args.top_k, args.capacity_factor, layer
        self.group, self.first, self.stats = group, ep_rank * (E // ep), None
        base = args.seed * 1_000_003 + 1009 * (layer + 1)  # gpt2's init, residual ones / sqrt(2L)
        self.router = seeded(base, lambda: nn.Linear(cfg.n_embd, E, bias=False).apply(init))
        self.experts = nn.ModuleList(seeded(base + 1 + e, lambda: gpt2.MLP(cfg).apply(init))
                                     for e in range(self.first, self.first + E // ep))

    def route(self, h):
        """Top-k experts and gates = their softmax probabilities (GShard 2.2). In fp32 under
        autocast: tiny logit differences flip top-k choices (Switch sec. 2.4)."""
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.router.weight.float())  # (N, E)
        scores = logits.softmax(-1)
        idx = torch.topk(scores, self.k, dim=-1).indices  # (N, k)
        return logits, scores, idx, scores.gather(-1, idx)

    def capacity(self, n_tokens):
        """Switch sec. 2.2: capacity = ceil(C * tokens * k / E) per source rank; C = 0: dropless."""
        return None if self.cf == 0 else math.ceil(self.cf * n_tokens * self.k / self.E)

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)  # (N = B*T, D): every token routes on its own
        N, ep = h.size(0), 1 if self.group is None else dist.get_world_size(self.group)
        logits, scores, idx, gates = self.route(h)
        choice = idx.t().reshape(-1)  # (k*N,) assignment a: choice a // N of token a % N
        order, routed, kept = keep_within_capacity(choice, self.E, self.capacity(N))
        k_n = choice.numel()
        place = torch.empty_like(order).scatter_(0, order, torch.arange(k_n, device=h.device))
        choice = choice.masked_fill(place >= kept.sum(), -1)  # beyond capacity: no expert
        if torch.is_autocast_enabled(h.device.type):  # ship bf16: the experts cast to it anyway
            h = h.to(torch.get_autocast_dtype(h.device.type))
        if ep > 1:  # every rank gets the whole group's tokens and choices, rank after rank
            with timeline.compute(f"layer {self.layer} all-gather", "all_gather"):
                h, choice = AllGather.apply(h, self.group), AllGather.apply(choice, self.group)
        picks = choice.view(ep, self.k, N, 1)  # the expert of each source's k choices
        with timeline.compute(f"layer {self.layer} experts"):  # 0 where a token did not pick e
            y = sum((picks == self.first + e) * expert(h).view(ep, 1, N, D)
                    for e, expert in enumerate(self.experts))  # (ep, k, N, D)
        if ep > 1:  # each source gets its k rows per token, summed over the ranks (one is not 0)
            with timeline.compute(f"layer {self.layer} reduce-scatter", "reduce_scatter"):
                y = ReduceScatter.apply(y.reshape(ep * k_n, D), self.group)
        out = (y.reshape(self.k, N, D) * gates.t().unsqueeze(-1)).sum(0)  # (N, D)
        if self.training:
            self.stats = {"routed": routed, "kept": kept, "P": scores.mean(0),
                          "z": torch.logsumexp(logits, -1).square().mean()}
        return out.view(B, T, D)

    def balance_loss(self, counts, args):
        """Switch eq. 4: alpha*E*sum_i f_i*P_i, f_i the fraction of the GLOBAL batch's choices that
        picked expert i (counts (2, E) summed over all ranks), P_i this rank's mean router
        probability; plus ST-MoE's z-loss."""
        f = counts[0].float() / counts[0].sum()
        return args.aux_coef * self.E * (f * self.stats["P"]).sum() + args.z_loss * self.stats["z"]

    @staticmethod
    def exchange_bytes(args, n_tokens, row_bytes):
        """Closed form per rank and micro-step, N = n_tokens: forward all-gathers (ep-1) N rows
        and (ep-1) k N int64 choices and reduce-scatters (ep-1) k N rows; backward sends the
        rows' gradients the other way (the choices have none)."""
        ep, k, passes = args.ep, args.top_k, 2 if args.activation_checkpointing else 1
        rows = (ep - 1) * n_tokens * (1 + k) * row_bytes
        return passes * (rows + (ep - 1) * k * n_tokens * 8) + rows


def all_to_all(x, in_splits, out_splits, group):
    """Rows x[sum(in_splits[:j]):sum(in_splits[:j+1])] go to rank j of `group`; returns the rows
    received, by source."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    away = sum(in_splits) - in_splits[dist.get_rank(group)]  # rows that leave this rank
    moved.all_to_all(away * math.prod(x.shape[1:]) * x.element_size())
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: a received row's gradient belongs to the rank that sent it, so
    backward is the same exchange with the splits swapped (GShard sec. 2.2: dispatch and combine
    are each other's transpose)."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group):
        ctx.saved = (in_splits, out_splits, group)
        return all_to_all(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits, group = ctx.saved
        return all_to_all(grad, out_splits, in_splits, group), None, None, None


@dataclass
class Plan:
    """What plan_dispatch decided, and what combine_tokens needs to undo it."""
    order: torch.Tensor  # kept assignment ids, sorted by expert (so also by destination rank)
    n_assign: int  # all assignments, kept or dropped: N tokens x k choices
    routed: torch.Tensor  # (E,) assignments per expert before capacity
    kept: torch.Tensor  # (E,) assignments per expert after capacity
    send_splits: list  # rows to each EP rank
    recv_splits: list  # rows from each EP rank
    recv_counts: torch.Tensor  # (ep, E_local): rows from each source rank for each local expert
    expert_rows: list  # rows per local expert, all sources together
    group: object  # the EP group (None: one rank)


# Dispatch, worked on 2 ranks: E = 4 experts, rank 0 holds e0 e1, rank 1 holds e2 e3; top-2;
# rank 0 has N = 3 tokens t0 t1 t2 (rank 1 has its own). Rank 0's router picks t0 -> (e2, e0),
# t1 -> (e1, e2), t2 -> (e3, e0).
#  1. assignments, choice-major: a0..a2 the first choices, a3..a5 the second:
#     expert_idx = [2 1 3 0 2 0].
#  2. order = stable argsort by expert = [a3 a5 | a1 | a0 a4 | a2] (e0 | e1 | e2 | e3); the rows
#     to send are x[order % N] = [t0 t2 | t1 | t0 t1 | t2]. Sorted by expert is sorted by rank:
#     the first 3 rows stay on rank 0, the last 3 go to rank 1: send_splits = [3, 3]. (With a
#     capacity, the assignments beyond it move to the end of `order` and are cut off once the
#     kept counts reach the host.)
#  3. counts exchange: rank 0 sends kept = [2, 1 | 2, 1] (rows for e0 e1 | e2 e3); say rank 1
#     sends it [1, 0] for e0 e1. Rank 0 now knows recv_counts = [[2, 1], [1, 0]] (source x local
#     expert), so recv_splits = [3, 1] and its experts see expert_rows = [3, 1] rows: these
#     three lists are the layer's one .tolist().
#  4. token exchange: rank 0 receives [t0 t2 t1 | s] (from itself: e0 e0 e1; from rank 1: s for
#     e0), by source, then expert. run_experts regroups by expert: eid = [0 0 1 0], regroup =
#     argsort(eid) = [0 1 3 2] -> [t0 t2 s | t1], runs e0 on 3 rows and e1 on 1, and puts the
#     outputs back in received order with the inverse permutation argsort(regroup).
#  5. combine: the reverse exchange (splits swapped) returns to rank 0 its 6 rows in `order`;
#     index_copy writes row i to assignment order[i], so y.view(k, N, D)[c, t] is token t's
#     c-th expert output, which the gates weight and sum. Backward: the same, splits swapped.

def plan_dispatch(x, expert_idx, num_experts, capacity, group):
    """x: (N, D) tokens; expert_idx: (k*N,) the expert of assignment a = token a % N
    (choice-major). Returns the rows to send (one per kept assignment, sorted by expert) and the
    Plan, after the counts exchange."""
    ep = dist.get_world_size(group) if group is not None else 1
    E, E_local, N = num_experts, num_experts // ep, x.size(0)
    order, routed, kept = keep_within_capacity(expert_idx, E, capacity)
    recv_counts = kept.view(1, E)
    if ep > 1:  # the counts exchange: each rank learns how many rows each local expert gets
        recv_counts = all_to_all(kept, [E_local] * ep, [E_local] * ep, group).view(ep, E_local)
    # the uneven splits must be host integers: ONE device->host copy per layer, dropless EP's price
    host = torch.cat([kept.view(ep, E_local).sum(1), recv_counts.sum(1), recv_counts.sum(0)])
    host = host.tolist()
    send, recv, rows = host[:ep], host[ep:2 * ep], host[2 * ep:]
    order = order[:sum(send)]  # the kept assignments
    plan = Plan(order, expert_idx.numel(), routed, kept, send, recv, recv_counts, rows, group)
    return x[order % N], plan


def dispatch_tokens(x, expert_idx, num_experts, capacity, group):
    """The rows this rank's experts must process (by source rank, then local expert) and the
    Plan. One row per kept assignment: a token whose k experts share a rank travels there k
    times."""
    rows, plan = plan_dispatch(x, expert_idx, num_experts, capacity, group)
    if group is not None:
        rows = AllToAll.apply(rows, plan.send_splits, plan.recv_splits, group)
    return rows, plan


def combine_tokens(y, plan):
    """Inverse of dispatch_tokens: y holds the expert outputs of the received rows (same order);
    returns (n_assign, D) in assignment order, zeros where an assignment was dropped."""
    if plan.group is not None:
        y = AllToAll.apply(y, plan.recv_splits, plan.send_splits, plan.group)
    return y.new_zeros((plan.n_assign, y.size(1))).index_copy(0, plan.order, y)


class MoE(NaiveMoE):
    """The layer with the all-to-all: a token's row goes only to the ranks of its experts."""
    exchange = "all-to-all"

    def run_experts(self, x, plan):
        """Received rows come by source rank, then local expert: regroup by expert, run, restore."""
        ep, E_local = plan.recv_counts.shape
        eid = torch.arange(E_local, device=x.device).repeat(ep).repeat_interleave(
            plan.recv_counts.flatten(), output_size=x.size(0))  # (R,); output_size: no host sync
        regroup = torch.argsort(eid, stable=True)
        parts = x[regroup].split(plan.expert_rows)  # local expert i's expert_rows[i] rows
        y = torch.cat([expert(xs) for expert, xs in zip(self.experts, parts)])
        return y[torch.argsort(regroup)]

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)  # (N = B*T, D): every token routes on its own
        logits, scores, idx, gates = self.route(h)
        if torch.is_autocast_enabled(h.device.type):  # ship bf16: the experts cast to it anyway
            h = h.to(torch.get_autocast_dtype(h.device.type))
        choice, cap = idx.t().reshape(-1), self.capacity(h.size(0))  # (k*N,) choice-major
        with timeline.compute(f"layer {self.layer} dispatch", "all_to_all"):
            recv, plan = dispatch_tokens(h, choice, self.E, cap, self.group)
        with timeline.compute(f"layer {self.layer} experts"):
            y = self.run_experts(recv, plan)
        with timeline.compute(f"layer {self.layer} combine", "all_to_all"):
            y = combine_tokens(y, plan)  # (k*N, D)
        out = (y.view(self.k, -1, D) * gates.t().unsqueeze(-1)).sum(0)  # (N, D); a drop adds 0
        if self.training:
            self.stats = {"routed": plan.routed, "kept": plan.kept, "P": scores.mean(0),
                          "plan": plan, "z": torch.logsumexp(logits, -1).square().mean()}
        return out.view(B, T, D)

    @staticmethod
    def exchange_bytes(args, n_tokens, row_bytes):
        """Closed form per rank and micro-step, uniform routing, dropless: (ep-1)/ep of the N k
        rows leave the rank in dispatch and combine, and again in backward; the counts, (ep-1)
        E/ep int64s, once per forward pass (twice with activation checkpointing)."""
        ep, passes = args.ep, 2 if args.activation_checkpointing else 1
        rows = n_tokens * args.top_k * (ep - 1) / ep * row_bytes
        return passes * (2 * rows + (ep - 1) * args.experts // ep * 8) + 2 * rows


def make_groups(rank, world, ep):
    """EP groups are blocks of ep consecutive ranks; expert e's replicas are the ranks with the
    same rank % ep. Every rank must create every group, in the same order. None: one rank."""
    ep_group = dp_group = None
    if ep > 1:
        ep_groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(world // ep)]
        ep_group = ep_groups[rank // ep]
    if world > ep:
        dp_group = [dist.new_group(list(range(j, world, ep))) for j in range(ep)][rank % ep]
    return ep_group, dp_group


def all_reduce_grads(params, group, n, world):
    """Sum the gradients over `group` (n ranks) in one flat bucket, divide by the WORLD size: an
    expert's gradient already sums, by the backward exchange, its EP group's losses; its n
    replicas cover all world ranks."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in params])
    if n > 1:
        comm.all_reduce(flat.nbytes, n)
        dist.all_reduce(flat, group=group)
    flat /= world
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def squared_norm(params, device):
    """The sum of the squares of the gradients, a 0-dim fp32 tensor on `device` (no host sync)."""
    return sum((p.grad.float().square().sum() for p in params if p.grad is not None),
               torch.zeros((), device=device))


def clip_global_grad_norm(dense, experts, max_norm, ep_group, ep):
    """The whole model's gradient norm before clipping, and clip_grad_norm_ to max_norm (0: off):
    dense grads are identical on every rank, expert grads are split over the EP group, so their
    squared norms are summed over it (one float)."""
    expert_sq = squared_norm(experts, dense[0].device)
    if ep > 1:
        comm.all_reduce(4, ep)
        dist.all_reduce(expert_sq, group=ep_group)
    norm = (squared_norm(dense, dense[0].device) + expert_sq).sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # a tensor: no host sync
        torch._foreach_mul_([p.grad for p in dense + experts if p.grad is not None], coef)
    return norm


def train(args, Layer):
    """The loop, for args checked by check_args; Layer: NaiveMoE, MoE or a subclass. Returns
    (metrics records, model)."""
    global timeline  # one step drawn, on this run's device
    ctx = gpt2.setup(args)  # device from LOCAL_RANK; data and writes below go by the global rank
    world, ep, dp = ctx.world, args.ep, ctx.world // args.ep
    ep_group, expert_dp_group = make_groups(ctx.rank, world, ep)  # its EP group, expert replicas
    model = gpt2.build_model(args)  # same seed, same dense weights; then every MLP becomes an MoE
    for i, block in enumerate(model.h):
        block.mlp = Layer(model.config, args, i, model.init_weights, ctx.rank % ep, ep_group)
    model = model.to(ctx.device)
    moes = [b.mlp for b in model.h]
    experts = [p for m in moes for p in m.experts.parameters()]
    dense = [p for p in model.parameters() if all(p is not e for e in experts)]
    train_loader, val_loader = gpt2.make_loaders(args, ctx.rank, world, model.config.vocab_size)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
    for b in model.h if args.compile else []:  # attention whole; experts see other row counts
        [m.compile(dynamic=m is not b.attn) for m in [b.attn, *b.mlp.experts]]
    all_experts = sum(p.numel() for p in experts) * ep  # of which a token uses k / E
    active = model.num_params() - all_experts * (1 - args.top_k / args.experts)
    tokens = args.batch_size * args.seq_len  # per rank and micro-step
    metrics = gpt2.Metrics(args, ctx, model.config, active, tokens * args.grad_accum * world)
    timeline, _, _ = gpt2.Timeline(ctx), moved.take_mb(), comm.take_mb()
    for step in range(args.steps):
        timeline.start_step(step), metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        sums, counts = torch.zeros(2, device=ctx.device), 0  # (train loss, aux loss); (L, 2, E)
        for _ in range(args.grad_accum):
            x, y = train_loader.next_batch(ctx.device)  # CUDA: pinned, non-blocking
            with ctx.autocast():
                _, loss = model(x, y)
            c = torch.stack([torch.stack([m.stats["routed"], m.stats["kept"]]) for m in moes])
            if world > 1:  # global_counts: routed and kept per expert, summed over ALL ranks
                comm.all_reduce(c.nbytes, world)
                dist.all_reduce(c)
            aux = sum(m.balance_loss(counts_l, args) for m, counts_l in zip(moes, c))
            sums = sums + torch.stack([loss.detach(), aux.detach()]) / args.grad_accum
            counts = counts + c
            with timeline.compute("backward"):
                ((loss + aux) / args.grad_accum).backward()
        if world > 1:
            t0 = timeline.now()
            all_reduce_grads(dense, None, world, world)
            all_reduce_grads(experts, expert_dp_group, dp, world)
            timeline.comm_span("grad all-reduces", t0)
        norm = clip_global_grad_norm(dense, experts, args.grad_clip, ep_group, ep)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timeline.stop()  # the picture is one optimizer step, not the validation that may follow
        if world > 1:  # the mean over ranks of (train loss, balancing loss)
            comm.all_reduce(sums.nbytes, world)
            dist.all_reduce(sums)
        load = counts[:, 0].float() / counts[:, 0].float().mean(-1, keepdim=True)  # (L, E) 1: even
        kept = counts[:, 1].sum() / counts[:, 0].sum()
        figures = torch.cat([sums / world, kept[None], norm[None], load.flatten()])
        loss, aux, kept, norm, *load = figures.tolist()  # the step's one host sync
        gpt2.check_finite(loss, step)
        mb, E = moved.take_mb(), args.experts
        per_layer = [[round(v, 4) for v in load[i:i + E]] for i in range(0, len(load), E)]
        metrics.log_step(step, loss, lr, comm_mb=mb + comm.take_mb(), grad_norm=norm, aux_loss=aux,
                         drop_rate=1 - kept, exchange_mb=mb, expert_load=per_layer)
        print0(f"      moe | aux {aux:.5f} | drop {1 - kept:.2%} | max/mean load {max(load):.2f} | "
               f"{Layer.exchange} {mb:.3f} MB")
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            with ctx.autocast():  # gpt2.evaluate in eval mode: the mean val loss over all ranks
                val = gpt2.evaluate(lambda x, y: model.eval()(x, y)[1], val_loader, args.eval_steps,
                                    ctx.device)
            metrics.log_val(step, val)
            model.train(), moved.take_mb(), comm.take_mb()  # validation is not a training step
    timeline.save(os.path.join(args.out, "timeline.png"), f"one step of {Layer.__name__}")
    gpt2.check_finite_weights(model.parameters(), args.steps - 1)  # every rank: its experts too
    metrics.plot()
    per_step = [r["exchange_mb"] for r in metrics.records if "exchange_mb" in r]
    mb, row = sum(per_step) / len(per_step), model.config.n_embd * ctx.dtype.itemsize  # a token
    forms = (Layer.exchange_bytes, MoE.exchange_bytes, NaiveMoE.exchange_bytes)  # layer, micro-step
    closed, a2a, naive = (len(moes) * args.grad_accum * f(args, tokens, row) / 1e6 for f in forms)
    print0(f"{Layer.exchange}: {mb:.3f} MB per step, closed form {closed:.3f} MB "
           f"(all-to-all, uniform routing: {a2a:.3f} MB; --naive: {naive:.3f} MB)")
    a2a_mb = 0.0 if Layer is NaiveMoE else mb
    metrics.log_summary({"exchange": Layer.exchange, "exchange_mb": mb,
                         "exchange_mb_closed_form": closed, "a2a_mb": a2a_mb,
                         "a2a_mb_closed_form": a2a, "naive_mb_closed_form": naive})
    return metrics.records, model


def make_parser():
    p = gpt2.make_parser("Train a Mixture-of-Experts GPT-2 with expert parallelism (torchrun for "
                         "several ranks).")
    a = p.add_argument
    a("--naive", action="store_true", help="all-gather the tokens, every rank runs its experts on "
      "all of them, reduce-scatter the outputs (no routing-dependent exchange)")
    a("--ep", type=int, default=None, help="expert-parallel size: the experts are split over "
      "groups of this many ranks (default: all ranks)")
    a("--experts", type=int, default=4, help="routed experts per MoE layer (each one GPT-2's MLP)")
    a("--top-k", type=int, default=2, help="experts per token")
    a("--capacity-factor", type=float, default=0.0, help="expert capacity = ceil(C*tokens*k/E) per "
      "rank; 0 = dropless")
    a("--aux-coef", type=float, default=0.01, help="alpha of the Switch load-balancing loss")
    a("--z-loss", type=float, default=1e-3, help="coefficient of the router z-loss (0 = off)")
    return p


def check_args(args, world):
    """Every mistake found before the first collective, so it is an error message and not a hang."""
    gpt2.check_args(args)
    args.ep = world if args.ep is None else args.ep  # default: the experts spread over every rank
    gpt2.check_range(args.ep, "--ep", 1, todo="give a positive integer")
    if args.experts % args.ep:
        gpt2.fail(f"{args.experts} experts do not split evenly over {args.ep} ranks",
                  "--experts/--ep", "give a number of experts divisible by --ep")
    gpt2.check_range(args.top_k, "--top-k", 1, args.experts,
                     todo="route each token to 1 to --experts experts")
    if world % args.ep:
        gpt2.fail(f"{world} ranks do not form groups of --ep {args.ep}", "--ep",
                  "give a divisor of the world size")
    for flag in ("aux_coef", "z_loss", "capacity_factor"):  # a negative one rewards imbalance
        gpt2.check_range(getattr(args, flag), "--" + flag.replace("_", "-"), 0,
                         todo="give 0 (off) or a positive value")


def main(argv=None):
    args = make_parser().parse_args(argv)
    check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    return train(args, NaiveMoE if args.naive else MoE)

# ---- Beyond the core ----
# DeepSeekMoE: the MoE layer with DeepSeek-V3's options (sec. 2.1.2, 3.2.2), each off by default; cli picks it
# when any of them is on:
#   --gate sigmoid        sigmoid affinities, gates renormalised over the k chosen (--norm-topk: softmax too, Mixtral)
#   --balance bias        auxiliary-loss-free balancing: a bias on the scores for top-k selection only, moved once
#                         per optimizer step from the step's global load (after the step's last backward)
#   --route-groups G --groups-per-token M   node-limited routing (DeepSeek-V2's device-limited routing)
#   --seq-aux-coef a      the sequence-wise balance loss (eq. 17-20), added to the layer's balance_loss
#   --shared-expert       one always-on expert, data parallel (DeepSeekMoE, Dai et al. 2024)
#   --overlap-shared      the shared expert computes while the dispatch all-to-all is in flight
#   --dispatch rank       one row per (token, destination rank), summed there before the combine (sec. 3.2.2)
#   --grouped-gemm        the local experts as two grouped GEMMs (torch._grouped_mm, or one padded bmm)

class DeepSeekMoE(MoE):
    def __init__(self, cfg, args, layer, init, ep_rank=0, group=None):
        super().__init__(cfg, args, layer, init, ep_rank, group)
        self.gate, self.norm_topk = getattr(args, "gate", "softmax"), getattr(args, "norm_topk", False)
        self.dispatch = getattr(args, "dispatch", "expert")
        self.route_groups, self.groups_per_token = getattr(args, "route_groups", 0), getattr(args, "groups_per_token", 0)
        self.seq_aux_coef = getattr(args, "seq_aux_coef", 0.0)
        self.grouped = getattr(args, "grouped_gemm", False)
        self.overlap_shared = getattr(args, "overlap_shared", False)
        base = args.seed * 1_000_003 + 1009 * (layer + 1)
        self.shared = seeded(base - 1, lambda: gpt2.MLP(cfg).apply(init)) if getattr(args, "shared_expert", False) else None
        # DeepSeek-V3 sec. 2.1.2: a bias added to the scores for top-k selection only (never to the gates);
        # a buffer, not a parameter: update_bias moves it, not gradients
        self.register_buffer("bias", torch.zeros(args.experts))
        self.load, self.backwards = None, 0  # this step's global routed counts (summed over micro-steps)
        if getattr(args, "balance", "aux") == "bias":
            self.bias_rate, self.grad_accum = args.bias_rate, getattr(args, "grad_accum", 1)
            self.router.weight.register_post_accumulate_grad_hook(self.after_backward)

    @staticmethod
    def exchange_bytes(args, n_tokens, row_bytes):
        return a2a_bytes_uniform(args, n_tokens, row_bytes)  # --dispatch rank: one row per (token, rank)

    def after_backward(self, _):
        """The router's gradient is in, so this layer's routing of the micro-step is final (recomputation
        included). After the step's last micro-step the bias moves: as after the optimizer step, which never
        reads it, and before the next forward."""
        self.backwards += 1
        if self.backwards == self.grad_accum and self.load is not None:
            update_bias([self], self.load[None], self.bias_rate)
            self.load, self.backwards = None, 0

    def route(self, h):
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.router.weight.float())  # (N, E)
        scores = logits.softmax(-1) if self.gate == "softmax" else logits.sigmoid()
        choice = scores + self.bias
        if self.groups_per_token:
            choice = limit_groups(choice, self.route_groups, self.groups_per_token, self.k)
        idx = torch.topk(choice, self.k, dim=-1).indices
        gates = scores.gather(-1, idx)
        # --norm-topk renormalises softmax gates over k (Mixtral); DeepSeek-V3 2.1.2 does so for sigmoid affinities
        if self.gate == "sigmoid" or self.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        return logits, scores, idx, gates

    def run_experts(self, x, plan):
        if not self.grouped:
            return super().run_experts(x, plan)
        ep, E_local = plan.recv_counts.shape
        eid = torch.arange(E_local, device=x.device).repeat(ep).repeat_interleave(plan.recv_counts.flatten(),
                                                                                  output_size=x.size(0))
        regroup = torch.argsort(eid, stable=True)
        with timeline.compute(f"layer {self.layer} experts"):
            y = grouped_experts(x[regroup], self.experts, plan.expert_rows)
        return y[torch.argsort(regroup)]

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)  # (N, D)
        N = h.size(0)
        logits, scores, idx, gates = self.route(h)
        if torch.is_autocast_enabled(h.device.type):
            h = h.to(torch.get_autocast_dtype(h.device.type))
        during = (lambda: self.shared(h)) if self.shared is not None and self.overlap_shared else None
        if self.dispatch == "rank":
            recv, recv_gates, chosen, plan, side = dispatch_by_rank(h, idx.t().reshape(-1), gates.t().reshape(-1), self.E,
                                                                    self.capacity(N), self.group, during)
            out = combine_by_rank(self.run_experts_by_rank(recv, recv_gates, chosen), plan, N)
        else:
            rows, plan = plan_dispatch(h, idx.t().reshape(-1), self.E, self.capacity(N), self.group)
            recv, side = send_rows(rows, plan.send_splits, plan.recv_splits, plan.group, during)
            y = combine_tokens(self.run_experts(recv, plan), plan)
            out = (y.view(self.k, N, D) * gates.t().unsqueeze(-1)).sum(0)  # (N, D)
        if self.shared is not None:
            out = out + (side if during else self.shared(h))
        if self.training:
            probs = scores if self.gate == "softmax" else scores / scores.sum(-1, keepdim=True)
            self.stats = {"routed": plan.routed, "kept": plan.kept, "P": probs.mean(0), "plan": plan,
                          "z": torch.logsumexp(logits, -1).square().mean()}
            if self.seq_aux_coef:
                # DeepSeek-V3 eq. 17-20, per sequence: f_i = E/(k T) x (tokens of the sequence choosing i),
                # P_i = the sequence's mean normalised affinity; sum_i f_i P_i, averaged over this rank's
                # sequences (the data-parallel gradient average then averages over all sequences)
                f = (idx[..., None] == torch.arange(self.E, device=idx.device)).sum(1).view(B, T, self.E).sum(1).float() * self.E / (self.k * T)  # (B, E)
                self.stats["seq_aux"] = (f * probs.view(B, T, self.E).mean(1)).sum(-1).mean()
        return out.view(B, T, D)

    def balance_loss(self, counts, args):
        self.load = counts[0] if self.load is None else self.load + counts[0]
        loss = super().balance_loss(counts, args)
        return loss + self.seq_aux_coef * self.stats["seq_aux"] if self.seq_aux_coef else loss

    def run_experts_by_rank(self, x, gates, chosen):
        """--dispatch rank, on the receiving side: x (R, D) one row per (source token, this rank); every chosen
        local expert runs on its rows, and each row's gated outputs are summed: (R, D), one row back per row."""
        expert, row = chosen.t().nonzero(as_tuple=True)  # (expert, row) pairs, grouped by expert
        rows = F.one_hot(expert, len(self.experts)).sum(0).tolist()
        xs = x[row]
        y = grouped_experts(xs, self.experts, rows) if self.grouped else \
            torch.cat([e(part) for e, part in zip(self.experts, xs.split(rows))])
        y = y * gates[row, expert].unsqueeze(-1)
        return x.new_zeros(x.shape).index_add(0, row, y.to(x.dtype))

@torch.no_grad()
def update_bias(moes, load, rate):
    """DeepSeek-V3 sec. 2.1.2: after each step, b_i += gamma * sign(mean load - load_i) with the step's load
    summed over ranks: overloaded experts get picked less, idle ones more, and no gradient is touched."""
    for m, l in zip(moes, load.float()):
        m.bias += rate * torch.sign(l.mean() - l)

def limit_groups(choice, groups, max_groups, k):
    """Node-limited routing (DeepSeek-V3 sec. 2.1.2; DeepSeek-V2's device-limited routing): experts form
    `groups` consecutive groups of E/groups; keep, for each token, the max_groups groups whose highest
    ceil(k / max_groups) affinities sum highest, and make the other groups' experts unselectable. choice: (N, E)
    scores (+ bias) that top-k selects on. The groups are a flag, not the EP layout: with --route-groups a
    multiple of --ep every group sits on one rank, so a token crosses the network to at most max_groups ranks,
    and one process routes the same tokens to the same experts."""
    N, E = choice.shape
    per_group = choice.view(N, groups, E // groups)
    group_score = per_group.topk(min(E // groups, math.ceil(k / max_groups)), dim=-1).values.sum(-1)  # (N, groups)
    allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(max_groups, -1).indices, True)
    return choice.masked_fill(~allowed.repeat_interleave(E // groups, dim=1), float("-inf"))

class AllToAllInFlight(torch.autograd.Function):
    """AllToAll whose forward exchange was started earlier (async_op=True, see send_rows): forward only waits
    for it; backward is AllToAll's."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group, started):
        ctx.saved = (in_splits, out_splits, group)
        out, work = started
        work.wait()  # NCCL: the compute stream waits for the exchange; gloo: the CPU does
        away = sum(in_splits) - in_splits[dist.get_rank(group)]
        moved.all_to_all(away * math.prod(x.shape[1:]) * x.element_size())
        return out

    @staticmethod
    def backward(ctx, grad):
        return *AllToAll.backward(ctx, grad), None

def send_rows(rows, send_splits, recv_splits, group, during=None):
    """AllToAll of rows, with `during()` (autograd on) computed while the exchange is in flight (--overlap-shared);
    returns (received rows, during's result or None)."""
    if group is None:
        return rows, during() if during else None
    if during is None:
        return AllToAll.apply(rows, send_splits, recv_splits, group), None
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    work = dist.all_to_all_single(out, rows.detach().contiguous(), recv_splits, send_splits, group=group, async_op=True)
    side = during()
    return AllToAllInFlight.apply(rows, send_splits, recv_splits, group, (out, work)), side

@dataclass
class RankPlan(Plan):
    token: torch.Tensor = None  # the token of each row sent

def dispatch_by_rank(x, expert_idx, gates, num_experts, capacity, group, during=None):
    """--dispatch rank, as DeepSeek-V3 runs it (sec. 3.2.2; DeepEP): one row per (token, destination rank),
    however many of the token's experts that rank holds. Beside each row travel its gates for the receiver's
    local experts (fp32, 0 where not chosen) and which of them were chosen (uint8), so the receiver can run
    every chosen local expert and sum their gated outputs into ONE row before the combine. Same capacity rule
    as dispatch_tokens. gates: (k*N,) in expert_idx's order. Returns (rows (R, D), their gates (R, E_local),
    chosen (R, E_local), Plan, during's result); the rows are grouped by source rank, then token. Host syncs:
    torch.unique (a data-dependent size) and the splits."""
    ep = dist.get_world_size(group) if group is not None else 1
    E_local, N = num_experts // ep, x.size(0)
    order, routed, kept = keep_within_capacity(expert_idx, num_experts, capacity)
    order = order[:int(kept.sum())]  # the kept assignments
    expert = expert_idx[order]
    # one key per kept assignment, (destination rank, token); unique() sorts and merges a token's choices
    pair, row_of = torch.unique(expert // E_local * N + order % N, return_inverse=True)
    local = expert % E_local
    token = pair % N
    rows = x[token]  # (P, D): P distinct (rank, token) pairs
    row_gates = gates.new_zeros(pair.numel(), E_local).index_put((row_of, local), gates[order])
    chosen = torch.zeros(pair.numel(), E_local, dtype=torch.uint8, device=x.device).index_put_(
        (row_of, local), torch.ones_like(local, dtype=torch.uint8))
    send = (pair[:, None] // N == torch.arange(ep, device=x.device)).sum(0)  # rows to each rank
    if ep == 1:
        n = pair.numel()
        return rows, row_gates, chosen, RankPlan(order, expert_idx.numel(), routed, kept, [n], [n], None, None, None,
                                                 token), during() if during else None
    recv_n = all_to_all(send, [1] * ep, [1] * ep, group)  # ep-1 int64s leave this rank
    host = torch.cat([send, recv_n]).tolist()
    send_splits, recv_splits = host[:ep], host[ep:]
    recv_gates = AllToAll.apply(row_gates, send_splits, recv_splits, group)
    recv_chosen = all_to_all(chosen, send_splits, recv_splits, group)
    recv, side = send_rows(rows, send_splits, recv_splits, group, during)
    return recv, recv_gates, recv_chosen, RankPlan(order, expert_idx.numel(), routed, kept, send_splits, recv_splits,
                                                   None, None, group, token), side

def combine_by_rank(y, plan, n_tokens):
    """Inverse of dispatch_by_rank: y (R, D) holds each received row's summed, gated local-expert outputs;
    back to the senders, then each token sums its rows (one per destination rank): (N, D)."""
    if plan.group is not None:
        y = AllToAll.apply(y, plan.recv_splits, plan.send_splits, plan.group)
    return y.new_zeros((n_tokens, y.size(1))).index_add(0, plan.token, y)

def grouped_mm(x, w, rows):
    """x: (R, K) rows grouped by expert, rows[g] of them for group g; w: (G, K, M) -> (R, M), each group's rows
    times its own w[g], as one call. torch._grouped_mm (CUTLASS's grouped GEMM on Hopper and later in bf16,
    a loop over groups on CPU) where this build has it and the strides are 16-byte multiples it requires;
    elsewhere every group is padded to the longest and multiplied by one batched matmul."""
    aligned = all(n * x.element_size() % 16 == 0 for n in (w.size(1), w.size(2)))
    hopper = not x.is_cuda or (torch.cuda.get_device_capability(x.device) >= (9, 0) and x.dtype == torch.bfloat16)
    if hasattr(torch, "_grouped_mm") and aligned and hopper:
        offs = torch.tensor(rows, device=x.device).cumsum(0).to(torch.int32)  # where each group's rows end
        return torch._grouped_mm(x, w, offs=offs)
    which = torch.repeat_interleave(torch.arange(len(rows), device=x.device), torch.tensor(rows, device=x.device))
    start = torch.tensor(rows, device=x.device).cumsum(0) - torch.tensor(rows, device=x.device)
    slot = torch.arange(x.size(0), device=x.device) - start[which]  # each row's place in its group
    padded = x.new_zeros(len(rows), max(rows), x.size(1)).index_put((which, slot), x)  # (G, max rows, K)
    return torch.bmm(padded, w)[which, slot]

def grouped_experts(x, experts, rows):
    """The local experts (gpt2.MLP each) on rows grouped by expert, as two grouped GEMMs instead of 2 x E_local
    small ones. The weights are stacked every call (a copy; a production kernel keeps them stacked)."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    stack = lambda name: torch.stack([getattr(e, name).weight for e in experts]).transpose(1, 2).to(dtype)  # (G, in, out)
    bias = lambda name: torch.stack([getattr(e, name).bias for e in experts]).to(dtype)
    which = torch.repeat_interleave(torch.arange(len(rows), device=x.device), torch.tensor(rows, device=x.device))
    hidden = grouped_mm(x.to(dtype), stack("c_fc"), rows) + bias("c_fc")[which]  # (R, 4D)
    hidden = F.gelu(hidden, approximate="tanh")
    return grouped_mm(hidden, stack("c_proj"), rows) + bias("c_proj")[which]  # (R, D)

# ---- Appendix ----
# Closed forms per rank, N tokens per micro-step, row = D x dtype bytes, uniform routing, dropless:
#     all-to-all bytes/layer  4 x N k (ep-1)/ep rows (dispatch, combine, both again in backward) + (ep-1) E/ep x 8
#     --naive bytes/layer     2 x (ep-1) N (1 + k) rows (all-gather, reduce-scatter, again in backward) + (ep-1) k N x 8
#     all-reduce bytes/step   2 (W-1)/W x 4 B x dense params + 2 (W/ep-1)/(W/ep) x 4 B x local expert params
#     memory                  16 B x (dense params + L x E/ep x 8 D^2): fp32 weights, grads, AdamW's 2 moments
import argparse  # noqa: E402 (the appendix's own imports)
import pickle  # noqa: E402
import sys  # noqa: E402


def a2a_bytes_closed(moes, ep, recompute, row_bytes):
    """This rank's all-to-all bytes in one micro-step, from what its routing sent (each layer's last Plan). Per
    layer: the forward sends rows_out token rows away (dispatch) and rows_in back (combine); backward sends
    their gradients the other way; activation checkpointing re-runs the forward, counts exchange included.
    --dispatch expert: rows are assignments, counts (ep-1) x E/ep int64s. --dispatch rank: rows are (token, rank)
    pairs, each also carrying E/ep fp32 gates (and their gradients back) and E/ep uint8 choice flags; counts
    (ep-1) int64s."""
    if ep == 1:
        return 0
    total, fwd_passes = 0, 2 if recompute else 1
    for m in moes:
        plan, local = m.stats["plan"], m.E // ep
        me = dist.get_rank(plan.group)
        out, back = sum(plan.send_splits) - plan.send_splits[me], sum(plan.recv_splits) - plan.recv_splits[me]
        if getattr(m, "dispatch", "expert") == "rank":
            fwd = out * (row_bytes + 5 * local) + back * row_bytes + (ep - 1) * 8
            bwd = out * row_bytes + back * (row_bytes + 4 * local)
        else:
            fwd = (out + back) * row_bytes + (ep - 1) * local * 8
            bwd = (out + back) * row_bytes
        total += fwd_passes * fwd + bwd
    return total


def a2a_bytes_uniform(args, n_tokens, row_bytes):
    """a2a_bytes_closed for one layer and one micro-step if routing were uniform (and not node-limited):
    --dispatch expert: MoE.exchange_bytes; --dispatch rank: a token goes once to each other rank holding
    any of its k experts, which happens with chance 1 - C(E - E/ep, k) / C(E, k) per rank (1 for
    E/ep = 1: no saving when every rank holds one expert)."""
    ep, E, k = args.ep, args.experts, args.top_k
    if getattr(args, "dispatch", "expert") != "rank" or ep == 1:
        return MoE.exchange_bytes(args, n_tokens, row_bytes)
    fwd_passes, local = (2 if args.activation_checkpointing else 1), E // ep
    pairs = n_tokens * (ep - 1) * (1 - math.comb(E - local, k) / math.comb(E, k))
    return fwd_passes * (pairs * (2 * row_bytes + 5 * local) + (ep - 1) * 8) + pairs * (2 * row_bytes + 4 * local)


def plot_expert_load(loads, args, path):
    """Heatmap: one row per (layer, expert), one column per step, colour = tokens / mean tokens (1 = balanced)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    L, E = len(loads[0]), len(loads[0][0])
    grid = torch.tensor(loads, dtype=torch.float32).permute(1, 2, 0).reshape(L * E, -1).numpy()
    fig, ax = plt.subplots(figsize=(7, 1 + 0.22 * L * E))
    im = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest", vmin=0)
    for i in range(1, L):
        ax.axhline(i * E - 0.5, color="white", lw=0.8)
    ax.set_yticks([i * E + (E - 1) / 2 for i in range(L)], [f"layer {i}" for i in range(L)])
    ax.set_xlabel("step")
    ax.set_title(f"expert load (tokens / mean), {E} experts per layer, top-{args.top_k}, balance={args.balance}")
    fig.colorbar(im, ax=ax, label="load / mean")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def full_state_dict(model, ep):
    """The whole MoE's weights, as one process would hold them: each layer's local experts flattened and
    all-gathered over its EP group, then renamed by their global index (rank r's expert j is r*E/ep + j)."""
    state = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
    for i, block in enumerate(model.h):
        named = list(block.mlp.experts.named_parameters())  # ("0.c_fc.weight", p), ...
        flat = torch.cat([p.detach().reshape(-1) for _, p in named])
        parts = [flat]
        if ep > 1:
            parts = [torch.empty_like(flat) for _ in range(ep)]
            dist.all_gather(parts, flat, group=block.mlp.group)
        for r, part in enumerate(parts):
            for (name, p), chunk in zip(named, part.split([p.numel() for _, p in named])):
                j, rest = name.split(".", 1)
                state[f"h.{i}.mlp.experts.{r * len(block.mlp.experts) + int(j)}.{rest}"] = chunk.view_as(p).clone()
    return state


def save_moe(model, args):
    """OUT/model.pt with all E experts of every layer (full_state_dict: a collective, every rank takes part)."""
    state = full_state_dict(model, args.ep)
    if int(os.environ.get("RANK", 0)) == 0:
        moe = {k: getattr(args, k) for k in ("experts", "top_k", "gate", "norm_topk", "shared_expert", "route_groups",
                                             "groups_per_token")}
        moe["layer"] = type(model.h[0].mlp).__name__
        gpt2.save_model(os.path.join(args.out, "model.pt"), model.config, state, moe=moe)


def add_options(p):
    """DeepSeek-V3's options (and Mixtral's --norm-topk) on top of the core's parser."""
    a = p.add_argument
    p.set_defaults(z_loss=None)
    p.description = "Train a Mixture-of-Experts GPT-2 with expert parallelism (torchrun for several ranks); " \
                    "`moe_ep.py sample --init-from OUT/model.pt` samples from a finished run."
    a("--gate", default="softmax", choices=["softmax", "sigmoid"], help="softmax top-k probabilities, or DeepSeek-V3 "
      "sigmoid renormalised over k")
    a("--norm-topk", action="store_true", help="renormalise softmax gates over the chosen k (Mixtral, DeepSeek-V2); "
      "sigmoid gates always are")
    a("--balance", default="aux", choices=["aux", "bias", "none"], help="Switch aux loss, DeepSeek-V3 aux-loss-free "
      "bias, or nothing (bias and none set --aux-coef to 0)")
    a("--bias-rate", type=float, default=1e-3, help="gamma: bias update speed of --balance bias")
    a("--shared-expert", action="store_true", help="add one always-on expert per layer (DeepSeek-V3), data parallel")
    a("--dispatch", default="expert", choices=["expert", "rank"], help="send a token once per chosen expert, or once "
      "per destination rank (DeepSeek-V3: the receiver fans out to its local experts and sums)")
    a("--route-groups", type=int, default=0, help="node-limited routing (DeepSeek-V3 sec. 2.1.2): the experts in G "
      "groups (a multiple of --ep: each group on one rank); 0 = off")
    a("--groups-per-token", type=int, default=0, help="node-limited routing: a token's experts come from at most M "
      "of the --route-groups groups (so at most M ranks)")
    a("--seq-aux-coef", type=float, default=0.0, help="alpha of DeepSeek-V3's sequence-wise balance loss (0 = off)")
    a("--grouped-gemm", action="store_true", help="run the local experts as grouped GEMMs (torch._grouped_mm where "
      "available, a batched matmul elsewhere)")
    a("--overlap-shared", action="store_true", help="compute the shared expert while the dispatch all-to-all is in flight")


def option_defaults(args):
    """The core's defaults that an option changes."""
    if args.z_loss is None:
        # ST-MoE's z-loss keeps the softmax's logits small, so exp() neither overflows nor rounds the
        # probabilities away; a sigmoid router has no softmax to protect (DeepSeek-V3 uses none)
        args.z_loss = 1e-3 if args.gate == "softmax" else 0.0
    if args.balance != "aux":
        args.aux_coef = 0.0


def check_options(args):
    """The options' mistakes, before the first collective."""
    if args.norm_topk and args.top_k == 1:
        gpt2.fail("--norm-topk with --top-k 1 makes every gate 1", "--norm-topk",
                  "drop --norm-topk or route to --top-k 2 or more (the router would learn from the aux loss only)")
    G, M = args.route_groups, args.groups_per_token
    if bool(G) != bool(M):
        gpt2.fail(f"--route-groups {G} with --groups-per-token {M}", "--route-groups/--groups-per-token",
                  "give both (node-limited routing) or neither")
    if G and (G < 1 or args.experts % G or G % args.ep):
        gpt2.fail(f"--route-groups {G} does not split {args.experts} experts into groups that each sit on one of "
                  f"--ep {args.ep} ranks", "--route-groups", "give a divisor of --experts that is a multiple of --ep")
    if M and not 1 <= M < G:
        gpt2.fail(f"--groups-per-token {M} is outside [1, --route-groups {G})", "--groups-per-token",
                  "allow fewer groups than there are (all of them is no limit)")
    if M and M * (args.experts // G) < args.top_k:
        gpt2.fail(f"--groups-per-token {M} groups hold {M * (args.experts // G)} experts, fewer than --top-k "
                  f"{args.top_k}", "--groups-per-token", "allow more groups per token")
    for flag in ("seq_aux_coef", "bias_rate"):  # a negative one rewards imbalance
        gpt2.check_range(getattr(args, flag), "--" + flag.replace("_", "-"), 0, todo="give 0 (off) or a positive coefficient")
    if args.overlap_shared and not args.shared_expert:
        gpt2.fail("--overlap-shared without a shared expert to overlap", "--overlap-shared", "add --shared-expert")
    if args.naive and uses_deepseek(args):  # DeepSeekMoE extends the all-to-all layer, not NaiveMoE
        gpt2.fail("--naive runs the core's softmax router and all-gather exchange only, without DeepSeek-V3's "
                  "options", "--naive", "drop --naive, or the options (--gate, --norm-topk, --balance bias, "
                  "--shared-expert, --dispatch rank, --route-groups, --seq-aux-coef, --grouped-gemm)")


def uses_deepseek(args):
    """Whether any of DeepSeekMoE's options is on (else the core's MoE runs)."""
    return (getattr(args, "gate", "softmax") == "sigmoid" or getattr(args, "norm_topk", False)
            or getattr(args, "balance", "aux") == "bias" or getattr(args, "shared_expert", False)
            or getattr(args, "groups_per_token", 0) or getattr(args, "seq_aux_coef", 0.0) > 0
            or getattr(args, "dispatch", "expert") == "rank" or getattr(args, "grouped_gemm", False))


def cli(argv=None):
    """The whole command line: the core's flags and the options; DeepSeekMoE if an option asks for it, else the
    core's MoE (NaiveMoE with --naive); then model.pt and the expert-load picture."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sample"]:
        return sample(argv[1:])
    p = make_parser()
    add_options(p)
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    option_defaults(args)
    check_args(args, world)
    check_options(args)
    records, model = train(args, DeepSeekMoE if uses_deepseek(args) else NaiveMoE if args.naive else MoE)
    save_moe(model, args)
    steps = [r for r in records if "loss" in r]
    if int(os.environ.get("RANK", 0)) == 0 and steps:
        plot_expert_load([r["expert_load"] for r in steps], args, os.path.join(args.out, "expert_load.png"))
        print0(f"wrote {args.out}/model.pt, loss.png, timeline.png and expert_load.png "
               f"(sample: python moe_ep.py sample --init-from {args.out}/model.pt)")
    return records


def load_moe(path, device="cpu"):
    """OUT/model.pt written by cli() -> the MoE GPT-2 in one process (all experts, dropless), for sampling
    or evaluation. gpt2.load_for_inference builds a dense GPT-2 and cannot read it."""
    if not os.path.exists(path):
        gpt2.fail(f"{path} does not exist", "--init-from", "give the model.pt of a finished moe_ep.py run")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:  # not a torch.save file at all
        gpt2.fail(f"{path} is not a model.pt ({type(e).__name__})", "--init-from",
                  "give the model.pt of a finished moe_ep.py run")
    if not isinstance(ckpt, dict) or not {"config", "model"} <= ckpt.keys():
        gpt2.fail(f"{path} is not a model.pt written by this project", "--init-from",
                  "give the model.pt of a finished moe_ep.py run")
    if "moe" not in ckpt:
        gpt2.fail(f"{path} holds a dense GPT-2, not an MoE", "--init-from",
                  f"sample it with `python gpt2.py sample --init-from {path}`")
    cfg = gpt2.GPTConfig(**ckpt["config"])
    model = gpt2.GPT(cfg)
    moe = {k: v for k, v in ckpt["moe"].items() if k != "layer"}
    args = argparse.Namespace(**moe, ep=1, capacity_factor=0.0, seed=0)
    Layer = DeepSeekMoE if ckpt["moe"].get("layer") == "DeepSeekMoE" else MoE
    for i, block in enumerate(model.h):
        block.mlp = Layer(cfg, args, i, model.init_weights)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def sample(argv):
    """`python moe_ep.py sample --init-from OUT/model.pt`: gpt2.py's sample command with the MoE loader."""
    gpt2.sample(argv, load_model=load_moe, prog="moe_ep.py sample", init_help="OUT/model.pt of a moe_ep.py run")


if __name__ == "__main__":
    gpt2.run_main(cli)
