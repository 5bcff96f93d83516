"""The one device decoding runs on (``eval.device``), and a clock that is right on it.

CUDA kernels run asynchronously: ``time.perf_counter()`` read right after a forward measures the kernel
launches, not the work. ``clock(device)`` waits for the device's queued work before reading the time, so
every timer of the engine, the eval stage and the benchmarks measures what a user waits for. On the CPU
it is ``perf_counter`` alone.

``half_precision_dtypes(device)`` names the half-precision dtypes the device computes natively, the
candidates the eval stage may decode in (pipeline/speculative/costs.py); ``autocast_precision(requested)``
is the training step's autocast by the same rule.

On CUDA, ``resolve_device`` also turns off cuDNN's attention for the process (``decode_without_cudnn_attention``):
its per-length plans would charge a decode's first pass over each length.

``check_slurm_gpus()`` refuses, in one line, a Slurm job whose torch cannot see the GPUs Slurm gave it
(a CPU build installed on a login node without nvidia-smi, or a driver the build cannot use): every
stage calls it before any work instead of training or decoding a 7B model on the CPU.
"""

from __future__ import annotations

import os
import platform
import time
from functools import cache

import torch

from pipeline.config import DEVICE_SPEC, ConfigError


def resolve_device(spec: str, key: str = "eval.device") -> torch.device:
    """``auto`` (CUDA when one is visible, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; one-line errors."""
    if not DEVICE_SPEC.fullmatch(spec):
        raise ConfigError(f"{key}={spec} is not a device; use auto, cpu, cuda or cuda:N")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec)
    if device.type == "cuda" and spec != "auto":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{key}={spec} but torch sees no CUDA device (torch {torch.__version__}): "
                f"use {key}=auto or cpu, or install a CUDA build (make install EXTRAS=gpu,dev)"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{key}={spec} but only {torch.cuda.device_count()} CUDA device(s) are visible")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        decode_without_cudnn_attention()
    return device


def decode_without_cudnn_attention() -> None:
    """Keep this process's attention off cuDNN's backend: it builds an execution plan for each new (query, key)
    length, and a decode meets a new key length every token. On an H200 (torch 2.11) a target-only decode took
    86-104 ms a token over lengths it had not met and 27-34 ms over them again; with cuDNN's backend off, 30-35 ms
    either way (docs/results/2026-11-28-gpu-check-h200.md): the first method an eval decodes would pay for every
    other. Flash and memory-efficient attention build no plans. Training's fixed shapes keep cuDNN (its own
    processes never resolve a decoding device)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def slurm_gpus(env: dict[str, str] = os.environ) -> int:
    """The GPUs Slurm gave this job on this node; 0 outside a Slurm job or in one without GPUs."""
    if "SLURM_JOB_ID" not in env:
        return 0
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    ids = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS") or ""
    return len([gpu for gpu in ids.split(",") if gpu.strip()])


def check_slurm_gpus(env: dict[str, str] = os.environ) -> None:
    """ConfigError, naming the fix, when torch sees fewer GPUs than Slurm gave this job (and lets it see:
    CUDA_VISIBLE_DEVICES, where set, may narrow them on purpose)."""
    given = slurm_gpus(env)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    expected = given if visible is None else min(given, len([gpu for gpu in visible.split(",") if gpu.strip()]))
    if not expected:
        return
    fix = "rebuild the venv for GPUs: rm -rf .venv && make install EXTRAS=gpu,dev"
    if torch.version.cuda is None:
        raise ConfigError(
            f"Slurm gave this job {given} GPU(s) but the venv's torch {torch.__version__} is a CPU build "
            f"(make install chose it where nvidia-smi found no GPU): {fix}"
        )
    if (seen := torch.cuda.device_count()) < expected:
        shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible})"
        raise ConfigError(
            f"Slurm gave this job {given} GPU(s){shown} but torch {torch.__version__} sees {seen}: check nvidia-smi "
            f"and that the driver supports CUDA {torch.version.cuda}, or {fix}"
        )


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """``perf_counter`` once ``device`` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            return frozenset(next(line for line in info if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line for line in info if line.startswith("model name")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


# CPU flags of native half-precision matrix instructions (oneDNN runs bf16 without them too, emulated and slow)
NATIVE_CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def half_precision_dtypes(device: torch.device) -> list[str]:
    """The half-precision dtypes ``device`` multiplies natively: on CUDA float16, and bfloat16 from Ampere on;
    on an x86 CPU those its flags name (AVX512-BF16/AMX for bfloat16, AVX512-FP16/AMX-FP16 for float16)."""
    if device.type == "cuda":
        return (["bfloat16"] if torch.cuda.is_bf16_supported(including_emulation=False) else []) + ["float16"]
    return [dtype for dtype, flags in NATIVE_CPU_FLAGS.items() if cpu_flags() & set(flags)]


def emulated(dtype: str, device: torch.device) -> bool:
    """Whether ``dtype`` is a half precision ``device`` does not multiply natively: torch and vLLM's CPU build then
    emulate it, several times slower than float32."""
    return dtype in NATIVE_CPU_FLAGS and dtype not in half_precision_dtypes(device)


AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def autocast_precision(requested: str) -> str:
    """The training step's autocast (accelerate's ``mixed_precision``) for ``train.<stage>.mixed_precision``: the
    requested half precision where the device training runs on (CUDA when visible, else the CPU) multiplies it
    natively, else ``no``: float32, because autocast then emulates it (a bf16 step of a 2-core AMD EPYC without
    AVX512-BF16 took 14x the float32 step)."""
    dtype = AUTOCAST_DTYPES.get(requested)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return requested if dtype is None or not emulated(dtype, device) else "no"


def relevant_cpu_flags() -> list[str]:
    """The flags that decide the CPU's matrix speed, for reports: AVX2/AVX-512 and the half-precision ones."""
    wanted = {"avx2", "avx512f", *(f for flags in NATIVE_CPU_FLAGS.values() for f in flags)}
    return sorted(cpu_flags() & wanted)
