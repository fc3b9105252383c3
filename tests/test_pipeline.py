"""pipeline.py: the schedules' definitions, each schedule's loss and gradients vs the unsplit model and vs
torch.distributed.pipelining on the same stages, and 8-step loss curves vs `gpt2.py train` at 2 and 4 ranks."""
import copy
import json
import os

import pytest
import torch
import torch.nn as nn

import gpt2
import pipeline as pl
from harness import max_rel_diff, read_metrics, run_cli, run_distributed

SMALL = ["--n-embd", "32", "--seq-len", "16", "--device", "cpu", "--dtype", "float32", "--steps", "8",
         "--eval-every", "4", "--eval-steps", "1", "--warmup", "2"]


def losses(out):
    """Train and val losses of a run, in the order they were logged."""
    return [r.get("loss", r.get("val_loss")) for r in read_metrics(out)]


# -- the schedules as definitions (no processes) ---------------------------------------------------------

def torch_dualpipev_order(P, M, rank):
    """torch.distributed.pipelining's ScheduleDualPipeV op list (an independent port of deepseek-ai/DualPipe),
    computed without building stages, in our Op notation."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType as C
    sched = object.__new__(ScheduleDualPipeV)
    sched.pp_group_size, sched._n_microbatches = P, M
    kinds = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "I", C.BACKWARD_WEIGHT: "W"}
    ops = []
    for a in sched._calculate_single_rank_operations(rank):
        for b in (a.sub_actions if a.computation_type == C.OVERLAP_F_B else [a]):
            ops.append(pl.Op(kinds[b.computation_type], b.stage_index, b.microbatch_index))
    return ops


def check_well_formed(name, P, M):
    """Every (stage, micro-batch) of every rank: one F, then one backward (B, or I then its W)."""
    for r in range(P):
        ops = pl.SCHEDULES[name](P, M, r)
        seen = {}
        for i, op in enumerate(ops):
            seen.setdefault((op.stage, op.mb), []).append(op.kind)
            assert pl.stage_owner(name, P, M, op.stage, op.mb) == r
        assert all(k in (["F", "B"], ["F", "I", "W"]) for k in seen.values()), (name, P, M, r, ops)
        assert len(seen) == M * len(pl.stages_of(name, P, r)) // (2 if name == "dualpipe" else 1)


def test_schedule_definitions():
    # GPipe: all forwards then all backwards; 1F1B: P-1-r warmup forwards, then alternate, then drain
    assert [op.kind for op in pl.gpipe(4, 3, 1)] == list("FFFBBB")
    assert [(op.kind, op.mb) for op in pl.one_f_one_b(2, 4, 0)] == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    for P, M in ((2, 4), (4, 8), (4, 5)):
        for r in range(P):
            kinds = "".join(op.kind for op in pl.one_f_one_b(P, M, r))
            assert kinds.index("B") == P - r  # P-1-r warmup forwards, then the first steady F
            held = max(kinds[:i].count("F") - kinds[:i].count("B") for i in range(len(kinds) + 1))
            assert held == P - r  # the point of 1F1B: at most P - rank micro-batches in flight
    # DualPipeV: the same op lists as PyTorch's ScheduleDualPipeV (from deepseek-ai/DualPipe)
    for P, M in ((2, 4), (2, 6), (4, 8), (4, 10), (8, 16), (8, 20)):
        for r in range(P):
            assert pl.dualpipev(P, M, r) == torch_dualpipev_order(P, M, r), (P, M, r)
    # DualPipe: rank P-1-r runs rank r's list with the two directions swapped (the schedule is symmetric)
    for P, M in ((2, 4), (4, 8), (4, 12), (8, 20)):
        for r in range(P):
            mirror = [pl.Op(o.kind, o.stage, (o.mb + M // 2) % M) for o in pl.dualpipe(P, M, P - 1 - r)]
            assert pl.dualpipe(P, M, r) == mirror
    for name in pl.SCHEDULES:
        for P, M in ((2, 4), (4, 8), (4, 12)):
            check_well_formed(name, P, M)


def test_bubbles_by_simulation():
    # with F=1, B=2 and free communication the op lists reproduce the closed forms exactly
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    for name in ("gpipe", "1f1b"):
        for P, M in ((2, 4), (4, 8), (4, 16)):
            frac = pl.bubble_fraction(pl.simulate(name, P, M, cost))
            assert abs(frac - (P - 1) / (M + P - 1)) < 1e-9
    # DualPipe: no bubble at P=2, and far less than 1F1B's at P=4, 8; every schedule is deadlock-free
    assert pl.bubble_fraction(pl.simulate("dualpipe", 2, 4, cost)) == 0.0
    for P in (4, 8):
        one = pl.bubble_fraction(pl.simulate("1f1b", P, 2 * P, cost))
        for name in ("dualpipe", "dualpipev"):
            assert pl.bubble_fraction(pl.simulate(name, P, 2 * P, cost)) < one / 2
    bad = [pl.Op("B", 0, 0), pl.Op("F", 0, 0)]  # a backward before its forward cannot run
    with pytest.raises(RuntimeError, match="deadlock"):
        pl.simulate("1f1b", 2, 1, cost, orders=[bad, pl.one_f_one_b(2, 1, 1)])


def test_bad_input_is_a_clear_error():
    def args(*a):
        return pl.make_parser().parse_args(list(a))
    cases = [(args("--schedule", "1f1b", "--n-layer", "3"), 2, "do not split into 2 stages"),
             (args("--schedule", "dualpipev", "--micro-batches", "8"), 4, "do not split into 8 stages"),
             (args("--schedule", "dualpipe", "--n-layer", "3"), 3, "P=3 is odd"),
             (args("--schedule", "1f1b", "--micro-batches", "2"), 4, "cannot fill 4 stages"),
             (args("--schedule", "dualpipe", "--micro-batches", "4"), 4, "even number of micro-batches >= 2P = 8"),
             (args("--batch-size", "6", "--micro-batches", "4"), 2, "--batch-size 6 is not divisible"),
             (args("--dp", "3"), 4, "--dp 3 does not divide"),
             (args("--schedule", "dualpipe", "--compile"), 2, "--compile")]
    for a, world, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("+", r"\+")):
            pl.check_args(a, world)
    assert pl.check_args(args("--schedule", "dualpipev", "--n-layer", "8", "--micro-batches", "8"), 4) == 4


# -- 2 ranks in one launch: gradients vs the unsplit model and vs torch.distributed.pipelining ------------

class TorchStage(nn.Module):
    """One stage for torch.distributed.pipelining, built from the same pieces of gpt2.GPT."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.model, self.lo, self.hi, self.first, self.last = model, lo, hi, first, last

    def forward(self, x):
        if self.first:
            x = self.model.embed(x)
        x = self.model.forward_blocks(x, self.lo, self.hi)
        return self.model.logits(x) if self.last else x


