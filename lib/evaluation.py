"""Held-out scores: loss, perplexity and bits per byte, per data source and over all of them.

Loss is the mean next-token NLL (nats) over valid targets. Perplexity is its
exp. Bits per byte divides the summed NLL, in bits, by the UTF-8 bytes of the
predicted text: unlike loss and perplexity it does not depend on the
tokenizer, so models with different vocabularies can be compared. The bytes
come from a per-token byte-length table, so they cover exactly the tokens that
were scored (the first token of each sequence is never a target).
"""

from __future__ import annotations

import json
import math
from typing import Callable

import numpy as np

from lib.corpus import PAD_ID
from lib.data import to_model_batch

Batch = dict[str, np.ndarray]


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for; special tokens (PAD, EOS) stand for none."""
    size = tokenizer.get_vocab_size()
    lengths = np.zeros(size, np.int64)
    specials = set(tokenizer.get_added_tokens_decoder())
    decoder = (json.loads(tokenizer.to_str()).get("decoder") or {}).get("type")
    for i in range(size):
        if i in specials:
            continue
        if decoder == "ByteLevel":
            # Byte-level BPE spells each raw byte as exactly one character of its alphabet.
            lengths[i] = len(tokenizer.id_to_token(i))
        else:  # other tokenizers: decode alone (exact for most; boundary spaces may differ by a byte)
            lengths[i] = len(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8"))
    return lengths


def target_bytes(tokens: np.ndarray, mask: np.ndarray, byte_lengths: np.ndarray) -> int:
    """UTF-8 bytes of the valid next-token targets of a batch (the text the loss scores)."""
    targets, valid = tokens[:, 1:], mask[:, 1:]
    return int(byte_lengths[targets][valid].sum())


def padded_batches(rows: list[Batch], batch_size: int, vocab_size: int, document_mask: bool = False) -> list[Batch]:
    """Model batches of `batch_size` rows; the last is filled with all-padding rows, so every batch has one
    shape (one compile) and no row is dropped. Padding rows are masked out and add nothing to the sums."""
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        filler = {"tokens": np.full_like(chunk[0]["tokens"], PAD_ID), "source": chunk[0]["source"], "index": np.int64(-1)}
        chunk = chunk + [filler] * (batch_size - len(chunk))
        stacked = {k: np.stack([r[k] for r in chunk]) for k in chunk[0]}
        out.append(to_model_batch(stacked, vocab_size, document_mask))
    return out


def score(eval_step: Callable, model, batches: list[Batch], put: Callable, byte_lengths: np.ndarray | None = None) -> dict:
    """Summed NLL, valid targets and (with a byte table) target bytes over `batches`."""
    nll, count, nbytes = 0.0, 0, 0
    for batch in batches:
        s, n = eval_step(model, put(batch))
        nll, count = nll + float(s), count + int(n)
        if byte_lengths is not None:
            nbytes += target_bytes(batch["tokens"], batch["mask"], byte_lengths)
    return {"nll_sum": nll, "tokens": count, "bytes": nbytes}


def summarize(sums: dict) -> dict:
    """Loss, perplexity and bits per byte from summed NLL, target count and target bytes."""
    loss = sums["nll_sum"] / max(sums["tokens"], 1)
    out = {"loss": loss, "ppl": math.exp(loss), "tokens": sums["tokens"]}
    if sums.get("bytes"):
        out |= {"bits_per_byte": sums["nll_sum"] / math.log(2) / sums["bytes"], "bytes": sums["bytes"]}
    return out


def combine(per_source: dict[str, dict]) -> dict:
    """All sources together: sums add, so the combined loss weighs every target token equally."""
    keys = ("nll_sum", "tokens", "bytes")
    return {k: sum(s[k] for s in per_source.values()) for k in keys}


def per_source_val_losses(eval_step: Callable, model, val_sets: dict[str, list[Batch]], put: Callable) -> dict:
    """`{"val_loss/<name>": loss}` for each source of a mixture (sources without validation data are left out)."""
    return {f"val_loss/{name}": summarize(score(eval_step, model, batches, put))["loss"] for name, batches in val_sets.items() if batches}
