"""
ddp.py - data parallelism written from torch.distributed calls: every rank holds the whole model,
reads its own slice of the global batch, and the ranks average their gradients before each step.

The idea: N ranks run forward and backward on N different micro-batches, then all-reduce (sum,
divided by N) the gradients, so every rank applies the same update to the same weights and the run
is the single-process run on an N-times-larger batch. The cost is moving 2(N-1)/N x (gradient
bytes) per step; the trick is to hide it under backward. Gradients are grouped into ~25 MB buckets
in the reverse order of the parameters (about the order backward produces them), and each bucket's
all-reduce starts asynchronously the moment its last gradient lands (a post-accumulate-grad hook),
while backward keeps computing earlier layers. With --zero1 (ZeRO stage 1) each rank also keeps
the AdamW moments of only 1/N of the weights: the buckets are reduce-scattered instead, each rank
updates its slice, and an all-gather brings the updated weights back to everyone.

    rank r (of N): whole model | batch rows [r*B, (r+1)*B) | AdamW state: all (DDP) or slice r (ZeRO-1)

    GPT-2 124M, --bucket-mb 25: 18 buckets of 16-22 MB (ln_f, h.11 ... h.0, wpe), then wte alone (155 MB)
    backward  [lm_head][ln_f,h.11][h.10][h.9] ... [h.0][wpe][wte]
    comm                  [b0]      [b1] [b2] ...  [b16] [b17][b18 = wte ...........] wait -> clip -> AdamW
    (the tied wte/lm_head gradient is complete only when the embedding's backward, the very last op,
     has added its share: its bucket, 31% of the bytes, is the one that cannot hide under backward)

    ZeRO-1, per bucket:   grads   [ s0 | s1 | .. | sN-1 ]  --reduce-scatter-->  rank r: mean of slice r
                          AdamW on slice r only (exp_avg, exp_avg_sq: 1/N of the state per rank)
                          weights [ s0 | s1 | .. | sN-1 ]  <--all-gather--   rank r's updated slice
    bytes per rank per step: all-reduce 2(N-1)/N x G  =  reduce-scatter (N-1)/N x G + all-gather (N-1)/N x G

Launch (same flags as `python gpt2.py train`; --batch-size is per rank):
    python gpt2.py prepare shakespeare
    torchrun --nproc_per_node=2 ddp.py --device cpu              # CPU, gloo
    torchrun --nproc_per_node=8 ddp.py --model gpt2 --data data/fineweb10B --seq-len 1024 --batch-size 16 \
        --grad-accum 4 --lr 6e-4 --warmup 700 --steps 19000 --compile       # 0.5M tokens/step, as GPT-2
    torchrun --nproc_per_node=8 ddp.py ... --zero1               # AdamW state / N
    python gpt2.py sample --init-from out/model.pt

References: Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training" (section 3.2: bucketing, overlap, unused parameters, no_sync); Rajbhandari et al. 2020,
"ZeRO" (section 5.1, P_os); Patarasuk & Yuan 2009 (the ring all-reduce bound); picotron's
data_parallel.py.
"""
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist

import gpt2
from gpt2 import all_gather_single, print0, reduce_scatter_single

# ----------------------------------------------------------------------------------------------------
# Gradient buckets


class Bucket:
    """Consecutive parameters whose gradients travel in one collective. `grads` is one flat buffer;
    it is padded to a multiple of the world size so ZeRO-1 can cut it into N equal slices."""

    def __init__(self, params, world):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        numel = math.ceil(self.offsets[-1] / world) * world
        self.grads = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.weights = None  # ZeRO-1 only: the parameters' storage, laid out like grads
        self.slices = {}  # ZeRO-1 only: param index -> (1-D view of the weights this rank updates, lo, hi)
        self.work = None  # the in-flight collective
        self.ready = [False] * len(params)

    def view(self, flat, i):
        """Parameter i's piece of a flat buffer, shaped like the parameter."""
        return flat[self.offsets[i]: self.offsets[i + 1]].view_as(self.params[i])

    def nbytes(self):
        return self.grads.numel() * self.grads.element_size()


# ----------------------------------------------------------------------------------------------------
# Data parallelism: bucketed all-reduce overlapped with backward, no-sync accumulation, ZeRO-1


