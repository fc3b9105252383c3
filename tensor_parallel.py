"""
tensor_parallel.py - Megatron-LM tensor parallelism for GPT-2 from torch.distributed primitives:
column- and row-parallel matmuls, a vocab-parallel embedding and loss, a grid of TP x DP ranks.

Cut a block's first matmul of each pair by output features (heads, MLP units), the second by input
features: each rank then holds a partial sum of the block's output, one all-reduce (g) finishes it;
in backward the same happens to the input's gradient (f). The tied embedding / head is cut along
the vocabulary. rank = dp_rank * t + tp_rank.

    one block on TP rank r of t (x: (B, T, E), whole on every rank of the TP group):
      h = f(ln_1(x))                    f: forward identity | backward all-reduce of dh over TP
      y = attention(h @ [Wq Wk Wv]_r^T)  ColumnParallelLinear: rank r's H/t heads, nothing moves
      x = x + g(y @ Wo_r^T) + bo        RowParallelLinear: g's forward all-reduce, then the bias
      x = x + g(gelu(f(ln_2(x)) @ Wfc_r^T) @ Wpr_r^T) + bpr    the MLP: rank r's 4E/t units
    vocab: rank r holds wte rows r*V/t ..; embedding = g(my rows, zeros elsewhere); the (B, T, V/t)
      logits give the loss from an all-reduced row max (MAX), then [sum of exp, target logit] (SUM)

Who sums what (t TP ranks hold one model; d DP ranks hold the same shard for other rows):
    what                                  | over | how               | where
    a column matmul's input gradient dX   | TP   | sum (f backward)  | CopyToTP.backward
    a row matmul's partial outputs        | TP   | sum (g forward)   | ReduceFromTP.forward
    row-parallel biases bo, bpr           | -    | added ONCE, after g | RowParallelLinear.forward
    embedding rows (zeros off the shard)  | TP   | sum (g)           | vocab_parallel_embedding
    the loss's row max, [sum exp, target] | TP   | max, sum          | VocabParallelCrossEntropy
    every gradient                        | DP   | mean (sum / d)    | TensorParallelGPT.sync_grads
    norm^2 of sharded grads               | TP   | sum of squares    | grad_norm (logged, clipped)
    norm^2 of replicated grads (LN, wpe,  | TP   | counted once: /t  | grad_norm (after the DP mean)
        row biases: equal on TP ranks)
    the printed loss                      | DP   | mean              | train
Below the banners: sequence parallelism, --overlap-comm, the gathered model.pt, the full CLI.

Read first: CopyToTP, ReduceFromTP (f, g), RowParallelLinear, VocabParallelCrossEntropy, train.
Run (a minute on 2 CPU cores; the closing lines are the payoff, each figure beside its closed form):
    torchrun --nproc_per_node=2 tensor_parallel.py --data data/shakespeare_char --steps 20 \\
        --batch-size 8 --seq-len 64 --out out/tp
    communication per step per rank: 4.725 .. 4.725 MB measured over 20 steps, 4.725 MB closed ..
    activations per rank, one micro-batch: 10.54 MB embedding + blocks (fp32 closed form 10.54;
        16.85 at --tp 1), 0.66 MB head + loss (closed form 0.66)
Shoeybi et al. 2019 (Megatron-LM) 3, fig. 3-4; Korthikanti et al. 2022 4.1, 4.2.2 (SP).
"""
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gpt2


def idle_timeline():
    """A timeline that never records: the grid's until train gives it the run's."""
    return gpt2.Timeline(gpt2.Context(0, 1, 0, torch.device("cpu"), torch.float32, True))


@dataclass
class Grid:
    """Where this rank sits; f and g; the bytes it sent (meter) and the step drawn (timeline)."""
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: object
    dp_group: object
    meter: gpt2.CommMeter = field(default_factory=gpt2.CommMeter)
    timeline: gpt2.Timeline = field(default_factory=idle_timeline)

    def f(self, x):  # into a column-parallel matmul: forward identity, backward all-reduce
        return CopyToTP.apply(x, self)

    @torch.compiler.disable  # a collective: --compile compiles the matmuls around it
    def g(self, x):  # out of a row-parallel matmul: forward all-reduce, backward identity
        return ReduceFromTP.apply(x, self)


