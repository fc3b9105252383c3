"""
checkpoint.py - sharded, asynchronous, crash-safe checkpoints for a ZeRO-1 run, with resharding
and bit-exact resume.

The idea: a long pre-training run will be killed (preemption, a dead GPU, a bug at hour 30), so it
must be able to continue exactly where it stopped. Here the optimizer state is sharded (a minimal
ZeRO-1, written below: every rank owns 1/N of the fp32 parameters and of AdamW's two moments), so the
checkpoint is sharded too: each rank writes only its own slice, tagged with its global offsets, in the
background while training goes on. A checkpoint exists only once rank 0 has seen every shard durable
and renamed the manifest into place; on restart the newest checkpoint whose checksums verify is loaded,
onto any number of ranks (the slices are re-cut by global offset), together with the data-loader
position and the RNG states: the resumed losses equal an uninterrupted run's bit for bit at the same
world size, and within about 1e-7 on another (fp32 sums in another order; tests/test_checkpoint.py).

    ZeRO-1 (2 ranks): one flat fp32 vector of all parameters, padded to a multiple of the world size
        flat params  [=========== rank 0 slice ===========|=========== rank 1 slice ===========]
        grads        every rank holds full grads -> reduce-scatter -> each keeps the mean of its slice
        AdamW        each rank updates its slice (params, exp_avg, exp_avg_sq) -> all-gather params

    save at step S (every --save-every steps)
        main thread:  wait for save S-k | copy my slices + RNG + loader position to CPU | train on
        writer:       step_S/rankR-of-N.safetensors (write, fsync, rename, fsync the directory, crc32)
                      -> all-gather (ok, bytes, crc32) on a separate gloo group
                      -> rank 0: manifest.json.tmp, fsync, rename to manifest.json (the commit), prune
                      -> broadcast of the commit's verdict: a failed save fails every rank's next step
    ckpt_dir/step_000010/{rank00000-of-00002.safetensors, rank00001-of-00002.safetensors, manifest.json}

    load (N writers -> M readers): rank r of M needs global range [r*L, (r+1)*L), L = padded/M;
        it reads and verifies only the old shards overlapping that range and copies the overlaps.

A reader never destroys a checkpoint. Newest first, every rank gives its verdict and the worst wins:
    no manifest.json         never committed: skipped, left in place
    bad CRC-32 / manifest    corrupt: renamed aside to step_S.corrupt (kept), try the previous one
    other flags              the manifest records shape, --lr --warmup --steps, global batch, seq len:
                             refused, naming the flags (another world size, same global batch: resharded)
    OSError                  retried (READ_TRIES, backoff), then the run stops, nothing moved
and when checkpoints were set aside and none verifies, the run stops unless --allow-fresh-start.
rank 0 holds --ckpt-dir/LOCK for the run: a second run on the same directory refuses at once.

GPT-2 124M at 8 ranks (P = 124,475,904 = 8 x 15,559,488; tests/bench_checkpoint.py --per-rank-124m,
fake process group, rank 0, measured = closed form unless shown):
    sent per step      871.3 MB = reduce-scatter + all-gather of the fp32 flat vector, 2 x 7/8 x 4P (+12 B)
    memory per rank    params 497.9 MB (4P, all of them) + grads 560.1 MB (4P flat + 4P/8 slice)
                       + AdamW 124.5 MB (8P/8) = 1182.5 MB, against ddp.py's 16P = 1991.6 MB
    activations        8.82 GB at B=16, T=1024, bf16 (+ 247 MB of bf16 weight copies): as ddp.py
    one save           186.7 MB written per rank (12P/8: params + 2 moments; 186.72 measured with header
                       and RNG) + a 7.7 KB manifest on rank 0; the async snapshot holds 186.7 MB of
                       (pinned) host memory per rank, reused from save to save

Launch:
    torchrun --nproc_per_node=2 checkpoint.py --ckpt-dir out/ckpt --save-every 50   # resumes if it can
    torchrun --nproc_per_node=8 checkpoint.py --model gpt2 --data data/fineweb10B --batch-size 16 \\
        --grad-accum 4 --compile --ckpt-dir /scratch/ckpt --save-every 250 --keep 3
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --max-restarts 3 --nproc_per_node=8 \\
        checkpoint.py ...    # a dead worker restarts the job, which resumes from the last commit. The env
        # var gives each attempt a fresh TCPStore: a shared one keeps the dead attempt's addresses and the
        # new ranks may connect to them (pytorch/pytorch#135712; seen here with gloo in torch 2.13)
    python checkpoint.py --ckpt-dir out/ckpt --batch-size 16         # one process, same global batch: 2 -> 1

References: Rajbhandari et al. 2020, ZeRO (section 5.1, P_os: optimizer-state partitioning);
Mohan et al. 2021, CheckFreq (FAST'21, section 4: snapshot to memory, persist in the background);
Eisenman et al. 2022, Check-N-Run (NSDI'22); PyTorch torch.distributed.checkpoint (DCP) and
Megatron-LM's distributed checkpointing (resharding by global offsets); the safetensors file layout.

From gpt2.py: the model and data (build_model, make_loaders), the recipe (make_adamw, set_lr,
accumulate_grads, evaluate, check_finite), the plumbing (setup, collective names, CommMeter, Metrics,
Profiler, print0) and the one-line errors and locks (make_parser, check_args, fail, lock_dir, run_main).
"""
import json
import os
import shutil
import threading
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

