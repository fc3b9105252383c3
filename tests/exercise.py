"""Workshop exercises: re-implement a technique's core, then let the project's own tests check your copy.

    python tests/exercise.py ddp.py --out mine          # writes mine/ddp.py with the key functions emptied
    # ... write them (each raises NotImplementedError("exercise N: what to write") until you do) ...
    python -m pytest -q --impl mine tests/test_ddp.py    # exactly the tests that check ours, on your copy

    python tests/exercise.py ddp.py --core --out handout  # handout/ddp.py: the core alone (it trains), and a
                                                          # gpt2.py of only what it uses; its docstring: the lesson
    python tests/exercise.py ddp.py --bug list           # the bug zoo: plausible bugs, each with its symptom
    python tests/exercise.py ddp.py --bug 2 --out zoo    # zoo/ddp.py with bug 2 planted: find it

`pytest --impl DIR` runs every technique test on the files in DIR (the repository's own for those DIR lacks),
imported in-process and launched under torchrun alike; a failing test also says which step's loss differs
first from its reference and what that usually means (the hints below). `python tests/exercise.py --list`
shows every file's exercises. The functions to write are listed here, not marked in the lesson.
"""
import argparse
import ast
import os
import re
import sys

# file -> [(function or Class.method, what to write)], in the order a reader meets them
EXERCISES = {
    "ddp.py": [
        ("DataParallel.take_grad", "copy p.grad into its slice of the bucket, divided by the world size (a mean), "
                                   "then drop p.grad, mark the slice ready and count it (self.pending -= 1)"),
        ("DataParallel._launch_ready_buckets", "launch every complete bucket, strictly in index order (every rank "
                                               "must issue the same all-reduces in the same order)"),
        ("DataParallel.launch", "start the bucket's all-reduce asynchronously (async_op=True), keep the work "
                                "in b.work, count its bytes with self.meter.all_reduce"),
        ("DataParallel.wait", "wait for the bucket's all-reduce, if one is in flight, and forget its work"),
    ],
    "fsdp2.py": [
        ("NaiveZeRO3.reduce_scatter_grads", "after backward, for each parameter: its gradient cut into N row-blocks "
                                            "(rank_major), reduce-scatter (SUM), / N, added into the slice's "
                                            ".grad; then free the full gradient and weight"),
        ("ShardedUnit.unshard", "wait for the unit's all-gather (start_gather issues it), give each padded "
                                "parameter its storage back and copy every rank's rows into it (one copy)"),
        ("ShardedUnit.reshard", "free each padded parameter's storage (resize it to 0 bytes), keeping the tensor"),
        ("ShardedUnit.reduce_scatter_grads", "lay the full gradients out rank-major in one fp32 buffer (N, "
                                             "shard_numel): torch.cat of each one's rank_major(...) along dim 1, "
                                             "out=buf; reduce-scatter (SUM) it asynchronously; return (work, out, "
                                             "buf, issue time)"),
    ],
    "tensor_parallel.py": [
        ("CopyToTP.backward", "f's backward: all-reduce (sum) the input gradient over the TP group"),
        ("ReduceFromTP.forward", "g's forward: all-reduce (sum) the partial outputs over the TP group"),
        ("RowParallelLinear.forward", "this rank's partial sum X_r W_r^T (no bias), g (the sum over the TP "
                                      "group), then the bias once"),
        ("ParallelBlock.forward", "the block: f (enter_tp) in front of each column matmul (attention, MLP), "
                                  "with the residuals; g is inside each row matmul"),
        ("VocabParallelCrossEntropy.forward", "the mean cross-entropy from (N, V/t) logit shards: all-reduce the "
                                              "row max (MAX), then [sum of exp, target logit] (SUM); save the "
                                              "softmax for backward"),
    ],
    "pipeline.py": [
        ("naive_step", "forwards(pipe, x, y, scale) (every forward: the activation in, compute, the output "
                       "out), then all M backwards the same way up: pipe.exchange(recv_from=pipe.down) the "
                       "output's gradient, pipe.compute('B', mb, grad), pipe.exchange(pipe.up, the input's "
                       "gradient); return pipe.loss_sum"),
        ("one_f_one_b", "P-1-stage warm-up forwards, then per steady step one forward whose send down "
                        "rides with the receive of a gradient from below and one backward whose send up "
                        "rides with the receive of the next activation (if one is still to come), then "
                        "the remaining backwards; pipe.start first, return pipe.loss_sum"),
        ("Pipeline.exchange", "one dist.batch_isend_irecv of the send (the tensor detached, in "
                              "self.wire_dtype, contiguous, its bytes counted by self.comm.send) and the "
                              "receive (an empty self.act_shape buffer), each only if its rank is not "
                              "None; wait for every work; return the received buffer or None"),
    ],
    "moe_ep.py": [
        ("NaiveMoE.forward", "route, mark the choices beyond capacity -1 (keep_within_capacity), all-gather the EP "
                             "group's tokens and choices (AllGather), run each local expert on all of them (0 where "
                             "a token did not choose it), reduce-scatter (ReduceScatter), weight by the gates"),
        ("AllToAll.backward", "the gradient of a received row goes back to its sender: the same exchange with the "
                              "splits swapped"),
        ("plan_dispatch", "sort the assignments by expert (keep_within_capacity), exchange the per-expert counts "
                          "(all_to_all), and derive send/recv splits and rows per local expert: the Plan"),
        ("combine_tokens", "the reverse exchange (splits swapped), then put each row back at its assignment "
                           "(index_copy into zeros: dropped assignments stay 0)"),
    ],
    "muon.py": [
        ("muon_update", "update the momentum (EMA form: lerp towards grad), take the Nesterov look-ahead, and "
                        "orthogonalise it as `parts` stacked row blocks"),
        ("Muon.reduce_grads", "copy each gradient into its owner's slab of self.flat, reduce-scatter into "
                              "self.own and divide by the world size: the owners' mean gradients"),
        ("Muon.all_gather_params", "copy this rank's updated matrices into its slab (self.own), all-gather the "
                                   "slabs into self.flat and copy the matrices this rank does not own into the "
                                   "parameters"),
    ],
    "checkpoint.py": [
        ("write_durably", "write path.tmp, fsync it, rename it to path, fsync the directory; return (bytes, crc32)"),
        ("SyncCheckpointer.commit", "rank 0, once every shard is durable: the manifest (shards with their global "
                                    "[lo, hi), bytes, crc32; step, world, loader position, schedule) written last"),
        ("SyncCheckpointer.read_slices", "for this rank's [lo, hi): copy the overlap of every shard that covers "
                                         "it (any number of writers), and this rank's RNG state"),
        ("SyncCheckpointer.resume", "the slices into the weights (then all-gather) and AdamW's moments with "
                                    "their step count, the RNG states, the loader position; return the step"),
        ("AsyncCheckpointer.save", "wait for the previous save, take the snapshot on the training thread, then "
                                   "write_and_commit it in a thread (self.thread) while training goes on"),
    ],
    "fp8.py": [
        ("quantize_1x128", "one scale per row per 128 columns: amax / 448 (powers of 2 when pow2), e4m3 values"),
        ("fp8_matmul", "for each 128-wide K chunk: the fp8 chunk product in fp32, scaled by the row's "
                                 "and the column's chunk scales, accumulated in fp32"),
    ],
}

