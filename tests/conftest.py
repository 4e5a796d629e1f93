"""Shared fixtures: a private corpus cache and tiny corpora that tests build themselves."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session", autouse=True)
def private_corpus_cache(tmp_path_factory):
    """Build the stdlib corpus once per session in a temp cache, never in the user's home."""
    cache = tmp_path_factory.mktemp("corpus-cache")
    old = os.environ.get("JAXPRETRAIN_CACHE")
    os.environ["JAXPRETRAIN_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("JAXPRETRAIN_CACHE", None)
    else:
        os.environ["JAXPRETRAIN_CACHE"] = old


def write_text_files(folder: Path, n: int = 12, words: int = 300) -> Path:
    """Small synthetic documents with learnable structure (repeated phrases)."""
    import random

    rng = random.Random(0)
    vocab = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", ":", "x", "y", "=", "+", "\n"]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        text = " ".join(rng.choice(vocab) for _ in range(words))
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}\n{text}\n")
    return folder


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A prepared corpus (seq_len 32, vocab <= 300) from synthetic text."""
    from lib.corpus import prepare_corpus, read_documents, split_train_val

    src = write_text_files(tmp_path_factory.mktemp("text"))
    out = tmp_path_factory.mktemp("prepared") / "tiny"
    train, val = split_train_val(list(read_documents([str(src / "*.txt")])), 10)
    prepare_corpus(train, val, out, seq_len=32, vocab_size=300, shard_sequences=16)
    return out


def smoke_overrides(run_dir: Path, *extra: str) -> list[str]:
    return ["+exp=smoke", f"run_dir={run_dir}", "trainer.progress=false", "logger.wandb=disabled", *extra]
