"""
ddp.py - data parallelism written from torch.distributed calls: every rank holds the whole model,
reads its own slice of the global batch, and the ranks average their gradients before each step;
ZeRO-1 and ZeRO-2 then shard the optimizer state and the gradients over the ranks.

The idea: N ranks run forward and backward on N different micro-batches, then all-reduce (sum,
divided by N) the gradients, so every rank applies the same update to the same weights and the run
is the single-process run on an N-times-larger batch. The cost is moving 2(N-1)/N x (gradient
bytes) per step; the trick is to hide it under backward. Gradients are grouped into ~25 MB buckets
in the reverse order of the parameters (about the order backward produces them), and each bucket's
all-reduce starts asynchronously the moment its last gradient lands (a post-accumulate-grad hook),
while backward keeps computing earlier layers. An all-reduce is a reduce-scatter followed by an
all-gather, which is what ZeRO exploits: with --zero 1 each bucket is only reduce-scattered, rank r
keeps AdamW's moments for slice r alone, updates slice r, and all-gathers the new weights (same bytes,
1/N of the optimizer state). --zero 2 also frees each bucket's buffer once its reduce-scatter is done,
so a rank keeps only its slice of the gradients. DataParallel wraps any nn.Module and
ShardedOptimizer wraps any element-wise torch optimizer, so both work on models that are not GPT-2.

    rank r (of N): whole model | batch rows [r*B, (r+1)*B) | AdamW state: all (plain) or slice r (ZeRO)

    one bucket, 2 ranks    grads  [ s0 | s1 ]   (padded to a multiple of N; a parameter may span slices)
      plain   all-reduce:       [ s0 | s1 ] -> mean on every rank; every rank steps all of it
      ZeRO-1  reduce-scatter:   rank r gets mean(s_r); AdamW on s_r; all-gather weights [ s0 | s1 ]
      ZeRO-2  the same, and the bucket buffer is freed after its reduce-scatter: rank r keeps mean(s_r)

    GPT-2 124M, --bucket-mb 25 (fp32 gradients, 28.3 MB per block): 19 buckets, 3 for every 2 blocks,
    cut inside blocks (backward order: a block's mlp.c_proj first, its ln_1 last)
      b0  21.3 MB  ln_f, h.11 mlp, ln_2, attn.c_proj, attn.c_attn.bias
      b1  16.5 MB  h.11 attn.c_attn.weight, ln_1 | h.10 mlp.c_proj, mlp.c_fc.bias
      b2  18.9 MB  h.10 mlp.c_fc.weight ... ln_1 | h.9 mlp.c_proj.bias
      b3  21.3 MB  h.9 mlp.c_proj.weight ... attn.c_attn.bias           (b1-b3 repeat down to h.0)
      b17 22.0 MB  h.0 mlp.c_fc.weight ... ln_1, wpe
      b18 154.5 MB wte alone (the tied lm_head: bigger than the cap)
    backward  [lm_head][ln_f h.11][h.10][h.9] ... [h.0][wpe][wte]
    comm                 [b0]  [b1][b2][b3] ...  [b16][b17][b18 = wte ..........] wait -> clip -> AdamW
    (the tied wte/lm_head gradient is complete only when the embedding's backward, the very last op,
     has added its share: its bucket, 31% of the bytes, is the one that cannot hide under backward)

GPT-2 124M at 8 ranks (P = 124,475,904, fp32 master weights + AdamW; `python tests/bench_ddp.py
--per-rank-124m`: a real step of these classes on rank 0 of torch's fake process group):
    bytes sent per rank per step, all three: 871.3 MB = 2(N-1)/N x 4P (all-reduce, or reduce-scatter +
        all-gather of the same buckets; --grad-accum k: plain/ZeRO-1 the same, ZeRO-2 (k+1)(N-1)/N x 4P)
    memory per rank, MB   params 4P   grads                        AdamW          total (closed form)
      plain               497.9       497.9 (4P)                   995.8 (8P)     1991.6 (1991.6)
      --zero 1            497.9       497.9 (4P)                   124.5 (8P/N)   1120.3 (1120.3)
      --zero 2            497.9       238.8 (4P/N + b18 = 216.7)   124.5 (8P/N)    861.2 (839.2)
    (ZeRO-2's extra 22.1 MB is b17 still reducing while wte's bucket fills: one bucket in flight)
    activations saved for backward at B=16, T=1024, bf16: 8821 MB per rank (every setup: each rank runs
        the whole model on its rows), plus autocast's bf16 weight copies 247 MB. ZeRO-3 (fsdp2.py) shards
        the 497.9 MB of weights too.

Launch (same flags as `python gpt2.py train`; --batch-size is per rank):
    python gpt2.py prepare shakespeare
    torchrun --nproc_per_node=2 ddp.py --device cpu              # CPU, gloo
    torchrun --nproc_per_node=8 ddp.py --model gpt2 --data data/fineweb10B --seq-len 1024 --batch-size 16 \
        --grad-accum 4 --lr 6e-4 --warmup 700 --steps 19073 --compile       # 0.5M tokens/step, as GPT-2
    torchrun --nproc_per_node=8 ddp.py ... --zero 1              # AdamW state / N   (--zero1 is the same)
    torchrun --nproc_per_node=8 ddp.py ... --zero 2              # and gradients / N
    python gpt2.py sample --init-from out/model.pt

References: Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training" (section 3.2: bucketing, overlap, unused parameters, no_sync); Rajbhandari et al. 2020,
"ZeRO" (section 5.1: P_os = our ZeRO-1, P_os+g = our ZeRO-2; the paper reduces gradients to their
owner, we reduce-scatter flat buckets, the same bytes); Patarasuk & Yuan 2009 (the ring all-reduce
bound); picotron's data_parallel.py.
Uses from gpt2.py: build_model, make_loaders, optimizer_groups, make_adamw, set_lr, evaluate, setup,
CommMeter, Metrics, Profiler, the flat-collective names, fail / check_args / run_main.
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

# ----------------------------------------------------------------------------------------------------
# Flat buckets: the layout both the gradient reduction and the sharded optimizer use


class Bucket:
    """Consecutive parameters laid out end to end in one flat buffer (gradients or weights), padded to
    a multiple of the world size so the buffer cuts into N equal slices: rank r's slice is
    [r*S, (r+1)*S). A parameter's piece of the buffer is a view shaped like the parameter."""

    def __init__(self, params, world):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = math.ceil(self.offsets[-1] / world) * world
        self.slice_numel = self.numel // world
        self.dtype, self.device = params[0].dtype, params[0].device
        self.grads = None  # DataParallel: the flat gradient buffer (ZeRO-2: only while it is being reduced)
        self.shard_grads = None  # ZeRO-2: this rank's averaged slice, kept between backward and step
        self.weights = None  # ShardedOptimizer: the parameters' own storage
        self.work = None  # the collective in flight
        self.ready = [False] * len(params)  # its gradient is in the buffer (this backward)
        self.used = [False] * len(params)  # autograd produced a gradient for it since the last sync

    def view(self, flat, i):
        """Parameter i's piece of a flat buffer, shaped like the parameter."""
        return flat[self.offsets[i]: self.offsets[i + 1]].view_as(self.params[i])

    def nbytes(self):
        return self.numel * self.params[0].element_size()

    def new_buffer(self):
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)


