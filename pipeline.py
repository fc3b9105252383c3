"""
pipeline.py - pipeline parallelism: GPT-2's blocks cut into P stages, one per rank; micro-batches
stream through.

The batch is split into M micro-batches. Only the activation at a cut, (B/M, T, C), moves down to
the next stage, and its gradient moves back up, point to point. naive_step (--naive): every forward,
then every backward; a rank holds all M micro-batches. one_f_one_b (the default, PipeDream-Flush):
P-1-s warm-up forwards on stage s, then one forward, one backward: the same bubble, (P-1)/(M+P-1) of
the step, but stage s holds only P - s micro-batches. Each exchange is one batch_isend_irecv,
waited; a send is paired by hand with the receive the peer posts at the same point of its loop (on
NCCL a send may block until its receive is posted: two ranks each sending alone first would hang).
1F1B, P=2, M=4, as the loop runs ([...]: one batch_isend_irecv; >a1 sends micro-batch 1's
activation, <g0 receives micro-batch 0's gradient):
  rank 0  F0 [>a0] F1 [>a1 <g0] B0 F2 [>a2 <g1] B1 F3 [>a3 <g2] B2 [<g3] B3
  rank 1  [<a0] F0 B0 [>g0 <a1] F1 B1 [>g1 <a2] F2 B2 [>g2 <a3] F3 B3 [>g3]
Who sums what (stage s: blocks [s*L/P, (s+1)*L/P); stage 0 also wte, wpe; stage P-1 ln_f, lm_head):
  loss       the last stage scales each micro-batch's mean loss by 1/(M x --grad-accum)
  grads      autograd sums them over the micro-batches (+=); no two stages share a weight but wte
  wte        one copy on stage 0 (embedding), one on stage P-1 (lm_head): their gradients summed
  norm       each rank's sum of squares (wte counted once, on stage 0) summed over the pipeline:
             every rank clips by the same min(1, clip / norm), as clip_grad_norm_ on the whole model
  logged     the loss all-reduced, read with the norm in the step's one host sync
Payoff (printed, and OUT/metrics.jsonl's summary): 3 more batches timed op by op, their bubble
(each rank's idle share of the step, averaged) beside the closed form; micro-batches held per rank.
Read first: naive_step, one_f_one_b, Pipeline.exchange, .forward, .backward, train.
Beyond the core: messages planned ahead, in flight while ranks compute (plan_messages); --schedule
gpipe, zbh1, interleaved, dualpipe, dualpipev; --dp D replicas. Appendix: each schedule's closed
form and picture (OUT/schedule.png), the checks, the CLI.
Run (the data: python gpt2.py prepare --text ../shared/data/tinyshakespeare.txt --tokenizer char
--out data/shakespeare_char):
  torchrun --nproc_per_node=2 pipeline.py --data data/shakespeare_char --steps 20 --out out/pp
It ends (gpt2.py's losses; the bubble varies a little from run to run):
  step    19 | loss 3.1000 | norm 1.2339 | lr 1.00e-03 | ... | comm 1.11 MB
  bubble 0.24 of the step (measured, ... ms) | closed form (P-1)/(M+P-1) = 0.200
  micro-batches held at once per rank: [2, 1] of M=4 (1F1B: P - stage)
"""
import functools
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gpt2
from gpt2 import print0


def forwards(pipe, x, y, scale):
    """Every micro-batch's forward in turn: the activation in, my blocks, my output out."""
    pipe.start(x, y, scale)
    for mb in range(pipe.M):
        h = pipe.exchange(recv_from=pipe.up)  # (B/M, T, C), or None on the first stage
        pipe.exchange(pipe.down, pipe.compute("F", mb, h))
    return pipe.loss_sum


def naive_step(pipe, x, y, scale):
    """--naive (picotron's all-forward-all-backward): every forward, then every backward, one
    message per exchange. No cycle: activations flow only down, gradients only up, in order."""
    forwards(pipe, x, y, scale)
    for mb in range(pipe.M):  # my output's gradient in, backpropagate, my input's gradient out
        grad = pipe.exchange(recv_from=pipe.down)  # (B/M, T, C), or None on the last stage
        pipe.exchange(pipe.up, pipe.compute("B", mb, grad))
    return pipe.loss_sum


def one_f_one_b(pipe, x, y, scale):
    """1F1B (PipeDream-Flush): naive_step's bubble, but stage s holds P - s micro-batches, not M. In
    the steady state a forward's send down rides with the receive of a gradient from below, and a
    backward's send up with the receive of the next activation: the peer posts the mirror pair."""
    P, M, s = pipe.P, pipe.M, pipe.stage
    warmup = min(P - 1 - s, M)  # forwards to issue before the first backward comes back
    pipe.start(x, y, scale)
    for mb in range(warmup):
        h = pipe.exchange(recv_from=pipe.up)
        pipe.exchange(pipe.down, pipe.compute("F", mb, h))
    h = pipe.exchange(recv_from=pipe.up) if warmup < M else None
    for i in range(M - warmup):  # steady state: forward warmup + i, then backward i
        out = pipe.compute("F", warmup + i, h)
        grad = pipe.exchange(pipe.down, out, recv_from=pipe.down)  # activation down, gradient up
        more = warmup + i + 1 < M  # a forward still to come: its activation rides with my gradient
        h = pipe.exchange(pipe.up, pipe.compute("B", i, grad), recv_from=pipe.up if more else None)
    for mb in range(M - warmup, M):  # cooldown: drain the backwards
        grad = pipe.exchange(recv_from=pipe.down)
        pipe.exchange(pipe.up, pipe.compute("B", mb, grad))
    return pipe.loss_sum


def keep_only(model, layers, first, last):
    """Strip the model, in place, to a stage's blocks, the embeddings if first, ln_f and lm_head (=
    wte) if last."""
    for i in set(range(model.config.n_layer)) - set(layers):
        model.h[i] = nn.Identity()
    model.wte, model.wpe = (model.wte, model.wpe) if first else (None, None)
    model.ln_f, model.lm_head = (model.ln_f, model.lm_head) if last else (None, None)
    return model