import gpt2
from gpt2 import all_gather_single, print0, reduce_scatter_single

# ----------------------------------------------------------------------------------------------------
# ZeRO-1: flat fp32 parameters and gradients, AdamW on this rank's slice only


class Zero1:
    """Every parameter becomes a view into one flat fp32 vector (and every .grad a view into a flat
    gradient vector), so the collectives run on a single buffer and a rank's shard is a plain slice
    [lo, hi) of it. 2-D weights come first, so a slice splits into at most one decayed and one
    non-decayed piece and can be handed to torch's AdamW as (at most) two parameters."""

    def __init__(self, model, args, ctx, comm):
        self.ctx, self.comm, self.world = ctx, comm, ctx.world
        self.config = dict(model.config.__dict__)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # the tied wte counts once
        named = [np_ for np_ in named if np_[1].dim() >= 2] + [np_ for np_ in named if np_[1].dim() < 2]
        self.numel = sum(p.numel() for _, p in named)
        self.n_decay = sum(p.numel() for _, p in named if p.dim() >= 2)
        self.shard = -(-self.numel // self.world)  # ceil: pad so every rank holds an equal slice
        if (self.world - 1) * self.shard >= self.numel:  # same verdict on every rank: no hang
            gpt2.fail(f"{self.world} ranks for {self.numel} parameters: the last rank would hold nothing",
                      "--nproc_per_node", "use fewer ranks or a larger model")
        self.flat = torch.zeros(self.shard * self.world, device=ctx.device, dtype=torch.float32)
        self.grad = torch.zeros_like(self.flat)
        self.layout, off = [], 0
        for name, p in named:
            n = p.numel()
            self.flat[off: off + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[off: off + n].view_as(p)
            p.grad = self.grad[off: off + n].view_as(p)  # backward accumulates in place into the flat buffer
            self.layout.append([name, list(p.shape), off])
            off += n
        self.lo, self.hi = ctx.rank * self.shard, min((ctx.rank + 1) * self.shard, self.numel)  # real, unpadded
        # the reduce-scatter output; with one rank the flat gradient itself
        self.grad_shard = self.grad[self.lo: self.lo + self.shard] if self.world == 1 else \
            torch.zeros(self.shard, device=ctx.device, dtype=torch.float32)
        # this rank's slice as optimizer parameters: views, so AdamW writes straight into self.flat
        self.pieces = []  # (a, b, weight_decay) in global offsets
        if self.lo < self.n_decay:
            self.pieces.append((self.lo, min(self.hi, self.n_decay), args.weight_decay))
        if self.hi > self.n_decay:
            self.pieces.append((max(self.lo, self.n_decay), self.hi, 0.0))
        self.params = []
        for a, b, _ in self.pieces:
            p = torch.nn.Parameter(self.flat[a:b])
            p.grad = self.grad_shard[a - self.lo: b - self.lo]
            self.params.append(p)

    def optimizer_groups(self):
        return [{"params": [p], "weight_decay": wd} for p, (_, _, wd) in zip(self.params, self.pieces)]

    def reduce_scatter_grads(self):
        """Sum the full gradients over ranks, keep my slice, divide by N: the data-parallel mean."""
        if self.world > 1:
            reduce_scatter_single(self.grad_shard, self.grad)  # SUM: gloo has no AVG
            self.grad_shard.div_(self.world)
            self.comm.reduce_scatter(self.grad.numel() * 4, self.world)

    def clip_global_grad_norm(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model, from the slices: sum of squares of my
        slice, all-reduced, is the squared global norm (padding gradients are zero)."""
        sq = self.grad_shard.square().sum()
        if self.world > 1:
            dist.all_reduce(sq)
            self.comm.all_reduce(4, self.world)
        coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        self.grad_shard.mul_(coef)

    def all_gather_params(self):
        """Every rank's updated slice to every rank: in place, the input is my slice of the output."""
        if self.world > 1:
            all_gather_single(self.flat, self.flat[self.ctx.rank * self.shard: (self.ctx.rank + 1) * self.shard])
            self.comm.all_gather(self.flat.numel() * 4, self.world)

    def zero_grad(self):
        self.grad.zero_()  # never set_to_none: the .grad views must keep pointing into self.grad


# ----------------------------------------------------------------------------------------------------
# Shard files: the safetensors layout (8-byte header length, JSON header, raw bytes), CRC-32 on the fly.
# CRC-32 catches accidental corruption (flipped bits, torn or truncated writes) at ~3 GB/s; it is not a
# defence against deliberate tampering (that would take a cryptographic hash, ~5x slower here).

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}


class CorruptCheckpoint(Exception):
    """A shard whose size or CRC-32 differs from the manifest's, or a malformed manifest: the only two
    verdicts that make a checkpoint unusable. It is then renamed aside (step_N.corrupt), never deleted."""


class Uncommitted(Exception):
    """A step directory without manifest.json: a save that never finished. Skipped and left in place."""


class Unreadable(Exception):
    """An OSError that outlived READ_TRIES: the filesystem's fault, not the checkpoint's. The run stops."""


READ_TRIES, READ_BACKOFF_S = 3, 0.5  # a shared filesystem's hiccups (failover, stale handle) pass in seconds


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the rename itself durable, not only the file's bytes
    finally:
        os.close(fd)


def write_shard(path, tensors, meta):
    """Write CPU tensors to path (via path.tmp + fsync + rename + fsync of the directory) and return
    (bytes, crc32). Every rank does all of it before it reports its shard durable: on a multi-node
    filesystem rank 0's fsync of the directory says nothing about another node's rename."""
    header, off = {"__metadata__": {k: json.dumps(v) for k, v in meta.items()}}, 0
    for k, t in tensors.items():
        header[k] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.numel() * t.element_size()]}
        off += t.numel() * t.element_size()
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    chunks = [len(hb).to_bytes(8, "little"), hb] + [t.reshape(-1).view(torch.uint8).numpy() for t in tensors.values()]
    crc, size = 0, 0
    with open(path + ".tmp", "wb") as f:
        for c in chunks:
            f.write(c)  # both release the GIL on large buffers: training goes on meanwhile
            crc = zlib.crc32(c, crc)
            size += len(c)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(os.path.dirname(path))
    return size, crc


