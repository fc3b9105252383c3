"""
moe_ep.py - a Mixture-of-Experts GPT-2 trained with expert parallelism (EP): every block's MLP becomes E expert
MLPs and a router that sends each token to its top-k experts. A token runs k of the E experts, so the MoE holds
E times the dense MLP's parameters for k times its FLOPs (Shazeer et al. 2017). Rank r of an EP group of ep
ranks holds experts [r*E/ep, (r+1)*E/ep) only. In each MoE layer a rank routes its own tokens, sorts them by
expert (hence by destination rank), swaps the counts, then the rows (all_to_all_single with uneven splits),
runs its experts on what it received, sends the outputs back by the reverse all-to-all and sums them weighted
by the gates. Everything that is not an expert (attention, LayerNorms, embeddings, routers) is data parallel.

    world = 4, --ep 2 --experts 4: EP groups {0,1} {2,3}; expert e's replicas: the ranks with equal rank % ep
               rank 0          rank 1        |   rank 2          rank 3
    data       rows [0,B)      rows [B,2B)   |   rows [2B,3B)    rows [3B,4B)
    dense      attention, LayerNorms, wte/wpe, routers: a full copy everywhere, grads all-reduced over 4
    experts    e0 e1           e2 e3         |   e0 e1           e2 e3    (e0's grads: all-reduced over {0,2})
    one layer: route -> top-k -> sort by expert -> a2a counts -> a2a rows ===> local experts ===> a2a back
               -> unsort -> sum_k gate_k * y_k -> residual add (a choice dropped by capacity adds nothing)

Closed forms per rank, N tokens per micro-step, row = D x dtype bytes, uniform routing, dropless:
    all-to-all bytes/layer  4 x N k (ep-1)/ep rows (dispatch, combine, both again in backward) + (ep-1) E/ep x 8
    all-reduce bytes/step   2 (W-1)/W x 4 B x dense params + 2 (W/ep-1)/(W/ep) x 4 B x local expert params
    memory                  16 B x (dense params + L x E/ep x 8 D^2): fp32 weights, grads, AdamW's 2 moments
Launch (the second run reproduces the first's losses; tests/test_moe_ep.py checks every layout):
    python moe_ep.py --experts 4 --top-k 2 --batch-size 8 --out out/moe
    torchrun --nproc_per_node=2 moe_ep.py --ep 2 --experts 4 --top-k 2 --batch-size 4 --out out/moe_ep2
    python moe_ep.py sample --init-from out/moe_ep2/model.pt --prompt "Hello"
References: GShard (Lepikhin et al. 2020) sec. 2.2 (top-2, capacity, all-to-all dispatch); Switch Transformer
(Fedus et al. 2021) sec. 2.2, eq. 4-6 (capacity factor, aux loss); ST-MoE (Zoph et al. 2022) sec. 3 (z-loss);
DeepSeek-V3 (2024) sec. 2.1.2, 3.2.2 (beyond the core: bias balancing, node-limited routing, shared expert).
Uses from gpt2.py: build_model, MLP, make_loaders, optimizer_groups, make_adamw, set_lr, evaluate, setup,
check_finite(_weights), save_model, Metrics, Profiler, make_parser/check_args/check_range/fail/run_main, sample.
"""
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist  # the appendix rebinds `dist` to MeteredDist: same calls, bytes counted
import torch.nn as nn
import torch.nn.functional as F

import gpt2
from gpt2 import print0