class DataParallel:
    """Keeps the replicas of `module` identical: the same start (a broadcast from rank 0) and the same
    gradients (averaged across ranks) at every optimizer step. Use:

        ddp = DataParallel(model, bucket_mb=25, zero1=False, meter=gpt2.CommMeter())
        opt = ddp.make_optimizer(args, device)
        with ddp.no_sync(): loss.backward()         # all micro-steps but the last: accumulate locally
        loss.backward()                             # the last: buckets all-reduce during backward
        ddp.finish_grad_sync(); ddp.clip_grad_norm_(1.0); opt.step(); ddp.all_gather_params()

    Any module works: a tied parameter is one Parameter (module.parameters() yields it once, and
    autograd sums its uses before its hook fires, so it is reduced once, after both); frozen
    parameters are left out; a parameter that gets no gradient on some rank contributes zeros, and one
    that gets none on any rank keeps grad None, exactly as in one process (AdamW then skips it)."""

    def __init__(self, module, bucket_mb=25.0, zero1=False, meter=None):
        self.module, self.zero1 = module, zero1
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.meter = meter if meter is not None else gpt2.CommMeter()
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("DataParallel: the module has no parameter that requires grad")
        self.names = {p: n for n, p in module.named_parameters()}
        self.broadcast_from_rank0()
        self.buckets = self.make_buckets(bucket_mb * 1e6)
        self.where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.sync, self.next_bucket = True, 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        if zero1:
            self.shard_weights()

    def broadcast_from_rank0(self):
        """Different seeds or a checkpoint read by one rank must not make the replicas differ."""
        if self.world == 1:
            return
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.detach(), src=0)
                self.meter.all_gather(t.numel() * t.element_size(), self.world)  # a pipelined broadcast moves as much

    def make_buckets(self, cap_bytes):
        """Parameters in reverse registration order, which is roughly the order backward finishes
        them (the last layer first), cut into buckets of about cap_bytes. A bucket must hold one dtype
        on one device; a parameter bigger than the cap gets a bucket of its own."""
        buckets, current, size = [], [], 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
                buckets.append(Bucket(current, self.world))
                current, size = [], 0
            current.append(p)
            size += nbytes
        buckets.append(Bucket(current, self.world))
        return buckets

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: the micro-steps before the last only add into p.grad. Averaging is
        linear, so one all-reduce of the sum at the last micro-step gives the same mean as one per
        micro-step, at 1/grad_accum of the traffic."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _grad_ready(self, p):
        """Runs when autograd has written p's whole gradient for this backward (after all its uses)."""
        if not self.sync:
            return
        bucket, i = self.where[p]
        if bucket.ready[i]:
            raise RuntimeError(f"{self.names[p]} received a second gradient after it was reduced: call backward once "
                               f"per micro-step (reentrant checkpointing of a shared weight does this)")
        torch.mul(p.grad, 1.0 / self.world, out=bucket.view(bucket.grads, i))  # average, not sum: divide on the way in
        p.grad = None  # the bucket holds it now: one copy of the gradients, not two
        bucket.ready[i] = True
        self._launch_ready_buckets()

    def _launch_ready_buckets(self):
        """Launch complete buckets strictly in index order: collectives must be issued in the same
        order on every rank, and a rank's hooks may complete buckets in a different order."""
        while self.next_bucket < len(self.buckets) and all(self.buckets[self.next_bucket].ready):
            b = self.buckets[self.next_bucket]
            if self.world > 1 and self.zero1:
                # in place: slice r of the buffer receives the mean of slice r over the ranks
                S = b.grads.numel() // self.world
                b.work = reduce_scatter_single(b.grads[self.rank * S: (self.rank + 1) * S], b.grads, async_op=True)
                self.meter.reduce_scatter(b.nbytes(), self.world)
            elif self.world > 1:
                b.work = dist.all_reduce(b.grads, async_op=True)
                self.meter.all_reduce(b.nbytes(), self.world)
            self.next_bucket += 1

    def finish_grad_sync(self):
        """After the last backward of the step: send what is left, wait for every bucket, then give
        each parameter its averaged gradient (ZeRO-1: each of this rank's slices, its averaged slice)."""
        used = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if not b.ready[i]:  # no gradient in this backward: maybe some from no_sync micro-steps
                    if p.grad is not None:
                        torch.mul(p.grad, 1.0 / self.world, out=b.view(b.grads, i))
                    else:
                        b.view(b.grads, i).zero_()
                    used.append(p.grad is not None)
                    p.grad = None
                    b.ready[i] = True
                else:
                    used.append(True)
        self._launch_ready_buckets()
        # which parameters got a gradient on SOME rank: those that got none anywhere keep grad None
        # (one small all-reduce; torch's DDP does the same with find_unused_parameters=True)
        used = torch.tensor(used, dtype=torch.int32, device=self.params[0].device)
        if self.world > 1:
            dist.all_reduce(used)
            self.meter.all_reduce(used.numel() * used.element_size(), self.world)
        used = iter(used.tolist())
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.ready = None, [False] * len(b.params)
            for i, p in enumerate(b.params):
                u = next(used) > 0
                if not self.zero1:
                    p.grad = b.view(b.grads, i) if u else None
                elif i in b.slices:
                    seg, lo, hi = b.slices[i]
                    seg.grad = b.grads[lo:hi] if u else None
        self.next_bucket = 0

    def clip_grad_norm_(self, max_norm):
        """Clip to max_norm on the norm of the GLOBAL gradient. With replicated gradients every rank
        computes it alone; with ZeRO-1 each rank holds a slice, so the squared norms are summed."""
        if not self.zero1:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        grads = [s.grad for s in self.shard_params() if s.grad is not None]
        sq = torch.zeros((), device=self.params[0].device)
        if grads:  # the per-tensor norms clip_grad_norm_ takes, so one rank computes what it computes
            sq += torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
        if self.world > 1:
            dist.all_reduce(sq)
            self.meter.all_reduce(sq.element_size(), self.world)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # the formula of clip_grad_norm_
        for g in grads:
            g.mul_(coef)
        return norm

    def close(self):
        """Remove the hooks (the module trains alone again)."""
        for h in self.hooks:
            h.remove()

    # ------------------------------------------------------------------------------------------------
    # ZeRO-1: shard the optimizer state (Rajbhandari et al. 2020, section 5.1)

    def shard_weights(self):
        """Move every parameter into a flat per-bucket buffer laid out like the bucket's gradients,
        so slice r of the weights is a plain view that rank r's AdamW updates in place, and one
        all-gather per bucket refreshes all the parameters."""
        for b in self.buckets:
            b.weights = torch.zeros_like(b.grads)
            S = b.grads.numel() // self.world
            mine = (self.rank * S, (self.rank + 1) * S)
            for i, p in enumerate(b.params):
                b.view(b.weights, i).copy_(p.detach())
                # swap the storage, keep the Parameter: the module, the tie wte/lm_head and our hooks
                # all still point at the same object, which now lives in the bucket's buffer
                p.data = b.view(b.weights, i)
                lo, hi = max(b.offsets[i], mine[0]), min(b.offsets[i + 1], mine[1])
                if lo < hi:  # this parameter overlaps my slice: I own these elements' AdamW state
                    b.slices[i] = (b.weights[lo:hi], lo, hi)

    def shard_params(self):
        return [seg for b in self.buckets for seg, _, _ in b.slices.values()]

    def make_optimizer(self, args, device):
        """AdamW over the whole model (DDP) or over this rank's slices (ZeRO-1). AdamW is elementwise,
        so updating a slice is updating those elements of the whole; weight decay goes to 2-D weights
        only, the rule of gpt2.optimizer_groups."""
        if not self.zero1:
            return gpt2.make_adamw(gpt2.optimizer_groups(self.module, args.weight_decay), args, device)
        decay, no_decay = [], []
        for b in self.buckets:
            for i, (seg, _, _) in b.slices.items():
                (decay if b.params[i].dim() >= 2 else no_decay).append(seg)
        return gpt2.make_adamw([{"params": decay, "weight_decay": args.weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}], args, device)

    def all_gather_params(self):
        """After opt.step(): each rank updated its slice; gather all slices into every replica. (It
        could instead overlap the next forward, bucket by bucket, as FSDP's prefetch does.)"""
        if not self.zero1 or self.world == 1:
            return
        works = []
        for b in self.buckets:
            S = b.weights.numel() // self.world
            works.append(all_gather_single(b.weights, b.weights[self.rank * S: (self.rank + 1) * S], async_op=True))
            self.meter.all_gather(b.nbytes(), self.world)
        for w in works:
            w.wait()


