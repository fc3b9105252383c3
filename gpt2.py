"""
gpt2.py - GPT-2 (124M and friends) in one file: the model, the data loader and the training recipe
that every technique file of this project must reproduce, then (in the appendix) the shared toolkit.

The idea: one exact, readable GPT-2, weight-compatible with OpenAI's, trained the way llm.c and
modded-nanogpt train it. Every distributed technique (ddp.py, fsdp2.py, tensor_parallel.py, ...)
reuses this model and this loader, so with the same seed and the same global batch each must
reproduce this file's loss curve step by step: that equality is how we know they are right.

    tokens (B,T) --wte+wpe--> x --[Block]*L--> ln_f --lm_head (tied to wte)--> logits (B,T,V)
    Block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))           (pre-LayerNorm, GELU-tanh)

    data:  DIR/*train*.bin, DIR/*val*.bin  (256 x int32 header: 20240520, 1, n_tokens; then uint16)
           DIR/vocab.json for character-level data (the course: V = 65), else GPT-2's BPE (50257)
    step:  one contiguous global batch of world*B*T+1 tokens; rank r takes rows [r*B, (r+1)*B)
           -> the union over ranks is exactly the single-process batch, for any world size

Closed forms (GPT-2 124M: 124,475,904 parameters, the 50,304 x 768 tied embedding 38.6M of them):
    memory, one process:  fp32 weights 4P + grads 4P + AdamW moments 8P = 16 B x P = 1.99 GB
    FLOPs per token:      6N + 12*L*H*Q*T, N = 123.7M (all but wpe) -> 0.85 GFLOP at T=1024 (PaLM B)

Read first: nothing; this file is the reference. Reading order: the model (GPTConfig, GPT with
embed / forward_blocks / head_loss, build_model), the data (shard format, DataLoader,
make_loaders), the recipe (AdamW groups, lr_at, accumulate_grads, evaluate, train: the loop).
Below `# ---- Appendix ----`: what a technique file borrows and what a user runs after: HF weights
in and out, corpus preparation, one-line errors and checks, locks, setup of the process group,
byte meters, metrics, timeline, profiler, sampling, HellaSwag, export.

Launch (the course data, then GPT-2 124M):
    python gpt2.py prepare --text input.txt --tokenizer char --out data/shakespeare_char  # offline
    python gpt2.py train --data data/shakespeare_char --steps 20 --batch-size 8 --seq-len 64 \
        --out out/g     # a line per step (loss 4.2 at step 0, ~3.2 at 19), the val loss; ~10 s
    python gpt2.py sample --init-from out/g/model.pt --prompt "ROMEO:"
    python gpt2.py train --model gpt2 --data data/fineweb10B --batch-size 16 --grad-accum 32 \
        --compile --val-tokens 10485760;  python gpt2.py hellaswag --init-from gpt2

References: Radford et al. 2019 (GPT-2, section 2.3 init); Karpathy's nanoGPT, llm.c and
build-nanogpt; Keller Jordan's modded-nanogpt (the shard format and the 3.28 FineWeb target).
"""
import argparse
import atexit
import contextlib
import datetime
import glob
import json
import math
import mmap
import os
import pickle
import resource
import signal
import socket
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


# The model: GPT-2 exactly as OpenAI shaped it, cut into embed / forward_blocks / head_loss


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest context (rows of wpe)
    vocab_size: int = 50257  # real GPT-2 tokens; logits are returned for these only
    padded_vocab: int = 50304  # rows of wte/lm_head: a multiple of 128 makes the head matmul fast
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    chars: str = ""  # a character vocabulary (token i is chars[i]); empty: GPT-2's BPE


MODELS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=256, n_layer=4, n_head=4, n_embd=128),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v packed as in OpenAI's weights
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.c_proj.residual_scale = True

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # heads are counted from the width, so a tensor-parallel rank holding a slice of the heads
        # runs this same code on its local heads
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention on CUDA
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.c_proj.residual_scale = True

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2 used the tanh GELU


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2. Cut it up with embed / forward_blocks(start, end) / head_loss: pipeline stages and
    sharding units use these pieces, so every technique runs the very same arithmetic."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2: one matrix reads and writes
        self.activation_checkpointing = False
        self.apply(self.init_weights)

    def init_weights(self, m):
        if isinstance(m, nn.Linear):
            # GPT-2 section 2.3: scale residual projections by 1/sqrt(N) with N = 2 adds per block,
            # so the residual stream's variance does not grow with depth
            std = 0.02
            if getattr(m, "residual_scale", False):
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())  # the tied matrix is counted once
        return n - self.wpe.weight.numel() if non_embedding else n

    def embed(self, idx):
        T = idx.size(1)
        assert T <= self.config.block_size, f"sequence length {T} > {self.config.block_size}"
        return self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))

    def forward_blocks(self, x, start=0, end=None):
        for block in self.h[start:end]:
            if self.activation_checkpointing and self.training:
                # keep only the block's input; recompute its insides in backward (memory for FLOPs)
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def logits(self, x):
        """(..., padded_vocab) logits whose padding columns are -inf: the extra rows exist only for
        matmul speed, so they never win a sample and never enter the softmax, exactly as in OpenAI's
        50257-token model (and the logits stay contiguous, which keeps the softmax fast)."""
        logits = self.lm_head(self.ln_f(x))
        logits[..., self.config.vocab_size:] = float("-inf")
        return logits

    def head_loss(self, x, targets):
        """Mean next-token cross-entropy from the last block's hidden states (B, T, C). Beyond
        LOSS_CHUNK rows the fp32 logits of the whole batch would not fit (B=64, T=1024: 13 GB,
        twice): chunked_cross_entropy (in the appendix) makes them a chunk at a time."""
        if x.shape[0] * x.shape[1] <= LOSS_CHUNK:
            return cross_entropy(self.logits(x), targets)
        return chunked_cross_entropy(self.ln_f(x).flatten(0, 1), self.lm_head.weight,
                                     targets.flatten(), self.config.vocab_size)

    def forward(self, idx, targets=None):
        """(logits, loss); the logits are None where the loss was made in chunks (never whole)."""
        x = self.forward_blocks(self.embed(idx))
        if targets is None:
            return self.logits(x[:, [-1], :]), None  # sampling needs the last position only
        if x.shape[0] * x.shape[1] > LOSS_CHUNK:
            return None, self.head_loss(x, targets)
        logits = self.logits(x)
        return logits, cross_entropy(logits, targets)


def cross_entropy(logits, targets):
    """The mean loss of (B, T, V) logits against (B, T) targets, in fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def model_config(args) -> GPTConfig:
    """MODELS[--model] with the --n-layer/--n-head/--n-embd overrides (check_model_flags has checked
    them); a --data directory holding a character vocabulary (vocab.json) sets the vocabulary."""
    check_model_flags(args)
    names = ("n_layer", "n_head", "n_embd")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    chars = read_vocab(getattr(args, "data", None))
    if chars:  # 65 characters for Tiny Shakespeare: wte's rows padded to a multiple of 128
        padded = -(-len(chars) // 128) * 128
        overrides.update(chars=chars, vocab_size=len(chars), padded_vocab=padded)
    return GPTConfig(**{**MODELS[args.model].__dict__, **overrides})


def build_model(args) -> GPT:
    """The model every file trains, initialised from --seed: every rank and every technique starts
    from the same weights. With --init-from the weights decide the shape (check_init_from refuses
    flags naming another)."""
    torch.manual_seed(args.seed)
    if getattr(args, "init_from", None):
        model = load_weights(args.init_from)
        check_init_from(args, model.config)
    else:
        model = GPT(model_config(args))
    model.activation_checkpointing = args.activation_checkpointing
    return model


# The data: the speedrun's shard format and a loader whose global batch does not depend on the
# world size

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
EOT = 50256  # <|endoftext|>, put before every document
VOCAB = "vocab.json"  # beside character-level shards: {"chars": "..."}, token i is chars[i]


def read_vocab(data_dir):
    """The character vocabulary of a prepared directory, or "" (GPT-2's BPE: no vocab.json)."""
    path = os.path.join(data_dir or "", VOCAB)
    if not data_dir or not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return json.load(f)["chars"]


def read_shard(path, vocab_size=None):
    """Memory-map a shard's tokens (check_shard: the header, the file size and the token range)."""
    n = check_shard(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_INTS * 4, shape=(n,))
    check_token_range(tokens, vocab_size, path)
    return tokens


class DataLoader:
    """Each call reads one contiguous global batch of world*B*T+1 tokens and returns this rank's
    rows; shards are read in sorted order and wrap around. state_dict() makes it resumable."""

    def __init__(self, data_dir, split, batch_size, seq_len, rank=0, world=1, vocab_size=50257):
        self.files = sorted(glob.glob(os.path.join(data_dir, f"*{split}*.bin")))
        check_shards_found(self.files, data_dir, split)
        self.B, self.T, self.rank, self.world = batch_size, seq_len, rank, world
        self.vocab_size = vocab_size
        self.eval_steps = None  # set by make_loaders for --val-tokens
        self.load_state_dict({"shard": 0, "pos": 0})

    def state_dict(self):
        return {"shard": self.shard, "pos": self.pos}

    def load_state_dict(self, state):
        self.shard, self.pos = state["shard"], state["pos"]
        self.tokens = read_shard(self.files[self.shard], self.vocab_size)
        check_fits(self)

    def next_batch(self, device=None):
        """This rank's (B, T) inputs and (B, T) next-token targets on `device` (None: host)."""
        span = self.world * self.B * self.T
        if self.pos + span + 1 > len(self.tokens):
            self.shard = (self.shard + 1) % len(self.files)
            self.pos = 0
            self.tokens = read_shard(self.files[self.shard], self.vocab_size)
            check_fits(self)
        lo = self.pos + self.rank * self.B * self.T
        rows = self.tokens[lo: lo + self.B * self.T + 1]
        buf = torch.from_numpy(rows.astype(np.int64))  # (B*T+1,)
        self.pos += span
        if device is not None and device.type == "cuda":
            # page-locked memory lets the copy run asynchronously (a pageable one stalls the host)
            buf = buf.pin_memory().to(device, non_blocking=True)
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)  # x, y shifted by one