def read_bytes(path):
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)  # straight into a writable buffer: no extra copy for frombuffer
    return data


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


def read_shard(path, nbytes, crc32):
    """Read a whole shard, verify size and checksum, return (tensors, metadata)."""
    data = read_with_retries(path)
    if len(data) != nbytes or zlib.crc32(data) != crc32:
        raise CorruptCheckpoint(f"{path}: size {len(data)} / crc32 {zlib.crc32(data):08x} differ from the "
                                f"manifest's {nbytes} / {crc32:08x}")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + n])
    meta = {k: json.loads(v) for k, v in header.pop("__metadata__").items()}
    dt = {v: k for k, v in DTYPES.items()}
    tensors = {}
    for k, m in header.items():
        a, b = m["data_offsets"]
        tensors[k] = torch.frombuffer(data, dtype=dt[m["dtype"]], count=(b - a) // dt[m["dtype"]].itemsize,
                                      offset=8 + n + a).view(m["shape"]) if b > a else torch.empty(m["shape"], dtype=dt[m["dtype"]])
    return tensors, meta


def step_dir(ckpt_dir, step):
    return os.path.join(ckpt_dir, f"step_{step:06d}")


def list_checkpoints(ckpt_dir):
    """Steps that have a step_* directory (committed or not), newest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    steps = [int(d[5:]) for d in os.listdir(ckpt_dir) if d.startswith("step_") and d[5:].isdigit()]
    return sorted(steps, reverse=True)


def list_set_aside(ckpt_dir):
    """Checkpoints renamed aside as corrupt (step_N.corrupt, step_N.corrupt1, ...)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") and ".corrupt" in d)


