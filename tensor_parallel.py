"""
tensor_parallel.py - Megatron-LM tensor parallelism for GPT-2 from torch.distributed primitives: column-
and row-parallel matmuls, a vocab-parallel embedding and cross-entropy, a 2-D grid of TP x DP ranks.

A block's two matmul pairs can be cut so that ranks never exchange weights. Split the first matmul of each
pair by output features (attention heads, MLP hidden units) and the second by input features: each rank
then holds a partial sum of the block's output, and one all-reduce (g) finishes it; in backward the same
happens to the input's gradient (f). The tied embedding / LM head is cut along the vocabulary: no rank
holds a full row of logits; the softmax is assembled from all-reduced maxima and sums.

    grid: rank = dp_rank * TP + tp_rank; a TP group shares a node (NVLink), activations move inside it;
          a DP group holds the same shards for other batch rows: gradients move once a step
    one block on TP rank r of t (x, h: (B, T, E), whole on every rank of the TP group; H heads):
        h = f(ln_1(x))                        f: forward identity, backward all-reduce of dh
        q, k, v = h @ [Wq_r; Wk_r; Wv_r]^T    column-parallel: heads r*H/t .. (r+1)*H/t-1, nothing moves
        x = x + g(attention(q, k, v) @ Wo_r^T) + bo   row-parallel partial sum; g: forward all-reduce
        x = x + g(gelu(f(ln_2(x)) @ Wfc_r^T) @ Wpr_r^T) + bpr    the MLP: 4E/t hidden units on rank r
    vocab (padded to V, tied): rank r holds wte rows r*V/t .. (r+1)*V/t-1; embedding = g(my rows, zeros
        elsewhere); loss from (B, T, V/t) logits: all-reduce row maxima, then [sum of exp, target logit]

Closed forms per rank (ring; N = B*T, L layers, s bytes per activation value, P_r params on the rank):
    sent per micro-step: (4L + 1) all-reduces of N*E*s bytes + the embedding's (fp32) + the loss's 3N fp32,
        an all-reduce of S bytes sending 2(t-1)/t * S; per step the DP all-reduce of the 4*P_r grad bytes
    params + grads + AdamW: 16 P_r bytes, P_r = L(12E^2 + 7E)/t + 6LE + V*E/t + (block_size + 2)E
    activations per block, fp32: 4N*[E(4 + 12/t) + 4 + H/t] bytes (Korthikanti et al. 4.1, see appendix)

Launch: torchrun --nproc_per_node=2 tensor_parallel.py --tp 2 --out out/tp      (CPU, tiny model)
        torchrun --nproc_per_node=4 tensor_parallel.py --tp 2 --batch-size 4 --out out/tp_dp  (TP=2 x DP=2)
References: Shoeybi et al. 2019, Megatron-LM, section 3, figures 3-4 (f, g, heads, vocab-parallel embedding
and loss); Korthikanti et al. 2022, Reducing Activation Recomputation, sections 4.1 and 4.2.2; Narayanan
et al. 2021, Efficient Large-Scale LM Training, section 2.3 (TP x DP); NVIDIA/Megatron-LM tensor_parallel.
Uses from gpt2.py: GPT/Block (cut in place), build_model, make_loaders, the AdamW recipe, setup, Metrics.
"""
import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gpt2

@dataclass
class Grid:
    """Where this rank sits, and how f, g and a column-parallel matmul communicate (subclassed below the banner)."""
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: object
    dp_group: object
    meter: gpt2.CommMeter = field(default_factory=gpt2.CommMeter)  # the appendix counts bytes into it

    def f(self, x):  # into a column-parallel matmul: forward identity, backward all-reduce
        return CopyToTP.apply(x, self)
    def g(self, x):  # out of a row-parallel matmul: forward all-reduce, backward identity
        return ReduceFromTP.apply(x, self)
    def column_linear(self, x, weight, bias):  # the local matmul of a column-parallel layer
        return F.linear(x, weight, bias)
    def positions(self, T, device):  # the token positions this rank's activations hold
        return torch.arange(T, device=device)
    def sum_replicated_grads(self, params):  # every TP rank saw every token: nothing to add
        pass

