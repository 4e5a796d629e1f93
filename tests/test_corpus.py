import json

import numpy as np
import pytest

from lib.corpus import EOS_ID, PAD_ID, DataError, pack_sequences, prepare_corpus, read_documents, split_train_val, stdlib_documents
from tests.conftest import write_text_files


def test_pack_separates_documents_with_eos_and_pads_only_the_tail():
    seqs = pack_sequences([[5, 6, 7], [8, 9]], seq_len=4)
    assert seqs.tolist() == [[5, 6, 7, EOS_ID], [8, 9, EOS_ID, PAD_ID]]


def test_validation_split_is_a_fixed_function_of_names():
    docs = [(f"file{i}.py", "x") for i in range(200)]
    train1, val1 = split_train_val(docs, 10)
    train2, val2 = split_train_val(list(reversed(docs)), 10)
    assert sorted(val1) == sorted(val2) and 5 < len(val1) < 40
    assert not set(n for n, _ in val1) & set(n for n, _ in train1)


def test_validation_split_does_not_depend_on_where_the_data_lives(tmp_path):
    for folder in ("a", "deeper/b"):
        (tmp_path / folder / "sub").mkdir(parents=True)
        for i in range(60):
            (tmp_path / folder / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(f"text {i}")
    splits = [split_train_val(list(read_documents([str(tmp_path / f / "**" / "*.txt")])), 10) for f in ("a", "deeper/b")]
    assert splits[0] == splits[1] and splits[0][1]  # same names, same held-out documents
    assert "sub/doc1.txt" in [n for n, _ in splits[0][0] + splits[0][1]]


def test_stdlib_documents_exclude_site_packages():
    docs = stdlib_documents(200_000)
    assert docs and sum(len(t) for _, t in docs) >= 200_000
    assert not any("site-packages" in name for name, _ in docs)


def test_prepare_corpus_writes_manifest_shards_and_tokenizer(tiny_corpus):
    manifest = json.loads((tiny_corpus / "manifest.json").read_text())
    assert manifest["seq_len"] == 32 and manifest["max_token_id"] < manifest["vocab_size"] <= 300
    train = manifest["splits"]["train"]
    assert len(train["shards"]) >= 2  # shard_sequences=16 forces several
    first = np.load(tiny_corpus / train["shards"][0]["file"])
    assert first.shape == (16, 32) and first.dtype == np.uint16
    assert (tiny_corpus / "tokenizer.json").is_file()
    assert all(len(s["sha256"]) == 64 for s in train["shards"])


def test_jsonl_and_parquet_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "second doc"}\n')
    pq.write_table(pa.table({"body": ["from parquet"]}), tmp_path / "b.parquet")
    assert [t for _, t in read_documents([str(tmp_path / "*.jsonl")])] == ["hello world", "second doc"]
    assert [t for _, t in read_documents([str(tmp_path / "*.parquet")], text_key="body")] == ["from parquet"]
    with pytest.raises(DataError, match="no column 'text'"):
        list(read_documents([str(tmp_path / "*.parquet")]))


def test_missing_inputs_and_empty_corpus_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no input files match"):
        list(read_documents([str(tmp_path / "nothing*.txt")]))
    with pytest.raises(DataError, match="empty"):
        prepare_corpus([("a", "  ")], [], tmp_path / "out", seq_len=8, vocab_size=300)
    assert not (tmp_path / "out").exists()


def test_existing_output_is_never_overwritten(tmp_path):
    src = write_text_files(tmp_path / "text", n=3, words=50)
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.bin").write_bytes(b"keep me")
    docs = list(read_documents([str(src / "*.txt")]))
    with pytest.raises(DataError, match="already exists"):
        prepare_corpus(docs, docs[:1], out, seq_len=8, vocab_size=300)
    assert (out / "precious.bin").read_bytes() == b"keep me"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")] == []


def test_user_tokenizer_is_reused(tmp_path, tiny_corpus):
    src = write_text_files(tmp_path / "text", n=3, words=50)
    docs = list(read_documents([str(src / "*.txt")]))
    manifest = prepare_corpus(docs, docs[:1], tmp_path / "out", seq_len=8, vocab_size=999, tokenizer_path=tiny_corpus / "tokenizer.json")
    assert manifest["tokenizer_sha256"] == json.loads((tiny_corpus / "manifest.json").read_text())["tokenizer_sha256"]