def bucket_params(params, cap_bytes):
    """Cut a parameter list, in its order, into runs of about cap_bytes (a parameter bigger than the cap
    gets a run of its own; cap 0 = one parameter per bucket, inf = one bucket). A bucket holds one dtype
    on one device, since one collective moves one flat tensor."""
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


def unique_params(params):
    """Parameters once each: a tied weight is one Parameter, however many modules hold it."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def group_world():
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


# ----------------------------------------------------------------------------------------------------
# Data parallelism: bucketed all-reduce (or reduce-scatter) overlapped with backward


class DataParallel(nn.Module):
    """Wraps any module and keeps its replicas identical: the same start (a broadcast from rank 0) and
    the same gradients (averaged across ranks) at every optimizer step.

        model = DataParallel(net, bucket_mb=25)                        # zero=1 / 2: see sharded_optimizer
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)           # or ShardedOptimizer(...)
        with model.no_sync(): model(x0).loss.backward()                # micro-steps but the last: local sums
        model(x1).loss.backward()                                      # buckets reduce during this backward
        model.finish_grad_sync(); opt.step(); opt.zero_grad()

    forward is the module's; parameters() and state_dict() are the module's (a checkpoint loads into
    the bare module). bucket_mb=None: one bucket for everything (starts only after backward); 0: one
    bucket per parameter. A tied parameter is one Parameter (autograd sums its uses before its hook
    fires, so it is reduced once, after both); frozen parameters are left out; a parameter that gets no
    gradient on some rank contributes zeros, one that gets none on any rank keeps grad None, exactly as
    in one process (the optimizer then skips it).

    zero=1 (ZeRO-1) and zero=2 (ZeRO-2) need the optimizer from sharded_optimizer(): each bucket is
    reduce-scattered, not all-reduced, straight into the optimizer's pieces. ZeRO-1 keeps the full
    gradient buffer (4P bytes); ZeRO-2 allocates a bucket's buffer when its first gradient lands, and
    frees it as soon as its reduce-scatter has finished: what stays is this rank's slice, 4P/N."""

    def __init__(self, module, bucket_mb=25.0, zero=0, meter=None):
        super().__init__()
        if zero not in (0, 1, 2):
            raise ValueError(f"DataParallel: zero is {zero}, expected 0, 1 or 2")
        self.module, self.zero = module, zero
        self.world, self.rank = group_world()
        self.meter = meter if meter is not None else gpt2.CommMeter()
        self.params = unique_params(p for p in module.parameters() if p.requires_grad)
        if not self.params:
            raise ValueError("DataParallel: the module has no parameter that requires grad")
        self.names = {p: n for n, p in module.named_parameters()}
        taken = [self.names[p] for p in self.params if getattr(p, "_data_parallel", False)]
        if taken:  # two sets of hooks on one parameter would each take its gradient
            raise ValueError(f"DataParallel: {taken[0]} is already in a DataParallel; close() that one first")
        for p in self.params:
            p._data_parallel = True
        self.broadcast_from_rank0()
        # reverse registration order is roughly the order backward finishes the gradients (last layer first)
        cap = math.inf if bucket_mb is None else bucket_mb * 1e6
        self.buckets = [Bucket(run, self.world) for run in bucket_params(list(reversed(self.params)), cap)]
        self.where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.optimizer = None  # ZeRO-1/2: the ShardedOptimizer whose pieces receive the reduced slices
        self.live_grad_bytes, self.peak_grad_bytes = 0, 0  # gradient memory, measured (see track)
        for b in self.buckets:
            if zero < 2:
                b.grads = self.track(b.new_buffer())
            else:
                b.shard_grads = self.track(torch.zeros(b.slice_numel, dtype=b.dtype, device=b.device))
        self.sync, self.next_bucket = True, 0
        self.in_flight, self.blocked_s = 2, 0.0  # ZeRO-2: reduce-scatters allowed in flight; seconds waited on them
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def forward(self, *args, **kwargs):
        if self.zero < 2:
            # let autograd accumulate straight into the bucket (torch DDP's gradient_as_bucket_view):
            # no second copy of a gradient, so the gradients cost 4P bytes, not 4P + the largest one
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

    def track(self, t):
        """Count a gradient buffer just allocated (its bytes leave live_grad_bytes when freed); keeps the peak."""
        self.live_grad_bytes += t.numel() * t.element_size()
        self.peak_grad_bytes = max(self.peak_grad_bytes, self.live_grad_bytes)
        return t

    def broadcast_from_rank0(self):
        """Different seeds or a checkpoint read by one rank must not make the replicas differ."""
        if self.world == 1:
            return
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.detach(), src=0)
                self.meter.broadcast(t.numel() * t.element_size(), self.world)

    def sharded_optimizer(self, params, optimizer_cls, **kwargs):
        """The ShardedOptimizer laid out on this object's buckets, so that a bucket's reduce-scatter
        leaves each rank exactly the gradient slice its optimizer pieces need (needed for zero=1/2)."""
        self.optimizer = ShardedOptimizer(params, optimizer_cls, layout=[b.params for b in self.buckets],
                                          meter=self.meter, **kwargs)
        return self.optimizer

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: the micro-steps before the last only add into p.grad. Averaging is
        linear, so one reduction of the sum at the last micro-step gives the same mean as one per
        micro-step, at 1/grad_accum of the traffic. Not with ZeRO-2: it keeps no full gradient to sum
        into, so it reduce-scatters every micro-step (DeepSpeed refuses no_sync with ZeRO-2 likewise)."""
        if self.zero == 2:
            raise RuntimeError("no_sync with ZeRO-2: call finish_grad_sync after every micro-step instead")
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _grad_ready(self, p):
        """Runs when autograd has written p's whole gradient for this backward (after all its uses)."""
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
        p, dst = b.params[i], None
        if b.grads is None and len(b.params) == 1 and p.grad is not None and p.grad.numel() == b.numel \
                and p.grad.is_contiguous():
            b.grads = self.track(p.grad.view(-1))  # ZeRO-2, a parameter alone: its gradient IS the buffer
            dst = b.grads
        elif b.grads is None:  # ZeRO-2: the buffer exists from the bucket's first gradient to its reduction
            b.grads = self.track(b.new_buffer())
        if dst is None:
            dst = b.view(b.grads, i)
        if p.grad is not None and p.grad.data_ptr() != dst.data_ptr():
            # autograd's own tensor and the bucket coexist for a moment
            autograd_bytes = p.grad.numel() * p.grad.element_size()
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.live_grad_bytes + autograd_bytes)
        if p.grad is None:
            dst.zero_()
        else:
            torch.mul(p.grad.view_as(dst), 1.0 / self.world, out=dst)
        p.grad = None  # the bucket holds it now (set again after the sync)
        b.ready[i] = True

    def _launch_ready_buckets(self):
        """Launch complete buckets strictly in index order: collectives must be issued in the same
        order on every rank, and a rank's hooks may complete buckets in a different order."""
        while self.next_bucket < len(self.buckets) and all(self.buckets[self.next_bucket].ready):
            k = self.next_bucket
            b = self.buckets[k]
            if self.zero == 2 and k >= self.in_flight:  # keep in_flight buckets reducing while the next fills
                t0 = time.perf_counter()
                self._settle(self.buckets[k - self.in_flight], k - self.in_flight)
                self.blocked_s += time.perf_counter() - t0  # backward waits here (bench_ddp.py prints it)
            if self.world > 1 and self.zero:
                # in place: slice r of the buffer receives the mean of slice r over the ranks
                S = b.slice_numel
                b.work = reduce_scatter_single(b.grads[self.rank * S: (self.rank + 1) * S], b.grads, async_op=True)
                self.meter.reduce_scatter(b.nbytes(), self.world)
            elif self.world > 1:
                b.work = dist.all_reduce(b.grads, async_op=True)
                self.meter.all_reduce(b.nbytes(), self.world)
            self.next_bucket += 1

    def _settle(self, b, k):
        """ZeRO-2: wait for bucket k's reduce-scatter, add this rank's slice into the gradient it keeps
        (copy when the optimizer has no gradient for the bucket yet: the first micro-step), free the rest."""
        if b.grads is None:
            return
        if b.work is not None:
            b.work.wait()
            b.work = None
        S = b.slice_numel
        mine = b.grads[self.rank * S: (self.rank + 1) * S]
        if all(s.tensor.grad is None for s in self.optimizer.bucket_shards[k]):
            b.shard_grads.copy_(mine)
        else:
            b.shard_grads.add_(mine)
        self.live_grad_bytes -= b.grads.numel() * b.grads.element_size()
        b.grads = None

    def finish_grad_sync(self):
        """After the last backward of the step (ZeRO-2: after every backward): reduce what is left,
        wait for every bucket, then hand out the averaged gradients - plain: param.grad; ZeRO-1/2: the
        ShardedOptimizer pieces' .grad. The optimizer step comes after this."""
        if self.zero and self.optimizer is None:
            raise RuntimeError(f"ZeRO-{self.zero}: build the optimizer with DataParallel.sharded_optimizer(...)")
        used = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if not b.ready[i]:  # no gradient in this backward: maybe one from no_sync micro-steps
                    self.take_grad(b, i)
                used.append(b.used[i])
        self._launch_ready_buckets()
        # which parameters got a gradient on SOME rank: those that got none anywhere keep grad None
        # (one small all-reduce; torch's DDP does the same with find_unused_parameters=True)
        used = torch.tensor(used, dtype=torch.int32, device=self.params[0].device)
        if self.world > 1:
            dist.all_reduce(used)
            self.meter.all_reduce(used.numel() * used.element_size(), self.world)
        used = iter(used.tolist())
        anywhere = {}
        for k, b in enumerate(self.buckets):
            if self.zero == 2:
                self._settle(b, k)
            elif b.work is not None:
                b.work.wait()
            b.work, b.ready, b.used = None, [False] * len(b.params), [False] * len(b.params)
            for i, p in enumerate(b.params):
                anywhere[p] = next(used) > 0
                if self.zero == 0:
                    p.grad = b.view(b.grads, i) if anywhere[p] else None
        if self.zero:
            for s in self.optimizer.shards:
                b = self.buckets[s.bucket]
                if not anywhere[s.param]:
                    if self.zero == 1:
                        s.tensor.grad = None
                    continue  # ZeRO-2: a gradient from an earlier micro-step of this step stays
                if self.zero == 1:
                    s.tensor.grad = b.grads[s.lo:s.hi]
                else:
                    base = self.rank * b.slice_numel
                    s.tensor.grad = b.shard_grads[s.lo - base: s.hi - base]
        self.next_bucket = 0

    def clip_grad_norm_(self, max_norm):
        """Clip to max_norm on the norm of the GLOBAL gradient (sharded: summed over the ranks' slices)."""
        if self.zero:
            return self.optimizer.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def close(self):
        """Wait for any collective still in flight (none is left pending at interpreter exit), then remove
        the hooks (the module trains alone again)."""
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        for h in self.hooks:
            h.remove()
        for p in self.params:
            p._data_parallel = False