# test module -> what a difference from the reference usually means
HINTS = {
    "test_ddp": "a loss that differs from step 1 on: are gradients divided by the world size (a mean, not a sum), "
                "and every bucket waited for before the optimizer step? A hang or a timeout: do all ranks launch "
                "the buckets in the same order?",
    "test_fsdp2": "a gradient N times one process's: the reduce-scatter is a SUM, divide by the world size (all the "
                  "ranks, also under HSDP); smaller at --grad-accum 2: add into the slice's .grad; gathered weights "
                  "above the root + 2 units: reshard after each forward and backward. A crash in backward ('modified "
                  "by an inplace operation'): refill the padded tensor through .data, keep the tensor, free its storage.",
    "test_tensor_parallel": "wrong from step 0: f and g are conjugates (f: identity forward, all-reduce backward; g: "
                            "all-reduce forward, identity backward) and the row-parallel bias is added once, after g; "
                            "the loss needs the global row max and the global sum of exp.",
    "test_pipeline": "a hang: each exchange pairs a send with the receive the peer posts at the same point of its "
                     "loop (one batch_isend_irecv); a wrong loss: the last stage scales each micro-batch's loss by 1/M.",
    "test_moe_ep": "EP differs from one rank: combine must swap dispatch's splits, and backward is the same "
                   "exchange with the splits swapped; a hang: every rank exchanges counts before rows.",
    "test_muon": "one rank already differs from torch.optim.Muon: the momentum is an EMA (lerp) and Nesterov "
                 "looks ahead from it; several ranks differ from one: each owner must get the MEAN gradient "
                 "(reduce-scatter, then / world) and every rank must copy back the matrices it does not own.",
    "test_checkpoint": "a resume that is not bit-exact: AdamW's step count (bias correction), the RNG state and "
                       "the loader position are part of the state, and the snapshot must be a copy; a durability "
                       "failure: write path.tmp, fsync it, rename, fsync the directory, and rank 0 commits the "
                       "manifest only after the all-gather of every rank's (bytes, crc32).",
    "test_fp8": "errors far above the figures: one scale per 1x128 tile (amax over the 128 values of a row), and the "
                "GEMM scales each 128-wide chunk's product before adding it into the fp32 accumulator.",
}


# The round trip a course maintainer runs (`--check`): one test per file, a copy with one deliberate bug each
# (the original line, the bug), expected to fail with a `what differs` section or the hint.
CHECKS = {
    "ddp.py": ("two_ranks_match_one_process", ("1.0 / self.world", "1.0")),  # gradients summed, not averaged
    "fsdp2.py": ("gradients_after_one_step", ("out /= dist.get_world_size()", "out /= 1")),  # reduce-scatter summed
    "tensor_parallel.py": ("parallel_layers_dtensor", ("return all_reduce(grad.contiguous(), ctx.grid), None",
                                                       "return grad, None")),  # f's backward without its all-reduce
    "pipeline.py": ("two_ranks_every_schedule", ("out = self.model.head_loss(h, self.ys[mb]) * self.scale",
                                                 "out = self.model.head_loss(h, self.ys[mb])")),  # losses not scaled by 1/M
    "moe_ep.py": ("expert_parallel_equals_one_process", ("    flat /= world\n", "    flat /= n\n")),  # / EP group
    "fp8.py": ("fp8_matmul_vs_fp64", ("acc += partial * a_scales[:, k, None] * b_rows[None, :, k]",
                                      "acc += partial * a_scales[:, k, None] * b_rows[None, :, 0]")),  # every chunk, chunk 0's scale
    "muon.py": ("distributed_muon_equals_one_rank", ("self.own /= self.world", "self.own /= 1")),  # owners sum
    "checkpoint.py": ("bit_exact_resume_on_two_ranks", ('loader.load_state_dict(man["loader"])', "pass")),  # data
}


