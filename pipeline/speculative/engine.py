"""The decoding loop: speculative decoding with KV caches, and target-only decoding through the same path.

Every round the drafter proposes up to K tokens, the target scores the tokens it has not seen plus the
drafts in ONE forward pass (K+1 logits), ``sampler.verify`` accepts a prefix and emits one more token,
and both caches are cropped back to the accepted prefix. Target-only decoding is the same loop with no
drafter (K=0), so speedups compare like with like. Batch size 1; the sampler itself is batched.

All ids are target-vocabulary ids; a reduced-vocabulary drafter translates at its boundary (VocabMap)
and keeps its distributions over its own N ids: at T>0 nothing target-wide is made per draft position
(the sampler reads the draft at the drafted ids and builds one target-wide residual per round).
Every tensor the loop makes lives on the prompt's device (the models' and caches' device), and every
timer reads ``pipeline.device.clock``, which waits for that device's queued work first.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from pipeline import device as devices
from pipeline.config import ConfigError
from pipeline.models.eagle3 import Eagle3Head, KVCache, TargetFeatures
from pipeline.models.vocab import PARD_K, PARD_TOKEN, VocabMap
from pipeline.speculative.sampler import Sampling, probabilities, sample, verify, verify_greedy


class CachedModel:
    """A causal LM and its KV cache over a growing token sequence; ``length`` tokens are cached. Reset with
    ``features`` (a drafter that reads the target's hidden states asks for them), it also keeps those layers'
    states of every cached position in ``states`` (1, length, 3 x hidden), cut back with the cache."""

    def __init__(self, model, vocab_map: VocabMap | None = None):
        self.model = model
        self.vocab_map = vocab_map
        self.mask_id = getattr(model.config, PARD_TOKEN, None)  # a parallel drafter's (a drafter id)
        self.reset()

    def reset(self, features: TargetFeatures | None = None) -> None:
        with torch.device(self.model.device):  # Gemma 3's sliding-window layers make a tensor here
            self.cache = DynamicCache(config=self.model.config)
        # Sliding-window layers (Gemma 3) otherwise drop the states a rollback needs.
        self.cache.activate_past_recording()
        self.length = 0
        self.features = features
        self.states = None

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, keep: int, masks: int = 0) -> torch.Tensor:
        """Feed (1, n) target ids, then ``masks`` mask tokens; return the logits of the last ``keep`` positions
        over the ids the model can propose: (1, keep, V), or (1, keep, N) over a vocabulary map's ids (its
        input-only unk and mask ids, N and N + 1, left out)."""
        ids = self.vocab_map.encode(tokens) if self.vocab_map is not None else tokens
        if masks:
            ids = torch.cat([ids, ids.new_full((1, masks), self.mask_id)], dim=1)
        with self.features.capture() if self.features is not None else contextlib.nullcontext() as captured:
            logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep).logits
        if self.features is not None:
            new = self.features.stacked(captured)
            self.states = new if self.states is None else torch.cat([self.states, new], dim=1)
        if self.vocab_map is not None:
            logits = logits[..., : self.vocab_map.unk_id]
        self.length += ids.shape[1]
        return logits.float()

    def target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns of ``forward``'s logits -> target ids."""
        return self.vocab_map.decode(columns) if self.vocab_map is not None else columns

    def feed(
        self, sequence: torch.Tensor, extra: torch.Tensor | None = None, keep: int = 1, masks: int = 0
    ) -> torch.Tensor:
        """Feed the part of ``sequence`` not cached yet (plus ``extra`` tokens, then ``masks`` mask tokens);
        logits of the last ``keep``."""
        pending = sequence[:, self.length :]
        if extra is not None:
            pending = torch.cat([pending, extra], dim=1)
        return self.forward(pending, keep, masks)

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (transformers 5: a negative crop drops that many)."""
        drop = max(self.length - length, 0)
        self.cache.crop(-drop)  # crop(0) also trims sliding-window layers back to their window
        self.length -= drop
        if self.states is not None:
            self.states = self.states[:, : self.length]


class Draft(NamedTuple):
    """A round's proposal: what every drafter's ``propose`` returns."""

    tokens: torch.Tensor  # (1, n) target ids, n <= K
    probs: torch.Tensor | None = (
        None  # (1, n, V) the drafter's distributions, None when greedy; (1, n, N) with vocab_map
    )
    vocab_map: VocabMap | None = None  # probs' columns are this map's N target ids

    def first(self, n: int) -> Draft:
        """The proposal's first n tokens: a draft's prefix is a draft, verified as exactly."""
        if self.tokens.shape[1] <= n:
            return self
        return Draft(self.tokens[:, :n], None if self.probs is None else self.probs[:, :n], self.vocab_map)


class ModelDrafter:
    """Proposes up to K tokens autoregressively from a (possibly reduced-vocabulary) drafter model.

    With ``min_confidence`` > 0 a round's draft ends before the first position where the drafter's most
    likely token has less probability than that (dynamic draft length): a weak drafter's unsure guesses
    cost a drafter step and a verify position each and are mostly rejected. The cut depends on the
    drafter's own distribution only, so the output distribution stays the target's.
    """

    def __init__(self, model, vocab_map: VocabMap | None = None, min_confidence: float = 0.0):
        self.lm = CachedModel(model, vocab_map)
        self.min_confidence = min_confidence

    def reset(self) -> None:
        self.lm.reset()

    def propose(self, sequence, k, sampling, generator) -> Draft:
        """Up to k drafts, sampled from the drafter's distribution over its own vocabulary."""
        return self.draft_from(self.lm.feed(sequence)[:, -1], sequence, k, sampling, generator)

    def draft_from(self, logits, sequence, k, sampling, generator) -> Draft:
        """Up to k drafts: the first from (1, N) ``logits``, each next one from the drafter's step on the last."""
        tokens, probs = [], []
        for i in range(k):
            if not self.pick(logits, sampling, generator, tokens, probs):
                break
            if i < k - 1:
                logits = self.lm.forward(tokens[-1][:, None], keep=1)[:, -1]
        return self.draft(sequence, tokens, probs)

    def pick(self, logits, sampling, generator, tokens: list, probs: list) -> bool:
        """Draft one token from (1, N) ``logits`` into ``tokens`` (its distribution into ``probs`` at T > 0);
        False, drafting nothing, where the drafter is less sure than ``min_confidence``."""
        distribution = probabilities(logits, sampling) if not sampling.greedy else None
        if self.min_confidence > 0:
            confidence = (distribution if distribution is not None else torch.softmax(logits, -1)).max()
            if confidence < self.min_confidence:
                return False
        if distribution is None:
            column = logits.argmax(-1)
        else:
            probs.append(distribution)
            column = sample(distribution, generator)
        tokens.append(self.lm.target_ids(column))
        return True

    def draft(self, sequence, tokens: list, probs: list) -> Draft:
        if not tokens:
            return Draft(sequence.new_zeros((1, 0)))
        return Draft(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None, self.lm.vocab_map)

    def rollback(self, length: int) -> None:
        self.lm.rollback(length)


