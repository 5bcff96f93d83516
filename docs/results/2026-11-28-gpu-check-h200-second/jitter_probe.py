"""Probe (H200, 2026-11-28, second GPU session): gpu-check's costs part measured the 7B target's step at ~20 ms in
some rows and ~35 ms in others of the same run. Host-bound (kernel launches) or GPU-bound? Per step: the host's
time to issue one cached single-token forward (before any sync), the GPU's time for it (CUDA events), the synced
wall time; 30 forwards queued without syncs; and step_costs repeated."""

import os
import statistics
import sys
import time

import torch

from pipeline.device import resolve_device
from pipeline.gpu_check.models import SHAPES, last_token_pair, prompt_ids
from pipeline.speculative.engine import CachedModel, step_costs

dev = resolve_device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
shapes = SHAPES["real"] if dev.type == "cuda" else SHAPES["tiny"]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
print(
    "cpus",
    os.cpu_count(),
    "affinity",
    len(os.sched_getaffinity(0)),
    "load",
    os.getloadavg(),
    "threads",
    torch.get_num_threads(),
    flush=True,
)
target, drafter, _ = last_token_pair(shapes, dev, torch.bfloat16)
tm = CachedModel(target)
ids = prompt_ids(shapes, shapes.contexts[0], dev)


def clock_mhz():
    try:
        return torch.cuda.clock_rate(dev)
    except Exception as exc:  # noqa: BLE001
        return f"n/a ({type(exc).__name__})"


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def q(xs):
    xs = sorted(xs)
    p10, p50, p90 = xs[len(xs) // 10], statistics.median(xs), xs[len(xs) * 9 // 10]
    return f"p10 {p10:6.2f} p50 {p50:6.2f} p90 {p90:6.2f} max {xs[-1]:6.2f}"


token = ids[:, -1:]
with torch.inference_mode():
    tm.reset()
    tm.forward(ids, keep=1)
    base = ids.shape[1]
    for rnd in range(3):
        issue, gpu, wall, cpu = [], [], [], []
        for i in range(steps):
            tm.rollback(base)
            sync()
            e0 = torch.cuda.Event(enable_timing=True) if dev.type == "cuda" else None
            e1 = torch.cuda.Event(enable_timing=True) if dev.type == "cuda" else None
            c0, t0 = time.process_time(), time.perf_counter()
            if e0:
                e0.record()
            tm.forward(token, keep=1)
            if e1:
                e1.record()
            t1 = time.perf_counter()
            sync()
            t2, c1 = time.perf_counter(), time.process_time()
            issue.append((t1 - t0) * 1000)
            wall.append((t2 - t0) * 1000)
            cpu.append((c1 - c0) * 1000)
            if e0:
                gpu.append(e0.elapsed_time(e1))
        print(f"round {rnd}: clock {clock_mhz()} MHz, load {os.getloadavg()[0]:.2f}", flush=True)
        print(f"  host issue ms  {q(issue)}", flush=True)
        print(f"  host cpu ms    {q(cpu)}", flush=True)
        if gpu:
            print(f"  gpu events ms  {q(gpu)}", flush=True)
        print(f"  synced wall ms {q(wall)}", flush=True)
        print(f"  first 40 walls {[round(x, 1) for x in wall[:40]]}", flush=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(30):
            tm.rollback(base)
            tm.forward(token, keep=1)
        sync()
        print(f"  30 queued forwards: {(time.perf_counter() - t0) / 30 * 1000:.2f} ms each", flush=True)
    dm = CachedModel(drafter.float())
    for rep in range(6):
        s = step_costs(tm, dm, ids, [1, 4, 8], repetitions=10)
        print(
            f"step_costs rep {rep}: target {s['target_step_s'] * 1000:.2f} ms, "
            f"drafter {s['drafter_step_s'] * 1000:.2f} ms, c {s['c']:.3f}, v {[round(v, 2) for v in s['v'].values()]}",
            flush=True,
        )
