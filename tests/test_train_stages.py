"""The pretrain and finetune stages end to end on the `ci` recipe, through the real CLI and accelerate."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.cli import main as cli
from pipeline.config import REPO_ROOT, compose_config
from pipeline.data.sources import sharegpt_segments
from pipeline.models.drafter import build_drafter
from pipeline.models.provision import load_model, load_tokenizer
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE, build_prompt
from pipeline.rundir import MARKER, stage_dir
from pipeline.stages import serve_bench
from pipeline.training.data import Collator, TokenStrings, finetune_examples, read_records
from pipeline.training.launch import read_metrics
from pipeline.training.loop import latest_checkpoint
from pipeline.workers import EXIT_PREEMPTED
from tests.helpers import logged_losses, run_stage, start_stage, target_alone_on

pytestmark = pytest.mark.slow

PRETRAIN = ["train.pretrain.log_every=1"]
ON_POLICY = [
    "train.finetune.log_every=1",
    "train.finetune.on_policy.enabled=true",
    "train.finetune.on_policy.rounds=2",
    "train.finetune.on_policy.steps_per_round=3",
    "train.finetune.on_policy.batch_size=4",
    "train.finetune.on_policy.heldout_prompts=2",
]
TWO_PROCESSES = ["train.pretrain.launch=ddp-cpu", "train.pretrain.num_processes=2"]  # a real 2-rank gloo group
TWO_JOBS_B_STEPS = 4  # the second of two_ddp_jobs

# German sources and English translations, as the target's distilled answers (real text).
TRANSLATIONS = [
    ("Der Hund läuft durch den Park.", "The dog runs through the park."),
    ("Ich habe heute keine Zeit, weil ich arbeiten muss.", "I have no time today because I have to work."),
    ("Das Wetter ist schön und die Sonne scheint.", "The weather is nice and the sun is shining."),
    ("Kannst du mir bitte das Salz geben?", "Can you please pass me the salt?"),
    ("Wir fahren morgen mit dem Zug nach Berlin.", "Tomorrow we are taking the train to Berlin."),
    ("Meine Schwester studiert Medizin in München.", "My sister studies medicine in Munich."),
    ("Das Buch liegt auf dem Tisch neben der Lampe.", "The book is lying on the table next to the lamp."),
    ("Er trinkt jeden Morgen eine Tasse Kaffee.", "He drinks a cup of coffee every morning."),
]


def overrides(runs_dir, *extra) -> list[str]:
    return ["recipe=ci", f"paths.runs_dir={runs_dir}", f"paths.cache_dir={runs_dir}/cache", *extra]


def signal_after(child, path, steps: int, signum: int = signal.SIGTERM) -> int:
    """Signal the stage (SIGTERM: as Slurm preempts) once ``steps`` steps are logged; returns its exit code."""
    deadline = time.time() + 180
    while len(read_metrics(path)) < steps and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    child.send_signal(signum)
    return child.wait(timeout=180)


def preempt_stage(stage: str, args: list[str], tmp_path, steps: int, stops_before: int) -> tuple:
    """Start a training stage as a user would, SIGTERM it after ``steps`` logged steps, check it stopped
    unfinished before step ``stops_before``; (stage path, step it stopped at, log)."""
    path = stage_dir(compose_config(args), stage).path
    with (tmp_path / "stage.log").open("w+") as output:
        code = signal_after(start_stage(stage, args, output), path, steps=steps)
        output.seek(0)
        log = output.read()
    assert code == EXIT_PREEMPTED, log
    assert not (path / MARKER).exists() and not (path / "drafter").exists()
    stopped_at = max(read_metrics(path))
    assert steps <= stopped_at < stops_before, log
    return path, stopped_at, log


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory, smollm_path):
    """One uninterrupted 1-process ci pretrain, logging every step, in a process of its own (run_stage)."""
    runs_dir = tmp_path_factory.mktemp("pretrained")
    copy_shared_segments(runs_dir)
    run_stage("pretrain", overrides(runs_dir, *PRETRAIN))
    return runs_dir


def copy_shared_segments(runs_dir) -> None:
    """The held-out prompts' ShareGPT language ID (~1 min) as the other test files share it, under runs/cache/,
    copied into this run's cache: the runs on ``pretrained``'s folder read it instead of extracting it again."""
    data = compose_config(["recipe=ci"]).data
    shared = sharegpt_segments(REPO_ROOT / "runs" / "cache", data.min_chars, data.max_chars)
    own = runs_dir / "cache" / shared.relative_to(shared.parents[1])
    own.parent.mkdir(parents=True)
    shutil.copyfile(shared, own)


@pytest.fixture(scope="session")
def two_ddp_jobs(tmp_path_factory, smollm_path):
    """Two uninterrupted 2-process ci pretrains (accelerate launch, gloo), logging every step, started at once on
    this node as two users' jobs would be: {job: (runs dir, exit code, output)}. Job "a" is ``two_processes``; job
    "b" trains TWO_JOBS_B_STEPS steps, enough to rendezvous and train beside "a", with less of "a"'s two cores."""
    root = tmp_path_factory.mktemp("two-ddp-jobs")
    logs = {name: (root / f"{name}.log").open("w+") for name in ("a", "b")}
    steps = {"a": [], "b": [f"train.pretrain.max_steps={TWO_JOBS_B_STEPS}"]}
    stages = {
        name: start_stage("pretrain", overrides(root / name, *PRETRAIN, *TWO_PROCESSES, *steps[name]), logs[name])
        for name in logs
    }
    try:
        codes = {name: stage.wait(timeout=600) for name, stage in stages.items()}
    finally:
        for stage in stages.values():
            if stage.poll() is None:
                os.killpg(stage.pid, signal.SIGKILL)
    return {name: (root / name, codes[name], (log.seek(0), log.read())[1][-3000:]) for name, log in logs.items()}