def optimizer_state_mb(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)) / 1e6


# ----------------------------------------------------------------------------------------------------
# Overlap measurement


def measure_overlap(model, loss_fn, batch, bucket_mb, steps, device):
    """Seconds per forward+backward+gradient sync with buckets launched during backward, and with one
    bucket holding everything, which can only start when backward has ended (no overlap). The weights
    are not updated."""
    times = []
    for mb in (bucket_mb, float("inf")):
        ddp = DataParallel(model, mb)
        for i in range(steps + 1):  # the first one warms up
            if i == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            loss_fn(*batch).backward()
            ddp.finish_grad_sync()
            model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / steps)
        ddp.close()
    return times


# ----------------------------------------------------------------------------------------------------
# Training


def validate(args, world):
    """Everything that would otherwise fail inside a collective, checked before the first one."""
    gpt2.check_args(args)  # the shared checks (sizes, --lr, --device, --model), then this file's own
    if not args.bucket_mb > 0:
        gpt2.fail(f"--bucket-mb is {args.bucket_mb}", "--bucket-mb", "give a positive size in MB (25 is the default)")
    if args.overlap_steps < 0:
        gpt2.fail(f"--overlap-steps is {args.overlap_steps}", "--overlap-steps", "give 0 or a positive integer")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if use_cuda and local_world > torch.cuda.device_count():
        gpt2.fail(f"{local_world} processes per node but {torch.cuda.device_count()} GPUs", "--nproc_per_node",
                  f"use --nproc_per_node={torch.cuda.device_count()}")


