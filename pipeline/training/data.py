"""Training examples for the drafter: packed pretraining blocks and masked finetuning examples.

Every example is ``{"input_ids": [...], "labels": [...]}`` in TARGET token ids, labels aligned with
inputs (the loss predicts ``labels[t + 1]`` from ``input_ids[: t + 1]``) and ``IGNORE`` where no loss
is taken. ``Collator`` pads a batch and maps both to a reduced drafter vocabulary.

Pretraining packs documents into ``max_length`` blocks, each document ``[BOS] text EOS`` (BOS only
when the target's tokenizer adds one). Attention does cross document boundaries, as in GPT/nanoGPT
pretraining, but the label of each document's first token is masked: the drafter is never trained
to guess an unrelated document's start; it is trained to predict the EOS that ends a document.
Blocks are never padded (the stream's tail is dropped), so no padding is ever a label.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from pipeline import prompts
from pipeline.data.sharegpt import iter_conversations
from pipeline.models.vocab import VocabMap

IGNORE = -100  # torch cross_entropy's ignore_index
TOKENIZE_BATCH = 512


# ---------------------------------------------------------------- pretraining


def sharegpt_documents(limit: int | None) -> Iterator[dict]:
    for record in iter_conversations(limit):
        text = "\n\n".join(turn["value"] for turn in record.get("conversations", []) if (turn.get("value") or "").strip())
        if text:
            yield {"text": text}


def pretrain_documents(cfg: DictConfig) -> Iterator[str]:
    """Documents of ``data.pretrain_corpora``, mixed by weight (ShareGPT offline; C4 streamed from the hub)."""
    import datasets

    streams = []
    for corpus in cfg.data.pretrain_corpora:
        if corpus.name == "sharegpt":
            stream = datasets.IterableDataset.from_generator(
                sharegpt_documents, gen_kwargs={"limit": cfg.data.pretrain_max_documents}
            )
        else:  # a hub text corpus, e.g. allenai/c4 "en"
            stream = datasets.load_dataset(
                corpus.hub_dataset or corpus.name, corpus.hub_subset, split="train", streaming=True
            ).select_columns(["text"])
        streams.append(stream)
    weights = [corpus.weight for corpus in cfg.data.pretrain_corpora]
    mixed = streams[0] if len(streams) == 1 else datasets.interleave_datasets(
        streams, probabilities=[w / sum(weights) for w in weights], seed=cfg.seed, stopping_strategy="first_exhausted"
    )
    if cfg.data.pretrain_max_documents is not None:
        mixed = mixed.take(cfg.data.pretrain_max_documents)
    for row in mixed:
        yield row["text"]


def pretrain_tokens(cfg: DictConfig, tokenizer, max_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The tokenized pretraining stream and its document start offsets, cached under ``paths.cache_dir``.

    Tokenizing all of ShareGPT with a 262k-token vocabulary takes minutes: the stream is computed once
    per (tokenizer, corpora, limits) and shared by every run and rank. Stops after ``max_tokens``.
    """
    key = {
        # the vocabulary itself: a dry run's stand-in or a test's tokenizer may carry a real target's name
        "tokenizer": hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest(),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id],
        "corpora": OmegaConf.to_container(cfg.data.pretrain_corpora, enum_to_str=True),
        "max_documents": cfg.data.pretrain_max_documents,
        "max_tokens": max_tokens,
        "seed": cfg.seed if len(cfg.data.pretrain_corpora) > 1 else None,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cfg.paths.cache_dir) / "pretrain-tokens" / digest
    if (folder / "tokens.npy").exists():
        return np.load(folder / "tokens.npy"), np.load(folder / "starts.npy")

    eos = tokenizer.eos_token_id
    pieces, starts, total = [], [], 0
    documents = pretrain_documents(cfg)
    with tqdm(desc="tokenizing pretraining data", unit=" tok", unit_scale=True, mininterval=5) as bar:
        while max_tokens is None or total < max_tokens:
            batch = [text for _, text in zip(range(TOKENIZE_BATCH), documents)]
            if not batch:
                break
            for ids in tokenizer(batch)["input_ids"]:  # adds BOS exactly when the target's tokenizer does
                starts.append(total)
                pieces.append(np.asarray(ids + [eos], dtype=np.uint32))
                total += len(ids) + 1
            bar.update(sum(len(p) for p in pieces[-len(batch):]))
    tokens = np.concatenate(pieces)[:max_tokens] if pieces else np.zeros(0, dtype=np.uint32)
    starts = np.asarray(starts, dtype=np.int64)
    starts = starts[starts < len(tokens)]
    partial = folder.with_name(f".{digest}.{os.getpid()}.partial")
    partial.mkdir(parents=True, exist_ok=True)
    np.save(partial / "tokens.npy", tokens)
    np.save(partial / "starts.npy", starts)
    if not folder.exists():  # another rank or run may have finished the same cache first
        os.replace(partial, folder)
    return tokens, starts


