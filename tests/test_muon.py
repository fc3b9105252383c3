"""muon.py: Newton-Schulz against torch.optim.Muon's, one Muon step against torch.optim.Muon, distributed
Muon (2 and 4 ranks) against one rank, and the CLI: torchrun 2 ranks == 1 process, --optimizer adamw ==
gpt2.py train, bytes sent == theory, bad flags fail before any collective."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz

import gpt2
import muon
from harness import max_rel_diff, read_metrics, run_cli, run_distributed, train_losses

TINY = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--seq-len", "32", "--steps", "12", "--warmup", "3",
        "--eval-every", "0", "--device", "cpu", "--dtype", "float32"]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------------------------------------------
# Newton-Schulz


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96)])
def test_newton_schulz_matches_torch(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ref = torch_newton_schulz(G, muon.QUINTIC, 5, 1e-7).float()  # torch runs it in bf16
    assert rel(muon.newton_schulz(G, dtype=torch.bfloat16), ref) == 0.0  # same arithmetic, bit for bit
    ours = muon.newton_schulz(G)  # fp32 on CPU: differs from the bf16 result only by bf16 rounding
    assert rel(ours, ref) < 0.03
    assert ours.dtype == torch.float32 and ours.shape == G.shape
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh  # the exact orthogonalisation: NS points the same way, up to the band
    assert (ours * polar).sum() / (ours.norm() * polar.norm()) > 0.97
    # transposing commutes with it, and a batch equals its matrices one by one
    assert torch.allclose(muon.newton_schulz(G.T), ours.T, atol=1e-5)
    batch = torch.stack([G[:32, :32], G[32:64, :32]])
    assert torch.allclose(muon.newton_schulz(batch)[1], muon.newton_schulz(G[32:64, :32]), atol=1e-6)


def test_newton_schulz_grows_small_singular_values():
    g = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    G = U @ torch.diag(torch.logspace(-3, 0, 64)) @ V.T  # condition number 1000
    sv = torch.linalg.svdvals(muon.newton_schulz(G))
    assert sv.max() < 1.25 and sv.min() > 0.1  # s = 1e-3 alone would stay ~1e-3 under plain scaling
    assert (sv > 0.6).sum() >= 50


# The band each schedule promises (muon.py's comments): every singular value of G / ||G||_F in [lo_in, 1]
# lands in [lo, hi] after 5 fp32 steps (the scalar map p(p(p(p(p(s))))) over [lo_in, 1]: quintic [0.682, 1.202]
# from 1.6e-3 up, Polar Express [0.859, 1.141] from 1.2e-3 up; 1e-3 gives 0.47 and 0.85: the condition matters).
BANDS = {"quintic": (2e-3, 0.68, 1.21), "polar_express": (2e-3, 0.85, 1.15)}
ORTHOGONALIZE = {"quintic": muon.newton_schulz, "polar_express": muon.polar_express}


def conditioned(seed, lo_in):
    """A Gaussian of a random rectangular shape, and a matrix whose normalised spectrum reaches down to lo_in."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = [(32, 128), (128, 32), (48, 96), (96, 64)][seed % 4]
    gauss = torch.randn(rows, cols, generator=g)
    k = min(rows, cols)  # full rank: no zero singular values (NS keeps 0 at 0)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=g))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=g))
    s = torch.exp(torch.empty(k).uniform_(-4, 0, generator=g))  # log-uniform in [e^-4, 1]
    c = 1.001 * lo_in  # the last one ends at 1.001 lo_in after normalising
    s[-1] = c * (s[:-1].square().sum() / (1 - c * c)).sqrt()
    return gauss, U @ torch.diag(s) @ V.T


