#!/usr/bin/env python3
"""Turn a local text corpus into Megatron's indexed dataset (``<prefix>_text_document.bin/.idx``).

Inputs (one or more files, optionally ``.gz``; the format follows the extension unless ``--format``):

* ``jsonl``: one JSON object per line, the document under ``--json-key`` (default ``text``);
* ``csv``: the document is ``--csv-column`` (a header name, or a 0-based index for header-less
  files such as AG News' ``class,title,description`` rows; several columns are joined by
  ``--csv-join``);
* ``text``: one document per line (``--text-mode line``) or per blank-line separated paragraph
  (``--text-mode paragraph``).

Tokenizers (nothing is downloaded, ever):

* ``--tokenizer byte``: UTF-8 bytes shifted by :data:`BYTE_OFFSET` (ids 0-3 are reserved), so ids
  are 4..259, and every document ends with EOD = :data:`BYTE_EOD` = 260. Train on it with
  ``--tokenizer-type NullTokenizer --vocab-size`` :func:`byte_train_vocab_size` (``TOKENIZER=byte``
  in ``examples/``): Megatron's NullTokenizer has its EOD as its last id, at ``vocab_size`` up to
  megatron-core 0.17 (260) and at ``vocab_size - 1`` from 0.18 on (261); the tool prints the one
  the installed release needs.
* ``--tokenizer hf --tokenizer-file tokenizer.json``: a local Hugging Face ``tokenizers`` file.
  The EOD id is ``--eod-token`` (default: the first of ``<|endoftext|>``, ``</s>``,
  ``<|end_of_text|>``, ``<eos>`` the file knows). Train with ``--vocab-size`` equal to the printed
  vocabulary size.

The writer is megatron-core's own ``IndexedDatasetBuilder``, so ``IndexedDataset(prefix)`` and
``--data-path prefix`` read the result. ``--make-sample PATH`` writes a small synthetic corpus
(jsonl, AG-News-shaped csv, or text, by extension) to try the pipeline without any download.

Example::

    python tools/preprocess_data.py --make-sample data/sample.csv
    python tools/preprocess_data.py --input data/sample.csv --csv-column 1,2 \\
        --output-prefix data/sample --tokenizer byte
    DATA_PATH=data/sample_text_document TOKENIZER=byte TINY=1 examples/olmoe/train_olmoe.sh
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import multiprocessing
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy

BYTE_OFFSET = 4
"""Byte ``b`` becomes id ``b + BYTE_OFFSET``; ids below it are reserved for future special tokens."""

BYTE_VOCAB_SIZE = BYTE_OFFSET + 256
"""Ids of the byte tokenizer below its EOD: the reserved ones and the bytes."""

BYTE_EOD = BYTE_VOCAB_SIZE
"""The byte tokenizer's EOD, after every document: the corpus's largest id."""


def byte_train_vocab_size() -> int:
    """The ``--vocab-size`` that puts the installed megatron-core's NullTokenizer EOD at
    :data:`BYTE_EOD` (260 up to megatron-core 0.17, 261 from 0.18 on)."""
    from megatron.ciera.app.upstream_features import null_tokenizer_vocab_size

    return null_tokenizer_vocab_size(BYTE_EOD)


DEFAULT_EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")

OUTPUT_SUFFIX = "_text_document"

POOL_BATCH_PER_WORKER = 256
"""With ``--workers N``, documents go to the pool ``N x POOL_BATCH_PER_WORKER`` at a time."""


class PreprocessError(RuntimeError):
    """A user-facing error: bad input, missing file, missing optional package."""


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes plus :data:`BYTE_OFFSET`; needs no file and round-trips any text exactly."""

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eod = BYTE_EOD

    def encode(self, text: str) -> numpy.ndarray:
        """Token ids of ``text`` (no EOD)."""
        return numpy.frombuffer(text.encode("utf-8"), dtype=numpy.uint8).astype(numpy.int32) + BYTE_OFFSET

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; EOD and reserved ids are dropped."""
        data = bytes(int(i) - BYTE_OFFSET for i in ids if BYTE_OFFSET <= int(i) < BYTE_EOD)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face ``tokenizers`` JSON file; ``tokenizers`` is imported only here."""

    name = "hf"

    def __init__(self, *, tokenizer_file: str, eod_token: str | None) -> None:
        if not os.path.isfile(tokenizer_file):
            raise PreprocessError(
                f"tokenizer file not found: {tokenizer_file} (this tool never downloads; "
                "pass a local tokenizer.json)"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise PreprocessError(
                "--tokenizer hf needs the 'tokenizers' package: pip install tokenizers"
            ) from exc
        self._tokenizer = Tokenizer.from_file(tokenizer_file)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (eod_token,) if eod_token else DEFAULT_EOD_TOKENS
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                self.eod = int(token_id)
                break
        else:
            raise PreprocessError(
                f"none of the EOD tokens {list(candidates)} is in {tokenizer_file}; "
                "name the right one with --eod-token"
            )

    def encode(self, text: str) -> numpy.ndarray:
        """Token ids of ``text`` without added special tokens (no EOD)."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return numpy.asarray(ids, dtype=numpy.int64)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self._tokenizer.decode([int(i) for i in ids])


def build_tokenizer(*, kind: str, tokenizer_file: str | None = None, eod_token: str | None = None):
    """The tokenizer named by ``--tokenizer``: ``byte`` or ``hf`` (which needs ``tokenizer_file``)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if not tokenizer_file:
            raise PreprocessError("--tokenizer hf needs --tokenizer-file path/to/tokenizer.json")
        return HFTokenizer(tokenizer_file=tokenizer_file, eod_token=eod_token)
    raise PreprocessError(f"unknown tokenizer {kind!r}: use 'byte' or 'hf'")


# --------------------------------------------------------------------------------------------
# Readers: each yields documents (str) from one file
# --------------------------------------------------------------------------------------------


def _open_text(*, path: str) -> io.TextIOBase:
    """``path`` opened as UTF-8 text (gzip-decompressed for ``.gz``); a clear error if missing."""
    if not os.path.isfile(path):
        raise PreprocessError(f"input file not found: {path}")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, "r", encoding="utf-8", newline="")


