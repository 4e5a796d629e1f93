"""Turning text into a prepared corpus: tokenizer, packed token shards and a manifest.

A prepared corpus is a folder:

    tokenizer.json            HF tokenizers byte-level BPE (trained here, or the user's)
    train-00000.npy ...       packed sequences [n, seq_len], uint16/uint32, memory-mappable
    val-00000.npy ...         the held-out split, same format
    manifest.json             tokenizer, sources, token counts, checksums; written last

Documents are separated by EOS and packed back to back into fixed-length
sequences; only the very last sequence of a split is padded (pad id 0), and
padding is masked out of the loss. The folder is built under a temporary name
and renamed into place, so a crash never leaves a half corpus that looks whole.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

FORMAT_VERSION = 1
PAD, EOS = "<|pad|>", "<|eos|>"
PAD_ID, EOS_ID = 0, 1
MANIFEST = "manifest.json"


class DataError(ValueError):
    """A user-facing data problem; the message names the fix."""


Document = tuple[str, str]  # (name, text)


def _hash_percent(name: str) -> int:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 100


def split_train_val(docs: Iterable[Document], val_percent: int) -> tuple[list[Document], list[Document]]:
    """Hold out a fixed set of documents, chosen by a hash of their name (stable across runs and machines)."""
    train, val = [], []
    for doc in docs:
        (val if _hash_percent(doc[0]) < val_percent else train).append(doc)
    if not val and train:  # tiny corpora: still keep something to validate on
        val.append(train.pop())
    return train, val


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not ({"site-packages", "dist-packages"} & set(p.parts))]
    return sorted(files, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())


def stdlib_documents(max_bytes: int) -> list[Document]:
    """Python's own standard-library sources, in a fixed hash order, up to `max_bytes` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        docs.append((str(path.relative_to(root)), text))
        total += len(text)
        if total >= max_bytes:
            break
    return docs


def read_documents(patterns: list[str], text_key: str = "text") -> Iterator[Document]:
    """Documents from globs: plain text files (one document each), .jsonl (a field per line), .parquet (a column)."""
    paths = sorted({p for pat in patterns for p in glob.glob(os.path.expanduser(pat), recursive=True) if os.path.isfile(p)})
    if not paths:
        raise DataError(f"no input files match {patterns}; check the path or glob (quote it so the shell leaves it alone)")
    # Documents are named relative to the files' common folder, so the held-out split (a hash of
    # the name) stays the same when the data moves to another folder or machine.
    root = os.path.dirname(paths[0]) if len(paths) == 1 else os.path.commonpath(paths)
    for path in paths:
        name = os.path.relpath(path, root)
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if line.strip():
                        row = json.loads(line)
                        if text_key not in row:
                            raise DataError(f"{path}:{i + 1} has no '{text_key}' field; pass --text-key with the right field name")
                        yield f"{name}:{i}", str(row[text_key])
        elif path.endswith(".parquet"):
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if text_key not in table.column_names:
                raise DataError(f"{path} has no column '{text_key}'; pass --text-key with one of {table.column_names}")
            for i, text in enumerate(table.column(text_key).to_pylist()):
                yield f"{name}:{i}", str(text)
        else:
            try:
                yield name, Path(path).read_text(encoding="utf-8")
            except UnicodeDecodeError:
                print(f"skipping {path}: not UTF-8 text", file=sys.stderr)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style): any input is encodable, no unknown tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS],  # ids 0 and 1, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise DataError(f"tokenizer file {path} not found; give the path to a tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    for token, want in ((PAD, PAD_ID), (EOS, EOS_ID)):
        if tok.token_to_id(token) != want:
            raise DataError(f"tokenizer {path} must have {token} at id {want}; train one with recipes.prepare_data")
    return tok