def grads_by_name(model):
    out = {}
    for n, p in model.named_parameters():
        out["wte.weight" if n == "lm_head.weight" else n] = p.grad
    return out


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def torch_pipelining_grads(name, pipe, args, x, y):
    """The same stages under torch's ScheduleGPipe / Schedule1F1B / ScheduleDualPipeV; the tied wte/lm_head
    copies summed as pipeline.py sums them. Returns (loss or None, {param name: grad})."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe
    M, S, full = pipe.M, pipe.S, gpt2.build_model(args)
    mods = {s: TorchStage(pl.keep_only(copy.deepcopy(full), set(range(*pipe.layers[s])), s == 0, s == S - 1),
                          *pipe.layers[s], s == 0, s == S - 1) for s in pipe.my_stages}
    stages = [PipelineStage(mods[s], s, S, torch.device("cpu")) for s in sorted(pipe.my_stages)]
    loss_fn = lambda out, tgt: gpt2.cross_entropy(out, tgt) / M  # noqa: E731  (scale_grads=False below)
    if name == "dualpipev":
        sched = ScheduleDualPipeV(stages, M, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stages[0], M, loss_fn=loss_fn, scale_grads=False)
    losses = []
    kw = {"target": y, "losses": losses} if pipe.last else {}
    sched.step(*((x,) if pipe.first else ()), **kw)
    grads = {}
    for s in sorted(pipe.my_stages):
        for n, g in grads_by_name(mods[s].model).items():
            grads[n] = g if n not in grads else grads[n] + g  # dualpipev: wte used by stage 0 and 2P-1
    if name != "dualpipev" and pipe.P > 1:
        dist.all_reduce(grads["wte.weight"])  # P=2: the first and last stage are the whole world
    return (sum(losses).item() if losses else None), grads


def _two_rank_worker(rank, world, data, out):
    import torch.distributed as dist
    result = {}
    torch.manual_seed(0)
    x = torch.randint(0, 50257, (8, 16))
    y = torch.randint(0, 50257, (8, 16))
    for name in pl.SCHEDULE_NAMES:
        argv = ["--schedule", name, "--micro-batches", "4", "--batch-size", "8", "--data", data,
                "--out", os.path.join(out, name)] + SMALL
        args = pl.make_parser().parse_args(argv)
        ctx = gpt2.setup(args)
        pipe = pl.Pipeline(args, ctx, pl.check_args(args, world), gpt2.CommMeter())
        loss = pipe.global_loss(pipe.run(pipe.orders, x, y, 1.0 / pipe.M))
        pipe.sync_grads()
        ran = [op for op, _, _ in pipe.timeline.spans()]
        ref = gpt2.build_model(args)  # the unsplit model on the whole batch
        ref_loss = ref(x, y)[1]
        ref_loss.backward()
        ref_grads = grads_by_name(ref)
        ours = grads_by_name(pipe.model)
        r = {"loss": abs(loss - ref_loss.item()) / ref_loss.item(),
             "grad": max(rel(g, ref_grads[n]) for n, g in ours.items()),
             "n_params": len(ours), "order": ran == pipe.orders[pipe.pp_rank]}
        if name != "dualpipe":  # torch has no bidirectional DualPipe
            t_loss, t_grads = torch_pipelining_grads(name, pipe, args, x, y)
            r["torch_grad"] = max(rel(t_grads[n], g) for n, g in ours.items())
            r["torch_loss"] = None if t_loss is None else abs(t_loss - loss) / loss
        result[name] = r
        dist.barrier()
        pl.train(argv)  # the 8-step run, compared with gpt2.py train by the test
    return result


@pytest.fixture(scope="module")
def baselines(random_data, tmp_path_factory):
    """`gpt2.py train` (one process) for the configurations the pipeline runs are compared with."""
    out = {}
    for key, extra in {"L4B8": ["--batch-size", "8"], "L8B8": ["--batch-size", "8", "--n-layer", "8"]}.items():
        d = str(tmp_path_factory.mktemp("base_" + key))
        gpt2.train(["--data", random_data, "--out", d] + SMALL + extra)
        out[key] = losses(d)
        out[key + "_train"] = [r["loss"] for r in read_metrics(d) if "loss" in r]
    return out


def test_two_ranks_every_schedule(random_data, tmp_path, baselines):
    results = run_distributed(_two_rank_worker, 2, random_data, str(tmp_path), timeout=300)
    for name in pl.SCHEDULE_NAMES:
        for rank, res in enumerate(results):
            r = res[name]
            assert r["order"], (name, rank)
            assert r["loss"] < 1e-5 and r["grad"] < 1e-4, (name, rank, r)
            assert r["n_params"] > 0
            if name != "dualpipe":
                assert r["torch_grad"] < 1e-4, (name, rank, r)
                assert r["torch_loss"] is None or r["torch_loss"] < 1e-5, (name, rank, r)
        d = os.path.join(str(tmp_path), name)
        assert max_rel_diff(losses(d), baselines["L4B8"]) <= 1e-4, name
        sched = json.load(open(os.path.join(d, "schedule.json")))
        assert [[tuple(s[0]) for s in spans] for spans in sched["spans"]] == \
               [[tuple(op) for op in pl.SCHEDULES[name](2, 4, r)] for r in range(2)]
        assert 0.0 < sched["bubble"] < 1.0 and os.path.getsize(os.path.join(d, "schedule.png")) > 10_000
    # bytes rank 0 sends in a 1f1b step: M activations of (B/M, T, E) fp32, the tied wte's all-reduce
    # (2(n-1)/n of it, n=2), and the 4-byte loss and grad-norm all-reduces
    step0 = read_metrics(os.path.join(str(tmp_path), "1f1b"))[0]
    assert abs(step0["comm_mb"] * 1e6 - (4 * 2 * 16 * 32 * 4 + 50304 * 32 * 4 + 4 + 4)) < 1e-3
    # activations held: GPipe all M, 1F1B P - rank, DualPipe P + 1 (DeepSeek-V3 table 2)
    held = {n: json.load(open(os.path.join(str(tmp_path), n, "schedule.json")))["peak_held"] for n in pl.SCHEDULE_NAMES}
    assert held["gpipe"] == [4, 4] and held["1f1b"] == [2, 1] and held["dualpipe"] == [3, 3]


# -- 4 ranks: DualPipe at P=4, DualPipeV over 8 stages, 1F1B x data parallel (P=2, D=2) ------------------

def _four_rank_worker(rank, world, data, out):
    runs = {"dualpipe": ["--schedule", "dualpipe", "--micro-batches", "8", "--batch-size", "8"],
            "dualpipev": ["--schedule", "dualpipev", "--micro-batches", "8", "--batch-size", "8", "--n-layer", "8"],
            "1f1b_dp2": ["--schedule", "1f1b", "--micro-batches", "2", "--batch-size", "4", "--dp", "2"]}
    for key, argv in runs.items():
        pl.train(argv + ["--data", data, "--out", os.path.join(out, key)] + SMALL + ["--eval-every", "0"])
    return True


def test_four_ranks(random_data, tmp_path, baselines):
    run_distributed(_four_rank_worker, 4, random_data, str(tmp_path), timeout=300)
    # 1f1b_dp2: two replicas of 4 rows each are the baseline's batch of 8
    for key, base in {"dualpipe": "L4B8", "dualpipev": "L8B8", "1f1b_dp2": "L4B8"}.items():
        train = [r["loss"] for r in read_metrics(os.path.join(str(tmp_path), key))]
        assert len(train) == 8 and max_rel_diff(train, baselines[base + "_train"]) <= 1e-4, key
    held = json.load(open(os.path.join(str(tmp_path), "dualpipe", "schedule.json")))["peak_held"]
    assert held == [5, 5, 5, 5]  # DualPipe holds P + 1 micro-batches' activations per rank


def test_bad_input_exits_before_any_collective(random_data, tmp_path):
    bad = run_cli(["pipeline.py", "--schedule", "dualpipe", "--data", random_data, "--out", str(tmp_path)], check=False)
    assert bad.returncode != 0 and "P=1 is odd" in bad.stderr
