"""The distill stage through a real vLLM CPU server (SmolLM2, the ci recipe's target).

Most tests share the session's server through ``distill.server.url``; the ones about the stage's own
server (killed mid-run, SIGTERM) start their own, since they end it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import REPO_ROOT, compose_config
from pipeline.data.sources import load_sources
from pipeline.errors import ServingError, StageInputError
from pipeline.jsonl import AppendOnlyJsonl, BackgroundJsonl, read_jsonl
from pipeline.models.provision import load_tokenizer
from pipeline.prompts import build_prompt
from pipeline.rundir import stage_dir
from pipeline.serving.server import INFO_FILE
from pipeline.stages.distill import FanOut, fan_out, load_records, request_seed, shard_of
from tests.helpers import command_lines

pytestmark = pytest.mark.starts_vllm

CACHE = REPO_ROOT / "runs" / "cache"
FIELDS = {
    "id",
    "temperature",
    "sample",
    "prompt",
    "response",
    "finish_reason",
    "stop_reason",
    "prompt_tokens",
    "completion_tokens",
    "seed",
    "model",
    "revision",
}
FOUR = "distill.temperatures=[0.0,0.3,0.7,1.0]"
SHORT = "distill.max_tokens=16"  # the answers only need to exist: keeps the CPU time small


def overrides(runs_dir: Path, *extra: str) -> list[str]:
    return [
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={CACHE}",
        f"paths.models_dir={REPO_ROOT / 'models'}",
        *extra,
    ]


def stage_path(args: list[str]) -> Path:
    return stage_dir(compose_config(args), "distill").path


def expected_keys(args: list[str]) -> set:
    cfg = compose_config(args)
    train, _ = load_sources(cfg)
    return {
        (ex.id, float(t), s)
        for ex in train
        for t in cfg.distill.temperatures
        for s in range(cfg.distill.samples_per_prompt)
    }


def all_records(path: Path) -> list[dict]:
    return [
        json.loads(line)
        for shard in sorted((path / "records").glob("*.jsonl"))
        for line in shard.read_text().split("\n")
        if line
    ]


def count_lines(path: Path) -> int:
    return sum(shard.read_bytes().count(b"\n") for shard in (path / "records").glob("*.jsonl"))


def cli(args: list[str], env: dict | None = None, open_files: tuple[int, int] | None = None) -> subprocess.Popen:
    """The stage as a process; ``open_files``: its (soft, hard) limit on open files, as ``ulimit -n`` sets it."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", "distill", *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE if open_files else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, open_files)) if open_files else None,
    )


