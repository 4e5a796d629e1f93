"""Data mixtures: several prepared corpora drawn in fixed proportions.

`grain.MapDataset.mix` interleaves the (endless, reshuffled) sources by their
normalised weights with a deterministic pattern, so sample i of the mixture is
a pure function of i: the batch at step s stays a pure function of s and resume
needs nothing but the step. Every source must share one tokenizer, or the same
token id would mean different text in different rows of a batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grain
import numpy as np

from lib.corpus import DataError

if TYPE_CHECKING:
    from lib.data import Corpus


def mix_datasets(datasets: list[grain.MapDataset], weights: list[float]) -> grain.MapDataset:
    if len(datasets) != len(weights):
        raise DataError(f"{len(datasets)} data sources but {len(weights)} weights; give one weight per source")
    if len(datasets) == 1:
        return datasets[0]
    total = float(sum(weights))
    return grain.MapDataset.mix(datasets, [w / total for w in weights])


def check_shared_tokenizer(corpora: list[Corpus]) -> None:
    first = corpora[0]
    for other in corpora[1:]:
        if other.manifest["tokenizer_sha256"] != first.manifest["tokenizer_sha256"]:
            raise DataError(
                f"data sources '{first.name}' and '{other.name}' use different tokenizers; prepare '{other.name}' again "
                f"with --tokenizer {first.tokenizer_path} so that token ids mean the same text in both"
            )


class MixtureCounter:
    """The proportions of sequences actually drawn from each source, since this process started."""

    def __init__(self, names: list[str]):
        self.names = names
        self.counts = np.zeros(len(names), np.int64)

    def add(self, source_ids: np.ndarray) -> None:
        self.counts += np.bincount(np.asarray(source_ids).ravel(), minlength=len(self.names))[: len(self.names)]

    def fractions(self) -> dict[str, float]:
        """`{"mix/<name>": fraction}`; empty for a single source (nothing to report)."""
        if len(self.names) < 2 or not self.counts.sum():
            return {}
        share = self.counts / self.counts.sum()
        return {f"mix/{name}": float(f) for name, f in zip(self.names, share)}