def make_grid(world, rank, tp):
    """rank = dp_rank * tp + tp_rank. Every rank must create every group, in the same order."""
    dp, tp_group, dp_group = world // tp, None, None
    if world > 1:  # TP groups: tp consecutive ranks; DP groups: ranks tp apart
        tp_group = [dist.new_group([d * tp + i for i in range(tp)]) for d in range(dp)][rank // tp]
        dp_group = [dist.new_group([d * tp + i for d in range(dp)]) for i in range(tp)][rank % tp]
    return Grid(tp, dp, rank % tp, rank // tp, tp_group, dp_group)

def all_reduce(x, grid, group="tp", op=dist.ReduceOp.SUM, async_op=False):
    """In place over the TP (or DP) group; returns x, or with async_op the work handle (None when alone)."""
    n, g = (grid.tp, grid.tp_group) if group == "tp" else (grid.dp, grid.dp_group)
    work = dist.all_reduce(x, op=op, group=g, async_op=async_op) if n > 1 else None
    return work if async_op else x

# The conjugate operators (Megatron-LM figure 3): f before a column-parallel matmul, g after a row-parallel one.
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
    """f, into a column-parallel matmul (its only consumer). Under autocast the matmul would cast to bf16
    anyway: cast first, so that f's communication moves bf16."""
    if grid.tp == 1:
        return x
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return grid.f(x)

def exit_tp(x, grid):
    """g, out of a row-parallel matmul (or the vocab-parallel embedding): sum the partial results."""
    return x if grid.tp == 1 else grid.g(x)

# c_attn's weight (3E, E) packs q, k, v; each is cut on its own, so rank r keeps its heads of all three:
#     full    [ q_0 q_1 | k_0 k_1 | v_0 v_1 ]   (t = 2; q_r: the rows of heads r*H/t .. (r+1)*H/t-1)
#     rank 0  [ q_0 | k_0 | v_0 ]     rank 1  [ q_1 | k_1 | v_1 ]     gpt2's chunk(3) splits them as before
def shard(w, grid, dim=0, pieces=1):
    """This rank's 1/t of dimension `dim`, each of `pieces` packed blocks cut separately (drawing above)."""
    w = w.movedim(dim, 0)
    blocks = w.reshape(pieces, w.size(0) // pieces, *w.shape[1:])
    n = blocks.size(1) // grid.tp
    return blocks[:, grid.tp_rank * n:(grid.tp_rank + 1) * n].reshape(-1, *w.shape[1:]).movedim(0, dim).clone()

def split_param(t, grid, dim=0, pieces=1):
    """A parameter holding this rank's shard; tp_split remembers how to put the full tensor back."""
    if t is None:  # a Linear without bias
        return None
    p = nn.Parameter(shard(t.detach(), grid, dim, pieces))
    p.tp_split = (dim, pieces)
    return p

class ColumnParallelLinear(nn.Module):
    """nn.Linear cut by output features: Y_r = X W_r^T + b_r, X from enter_tp (Megatron-LM's A_r). Any Linear."""
    def __init__(self, linear: nn.Linear, grid, pieces=1):
        super().__init__()
        self.grid = grid
        self.weight = split_param(linear.weight, grid, 0, pieces)  # (out/t, in)
        self.bias = split_param(linear.bias, grid, 0, pieces)  # (out/t,) or None

    def forward(self, x):
        return self.grid.column_linear(x, self.weight, self.bias)

def row_parallel(linear: nn.Linear, grid):
    """Y = sum_r X_r W_r^T + b: rank r multiplies its input features into a partial sum (no bias: it is added
    once, after exit_tp). Returns the local nn.Linear and the replicated bias."""
    out = nn.Linear(linear.in_features // grid.tp, linear.out_features, bias=False, device="meta")
    out.weight = split_param(linear.weight, grid, dim=1)  # (out, in/t)
    return out, None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

class ParallelBlock(nn.Module):
    """gpt2.Block with its four matmuls cut. gpt2's own attention and MLP modules run on the local slices
    (their head count follows the width); the communication happens around them, outside --compile's reach."""
    def __init__(self, block: gpt2.Block, grid: Grid):
        super().__init__()
        self.grid = grid
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp
        self.attn.c_attn = ColumnParallelLinear(self.attn.c_attn, grid, pieces=3)
        self.attn.c_proj, self.attn_bias = row_parallel(self.attn.c_proj, grid)
        self.mlp.c_fc = ColumnParallelLinear(self.mlp.c_fc, grid)
        self.mlp.c_proj, self.mlp_bias = row_parallel(self.mlp.c_proj, grid)

    def forward(self, x):  # x (B, T, E)
        h = enter_tp(self.ln_1(x), self.grid)  # f
        y = self.attn(h)  # c_attn (B, T, 3E/t) -> attention on H/t heads -> c_proj: a partial (B, T, E)
        x = x + (exit_tp(y, self.grid) + self.attn_bias)  # g, then the bias once
        h = enter_tp(self.ln_2(x), self.grid)  # f
        y = self.mlp(h)  # c_fc (B, T, 4E/t) -> gelu -> c_proj: a partial (B, T, E)
        return x + (exit_tp(y, self.grid) + self.mlp_bias)  # g

def vocab_parallel_embedding(idx, weight, grid):
    """Rank r looks up the ids it owns and writes zeros for the others; exit_tp's sum then holds each
    token's row exactly once (Megatron-LM section 3, the input embedding)."""
    lo, hi = grid.tp_rank * weight.size(0), (grid.tp_rank + 1) * weight.size(0)  # weight (V/t, E)
    foreign = (idx < lo) | (idx >= hi)  # (B, T)
    x = F.embedding((idx - lo).masked_fill(foreign, 0), weight)  # (B, T, E)
    return exit_tp(x.masked_fill(foreign.unsqueeze(-1), 0.0), grid)

class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from (N, V/t) logit shards (rank r holds columns lo .. lo + V/t - 1). Only (N,)-sized
    statistics cross ranks: the row max, then [sum of exp, target logit] in one all-reduce."""
    @staticmethod
    def forward(ctx, logits, targets, grid, lo, vocab_size):
        cols = torch.arange(lo, lo + logits.size(1), device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))  # the padding ids, as gpt2.GPT.logits
        row_max = all_reduce(logits.max(dim=1).values, grid, op=dist.ReduceOp.MAX)  # (N,)
        exp = (logits - row_max.unsqueeze(1)).exp_()  # (N, V/t)
        mine = (targets >= lo) & (targets < lo + logits.size(1))  # (N,): the target column is on this rank
        local_t = (targets - lo).masked_fill(~mine, 0)
        target_logit = logits.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        stats = all_reduce(torch.stack([exp.sum(dim=1), target_logit]), grid)  # (2, N)
        loss = (stats[0].log() + row_max - stats[1]).mean()
        ctx.save_for_backward(exp.div_(stats[0].unsqueeze(1)), mine, local_t)  # exp becomes the softmax
        return loss

    @staticmethod
    def backward(ctx, grad):  # local: softmax - one_hot(target), the one hot on the target's owner only
        softmax, mine, local_t = ctx.saved_tensors
        rows = torch.arange(softmax.size(0), device=softmax.device)
        grad_logits = softmax.clone()
        grad_logits[rows[mine], local_t[mine]] -= 1.0
        return grad_logits.mul_(grad / softmax.size(0)), None, None, None, None

def vocab_parallel_cross_entropy(logits, targets, grid, vocab_size=None):
    """Mean loss from this rank's (..., V/t) slice (columns r*V/t ..) of any LM head's logits; columns at or
    above vocab_size (padding) are excluded."""
    n = logits.size(-1)
    return VocabParallelCrossEntropy.apply(logits.float().reshape(-1, n), targets.reshape(-1), grid,
                                           grid.tp_rank * n, vocab_size or grid.tp * n)

class TensorParallelGPT(nn.Module):
    """This rank's shard of gpt2.GPT: one tied (V/t, E) slice of wte, the blocks' matmul slices, and
    replicated LayerNorms, row-parallel biases and wpe."""
    def __init__(self, full: gpt2.GPT, grid: Grid):
        super().__init__()
        self.config, self.grid = full.config, grid
        self.activation_checkpointing = full.activation_checkpointing
        self.wte = split_param(full.wte.weight, grid)  # the embedding AND the head
        self.wpe, self.ln_f = full.wpe, full.ln_f
        self.h = nn.ModuleList(ParallelBlock(b, grid) for b in full.h)

    def embed(self, idx):
        x = vocab_parallel_embedding(idx, self.wte, self.grid)
        return x + self.wpe(self.grid.positions(x.size(1), idx.device))

    def forward_blocks(self, x):
        for block in self.h:  # recomputation (activation checkpointing) repeats the block's collectives
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing and self.training else block(x)
        return x

    def forward(self, idx, targets):  # the mean loss, the same number on every TP rank
        return self.head_loss(self.forward_blocks(self.embed(idx)), targets)

    def head_loss(self, x, targets):  # vocab-parallel head and loss: the (B, T, V) logits are never formed
        logits = self.grid.column_linear(enter_tp(self.ln_f(x), self.grid), self.wte, None)  # (B, T, V/t)
        return vocab_parallel_cross_entropy(logits, targets, self.grid, self.config.vocab_size)

def sync_grads(model, grid):
    """Within a TP group f and g already made every grad right; average them over the DP group."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grid.sum_replicated_grads([p for p in model.parameters() if p.grad is not None and not hasattr(p, "tp_split")])
    if grid.dp > 1:  # one flat buffer, one collective (not one per tensor), then copied back
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]).div_(grid.dp), grid, "dp")
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])