def make_grid(world, rank, tp, Grid=Grid):
    """rank = dp_rank * tp + tp_rank. Every rank must create every group, in the same order."""
    dp, tp_group, dp_group = world // tp, None, None
    if world > 1:  # TP groups: tp consecutive ranks (one node); DP groups: ranks tp apart
        tp_group = [dist.new_group([d * tp + i for i in range(tp)]) for d in range(dp)][rank // tp]
        dp_group = [dist.new_group([d * tp + i for d in range(dp)]) for i in range(tp)][rank % tp]
    return Grid(tp, dp, rank % tp, rank // tp, tp_group, dp_group)


def all_reduce(x, grid, group="tp", op=dist.ReduceOp.SUM):
    """x reduced in place over this rank's TP (or DP) group; the meter counts what a ring sends."""
    n, g = (grid.tp, grid.tp_group) if group == "tp" else (grid.dp, grid.dp_group)
    if n > 1:
        grid.meter.all_reduce(x.numel() * x.element_size(), n)  # 2(n-1)/n of x
        with grid.timeline.compute(f"all-reduce {group}", "all_reduce"):
            dist.all_reduce(x, op=op, group=g)
    return x


# The conjugate operators (Megatron-LM figure 3): f before a column matmul, g after a row matmul.
class CopyToTP(torch.autograd.Function):
    """f: every rank needs the whole input; its gradient is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, grid):
        ctx.grid = grid
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.grid), None


class ReduceFromTP(torch.autograd.Function):
    """g: sum the partial outputs; each rank's partial gets the whole (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, grid):
        ctx.mark_dirty(x)  # summed in place: x is a fresh matmul output nobody else reads
        return all_reduce(x, grid)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def enter_tp(x, grid):
    """f, into column matmuls; autocast casts their input to bf16: cast first, f moves it."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return grid.f(x)


# c_attn's weight (3E, E) packs q, k, v; each is cut on its own: rank r keeps its heads of all three
#     full    [ q_0 q_1 | k_0 k_1 | v_0 v_1 ]   (t = 2; q_r: the rows of heads r*H/t .. (r+1)*H/t-1)
#     rank 0  [ q_0 | k_0 | v_0 ]     rank 1  [ q_1 | k_1 | v_1 ]     gpt2's chunk(3) splits them
def shard(w, grid, dim=0, pieces=1):
    """This rank's 1/t of dimension `dim`, each of `pieces` packed blocks cut on its own (above)."""
    w = w.movedim(dim, 0)
    blocks = w.reshape(pieces, w.size(0) // pieces, *w.shape[1:])  # (pieces, rows per piece, ...)
    n = blocks.size(1) // grid.tp
    mine = blocks[:, grid.tp_rank * n:(grid.tp_rank + 1) * n]  # (pieces, n, ...)
    return mine.reshape(-1, *w.shape[1:]).movedim(0, dim).clone()


def split_param(t, grid, dim=0, pieces=1):
    """A parameter holding this rank's shard; tp_split remembers how to put the full tensor back."""
    if t is None:  # a Linear without bias
        return None
    p = nn.Parameter(shard(t.detach(), grid, dim, pieces))
    p.tp_split = (dim, pieces)
    return p


class ColumnParallelLinear(nn.Module):
    """nn.Linear cut by output features: Y_r = X W_r^T + b_r, X from enter_tp (Megatron's A_r)."""

    def __init__(self, linear: nn.Linear, grid, pieces=1):
        super().__init__()
        self.grid = grid
        self.weight = split_param(linear.weight, grid, 0, pieces)  # (out/t, in)
        self.bias = split_param(linear.bias, grid, 0, pieces)  # (out/t,) or None

    def forward(self, x):  # (B, T, in) -> (B, T, out/t)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """nn.Linear cut by input features: Y = g(X_r W_r^T) + b (Megatron's B_r). X_r (B, T, in/t) is a
    column matmul's output, after any element-wise function; the bias is whole on every rank."""

    def __init__(self, linear: nn.Linear, grid):
        super().__init__()
        self.grid = grid
        self.weight = split_param(linear.weight, grid, dim=1)  # (out, in/t)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):  # (B, T, in/t) -> (B, T, out)
        y = self.grid.g(F.linear(x, self.weight))  # this rank's partial sum, then the sum of all
        return y if self.bias is None else y + self.bias  # once, after g


class ParallelBlock(nn.Module):
    """gpt2.Block with its four matmuls cut; gpt2's attention and MLP run on the slices (H/t heads,
    4E/t units): f in front of each column matmul, g inside each row matmul."""

    def __init__(self, block: gpt2.Block, grid: Grid):
        super().__init__()
        self.grid = grid
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp
        self.attn.c_attn = ColumnParallelLinear(self.attn.c_attn, grid, pieces=3)
        self.attn.c_proj = RowParallelLinear(self.attn.c_proj, grid)
        self.mlp.c_fc = ColumnParallelLinear(self.mlp.c_fc, grid)
        self.mlp.c_proj = RowParallelLinear(self.mlp.c_proj, grid)

    def forward(self, x):  # x (B, T, E)
        x = x + self.attn(enter_tp(self.ln_1(x), self.grid))  # c_attn (B, T, 3E/t), H/t heads
        return x + self.mlp(enter_tp(self.ln_2(x), self.grid))  # c_fc (B, T, 4E/t), gelu


def vocab_parallel_embedding(idx, weight, grid):
    """Rank r looks up the ids it owns, zeros for the others: g's sum holds every row once."""
    lo, hi = grid.tp_rank * weight.size(0), (grid.tp_rank + 1) * weight.size(0)  # weight (V/t, E)
    foreign = (idx < lo) | (idx >= hi)  # (B, T)
    x = F.embedding((idx - lo).masked_fill(foreign, 0), weight)  # (B, T, E)
    return grid.g(x.masked_fill(foreign.unsqueeze(-1), 0.0))


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from (N, V/t) logit shards (columns lo ..): only (N,)-sized sums move."""

    @staticmethod
    def forward(ctx, logits, targets, grid, lo, vocab_size):
        cols = torch.arange(lo, lo + logits.size(1), device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))  # padding, as GPT.logits
        row_max = all_reduce(logits.max(dim=1).values, grid, op=dist.ReduceOp.MAX)  # (N,)
        exp = (logits - row_max.unsqueeze(1)).exp_()  # (N, V/t): shifted, so exp never overflows
        mine = (targets >= lo) & (targets < lo + logits.size(1))  # (N,): the target column is here
        local_t = (targets - lo).masked_fill(~mine, 0)  # (N,)
        target_logit = logits.gather(1, local_t.unsqueeze(1)).squeeze(1)  # (N,)
        target_logit = target_logit.masked_fill(~mine, 0.0)  # the owner's, 0 elsewhere
        stats = all_reduce(torch.stack([exp.sum(dim=1), target_logit]), grid)  # (2, N)
        loss = (stats[0].log() + row_max - stats[1]).mean()
        ctx.save_for_backward(exp.div_(stats[0].unsqueeze(1)), mine, local_t)  # exp: the softmax
        return loss

    @staticmethod
    def backward(ctx, grad):  # softmax - one_hot(target), the one hot on the target's owner only
        softmax, mine, local_t = ctx.saved_tensors
        one_hot = mine.to(softmax.dtype).unsqueeze(1)  # (N, 1): 1 where this rank holds the target
        grad_logits = softmax.scatter_add(1, local_t.unsqueeze(1), -one_hot)  # no mask: no sync
        return grad_logits.mul_(grad / softmax.size(0)), None, None, None, None


class TensorParallelGPT(nn.Module):
    """This rank's shard of gpt2.GPT: wte's (V/t, E) rows, the matmul slices; LayerNorms, row
    biases and wpe replicated."""

    def __init__(self, full: gpt2.GPT, grid: Grid):
        super().__init__()
        self.config, self.grid = full.config, grid
        self.activation_checkpointing = full.activation_checkpointing
        self.wte = split_param(full.wte.weight, grid)  # (V/t, E): the embedding AND the head
        self.wpe, self.ln_f = full.wpe, full.ln_f
        self.h = nn.ModuleList(ParallelBlock(b, grid) for b in full.h)

    def embed(self, idx):  # idx (B, T) -> (B, T, E)
        x = vocab_parallel_embedding(idx, self.wte, self.grid)
        return x + self.wpe(torch.arange(x.size(1), device=idx.device))

    def forward_blocks(self, x):  # (B, T, E); recomputation repeats a block's collectives
        recompute = self.activation_checkpointing and self.training
        for k, block in enumerate(self.h):
            with self.grid.timeline.compute(f"block {k}"):  # its forward, with its two g
                x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return x

    def forward(self, idx, targets):  # the mean loss, the same number on every TP rank
        return self.head_loss(self.forward_blocks(self.embed(idx)), targets)

    def head(self, h):  # the tied head, column-parallel over the vocabulary: -> (B, T, V/t)
        return F.linear(h, self.wte)

    def head_loss(self, x, targets):  # the (B, T, V) logits are never formed
        logits = self.head(enter_tp(self.ln_f(x), self.grid)).float()  # (B, T, V/t)
        lo = self.grid.tp_rank * logits.size(-1)  # rank r's columns lo .. lo + V/t - 1
        return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), self.grid,
                                               lo, self.config.vocab_size)

    def sync_grads(self):
        """f and g made every grad right in the TP group; average over DP in one flat buffer."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if self.grid.dp > 1:
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.grid.dp)
            all_reduce(flat, self.grid, group="dp")
            pieces = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(pieces, grads)])

    def comm_bytes_per_step(self, args, act_bytes):
        """The closed form of what this rank sends in one optimizer step (ring all-reduces, as the
        meter counts). Per micro-step: 4 all-reduces of a (B, T, E) activation per block (f and g,
        forward and backward; activation checkpointing repeats the attention's g: 1 more), the
        embedding's g (fp32), the head's f, the loss's row maxima (N fp32) and sums (2N). Per step:
        the DP mean of this rank's gradients, the squared norm over TP, the loss over DP."""
        t, d, E, L = self.grid.tp, self.grid.dp, self.config.n_embd, self.config.n_layer
        ring = lambda nbytes, n: 2 * (n - 1) / n * nbytes
        N = args.batch_size * args.seq_len
        per_block = (4 + (1 if args.activation_checkpointing else 0)) * ring(N * E * act_bytes, t)
        micro = L * per_block + ring(N * E * 4, t) + ring(N * E * act_bytes, t) + ring(3 * N * 4, t)
        n_local = sum(p.numel() for p in self.parameters())
        return args.grad_accum * micro + ring(n_local * 4, d) + ring(4, t) + ring(4, d)

    def activation_bytes_closed_form(self, B, T, t=None):
        """Bytes one rank keeps for backward in one fp32 micro-step (s = T, b = B, h = E, a = heads,
        V = padded vocabulary), as (embedding + blocks, head + loss). Korthikanti et al. 4.1 count
        per layer, 16-bit, with dropout, sbh(10 + 24/t + 5as/(ht)). Here in fp32 values (x4 bytes):
        no dropout masks, and SDPA keeps q, k, v, its output and a logsumexp of a/t values a token,
        not the scores; each LayerNorm keeps a mean and an rstd per token: per layer
        sbh(4 + 12/t) + sb(4 + a/t). Embedding: the ids (int64) and the foreign-id mask (bool), 9sb
        bytes, + wpe's positions 8s. Head: ln_f's and the head's inputs 2sbh, ln_f's 2sb statistics,
        the softmax sbV/t; the loss's target mask and local ids 9sb bytes."""
        t = t or self.grid.tp
        s, b, h, a, V = T, B, self.config.n_embd, self.config.n_head, self.config.padded_vocab
        layer = 4 * (s * b * h * (4 * t + 12) // t + s * b * (4 * t + a) // t)
        head = 4 * (2 * s * b * h + 2 * s * b + s * b * V // t) + 9 * s * b
        return 9 * s * b + 8 * s + self.config.n_layer * layer, head


def grad_norm(model, grid):
    """The GLOBAL gradient norm: sharded squares add over TP, replicated ones (equal on the TP
    ranks) count once (/t). A tensor: the loop reads it in the same sync as the loss."""
    sq = [p.grad.float().pow(2).sum() / (1 if hasattr(p, "tp_split") else grid.tp)
          for p in model.parameters() if p.grad is not None]
    return all_reduce(torch.stack(sq).sum(), grid).sqrt()


def clip_grad_norm(model, grid, max_norm):
    """grads x min(1, max_norm / (norm + 1e-6)), the global norm; returns it (before clipping)."""
    norm = grad_norm(model, grid)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))  # a tensor: no host sync
    return norm


