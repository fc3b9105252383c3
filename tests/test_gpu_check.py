"""tests/gpu_check.py without a GPU: its plan (the dry run as JSON: the block-scaled GEMM check first, the one-GPU rows
before the others, the total within the default --minutes, for 1 and 8 GPUs), the NCCL rows issue 29 asks for, every
flag those rows pass exists in the file they run, every flag of gpu_check.py that its docstring or a README names
exists; and how it runs rows (fake ones here): a row that runs past its seconds has its whole process group ended, a
row that no longer fits is skipped with a line, and the exit code is 1 with a one-line summary naming them."""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

import gpu_check
from harness import ROOT, file_flags


def dry_run(gpus, *extra):
    out = subprocess.run([sys.executable, "tests/gpu_check.py", "--dry-run", "--gpus", str(gpus), *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("gpus", [1, 8])
def test_dry_run_json_is_the_plan_check_first_one_gpu_rows_next_total_within_minutes(gpus):
    plan = json.loads(dry_run(gpus, "--json"))
    assert set(plan) == {"rows", "total_s", "minutes"}, plan.keys()
    names = [r["name"] for r in plan["rows"]]
    assert names[0] == "fp8 block-scaled _scaled_mm", f"the real block-scaled GEMM check is not first: {names[:3]}"
    assert all(isinstance(r["seconds"], int) and r["seconds"] > 0 for r in plan["rows"]), plan["rows"]
    assert 0 < plan["total_s"] <= 60 * plan["minutes"], f"the plan ({plan['total_s']} s) does not fit its minutes"
    assert plan["total_s"] <= sum(r["seconds"] for r in plan["rows"])
    phases = [r["phase"] for r in plan["rows"]]
    one_gpu = phases.count("1 GPU") + phases.count("speed 1 GPU")
    assert set(phases[:one_gpu]) == {"1 GPU", "speed 1 GPU"}, f"a multi-GPU row before a one-GPU row: {phases}"
    if gpus == 1:
        assert set(phases) == {"1 GPU", "speed 1 GPU"}, "one GPU: NCCL allows one rank per device"
    rows = {r["row"]: r for r in gpu_check.plan(gpus, "DATA", "OUT")}
    assert plan["total_s"] == gpu_check.estimate(list(rows.values()), gpus)
    text = dry_run(gpus)
    assert f"fits --minutes {plan['minutes']}" in text.splitlines()[-1], text.splitlines()[-1]


def test_dry_run_on_8_gpus_has_a_nccl_row_for_every_file_and_an_equality_row_each():
    rows = gpu_check.plan(8, "DATA", "OUT")
    torchrun = [" ".join(gpu_check.command(r, shown=True)) for r in rows if r["nproc"] > 1]
    for name in ("ddp.py", "fsdp2.py", "tensor_parallel.py", "pipeline.py", "moe_ep.py", "fp8.py", "muon.py",
                 "checkpoint.py"):
        assert any(f" {name} " in ln for ln in torchrun), f"no torchrun row runs {name}"
        assert any(r["kind"] == "equal" and r["argv"][0] == name for r in rows), f"no equality row runs {name}"
    for flag in ["--zero 1", "--zero 2", "--replicate 2", "--sequence-parallel --overlap-comm", "--schedule zbh1",
                 "--schedule interleaved", "--schedule dualpipev", "--ep 2", "--fail-at"]:
        assert any(flag in ln for ln in torchrun), f"no NCCL row with {flag}"
    for r in rows:
        if r["kind"] in ("equal", "ref"):
            assert "--deterministic" in r["argv"] and "float32" in r["argv"], f"{r['row']}: not fp32 --deterministic"
        if r["argv"][0].endswith(".py") and not r["argv"][0].startswith("tests/"):
            assert r["argv"][r["argv"].index("--timeout") + 1] == str(r["seconds"]), f"{r['row']}: no --timeout"
    resume = next(r for r in rows if r["row"] == "checkpoint.py resumed on 1 rank")
    assert resume["nproc"] == 1 and resume.get("after") == "checkpoint.py 2 ranks, saves, dies", \
        "no row resumes on 1 rank what 2 ranks saved, after them"


def test_rows_where_rounding_is_discrete_carry_a_wider_tolerance_with_its_reason():
    rows = {r["row"]: r for r in gpu_check.plan(8, "DATA", "OUT") if r["kind"] == "equal"}
    assert rows["ddp.py"]["tol"] == 1e-5
    for name, words in (("fp8.py 2 ranks", "e4m3"), ("moe_ep.py --ep 2", "top-k"),
                        ("muon.py 2 ranks", "Newton-Schulz")):
        assert words in rows[name]["why"], (name, rows[name]["why"])
        assert rows[name]["tol"] > 1e-5 or "exact" in rows[name]["why"], (name, rows[name]["tol"])


@pytest.mark.parametrize("argv, flag", [(["--minutes", "0"], "(--minutes)"), (["--minutes", "-3"], "(--minutes)"),
                                        (["--gpus", "0"], "(--gpus)"), (["--json"], "(--json)")])
def test_bad_input_is_one_line_and_exit_2(argv, flag):
    out = subprocess.run([sys.executable, "tests/gpu_check.py", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], out.stderr


def fake(name, code, seconds=30, **extra):
    """A row that runs `python -c code`, with a check row's handling (its exit code decides)."""
    return {"row": name, "nproc": 1, "argv": ["-c", code], "kind": "check", "ref": None, "out": None,
            "seconds": seconds, "phase": "1 GPU", "tol": None, "why": "", **extra}


def alive(pid):
    """Running (a zombie, ended and waiting for its reaper, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_row_past_its_seconds_has_its_process_group_ended_and_the_exit_code_says_which_failed(tmp_path,
                                                                                                monkeypatch):
    pid_file = tmp_path / "child.pid"
    hang = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(120)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    rows = [fake("passes", "print('ok')"), fake("fails", "import sys; sys.exit(3)"),
            fake("hangs", hang, seconds=5), fake("too long for --minutes", "print('never')", seconds=600)]
    monkeypatch.setattr(gpu_check, "plan", lambda *a, **k: rows)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        gpu_check.main(["--smoke", "--minutes", "1", "--out", str(tmp_path / "out")])
    printed = out.getvalue().strip().splitlines()
    assert stop.value.code == 1, printed[-1]
    assert printed[-1] == "gpu_check: FAIL: 1 of 4 passed; 1 failed (fails); 1 timed out (hangs); " \
                          "1 skipped for time (too long for --minutes)", printed[-1]
    child = int(pid_file.read_text())
    time.sleep(0.5)
    assert not alive(child), "the hung row's child (a rank torchrun would have started) still runs"
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]
    assert results[3]["error"].startswith("skipped: needs 600 s"), results[3]
    monkeypatch.setattr(gpu_check, "plan", lambda *a, **k: rows[:1])
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        gpu_check.main(["--smoke", "--minutes", "1", "--out", str(tmp_path / "out2")])
    assert stop.value.code == 0 and out.getvalue().strip().splitlines()[-1] == "gpu_check: PASS: 1 of 1 rows passed"


def test_the_resume_row_expects_the_last_commit_that_exists(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step, committed in ((10, True), (12, False)):
        (ckpt / f"step_{step:06d}").mkdir(parents=True)
        if committed:
            (ckpt / f"step_{step:06d}" / "manifest.json").write_text("{}")
    assert gpu_check.last_commit(str(ckpt)) == 10
    said = fake("resume", "print('resumed from step 12')", ckpt_dir=str(ckpt), kind="equal")
    res = gpu_check.run_row(said, dict(os.environ), {})
    assert not res["ok"] and "expected 'resumed from step 10' (the last commit)" in res["error"], res
    assert not gpu_check.run_row(fake("none", "pass", ckpt_dir=str(tmp_path / "empty")), dict(os.environ), {})["ok"]


def test_every_flag_a_row_passes_exists_in_its_file():
    rows = gpu_check.plan(8, "DATA", "OUT")
    known = {}
    for r in rows:
        name = r["argv"][0]
        if not name.endswith(".py") or name.startswith("tests/"):
            continue
        if name not in known:
            known[name] = file_flags(name)
        missing = [a for a in r["argv"] if a.startswith("--") and a not in known[name]]
        assert not missing, f"row {r['row']!r}: {name} has no {missing}"


def test_every_gpu_check_flag_named_in_its_docstring_and_the_readmes_exists():
    own = {a for action in gpu_check.parser()._actions for a in action.option_strings}
    texts = [gpu_check.__doc__]
    for path in ("README.md", "tests/README.md"):
        with open(os.path.join(ROOT, path)) as f:
            texts.append(f.read())
    named = set()
    for text in texts:
        for line in re.findall(r"gpu_check\.py[^\n`]*", text):
            named |= set(re.findall(r"--[a-z][a-z-]*", line))
    assert named, "no gpu_check.py command line found"
    assert named <= own, f"gpu_check.py has no {sorted(named - own)}"