def train(args):
    """gpt2.py train's loop on this rank's shard, then the grid's gradient sync; model.pt in gpt2's layout."""
    own_group = not dist.is_initialized()  # a caller (tests) may have started the process group
    ctx = gpt2.setup(args)
    grid = grid_from_args(args, ctx)  # the appendix: plain TP, or an extension's Grid subclass
    full = gpt2.build_model(args)
    cfg, n_params = full.config, full.num_params()
    validate(args, cfg, ctx.world)  # --init-from brings its own config
    model = TensorParallelGPT(full.to(ctx.device), grid)  # cut in place: what is not ours is freed with `full`
    del full
    train_loader, val_loader = gpt2.make_loaders(args, grid.dp_rank, grid.dp, vocab_size=cfg.vocab_size)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
    metrics = gpt2.Metrics(args, ctx, cfg, n_params, args.batch_size * args.seq_len * args.grad_accum * grid.dp)
    profiler = gpt2.Profiler(args, ctx)
    expected_mb = report_start(args, ctx, model, n_params)  # sizes, activations, closed forms (appendix)
    if args.compile:  # the local math only: the collectives sit between the compiled pieces
        for b in model.h:
            b.attn.compile()
            b.mlp.compile()

    def loss_fn(x, y):
        with ctx.autocast():
            return model(x, y)

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)
        sync_grads(model, grid)
        if args.grad_clip > 0:
            clip_grad_norm(model, grid, args.grad_clip)  # the global norm over shards (appendix)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val = all_reduce(loss_sum, grid, group="dp").item() / grid.dp  # every TP rank holds the same loss
        gpt2.check_finite(loss_val, step)
        report_step(metrics, step, loss_val, lr, grid, expected_mb)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()  # gpt2.evaluate averages over all ranks; TP ranks hold equal losses: the DP mean
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
            grid.meter.take_mb()
    gpt2.check_finite_weights(list(model.parameters()), args.steps - 1)  # every rank: the last update too
    sd = full_state_dict(model)  # gathered over TP (appendix)
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, sd)
    metrics.plot()
    gpt2.print0(f"saved {args.out}/model.pt (gathered, gpt2 layout) and {args.out}/loss.png")
    if own_group and dist.is_initialized():
        dist.destroy_process_group()

# ---- Beyond the core ----
# RowParallelLinear: row_parallel and g packaged as one nn.Module, for models other than GPT (the tests' toy
# model; README, "Using the pieces in your own code").


class RowParallelLinear(nn.Module):
    """nn.Linear cut by input features, g included: the input (..., in/t) is a ColumnParallelLinear's
    output (after any element-wise function); the output is whole. GPT's blocks call row_parallel."""
    def __init__(self, linear: nn.Linear, grid):
        super().__init__()
        self.grid = grid
        self.local, self.bias = row_parallel(linear, grid)

    def forward(self, x):
        y = exit_tp(self.local(x), self.grid)  # (..., out): summed over the TP group
        return y if self.bias is None else y + self.bias


# Sequence parallelism (--sequence-parallel; Korthikanti et al. 2022 section 4.2.2): every all-reduce becomes a
# reduce-scatter + all-gather along T (the same bytes), so the LayerNorm/residual stretch between g and f is
# cut along the sequence and its activations shrink by t too: a Grid subclass with other f, g and matmul.


def gather_sequence(x, grid, async_op=False):
    """(B, T/t, ...) -> (B, T, ...): rank r's tokens land at positions r*T/t ... The gather stacks along
    a new leading dim; Megatron keeps activations (T, B, E) so that this is copy-free, gpt2 is (B, T, E).
    With async_op it returns a function that waits for the gather and then returns the (B, T, ...) tensor."""
    x = x.contiguous()
    out = torch.empty((grid.tp * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = gpt2.all_gather_single(out, x, group=grid.tp_group, async_op=async_op)  # (t*B, T/t, ...)

    def arranged():
        if work is not None:
            work.wait()
        return out.view(grid.tp, *x.shape).transpose(0, 1).reshape(x.size(0), grid.tp * x.size(1), *x.shape[2:])
    return arranged if async_op else arranged()


def reduce_scatter_sequence(x, grid):
    """(B, T, ...) partial sums -> (B, T/t, ...) full sums of this rank's tokens."""
    B, T = x.shape[:2]
    stacked = x.reshape(B, grid.tp, T // grid.tp, *x.shape[2:]).transpose(0, 1).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    gpt2.reduce_scatter_single(out, stacked.view(-1, *stacked.shape[2:]), group=grid.tp_group)  # gloo: concatenated
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


def linear_grads(grad, x, weight, has_bias):
    """dW = dY^T X and db = sum dY, as autograd's linear computes them (X already in dY's dtype: autocast
    does not reach a custom backward, so the Functions cast to the forward's dtype themselves)."""
    grad_2d = grad.flatten(0, -2)  # (B*T, out)
    grad_w = (grad_2d.t() @ x.flatten(0, -2)).to(weight.dtype)  # (out, in)
    return grad_w, grad_2d.float().sum(0).to(weight.dtype) if has_bias else None


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
        ctx.save_for_backward(x[:, grid.tp_rank * n:(grid.tp_rank + 1) * n].clone(), weight)
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


@torch.compiler.disable  # a collective in a custom backward: keep it out of the compiled graph
def column_function(fn, x, weight, bias, grid):
    return fn.apply(x, weight, bias, grid)


@dataclass
class SequenceParallelGrid(Grid):
    """f all-gathers T, g reduce-scatters it; the column matmuls keep only this rank's T/t tokens of their
    input; the replicated parameters (LayerNorms, row-parallel biases, wpe) saw T/t tokens on each rank."""
    overlap_regather: bool = False  # --overlap-comm with SP: re-gather a matmul's input while dX computes

    def f(self, x):
        return GatherSequence.apply(x, self)

    def g(self, x):
        return ReduceScatterSequence.apply(x, self)

    def column_linear(self, x, weight, bias):
        if self.tp > 1 and torch.is_grad_enabled():
            return column_function(LinearRegatherInput, x, weight, bias, self)
        return F.linear(x, weight, bias)

    def positions(self, T, device):  # this rank holds tokens tp_rank*T .. (tp_rank+1)*T - 1 of the sequence
        return torch.arange(self.tp_rank * T, (self.tp_rank + 1) * T, device=device)

    def sum_replicated_grads(self, params):  # section 4.2.2: add the T/t-token partial grads over TP
        grads = [p.grad for p in params]
        if self.tp > 1 and grads:
            flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), self)
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])


