"""
fsdp2.py - Fully Sharded Data Parallel (FSDP2 / ZeRO-3, and HSDP) for GPT-2 or any module, written
from all_gather and reduce_scatter: a faithful simplification of torch.distributed.fsdp.fully_shard
(the same dim-0 slices, units, prefetch order and numbers; plain tensors instead of DTensor, and no
separate CUDA streams: copies run on the compute stream, collectives on the backend's own).

The idea: data parallelism keeps a full copy of the weights, the gradients and AdamW's two moments on
every rank: 16 bytes per parameter (fp32), 2 GB for GPT-2 124M, 25 GB for 1.5B. FSDP cuts every
parameter into N row-slices (dim 0, padded to a multiple of N) and each rank keeps only its slice of
the weights, of the gradients and of the optimizer state: 16/N bytes per parameter. A layer's full
weights exist only while the layer runs: just before a unit (one transformer Block, or the root unit
wte/lm_head + wpe + ln_f) computes, its slices are all-gathered into one flat buffer; right after its
backward, its full gradients are reduce-scattered so each rank keeps the sum of its own rows only.
AdamW then updates each rank's rows, which is all the optimizer ever needs (it works elementwise).
The communication is hidden behind compute by prefetching: the next unit's all-gather is in flight
while this unit computes. Module hooks drive it all, so any nn.Module can be sharded given its units:
FullyShardedModel(model, units=[...]) (a tied weight in one unit or in the root; a parameter unused
on every rank keeps no gradient, as in one process). HSDP (--replicate R) shards each unit over
S = N/R ranks only and all-reduces the reduced slices across the R replicas: the per-unit gathers
stay on the fast links of a node, and only 4P/S gradient bytes cross between nodes.

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
      The root unit is gathered once per micro-step in both modes, as FSDP2 does (the embedding
      needs it first, the head last, and the embedding's backward again at the very end), so for
      GPT-2 124M, whose root is 32% of P, ZeRO-3 sends 1.34x DDP in fp32, 0.92x with bf16 gathers.

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

    Precision (--mp-policy, with --dtype bfloat16, the CUDA default). bf16-gather (the default) gathers
    bf16 copies, as fully_shard's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) does: half
    the gather bytes, but the embedding output, the LayerNorms and the whole residual stream are then
    bf16 (gpt2.py and ddp.py keep them fp32 under autocast), and each rank's full gradients are bf16
    before the fp32 reduce-scatter. Not lossless: 4 tiny steps are 3.4e-5 (relative loss) from
    gpt2.py train --dtype bfloat16. autocast gathers fp32 and lets autocast cast per op: gpt2.py's
    numerics (1.9e-6 from it, reduction order only), at twice the gather bytes and gathered memory
    (p = 4). Both measured in tests/test_fsdp2.py. The master slices and AdamW stay fp32 in both.

    Bytes with HSDP (R replicas x S shards), per micro-step: gathers and reduce-scatter as above with
    S for N, plus all_reduce(reduced slice, fp32) across R: 2 (R-1)/R 4P/S.

    GPT-2 124M at 8 ranks, per rank, bf16 gathers, B=16, T=1024 (python tests/bench_fsdp2.py
    --per-rank-124m: one real step on rank 0 of torch's fake process group; P = 124.48M, U_root = 39.42M):
      setup            bytes/step (measured = closed form)        16P/S persistent   peak w/o act  activations
      ZeRO-3           802 MB = 7/8 (2 (2 (P - U_root) + U_root) + 4P)   249 MB          593 MB      8190 MB
      SHARD_GRAD_OP    654 MB = 7/8 (2P + 4P)                           249 MB          619 MB      8190 MB
      HSDP 2 x 4       812 MB = 3/4 (2 (2 (P - U_root) + U_root) + 4P)   498 MB          842 MB      8190 MB
                              + 1/2 x 4P/4 x 2
      ddp.py           871 MB = 2 x 7/8 x 4P                            1992 MB (16P, nothing sharded)
    Activations (bytes autograd saves: 512 MB per sequence, 206 MB of it = T x 50304 x 4 B, the fp32
    log-softmax of the head) dwarf the sharded state at this batch: --activation-checkpointing or a
    smaller --batch-size with --grad-accum makes room for them; FSDP makes room for the 16P.

Launch:
    torchrun --nproc_per_node=2 fsdp2.py --batch-size 4          # tiny, CPU: = gpt2.py train --batch-size 8
    torchrun --nproc_per_node=2 fsdp2.py --batch-size 4 --reshard-after-forward 0      # SHARD_GRAD_OP
    torchrun --nproc_per_node=4 fsdp2.py --batch-size 2 --replicate 2     # HSDP: 2 replicas x 2 shards
    torchrun --nproc_per_node=2 fsdp2.py --batch-size 4 --dtype bfloat16 --mp-policy autocast  # gpt2.py's bf16
    torchrun --nproc_per_node=8 fsdp2.py --model gpt2 --data data/fineweb10B --batch-size 16 --grad-accum 4 \\
        --seq-len 1024 --steps 19073 --warmup 700 --lr 6e-4 --compile             # the 124M speedrun setting
    torchrun --nproc_per_node=2 tests/bench_fsdp2.py          # ours against fully_shard, same run

Uses from gpt2.py: build_model and GPT.embed / forward_blocks / head_loss, make_loaders, make_adamw,
set_lr, accumulate_grads, evaluate, setup, all_gather_single / reduce_scatter_single, CommMeter, Metrics,
Profiler, make_parser / check_args / fail / run_main.

References: Rajbhandari et al. 2020, ZeRO (section 5: the P_os, P_g, P_p stages; section 7: their
communication volume); Zhao et al. 2023, PyTorch FSDP (sections 3-4: units, sharding, prefetch,
hybrid sharding);
PyTorch's FSDP2 (per-parameter dim-0 sharding, torch/distributed/fsdp/_fully_shard); torchtitan.
"""
import math
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

