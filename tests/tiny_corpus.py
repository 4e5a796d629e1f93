"""A prepared corpus small enough to build in a second, for the align and init_from tests."""

from __future__ import annotations

import random
from pathlib import Path


def build_tiny_corpus(root: Path, seq_len: int = 32) -> Path:
    from lib.corpus import prepare_corpus, split_train_val

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "def", "return", "(", ")", ":", "x", "y", "=", "+", "\n"]
    docs = [(f"doc{i}", f"document {i}\n" + " ".join(rng.choice(words) for _ in range(200))) for i in range(12)]
    train, val = split_train_val(docs, 10)
    out = root / "tiny"
    prepare_corpus(train, val, out, seq_len=seq_len, vocab_size=300, shard_sequences=16)
    return out


def tiny_overrides(corpus: Path, *extra: str) -> list[str]:
    """The smoke experiment on the tiny corpus, quiet."""
    return ["+exp=smoke", f"data.sources=[{{name:tiny,path:{corpus},weight:1.0}}]", "logger.wandb=disabled", "trainer.progress=false", *extra]
