"""Shared test setup: the repo root on sys.path, the offline tiktoken cache, prepared data."""
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, ROOT)
if os.path.isdir(os.path.join(SHARED, "tiktoken")):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(SHARED, "tiktoken"))


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
def random_data(tmp_path_factory):
    """Random-token shards (no tokenizer needed): two train shards and one val shard."""
    import gpt2
    out = str(tmp_path_factory.mktemp("random"))
    rng = np.random.default_rng(0)
    gpt2.write_shard(os.path.join(out, "train_000000.bin"), rng.integers(0, 50257, 20_000))
    gpt2.write_shard(os.path.join(out, "train_000001.bin"), rng.integers(0, 50257, 20_000))
    gpt2.write_shard(os.path.join(out, "val_000000.bin"), rng.integers(0, 50257, 5_000))
    return out