class Pipeline:
    """This rank's stage of GPT-2 (its blocks; the embeddings on the first stage, ln_f and the head
    on the last), the exchange and the two ops the loops call, and the step's sums. saved: per
    (stage, micro-batch) what its backward needs; spans: the step's ops, timed (the bubble is the
    time outside them)."""

    def __init__(self, args, ctx, P):
        self.args, self.ctx, self.P, self.M = args, ctx, P, args.micro_batches
        self.S, self.stage = P, ctx.rank % P  # P stages, one per rank
        self.up = self.rank_of(self.stage - 1) if self.stage > 0 else None  # the neighbours' ranks
        self.down = self.rank_of(self.stage + 1) if self.stage < P - 1 else None
        self.comm, self.spans, self.peak_held = gpt2.CommMeter(), [], 0
        model = gpt2.build_model(args)  # the full model from --seed, then only this rank's stage
        self.cfg, self.n_params, per = model.config, model.num_params(), model.config.n_layer // P
        self.layers = {s: (s * per, (s + 1) * per) for s in range(P)}  # blocks [lo, hi) per stage
        self.first, self.last = self.stage == 0, self.stage == P - 1
        mine = range(*self.layers[self.stage])
        self.model = keep_only(model, mine, self.first, self.last).to(ctx.device)
        for i in mine if args.compile else ():  # per block: the cuts between stages stay Python
            self.model.h[i].compile()
        self.wire_dtype, self.resid_dtype = ctx.dtype, torch.float32  # bf16 messages on GPUs
        self.make_groups()
        if ctx.world > 1:
            dist.barrier()  # every NCCL communicator up before the first batch_isend_irecv

    def rank_of(self, stage):  # the global rank that runs a stage
        return stage

    def make_groups(self):  # every rank creates every group, in the same order; None: the default
        self.pipe_group = None  # the whole pipeline: the clip norm's sum
        ends = [self.rank_of(0), self.rank_of(self.P - 1)]  # the two copies of wte
        self.embed_group = dist.new_group(ends) if self.P > 1 else None

    def loaders(self):  # every stage reads the whole batch: the first needs x, the last y
        return gpt2.make_loaders(self.args, vocab_size=self.cfg.vocab_size)

    def start(self, x, y, scale):
        self.saved, self.spans = {}, []
        B = x.size(0) // self.M
        self.act_shape, self.scale = (B, x.size(1), self.cfg.n_embd), scale
        self.xs, self.ys = (t.to(self.ctx.device, non_blocking=True).split(B) for t in (x, y))
        self.loss_sum = torch.zeros((), device=self.ctx.device)  # xs, ys: M x (B/M, T)

    def step(self, x, y, scale):  # one micro-step's forwards and backwards -> this rank's loss sum
        return (naive_step if self.args.naive else one_f_one_b)(self, x, y, scale)

    def forward_only(self, x, y, scale):  # evaluation
        return forwards(self, x, y, scale)

    def exchange(self, send_to=None, tensor=None, recv_from=None):
        """One batch_isend_irecv, waited: `tensor` to rank send_to, an activation-shaped tensor from
        rank recv_from (None: no such message) -> what was received. CUDA: the stream waits."""
        ops, got = [], None
        if send_to is not None:
            tensor = tensor.detach().to(self.wire_dtype).contiguous()
            self.comm.send(tensor.nbytes)
            ops.append(dist.P2POp(dist.isend, tensor, send_to))
        if recv_from is not None:
            got = torch.empty(self.act_shape, dtype=self.wire_dtype, device=self.ctx.device)
            ops.append(dist.P2POp(dist.irecv, got, recv_from))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        return got

    def compute(self, kind, mb, h):
        """F (forward) or B (backward) of micro-batch mb on my stage; its span kept (the bubble)."""
        start = self.clock()
        out = (self.forward if kind == "F" else self.backward)(self.stage, mb, h)
        self.spans.append(((kind, self.stage, mb), start, self.clock()))
        return out

    def clock(self):  # CUDA: an event recorded on the stream, read after the step; CPU: ms
        if self.ctx.device.type != "cuda":
            return time.perf_counter() * 1e3
        return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))

    def forward(self, s, mb, h):
        """Stage s on micro-batch mb, h its input (B/M, T, C) (None on stage 0: the tokens) -> its
        output, or None on the last stage, which adds the micro-batch's scaled loss to loss_sum."""
        with self.ctx.autocast():
            if s == 0:
                h_in, h = None, self.model.embed(self.xs[mb])  # (B/M, T, C)
            else:
                h_in = h = h.to(self.resid_dtype).requires_grad_(torch.is_grad_enabled())
            h = self.model.forward_blocks(h, *self.layers[s])  # (B/M, T, C)
            if s == self.S - 1:  # the step's loss: the mean over micro-batches, each scaled by 1/M
                out = self.model.head_loss(h, self.ys[mb]) * self.scale
                self.loss_sum += out.detach().float()
        if s < self.S - 1:  # backward needs the graph behind h, not h: once sent, h is freed
            out = torch.autograd.graph.get_gradient_edge(h) if torch.is_grad_enabled() else None
        if torch.is_grad_enabled():
            self.saved[(s, mb)] = (h_in, out)
            self.peak_held = max(self.peak_held, len(self.saved))
        return h if s < self.S - 1 else None

    def backward(self, s, mb, grad):
        """Micro-batch mb back through stage s from its output's gradient (None on the last stage:
        from the loss) -> its input's gradient (B/M, T, C), or None on stage 0."""
        h_in, out = self.saved.pop((s, mb))
        torch.autograd.backward(out, None if grad is None else grad.to(self.resid_dtype))
        return h_in.grad if s > 0 else None

    def all_reduce(self, tensor, group=None):  # a SUM, its bytes counted by the pipeline's meter
        self.comm.all_reduce(tensor.nbytes, dist.get_world_size(group))
        dist.all_reduce(tensor, group=group)

    def sync_grads(self):
        """The tied wte/lm_head: the first and the last stage's copies of its gradient summed."""
        if self.P > 1 and (self.first or self.last):
            tied = self.model.wte if self.first else self.model.lm_head
            self.all_reduce(tied.weight.grad, self.embed_group)

    def clip_grad_norm(self, max_norm):
        """gpt2.clip_grad_norm_ over the pipeline (max_norm 0: no clip) -> the norm before clipping:
        squares summed over the stages, the tied wte counted once, on stage 0. No host sync."""
        head = self.model.lm_head.weight if self.P > 1 and self.last else None  # wte's 2nd copy
        sq = sum((p.grad.float().pow(2).sum() for p in self.model.parameters() if p is not head),
                 torch.zeros((), device=self.ctx.device))
        if self.P > 1:
            self.all_reduce(sq, self.pipe_group)  # the sum of squares over the stages
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # a tensor: no host sync
        for p in self.model.parameters() if max_norm > 0 else ():
            p.grad.mul_(coef)
        return norm

    def global_loss(self, loss_sum):  # the last stage holds it: the sum over ranks is the step's
        if self.ctx.world > 1:
            self.all_reduce(loss_sum)
        return loss_sum


def check_args(args, P):
    """A batch its micro-batches do not divide (rows would be dropped) or blocks that do not split
    into P stages (a block would be dropped): one line before the first collective (gpt2.fail)."""
    gpt2.check_range(args.micro_batches, "--micro-batches", 1, todo="give a positive integer")
    M, L = args.micro_batches, gpt2.model_config(args).n_layer
    if args.batch_size % M:
        gpt2.fail(f"--batch-size {args.batch_size} is not divisible by --micro-batches {M}",
                  "--micro-batches", "give a divisor of --batch-size")
    if L % P:
        gpt2.fail(f"{L} layers do not split into {P} stages (P={P} ranks per pipeline)",
                  "--n-layer", f"give a multiple of {P} layers, or another number of ranks")