# The bug zoo: file -> [(name, the original text (unique in the file), the bug, the symptom a student sees,
# the test that catches it as a pytest -k expression, a phrase its `what differs` or failure message contains)].
# Workshop material ("find the bug") and the measure of the tests: `--check` proves each is caught and named.
BUGS = {
    "ddp.py": [
        ("gradients summed, not averaged", "1.0 / self.world", "1.0",
         "the loss follows gpt2.py's for ~20 steps (AdamW and clipping hide a constant scale), then drifts; one SGD "
         "step moves every weight twice as far", "one_sgd_step_averages_the_gradients and plain", "(ratio 2.000,"),
        ("naive: the all-reduced gradient not divided by N",
         "            p.grad /= self.world  # the mean, as one process on the N-times-larger batch\n", "",
         "--naive trains, a little off gpt2.py; one SGD step moves every weight twice as far",
         "one_sgd_step_averages_the_gradients and naive", "(ratio 2.000,"),
        ("wait on the last bucket only", "            self.wait(k, b)  # CUDA: the stream waits, not the host",
         "            self.wait(k, self.buckets[-1])  # CUDA: the stream waits, not the host",
         "every loss curve matches (gloo and NCCL finish collectives in order), but the gradients are handed out "
         "before their own all-reduce was waited for", "every_bucket_waited and plain", "not waited for"),
        ("ZeRO-2 with one bucket in flight", "    in_flight = 2  #", "    in_flight = 1  #",
         "every curve matches; backward waits on each previous bucket's reduce-scatter (bench_ddp.py: blocked ms)",
         "zero2_keeps_two_buckets_in_flight", "reduce-scatters in flight (expected 2"),
        ("buckets in forward order", "bucket_params(self.params[::-1], cap)",
         "bucket_params(self.params, cap)",
         "the same losses, but bucket 0 holds wte, whose gradient lands last: nothing starts during backward, the "
         "closing line says 0.00 of the bytes launched during backward", "buckets_launched_during_backward",
         "launched during backward"),
        ("no_sync forgotten in the loop",
         "            with ddp.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():",
         "            with contextlib.nullcontext():",
         "with --grad-accum 2 the loss leaves gpt2.py's at step 1: each micro-step's hooks take the gradient "
         "again, the first micro-batch's is lost", "two_ranks_match_one_process", "train loss, ddp.py --grad-accum 2"),
    ],

    "fsdp2.py": [
        ("reduce-scatter summed, not averaged", "out /= dist.get_world_size()  # a mean", "out /= 1  # a mean",
         "the loss curve barely moves (AdamW and clipping hide a constant scale), but every gradient is N times one "
         "process's", "gradients_after_one_step_and", "a SUM over the ranks where a mean belongs"),
        ("micro-steps overwritten, not accumulated",
         "s.grad = piece.view_as(s) if s.grad is None else s.grad + piece.view_as(s)", "s.grad = piece.view_as(s)",
         "right at --grad-accum 1; at 2 only the last micro-batch's gradient survives", "gradients_after_one_step_and",
         "--grad-accum 2, one step vs one process"),
        ("HSDP replicas summed: the mean over the shard group only", "out /= dist.get_world_size()  # a mean",
         "out /= dist.get_world_size(unit.group)  # a mean", "plain FSDP is right; with --replicate 2 every gradient "
         "is twice one process's", "hsdp_gradients", "hsdp, 4 ranks"),
        ("--naive: gradients summed, not averaged", "s.grad = out.view_as(s) / self.world + ",
         "s.grad = out.view_as(s) + ", "the real version is right; --naive's gradients are N times one process's",
         "gradients_after_one_step_and", "naive, 2 ranks"),
        ("every rank keeps rank 0's rows", "self.world)[dist.get_rank(group)]", "self.world)[0]",
         "the sharded model is not the model: rank 1's slices hold rank 0's rows", "gradients_after_one_step_and",
         "wrong rows"),
        ("units never freed after forward", "unit.reshard()  # ZeRO-3: free", "pass  # ZeRO-3: free",
         "the same losses, but every unit stays gathered from its forward to its backward (SHARD_GRAD_OP's memory)",
         "gradients_after_one_step_and", "is each unit freed"),
        ("gradients reduced in param_dtype", "dtype=torch.float32, device=self.device)",
         "dtype=self.param_dtype, device=self.device)",
         "fp32 runs are right; with param_dtype=float16 the gradients are summed in fp16 (fully_shard's "
         "reduce_dtype=float32 sums in fp32) and torch refuses them as the fp32 slices' .grad", "param_dtype",
         "attempting to assign a gradient with dtype"),
        ("HSDP's replica all-reduce waited at once", "            self.pending_ar = (unit, work, out)\n",
         "            self.pending_ar = (unit, work, out)\n            self.wait_all_reduce()\n",
         "every gradient and curve is right, but the compute stream waits out each unit's inter-node all-reduce",
         "hsdp_gradients", "waited for at once"),
    ],

    "tensor_parallel.py": [
        ("the loss all-reduces the row max but never subtracts it",
         """        exp = (logits - row_max.unsqueeze(1)).exp_()  # (N, V/t): shifted, so exp never overflows
        mine = (targets >= lo) & (targets < lo + logits.size(1))  # (N,): the target column is here
        local_t = (targets - lo).masked_fill(~mine, 0)  # (N,)
        target_logit = logits.gather(1, local_t.unsqueeze(1)).squeeze(1)  # (N,)
        target_logit = target_logit.masked_fill(~mine, 0.0)  # the owner's, 0 elsewhere
        stats = all_reduce(torch.stack([exp.sum(dim=1), target_logit]), grid)  # (2, N)
        loss = (stats[0].log() + row_max - stats[1]).mean()""",
         """        exp = logits.exp()  # (N, V/t)
        mine = (targets >= lo) & (targets < lo + logits.size(1))  # (N,): the target column is here
        local_t = (targets - lo).masked_fill(~mine, 0)  # (N,)
        target_logit = logits.gather(1, local_t.unsqueeze(1)).squeeze(1)  # (N,)
        target_logit = target_logit.masked_fill(~mine, 0.0)  # the owner's, 0 elsewhere
        stats = all_reduce(torch.stack([exp.sum(dim=1), target_logit]), grid)  # (2, N)
        loss = (stats[0].log() - stats[1]).mean()""",
         "training from scratch matches gpt2.py; from OpenAI's weights (logits near 1000) the loss is inf or nan",
         "parallel_layers_dtensor", "loss_offset1000"),
        ("the row-parallel bias added on every rank, before g",
         "        y = self.grid.g(F.linear(x, self.weight))  # this rank's partial sum, then the sum of all\n"
         "        return y if self.bias is None else y + self.bias  # once, after g",
         "        return self.grid.g(F.linear(x, self.weight, self.bias))  # every rank's bias, summed",
         "from scratch (zero biases) the first steps match gpt2.py, then the curves part; pretrained weights are off "
         "from step 0", "parallel_layers_dtensor", "row_out"),
        ("gradients summed over the DP group instead of averaged",
         "torch.cat([g.reshape(-1) for g in grads]).div_(self.grid.dp)",
         "torch.cat([g.reshape(-1) for g in grads])",
         "TP x DP runs track gpt2.py closely (AdamW and clipping hide a constant gradient scale) but the gradients "
         "are d times too large", "parallel_layers_dtensor", "gradient after sync_grads"),
        ("the clip norm counts each replicated gradient t times",
         'p.grad.float().pow(2).sum() / (1 if hasattr(p, "tp_split") else grid.tp)',
         "p.grad.float().pow(2).sum()",
         "the curve drifts from gpt2.py's only while clipping is active (a slightly larger norm, a smaller step)",
         "parallel_layers_dtensor", "clip_norm"),
        ("g's backward all-reduces the gradient as well (f and g not conjugate)",
         """        return all_reduce(x, grid)

    @staticmethod
    def backward(ctx, grad):
        return grad, None""",
         """        ctx.grid = grid
        return all_reduce(x, grid)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.grid), None""",
         "the loss is right at step 0 and wrong from step 1: every gradient below a row-parallel matmul is t times "
         "too large", "parallel_layers_dtensor", "row_dx"),
        ("the loss's backward subtracts the one-hot on every rank, not only on the target's owner",
         "        one_hot = mine.to(softmax.dtype).unsqueeze(1)  # (N, 1): 1 where this rank holds the target",
         "        one_hot = torch.ones_like(softmax[:, :1])  # (N, 1)",
         "the loss is right at step 0, wrong from step 1; the embedding learns the wrong tokens",
         "parallel_layers_dtensor", "loss_dwte"),
        ("the vocab-parallel embedding's shard boundary off by one",
         "    foreign = (idx < lo) | (idx >= hi)  # (B, T)",
         "    foreign = (idx < lo) | (idx > hi)  # (B, T)",
         "an IndexError on the first batch holding the token id t*V/t's boundary (25152 at TP=2), or a silently "
         "doubled embedding row", "parallel_layers_dtensor", "vocab_parallel_embedding"),
        ("the clip reads the norm on the host", "    return all_reduce(torch.stack(sq).sum(), grid).sqrt()\n",
         "    return torch.tensor(all_reduce(torch.stack(sq).sum(), grid).sqrt().item())\n",
         "every curve matches; on CUDA every step waits for the GPU once more, in the clip",
         "norm_and_clip_add_no_host_sync", "host syncs in grad_norm"),
        ("--overlap-comm read but not applied", "    elif args.overlap_comm:\n        grid_class, model_class",
         "    elif False:\n        grid_class, model_class",
         "every curve matches (the same products); the timeline shows no dX all-reduce under its dW",
         "each_flag_changes_what_it_must", "the flag must move each all-reduce before its dW"),
    ],

    "pipeline.py": [
        ("loss not scaled by 1/M", "out = self.model.head_loss(h, self.ys[mb]) * self.scale",
         "out = self.model.head_loss(h, self.ys[mb])", "the logged loss is M times gpt2.py's from step 0, every "
         "gradient M times too large", "two_ranks_every_schedule", "loss, naive rank"),
        ("tied wte/lm_head gradients not summed", "        if self.P > 1 and (self.first or self.last):\n",
         "        if False:\n", "the curve drifts from gpt2.py after step 0; the first and last stage's wte "
         "differ", "two_ranks_every_schedule", "norm of wte.weight"),
        ("--dp gradients summed, not averaged", "            self.all_reduce(p.grad, self.dp_group)\n"
         "            p.grad /= self.D\n", "            self.all_reduce(p.grad, self.dp_group)\n",
         "--dp 2 runs drift from gpt2.py only slowly (AdamW hides a constant scale)", "four_ranks", "--dp 2 rank"),
        ("clip norm not summed over the stages", "        if self.P > 1:\n            self.all_reduce(sq, self.pipe_group)"
         "  # the sum of squares over the stages\n", "", "each stage clips by its own norm: too little, from the "
         "first clipped step", "two_ranks_every_schedule", "gradient clipped to half its norm"),
        ("clip coefficient clamped the wrong way", "max=1.0)  # a tensor: no host sync", "min=1.0)  # a tensor: no host sync",
         "gradients are never clipped: the coefficient never goes below 1", "two_ranks_every_schedule",
         "gradient clipped to half its norm"),
        ("--grad-accum not in the loss scale", "scale = 1.0 / (args.micro_batches * args.grad_accum)",
         "scale = 1.0 / args.micro_batches", "at --grad-accum 2 the logged loss is twice gpt2.py's",
         "two_ranks_every_schedule", "--grad-accum 2"),
        ("1F1B with one warm-up forward too many", "warmup = min(P - 1 - s, M)  # forwards",
         "warmup = min(P - s, M)  # forwards", "the same losses, but every rank holds one micro-batch more than "
         "P - stage", "core_loops_pair_their_messages", "held per stage [2, 2], expected [2, 1]"),
        ("the last steady backward waits for an activation that never comes",
         "recv_from=pipe.up if more else None)", "recv_from=pipe.up)",
         "the first step hangs at its end on every rank but the first (a receive no rank sends)",
         "core_loops_pair_their_messages", "unmatched"),
        ("--naive read but not applied", "return (naive_step if self.args.naive else one_f_one_b)(self, x, y, scale)",
         "return one_f_one_b(self, x, y, scale)", "the same losses (both loops compute the same gradients), "
         "but --naive holds P - stage micro-batches, not M: the lesson it teaches is gone",
         "two_ranks_every_schedule", "naive rank 0: the ops did not run in the op list's order"),
        ("the core's checks skipped", "    check_args(args, P)\n    ctx = gpt2.setup(args)\n",
         "    ctx = gpt2.setup(args)\n", "the whole file still refuses; the --core handout trains on 6 of 8 rows "
         "at --micro-batches 3 and drops the last block when the ranks do not divide --n-layer",
         "core_refuses", "gpt2.setup reached"),
    ],
    "moe_ep.py": [
        ("capacity rounds down", "math.ceil(self.cf * n_tokens * self.k / self.E)",
         "int(self.cf * n_tokens * self.k / self.E)",
         "with --capacity-factor a few more tokens are dropped than the factor allows; every EP layout still equals "
         "one rank (they round alike)", "capacity_rounds_up", "expected ceil(6.25) = 7"),
        ("gates never weight the expert outputs", "out = (y.view(self.k, -1, D) * gates.t().unsqueeze(-1)).sum(0)",
         "out = y.view(self.k, -1, D).sum(0)",
         "the router learns from the aux loss only; EP=2 still equals one rank, the loss is a little worse",
         "dense_reference", "MoE.forward vs the dense reference"),
        ("dense gradients summed over the world", "all_reduce_grads(dense, None, world, world)",
         "all_reduce_grads(dense, None, world, 1)",
         "the curves of 2 ranks move a little from one rank's (AdamW and clipping hide most of a 2x gradient)",
         "one_sgd_step", "all_reduce_grads of the dense parameters"),
        ("expert gradients divided by their replicas, not the world", "all_reduce_grads(experts, expert_dp_group, dp, world)",
         "all_reduce_grads(experts, expert_dp_group, dp, dp)",
         "nothing visible in the loss at EP=2 on 2 ranks (one replica: a 2x expert gradient, which AdamW hides)",
         "one_sgd_step", "all_reduce_grads of the experts"),
        ("micro-step loss not divided by --grad-accum", "((loss + aux) / args.grad_accum).backward()",
         "(loss + aux).backward()",
         "the logged loss is right (it is divided separately) and AdamW hides the 2x gradient",
         "one_sgd_step", "not divided by --grad-accum"),
        ("clip norm from this rank's experts only", "        dist.all_reduce(expert_sq, group=ep_group)\n",
         "        expert_sq = expert_sq * 1  # this rank's experts only\n",
         "EP runs clip a little less than one rank once the gradient norm exceeds --grad-clip",
         "one_sgd_step", "clip_global_grad_norm"),
        ("--naive takes its local expert ids for global ones", "(picks == self.first + e)", "(picks == e)",
         "--naive on several ranks: every rank runs its experts on the tokens of experts 0..E/ep-1",
         "expert_parallel_equals_one_process", "NaiveMoE layer, EP=4 vs one process"),
        ("expert counts not summed over the ranks", "                dist.all_reduce(c)\n", "                c = c * 1\n",
         "each rank balances its own batch: the aux loss, drop rate and expert-load picture differ from one rank's",
         "expert_parallel_equals_one_process", "expert loads differ"),
    ],

    "fp8.py": [
        ("gradients summed over the ranks, not averaged", "    flat /= world\n", "    flat /= 1\n",
         "the loss curve looks fine (AdamW and clipping hide a factor of 2); every gradient is twice the mean",
         "gradients_after_all_reduce", "after fp8.all_reduce_grads"),
        ("the column's chunk scale left out of the promotion", "acc += partial * a_scales[:, k, None] * b_rows[None, :, k]",
         "acc += partial * a_scales[:, k, None]", "every fp8 output is off by the weight's scale (~1e-3): the loss "
         "barely moves", "fp8_matmul_vs_fp64", "fp8 GEMM vs fp64"),
        ("wgrad re-cuts x with amax/448 scales", "cls.tiles(x_hp.t(), pow2=True)", "cls.tiles(x_hp.t())",
         "training works, a little noisier: x is rounded twice on its way to wgrad", "pow2_scales_make_the_wgrad",
         "Fp8LinearFn's wgrad"),
        ("power-of-2 scales rounded down", "(bits + 0x007FFFFF) & 0x7F800000", "bits & 0x7F800000",
         "a tile's largest values exceed 448 and saturate", "pow2_scales_make_the_wgrad", "_pow2_up must round"),
        ("no amax floor", "scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX", "scale = amax / FP8_MAX",
         "NaN as soon as a tile is all zeros (0 / 0)", "extreme_magnitudes", "AMAX_FLOOR"),
        ("the logged loss summed over the ranks", "    return t / world\n", "    return t\n",
         "2-rank runs log twice the loss of one process", "two_rank_training_fp8_vs_baseline",
         "train loss, fp8.py --fp8 off 2 ranks"),
        ("--naive read but not applied", "Linear = NaiveFp8Linear if args.naive else Fp8Linear",
         "Linear = Fp8Linear", "the handout's --naive trains with tiles: its loss looks like any fp8 run's",
         "every_documented_flag", "the flag is read but not applied"),
        ("the naive version scales per tile", "    tiles = staticmethod(quantize_tensorwise)\n",
         "    tiles = staticmethod(quantize_1x128)\n", "--naive trains fine: only an outlier would show it",
         "scales_alone", "must take one scale per tensor for x and dy"),
    ],

    "muon.py": [
        ("owners sum", "            self.own /= self.world\n", "",
         "2 ranks train exactly like 1 (Newton-Schulz removes the scale) but the clip sees a 2x gradient norm",
         "distributed_muon_equals_one_rank", "Muon.reduce_grads"),
        ("naive version sums", "        p.grad /= world\n", "        pass\n",
         "--naive trains almost like the owners: only the clip coefficient sees the N x gradient",
         "distributed_muon_equals_one_rank", "naive_all_reduce"),
        ("Nesterov from the wrong side", "u = grad.lerp(momentum, beta) if nesterov else momentum",
         "u = momentum.lerp(grad, beta) if nesterov else momentum",
         "it trains, a little worse than it should: the look-ahead leans on the gradient, not the momentum",
         "torch_muon", "differs from torch.optim.Muon"),
        ("clip not applied to Muon", "self._view(self.own, i).mul_(clip_coef)", "self._view(self.own, i)",
         "the loss curve looks right: a constant scale vanishes in Newton-Schulz, only a clip that varies shows",
         "torch_muon", "the clip coefficient"),
        ("the gather sends gradients", "        for i in self.mine:\n            self._view(self.own, i).copy_(self.params[i])\n", "",
         "several ranks diverge from one after the first step: every rank but the owner reads the gradient slab",
         "distributed_muon_equals_one_rank", "all_gather_params"),
        ("--no-nesterov ignored", "nesterov=args.nesterov", "nesterov=True",
         "every run uses Nesterov momentum, whatever the flag says", "flags_reach_muon", "--no-nesterov"),
        ("--muon-scale ignored", "scale=args.muon_scale", 'scale="original"',
         "--muon-scale match_rms_adamw changes the default lr but not the update's scale",
         "flags_reach_muon", "match_rms_adamw"),
        ("AdamW gradients summed", "    flat /= world\n", "",
         "2 ranks log twice the loss of 1 rank", "curve_two_ranks", "train loss, muon.py 2 ranks"),
        ("--ns-steps ignored", "ns_steps=args.ns_steps", "ns_steps=5",
         "every run takes 5 Newton-Schulz steps, whatever the flag says", "flags_reach_muon", "--ns-steps"),
        ("Newton-Schulz in bf16 whatever the run", "ns_dtype=ctx.dtype", "ns_dtype=torch.bfloat16",
         "fp32 runs on a GPU no longer equal the CPU's: the update carries bf16 rounding",
         "runs_dtype", "make_muon must pass the run's dtype"),
    ],

    "checkpoint.py": [
        ("the rename before the fsync",
         "        os.fsync(f.fileno())  # the bytes on disk before the name: `path` is never half-written\n"
         "    os.replace(path + \".tmp\", path)  # atomic: path is the old file or the new one, never a mix\n",
         "        os.replace(path + \".tmp\", path)  # atomic: path is the old file or the new one, never a mix\n"
         "        os.fsync(f.fileno())  # the bytes on disk before the name: `path` is never half-written\n",
         "training and resuming look fine; after a power loss a committed name can point at empty or torn bytes",
         "fsynced_then_renamed", "were not fsynced before the rename"),
        ("no fsync of the directory after the rename",
         "    fsync_dir(os.path.dirname(path))  # the rename itself durable\n", "",
         "training and resuming look fine; after a power loss the rename (the commit itself) can be undone",
         "fsynced_then_renamed", "was not fsynced after the rename"),
        ("rank 0 commits before the other shards are durable",
         "        with self.io.compute(\"gather\", \"all_gather\"):  # every rank's (bytes, crc32) to every rank\n"
         "            reports = report.repeat(self.ctx.world, 1)\n"
         "            if self.group is not None:  # returns once every shard is durable\n"
         "                all_gather_single(reports.view(-1), report, group=self.group)\n"
         "        if self.ctx.master:\n"
         "            with self.io.compute(f\"commit {step}\", \"io\"):\n"
         "                self.commit(step, d, reports, meta[\"loader\"])\n",
         "        reports = report.repeat(self.ctx.world, 1)\n"
         "        if self.ctx.master:\n"
         "            with self.io.compute(f\"commit {step}\", \"io\"):\n"
         "                self.commit(step, d, reports, meta[\"loader\"])\n"
         "        with self.io.compute(\"gather\", \"all_gather\"):  # every rank's (bytes, crc32) to every rank\n"
         "            if self.group is not None:  # returns once every shard is durable\n"
         "                all_gather_single(reports.view(-1), report, group=self.group)\n",
         "resumes work; a crash between the commit and a slow rank's write leaves a committed checkpoint with a "
         "missing shard, and the manifest lists rank 0's checksum for every shard",
         "fsynced_then_renamed", "renamed into place before rank 1's shard was durable"),
        ("gradients summed over the ranks, not averaged",
         "            self.grad_shard.div_(self.world)\n", "",
         "the loss curve stays close to gpt2.py's (AdamW divides a constant scale away); the moments are N times too big",
         "mean_gradient", "the reduce-scatter SUMs the ranks"),
        ("AdamW's step count not restored",
         "torch.tensor(float(step))", "torch.tensor(0.0)",
         "the resumed loss jumps at the first step after the resume (the bias correction starts over)",
         "every_piece", "AdamW's step count"),
        ("the RNG state not restored",
         "            torch.set_rng_state(rng[\"rng_cpu\"])\n", "            pass\n",
         "nothing visible here (no dropout); with dropout or sampling the resumed run leaves the straight one",
         "every_piece", "CPU RNG state"),
        ("the loader position not restored",
         "loader.load_state_dict(man[\"loader\"])  # a token offset", "pass  # a token offset",
         "the resumed curve differs from the straight one from the first resumed step: it trains on data seen before",
         "every_piece", "loader position"),
        ("the snapshot a view of the live state",
         "out = {k: v.to(\"cpu\", copy=True) for k, v in out.items()}", "out = {k: v.to(\"cpu\") for k, v in out.items()}",
         "on CPU, a checkpoint holds weights from a later step than its name says; a resume from it is not bit-exact",
         "snapshot_is_a_copy and Async", "not a copy"),
        ("resharding reads each shard at this rank's offset",
         "tensors[k][a - sh[\"lo\"]: b - sh[\"lo\"]]", "tensors[k][a - z.lo: b - z.lo]",
         "a resume on as many ranks as wrote it works; on another world size it crashes or loads the wrong weights",
         "every_piece", "read_slices"),
        ("a shard's CRC-32 not checked before it is loaded",
         "        check_bytes(path, data, shard)\n", "",
         "a flipped byte in the newest checkpoint is resumed silently; the next loss can be in the millions",
         "falls_back_to_the_newest_commit_that_verifies", "the core must verify every shard"),
        ("a resume does not compare the flags with the checkpoint's",
         "            refuse_another_run(man, d, self.args, self.zero, self.ctx.world)  # before any loading\n", "",
         "a resume with another --lr or --seq-len goes on silently; another --n-embd crashes in read_slices",
         "other_flags", "expected the one-line refusal naming"),
        ("--fail-at exits before its save in flight is committed",
         "            self.wait()  # its save in flight committed first: a resume finds the commit it expects\n", "",
         "the crash lesson resumes from an older commit than the one it saved last (or from none)",
         "max_restarts", "must wait for its save in flight"),
    ],
}

