"""Drafter models: built from the ``drafter`` config group around the target's tokenizer.

A drafter is a plain HF causal LM. ``source=init`` builds one with random weights from the
architecture fields (vocabulary, BOS/EOS/PAD ids from the target, or the reduced vocabulary of a
``VocabMap``), or with ``init_from`` starts that shape from published weights (the authors'
double7/vicuna-68m), refusing a checkpoint of another shape; ``source=hub|local`` loads published
weights as they are (e.g. JackFram/llama-68m). Every drafter passes ``check_drafter`` — same
tokenizer as the target, and a vocabulary of the target's padded size (or of its vocab map) — before
any compute.

A finished drafter folder holds the weights (``save_pretrained``), the target's tokenizer and, for a
reduced vocabulary, ``vocab_map.json``: loadable by ``AutoModelForCausalLM`` and, full-vocab, usable
as transformers' ``assistant_model``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from pipeline.config import EAGLE3, ConfigError, ModelSource
from pipeline.errors import TokenizerMismatchError
from pipeline.models.eagle3 import Eagle3Head, new_head
from pipeline.models.modeling_specdraft import SpecdraftDrafterConfig
from pipeline.models.vocab import PARD_K, PARD_TOKEN, VocabMap, check_tokenizers


def reduced_vocab(drafter: DictConfig, counts: torch.Tensor, tokenizer) -> VocabMap | None:
    """The drafter's reduced vocabulary: the ``drafter.reduced_vocab`` most counted target ids and every special id."""
    if drafter.reduced_vocab is None:
        return None
    return VocabMap.most_frequent(counts, drafter.reduced_vocab, always=tokenizer.all_special_ids)


def specialize_vocab(
    model: PreTrainedModel, vocab: VocabMap, counts: torch.Tensor, tokenizer, target_path: str | None = None
) -> VocabMap:
    """A pretrained reduced-vocab drafter adapted to its finetuning data: its rows for ids that data never
    uses are re-pointed at the data's frequent unmapped ids (``VocabMap.specialize``) and restart from the
    mean embedding, or, given ``target_path`` (drafter.embeddings_from_target), the input rows from the
    target's rows of their new ids. Pretraining counts English; a language pair's prompts and answers need
    other tokens. An EAGLE-3 head reads the target's embeddings: only its output rows change, to the target's own
    output rows of the new ids (given ``target_path``), else the mean."""
    specialized, rows = vocab.specialize(counts, always=tokenizer.all_special_ids)
    if isinstance(model, Eagle3Head):
        with torch.no_grad():
            weight = model.lm_head.weight
            weight[rows] = (
                target_model(target_path).get_output_embeddings().weight[specialized.target_ids[rows]].to(weight)
                if target_path is not None
                else weight.mean(0)
            )
        return specialized
    with torch.no_grad():
        std = float(model.get_input_embeddings().weight[: vocab.unk_id].std())  # the trained rows' scale
        for weight in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:  # one if tied
            weight[rows] = weight[: vocab.unk_id].mean(0)
        if target_path is not None:
            model.get_input_embeddings().weight[rows] = target_embedding_rows(
                target_path, model.config.hidden_size, specialized.target_ids[rows], std
            )
    return specialized


def target_model(target_path: str) -> PreTrainedModel:
    """The target's weights for a new drafter to start from (bf16: a 7B target fits every rank's host memory)."""
    return AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.bfloat16)


def init_head(drafter: DictConfig, target_path: str, vocab: VocabMap | None, seed: int) -> Eagle3Head:
    """A random EAGLE-3 head of the configured shape for the target, reading its ``drafter.aux_layer_ids``."""
    return head_for(target_model(target_path), drafter, vocab, seed)


def head_for(target: PreTrainedModel, drafter: DictConfig, vocab: VocabMap | None, seed: int = 0) -> Eagle3Head:
    """A random EAGLE-3 head of ``drafter``'s shape for the loaded ``target``."""
    return new_head(
        target,
        vocab,
        drafter.aux_layer_ids,
        num_heads=drafter.num_heads,
        num_kv_heads=drafter.num_kv_heads,
        head_dim=drafter.head_dim,
        intermediate_size=drafter.intermediate_size,
        rms_norm_eps=drafter.rms_norm_eps,
        max_position_embeddings=drafter.max_position_embeddings,
        seed=seed,
    )


