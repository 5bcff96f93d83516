"""Speculative decoding: the exact sampler (``sampler``) and the decoding loop with KV caches (``engine``)."""
