"""
ddp.py - data parallelism from torch.distributed calls. N ranks hold the whole model; each runs
forward and backward on its rows of the global batch; the gradients are averaged: the same update as
one process on an N-times-larger batch. Naive first (--naive): after backward, all-reduce each
gradient, divide by N; the network idles during backward, then the GPU during the all-reduces.
DataParallel hides them: the gradients fill flat buckets (--bucket-mb) in reverse parameter order
(about backward's order); a bucket's all-reduce starts, asynchronously, when its last gradient lands
(a post-accumulate-grad hook).

    naive     [backward: ln_f h.3 ... h.0 wpe wte][all-reduce p0][p1] ... [p_last] -> clip -> AdamW
    buckets   [backward: ln_f h.3 ... h.0 wpe wte]
    comm            [bucket 0][bucket 1] ... [bucket k] -> wait -> clip -> AdamW  (OUT/timeline.png)
                                            ^^^^^^^^^^ exposed: the tail after backward ends

The life of p.grad in one step (DataParallel):
    backward  autograd writes p.grad; under no_sync() (micro-steps but the last) it sums there
    hook      take_grad: p.grad / N into its slice of its bucket, p.grad = None; full: launch
    finish    finish_grad_sync: refuse a parameter with no gradient, launch the rest, wait
    hand_out  p.grad = its slice of the bucket: the mean over the ranks (a view, no copy)

Who sums what (N ranks, k = --grad-accum micro-steps per rank):
    | what             | summed over              | divided by        | where                    |
    | p.grad on a rank | its k micro-batches      | k (the loss / k)  | train: loss / grad_accum |
    | a bucket         | the N ranks (all-reduce) | N, before the sum | take_grad, then launch   |
    | clip norm        | each element once: each rank has the mean gradient | clip_grad_norm_     |
    | logged loss      | the N ranks              | N                 | train                    |

Read first: NaiveDataParallel, DataParallel._grad_ready, .finish_grad_sync, train. Beyond the core:
FindUnusedParameters (--find-unused-parameters), ShardedOptimizer, ZeRO-1/2 (--zero 1|2). Appendix:
bytes and memory per rank against their closed forms, the checks, the full command line. A minute:
    torchrun --nproc_per_node=2 ddp.py --data data/shakespeare_char --batch-size 4 --bucket-mb 1 \\
        --steps 20 --out out/ddp
ends with the share of gradient bytes whose all-reduce started under backward, and the wait left
(times vary; these are 2 busy CPU cores):
  step    19 | loss 3.1000 | norm 1.2339 | lr 1.00e-03 | (ms, tok/s) | comm 3.37 MB
  gradient bytes launched during backward: 0.94 (4 buckets) | exposed after backward: 33.3 ms/step
  exposed comm after backward, ms per step: naive 492.9 | buckets, no overlap 66.5 | overlapped 26.4
"""
import contextlib
import math
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

import gpt2
from gpt2 import print0


class NaiveDataParallel(nn.Module):
    """After backward, all-reduce each gradient, divide by N (every rank needs every gradient)."""

    def __init__(self, module, meter=None):
        super().__init__()
        self.module, self.meter = module, meter or gpt2.CommMeter()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.bytes_launched = [0, 0]  # [after, during] backward: all after
        for t in [*module.parameters(), *module.buffers()] if self.world > 1 else []:
            dist.broadcast(t.detach(), src=0)  # the same start on every rank, whatever the seeds
            self.meter.broadcast(t.nbytes, self.world)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):  # micro-steps add into p.grad; nothing is reduced before finish_grad_sync
        return contextlib.nullcontext()

    def finish_grad_sync(self):
        for p in self.module.parameters():  # a tied one once: its gradient sums both uses
            if self.world > 1:
                dist.all_reduce(p.grad)  # blocking, one by one, after backward: all exposed
                self.meter.all_reduce(p.grad.nbytes, self.world)
            p.grad /= self.world  # the mean, as one process on the N-times-larger batch
            self.bytes_launched[0] += p.grad.nbytes

    def clip_grad_norm_(self, max_norm):
        return gpt2.clip_grad_norm_(self.module.parameters(), max_norm)

    def close(self):
        pass


