"""Flags, data splits, evaluation report, interval logging, TensorBoard / wandb sinks (in-process)."""

import argparse
import glob
import math
import os
import struct
import time

import numpy as np
import pytest
import torch

from megatron.ciera.app import arguments, data, evaluation, feature_args, logging_utils, timers

from test_mc_data import BatchOrder  # noqa: E402  (the test oracle of the batch order)


def _parse(extra, world=2):
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--lr", "1e-4", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    return arguments.validate_args(arguments.build_parser().parse_args(base + extra), world_size=world)


def test_upstream_defaults_and_every_flag_is_honoured_or_rejected():
    args = _parse(["--mock-data"])
    assert (args.ckpt_format, args.dist_ckpt_strictness, args.eval_iters, args.eval_interval) == (
        "torch_dist", "assume_ok_unexpected", 100, None)  # upstream: no periodic evaluation by default
    assert args.check_for_nan_in_loss_and_grad and args.num_workers == 2 and args.timing_log_level == 0
    assert not _parse(["--mock-data", "--no-check-for-nan-in-loss-and-grad"]).check_for_nan_in_loss_and_grad
    parser = argparse.ArgumentParser()
    feature_args.add_checkpoint_eval_data_logging_args(parser)
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests == set(feature_args.HONOURED_FLAGS)  # every flag of the feature modules is honoured
    assert _parse(["--mock-data", "--async-save", "--save", "x"]).async_save
    assert _parse(["--mock-data", "--ckpt-format", "torch"]).ckpt_format == "torch"  # legacy per-rank files
    assert _parse(["--mock-data", "--finetune"]).finetune  # without --load: from scratch, as upstream
    for flags, message in (
        (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp"),
        (["--ckpt-format", "torch", "--async-save", "--save", "x"], "--async-save needs --ckpt-format torch_dist"),
        (["--save-interval", "5"], "--save-interval needs --save"),
        (["--eval-interval", "0"], "--eval-interval 0 must be >= 1"),
        (["--wandb-project", "p"], "--wandb-project needs --wandb-exp-name"),
        (["--valid-data-path", "x"], "need --train-data-path"),
    ):
        with pytest.raises(ValueError, match=message):
            _parse((["--mock-data"] if "--valid-data-path" not in flags else []) + flags)


def _corpus(prefix, docs, rng=np.random.default_rng(0)):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(docs):
        builder.add_item(torch.from_numpy(rng.integers(0, 100, size=int(rng.integers(5, 40))).astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_split_that_gets_no_documents_fails_up_front(tmp_path):
    prefix = _corpus(str(tmp_path / "small"), docs=20)
    args = _parse(["--data-path", prefix, "--split", "969,30,1", "--eval-iters", "1"])
    # round(20 x 0.999) = round(20 x 1.0): megatron-core would loop forever building the test split
    with pytest.raises(SystemExit, match=r"gives the test split of .*small no documents"):
        data.check_splits(args)
    data.check_splits(_parse(["--data-path", prefix, "--split", "969,30,1", "--eval-iters", "0"]))
    with pytest.raises(SystemExit, match="does not exist"):
        data.check_splits(_parse(["--data-path", str(tmp_path / "missing"), "--eval-iters", "0"]))


@pytest.fixture
def one_rank_group(tmp_path_factory):
    import torch.distributed as dist

    if not dist.is_initialized():
        store = str(tmp_path_factory.mktemp("pg") / "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def test_blend_and_per_split_paths_build_real_splits(tmp_path, one_rank_group):
    a, b = _corpus(str(tmp_path / "a"), 200), _corpus(str(tmp_path / "b"), 200)
    args = _parse(["--data-path", "0.7", a, "0.3", b, "--split", "80,15,5", "--eval-iters", "1", "--eval-interval", "2",
                   "--data-cache-path", str(tmp_path / "cache")])
    train, valid, test = data.build_datasets(args, data.build_tokenizer(args))
    assert len(train) >= 24 and len(valid) >= 16 and len(test) >= 8
    assert os.listdir(tmp_path / "cache")
    args = _parse(["--train-data-path", a, "--valid-data-path", b, "--eval-iters", "1", "--num-workers", "1"])
    train, valid, test = data.build_datasets(args, data.build_tokenizer(args))
    assert test is None and valid is not None
    # the DataLoader (one worker, prefetching) yields the in-process order exactly
    loader = data.train_iterator(train, args, dp_rank=1, start_iteration=1)
    order = BatchOrder(train, 2, 2, 1, args.num_microbatches)
    for it in (1, 2):
        for m in range(args.num_microbatches):
            got, want = next(loader), order.micro_batch(it, m)
            assert all(torch.equal(got[k], want[k]) for k in data.KEYS)
    first = next(data.eval_iterator(valid, args, dp_rank=0, eval_index=1))
    assert torch.equal(first["tokens"][0], torch.as_tensor(valid[1 * 1 * 8 + 0]["tokens"]))


def test_loaders_leave_the_global_random_stream_alone():
    args = _parse(["--mock-data", "--eval-iters", "1", "--num-workers", "1"])
    train, valid, _ = data.build_datasets(args, data.build_tokenizer(args))
    state = torch.get_rng_state()
    next(data.train_iterator(train, args, dp_rank=0, start_iteration=0))
    next(data.eval_iterator(valid, args, dp_rank=0, eval_index=0))
    assert torch.equal(state, torch.get_rng_state())  # dropout masks after a resume / an evaluation


def test_interval_losses_stay_on_the_device_until_flushed():
    losses = logging_utils.IntervalLosses()
    losses.add(1, torch.tensor([6.0, 2.0]))
    losses.add(2, torch.tensor([float("nan"), 2.0]))
    assert len(losses) == 2
    steps = losses.flush()
    assert steps[0] == (1, 3.0) and math.isnan(steps[1][1]) and logging_utils.nonfinite(steps) == [2]
    assert losses.flush() == []


def test_loss_log_drops_the_lines_past_the_checkpoint(tmp_path):
    path = str(tmp_path / "losses.txt")
    log = logging_utils.LossLog(path, start_iteration=0)
    log.write([(i, float(i)) for i in range(1, 6)])
    log.close()
    log = logging_utils.LossLog(path, start_iteration=3)
    log.write([(4, 4.5)])
    log.close()
    assert [line.split()[0] for line in open(path)] == ["1", "2", "3", "4"]


def test_evaluation_block_and_index():
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, *a):
            self.scalars.append(a)

    w = Writer()
    text = evaluation.report({"lm loss": torch.tensor(2.0)}, prefix="iteration 10", name="validation",
                             iteration=10, writer=w, log_ppl=True)
    bar, line, bar2 = text.splitlines()
    assert line == f" validation loss at iteration 10 | lm loss value: {2.0:.6E} | lm loss PPL: {math.exp(2):.6E} | "
    assert bar == bar2 == "-" * (len(line) + 1)
    assert w.scalars == [("lm loss validation", 2.0, 10), ("lm loss validation ppl", math.exp(2), 10)]
    assert [evaluation.eval_index(i, 5) for i in (5, 10, 15)] == [0, 1, 2]


def test_flops_match_the_dense_formula():
    args = _parse(["--mock-data", "--swiglu"])
    args.padded_vocab_size = 128
    h, s, f, v = 32, 16, 128, 128
    per_token = 1 * (2 * h * 16 * (2 + 2 * 2) + 2 * 16 * 2 * h + 4 * s * 16 * 2 + 2 * 3 * h * f) + 2 * h * v
    assert logging_utils.flops_per_iteration(args) == 3 * per_token * s * 8


def test_ciera_codec_rows_in_the_timer_format():
    class S:
        encode_s, decode_s = 0.004, 0.002

    assert timers.ciera_codec_ms([("b0", S()), ("b1", S())], 2) == pytest.approx((4.0, 2.0))


def _wandb_history(run_dir):
    """The history rows of an offline wandb run, read from its .wandb file (LevelDB-style log of
    protobuf records: 7-byte file header, 32 KiB blocks, records with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = open(glob.glob(os.path.join(run_dir, "*.wandb"))[0], "rb").read()
    pos, block, pending, rows = 7, 32768, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pos += 7
        if kind == 0:
            pos += left - 7
            continue
        chunk, pos = raw[pos:pos + length], pos + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
    return rows


def test_tensorboard_and_offline_wandb_read_back(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = argparse.Namespace(tensorboard_dir=str(tmp_path / "tb"), tensorboard_queue_size=10, wandb_project="ciera",
                              wandb_exp_name="read-back", wandb_save_dir=str(tmp_path / "wb"), wandb_entity="",
                              save=None)
    logging_utils.check_writer_packages(args)
    writer = logging_utils.MetricWriter(args, start_iteration=0, rank=0)
    for it in (2, 4):
        writer.add_scalar("lm loss", 0.5 * it, it)
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(2, 1.0), (4, 2.0)]
    run_dir = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))[0]
    for _ in range(100):  # the wandb service may still be flushing the run file after finish()
        rows = _wandb_history(run_dir)
        if len(rows) == 2:
            break
        time.sleep(0.2)
    assert [(int(r["_step"]), float(r["lm loss"])) for r in rows] == [(2, 1.0), (4, 2.0)]
    assert not logging_utils.MetricWriter(args, start_iteration=0, rank=1).enabled
