"""One tokenization of the request (pipeline/prompts.py): exactly one BOS whatever the family's template does,
and where an answer ends: stop strings by prompt format, stop tokens by name."""

from __future__ import annotations

import pytest
import standins  # tests/standins.py

from pipeline.config import ConfigError, compose_config
from pipeline.models.provision import load_tokenizer
from pipeline.prompts import build_prompt, prompt_ids, stop_strings, stop_token_ids

# recipe -> (family of its target, whether the chat template renders the BOS itself)
FAMILIES = {"paper-llama2": ("llama2", True), "paper-vicuna": ("vicuna", False), "paper-gemma": ("gemma", True)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: standins.family_source(family, root / family) for family in ("llama2", "vicuna", "gemma")}


@pytest.mark.parametrize("recipe", sorted(FAMILIES))
def test_every_family_gets_exactly_one_bos(sources, recipe):
    family, template_has_bos = FAMILIES[recipe]
    cfg = compose_config([f"recipe={recipe}"])
    tokenizer = load_tokenizer(str(sources[family]))
    text = build_prompt(cfg.target, cfg.lang, "Das Wetter ist heute sehr schön.", tokenizer)
    assert text.startswith(tokenizer.bos_token) == template_has_bos
    ids = prompt_ids(text, tokenizer)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert (
        tokenizer.decode(ids, skip_special_tokens=True).strip()
        == tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids, skip_special_tokens=True).strip()
    )


def test_chat_targets_stop_at_no_string_and_completion_targets_at_a_newline():
    assert stop_strings(compose_config(["recipe=paper-llama2"]).target) == []
    assert stop_strings(compose_config(["recipe=local"]).target) == ["\n"]
    assert stop_strings(compose_config(["recipe=paper-llama2", "target.stop=[END]"]).target) == ["END"]


def test_gemma_ends_a_turn_with_its_stop_token_and_an_unknown_one_fails_in_one_line(sources):
    tokenizer = load_tokenizer(str(sources["gemma"]))
    target = compose_config(["recipe=paper-gemma"]).target
    assert stop_token_ids(target, tokenizer) == [tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    target.stop_tokens = ["<end_of_answer>"]
    with pytest.raises(ConfigError, match=r"^target.stop_tokens: '<end_of_answer>' is not a token of gemma-7b-it's "):
        stop_token_ids(target, tokenizer)
