"""
checkpoint.py - sharded, asynchronous, crash-safe checkpoints of a ZeRO-1 run, resumed on any
number of ranks: bit-exact on as many as wrote them.

A killed run must continue exactly where it stopped. ZeRO-1 shards the optimizer state (rank r
owns 1/N of the flat fp32 params and AdamW moments), so the checkpoint is sharded too. The naive
save (--naive) writes on the training thread, which waits for the disk; the real one copies to
host memory and a thread writes while training goes on (CheckFreq, section 4).

  rank 0  training [ step S-1 ]snap S[ step S ][ step S+1 ]   snap: my slices -> host (step waits)
          writer            [ write S ](gather..)[commit S]   --naive: all of it before step S
  rank 1  training [ step S-1 ]snap S[ step S ][ step S+1 ]   commit: rank 0 renames manifest.json
          writer            [ write S    ](gather)            into place, last

  who writes   rank r: step_S/rankR-of-N.pt = [r*L, (r+1)*L) of params, exp_avg, exp_avg_sq
               (L = ceil(P/N)), its RNG, the data position; rank 0, after an all-gather of every
               (bytes, crc32): manifest.json, last. Each file: .tmp, fsync, rename, fsync the dir.
  who resumes  the newest commit written with this run's flags (else one line naming the flag)
               whose shards match their CRC-32s (else the commit before it, saying so). Rank r of
               M reads [r*L', (r+1)*L'), L' = ceil(P/M), from the shards that overlap it.
  who sums     the gradient: reduce-scatter SUM over the N ranks, then / N (a mean); its norm:
               each slice's sum of squares, all-reduced (SUM). A checkpoint sums nothing: it copies.

Below the banners: --pinned snapshots; --safe (read retries, corrupt commits renamed aside, --keep,
--allow-fresh-start, a failed save stops every rank at once); the command line's checks.
read first: Zero1.reduce_scatter_grads, write_durably, SyncCheckpointer.save,
AsyncCheckpointer.save, SyncCheckpointer.load_latest, SyncCheckpointer.read_slices.

  torchrun --nproc_per_node=2 checkpoint.py --data data/shakespeare_char --steps 20 \\
      --batch-size 4 --seq-len 128 --save-every 5 --fail-at 13 \\
      --ckpt-dir out/ckpt/shards --out out/ckpt
  python checkpoint.py --data data/shakespeare_char --steps 20 --batch-size 8 --seq-len 128 \\
      --save-every 5 --ckpt-dir out/ckpt/shards --out out/ckpt      # 1 rank, the same global batch
print `[rank 1] --fail-at 13: exiting abruptly` (rank 0: one line saying how to continue), then
  resharding: written by 2 ranks, loaded by 1
  resumed from step 10
  ...steps 10-19 (10-12 as the first run printed them)
  checkpoint: 2 saves of 10.12 MB a rank; write + commit 892.5 ms per save, in a background thread
  checkpoint: the step was blocked 87.7 ms per save, by the snapshot (--naive: 980.2 ms, by both)
"""
import glob
import io
import json
import os
import shlex
import sys
import threading
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

import gpt2
from gpt2 import all_gather_single, print0, reduce_scatter_single


class Zero1:
    """Every parameter (and .grad) views one flat fp32 vector, 2-D weights first; rank r owns the
    slice [lo, hi) of it, and AdamW updates that slice only."""

    def __init__(self, model, args, ctx, comm):
        self.ctx, self.comm, self.world = ctx, comm, ctx.world
        self.config = dict(model.config.__dict__)
        named = sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad),
                       key=lambda n_p: n_p[1].dim() < 2)  # a slice: <= 1 decayed + 1 other piece
        self.numel = sum(p.numel() for _, p in named)  # the tied wte counted once
        self.n_decay = sum(p.numel() for _, p in named if p.dim() >= 2)
        self.shard = -(-self.numel // self.world)  # ceil: pad so every rank holds an equal slice
        self.flat = torch.zeros(self.shard * self.world, device=ctx.device, dtype=torch.float32)
        self.grad = torch.zeros_like(self.flat)
        self.layout, off = [], 0
        for name, p in named:
            self.flat[off: off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[off: off + p.numel()].view_as(p)
            p.grad = self.grad[off: off + p.numel()].view_as(p)  # backward adds into self.grad
            self.layout.append([name, list(p.shape), off])
            off += p.numel()
        self.lo = ctx.rank * self.shard
        self.hi = min((ctx.rank + 1) * self.shard, self.numel)  # real, unpadded
        # my reduced slice (one rank: the whole gradient)
        self.grad_shard = self.grad if self.world == 1 else torch.zeros_like(self.grad[:self.shard])
        decayed = (self.lo, min(self.hi, self.n_decay), args.weight_decay)
        other = (max(self.lo, self.n_decay), self.hi, 0.0)
        self.pieces = [(a, b, wd) for a, b, wd in (decayed, other) if a < b]
        # views: AdamW writes into flat
        self.params = [torch.nn.Parameter(self.flat[a:b]) for a, b, _ in self.pieces]
        for p, (a, b, _) in zip(self.params, self.pieces):
            p.grad = self.grad_shard[a - self.lo: b - self.lo]
        self.optimizer_groups = [{"params": [p], "weight_decay": wd}
                                 for p, (_, _, wd) in zip(self.params, self.pieces)]

    def reduce_scatter_grads(self):  # sum the gradients over ranks, keep my slice, divide: the mean
        if self.world > 1:
            reduce_scatter_single(self.grad_shard, self.grad)  # SUM: gloo has no AVG
            self.grad_shard.div_(self.world)
            self.comm.reduce_scatter(self.grad.numel() * 4, self.world)

    def grad_norm(self):  # my slice's sum of squares, all-reduced: the global norm, before any clip
        sq = self.grad_shard.square().sum()
        if self.world > 1:
            dist.all_reduce(sq)
            self.comm.all_reduce(4, self.world)
        return sq.sqrt()

    def clip_grads(self, norm, max_norm):  # torch's clip_grad_norm_: x min(1, max / (norm + 1e-6))
        self.grad_shard.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))

    def all_gather_params(self):  # every rank's updated slice to every rank, in place
        if self.world > 1:
            mine = self.flat[self.ctx.rank * self.shard: (self.ctx.rank + 1) * self.shard]
            all_gather_single(self.flat, mine)
            self.comm.all_gather(self.flat.numel() * 4, self.world)


