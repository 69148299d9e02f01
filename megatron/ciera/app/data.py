"""Data for ``pretrain_gpt.py``: Megatron-Core GPT datasets (train / valid / test) and loaders.

* Splits come from ``--split`` over ``--data-path`` (a weighted blend: ``[w1] p1 [w2 p2 ...]``) or
  from ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``; ``--mock-data`` uses
  megatron-core's MockGPTDataset. :func:`check_splits` validates the split sizes from the ``.idx``
  files before megatron-core builds anything (megatron-core loops forever on a split with no
  documents).
* The sample order is a pure function of the iteration (Megatron-LM's pretraining sampler: each
  global batch is ``num_microbatches`` consecutive chunks of ``micro x dp`` samples, data-parallel
  rank ``r`` takes the ``r``-th micro batch of each chunk), so a resume needs only the iteration.
  Evaluation ``k`` (the k-th call of the run, counted from iteration 0) reads the valid samples
  ``[k x eval_iters x gbs, (k + 1) x eval_iters x gbs)``, so resumed and uninterrupted runs report
  the same validation loss.
* The dataset's own flags (``--reset-position-ids``, ``--reset-attention-mask``, ``--eod-mask-loss``,
  ``--no-create-attention-mask-in-dataloader``, ``--no-mmap-bin-files``) reach megatron-core's
  ``GPTDatasetConfig``, whose fields :func:`dataset_config_kwargs` reads off the dataclass.
* Loading runs in a ``torch.utils.data.DataLoader`` with ``--num-workers`` worker processes
  (prefetching 2 micro batches each), pinned memory on CUDA.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from collections import OrderedDict

import torch


MODEL_FILE_TOKENIZERS = {"TikTokenizer": "tiktoken", "SentencePieceTokenizer": "sentencepiece",
                         "GPTSentencePieceTokenizer": "sentencepiece", "Llama2Tokenizer": "sentencepiece"}
"""``--tokenizer-type`` values megatron-core's own builder makes from ``--tokenizer-model`` (a local
file), with the package each needs."""

TOKENIZERS = ("NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", *MODEL_FILE_TOKENIZERS)
"""The ``--tokenizer-type`` values :func:`build_tokenizer` builds."""

TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "tiktoken_pattern",
                   "tiktoken_num_special_tokens", "tokenizer_special_tokens", "special_tokens",
                   "tokenizer_sentencepiece_legacy", "tokenizer_sentencepiece_ignore_extra_whitespaces")
"""Flags :func:`build_tokenizer` honours (``--tokenizer-special-tokens``, whose dest is
``special_tokens`` from 0.19 on, and the ``--tiktoken-*`` / SentencePiece ones through
megatron-core's builder)."""


def _megatron_tokenizer(args: argparse.Namespace):
    """TikToken and SentencePiece (Llama 2) tokenizers from ``--tokenizer-model``, by megatron-core's
    own builder (the one upstream's ``pretrain_gpt.py`` calls; it moved in 0.19). GPT2BPETokenizer is
    not built there: megatron-core's asks the Hugging Face hub for ``gpt2``'s configuration."""
    import copy
    import importlib

    package = MODEL_FILE_TOKENIZERS[args.tokenizer_type]
    try:
        importlib.import_module(package)
    except ImportError:
        raise SystemExit(f"--tokenizer-type {args.tokenizer_type} needs the '{package}' package "
                         f"(pip install {package})") from None
    if not os.path.isfile(args.tokenizer_model):
        raise SystemExit(f"--tokenizer-model {args.tokenizer_model}: no such file (nothing is downloaded)")
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as build
    except ImportError:  # megatron-core < 0.19
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as build
    view = copy.copy(args)
    view.pad_vocab_size = False  # 0.19's builder would set padded_vocab_size; training pads itself
    try:
        return build(view)
    except AssertionError as exc:  # megatron-core's consistency checks of the file against the flags
        hint = (f"; TikTokenizer: --vocab-size {args.vocab_size} must be at most --tiktoken-num-special-tokens "
                f"{args.tiktoken_num_special_tokens} + the file's entries" if args.tokenizer_type == "TikTokenizer" else "")
        raise SystemExit(f"--tokenizer-model {args.tokenizer_model}: megatron-core's {args.tokenizer_type} rejects it "
                         f"({exc or 'a consistency check failed'}){hint}") from None


def _gpt2_bpe(cls, vocab_file: str, merge_file: str):
    """``cls`` (GPT2TokenizerFast) from the two files. transformers < 5 takes the paths
    (``vocab_file`` / ``merges_file``); 5.x takes the contents (``vocab`` / ``merges``) and
    silently ignores the old keywords, which would leave a one-token vocabulary."""
    import inspect
    import json

    if "vocab_file" in inspect.signature(cls.__init__).parameters:
        return cls(vocab_file=vocab_file, merges_file=merge_file)
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().splitlines() if line and not line.startswith("#version")]
    return cls(vocab=vocab, merges=merges)


