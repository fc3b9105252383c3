"""
ddp.py - data parallelism from torch.distributed calls. N ranks each hold the whole model and run forward and
backward on their own rows of the global batch, then all-reduce (sum / N) the gradients, so every rank applies
the same update to the same weights: the one-process run on an N-times-larger batch (fp32: the losses equal
gpt2.py's to ~1e-7 at first; the summation order compounds, to within 1e-5 over 200 steps). The trick is to
hide the traffic under backward: the gradients lie in ~25 MB flat buckets in reverse parameter order (about
the order backward finishes them), and a bucket's all-reduce starts asynchronously the moment its last
gradient lands (a post-accumulate-grad hook) while backward goes on with earlier layers. With gradient
accumulation the micro-steps but the last skip the sync (no_sync): one reduction of the sum will do.

    rank r of N: whole model | batch rows [r*B, (r+1)*B) | whole optimizer state
    backward   [lm_head][h.11][h.10] ... [h.0][wpe][wte]      hooks fill buckets in this order
    comm                 [b0 all-reduce][b1][b2] ... [b_last]  wait -> clip -> AdamW (the same on every rank)
    (the tied wte/lm_head gradient is complete only after the embedding's backward, the very last op: its
     bucket is the one that cannot hide under backward)

Bytes sent per rank per step: 2(N-1)/N x 4P (ring all-reduce of fp32 gradients, P parameters), once per
step whatever --grad-accum. Memory per rank: 4P params + 4P grads + 8P AdamW = 16P (+ activations).
Beyond the core (after the banner): ZeRO-1 (--zero 1: each rank keeps the optimizer state of 1/N of every
bucket: 4P + 4P + 8P/N) and ZeRO-2 (--zero 2: and only its 1/N of the gradients: 4P + 4P/N + 8P/N + the
buckets in flight), with the same bytes (reduce-scatter + all-gather = all-reduce; but ZeRO-2 has no full
gradient to accumulate into, so it reduce-scatters every micro-step: (k+1)(N-1)/N x 4P at --grad-accum k).

Launch (the flags of `python gpt2.py train`; --batch-size is per rank; CPU: gloo, GPU: NCCL):
    torchrun --nproc_per_node=2 ddp.py --batch-size 4 --out out/ddp     # after `python gpt2.py prepare shakespeare`
    torchrun --nproc_per_node=8 ddp.py --model gpt2 --data data/fineweb10B --seq-len 1024 --batch-size 16 \
        --grad-accum 4 --lr 6e-4 --warmup 700 --steps 19073 --compile [--zero 1|2]   # 0.5M tokens/step, as GPT-2

References: Li et al. 2020, "PyTorch Distributed" (section 3.2: bucketing, overlap with backward, unused
parameters, no_sync); Patarasuk & Yuan 2009 (the ring all-reduce bound); Rajbhandari et al. 2020, "ZeRO"
(section 5.1: P_os, P_os+g); picotron's data_parallel.py. Uses from gpt2.py: build_model, make_loaders,
optimizer_groups, make_adamw, set_lr, evaluate, setup, CommMeter, Metrics, Profiler, check_finite_weights,
save_model, fail, run_main.
"""
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gpt2
from gpt2 import all_gather_single, print0, reduce_scatter_single


class Bucket:
    """Consecutive parameters end to end in one flat buffer; parameter i's piece is view(flat, i). Padded to a
    multiple of N for ZeRO, which cuts it into N slices: rank r's is [r*S, (r+1)*S)."""

    def __init__(self, params, world):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = math.ceil(self.offsets[-1] / world) * world
        self.slice_numel = self.numel // world
        self.dtype, self.device = params[0].dtype, params[0].device
        self.grads, self.work = None, None  # the flat gradient buffer, the collective in flight
        self.ready = [False] * len(params)  # its gradient is in the buffer (this backward)
        self.used = [False] * len(params)  # autograd produced a gradient for it since the last sync

    def view(self, flat, i):
        return flat[self.offsets[i]: self.offsets[i + 1]].view_as(self.params[i])

    def new_buffer(self):
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)