@pytest.fixture(scope="session")
def two_processes(two_ddp_jobs):
    """One uninterrupted 2-process ci pretrain (accelerate launch, gloo), logging every step: its runs dir."""
    runs_dir, code, output = two_ddp_jobs["a"]
    assert code == 0, output
    return runs_dir


def test_two_ddp_jobs_on_one_node_both_finish(two_ddp_jobs):
    """Two 2-process gloo groups at once: each rendezvous on a port of its own, not one fixed port."""
    codes = {name: code for name, (_, code, _) in two_ddp_jobs.items()}
    # a string, not the dict: pytest shortens a dict's repr to its first and last characters, the traceback lost
    assert codes == {"a": 0, "b": 0}, "\n".join(f"--- job {name}:\n{job[2]}" for name, job in two_ddp_jobs.items())
    for name, steps in (("a", 20), ("b", TWO_JOBS_B_STEPS)):
        runs_dir, _, output = two_ddp_jobs[name]
        args = overrides(runs_dir, *PRETRAIN, *TWO_PROCESSES, f"train.pretrain.max_steps={steps}")
        path = stage_dir(compose_config(args), "pretrain").path
        assert (path / MARKER).exists() and sorted(read_metrics(path)) == list(range(1, steps + 1)), output


@pytest.fixture(scope="session")
def distilled(pretrained, smollm_path):
    """A complete distill stage of the ci recipe beside the pretrain stage, in the records format of contract 1."""
    cfg = compose_config(overrides(pretrained))
    tokenizer, target = load_tokenizer(smollm_path), load_model(smollm_path)
    directory = stage_dir(cfg, "distill")
    directory.begin(cfg)
    (directory.path / "records").mkdir()
    endings = [("stop", "\n"), ("stop", None), ("length", None)]
    with (directory.path / "records" / "attempt-000.jsonl").open("w") as out:
        for i, (src, ref) in enumerate(TRANSLATIONS):
            for temperature in (0.0, 1.0):
                prompt = build_prompt(cfg.target, cfg.lang, src, tokenizer)
                finish_reason, stop_reason = endings[i % 3]
                record = {
                    "id": f"s{i}",
                    "temperature": temperature,
                    "sample": 0,
                    "prompt": prompt,
                    "response": ref,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                    "prompt_tokens": len(tokenizer(prompt).input_ids),
                    "completion_tokens": 12,
                    "seed": 0,
                    "model": cfg.target.name,
                    "revision": None,
                }
                record["top_logprobs"] = top_logprobs(target, tokenizer, prompt, ref)
                out.write(json.dumps(record) + "\n")
    directory.finish(cfg, {"records": 2 * len(TRANSLATIONS)})
    return pretrained