@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_newton_schulz_band_holds_for_its_condition(coefficients):
    lo_in, lo, hi = BANDS[coefficients]
    seen = []
    for seed in range(24):
        for G in conditioned(seed, lo_in):
            s_in = torch.linalg.svdvals(G / G.norm())
            assert lo_in <= s_in.min() and s_in.max() <= 1  # the stated condition holds for this input
            sv = torch.linalg.svdvals(ORTHOGONALIZE[coefficients](G))
            assert lo <= sv.min() and sv.max() <= hi, (seed, sv.min().item(), sv.max().item())
            seen += [sv.min().item(), sv.max().item()]
    assert min(seen) < lo + 0.03 and max(seen) > hi - 0.08  # the band is tight, not a loose bound


def test_polar_express_ends_closer_to_one():
    """Polar Express's per-step quintics end closer to U V^T than the one quintic, in fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        worst = {"quintic": 0.0, "polar_express": 0.0}  # largest |s - 1| over 20 seeds
        for seed in range(20):
            G = conditioned(seed, 2e-3)[seed % 2]
            for name in worst:
                sv = torch.linalg.svdvals(ORTHOGONALIZE[name](G, dtype=dtype).float())
                worst[name] = max(worst[name], (sv - 1).abs().max().item())
        assert worst["polar_express"] < 0.16 and worst["polar_express"] < 0.6 * worst["quintic"], (dtype, worst)
    with pytest.raises(ValueError):
        muon.polar_express(G, steps=6)  # 5 published steps


def test_momentum_warmup_is_the_speedrun_ramp():
    assert [muon.momentum_at(s, 300, 0.95) for s in (0, 150, 300, 1000)] == pytest.approx([0.85, 0.90, 0.95, 0.95])
    assert muon.momentum_at(0, 0, 0.95) == 0.95  # off


def test_qk_clip_brings_each_hot_head_to_tau():
    """The probe's S_max equals the max of explicitly computed causal logits; after scaling c_attn's q, k rows
    (weights and biases) by qk_clip_factors, each head above tau peaks at exactly tau, the others unchanged."""
    torch.manual_seed(0)
    model = gpt2.GPT(gpt2.GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64))
    with torch.no_grad():  # larger q, k weights: logits of a few units, so some heads sit above tau
        for block in model.h:
            block.attn.c_attn.weight[:128].mul_(8)
    probe = muon.MaxLogitProbe(model)
    idx = torch.randint(0, 50257, (3, 32))
    model(idx)
    s_max = probe.take(1, gpt2.CommMeter())
    # by hand for layer 0: q k^T / sqrt(d) on ln_1 of the embeddings, causal
    x = model.h[0].ln_1(model.embed(idx))
    q, k, _ = model.h[0].attn.c_attn(x).chunk(3, dim=-1)
    q, k = (t.view(3, 32, 4, 16).transpose(1, 2) for t in (q, k))
    logits = (q @ k.mT / 4).masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(s_max[0], logits.amax(dim=(0, 2, 3)), rtol=1e-5)
    assert probe.take(1, gpt2.CommMeter())[0] == pytest.approx(s_max[0])  # that c_attn call was recorded too
    tau = s_max.median().item()
    assert (s_max > tau).sum() >= 3 and (s_max < tau).sum() >= 3
    factors = muon.qk_clip_factors(s_max, tau, 16)
    assert factors.shape == (2, 192) and (factors[:, 128:] == 1).all()  # v rows untouched
    with torch.no_grad():
        for block, f in zip(model.h, factors):
            block.attn.c_attn.weight.mul_(f[:, None])
            block.attn.c_attn.bias.mul_(f)
    model(idx)
    after = probe.take(1, gpt2.CommMeter())
    assert after[0] == pytest.approx(torch.where(s_max[0] > tau, tau, s_max[0]), rel=1e-4)  # layer 0: exactly tau
    assert after[1].max() < s_max[1].max()  # layer 1's input changed too: its hot heads came down
    model.eval()
    model(idx)  # evaluation forwards are not recorded
    assert (probe.take(1, gpt2.CommMeter()) == float("-inf")).all()


def test_qk_clip_factors_leave_cool_heads_alone():
    """Factor 1 for every head at or below tau, including negative and -inf maxima (a head that saw only
    negative logits, or no token at all); sqrt(tau / max) above it."""
    s_max = torch.tensor([[-3.0, float("-inf"), 0.0, 2.0], [2.0001, 8.0, 4.5, -0.0]])
    f = muon.qk_clip_factors(s_max, 2.0, 1)  # head_dim 1: row h of q (and of k) is head h
    want = torch.tensor([[1.0, 1.0, 1.0, 1.0], [(2 / 2.0001) ** 0.5, 0.5, (2 / 4.5) ** 0.5, 1.0]])
    assert torch.equal(f[:, :4], want) and torch.equal(f[:, 4:8], want) and (f[:, 8:] == 1).all()
    assert not torch.signbit(f).any()


# ----------------------------------------------------------------------------------------------------
# One step against torch.optim.Muon


@pytest.mark.parametrize("scale,nesterov", [("original", True), ("match_rms_adamw", True), ("original", False)])
def test_muon_steps_equal_torch_muon(scale, nesterov):
    g = torch.Generator().manual_seed(2)
    shapes = [(48, 16), (16, 48), (32, 32)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    lr, wd = 0.05, 0.1
    opt = muon.Muon(ours, lr=lr, weight_decay=wd, momentum=0.9, nesterov=nesterov, scale=scale, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(theirs, lr=lr, weight_decay=wd, momentum=0.9, nesterov=nesterov, adjust_lr_fn=scale)
    for step in range(3):  # three steps, so the momentum buffer matters
        grads = [torch.randn(s, generator=g) for s in shapes]
        before = [p.detach().clone() for p in ours]
        for p, q, gr in zip(ours, theirs, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.reduce_scatter_grads()
        opt.step()
        ref.step()
        for i, (p, q, b) in enumerate(zip(ours, theirs, before)):
            assert rel(p.detach() - b, q.detach() - b) < 1e-5, (step, i)  # the update itself, not just p
            assert torch.allclose(opt.momentum_buf[i], ref.state[q]["momentum_buffer"], atol=1e-6)
            assert (p.detach() - b).norm() > 0.01  # the step is not trivially small


# ----------------------------------------------------------------------------------------------------
# Distributed Muon == one rank


def block_shapes(E=32, layers=2):
    return [((3 * E, E), 3), ((E, E), 1), ((4 * E, E), 1), ((E, 4 * E), 1)] * layers


def grads_for(step, rank, shapes):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) for s, _ in shapes]


def make_params(shapes):
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.05) for s, _ in shapes]


def distributed_muon_run(rank, world, steps=3):
    shapes = block_shapes()
    params, params16 = make_params(shapes), make_params(shapes)
    opt = muon.Muon(params, [k for _, k in shapes], lr=0.02, weight_decay=0.1, rank=rank, world=world)
    opt16 = muon.Bf16Gather(params16, [k for _, k in shapes], lr=0.02, weight_decay=0.1, rank=rank,
                            world=world)  # the same, its updated matrices sent in bf16
    norms = []
    for step in range(steps):
        for p, q, gr in zip(params, params16, grads_for(step, rank, shapes)):
            p.grad, q.grad = gr, gr.clone()
        opt.reduce_scatter_grads()
        opt16.reduce_scatter_grads()
        sq = opt.grad_sq_norm()
        torch.distributed.all_reduce(sq)
        norms.append(sq.sqrt().item())
        opt.step(clip_coef=0.5)
        opt16.step(clip_coef=0.5)
    bf16 = ([p.detach().numpy() for p in params16], opt16.comm.take_mb())
    return [p.detach().numpy() for p in params], opt.mine, sorted(opt.momentum_buf), opt.comm.take_mb(), opt.slab, norms, bf16


def test_distributed_muon_equals_one_rank(world=4):  # 2 ranks: the CLI test below, end to end
    out = run_distributed(distributed_muon_run, world)
    shapes = block_shapes()
    params = make_params(shapes)
    ref = muon.Muon(params, [k for _, k in shapes], lr=0.02, weight_decay=0.1)
    norms = []
    for step in range(3):  # one rank, on the mean of the ranks' gradients
        all_grads = [grads_for(step, r, shapes) for r in range(world)]
        for i, p in enumerate(params):
            p.grad = sum(gs[i] for gs in all_grads) / world
        ref.reduce_scatter_grads()
        norms.append(ref.grad_sq_norm().sqrt().item())
        ref.step(clip_coef=0.5)
    for r, (ps, mine, momentum_keys, comm_mb, slab, rank_norms, (ps16, comm16)) in enumerate(out):
        assert rank_norms == pytest.approx(norms, rel=1e-5)  # the sharded grad norm is the global one
        for i, (p, q) in enumerate(zip(ps, params)):
            assert torch.allclose(torch.from_numpy(p), q.detach(), atol=1e-6, rtol=0), r  # every rank holds every updated matrix
            # bf16 gather: the owner's fp32 master follows the one-rank run as closely (its own arithmetic is
            # fp32), the other ranks hold it rounded to bf16, which is all a bf16 autocast forward reads
            p16 = torch.from_numpy(ps16[i])
            if i in mine:
                assert torch.allclose(p16, q.detach(), atol=1e-6, rtol=0), (r, i)
            else:
                assert torch.equal(p16, p16.bfloat16().float()) and torch.allclose(p16, q.detach(), rtol=2 ** -8, atol=1e-6)  # bf16 unit roundoff
        assert mine == momentum_keys  # momentum lives only with the owner
        # bytes: per step one reduce-scatter and one all-gather of world slabs of fp32, 2(N-1)/N x S;
        # with the bf16 gather (N-1)/N x S + (N-1)/N x S/2
        assert comm_mb == pytest.approx(3 * 2 * (world - 1) / world * world * slab * 4 / 1e6)
        assert comm16 == pytest.approx(3 * 1.5 * (world - 1) / world * world * slab * 4 / 1e6)
    owned = sorted(i for _, mine, *_ in out for i in mine)
    assert owned == list(range(len(shapes)))  # each matrix has exactly one owner
    load = [sum(muon.ns_flops(shapes[i][0], shapes[i][1]) for i in mine) for _, mine, *_ in out]
    assert max(load) <= 4 / 3 * sum(load) / world + max(muon.ns_flops(s, k) for s, k in shapes)


def test_assign_owners_balances_work():
    assert muon.assign_owners([6, 18, 14, 18], 2) == [1, 0, 0, 1]  # largest first: 18 | 18, 14 -> 0, 6 -> 1
    costs = [muon.ns_flops(s, k) for s, k in block_shapes(64, 12)]
    loads = [0] * 8
    for c, r in zip(costs, muon.assign_owners(costs, 8)):
        loads[r] += c
    assert max(loads) / min(loads) < 1.1


# ----------------------------------------------------------------------------------------------------
# The training CLI


def test_cli_two_ranks_equal_one_and_adamw_equals_gpt2(shakespeare, tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    with ThreadPoolExecutor(1) as pool:  # torchrun starts while this process trains the 1-rank reference
        job = pool.submit(run_cli, ["muon.py", *TINY, "--data", shakespeare, "--batch-size", "4", "--out", two], nproc=2)
        muon.main([*TINY, "--data", shakespeare, "--batch-size", "8", "--out", one])
        job.result()
    a, b = train_losses(one), train_losses(two)
    assert len(a) == 12 and max_rel_diff(b, a) <= 1e-4
    assert a[-1] < a[0] - 0.3  # it trains
    w1 = torch.load(os.path.join(one, "model.pt"))["model"]
    w2 = torch.load(os.path.join(two, "model.pt"))["model"]
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=2e-5, rtol=0), k
    # bytes per step on a rank: the AdamW all-reduce (+ the loss), the Muon reduce-scatter and all-gather
    # (padded slabs), the clip norm's scalar
    model = gpt2.build_model(make_args(shakespeare))
    m, parts, rest = muon.split_params(model, "muon")
    opt = muon.Muon(m, parts, world=2)
    n_adamw = sum(p.numel() for p in rest) + 1
    theory = (2 * 0.5 * n_adamw * 4 + 2 * 0.5 * 2 * opt.slab * 4 + 2 * 0.5 * 4) / 1e6
    comm = [r["comm_mb"] for r in read_metrics(two) if "loss" in r]
    assert comm == pytest.approx([theory] * 12, rel=1e-9)
    assert opt.padding < 0.3 * sum(p.numel() for p in m)

    # --optimizer adamw is gpt2.py's trainer, step for step; Muon trains differently (faster here)
    adam, base = str(tmp_path / "adam"), str(tmp_path / "base")
    six = ["--data", shakespeare, "--batch-size", "8", "--steps", "6"]  # 6 steps: the loop is the same every step
    muon.main([*TINY, *six, "--optimizer", "adamw", "--out", adam])
    gpt2.train([*TINY, *six, "--out", base])
    assert max_rel_diff(train_losses(adam), train_losses(base)) <= 1e-5
    # what Muon changes: its total update to a block matrix is spread over many directions (stable rank
    # ||D||_F^2 / ||D||_2^2 of D = W_12 - W_0 is ~30 of 64 possible), AdamW's is dominated by a few (~1-3)
    init = model.state_dict()
    w_adam = torch.load(os.path.join(adam, "model.pt"))["model"]
    for k in ("h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "h.1.attn.c_proj.weight", "h.1.mlp.c_proj.weight"):
        assert stable_rank(w1[k] - init[k]) > 15 and stable_rank(w_adam[k] - init[k]) < 8, k


def test_bf16_two_ranks_equal_own_one_rank(shakespeare, tmp_path):
    """Issue 15: bf16 autocast, 2 ranks (bf16 gather of the updated matrices) against its own one-rank bf16 run."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    bf16 = [*TINY, "--steps", "3", "--dtype", "bfloat16", "--data", shakespeare]
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(run_cli, ["muon.py", *bf16, "--batch-size", "4", "--out", two], nproc=2)
        muon.main([*bf16, "--batch-size", "8", "--out", one])
        job.result()
    a, b = train_losses(one), train_losses(two)
    assert len(a) == 3 and max_rel_diff(b, a) <= BF16_TOL, (a, b)
    w1 = torch.load(os.path.join(one, "model.pt"))["model"]
    w2 = torch.load(os.path.join(two, "model.pt"))["model"]
    # weights within two AdamW steps' worth (2 x the summed lr, 4e-3; measured 2.3e-3): the key bias's gradient is
    # ~0 (softmax ignores it), so AdamW's sign of rounding noise differs between the runs
    assert max((w2[k] - w1[k]).abs().max().item() for k in w1) < 4e-3
    # bytes: AdamW all-reduce (+ loss) and the clip scalar in fp32, Muon's reduce-scatter in fp32, its all-gather in bf16
    model = gpt2.build_model(make_args(shakespeare))
    m, parts, rest = muon.split_params(model, "muon")
    opt = muon.Muon(m, parts, world=2)
    theory = (2 * 0.5 * (sum(p.numel() for p in rest) + 1) * 4 + 0.5 * 2 * opt.slab * (4 + 2) + 2 * 0.5 * 4) / 1e6
    assert [r["comm_mb"] for r in read_metrics(two) if "loss" in r] == pytest.approx([theory] * 3, rel=1e-9)