def pack(tokens: np.ndarray, starts: np.ndarray, max_length: int) -> list[dict]:
    """Cut the stream into ``max_length`` blocks; a document's first token is never a label."""
    inputs = tokens.astype(np.int64)
    labels = inputs.copy()
    labels[starts] = IGNORE
    count = len(tokens) // max_length
    inputs = inputs[: count * max_length].reshape(count, max_length)
    labels = labels[: count * max_length].reshape(count, max_length)
    return [{"input_ids": inputs[i], "labels": labels[i]} for i in range(count)]  # views, no copies


# ---------------------------------------------------------------- finetuning


def read_records(records_dir: Path) -> list[dict]:
    """The distill stage's records (contract 1), in file and line order."""
    records = []
    for path in sorted(Path(records_dir).glob("*.jsonl")):
        with path.open() as handle:
            records.extend(json.loads(line) for line in handle if line.strip())
    return records


def seeded_prompt_ids(records: list[dict], seed: int) -> list[str]:
    """The records' prompt ids in an order drawn by ``seed`` (the same for the same records and seed)."""
    ids = sorted({r["id"] for r in records})
    return [ids[i] for i in torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()]


def prompt_fraction(records: list[dict], fraction: float, seed: int) -> list[dict]:
    """Every record of the first ``fraction`` of the prompts in the seed's order (at least one prompt): a
    smaller fraction's prompts are inside a larger one's, so data-scaling runs are nested."""
    if fraction >= 1:
        return records
    order = seeded_prompt_ids(records, seed)
    kept = set(order[: max(1, round(fraction * len(order)))])
    return [r for r in records if r["id"] in kept]