# --overlap-comm (Megatron-LM's async tensor-parallel all-reduce, core/tensor_parallel/layers.py): f's backward
# all-reduce of dX is issued before the dW matmul so the two may overlap; the forward all-reduces stay exposed.
# On CUDA the order holds only with CUDA_DEVICE_MAX_CONNECTIONS=1 (main sets it); 2 CPU cores: 0.98-1.00x (bench).


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
        grad_x = grad @ weight.to(grad.dtype)  # (B, T, in): this rank's partial sum of dX
        work = all_reduce(grad_x, ctx.grid, async_op=True)
        grad_w, grad_b = linear_grads(grad, x.to(grad.dtype), weight, ctx.has_bias)
        work.wait()
        return grad_x, grad_w, grad_b, None


@dataclass
class OverlapCommGrid(Grid):
    """f does nothing: the column matmul (LinearOverlapAllReduce) all-reduces dX itself, under dW."""

    def f(self, x):
        return x

    def column_linear(self, x, weight, bias):
        if self.tp > 1 and torch.is_grad_enabled():
            return column_function(LinearOverlapAllReduce, x, weight, bias, self)
        return F.linear(x, weight, bias)


# ---- Appendix ----
# Measurement (bytes, activations, closed forms, the run's report), the gathered model.pt, the global clip,
# argument checks, the command line.


