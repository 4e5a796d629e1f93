import numpy as np
import pytest

from lib.config import DataConfig
from lib.corpus import DataError
from lib.data import PackedSequences, check_compatible, open_corpus, to_model_batch, train_batches, val_batches


def cfg(**kw):
    return DataConfig(seq_len=32, shuffle_seed=3, prefetch=2, read_threads=1, **kw)


def first_batches(corpus, n, **kw):
    it = iter(train_batches([corpus], cfg(), vocab_size=300, **kw))
    return [next(it) for _ in range(n)]


def test_batches_are_a_pure_function_of_step_and_cover_an_epoch(tiny_corpus):
    corpus = open_corpus("tiny", tiny_corpus)
    a = first_batches(corpus, 3, global_batch=4)
    b = first_batches(corpus, 3, global_batch=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    n = len(PackedSequences(corpus, "train"))
    epoch = np.concatenate([x["index"] for x in first_batches(corpus, n // 4, global_batch=4)])
    assert len(set(epoch.tolist())) == len(epoch)  # shuffled without repeats inside an epoch
    assert a[0]["index"].tolist() != list(range(4))  # and really shuffled


def test_each_process_reads_contiguous_rows_of_the_same_global_batch(tiny_corpus):
    corpus = open_corpus("tiny", tiny_corpus)
    whole = first_batches(corpus, 3, global_batch=4)
    halves = [first_batches(corpus, 3, global_batch=4, process_index=p, process_count=2) for p in range(2)]
    for step in range(3):
        joined = np.concatenate([halves[0][step]["index"], halves[1][step]["index"]])
        np.testing.assert_array_equal(joined, whole[step]["index"])


def test_iterator_state_resumes_exactly(tiny_corpus):
    corpus = open_corpus("tiny", tiny_corpus)
    it = iter(train_batches([corpus], cfg(), global_batch=4, vocab_size=300))
    for _ in range(2):
        next(it)
    state = it.get_state()
    expected = [next(it)["index"] for _ in range(2)]
    fresh = iter(train_batches([corpus], cfg(), global_batch=4, vocab_size=300))
    fresh.set_state(state)
    assert [next(fresh)["index"].tolist() for _ in range(2)] == [e.tolist() for e in expected]


def test_masks_cover_real_tokens_and_segments_follow_eos():
    rows = {"tokens": np.array([[5, 1, 6, 7, 1, 0]]), "source": np.array([0]), "index": np.array([9])}
    batch = to_model_batch(rows, vocab_size=10, document_mask=True)
    assert batch["mask"].tolist() == [[True, True, True, True, True, False]]
    assert batch["segment_ids"].tolist() == [[0, 0, 1, 1, 1, 2]]


def test_token_beyond_vocabulary_is_caught_at_the_boundary():
    rows = {"tokens": np.array([[5, 12]]), "source": np.array([0]), "index": np.array([4])}
    with pytest.raises(DataError, match="token id 12 is outside the vocabulary"):
        to_model_batch(rows, vocab_size=10)


def test_corpus_shape_mismatches_are_clear_errors(tiny_corpus, tmp_path):
    corpus = open_corpus("tiny", tiny_corpus)
    with pytest.raises(DataError, match="data.seq_len=64"):
        check_compatible(corpus, 64, 300)
    with pytest.raises(DataError, match="model.vocab_size"):
        check_compatible(corpus, 32, 10)
    with pytest.raises(DataError, match="no prepared corpus"):
        open_corpus("missing", tmp_path / "nowhere")


def test_validation_batches_are_fixed_and_whole(tiny_corpus):
    corpus = open_corpus("tiny", tiny_corpus)
    val = val_batches(corpus, cfg(), batch_size=2, n_batches=3, vocab_size=300)
    assert val and all(b["tokens"].shape == val[0]["tokens"].shape for b in val)