def bucket_params(params, cap_bytes):
    """Cut a parameter list, in order, into runs of about cap_bytes (0: one parameter each, inf: one run); one
    dtype and device per run, since one collective moves one flat tensor."""
    runs, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            runs.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    runs.append(current)
    return runs


class DataParallel(nn.Module):
    """Wraps any module and keeps its replicas identical: the same start (a broadcast from rank 0), the same
    averaged gradients at every step. Use: with model.no_sync(): backward (micro-steps but the last); then
    backward; model.finish_grad_sync(); opt.step(). forward, parameters() and state_dict() are the module's.
    bucket_mb=None: one bucket (it starts only after backward). A tied parameter is reduced once (autograd sums
    its uses before its hook fires); frozen ones are left out; one with no gradient on some rank contributes
    zeros, one with none on any rank keeps grad None, as in one process."""

    def __init__(self, module, bucket_mb=25.0, meter=None):
        super().__init__()
        self.module = module
        self.world, self.rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        self.meter = meter if meter is not None else gpt2.CommMeter()
        self.params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))  # a tied one once
        if not self.params:
            raise ValueError("DataParallel: the module has no parameter that requires grad")
        self.names = {p: n for n, p in module.named_parameters()}
        if any(getattr(p, "_data_parallel", False) for p in self.params):  # two hooks would each take a gradient
            raise ValueError("DataParallel: the module is already in a DataParallel; close() that one first")
        for p in self.params:
            p._data_parallel = True
        if self.world > 1:  # different seeds, or a checkpoint read by one rank, must not make the replicas differ
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.detach(), src=0)
                    self.meter.broadcast(t.numel() * t.element_size(), self.world)
        # reverse registration order is roughly the order backward finishes the gradients (last layer first)
        cap = math.inf if bucket_mb is None else bucket_mb * 1e6
        self.buckets = [Bucket(run, self.world) for run in bucket_params(list(reversed(self.params)), cap)]
        self.where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.peak_grad_bytes = sum(self.allocate(b) for b in self.buckets)  # gradient memory, measured
        self.sync, self.next_bucket = True, 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def allocate(self, b):  # the bucket's gradient buffer, for the whole run; returns its bytes
        b.grads = b.new_buffer()
        return b.grads.nbytes

    def forward(self, *args, **kwargs):
        # autograd accumulates straight into the buckets (torch DDP's gradient_as_bucket_view): grads cost 4P
        for b in self.buckets:
            empty = [i for i, p in enumerate(b.params) if p.grad is None]
            if len(empty) == len(b.params):
                b.grads.zero_()  # after zero_grad: one kernel per bucket, not one per parameter
            for i in empty:
                view = b.view(b.grads, i)
                b.params[i].grad = view if len(empty) == len(b.params) else view.zero_()
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self.module.load_state_dict(state_dict, strict, assign)

    def make_optimizer(self, params, optimizer_cls, **kwargs):
        return optimizer_cls(params, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-steps before the last only add into p.grad: averaging is linear, one reduction of the sum at
        the last micro-step gives the same mean at 1/grad_accum of the traffic."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _grad_ready(self, p):
        # autograd has written p's whole gradient for this backward (after all its uses)
        bucket, i = self.where[p]
        bucket.used[i] = True
        if not self.sync:
            return
        if bucket.ready[i]:
            raise RuntimeError(f"{self.names[p]} received a second gradient after it was reduced: call backward once "
                               f"per micro-step (reentrant checkpointing of a shared weight does this)")
        self.take_grad(bucket, i)
        self._launch_ready_buckets()

    def take_grad(self, b, i):
        """Move parameter i's gradient (if any) into its bucket, divided by N on the way in (a mean, not a sum)."""
        p, dst = b.params[i], b.view(b.grads, i)
        if p.grad is None:
            dst.zero_()
        else:
            torch.mul(p.grad.view_as(dst), 1.0 / self.world, out=dst)
        p.grad = None  # the bucket holds it now (set again after the sync)
        b.ready[i] = True

    def _launch_ready_buckets(self):
        """Complete buckets, strictly in index order: every rank must issue the same collectives in the same
        order, and a rank's hooks may complete buckets in another order."""
        while self.next_bucket < len(self.buckets) and all(self.buckets[self.next_bucket].ready):
            self.launch(self.next_bucket, self.buckets[self.next_bucket])
            self.next_bucket += 1

    def launch(self, k, b):
        if self.world > 1:
            b.work = dist.all_reduce(b.grads, async_op=True)
            self.meter.all_reduce(b.grads.nbytes, self.world)

    def finish_grad_sync(self):
        """After the step's last backward: reduce what is left, wait for every bucket, set p.grad to the mean."""
        used = []
        for b in self.buckets:
            for i in range(len(b.params)):
                if not b.ready[i]:  # no gradient in this backward: maybe one from no_sync micro-steps
                    self.take_grad(b, i)
                used.append(b.used[i])
        self._launch_ready_buckets()
        # who got a gradient on SOME rank (torch DDP's find_unused_parameters): none anywhere keeps grad None
        used = torch.tensor(used, dtype=torch.int32, device=self.params[0].device)
        if self.world > 1:
            dist.all_reduce(used)
            self.meter.all_reduce(used.numel() * used.element_size(), self.world)
        used = iter(used.tolist())
        anywhere = {p: next(used) > 0 for b in self.buckets for p in b.params}
        for k, b in enumerate(self.buckets):
            self.wait(k, b)
            b.ready, b.used = [False] * len(b.params), [False] * len(b.params)
        self.hand_out(anywhere)
        self.next_bucket = 0

    def wait(self, k, b):
        if b.work is not None:
            b.work.wait()
            b.work = None

    def hand_out(self, anywhere):
        for b in self.buckets:
            for i, p in enumerate(b.params):
                p.grad = b.view(b.grads, i) if anywhere[p] else None

    def clip_grad_norm_(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def close(self):
        """Wait for any collective still in flight (none is left pending at exit), remove the hooks."""
        for k, b in enumerate(self.buckets):
            self.wait(k, b)
        for h in self.hooks:
            h.remove()
        for p in self.params:
            p._data_parallel = False


def train(args, world, rank, data_parallel=DataParallel):
    """`gpt2.py train`'s loop on every rank, each on its rows; data_parallel: DataParallel or a ZeRO subclass."""
    cfg = gpt2.model_config(args)
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, cfg.vocab_size)  # raises if a batch does not fit
    ctx = gpt2.setup(args)
    model = gpt2.build_model(args).to(ctx.device)
    cfg, meter = model.config, gpt2.CommMeter()
    ddp = data_parallel(model, args.bucket_mb, meter=meter)
    opt = ddp.make_optimizer(gpt2.optimizer_groups(model, args.weight_decay),
                             lambda groups: gpt2.make_adamw(groups, args, ctx.device))
    if args.compile:
        # block by block: one whole-model graph would hand over every gradient at its end, none to overlap
        for block in model.h:
            block.compile()
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | {world} ranks | {ctx.device} "
           f"{ctx.dtype} | {len(ddp.buckets)} buckets of <= {args.bucket_mb:g} MB | {type(ddp).__name__} | "
           f"broadcast {meter.take_mb():.1f} MB from rank 0")
    metrics = gpt2.Metrics(args, ctx, cfg, model.num_params(), world * args.batch_size * args.seq_len * args.grad_accum)
    profiler = gpt2.Profiler(args, ctx)

    def loss_fn(x, y, net=ddp):
        with ctx.autocast():
            return net(x.to(ctx.device), y.to(ctx.device))[1]

    opt_mb, comm = 0.0, []
    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.grad_accum):
            x, y = train_loader.next_batch()
            with ddp.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                loss = loss_fn(x, y) / args.grad_accum  # the gradient of the mean over all micro-batches
                loss_sum += loss.detach()
                loss.backward()
        ddp.finish_grad_sync()
        if args.grad_clip > 0:
            ddp.clip_grad_norm_(args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:  # the logged loss is the mean over the global batch, as in one process
            dist.all_reduce(loss_sum)
            loss_sum /= world
            meter.all_reduce(loss_sum.element_size(), world)
        loss_val = loss_sum.item()
        gpt2.check_finite(loss_val, step)
        opt_mb = opt_mb or optimizer_state_mb(opt)
        comm.append(meter.take_mb())
        metrics.log_step(step, loss_val, lr, comm_mb=comm[-1], opt_state_mb=opt_mb,
                         grad_peak_mb=ddp.peak_grad_bytes / 1e6)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            ddp.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            ddp.train()
    ddp.close()
    gpt2.check_finite_weights(list(model.parameters()), args.steps - 1, ctx.device)  # every rank: a collective
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, model.state_dict())
    metrics.plot()
    print0(f"saved {args.out}/model.pt and {args.out}/loss.png")
    report(args, world, ddp, opt, comm, ctx.device)
    overlap(args, world, model, loss_fn, train_loader, ctx.device)
    # gpt2.run_main then destroys the process group: every collective was waited for, every hook removed


