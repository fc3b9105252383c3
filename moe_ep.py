"""
moe_ep.py - a Mixture-of-Experts GPT-2 trained with expert parallelism: the MLP of every block becomes
E expert MLPs and a router that sends each token to its top-k experts; the experts are split across EP
ranks, and tokens travel to their experts and back by two hand-written all-to-alls per layer.

The idea: a token runs only k of the E expert MLPs, so parameters grow with E and FLOPs per token with k:
E times the dense MLP's parameters for k times its FLOPs (Shazeer et al. 2017; GShard; Switch Transformer;
top-2 of 8 at 124M: 578M held, 237.8M used per token vs the dense 124.5M; train() prints `active`). The experts do
not fit, or do not run fast, on one GPU, so rank r of an EP group keeps experts [r*E/ep, (r+1)*E/ep) only.
In each MoE layer a rank routes its own tokens, sorts them by destination expert, swaps counts, then swaps
the tokens themselves (all_to_all_single with uneven splits), runs its local experts on what it received,
sends the results back by the reverse all-to-all, puts them in token order and weights them by the gates.
Everything that is not an expert (attention, LayerNorms, embeddings, routers) is plain data parallel.

    world = 4, --ep 2 --experts 4: two EP groups {0,1} {2,3}; each expert has world/ep = 2 replicas
               rank 0          rank 1        |   rank 2          rank 3
    data       rows [0,B)      rows [B,2B)   |   rows [2B,3B)    rows [3B,4B)
    dense      attention, LayerNorms, wte/wpe, routers: a full copy everywhere, grads all-reduced over 4
    experts    e0 e1           e2 e3         |   e0 e1           e2 e3    (e0's grads: all-reduced over {0,2})
    one MoE layer, inside an EP group:
      router -> top-k -> sort by expert -> a2a counts -> a2a tokens ===> local experts ===> a2a back
      -> unsort -> sum_k gate_k * y_k  (+ shared expert)  -> residual add (dropped tokens: residual only)

    load balancing (--balance): aux = alpha*E*sum_i f_i*P_i (Switch eq. 4-6) from GLOBAL counts f_i;
      bias = DeepSeek-V3's aux-loss-free bias b_i, used for top-k selection only, b_i += gamma*sign(mean-load_i)
    router z-loss (--z-loss) = mean logsumexp(router logits)^2 (ST-MoE's router z-loss): on by default (1e-3)
      for softmax routers only; gates: softmax top-k probabilities as they are (sum < 1; --norm-topk
      renormalises them), sigmoid affinities always renormalised over the chosen k (DeepSeek-V3)

DeepSeek-V3's dispatch, each a flag that is off by default (off = the behaviour above, tested):
    --dispatch rank          one row per (token, destination rank) instead of per chosen expert; the gates
                             travel with it and the receiver sums its local experts' outputs before the combine
    --route-groups G --groups-per-token M   node-limited routing (sec. 2.1.2): experts in G groups (one
                             node's worth each), a token's k experts from at most M groups; G is fixed by the
                             flag, not by --ep, so the one-rank run routes exactly as the EP run
    --seq-aux-coef a         the sequence-wise balance loss (eq. 17-20) beside the batch-wise one
    --grouped-gemm           local experts as grouped GEMMs (torch._grouped_mm, or one padded bmm)
    --overlap-shared         the shared expert computes while the dispatch all-to-all is in flight

GPT-2 124M at 8 ranks (tests/bench_moe_ep.py --per-rank-124m), the launch below: 8 experts top-2 + 1 shared
expert per layer, --ep 8 (one routed expert per rank per layer), B=16, T=1024, bf16:
    params/rank   181.2M = 124.5M (GPT-2) + 12 layers x (1 routed + 1 shared - 1 dense MLP) x 4.72M + 12 x 8 x 768
                  (router); the whole model holds 578M, a token uses 124.5M + 12 x 2 x 4.72M = 237.8M of them
    memory/rank   params 724.9 + grads 724.9 + AdamW 1449.8 = 2899.5 MB = 16 B x 181.2M (measured = closed form);
                  ddp.py's 124M: 1991.6 MB. Activations saved for backward 16.1 GB (17.3 GB with --dispatch rank)
    bytes/step    all-to-all 2114 MB = 4 exchanges x 12 layers x 16384 tokens x 2 choices x 7/8 remote x 768 x 2 B
                  (uniform routing) + dense all-reduce 872 MB = 2 x 7/8 x 4 B x 124.55M: closed form 2986 MB,
                  measured 2846 MB (rank 0's routing at init sends 93% of the uniform remote share); ddp.py: 871 MB.
    --dispatch rank saves nothing here: with one expert per rank a token's 2 experts always sit on 2 ranks,
    and each row carries 9 more bytes (gates + flags): closed form 2989 MB. It pays when a rank holds
    several experts (tests: 4 experts on 2 ranks, 3706 vs 4368 bytes per layer step at rank 0).

Launch:
    python moe_ep.py --experts 4 --top-k 2                                      # 1 process, all experts
    torchrun --nproc_per_node=2 moe_ep.py --ep 2 --batch-size 4 --experts 4     # same run, 2 EP ranks
    torchrun --nproc_per_node=8 moe_ep.py --model gpt2 --ep 8 --experts 8 --top-k 2 --gate sigmoid \
        --balance bias --shared-expert --data data/fineweb10B --batch-size 16 --compile
Equivalence: in fp32 and dropless (--capacity-factor 0) every --ep x data-parallel layout with the same
global batch reproduces the 1-process loss curve step by step (tests/test_moe_ep.py); in bf16, EP=2 stays
within 2e-6 of its one-rank bf16 run; --compile (attention whole, experts with dynamic shapes) equals eager.
Sampling: train() all-gathers every layer's experts over the EP group and writes OUT/model.pt with all E of
them; gpt2.py's loaders build a dense GPT-2 and cannot read it, so this file samples it itself:
    python moe_ep.py sample --init-from out/model.pt --prompt "Hello"    # one process, dropless (load_moe)

References: Shazeer et al. 2017 (sparsely-gated MoE); Lepikhin et al. 2020, GShard sec. 2.2 (capacity,
top-2, all-to-all dispatch); Fedus et al. 2021, Switch Transformer sec. 2.2 (capacity factor, aux loss);
Zoph et al. 2022, ST-MoE (router z-loss); DeepSeek-AI 2024, DeepSeek-V3 sec. 2.1.2 (sigmoid
gates, auxiliary-loss-free balancing, shared expert, node-limited routing, sequence-wise loss), sec. 3.2.2
(dispatch once per node, combine after local summation); Megatron-LM / torchtitan expert parallelism.
Uses from gpt2.py: build_model (the dense GPT-2 whose MLPs become MoE layers), MLP, make_loaders,
optimizer_groups / make_adamw / set_lr, evaluate, make_parser / check_args / fail / setup / run_main, CommMeter,
Metrics, Profiler.
"""
import argparse
import math
import os
import pickle
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpt2
from gpt2 import print0

