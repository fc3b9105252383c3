"""Shared test setup: the repo root on sys.path, the offline tiktoken cache, prepared data, and
`pytest --impl DIR`: the technique tests run the technique files found in DIR (a student's copies, see
tests/exercise.py), the repository's own for the files DIR lacks, in-process imports and launches alike."""
import contextlib
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, ROOT)
if os.path.isdir(os.path.join(SHARED, "tiktoken")):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(SHARED, "tiktoken"))

# glibc's malloc hands every large freed block back to the kernel and faults it in again, zeroed, at the next step:
# on 2 cores that was a quarter of a tiny run's time (ddp.py, 20 steps: 18.2 -> 13.8 s; sys 10.6 -> 3.4 s). Keep freed
# memory in the heap: in this process (mallopt) and in every process the tests start (they inherit the environment).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": (-3, 1 << 27), "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30), "MALLOC_TOP_PAD_": (-2, 1 << 28)}
for _name, (_param, _value) in MALLOC.items():
    os.environ.setdefault(_name, str(_value))
    if sys.platform.startswith("linux"):
        import ctypes
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").mallopt(_param, _value)


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory):
    """../shared/data/tinyshakespeare.txt prepared as GPT-2 shards (train 301,966 / val 36,059 tokens)."""
    import gpt2
    text = os.path.join(SHARED, "data", "tinyshakespeare.txt")
    assert os.path.exists(text), f"the tests need {text} (see ../shared/README.md)"
    out = str(tmp_path_factory.mktemp("shakespeare"))
    gpt2.prepare_text(text, out)
    return out


@pytest.fixture(scope="session")
def shakespeare_char(tmp_path_factory):
    """The course data: Tiny Shakespeare, one token per character (65; train 1,003,854 / val 111,540)."""
    import gpt2
    out = str(tmp_path_factory.mktemp("shakespeare_char"))
    gpt2.prepare_text(os.path.join(SHARED, "data", "tinyshakespeare.txt"), out, tokenizer="char")
    return out


@pytest.fixture(scope="session")
def random_data(tmp_path_factory):
    """Random-token shards (no tokenizer needed): two train shards and one val shard."""
    import gpt2
    out = str(tmp_path_factory.mktemp("random"))
    rng = np.random.default_rng(0)
    gpt2.write_shard(os.path.join(out, "train_000000.bin"), rng.integers(0, 50257, 20_000))
    gpt2.write_shard(os.path.join(out, "train_000001.bin"), rng.integers(0, 50257, 20_000))
    gpt2.write_shard(os.path.join(out, "val_000000.bin"), rng.integers(0, 50257, 5_000))
    return out


def pytest_addoption(parser):
    parser.addoption("--impl", metavar="DIR", help="test the technique files in DIR (your copies) instead of the "
                     "repository's; files DIR lacks come from the repository")


def pytest_configure(config):
    impl = config.getoption("--impl")
    if impl:
        impl = os.path.abspath(impl)
        if not os.path.isdir(impl):
            raise pytest.UsageError(f"--impl {impl}: not a directory (give the directory holding your copies)")
        for name in sorted(os.listdir(impl)):  # a copy that does not parse: one line, not a collection traceback
            if name.endswith(".py") and name[:-3] in TECHNIQUES:
                try:
                    with open(os.path.join(impl, name)) as f:
                        compile(f.read(), name, "exec")
                except SyntaxError as e:
                    raise pytest.UsageError(f"{impl}/{name} line {e.lineno}: {e.msg} (--impl): fix the syntax "
                                            f"and run again") from None
        os.environ["GPT2_IMPL"] = impl  # harness.script() and every launch read it; spawned ranks inherit it
        sys.path.insert(0, impl)


TECHNIQUES = ("gpt2", "ddp", "fsdp2", "tensor_parallel", "pipeline", "moe_ep", "fp8", "muon", "checkpoint")


def pytest_collection_modifyitems(session, config, items):
    """--impl DIR must hold the file each selected test module checks (tests/test_ddp.py checks ddp.py): a DIR
    without it would silently test the repository's own file and pass."""
    impl = os.environ.get("GPT2_IMPL")
    if not impl or not config.getoption("--impl"):
        return
    wanted = sorted({f"{m}.py" for m in (os.path.basename(str(i.fspath))[5:-3] for i in items) if m in TECHNIQUES})
    missing = [f for f in wanted if not os.path.exists(os.path.join(impl, f))]
    if missing:
        raise pytest.UsageError(f"{impl} has no {', '.join(missing)} (--impl): write your copy there "
                                f"(python tests/exercise.py {missing[0]} --out {impl}) or select only the tests of the "
                                f"files it holds")


def pytest_report_header(config):
    impl = os.environ.get("GPT2_IMPL")
    if impl and config.getoption("--impl"):
        mine = sorted(f for f in os.listdir(impl) if f.endswith(".py") and f[:-3] in TECHNIQUES)
        return f"--impl {impl}: {', '.join(mine) or 'no technique file'} from there; every other file from the repository"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under --impl, a failing test says which figure differs first and what that usually means."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or not os.environ.get("GPT2_IMPL"):
        return
    import harness
    from exercise import hint_for
    lines = harness.first_differences()
    hint = None if any("which usually means" in line for line in lines) else hint_for(item.module.__name__)
    if lines or hint:
        report.sections.append(("what differs", "\n".join(lines + ([f"hint: {hint}"] if hint else []))))


@pytest.fixture(autouse=True)
def _fresh_comparisons():
    import harness
    harness.COMPARED.clear()
