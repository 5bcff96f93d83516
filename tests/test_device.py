"""Device hygiene without a GPU, and the eval device setting.

Every tensor the decoding loop, the sampler and the drafters make must live on the models' device. The
models here live on the CPU while the *default* device is ``meta``: a tensor made without an explicit
device is then a meta tensor, and mixing it with the CPU models' tensors fails — what a stray CPU tensor
does next to CUDA models. Timers must wait for the device: ``pipeline.device.synchronize`` is recorded.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from pipeline import device as devices
from pipeline.config import ConfigError, compose_config
from pipeline.device import resolve_device
from pipeline.models.vocab import VocabMap
from pipeline.speculative.engine import (
    CachedModel,
    LookupThenModelDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    StopCondition,
    generate,
    step_costs,
    top2_gap,
)
from pipeline.speculative.metrics import timed
from pipeline.speculative.sampler import Sampling, probabilities, verify, verify_greedy
from tests.helpers import PROMPT, VOCAB, gemma, llama, reduced_copy

NO_STOP = StopCondition(tokenizer=None)


@contextlib.contextmanager
def default_device_meta():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def drafters(target_model):
    vocab_map = VocabMap(torch.tensor(list(range(0, VOCAB, 2))), VOCAB)
    lookup = PromptLookupDrafter(VOCAB)
    return {
        "model": ModelDrafter(llama(1)),
        "reduced_vocab": ModelDrafter(reduced_copy(target_model, vocab_map), vocab_map),
        "confidence_cut": ModelDrafter(llama(1), min_confidence=0.02),
        "lookup": lookup,
        "lookup_then_model": LookupThenModelDrafter(lookup, ModelDrafter(llama(1))),
    }


@pytest.mark.parametrize("make", [llama, gemma])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decoding_makes_every_tensor_on_the_models_device(make, temperature):
    target_model = make(0)
    candidates = drafters(target_model)
    target = CachedModel(target_model)
    reference = generate(target, PROMPT, 12, NO_STOP, Sampling(temperature), generator=torch.Generator().manual_seed(0))
    with default_device_meta():
        assert torch.empty(1).device.type == "meta"  # the trap is set
        generator = torch.Generator(device="cpu").manual_seed(0)
        out = generate(target, PROMPT, 12, NO_STOP, Sampling(temperature), generator=generator)
        assert out.tokens == reference.tokens
        for name, drafter in candidates.items():
            out = generate(
                target,
                PROMPT,
                12,
                NO_STOP,
                Sampling(temperature),
                drafter=drafter,
                k=3,
                generator=torch.Generator(device="cpu").manual_seed(0),
            )
            assert len(out.tokens) == 12 and sum(out.drafted) > 0, name
        costs = step_costs(target, candidates["reduced_vocab"].lm, PROMPT, [1, 3], repetitions=2)
        assert costs["c"] > 0 and set(costs["v"]) == {1, 3}
        assert top2_gap(target_model, PROMPT, reference.tokens[:3]) >= 0


def test_sampler_makes_every_tensor_on_the_inputs_device():
    g = torch.Generator().manual_seed(0)
    target_logits, draft_logits = torch.randn(2, 4, VOCAB, generator=g), torch.randn(2, 3, VOCAB, generator=g)
    drafts = torch.randint(0, VOCAB, (2, 3), generator=g)
    with default_device_meta():
        sampling = Sampling(1.0, top_k=20, top_p=0.9)
        num_accepted, token = verify(
            drafts,
            probabilities(draft_logits, sampling),
            probabilities(target_logits, sampling),
            torch.Generator(device="cpu").manual_seed(0),
        )
        assert num_accepted.device.type == token.device.type == "cpu"
        num_accepted, token = verify_greedy(drafts, target_logits)
        assert token.device.type == "cpu"


def test_timers_wait_for_the_device(monkeypatch):
    """generate, step_costs' forwards and the HF timer read the clock only after synchronizing the device."""
    events = []
    monkeypatch.setattr(devices, "synchronize", lambda device: events.append(("sync", device.type)))
    monkeypatch.setattr(devices.time, "perf_counter", lambda: events.append(("clock",)) or float(len(events)))
    target = CachedModel(llama(0))
    generate(target, PROMPT, 4, NO_STOP)
    assert events == [("sync", "cpu"), ("clock",)] * 2  # at the start and at the end
    events.clear()
    step_costs(target, CachedModel(llama(1)), PROMPT, [2], repetitions=1)
    assert events == [("sync", "cpu"), ("clock",)] * 6  # three timed forwards: target, drafter, verify(K=2)
    events.clear()
    timed(lambda: [1, 2], torch.device("cpu"))
    assert events == [("sync", "cpu"), ("clock",)] * 2