BF16_TOL = 1e-4  # relative, per step (measured 6.7e-6): bf16 matmuls on batches of 4 vs 8 round differently


def test_compile_equals_eager(shakespeare, tmp_path):
    """Issue 15: --compile (the model; the optimizer stays eager) gives eager's losses at steps 0-2."""
    run = [*TINY, "--steps", "3", "--data", shakespeare, "--batch-size", "8"]
    eager = muon.main([*run, "--out", str(tmp_path / "eager")])
    compiled = muon.main([*run, "--compile", "--out", str(tmp_path / "compiled")])
    a, b = [r["loss"] for r in eager if "loss" in r], [r["loss"] for r in compiled if "loss" in r]
    assert len(a) == 3 and max_rel_diff(b, a) <= 1e-5, (a, b)


def stable_rank(D):
    s = torch.linalg.svdvals(D)
    return ((s ** 2).sum() / s[0] ** 2).item()


def make_args(data):
    return muon.make_parser().parse_args([*TINY, "--data", data])


@pytest.mark.parametrize("flags,error", [
    (["--momentum", "1.0"], ValueError), (["--ns-steps", "0"], ValueError), (["--muon-lr", "-1"], ValueError),
    (["--n-embd", "63"], ValueError), (["--seq-len", "4096"], ValueError), (["--data", "/nonexistent"], ValueError),
    (["--muon-weight-decay", "-0.1"], ValueError), (["--momentum-warmup", "-1"], ValueError),
    (["--ns-coefficients", "polar_express", "--ns-steps", "6"], ValueError), (["--qk-clip", "-1"], ValueError),
    (["--qk-clip", "50", "--optimizer", "adamw"], ValueError), (["--log-max-logit", "--compile"], ValueError),
])
def test_bad_flags_fail_before_any_collective(flags, error, random_data, tmp_path, monkeypatch):
    def no_setup(args):
        raise AssertionError("setup reached: the error must come before the process group starts")
    monkeypatch.setattr(gpt2, "setup", no_setup)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: nothing may reach a collective
    with pytest.raises(error):
        muon.main([*TINY, "--data", random_data, "--out", str(tmp_path), *flags])
    with pytest.raises(ValueError):
        muon.Muon([torch.nn.Parameter(torch.zeros(3))])  # 1-D: not Muon's
    with pytest.raises(ValueError):
        muon.Muon([torch.nn.Parameter(torch.zeros(4, 4))], scale="adam")


