"""The pretrain and finetune stages end to end on the `ci` recipe, through the real CLI and accelerate."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.cli import main as cli
from pipeline.config import REPO_ROOT, compose_config
from pipeline.models.provision import load_model, load_tokenizer
from pipeline.models.vocab import VocabMap
from pipeline.prompts import build_prompt
from pipeline.rundir import MARKER, stage_dir
from pipeline.training.launch import read_metrics
from pipeline.training.loop import EXIT_PREEMPTED

pytestmark = pytest.mark.slow

PRETRAIN = ["train.pretrain.log_every=1"]

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


def losses(stage_path) -> list[float]:
    metrics = read_metrics(stage_path)
    return [metrics[step]["loss"] for step in sorted(metrics)]


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory, smollm_path):
    """One uninterrupted 1-process ci pretrain, logging every step."""
    runs_dir = tmp_path_factory.mktemp("pretrained")
    assert cli(["pretrain", *overrides(runs_dir, *PRETRAIN)]) == 0
    return runs_dir


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
                record = {"id": f"s{i}", "temperature": temperature, "sample": 0, "prompt": prompt, "response": ref,
                          "finish_reason": finish_reason, "stop_reason": stop_reason,
                          "prompt_tokens": len(tokenizer(prompt).input_ids), "completion_tokens": 12, "seed": 0,
                          "model": cfg.target.name, "revision": None}
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
    return [{tokenizer.decode([int(i)]): float(logprobs[t, i]) for i in logprobs[t].topk(k).indices}
            for t in range(start - 1, ids.shape[1] - 1)]


def test_pretrain_writes_a_drafter_and_its_loss_falls(pretrained):
    cfg = compose_config(overrides(pretrained))
    path = stage_dir(cfg, "pretrain").path
    assert (path / MARKER).exists()
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["steps"] == 20 and counts["tokens_seen"] == 20 * 4 * 128 and 190 <= counts["documents"] <= 200
    curve = losses(path)
    assert len(curve) == 20 and sum(curve[-3:]) / 3 < curve[0] - 0.3, curve
    drafter = AutoModelForCausalLM.from_pretrained(path / "drafter")
    assert drafter.config.vocab_size == 49152 and VocabMap.load(path / "drafter") is None


def test_preempted_pretrain_exits_incomplete_and_resumes_to_the_same_losses(pretrained, tmp_path):
    args = overrides(tmp_path, *PRETRAIN)
    path = stage_dir(compose_config(args), "pretrain").path
    child = subprocess.Popen([sys.executable, "-m", "pipeline", "pretrain", *args], cwd=REPO_ROOT)
    deadline = time.time() + 120
    while len(read_metrics(path)) < 3 and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)  # as Slurm preempts
    assert child.wait(timeout=120) == EXIT_PREEMPTED
    assert not (path / MARKER).exists() and not (path / "drafter").exists()
    stopped_at = max(read_metrics(path))
    assert 3 <= stopped_at < 20 and (path / "checkpoints" / f"step-{stopped_at:08d}").exists()

    assert cli(["pretrain", *args]) == 0  # resume=auto
    assert (path / MARKER).exists()
    reference = stage_dir(compose_config(overrides(pretrained)), "pretrain").path
    assert losses(path) == losses(reference)  # exactly: same weights, optimizer, schedule, data position


def test_two_process_accelerate_launch_matches_one_process(pretrained, tmp_path):
    args = overrides(tmp_path, *PRETRAIN, "train.pretrain.launch=ddp-cpu", "train.pretrain.num_processes=2")
    assert cli(["pretrain", *args]) == 0
    path = stage_dir(compose_config(args), "pretrain").path
    reference = stage_dir(compose_config(overrides(pretrained)), "pretrain").path
    # Each step's global batch is split over the two gloo processes: same data, same loss up to float sums.
    assert losses(path) == pytest.approx(losses(reference), rel=1e-4)
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["processes"] == 2 and counts["tokens_seen"] == 20 * 4 * 128  # a real 2-rank gloo group
    two = AutoModelForCausalLM.from_pretrained(path / "drafter").state_dict()
    one = AutoModelForCausalLM.from_pretrained(reference / "drafter").state_dict()
    assert all(torch.allclose(two[name], one[name], atol=1e-4) for name in one)


def test_finetune_from_pretrain_on_distilled_records(distilled):
    args = overrides(distilled, *PRETRAIN, "train.finetune.log_every=1")
    assert cli(["finetune", *args]) == 0
    path = stage_dir(compose_config(args), "finetune").path
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["records"] == 16 and counts["temperatures"] == [0.0, 1.0] and counts["steps"] == 20
    curve = losses(path)
    assert curve[-1] < curve[0], curve
    drafter = AutoModelForCausalLM.from_pretrained(path / "drafter")
    pretrained_drafter = AutoModelForCausalLM.from_pretrained(stage_dir(compose_config(args), "pretrain").path / "drafter")
    assert not torch.equal(drafter.lm_head.weight, pretrained_drafter.lm_head.weight)  # it learned from there


def test_finetune_only_with_a_reduced_vocabulary(distilled):
    args = overrides(distilled, "train.finetune.mode=finetune_only", "drafter.name=tiny-ci-r512",
                     "drafter.reduced_vocab=512")
    assert cli(["finetune", *args]) == 0
    path = stage_dir(compose_config(args), "finetune").path
    vocab = VocabMap.load(path / "drafter")
    assert vocab.drafter_vocab_size == 513 and vocab.target_vocab_size == 49152
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["drafter_vocab"] == 513 and counts["label_coverage"] == 1.0  # 512 ids cover these records


def test_finetune_with_a_kd_loss_on_the_targets_top_k(distilled):
    args = overrides(distilled, "train.finetune.mode=finetune_only", "drafter.name=tiny-ci-kd",
                     "train.finetune.loss=kd_forward_kl", "train.finetune.log_every=1")
    assert cli(["finetune", *args]) == 0
    path = stage_dir(compose_config(args), "finetune").path
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert 0.3 < counts["teacher_coverage"] < 1.0  # stops, EOS and off-top-k tokens keep CE
    curve = losses(path)
    assert curve[-1] < curve[0], curve


def test_drafter_with_another_tokenizer_is_refused_before_any_compute(gemma_path, tmp_path, capsys):
    args = overrides(tmp_path, "drafter.source=local", f"drafter.path={gemma_path}", "drafter.name=gemma-as-drafter")
    assert cli(["pretrain", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: gemma-as-drafter's tokenizer is not the target's") and "\n" not in error
    assert not (tmp_path / "cache").exists()  # no data was tokenized