def pack_sequences(token_lists: Iterable[list[int]], seq_len: int) -> np.ndarray:
    """Concatenate documents (each followed by EOS) and cut into [n, seq_len]; pad the tail with PAD_ID."""
    stream = []
    for ids in token_lists:
        stream.extend(ids)
        stream.append(EOS_ID)
    n = -(-len(stream) // seq_len)
    out = np.full((n * seq_len,), PAD_ID, dtype=np.int64)
    out[: len(stream)] = stream
    return out.reshape(n, seq_len)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_split(folder: Path, split: str, seqs: np.ndarray, shard_sequences: int, dtype) -> dict:
    shards = []
    for i, start in enumerate(range(0, len(seqs), shard_sequences)):
        name = f"{split}-{i:05d}.npy"
        np.save(folder / name, seqs[start : start + shard_sequences].astype(dtype))
        shards.append({"file": name, "sequences": int(min(shard_sequences, len(seqs) - start)), "sha256": _sha256(folder / name)})
    return {
        "shards": shards,
        "sequences": int(len(seqs)),
        "tokens": int((seqs != PAD_ID).sum()),
    }


def _tokenize(tok, docs: list[Document], desc: str, batch: int = 256) -> Iterator[list[int]]:
    bar = tqdm(total=sum(len(t) for _, t in docs), desc=desc, unit="B", unit_scale=True, leave=False)
    for start in range(0, len(docs), batch):
        chunk = docs[start : start + batch]
        for enc in tok.encode_batch([t for _, t in chunk]):
            yield enc.ids
        bar.update(sum(len(t) for _, t in chunk))
    bar.close()


def prepare_corpus(
    train_docs: list[Document],
    val_docs: list[Document],
    out_dir: str | Path,
    *,
    seq_len: int,
    vocab_size: int,
    tokenizer_path: str | Path | None = None,
    shard_sequences: int = 8192,
    sources: dict | None = None,
) -> dict:
    """Tokenize, pack and write a corpus folder atomically; returns its manifest."""
    out_dir = Path(out_dir)
    if not train_docs or not any(t.strip() for _, t in train_docs):
        raise DataError(f"the corpus for {out_dir} is empty; give input files that contain text")
    if seq_len < 2:
        raise DataError(f"seq_len={seq_len} is too short; use seq_len>=2")
    if tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
    else:
        tok = train_tokenizer((t for _, t in train_docs), vocab_size)
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max else np.uint32

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        splits, max_id = {}, 0
        for split, docs in (("train", train_docs), ("val", val_docs)):
            seqs = pack_sequences(_tokenize(tok, docs, f"tokenizing {split}"), seq_len)
            max_id = max(max_id, int(seqs.max()))
            splits[split] = _write_split(tmp, split, seqs, shard_sequences, dtype) | {"documents": len(docs)}
        manifest = {
            "format_version": FORMAT_VERSION,
            "seq_len": seq_len,
            "vocab_size": vocab,
            "max_token_id": max_id,
            "dtype": np.dtype(dtype).name,
            "tokenizer": "tokenizer.json",
            "tokenizer_sha256": _sha256(tmp / "tokenizer.json"),
            "pad_id": PAD_ID,
            "eos_id": EOS_ID,
            "sources": sources or {},
            "splits": splits,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if out_dir.exists():
            raise DataError(f"{out_dir} already exists; choose a new output folder or remove the old one yourself")
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def stdlib_corpus(cache_dir: str | Path, *, seq_len: int, vocab_size: int, max_bytes: int, val_percent: int) -> Path:
    """The embedded default corpus, built on first use and cached by its settings."""
    settings = {
        "v": FORMAT_VERSION,
        "python": sys.version.split()[0],
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "max_bytes": max_bytes,
        "val_percent": val_percent,
    }
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(cache_dir) / f"stdlib-{key}"
    if (folder / MANIFEST).is_file():
        return folder
    docs = stdlib_documents(max_bytes)
    if not docs:
        raise DataError("found no Python standard-library sources to build the default corpus; point data.sources at a prepared folder")
    train, val = split_train_val(docs, val_percent)
    print(f"building the stdlib corpus ({len(train)} train / {len(val)} val files) in {folder}", file=sys.stderr)
    try:
        prepare_corpus(train, val, folder, seq_len=seq_len, vocab_size=vocab_size, sources={"stdlib": settings})
    except DataError:
        if (folder / MANIFEST).is_file():  # another process (multi-host launch) built it first
            return folder
        raise
    return folder
