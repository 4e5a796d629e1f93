"""Quarantined samples: the log of skipped steps' data, and leaving those samples out of later reads.

`<run_dir>/quarantine.jsonl` gets one line per skipped step: the step, why it
was skipped, its loss and gradient norm, and the identity (source, index) of
every sample in its batch. The samples named there are left out whenever the
data is read again (after a rollback, or in a later epoch).

Leaving out is *replacement*, not filtering: a quarantined sample at stream
position i is swapped for the sample at a position derived from (i, attempt)
by a fixed hash. Every other position keeps its sample, so the batch at step
s stays a pure function of (s, quarantine set) and resuming stays exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import grain
import numpy as np

from lib.corpus import DataError
from lib.metrics import read_jsonl

Identity = tuple[int, int]  # (source id, index in that source's train split)
QUARANTINE_FILE = "quarantine.jsonl"
MAX_REPLACEMENT_TRIES = 1000


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a fixed, well-spread hash of an integer (Python's hash is not for this)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def replacement_position(position: int, attempt: int) -> int:
    return _mix64(position * 1_000_003 + attempt) % (1 << 40)


def identity(sample: dict) -> Identity:
    return int(sample["source"]), int(sample["index"])


def replace_quarantined(stream: grain.MapDataset, quarantined: frozenset[Identity]) -> grain.MapDataset:
    """`stream` (endless, random access) with each quarantined sample swapped for a fixed substitute."""
    if not quarantined:
        return stream

    def substitute(position: int, sample: dict) -> dict:
        attempt = 0
        while identity(sample) in quarantined:
            attempt += 1
            if attempt > MAX_REPLACEMENT_TRIES:
                raise DataError(
                    f"almost every sample is quarantined ({len(quarantined)} of them); the data or the guard "
                    "thresholds are wrong: inspect quarantine.jsonl, fix the data or raise guard.sigma"
                )
            sample = stream[replacement_position(position, attempt)]
        return sample

    return stream.map_with_index(substitute)


def batch_identities(batch: dict) -> list[Identity]:
    return [(int(s), int(i)) for s, i in zip(np.asarray(batch["source"]).ravel(), np.asarray(batch["index"]).ravel())]


class QuarantineLog:
    """Append-only `quarantine.jsonl` plus the set of quarantined identities it names."""

    def __init__(self, run_dir: str | Path, source_names: list[str], enabled: bool = True):
        self.path = Path(run_dir) / QUARANTINE_FILE
        self.source_names = source_names
        self.enabled = enabled  # only process 0 writes
        self.entries: list[dict] = read_quarantine(self.path)

    def identities(self, n_entries: int | None = None) -> frozenset[Identity]:
        entries = self.entries if n_entries is None else self.entries[:n_entries]
        return frozenset((s["source_id"], s["index"]) for e in entries for s in e["samples"])

    def record(self, step: int, reason: str, loss: float, grad_norm: float, samples: list[Identity]) -> None:
        entry = {
            "step": step,
            "reason": reason,
            "loss": loss,
            "grad_norm": grad_norm,
            "samples": [{"source": self.source_names[s], "source_id": s, "index": i} for s, i in samples],
        }
        self.entries.append(entry)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def truncate(self, n_entries: int) -> None:
        """On resume: forget entries written after the checkpoint (the resumed run writes them again)."""
        self.entries = self.entries[:n_entries]
        if self.enabled and self.path.exists():
            self.path.write_text("".join(json.dumps(e) + "\n" for e in self.entries))


def read_quarantine(path: str | Path) -> list[dict]:
    """Entries of a quarantine.jsonl; a line torn by a kill mid-write is ignored."""
    return read_jsonl(path)