import gpt2
from gpt2 import print0


# ----------------------------------------------------------------------------------------------------
# The ranks: N = R replicas x S shards (HSDP when R > 1)


class Mesh:
    """HSDP's 2-D grid of ranks, in torch DeviceMesh's order: rank = replica * S + shard. A unit is
    sharded over the S ranks of a row (all-gather, reduce-scatter inside it) and replicated over the
    R rows (one gradient all-reduce per unit across them): the fast links (one node) carry the
    per-unit gathers, the slow ones (between nodes) only 4P/S gradient bytes. R = 1 is plain FSDP."""

    def __init__(self, replicate=1):
        self.world, rank = dist.get_world_size(), dist.get_rank()
        self.replicas, self.shards = replicate, self.world // replicate
        self.shard_rank = rank % self.shards
        self.shard_group = self.replicate_group = None  # None = the whole world
        if replicate > 1:  # new_group is collective: every rank creates every group, in the same order
            for r in range(replicate):
                g = dist.new_group(list(range(r * self.shards, (r + 1) * self.shards)))
                if rank // self.shards == r:
                    self.shard_group = g
            for s in range(self.shards):
                g = dist.new_group(list(range(s, self.world, self.shards)))
                if self.shard_rank == s:
                    self.replicate_group = g


# ----------------------------------------------------------------------------------------------------
# A unit: its parameters sharded on dim 0, gathered and reduce-scattered as one flat buffer


def free_storage(t):
    """Release a tensor's memory but keep the tensor object: autograd saved it (as a matmul operand)
    in forward, and in backward it must find the same object refilled by a new all-gather."""
    t.untyped_storage().resize_(0)


