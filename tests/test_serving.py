"""vLLM server lifecycle: bad model folders fail before launching, start-up deaths name the cause,
and the shared session server answers the target's prompt format."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from pipeline.config import REPO_ROOT, compose_config
from pipeline.models.provision import ModelNotFoundError
from pipeline.serving.client import TargetClient, is_transient
from pipeline.serving.server import ServingError, VLLMServer

CACHE = REPO_ROOT / "runs" / "cache"


def distill_cli(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "distill", "recipe=ci", f"paths.runs_dir={tmp_path / 'runs'}",
         f"paths.cache_dir={CACHE}", f"paths.models_dir={REPO_ROOT / 'models'}", *overrides],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("make_folder", [False, True], ids=["missing", "no-config-json"])
def test_bad_model_path_is_a_one_line_error_before_vllm_starts(tmp_path, make_folder):
    folder = tmp_path / "not-a-model"
    if make_folder:
        folder.mkdir()
    result = distill_cli(tmp_path, "target.source=local", f"target.path={folder}")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert str(folder) in result.stderr
    assert not list(tmp_path.rglob("vllm.log"))  # vLLM was never launched


def test_server_refuses_a_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        VLLMServer(str(tmp_path), "x", tmp_path / "logs", tmp_path / "cache").start()


def test_transient_causes_are_those_a_rerun_can_fix():
    assert all(map(is_transient, ["connection", "timeout", "http_500", "http_503", "http_429"]))
    assert not any(map(is_transient, ["http_400", "http_401", "http_404", "ValueError"]))


@pytest.mark.slow
def test_death_during_startup_reports_the_log_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    server = VLLMServer(str(tmp_path), "broken", tmp_path / "logs", CACHE / "vllm", startup_timeout_s=300)
    with pytest.raises(ServingError, match=r"vLLM exited with code \d+ during start-up: .*full log: ") as info:
        with server:
            pass
    assert "\n" not in str(info.value)
    assert server.process is None  # torn down


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["ci", "local"])
def test_client_speaks_the_target_prompt_format(vllm_server, smollm_path, recipe):
    """Chat targets go through the chat API, base targets through completions with the newline stop."""
    from pipeline.models.provision import load_tokenizer

    cfg = compose_config([f"recipe={recipe}"])
    cfg.target.name = "smollm2-135m"  # the shared server's model; only the prompt format differs
    client = TargetClient(vllm_server.endpoint, cfg.target, max_tokens=16, top_logprobs=3, timeout_s=60, max_retries=1)
    prompt = "Translate German to English: Guten Morgen!\nEnglish:"
    messages = [{"role": "user", "content": "Translate German to English: Guten Morgen!"}]

    async def ask():
        try:
            return [await client.complete(prompt, messages, 0.0, seed=1) for _ in range(2)]
        finally:
            await client.close()

    first, second = asyncio.run(ask())
    assert first == second  # T=0
    # What the server was given, by its length in tokens: the chat template around the message, or the bare prompt.
    tokenizer = load_tokenizer(smollm_path)
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    lengths = {"ci": len(tokenizer(chat, add_special_tokens=False).input_ids),
               "local": len(tokenizer(prompt).input_ids)}
    assert lengths["ci"] > lengths["local"] + 10, lengths  # the two can be told apart
    assert first.prompt_tokens == lengths[recipe], (lengths, first.prompt_tokens)
    assert 0 < len(first.top_logprobs) <= first.completion_tokens
    assert all(len(alternatives) <= 3 for alternatives in first.top_logprobs)
    if recipe == "local":
        assert first.finish_reason == "stop" and first.stop_reason == "\n" and "\n" not in first.text, first


@pytest.mark.slow
def test_chat_api_sees_exactly_the_recorded_prompt(vllm_server, smollm_path):
    """The record's prompt (build_prompt) is token for token what the server rendered from the chat messages."""
    import openai

    from pipeline.models.provision import load_tokenizer
    from pipeline.prompts import build_prompt, chat_messages

    cfg = compose_config(["recipe=ci"])
    tokenizer = load_tokenizer(smollm_path)
    text = "Guten Morgen, wie geht es dir?"
    client = openai.OpenAI(base_url=vllm_server.endpoint.url, api_key=vllm_server.endpoint.api_key)
    response = client.chat.completions.create(
        model="smollm2-135m", messages=chat_messages(cfg.target, cfg.lang, text), max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    seen = response.model_extra["prompt_token_ids"]
    expected = tokenizer(build_prompt(cfg.target, cfg.lang, text, tokenizer), add_special_tokens=False)["input_ids"]
    assert seen == expected
