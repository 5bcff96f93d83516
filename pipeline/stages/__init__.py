"""One module per stage; each exposes ``run(cfg, directory, tracker) -> counts``, run by pipeline/runner.py
(what each stage is: pipeline/registry.py)."""