def top_logprobs(target, tokenizer, prompt: str, response: str, k: int = 5) -> list[dict[str, float]]:
    """The target's top-k logprobs at each response token, as the OpenAI API reports them."""
    ids = tokenizer(prompt + response, return_tensors="pt").input_ids
    start = len(tokenizer(prompt).input_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(target(input_ids=ids).logits[0], -1)
    return [
        {tokenizer.decode([int(i)]): float(logprobs[t, i]) for i in logprobs[t].topk(k).indices}
        for t in range(start - 1, ids.shape[1] - 1)
    ]


def test_pretrain_writes_a_drafter_and_its_loss_falls(pretrained):
    cfg = compose_config(overrides(pretrained))
    path = stage_dir(cfg, "pretrain").path
    assert (path / MARKER).exists()
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["steps"] == 20 and counts["tokens_seen"] == 20 * 4 * 128 and 190 <= counts["documents"] <= 200
    curve = logged_losses(path)
    assert len(curve) == 20 and sum(curve[-3:]) / 3 < curve[0] - 0.3, curve
    drafter = AutoModelForCausalLM.from_pretrained(path / "drafter")
    assert drafter.config.vocab_size == 49152 and VocabMap.load(path / "drafter") is None


def test_preempted_pretrain_exits_incomplete_and_resumes_to_the_same_losses(pretrained, tmp_path):
    """Preempted, then run again (resume=auto) in a new process, as Slurm requeues a job."""
    args = overrides(tmp_path, *PRETRAIN)
    path, stopped_at, _ = preempt_stage("pretrain", args, tmp_path, steps=3, stops_before=20)
    assert (path / "checkpoints" / f"step-{stopped_at:08d}").exists()

    run_stage("pretrain", args)
    assert (path / MARKER).exists()
    reference = stage_dir(compose_config(overrides(pretrained)), "pretrain").path
    assert logged_losses(path) == logged_losses(reference)  # exactly: same weights, optimizer, schedule, data position


def test_two_process_accelerate_launch_matches_one_process(pretrained, two_processes):
    args = overrides(two_processes, *PRETRAIN, *TWO_PROCESSES)
    path = stage_dir(compose_config(args), "pretrain").path
    reference = stage_dir(compose_config(overrides(pretrained)), "pretrain").path
    # Each step's global batch is split over the two gloo processes: same data, same loss up to float sums.
    assert logged_losses(path) == pytest.approx(logged_losses(reference), rel=1e-4)
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["processes"] == 2 and counts["tokens_seen"] == 20 * 4 * 128  # a real 2-rank gloo group
    two = AutoModelForCausalLM.from_pretrained(path / "drafter").state_dict()
    one = AutoModelForCausalLM.from_pretrained(reference / "drafter").state_dict()
    assert all(torch.allclose(two[name], one[name], atol=1e-4) for name in one)


def test_preempted_two_process_pretrain_stops_both_ranks_at_one_step_and_resumes_exactly(two_processes, tmp_path):
    args = overrides(tmp_path, *PRETRAIN, *TWO_PROCESSES)
    # at step 10 of 20: the one-process resume below trains what is left (the 2-process runs train 20 steps either way)
    path, stopped_at, log = preempt_stage("pretrain", args, tmp_path, steps=10, stops_before=20)
    # One checkpoint, of the step both ranks stopped at: each rank saved its RNG state into that step's folder.
    checkpoint = path / "checkpoints" / f"step-{stopped_at:08d}"
    assert [p.name for p in (path / "checkpoints").iterdir()] == [checkpoint.name]
    assert sorted(p.name for p in checkpoint.glob("random_states_*")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert json.loads((checkpoint / "step.json").read_text())["step"] == stopped_at
    assert log.count("preempted: checkpoint at step") == 1, log

    assert "death signal" not in log  # the stage signalled the workers, not torchrun (which SIGKILLs after 30 s)
    one_process = tmp_path / "one-process"
    shutil.copytree(tmp_path / "smollm2-135m", one_process / "smollm2-135m")

    assert cli(["pretrain", *args]) == 0  # resume=auto, again with 2 processes
    assert (path / MARKER).exists()
    reference = stage_dir(compose_config(overrides(two_processes, *PRETRAIN, *TWO_PROCESSES)), "pretrain").path
    assert logged_losses(path) == logged_losses(reference)  # exactly, as with one process
    assert len((path / "metrics.jsonl").read_text().splitlines()) == 20

    # num_processes is not part of the stage's config: one process resumes the 2-process checkpoint (DDP
    # saves whole tensors), and computes the same losses up to the order of float sums.
    single = overrides(one_process, *PRETRAIN)
    assert cli(["pretrain", *single]) == 0
    resumed = stage_dir(compose_config(single), "pretrain").path
    assert logged_losses(resumed) == pytest.approx(logged_losses(reference), rel=1e-4)
    assert len((resumed / "metrics.jsonl").read_text().splitlines()) == 20  # resumed: no step trained twice
    assert json.loads((resumed / "manifest.json").read_text())["counts"]["processes"] == 1


def test_deepspeed_zero2_accumulates_as_one_process_and_a_full_disk_during_its_sharded_save_resumes_exactly(
    tmp_path, smollm_path
):
    """A real DeepSpeed engine (its CPU accelerator, gloo) under accelerate launch, not DDP under another name, as the
    paper pretrains (grad_accum 2; Gemma's 8): ZeRO-2 reduces each micro-batch's gradients into its shard, steps at
    the accumulation boundary and writes its checkpoint in shards, one per rank (torch.save, not safetensors). Once
    the first checkpoint is whole, the workers get a 4 MiB file size limit (a full disk, a quota): the next save
    fails, the stage ends in one line naming the fix and the checkpoint it resumes from, which stays whole; a rerun
    with room resumes from it. Its losses and weights are those of one process accumulating the same micro-batches
    uninterrupted (each step's micro-batch i is the same examples, split over the ranks or not). The first run
    JIT-builds DeepSpeed's shared-memory comm op (g++, ninja) into ~/.cache/torch_extensions. A preempted ZeRO-2
    run over two nodes: tests/test_multinode.py."""
    accumulate = [*PRETRAIN, "train.pretrain.grad_accum=2"]
    one = overrides(tmp_path / "one", *accumulate)
    assert cli(["pretrain", *one]) == 0  # in this process: compared within 1e-4, not bit for bit
    args = overrides(
        tmp_path / "zero",
        *accumulate,
        "train.pretrain.launch=deepspeed-zero2",
        "train.pretrain.num_processes=2",
        "train.pretrain.save_every=5",
    )
    path = stage_dir(compose_config(args), "pretrain").path
    first = path / "checkpoints" / "step-00000005"
    with (tmp_path / "stage.log").open("w+") as output:
        child = start_stage("pretrain", args, output)
        deadline = time.time() + 300
        while not (first / "step.json").exists():
            assert child.poll() is None and time.time() < deadline, "no first checkpoint"
            time.sleep(0.02)
        config_file = str(path / "launch_config.yaml")
        for process in psutil.process_iter(["cmdline"]):
            if config_file in (process.info["cmdline"] or []):
                process.rlimit(psutil.RLIMIT_FSIZE, (4 << 20, 4 << 20))
        code = child.wait(timeout=300)
        output.seek(0)
        log = output.read()
    assert code == 2, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: no room to write (") and "free space (or raise the quota)" in last, log[-3000:]
    assert last.endswith("checkpoint step-00000010 was not written, and the run resumes from step-00000005"), last
    assert latest_checkpoint(path) == first and not (path / MARKER).exists()
    uninterrupted = {step: row["loss"] for step, row in read_metrics(path).items() if step > 5}  # the failed run's
    assert uninterrupted, log[-3000:]

    assert cli(["pretrain", *args]) == 0
    resumed = read_metrics(path)  # the same two ranks, from step 5's shards: as the failed run trained on from there
    assert {step: resumed[step]["loss"] for step in uninterrupted} == pytest.approx(uninterrupted, rel=1e-5)
    reference = stage_dir(compose_config(one), "pretrain").path
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["processes"] == 2 and counts["steps"] == 20 and counts["tokens_seen"] == 20 * 4 * 128
    assert len(logged_losses(path)) == 20 and logged_losses(path) == pytest.approx(logged_losses(reference), rel=1e-4)
    drafter = AutoModelForCausalLM.from_pretrained(path / "drafter")
    assert drafter.lm_head.weight.data_ptr() == drafter.model.embed_tokens.weight.data_ptr()  # still tied
    zero_weights = drafter.state_dict()
    one_weights = AutoModelForCausalLM.from_pretrained(reference / "drafter").state_dict()
    assert all(torch.allclose(zero_weights[name], one_weights[name], atol=1e-4) for name in one_weights)


@pytest.mark.parametrize("recipe", ["paper-llama2", "paper-vicuna", "paper-vicuna-f-only", "paper-gemma"])
def test_paper_recipes_train_under_ddp(recipe):
    """Their drafters' weights, gradients and Adam state (68M: 1.1 GB, Gemma's 228M: 3.6 GB) fit any GPU: ZeRO-2
    would save 1-3 GB a GPU and reduce every micro-batch (docs/results/2026-11-27-ddp-vs-zero2.md)."""
    train = compose_config([f"recipe={recipe}"]).train
    assert train.pretrain.launch == train.finetune.launch == "ddp"


def test_ctrl_c_stops_the_accelerate_workers_with_the_stage(tmp_path):
    """The launcher runs in its own session, out of the terminal's reach: the stage stops its workers."""
    args = overrides(tmp_path, *PRETRAIN, *TWO_PROCESSES)
    path = stage_dir(compose_config(args), "pretrain").path
    with (tmp_path / "stage.log").open("w+") as output:
        code = signal_after(start_stage("pretrain", args, output), path, steps=2, signum=signal.SIGINT)
        output.seek(0)
        log = output.read()
    assert code != 0 and "KeyboardInterrupt" in log, log
    config_file = str(path / "launch_config.yaml")
    left = [p for p in psutil.process_iter(["cmdline"]) if config_file in (p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]  # no worker trains on unattended
    checkpoint = latest_checkpoint(path)  # the workers stopped as when preempted
    assert not (path / MARKER).exists() and checkpoint.name == f"step-{max(read_metrics(path)):08d}"


def test_finetune_from_pretrain_on_distilled_records(distilled):
    args = overrides(distilled, *PRETRAIN, "train.finetune.log_every=1")
    assert cli(["finetune", *args]) == 0
    path = stage_dir(compose_config(args), "finetune").path
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["records"] == 16 and counts["temperatures"] == [0.0, 1.0] and counts["steps"] == 20
    curve = logged_losses(path)
    assert len(curve) == 20 and sum(curve[-3:]) / 3 < curve[0] - 0.3, curve  # as pretraining's: over the run
    drafter = AutoModelForCausalLM.from_pretrained(path / "drafter")
    pretrained_drafter = AutoModelForCausalLM.from_pretrained(
        stage_dir(compose_config(args), "pretrain").path / "drafter"
    )
    assert not torch.equal(drafter.lm_head.weight, pretrained_drafter.lm_head.weight)  # it learned from there


def test_finetune_only_with_a_reduced_vocabulary(distilled):
    args = overrides(
        distilled, "train.finetune.mode=finetune_only", "drafter.name=tiny-ci-r512", "drafter.reduced_vocab=512"
    )
    assert cli(["finetune", *args]) == 0
    path = stage_dir(compose_config(args), "finetune").path
    vocab = VocabMap.load(path / "drafter")
    assert vocab.drafter_vocab_size == 513 and vocab.target_vocab_size == 49152
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["drafter_vocab"] == 513 and counts["label_coverage"] == 1.0  # 512 ids cover these records


def test_finetune_tokenizes_the_same_records_once_for_requeues_reruns_and_other_runs(distilled, tmp_path, monkeypatch):
    """The examples are cached by what determines them: a requeue (the same stage folder) and another run of the same
    data (an lr sweep's folder) read them, linked, not copied; a max_length, data fraction or KD loss tokenizes anew."""
    from pipeline.stages import finetune

    tokenized = []
    tokenize_records = finetune.finetune_examples
    monkeypatch.setattr(
        finetune,
        "finetune_examples",
        lambda records, *args: tokenized.append(len(records)) or tokenize_records(records, *args),
    )

    def tokenize(*extra, run="tokenize-once"):
        args = overrides(distilled, f"run={run}", "train.finetune.mode=finetune_only", f"paths.cache_dir={tmp_path}")
        cfg = compose_config([*args, *extra])
        return finetune.tokenize(cfg, stage_dir(cfg, "finetune")), stage_dir(cfg, "finetune").path / finetune.EXAMPLES

    counts, examples = tokenize()
    assert tokenized == [16, 0]  # the training records, the held-out ones
    assert counts == {"records": 16, "prompts": 8, "temperatures": [0.0, 1.0]}
    written = examples.stat()
    assert tokenize() == (counts, examples) and tokenized == [16, 0]  # requeued: read, not tokenized again
    assert (examples.stat().st_ino, examples.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    other_counts, other = tokenize("train.finetune.lr=1e-4", run="lr-1e-4")
    assert other != examples and other.stat().st_ino == written.st_ino and tokenized == [16, 0]  # one file, linked
    assert other_counts == counts
    tokenize("train.finetune.max_length=64")
    tokenize("train.finetune.data_fraction=0.5")
    assert tokenized == [16, 0, 16, 0, 8, 0]
    kd, _ = tokenize("train.finetune.loss=kd_forward_kl")
    assert tokenized[-2:] == [16, 0] and "teacher_coverage" in kd
    caches = [p for p in (tmp_path / "finetune-examples").iterdir() if not p.name.startswith(".")]
    assert len(caches) == 4 and not list((tmp_path / "finetune-examples").glob(".*.partial"))
    assert all(stat.S_IMODE(cache.stat().st_mode) == 0o700 for cache in caches)  # private, as the distilled records


PARALLEL = [
    "train.finetune.log_every=1",
    "train.finetune.parallel_draft.enabled=true",
    "train.finetune.parallel_draft.k=4",
]


def test_parallel_draft_finetune_logs_each_offset_and_resumes_to_the_uninterrupted_run(distilled, tmp_path):
    """P-F with parallel drafting: the pretrained drafter gets a mask token (an id the data never uses, its
    vocabulary unchanged), each offset's loss is logged, and a run preempted mid-way resumes to the same losses
    and the same drafter as the uninterrupted one."""
    reference_args = overrides(distilled, "run=parallel", *PARALLEL)
    run_stage("finetune", reference_args)
    reference = stage_dir(compose_config(reference_args), "finetune").path
    metrics = read_metrics(reference)
    assert len(metrics) == 20 and all(f"loss_offset_{j}" in m for m in metrics.values() for j in (1, 2, 3, 4))
    drafter = AutoModelForCausalLM.from_pretrained(reference / "drafter")
    assert drafter.config.pard_k == 4 and drafter.config.vocab_size == 49152
    assert drafter.config.pard_token in load_tokenizer(str(reference / "drafter")).all_special_ids

    args = overrides(distilled, "run=parallel-preempted", *PARALLEL)
    path, _, _ = preempt_stage("finetune", args, tmp_path, steps=4, stops_before=20)
    run_stage("finetune", args)
    keys = ("loss", "loss_offset_1", "loss_offset_2", "loss_offset_3", "loss_offset_4")
    assert {step: [m[key] for key in keys] for step, m in read_metrics(path).items()} == {
        step: [m[key] for key in keys] for step, m in metrics.items()
    }
    ours, theirs = (load_file(p / "drafter" / "model.safetensors") for p in (path, reference))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_parallel_draft_finetune_of_a_reduced_vocabulary_with_kd_serves_the_eval_stage(distilled, capsys):
    """F-only, a reduced vocabulary (its mask: a drafter id of its own, N + 1) and KD to the target's top-k; the
    eval stage drafts K tokens per forward with it, exactly at T=0, and measures a round's drafting cost."""
    args = overrides(
        distilled,
        "train.finetune.mode=finetune_only",
        "drafter.name=tiny-ci-r512",
        "drafter.reduced_vocab=512",
        "train.finetune.loss=kd_forward_kl",
        "run=parallel-kd",
        *PARALLEL,
    )
    assert cli(["finetune", *args]) == 0
    path = stage_dir(compose_config(args), "finetune").path
    drafter = AutoModelForCausalLM.from_pretrained(path / "drafter")
    assert (drafter.config.vocab_size, drafter.config.pard_token, drafter.config.pard_k) == (514, 513, 4)
    eval_args = [
        *args,
        "eval.temperatures=[0.0]",
        "eval.num_prompts=2",
        "eval.methods=[target,speculative]",
        "eval.k_sweep=[2]",
        "eval.seeds=[0]",
    ]
    assert cli(["eval", *eval_args]) == 0
    metrics = json.loads((stage_dir(compose_config(eval_args), "eval").path / "metrics.json").read_text())
    assert metrics["lossless"]["exact"] == metrics["lossless"]["outputs_checked"] > 0
    assert set(metrics["costs"]["draft"]) == {"2", "4"}  # measured forwards, not K x c
    capsys.readouterr()
    assert cli(["eval", *eval_args, f"eval.drafter_path={path / 'drafter'}", "eval.k_sweep=[6]", "run=k6"]) == 2
    assert capsys.readouterr().err.startswith("error: K=6 draft tokens, but this parallel drafter learned 4 positions")


def first_batch_losses(cfg, target_path: str) -> tuple[float, float]:
    """The F-only finetune's initial drafter on its first batch, computed here from the distilled records: the
    mean forward KL(p || q) to the target's renormalised top-k p (CE where the top-k is unknown), and plain CE."""
    tc = cfg.train.finetune
    tokenizer = load_tokenizer(target_path)
    examples = finetune_examples(
        read_records(stage_dir(cfg, "distill").path / "records"), tokenizer, tc.max_length, TokenStrings(tokenizer)
    )
    assert cfg.drafter.reduced_vocab is None and tc.grad_accum == 1
    model, _ = build_drafter(cfg.drafter, target_path, None, cfg.seed)  # the stage's init, seeded alike
    first = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed))[: tc.batch_size]
    batch = Collator(tokenizer.pad_token_id, None)([examples[i] for i in first.tolist()])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    log_q = torch.log_softmax(logits[:, :-1].double(), -1)  # position t predicts token t + 1
    labels = batch["labels"][:, 1:]
    top_ids, top_logprobs = batch["teacher_ids"][:, 1:], batch["teacher_logprobs"][:, 1:]
    kd, ce = [], []
    for row, t in (labels != IGNORE).nonzero().tolist():
        ce.append(-float(log_q[row, t, labels[row, t]]))
        known = top_ids[row, t] >= 0
        if known.any():
            p = torch.softmax(top_logprobs[row, t][known].double(), -1)
            kd.append(float((p * (p.log() - log_q[row, t, top_ids[row, t][known]])).sum()))
        else:
            kd.append(ce[-1])
    return sum(kd) / len(kd), sum(ce) / len(ce)


def test_finetune_with_a_kd_loss_on_the_targets_top_k(distilled, smollm_path):
    args = overrides(
        distilled,
        "train.finetune.mode=finetune_only",
        "drafter.name=tiny-ci-kd",
        "train.finetune.loss=kd_forward_kl",
        "train.finetune.log_every=1",
    )
    assert cli(["finetune", *args]) == 0
    path = stage_dir(compose_config(args), "finetune").path
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert 0.3 < counts["teacher_coverage"] < 1.0  # stops, EOS and off-top-k tokens keep CE
    curve = logged_losses(path)
    # Step 1's loss is the initial drafter's, before any update: the KD loss of the first batch, not its CE.
    kd, ce = first_batch_losses(compose_config(args), smollm_path)
    assert curve[0] == pytest.approx(kd, rel=1e-4) and abs(kd - ce) > 0.05, (curve[0], kd, ce)
    assert len(curve) == 20 and sum(curve[-3:]) / 3 < curve[0] - 0.3, curve  # as pretraining's: over the run


@pytest.mark.parametrize("launch", [[], TWO_PROCESSES])
def test_drafter_with_another_tokenizer_is_refused_before_any_compute(gemma_path, tmp_path, capsys, launch):
    """The stage's own process checks, before it tokenizes anything or starts a training process."""
    args = overrides(
        tmp_path, "drafter.source=local", f"drafter.path={gemma_path}", "drafter.name=gemma-as-drafter", *launch
    )
    assert cli(["pretrain", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: gemma-as-drafter's tokenizer is not the target's") and "\n" not in error
    assert not (tmp_path / "cache").exists()  # no data was tokenized
    assert not (stage_dir(compose_config(args), "pretrain").path / "worker-errors").exists()  # no worker started


def test_user_error_inside_an_accelerate_worker_ends_the_stage_in_one_line(tmp_path, capsys, monkeypatch):
    """Workers only read the data the stage tokenized: started without it (as a worker alone would be), both gloo
    workers fail in one line each, and the stage raises their error, as one process would."""
    from pipeline.stages import pretrain

    monkeypatch.setattr(pretrain, "write_pretrain_tokens", lambda cfg, tokenizer, max_tokens: {"corpora": {}})
    args = overrides(tmp_path, *TWO_PROCESSES)
    assert cli(["pretrain", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "holds no tokenized pretraining data" in error and "\n" not in error
    path = stage_dir(compose_config(args), "pretrain").path
    # Raised in the workers (the first to fail may take the other down before it gets as far).
    reports = [json.loads(p.read_text()) for p in (path / "worker-errors").glob("rank-*.json")]
    assert reports and all(r["user_error"] and r["type"].endswith("FileNotFoundError") for r in reports)
    assert not (path / MARKER).exists()


def test_pretrain_reads_its_token_budget_with_c4_going_on_after_sharegpt(tmp_path, monkeypatch):
    """The acceptance of issue 27: a token budget over C4 (a local stand-in) and a ShareGPT that runs out first."""
    from standins import datasets_root

    from pipeline.training import data
    from tests.helpers import short_sharegpt

    monkeypatch.setattr(data, "iter_conversations", short_sharegpt(4))
    c4 = datasets_root(tmp_path / "data")["c4"]
    corpora = f"[{{name:c4,weight:0.5,hub_dataset:'{c4}',hub_subset:en}},{{name:sharegpt,weight:0.5}}]"
    args = overrides(
        tmp_path,
        f"data.pretrain_corpora={corpora}",
        "train.pretrain.token_budget=2560",
        "train.pretrain.max_steps=null",
    )
    assert cli(["pretrain", *args]) == 0
    counts = json.loads((stage_dir(compose_config(args), "pretrain").path / "manifest.json").read_text())["counts"]
    assert counts["tokens"] == 2560 and counts["steps"] == 2560 // (4 * 128)  # the budget, read and trained on
    assert counts["corpora"]["sharegpt"]["exhausted"] and counts["corpora"]["sharegpt"]["documents"] == 4
    assert not counts["corpora"]["c4"]["exhausted"] and counts["corpora"]["c4"]["tokens"] > 2560 / 2


def test_packed_finetune_trains_on_the_same_examples(distilled):
    unpacked_args = overrides(distilled, *PRETRAIN, "train.finetune.log_every=1")  # test_finetune_from_pretrain's
    assert cli(["finetune", *unpacked_args]) == 0  # done already when that test ran
    args = overrides(distilled, "run=packed", "train.finetune.pack=true", "train.finetune.log_every=1")
    assert cli(["finetune", *args]) == 0
    path = stage_dir(compose_config(args), "finetune").path
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["records"] == 16 and counts["steps"] == 20
    curve = logged_losses(path)
    assert len(curve) == 20 and sum(curve[-3:]) / 3 < curve[0] - 0.3, curve
    unpacked = logged_losses(stage_dir(compose_config(unpacked_args), "finetune").path)
    assert curve == pytest.approx(unpacked, rel=1e-3)  # the same examples per step, rows packed


@pytest.fixture(scope="session")
def on_policy_finetuned(distilled) -> list[str]:
    """An uninterrupted finetune with the on-policy phase, in a process of its own (run_stage): its overrides.
    run=on-policy: the session's plain finetune of the same prompts lives beside it."""
    args = overrides(distilled, "run=on-policy", *ON_POLICY)
    run_stage("finetune", args)
    return args


def test_finetune_with_on_policy_alignment_after_sft(distilled, on_policy_finetuned):
    """The phase inside the stage on the ci recipe (full-vocabulary drafter): SFT, then rounds of drafter
    rollouts scored by the SmolLM2 target, each checkpointed and logged with the held-out estimate."""
    args = on_policy_finetuned
    path = stage_dir(compose_config(args), "finetune").path
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["records"] == 12 and counts["steps"] == 20  # 2 of the 8 prompts held out of both phases
    assert counts["on_policy"]["steps"] == 6 and 0 < counts["on_policy"]["heldout_after"]["heldout_t1_acceptance"] < 1
    metrics = read_metrics(path)
    assert sorted(metrics) == list(range(1, 27))  # the phase's steps follow SFT's
    assert [s for s in metrics if "on_policy/heldout_t0_agreement" in metrics[s]] == [23, 26]
    assert latest_checkpoint(path / "on_policy").name == "step-00000006"
    assert (path / "drafter").exists()
    assert (
        stage_dir(compose_config(overrides(distilled)), "finetune").config_hash
        != stage_dir(compose_config(args), "finetune").config_hash
    )  # the phase is part of the result


def test_finetune_preempted_in_the_on_policy_phase_resumes_to_the_uninterrupted_run(
    distilled, on_policy_finetuned, tmp_path
):
    """SIGTERM (as Slurm preempts) inside the phase, after SFT's 20 steps; the stage run again continues from
    the phase's checkpoint to the same losses and the same drafter as a run never stopped."""
    reference_args = on_policy_finetuned
    args = overrides(distilled, "run=on-policy-preempted", *ON_POLICY)
    path, _, _ = preempt_stage("finetune", args, tmp_path, steps=22, stops_before=26)
    run_stage("finetune", args)
    reference = stage_dir(compose_config(reference_args), "finetune").path
    assert read_metrics(path).keys() == read_metrics(reference).keys()
    for step, metrics in read_metrics(reference).items():
        key = "loss" if step <= 20 else "on_policy/loss"
        assert read_metrics(path)[step][key] == metrics[key], step
    ours, theirs = (load_file(p / "drafter" / "model.safetensors") for p in (path, reference))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_scaling_finetunes_nested_fractions_and_fits_acceptance_against_data(distilled, capsys):
    """`specdraft scaling` on the ci recipe: a finetune per series and fraction (on-policy too), the pretrained
    drafter as baseline, an anchor through the eval stage, scaling.json/png, and a rerun that only reads it."""
    args = overrides(
        distilled,
        "scaling.fractions=[0.5,1]",
        "scaling.series=[pf,f_only,pf_on_policy]",
        "scaling.heldout_prompts=2",
        "scaling.anchors=[pf@0.5]",
        "eval.temperatures=[0.0]",
        "train.finetune.on_policy.rounds=1",
        "train.finetune.on_policy.steps_per_round=2",
        "train.finetune.on_policy.batch_size=2",
        "train.finetune.on_policy.heldout_prompts=2",
    )
    assert cli(["scaling", *args]) == 0
    path = stage_dir(compose_config(args), "scaling").path
    result = json.loads((path / "scaling.json").read_text())
    points = result["points"]
    assert sorted(points) == [
        "f_only@0.5",
        "f_only@1",
        "pf@0.5",
        "pf@1",
        "pf_on_policy@0.5",
        "pf_on_policy@1",
        "pretrained",
    ]
    # 8 prompts at T 0 and 1; on-policy holds 2 prompts out of both phases
    assert [points[f"pf@{f}"]["records"] for f in ("0.5", "1")] == [8, 16]
    assert [points[f"pf_on_policy@{f}"]["records"] for f in ("0.5", "1")] == [6, 12]
    assert points["pf@1"]["drafter"] == str(
        stage_dir(compose_config(overrides(distilled)), "finetune").path / "drafter"
    )
    for point in points.values():
        assert 0 <= point["t0_agreement"]["mean"] <= 1 and 0 < point["t1_acceptance"]["mean"] < 1
        assert 1 <= point["predicted"]["T0"]["tau"] <= 1 + result["K"]
    assert set(result["series"]) == {"pf", "f_only", "pf_on_policy"}
    assert all("tau_gain_per_doubling" in fit for fit in result["series"].values())
    assert (
        result["anchors"]["pf@0.5"]["T0"]["tau"] >= 1
        and result["anchors"]["pf@0.5"]["tau_measured_over_predicted"]["T0"] > 0
    )
    assert (path / "scaling.png").stat().st_size > 0 and (path / MARKER).exists()
    capsys.readouterr()
    assert cli(["scaling", *args]) == 0  # complete: prints the table, trains and measures nothing
    printed = capsys.readouterr().out
    assert "complete for this config; skipping" in printed and "\npf: tau T0 " in printed


HEAD = [
    "drafter=eagle3-ci",
    "train.pretrain.max_steps=6",
    "train.pretrain.log_every=1",
    "train.finetune.max_steps=6",
    "train.finetune.log_every=1",
]


@pytest.fixture(scope="session")
def head_pretrained(distilled):
    """An EAGLE-3 head of the ci target pretrained beside the distilled records (its own process, run_stage)."""
    run_stage("pretrain", overrides(distilled, *HEAD))
    return distilled


def test_head_pretrain_learns_and_a_preempted_one_resumes_to_the_same_losses(head_pretrained, tmp_path):
    reference = stage_dir(compose_config(overrides(head_pretrained, *HEAD)), "pretrain").path
    curve = logged_losses(reference)
    assert len(curve) == 6 and curve[-1] < curve[0], curve
    head = AutoModelForCausalLM.from_pretrained(reference / "drafter")
    assert head.config.aux_layer_ids == [2, 15, 27] and head.config.draft_vocab_size == 2048  # 30 layers: vLLM's
    assert len(VocabMap.load(reference / "drafter").target_ids) == 2048
    args = overrides(tmp_path, *HEAD)
    path, _, _ = preempt_stage("pretrain", args, tmp_path, steps=2, stops_before=6)
    run_stage("pretrain", args)
    assert logged_losses(path) == logged_losses(reference)  # exactly: same head, optimizer, schedule, data, states


@pytest.fixture(scope="session")
def head_finetuned(head_pretrained):
    """The head finetuned (P-F) on the pair's records, then measured by the eval stage on our engine: its args."""
    args = overrides(head_pretrained, *HEAD)
    assert cli(["finetune", *args]) == 0
    # K = eval.num_draft_tokens, as vLLM serves the export: the two engines' acceptance compare at one K
    assert cli(["eval", *args, "eval.methods=[target,speculative,hybrid]", "eval.choose_k=false"]) == 0
    return args


def eval_metrics(args: list[str]) -> dict:
    """The eval stage's metrics.json (eval/, or eval-vllm/ with eval.engine=vllm: the folder ignores other keys)."""
    return json.loads((stage_dir(compose_config(args), "eval").path / "metrics.json").read_text())


def test_head_finetunes_on_the_pair_and_the_eval_drafts_with_it_losslessly(head_finetuned):
    assert len(logged_losses(stage_dir(compose_config(head_finetuned), "finetune").path)) == 6
    metrics = eval_metrics(head_finetuned)
    lossless = metrics["lossless"]
    drafted = set(metrics["results"]["de-en"]["T=0.0"]["seeds"]["0"]) - {"target"}
    assert {"speculative", "hybrid"} <= drafted  # and the K the costs chose, where it differs from the recipe's
    assert lossless["exact"] == lossless["outputs_checked"] == 3 * len(drafted) and not lossless["mismatches"], lossless
    for temperature in ("T=0.0", "T=1.0"):
        head = metrics["results"]["de-en"][temperature]["seeds"]["0"]["speculative"]
        assert head["tau"] >= 1 and len(head["acceptance_per_position"]) == 4, head


def test_scaling_scores_heads_as_it_scores_standalone_drafters(head_finetuned):
    """`specdraft scaling` with a head: the pair's finetuned head (P-F on all the data: the fixture's own finetune,
    reused), one on half the data, and the general (pretrained-only) head, scored from the target's states."""
    args = [*head_finetuned, "scaling.fractions=[0.5,1]", "scaling.series=[pf]", "scaling.heldout_prompts=2"]
    args.append("scaling.anchors=[]")
    assert cli(["scaling", *args]) == 0
    result = json.loads((stage_dir(compose_config(args), "scaling").path / "scaling.json").read_text())
    points = result["points"]
    assert sorted(points) == ["pf@0.5", "pf@1", "pretrained"] and result["drafter"] == "eagle3-ci"
    assert points["pf@1"]["drafter"] == str(stage_dir(compose_config(head_finetuned), "finetune").path / "drafter")
    assert [points[f"pf@{f}"]["records"] for f in ("0.5", "1")] == [8, 16]
    for point in points.values():
        assert 0 <= point["t0_agreement"]["mean"] <= 1 and 0 < point["t1_acceptance"]["mean"] < 1
        assert 1 <= point["predicted"]["T0"]["tau"] <= 1 + result["K"]
    assert result["costs"]["c"] > 0 and "tau_gain_per_doubling" in result["series"]["pf"]


def test_vllm_serves_the_exported_head_with_the_targets_own_greedy_outputs(head_finetuned, vllm_server):
    """The export in vLLM's EAGLE-3 format, served by vLLM's eagle3 method beside the ci target (SmolLM2, a Llama):
    its greedy outputs are the target server's (the session's: target_alone_on), and it accepts the drafts our
    engine accepts (same layers)."""
    assert cli(["export", *head_finetuned]) == 0
    folder = stage_dir(compose_config(head_finetuned), "export").path / "drafter"
    vocab = VocabMap.load(stage_dir(compose_config(head_finetuned), "finetune").path / "drafter")
    assert AutoConfig.from_pretrained(folder).eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    assert torch.equal(load_file(folder / "model.safetensors")["d2t"] + torch.arange(2048), vocab.target_ids)
    readme = (folder / "README.md").read_text()
    assert '"method": "eagle3"' in readme
    assert f"eval.engine=vllm eval.drafter_path={folder.resolve()} eval.temperatures=[0]'" in readme  # runs here
    # serve-bench's ladder serves the head as it serves a standalone drafter: the export's speculative_config
    cfg = compose_config(head_finetuned)
    assert serve_bench.exported_config(cfg, stage_dir(cfg, "serve-bench")) == {
        "method": "eagle3",
        "model": str(folder.resolve()),
        "num_speculative_tokens": cfg.eval.num_draft_tokens,
        "single_kv_group": False,
        "target_args": [],  # a Llama: vLLM's own model hands the head its states
    }
    served = [*head_finetuned, "eval.engine=vllm", f"eval.drafter_path={folder}", "eval.temperatures=[0]"]
    with target_alone_on(vllm_server):
        assert cli(["eval", *served]) == 0  # the ci recipe serves float32: exact greedy outputs
    metrics = eval_metrics(served)
    assert metrics["lossless"]["exact"] == metrics["lossless"]["outputs_checked"] == 3, metrics["lossless"]
    report = (stage_dir(compose_config(served), "eval").path / "report.md").read_text()
    assert f"drafter `{folder}` (vLLM method eagle3)" in report
    vllm = metrics["results"]["de-en"]["T=0.0"]["seeds"]["0"]["vllm_speculative"]
    ours = eval_metrics(head_finetuned)["results"]["de-en"]["T=0.0"]["seeds"]["0"]["speculative"]
    assert vllm["draft_tokens"] > 0 and abs(vllm["alpha"] - ours["alpha"]) < 0.1, (vllm, ours)
