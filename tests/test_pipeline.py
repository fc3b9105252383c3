"""pipeline.py: the core's loops (their traffic against a model of NCCL's rules, the micro-batches they hold,
no processes), the schedules' definitions and planned messages; the core's refusals, in the file and in the
--core handout; then, per schedule and for --naive, the loss and every gradient (before and after clipping) vs
the unsplit model and torch.distributed.pipelining, BEFORE the curves: 8 steps vs `gpt2.py train` (also at
--grad-accum 2), 60 steps of 1F1B, and 4 ranks (--dp 2: each replica's gradients vs the unsplit model on both
halves); each run's op order, micro-batches held and summary record show that its flags acted."""
import collections
import copy
import functools
import json
import os

import pytest
import torch
import torch.nn as nn

import gpt2
import pipeline as pl
from harness import assert_close, compare, read_metrics, run_cli, run_distributed

SMALL = ["--n-embd", "32", "--seq-len", "16", "--device", "cpu", "--dtype", "float32", "--steps", "8",
         "--eval-every", "4", "--eval-steps", "1", "--warmup", "2"]


def losses(out):
    """Train and val losses of a run, in the order they were logged."""
    return [r.get("loss", r.get("val_loss")) for r in read_metrics(out) if "step" in r]


def summary(out):
    """The run's closing figures: its one {"summary": ...} record."""
    found = [r["summary"] for r in read_metrics(out) if "summary" in r]
    assert len(found) == 1, f"{out}: {len(found)} summary records, expected one (metrics.log_summary at the end)"
    return found[0]


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


def torch_zbh1_order(P, M, rank):
    """torch.distributed.pipelining's ScheduleInterleavedZeroBubble (Qi et al., ZB-1P) with one chunk per rank,
    i.e. ZB-H1's memory: 1F1B's warm-up, each rank's W `rank` backwards behind its I. Computed without stages."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, _ComputationType as C
    sched = object.__new__(ScheduleInterleavedZeroBubble)
    sched.pp_group_size, sched._n_microbatches, sched.n_local_stages = P, M, 1
    sched.number_of_rounds = max(1, M // P)
    sched.microbatches_per_round = M // sched.number_of_rounds
    kinds = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "I", C.BACKWARD_WEIGHT: "W"}
    return [pl.Op(kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for a in sched._calculate_single_rank_operations(rank) if a is not None]


def check_well_formed(name, P, M):
    """Every (stage, micro-batch) of every rank: one F, then one backward (B, or I then its W)."""
    for r, ops in enumerate(pl.op_lists(name, P, M)):
        seen = {}
        for i, op in enumerate(ops):
            seen.setdefault((op.stage, op.mb), []).append(op.kind)
            assert pl.stage_owner(name, P, M, op.stage, op.mb) == r
        assert all(k in (["F", "B"], ["F", "I", "W"]) for k in seen.values()), (name, P, M, r, ops)
        assert len(seen) == M * len(pl.stages_of(name, P, r)) // (2 if name == "dualpipe" else 1), (name, P, M)


def test_schedule_definitions():
    # GPipe: all forwards then all backwards; 1F1B: P-1-r warmup forwards, then alternate, then drain
    assert [op.kind for op in pl.gpipe(4, 3, 1)] == list("FFFBBB")
    assert [(op.kind, op.mb) for op in pl.one_f_one_b_ops(2, 4, 0)] == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    for P, M in ((2, 4), (4, 8), (4, 5)):
        for r in range(P):
            kinds = "".join(op.kind for op in pl.one_f_one_b_ops(P, M, r))
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
    # ZB-H1: the same op lists as PyTorch's ScheduleInterleavedZeroBubble with one chunk per rank; 1F1B's
    # order of forwards and input gradients; P - rank micro-batches await their I (1F1B's), but rank r keeps
    # the W state of r + 1, so every rank holds P micro-batches from F to W (not P - rank)
    for P, M in ((2, 4), (2, 7), (4, 4), (4, 5), (4, 8), (4, 12), (8, 16), (8, 19)):
        for r in range(P):
            ops = pl.zbh1(P, M, r)
            assert ops == torch_zbh1_order(P, M, r), (P, M, r)
            assert [o for o in ops if o.kind != "W"] == [pl.Op("I" if o.kind == "B" else "F", o.stage, o.mb)
                                                         for o in pl.one_f_one_b_ops(P, M, r)]
            kinds = "".join(o.kind for o in ops)
            held = lambda a, b: max(kinds[:i].count(a) - kinds[:i].count(b) for i in range(len(kinds) + 1))  # noqa: E731
            assert (held("F", "I"), held("I", "W"), held("F", "W")) == (P - r, r + 1, P), (P, M, r)
    # interleaved: Megatron's order, chunk c of rank r is stage c*P + r, groups of P micro-batches
    assert [tuple(o) for o in pl.interleaved(2, 4, 0, 2)[:8]] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2), ("B", 2, 0), ("F", 0, 3), ("B", 2, 1)]
    for name in pl.SCHEDULE_NAMES:
        for P, M in ((2, 4), (4, 8), (4, 12)):
            check_well_formed(name, P, M)


def test_core_first_layout():
    """The layout every technique file keeps: a docstring of at most 40 lines, then the core, the naive loop
    first, then the two banners in order; no code above the first names an extension (a schedule, the
    planner, several stages per rank, --dp). Line counts are not checked: a correct copy never fails here."""
    lines = open(pl.__file__).read().splitlines()
    beyond, appendix = lines.index("# ---- Beyond the core ----"), lines.index("# ---- Appendix ----")
    doc_end = next(i for i in range(1, len(lines)) if '"""' in lines[i])
    assert doc_end + 1 <= 40 and beyond < appendix, (doc_end + 1, beyond + 1, appendix + 1)
    core = "\n".join(lines[doc_end + 1:beyond]).lower()
    for word in ("virtual", "zbh1", "interleav", "dualpipe", "splitbackward", "deferred", "simulate_paired", "f&b", "tape",
                 "num_stages", "stages_of", "self.owner", "self.copies", "--schedule", "plan_messages",
                 "op_list", "replica", "--dp", "self.d "):  # the core knows one stage per rank, one pipeline
        assert word not in core, word
    defs = [l.split("(")[0].split()[-1] for l in lines[doc_end + 1:beyond] if l.startswith("def ")]
    assert defs.index("naive_step") < defs.index("one_f_one_b"), defs  # the naive loop first


