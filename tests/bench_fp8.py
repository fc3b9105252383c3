"""Benchmark fp8.py: speed on a GPU, accuracy everywhere.

    torchrun --nproc_per_node=1 tests/bench_fp8.py          (or: python tests/bench_fp8.py)

On a GPU with fp8 tensor cores (sm_89+):
  1. GEMM TFLOP/s at 4096^3 and 8192^3: bf16 torch.matmul; PyTorch's built-in torch._scaled_mm with one
     scale per tensor (fast accumulation: the peak) and one per row; ours (fp8_matmul, 1x128 x 128x128
     tiles) on pre-quantized operands, and including the quantization of both operands (eager, and with
     the quantize functions torch.compile'd into fused kernels).
  2. Fp8Linear forward+backward vs nn.Linear under bf16 autocast (fp32 master weights in both), a 4096-wide
     layer and GPT-2 124M's MLP c_fc (768 -> 3072), 16k tokens; torchao's Float8Linear too if installed.
  3. Our CUDA GEMM vs the CPU emulation on identical fp8 inputs (they must agree).
On CPU (and on a GPU as well): the emulation's accuracy vs fp64 (bf16 / fp8 one scale / fp8 tiles), the
outlier sweep, Fp8Linear's gradient errors vs an fp32 Linear.
"""
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp8  # noqa: E402