# ---- Beyond the core ----
# ShardedOptimizer: ZeRO-1 as an optimizer around any element-wise torch optimizer (Rajbhandari et al. 2020,
# section 5.1, P_os): each rank keeps the state of, and updates, 1/N of every flat bucket.
class Shard:
    """The elements [lo, hi) of bucket `bucket` that belong to `param` and to this rank. `tensor` is a
    1-D view of the parameter's storage: the inner optimizer updates it in place, and it carries its
    own .grad (the matching slice of the averaged gradient)."""

    def __init__(self, param, bucket, index, lo, hi, tensor):
        self.param, self.bucket, self.index, self.lo, self.hi, self.tensor = param, bucket, index, lo, hi, tensor


# torch's optimizers whose update of an element reads only that element's gradient and state (and scalars)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
               torch.optim.ASGD)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 (Rajbhandari et al. 2020, section 5.1, P_os) around any element-wise optimizer:

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)   # or param groups
        ... gradients averaged over the ranks (DataParallel, or anything else) ...
        opt.step(); opt.zero_grad()

    The parameters are moved into flat buckets (the Parameter objects stay, only their storage moves),
    each bucket is cut into N slices, and rank r's optimizer_cls sees only the pieces of slice r: it
    keeps their state (AdamW: exp_avg and exp_avg_sq, 8 bytes per element, so 8P/N per rank) and
    updates them in place. step() then all-gathers every bucket, so all ranks hold all the new weights.
    The gradient of a piece is a view of param.grad when the parameter has one (DataParallel plain, or
    any all-reduce), else the slice a fused reducer put on the piece (ZeRO1DataParallel and
    ZeRO2DataParallel below reduce-scatter straight into it). param_groups are the inner optimizer's (set lr there).

    Flat slices are exact only for element-wise rules (AdamW, SGD with momentum, Lion): the update of
    an element depends on that element's history alone, so slice r of the update is the update of slice
    r. A per-matrix rule such as Muon (Newton-Schulz orthogonalizes the whole 2-D update) needs every
    element of a matrix on one rank: it must shard whole parameters (rank r owns matrices, not slices)
    and gather whole updated matrices; a flat slice cuts matrices in pieces and would change the math.
    So does Adafactor (row and column statistics of a matrix: 7.1e-3 off in 3 steps on 2 ranks): any
    optimizer outside ELEMENTWISE is refused in one line unless elementwise=True says it is one."""

    def __init__(self, params, optimizer_cls, layout=None, bucket_mb=25.0, meter=None, elementwise=False, **kwargs):
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer: empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": list(g["params"])} for g in groups]
        every = list(dict.fromkeys(p for g in groups for p in g["params"]))  # a tied one once
        self.world, self.rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        self.meter = meter if meter is not None else gpt2.CommMeter()
        if layout is None:
            layout = bucket_params(every, math.inf if bucket_mb is None else bucket_mb * 1e6)
        if {id(p) for run in layout for p in run} != {id(p) for p in every}:
            raise ValueError("ShardedOptimizer: the layout must hold exactly the parameters given")
        self.buckets = [Bucket(run, self.world) for run in layout]
        self.shards, self.bucket_shards = [], []
        with torch.no_grad():
            for k, b in enumerate(self.buckets):
                b.weights = b.new_buffer()
                mine_lo, mine_hi = self.rank * b.slice_numel, (self.rank + 1) * b.slice_numel
                here = []
                for i, p in enumerate(b.params):
                    b.view(b.weights, i).copy_(p.detach())
                    # swap the storage, keep the Parameter: the module, tied weights, hooks and any
                    # optimizer built before all still point at the same object
                    p.data = b.view(b.weights, i)
                    lo, hi = max(b.offsets[i], mine_lo), min(b.offsets[i + 1], mine_hi)
                    if lo < hi:
                        here.append(Shard(p, k, i, lo, hi, b.weights[lo:hi]))
                self.shards += here
                self.bucket_shards.append(here)
        pieces = {}
        for s in self.shards:
            pieces.setdefault(id(s.param), []).append(s.tensor)
        seen, inner = set(), []
        for g in groups:  # each group keeps its options (weight decay, lr) for its parameters' pieces
            mine = [t for p in g["params"] if id(p) not in seen and not seen.add(id(p)) for t in pieces.get(id(p), [])]
            inner.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine})
        self.optimizer = optimizer_cls(inner, **kwargs)
        if not (elementwise or isinstance(self.optimizer, ELEMENTWISE)):  # e.g. Adafactor factors a matrix's rows
            name = type(self.optimizer).__name__
            gpt2.fail(f"ShardedOptimizer cannot shard {name}: flat slices are exact only for element-wise "
                      f"optimizers ({', '.join(c.__name__ for c in ELEMENTWISE)})", "optimizer_cls",
                      f"use one of those, or pass elementwise=True if {name}'s update of an element reads that "
                      f"element alone")
        super().__init__(every, self.optimizer.defaults)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    def take_grads(self):
        """Point each piece's .grad at its slice of param.grad where the parameter has a full gradient."""
        for s in self.shards:
            if s.param.grad is not None:
                start = self.buckets[s.bucket].offsets[s.index]
                s.tensor.grad = s.param.grad.view(-1)[s.lo - start: s.hi - start]

    def clip_grad_norm_(self, max_norm):
        """Clip on the norm of the GLOBAL gradient: each element is in exactly one rank's pieces, so the
        squared norms are summed over the ranks (torch.nn.utils.clip_grad_norm_'s formula otherwise)."""
        self.take_grads()
        grads = [s.tensor.grad for s in self.shards if s.tensor.grad is not None]
        device = self.buckets[0].device
        sq = torch.zeros((), device=device)
        if grads:
            sq += torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
        if self.world > 1:
            dist.all_reduce(sq)
            self.meter.all_reduce(sq.element_size(), self.world)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.take_grads()
        self.optimizer.step()
        self.all_gather_params()
        return loss

    def all_gather_params(self):
        """Every rank updated its slice of every bucket; one all-gather per bucket, in place, gives each
        replica all of them. (It could instead overlap the next forward, as FSDP's prefetch does.)"""
        if self.world == 1:
            return
        works = []
        for b in self.buckets:
            S = b.slice_numel
            works.append(all_gather_single(b.weights, b.weights[self.rank * S: (self.rank + 1) * S], async_op=True))
            self.meter.all_gather(b.weights.nbytes, self.world)
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none=True):
        """The pieces' gradients and every parameter's, including those with no piece on this rank."""
        self.optimizer.zero_grad(set_to_none)
        for b in self.buckets:
            for p in b.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_dict(self):
        return self.optimizer.state_dict()  # this rank's pieces' state

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state



