"""The global batch size of every iteration, from megatron-core's num-microbatches calculator.

``--rampup-batch-size START INCREMENT SAMPLES`` (megatron-core 0.16) grows the global batch from
``START`` by ``INCREMENT`` over ``SAMPLES`` samples up to ``--global-batch-size``;
``--step-batch-size-schedule "0:B0 T1:B1 ..."`` (megatron-core 0.19, which ignores the ramp-up)
switches the batch at sample (or token) thresholds, with ``--train-iters`` or ``--train-samples``.
The ramp-up needs ``--train-samples`` (upstream: no ramp for iteration-based training). With
``--train-samples`` the number of iterations is upstream's arithmetic.

The batch of an iteration depends only on the samples consumed before it, and those only on the
iteration, so :meth:`BatchSchedule.consumed_samples` is a pure function of the iteration: a run
resumed mid-ramp reads the same samples with the same batch sizes as an uninterrupted one.

    schedule = BatchSchedule.from_args(args)
    gbs, micro_batches = schedule.at_iteration(i)     # the batch of iteration i + 1
    schedule.consumed_samples(i)                      # samples read by iterations 1 .. i
"""

from __future__ import annotations

import argparse
import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["BatchSchedule", "check_args"]


@dataclass(frozen=True)
class BatchSchedule:
    """Megatron-core's calculator over the run's batch flags (constant, ramp-up or step schedule)."""

    global_batch_size: int
    """``--global-batch-size``: the batch after the ramp-up (constant runs: every batch)."""
    micro_batch_size: int
    """``--micro-batch-size``."""
    data_parallel_size: int
    """Data-parallel ranks: every global batch is a multiple of ``micro x dp``."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """``--rampup-batch-size`` (start, increment, ramp-up samples), or ``None``."""
    step_batch_size_schedule: str | None = None
    """``--step-batch-size-schedule`` (megatron-core >= 0.19), or ``None``."""
    seq_length: int | None = None
    """``--seq-length``: the step schedule's token thresholds become samples with it."""
    _consumed: list = field(default_factory=lambda: [0], init=False, repr=False, compare=False)
    # consumed samples before iteration i, filled on demand (a memo of a pure function)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BatchSchedule":
        ramp = args.rampup_batch_size
        return cls(global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                   data_parallel_size=args.data_parallel_size,
                   rampup_batch_size=tuple(int(v) for v in ramp) if ramp else None,
                   step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None),
                   seq_length=args.seq_length)

    @property
    def varies(self) -> bool:
        """Whether the batch changes during the run."""
        return self.rampup_batch_size is not None or self.step_batch_size_schedule is not None

    @functools.cached_property
    def _calculator(self):
        """megatron-core's calculator object (not its process-wide one): the keywords its builder
        takes in the installed release."""
        from megatron.core.num_microbatches_calculator import _build_num_microbatches_calculator as build

        offered = {"rank": 1,  # not 0: the calculator's info lines stay quiet (each rank builds its own)
                   "rampup_batch_size": list(self.rampup_batch_size) if self.rampup_batch_size else None,
                   "global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                   "data_parallel_size": self.data_parallel_size, "decrease_batch_size_if_needed": False,
                   "step_batch_size_schedule": self.step_batch_size_schedule, "seq_length": self.seq_length}
        accepted = inspect.signature(build).parameters
        return build(**{k: v for k, v in offered.items() if k in accepted})

    def at_samples(self, consumed_samples: int) -> tuple[int, int]:
        """(global batch, micro batches per rank) after ``consumed_samples`` samples. Raises
        ``AssertionError`` (megatron-core's check) when the batch is not a multiple of micro x dp."""
        calc = self._calculator
        calc.update(consumed_samples, True)
        return calc.get_current_global_batch_size(), calc.get()

    def consumed_samples(self, iteration: int) -> int:
        """Samples read by iterations ``1 .. iteration``."""
        consumed = self._consumed
        while len(consumed) <= iteration:
            consumed.append(consumed[-1] + self.at_samples(consumed[-1])[0])
        return consumed[iteration]

    def at_iteration(self, iteration: int) -> tuple[int, int]:
        """(global batch, micro batches per rank) of the step that follows ``iteration`` steps."""
        return self.at_samples(self.consumed_samples(iteration))

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run: upstream's ``update_train_iters`` arithmetic
        (ramp-up: the ramp's steps while at most ``SAMPLES`` samples are consumed, then constant
        batches, the last partial one dropped; step schedule: until ``train_samples`` is reached)."""
        if self.rampup_batch_size is not None:
            iterations = 0
            while self.consumed_samples(iterations) <= min(self.rampup_batch_size[2], train_samples):
                iterations += 1
            consumed = self.consumed_samples(iterations)
            return iterations + max(train_samples - consumed, 0) // self.global_batch_size
        if self.step_batch_size_schedule is not None:
            iterations = 0
            while self.consumed_samples(iterations) < train_samples:
                iterations += 1
            return iterations
        return train_samples // self.global_batch_size


def check_args(args: argparse.Namespace, err: Callable[[str], None]) -> None:
    """Validate the ramp / step schedule and set ``args.train_iters`` from ``--train-samples``
    (as upstream). Every message names the flags."""
    ramp = args.rampup_batch_size
    step = getattr(args, "step_batch_size_schedule", None)
    if ramp is None and step is None:
        return
    if ramp is not None and hasattr(args, "step_batch_size_schedule"):
        err("--rampup-batch-size: megatron-core 0.19 ignores it (its calculator takes --step-batch-size-schedule); "
            "give the ramp as --step-batch-size-schedule")
        return
    name = "--rampup-batch-size" if ramp is not None else "--step-batch-size-schedule"
    if ramp is not None and args.train_samples is None:
        err(f"{name} needs --train-samples (as upstream: no batch-size ramp for iteration-based training)")
        return
    if step is not None and "global_batch_size" in getattr(args, "explicit", ()):
        err("--step-batch-size-schedule and --global-batch-size are exclusive (as upstream)")
        return
    if ramp is not None and (min(ramp[:2]) < 1 or ramp[2] < 0):
        err(f"--rampup-batch-size {' '.join(map(str, ramp))}: start and increment must be >= 1, samples >= 0")
        return
    schedule = BatchSchedule.from_args(args)
    try:
        if args.train_samples is not None:
            args.train_iters = schedule.train_iters(args.train_samples)
        sizes = sorted({schedule.at_iteration(i)[0] for i in range(args.train_iters)})
    except (AssertionError, ValueError) as exc:
        err(f"{name}: megatron-core's batch calculator rejects it: {exc}")
        return
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.virtual_pipeline_model_parallel_size:
        pp = args.pipeline_model_parallel_size
        odd = [gbs for gbs in sizes if (gbs // per_step) % pp]
        if odd:
            err(f"{name}: global batches {odd} give micro-batch counts that are not multiples of "
                f"--pipeline-model-parallel-size {pp} (the interleaved schedule needs them)")
