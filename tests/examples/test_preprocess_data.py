"""tools/preprocess_data.py: corpora it generates round-trip through megatron-core's indexed
dataset (token ids and document boundaries), and bad inputs fail with messages naming the problem."""

from __future__ import annotations

import csv
import gzip
import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from megatron.ciera.app.upstream_features import null_tokenizer_vocab_size

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "preprocess_data.py"


pp = importlib.import_module("tools.preprocess_data")  # spawn workers import it by this name too


def read_back(prefix: str) -> list[numpy.ndarray]:
    """Every document of ``prefix`` as one id array, via megatron-core's reader."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    doc_index = dataset.document_indices
    docs = []
    for d in range(len(doc_index) - 1):
        seqs = [dataset[i] for i in range(doc_index[d], doc_index[d + 1])]
        docs.append(numpy.concatenate(seqs) if seqs else numpy.zeros(0, dtype=numpy.int64))
    assert len(dataset) == len(docs)  # one sequence per document
    return docs


def assert_round_trip(prefix: str, texts: list[str], *, eod: bool = True) -> None:
    docs = read_back(prefix)
    assert len(docs) == len(texts)
    tok = pp.ByteTokenizer()
    for ids, text in zip(docs, texts):
        expected = list(text.encode("utf-8"))
        body = ids[:-1] if eod else ids
        if eod:
            assert ids[-1] == pp.BYTE_EOD
        assert [int(i) - pp.BYTE_OFFSET for i in body] == expected
        assert tok.decode(ids) == text
        assert int(ids.min()) >= pp.BYTE_OFFSET and int(ids.max()) <= pp.BYTE_EOD


def run(paths, prefix, **kwargs):
    return pp.preprocess(paths=[str(p) for p in paths], output_prefix=str(prefix), **kwargs)


def test_byte_tokenizer_layout():
    tok = pp.ByteTokenizer()
    ids = tok.encode("aé🚀")
    assert list(ids) == [b + 4 for b in "aé🚀".encode("utf-8")]
    assert tok.vocab_size == tok.eod == 260 == pp.BYTE_VOCAB_SIZE
    assert tok.decode(list(ids) + [tok.eod, 0, 1]) == "aé🚀"
    assert tok.encode("").size == 0


@pytest.mark.parametrize("ext", ["jsonl", "txt", "csv"])
def test_generated_corpus_round_trips(tmp_path, ext):
    corpus = tmp_path / f"corpus.{ext}"
    texts = pp.write_sample_corpus(path=str(corpus), num_docs=57, seed=3)
    assert any(ord(c) > 127 for t in texts for c in t)  # multi-byte UTF-8 is exercised
    options = pp.ReaderOptions(csv_column="1,2") if ext == "csv" else pp.ReaderOptions()
    summary = run([corpus], tmp_path / "out" / "ds", options=options)
    prefix = str(tmp_path / "out" / "ds_text_document")
    assert summary.prefix == prefix and summary.documents == 57
    assert summary.tokens == sum(len(t.encode("utf-8")) + 1 for t in texts)
    assert_round_trip(prefix, texts)


def test_ag_news_shaped_csv(tmp_path):
    """AG News' train.csv: header-less "class","title","description" rows with embedded commas/quotes."""
    rows = [["3", "Wall St. Bears Claw Back", 'Reuters - Short-sellers, "ultra-cynics", are back.'],
            ["4", "Space, the final", "A rocket\nlaunched today."],
            ["1", "", "Only a description"]]
    corpus = tmp_path / "train.csv"
    with open(corpus, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    run([corpus], tmp_path / "desc", options=pp.ReaderOptions(csv_column="2"))
    assert_round_trip(str(tmp_path / "desc_text_document"), [r[2] for r in rows])
    run([corpus], tmp_path / "both", options=pp.ReaderOptions(csv_column="1,2", csv_join=". "))
    assert_round_trip(str(tmp_path / "both_text_document"), [f"{r[1]}. {r[2]}" for r in rows])


def test_csv_with_header_by_name(tmp_path):
    corpus = tmp_path / "named.csv"
    corpus.write_text("label,title,body\n1,t1,b1\n2,t2,\n", encoding="utf-8")
    run([corpus], tmp_path / "x", options=pp.ReaderOptions(csv_column="title,body"))
    assert_round_trip(str(tmp_path / "x_text_document"), ["t1 b1", "t2 "])
    with pytest.raises(pp.PreprocessError, match="no column 'text'"):
        run([corpus], tmp_path / "y", options=pp.ReaderOptions(csv_column="text"))
    with pytest.raises(pp.PreprocessError, match="--csv-column"):
        run([corpus], tmp_path / "z")


def test_text_paragraph_mode_and_empty_documents(tmp_path):
    corpus = tmp_path / "book.txt"
    corpus.write_text("first line\nsame paragraph\n\n\n  \nsecond\r\n\nthird\n", encoding="utf-8")
    run([corpus], tmp_path / "para", options=pp.ReaderOptions(text_mode="paragraph"))
    assert_round_trip(str(tmp_path / "para_text_document"), ["first line\nsame paragraph", "second", "third"])
    summary = run([corpus], tmp_path / "line")
    assert summary.skipped_empty == 0  # blank lines are separators, not documents
    assert_round_trip(str(tmp_path / "line_text_document"), ["first line", "same paragraph", "second", "third"])

    jsonl = tmp_path / "e.jsonl"
    jsonl.write_text('{"text": "a"}\n{"text": ""}\n\n{"text": "   "}\n{"text": "b"}\n', encoding="utf-8")
    summary = run([jsonl], tmp_path / "e")
    assert (summary.documents, summary.skipped_empty) == (2, 2)
    assert_round_trip(str(tmp_path / "e_text_document"), ["a", "b"])


def test_json_key_gzip_several_inputs_and_no_eod(tmp_path):
    a = tmp_path / "a.jsonl.gz"
    with gzip.open(a, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"content": "zipped é"}) + "\n")
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps({"content": "plain"}) + "\n", encoding="utf-8")
    run([a, b], tmp_path / "k", options=pp.ReaderOptions(json_key="content"), append_eod=False)
    assert_round_trip(str(tmp_path / "k_text_document"), ["zipped é", "plain"], eod=False)
    with pytest.raises(pp.PreprocessError, match=r"b.jsonl:1: no key 'text'.*--json-key"):
        run([b], tmp_path / "k2")


