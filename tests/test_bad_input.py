"""Bad input, as a new user types it, across all nine files: each case must end in ONE line
`error: <what> (<flag or file>): <what to do>`, exit code 2, no traceback, nothing written, and no
collective reached (dist.init_process_group is patched to fail the test if a case gets that far).

Most cases call the file's entry point through gpt2.run_main in this process (exactly what each file's
`__main__` runs; one interpreter keeps the suite fast); a few go through the real CLI and torchrun to
prove the once-only printing, the exclusive --out and the launcher watchdog.
`python tests/test_bad_input.py` prints the table: case, exit code, message.
"""
import contextlib
import importlib
import io
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest

for _path in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:  # run as a script too; under pytest --impl DIR, DIR stays first
        sys.path.append(_path)
import gpt2  # noqa: E402
from harness import ROOT, default_sigint, free_port, launch_env, script  # noqa: E402

SMALL = ["--seq-len", "32", "--batch-size", "2", "--steps", "2", "--eval-every", "0"]
W2 = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}

# (file, flags, world env, text the one line must contain). {data} and {tmp} are filled in per case.
CASES = [
    *[(f, ["--steps", "0"], W2 if f in ("fsdp2", "pipeline", "moe_ep") else {}, "(--steps)")
      for f in ("gpt2", "ddp", "fsdp2", "tensor_parallel", "pipeline", "moe_ep", "fp8", "muon", "checkpoint")],
    *[(f, ["--lr", "-1"], W2 if f in ("fsdp2", "pipeline") else {}, "(--lr)")
      for f in ("gpt2", "ddp", "fsdp2", "pipeline", "muon")],
    *[(f, ["--seq-len", "1000"], W2 if f == "fsdp2" else {}, "(--seq-len)") for f in ("gpt2", "ddp", "fsdp2", "fp8")],
    *[(f, ["--data", "{tmp}/nowhere"], W2 if f == "fsdp2" else {}, "(--data)") for f in ("gpt2", "ddp", "fsdp2", "muon")],
    ("gpt2", ["--device", "cuda"], {}, "(--device)"),
    ("ddp", ["--device", "cuda"], {}, "(--device)"),
    ("gpt2", ["--model", "gpt5"], {}, "(--model)"),
    ("ddp", ["--n-head", "3"], {}, "(--n-head)"),
    ("gpt2", ["--batch-size", "0"], {}, "(--batch-size)"),
    ("gpt2", ["--warmup", "-1"], {}, "(--warmup)"),
    ("gpt2", ["--beta2", "1.5"], {}, "(--beta2)"),
    ("gpt2", ["--timeout", "0"], {}, "(--timeout)"),
    ("gpt2", ["--out", "{tmp}/a_file/out"], {}, "(--out)"),
    ("gpt2", ["--init-from", "{tmp}/missing.pt"], {}, "(--init-from)"),
    ("gpt2", ["--init-from", "{tmp}/truncated"], {}, "model.safetensors)"),
    ("gpt2", ["--val-tokens", "1000"], {}, "(--val-tokens)"),
    ("gpt2", [], W2, "(WORLD_SIZE)"),
    ("tensor_parallel", ["--tp", "2", "--grad-accum", "0", "--grad-clip", "0"], W2, "(--grad-accum)"),
    ("tensor_parallel", ["--tp", "2", "--n-head", "3", "--n-embd", "96"], W2, "--tp"),
    ("fsdp2", ["--eval-every", "1", "--eval-steps", "0"], W2, "(--eval-steps)"),
    ("fsdp2", [], {}, "torchrun"),
    ("fsdp2", ["--replicate", "3"], W2, "(--replicate)"),
    ("pipeline", ["--n-layer", "3", "--micro-batches", "2"], W2, "--n-layer"),
    ("moe_ep", ["--ep", "2", "--experts", "3"], W2, "--experts"),
    ("moe_ep", ["--top-k", "9"], {}, "--top-k"),
    ("muon", ["--momentum", "1.0"], {}, "--momentum"),
    ("muon", ["--ns-steps", "0"], {}, "--ns-steps"),
    ("checkpoint", ["--save-every", "1"], {}, "--ckpt-dir"),
    ("checkpoint", ["--ckpt-dir", "{tmp}/a_file/ckpt", "--save-every", "1"], {}, "--ckpt-dir"),
    ("ddp", ["--bucket-mb", "-1"], {}, "--bucket-mb"),
]

# Each file's own rows (issue 25 and later), one block per file.
CASES += [  # gpt2
    ("gpt2", ["--lr", "1e39"], {}, "(--lr)"),
    ("gpt2", ["--weight-decay", "nan"], {}, "(--weight-decay)"),
]