def wait_for_records(path: Path, more_than: int, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while (path / "records").exists() is False or count_lines(path) <= more_than:
        assert process.poll() is None, f"stage exited early: {process.stderr.read()}"
        assert time.monotonic() < deadline, "no new record in time"
        time.sleep(0.05)


def live_members(group: int) -> dict[int, str]:
    """Processes of a process group that are not zombies: pid -> command line."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            members[int(stat.parent.name)] = command
    return members


def settled_requests(log: Path) -> int:
    """The completions a server's access log counts, once it has counted no new one for 2 s."""
    counts = [-1]
    while counts[-4:] != [counts[-1]] * 4:
        time.sleep(0.5)
        counts.append(log.read_text().count("POST /v1/completions"))
    return counts[-1]


def wait_for_vllm_worker(path: Path, process: subprocess.Popen, timeout_s: float = 300) -> int:
    """The process group of the stage's own server, once vLLM's worker process (the last one it starts) runs."""
    info, deadline = path / "server" / INFO_FILE, time.monotonic() + timeout_s
    while True:
        assert process.poll() is None and time.monotonic() < deadline, (
            "vLLM's worker never started (a test that waits for it asks for cpu_vllm_worker_process: the tests' "
            "servers keep the model in the engine core, tests/conftest.py)"
        )
        if info.exists():
            group = json.loads(info.read_text())["pgid"]
            if any(command.startswith("VLLM::Worker") for command in live_members(group).values()):
                return group
        time.sleep(0.2)


# ---- fast: the resume bookkeeping on its own ----


def test_torn_last_line_is_cut_and_only_complete_records_count(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    lines = [json.dumps({"id": f"e{i}", "temperature": 0.3, "sample": 0}) for i in range(3)]
    (records / "attempt-000.jsonl").write_text("\n".join(lines) + "\n")
    (records / "attempt-001.jsonl").write_text(lines[0].replace("e0", "e9") + "\n" + lines[1][:17])  # kill -9 mid-write
    keys = set(load_records(records))
    assert keys == {("e0", 0.3, 0), ("e1", 0.3, 0), ("e2", 0.3, 0), ("e9", 0.3, 0)}
    assert (records / "attempt-001.jsonl").read_text().endswith("}\n")  # the torn tail is gone, appends start clean
    assert len(read_jsonl(records / "attempt-001.jsonl")) == 1


@pytest.mark.parametrize("writer", [AppendOnlyJsonl, BackgroundJsonl])
def test_answers_with_unicode_line_separators_read_back_whole(tmp_path, writer):
    """gemma-3-270m answered one demo prompt with a U+2028 in it: JSON keeps it raw, and it is not a line end."""
    out = writer(tmp_path / "attempt-000.jsonl")
    answers = ["defend these\u2028first", "a\x85b\x1cc\u2029d", "plain"]
    for i, response in enumerate(answers):
        out.append({"id": f"e{i}", "temperature": 1.0, "sample": 0, "response": response})
    out.close()
    assert [r["response"] for r in read_jsonl(tmp_path / "attempt-000.jsonl")] == answers


def test_the_record_writer_never_makes_the_caller_wait_for_an_fsync(tmp_path, monkeypatch):
    """Distill's event loop only queues a record: the writer thread fsyncs once per interval and at close, not per
    record, appends after a torn tail start a line of their own, and a write error reaches the caller."""
    path = tmp_path / "attempt-000.jsonl"
    path.write_text('{"id": "e0", "temperature": 0.0, "sample": 0}\n{"id": "e1", "temper')  # a kill -9 mid-write
    synced_by = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced_by.append(threading.current_thread()), real_fsync(fd)))
    with BackgroundJsonl(path, sync_every_s=60) as out:
        for i in range(1, 1001):
            out.append({"id": f"e{i}", "temperature": 0.0, "sample": 0})
    assert len(synced_by) == 1 and synced_by[0] is not threading.main_thread()  # one fsync (at close) for 1000
    assert [r["id"] for r in read_jsonl(path)] == [f"e{i}" for i in range(1001)]

    broken = BackgroundJsonl(tmp_path / "missing-folder" / "attempt-000.jsonl")
    broken.append({"id": "e0"})
    with pytest.raises(OSError, match="missing-folder"):
        broken.close()


def test_shards_are_disjoint_and_cover_every_prompt(runs_dir):
    ids = [ex.id for ex in load_sources(compose_config(overrides(runs_dir)))[0]] + [f"id-{i}" for i in range(2000)]
    for num_shards in (1, 2, 3, 8):
        shards = [{i for i in ids if shard_of(i, num_shards) == shard} for shard in range(num_shards)]
        assert sum(map(len, shards)) == len(ids) and set().union(*shards) == set(ids)
        assert min(map(len, shards)) > 0.8 * len(ids) / num_shards  # balanced, by a hash of the id
    assert [shard_of(i, 3) for i in ids] == [shard_of(i, 3) for i in reversed(ids)][::-1]  # order-independent


