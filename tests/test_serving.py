"""vLLM server lifecycle: bad model folders fail before launching, start-up deaths name the cause,
and the shared session server answers the target's prompt format."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import replace

import pytest

from pipeline import device as devices
from pipeline.config import REPO_ROOT, compose_config
from pipeline.errors import ModelNotFoundError, ServingError
from pipeline.serving.client import TargetClient, failure_cause, is_transient
from pipeline.serving.relay import ClientProcesses
from pipeline.serving.server import VLLMServer, data_parallel_size, served_dtype, target_server
from pipeline.stages.distill import fan_out
from tests.helpers import command_lines

pytestmark = pytest.mark.starts_vllm

CACHE = REPO_ROOT / "runs" / "cache"


def distill_cli(tmp_path, *overrides):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "distill",
            "recipe=ci",
            f"paths.runs_dir={tmp_path / 'runs'}",
            f"paths.cache_dir={CACHE}",
            f"paths.models_dir={REPO_ROOT / 'models'}",
            *overrides,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
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


def test_one_replica_per_visible_gpu_and_the_eval_dtype_by_default(monkeypatch):
    """data_parallel=auto is the visible GPUs in replicas of tensor_parallel (1 on this CPU), and the target is
    served in target.dtype unless distill.server.dtype says otherwise: Vicuna ships float16, its recipe's eval
    measures bfloat16, so it is distilled in bfloat16 (in float32 where a CPU without bfloat16 instructions serves
    it)."""
    import torch

    cfg = compose_config(["recipe=paper-vicuna"])
    assert cfg.distill.server.data_parallel == "auto" and data_parallel_size(cfg.distill.server) == 1
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))  # the Xeon's
    assert served_dtype(cfg) == cfg.target.dtype == "bfloat16"
    assert served_dtype(compose_config(["recipe=ci"])) == "float32"  # ci's target, as its eval decodes it
    # a CPU without bfloat16 instructions (the EPYC's): vLLM would emulate it, 5x slower (docs/design.md)
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert served_dtype(cfg) == "float32" and served_dtype(compose_config(["recipe=local"])) == "float32"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a GPU serves what the config asks
    assert served_dtype(cfg) == "bfloat16"
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for tensor_parallel, replicas in ((1, 8), (2, 4), (3, 2)):
        launch = compose_config(
            ["recipe=paper-vicuna", f"distill.server.tensor_parallel={tensor_parallel}"]
        ).distill.server
        assert data_parallel_size(launch) == replicas
    assert (
        data_parallel_size(compose_config(["recipe=paper-vicuna", "distill.server.data_parallel=3"]).distill.server)
        == 3
    )


def test_the_server_of_one_8_gpu_node_has_an_api_server_per_gpu(monkeypatch, tmp_path):
    """The paper recipe on an 8-GPU node: `vllm serve` (the launcher runs vLLM's own serve command, which the CPU
    build's `vllm` cannot) with 8 data-parallel replicas behind 8 API-server processes, as vLLM 0.32's own parser
    reads the command line; one API process would feed all 8 engines otherwise."""
    import torch
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    cfg = compose_config(["recipe=paper-vicuna"])
    fan = fan_out(cfg, 65536)
    server = target_server(cfg, "/models/vicuna-7b", tmp_path, replicas=fan.replicas, api_servers=fan.api_servers)
    command = server.command(8000)
    assert command[1:3] == ["-m", "pipeline.serving.vllm_serve"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])
    assert (args.data_parallel_size, args.api_server_count, args.tensor_parallel_size) == (8, 8, 1)
    assert (args.model, args.port, args.dtype, args.enforce_eager) == ("/models/vicuna-7b", 8000, "bfloat16", False)


def test_transient_causes_are_those_a_rerun_can_fix():
    assert all(map(is_transient, ["connection", "timeout", "http_500", "http_503", "http_429", "client_process"]))
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


def test_vllm_cache_root_of_the_environment_wins_over_the_cache_dir(tmp_path, monkeypatch):
    """vLLM's own variable where it is set, else paths.cache_dir/vllm: tests/conftest.py gives every test's server
    one root, where vLLM keeps what it learnt of a model class instead of inspecting it again in a new process."""
    launched = []

    def popen(command, env, **kwargs):
        launched.append(env["VLLM_CACHE_ROOT"])
        raise InterruptedError  # no server: only its environment is under test

    monkeypatch.setattr(subprocess, "Popen", popen)
    (tmp_path / "logs").mkdir()
    server = VLLMServer(str(tmp_path), "model", tmp_path / "logs", tmp_path / "cache" / "vllm")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "shared"))
    with pytest.raises(InterruptedError):
        server._launch(8000)
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    with pytest.raises(InterruptedError):
        server._launch(8000)
    assert launched == [str(tmp_path / "shared"), str(tmp_path / "cache" / "vllm")]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["ci", "local"])
def test_client_sends_the_prompt_ids_with_explicit_sampling(vllm_server, smollm_path, recipe):
    """Chat and completion prompts alike reach the server as our token ids; it reports the same ids back,
    the generated ids end with the stop (EOS here) and T=0 repeats."""
    from pipeline.models.provision import load_tokenizer
    from pipeline.prompts import build_prompt, prompt_ids, stop_strings

    cfg = compose_config([f"recipe={recipe}"])
    tokenizer = load_tokenizer(smollm_path)
    ids = prompt_ids(build_prompt(cfg.target, cfg.lang, "Guten Morgen!", tokenizer), tokenizer)
    client = TargetClient(
        vllm_server.endpoint,
        stop=stop_strings(cfg.target),
        stop_token_ids=[],
        max_tokens=16,
        top_p=0.5,
        top_k=5,
        top_logprobs=3,
        timeout_s=60,
        max_retries=1,
        model="smollm2-135m",
        connections=1,
    )

    async def ask():
        try:
            return [await client.complete(ids, 0.0, seed=1) for _ in range(2)]
        finally:
            await client.close()

    first, second = asyncio.run(ask())
    assert first == second  # T=0
    assert first.prompt_token_ids == ids and first.prompt_tokens == len(ids)
    assert len(first.token_ids) == first.completion_tokens and tokenizer.decode(first.token_ids).startswith(first.text)
    assert 0 < len(first.top_logprobs) <= first.completion_tokens
    assert all(len(alternatives) <= 3 for alternatives in first.top_logprobs)
    if first.finish_reason == "stop" and first.stop_reason is None:
        assert first.token_ids[-1] == tokenizer.eos_token_id
    if recipe == "local":  # a completion prompt for this chat model: it goes on past the first line
        assert first.finish_reason == "stop" and first.stop_reason == "\n" and "\n" not in first.text, first


@pytest.mark.slow
def test_a_stop_token_ends_the_answer_and_finetuning_trains_on_it(vllm_server, smollm_path):
    """target.stop_tokens (Gemma's <end_of_turn>) reach vLLM as stop_token_ids; the record's ids end with the
    token, and a record without ids (another endpoint) gets it back from its stop_reason."""
    from pipeline.models.provision import load_tokenizer
    from pipeline.prompts import IGNORE, build_prompt, prompt_ids
    from pipeline.training.data import record_example

    cfg = compose_config(["recipe=ci"])
    tokenizer = load_tokenizer(smollm_path)
    prompt = build_prompt(cfg.target, cfg.lang, "Guten Morgen!", tokenizer)
    ids = prompt_ids(prompt, tokenizer)

    def ask(stop_token_ids):
        client = TargetClient(
            vllm_server.endpoint,
            stop=[],
            stop_token_ids=stop_token_ids,
            max_tokens=8,
            top_p=1.0,
            top_k=0,
            top_logprobs=0,
            timeout_s=60,
            max_retries=1,
            model="smollm2-135m",
            connections=1,
        )

        async def one():
            try:
                return await client.complete(ids, 0.0, seed=1)
            finally:
                await client.close()

        return asyncio.run(one())

    free = ask([])
    stop_id = free.token_ids[1]
    stopped = ask([stop_id])
    assert (stopped.finish_reason, stopped.stop_reason, stopped.token_ids) == ("stop", stop_id, free.token_ids[:2])
    record = {
        "prompt": prompt,
        "response": stopped.text,
        "finish_reason": "stop",
        "stop_reason": stopped.stop_reason,
        "prompt_token_ids": stopped.prompt_token_ids,
        "token_ids": stopped.token_ids,
    }
    served = record_example(record, tokenizer, 4096)
    assert served["input_ids"] == ids + free.token_ids[:2] and served["labels"][len(ids) - 1] == IGNORE
    without_ids = record_example({k: v for k, v in record.items() if not k.endswith("token_ids")}, tokenizer, 4096)
    assert without_ids["input_ids"][-1] == stop_id and without_ids["input_ids"][: len(ids)] == ids


def test_the_key_is_in_no_command_line_and_the_server_requires_it(vllm_server):
    """Every user of a node can read /proc/PID/cmdline: the key goes to vLLM through its environment only."""
    import urllib.error
    import urllib.request

    key = vllm_server.endpoint.api_key.encode()
    lines = command_lines()
    assert any(b"pipeline.serving.vllm_serve" in line for line in lines)
    assert not [line for line in lines if key in line]
    models = f"{vllm_server.endpoint.url}/models"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(models, timeout=10)
    assert refused.value.code == 401
    request = urllib.request.Request(models, headers={"Authorization": f"Bearer {vllm_server.endpoint.api_key}"})
    assert urllib.request.urlopen(request, timeout=10).status == 200


@pytest.mark.slow
def test_client_processes_answer_as_the_client_does_and_a_dead_one_fails_its_requests(vllm_server, smollm_path):
    """ClientProcesses (more requests in flight than one process serves well) answers as TargetClient, with the
    API key in no command line; a client process that dies fails the requests in it, and those sent to it after,
    with a cause a rerun retries."""
    from pipeline.models.provision import load_tokenizer
    from pipeline.prompts import build_prompt, prompt_ids

    cfg = compose_config(["recipe=ci"])
    tokenizer = load_tokenizer(smollm_path)
    ids = prompt_ids(build_prompt(cfg.target, cfg.lang, "Guten Morgen!", tokenizer), tokenizer)
    settings = dict(
        stop=["\n"],
        stop_token_ids=[],
        max_tokens=8,
        top_p=1.0,
        top_k=0,
        top_logprobs=2,
        timeout_s=60,
        max_retries=0,
        model="smollm2-135m",
        connections=2,
    )

    async def ask():
        direct = TargetClient(vllm_server.endpoint, **settings)
        relayed = ClientProcesses(2, vllm_server.endpoint, settings)
        try:
            assert await relayed.resolve_model() == "smollm2-135m"
            expected = await direct.complete(ids, 0.0, seed=1)
            answers = await asyncio.gather(*(relayed.complete(ids, 0.0, seed=1) for _ in range(4)))
            key = vllm_server.endpoint.api_key.encode()
            assert not [line for line in command_lines() if key in line]
            dying, request = relayed.processes[0], {"prompt_ids": ids, "temperature": 0.0, "seed": 1}
            in_flight = asyncio.create_task(dying.ask(request))
            await asyncio.sleep(0)  # sent
            dying.process.kill()
            failures = await asyncio.gather(in_flight, dying.ask(request), return_exceptions=True)
            return expected, answers, failures
        finally:
            await direct.close()
            await relayed.close()

    expected, answers, failures = asyncio.run(ask())
    # the same tokens and text; the logprobs to float32's rounding: four requests at once are one batch, whose
    # matrix shapes round the last bits unlike the direct request's alone (4e-6 apart once, beside another worker)
    assert [replace(a, top_logprobs=None) for a in answers] == [replace(expected, top_logprobs=None)] * 4
    assert expected.top_logprobs and all(
        [list(top) for top in a.top_logprobs] == [list(top) for top in expected.top_logprobs]
        and [list(top.values()) for top in a.top_logprobs]
        == [pytest.approx(list(top.values()), abs=1e-4) for top in expected.top_logprobs]
        for a in answers
    )
    assert [failure_cause(exc) for exc in failures] == ["client_process"] * 2