def test_workers_give_the_same_bytes(tmp_path, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    pp.write_sample_corpus(path=str(corpus), num_docs=300, seed=1)
    run([corpus], tmp_path / "one")
    monkeypatch.setattr(pp, "POOL_BATCH_PER_WORKER", 7)  # 300 = 21 batches of 14 + a remainder of 6
    run([corpus], tmp_path / "two", workers=2)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one_text_document{ext}").read_bytes() == (tmp_path / f"two_text_document{ext}").read_bytes()


def test_missing_files_give_clear_errors(tmp_path):
    with pytest.raises(pp.PreprocessError, match="input file not found: .*nope.jsonl"):
        run([tmp_path / "nope.jsonl"], tmp_path / "x")
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello\n", encoding="utf-8")
    with pytest.raises(pp.PreprocessError, match="tokenizer file not found: .*tok.json.*never downloads"):
        run([corpus], tmp_path / "x", tokenizer_kind="hf", tokenizer_file=str(tmp_path / "tok.json"))
    with pytest.raises(pp.PreprocessError, match="needs --tokenizer-file"):
        run([corpus], tmp_path / "x", tokenizer_kind="hf")
    assert not list(tmp_path.glob("x_text_document*"))


def test_missing_tokenizers_package_is_named(tmp_path, monkeypatch):
    tok_file = tmp_path / "tokenizer.json"
    tok_file.write_text("{}", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(pp.PreprocessError, match="pip install tokenizers"):
        pp.build_tokenizer(kind="hf", tokenizer_file=str(tok_file))


def test_bad_input_removes_partial_output(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(pp.PreprocessError, match="bad.jsonl:2: not valid JSON"):
        run([corpus], tmp_path / "bad")
    assert not list(tmp_path.glob("bad_text_document*"))


def test_hf_tokenizer_file_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "the": 2, "cat": 3, "sat": 4}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_file = tmp_path / "tokenizer.json"
    tok.save(str(tok_file))
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat\ncat dog\n", encoding="utf-8")
    summary = run([corpus], tmp_path / "hf", tokenizer_kind="hf", tokenizer_file=str(tok_file))
    assert (summary.vocab_size, summary.eod) == (5, 1)
    docs = read_back(str(tmp_path / "hf_text_document"))
    assert [d.tolist() for d in docs] == [[2, 3, 4, 1], [3, 0, 1]]
    with pytest.raises(pp.PreprocessError, match="--eod-token"):
        run([corpus], tmp_path / "hf2", tokenizer_kind="hf", tokenizer_file=str(tok_file), eod_token="<eod>")


def test_command_line(tmp_path):
    sample = tmp_path / "s.csv"
    out = subprocess.run([sys.executable, str(TOOL), "--make-sample", str(sample), "--sample-docs", "30"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--input", str(sample), "--csv-column", "1,2",
         "--output-prefix", str(tmp_path / "agnews"), "--log-interval", "10"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "documents/s" in proc.stderr  # progress lines
    assert f"--tokenizer-type NullTokenizer --vocab-size {null_tokenizer_vocab_size(260)} " in proc.stdout
    assert len(read_back(str(tmp_path / "agnews_text_document"))) == 30

    missing = subprocess.run(
        [sys.executable, str(TOOL), "--input", str(tmp_path / "none.csv"), "--output-prefix", str(tmp_path / "n")],
        capture_output=True, text=True, timeout=120,
    )
    assert missing.returncode == 2
    assert "input file not found" in missing.stderr and "Traceback" not in missing.stderr