# ZeRO-1 (Rajbhandari et al. 2020, section 5.1, P_os): reduce-scatter each bucket straight into the
# ShardedOptimizer's pieces; rank r steps slice r and all-gathers the weights (same bytes as an all-reduce).
class ZeRO1DataParallel(DataParallel):
    """DataParallel whose buckets are reduce-scattered, not all-reduced: slice r of each bucket's buffer
    receives the mean of slice r, which is exactly what rank r's pieces of the ShardedOptimizer built by
    make_optimizer (laid out on these buckets) step. Gradients 4P (the full buffers), optimizer state 8P/N."""

    def __init__(self, module, bucket_mb=25.0, meter=None):
        super().__init__(module, bucket_mb, meter)
        self.optimizer = None  # the ShardedOptimizer whose pieces receive the reduced slices

    def make_optimizer(self, params, optimizer_cls, **kwargs):
        """The ShardedOptimizer laid out on these buckets, so a bucket's reduce-scatter leaves each rank
        exactly the gradient slice its pieces need."""
        self.optimizer = ShardedOptimizer(params, optimizer_cls, layout=[b.params for b in self.buckets],
                                          meter=self.meter, **kwargs)
        return self.optimizer

    def launch(self, k, b):
        if self.world > 1:  # in place: slice r of the buffer receives the mean of slice r over the ranks
            S = b.slice_numel
            b.work = reduce_scatter_single(b.grads[self.rank * S: (self.rank + 1) * S], b.grads, async_op=True)
            self.meter.reduce_scatter(b.grads.nbytes, self.world)

    def finish_grad_sync(self):
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: build the optimizer with make_optimizer(...) first")
        super().finish_grad_sync()

    def hand_out(self, anywhere):
        for s in self.optimizer.shards:
            s.tensor.grad = self.buckets[s.bucket].grads[s.lo:s.hi] if anywhere[s.param] else None

    def clip_grad_norm_(self, max_norm):
        return self.optimizer.clip_grad_norm_(max_norm)


