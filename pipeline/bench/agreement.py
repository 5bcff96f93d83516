"""How well each finetuned de-en drafter of the ``local`` recipe predicts the target, token by token.

The target decodes the held-out prompts greedily (the eval stage's prompts and stop condition); each
drafter then reads those sequences in one teacher-forced pass (pipeline/evaluation/teacher_forced.py). Per
answer token: whether the drafter's top token is the target's (the T=0 acceptance of a draft at that position)
and Σ min(p, q) over the vocabulary (its T=1 acceptance). No timing, so the figures do not depend on machine
load, and paired per-token differences against the recipe's own drafter separate small improvements from noise.
Also the acceptance greedy decoding at K = 1 would measure on these prompts, its rounds replayed on each answer's
agreement row (``replayed_greedy_rounds``): lower than the mean agreement where misses cluster, since rounds
start after rejections.
Drafters: every ``runs/<target>/<drafter>/de-en/finetune/drafter`` folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.bench import BenchSettings
from pipeline.evaluation.heldout import greedy_heldout_examples
from pipeline.evaluation.teacher_forced import SharedTeacherForced
from pipeline.models.drafter import load_drafter
from pipeline.models.eagle3 import Eagle3Head
from pipeline.models.provision import load_model
from pipeline.prompts import IGNORE
from pipeline.speculative.metrics import mean_and_standard_error, replayed_greedy_rounds

PAIR = "de-en"
METRICS = ("top1_agreement", "t1_acceptance")


@torch.inference_mode()
def main(out_dir: Path, settings: BenchSettings) -> dict:
    cfg, device, target_path, tokenizer = settings.target(f"lang={PAIR}", "eval.num_prompts=1000")  # every prompt
    target = load_model(target_path, device=device)
    examples = greedy_heldout_examples(cfg, target, tokenizer, cfg.eval.num_prompts, cfg.eval.max_new_tokens)
    pad_id = 0 if tokenizer.pad_token_id is None else tokenizer.pad_token_id

    # runs/<target>/<drafter>/<run>/<pair>/finetune/drafter: every drafter and variant finetuned on the pair
    folders = sorted(Path(cfg.paths.runs_dir).glob(f"{cfg.target.name}/*/*/{PAIR}/finetune/drafter"))
    scores, k1_acceptance, scorer = {}, {}, SharedTeacherForced(target, examples, pad_id)
    answer_lengths = [len(e["labels"]) - e["labels"].count(IGNORE) for e in examples]
    for folder in folders:
        model, vocab = load_drafter(str(folder), target_path, device=device)
        acceptance, agreement = scorer.per_token(model, vocab)
        name = f"{folder.parents[3].name}/{folder.parents[2].name}"
        scores[name] = (agreement, acceptance)  # METRICS' order
        first = 1 if isinstance(model, Eagle3Head) else 0  # a head's first round is the target's prefill
        rounds = [
            replayed_greedy_rounds(row.tolist(), 1, first, cfg.eval.max_new_tokens)
            for row in agreement.split(answer_lengths)
        ]
        k1_acceptance[name] = round(sum(a for _, a in rounds) / max(sum(r for r, _ in rounds), 1), 4)
    reference_name = f"{cfg.drafter.name}/{cfg.run}"
    reference = scores.get(reference_name)  # the recipe's drafter: the others are paired against it
    drafters = {}
    for name, per_token_scores in scores.items():
        drafters[name] = {metric: round(float(values.mean()), 4) for metric, values in zip(METRICS, per_token_scores)}
        drafters[name]["k1_decoding_acceptance"] = k1_acceptance[name]
        if name != reference_name and reference is not None:
            for metric, ours, theirs in zip(METRICS, per_token_scores, reference):
                drafters[name][f"{metric}_minus_{reference_name}"] = mean_and_standard_error(ours - theirs)
    result = {"pair": PAIR, "prompts": len(examples), "answer_tokens": sum(answer_lengths), "drafters": drafters}
    (out_dir / "agreement.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
