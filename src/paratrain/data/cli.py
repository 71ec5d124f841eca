"""``paratrain data``: prepare a tokenized dataset from text, check one."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..models import has_weights
from .prepare import DataError, prepare


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare tokenized datasets for `train --data`")
    commands = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prep = commands.add_parser(
        "prepare", help="tokenize .txt / .jsonl / .parquet files into token shards",
        description="Tokenize text into memory-mapped token shards plus meta.json, in parallel "
                    "processes; the end of the token stream is the validation split.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt (a document per file), "
                      ".jsonl (a document per line) or .parquet (a document per row) files")
    prep.add_argument("--tokenizer", required=True, help="a tokenizer.json, a local Hugging Face "
                      "model directory holding one, or 'bytes' (byte-level, NUL ends a document)")
    prep.add_argument("--out", required=True, help="the dataset directory to create (must not exist)")
    prep.add_argument("--field", default="text", help="JSON field / parquet column of the text (default: text)")
    prep.add_argument("--val-fraction", type=float, default=0.05,
                      help="share of the tokens (the end) held out for validation (default: 0.05)")
    prep.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: all cores)")
    prep.add_argument("--eos", default=None, help="the end-of-document token (default: the "
                      "tokenizer's own, e.g. <|endoftext|> or </s>; not with bytes, where NUL ends a document)")
    prep.set_defaults(func=_prepare)
    check = commands.add_parser("verify", help="recompute every shard's checksum")
    check.add_argument("dataset", help="a directory made by `paratrain data prepare`")
    check.set_defaults(func=_verify)


def _prepare(args: argparse.Namespace) -> int:
    if args.workers < 0:
        raise DataError(f"--workers {args.workers}: give 0 (all cores) or more")
    meta = prepare(args.inputs, args.tokenizer, args.out, field=args.field,
                   val_fraction=args.val_fraction, workers=args.workers, eos=args.eos)
    print(f"dataset       {args.out}: {meta['documents']:,} documents, {meta['tokens']:,} tokens "
          f"({meta['train_tokens']:,} train), vocabulary {meta['vocab_size']:,}, "
          f"{len(meta['shards'])} shard(s) of {meta['dtype']}")
    print(f"train on it   {train_command(args.tokenizer, args.out, meta['vocab_size'])}")
    return 0


def train_command(tokenizer: str, out: str, vocab_size: int) -> str:
    """The command that trains on the new dataset: the Hugging Face model whose directory
    gave the tokenizer (its vocabulary is its own: ``--model DIR`` refuses --vocab-size),
    else a paratrain preset sized to the vocabulary."""
    if (Path(tokenizer) / "config.json").is_file() and has_weights(tokenizer):
        return f"paratrain train --model {tokenizer} --data {out}"
    return f"paratrain train --data {out} --vocab-size {vocab_size}"


def _verify(args: argparse.Namespace) -> int:
    from .dataset import read_meta, verify

    verify(args.dataset, what="dataset")  # as the usage line names it; train's messages say --data
    meta = read_meta(args.dataset, what="dataset")
    print(f"dataset       {args.dataset}: {len(meta.raw['shards'])} shard(s), {meta.tokens:,} tokens, checksums match")
    return 0
