"""Turn your own text into a prepared corpus the trainer can read.

    python -m recipes.prepare_data --input 'notes/**/*.txt' --output data/notes --vocab-size 4096 --seq-len 256
    python -m recipes.prepare_data --input 'dump/*.jsonl' --text-key text --output data/dump --tokenizer tokenizer.json

Inputs are globs of plain text files (one document each), .jsonl (one document
per line, field --text-key) or .parquet (column --text-key). A fixed set of
documents (by a hash of their name) is held out for validation. Then train with
`data.sources='[{name: notes, path: data/notes}]'` and `model.vocab_size`
at least the manifest's `vocab_size`.
"""

from __future__ import annotations

import argparse
import sys

from lib.corpus import prepare_corpus, read_documents, split_train_val
from lib.errors import run_cli


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.prepare_data", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="file globs (quote them): *.txt, *.md, *.py, *.jsonl, *.parquet")
    p.add_argument("--output", required=True, help="new folder for the prepared corpus (must not exist)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed sequence (= data.seq_len)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary to train (ignored with --tokenizer)")
    p.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    p.add_argument("--text-key", default="text", help="field/column holding the text in .jsonl/.parquet")
    p.add_argument("--val-percent", type=int, default=5, help="percent of documents held out for validation")
    p.add_argument("--shard-sequences", type=int, default=8192, help="sequences per shard file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def body():
        docs = list(read_documents(args.input, args.text_key))
        train, val = split_train_val(docs, args.val_percent)
        manifest = prepare_corpus(
            train, val, args.output, seq_len=args.seq_len, vocab_size=args.vocab_size,
            tokenizer_path=args.tokenizer, shard_sequences=args.shard_sequences,
            sources={"inputs": args.input, "documents": len(docs)},
        )
        s = manifest["splits"]
        print(
            f"wrote {args.output}: vocab {manifest['vocab_size']}, train {s['train']['tokens']:,} tokens "
            f"({s['train']['sequences']} x {args.seq_len}), val {s['val']['tokens']:,} tokens; "
            f"train with data.seq_len={args.seq_len} model.vocab_size={manifest['vocab_size']} "
            f"'data.sources=[{{name: mine, path: {args.output}}}]'"
        )

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