def train(args, Grid=Grid, Model=TensorParallelGPT):
    """gpt2.py train's loop on this rank's shard, then the DP gradient mean."""
    ctx = gpt2.setup(args)
    grid = make_grid(ctx.world, ctx.rank, args.tp, Grid)
    grid.timeline = timeline = gpt2.Timeline(ctx, record_step=1)  # step 0 warms up
    full = gpt2.build_model(args)
    cfg, n_params = full.config, full.num_params()
    model = Model(full.to(ctx.device), grid)  # cut in place: what is not ours is freed with `full`
    del full
    train_loader, val_loader = gpt2.make_loaders(args, grid.dp_rank, grid.dp, cfg.vocab_size)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
    tokens = args.batch_size * args.seq_len * args.grad_accum * grid.dp
    metrics = gpt2.Metrics(args, ctx, cfg, n_params, tokens)
    profiler = gpt2.Profiler(args, ctx)
    gpt2.print0(f"model {args.model}: {n_params / 1e6:.2f}M non-embedding params | "
                f"TP={grid.tp} x DP={grid.dp}")
    for b in model.h if args.compile else []:  # the local math: g (in c_proj) is left out
        b.attn.compile()
        b.mlp.compile()

    def loss_fn(x, y):
        with ctx.autocast():
            return model(x, y)

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        timeline.start_step(step)
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)
        model.sync_grads()
        if args.grad_clip > 0:
            norm = clip_grad_norm(model, grid, args.grad_clip)  # the norm before clipping
        else:
            norm = grad_norm(model, grid)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_dp = all_reduce(loss_sum, grid, group="dp") / grid.dp  # TP ranks hold the same loss
        loss, norm = torch.stack([loss_dp, norm]).tolist()  # the step's one host sync
        timeline.stop()
        gpt2.check_finite(loss, step)
        metrics.log_step(step, loss, lr, comm_mb=grid.meter.take_mb(), grad_norm=norm)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()  # evaluate's mean over all ranks: TP ranks hold equal losses, the DP mean
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
            grid.meter.take_mb()
    gpt2.check_finite_weights(list(model.parameters()), args.steps - 1)  # the last update too
    timeline.save(os.path.join(args.out, "timeline.png"), title="one TP step: compute (upper "
                  "bars), all-reduces over TP and DP (lower bars); forward: each block's two g")
    metrics.plot()
    gpt2.print0(f"saved {args.out}/loss.png and timeline.png")
    return model, metrics