# ZeRO-2 (section 5.1, P_os+g): also free each bucket's buffer once its reduce-scatter is done, keeping only
# this rank's averaged slice: gradients 4P/N + the buckets in flight.
class ZeRO2DataParallel(ZeRO1DataParallel):
    """A bucket's buffer is allocated when its first gradient lands and freed when its reduce-scatter has
    finished and this rank's slice is added into shard_grads (kept from backward to step). in_flight
    reduce-scatters run while the next bucket fills (the paper reduces each gradient to its owner; we
    reduce-scatter flat buckets, the same bytes). There is no full gradient to sum micro-steps into, so
    no_sync cannot skip the sync: each micro-step reduce-scatters, (k+1)(N-1)/N x 4P bytes per step for k
    micro-steps (DeepSpeed refuses no_sync with ZeRO-2 instead)."""
    in_flight = 2  # 1: backward waits on the previous bucket's reduce-scatter (bench_ddp.py measures both)

    def __init__(self, module, bucket_mb=25.0, meter=None):
        super().__init__(module, bucket_mb, meter)
        self.live_grad_bytes = self.peak_grad_bytes  # the slices it keeps; buffers come and go (track)
        self.blocked_s = 0.0  # seconds backward waited on a reduce-scatter (bench_ddp.py prints it)

    def allocate(self, b):  # only this rank's slice lives the whole run; the buffer, from take_grad to wait
        b.grads, b.shard_grads = None, torch.zeros(b.slice_numel, dtype=b.dtype, device=b.device)
        return b.shard_grads.nbytes

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)  # autograd's own gradients, moved into a bucket one by one

    @contextlib.contextmanager
    def no_sync(self):
        yield
        self.finish_grad_sync()

    def track(self, t):
        self.live_grad_bytes += t.nbytes
        self.peak_grad_bytes = max(self.peak_grad_bytes, self.live_grad_bytes)
        return t

    def take_grad(self, b, i):
        p = b.params[i]
        if b.grads is None and len(b.params) == 1 and p.grad is not None and p.grad.numel() == b.numel \
                and p.grad.is_contiguous():
            b.grads = self.track(p.grad.view(-1))  # a parameter alone: its gradient IS the buffer
        elif b.grads is None:
            b.grads = self.track(b.new_buffer())
        if p.grad is not None and p.grad.data_ptr() != b.view(b.grads, i).data_ptr():
            # autograd's own tensor and the bucket coexist for a moment
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.live_grad_bytes + p.grad.nbytes)
        super().take_grad(b, i)

    def launch(self, k, b):
        if k >= self.in_flight:  # keep in_flight buckets reducing while the next one fills
            t0 = time.perf_counter()
            self.wait(k - self.in_flight, self.buckets[k - self.in_flight])
            self.blocked_s += time.perf_counter() - t0
        super().launch(k, b)

    def wait(self, k, b):
        """Wait for bucket k's reduce-scatter, add this rank's slice into the gradient it keeps (copy when the
        optimizer has no gradient for the bucket yet: the first micro-step), free the buffer."""
        if b.grads is None:
            return
        super().wait(k, b)
        S = b.slice_numel
        mine = b.grads[self.rank * S: (self.rank + 1) * S]
        if all(s.tensor.grad is None for s in self.optimizer.bucket_shards[k]):
            b.shard_grads.copy_(mine)
        else:
            b.shard_grads.add_(mine)
        self.live_grad_bytes -= b.grads.nbytes
        b.grads = None

    def hand_out(self, anywhere):
        for s in self.optimizer.shards:
            if anywhere[s.param]:  # else: a gradient from an earlier micro-step of this step stays
                b = self.buckets[s.bucket]
                base = self.rank * b.slice_numel
                s.tensor.grad = b.shard_grads[s.lo - base: s.hi - base]