def write_durably(path, data):  # path.tmp, fsync, rename to path, fsync the dir -> (bytes, crc32)
    with open(path + ".tmp", "wb") as f:
        f.write(data)  # releases the GIL on a large buffer: training goes on meanwhile
        f.flush()
        os.fsync(f.fileno())  # the bytes on disk before the name: `path` is never half-written
    os.replace(path + ".tmp", path)  # atomic: path is the old file or the new one, never a mix
    fsync_dir(os.path.dirname(path))  # the rename itself durable
    return len(data), zlib.crc32(data)  # crc32 catches flipped bits and torn writes (not tampering)


def fsync_dir(path):  # makes a rename in the directory durable, not only the file's bytes
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


class CorruptCheckpoint(Exception):
    """A commit that cannot be used as written: a shard missing, or its bytes not the ones the
    manifest lists (a flipped bit, a torn write), or (--safe) a malformed manifest."""


def check_bytes(path, data, shard):  # the bytes read against the manifest's (bytes, crc32)
    if len(data) != shard["bytes"]:
        raise CorruptCheckpoint(f"{path} holds {len(data)} bytes, the manifest lists "
                                f"{shard['bytes']}")
    if zlib.crc32(data) != shard["crc32"]:
        raise CorruptCheckpoint(f"{path} fails its CRC-32 (read crc32 {zlib.crc32(data):08x}, the "
                                f"manifest lists {shard['crc32']:08x})")


def mismatched_flags(man, args, zero, world):
    """[(flag, the checkpoint's value, ours)] for each flag whose value differs from the run that
    wrote the checkpoint. Another world size with the same global batch is not one: that is
    resharding."""
    named, ours = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd"}, zero.config
    diff = [(named[k], f"{named[k]} {v}", f"{named[k]} {ours.get(k)}")
            for k, v in man["config"].items() if k in named and ours.get(k) != v]
    diff += [("--data" if "vocab" in k or k == "chars" else "--model", f"{k}={v!r:.24}",
              f"{k}={ours.get(k)!r:.24}")
             for k, v in man["config"].items() if k not in named and ours.get(k) != v]
    if not diff and man["layout"] != zero.layout:
        diff.append(("--model", "another parameter layout", "this model's"))
    schedule = {"lr": args.lr, "warmup": args.warmup, "steps": args.steps}
    diff += [(f"--{k}", f"--{k} {man['schedule'][k]}", f"--{k} {v}") for k, v in schedule.items()
             if man["schedule"][k] != v]
    if man["seq_len"] != args.seq_len:
        diff.append(("--seq-len", f"--seq-len {man['seq_len']}", f"--seq-len {args.seq_len}"))
    batch = world * args.batch_size * args.grad_accum
    if man["global_batch"] != batch:
        ranks = f"{world} rank{'s' * (world > 1)}"
        diff.append(("--batch-size", f"a global batch of {man['global_batch']}",
                     f"a global batch of {batch} ({ranks} x --batch-size {args.batch_size} x "
                     f"--grad-accum {args.grad_accum})"))
    return diff


def refuse_another_run(man, d, args, zero, world):  # a resume continues the run that wrote d
    diff = mismatched_flags(man, args, zero, world)
    if diff:
        flags = " ".join(dict.fromkeys(f for f, _, _ in diff))  # each flag once
        gpt2.fail(f"{d} was written with {' '.join(a for _, a, _ in diff)}, this run has "
                  f"{' '.join(b for _, _, b in diff)}", flags,
                  "resume with the checkpoint's values (another world size with the same global "
                  "batch is fine), or give another --ckpt-dir")


