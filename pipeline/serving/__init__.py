"""Serving the target for the pipeline: vLLM's OpenAI-compatible server (``server``) and the client (``client``)."""