def make_loaders(args, rank=0, world=1, vocab_size=50257):
    """Train and val loaders for data-parallel rank `rank` of `world`. The default data directory is
    prepared on first use. --val-tokens N: validation reads the first N val tokens, the same text
    for any world size."""
    prepare_default_data(args)
    B, T = args.batch_size, args.seq_len
    loaders = tuple(DataLoader(args.data, split, B, T, rank, world, vocab_size)
                    for split in ("train", "val"))
    if getattr(args, "val_tokens", 0):
        span = world * args.batch_size * args.seq_len  # tokens of one global batch
        check_val_tokens(args, span, len(loaders[1].tokens) - 1, loaders[1].files[0])
        loaders[1].eval_steps = args.val_tokens // span  # evaluate() reads these, not --eval-steps
    return loaders


# The recipe: AdamW groups, warmup + cosine LR, accumulation, evaluation, and the reference loop.
# Its defaults (every file's flags start from these; GPT-2 124M on FineWeb: lr 6e-4, 0.5M tokens):
RECIPE = dict(model="tiny", steps=200, batch_size=8, seq_len=256, grad_accum=1, lr=1e-3, warmup=20,
              weight_decay=0.1, beta2=0.95, grad_clip=1.0, seed=1337, eval_every=50, eval_steps=10)


def optimizer_groups(model, weight_decay):
    """Decay 2-D weights (matmuls, embeddings) only; biases and LayerNorm gains are left alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_adamw(params_or_groups, args, device):
    return torch.optim.AdamW(params_or_groups, lr=args.lr, betas=(0.9, args.beta2), eps=1e-8,
                             fused=device.type == "cuda")


def lr_at(step, args):
    """Linear warmup for --warmup steps, then cosine decay to 10% of --lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    min_lr = 0.1 * args.lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))) * (args.lr - min_lr)


def set_lr(opt, step, args):
    """Put step's scheduled learning rate into every param group of opt; returns it."""
    lr = lr_at(step, args)
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def grad_norm(params):
    """The global gradient norm as a 0-dim tensor (no host sync), summed as squares: torch's CPU
    vector_norm is ~1e-4 low on wte's 6.4M-element gradient, and techniques summing shards' squares
    must get the same number."""
    squares = [p.grad.float().pow(2).sum() for p in params if p.grad is not None]
    return torch.stack(squares).sum().sqrt()


def clip_grad_norm_(params, max_norm):
    """torch's rule, grads x min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params)
    grads = [p.grad for p in params]
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return norm


def accumulate_grads(loss_fn, loader, args, device, after_backward=None):
    """Forward and backward over --grad-accum micro-batches. Each micro-batch's loss is divided by
    grad_accum, so the accumulated gradient is the gradient of the mean over all of them.
    loss_fn(x, y) returns a micro-batch's mean loss; after_backward() runs after each backward (e.g.
    a reduce-scatter). Returns this rank's mean loss of the step, detached."""
    loss_sum = torch.zeros((), device=device)
    for _ in range(args.grad_accum):
        x, y = loader.next_batch(device)
        loss = loss_fn(x, y) / args.grad_accum
        loss_sum += loss.detach()
        loss.backward()
        if after_backward is not None:
            after_backward()
    return loss_sum


@torch.no_grad()
def evaluate(loss_fn, loader: DataLoader, steps, device):
    """Mean validation loss over `steps` batches (--val-tokens: the loader's own count) from the
    start of the val split. loss_fn(x, y) -> loss; with a group the ranks' means are averaged,
    which is the single-process mean."""
    steps = loader.eval_steps or steps
    loader.load_state_dict({"shard": 0, "pos": 0})
    total = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = loader.next_batch(device)
        total += loss_fn(x, y).float()
    total /= steps
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total.item()


def train(argv=None):
    args = make_parser("Train GPT-2 in one process (see ddp.py for several).").parse_args(argv)
    check_one_process()
    ctx = setup(args)
    model = build_model(args).to(ctx.device)
    cfg = model.config
    train_loader, val_loader = make_loaders(args, vocab_size=cfg.vocab_size)
    opt = make_adamw(optimizer_groups(model, args.weight_decay), args, ctx.device)
    fwd = torch.compile(model) if args.compile else model
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    metrics = Metrics(args, ctx, cfg, model.num_params(), tokens_per_step)
    profiler = Profiler(args, ctx)
    print0(f"model {args.model}: {model.num_params() / 1e6:.2f}M non-embedding params | "
           f"device {ctx.device} {ctx.dtype}")

    def loss_fn(x, y):
        with ctx.autocast():
            return fwd(x, y)[1]  # the logits are dropped here, before backward: B*T*V floats

    for step in range(args.steps):
        profiler.step(step)
        metrics.start_step()
        lr = set_lr(opt, step, args)
        loss_sum = accumulate_grads(loss_fn, train_loader, args, ctx.device)
        if args.grad_clip > 0:
            norm = clip_grad_norm_(model.parameters(), args.grad_clip)
        else:
            norm = grad_norm(model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val, norm_val = torch.stack([loss_sum, norm]).tolist()  # the step's one host sync
        check_finite(loss_val, step)
        metrics.log_step(step, loss_val, lr, grad_norm=norm_val)
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            model.eval()
            metrics.log_val(step, evaluate(loss_fn, val_loader, args.eval_steps, ctx.device))
            model.train()
    check_finite_weights(model.parameters(), args.steps - 1)
    save_model(os.path.join(args.out, "model.pt"), cfg, model.state_dict())
    val = [r["val_loss"] for r in metrics.records if "val_loss" in r]
    metrics.log_summary({"loss": loss_val, "val_loss": val[-1] if val else None})
    metrics.plot()
    print0(f"saved {args.out}/model.pt and {args.out}/loss.png")


# ---- Appendix ----


# The loss of large batches, in chunks (GPT.head_loss calls it beyond LOSS_CHUNK rows)


LOSS_CHUNK = 8192  # rows of (rows, V) fp32 logits alive at once: 1.6 GB at V = 50,304


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of x @ W.T over the real vocabulary, LOSS_CHUNK rows at a time, with the gradients
    of x and W made in the same pass (softmax - onehot, per chunk): no (N, V) tensor outlives its chunk, and
    nothing is recomputed. Backward only scales them. Matmuls follow autocast, as autograd's would."""

    @staticmethod
    def forward(ctx, x, weight, targets, vocab_size, grads):
        n = x.shape[0]  # x (N, C), weight (V_padded, C), targets (N,)
        dev = x.device.type  # the gradient matmuls run in autocast's dtype, as autograd's would
        ctx.matmul_dtype = torch.get_autocast_dtype(dev) if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) \
            else x.dtype
        loss = torch.zeros((), device=x.device)
        grad_x = torch.empty_like(x) if grads else None
        grad_w = torch.zeros(weight.shape, device=weight.device) if grads else None  # fp32 accumulator
        for lo in range(0, n, LOSS_CHUNK):
            xc, tc = x[lo:lo + LOSS_CHUNK], targets[lo:lo + LOSS_CHUNK]  # (c, C), (c,)
            logits = (xc @ weight.t()).float()  # (c, V_padded): the only fp32 (c, V) tensor, reused in place below
            logits[:, vocab_size:] = float("-inf")  # the padding rows never enter the softmax
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            loss += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            if grads:  # d loss / d logits = (softmax - onehot) / N
                dlogits = logits.sub_(lse[:, None]).exp_()
                dlogits[torch.arange(len(tc), device=x.device), tc] -= 1.0
                dlogits = dlogits.div_(n).to(ctx.matmul_dtype)
                grad_x[lo:lo + LOSS_CHUNK] = dlogits @ weight.to(dlogits.dtype)  # (c, C)
                grad_w += (dlogits.t() @ xc.to(dlogits.dtype)).float()  # (V_padded, C)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss, (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None