def measure_bubble(pipe, batches):
    """The batches once more through pipe.step, every op timed, their gradients dropped -> the
    figures: the bubble (per rank, the share of the steps, from the ranks' common start to the last
    rank's end, spent outside its ops; averaged over the ranks), the closed form (P-1)/(M+P-1)
    (equal stages, free messages) and the most micro-batches each rank held at once."""
    cuda, busy, total, pipe.peak_held = pipe.ctx.device.type == "cuda", 0.0, [], 0
    ms = (lambda a, b: a.elapsed_time(b)) if cuda else (lambda a, b: b - a)
    for x, y in batches:
        if pipe.ctx.world > 1:
            dist.barrier()  # the ranks start together, so their clocks line up
        start = pipe.clock()
        pipe.step(x, y, 1.0)
        total.append((start, pipe.clock()))
        if cuda:
            torch.cuda.synchronize()  # the events are done: read them
        busy += sum(ms(a, b) for _, a, b in pipe.spans)
    pipe.model.zero_grad(set_to_none=True)
    mine = torch.tensor([busy, *(ms(a, b) for a, b in total), pipe.peak_held], dtype=torch.float64,
                        device=pipe.ctx.device)  # (2 + batches,)
    every = [torch.zeros_like(mine) for _ in range(pipe.ctx.world)]
    if pipe.ctx.world > 1:
        dist.all_gather(every, mine)
    every = torch.stack(every if pipe.ctx.world > 1 else [mine])[:pipe.P]  # (P, 2 + batches)
    step_ms = every[:, 1:-1].max(0).values.sum().item()  # each step until its last rank is done
    return {"bubble": (1 - every[:, 0] / step_ms).mean().item(), "step_ms": step_ms / len(total),
            "bubble_closed_form": (pipe.P - 1) / (pipe.M + pipe.P - 1),
            "held": [int(h) for h in every[:, -1].tolist()]}


def train(args, P, Pipe=Pipeline):
    """gpt2.train's loop: lr, micro-steps (pipe.step: 1F1B or naive_step), gradients synced, clip,
    step, log, eval; then the payoff: 3 more batches timed, their bubble beside the closed form."""
    check_args(args, P)
    ctx = gpt2.setup(args)
    pipe = Pipe(args, ctx, P)
    train_loader, val_loader = pipe.loaders()
    opt = gpt2.make_adamw(gpt2.optimizer_groups(pipe.model, args.weight_decay), args, ctx.device)
    tokens = args.batch_size * args.seq_len * args.grad_accum * train_loader.world  # all readers
    metrics = gpt2.Metrics(args, ctx, pipe.cfg, pipe.n_params, tokens)
    profiler = gpt2.Profiler(args, ctx)
    print0(f"{'naive' if args.naive else type(pipe).__name__}: P={P} stages, M={pipe.M} "
           f"micro-batches of {args.batch_size // pipe.M} | device {ctx.device} {ctx.dtype}")
    scale = 1.0 / (args.micro_batches * args.grad_accum)  # the step's loss: the mean of them all
    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        # on the device: pinned, so the copy is asynchronous on CUDA (no host sync)
        batches = (train_loader.next_batch(ctx.device) for _ in range(args.grad_accum))
        loss_sum = sum(pipe.step(x, y, scale) for x, y in batches)
        pipe.sync_grads()
        loss = pipe.global_loss(loss_sum)
        norm = pipe.clip_grad_norm(args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val, norm_val = torch.stack([loss, norm]).tolist()  # the step's one host sync
        gpt2.check_finite(loss_val, step)
        metrics.log_step(step, loss_val, lr, comm_mb=pipe.comm.take_mb(), grad_norm=norm_val)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            pipe.model.eval()  # gpt2.evaluate averages over every rank: the last stage's loss x P
            val_loss = functools.partial(pipe.forward_only, scale=P / pipe.M)
            metrics.log_val(step, gpt2.evaluate(val_loss, val_loader, args.eval_steps, ctx.device))
            pipe.model.train()
    metrics.plot()
    fig = measure_bubble(pipe, [train_loader.next_batch(ctx.device) for _ in range(3)])
    print0(f"bubble {fig['bubble']:.3f} of the step (measured, {fig['step_ms']:.1f} ms) | closed "
           f"form (P-1)/(M+P-1) = {fig['bubble_closed_form']:.3f}")
    print0(f"micro-batches held at once per rank: {fig['held']} of M={pipe.M} (1F1B: P - stage)")
    metrics.log_summary(fig)
    return pipe


def make_parser():
    p = gpt2.make_parser("Train GPT-2 with pipeline parallelism (1F1B; --naive: all forwards, "
                         "then all backwards).")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches M of --batch-size")
    p.add_argument("--naive", action="store_true", help="all forwards, then all backwards")
    return p


def main(argv=None):
    args = make_parser().parse_args(argv)
    train(args, int(os.environ.get("WORLD_SIZE", 1)))


# ---- Beyond the core ----
# The core's loops wait for every exchange. Below: messages planned ahead (plan_messages), in flight
# while the ranks compute, as the schedules need (each a PlannedPipeline, chosen in the appendix):
#   GPipe: all forwards, then all backwards, with planned messages (Huang et al. 2019)
#   SplitBackward: a backward split into I (input gradient) now and W (weight gradient) later (Qi et al. 2023, 2)
#   ZBH1: 1F1B with W's deferred into the cooldown (Qi et al. 2023, 3.1)
#   MultiStage: several stages per rank; Interleaved: --virtual-stages V chunks per rank (Narayanan et al.
#   2021, 2.2, Megatron-LM's order); DualPipe: two directions, two copies of every stage (DeepSeek-V3 3.2.1);
#   DualPipeV: DualPipe folded into a V, one copy (deepseek-ai/DualPipe, torch's ScheduleDualPipeV)
#   simulate_paired: DualPipe as DeepSeek runs it, each F&B pair one unit (DeepSeek-V3 table 2)
#   Replicas: --dp D pipelines on different data, every gradient averaged over a stage's D replicas
# Notation: F forward, B full backward = I (input gradient) + W (weight gradient); the zero-bubble paper's B is I.
import collections  # noqa: E402

import torch.nn.functional as F  # noqa: E402

Op = collections.namedtuple("Op", "kind stage mb")  # kind F | B | I | W; one micro-batch on one stage


def one_f_one_b_ops(P, M, rank):
    """The core's one_f_one_b as an op list (what its spans show): P-1-rank warm-up forwards, then one
    forward one backward, then the remaining backwards."""
    warmup = min(P - 1 - rank, M)
    ops = [Op("F", rank, i) for i in range(warmup)]
    for i in range(M - warmup):
        ops += [Op("F", rank, warmup + i), Op("B", rank, i)]
    return ops + [Op("B", rank, i) for i in range(M - warmup, M)]


def message_in(op, S):
    """What an op waits for, keyed by the receiving stage: F the activation from above, a backward (B, I)
    its output's gradient from below; None at the ends of the pipeline."""
    from_below = op.kind != "F"  # a gradient comes up from stage + 1, an activation down from stage - 1
    key = ("grad" if from_below else "act", op.stage, op.mb)
    return key if op.kind in "FBI" and 0 < op.stage + from_below < S else None


def message_out(op, S):
    """What an op sends (the mirror of message_in): F its output's activation, a backward its input's gradient."""
    return message_in(Op(op.kind, op.stage + (1 if op.kind == "F" else -1), op.mb), S)


def simulate(orders, cost):
    """Every rank's op list run against its data dependencies with op durations `cost` ({kind or (kind, stage):
    time}) and free messages -> per rank [(op, start, end)]."""
    P, S = len(orders), 1 + max(op.stage for order in orders for op in order)
    made_by = lambda key: ("F", key[1] - 1, key[2]) if key[0] == "act" else ("B", key[1] + 1, key[2])  # noqa: E731
    done, out, free = {}, [[] for _ in range(P)], [0.0] * P
    while sum(map(len, out)) < sum(map(len, orders)):
        progressed = False
        for r, order in enumerate(orders):
            for op in order[len(out[r]):]:
                key = message_in(op, S)
                if key is not None and made_by(key) not in done:
                    break
                start = max(free[r], done[made_by(key)] if key is not None else 0.0)
                free[r] = start + cost.get((op.kind, op.stage), cost.get(op.kind))
                out[r].append((op, start, free[r]))
                done[("B" if op.kind == "I" else op.kind, op.stage, op.mb)], progressed = free[r], True
        assert progressed, f"the op lists deadlock (P={P}, after {[len(o) for o in out]} ops)"
    return out


def plan_messages(orders, owner):
    """Every message of a step, before anything moves: per rank, batch 0 before its first op, batch i + 1 after
    op i, each [("send" | "recv", peer, key)]; owner(stage, mb): the rank running it. On one clock (a simulation)
    a message leaves when the op that made it ends, at t, and the receiver posts it in its first batch at or
    after t: a batch waits only on batches earlier on that clock, so no cycle forms (tests/ checks every plan
    against a model of NCCL's rules, which pair the n-th send a->b with the n-th receive: in send order)."""
    spans = simulate(orders, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0})  # any costs would do: these are nominal
    S = 1 + max(op.stage for order in orders for op in order)
    plans = [[[] for _ in range(len(order) + 1)] for order in orders]
    leaving = []  # (send time, sender, key, receiver)
    for r, ops in enumerate(spans):
        for i, (op, _, end) in enumerate(ops):
            key = message_out(op, S)
            if key is not None and owner(key[1], key[2]) != r:  # between two stages of one rank: no message
                plans[r][i + 1].append(("send", owner(key[1], key[2]), key))
                leaving.append((end, r, key, owner(key[1], key[2])))
    for t, src, key, dst in sorted(leaving):
        starts = [a for _, a, _ in spans[dst]] + [float("inf")]  # batch j is posted when op j starts
        plans[dst][next(j for j, a in enumerate(starts) if a >= t)].append(("recv", src, key))
    return plans


