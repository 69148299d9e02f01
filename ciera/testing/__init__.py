"""Fixtures for tests, benchmarks, tools and examples; the library itself never imports this package.

* :mod:`ciera.testing.ranks`: run a function on N local gloo ranks (:func:`run_on_ranks`).
* :mod:`ciera.testing.trajectory`: synthetic AdamW trajectories and adversarial steps.
* :mod:`ciera.testing.model_trajectory`: a tiny MoE's bucket laid out and sharded as Megatron's
  distributed optimizer does, trained step by step.
* :mod:`ciera.testing.lm_steps`: the training steps of the ZeRO-3 bit-exactness checks and the
  sha256 of a model's full parameters.
"""

from .ranks import free_port, run_on_ranks

__all__ = ["free_port", "run_on_ranks"]