# The real version (Li et al. 2020, 3.2.3): bucketed all-reduces under backward, the tail exposed.
class Bucket:
    """Consecutive parameters end to end in one flat buffer; parameter i's is view(flat, i)."""

    def __init__(self, params):
        self.params, self.offsets = params, [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel, self.nbytes = self.offsets[-1], sum(p.nbytes for p in params)
        self.dtype, self.device = params[0].dtype, params[0].device
        # the flat gradient buffer, the collective in flight, which gradients are in the buffer
        self.grads, self.work, self.ready = None, None, [False] * len(params)

    def view(self, flat, i):
        return flat[self.offsets[i]: self.offsets[i + 1]].view_as(self.params[i])


def bucket_params(params, cap_bytes):
    """Cut parameters, in order, into runs closed once they hold cap_bytes (torch's DDP's rule: the
    last run is the rest, so little is left for after backward); one dtype per run."""
    runs, size = [[]], 0
    for p in params:
        if runs[-1] and (size >= cap_bytes or p.dtype != runs[-1][0].dtype):
            runs, size = runs + [[]], 0
        runs[-1].append(p)
        size += p.nbytes
    return runs


NO_TIMELINE = gpt2.Timeline(gpt2.Context(0, 1, 0, torch.device("cpu"), torch.float32, False))


class DataParallel(nn.Module):
    """The replicas stay identical: the same start, the same mean gradients. Use: with
    ddp.no_sync(): backward (micro-steps but the last); backward; finish_grad_sync(); opt.step().
    bucket_mb=None: one bucket. A tied parameter is reduced once, frozen ones not; one that produced
    no gradient on this rank in a step is refused at finish_grad_sync, as torch's DDP does."""

    def __init__(self, module, bucket_mb=25.0, meter=None, timeline=None):
        super().__init__()
        self.module, self.meter = module, meter or gpt2.CommMeter()
        self.timeline = timeline or NO_TIMELINE  # draws only the step it is started on
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.names = {p: name for name, p in module.named_parameters()}  # a tied one once
        self.params = [p for p in self.names if p.requires_grad]
        for t in [*module.parameters(), *module.buffers()] if self.world > 1 else []:
            dist.broadcast(t.detach(), src=0)  # the same start on every rank, whatever the seeds
            self.meter.broadcast(t.nbytes, self.world)
        # reverse registration order is roughly the order backward finishes the gradients
        cap = math.inf if bucket_mb is None else bucket_mb * 1e6
        self.buckets = [Bucket(run) for run in bucket_params(self.params[::-1], cap)]
        self.where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for b in self.buckets:
            self.allocate(b)
        self.sync, self.next_bucket, self.pending = True, 0, len(self.params)
        self.used = set()  # parameters autograd gave a gradient in this step (known on the host)
        self.bytes_launched = [0, 0]  # [after, during] backward, summed over the steps
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def allocate(self, b):  # the bucket's gradient buffer, for the whole run
        b.grads = torch.zeros(b.numel, dtype=b.dtype, device=b.device)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def make_optimizer(self, params, make):  # make(params) builds it (ZeRO's wrappers shard it)
        return make(params)

    @contextlib.contextmanager
    def no_sync(self):  # averaging is linear: one reduction of the micro-steps' sum, 1/k the bytes
        self.sync = False
        yield
        self.sync = True

    def _grad_ready(self, p):
        # autograd has written p's whole gradient for this backward (after all its uses)
        self.used.add(p)
        if self.sync:
            bucket, i = self.where[p]
            self.take_grad(bucket, i)
            self._launch_ready_buckets()

    def take_grad(self, b, i):
        """Parameter i's gradient into its bucket, divided by N on the way (a mean, not a sum)."""
        p, dst = b.params[i], b.view(b.grads, i)
        torch.mul(p.grad.view_as(dst), 1.0 / self.world, out=dst)
        p.grad = None  # the bucket holds it now (handed out again after the sync)
        b.ready[i] = True
        self.pending -= 1  # gradients of this step not yet in their bucket

    def _launch_ready_buckets(self):
        # strictly in index order: every rank must issue the same collectives in the same order
        while self.next_bucket < len(self.buckets) and all(self.buckets[self.next_bucket].ready):
            b = self.buckets[self.next_bucket]
            self.launch(self.next_bucket, b)
            self.bytes_launched[self.pending > 0] += b.nbytes  # under backward: some still due
            self.next_bucket += 1

    def launch(self, k, b):
        if self.world > 1:
            b.work = dist.all_reduce(b.grads, async_op=True)
            self.meter.all_reduce(b.grads.nbytes, self.world)
            self.timeline.comm(f"bucket {k}", b.work, kind="all_reduce")

    def check_used(self):
        """A parameter with no gradient in this step would be reduced as zeros and weight decay
        would still move it: one process leaves it alone. Checked before the next collective."""
        unused = [self.names[p] for p in self.params if p not in self.used]
        if unused:
            gpt2.fail(f"{', '.join(unused)} produced no gradient in this step", "DataParallel",
                      "use FindUnusedParameters (ddp.py --find-unused-parameters), or freeze them")

    def finish_grad_sync(self):
        """After the step's last backward: reduce the rest, wait for it all, hand out the mean."""
        self.check_used()
        for b in self.buckets:
            for i in range(len(b.params)):
                if not b.ready[i]:  # its gradient comes from the no_sync micro-steps only
                    self.take_grad(b, i)
        self._launch_ready_buckets()
        for k, b in enumerate(self.buckets):
            self.wait(k, b)  # CUDA: the stream waits, not the host
            b.ready = [False] * len(b.params)
        self.hand_out()
        self.next_bucket, self.pending, self.used = 0, len(self.params), set()

    def wait(self, k, b):
        if b.work is not None:
            b.work.wait()
            b.work = None

    def hand_out(self):
        for b in self.buckets:
            for i, p in enumerate(b.params):
                p.grad = b.view(b.grads, i)

    def clip_grad_norm_(self, max_norm):
        return gpt2.clip_grad_norm_(self.params, max_norm)

    def close(self):  # wait for what is in flight, remove the hooks
        for k, b in enumerate(self.buckets):
            self.wait(k, b)
        for h in self.hooks:
            h.remove()


def make_ddp(args, model, meter, timeline):
    """The data-parallel model and its optimizer (cli() below the banner adds ZeRO's)."""
    ddp = NaiveDataParallel(model, meter) if args.naive else \
        DataParallel(model, args.bucket_mb, meter, timeline)
    groups = gpt2.optimizer_groups(model, args.weight_decay)
    return ddp, gpt2.make_adamw(groups, args, next(model.parameters()).device)


def median_ms(spans):
    """The median of (start, end) pairs of timeline.now(): CUDA events on the stream (what waits
    for NCCL), else host seconds (gloo). A step slowed by another process barely moves a median."""
    if spans and isinstance(spans[0][0], torch.cuda.Event):
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in spans)
    return statistics.median(1e3 * (b - a) for a, b in spans) if spans else 0.0