class PlannedPipeline(Pipeline):
    """The executor the schedules share: every rank's op list (op_list), every message planned ahead
    (plan_messages), each op's sends and the receives of ops to come issued in one batch_isend_irecv that
    is not waited for: messages fly while the rank computes. inbox: posted receives by key; outbox: outputs
    awaiting their batch; sent: sends in flight (their buffers kept alive). Its own op list is 1F1B's."""

    def __init__(self, args, ctx, P):
        super().__init__(args, ctx, P)
        self.pp_rank = self.stage
        self.orders = [self.op_list(r) for r in range(P)]
        self.plan = plan_messages(self.orders, self.owner)  # every message of a step, in advance
        self.eval_orders, self.eval_plan = self.forward_plan()

    def op_list(self, rank):
        return one_f_one_b_ops(self.P, self.M, rank)

    def owner(self, stage, mb):  # the pipeline rank that runs a stage for a micro-batch
        return stage

    def forward_plan(self):  # evaluation: forwards only, in stage order
        orders = [[Op("F", r, i) for i in range(self.M)] for r in range(self.P)]
        return orders, plan_messages(orders, self.owner)

    def step(self, x, y, scale):
        return self.run(x, y, scale)

    def forward_only(self, x, y, scale):
        return self.run(x, y, scale, self.eval_orders, self.eval_plan)

    def start(self, x, y, scale):
        super().start(x, y, scale)
        self.inbox, self.outbox, self.sent = {}, {}, []

    def send(self, message, batch):
        """Queue an op's output (key, tensor), then issue the planned batch that follows the op."""
        if message is not None:
            key, tensor = message
            self.outbox[key] = tensor.detach().to(self.wire_dtype).contiguous()
        self.issue(batch)

    def issue(self, batch):
        """One planned batch_isend_irecv: queued sends, planned receives (tags for gloo; NCCL matches in order)."""
        tag = lambda key: ((key[0] == "grad") * self.S + key[1]) * self.M + key[2]  # noqa: E731
        buffer = lambda: torch.empty(self.act_shape, dtype=self.wire_dtype, device=self.ctx.device)  # noqa: E731
        self.comm.send(sum(self.outbox[key].nbytes for kind, _, key in batch if kind == "send"))
        ops = [dist.P2POp(dist.isend, self.outbox.pop(key), self.rank_of(peer), tag=tag(key)) if kind == "send"
               else dist.P2POp(dist.irecv, buffer(), self.rank_of(peer), tag=tag(key)) for kind, peer, key in batch]
        if ops:
            works = dist.batch_isend_irecv(ops)
            per_op = [[w] for w in works] if len(works) == len(ops) else [works] * len(ops)  # gloo: one each
            for (kind, _, key), op, w in zip(batch, ops, per_op):
                if kind == "send":
                    self.sent.append((w, op.tensor))
                else:
                    self.inbox[key] = (op.tensor, w)
        # a sent output is freed once its send is done (Megatron's deallocate_output_tensor)
        self.sent = [(w, t) for w, t in self.sent if not all(x.is_completed() for x in w)]

    def run_op(self, op, h):
        """One op on its input h (or None) -> its output (or None); its span kept, as the core's compute."""
        start = self.clock()
        out = self.op_function(op.kind)(op.stage, op.mb, h)
        self.spans.append((op, start, self.clock()))
        return out

    def op_function(self, kind):
        return {"F": self.forward, "B": self.backward}[kind]

    def run(self, x, y, scale, orders=None, plan=None):
        """One step of this rank's op list and planned messages (or evaluation's): per op receive, compute,
        send -> this rank's part of the loss (the scaled micro-batch losses; non-zero on the last stage)."""
        orders, plan, me = orders or self.orders, plan or self.plan, self.pp_rank
        self.start(x, y, scale)
        self.issue(plan[me][0])  # the receives planned before the first op
        for i, op in enumerate(orders[me]):
            key = message_in(op, self.S)  # receive: wait for the planned receive of the op's input
            h, works = self.inbox.pop(key) if key is not None else (None, [])
            for w in works:
                w.wait()  # on CUDA the stream waits, not the host
            out = self.run_op(op, h)
            key = message_out(op, self.S)
            self.send((key, out) if key is not None and out is not None else None, plan[me][i + 1])
        for w in (w for works, _ in self.sent for w in works):
            w.wait()
        assert not (self.inbox or self.outbox or self.saved), "schedule left work behind"
        return self.loss_sum


class Replicas(Pipeline):
    """--dp D: D pipelines on different rows of the global batch (ranks d*P .. d*P+P-1 form replica d);
    the tied wte summed within each pipeline, then every gradient averaged over its stage's D replicas.
    Mixed in front of any single-stage class (MultiStage handles D itself)."""

    def __init__(self, args, ctx, P):
        self.D, self.replica = args.dp, ctx.rank // P
        super().__init__(args, ctx, P)

    def rank_of(self, stage):
        return self.replica * self.P + stage

    def make_groups(self):  # every rank creates every group, in the same order; None: the default group
        P, D = self.P, self.D
        new = lambda ranks: dist.new_group(ranks) if 1 < len(ranks) < self.ctx.world else None  # noqa: E731
        self.pipe_group = [new(list(range(d * P, (d + 1) * P))) for d in range(D)][self.replica]
        self.dp_group = [new(list(range(p, P * D, P))) for p in range(P)][self.stage]  # a stage's D replicas
        self.embed_group = [new([d * P, d * P + P - 1]) for d in range(D)][self.replica] if P > 1 else None

    def loaders(self):
        return gpt2.make_loaders(self.args, self.replica, self.D, self.cfg.vocab_size)

    def sync_grads(self):
        """The core's tied-wte sum, then the sum over the replicas, / D: a mean."""
        super().sync_grads()
        for p in self.model.parameters() if self.D > 1 else ():  # the same order on every replica
            self.all_reduce(p.grad, self.dp_group)
            p.grad /= self.D

    def global_loss(self, loss_sum):  # the last stages hold the losses; the mean over replicas is the step's
        return super().global_loss(loss_sum) / self.D