def main(argv=None):
    p = gpt2.make_parser("Train GPT-2 data-parallel: torchrun --nproc_per_node=N ddp.py (flags of gpt2.py train).")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB (one collective each)")
    p.add_argument("--zero1", action="store_true", help="ZeRO-1: shard AdamW's state over the ranks")
    p.add_argument("--overlap-steps", type=int, default=5, help="at the end, time N backward passes with buckets vs "
                                                                "one bucket after backward (0 = skip)")
    args = p.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    validate(args, world)
    cfg = gpt2.model_config(args)
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, cfg.vocab_size)  # raises if a batch does not fit

    ctx = gpt2.setup(args)
    model = gpt2.build_model(args).to(ctx.device)
    cfg = model.config
    meter = gpt2.CommMeter()
    ddp = DataParallel(model, args.bucket_mb, args.zero1, meter)
    opt = ddp.make_optimizer(args, ctx.device)
    if args.compile:
        # compile block by block: each block's backward stays its own graph, so its gradients (and
        # their buckets) are ready while earlier blocks still run backward; one whole-model graph would
        # hand over every gradient at its very end (torch's DDP splits the graph at buckets for this)
        for block in model.h:
            block.compile()
    grad_mb = sum(q.numel() * q.element_size() for q in ddp.params) / 1e6
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | {world} ranks | device "
           f"{ctx.device} {ctx.dtype} | {len(ddp.buckets)} buckets of <= {args.bucket_mb:g} MB"
           f"{' | ZeRO-1' if args.zero1 else ''} | broadcast {meter.take_mb():.1f} MB from rank 0")
    metrics = gpt2.Metrics(args, ctx, cfg, model.num_params(), world * args.batch_size * args.seq_len * args.grad_accum)
    profiler = gpt2.Profiler(args, ctx)

    def loss_fn(x, y):
        with ctx.autocast():
            return model(x.to(ctx.device), y.to(ctx.device))[1]

    opt_mb, comm = 0.0, []
    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.grad_accum):
            x, y = train_loader.next_batch()
            # only the last micro-step communicates (see no_sync)
            with ddp.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                loss = loss_fn(x, y) / args.grad_accum  # the gradient of the mean over all micro-batches
                loss_sum += loss.detach()
                loss.backward()
        ddp.finish_grad_sync()
        if args.grad_clip > 0:
            ddp.clip_grad_norm_(args.grad_clip)
        opt.step()
        ddp.all_gather_params()  # ZeRO-1 only
        opt.zero_grad(set_to_none=True)
        if world > 1:  # the logged loss is the mean over the global batch, as in one process
            dist.all_reduce(loss_sum)
            loss_sum /= world
            meter.all_reduce(loss_sum.element_size(), world)
        loss_val = loss_sum.item()
        gpt2.check_finite(loss_val, step)
        opt_mb = opt_mb or optimizer_state_mb(opt)
        comm.append(meter.take_mb())
        metrics.log_step(step, loss_val, lr, comm_mb=comm[-1], opt_state_mb=opt_mb)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
    ddp.close()
    if ctx.master:
        torch.save({"config": cfg.__dict__, "model": model.state_dict()}, os.path.join(args.out, "model.pt"))
    metrics.plot()
    print0(f"saved {args.out}/model.pt and {args.out}/loss.png")

    ring = 2 * (world - 1) / world * grad_mb
    print0(f"comm per step: {sum(comm) / len(comm):.3f} MB sent per rank | ring all-reduce minimum "
           f"2(N-1)/N x {grad_mb:.3f} MB of gradients = {ring:.3f} MB")
    print0(f"AdamW state per rank: {opt_mb:.2f} MB{' (ZeRO-1)' if args.zero1 else ''} | replicated: "
           f"{2 * grad_mb:.2f} MB (exp_avg + exp_avg_sq)")
    if args.overlap_steps and world > 1:
        batch = train_loader.next_batch()
        t_buckets, t_one = measure_overlap(model, loss_fn, batch, args.bucket_mb, args.overlap_steps, ctx.device)
        print0(f"overlap: forward+backward+sync {t_buckets * 1e3:.1f} ms with {args.bucket_mb:g} MB buckets vs "
               f"{t_one * 1e3:.1f} ms with one bucket after backward ({t_one / t_buckets:.2f}x)")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    gpt2.run_main(main)
