"""CIERA for torchtitan: its own trainer and entry point, switched on from the job config.

Any config function of torchtitan's own models, with a ``ciera`` section added::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module ciera.integrations.torchtitan --config llama3_debugmodel --ciera.enable

``--module ciera.integrations.torchtitan --config NAME`` resolves ``NAME`` among the config functions
of torchtitan's models (``llama3_debugmodel``, ``deepseek_v3_debugmodel``, ...) and returns the same
config as :class:`CieraTrainer` 's (torchtitan's ``Trainer`` plus the ``ciera`` section; every other
flag is torchtitan's). A project with its own config registry returns ``with_ciera(its_config())``
from its config function instead.

With ``--ciera.enable`` the trainer, once torchtitan has built and sharded the model (FSDP2's
``fully_shard``) and its optimizers, installs :func:`ciera.fsdp2.enable` on every model part with
the optimizers' post-step hook, so each FSDP unit encodes once per step. Training is bit-identical
to FSDP2's own gather; the gathers' counters are logged at torchtitan's ``--metrics.log_freq``.

torchtitan is imported only when a trainer or a config is asked for: this module imports without it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from dataclasses import dataclass, field

from .. import fsdp2
from ..codecs.registry import codec_choices
from ..config import CACHES, SELECTIONS, CieraConfig
from ..stats import GatherStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CieraJobConfig:
    """The ``ciera`` section of a torchtitan job config (``--ciera.<field>`` on the command line)."""

    enable: bool = False
    """Gather the FSDP2 units' parameters with CIERA (``--ciera.enable``); off: torchtitan unchanged."""

    cache: str = "exponents"
    """What each rank keeps of the other ranks' shards between gathers (:attr:`ciera.CieraConfig.cache`):
    ``exponents`` (one byte per value), ``values`` (the unsharded parameters' memory; a step's later
    gathers send nothing) or ``none`` (every gather plain)."""

    codec: str = "auto"
    """:attr:`ciera.CieraConfig.codec`: ``auto`` (the cost model picks per unit) or a codec's name."""

    selection: str = "auto"
    """:attr:`ciera.CieraConfig.selection`: ``auto`` (compress where it pays on this link),
    ``always`` or ``never`` (raw, through CIERA's code path)."""

    def __post_init__(self):
        for name, allowed in (("cache", CACHES), ("codec", codec_choices()), ("selection", SELECTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--ciera.{name} {getattr(self, name)!r}: expected one of {', '.join(allowed)}")

    def ciera_config(self) -> CieraConfig:
        """The gather's :class:`ciera.CieraConfig` (library defaults for everything not set here)."""
        return dataclasses.replace(CieraConfig(), cache=self.cache, codec=self.codec, selection=self.selection)


def enable(*, model_parts, optimizers, job: CieraJobConfig) -> list[fsdp2.Fsdp2Gathers]:
    """Install CIERA on every FSDP2-sharded model part (one per pipeline stage), stepped by
    ``optimizers`` (a ``torch.optim.Optimizer``, torchtitan's ``OptimizersContainer`` included).
    Call after the parts are sharded and the optimizers built, before the first forward."""
    gathers = []
    for i, part in enumerate(model_parts):
        try:
            gathers.append(fsdp2.enable(part, config=job.ciera_config(), optimizer=optimizers))
        except ValueError as e:
            raise ValueError(f"--ciera.enable: model part {i} is not sharded by FSDP2 (set "
                             "--parallelism.data_parallel_shard_degree to 2 or more, or -1): " + str(e)) from e
    return gathers


def total_stats(gathers: list[fsdp2.Fsdp2Gathers]) -> GatherStats:
    """Every model part's counters summed (``codec``: the last compressing part's)."""
    total = GatherStats(codec="raw")
    for g in gathers:
        s = g.stats()
        for f in dataclasses.fields(total):
            if f.name != "codec":
                setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
        if s.compressed_gathers:
            total.codec = s.codec
    return total


def format_stats(step: int, s: GatherStats) -> str:
    """One log line: the gathers so far and what they delivered to this rank."""
    return (f"ciera: step {step}: {s.gathers} gathers ({s.compressed_gathers} compressed, {s.raw_gathers} raw, "
            f"{s.replays} replays; codec {s.codec}), {s.wire_bytes} bytes received for {s.raw_bytes} raw "
            f"({s.ratio:.2f}x)")


@functools.cache
def trainer_class():
    """:class:`CieraTrainer`: torchtitan's ``Trainer`` with the ``ciera`` config section (built on
    first use, so that this module imports without torchtitan)."""
    from torchtitan.tools.logging import logger as titan_logger
    from torchtitan.trainer import Trainer

    class CieraTrainer(Trainer):
        """torchtitan's trainer; with ``--ciera.enable`` its FSDP2 gathers are CIERA's."""

        @dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            ciera: CieraJobConfig = field(default_factory=CieraJobConfig)
            """CIERA's compressed parameter all-gather (``--ciera.enable``, ``--ciera.cache``, ...)."""

        def __init__(self, config):
            super().__init__(config)
            # Installed after the model is sharded and the optimizers are built, before any forward.
            # The checkpoint load in train() precedes every gather (the first gather is raw), so no
            # invalidate is needed for it.
            self.ciera_gathers = (enable(model_parts=self.model_parts, optimizers=self.optimizers, job=config.ciera)
                                  if config.ciera.enable else [])
            if self.ciera_gathers:
                titan_logger.info(f"ciera: compressed all-gather on {sum(len(g.gathers) for g in self.ciera_gathers)} "
                                  f"FSDP2 units ({config.ciera})")

        def train_step(self, data_iterator):
            super().train_step(data_iterator)
            if self.ciera_gathers:
                self.ciera_raise_pending_errors()
                if self.metrics_processor.should_log(self.step):
                    titan_logger.info(format_stats(self.step, total_stats(self.ciera_gathers)))

        def ciera_raise_pending_errors(self) -> None:
            """Surface a failed gather (bad payload, failed verification) at this step."""
            for g in self.ciera_gathers:
                g.raise_pending_errors(wait=False)

        def close(self) -> None:
            for g in getattr(self, "ciera_gathers", []):
                g.remove()
            super().close()

    CieraTrainer.__module__ = __name__
    CieraTrainer.__qualname__ = "CieraTrainer"
    return CieraTrainer


def with_ciera(config, *, ciera: CieraJobConfig | None = None):
    """``config`` (a torchtitan ``Trainer.Config``) as a :class:`CieraTrainer` config, every field
    kept, with the ``ciera`` section (default: off until ``--ciera.enable``)."""
    from torchtitan.trainer import Trainer

    if type(config) is not Trainer.Config:
        raise TypeError(f"ciera.integrations.torchtitan: {type(config).__qualname__} is not torchtitan's "
                        "Trainer.Config (a model with a trainer of its own needs its own binding)")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return trainer_class().Config(**values, ciera=CieraJobConfig() if ciera is None else ciera)


def _titan_config_function(name: str):
    """torchtitan's config function ``name`` from the model whose name prefixes it, or None."""
    from torchtitan.models import _supported_models

    for model in sorted(_supported_models, key=len, reverse=True):  # deepseek_v3 before a shorter prefix
        if name.startswith(model + "_"):
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
            fn = getattr(registry, name, None)
            return fn if callable(fn) else None
    return None


def __getattr__(name: str):
    """``CieraTrainer``, or any torchtitan model's config function with the ``ciera`` section
    (what torchtitan's ``--module ciera.integrations.torchtitan --config NAME`` looks up)."""
    if name == "CieraTrainer":
        return trainer_class()
    fn = None if name.startswith("_") else _titan_config_function(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (nor has any torchtitan model "
                             "a config function of that name)")

    @functools.wraps(fn)
    def config_with_ciera():
        return with_ciera(fn())

    return config_with_ciera