BANNER = "# ---- Beyond the core ----"


def core_copy(source):
    """The file cut at the banner, started by its core's own main(): the handout (issue 30: the core runs alone)."""
    assert source.count(BANNER) == 1, "no '# ---- Beyond the core ----' banner"
    core = source[: source.index(BANNER)].rstrip("\n")
    return core + '\n\n\nif __name__ == "__main__":\n    gpt2.run_main(main)\n'


COURSE_DATA = "data/shakespeare_char"  # the course data, relative to the repository and to a handout


def lesson_command(name, source):
    """The file's own lesson command from its docstring (the first `torchrun ... FILE` line, backslash lines joined,
    its comment and [optional] parts cut), with --data COURSE_DATA and --steps 20 (a minute on 2 cores) when it names
    none; a plain one if the docstring has none."""
    doc = (ast.get_docstring(ast.parse(source)) or "").replace("\\\n", " ")
    for line in doc.splitlines():
        if "torchrun" in line and f" {name}" in line:
            cmd = re.sub(r"\s*\[[^\]]*\]", "", line[line.index("torchrun"):].split(" (")[0].split(" #")[0]).split()
            at = cmd.index(name) + 1
            cmd[at:at] = ["--data", COURSE_DATA] * ("--data" not in cmd) + ["--steps", "20"] * ("--steps" not in cmd)
            return " ".join(cmd)
    return f"torchrun --nproc_per_node=2 {name} --data {COURSE_DATA} --steps 20 --out out/{name[:-3]}"


