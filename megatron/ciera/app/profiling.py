"""``--profile``: upstream's profiler flags, with upstream's step window and trace location.

    profiler = StepProfiler.from_args(args, rank=dist.get_rank())   # None: not profiling this rank
    profiler.before_step(iteration)   # iteration: the steps done so far
    ... one training step ...
    profiler.after_step(iteration)    # iteration: now one more
    profiler.close()                  # the loop ended (early exit included)

* ``--use-pytorch-profiler``: a ``torch.profiler`` session over the steps ``--profile-step-start``
  to ``--profile-step-end`` (upstream's schedule: wait ``start - 1`` steps, warm up one, record
  ``end - start``; its ``ProfilerStep#N`` are iterations ``start .. end - 1``), written as a chrome
  trace where the installed release's upstream writes it: megatron-core 0.16's
  ``tensorboard_trace_handler(--tensorboard-dir)`` (``<host>_<pid>.<time>.pt.trace.json``), 0.19's
  ``<--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz``. Open it in Perfetto or
  chrome://tracing; TensorBoard's profiler plugin reads the first.
* ``--profile`` alone: an Nsight Systems capture range (CUDA's profiler API and NVTX ranges), so
  GPU only; on CPU the validation asks for ``--use-pytorch-profiler``.
* ``--profile-ranks``: the global ranks that profile (0.16: default rank 0; 0.19: empty = all).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch

__all__ = ["StepProfiler", "check_args", "trace_dir"]


def _upstream_019(args) -> bool:
    """The flag table of megatron-core >= 0.19 (its profiler flags and trace location)."""
    return hasattr(args, "pytorch_profiler_collect_shapes")


def check_args(args: argparse.Namespace, err: Callable[[str], None]) -> None:
    """Report what the profiler flags cannot do (each message names the flag)."""
    if not args.profile:
        return
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0 or end <= start:
        err(f"--profile-step-start {start} / --profile-step-end {end}: need 0 <= start < end")
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        err("--use-pytorch-profiler needs --tensorboard-dir (the trace is written there, as upstream)")
    if not args.use_pytorch_profiler and args.device != "cuda":
        err("--profile without --use-pytorch-profiler opens an Nsight Systems capture range (CUDA's profiler "
            "API): on CPU add --use-pytorch-profiler for a torch.profiler trace")


def trace_dir(args: argparse.Namespace) -> Path:
    """Where the chrome traces go (upstream's location for the installed release)."""
    tb = Path(args.tensorboard_dir)
    return tb.parent / "torch_profile" if _upstream_019(args) else tb


class StepProfiler:
    """Profiles the training steps of one rank (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, *, rank: int):
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.rank, self._nvtx = rank, None
        self._torch = None
        if args.use_pytorch_profiler:
            out = trace_dir(args)
            out.mkdir(parents=True, exist_ok=True)
            if _upstream_019(args):
                def on_trace_ready(prof):
                    prof.export_chrome_trace(str(out / f"rank-{rank}.json.gz"))
                shapes, stack = args.pytorch_profiler_collect_shapes, args.pytorch_profiler_collect_callstack
            else:
                on_trace_ready, shapes, stack = torch.profiler.tensorboard_trace_handler(str(out)), True, True
            self._torch = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(self.start - 1, 0), warmup=1 if self.start > 0 else 0,
                                                 active=self.end - self.start, repeat=1),
                on_trace_ready=on_trace_ready, record_shapes=shapes, with_stack=stack)
            self._torch.start()

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, rank: int) -> "StepProfiler | None":
        """The profiler of ``rank``, or ``None`` without ``--profile`` or outside ``--profile-ranks``."""
        if not args.profile or (args.profile_ranks and rank not in args.profile_ranks):
            return None
        return cls(args, rank=rank)

    def before_step(self, iteration: int) -> None:
        """Before the step that makes ``iteration`` steps ``iteration + 1``."""
        if self._torch is not None:
            self._torch.step()
        elif iteration == self.start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """After the step that made ``iteration`` steps: the window closes at ``--profile-step-end``."""
        if iteration == self.end:
            self.close()

    def close(self) -> None:
        """End profiling (idempotent); a recorded window is written by then."""
        if self._torch is not None:
            self._torch.stop()
            self._torch = None
        elif self._nvtx is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
