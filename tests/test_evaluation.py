"""Evaluation numbers on cases known by hand: uniform logits, byte counts, padding."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.config import ModelConfig
from lib.corpus import train_tokenizer
from lib.data import PackedSequences, open_corpus
from lib.evaluation import combine, padded_batches, score, summarize, target_bytes, token_byte_lengths
from lib.model import Llama
from lib.train_state import make_eval_step

VOCAB = 300


def put(batch):
    return {k: jnp.asarray(v) for k, v in batch.items() if k in ("tokens", "mask")}


@pytest.fixture(scope="module")
def uniform_model():
    """Zero LM head: every position predicts the uniform distribution, so each target costs exactly ln V."""
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=VOCAB)
    model = Llama(cfg, jax.random.PRNGKey(0))
    return eqx.tree_at(lambda m: m.lm_head, model, jnp.zeros_like(model.lm_head))


def test_uniform_model_scores_ln_v_and_log2_v_bits_per_token(tiny_corpus, uniform_model):
    corpus = open_corpus("tiny", tiny_corpus)
    tok = corpus.tokenizer()
    rows = [PackedSequences(corpus, "val")[i] for i in range(5)]
    batches = padded_batches(rows, 2, VOCAB)  # 5 rows -> 3 batches, the last one padded
    result = summarize(score(make_eval_step(), uniform_model, batches, put, token_byte_lengths(tok)))
    # Independent byte count: decode each row's valid targets (the synthetic text is ASCII, EOS has no bytes).
    targets = [r["tokens"][1:][r["tokens"][1:] != 0] for r in rows]
    nbytes = sum(len(tok.decode(t.tolist(), skip_special_tokens=True).encode()) for t in targets)
    ntokens = sum(len(t) for t in targets)
    assert result["tokens"] == ntokens and result["bytes"] == nbytes
    assert result["loss"] == pytest.approx(math.log(VOCAB), rel=1e-6)
    assert result["ppl"] == pytest.approx(VOCAB, rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(math.log2(VOCAB) * ntokens / nbytes, rel=1e-6)


def test_summaries_by_hand():
    # 4 targets of 2 bytes each, each with probability 1/4: 2 bits per token, 1 bit per byte.
    s = summarize({"nll_sum": 4 * math.log(4), "tokens": 4, "bytes": 8})
    assert s["loss"] == pytest.approx(math.log(4)) and s["ppl"] == pytest.approx(4) and s["bits_per_byte"] == pytest.approx(1.0)
    both = summarize(combine({"a": {"nll_sum": 3.0, "tokens": 1, "bytes": 2}, "b": {"nll_sum": 1.0, "tokens": 3, "bytes": 6}}))
    assert both["loss"] == pytest.approx(1.0)  # token-weighted: (3 + 1) / 4, not the mean of 3 and 1/3


def test_byte_table_counts_utf8_bytes_of_byte_level_tokens():
    tok = train_tokenizer(["naïve café ☃ snow, déjà vu ☃"] * 30 + ["plain ascii words"] * 30, vocab_size=280)
    lengths = token_byte_lengths(tok)
    text = "déjà vu: a naïve ☃ in the café"
    ids = np.array([[1] + tok.encode(text).ids])
    assert target_bytes(ids, ids != 0, lengths) == len(text.encode("utf-8"))
    assert lengths[0] == lengths[1] == 0  # PAD and EOS stand for no text


def test_padding_rows_change_nothing(tiny_corpus, uniform_model):
    corpus = open_corpus("tiny", tiny_corpus)
    rows = [PackedSequences(corpus, "train")[i] for i in range(3)]
    padded = padded_batches(rows, 2, VOCAB)  # the second batch: one real row, one padding row
    assert [b["tokens"].shape for b in padded] == [(2, 32), (2, 32)] and not padded[1]["mask"][1].any()
    real_targets = sum(int((r["tokens"][1:] != 0).sum()) for r in rows)
    assert score(make_eval_step(), uniform_model, padded, put)["tokens"] == real_targets