def handout_copy(name, source):
    """The core alone (core_copy) with a paragraph closing its docstring: what the handout is, and the lesson
    command to run from its directory."""
    text = core_copy(source)
    doc = ast.parse(text).body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{name}: no module docstring"
    lines = text.splitlines(keepends=True)
    last = lines[doc.end_lineno - 1]
    quote = max(last.rfind('"""'), last.rfind("'''"))  # the docstring's closing quotes
    note = (f"\nHandout (`python tests/exercise.py {name} --core --out DIR`): this core, cut at its banner, and a\n"
            f"gpt2.py of only what it uses. From DIR, with the course data in DIR/{COURSE_DATA}:\n"
            f"    {lesson_command(name, source)}\n")
    head = last[:quote].rstrip()
    lines[doc.end_lineno - 1] = (head + "\n" if head else "") + note + last[quote:]
    return "".join(lines)


APPENDIX = "# ---- Appendix ----"
# A handout's gpt2.py at most (issue 37 asks 900; gpt2.py's core is ~450 lines and the toolkit every core uses - run_main,
# setup, make_parser, the checks, Metrics, Timeline - another ~600 with their blank lines, so 900 is not reached).
LEAN_LINES = 1250
LEAN_NOTE = "This handout's appendix"  # marks a gpt2.py written here (rewritten when another core joins it)
LEAN_COMMANDS = ("train", "prepare", "sample")  # gpt2.py's commands a handout keeps, in this order, while they fit
# What a handout leaves to the repository's gpt2.py: the name, replaced by a one-line refusal naming the flag.
LEAN_STUBS = {"load_weights": ("--init-from", "weights (pretrained or a saved model.pt) are read by the repository's "
                                              "gpt2.py"),
              "check_init_from": ("--init-from", "weights are read by the repository's gpt2.py"),
              "prepare": ("--data", "pass --data DIR: this handout's gpt2.py prepares no data; the repository's "
                                    "`python gpt2.py prepare shakespeare-char` does"),
              "lock_dir": (None, "the repository's gpt2.py also locks --out against a second run")}