class SyncCheckpointer:
    """The naive save (--naive): all on the training thread, which waits for the disk. And what
    every checkpointer shares: the commit, the verified load, the resume, --fail-at."""

    def __init__(self, args, ctx, zero, timeline):
        self.args, self.ctx, self.zero, self.timeline = args, ctx, zero, timeline
        self.ms = {"blocked": [], "write": []}  # per save: how long the step waited; write + commit
        self.shard_mb = 0.0  # this rank's file of the last save
        # the writer's spans: a writer thread records no CUDA event (it would time the stream, not
        # the disk, and open a context on GPU 0): drawn where the timeline's clock is the host's
        self.io = timeline if ctx.device.type == "cpu" else gpt2.Timeline(ctx, record_step=-1)
        # the writer's own gloo group: collectives of a group come in one order on all ranks, and
        # the training thread's come in another
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout)) \
            if ctx.world > 1 else None

    def after_step(self, step, opt, loader):  # `step` updates done: save on schedule; --fail-at
        if self.args.save_every and (step % self.args.save_every == 0 or step == self.args.steps):
            t0 = time.perf_counter()
            self.save(step, opt, loader)  # the state after `step` updates: a resume runs it next
            self.ms["blocked"].append(1e3 * (time.perf_counter() - t0))
        if step == self.args.fail_at:
            self.crash(step)

    def crash(self, step):  # the last rank dies as a node would (on torchrun's first attempt only)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.ctx.rank == self.ctx.world - 1 and first_attempt:
            self.wait()  # its save in flight committed first: a resume finds the commit it expects
            print(f"[rank {self.ctx.rank}] --fail-at {step}: exiting abruptly", flush=True)
            os._exit(1)

    def save(self, step, opt, loader):  # the naive way: training goes on once the save is committed
        self.write_and_commit(step, *self.snapshot(step, opt, loader))

    def wait(self):  # nothing in flight: save() returned after the commit
        pass

    def snapshot(self, step, opt, loader):  # what a resume needs, on the host, before the next step
        z = self.zero
        with self.timeline.compute(f"snapshot {step}", "io"):
            moments = {k: torch.cat([opt.state[p][k] for p in z.params])
                       for k in ("exp_avg", "exp_avg_sq")}
            out = {"params": z.flat[z.lo: z.hi]} | moments
            out = {k: v.to("cpu", copy=True) for k, v in out.items()}  # copies, not views
            out["rng_cpu"] = torch.get_rng_state()
            if self.ctx.device.type == "cuda":
                out["rng_cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        return out, {"step": step, "rank": z.ctx.rank, "world": z.world, "lo": z.lo, "hi": z.hi,
                     "loader": loader.state_dict()}

    def write_and_commit(self, step, tensors, meta):  # every rank's shard durable, then the commit
        t0, d = time.perf_counter(), os.path.join(self.args.ckpt_dir, f"step_{step:06d}")
        with self.io.compute(f"write {step}", "io"):
            report = self.write(d, tensors, meta)
        with self.io.compute("gather", "all_gather"):  # every rank's (bytes, crc32) to every rank
            reports = report.repeat(self.ctx.world, 1)
            if self.group is not None:  # returns once every shard is durable
                all_gather_single(reports.view(-1), report, group=self.group)
        if self.ctx.master:
            with self.io.compute(f"commit {step}", "io"):
                self.commit(step, d, reports, meta["loader"])
        if self.group is not None:  # every rank's writer returns after the commit
            dist.barrier(group=self.group)
        gpt2.RUN["resume"] = self.resume_hint(step)  # what a Ctrl-C or a lost peer prints
        self.ms["write"].append(1e3 * (time.perf_counter() - t0))  # the host clock, as the disk's
        self.shard_mb = int(report[0]) / 1e6

    def write(self, d, tensors, meta):  # this rank's shard, durable -> [bytes, crc32]
        os.makedirs(d, exist_ok=True)
        torch.save(tensors | {"meta": meta}, buf := io.BytesIO())
        path = os.path.join(d, f"rank{self.ctx.rank:05d}-of-{self.ctx.world:05d}.pt")
        out = write_durably(path, buf.getbuffer())
        fsync_dir(self.args.ckpt_dir)  # the step directory's entry: another node's rank may make it
        return torch.tensor(out, dtype=torch.int64)

    def commit(self, step, d, reports, loader_state):  # rank 0, every shard durable: the manifest
        z, W, a = self.zero, self.ctx.world, self.args
        shards = [{"file": f"rank{r:05d}-of-{W:05d}.pt", "lo": r * z.shard,
                   "hi": min((r + 1) * z.shard, z.numel), "bytes": nbytes, "crc32": crc}
                  for r, (nbytes, crc) in enumerate(reports.tolist())]
        manifest = {"format": 3, "step": step, "world": W, "numel": z.numel, "config": z.config,
                    "layout": z.layout,
                    "schedule": {"lr": a.lr, "warmup": a.warmup, "steps": a.steps},
                    "global_batch": W * a.batch_size * a.grad_accum, "seq_len": a.seq_len,
                    "loader": loader_state, "shards": shards}
        write_durably(os.path.join(d, "manifest.json"), json.dumps(manifest).encode())

    def load_latest(self, opt, loader):
        """The newest commit (a step directory holding manifest.json) written with this run's flags
        whose shards verify, into the weights, AdamW, the RNGs and the loader. Returns its step, or
        0 when there is none."""
        skipped = []  # (step, why): commits with a shard this rank found corrupt or missing
        steps = glob.glob(os.path.join(self.args.ckpt_dir, "step_" + "[0-9]" * 6))
        for d in sorted(steps, reverse=True):  # newest first
            if not os.path.exists(os.path.join(d, "manifest.json")):
                continue  # a save that never committed
            man = json.loads(read_bytes(os.path.join(d, "manifest.json")))
            refuse_another_run(man, d, self.args, self.zero, self.ctx.world)  # before any loading
            try:
                slices, rng = self.read_slices(man, d)
            except CorruptCheckpoint as e:
                skipped, slices = skipped + [(man["step"], str(e))], None
            if gpt2.agree(slices is not None):  # every rank verified its part: all resume, or none
                for step, why in skipped:  # the rank that found it says so
                    print(f"checkpoint step {step}: {why}: skipped, left in place", flush=True)
                self.resume(man, slices, rng, opt, loader)
                gpt2.RUN["resume"] = self.resume_hint(man["step"])
                if man["world"] != self.ctx.world:
                    print0(f"resharding: written by {man['world']} ranks, loaded by "
                           f"{self.ctx.world}")
                print0(f"resumed from step {man['step']}")
                return man["step"]
        if not gpt2.agree(not skipped):  # commits exist, none verifies: stop, every file in place
            step, why = skipped[0] if skipped else ("?", "another rank found a shard corrupt")
            gpt2.fail(f"checkpoint step {step}: {why}, and no older commit verifies", "--ckpt-dir",
                      "restore the file from a copy, or give another --ckpt-dir and --out to start "
                      "over", local=bool(skipped))
        return 0

    def resume_hint(self, step):  # what a Ctrl-C or a lost peer prints: the command that goes on
        local, world = os.environ.get("LOCAL_WORLD_SIZE", "1"), str(self.ctx.world)
        launch = "python" if world == "1" else \
            f"torchrun --nproc_per_node={local}{' (and your --nnodes)' * (local != world)}"
        return (f"step {step} is committed in {self.args.ckpt_dir}; continue with: {launch} "
                f"{shlex.join(sys.argv)}")

    def read_shard(self, d, shard):  # its tensors, once its bytes are the ones the manifest lists
        path = os.path.join(d, shard["file"])
        if not os.path.exists(path):
            raise CorruptCheckpoint(f"{path} is missing")
        data = read_bytes(path)
        check_bytes(path, data, shard)
        return torch.load(io.BytesIO(data), weights_only=True)

    def read_slices(self, man, d):
        """My slices [lo, hi) from any number of writers: the overlapping shards, and my rank's for
        the RNG. Raises CorruptCheckpoint before anything is loaded."""
        z, rng = self.zero, {}
        out = {k: torch.empty(z.hi - z.lo) for k in ("params", "exp_avg", "exp_avg_sq")}
        for r, sh in enumerate(man["shards"]):
            a, b = max(sh["lo"], z.lo), min(sh["hi"], z.hi)
            if a < b or r == self.ctx.rank:
                tensors = self.read_shard(d, sh)
                for k in out if a < b else ():
                    out[k][a - z.lo: b - z.lo] = tensors[k][a - sh["lo"]: b - sh["lo"]]
                if r == self.ctx.rank:  # a rank new to the old world keeps its seeded RNG
                    rng = {k: tensors[k] for k in ("rng_cpu", "rng_cuda") if k in tensors}
        return out, rng

    def resume(self, man, slices, rng, opt, loader):  # my slices into the weights, AdamW; RNG; data
        z, step = self.zero, man["step"]
        z.flat[z.lo: z.hi].copy_(slices["params"])  # flat is a plain tensor: no autograd to bypass
        z.all_gather_params()  # everyone's slice to everyone: the full weights again
        sd = opt.state_dict()  # AdamW's bias correction counts the steps
        sd["state"] = {i: {"step": torch.tensor(float(step))} | {
            k: slices[k][lo - z.lo: hi - z.lo] for k in ("exp_avg", "exp_avg_sq")}
            for i, (lo, hi, _) in enumerate(z.pieces)}
        opt.load_state_dict(sd)
        if "rng_cpu" in rng:
            torch.set_rng_state(rng["rng_cpu"])
        if "rng_cuda" in rng and self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(rng["rng_cuda"], self.ctx.device)
        loader.load_state_dict(man["loader"])  # a token offset: valid for any world size
        return step


