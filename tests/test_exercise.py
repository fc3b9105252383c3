"""The workshop round trip (issue 23) on one file, ddp.py: the exercise copy fails the project's own test with
the exercise's message, the reference copied into the same kind of directory passes it, and a copy with one
deliberate bug (gradients summed over the ranks instead of averaged) fails with the step that differs and the hint."""
import shutil
import subprocess
import sys

from exercise import CHECKS, EXERCISES, cut, main
from harness import ROOT

TEST = ["tests/test_ddp.py", "-k", "two_ranks_match_one_process"]


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
    proc = pytest_on(tmp_path / "exercise", tmp_path / "t1")
    assert proc.returncode == 1 and "NotImplementedError: exercise 1: DataParallel.take_grad: " in proc.stdout, \
        proc.stdout[-3000:]

    (tmp_path / "reference").mkdir()
    shutil.copy(f"{ROOT}/ddp.py", tmp_path / "reference" / "ddp.py")
    proc = pytest_on(tmp_path / "reference", tmp_path / "t2")
    assert proc.returncode == 0, proc.stdout[-3000:]

    (tmp_path / "bug").mkdir()
    text = open(f"{ROOT}/ddp.py").read()
    assert text.count("1.0 / self.world") == 1
    (tmp_path / "bug" / "ddp.py").write_text(text.replace("1.0 / self.world", "1.0"))  # a sum, not a mean
    proc = pytest_on(tmp_path / "bug", tmp_path / "t3")
    assert proc.returncode == 1 and "what differs" in proc.stdout, proc.stdout[-3000:]
    assert "step 1: loss" in proc.stdout and "steps before it agree" in proc.stdout, proc.stdout[-3000:]
    assert "are gradients divided by the world size" in proc.stdout