def gpipe(P, M, rank):
    """GPipe: all M forwards, then all M backwards; all M micro-batches' activations are held at once."""
    return [Op("F", rank, i) for i in range(M)] + [Op("B", rank, i) for i in range(M)]


class GPipe(PlannedPipeline):
    def op_list(self, rank):
        return gpipe(self.P, self.M, rank)


def _accumulate(p, g, rows=None):
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    if rows is not None:
        p.grad.index_add_(0, rows[0], rows[1].to(p.dtype))
    else:
        p.grad += g.to(p.dtype)


class SplitBackward(PlannedPipeline):
    """The I/W tape: a forward whose backward will be split records, by a forward hook on every Linear,
    LayerNorm and Embedding, its input and where its output's gradient arrives; I computes the gradients of
    the stage input and of those outputs (autograd skips the weight-gradient matmuls), W the weight gradients
    from the recorded pairs. The outputs are not kept, but from I to W the tape holds each output's gradient:
    for lm_head the logits-sized (B/M, T, V). Ops I and W; B stays the full backward."""

    def __init__(self, args, ctx, P):
        super().__init__(args, ctx, P)
        self.tape, self.split, self.tapes, self.deferred = None, set(), {}, {}
        if any(op.kind == "I" for op in self.orders[self.pp_rank]):
            for m in self.model.modules():
                if isinstance(m, (nn.Linear, nn.LayerNorm, nn.Embedding)):
                    m.register_forward_hook(self.record)

    @torch.compiler.disable  # under --compile the recording stays eager (a graph break)
    def record(self, module, inputs, output):
        if self.tape is not None:
            self.tape.append((module, inputs[0], torch.autograd.graph.get_gradient_edge(output)))

    def run(self, x, y, scale, orders=None, plan=None):
        self.split = {(op.stage, op.mb) for op in (orders or self.orders)[self.pp_rank] if op.kind == "I"}
        loss = super().run(x, y, scale, orders, plan)
        assert not (self.tapes or self.deferred), "schedule left work behind"
        return loss

    def forward(self, s, mb, h):
        if (s, mb) not in self.split:
            return super().forward(s, mb, h)
        self.tape = []
        out = super().forward(s, mb, h)
        self.tapes[(s, mb)], self.tape = self.tape, None
        return out

    def op_function(self, kind):
        return {"F": self.forward, "B": self.backward, "I": self.input_grad, "W": self.weight_grad}[kind]

    def run_op(self, op, h):  # held: micro-batches awaiting their backward or their W
        out = super().run_op(op, h)
        self.peak_held = max(self.peak_held, len(self.saved.keys() | self.deferred.keys()))
        return out

    def input_grad(self, s, mb, grad):
        """I: the gradient w.r.t. the stage input (the previous stage waits for it) and w.r.t. every recorded
        output; the (input, output gradient) pairs wait for W."""
        (h_in, out), tape = self.saved.pop((s, mb)), self.tapes.pop((s, mb))
        inputs = ([h_in] if h_in is not None else []) + [edge for _, _, edge in tape]
        grads = torch.autograd.grad(out, inputs, None if grad is None else grad.to(self.resid_dtype))
        self.deferred[(s, mb)] = [(m, x, dy) for (m, x, _), dy in zip(tape, grads[len(grads) - len(tape):])]
        return grads[0] if s > 0 else None

    def weight_grad(self, s, mb, _):
        """W: the weight gradients of one I, from the recorded inputs x and output gradients dy."""
        for m, x, dy in self.deferred.pop((s, mb)):
            dy2 = dy.reshape(-1, dy.size(-1))  # (N, out features)
            if isinstance(m, nn.Embedding):  # x are token ids (wte) or positions (wpe): rows gathered
                _accumulate(m.weight, None, rows=(x.reshape(-1), dy2))
                continue
            if isinstance(m, nn.Linear):
                _accumulate(m.weight, dy2.t() @ x.reshape(-1, x.size(-1)).to(dy2.dtype))
            else:  # LayerNorm: y = xhat * gamma + beta
                xhat = F.layer_norm(x.float(), m.normalized_shape, eps=m.eps).reshape(-1, dy.size(-1))
                _accumulate(m.weight, (dy2.float() * xhat).sum(0))
            if m.bias is not None:
                _accumulate(m.bias, dy2.float().sum(0))
        return None


def zbh1(P, M, rank):
    """ZB-H1 (Qi et al. 2023, section 3.1): 1F1B with every backward split into I (the input gradient the
    previous stage waits for) and W (the weight gradient nobody waits for). Rank r runs each W `r` ops
    behind its I: the I's then travel back to rank 0 at I's pace instead of B's, and the W's held back
    fill the cooldown, where 1F1B idles: bubble (P-1)(F+B-2W) per rank instead of (P-1)(F+B) (tests/
    simulates it). Memory: P - rank micro-batches await their I, as in 1F1B, but rank r also keeps the W
    state of up to r + 1, so every rank holds state for P micro-batches from F to W; on the last stage
    that state includes lm_head's logits-sized output gradient (tests/bench_pipeline.py --quick). The
    same lists as torch's ScheduleInterleavedZeroBubble with one chunk per rank (tests/)."""
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


class ZBH1(SplitBackward):
    def op_list(self, rank):
        return zbh1(self.P, self.M, rank)