CASES += [  # ddp
    ("ddp", ["--bucket-mb", "inf"], {}, "(--bucket-mb)"),
    ("ddp", ["--bucket-mb", "2e6"], {}, "(--bucket-mb)"),
    ("ddp", ["--overlap-steps", "-1"], {}, "(--overlap-steps)"),
    ("ddp", ["--bucket-mb", "1", "--lr", "nan"], W2, "(--lr)"),
]

CASES += [  # fsdp2
    ("fsdp2", ["--replicate", "0"], W2, "(--replicate)"),
    ("fsdp2", ["--replicate", "4"], W2, "(--replicate)"),
    ("fsdp2", ["--grad-clip", "nan"], W2, "(--grad-clip)"),
    ("fsdp2", ["--reshard-after-forward", "2"], W2, "--reshard-after-forward"),
]

CASES += [  # tensor_parallel
    ("tensor_parallel", ["--tp", "0"], W2, "(--tp)"),
    ("tensor_parallel", ["--tp", "3"], {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}, "(--tp)"),
    ("tensor_parallel", ["--tp", "2", "--sequence-parallel", "--seq-len", "31"], W2, "(--sequence-parallel)"),
    ("tensor_parallel", ["--tp", "2", "--overlap-comm", "--lr", "inf"], W2, "(--lr)"),
]

CASES += [  # pipeline
    ("pipeline", ["--schedule", "interleaved", "--virtual-stages", "3", "--n-layer", "4", "--micro-batches", "2"], W2,
     "(--virtual-stages)"),
    ("pipeline", ["--virtual-stages", "0"], W2, "(--virtual-stages)"),
    ("pipeline", ["--micro-batches", "0"], W2, "(--micro-batches)"),
    ("pipeline", ["--dp", "0"], W2, "(--dp)"),
    ("pipeline", ["--dp", "3"], W2, "(--dp)"),
]

CASES += [  # moe_ep
    ("moe_ep", ["--ep", "0"], {}, "(--ep)"),
    ("moe_ep", ["--aux-coef", "-1"], {}, "(--aux-coef)"),
    ("moe_ep", ["--bias-rate", "-1", "--balance", "bias"], {}, "(--bias-rate)"),
    ("moe_ep", ["--z-loss", "-1"], {}, "(--z-loss)"),
    ("moe_ep", ["--z-loss", "nan"], {}, "(--z-loss)"),
    ("moe_ep", ["--seq-aux-coef", "-1"], {}, "(--seq-aux-coef)"),
    ("moe_ep", ["--capacity-factor", "nan"], {}, "(--capacity-factor)"),
    ("moe_ep", ["--capacity-factor", "-1"], {}, "(--capacity-factor)"),
    ("moe_ep", ["--route-groups", "3", "--groups-per-token", "1"], {}, "(--route-groups)"),
    ("moe_ep", ["--route-groups", "2"], {}, "(--route-groups/--groups-per-token)"),
    ("moe_ep", ["--route-groups", "2", "--groups-per-token", "2"], {}, "(--groups-per-token)"),
]

CASES += [  # fp8
    ("fp8", ["--compare-with", "{tmp}/nowhere"], {}, "(--compare-with)"),
    ("fp8", ["--compare-with", "{tmp}"], W2, "(--compare-with)"),
    ("fp8", ["--nvfp4-recipe", "sr"], {}, "(--nvfp4-recipe)"),
    ("fp8", ["--format", "nvfp4", "--nvfp4-recipe", "hadamard,fast"], {}, "(--nvfp4-recipe)"),
]

CASES += [  # muon
    ("muon", ["--muon-weight-decay", "-0.1"], W2, "(--muon-weight-decay)"),
    ("muon", ["--muon-weight-decay", "100"], {}, "(--muon-weight-decay)"),  # 1 - 0.02 x 100 < 0: flips the weights
    ("muon", ["--momentum", "-0.5"], W2, "(--momentum)"),
    ("muon", ["--momentum", "nan"], {}, "--momentum"),
    ("muon", ["--muon-lr", "0"], {}, "(--muon-lr)"),
    ("muon", ["--muon-lr", "inf"], {}, "--muon-lr"),
    ("muon", ["--momentum-warmup", "-1"], {}, "(--momentum-warmup)"),
    ("muon", ["--qk-clip", "-1"], W2, "(--qk-clip)"),
    ("muon", ["--qk-clip", "nan"], {}, "--qk-clip"),
    ("muon", ["--qk-clip", "50", "--optimizer", "adamw"], {}, "--qk-clip"),
    ("muon", ["--log-max-logit", "--optimizer", "adamw"], {}, "--log-max-logit"),
    ("muon", ["--ns-steps", "1000"], {}, "(--ns-steps)"),
    ("muon", ["--ns-coefficients", "polar_express", "--ns-steps", "6"], {}, "(--ns-steps)"),
    ("muon", ["--log-max-logit", "--compile"], {}, "--log-max-logit"),
]

