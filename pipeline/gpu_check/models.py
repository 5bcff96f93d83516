"""The models the GPU check runs, all built here with random weights (nothing from the hub).

``Shapes``: ``tiny`` (a CPU runs everything in a minute or two) or ``real`` (the paper's: a Llama-2-7B-shaped
target in bf16, the llama-68m drafter shape, a 32k vocabulary). ``last_token_pair`` is the pair with a
controlled acceptance: both models' attention and MLP outputs are zero, so the logits depend on the last
token only, through one shared rank-r table (the target's embeddings and head live in the drafter's r = hidden
dimensions); the drafter's head is the target's plus noise of scale sigma, calibrated to an acceptance rate.
The forwards still run every layer, so their cost is the real shape's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from pipeline.config import compose_config
from pipeline.models.drafter import head_for
from pipeline.models.vocab import VocabMap

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
WORDS = (
    "Translate German to English : English Das Wetter ist heute sehr schön . Bitte schicken Sie mir die "
    "Unterlagen bis Freitag Die Sitzung wurde auf Donnerstag verschoben Wo der nächste Bahnhof ?"
).split()


@dataclass(frozen=True)
class Shapes:
    name: str
    vocab: int
    target: dict  # LlamaConfig fields
    drafter: dict
    head: str  # the EAGLE-3 head's shape: a conf/drafter/ entry
    contexts: tuple[int, ...]  # prompt lengths the costs are measured at
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    max_new_tokens: int = 64  # per decode of the engine and ties measurements
    prompts: int = 3  # the engine's and the ties' prompts, one decode each per method
    repetitions: int = 10  # step_costs' medians
    sampler_rows: int = 200_000
    # batch_size, max_length; warmup_steps then timed_steps (a multiple of warmup_steps) for the throughput
    train: dict = field(default_factory=dict)
    compile: bool = True  # time a torch.compile'd training step too (CUDA only)


SHAPES = {
    "tiny": Shapes(
        "tiny",
        vocab=512,
        target=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
        ),
        drafter=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
        ),
        head="eagle3-ci",
        contexts=(16, 64),
        ks=(1, 2, 4),
        max_new_tokens=24,
        prompts=2,
        repetitions=3,
        sampler_rows=20_000,
        train=dict(batch_size=4, max_length=32, warmup_steps=2, timed_steps=4),
    ),
    "real": Shapes(
        "real",
        vocab=32000,  # Llama-2-7B and JackFram/llama-68m
        target=dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
        ),
        drafter=dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=12
        ),
        head="eagle3-llama",  # the head shipped for Llama-2-7B-shaped targets
        contexts=(128, 1024),
        max_new_tokens=64,
        prompts=3,
        repetitions=10,
        sampler_rows=1_000_000,
        train=dict(batch_size=32, max_length=512, warmup_steps=10, timed_steps=20),
    ),
}
# The correctness checks and the stages run small models on every device: what they check does not depend on the
# size (the costs, engine, ties and throughput measure the real shapes).
SMALL = SHAPES["tiny"]


def quick(shapes: Shapes) -> Shapes:
    """``--quick``: fewer prompts, shorter decodes, fewer repetitions, no compiled training step (docs/gpu-check.md
    gives both times)."""
    return replace(
        shapes,
        prompts=2,
        max_new_tokens=min(shapes.max_new_tokens, 32),
        repetitions=max(shapes.repetitions // 2, 3),
        compile=False,
    )


def llama_config(fields: dict, vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        **fields,
    )


def random_model(fields: dict, vocab: int, device: torch.device, dtype=torch.float32, seed: int = 0):
    """A random Llama of ``fields``' shape, built on ``device`` (a 7B model initialises in seconds on a GPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(fields, vocab), dtype=dtype)
    return model.eval()


def random_head(shapes: Shapes, target, device: torch.device, dtype=torch.float32, vocab_map: VocabMap | None = None):
    """A random EAGLE-3 head of ``shapes.head``'s configured shape reading ``target``, built on ``device``."""
    with torch.device(device):
        head = head_for(target, compose_config(["recipe=ci", f"drafter={shapes.head}"]).drafter, vocab_map)
    return head.to(dtype).eval()