def idle_per_rank(spans):
    end = max(b for r in spans for _, _, b in r)
    return [end - sum(b - a for _, a, b in r) for r in spans]


def test_bubbles_by_simulation():
    # with F=1, B=2 (I=W=1) and free communication the op lists reproduce the closed forms exactly
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    for P, M in ((2, 4), (4, 8), (4, 16), (8, 16)):
        for name in ("gpipe", "1f1b"):
            assert abs(pl.bubble_fraction(pl.simulate(pl.op_lists(name, P, M), cost)) - (P - 1) / (M + P - 1)) < 1e-9
        # ZB-H1: (P-1)(F+B-2W) idle per rank, against 1F1B's (P-1)(F+B)
        assert idle_per_rank(pl.simulate(pl.op_lists("zbh1", P, M), cost)) == [(P - 1) * (1 + 2 - 2)] * P
        for V in (2, 3):  # interleaved, chunks 1/V of a stage: bubble (P-1)/(V*M) of the ideal time
            frac = pl.bubble_fraction(pl.simulate(pl.op_lists("interleaved", P, M, V), {"F": 1 / V, "B": 2 / V}))
            assert abs(frac - (P - 1) / (V * M + P - 1)) < 1e-9, (P, M, V)
        # DualPipe(V): DeepSeek-V3 table 2's (PP/2-1)(F&B+B-3W) idle per rank is what the paper's execution
        # (F&B pairs as one unit) gives; this file's executor, F then B, idles half of that here
        for name, n in (("dualpipe", P / 2 - 1), ("dualpipev", P - 1)):
            if M < 2 * P:
                continue
            assert idle_per_rank(pl.simulate_paired(pl.op_lists(name, P, M), cost)) == [n * (3 + 2 - 3)] * P
            assert idle_per_rank(pl.simulate(pl.op_lists(name, P, M), cost)) == [n * (3 + 2 - 3) / 2] * P
    assert pl.bubble_fraction(pl.simulate(pl.op_lists("dualpipe", 2, 4), cost)) == 0.0
    for P in (4, 8):
        one = pl.bubble_fraction(pl.simulate(pl.op_lists("1f1b", P, 2 * P), cost))
        for name in ("dualpipe", "dualpipev"):
            assert pl.bubble_fraction(pl.simulate(pl.op_lists(name, P, 2 * P), cost)) < one / 2
    source = open(pl.__file__).read()
    for name in ("1f1b", "dualpipev"):  # the pictures beside DualPipe are simulate()'s
        for r, row in enumerate(pl.ascii_timeline(name, 4, 8)):
            assert f"rank{r} {row}" in source, (name, r, row)
    for row in pl.loop_picture(2, 4):  # the docstring's 1F1B picture is what the core's loop does
        assert row in pl.__doc__, row
    bad = [pl.Op("B", 0, 0), pl.Op("F", 0, 0)]  # a backward before its forward cannot run
    with pytest.raises(AssertionError, match="deadlock"):
        pl.simulate([bad, pl.one_f_one_b_ops(2, 1, 1)], cost)


# -- NCCL's point-to-point contract, modelled (no processes) ----------------------------------------------

def nccl_p2p_check(batches):
    """A model of NCCL's point-to-point contract. batches[r]: rank r's batch_isend_irecv calls in order, each a
    list of ("send" | "recv", peer, tag, nbytes). Rules: a rank runs one batch at a time, in order; the n-th
    send a->b matches the n-th recv b<-a (tags are not used for matching, only checked); an op completes only
    once the peer has reached the batch holding its match; a batch completes when all its ops have.
    Returns None, or one line naming the unmatched op, the mismatch or the deadlock."""
    R, where = len(batches), collections.defaultdict(list)  # (src, dst, "send"/"recv") -> [(batch, tag, bytes)]
    for r, rank_batches in enumerate(batches):
        for j, batch in enumerate(rank_batches):
            for kind, peer, tag, nbytes in batch:
                pair = (r, peer) if kind == "send" else (peer, r)
                where[pair + (kind,)].append((j, tag, nbytes))
    for (src, dst, kind) in list(where):
        if kind != "send":
            continue
        sends, recvs = where[(src, dst, "send")], where.get((src, dst, "recv"), [])
        if len(sends) != len(recvs):
            return f"unmatched: {len(sends)} sends {src}->{dst}, {len(recvs)} recvs"
        for (js, ts, bs), (jr, tr, br) in zip(sends, recvs):
            if (ts, bs) != (tr, br):
                return f"mismatch {src}->{dst}: send {ts} ({bs} B) meets recv {tr} ({br} B)"
    if any(len(where.get((s, d, "send"), [])) != len(v) for (s, d, k), v in where.items() if k == "recv"):
        return "unmatched: a recv with no send"
    peer_batch = {}
    for (src, dst, kind), ops in where.items():
        for n, (j, _, _) in enumerate(ops):
            me, peer = (src, dst) if kind == "send" else (dst, src)
            other = where[(src, dst, "recv" if kind == "send" else "send")][n][0]
            peer_batch.setdefault((me, j), []).append((peer, other))
    pos = [0] * R
    progressed = True
    while progressed:
        progressed = False
        for r in range(R):
            while pos[r] < len(batches[r]) and all(pos[p] >= j for p, j in peer_batch.get((r, pos[r]), [])):
                pos[r] += 1
                progressed = True
    if all(pos[r] == len(batches[r]) for r in range(R)):
        return None
    stuck = {r: batches[r][pos[r]] for r in range(R) if pos[r] < len(batches[r])}
    return f"deadlock: rank -> blocked batch {stuck}"