CASES += [  # checkpoint
    ("checkpoint", ["--keep", "0", "--safe"], {}, "(--keep)"),
    ("checkpoint", ["--ckpt-dir", "{tmp}/ck", "--save-every", "-1"], {}, "(--save-every)"),
    ("checkpoint", ["--fail-at", "-2", "--safe"], {}, "(--fail-at)"),
    ("checkpoint", ["--keep", "3"], {}, "(--keep): add --safe"),
    ("checkpoint", ["--naive", "--safe"], {}, "(--naive)"),
]


def entry(name):
    mod = importlib.import_module(name)
    return getattr(mod, "cli", None) or getattr(mod, "main", None) or mod.train  # cli: the core and its extensions


def prepare_tmp(tmp):
    (tmp / "a_file").write_text("a regular file where a directory is expected")
    hf = tmp / "truncated"
    hf.mkdir()
    (hf / "config.json").write_text('{"n_positions": 32, "vocab_size": 50257, "n_layer": 1, "n_head": 2, "n_embd": 32}')
    (hf / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"wte.weight\": {\"dtype\"")


def one_process(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)


def run_case(case, data, tmp, monkeypatch):
    """Run one case in this process; returns (exit code, what it printed to stderr)."""
    name, flags, env, _ = case
    one_process(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def no_collective(*a, **k):
        raise AssertionError("init_process_group reached: a bad input must be refused before any collective")
    monkeypatch.setattr(gpt2.dist, "init_process_group", no_collective)
    argv = [a.format(data=data, tmp=tmp) for a in
            [*SMALL, "--data", "{data}", "--out", "{tmp}/out_" + name, *flags]]
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out), pytest.raises(SystemExit) as e:
        gpt2.run_main(entry(name), argv)
    return e.value.code, err.getvalue()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_bad_input_is_one_line_before_any_collective(case, random_data, tmp_path, monkeypatch):
    prepare_tmp(tmp_path)
    code, err = run_case(case, random_data, tmp_path, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith("error: ") and case[3] in lines[0] and "): " in lines[0], lines[0]
    assert not os.path.exists(tmp_path / f"out_{case[0]}" / "metrics.jsonl")  # nothing half-written


# The other subcommands of gpt2.py (issue 25): (command, argv, text the one line must contain). {tmp} holds
# tiny.pt (a 1-layer model.pt), moe.pt (a model.pt in moe_ep.py's layout) and the files named below.
SUBCOMMAND_CASES = [
    ("sample", ["--init-from", "{tmp}/tiny.pt", "--temperature", "-1"], "(--temperature)"),
    ("sample", ["--init-from", "{tmp}/tiny.pt", "--num-samples", "0"], "(--num-samples)"),
    ("sample", ["--init-from", "{tmp}/tiny.pt", "--top-k", "-1"], "(--top-k)"),
    ("sample", ["--init-from", "{tmp}/tiny.pt", "--max-new-tokens", "0"], "(--max-new-tokens)"),
    ("sample", ["--init-from", "{tmp}/tiny.pt", "--device", "cuda"], "(--device)"),
    ("sample", ["--init-from", "{tmp}/moe.pt"], "python moe_ep.py sample --init-from"),
    ("export", ["--init-from", "{tmp}/moe.pt", "--out", "{tmp}/hf"], "python moe_ep.py sample --init-from"),
    ("hellaswag", ["--init-from", "{tmp}/tiny.pt", "--file", "{tmp}/empty.txt"], "no examples in the file"),
    ("hellaswag", ["--init-from", "{tmp}/tiny.pt", "--file", "{tmp}/malformed.jsonl"], "line 2 is not a HellaSwag example"),
    ("prepare", ["--text", "{tmp}/missing.txt", "--out", "{tmp}/p"], "(--text)"),
    ("prepare", ["--text", "{tmp}/binary.bin", "--out", "{tmp}/p"], "not UTF-8 text"),
    ("prepare", ["--text", "{tmp}/empty.txt", "--out", "{tmp}/p"], "the file holds no text"),
    ("prepare", ["--text", "{tmp}/good.txt", "--out", "{tmp}/a_file/p"], "(--out)"),
    ("train", ["--init-from", "{tmp}/noconfig", *SMALL], "has no config.json"),
    ("train", ["--init-from", "{tmp}/badconfig", *SMALL], "config.json is not a GPT-2 config"),
]


def prepare_subcommand_tmp(tmp):
    prepare_tmp(tmp)
    torch = gpt2.torch
    torch.manual_seed(0)
    cfg = gpt2.GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    gpt2.save_model(str(tmp / "tiny.pt"), cfg, gpt2.GPT(cfg).state_dict())
    torch.save({"config": cfg.__dict__, "moe": {"experts": 4, "top_k": 2}, "model": {}}, tmp / "moe.pt")
    (tmp / "empty.txt").write_text("")
    ok = '{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 0}'
    (tmp / "malformed.jsonl").write_text(ok + "\n" + '{"ctx": "cut short' + "\n")
    (tmp / "binary.bin").write_bytes(bytes(range(128, 256)))
    (tmp / "good.txt").write_text("To be, or not to be: that is the question.\n" * 20)
    (tmp / "noconfig").mkdir()
    (tmp / "badconfig").mkdir()
    (tmp / "badconfig" / "config.json").write_text('{"n_layer": "twelve"}')


@pytest.mark.parametrize("case", SUBCOMMAND_CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in SUBCOMMAND_CASES])
def test_subcommand_bad_input_is_one_line(case, random_data, tmp_path, monkeypatch):
    prepare_subcommand_tmp(tmp_path)
    command, argv, text = case
    argv = [a.format(tmp=tmp_path) for a in argv]
    if command == "train":
        argv += ["--data", random_data, "--out", str(tmp_path / "out")]
    one_process(monkeypatch)
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out), pytest.raises(SystemExit) as e:
        gpt2.run_main(getattr(gpt2, command), argv)
    lines = err.getvalue().strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, (e.value.code, err.getvalue())
    assert lines[0].startswith("error: ") and text in lines[0] and "): " in lines[0], lines[0]
    assert not (tmp_path / "p").exists() and not (tmp_path / "hf").exists() and not (tmp_path / "out").exists()


