"""
fsdp2.py - Fully Sharded Data Parallel (ZeRO-3) from all_gather and reduce_scatter, for GPT-2 or any
nn.Module. Data parallelism keeps the weights, gradients and AdamW's m, v whole on every rank: 16 bytes
per parameter. FSDP cuts every parameter into N row-slices (dim 0, padded to a multiple of N); a rank
keeps its slice of all four: 16/N bytes. A unit (one Block; the root: everything else) is all-gathered
just before it runs and freed right after, in forward and again in backward; its full gradients are
reduce-scattered so each rank keeps the sum of its own rows, and AdamW (elementwise) updates its rows.
The next unit's all-gather is issued before this unit computes (prefetch), so the two can overlap.
A faithful simplification of torch's fully_shard (same slices, units, prefetch order and numbers:
tests/test_fsdp2.py) with no DTensor (a shard is a plain Parameter), no separate CUDA streams (copies
run on the compute stream, collectives on the backend's own) and one flat collective per unit.

    N = 2 ranks, a weight W of R rows, r = ceil(R/2)      rank 0 keeps W[0:r], rank 1 W[r:R] + zero rows
      forward  all_gather(slices) -> full W on both; the Block runs; free W  (next unit's gather in flight)
      backward all_gather W again (prefetched one unit ahead); dW, full size, on both
               reduce_scatter(dW, fp32, sum) -> rank k keeps dW[k r:(k+1) r] / N; free W, dW
      step     grad norm = sqrt(all_reduce(sum of the slices' squares)); AdamW on the slices only

    bytes sent per rank per micro-step, P params, U_root the root's, p the gather dtype's bytes (ring):
      DDP   all_reduce(grads fp32)                                 2 (N-1)/N 4P
      FSDP  gathers (blocks twice, the root once) + reduce_scatter (N-1)/N (p (2P - U_root) + 4P)
            GPT-2 124M: 1.34x DDP with fp32 gathers (p = 4), 0.92x with bf16 gathers (p = 2)
    memory per rank: 16P/N + (2p + 4) U_root + 4 U_blk + activations, at the end of backward: the root
      gathered, its gradient, its fp32 reduce buffer and block 0's (two reduce-scatters are in flight).

Launch:  torchrun --nproc_per_node=2 fsdp2.py --batch-size 4 --out out/fsdp2   # = gpt2.py train --batch-size 8
References: Rajbhandari et al. 2020, ZeRO (sec. 5: P_os+g+p; sec. 7: communication volume); Zhao et al.
2023, PyTorch FSDP (sec. 3-4: units, sharding, prefetch, hybrid sharding); torch's FSDP2 (fully_shard).
Uses from gpt2.py: build_model, make_loaders, make_adamw, set_lr, accumulate_grads, evaluate, setup, run_main.
"""
import math
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

import gpt2

# the three collectives of this file (the appendix wraps them to count their bytes)
all_gather, reduce_scatter, all_reduce = gpt2.all_gather_single, gpt2.reduce_scatter_single, dist.all_reduce


def hook_outputs(out, hook):
    for t in out if isinstance(out, (tuple, list)) else [out]:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(hook)