@torch.compiler.disable  # eager: its work is large GEMMs; a compiled loop of in-place ops would save little
def chunked_cross_entropy(x, weight, targets, vocab_size):
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return ChunkedCrossEntropy.apply(x, weight, targets, vocab_size, grads)


# HF weights in and out: OpenAI's checkpoints in the Hugging Face layout, and this project's model.pt


def load_weights(init_from) -> GPT:
    """A pretrained name, a HF-layout directory, or a model.pt written by this project's training loops."""
    if init_from.endswith(".pt"):
        try:
            ck = torch.load(init_from, map_location="cpu", weights_only=True)
            if isinstance(ck, dict) and "moe" in ck:
                fail(f"{init_from} is a mixture-of-experts model written by moe_ep.py", "--init-from",
                     f"sample it with `python moe_ep.py sample --init-from {init_from}` (export takes dense GPT-2 only)")
            model = GPT(GPTConfig(**ck["config"]))
            model.load_state_dict(ck["model"])
        except FileNotFoundError:
            fail(f"no such file {init_from}", "--init-from", "pass OUT/model.pt of a finished run")
        except (RuntimeError, KeyError, TypeError, EOFError, OSError, pickle.UnpicklingError) as e:
            fail(f"not a model.pt of this project ({e.__class__.__name__})", init_from,
                 "pass OUT/model.pt of a finished run")
        return model
    return from_pretrained(init_from)


