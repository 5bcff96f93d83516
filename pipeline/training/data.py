"""Training examples for the drafter: packed pretraining blocks and masked finetuning examples.

Every example is ``{"input_ids": [...], "labels": [...]}`` in TARGET token ids, labels aligned with
inputs (the loss predicts ``labels[t + 1]`` from ``input_ids[: t + 1]``) and ``IGNORE`` where no loss
is taken. ``Collator`` pads (or packs, finetuning) a batch and maps both to a reduced drafter vocabulary.

Pretraining reads ``train.pretrain.token_budget`` tokens of its corpora mixed by tokens at their
weights; once the small corpus (ShareGPT) is exhausted the large one (C4) goes on alone. The stage
process tokenizes them into a cache before any training process starts; the processes only read it.
Pretraining packs documents into ``max_length`` blocks, each document ``[BOS] text EOS`` (BOS only
when the target's tokenizer adds one). Attention does cross document boundaries, as in GPT/nanoGPT
pretraining, but the label of each document's first token is masked: the drafter is never trained
to guess an unrelated document's start; it is trained to predict the EOS that ends a document.
Blocks are never padded (the stream's tail is dropped), so no padding is ever a label.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from pipeline import prompts
from pipeline.data.sharegpt import iter_conversations
from pipeline.jsonl import parse_jsonl
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE

TOKENIZE_BATCH = 512
READ_FILE = "read.json"  # a pretraining cache's counts, written last


# ---------------------------------------------------------------- pretraining


def sharegpt_documents(limit: int | None) -> Iterator[str]:
    for record in iter_conversations(limit):
        text = "\n\n".join(
            turn["value"] for turn in record.get("conversations", []) if (turn.get("value") or "").strip()
        )
        if text:
            yield text


def corpus_documents(corpus: DictConfig, max_documents: int | None) -> Iterator[str]:
    """One pretraining corpus's texts: ShareGPT from its package, any other a hub text corpus streamed (C4)."""
    if corpus.name == "sharegpt":
        return sharegpt_documents(max_documents)
    import datasets

    stream = datasets.load_dataset(corpus.hub_dataset or corpus.name, corpus.hub_subset, split="train", streaming=True)
    return (row["text"] for row in stream.select_columns(["text"]))


def tokenized_documents(texts: Iterator[str], tokenizer) -> Iterator[np.ndarray]:
    """Each text as ``[BOS] ids EOS`` (BOS exactly when the target's tokenizer adds one), tokenized in batches."""
    while batch := list(itertools.islice(texts, TOKENIZE_BATCH)):
        for ids in tokenizer(batch)["input_ids"]:
            yield np.asarray(ids + [tokenizer.eos_token_id], dtype=np.uint32)


def mixed_documents(cfg: DictConfig, tokenizer, counts: dict[str, dict]) -> Iterator[np.ndarray]:
    """The tokenized documents of ``data.pretrain_corpora`` mixed BY TOKENS at their weights.

    The next document always comes from the corpus furthest below its share of the tokens read so far
    (deterministic, no seed). A corpus that runs out leaves the others to go on, so a token budget is
    read from the large corpus (C4) after the small one (ShareGPT's 17.7k conversations) is exhausted,
    never recycling it. ``counts`` receives each corpus's documents and tokens read.
    """
    corpora = {c.name: c for c in cfg.data.pretrain_corpora}
    streams = {
        name: tokenized_documents(corpus_documents(c, cfg.data.pretrain_max_documents), tokenizer)
        for name, c in corpora.items()
    }
    counts.update({name: {"documents": 0, "tokens": 0, "exhausted": False} for name in corpora})
    while streams:
        name = min(streams, key=lambda n: counts[n]["tokens"] / corpora[n].weight)
        ids = next(streams[name], None)
        if ids is None:
            counts[name]["exhausted"] = True
            del streams[name]
            continue
        counts[name]["documents"] += 1
        counts[name]["tokens"] += len(ids)
        yield ids