def test_sample_greedy_and_empty_prompt(tmp_path, capsys):
    """--temperature 0 is greedy (the same text whatever the seed); an empty prompt starts from <|endoftext|>."""
    prepare_subcommand_tmp(tmp_path)
    texts = []
    for seed in ("1", "2"):
        gpt2.sample(["--init-from", str(tmp_path / "tiny.pt"), "--temperature", "0", "--seed", seed,
                     "--num-samples", "2", "--max-new-tokens", "8", "--device", "cpu"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].count("-" * 40) == 2
    gpt2.sample(["--init-from", str(tmp_path / "tiny.pt"), "--prompt", "", "--num-samples", "1",
                 "--max-new-tokens", "4", "--device", "cpu"])
    assert capsys.readouterr().out.startswith("<|endoftext|>")


def test_a_refused_run_leaves_no_directory(random_data, tmp_path):
    """A run refused after setup (no data) removes the --out directories it created, parents included."""
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()), pytest.raises(SystemExit):
        gpt2.run_main(gpt2.train, [*SMALL, "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "new" / "out")])
    assert "(--data)" in err.getvalue() and not (tmp_path / "new").exists()


def test_ctrl_c_is_one_line_and_exit_130(random_data, tmp_path):
    out = tmp_path / "out"
    run = _start_training(out, random_data)
    try:
        _wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2,
                  90, "two steps")
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert err.count("\n") == 1 and err.startswith("interrupted after step ") and "Traceback" not in err, err
    assert not (out / "LOCK").exists()


def test_error_is_printed_once_by_torchrun_and_without_traceback(random_data, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           script("ddp.py"), *SMALL, "--data", random_data, "--out", str(tmp_path), "--lr", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=launch_env())
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode != 0 and ours == ["error: --lr is 0.0 (--lr): give a positive learning rate (GPT-2 124M: 6e-4)"]
    assert 'File "' + os.path.join(ROOT, script("ddp.py")) not in proc.stderr  # torchrun's own summary may follow


def test_prepare_fineweb_edu_offline_is_one_line(tmp_path, monkeypatch):
    """Offline, `prepare fineweb-edu` gives the same kind of hint as the other corpora (no network here:
    the hub call is replaced by the ConnectionError datasets raises offline)."""
    import datasets  # a requirement: prepare fineweb-edu imports it inside the command

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as e:
        gpt2.run_main(gpt2.prepare, ["fineweb-edu", "--out", str(tmp_path / "fwe")])
    assert e.value.code == 2 and err.getvalue().count("\n") == 1, err.getvalue()
    assert err.getvalue().startswith("error: could not reach HuggingFaceFW/fineweb-edu (ConnectionError) (fineweb-edu): ")
    assert not (tmp_path / "fwe").exists()


def _start_training(out, data, extra=()):
    cmd = [sys.executable, "gpt2.py", "train", *SMALL[:4], "--steps", "100000", "--eval-every", "0",
           "--data", data, "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=launch_env(), preexec_fn=default_sigint)


def _wait_for(pred, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_second_run_in_the_same_out_is_refused_and_a_stale_lock_is_taken(random_data, tmp_path):
    out = tmp_path / "out"
    first = _start_training(out, random_data)
    try:
        _wait_for(lambda: (out / "metrics.jsonl").exists(), 90, "the first run's first step")
        second = subprocess.run([sys.executable, "gpt2.py", "train", *SMALL, "--data", random_data, "--out", str(out)],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"error: {out} is in use by another run (pid {first.pid} on " in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.wait(timeout=30)
    # the SIGKILLed run left its LOCK behind; its pid is dead, so the next run takes the lock over, once the
    # killed run's metrics are gone (a directory never mixes two runs: while they are there it is refused)
    assert (out / "LOCK").read_text().split()[1] == str(first.pid)
    again = subprocess.run([sys.executable, "gpt2.py", "train", *SMALL, "--data", random_data, "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and f"error: {out} holds an earlier run (metrics.jsonl) (--out): " in again.stderr
    (out / "metrics.jsonl").unlink()
    third = subprocess.run([sys.executable, "gpt2.py", "train", *SMALL, "--data", random_data, "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr[-2000:]
    assert not (out / "LOCK").exists()  # released at exit


def test_rank_stops_when_its_launcher_dies(random_data, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
           script("ddp.py"), *SMALL[:4], "--steps", "100000", "--eval-every", "0", "--data", random_data, "--out", str(out)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=launch_env(), start_new_session=True)
    try:
        _wait_for(lambda: (out / "metrics.jsonl").exists(), 90, "the first step")
        worker = int((out / "LOCK").read_text().split()[1])
        launcher.send_signal(signal.SIGKILL)  # torchrun killed alone: its worker is re-parented
        launcher.wait(timeout=10)

        def gone():
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                return True
            with open(f"/proc/{worker}/stat") as f:
                return f.read().split()[2] == "Z"
        _wait_for(gone, 15, "the orphaned rank to stop")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


# The tools under tests/ that a user types too (issue 36): (script, flags, text the one line must contain)
TOOL_CASES = [
    ("tests/exercise.py", ["--out", "{tmp}/mine"], "(FILE)"),
    ("tests/exercise.py", ["--core"], "(FILE)"),
    ("tests/gpu_check.py", ["--minutes", "0"], "(--minutes)"),
    ("tests/gpu_check.py", ["--minutes", "-1", "--dry-run"], "(--minutes)"),
]


@pytest.mark.parametrize("case", TOOL_CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in TOOL_CASES])
def test_tool_bad_input_is_one_line_and_exit_2(case, tmp_path):
    script, flags, where = case
    proc = subprocess.run([sys.executable, script, *[f.format(tmp=tmp_path) for f in flags]], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and where in lines[0], \
        f"{script} {' '.join(flags)}: exit {proc.returncode}, stderr {proc.stderr[-500:]!r}"
    assert not (tmp_path / "mine").exists(), "a refused run wrote its directory"


if __name__ == "__main__":  # the table for a closing note: case, exit code, message
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        data = d / "data"
        data.mkdir()
        import numpy as np
        rng = np.random.default_rng(0)
        gpt2.write_shard(str(data / "train_000000.bin"), rng.integers(0, 50257, 20_000))
        gpt2.write_shard(str(data / "val_000000.bin"), rng.integers(0, 50257, 5_000))
        print("| file | flags | exit | message |\n|---|---|---|---|")
        for i, case in enumerate(CASES):
            tmp = d / f"case{i}"
            tmp.mkdir()
            prepare_tmp(tmp)
            mp = pytest.MonkeyPatch()
            try:
                code, err = run_case(case, str(data), tmp, mp)
            except BaseException as e:  # noqa: BLE001 - a failing case is a row, not a crash of the table
                code, err = "-", f"{e.__class__.__name__}: {e}"
            finally:
                mp.undo()
            msg = err.strip().replace(str(tmp), "TMP").replace(str(data), "DATA").replace("|", "/")
            print(f"| {case[0]} | {' '.join(case[1]).replace(str(tmp), 'TMP')} | {code} | {msg} |")
