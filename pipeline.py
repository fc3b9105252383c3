"""
pipeline.py - pipeline parallelism from point-to-point messages: GPipe, 1F1B, ZB-H1, interleaved 1F1B,
DualPipe and DualPipeV, with an NCCL-safe message plan, every op timed, the bubble measured and drawn.

The idea: cut GPT-2's stack of blocks into stages and give each rank one (or a few) of them. The batch is
split into M micro-batches that stream through the stages: while rank 1 runs its blocks on micro-batch
0, rank 0 already runs its blocks on micro-batch 1. Only the activation at each cut (B/M x T x C) moves
forward, and its gradient moves back. The *schedule* is the order in which a rank runs forwards (F) and
backwards (B), or backwards split into the input gradient (I: the zero-bubble paper's B; DeepSeek's B is
the full backward, our B) and the weight gradient (W), which has no consumer downstream and so can wait. The idle time a schedule
leaves is its bubble. Here every schedule is a plain function that returns each rank's list of ops; from
all ranks' lists, plan_messages lays out every batch_isend_irecv of the step in advance (a pure function,
checked against a model of NCCL's point-to-point rules in tests/), and one executor runs any list.

    gpipe / 1f1b / zbh1, P=4 (12 layers):  stage s on rank s
      rank0 [wte wpe h0-2] --act--> rank1 [h3-5] --act--> rank2 [h6-8] --act--> rank3 [h9-11 ln_f lm_head]
                           <-grad--             <-grad--             <-grad--
      lm_head is tied to wte: rank0 and rank3 each keep a copy and sum their gradients every step.
    interleaved, P=4, V=3: rank r holds stages r, r+4, r+8 (one block each): a micro-batch goes round 3 times
    dualpipe, P=4: rank r holds stage r AND stage P-1-r (two copies of every stage, grads summed in pairs)
      direction 0, mb 0..M/2-1:  rank0 S0 -> rank1 S1 -> rank2 S2 -> rank3 S3 -> loss on rank3
      direction 1, mb M/2..M-1:  rank3 S0 -> rank2 S1 -> rank1 S2 -> rank0 S3 -> loss on rank0
    dualpipev, P=4 (2P = 8 stages): rank r holds stage r and stage 2P-1-r; micro-batches go down the V
      rank0 S0 -> rank1 S1 -> rank2 S2 -> rank3 S3 --+      and come back up: the loss and both uses of
      rank0 S7 <- rank1 S6 <- rank2 S5 <- rank3 S4 <-+      the tied wte are on rank0 (one tensor).
    --dp D: D pipeline replicas (rank = replica * P + stage rank), gradients averaged across replicas.

Timelines at P=4, M=8, one character per forward's time (F=1, B=2, I=W=1; lower case: the way back up
the V; '.' idle), as simulate() lays them out and tests/ checks:
    1F1B   rank0 FFFF......BBFBBFBBFBBFBB.BB.BB.BB     idle per rank (P-1)(F+B) = 9 of 33
           rank1 .FFF....BBFBBFBBFBBFBBFBB.BB.BB..
           rank2 ..FF..BBFBBFBBFBBFBBFBBFBB.BB....
           rank3 ...FBBFBBFBBFBBFBBFBBFBBFBB......
    DualPipeV rank0 FFFFFFFfiwfiwfiwfFbbfBBbbf.BBbbf.BBbbf.BBbbIWIWIWIW   idle 3 of 51 per rank, each rank
              rank1 .FFFFFfFfiwfiwfFbbfBBFbbfBBbbf.BBbbf.BBbbBBiIwIWIWW   doing twice 1F1B's work (2P stages)
              rank2 ..FFFfFfFfiwfFbbfBBFbbfBBFbbfBBbbf.BBbbBBbbIiIWIwWW
              rank3 ...FfFfFfFfFbbfBBFbbfBBFbbfBBFbbfBBbbBBbbBBiIiIwWwW

Why DualPipe exists, and what this file does not do. DeepSeek-V3 (section 3.2.1) built DualPipe for
expert parallelism: each MoE layer's dispatch and combine all-to-alls cost about as much as its compute,
so DualPipe pairs the forward of one micro-batch with the backward of another (the F&B pairs of its
main phase) and runs them as one unit on two CUDA streams, each chunk's all-to-all and pipeline sends
hidden under the other chunk's compute. Its bubble, (PP/2-1)(F&B+B-3W) per rank (table 2), assumes that
unit. This file has no all-to-all (GPT-2 is dense) and runs F then B on one stream; it overlaps only
the point-to-point messages (in flight while the next op computes) and nothing inside an op. simulate()
models both: paired=True (F&B as one unit) reproduces table 2's formula exactly, the executor's own
order idles half of it at F=1, B=2, W=1 (tests/), and report() prints both, labelled. That is no win
over DeepSeek: pairing trades idle time for hiding an all-to-all inside each F&B, and pays only where
there is one to hide, which a dense model has not. What this file keeps of DualPipe is the schedule:
two directions (or the V) and W's that fill the ramps.

Messages and memory. An activation crossing a boundary is (B/M, T, C) in the run's compute dtype (bf16
on GPUs, received back into the fp32 residual stream); the whole batch crosses each boundary once
forward and once back. A stage's output is freed as soon as its send is done (backward keeps only the
graph behind it, as Megatron-LM's deallocate_output_tensor does); the I/W tape keeps, per matmul and
LayerNorm, its input and where its output's gradient arrives, never the output; but from I to W it holds
that output gradient, for lm_head the logits-sized (B/M, T, V): ZB-H1's last stage keeps P of them.

GPT-2 124M at 8 ranks, B=16 x T=1024 per replica (tests/bench_pipeline.py --per-rank-124m measures
the same on a fake process group; `1f1b` rank 0 of P=4 x D=2):
    activation per boundary per step = 2 (fwd+bwd) x 16 x 1024 x 768 x 2 B (bf16) = 50.3 MB (25.2 MB sent)
    tied wte all-reduce, rank 0 <-> rank P-1 = 50304 x 768 x 4 B = 154.5 MB per step (2 ranks: each sends it once)
    rank 0 parameters = wte 38.63M + wpe 0.79M + 3 blocks x 7.09M = 60.7M -> 243 MB fp32, grads 243 MB,
      AdamW 486 MB (16 B/param: 971 MB) vs 1991 MB for ddp.py's whole model
    data parallel all-reduce of rank 0's gradients over D=2 = 243 MB sent; total sent ~ 25 + 155 + 243 = 423 MB
    activations saved for backward (bf16, M=4): all 4 micro-batches of 4 rows in flight on rank 0 (1F1B holds
      P - rank), 3 blocks each: 1382 MB measured = 28.8 MB per row per block (Korthikanti et al.: 34 T C = 26.7 MB)
    the whole table (every schedule; dualpipev P=2 rank 0: 1311 MB of state, 542 MB sent, 4592 MB activations):
      python tests/bench_pipeline.py --per-rank-124m

Launch (the tiny model on CPU; add --device cuda for GPUs, where bf16 autocast and flash attention apply):
    torchrun --nproc_per_node=2 pipeline.py --schedule 1f1b --micro-batches 4 --batch-size 8
    torchrun --nproc_per_node=2 pipeline.py --schedule zbh1 --micro-batches 4 --batch-size 8
    torchrun --nproc_per_node=2 pipeline.py --schedule interleaved --virtual-stages 2 --micro-batches 4 --batch-size 8
    torchrun --nproc_per_node=4 pipeline.py --schedule dualpipe --micro-batches 8
    torchrun --nproc_per_node=4 pipeline.py --schedule dualpipev --micro-batches 8 --n-layer 8 --compile
    torchrun --nproc_per_node=4 pipeline.py --schedule 1f1b --dp 2 --micro-batches 4
    python gpt2.py train --batch-size 8 ...   # the same loss curve, step by step (fp32)

References: GPipe (Huang et al. 2019); 1F1B/PipeDream-Flush and interleaved 1F1B (Narayanan et al. 2021,
Megatron-LM, 2.2); zero-bubble B/W split and ZB-H1 (Qi et al. 2023); DualPipe (DeepSeek-V3 report, 3.2.1)
and DualPipeV (deepseek-ai/DualPipe); torch.distributed.pipelining, which tests/ compares against.
Uses from gpt2.py: build_model and the GPT pieces embed / forward_blocks / head_loss, make_parser,
check_args, setup, make_loaders, optimizer_groups, make_adamw, set_lr, CommMeter, Metrics, Profiler.
"""
import collections
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpt2
from gpt2 import print0