class MultiStage(Replicas, PlannedPipeline):
    """Several stages per rank: the layout is num_stages(), stages_of(rank), owner(stage, mb) (the rank that
    runs a stage for a micro-batch) and copies(p) (the pipeline ranks holding the same parameters). The
    core's __init__, send, groups, gradient sums, clip and evaluation plan, rewritten for it (with --dp's
    replicas): a message between two stages of one rank stays on the rank, the tied wte is summed only
    where its two uses sit on two ranks, and copies of a stage sum their gradients."""

    def __init__(self, args, ctx, P):  # the core's __init__ with this layout (it does not call the core's)
        self.args, self.ctx, self.P, self.M, self.D = args, ctx, P, args.micro_batches, args.dp
        self.stage = self.pp_rank = ctx.rank % P  # the rank's place in its pipeline
        self.replica = ctx.rank // P
        self.S, self.my_stages = self.num_stages(), self.stages_of(ctx.rank % P)
        self.comm, self.spans, self.peak_held = gpt2.CommMeter(), [], 0
        model = gpt2.build_model(args)
        self.cfg, self.n_params, per = model.config, model.num_params(), model.config.n_layer // self.S
        self.layers = {s: (s * per, (s + 1) * per) for s in range(self.S)}
        self.first, self.last = 0 in self.my_stages, self.S - 1 in self.my_stages
        keep = {i for s in self.my_stages for i in range(*self.layers[s])}
        self.model = keep_only(model, keep, self.first, self.last).to(ctx.device)
        for i in sorted(keep) if args.compile else ():
            self.model.h[i].compile()
        self.orders = [self.op_list(r) for r in range(P)]
        self.plan = plan_messages(self.orders, self.owner)
        self.eval_orders, self.eval_plan = self.forward_plan()
        self.wire_dtype, self.resid_dtype = ctx.dtype, torch.float32
        self.make_groups()
        if ctx.world > 1:
            dist.barrier()

    def num_stages(self):
        return self.P

    def stages_of(self, rank):
        return (rank,)

    def owner(self, stage, mb):
        return stage

    def copies(self, p):
        return [p]

    def make_groups(self):  # every rank creates every group, in the same order; None: the default group
        P, D, r = self.P, self.D, self.ctx.rank
        new = lambda ranks: dist.new_group(ranks) if 1 < len(ranks) < self.ctx.world else None  # noqa: E731
        self.pipe_group = [new(list(range(d * P, (d + 1) * P))) for d in range(D)][self.replica]
        for p in (p for p in range(P) if min(self.copies(p)) == p):  # same parameters: D replicas (x copies)
            ranks = sorted(d * P + q for d in range(D) for q in self.copies(p))
            g = new(ranks)
            if r in ranks:
                self.grad_group, self.grad_group_size = g, len(ranks)
        self.tied_split = P > 1 and self.S - 1 not in self.stages_of(0)
        if self.tied_split:
            self.embed_group = [new([d * P, d * P + P - 1]) for d in range(D)][self.replica]

    def send(self, message, batch):
        if message is not None and self.owner(message[0][1], message[0][2]) == self.pp_rank:
            self.inbox[message[0]] = (message[1].detach(), [])  # the next stage is on this rank: no message
            message = None
        super().send(message, batch)

    def sync_grads(self):
        params = list(self.model.parameters())
        for p in (p for p in params if p.grad is None):
            p.grad = torch.zeros_like(p)
        if self.tied_split and (self.first or self.last):
            self.all_reduce((self.model.wte if self.first else self.model.lm_head).weight.grad, self.embed_group)
        if self.grad_group_size > 1:  # sum over the copies, average over the D replicas
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # (all of this rank's parameters,)
            self.all_reduce(flat, self.grad_group)
            flat /= self.D
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))

    def clip_grad_norm(self, max_norm):
        """Each parameter counted once: the lowest of its copies; the head's copy of wte on the first stage."""
        head = self.model.lm_head.weight if self.tied_split and self.last else None  # wte's copy: counted on rank 0
        params = [] if min(self.copies(self.pp_rank)) != self.pp_rank else [
            p for p in self.model.parameters() if p is not head]
        sq = sum((p.grad.float().pow(2).sum() for p in params), torch.zeros((), device=self.ctx.device))
        if self.P > 1:
            self.all_reduce(sq, self.pipe_group)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.model.parameters() if max_norm > 0 else ():
            p.grad.mul_(coef)
        return norm

    def forward_plan(self):  # lower stages first: a topological order in every layout
        orders = [[Op("F", s, i) for s in sorted(self.stages_of(r)) for i in range(self.M) if self.owner(s, i) == r]
                  for r in range(self.P)]
        return orders, plan_messages(orders, self.owner)


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


class Interleaved(MultiStage):
    """--virtual-stages V: rank r holds stages r, r+P, ..., r+(V-1)P (one chunk of L/(VP) blocks each)."""

    def __init__(self, args, ctx, P):
        self.V = args.virtual_stages
        super().__init__(args, ctx, P)

    def num_stages(self):
        return self.V * self.P

    def stages_of(self, rank):
        return tuple(c * self.P + rank for c in range(self.V))

    def owner(self, stage, mb):
        return stage % self.P

    def op_list(self, rank):
        return interleaved(self.P, self.M, rank, self.V)


# Why DualPipe exists, and what this file does not do. DeepSeek-V3 (section 3.2.1) built DualPipe for
# expert parallelism: each MoE layer's dispatch and combine all-to-alls cost about as much as its compute,
# so DualPipe pairs the forward of one micro-batch with the backward of another (the F&B pairs of its main
# phase) and runs them as one unit on two CUDA streams, each chunk's all-to-all and pipeline sends hidden
# under the other chunk's compute. Its bubble, (PP/2-1)(F&B+B-3W) per rank (table 2), assumes that unit.
# This file has no all-to-all (GPT-2 is dense) and runs F then B on one stream; it overlaps only the
# point-to-point messages. simulate_paired (F&B as one unit) reproduces table 2's formula exactly, the
# executor's own order idles half of it at F=1, B=2, W=1 (tests/), and report() prints both, labelled.
# That is no win over DeepSeek: pairing trades idle time for hiding an all-to-all inside each F&B, and
# pays only where there is one to hide, which a dense model has not. What this file keeps of DualPipe is
# the schedule: two directions (or the V) and W's that fill the ramps. simulate() at F=1, B=2, I=W=1
# (lower case: the way back up the V; '.' idle), P=4, M=8, beside 1F1B (tests/ checks these pictures):
#   1F1B      rank0 FFFF......BBFBBFBBFBBFBB.BB.BB.BB     idle per rank (P-1)(F+B) = 9 of 33
#             rank1 .FFF....BBFBBFBBFBBFBBFBB.BB.BB..
#             rank2 ..FF..BBFBBFBBFBBFBBFBBFBB.BB....
#             rank3 ...FBBFBBFBBFBBFBBFBBFBBFBB......
#   DualPipeV rank0 FFFFFFFfiwfiwfiwfFbbfBBbbf.BBbbf.BBbbf.BBbbIWIWIWIW   idle 3 of 51 per rank, each rank
#             rank1 .FFFFFfFfiwfiwfFbbfBBFbbfBBbbf.BBbbf.BBbbBBiIwIWIWW   doing twice 1F1B's work (2P stages)
#             rank2 ..FFFfFfFfiwfFbbfBBFbbfBBFbbfBBbbf.BBbbBBbbIiIWIwWW
#             rank3 ...FfFfFfFfFbbfBBFbbfBBFbbfBBFbbfBBbbBBbbBBiIiIwWwW
# Layouts: dualpipe, P=4: rank r holds stage r of direction 0 (fed at rank 0, micro-batches 0..M/2-1) and
# stage P-1-r of direction 1 (fed at rank P-1, M/2..M-1): two copies of every stage, grads summed in pairs.
# dualpipev, P=4: 2P = 8 stages, rank r holds stage r (going down) and 2P-1-r (coming back up the V):
#   rank0 S0 -> rank1 S1 -> rank2 S2 -> rank3 S3 --+   the loss and both uses of the tied wte are on
#   rank0 S7 <- rank1 S6 <- rank2 S5 <- rank3 S4 <-+   rank0 (one tensor)


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


class DualPipe(SplitBackward, MultiStage):
    """M/2 micro-batches enter at each end; rank r holds stage r of direction 0 and stage P-1-r of direction
    1, so ranks r and P-1-r hold copies of the same stages and sum their gradients (DeepSeek-V3 3.2.1: "two
    copies of the model parameters"); the first and last stage share a rank (no tied-wte group)."""

    def op_list(self, rank):
        return dualpipe(self.P, self.M, rank)

    def stages_of(self, rank):
        return (rank, self.P - 1 - rank)

    def owner(self, stage, mb):
        return stage if mb < self.M // 2 else self.P - 1 - stage

    def copies(self, p):
        return sorted({p, self.P - 1 - p})


