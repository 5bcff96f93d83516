"""The eval's decoding methods on our engine (pipeline/evaluation/transformers_backend.py times them prompt by
prompt): each method's decoder over one target, its drafters and its stop condition, on one device.

A method's name is the method (``target``, ``speculative``, ``pld``, ``hybrid``, ``hf``, ``hf_assisted``,
``router``), a K of the sweep (``speculative_k2``), or ``<method>@<label>``: ``speculative`` and ``hybrid`` with a
drafter measured beside the eval's own (``eval.beside``: a drafter config, whose finetuned drafter of this pair
it means, or LABEL:FOLDER). A drafter beside decodes the same prompts with the same seeds against the
same target, interleaved with every other method prompt by prompt, so two drafter kinds (a head and a standalone
drafter), or a general and a finetuned drafter, are compared per decode, each at the K its own costs choose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from pipeline.config import EVAL_METHODS
from pipeline.evaluation.heldout import stop_condition
from pipeline.speculative.engine import (
    CachedModel,
    LookupThenModelDrafter,
    PromptLookupDrafter,
    generate,
    hf_generate,
    model_drafter,
)
from pipeline.speculative.metrics import timed
from pipeline.speculative.router import LanguageRouter
from pipeline.speculative.sampler import Sampling

METHODS = (*EVAL_METHODS, "router")
EXACT_AT_T0 = ("speculative", "pld", "hybrid", "router")  # our loop: greedy output must be the target's
MIXED = "mixed"  # the router's prompt set: held-out prompts of every eval.router_langs pair
BESIDE_METHODS = ("speculative", "hybrid")  # what a drafter measured beside the eval's own runs, as eval.methods has


def split_method(name: str) -> tuple[str, str | None]:
    """A method name's method and the label of the drafter beside it: hybrid@tiny-7m -> (hybrid, tiny-7m)."""
    method, _, label = name.partition("@")
    return method, label or None


@dataclass
class Drafters:
    """The eval's drafter models as loaded (float32), each with its vocab map (None: the target's vocabulary)."""

    own: tuple  # (model, vocab map): the eval's drafter
    router: dict  # source language -> (model, vocab map): eval.router_langs' finetuned drafters
    beside: dict  # label -> (model, vocab map): eval.beside's
    beside_folders: dict  # label -> the folder each of those was loaded from


class Decoders:
    """Every method's decoder over the same target, drafters and stop condition, on one device; the drafters
    in the target's dtype, the one they are served in."""

    def __init__(
        self,
        cfg: DictConfig,
        target_model,
        drafters: Drafters,
        tokenizer,
        device: torch.device,
    ):
        self.cfg, self.device = cfg, device
        self.target_model = target_model
        drafter_model, vocab_map = drafters.own
        self.drafter_model = drafter_model.to(target_model.dtype).eval()
        self.target = CachedModel(target_model)
        confidence = cfg.eval.draft_confidence

        def drafter_of(model, vocab):
            return model_drafter(model.to(target_model.dtype).eval(), vocab, confidence, self.target)

        self.drafter = drafter_of(drafter_model, vocab_map)
        self.pld = PromptLookupDrafter(target_model.config.vocab_size)
        self.beside = {label: drafter_of(model, vocab) for label, (model, vocab) in drafters.beside.items()}
        self.drafting = {None: self.drafter} | self.beside  # label (None: the eval's own drafter) -> its drafter
        self.stop = stop_condition(cfg.target, tokenizer, target_model)
        self.hf_assisted = vocab_map is None and getattr(self.drafter, "target_features", None) is None
        self.router = LanguageRouter(
            {src: drafter_of(model, vocab) for src, (model, vocab) in drafters.router.items()}, self.drafter
        )
        self.k_choice: dict = {}  # "T=<t>" -> method -> costs.choose_k's record (eval.choose_k)

    def k(self, t: float, method: str) -> int:
        """The method's K at temperature t: chosen from the measured costs, else eval.num_draft_tokens; the router,
        transformers' assisted generation and hybrid take their drafter's speculative method's (hybrid's lookup
        rounds prompt lookup's: ``decode``)."""
        base, _ = split_method(method)
        if base in ("router", "hf_assisted", "hybrid"):
            method = "speculative" + method.removeprefix(base)  # hybrid@tiny-7m -> speculative@tiny-7m
        return self.k_choice.get(f"T={t}", {}).get(method, {}).get("k", self.cfg.eval.num_draft_tokens)

    def variants(self, first_pass: bool, pair: str, t: float) -> list[tuple[str, str, int]]:
        """(name, method, K) to run; the K sweep only in the first (T=0, first seed) pass; the router
        only on the mixed set; the drafters beside after the eval's own."""
        ev = self.cfg.eval
        chosen = [m for m in METHODS if m == "target" or m in ev.methods or (m == "router" and pair == MIXED)]
        if not self.hf_assisted and "hf_assisted" in chosen:
            chosen.remove("hf_assisted")
        chosen += [f"{m}@{label}" for label in self.beside for m in BESIDE_METHODS if m in chosen]
        out = [(m, m, self.k(t, m)) for m in chosen]
        if first_pass and "speculative" in chosen:
            out += [(f"speculative_k{k}", "speculative", k) for k in ev.k_sweep if k != self.k(t, "speculative")]
        return out

    def decode(self, method: str, k: int, ids: torch.Tensor, sampling: Sampling, seed: int, routed=None):
        ev = self.cfg.eval
        if method in ("hf", "hf_assisted"):
            assistant = self.drafter_model if method == "hf_assisted" else None
            return timed(
                lambda: hf_generate(
                    self.target_model, ids, ev.max_new_tokens, self.stop, sampling, seed, assistant=assistant, k=k
                ),
                self.device,
            )
        base, label = split_method(method)
        speculative = self.drafting[label]
        hybrid = LookupThenModelDrafter(self.pld, speculative, self.k(sampling.temperature, "pld"))
        drafters = {"target": None, "speculative": speculative, "pld": self.pld, "hybrid": hybrid, "router": routed}
        drafter = drafters[base]
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return generate(
            self.target, ids, ev.max_new_tokens, self.stop, sampling, drafter=drafter, k=k, generator=generator
        )
