"""The one command for a machine with GPUs: does every file run there on NCCL, does it still equal gpt2.py, how fast?

    python tests/gpu_check.py [--out OUT] [--minutes 12] [--gpus N]
    python tests/gpu_check.py --dry-run --gpus 8     # the rows it would run, without a GPU
    python tests/gpu_check.py --smoke --gpus 2       # every equality row on the CPU (gloo), tiny model, to check the commands

Each row is one real run of a file's CLI (torchrun for several ranks), in its own process with its own time limit;
a row that fails is printed with its error and does not stop the others. One table, and OUT/gpu_check.json.
Rows, in this order, until --minutes runs out (the rest are listed as skipped):
  1. equality (fp32, --deterministic: TF32 off, deterministic kernels, math attention; tiny model, 20 steps):
     gpt2.py in one process, then with 2 GPUs on NCCL: ddp.py plain, --zero 1, --zero 2; fsdp2.py (and
     --replicate 2 on 4 GPUs); tensor_parallel.py --tp 2 plain and with --sequence-parallel --overlap-comm;
     pipeline.py, each --schedule; checkpoint.py saved on 2 ranks (one dies, --fail-at) and resumed on 1: each
     against gpt2.py's losses. moe_ep.py --ep 2 (plain and with DeepSeek's options), muon.py and fp8.py on 2 ranks:
     each against its own one-rank run with the same global batch. A row passes within 1e-5 (relative).
  2. speed: gpt2.py train --model gpt2, bf16 + torch.compile + SDPA, B=16 T=1024 on one GPU (tokens/s, MFU, peak
     allocated and reserved memory, the SDPA kernel the profiler saw); ddp.py, fsdp2.py and fp8.py at 124M on
     every GPU.
  3. fp8: tests/bench_fp8.py --scaled-mm-check (the real block-scaled `_scaled_mm` vs fp8.py's emulation in the
     forward, dgrad and wgrad layouts, token counts that are and are not multiples of 128).
With one GPU only the one-process and one-rank rows run (NCCL allows one rank per device). The data is random
tokens (no network). Goals, not measurements (no GPU has run this yet): MFU >= 50% at 124M with compile, flash
attention, every equality row within 1e-5.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EQUAL_TOL = 1e-5


def plan(gpus, data, out, smoke=False):
    """The rows for `gpus` GPUs: [{"row", "nproc", "argv" (file and flags), "kind", "ref", "out"}], in run order.
    kind "ref" rows produce the losses "equal" rows are compared with; "speed" rows report step time; a "crash" row
    is meant to die (checkpoint.py --fail-at) and the row after it resumes."""
    device = ["--device", "cpu"] if smoke else ["--device", "cuda", "--deterministic"]
    steps = "6" if smoke else "20"
    eq = ["--model", "tiny", "--seq-len", "64", "--steps", steps, "--eval-every", "0", "--warmup", "2",
          "--dtype", "float32", "--data", data, *device]
    rows = []

    def row(name, nproc, argv, kind, ref=None):
        rows.append({"row": name, "nproc": nproc, "argv": argv + ["--out", os.path.join(out, name_dir(name))],
                     "kind": kind, "ref": ref, "out": os.path.join(out, name_dir(name))})

    # 1. equality. Global batch 8 everywhere: 2 data-parallel ranks x 4, or one model-parallel pair x 8.
    row("gpt2.py fp32 B=8", 1, ["gpt2.py", "train", *eq, "--batch-size", "8"], "ref")
    for name, extra in (("moe_ep.py 1 rank", []),
                        ("moe_ep.py 1 rank, DeepSeek options", ["--gate", "sigmoid", "--balance", "bias",
                                                                "--shared-expert", "--dispatch", "rank"])):
        row(name, 1, ["moe_ep.py", *eq, "--batch-size", "8", "--ep", "1", *extra], "ref")
    row("muon.py 1 rank", 1, ["muon.py", *eq, "--batch-size", "8"], "ref")
    row("fp8.py 1 rank", 1, ["fp8.py", *eq, "--batch-size", "8"], "ref")
    if not smoke:  # the fast path must be the one that ran: a silent row-wise fallback would pass the equality
        rows[-1].update(expect="fp8 GEMM: blockwise (sm_90", forbid="failed")
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
        row("checkpoint.py 2 ranks, saves, dies", 2, ["checkpoint.py", *eq, "--batch-size", "4", "--ckpt-dir", ckpt,
                                                      "--save-every", half, "--fail-at", str(int(half) + 2)], "crash")
        row("checkpoint.py resumed on 1 rank", 1, ["checkpoint.py", *eq, "--batch-size", "8", "--ckpt-dir", ckpt,
                                                   "--save-every", half], "equal", gpt)
        rows[-1]["argv"][-1] = rows[-2]["out"]  # the same --out: the resumed run continues its metrics
        rows[-1]["out"] = rows[-2]["out"]
        row("moe_ep.py --ep 2", 2, ["moe_ep.py", *eq, "--batch-size", "4", "--ep", "2"], "equal", "moe_ep.py 1 rank")
        row("moe_ep.py --ep 2, DeepSeek options", 2, ["moe_ep.py", *eq, "--batch-size", "4", "--ep", "2", "--gate",
                                                      "sigmoid", "--balance", "bias", "--shared-expert", "--dispatch",
                                                      "rank"], "equal", "moe_ep.py 1 rank, DeepSeek options")
        row("muon.py 2 ranks", 2, ["muon.py", *eq, "--batch-size", "4"], "equal", "muon.py 1 rank")
        row("fp8.py 2 ranks", 2, ["fp8.py", *eq, "--batch-size", "4"], "equal", "fp8.py 1 rank")
        if not smoke:
            rows[-1].update(expect="fp8 GEMM: blockwise (sm_90", forbid="failed")
    if gpus >= 4:
        row("fsdp2.py --replicate 2 (HSDP, 4 ranks)", 4, ["fsdp2.py", *eq, "--batch-size", "2", "--replicate", "2"],
            "equal", "gpt2.py fp32 B=8")
    if smoke:
        return rows
    # 2. speed at 124M (bf16, compile): one GPU, then every GPU
    fast = ["--model", "gpt2", "--batch-size", "16", "--seq-len", "1024", "--device", "cuda", "--data", data,
            "--eval-every", "0", "--warmup", "5", "--lr", "6e-4", "--steps", "30", "--compile"]
    row("gpt2.py 124M speed", 1, ["gpt2.py", "train", *fast], "speed")
    for name in ("ddp.py", "fsdp2.py", "fp8.py") if gpus >= 2 else ():
        row(f"{name} 124M speed, {gpus} GPUs", gpus, [name, *fast], "speed")
    # 3. the real block-scaled GEMM against the emulation
    rows.append({"row": "fp8 block-scaled _scaled_mm", "nproc": 1, "argv": ["tests/bench_fp8.py", "--scaled-mm-check"],
                 "kind": "check", "ref": None, "out": None})
    return rows


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
        return [json.loads(line) for line in f if '"loss"' in line]


def run_row(r, timeout, done):
    """Run one row; return its result: ok, step time and memory, and for an equality row the largest relative
    difference from its reference's losses."""
    t0 = time.time()
    res = {"row": r["row"], "cmd": " ".join(command(r)[1:])}
    try:
        proc = subprocess.run(command(r), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {**res, "ok": False, "error": f"timed out after {timeout:.0f} s"}
    res["wall_s"] = round(time.time() - t0, 1)
    if r["kind"] == "crash":  # meant to die (--fail-at): the next row resumes from what it committed
        return {**res, "ok": proc.returncode != 0, **({} if proc.returncode else {"error": "did not die"})}
    if proc.returncode != 0:
        err = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        return {**res, "ok": False, "error": " | ".join(err[-3:])[-400:]}
    printed = proc.stdout + proc.stderr
    if r.get("expect") and r["expect"] not in printed or r.get("forbid") and r["forbid"] in printed:
        line = next((ln for ln in printed.splitlines() if "fp8 GEMM" in ln), "(no path line)")
        return {**res, "ok": False, "error": f"expected {r['expect']!r}, not {r.get('forbid')!r}: {line}"}
    if r["out"] is None:
        return {**res, "ok": True, "stdout_tail": proc.stdout[-3000:]}
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
        res.update(max_rel_diff=float(f"{worst:.2e}"), ok=worst <= EQUAL_TOL)
    return res


def sdpa_kernel_used(device):
    """Run one causal SDPA at GPT-2 124M's shape in bf16 under the profiler; name the kernel it launched."""
    import torch
    q = torch.randn(16, 12, 1024, 64, device=device, dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
    names = " ".join(e.key.lower() for e in prof.key_averages())
    for kind, marks in (("flash", ("flash",)), ("cudnn", ("cudnn",)), ("memory-efficient", ("efficient", "fmha")),
                        ("math", ("softmax", "bmm", "gemm"))):
        if any(m in names for m in marks):
            return kind
    return "unknown"


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/gpu_check", help="directory for the runs and gpu_check.json")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--minutes", type=float, default=12.0, help="time for all rows; rows that no longer fit are skipped")
    p.add_argument("--row-timeout", type=int, default=240, help="seconds one row may take at most")
    p.add_argument("--dry-run", action="store_true", help="print the rows for --gpus N and exit (no GPU needed)")
    p.add_argument("--smoke", action="store_true", help="run the equality rows on the CPU (gloo, tiny model)")
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    if a.gpus is not None and a.gpus < 1:
        sys.exit(f"error: --gpus {a.gpus} (--gpus): give a positive number")
    if a.dry_run:
        for r in plan(a.gpus or 8, "DATA", "OUT", a.smoke):
            cmp = f"  [vs {r['ref']}]" if r["kind"] == "equal" else ""
            print(f"{r['kind']:6s} {r['row']}: {' '.join(command(r, shown=True))}{cmp}")
        return
    import numpy as np
    import torch
    import gpt2
    if not torch.cuda.is_available() and not a.smoke:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine "
              "(--dry-run lists the rows, --smoke runs them on the CPU)")
        return
    gpus = a.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if torch.cuda.is_available() and gpus > torch.cuda.device_count():
        sys.exit(f"error: --gpus {gpus} but {torch.cuda.device_count()} are visible (--gpus): give at most that")
    os.makedirs(a.out, exist_ok=True)
    data = os.path.join(a.out, "data")
    rng = np.random.default_rng(0)
    for split, n in (("train", 200_000 if a.smoke else 40_000_000), ("val", 50_000 if a.smoke else 2_000_000)):
        if not os.path.exists(os.path.join(data, f"{split}_000000.bin")):
            gpt2.write_shard(os.path.join(data, f"{split}_000000.bin"), rng.integers(0, 50257, n))
    info = {"torch": torch.__version__, "gpus": gpus}
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        info.update(device=torch.cuda.get_device_name(dev), capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
                    cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            info["sdpa_kernel"] = sdpa_kernel_used(dev)
        except Exception as e:  # noqa: BLE001 - a row, not a crash
            info["sdpa_kernel"] = f"error: {e}"
    print(f"## gpu_check: {info}", flush=True)
    deadline, done, results = time.time() + 60 * a.minutes, {}, []
    for r in plan(gpus, data, a.out, a.smoke):
        left = deadline - time.time()
        if left < 20:
            results.append({"row": r["row"], "ok": None, "error": "skipped: --minutes ran out"})
            continue
        res = run_row(r, min(a.row_timeout, left), done)
        done[r["row"]] = r
        results.append(res)
        print(json.dumps(res), flush=True)
    print(f"\n| {'row':40s} | ok | {'max rel diff':>12s} | {'step ms':>8s} | {'MFU %':>6s} | {'peak MB':>8s} | {'reserved':>8s} | note")
    print(f"|{'-' * 42}|----|{'-' * 14}|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 10}|------")
    for r in results:
        note = r.get("error") or (f"loss {r['final_loss']}" if "final_loss" in r else "")
        ok = "-" if r["ok"] is None else "y" if r["ok"] else "N"
        print(f"| {r['row']:40s} | {ok:2s} | {r.get('max_rel_diff', ''):>12} | {r.get('step_ms', ''):>8} | "
              f"{r.get('mfu', ''):>6} | {r.get('peak_mem_mb', ''):>8} | {r.get('peak_reserved_mb', ''):>8} | {note}")
        if r.get("stdout_tail"):
            print(r["stdout_tail"])
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump({"info": info, "rows": results}, f, indent=1)
    print(f"wrote {a.out}/gpu_check.json")
    return results


if __name__ == "__main__":
    main()
