"""Mixtures: weighted proportions, shared tokenizers, counting what was drawn."""

import numpy as np
import pytest

from lib.config import ConfigError, DataConfig, load_config
from lib.corpus import DataError, prepare_corpus, read_documents, split_train_val
from lib.data import open_corpus, resolve_corpora, train_batches
from lib.mixture import MixtureCounter
from tests.conftest import write_text_files


@pytest.fixture(scope="module")
def second_corpus(tiny_corpus, tmp_path_factory):
    """Other text, tokenized with the tiny corpus's tokenizer so the two can be mixed."""
    src = write_text_files(tmp_path_factory.mktemp("more"), n=6, words=200)
    train, val = split_train_val(list(read_documents([str(src / "*.txt")])), 20)
    out = tmp_path_factory.mktemp("prepared2") / "second"
    prepare_corpus(train, val, out, seq_len=32, vocab_size=300, tokenizer_path=tiny_corpus / "tokenizer.json")
    return out


def sources(*triples) -> str:
    """A Hydra `data.sources=[...]` override, as a user would type it."""
    items = ", ".join(f"{{name: {n}, path: {p}, weight: {w}}}" for n, p, w in triples)
    return f"data.sources=[{items}]"


def test_mixture_draws_sources_in_the_weights_proportions(tiny_corpus, second_corpus):
    cfg = DataConfig(seq_len=32, read_threads=1, prefetch=1)
    corpora = [open_corpus("a", tiny_corpus), open_corpus("b", second_corpus)]
    it = iter(train_batches(corpora, cfg, global_batch=8, vocab_size=300, weights=[3.0, 1.0]))
    counter = MixtureCounter(["a", "b"])
    for _ in range(40):  # 320 samples: several epochs of both (endless, reshuffled) sources
        counter.add(next(it)["source"])
    assert counter.fractions() == {"mix/a": 0.75, "mix/b": 0.25}
    assert counter.counts.sum() == 320 and counter.counts[1] > 3 * 16  # b (~20 sequences) was repeated


def test_uneven_weights_give_their_proportions(tiny_corpus, second_corpus):
    cfg = DataConfig(seq_len=32, read_threads=1, prefetch=1)
    corpora = [open_corpus("a", tiny_corpus), open_corpus("b", second_corpus)]
    it = iter(train_batches(corpora, cfg, global_batch=10, vocab_size=300, weights=[0.7, 0.3]))
    source = np.concatenate([next(it)["source"] for _ in range(30)])
    assert abs(source.mean() - 0.3) < 0.01


def test_sources_with_different_tokenizers_are_refused(tiny_corpus, tmp_path):
    src = write_text_files(tmp_path / "text", n=4, words=100)
    train, val = split_train_val(list(read_documents([str(src / "*.txt")])), 20)
    prepare_corpus(train, val, tmp_path / "own", seq_len=32, vocab_size=280)
    cfg = load_config(["+exp=smoke", sources(('a', tiny_corpus, 1.0), ('own', tmp_path / 'own', 1.0))])
    with pytest.raises(DataError, match=r"different tokenizers.*--tokenizer .*tokenizer.json"):
        resolve_corpora(cfg.data, 300)


def test_bad_mixture_configs_are_one_line_errors(tiny_corpus):
    with pytest.raises(ConfigError, match="weight"):
        load_config(["+exp=smoke", sources(('a', tiny_corpus, 0.0))])
    with pytest.raises(ConfigError, match="repeat"):
        load_config(["+exp=smoke", sources(('a', tiny_corpus, 1.0), ('a', tiny_corpus, 2.0))])


def test_a_single_source_reports_no_mixture():
    counter = MixtureCounter(["only"])
    counter.add(np.zeros(4, np.int32))
    assert counter.fractions() == {}
