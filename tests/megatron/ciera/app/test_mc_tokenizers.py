"""--tokenizer-type TikTokenizer / Llama2Tokenizer / SentencePiece: megatron-core's own tokenizers
from local files (a tiny TikToken vocabulary and a SentencePiece model trained here; nothing is
downloaded), with upstream's --tiktoken-* flags, and megatron-core's GPT dataset built on them."""

import base64
import json

import pytest

from megatron.ciera.app import arguments, data, flag_policy

BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--lr", "1e-4", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--mock-data",
        "--eval-iters", "0"]
MERGES = [b"th", b"he", b" t", b"the"]


def _args(extra):
    return arguments.validate_args(arguments.build_parser().parse_args(BASE + extra), world_size=1)


def _tiktoken_vocab(tmp_path):
    """TikToken's JSON vocabulary as megatron-core reads it: the 256 bytes, then the merges, by rank."""
    pieces = [bytes([i]) for i in range(256)] + MERGES
    vocab = [{"rank": i, "token_bytes": base64.b64encode(p).decode(), "token_str": p.decode("latin-1")}
             for i, p in enumerate(pieces)]
    path = tmp_path / "tiktoken.json"
    path.write_text(json.dumps(vocab))
    return str(path)


def test_tiktokenizer_honours_the_tiktoken_flags(tmp_path):
    pytest.importorskip("tiktoken")
    vocab = _tiktoken_vocab(tmp_path)
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab, "--vocab-size", "360"]
    tok = data.build_tokenizer(_args(flags + ["--tiktoken-num-special-tokens", "100"]))
    assert tok.vocab_size == 360 and tok.eod == 2  # "</s>", the third of megatron-core's special tokens
    # ids are ranks shifted by the special tokens: " " = 32, "the" = merge 3 (rank 259)
    assert tok.tokenize(" the") == [100 + 32, 100 + 259] and tok.detokenize(tok.tokenize(" the")) == " the"
    flags[-1] = "310"  # 50 + the 260 entries
    shifted = data.build_tokenizer(_args(flags + ["--tiktoken-num-special-tokens", "50", "--tiktoken-pattern", "v1"]))
    assert shifted.tokenize(" the") == [50 + 32, 50 + 259]
    flags[-1] = "400"  # more ids than special tokens + entries
    with pytest.raises(SystemExit, match="--vocab-size 400 must be at most --tiktoken-num-special-tokens 100"):
        data.build_tokenizer(_args(flags + ["--tiktoken-num-special-tokens", "100"]))
    for dest in ("tiktoken_pattern", "tiktoken_num_special_tokens", "tokenizer_special_tokens"):
        assert flag_policy.policy(dest).kind == "feature:data"


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("spm")
    (folder / "corpus.txt").write_text("".join(f"the quick brown fox jumps over the lazy dog {i}\n" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(folder / "corpus.txt"), model_prefix=str(folder / "tiny"),
                                   vocab_size=60, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    return str(folder / "tiny.model"), spm.SentencePieceProcessor(model_file=str(folder / "tiny.model"))


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_sentencepiece_tokenizers_from_a_trained_model(sentencepiece_model, kind):
    path, processor = sentencepiece_model
    tok = data.build_tokenizer(_args(["--tokenizer-type", kind, "--tokenizer-model", path]))
    assert tok.vocab_size == processor.get_piece_size() == 60 and tok.eod == processor.eos_id() == 2
    text = "the lazy fox"
    assert tok.tokenize(text) == processor.encode(text) and tok.detokenize(tok.tokenize(text)) == text


def test_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type Llama2Tokenizer needs --tokenizer-model"):
        _args(["--tokenizer-type", "Llama2Tokenizer"])
    with pytest.raises(SystemExit, match="--tokenizer-model .*missing.model: no such file"):
        data.build_tokenizer(_args(["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                                    str(tmp_path / "missing.model")]))


def test_gpt_dataset_on_a_sentencepiece_tokenizer(sentencepiece_model, tmp_path):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    args = _args(["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sentencepiece_model[0],
                  "--data-cache-path", str(tmp_path / "cache")])
    tok = data.build_tokenizer(args)
    train = data.build_datasets(args, tok)[0]
    sample = train[0]
    assert sample["tokens"].shape == (16,) and int(sample["tokens"].max()) < tok.vocab_size
    assert data.padded_vocab_size(tok.vocab_size, args.make_vocab_size_divisible_by) == 128
