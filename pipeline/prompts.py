"""The one definition of how a translation request is shown to the target.

Distillation, finetuning and evaluation all build prompts here, so the drafter is trained on exactly
the text the target saw: base models get ``instruction + completion_suffix`` (e.g.
``Translate German to English: {src}\\nEnglish:``), chat models the chat template (the tokenizer's,
or ``target.chat_template`` for models that ship none, like Vicuna v1.3).
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

from pipeline.config import ConfigError, PromptFormat

IGNORE = -100  # the label of a token no loss or estimate reads (torch cross_entropy's ignore_index)
Shot = tuple[str, str]  # a worked example shown before the request: (source text, its translation)


def instruction(target: DictConfig, lang: DictConfig, text: str) -> str:
    return target.instruction.format(src_name=lang.src_name, tgt_name=lang.tgt_name, text=text)


def build_prompt(target: DictConfig, lang: DictConfig, text: str, tokenizer, shots: Sequence[Shot] = ()) -> str:
    """The full prompt string (BOS excluded: the tokenizer adds it), after the worked ``shots``, if any."""
    if target.prompt_format == PromptFormat.completion:
        suffix = target.completion_suffix.format(src_name=lang.src_name, tgt_name=lang.tgt_name)
        worked = "".join(f"{instruction(target, lang, src)}{suffix} {tgt}\n\n" for src, tgt in shots)
        return worked + instruction(target, lang, text) + suffix
    return tokenizer.apply_chat_template(
        chat_messages(target, lang, text, shots),
        chat_template=target.chat_template,
        add_generation_prompt=True,
        tokenize=False,
    )


def chat_messages(target: DictConfig, lang: DictConfig, text: str, shots: Sequence[Shot] = ()) -> list[dict[str, str]]:
    """The request as chat messages (what a chat API receives; build_prompt renders them)."""
    messages = [{"role": "system", "content": target.system_prompt}] if target.system_prompt else []
    for src, tgt in shots:
        messages += [{"role": "user", "content": instruction(target, lang, src)}, {"role": "assistant", "content": tgt}]
    return messages + [{"role": "user", "content": instruction(target, lang, text)}]


def prompt_ids(prompt: str, tokenizer) -> list[int]:
    """The rendered prompt's token ids: its text's tokens, after one BOS where the tokenizer adds one.

    Llama-2's and Gemma's chat templates render the BOS themselves, Vicuna's and completion prompts do
    not; tokenizing with special tokens would give the first two BOS twice."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [bos]
    return [bos, *ids] if adds_bos and ids[:1] != [bos] else ids


def stop_strings(target: DictConfig) -> list[str]:
    """``target.stop``, else a newline for completion prompts (one line is one translation) and none for chat."""
    if target.stop is not None:
        return list(target.stop)
    return ["\n"] if target.prompt_format == PromptFormat.completion else []


def stop_token_ids(target: DictConfig, tokenizer) -> list[int]:
    """The ids of ``target.stop_tokens``: special tokens that end an answer besides EOS (Gemma's <end_of_turn>)."""
    ids = []
    for token in target.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ConfigError(
                f"target.stop_tokens: '{token}' is not a token of {target.name}'s tokenizer; "
                "use one of its special tokens, e.g. <end_of_turn>"
            )
        ids.append(token_id)
    return ids


def stop_string_token_ids(tokenizer, stop: Sequence[str]) -> list[int]:
    """Every token whose text holds one of the stop strings: sampling one ends the answer where the stop string
    would (a stop string that spans tokens is not among them)."""
    if not stop:
        return []
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [i for i, text in enumerate(texts) if any(s in text for s in stop)]