def tokenizer_digest(tokenizer) -> str:
    """The vocabulary itself, hashed: a dry run's stand-in or a test's tokenizer may carry a real target's name."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def cache_folder(cache_dir: str | Path, kind: str, key: dict) -> Path:
    """Where the data of ``key`` (all that determines it, JSON) is cached: ``<cache_dir>/<kind>/<key's hash>``."""
    return Path(cache_dir) / kind / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def fill_cache(folder: Path, last: str, write: Callable[[Path], None]) -> bool:
    """Make ``folder`` whole once: ``write(partial)`` fills a partial folder, its file ``last`` written last, which is
    renamed into place. Under a lock beside it: concurrent runs, and every node of a multi-node job
    (slurm/train-node.sh), wait for one writer and then read its cache (a filesystem whose locks do not reach
    across nodes costs duplicate work, never a torn cache). Returns whether this call wrote it."""
    if (folder / last).exists():
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.with_name(f".{folder.name}.lock")):
        if (folder / last).exists():
            return False
        # the host in the name: processes of two nodes may share a pid
        partial = folder.with_name(f".{folder.name}.{socket.gethostname()}.{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            write(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        if not folder.exists():  # another node may have finished the same cache first
            os.replace(partial, folder)
        else:
            shutil.rmtree(partial)
    return True


def pretrain_cache(cfg: DictConfig, tokenizer, max_tokens: int | None) -> Path:
    """Where the pretraining stream of this (tokenizer, corpora, limits) is cached, under ``paths.cache_dir``."""
    key = {
        "tokenizer": tokenizer_digest(tokenizer),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id],
        "corpora": OmegaConf.to_container(cfg.data.pretrain_corpora, enum_to_str=True),
        "max_documents": cfg.data.pretrain_max_documents,
        "max_tokens": max_tokens,
        "mixing": "tokens",  # caches of the former document-interleaved stream are not reused
    }
    return cache_folder(cfg.paths.cache_dir, "pretrain-tokens", key)


def write_pretrain_tokens(cfg: DictConfig, tokenizer, max_tokens: int | None) -> dict:
    """Tokenize the pretraining stream into its cache (once per key) and return what was read.

    Runs in the stage's own process before ``accelerate launch``: tokenizing C4 takes far longer than a
    collective may wait (NCCL's 10 minutes). Stops after ``max_tokens`` (all corpora exhausted: fewer).
    """
    folder = pretrain_cache(cfg, tokenizer, max_tokens)

    def write(partial: Path) -> None:
        pieces, starts, total, counts = [], [], 0, {}
        documents = itertools.islice(mixed_documents(cfg, tokenizer, counts), cfg.data.pretrain_max_documents)
        with tqdm(desc="tokenizing pretraining data", unit=" tok", unit_scale=True, mininterval=5) as bar:
            while max_tokens is None or total < max_tokens:
                ids = next(documents, None)
                if ids is None:
                    break
                starts.append(total)
                pieces.append(ids)
                total += len(ids)
                bar.update(len(ids))
        tokens = np.concatenate(pieces)[:max_tokens] if pieces else np.zeros(0, dtype=np.uint32)
        read = {"tokens": len(tokens), "documents": len(starts), "corpora": counts}
        np.save(partial / "tokens.npy", tokens)
        np.save(partial / "starts.npy", np.asarray(starts, dtype=np.int64))
        (partial / READ_FILE).write_text(json.dumps(read, indent=1) + "\n")  # written last: the cache is whole

    fill_cache(folder, READ_FILE, write)
    return json.loads((folder / READ_FILE).read_text())