def init_drafter(drafter: DictConfig, target_path: str, vocab: VocabMap | None, seed: int) -> PreTrainedModel:
    """A randomly initialised drafter of the configured shape, on the target's (or the reduced) vocabulary."""
    target_config = AutoConfig.from_pretrained(target_path)
    special = {name: getattr(target_config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if vocab is not None:  # the special ids are always in the map (VocabMap.most_frequent's `always`)
        special = {name: _to_drafter_ids(ids, vocab) for name, ids in special.items()}
    config = AutoConfig.for_model(
        drafter.architecture,
        vocab_size=vocab.drafter_vocab_size if vocab is not None else target_config.vocab_size,
        hidden_size=drafter.hidden_size,
        num_hidden_layers=drafter.num_layers,
        num_attention_heads=drafter.num_heads,
        num_key_value_heads=drafter.num_kv_heads or drafter.num_heads,
        head_dim=drafter.head_dim or drafter.hidden_size // drafter.num_heads,
        intermediate_size=drafter.intermediate_size,
        hidden_act=drafter.hidden_act,
        hidden_activation=drafter.hidden_act,  # Gemma's name for it
        rms_norm_eps=drafter.rms_norm_eps,
        max_position_embeddings=drafter.max_position_embeddings,
        tie_word_embeddings=drafter.tie_word_embeddings,
        **special,
    )
    torch.manual_seed(seed)  # every rank builds the same weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if drafter.embeddings_from_target:
        ids = vocab.target_ids if vocab is not None else torch.arange(target_config.vocab_size)
        with torch.no_grad():
            model.get_input_embeddings().weight[: len(ids)] = target_embedding_rows(
                target_path, drafter.hidden_size, ids, config.initializer_range
            )
    return model


def target_embedding_rows(target_path: str, hidden_size: int, target_ids: torch.Tensor, std: float) -> torch.Tensor:
    """What the target learned about each token, at the drafter's width: the target's embedding rows of
    ``target_ids`` projected on the ``hidden_size`` largest principal directions of its whole embedding
    matrix, scaled so that the whole projected matrix has standard deviation ``std``. The projection
    depends on the target alone, so pretraining and the finetune's re-pointed rows share it."""
    weight = (
        AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).get_input_embeddings().weight.detach()
    )
    if hidden_size > weight.shape[1]:
        raise ConfigError(f"drafter.embeddings_from_target needs drafter.hidden_size <= the target's {weight.shape[1]}")
    centered = weight - weight.mean(0)
    basis = torch.linalg.eigh(centered.T @ centered).eigenvectors[:, -hidden_size:]  # eigh sorts ascending
    return centered[target_ids] @ basis * (std / float((centered @ basis).std()))


def _to_drafter_ids(ids, vocab: VocabMap):
    if ids is None:
        return None
    if isinstance(ids, list):
        return [int(vocab.to_drafter[i]) for i in ids]
    return int(vocab.to_drafter[ids])


def check_drafter(drafter_path: str, target_path: str, name: str = "drafter") -> VocabMap | None:
    """The compatibility gate for a drafter folder (or hub id): tokenizer and vocabulary size.

    Returns the folder's vocab map (None for a full-vocabulary drafter).
    """
    config = Path(drafter_path) / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == SpecdraftDrafterConfig.model_type:
        raise TokenizerMismatchError(
            f"{name} {drafter_path} is the transformers wrapper `make export` writes for serving; specdraft's engine "
            "takes the drafter it was exported from (<run>/finetune/drafter), eval.engine=vllm takes this folder"
        )
    check_tokenizers(AutoTokenizer.from_pretrained(drafter_path), AutoTokenizer.from_pretrained(target_path), name)
    vocab = VocabMap.load(drafter_path) if Path(drafter_path).is_dir() else None
    target_size = AutoConfig.from_pretrained(target_path).vocab_size
    drafter_config = AutoConfig.from_pretrained(drafter_path)
    drafter_size, mask = drafter_config.vocab_size, getattr(drafter_config, PARD_TOKEN, None)
    expected = vocab.drafter_vocab_size if vocab is not None else target_size
    if vocab is not None and vocab.target_vocab_size != target_size:
        raise TokenizerMismatchError(
            f"{name}'s vocab map covers {vocab.target_vocab_size} target ids but the target has {target_size}; "
            "retrain the drafter for this target"
        )
    if mask is not None and not (mask == expected if vocab is not None else 0 <= mask < expected):
        where = f"its vocabulary's id {expected}, after the map's" if vocab is not None else f"a target id < {expected}"
        raise TokenizerMismatchError(
            f"{name}'s mask token {PARD_TOKEN}={mask} is not {where}: it cannot draft in "
            "parallel; finetune it again with train.finetune.parallel_draft.k=K"
        )
    if getattr(drafter_config, "draft_vocab_size", None) is not None:  # an EAGLE-3 head: reads every id, proposes N
        if drafter_config.vocab_size != target_size:
            raise TokenizerMismatchError(
                f"{name} reads {drafter_config.vocab_size} token ids but the target has {target_size}; "
                "train the head for this target"
            )
        drafter_size, expected = drafter_config.draft_vocab_size, expected - (vocab is not None)
    if drafter_size != expected + (mask is not None and vocab is not None):
        raise TokenizerMismatchError(
            f"{name} predicts {drafter_size} tokens but the target's (padded) vocabulary needs {expected}; "
            "build the drafter with the target's tokenizer"
        )
    return vocab


def make_parallel(model: PreTrainedModel, vocab: VocabMap | None, k: int, mask_id: int | None) -> PreTrainedModel:
    """Teach ``model`` parallel drafting of ``k`` positions with a mask token: a reduced vocabulary's gets a row of
    its own (id N + 1), a full vocabulary's is ``mask_id``, a target id its data never uses. The mask's rows start
    at the mean embedding. A drafter already parallel keeps its mask and learns ``k`` positions."""
    if getattr(model.config, PARD_TOKEN, None) is None:
        size = model.config.vocab_size
        if vocab is not None:
            model.resize_token_embeddings(size + 1, mean_resizing=False)
            mask_id = size
        with torch.no_grad():
            for weight in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:  # one if tied
                weight[mask_id] = weight[:size].mean(0)
        setattr(model.config, PARD_TOKEN, mask_id)
    setattr(model.config, PARD_K, k)
    return model


def load_drafter(
    path: str, target_path: str, name: str = "drafter", device: torch.device = torch.device("cpu")
) -> tuple[PreTrainedModel, VocabMap | None]:
    """A drafter folder or hub id, after the compatibility gate, with its vocab map, on ``device``."""
    vocab = check_drafter(path, target_path, name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    return model, vocab.to(device) if vocab is not None else None


def published_weights(drafter: DictConfig) -> str | None:
    """The hub id or folder the drafter's weights come from (``source=hub|local``, or ``init_from``); None: random
    init."""
    return drafter.path if drafter.source != ModelSource.init else drafter.init_from


def start_from(drafter: DictConfig, target_path: str) -> tuple[PreTrainedModel, VocabMap | None]:
    """The configured drafter shape with ``drafter.init_from``'s weights (e.g. double7/vicuna-68m), after the
    compatibility gate; a checkpoint of another shape is refused in one line."""
    model, vocab = load_drafter(drafter.init_from, target_path, f"drafter.init_from {drafter.init_from}")
    config = model.config
    expected = {
        "model_type": drafter.architecture,
        "hidden_size": drafter.hidden_size,
        "num_hidden_layers": drafter.num_layers,
        "num_attention_heads": drafter.num_heads,
        "num_key_value_heads": drafter.num_kv_heads or drafter.num_heads,
        "intermediate_size": drafter.intermediate_size,
        "tie_word_embeddings": drafter.tie_word_embeddings,
    }
    if wrong := [
        f"{key} {getattr(config, key, None)} (not {value})"
        for key, value in expected.items()
        if getattr(config, key, None) != value
    ]:
        raise ConfigError(
            f"drafter.init_from {drafter.init_from} is not the shape of drafter {drafter.name}: "
            f"{', '.join(wrong)}; start from a checkpoint of that shape or choose a drafter config "
            "that matches it"
        )
    return model, vocab


def build_drafter(
    drafter: DictConfig, target_path: str, vocab: VocabMap | None, seed: int
) -> tuple[PreTrainedModel, VocabMap | None]:
    """The drafter the config asks for: random init (with ``vocab``), ``init_from``'s weights, or published
    hub/local weights."""
    if drafter.architecture == EAGLE3:
        return init_head(drafter, target_path, vocab, seed), vocab
    if drafter.source == ModelSource.init:
        if drafter.init_from is not None:
            return start_from(drafter, target_path)
        return init_drafter(drafter, target_path, vocab, seed), vocab
    if drafter.reduced_vocab is not None:
        raise ConfigError(f"drafter.reduced_vocab needs drafter.source=init; {drafter.path} brings its own vocabulary")
    return load_drafter(drafter.path, target_path, drafter.name)


def save_drafter(
    model: PreTrainedModel, target_path: str, vocab: VocabMap | None, folder: Path, state_dict=None
) -> None:
    """Write the drafter folder atomically: weights, the target's tokenizer, the vocab map."""
    partial = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, state_dict=state_dict)
    AutoTokenizer.from_pretrained(target_path).save_pretrained(partial)
    if vocab is not None:
        vocab.save(partial)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
