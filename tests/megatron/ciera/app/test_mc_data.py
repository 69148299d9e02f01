"""megatron.ciera.app.data: Megatron indexed datasets (.bin/.idx) and the resumable batch order."""

import math

import numpy as np
import pytest
import torch

from megatron.ciera.app import arguments, data
from megatron.ciera.app.upstream_features import null_tokenizer_vocab_size


class BatchOrder:
    """Test oracle, independent of the loader's code: the micro batches of one data-parallel rank
    in Megatron-LM's pretraining-sampler order, straight from the formula
    global sample = (iteration * micro batches + index) * mbs * dp + rank * mbs + j."""

    def __init__(self, dataset, micro_batch_size: int, dp_size: int, dp_rank: int, num_microbatches: int):
        self.dataset, self.mbs, self.dp, self.rank, self.nmb = dataset, micro_batch_size, dp_size, dp_rank, num_microbatches

    def micro_batch(self, iteration: int, index: int) -> dict:
        start = (iteration * self.nmb + index) * self.mbs * self.dp + self.rank * self.mbs
        return data.collate([self.dataset[start + j] for j in range(self.mbs)])


def _args(extra):
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--lr", "1e-4", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    return arguments.validate_args(arguments.build_parser().parse_args(base + extra), world_size=2)


def test_indexed_dataset_and_batch_order(tmp_path):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "toy_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(64):
        builder.add_item(torch.from_numpy(rng.integers(0, 100, size=int(rng.integers(5, 40))).astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")

    args = _args(["--data-path", prefix, "--split", "100,0,0", "--data-cache-path", str(tmp_path / "cache")])
    tokenizer = data.build_tokenizer(args)
    dataset = data.build_datasets(args, tokenizer)[0]
    assert len(dataset) >= args.train_iters * args.global_batch_size
    order = [BatchOrder(dataset, 2, 2, r, args.num_microbatches) for r in (0, 1)]
    batch = order[1].micro_batch(iteration=2, index=1)
    assert batch["tokens"].shape == (2, 16) and batch["labels"].shape == (2, 16)
    # global sample index = iteration * gbs + micro batch * mbs * dp + rank * mbs + j
    assert torch.equal(batch["tokens"][0], torch.as_tensor(dataset[2 * 8 + 1 * 4 + 1 * 2]["tokens"]))
    seen = [tuple(order[r].micro_batch(i, m)["tokens"][j].tolist())
            for i in range(3) for m in range(2) for r in range(2) for j in range(2)]
    assert len(seen) == 24


def test_weighted_blend_parsing_and_vocab_padding():
    assert data._blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert data._blend(["a", "b"]) == (["a", "b"], None)
    assert data.padded_vocab_size(101, 128) == 128 and data.padded_vocab_size(256, 128) == 256


# --- the dataset flags (GPTDatasetConfig) on a corpus tools/preprocess_data.py wrote ---

EOD = 260  # tools/preprocess_data.py's byte tokenizer: NullTokenizer's EOD must land here
BYTE_VOCAB = str(null_tokenizer_vocab_size(EOD))  # 260 on megatron-core 0.16, 261 on 0.19 (EOD = vocab_size - 1)


def _byte_corpus(tmp_path):
    import importlib

    pp = importlib.import_module("tools.preprocess_data")
    import json
    import random

    rng = random.Random(5)
    corpus = tmp_path / "corpus.jsonl"  # short documents: every 64-token sample crosses several
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(["ab", "cde", "fg", "é"]) for _ in range(rng.randint(1, 9)))}) + "\n"
                              for _ in range(120)))
    return pp.preprocess(paths=[str(corpus)], output_prefix=str(tmp_path / "bytes")).prefix


def _first_samples(tmp_path, prefix, extra, n=6):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64",
            "--lr", "1e-4", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", BYTE_VOCAB, "--data-path", prefix, "--split", "100,0,0",
            "--data-cache-path", str(tmp_path / "cache")]
    args = arguments.validate_args(arguments.build_parser().parse_args(base + extra), world_size=1)
    dataset = data.build_datasets(args, data.build_tokenizer(args))[0]
    return data.collate([dataset[i] for i in range(n)])