class DualPipeV(SplitBackward, MultiStage):
    """2P stages down and back up a V: rank r holds stages r and 2P-1-r, one copy of the weights; the turn
    of the V (stage P-1 to P) stays on rank P-1, and rank 0 holds the loss and both uses of the tied wte."""

    def op_list(self, rank):
        return dualpipev(self.P, self.M, rank)

    def num_stages(self):
        return 2 * self.P

    def stages_of(self, rank):
        return (rank, 2 * self.P - 1 - rank)

    def owner(self, stage, mb):
        return stage if stage < self.P else 2 * self.P - 1 - stage




def simulate_paired(orders, cost):
    """DeepSeek's execution of DualPipe: a forward followed by a full backward of another stage (an "F&B"
    pair of the main phase) runs as one unit: it starts when both inputs are there, and both outputs leave
    when it ends, after F + B (no speed-up assumed from the overlap, only its ordering). This file's
    executor (and simulate) run them one after the other instead."""
    P, S = len(orders), 1 + max(op.stage for order in orders for op in order)
    dur = lambda op: cost.get((op.kind, op.stage), cost.get(op.kind))  # noqa: E731
    made_by = lambda key: ("F", key[1] - 1, key[2]) if key[0] == "act" else ("B", key[1] + 1, key[2])  # noqa: E731
    done, out, pos, free = {}, [[] for _ in range(P)], [0] * P, [0.0] * P
    while any(pos[r] < len(orders[r]) for r in range(P)):
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                i = pos[r]
                pair = order[i].kind == "F" and i + 1 < len(order) and order[i + 1].kind == "B" and \
                    order[i + 1].stage != order[i].stage
                ops = order[i:i + 1 + pair]
                needs = [made_by(k) for k in (message_in(o, S) for o in ops) if k is not None]
                if any(n not in done for n in needs):
                    break
                t = max([free[r]] + [done[n] for n in needs])
                for o in ops:
                    out[r].append((o, t, t + dur(o)))
                    t += dur(o)
                for o in ops:
                    done[("B" if o.kind == "I" else o.kind, o.stage, o.mb)] = t
                free[r], pos[r], progressed = t, pos[r] + len(ops), True
        assert progressed, f"the op lists deadlock (P={P})"
    return out


# ---- Appendix ----
# The schedules' closed forms, simulations and pictures, their layouts as plain functions for tests/ and
# benches, argument checks, the CLI.
import json  # noqa: E402

SCHEDULE_NAMES = ("gpipe", "1f1b", "zbh1", "interleaved", "dualpipe", "dualpipev")


class GPipeReplicas(Replicas, GPipe):
    pass


class ZBH1Replicas(Replicas, ZBH1):
    pass


def pipeline_class(schedule, dp=1):
    """The class that runs --schedule (1f1b: the core's Pipeline); with --dp > 1 the single-stage ones get
    Replicas in front (the multi-stage ones handle --dp themselves)."""
    if schedule == "gpipe":
        return GPipeReplicas if dp > 1 else GPipe
    if schedule == "zbh1":
        return ZBH1Replicas if dp > 1 else ZBH1
    if schedule == "interleaved":
        return Interleaved
    if schedule == "dualpipe":
        return DualPipe
    if schedule == "dualpipev":
        return DualPipeV
    return Replicas if dp > 1 else Pipeline


def bubble_fraction(ranks):
    """Mean over ranks of the idle share of the step, from [(op, start, end)] per rank."""
    t0, t1 = min(a for r in ranks for _, a, _ in r), max(b for r in ranks for _, _, b in r)
    return sum((t1 - t0) - sum(b - a for _, a, b in r) for r in ranks) / len(ranks) / (t1 - t0)


def timed_spans(pipe, x, y):
    """The batch once more through pipe.step, every op timed (as the core's measure_bubble), its gradients
    dropped -> every rank's {"spans": [(op, start ms, end ms)], "peak_held"}, the times from a common start."""
    pipe.peak_held = 0
    if pipe.ctx.world > 1:
        dist.barrier()  # the ranks start together, so their clocks line up
    t0 = pipe.clock()
    pipe.step(x, y, 1.0)
    pipe.model.zero_grad(set_to_none=True)
    if pipe.ctx.device.type == "cuda":
        torch.cuda.synchronize()
    ms = (lambda t: t - t0) if pipe.ctx.device.type != "cuda" else t0.elapsed_time  # noqa: E731
    mine = {"spans": [(tuple(op), ms(a), ms(b)) for op, a, b in pipe.spans], "peak_held": pipe.peak_held}
    every = [mine] * pipe.ctx.world
    if pipe.ctx.world > 1:
        dist.all_gather_object(every, mine)
    return every


def layout(schedule, P, M=1, V=2):
    """A PlannedPipeline subclass's layout without a model (for tests/, benches and checks); 1f1b's op
    list is the core loop's order, naive's GPipe's."""
    pipe = object.__new__({"1f1b": PlannedPipeline, "naive": GPipe}.get(schedule) or pipeline_class(schedule))
    pipe.P, pipe.M, pipe.V = P, M, V
    return pipe


def op_lists(schedule, P, M, V=2):
    """Every pipeline rank's op list (V, the chunks per rank, is used by interleaved only)."""
    return [layout(schedule, P, M, V).op_list(r) for r in range(P)]


def num_stages(schedule, P, V=2):
    pipe = layout(schedule, P, 1, V)
    return pipe.num_stages() if isinstance(pipe, MultiStage) else P


def stage_owner(schedule, P, M, stage, mb):
    pipe = layout(schedule, P, M)
    return pipe.owner(stage, mb) if isinstance(pipe, MultiStage) else stage


def stages_of(schedule, P, rank, V=2):
    pipe = layout(schedule, P, 1, V)
    return pipe.stages_of(rank) if isinstance(pipe, MultiStage) else (rank,)


def forward_only(schedule, P, M, rank, V=2):
    return [Op("F", s, i) for s in sorted(stages_of(schedule, P, rank, V)) for i in range(M)
            if stage_owner(schedule, P, M, s, i) == rank]


class RecordedStage:
    """A stand-in for the core's Pipeline on one stage, without processes or tensors: the core's loops run
    on it record every exchange and op, a message a placeholder resolved by core_traffic (tests/ checks
    the traffic against a model of NCCL's rules; the docstring's picture is drawn from it)."""

    def __init__(self, P, M, stage):
        self.P, self.M, self.stage, self.loss_sum = P, M, stage, None
        self.up, self.down = (stage - 1 if stage > 0 else None), (stage + 1 if stage < P - 1 else None)
        self.events, self.held, self.peak_held = [], set(), 0

    def start(self, x, y, scale):
        pass

    def compute(self, kind, mb, h):
        self.events.append(("op", kind, mb, h))
        self.held = self.held | {mb} if kind == "F" else self.held - {mb}
        self.peak_held = max(self.peak_held, len(self.held))
        peer = self.down if kind == "F" else self.up
        return None if peer is None else ("a" if kind == "F" else "g", mb)

    def exchange(self, send_to=None, tensor=None, recv_from=None):
        batch = [("send", send_to, tensor)] if send_to is not None else []
        batch += [("recv", recv_from, ("recv", self.stage, len(self.events)))] if recv_from is not None else []
        if batch:
            self.events.append(("batch", batch))
        return batch[-1][2] if recv_from is not None else None


