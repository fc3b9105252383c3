"""The foundation: model, HF-layout loader, shards, loader, schedule, metrics and a real CPU run."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import gpt2
from harness import ROOT, read_metrics, run_cli, run_distributed

TINY = gpt2.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def test_gpt2_124m_parameter_count_and_init():
    torch.manual_seed(0)
    m = gpt2.GPT(gpt2.MODELS["gpt2"])
    # 124,439,808 for OpenAI's 50257-row vocab, plus 47 padding rows of 768
    assert m.num_params(non_embedding=False) == 124_439_808 + 47 * 768
    assert m.lm_head.weight is m.wte.weight
    assert abs(m.h[0].mlp.c_fc.weight.std().item() - 0.02) < 1e-3
    assert abs(m.h[0].mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(24)) < 3e-4
    assert m.h[0].attn.c_attn.bias.abs().max() == 0


def test_forward_pieces_causality_and_padding():
    torch.manual_seed(0)
    m = gpt2.GPT(TINY)
    idx = torch.randint(0, 50257, (2, 16))
    logits, loss = m(idx, idx)
    assert logits.shape == (2, 16, 50304)
    assert torch.isinf(logits[..., 50257:]).all() and torch.isfinite(logits[..., :50257]).all()
    x = m.forward_blocks(m.forward_blocks(m.embed(idx), 0, 1), 1, None)
    assert torch.allclose(m.head_loss(x, idx), loss)
    assert abs(loss.item() - math.log(50257)) < 0.5  # a fresh model is near uniform
    idx2 = idx.clone()
    idx2[:, 10] = (idx2[:, 10] + 1) % 50257
    l2, _ = m(idx2, idx2)
    assert torch.equal(logits[:, :10], l2[:, :10]) and not torch.equal(logits[:, 10:], l2[:, 10:])
    m.activation_checkpointing = True
    _, loss_ck = m(idx, idx)
    loss_ck.backward()
    assert torch.allclose(loss_ck, loss) and m.wte.weight.grad[50257:].abs().max() == 0


# -- HF layout -----------------------------------------------------------------------------------------

def hf_state_dict(cfg, vocab=50257, seed=0):
    """Random weights laid out as Hugging Face's GPT2LMHeadModel: Conv1D (in, out) weights."""
    g = torch.Generator().manual_seed(seed)
    E, sd = cfg.n_embd, {}
    r = lambda *s: torch.randn(*s, generator=g) * 0.1
    sd["transformer.wte.weight"], sd["transformer.wpe.weight"] = r(vocab, E), r(cfg.block_size, E)
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            sd[p + ln + ".weight"], sd[p + ln + ".bias"] = 1 + r(E), r(E)
        sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"] = r(E, 3 * E), r(3 * E)
        sd[p + "attn.c_proj.weight"], sd[p + "attn.c_proj.bias"] = r(E, E), r(E)
        sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = r(E, 4 * E), r(4 * E)
        sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = r(4 * E, E), r(E)
        sd[p + "attn.bias"] = torch.tril(torch.ones(cfg.block_size, cfg.block_size))[None, None]
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = 1 + r(E), r(E)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def reference_logits(sd, cfg, idx):
    """GPT-2's forward written straight from the HF tensors in float64 numpy, independent of gpt2.py."""
    w = {k.removeprefix("transformer."): v.double().numpy() for k, v in sd.items()}
    def ln(x, p):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[p + ".weight"] + w[p + ".bias"]
    gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    T, H, E = len(idx), cfg.n_head, cfg.n_embd
    x = w["wte.weight"][idx] + w["wpe.weight"][:T]
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        qkv = ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (a.reshape(T, H, E // H).transpose(1, 0, 2) for a in np.split(qkv, 3, axis=-1))
        att = q @ k.transpose(0, 2, 1) / np.sqrt(E // H) + np.triu(np.full((T, T), -np.inf), 1)
        att = np.exp(att - att.max(-1, keepdims=True))
        y = (att / att.sum(-1, keepdims=True)) @ v
        x = x + y.transpose(1, 0, 2).reshape(T, E) @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = gelu(ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ w["wte.weight"].T


def write_safetensors(path, sd):
    """The safetensors layout written by hand: u64 header size, JSON header, raw little-endian data."""
    header, blobs, off = {}, [], 0
    for k, v in sd.items():
        b = v.contiguous().numpy().astype("<f4").tobytes()
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_from_pretrained_hf_layout_matches_reference(tmp_path, fmt):
    cfg = TINY
    sd = hf_state_dict(cfg)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"n_positions": cfg.block_size, "vocab_size": 50257, "n_layer": cfg.n_layer,
                   "n_head": cfg.n_head, "n_embd": cfg.n_embd}, f)
    if fmt == "safetensors":
        write_safetensors(tmp_path / "model.safetensors", {k: v for k, v in sd.items() if k != "lm_head.weight"})
    else:
        torch.save(sd, tmp_path / "pytorch_model.bin")
    model = gpt2.from_pretrained(str(tmp_path)).eval()
    idx = np.random.default_rng(0).integers(0, 50257, 20)
    with torch.no_grad():
        ours = model.logits(model.forward_blocks(model.embed(torch.tensor(idx)[None])))[0, :, :50257]
    ref = reference_logits(sd, cfg, idx)
    assert np.abs(ours.double().numpy() - ref).max() < 1e-4


# -- data ----------------------------------------------------------------------------------------------

def test_shard_roundtrip_and_corrupt_shards(tmp_path):
    p = str(tmp_path / "a_train.bin")
    toks = np.arange(1000) % 50257
    gpt2.write_shard(p, toks)
    assert np.array_equal(gpt2.read_shard(p), toks)
    assert os.path.getsize(p) == 1024 + 2000
    raw = bytearray(open(p, "rb").read())
    bad = str(tmp_path / "bad.bin")
    open(bad, "wb").write(b"\x00" * 10)
    with pytest.raises(ValueError, match="shorter than"):
        gpt2.read_shard(bad)
    open(bad, "wb").write(b"\x01" + raw[1:])
    with pytest.raises(ValueError, match="magic"):
        gpt2.read_shard(bad)
    open(bad, "wb").write(raw[:-6])
    with pytest.raises(ValueError, match="header says 1000 tokens"):
        gpt2.read_shard(bad)
    gpt2.write_shard(bad, [1, 2, 60000])
    with pytest.raises(ValueError, match="token id 60000"):
        gpt2.read_shard(bad, vocab_size=50257)
    with pytest.raises(ValueError, match="uint16"):
        gpt2.write_shard(bad, [70000])


@pytest.mark.parametrize("world", [2, 4])
def test_loader_rank_slices_equal_single_batch_and_resume(random_data, world):
    B, T = 8, 16
    single = gpt2.DataLoader(random_data, "train", B, T)
    ranks = [gpt2.DataLoader(random_data, "train", B // world, T, r, world) for r in range(world)]
    for step in range(200):  # 200 * 128 tokens crosses into the second shard and wraps
        x, y = single.next_batch()
        parts = [l.next_batch() for l in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])
        if step == 100:
            state = single.state_dict()
    assert single.shard == 1 or state["shard"] == 1
    resumed = gpt2.DataLoader(random_data, "train", B, T)
    resumed.load_state_dict(state)
    replay = gpt2.DataLoader(random_data, "train", B, T)
    for _ in range(101):
        replay.next_batch()
    for _ in range(50):
        assert torch.equal(resumed.next_batch()[0], replay.next_batch()[0])


def test_loader_errors(tmp_path, random_data):
    with pytest.raises(gpt2.UsageError, match="prepare"):
        gpt2.DataLoader(str(tmp_path), "train", 4, 16)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        gpt2.DataLoader(random_data, "val", 64, 64, 0, 2)


def test_download_offline_fails_fast_and_leaves_nothing(tmp_path):
    dest = str(tmp_path / "x" / "f.bin")
    with pytest.raises(gpt2.UsageError, match="pass --text"):
        gpt2.download("http://127.0.0.1:9/none", dest, offline_hint="pass --text FILE")
    assert not os.path.exists(dest) and not os.path.exists(dest + ".part")


# -- schedule, metrics ---------------------------------------------------------------------------------

def test_lr_schedule():
    class A:
        lr, warmup, steps = 1e-3, 10, 110
    lrs = [gpt2.lr_at(s, A) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert gpt2.lr_at(110, A) == pytest.approx(1e-4)


def test_comm_meter_and_flops():
    c = gpt2.CommMeter()
    c.all_reduce(1000, 4)
    c.all_gather(1000, 4)
    c.reduce_scatter(1000, 4)
    c.send(10)
    assert c.take_mb() == pytest.approx((1500 + 750 + 750 + 10) / 1e6) and c.take_mb() == 0
    cfg = gpt2.MODELS["gpt2"]
    n = gpt2.GPT(TINY).num_params()  # any N: the formula is 6N + 12*L*H*Q*T
    assert gpt2.flops_per_token(cfg, n, 1024) == 6 * n + 12 * 12 * 768 * 1024
    with pytest.raises(gpt2.UsageError, match="step 3"):
        gpt2.check_finite(float("nan"), 3)


def test_hellaswag_scoring_matches_per_ending_loss():
    torch.manual_seed(0)
    m = gpt2.GPT(gpt2.GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    enc = gpt2.get_tokenizer()
    ex = {"ctx": "The cat sat on the", "endings": ["mat.", "big red mat of wool", "dog", "a chair by the door"], "label": 0}
    pred, pred_norm = gpt2.hellaswag_predict(m, enc, ex, torch.device("cpu"))
    ctx = enc.encode(ex["ctx"])
    totals, means = [], []
    for e in ex["endings"]:
        tok = torch.tensor([ctx + enc.encode(" " + e)])
        logits, _ = m(tok, tok)
        lp = torch.log_softmax(logits[0, :-1].double(), -1).gather(-1, tok[0, 1:, None])[:, 0]
        tail = -lp[len(ctx) - 1:]
        totals.append(tail.sum().item())
        means.append(tail.mean().item())
    assert pred == int(np.argmin(totals)) and pred_norm == int(np.argmin(means))


# -- the real thing: a short CPU run on Tiny Shakespeare ---------------------------------------------

def test_cli_train_on_shakespeare_loss_falls(shakespeare, tmp_path):
    out = str(tmp_path / "O")
    run_cli(["gpt2.py", "train", "--model", "tiny", "--data", shakespeare, "--steps", "40", "--batch-size", "8",
             "--seq-len", "64", "--lr", "3e-3", "--warmup", "2", "--device", "cpu", "--dtype", "float32",
             "--eval-every", "20", "--eval-steps", "2", "--out", out],
            env={"OMP_NUM_THREADS": "2"})  # one process: both cores
    recs = read_metrics(out)
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 40 and len([r for r in recs if "val_loss" in r]) == 2
    assert set(steps[0]) >= {"step", "loss", "lr", "tokens", "dt_ms", "tok_per_s", "mfu", "peak_mem_mb", "comm_mb"}
    assert steps[0]["mfu"] is None and steps[-1]["tokens"] == 40 * 8 * 64
    assert steps[0]["loss"] - np.mean([r["loss"] for r in steps[-5:]]) > 2.0
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
    proc = run_cli(["gpt2.py", "sample", "--init-from", os.path.join(out, "model.pt"), "--prompt", "ROMEO:",
                    "--num-samples", "1", "--max-new-tokens", "8", "--device", "cpu"])
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) > len("ROMEO:") + 8


def test_gpt2_refuses_several_ranks(random_data, tmp_path):
    proc = run_cli(["gpt2.py", "train", "--data", random_data, "--out", str(tmp_path)], env={"WORLD_SIZE": "2"}, check=False)
    assert proc.returncode != 0 and "ddp.py" in proc.stderr


def _val_loss_on_ranks(rank, world, data):
    torch.manual_seed(0)
    m = gpt2.GPT(TINY)
    loader = gpt2.DataLoader(data, "val", 8 // world, 16, rank, world)
    return gpt2.evaluate(lambda x, y: m(x, y)[1], loader, 3, torch.device("cpu"))


def test_distributed_val_loss_equals_single_process(random_data):
    from harness import run_distributed
    single = _val_loss_on_ranks(0, 1, random_data)
    both = run_distributed(_val_loss_on_ranks, 2, random_data)
    assert both[0] == both[1] and abs(both[0] - single) / single < 1e-6


def test_token_stream_sharding(tmp_path):
    docs = [np.arange(n, dtype=np.uint16) for n in (7, 30, 5, 1, 12)]  # 55 tokens in all
    n = gpt2.write_token_stream(iter(docs), str(tmp_path), "x", 20, train_shards=5)
    assert n == 3
    got = [gpt2.read_shard(str(tmp_path / f"x_{s}_{i:06d}.bin")) for i, s in enumerate(["val", "train", "train"])]
    assert [len(g) for g in got] == [20, 20, 15] and np.array_equal(np.concatenate(got), np.concatenate(docs))
    assert gpt2.write_token_stream(iter(docs), str(tmp_path / "y"), "y", 20, train_shards=1) == 2


def _save_model_pt(path, cfg, seed=0):
    torch.manual_seed(seed)
    m = gpt2.GPT(cfg)
    torch.save({"config": cfg.__dict__, "model": m.state_dict()}, path)
    return m


def test_export_roundtrip_gives_identical_logits(tmp_path):
    cfg = gpt2.GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)
    m = _save_model_pt(str(tmp_path / "model.pt"), cfg).eval()
    gpt2.export(["--init-from", str(tmp_path / "model.pt"), "--out", str(tmp_path / "hf")])
    with open(tmp_path / "hf" / "config.json") as f:
        hf = json.load(f)
    assert (hf["vocab_size"], hf["n_positions"], hf["n_layer"], hf["n_embd"]) == (50257, 64, 2, 32)
    sd = gpt2.load_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    assert sd["wte.weight"].shape == (50257, 32) and sd["h.0.mlp.c_fc.weight"].shape == (32, 128)  # Conv1D (in, out)
    assert "lm_head.weight" not in sd
    back = gpt2.from_pretrained(str(tmp_path / "hf")).eval()
    idx = torch.randint(0, 50257, (2, 64))
    with torch.no_grad():
        assert torch.equal(m(idx)[0][..., :50257], back(idx)[0][..., :50257])
    # the real-vocab rows are bit-identical; the 47 padding rows are zero again (never read for a logit)
    assert torch.equal(back.wte.weight[:50257], m.wte.weight[:50257]) and back.wte.weight[50257:].abs().max() == 0


def test_init_from_decides_the_shape(tmp_path):
    cfg = gpt2.GPTConfig(block_size=512, n_layer=1, n_head=2, n_embd=32)
    _save_model_pt(str(tmp_path / "model.pt"), cfg)
    gpt2.export(["--init-from", str(tmp_path / "model.pt"), "--out", str(tmp_path / "hf")])
    parse = gpt2.make_parser("t").parse_args
    # --seq-len 512 is beyond the default (tiny) model's context 256, but within the weights' 512
    m = gpt2.build_model(parse(["--init-from", str(tmp_path / "hf"), "--seq-len", "512"]))
    assert m.config.block_size == 512 and m.config.n_layer == 1
    with pytest.raises(gpt2.UsageError, match=r"n_layer=1, but --model asks for 12 \(--model\)"):
        gpt2.build_model(parse(["--init-from", str(tmp_path / "hf"), "--model", "gpt2"]))
    with pytest.raises(gpt2.UsageError, match=r"\(--n-layer\)"):
        gpt2.build_model(parse(["--init-from", str(tmp_path / "model.pt"), "--n-layer", "2"]))
    with pytest.raises(gpt2.UsageError, match=r"context 512 .*\(--seq-len\)"):
        gpt2.build_model(parse(["--init-from", str(tmp_path / "hf"), "--seq-len", "1024"]))


def test_corrupt_weights_name_the_file(tmp_path):
    cfg = gpt2.GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
    _save_model_pt(str(tmp_path / "model.pt"), cfg)
    gpt2.export(["--init-from", str(tmp_path / "model.pt"), "--out", str(tmp_path / "hf")])
    path = tmp_path / "hf" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(gpt2.UsageError, match=r"model.safetensors\): it is truncated or corrupt"):
        gpt2.from_pretrained(str(tmp_path / "hf"))
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())  # random
    with pytest.raises(gpt2.UsageError, match="not a readable safetensors file"):
        gpt2.load_safetensors(str(path))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(gpt2.UsageError, match="not a model.pt of this project"):
        gpt2.load_weights(str(tmp_path / "bad.pt"))


def _val_tokens_read(data, world, batch, val_tokens):
    args = gpt2.make_parser("t").parse_args(["--data", data, "--batch-size", str(batch), "--seq-len", "16",
                                             "--val-tokens", str(val_tokens)])
    rows = {}
    for rank in range(world):
        _, val = gpt2.make_loaders(args, rank, world)
        rows[rank] = [val.next_batch()[0] for _ in range(val.eval_steps)]
    assert args.eval_steps == 10  # make_loaders leaves the flags as they were given
    # the global order: step by step, rank by rank
    return torch.cat([rows[r][s] for s in range(val.eval_steps) for r in range(world)]).flatten()


def test_val_tokens_are_the_same_tokens_for_any_world_and_batch(random_data):
    ref = _val_tokens_read(random_data, 1, 8, 1024)
    assert ref.numel() == 1024
    for world, batch in ((2, 4), (4, 2), (4, 16), (1, 64)):
        assert torch.equal(_val_tokens_read(random_data, world, batch, 1024), ref)
    with pytest.raises(gpt2.UsageError, match=r"not a multiple of the global batch 2 x 3 x 16 = 96 \(--val-tokens\)"):
        _val_tokens_read(random_data, 2, 3, 1024)
    with pytest.raises(gpt2.UsageError, match="exceeds the 4999 tokens"):
        _val_tokens_read(random_data, 1, 8, 8192)


def test_peak_flops_by_exact_device_name():
    assert gpt2.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpt2.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpt2.peak_flops("NVIDIA H200") == 989e12
    assert gpt2.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpt2.peak_flops("NVIDIA GeForce GTX 1080") is None  # unknown: no MFU rather than a wrong one


def test_gpu_check_refuses_in_one_line_without_cuda():
    """tests/gpu_check.py is the command for a GPU machine; here (no CUDA) it must say so in one line."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_check.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout  # not a pass: nothing was checked
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: no CUDA device here"), proc.stderr


def test_a_diverged_last_update_is_never_saved(random_data, tmp_path, monkeypatch, capsys):
    """The loss is computed before the update, so the last update is checked on the weights themselves:
    one line, exit 2, no model.pt (issue 25: 43 of 53 tensors of a saved model.pt were NaN)."""
    make_adamw = gpt2.make_adamw

    def poisoned_adamw(params, args, device):
        opt = make_adamw(params, args, device)
        step, calls = opt.step, []

        def last_step_diverges(*a, **k):
            out = step(*a, **k)
            calls.append(1)
            if len(calls) == args.steps:
                with torch.no_grad():
                    opt.param_groups[0]["params"][0][0, 0] = float("nan")
            return out
        opt.step = last_step_diverges
        return opt
    monkeypatch.setattr(gpt2, "make_adamw", poisoned_adamw)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        gpt2.run_main(gpt2.train, ["--model", "tiny", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                                   "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--eval-every", "0",
                                   "--data", random_data, "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the weights are not finite after step 1 (1 of ") and "(--lr): nothing was saved" in err
    assert not (out / "model.pt").exists() and (out / "metrics.jsonl").exists()


def _prepare_default_data(rank, world, cwd, offline):
    """make_loaders on the default --data with nothing prepared: rank 0 prepares for all, or fails for all."""
    os.makedirs(cwd, exist_ok=True)
    os.chdir(cwd)
    calls = []

    def prepare(argv):
        calls.append(argv)
        if offline:
            gpt2.fail("could not download input.txt (offline)", "data/shakespeare/input.txt", "pass --text")
        import time
        time.sleep(1)  # a slow download: the other rank must wait for it, not read a half-made directory
        rng = np.random.default_rng(0)
        gpt2.write_shard("data/shakespeare/train_000000.bin", rng.integers(0, 50257, 5000))
        gpt2.write_shard("data/shakespeare/val_000000.bin", rng.integers(0, 50257, 1000))
    gpt2.prepare = prepare
    args = gpt2.make_parser("t").parse_args(["--batch-size", "2", "--seq-len", "16"])
    try:
        train, _ = gpt2.make_loaders(args, rank, world)
    except gpt2.UsageError as e:
        return len(calls), str(e)
    return len(calls), len(train.tokens)


def test_default_data_is_prepared_by_rank_0_alone(tmp_path):
    assert run_distributed(_prepare_default_data, 2, str(tmp_path / "a"), False) == [(1, 5000), (0, 5000)]
    (rank0, msg0), (rank1, msg1) = run_distributed(_prepare_default_data, 2, str(tmp_path / "b"), True)
    assert (rank0, rank1) == (1, 0) and "offline" in msg0 and "rank 0 could not prepare data/shakespeare" in msg1
    assert msg0.endswith("(--data): offline? pass --data DIR, a directory prepared by `python gpt2.py prepare "
                         "--text FILE --out DIR` (any UTF-8 text)"), msg0  # the flag that avoids the download


# -- the course data: one token per character ---------------------------------------------------------

TINY_RUN = ["--model", "tiny", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
            "--eval-every", "0", "--device", "cpu", "--dtype", "float32"]


def test_char_data_sets_the_vocabulary_and_sample_decodes_it(shakespeare_char, shakespeare, tmp_path, capsys):
    """nanoGPT's shakespeare_char: 65 characters, 1,003,854 train / 111,540 val tokens; --data alone makes
    the model's vocabulary (wte padded to 128 rows); model.pt carries it, so sample prints characters."""
    chars = gpt2.read_vocab(shakespeare_char)
    assert len(chars) == 65 and chars == "".join(sorted(chars)) and chars[0] == "\n"
    assert [len(gpt2.read_shard(os.path.join(shakespeare_char, f"{s}_000000.bin"))) for s in ("train", "val")] \
        == [1_003_854, 111_540]
    first = gpt2.read_shard(os.path.join(shakespeare_char, "train_000000.bin"))[:10]
    assert "".join(chars[i] for i in first) == "First Citi"
    args = gpt2.make_parser("t").parse_args(["--data", shakespeare_char])
    cfg = gpt2.model_config(args)
    assert (cfg.vocab_size, cfg.padded_vocab, cfg.chars) == (65, 128, chars)
    out = str(tmp_path / "char")
    gpt2.run_main(gpt2.train, TINY_RUN + ["--data", shakespeare_char, "--steps", "2", "--batch-size", "2",
                                          "--out", out])
    capsys.readouterr()
    gpt2.sample(["--init-from", f"{out}/model.pt", "--prompt", "ROMEO:", "--num-samples", "1",
                 "--max-new-tokens", "30"])
    printed = capsys.readouterr().out.split(" \n" + "-" * 40)[0]  # print(text, "\n---")
    assert printed.startswith("ROMEO:") and len(printed) == 36 and set(printed) <= set(chars), printed
    with pytest.raises(gpt2.UsageError, match=r"reads 65 characters, but --data .* holds GPT-2's BPE \(--data\)"):
        gpt2.train(["--init-from", f"{out}/model.pt", "--data", shakespeare, "--out", str(tmp_path / "x")])


def test_grad_norm_is_recorded_and_the_micro_batch_loss_divided_by_grad_accum(random_data, tmp_path):
    """metrics.jsonl records the pre-clip gradient norm every step: 2 micro-batches of 4 give one batch of
    8's norm (a micro-batch loss not divided by --grad-accum shows as a norm 2x too large); the run ends in
    one summary record."""
    runs = {"b8": ["--batch-size", "8"], "b4x2": ["--batch-size", "4", "--grad-accum", "2"]}
    for name, flags in runs.items():
        gpt2.run_main(gpt2.train, TINY_RUN + ["--data", random_data, "--steps", "2", "--out",
                                              str(tmp_path / name)] + flags)
    recs = {name: read_metrics(str(tmp_path / name)) for name in runs}
    norms = {name: [r["grad_norm"] for r in rs if "loss" in r] for name, rs in recs.items()}
    assert norms["b8"][0] > 0.1 and math.isclose(norms["b4x2"][0], norms["b8"][0], rel_tol=1e-5), norms
    assert recs["b8"][-1] == {"summary": {"loss": recs["b8"][-2]["loss"], "val_loss": None}}


def test_sigterm_ends_the_run_in_one_line(random_data, tmp_path):
    """A scheduler's stop (SIGTERM) says, like Ctrl-C, after which step the run ended and what to do."""
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "gpt2.py", "train"] + TINY_RUN + [
        "--data", random_data, "--steps", "100000", "--batch-size", "2", "--warmup", "1", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import time
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(0.5)
    proc.terminate()
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 143 and err.count("\n") == 1, (proc.returncode, err)
    assert err.startswith("terminated (SIGTERM) after step ") and "nothing was saved" in err, err


def test_chunked_cross_entropy_equals_the_plain_loss_and_saves_no_full_logits(monkeypatch):
    """Beyond LOSS_CHUNK rows the head and loss run chunk by chunk (issue 29: B=64, T=1024 would hold 13 GB of fp32
    logits twice): the same loss and gradients as the plain path, and nothing of size (N, V) kept for backward."""
    torch.manual_seed(0)
    model = gpt2.GPT(gpt2.MODELS["tiny"])
    idx, targets = torch.randint(0, 50257, (4, 64)), torch.randint(0, 50257, (4, 64))
    params = [model.wte.weight, model.ln_f.weight, model.h[0].attn.c_attn.weight]

    def loss_and_grads():
        with gpt2.SavedBytes(exclude=model.parameters()) as saved:
            loss = model(idx, targets)[1]
        return loss, torch.autograd.grad(loss, params), saved.bytes

    plain, plain_grads, plain_saved = loss_and_grads()
    monkeypatch.setattr(gpt2, "LOSS_CHUNK", 50)  # 256 rows: 6 chunks, the last one short
    chunked, chunked_grads, chunked_saved = loss_and_grads()
    assert abs(chunked.item() - plain.item()) / plain.item() < 1e-6, (chunked.item(), plain.item())
    for p, a, b in zip(("wte", "ln_f", "c_attn"), chunked_grads, plain_grads):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel < 1e-5, f"chunked loss: d/d{p} differs by {rel:.1e} (relative to its largest entry)"
    logits_bytes = 256 * model.config.padded_vocab * 4  # the plain path keeps the fp32 log-softmax, (N, V)
    grad_w_bytes = model.wte.weight.numel() * 4  # the chunked path keeps d loss / d W instead, (V, C): not N's size
    assert plain_saved - chunked_saved >= logits_bytes - grad_w_bytes, \
        f"saved for backward: chunked {chunked_saved / 1e6:.1f} MB vs plain {plain_saved / 1e6:.1f} MB"
