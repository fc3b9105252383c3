"""The one command for a machine with a GPU: does every file run there, and how fast?

    python tests/gpu_check.py [--out OUT] [--minutes 8]

Each row is one real run of a file's CLI, in its own process with its own time limit; a row that fails
is printed with its error, it does not stop the others. One table, and OUT/gpu_check.json.
  1. gpt2.py train --model gpt2, bf16 + torch.compile + SDPA, B=16 T=1024: tokens/s, MFU, peak memory,
     and the SDPA kernel the profiler saw (flash, memory-efficient, cuDNN or math).
  2. Each technique at one rank on NCCL where one rank is meaningful (ddp, fp8 --fp8 on, muon, moe_ep
     --ep 1, checkpoint save + resume): step time and peak memory. fsdp2, tensor_parallel and pipeline
     need two GPUs (NCCL refuses two ranks on one device); they are listed as such.
  3. tests/bench_fp8.py --scaled-mm-check: the real block-scaled `_scaled_mm` (no fallback) vs the emulation
     in fp8.py's forward/dgrad/wgrad layouts; tests/bench_fp8.py: fp8 vs
     bf16 GEMM TFLOP/s at 4096 and 8192, Fp8Linear fwd+bwd vs nn.Linear.
What good looks like on one H100 SXM / H200 (goals: no GPU has run this file yet): MFU >= 50% for
GPT-2 124M at B=16, T=1024 with compile, the flash kernel, ~1.5x fp8 over bf16 GEMM at 8192.
The data is random tokens (speed does not depend on the text): the machine needs no network.
On a machine without CUDA it says so in one line and exits 0; `--smoke` runs every row on the CPU with
the tiny model instead, to check the commands themselves.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import gpt2  # noqa: E402


def sdpa_kernel_used(device):
    """Run one causal SDPA at GPT-2 124M's shape in bf16 under the profiler; name the kernel it launched."""
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


