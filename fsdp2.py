"""
fsdp2.py - Fully Sharded Data Parallel (FSDP2 / ZeRO-3) for GPT-2, written from all_gather and
reduce_scatter, so you can see exactly what torch.distributed.fsdp.fully_shard does.

The idea: data parallelism keeps a full copy of the weights, the gradients and AdamW's two moments on
every rank: 16 bytes per parameter (fp32), 2 GB for GPT-2 124M, 25 GB for 1.5B. FSDP cuts every
parameter into N row-slices (dim 0, padded to a multiple of N) and each rank keeps only its slice of
the weights, of the gradients and of the optimizer state: 16/N bytes per parameter. A layer's full
weights exist only while the layer runs: just before a unit (one transformer Block, or the root unit
wte/lm_head + wpe + ln_f) computes, its slices are all-gathered into one flat buffer; right after its
backward, its full gradients are reduce-scattered so each rank keeps the sum of its own rows only.
AdamW then updates each rank's rows, which is all the optimizer ever needs (it works elementwise).
The communication is hidden behind compute by prefetching: the next unit's all-gather is in flight
while this unit computes.

    2 ranks, one Block unit; a weight W of R rows is padded to 2r rows, r = ceil(R/2)

      rank 0 keeps W[0:r]  fp32  (+ grad + AdamW m, v)   rank 1 keeps W[r:2r]  (+ grad + m, v)
                |                                                  |
    forward     +------- all_gather (in the gather dtype) ---------+     next unit's gather
                v                                                  v     already in flight
      full W (both ranks): run the Block;  ZeRO-3: free W now  |  SHARD_GRAD_OP: keep W until backward
    backward    ZeRO-3: all_gather W again (prefetched one unit ahead), compute dW (full size)
                +----------- reduce_scatter(dW, fp32, sum) --------+
                v                                                  v
      rank 0: dW[0:r] / 2,  free W, dW                rank 1: dW[r:2r] / 2
    step        global grad norm = sqrt(all_reduce(sum of squares of the slices)), clip,
                AdamW on the slices only; nothing else moves

    bytes sent per rank per micro-step, P params, N ranks (ring algorithms, CommMeter's convention):
      DDP            all_reduce(grads fp32)                       2 (N-1)/N 4P
      ZeRO-3         gather fwd + gather bwd + reduce_scatter     3 (N-1)/N 4P  = 1.5x DDP   (fp32)
      SHARD_GRAD_OP  gather fwd + reduce_scatter                  2 (N-1)/N 4P  = 1.0x DDP
      The root unit is gathered once per micro-step in both modes, as FSDP2 does (the embedding needs
      it first, the head last, and the embedding's backward needs it again at the very end), so for GPT-2 124M, whose
      root is 32% of P, ZeRO-3 sends 1.34x DDP in fp32, and 0.92x with bf16 gathers on CUDA.

    Names. --reshard-after-forward 1 is ZeRO-3 (the paper's P_os+g+p, FSDP's FULL_SHARD). 0 keeps
    each unit's full weights from its forward to its backward and still gathers them every micro-step:
    FSDP's SHARD_GRAD_OP, "ZeRO-2-like" but not the paper's ZeRO-2, whose parameters are replicated
    (never gathered; ddp.py's territory). Start-up: every rank builds the whole model
    (gpt2.build_model().to(device)) and then keeps its slices, so for a moment each rank holds the full
    fp32 weights (4P: 0.5 GB at 124M, 6 GB at 1.5B); real FSDP code builds on the meta device and
    initializes only the local shards, which matters once 4P no longer fits beside the shards.

    Memory per rank (bytes; p = gather dtype size, g = its gradient's size = p, 4 = the fp32 reduce
    buffer; U_root = wte + wpe + ln_f, U_blk = one Block). The peak is at the end of backward, when the
    root (the largest unit, thanks to the tied 50304 x C embedding) is reduced:
      persistent     16 P / N                       fp32 slices + their grads + AdamW m, v
      ZeRO-3         + (p + g + 4) U_root           root gathered since forward; its full gradient (the
                                                    head's part waits in autograd since the head's
                                                    backward); the fp32 reduce-scatter buffer
                     + 4 U_blk                      block 0's reduce-scatter still in flight
      SHARD_GRAD_OP  + (p + g) U_root + max(p L U_blk + (g + 4) U_blk,  4 U_root + 4 U_blk)
                                                    (all L blocks stay gathered until their backward)
      + activations, counted separately (they scale with B x T, the rest does not).
      GPT-2 124M, N = 8, bf16 gathers (p = g = 2): 16P/N = 249 MB; ZeRO-3 593 MB; SHARD_GRAD_OP 619 MB;
      fp32 gathers (p = g = 4): 750 MB and 961 MB. "16P/N + the largest gathered unit" (328 MB) misses
      the root's full gradient and the fp32 buffer. report() prints this formula at step 0 (beside
      the measured peak on CUDA); tests/bench_fsdp2.py prints it beside the measured peak of fsdp2.py
      and of fully_shard.

    Precision. With --dtype bfloat16 (the CUDA default) every parameter is gathered in bf16, as
    fully_shard's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) does: the embedding
    output, the LayerNorms and the whole residual stream are then bf16 (gpt2.py and ddp.py keep them
    fp32 under autocast), and each rank's full gradients are bf16 before the fp32 reduce-scatter. It is
    not lossless: the loss curve moves away from gpt2.py's bf16 curve (tests/test_fsdp2.py measures
    by how much). The fp32 master slices and AdamW stay fp32.

Launch:
    torchrun --nproc_per_node=2 fsdp2.py --batch-size 4          # tiny, CPU: = gpt2.py train --batch-size 8
    torchrun --nproc_per_node=2 fsdp2.py --batch-size 4 --reshard-after-forward 0      # SHARD_GRAD_OP
    torchrun --nproc_per_node=8 fsdp2.py --model gpt2 --data data/fineweb10B --batch-size 16 --grad-accum 4 \\
        --seq-len 1024 --steps 19073 --warmup 700 --lr 6e-4 --compile             # the 124M speedrun setting
    torchrun --nproc_per_node=2 tests/bench_fsdp2.py          # ours against fully_shard, same run

References: Rajbhandari et al. 2020, ZeRO (section 5: the P_os, P_g, P_p stages; section 7: their
communication volume); Zhao et al. 2023, PyTorch FSDP (sections 3-4: units, sharding, prefetch);
PyTorch's FSDP2 (per-parameter dim-0 sharding, torch/distributed/fsdp/_fully_shard); torchtitan.
"""
import math
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import gpt2
from gpt2 import print0


