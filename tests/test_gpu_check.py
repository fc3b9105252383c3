"""tests/gpu_check.py without a GPU: its dry run lists the NCCL rows issue 29 asks for, every flag those rows pass
exists in the file they run, and every flag of gpu_check.py that its docstring or a README names exists."""
import contextlib
import importlib
import io
import os
import re
import subprocess
import sys

import pytest

import gpu_check
from harness import ROOT


def dry_run(gpus):
    out = subprocess.run([sys.executable, "tests/gpu_check.py", "--dry-run", "--gpus", str(gpus)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_dry_run_on_8_gpus_has_a_nccl_row_for_every_file_and_an_equality_row_each():
    lines = dry_run(8)
    torchrun = [ln for ln in lines if "torchrun --standalone --nproc_per_node=" in ln]
    for name in ("ddp.py", "fsdp2.py", "tensor_parallel.py", "pipeline.py", "moe_ep.py", "fp8.py", "muon.py",
                 "checkpoint.py"):
        assert any(f" {name} " in ln for ln in torchrun), f"no torchrun row runs {name}: {lines}"
        assert any(ln.startswith("equal") and f" {name} " in ln for ln in lines) or name == "checkpoint.py", name
    wanted = ["--zero 1", "--zero 2", "--replicate 2", "--sequence-parallel --overlap-comm", "--schedule zbh1",
              "--schedule interleaved", "--schedule dualpipev", "--ep 2", "--fail-at"]
    for flag in wanted:
        assert any(flag in ln for ln in torchrun), f"no NCCL row with {flag}"
    assert all("--deterministic" in ln and "--dtype float32" in ln for ln in lines if ln.startswith("equal")), \
        "an equality row without fp32 --deterministic"
    assert any(re.match(r"equal +checkpoint.py resumed on 1 rank: python checkpoint.py", ln) for ln in lines), \
        "no row resumes on 1 rank what 2 ranks saved"
    assert not any("torchrun" in ln for ln in dry_run(1) if not ln.startswith("speed")), \
        "one GPU: NCCL allows one rank per device, so no two-rank row"


def file_flags(name):
    """The flags `python FILE --help` lists (`gpt2.py train --help`), asked in this process: no launch per file."""
    module = importlib.import_module(name[:-3])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        module.run_main(module.train, ["--help"]) if name == "gpt2.py" else module.cli(["--help"])
    assert stop.value.code in (0, None), f"{name} --help exited {stop.value.code}"
    return set(re.findall(r"--[a-z0-9][a-z0-9-]*", out.getvalue()))


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
