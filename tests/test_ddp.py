"""ddp.py: per-tensor checks first (one SGD step on 2 ranks = one process on the global batch, for the naive
version, the buckets, unused-parameter detection, ZeRO-1 and ZeRO-2, with and without accumulation; every
bucket waited for on its own work; ZeRO-2's two buckets in flight; buckets launched during backward; the
timeline's labels), then end-to-end: the 2-rank run reproduces `gpt2.py train` over 60 steps (plain), with
--grad-accum 2, --naive, ZeRO-2 with accumulation, ZeRO-1 in bf16, --compile; bytes and memory per rank equal
the closed forms; DataParallel and ShardedOptimizer on a toy model with tied, frozen and unused parameters match
one process and torch's DistributedDataParallel."""
import contextlib
import functools
import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import ddp
import gpt2
from harness import assert_close, compare, read_metrics, run_cli, run_clis, run_distributed, train_losses

CFG = ["--model", "tiny", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "16",
       "--device", "cpu", "--dtype", "float32", "--eval-every", "20", "--eval-steps", "2"]
STEPS = 60  # the curve: warmup 20, then the cosine; the shorter runs stay in the warmup, where --steps changes nothing


def gradient_mb():
    """fp32 gradient bytes of the CFG model, the tied wte/lm_head counted once, computed here."""
    m = gpt2.GPT(gpt2.GPTConfig(block_size=256, n_layer=2, n_head=2, n_embd=32))
    return 4 * sum(p.numel() for p in m.parameters()) / 1e6


def bucket_bytes(cap_mb):
    """The CFG model's buckets at --bucket-mb cap_mb (reverse parameter order, closed at the cap)."""
    m = gpt2.GPT(gpt2.GPTConfig(block_size=256, n_layer=2, n_head=2, n_embd=32))
    return [sum(p.nbytes for p in run) for run in ddp.bucket_params(list(m.parameters())[::-1], cap_mb * 1e6)]


@pytest.fixture(scope="module")
def baseline(random_data, tmp_path_factory):
    """`gpt2.py train` in this process with a global batch of 8 rows, 60 steps."""
    out = str(tmp_path_factory.mktemp("base"))
    gpt2.train(CFG + ["--data", random_data, "--batch-size", "8", "--steps", str(STEPS), "--out", out])
    return out


def val_losses(out):
    return [r["val_loss"] for r in read_metrics(out) if "val_loss" in r]


def val_steps(out):
    return [r["step"] for r in read_metrics(out) if "val_loss" in r]


def grad_norms(out):
    return [r["grad_norm"] for r in read_metrics(out) if "loss" in r]


def summary(out):
    """The run's one summary record: the figures its closing lines print (the last line of metrics.jsonl)."""
    recs = read_metrics(out)
    assert sum("summary" in r for r in recs) == 1 and "summary" in recs[-1], recs[-3:]
    return recs[-1]["summary"]


# -- per tensor: one optimizer step of each wrapper on 2 ranks vs one process -------------------------------

GPT_CFG = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)
KINDS = ("naive", "plain", "find_unused", "zero1", "zero2")


def gpt_batch(rank, micro):
    g = torch.Generator().manual_seed(1000 + 10 * rank + micro)
    idx = torch.randint(0, 50257, (2, 17), generator=g)
    return idx[:, :-1], idx[:, 1:]


def wrap(kind, model, timeline=None):
    if kind == "naive":
        return ddp.NaiveDataParallel(model)
    cls = {"plain": ddp.DataParallel, "find_unused": ddp.FindUnusedParameters, "zero1": ddp.ZeRO1DataParallel,
           "zero2": ddp.ZeRO2DataParallel}[kind]
    return cls(model, 0.02, None, timeline)  # 0.02 MB: 4 buckets on this model


class LazyWork:
    """An asynchronous collective that runs only when waited for: a bucket read before its own wait() holds
    this rank's gradient, not the mean, whatever the timing (a fast gloo would hide a missing wait)."""

    def __init__(self, run, log):
        self.run, self.log, self.done = run, log, False
        log["pending"].append(self)
        log["issued"] += 1
        log["most_in_flight"] = max(log["most_in_flight"], len(log["pending"]))
        log["grads_seen_at_issue"].append(log["grads_seen"])

    def wait(self):
        if not self.done:
            self.run()
            self.done = True
            self.log["pending"].remove(self)
        return True


def lazy_collectives(log):
    """Make the async all-reduce and reduce-scatter lazy (this spawned process only); the blocking ones stay."""
    real_ar, real_rs = dist.all_reduce, ddp.gpt2.reduce_scatter_single

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return LazyWork(lambda: real_ar(t, op, group), log) if async_op else real_ar(t, op, group)

    def reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return LazyWork(lambda: real_rs(out, inp, op, group), log) if async_op else real_rs(out, inp, op, group)

    dist.all_reduce, ddp.gpt2.reduce_scatter_single = all_reduce, reduce_scatter
    return lambda: (setattr(dist, "all_reduce", real_ar), setattr(ddp.gpt2, "reduce_scatter_single", real_rs))