# ----------------------------------------------------------------------------------------------------
# A unit: its parameters sharded on dim 0, gathered and reduce-scattered as one flat buffer


def free_storage(t):
    """Release a tensor's memory but keep the tensor object: autograd saved it (as a matmul operand)
    in forward, and in backward it must find the same object refilled by a new all-gather."""
    t.untyped_storage().resize_(0)


class ShardedUnit:
    """The parameters of one module group, each cut into `world` row-slices. Per parameter:
    shard (fp32 nn.Parameter, this rank's rows, what AdamW updates) and full (the model's parameter,
    the gathered rows in the compute dtype, whose memory exists only while the unit is gathered)."""

    def __init__(self, name, params, ctx, param_dtype, comm):
        self.name, self.world, self.comm, self.device = name, ctx.world, comm, ctx.device
        self.param_dtype = param_dtype
        self.shapes = [p.shape for p in params]
        self.rows = [math.ceil(p.shape[0] / ctx.world) for p in params]  # rows per rank
        self.shards, self.padded, self.full = [], [], []
        for p, r in zip(params, self.rows):
            padded = torch.zeros((r * ctx.world, *p.shape[1:]), dtype=torch.float32, device=ctx.device)
            padded[: p.shape[0]] = p.detach()
            self.shards.append(nn.Parameter(padded[ctx.rank * r: (ctx.rank + 1) * r].clone()))
            # the gathered tensor keeps the padding rows so the copy-out is one strided copy; the
            # model sees only the first R rows, a view of the same storage
            self.padded.append(torch.empty_like(padded, dtype=param_dtype))
            self.full.append(nn.Parameter(self.padded[-1][: p.shape[0]]))
            free_storage(self.padded[-1])
        self.numels = [s.numel() for s in self.shards]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]  # in the flat buffer
        self.shard_numel = sum(self.numels)
        self.gathered, self.gather_work, self.gather_buf = False, None, None
        self.grads_ready = 0

    # -- all-gather ------------------------------------------------------------------------------
    def all_gather_shards(self, dtype, async_op):
        """One collective for the whole unit: in = my slices back to back; out = (world, shard_numel),
        row k = rank k's slices, in the same order."""
        with torch.no_grad():
            flat = torch.cat([s.reshape(-1) for s in self.shards]).to(dtype)
        out = torch.empty(self.world * self.shard_numel, dtype=dtype, device=self.device)
        work = gpt2.all_gather_single(out, flat, async_op=async_op)
        self.comm.all_gather(out.nbytes, self.world)
        return work, out.view(self.world, self.shard_numel)

    def unpack(self, i, gathered):
        """Parameter i's columns of the gathered buffer as (world * rows, ...): rank-major rows."""
        off, n = self.offsets[i], self.numels[i]
        return gathered[:, off: off + n].reshape(-1, *self.shapes[i][1:])

    def start_gather(self):
        """Issue the all-gather and return at once (the prefetch); unshard() waits for it."""
        if not self.gathered and self.gather_work is None:
            self.gather_work, self.gather_buf = self.all_gather_shards(self.param_dtype, async_op=True)

    def unshard(self):
        if self.gathered:
            return
        self.start_gather()
        self.gather_work.wait()
        for padded, off, n in zip(self.padded, self.offsets, self.numels):
            padded.untyped_storage().resize_(padded.numel() * padded.element_size())
            # .data: refill without bumping autograd's version counter, or backward would reject
            # the saved tensor as "modified in place" (the values are the same weights as before)
            padded.data.view(self.world, n).copy_(self.gather_buf[:, off: off + n])
        self.gathered, self.gather_work, self.gather_buf = True, None, None

    def reshard(self):
        for padded in self.padded:
            free_storage(padded)
        self.gathered = False

    # -- reduce-scatter --------------------------------------------------------------------------
    def reduce_scatter_grads(self):
        """Lay the full gradients out like the gathered buffer (row k = the rows rank k owns), in
        fp32 whatever the compute dtype, and sum them across ranks into this rank's rows only."""
        buf = torch.zeros(self.world, self.shard_numel, dtype=torch.float32, device=self.device)
        for p, r, off, n in zip(self.full, self.rows, self.offsets, self.numels):
            g = p.grad
            if g.size(0) < r * self.world:  # padding rows get zero gradient
                g = torch.cat([g, g.new_zeros(r * self.world - g.size(0), *g.shape[1:])])
            buf[:, off: off + n].view(self.world, r, *g.shape[1:]).copy_(g.view(self.world, r, *g.shape[1:]))
            p.grad = None
        out = torch.empty(self.shard_numel, dtype=torch.float32, device=self.device)
        work = gpt2.reduce_scatter_single(out, buf.view(-1), op=dist.ReduceOp.SUM, async_op=True)
        self.comm.reduce_scatter(buf.nbytes, self.world)
        return work, out, buf

    def accumulate_grads(self, out):
        """Add the reduced slice (averaged over ranks, like DDP) into each shard's .grad."""
        out /= self.world
        for s, piece in zip(self.shards, out.split(self.numels)):
            if s.grad is None:
                s.grad = piece.view_as(s)  # a view: the reduced buffer becomes the gradient, no copy
            else:
                s.grad += piece.view_as(s)


