"""Speculative decoding: the exact sampler (``sampler``) and the decoding loop with KV caches (``engine``)."""


class LosslessError(RuntimeError):
    """Speculative greedy output differs from the target's own greedy output (the stage fails in one line)."""