# Bytes: the lesson's collectives are wrapped here and their names rebound, so every call above (which looks
# the name up when it runs) adds the bytes the ring algorithm sends to grid.meter (gpt2.CommMeter).
_uncounted = {"all_reduce": all_reduce, "gather_sequence": gather_sequence,
              "reduce_scatter_sequence": reduce_scatter_sequence}


def all_reduce(x, grid, group="tp", op=dist.ReduceOp.SUM, async_op=False):  # noqa: F811
    grid.meter.all_reduce(x.numel() * x.element_size(), grid.tp if group == "tp" else grid.dp)
    return _uncounted["all_reduce"](x, grid, group, op, async_op)


def gather_sequence(x, grid, async_op=False):  # noqa: F811
    grid.meter.all_gather(grid.tp * x.numel() * x.element_size(), grid.tp)
    return _uncounted["gather_sequence"](x, grid, async_op)


def reduce_scatter_sequence(x, grid):  # noqa: F811
    grid.meter.reduce_scatter(x.numel() * x.element_size(), grid.tp)
    return _uncounted["reduce_scatter_sequence"](x, grid)


def grid_for(world, rank, tp, sequence_parallel=False, overlap_comm=False):
    """make_grid, then the extension the flags ask for (the same groups and fields)."""
    grid = make_grid(world, rank, tp)
    fields = {f.name: getattr(grid, f.name) for f in dataclasses.fields(Grid)}
    if sequence_parallel:
        return SequenceParallelGrid(**fields, overlap_regather=overlap_comm)
    return OverlapCommGrid(**fields) if overlap_comm else grid


def grid_from_args(args, ctx):
    return grid_for(ctx.world, ctx.rank, args.tp, args.sequence_parallel, args.overlap_comm)