def all_to_all(x, in_splits, out_splits, group):
    """Rows x[sum(in_splits[:j]):sum(in_splits[:j+1])] go to rank j of `group`; returns those received, by source."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out

class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: a received row's gradient belongs to the rank that sent it, so backward is the
    same exchange with the splits swapped (GShard sec. 2.2: dispatch and combine are each other's transpose)."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group):
        ctx.saved = (in_splits, out_splits, group)
        return all_to_all(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits, group = ctx.saved
        return all_to_all(grad, out_splits, in_splits, group), None, None, None

def keep_within_capacity(expert_idx, num_experts, capacity):
    """Assignment ids sorted by expert (stable: first choices, then earlier tokens, GShard sec. 2.2's priority),
    minus those beyond `capacity` per expert (None = dropless); counts per expert before and after the cut."""
    order = torch.argsort(expert_idx, stable=True)
    routed = torch.bincount(expert_idx, minlength=num_experts)
    kept = routed
    if capacity is not None:
        first = torch.cumsum(routed, 0) - routed  # where each expert's run starts in `order`
        slot = torch.arange(order.numel(), device=expert_idx.device) - first[expert_idx[order]]
        order, kept = order[slot < capacity], routed.clamp(max=capacity)
    return order, routed, kept

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
    group: object

# Dispatch, worked on 2 ranks: E = 4 experts, rank 0 holds e0 e1, rank 1 holds e2 e3; top-2; rank 0 has N = 3
# tokens t0 t1 t2 (rank 1 has its own). Rank 0's router picks t0 -> (e2, e0), t1 -> (e1, e2), t2 -> (e3, e0).
#  1. assignments, choice-major: a0..a2 are the first choices, a3..a5 the second: expert_idx = [2, 1, 3, 0, 2, 0].
#  2. order = stable argsort by expert = [a3 a5 | a1 | a0 a4 | a2] (e0 | e1 | e2 | e3); the rows to send are
#     x[order % N] = [t0 t2 | t1 | t0 t1 | t2]. Sorted by expert means sorted by rank: the first 3 rows stay
#     on rank 0, the last 3 go to rank 1: send_splits = [3, 3].
#  3. counts exchange: rank 0 sends kept = [2, 1 | 2, 1] (rows for e0 e1 | e2 e3); say rank 1 sends it [1, 0]
#     for e0 e1. Rank 0 now knows recv_counts = [[2, 1], [1, 0]] (source x local expert), so recv_splits = [3, 1]
#     and its experts see expert_rows = [3, 1] rows.
#  4. token exchange: rank 0 receives [t0 t2 t1 | s] (from itself: e0 e0 e1; from rank 1: s for e0), ordered by
#     source, then expert. run_experts regroups by expert: eid = [0 0 1 0], regroup = argsort(eid) = [0 1 3 2]
#     -> [t0 t2 s | t1], runs e0 on 3 rows and e1 on 1, and puts the outputs back in received order with the
#     inverse permutation argsort(regroup).
#  5. combine: the reverse exchange (splits swapped) returns to rank 0 its 6 rows in `order`; index_copy
#     writes row i to assignment order[i], so y.view(k, N, D)[c, t] is token t's c-th expert output, which the
#     gates weight and sum. Backward runs the same exchanges with the splits swapped again.
def plan_dispatch(x, expert_idx, num_experts, capacity, group):
    """x: (N, D) tokens; expert_idx: (k*N,) the expert of assignment a = token a % N (choice-major). Returns the rows
    to send (one per kept assignment, sorted by expert) and the Plan, after the counts exchange."""
    ep = dist.get_world_size(group) if group is not None else 1
    E, E_local, N = num_experts, num_experts // ep, x.size(0)
    order, routed, kept = keep_within_capacity(expert_idx, E, capacity)
    if ep == 1:
        n = order.numel()
        return x[order % N], Plan(order, expert_idx.numel(), routed, kept, [n], [n], kept.view(1, E), kept.tolist(), None)
    recv_counts = torch.empty_like(kept)
    dist.all_to_all_single(recv_counts, kept, group=group)
    recv_counts = recv_counts.view(ep, E_local)
    # the uneven splits must be host integers: one device->host copy per layer, the price of dropless EP
    host = torch.cat([kept.view(ep, E_local).sum(1), recv_counts.sum(1), recv_counts.sum(0)]).tolist()
    return x[order % N], Plan(order, expert_idx.numel(), routed, kept, host[:ep], host[ep:2 * ep], recv_counts,
                              host[2 * ep:], group)

def dispatch_tokens(x, expert_idx, num_experts, capacity, group):
    """The rows this rank's experts must process (by source rank, then local expert) and the Plan. One row per
    kept assignment: a token whose k experts share a rank travels there k times."""
    rows, plan = plan_dispatch(x, expert_idx, num_experts, capacity, group)
    return (rows if group is None else AllToAll.apply(rows, plan.send_splits, plan.recv_splits, group)), plan

def combine_tokens(y, plan):
    """Inverse of dispatch_tokens: y holds the expert outputs of the received rows (same order); returns
    (n_assign, D) in assignment order, zeros where an assignment was dropped."""
    if plan.group is not None:
        y = AllToAll.apply(y, plan.recv_splits, plan.send_splits, plan.group)
    return y.new_zeros((plan.n_assign, y.size(1))).index_copy(0, plan.order, y)

def seeded(seed, make):
    """make() under its own seed, global RNG untouched: every EP layout builds identical experts, each rank its own."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator only: modules are built on the CPU
        return make()

class MoE(nn.Module):
    """Drop-in for gpt2.MLP: (B, T, D) -> (B, T, D); this rank holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep)."""

    def __init__(self, cfg, args, layer, init, ep_rank=0, group=None):
        super().__init__()
        E, ep = args.experts, args.ep
        self.E, self.k, self.gate, self.cf = E, args.top_k, args.gate, args.capacity_factor
        self.norm_topk, self.group, self.stats = getattr(args, "norm_topk", False), group, None
        base = args.seed * 1_000_003 + 1009 * (layer + 1)  # init: gpt2's, N(0, 0.02), residual projections / sqrt(2L)
        self.router = seeded(base, lambda: nn.Linear(cfg.n_embd, E, bias=False).apply(init))
        self.experts = nn.ModuleList(seeded(base + 1 + e, lambda: gpt2.MLP(cfg).apply(init))
                                     for e in range(ep_rank * (E // ep), (ep_rank + 1) * (E // ep)))

    def route(self, h):
        """Top-k experts and gates of each token. The router runs in fp32 even under autocast: tiny logit
        differences flip top-k choices (Switch sec. 2.4, selective precision)."""
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.router.weight.float())
        scores = logits.softmax(-1) if self.gate == "softmax" else logits.sigmoid()
        idx = self.choose(scores)
        gates = scores.gather(-1, idx)
        # Softmax gates stay the top-k probabilities (GShard 2.2, Switch 2.1; sum < 1): the LM loss reaches the router
        # through them. --norm-topk renormalises over k (Mixtral); so does DeepSeek-V3 2.1.2 for sigmoid affinities.
        if self.gate == "sigmoid" or self.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        return logits, scores, idx, gates

    def choose(self, scores):
        return torch.topk(scores, self.k, dim=-1).indices

    def capacity(self, n_tokens):
        """Switch sec. 2.2: expert capacity = C * tokens * k / E per source rank; 0 = dropless."""
        return None if self.cf == 0 else math.ceil(self.cf * n_tokens * self.k / self.E)

    def expert_ffn(self, x, rows):
        """Local expert i on rows [sum(rows[:i]), sum(rows[:i+1])) of x."""
        return torch.cat([expert(xs) for expert, xs in zip(self.experts, x.split(rows))])

    def run_experts(self, x, plan):
        """Received rows come by source rank, then local expert: regroup by expert, run, restore the order."""
        ep, E_local = plan.recv_counts.shape
        eid = torch.arange(E_local, device=x.device).repeat(ep).repeat_interleave(plan.recv_counts.flatten())
        regroup = torch.argsort(eid, stable=True)
        return self.expert_ffn(x[regroup], plan.expert_rows)[torch.argsort(regroup)]

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
        logits, scores, idx, gates = self.route(h)
        if torch.is_autocast_enabled(h.device.type):  # ship bf16: the experts would cast to it anyway
            h = h.to(torch.get_autocast_dtype(h.device.type))
        recv, plan = dispatch_tokens(h, idx.t().reshape(-1), self.E, self.capacity(h.size(0)), self.group)
        y = combine_tokens(self.run_experts(recv, plan), plan)
        out = (y.view(self.k, -1, D) * gates.t().unsqueeze(-1)).sum(0)  # dropped choices add nothing
        if self.training:
            self.stats = self.statistics(logits, scores, plan, h)
        return out.view(B, T, D)

    def statistics(self, logits, scores, plan, h):
        probs = scores if self.gate == "softmax" else scores / scores.sum(-1, keepdim=True)
        return {"routed": plan.routed, "kept": plan.kept, "P": probs.mean(0), "plan": plan,
                "row_bytes": h.size(1) * h.element_size(), "z": torch.logsumexp(logits, -1).square().mean()}

    def balance_loss(self, counts, args):
        """Switch eq. 4: alpha*E*sum_i f_i*P_i, f_i the fraction of the GLOBAL batch's choices that picked expert i
        (counts (2, E) summed over all ranks), P_i this rank's mean router probability: the data-parallel gradient
        average makes P_i global, so every layout reproduces one process. Plus ST-MoE's z-loss, a per-token mean."""
        f = counts[0].float() / counts[0].sum()
        loss = args.aux_coef * self.E * (f * self.stats["P"]).sum() if args.balance == "aux" else 0.0
        return loss + args.z_loss * self.stats["z"] if args.z_loss else loss

def global_counts(moes, world):
    """(L, 2, E) assignments per expert (routed, kept) summed over ALL ranks: one all-reduce per micro-step."""
    counts = torch.stack([torch.stack([m.stats["routed"], m.stats["kept"]]) for m in moes])
    if world > 1:
        dist.all_reduce(counts)
    return counts

def build_moe_model(args, ep_rank=0, group=None, layer=MoE):
    """gpt2.build_model (same seed, same dense weights), with every block's MLP replaced by an MoE layer."""
    model = gpt2.build_model(args)
    for i, block in enumerate(model.h):
        block.mlp = layer(model.config, args, i, model.init_weights, ep_rank, group)
    return model

def make_groups(rank, world, ep):
    """EP groups are blocks of ep consecutive ranks; expert e's replicas are the ranks with the same rank % ep.
    Every rank must create every group, in the same order. None: a group of one, no communication."""
    ep_groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(world // ep)] if ep > 1 else []
    dp_groups = [dist.new_group(list(range(j, world, ep))) for j in range(ep)] if world > ep else []
    return ep_groups[rank // ep] if ep_groups else None, dp_groups[rank % ep] if dp_groups else None

def all_reduce_grads(params, group, n, world):
    """Sum the gradients over `group` (n ranks) in one flat bucket, divide by the WORLD size: an expert's gradient
    already sums, by the backward all-to-all, its EP group's losses; its n replicas cover all world ranks."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    if n > 1:
        dist.all_reduce(flat, group=group)
    flat /= world
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)

def clip_global_grad_norm(dense, experts, max_norm, ep_group, ep):
    """clip_grad_norm_ on the whole model: dense grads are identical on every rank, expert grads are split
    over the EP group, so their squared norms are summed over it (one float)."""
    sq = lambda ps: sum((p.grad.float().square().sum() for p in ps if p.grad is not None), torch.zeros((), device=dense[0].device))
    expert_sq = sq(experts)
    if ep > 1:
        dist.all_reduce(expert_sq, group=ep_group)
    coef = (max_norm / ((sq(dense) + expert_sq).sqrt() + 1e-6)).clamp(max=1.0)
    for p in dense + experts:
        if p.grad is not None:
            p.grad.mul_(coef)

def train(argv=None):
    args = make_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    check_args(args, world)
    ctx = gpt2.setup(args)  # device from LOCAL_RANK; data and writes below go by the global rank
    ep, dp = args.ep, world // args.ep
    ep_group, expert_dp_group = make_groups(ctx.rank, world, ep)  # every rank: its EP group, its expert replicas
    model = build_moe_model(args, ctx.rank % ep, ep_group, layer_class(args)).to(ctx.device)
    moes = [b.mlp for b in model.h]
    experts = [p for m in moes for p in m.experts.parameters()]
    dense = [p for p in model.parameters() if id(p) not in {id(e) for e in experts}]
    train_loader, val_loader = gpt2.make_loaders(args, ctx.rank, world, model.config.vocab_size)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
    extend_optimizer(opt, moes, args)  # beyond the core: what an extension does after each optimizer step
    if args.compile:
        compile_parts(model)
    log = RunLog(args, ctx, model, experts)  # appendix: metrics, bytes against closed forms, the load picture
    for step in range(args.steps):
        log.start_step(step)
        lr = gpt2.set_lr(opt, step, args)
        sums = torch.zeros(2, device=ctx.device)  # (train loss, balancing loss) of this rank
        for _ in range(args.grad_accum):
            x, y = train_loader.next_batch()
            with ctx.autocast():
                _, loss = model(x.to(ctx.device), y.to(ctx.device))
            c = global_counts(moes, world)
            aux = sum((m.balance_loss(cl, args) for m, cl in zip(moes, c)), torch.zeros((), device=ctx.device))
            log.micro_step(moes, c)
            sums += torch.stack([loss.detach(), aux.detach()]) / args.grad_accum
            ((loss + aux) / args.grad_accum).backward()
        if world > 1:
            all_reduce_grads(dense, None, world, world)
            all_reduce_grads(experts, expert_dp_group, dp, world)
        if args.grad_clip > 0:
            clip_global_grad_norm(dense, experts, args.grad_clip, ep_group, ep)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.step(step, sums, lr)  # the mean over ranks (an all-reduce), checked finite, logged
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            log.evaluate(step, model, val_loader)  # gpt2.evaluate in eval mode, dropless
    gpt2.check_finite_weights(model.parameters(), args.steps - 1)  # every rank: its own experts too
    save_moe(model, args, ctx.master, ep_group)  # experts all-gathered over the EP group; rank 0 writes model.pt
    return log.finish()

# ---- Beyond the core ----
# DeepSeekMoE: the MoE layer with DeepSeek-V3's options (sec. 2.1.2, 3.2.2), each off by default:
#   --balance bias        auxiliary-loss-free balancing: a bias on the scores for top-k selection only, moved
#                         after each optimizer step (extend_optimizer: a torch step post-hook)
#   --route-groups G --groups-per-token M   node-limited routing (DeepSeek-V2's device-limited routing)
#   --seq-aux-coef a      the sequence-wise balance loss (eq. 17-20), added to the layer's balance_loss
#   --shared-expert       one always-on expert, data parallel (DeepSeekMoE, Dai et al. 2024)
#   --overlap-shared      the shared expert computes while the dispatch all-to-all is in flight
#   --dispatch rank       one row per (token, destination rank), summed there before the combine (sec. 3.2.2)
#   --grouped-gemm        the local experts as two grouped GEMMs (torch._grouped_mm, or one padded bmm)

def layer_class(args):
    """MoE unless a flag asks for one of DeepSeek-V3's options."""
    options = (getattr(args, "balance", "aux") == "bias", getattr(args, "shared_expert", False),
               getattr(args, "groups_per_token", 0), getattr(args, "seq_aux_coef", 0.0) > 0,
               getattr(args, "dispatch", "expert") == "rank", getattr(args, "grouped_gemm", False))
    return DeepSeekMoE if any(options) else MoE

class DeepSeekMoE(MoE):
    def __init__(self, cfg, args, layer, init, ep_rank=0, group=None):
        super().__init__(cfg, args, layer, init, ep_rank, group)
        self.dispatch = getattr(args, "dispatch", "expert")
        self.route_groups, self.groups_per_token = getattr(args, "route_groups", 0), getattr(args, "groups_per_token", 0)
        self.seq_aux_coef = getattr(args, "seq_aux_coef", 0.0)
        self.grouped = getattr(args, "grouped_gemm", False)
        self.overlap_shared = getattr(args, "overlap_shared", False)
        base = args.seed * 1_000_003 + 1009 * (layer + 1)
        self.shared = seeded(base - 1, lambda: gpt2.MLP(cfg).apply(init)) if args.shared_expert else None
        # DeepSeek-V3 sec. 2.1.2: a bias added to the scores for top-k selection only (never to the gates);
        # a buffer, not a parameter: update_bias moves it, not gradients
        self.register_buffer("bias", torch.zeros(args.experts))
        self.load = None  # this step's global routed counts, summed over micro-steps, for update_bias

    def choose(self, scores):
        choice = scores + self.bias
        if self.groups_per_token:
            choice = limit_groups(choice, self.route_groups, self.groups_per_token, self.k)
        return torch.topk(choice, self.k, dim=-1).indices

    def expert_ffn(self, x, rows):
        return grouped_experts(x, self.experts, rows) if self.grouped else super().expert_ffn(x, rows)

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
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
            recv, side = exchange(rows, plan.send_splits, plan.recv_splits, plan.group, during)
            y = combine_tokens(self.run_experts(recv, plan), plan)
            out = (y.view(self.k, N, D) * gates.t().unsqueeze(-1)).sum(0)
        if self.shared is not None:
            out = out + (side if during else self.shared(h))
        if self.training:
            self.stats = self.statistics(logits, scores, plan, h)
            if self.seq_aux_coef:
                # DeepSeek-V3 eq. 17-20, per sequence: f_i = E/(k T) x (tokens of the sequence choosing i),
                # P_i = the sequence's mean normalised affinity; sum_i f_i P_i, averaged over this rank's
                # sequences (the data-parallel gradient average then averages over all sequences)
                probs = scores if self.gate == "softmax" else scores / scores.sum(-1, keepdim=True)
                f = F.one_hot(idx, self.E).sum(1).view(B, T, self.E).sum(1).float() * self.E / (self.k * T)
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
        rows = torch.bincount(expert, minlength=len(self.experts)).tolist()
        y = self.expert_ffn(x[row], rows) * gates[row, expert].unsqueeze(-1)
        return x.new_zeros(x.shape).index_add(0, row, y.to(x.dtype))

def extend_optimizer(opt, moes, args):
    """--balance bias: after each optimizer step, update_bias from the step's global load (a post-step hook)."""
    if args.balance == "bias":
        def after_step(*_):
            update_bias(moes, torch.stack([m.load for m in moes]), args.bias_rate)
            for m in moes:
                m.load = None
        opt.register_step_post_hook(after_step)

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
    """AllToAll whose forward exchange was started earlier (async_op=True, see exchange): forward only waits
    for it; backward is AllToAll's."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group, started):
        ctx.saved = (in_splits, out_splits, group)
        out, work = started
        work.wait()  # NCCL: the compute stream waits for the exchange; gloo: the CPU does
        return out

    @staticmethod
    def backward(ctx, grad):
        return *AllToAll.backward(ctx, grad), None

def exchange(rows, send_splits, recv_splits, group, during=None):
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
    chosen (R, E_local), Plan, during's result); the rows are grouped by source rank, then token."""
    ep = dist.get_world_size(group) if group is not None else 1
    E_local, N = num_experts // ep, x.size(0)
    order, routed, kept = keep_within_capacity(expert_idx, num_experts, capacity)
    expert = expert_idx[order]
    # one key per kept assignment, (destination rank, token); unique() sorts and merges a token's choices
    pair, row_of = torch.unique(expert // E_local * N + order % N, return_inverse=True)
    local = expert % E_local
    token = pair % N
    rows = x[token]  # (P, D): P distinct (rank, token) pairs
    row_gates = gates.new_zeros(pair.numel(), E_local).index_put((row_of, local), gates[order])
    chosen = torch.zeros(pair.numel(), E_local, dtype=torch.uint8, device=x.device).index_put_(
        (row_of, local), torch.ones_like(local, dtype=torch.uint8))
    send = torch.bincount(pair // N, minlength=ep)  # rows to each rank
    if ep == 1:
        n = pair.numel()
        return rows, row_gates, chosen, RankPlan(order, expert_idx.numel(), routed, kept, [n], [n], None, None, None,
                                                 token), during() if during else None
    recv_n = torch.empty_like(send)
    dist.all_to_all_single(recv_n, send, group=group)  # the counts: ep-1 int64s leave this rank
    send_splits, recv_splits = send.tolist(), recv_n.tolist()
    recv_gates = AllToAll.apply(row_gates, send_splits, recv_splits, group)
    recv_chosen = all_to_all(chosen, send_splits, recv_splits, group)
    recv, side = exchange(rows, send_splits, recv_splits, group, during)
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
# Measurement (bytes and time of every collective above, their closed forms), the run's log and the
# expert-load picture, the whole model for model.pt, argument checks, the command line, sampling.
import argparse  # noqa: E402 (the appendix's own imports)
import pickle  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

class A2AMeter(gpt2.CommMeter):
    """Bytes (as CommMeter) and wall time of the all-to-alls. With sync=True the CUDA stream is drained
    around each one so that the time is real (NCCL is asynchronous); that costs overlap, so it is opt-in."""

    def __init__(self, sync=False):
        super().__init__()
        self.seconds, self.sync = 0.0, sync

class TimedWork:
    """An all-to-all started with async_op=True: the time counted is the wait only, so work done between the
    start and the wait (the shared expert under --overlap-shared) shows up as hidden."""

    def __init__(self, work, meter, out):
        self.work, self.meter, self.out = work, meter, out

    def wait(self):
        t0 = time.perf_counter()
        self.work.wait()
        if self.meter.sync and self.out.is_cuda:
            torch.cuda.synchronize(self.out.device)
        self.meter.seconds += time.perf_counter() - t0
        return True

class MeteredDist:
    """torch.distributed as the functions above see it: the module global `dist` is rebound to one of these
    at the end of the file, so the lesson's code calls plain dist.all_to_all_single / dist.all_reduce and the
    bytes that leave this rank are counted here (gpt2.CommMeter's rules: all-reduce 2(n-1)/n x S, all-to-all
    the rows sent to other ranks), with the all-to-alls' wall time. Everything else passes through."""

    def __init__(self):
        self.a2a, self.comm = A2AMeter(), gpt2.CommMeter()

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    def all_reduce(self, tensor, *a, group=None, **k):
        self.comm.all_reduce(tensor.numel() * tensor.element_size(), torch.distributed.get_world_size(group))
        return torch.distributed.all_reduce(tensor, *a, group=group, **k)

    def all_to_all_single(self, out, x, out_splits=None, in_splits=None, group=None, async_op=False):
        n, me = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        row = math.prod(x.shape[1:]) * x.element_size()
        self.a2a.all_to_all((sum(in_splits) - in_splits[me]) * row if in_splits else (n - 1) * x.size(0) // n * row)
        sync = self.a2a.sync and x.is_cuda
        if async_op:
            return TimedWork(torch.distributed.all_to_all_single(out, x, out_splits, in_splits, group=group,
                                                                 async_op=True), self.a2a, out)
        if sync:
            torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        torch.distributed.all_to_all_single(out, x, out_splits, in_splits, group=group)
        if sync:
            torch.cuda.synchronize(x.device)
        self.a2a.seconds += time.perf_counter() - t0

def a2a_bytes_closed(moes, ep, recompute):
    """This rank's all-to-all bytes in one micro-step, from what its routing sent. Per layer, with row = D x
    dtype bytes: the forward sends rows_out token rows away (dispatch) and rows_in back (combine); backward
    sends their gradients the other way (rows_in + rows_out again); activation checkpointing re-runs the
    forward, counts exchange included. --dispatch expert: rows are assignments, counts (ep-1) x E/ep int64s.
    --dispatch rank: rows are (token, rank) pairs, each also carrying E/ep fp32 gates (and their gradients back)
    and E/ep uint8 choice flags; counts (ep-1) int64s."""
    if ep == 1:
        return 0
    total, fwd_passes = 0, 2 if recompute else 1
    for m in moes:
        plan, row, local = m.stats["plan"], m.stats["row_bytes"], m.E // ep
        me = torch.distributed.get_rank(plan.group)
        out, back = sum(plan.send_splits) - plan.send_splits[me], sum(plan.recv_splits) - plan.recv_splits[me]
        if getattr(m, "dispatch", "expert") == "rank":
            fwd = out * (row + 5 * local) + back * row + (ep - 1) * 8
            bwd = out * row + back * (row + 4 * local)
        else:
            fwd = (out + back) * row + (ep - 1) * local * 8
            bwd = (out + back) * row
        total += fwd_passes * fwd + bwd
    return total

def a2a_bytes_uniform(args, n_tokens, row_bytes, drop=0.0):
    """a2a_bytes_closed for one layer and one micro-step if routing were uniform (and not node-limited):
    --dispatch expert: (ep-1)/ep of the kept N*k assignments leave the rank; --dispatch rank: a token goes
    once to each other rank holding any of its k experts, which happens with chance
    1 - C(E - E/ep, k) / C(E, k) per rank (1 for E/ep = 1: no saving when every rank holds one expert)."""
    ep, E, k = args.ep, args.experts, args.top_k
    if ep == 1:
        return 0.0
    fwd_passes, local = (2 if args.activation_checkpointing else 1), E // ep
    if args.dispatch == "rank":
        pairs = n_tokens * (1 - drop) * (ep - 1) * (1 - math.comb(E - local, k) / math.comb(E, k))
        return fwd_passes * (pairs * (2 * row_bytes + 5 * local) + (ep - 1) * 8) + pairs * (2 * row_bytes + 4 * local)
    rows = n_tokens * k * (1 - drop) * (ep - 1) / ep
    return fwd_passes * (2 * rows * row_bytes + (ep - 1) * local * 8) + 2 * rows * row_bytes

class RunLog:
    """What train() reports: gpt2.Metrics (loss, lr, tokens/s, comm), per step the balancing loss, drop rate,
    expert loads and the all-to-all bytes beside their closed forms (from the step's routing, and for uniform
    routing), the profiler, and at the end loss.png and expert_load.png."""

    def __init__(self, args, ctx, model, experts):
        cfg, world = model.config, ctx.world
        expert_size = sum(p.numel() for p in model.h[0].mlp.experts[0].parameters())  # a token visits k experts
        active = model.num_params() - sum(p.numel() for p in experts) + cfg.n_layer * args.top_k * expert_size
        self.metrics = gpt2.Metrics(args, ctx, cfg, active, args.batch_size * args.seq_len * args.grad_accum * world)
        self.profiler = gpt2.Profiler(args, ctx)
        self.args, self.ctx, self.cfg, self.loads, self.closed = args, ctx, cfg, [], 0
        self.row_bytes = cfg.n_embd * ctx.dtype.itemsize
        dist.a2a.sync = args.time_a2a
        self.discard()
        print0(f"model {args.model}: {active / 1e6:.2f}M active non-embedding params, {cfg.n_layer} MoE layers x "
               f"{args.experts} experts (top-{args.top_k}) | EP {args.ep} x DP {world // args.ep} | device "
               f"{ctx.device} {ctx.dtype}")

    def discard(self):
        dist.a2a.take_mb(), dist.comm.take_mb()
        dist.a2a.seconds = 0.0

    def start_step(self, step):
        self.profiler.step(step)
        self.metrics.start_step()
        self.closed, self.counts = 0, 0

    def micro_step(self, moes, counts):
        self.closed += a2a_bytes_closed(moes, self.args.ep, self.args.activation_checkpointing)
        self.counts = self.counts + counts  # (L, 2, E) global (routed, kept) per expert

    def step(self, step, sums, lr):
        """sums: (train loss, balancing loss) of this rank, averaged here over all ranks."""
        args, counts = self.args, self.counts
        if self.ctx.world > 1:
            dist.all_reduce(sums)
            sums /= self.ctx.world
        loss_val, aux_val = sums.tolist()
        gpt2.check_finite(loss_val, step)
        routed, kept = counts[:, 0].float(), counts[:, 1].float()
        load = routed / routed.mean(-1, keepdim=True)  # 1.0 = perfectly balanced
        self.loads.append(load.tolist())
        drop = 1 - kept.sum().item() / routed.sum().item()
        a2a_mb, a2a_ms = dist.a2a.take_mb(), dist.a2a.seconds * 1e3
        dist.a2a.seconds = 0.0
        theory_mb = args.grad_accum * self.cfg.n_layer * a2a_bytes_uniform(
            args, args.batch_size * args.seq_len, self.row_bytes, drop) / 1e6
        self.metrics.log_step(step, loss_val, lr, comm_mb=a2a_mb + dist.comm.take_mb(), aux_loss=aux_val,
                              drop_rate=drop, a2a_mb=a2a_mb, a2a_mb_closed=self.closed / 1e6, a2a_mb_theory=theory_mb,
                              a2a_ms=a2a_ms, max_load=load.max().item(),
                              expert_load=[[round(v, 4) for v in layer] for layer in load.tolist()])
        print0(f"      moe | aux {aux_val:.5f} | drop {100 * drop:5.2f}% | max/mean load {load.max().item():.2f} | "
               f"a2a {a2a_mb:.3f} MB (closed form {self.closed / 1e6:.3f}, uniform routing {theory_mb:.3f}) {a2a_ms:.1f} ms")

    def evaluate(self, step, model, val_loader):
        def val_loss(x, y):
            with self.ctx.autocast():
                return model(x, y)[1]
        model.eval()
        self.metrics.log_val(step, gpt2.evaluate(val_loss, val_loader, self.args.eval_steps, self.ctx.device))
        model.train()
        self.discard()  # validation traffic is not part of a training step

    def finish(self):
        self.metrics.plot()
        out = self.args.out
        if self.ctx.master and self.loads:
            plot_expert_load(self.loads, self.args, os.path.join(out, "expert_load.png"))
            print0(f"wrote {out}/model.pt, {out}/loss.png and {out}/expert_load.png "
                   f"(sample: python moe_ep.py sample --init-from {out}/model.pt)")
        return self.metrics.records

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

def compile_parts(model):
    """--compile: attention whole (static shapes); the experts see a different row count each call (dynamic)."""
    for b in model.h:
        b.attn.compile()
        for e in b.mlp.experts:
            e.compile(dynamic=True)

def save_moe(model, args, master, ep_group):
    """OUT/model.pt with all E experts of every layer (full_state_dict: a collective, every rank takes part)."""
    state = full_state_dict(model, ep_group, args.ep)
    if master:
        moe = {k: getattr(args, k) for k in ("experts", "top_k", "gate", "norm_topk", "shared_expert", "route_groups",
                                             "groups_per_token")}
        gpt2.save_model(os.path.join(args.out, "model.pt"), model.config, state, moe=moe)

def full_state_dict(model, ep_group, ep):
    """The whole MoE's weights, as one process would hold them: each layer's local experts flattened and
    all-gathered over the EP group, then renamed by their global index (rank r's expert j is r*E/ep + j)."""
    state = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
    for i, block in enumerate(model.h):
        named = list(block.mlp.experts.named_parameters())  # ("0.c_fc.weight", p), ...
        flat = torch.cat([p.detach().reshape(-1) for _, p in named])
        parts = [flat]
        if ep > 1:
            parts = [torch.empty_like(flat) for _ in range(ep)]
            dist.all_gather(parts, flat, group=ep_group)
        for r, part in enumerate(parts):
            for (name, p), chunk in zip(named, part.split([p.numel() for _, p in named])):
                j, rest = name.split(".", 1)
                state[f"h.{i}.mlp.experts.{r * len(block.mlp.experts) + int(j)}.{rest}"] = chunk.view_as(p).clone()
    return state

def check_args(args, world):
    """Every mistake found before the first collective, so it is an error message and not a hang."""
    gpt2.check_args(args)
    gpt2.check_range(args.ep, "--ep", 1, todo="give a positive integer")
    if args.experts < 1:
        gpt2.fail(f"--experts is {args.experts}", "--experts", "give a positive number of experts")
    if args.experts % args.ep:
        gpt2.fail(f"{args.experts} experts do not split evenly over {args.ep} ranks", "--experts/--ep",
                  "give a number of experts divisible by --ep")
    if not 1 <= args.top_k <= args.experts:
        gpt2.fail(f"--top-k {args.top_k} is outside [1, {args.experts}]", "--top-k",
                  "route each token to at least 1 and at most --experts experts")
    if world % args.ep:
        gpt2.fail(f"{world} ranks do not form groups of --ep {args.ep}", "--ep", "give a divisor of the world size")
    if args.norm_topk and args.top_k == 1:
        gpt2.fail("--norm-topk with --top-k 1 makes every gate 1", "--norm-topk",
                  "drop --norm-topk or route to --top-k 2 or more (the router would learn from the aux loss only)")
    if args.z_loss is None:
        # ST-MoE's z-loss keeps the softmax's logits small, so exp() neither overflows nor rounds the
        # probabilities away; a sigmoid router has no softmax to protect (DeepSeek-V3 uses none)
        args.z_loss = 1e-3 if args.gate == "softmax" else 0.0
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
    for flag in ("aux_coef", "z_loss", "seq_aux_coef", "bias_rate"):  # a negative one rewards imbalance
        gpt2.check_range(getattr(args, flag), "--" + flag.replace("_", "-"), 0, todo="give 0 (off) or a positive coefficient")
    gpt2.check_range(args.capacity_factor, "--capacity-factor", 0, todo="give 0 (dropless) or a positive factor")
    if args.overlap_shared and not args.shared_expert:
        gpt2.fail("--overlap-shared without a shared expert to overlap", "--overlap-shared", "add --shared-expert")

def make_parser():
    p = gpt2.make_parser("Train a Mixture-of-Experts GPT-2 with expert parallelism (torchrun for several ranks).")
    a = p.add_argument
    a("--ep", type=int, default=1, help="expert-parallel size: experts are split over groups of this many ranks")
    a("--experts", type=int, default=4, help="routed experts per MoE layer (each shaped as GPT-2's MLP)")
    a("--top-k", type=int, default=2, help="experts per token")
    a("--capacity-factor", type=float, default=0.0, help="expert capacity = C*tokens*k/E per rank; 0 = dropless")
    a("--gate", default="softmax", choices=["softmax", "sigmoid"], help="softmax top-k probabilities, or DeepSeek-V3 sigmoid renormalised over k")
    a("--shared-expert", action="store_true", help="add one always-on expert per layer (DeepSeek-V3), data parallel")
    a("--balance", default="aux", choices=["aux", "bias", "none"], help="Switch aux loss, DeepSeek-V3 aux-loss-free bias, or nothing")
    a("--aux-coef", type=float, default=0.01, help="alpha of the Switch load-balancing loss")
    a("--norm-topk", action="store_true", help="renormalise softmax gates over the chosen k (Mixtral, DeepSeek-V2); "
      "sigmoid gates always are")
    a("--z-loss", type=float, default=None, help="coefficient of the router z-loss (0 = off); default 1e-3 for "
      "--gate softmax, 0 for sigmoid")
    a("--bias-rate", type=float, default=1e-3, help="gamma: bias update speed of --balance bias")
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
    a("--time-a2a", action="store_true", help="synchronize CUDA around each all-to-all to time it (costs overlap)")
    return p

def load_moe(path, device="cpu"):
    """OUT/model.pt written by train() -> the MoE GPT-2 in one process (all experts, dropless), for sampling
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
    moe = ckpt["moe"]
    args = argparse.Namespace(**moe, ep=1, capacity_factor=0.0, seed=0)
    layer = DeepSeekMoE if "h.0.mlp.bias" in ckpt["model"] else MoE  # the class that wrote it (bias: DeepSeekMoE)
    for i, block in enumerate(model.h):
        block.mlp = layer(cfg, args, i, model.init_weights)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()

def sample(argv):
    """`python moe_ep.py sample --init-from OUT/model.pt`: gpt2.py's sample command with the MoE loader."""
    gpt2.sample(argv, load_model=load_moe, prog="moe_ep.py sample", init_help="OUT/model.pt of a moe_ep.py run")

dist = MeteredDist()  # from here on, every collective of this file is counted (see MeteredDist)

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "sample":
        gpt2.run_main(sample, sys.argv[2:])
    else:
        gpt2.run_main(train)