def detect_format(*, path: str) -> str:
    """``jsonl``, ``csv`` or ``text`` from the file name (a trailing ``.gz`` is ignored)."""
    name = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(name)[1].lower()
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if ext == ".csv":
        return "csv"
    return "text"


def read_jsonl(*, path: str, json_key: str) -> Iterator[str]:
    """Documents under ``json_key`` of each non-blank line of a JSON-lines file."""
    with _open_text(path=path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PreprocessError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or json_key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise PreprocessError(
                    f"{path}:{lineno}: no key {json_key!r} (found {keys}); choose it with --json-key"
                )
            value = record[json_key]
            if not isinstance(value, str):
                raise PreprocessError(
                    f"{path}:{lineno}: {json_key!r} holds {type(value).__name__}, not a string"
                )
            yield value


def _parse_columns(*, spec: str) -> list[str | int]:
    """``--csv-column``: comma-separated header names (str) or 0-based indices (int)."""
    columns: list[str | int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise PreprocessError(f"empty column in --csv-column {spec!r}")
        columns.append(int(part) if part.isdigit() else part)
    return columns


def read_csv(*, path: str, columns: str, join: str, header: bool | None) -> Iterator[str]:
    """Documents made of the ``columns`` of each csv row, joined by ``join``.

    ``columns`` is a comma-separated list of header names or 0-based indices. ``header`` None
    means: a header row exists iff the columns are given by name (AG News' csv has no header, so
    ``--csv-column 1,2`` reads title and description).
    """
    wanted = _parse_columns(spec=columns)
    by_name = any(isinstance(c, str) for c in wanted)
    has_header = by_name if header is None else header
    if by_name and not has_header:
        raise PreprocessError("--csv-column names columns, but --csv-header no says there is no header")
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with _open_text(path=path) as f:
        reader = csv.reader(f)
        indices: list[int]
        if has_header:
            try:
                names = next(reader)
            except StopIteration:
                return
            indices = []
            for column in wanted:
                if isinstance(column, int):
                    indices.append(column)
                elif column in names:
                    indices.append(names.index(column))
                else:
                    raise PreprocessError(f"{path}: no column {column!r} in header {names}")
        else:
            indices = [int(c) for c in wanted]
        first_row = 2 if has_header else 1
        for rowno, row in enumerate(reader, start=first_row):
            if not row:
                continue
            if max(indices) >= len(row):
                raise PreprocessError(
                    f"{path}:{rowno}: row has {len(row)} columns, --csv-column asks for index {max(indices)}"
                )
            yield join.join(row[i] for i in indices)


def read_text(*, path: str, mode: str) -> Iterator[str]:
    """Documents of a plain-text file: each non-blank line, or each blank-line separated paragraph."""
    with _open_text(path=path) as f:
        if mode == "line":
            for line in f:
                line = line.rstrip("\r\n")
                if line.strip():
                    yield line
            return
        if mode != "paragraph":
            raise PreprocessError(f"unknown --text-mode {mode!r}: use 'line' or 'paragraph'")
        paragraph: list[str] = []
        for line in f:
            line = line.rstrip("\r\n")
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "\n".join(paragraph)
                paragraph = []
        if paragraph:
            yield "\n".join(paragraph)


@dataclass(frozen=True)
class ReaderOptions:
    """How to find documents in the inputs (see the module docstring)."""

    format: str = "auto"
    json_key: str = "text"
    csv_column: str | None = None
    csv_join: str = " "
    csv_header: bool | None = None
    text_mode: str = "line"


def iter_documents(*, paths: Sequence[str], options: ReaderOptions) -> Iterator[str]:
    """All documents of ``paths``, in order."""
    for path in paths:
        fmt = detect_format(path=path) if options.format == "auto" else options.format
        if fmt == "jsonl":
            yield from read_jsonl(path=path, json_key=options.json_key)
        elif fmt == "csv":
            if options.csv_column is None:
                raise PreprocessError(
                    f"{path} is csv: say which column(s) hold the text with --csv-column "
                    "(for AG News' class,title,description rows: --csv-column 1,2)"
                )
            yield from read_csv(
                path=path, columns=options.csv_column, join=options.csv_join, header=options.csv_header
            )
        elif fmt == "text":
            yield from read_text(path=path, mode=options.text_mode)
        else:
            raise PreprocessError(f"unknown --format {fmt!r}: use jsonl, csv, text or auto")


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

_worker_tokenizers: dict = {}


def _encode_in_worker(job: tuple[tuple[str, str | None, str | None], str]) -> numpy.ndarray:
    """Encode one text in a worker process, building (once) the tokenizer that ``job`` names.

    The tokenizer is built lazily rather than in a Pool initializer: an initializer that raises
    makes the pool respawn workers forever, while an error here reaches the parent."""
    spec, text = job
    tokenizer = _worker_tokenizers.get(spec)
    if tokenizer is None:
        kind, tokenizer_file, eod_token = spec
        tokenizer = build_tokenizer(kind=kind, tokenizer_file=tokenizer_file, eod_token=eod_token)
        _worker_tokenizers[spec] = tokenizer
    return tokenizer.encode(text)


@dataclass
class Summary:
    """What :func:`preprocess` wrote."""

    prefix: str
    documents: int
    tokens: int
    skipped_empty: int
    vocab_size: int
    eod: int
    seconds: float


def preprocess(
    *,
    paths: Sequence[str],
    output_prefix: str,
    tokenizer_kind: str = "byte",
    tokenizer_file: str | None = None,
    eod_token: str | None = None,
    append_eod: bool = True,
    options: ReaderOptions = ReaderOptions(),
    workers: int = 1,
    log_interval: int = 10000,
    log: Callable[[str], None] | None = None,
) -> Summary:
    """Tokenize ``paths`` into ``<output_prefix>_text_document.bin/.idx``; one document per input doc.

    Empty documents are skipped. Files are written next to each other and removed again if
    anything fails, so a partial dataset never looks complete.
    """
    for path in paths:
        if not os.path.isfile(path):
            raise PreprocessError(f"input file not found: {path}")
    tokenizer = build_tokenizer(kind=tokenizer_kind, tokenizer_file=tokenizer_file, eod_token=eod_token)
    with warnings.catch_warnings():
        # megatron.core's package import warns about optional fused kernels we never use here.
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    # Ids go up to max(vocab_size - 1, eod); the byte tokenizer's EOD equals its vocab size.
    dtype = DType.optimal_dtype(max(tokenizer.vocab_size, tokenizer.eod + 1))
    prefix = output_prefix + OUTPUT_SUFFIX
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"

    documents = iter_documents(paths=paths, options=options)
    start = time.monotonic()
    n_docs = n_tokens = n_chars = 0
    pool = None
    try:
        builder = IndexedDatasetBuilder(bin_path, dtype=dtype)
        skipped = [0]

        def nonempty_documents() -> Iterator[str]:
            for doc in documents:
                if doc.strip():
                    yield doc
                else:
                    skipped[0] += 1

        nonempty = nonempty_documents()
        encoded: Iterable[tuple[str, numpy.ndarray]]
        if workers > 1:
            # Spawned workers import this file by module name: tools.preprocess_data (installed),
            # or __main__ (spawn runs the script's path again).
            pool = multiprocessing.get_context("spawn").Pool(workers)
            encoded = _encode_in_pool(
                texts=nonempty, pool=pool, spec=(tokenizer_kind, tokenizer_file, eod_token),
                batch_size=POOL_BATCH_PER_WORKER * workers,
            )
        else:
            encoded = ((text, tokenizer.encode(text)) for text in nonempty)
        for text, ids in encoded:
            if append_eod:
                ids = numpy.append(ids, tokenizer.eod)
            builder.add_document(ids, [int(ids.size)])
            n_docs += 1
            n_tokens += int(ids.size)
            n_chars += len(text)
            if log is not None and log_interval > 0 and n_docs % log_interval == 0:
                elapsed = max(time.monotonic() - start, 1e-9)
                log(
                    f"{n_docs} documents, {n_tokens} tokens, {n_docs / elapsed:.0f} documents/s, "
                    f"{n_chars / elapsed / 1e6:.2f} M chars/s"
                )
        builder.finalize(idx_path)
    except BaseException:
        for path in (bin_path, idx_path):
            if os.path.exists(path):
                os.remove(path)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    n_empty = skipped[0]
    return Summary(
        prefix=prefix,
        documents=n_docs,
        tokens=n_tokens,
        skipped_empty=n_empty,
        vocab_size=tokenizer.vocab_size,
        eod=tokenizer.eod,
        seconds=time.monotonic() - start,
    )


def _encode_in_pool(*, texts: Iterable[str], pool, spec: tuple, batch_size: int) -> Iterator[tuple[str, numpy.ndarray]]:
    """``(text, ids)`` in input order, encoded by ``pool`` one bounded batch at a time.

    Batches (rather than ``Pool.imap`` over the whole stream, whose feeder thread reads ahead
    without limit) keep memory flat on corpora larger than RAM."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield from zip(batch, pool.map(_encode_in_worker, [(spec, t) for t in batch], chunksize=64))
            batch = []
    if batch:
        yield from zip(batch, pool.map(_encode_in_worker, [(spec, t) for t in batch], chunksize=64))


# --------------------------------------------------------------------------------------------
# Sample corpus
# --------------------------------------------------------------------------------------------

_WORDS = (
    "market stocks rose fell shares investors team season game won lost league researchers "
    "found study space launch rocket software company quarter profit growth election vote "
    "minister talks peace city storm rain record new first final report said today week"
).split()
_EXTRA = ("café", "naïve", "Zürich", "東京", "données", "🚀", "—", "“quoted”")


def write_sample_corpus(*, path: str, num_docs: int = 200, seed: int = 0) -> list[str]:
    """Write ``num_docs`` synthetic news-like documents to ``path`` and return their texts.

    The format follows the extension: ``.jsonl`` (key ``text``), ``.csv`` (AG News' header-less
    ``class,title,description`` rows; the returned text is ``title + " " + description``), or
    anything else as one document per line. Some words are non-ASCII to exercise UTF-8.
    """
    rng = random.Random(seed)

    def sentence(n_words: int) -> str:
        words = [rng.choice(_WORDS if rng.random() > 0.1 else _EXTRA) for _ in range(n_words)]
        return " ".join(words).capitalize() + "."

    fmt = detect_format(path=path)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    texts: list[str] = []
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL) if fmt == "csv" else None
        for _ in range(num_docs):
            if fmt == "csv":
                title, body = sentence(rng.randint(3, 8)), sentence(rng.randint(8, 30))
                writer.writerow([str(rng.randint(1, 4)), title, body])
                texts.append(f"{title} {body}")
            else:
                text = " ".join(sentence(rng.randint(5, 20)) for _ in range(rng.randint(1, 4)))
                if fmt == "jsonl":
                    f.write(json.dumps({"text": text, "id": len(texts)}, ensure_ascii=False) + "\n")
                else:
                    f.write(text + "\n")
                texts.append(text)
    return texts


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    io_group = parser.add_argument_group("input and output")
    io_group.add_argument("--input", nargs="+", metavar="FILE", help="corpus file(s), optionally .gz")
    io_group.add_argument(
        "--output-prefix", help="writes <prefix>_text_document.bin/.idx (use that as DATA_PATH)"
    )
    io_group.add_argument("--format", default="auto", choices=("auto", "jsonl", "csv", "text"))
    io_group.add_argument("--json-key", default="text", help="jsonl: key of the document text")
    io_group.add_argument(
        "--csv-column",
        help="csv: header name(s) or 0-based index(es), comma-separated (AG News: 1,2)",
    )
    io_group.add_argument("--csv-join", default=" ", help="csv: separator between joined columns")
    io_group.add_argument(
        "--csv-header",
        choices=("auto", "yes", "no"),
        default="auto",
        help="csv: is the first row a header? auto: yes iff --csv-column uses names",
    )
    io_group.add_argument(
        "--text-mode",
        choices=("line", "paragraph"),
        default="line",
        help="text: one document per line, or per blank-line separated paragraph",
    )
    tok = parser.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", choices=("byte", "hf"), default="byte")
    tok.add_argument("--tokenizer-file", help="hf: local tokenizer.json")
    tok.add_argument("--eod-token", help="hf: the end-of-document token (default: a common one)")
    tok.add_argument("--no-eod", action="store_true", help="do not append EOD to each document")
    run = parser.add_argument_group("run")
    run.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    run.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    run.add_argument(
        "--make-sample",
        metavar="FILE",
        help="write a small synthetic corpus (.jsonl, .csv or text) to FILE and exit",
    )
    run.add_argument("--sample-docs", type=int, default=200)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.make_sample:
        write_sample_corpus(path=args.make_sample, num_docs=args.sample_docs)
        print(f"wrote {args.sample_docs} documents to {args.make_sample}")
        return 0
    if not args.input or not args.output_prefix:
        parser.error("--input and --output-prefix are required (or --make-sample FILE)")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    options = ReaderOptions(
        format=args.format,
        json_key=args.json_key,
        csv_column=args.csv_column,
        csv_join=args.csv_join,
        csv_header={"auto": None, "yes": True, "no": False}[args.csv_header],
        text_mode=args.text_mode,
    )
    try:
        summary = preprocess(
            paths=args.input,
            output_prefix=args.output_prefix,
            tokenizer_kind=args.tokenizer,
            tokenizer_file=args.tokenizer_file,
            eod_token=args.eod_token,
            append_eod=not args.no_eod,
            options=options,
            workers=args.workers,
            log_interval=args.log_interval,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except PreprocessError as exc:
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        return 2
    rate = summary.documents / max(summary.seconds, 1e-9)
    print(
        f"wrote {summary.prefix}.bin/.idx: {summary.documents} documents, {summary.tokens} tokens "
        f"({summary.skipped_empty} empty skipped) in {summary.seconds:.1f}s, {rate:.0f} documents/s"
    )
    if args.tokenizer == "byte":
        hint = f"--tokenizer-type NullTokenizer --vocab-size {byte_train_vocab_size()}  (or TOKENIZER=byte)"
    else:
        hint = f"--vocab-size {summary.vocab_size} (EOD id {summary.eod})"
    print(f"train with: --data-path {summary.prefix} {hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