def from_pretrained(name_or_dir: str) -> GPT:
    """OpenAI's weights in the Hugging Face layout: a name ("gpt2", "gpt2-medium", ...) is
    downloaded once to data/weights/NAME; a local directory needs config.json plus
    model.safetensors or pytorch_model.bin."""
    d = name_or_dir
    if not os.path.isdir(d):
        if name_or_dir not in MODELS or name_or_dir == "tiny":
            fail(f"{name_or_dir!r} is neither a directory nor a GPT-2 name", "--init-from",
                 "pass gpt2, gpt2-medium, gpt2-large, gpt2-xl or a directory with config.json")
        d = os.path.join("data", "weights", name_or_dir)
        for f in ("config.json", "model.safetensors"):
            download(f"https://huggingface.co/{name_or_dir}/resolve/main/{f}", os.path.join(d, f),
                     offline_hint="pass a local directory holding config.json and model.safetensors")
    try:
        with open(os.path.join(d, "config.json")) as f:
            hf = json.load(f)
        cfg = GPTConfig(block_size=int(hf["n_positions"]), vocab_size=int(hf["vocab_size"]), n_layer=int(hf["n_layer"]),
                        n_head=int(hf["n_head"]), n_embd=int(hf["n_embd"]),
                        padded_vocab=math.ceil(int(hf["vocab_size"]) / 128) * 128)
    except FileNotFoundError:
        fail(f"{d} has no config.json", "--init-from", "point it at a HF-layout GPT-2 directory (config.json + "
             "model.safetensors), e.g. one written by `python gpt2.py export`")
    except (ValueError, KeyError, TypeError, OSError) as e:
        fail(f"config.json is not a GPT-2 config ({e.__class__.__name__}: {e})", os.path.join(d, "config.json"),
             "it needs n_positions, vocab_size, n_layer, n_head, n_embd: re-export or re-download it")
    if os.path.exists(os.path.join(d, "model.safetensors")):
        sd = load_safetensors(os.path.join(d, "model.safetensors"))
    elif os.path.exists(os.path.join(d, "pytorch_model.bin")):
        sd = torch.load(os.path.join(d, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        fail(f"{d} holds neither model.safetensors nor pytorch_model.bin", "--init-from",
             "point it at a HF-layout GPT-2 directory")
    model = GPT(cfg)
    ours = model.state_dict()
    # OpenAI's Conv1D stores Linear weights as (in, out): transpose them
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    seen = set()
    for k, v in sd.items():
        k = k.removeprefix("transformer.")
        if k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
            continue  # causal-mask buffers, and the head that is tied to wte
        if k not in ours:
            fail(f"unexpected tensor {k!r}", d, "this is not a GPT-2 checkpoint in the HF layout")
        v = v.float()
        if k.endswith(conv1d):
            v = v.t()
        with torch.no_grad():
            if k == "wte.weight":
                ours[k].zero_()
                ours[k][: v.size(0)].copy_(v)
            else:
                if ours[k].shape != v.shape:
                    fail(f"{k} has shape {tuple(v.shape)}, config.json implies {tuple(ours[k].shape)}", d,
                         "the weights and config.json disagree: re-export or re-download them")
                ours[k].copy_(v)
        seen.add(k)
    missing = set(ours) - seen - {"lm_head.weight"}
    if missing:
        fail(f"missing tensors {sorted(missing)[:5]}", d,
             "the checkpoint is incomplete: re-export or re-download it")
    return model


def load_safetensors(path):
    """The safetensors layout: 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the raw bytes. The file is memory-mapped (copy-on-write),
    so the tensors alias it: no copy of the 500 MB file is made before the model takes its weights."""
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= size - 8:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else bytearray()
        out = {}
        for k, meta in header.items():
            if k == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            dtype = dtypes[meta["dtype"]]
            count = math.prod(meta["shape"])
            if not 0 <= start <= end <= size - 8 - n or end - start != count * dtype.itemsize:
                raise ValueError(f"{k}: bytes [{start}, {end}) do not hold shape {meta['shape']} in a {size}-byte file")
            out[k] = torch.frombuffer(buf, dtype=dtype, count=count, offset=8 + n + start).reshape(meta["shape"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as e:
        fail(f"not a readable safetensors file ({e.__class__.__name__}: {e})", path,
             "it is truncated or corrupt: re-download or re-export it")
    return out


def save_safetensors(tensors, path):
    """The inverse of load_safetensors: a JSON header (padded to 8 bytes), then each tensor's bytes."""
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)  # a reader never sees half a file


# Corpus preparation and downloads


def write_shard(path, tokens):
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: tokens must lie in [0, 65535] to be stored as uint16")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens.size)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:  # write aside, then rename: a crash never leaves half a shard
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    os.replace(tmp, path)


def download(url, path, offline_hint):
    """Fetch url to path once; a failed or interrupted download leaves nothing behind."""
    if os.path.exists(path):
        return path
    make_dir(os.path.dirname(path) or ".", path)  # removed again if the download fails
    tmp = path + ".part"
    print(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
    except Exception as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        fail(f"could not download {url} ({e})", path, f"offline? {offline_hint}")
    os.replace(tmp, path)
    return path


def get_tokenizer():
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        fail(f"could not load tiktoken's GPT-2 BPE ({e.__class__.__name__})", "TIKTOKEN_CACHE_DIR",
             "offline, set it to a directory holding tiktoken's cache (this project's CI uses ../shared/tiktoken)")


def prepare_text(text_file, out_dir, tokenizer="gpt2"):
    """Any local text: a 90/10 split on characters (as nanoGPT does), one shard each, of GPT-2 tokens or
    (tokenizer "char", nanoGPT's shakespeare_char) of character ids, the vocabulary in DIR/vocab.json."""
    enc = get_tokenizer() if tokenizer == "gpt2" else None
    try:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        fail(f"not UTF-8 text (byte {e.start}: {e.reason})", text_file, "pass a plain-text file")
    except OSError as e:
        fail(f"cannot read {text_file} ({e.strerror})", "--text", "pass an existing plain-text file")
    if not text.strip():
        fail("the file holds no text", text_file, "pass a file with some text to train on")
    chars = "".join(sorted(set(text)))
    if enc is None and len(chars) > 256:
        fail(f"{len(chars)} distinct characters (at most 256 for --tokenizer char)", text_file,
             "pass a text with fewer distinct characters, or use --tokenizer gpt2")
    make_dir(out_dir, "--out")
    if enc is None:
        with open(os.path.join(out_dir, VOCAB), "w", encoding="utf-8") as f:
            json.dump({"chars": chars}, f)
        print(f"vocabulary: {len(chars)} characters -> {out_dir}/{VOCAB}")
    cut = int(0.9 * len(text))
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        if enc is None:
            points = np.frombuffer(part.encode("utf-32-le"), dtype=np.uint32)  # code points
            vocab = np.frombuffer(chars.encode("utf-32-le"), dtype=np.uint32)  # sorted code points
            tokens = np.searchsorted(vocab, points).astype(np.uint16)  # each one's index in chars
        else:
            tokens = np.array(enc.encode_ordinary(part), dtype=np.uint16)
        write_shard(os.path.join(out_dir, f"{split}_000000.bin"), tokens)
        print(f"{split}: {len(tokens):,} tokens -> {out_dir}")


def prepare_fineweb10b(out_dir, shards):
    """The speedrun's pre-tokenized FineWeb-10B: 100M-token shards, shard 0 is val."""
    base = "https://huggingface.co/datasets/kjj0/fineweb10B-gpt2/resolve/main/"
    names = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, shards + 1)]
    for name in names:
        download(base + name, os.path.join(out_dir, name), offline_hint="copy the shards into --out by hand")
        read_shard(os.path.join(out_dir, name))  # verify the header before trusting it


def _tokenize_doc(doc):
    import tiktoken
    return np.array([EOT] + tiktoken.get_encoding("gpt2").encode_ordinary(doc["text"]), dtype=np.uint16)


def write_token_stream(docs, out_dir, name, shard_tokens, train_shards):
    """Cut a stream of tokenized documents into shards of shard_tokens: shard 0 is val, then up to
    train_shards train shards; a final partial shard is kept. Returns the number of shards written."""
    buf, fill, shard = np.empty(shard_tokens, dtype=np.uint16), 0, 0

    def flush():
        split = "val" if shard == 0 else "train"
        write_shard(os.path.join(out_dir, f"{name}_{split}_{shard:06d}.bin"), buf[:fill])

    for toks in docs:
        while len(toks):
            take = min(len(toks), shard_tokens - fill)
            buf[fill: fill + take], fill, toks = toks[:take], fill + take, toks[take:]
            if fill == shard_tokens:
                flush()
                shard, fill = shard + 1, 0
                if shard > train_shards:
                    return shard
    if fill:
        flush()
        shard += 1
    return shard


def prepare_fineweb_edu(out_dir, shards, shard_tokens=100_000_000):
    """Tokenize HuggingFaceFW/fineweb-edu sample-10BT with all cores; shard 0 is val."""
    import multiprocessing as mp
    try:
        from datasets import load_dataset
        from tqdm import tqdm
    except ImportError:
        fail("prepare fineweb-edu needs the datasets and tqdm packages", "fineweb-edu",
             "`pip install datasets tqdm` (needs network), or pass --text FILE for a local corpus")
    get_tokenizer()  # fail early, offline
    try:
        ds = load_dataset("HuggingFaceFW/fineweb-edu", name="sample-10BT", split="train", streaming=True)
    except (ConnectionError, OSError) as e:  # datasets raises ConnectionError offline; hub errors are OSErrors
        fail(f"could not reach HuggingFaceFW/fineweb-edu ({e.__class__.__name__})", "fineweb-edu",
             "offline? pass --text FILE for a local corpus, or copy prepared shards into a directory for --data")
    with mp.Pool(max(1, os.cpu_count() - 1)) as pool:
        docs = tqdm(pool.imap(_tokenize_doc, ds, chunksize=16), unit=" docs", desc="tokenizing")
        n = write_token_stream(docs, out_dir, "fineweb-edu", shard_tokens, shards)
    print(f"{n} shards of up to {shard_tokens:,} tokens -> {out_dir}")


def prepare(argv):
    p = argparse.ArgumentParser(prog="gpt2.py prepare", description="Tokenize a corpus into token shards.")
    p.add_argument("name", nargs="?", choices=["shakespeare", "shakespeare-char", "fineweb10B", "fineweb-edu"],
                   help="a named corpus to download (needs network); omit it and pass --text for a local file; "
                   "shakespeare-char = Tiny Shakespeare, one token per character (the course data)")
    p.add_argument("--text", help="a local UTF-8 text file to tokenize (works offline)")
    p.add_argument("--tokenizer", choices=["gpt2", "char"], help="for --text: GPT-2's BPE (default) or one "
                   "token per character, the vocabulary written to OUT/vocab.json")
    p.add_argument("--out", help="output directory (default data/NAME)")
    p.add_argument("--shards", type=int, default=8, help="train shards of 100M tokens (fineweb); 103 = all 10B")
    a = p.parse_args(argv)
    if a.tokenizer and not a.text:
        p.error("--tokenizer applies to --text FILE (the named corpora choose their own)")
    if a.text:
        return prepare_text(a.text, a.out or "data/text", a.tokenizer or "gpt2")
    if a.name in ("shakespeare", "shakespeare-char"):
        url = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
        out = a.out or f"data/{a.name.replace('-', '_')}"
        tokenizer = "char" if a.name == "shakespeare-char" else "gpt2"
        src = download(url, os.path.join(out, "input.txt"), offline_hint="with a local copy of the text run "
                       f"`python gpt2.py prepare --text FILE --tokenizer {tokenizer} --out {out}`")
        return prepare_text(src, out, tokenizer)
    if a.name == "fineweb10B":
        return prepare_fineweb10b(a.out or "data/fineweb10B", a.shards)
    if a.name == "fineweb-edu":
        return prepare_fineweb_edu(a.out or "data/fineweb-edu", a.shards)
    p.error("name a corpus or pass --text FILE")


# Shared plumbing for the technique files: collective names, one-line errors and checks, locks, setup,
# byte meters, metrics, profiler


# torch 2.13 renamed the flat collectives reduce_scatter_tensor / all_gather_into_tensor (the old names
# warn there) and torch 2.11-2.12 have only the old ones: every file calls them through these names
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class UsageError(ValueError):
    """A mistake in a flag or a file, not a bug: run_main prints it as one line,
    `error: <what> (<flag or file>): <what to do>`, and exits 2 without a traceback.
    local=True: only this rank hit it (its own shard, its own disk), so this rank prints it too."""

    def __init__(self, what, where, todo, local=False):
        super().__init__(f"{what} ({where}): {todo}")
        self.what, self.local = what, local


def fail(what, where, todo, local=False):
    raise UsageError(what, where, todo, local)


class Terminated(Exception):
    """SIGTERM (a scheduler's or torchrun's stop), raised in the main thread like Ctrl-C's KeyboardInterrupt."""


def raise_terminated(signum, frame):
    raise Terminated


def run_main(main, argv=None):
    """Every file's entry point: main(argv), with the project's own errors as one line, printed once.
    Ctrl-C and SIGTERM end in one line too (exit 130, 143); a refused run removes the directories it created."""
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        signal.signal(signal.SIGTERM, raise_terminated)
    try:
        main(argv)
    except BaseException as e:
        if main_thread:  # the run is ending: torchrun's SIGTERM to the other ranks now simply ends them
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        end_run(e)
    if dist.is_initialized():
        dist.barrier()  # every rank is done before any tears its part of the group down
        dist.destroy_process_group()


def end_run(e):
    """How a run that raised e ends: our errors, a lost peer, Ctrl-C and SIGTERM in one line; a bug re-raised."""
    if isinstance(e, UsageError):
        if e.local or int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(3)  # torchrun stops every rank when one exits: give rank 0 the time to print its line
        remove_created_dirs()
        end_gloo_group()
        sys.exit(2)
    if isinstance(e, RuntimeError) and dist.is_initialized() and peer_lost(e):  # DistBackendError, gloo's
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line per surviving machine
            reason = str(e).strip().splitlines()[0].split("] ")[-1].split(". ")[0][:120]  # gloo/NCCL's first sentence
            print(f"error: another rank of the job is gone ({reason}) (torchrun): this rank "
                  f"{os.environ.get('RANK', 0)} stops; {RUN['resume']}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        atexit._run_exitfuncs()  # release --out's lock; then leave without tearing down a group whose peers are gone
        os._exit(3)
    if isinstance(e, (KeyboardInterrupt, Terminated)):
        if int(os.environ.get("RANK", 0)) == 0:
            step = RUN["step"]
            at = f"after step {step}" if step is not None else "before the first step"
            how = "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated (SIGTERM)"
            print(f"{how} {at}: {RUN['resume']}", file=sys.stderr, flush=True)
        end_gloo_group()
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 143)
    raise e  # a bug: its traceback


def end_gloo_group():
    """Leaving with a gloo group alive can abort the process at exit ("terminate called without an active
    exception"); gloo's teardown is local. NCCL's is not (it may wait for a peer that is gone): left alone."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def peer_lost(e):
    """A collective failed because another process (or its machine) went away, not because of a bug here."""
    lost = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out",
            "communicator was aborted", "NCCL error", "Socket Timeout")
    return isinstance(e, (dist.DistBackendError, dist.DistNetworkError)) or any(s in str(e) for s in lost)


# What a Ctrl-C or a lost peer reports: the last logged step (Metrics sets it) and how to go on (checkpoint.py says how to resume).
RUN = {"step": None, "resume": "nothing was saved but metrics.jsonl: to run again, give a new --out (or delete this "
                              "one); checkpoint.py runs can resume"}
_created_dirs = []


def make_dir(path, flag):
    """os.makedirs that remembers what it created, so that a refused run leaves no empty directory behind."""
    missing = []
    head = os.path.abspath(path)
    while head and not os.path.exists(head):
        missing.append(head)
        head = os.path.dirname(head)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        fail(f"cannot create {path} ({e.strerror})", flag, "choose a directory you can write")
    _created_dirs.extend(missing)


def remove_created_dirs():
    for d in _created_dirs:  # deepest first; a directory that holds anything but our LOCK is kept
        with contextlib.suppress(OSError):
            lock = os.path.join(d, "LOCK")
            if os.listdir(d) == ["LOCK"]:
                with open(lock) as f:
                    if f.read() == f"{socket.gethostname()} {os.getpid()}":
                        os.remove(lock)
            os.rmdir(d)
    _created_dirs.clear()


def check_range(value, flag, lo=-math.inf, hi=math.inf, todo=None):
    """The one rule for a number flag: finite and within [lo, hi], checked before the first collective."""
    if not (math.isfinite(value) and lo <= value <= hi):
        fail(f"{flag} is {value}", flag, todo or f"give a finite value in [{lo:g}, {hi:g}]")


def agree(ok, device=None):
    """True on every rank iff `ok` is true on every rank (one all-reduce; no group: just ok). Used where one
    rank does work for all (rank 0 prepares the data) and all must stop together if it failed. `ok` may be a
    0-d tensor on the device: then reading the answer is the one host sync."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return bool(ok)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = ok.to(device, torch.int32).reshape(1) if isinstance(ok, torch.Tensor) else \
        torch.full((1,), 1 if ok else 0, dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check_finite_weights(tensors, step, device=None, flag="--lr",
                         todo="nothing was saved: lower --lr, keep --grad-clip on, or raise --warmup"):
    """Before anything is written: the weights after the last update are finite on every rank (the loss
    check sees only the weights before it). A collective when there is a group: every rank calls it. One host
    sync: the flags of all tensors are reduced on the device first."""
    tensors = [t.detach() for t in tensors if t.is_floating_point()]
    finite = torch.stack([torch.isfinite(t).all() for t in tensors]).all() if tensors else torch.tensor(True)
    if not agree(finite, device):
        bad = sum(int(not torch.isfinite(t).all()) for t in tensors)  # the failure path only: count them
        fail(f"the weights are not finite after step {step} ({bad} of {len(tensors)} tensors on rank "
             f"{int(os.environ.get('RANK', 0))} hold NaN or Inf)", flag, todo)


def save_model(path, cfg, state, **extra):
    """OUT/model.pt, written whole or not at all (tmp + rename). Call check_finite_weights first."""
    tmp = path + ".tmp"
    torch.save({"config": cfg.__dict__, "model": state, **extra}, tmp)
    os.replace(tmp, path)


def check_args(args):
    """The checks every file shares, run by setup() before the process group starts (files add their own
    beside it). Flags a file does not have are skipped."""
    for flag in ("steps", "batch_size", "grad_accum", "seq_len", "eval_steps", "n_head", "n_layer", "n_embd",
                 "timeout"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            fail(f"--{flag.replace('_', '-')} is {v}", f"--{flag.replace('_', '-')}", "give a positive integer")
    for flag in ("warmup", "eval_every", "profile", "val_tokens"):
        v = getattr(args, flag, None)
        if v is not None and v < 0:
            fail(f"--{flag.replace('_', '-')} is {v}", f"--{flag.replace('_', '-')}", "give 0 or a positive integer")
    for flag, v in vars(args).items():  # one rule for every float flag of every file: finite
        if isinstance(v, float) and not math.isfinite(v):
            fail(f"--{flag.replace('_', '-')} is {v}", f"--{flag.replace('_', '-')}", "give a finite number")
    if not 0 < getattr(args, "lr", 1.0) <= torch.finfo(torch.float32).max:  # the optimizers compute in fp32
        fail(f"--lr is {args.lr}", "--lr", "give a positive learning rate (GPT-2 124M: 6e-4)")
    if getattr(args, "grad_clip", 0.0) < 0 or getattr(args, "weight_decay", 0.0) < 0:
        fail("a negative --grad-clip or --weight-decay", "--grad-clip/--weight-decay",
             "give 0 (off) or a positive value")
    if not 0.0 <= getattr(args, "beta2", 0.5) < 1.0:
        fail(f"--beta2 is {args.beta2}", "--beta2", "give a value in [0, 1), e.g. 0.95")
    if getattr(args, "device", "auto") == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but this machine has no visible GPU", "--device", "drop the flag (auto uses the CPU) "
             "or run where CUDA is available")
    if hasattr(args, "model") and hasattr(args, "seq_len") and not getattr(args, "init_from", None):
        model_config(args)  # --model known, --n-embd divisible by --n-head, --seq-len within the context


# Input checks of the core, one line each there: `error: <what> (<flag or file>): <what to do>`, before any collective


def check_model_flags(args):
    if args.model not in MODELS:
        fail(f"unknown model {args.model!r}", "--model", f"choose one of {', '.join(MODELS)}")
    n_embd = getattr(args, "n_embd", None) or MODELS[args.model].n_embd
    n_head = getattr(args, "n_head", None) or MODELS[args.model].n_head
    if n_embd % n_head:
        fail(f"--n-embd {n_embd} is not divisible by --n-head {n_head}", "--n-head",
             "pick a head count that divides the width")
    if args.seq_len > MODELS[args.model].block_size:
        fail(f"--seq-len {args.seq_len} exceeds the model's context {MODELS[args.model].block_size}", "--seq-len",
             f"use at most {MODELS[args.model].block_size}")


def check_init_from(args, cfg):
    wanted = {}
    if args.model != "tiny":  # the default cannot be told from an explicit --model tiny
        wanted = {k: getattr(MODELS.get(args.model, cfg), k) for k in ("n_layer", "n_head", "n_embd")}
    wanted.update({k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd") if getattr(args, k, None)})
    for k, v in wanted.items():
        if getattr(cfg, k) != v:
            flag = f"--{k.replace('_', '-')}" if getattr(args, k, None) else "--model"
            fail(f"--init-from {args.init_from} has {k}={getattr(cfg, k)}, but {flag} asks for {v}", flag,
                 "drop the flag: the weights decide the shape")
    if args.seq_len > cfg.block_size:
        fail(f"--seq-len {args.seq_len} exceeds the context {cfg.block_size} of {args.init_from}", "--seq-len",
             f"use at most {cfg.block_size}")
    chars = read_vocab(getattr(args, "data", None))
    if chars != cfg.chars:
        have = f"{len(cfg.chars)} characters" if cfg.chars else "GPT-2's BPE"
        want = f"{len(chars)} characters" if chars else "GPT-2's BPE"
        fail(f"--init-from {args.init_from} reads {have}, but --data {args.data} holds {want}", "--data",
             "pass data prepared with the tokenizer the weights were trained with")


def check_shard(path):
    """The header and the file size of a shard; returns its token count."""
    size = os.path.getsize(path)
    if size < HEADER_INTS * 4:
        fail(f"{size} bytes is shorter than the {HEADER_INTS * 4}-byte header", path,
             "re-create it with gpt2.py prepare")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC:
        fail(f"magic {header[0]} != {MAGIC}: not a GPT-2 token shard", path, "prepare it with gpt2.py prepare")
    if header[1] != VERSION:
        fail(f"version {header[1]} != {VERSION}", path, "re-create it with gpt2.py prepare")
    n = int(header[2])
    if size != HEADER_INTS * 4 + 2 * n:
        fail(f"header says {n} tokens ({HEADER_INTS * 4 + 2 * n} bytes) but the file has {size} bytes", path,
             "the shard is truncated or corrupt: re-create it with gpt2.py prepare")
    return n


def check_token_range(tokens, vocab_size, path):
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        fail(f"token id {int(tokens.max())} >= vocab size {vocab_size}", path, "re-create it with gpt2.py prepare")


def check_shards_found(files, data_dir, split):
    if not files:
        fail(f"no {split} shards (*{split}*.bin) in {data_dir!r}", "--data",
             f"run `python gpt2.py prepare shakespeare`, or offline `python gpt2.py prepare --text FILE --out {data_dir}`")


def check_fits(loader):
    need = loader.world * loader.B * loader.T + 1
    if len(loader.tokens) < need:
        fail(f"{len(loader.tokens)} tokens, fewer than one global batch ({loader.world} ranks x {loader.B} x "
             f"{loader.T} + 1 = {need})", loader.files[loader.shard], "lower --batch-size/--seq-len")


def check_val_tokens(args, span, have, path):
    if args.val_tokens % span:
        fail(f"--val-tokens {args.val_tokens} is not a multiple of the global batch {span // args.batch_size // args.seq_len}"
             f" x {args.batch_size} x {args.seq_len} = {span}", "--val-tokens", f"use {args.val_tokens // span * span or span}")
    if args.val_tokens > have:
        fail(f"--val-tokens {args.val_tokens} exceeds the {have} tokens of {path}", "--val-tokens",
             f"use at most {have // span * span}")


def check_finite(loss, step, what="loss"):
    if not math.isfinite(loss):
        fail(f"{what} is {loss} at step {step}", "--lr", "lower --lr, raise --warmup, or check the data")

def check_one_process():
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        fail("gpt2.py trains in one process", "WORLD_SIZE",
             "for several use `torchrun --nproc_per_node=N ddp.py` (same flags)")


def prepare_default_data(args):
    """data/shakespeare is prepared on first use: rank 0 prepares it for all (two ranks must not write one
    file), the others wait; offline, every rank stops with rank 0's one line."""
    if args.data != "data/shakespeare" or glob.glob(os.path.join(args.data, "*train*.bin")):
        return
    error = None
    if int(os.environ.get("RANK", 0)) == 0:
        try:
            prepare(["shakespeare"])
        except UsageError as e:  # offline: name the flag that avoids the download
            error = UsageError(e.what, "--data", "offline? pass --data DIR, a directory "
                               "prepared by `python gpt2.py prepare --text FILE --out DIR` (any UTF-8 text)")
    if not agree(error is None):
        raise error or UsageError("rank 0 could not prepare data/shakespeare", "--data", "see rank 0's line")


def lock_dir(path, flag):
    """Hold `path` for this run alone: rank 0 creates path/LOCK ("host pid"), released at exit. A lock
    left by a dead process on this host is taken over; a live holder makes the second run refuse at once,
    before it writes anything (two runs in one --out would interleave metrics and overwrite model.pt)."""
    make_dir(path, flag)
    lock, me = os.path.join(path, "LOCK"), f"{socket.gethostname()} {os.getpid()}"
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(lock) as f:
                    host, pid = f.read().split()
            except (OSError, ValueError):
                host, pid = "?", "0"  # half-written by a process that died between create and write
            if f"{host} {pid}" == me:
                return
            if host in (socket.gethostname(), "?") and not _pid_alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock)  # stale: its process is gone
                continue
            fail(f"{path} is in use by another run (pid {pid} on {host})", flag,
                 f"wait for it to finish or choose another {flag}; remove {lock} if that run is gone")
        except OSError as e:
            fail(f"cannot write in {path} ({e.strerror})", flag, "choose a directory you can write")
        else:
            with os.fdopen(fd, "w") as f:
                f.write(me)
            atexit.register(_unlock, lock, me)
            return
    fail(f"could not take {lock}", flag, "another run keeps taking it; choose another directory")


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def _unlock(lock, me):
    with contextlib.suppress(OSError):
        with open(lock) as f:
            if f.read() == me:
                os.remove(lock)


def watch_launcher(interval=1.0):
    """Under torchrun, stop this rank if the launcher dies (killed alone, its workers are re-parented):
    an orphan would train on, and commit checkpoints, for a job nobody watches."""
    parent = os.getppid()

    done = threading.Event()

    def watch():
        while not done.wait(interval):
            if os.getppid() != parent:
                print(f"error: the launcher (pid {parent}) died (torchrun): this rank "
                      f"{os.environ.get('RANK', 0)} stops; relaunch the job", file=sys.stderr, flush=True)
                os._exit(3)

    thread = threading.Thread(target=watch, daemon=True, name="watch_launcher")
    thread.start()
    atexit.register(lambda: (done.set(), thread.join(timeout=2 * interval)))  # no thread left running at exit


def make_parser(description):
    """The one parser every file starts from; files add their own flags to it."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default=RECIPE["model"], help=f"model size: {', '.join(MODELS)}")
    a("--n-layer", type=int, help="override the model's number of blocks")
    a("--n-head", type=int, help="override the model's number of attention heads")
    a("--n-embd", type=int, help="override the model's width")
    a("--init-from", help="start from pretrained weights: gpt2, gpt2-medium, ... or a HF-layout directory")
    a("--data", default="data/shakespeare", help="directory with *train*.bin and *val*.bin shards")
    a("--steps", type=int, default=RECIPE["steps"], help="optimizer steps")
    a("--batch-size", type=int, default=RECIPE["batch_size"], help="sequences per data-parallel rank per micro-step")
    a("--seq-len", type=int, default=RECIPE["seq_len"], help="tokens per sequence")
    a("--grad-accum", type=int, default=RECIPE["grad_accum"], help="micro-steps per optimizer step")
    a("--lr", type=float, default=RECIPE["lr"], help="peak learning rate (GPT-2 124M: 6e-4)")
    a("--warmup", type=int, default=RECIPE["warmup"], help="linear warmup steps")
    a("--weight-decay", type=float, default=RECIPE["weight_decay"], help="AdamW decoupled weight decay on 2-D weights")
    a("--beta2", type=float, default=RECIPE["beta2"], help="AdamW beta2")
    a("--grad-clip", type=float, default=RECIPE["grad_clip"], help="clip the global gradient norm to this (0 = off)")
    a("--seed", type=int, default=RECIPE["seed"], help="seed of the weights (identical on every rank)")
    a("--eval-every", type=int, default=RECIPE["eval_every"], help="validation loss every N steps (0 = never)")
    a("--eval-steps", type=int, default=RECIPE["eval_steps"], help="batches per validation (of the global batch: depends on world size)")
    a("--val-tokens", type=int, default=0, help="validate on exactly the first N val tokens, the same tokens for any "
      "world size and batch (N a multiple of world*B*T; the speedrun's 3.28 uses 10485760); 0 = --eval-steps batches")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="autocast dtype; auto = bf16 on CUDA, fp32 on CPU")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--deterministic", action="store_true", help="GPU runs that repeat to the bit and compare with fp32 CPU: TF32 "
      "off, deterministic algorithms, math attention (slower; CPU runs are deterministic already)")
    a("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    a("--profile", type=int, default=0, help="write a torch.profiler trace of N steps to OUT/trace.json")
    a("--timeout", type=int, default=300, help="seconds a collective may wait before the job fails")
    a("--out", default="out", help="directory for metrics.jsonl, loss.png and checkpoints")
    return p


@dataclass
class Context:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    dtype: torch.dtype
    master: bool

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def check_fresh_out(out):
    """A directory never mixes two runs: a finished run's results are not silently replaced. Every rank
    checks before the group starts (or, where a group exists already, all agree before rank 0 writes)."""
    old = [n for n in ("metrics.jsonl", "model.pt") if os.path.exists(os.path.join(out, n))]
    if not agree(not old):
        fail(f"{out} holds an earlier run ({', '.join(old) or 'see rank 0'})", "--out",
             "choose a new --out, or delete that directory to start over")


def setup(args, resumes=False) -> Context:
    """Read torchrun's environment, pick the device and backend (NCCL on CUDA, gloo on CPU), start the
    process group with a timeout (a missing peer fails the job instead of hanging it). resumes=True: the
    caller continues runs in --out (checkpoint.py) and checks it itself."""
    check_args(args)
    if getattr(args, "warmup", 0) > getattr(args, "steps", math.inf):
        print0(f"warning: --warmup {args.warmup} > --steps {args.steps}: the learning rate never reaches --lr")
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and local_rank >= torch.cuda.device_count():
        fail(f"LOCAL_RANK {local_rank} but {torch.cuda.device_count()} GPUs", "--nproc_per_node",
             "launch at most one process per GPU")
    if rank == 0:
        lock_dir(args.out, "--out")
    if not resumes:
        check_fresh_out(args.out)  # every rank, before the group starts: all refuse together
    if "TORCHELASTIC_RUN_ID" in os.environ:
        watch_launcher()
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        # TF32 matmuls (10-bit mantissa) are fast and fine for training, but they break equality with fp32 CPU
        tf32 = not getattr(args, "deterministic", False)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if getattr(args, "deterministic", False):
        make_deterministic()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype, torch.bfloat16 if use_cuda else torch.float32)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout),
                                **({"device_id": device} if use_cuda else {}))
    make_dir(args.out, "--out")  # every rank sees it (rank 0 made it, or a shared filesystem lags)
    return Context(rank, world, local_rank, device, dtype, rank == 0)


def make_deterministic():
    """--deterministic: the same bits on every run. cuBLAS needs a fixed workspace (set before its first use),
    flash/efficient attention's backward adds with atomics, so attention falls back to the math kernel, and
    every op with a nondeterministic CUDA kernel (index_add_, scatter_add_) takes its deterministic one or fails."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


def print0(*a, **k):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, **k, flush=True)


class SavedBytes:
    """Bytes autograd saves for backward inside the `with` block: what a rank's activations cost. Each storage
    counts once (a view and its base are one); storages of `exclude` (the parameters: persistent, not
    activations) are skipped.

        with SavedBytes(exclude=model.parameters()) as saved:
            loss = model(x, y)[1]
        saved.bytes"""

    def __init__(self, exclude=()):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.seen.values())


