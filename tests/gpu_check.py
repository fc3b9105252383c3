"""The one command for a machine with GPUs: does every file run there on NCCL, does it still equal gpt2.py, how fast?

    python tests/gpu_check.py [--out OUT] [--gpus N] [--minutes M]
    python tests/gpu_check.py --dry-run --gpus 8        # the plan: each row, its seconds, the total (no GPU needed)
    python tests/gpu_check.py --dry-run --gpus 8 --json  # {"rows": [{"name", "seconds"}, ...], "total_s", "minutes"}
    python tests/gpu_check.py --smoke --gpus 2          # every equality row on the CPU (gloo, tiny model)

It plans before it runs. Each row is one real run of a file's CLI (torchrun for several ranks) with a time limit, its
`seconds` (the estimate the plan adds up; the file gets it as --timeout too): a row that runs past it has its whole
process group ended (the ranks too, not only torchrun), and a row is started only if its full time is left (else it
is skipped, with a line). The rows, in phases; in a phase, rows run side by side on disjoint GPUs (lanes):
  1. one GPU each: the real block-scaled `_scaled_mm` against fp8.py's emulation (tests/bench_fp8.py
     --scaled-mm-check: forward, dgrad and wgrad layouts, token counts that are and are not multiples of 128) first,
     then the one-process references: gpt2.py, moe_ep.py (plain and DeepSeek's options), muon.py, fp8.py.
  2. speed on one GPU, alone: gpt2.py --model gpt2, bf16 + torch.compile + SDPA, B=16 T=1024 (tokens/s, MFU, peak
     allocated and reserved memory).
  3. two GPUs each (NCCL): ddp.py plain, --zero 1, --zero 2; fsdp2.py; tensor_parallel.py --tp 2 plain and with
     --sequence-parallel --overlap-comm; pipeline.py, each --schedule; checkpoint.py saved on 2 ranks (one dies,
     --fail-at), then resumed on 1 from the last commit that exists (the row says which): each against gpt2.py's
     losses. moe_ep.py --ep 2 (both), muon.py and fp8.py: each against its one-rank run, same global batch.
  4. four GPUs: fsdp2.py --replicate 2 (HSDP).   5. every GPU: ddp.py, fsdp2.py and fp8.py at 124M (eager).
Equality rows run fp32 with --deterministic (TF32 off, deterministic kernels, math attention), tiny model, 20 steps,
and pass within their row's tolerance (relative, on every step's loss), printed with its reason: 1e-5 where only
the order of a sum differs; wider where rounding is discrete (fp8's e4m3, muon's bf16 Newton-Schulz, moe's top-k).
One table, OUT/gpu_check.json, and a last line: PASS, or FAIL with the rows that failed, timed out or were skipped
(exit 1). With one GPU only the one-GPU rows run. The data is random tokens (no network). The device is read in a
subprocess (this process never opens a CUDA context). Goals, not measurements (no GPU has run this yet): MFU >= 50%
at 124M with compile, flash attention, every equality row within its tolerance.
"""
import argparse
import ast
import concurrent.futures
import contextlib
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# A row's seconds: launch (python + torch import, NCCL set-up) and its steps, with room for a busy machine.
SECONDS = {"check": 90, "tiny 1": 45, "tiny 2": 60, "tiny 4": 75, "compile 124M": 300, "eager 124M": 150}
# Tolerance (relative, every step's loss) of an equality row, and why.
EXACT = (1e-5, "fp32 --deterministic, same global batch: only the order of the gradient mean's sum differs "
               "(~1e-7 a step)")
FP8 = (1e-4, "e4m3 keeps 3 mantissa bits: a last-bit difference in a weight can flip one element's rounding by one "
             "e4m3 step (1/8 of it), ~1e-5 of the loss a flip (the README's fp8 curve moves 1.3e-5 between two CPUs)")
MOE = (1e-3, "top-k near-ties: a last-bit difference can send one of a step's 512 tokens to its next expert, ~1e-4 "
             "of the mean loss a flip; a gradient off by the world size or a token lost in the exchange moves it more")
MUON_BF16 = (1e-3, "Newton-Schulz iterates in bf16 on CUDA (unit roundoff 2^-9): a last-bit difference in the mean "
                   "gradient can flip roundings of the orthogonalised update")