class AsyncCheckpointer(SyncCheckpointer):
    """The real save (CheckFreq, section 4): the step waits for the snapshot only; a thread writes
    and commits."""
    thread = failure = None

    def save(self, step, opt, loader):
        self.wait()  # a new save waits for the previous one
        self.thread = threading.Thread(target=self.write_in_background,
                                       args=(step, *self.snapshot(step, opt, loader)), daemon=True)
        self.thread.start()

    def write_in_background(self, step, tensors, meta):  # the writer thread
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)  # per thread: a new one would start on GPU 0
        try:
            self.write_and_commit(step, tensors, meta)
        except OSError as e:  # the disk: one line, on the training thread at its next wait()
            self.failure = gpt2.UsageError(
                f"checkpoint save of step {step} failed on rank {self.ctx.rank}: {e}", "--ckpt-dir",
                "fix it (space, permissions) and relaunch to resume from the last commit",
                local=True)
        except RuntimeError as e:  # a lost peer (the writer's gloo group): run_main's one line
            self.failure = e

    def wait(self):  # the save in flight committed on every rank, or its failure raised here
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.failure is not None:
            raise self.failure


def closing_lines(ckpt, metrics):  # the payoff: how long a save held the training step
    if ckpt is None or not ckpt.ms["blocked"]:
        print0("checkpoint: no save (give --ckpt-dir DIR --save-every N)")
        return metrics.log_summary({"saves": 0})
    n, (blocked, write) = len(ckpt.ms["blocked"]), (sum(v) / len(v) for v in ckpt.ms.values())
    thread = isinstance(ckpt, AsyncCheckpointer)
    print0(f"checkpoint: {n} save{'s' * (n > 1)} of {ckpt.shard_mb:.2f} MB a rank; write + commit "
           f"{write:.1f} ms per save, {'in a background' if thread else 'on the training'} thread")
    print0(f"checkpoint: the step was blocked {blocked:.1f} ms per save, " + (
        f"by the snapshot (--naive: {blocked + write:.1f} ms, by both)" if thread else
        "by all of it (without --naive: the snapshot)"))
    metrics.log_summary({"saves": n, "shard_mb": ckpt.shard_mb, "write_ms": write,
                         "blocked_ms": blocked, "background": thread})


