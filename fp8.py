"""
fp8.py - GPT-2's block Linears in fp8, one scale per tile (DeepSeek-V3 section 3.3), data parallel.

fp8 e4m3 keeps 3 mantissa bits and magnitudes 2^-9..448: a tensor is divided by a scale before
the cast. The naive version (--naive) takes one scale per tensor: one outlier pushes every other
value into the subnormals. DeepSeek-V3 gives every 1x128 tile of an activation or gradient and
every 128x128 block of a weight its own scale (amax/448); the GEMM promotes each 128-wide K chunk's
fp8 partial sum to fp32 with its two scales. That is the one difference between the two versions.
The master weights, AdamW, embeddings, LayerNorm, attention and the head stay in high precision.

    forward  y  = x @ W^T    x: 1x128 tiles along K     W: 128x128 blocks of the fp32 master
    dgrad    dx = dy @ W     dy: 1x128 tiles along N    W^T: the same blocks, transposed
    wgrad    dW = dy^T @ x   dy^T, x^T: 1x128 tiles along the tokens (x re-cut from its saved fp8)
      for k in K/128 chunks:   acc(fp32) += (x_fp8[:,k] @ W_fp8[:,k]^T) * sx[:,k] * sW[:,k]
                                             \\_ tensor core, fp8 _/      \\_ promotion to fp32 _/

Who sums what (n data-parallel ranks, each holding the whole model):
    p.grad, every parameter   all_reduce_grads: SUM over the n ranks (one flat fp32 bucket), / n
    --grad-accum k            each micro-batch's loss / k before backward: p.grad sums to their mean
    dW of an fp8 Linear       summed over the step's tokens inside the GEMM, in fp32
    the logged loss           global_mean: SUM over the ranks / n
    the clip norm             each rank's own, after the all-reduce (equal on every rank)

The core's GEMM is an exact emulation (the same fp8 values and scales, fp32 sums, any device).
The run ends with the payoff: block 0's c_attn GEMM error vs fp32, one scale per tensor vs tiles,
as trained and with one token made a x1e5 outlier (a "massive activation"): there tiles win.
Beyond the core: cuBLAS's block-scaled torch._scaled_mm (cli picks it on a GPU), MXFP8 and NVFP4
(--format), --compare-with a --fp8 off run.
    torchrun --nproc_per_node=2 fp8.py --steps 30 --data data/shakespeare_char --out out/fp8
    torchrun --nproc_per_node=2 fp8.py --steps 30 --data data/shakespeare_char --out out/n --naive
prints the losses, then (the figures of the first command, 2 idle cores, ~30 s):
    fp8 GEMM error vs fp32, block 0's c_attn: one scale per tensor 3.58%, tiles 3.55%
    ... token 0 x1e5, the other tokens: one scale per tensor 41.20%, tiles 3.55%
Read first: quantize_tensorwise, quantize_1x128, fp8_matmul, Fp8LinearFn, train. Closed forms: end.
"""
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpt2
from gpt2 import print0

FP8 = torch.float8_e4m3fn  # 1 sign, 4 exponent, 3 mantissa bits; no inf; largest finite 448
FP8_MAX = torch.finfo(FP8).max  # 448.0
TILE = 128  # DeepSeek-V3's tile: 1x128 for activations/gradients, 128x128 for weights
# The smallest amax a tile is scaled from (scale = fp32's smallest normal): subnormals to 2^-135
AMAX_FLOOR = torch.finfo(torch.float32).tiny * FP8_MAX
OUTLIER = 1e5  # the payoff's massive activation: one token's values times this


def _pow2_up(scale):
    """Round up to a power of 2: add 'all mantissa bits set', clear the mantissa (section 3.3.3)."""
    bits = scale.contiguous().view(torch.int32)
    return ((bits + 0x007FFFFF) & 0x7F800000).view(torch.float32)


def _scale_from_amax(amax, pow2):
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return _pow2_up(scale) if pow2 else scale


def _to_fp8(x, scale):  # x / scale can round to 448.0001; some builds cast that to NaN
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _pad_to_tile(x, dims):
    """Zero-pad the given dims of a 2-D tensor to a multiple of 128 (zeros add nothing to GEMMs)."""
    pad = [0, 0, 0, 0]  # F.pad order: (last dim left, right, first dim left, right)
    for d in dims:
        pad[3 - 2 * d] = -x.size(d) % TILE
    return F.pad(x, pad) if any(pad) else x