def names_used(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def names_defined(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def is_main_block(node):
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


def gpt2_names_used(source):
    """The names a technique file takes from gpt2: `gpt2.X` anywhere, `from gpt2 import X`."""
    tree = ast.parse(source)
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "gpt2"}
    return used | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "gpt2"
                   for a in n.names}


def lean_gpt2(source, cores):
    """gpt2.py for a handout: its core whole, and of its appendix only the definitions that the core, the
    technique cores (`cores`: their sources) and the kept commands reach, transitively (by the names they use);
    the commands (train, then prepare and sample while the file stays within LEAN_LINES) in a new __main__."""
    lines = source.splitlines()
    banners = [i for i, line in enumerate(lines) if line.startswith(APPENDIX)]
    assert len(banners) == 1, "gpt2.py needs one line that starts with '# ---- Appendix ----'"
    cut = banners[0]  # 0-based index of the banner
    tree = ast.parse(source)
    core_nodes = [n for n in tree.body if n.lineno <= cut]
    appendix = [n for n in tree.body if n.lineno > cut and not is_main_block(n)]
    roots = set().union(*(names_used(n) for n in core_nodes), *(gpt2_names_used(c) for c in cores))
    always = [n for n in appendix if not names_defined(n)]  # statements that define nothing: kept as they are

    def closure(commands):
        need, kept = roots | set(commands) | set().union(*map(names_used, always)), set()
        while True:
            new = [n for n in appendix if id(n) not in kept and (names_defined(n) & need or n in always)]
            if not new:
                return [n for n in appendix if id(n) in kept]
            for n in new:
                kept.add(id(n))
                if not stubbed(n, commands):
                    need |= names_used(n)

    def stubbed(n, commands):
        return isinstance(n, ast.FunctionDef) and n.name in LEAN_STUBS and n.name not in commands

    def render(commands):
        chunks = []
        for n in closure(commands):
            if stubbed(n, commands):
                flag, todo = LEAN_STUBS[n.name]
                body = f"fail(\"not in this handout's gpt2.py\", {flag!r}, {todo!r})" if flag else f"pass  # {todo}"
                chunks.append(f"def {n.name}(*args, **kwargs):  # the repository's gpt2.py has the whole one\n"
                              f"    {body}")
                continue
            first = min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]) - 1
            while first > 0 and lines[first - 1].startswith("#") and not lines[first - 1].startswith(APPENDIX):
                first -= 1  # the comment right above it
            chunks.append("\n".join(lines[first:n.end_lineno]))
        main = ('if __name__ == "__main__":\n'
                f'    commands = {{{", ".join(f"{c!r}: {c}" for c in commands)}}}\n'
                '    if len(sys.argv) < 2 or sys.argv[1] not in commands:\n'
                '        sys.exit(f"usage: python gpt2.py {{{\',\'.join(commands)}}} [flags]   (add -h to a command for '
                'its flags)")\n'
                '    run_main(commands[sys.argv[1]], sys.argv[2:])\n')
        head = "\n".join(lines[:cut]).rstrip("\n")
        note = (f"{APPENDIX}\n# {LEAN_NOTE}: only what the cores beside it use (tests/exercise.py --core "
                f"chose it); the\n# repository's gpt2.py has the rest (HF weights, FineWeb, HellaSwag, export, "
                f"the profiler and timeline).")
        return head + "\n\n\n" + note + "\n\n\n" + "\n\n\n".join(chunks) + "\n\n\n" + main

    commands = ["train"]
    for extra in LEAN_COMMANDS[1:]:
        if render(commands + [extra]).count("\n") <= LEAN_LINES:
            commands.append(extra)
    return render(commands)