@torch.no_grad()
def last_token_pair(
    shapes: Shapes, device: torch.device, target_dtype=torch.bfloat16, logit_std: float = 3.0, seed: int = 0
):
    """(target, drafter, table): a target whose next-token logits are a function of the last token only, and a
    full-vocabulary drafter at the drafter shape computing the same function (its noise is set by ``set_noise``)."""
    target = random_model(shapes.target, shapes.vocab, device, target_dtype, seed)
    drafter = random_model(shapes.drafter, shapes.vocab, device, torch.float32, seed + 1)
    rank = shapes.drafter["hidden_size"]
    generator = torch.Generator(device="cpu").manual_seed(seed)
    embed = torch.randn(shapes.vocab, rank, generator=generator)
    head = torch.randn(shapes.vocab, rank, generator=generator) * logit_std / math.sqrt(rank)
    noise = torch.randn(shapes.vocab, rank, generator=generator) * logit_std / math.sqrt(rank)
    for model in (target, drafter):
        for layer in model.model.layers:  # every sublayer adds zero to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :rank] = embed.to(model.dtype).to(device)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :rank] = head.to(model.dtype).to(device)
    # RMSNorm divides by the rms over all hidden dimensions: the target's has more (zero) ones.
    target.model.norm.weight.fill_(math.sqrt(rank / shapes.target["hidden_size"]))
    drafter.model.norm.weight.fill_(1.0)
    return target, drafter, {"head": head, "noise": noise, "rank": rank}


@torch.no_grad()
def set_noise(drafter, table: dict, sigma: float) -> None:
    weight = drafter.lm_head.weight
    weight[:, : table["rank"]] = (table["head"] + sigma * table["noise"]).to(weight.dtype).to(weight.device)


@torch.no_grad()
def acceptance(target, drafter, tokens: torch.Tensor) -> dict:
    """The pair's expected acceptance over ``tokens`` (1, n) as the last token: T=1, sum min(p, q); T=0, argmax
    agreement."""
    p = target(input_ids=tokens).logits[0].float()
    q = drafter(input_ids=tokens).logits[0].float()
    return {
        "T1": float(torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1).mean()),
        "T0": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
    }


def calibrate(target, drafter, table: dict, alpha: float, vocab: int, device: torch.device) -> dict:
    """Bisect the drafter's noise until its T=1 acceptance is ``alpha``; returns sigma and both acceptances."""
    tokens = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:512].to(device)[None]
    low, high = 0.0, 4.0
    for _ in range(14):
        sigma = (low + high) / 2
        set_noise(drafter, table, sigma)
        if acceptance(target, drafter, tokens)["T1"] > alpha:
            low = sigma
        else:
            high = sigma
    set_noise(drafter, table, (low + high) / 2)
    return {"sigma": (low + high) / 2, **acceptance(target, drafter, tokens)}


def synthetic_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of exactly ``vocab`` ids: <unk> <s> </s>, the prompts' words, then filler words.
    It adds BOS like Llama's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = SPECIALS + list(dict.fromkeys(WORDS))
    words += [f"w{i}" for i in range(vocab - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def prompt_ids(shapes: Shapes, length: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """(1, length) random ids (BOS first), on ``device``."""
    ids = torch.randint(3, shapes.vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    ids[0, 0] = 1
    return ids.to(device)


def source_file(path: Path, count: int) -> Path:
    """Held-out prompts for a stage run (data.sources=file): sentences of the tokenizer's words."""
    sentences = [
        "Das Wetter ist heute sehr schön .",
        "Bitte schicken Sie mir die Unterlagen bis Freitag .",
        "Die Sitzung wurde auf Donnerstag verschoben .",
        "Wo ist der nächste Bahnhof ?",
    ]
    with path.open("w") as handle:
        for i in range(count):
            src = (
                sentences[i % len(sentences)] + " " + " ".join(f"w{i * 7 + j}" for j in range(i // len(sentences) + 1))
            )
            handle.write(json.dumps({"src": src, "ref": "English"}) + "\n")
    return path
