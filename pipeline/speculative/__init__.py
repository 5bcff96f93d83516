"""Speculative decoding: the exact sampler (``sampler``), the decoding loop with KV caches (``engine``), the
step costs (``costs``), the metrics of a decode (``metrics``) and the language router (``router``)."""