# ----------------------------------------------------------------------------------------------------
# Each extension flag reaches the training loop: one-step runs against a reference computed here


def first_step_reference(data):
    """The step-0 gradient of every parameter (same init, same first batch as muon.main) and each head's
    S_max in that forward. At step 0 the Nesterov direction is (1 - mu^2) g and the clip a scalar, so
    after Newton-Schulz (scale-free) each Muon matrix moves by -lr0 x scale x NS(g) whatever the momentum."""
    args = muon.make_parser().parse_args([*TINY, "--data", data, "--batch-size", "8"])
    model = gpt2.build_model(args)
    probe = muon.MaxLogitProbe(model)
    loader, _ = gpt2.make_loaders(args, 0, 1, model.config.vocab_size)
    gpt2.accumulate_grads(lambda x, y: model(x, y)[1], loader, args, "cpu")
    return model, probe.take(1, gpt2.CommMeter())


def one_step(data, out, *flags):
    recs = muon.main([*TINY, "--data", data, "--batch-size", "8", "--steps", "1", "--out", out, *flags])
    return torch.load(os.path.join(out, "model.pt"))["model"], [r for r in recs if "loss" in r][0]


def test_extension_flags_change_the_first_step_as_computed(shakespeare, tmp_path):
    model, s_max = first_step_reference(shakespeare)
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    base, rec = one_step(shakespeare, str(tmp_path / "base"))
    lr0 = rec["muon_lr"]
    muon_keys = [k for k, p in params.items() if p.dim() == 2 and k.startswith("h.")]

    def expected(k, coefficients):  # W0 - lr0 x scale x NS(g), c_attn as three blocks
        g, parts = params[k].grad, 3 if k.endswith("c_attn.weight") else 1
        rows, cols = g.size(0) // parts, g.size(1)
        o = ORTHOGONALIZE[coefficients](g.view(parts, rows, cols)).view_as(g)
        return w0[k] - lr0 * muon.update_scale(rows, cols, "original") * o

    # --ns-coefficients: the default run takes the quintic's step, the flag's run Polar Express's
    polar, _ = one_step(shakespeare, str(tmp_path / "polar"), "--ns-coefficients", "polar_express")
    for k in muon_keys:
        assert rel(base[k] - w0[k], expected(k, "quintic") - w0[k]) < 1e-4, k
        assert rel(polar[k] - w0[k], expected(k, "polar_express") - w0[k]) < 1e-4, k
        assert rel(polar[k] - w0[k], base[k] - w0[k]) > 0.02, k  # the two really differ

    # --muon-weight-decay: the Muon matrices, and only they, end lower by exactly lr0 x wd x W0
    wd, _ = one_step(shakespeare, str(tmp_path / "wd"), "--muon-weight-decay", "5")
    for k in w0:
        if k in muon_keys:
            assert torch.allclose(wd[k] - base[k], -lr0 * 5 * w0[k], atol=1e-7, rtol=1e-3), k
        else:
            assert torch.equal(wd[k], base[k]), k

    # --qk-clip: after the step, each head's q and k rows (weights and biases) times sqrt(tau / S_max), v untouched
    tau = s_max.median().item()
    assert (s_max > tau).sum() >= 2
    clip, crec = one_step(shakespeare, str(tmp_path / "clip"), "--qk-clip", str(tau))
    factors = muon.qk_clip_factors(s_max, tau, 64 // 4)  # (n_layer, 3C)
    assert crec["clipped_heads"] == int((s_max > tau).sum()) and crec["max_logit"] == pytest.approx(s_max.max().item(), rel=1e-5)
    for k in w0:
        if ".attn.c_attn." in k:
            f = factors[int(k.split(".")[1])]
            assert torch.allclose(clip[k], base[k] * (f[:, None] if k.endswith("weight") else f), atol=1e-7, rtol=1e-5), k
            assert not torch.equal(clip[k], base[k]), k
        else:
            assert torch.equal(clip[k], base[k]), k


def test_momentum_warmup_reaches_the_loop(shakespeare, tmp_path):
    """--momentum-warmup 1000000 keeps the momentum at 0.85 (+1e-7 per step) for 3 steps: the run equals
    --momentum 0.85 (the flag reaches Muon's step), not the default 0.95 it would equal if it were ignored."""
    run = [*TINY, "--data", shakespeare, "--batch-size", "8", "--steps", "3"]
    warm = muon.main([*run, "--momentum-warmup", "1000000", "--out", str(tmp_path / "warm")])
    muon.main([*run, "--momentum", "0.85", "--out", str(tmp_path / "low")])
    muon.main([*run, "--out", str(tmp_path / "default")])
    w_warm, w_low, w_default = (torch.load(str(tmp_path / d / "model.pt"))["model"] for d in ("warm", "low", "default"))
    assert [r["momentum"] for r in warm if "loss" in r] == pytest.approx([0.85] * 3, abs=1e-6)
    for k in w_warm:
        if k.startswith("h.") and w_warm[k].dim() == 2:
            assert rel(w_warm[k] - w_default[k], w_low[k] - w_default[k]) < 1e-3, k  # the 0.85 run's difference
            assert (w_low[k] - w_default[k]).norm() > 1e-4 * w_default[k].norm(), k  # momentum matters by step 2


def test_nonfinite_last_step_is_not_saved(shakespeare, tmp_path, monkeypatch):
    """Issue 25: the loss is checked before the update, so a last update that diverges must be caught by
    the weight check before model.pt is written."""
    step = muon.Muon.step

    def diverging(self, *a, **k):
        step(self, *a, **k)
        self.params[0].data[0, 0] = float("nan")
    monkeypatch.setattr(muon.Muon, "step", diverging)
    out = tmp_path / "nan"
    with pytest.raises(gpt2.UsageError, match="weights are not finite after step 0"):
        muon.main([*TINY, "--data", shakespeare, "--batch-size", "8", "--steps", "1", "--out", str(out)])
    assert not (out / "model.pt").exists()
