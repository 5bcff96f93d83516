"""Speculative decoding: the exact sampler (``sampler``) and the decoding loop with KV caches (``engine``)."""


class LosslessError(RuntimeError):
    """Speculative greedy output differs from the target's own greedy output (the stage fails in one line)."""


class AcceptanceMismatchError(RuntimeError):
    """An exported drafter's acceptance in transformers differs from our engine's with the same drafter (one line)."""