def plant(source, bug):
    """The source with one zoo bug planted."""
    name, original, buggy = bug[:3]
    assert source.count(original) == 1, f"bug {name!r}: its original text is not unique in the file: {original!r}"
    return source.replace(original, buggy)


def run_pytest(root, impl, test, basetemp, k=None):
    import subprocess
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
                           "--impl", impl, test, *(["-k", k] if k else [])], cwd=root, capture_output=True, text=True,
                          timeout=1200)


def check_zoo(name, root, work, only=None):
    """Each zoo bug of `name` fails its test, and the failure names it (its phrase appears in the output).
    Returns [(bug number, bug name, caught, named, the first line of `what differs` or of the failure)]."""
    with open(os.path.join(root, name)) as f:
        source = f.read()
    rows = []
    for n, bug in enumerate(BUGS[name], 1):
        if only and n != only:
            continue
        bug_name, _, _, _, test, phrase = bug
        d = os.path.join(work, f"{name[:-3]}_bug{n}")
        os.makedirs(d)
        with open(os.path.join(d, name), "w") as f:
            f.write(plant(source, bug))
        out = run_pytest(root, d, f"tests/test_{name[:-3]}.py", f"{d}/tmp", test)
        text = out.stdout + out.stderr
        lines = text[text.find("what differs -"):].splitlines()[1:2] if "what differs -" in text else \
            [next((l for l in text.splitlines() if l.startswith("E ")), "")]
        rows.append((n, bug_name, out.returncode == 1, phrase in text, (lines or [""])[0][:200]))
    return rows


def check(name, root, work):
    """The exercise copy fails with its own message, the bug copy fails saying what differs, the reference
    copy passes: each under `pytest --impl` on the file's CHECKS test. Returns [(kind, exit code, line)]."""
    test, (line, bug) = CHECKS[name]
    with open(os.path.join(root, name)) as f:
        source = f.read()
    assert source.count(line) == 1, f"{name}: the bug's line is not unique: {line!r}"
    rows = []
    for kind, text in (("exercise", cut(source, EXERCISES[name])), ("bug", source.replace(line, bug)),
                       ("reference", source)):
        d = os.path.join(work, name[:-3], kind)
        os.makedirs(d)
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
        out = run_pytest(root, d, f"tests/test_{name[:-3]}.py", f"{d}/tmp", test)
        key = {"exercise": "NotImplementedError: exercise", "bug": "what differs -", "reference": " passed"}[kind]
        lines = out.stdout[out.stdout.find(key):].splitlines() if key in out.stdout else [""]
        rows.append((kind, out.returncode, (lines[1] if kind == "bug" and len(lines) > 1 else lines[0])[:200]))
    return rows


