"""Evaluation: what a drafter buys the target, measured on held-out translation prompts.

- ``heldout``: the held-out prompts, the target's stop condition and greedy answers as examples
- ``gate``: the greedy gate (a T=0 speculative output must be the target's own) and its errors
- ``teacher_forced``: the drafter scored against the target's distribution in one pass (no decoding, no
  timing): used by the scaling study, the on-policy phase's held-out estimate and the benches
- ``results``: the machine a figure was measured on, summaries over seeds, metrics.json
- ``choices``: what the eval measures and chooses before decoding (the target's dtype, c and v(K), K per
  method from a pilot over several prompts) and each choice held against the decode's measurement
- ``transformers_backend``: the eval stage on our engine (every method, one process per GPU)
- ``vllm_backend``: the eval stage through vLLM's own speculative decoding (``eval.engine=vllm``)

The eval stage (pipeline/stages/eval.py) chooses the backend; this package sits below the stages and the
training code, so nothing here imports them.
"""