def dequantize_1x128(x_fp8, scales, shape=None):
    M, Kp = x_fp8.shape
    x = (x_fp8.float().view(M, Kp // TILE, TILE) * scales[..., None]).view(M, Kp)  # (M, Kp)
    return x if shape is None else x[: shape[0], : shape[1]]


# ---- The naive version (--naive): one scale per tensor ----
def quantize_tensorwise(x, pow2=False, blocks=False):
    """One scale for the whole tensor, amax/448, handed to the GEMM as tile scales, all equal:
    (M, Kp/128) as quantize_1x128's, or (Np/128, Kp/128) with blocks, as quantize_128x128's."""
    xp = _pad_to_tile(x.float(), dims=[0, 1] if blocks else [1])
    scale = _scale_from_amax(xp.abs().amax(), pow2)
    rows = xp.size(0) // TILE if blocks else xp.size(0)
    return _to_fp8(xp, scale), scale.expand(rows, xp.size(1) // TILE).contiguous()


# ---- The real version: a scale per 1x128 tile / 128x128 block ----
def quantize_1x128(x, pow2=False):
    """x (M, K) -> x_fp8 (M, Kp) e4m3, row-major even for a transposed x (cuBLAS's first operand
    must be), and scales (M, Kp/128) fp32; Kp = K padded to 128. An outlier spoils only its tile."""
    M, _ = x.shape
    tiles = _pad_to_tile(x.float(), dims=[1]).contiguous().view(M, -1, TILE)  # (M, Kp/128, 128)
    scales = _scale_from_amax(tiles.abs().amax(dim=-1, keepdim=True), pow2)
    return _to_fp8(tiles, scales).view(M, -1), scales.squeeze(-1)


def quantize_128x128(w, pow2=False):
    """w (N, K) -> w_fp8 (Np, Kp), scales (Np/128, Kp/128); backward reuses them transposed."""
    blocks = _pad_to_tile(w.float(), dims=[0, 1])
    Np, Kp = blocks.shape
    blocks = blocks.view(Np // TILE, TILE, Kp // TILE, TILE)  # (N/128, 128, K/128, 128)
    scales = _scale_from_amax(blocks.abs().amax(dim=(1, 3), keepdim=True), pow2)
    return _to_fp8(blocks, scales).view(Np, Kp), scales[:, 0, :, 0]


@torch.compiler.disable  # opaque, like cuBLAS's GEMM; inductor (torch 2.13, CPU) miscompiled it
def fp8_matmul(a_fp8, a_scales, b_fp8, b_scales, out_dtype=torch.float32):
    """a @ b^T for a (M, K) in 1x128 tiles, b (N, K) in 1x128 tiles (scales (N, K/128)) or 128x128
    blocks (scales (ceil(N/128), K/128)), K padded to 128, emulated: e4m3 products are exact in
    fp32; each chunk's 128 are summed in fp32 (the tensor core keeps ~14 bits: an upper bound on its
    accuracy), then scaled and accumulated in fp32."""
    (M, K), N = a_fp8.shape, b_fp8.size(0)
    b_rows = b_scales
    if b_scales.size(0) != N:  # 128x128 blocks: each block's scale repeated over its 128 rows
        b_rows = b_scales.repeat_interleave(TILE, dim=0)[:N]  # (N, K/128)
    acc = torch.zeros(M, N, dtype=torch.float32, device=a_fp8.device)
    for k in range(K // TILE):
        cols = slice(k * TILE, (k + 1) * TILE)
        partial = a_fp8[:, cols].float() @ b_fp8[:, cols].float().t()  # the unscaled chunk product
        acc += partial * a_scales[:, k, None] * b_rows[None, :, k]
    return acc.to(out_dtype)


class Fp8LinearFn(torch.autograd.Function):
    """y = x @ W^T, x in 1x128 tiles (power-of-2 scales), W in 128x128 blocks; saves fp8 x and W.
    The class names its quantizers (tiles, blocks) and its GEMM: the naive version swaps the
    quantizers, Beyond the core swaps the GEMM (cuBLAS)."""
    tiles, blocks = staticmethod(quantize_1x128), staticmethod(quantize_128x128)
    gemm = staticmethod(fp8_matmul)

    @classmethod
    def forward(cls, ctx, x, weight):
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        N, K = weight.shape
        with torch.autocast(dev, enabled=False):  # the promotion stays fp32, whatever autocast says
            x2 = x.reshape(-1, K)  # (B*T, C)
            x_fp8, x_scales = cls.tiles(x2, pow2=True)
            w_fp8, w_scales = cls.blocks(weight)
            y = cls.gemm(x_fp8, x_scales, w_fp8, w_scales, out_dtype)[:, :N]  # (B*T, N)
        ctx.save_for_backward(x_fp8, x_scales, w_fp8, w_scales)
        ctx.shapes, ctx.dtypes = (x.shape, x2.shape, weight.shape), (x.dtype, weight.dtype)
        return y.reshape(*x.shape[:-1], N)  # (B, T, N)

    @classmethod
    def backward(cls, ctx, dy):
        x_fp8, x_scales, w_fp8, w_scales = ctx.saved_tensors
        x_shape, x2_shape, (N, K) = ctx.shapes
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, N)  # (B*T, N)
            # dgrad contracts over N: dy in 1x128 tiles along N; W^T: forward's blocks transposed
            dy_fp8, dy_scales = cls.tiles(dy2)
            dx = cls.gemm(dy_fp8, dy_scales, w_fp8.t(), w_scales.t(), dy.dtype)[:, :K]  # (B*T, C)
            # wgrad contracts over the tokens: both operands re-cut into 1x128 tiles along the
            # tokens, x from its saved fp8 copy (section 3.5.2). Power-of-2 scales make both steps
            # exponent shifts: 0.0002% of values change (99.2% with amax/448; tests: pow2_scales)
            x_hp = dequantize_1x128(x_fp8, x_scales, x2_shape)  # (B*T, C) fp32
            xt_fp8, xt_scales = cls.tiles(x_hp.t(), pow2=True)  # (C, B*T)
            dyt_fp8, dyt_scales = cls.tiles(dy2.t())  # (N, B*T)
            # dW leaves the fp32 accumulator unrounded: the master weights are fp32
            dw = cls.gemm(dyt_fp8, dyt_scales, xt_fp8, xt_scales, torch.float32)  # (N, C)
        x_dtype, w_dtype = ctx.dtypes
        return dx.reshape(x_shape).to(x_dtype), dw.to(w_dtype)


class NaiveFp8LinearFn(Fp8LinearFn):
    """The naive version: the same three GEMMs, every scale the whole tensor's amax/448."""
    tiles = staticmethod(quantize_tensorwise)
    blocks = staticmethod(functools.partial(quantize_tensorwise, blocks=True))


class Fp8Linear(nn.Linear):
    """A drop-in nn.Linear (same parameters and state_dict) whose three matmuls run in fp8 tiles."""
    Function = Fp8LinearFn

    def forward(self, x):
        y = self.Function.apply(x, self.weight)
        # the bias outside the Function, in the output's dtype: autograd sums its gradient in fp32
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        bias = linear.bias is not None
        new = cls(linear.in_features, linear.out_features, bias=bias, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # share the fp32 master parameters
        return new


class NaiveFp8Linear(Fp8Linear):
    Function = NaiveFp8LinearFn


def convert_to_fp8(model: gpt2.GPT, Linear=Fp8Linear):
    """Swap the four Linears of every block for Linear.from_linear(linear); embeddings, LayerNorms,
    attention's softmax and the tied head stay in high precision (DeepSeek-V3 section 3.3)."""
    for block in model.h:
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"),
                             (block.mlp, "c_fc"), (block.mlp, "c_proj")):
            setattr(parent, name, Linear.from_linear(getattr(parent, name)))
    return model


def all_reduce_grads(params, world, comm: gpt2.CommMeter):
    """Sum every rank's gradients in one flat fp32 bucket, / world: the global mean's gradient."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    comm.all_reduce(flat.numel() * flat.element_size(), world)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def global_mean(t, world, comm: gpt2.CommMeter):
    dist.all_reduce(t)
    comm.all_reduce(t.numel() * t.element_size(), world)
    return t / world


def gemm_error(x, w, quantize_x, quantize_w, rows):
    """Relative error of the fp8 GEMM x @ w^T against fp32 over the given rows of the output."""
    ref = x[rows] @ w.t()  # (rows, N)
    y = fp8_matmul(*quantize_x(x), *quantize_w(w))[rows, : w.size(0)]
    return ((y - ref).norm() / ref.norm()).item()


@torch.no_grad()
def tiles_vs_one_scale(model, idx):
    """The payoff, on this run's weights and a batch (token ids idx): block 0's c_attn GEMM error vs
    fp32, one scale per tensor vs tiles; then with token 0 times OUTLIER, over the other tokens."""
    lin = model.h[0].attn.c_attn
    x = model.h[0].ln_1(model.embed(idx)).reshape(-1, lin.in_features).float()  # (B*T, C)
    w = lin.weight.float()  # (3C, C)
    big = x.clone()
    big[0] *= OUTLIER  # a massive activation (Sun et al. 2024): one token, every channel
    one = functools.partial(quantize_tensorwise, blocks=True)
    figures = {}
    for name, xs, rows in (("", x, slice(None)), ("outlier_", big, slice(1, None))):
        figures[name + "gemm_err_one_scale"] = gemm_error(xs, w, quantize_tensorwise, one, rows)
        figures[name + "gemm_err_tiles"] = gemm_error(xs, w, quantize_1x128, quantize_128x128, rows)
    return figures


def make_parser():
    p = gpt2.make_parser("GPT-2 with tile-scaled fp8 Linears (DeepSeek-V3 3.3), data parallel.")
    p.add_argument("--fp8", default="on", choices=["on", "off"], help="off: the run without fp8")
    p.add_argument("--naive", action="store_true", help="one scale per tensor instead of tiles")
    return p


def train(args, to_fp8=convert_to_fp8):
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cfg = gpt2.model_config(args)
    train_loader, val_loader = gpt2.make_loaders(args, rank, world, cfg.vocab_size)
    ctx = gpt2.setup(args)
    model = gpt2.build_model(args)
    if args.fp8 == "on":
        to_fp8(model)  # the core: convert_to_fp8, with Fp8Linear or NaiveFp8Linear
    model.to(ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = gpt2.make_adamw(gpt2.optimizer_groups(model, args.weight_decay), args, ctx.device)
    fwd = torch.compile(model) if args.compile else model
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    metrics = gpt2.Metrics(args, ctx, cfg, model.num_params(), tokens_per_step)
    profiler, comm = gpt2.Profiler(args, ctx), gpt2.CommMeter()
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | {world} "
           f"rank(s) | device {ctx.device} {ctx.dtype} | fp8 {args.fp8}{' (naive)' * args.naive}")

    def loss_fn(x, y):
        with ctx.autocast():
            return fwd(x, y)[1]

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = gpt2.set_lr(opt, step, args)
        loss_sum = gpt2.accumulate_grads(loss_fn, train_loader, args, ctx.device)
        if world > 1:
            all_reduce_grads(params, world, comm)
            loss_sum = global_mean(loss_sum, world, comm)
        # the grads are now equal on every rank: the local norm is the global one
        if args.grad_clip > 0:
            norm = gpt2.clip_grad_norm_(params, args.grad_clip)
        else:
            norm = gpt2.grad_norm(params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val, norm_val = torch.stack([loss_sum, norm]).tolist()  # the step's one host sync
        gpt2.check_finite(loss_val, step)
        metrics.log_step(step, loss_val, lr, comm_mb=comm.take_mb(), grad_norm=norm_val)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, gpt2.evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
    figures = tiles_vs_one_scale(model, train_loader.next_batch()[0].to(ctx.device))
    print0(f"fp8 GEMM error vs fp32, block 0's c_attn: one scale per tensor "
           f"{100 * figures['gemm_err_one_scale']:.2f}%, "
           f"tiles {100 * figures['gemm_err_tiles']:.2f}%")
    print0(f"... token 0 x{OUTLIER:,.0f}, the other tokens: one scale per tensor "
           f"{100 * figures['outlier_gemm_err_one_scale']:.2f}%, "
           f"tiles {100 * figures['outlier_gemm_err_tiles']:.2f}%")
    metrics.log_summary(figures)
    metrics.plot()
    return metrics.records


def check_flags(args):
    """Before the first collective, on every rank: a bad flag fails every rank in one line."""
    if args.naive and args.fp8 == "off":
        gpt2.fail("--naive with --fp8 off: no Linear runs in fp8", "--naive", "drop one of them")
    gpt2.check_args(args)


def main(argv=None):
    args = make_parser().parse_args(argv)
    check_flags(args)
    Linear = NaiveFp8Linear if args.naive else Fp8Linear
    return train(args, functools.partial(convert_to_fp8, Linear=Linear))


# ---- Beyond the core ----
# 1. The fp8 GEMM on a GPU (CublasFp8Linear, which cli picks on CUDA): torch._scaled_mm, three paths.
#    blockwise  one cuBLAS GEMM with 1x128 block scales on both operands (sm_90 and a torch built for CUDA
#               >= 12.9: torch's "DeepSeek" scaling, ScaledBlas.cpp); use_fast_accum=False keeps cuBLAS's fp32
#               promotion (section 3.3). The first call of each kind is checked against the emulation.
#    rowwise    one row-wise _scaled_mm per 128-wide K chunk (sm_89, sm_100+, older CUDA): within a chunk the
#               tile scales are plain row scales; bf16 partials summed in fp32 by us (K/128 GEMMs, slower).
#    emulated   the core's fp8_matmul (any device).
#    gemm_path picks one from (capability, CUDA version, torch version) and says why in one line; a path that
#    raises for one GEMM kind (forward, dgrad, wgrad) is left for the next one for that kind only, with one
#    line (never a silent whole-run fallback).

GEMM_PATHS = ("blockwise", "rowwise", "emulated")


def gemm_path(capability, cuda_version, torch_version):
    """(path, why) for a GPU of this compute capability ((9, 0); None: no GPU) with a torch of this version
    built for this CUDA (torch.version.cuda; None: a CPU build). A pure function: tested for every GPU."""
    if capability is None or cuda_version is None:
        return "emulated", "no CUDA GPU: the core's emulation"
    sm = f"sm_{capability[0]}{capability[1]}"
    if capability < (8, 9):
        return "emulated", f"{sm} has no fp8 tensor cores: the core's emulation"
    cuda = tuple(int(v) for v in cuda_version.split(".")[:2])
    major_minor = tuple(int(v) for v in torch_version.split("+")[0].split(".")[:2])
    if capability[0] != 9:
        return "rowwise", f"{sm}: torch's 1x128 block-scaled _scaled_mm runs on sm_90 only (Blackwell scales " \
                          f"blocks as MXFP8, see --format mxfp8): one row-wise _scaled_mm per 128-wide K chunk"
    if cuda < (12, 9):
        return "rowwise", f"torch built for CUDA {cuda_version}: block scales need cuBLAS >= 12.9; one row-wise " \
                          f"_scaled_mm per 128-wide K chunk"
    if major_minor < (2, 9):
        return "rowwise", f"torch {torch_version} predates block-scaled _scaled_mm (2.9): one row-wise " \
                          f"_scaled_mm per 128-wide K chunk"
    return "blockwise", f"{sm}, CUDA {cuda_version}: one cuBLAS block-scaled _scaled_mm per GEMM"


def block_scaled_mm(a_fp8, a_scales, b_fp8, b_scales, out_dtype):
    """a @ b^T in one torch._scaled_mm with 1x128 scales on both operands, no fallback, every argument in the
    layout torch checks (ScaledBlas.cpp, is_blockwise_1x128_scaling; cuBLASLt multiplies only a row-major mat1
    by a column-major mat2):
        mat1    a (M, K), row-major                 scale_a (M, K/128), outer-dim-major: strides (1, M)
        mat2    b^T (K, N), column-major            scale_b (K/128, N), row-major (b's (N, K/128) transposed)
    A weight's 128x128 scales go in as 1x128 rows (each row of a block repeats its scale: the same numbers),
    the one block layout whose contract torch 2.9-2.13 agree on (the padding of 128x128 scale rows changed).
    N is padded to 16 (cuBLASLt's dims): zero rows, cut from the result."""
    N, K = b_fp8.shape
    b_rows = b_scales if b_scales.size(0) == N else b_scales.repeat_interleave(TILE, dim=0)[:N]  # (N, K/128)
    pad = -N % 16
    if pad:
        b_fp8 = torch.cat([b_fp8, b_fp8.new_zeros(pad, K)])  # (N + pad, K)
        b_rows = torch.cat([b_rows, b_rows.new_ones(pad, b_rows.size(1))])
    out = torch._scaled_mm(a_fp8.contiguous(), b_fp8.contiguous().t(), scale_a=a_scales.t().contiguous().t(),
                           scale_b=b_rows.t().contiguous(), out_dtype=out_dtype, use_fast_accum=False)
    return out[:, :N]


def rowwise_chunks_mm(a_fp8, a_scales, b_fp8, b_scales, out_dtype):
    """Within one 128-wide K chunk the tile scales are row-wise scales (scale_a (M,1), scale_b (1,N)), which
    every fp8 _scaled_mm takes; the row-wise kernel returns bf16 partials, promoted and summed in fp32 here
    (measured 1.66e-3 relative to the emulation: each partial rounded to bf16)."""
    M, K = a_fp8.shape
    N = b_fp8.size(0)
    b_rows = b_scales if b_scales.size(0) == N else b_scales.repeat_interleave(TILE, dim=0)[:N]  # (N, K/128)
    acc = torch.zeros(M, N, dtype=torch.float32, device=a_fp8.device)
    for k in range(K // TILE):
        cols = slice(k * TILE, (k + 1) * TILE)
        # dense chunks: a row-major, b^T column-major (a copy of 1 byte per element, small next to the GEMM)
        acc += torch._scaled_mm(a_fp8[:, cols].contiguous(), b_fp8[:, cols].contiguous().t(),
                                scale_a=a_scales[:, k, None].contiguous(), scale_b=b_rows[None, :, k].contiguous(),
                                out_dtype=torch.bfloat16).float()
    return acc.to(out_dtype)


_gemm = {"chosen": None, "path": {}, "checked": set()}  # gemm_path's pick; each kind's path; verified


def gemm_kind(b_fp8, b_scales):
    """Which of Fp8LinearFn's three GEMMs a call is, told by its b: wgrad's b is in 1x128 tiles (one
    scale per row), dgrad's is the forward's weight blocks transposed (a view), forward's the blocks."""
    if b_scales.size(0) == b_fp8.size(0):
        return "wgrad"
    return "forward" if b_fp8.is_contiguous() else "dgrad"


def check_fp8_operands(a_fp8, a_scales, b_fp8, b_scales):
    (M, K), N, L = a_fp8.shape, b_fp8.size(0), a_fp8.size(1) // TILE
    if a_fp8.dtype != FP8 or b_fp8.dtype != FP8 or b_fp8.size(1) != K or K % TILE:
        raise ValueError(f"fp8 GEMM wants e4m3 a (M,K), b (N,K), K a multiple of {TILE}: got {a_fp8.dtype} "
                         f"{tuple(a_fp8.shape)}, {b_fp8.dtype} {tuple(b_fp8.shape)}")
    if a_scales.shape != (M, L) or b_scales.shape not in ((N, L), (-(-N // TILE), L)):
        raise ValueError(f"scales {tuple(a_scales.shape)}, {tuple(b_scales.shape)} do not fit 1x128 / 128x128 tiles")


@torch.compiler.disable  # a try/except around a kernel choice is eager-mode code
def cuda_fp8_matmul(a_fp8, a_scales, b_fp8, b_scales, out_dtype=torch.float32):
    """fp8_matmul on the path gemm_path chose (printed once). Each GEMM kind (forward, dgrad, wgrad: their
    operand layouts differ) keeps its own path: a path that raises for a kind, or whose first result of that
    kind differs from the emulation by 1e-2 or more, gives way to the next path for that kind only, with
    one printed line; the other kinds keep theirs."""
    check_fp8_operands(a_fp8, a_scales, b_fp8, b_scales)
    if _gemm["chosen"] is None:
        cap = torch.cuda.get_device_capability(a_fp8.device) if a_fp8.is_cuda else None
        _gemm["chosen"], why = gemm_path(cap, torch.version.cuda, torch.__version__)
        print0(f"fp8 GEMM: {_gemm['chosen']} ({why})")
    kind = gemm_kind(b_fp8, b_scales)
    while True:
        path = _gemm["path"].setdefault(kind, _gemm["chosen"])
        gemm = {"blockwise": block_scaled_mm, "rowwise": rowwise_chunks_mm, "emulated": fp8_matmul}[path]
        try:
            out = gemm(a_fp8, a_scales, b_fp8, b_scales, out_dtype)
            if path == "emulated" or (kind, path) in _gemm["checked"]:
                return out
            ref = fp8_matmul(a_fp8, a_scales, b_fp8, b_scales)
            err = ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()  # once per kind: one sync
            if err >= 1e-2:
                raise RuntimeError(f"{err:.1e} from the emulation")
            _gemm["checked"].add((kind, path))
            return out
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
            if path == "emulated":
                raise  # the reference itself: a bug, its traceback
            _gemm["path"][kind] = GEMM_PATHS[GEMM_PATHS.index(path) + 1]
            print0(f"fp8 GEMM {kind}: {path} failed ({str(e).strip().splitlines()[0][:120]}); using "
                   f"{_gemm['path'][kind]} for {kind}, the other kinds keep theirs")


class CublasFp8LinearFn(Fp8LinearFn):
    gemm = staticmethod(cuda_fp8_matmul)


class CublasFp8Linear(Fp8Linear):
    """Fp8Linear whose three GEMMs run on the GPU's fp8 tensor cores (cuda_fp8_matmul)."""
    Function = CublasFp8LinearFn


# 2. MXFP8 and NVFP4 (--format mxfp8|nvfp4): the block-scaled formats of Blackwell's tensor cores (OCP MX v1.0;
# NVIDIA, arXiv 2509.25149), emulated on every device, as a subclass of Fp8Linear (BlockScaledLinear).
#
#   format    element          block along K   block scale                      tensor scale
#   deepseek  e4m3 (448)       1x128 / 128x128 fp32 (x: power of 2)             -
#   mxfp8     e4m3 (448)       1x32            UE8M0 (a power of 2, 1 byte)     -
#   nvfp4     e2m1 (6, 4 bits) 1x16 (W: 16x16) e4m3 (1 byte)                    fp32
#
# MXFP8's UE8M0 scale is rounded up (cuBLAS's and torchao's rule); OCP MX v1.0 floors the exponent instead:
# the two differ on 17% of randn blocks, in each of which the floor saturates the block's largest value
# (test_mxfp8_scale_rounds_up_where_ocp_floors). The hardware applies both block scales inside the tensor
# core and accumulates in fp32, so there is no per-chunk promotion to write: the emulation dequantizes both
# operands (exact in fp32) and multiplies them in fp32; NVFP4's tensor scale is applied in the dequantization.
# Blocks run along each GEMM's contraction dim, so x, W and dy are quantized once per GEMM they enter, each
# from high precision (x's column copy and nvfp4's 16x16 weight blocks are made in forward, as Transformer
# Engine does). GEMM error vs fp64 (randn, 1024x768x768): bf16 0.23%, deepseek 3.72%, mxfp8 3.74%, nvfp4
# 14.62% (18.83% beside a x100 outlier channel; tests/bench_fp8.py --formats). NVFP4's recipe (--nvfp4-recipe,
# default all): a 16x16 random Hadamard transform on wgrad's inputs, stochastic rounding of the gradients,
# the last ~15% of blocks in high precision. Per GEMM they cost accuracy: Hadamard 8.67% -> 13.50% on
# heavy-tailed wgrad inputs (it evens a block out, so its largest values lose the precision they had);
# stochastic rounding raises dgrad's error 14.6% -> 17.7% (noisier, unbiased below saturation); they pay
# off over long runs, which no CPU test reaches. Differences from the paper: one fixed sign pattern for the
# Hadamard transform, not a fresh one per step. A 4x64 model, 60 steps: every format and variant ends
# 1.2-1.4% below --fp8 off, within 0.2% of each other (the timing of a loss drop near step 40), so this run
# cannot rank the formats.

FORMATS = ("deepseek", "mxfp8", "nvfp4")
MX_BLOCK = {"mxfp8": 32, "nvfp4": 16}
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the 8 magnitudes; the 4-bit code is sign<<3 | index
NVFP4_RECIPE = ("hadamard", "sr", "last")  # NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149 section 4)


# Stochastic rounding (--nvfp4-recipe sr): the gradients' e2m1 rounding, random and unbiased below saturation (section 4.3)


def round_e2m1(y, stochastic=False):
    """|y| <= 6 -> the nearest e2m1 value (ties to even), or stochastically rounded (E[q] = y for |y| <= 6;
    quantize_blocks clamps larger |y|, where the block scale rounded down, so there the mean is biased).
    e2m1's steps are 0.5 below 2, 1 below 4, 2 up to 6: divide by the step, round to an integer, multiply."""
    mag = y.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    units = mag / step
    units = torch.floor(units + torch.rand_like(units)) if stochastic else torch.round(units)  # round: half to even
    return torch.copysign((units * step).clamp(max=E2M1_MAX), y)


@functools.cache  # built once per device: a tensor made from a list is a host-to-device copy per call
def e2m1_grid(device):
    return torch.tensor(E2M1_VALUES, device=device)


def pack_e2m1(values):
    """e2m1 values (R, C), C even -> (R, C/2) uint8, two 4-bit codes per byte, the first in the low nibble
    (torch.float4_e2m1fn_x2's layout)."""
    grid = e2m1_grid(values.device)
    codes = torch.searchsorted(grid, values.abs().contiguous()).to(torch.uint8) | (values < 0).to(torch.uint8) << 3
    return codes[:, 0::2] | codes[:, 1::2] << 4


def unpack_e2m1(packed):
    grid = e2m1_grid(packed.device)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.size(0), -1).long()  # (R, C)
    return torch.where(codes >= 8, -grid[codes & 7], grid[codes & 7])


# The Hadamard transform (--nvfp4-recipe hadamard): spreads an outlier over its 16-block (arXiv 2509.25149 section 4.2)


@functools.cache  # built once per device (it was rebuilt and copied to the device on every call)
def hadamard_16(device):
    """A 16x16 random Hadamard transform Q = H diag(signs) / 4, orthogonal (Q Q^T = I): applied to both
    operands along a GEMM's contraction dim it leaves the product unchanged, (a Q)(b Q)^T = a b^T, while
    spreading an outlier over its 16-block (the paper applies it to wgrad's inputs, section 4.2)."""
    h = torch.ones(1, 1)
    while h.size(0) < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # Sylvester's construction
    signs = torch.tensor([1, -1, -1, 1, -1, 1, 1, 1, -1, -1, 1, -1, 1, 1, -1, 1.0])  # fixed random signs
    return (h * signs / 4).to(device)


def rotate_16(x, q):
    """x (R, C) times the block-diagonal diag(q, q, ...) along C (zero-padded to 16)."""
    R, C = x.shape
    xp = F.pad(x, (0, -C % 16))
    return (xp.view(R, -1, 16) @ q).view(R, -1)


def quantize_blocks(x, fmt, stochastic=False, square=False):
    """x (R, C) -> (codes, scales, tensor_scale) in 1 x b blocks along C (b = 32 mxfp8, 16 nvfp4; C padded).
    mxfp8: e4m3 codes, UE8M0 scales (powers of 2 rounded up, float8_e8m0fnu), no tensor scale.
    nvfp4: e2m1 codes packed 2 per byte, e4m3 block scales of amax/6 measured in units of an fp32 tensor
    scale amax_tensor/(448*6), which keeps the block scales inside e4m3's range.
    square: 16x16 blocks (nvfp4 weights), so W and W^T share one quantization."""
    b = MX_BLOCK[fmt]
    xp = F.pad(x.float(), (0, -x.size(1) % b, 0, -x.size(0) % b if square else 0))
    R, C = xp.shape
    if square:  # the amax of each b x b block, repeated over its b rows
        amax = xp.view(R // b, b, C // b, b).abs().amax(dim=(1, 3)).repeat_interleave(b, dim=0)
    else:
        amax = xp.view(R, C // b, b).abs().amax(dim=-1)  # (R, C/b)
    blocks = xp.view(R, C // b, b)
    if fmt == "mxfp8":
        scales = _pow2_up(amax.clamp(min=AMAX_FLOOR) / FP8_MAX)
        return _to_fp8(blocks, scales[..., None]).view(R, C), scales.to(torch.float8_e8m0fnu), None
    tensor_scale = xp.abs().amax().clamp(min=AMAX_FLOOR * E2M1_MAX) / (FP8_MAX * E2M1_MAX)
    scales = (amax / E2M1_MAX / tensor_scale).clamp(max=FP8_MAX).to(FP8)  # e4m3, rounded to nearest
    decode = scales.float() * tensor_scale
    y = torch.where(decode[..., None] > 0, blocks / decode[..., None], 0.0).clamp(-E2M1_MAX, E2M1_MAX)
    return pack_e2m1(round_e2m1(y, stochastic).view(R, C)), scales, tensor_scale


def dequantize_blocks(codes, scales, tensor_scale, fmt, shape):
    b = MX_BLOCK[fmt]
    values = codes.float() if fmt == "mxfp8" else unpack_e2m1(codes)
    R, C = values.shape
    x = values.view(R, C // b, b) * scales.float()[..., None]
    if tensor_scale is not None:
        x = x * tensor_scale
    return x.view(R, C)[: shape[0], : shape[1]]


def block_scaled_matmul(a, b, fmt, a_sr=False, b_sr=False, b_square=False):
    """a (M, K) @ b (N, K)^T with both operands quantized in blocks along K: what one block-scaled MMA
    computes (the CPU emulation: exact products, fp32 sums). Returns fp32 (M, N)."""
    aq = dequantize_blocks(*quantize_blocks(a, fmt, a_sr), fmt, a.shape)
    bq = dequantize_blocks(*quantize_blocks(b, fmt, b_sr, b_square), fmt, b.shape)
    return aq @ bq.t()


class BlockScaledLinearFn(torch.autograd.Function):
    """y = x @ W^T in MXFP8 or NVFP4, all three GEMMs with their operands blocked along the contraction dim.
    recipe (nvfp4): 'hadamard' rotates wgrad's inputs (dy^T, x^T along the tokens) by a 16x16 random
    Hadamard transform; 'sr' rounds the gradient dy stochastically (unbiased but at saturation, so small
    updates survive on average);
    the weights use 16x16 blocks, so dgrad reuses forward's W. mxfp8 quantizes W^T afresh for dgrad."""

    @staticmethod
    def forward(ctx, x, weight, fmt, recipe):
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        N, K = weight.shape
        square = fmt == "nvfp4"
        with torch.autocast(dev, enabled=False):
            x2 = x.reshape(-1, K).float()  # (B*T, K)
            wq = quantize_blocks(weight, fmt, square=square)
            w_hp = dequantize_blocks(*wq, fmt, weight.shape)  # (N, K), the values the tensor core sees
            y = dequantize_blocks(*quantize_blocks(x2, fmt), fmt, x2.shape) @ w_hp.t()  # (B*T, N)
            # wgrad's copy of x, blocked along the tokens, made now from high precision and saved
            xt = x2.t()  # (K, B*T)
            if "hadamard" in recipe:
                xt = rotate_16(xt, hadamard_16(x.device))
            xtq = quantize_blocks(xt, fmt)
        ctx.save_for_backward(*[t for t in xtq + (wq if square else (weight,)) if t is not None])
        ctx.meta = (fmt, recipe, x.shape, xt.shape, weight.shape, x.dtype, weight.dtype, square)
        return y.to(out_dtype).reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        fmt, recipe, x_shape, xt_shape, (N, K), x_dtype, w_dtype, square = ctx.meta
        saved = list(ctx.saved_tensors)
        xt_codes, xt_scales = saved[:2]
        xt_ts = saved[2] if fmt == "nvfp4" else None
        sr = "sr" in recipe
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, N).float()  # (B*T, N)
            if square:  # W^T: the forward's 16x16 blocks, transposed
                w_codes, w_scales, w_ts = saved[3:]
                wt_hp = dequantize_blocks(w_codes, w_scales, w_ts, fmt, (N, K)).t()  # (K, N)
            else:
                wt_hp = dequantize_blocks(*quantize_blocks(saved[2].t(), fmt), fmt, (K, N))
            dx = dequantize_blocks(*quantize_blocks(dy2, fmt, sr), fmt, dy2.shape) @ wt_hp.t()  # (B*T, K)
            dyt = dy2.t()  # (N, B*T)
            if "hadamard" in recipe:
                dyt = rotate_16(dyt, hadamard_16(dy.device))
            xt_hp = dequantize_blocks(xt_codes, xt_scales, xt_ts, fmt, xt_shape)
            dw = dequantize_blocks(*quantize_blocks(dyt, fmt, sr), fmt, dyt.shape) @ xt_hp.t()  # (N, K) fp32
        return dx.reshape(x_shape).to(x_dtype), dw.to(w_dtype), None, None


class BlockScaledLinear(Fp8Linear):
    """Fp8Linear with its three GEMMs in MXFP8 or NVFP4 (fmt), with NVFP4's recipe items (recipe)."""
    Function = BlockScaledLinearFn
    fmt, recipe = "mxfp8", ()

    def forward(self, x):
        y = BlockScaledLinearFn.apply(x, self.weight, self.fmt, self.recipe)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt="mxfp8", recipe=()) -> "BlockScaledLinear":
        new = super().from_linear(linear)
        new.fmt, new.recipe = fmt, tuple(recipe)
        return new


def convert_to_block_format(model: gpt2.GPT, fmt, recipe=()):
    """convert_to_fp8 with BlockScaledLinear; nvfp4 with 'last' keeps the last ~15% of the blocks (at least
    one) in high precision, as the NVFP4 recipe does."""
    keep = max(1, round(0.15 * len(model.h))) if fmt == "nvfp4" and "last" in recipe else 0
    for block in list(model.h)[: len(model.h) - keep]:
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"), (block.mlp, "c_proj")):
            setattr(parent, name, BlockScaledLinear.from_linear(getattr(parent, name), fmt, recipe))
    return model


# ---- Appendix ----
# Closed forms (P parameters, n ranks, C the width; a block's four Linears take inputs of C, C, C, 4C):
#     all-reduce per step           2 (n-1)/n x (4 B x P + 4 B loss), the same with --fp8 off
#     params + grads + AdamW        16 B x P per rank (fp32 master weights, as --fp8 off)
#     saved Linear inputs per token 7C x (1 B + 4 B / 128) per block, against 7C x 2 B in bf16
# References: DeepSeek-V3 technical report (arXiv 2412.19437) sections 3.3 and 3.5.2; Micikevicius et al. 2022,
# "FP8 formats for deep learning"; DeepSeek's DeepGEMM; PyTorch's torch._scaled_mm (ScaledBlas.cpp); OCP
# Microscaling Formats v1.0 (MXFP8); NVIDIA, "Pretraining LLMs with NVFP4" (arXiv 2509.25149) section 4.
# Below: the extension flags and their checks, the comparison with a baseline run, and cli.


def dequantize_128x128(w_fp8, scales, shape=None):
    Np, Kp = w_fp8.shape
    w = (w_fp8.float().view(Np // TILE, TILE, Kp // TILE, TILE) * scales[:, None, :, None]).view(Np, Kp)
    return w if shape is None else w[: shape[0], : shape[1]]


def add_extension_flags(p):
    p.add_argument("--compare-with", default=None, metavar="DIR",
                   help="the --out of a finished run of the same length (e.g. --fp8 off): print the final-loss "
                        "gap to it and draw OUT/<fp8|mxfp8|nvfp4|off>_vs_baseline.png")
    p.add_argument("--format", default="deepseek", choices=FORMATS,
                   help="deepseek: e4m3 in 1x128/128x128 tiles; mxfp8: e4m3 in 1x32 blocks, UE8M0 scales; "
                        "nvfp4: e2m1 in 16-blocks, e4m3 block scales, fp32 tensor scale (all emulated off Hopper)")
    p.add_argument("--nvfp4-recipe", default=None,
                   help=f"comma-separated subset of {','.join(NVFP4_RECIPE)} or 'none' (default: all of them) "
                        "for --format nvfp4: Hadamard on wgrad inputs, stochastic rounding of gradients, "
                        "the last ~15%% of blocks in high precision")
    return p


def choose_to_fp8(args):
    """Every extension flag, checked before the first collective; returns the function that swaps the
    model's Linears (the core's convert_to_fp8 with the Linear class this run needs) and what it runs."""
    recipe = check_format(args)
    if args.naive and args.format != "deepseek":
        gpt2.fail(f"--naive with --format {args.format}", "--naive", "--naive is the per-tensor version of the "
                  "deepseek tiles: drop one of them")
    if args.format != "deepseek":
        what = f"{args.format} ({','.join(recipe) or 'no recipe'})" if args.format == "nvfp4" else args.format
        return functools.partial(convert_to_block_format, fmt=args.format, recipe=recipe), f"{what}, emulated"
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.naive or not use_cuda:
        return functools.partial(convert_to_fp8, Linear=NaiveFp8Linear if args.naive else Fp8Linear), \
            ("one scale per tensor" if args.naive else "1x128 tiles") + ", emulated"
    cap = torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", 0)))
    if cap < (8, 9) and args.fp8 == "on":
        gpt2.fail(f"this GPU is sm_{cap[0]}{cap[1]}, fp8 tensor cores need sm_89 or newer", "--fp8",
                  "use --fp8 off, or --device cpu to emulate")
    return functools.partial(convert_to_fp8, Linear=CublasFp8Linear), "1x128 tiles, CublasFp8Linear (its first " \
        "GEMM prints the path: blockwise, rowwise or emulated, and why)"


def check_format(args):
    """--format / --nvfp4-recipe, checked before any collective; returns the recipe as a tuple."""
    if args.nvfp4_recipe is not None and args.format != "nvfp4":
        gpt2.fail(f"--nvfp4-recipe with --format {args.format}", "--nvfp4-recipe", "add --format nvfp4 or drop it")
    if args.fp8 == "off" and args.format != "deepseek":
        gpt2.fail(f"--format {args.format} with --fp8 off: no Linear is quantized", "--format", "drop one of them")
    if args.format != "nvfp4":
        return ()
    items = NVFP4_RECIPE
    if args.nvfp4_recipe is not None:
        items = () if args.nvfp4_recipe == "none" else tuple(args.nvfp4_recipe.split(","))
    bad = [i for i in items if i not in NVFP4_RECIPE]
    if bad:
        gpt2.fail(f"unknown --nvfp4-recipe item {bad[0]!r}", "--nvfp4-recipe",
                  f"give a comma-separated subset of {','.join(NVFP4_RECIPE)}, or none")
    if "last" in items and gpt2.model_config(args).n_layer == 1:  # the one block stays high precision
        gpt2.fail("--format nvfp4 with one block: 'last' keeps it in high precision, nothing runs in nvfp4",
                  "--nvfp4-recipe", "use --n-layer 2 or more, or a recipe without last (e.g. hadamard,sr)")
    return items


def read_baseline(args):
    """--compare-with DIR: the train records of DIR/metrics.jsonl, a finished run of --steps steps; checked on
    every rank before the process group starts (a directory never holds two runs, so the baseline is a
    run of its own: run it first, then this one with --compare-with)."""
    if args.compare_with is None:
        return None
    import json
    path = os.path.join(args.compare_with, "metrics.jsonl")
    records, why = [], None
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f]
    except (OSError, ValueError) as e:
        why = f"{path} cannot be read ({type(e).__name__})"
    steps = [r["step"] for r in records if "loss" in r]
    if why is None and len(steps) != args.steps:
        why = f"{path} holds {len(steps)} training steps, this run has --steps {args.steps}"
    if not gpt2.agree(why is None):
        gpt2.fail(why or "rank 0 could not read the baseline", "--compare-with",
                  "give the --out of a finished run with the same --steps (e.g. python fp8.py --fp8 off --out out/fp8_off)")
    return records


def compare_with_baseline(args, records, baseline):
    """Print this run's final-loss gap to the --compare-with run and draw OUT/<mode>_vs_baseline.png (mode: fp8
    = the DeepSeek tiles, mxfp8, nvfp4, or off); without --compare-with, say how to compare."""
    mode = "off" if args.fp8 == "off" else "fp8" if args.format == "deepseek" else args.format
    if baseline is None:
        print0("compare: run the same command with " + (f"--fp8 on --out OTHER_DIR --compare-with {args.out}" if mode == "off"
               else "--fp8 off --out BASE_DIR, then this one with --compare-with BASE_DIR (a new --out)"))
        return None
    on, off = ([(r["step"], r["loss"]) for r in recs if "loss" in r] for recs in (records, baseline))
    label, base = {"fp8": "fp8 tiles"}.get(mode, mode), f"{args.compare_with}"
    gap = (on[-1][1] - off[-1][1]) / off[-1][1]
    print0(f"final train loss: {label} {on[-1][1]:.4f} | {base} {off[-1][1]:.4f} | gap {100 * gap:+.2f}%")
    val_on, val_off = ([r["val_loss"] for r in recs if "val_loss" in r] for recs in (records, baseline))
    if val_on and val_off:
        print0(f"final val loss:   {label} {val_on[-1]:.4f} | {base} {val_off[-1]:.4f} | "
               f"gap {100 * (val_on[-1] - val_off[-1]) / val_off[-1]:+.2f}%")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(6, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(*zip(*off), label=f"{base} (--compare-with)")
    ax.plot(*zip(*on), label=f"{label} (this run)")
    ax.set_ylabel("train loss (nats/token)")
    ax.legend()
    ax2.plot([s for s, _ in on], [100 * (a - b) / b for (_, a), (_, b) in zip(on, off)])
    ax2.axhline(0, color="gray", lw=0.5)
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"{label} vs --compare-with (%)")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{mode}_vs_baseline.png"), dpi=100)
    plt.close(fig)
    return gap


def cli(argv=None):
    """The whole file: the core's loop with the Linear class the flags pick (the core's own with no
    extension flag, CublasFp8Linear on a GPU, BlockScaledLinear for --format), then --compare-with."""
    args = add_extension_flags(make_parser()).parse_args(argv)
    to_fp8, what = choose_to_fp8(args)  # every check before the first collective: none hangs
    check_flags(args)
    baseline = read_baseline(args)
    if args.fp8 == "on":
        print0(f"fp8: {what}")
    records = train(args, to_fp8)
    return compare_with_baseline(args, records, baseline) if int(os.environ.get("RANK", 0)) == 0 else None


if __name__ == "__main__":
    gpt2.run_main(cli)