class ShardedUnit:
    """One unit's parameters, each cut into S row-slices over `group`. W with R = 5 rows, S = 2, r = 3:
        shard   rank 0 [w0 w1 w2]   rank 1 [w3 w4 0]   r rows, fp32 Parameter: what the optimizer updates
        padded  both   [w0 w1 w2 | w3 w4 0]            S r rows, all_gather's output; memory only when gathered
        full    both   [w0 w1 w2   w3 w4]              padded[:R], a view: the parameter the model computes with"""

    def __init__(self, params, group, param_dtype):
        self.group, self.param_dtype, self.device = group, param_dtype, params[0].device
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.shapes = [p.shape for p in params]
        self.rows = [math.ceil(p.shape[0] / self.world) for p in params]  # rows per rank
        self.shards, self.padded, self.full = [], [], []
        for p, r in zip(params, self.rows):
            mine = p.detach()[rank * r: (rank + 1) * r]  # the last ranks' rows may run short: pad with zeros
            shard = torch.zeros((r, *p.shape[1:]), dtype=torch.float32, device=self.device)
            shard[: mine.size(0)] = mine
            self.shards.append(nn.Parameter(shard, requires_grad=p.requires_grad))
            self.padded.append(torch.empty((r * self.world, *p.shape[1:]), dtype=param_dtype, device=self.device))
            self.full.append(nn.Parameter(self.padded[-1][: p.shape[0]], requires_grad=p.requires_grad))
            self.padded[-1].untyped_storage().resize_(0)
        self.numels = [s.numel() for s in self.shards]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]  # in the flat buffer
        self.shard_numel = sum(self.numels)
        self.gathered, self.gather_work, self.gather_buf = False, None, None
        self.grads_ready, self.had_grad = 0, [False] * len(params)

    def all_gather_shards(self, dtype, async_op):
        """One collective for the whole unit: my slices back to back in; (S, shard_numel) out, row k = rank k's."""
        with torch.no_grad():
            flat = torch.cat([s.reshape(-1) for s in self.shards]).to(dtype)
        out = torch.empty(self.world * self.shard_numel, dtype=dtype, device=self.device)
        work = all_gather(out, flat, group=self.group, async_op=async_op)
        return work, out.view(self.world, self.shard_numel)

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
            # .data: same weights, no version bump, or backward would reject the tensor it saved as modified
            padded.data.view(self.world, n).copy_(self.gather_buf[:, off: off + n])
        self.gathered, self.gather_work, self.gather_buf = True, None, None

    def reshard(self):
        for padded in self.padded:  # free the memory, keep the tensor: autograd saved it in forward
            padded.untyped_storage().resize_(0)  # and in backward finds it refilled by unshard()
        self.gathered = False

    def reduce_scatter_grads(self):
        """Lay the full gradients out as the gathered buffer (row k = rank k's rows), fp32, and sum them
        into each rank's rows (async). A parameter unused on every rank adds zeros and keeps no gradient."""
        buf = torch.zeros(self.world, self.shard_numel, dtype=torch.float32, device=self.device)
        for i, (p, r, off, n) in enumerate(zip(self.full, self.rows, self.offsets, self.numels)):
            self.had_grad[i] = p.grad is not None
            if p.grad is None:
                continue
            dst = buf[:, off: off + n].view(self.world, r, *self.shapes[i][1:])
            for k in range(self.world):  # rank k's rows; the padding rows stay zero
                rows = p.grad[k * r: (k + 1) * r]
                dst[k, : rows.size(0)].copy_(rows)
            p.grad = None
        out = torch.empty(self.shard_numel, dtype=torch.float32, device=self.device)
        work = reduce_scatter(out, buf.view(-1), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return work, out, buf

    def accumulate_grads(self, out):
        """Average over all data-parallel ranks (like DDP) and add into each shard's .grad."""
        out /= dist.get_world_size()
        for s, piece, had in zip(self.shards, out.split(self.numels), self.had_grad):
            if had:
                s.grad = piece.view_as(s) if s.grad is None else s.grad + piece.view_as(s)  # first: a view, no copy


class FullyShardedModel(nn.Module):
    """`module` sharded unit by unit, used like fully_shard: fsdp(x, ...) runs forward_fn (default module)
    with the gathered parameters swapped in; parameters() are this rank's shards (.grad set when backward
    ends); .module is the model. units: in the order forward runs them (prefetch follows it, backward its
    reverse), by default the blocks of the model's first nn.ModuleList; the root (the other parameters)
    stays gathered through forward and backward, as in FSDP2. A tied weight sits in one unit or the root.
        fsdp = FullyShardedModel(model); opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        fsdp(x, y).backward(); opt.step(); opt.zero_grad()"""
    unit_type = ShardedUnit

    def __init__(self, module, units=None, group=None, param_dtype=torch.float32, forward_fn=None):
        super().__init__()
        # plain attributes, the model not a submodule: parameters() yields the shards only
        self.__dict__.update(module=module, forward_fn=forward_fn or module, group=group, param_dtype=param_dtype)
        if units is None:
            units = next((list(m) for m in module.modules() if isinstance(m, nn.ModuleList)), [])
        groups = [list(m.parameters()) for m in units]  # a tie inside a unit is listed once
        owned = {id(p) for params in groups for p in params}
        if not all(groups) or len(owned) < sum(map(len, groups)):
            raise ValueError("a unit holds no parameters, or shares one with another unit (tie inside one, or root)")
        rest = [p for p in module.parameters() if id(p) not in owned]
        self.root = self.unit_type(rest, group, param_dtype) if rest else None
        self.units = [self.unit_type(params, group, param_dtype) for params in groups]
        self.all_units = [self.root] * bool(rest) + self.units
        self.shard_params = nn.ParameterList(s for u in self.all_units for s in u.shards)
        to_full = {}
        for unit, params in zip(self.all_units, [rest] * bool(rest) + groups):
            for p, full in zip(params, unit.full):
                to_full[id(p)] = full
                if p.requires_grad:  # post-backward: when a unit's last gradient lands, reduce-scatter it
                    full.register_post_accumulate_grad_hook(partial(self._post_backward, unit))
        for m in module.modules():  # swap every reference, so a tied weight is one tensor again
            for k, p in m._parameters.items():
                if p is not None:
                    m._parameters[k] = to_full[id(p)]
        for i, m in enumerate(units):
            m.register_forward_pre_hook(partial(self._pre_forward, i))
            m.register_forward_hook(partial(self._post_forward, i))
        self.pending_rs = None  # the reduce-scatter issued last, waited for when the next one is issued
        self.in_backward = self.end_queued = False  # in backward, a unit's forward is a recomputation

    def forward(self, *args):
        """Gather the root and prefetch the first unit, then run the model: the hooks do the rest."""
        self.in_backward = False
        self.module.train(self.training)  # fsdp.eval() / train() reach the model
        if self.root:
            self.root.unshard()
        if self.units:
            self.units[0].start_gather()  # overlaps whatever runs before the first unit (the embedding)
        out = self.forward_fn(*args)
        if torch.is_grad_enabled():
            hook_outputs(out, self._backward_starts)
        elif self.root:
            self.root.reshard()
        return out

    def _backward_starts(self, grad):
        self.in_backward = True
        if not self.end_queued:  # the engine calls finish_backward once, when this backward is done
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self.end_queued = True

    def _pre_forward(self, i, module, args):
        self.units[i].unshard()  # waits for the prefetched gather
        if self.in_backward:
            return  # recomputation (activation checkpointing): backward goes the other way, no prefetch
        if i + 1 < len(self.units):
            self.units[i + 1].start_gather()  # prefetch the next unit while this one computes

    def _post_forward(self, i, module, args, output):
        if self.in_backward:
            return  # recomputation: the weights stay for the backward that asked for them
        if torch.is_grad_enabled():  # the gradient of a unit's output arrives just before its backward
            hook_outputs(output, partial(self._pre_backward, i))
        self.after_forward(self.units[i])

    def after_forward(self, unit):
        unit.reshard()  # ZeRO-3: free the full weights now, gather them again for backward

    def _pre_backward(self, i, grad):
        self.in_backward = True
        self.units[i].unshard()  # waits for the prefetched gather
        if i > 0:
            self.units[i - 1].start_gather()  # backward runs the units in reverse: prefetch i-1

    def _post_backward(self, unit, _param):
        unit.grads_ready += 1
        if unit.grads_ready == sum(p.requires_grad for p in unit.full):
            self._reduce(unit)

    def _reduce(self, unit):
        unit.grads_ready = 0
        rs = unit.reduce_scatter_grads()
        unit.reshard()  # the full weights are no longer needed; the grads now live in rs's buffer
        self.wait_reduce_scatter()  # the previous unit's, which ran while this unit's backward computed
        self.pending_rs = (unit, rs)

    def wait_reduce_scatter(self):
        if self.pending_rs is not None:
            unit, (work, out, _buf) = self.pending_rs
            work.wait()
            unit.accumulate_grads(out)
            self.pending_rs = None

    def finish_backward(self):
        """When backward ends, and at the end of a run: reduce the units some of whose parameters got no
        gradient, wait for every collective in flight (none may outlive the run), free what is gathered."""
        self.end_queued = False
        for unit in self.all_units:
            if unit.grads_ready:
                self._reduce(unit)
            if unit.gather_work is not None:
                unit.gather_work.wait()
                unit.gather_work = unit.gather_buf = None
        self.wait_reduce_scatter()
        for unit in self.all_units:
            unit.reshard()


def train(argv=None):
    """gpt2.train()'s loop, step for step; units: each Block, the root wte = lm_head, wpe, ln_f."""
    args = make_parser().parse_args(argv)
    check(args)  # before any collective, so bad input fails fast instead of hanging the other ranks
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, gpt2.model_config(args).vocab_size)
    ctx = gpt2.setup(args)
    model = gpt2.build_model(args).to(ctx.device)  # the full model on every rank, for a moment (notes)
    cfg, n_params = model.config, model.num_params()
    fsdp = shard_gpt(model, args, ctx.dtype)  # = FullyShardedModel(model, forward_fn=...), plus the flags' extensions
    opt = gpt2.make_adamw(gpt2.optimizer_groups(fsdp, args.weight_decay), args, ctx.device)  # a slice keeps its dims
    metrics = gpt2.Metrics(args, ctx, cfg, n_params, args.batch_size * args.seq_len * args.grad_accum * ctx.world)
    profiler = gpt2.Profiler(args, ctx)
    gpt2.print0(f"model {args.model}: {n_params / 1e6:.2f}M non-embedding params | {describe(fsdp, ctx)}")
    METER.take_mb()  # bytes are counted from here

    def loss_fn(x, y):
        with ctx.autocast():
            return fsdp(x, y)

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)  # backward ends reduced
        if args.grad_clip > 0:
            clip_grad_norm_(fsdp, args.grad_clip)
        opt.step()
        all_reduce(loss_sum)
        loss_val = loss_sum.item() / ctx.world
        gpt2.check_finite(loss_val, step)
        comm_mb = METER.take_mb()
        metrics.log_step(step, loss_val, lr, comm_mb=comm_mb)
        if step == 0:
            report(fsdp, opt, args, ctx, comm_mb)  # before zero_grad: the slices' grads and AdamW's state exist
        opt.zero_grad(set_to_none=True)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            fsdp.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            fsdp.train()
            METER.take_mb()  # the evaluation's gathers are not part of a training step
    fsdp.finish_backward()  # nothing in flight when the run ends
    gpt2.check_finite_weights(fsdp.parameters(), args.steps - 1)  # every rank its slices, before any write
    state = full_state_dict(fsdp)
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, state)
    metrics.plot()
    gpt2.print0(f"saved {args.out}/model.pt and {args.out}/loss.png")
    return fsdp, opt