def one_sgd_step(rank, kind, accum, log):
    """SGD (lr 1, no momentum, no clipping): the update IS the gradient, so its scale shows (AdamW hides it)."""
    torch.manual_seed(rank)  # different on each rank: the broadcast from rank 0 must fix it
    model = gpt2.GPT(gpt2.GPTConfig(**GPT_CFG))
    net = wrap(kind, model)
    for p in model.parameters():  # runs after ours: counts the gradients that have landed
        p.register_post_accumulate_grad_hook(lambda p: log.__setitem__("grads_seen", log["grads_seen"] + 1))
    sgd = lambda groups: torch.optim.SGD(groups, lr=1.0)
    params = list(model.parameters())
    opt = net.make_optimizer(params, sgd) if hasattr(net, "make_optimizer") else sgd(params)  # ZeRO: sharded
    for micro in range(accum):
        log["grads_seen"] = 0
        with net.no_sync() if micro < accum - 1 else contextlib.nullcontext():
            (net(*gpt_batch(rank, micro))[1] / accum).backward()
    log["after_backward"] = log["issued"]
    net.finish_grad_sync()
    log["left_pending"] = len(log["pending"])
    log["bytes_launched"] = list(net.bytes_launched)  # [after, during] backward
    log["bucket_bytes"] = [b.nbytes for b in getattr(net, "buckets", [])]
    for w in list(log["pending"]):  # keep the ranks' collectives matched even when a wait was missed
        w.wait()
    opt.step()
    net.close()
    n_params = len(list(model.parameters()))
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, n_params


def timeline_rows(rank, world, path):
    """One recorded step of DataParallel with gpt2.Timeline: rank 0's rows."""
    torch.manual_seed(0)
    model = gpt2.GPT(gpt2.GPTConfig(**GPT_CFG))
    timeline = gpt2.Timeline(SimpleNamespace(device=torch.device("cpu"), master=rank == 0), record_step=0)
    net = wrap("plain", model, timeline)
    timeline.start_step(0)
    with timeline.compute("backward"):
        net(*gpt_batch(rank, 0))[1].backward()
    net.finish_grad_sync()
    rows = timeline.save(path)
    net.close()
    return rows, len(net.buckets)


def unit_checks(rank, world, path):
    out = {"timeline": timeline_rows(rank, world, path)}
    for kind in KINDS:
        for accum in (1, 2):
            log = {"pending": [], "issued": 0, "most_in_flight": 0, "grads_seen": 0, "grads_seen_at_issue": []}
            restore = lazy_collectives(log)
            state, n_params = one_sgd_step(rank, kind, accum, log)
            restore()
            del log["pending"]
            out[kind, accum] = state, log, n_params
    return out


@functools.lru_cache(maxsize=None)
def sgd_reference(accum):
    """One process: rank 0's init, both ranks' micro-batches, the mean of their losses, one SGD step."""
    torch.manual_seed(0)
    model = gpt2.GPT(gpt2.GPTConfig(**GPT_CFG))
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for micro in range(accum):
        sum(model(*gpt_batch(r, micro))[1] for r in range(2)).div(2 * accum).backward()
    opt.step()
    return init, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("timeline") / "timeline.png")
    return run_distributed(unit_checks, 2, path), path


@pytest.mark.parametrize("kind", KINDS)
def test_one_sgd_step_averages_the_gradients(units, kind):
    """The update of every tensor = one process's, so the gradient is the MEAN over ranks and micro-steps."""
    results, _ = units
    for accum in (1, 2):
        init, ref = sgd_reference(accum)
        names = [k for k in ref if not torch.equal(ref[k], init[k])]  # the tensors SGD moved (not the causal mask)
        for r in range(2):
            ours = {k: torch.from_numpy(v) for k, v in results[r][kind, accum][0].items()}
            what = f"weights after one SGD step, {kind} 2 ranks --grad-accum {accum}, rank {r} vs one process: " \
                   f"the norm of each tensor's update"
            upd = [float((ours[k] - init[k]).norm()) for k in names]
            upd_ref = [float((ref[k] - init[k]).norm()) for k in names]
            worst = compare(what, upd, upd_ref, 1e-4, steps=[0] * len(names),
                            hint="a ratio of 2 is a sum where the mean belongs (divide by the world size); 1/2 "
                                 "or 0 for some tensors: a bucket read before it was reduced, or a gradient lost")
            k = max(range(len(names)), key=lambda i: abs(upd[i] - upd_ref[i]) / upd_ref[i])
            assert worst <= 1e-4, f"{what}: {names[k]} moved {upd[k]:.4e} vs {upd_ref[k]:.4e} in one process " \
                                  f"(ratio {upd[k] / upd_ref[k]:.3f}, expected 1)"
            diff = max(float((ours[k] - ref[k]).abs().max()) for k in names)
            assert diff <= 1e-6, f"{what}: weights differ by {diff:.1e} (expected <= 1e-6)"


