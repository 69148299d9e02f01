"""Fixtures for tests, benchmarks, tools and examples; the library itself never imports this package.

* :mod:`ciera.testing.ranks`: run a function on N local gloo ranks (:func:`run_on_ranks`).
* :mod:`ciera.testing.trajectory`: synthetic AdamW trajectories and adversarial steps.
* :mod:`ciera.testing.model_trajectory`: a tiny MoE's bucket laid out and sharded as Megatron's
  distributed optimizer does, trained step by step.
"""

from .ranks import free_port, run_on_ranks

__all__ = ["free_port", "run_on_ranks"]