class ShardedUnit:
    """The parameters of one module group, each cut into S row-slices. Per parameter:
    shard (fp32 nn.Parameter, this rank's rows, what AdamW updates) and full (the model's parameter,
    the gathered rows in the gather dtype, whose memory exists only while the unit is gathered)."""

    def __init__(self, name, params, mesh, param_dtype, comm):
        self.name, self.mesh, self.comm, self.param_dtype = name, mesh, comm, param_dtype
        self.world, rank, self.device = mesh.shards, mesh.shard_rank, params[0].device
        self.shapes = [p.shape for p in params]
        self.rows = [math.ceil(p.shape[0] / self.world) for p in params]  # rows per rank
        self.shards, self.padded, self.full = [], [], []
        for p, r in zip(params, self.rows):
            mine = p.detach()[rank * r: (rank + 1) * r]  # the last ranks' rows may run short: pad with zeros
            shard = torch.zeros((r, *p.shape[1:]), dtype=torch.float32, device=self.device)
            shard[: mine.size(0)] = mine
            self.shards.append(nn.Parameter(shard, requires_grad=p.requires_grad))
            # the gathered tensor keeps the padding rows so the copy-out is one strided copy; the
            # model sees only the first R rows, a view of the same storage
            self.padded.append(torch.empty((r * self.world, *p.shape[1:]), dtype=param_dtype, device=self.device))
            self.full.append(nn.Parameter(self.padded[-1][: p.shape[0]], requires_grad=p.requires_grad))
            free_storage(self.padded[-1])
        self.numels = [s.numel() for s in self.shards]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]  # in the flat buffer
        self.shard_numel = sum(self.numels)
        self.gathered, self.gather_work, self.gather_buf = False, None, None
        self.grads_ready, self.had_grad = 0, [False] * len(params)

    # -- all-gather ------------------------------------------------------------------------------
    def all_gather_shards(self, dtype, async_op):
        """One collective for the whole unit: in = my slices back to back; out = (S, shard_numel),
        row k = shard rank k's slices, in the same order."""
        with torch.no_grad():
            flat = torch.cat([s.reshape(-1) for s in self.shards]).to(dtype)
        out = torch.empty(self.world * self.shard_numel, dtype=dtype, device=self.device)
        work = gpt2.all_gather_single(out, flat, group=self.mesh.shard_group, async_op=async_op)
        self.comm.all_gather(out.nbytes, self.world)
        return work, out.view(self.world, self.shard_numel)

    def unpack(self, i, gathered):
        """Parameter i's columns of the gathered buffer as (S * rows, ...): rank-major rows."""
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

    # -- reduce-scatter (+ all-reduce across replicas) ---------------------------------------------
    def reduce_scatter_grads(self):
        """Lay the full gradients out like the gathered buffer (row k = the rows shard rank k owns),
        in fp32 whatever the gather dtype, freeing each full gradient once copied, and sum them across
        the shard group into this rank's rows only. A parameter without a gradient (unused in this
        forward) adds zeros and keeps no gradient; like fully_shard, this needs it unused on every rank."""
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
        work = gpt2.reduce_scatter_single(out, buf.view(-1), op=dist.ReduceOp.SUM, group=self.mesh.shard_group,
                                          async_op=True)
        self.comm.reduce_scatter(buf.nbytes, self.world)
        return work, out, buf

    def accumulate_grads(self, out):
        """HSDP: sum the reduced slice across the R replicas too (here a blocking all-reduce when the
        reduce-scatter is waited for; fully_shard overlaps it with the next unit's backward); then
        average over all N data-parallel ranks (like DDP) and add it into each shard's .grad."""
        if self.mesh.replicas > 1:
            dist.all_reduce(out, group=self.mesh.replicate_group)
            self.comm.all_reduce(out.nbytes, self.mesh.replicas)
        out /= self.mesh.world
        for s, piece, had in zip(self.shards, out.split(self.numels), self.had_grad):
            if not had:
                continue
            if s.grad is None:
                s.grad = piece.view_as(s)  # a view: the reduced buffer becomes the gradient, no copy
            else:
                s.grad += piece.view_as(s)


# ----------------------------------------------------------------------------------------------------
# The sharded model: any nn.Module cut into units; module hooks gather, prefetch, reduce-scatter