class ParallelDrafter(ModelDrafter):
    """Proposes up to K tokens in ONE drafter forward (PARD, AMD 2025): the tokens it has not cached,
    then K − 1 copies of its mask token (``config.pard_token``); the logits at the last real token and at each
    mask are the K positions' distributions. Each is conditioned on the context alone, not on the drafts
    before it: a proposal like any other, so the sampler stays exact. The masks leave the cache at once, and
    the next round starts from the context. It learned ``config.pard_k`` positions; more are refused."""

    def propose(self, sequence, k, sampling, generator) -> Draft:
        check_parallel_k(self.lm.model.config, [k])
        logits = self.lm.feed(sequence, keep=k, masks=k - 1)
        self.lm.rollback(sequence.shape[1])
        tokens, probs = [], []
        for i in range(k):
            if not self.pick(logits[:, i], sampling, generator, tokens, probs):
                break
        return self.draft(sequence, tokens, probs)


class HeadLM:
    """An EAGLE-3 head (pipeline/models/eagle3.py) with its KV cache, reading target token ids through the target's
    own embedding. It has CachedModel's interface (reset, forward, rollback, length, target_ids), so step costs time
    it as any drafter: there ``forward`` is a draft step, each token's hidden input the head's own last output."""

    mask_id = None

    def __init__(self, head: Eagle3Head, embedding: torch.nn.Module, vocab_map: VocabMap | None):
        self.model, self.embedding, self.vocab_map = head, embedding, vocab_map
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache()
        self.last = None  # the residual stream out at the last position read: the next draft step's hidden input

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.inference_mode()
    def read(self, hidden: torch.Tensor, tokens: torch.Tensor, keep: int) -> torch.Tensor:
        """Read pairs (hidden state at t, target id of token t + 1); logits (1, keep, N) of the last ``keep``."""
        start = self.length
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        out = self.model.step(hidden, self.embedding(tokens), positions, self.cache)
        self.last = out[:, -1:]
        return self.model.logits(out[:, -keep:]).float()

    def forward(self, tokens: torch.Tensor, keep: int, masks: int = 0) -> torch.Tensor:
        if self.last is None:
            self.last = torch.zeros(1, 1, self.model.config.hidden_size, dtype=self.model.dtype, device=tokens.device)
        return self.read(self.last.expand(-1, tokens.shape[1], -1), tokens, keep)

    def rollback(self, length: int) -> None:
        self.cache.crop(length)

    def target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        return self.vocab_map.decode(columns) if self.vocab_map is not None else columns


