"""Asynchronous requests to an OpenAI-compatible endpoint (vLLM's, ours or an external one).

Every request goes to the completions API as token ids (``prompts.prompt_ids``: the chat template is
rendered here, with one BOS), so the target sees exactly the tokens finetuning and evaluation use; a chat
API would render and tokenize again by the server's own rules (vLLM's adds no BOS to Vicuna's template).
Sampling is explicit in every request: temperature, top_p and top_k of the eval, no repetition penalty,
so a model's ``generation_config`` (Llama-2-chat: top_p 0.9) cannot change what is distilled.

The ``openai`` client does the retrying: connection errors, timeouts, 408/409/429 and 5xx are retried
``max_retries`` times with exponential backoff (0.5 s doubling to 8 s, with jitter).

A request in flight holds a connection, which is an open file: ``raise_open_file_limit`` lifts the soft limit to
the hard one, and ``connections_per_process`` says how many a process may hold. One process holds at most
``REQUESTS_PER_PROCESS``; more requests in flight go through ``pipeline.serving.relay``'s client processes.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import openai

try:  # the HTTP library under openai: its fork httpx2 from openai 3, httpx before
    import httpx2 as http
except ImportError:
    import httpx as http

from pipeline.errors import ServingError
from pipeline.serving.server import Endpoint

# Requests one process keeps in flight at most. Its CPU time per request grows with its connections (httpcore's
# pool looks at each of them for every request): 3.0 ms at 32, 4.4 ms at 256, 10.1 ms at 1,024 (a shared 2-core
# AMD EPYC; docs/paper-recipes.md), and one process falls short of the ~1k requests/s of one 8-GPU node.
REQUESTS_PER_PROCESS = 256
# Open files a process needs besides its connections: measured 41 in a vLLM API server, ~30 in the stage.
FD_RESERVE = 128


@dataclass
class Completion:
    text: str
    finish_reason: str  # stop | length
    # the matched stop string, or stop token id (target.stop_tokens); None at EOS (or when out of tokens)
    stop_reason: str | int | None
    prompt_tokens: int
    completion_tokens: int
    top_logprobs: list[dict[str, float]] | None
    prompt_token_ids: list[int] | None  # as the server saw them (vLLM reports them; another endpoint may not)
    token_ids: list[int] | None  # the generated ids, the stop token or EOS included
    # vLLM's per-request speculative-decoding metrics (--per-request-spec-decode-metrics; None where it sent none)
    spec_decode: dict | None = None


class RelayedError(Exception):
    """A request that failed in a client process (``pipeline.serving.relay``), with the cause named there."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


def failure_cause(exc: Exception) -> str:
    if isinstance(exc, RelayedError):
        return exc.cause
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    return type(exc).__name__


def is_transient(cause: str) -> bool:
    """Worth retrying on a rerun (the server was down or overloaded, a client process died), unlike a rejected
    request."""
    return cause in ("timeout", "connection", "client_process", "http_408", "http_409", "http_429") or (
        cause.startswith("http_5")
    )


def raise_open_file_limit() -> int:
    """Lifts this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit, which the processes it
    starts inherit (vLLM's servers, client processes), and returns it. Clusters often leave the soft limit at
    1,024 (Slurm passes on the login shell's), below one connection per request in flight."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # Linux caps the hard one (fs.nr_open): never infinite
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def connections_per_process(open_files: int) -> int:
    """The connections (requests in flight) one process holds at most under a limit of ``open_files``."""
    return max(min(REQUESTS_PER_PROCESS, open_files - FD_RESERVE), 1)


class TargetClient:
    """Sends one request of the target's prompt ids with the eval's sampling and returns its completion."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        stop: list[str],
        stop_token_ids: list[int],
        max_tokens: int,
        top_p: float,
        top_k: int,
        top_logprobs: int,
        timeout_s: float,
        max_retries: int,
        model: str,
        connections: int,
    ):
        # a connection per request in flight: openai's default pool (1000) would hold back 8 replicas x 256, and a
        # request waiting for a connection counts against its timeout
        pool = http.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = openai.AsyncOpenAI(
            base_url=endpoint.url,
            api_key=endpoint.api_key,
            timeout=timeout_s,
            max_retries=max_retries,
            http_client=openai.DefaultAsyncHttpxClient(limits=pool),
        )
        self.stop, self.stop_token_ids = stop or None, stop_token_ids
        self.max_tokens, self.top_p, self.top_k, self.top_logprobs = max_tokens, top_p, top_k, top_logprobs
        self.model = model

    async def resolve_model(self) -> str:
        """The served model name: the target's name, or the endpoint's only model (external servers)."""
        try:
            served = [m.id async for m in self.client.models.list()]
        except openai.APIError as exc:
            raise ServingError(
                f"endpoint {self.client.base_url} does not answer ({failure_cause(exc)}): {exc}"
            ) from exc
        if self.model not in served:
            if len(served) != 1:
                raise ServingError(f"endpoint {self.client.base_url} serves {served}, not {self.model}")
            self.model = served[0]
        return self.model

    async def complete(self, prompt_ids: list[int], temperature: float, seed: int) -> Completion:
        body = dict(
            model=self.model,
            prompt=prompt_ids,
            temperature=temperature,
            top_p=self.top_p,
            seed=seed,
            max_tokens=self.max_tokens,
            stop=self.stop,
            top_k=self.top_k,
            min_p=0.0,
            repetition_penalty=1.0,
            stop_token_ids=self.stop_token_ids,
            return_token_ids=True,
        )
        if self.top_logprobs:
            body["logprobs"] = self.top_logprobs
        # the body as JSON, as it is: completions.create would first walk the prompt's ids one by one against its
        # type hints, which more than doubled the client's CPU time per request (6.9 ms -> 3.0 ms at 32 in flight)
        response = await self.client.post("/completions", cast_to=dict, body=body)
        choice = response["choices"][0]
        return Completion(
            text=choice["text"],
            finish_reason=choice["finish_reason"],
            stop_reason=choice.get("stop_reason"),
            prompt_tokens=response["usage"]["prompt_tokens"],
            completion_tokens=response["usage"]["completion_tokens"],
            top_logprobs=choice["logprobs"]["top_logprobs"] if self.top_logprobs else None,
            prompt_token_ids=choice.get("prompt_token_ids"),
            token_ids=choice.get("token_ids"),
            spec_decode=(response.get("metrics") or {}).get("speculative_decoding"),
        )

    async def close(self) -> None:
        await self.client.close()
