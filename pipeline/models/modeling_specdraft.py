"""A reduced-vocabulary drafter as a transformers causal LM over its target's whole vocabulary.

Remote code for ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``: the export
stage copies this file, unchanged, into the exported folder (it imports nothing from specdraft). The
drafter itself is an ordinary causal LM over N + 1 ids (``drafter_config``): its id i < N stands for
target id ``target_ids[i]`` and id N for every other target token, on the input side only. This wrapper
takes and returns *target* ids and logits, so transformers' assisted generation
(``target.generate(..., assistant_model=drafter)``) runs it as it is: target ids are looked up in
``to_drafter`` on the way in, and the N drafter logits are placed at their target ids on the way out,
every other target id (and the unmapped id N) getting logit -inf, i.e. probability exactly 0 — the
drafter's own distribution, unchanged. Weights stay the drafter's (its small head, tied if it was).

``config.json`` holds the drafter's config with the target's ``vocab_size`` and special token ids (what
``generate`` checks and uses) and the drafter's own config, unchanged, as ``drafter_config``.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class SpecdraftDrafterConfig(PretrainedConfig):
    model_type = "specdraft_drafter"

    def __init__(self, drafter_config: dict | None = None, **kwargs):
        self.drafter_config = drafter_config or {}
        super().__init__(**kwargs)


class SpecdraftDrafterForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = SpecdraftDrafterConfig
    base_model_prefix = "drafter"
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True

    def __init__(self, config: SpecdraftDrafterConfig):
        super().__init__(config)
        inner = dict(config.drafter_config)
        inner_config = AutoConfig.for_model(inner.pop("model_type"), **inner)
        # the dtype from_pretrained(dtype=...) builds in (its default dtype here); from_config alone would reset it
        self.drafter = AutoModelForCausalLM.from_config(
            inner_config, attn_implementation=config._attn_implementation, dtype=torch.get_default_dtype()
        )
        # target id -> drafter id (N for the unmapped ones): the input lookup and, inverted, the output's places
        self.register_buffer("to_drafter", torch.zeros(config.vocab_size, dtype=torch.long))
        # the unmapped id N: the drafter's last id, or the one before a parallel drafter's mask token (N + 1)
        self.unmapped = inner_config.vocab_size - 1 - (getattr(inner_config, "pard_token", None) is not None)
        self.post_init()

    def get_input_embeddings(self):
        return self.drafter.get_input_embeddings()

    def get_output_embeddings(self):
        return self.drafter.get_output_embeddings()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.drafter(
            input_ids=self.to_drafter[input_ids],
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        # the unmapped id's logit becomes -inf, then every target id reads its drafter id's logit
        logits = out.logits.index_fill(-1, torch.tensor([self.unmapped], device=out.logits.device), float("-inf"))
        return CausalLMOutputWithPast(
            logits=logits.index_select(-1, self.to_drafter),
            past_key_values=out.past_key_values,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )
