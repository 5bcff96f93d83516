"""slurm/ on a REAL one-node Slurm cluster (slurm/local-cluster.sh): the ci recipe's chain submitted by
slurm/submit.sh, with its pretrain job told that its time is up (it checkpoints, requeues itself and
resumes); then a failing stage, whose dependents must be cancelled rather than pend forever."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.config import REPO_ROOT, compose_config
from pipeline.registry import PIPELINE
from pipeline.rundir import MANIFEST, stage_dir

pytestmark = [pytest.mark.slow, pytest.mark.starts_vllm]
SLURM_DIR = REPO_ROOT / "slurm"
SUBMIT = str(SLURM_DIR / "submit.sh")
CHAIN_TIMEOUT_S = 1800  # a safety net for a loaded machine, not a speed goal


@dataclass
class Cluster:
    directory: Path
    env: dict[str, str]

    def try_run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=REPO_ROOT, env=self.env, capture_output=True, text=True)

    def run(self, *command: str) -> str:
        done = self.try_run(*command)
        assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}"
        return done.stdout

    def submit(self, *args: str) -> dict[str, str]:
        """slurm/submit.sh's `stage=JOBID` lines."""
        return dict(line.split("=", 1) for line in self.run(SUBMIT, *args).split())

    def tasks(self, job_id: str) -> list[dict[str, str]]:
        """scontrol's fields of every task of a job or job array (finished jobs stay for MinJobAge)."""
        lines = self.run("scontrol", "show", "job", "--oneliner", job_id).splitlines()
        return [dict(field.split("=", 1) for field in line.split() if "=" in field) for line in lines]

    def task(self, job_id: str, array_index: int | None = None) -> dict[str, str]:
        tasks = self.tasks(job_id)
        if array_index is not None:
            tasks = [t for t in tasks if t.get("ArrayTaskId") == str(array_index)]
        assert len(tasks) == 1, f"job {job_id}[{array_index}]: {len(tasks)} tasks"
        return tasks[0]

    def array_tasks(self, job_id: str) -> set[int]:
        """The task indices of a job array over all its records: Slurm may split a pending array into a record
        per task (or range) at any time."""
        indices = set()
        for task in self.tasks(job_id):
            for part in task["ArrayTaskId"].split("%")[0].split(","):
                first, _, last = part.partition("-")
                indices.update(range(int(first), int(last or first) + 1))
        return indices

    def daemon_logs(self) -> str:
        """The end of slurmctld's and every slurmd's log: why Slurm failed a job that printed nothing."""
        return "\n".join(
            f"== {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:])
            for p in sorted((self.directory / "log").glob("slurm*.log"))
        )

    def wait_until_idle(self, timeout_s: float, log_dir: Path) -> None:
        deadline = time.monotonic() + timeout_s
        while self.run("squeue", "--noheader", "--format=%i").strip():
            if time.monotonic() > deadline:
                queue = self.run("squeue")
                logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted(log_dir.glob("*.out")))
                pytest.fail(f"jobs still queued after {timeout_s:.0f}s:\n{queue}\n{logs}")
            time.sleep(2)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    missing = [tool for tool in ("munged", "slurmctld", "slurmd", "sbatch", "pgrep") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        reason = (
            f"needs root and Slurm ({', '.join(missing)} missing): "
            "apt-get install munge slurmctld slurmd slurm-client procps, as .ci/run does"
        )
        if os.environ.get("SPECDRAFT_REQUIRE_SLURM"):  # CI: a skipped Slurm test would hide a broken install
            pytest.fail(reason)
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("slurm-cluster")
    script = str(SLURM_DIR / "local-cluster.sh")
    subprocess.run([script, "up", str(directory)], check=True, capture_output=True, text=True)
    env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf"), "LANG": "C.UTF-8"}
    yield Cluster(directory, env)
    subprocess.run([script, "down", str(directory)], check=True, capture_output=True, text=True)


def ci_config(runs_dir: Path, pair: str, overrides: list[str]):
    return compose_config(["recipe=ci", f"lang={pair}", f"paths.runs_dir={runs_dir}", *overrides])


def wait_for_checkpoint(cluster: Cluster, job_id: str, checkpoints: Path, log: Path) -> None:
    deadline = time.monotonic() + CHAIN_TIMEOUT_S
    while not list(checkpoints.glob("*/step.json")):
        state = cluster.task(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"pretrain {state} before a checkpoint:\n{log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "pretrain wrote no checkpoint"
        time.sleep(1)


@pytest.fixture(scope="session")
def chain(cluster, tmp_path_factory):
    """The ci recipe's chain for de-en. Once pretrain has a checkpoint, Slurm's time-limit warning
    (--signal=B:USR1) is sent by hand, as slurmctld sends it 120 s before the limit."""
    work = tmp_path_factory.mktemp("chain")
    runs_dir, log_dir = work / "runs", work / "logs"
    # Smaller than the ci recipe where only the machinery is under test; pretrain checkpoints every 2 steps.
    overrides = [
        "logger=none",
        "data.max_train_prompts=12",
        "distill.temperatures=[0.0]",
        "train.pretrain.save_every=2",
        "eval.num_prompts=2",
        "eval.methods=[target,speculative]",
        "eval.k_sweep=[4]",
        "eval.temperatures=[0.0]",
    ]
    ids = cluster.submit(
        "--recipe", "ci", "--langs", "de-en", "--log-dir", str(log_dir), f"paths.runs_dir={runs_dir}", *overrides
    )
    cfg = ci_config(runs_dir, "de-en", overrides)
    pretrain_log = log_dir / f"pretrain-{ids['pretrain']}.out"
    checkpoints = stage_dir(cfg, "pretrain", check_inputs=False).path / "checkpoints"
    wait_for_checkpoint(cluster, ids["pretrain"], checkpoints, pretrain_log)
    cluster.run("scancel", "--batch", "--signal=USR1", ids["pretrain"])
    # The requeued job starts again on its own, cred_expire + 1 s later (local-cluster.sh sets 30 s).
    deadline = time.monotonic() + 120
    while cluster.task(ids["pretrain"])["Restarts"] == "0":
        assert time.monotonic() < deadline, f"pretrain was not requeued:\n{pretrain_log.read_text()[-2000:]}"
        time.sleep(1)
    cluster.wait_until_idle(CHAIN_TIMEOUT_S, log_dir)
    return {"ids": ids, "runs_dir": runs_dir, "log_dir": log_dir, "overrides": overrides, "cfg": cfg}


def test_chain_runs_every_stage_in_dependency_order(cluster, chain):
    ids, log_dir = chain["ids"], chain["log_dir"]
    assert list(ids) == list(PIPELINE)
    jobs = {stage: cluster.task(ids[stage], None if stage == "pretrain" else 0) for stage in PIPELINE}
    for stage, job in jobs.items():
        log = next(log_dir.glob(f"{stage}-{ids[stage]}*.out"))
        assert job["JobState"] == "COMPLETED", (
            f"{stage}: {job['JobState']}\n{log.read_text()[-2000:]}\n{cluster.daemon_logs()}"
        )
        assert "lang=de-en" in log.read_text()
    # ISO timestamps compare as strings; a job starts no earlier than the jobs it depends on end.
    assert jobs["distill"]["EndTime"] <= jobs["finetune"]["StartTime"]
    assert jobs["pretrain"]["EndTime"] <= jobs["finetune"]["StartTime"]
    assert jobs["finetune"]["EndTime"] <= jobs["eval"]["StartTime"]
    # Every stage directory of the config the test composes is complete: the jobs ran that config.
    for stage in PIPELINE:
        directory = stage_dir(chain["cfg"], stage)
        assert directory.marker.read_text().strip() == directory.config_hash, stage
    assert (stage_dir(chain["cfg"], "finetune").path / "drafter" / "config.json").exists()


def test_pretrain_requeued_at_its_time_limit_resumes_from_its_checkpoint(cluster, chain):
    job = cluster.task(chain["ids"]["pretrain"])
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), cluster.daemon_logs()
    # Both runs' output: submit.sh opens logs with --open-mode=append.
    log = (chain["log_dir"] / f"pretrain-{chain['ids']['pretrain']}.out").read_text()
    assert "time limit near" in log and "requeueing job" in log
    stopped = re.search(r"preempted: checkpoint at step (\d+)", log)
    resumed = re.search(r"\(restart 1\)(?s:.*)resuming from \S+ \(step (\d+) of 20\)", log)
    assert stopped and resumed and int(resumed.group(1)) == int(stopped.group(1)) >= 2, log[-3000:]


def test_failed_stage_cancels_only_its_dependents(cluster, chain):
    """de-en is complete from the chain (every stage skips); fr-en's distill directory holds another
    config's results, so its distill fails without touching them, and fr-en's finetune and eval are
    cancelled instead of pending forever."""
    runs_dir, overrides = chain["runs_dir"], chain["overrides"]
    foreign = stage_dir(ci_config(runs_dir, "fr-en", overrides), "distill").path
    foreign.mkdir(parents=True)
    manifest = json.dumps({"stage": "distill", "config_hash": "0123456789abcdef"})
    (foreign / MANIFEST).write_text(manifest)
    log_dir = chain["log_dir"].parent / "logs-failure"
    ids = cluster.submit(
        "--recipe", "ci", "--langs", "de-en fr-en", "--log-dir", str(log_dir), f"paths.runs_dir={runs_dir}", *overrides
    )
    cluster.wait_until_idle(CHAIN_TIMEOUT_S, log_dir)

    states = {
        (stage, index): cluster.task(ids[stage], index) for stage in ("distill", "finetune", "eval") for index in (0, 1)
    }
    assert {key: job["JobState"] for key, job in states.items()} == {
        ("distill", 0): "COMPLETED",
        ("finetune", 0): "COMPLETED",
        ("eval", 0): "COMPLETED",
        ("distill", 1): "FAILED",
        ("finetune", 1): "CANCELLED",
        ("eval", 1): "CANCELLED",
    }
    assert states[("finetune", 1)]["Reason"] == states[("eval", 1)]["Reason"] == "DependencyNeverSatisfied"
    assert cluster.task(ids["pretrain"])["JobState"] == "COMPLETED"
    assert "force=true" in (log_dir / f"distill-{ids['distill']}_1.out").read_text()
    assert (foreign / MANIFEST).read_text() == manifest


def test_submit_rejects_a_bad_override_before_submitting_anything(cluster, tmp_path):
    done = cluster.try_run(SUBMIT, "--recipe", "ci", "--log-dir", str(tmp_path), "train.pretrain.no_such_key=1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1
    assert "no_such_key" in done.stderr


def test_refused_job_leaves_no_half_submitted_chain(cluster, tmp_path):
    """Two training nodes on a one-node cluster: sbatch refuses pretrain at once (EnforcePartLimits=ALL)
    instead of queueing it forever, and submit.sh cancels the distill job it had already submitted."""
    multi_node = [
        f"train.{stage}.{key}" for stage in ("pretrain", "finetune") for key in ("launch=ddp", "num_processes=2")
    ]
    done = cluster.try_run(
        SUBMIT,
        "--recipe",
        "ci",
        "--train-nodes",
        "2",
        "--log-dir",
        str(tmp_path),
        f"paths.runs_dir={tmp_path}",
        *multi_node,
    )
    assert done.returncode == 2, done.stderr
    distill = done.stdout.strip().removeprefix("distill=")
    assert done.stdout.split("=")[0] == "distill" and "sbatch refused the pretrain job" in done.stderr
    assert cluster.task(distill, 0)["JobState"] == "CANCELLED"
    cluster.wait_until_idle(60, tmp_path)


def submit_dry_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """slurm/submit.sh --dry-run: its sbatch lines, without a cluster."""
    return subprocess.run([SUBMIT, "--dry-run", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True)


def test_a_gpu_recipe_is_refused_without_gpus_in_one_line():
    done = submit_dry_run("--recipe", "paper-vicuna", "--gpus-per-node", "0")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "error: recipe paper-vicuna needs GPUs (needs_gpu: true) but --gpus-per-node is 0: "
        "pass --gpus-per-node N (a node's GPUs, e.g. 8)\n"
    )


def test_gpu_jobs_ask_for_each_gpus_cpu_and_memory_share_and_eval_is_not_exclusive():
    done = submit_dry_run("--recipe", "paper-vicuna", "--langs", "de-en fr-en", "--gpus-per-node", "8")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[-2] for line in lines] == [f"slurm/{stage}.sbatch" for stage in PIPELINE]
    for line in lines:
        assert " --cpus-per-task=64 --mem=512G --gpus-per-node=8 " in line and "--exclusive" not in line, line
    assert "--dependency=aftercorr:DISTILL_JOB,afterok:PRETRAIN_JOB" in lines[2]
    override = submit_dry_run(
        "--recipe", "paper-vicuna", "--gpus-per-node", "4", "--cpus", "20", "--mem-per-gpu", "100G"
    )
    assert " --cpus-per-task=20 --mem=400G --gpus-per-node=4 " in override.stdout, override.stderr


def test_gpu_jobs_are_refused_while_the_venv_is_a_cpu_build(tmp_path):
    """A venv make install built where nvidia-smi found no GPU (a login node), named by its stamp."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    (venv / "pyvenv.cfg").write_text(f"home = {Path(os.path.realpath(sys.executable)).parent}\n")
    (venv / ".installed-cpu-dev").touch()
    sbatch = tmp_path / "sbatch"  # must never be called
    sbatch.write_text('#!/bin/sh\ntouch "$0.called"\nexit 99\n')
    sbatch.chmod(0o755)
    env = {
        **os.environ,
        "SPECDRAFT_PYTHON": str(venv / "bin" / "python"),
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "PYTHONPATH": f"{REPO_ROOT}:{sysconfig.get_paths()['purelib']}",
        "LANG": "C.UTF-8",
    }
    done = subprocess.run(
        [SUBMIT, "--recipe", "ci", "--gpus-per-node", "8"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith(f"error: {venv} is a CPU build (cpu-dev") and len(done.stderr.splitlines()) == 1
    assert done.stderr.rstrip().endswith("make install EXTRAS=gpu,dev") and not Path(f"{sbatch}.called").exists()


def test_distill_shards_make_pairs_times_shards_tasks_that_finetune_waits_for_whole(cluster, tmp_path):
    """Submitted held: the arrays and dependencies as Slurm records them; then each distill task's pair and
    shard as slurm/distill.sbatch computes them (its python an echo)."""
    env = {**cluster.env, "SBATCH_HOLD": "1"}
    done = subprocess.run(
        [
            SUBMIT,
            "--recipe",
            "ci",
            "--langs",
            "de-en fr-en",
            "--distill-shards",
            "2",
            "--log-dir",
            str(tmp_path),
            f"paths.runs_dir={tmp_path}",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    ids = dict(line.split("=", 1) for line in done.stdout.split())
    try:
        # The arrays' tasks and dependencies as Slurm records them.
        assert cluster.array_tasks(ids["distill"]) == {0, 1, 2, 3}
        assert cluster.array_tasks(ids["finetune"]) == {0, 1}
        assert all(
            task["Dependency"].startswith(f"afterok:{ids['distill']}_*") for task in cluster.tasks(ids["finetune"])
        )
        assert all(
            task["Dependency"].startswith(f"aftercorr:{ids['finetune']}_*") for task in cluster.tasks(ids["eval"])
        )
    finally:
        cluster.run("scancel", *ids.values())
        cluster.wait_until_idle(60, tmp_path)
    echo = tmp_path / "python"
    echo.write_text('#!/bin/sh\necho "$@"\n')
    echo.chmod(0o755)
    answered = []
    for task in range(4):
        task_env = {
            **os.environ,
            "SLURM_ARRAY_TASK_ID": str(task),
            "LANG_PAIRS": "de-en fr-en",
            "PAIR_TASKS": "2",
            "SPECDRAFT_PYTHON": str(echo),
        }
        out = subprocess.run(
            [str(SLURM_DIR / "distill.sbatch"), "recipe=ci", "distill.num_shards=2"],
            cwd=REPO_ROOT,
            env=task_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        answered.append(out.splitlines()[-1].split()[-2:])
    assert answered == [
        ["lang=de-en", "distill.shard=0"],
        ["lang=de-en", "distill.shard=1"],
        ["lang=fr-en", "distill.shard=0"],
        ["lang=fr-en", "distill.shard=1"],
    ]
