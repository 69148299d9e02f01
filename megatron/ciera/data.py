"""Training data for ``pretrain_gpt.py``: Megatron-Core GPT datasets and a resumable batch order.

The sample order is a pure function of the iteration number (Megatron-LM's pretraining sampler
order: each global batch is ``num_microbatches`` consecutive chunks of ``micro x dp`` samples,
data-parallel rank ``r`` takes the ``r``-th micro batch of each chunk), so resuming from a
checkpoint needs nothing but the iteration.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import torch


class _HFTokenizer:
    """The few members Megatron-Core's GPT datasets use, over a Hugging Face tokenizer."""

    def __init__(self, name: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise SystemExit("--tokenizer-type HuggingFaceTokenizer needs the 'transformers' package "
                             "(pip install transformers); with --mock-data use NullTokenizer") from None
        self._tok = AutoTokenizer.from_pretrained(name)
        self._name = name

    @property
    def vocab_size(self):
        return len(self._tok)

    @property
    def eod(self):
        return self._tok.eos_token_id

    @property
    def unique_identifiers(self):
        return OrderedDict({"class": "HuggingFaceTokenizer", "model": self._name})


def build_tokenizer(args: argparse.Namespace):
    if args.tokenizer_type == "NullTokenizer":
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        return NullTokenizer(args.vocab_size)
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return _HFTokenizer(args.tokenizer_model)
    raise SystemExit(f"--tokenizer-type {args.tokenizer_type} is not supported by this entry point; "
                     "use NullTokenizer or HuggingFaceTokenizer")


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron-LM pads the embedding table to a multiple of ``--make-vocab-size-divisible-by``."""
    return -(-vocab_size // divisible_by) * divisible_by


def _blend(data_path: list[str]):
    """``--data-path`` as ``[w1 p1 w2 p2 ...]`` or ``[p1 p2 ...]`` -> (prefixes, weights or None)."""
    if len(data_path) == 1:
        return [data_path[0]], None
    try:
        weights = [float(x) for x in data_path[0::2]]
        return list(data_path[1::2]), weights
    except ValueError:
        return list(data_path), None


def build_train_dataset(args: argparse.Namespace, tokenizer):
    """The training split, sized for ``train_iters x global batch`` samples."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else _blend(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    # No evaluation loop: the valid/test splits are not built (their documents stay out of
    # training, as in Megatron-LM). Building them could also hang megatron-core when a small
    # corpus leaves a split with zero documents.
    config.split_matrix = [config.split_matrix[0], None, None]
    cls = MockGPTDataset if args.mock_data else GPTDataset
    n = args.train_iters * args.global_batch_size
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [n, 0, 0], lambda: True, config).build()
    if train is None:
        raise SystemExit(f"--split {args.split} gives no training data")
    return train


class BatchOrder:
    """Micro batches of one rank, as a function of (iteration, micro batch index)."""

    def __init__(self, dataset, micro_batch_size: int, dp_size: int, dp_rank: int, num_microbatches: int):
        self.dataset = dataset
        self.mbs, self.dp, self.rank, self.nmb = micro_batch_size, dp_size, dp_rank, num_microbatches

    def micro_batch(self, iteration: int, index: int) -> dict:
        gbs = self.mbs * self.dp * self.nmb
        start = iteration * gbs + index * self.mbs * self.dp + self.rank * self.mbs
        items = [self.dataset[start + j] for j in range(self.mbs)]
        return {k: torch.stack([torch.as_tensor(it[k]) for it in items]) for k in ("tokens", "labels", "loss_mask", "position_ids")}

    def iterator(self, iteration: int):
        """The micro batches of ``iteration`` in order (what the schedule's data iterator yields)."""
        return iter([self.micro_batch(iteration, i) for i in range(self.nmb)])