class Eagle3Drafter(ModelDrafter):
    """Proposes up to K tokens with an EAGLE-3 head from the target's own hidden states.

    The target keeps its states at the head's layers for every position it caches (``target_features``, which
    ``generate`` hands the target). A round first reads the pairs the head has not seen — the target's states at
    t with token t + 1, up to the last token the target cached — then drafts autoregressively, each draft's
    hidden input the head's previous output. The first round, before the target has read the prompt, drafts
    nothing: the target's prefill is a plain step. A rollback keeps only the pairs read from the target."""

    def __init__(self, head: Eagle3Head, target: CachedModel, vocab_map: VocabMap | None, min_confidence: float = 0.0):
        self.lm = HeadLM(head, target.model.get_input_embeddings(), vocab_map)
        self.target = target
        self.target_features = TargetFeatures(target.model, head.config.aux_layer_ids)
        self.min_confidence = min_confidence
        self.context = 0

    def reset(self) -> None:
        self.lm.reset()
        self.context = 0

    def propose(self, sequence, k, sampling, generator) -> Draft:
        start, end = self.lm.length, self.target.length
        if end == 0:
            return Draft(sequence.new_zeros((1, 0)))
        hidden = self.lm.model.fuse(self.target.states[:, start:end])
        logits = self.lm.read(hidden, sequence[:, start + 1 : end + 1], keep=1)[:, -1]
        self.context = end
        return self.draft_from(logits, sequence, k, sampling, generator)

    def rollback(self, length: int) -> None:
        self.lm.rollback(min(length, self.context))


def check_parallel_k(config, ks) -> None:
    """Refuse, in one line, more draft positions than a parallel drafter was trained for."""
    if (trained := getattr(config, PARD_K, None)) is not None and max(ks, default=0) > trained:
        raise ConfigError(
            f"K={max(ks)} draft tokens, but this parallel drafter learned {trained} positions: set "
            f"eval.num_draft_tokens and eval.k_sweep to at most {trained}, or finetune it with "
            f"train.finetune.parallel_draft.k={max(ks)}"
        )