@pytest.mark.parametrize("kind", ["plain", "find_unused", "zero1", "zero2"])
def test_every_bucket_waited_for_before_its_gradient_is_read(units, kind):
    """Collectives that run only when waited for: a missing or misdirected wait leaves a bucket unreduced."""
    results, _ = units
    for accum in (1, 2):
        log = results[0][kind, accum][1]
        compare(f"bucket collectives not yet waited for when finish_grad_sync returned, {kind} --grad-accum {accum}",
                [log["left_pending"]], [0], 0, steps=[0],
                hint="wait on every bucket's own work (b.work) before handing out p.grad: a bucket read before its "
                     "wait holds this rank's gradient, not the mean (NCCL: the stream has not waited for it)")
        assert log["left_pending"] == 0, f"{kind} --grad-accum {accum}: finish_grad_sync returned with " \
                                         f"{log['left_pending']} of {log['issued']} bucket collectives not waited " \
                                         f"for: wait on every bucket's own work (b.work) before handing out p.grad"


def test_zero2_keeps_two_buckets_in_flight(units):
    results, _ = units
    for accum in (1, 2):
        log = results[0]["zero2", accum][1]
        assert log["issued"] >= 4 * accum, log["issued"]
        compare(f"most reduce-scatters in flight at once, ZeRO-2 --grad-accum {accum}", [log["most_in_flight"]], [2],
                0, steps=[0], hint="launching bucket k first waits for bucket k - in_flight; in_flight = 2 keeps two "
                                   "reduce-scatters under backward")
        assert log["most_in_flight"] == ddp.ZeRO2DataParallel.in_flight == 2, \
            f"ZeRO-2 --grad-accum {accum}: at most {log['most_in_flight']} reduce-scatters in flight (expected 2: " \
            f"launching bucket k waits for bucket k-2, so backward overlaps two; in_flight = " \
            f"{ddp.ZeRO2DataParallel.in_flight})"
    plain = results[0]["plain", 1][1]  # plain and ZeRO-1 wait only at the end: every bucket in flight at once
    assert plain["most_in_flight"] == plain["issued"] >= 4, plain


def test_buckets_launched_during_backward(units):
    """Reverse parameter order: every bucket but the last (wte's) launches while backward still has gradients
    to produce; in forward order nothing could start before wte's gradient, the very last."""
    results, _ = units
    state, log, n_params = results[0]["plain", 1]
    early = sum(seen < n_params - 1 for seen in log["grads_seen_at_issue"])
    compare("buckets launched during backward (before its last gradient landed), DataParallel", [early],
            [log["issued"] - 1], 0, steps=[0], hint="the buckets in reverse parameter order (about the order backward "
                                                     "finishes the gradients), each launched from the hook when complete")
    assert log["after_backward"] == log["issued"]  # every bucket complete when backward returns
    assert early >= log["issued"] - 1, f"{early} of {log['issued']} buckets launched during backward (before " \
                                       f"its last gradient landed); expected all but the last: are the buckets " \
                                       f"in reverse parameter order, launched from the hook?"
    # the payoff figure counts the same: every bucket's bytes but the last one's (wte's, launched by the last
    # gradient), also when a no_sync micro-step came first; naive launches everything after backward
    for accum in (1, 2):
        log = results[0]["plain", accum][1]
        sizes = log["bucket_bytes"]
        assert log["bytes_launched"] == [sizes[-1], sum(sizes[:-1])], \
            f"--grad-accum {accum}: bytes launched [after, during] backward {log['bytes_launched']}, expected " \
            f"[{sizes[-1]}, {sum(sizes[:-1])}] (bucket sizes {sizes}): only a bucket launched while gradients " \
            f"are still due counts as under backward"
        naive = results[0]["naive", accum][1]
        total = 4 * sum(p.numel() for p in gpt2.GPT(gpt2.GPTConfig(**GPT_CFG)).parameters())
        assert naive["bytes_launched"] == [total, 0], (naive["bytes_launched"], total)


def test_timeline_draws_backward_and_each_bucket(units):
    results, path = units
    rows, n_buckets = results[0]["timeline"]
    assert os.path.getsize(path) > 10_000
    labels = {(r, label, kind) for r, label, kind, *_ in rows}
    for r in range(2):
        assert (r, "backward", "compute") in labels
        assert {(r, f"bucket {k}", "all_reduce") for k in range(n_buckets)} <= labels, sorted(labels)
    back_end = {r: e for r, label, kind, s, e in rows if label == "backward"}
    for r, label, kind, s, e in rows:
        assert 0 <= s <= e, (label, s, e)
        if label.startswith("bucket "):  # issued by a hook during backward, complete after it was issued
            assert s <= back_end[r], (label, s, back_end[r])


# -- end to end: the ddp.py runs vs gpt2.py -----------------------------------------------------------------

