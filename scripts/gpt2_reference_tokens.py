#!/usr/bin/python3
"""Independent pure-Python GPT-2 byte-level BPE encoder, used as a reference.

It implements the algorithm of OpenAI's GPT-2 tokenizer from scratch:
  1. every byte 0..255 is mapped to a printable unicode character;
  2. text is split into chunks by the GPT-2 pre-tokenization regex
     (needs the PyPI `regex` module for \\p{L} / \\p{N});
  3. each chunk's bytes become characters, which are merged pairwise by
     lowest merge rank (vocab.bpe line order) until no ranked pair is left;
  4. the resulting symbols are looked up in encoder.json.

Text is encoded as ordinary text: "<|endoftext|>" is NOT treated as a
special token, and no end-of-text token is appended.

Usage:
  gpt2_reference_tokens.py --vocab-dir DIR --input FILE [--json OUT]
      prints {"tokens", "sum", "crc32", "first", "last"} (and writes it to OUT)
  gpt2_reference_tokens.py --vocab-dir DIR --text STRING
      prints the full id list as JSON
"""

import argparse
import json
import os
import struct
import sys
import time
import zlib

try:
    import regex
except ImportError:  # pragma: no cover
    sys.stderr.write(
        "error: the 'regex' module is required "
        "(apt-get install python3-regex, or pip install regex)\n")
    sys.exit(2)

SPLIT_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+"
                 r"| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def byte_to_char_table():
    """Return a list of 256 one-character strings, indexed by byte value.

    Printable latin-1 bytes keep their own code point; the remaining bytes
    are given code points 256, 257, ... in increasing byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1))
    keep |= set(range(0xA1, 0xAC + 1))
    keep |= set(range(0xAE, 0xFF + 1))
    table = []
    extra = 0
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


class Gpt2Bpe:
    def __init__(self, vocab_dir):
        with open(os.path.join(vocab_dir, "encoder.json"), encoding="utf-8") as f:
            self.token_to_id = json.load(f)
        self.merge_rank = {}
        with open(os.path.join(vocab_dir, "vocab.bpe"), encoding="utf-8") as f:
            lines = f.read().split("\n")
        # First line is a "#version" header; blank lines are ignored.
        rank = 0
        for line in lines:
            if not line or line.startswith("#version"):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError("bad merge line in vocab.bpe: %r" % line)
            pair = (parts[0], parts[1])
            if pair not in self.merge_rank:
                self.merge_rank[pair] = rank
            rank += 1
        self.byte_chars = byte_to_char_table()
        self.splitter = regex.compile(SPLIT_PATTERN)
        self.cache = {}

    def merge_word(self, word):
        """Apply rank-ordered BPE merges to one pre-token (a str of mapped chars)."""
        symbols = list(word)
        if len(symbols) < 2:
            return symbols
        ranks = self.merge_rank
        while True:
            best_rank = None
            best_pair = None
            for i in range(len(symbols) - 1):
                r = ranks.get((symbols[i], symbols[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank = r
                    best_pair = (symbols[i], symbols[i + 1])
            if best_pair is None:
                break
            # Merge every non-overlapping occurrence of best_pair, left to right.
            left, right = best_pair
            joined = left + right
            out = []
            i = 0
            n = len(symbols)
            while i < n:
                if i + 1 < n and symbols[i] == left and symbols[i + 1] == right:
                    out.append(joined)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            symbols = out
            if len(symbols) == 1:
                break
        return symbols

    def encode(self, text):
        ids = []
        table = self.byte_chars
        for piece in self.splitter.findall(text):
            cached = self.cache.get(piece)
            if cached is None:
                mapped = "".join(table[b] for b in piece.encode("utf-8"))
                cached = [self.token_to_id[s] for s in self.merge_word(mapped)]
                self.cache[piece] = cached
            ids.extend(cached)
        return ids


def summarize(ids):
    packed = b"".join(struct.pack("<I", t) for t in ids)
    return {
        "tokens": len(ids),
        "sum": sum(ids),
        "crc32": zlib.crc32(packed) & 0xFFFFFFFF,
        "first": ids[:64],
        "last": ids[-16:] if ids else [],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab-dir", required=True,
                    help="directory with encoder.json and vocab.bpe")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="UTF-8 text file to encode")
    src.add_argument("--text", help="encode this string, print all ids")
    ap.add_argument("--json", help="also write the --input summary here")
    args = ap.parse_args(argv)

    bpe = Gpt2Bpe(args.vocab_dir)

    if args.text is not None:
        print(json.dumps(bpe.encode(args.text)))
        return 0

    with open(args.input, "rb") as f:
        text = f.read().decode("utf-8")
    t0 = time.time()
    ids = bpe.encode(text)
    elapsed = time.time() - t0
    summary = summarize(ids)
    out = json.dumps(summary)
    print(out)
    sys.stderr.write("encoded %d tokens in %.2f s\n" % (len(ids), elapsed))
    if args.json:
        parent = os.path.dirname(args.json)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