# ----------------------------------------------------------------------------------------------------
# The sharded model: forward with prefetch, backward hooks that re-gather and reduce-scatter


class FullyShardedGPT:
    """gpt2.GPT cut into units: root (wte = lm_head, wpe, ln_f) and one per Block. The model's own
    modules still run the arithmetic; only their parameters are swapped for gathered ones."""

    def __init__(self, model, ctx, args, comm):
        self.model, self.ctx, self.comm = model, ctx, comm
        self.reshard_after_forward = bool(args.reshard_after_forward)
        # with bf16 autocast (CUDA's default, or --dtype bfloat16), gather bf16 copies (half the
        # bytes) and keep fp32 masters; gradients are reduced in fp32 either way: FSDP2's
        # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        param_dtype = ctx.dtype
        groups = [("root", [model.wte, model.wpe, model.ln_f, model.lm_head])]
        groups += [(f"h.{i}", [block]) for i, block in enumerate(model.h)]
        self.units, to_full = [], {}
        for name, modules in groups:
            params = list({id(p): p for m in modules for p in m.parameters()}.values())  # the tie once
            unit = ShardedUnit(name, params, ctx, param_dtype, comm)
            self.units.append(unit)
            for p, full in zip(params, unit.full):
                to_full[id(p)] = (full, unit)
        for m in model.modules():  # swap every reference, so lm_head.weight is wte.weight again
            for k, p in m._parameters.items():
                if p is not None:
                    m._parameters[k] = to_full[id(p)][0]
        # post-backward: when the last parameter of a unit has its full gradient, reduce-scatter it
        for full, unit in to_full.values():
            full.register_post_accumulate_grad_hook(partial(self._post_backward, unit))
        self.root, self.blocks = self.units[0], self.units[1:]
        self.block_fns = [torch.compile(b) if args.compile else b for b in model.h]
        self.head_loss = torch.compile(model.head_loss) if args.compile else model.head_loss
        self.pending_rs = None  # one reduce-scatter in flight at a time bounds the gradient memory
        self.max_gathered_blocks = 0  # measured: how many Block units were ever gathered at once

    def shards(self):
        return [s for u in self.units for s in u.shards]

    def _count_gathered(self):
        alive = sum(u.gathered or u.gather_work is not None for u in self.blocks)
        self.max_gathered_blocks = max(self.max_gathered_blocks, alive)

    def forward(self, idx, targets):
        """embed -> blocks -> head, unit by unit. The root is gathered once and kept to the head
        (and through its backward), as FSDP2 does with its root: re-gathering wte for the head
        would cost a full embedding all-gather without lowering the memory peak, which is at the head."""
        training = torch.is_grad_enabled()
        self.root.unshard()
        self.blocks[0].start_gather()  # prefetch: block 0's gather overlaps the embedding
        x = self.model.embed(idx)
        for i, (unit, block) in enumerate(zip(self.blocks, self.block_fns)):
            unit.unshard()
            if i + 1 < len(self.blocks):
                self.blocks[i + 1].start_gather()  # prefetch the next unit while this one computes
            self._count_gathered()
            if self.model.activation_checkpointing and training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
            if training:
                # the gradient of a block's output arrives just before the block's backward runs
                x.register_hook(partial(self._pre_backward, i))
            if self.reshard_after_forward or not training:
                unit.reshard()
        loss = self.head_loss(x, targets)
        if not training:
            self.root.reshard()
        return loss

    def _pre_backward(self, i, grad):
        self.blocks[i].unshard()  # ZeRO-3: waits for the prefetched gather; SHARD_GRAD_OP: still gathered
        if i > 0:
            self.blocks[i - 1].start_gather()  # backward runs the units in reverse: prefetch i-1
        self._count_gathered()

    def _post_backward(self, unit, _param):
        unit.grads_ready += 1
        if unit.grads_ready < len(unit.full):
            return
        unit.grads_ready = 0
        rs = unit.reduce_scatter_grads()
        unit.reshard()  # the full weights are no longer needed; the grads now live in rs's buffer
        self.finish_reduce_scatter()  # wait for the previous unit's reduce-scatter, which ran meanwhile
        self.pending_rs = (unit, rs)

    def finish_reduce_scatter(self):
        if self.pending_rs is not None:
            unit, (work, out, _buf) = self.pending_rs
            work.wait()
            unit.accumulate_grads(out)
            self.pending_rs = None

    def finish_backward(self):
        self.finish_reduce_scatter()
        stuck = [u.name for u in self.units if u.gathered or u.grads_ready]
        if stuck:
            raise RuntimeError(f"units {stuck} did not finish backward (a parameter got no gradient?)")

    def clip_grad_norm_(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model: each rank holds disjoint rows of every
        gradient (padding rows are zero), so the global sum of squares is one all_reduce away."""
        grads = [s.grad for s in self.shards()]
        sq = torch.stack([g.float().square().sum() for g in grads]).sum()
        dist.all_reduce(sq)
        self.comm.all_reduce(sq.nbytes, self.ctx.world)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return norm

    def full_state_dict(self):
        """Every parameter gathered in fp32, on CPU, on rank 0 only (the others return None): the
        layout of gpt2.GPT.state_dict(), so gpt2.py sample / load_for_inference read it."""
        full = {}
        for unit in self.units:  # one unit at a time: a rank never holds more than one gathered unit
            _, gathered = unit.all_gather_shards(torch.float32, async_op=False)
            if self.ctx.master:
                for i, p in enumerate(unit.full):
                    full[id(p)] = unit.unpack(i, gathered)[: unit.shapes[i][0]].cpu()
        if not self.ctx.master:
            return None
        return {k: full[id(p)] for k, p in self.model.named_parameters(remove_duplicate=False)}


# ----------------------------------------------------------------------------------------------------
# Memory and communication against theory


def persistent_mb(fsdp, opt):
    """This rank's persistent bytes: its slices, their gradients and AdamW's m and v (call it after
    opt.step(), before zero_grad, when all three exist)."""
    shards = fsdp.shards()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 1e6
    adam = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return nbytes(shards), nbytes(s.grad for s in shards if s.grad is not None), nbytes(adam)


def memory_formula(fsdp):
    """The docstring's peak per rank without activations, in MB, from this run's real unit sizes
    (padded rows included): persistent fp32 slices + grads + AdamW, then the transient terms at the
    end of backward (ZeRO-3) or at the last block's backward (SHARD_GRAD_OP, if larger)."""
    p = torch.finfo(fsdp.root.param_dtype).bits // 8
    g = p  # autograd gives the gathered parameters gradients of their own dtype
    root = fsdp.root.world * fsdp.root.shard_numel
    blk = max(u.world * u.shard_numel for u in fsdp.blocks)
    persistent = 16 * sum(s.numel() for s in fsdp.shards())
    end = {"gathered": p * root, "full_grads": g * root, "reduce_buffers": 4 * root + 4 * blk}
    if not fsdp.reshard_after_forward:  # SHARD_GRAD_OP: at block L-1's backward every block is still gathered
        mid = {"gathered": p * (root + len(fsdp.blocks) * blk), "full_grads": g * (root + blk), "reduce_buffers": 4 * blk}
        if sum(mid.values()) > sum(end.values()):
            end = mid
    f = {"persistent": persistent, **end}
    f["peak"] = sum(f.values())
    return {k: v / 1e6 for k, v in f.items()}


def activation_mb(loss_fn, fsdp):
    """MB of tensors autograd saves for backward during loss_fn() (one forward), each storage counted
    once, the gathered weights left out (they are the formula's "gathered" term). Runs the backward
    too, so the units end resharded, and drops the gradients it made."""
    weights = {p.untyped_storage()._cdata for u in fsdp.units for p in u.padded}  # stable across refills
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in weights:
            seen[st._cdata] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    fsdp.finish_backward()
    for s in fsdp.shards():
        s.grad = None
    return sum(seen.values()) / 1e6


def report(fsdp, args, ctx, n_total, mem, step_comm_mb):
    """Rank 0's persistent bytes against 16 bytes x params / world, the peak formula of the docstring
    (beside the measured peak on CUDA), and the step's measured traffic against its formula."""
    p_mb, g_mb, o_mb = mem
    f = memory_formula(fsdp)
    n, micro = ctx.world, args.grad_accum
    pbytes = torch.finfo(fsdp.root.param_dtype).bits // 8
    n_root = sum(p.numel() for p in fsdp.root.full)
    gathers = 2 if fsdp.reshard_after_forward else 1
    theory = micro * (n - 1) / n * ((gathers * (n_total - n_root) + n_root) * pbytes + 4 * n_total) / 1e6
    ddp = 2 * (n - 1) / n * 4 * n_total / 1e6  # per micro-step (with no_sync DDP sends it once per step)
    print0(f"memory/rank: params {p_mb:.2f} + grads {g_mb:.2f} + adam {o_mb:.2f} = {p_mb + g_mb + o_mb:.2f} MB "
           f"(theory 16 x {n_total / 1e6:.2f}M / {n} = {16 * n_total / n / 1e6:.2f} MB) | "
           f"at most {fsdp.max_gathered_blocks} of {len(fsdp.blocks)} blocks gathered at once")
    measured = f" | measured peak {torch.cuda.max_memory_allocated(ctx.device) / 1e6:.2f} MB (with activations)" \
        if ctx.device.type == "cuda" else " | CPU: tests/bench_fsdp2.py measures the peak"
    print0(f"peak memory/rank formula: persistent {f['persistent']:.2f} + gathered {f['gathered']:.2f} + full grads "
           f"{f['full_grads']:.2f} + fp32 reduce buffers {f['reduce_buffers']:.2f} = {f['peak']:.2f} MB "
           f"+ activations{measured}")
    print0(f"comm/step: {step_comm_mb:.2f} MB measured | {theory:.2f} MB theory "
           f"({'ZeRO-3' if fsdp.reshard_after_forward else 'SHARD_GRAD_OP'}, root gathered once per micro-step) | "
           f"DDP all-reduce {ddp:.2f} MB per micro-step -> {theory / micro / ddp:.2f}x DDP")


# ----------------------------------------------------------------------------------------------------
# Training: gpt2.train()'s loop, step for step


def train(argv=None):
    p = gpt2.make_parser("Fully sharded data parallel (FSDP2 / ZeRO-3) from all_gather and reduce_scatter.")
    p.add_argument("--reshard-after-forward", type=int, default=1, choices=[0, 1],
                   help="1 = ZeRO-3: free each unit's gathered weights after its forward, gather again for "
                        "backward; 0 = FSDP's SHARD_GRAD_OP (ZeRO-2-like): keep them until the unit's backward "
                        "(less traffic, more memory; still gathered every micro-step, unlike the paper's ZeRO-2)")
    args = p.parse_args(argv)
    # validate before any collective, so bad input fails fast instead of hanging the other ranks
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    gpt2.check_args(args)
    if world < 2:
        gpt2.fail("fsdp2.py shards over several ranks but runs alone", "WORLD_SIZE",
                  "launch it with torchrun --nproc_per_node=N (N >= 2); one process is gpt2.py train")
    cfg = gpt2.model_config(args)
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, cfg.vocab_size)

    ctx = gpt2.setup(args)
    comm = gpt2.CommMeter()
    model = gpt2.build_model(args).to(ctx.device)
    cfg, n_params, n_total = model.config, model.num_params(), model.num_params(non_embedding=False)
    fsdp = FullyShardedGPT(model, ctx, args, comm)  # from here on, each rank holds 1/world of the weights
    # decay 2-D weights only, as gpt2.optimizer_groups (a slice keeps its parameter's number of dims)
    shards = fsdp.shards()
    opt = gpt2.make_adamw([{"params": [s for s in shards if s.dim() >= 2], "weight_decay": args.weight_decay},
                           {"params": [s for s in shards if s.dim() < 2], "weight_decay": 0.0}], args, ctx.device)
    metrics = gpt2.Metrics(args, ctx, cfg, n_params, args.batch_size * args.seq_len * args.grad_accum * ctx.world)
    profiler = gpt2.Profiler(args, ctx)
    print0(f"model {args.model}: {n_params / 1e6:.2f}M non-embedding params | {ctx.world} ranks | "
           f"reshard-after-forward {args.reshard_after_forward} | device {ctx.device} {ctx.dtype}")

    def loss_fn(x, y):
        with ctx.autocast():
            return fsdp.forward(x, y)

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device, after_backward=fsdp.finish_backward)
        if args.grad_clip > 0:
            fsdp.clip_grad_norm_(args.grad_clip)
        opt.step()
        mem = persistent_mb(fsdp, opt) if step == 0 else None
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        comm.all_reduce(loss_sum.nbytes, ctx.world)
        loss_val = loss_sum.item() / ctx.world
        gpt2.check_finite(loss_val, step)
        comm_mb = comm.take_mb()
        metrics.log_step(step, loss_val, lr, comm_mb=comm_mb)
        if step == 0:
            report(fsdp, args, ctx, n_total, mem, comm_mb)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
            comm.take_mb()  # the evaluation's gathers are not part of a training step
    state = fsdp.full_state_dict()
    if ctx.master:
        torch.save({"config": cfg.__dict__, "model": state}, os.path.join(args.out, "model.pt"))
    metrics.plot()
    print0(f"saved {args.out}/model.pt and {args.out}/loss.png")
    return fsdp, opt


if __name__ == "__main__":
    gpt2.run_main(train)