def test_cuda_synchronize_is_what_the_clock_waits_for(monkeypatch):
    called = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: called.append(device))
    devices.clock(torch.device("cuda", 0))
    devices.clock(torch.device("cpu"))
    assert called == [torch.device("cuda", 0)]


def test_device_setting_is_resolved_and_checked(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(
        ConfigError, match=r"eval.device=cuda:1 but torch sees no CUDA device.*use eval.device=auto or cpu"
    ):
        resolve_device("cuda:1")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    try:
        for spec, device in (("auto", torch.device("cuda")), ("cuda:1", torch.device("cuda", 1))):
            torch.backends.cuda.enable_cudnn_sdp(True)
            assert resolve_device(spec) == device
            # cuDNN's attention plans each new length: decoding leaves it (docs/results/2026-11-28-gpu-check-h200.md)
            assert not torch.backends.cuda.cudnn_sdp_enabled(), spec
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    with pytest.raises(ConfigError, match="eval.device=cuda:2 but only 2 CUDA device"):
        resolve_device("cuda:2")
    with pytest.raises(ConfigError, match="eval.device=gpu is not a device; use auto, cpu, cuda or cuda:N"):
        compose_config(["recipe=ci", "eval.device=gpu"])


def test_training_autocasts_only_in_a_half_precision_its_device_multiplies_natively(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))  # a 2-core AMD EPYC's
    assert [devices.autocast_precision(p) for p in ("no", "bf16", "fp16")] == ["no", "no", "no"]
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))  # the Xeon's
    assert [devices.autocast_precision(p) for p in ("no", "bf16", "fp16")] == ["no", "bf16", "no"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for ampere, expected in ((True, ["no", "bf16", "fp16"]), (False, ["no", "no", "fp16"])):  # an A100, a V100
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, a=ampere: a)
        assert [devices.autocast_precision(p) for p in ("no", "bf16", "fp16")] == expected


def test_a_slurm_job_whose_torch_cannot_see_its_gpus_is_refused_in_one_line(monkeypatch):
    job = {"SLURM_JOB_ID": "7"}
    devices.check_slurm_gpus({})  # not a Slurm job: nothing to compare
    devices.check_slurm_gpus(job)  # a CPU job
    assert devices.slurm_gpus(job | {"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert devices.slurm_gpus(job | {"SLURM_JOB_GPUS": "0,1,2,3"}) == 4
    assert devices.slurm_gpus({"SLURM_GPUS_ON_NODE": "8"}) == 0  # a leftover variable outside a job

    monkeypatch.setattr(torch.version, "cuda", None)  # this venv's CPU build, as make install picks on a login node
    with pytest.raises(
        ConfigError,
        match=r"^Slurm gave this job 8 GPU\(s\) but the venv's torch .* is a CPU build .*"
        r"make install EXTRAS=gpu,dev$",
    ):
        devices.check_slurm_gpus(job | {"SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    devices.check_slurm_gpus(job | {"SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": ""})  # hidden on purpose

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a driver too old for the build
    with pytest.raises(
        ConfigError,
        match=r"^Slurm gave this job 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\) but torch .* "
        r"sees 0: .*CUDA 12.8.*make install EXTRAS=gpu,dev$",
    ):
        devices.check_slurm_gpus(job | {"SLURM_JOB_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    devices.check_slurm_gpus(job | {"SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "3"})  # one per eval worker
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    devices.check_slurm_gpus(job | {"SLURM_GPUS_ON_NODE": "8"})


def test_every_stage_checks_the_gpus_slurm_gave_it_before_any_work(monkeypatch, capsys, tmp_path):
    from pipeline.cli import main as cli

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    for stage in ("distill", "pretrain", "finetune", "eval"):
        assert cli([stage, "recipe=ci", f"paths.runs_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: Slurm gave this job 8 GPU(s)") and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())  # no stage directory begun