# ---- Appendix ----


def optimizer_state_mb(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)) / 1e6


def memory_per_rank(ddp, opt):
    """Persistent bytes per rank, measured from the tensors our classes allocated, beside the closed form
    (fp32, AdamW; P = parameters, N = ranks): params 4P; grads 4P (plain, ZeRO-1) or 4P/N + the largest
    in_flight + 1 consecutive buckets (ZeRO-2: in_flight buckets reducing when the next one completes);
    AdamW 8P (plain) or 8P/N (ZeRO-1/2).
    grads is the PEAK of the gradient buffers over the run (live_grad_bytes, and autograd's own
    gradient while it is copied into its bucket)."""
    n, world = sum(p.numel() for p in ddp.params), ddp.world
    sharded, zero2 = isinstance(ddp, ZeRO1DataParallel), isinstance(ddp, ZeRO2DataParallel)
    measured = {"params": (sum(b.weights.nbytes for b in ddp.optimizer.buckets) if sharded else 4 * n) / 1e6,
                "grads": ddp.peak_grad_bytes / 1e6, "optim": optimizer_state_mb(opt)}
    sizes, w = [b.numel * b.params[0].element_size() for b in ddp.buckets], getattr(ddp, "in_flight", 0) + 1
    largest = max(sum(sizes[max(0, k - w + 1): k + 1]) for k in range(len(sizes)))
    closed = {"params": 4 * n / 1e6, "grads": (4 * n / world + largest if zero2 else 4 * n) / 1e6,
              "optim": (8 * n / (world if sharded else 1)) / 1e6}
    return measured, closed