# ----------------------------------------------------------------------------------------------------
# ZeRO-1 as an optimizer: each rank keeps the state of, and updates, 1/N of every flat bucket


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
    any all-reduce), else the slice a fused reducer put on the piece (DataParallel's ZeRO-1/2 path,
    which reduce-scatters straight into it). param_groups are the inner optimizer's (set lr there).

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
        every = unique_params(p for g in groups for p in g["params"])
        self.world, self.rank = group_world()
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
            self.meter.all_gather(b.nbytes(), self.world)
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


# ----------------------------------------------------------------------------------------------------
# Training


def train(args, world, rank):
    cfg = gpt2.model_config(args)
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, cfg.vocab_size)  # raises if a batch does not fit
    ctx = gpt2.setup(args)
    model = gpt2.build_model(args).to(ctx.device)
    cfg = model.config
    meter = gpt2.CommMeter()
    ddp = DataParallel(model, args.bucket_mb, args.zero, meter)
    groups = gpt2.optimizer_groups(model, args.weight_decay)
    if args.zero:
        opt = ddp.sharded_optimizer(groups, lambda pieces: gpt2.make_adamw(pieces, args, ctx.device))
    else:
        opt = gpt2.make_adamw(groups, args, ctx.device)
    if args.compile:
        # compile block by block: each block's backward stays its own graph, so its gradients (and
        # their buckets) are ready while earlier blocks still run backward; one whole-model graph would
        # hand over every gradient at its very end (torch's DDP splits the graph at buckets for this)
        for block in model.h:
            block.compile()
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | {world} ranks | device "
           f"{ctx.device} {ctx.dtype} | {len(ddp.buckets)} buckets of <= {args.bucket_mb:g} MB"
           f"{f' | ZeRO-{args.zero}' if args.zero else ''} | broadcast {meter.take_mb():.1f} MB from rank 0")
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
            last = micro == args.grad_accum - 1
            # plain and ZeRO-1: only the last micro-step communicates (see no_sync); ZeRO-2: every one
            with ddp.no_sync() if not last and args.zero < 2 else contextlib.nullcontext():
                loss = loss_fn(x, y) / args.grad_accum  # the gradient of the mean over all micro-batches
                loss_sum += loss.detach()
                loss.backward()
            if last or args.zero == 2:
                ddp.finish_grad_sync()
        if args.grad_clip > 0:
            ddp.clip_grad_norm_(args.grad_clip)
        opt.step()  # ZeRO: steps this rank's slices, then all-gathers the weights
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
    if args.overlap_steps and world > 1:
        batch = train_loader.next_batch()
        t_buckets, t_one = measure_overlap(model, loss_fn, batch, args.bucket_mb, args.overlap_steps, ctx.device)
        print0(f"overlap: forward+backward+sync {t_buckets * 1e3:.1f} ms with {args.bucket_mb:g} MB buckets vs "
               f"{t_one * 1e3:.1f} ms with one bucket after backward ({t_one / t_buckets:.2f}x)"
               + (" | CPU: gloo's threads share the cores with backward, so buckets may not pay (on GPU NCCL "
                  "runs on its own stream and SMs)" if ctx.device.type == "cpu" else ""))
    # gpt2.run_main destroys the process group: every collective has been waited for and every hook removed