def test_two_ranks_match_one_process(random_data, baseline, tmp_path):
    # 2 ranks x 2 rows x --grad-accum 2 = gpt2.py's 8 rows: the core's no_sync path, 60 steps
    out = str(tmp_path / "ddp")
    proc = run_cli(["ddp.py"] + CFG + ["--data", random_data, "--steps", str(STEPS), "--batch-size", "2",
                                       "--grad-accum", "2", "--bucket-mb", "0.12", "--overlap-steps", "2",
                                       "--eval-steps", "4", "--out", out], nproc=2)  # val: the same 16 rows
    # the first steps agree to ~1e-7 (fp32, only the summation order differs: one float32 ulp of 10.8 is 8.8e-8
    # relative); the difference compounds with the steps
    ours, ref = train_losses(out), train_losses(baseline)
    compare("train loss, ddp.py --grad-accum 2, 2 ranks fp32 vs gpt2.py, steps 0-2", ours[:3], ref[:3], 3e-7)
    worst = compare(f"train loss, ddp.py --grad-accum 2, 2 ranks fp32 vs gpt2.py, {STEPS} steps", ours, ref, 1e-5)
    assert max(abs(a - b) / b for a, b in zip(ours[:3], ref[:3])) <= 3e-7 and worst <= 1e-5
    assert_close("val loss, ddp.py 2 ranks fp32 vs gpt2.py", val_losses(out), val_losses(baseline), 1e-5,
                 steps=val_steps(out))
    assert len(val_losses(out)) == 3
    recs = [r for r in read_metrics(out) if "loss" in r]
    ring = 2 * (2 - 1) / 2 * gradient_mb()  # the ring all-reduce minimum for 2 ranks
    assert len(recs) == STEPS and all(abs(r["comm_mb"] - ring) <= 0.1 * ring for r in recs), (recs[0]["comm_mb"], ring)
    assert abs(recs[0]["opt_state_mb"] - 2 * gradient_mb()) <= 0.01 * gradient_mb()  # exp_avg + exp_avg_sq, all
    # the pre-clip global norm of the mean gradient, recorded each step: a micro-batch loss not divided by
    # --grad-accum, or a gradient summed over the ranks, scales it (AdamW and clipping hide that in the loss)
    compare(f"grad_norm, ddp.py --grad-accum 2, 2 ranks fp32 vs gpt2.py, {STEPS} steps", grad_norms(out),
            grad_norms(baseline), 1e-4, hint="the norm of the mean gradient: the loss / --grad-accum, / world")
    assert max(abs(a - b) / b for a, b in zip(grad_norms(out), grad_norms(baseline))) <= 1e-4
    # --bucket-mb 0.12 applied: blocks and wpe (0.13 MB) in bucket 0, launched under backward; wte (6.4 MB) last
    fig, sizes = summary(out), bucket_bytes(0.12)
    assert fig["buckets"] == len(sizes) == 2, (fig, sizes)
    assert abs(fig["bytes_launched_in_backward"] - sizes[0] / sum(sizes)) < 1e-9, (fig, sizes)
    assert {"exposed_comm_ms", "exposed_comm_ms_naive", "exposed_comm_ms_buckets_no_overlap",
            "exposed_comm_ms_buckets_overlapped"} <= set(fig), fig  # --overlap-steps 2: the comparison ran
    closing = proc.stdout.strip().splitlines()[-2:]  # the core's lines, last (the handout ends alike)
    assert closing[0].startswith(f"gradient bytes launched during backward: "
                                 f"{fig['bytes_launched_in_backward']:.2f} (2 buckets) | exposed after "), closing
    assert closing[1].startswith("exposed comm after backward, ms per step: naive "), closing
    g = gradient_mb()  # params 4P, grads 4P, AdamW 8P: measured from the tensors DataParallel allocated
    assert f"memory per rank (plain, MB): params {g:.3f} (closed {g:.3f}) | grads {g:.3f} (closed {g:.3f}) | " \
           f"optim {2 * g:.3f} (closed {2 * g:.3f})" in proc.stdout, proc.stdout
    assert os.path.getsize(os.path.join(out, "timeline.png")) > 10_000
    # rank 0 saved the weights where `gpt2.py sample --init-from OUT/model.pt` reads them
    ours = gpt2.load_for_inference(os.path.join(out, "model.pt"), torch.device("cpu")).state_dict()
    ref = gpt2.load_for_inference(os.path.join(baseline, "model.pt"), torch.device("cpu")).state_dict()
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


def test_course_lesson_launches_most_bytes_under_backward(shakespeare_char, tmp_path):
    """The lesson on the course data: with --bucket-mb 1 the character model's 3.37 MB of gradients fill 4
    buckets, and all but the last (h.0's end, wpe, wte: the last gradients) start under backward, at least
    half the bytes. The handout (the core alone) ends with the same closing lines, timings aside."""
    from exercise import main as exercise
    exercise(["ddp.py", "--core", "--out", str(tmp_path / "handout")])
    flags = ["--data", shakespeare_char, "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--bucket-mb", "1",
             "--eval-every", "0", "--overlap-steps", "1"]
    runs = run_clis((["ddp.py", *flags, "--out", str(tmp_path / "whole")], 2),
                    ([str(tmp_path / "handout" / "ddp.py"), *flags, "--out", str(tmp_path / "core")], 2))
    closing = []
    for proc, name in zip(runs, ("whole", "core")):
        fig = summary(str(tmp_path / name))
        assert fig["buckets"] == 4 and 0.5 <= fig["bytes_launched_in_backward"] < 1, (name, fig)
        lines = proc.stdout.strip().splitlines()[-2:]
        assert lines[0].startswith(f"gradient bytes launched during backward: "
                                   f"{fig['bytes_launched_in_backward']:.2f} (4 buckets) | exposed after "), lines
        closing.append([lines[0].split(" | exposed")[0]] + [re.sub(r"\d+\.\d+", "#", line) for line in lines])
    assert closing[0] == closing[1], f"the handout's closing lines differ from the whole file's: {closing}"