class CommMeter:
    """Bytes this rank sends, under the bandwidth-optimal algorithm for each collective (ring):
    all-reduce 2(n-1)/n*S, all-gather and reduce-scatter (n-1)/n*S with S the full tensor's bytes,
    all-to-all and point-to-point: the bytes that leave the rank."""

    def __init__(self):
        self.bytes = 0.0

    def all_reduce(self, nbytes, n):
        self.bytes += 2 * (n - 1) / n * nbytes

    def all_gather(self, full_nbytes, n):
        self.bytes += (n - 1) / n * full_nbytes

    reduce_scatter = all_gather

    def broadcast(self, nbytes, n):  # pipelined along a chain: each rank forwards about (n-1)/n of it
        self.bytes += (n - 1) / n * nbytes

    def send(self, nbytes):
        self.bytes += nbytes

    all_to_all = send

    def take_mb(self):
        mb, self.bytes = self.bytes / 1e6, 0.0
        return mb


# Dense bf16 tensor-core peaks (no sparsity) from NVIDIA's datasheets, matched on the device name, most
# specific first: an H100 PCIe (756 TFLOP/s) is not an H100 SXM (989), and an unknown card reports no MFU.
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
              ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12)]


def peak_flops(device_name):
    return next((v for k, v in PEAK_FLOPS if k in device_name), None)


