"""How well each finetuned de-en drafter of the ``local`` recipe predicts the target, token by token.

The target decodes the held-out prompts greedily (the eval stage's prompts and stop condition); each
drafter then reads those sequences in one teacher-forced pass. Per answer token: whether the drafter's
top token is the target's (the T=0 acceptance of a draft at that position) and Σ min(p, q) over the
vocabulary (its T=1 acceptance). No timing, so the figures do not depend on machine load, and paired
per-token differences against the recipe's own drafter separate small improvements from noise.
Drafters: every ``runs/<target>/<drafter>/de-en/finetune/drafter`` folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.bench import BenchSettings
from pipeline.device import resolve_device
from pipeline.evaluation import heldout_prompts, stop_condition
from pipeline.models.drafter import load_drafter
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.prompts import prompt_ids
from pipeline.speculative.engine import CachedModel, generate
from pipeline.speculative.metrics import mean_and_standard_error

PAIR = "de-en"
METRICS = ("top1_agreement", "t1_acceptance")  # what per_token returns, in its order


@torch.inference_mode()
def per_token(model, vocab, sequences: list[tuple[torch.Tensor, int]], target_probs: list[torch.Tensor]):
    """(top-1 match, Σ min(p, q)) of every answer token, concatenated over the sequences."""
    matches, overlaps = [], []
    for (sequence, prompt_len), p in zip(sequences, target_probs):
        logits = model(input_ids=vocab.encode(sequence) if vocab is not None else sequence).logits[0].float()
        logits = (vocab.expand_logits(logits) if vocab is not None else logits)[prompt_len - 1 : -1]
        matches.append((logits.argmax(-1) == sequence[0, prompt_len:]).float())
        overlaps.append(torch.minimum(torch.softmax(logits, -1), p).sum(-1))
    return torch.cat(matches), torch.cat(overlaps)


def main(out_dir: Path, settings: BenchSettings) -> dict:
    cfg = settings.config(f"lang={PAIR}", "eval.num_prompts=1000")  # every held-out prompt
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    device = resolve_device(cfg.eval.device)
    tokenizer, target = load_tokenizer(target_path), load_model(target_path, device=device)
    stop = stop_condition(cfg.target, tokenizer, target)
    sequences, target_probs = [], []
    with torch.inference_mode():
        for _, prompt in heldout_prompts(cfg, PAIR, tokenizer):
            ids = torch.tensor([prompt_ids(prompt, tokenizer)], device=device)
            answer = generate(CachedModel(target), ids, cfg.eval.max_new_tokens, stop).tokens
            sequence = torch.cat([ids, torch.tensor([answer], device=device)], dim=1)
            sequences.append((sequence, ids.shape[1]))
            target_probs.append(torch.softmax(target(input_ids=sequence).logits[0, ids.shape[1] - 1 : -1].float(), -1))

    # runs/<target>/<drafter>/<run>/<pair>/finetune/drafter: every drafter and variant finetuned on the pair
    folders = sorted(Path(cfg.paths.runs_dir).glob(f"{cfg.target.name}/*/*/{PAIR}/finetune/drafter"))
    scores = {f"{folder.parents[3].name}/{folder.parents[2].name}": per_token(
        *load_drafter(str(folder), target_path, device=device), sequences, target_probs) for folder in folders}
    reference_name = f"{cfg.drafter.name}/{cfg.run}"
    reference = scores.get(reference_name)  # the recipe's drafter: the others are paired against it
    drafters = {}
    for name, per_token_scores in scores.items():
        drafters[name] = {metric: round(float(values.mean()), 4) for metric, values in zip(METRICS, per_token_scores)}
        if name != reference_name and reference is not None:
            for metric, ours, theirs in zip(METRICS, per_token_scores, reference):
                drafters[name][f"{metric}_minus_{reference_name}"] = mean_and_standard_error(ours - theirs)
    answer_tokens = sum(sequence.shape[1] - prompt_len for sequence, prompt_len in sequences)
    result = {"pair": PAIR, "prompts": len(sequences), "answer_tokens": answer_tokens, "drafters": drafters}
    (out_dir / "agreement.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