def train(args, make_ddp):
    """`gpt2.py train`'s loop, each rank on its rows. Returns (ddp, opt, MB sent per step, metrics,
    the lesson's figures)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    vocab = gpt2.model_config(args).vocab_size
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, vocab)
    ctx = gpt2.setup(args)
    model = gpt2.build_model(args).to(ctx.device)
    meter, timeline = gpt2.CommMeter(), gpt2.Timeline(ctx, record_step=min(1, args.steps - 1))
    ddp, opt = make_ddp(args, model, meter, timeline)
    for block in model.h if args.compile else []:  # by block: a whole-model graph hides the hooks
        block.compile()
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | "
           f"{world} ranks | {ctx.device} {ctx.dtype} | {type(ddp).__name__} | "
           f"broadcast {meter.take_mb():.1f} MB")
    tokens = world * args.batch_size * args.seq_len * args.grad_accum
    metrics = gpt2.Metrics(args, ctx, model.config, model.num_params(), tokens)
    profiler = gpt2.Profiler(args, ctx)

    def loss_fn(x, y, net=ddp):
        with ctx.autocast():
            return net(x, y)[1]

    opt_mb, comm, exposed = 0.0, [], []
    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        timeline.start_step(step)
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(args.grad_accum):
            x, y = train_loader.next_batch(ctx.device)  # (B, T) each; CUDA: from pinned memory
            with ddp.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                with timeline.compute("forward"):
                    loss = loss_fn(x, y) / args.grad_accum  # the mean over the micro-batches
                loss_sum += loss.detach()
                with timeline.compute("backward"):
                    loss.backward()
        backward_end = timeline.now()
        ddp.finish_grad_sync()
        exposed.append((backward_end, timeline.now()))  # what backward left of the communication
        norm = ddp.clip_grad_norm_(args.grad_clip or math.inf)  # the pre-clip norm (0: no clipping)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:  # the logged loss is the mean over the global batch, as in one process
            dist.all_reduce(loss_sum)
            loss_sum /= world
            meter.all_reduce(loss_sum.element_size(), world)
        loss_val, norm_val = torch.stack([loss_sum, norm]).tolist()  # the step's one host sync
        gpt2.check_finite(loss_val, step)
        opt_mb = opt_mb or sum(t.nbytes for s in opt.state.values() for t in s.values()
                               if torch.is_tensor(t)) / 1e6
        comm.append(meter.take_mb())
        metrics.log_step(step, loss_val, lr, comm[-1], grad_norm=norm_val, opt_state_mb=opt_mb)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            ddp.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            ddp.train()
    ddp.close()
    gpt2.check_finite_weights(list(model.parameters()), args.steps - 1, ctx.device)  # a collective
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), model.config, model.state_dict())
    metrics.plot()
    timeline.save(os.path.join(args.out, "timeline.png"),
                  f"one step of ddp.py ({type(ddp).__name__}): forward and backward (upper bar); "
                  f"each bucket's collective, issue to completion")
    print0(f"saved {args.out}/model.pt, {args.out}/loss.png and {args.out}/timeline.png")
    after, during = ddp.bytes_launched
    figures = {"bytes_launched_in_backward": during / max(after + during, 1),
               "buckets": len(getattr(ddp, "buckets", [])),
               "exposed_comm_ms": median_ms(exposed[1:])}  # step 0 warms up
    if args.overlap_steps and world > 1:
        figures |= exposed_communication(args, model, loss_fn, train_loader.next_batch(ctx.device),
                                         timeline)
    return ddp, opt, comm, metrics, figures  # run_main ends the group: every collective was waited


def exposed_communication(args, model, loss_fn, batch, timeline):
    """ms a step waits for its gradients after backward, three ways: naive (every all-reduce),
    buckets launched after backward (no_sync holds them: bucketing alone), buckets launched from the
    hooks (bucketing and overlap)."""
    buckets = lambda: DataParallel(model, args.bucket_mb)  # noqa: E731
    ways = (("naive", lambda: NaiveDataParallel(model), False),
            ("buckets_no_overlap", buckets, True), ("buckets_overlapped", buckets, False))
    ms = {}
    for name, make, hold in ways:
        ddp, waits = make(), []
        for _ in range(args.overlap_steps + 1):  # the first warms up; the weights are not updated
            dist.barrier()  # the ranks start together: what is measured is communication, not skew
            with ddp.no_sync() if hold else contextlib.nullcontext():
                loss_fn(*batch, net=ddp).backward()
            t0 = timeline.now()
            ddp.finish_grad_sync()
            waits.append((t0, timeline.now()))
            model.zero_grad(set_to_none=True)
        ddp.close()
        ms[f"exposed_comm_ms_{name}"] = median_ms(waits[1:])
    return ms


def payoff(metrics, figures):
    """The lesson's closing lines, and the same figures as OUT/metrics.jsonl's summary record."""
    f = figures
    print0(f"gradient bytes launched during backward: {f['bytes_launched_in_backward']:.2f} "
           f"({f['buckets']} buckets) | exposed after backward: {f['exposed_comm_ms']:.1f} ms/step")
    if "exposed_comm_ms_naive" in f:
        print0(f"exposed comm after backward, ms per step: naive {f['exposed_comm_ms_naive']:.1f} "
               f"| buckets, no overlap {f['exposed_comm_ms_buckets_no_overlap']:.1f} "
               f"| overlapped {f['exposed_comm_ms_buckets_overlapped']:.1f}")
    metrics.log_summary(figures)


def make_parser():
    p = gpt2.make_parser("Train GPT-2 data-parallel: torchrun --nproc_per_node=N ddp.py")
    p.add_argument("--naive", action="store_true",
                   help="NaiveDataParallel: all-reduce each gradient after backward")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradient bucket size in MB (0: one per parameter)")
    p.add_argument("--overlap-steps", type=int, default=5,
                   help="at the end: exposed comm., naive vs buckets with and without overlap")
    return p


def main(argv=None):
    args = make_parser().parse_args(argv)
    gpt2.check_args(args)  # the shared checks (sizes, --lr, --device, --model); cli() adds more
    ddp, opt, comm, metrics, figures = train(args, make_ddp)
    payoff(metrics, figures)


# ---- Beyond the core ----
import sys  # noqa: E402  (cli's argv)
import time  # noqa: E402  (ZeRO-2's clock on CPU; the core needs none)


# --find-unused-parameters (torch DDP's flag; Li et al. 2020, section 3.2.3): a parameter that produced no
# gradient on a rank is reduced as zeros there instead of refused, and one that NO rank used in the step keeps
# grad None, as in one process (AdamW then skips it, weight decay included). It costs what the core avoids: one
# more all-reduce and a host sync (.tolist()) every step, after every bucket.
class FindUnusedParameters(DataParallel):
    def check_used(self):  # instead of refusing: remember which parameters this rank used
        self.used_here = torch.tensor([p in self.used for p in self.params], dtype=torch.int32,
                                      device=self.params[0].device)

    def take_grad(self, b, i):
        p = b.params[i]
        if p.grad is None:  # no gradient on this rank: zeros in its slice of the sum
            p.grad = torch.zeros_like(p)
        super().take_grad(b, i)

    def finish_grad_sync(self):
        super().finish_grad_sync()  # every bucket first, so the ranks' collectives stay in the same order
        used = self.used_here
        if self.world > 1:
            dist.all_reduce(used)
            self.meter.all_reduce(used.nbytes, self.world)
        for p, anywhere in zip(self.params, used.tolist()):  # the host waits for the all-reduce here
            if not anywhere:
                p.grad = None


def pad_to_slices(b, world):
    """ZeRO cuts a bucket into N equal slices: pad it to a multiple of N; rank r's slice is [r*S, (r+1)*S)."""
    b.numel = math.ceil(b.numel / world) * world
    b.slice_numel = b.numel // world
    return b


