"""Asynchronous requests to an OpenAI-compatible endpoint (vLLM's, ours or an external one).

The ``openai`` client does the retrying: connection errors, timeouts, 408/409/429 and 5xx are retried
``max_retries`` times with exponential backoff (0.5 s doubling to 8 s, with jitter). Base models get
the completions API with the completion-format prompt; chat models the chat API (the server applies
the chat template: ``target.chat_template``, given to the server at launch, when the model ships none).
"""

from __future__ import annotations

from dataclasses import dataclass

import openai
from omegaconf import DictConfig

from pipeline.config import PromptFormat
from pipeline.serving.server import Endpoint, ServingError


@dataclass
class Completion:
    text: str
    finish_reason: str  # stop | length
    stop_reason: str | None  # the matched stop string; None when the model emitted EOS (or ran out of tokens)
    prompt_tokens: int
    completion_tokens: int
    top_logprobs: list[dict[str, float]] | None


def failure_cause(exc: Exception) -> str:
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    return type(exc).__name__


def is_transient(cause: str) -> bool:
    """Worth retrying on a rerun (the server was down or overloaded), unlike a rejected request."""
    return cause in ("timeout", "connection", "http_408", "http_409", "http_429") or cause.startswith("http_5")


class TargetClient:
    """Sends one translation request of the target's prompt format and returns its completion."""

    def __init__(self, endpoint: Endpoint, target: DictConfig, *, max_tokens: int, top_logprobs: int,
                 timeout_s: float, max_retries: int):
        self.client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=endpoint.api_key,
                                         timeout=timeout_s, max_retries=max_retries)
        self.chat = target.prompt_format == PromptFormat.chat
        self.stop = list(target.stop) or None
        self.max_tokens, self.top_logprobs = max_tokens, top_logprobs
        self.model = target.name

    async def resolve_model(self) -> str:
        """The served model name: the target's name, or the endpoint's only model (external servers)."""
        try:
            served = [m.id async for m in self.client.models.list()]
        except openai.APIError as exc:
            raise ServingError(f"endpoint {self.client.base_url} does not answer ({failure_cause(exc)}): {exc}") from exc
        if self.model not in served:
            if len(served) != 1:
                raise ServingError(f"endpoint {self.client.base_url} serves {served}, not {self.model}")
            self.model = served[0]
        return self.model

    async def complete(self, prompt: str, messages: list[dict] | None, temperature: float, seed: int) -> Completion:
        common = dict(model=self.model, temperature=temperature, seed=seed, max_tokens=self.max_tokens, stop=self.stop)
        if self.chat:
            logprobs = dict(logprobs=True, top_logprobs=self.top_logprobs) if self.top_logprobs else {}
            response = await self.client.chat.completions.create(messages=messages, **logprobs, **common)
            choice = response.choices[0]
            text = choice.message.content or ""
            top = ([{alt.token: alt.logprob for alt in token.top_logprobs} for token in choice.logprobs.content]
                   if self.top_logprobs else None)
        else:
            logprobs = dict(logprobs=self.top_logprobs) if self.top_logprobs else {}
            response = await self.client.completions.create(prompt=prompt, **logprobs, **common)
            choice = response.choices[0]
            text = choice.text
            top = choice.logprobs.top_logprobs if self.top_logprobs else None
        stop_reason = (choice.model_extra or {}).get("stop_reason")
        return Completion(
            text=text,
            finish_reason=choice.finish_reason,
            stop_reason=stop_reason if isinstance(stop_reason, str) else None,  # an int: a stop token id
            prompt_tokens=response.usage.prompt_tokens,
            completion_tokens=response.usage.completion_tokens,
            top_logprobs=top,
        )

    async def close(self) -> None:
        await self.client.close()