def test_finetune_reads_every_shard_and_names_the_missing_ones_in_one_line(runs_dir):
    args = ["recipe=ci", f"paths.runs_dir={runs_dir}", "distill.num_shards=3", "train.finetune.mode=finetune_only"]
    shard_dirs = [stage_dir(compose_config([*args, f"distill.shard={k}"]), "distill") for k in range(3)]
    assert len({d.path for d in shard_dirs}) == 3 and len({d.config_hash for d in shard_dirs}) == 3
    assert stage_dir(compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}"]), "distill").path not in {
        d.path for d in shard_dirs
    }
    for k in (0, 2):  # shard 1 never ran
        cfg = compose_config([*args, f"distill.shard={k}"])
        shard_dirs[k].begin(cfg)
        shard_dirs[k].finish(cfg, {"records": 0})
    with pytest.raises(StageInputError) as error:
        stage_dir(compose_config(args), "finetune")
    message = str(error.value)
    assert "\n" not in message and "shard(s) 1 is not complete" in message
    assert (
        f"make distill LANG=de-en RECIPE=ci ARGS='paths.runs_dir={runs_dir} distill.num_shards=3 "
        "train.finetune.mode=finetune_only distill.shard=K'` for K in 1"
    ) in message

    cfg = compose_config([*args, "distill.shard=1"])
    shard_dirs[1].begin(cfg)
    shard_dirs[1].finish(cfg, {"records": 0})
    distill = stage_dir(compose_config(args), "finetune").inputs["distill"]
    assert [part.path for part in distill.parts] == [d.path for d in shard_dirs]
    # the set's hash (the finetune's upstream) is the same whichever shard the finetune's config names
    assert (
        distill.config_hash
        == stage_dir(compose_config([*args, "distill.shard=2"]), "finetune").inputs["distill"].config_hash
    )
    unsharded = compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}", "train.finetune.mode=finetune_only"])
    with pytest.raises(StageInputError, match=r"pass distill.num_shards=N to read a sharded one: de-en.shards-3"):
        stage_dir(unsharded, "finetune")