# ----------------------------------------------------------------------------------------------------
# Communication: all-to-all with uneven splits, and its gradient


class Pending:
    """An all-to-all in flight (async_op=True): wait() returns the received rows. The time counted is the
    wait only, so work done between the start and the wait (the shared expert) shows up as hidden."""

    def __init__(self, out, work, meter):
        self.out, self.work, self.meter = out, work, meter

    def wait(self):
        t0 = time.perf_counter()
        self.work.wait()  # NCCL: the compute stream waits for the exchange; gloo: the CPU does
        if self.meter.sync and self.out.is_cuda:
            torch.cuda.synchronize(self.out.device)
        self.meter.seconds += time.perf_counter() - t0
        return self.out


def all_to_all(x, in_splits, out_splits, group, meter, async_op=False):
    """Rows x[sum(in_splits[:j]) : sum(in_splits[:j+1])] go to rank j of `group`; returns the rows received,
    ordered by source rank, sum(out_splits) of them (or, with async_op, a Pending that returns them)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    me = dist.get_rank(group)
    meter.all_to_all((sum(in_splits) - in_splits[me]) * math.prod(x.shape[1:]) * x.element_size())
    if async_op:
        return Pending(out, dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                                   async_op=True), meter)
    if meter.sync and x.is_cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if meter.sync and x.is_cuda:
        torch.cuda.synchronize(x.device)
    meter.seconds += time.perf_counter() - t0
    return out


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the gradient of a received row belongs to the rank that sent it, so the
    backward is the same exchange with the splits swapped (GShard sec. 2.2: dispatch and combine are each
    other's transpose). pending: the same exchange of x already started with async_op=True; forward only
    waits for it (--overlap-shared)."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group, meter, pending=None):
        ctx.saved = (in_splits, out_splits, group, meter)
        return pending.wait() if pending is not None else all_to_all(x, in_splits, out_splits, group, meter)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits, group, meter = ctx.saved
        return all_to_all(grad, out_splits, in_splits, group, meter), None, None, None, None, None


def exchange(rows, send_splits, recv_splits, group, meter, during):
    """AllToAll of rows, with `during()` (autograd on) computed while the exchange is in flight; returns
    (received rows, during's result or None)."""
    if during is None:
        return AllToAll.apply(rows, send_splits, recv_splits, group, meter), None
    pending = all_to_all(rows.detach(), send_splits, recv_splits, group, meter, async_op=True)
    side = during()
    return AllToAll.apply(rows, send_splits, recv_splits, group, meter, pending), side


# ----------------------------------------------------------------------------------------------------
# Dispatch and combine: route assignments to the ranks holding their experts, and bring them back


@dataclass
class Plan:
    """What dispatch_tokens decided, and what combine_tokens needs to undo it."""
    order: torch.Tensor  # kept assignment ids, sorted by expert (so also by destination rank)
    n_assign: int  # all assignments, kept or dropped: N tokens x k choices
    routed: torch.Tensor  # (E,) assignments per expert before capacity
    kept: torch.Tensor  # (E,) assignments per expert after capacity
    send_splits: list  # rows to each EP rank
    recv_splits: list  # rows from each EP rank
    recv_counts: torch.Tensor  # (ep, E_local): rows from each source rank for each local expert
    expert_rows: list  # rows per local expert, all sources together
    group: object
    meter: "A2AMeter"
    side: object = None  # what `during` returned (the shared expert's output under --overlap-shared)
    token: torch.Tensor = None  # --dispatch rank: the token of each row sent


def keep_within_capacity(expert_idx, num_experts, capacity):
    """Assignment ids sorted by expert (stable: first choices, then earlier tokens, GShard sec. 2.2's
    priority), minus those beyond `capacity` per expert (None = dropless); and the counts per expert
    before (routed) and after (kept) the cut."""
    order = torch.argsort(expert_idx, stable=True)
    routed = torch.bincount(expert_idx, minlength=num_experts)
    kept = routed
    if capacity is not None:
        first = torch.cumsum(routed, 0) - routed  # where each expert's run starts in `order`
        slot = torch.arange(order.numel(), device=expert_idx.device) - first[expert_idx[order]]
        order, kept = order[slot < capacity], routed.clamp(max=capacity)
    return order, routed, kept


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
def dispatch_tokens(x, expert_idx, num_experts, capacity, group, meter, during=None):
    """x: (N, D) this rank's tokens; expert_idx: (k*N,) the expert of each assignment, assignment a being
    token a % N (choice-major: all first choices, then all second choices). Assignments beyond `capacity`
    per expert (None = dropless) are dropped, first choices and earlier tokens first (GShard sec. 2.2).
    Returns the rows this rank's experts must process, grouped by source rank then local expert, and the Plan.
    One row per kept assignment: a token whose k experts share a rank travels there k times."""
    ep = dist.get_world_size(group) if group is not None else 1
    E, E_local, N = num_experts, num_experts // ep, x.size(0)
    order, routed, kept = keep_within_capacity(expert_idx, E, capacity)
    rows = x[order % N]
    if ep == 1:
        n = order.numel()
        return rows, Plan(order, expert_idx.numel(), routed, kept, [n], [n], kept.view(1, E), kept.tolist(), None,
                          meter, during() if during else None)
    # 1) counts: every rank learns how many rows it will receive from each source for each local expert
    recv_counts = torch.empty_like(kept)
    dist.all_to_all_single(recv_counts, kept, group=group)
    meter.all_to_all((ep - 1) * E_local * kept.element_size())
    recv_counts = recv_counts.view(ep, E_local)
    # the uneven splits must be host integers: one device->host copy per layer, the price of dropless EP
    host = torch.cat([kept.view(ep, E_local).sum(1), recv_counts.sum(1), recv_counts.sum(0)]).tolist()
    send_splits, recv_splits, expert_rows = host[:ep], host[ep:2 * ep], host[2 * ep:]
    # 2) the tokens themselves (with --overlap-shared, the shared expert computes while they travel)
    recv, side = exchange(rows, send_splits, recv_splits, group, meter, during)
    return recv, Plan(order, expert_idx.numel(), routed, kept, send_splits, recv_splits, recv_counts,
                      expert_rows, group, meter, side)


def combine_tokens(y, plan):
    """Inverse of dispatch_tokens: y holds the expert outputs of the received rows (same order); returns
    (n_assign, D) in assignment order, zeros where an assignment was dropped."""
    if plan.group is not None:
        y = AllToAll.apply(y, plan.recv_splits, plan.send_splits, plan.group, plan.meter)
    return y.new_zeros((plan.n_assign, y.size(1))).index_copy(0, plan.order, y)


def dispatch_by_rank(x, expert_idx, gates, num_experts, capacity, group, meter, during=None):
    """--dispatch rank, as DeepSeek-V3 runs it (sec. 3.2.2; DeepEP): one row per (token, destination rank),
    however many of the token's experts that rank holds. Beside each row travel its gates for the receiver's
    local experts (fp32, 0 where not chosen) and which of them were chosen (uint8), so the receiver can run
    every chosen local expert and sum their gated outputs into ONE row before the combine. Same capacity rule
    as dispatch_tokens. gates: (k*N,) in expert_idx's order. Returns (rows (R, D), their gates (R, E_local),
    chosen (R, E_local), Plan); the rows are grouped by source rank, then token."""
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
        return rows, row_gates, chosen, Plan(order, expert_idx.numel(), routed, kept, [n], [n], None, None, None,
                                             meter, during() if during else None, token)
    recv_n = torch.empty_like(send)
    dist.all_to_all_single(recv_n, send, group=group)  # the counts: ep-1 int64s leave this rank
    meter.all_to_all((ep - 1) * send.element_size())
    send_splits, recv_splits = send.tolist(), recv_n.tolist()
    recv_gates = AllToAll.apply(row_gates, send_splits, recv_splits, group, meter)
    recv_chosen = all_to_all(chosen, send_splits, recv_splits, group, meter)
    recv, side = exchange(rows, send_splits, recv_splits, group, meter, during)
    return recv, recv_gates, recv_chosen, Plan(order, expert_idx.numel(), routed, kept, send_splits, recv_splits,
                                               None, None, group, meter, side, token)


def combine_by_rank(y, plan, n_tokens):
    """Inverse of dispatch_by_rank: y (R, D) holds each received row's summed, gated local-expert outputs;
    back to the senders, then each token sums its rows (one per destination rank): (N, D)."""
    if plan.group is not None:
        y = AllToAll.apply(y, plan.recv_splits, plan.send_splits, plan.group, plan.meter)
    return y.new_zeros((n_tokens, y.size(1))).index_add(0, plan.token, y)


# ----------------------------------------------------------------------------------------------------
# The MoE layer: router, load balancing, local experts


def seeded(seed, make):
    """make() under its own seed, without disturbing the global RNG: every expert's weights are a function
    of (seed, layer, expert) only, so all EP layouts build identical experts and each rank builds only its own."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator only: modules are built on the CPU
        return make()


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


class MoE(nn.Module):
    """Drop-in for gpt2.MLP: (B, T, D) -> (B, T, D). E experts shaped as gpt2.MLP, of which this rank holds
    experts [ep_rank*E/ep, (ep_rank+1)*E/ep). After a training forward, self.stats holds what the balancing
    losses and the load log need."""

    def __init__(self, cfg, args, layer, init, ep_rank=0, group=None, meter=None):
        super().__init__()
        E, ep = args.experts, args.ep
        self.E, self.k, self.gate, self.cf = E, args.top_k, args.gate, args.capacity_factor
        self.norm_topk = getattr(args, "norm_topk", False)
        self.dispatch = getattr(args, "dispatch", "expert")
        self.route_groups, self.groups_per_token = getattr(args, "route_groups", 0), getattr(args, "groups_per_token", 0)
        self.seq_aux = getattr(args, "seq_aux_coef", 0.0) > 0
        self.grouped = getattr(args, "grouped_gemm", False)
        self.overlap_shared = getattr(args, "overlap_shared", False)
        self.group, self.meter = group, meter or A2AMeter()
        base = args.seed * 1_000_003 + 1009 * (layer + 1)

        def build(module):
            module.apply(init)  # gpt2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2L)
            return module

        self.router = seeded(base, lambda: build(nn.Linear(cfg.n_embd, E, bias=False)))
        lo = ep_rank * (E // ep)
        self.experts = nn.ModuleList(seeded(base + 1 + e, lambda: build(gpt2.MLP(cfg))) for e in range(lo, lo + E // ep))
        self.shared = seeded(base - 1, lambda: build(gpt2.MLP(cfg))) if args.shared_expert else None
        # DeepSeek-V3 sec. 2.1.2: a bias added to the scores for top-k selection only (never to the gates);
        # a buffer, not a parameter: it is moved by update_bias, not by gradients
        self.register_buffer("bias", torch.zeros(E))
        self.stats = None

    def route(self, h):
        """Top-k experts and gates of each token. The router runs in fp32 even under autocast: tiny logit
        differences flip top-k choices, and exp() of bf16 logits is coarse (Switch sec. 2.4, selective precision)."""
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.router.weight.float())
        scores = logits.softmax(-1) if self.gate == "softmax" else logits.sigmoid()
        choice = scores + self.bias
        if self.groups_per_token:
            choice = limit_groups(choice, self.route_groups, self.groups_per_token, self.k)
        idx = torch.topk(choice, self.k, dim=-1).indices
        gates = scores.gather(-1, idx)
        # Softmax gates stay the top-k probabilities (GShard sec. 2.2 keeps them, Switch sec. 2.1 gates by p_i):
        # they sum to less than 1, so a token whose chosen experts got little of the probability mass moves
        # its residual less, and the LM loss reaches the router through the gate values themselves; with
        # k = 1 renormalising would make every gate exactly 1 and leave the router no gradient but the aux
        # loss. --norm-topk renormalises over the chosen k, as Mixtral and DeepSeek-V2 (norm_topk_prob) do.
        # Sigmoid affinities do not sum to 1 over the experts, so DeepSeek-V3 sec. 2.1.2 always renormalises.
        if self.gate == "sigmoid" or self.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        return logits, scores, idx, gates

    def capacity(self, n_tokens):
        """Switch sec. 2.2: expert capacity = C * tokens * k / E per source rank; 0 = dropless."""
        return None if self.cf == 0 else math.ceil(self.cf * n_tokens * self.k / self.E)

    def expert_ffn(self, x, rows):
        """Local expert i on rows [sum(rows[:i]), sum(rows[:i+1])) of x: one matmul pair per expert, or all
        of them as two grouped GEMMs (--grouped-gemm)."""
        if self.grouped:
            return grouped_experts(x, self.experts, rows)
        return torch.cat([expert(xs) for expert, xs in zip(self.experts, x.split(rows))])

    def run_experts(self, x, plan):
        """Received rows come grouped by source rank, then local expert: regroup them by expert, run each
        expert on its contiguous slice, and restore the received order."""
        ep, E_local = plan.recv_counts.shape
        regroup = None
        if ep > 1:
            eid = torch.arange(E_local, device=x.device).repeat(ep).repeat_interleave(plan.recv_counts.flatten())
            regroup = torch.argsort(eid, stable=True)
            x = x[regroup]
        y = self.expert_ffn(x, plan.expert_rows)
        return y if regroup is None else y[torch.argsort(regroup)]

    def run_experts_by_rank(self, x, gates, chosen):
        """--dispatch rank, on the receiving side: x (R, D) one row per (source token, this rank); every chosen
        local expert runs on its rows, and each row's gated outputs are summed: (R, D), one row back per row."""
        expert, row = chosen.t().nonzero(as_tuple=True)  # (expert, row) pairs, grouped by expert
        rows = torch.bincount(expert, minlength=len(self.experts)).tolist()
        y = self.expert_ffn(x[row], rows) * gates[row, expert].unsqueeze(-1)
        return x.new_zeros(x.shape).index_add(0, row, y.to(x.dtype))

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
        N = h.size(0)
        logits, scores, idx, gates = self.route(h)
        if torch.is_autocast_enabled(h.device.type):  # ship bf16: the experts would cast to it anyway
            h = h.to(torch.get_autocast_dtype(h.device.type))
        during = (lambda: self.shared(h)) if self.shared is not None and self.overlap_shared else None
        if self.dispatch == "rank":
            recv, recv_gates, chosen, plan = dispatch_by_rank(h, idx.t().reshape(-1), gates.t().reshape(-1), self.E,
                                                              self.capacity(N), self.group, self.meter, during)
            out = combine_by_rank(self.run_experts_by_rank(recv, recv_gates, chosen), plan, N)
        else:
            recv, plan = dispatch_tokens(h, idx.t().reshape(-1), self.E, self.capacity(N), self.group, self.meter, during)
            y = combine_tokens(self.run_experts(recv, plan), plan)
            out = (y.view(self.k, N, D) * gates.t().unsqueeze(-1)).sum(0)  # dropped choices add nothing
        if self.shared is not None:
            out = out + (plan.side if during else self.shared(h))
        if self.training:
            me = 0 if plan.group is None else dist.get_rank(plan.group)
            probs = scores if self.gate == "softmax" else scores / scores.sum(-1, keepdim=True)
            self.stats = {"routed": plan.routed, "kept": plan.kept, "P": probs.mean(0),
                          "rows_out": sum(plan.send_splits) - plan.send_splits[me],  # rows this rank sends away
                          "rows_in": sum(plan.recv_splits) - plan.recv_splits[me],  # and receives (sends back)
                          "row_bytes": h.size(1) * h.element_size(),
                          "z": torch.logsumexp(logits, -1).square().mean()}
            if self.seq_aux:
                # DeepSeek-V3 eq. 17-20, per sequence: f_i = E/(k T) x (tokens of the sequence choosing i),
                # P_i = the sequence's mean normalised affinity; sum_i f_i P_i, averaged over this rank's
                # sequences (the data-parallel gradient average then averages over all sequences)
                f = F.one_hot(idx, self.E).sum(1).view(B, T, self.E).sum(1).float() * self.E / (self.k * T)
                self.stats["seq_aux"] = (f * probs.view(B, T, self.E).mean(1)).sum(-1).mean()
        return out.view(B, T, D)


# ----------------------------------------------------------------------------------------------------
# Load balancing: global statistics, auxiliary losses, the aux-loss-free bias


def global_counts(moes, world, meter):
    """(L, 2, E) assignments per expert (routed, kept) summed over ALL ranks: one all-reduce of L*2*E ints per
    micro-step. With these global counts every layout computes the same balancing signal as one process."""
    counts = torch.stack([torch.stack([m.stats["routed"], m.stats["kept"]]) for m in moes])
    if world > 1:
        dist.all_reduce(counts)
        meter.all_reduce(counts.numel() * counts.element_size(), world)
    return counts


def balance_loss(moes, counts, args):
    """Switch eq. 4: alpha*E*sum_i f_i*P_i per layer, f_i the fraction of the global batch's k*N routing
    choices that picked expert i (from `counts`, not differentiable), P_i this rank's mean router probability.
    The global P_i is the mean of the ranks' P_i, and the data-parallel gradient average takes exactly that
    mean, so global f with local P reproduces the one-process loss and gradient. Plus the router z-loss,
    a per-token mean, which the average over ranks also makes global. Summed over layers."""
    loss = torch.zeros((), device=counts.device)
    for m, c in zip(moes, counts):
        if args.balance == "aux":
            f = c[0].float() / c[0].sum()
            loss = loss + args.aux_coef * m.E * (f * m.stats["P"]).sum()
        if args.z_loss:
            loss = loss + args.z_loss * m.stats["z"]
        if m.seq_aux:  # DeepSeek-V3's sequence-wise balance loss, beside whatever --balance does
            loss = loss + args.seq_aux_coef * m.stats["seq_aux"]
    return loss


@torch.no_grad()
def update_bias(moes, load, rate):
    """DeepSeek-V3 sec. 2.1.2: after each step, b_i += gamma * sign(mean load - load_i) with the step's load
    summed over ranks: overloaded experts get picked less, idle ones more, and no gradient is touched."""
    for m, l in zip(moes, load.float()):
        m.bias += rate * torch.sign(l.mean() - l)


# ----------------------------------------------------------------------------------------------------
# Model and gradients


def build_moe_model(args, ep_rank=0, group=None, meter=None):
    """gpt2.build_model (same seed, same dense weights), with every block's MLP replaced by an MoE layer."""
    model = gpt2.build_model(args)
    for i, block in enumerate(model.h):
        block.mlp = MoE(model.config, args, i, model.init_weights, ep_rank, group, meter)
    return model


def make_groups(rank, world, ep):
    """EP groups are blocks of ep consecutive ranks; expert e's replicas are the ranks with the same
    rank % ep. Every rank must create every group, in the same order."""
    ep_group = expert_dp_group = None  # None: a group of one, no communication
    if ep > 1:
        for g in range(world // ep):
            ranks = list(range(g * ep, (g + 1) * ep))
            grp = dist.new_group(ranks)
            ep_group = grp if rank in ranks else ep_group
    if world > ep:
        for j in range(ep):
            ranks = list(range(j, world, ep))
            grp = dist.new_group(ranks)
            expert_dp_group = grp if rank in ranks else expert_dp_group
    return ep_group, expert_dp_group


def all_reduce_grads(params, group, n, world, meter):
    """Sum the gradients over `group` (n ranks) in one flat bucket, then divide by the WORLD size. Why world
    and not n: an expert's gradient already sums, through the backward all-to-all, the losses of every rank
    of its EP group; summing over its n replicas then covers all world ranks, whose mean loss we train on."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if n > 1:
        dist.all_reduce(flat, group=group)
        meter.all_reduce(flat.numel() * flat.element_size(), n)
    flat /= world
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def clip_global_grad_norm(dense, experts, max_norm, ep_group, ep, meter):
    """torch.nn.utils.clip_grad_norm_ on the whole model: dense grads are identical on every rank, expert
    grads are split over the EP group, so their squared norms are summed over it (one float)."""
    sq = lambda ps: sum((p.grad.float().square().sum() for p in ps if p.grad is not None), torch.zeros((), device=dense[0].device))
    expert_sq = sq(experts)
    if ep > 1:
        dist.all_reduce(expert_sq, group=ep_group)
        meter.all_reduce(4, ep)
    norm = (sq(dense) + expert_sq).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in dense + experts:
        if p.grad is not None:
            p.grad.mul_(coef)
    return norm


# ----------------------------------------------------------------------------------------------------
# Training


def train(argv=None):
    args = make_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    check_args(args, world)
    ctx = gpt2.setup(args)
    ep, dp = args.ep, world // args.ep
    ep_group, expert_dp_group = make_groups(ctx.rank, world, ep)
    a2a, meter = A2AMeter(sync=args.time_a2a), gpt2.CommMeter()
    model = build_moe_model(args, ctx.rank % ep, ep_group, a2a).to(ctx.device)
    cfg, moes = model.config, [b.mlp for b in model.h]
    experts = [p for m in moes for p in m.experts.parameters()]
    expert_ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    train_loader, val_loader = gpt2.make_loaders(args, ctx.rank, world, cfg.vocab_size)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
    if args.compile:  # static-shape parts whole; experts see a different row count each call
        for b in model.h:
            b.attn.compile()
            for e in b.mlp.experts:
                e.compile(dynamic=True)
    expert_size = sum(p.numel() for p in moes[0].experts[0].parameters())  # FLOPs count the k experts a token visits
    active = model.num_params() - sum(p.numel() for p in experts) + cfg.n_layer * args.top_k * expert_size
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    metrics = gpt2.Metrics(args, ctx, cfg, active, tokens_per_step)
    profiler = gpt2.Profiler(args, ctx)
    print0(f"model {args.model}: {active / 1e6:.2f}M active non-embedding params, {cfg.n_layer} MoE layers x "
           f"{args.experts} experts (top-{args.top_k}) | EP {ep} x DP {dp} | device {ctx.device} {ctx.dtype}")
    row_bytes = cfg.n_embd * ctx.dtype.itemsize
    loads = []

    def val_loss_fn(x, y):
        with ctx.autocast():
            return model(x, y)[1]

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        sums = torch.zeros(2, device=ctx.device)  # (train loss, balancing loss) of this rank
        counts = torch.zeros(cfg.n_layer, 2, args.experts, dtype=torch.long, device=ctx.device)
        closed_bytes = 0
        for _ in range(args.grad_accum):
            x, y = train_loader.next_batch()
            with ctx.autocast():
                _, loss = model(x.to(ctx.device), y.to(ctx.device))
            c = global_counts(moes, world, meter)
            aux = balance_loss(moes, c, args)
            counts += c
            closed_bytes += a2a_bytes_closed(moes, ep, args.activation_checkpointing)
            sums += torch.stack([loss.detach(), aux.detach()]) / args.grad_accum
            ((loss + aux) / args.grad_accum).backward()
        if world > 1:
            all_reduce_grads(dense, None, world, world, meter)
            all_reduce_grads(experts, expert_dp_group, dp, world, meter)
        if args.grad_clip > 0:
            clip_global_grad_norm(dense, experts, args.grad_clip, ep_group, ep, meter)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.balance == "bias":
            update_bias(moes, counts[:, 0], args.bias_rate)
        if world > 1:
            dist.all_reduce(sums)
            meter.all_reduce(sums.numel() * 4, world)
            sums /= world
        loss_val, aux_val = sums.tolist()
        gpt2.check_finite(loss_val, step)
        routed, kept = counts[:, 0].float(), counts[:, 1].float()
        load = routed / routed.mean(-1, keepdim=True)  # 1.0 = perfectly balanced
        loads.append(load.tolist())
        drop = 1 - kept.sum().item() / routed.sum().item()
        a2a_mb, a2a_ms = a2a.take_mb(), a2a.seconds * 1e3
        a2a.seconds = 0.0
        theory_mb = args.grad_accum * cfg.n_layer * a2a_bytes_uniform(args, args.batch_size * args.seq_len, row_bytes,
                                                                      drop) / 1e6
        metrics.log_step(step, loss_val, lr, comm_mb=a2a_mb + meter.take_mb(), aux_loss=aux_val, drop_rate=drop,
                         a2a_mb=a2a_mb, a2a_mb_closed=closed_bytes / 1e6, a2a_mb_theory=theory_mb, a2a_ms=a2a_ms, max_load=load.max().item(),
                         expert_load=[[round(v, 4) for v in layer] for layer in load.tolist()])
        print0(f"      moe | aux {aux_val:.5f} | drop {100 * drop:5.2f}% | max/mean load {load.max().item():.2f} | "
               f"a2a {a2a_mb:.3f} MB (closed form {closed_bytes / 1e6:.3f}, uniform routing {theory_mb:.3f}) {a2a_ms:.1f} ms")
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(val_loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
            a2a.take_mb(), meter.take_mb()  # validation traffic is not part of a training step
            a2a.seconds = 0.0
    gpt2.check_finite_weights(model.parameters(), args.steps - 1)  # every rank: its own experts too
    state = full_state_dict(model, ep_group, ep)  # a collective: every rank takes part, rank 0 writes
    if ctx.master:
        moe = {k: getattr(args, k) for k in ("experts", "top_k", "gate", "norm_topk", "shared_expert", "route_groups",
                                             "groups_per_token")}
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, state, moe=moe)
    metrics.plot()
    if ctx.master and loads:
        plot_expert_load(loads, args, os.path.join(args.out, "expert_load.png"))
        print0(f"wrote {args.out}/model.pt, {args.out}/loss.png and {args.out}/expert_load.png "
               f"(sample: python moe_ep.py sample --init-from {args.out}/model.pt)")
    return metrics.records


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


# ====================================================================================================
# Appendix: measurement (all-to-all bytes and time, their closed forms), the expert-load picture,
# argument checks, the command line
# ====================================================================================================


class A2AMeter(gpt2.CommMeter):
    """Bytes (as CommMeter) and wall time of the all-to-alls. With sync=True the CUDA stream is drained
    around each one so that the time is real (NCCL is asynchronous); that costs overlap, so it is opt-in."""

    def __init__(self, sync=False):
        super().__init__()
        self.seconds, self.sync = 0.0, sync


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
        out, back, row, local = m.stats["rows_out"], m.stats["rows_in"], m.stats["row_bytes"], m.E // ep
        if m.dispatch == "rank":
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


def check_args(args, world):
    """Every mistake found before the first collective, so it is an error message and not a hang."""
    gpt2.check_args(args)
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
    for i, block in enumerate(model.h):
        block.mlp = MoE(cfg, args, i, model.init_weights)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def sample(argv):
    """`python moe_ep.py sample --init-from OUT/model.pt`: gpt2.py's sample command with the MoE loader."""
    gpt2.sample(argv, load_model=load_moe, prog="moe_ep.py sample", init_help="OUT/model.pt of a moe_ep.py run")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "sample":
        gpt2.run_main(sample, sys.argv[2:])
    else:
        gpt2.run_main(train)