class FullyShardedModel:
    """model's parameters sharded unit by unit: one unit per module in `units` (listed in the order
    forward runs them: the prefetch follows that order forward and its reverse backward), plus a
    root unit with every parameter no unit holds (GPT-2: wte = lm_head, wpe, ln_f). The root is
    gathered for the whole forward and backward, as FSDP2 does with its root. A tied weight must sit
    in one unit, or in the root. The model's own modules still run the arithmetic; only their
    parameters are swapped for gathered ones. fsdp(*args) runs forward_fn(*args), model by default.

        fsdp = FullyShardedModel(model, units=list(model.layers))
        opt = torch.optim.AdamW(fsdp.shards())
        loss = fsdp(x, y); loss.backward(); fsdp.finish_backward(); opt.step(); opt.zero_grad()"""

    def __init__(self, model, units, mesh=None, param_dtype=torch.float32, reshard_after_forward=True, comm=None,
                 forward_fn=None):
        self.model, self.forward_fn = model, forward_fn or model
        self.mesh, self.comm = mesh or Mesh(1), comm or gpt2.CommMeter()
        self.reshard_after_forward = reshard_after_forward
        owner, groups = {}, []
        for i, module in enumerate(units):
            params = list(module.parameters())  # a tie inside the unit is listed once
            if not params:
                raise ValueError(f"unit {i} ({type(module).__name__}) holds no parameters")
            for p in params:
                if id(p) in owner:
                    raise ValueError(f"a parameter of unit {i} is also in unit {owner[id(p)]}: a tied weight must "
                                     "sit in one unit or in the root")
                owner[id(p)] = i
            groups.append((f"unit {i}", params))
        rest = [p for p in model.parameters() if id(p) not in owner]
        self.root = ShardedUnit("root", rest, self.mesh, param_dtype, self.comm) if rest else None
        self.units = [ShardedUnit(name, params, self.mesh, param_dtype, self.comm) for name, params in groups]
        self.all_units = [self.root] * bool(rest) + self.units
        to_full = {}
        for unit, params in zip(self.all_units, [rest] * bool(rest) + [params for _, params in groups]):
            for p, full in zip(params, unit.full):
                to_full[id(p)] = full
                if p.requires_grad:  # post-backward: when a unit's last gradient lands, reduce-scatter it
                    full.register_post_accumulate_grad_hook(partial(self._post_backward, unit))
        for m in model.modules():  # swap every reference, so a tied weight is one tensor again
            for k, p in m._parameters.items():
                if p is not None:
                    m._parameters[k] = to_full[id(p)]
        for i, module in enumerate(units):
            module.register_forward_pre_hook(partial(self._pre_forward, i))
            module.register_forward_hook(partial(self._post_forward, i))
        self.pending_rs = None  # at most two reduce-scatters in flight: a unit's is issued, then the previous waited
        self.in_backward = False  # a unit's forward in backward is a checkpoint's recomputation
        self.max_gathered_units = 0  # measured: how many units were ever gathered at once
        self.max_reduces_in_flight = 0  # measured: 2 (the memory formula's two fp32 reduce buffers)

    def shards(self):
        return [s for u in self.all_units for s in u.shards]

    def _count_gathered(self):
        alive = sum(u.gathered or u.gather_work is not None for u in self.units)
        self.max_gathered_units = max(self.max_gathered_units, alive)

    def __call__(self, *args):
        """Gather the root and prefetch the first unit, then run the model: the hooks do the rest."""
        self.in_backward = False
        if self.root:
            self.root.unshard()
        if self.units:
            self.units[0].start_gather()  # overlaps whatever runs before the first unit (the embedding)
        out = self.forward_fn(*args)
        if self.root and not torch.is_grad_enabled():
            self.root.reshard()
        return out

    def _pre_forward(self, i, module, args):
        self.units[i].unshard()  # waits for the prefetched gather
        if self.in_backward:
            return  # recomputation: no prefetch of the next unit, backward goes the other way
        if i + 1 < len(self.units):
            self.units[i + 1].start_gather()  # prefetch the next unit while this one computes
        self._count_gathered()

    def _post_forward(self, i, module, args, output):
        if self.in_backward:
            return  # recomputation: the weights stay for the backward that asked for them
        training = torch.is_grad_enabled()
        if training:
            # the gradient of a unit's output arrives just before the unit's backward runs
            outputs = output if isinstance(output, (tuple, list)) else [output]
            for t in outputs:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(partial(self._pre_backward, i))
        if self.reshard_after_forward or not training:
            self.units[i].reshard()

    def _pre_backward(self, i, grad):
        self.in_backward = True
        self.units[i].unshard()  # ZeRO-3: waits for the prefetched gather; SHARD_GRAD_OP: still gathered
        if i > 0:
            self.units[i - 1].start_gather()  # backward runs the units in reverse: prefetch i-1
        self._count_gathered()

    def _post_backward(self, unit, _param):
        unit.grads_ready += 1
        if unit.grads_ready == sum(p.requires_grad for p in unit.full):
            self._reduce(unit)

    def _reduce(self, unit):
        unit.grads_ready = 0
        rs = unit.reduce_scatter_grads()
        unit.reshard()  # the full weights are no longer needed; the grads now live in rs's buffer
        self.max_reduces_in_flight = max(self.max_reduces_in_flight, 1 + (self.pending_rs is not None))
        self.finish_reduce_scatter()  # wait for the previous unit's reduce-scatter, which ran meanwhile
        self.pending_rs = (unit, rs)

    def wait(self):
        """Wait for every collective still in flight: a prefetched gather nobody used, the last reduce-scatter."""
        for unit in self.all_units:
            if unit.gather_work is not None:
                unit.gather_work.wait()
                unit.gather_work = unit.gather_buf = None
        self.finish_reduce_scatter()

    def finish_reduce_scatter(self):
        if self.pending_rs is not None:
            unit, (work, out, _buf) = self.pending_rs
            work.wait()
            unit.accumulate_grads(out)
            self.pending_rs = None

    def finish_backward(self):
        """After loss.backward(): reduce the units some of whose parameters got no gradient (their
        hook count never completed), wait for the last reduce-scatter, free what is still gathered."""
        for unit in self.all_units:
            if unit.grads_ready:
                self._reduce(unit)
        self.finish_reduce_scatter()
        for unit in self.all_units:
            if unit.gathered:
                unit.reshard()

    def clip_grad_norm_(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model: the ranks of a shard group hold
        disjoint rows of every gradient (padding rows are zero), so the global sum of squares is one
        all_reduce away (HSDP: the replicas hold the same rows and the same sums)."""
        grads = [s.grad for s in self.shards() if s.grad is not None]
        sq = torch.stack([g.float().square().sum() for g in grads]).sum()
        dist.all_reduce(sq, group=self.mesh.shard_group)
        self.comm.all_reduce(sq.nbytes, self.mesh.shards)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return norm

    def full_state_dict(self):
        """Every parameter gathered in fp32, on CPU, on rank 0 only (the others return None): the
        layout of model.state_dict(), so gpt2.py sample / load_for_inference read it."""
        full, master = {}, dist.get_rank() == 0
        for unit in self.all_units:  # one unit at a time: a rank never holds more than one gathered unit
            _, gathered = unit.all_gather_shards(torch.float32, async_op=False)
            if master:
                for i, p in enumerate(unit.full):
                    full[id(p)] = unit.unpack(i, gathered)[: unit.shapes[i][0]].cpu()
        if not master:
            return None
        return {k: full[id(p)] for k, p in self.model.named_parameters(remove_duplicate=False)}


def shard_gpt(model, mesh, args, comm, dtype):
    """gpt2.GPT's units: one per Block, the rest (wte = lm_head, wpe, ln_f) the root. Forward is
    embed -> blocks -> head_loss, so the (B, T, V) logits are never returned. --mp-policy decides the
    gather dtype: bf16-gather = fully_shard's MixedPrecisionPolicy(bf16, fp32); autocast = fp32 gathers
    under autocast, gpt2.py's numerics (embeddings, LayerNorms, residual stream fp32)."""
    bf16_gather = args.mp_policy == "bf16-gather" and dtype == torch.bfloat16  # dtype: the autocast dtype
    if args.compile:  # compile each Block's forward; the module hooks around it stay eager
        for block in model.h:
            block.forward = torch.compile(block.forward)
    head_loss = torch.compile(model.head_loss) if args.compile else model.head_loss

    def forward(idx, targets):
        return head_loss(model.forward_blocks(model.embed(idx)), targets)
    return FullyShardedModel(model, list(model.h), mesh, torch.bfloat16 if bf16_gather else torch.float32,
                             bool(args.reshard_after_forward), comm, forward)


# ----------------------------------------------------------------------------------------------------
# Training: gpt2.train()'s loop, step for step


def train(argv=None):
    args = make_parser().parse_args(argv)
    check(args)  # before any collective, so bad input fails fast instead of hanging the other ranks
    cfg = gpt2.model_config(args)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, cfg.vocab_size)  # N data-parallel ranks

    ctx = gpt2.setup(args)
    comm, mesh = gpt2.CommMeter(), Mesh(args.replicate)
    model = gpt2.build_model(args).to(ctx.device)  # the full model on every rank, for a moment (docstring)
    cfg, n_params, n_total = model.config, model.num_params(), model.num_params(non_embedding=False)
    fsdp = shard_gpt(model, mesh, args, comm, ctx.dtype)  # from here on, each rank holds 1/S of the weights
    if ctx.device.type == "cuda":  # report()'s measured peak is training's, not the full model's at start-up
        torch.cuda.reset_peak_memory_stats(ctx.device)
    # decay 2-D weights only, as gpt2.optimizer_groups (a slice keeps its parameter's number of dims)
    shards = fsdp.shards()
    opt = gpt2.make_adamw([{"params": [s for s in shards if s.dim() >= 2], "weight_decay": args.weight_decay},
                           {"params": [s for s in shards if s.dim() < 2], "weight_decay": 0.0}], args, ctx.device)
    metrics = gpt2.Metrics(args, ctx, cfg, n_params, args.batch_size * args.seq_len * args.grad_accum * ctx.world)
    profiler = gpt2.Profiler(args, ctx)
    print0(f"model {args.model}: {n_params / 1e6:.2f}M non-embedding params | {ctx.world} ranks = {mesh.replicas} "
           f"replicas x {mesh.shards} shards | reshard-after-forward {args.reshard_after_forward} | mp-policy "
           f"{args.mp_policy} (gathers {fsdp.units[0].param_dtype}) | device {ctx.device} {ctx.dtype}")

    def loss_fn(x, y):
        with ctx.autocast():
            return fsdp(x, y)

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
            report(fsdp, args, ctx, mem, comm_mb)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
            comm.take_mb()  # the evaluation's gathers are not part of a training step
    fsdp.wait()  # end with nothing in flight: no collective may outlive the run
    gpt2.check_finite_weights(fsdp.shards(), args.steps - 1)  # every rank its slices, before anything is written
    state = fsdp.full_state_dict()
    if ctx.master:
        gpt2.save_model(os.path.join(args.out, "model.pt"), cfg, state)
    metrics.plot()
    print0(f"saved {args.out}/model.pt and {args.out}/loss.png")
    return fsdp, opt