def saved_activation_bytes(model, idx, targets):
    """Bytes autograd keeps for one micro-batch's backward, as (embedding + blocks, head + loss),
    and the loss (a caller may go on to backward)."""
    with gpt2.SavedBytes(exclude=model.parameters()) as blocks:
        x = model.forward_blocks(model.embed(idx))
    with gpt2.SavedBytes(exclude=model.parameters()) as head:
        loss = model.head_loss(x, targets)
    return blocks.bytes, head.bytes, loss


def report(args, model, metrics):
    """The payoff, printed and recorded in metrics.jsonl: the bytes each step sent against their
    closed form, the activations one micro-batch keeps on this rank against theirs and --tp 1's."""
    ctx, cfg, B, T = metrics.ctx, model.config, args.batch_size, args.seq_len
    sent = [r["comm_mb"] for r in metrics.records if "comm_mb" in r]
    closed = model.comm_bytes_per_step(args, torch.finfo(ctx.dtype).bits // 8) / 1e6
    n_local = sum(p.numel() for p in model.parameters())
    probe = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    probe = probe.to(ctx.device)
    model.eval()  # no activation checkpointing: every tensor the closed form counts
    with ctx.autocast():
        blocks, head, _ = saved_activation_bytes(model, probe, probe)
    model.train()
    model.grid.meter.take_mb()  # the probe's collectives are not a step's
    cb, ch = (b / 1e6 for b in model.activation_bytes_closed_form(B, T))  # fp32
    cb1 = model.activation_bytes_closed_form(B, T, 1)[0] / 1e6
    gpt2.print0(f"communication per step per rank: {min(sent):.3f} .. {max(sent):.3f} MB measured "
                f"over {len(sent)} steps, {closed:.3f} MB closed form | "
                f"{n_local / 1e6:.2f}M params on this rank")
    gpt2.print0(f"activations per rank, one micro-batch: {blocks / 1e6:.2f} MB embedding + "
                f"blocks (fp32 closed form {cb:.2f}; {cb1:.2f} at --tp 1), "
                f"{head / 1e6:.2f} MB head + loss (closed form {ch:.2f})")
    metrics.log_summary({"comm_mb_per_step": max(sent), "comm_mb_closed_form": closed,
                         "params_per_rank": n_local, "activation_mb_blocks": blocks / 1e6,
                         "activation_mb_blocks_closed_form": cb, "activation_mb_blocks_tp1": cb1,
                         "activation_mb_head": head / 1e6, "activation_mb_head_closed_form": ch})


def make_parser():
    p = gpt2.make_parser("Megatron tensor parallelism (x data parallelism) for GPT-2.")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks per model (default: all); "
                                          "DP = world / tp")
    return p