# ----------------------------------------------------------------------------------------------------
# Appendix: measurement (traffic, memory, overlap), argument checks, CLI


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
    weights = ddp.optimizer.buckets if ddp.zero else None
    measured = {"params": (sum(b.nbytes() for b in weights) if weights else 4 * n) / 1e6,
                "grads": ddp.peak_grad_bytes / 1e6, "optim": optimizer_state_mb(opt)}
    sizes, w = [b.nbytes() for b in ddp.buckets], ddp.in_flight + 1
    largest = max(sum(sizes[max(0, k - w + 1): k + 1]) for k in range(len(sizes)))
    closed = {"params": 4 * n / 1e6, "grads": (4 * n if ddp.zero < 2 else 4 * n / world + largest) / 1e6,
              "optim": (8 * n / (world if ddp.zero else 1)) / 1e6}
    return measured, closed


def report(args, world, ddp, opt, comm, device):
    grad_mb = sum(q.numel() * q.element_size() for q in ddp.params) / 1e6
    ring = 2 * (world - 1) / world * grad_mb
    if args.zero == 2:  # one reduce-scatter per micro-step, one all-gather per step
        closed, how = (args.grad_accum + 1) * (world - 1) / world * grad_mb, f"({args.grad_accum}+1)(N-1)/N"
    else:
        closed, how = ring, "2(N-1)/N"
    print0(f"comm per step: {sum(comm) / len(comm):.3f} MB sent per rank | closed form {how} x {grad_mb:.3f} MB "
           f"of gradients = {closed:.3f} MB")
    measured, form = memory_per_rank(ddp, opt)
    setup = f"ZeRO-{args.zero}" if args.zero else "plain"
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
                   help="ZeRO stage: 1 shards AdamW's state over the ranks, 2 also the gradients")
    p.add_argument("--zero1", dest="zero", action="store_const", const=1, help="the same as --zero 1")
    p.add_argument("--overlap-steps", type=int, default=5, help="at the end, time N backward passes with buckets vs "
                                                                "one bucket after backward (0 = skip)")
    args = p.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    validate(args, world)
    train(args, world, rank)


if __name__ == "__main__":
    gpt2.run_main(main)