def muon_tolerance():
    """Exact when muon.py runs Newton-Schulz in fp32 under --deterministic (its newton_schulz reads the flag)."""
    with open(os.path.join(ROOT, "muon.py")) as f:
        tree = ast.parse(f.read())
    ns = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "newton_schulz"), None)
    if ns is not None and "deterministic" in ast.unparse(ns):
        return 1e-5, "exact: muon.py runs Newton-Schulz in fp32 under --deterministic"
    return MUON_BF16


def plan(gpus, data, out, smoke=False):
    """The rows for `gpus` GPUs, in run order: [{"row", "nproc", "argv" (file and flags), "kind", "ref", "out",
    "seconds", "phase", "tol", "why"}]. kind "ref" rows produce the losses "equal" rows are compared with; "speed"
    rows report step time; the "crash" row is meant to die (checkpoint.py --fail-at) and the row after it resumes
    (its "after": a row of the same lane, run after it)."""
    device = ["--device", "cpu"] if smoke else ["--device", "cuda", "--deterministic"]
    steps = "6" if smoke else "20"
    eq = ["--model", "tiny", "--seq-len", "64", "--steps", steps, "--eval-every", "0", "--warmup", "2",
          "--dtype", "float32", "--data", data, *device]
    rows = []

    def row(name, nproc, argv, kind, ref=None, seconds=None, phase=None, tol=EXACT, **extra):
        d = os.path.join(out, name_dir(name))
        seconds = (seconds or SECONDS[f"tiny {nproc}"]) * (4 if smoke else 1)  # the CPU (gloo) is slower
        if argv[0].endswith(".py") and not argv[0].startswith("tests/"):
            argv = argv + ["--out", d, "--timeout", str(seconds)]  # a hung collective ends within the row
        rows.append({"row": name, "nproc": nproc, "argv": argv, "kind": kind, "ref": ref, "out": d,
                     "seconds": seconds, "phase": phase or f"{nproc} GPU", "tol": tol[0], "why": tol[1], **extra})
        return rows[-1]

    fp8_path = {} if smoke else {"expect": "fp8 GEMM: blockwise (sm_90", "forbid": "failed"}  # a silent fallback
    # 1. one GPU each: the real block-scaled GEMM first, then the one-process references (global batch 8)
    if not smoke:
        row("fp8 block-scaled _scaled_mm", 1, ["tests/bench_fp8.py", "--scaled-mm-check"], "check",
            seconds=SECONDS["check"])["out"] = None
    row("gpt2.py fp32 B=8", 1, ["gpt2.py", "train", *eq, "--batch-size", "8"], "ref")
    deepseek = ["--gate", "sigmoid", "--balance", "bias", "--shared-expert", "--dispatch", "rank"]
    row("moe_ep.py 1 rank", 1, ["moe_ep.py", *eq, "--batch-size", "8", "--ep", "1"], "ref")
    row("moe_ep.py 1 rank, DeepSeek options", 1, ["moe_ep.py", *eq, "--batch-size", "8", "--ep", "1", *deepseek], "ref")
    row("muon.py 1 rank", 1, ["muon.py", *eq, "--batch-size", "8"], "ref")
    row("fp8.py 1 rank", 1, ["fp8.py", *eq, "--batch-size", "8"], "ref", **fp8_path)
    fast = ["--model", "gpt2", "--batch-size", "16", "--seq-len", "1024", "--device", "cuda", "--data", data,
            "--eval-every", "0", "--warmup", "5", "--lr", "6e-4", "--steps", "30"]
    # 2. speed on one GPU, alone
    if not smoke:
        row("gpt2.py 124M speed", 1, ["gpt2.py", "train", *fast, "--compile"], "speed",
            seconds=SECONDS["compile 124M"], phase="speed 1 GPU")
    # 3. two GPUs each (NCCL), global batch 8: 2 data-parallel ranks x 4, or one model-parallel pair x 8
    if gpus >= 2:
        gpt = "gpt2.py fp32 B=8"
        for name, argv in (("ddp.py", ["ddp.py", "--batch-size", "4"]),
                           ("ddp.py --zero 1", ["ddp.py", "--batch-size", "4", "--zero", "1"]),
                           ("ddp.py --zero 2", ["ddp.py", "--batch-size", "4", "--zero", "2"]),
                           ("fsdp2.py", ["fsdp2.py", "--batch-size", "4"]),
                           ("tensor_parallel.py --tp 2", ["tensor_parallel.py", "--tp", "2", "--batch-size", "8"]),
                           ("tensor_parallel.py --tp 2 SP + overlap", ["tensor_parallel.py", "--tp", "2", "--batch-size",
                                                                       "8", "--sequence-parallel", "--overlap-comm"])):
            row(name, 2, [*argv[:1], *eq, *argv[1:]], "equal", gpt)
        for schedule in ("gpipe", "1f1b", "zbh1", "interleaved", "dualpipe", "dualpipev"):
            extra = ["--virtual-stages", "2"] if schedule == "interleaved" else []
            row(f"pipeline.py --schedule {schedule}", 2, ["pipeline.py", *eq, "--batch-size", "8", "--schedule",
                                                          schedule, *extra], "equal", gpt)
        ckpt = os.path.join(out, "ckpt_dir")
        half = str(int(steps) // 2)  # saved at step `half`, the last rank dies 2 steps later, one rank resumes
        crash = row("checkpoint.py 2 ranks, saves, dies", 2, ["checkpoint.py", *eq, "--batch-size", "4", "--ckpt-dir",
                                                              ckpt, "--save-every", half, "--fail-at", str(int(half) + 2)],
                    "crash")
        resume = row("checkpoint.py resumed on 1 rank", 1, ["checkpoint.py", *eq, "--batch-size", "8", "--ckpt-dir",
                                                            ckpt, "--save-every", half], "equal", gpt, phase="2 GPU",
                     after=crash["row"], ckpt_dir=ckpt)
        at = resume["argv"].index("--out") + 1
        resume["argv"][at] = resume["out"] = crash["out"]  # the same --out: the resumed run continues its metrics
        for name, extra in (("moe_ep.py --ep 2", []), ("moe_ep.py --ep 2, DeepSeek options", deepseek)):
            row(name, 2, ["moe_ep.py", *eq, "--batch-size", "4", "--ep", "2", *extra], "equal",
                name.replace("--ep 2", "1 rank"), tol=MOE)
        row("muon.py 2 ranks", 2, ["muon.py", *eq, "--batch-size", "4"], "equal", "muon.py 1 rank", tol=muon_tolerance())
        row("fp8.py 2 ranks", 2, ["fp8.py", *eq, "--batch-size", "4"], "equal", "fp8.py 1 rank", tol=FP8, **fp8_path)
    # 4. four GPUs
    if gpus >= 4:
        row("fsdp2.py --replicate 2 (HSDP, 4 ranks)", 4, ["fsdp2.py", *eq, "--batch-size", "2", "--replicate", "2"],
            "equal", "gpt2.py fp32 B=8")
    # 5. every GPU, one row at a time (eager: eight ranks compiling at once may outlast any row's time)
    if gpus >= 2 and not smoke:
        for name in ("ddp.py", "fsdp2.py", "fp8.py"):
            row(f"{name} 124M speed, {gpus} GPUs", gpus, [name, *fast], "speed", seconds=SECONDS["eager 124M"],
                phase=f"speed {gpus} GPU")
    return rows


def lanes_of(phase, gpus, smoke):
    """How many rows of `phase` run side by side: one per disjoint set of its GPUs (one on the CPU)."""
    if smoke or phase.startswith("speed"):
        return 1
    return max(1, gpus // int(phase.split()[0]))


def phases(rows):
    """[(phase, [chain of rows])]: the rows grouped by phase, in order; a row with "after" joins its row's chain."""
    out, chains = [], {}
    for r in rows:
        if not out or out[-1][0] != r["phase"]:
            out.append((r["phase"], []))
        if r.get("after") in chains:
            chains[r["after"]].append(r)
            chains[r["row"]] = chains[r["after"]]
        else:
            chains[r["row"]] = [r]
            out[-1][1].append(chains[r["row"]])
    return out


def estimate(rows, gpus, smoke=False):
    """The plan's seconds: per phase, its chains given in order to the first free lane; the phases add up."""
    total = 0
    for phase, chains in phases(rows):
        lanes = [0] * lanes_of(phase, gpus, smoke)
        for chain in chains:
            lanes[lanes.index(min(lanes))] += sum(r["seconds"] for r in chain)
        total += max(lanes)
    return total


def name_dir(name):
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def command(r, shown=False):
    if shown:  # as a person types it
        return ["python", *r["argv"]] if r["nproc"] == 1 else ["torchrun", "--standalone",
                                                               f"--nproc_per_node={r['nproc']}", *r["argv"]]
    if r["nproc"] == 1:
        return [sys.executable, *r["argv"]]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r['nproc']}", *r["argv"]]


def losses(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    return [r for r in recs if "loss" in r and "step" in r]  # the step records (not val, not the summary)


def last_commit(ckpt_dir):
    """The newest step of `ckpt_dir` with a manifest (a commit), or None."""
    steps = [int(re.search(r"step_(\d+)", d).group(1)) for d in glob.glob(os.path.join(ckpt_dir, "step_*"))
             if os.path.exists(os.path.join(d, "manifest.json"))]
    return max(steps) if steps else None


def run_process(cmd, timeout, env):
    """(returncode or None if it timed out, printed text). The command leads its own process group (a new session):
    on time-out the whole group is ended (torchrun's ranks too, which would otherwise spin in NCCL)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        printed = proc.communicate(timeout=timeout)[0]  # read while waiting: a full pipe would stall the row
        return proc.returncode, printed
    except subprocess.TimeoutExpired:
        # SIGTERM first (the files print a line and release --out), then SIGKILL for what is left: a rank blocked
        # in an NCCL wait never runs its Python signal handler
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        try:
            return None, proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:  # a process outside the group holds the pipe
            return None, ""


def run_row(r, env, done):
    """Run one row within its seconds; return its result: ok, step time and memory, and for an equality row the
    largest relative difference from its reference's losses (and the tolerance it was held to)."""
    t0 = time.time()
    res = {"row": r["row"], "cmd": " ".join(command(r, shown=True))}
    expected = None
    if r.get("ckpt_dir"):  # the resume continues from the last commit the crash left, whichever it is
        expected = last_commit(r["ckpt_dir"])
        if expected is None:
            return {**res, "ok": False, "error": f"no commit in {r['ckpt_dir']}: the crash row died before its first "
                                                 f"checkpoint was committed"}
    code, printed = run_process(command(r), r["seconds"], env)
    res["wall_s"] = round(time.time() - t0, 1)
    if code is None:
        return {**res, "ok": False, "timed_out": True,
                "error": f"timed out after {r['seconds']} s: its process group was ended"}
    if r["kind"] == "crash":  # meant to die (--fail-at): the next row resumes from what it committed
        step = last_commit(r["ckpt_dir"] if "ckpt_dir" in r else r["argv"][r["argv"].index("--ckpt-dir") + 1])
        return {**res, "ok": code != 0, "note": f"died; last commit: step {step}",
                **({} if code else {"error": "did not die"})}
    if code != 0:
        err = [ln for ln in printed.splitlines() if ln.strip()]
        return {**res, "ok": False, "error": " | ".join(err[-3:])[-400:]}
    if r.get("expect") and r["expect"] not in printed or r.get("forbid") and r["forbid"] in printed:
        line = next((ln for ln in printed.splitlines() if "fp8 GEMM" in ln), "(no path line)")
        return {**res, "ok": False, "error": f"expected {r['expect']!r}, not {r.get('forbid')!r}: {line}"}
    if expected is not None:
        if f"resumed from step {expected}" not in printed:
            said = next((ln for ln in printed.splitlines() if "resumed from" in ln), "no 'resumed from step' line")
            return {**res, "ok": False, "error": f"expected 'resumed from step {expected}' (the last commit): {said}"}
        res["note"] = f"resumed from step {expected}, the last commit"
    if r["out"] is None:
        return {**res, "ok": True, "stdout_tail": printed[-3000:]}
    recs = losses(r["out"])
    if not recs:
        return {**res, "ok": False, "error": "no metrics.jsonl"}
    steady = recs[len(recs) // 2:]
    res.update(steps=len(recs), step_ms=round(sorted(x["dt_ms"] for x in steady)[len(steady) // 2], 1),
               peak_mem_mb=round(recs[-1]["peak_mem_mb"]), peak_reserved_mb=round(recs[-1].get("peak_reserved_mb", 0)),
               final_loss=round(recs[-1]["loss"], 6), ok=True)
    if recs[-1].get("mfu") is not None:
        res["mfu"] = round(100 * sorted(x["mfu"] for x in steady)[len(steady) // 2], 1)
    if r["kind"] == "equal":
        ref = [x["loss"] for x in losses(done[r["ref"]]["out"])] if r["ref"] in done else []
        ours = [x["loss"] for x in recs]
        if not ref or len(ref) != len(ours):
            return {**res, "ok": False, "error": f"reference {r['ref']!r}: {len(ref)} losses vs {len(ours)}"}
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
        res.update(max_rel_diff=float(f"{worst:.2e}"), tol=r["tol"], ok=worst <= r["tol"])
        if worst > r["tol"]:
            res["error"] = f"max rel diff {worst:.2e} > {r['tol']:g} ({r['why']})"
    return res


PROBE = r'''
import json, torch
info = {"torch": torch.__version__, "visible": torch.cuda.device_count() if torch.cuda.is_available() else 0}
if info["visible"]:
    dev = torch.device("cuda")
    info.update(device=torch.cuda.get_device_name(dev), capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
                cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    try:  # one causal SDPA at GPT-2 124M's shape in bf16 under the profiler: the kernel it launched
        q = torch.randn(16, 12, 1024, 64, device=dev, dtype=torch.bfloat16)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            torch.cuda.synchronize()
        names = " ".join(e.key.lower() for e in prof.key_averages())
        info["sdpa_kernel"] = next((kind for kind, marks in (("flash", ("flash",)), ("cudnn", ("cudnn",)),
                                    ("memory-efficient", ("efficient", "fmha")), ("math", ("softmax", "bmm", "gemm")))
                                    if any(m in names for m in marks)), "unknown")
    except Exception as e:
        info["sdpa_kernel"] = f"error: {e}"
print(json.dumps(info))
'''


def probe():
    """The device, read in a subprocess: this process never opens a CUDA context (under EXCLUSIVE_PROCESS it would
    take GPU 0 from every row's rank 0)."""
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return {"visible": 0, "error": (proc.stderr.strip().splitlines() or ["probe failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def default_minutes(gpus):
    return math.ceil(estimate(plan(gpus, "DATA", "OUT"), gpus) / 60)


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/gpu_check", help="directory for the runs and gpu_check.json")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; --dry-run: 8)")
    p.add_argument("--minutes", type=float, default=None,
                   help="time for all rows (default: the plan's total for --gpus); a row whose seconds no longer fit "
                        "is skipped")
    p.add_argument("--dry-run", action="store_true", help="print the plan for --gpus N and exit (no GPU needed)")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    p.add_argument("--smoke", action="store_true", help="run the equality rows on the CPU (gloo, tiny model)")
    return p


def refuse(what, flag, todo):
    print(f"error: {what} ({flag}): {todo}", file=sys.stderr)
    sys.exit(2)


def summary(results):
    """(ok, one line): PASS, or FAIL naming the rows that failed, timed out or were skipped for time."""
    groups = {"failed": [], "timed out": [], "skipped for time": []}
    for r in results:
        if r.get("skipped"):
            groups["skipped for time"].append(r["row"])
        elif r.get("timed_out"):
            groups["timed out"].append(r["row"])
        elif not r["ok"]:
            groups["failed"].append(r["row"])
    passed = sum(1 for r in results if r["ok"])
    if not any(groups.values()):
        return True, f"gpu_check: PASS: {passed} of {len(results)} rows passed"
    parts = [f"{len(v)} {k} ({', '.join(v)})" for k, v in groups.items() if v]
    return False, f"gpu_check: FAIL: {passed} of {len(results)} passed; " + "; ".join(parts)


def execute(rows, gpus, minutes, smoke, visible_ids=None):
    """Run the plan's phases within `minutes`: a phase's chains side by side, one lane of GPUs each. Returns the
    results in plan order."""
    deadline, done, results, lock = time.time() + 60 * minutes, {}, {}, threading.Lock()
    ids = visible_ids or [str(i) for i in range(gpus)]

    def run_chain(chain, lane_ids):
        env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
        if not smoke:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(lane_ids)
        for r in chain:
            left = deadline - time.time()
            if left < r["seconds"]:
                res = {"row": r["row"], "ok": False, "skipped": True,
                       "error": f"skipped: needs {r['seconds']} s, {max(0, left):.0f} s of --minutes left"}
            else:
                try:
                    res = run_row(r, env, done)
                except Exception as e:  # noqa: BLE001 - a row that cannot be read is a failed row, not a crash
                    res = {"row": r["row"], "ok": False, "error": f"gpu_check could not read the row: {e!r}"}
            with lock:
                done[r["row"]] = r
                results[r["row"]] = res
                print(json.dumps(res), flush=True)

    for phase, chains in phases(rows):
        n = lanes_of(phase, gpus, smoke)
        per = len(ids) // n if not smoke else 0
        lanes = [ids[i * per:(i + 1) * per] for i in range(n)]
        free = list(range(n))
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            def lane_job(chain):
                with lock:
                    lane = free.pop(0)
                try:
                    run_chain(chain, lanes[lane])
                finally:
                    with lock:
                        free.append(lane)
            list(pool.map(lane_job, chains))
    return [results[r["row"]] for r in rows]


def main(argv=None):
    a = parser().parse_args(argv)
    if a.gpus is not None and a.gpus < 1:
        refuse(f"--gpus {a.gpus}", "--gpus", "give a positive number")
    if a.minutes is not None and a.minutes <= 0:
        refuse(f"--minutes {a.minutes:g} leaves no time for any row", "--minutes",
               f"give a positive number; the plan for --gpus {a.gpus or 8} needs {default_minutes(a.gpus or 8)}")
    if a.json and not a.dry_run:
        refuse("--json prints the plan", "--json", "add --dry-run")
    if a.dry_run:
        gpus = a.gpus or 8
        rows = plan(gpus, "DATA", "OUT", a.smoke)
        total = estimate(rows, gpus, a.smoke)
        minutes = a.minutes if a.minutes is not None else math.ceil(total / 60)
        if a.json:
            print(json.dumps({"rows": [{"name": r["row"], "seconds": r["seconds"], "phase": r["phase"],
                                        "tol": r["tol"] if r["kind"] == "equal" else None} for r in rows],
                              "total_s": total, "minutes": minutes}))
            return
        for r in rows:
            cmp = f"  [vs {r['ref']} within {r['tol']:g}]" if r["kind"] == "equal" else ""
            print(f"{r['seconds']:4d} s  {r['phase']:9s} {r['kind']:6s} {r['row']}: "
                  f"{' '.join(command(r, shown=True))}{cmp}")
        fits = "fits" if total <= 60 * minutes else "does NOT fit"
        print(f"total {total} s ({total / 60:.1f} min, rows side by side within a phase) {fits} --minutes {minutes:g}")
        return
    import numpy as np
    import gpt2
    info = {"smoke": True} if a.smoke else probe()
    if not a.smoke and not info.get("visible"):
        refuse(f"no CUDA device here ({info.get('error', 'torch.cuda.is_available() is False')})", "--gpus",
               "run it on a GPU machine (--dry-run prints the plan, --smoke runs the rows on the CPU)")
    gpus = a.gpus or (info["visible"] if not a.smoke else 2)
    if not a.smoke and gpus > info["visible"]:
        refuse(f"--gpus {gpus} but {info['visible']} are visible", "--gpus", "give at most that")
    rows = plan(gpus, os.path.join(a.out, "data"), a.out, a.smoke)
    total = estimate(rows, gpus, a.smoke)
    minutes = a.minutes if a.minutes is not None else math.ceil(total / 60)
    os.makedirs(a.out, exist_ok=True)
    data = os.path.join(a.out, "data")
    rng = np.random.default_rng(0)
    for split, n in (("train", 200_000 if a.smoke else 40_000_000), ("val", 50_000 if a.smoke else 2_000_000)):
        if not os.path.exists(os.path.join(data, f"{split}_000000.bin")):
            gpt2.write_shard(os.path.join(data, f"{split}_000000.bin"), rng.integers(0, 50257, n))
    print(f"## gpu_check: {info} | {len(rows)} rows, planned {total} s, --minutes {minutes:g}", flush=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    results = execute(rows, gpus, minutes, a.smoke, visible.split(",")[:gpus] if visible else None)
    print(f"\n| {'row':40s} | ok | {'max rel diff':>12s} | {'tol':>6s} | {'step ms':>8s} | {'MFU %':>6s} | "
          f"{'peak MB':>8s} | {'reserved':>8s} | note")
    print(f"|{'-' * 42}|----|{'-' * 14}|{'-' * 8}|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 10}|------")
    for r in results:
        note = r.get("error") or r.get("note") or (f"loss {r['final_loss']}" if "final_loss" in r else "")
        ok = "-" if r.get("skipped") else "y" if r["ok"] else "N"
        print(f"| {r['row']:40s} | {ok:2s} | {r.get('max_rel_diff', ''):>12} | {r.get('tol', ''):>6} | "
              f"{r.get('step_ms', ''):>8} | {r.get('mfu', ''):>6} | {r.get('peak_mem_mb', ''):>8} | "
              f"{r.get('peak_reserved_mb', ''):>8} | {note}")
        if r.get("stdout_tail"):
            print(r["stdout_tail"])
    for r in rows:
        if r["kind"] == "equal" and r["tol"] > EXACT[0]:
            print(f"tolerance of {r['row']}: {r['tol']:g}: {r['why']}")
    ok, line = summary(results)
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump({"info": info, "plan_s": total, "minutes": minutes, "rows": results, "summary": line}, f, indent=1)
    print(f"wrote {a.out}/gpu_check.json")
    print(line)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