SCHEDULE_NAMES = ("gpipe", "1f1b", "zbh1", "interleaved", "dualpipe", "dualpipev")

# ----------------------------------------------------------------------------------------------------
# Schedules: rank r's ordered list of ops. An op is (kind, stage, micro-batch), kind one of
#   F forward | B full backward (input and weight gradients) | I input-gradient half of a backward |
#   W weight-gradient half, deferred (zero-bubble split, Qi et al. 2023)

Op = collections.namedtuple("Op", "kind stage mb")


def gpipe(P, M, rank):
    """GPipe: all M forwards, then all M backwards; all M micro-batches' activations are held at once."""
    return [Op("F", rank, i) for i in range(M)] + [Op("B", rank, i) for i in range(M)]


def one_f_one_b(P, M, rank):
    """1F1B (PipeDream-Flush): the same bubble as GPipe, but a rank holds at most P - rank micro-batches."""
    warmup = min(P - 1 - rank, M)  # forwards to issue before the first backward comes back
    ops = [Op("F", rank, i) for i in range(warmup)]
    for i in range(M - warmup):  # steady state: one forward, one backward
        ops += [Op("F", rank, warmup + i), Op("B", rank, i)]
    ops += [Op("B", rank, i) for i in range(M - warmup, M)]  # cooldown: drain the backwards
    return ops


def zbh1(P, M, rank):
    """ZB-H1 (Qi et al. 2023, section 3.1): 1F1B with every backward split into I (the input gradient the
    previous stage waits for) and W (the weight gradient nobody waits for). Rank r runs each W `r` ops
    behind its I: the I's then travel back to rank 0 at I's pace instead of B's, and the W's held back
    fill the cooldown, where 1F1B idles: bubble (P-1)(F+B-2W) per rank instead of (P-1)(F+B) (tests/
    simulates it). Memory: P - rank micro-batches await their I, as in 1F1B, but rank r also keeps the W
    state of up to r + 1, so every rank holds state for P micro-batches from F to W; on the last stage
    that state includes lm_head's logits-sized output gradient (tests/bench_pipeline.py --quick)."""
    warmup, lag = min(P - 1 - rank, M), rank
    ops, waiting = [Op("F", rank, i) for i in range(warmup)], collections.deque()
    for i in range(M):
        if warmup + i < M:
            ops.append(Op("F", rank, warmup + i))
        ops.append(Op("I", rank, i))
        waiting.append(i)
        if len(waiting) > lag or warmup + i >= M:  # steady state: W trails by `lag`; cooldown: drain
            ops.append(Op("W", rank, waiting.popleft()))
    return ops + [Op("W", rank, i) for i in waiting]