def core_traffic(loop, P, M):
    """The core loop `loop` (naive_step, one_f_one_b, forwards) on P recorded stages -> per stage its
    events, each received placeholder replaced by the message NCCL would deliver (the n-th send a->b
    meets the n-th receive b<-a): ("op", kind, mb, input) and ("batch", [(send | recv, peer, key)]),
    and the micro-batches each stage held at most."""
    stages = [RecordedStage(P, M, s) for s in range(P)]
    for st in stages:
        loop(st, None, None, 1.0)
    sent = collections.defaultdict(list)
    for s, st in enumerate(stages):
        for ev in st.events:
            for kind, peer, key in ev[1] if ev[0] == "batch" else ():
                if kind == "send":
                    sent[(s, peer)].append(key)
    got, taken = {}, collections.Counter()
    for s, st in enumerate(stages):
        for ev in st.events:
            for kind, peer, key in ev[1] if ev[0] == "batch" else ():
                if kind == "recv":
                    n, taken[(peer, s)] = taken[(peer, s)], taken[(peer, s)] + 1
                    got[key] = sent[(peer, s)][n] if n < len(sent[(peer, s)]) else None
    fix = lambda k: got.get(k, k) if isinstance(k, tuple) and k[:1] == ("recv",) else k  # noqa: E731
    events = [[("op", ev[1], ev[2], fix(ev[3])) if ev[0] == "op" else
               ("batch", [(kind, peer, fix(key)) for kind, peer, key in ev[1]]) for ev in st.events]
              for st in stages]
    return events, [st.peak_held for st in stages]


def loop_picture(P=2, M=4, loop=one_f_one_b):
    """The docstring's picture of the core loop: per rank its ops and [batches] in order."""
    events, _ = core_traffic(loop, P, M)
    rows = []
    for s, evs in enumerate(events):
        words = [f"{ev[1]}{ev[2]}" if ev[0] == "op" else
                 "[" + " ".join((">" if kind == "send" else "<") + f"{key[0]}{key[1]}" for kind, _, key in ev[1]) + "]"
                 for ev in evs]
        rows.append(f"  rank {s}  " + " ".join(words))
    return rows


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
    orders = op_lists(name, P, M, V)  # naive: GPipe's order
    costs = f"F={cost['F']:.2f} B={cost['B']:.2f} W={cost['W']:.2f} ms"
    if name in ("gpipe", "1f1b", "naive"):
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
        st["simulated_paired"] = bubble_fraction(simulate_paired(orders, per_stage))
    return st


def report(pipe, args):
    """One more batch timed (timed_spans), then on rank 0 the schedule's closed form and a simulation of its
    op lists with the measured op times (one line), OUT/schedule.json and OUT/schedule.png."""
    g = torch.Generator().manual_seed(args.seed)  # any tokens time the same
    x, y = (torch.randint(pipe.cfg.vocab_size, (args.batch_size, args.seq_len), generator=g) for _ in range(2))
    gathered = timed_spans(pipe, x, y)
    if not pipe.ctx.master:
        return None
    P, M, name = pipe.P, pipe.M, "naive" if args.naive else args.schedule
    ranks = [[(Op(*op), a, b) for op, a, b in g["spans"]] for g in gathered[:P]]  # replica 0
    st = bubble_stats(name, P, M, ranks, getattr(pipe, "V", 2))
    st.update(schedule=name, P=P, M=M, peak_held=[g["peak_held"] for g in gathered[:P]],
              spans=[g["spans"] for g in gathered])
    paired = (f" | as DeepSeek runs it (F&B pairs as one unit) {st['simulated_paired']:.3f}"
              if "simulated_paired" in st else "")
    print0(f"{name}: closed form {st['closed']} | simulated with the measured op times {st['simulated']:.3f}"
           + paired)
    with open(os.path.join(args.out, "schedule.json"), "w") as f:
        json.dump(st, f)
    way_back = lambda op: op.stage >= P or (name == "dualpipe" and op.mb >= M // 2)  # noqa: E731
    draw_schedule(ranks, os.path.join(args.out, "schedule.png"), f"{name}: P={P}, M={M}, "
                  f"measured bubble {st['bubble']:.1%}", way_back)
    return st


def ascii_timeline(schedule, P, M, V=2):
    """The timelines beside DualPipe: simulate() at F=1, B=2, I=W=1, one character per time unit, the op's
    kind (lower case for stages on the way back up DualPipeV's V), '.' idle."""
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
    ax.set_xlabel("ms since the step started (numbers: micro-batch; white: the bubble, a rank idle)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=names[k]) for k, c in colours.items()], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_cli_args(args, world):
    """Returns P, the pipeline depth; a bad flag is one line naming it (gpt2.fail), before any collective.
    The core's check_args (the batch and the blocks) runs in train too."""
    gpt2.check_args(args)
    for flag in ("--micro-batches", "--dp"):
        gpt2.check_range(getattr(args, flag[2:].replace("-", "_")), flag, 1, todo="give a positive integer")
    if world % args.dp:
        gpt2.fail(f"--dp {args.dp} does not divide the {world} ranks", "--dp", "give a divisor of the world size")
    P, M, L = world // args.dp, args.micro_batches, gpt2.model_config(args).n_layer
    V = args.virtual_stages
    if V < 1:
        gpt2.fail(f"--virtual-stages {V} is not a positive number of model chunks", "--virtual-stages", "give V >= 1")
    if args.naive and args.schedule != "1f1b":
        gpt2.fail(f"--naive is its own schedule, not --schedule {args.schedule}", "--naive", "drop one of the two")
    S = num_stages(args.schedule, P, V)
    check_args(args, P)
    if L % S and args.schedule == "interleaved" and L % P == 0:  # the layers split over P ranks, not into V chunks
        fits = [v for v in range(1, L // P + 1) if L // P % v == 0]
        gpt2.fail(f"{L} layers do not split into V x P = {V} x {P} = {S} stages (interleaved)", "--virtual-stages",
                  f"give a V that divides {L // P} layers per rank: one of {fits}")
    if L % S:  # beyond the core's L % P
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


def make_cli_parser():
    """The core's parser and the flags of the schedules beyond it."""
    p = make_parser()
    p.description = ("Train GPT-2 with pipeline parallelism (1F1B; --naive; beyond the core: GPipe, ZB-H1, "
                     "interleaved 1F1B, DualPipe, DualPipeV).")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES, help="pipeline schedule")
    p.add_argument("--dp", type=int, default=1, help="data-parallel pipeline replicas D (world = P * D)")
    p.add_argument("--virtual-stages", type=int, default=2, help="interleaved: model chunks V per rank")
    return p


def cli(argv=None):
    """The full CLI: the core's flags, --schedule and --dp, checked in one line each, the schedule's class
    into the core's loop, then the schedule's closed form and picture."""
    args = make_cli_parser().parse_args(argv)
    P = check_cli_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    pipe = train(args, P, pipeline_class(args.schedule, args.dp))
    report(pipe, args)
    print0(f"wrote {args.out}/metrics.jsonl, loss.png, schedule.json and schedule.png")
    return pipe


if __name__ == "__main__":
    gpt2.run_main(cli)