def flops_per_token(cfg: GPTConfig, n_params, seq_len):
    """6N for the matmuls with parameters (forward 2N, backward 4N) plus 12*L*H*Q*T for attention
    (PaLM appendix B), with N the non-embedding parameters, Q the head size, T the sequence length."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * seq_len


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # kB on Linux: the process's peak RSS


class Metrics:
    """OUT/metrics.jsonl (one line per step and per validation) and OUT/loss.png, written by rank 0."""

    def __init__(self, args, ctx: Context, cfg: GPTConfig, n_params, tokens_per_step, resume_step=0):
        self.args, self.ctx, self.records = args, ctx, []
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_token(cfg, n_params, args.seq_len) * tokens_per_step
        name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else ""
        self.peak = peak_flops(name)
        self.path = os.path.join(args.out, "metrics.jsonl")
        if ctx.master:
            if resume_step and os.path.exists(self.path):  # a resumed run keeps the curve before its start
                with open(self.path) as f:
                    for line in f:
                        with contextlib.suppress(ValueError):  # a line cut short by a kill is dropped
                            rec = json.loads(line)
                            if rec.get("step", resume_step) < resume_step:  # not the summary
                                self.records.append(rec)
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)
        self.t0 = None

    def start_step(self):
        self.t0 = time.perf_counter()

    def log_step(self, step, loss, lr, comm_mb=0.0, grad_norm=None, **extra):
        """Call after the optimizer step with the global mean loss and the global gradient norm before
        clipping as floats (llm.c prints both): reading them (one .tolist() of both) is the step's one host
        sync, so the host clock here measures the step without a torch.cuda.synchronize()."""
        dt = time.perf_counter() - self.t0
        tok_s = self.tokens_per_step / dt
        mfu = self.flops_per_step / dt / (self.ctx.world * self.peak) if self.peak else None
        RUN["step"] = step
        rec = {"step": step, "loss": loss, "lr": lr, "tokens": (step + 1) * self.tokens_per_step,
               "dt_ms": dt * 1e3, "tok_per_s": tok_s, "mfu": mfu,
               "peak_mem_mb": peak_memory_mb(self.ctx.device), "comm_mb": comm_mb, "grad_norm": grad_norm,
               **extra}
        if self.ctx.device.type == "cuda":  # what the caching allocator holds: what nvidia-smi and an OOM see
            rec["peak_reserved_mb"] = torch.cuda.max_memory_reserved(self.ctx.device) / 1e6
        self._write(rec)
        mfu_s = f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""
        norm_s = f" | norm {grad_norm:.4f}" if grad_norm is not None else ""
        # 4 decimals (as nanoGPT): the 7th digit differs between CPUs' kernels; metrics.jsonl keeps them all
        print0(f"step {step:5d} | loss {loss:.4f}{norm_s} | lr {lr:.2e} | {dt * 1e3:7.1f} ms | "
               f"{tok_s:9.0f} tok/s{mfu_s} | comm {comm_mb:.2f} MB")
        return rec

    def log_val(self, step, val_loss):
        check_finite(val_loss, step, "val loss")  # a NaN must stop the run, not land in metrics.jsonl
        self._write({"step": step, "val_loss": val_loss})
        print0(f"step {step:5d} | val loss {val_loss:.4f}")

    def log_summary(self, figures):
        """The run's last record, {"summary": {...}}: the figures its closing lines print."""
        self._write({"summary": figures})

    def _write(self, rec):
        self.records.append(rec)
        if self.ctx.master:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def plot(self, name="loss.png"):
        if not self.ctx.master:
            return
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        tr = [(r["step"], r["loss"]) for r in self.records if "loss" in r]
        va = [(r["step"], r["val_loss"]) for r in self.records if "val_loss" in r]
        fig, ax = plt.subplots(figsize=(6, 4))
        if tr:
            ax.plot(*zip(*tr), label="train")
        if va:
            ax.plot(*zip(*va), "o-", label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(self.args.out, name), dpi=100)
        plt.close(fig)