def test_naive_matches_one_process(random_data, baseline, tmp_path):
    out = str(tmp_path / "run")
    proc = run_cli(["ddp.py"] + CFG + ["--data", random_data, "--steps", "12", "--eval-every", "0", "--naive",
                                       "--batch-size", "4", "--overlap-steps", "0", "--out", out], nproc=2)
    assert_close("train loss, ddp.py --naive 2 ranks fp32 vs gpt2.py (8 rows per step)", train_losses(out),
                 train_losses(baseline)[:12], 1e-5, hint="--naive: each all-reduced gradient divided by N")
    assert "| NaiveDataParallel |" in proc.stdout
    fig = summary(out)  # --naive applied: every byte after backward; --overlap-steps 0: no comparison
    assert fig["bytes_launched_in_backward"] == 0 and fig["buckets"] == 0 and fig["exposed_comm_ms"] > 0, fig
    assert "exposed_comm_ms_naive" not in fig and "exposed comm after backward" not in proc.stdout, fig


def test_zero2_with_grad_accum_matches_one_process(random_data, baseline, tmp_path):
    out = str(tmp_path / "zero2")
    proc = run_cli(["ddp.py"] + CFG + ["--data", random_data, "--steps", "12", "--batch-size", "2", "--grad-accum", "2",
                                       "--zero", "2", "--bucket-mb", "0.12", "--overlap-steps", "0", "--eval-every", "0",
                                       "--out", out], nproc=2)
    assert_close("train loss, ddp.py --zero 2 --grad-accum 2, 2 ranks fp32 vs gpt2.py", train_losses(out),
                 train_losses(baseline)[:12], 1e-5)
    recs = [r for r in read_metrics(out) if "loss" in r]
    g = gradient_mb()
    closed = (2 + 1) * (2 - 1) / 2 * g  # a reduce-scatter per micro-step (no no_sync in ZeRO-2) + one all-gather
    assert len(recs) == 12 and all(abs(r["comm_mb"] - closed) <= 0.02 * closed for r in recs), recs[0]["comm_mb"]
    # gradients: 4P/N kept + the bucket being reduced (the largest: wte, 50304 x 32 fp32, alone: its gradient is
    # the buffer, no copy) + the one before it still in flight (small here); plain and ZeRO-1 keep 4P
    wte = 4 * 50304 * 32 / 1e6
    line = next(l for l in proc.stdout.splitlines() if l.startswith("memory per rank (ZeRO-2, MB)"))
    grads = float(line.split("| grads ")[1].split()[0])
    assert g / 2 + wte <= grads <= g / 2 + wte + 0.05 * g, (grads, g)
    assert abs(recs[0]["opt_state_mb"] - g) <= 0.05 * g
    assert "ZeRO-2: waited " in proc.stdout and "(host clock)" in proc.stdout
    assert summary(out)["buckets"] == 2  # --bucket-mb 0.12 applied (25: one bucket, as the ZeRO-1 run shows)


def test_zero1_bf16_with_grad_accum_near_gpt2_bf16(random_data, tmp_path):
    # bf16 autocast, fp32 master weights and gradients: 2 ranks x 2 rows x 2 micro-steps, so the matmuls
    # see 2 rows instead of 8 and the bf16 rounding may differ a little from one process (measured 7.0e-7
    # relative over 3 steps; 5e-5 allowed). --zero 1: ZeRO1DataParallel, the fused reduce-scatter path.
    base = str(tmp_path / "base16")
    gpt2.train(CFG + ["--data", random_data, "--batch-size", "8", "--steps", "3", "--eval-every", "0",
                      "--dtype", "bfloat16", "--out", base])
    out = str(tmp_path / "zero1")
    proc = run_cli(["ddp.py"] + CFG + ["--data", random_data, "--steps", "3", "--batch-size", "2", "--grad-accum", "2",
                                       "--eval-every", "0", "--dtype", "bfloat16", "--zero", "1",
                                       "--overlap-steps", "0",
                                       "--out", out], nproc=2)
    assert_close("train loss, ddp.py --zero 1 --grad-accum 2, 2 ranks bf16 vs gpt2.py bf16", train_losses(out),
                 train_losses(base), 5e-5)
    recs = [r for r in read_metrics(out) if "loss" in r]
    ring = 2 * (2 - 1) / 2 * gradient_mb()
    # reduce-scatter + all-gather = one all-reduce, and no_sync keeps it to one per step, not per micro-step
    assert len(recs) == 3 and all(abs(r["comm_mb"] - ring) <= 0.1 * ring for r in recs), (recs[0]["comm_mb"], ring)
    assert abs(recs[0]["opt_state_mb"] - gradient_mb()) <= 0.05 * gradient_mb()  # half the replicated state
    assert "| ZeRO1DataParallel |" in proc.stdout
    assert summary(out)["buckets"] == 1  # the default 25 MB: one bucket (the ZeRO-2 run's --bucket-mb 0.12: two)


