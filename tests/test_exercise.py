"""The workshop round trip (issue 23) on one file, ddp.py: the exercise copy fails the project's own test with
the exercise's message, the reference copied into the same kind of directory passes it, and a copy with one
deliberate bug (gradients summed over the ranks instead of averaged) fails one SGD step's check with the ratio (2)
and the hint that names it."""
import concurrent.futures
import shutil
import subprocess
import sys

import pytest

from exercise import BANNER, CHECKS, EXERCISES, cut, main
from harness import ROOT, compare, run_clis, train_losses

TEST = ["tests/test_ddp.py", "-k", "one_sgd_step_averages_the_gradients and plain"]  # SGD: the scale shows at once


def pytest_on(impl, basetemp):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
                           "--impl", str(impl), *TEST], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_every_exercise_cuts_a_function_of_the_core(tmp_path):
    for name, items in EXERCISES.items():
        source = open(f"{ROOT}/{name}").read()
        text = cut(source, items)
        core = source[: source.index("# ---- Beyond the core ----")]
        for n, (dotted, _) in enumerate(items, 1):
            assert f'NotImplementedError("exercise {n}: {dotted}: ' in text, (name, dotted)
            assert f"def {dotted.split('.')[-1]}(" in core, f"{name}: {dotted} is not in the core"
        compile(text, name, "exec")
        assert source.count(CHECKS[name][1][0]) == 1, name  # the --check bug's line is there, once


def test_ddp_exercise_fails_reference_passes_bug_points_at_it(tmp_path):
    main(["ddp.py", "--out", str(tmp_path / "exercise")])
    (tmp_path / "reference").mkdir()
    shutil.copy(f"{ROOT}/ddp.py", tmp_path / "reference" / "ddp.py")
    (tmp_path / "bug").mkdir()
    text = open(f"{ROOT}/ddp.py").read()
    assert text.count("1.0 / self.world") == 1
    (tmp_path / "bug" / "ddp.py").write_text(text.replace("1.0 / self.world", "1.0"))  # a sum, not a mean
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three independent pytest runs, at once
        exercise, reference, bug = pool.map(lambda d: pytest_on(tmp_path / d, tmp_path / f"t_{d}"),
                                            ("exercise", "reference", "bug"))

    assert exercise.returncode == 1 and "NotImplementedError: exercise 1: DataParallel.take_grad: " in exercise.stdout, \
        exercise.stdout[-3000:]
    assert reference.returncode == 0, reference.stdout[-3000:]
    assert bug.returncode == 1 and "what differs" in bug.stdout, bug.stdout[-3000:]
    assert "ratio 2.000, expected 1" in bug.stdout, bug.stdout[-3000:]  # the update of each tensor doubles
    assert "a ratio of 2 is a sum where the mean belongs" in bug.stdout, bug.stdout[-3000:]  # the check's own hint


# The handout runs alone (issue 30): each file cut at its banner trains under torchrun and prints the same losses
# as the whole file with the same flags. Flags a file's core needs on 2 ranks:
CORE_FLAGS = {"ddp.py": [], "fsdp2.py": [], "tensor_parallel.py": ["--tp", "2"], "pipeline.py": ["--micro-batches", "2"], "moe_ep.py": [],
              "fp8.py": [], "muon.py": [], "checkpoint.py": []}


@pytest.mark.parametrize("name", sorted(CORE_FLAGS))
def test_core_alone_trains_like_the_whole_file(name, tmp_path, shakespeare):
    main([name, "--core", "--out", str(tmp_path / "handout")])
    core = (tmp_path / "handout" / name).read_text()
    assert BANNER not in core and "Appendix" not in core, f"{name}: the handout holds more than the core"
    flags = ["--data", shakespeare, "--steps", "3", "--eval-every", "0", "--batch-size", "2", "--seq-len", "64",
             *CORE_FLAGS[name]]
    run_clis(([str(tmp_path / "handout" / name), *flags, "--out", str(tmp_path / "core")], 2),
             ([name, *flags, "--out", str(tmp_path / "whole")], 2))
    core_losses, whole = train_losses(str(tmp_path / "core")), train_losses(str(tmp_path / "whole"))
    worst = compare(f"train loss, {name} core alone vs the whole file (2 ranks, fp32)", core_losses, whole, 0.0)
    assert worst == 0.0, f"{name}: the core alone differs from the whole file by {worst:.1e} (the default run must " \
                         f"be the core's classes)"
