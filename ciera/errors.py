"""The errors a gather raises on every rank of its group together."""


class CieraVerifyError(RuntimeError):
    """The gathered buffers of two ranks disagree: a cache was stale or a codec is broken."""


class StaleReplayError(CieraVerifyError):
    """A rank's shard changed between gathers that reused one plan without an agreement (a write to
    the parameters outside the optimizer step, without ``invalidate()``): those gathers delivered the
    earlier values, so training cannot go on bit-exact. Raised on every rank at the next agreement."""
