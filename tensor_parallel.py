"""
tensor_parallel.py - Megatron-LM tensor parallelism for GPT-2, written from torch.distributed primitives:
column/row-parallel matmuls, a vocab-parallel embedding and cross-entropy, sequence parallelism, and a
2-D grid of tensor x data parallel ranks.

The idea: a block's two matmul pairs can be cut so that ranks never exchange weights. Split the first
matmul of each pair by output features (columns of the math, rows of nn.Linear: attention heads, MLP
hidden units) and the second by input features; each rank then computes a partial sum of the block's
output and one all-reduce finishes it. Attention splits the same way because heads are independent.
The embedding and the tied LM head are cut along the vocabulary: no rank ever holds a full row of
logits, the softmax is assembled from all-reduced maxima and sums. Sequence parallelism replaces each
all-reduce by a reduce-scatter + all-gather (same bytes) and keeps the LayerNorm/residual stretch cut
along the sequence, so its activations shrink by TP too. --overlap-comm issues a column-parallel matmul's input-gradient all-reduce before its weight-gradient
matmul so that the two may overlap, as Megatron-LM does (on CUDA with CUDA_DEVICE_MAX_CONNECTIONS=1, which
it sets); the forward all-reduces stay exposed. On 2 CPU cores it gains nothing (1.00x, bench below).
The column/row-parallel linears, the vocab-parallel embedding and loss take any nn.Linear/nn.Embedding:
GPT's blocks are one user of them, a toy MLP + LM head in the tests is another.

    2-D grid: world = DP x TP, rank = dp_rank * TP + tp_rank (TP neighbours share a node: NVLink)

                    tp_rank 0          tp_rank 1
        dp_rank 0    rank 0  <-- TP -->  rank 1     TP group: same batch rows, different weight shards
        dp_rank 1    rank 2  <-- TP -->  rank 3       (activations move: all-reduce / gather / scatter)
                       ^ DP ^              ^ DP ^   DP group: same shards, different batch rows
                                                      (gradients move: one all-reduce per step)

    one block on TP rank r of t        (E width, H heads, [..] = with --sequence-parallel)
        x (B,T,E) replicated  [x (B,T/t,E): rank r holds tokens r*T/t .. (r+1)*T/t-1]
        h = f(ln_1(x))                    f: fwd identity, bwd all-reduce  [fwd all-gather T, bwd reduce-scatter T]
        q,k,v = h @ [Wq_r; Wk_r; Wv_r]^T  column-parallel: heads r*H/t .. (r+1)*H/t-1, no communication
        y = attention(q, k, v) @ Wo_r^T   row-parallel: a partial sum of the full (B,T,E) output
        x = x + g(y) + bo                 g: fwd all-reduce, bwd identity  [fwd reduce-scatter T, bwd all-gather T]
        (the MLP: c_fc column-parallel (4E/t hidden units), c_proj row-parallel, the same f and g)

    vocab: wte (50304,E) tied with lm_head -> rank r holds rows r*V/t .. (r+1)*V/t-1 for both
        embed:  look up the ids in my rows, zeros elsewhere, then g (the sum picks the owner's row)
        loss:   logits_r = f(ln_f(x)) @ wte_r^T (B,T,V/t); all-reduce max, then all-reduce
                [sum exp, target logit]: loss = log sum exp - target; the 47 pad ids are -inf

    activations one block keeps for backward on a rank, in units of B*T*E values (no dropout here):
        TP       4 + 12/t   LayerNorm inputs and the gathered c_attn/c_fc inputs are whole, the rest cut
        TP + SP  16/t       LayerNorm inputs cut along T; c_attn/c_fc keep only their input's T/t
                            tokens and all-gather them again in backward (2 more all-gathers a block)

    GPT-2 124M at 8 ranks, B=16, T=1024, bf16, per rank (measured by tests/bench_tensor_parallel.py
    --per-rank-124m on a fake process group; TP=8 cannot cut 12 heads, so TP=4 and TP=2):
                           bytes sent/step   params+grads+AdamW   activations (saved for backward)
        TP=4 x DP=2             2052 MB           508 MB              4612 MB
        TP=4 x DP=2 + SP        2529 MB           508 MB              2489 MB
        TP=2 x DP=4             1660 MB          1003 MB              7333 MB
        TP=2 x DP=4 + SP        1978 MB          1003 MB              4977 MB
        ddp.py, DP=8             871 MB          1992 MB
      params on a rank: L(12E^2 + 7E)/t + 6LE + VE/t + 1024E + 2E = 31.75M at t=4, x 16 bytes = 508 MB
      bytes at t=4, N = B*T = 16384: one all-reduce of (N, E) bf16 is 2(t-1)/t * 25.2 MB = 37.7 MB; 4 per
        block x 12 = 1812 MB, + embedding (fp32) 75.5 + head 37.7 + the DP grads 2(d-1)/d * 127 MB -> 2052 MB;
        SP: 2 re-gathers per block and 1 for the head (+472 MB), the SP grads over TP (+5 MB) -> 2529 MB
      ddp.py: 16P = 16 * 124.48M = 1992 MB and 2(7/8) * 4P = 871 MB. TP=4 holds 3.9x less and sends 2.4x
        more, inside forward and backward (on the critical path): TP stays inside a node (NVLink).

Launch:
    torchrun --nproc_per_node=2 tensor_parallel.py --tp 2                       # CPU gloo, tiny model
    torchrun --nproc_per_node=2 tensor_parallel.py --tp 2 --sequence-parallel
    torchrun --nproc_per_node=2 tensor_parallel.py --tp 2 --overlap-comm        # same gradients, comm hidden
    torchrun --nproc_per_node=4 tensor_parallel.py --tp 2 --batch-size 4        # TP=2 x DP=2, global batch 8
    torchrun --nproc_per_node=8 tensor_parallel.py --model gpt2 --data data/fineweb10B --tp 4 \
        --sequence-parallel --batch-size 16 --seq-len 1024 --grad-accum 16 --compile   # 8 GPUs: TP=4 x DP=2

References: Shoeybi et al. 2019, Megatron-LM, section 3 and figures 3-4 (the f/g operators, heads and
the vocab-parallel embedding/loss); Korthikanti et al. 2022, Reducing Activation Recomputation in Large
Transformer Models, section 4.2.2 (sequence parallelism) and section 4.1 (activation memory);
Narayanan et al. 2021, Efficient Large-Scale Language Model Training (section 2.3, the TP x DP grid);
NVIDIA/Megatron-LM megatron/core/tensor_parallel (layers.py: the async all-reduce and the SP input
re-gather in LinearWithGradAccumulationAndAsyncCommunication); huggingface/picotron tensor_parallel.
Differs from Megatron: activations are (B, T, E), not (T, B, E), so the sequence gathers copy; with SP the
reduce-scatter of the input gradient is not overlapped (gpt2's attention must see the gathered T).

Uses from gpt2.py: GPT/Block and its attention/MLP modules (cut in place), build_model, make_loaders,
optimizer_groups/make_adamw/set_lr/accumulate_grads/evaluate, setup/Context, CommMeter, Metrics, Profiler,
all_gather_single/reduce_scatter_single, make_parser/check_args/fail/run_main.
"""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gpt2
from gpt2 import all_gather_single, reduce_scatter_single

