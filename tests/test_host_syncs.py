"""Issue 29's host-sync budget: what would make a CUDA host wait in one optimizer step, counted on CPU by
tests/host_syncs.py. First the counter itself (each kind of sync is seen, its sync-free twin is not; a sync in a
branch only CUDA takes is counted when the step reaches its test), then every file against its measured budget (a
sync added to any file's step fails, named at its line), within issue 29's ceiling: 4 per step, plus 1 per MoE
layer per micro-step for moe_ep."""
import importlib.util
import io
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import host_syncs
from harness import two_at_a_time


@pytest.fixture
def counter():
    c = host_syncs.counters()
    c.on = True
    with c.dispatch, c.function:
        yield c


def added(c, op):
    """The kinds `op` added to the tally."""
    before = dict(c.tally)
    op()
    return {k: v - before.get(k, 0) for k, v in c.tally.items() if v != before.get(k, 0)}


def assign(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def test_the_counter_sees_each_kind_of_sync_and_not_its_sync_free_twin(counter):
    x = torch.randn(8, requires_grad=True)  # a test's factory is not the project's: this stands for device memory
    d = x.detach() * 1
    batch = torch.from_numpy(np.arange(8))  # host memory (the loader's numpy tokens)
    host = torch.zeros(8, device="cpu")  # host memory, named
    sink = io.StringIO()
    planted = [  # (kind, the op that syncs on CUDA, its sync-free twin)
        ("item/bool/float", lambda: x.sum().item(), lambda: batch.sum().item()),
        ("item/bool/float", lambda: bool(d.sum() > 0), lambda: d.sum() > 0),
        ("tolist", lambda: d.tolist(), lambda: batch.tolist()),
        ("numpy", lambda: d.numpy(), lambda: batch.numpy()),
        ("print a tensor", lambda: print(d, file=sink), lambda: print(batch, d.shape, file=sink)),
        ("print a tensor", lambda: f"{d.sum():.3f}", lambda: f"{batch.sum():.3f}"),
        ("device -> host copy", lambda: d.cpu(), lambda: batch.cpu()),
        ("device -> host copy", lambda: d.to("cpu"), lambda: d.to("cpu", non_blocking=True)),
        ("device -> host copy", lambda: host.copy_(d), lambda: d.copy_(d * 2)),
        ("equal", lambda: torch.equal(d, d), lambda: torch.equal(batch, batch)),
        ("boolean mask index", lambda: d[d > 0], lambda: d.masked_fill(d > 0, 0.0)),
        ("boolean mask index", lambda: assign(d, d > 0, d[0]), lambda: assign(d, d > 0, 0.0)),  # t[mask] = number
        ("nonzero", lambda: d.nonzero(), lambda: batch.nonzero()),
        ("bincount", lambda: torch.bincount(d.long().abs()), lambda: torch.bincount(batch)),
        ("repeat_interleave without output_size", lambda: torch.repeat_interleave(d, (d * 0 + 1).long()),
         lambda: torch.repeat_interleave(d, (d * 0 + 1).long(), output_size=8)),
        ("pageable host copy", lambda: batch.to(torch.device("cpu")), lambda: d.to(torch.device("cpu"))),
        ("pageable host copy", lambda: torch.tensor([1.0], device=torch.device("cpu")), lambda: torch.tensor([1.0])),
        ("pageable host copy", lambda: d.new_tensor([1.0]), lambda: batch.new_tensor([1.0])),
        ("pageable host copy", lambda: d.copy_(torch.ones(8, device="cpu")), lambda: d.copy_(torch.ones_like(d))),
    ]
    for kind, op, twin in planted:
        seen, twin_seen = added(counter, op), added(counter, twin)
        assert seen == {kind: 1}, f"planted {kind}: the counter saw {seen}"
        assert not twin_seen, f"the sync-free twin of {kind} was counted: {twin_seen}"
    assert added(counter, lambda: (x * 2).sum().backward()) == {}, "backward of a sum counted"


def test_host_memory_is_what_the_project_makes_without_a_device_and_what_is_computed_from_it(counter, tmp_path,
                                                                                              monkeypatch):
    """A factory without a device makes host memory when the project's code calls it (torch's nn.Linear makes its
    weights on the host too, then the model moves): a file of the project is simulated here."""
    monkeypatch.setattr(host_syncs, "ROOT", str(tmp_path))
    scope = {"torch": torch, "dev": torch.device("cpu")}
    exec(compile("def made():\n    return torch.zeros(4), torch.zeros(4, device=dev)\n", str(tmp_path / "f.py"),
                 "exec"), scope)
    host, device = scope["made"]()
    assert added(counter, lambda: host.to(torch.device("cpu"))) == {"pageable host copy": 1}
    assert added(counter, lambda: device.to(torch.device("cpu"))) == {}
    assert added(counter, lambda: (host * 2).to(torch.device("cpu"))) == {"pageable host copy": 1}, \
        "a tensor computed from host tensors only is host memory too"
    assert added(counter, lambda: (host * 2).sum().item()) == {}, "reading host memory is no sync"
    moved = host.to(torch.device("cpu"))
    assert added(counter, lambda: moved.sum().item()) == {"item/bool/float": 1}, "a copy to the device is device memory"


def test_synchronize_and_blocking_collectives_are_counted_once_each(counter, monkeypatch):
    calls = []
    for owner, name in ((torch.cuda, "synchronize"), (dist, "barrier"), (dist, "all_gather_object")):
        monkeypatch.setattr(getattr(owner, name), "original", lambda *a, _n=name, **k: calls.append(_n))
    assert added(counter, torch.cuda.synchronize) == {"cuda.synchronize": 1}
    assert added(counter, dist.barrier) == {"dist.barrier": 1}
    assert added(counter, lambda: dist.all_gather_object([None], 1)) == {"dist.all_gather_object": 1}
    assert calls == ["synchronize", "barrier", "all_gather_object"]
    monkeypatch.setattr(dist.new_group, "original", lambda *a, **k: object())
    writer = dist.new_group(backend="gloo")  # a host group even on CUDA (checkpoint.py's writer)
    assert added(counter, lambda: dist.barrier(group=writer)) == {}, "a barrier of a gloo-made group counted"


CUDA_ONLY = '''
import torch
import torch.distributed as dist


def step(x, cuda_timing):
    if x.device.type == "cuda":
        torch.cuda.synchronize()  # counted: CUDA takes this branch
    if x.device.type == "cuda" and cuda_timing:
        print(x.sum().item())  # not counted: cuda_timing is False in this step
    loss = x.sum() if x.device.type != "cuda" else x.sum().to("cpu")  # counted: CUDA's side copies to the host
    if torch.cuda.is_available():
        x = x.to("cpu", non_blocking=True)  # no sync: non_blocking
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.barrier()  # not counted: no process group in this step
    cuda = x.device.type == "cuda"
    if cuda:
        x.tolist()  # counted: `cuda` holds a CUDA test
    return loss
'''


def test_a_sync_in_a_branch_only_cuda_takes_is_counted_when_the_step_reaches_it(counter, tmp_path):
    path = tmp_path / "cuda_only.py"
    path.write_text(CUDA_ONLY)
    spec = importlib.util.spec_from_file_location("cuda_only", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tracer = host_syncs.BranchTracer(counter, [str(path)])
    assert len(tracer.files[str(path)]) == 5, tracer.files  # the non_blocking copy's branch holds no sync
    tracer.start(sys._getframe())
    try:
        seen = added(counter, lambda: module.step(torch.ones(3), cuda_timing=False))
    finally:
        tracer.stop()
    assert seen == {"CUDA-only branch: synchronize": 1, "CUDA-only branch: device -> host copy": 1,
                    "CUDA-only branch: tolist": 1}, seen
    assert added(counter, lambda: module.step(torch.ones(3), cuda_timing=False)) == {}, "counted after stop()"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    host_syncs.DATA = host_syncs.prepare_data(str(tmp_path_factory.mktemp("syncs")))
    return host_syncs.DATA


@pytest.fixture(scope="module")
def counts(request, data):
    """Every selected file counted, two launches at a time (the count is of operations, not of time)."""
    yield from two_at_a_time(request, "test_host_syncs_per_step_within_budget", "name",
                             lambda name: host_syncs.count_file(name, grad_accum=2))


@pytest.mark.parametrize("name", list(host_syncs.RUNS))
def test_host_syncs_per_step_within_budget(name, counts):
    row = counts[name].result()
    where = ", ".join(f"{k} x{v}" for k, v in row["ops"].items())
    assert row["budget"] <= row["ceiling"], f"{name}: budget {row['budget']} above issue 29's {row['ceiling']}"
    assert row["syncs_per_step"] <= row["budget"], \
        f"{name}: {row['syncs_per_step']} host syncs per step at --grad-accum 2 > its budget {row['budget']} " \
        f"({where}; at {row['where']}): a new host sync in the step? " \
        f"python tests/host_syncs.py {name} --where lists each at its line"
