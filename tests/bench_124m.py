"""GPT-2 124M at 8 ranks: what every technique sends and holds per rank, in one table.

    python tests/bench_124m.py [--world 8] [--batch-size 16] [--seq-len 1024]

No GPU and no 8 processes: each technique's bench file measures its own rows in a process of its own
(`per_rank_124m()` in tests/bench_<file>.py: torch's fake process group, where collectives are no-ops but
the file's own byte meter and buffers are real, and/or the meta device), and this script prints them beside
the single-process baseline below. Bytes per step are what one rank sends under the bandwidth-optimal
algorithm (gpt2.CommMeter), per optimizer step at --batch-size sequences of --seq-len per data-parallel
rank; memory is per rank: fp32 parameters, gradients, AdamW (or the file's) optimizer state, and the bf16
activations saved for backward. Each row prints its measured figures beside its closed form.
"""
import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import gpt2  # noqa: E402

FILES = ["ddp", "fsdp2", "tensor_parallel", "pipeline", "moe_ep", "fp8", "muon", "checkpoint"]
MB = 1e6


def saved_activation_bytes(model, batch_size, seq_len, dtype=torch.bfloat16):
    """Bytes autograd saves for backward in one forward of `model` (each storage counted once)."""
    idx = torch.randint(0, model.config.vocab_size, (batch_size, seq_len))
    with gpt2.SavedBytes() as counted, torch.autocast("cpu", dtype):
        model(idx, idx)
    return counted.bytes


def gpt2_row(batch_size, seq_len):
    """One process, no parallelism: the row every technique is compared with."""
    torch.manual_seed(0)
    model = gpt2.GPT(gpt2.MODELS["gpt2"])
    n = sum(p.numel() for p in model.parameters())
    # saved bytes = a fixed part (the bf16 copies of the weights autocast saves) + a part per sequence:
    # measure 1 and 2 sequences and extrapolate the line to the batch
    one, two = saved_activation_bytes(model, 1, seq_len), saved_activation_bytes(model, 2, seq_len)
    act = one + (batch_size - 1) * (two - one)
    return {"setup": "gpt2.py (1 process)", "comm_MB": 0.0, "comm_MB_closed": 0.0, "params_MB": 4 * n / MB,
            "grads_MB": 4 * n / MB, "optim_MB": 8 * n / MB, "act_MB": act / MB, "mem_MB_closed": 16 * n / MB,
            "how": f"real CPU forwards (bf16 autocast) at B=1 and 2, extrapolated to B={batch_size}"}


def rows_of(name, world, batch_size, seq_len):
    code = (f"import json, sys; sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]; import bench_{name} as b; "
            f"print('ROWS ' + json.dumps(b.per_rank_124m({world}, {batch_size}, {seq_len})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WORLD_SIZE": "1", "RANK": "0"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [{"setup": f"{name}.py", "error": tail[:120]}]
    return json.loads(lines[-1][5:])


def fmt(row):
    if "error" in row:
        return f"| {row['setup']} | failed: {row['error']} | | | | | | |"

    def pair(measured, closed):
        same = closed is not None and abs(measured - closed) <= 0.005 * max(1.0, abs(closed))
        return f"{measured:,.1f}" + ("" if closed is None else (" (= closed form)" if same else f" (closed {closed:,.1f})"))
    persistent = row["params_MB"] + row["grads_MB"] + row["optim_MB"]
    return (f"| {row['setup']} | {pair(row['comm_MB'], row.get('comm_MB_closed'))} | {row['params_MB']:,.1f} | "
            f"{row['grads_MB']:,.1f} | {row['optim_MB']:,.1f} | {pair(persistent, row.get('mem_MB_closed'))} | "
            f"{row['act_MB']:,.1f} | {row['how']} |")


class LiveBytes:
    """Peak bytes of the tensors alive at once while a function runs, on the meta device (shapes only: no compute,
    no memory, any size): every op's output storage counts from its creation to the death of its last tensor."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        import weakref
        tracker = self
        self.refs, self.size, self.seen, self.now, self.peak = {}, {}, set(), 0, 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and id(t) not in tracker.seen:
                        key = t.untyped_storage()._cdata
                        tracker.seen.add(id(t))
                        if key not in tracker.refs:
                            tracker.refs[key], tracker.size[key] = 0, t.untyped_storage().nbytes()
                            tracker.now += tracker.size[key]
                            tracker.peak = max(tracker.peak, tracker.now)
                        tracker.refs[key] += 1
                        weakref.finalize(t, tracker.drop, key, id(t))
                return out

        self.mode = Mode()

    def drop(self, key, tid):
        self.seen.discard(tid)
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.now -= self.size.pop(key)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def head_loss_peak_gb(batch_size, seq_len, chunked):
    """The head and loss of GPT-2 124M on one GPU in bf16 (logits = x @ W.T in bf16, the loss in fp32), forward and
    backward, measured on the meta device: the plain path (fp32 logits and log-softmax for the whole batch) or
    gpt2.py's ChunkedCrossEntropy (gpt2.LOSS_CHUNK rows at a time)."""
    cfg, n = gpt2.MODELS["gpt2"], batch_size * seq_len
    w = torch.empty(cfg.padded_vocab, cfg.n_embd, device="meta", dtype=torch.bfloat16, requires_grad=True)
    x = torch.empty(n, cfg.n_embd, device="meta", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.zeros(n, dtype=torch.long, device="meta")
    with LiveBytes() as live:
        if chunked:
            loss = gpt2.ChunkedCrossEntropy.apply(x, w, targets, cfg.vocab_size, True)
        else:
            logits = x @ w.t()
            logits[..., cfg.vocab_size:] = float("-inf")
            loss = gpt2.cross_entropy(logits, targets)
        loss.backward()
    return live.peak / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8, help="ranks the figures are for")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel rank per step")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--only", default=",".join(FILES), help="comma-separated technique files to include")
    args = p.parse_args()
    rows = [gpt2_row(args.batch_size, args.seq_len)]
    for name in args.only.split(","):
        rows += rows_of(name, args.world, args.batch_size, args.seq_len)
    print(f"GPT-2 124M, {args.world} ranks, B={args.batch_size} x T={args.seq_len} per data-parallel rank, "
          f"MB per rank (1 MB = 1e6 bytes)\n")
    print("| setup | sent per step | params | grads | optimizer | params+grads+optimizer | activations (bf16) | how |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(fmt(row))
    for b in (args.batch_size, 64):
        print(f"\nhead + loss peak per GPU at B={b} x T={args.seq_len} (bf16 logits, fp32 loss, forward + backward, "
              f"meta device): whole-batch logits {head_loss_peak_gb(b, args.seq_len, False):.2f} GB, chunked "
              f"({gpt2.LOSS_CHUNK} rows at a time, gpt2.py) {head_loss_peak_gb(b, args.seq_len, True):.2f} GB")


if __name__ == "__main__":
    main()