def run_row(name, cmd, out, timeout):
    """Run one CLI; return its last metrics record (plus wall time), or the error that ended it."""
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"row": name, "ok": False, "error": f"timed out after {timeout} s"}
    row = {"row": name, "wall_s": round(time.time() - t0, 1), "cmd": " ".join(cmd[1:])}
    if proc.returncode != 0:
        err = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        return {**row, "ok": False, "error": " | ".join(err[-3:])[-400:]}
    path = os.path.join(out, "metrics.jsonl")
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            recs = [json.loads(line) for line in f if '"loss"' in line]
    if not recs:
        return {**row, "ok": True, "stdout_tail": proc.stdout[-2000:]}
    steady = recs[len(recs) // 2:] or recs  # skip the compile and warm-up steps
    dt = sorted(r["dt_ms"] for r in steady)[len(steady) // 2]
    last = recs[-1]
    return {**row, "ok": True, "steps": len(recs), "step_ms": round(dt, 1),
            "tok_per_s": round(last["tokens"] / (last["step"] + 1) / dt * 1e3),
            "mfu": None if last.get("mfu") is None else round(100 * sorted(r["mfu"] for r in steady)[len(steady) // 2], 1),
            "peak_mem_mb": round(last["peak_mem_mb"]), "final_loss": round(last["loss"], 4)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/gpu_check", help="directory for the runs and gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="on a machine without CUDA: every row on the CPU, tiny model")
    p.add_argument("--row-timeout", type=int, default=150, help="seconds each row may take")
    a = p.parse_args()
    if not torch.cuda.is_available() and not a.smoke:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine "
              "(or pass --smoke to check the commands on the CPU)")
        return
    os.makedirs(a.out, exist_ok=True)
    data = os.path.join(a.out, "data")
    rng = np.random.default_rng(0)
    for split, n in (("train", 40_000_000 if not a.smoke else 200_000), ("val", 2_000_000 if not a.smoke else 50_000)):
        if not os.path.exists(os.path.join(data, f"{split}_000000.bin")):
            gpt2.write_shard(os.path.join(data, f"{split}_000000.bin"), rng.integers(0, 50257, n))
    if a.smoke:
        size = ["--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--device", "cpu"]
        steps, fast = 4, []
    else:
        size = ["--model", "gpt2", "--batch-size", "16", "--seq-len", "1024", "--device", "cuda"]
        steps, fast = 30, ["--compile"]
    common = [*size, "--data", data, "--eval-every", "0", "--warmup", "5", "--lr", "6e-4"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]

    def out(name):
        return os.path.join(a.out, name)

    rows, info = [], {"torch": torch.__version__}
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        info.update(device=torch.cuda.get_device_name(dev), capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
                    peak_bf16_tflops=(gpt2.peak_flops(torch.cuda.get_device_name(dev)) or 0) / 1e12,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            info["sdpa_kernel"] = sdpa_kernel_used(dev)
        except Exception as e:  # noqa: BLE001 - a row, not a crash
            info["sdpa_kernel"] = f"error: {e}"
    plan = [
        ("gpt2.py train (bf16, compile)", [sys.executable, "gpt2.py", "train", *common, "--steps", str(steps), *fast,
                                          "--out", out("gpt2")], out("gpt2")),
        ("ddp.py, 1 rank NCCL", [*torchrun, "ddp.py", *common, "--steps", str(steps), *fast, "--out", out("ddp")], out("ddp")),
        ("fp8.py --fp8 on, 1 rank", [*torchrun, "fp8.py", *common, "--steps", str(steps), "--fp8", "on",
                                     "--out", out("fp8")], out("fp8")),
        ("muon.py, 1 rank", [*torchrun, "muon.py", *common, "--steps", str(steps), "--out", out("muon")], out("muon")),
        ("moe_ep.py --ep 1", [*torchrun, "moe_ep.py", *common, "--steps", str(steps), "--ep", "1",
                              "--out", out("moe")], out("moe")),
        # --max-restarts 1 and --fail-at: the rank dies after step 12, torchrun restarts it, it resumes from step 10
        ("checkpoint.py save, crash, resume", [*torchrun, "--max-restarts=1", "checkpoint.py", *common, "--steps",
                                               str(steps), "--save-every", "5", "--fail-at", "12",
                                               "--ckpt-dir", out("ckpt_dir"), "--out", out("ckpt")], out("ckpt")),
    ]
    for name, cmd, path in plan:
        rows.append(run_row(name, cmd, path, a.row_timeout))
        print(json.dumps(rows[-1]), flush=True)
    for name in ("fsdp2.py", "tensor_parallel.py", "pipeline.py"):
        rows.append({"row": name, "ok": None, "error": "needs >= 2 GPUs (NCCL allows one rank per device)"})
    if torch.cuda.is_available():  # the real block-scaled call against the emulation (the CPU tests use a mock)
        r = run_row("fp8 block-scaled _scaled_mm", [sys.executable, "tests/bench_fp8.py", "--scaled-mm-check"],
                    out("none"), a.row_timeout)
        rows.append(r)
        print(r.get("stdout_tail", json.dumps(r)), flush=True)
        r = run_row("bench_fp8.py", [sys.executable, "tests/bench_fp8.py"], out("none"), 2 * a.row_timeout)
        rows.append(r)

    print(f"\n## gpu_check: {info}")
    print(f"| {'row':32s} | ok | {'step ms':>8s} | {'tok/s':>9s} | {'MFU %':>6s} | {'peak MB':>8s} | note")
    print(f"|{'-' * 34}|----|{'-' * 10}|{'-' * 11}|{'-' * 8}|{'-' * 10}|------")
    for r in rows:
        note = r.get("error") or (f"loss {r['final_loss']}" if "final_loss" in r else "")
        print(f"| {r['row']:32s} | {'-' if r['ok'] is None else 'y' if r['ok'] else 'N':2s} | {r.get('step_ms', ''):>8} | "
              f"{r.get('tok_per_s', ''):>9} | {r.get('mfu', '') if r.get('mfu') is not None else '':>6} | "
              f"{r.get('peak_mem_mb', ''):>8} | {note}")
    if rows[-1]["row"] == "bench_fp8.py" and rows[-1].get("stdout_tail"):
        print("\n" + rows[-1]["stdout_tail"])
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}/gpu_check.json")


if __name__ == "__main__":
    main()