class Profiler:
    """--profile N: trace steps 1..N (step 0 warms up) to OUT/trace.json, open it in Perfetto."""

    def __init__(self, args, ctx: Context):
        self.n, self.prof, self.path = args.profile, None, os.path.join(args.out, f"trace_rank{ctx.rank}.json" if ctx.world > 1 else "trace.json")

    def step(self, step):
        if not self.n:
            return
        if step == 1:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self.prof.__enter__()
        elif self.prof is not None and step == 1 + self.n:
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(self.path)
            print0(f"profiler trace -> {self.path}")
            self.prof = None


class Timeline:
    """One optimizer step drawn as OUT/timeline.png: a row per rank, a bar per span of compute and per
    collective from its issue to its completion, labelled by what it moves ("bucket 3", "unit 2 gather").
    Explicit, short calls from the training loop; they do nothing outside the recorded step.

        timeline = Timeline(ctx, record_step=1)       # step 0 warms up (allocations, compile)
        timeline.start_step(step)
        with timeline.compute("forward"): ...         # a span of the host's work (CUDA: of the stream's)
        work = dist.all_reduce(t, async_op=True)
        timeline.comm("bucket 3", work)               # issue now -> completion (gloo: the work's callback)
        timeline.comm_span("owner 1 gather", t0)      # a blocking collective issued at t0 = timeline.now()
        timeline.save(os.path.join(args.out, "timeline.png"))   # every rank calls it: a gather to rank 0

    On CPU/gloo a span is host time (time.perf_counter). On CUDA it is measured by CUDA events on the
    current stream: a collective's end is an event recorded by the work's future callback, which CUDA
    orders after the collective (so the bar ends when the data is there, not when the host returned)."""

    COLOURS = {"compute": "#9ecae1", "all_reduce": "#e6550d", "all_gather": "#31a354", "reduce_scatter": "#756bb1",
               "all_to_all": "#d6616b", "send": "#fdae6b", "recv": "#bcbddc", "io": "#969696"}

    def __init__(self, ctx, record_step=1):
        self.ctx, self.record_step, self.on = ctx, record_step, False
        self.cuda = ctx.device.type == "cuda"
        self.spans = []  # (label, kind, start, end): floats (s) on CPU, CUDA events (or a list to fill) on GPU
        self.t0 = None

    def start_step(self, step):
        self.on = step == self.record_step
        if self.on:
            self.spans.clear()
            self.t0 = self.now()

    def now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def compute(self, label, kind="compute"):
        if not self.on:
            yield
            return
        start = self.now()
        yield
        self.spans.append([label, kind, start, self.now()])

    def comm(self, label, work, kind="all_reduce"):
        """A collective issued just now with async_op=True; its bar ends when `work` completes."""
        if not self.on:
            return
        span = [label, kind, self.now(), None]
        self.spans.append(span)

        def done(fut):
            span[3] = self.now()  # gloo: a host timestamp on gloo's thread; CUDA: an event ordered after the work
            return fut.value()

        work.get_future().then(done)

    def comm_span(self, label, start, kind="all_reduce"):
        """A blocking collective issued at `start` (= timeline.now()) that has just returned."""
        if self.on:
            self.spans.append([label, kind, start, self.now()])

    def stop(self):
        """End of the recorded step (optional: save() stops it too)."""
        self.on = False

    def _times_ms(self):
        if self.cuda:
            torch.cuda.synchronize()
            return [(lab, kind, self.t0.elapsed_time(s), self.t0.elapsed_time(e))
                    for lab, kind, s, e in self.spans if e is not None]
        return [(lab, kind, 1e3 * (s - self.t0), 1e3 * (e - self.t0)) for lab, kind, s, e in self.spans
                if e is not None]

    def save(self, path, title=""):
        """Every rank calls it once (a gather of each rank's spans); rank 0 draws. Returns rank 0's rows:
        [(rank, label, kind, start_ms, end_ms)], [] elsewhere, and [] when the step was never recorded."""
        self.on = False
        rows = self._times_ms() if self.t0 is not None else []
        everyone = [rows]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, rows)
        if not self.ctx.master or not any(everyone):
            return []
        flat = [(r, *span) for r, spans in enumerate(everyone) for span in spans]
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(everyone)))
        end = max(e for *_, e in flat) or 1.0
        lanes = {}  # (rank, upper or lower) -> each sub-lane's end: bars that overlap in time get sub-lanes
        placed = []
        for rank, label, kind, s, e in sorted(flat, key=lambda f: f[3]):
            ends = lanes.setdefault((rank, kind == "compute"), [])
            sub = next((i for i, t in enumerate(ends) if t <= s), len(ends))
            ends[sub:sub + 1] = [e]
            placed.append((rank, label, kind, s, e, sub))
        for rank, label, kind, s, e, sub in placed:
            n = len(lanes[(rank, kind == "compute")])
            height = 0.38 / n  # compute above, communication below, in each rank's row
            y = rank + (0.0 if kind == "compute" else 0.42) - 0.19 + height * (sub + 0.5)
            ax.barh(y, max(e - s, end * 1e-3), left=s, height=height, color=self.COLOURS.get(kind, "#cccccc"),
                    edgecolor="black", linewidth=0.3)
            if e - s > end * 0.03:
                ax.text(s + (e - s) / 2, y, label, ha="center", va="center", fontsize=6 if n < 3 else 5, clip_on=True)
        ax.set_yticks([r + 0.21 for r in range(len(everyone))], [f"rank {r}" for r in range(len(everyone))])
        ax.invert_yaxis()
        ax.set_xlabel(f"ms since the start of step {self.record_step} ({'CUDA events' if self.cuda else 'host clock'})")
        kinds = sorted({k for *_, k, _s, _e in flat})
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=self.COLOURS.get(k, "#cccccc")) for k in kinds],
                  labels=kinds, loc="upper right", fontsize=7, ncol=len(kinds))
        ax.set_title(title or "one optimizer step: compute (upper bar) and collectives, issue to completion (lower bar)",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return flat


# Using a trained model: sampling, HellaSwag, export to the Hugging Face layout


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=50):
    """temperature 0 = greedy (the likeliest token each time); top_k 0 = sample among all tokens."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size:])
        logits = logits[:, -1, :]
        if temperature == 0:
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
            continue
        logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
    return idx


def check_device(device):
    if device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {device} but this machine has no visible GPU", "--device", "use --device cpu")


def load_for_inference(init_from, device):
    return load_weights(init_from).to(device).eval()


@torch.no_grad()
def hellaswag_predict(model, enc, example, device):
    """Completion-style scoring (build-nanogpt's convention): each ending is scored as a continuation of
    the context, the lowest mean loss per ending token wins (acc_norm, normalized by tokens), the lowest
    total loss gives plain acc. OpenAI's GPT-2 124M scores acc_norm 29.55% this way; the EleutherAI
    harness scores multiple-choice style and normalizes by characters (31.14% for the same weights), so
    compare a figure only with one measured the same way."""
    ctx = enc.encode(example["ctx"])
    rows = [ctx + enc.encode(" " + e) for e in example["endings"]]
    T = max(len(r) for r in rows)
    tok = torch.zeros(4, T, dtype=torch.long)
    mask = torch.zeros(4, T)
    for i, r in enumerate(rows):
        tok[i, : len(r)] = torch.tensor(r)
        mask[i, len(ctx): len(r)] = 1
    tok, mask = tok.to(device), mask.to(device)
    x = model.forward_blocks(model.embed(tok))
    logits = model.logits(x).float()
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tok[:, 1:].reshape(-1), reduction="none").view(4, -1)
    losses = losses * mask[:, 1:]
    total = losses.sum(1)
    return int(total.argmin()), int((total / mask[:, 1:].sum(1)).argmin())


def hellaswag(argv):
    p = argparse.ArgumentParser(prog="gpt2.py hellaswag", description="HellaSwag validation accuracy (10,042 examples), "
                                "completion style as build-nanogpt scores it (GPT-2 124M: acc_norm 29.55%; the EleutherAI "
                                "harness's multiple-choice style gives 31.14%).")
    p.add_argument("--init-from", default="gpt2", help="gpt2..., a HF-layout directory, or OUT/model.pt")
    p.add_argument("--file", default="data/hellaswag/hellaswag_val.jsonl", help="the val jsonl (downloaded if missing)")
    p.add_argument("--limit", type=int, default=0, help="score only the first N examples (0 = all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    a = p.parse_args(argv)
    check_device(a.device)
    check_range(a.limit, "--limit", 0, todo="give 0 (all) or a positive number of examples")
    if not os.path.exists(a.file):
        download("https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl", a.file,
                 offline_hint="pass --file with a local copy of hellaswag_val.jsonl")
    model, enc = load_for_inference(a.init_from, torch.device(a.device)), get_tokenizer()
    n = acc = acc_norm = 0
    with open(a.file) as f:
        for i, line in enumerate(f, 1):
            try:
                ex = json.loads(line)
                assert len(ex["endings"]) == 4 and ex["label"] in range(4) and isinstance(ex["ctx"], str)
            except (ValueError, KeyError, TypeError, AssertionError):
                fail(f"line {i} is not a HellaSwag example (ctx, 4 endings, label)", a.file,
                     "pass the hellaswag_val.jsonl of rowanz/hellaswag")
            pred, pred_norm = hellaswag_predict(model, enc, ex, torch.device(a.device))
            n, acc, acc_norm = n + 1, acc + (pred == ex["label"]), acc_norm + (pred_norm == ex["label"])
            if n == a.limit:
                break
    if n == 0:
        fail("no examples in the file", a.file, "pass the hellaswag_val.jsonl of rowanz/hellaswag")
    print(f"hellaswag: {n} examples | acc {acc / n:.4f} | acc_norm {acc_norm / n:.4f}")
    return acc / n, acc_norm / n


def sample(argv, load_model=None, prog="gpt2.py sample", init_help="gpt2..., a HF-layout directory, or OUT/model.pt"):
    """Sample text. load_model(init_from, device) builds the model (a file with another architecture,
    e.g. moe_ep.py's MoE GPT-2, passes its own loader); default: load_for_inference."""
    p = argparse.ArgumentParser(prog=prog, description="Sample text from a model.")
    p.add_argument("--init-from", default="out/model.pt", help=init_help)
    p.add_argument("--prompt", default="\n", help="text to continue ('' = from <|endoftext|>, unconditional)")
    p.add_argument("--num-samples", type=int, default=3, help="how many continuations")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens per continuation")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--seed", type=int, default=42, help="sampling seed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    a = p.parse_args(argv)
    check_device(a.device)
    check_range(a.temperature, "--temperature", 0, todo="give 0 (greedy) or a positive temperature, e.g. 0.8")
    check_range(a.top_k, "--top-k", 0, todo="give 0 (all tokens) or a positive k, e.g. 50")
    check_range(a.num_samples, "--num-samples", 1, todo="give a positive number of samples")
    check_range(a.max_new_tokens, "--max-new-tokens", 1, todo="give a positive number of tokens")
    torch.manual_seed(a.seed)
    model = (load_model or load_for_inference)(a.init_from, torch.device(a.device))
    chars = model.config.chars
    if chars:  # a character-level model (gpt2.py prepare --tokenizer char): token i is chars[i]
        if any(c not in chars for c in a.prompt):
            fail(f"the prompt holds characters outside the model's {len(chars)}-character vocabulary",
                 "--prompt", f"use only these: {chars!r}")
        prompt, decode = [chars.index(c) for c in a.prompt] or [0], lambda row: "".join(chars[i] for i in row)
    else:
        enc = get_tokenizer()
        prompt = enc.encode(a.prompt, allowed_special={"<|endoftext|>"}) or [EOT]  # '' = <|endoftext|>
        decode = enc.decode
    idx = torch.tensor([prompt] * a.num_samples, device=a.device)
    for row in generate(model, idx, a.max_new_tokens, a.temperature, a.top_k).tolist():
        print(decode(row), "\n" + "-" * 40)


def export(argv):
    """Write a trained model in the Hugging Face GPT-2 layout (config.json + model.safetensors): OpenAI's
    Conv1D (in, out) weight layout, the vocabulary sliced back to 50,257 rows, lm_head left to the tie.
    `--init-from DIR` of any file here, or transformers' GPT2LMHeadModel.from_pretrained(DIR), reads it."""
    p = argparse.ArgumentParser(prog="gpt2.py export", description="Export weights in the Hugging Face GPT-2 layout.")
    p.add_argument("--init-from", required=True, help="OUT/model.pt of a finished run (or a name / HF directory)")
    p.add_argument("--out", required=True, help="directory to write config.json and model.safetensors into")
    a = p.parse_args(argv)
    model = load_weights(a.init_from)
    cfg = model.config
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    tensors = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        v = v.detach().float()
        tensors[k] = v[: cfg.vocab_size] if k == "wte.weight" else v.t() if k.endswith(conv1d) else v
    try:
        os.makedirs(a.out, exist_ok=True)
        save_safetensors(tensors, os.path.join(a.out, "model.safetensors"))
        with open(os.path.join(a.out, "config.json"), "w") as f:
            json.dump({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
                       "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd,
                       "n_layer": cfg.n_layer, "n_head": cfg.n_head, "activation_function": "gelu_new",
                       "layer_norm_epsilon": 1e-5, "bos_token_id": EOT, "eos_token_id": EOT,
                       "tie_word_embeddings": True}, f, indent=2)
    except OSError as e:
        fail(f"cannot write {a.out} ({e.strerror})", "--out", "choose a directory you can write")
    print(f"exported {a.init_from} ({cfg.n_layer} layers, {cfg.n_embd} wide) -> {a.out}/model.safetensors, config.json")


if __name__ == "__main__":
    commands = {"train": train, "prepare": prepare, "sample": sample, "hellaswag": hellaswag, "export": export}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python gpt2.py {{{','.join(commands)}}} [flags]   (add -h to a command for its flags)")
    run_main(commands[sys.argv[1]], sys.argv[2:])