def core_batches(events):
    """core_traffic's events -> the checker's batches: every exchange's messages, tagged by what they carry."""
    return [[[(kind, peer, key, 1) for kind, peer, key in ev[1]] for ev in evs if ev[0] == "batch"] for evs in events]


def test_core_loops_pair_their_messages():
    """The core's loops, run on recorded stages (no processes): every exchange against the model of NCCL's
    rules (no unmatched message, no deadlock), every op fed the message it needs, the op order, and the
    micro-batches held: 1F1B P - stage, naive all M."""
    checked = 0
    for P in (2, 3, 4, 8):
        for M in range(1, 3 * P + 1):
            for name, loop in (("one_f_one_b", pl.one_f_one_b), ("naive_step", pl.naive_step),
                               ("forwards", pl.forwards)):
                events, held = pl.core_traffic(loop, P, M)
                problem = nccl_p2p_check(core_batches(events))
                assert problem is None, f"{name} P={P} M={M}: {problem}"
                want = [min(P - s, M) for s in range(P)] if name == "one_f_one_b" else [M] * P
                assert name == "forwards" or held == want, \
                    f"{name} P={P} M={M}: micro-batches held per stage {held}, expected {want} (1F1B: P - stage)"
                for s, evs in enumerate(events):
                    ops = [ev for ev in evs if ev[0] == "op"]
                    for _, kind, mb, got in ops:  # F needs the activation from above, B the gradient from below
                        need = None if (s == 0 if kind == "F" else s == P - 1) else ("a" if kind == "F" else "g", mb)
                        assert got == need, f"{name} P={P} M={M} stage {s}: {kind}{mb} got {got}, needs {need}"
                    order = [pl.Op(kind, s, mb) for _, kind, mb, _ in ops]
                    expect = {"one_f_one_b": pl.one_f_one_b_ops(P, M, s), "naive_step": pl.gpipe(P, M, s),
                              "forwards": pl.gpipe(P, M, s)[:M]}[name]
                    assert order == expect, f"{name} P={P} M={M} stage {s}: ops {order}"
                checked += 1
    assert checked == 3 * sum(3 * P for P in (2, 3, 4, 8))
    # negative controls: a lone send facing a lone send (a cycle under NCCL), a receive nobody answers
    lone = [[[("send", 1, "a0", 1)], [("recv", 1, "g0", 1)]], [[("send", 0, "g0", 1)], [("recv", 0, "a0", 1)]]]
    assert nccl_p2p_check(lone).startswith("deadlock")
    events, _ = pl.core_traffic(pl.one_f_one_b, 2, 4)
    events[1][-1][1].append(("recv", 0, ("a", 4)))
    assert nccl_p2p_check(core_batches(events)).startswith("unmatched")


def legacy_plan(orders, owner, S):
    """The executor before plan_messages: before each op, one batch with the previous op's sends and the
    receives this op needs (posted in the peer's send order); the last op's sends alone at the end."""
    P = len(orders)
    out = []
    for me in range(P):
        expect = {p: collections.deque(k for op in orders[p] for k in [pl.message_out(op, S)]
                                       if k and owner(k[1], k[2]) == me) for p in range(P) if p != me}
        batches, outbox, posted = [], [], set()
        for op in orders[me]:
            need, recvs = pl.message_in(op, S), []
            src = None if need is None else owner(need[1] + (1 if need[0] == "grad" else -1), need[2])
            while src not in (None, me) and need not in posted:
                k = expect[src].popleft()
                posted.add(k)
                recvs.append(("recv", src, k))
            batches.append(outbox + recvs)
            k = pl.message_out(op, S)
            outbox = [("send", owner(k[1], k[2]), k)] if k and owner(k[1], k[2]) != me else []
        out.append(batches + [outbox])
    return out


def as_batches(plans, S, M, dp=1, nbytes=2 * 16 * 32 * 4):
    """plan_messages' plans of D pipeline replicas -> the checker's global-rank batches, tagged as the executor tags."""
    P, tag = len(plans), lambda k: ((k[0] == "grad") * S + k[1]) * M + k[2]  # noqa: E731
    return [[[(kind, d * P + peer, tag(key), nbytes) for kind, peer, key in batch] for batch in plans[r]]
            for d in range(dp) for r in range(P)]