def report(args, world, ddp, opt, comm, device):
    grad_mb = sum(q.numel() * q.element_size() for q in ddp.params) / 1e6
    ring = 2 * (world - 1) / world * grad_mb
    if isinstance(ddp, ZeRO2DataParallel):  # one reduce-scatter per micro-step, one all-gather per step
        closed, how = (args.grad_accum + 1) * (world - 1) / world * grad_mb, f"({args.grad_accum}+1)(N-1)/N"
    else:
        closed, how = ring, "2(N-1)/N"
    print0(f"comm per step: {sum(comm) / len(comm):.3f} MB sent per rank | closed form {how} x {grad_mb:.3f} MB "
           f"of gradients = {closed:.3f} MB")
    measured, form = memory_per_rank(ddp, opt)
    setup = {ZeRO1DataParallel: "ZeRO-1", ZeRO2DataParallel: "ZeRO-2"}.get(type(ddp), "plain")
    parts = [f"{k} {measured[k]:.3f} (closed {form[k]:.3f})" for k in measured]
    print0(f"memory per rank ({setup}, MB): " + " | ".join(parts)
           + f" | total {sum(measured.values()):.3f} (closed {sum(form.values()):.3f})")
    if device.type == "cuda":
        print0(f"CUDA peak allocated (with activations): {torch.cuda.max_memory_allocated(device) / 1e6:.1f} MB")