def main(argv=None):
    args = make_parser().parse_args(argv)
    args.tp = args.tp or int(os.environ.get("WORLD_SIZE", 1))  # the appendix's cli checks the sizes
    model, metrics = train(args)
    report(args, model, metrics)


# ---- Beyond the core ----


# Each extension below is a subclass (Grid, ColumnParallelLinear, TensorParallelGPT) that the appendix's cli
# picks with plain `if`s; the core knows none of them.


def vocab_parallel_cross_entropy(logits, targets, grid, vocab_size=None):
    """Mean loss from this rank's (..., V/t) slice (columns r*V/t ..) of any LM head's logits; columns at or
    above vocab_size (padding) are excluded."""
    n = logits.size(-1)
    return VocabParallelCrossEntropy.apply(logits.float().reshape(-1, n), targets.reshape(-1), grid,
                                           grid.tp_rank * n, vocab_size or grid.tp * n)


def wrap_columns(blocks, Column):
    """Each ParallelBlock's column matmuls (c_attn, c_fc) as Column, an explicit wrapper over the same parameters."""
    for b in blocks:
        b.attn.c_attn = Column(b.attn.c_attn)
        b.mlp.c_fc = Column(b.mlp.c_fc)


@torch.compiler.disable  # a collective in a custom backward: keep it out of the compiled graph
def column_function(fn, x, weight, bias, grid):
    return fn.apply(x, weight, bias, grid)


def linear_grads(grad, x, weight, has_bias):
    """dW = dY^T X and db = sum dY, as autograd's linear computes them (X already in dY's dtype: autocast
    does not reach a custom backward, so the Functions cast to the forward's dtype themselves)."""
    grad_2d = grad.flatten(0, -2)  # (B*T, out)
    grad_w = (grad_2d.t() @ x.flatten(0, -2)).to(weight.dtype)  # (out, in)
    return grad_w, grad_2d.float().sum(0).to(weight.dtype) if has_bias else None


# Sequence parallelism (--sequence-parallel; Korthikanti et al. 2022 section 4.2.2): every all-reduce becomes a
# reduce-scatter + all-gather along T (the same bytes), so the LayerNorm/residual stretch between g and f is
# cut along the sequence and its activations shrink by t too.