def test_nccl_p2p_contract():
    smallest = {"gpipe": lambda P: 1, "dualpipe": lambda P: 2 * P, "dualpipev": lambda P: 2 * P}
    checked = 0
    for name in pl.SCHEDULE_NAMES:
        for P in (2, 4, 6, 8):
            if name == "dualpipe" and P % 2:
                continue
            for M in range(smallest.get(name, lambda P: P)(P), 4 * P + 1):
                if (name == "interleaved" and M % P) or (name.startswith("dualpipe") and M % 2):
                    continue
                S, owner = pl.num_stages(name, P), functools.partial(pl.stage_owner, name, P, M)
                for orders in (pl.op_lists(name, P, M), [pl.forward_only(name, P, M, r) for r in range(P)]):
                    plans = pl.plan_messages(orders, owner)
                    for dp in (1, 2):
                        assert nccl_p2p_check(as_batches(plans, S, M, dp)) is None, (name, P, M, dp)
                        checked += 1
    assert checked == 1088
    # negative controls: the old plan deadlocks DualPipe(V) and interleaved (gloo buffers sends and never
    # showed it); a swapped pair of receives, and a missing one, are reported
    for name, P, M in (("dualpipe", 2, 4), ("dualpipev", 2, 4), ("dualpipev", 4, 8), ("interleaved", 2, 4)):
        S, owner = pl.num_stages(name, P), functools.partial(pl.stage_owner, name, P, M)
        assert nccl_p2p_check(as_batches(legacy_plan(pl.op_lists(name, P, M), owner, S), S, M)).startswith("deadlock")
    for name in ("gpipe", "1f1b"):  # ... and passes where it was safe: GPipe and 1F1B never send first both ways
        S, owner = 4, functools.partial(pl.stage_owner, name, 4, 8)
        assert nccl_p2p_check(as_batches(legacy_plan(pl.op_lists(name, 4, 8), owner, S), S, 8)) is None
    plans = pl.plan_messages(pl.op_lists("1f1b", 2, 4), functools.partial(pl.stage_owner, "1f1b", 2, 4))
    recvs = [(j, i) for j, b in enumerate(plans[1]) for i, m in enumerate(b) if m[0] == "recv"]
    (j0, i0), (j1, i1) = recvs[:2]
    plans[1][j0][i0], plans[1][j1][i1] = plans[1][j1][i1], plans[1][j0][i0]
    assert nccl_p2p_check(as_batches(plans, 2, 4)).startswith("mismatch")
    del plans[1][j0][i0]
    assert nccl_p2p_check(as_batches(plans, 2, 4)).startswith("unmatched")


def test_bad_input_is_a_clear_error():
    def args(*a):
        return pl.make_cli_parser().parse_args(list(a))
    cases = [(args("--schedule", "1f1b", "--n-layer", "3"), 2, "do not split into 2 stages"),
             (args("--schedule", "dualpipev", "--micro-batches", "8"), 4, "do not split into 8 stages"),
             (args("--schedule", "dualpipe", "--n-layer", "3"), 3, "P=3 is odd"),
             (args("--schedule", "1f1b", "--micro-batches", "2"), 4, "cannot fill 4 stages"),
             (args("--schedule", "dualpipe", "--micro-batches", "4"), 4, "even number of micro-batches >= 2P = 8"),
             (args("--batch-size", "6", "--micro-batches", "4"), 2, "--batch-size 6 is not divisible"),
             (args("--dp", "3"), 4, "--dp 3 does not divide"),
             (args("--schedule", "interleaved", "--micro-batches", "3", "--batch-size", "6"), 2, "groups of P=2"),
             (args("--schedule", "interleaved", "--virtual-stages", "0"), 2, "--virtual-stages 0"),
             (args("--schedule", "zbh1", "--micro-batches", "2"), 4, "zbh1 with 2 micro-batches cannot fill")]
    for a, world, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("+", r"\+")):
            pl.check_cli_args(a, world)
    assert pl.check_cli_args(args("--schedule", "dualpipev", "--n-layer", "8", "--micro-batches", "8"), 4) == 4
    assert pl.check_cli_args(args("--schedule", "dualpipe", "--compile", "--activation-checkpointing"), 2) == 2


CORE_REFUSALS = [  # what the core itself refuses, in one line, before gpt2.setup: (flags, WORLD_SIZE, the line)
    (["--batch-size", "8", "--micro-batches", "3"], 2,
     "error: --batch-size 8 is not divisible by --micro-batches 3 (--micro-batches): give a divisor of --batch-size"),
    (["--n-layer", "3", "--micro-batches", "2"], 2,
     "error: 3 layers do not split into 2 stages (P=2 ranks per pipeline) (--n-layer): give a multiple of 2 "
     "layers, or another number of ranks"),
    (["--n-layer", "4", "--micro-batches", "2"], 8, "error: 4 layers do not split into 8 stages"),
]


