"""megatron.ciera.data: Megatron indexed datasets (.bin/.idx) and the resumable batch order."""

import numpy as np
import torch

from megatron.ciera import arguments, data


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