def unshard(w, grid, dim=0, pieces=1):
    """The inverse of shard: all-gather the TP group's slices into the full tensor."""
    w = w.detach().movedim(dim, 0).contiguous()
    out = torch.empty((grid.tp * w.size(0),) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
    gpt2.all_gather_single(out, w, group=grid.tp_group) if grid.tp > 1 else out.copy_(w)
    out = out.reshape(grid.tp, pieces, w.size(0) // pieces, *w.shape[1:]).transpose(0, 1)
    return out.reshape(-1, *w.shape[1:]).movedim(0, dim)


def full_state_dict(model):
    """gpt2.GPT's state dict, all-gathered over the TP group (so `gpt2.py sample` can load it)."""
    sd = {}
    for name, p in model.named_parameters():
        name = name.replace("attn_bias", "attn.c_proj.bias").replace("mlp_bias", "mlp.c_proj.bias")
        full = unshard(p, model.grid, *p.tp_split) if hasattr(p, "tp_split") else p.detach()
        sd[name if "." in name else name + ".weight"] = full.cpu()  # our wte is a bare Parameter
    sd["lm_head.weight"] = sd["wte.weight"]
    return sd


def clip_grad_norm(model, grid, max_norm):
    """The GLOBAL norm: sharded grads add their squares over TP, replicated ones count once, so they are
    divided by t before the one all-reduce. Then scale as torch.nn.utils.clip_grad_norm_ does."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = torch.stack([torch.linalg.vector_norm(p.grad.float()) ** 2 / (1 if hasattr(p, "tp_split") else grid.tp)
                      for p in model.parameters() if p.grad is not None]).sum()
    norm = all_reduce(sq, grid).sqrt()
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def comm_bytes_closed_form(cfg, args, grid, act_bytes, n_local_params):
    """Bytes one rank sends per optimizer step (ring algorithms, as gpt2.CommMeter counts them).
    Per micro-step: 4 all-reduces of a (B,T,E) activation per block (f and g, forward and backward), one
    for the embedding (fp32), one for the head input, and the loss statistics (N fp32 maxima, then 2N).
    With SP each all-reduce becomes an all-gather plus a reduce-scatter: the same bytes, plus 2 all-gathers
    per block and 1 for the head in backward to rebuild the column-parallel matmuls' inputs. Activation
    checkpointing recomputes a block only up to its last saved tensor (the MLP's c_proj input), so the
    MLP's g is not repeated: 1 extra all-reduce per block, or 3 half-size ops with SP. Per step: the SP
    grads over TP, every grad over DP, the grad norm and the loss."""
    t, d, E, L = grid.tp, grid.dp, cfg.n_embd, cfg.n_layer
    ar = lambda nbytes, n: 2 * (n - 1) / n * nbytes
    N = args.batch_size * args.seq_len
    sp = isinstance(grid, SequenceParallelGrid)
    recompute = (1.5 if sp else 1.0) if args.activation_checkpointing else 0.0
    regather = 1.0 if sp else 0.0  # c_attn's and c_fc's inputs, gathered again
    per_layer = (4 + regather + recompute) * ar(N * E * act_bytes, t)
    head = (1 + regather / 2) * ar(N * E * act_bytes, t)  # f before the head (+ its re-gather with SP)
    micro = L * per_layer + ar(N * E * 4, t) + head + ar(N * 4, t) + ar(2 * N * 4, t)
    replicated = L * 6 * E + 2 * E + cfg.block_size * E  # LayerNorm gains/biases, row-parallel biases, wpe
    sp_grads = ar(replicated * 4, t) if sp else 0.0
    return args.grad_accum * micro + sp_grads + ar(n_local_params * 4, d) + ar(4, t) + ar(4, d)


def saved_activation_bytes(model, idx, targets):
    """Bytes of the tensors autograd keeps for backward during one forward (parameters excluded, views
    of one storage counted once), as (embedding + blocks, head + loss): a micro-step's activations.
    Also returns the loss, so a caller may go on to backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = [{}, {}]

    def measure(part):
        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                kept[part][s.data_ptr()] = s.nbytes()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    with measure(0):
        x = model.forward_blocks(model.embed(idx))
    with measure(1):
        loss = model.head_loss(x, targets)
    return sum(kept[0].values()), sum(kept[1].values()), loss


def activation_bytes_closed_form(cfg, B, T, t, sequence_parallel):
    """Bytes one rank keeps for backward in one fp32 micro-step (s = T, b = B, h = E, a = heads, V = padded
    vocabulary), as (embedding + blocks, head + loss). Korthikanti et al. section 4.1 count, per layer in
    16-bit with dropout, sbh(34 + 5as/h), with TP sbh(10 + 24/t + 5as/(ht)), with SP sbh/t(34 + 5as/h).
    Here, per layer in values (x4 bytes): no dropout masks (their 2 bytes go), and SDPA's fused attention
    keeps q, k, v, its output (c_proj reads it as a view) and a logsumexp of a/t values per token instead
    of the a*s/h-sized scores; the LayerNorms keep a mean and an rstd per token (2 x 2 values):
        TP  sbh(4 + 12/t) + sb(4 + a/t)        (the paper's 10 + 24/t bytes less 2 of masks, over 2 bytes)
        SP  sbh(16/t) + sb(4 + a)/t            (the paper's 34/t bytes less 2/t, over 2)
    Embedding: the ids (int64) and the foreign-id mask (bool), 9sb bytes, + wpe's positions 8s (SP: 8s/t).
    Head: ln_f's input and the head's input, 2sbh values (SP: 2sbh/t), ln_f's 2sb (SP: 2sb/t) statistics,
    the softmax sbV/t, and the loss's target mask and local ids, 9sb bytes."""
    s, b, h, a, V = T, B, cfg.n_embd, cfg.n_head, cfg.padded_vocab
    if sequence_parallel:
        layer = 4 * (s * b * h * 16 // t + s * b * (4 + a) // t)
        embed, head = 9 * s * b + 8 * s // t, 4 * (2 * s * b * h // t + 2 * s * b // t + s * b * V // t) + 9 * s * b
    else:
        layer = 4 * (s * b * h * (4 * t + 12) // t + s * b * (4 * t + a) // t)
        embed, head = 9 * s * b + 8 * s, 4 * (2 * s * b * h + 2 * s * b + s * b * V // t) + 9 * s * b
    return embed + cfg.n_layer * layer, head


def with_grid(model, grid):
    """Point every module of a TensorParallelGPT at `grid` (the activation probe measures both modes)."""
    for m in model.modules():
        if hasattr(m, "grid"):
            m.grid = grid


def print_activation_memory(model, grid, args, ctx):
    """Print the activation bytes of one micro-batch, without and with sequence parallelism, beside their
    closed forms (fp32 only: under autocast the saved tensors also hold low-precision copies of the weights).
    Runs eagerly before train compiles anything: under --compile, probing both modes inside the compiled
    modules cost 3 recompiles and a graph break before step 0. The probe's collectives are not counted."""
    probe = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len),
                          generator=torch.Generator().manual_seed(0)).to(ctx.device)
    fields = {f.name: getattr(grid, f.name) for f in dataclasses.fields(Grid)}
    for sp in [False] + ([True] if grid.tp > 1 and args.seq_len % grid.tp == 0 else []):
        with_grid(model, SequenceParallelGrid(**fields) if sp else Grid(**fields))
        with ctx.autocast():
            blocks, head, _ = saved_activation_bytes(model, probe, probe)
        closed = activation_bytes_closed_form(model.config, args.batch_size, args.seq_len, grid.tp, sp)
        closed = [f" (closed form {c / 1e6:.2f})" if ctx.dtype == torch.float32 else "" for c in closed]
        gpt2.print0(f"activation memory per rank, one micro-batch, {'with' if sp else 'without'} sequence parallelism: "
                    f"{blocks / 1e6:.2f} MB embedding + blocks{closed[0]}, {head / 1e6:.2f} MB head + loss{closed[1]}")
    with_grid(model, grid)
    grid.meter.take_mb()


def report_start(args, ctx, model, n_params):
    """The run's first lines: sizes, the activation probe; returns the closed form of the bytes per step."""
    grid, n_local = model.grid, sum(p.numel() for p in model.parameters())
    gpt2.print0(f"model {args.model}: {n_params / 1e6:.2f}M non-embedding params | grid TP={grid.tp} x DP={grid.dp}"
                f"{' + SP' if args.sequence_parallel else ''}{' + overlap' if args.overlap_comm else ''} | "
                f"{n_local / 1e6:.2f}M params on this rank | {ctx.device} {ctx.dtype}")
    print_activation_memory(model, grid, args, ctx)  # eager, before compiling (see there)
    return comm_bytes_closed_form(model.config, args, grid, torch.finfo(ctx.dtype).bits // 8, n_local) / 1e6


def report_step(metrics, step, loss, lr, grid, expected_mb):
    comm_mb = grid.meter.take_mb()
    metrics.log_step(step, loss, lr, comm_mb=comm_mb, comm_closed_form_mb=expected_mb)
    if step == 0:
        gpt2.print0(f"communication per step per rank: {comm_mb:.3f} MB measured, {expected_mb:.3f} MB closed form")


def validate(args, cfg, world):
    """Every size problem becomes an error before the first collective."""
    gpt2.check_args(args)
    if args.tp is not None:
        gpt2.check_range(args.tp, "--tp", 1, todo="give a positive integer")
    tp = args.tp or world
    if tp < 1 or world % tp:
        gpt2.fail(f"--tp {tp} does not divide the {world} ranks", "--tp", "give a divisor of the world size")
    if cfg.n_head % tp:
        gpt2.fail(f"{cfg.n_head} heads cannot be split over {tp} ranks", "--tp/--n-head",
                  "give a --tp that divides the number of heads (GPT-2 124M: 1, 2, 3, 4, 6 or 12)")
    if cfg.padded_vocab % tp:
        gpt2.fail(f"the padded vocabulary {cfg.padded_vocab} is not divisible by {tp}", "--tp",
                  "give a power-of-two --tp (the vocabulary is padded to a multiple of 128)")
    if args.sequence_parallel and args.seq_len % tp:
        gpt2.fail(f"--seq-len {args.seq_len} is not divisible by --tp {tp}", "--sequence-parallel",
                  "give a --seq-len divisible by --tp, or drop --sequence-parallel")
    return tp


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


def main(argv=None):
    p = gpt2.make_parser("Megatron tensor parallelism (x data parallelism) for GPT-2.")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks per model (default: all); DP = world / tp")
    p.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/residual activations along the sequence")
    p.add_argument("--overlap-comm", action="store_true",
                   help="issue the column-parallel matmuls' backward dX all-reduce (SP: the input re-gather) before "
                        "the matmul it may overlap with")
    args = p.parse_args(argv)
    args.tp = validate(args, gpt2.model_config(args), int(os.environ.get("WORLD_SIZE", 1)))
    warn_tp_across_nodes(args.tp)
    if args.overlap_comm:
        order_comm_before_compute()
    train(args)


if __name__ == "__main__":
    gpt2.run_main(main)