def test_one_process_and_bad_input(random_data, baseline, tmp_path, monkeypatch, capsys):
    # without torchrun ddp.py is the single-process trainer (world 1: no collective at all); the first
    # 3 steps lie in the warmup, so their learning rates do not depend on --steps
    ddp.cli(CFG + ["--data", random_data, "--steps", "3", "--batch-size", "8", "--eval-every", "0", "--zero", "1",
                   "--out", str(tmp_path / "one")])
    assert_close("train loss, ddp.py --zero 1 in one process vs gpt2.py", train_losses(str(tmp_path / "one")),
                 train_losses(baseline)[:3], 1e-5)
    # --compile (block by block, hooks and buckets around it) equals eager at steps 0-2 (measured: bitwise)
    ddp.cli(CFG + ["--data", random_data, "--steps", "3", "--batch-size", "8", "--eval-every", "0", "--compile",
                   "--zero", "2", "--out", str(tmp_path / "compiled")])
    assert_close("train loss, ddp.py --compile --zero 2 in one process vs gpt2.py",
                 train_losses(str(tmp_path / "compiled")), train_losses(baseline)[:3], 1e-6)
    # --find-unused-parameters applied: its class, which also reduces which parameters were used
    ddp.cli(CFG + ["--data", random_data, "--steps", "1", "--batch-size", "8", "--eval-every", "0",
                   "--find-unused-parameters", "--out", str(tmp_path / "unused")])
    assert "| FindUnusedParameters |" in capsys.readouterr().out
    assert_close("train loss, ddp.py --find-unused-parameters in one process vs gpt2.py",
                 train_losses(str(tmp_path / "unused")), train_losses(baseline)[:1], 1e-6)
    # bad sizes and combinations raise before the process group exists, so no rank waits for a peer that has quit
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    base = CFG + ["--data", random_data, "--timeout", "5", "--out", str(tmp_path / "bad")]
    with pytest.raises(ValueError, match="--bucket-mb"):
        ddp.cli(base + ["--bucket-mb", "-1"])
    with pytest.raises(ValueError, match=r"\(--naive\): drop --bucket-mb / --zero"):
        ddp.cli(base + ["--naive", "--zero", "1"])
    with pytest.raises(ValueError, match=r"no buckets to size.* \(--naive\)"):
        ddp.cli(base + ["--naive", "--bucket-mb=1"])  # a flag --naive would ignore
    with pytest.raises(ValueError, match=r"\(--find-unused-parameters\)"):
        ddp.cli(base + ["--zero", "2", "--find-unused-parameters"])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ddp.cli(base + ["--batch-size", "700"])  # 2 x 700 x 16 > the 20k-token shard
    assert not dist.is_initialized()