def read_pretrain_tokens(cfg: DictConfig, tokenizer, max_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The cached stream and its document start offsets (what every training process reads)."""
    folder = pretrain_cache(cfg, tokenizer, max_tokens)
    if not (folder / READ_FILE).exists():
        raise FileNotFoundError(
            f"{folder} holds no tokenized pretraining data: the pretrain stage writes it before "
            "it launches the training processes; run `specdraft pretrain`, not a worker alone"
        )
    return np.load(folder / "tokens.npy"), np.load(folder / "starts.npy")


def pretrain_tokens(cfg: DictConfig, tokenizer, max_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Both at once, in one process that is no training worker (a bench)."""
    write_pretrain_tokens(cfg, tokenizer, max_tokens)
    return read_pretrain_tokens(cfg, tokenizer, max_tokens)


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


def record_files(records_dir: Path) -> list[Path]:
    """The distill stage's record files, in the order they are read."""
    return sorted(Path(records_dir).glob("*.jsonl"))


def read_records(records_dir: Path) -> list[dict]:
    """The distill stage's records (contract 1), in file and line order."""
    records = []
    for path in record_files(records_dir):
        records.extend(parse_jsonl(path, path.read_bytes()))
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
    if full_ids[: len(prompt_ids)] == prompt_ids:
        ids = full_ids[len(prompt_ids) :]
    else:
        ids = tokenizer(record["response"] + stop, add_special_tokens=False)["input_ids"]
    if stopped and isinstance(record.get("stop_reason"), int):
        return ids + [record["stop_reason"]]  # a stop token (target.stop_tokens)
    if stopped and record.get("stop_reason") is None:
        return ids + [tokenizer.eos_token_id]  # the target ended with EOS
    return ids


def finetune_examples(
    records: list[dict], tokenizer, max_length: int, strings: TokenStrings | None = None
) -> list[dict]:
    return [
        record_example(r, tokenizer, max_length, strings)
        for r in tqdm(records, desc="tokenizing records", mininterval=5)
    ]


def teacher_coverage(examples: list[dict]) -> float:
    """Share of the label tokens that have the target's top-k logprobs (the rest train on plain CE)."""
    labelled = sum(int((np.asarray(e["labels"]) != IGNORE).sum()) for e in examples)
    known = sum(int(((e["teacher_ids"] >= 0).any(1) & (np.asarray(e["labels"]) != IGNORE)).sum()) for e in examples)
    return known / max(labelled, 1)


EXAMPLE_ARRAYS = ("input_ids", "labels", "teacher_ids", "teacher_logprobs")


def save_examples(path: Path, examples: list[dict]) -> None:
    """Tokenized examples as flat arrays and lengths (``np.savez``, nothing pickled), written atomically: the
    finetune stage tokenizes its records once, into a cache, before ``accelerate launch``; every process reads them."""
    arrays = {"lengths": np.asarray([len(e["input_ids"]) for e in examples], dtype=np.int64)}
    for key in EXAMPLE_ARRAYS:
        if examples and key in examples[0]:
            values = [np.asarray(e[key]) for e in examples]
            if values[0].ndim == 2:  # the target's top-k: records may list fewer alternatives; pad as the Collator does
                width = max(v.shape[1] for v in values)
                fill = -1 if key == "teacher_ids" else -np.inf
                values = [np.pad(v, ((0, 0), (0, width - v.shape[1])), constant_values=fill) for v in values]
            arrays[key] = np.concatenate(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with partial.open("wb") as handle:
        np.savez(handle, **arrays)
    os.replace(partial, path)


def link_into(source: Path, path: Path) -> None:
    """``source`` at ``path`` too, replacing what was there atomically: a hard link (the same file, not a copy),
    else a copy (another filesystem)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(source, partial)
    except OSError:
        shutil.copyfile(source, partial)
    os.replace(partial, path)


def load_examples(path: Path) -> list[dict]:
    """What ``save_examples`` wrote, as views into the arrays; one line naming the stage if it is missing."""
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the finetune stage tokenizes its records there before it launches "
            "the training processes; run `specdraft finetune`, not a worker alone"
        )
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    bounds = np.cumsum(arrays.pop("lengths"))[:-1]
    split = {key: np.split(array, bounds) for key, array in arrays.items()}
    return [dict(zip(split, values)) for values in zip(*split.values())] if split else []


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


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, length, length) bool: each token attends to the earlier tokens of its own packed example."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    return ((segment_ids[:, :, None] == segment_ids[:, None, :]) & causal).unsqueeze(1)


def with_sliding_window(config, mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | dict:
    """A prepared (batch, 1, length, length) bool mask as a model of ``config`` takes it. transformers uses a prepared
    mask as given, so a model with sliding-window layers needs the window in it (keys fewer than ``sliding_window``
    positions back): one mask per layer type for the models that take such a mapping (those with ``layer_types``:
    Gemma 2/3, Qwen 2/3), one windowed mask for a model whose every layer slides (Mistral); else the window would be
    lost wherever an example outgrows it."""
    config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if not window:
        return mask
    near = (position_ids[:, :, None] - position_ids[:, None, :] < window).unsqueeze(1)
    if getattr(config, "layer_types", None) is None:
        return mask & near
    return {"full_attention": mask, "sliding_attention": mask & near}


def packed_attention_mask(config, segment_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | dict:
    """The attention mask of packed rows (positions from 0 in each example) for a model of ``config``."""
    return with_sliding_window(config, block_causal_mask(segment_ids), position_ids)


class Collator:
    """Pads a batch (right side; padding is never a label) and maps ids to the drafter's vocabulary.

    Labels outside a reduced vocabulary are ignored: the drafter can never propose them. The target's
    top-k (``teacher_ids``/``teacher_logprobs``, for KD) is padded to (batch, length, k) the same way,
    ids off the map dropped (-1, logprob -inf).

    With ``pack_length`` the batch's examples are packed into rows of up to that many tokens (first fit,
    longest first) instead of one padded row each. Each example keeps its own positions from 0
    (``position_ids``) and attends to itself only (``segment_ids``; the objective builds the
    block-diagonal causal mask on the device), and its first token is no label, so a packed batch has
    exactly the losses of its examples run one by one. Every batch carries ``keep``: the positions where
    some row has a label, found here on the host, so the LM head runs there without a device sync.
    """

    def __init__(self, pad_id: int | None, vocab: VocabMap | None, pack_length: int | None = None):
        # Llama-2's tokenizer has no pad token: padded positions are masked and never labels, so any id serves.
        self.pad_id, self.vocab, self.pack_length = 0 if pad_id is None else pad_id, vocab, pack_length

    def rows(self, examples: list[dict]) -> list[list[dict]]:
        """The examples of each row: one each, or packed first-fit, longest first."""
        if self.pack_length is None:
            return [[example] for example in examples]
        rows, room = [], []
        for example in sorted(examples, key=lambda e: -len(e["input_ids"])):
            n = len(example["input_ids"])
            row = next((i for i, free in enumerate(room) if n <= free), None)
            if row is None:
                rows.append([])
                room.append(self.pack_length)
                row = len(rows) - 1
            rows[row].append(example)
            room[row] -= n
        return rows

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.layout(self.rows(examples), unlabelled_first=self.pack_length is not None)
        if self.vocab is not None:
            batch["input_ids"] = self.vocab.encode(batch["input_ids"])
        self.map_targets(batch)
        batch["keep"] = (batch["labels"][:, 1:] != IGNORE).any(0).nonzero().squeeze(1)  # t predicts label t + 1
        if self.pack_length is None:
            del batch["position_ids"], batch["segment_ids"]
        return batch

    def layout(
        self, rows: list[list[dict]], unlabelled_first: bool, extra: dict[str, torch.Tensor] | None = None
    ) -> dict:
        """The rows' examples side by side, padded: every per-token field (``input_ids``, ``labels``, the teacher's
        top-k and ``extra``'s, each a padding default of one row), ``attention_mask``, ``segment_ids`` and
        ``position_ids`` (an example's own, else from 0); ``unlabelled_first``: each example's first token is no
        label (packed rows: it would be predicted from the example before it)."""
        extra = extra or {}
        length = max(sum(len(e["input_ids"]) for e in row) for row in rows)
        shape = (len(rows), length)
        batch = {
            "input_ids": torch.full(shape, self.pad_id, dtype=torch.long),
            "labels": torch.full(shape, IGNORE, dtype=torch.long),
            "attention_mask": torch.zeros(shape, dtype=torch.long),
            "position_ids": torch.zeros(shape, dtype=torch.long),
            "segment_ids": torch.full(shape, -1, dtype=torch.long),
        }  # padding: a segment of its own, no label
        batch |= {key: default[:length].repeat(len(rows), 1) for key, default in extra.items()}
        if teacher := "teacher_ids" in rows[0][0]:
            k = max(e["teacher_ids"].shape[1] for row in rows for e in row)
            batch["teacher_ids"] = torch.full((*shape, k), -1, dtype=torch.long)
            batch["teacher_logprobs"] = torch.full((*shape, k), float("-inf"))
        for r, row in enumerate(rows):
            at = 0
            for segment, example in enumerate(row):
                n = len(example["input_ids"])
                for key in ("input_ids", "labels", *extra):
                    batch[key][r, at : at + n] = torch.as_tensor(example[key])
                batch["position_ids"][r, at : at + n] = torch.as_tensor(example.get("position_ids", range(n)))
                batch["attention_mask"][r, at : at + n] = 1
                batch["segment_ids"][r, at : at + n] = segment
                if teacher:
                    width = example["teacher_ids"].shape[1]
                    batch["teacher_ids"][r, at : at + n, :width] = torch.as_tensor(example["teacher_ids"])
                    batch["teacher_logprobs"][r, at : at + n, :width] = torch.as_tensor(example["teacher_logprobs"])
                if unlabelled_first:
                    batch["labels"][r, at] = IGNORE
                at += n
        return batch

    def map_targets(self, batch: dict) -> None:
        """Labels and the teacher's ids to the drafter's vocabulary (what it cannot predict: no target), and the
        teacher's log-probabilities of ids with no target to -inf."""
        if self.vocab is not None:
            batch["labels"] = self.to_drafter(batch["labels"])
            if "teacher_ids" in batch:
                batch["teacher_ids"] = self.to_drafter(batch["teacher_ids"], missing=-1)
        if "teacher_ids" in batch:
            batch["teacher_logprobs"] = batch["teacher_logprobs"].masked_fill(batch["teacher_ids"] < 0, float("-inf"))

    def to_drafter(self, target_ids: torch.Tensor, missing: int = IGNORE) -> torch.Tensor:
        """Target ids -> drafter ids; ids the drafter cannot predict (and ``missing`` ones) become ``missing``."""
        mapped = self.vocab.encode(target_ids.clamp(min=0))
        return torch.where((target_ids >= 0) & (mapped != self.vocab.unk_id), mapped, missing)