def model_drafter(
    model, vocab_map: VocabMap | None = None, min_confidence: float = 0.0, target: CachedModel | None = None
) -> ModelDrafter:
    """The drafter a model makes: parallel when it was trained to (its config names a mask token), an EAGLE-3 head
    reading ``target``'s hidden states, else autoregressive."""
    if isinstance(model, Eagle3Head):
        if target is None:
            raise ConfigError("an eagle3 head drafts from the target's hidden states: this path has no target for it")
        return Eagle3Drafter(model, target, vocab_map, min_confidence)
    kind = ParallelDrafter if getattr(model.config, PARD_TOKEN, None) is not None else ModelDrafter
    return kind(model, vocab_map, min_confidence)


class PromptLookupDrafter:
    """Prompt-lookup decoding (Saxena 2023): copy the continuation of the latest earlier occurrence of the
    context's last n-gram (n = max_ngram..1). No model; its proposal is deterministic (one-hot)."""

    def __init__(self, vocab_size: int, max_ngram: int = 3):
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram

    def reset(self) -> None:
        pass

    def propose(self, sequence, k, sampling, generator):
        ids = sequence[0].tolist()
        draft: list[int] = []
        for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    draft = ids[start + n : start + n + k]
                    break
            if draft:
                break
        tokens = torch.tensor([draft], dtype=torch.long, device=sequence.device)
        if sampling.greedy:
            return Draft(tokens)
        return Draft(tokens, torch.nn.functional.one_hot(tokens, self.vocab_size).float())

    def rollback(self, length: int) -> None:
        pass


class LookupThenModelDrafter:
    """Prompt lookup where the context offers an n-gram match, the drafter model elsewhere: translations
    copy names, numbers and code from the prompt, which lookup drafts for free and a small drafter often
    misses, while the drafter covers the rounds with no match. Each round's proposal comes from one of the
    two, chosen from the context alone, so verification stays exact.

    Each part drafts at its own K: the round's K is the model's, ``lookup_k`` (None: the round's too) the
    lookup's, whose copies often run on where a model's guesses stop paying (the local recipe's K = 4 against 1:
    docs/results/2026-11-29-hybrid-k-per-part-de-en.md)."""

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter, lookup_k: int | None = None):
        self.lookup, self.model, self.lookup_k = lookup, model, lookup_k
        self.target_features = getattr(model, "target_features", None)

    def reset(self) -> None:
        self.model.reset()

    def propose(self, sequence, k, sampling, generator):
        draft = self.lookup.propose(sequence, self.lookup_k or k, sampling, generator)
        if draft.tokens.shape[1] > 0:
            return draft
        return self.model.propose(sequence, k, sampling, generator)

    def rollback(self, length: int) -> None:
        self.model.rollback(length)