def interleaved(P, M, rank, V):
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): V model chunks per rank, chunk c of rank r is
    stage c*P + r. Micro-batches go round in groups of P: P forwards on chunk 0, P on chunk 1, ... so the
    pipe fills V times faster; bubble (P-1)/(V*M) of the ideal time, for V times the messages."""
    def stage_mb(k, forward):  # the k-th forward (or backward) of this rank
        group, within = divmod(k, P * V)
        chunk = within // P if forward else V - 1 - within // P
        return chunk * P + rank, group * P + within % P
    total = M * V
    warmup = total if M == P else min(total, (P - 1 - rank) * 2 + (V - 1) * P)
    ops = [Op("F", *stage_mb(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [Op("F", *stage_mb(warmup + k, True)), Op("B", *stage_mb(k, False))]
    return ops + [Op("B", *stage_mb(k, False)) for k in range(total - warmup, total)]


class _OpList:
    """DualPipe's phases say only "a forward of my near stage", "a backward of my far stage"; which
    micro-batch that is follows from how many of that kind this stage has already run. _OpList keeps
    that count per (stage, forward or backward), starting at the stage's first micro-batch (M/2 for
    DualPipe's second direction), and queues the W of every I so that W() runs the oldest pending weight
    gradient (first in, first out, as deepseek-ai/DualPipe does)."""

    def __init__(self, mb_base):
        self.ops, self.next, self.pending_w, self.mb_base = [], collections.Counter(), collections.deque(), mb_base

    def add(self, kind, stage):
        key = (stage, kind == "F")
        mb = self.mb_base.get(stage, 0) + self.next[key]
        self.next[key] += 1
        self.ops.append(Op(kind, stage, mb))
        if kind == "I":
            self.pending_w.append((stage, mb))

    def W(self):
        if self.pending_w:
            self.ops.append(Op("W", *self.pending_w.popleft()))


def _dualpipe_phases(half, h, chunks, near, far, mb_base):
    """The eight phases of DualPipe (deepseek-ai/DualPipe) on a rank h steps from its end of a pipeline of
    2*half ranks fed `chunks` micro-batches per direction. `near` is this rank's stage in the direction
    fed from its own end (phase 0), `far` its stage in the other (phase 1). Backwards of the main phase
    pair a forward of one direction with a backward of the other (F&B: on GPUs one's communication hides
    under the other's compute); split backwards (I now, W later) fill the ramps."""
    o = _OpList(mb_base)
    F = lambda stage: o.add("F", stage)  # noqa: E731
    B = lambda stage, zb=False: o.add("I" if zb else "B", stage)  # noqa: E731
    for _ in range((half - h - 1) * 2):  # 1: nF0, fill the pipe from my end
        F(near)
    for _ in range(h + 1):  # 2: nF0F1, the other direction's first micro-batches arrive
        F(near), F(far)
    for _ in range(half - h - 1):  # 3: nB1W1F1, zero bubble: the W runs right away
        B(far, zb=True), o.W(), F(far)
    for _ in range(chunks - 2 * half + h + 1):  # 4: main, nF0B1F1B0 (F&B pairs)
        F(near), B(far), F(far), B(near)
    for _ in range(half - h - 1):  # 5: nB1F1B0
        B(far), F(far), B(near)
    zb = False
    for i in range(h + 1):  # 6: nB1B0, the second half of these backwards split into I and W
        zb = zb or (i == (h + 1) // 2 and h % 2 == 1)
        B(far, zb)
        zb = zb or (i == (h + 1) // 2 and h % 2 == 0)
        B(near, zb)
    for _ in range(half - h - 1):  # 7: nWB0, weight gradients fill the drain
        o.W(), B(near, zb=True)
    for _ in range(h + 1):  # 8: nW, the remaining weight gradients
        o.W()
    return o.ops


def dualpipe(P, M, rank):
    """DualPipe (DeepSeek-V3 section 3.2.1): M/2 micro-batches enter at each end at once; rank r holds stage r
    of direction 0 (fed at rank 0) and stage P-1-r of direction 1 (fed at rank P-1, micro-batches M/2..M-1).
    The second half of the ranks mirrors the first, so phase 0 is direction 1 there."""
    stages = (rank, P - 1 - rank) if rank < P // 2 else (P - 1 - rank, rank)  # (near, far)
    return _dualpipe_phases(P // 2, min(rank, P - 1 - rank), M // 2, *stages, {P - 1 - rank: M // 2})


def dualpipev(P, M, rank):
    """DualPipeV: DualPipe "cut in half" (deepseek-ai/DualPipe). One feed and 2P stages laid out as a V: rank
    r holds stage r (going down) and 2P-1-r (coming back), i.e. it plays rank r of a 2P-rank DualPipe
    whose second half has been folded back onto the first. One copy of the weights instead of two."""
    return _dualpipe_phases(P, rank, M, rank, 2 * P - 1 - rank, {})


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zbh1": zbh1, "interleaved": interleaved,
             "dualpipe": dualpipe, "dualpipev": dualpipev}


def op_lists(schedule, P, M, V=2):
    """Every pipeline rank's op list (V, the chunks per rank, is used by interleaved only)."""
    return [interleaved(P, M, r, V) if schedule == "interleaved" else SCHEDULES[schedule](P, M, r) for r in range(P)]


def num_stages(schedule, P, V=2):
    return {"dualpipev": 2 * P, "interleaved": V * P}.get(schedule, P)


def stage_owner(schedule, P, M, stage, mb):
    """The pipeline rank that runs `stage` for micro-batch `mb`."""
    if schedule == "dualpipe":
        return stage if mb < M // 2 else P - 1 - stage
    if schedule == "dualpipev":
        return stage if stage < P else 2 * P - 1 - stage
    return stage % P  # interleaved: chunk c of rank r is stage c*P + r


def stages_of(schedule, P, rank, V=2):
    if schedule == "interleaved":
        return tuple(c * P + rank for c in range(V))
    return {"dualpipe": (rank, P - 1 - rank), "dualpipev": (rank, 2 * P - 1 - rank)}.get(schedule, (rank,))


def forward_only(schedule, P, M, rank, V=2):
    """Validation: forwards only, lower stages first (a topological order in every layout)."""
    return [Op("F", s, i) for s in sorted(stages_of(schedule, P, rank, V)) for i in range(M)
            if stage_owner(schedule, P, M, s, i) == rank]


def message_out(op, S):
    """The message an op sends: a forward its activation to the next stage, a backward (B or I) the
    gradient of its input to the previous stage; W sends nothing. Keys name the receiving stage."""
    if op.kind == "F" and op.stage < S - 1:
        return ("act", op.stage + 1, op.mb)
    if op.kind in "BI" and op.stage > 0:
        return ("grad", op.stage - 1, op.mb)
    return None


def message_in(op, S):
    """The message an op waits for (the mirror of message_out)."""
    if op.kind == "F" and op.stage > 0:
        return ("act", op.stage, op.mb)
    if op.kind in "BI" and op.stage < S - 1:
        return ("grad", op.stage, op.mb)
    return None


def simulate(orders, cost, paired=False):
    """Run every rank's op list against the data dependencies with op durations `cost` ({kind: time}, or
    {(kind, stage): time} for unequal stages) and free communication. Returns per-rank [(op, start,
    end)]; raises if the lists deadlock. With F=1, B=2 it reproduces the closed forms; with the measured
    durations it is the ideal this hardware could reach with this schedule.
    paired: DeepSeek's execution of DualPipe, where a forward followed by a full backward of another stage
    (an "F&B" pair of the main phase) runs as one unit: it starts when both inputs are there, and both
    outputs leave when the unit ends, after cost["F&B"] (default F + B: no speed-up assumed from the
    overlap, only its ordering). This file's executor runs them one after the other instead."""
    P, S = len(orders), 1 + max(op.stage for order in orders for op in order)
    dur = lambda op: cost.get((op.kind, op.stage), cost.get(op.kind))  # noqa: E731
    done, out, pos, free = {}, [[] for _ in range(P)], [0] * P, [0.0] * P
    while any(pos[r] < len(orders[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                op, nxt = orders[r][pos[r]], orders[r][pos[r] + 1] if pos[r] + 1 < len(orders[r]) else None
                unit = [op, nxt] if (paired and op.kind == "F" and nxt is not None and nxt.kind == "B"
                                     and nxt.stage != op.stage) else [op]
                deps = [message_in(o, S) for o in unit]
                deps = [("B" if k[0] == "grad" else "F", k[1] + (k[0] == "grad") - (k[0] == "act"), k[2])
                        for k in deps if k is not None]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                t = start
                for o in unit:
                    out[r].append((o, t, t + dur(o)))
                    t += dur(o)
                if len(unit) == 2 and "F&B" in cost:
                    t = start + cost["F&B"]
                    out[r][-2:] = [(unit[0], start, start + cost["F&B"] / 2), (unit[1], start + cost["F&B"] / 2, t)]
                free[r] = t
                for o in unit:
                    done[("B" if o.kind == "I" else o.kind, o.stage, o.mb)] = t
                pos[r], progressed = pos[r] + len(unit), True
        if not progressed:
            stuck = [o[p] if p < len(o) else None for o, p in zip(orders, pos)]
            raise RuntimeError(f"the op lists deadlock (P={P}, at ops {stuck})")
    return out


def bubble_fraction(ranks):
    """Mean over ranks of the idle share of the makespan, from [(op, start, end)] per rank."""
    t0, t1 = min(a for r in ranks for _, a, _ in r), max(b for r in ranks for _, _, b in r)
    return sum((t1 - t0) - sum(b - a for _, a, b in r) for r in ranks) / len(ranks) / (t1 - t0)


# The nominal op costs the communication plan is laid out with (the ZB paper's F = I = W; any costs give
# a deadlock-free plan, these keep receives posted close to when the data really arrives)
PLAN_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def plan_messages(orders, owner):
    """The point-to-point plan of one step, a pure function of every rank's op list: for rank r, the
    batch_isend_irecv batches to issue, batch i just before op i and the last after the last op, each a
    list of ("send" | "recv", peer, key).

    NCCL's contract (not gloo's): a send may block until the peer has posted the matching receive, the
    n-th send a->b matches the n-th receive b<-a whatever the tags, and a rank's batches run one after
    the other on one stream. Sending each op's output as soon as it exists and receiving each input only
    when it is needed (the obvious plan) can deadlock: rank 0 blocks in a send that rank 1 receives only
    after a batch of its own whose send rank 0 receives later. So the plan is laid out on one shared
    clock, a simulation of the op lists (PLAN_COST): a message leaves with the batch right after the op
    that made it (at the op's end time t), and the receiver posts its receive in its first batch at or
    after t, which is never later than the batch before the op that needs it. The intuition: every batch
    then waits only on batches earlier on that clock, so no cycle can form. The proof is tests/'s
    exhaustive check of every schedule's plan (P up to 8, M up to 4P, with and without --dp) against
    a model of NCCL's contract.
    Receives from one peer are posted in the order it sends (sorted by send time), so the n-th receive
    is the n-th send, as NCCL matches them. tests/ checks the plan of every schedule against a model of
    this contract."""
    spans = simulate(orders, PLAN_COST)
    S = 1 + max(op.stage for order in orders for op in order)
    plans = [[[] for _ in range(len(order) + 1)] for order in orders]
    leaving = []  # (send time, sender, op index, key, receiver)
    for r, ops in enumerate(spans):
        for i, (op, _, end) in enumerate(ops):
            key = message_out(op, S)
            if key is not None and owner(key[1], key[2]) != r:  # dualpipev's turn stays on its rank
                dst = owner(key[1], key[2])
                plans[r][i + 1].append(("send", dst, key))
                leaving.append((end, r, i, key, dst))
    for t, src, _, key, dst in sorted(leaving):
        starts = [a for _, a, _ in spans[dst]] + [float("inf")]  # batch j is posted when op j starts
        j = next(j for j, a in enumerate(starts) if a >= t)
        plans[dst][j].append(("recv", src, key))
    return plans


# ----------------------------------------------------------------------------------------------------
# The executor: runs one rank's op list, moving activations and gradients with batch_isend_irecv


class Pipeline:
    """This rank's stages of GPT-2 and the machinery to run any schedule over them.

    How a step runs (run): before op i, issue batch i of plan_messages' plan (_issue): the sends it
    lists take their tensors from `outbox`, where the op that made them left them keyed by message
    (_send), and the receives it lists get fresh buffers, parked in `inbox` under their message key
    with the work that fills them. An op that needs a message takes it from `inbox` (_take waits for
    that work only). The receives from one peer sit in the plan in the order that peer sends, because
    NCCL pairs the n-th send with the n-th receive and ignores tags; the tags (message kind, stage,
    micro-batch) are for gloo, which matches on them, and make a mismatch impossible to miss. `saved`
    holds, per (stage, micro-batch), what its backward needs; `deferred` the (input, output gradient)
    pairs an I leaves for its W."""

    def __init__(self, args, ctx, P, comm):
        self.args, self.ctx, self.P, self.M, self.comm = args, ctx, P, args.micro_batches, comm
        self.schedule, self.D = args.schedule, args.dp
        self.pp_rank, self.replica = ctx.rank % P, ctx.rank // P
        self.base = self.replica * P  # global rank of this replica's pipeline rank 0
        self.V = args.virtual_stages
        self.S = num_stages(self.schedule, P, self.V)
        model = gpt2.build_model(args)  # the full model from --seed, then keep only this rank's stages
        self.cfg, self.n_params = model.config, model.num_params()
        per = self.cfg.n_layer // self.S
        self.layers = {s: (s * per, (s + 1) * per) for s in range(self.S)}
        self.my_stages = stages_of(self.schedule, P, self.pp_rank, self.V)
        self.first, self.last = 0 in self.my_stages, self.S - 1 in self.my_stages
        keep = {i for s in self.my_stages for i in range(*self.layers[s])}
        keep_only(model, keep, self.first, self.last)
        self.model = model.to(ctx.device)
        self.orders = op_lists(self.schedule, P, self.M, self.V)
        self.eval_orders = [forward_only(self.schedule, P, self.M, r, self.V) for r in range(P)]
        self.plan = plan_messages(self.orders, self._owner)  # every message of a step, laid out in advance
        self.eval_plan = plan_messages(self.eval_orders, self._owner)
        self._tape = None
        if any(op.kind == "I" for op in self.orders[self.pp_rank]):  # record matmul/LayerNorm inputs for W
            for m in self.model.modules():
                if isinstance(m, (nn.Linear, nn.LayerNorm)):
                    self._record_inputs(m)
        if args.compile:  # per block, so the stage cuts (and the I/W recording) stay plain Python
            for i in sorted(keep):
                self.model.h[i].compile()
        # activations and their gradients cross the wire in the run's compute dtype (bf16 on GPUs: half
        # the bytes); the residual stream they belong to is fp32 (autocast), so receivers cast back
        self.wire_dtype, self.resid_dtype = ctx.dtype, torch.float32
        self.timeline = Timeline(ctx.device)
        self.peak_held = 0
        self._make_groups()
        if ctx.world > 1:
            dist.barrier()  # brings every NCCL communicator up before the first (partial) batch_isend_irecv

    # -- process groups (every rank creates every group, in the same order) ---------------------------

    def _make_groups(self):
        P, D, r = self.P, self.D, self.ctx.rank
        # None is the default group: used when a group would span every rank (or only this one)
        new = lambda ranks: dist.new_group(ranks) if 1 < len(ranks) < self.ctx.world else None
        self.pp_group = self.grad_group = self.embed_group = None
        for d in range(D):  # one pipeline per replica: the loss and the grad norm are summed in it
            g = new(list(range(d * P, (d + 1) * P)))
            if d == self.replica:
                self.pp_group = g
        # ranks holding a copy of the same parameters: the replicas, and in dualpipe the pair r, P-1-r
        # (DeepSeek-V3 3.2.1: "two copies of the model parameters"); their gradients are summed
        for p in range(P):
            pair = sorted({p, P - 1 - p}) if self.schedule == "dualpipe" else [p]
            if pair[0] != p:
                continue
            ranks = sorted(d * P + q for d in range(D) for q in pair)
            g = new(ranks)
            if r in ranks:
                self.grad_group, self.grad_group_size = g, len(ranks)
        # the tied wte/lm_head when the first and last stage are on different ranks (all but dualpipe(v)): each
        # keeps a copy and their gradients are summed every step, as Megatron-LM's embedding group does
        self.tied_split = self.schedule not in ("dualpipe", "dualpipev") and P > 1
        if self.tied_split:
            for d in range(D):
                ends = [d * P, d * P + P - 1]
                g = new(ends)
                if r in ends:
                    self.embed_group = g

    def norm_parameters(self):
        """The parameters whose gradient this rank adds to the global norm: every parameter exactly once."""
        if self.schedule == "dualpipe":  # the pair r, P-1-r holds the same stages: the lower rank counts
            return list(self.model.parameters()) if self.pp_rank < self.P // 2 else []
        if self.tied_split and self.last:  # the head's copy of wte is counted on the first stage
            return [p for p in self.model.parameters() if p is not self.model.lm_head.weight]
        return list(self.model.parameters())

    # -- messages ---------------------------------------------------------------------------------------

    def _owner(self, stage, mb):
        return stage_owner(self.schedule, self.P, self.M, stage, mb)

    def _tag(self, key):
        return ((key[0] == "grad") * self.S + key[1]) * self.M + key[2]

    def _send(self, key, tensor):
        """Queue an op's output for the batch that plan_messages put its send in (the next one)."""
        if self._owner(key[1], key[2]) == self.pp_rank:  # the turn of the V in dualpipev: stage P-1 feeds P here
            self.inbox[key] = (tensor.detach(), [])
            return
        self.outbox[key] = tensor.detach().to(self.wire_dtype).contiguous()

    def _issue(self, batch):
        """One planned batch_isend_irecv: the queued sends and the receives the plan posts here."""
        ops, recvs = [], []
        for kind, peer, key in batch:
            if kind == "send":
                t = self.outbox.pop(key)
                ops.append(dist.P2POp(dist.isend, t, self.base + peer, tag=self._tag(key)))
                self.comm.send(t.numel() * t.element_size())
            else:
                buf = torch.empty(self.act_shape, dtype=self.wire_dtype, device=self.ctx.device)
                recvs.append(key)
                ops.append(dist.P2POp(dist.irecv, buf, self.base + peer, tag=self._tag(key)))
        if ops:
            works = dist.batch_isend_irecv(ops)
            # gloo answers one work per op, NCCL one for the whole (grouped) batch
            per_op = [[w] for w in works] if len(works) == len(ops) else [works] * len(ops)
            n_send = len(ops) - len(recvs)
            self.sent += [(w, op.tensor) for w, op in zip(per_op[:n_send], ops[:n_send])]
            for key, op, w in zip(recvs, ops[n_send:], per_op[n_send:]):
                self.inbox[key] = (op.tensor, w)
        # a send buffer is dropped as soon as its send is done: the stage output it holds is then freed
        # (Megatron's deallocate_output_tensor; backward needs only the graph, kept as a GradientEdge)
        self.sent = [(w, t) for w, t in self.sent if not all(x.is_completed() for x in w)]

    def _take(self, key):
        tensor, works = self.inbox.pop(key)
        for w in works:
            w.wait()
        return tensor

    # -- compute ----------------------------------------------------------------------------------------

    def _record_inputs(self, module):
        """Wrap a Linear/LayerNorm so that, inside a forward that will be split into I and W, it writes
        (module, input, where its output's gradient arrives) on the tape: W needs exactly the input and
        that gradient. The output itself is not kept (for lm_head it is the B/M x T x V logits). Under
        --compile the wrapper stays eager (a graph break), so the recording sees real tensors."""
        forward = module.forward

        @torch.compiler.disable
        def recorded(x):
            y = forward(x)
            if self._tape is not None:
                self._tape.append((module, x, torch.autograd.graph.get_gradient_edge(y)))
            return y
        module.forward = recorded

    def _forward(self, op, xs, ys):
        s, mb = op.stage, op.mb
        lo, hi = self.layers[s]
        tape = [] if (s, mb) in self.split else None
        self._tape = tape
        with self.ctx.autocast():
            if s == 0:
                h_in, h = None, self.model.embed(xs[mb])  # (B/M, T, C)
                if tape is not None:
                    tape.append(("embed", xs[mb], torch.autograd.graph.get_gradient_edge(h)))
            else:
                h_in = h = self._take(("act", s, mb)).to(self.resid_dtype).requires_grad_(torch.is_grad_enabled())
            h = self.model.forward_blocks(h, lo, hi)  # (B/M, T, C)
            if s == self.S - 1:
                # loss of a step = mean over micro-batches, so each micro-batch's loss is scaled by 1/M
                out = self.model.head_loss(h, ys[mb]) * self.scale
                self.loss_sum += out.detach().float()
        self._tape = None
        if s < self.S - 1:
            self._send(("act", s + 1, mb), h)
            # backward needs the graph behind h, not h: once sent, h is freed (deallocate_output_tensor)
            out = torch.autograd.graph.get_gradient_edge(h) if torch.is_grad_enabled() else None
        if torch.is_grad_enabled():
            self.saved[(s, mb)] = (h_in, out, tape)

    def _backward(self, op):
        s, mb = op.stage, op.mb
        h_in, out, tape = self.saved.pop((s, mb))
        grad = None if s == self.S - 1 else self._take(("grad", s, mb)).to(self.resid_dtype)
        if op.kind == "B":
            torch.autograd.backward(out, grad)
            g_in = h_in.grad if h_in is not None else None
        else:
            # I: the gradient w.r.t. the stage input (needed downstream now) and w.r.t. every matmul's and
            # LayerNorm's output; autograd skips the weight-gradient matmuls, which W does later
            inputs = ([h_in] if h_in is not None else []) + [edge for _, _, edge in tape]
            grads = torch.autograd.grad(out, inputs, grad)
            g_in = grads[0] if h_in is not None else None
            self.deferred[(s, mb)] = [(m, x, dy) for (m, x, _), dy in zip(tape, grads[len(grads) - len(tape):])]
        if s > 0:
            self._send(("grad", s - 1, mb), g_in)

    def _weight(self, op):
        """W: the weight gradients of one I, from the recorded inputs x and output gradients dy."""
        for m, x, dy in self.deferred.pop((op.stage, op.mb)):
            if m == "embed":  # x are token ids: wte gathers rows, wpe adds over the batch
                _accumulate(self.model.wte.weight, None, rows=(x.reshape(-1), dy.reshape(-1, dy.size(-1))))
                _accumulate(self.model.wpe.weight, None, rows=(torch.arange(dy.size(1), device=dy.device), dy.sum(0)))
                continue
            dy2 = dy.reshape(-1, dy.size(-1))
            if isinstance(m, nn.Linear):
                _accumulate(m.weight, dy2.t() @ x.reshape(-1, x.size(-1)).to(dy2.dtype))
            else:  # LayerNorm: y = xhat * gamma + beta
                xhat = F.layer_norm(x.float(), m.normalized_shape, eps=m.eps).reshape(-1, dy.size(-1))
                _accumulate(m.weight, (dy2.float() * xhat).sum(0))
            if m.bias is not None:
                _accumulate(m.bias, dy2.float().sum(0))

    def run(self, x, y, scale, train=True, align=False, timed=True):
        """Run this rank's op list (training, or evaluation's forwards) and its planned messages on the
        batch (x, y) -> this rank's part of the loss (sum of scaled micro-batch losses; non-zero only
        where a last stage lives). timed: record it in the timeline."""
        orders, plan = (self.orders, self.plan) if train else (self.eval_orders, self.eval_plan)
        me = self.pp_rank
        self.split = {(op.stage, op.mb) for op in orders[me] if op.kind == "I"}
        self.inbox, self.outbox, self.sent, self.saved, self.deferred = {}, {}, [], {}, {}
        B = x.size(0) // self.M
        self.act_shape, self.scale = (B, x.size(1), self.cfg.n_embd), scale
        xs, ys = x.to(self.ctx.device).split(B), y.to(self.ctx.device).split(B)
        self.loss_sum = torch.zeros((), device=self.ctx.device)
        if align and self.ctx.world > 1:
            dist.barrier()  # start the drawn step together, so the ranks' clocks line up in the picture
        if timed:
            self.timeline.reset()
        for op, batch in zip(orders[me], plan[me]):
            self._issue(batch)  # the previous op's output leaves, receives are posted as planned
            key = message_in(op, self.S)
            if key is not None:  # wait before the clock starts: time spent waiting on a peer is bubble, not work
                self.inbox[key] = (self._take(key), [])
            with self.timeline.op(op) if timed else contextlib.nullcontext():
                if op.kind == "F":
                    self._forward(op, xs, ys)
                elif op.kind == "W":
                    self._weight(op)
                else:
                    self._backward(op)
            self.peak_held = max(self.peak_held, len(self.saved.keys() | self.deferred.keys()))
        self._issue(plan[me][-1])
        for w in (w for works, _ in self.sent for w in works):
            w.wait()
        assert not (self.inbox or self.outbox or self.saved or self.deferred), "schedule left work behind"
        self.sent = []
        return self.loss_sum

    # -- gradient synchronisation, norm, loss -----------------------------------------------------------

    def sync_grads(self):
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.tied_split and (self.first or self.last):
            w = self.model.wte.weight if self.first else self.model.lm_head.weight
            dist.all_reduce(w.grad, group=self.embed_group)
            self.comm.all_reduce(w.grad.numel() * w.grad.element_size(), 2)
        if self.grad_group_size > 1:  # sum over the copies, average over the D replicas
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.grad_group)
            self.comm.all_reduce(flat.numel() * flat.element_size(), self.grad_group_size)
            flat /= self.D
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))

    def clip_grad_norm(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model, each parameter counted once."""
        grads = [p.grad for p in self.norm_parameters()]
        sq = sum((torch.linalg.vector_norm(g.float()).square() for g in grads), torch.zeros((), device=self.ctx.device))
        if self.P > 1:
            dist.all_reduce(sq, group=self.pp_group)
            self.comm.all_reduce(4, self.P)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.model.parameters():
            p.grad.mul_(coef)
        return total

    def global_loss(self, loss_sum):
        if self.ctx.world > 1:  # the last stages hold the losses; the mean over replicas is the step's loss
            dist.all_reduce(loss_sum)
            self.comm.all_reduce(4, self.ctx.world)
        return (loss_sum / self.D).item()

    @torch.no_grad()
    def evaluate(self, loader, steps):
        loader.load_state_dict({"shard": 0, "pos": 0})
        total = torch.zeros((), device=self.ctx.device)
        for _ in range(steps):
            x, y = loader.next_batch()
            total += self.run(x, y, 1.0 / self.M, train=False, timed=False)
        return self.global_loss(total / steps)


def keep_only(model, layers, first, last):
    """Strip the full model, in place, down to what a rank's stages run: its blocks, the embeddings on
    the first stage, ln_f and the head on the last (where lm_head still holds the tied wte matrix)."""
    for i in range(model.config.n_layer):
        if i not in layers:
            model.h[i] = nn.Identity()
    if not first:
        model.wte, model.wpe = None, None
    if not last:
        model.ln_f, model.lm_head = None, None
    return model


def _accumulate(p, g, rows=None):
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    if rows is not None:
        p.grad.index_add_(0, rows[0], rows[1].to(p.dtype))
    else:
        p.grad += g.to(p.dtype)


# ----------------------------------------------------------------------------------------------------
# Training loop (gpt2.train's order: lr, micro-steps, clip, step, zero_grad, check, log, eval)


def train(argv=None):
    args = make_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    P = check_args(args, world)
    ctx = gpt2.setup(args)
    comm = gpt2.CommMeter()
    pipe = Pipeline(args, ctx, P, comm)
    train_loader, val_loader = gpt2.make_loaders(args, pipe.replica, args.dp, pipe.cfg.vocab_size)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(pipe.model, args.weight_decay), args, ctx.device)
    tokens = args.batch_size * args.seq_len * args.grad_accum * args.dp
    metrics = gpt2.Metrics(args, ctx, pipe.cfg, pipe.n_params, tokens)
    profiler = gpt2.Profiler(args, ctx)
    print0(f"{args.schedule}: P={P} ranks per pipeline x D={args.dp} replicas, {pipe.S} stages of "
           f"{pipe.cfg.n_layer // pipe.S} blocks, M={args.micro_batches} micro-batches of "
           f"{args.batch_size // args.micro_batches} | device {ctx.device} {ctx.dtype}")
    scale = 1.0 / (args.micro_batches * args.grad_accum)
    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = torch.zeros((), device=ctx.device)
        for _ in range(args.grad_accum):
            x, y = train_loader.next_batch()
            loss_sum += pipe.run(x, y, scale, align=step == args.steps - 1)
        pipe.sync_grads()
        loss_val = pipe.global_loss(loss_sum)
        if args.grad_clip > 0:
            pipe.clip_grad_norm(args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        gpt2.check_finite(loss_val, step)
        metrics.log_step(step, loss_val, lr, comm_mb=comm.take_mb())
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            pipe.model.eval()
            metrics.log_val(step, pipe.evaluate(val_loader, args.eval_steps))
            pipe.model.train()
    report(pipe, args)
    metrics.plot()
    print0(f"wrote {args.out}/metrics.jsonl, loss.png and schedule.png")
    return pipe


# ====================================================================================================
# Appendix: measurement (Timeline, bubble report, pictures), argument checks, CLI
# ====================================================================================================


class Timeline:
    """Start and end of every op, in ms from reset(). CUDA events on the GPU, so timing adds no syncs."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.reset()

    def now(self):
        if not self.cuda:
            return time.perf_counter() * 1e3
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reset(self):
        self.ops, self.t0 = [], self.now()

    @contextlib.contextmanager
    def op(self, op):
        start = self.now()
        yield
        self.ops.append((op, start, self.now()))

    def spans(self):
        if self.cuda:
            torch.cuda.synchronize()
        ms = (lambda e: self.t0.elapsed_time(e)) if self.cuda else (lambda t: t - self.t0)
        return [(op, ms(a), ms(b)) for op, a, b in self.ops]


# ----------------------------------------------------------------------------------------------------
# Bubble report and the schedule picture


def bubble_stats(name, P, M, ranks, V=2):
    """One step's timeline ([(op, start, end)] per rank) -> the measured bubble (mean idle share of the
    step), the closed form (which assumes equal stages), and a simulation of the op lists with the
    measured mean duration of each (kind, stage): on small models the last stage's vocabulary-sized
    head makes it much slower than the others, a bubble no schedule removes. DualPipe(V) is simulated
    twice: as this executor runs it (F, then B) and as DeepSeek runs it (each F&B pair one unit)."""
    step = max(b for r in ranks for _, _, b in r) - min(a for r in ranks for _, a, _ in r)
    ms = {k: sum(b - a for r in ranks for op, a, b in r if op.kind == k) /
          max(1, sum(op.kind == k for r in ranks for op, _, _ in r)) for k in "FBIW"}
    cost = dict(ms, B=ms["B"] or ms["I"] + ms["W"])
    per_stage = collections.defaultdict(list)
    for op, a, b in (s for r in ranks for s in r):
        per_stage[(op.kind, op.stage)].append(b - a)
    per_stage = {k: sum(v) / len(v) for k, v in per_stage.items()}
    orders = op_lists(name, P, M, V)
    costs = f"F={cost['F']:.2f} B={cost['B']:.2f} W={cost['W']:.2f} ms"
    if name in ("gpipe", "1f1b"):
        closed = f"(P-1)/(M+P-1) = {(P - 1) / (M + P - 1):.3f}"
    elif name == "interleaved":
        closed = f"(P-1)/(V*M+P-1) = {(P - 1) / (V * M + P - 1):.3f}"
    elif name == "zbh1":
        closed = f"(P-1)(F+B-2W) = {(P - 1) * (cost['F'] + cost['B'] - 2 * cost['W']):.2f} ms idle per rank ({costs})"
    else:  # DeepSeek-V3 table 2, a time per rank, F&B = F+B (no faster for the overlap); DualPipeV = DualPipe over 2P
        n, label = (P / 2 - 1, "P/2-1") if name == "dualpipe" else (P - 1, "P-1")
        closed = (f"({label})(F&B+B-3W) = {n * (cost['F'] + 2 * cost['B'] - 3 * cost['W']):.2f} ms idle per rank "
                  f"({costs}, F&B=F+B)")
    bubble = bubble_fraction(ranks)
    st = {"bubble": bubble, "idle_ms": bubble * step, "step_ms": step, "closed": closed, "op_ms": ms,
          "simulated": bubble_fraction(simulate(orders, per_stage))}
    if name in ("dualpipe", "dualpipev"):
        st["simulated_paired"] = bubble_fraction(simulate(orders, per_stage, paired=True))
    return st


def report(pipe, args):
    """Gather the drawn step's op times to rank 0, print its bubble stats and the peak activations held,
    draw OUT/schedule.png and write OUT/schedule.json."""
    mine = {"spans": [(tuple(op), a, b) for op, a, b in pipe.timeline.spans()], "peak_held": pipe.peak_held}
    gathered = [None] * pipe.ctx.world if pipe.ctx.master else None
    if pipe.ctx.world > 1:
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if not pipe.ctx.master:
        return None
    P, M, name = pipe.P, pipe.M, args.schedule
    ranks = [[(Op(*op), a, b) for op, a, b in g["spans"]] for g in gathered[:P]]  # replica 0
    st = bubble_stats(name, P, M, ranks, pipe.V)
    st.update(schedule=name, P=P, M=M, peak_held=[g["peak_held"] for g in gathered[:P]],
              spans=[g["spans"] for g in gathered])
    paired = (f" | simulated as DeepSeek runs it (F&B pairs as one unit) {st['simulated_paired']:.3f}"
              if "simulated_paired" in st else "")
    print0(f"{name} P={P} M={M}: measured bubble {st['bubble']:.3f} of a {st['step_ms']:.1f} ms step | closed form "
           f"{st['closed']} | simulated with the measured op times, as this executor runs it {st['simulated']:.3f}"
           + paired)
    print0(f"peak micro-batch activations held per rank: {st['peak_held']}")
    with open(os.path.join(args.out, "schedule.json"), "w") as f:
        json.dump(st, f)
    way_back = lambda op: op.stage >= P or (name == "dualpipe" and op.mb >= M // 2)  # noqa: E731
    draw_schedule(ranks, os.path.join(args.out, "schedule.png"), f"{name}: P={P}, M={M}, "
                  f"measured bubble {st['bubble']:.1%}", way_back)
    return st


def ascii_timeline(schedule, P, M, V=2):
    """The docstring's timelines: simulate() at F=1, B=2, I=W=1, one character per time unit, the op's kind
    (lower case for stages on the way back up DualPipeV's V), '.' idle."""
    spans = simulate(op_lists(schedule, P, M, V), {"F": 1, "B": 2, "I": 1, "W": 1})
    end = int(max(b for r in spans for _, _, b in r))
    rows = []
    for ops in spans:
        line = ["."] * end
        for op, a, b in ops:
            a, b = int(a), int(b)
            line[a:b] = [op.kind.lower() if schedule == "dualpipev" and op.stage >= P else op.kind] * (b - a)
        rows.append("".join(line))
    return rows


def draw_schedule(ranks, path, title, pale):
    """Ranks as rows, one box per op coloured by kind, its micro-batch inside; the second direction of
    dualpipe and the way back up dualpipev's V are drawn paler."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    colours = {"F": "#4C72B0", "B": "#55A868", "I": "#8172B3", "W": "#DD8452"}
    names = {"F": "F forward", "B": "B backward", "I": "I backward for inputs", "W": "W backward for weights"}
    t0 = min(a for r in ranks for _, a, _ in r)
    fig, ax = plt.subplots(figsize=(13, 0.6 * len(ranks) + 1.5))
    for row, spans in enumerate(ranks):
        for op, a, b in spans:
            ax.barh(row, b - a, left=a - t0, color=colours[op.kind], edgecolor="black", linewidth=0.5,
                    alpha=0.55 if pale(op) else 1.0)
            ax.text((a + b) / 2 - t0, row, str(op.mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started (numbers: micro-batch)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=names[k]) for k, c in colours.items()], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# Checks that run before the first collective (bad input -> a clear error, never a hang)


def check_args(args, world):
    """Returns P, the pipeline depth; a bad flag is one line naming it (gpt2.fail)."""
    gpt2.check_args(args)
    if world % args.dp:
        gpt2.fail(f"--dp {args.dp} does not divide the {world} ranks", "--dp", "give a divisor of the world size")
    P, M, L = world // args.dp, args.micro_batches, gpt2.model_config(args).n_layer
    V = args.virtual_stages
    if V < 1:
        gpt2.fail(f"--virtual-stages {V} is not a positive number of model chunks", "--virtual-stages", "give V >= 1")
    S = num_stages(args.schedule, P, V)
    if args.batch_size % M:
        gpt2.fail(f"--batch-size {args.batch_size} is not divisible by --micro-batches {M}", "--micro-batches",
                  "give a divisor of --batch-size")
    if L % S and args.schedule == "interleaved" and L % P == 0:  # the layers split over P ranks, not into V chunks
        fits = [v for v in range(1, L // P + 1) if L // P % v == 0]
        gpt2.fail(f"{L} layers do not split into V x P = {V} x {P} = {S} stages (interleaved)", "--virtual-stages",
                  f"give a V that divides {L // P} layers per rank: one of {fits}")
    if L % S:
        gpt2.fail(f"{L} layers do not split into {S} stages ({args.schedule}, P={P} ranks per pipeline)",
                  "--n-layer", f"give a multiple of {S} layers, or another number of ranks")
    if args.schedule == "dualpipe" and P % 2:
        gpt2.fail(f"dualpipe pairs ranks from both ends, P={P} is odd", "--nproc_per_node/--dp",
                  "use an even number of ranks per pipeline")
    if args.schedule in ("1f1b", "zbh1") and M < P:
        gpt2.fail(f"{args.schedule} with {M} micro-batches cannot fill {P} stages", "--micro-batches",
                  f"give at least {P}")
    if args.schedule == "interleaved" and M % P:
        gpt2.fail(f"interleaved sends micro-batches round in groups of P={P}, got {M}", "--micro-batches",
                  f"give a multiple of {P}")
    if args.schedule in ("dualpipe", "dualpipev") and (M < 2 * P or M % 2):
        gpt2.fail(f"{args.schedule} needs an even number of micro-batches >= 2P = {2 * P}, got {M}",
                  "--micro-batches", f"give an even number >= {2 * P}")
    return P


def make_parser():
    p = gpt2.make_parser("Train GPT-2 with pipeline parallelism (GPipe, 1F1B, ZB-H1, interleaved 1F1B, DualPipe, "
                         "DualPipeV).")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES, help="pipeline schedule")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches M that --batch-size is split into")
    p.add_argument("--dp", type=int, default=1, help="data-parallel pipeline replicas D (world = P * D)")
    p.add_argument("--virtual-stages", type=int, default=2, help="interleaved: model chunks V per rank")
    return p


if __name__ == "__main__":
    gpt2.run_main(train)