class TokenStrings:
    """Target token ids <-> the strings the OpenAI API reports in ``top_logprobs`` (each id decoded alone)."""

    def __init__(self, tokenizer):
        self.texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        alike: dict[str, list[int]] = {}
        for i, text in enumerate(self.texts):
            alike.setdefault(text, []).append(i)
        # Some ids decode alike: Gemma's byte-fallback <0x2E> and its real "." token. The model writes the id
        # its tokenizer makes of the text, never the byte piece, so that id stands for the string.
        self.ids: dict[str, int] = {}
        for text, ids in alike.items():
            encoded = tokenizer.encode(text, add_special_tokens=False) if len(ids) > 1 else ids
            self.ids[text] = encoded[0] if len(encoded) == 1 and encoded[0] in ids else ids[0]

    def teacher(self, completion_ids: list[int], top_logprobs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """The target's top-k (ids, logprobs) per completion token; id -1 where unknown.

        A position is used only where its token is among that position's alternatives: the record's
        text was re-tokenized, and this keeps a misaligned (or off-top-k sampled) position on plain CE.
        """
        k = max((len(top) for top in top_logprobs), default=1)
        ids = np.full((len(completion_ids), k), -1, dtype=np.int64)
        logprobs = np.full((len(completion_ids), k), -np.inf, dtype=np.float32)
        for j, (token, top) in enumerate(zip(completion_ids, top_logprobs)):
            if self.texts[token] not in top:
                continue
            for slot, (text, logprob) in enumerate(top.items()):
                if text in self.ids:
                    ids[j, slot], logprobs[j, slot] = self.ids[text], logprob
        return ids, logprobs


def record_example(record: dict, tokenizer, max_length: int, strings: TokenStrings | None = None) -> dict:
    """The sequence the target saw and produced: prompt, response, and how it stopped.

    Loss is taken on the response and its stop only. Records of a vLLM server hold the very ids the
    target read (``prompts.prompt_ids``, one BOS) and wrote (its stop token or EOS included). Without
    them (another endpoint) the text is tokenized again: prompt and response at once, split at the
    prompt's length, or the response on its own where a token merges across that boundary; then the
    stop string, stop token or EOS that ended the answer. With ``strings`` the example also carries the
    target's top-k logprobs (for a KD loss), aligned with ``labels``.
    """
    prompt_ids = record.get("prompt_token_ids") or prompts.prompt_ids(record["prompt"], tokenizer)
    completion_ids = record.get("token_ids") or response_ids(record, prompt_ids, tokenizer)
    input_ids = (prompt_ids + completion_ids)[-max_length:]  # over-long prompts lose their start
    labels = ([IGNORE] * len(prompt_ids) + completion_ids)[-max_length:]
    example = {"input_ids": input_ids, "labels": labels}
    if strings is not None:
        ids, logprobs = strings.teacher(completion_ids, record.get("top_logprobs") or [])
        none = np.full((len(prompt_ids), ids.shape[1]), -1, dtype=np.int64)
        example["teacher_ids"] = np.concatenate([none, ids])[-max_length:]
        example["teacher_logprobs"] = np.concatenate([np.full(none.shape, -np.inf, np.float32), logprobs])[-max_length:]
    return example


def response_ids(record: dict, prompt_ids: list[int], tokenizer) -> list[int]:
    """The response's ids recovered from its text (records without the server's ids)."""
    stopped = record["finish_reason"] == "stop"
    stop = record["stop_reason"] if stopped and isinstance(record.get("stop_reason"), str) else ""
    full_ids = prompts.prompt_ids(record["prompt"] + record["response"] + stop, tokenizer)
    if full_ids[:len(prompt_ids)] == prompt_ids:
        ids = full_ids[len(prompt_ids):]
    else:
        ids = tokenizer(record["response"] + stop, add_special_tokens=False)["input_ids"]
    if stopped and isinstance(record.get("stop_reason"), int):
        return ids + [record["stop_reason"]]  # a stop token (target.stop_tokens)
    if stopped and record.get("stop_reason") is None:
        return ids + [tokenizer.eos_token_id]  # the target ended with EOS
    return ids


def finetune_examples(records: list[dict], tokenizer, max_length: int, strings: TokenStrings | None = None) -> list[dict]:
    return [record_example(r, tokenizer, max_length, strings)
            for r in tqdm(records, desc="tokenizing records", mininterval=5)]


def teacher_coverage(examples: list[dict]) -> float:
    """Share of the label tokens that have the target's top-k logprobs (the rest train on plain CE)."""
    labelled = sum(int((np.asarray(e["labels"]) != IGNORE).sum()) for e in examples)
    known = sum(int(((e["teacher_ids"] >= 0).any(1) & (np.asarray(e["labels"]) != IGNORE)).sum()) for e in examples)
    return known / max(labelled, 1)


# ---------------------------------------------------------------- vocabulary and batches


def token_counts(examples: list[dict], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in the examples' inputs (for a reduced vocabulary)."""
    flat = np.concatenate([np.asarray(e["input_ids"], dtype=np.int64) for e in examples])
    return torch.from_numpy(np.bincount(flat, minlength=vocab_size))


def label_coverage(examples: list[dict], vocab: VocabMap | None) -> float:
    """Share of the label tokens the drafter can predict (1.0 for a full vocabulary)."""
    labels = torch.from_numpy(np.concatenate([np.asarray(e["labels"], dtype=np.int64) for e in examples]))
    labels = labels[labels != IGNORE]
    if vocab is None or labels.numel() == 0:
        return 1.0
    return float((vocab.encode(labels) != vocab.unk_id).float().mean())


class Collator:
    """Pads a batch (right side; padding is never a label) and maps ids to the drafter's vocabulary.

    Labels outside a reduced vocabulary are ignored: the drafter can never propose them. The target's
    top-k (``teacher_ids``/``teacher_logprobs``, for KD) is padded to (batch, length, k) the same way,
    ids off the map dropped (-1, logprob -inf).
    """

    def __init__(self, pad_id: int | None, vocab: VocabMap | None):
        # Llama-2's tokenizer has no pad token: padded positions are masked and never labels, so any id serves.
        self.pad_id, self.vocab = 0 if pad_id is None else pad_id, vocab

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(e["input_ids"]) for e in examples)
        input_ids = torch.full((len(examples), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.as_tensor(example["input_ids"])
            labels[row, :n] = torch.as_tensor(example["labels"])
            attention_mask[row, :n] = 1
        if self.vocab is not None:
            input_ids = self.vocab.encode(input_ids)
            labels = self.to_drafter(labels)
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
        if "teacher_ids" in examples[0]:
            k = max(e["teacher_ids"].shape[1] for e in examples)
            teacher_ids = torch.full((len(examples), length, k), -1, dtype=torch.long)
            teacher_logprobs = torch.full((len(examples), length, k), float("-inf"))
            for row, example in enumerate(examples):
                n, width = example["teacher_ids"].shape
                teacher_ids[row, :n, :width] = torch.as_tensor(example["teacher_ids"])
                teacher_logprobs[row, :n, :width] = torch.as_tensor(example["teacher_logprobs"])
            if self.vocab is not None:
                teacher_ids = self.to_drafter(teacher_ids, missing=-1)
            batch["teacher_ids"] = teacher_ids
            batch["teacher_logprobs"] = teacher_logprobs.masked_fill(teacher_ids < 0, float("-inf"))
        return batch

    def to_drafter(self, target_ids: torch.Tensor, missing: int = IGNORE) -> torch.Tensor:
        """Target ids -> drafter ids; ids the drafter cannot predict (and ``missing`` ones) become ``missing``."""
        mapped = self.vocab.encode(target_ids.clamp(min=0))
        return torch.where((target_ids >= 0) & (mapped != self.vocab.unk_id), mapped, missing)