def test_weights_not_finite_after_the_last_update_save_nothing(random_data, tmp_path, capsys):
    # step 0's loss is computed before the update (finite); AdamW's decoupled decay, times (1 - lr * wd) = -1e41,
    # then overflows fp32 in the 2-D weights
    out = tmp_path / "inf"
    with pytest.raises(SystemExit) as e:
        gpt2.run_main(ddp.main, CFG + ["--data", random_data, "--steps", "1", "--batch-size", "2", "--eval-every", "0",
                                       "--lr", "1e37", "--weight-decay", "1e4", "--warmup", "0", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: the weights are not finite after step 0")
    assert (out / "metrics.jsonl").exists() and not (out / "model.pt").exists()


def test_sharded_optimizer_refuses_optimizers_that_are_not_elementwise():
    def run(cls, sharded, **kw):  # one process: ShardedOptimizer flattens the matrices into 1-D pieces
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = ddp.ShardedOptimizer(model.parameters(), cls, elementwise=True, **kw) if sharded \
            else cls(model.parameters(), **kw)
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    for cls, kw in ((torch.optim.AdamW, dict(lr=1e-2)), (torch.optim.SGD, dict(lr=0.1, momentum=0.9))):
        assert (run(cls, True, **kw) - run(cls, False, **kw)).abs().max() <= 1e-7, cls
    # why they are refused: Adafactor's row/column statistics of a matrix are not those of a flat piece
    drift = (run(torch.optim.Adafactor, True, lr=1e-2) - run(torch.optim.Adafactor, False, lr=1e-2)).abs().max()
    assert drift > 1e-4, drift
    with pytest.raises(gpt2.UsageError, match=r"cannot shard Adafactor: .*\(SGD, Adam, AdamW, .*elementwise=True"):
        ddp.ShardedOptimizer(nn.Linear(4, 4).parameters(), torch.optim.Adafactor, lr=1e-2)
    ddp.ShardedOptimizer(nn.Linear(4, 4).parameters(), torch.optim.SGD, lr=1e-2)  # accepted without the flag


# -- the building blocks on a toy model: vs one process and vs torch's DistributedDataParallel ----------

class Toy(nn.Module):
    """Tied embedding/head, a frozen layer, a layer only rank 1 uses, one nobody uses, a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.sometimes = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, idx, sometimes=None):
        x = torch.tanh(self.body(self.emb(idx))) + self.frozen(self.emb(idx)) * self.scale
        if sometimes is not None:  # 0.0: used with a zero gradient (the usual fix without find-unused)
            x = x + sometimes * self.sometimes(x)
        return self.head(x)


TOY_STEPS, ACCUM = 3, 2


def toy_data(rank):
    """Rank r's micro-batches: different on each rank, (4, 5) tokens each."""
    g = torch.Generator().manual_seed(100 + rank)
    return [[torch.randint(0, 16, (4, 5), generator=g) for _ in range(ACCUM)] for _ in range(TOY_STEPS)]


def toy_loss(net, idx, rank, touch_all=False):
    """Rank 1 uses `sometimes`; rank 0 does not, or (touch_all) multiplies it by 0: the same gradient."""
    sometimes = 1.0 if rank == 1 else 0.0 if touch_all else None
    return nn.functional.cross_entropy(net(idx, sometimes).view(-1, 16), idx.view(-1)) / ACCUM


def make_opt(kind, params):
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW, groups, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    return torch.optim.SGD, groups, dict(lr=0.5, momentum=0.9)


def numpy(state):
    """Tensors leave a spawned process by value (shared-memory tensors die with the process)."""
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def train_reference(optim):
    """One process, the global batch (both ranks' micro-batches, the mean of their losses), rank 0's init."""
    torch.manual_seed(0)
    model = Toy()
    cls, groups, kw = make_opt(optim, [p for p in model.parameters() if p.requires_grad])
    opt = cls(groups, **kw)
    data = [toy_data(0), toy_data(1)]
    for step in range(TOY_STEPS):
        for micro in range(ACCUM):
            sum(toy_loss(model, data[r][step][micro], r) for r in range(2)).div(2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # small enough to clip: the norm must be global
        opt.step()
        opt.zero_grad(set_to_none=True)
    return numpy(model.state_dict())


FIND_UNUSED = ("torch", "unused", "sharded", "torch+sharded")  # the kinds that must find `never` unused


def train_toy(rank, world, kind, bucket_mb=0.0002, optim="adamw"):
    """kind: torch (DistributedDataParallel), unused (our FindUnusedParameters), plain / zero1 / zero2 (our
    DataParallel, ZeRO1DataParallel, ZeRO2DataParallel with its make_optimizer; they refuse a parameter with
    no gradient, as torch's DDP without find_unused_parameters: `never` frozen, and rank 0 multiplies
    `sometimes` by 0, which gives the gradient one process gives), sharded
    (FindUnusedParameters + a ShardedOptimizer with its own layout), torch+sharded (torch's DDP averages, our
    ShardedOptimizer steps)."""
    torch.manual_seed(rank)  # different on each rank: the broadcast from rank 0 must fix it
    model = Toy()
    if kind not in FIND_UNUSED:
        model.never.requires_grad_(False)
    if rank == 1:
        model.scale.fill_(2.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    cls, groups, kw = make_opt(optim, trainable)
    dp = None
    if kind.startswith("torch"):
        net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        wrapper = {"zero1": ddp.ZeRO1DataParallel, "zero2": ddp.ZeRO2DataParallel, "plain": ddp.DataParallel}.get(
            kind, ddp.FindUnusedParameters)
        net = dp = wrapper(model, bucket_mb=bucket_mb)
    if kind.startswith("zero"):
        opt = dp.make_optimizer(groups, lambda g: cls(g, **kw))  # the ShardedOptimizer laid out on the buckets
    elif kind.endswith("sharded"):
        opt = ddp.ShardedOptimizer(groups, cls, bucket_mb=0.0002, **kw)  # a layout unlike the buckets
    else:
        opt = cls(groups, **kw)
    data = toy_data(rank)
    for step in range(TOY_STEPS):
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            # ZeRO-2's no_sync cannot skip the sync: it reduce-scatters each micro-step, finishing on exit
            with net.no_sync() if not last else contextlib.nullcontext():
                toy_loss(net, data[step][micro], rank, touch_all=kind in ("plain", "zero1", "zero2")).backward()
            if dp is not None and last:
                dp.finish_grad_sync()
        if isinstance(opt, ddp.ShardedOptimizer):
            opt.clip_grad_norm_(0.05)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state_numel = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    buckets = len(dp.buckets) if dp is not None else None
    return numpy(model.state_dict()), state_numel, buckets


def check_module_api(rank, world):
    """DataParallel is the module: same parameters, same output."""
    torch.manual_seed(0)
    model = Toy()
    dp = ddp.DataParallel(model)
    idx = torch.arange(10).view(2, 5)
    same_out = bool(torch.equal(dp(idx, 1.0), model(idx, 1.0)))
    same_params = [id(p) for p in dp.parameters()] == [id(p) for p in model.parameters()]
    dp.close()
    return same_out and same_params


TOY = [("torch", 0, "adamw"), ("plain", 0.0, "adamw"), ("plain", 0.0002, "adamw"), ("plain", 25.0, "adamw"),
       ("unused", 0.0, "adamw"), ("unused", 0.0002, "adamw"), ("unused", None, "adamw"), ("zero1", 0.0002, "adamw"),
       ("zero2", 0.0, "adamw"), ("zero2", 0.0002, "adamw"), ("zero2", None, "adamw"), ("sharded", 25.0, "adamw"),
       ("sharded", 25.0, "sgd"), ("zero1", 0.0002, "sgd"), ("torch+sharded", 0, "sgd")]


def train_gpt(rank, world, kind, steps=2):
    torch.manual_seed(rank)
    model = gpt2.GPT(gpt2.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))
    args = SimpleNamespace(lr=1e-3, beta2=0.95, weight_decay=0.1)
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, 0.1), args, torch.device("cpu"))
    net = nn.parallel.DistributedDataParallel(model) if kind == "torch" else ddp.DataParallel(model, bucket_mb=0.02)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(0, 50257, (2, 16), generator=g)
        net(idx, idx)[1].backward()
        if kind != "torch":
            net.finish_grad_sync()
            assert len(net.buckets) >= 4
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return numpy(model.state_dict())


def unused_refused(rank, world):
    """DataParallel on Toy with `never` trainable (forward never calls it): finish_grad_sync refuses it on
    every rank, before any collective of the step, naming it and the fix. Returns the message."""
    torch.manual_seed(0)
    dp = ddp.DataParallel(Toy(), bucket_mb=0.0002)
    toy_loss(dp, toy_data(rank)[0][0], rank, touch_all=True).backward()
    try:
        dp.finish_grad_sync()
        message = None
    except gpt2.UsageError as e:
        message = str(e)
    dp.close()
    return message


def building_blocks(rank, world):
    return {"reference": {o: train_reference(o) for o in ("adamw", "sgd")},
            "unused_refused": unused_refused(rank, world),
            "toy": {v: train_toy(rank, world, *v) for v in TOY},
            "api": check_module_api(rank, world),
            "gpt": {kind: train_gpt(rank, world, kind) for kind in ("torch", "ours")}}


def test_building_blocks_match_one_process_and_torch_ddp():
    results = run_distributed(building_blocks, 2)
    diff = lambda a, b: max(float(abs(a[k] - b[k]).max()) for k in a)
    torch.manual_seed(0)
    init = numpy(Toy().state_dict())  # rank 0's initial values (the broadcast makes them everyone's)
    n_trainable = sum(p.numel() for p in Toy().parameters() if p.requires_grad)  # the tied one once
    for r in range(2):
        res = results[r]
        assert res["api"]
        # torch's DDP raises too (without find_unused_parameters): a zero gradient would let weight decay move it
        assert res["unused_refused"] == "never.weight, never.bias produced no gradient in this step " \
                                       "(DataParallel): use FindUnusedParameters (ddp.py --find-unused-parameters), " \
                                       "or freeze them", res["unused_refused"]
        ref = res["reference"]
        torch_state = res["toy"][("torch", 0, "adamw")][0]
        assert diff(torch_state, ref["adamw"]) <= 1e-6  # torch's DDP = one process, to start with
        for v in TOY[1:]:
            ours, state_numel, buckets = res["toy"][v]
            d = diff(ours, ref[v[2]])
            assert d <= 1e-6, f"toy weights after {TOY_STEPS} steps, {v} rank {r} vs one process: {d:.1e} > 1e-6"
            if v[2] == "adamw":
                assert diff(ours, torch_state) <= 1e-6, (v, r)
            assert diff(ours, results[0]["toy"][v][0]) == 0, v  # the replicas are identical
            assert (ours["frozen.weight"] == init["frozen.weight"]).all()  # rank 0's, never trained
            assert (ours["scale"] == init["scale"]).all()  # rank 0's buffer
            # nobody used it: grad None, so not even weight decay touched it (a zero grad would have)
            assert (ours["never.weight"] == init["never.weight"]).all()
            assert (ours["sometimes.weight"] != init["sometimes.weight"]).all()  # rank 1 used it
            assert (ours["emb.weight"] != init["emb.weight"]).any()
            if v[0] != "torch+sharded":  # our DataParallel's buckets
                per_param = 7 if v[0] in FIND_UNUSED else 5  # 0: one per parameter (tied: once; `never` frozen)
                assert buckets == {0.0: per_param, None: 1}.get(v[1], buckets), (v, buckets)
                assert buckets > (2 if v[1] == 0.0002 else 0), (v, buckets)
            if v[0] in ("zero1", "zero2", "sharded", "torch+sharded"):  # each element's state on one rank only
                used = n_trainable - 8 * 8 - 8  # `never` has no gradient, so no state
                per_elem = 2 if v[2] == "adamw" else 1  # AdamW: exp_avg, exp_avg_sq; SGD: momentum
                both = state_numel + results[1 - r]["toy"][v][1]
                assert both == per_elem * used and 0 < state_numel < both, (v, r, state_numel, used)
        assert diff(res["gpt"]["ours"], res["gpt"]["torch"]) <= 1e-6
        assert diff(res["gpt"]["ours"], results[0]["gpt"]["ours"]) == 0