def _documents(tokens):
    """Document number of each position: a new document starts after every EOD."""
    return torch.cumsum(torch.nn.functional.pad((tokens == EOD)[:, :-1].long(), (1, 0)), dim=1)


def test_dataset_flags_change_the_batches_as_upstream(tmp_path):
    prefix = _byte_corpus(tmp_path)
    plain = _first_samples(tmp_path, prefix, [])
    tokens = plain["tokens"]
    assert (tokens == EOD).any(dim=1).all(), "every sample crosses a document boundary"
    seq = tokens.shape[1]
    # upstream's defaults: positions 0..s-1, every token in the loss, a causal mask (True = masked)
    assert torch.equal(plain["position_ids"], torch.arange(seq).expand_as(tokens))
    assert torch.equal(plain["loss_mask"], torch.ones_like(plain["loss_mask"]))
    causal = torch.ones(seq, seq).triu(1).bool()
    assert plain["attention_mask"].shape == (len(tokens), 1, seq, seq)
    assert torch.equal(plain["attention_mask"][:, 0], causal.expand(len(tokens), seq, seq))

    reset = _first_samples(tmp_path, prefix, ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"])
    assert torch.equal(reset["tokens"], tokens)  # the same samples, only their masks and positions differ
    doc = _documents(tokens)
    start = torch.stack([torch.tensor([int((doc[b, :t + 1] == doc[b, t]).nonzero()[0]) for t in range(seq)])
                         for b in range(len(tokens))])
    assert torch.equal(reset["position_ids"], torch.arange(seq) - start)  # positions restart after each EOD
    assert torch.equal(reset["loss_mask"], (tokens != EOD).float())  # EOD tokens leave the loss
    other_doc = doc[:, :, None] != doc[:, None, :]
    assert torch.equal(reset["attention_mask"][:, 0], causal | other_doc)  # no attention across documents

    bare = _first_samples(tmp_path, prefix, ["--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files"])
    assert "attention_mask" not in bare and torch.equal(bare["tokens"], tokens)
    assert torch.equal(bare["position_ids"], plain["position_ids"])


def test_dataset_config_is_read_off_the_dataclass():
    import dataclasses

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    args = _args(["--mock-data", "--reset-position-ids", "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader"])
    kwargs = data.dataset_config_kwargs(args, tokenizer=None)
    fields = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    assert set(kwargs) <= fields and {"blend", "split"}.isdisjoint(kwargs)
    assert kwargs["reset_position_ids"] and not kwargs["mmap_bin_files"] and not kwargs["create_attention_mask"]
    assert not kwargs["reset_attention_mask"] and not kwargs["eod_mask_loss"]
    assert (kwargs["random_seed"], kwargs["sequence_length"]) == (args.seed, args.seq_length)


@pytest.mark.slow
@pytest.mark.distributed
def test_training_with_the_dataset_flags_is_bit_identical_with_ciera(tmp_path):
    from megatron.ciera.app.launch import run_pretrain

    prefix = _byte_corpus(tmp_path)
    flags = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64",
             "--max-position-embeddings", "64", "--lr", "1e-3", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "3", "--tokenizer-type", "NullTokenizer", "--vocab-size", BYTE_VOCAB, "--data-path", prefix,
             "--split", "100,0,0", "--data-cache-path", str(tmp_path / "cache"), "--eval-iters", "0",
             "--num-workers", "0", "--device", "cpu", "--seed", "3", "--use-distributed-optimizer",
             "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--no-mmap-bin-files"]
    ciera = ["--ciera-allgather", "--ciera-selection", "always", "--ciera-warmup-iters", "1"]
    runs = [run_pretrain(flags + extra, nproc=2, timeout=240) for extra in ([], ciera)]
    for r in runs:
        assert r.returncode == 0, r.output[-3000:]
        assert sorted(r.losses) == [1, 2, 3] and all(math.isfinite(v) for v in r.losses.values())
    assert runs[0].losses == runs[1].losses and runs[0].sha256 == runs[1].sha256