def train(args, Checkpointer=AsyncCheckpointer):
    """gpt2.train's loop on ZeRO-1, resumed from and saved to --ckpt-dir."""
    ctx = gpt2.setup(args, resumes=True)  # a run continues in its --out (cli() refuses another)
    comm = gpt2.CommMeter()
    model = gpt2.build_model(args).to(ctx.device)
    zero = Zero1(model, args, ctx, comm)
    opt = gpt2.make_adamw(zero.optimizer_groups, args, ctx.device)
    train_loader, val_loader = gpt2.make_loaders(args, ctx.rank, ctx.world, model.config.vocab_size)
    timeline, k = gpt2.Timeline(ctx), args.save_every if args.ckpt_dir else 0
    ckpt = Checkpointer(args, ctx, zero, timeline) if args.ckpt_dir else None
    start = ckpt.load_latest(opt, train_loader) if ckpt else 0
    comm.take_mb()  # the resume's all-gather is not a training step's traffic
    # the step drawn: one that ends with a save (not the first)
    timeline.record_step = -(-(start + 2) // k) * k - 1 if k else start + 1
    fwd = torch.compile(model) if args.compile else model
    tokens = ctx.world * args.batch_size * args.seq_len * args.grad_accum
    metrics = gpt2.Metrics(args, ctx, model.config, model.num_params(), tokens, resume_step=start)
    profiler = gpt2.Profiler(args, ctx)

    def loss_fn(x, y):
        with ctx.autocast():
            return fwd(x, y)[1]

    for step in range(start, args.steps):
        if step == timeline.record_step:
            timeline.start_step(step)  # once: it records on, over the steps the write overlaps
        elif timeline.on and step > timeline.record_step + 1 and (not k or ckpt.ms["write"]):
            timeline.stop()  # one more step drawn, and that save is committed
        profiler.step(step)
        metrics.start_step()
        t0, lr = timeline.now(), gpt2.set_lr(opt, step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)
        zero.reduce_scatter_grads()
        norm = zero.grad_norm()  # before clipping: what metrics.jsonl records
        if args.grad_clip > 0:
            zero.clip_grads(norm, args.grad_clip)
        opt.step()
        zero.all_gather_params()
        zero.grad.zero_()  # never set_to_none: the .grad views must keep pointing into zero.grad
        if ctx.world > 1:  # the logged loss: the mean over the global batch, as in one process
            dist.all_reduce(loss_sum)
            comm.all_reduce(4, ctx.world)
        timeline.comm_span(f"step {step}", t0, "compute")
        loss, norm = torch.stack([loss_sum / ctx.world, norm]).tolist()  # the step's one host sync
        gpt2.check_finite(loss, step)
        if ckpt:
            ckpt.after_step(step + 1, opt, train_loader)  # saves on schedule
        metrics.log_step(step, loss, lr, comm_mb=comm.take_mb(), grad_norm=norm)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
    if ckpt:
        ckpt.wait()  # the last save commits before the run ends
    closing_lines(ckpt, metrics)
    timeline.save(os.path.join(args.out, "timeline.png"),
                  "training steps (upper); a save: snapshot, write, gather, commit")
    metrics.plot()


def make_parser():
    p = gpt2.make_parser("GPT-2 on ZeRO-1 with sharded, asynchronous, crash-safe checkpoints and "
                         "resharding resume.")
    p.add_argument("--ckpt-dir", help="checkpoint directory; the newest commit in it is resumed")
    p.add_argument("--save-every", type=int, default=0,
                   help="save every N steps, and after the last (0 = never)")
    p.add_argument("--naive", action="store_true",
                   help="save synchronously: the training step waits for the disk")
    p.add_argument("--fail-at", type=int, default=-1,
                   help="a crash: after this many steps (and its save in flight committed) the "
                        "last rank exits, on torchrun's first attempt only; -1 = never")
    return p


def check_ckpt_flags(args):  # flags that act only with a directory to save into, or saves
    for flag, given in (("--save-every", args.save_every), ("--fail-at", args.fail_at != -1)):
        if given and not args.ckpt_dir:
            gpt2.fail(f"{flag} without a directory to save into", "--ckpt-dir",
                      "add --ckpt-dir DIR")
    if args.naive and not args.save_every:
        gpt2.fail("--naive without --save-every: nothing would be saved", "--naive",
                  "add --save-every N, or drop --naive")


def main(argv=None):  # the core alone; the file's entry point is cli() (its checks, its extensions)
    args = make_parser().parse_args(argv)  # gpt2.setup checks the shared flags
    check_ckpt_flags(args)
    train(args, SyncCheckpointer if args.naive else AsyncCheckpointer)


# ---- Beyond the core ----
# PinnedSnapshots (--pinned): the snapshot into reused pinned host buffers, queued on the GPU's stream (CheckFreq
# section 4). SafeCheckpointer (--safe, pinned too): finite weights before a snapshot, a failure handshake, --keep,
# read retries, a malformed manifest or corrupt shard set aside (the core only skips it), --allow-fresh-start.
import shutil  # noqa: E402  (the extensions' only import)
# Elastic restarts: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --max-restarts 3 --nproc_per_node=8
# checkpoint.py ... restarts the job from the last commit when a worker dies (a fresh TCPStore per attempt:
# pytorch/pytorch#135712); --fail-at kills one worker on the first attempt to show it.


class PinnedSnapshots(AsyncCheckpointer):
    """The snapshot copies into host buffers allocated once and page-locked, queued on the GPU's stream: the
    training thread does not wait for them; the writer thread waits (a CUDA event) before it writes."""
    buffers = copied = None

    def snapshot(self, step, opt, loader):
        z, cuda = self.zero, self.ctx.device.type == "cuda"
        with self.timeline.compute(f"snapshot {step}", "io"):
            if self.buffers is None:  # reused: the previous save is committed before the next snapshot
                self.buffers = {k: torch.empty(z.hi - z.lo, dtype=torch.float32, pin_memory=cuda)
                                for k in ("params", "exp_avg", "exp_avg_sq")}
            b = self.buffers
            b["params"].copy_(z.flat[z.lo: z.hi], non_blocking=cuda)
            for p, (lo, hi, _) in zip(z.params, z.pieces):
                for k in ("exp_avg", "exp_avg_sq"):
                    b[k][lo - z.lo: hi - z.lo].copy_(opt.state[p][k], non_blocking=cuda)
            out = dict(b, rng_cpu=torch.get_rng_state())
            if cuda:
                out["rng_cuda"], self.copied = torch.cuda.get_rng_state(self.ctx.device), torch.cuda.Event()
                self.copied.record()
        return out, {"step": step, "rank": z.ctx.rank, "world": z.world, "lo": z.lo, "hi": z.hi, "loader": loader.state_dict()}

    def write(self, d, tensors, meta):
        if self.copied is not None:
            self.copied.synchronize()  # the snapshot's copies have landed in host memory
        return super().write(d, tensors, meta)


class Uncommitted(Exception):
    """A step directory without manifest.json: a save that never finished. Skipped and left in place."""


class Unreadable(Exception):
    """An OSError that outlived READ_TRIES: the filesystem's fault, not the checkpoint's. The run stops."""


READ_TRIES, READ_BACKOFF_S = 3, 0.5  # a shared filesystem's hiccups (failover, stale handle) pass in seconds
OK, UNCOMMITTED, CORRUPT, MISMATCH, UNREADABLE = range(5)  # a rank's verdict on one candidate; worst wins
MANIFEST = {"format": int, "step": int, "world": int, "numel": int, "config": dict, "layout": list, "schedule": dict,
            "global_batch": int, "seq_len": int, "loader": dict, "shards": list}


def parse_shard(data):  # a shard's bytes -> its tensors and "meta"
    return torch.load(io.BytesIO(data), weights_only=True)


def read_with_retries(path):
    """read_bytes, retried with backoff. An OSError is never evidence of corruption (a checksum is):
    when it persists the caller stops the run and leaves every checkpoint where it is."""
    for attempt in range(READ_TRIES):
        try:
            return read_bytes(path)
        except OSError as e:
            if attempt + 1 == READ_TRIES:
                raise Unreadable(f"{path}: {e.strerror or e} after {READ_TRIES} tries") from None
            wait = READ_BACKOFF_S * 2 ** attempt
            print(f"[rank {os.environ.get('RANK', 0)}] reading {path} failed ({e.strerror or e}); retrying in {wait:g} s",
                  flush=True)
            time.sleep(wait)


def list_set_aside(ckpt_dir):
    """Checkpoints renamed aside as corrupt (step_N.corrupt, step_N.corrupt1, ...)."""
    return sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") and ".corrupt" in d) \
        if os.path.isdir(ckpt_dir) else []


def set_aside(d):
    """Rename a corrupt checkpoint out of the way, keeping every byte of it for a post-mortem."""
    i = 0
    while os.path.exists(f"{d}.corrupt{i or ''}"):
        i += 1
    os.rename(d, f"{d}.corrupt{i or ''}")
    fsync_dir(os.path.dirname(d))
    return f"{d}.corrupt{i or ''}"


def read_manifest(d, step):
    """The manifest of step directory d, checked for shape. Raises Uncommitted, Unreadable, CorruptCheckpoint."""
    path = os.path.join(d, "manifest.json")
    if not os.path.exists(path):
        raise Uncommitted(f"{d}: no manifest.json, the save never committed")
    data = read_with_retries(path)
    try:
        man = json.loads(data)
        for k, kind in MANIFEST.items():
            if not isinstance(man[k], kind):
                raise TypeError(f"{k!r} is a {type(man[k]).__name__}")
        for k in ("lr", "warmup", "steps"):
            man["schedule"][k] + 0
        ends = [0]
        for sh in man["shards"]:
            if sh["lo"] != ends[-1] or not sh["lo"] <= sh["hi"] or not isinstance(sh["file"], str) or "/" in sh["file"]:
                raise ValueError(f"shard {sh} does not continue at {ends[-1]}")
            ends.append(sh["hi"])
            sh["bytes"] + sh["crc32"]
        if man["step"] != step or ends[-1] != man["numel"]:
            raise ValueError(f"step {man['step']} / {ends[-1]} of {man['numel']} parameters covered")
    except (ValueError, KeyError, TypeError) as e:  # json's errors are ValueErrors
        raise CorruptCheckpoint(f"{path}: malformed manifest ({e.__class__.__name__}: {e})") from None
    return man


def worst_verdict(verdict, ctx):
    """The worst verdict over the ranks, and the lowest rank that reached it: one all-reduce of
    verdict * world + (world - 1 - rank), MAX."""
    if ctx.world == 1:
        return verdict, ctx.rank
    t = torch.tensor([verdict * ctx.world + ctx.world - 1 - ctx.rank], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t) // ctx.world, ctx.world - 1 - int(t) % ctx.world


class SafeCheckpointer(PinnedSnapshots):
    """What a production run adds: every failure is one line on every rank at the same step, nothing committed is
    ever lost, and a load verifies what it reads (the manifest's sizes and CRC-32s) before it trusts it."""
    manifest = None  # the one being verified: read_shard checks each shard against it

    def __init__(self, args, ctx, zero, timeline):
        super().__init__(args, ctx, zero, timeline)
        self.comm = zero.comm
        self.committed, self.error = 0, None  # error: (step, message, local = this rank's own exception)

    def after_step(self, step, opt, loader):
        failed = self.error is not None  # a background save that failed fails this step, on every rank at once
        if self.ctx.world > 1:
            failed = not gpt2.agree(not failed, self.ctx.device)
            self.comm.all_reduce(4, self.ctx.world)
        if failed:
            self.raise_failure()
        super().after_step(step, opt, loader)

    def raise_failure(self):
        """The one-line error of a failed save, on every rank. The writer's handshake already told every
        rank that some rank failed; the rank whose own write or commit failed prints why."""
        super().wait()
        step, why, local = self.error or ("?", "a peer's save failed", False)
        last = f"step {self.committed} is the last committed checkpoint" if self.committed else "nothing was committed"
        gpt2.fail(f"checkpoint save of step {step} failed on rank {self.ctx.rank}: {why}" if local else
                  f"checkpoint save of step {step} failed: {why}", "--ckpt-dir",
                  f"{last}; fix {self.args.ckpt_dir} (space, permissions) and relaunch to resume", local=local)

    def wait(self):
        super().wait()
        if self.error is not None:
            self.raise_failure()

    def save(self, step, opt, loader):
        """Every rank, before its snapshot (a collective): a diverged update is never committed, so the
        newest committed checkpoint, which pruning always keeps, is a finite one."""
        self.wait()  # the previous save commits first (or fails in one line)
        z = self.zero
        moments = [opt.state[p][k] for p in z.params for k in ("exp_avg", "exp_avg_sq")]
        last = f"step {self.committed}, the newest committed checkpoint, is finite and kept" if self.committed \
            else "nothing was committed"
        gpt2.check_finite_weights([z.flat[z.lo: z.hi], *moments], step - 1, self.ctx.device, todo=f"{last}; lower "
                                  "--lr (with another --ckpt-dir), keep --grad-clip on, or raise --warmup")
        super().save(step, opt, loader)
        if self.ctx.world > 1:  # the writer's handshake: every rank's (bytes, crc32), rank 0's verdict on the commit
            self.comm.all_gather(16 * self.ctx.world, self.ctx.world)
            self.comm.broadcast(8, self.ctx.world)

    def gather_reports(self, report):  # every rank's [bytes, crc32] to every rank, on the writer's group
        reports = report.repeat(self.ctx.world, 1)
        if self.group is not None:
            with self.io.compute("gather", "all_gather"):
                all_gather_single(reports.view(-1), report, group=self.group)
        return reports

    def write_and_commit(self, step, tensors, meta):
        """The core's writer with a handshake: a failed write reports 0 bytes, so every rank learns that the
        save failed in the same all-gather, and rank 0 broadcasts whether its commit succeeded."""
        t0, d, mine = time.perf_counter(), step_dir(self.args.ckpt_dir, step), None
        try:
            if os.path.exists(os.path.join(d, "manifest.json")):  # never overwrite a committed checkpoint
                raise FileExistsError(f"{d} already holds a committed checkpoint; not overwritten")
            with self.io.compute(f"write {step}", "io"):
                report = self.write(d, tensors, meta)
        except BaseException as e:  # still join the handshake below, so no peer waits for us forever
            report, mine = torch.zeros(2, dtype=torch.int64), f"{e.__class__.__name__}: {e}"
        try:
            reports = self.gather_reports(report)
            failed = [r for r in range(self.ctx.world) if not reports[r, 0]]
            if failed:  # every rank learns it here, so every rank stops at the same step
                self.error = (step, mine, True) if mine else (step, f"rank(s) {failed} could not write their shard", False)
                return
            verdict = torch.ones(1, dtype=torch.int64)
            if self.ctx.master:
                try:
                    with self.io.compute(f"commit {step}", "io"):
                        self.commit(step, d, reports, meta["loader"])
                except BaseException as e:
                    verdict[0], mine = 0, f"{e.__class__.__name__}: {e}"
            if self.group is not None:
                dist.broadcast(verdict, 0, group=self.group)
            if not verdict[0]:
                self.error = (step, mine, True) if self.ctx.master else (step, "rank 0 could not commit the manifest", False)
                return
            self.committed = step
            gpt2.RUN["resume"] = self.resume_hint(step)  # what a Ctrl-C prints, on every rank
            self.ms["write"].append(1e3 * (time.perf_counter() - t0))
            self.shard_mb = int(report[0]) / 1e6
        except BaseException as e:  # the handshake itself failed (a peer died)
            self.error = (step, f"{e.__class__.__name__}: {e}", True)

    def commit(self, step, d, reports, loader_state):
        super().commit(step, d, reports, loader_state)
        self.prune(step)

    def prune(self, newest):
        """Keep the last --keep committed checkpoints (the newest among them, which is finite: see save);
        drop older ones and older uncommitted leftovers. Newer directories and the ones set aside as corrupt
        are never touched."""
        kept = 0
        for s in list_checkpoints(self.args.ckpt_dir):
            committed = os.path.exists(os.path.join(step_dir(self.args.ckpt_dir, s), "manifest.json"))
            if s <= newest and committed and kept < self.args.keep:
                kept += 1
            elif s < newest:
                shutil.rmtree(step_dir(self.args.ckpt_dir, s), ignore_errors=True)

    def read_shard(self, d, sh):
        """Read a whole shard with retries (a missing one too: a shared filesystem may lag), verify size,
        checksum and metadata against the manifest."""
        path = os.path.join(d, sh["file"])
        data = read_with_retries(path)
        check_bytes(path, data, sh)
        tensors = parse_shard(data)
        if tensors["meta"]["lo"] != sh["lo"] or tensors["meta"]["step"] != self.manifest["step"]:
            raise CorruptCheckpoint(f"{path}: its metadata disagrees with the manifest")
        return tensors

    def load_latest(self, opt, loader):
        self.committed = start = self.load_verified(opt, loader)
        gpt2.RUN["resume"] = self.resume_hint(start) if start else \
            f"no checkpoint was committed yet; give a new --out (or delete {self.args.out}) to start over"
        if start == self.args.fail_at:
            self.crash(start)
        return start

    def load_verified(self, opt, loader):
        """Try the checkpoints newest first; every rank must verify its part of one. A reader never deletes:
        uncommitted directories are skipped and left, corrupt ones renamed aside, and an I/O error or a
        checkpoint of another schedule or shape stops the run with every checkpoint in place. Returns the
        step, or 0 when none exists (or none verifies and --allow-fresh-start is given)."""
        args, ctx = self.args, self.ctx
        steps, n_aside = list_checkpoints(args.ckpt_dir), len(list_set_aside(args.ckpt_dir))
        if ctx.world > 1:  # everyone walks rank 0's list, so no rank can disagree on the candidates
            n = torch.tensor([len(steps), n_aside], dtype=torch.int64, device=ctx.device)  # NCCL wants device tensors
            dist.broadcast(n, 0)
            n_aside = int(n[1])
            t = torch.tensor(steps if ctx.master else [0] * int(n[0]), dtype=torch.int64, device=ctx.device)
            if len(t):
                dist.broadcast(t, 0)
            steps = t.tolist()
        corrupt = []
        for step in steps:
            d = step_dir(args.ckpt_dir, step)
            verdict, why, diff = OK, "", []
            try:
                man = read_manifest(d, step)
                diff = mismatched_flags(man, args, self.zero, ctx.world)
                if diff:
                    verdict = MISMATCH
                else:
                    self.manifest = man
                    slices, rng = self.read_slices(man, d)
            except Uncommitted as e:
                verdict, why = UNCOMMITTED, str(e)
            except CorruptCheckpoint as e:
                verdict, why = CORRUPT, str(e)
            except Unreadable as e:
                verdict, why = UNREADABLE, str(e)
            worst, who = worst_verdict(verdict, ctx)
            if worst == UNREADABLE:
                todo = (f"nothing was moved or deleted; fix the filesystem and relaunch, or move {d} out of "
                        f"{args.ckpt_dir} to resume from an older checkpoint")
                if verdict == UNREADABLE:
                    gpt2.fail(f"cannot read checkpoint step {step}: {why}", "--ckpt-dir", todo, local=True)
                gpt2.fail(f"rank {who} cannot read checkpoint step {step}", "--ckpt-dir", todo)
            if worst == MISMATCH and verdict != MISMATCH:  # a lagging filesystem: rank 0 may not see it yet
                gpt2.fail(f"rank {who} found {d} written with other flags", "--ckpt-dir", "compare its manifest.json")
            if worst == MISMATCH:  # the manifest is one file: every rank found the same differences
                refuse_another_run(man, d, args, self.zero, ctx.world)
            if worst == UNCOMMITTED:
                print0(f"checkpoint step {step} was never committed (no manifest.json): skipped, left in place")
                continue
            if worst == CORRUPT:
                if verdict == CORRUPT:
                    print(f"[rank {ctx.rank}] checkpoint step {step} is corrupt: {why}", flush=True)
                if ctx.master:  # after the all-reduce: no rank still reads it
                    print0(f"checkpoint step {step} renamed aside to {set_aside(d)}; trying the previous one")
                corrupt.append(step)
                continue
            self.resume(man, slices, rng, opt, loader)
            self.comm.take_mb()  # the resume's all-gather is not a training step's traffic
            if man["world"] != ctx.world:
                print0(f"resharding: written by {man['world']} ranks, loaded by {ctx.world}")
            print0(f"resumed from step {step}" + (f"; --steps {args.steps}: nothing left to train" if step >= args.steps else ""))
            return step
        if corrupt or n_aside:
            what = f"{len(corrupt) + n_aside} checkpoint(s) in {args.ckpt_dir} are corrupt (renamed aside as *.corrupt)"
            if not args.allow_fresh_start:
                gpt2.fail(f"{what} and none verifies", "--ckpt-dir", "inspect them, or pass --allow-fresh-start to "
                          "train from step 0 (they stay aside), or give another --ckpt-dir")
            print0(f"{what}; starting from step 0 (--allow-fresh-start)")
        return 0


# ---- Appendix ----
# The command line: the core's parser with the extensions' flags, every check before the process group starts, and
# the classes picked with plain ifs. Step directories' names. References: ZeRO (Rajbhandari et al. 2020, section 5.1,
# P_os); CheckFreq (Mohan et al., FAST'21, section 4: snapshot to memory, persist in the background); Check-N-Run
# (Eisenman et al., NSDI'22); DCP and Megatron-LM's dist_checkpointing (resharding by global offsets).
# Elastic restarts: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --max-restarts 3 --nproc_per_node=8
# checkpoint.py --safe ... restarts the job from the last commit when a worker dies (a fresh TCPStore per attempt:
# pytorch/pytorch#135712); --fail-at kills one worker on the first attempt to show it.


def cli(argv=None):
    args = parse_args(argv)
    Checkpointer = AsyncCheckpointer
    if args.naive:
        Checkpointer = SyncCheckpointer
    if args.pinned:
        Checkpointer = PinnedSnapshots
    if args.safe:
        Checkpointer = SafeCheckpointer
    train(args, Checkpointer)  # --ckpt-dir is locked by rank 0 in check_args


def parse_args(argv=None):
    p = make_parser()
    p.add_argument("--pinned", action="store_true", help="snapshot into reused pinned host buffers, without waiting "
                                                         "for the copies on the training thread")
    p.add_argument("--safe", action="store_true", help="the production checkpointer (pinned too): a failed save stops "
                   "every rank in one line, reads retried, corrupt commits set aside, --keep, --allow-fresh-start")
    p.add_argument("--keep", type=int, help="--safe: committed checkpoints to keep, older ones pruned (default 2)")
    p.add_argument("--allow-fresh-start", action="store_true",
                   help="--safe: when --ckpt-dir holds checkpoints and none verifies, train from step 0 instead of stopping")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    gpt2.check_args(args)
    gpt2.check_range(args.save_every, "--save-every", 0, todo="give 0 (never) or a number of steps")
    gpt2.check_range(args.fail_at, "--fail-at", -1, todo="give -1 (never) or a step")
    check_ckpt_flags(args)
    for flag, given in (("--keep", args.keep is not None), ("--allow-fresh-start", args.allow_fresh_start)):
        if given and not args.safe:
            gpt2.fail(f"{flag} belongs to the --safe checkpointer", flag, f"add --safe, or drop {flag}")
    if args.pinned and not args.save_every:
        gpt2.fail("--pinned without --save-every: nothing would be saved", "--pinned",
                  "add --save-every N, or drop --pinned")
    if args.naive and (args.safe or args.pinned):
        gpt2.fail(f"--naive saves on the training thread; {'--safe' if args.safe else '--pinned'} saves in the "
                  "background", "--naive", "choose one")
    args.keep = 2 if args.keep is None else args.keep
    gpt2.check_range(args.keep, "--keep", 1, todo="keep at least the newest checkpoint")
    check_world_size(args)
    old = [n for n in ("metrics.jsonl", "model.pt") if os.path.exists(os.path.join(args.out, n))]
    if old and not committed_steps(args.ckpt_dir):  # gpt2.setup(resumes=True) leaves this check to us
        why = f"{args.ckpt_dir} holds no committed checkpoint" if args.ckpt_dir else "no --ckpt-dir was given"
        gpt2.fail(f"{args.out} holds an earlier run ({', '.join(old)}) and {why} to resume it from", "--out",
                  "choose a new --out, give the --ckpt-dir that run saved into, or delete that directory to start over")
    if args.ckpt_dir:
        if int(os.environ.get("RANK", 0)) == 0:  # one run per directory: a second would resume our commits
            gpt2.lock_dir(args.ckpt_dir, "--ckpt-dir")  # and prune our in-flight saves
        else:
            gpt2.make_dir(args.ckpt_dir, "--ckpt-dir")


def check_world_size(args):  # Zero1's slices: the last rank must hold something (same verdict on every rank)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not getattr(args, "init_from", None):
        with torch.device("meta"):
            numel = sum(p.numel() for p in gpt2.GPT(gpt2.model_config(args)).parameters())
        if (world - 1) * -(-numel // world) >= numel:
            gpt2.fail(f"{world} ranks for {numel} parameters: the last rank would hold nothing", "--nproc_per_node",
                      "use fewer ranks or a larger model")


def step_dir(ckpt_dir, step):
    return os.path.join(ckpt_dir, f"step_{step:06d}")


def list_checkpoints(ckpt_dir):  # steps with a step_* directory (committed or not), newest first
    return sorted((int(d[5:]) for d in os.listdir(ckpt_dir) if d.startswith("step_") and d[5:].isdigit()),
                  reverse=True) if os.path.isdir(ckpt_dir) else []


def committed_steps(ckpt_dir):
    return [s for s in list_checkpoints(ckpt_dir or "") if os.path.exists(os.path.join(step_dir(ckpt_dir, s), "manifest.json"))]


if __name__ == "__main__":
    gpt2.run_main(cli)