def test_duplicate_records_are_refused(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    line = json.dumps({"id": "e0", "temperature": 1.0, "sample": 0}) + "\n"
    (records / "attempt-000.jsonl").write_text(line)
    (records / "attempt-001.jsonl").write_text(line)
    with pytest.raises(ServingError, match="repeats record"):
        load_records(records)


def test_requests_in_flight_fit_the_open_file_limit_of_every_process(monkeypatch):
    """One 8-GPU node on the paper recipe: a replica and an API server per GPU, 1,024 requests in flight per replica
    from client processes of 256 each. A hard limit on open files too low for a process's connections lowers the
    requests in flight, in one line naming the fix; an external endpoint's API servers are not ours to count."""
    import torch

    bench = fan_out(compose_config(["recipe=ci"]), 1024)  # this CPU: the stage's own event loop, as before
    assert (bench.replicas, bench.api_servers, bench.client_processes, bench.limited) == (1, 1, 1, None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    cfg = compose_config(["recipe=paper-vicuna"])
    assert fan_out(cfg, 65536) == FanOut(replicas=8, api_servers=8, client_processes=32, requests_in_flight=8192)
    low = fan_out(cfg, 1024)  # 896 connections per process: 1,024 minus the files a process holds besides
    assert (low.requests_in_flight, low.client_processes, low.connections_per_client) == (8 * 896, 28, 256)
    assert "\n" not in low.limited and "7168 requests in flight, not 8192" in low.limited
    assert "ulimit -Hn" in low.limited
    one = fan_out(compose_config(["recipe=paper-vicuna", "distill.client_processes=1"]), 1024)
    assert one.requests_in_flight == 896 and one.limited.endswith("or set distill.client_processes=auto")
    url = "distill.server.url=http://node:8000/v1"
    external = fan_out(compose_config(["recipe=paper-vicuna", url, "distill.server.data_parallel=8"]), 1024)
    assert (external.api_servers, external.client_processes, external.requests_in_flight, external.limited) == (
        0,
        32,
        8192,
        None,
    )
    tensor_parallel = fan_out(compose_config(["recipe=paper-vicuna", "distill.server.tensor_parallel=2"]), 65536)
    assert (tensor_parallel.replicas, tensor_parallel.api_servers) == (4, 8)


def test_request_seeds_are_stable_and_distinct():
    keys = [(f"e{i}", t, s) for i in range(50) for t in (0.0, 0.3, 0.7, 1.0) for s in range(3)]
    seeds = [request_seed(0, key) for key in keys]
    assert seeds == [request_seed(0, key) for key in keys]
    assert len(set(seeds)) == len(keys) and all(0 <= s < 2**31 for s in seeds)
    assert request_seed(1, keys[0]) != seeds[0]


# ---- slow: a real vLLM server ----


@pytest.mark.slow
def test_records_for_every_temperature_and_reruns_reproduce(vllm_server, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", vllm_server.endpoint.api_key)
    runs = {}
    for name in ("first", "second"):
        args = overrides(
            tmp_path / name,
            f"distill.server.url={vllm_server.endpoint.url}",
            FOUR,
            SHORT,
            "data.max_train_prompts=6",
            "distill.top_logprobs=2",
        )
        assert main(["distill", *args]) == 0
        path = stage_path(args)
        assert (path / "COMPLETE").exists()
        records = all_records(path)
        assert len(records) == 24 and {(r["id"], r["temperature"], r["sample"]) for r in records} == expected_keys(args)
        runs[name] = {(r["id"], r["temperature"]): r for r in records}

    cfg = compose_config(args)
    tokenizer = load_tokenizer(str(REPO_ROOT / "models" / "smollm2-135m"))
    sources = {ex.id: ex for ex in load_sources(cfg)[0]}
    for record in runs["first"].values():
        assert FIELDS <= set(record) and record["model"] == "smollm2-135m"
        assert record["prompt"] == build_prompt(cfg.target, cfg.lang, sources[record["id"]].src, tokenizer)
        assert record["finish_reason"] in ("stop", "length") and record["completion_tokens"] > 0
        assert 0 < len(record["top_logprobs"]) <= record["completion_tokens"]
    assert {t for _, t in runs["first"]} == {0.0, 0.3, 0.7, 1.0}
    first, second = ({key: r["response"] for key, r in run.items()} for run in runs.values())
    greedy = {key for key in first if key[1] == 0.0}
    assert {k: first[k] for k in greedy} == {k: second[k] for k in greedy}  # T=0 is deterministic
    assert any(first[(id_, 1.0)] != first[(id_, 0.0)] for id_, _ in greedy)  # T=1 does sample
    # Each request carries its own seed, so a rerun repeats most T=1 samples (unseeded, hardly any would);
    # not all: vLLM's CPU numerics depend slightly on how requests were batched (measured: 23 of 24 equal).
    sampled = [key for key in first if key[1] == 1.0]
    assert sum(first[k] == second[k] for k in sampled) >= 2 / 3 * len(sampled)

    stats = json.loads((stage_path(args) / "stats.json").read_text())
    assert stats["records"] == 24 and stats["failures"] == {} and stats["tokens_per_s"] > 0


@pytest.mark.slow
def test_shards_answer_disjoint_slices_that_finetune_reads_as_the_whole_set(vllm_server, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", vllm_server.endpoint.api_key)
    args = overrides(
        tmp_path,
        f"distill.server.url={vllm_server.endpoint.url}",
        SHORT,
        "data.max_train_prompts=6",
        "distill.temperatures=[0.0]",
        "train.finetune.mode=finetune_only",
    )
    slices = []
    for shard in (0, 1):
        shard_args = [*args, "distill.num_shards=2", f"distill.shard={shard}"]
        assert main(["distill", *shard_args]) == 0
        path = stage_path(shard_args)
        assert (path / "COMPLETE").exists() and path.parent.name == "de-en.shards-2"
        slices.append({(r["id"], r["temperature"], r["sample"]) for r in all_records(path)})
        assert json.loads((path / "stats.json").read_text())["shard"]["prompts"] == len(slices[-1])
    assert slices[0] and slices[1] and not slices[0] & slices[1] and slices[0] | slices[1] == expected_keys(args)
    distill = stage_dir(compose_config([*args, "distill.num_shards=2"]), "finetune").inputs["distill"]
    assert {
        (r["id"], r["temperature"], r["sample"]) for part in distill.parts for r in all_records(part.path)
    } == expected_keys(args)


@pytest.mark.slow
def test_kill_9_at_random_points_then_rerun_gives_the_exact_record_set(vllm_server, tmp_path, monkeypatch):
    args = overrides(
        tmp_path, f"distill.server.url={vllm_server.endpoint.url}", FOUR, SHORT, "data.max_train_prompts=12"
    )
    env = dict(os.environ, OPENAI_API_KEY=vllm_server.endpoint.api_key)
    path = stage_path(args)
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    for _ in range(3):
        process = cli(args, env)
        wait_for_records(path, count_lines(path) if path.exists() else 0, process)
        time.sleep(rng.uniform(0.0, 0.5))
        process.kill()
        process.wait()
    interrupted = count_lines(path)
    assert interrupted < 48, f"the kills came too late to interrupt anything (seed {seed})"

    asked_before = settled_requests(vllm_server.log_path)  # the killed stage's last requests may still be answered
    monkeypatch.setenv("OPENAI_API_KEY", vllm_server.endpoint.api_key)
    assert main(["distill", *args]) == 0  # the rerun in this process: one Python start fewer
    # the rerun sends exactly one request per missing record: its stats and the server's access log agree (the
    # tests of the session's server run one after another, on one xdist worker)
    asked = settled_requests(vllm_server.log_path) - asked_before
    stats = json.loads((path / "stats.json").read_text())
    assert stats["requests"] == stats["new_records"] == asked == 48 - interrupted, f"seed {seed}"
    keys = [(r["id"], r["temperature"], r["sample"]) for r in all_records(path)]
    assert len(keys) == len(set(keys)) == 48, f"duplicates or missing records (seed {seed})"
    assert set(keys) == expected_keys(args)
    assert len(list((path / "records").glob("*.jsonl"))) == 4  # a shard per attempt


@pytest.mark.slow
@pytest.mark.starts_vllm(servers=2)
@pytest.mark.usefixtures("cpu_vllm_worker_process")
def test_two_replicas_kill_9_mid_run_leaves_whole_records_and_no_server_process(tmp_path):
    """The acceptance of data parallelism and the background writer: the stage's own vLLM with two replicas
    (--data-parallel-size 2 runs on the CPU build: two engine cores behind one endpoint) answers, then the stage is
    killed with SIGKILL after some records: the reaper takes both replicas along and no torn line reads back. That
    a rerun asks exactly the missing records: test_kill_9_at_random_points_then_rerun_gives_the_exact_record_set."""
    args = overrides(
        tmp_path,
        FOUR,
        SHORT,
        "data.max_train_prompts=8",
        "distill.server.data_parallel=2",
        "distill.concurrency_per_replica=4",
        "distill.server.cpu_kvcache_gb=1",
    )
    path, expected = stage_path(args), expected_keys(args)
    process = cli(args)
    group = wait_for_vllm_worker(path, process)
    wait_for_records(path, 4, process)
    process.kill()
    process.wait()
    deadline = time.monotonic() + 60
    while live_members(group) and time.monotonic() < deadline:  # the reaper takes both replicas along
        time.sleep(0.2)
    assert not live_members(group)
    log = (path / "server" / "vllm.log").read_text()
    assert "'data_parallel_size': 2" in log and "EngineCore_DP1" in log  # two engine cores started
    assert "ApiServer_1" in log  # and two API-server processes

    written = b"".join(shard.read_bytes() for shard in sorted((path / "records").glob("*.jsonl")))
    complete = [json.loads(line) for line in written.split(b"\n")[:-1]]  # every whole line parses: none torn
    done = {(r["id"], r["temperature"], r["sample"]) for r in complete}
    assert len(done) == len(complete) and 4 < len(done) < len(expected), "killed too late to interrupt anything"
    assert done <= expected and not (path / "COMPLETE").exists()


@pytest.mark.slow
@pytest.mark.starts_vllm(servers=2)
@pytest.mark.usefixtures("cpu_vllm_worker_process")
def test_two_distills_on_one_node_each_ask_only_their_own_server_and_a_preempted_one_takes_its_along(tmp_path):
    """Two distill jobs started together on one node (two Slurm jobs sharing it, one vLLM cache): each starts its
    own server, on a port of its own and with a key of its own. The first is preempted (SIGTERM) mid-run: it tears
    its server down and exits 75 (EX_TEMPFAIL), as training and eval, so Slurm requeues it. The second completes
    with every record, its server having answered exactly its own stage's requests. A SIGKILL of the stage, which
    runs no handler, leaves no vLLM process either: the reaper takes the group along
    (test_two_replicas_kill_9_mid_run_leaves_whole_records_and_no_server_process)."""
    import re

    preempted, completed = (
        overrides(tmp_path / job, SHORT, f"data.max_train_prompts={prompts}", "distill.server.cpu_kvcache_gb=1")
        for job, prompts in (("job-1", 8), ("job-2", 4))
    )
    processes = [cli(args) for args in (preempted, completed)]
    path = stage_path(preempted)
    wait_for_records(path, 0, processes[0])
    group = wait_for_vllm_worker(path, processes[0])
    processes[0].send_signal(signal.SIGTERM)
    assert processes[0].wait(timeout=60) == 75, processes[0].stderr.read()
    deadline = time.monotonic() + 30
    while live_members(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_members(group) and not (path / "COMPLETE").exists()

    assert processes[1].wait(timeout=900) == 0, processes[1].stderr.read()
    path = stage_path(completed)
    log = (path / "server" / "vllm.log").read_text()
    stats = json.loads((path / "stats.json").read_text())
    assert stats["requests"] == log.count("POST /v1/completions") == len(expected_keys(completed))
    keys = [(r["id"], r["temperature"], r["sample"]) for r in all_records(path)]
    assert len(keys) == len(set(keys)) and set(keys) == expected_keys(completed)
    ports = [
        re.search(r"starting vLLM on port (\d+)", (stage_path(a) / "server" / "vllm.log").read_text())[1]
        for a in (preempted, completed)
    ]
    assert len(set(ports)) == 2


@pytest.mark.slow
def test_server_killed_mid_run_reports_and_a_rerun_completes(vllm_server, tmp_path):
    """The stage's own server dies mid-run. Its preferred port is taken by a squatter that answers every request,
    claiming our model: the server must not be taken for healthy there nor send it the key, and comes up on
    another port."""
    import http.server
    import threading

    args = overrides(tmp_path, SHORT, "data.max_train_prompts=8", "distill.max_retries=1")
    path, seen = stage_path(args), []
    claimed = json.dumps({"data": [{"id": compose_config(args).target.name}]}).encode()

    class Squatter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Length", str(len(claimed)))
            self.end_headers()
            self.wfile.write(claimed)

        def log_message(self, *args):
            pass

    squatter = http.server.HTTPServer(("127.0.0.1", 0), Squatter)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    port = squatter.server_address[1]
    try:
        process = cli([*args, f"distill.server.port={port}"])
        wait_for_records(path, 1, process)
        info = json.loads((path / "server" / INFO_FILE).read_text())
        os.killpg(info["pgid"], signal.SIGKILL)
        _, stderr = process.communicate(timeout=300)
    finally:
        squatter.shutdown()
    assert not [auth for _, auth in seen if auth]  # asked, if at all, without the key
    assert info["port"] != port
    assert "Address already in use" in (path / "server" / "vllm.log").read_text()
    assert process.returncode == 2
    assert stderr.strip().splitlines()[-1].startswith("error: the vLLM server died")
    assert not (path / "COMPLETE").exists() and not live_members(info["pgid"])
    assert any(json.loads(line)["cause"] == "connection" for line in (path / "failures.jsonl").read_text().splitlines())

    process = cli(
        [*args, f"distill.server.url={vllm_server.endpoint.url}"],
        dict(os.environ, OPENAI_API_KEY=vllm_server.endpoint.api_key),
    )
    assert process.wait(timeout=600) == 0, process.stderr.read()
    keys = [(r["id"], r["temperature"], r["sample"]) for r in all_records(path)]
    assert len(keys) == len(set(keys)) and set(keys) == expected_keys(args)


def test_a_distill_whose_requests_the_server_rejects_is_not_complete(vllm_server, tmp_path, monkeypatch, capsys):
    """Requests that fail permanently (HTTP 400: answers longer than the server's context) are not retried by
    the client; a distill missing more than distill.max_failed_share of its records must not be COMPLETE."""
    monkeypatch.setenv("OPENAI_API_KEY", vllm_server.endpoint.api_key)
    args = overrides(
        tmp_path,
        f"distill.server.url={vllm_server.endpoint.url}",
        "data.max_train_prompts=4",
        "distill.temperatures=[0.0]",
        "distill.max_tokens=100000",
    )
    assert main(["distill", *args]) == 2
    assert not (stage_path(args) / "COMPLETE").exists()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "4 of 4 records missing after requests the server rejected (http_400 ×4)" in error
    assert "distill.max_failed_share=0.01" in error and "make distill" in error


@contextlib.contextmanager
def holding_endpoint(hold: int) -> Iterator[tuple[str, dict]]:
    """An OpenAI-compatible endpoint answering each completion with one token, and holding each request until
    ``hold`` are in flight (or 5 s passed), so a client's connections are all open at once; ``peak`` counts them."""
    state, changed = {"in_flight": 0, "peak": 0}, threading.Condition()

    class Completions(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server

        def log_message(self, *args) -> None:
            pass

        def answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self.answer({"object": "list", "data": [{"id": "smollm2-135m", "object": "model"}]})

        def do_POST(self) -> None:
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            with changed:
                state["in_flight"] += 1
                state["peak"] = max(state["peak"], state["in_flight"])
                changed.notify_all()
                changed.wait_for(lambda: state["in_flight"] >= hold, timeout=5)
            choice = {"text": "x", "finish_reason": "length", "prompt_token_ids": prompt, "token_ids": [1]}
            self.answer({"choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1}})
            with changed:
                state["in_flight"] -= 1

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # 400 connections at once

    server = Server(("127.0.0.1", 0), Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    finally:
        server.shutdown()


def test_a_distill_under_ulimit_n_256_with_more_requests_in_flight_completes(smollm_path, tmp_path):
    """400 requests in flight, each holding a connection (an open file), from one process whose soft limit on open
    files is 256 (as `ulimit -n 256`, or a cluster's 1,024 under 8 x 256): the stage lifts it to the hard limit.
    Where the hard limit is 256 too, it keeps fewer requests in flight, says so in one line, and completes too."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for name, open_files, in_flight in (("soft", (256, hard), 400), ("hard", (256, 256), 256 - 128)):
        with holding_endpoint(hold=min(300, in_flight)) as (url, served):  # no wave waits out the 5 s
            args = overrides(
                tmp_path / name,
                f"distill.server.url={url}",
                "data.max_train_prompts=100",
                FOUR,
                "distill.concurrency_per_replica=400",
                "distill.client_processes=1",  # every connection in the stage's own process
                "distill.max_retries=0",
            )
            process = cli(args, dict(os.environ, OPENAI_API_KEY="EMPTY"), open_files)
            stdout, stderr = process.communicate(timeout=900)
        assert process.returncode == 0, stderr
        stats = json.loads((stage_path(args) / "stats.json").read_text())
        assert stats["records"] == 400 and stats["failures"] == {}
        assert stats["server"]["requests_in_flight"] == in_flight
        assert served["peak"] == in_flight if in_flight < 300 else served["peak"] >= 300  # all open at once
        limited = [line for line in stdout.splitlines() if "the hard limit on open files (256" in line]
        assert len(limited) == (name == "hard"), stdout


@pytest.mark.slow
def test_client_processes_answer_as_the_stage_does_and_die_with_it(vllm_server, tmp_path):
    """With client processes (distill.client_processes, auto above 256 requests in flight): the same greedy records
    as the stage's own client; a kill -9 of the stage takes its client processes along, and the rerun asks exactly
    the missing records."""
    import psutil

    env = dict(os.environ, OPENAI_API_KEY=vllm_server.endpoint.api_key)

    def args(name: str, client_processes: int) -> list[str]:
        return overrides(
            tmp_path / name,
            f"distill.server.url={vllm_server.endpoint.url}",
            FOUR,
            SHORT,
            "data.max_train_prompts=12",
            "distill.concurrency_per_replica=8",
            f"distill.client_processes={client_processes}",
        )

    relayed, direct = args("relayed", 3), args("direct", 1)
    path = stage_path(relayed)
    process = cli(relayed, env)
    wait_for_records(path, 4, process)
    relays = [child for child in psutil.Process(process.pid).children() if "pipeline.serving.relay" in child.cmdline()]
    assert len(relays) == 3
    key = vllm_server.endpoint.api_key.encode()
    assert not [line for line in command_lines() if key in line]
    process.kill()
    process.wait()
    _, alive = psutil.wait_procs(relays, timeout=30)
    assert not alive  # PR_SET_PDEATHSIG: none goes on asking into the stage directory
    done = count_lines(path)
    assert done < 48, "killed too late to interrupt anything"

    for run in (relayed, direct):
        assert cli(run, env).wait(timeout=600) == 0
    stats = json.loads((path / "stats.json").read_text())
    assert stats["server"]["client_processes"] == 3 and stats["requests"] == stats["new_records"] == 48 - done
    records = [
        {(r["id"], r["temperature"]): r["response"] for r in all_records(stage_path(run))} for run in (relayed, direct)
    ]
    assert len(all_records(path)) == 48 and set(records[0]) == set(records[1])
    greedy = {key for key in records[0] if key[1] == 0.0}
    assert {k: records[0][k] for k in greedy} == {k: records[1][k] for k in greedy}
