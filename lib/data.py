"""Reading prepared corpora with Grain: shuffled, process-sharded, prefetched, checkpointable.

The global batch at optimizer step s is a pure function of (seed, s): the
samples at positions [s*B, (s+1)*B) of a per-epoch reshuffled stream. Process p
of P reads only rows [p*B/P, (p+1)*B/P) of it, so the global batch is the same
whatever the number of processes, and resuming needs nothing but the step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from lib.config import DataConfig
from lib.corpus import MANIFEST, PAD_ID, DataError, load_tokenizer, stdlib_corpus


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXPRETRAIN_CACHE") or Path.home() / ".cache" / "jaxpretrain")


@dataclass
class Corpus:
    name: str
    folder: Path
    manifest: dict

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / self.manifest["tokenizer"]

    def tokenizer(self):
        return load_tokenizer(self.tokenizer_path)


def open_corpus(name: str, folder: str | Path) -> Corpus:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(f"no prepared corpus at {folder} (missing {MANIFEST}); build one with python -m recipes.prepare_data")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc.msg}); re-run recipes.prepare_data into a new folder") from exc
    if manifest["splits"]["train"]["sequences"] == 0:
        raise DataError(f"the corpus at {folder} has no training sequences; prepare it from non-empty files")
    return Corpus(name, folder, manifest)


def resolve_corpora(cfg: DataConfig, vocab_size: int) -> list[Corpus]:
    """Every configured source as an opened corpus, building the stdlib one if needed."""
    corpora = []
    for src in cfg.sources:
        if src.path == "stdlib":
            folder = stdlib_corpus(
                cfg.cache_dir or default_cache_dir(), seq_len=cfg.seq_len, vocab_size=vocab_size,
                max_bytes=cfg.stdlib_max_bytes, val_percent=cfg.val_percent,
            )
        else:
            folder = Path(src.path).expanduser()
        corpus = open_corpus(src.name, folder)
        check_compatible(corpus, cfg.seq_len, vocab_size)
        corpora.append(corpus)
    return corpora


def check_compatible(corpus: Corpus, seq_len: int, vocab_size: int) -> None:
    m = corpus.manifest
    if m["seq_len"] != seq_len:
        raise DataError(
            f"corpus '{corpus.name}' at {corpus.folder} is packed to seq_len={m['seq_len']} but data.seq_len={seq_len}; "
            f"set data.seq_len={m['seq_len']} or prepare the data again"
        )
    if m["max_token_id"] >= vocab_size:
        raise DataError(
            f"corpus '{corpus.name}' has token id {m['max_token_id']} but model.vocab_size={vocab_size}; "
            f"set model.vocab_size>={m['max_token_id'] + 1}"
        )


class PackedSequences:
    """Random access over a split's memory-mapped shards; item i is {tokens, source, index}."""

    def __init__(self, corpus: Corpus, split: str, source_id: int = 0):
        info = corpus.manifest["splits"][split]
        self._shards = [np.load(corpus.folder / s["file"], mmap_mode="r") for s in info["shards"]]
        self._starts = np.cumsum([0] + [len(s) for s in self._shards])
        self._source_id = source_id
        self.vocab_limit = corpus.manifest["vocab_size"]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> dict:
        shard = int(np.searchsorted(self._starts, index, side="right") - 1)
        tokens = np.asarray(self._shards[shard][index - self._starts[shard]], dtype=np.int32)
        return {"tokens": tokens, "source": np.int32(self._source_id), "index": np.int64(index)}


def to_model_batch(rows: dict, vocab_size: int, document_mask: bool = False) -> dict:
    """Stacked samples -> model inputs, checking token ids at the boundary (JAX would clamp them silently)."""
    tokens = rows["tokens"]
    top = int(tokens.max())
    if top >= vocab_size or int(tokens.min()) < 0:
        raise DataError(
            f"token id {top} is outside the vocabulary [0, {vocab_size}) in samples {rows['index'].tolist()}; "
            "the data and model.vocab_size disagree: prepare the data with this tokenizer or raise model.vocab_size"
        )
    batch = {"tokens": tokens, "mask": tokens != PAD_ID, "source": rows["source"], "index": rows["index"]}
    if document_mask:
        # A new document starts after each EOS: segment id = number of EOS tokens before this position.
        eos_before = np.cumsum(tokens == 1, axis=1) - (tokens == 1)
        batch["segment_ids"] = eos_before.astype(np.int32)
    return batch


def mixture(datasets: list[grain.MapDataset], weights: list[float]) -> grain.MapDataset:
    if len(datasets) == 1:
        return datasets[0]
    return grain.MapDataset.mix(datasets, weights)


def train_batches(
    corpora: list[Corpus],
    cfg: DataConfig,
    *,
    global_batch: int,
    vocab_size: int,
    process_index: int = 0,
    process_count: int = 1,
    weights: list[float] | None = None,
) -> grain.IterDataset:
    """An endless, checkpointable iterator source of this process's share of each global batch."""
    if global_batch % process_count:
        raise DataError(
            f"trainer.batch_size={global_batch} is not divisible by the {process_count} processes; "
            "make the batch a multiple of the process count"
        )
    local_batch = global_batch // process_count
    per_source = [
        grain.MapDataset.source(PackedSequences(c, "train", i)).shuffle(seed=cfg.shuffle_seed).repeat(None)
        for i, c in enumerate(corpora)
    ]
    ds = mixture(per_source, weights or [1.0] * len(corpora))
    # Local batches j = s*P + p belong to process p at step s: contiguous rows of the global batch.
    ds = ds.batch(local_batch)[process_index::process_count]
    ds = ds.map(lambda rows: to_model_batch(rows, vocab_size, cfg.document_mask))
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch))


def val_batches(corpus: Corpus, cfg: DataConfig, *, batch_size: int, n_batches: int, vocab_size: int) -> list[dict]:
    """The first `n_batches` of the held-out split, in order: the same batches at every evaluation."""
    src = PackedSequences(corpus, "val")
    # Whole batches only, so evaluation compiles once; a tiny split gives one short batch.
    n = min(len(src), batch_size * n_batches)
    n = n - n % batch_size if n >= batch_size else n
    if n == 0:
        return []
    rows = [src[i] for i in range(n)]
    out = []
    for start in range(0, n, batch_size):
        chunk = rows[start : start + batch_size]
        stacked = {k: np.stack([r[k] for r in chunk]) for k in chunk[0]}
        out.append(to_model_batch(stacked, vocab_size, cfg.document_mask))
    return out