class StopCondition:
    """Generation ends at an EOS id, at a stop string (e.g. "\\n" for completion prompts) or at max_new_tokens."""

    def __init__(self, tokenizer, stop_strings=(), eos_token_ids=()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.eos_token_ids = set(eos_token_ids)

    def first_stop(self, generated: list[int], start: int) -> int | None:
        """The number of tokens to keep when a stop occurs among ``generated[start:]``, else None."""
        for i in range(start, len(generated)):
            if generated[i] in self.eos_token_ids:
                return i + 1
        if self.stop_strings and self._has_stop(generated):
            for end in range(max(start, 1), len(generated) + 1):
                if self._has_stop(generated[:end]):
                    return end
        return None

    def _has_stop(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.stop_strings)

    def hf_criteria(self, prompt_length: int) -> StoppingCriteriaList:
        """This condition as a transformers criterion. Not transformers' own EOS and stop-string criteria: they
        look only at the sequence's last token, and an assisted round appends several, so a stop inside a round
        would let generation run on (its extra target forwards counted, its tokens cut afterwards)."""
        return StoppingCriteriaList([GeneratedStop(self, prompt_length)])

    def text(self, generated: list[int]) -> str:
        """The response text, the stop string excluded."""
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        cut = min((text.find(s) for s in self.stop_strings if s in text), default=len(text))
        return text[:cut]


class GeneratedStop(StoppingCriteria):
    """Stops a transformers ``generate`` as soon as its generated tokens hold a stop anywhere (StopCondition)."""

    def __init__(self, stop: StopCondition, prompt_length: int):
        self.stop, self.prompt_length = stop, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = [self.stop.first_stop(row[self.prompt_length :].tolist(), 0) is not None for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@dataclass
class Generation:
    tokens: list[int]  # generated ids (EOS / stop-completing token included)
    finish_reason: str  # stop | length
    target_calls: int = 0
    drafted: list[int] = field(default_factory=list)  # tokens drafted per round
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per round
    seconds: float = 0.0


def generate(
    target: CachedModel,
    prompt_ids: torch.Tensor,  # (1, L)
    max_new_tokens: int,
    stop: StopCondition,
    sampling: Sampling = Sampling(),
    drafter: ModelDrafter | PromptLookupDrafter | LookupThenModelDrafter | None = None,
    k: int = 0,
    generator: torch.Generator | None = None,
) -> Generation:
    """Speculative decoding with ``drafter`` and K, or target-only decoding without one. ``prompt_ids`` and
    ``generator`` live on the models' device."""
    device = prompt_ids.device
    started = devices.clock(device)
    target.reset(getattr(drafter, "target_features", None))
    if drafter is not None:
        drafter.reset()
    sequence = prompt_ids
    prompt_len = prompt_ids.shape[1]
    result = Generation(tokens=[], finish_reason="length")
    while len(result.tokens) < max_new_tokens:
        # Never draft past max_new_tokens: the round's bonus token is the last one allowed (a hybrid's lookup
        # part drafts at its own K, cut here too).
        room = max_new_tokens - len(result.tokens) - 1
        k_round = min(k, room) if drafter is not None else 0
        draft = (
            drafter.propose(sequence, k_round, sampling, generator).first(room)
            if k_round > 0
            else Draft(sequence.new_zeros((1, 0)))
        )
        drafts = draft.tokens
        target_logits = target.feed(sequence, drafts, keep=drafts.shape[1] + 1)
        if sampling.greedy:
            num_accepted, next_token = verify_greedy(drafts, target_logits)
        else:
            draft_probs = (
                draft.probs if draft.probs is not None else target_logits.new_zeros((1, 0, target_logits.shape[-1]))
            )
            num_accepted, next_token = verify(
                drafts, draft_probs, probabilities(target_logits, sampling), generator, draft.vocab_map
            )
        n = int(num_accepted[0])
        new = torch.cat([drafts[:, :n], next_token[:, None]], dim=1)
        target.rollback(sequence.shape[1] + n)
        if drafter is not None:
            drafter.rollback(sequence.shape[1] + n)
        sequence = torch.cat([sequence, new], dim=1)
        result.target_calls += 1
        if drafter is not None:
            result.drafted.append(drafts.shape[1])
            result.accepted.append(n)
        start = len(result.tokens)
        result.tokens = sequence[0, prompt_len:].tolist()
        end = stop.first_stop(result.tokens, start)
        if end is not None:
            result.tokens, result.finish_reason = result.tokens[:end], "stop"
            break
    result.seconds = devices.clock(device) - started
    return result


def timed_forward(lm: CachedModel, tokens: torch.Tensor, masks: int = 0) -> float:
    """Seconds of one forward over ``tokens`` (then ``masks`` mask tokens) after the cached prefix, which is then
    restored."""
    length = lm.length
    started = devices.clock(tokens.device)
    lm.forward(tokens, keep=tokens.shape[1] + masks, masks=masks)
    seconds = devices.clock(tokens.device) - started
    lm.rollback(length)
    return seconds


def step_costs(
    target: CachedModel, drafter: CachedModel, prompt_ids: torch.Tensor, ks: list[int], repetitions: int = 10
):
    """The formula's costs on this machine, in target steps: c = drafter step / target step, v(K) = target
    verify(K+1) / target step, and draft(K) = a round's drafting: K·c for an autoregressive drafter, one forward
    of its K positions (the context's last token and K − 1 masks) for a parallel one. Medians over repetitions
    that interleave the measured forwards, so load changes hit them alike. Call it after a warm-up: the first
    forwards on a GPU pay for kernel selection and allocation."""
    for lm in (target, drafter):
        lm.reset()
        lm.forward(prompt_ids, keep=1)
    tokens = prompt_ids[:, -1:].repeat(1, max(ks) + 1)
    parallel = drafter.mask_id is not None
    times = {"target": [], "drafter": [], **{k: [] for k in ks}, **{("draft", k): [] for k in ks if parallel}}
    for _ in range(repetitions):
        times["target"].append(timed_forward(target, tokens[:, :1]))
        times["drafter"].append(timed_forward(drafter, tokens[:, :1]))
        for k in ks:
            times[k].append(timed_forward(target, tokens[:, : k + 1]))
            if parallel:
                times["draft", k].append(timed_forward(drafter, tokens[:, :1], masks=k - 1))
    median = {key: statistics.median(values) for key, values in times.items()}
    c = median["drafter"] / median["target"]
    return {
        "target_step_s": median["target"],
        "drafter_step_s": median["drafter"],
        "c": c,
        "v": {k: median[k] / median["target"] for k in ks},
        "draft": {k: median["draft", k] / median["target"] if parallel else k * c for k in ks},
    }


@torch.inference_mode()
def top2_gap(model, prompt_ids: torch.Tensor, prefix: list[int]) -> float:
    """The target's top-2 logit gap for the token after ``prompt_ids`` + ``prefix`` (one full forward, no
    cache): how close to a tie its greedy choice there is."""
    extra = torch.tensor([prefix], dtype=torch.long, device=prompt_ids.device)
    logits = (
        model(input_ids=torch.cat([prompt_ids, extra], dim=1), use_cache=False, logits_to_keep=1).logits[0, -1].float()
    )
    best = logits.topk(2).values
    return float(best[0] - best[1])


def expected_tokens(alpha: float, k: int) -> float:
    """Leviathan et al.'s expected tokens per target call (1 − α^(K+1)) / (1 − α); K+1 at α=1."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float, draft: float | None = None) -> float:
    """Leviathan et al.'s expected speedup: expected tokens per target call / (K·c + v), or / (draft + v) with a
    round's drafting cost ``draft`` measured (a parallel drafter's one forward)."""
    return expected_tokens(alpha, k) / ((k * c if draft is None else draft) + v)


@contextlib.contextmanager
def assisted_by_k(assistant, k: int):
    """Make HF assisted generation draft exactly K tokens per round. transformers 5 reads these settings from
    the assistant's own generation_config, not from ``generate``'s arguments; its defaults (20 tokens, a 0.4
    confidence cut) stop weak drafters after about one token, which is another K than ours."""
    if assistant is None:
        yield
        return
    own = assistant.generation_config
    assistant.generation_config = copy.deepcopy(own)
    assistant.generation_config.update(
        num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0
    )
    try:
        yield
    finally:
        assistant.generation_config = own


def hf_generate(
    model, prompt_ids, max_new_tokens, stop: StopCondition, sampling: Sampling, seed: int, assistant=None, k: int = 0
) -> list[int]:
    """transformers' own ``generate`` (plain, or assisted by ``assistant`` with exactly K drafts per round)."""
    # Stop strings as a criterion, not `stop_strings=`: that one reaches the assistant, which has no tokenizer.
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": not sampling.greedy,
        "eos_token_id": sorted(stop.eos_token_ids),
        "pad_token_id": sorted(stop.eos_token_ids)[0],
        "stopping_criteria": stop.hf_criteria(prompt_ids.shape[1]),
    }
    if not sampling.greedy:
        kwargs |= {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    torch.manual_seed(seed)
    with assisted_by_k(assistant, k), torch.inference_mode():
        out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), **kwargs)
    tokens = out[0, prompt_ids.shape[1] :].tolist()
    # Assisted rounds can run past a stop string; count only what a user gets, as for our loop.
    end = stop.first_stop(tokens, 0)
    return tokens[:end] if end is not None else tokens