class _HFTokenizer:
    """The few members Megatron-Core's GPT datasets use, over a Hugging Face tokenizer."""

    def __init__(self, name: str, *, vocab_file: str | None = None, merge_file: str | None = None):
        kind = "GPT2BPETokenizer" if vocab_file else "HuggingFaceTokenizer"
        try:
            from transformers import AutoTokenizer, GPT2TokenizerFast
        except ImportError:
            raise SystemExit(f"--tokenizer-type {kind} needs the 'transformers' package "
                             "(pip install transformers); with --mock-data use NullTokenizer") from None
        if vocab_file:  # GPT-2's byte-level BPE from vocab.json + merges.txt, as Megatron-LM's GPT2BPETokenizer
            self._tok = _gpt2_bpe(GPT2TokenizerFast, vocab_file, merge_file)
        else:
            self._tok = AutoTokenizer.from_pretrained(name)
        self._name, self._kind = name, kind

    @property
    def vocab_size(self):
        return len(self._tok)

    @property
    def eod(self):
        return self._tok.eos_token_id

    @property
    def unique_identifiers(self):
        return OrderedDict({"class": self._kind, "model": self._name})


def build_tokenizer(args: argparse.Namespace):
    if args.tokenizer_type == "NullTokenizer":
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        return NullTokenizer(args.vocab_size)
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return _HFTokenizer(args.tokenizer_model)
    if args.tokenizer_type == "GPT2BPETokenizer":
        return _HFTokenizer(args.vocab_file, vocab_file=args.vocab_file, merge_file=args.merge_file)
    if args.tokenizer_type in MODEL_FILE_TOKENIZERS:
        return _megatron_tokenizer(args)
    raise SystemExit(f"--tokenizer-type {args.tokenizer_type} is not supported by this entry point; "
                     f"use one of {', '.join(TOKENIZERS)}")


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron-LM pads the embedding table to a multiple of ``--make-vocab-size-divisible-by``."""
    return -(-vocab_size // divisible_by) * divisible_by


def _blend(data_path: list[str]):
    """``--data-path`` as ``[w1 p1 w2 p2 ...]`` or ``[p1 p2 ...]`` -> (prefixes, weights or None)."""
    if len(data_path) == 1:
        return [data_path[0]], None
    try:
        weights = [float(x) for x in data_path[0::2]]
    except ValueError:
        return list(data_path), None
    if len(data_path) % 2:
        raise SystemExit(f"--data-path {' '.join(data_path)}: weights and prefixes must alternate")
    return list(data_path[1::2]), weights


SPLITS = ("train", "valid", "test")


def split_sizes(args: argparse.Namespace) -> list[int]:
    """Samples each split must provide (Megatron-LM's arithmetic): train the samples of
    ``train_iters`` global batches (``train_iters x gbs`` without a batch ramp); valid
    ``eval_iters x gbs`` per evaluation, ``train_iters // eval_interval + 1`` evaluations; test
    ``eval_iters x gbs``."""
    from .batch_schedule import BatchSchedule

    gbs = args.global_batch_size
    evals = args.train_iters // args.eval_interval + 1 if args.eval_interval else 1
    train = BatchSchedule.from_args(args).consumed_samples(args.train_iters)
    return [train, args.eval_iters * gbs * evals, args.eval_iters * gbs]


def _split_matrix(split: str) -> list:
    """megatron-core's own parsing of ``--split`` into ``[(lo, hi) or None] x 3``."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    try:
        return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    except (AssertionError, ValueError) as exc:
        raise SystemExit(f"--split {split!r}: give up to three non-negative proportions, e.g. 969,30,1 ({exc})") from None


def _document_lengths(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise SystemExit(f"dataset {prefix}: {prefix + ext} does not exist")
    return IndexedDataset(prefix, mmap=True).sequence_lengths


def check_splits(args: argparse.Namespace) -> None:
    """Fail (every rank, same message) when a split that will be read gets no documents.

    Mirrors megatron-core's split arithmetic: documents ``[round(lo x n), round(hi x n))`` of each
    prefix go to a split with bounds ``(lo, hi)``."""
    if args.mock_data:
        return
    sizes = split_sizes(args)
    if args.data_path:
        prefixes, _ = _blend(args.data_path)
        matrix = _split_matrix(args.split)
        for prefix in prefixes:
            n = len(_document_lengths(prefix))
            for name, bounds, need in zip(SPLITS, matrix, sizes):
                lo, hi = bounds or (0.0, 0.0)
                if need and hi > lo and int(round(hi * n)) - int(round(lo * n)) == 0:
                    raise SystemExit(
                        f"--split {args.split} gives the {name} split of {prefix} no documents "
                        f"(round({hi:.4f} x {n}) - round({lo:.4f} x {n}) = 0): use a corpus with more documents, "
                        f"a larger {name} proportion" + (", or --eval-iters 0" if name != "train" else ""))
        return
    for name, paths, need in zip(SPLITS, (args.train_data_path, args.valid_data_path, args.test_data_path), sizes):
        if need and paths:
            for prefix in _blend(paths)[0]:
                if not len(_document_lengths(prefix)):
                    raise SystemExit(f"--{name}-data-path {prefix} holds no documents")


# GPTDatasetConfig fields whose flag has another name (upstream's pretrain_gpt.py pairs them so);
# every other field is read from the flag of its own name, when there is one.
_FLAG_OF_FIELD = {
    "random_seed": "seed", "sequence_length": "seq_length", "path_to_cache": "data_cache_path",
    "create_attention_mask": "create_attention_mask_in_dataloader",
    "fast_cache_load": "dataloader_fast_cache_load", "defer_npy_index_mmap": "dataloader_defer_npy_index_mmap",
}
# Fields :func:`build_datasets` sets from more than one flag (the blend, the split, the tokenizer).
_SET_BY_BUILDER = frozenset({"blend", "blend_per_split", "split", "tokenizer"})

DATASET_FLAGS = ("mmap_bin_files", "reset_position_ids", "reset_attention_mask", "eod_mask_loss",
                 "create_attention_mask_in_dataloader")
"""Flags honoured through megatron-core's ``GPTDatasetConfig`` (beyond the data source and split):
``--no-mmap-bin-files``, ``--reset-position-ids``, ``--reset-attention-mask``, ``--eod-mask-loss``,
``--[no-]create-attention-mask-in-dataloader``. Other config fields take the value of their flag,
which :mod:`megatron.ciera.app.flag_policy` keeps at upstream's default."""


def dataset_config_kwargs(args: argparse.Namespace, *, tokenizer) -> dict:
    """Keyword arguments of megatron-core's ``GPTDatasetConfig`` from ``args``, read off the
    dataclass's own fields (a field of a newer release follows its flag without a change here);
    the blend and split are :func:`build_datasets`'s."""
    import dataclasses

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    kwargs = {"tokenizer": tokenizer}
    fields = [f for f in dataclasses.fields(GPTDatasetConfig) if f.init and f.name not in _SET_BY_BUILDER]
    for field in fields:
        flag = _FLAG_OF_FIELD.get(field.name, field.name)
        if hasattr(args, flag):
            kwargs[field.name] = getattr(args, flag)
    if any(f.name == "sequence_parallel_size" for f in fields):  # upstream: the TP size under sequence parallelism
        kwargs["sequence_parallel_size"] = args.tensor_model_parallel_size * bool(args.sequence_parallel)
    return kwargs


def build_datasets(args: argparse.Namespace, tokenizer) -> list:
    """``[train, valid, test]`` GPT datasets (``None`` for a split that is not read: no evaluation,
    a zero ``--split`` proportion or no ``--valid/test-data-path``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    check_splits(args)
    sizes = split_sizes(args)
    per_split = None
    if args.train_data_path:
        per_split = [_blend(p) if p else None for p in (args.train_data_path, args.valid_data_path, args.test_data_path)]
    config = GPTDatasetConfig(**dataset_config_kwargs(args, tokenizer=tokenizer), blend=_blend(args.data_path) if args.data_path else None,
                              blend_per_split=per_split, split=None if per_split else args.split)
    if per_split is None:
        # A split nobody reads is not built (its documents stay out of training, as in Megatron-LM).
        config.split_matrix = [m if need else None for m, need in zip(config.split_matrix, sizes)]
    cls = MockGPTDataset if args.mock_data else GPTDataset
    datasets = list(BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build())
    if datasets[0] is None:
        raise SystemExit(f"--split {args.split} gives no training data")
    return [d if need else None for d, need in zip(datasets, sizes)]


KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def collate(items: list[dict]) -> dict:
    """Stack the fields the forward step reads into ``[micro_batch, ...]`` tensors: tokens,
    labels, loss mask and position ids ``[micro_batch, seq]``; the attention mask ``[micro_batch,
    1, seq, seq]`` (True: masked) where the dataset made one (``--create-attention-mask-in-dataloader``)."""
    return {k: torch.stack([torch.as_tensor(it[k]) for it in items]) for k in KEYS if k in items[0]}


@dataclass(frozen=True)
class SampleOrder:
    """Which samples a data-parallel rank reads, in Megatron-LM's pretraining-sampler order."""

    micro_batch_size: int
    """Samples per micro batch."""
    dp_size: int
    """Data-parallel size: each chunk of ``micro x dp`` consecutive samples is one micro batch per rank."""
    dp_rank: int
    """This rank's position in each chunk."""

    def micro_batch(self, chunk: int, length: int | None = None) -> list[int]:
        """Sample indices of micro batch ``chunk`` of this rank (modulo ``length`` when given)."""
        start = chunk * self.micro_batch_size * self.dp_size + self.dp_rank * self.micro_batch_size
        idx = range(start, start + self.micro_batch_size)
        return [i % length for i in idx] if length else list(idx)


class _MicroBatches(torch.utils.data.Sampler):
    """Batch sampler: the micro batches ``first_chunk .. first_chunk + count - 1`` of one rank."""

    def __init__(self, order: SampleOrder, first_chunk: int, count: int, length: int | None):
        self.order, self.first, self.count, self.length = order, first_chunk, count, length

    def __iter__(self):
        return (self.order.micro_batch(c, self.length) for c in range(self.first, self.first + self.count))

    def __len__(self):
        return self.count


def _loader(dataset, order: SampleOrder, first_chunk: int, count: int, num_workers: int, wrap: bool):
    # A private generator: a DataLoader iterator draws its workers' base seed from it, and drawing
    # from the global one would shift the dropout random stream (resume and evaluation exactness).
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=_MicroBatches(order, first_chunk, count, len(dataset) if wrap else None),
        collate_fn=collate, num_workers=num_workers, pin_memory=torch.cuda.is_available(),
        prefetch_factor=2 if num_workers else None, persistent_workers=False, generator=generator)


def sample_order(args: argparse.Namespace, dp_rank: int) -> SampleOrder:
    return SampleOrder(args.micro_batch_size, args.data_parallel_size, dp_rank)


def train_iterator(dataset, args: argparse.Namespace, *, dp_rank: int, start_iteration: int):
    """Micro batches of this rank from ``start_iteration`` to ``--train-iters`` (one DataLoader):
    the chunks of ``micro x dp`` samples after the samples consumed so far, which a batch ramp
    (:mod:`megatron.ciera.app.batch_schedule`) makes a function of the iteration too."""
    from .batch_schedule import BatchSchedule

    schedule, per_chunk = BatchSchedule.from_args(args), args.micro_batch_size * args.data_parallel_size
    first = schedule.consumed_samples(start_iteration) // per_chunk
    count = schedule.consumed_samples(args.train_iters) // per_chunk - first
    return iter(_loader(dataset, sample_order(args, dp_rank), first, count, args.num_workers, False))


def eval_iterator(dataset, args: argparse.Namespace, *, dp_rank: int, eval_index: int):
    """Micro batches of evaluation number ``eval_index`` (``eval_iters`` global batches)."""
    count = args.eval_iters * args.num_microbatches
    return iter(_loader(dataset, sample_order(args, dp_rank), eval_index * count, count, args.num_workers, True))