def measure_overlap(model, loss_fn, batch, bucket_mb, steps, device):
    """Seconds per forward+backward+gradient sync with buckets launched during backward, and with one
    bucket holding everything, which can only start when backward has ended (no overlap). The weights
    are not updated."""
    times = []
    for mb in (bucket_mb, None):
        ddp = DataParallel(model, mb)
        for i in range(steps + 1):  # the first one warms up
            if i == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            loss_fn(*batch, net=ddp).backward()
            ddp.finish_grad_sync()
            model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / steps)
        ddp.close()
    return times


def overlap(args, world, model, loss_fn, loader, device):
    """The `overlap:` line: what launching buckets during backward saves over one all-reduce after it."""
    if not args.overlap_steps or world == 1:
        return
    t_buckets, t_one = measure_overlap(model, loss_fn, loader.next_batch(), args.bucket_mb, args.overlap_steps, device)
    print0(f"overlap: forward+backward+sync {t_buckets * 1e3:.1f} ms with {args.bucket_mb:g} MB buckets vs "
           f"{t_one * 1e3:.1f} ms with one bucket after backward ({t_one / t_buckets:.2f}x)"
           + (" | CPU: gloo's threads share the cores with backward, so buckets may not pay (on GPU NCCL "
              "runs on its own stream and SMs)" if device.type == "cpu" else ""))


def validate(args, world):
    """Everything that would otherwise fail inside a collective, checked before the first one."""
    gpt2.check_args(args)  # the shared checks (sizes, --lr, --device, --model), then this file's own
    gpt2.check_range(args.bucket_mb, "--bucket-mb", 0, 1e6, "give 0 (one bucket per parameter) or a size in MB "
                     "(25 is the default; larger than the model: one bucket)")
    gpt2.check_range(args.overlap_steps, "--overlap-steps", 0, 1000, "give 0 (skip) or a few steps, e.g. 5")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if use_cuda and local_world > torch.cuda.device_count():
        gpt2.fail(f"{local_world} processes per node but {torch.cuda.device_count()} GPUs", "--nproc_per_node",
                  f"use --nproc_per_node={torch.cuda.device_count()}")


def main(argv=None):
    p = gpt2.make_parser("Train GPT-2 data-parallel: torchrun --nproc_per_node=N ddp.py (flags of gpt2.py train).")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB (one collective each; "
                                                                 "0 = one bucket per parameter, 1e6 = one bucket)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2), default=0,
                   help="ZeRO stage: 1 shards AdamW's state over the ranks (ZeRO1DataParallel), 2 also the "
                        "gradients (ZeRO2DataParallel)")
    p.add_argument("--overlap-steps", type=int, default=5, help="at the end, time N backward passes with buckets vs "
                                                                "one bucket after backward (0 = skip)")
    args = p.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    validate(args, world)
    train(args, world, rank, (DataParallel, ZeRO1DataParallel, ZeRO2DataParallel)[args.zero])


if __name__ == "__main__":
    gpt2.run_main(main)