def rel_err(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def cuda_time(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def gemm_table(dev):
    print("\n## fp8 GEMM vs bf16 (TFLOP/s, C = A @ B^T, M = N = K)")
    print(f"| {'kernel':58s} | {'4096':>7s} | {'8192':>7s} |")
    print(f"|{'-' * 60}|{'-' * 9}|{'-' * 9}|")
    rows = {}
    q1x128_compiled, q128x128_compiled = torch.compile(fp8.quantize_1x128), torch.compile(fp8.quantize_128x128)
    for n in (4096, 8192):
        a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
        ab, bb = a.bfloat16(), b.bfloat16()
        (aq, sa), (bq, sb) = fp8.quantize_1x128(a), fp8.quantize_128x128(b)
        aq_t, sa_t = fp8.quantize_tensorwise(a)
        bq_t, sb_t = fp8.quantize_tensorwise(b)
        one_a, one_b = sa_t[:1, :1].contiguous().view(()), sb_t[:1, :1].contiguous().view(())
        row_a = sa.amax(1, keepdim=True).contiguous()  # any (M,1)/(1,N) fp32 scales time the same
        row_b = torch.ones(1, n, device=dev)
        flops = 2 * n ** 3
        cases = {
            "bf16 torch.matmul": lambda: ab @ bb.t(),
            "torch._scaled_mm tensor-wise, fast accum (built-in peak)":
                lambda: torch._scaled_mm(aq_t, bq_t.t(), scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16, use_fast_accum=True),
            "torch._scaled_mm row-wise (built-in)":
                lambda: torch._scaled_mm(aq, bq.t(), scale_a=row_a, scale_b=row_b, out_dtype=torch.bfloat16),
            "ours: fp8_matmul 1x128 x 128x128 (pre-quantized)": lambda: fp8.fp8_matmul(aq, sa, bq, sb, torch.bfloat16),
            "ours: quantize both + fp8_matmul":
                lambda: fp8.fp8_matmul(*fp8.quantize_1x128(ab), *fp8.quantize_128x128(bb), torch.bfloat16),
            "ours: torch.compile'd quantize both + fp8_matmul":
                lambda: fp8.fp8_matmul(*q1x128_compiled(ab), *q128x128_compiled(bb), torch.bfloat16),
        }
        for name, fn in cases.items():
            try:
                rows.setdefault(name, []).append(flops / cuda_time(fn) / 1e12)
            except RuntimeError as e:
                rows.setdefault(name, []).append(float("nan"))
                print(f"   ({name} at {n}: {str(e).splitlines()[0][:100]})")
        if n == 4096:  # correctness of the GPU path against the CPU emulation, same fp8 bytes
            got = fp8.fp8_matmul(aq, sa, bq, sb, torch.float32).cpu()
            want = fp8.fp8_matmul(aq.cpu(), sa.cpu(), bq.cpu(), sb.cpu())
            agree = rel_err(got, want)
        del a, b, ab, bb, aq, bq, aq_t, bq_t
        torch.cuda.empty_cache()
    for name, vals in rows.items():
        print(f"| {name:58s} | {vals[0]:7.1f} | {vals[1]:7.1f} |")
    base = rows["bf16 torch.matmul"][1]
    print(f"ours / bf16 at 8192: {rows['ours: fp8_matmul 1x128 x 128x128 (pre-quantized)'][1] / base:.2f}x "
          f"(with quantization {rows['ours: quantize both + fp8_matmul'][1] / base:.2f}x); goal >= 1.5x")
    print(f"GPU fp8_matmul vs CPU emulation, 4096^3, same fp8 inputs: relative difference {agree:.2e}")
    # all three orientations (forward, dgrad through W^T's transposed blocks, wgrad on token tiles), with
    # fp32 output and with bf16 output under autocast (what training uses), against the fp32 CPU emulation
    torch.manual_seed(0)
    lin, x = nn.Linear(768, 3072), torch.randn(1024, 768)
    g = torch.randn(1024, 3072).bfloat16().float()  # bf16-exact, so both devices quantize the same dy

    def fwd_bwd(d, autocast):
        layer = fp8.Fp8Linear.from_linear(nn.Linear(768, 3072, device=d))
        layer.load_state_dict(lin.state_dict())
        xi = x.to(d).requires_grad_()
        with torch.autocast(d.type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(xi)
        y.backward(g.to(d, y.dtype))
        return [t.detach().float().cpu() for t in (y, xi.grad, layer.weight.grad)]

    want = fwd_bwd(torch.device("cpu"), False)
    for autocast in (False, True):
        diffs = [rel_err(a, b) for a, b in zip(fwd_bwd(dev, autocast), want)]
        ok = "PASS" if max(diffs) < 1e-2 else "FAIL (a scale layout is wrong)"
        print(f"Fp8Linear GPU ({'bf16 autocast' if autocast else 'fp32'}) vs CPU emulation: "
              f"y {diffs[0]:.1e} dx {diffs[1]:.1e} dW {diffs[2]:.1e} -> {ok}")
    print(f"block-scaled _scaled_mm used, by (device, out dtype, b in 1x128 rows): {fp8._blockwise_ok}")


def linear_table(dev):
    print("\n## Linear forward+backward under bf16 autocast (fp32 master weights), 16384 tokens")
    print(f"| {'layer':28s} | {'bf16 nn.Linear ms':>17s} | {'Fp8Linear ms':>12s} | {'speedup':>7s} | {'torchao ms':>10s} |")
    print(f"|{'-' * 30}|{'-' * 19}|{'-' * 14}|{'-' * 9}|{'-' * 12}|")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        convert_to_float8_training = None
    for K, N in ((4096, 4096), (768, 3072)):
        x = torch.randn(16384, K, device=dev, requires_grad=True)
        g = torch.randn(16384, N, device=dev, dtype=torch.bfloat16)
        lin = nn.Linear(K, N, device=dev)
        layers = {"bf16": lin, "fp8": fp8.Fp8Linear.from_linear(lin)}
        if convert_to_float8_training is not None:
            layers["torchao"] = convert_to_float8_training(nn.Sequential(nn.Linear(K, N, device=dev)))

        def step(layer):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.backward(g)

        t = {k: cuda_time(lambda m=m: step(m), iters=10) * 1e3 for k, m in layers.items()}
        ao = f"{t['torchao']:10.2f}" if "torchao" in t else f"{'n/a':>10s}"
        print(f"| {f'{K} -> {N}':28s} | {t['bf16']:17.2f} | {t['fp8']:12.2f} | {t['bf16'] / t['fp8']:6.2f}x | {ao} |")


def accuracy_tables():
    torch.manual_seed(0)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    ref = a.double() @ b.double().t()
    print(f"\n## Accuracy of C = A @ B^T vs fp64, {n}^3, randn (CPU emulation: exact fp8 values, fp32 promotion)")
    print("| operands | relative error |\n|---|---|")
    print(f"| bf16 (fp32 accumulate) | {rel_err(a.bfloat16().float() @ b.bfloat16().float().t(), ref):.2e} |")
    print(f"| fp8 e4m3, one scale per tensor | {rel_err(fp8.fp8_matmul(*fp8.quantize_tensorwise(a), *fp8.quantize_tensorwise(b)), ref):.2e} |")
    print(f"| fp8 e4m3, 1x128 x 128x128 tiles (ours) | {rel_err(fp8.fp8_matmul(*fp8.quantize_1x128(a), *fp8.quantize_128x128(b)), ref):.2e} |")
    # PyTorch's built-in fp8 GEMM (torch._scaled_mm runs on CPU too) with one scale per row of a and of b
    sa, sb = a.abs().amax(1, keepdim=True) / fp8.FP8_MAX, b.abs().amax(1, keepdim=True) / fp8.FP8_MAX
    builtin = torch._scaled_mm((a / sa).to(fp8.FP8), (b / sb).to(fp8.FP8).t(), scale_a=sa, scale_b=sb.t().contiguous(),
                               out_dtype=torch.float32)
    print(f"| fp8 e4m3, one scale per row: torch._scaled_mm (built-in) | {rel_err(builtin, ref):.2e} |")

    print("\n## Outlier channel x[:, 7] *= m in dW = dy^T @ x (512 tokens, 256 -> 256): error on the other channels")
    print("| m | one scale per tensor | 1x128 tiles (ours) | ratio |\n|---|---|---|---|")
    for m in (1e1, 1e2, 1e3, 1e4, 1e5, 1e6):
        x, dy = torch.randn(512, 256), torch.randn(512, 256)
        x[:, 7] *= m
        ref = dy.double().t() @ x.double()
        rest = torch.arange(256) != 7
        errs = []
        for quantize in (fp8.quantize_tensorwise, fp8.quantize_1x128):
            y = fp8.fp8_matmul(*quantize(dy.t()), *quantize(x.t()))
            errs.append(rel_err(y[:, rest], ref[:, rest]))
        print(f"| {m:.0e} | {errs[0]:.2e} | {errs[1]:.2e} | {errs[0] / errs[1]:.1f}x |")

    print("\n## Fp8Linear vs fp32 nn.Linear (2048 tokens, 768 -> 3072), relative error; bf16 autocast for scale")
    lin = nn.Linear(768, 3072)
    x, g = torch.randn(2048, 768), torch.randn(2048, 3072)
    outs = {}
    for name, layer, ac in (("fp32", lin, False), ("bf16 autocast", lin, True), ("Fp8Linear", fp8.Fp8Linear.from_linear(lin), False)):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            y = layer(xi)
        y.float().backward(g)
        outs[name] = [y.detach().float(), xi.grad, lin.weight.grad.clone(), lin.bias.grad.clone()]
        lin.zero_grad(set_to_none=True)
    print("| | y | dx | dW | db |\n|---|---|---|---|---|")
    for name in ("bf16 autocast", "Fp8Linear"):
        print(f"| {name} | " + " | ".join(f"{rel_err(o, r):.2e}" for o, r in zip(outs[name], outs["fp32"])) + " |")

    t0 = time.perf_counter()
    for _ in range(3):
        fp8.fp8_matmul(*fp8.quantize_1x128(a), *fp8.quantize_128x128(b))
    t_emu = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    for _ in range(3):
        a @ b.t()
    t_fp32 = (time.perf_counter() - t0) / 3
    print(f"\nCPU emulation speed, {n}^3: quantize + fp8_matmul {t_emu * 1e3:.0f} ms vs fp32 matmul {t_fp32 * 1e3:.0f} ms "
          f"(the emulation proves numerics, not speed)")


if __name__ == "__main__":
    print(f"torch {torch.__version__}")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        print(f"device {torch.cuda.get_device_name(dev)}")
        gemm_table(dev)
        linear_table(dev)
    else:
        print("no GPU with fp8 tensor cores (sm_89+): accuracy of the CPU emulation only")
    accuracy_tables()