# ----------------------------------------------------------------------------------------------------
# Appendix: memory and communication against their formulas, argument checks, CLI


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
    end of backward (the root reduced while the last unit's reduce-scatter is in flight), or in the
    middle of backward if that is larger (SHARD_GRAD_OP: every unit still gathered at the last one's
    backward; ZeRO-3: a unit gathered, the next prefetched, its gradients and two reduce buffers)."""
    p = torch.finfo(fsdp.units[0].param_dtype).bits // 8
    g = p  # autograd gives the gathered parameters gradients of their own dtype
    root = fsdp.root.world * fsdp.root.shard_numel if fsdp.root else 0
    blk = max(u.world * u.shard_numel for u in fsdp.units)
    end = {"gathered": p * root, "full_grads": g * root, "reduce_buffers": 4 * root + 4 * blk}
    if fsdp.reshard_after_forward:
        mid = {"gathered": p * (root + 2 * blk), "full_grads": g * (root + blk), "reduce_buffers": 8 * blk}
    else:
        mid = {"gathered": p * (root + len(fsdp.units) * blk), "full_grads": g * (root + blk), "reduce_buffers": 4 * blk}
    f = {"persistent": 16 * sum(s.numel() for s in fsdp.shards()),
         **(mid if sum(mid.values()) > sum(end.values()) else end)}
    f["peak"] = sum(f.values())
    return {k: v / 1e6 for k, v in f.items()}


def comm_formula_mb(fsdp, micro_steps, world):
    """Bytes this rank sends per optimizer step (CommMeter's ring convention), padded sizes: gathers
    (the units twice in ZeRO-3, the root once) and the fp32 reduce-scatter inside the shard group of
    S, the fp32 all-reduce of the reduced slices across the R replicas, and the two 4-byte
    all-reduces of a step (grad norm over S, loss over N)."""
    s, r = fsdp.mesh.shards, fsdp.mesh.replicas
    p = torch.finfo(fsdp.units[0].param_dtype).bits // 8
    root = fsdp.root.world * fsdp.root.shard_numel if fsdp.root else 0
    total = root + sum(u.world * u.shard_numel for u in fsdp.units)
    gathers = 2 if fsdp.reshard_after_forward else 1
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
    fsdp.finish_backward()
    return sum(seen.values()) / 1e6


def report(fsdp, args, ctx, mem, step_comm_mb):
    """Rank 0's persistent bytes against 16 bytes x params / S, the peak formula of the docstring
    (beside the measured peak on CUDA), and the step's measured traffic against its formula."""
    p_mb, g_mb, o_mb = mem
    f = memory_formula(fsdp)
    s, n = fsdp.mesh.shards, ctx.world
    n_total = sum(math.prod(shape) for u in fsdp.all_units for shape in u.shapes)
    ddp = 2 * (n - 1) / n * 4 * n_total / 1e6  # per micro-step (with no_sync DDP sends it once per step)
    theory = comm_formula_mb(fsdp, args.grad_accum, n)
    print0(f"memory/rank: params {p_mb:.2f} + grads {g_mb:.2f} + adam {o_mb:.2f} = {p_mb + g_mb + o_mb:.2f} MB "
           f"(theory 16 x {n_total / 1e6:.2f}M / {s} = {16 * n_total / s / 1e6:.2f} MB) | "
           f"at most {fsdp.max_gathered_units} of {len(fsdp.units)} blocks gathered at once")
    measured = f" | measured peak {torch.cuda.max_memory_allocated(ctx.device) / 1e6:.2f} MB (with activations)" \
        if ctx.device.type == "cuda" else " | CPU: tests/bench_fsdp2.py measures the peak"
    print0(f"peak memory/rank formula: persistent {f['persistent']:.2f} + gathered {f['gathered']:.2f} + full grads "
           f"{f['full_grads']:.2f} + fp32 reduce buffers {f['reduce_buffers']:.2f} = {f['peak']:.2f} MB "
           f"+ activations{measured}")
    mode = "ZeRO-3" if fsdp.reshard_after_forward else "SHARD_GRAD_OP"
    hsdp = f", HSDP {fsdp.mesh.replicas} replicas x {s} shards" if fsdp.mesh.replicas > 1 else ""
    print0(f"comm/step: {step_comm_mb:.2f} MB measured | {theory:.2f} MB theory ({mode}{hsdp}, root gathered once "
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
    gpt2.check_range(args.reshard_after_forward, "--reshard-after-forward", 0, 1, "give 1 (ZeRO-3) or 0 (SHARD_GRAD_OP)")
    gpt2.check_range(args.replicate, "--replicate", 1, todo=f"pick R >= 1 dividing {world} (each replica shards "
                     f"over {world} / R ranks)")
    if world % args.replicate:
        gpt2.fail(f"--replicate {args.replicate} does not divide the {world} ranks", "--replicate",
                  f"pick R >= 1 dividing {world} (each replica shards over {world} / R ranks)")


if __name__ == "__main__":
    gpt2.run_main(train)
