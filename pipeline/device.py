"""The one device decoding runs on (``eval.device``), and a clock that is right on it.

CUDA kernels run asynchronously: ``time.perf_counter()`` read right after a forward measures the kernel
launches, not the work. ``clock(device)`` waits for the device's queued work before reading the time, so
every timer of the engine, the eval stage and the benchmarks measures what a user waits for. On the CPU
it is ``perf_counter`` alone.
"""

from __future__ import annotations

import time

import torch

from pipeline.config import DEVICE_SPEC, ConfigError


def resolve_device(spec: str, key: str = "eval.device") -> torch.device:
    """``auto`` (CUDA when one is visible, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; one-line errors."""
    if not DEVICE_SPEC.fullmatch(spec):
        raise ConfigError(f"{key}={spec} is not a device; use auto, cpu, cuda or cuda:N")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}={spec} but torch sees no CUDA device (torch {torch.__version__}): "
                              f"use {key}=auto or cpu, or install a CUDA build (make install EXTRAS=gpu,dev)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{key}={spec} but only {torch.cuda.device_count()} CUDA device(s) are visible")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """``perf_counter`` once ``device`` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()