@pytest.mark.parametrize("where", ["file", "handout"])
def test_core_refuses_a_partial_batch_and_a_dropped_block(where, tmp_path, monkeypatch, capsys):
    """Issue 36: the core never trains on part of the batch nor drops a block; the check lives in the core, so
    the --core handout (tests/exercise.py) refuses too: one line, exit 2, and gpt2.setup never reached."""
    import importlib.util
    from exercise import core_copy
    path = pl.__file__
    if where == "handout":
        path = str(tmp_path / "pipeline.py")
        with open(path, "w") as f:
            f.write(core_copy(open(pl.__file__).read()))
    spec = importlib.util.spec_from_file_location(f"pipeline_{where}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    entry = mod.cli if where == "file" else mod.main
    monkeypatch.setattr(gpt2, "setup", lambda *a, **k: pytest.fail("gpt2.setup reached: the check came too late"))
    for flags, world, line in CORE_REFUSALS:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        with pytest.raises(SystemExit) as e:
            gpt2.run_main(entry, flags + ["--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(line) and err.count("\n") == 1, (where, flags, err)


# -- 2 ranks in one launch: loss and every gradient vs the unsplit model and torch.distributed.pipelining, then curves

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
    return {"wte.weight" if n == "lm_head.weight" else n: p.grad for n, p in model.named_parameters()}


def my_stages(pipe):
    return getattr(pipe, "my_stages", (pipe.stage,))


def torch_pipelining_grads(name, pipe, args, x, y):
    """The same stages under torch's ScheduleGPipe / Schedule1F1B / ScheduleDualPipeV; the tied wte/lm_head
    copies summed as pipeline.py sums them. Returns (loss or None, {param name: grad})."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe
    M, S, full = pipe.M, pipe.S, gpt2.build_model(args)
    mods = {s: TorchStage(pl.keep_only(copy.deepcopy(full), set(range(*pipe.layers[s])), s == 0, s == S - 1),
                          *pipe.layers[s], s == 0, s == S - 1) for s in my_stages(pipe)}
    stages = [PipelineStage(mods[s], s, S, torch.device("cpu")) for s in sorted(my_stages(pipe))]
    loss_fn = lambda out, tgt: gpt2.cross_entropy(out, tgt) / M  # noqa: E731  (scale_grads=False below)
    if name == "dualpipev":
        sched = ScheduleDualPipeV(stages, M, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name](stages[0], M, loss_fn=loss_fn, scale_grads=False)
    losses = []
    kw = {"target": y, "losses": losses} if pipe.last else {}
    sched.step(*((x,) if pipe.first else ()), **kw)
    grads = {}
    for s in sorted(my_stages(pipe)):
        for n, g in grads_by_name(mods[s].model).items():
            grads[n] = g if n not in grads else grads[n] + g  # dualpipev: wte used by stage 0 and 2P-1
    if name != "dualpipev" and pipe.P > 1:
        dist.all_reduce(grads["wte.weight"])  # P=2: the first and last stage are the whole world
    return (sum(losses).item() if losses else None), grads


def tensor_diffs(ours, ref):
    """{name: (norm of ours, norm of the reference, max |ours - ref| / max |ref|)} for every tensor of ours."""
    return {n: (g.norm().item(), ref[n].norm().item(), ((g - ref[n]).abs().max() / ref[n].abs().max()).item())
            for n, g in ours.items()}


def one_step_vs_unsplit(pipe, step, args, x, y, order):
    """One step of `step` (pipe.step) -> its loss, its gradients and, after clipping to half the gradient
    norm, its clipped gradients, each against the unsplit model on the whole batch; and whether its ops ran
    in `order` (pipe.spans records them)."""
    loss = pipe.global_loss(step(x, y, 1.0 / pipe.M)).item()
    pipe.sync_grads()
    ref = gpt2.build_model(args)
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    r = {"loss": (loss, ref_loss.item()), "grad": tensor_diffs(grads_by_name(pipe.model), grads_by_name(ref)),
         "order": [tuple(op) for op, _, _ in pipe.spans] == [tuple(op) for op in order]}
    max_norm = 0.5 * torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    pipe.clip_grad_norm(max_norm)
    r["clipped"] = tensor_diffs(grads_by_name(pipe.model), grads_by_name(ref))
    return r


def _two_rank_worker(rank, world, data, out):
    import torch.distributed as dist
    result = {}
    torch.manual_seed(0)
    x, y = torch.randint(0, 50257, (8, 16)), torch.randint(0, 50257, (8, 16))
    base = ["--micro-batches", "4", "--batch-size", "8", "--data", data] + SMALL
    for name in ("naive",) + pl.SCHEDULE_NAMES:
        flags = ["--naive"] if name == "naive" else ["--schedule", name]
        args = pl.make_cli_parser().parse_args(flags + base + ["--out", os.path.join(out, name)])
        pipe = pl.pipeline_class(args.schedule)(args, gpt2.setup(args), pl.check_cli_args(args, world))
        order = pl.op_lists(name, 2, 4)[rank]  # naive: all F, then all B (GPipe's order)
        result[name] = one_step_vs_unsplit(pipe, pipe.step, args, x, y, order)
        if name in ("gpipe", "1f1b", "dualpipev"):  # the schedules torch has in the same layout
            pipe.model.zero_grad(set_to_none=True)
            loss = pipe.global_loss(pipe.step(x, y, 1.0 / pipe.M)).item()
            pipe.sync_grads()
            t_loss, t_grads = torch_pipelining_grads(name, pipe, args, x, y)
            result[name]["torch"] = (t_loss, loss, tensor_diffs(grads_by_name(pipe.model), t_grads))
        dist.barrier()
        pl.cli(flags + base + ["--out", os.path.join(out, name)])  # the 8-step run, compared with gpt2.py train
    argv = ["--schedule", "interleaved", "--virtual-stages", "1"] + base + ["--out", os.path.join(out, "v1")]
    args = pl.make_cli_parser().parse_args(argv)  # --virtual-stages acts: V=1 is not the default's order
    pipe = pl.pipeline_class("interleaved")(args, gpt2.setup(args), pl.check_cli_args(args, world))
    order = pl.op_lists("interleaved", 2, 4, 1)[rank]
    result["interleaved_v1"] = one_step_vs_unsplit(pipe, pipe.step, args, x, y, order)
    for name in ("naive", "1f1b"):  # --grad-accum 2: the batch in two halves, the losses scaled by 1/(M x 2)
        flags = ["--naive"] if name == "naive" else []
        pl.cli(flags + base + ["--grad-accum", "2", "--batch-size", "4", "--micro-batches", "2", "--eval-every", "0",
                               "--out", os.path.join(out, name + "_ga2")])
    pl.cli(LONG + ["--data", data, "--out", os.path.join(out, "1f1b_long")])
    return result


# a shrunk configuration of the default recipe: 60 steps, the same lr schedule shape (warmup, cosine to 10%)
LONG = ["--n-embd", "32", "--seq-len", "32", "--device", "cpu", "--dtype", "float32", "--steps", "60",
        "--eval-every", "0", "--warmup", "6", "--batch-size", "4", "--micro-batches", "2"]


@pytest.fixture(scope="module")
def baselines(shakespeare, tmp_path_factory):
    """`gpt2.py train` (one process, real text) for the configurations the pipeline runs are compared with."""
    out = {}
    for key, argv in {"L4B8": SMALL + ["--batch-size", "8"], "L8B8": SMALL + ["--batch-size", "8", "--n-layer", "8"],
                      "L4B4GA2": SMALL + ["--batch-size", "4", "--grad-accum", "2", "--eval-every", "0"],
                      "long": LONG[:-2]}.items():
        d = str(tmp_path_factory.mktemp("base_" + key))
        gpt2.train(["--data", shakespeare, "--out", d] + argv)
        out[key], out[key + "_dir"] = losses(d), d
        out[key + "_train"] = [r["loss"] for r in read_metrics(d) if "loss" in r]
        out[key + "_steps"] = [r["step"] for r in read_metrics(d) if "step" in r]
    return out


# A correct pipeline reproduces gpt2.py's fp32 curve to round-off (measured 1.8e-7 at 2 and 4 ranks); a frozen model or
# a dropped replica all-reduce moves it by far more on real text, where the loss falls (FALLS) in 8 steps
CURVE_TOL, FALLS, GRAD_TOL = 5e-7, 0.1, 1e-4
HINT_GRAD = {"loss": "the last stage scales each micro-batch's loss by 1/M (pipe.scale)",
             "wte.weight": "the tied wte/lm_head: its two copies' gradients summed (embed_group)",
             "clipped": "one clip coefficient everywhere: the sum of squares all-reduced over the stages, each "
                        "parameter counted once, coef = min(1, max_norm / norm) applied to every gradient"}


def check_tensors(what, diffs, hint):
    """Per tensor: its norm vs the reference's (a named comparison) and the largest elementwise difference."""
    for n, (ours, ref, rel) in diffs.items():
        compare(f"{what}: norm of {n}", [ours], [ref], GRAD_TOL, hint=HINT_GRAD.get(n, hint))
    for n, (ours, ref, rel) in diffs.items():
        assert rel < GRAD_TOL, f"{what} of {n}: max elementwise relative difference {rel:.1e} > {GRAD_TOL:.0e} " \
                               f"(norm {ours:.6g} vs {ref:.6g}; {HINT_GRAD.get(n, hint)})"


def check_curve(key, curve, base, steps, tol=CURVE_TOL):
    """A pipeline run's losses: the same length as gpt2.py's, within tol of it (named), and falling."""
    assert_close(f"train and val loss, pipeline.py {key} 2 ranks fp32 vs gpt2.py", curve, base, tol, steps=steps)
    assert curve[0] - curve[-1] > FALLS, f"{key}: the loss does not fall: {curve[0]:.3f} -> {curve[-1]:.3f}"


def test_two_ranks_every_schedule(shakespeare, tmp_path, baselines):
    results = run_distributed(_two_rank_worker, 2, shakespeare, str(tmp_path), timeout=400)
    for name in ("naive",) + pl.SCHEDULE_NAMES + ("interleaved_v1",):  # per tensor, one step, before any curve
        for rank, res in enumerate(results):
            r, what = res[name], f"{name} rank {rank} vs the unsplit model"
            assert r["order"], f"{name} rank {rank}: the ops did not run in the op list's order (is the flag applied?)"
            if r["loss"][0]:  # the rank holding the last stage reports the loss
                assert_close(f"loss, {what}", [r["loss"][0]], [r["loss"][1]], 1e-5, hint=HINT_GRAD["loss"])
            check_tensors(f"gradient, {what}", r["grad"], "each micro-batch's loss scaled by 1/M, gradients summed")
            check_tensors(f"gradient clipped to half its norm, {what}", r["clipped"], HINT_GRAD["clipped"])
            if "torch" in r:
                t_loss, loss, diffs = r["torch"]
                if t_loss is not None:
                    assert_close(f"loss, {name} rank {rank} vs torch.distributed.pipelining", [loss], [t_loss], 1e-5)
                check_tensors(f"gradient, {name} rank {rank} vs torch.distributed.pipelining", diffs, "")
    for name in ("naive",) + pl.SCHEDULE_NAMES:
        d = os.path.join(str(tmp_path), name)
        check_curve(name, losses(d), baselines["L4B8"], baselines["L4B8_steps"])
        sched = json.load(open(os.path.join(d, "schedule.json")))
        assert [[tuple(s[0]) for s in spans] for spans in sched["spans"]] == \
               [[tuple(op) for op in order] for order in pl.op_lists(name, 2, 4)], f"{name}: the op order of the run"
        assert 0.0 < sched["bubble"] < 1.0 and os.path.getsize(os.path.join(d, "schedule.png")) > 10_000
        fig = summary(d)  # the payoff the core prints, recorded: its bubble, the closed form, held per rank
        assert 0.0 < fig["bubble"] < 1.0 and fig["bubble_closed_form"] == 1 / 5, fig
        grad_norms = [r["grad_norm"] for r in read_metrics(d) if "loss" in r]
        assert all(g > 0 for g in grad_norms) and len(grad_norms) == 8, grad_norms
    # one step's grad norm (pre-clip, the whole pipeline's) is the unsplit model's: read in gpt2.py's run too
    base_norm = [r["grad_norm"] for r in read_metrics(baselines["L4B8_dir"]) if "loss" in r]
    assert_close("grad_norm, pipeline.py 1f1b vs gpt2.py", [r["grad_norm"] for r in read_metrics(
        os.path.join(str(tmp_path), "1f1b")) if "loss" in r], base_norm, 1e-5, hint="squares summed over the stages, "
                 "the tied wte counted once (pipe.clip_grad_norm), read before the clip")
    for name in ("naive", "1f1b"):
        d = os.path.join(str(tmp_path), name + "_ga2")
        check_curve(name + " --grad-accum 2", train_loss(d), baselines["L4B4GA2_train"], None)
        sched = json.load(open(os.path.join(d, "schedule.json")))  # --micro-batches 2 acted: 2 F and 2 B per rank
        assert [[tuple(s[0]) for s in spans] for spans in sched["spans"]] == \
               [[tuple(op) for op in order] for order in pl.op_lists(name, 2, 2)], f"{name} --micro-batches 2"
    check_curve("1f1b, 60 steps", train_loss(os.path.join(str(tmp_path), "1f1b_long")), baselines["long_train"], None,
                tol=2e-6)
    # bytes rank 0 sends in a 1f1b step: M activations of (B/M, T, E) fp32, the tied wte's all-reduce
    # (2(n-1)/n of it, n=2), and the 4-byte loss and grad-norm all-reduces
    step0 = read_metrics(os.path.join(str(tmp_path), "1f1b"))[0]
    assert abs(step0["comm_mb"] * 1e6 - (4 * 2 * 16 * 32 * 4 + 50304 * 32 * 4 + 4 + 4)) < 1e-3, step0["comm_mb"]
    # activations held: GPipe and naive all M, 1F1B P - rank, DualPipe P + 1 (DeepSeek-V3 table 2); --naive
    # read but not applied would hold 1F1B's [2, 1]
    held = {n: summary(os.path.join(str(tmp_path), n))["held"] for n in ("naive",) + pl.SCHEDULE_NAMES}
    assert held["naive"] == [4, 4], f"--naive holds every micro-batch, got {held['naive']} (is --naive applied?)"
    assert held["gpipe"] == [4, 4] and held["1f1b"] == [2, 1] and held["dualpipe"] == [3, 3], held
    assert held["zbh1"] == [2, 2], held  # ZB-H1: P on every rank, counting those whose W is still to run


def train_loss(d):
    return [r["loss"] for r in read_metrics(d) if "loss" in r]


# -- 4 ranks: --dp 2 gradients vs the unsplit model; DualPipe at P=4, DualPipeV over 8 stages, every schedule x dp

def _four_rank_worker(rank, world, data, out):
    torch.manual_seed(0)
    x, y = torch.randint(0, 50257, (8, 16)), torch.randint(0, 50257, (8, 16))
    result = {}
    for name in ("naive", "1f1b", "dualpipe"):  # each replica steps on its half: the gradient is the mean over both
        flags = ["--naive"] if name == "naive" else ["--schedule", name]
        args = pl.make_cli_parser().parse_args(flags + ["--micro-batches", "4", "--batch-size", "4", "--dp", "2",
                                                        "--data", data, "--out", os.path.join(out, "g" + name)] + SMALL)
        pipe = pl.pipeline_class(args.schedule, args.dp)(args, gpt2.setup(args), pl.check_cli_args(args, world))
        half = slice(4 * pipe.replica, 4 * pipe.replica + 4)
        pipe.step(x[half], y[half], 1.0 / pipe.M)
        pipe.sync_grads()
        ref = gpt2.build_model(args)
        ref(x, y)[1].backward()  # the unsplit model on the whole batch of 8: the mean over both replicas' halves
        result[name] = tensor_diffs(grads_by_name(pipe.model), grads_by_name(ref))
    runs = {"dualpipe": ["--schedule", "dualpipe", "--micro-batches", "8", "--batch-size", "8"],
            "dualpipev": ["--schedule", "dualpipev", "--micro-batches", "8", "--batch-size", "8", "--n-layer", "8"],
            "1f1b_dp2": ["--schedule", "1f1b", "--micro-batches", "2", "--batch-size", "4", "--dp", "2"],
            "zbh1": ["--schedule", "zbh1", "--micro-batches", "4", "--batch-size", "8"],
            "interleaved": ["--schedule", "interleaved", "--micro-batches", "4", "--batch-size", "8", "--n-layer", "8"]}
    for name in ("gpipe", "zbh1", "interleaved", "dualpipe", "dualpipev"):  # P=2 x DP=2: every schedule under --dp
        runs[name + "_dp2"] = ["--schedule", name, "--micro-batches", "4", "--batch-size", "4", "--dp", "2"]
    for key, argv in runs.items():
        pl.cli(argv + ["--data", data, "--out", os.path.join(out, key)] + SMALL + ["--eval-every", "0"])
    return result


def test_four_ranks(shakespeare, tmp_path, baselines):
    results = run_distributed(_four_rank_worker, 4, shakespeare, str(tmp_path), timeout=300)
    for name in ("naive", "1f1b", "dualpipe"):
        for rank, res in enumerate(results):
            check_tensors(f"gradient, {name} --dp 2 rank {rank} vs the unsplit model on both replicas' batches",
                          res[name], "--dp: every gradient summed over the stage's D replicas, then / D (a mean)")
    # 1f1b_dp2: two replicas of 4 rows each are the baseline's batch of 8
    for key, base in {"dualpipe": "L4B8", "dualpipev": "L8B8", "1f1b_dp2": "L4B8", "zbh1": "L4B8",
                      "interleaved": "L8B8", **{f"{name}_dp2": "L4B8" for name in
                                                ("gpipe", "zbh1", "interleaved", "dualpipe", "dualpipev")}}.items():
        check_curve(key, train_loss(os.path.join(str(tmp_path), key)), baselines[base + "_train"], None)
    held = json.load(open(os.path.join(str(tmp_path), "dualpipe", "schedule.json")))["peak_held"]
    assert held == [5, 5, 5, 5]  # DualPipe holds P + 1 micro-batches' activations per rank


# -- GPU readiness on CPU: activation checkpointing, --compile and bf16 with the I/W split ---------------

def _dualpipe_options_worker(rank, world, data, out):
    torch.manual_seed(0)
    x, y = torch.randint(0, 50257, (8, 16)), torch.randint(0, 50257, (8, 16))
    result = {}
    for name in ("dualpipe", "dualpipev"):  # recompute within a stage: gradients still those of the unsplit model
        argv = ["--schedule", name, "--micro-batches", "4", "--batch-size", "8", "--data", data,
                "--activation-checkpointing", "--out", os.path.join(out, "ac_" + name)] + SMALL
        args = pl.make_cli_parser().parse_args(argv)
        pipe = pl.pipeline_class(name)(args, gpt2.setup(args), pl.check_cli_args(args, world))
        pipe.run(x, y, 1.0 / pipe.M)
        pipe.sync_grads()
        ref = gpt2.build_model(args)
        ref(x, y)[1].backward()
        result["ac_" + name] = tensor_diffs(grads_by_name(pipe.model), grads_by_name(ref))
    three = ["--schedule", "dualpipev", "--micro-batches", "4", "--batch-size", "8", "--data", data] + SMALL + [
        "--steps", "3", "--eval-every", "0"]
    for key, extra in {"compile": ["--compile"], "bf16": ["--dtype", "bfloat16"]}.items():
        pl.cli(three + extra + ["--out", os.path.join(out, key)])
    return result


def test_dualpipe_checkpointing_compile_bf16(random_data, tmp_path):
    results = run_distributed(_dualpipe_options_worker, 2, random_data, str(tmp_path), timeout=600)
    for rank, r in enumerate(results):
        for name in ("dualpipe", "dualpipev"):
            check_tensors(f"gradient, {name} --activation-checkpointing rank {rank} vs the unsplit model",
                          r["ac_" + name], "recompute inside a stage must not change a gradient")
    train = {k: train_loss(os.path.join(str(tmp_path), k)) for k in ("compile", "bf16")}
    for dtype in ("float32", "bfloat16"):  # gpt2.py train, eager, one process, the same 3 steps
        gpt2.train(["--data", random_data, "--out", str(tmp_path / dtype), "--batch-size", "8"] + SMALL + [
            "--steps", "3", "--eval-every", "0", "--dtype", dtype])
        train["gpt2_" + dtype] = train_loss(str(tmp_path / dtype))
    # compiled blocks (the I/W recording left eager): eager gpt2.py's steps 0-2 to fp32 round-off
    assert_close("train loss, dualpipev --compile vs gpt2.py eager fp32", train["compile"], train["gpt2_float32"], 1e-5)
    # bf16 messages add one rounding of the residual stream at each stage cut: within 1e-4 of gpt2.py bf16
    # (measured 2.2e-6), and not the fp32 run
    assert_close("train loss, dualpipev bf16 vs gpt2.py bf16", train["bf16"], train["gpt2_bfloat16"], 1e-4)
    assert compare("train loss, dualpipev bf16 vs gpt2.py fp32 (must differ)", train["bf16"], train["gpt2_float32"],
                   1.0) > 1e-7, train


def test_bad_input_exits_before_any_collective(random_data, tmp_path):
    bad = run_cli(["pipeline.py", "--schedule", "dualpipe", "--data", random_data, "--out", str(tmp_path)], check=False)
    assert bad.returncode != 0 and "P=1 is odd" in bad.stderr