# ---- Beyond the core ----


# The whole model's gradient norm and full weights, as torch.nn.utils.clip_grad_norm_ and (for fully_shard)
# torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True) give them.
def clip_grad_norm_(fsdp, max_norm):
    """The ranks hold disjoint rows of every gradient: the global sum of squares is one all_reduce away."""
    grads = [s.grad for s in fsdp.parameters() if s.grad is not None]
    sq = torch.stack([g.float().square().sum() for g in grads]).sum()
    all_reduce(sq, group=fsdp.group)
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def full_state_dict(fsdp, all_ranks=False):
    """module.state_dict()'s layout, gathered unit by unit in fp32 on CPU: on rank 0 (others: None) or all."""
    full, mine = {}, all_ranks or dist.get_rank() == 0
    for unit in fsdp.all_units:
        _, gathered = unit.all_gather_shards(torch.float32, async_op=False)
        for p, shape, off, n in zip(unit.full, unit.shapes, unit.offsets, unit.numels):  # rank-major rows
            full[id(p)] = gathered[:, off: off + n].reshape(-1, *shape[1:])[: shape[0]].cpu() if mine else None
    return {k: full[id(p)] for k, p in fsdp.module.named_parameters(remove_duplicate=False)} if mine else None


# SHARD_GRAD_OP (torch's ShardingStrategy.SHARD_GRAD_OP, fully_shard(reshard_after_forward=False)): keep each unit's
# full weights from its forward to its backward: one gather per micro-step instead of two, more memory.
# "ZeRO-2-like", but the paper's ZeRO-2 never gathers (its parameters are replicated: ddp.py's territory).
def keep_gathered_until_backward(fsdp):
    fsdp.after_forward = lambda unit: None if torch.is_grad_enabled() else unit.reshard()
    fsdp.keeps_gathered = True
    return fsdp