def hint_for(test_module):
    return HINTS.get(test_module.rsplit(".", 1)[-1])


def find(tree, dotted):
    """The FunctionDef of `name` or `Class.name` at the top level of a module."""
    scope = tree.body
    *outer, name = dotted.split(".")
    for cls in outer:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls).body
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise KeyError(f"{dotted} not found")


def cut(source, exercises):
    """The source with each listed function's body (its docstring kept) replaced by a NotImplementedError."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    spans = []
    for n, (dotted, what) in enumerate(exercises, 1):
        fn = find(tree, dotted)
        body = fn.body
        keep_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str)
        first = body[1] if keep_doc and len(body) > 1 else None if keep_doc else body[0]
        indent = " " * body[0].col_offset
        stub = f'{indent}raise NotImplementedError("exercise {n}: {dotted}: {what}")\n'
        if first is None:
            spans.append((body[0].end_lineno, body[0].end_lineno, stub))
        else:
            spans.append((first.lineno - 1, fn.end_lineno, stub))
    for start, end, stub in sorted(spans, reverse=True):
        lines[start:end] = [stub]
    return "".join(lines)


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description="Write a technique file with its core's key functions to re-implement, "
                                            "its core alone (--core), or a copy with a planted bug (--bug).")
    p.add_argument("file", nargs="?", choices=sorted(EXERCISES), help="the technique file")
    p.add_argument("--out", help="directory for your copy (then: pytest --impl DIR)")
    p.add_argument("--list", action="store_true", help="print every file's exercises")
    p.add_argument("--core", action="store_true", help="write the core alone (cut at the banner) and a gpt2.py of only "
                                                       "what it uses: the handout")
    p.add_argument("--bug", help="N: write a copy with zoo bug N planted; list: list FILE's zoo (every file's without FILE)")
    p.add_argument("--check", action="store_true", help="for maintainers: the round trip of FILE (or every file) and "
                                                        "every zoo bug caught by its test")
    a = p.parse_args(argv)
    if a.check:
        import tempfile
        failed = 0
        with tempfile.TemporaryDirectory() as work:
            for name in [a.file] if a.file else EXERCISES:
                for kind, code, line in check(name, root, work):
                    failed += (code == 0) != (kind == "reference")
                    print(f"{name} {kind}: exit {code} | {line}", flush=True)
                for n, bug_name, caught, named, line in check_zoo(name, root, work):
                    failed += not (caught and named)
                    print(f"{name} bug {n} ({bug_name}): {'caught' if caught else 'MISSED'}"
                          f"{'' if named or not caught else ', NOT NAMED'} | {line}", flush=True)
        sys.exit(1 if failed else 0)
    if not a.file and not a.list and a.bug != "list":  # --out, --core or --bug N act on one file
        print("error: which file (FILE): give a technique file, e.g. `python tests/exercise.py ddp.py --out mine`; "
              "--list shows every file's exercises", file=sys.stderr)
        sys.exit(2)
    if a.bug == "list" or (a.bug is None and a.list):
        if a.bug == "list":
            for f in [a.file] if a.file else BUGS:
                for n, (bug_name, _, _, symptom, test, _) in enumerate(BUGS[f], 1):
                    print(f"{f} bug {n}: {bug_name}: {symptom} (caught by -k {test})")
            return
        for f, items in EXERCISES.items():
            print(f)
            for n, (dotted, what) in enumerate(items, 1):
                print(f"  exercise {n}: {dotted}: {what}")
        return
    if not a.out:
        sys.exit("error: where to write your copy (--out): give a directory, e.g. --out mine")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        sys.exit(f"error: {a.out} is a file (--out): give a directory")
    dst = os.path.join(a.out, a.file)
    if os.path.exists(dst):
        sys.exit(f"error: {dst} exists (--out): your work is never overwritten; choose another directory")
    mine = os.path.join(a.out, "gpt2.py")
    if a.core and os.path.exists(mine) and LEAN_NOTE not in open(mine).read():
        sys.exit(f"error: {mine} exists and is not a handout's (--out): your work is never overwritten; "
                 f"choose another directory")
    with open(os.path.join(root, a.file)) as f:
        source = f.read()
    if a.bug is not None:
        if not a.bug.isdigit() or not 1 <= int(a.bug) <= len(BUGS[a.file]):
            sys.exit(f"error: --bug {a.bug} (--bug): give 1..{len(BUGS[a.file])} or list")
        text, what = plant(source, BUGS[a.file][int(a.bug) - 1]), f"bug {a.bug} planted (symptom: " \
            f"{BUGS[a.file][int(a.bug) - 1][3]})"
    elif a.core:
        text, what = handout_copy(a.file, source), "its core alone"
    else:
        text, what = cut(source, EXERCISES[a.file]), f"{len(EXERCISES[a.file])} exercises"
    os.makedirs(a.out, exist_ok=True)
    with open(dst, "w") as f:
        f.write(text)
    if a.core:
        import shutil
        cores = [text] + [open(os.path.join(a.out, f)).read() for f in EXERCISES if f != a.file
                          and os.path.exists(os.path.join(a.out, f))]  # a second handout in DIR keeps what it uses
        with open(os.path.join(root, "gpt2.py")) as f:
            lean = lean_gpt2(f.read(), cores)
        with open(mine, "w") as f:  # a handout's own gpt2.py: rewritten for every core in DIR
            f.write(lean)
        data, have = os.path.join(a.out, COURSE_DATA), os.path.join(root, COURSE_DATA)
        if os.path.isdir(have) and not os.path.exists(data):
            shutil.copytree(have, data)
        print(f"wrote {dst} ({what}, {text.count(chr(10))} lines) and {a.out}/gpt2.py ({lean.count(chr(10))} lines, "
              f"what the core uses)")
        if not os.path.isdir(data):
            print(f"the lesson reads the course data; from the repository: python gpt2.py prepare shakespeare-char "
                  f"--out {data}")
        print(f"run it from {a.out}: {lesson_command(a.file, source)}")
        return
    print(f"wrote {dst} with {what}; test it with: python -m pytest -q --impl {a.out} tests/test_{a.file[:-3]}.py")


if __name__ == "__main__":
    main()