# ----------------------------------------------------------------------------------------------------
# The rank grid


@dataclass
class Grid:
    """Where this rank sits: its TP group (shards of one model) and its DP group (replicas)."""
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: object
    dp_group: object
    sequence_parallel: bool
    meter: gpt2.CommMeter
    overlap_comm: bool = False  # --overlap-comm: column-parallel backward communicates under the dW matmul


def make_grid(world, rank, tp, sequence_parallel=False, overlap_comm=False):
    """rank = dp_rank * tp + tp_rank. Every rank must create every group, in the same order."""
    dp = world // tp
    tp_group = dp_group = None
    if world > 1:
        for d in range(dp):
            g = dist.new_group([d * tp + i for i in range(tp)])
            tp_group = g if d == rank // tp else tp_group
        for i in range(tp):
            g = dist.new_group([d * tp + i for d in range(dp)])
            dp_group = g if i == rank % tp else dp_group
    return Grid(tp, dp, rank % tp, rank // tp, tp_group, dp_group, sequence_parallel, gpt2.CommMeter(), overlap_comm)


def all_reduce(x, grid, group="tp", op=dist.ReduceOp.SUM, async_op=False):
    """In place; returns x, or with async_op the work handle to wait on (None when alone)."""
    n, g = (grid.tp, grid.tp_group) if group == "tp" else (grid.dp, grid.dp_group)
    work = None
    if n > 1:
        work = dist.all_reduce(x, op=op, group=g, async_op=async_op)
        grid.meter.all_reduce(x.numel() * x.element_size(), n)
    return work if async_op else x


def gather_sequence(x, grid, async_op=False):
    """(B, T/t, ...) -> (B, T, ...): rank r's tokens land at positions r*T/t ... The gather stacks along
    a new leading dim; Megatron keeps activations (T, B, E) so that this is copy-free, gpt2 is (B, T, E).
    With async_op it returns a function that waits for the gather and then returns the (B, T, ...) tensor."""
    x = x.contiguous()
    out = torch.empty((grid.tp * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = all_gather_single(out, x, group=grid.tp_group, async_op=async_op)  # (t*B, T/t, ...)
    grid.meter.all_gather(out.numel() * out.element_size(), grid.tp)

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
    reduce_scatter_single(out, stacked.view(-1, *stacked.shape[2:]), group=grid.tp_group)  # gloo: concatenated
    grid.meter.reduce_scatter(stacked.numel() * stacked.element_size(), grid.tp)
    return out


# ----------------------------------------------------------------------------------------------------
# The conjugate operators (Megatron-LM figure 3: f before a column-parallel matmul, g after a row-parallel one)


class CopyToTP(torch.autograd.Function):
    """f: every rank needs the whole input; its gradient is a sum of each rank's contribution."""

    @staticmethod
    def forward(ctx, x, grid):
        ctx.grid = grid
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.grid), None


class ReduceFromTP(torch.autograd.Function):
    """g: sum the partial outputs; each rank's partial gets the full (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, grid):
        ctx.mark_dirty(x)  # summed in place: x is a fresh matmul output nobody else reads
        return all_reduce(x, grid)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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


def enter_tp(x, grid):
    """f, into a column-parallel matmul, whose input this must be and whose ONLY consumer. Which Function runs:
        TP + SP              GatherSequence  fwd all-gather along T        bwd reduce-scatter dX along T
        TP                   CopyToTP        fwd identity                  bwd all-reduce dX
        TP + overlap-comm    none: the matmul's LinearOverlapAllReduce all-reduces dX itself, under dW
        tp == 1              none
    Under autocast the matmul would cast to bf16 anyway: cast first, so f's communication moves bf16."""
    if grid.tp == 1:
        return x
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if grid.sequence_parallel:
        return GatherSequence.apply(x, grid)
    return x if grid.overlap_comm else CopyToTP.apply(x, grid)


def exit_tp(x, grid):
    """g, out of a row-parallel matmul (or the vocab-parallel embedding): sum the partial results.
    Which Function runs:
        TP + SP   ReduceScatterSequence  fwd reduce-scatter along T (B, T, E) -> (B, T/t, E)  bwd all-gather
        TP        ReduceFromTP           fwd all-reduce                                     bwd identity
        tp == 1   none"""
    if grid.tp == 1:
        return x
    return ReduceScatterSequence.apply(x, grid) if grid.sequence_parallel else ReduceFromTP.apply(x, grid)


# ----------------------------------------------------------------------------------------------------
# Parallel layers, cut out of the full (identically seeded) gpt2 model


def shard(w, grid, dim=0, pieces=1):
    """This rank's 1/t of dimension `dim`. `pieces` packed blocks (c_attn's q, k, v) are each cut
    separately, so rank r gets [q_r; k_r; v_r] and gpt2's attention splits them with the same chunk(3)."""
    w = w.movedim(dim, 0)
    blocks = w.reshape(pieces, w.size(0) // pieces, *w.shape[1:])
    n = blocks.size(1) // grid.tp
    return blocks[:, grid.tp_rank * n:(grid.tp_rank + 1) * n].reshape(-1, *w.shape[1:]).movedim(0, dim).clone()


def unshard(w, grid, dim=0, pieces=1):
    """The inverse of shard: all-gather the TP group's slices into the full tensor."""
    w = w.detach().movedim(dim, 0).contiguous()
    out = torch.empty((grid.tp * w.size(0),) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
    all_gather_single(out, w, group=grid.tp_group) if grid.tp > 1 else out.copy_(w)
    out = out.reshape(grid.tp, pieces, w.size(0) // pieces, *w.shape[1:]).transpose(0, 1)
    return out.reshape(-1, *w.shape[1:]).movedim(0, dim)


def split_param(t, grid, dim=0, pieces=1):
    """A parameter holding this rank's shard; tp_split remembers how to put the full tensor back."""
    if t is None:  # a Linear without bias
        return None
    p = nn.Parameter(shard(t.detach(), grid, dim, pieces))
    p.tp_split = (dim, pieces)
    return p


def linear_grads(grad, x, weight, has_bias):
    """dW = dY^T X and db = sum dY, as autograd's linear computes them (X already in dY's dtype: autocast
    does not reach a custom backward, so the Functions cast to the forward's dtype themselves)."""
    grad_2d = grad.flatten(0, -2)  # (B*T, out)
    grad_w = (grad_2d.t() @ x.flatten(0, -2)).to(weight.dtype)  # (out, in)
    return grad_w, grad_2d.float().sum(0).to(weight.dtype) if has_bias else None


class LinearRegatherInput(torch.autograd.Function):
    """Y = X W^T + b for an all-gathered X (B, T, in) that is NOT kept for backward: only this rank's
    tokens (B, T/t, in) are saved, and backward all-gathers them again for the weight gradient
    (Korthikanti et al. section 4.2.2). With --overlap-comm that re-gather runs while dX = dY W is
    computed (it needs no X), as Megatron-LM does; without, it comes first. dX leaves whole (B, T, in):
    enter_tp's GatherSequence reduce-scatters it (Megatron also overlaps that one with dW; here it
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
        if ctx.grid.overlap_comm:
            regathered = gather_sequence(mine, ctx.grid, async_op=True)  # in flight while dX computes
            grad_x = grad @ weight.to(grad.dtype)  # (B, T, in)
            x = regathered()  # (B, T, in)
        else:
            x = gather_sequence(mine, ctx.grid)
            grad_x = grad @ weight.to(grad.dtype)
        grad_w, grad_b = linear_grads(grad, x.to(grad.dtype), weight, ctx.has_bias)
        return grad_x, grad_w, grad_b, None


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


def column_parallel_linear(x, weight, bias, grid):
    """Y_r = X W_r^T + b_r, the output features this rank owns; x is enter_tp's output. In training
    the Function that runs is: with SP LinearRegatherInput, with --overlap-comm LinearOverlapAllReduce,
    otherwise plain F.linear (CopyToTP then all-reduces dX after autograd's linear backward)."""
    if grid.tp > 1 and torch.is_grad_enabled() and (grid.sequence_parallel or grid.overlap_comm):
        return _column_function(x, weight, bias, grid)
    return F.linear(x, weight, bias)


@torch.compiler.disable  # a collective in a custom backward: keep it out of the compiled graph
def _column_function(x, weight, bias, grid):
    fn = LinearRegatherInput if grid.sequence_parallel else LinearOverlapAllReduce
    return fn.apply(x, weight, bias, grid)


class ColumnParallelLinear(nn.Module):
    """nn.Linear cut by output features (rows of its weight): Y_r = X W_r^T + b_r. Its input must
    come through enter_tp; its output is this rank's slice of the features (Megatron-LM's A_r in
    section 3). Works for any nn.Linear: gpt2's c_attn (pieces=3: q, k, v cut separately), c_fc, a
    toy MLP's first layer, a toy LM head (then feed vocab_parallel_cross_entropy)."""

    def __init__(self, linear: nn.Linear, grid, pieces=1):
        super().__init__()
        self.grid = grid
        self.weight = split_param(linear.weight, grid, 0, pieces)  # (out/t, in)
        self.bias = split_param(linear.bias, grid, 0, pieces)  # (out/t,) or None

    def forward(self, x):
        return column_parallel_linear(x, self.weight, self.bias, self.grid)


def row_parallel(linear: nn.Linear, grid):
    """Y = sum_r X_r W_r^T + b: rank r multiplies its input features and returns a partial sum (no bias;
    the bias is added once, after exit_tp). Returns the local nn.Linear and the replicated bias."""
    out = nn.Linear(linear.in_features // grid.tp, linear.out_features, bias=False, device="meta")
    out.weight = split_param(linear.weight, grid, dim=1)  # (out, in/t)
    return out, None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())


class RowParallelLinear(nn.Module):
    """nn.Linear cut by input features, g included: X_r (..., in/t) is this rank's slice of the features
    (a ColumnParallelLinear's output, after any element-wise function); the output is whole (with SP,
    this rank's tokens). For any model; GPT's blocks call row_parallel directly, so that g runs outside
    gpt2's compiled attention/MLP modules."""

    def __init__(self, linear: nn.Linear, grid):
        super().__init__()
        self.grid = grid
        self.local, self.bias = row_parallel(linear, grid)

    def forward(self, x):
        y = exit_tp(self.local(x), self.grid)  # (..., out): summed over the TP group
        return y if self.bias is None else y + self.bias


class ParallelBlock(nn.Module):
    """gpt2.Block with its four matmuls cut: gpt2's own CausalSelfAttention and MLP modules run on the
    local slices (their head count follows the width), the communication happens around them."""

    def __init__(self, block: gpt2.Block, grid: Grid):
        super().__init__()
        self.grid = grid
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp
        self.attn.c_attn = ColumnParallelLinear(self.attn.c_attn, grid, pieces=3)
        self.attn.c_proj, self.attn_bias = row_parallel(self.attn.c_proj, grid)
        self.mlp.c_fc = ColumnParallelLinear(self.mlp.c_fc, grid)
        self.mlp.c_proj, self.mlp_bias = row_parallel(self.mlp.c_proj, grid)

    def forward(self, x):  # x (B, T, E), with SP (B, T/t, E); enter_tp gives attn/mlp the whole (B, T, E)
        x = x + (exit_tp(self.attn(enter_tp(self.ln_1(x), self.grid)), self.grid) + self.attn_bias)
        return x + (exit_tp(self.mlp(enter_tp(self.ln_2(x), self.grid)), self.grid) + self.mlp_bias)


def vocab_range(cfg, grid):
    n = cfg.padded_vocab // grid.tp
    return grid.tp_rank * n, (grid.tp_rank + 1) * n


def vocab_parallel_embedding(idx, weight, grid):
    """Rank r looks up the ids it owns and writes zeros for the others; exit_tp's sum then holds each
    token's row exactly once (Megatron-LM section 3, the input embedding)."""
    lo, hi = grid.tp_rank * weight.size(0), (grid.tp_rank + 1) * weight.size(0)  # weight (V/t, E)
    foreign = (idx < lo) | (idx >= hi)  # (B, T)
    x = F.embedding((idx - lo).masked_fill(foreign, 0), weight)  # (B, T, E), exit_tp: SP (B, T/t, E)
    return exit_tp(x.masked_fill(foreign.unsqueeze(-1), 0.0), grid)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from (N, V/t) logit shards (rank r holds columns lo .. lo + V/t - 1). Only (N,)-sized statistics cross ranks: the row
    max, then [sum of exp, target logit] in one all-reduce. Backward is local: softmax - one_hot."""

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
    def backward(ctx, grad):
        softmax, mine, local_t = ctx.saved_tensors
        rows = torch.arange(softmax.size(0), device=softmax.device)
        grad_logits = softmax.clone()
        grad_logits[rows[mine], local_t[mine]] -= 1.0
        return grad_logits.mul_(grad / softmax.size(0)), None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, grid, vocab_size=None, lo=None):
    """Mean loss from this rank's (..., V/t) slice of any LM head's logits (a ColumnParallelLinear, or
    the tied wte). Columns at or above vocab_size (padding) are excluded; lo defaults to rank * V/t."""
    lo = grid.tp_rank * logits.size(-1) if lo is None else lo
    vocab_size = grid.tp * logits.size(-1) if vocab_size is None else vocab_size
    logits = logits.float().reshape(-1, logits.size(-1))  # (N, V/t)
    return VocabParallelCrossEntropy.apply(logits, targets.reshape(-1), grid, lo, vocab_size)


class TensorParallelGPT(nn.Module):
    """This rank's shard of gpt2.GPT: one tied (V/t, E) slice of wte, the blocks' matmul slices, and
    replicated LayerNorms, biases of row-parallel matmuls and wpe."""

    def __init__(self, full: gpt2.GPT, grid: Grid):
        super().__init__()
        self.config, self.grid = full.config, grid
        self.activation_checkpointing = full.activation_checkpointing
        self.wte = split_param(full.wte.weight, grid)  # the embedding AND the head
        self.wpe, self.ln_f = full.wpe, full.ln_f
        self.h = nn.ModuleList(ParallelBlock(b, grid) for b in full.h)

    def embed(self, idx):
        x = vocab_parallel_embedding(idx, self.wte, self.grid)
        start = self.grid.tp_rank * x.size(1) if self.grid.sequence_parallel and self.grid.tp > 1 else 0
        return x + self.wpe(torch.arange(start, start + x.size(1), device=idx.device))

    def forward_blocks(self, x):
        for block in self.h:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)  # recomputation repeats the block's collectives
            else:
                x = block(x)
        return x

    def forward(self, idx, targets):
        """The mean loss (the same number on every TP rank)."""
        return self.head_loss(self.forward_blocks(self.embed(idx)), targets)

    def head_loss(self, x, targets):
        """Vocab-parallel head and loss: the full (B, T, V) logits are never formed."""
        logits = column_parallel_linear(enter_tp(self.ln_f(x), self.grid), self.wte, None, self.grid)  # (B, T, V/t)
        return vocab_parallel_cross_entropy(logits, targets, self.grid, self.config.vocab_size,
                                            vocab_range(self.config, self.grid)[0])

    def full_state_dict(self):
        """gpt2.GPT's state dict, all-gathered over the TP group (so `gpt2.py sample` can load it)."""
        sd = {}
        for name, p in self.named_parameters():
            name = name.replace("attn_bias", "attn.c_proj.bias").replace("mlp_bias", "mlp.c_proj.bias")
            full = unshard(p, self.grid, *p.tp_split) if hasattr(p, "tp_split") else p.detach()
            sd[name if "." in name else name + ".weight"] = full.cpu()  # our wte is a bare Parameter
        sd["lm_head.weight"] = sd["wte.weight"]
        return sd


# ----------------------------------------------------------------------------------------------------
# Gradients across the grid


def all_reduce_bucket(grads, grid, group):
    """One flat buffer, one collective (instead of one per tensor), then copied back."""
    flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), grid, group)
    torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])


def sync_grads(model, grid):
    """(1) With sequence parallelism each rank saw T/t tokens in the LayerNorms, the row-parallel biases
    and wpe: sum their grads over TP (Korthikanti et al. section 4.2.2). (2) Average every grad over DP.
    Without SP the replicated grads are already identical across TP."""
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if grid.sequence_parallel and grid.tp > 1:
        all_reduce_bucket([p.grad for p in params if not hasattr(p, "tp_split")], grid, "tp")
    if grid.dp > 1:
        torch._foreach_div_(grads, grid.dp)  # the mean over DP of each rank's mean loss gradient
        all_reduce_bucket(grads, grid, "dp")


def clip_grad_norm(model, grid, max_norm):
    """The GLOBAL norm: sharded grads add their squares over TP, replicated ones count once, so they are
    divided by t before the one all-reduce. Then scale as torch.nn.utils.clip_grad_norm_ does."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = torch.stack([torch.linalg.vector_norm(p.grad.float()) ** 2 / (1 if hasattr(p, "tp_split") else grid.tp)
                      for p in model.parameters() if p.grad is not None]).sum()
    norm = all_reduce(sq, grid).sqrt()
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


# ----------------------------------------------------------------------------------------------------
# Training: gpt2.py train's loop on the TP model, then the grid's gradient sync and the global clip


def train(args):
    """args.tp already checked (see validate). One TP x DP grid, the full model built identically on every
    rank (same seed) and cut, gpt2's data, AdamW and LR schedule; the gathered model saved in gpt2's layout."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    own_group = not dist.is_initialized()  # a caller (tests) may have started the process group
    ctx = gpt2.setup(args)
    grid = make_grid(ctx.world, ctx.rank, args.tp, args.sequence_parallel, args.overlap_comm)
    full = gpt2.build_model(args)
    cfg = full.config
    validate(args, cfg, world)  # --init-from brings its own config
    n_params = full.num_params()
    model = TensorParallelGPT(full.to(ctx.device), grid)
    del full
    train_loader, val_loader = gpt2.make_loaders(args, grid.dp_rank, grid.dp, vocab_size=cfg.vocab_size)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * grid.dp
    metrics = gpt2.Metrics(args, ctx, cfg, n_params, tokens_per_step)
    profiler = gpt2.Profiler(args, ctx)
    n_local = sum(p.numel() for p in model.parameters())
    expected_mb = comm_bytes_closed_form(cfg, args, grid, torch.finfo(ctx.dtype).bits // 8, n_local) / 1e6
    gpt2.print0(f"model {args.model}: {n_params / 1e6:.2f}M non-embedding params | grid TP={grid.tp} x DP={grid.dp}"
                f"{' + SP' if args.sequence_parallel else ''}{' + overlap' if args.overlap_comm else ''} | "
                f"{n_local / 1e6:.2f}M params on this rank | {ctx.device} {ctx.dtype}")
    print_activation_memory(model, grid, args, ctx)  # eager, before compiling (see there)
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
            clip_grad_norm(model, grid, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val = all_reduce(loss_sum, grid, group="dp").item() / grid.dp  # every TP rank holds the same loss
        gpt2.check_finite(loss_val, step)
        comm_mb = grid.meter.take_mb()
        metrics.log_step(step, loss_val, lr, comm_mb=comm_mb, comm_closed_form_mb=expected_mb)
        if step == 0:
            gpt2.print0(f"communication per step per rank: {comm_mb:.3f} MB measured, {expected_mb:.3f} MB closed form")
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            # gpt2.evaluate averages over all ranks; TP ranks hold equal losses, so that is the DP mean
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
            grid.meter.take_mb()
    gpt2.check_finite_weights(list(model.parameters()), args.steps - 1)  # every rank: the last update too
    sd = model.full_state_dict()
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, sd)
    metrics.plot()
    gpt2.print0(f"saved {args.out}/model.pt (gathered, gpt2 layout) and {args.out}/loss.png")
    if own_group and dist.is_initialized():
        dist.destroy_process_group()


# ====================================================================================================
# Appendix: closed forms and measurement, argument checks, command line
# ====================================================================================================




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
    recompute = (1.5 if grid.sequence_parallel else 1.0) if args.activation_checkpointing else 0.0
    regather = 1.0 if grid.sequence_parallel else 0.0  # c_attn's and c_fc's inputs, gathered again
    per_layer = (4 + regather + recompute) * ar(N * E * act_bytes, t)
    head = (1 + regather / 2) * ar(N * E * act_bytes, t)  # f before the head (+ its re-gather with SP)
    micro = L * per_layer + ar(N * E * 4, t) + head + ar(N * 4, t) + ar(2 * N * 4, t)
    replicated = L * 6 * E + 2 * E + cfg.block_size * E  # LayerNorm gains/biases, row-parallel biases, wpe
    sp = ar(replicated * 4, t) if grid.sequence_parallel else 0.0
    return args.grad_accum * micro + sp + ar(n_local_params * 4, d) + ar(4, t) + ar(4, d)


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


def print_activation_memory(model, grid, args, ctx):
    """Print the activation bytes of one micro-batch, without and with sequence parallelism, beside their
    closed forms (fp32 only: under autocast the saved tensors also hold low-precision copies of the weights).
    Runs eagerly before train compiles anything: under --compile, probing both modes inside the compiled
    modules cost 3 recompiles and a graph break before step 0. The probe's collectives are not counted."""
    probe = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len),
                          generator=torch.Generator().manual_seed(0)).to(ctx.device)
    for sp in [False] + ([True] if grid.tp > 1 and args.seq_len % grid.tp == 0 else []):
        grid.sequence_parallel = sp
        with ctx.autocast():
            blocks, head, _ = saved_activation_bytes(model, probe, probe)
        closed = activation_bytes_closed_form(model.config, args.batch_size, args.seq_len, grid.tp, sp)
        closed = [f" (closed form {c / 1e6:.2f})" if ctx.dtype == torch.float32 else "" for c in closed]
        gpt2.print0(f"activation memory per rank, one micro-batch, {'with' if sp else 'without'} sequence parallelism: "
                    f"{blocks / 1e6:.2f} MB embedding + blocks{closed[0]}, {head / 1e6:.2f} MB head + loss{closed[1]}")
    grid.sequence_parallel = args.sequence_parallel
    grid.meter.take_mb()


def validate(args, cfg, world):
    """Every size problem becomes an error before the first collective."""
    gpt2.check_args(args)
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


def main(argv=None):
    p = gpt2.make_parser("Megatron tensor parallelism (x data parallelism) for GPT-2.")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks per model (default: all); DP = world / tp")
    p.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/residual activations along the sequence")
    p.add_argument("--overlap-comm", action="store_true",
                   help="in backward, run the column-parallel matmuls' dX all-reduce (SP: the input re-gather) under a matmul")
    args = p.parse_args(argv)
    if args.overlap_comm:
        order_comm_before_compute()
    args.tp = validate(args, gpt2.model_config(args), int(os.environ.get("WORLD_SIZE", 1)))
    train(args)


if __name__ == "__main__":
    gpt2.run_main(main)
