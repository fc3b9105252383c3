"""Issue 29's host-sync budget: what would make a CUDA host wait in one optimizer step, counted on CPU by
tests/host_syncs.py. First the counter itself (each kind of sync is seen, its sync-free twin is not), then every file
against its budget: 4 per step, plus 1 per MoE layer per micro-step for moe_ep."""
import numpy as np
import pytest
import torch

import host_syncs
from harness import two_at_a_time


def test_the_counter_sees_each_kind_of_sync_and_not_its_sync_free_twin():
    tally, state, dispatch, function = host_syncs.counters()
    state["on"] = True
    x = torch.randn(8, requires_grad=True)
    batch = torch.from_numpy(np.arange(8))
    with dispatch, function:
        checks = [
            ("item/bool/float", lambda: x.sum().item()),
            ("item/bool/float", lambda: bool(x.sum() > 0)),
            ("tolist", lambda: x.detach().tolist()),
            ("boolean mask index", lambda: x.detach()[x.detach() > 0]),
            ("nonzero", lambda: x.detach().nonzero()),
            ("bincount", lambda: torch.bincount(batch)),
            ("repeat_interleave without output_size", lambda: torch.repeat_interleave(x, torch.ones(8, dtype=torch.long))),
            ("pageable host copy", lambda: batch.to(torch.device("cpu"))),
            ("pageable host copy", lambda: torch.tensor([1.0], device=torch.device("cpu"))),
        ]
        for what, op in checks:
            before = dict(tally)
            op()
            assert tally.get(what, 0) == before.get(what, 0) + 1, f"the counter missed {what}: {tally}"
        before = sum(tally.values())
        torch.repeat_interleave(x, torch.ones(8, dtype=torch.long), output_size=8)
        batch.to(torch.device("cpu"), non_blocking=True)
        x.detach().masked_fill(x.detach() > 0, 0.0)
        (x * 2).sum().backward()
        torch.zeros(3).to(torch.device("cpu"))  # born on the device: no host copy on CUDA
        assert sum(tally.values()) == before, f"counted a sync-free op: {tally}"



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
    assert row["syncs_per_step"] <= row["budget"], \
        f"{name}: {row['syncs_per_step']} host syncs per step at --grad-accum 2 > budget {row['budget']} ({where}); " \
        f"python tests/host_syncs.py {name} --where lists each at its line"