# HSDP (hybrid sharding, Zhao et al. 2023 sec. 3; fully_shard on a 2-D DeviceMesh): N = R replicas x S shards, rank =
# replica * S + shard. A unit is sharded over the S ranks of its row (the per-unit gathers stay on a
# node's fast links) and its reduced slices are all-reduced across the R rows (only 4P/S bytes between
# nodes). Here that all-reduce blocks when the reduce-scatter is waited for; fully_shard overlaps it.
class ReplicatedShardedUnit(ShardedUnit):
    def accumulate_grads(self, out):
        all_reduce(out, group=self.replicate_group)  # the same rows' sums from the other replicas
        super().accumulate_grads(out)


class HybridShardedModel(FullyShardedModel):
    unit_type = ReplicatedShardedUnit

    def __init__(self, module, replicate, **kw):
        world, rank = dist.get_world_size(), dist.get_rank()
        s = world // replicate  # new_group is collective: every rank creates every group, in the same order
        rows = [dist.new_group(list(range(r * s, (r + 1) * s))) for r in range(replicate)]  # shard groups
        columns = [dist.new_group(list(range(k, world, s))) for k in range(s)]  # replicate groups
        super().__init__(module, group=rows[rank // s], **kw)
        self.replicas = replicate
        for unit in self.all_units:
            unit.replicate_group = columns[rank % s]


# Mixed precision (--mp-policy, with --dtype bfloat16). bf16-gather (default): gather bf16 copies of the
# fp32 slices, reduce fp32, as fully_shard's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32):
# half the gather bytes, but embeddings, LayerNorms and the residual stream become bf16 (gpt2.py keeps
# them fp32 under autocast; 3.3e-5 from it in 4 tiny steps, test_fsdp2). autocast: gather fp32 and let
# autocast cast per op: gpt2.py's numerics (3.4e-6, reduction order only), at twice the gather bytes.
def gather_dtype(args, dtype):
    return torch.bfloat16 if args.mp_policy == "bf16-gather" and dtype == torch.bfloat16 else torch.float32


def shard_gpt(model, args, dtype):
    """train()'s FullyShardedModel for gpt2.GPT with what the flags ask for (dtype: the autocast dtype).
    --compile compiles each Block's forward and the head; the module hooks around them stay eager."""
    if args.compile:
        for block in model.h:
            block.forward = torch.compile(block.forward)
    head_loss = torch.compile(model.head_loss) if args.compile else model.head_loss
    kw = {"forward_fn": lambda idx, targets: head_loss(model.forward_blocks(model.embed(idx)), targets),
          "units": list(model.h), "param_dtype": gather_dtype(args, dtype)}
    fsdp = HybridShardedModel(model, args.replicate, **kw) if args.replicate > 1 else FullyShardedModel(model, **kw)
    if fsdp.root.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # report()'s measured peak is training's, not the full model's
    count_in_flight(fsdp)
    return fsdp if args.reshard_after_forward else keep_gathered_until_backward(fsdp)


# ---- Appendix ----


# Bytes sent, under gpt2.CommMeter's ring convention, counted where the core calls its collectives.
METER = gpt2.CommMeter()


def _metered(collective, kind, nbytes):
    def call(*a, group=None, **k):
        getattr(METER, kind)(nbytes(*a), dist.get_world_size(group))
        return collective(*a, group=group, **k)
    return call


all_gather = _metered(all_gather, "all_gather", lambda out, inp: out.nbytes)
reduce_scatter = _metered(reduce_scatter, "reduce_scatter", lambda out, inp: inp.nbytes)
all_reduce = _metered(all_reduce, "all_reduce", lambda t: t.nbytes)


def count_in_flight(fsdp):
    """Measure the core's claims while it runs: the most units gathered (or being gathered) at once
    (2 with the prefetch: this unit and the next) and the most reduce-scatters in flight at once (2:
    the memory formula's two fp32 reduce buffers: a unit's is issued while the previous one is pending),
    by wrapping each unit's gather and reduce-scatter."""
    fsdp.max_gathered_units = fsdp.max_reduces_in_flight = 0

    def count_gathered():
        alive = sum(u.gathered or u.gather_work is not None for u in fsdp.units)
        fsdp.max_gathered_units = max(fsdp.max_gathered_units, alive)
    for unit in fsdp.units:
        for name in ("start_gather", "unshard"):
            def call(f=getattr(unit, name)):
                f()
                count_gathered()
            setattr(unit, name, call)
    for unit in fsdp.all_units:
        def issue(f=unit.reduce_scatter_grads):
            fsdp.max_reduces_in_flight = max(fsdp.max_reduces_in_flight, 1 + (fsdp.pending_rs is not None))
            return f()
        unit.reduce_scatter_grads = issue
    return fsdp


def describe(fsdp, ctx):
    r = getattr(fsdp, "replicas", 1)
    return (f"{ctx.world} ranks = {r} replicas x {ctx.world // r} shards | reshard-after-forward "
            f"{int(not getattr(fsdp, 'keeps_gathered', False))} | gathers {fsdp.param_dtype} | "
            f"device {ctx.device} {ctx.dtype}")


def persistent_mb(fsdp, opt):
    """This rank's persistent bytes: its slices, their gradients and AdamW's m and v (call it after
    opt.step(), before zero_grad, when all three exist)."""
    shards = list(fsdp.parameters())
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 1e6
    adam = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return nbytes(shards), nbytes(s.grad for s in shards if s.grad is not None), nbytes(adam)


def memory_formula(fsdp):
    """The docstring's peak per rank without activations, in MB, from this run's real unit sizes
    (padded rows included): persistent fp32 slices + grads + AdamW, then the transient terms at the
    end of backward (the root reduced while block 0's reduce-scatter is still in flight: two fp32
    reduce buffers), or in the middle of backward if that is larger (SHARD_GRAD_OP: every unit still
    gathered at the last one's backward; ZeRO-3: a unit gathered, the next prefetched, its gradients
    and the two reduce buffers of the two reduce-scatters in flight)."""
    p = torch.finfo(fsdp.param_dtype).bits // 8
    g = p  # autograd gives the gathered parameters gradients of their own dtype
    root = fsdp.root.world * fsdp.root.shard_numel if fsdp.root else 0
    blk = max(u.world * u.shard_numel for u in fsdp.units)
    end = {"gathered": p * root, "full_grads": g * root, "reduce_buffers": 4 * root + 4 * blk}
    if not getattr(fsdp, "keeps_gathered", False):
        mid = {"gathered": p * (root + 2 * blk), "full_grads": g * (root + blk), "reduce_buffers": 8 * blk}
    else:
        mid = {"gathered": p * (root + len(fsdp.units) * blk), "full_grads": g * (root + blk),
               "reduce_buffers": 4 * blk}
    f = {"persistent": 16 * sum(s.numel() for s in fsdp.parameters()),
         **(mid if sum(mid.values()) > sum(end.values()) else end)}
    f["peak"] = sum(f.values())
    return {k: v / 1e6 for k, v in f.items()}


def comm_formula_mb(fsdp, micro_steps, world):
    """Bytes this rank sends per optimizer step (CommMeter's ring convention), padded sizes: gathers
    (the units twice in ZeRO-3, the root once) and the fp32 reduce-scatter inside the shard group of
    S, the fp32 all-reduce of the reduced slices across the R replicas, and the two 4-byte
    all-reduces of a step (grad norm over S, loss over N)."""
    r = getattr(fsdp, "replicas", 1)
    s = world // r
    p = torch.finfo(fsdp.param_dtype).bits // 8
    root = fsdp.root.world * fsdp.root.shard_numel if fsdp.root else 0
    total = root + sum(u.world * u.shard_numel for u in fsdp.units)
    gathers = 1 if getattr(fsdp, "keeps_gathered", False) else 2
    micro = (s - 1) / s * (p * (gathers * (total - root) + root) + 4 * total) + 2 * (r - 1) / r * 4 * total / s
    return (micro_steps * micro + 2 * (s - 1) / s * 4 + 2 * (world - 1) / world * 4) / 1e6


def activation_mb(loss_fn, fsdp):
    """MB of tensors autograd saves for backward during loss_fn() (one forward), each storage counted
    once, the gathered weights left out (they are the formula's "gathered" term). Runs the backward
    too (the units end resharded, the slices hold their gradients, as after any micro-step)."""
    weights = {p.untyped_storage()._cdata for u in fsdp.all_units for p in u.padded}  # stable across refills
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in weights:
            seen[st._cdata] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    return sum(seen.values()) / 1e6


def report(fsdp, opt, args, ctx, step_comm_mb):
    """Rank 0's persistent bytes against 16 bytes x params / S, the peak formula of the docstring
    (beside the measured peak on CUDA), and the step's measured traffic against its formula."""
    p_mb, g_mb, o_mb = persistent_mb(fsdp, opt)
    f = memory_formula(fsdp)
    n = ctx.world
    s = n // getattr(fsdp, "replicas", 1)
    n_total = sum(math.prod(shape) for u in fsdp.all_units for shape in u.shapes)
    ddp = 2 * (n - 1) / n * 4 * n_total / 1e6  # per micro-step (with no_sync DDP sends it once per step)
    theory = comm_formula_mb(fsdp, args.grad_accum, n)
    gpt2.print0(f"memory/rank: params {p_mb:.2f} + grads {g_mb:.2f} + adam {o_mb:.2f} = {p_mb + g_mb + o_mb:.2f} MB "
           f"(theory 16 x {n_total / 1e6:.2f}M / {s} = {16 * n_total / s / 1e6:.2f} MB) | "
           f"at most {fsdp.max_gathered_units} of {len(fsdp.units)} blocks gathered, "
           f"{fsdp.max_reduces_in_flight} reduce-scatters in flight at once")
    measured = f" | measured peak {torch.cuda.max_memory_allocated(ctx.device) / 1e6:.2f} MB (with activations)" \
        if ctx.device.type == "cuda" else " | CPU: tests/bench_fsdp2.py measures the peak"
    gpt2.print0(f"peak memory/rank formula: persistent {f['persistent']:.2f} + gathered {f['gathered']:.2f} + "
                f"full grads "
           f"{f['full_grads']:.2f} + fp32 reduce buffers {f['reduce_buffers']:.2f} = {f['peak']:.2f} MB "
           f"+ activations{measured}")
    mode = "SHARD_GRAD_OP" if getattr(fsdp, "keeps_gathered", False) else "ZeRO-3"
    hsdp = f", HSDP {n // s} replicas x {s} shards" if n // s > 1 else ""
    gpt2.print0(f"comm/step: {step_comm_mb:.2f} MB measured | {theory:.2f} MB theory ({mode}{hsdp}, root gathered once "
           f"per micro-step) | DDP all-reduce {ddp:.2f} MB per micro-step -> "
           f"{comm_formula_mb(fsdp, 1, n) / ddp:.2f}x DDP")


def make_parser():
    p = gpt2.make_parser("Fully sharded data parallel (FSDP2 / ZeRO-3, HSDP) from all_gather and reduce_scatter.")
    p.add_argument("--reshard-after-forward", type=int, default=1,
                   help="1 = ZeRO-3: free each unit's gathered weights after its forward, gather again for "
                        "backward; 0 = FSDP's SHARD_GRAD_OP (ZeRO-2-like): keep them until the unit's backward "
                        "(less traffic, more memory; still gathered every micro-step, unlike the paper's ZeRO-2)")
    p.add_argument("--mp-policy", default="bf16-gather", choices=["bf16-gather", "autocast"],
                   help="with --dtype bfloat16: bf16-gather = gather bf16 copies, fully_shard's MixedPrecisionPolicy "
                        "(half the gather bytes; embeddings, LayerNorms and residual stream bf16); autocast = gather "
                        "fp32 and let autocast cast per op, gpt2.py's numerics")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: R replicas of S = N/R-way sharding (gather and reduce-scatter inside S ranks, "
                        "gradient all-reduce across R); 1 = plain FSDP")
    return p


def check(args):
    world = int(os.environ.get("WORLD_SIZE", 1))
    gpt2.check_args(args)
    if world < 2:
        gpt2.fail("fsdp2.py shards over several ranks but runs alone", "WORLD_SIZE",
                  "launch it with torchrun --nproc_per_node=N (N >= 2); one process is gpt2.py train")
    gpt2.check_range(args.reshard_after_forward, "--reshard-after-forward", 0, 1,
                     "give 1 (ZeRO-3) or 0 (SHARD_GRAD_OP)")
    gpt2.check_range(args.replicate, "--replicate", 1, todo=f"pick R >= 1 dividing {world} (each replica shards "
                     f"over {world} / R ranks)")
    if world % args.replicate:
        gpt2.fail(f"--replicate {args.replicate} does not divide the {world} ranks", "--replicate",
                  f"pick R >= 1 dividing {world} (each replica shards over {world} / R ranks)")


if __name__ == "__main__":
    gpt2.run_main(train)