def new_buffer(b):
    return torch.zeros(b.numel, dtype=b.dtype, device=b.device)


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
        self.buckets = [pad_to_slices(Bucket(run), self.world) for run in layout]
        self.shards, self.bucket_shards = [], []
        with torch.no_grad():
            for k, b in enumerate(self.buckets):
                b.weights = new_buffer(b)
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
        squared norms are summed over the ranks (gpt2.clip_grad_norm_'s formula otherwise)."""
        self.take_grads()
        grads = [s.tensor.grad for s in self.shards if s.tensor.grad is not None]
        device = self.buckets[0].device
        sq = torch.zeros((), device=device)
        if grads:
            sq += torch.stack([g.float().pow(2).sum() for g in grads]).sum()
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
            mine = b.weights[self.rank * S: (self.rank + 1) * S]
            works.append(gpt2.all_gather_single(b.weights, mine, async_op=True))
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

    def __init__(self, module, bucket_mb=25.0, meter=None, timeline=None):
        self.rank = dist.get_rank() if dist.is_initialized() else 0  # this rank owns slice `rank`
        super().__init__(module, bucket_mb, meter, timeline)
        self.optimizer = None  # the ShardedOptimizer whose pieces receive the reduced slices

    def allocate(self, b):
        super().allocate(pad_to_slices(b, self.world))

    def make_optimizer(self, params, make):
        """The ShardedOptimizer laid out on these buckets, so a bucket's reduce-scatter leaves each rank
        exactly the gradient slice its pieces need."""
        self.optimizer = ShardedOptimizer(params, make, layout=[b.params for b in self.buckets], meter=self.meter)
        return self.optimizer

    def launch(self, k, b):
        if self.world > 1:  # in place: slice r of the buffer receives the mean of slice r over the ranks
            b.issued = self.timeline.now() if self.timeline.on else None
            S = b.slice_numel
            b.work = gpt2.reduce_scatter_single(b.grads[self.rank * S: (self.rank + 1) * S], b.grads, async_op=True)
            self.meter.reduce_scatter(b.grads.nbytes, self.world)

    def wait(self, k, b):
        super().wait(k, b)
        if getattr(b, "issued", None) is not None:  # gloo's reduce-scatter has no future: drawn issue -> waited
            self.timeline.comm_span(f"bucket {k}", b.issued, kind="reduce_scatter")
            b.issued = None

    def finish_grad_sync(self):
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: build the optimizer with make_optimizer(...) first")
        super().finish_grad_sync()

    def hand_out(self):
        for s in self.optimizer.shards:
            s.tensor.grad = self.buckets[s.bucket].grads[s.lo:s.hi]

    def clip_grad_norm_(self, max_norm):
        return self.optimizer.clip_grad_norm_(max_norm)


def clock(device):
    """CUDA: an event recorded on the current stream (what waits for NCCL is the stream, so the host clock
    would read ~0); CPU: the host clock. Read two with elapsed_s, once the events are done."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_s(t0, t1):
    return t0.elapsed_time(t1) / 1e3 if isinstance(t0, torch.cuda.Event) else t1 - t0


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

    def __init__(self, module, bucket_mb=25.0, meter=None, timeline=None):
        super().__init__(module, bucket_mb, meter, timeline)
        # the slices it keeps; buffers come and go (track)
        self.live_grad_bytes = self.peak_grad_bytes = sum(b.shard_grads.nbytes for b in self.buckets)
        self.blocked = []  # (clock, clock) around each wait backward made on a reduce-scatter: blocked_s()

    def allocate(self, b):  # only this rank's slice lives the whole run; the buffer, from take_grad to wait
        pad_to_slices(b, self.world)
        b.grads, b.shard_grads = None, torch.zeros(b.slice_numel, dtype=b.dtype, device=b.device)

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
            b.grads = self.track(new_buffer(b))
        if p.grad is not None and p.grad.data_ptr() != b.view(b.grads, i).data_ptr():
            # autograd's own tensor and the bucket coexist for a moment
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.live_grad_bytes + p.grad.nbytes)
        super().take_grad(b, i)

    def launch(self, k, b):
        if k >= self.in_flight:  # keep in_flight buckets reducing while the next one fills
            t0 = clock(b.device)
            self.wait(k - self.in_flight, self.buckets[k - self.in_flight])
            self.blocked.append((t0, clock(b.device)))
        super().launch(k, b)

    def blocked_s(self):
        """Seconds backward waited on a reduce-scatter: CUDA events (the stream's wait, and the slice's add)."""
        if self.blocked and isinstance(self.blocked[0][0], torch.cuda.Event):
            torch.cuda.synchronize()
        return sum(elapsed_s(t0, t1) for t0, t1 in self.blocked)

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

    def hand_out(self):
        for s in self.optimizer.shards:
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
                "grads": (ddp.peak_grad_bytes if zero2 else sum(b.grads.nbytes for b in ddp.buckets)) / 1e6,
                "optim": optimizer_state_mb(opt)}
    sizes, w = [b.numel * b.params[0].element_size() for b in ddp.buckets], getattr(ddp, "in_flight", 0) + 1
    largest = max(sum(sizes[max(0, k - w + 1): k + 1]) for k in range(len(sizes)))
    closed = {"params": 4 * n / 1e6, "grads": (4 * n / world + largest if zero2 else 4 * n) / 1e6,
              "optim": (8 * n / (world if sharded else 1)) / 1e6}
    return measured, closed


def report(args, ddp, opt, comm):
    """After training: bytes sent per step and memory per rank against their closed forms (ring all-reduce of
    fp32 gradients: 2(N-1)/N x 4P per step whatever --grad-accum; ZeRO-2: (k+1)(N-1)/N x 4P), ZeRO-2's wait."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    grad_mb = sum(q.nbytes for q in ddp.module.parameters() if q.requires_grad) / 1e6
    if isinstance(ddp, ZeRO2DataParallel):  # one reduce-scatter per micro-step, one all-gather per step
        closed, how = (args.grad_accum + 1) * (world - 1) / world * grad_mb, f"({args.grad_accum}+1)(N-1)/N"
    else:
        closed, how = 2 * (world - 1) / world * grad_mb, "2(N-1)/N"
    print0(f"comm per step: {sum(comm) / len(comm):.3f} MB sent per rank | closed form {how} x {grad_mb:.3f} MB "
           f"of gradients = {closed:.3f} MB")
    if isinstance(ddp, DataParallel):
        measured, form = memory_per_rank(ddp, opt)
        setup = {ZeRO1DataParallel: "ZeRO-1", ZeRO2DataParallel: "ZeRO-2"}.get(type(ddp), "plain")
        parts = [f"{k} {measured[k]:.3f} (closed {form[k]:.3f})" for k in measured]
        print0(f"memory per rank ({setup}, MB): " + " | ".join(parts)
               + f" | total {sum(measured.values()):.3f} (closed {sum(form.values()):.3f})")
    device = next(ddp.module.parameters()).device
    if isinstance(ddp, ZeRO2DataParallel):
        clock_kind = "CUDA events" if device.type == "cuda" else "host clock"
        print0(f"ZeRO-2: waited {ddp.blocked_s() / args.steps * 1e3:.2f} ms per step, before each launch, for the "
               f"reduce-scatter {ddp.in_flight} buckets back ({clock_kind})")
    if device.type == "cuda":
        print0(f"CUDA peak (with activations): {torch.cuda.max_memory_allocated(device) / 1e6:.1f} MB allocated, "
               f"{torch.cuda.max_memory_reserved(device) / 1e6:.1f} MB reserved by the caching allocator")


def validate(args, bucket_mb_given=False):
    """Everything that would otherwise fail inside a collective, checked before the first one."""
    gpt2.check_args(args)  # the shared checks (sizes, --lr, --device, --model), then this file's own
    gpt2.check_range(args.bucket_mb, "--bucket-mb", 0, 1e6, "give 0 (one bucket per parameter) or a size in MB "
                     "(25 is the default; larger than the model: one bucket)")
    gpt2.check_range(args.overlap_steps, "--overlap-steps", 0, 1000, "give 0 (skip) or a few steps, e.g. 5")
    if args.naive and (args.zero or args.find_unused_parameters or bucket_mb_given):
        gpt2.fail("--naive reduces every gradient after backward, with no buckets to size, shard or skip",
                  "--naive", "drop --bucket-mb / --zero / --find-unused-parameters, or drop --naive")
    if args.zero and args.find_unused_parameters:
        gpt2.fail("ZeRO's shards do not track unused parameters", "--find-unused-parameters",
                  "drop it with --zero (freeze a parameter no rank uses), or use --zero 0")
    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if use_cuda and local_world > torch.cuda.device_count():
        gpt2.fail(f"{local_world} processes per node but {torch.cuda.device_count()} GPUs", "--nproc_per_node",
                  f"use --nproc_per_node={torch.cuda.device_count()}")


def make_ddp_beyond(args, model, meter, timeline):
    """make_ddp with the extensions: ZeRO's wrappers build their ShardedOptimizer on their buckets."""
    if not (args.zero or args.find_unused_parameters):
        return make_ddp(args, model, meter, timeline)
    Wrapper = {1: ZeRO1DataParallel, 2: ZeRO2DataParallel}.get(args.zero, FindUnusedParameters)
    ddp = Wrapper(model, args.bucket_mb, meter, timeline)
    groups = gpt2.optimizer_groups(model, args.weight_decay)
    adamw = lambda g: gpt2.make_adamw(g, args, next(model.parameters()).device)  # noqa: E731
    return ddp, ddp.make_optimizer(groups, adamw)


def cli(argv=None):
    """The core's flags, and the extensions': --zero 1|2, --find-unused-parameters."""
    p = make_parser()
    p.add_argument("--zero", type=int, choices=(0, 1, 2), default=0,
                   help="ZeRO stage: 1 shards AdamW's state over the ranks (ZeRO1DataParallel), 2 also the "
                        "gradients (ZeRO2DataParallel)")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="reduce a parameter unused on a rank as zeros there, give grad None to one no rank used "
                        "(one more all-reduce and host sync per step); without it such a parameter is an error")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    validate(args, bucket_mb_given=any(a.split("=")[0] == "--bucket-mb" for a in argv))
    ddp, opt, comm, metrics, figures = train(args, make_ddp_beyond)
    report(args, ddp, opt, comm)
    payoff(metrics, figures)  # the core's closing lines, last, as the handout prints them


if __name__ == "__main__":
    gpt2.run_main(cli)