def gather_sequence(x, grid, async_op=False):
    """(B, T/t, ...) -> (B, T, ...): rank r's tokens land at positions r*T/t ... The gather stacks along
    a new leading dim; Megatron keeps activations (T, B, E) so that this is copy-free, gpt2 is (B, T, E).
    With async_op it returns a function that waits for the gather and then returns the (B, T, ...) tensor."""
    x = x.contiguous()
    out = torch.empty((grid.tp * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    grid.meter.all_gather(grid.tp * x.numel() * x.element_size(), grid.tp)
    work = None
    if async_op:
        work = gpt2.all_gather_single(out, x, group=grid.tp_group, async_op=True)  # (t*B, T/t, ...)
        grid.timeline.comm("all-gather tp", work, "all_gather")
    else:
        with grid.timeline.compute("all-gather tp", "all_gather"):
            gpt2.all_gather_single(out, x, group=grid.tp_group)

    def arranged():
        if work is not None:
            work.wait()
        return out.view(grid.tp, *x.shape).transpose(0, 1).reshape(x.size(0), grid.tp * x.size(1), *x.shape[2:])
    return arranged if async_op else arranged()


def reduce_scatter_sequence(x, grid):
    """(B, T, ...) partial sums -> (B, T/t, ...) full sums of this rank's tokens."""
    B, T = x.shape[:2]
    stacked = x.reshape(B, grid.tp, T // grid.tp, *x.shape[2:]).transpose(0, 1).contiguous()  # (t, B, T/t, ...)
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    grid.meter.reduce_scatter(x.numel() * x.element_size(), grid.tp)
    with grid.timeline.compute("reduce-scatter tp", "reduce_scatter"):  # gloo: a concatenated input
        gpt2.reduce_scatter_single(out, stacked.view(-1, *stacked.shape[2:]), group=grid.tp_group)
    return out


class GatherSequence(torch.autograd.Function):
    """f with sequence parallelism: all-gather the tokens; backward reduce-scatters the gradient."""
    @staticmethod
    def forward(ctx, x, grid):
        ctx.grid = grid
        return gather_sequence(x, grid)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.grid), None


class ReduceScatterSequence(torch.autograd.Function):
    """g with sequence parallelism: sum the partials and keep this rank's tokens only."""
    @staticmethod
    def forward(ctx, x, grid):
        ctx.grid = grid
        return reduce_scatter_sequence(x, grid)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.grid), None


class LinearRegatherInput(torch.autograd.Function):
    """Y = X W^T + b for an all-gathered X (B, T, in) that is NOT kept for backward: only this rank's
    tokens (B, T/t, in) are saved, and backward all-gathers them again for the weight gradient
    (Korthikanti et al. section 4.2.2). With overlap_regather (--overlap-comm) that re-gather runs while
    dX = dY W is computed (it needs no X), as Megatron-LM does; without, it comes first. dX leaves whole
    (B, T, in): f's GatherSequence reduce-scatters it (Megatron also overlaps that one with dW; here it
    cannot, as gpt2's attention must see the gathered T, so the gather stays outside this Function)."""
    @staticmethod
    def forward(ctx, x, weight, bias, grid):
        n = x.size(1) // grid.tp
        ctx.grid, ctx.has_bias = grid, bias is not None
        ctx.save_for_backward(x[:, grid.tp_rank * n:(grid.tp_rank + 1) * n].clone(), weight)  # (B, T/t, in)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        mine, weight = ctx.saved_tensors  # (B, T/t, in), (out, in)
        if ctx.grid.overlap_regather:
            regathered = gather_sequence(mine, ctx.grid, async_op=True)  # in flight while dX computes
            grad_x = grad @ weight.to(grad.dtype)  # (B, T, in)
            x = regathered()  # (B, T, in)
        else:
            x = gather_sequence(mine, ctx.grid)
            grad_x = grad @ weight.to(grad.dtype)
        grad_w, grad_b = linear_grads(grad, x.to(grad.dtype), weight, ctx.has_bias)
        return grad_x, grad_w, grad_b, None


@dataclass
class SequenceParallelGrid(Grid):
    """f all-gathers T, g reduce-scatters it."""
    overlap_regather = False  # a class attribute: OverlapSequenceParallelGrid re-gathers while dX computes

    def f(self, x):
        return GatherSequence.apply(x, self)

    @torch.compiler.disable  # a collective inside the row matmul: --compile stops around it
    def g(self, x):
        return ReduceScatterSequence.apply(x, self)


@dataclass
class OverlapSequenceParallelGrid(SequenceParallelGrid):
    """--sequence-parallel --overlap-comm: the column matmuls' input re-gather runs under dX = dY W."""
    overlap_regather = True


class RegatherColumnLinear(ColumnParallelLinear):
    """SP's column matmul: keeps only this rank's T/t tokens of its gathered input for backward."""
    Function = LinearRegatherInput

    def __init__(self, column):
        nn.Module.__init__(self)
        self.grid, self.weight, self.bias = column.grid, column.weight, column.bias

    def forward(self, x):
        if self.grid.tp > 1 and torch.is_grad_enabled():
            return column_function(self.Function, x, self.weight, self.bias, self.grid)
        return F.linear(x, self.weight, self.bias)


class SequenceParallelGPT(TensorParallelGPT):
    """Activations between g and f hold T/t tokens: positions offset, column matmuls keep T/t tokens, and the
    replicated parameters (LayerNorms, row-parallel biases, wpe) saw T/t tokens on each rank."""
    def __init__(self, full, grid):
        super().__init__(full, grid)
        wrap_columns(self.h, RegatherColumnLinear)

    def embed(self, idx):  # idx (B, T) -> (B, T/t, E): tokens tp_rank*T/t .. of the sequence
        x = vocab_parallel_embedding(idx, self.wte, self.grid)
        T = x.size(1)
        return x + self.wpe(torch.arange(self.grid.tp_rank * T, (self.grid.tp_rank + 1) * T, device=idx.device))

    def head(self, h):  # (B, T/t, E) gathered by f -> (B, T, V/t), only this rank's tokens kept for backward
        if self.grid.tp > 1 and torch.is_grad_enabled():
            return column_function(LinearRegatherInput, h, self.wte, None, self.grid)
        return F.linear(h, self.wte)

    def sync_grads(self):  # section 4.2.2: add the T/t-token partial grads of the replicated parameters over TP
        grads = [p.grad for p in self.parameters() if p.grad is not None and not hasattr(p, "tp_split")]
        if self.grid.tp > 1 and grads:
            flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.grid)
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])
        super().sync_grads()

    def comm_bytes_per_step(self, args, act_bytes):
        """The core's count with SP: each all-reduce becomes an all-gather plus a reduce-scatter (the same
        bytes), plus 2 all-gathers per block and 1 for the head in backward to rebuild the column matmuls'
        inputs. Activation checkpointing recomputes a block only up to its last saved tensor (the MLP's
        c_proj input), so the MLP's g is not repeated: 3 half-size ops per block. Per step: the replicated
        grads summed over TP, besides the core's."""
        t, d, E, L = self.grid.tp, self.grid.dp, self.config.n_embd, self.config.n_layer
        ring = lambda nbytes, n: 2 * (n - 1) / n * nbytes
        N = args.batch_size * args.seq_len
        act = ring(N * E * act_bytes, t)
        per_block = (5 + (1.5 if args.activation_checkpointing else 0.0)) * act  # + the re-gathers
        micro = L * per_block + ring(N * E * 4, t) + 1.5 * act + ring(3 * N * 4, t)
        replicated = L * 6 * E + 2 * E + self.config.block_size * E  # LayerNorms, row biases, wpe
        n_local = sum(p.numel() for p in self.parameters())
        return (args.grad_accum * micro + ring(replicated * 4, t) + ring(n_local * 4, d) + ring(4, t)
                + ring(4, d))

    def activation_bytes_closed_form(self, B, T, t=None):
        """The core's count with SP (Korthikanti et al. 4.1: sbh/t(34 + 5as/h) in 16-bit with dropout):
        every value is cut along the sequence, per layer sbh(16/t) + sb(4 + a)/t in fp32 values; wpe's
        positions 8s/t; the head's inputs and ln_f's statistics 2sbh/t and 2sb/t."""
        t = t or self.grid.tp
        s, b, h, a, V = T, B, self.config.n_embd, self.config.n_head, self.config.padded_vocab
        layer = 4 * (s * b * h * 16 // t + s * b * (4 + a) // t)
        head = 4 * (2 * s * b * h // t + 2 * s * b // t + s * b * V // t) + 9 * s * b
        return 9 * s * b + 8 * s // t + self.config.n_layer * layer, head


# --overlap-comm (Megatron-LM's async tensor-parallel all-reduce, core/tensor_parallel/layers.py): f's backward
# all-reduce of dX is issued before the dW matmul so the two may overlap; the forward all-reduces stay exposed.
# On CUDA the order holds only with CUDA_DEVICE_MAX_CONNECTIONS=1 (cli sets it); 2 CPU cores: 0.98-1.00x (bench).


class LinearOverlapAllReduce(torch.autograd.Function):
    """Y = X W^T + b for a replicated X, with f's backward all-reduce of dX moved in here so it runs
    while the weight gradient is computed (Megatron-LM's async tensor-parallel all-reduce):
        off (F.linear, then CopyToTP):  dX = dY W ; dW = dY^T X, db ; all-reduce dX          (in a row)
        on  (this Function):            dX = dY W ; all-reduce dX ......... wait ; return
                                                    dW = dY^T X, db
    The same products in a different order: the gradients are bit-identical to off (the test checks it,
    fp32 on CPU)."""
    @staticmethod
    def forward(ctx, x, weight, bias, grid):
        ctx.grid, ctx.has_bias = grid, bias is not None
        ctx.save_for_backward(x, weight)  # x (B, T, in) as F.linear would keep it
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grid = ctx.grid
        grad_x = grad @ weight.to(grad.dtype)  # (B, T, in): this rank's partial sum of dX
        grid.meter.all_reduce(grad_x.numel() * grad_x.element_size(), grid.tp)
        work = dist.all_reduce(grad_x, group=grid.tp_group, async_op=True)
        grid.timeline.comm("all-reduce tp", work)  # issue now -> completion
        grad_w, grad_b = linear_grads(grad, x.to(grad.dtype), weight, ctx.has_bias)
        work.wait()
        return grad_x, grad_w, grad_b, None


@dataclass
class OverlapCommGrid(Grid):
    """f does nothing: the column matmul (LinearOverlapAllReduce) all-reduces dX itself, under dW."""
    def f(self, x):
        return x


class OverlapColumnLinear(RegatherColumnLinear):
    Function = LinearOverlapAllReduce


class OverlapCommGPT(TensorParallelGPT):
    """Every column matmul, the head included, all-reduces its dX under its dW."""
    def __init__(self, full, grid):
        super().__init__(full, grid)
        wrap_columns(self.h, OverlapColumnLinear)

    def head(self, h):
        if self.grid.tp > 1 and torch.is_grad_enabled():
            return column_function(LinearOverlapAllReduce, h, self.wte, None, self.grid)
        return F.linear(h, self.wte)


# ---- Appendix ----
# Argument checks, the gathered model.pt, the zoomed timeline, the command line.


def full_state_dict(model):
    """gpt2.GPT's state dict, each shard all-gathered over the TP group (so `gpt2.py sample` can load it)."""
    sd, grid = {}, model.grid
    for name, p in model.named_parameters():
        if hasattr(p, "tp_split"):  # undo shard: gather (t * rows, ...) and put each piece's rows in place
            dim, pieces = p.tp_split
            w = p.detach().movedim(dim, 0).contiguous()
            out = torch.empty((grid.tp * w.size(0),) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
            gpt2.all_gather_single(out, w, group=grid.tp_group) if grid.tp > 1 else out.copy_(w)
            out = out.reshape(grid.tp, pieces, w.size(0) // pieces, *w.shape[1:]).transpose(0, 1)  # (pieces, t, ..)
            full = out.reshape(-1, *w.shape[1:]).movedim(0, dim)
        else:
            full = p.detach()
        sd[name if "." in name else name + ".weight"] = full.cpu()  # our wte is a bare Parameter
    sd["lm_head.weight"] = sd["wte.weight"]
    return sd


def check_tp(args, cfg, world):
    """Every size problem becomes one line, before the first collective. Returns t (default: every rank)."""
    if args.tp is not None:
        gpt2.check_range(args.tp, "--tp", 1, todo="give a positive integer")
    tp = args.tp or world
    if world % tp:
        gpt2.fail(f"--tp {tp} does not divide the {world} ranks", "--tp", "give a divisor of the world size")
    if cfg.n_head % tp:
        gpt2.fail(f"{cfg.n_head} heads cannot be split over {tp} ranks", "--tp/--n-head",
                  "give a --tp that divides the number of heads (GPT-2 124M: 1, 2, 3, 4, 6 or 12)")
    if cfg.padded_vocab % tp:
        gpt2.fail(f"the padded vocabulary {cfg.padded_vocab} is not divisible by {tp}", "--tp",
                  "give a power-of-two --tp (the vocabulary is padded to a multiple of 128)")
    return tp


def validate(args, cfg, world):
    """check_tp, and sequence parallelism's own size: one line each, before the first collective."""
    gpt2.check_args(args)
    tp = check_tp(args, cfg, world)
    if args.sequence_parallel and args.seq_len % tp:
        gpt2.fail(f"--seq-len {args.seq_len} is not divisible by --tp {tp}", "--sequence-parallel",
                  "give a --seq-len divisible by --tp, or drop --sequence-parallel")
    return tp


def save_zoomed_timeline(args, model):
    """OUT/timeline_forward.png: the recorded step's first forward through the blocks alone (block 0's start
    to the last block's end), where each block's compute and its two g all-reduces (SP: its gathers and
    reduce-scatters) are wide enough to read. Every rank calls it (the picture gathers)."""
    timeline = model.grid.timeline
    blocks = [s for s in timeline.spans if s[0].startswith("block ") and s[3] is not None][:len(model.h)]
    if timeline.t0 is None or not blocks:  # the step was never recorded (--steps 1): on every rank alike
        return
    if timeline.cuda:  # the spans are CUDA events: their times once the GPU has recorded them
        torch.cuda.synchronize()
    ms = (lambda t: timeline.t0.elapsed_time(t)) if timeline.cuda else (lambda t: 1e3 * (t - timeline.t0))
    lo, hi = ms(blocks[0][2]), ms(blocks[-1][3])
    zoom = gpt2.Timeline(timeline.ctx, record_step=timeline.record_step)
    zoom.spans = [s for s in timeline.spans if s[3] is not None and lo <= ms(s[2]) and ms(s[3]) <= hi]
    zoom.t0 = blocks[0][2]
    zoom.save(os.path.join(args.out, "timeline_forward.png"), title="the blocks in forward: each block's "
              "compute (upper bar) and its g all-reduces (lower bar), issue to completion")


def order_comm_before_compute():
    """--overlap-comm issues dX's all-reduce before the dW matmul; on CUDA the two only overlap in that order
    if the GPU takes work from one hardware queue, which Megatron-LM gets from CUDA_DEVICE_MAX_CONNECTIONS=1
    (read when CUDA initializes): set it while it can still take effect, else say so in one line."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and not torch.cuda.is_initialized():
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    elif torch.cuda.is_available():
        gpt2.print0("warning: --overlap-comm without CUDA_DEVICE_MAX_CONNECTIONS=1 (set before CUDA starts): "
                    "the GPU may run the dW matmul before dX's all-reduce, and nothing overlaps")


def warn_tp_across_nodes(tp):
    """TP moves activations 4 times a block, on the critical path: it belongs inside a node (NVLink). torchrun
    sets LOCAL_WORLD_SIZE to the processes of this node; the device is LOCAL_RANK's, the data rows and
    model.pt follow the global rank (gpt2.setup, make_grid)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    if tp > local:
        gpt2.print0(f"warning: --tp {tp} is larger than the {local} processes of one node: TP groups span nodes "
                    f"and their all-reduces leave NVLink; give a --tp that divides {local}")


def cli(argv=None):
    """The core's parser, loop and report, with the extensions the flags pick."""
    p = make_parser()
    p.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/residual activations along the sequence")
    p.add_argument("--overlap-comm", action="store_true",
                   help="issue the column-parallel matmuls' backward dX all-reduce (SP: the input re-gather) before "
                        "the matmul it may overlap with")
    args = p.parse_args(argv)
    if args.overlap_comm:  # before anything starts CUDA (setup, the model)
        order_comm_before_compute()
    args.tp = validate(args, gpt2.model_config(args), int(os.environ.get("WORLD_SIZE", 1)))
    warn_tp_across_nodes(args.tp)
    grid_class, model_class = Grid, TensorParallelGPT
    if args.sequence_parallel:
        grid_class = OverlapSequenceParallelGrid if args.overlap_comm else SequenceParallelGrid
        model_class = SequenceParallelGPT
    elif args.overlap_comm:
        grid_class, model_class = OverlapCommGrid, OverlapCommGPT
    model, metrics = train(args, grid_class, model_class)
    save_zoomed_timeline(args, model)
    sd = full_state_dict(model)  # gathered over TP, every rank takes part
    if metrics.ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), model.config, sd)
    gpt2.print0(f"saved {args.out}/model.pt (gathered, gpt2 layout)")
    report(args, model, metrics)  # the core's closing lines, as the handout prints them
    return model, metrics


if __name__ == "__main__":
    gpt2.run_main(cli)