def set_aside(d):
    """Rename a corrupt checkpoint out of the way, keeping every byte of it for a post-mortem."""
    i = 0
    while os.path.exists(f"{d}.corrupt{i or ''}"):
        i += 1
    os.rename(d, f"{d}.corrupt{i or ''}")
    fsync_dir(os.path.dirname(d))
    return f"{d}.corrupt{i or ''}"


# ----------------------------------------------------------------------------------------------------
# Save: snapshot to CPU memory, write in a background thread, commit by rank 0's manifest rename


class AsyncCheckpointer:
    def __init__(self, args, ctx, zero, comm):
        self.args, self.ctx, self.zero, self.comm = args, ctx, zero, comm
        self.thread, self.buffers, self.committed = None, None, None
        self.error = None  # (step, message, local): local = this rank's own exception, not a peer's
        # the writer thread talks over its own gloo group: collectives on one group must be issued in
        # the same order on every rank, and the training thread's order is not the writer's
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout)) if ctx.world > 1 else None

    def failed(self):
        """Whether a finished background save failed (the training loop all-reduces it with the loss)."""
        return self.error is not None

    def raise_failure(self):
        """The one-line error of a failed save, on every rank. The writer's handshake already told every
        rank that some rank failed; the rank whose own write or commit failed prints why."""
        self.wait_thread()
        step, why, local = self.error or ("?", "a peer's save failed", False)
        last = f"step {self.committed} is the last committed checkpoint" if self.committed else "nothing was committed"
        gpt2.fail(f"checkpoint save of step {step} failed on rank {self.ctx.rank}: {why}" if local else
                  f"checkpoint save of step {step} failed: {why}", "--ckpt-dir",
                  f"{last}; fix {self.args.ckpt_dir} (space, permissions) and relaunch to resume", local=local)

    def wait_thread(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def wait(self):
        self.wait_thread()
        if self.error is not None:
            self.raise_failure()

    def snapshot(self, opt):
        """Copy this rank's slices to CPU (pinned, reused) buffers. On CUDA the copies are queued on
        the compute stream, so the next optimizer step cannot overwrite them first; the writer waits
        on an event. Returns the tensors to write."""
        z, n = self.zero, self.zero.hi - self.zero.lo
        cuda = self.ctx.device.type == "cuda"
        if self.buffers is None:
            self.buffers = {k: torch.empty(n, dtype=torch.float32, pin_memory=cuda) for k in ("params", "exp_avg", "exp_avg_sq")}
        b = self.buffers
        b["params"].copy_(z.flat[z.lo: z.hi], non_blocking=cuda)
        for p, (lo, hi, _) in zip(z.params, z.pieces):
            st = opt.state[p]
            b["exp_avg"][lo - z.lo: hi - z.lo].copy_(st["exp_avg"], non_blocking=cuda)
            b["exp_avg_sq"][lo - z.lo: hi - z.lo].copy_(st["exp_avg_sq"], non_blocking=cuda)
        out = dict(b, rng_cpu=torch.get_rng_state())
        if cuda:
            out["rng_cuda"] = torch.cuda.get_rng_state(self.ctx.device)
            event = torch.cuda.Event()
            event.record()
            return out, event
        return out, None

    def check_finite(self, step, opt):
        """Every rank, before its snapshot (a collective): a diverged update is never committed, so the
        newest committed checkpoint, which pruning always keeps, is a finite one."""
        z = self.zero
        moments = [opt.state[p][k] for p in z.params for k in ("exp_avg", "exp_avg_sq")]
        try:
            gpt2.check_finite_weights([z.flat[z.lo: z.hi], *moments], step - 1, self.ctx.device)
        except gpt2.UsageError as e:
            last = f"step {self.committed}, the newest committed checkpoint, is finite and kept" if self.committed \
                else "nothing was committed"
            gpt2.fail(str(e).split(" (--lr): ")[0], "--lr", f"{last}; lower --lr (with another --ckpt-dir), "
                      "keep --grad-clip on, or raise --warmup")

    def save(self, step, opt, loader):
        """Block only for the previous save and for the copy to CPU; the rest runs in the background."""
        self.wait()  # a new save waits for the previous one (and reuses its buffers)
        self.check_finite(step, opt)
        tensors, event = self.snapshot(opt)
        meta = {"step": step, "rank": self.ctx.rank, "world": self.ctx.world, "lo": self.zero.lo,
                "hi": self.zero.hi, "loader": loader.state_dict(), "config": self.zero.config}
        if self.ctx.world > 1:
            self.comm.all_gather(self.ctx.world * 24, self.ctx.world)  # the writer's commit handshake
            self.comm.broadcast(8, self.ctx.world)  # and rank 0's verdict on the commit
        self.thread = threading.Thread(target=self._write_and_commit, args=(step, tensors, meta, event), daemon=True)
        self.thread.start()

    def _write_and_commit(self, step, tensors, meta, event):
        ctx, d = self.ctx, step_dir(self.args.ckpt_dir, step)
        name = f"rank{ctx.rank:05d}-of-{ctx.world:05d}.safetensors"
        report = torch.zeros(3, dtype=torch.int64)  # ok flag, byte count, crc32
        mine = None
        try:
            if event is not None:
                event.synchronize()
            os.makedirs(d, exist_ok=True)
            if os.path.exists(os.path.join(d, "manifest.json")):  # never overwrite a committed checkpoint
                raise FileExistsError(f"{d} already holds a committed checkpoint; not overwritten")
            report[:] = torch.tensor([1, *write_shard(os.path.join(d, name), tensors, meta)])
            fsync_dir(self.args.ckpt_dir)  # the step directory's own entry, whichever rank created it
        except BaseException as e:  # still join the handshake below, so no peer waits for us forever
            mine = f"{e.__class__.__name__}: {e}"
        try:
            reports = torch.zeros(ctx.world, 3, dtype=torch.int64)
            if self.group is not None:
                all_gather_single(reports.view(-1), report, group=self.group)
            else:
                reports[0] = report
            failed = [r for r in range(ctx.world) if not reports[r, 0]]
            if failed:  # every rank learns it here, so every rank stops at the same step
                self.error = (step, mine, True) if mine else (step, f"rank(s) {failed} could not write their shard", False)
                return
            verdict = torch.ones(1, dtype=torch.int64)
            if ctx.master:
                try:
                    self._commit(step, d, reports, meta["loader"])
                except BaseException as e:
                    verdict[0], mine = 0, f"{e.__class__.__name__}: {e}"
            if self.group is not None:
                dist.broadcast(verdict, 0, group=self.group)
            if not verdict[0]:
                self.error = (step, mine, True) if ctx.master else (step, "rank 0 could not commit the manifest", False)
                return
            self.committed = step
            gpt2.RUN["resume"] = f"rerun the same command; it resumes from the newest committed checkpoint in {self.args.ckpt_dir}"
        except BaseException as e:  # the handshake itself failed (a peer died)
            self.error = (step, f"{e.__class__.__name__}: {e}", True)

    def _commit(self, step, d, reports, loader_state):
        """Rank 0, once every shard is durable: the manifest goes last, by atomic rename. It records what
        a resume must agree with: the model's shape and layout, the LR schedule, the global batch, and
        where the data loader stands."""
        z, W, a = self.zero, self.ctx.world, self.args
        shards = []
        for r, (_, nbytes, crc) in enumerate(reports.tolist()):
            shards.append({"file": f"rank{r:05d}-of-{W:05d}.safetensors", "lo": r * z.shard, "hi": min((r + 1) * z.shard, z.numel),
                           "bytes": nbytes, "crc32": crc})
        manifest = {"format": 2, "step": step, "world": W, "numel": z.numel, "config": z.config, "layout": z.layout,
                    "schedule": {"lr": a.lr, "warmup": a.warmup, "steps": a.steps}, "global_batch": W * a.batch_size * a.grad_accum,
                    "seq_len": a.seq_len, "loader": loader_state, "shards": shards}
        path = os.path.join(d, "manifest.json")
        with open(path + ".tmp", "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        fsync_dir(d)
        self.prune(step)

    def prune(self, newest):
        """Keep the last --keep committed checkpoints; drop older ones and older uncommitted leftovers.
        Newer directories and the ones set aside as corrupt are never touched."""
        kept = 0
        for s in list_checkpoints(self.args.ckpt_dir):
            committed = os.path.exists(os.path.join(step_dir(self.args.ckpt_dir, s), "manifest.json"))
            if s <= newest and committed and kept < self.args.keep:
                kept += 1
            elif s < newest:
                shutil.rmtree(step_dir(self.args.ckpt_dir, s), ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# Load: the newest checkpoint that verifies, re-cut to this world's slices. A reader never deletes:
# uncommitted directories are skipped and left, corrupt checkpoints are renamed aside, and an I/O error
# or a checkpoint of another run's schedule or shape stops the run with every checkpoint in place.

MANIFEST = {"format": int, "step": int, "world": int, "numel": int, "config": dict, "layout": list, "schedule": dict,
            "global_batch": int, "seq_len": int, "loader": dict, "shards": list}


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


def resume_mismatch(man, args, zero, world):
    """The flags whose values differ from the checkpoint's: [(flag, theirs, ours)]. A different world
    size with the same global batch is not among them: that is resharding."""
    flag_of = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd"}
    diff = [(flag_of.get(k, "--model"), f"{k}={v}", f"{k}={zero.config.get(k)}")
            for k, v in man["config"].items() if zero.config.get(k) != v]
    if not diff and man["layout"] != zero.layout:
        diff.append(("--model", "another parameter layout", "this model's"))
    ours = {"lr": args.lr, "warmup": args.warmup, "steps": args.steps}
    diff += [(f"--{k}", man["schedule"][k], v) for k, v in ours.items() if man["schedule"][k] != v]
    gb = world * args.batch_size * args.grad_accum
    if man["global_batch"] != gb:
        diff.append(("--batch-size/--grad-accum", f"global batch {man['global_batch']}",
                     f"global batch {gb} = {world} ranks x {args.batch_size} x {args.grad_accum}"))
    if man["seq_len"] != args.seq_len:
        diff.append(("--seq-len", man["seq_len"], args.seq_len))
    return diff


def read_slices(man, d, zero, ctx):
    """This rank's slices of a verified manifest's checkpoint (any writer world size)."""
    out = {k: torch.empty(zero.hi - zero.lo) for k in ("params", "exp_avg", "exp_avg_sq")}
    rng = {}
    for r, sh in enumerate(man["shards"]):
        a, b = max(sh["lo"], zero.lo), min(sh["hi"], zero.hi)
        if a >= b and r != ctx.rank:
            continue  # a shard I need neither for my slice nor for my RNG state
        tensors, meta = read_shard(os.path.join(d, sh["file"]), sh["bytes"], sh["crc32"])
        if meta["lo"] != sh["lo"] or meta["step"] != man["step"]:
            raise CorruptCheckpoint(f"{d}/{sh['file']}: its metadata disagrees with the manifest")
        for k in out:
            if a < b:
                out[k][a - zero.lo: b - zero.lo] = tensors[k][a - sh["lo"]: b - sh["lo"]]
        if r == ctx.rank:  # a rank of the new world that did not exist in the old keeps its seeded RNG
            rng = {k: tensors[k].clone() for k in ("rng_cpu", "rng_cuda") if k in tensors}
    return out, rng


OK, UNCOMMITTED, CORRUPT, MISMATCH, UNREADABLE = range(5)  # a rank's verdict on one candidate; worst wins


def agree(verdict, ctx):
    """The worst verdict over the ranks, and the lowest rank that reached it: one all-reduce of
    verdict * world + (world - 1 - rank), MAX."""
    if ctx.world == 1:
        return verdict, ctx.rank
    t = torch.tensor([verdict * ctx.world + ctx.world - 1 - ctx.rank], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t) // ctx.world, ctx.world - 1 - int(t) % ctx.world


def load_latest(args, zero, opt, loader, ctx):
    """Try the checkpoints newest first; every rank must verify its part of one. Returns its step, or 0
    when the directory holds no checkpoint (or none verifies and --allow-fresh-start is given)."""
    if not args.ckpt_dir:
        return 0
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
            diff = resume_mismatch(man, args, zero, ctx.world)
            if diff:
                verdict = MISMATCH
            else:
                slices, rng = read_slices(man, d, zero, ctx)
        except Uncommitted as e:
            verdict, why = UNCOMMITTED, str(e)
        except CorruptCheckpoint as e:
            verdict, why = CORRUPT, str(e)
        except Unreadable as e:
            verdict, why = UNREADABLE, str(e)
        worst, who = agree(verdict, ctx)
        if worst == UNREADABLE:
            todo = (f"nothing was moved or deleted; fix the filesystem and relaunch, or move {d} out of "
                    f"{args.ckpt_dir} to resume from an older checkpoint")
            if verdict == UNREADABLE:
                gpt2.fail(f"cannot read checkpoint step {step}: {why}", "--ckpt-dir", todo, local=True)
            gpt2.fail(f"rank {who} cannot read checkpoint step {step}", "--ckpt-dir", todo)
        if worst == MISMATCH and verdict != MISMATCH:  # a lagging filesystem: rank 0 may not see it yet
            gpt2.fail(f"rank {who} found {d} written with other flags", "--ckpt-dir", "compare its manifest.json")
        if worst == MISMATCH:  # the manifest is one file: every rank found the same differences
            gpt2.fail(f"{d} was written with {' '.join(f'{f} {a}' for f, a, _ in diff)}, this run has "
                      f"{' '.join(f'{f} {b}' for f, _, b in diff)}", " ".join(f for f, _, _ in diff),
                      "resume with the checkpoint's values (a different world size with the same global batch is "
                      "fine), or give another --ckpt-dir")
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
        with torch.no_grad():
            zero.flat[zero.lo: zero.hi].copy_(slices["params"])
        zero.all_gather_params()  # everyone's slice to everyone: the full weights again
        zero.comm.take_mb()
        sd = opt.state_dict()
        for i, (lo, hi, _) in enumerate(zero.pieces):
            sd["state"][i] = {"step": torch.tensor(float(step)),  # AdamW's bias correction counts steps
                              "exp_avg": slices["exp_avg"][lo - zero.lo: hi - zero.lo],
                              "exp_avg_sq": slices["exp_avg_sq"][lo - zero.lo: hi - zero.lo]}
        opt.load_state_dict(sd)
        if "rng_cpu" in rng:
            torch.set_rng_state(rng["rng_cpu"])
        if "rng_cuda" in rng and ctx.device.type == "cuda":
            torch.cuda.set_rng_state(rng["rng_cuda"], ctx.device)
        loader.load_state_dict(man["loader"])  # a token offset: valid for any world size
        if man["world"] != ctx.world:
            print0(f"resharding: written by {man['world']} ranks, loaded by {ctx.world}")
        print0(f"resumed from step {step}")
        return step
    if corrupt or n_aside:
        what = f"{len(corrupt) + n_aside} checkpoint(s) in {args.ckpt_dir} are corrupt (renamed aside as *.corrupt)"
        if not args.allow_fresh_start:
            gpt2.fail(f"{what} and none verifies", "--ckpt-dir", "inspect them, or pass --allow-fresh-start to "
                      "train from step 0 (they stay aside), or give another --ckpt-dir")
        print0(f"{what}; starting from step 0 (--allow-fresh-start)")
    return 0


# ----------------------------------------------------------------------------------------------------
# Training: gpt2.train's loop on ZeRO-1, with saves and resume


def main(argv=None):
    args = parse_args(argv)  # the flags and their checks, in the appendix; --ckpt-dir is locked by rank 0
    world = int(os.environ.get("WORLD_SIZE", 1))
    own_group = world > 1 and not dist.is_initialized()  # tests may call main() inside their own group
    ctx = gpt2.setup(args, resumes=True)  # a run continues in its --out
    comm = gpt2.CommMeter()
    model = gpt2.build_model(args).to(ctx.device)
    cfg = model.config
    zero = Zero1(model, args, ctx, comm)
    opt = gpt2.make_adamw(zero.optimizer_groups(), args, ctx.device)
    train_loader, val_loader = gpt2.make_loaders(args, ctx.rank, ctx.world, cfg.vocab_size)
    ckpt = AsyncCheckpointer(args, ctx, zero, comm) if args.ckpt_dir else None
    start = load_latest(args, zero, opt, train_loader, ctx)
    if ckpt:
        ckpt.committed = start
        gpt2.RUN["resume"] = (f"rerun the same command; it resumes from the newest committed checkpoint in {args.ckpt_dir}"
                              if start else f"no checkpoint was committed yet; delete {args.out} to start over")
    if start >= args.steps:
        print0(f"checkpoint at step {start} >= --steps {args.steps}: nothing left to train")
        if own_group:
            dist.destroy_process_group()
        return
    fwd = torch.compile(model) if args.compile else model
    # the resumed run's metrics.jsonl carries the whole curve, not just its own steps
    metrics = gpt2.Metrics(args, ctx, cfg, model.num_params(), ctx.world * args.batch_size * args.seq_len * args.grad_accum,
                           resume_step=start)
    profiler = gpt2.Profiler(args, ctx)
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | {ctx.world} ranks x "
           f"{zero.shard:,} flat params each | device {ctx.device} {ctx.dtype}")

    def loss_fn(x, y):
        with ctx.autocast():
            return fwd(x, y)[1]

    for step in range(start, args.steps):
        if step == args.fail_at and ctx.rank == ctx.world - 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            print(f"[rank {ctx.rank}] --fail-at {step}: exiting abruptly", flush=True)
            os._exit(1)
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)
        zero.reduce_scatter_grads()
        if args.grad_clip > 0:
            zero.clip_global_grad_norm(args.grad_clip)
        opt.step()
        zero.all_gather_params()
        zero.zero_grad()
        save_failed = float(bool(ckpt and ckpt.failed()))  # a background save that failed fails this step
        if ctx.world > 1:  # on every rank at once: it rides on the loss's all-reduce
            both = torch.stack([loss_sum, torch.tensor(save_failed, device=ctx.device)])
            dist.all_reduce(both)
            comm.all_reduce(8, ctx.world)
            loss_sum, save_failed = both[0] / ctx.world, float(both[1])
        if save_failed:
            ckpt.raise_failure()
        loss_val = loss_sum.item()
        gpt2.check_finite(loss_val, step)
        t0 = time.perf_counter()
        if ckpt and args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            ckpt.save(step + 1, opt, train_loader)  # the state *after* step: resume runs step + 1 next
        metrics.log_step(step, loss_val, lr, comm_mb=comm.take_mb(), ckpt_block_ms=1e3 * (time.perf_counter() - t0))
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
    if ckpt:
        t0 = time.perf_counter()
        ckpt.wait()
        print0(f"last checkpoint committed ({1e3 * (time.perf_counter() - t0):.0f} ms waited at the end)")
    metrics.plot()
    if own_group:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# Appendix: the command line and its checks (all before the process group starts)


def parse_args(argv):
    p = gpt2.make_parser("GPT-2 on ZeRO-1 with sharded, asynchronous, crash-safe checkpoints and resharding resume.")
    p.add_argument("--ckpt-dir", help="checkpoint directory; the newest valid checkpoint in it is resumed")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps, and after the last (0 = never)")
    p.add_argument("--keep", type=int, default=2, help="committed checkpoints to keep (older ones are pruned)")
    p.add_argument("--fail-at", type=int, default=-1,
                   help="fault injection for tests: the last rank calls os._exit(1) before this step, on "
                        "torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT=0); -1 = never")
    p.add_argument("--allow-fresh-start", action="store_true",
                   help="when --ckpt-dir holds checkpoints and none verifies, train from step 0 instead of stopping")
    args = p.parse_args(argv)
    gpt2.check_args(args)
    gpt2.check_range(args.keep, "--keep", 1, todo="keep at least the newest checkpoint")
    gpt2.check_range(args.save_every, "--save-every", 0, todo="give 0 (never) or a number of steps")
    gpt2.check_range(args.fail_at, "--fail-at", -1, todo="give -1 (never) or a step")
    if args.save_every and not args.ckpt_dir:
        gpt2.fail("--save-every without a directory to save into", "--ckpt-dir", "add --ckpt-dir DIR")
    old = [n for n in ("metrics.jsonl", "model.pt") if os.path.exists(os.path.join(args.out, n))]
    if old and not committed_steps(args.ckpt_dir):  # gpt2.setup(resumes=True) leaves this check to us
        gpt2.fail(f"{args.out} holds an earlier run ({', '.join(old)}) and " + (f"{args.ckpt_dir} no committed checkpoint"
                  if args.ckpt_dir else "no --ckpt-dir was given") + " to resume it from", "--out", "choose a new --out, give the --ckpt-dir that run saved "
                  "into, or delete that directory to start over")
    if args.ckpt_dir:
        if int(os.environ.get("RANK", 0)) == 0:  # one run per directory: a second would resume our commits
            gpt2.lock_dir(args.ckpt_dir, "--ckpt-dir")  # and prune our in-flight saves
        else:
            gpt2.make_dir(args.ckpt_dir, "--ckpt-dir")
    return args


def committed_steps(ckpt_dir):
    return [s for s in list_checkpoints(ckpt_dir or "") if os.path.exists(os.path.join(step_dir(ckpt_dir, s), "manifest.json"))]


if __name__ == "__main__":
    gpt2.run_main(main)
