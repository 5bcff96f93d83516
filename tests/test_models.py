"""Offline models: GGUF packages convert once to HF folders that load and generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import REPO_ROOT, compose_config
from pipeline.errors import ModelNotFoundError
from pipeline.models.provision import CHECKSUMS, load_model, load_tokenizer, verify_checksums
from pipeline.prompts import build_prompt

pytestmark = pytest.mark.slow


def greedy(path: str, prompt: str, max_new_tokens: int = 30) -> str:
    tokenizer, model = load_tokenizer(path), load_model(path)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)


def test_gemma_target_translates_german_to_english(gemma_path):
    cfg = compose_config(["recipe=local", "lang=de-en"])
    tokenizer = load_tokenizer(gemma_path)
    assert len(tokenizer) == 262144
    prompt = build_prompt(
        cfg.target, cfg.lang, "Der Hund läuft durch den Park, weil er seinen Ball finden will.", tokenizer
    )
    assert prompt.endswith("\nEnglish:")
    assert tokenizer(prompt).input_ids[0] == tokenizer.bos_token_id  # Gemma only translates after <bos>
    translation = greedy(gemma_path, prompt).split("\n")[0].strip().lower()
    assert "dog" in translation and "park" in translation and "ball" in translation, translation


def test_smollm_fixture_uses_its_chat_template(smollm_path):
    cfg = compose_config(["recipe=ci", "lang=fr-en"])
    tokenizer = load_tokenizer(smollm_path)
    prompt = build_prompt(cfg.target, cfg.lang, "Bonjour tout le monde.", tokenizer)
    assert "<|im_start|>user\nTranslate French to English: Bonjour tout le monde.<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # The assistant's turn answers the user's request (SmolLM2-135M's French is poor, but it tries); without
    # the template it rambles about the single word "bonjour".
    answer = greedy(smollm_path, prompt, max_new_tokens=24).strip().lower()
    assert "bonjour tout le monde" in answer and "translates to" in answer and "world" in answer, answer


def test_converted_folder_is_checksummed(smollm_path, tmp_path):
    folder = Path(smollm_path)
    checksums = json.loads((folder / CHECKSUMS).read_text())
    assert "model.safetensors" in checksums and "config.json" in checksums
    verify_checksums(folder)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in checksums:
        (copy / name).write_bytes((folder / name).read_bytes())
    (copy / CHECKSUMS).write_text(json.dumps(checksums))
    with (copy / "config.json").open("a") as handle:
        handle.write(" ")
    with pytest.raises(ModelNotFoundError, match="does not match its checksum"):
        verify_checksums(copy)


def test_a_packaged_gguf_whose_sha256_is_not_the_pinned_one_is_never_converted(tmp_path):
    """The targets shipped in PyPI packages pin their GGUF's sha256: another file in the package (a tampered or
    republished release) is refused in one line before anything is converted or written."""
    from pipeline.models.provision import model_path

    cfg = compose_config(["target=smollm2-135m", "target.gguf_sha256=" + "0" * 64])
    with pytest.raises(ModelNotFoundError, match=r"not the pinned 0{64} of target smollm2-135m: reinstall"):
        model_path(cfg.target, tmp_path)
    assert {path.name for path in tmp_path.iterdir()} <= {"smollm2-135m.lock"}  # no folder, no partial one
    assert len(compose_config(["target=smollm2-135m"]).target.gguf_sha256) == 64
    assert len(compose_config(["target=gemma3-270m"]).target.gguf_sha256) == 64


def test_a_gguf_converts_to_the_same_tokenizer_files_whether_the_hub_is_off_or_not(tmp_path):
    """transformers records the hub's offline mode in a saved tokenizer_config.json: converted on a hub-free node
    and on a login node, one GGUF would fingerprint as two targets and every later stage would read as stale
    (seen rehearsing a GPU run, 2026-11-29)."""
    target = compose_config(["target=smollm2-135m"]).target
    script = (
        "import sys; from pathlib import Path; from pipeline.models.provision import gguf_tokenizer, packaged_gguf; "
        "gguf = packaged_gguf(sys.argv[1], sys.argv[2], Path(sys.argv[3])); "
        "gguf_tokenizer(gguf, None).save_pretrained(sys.argv[3])"
    )
    saved = {}
    for offline in ("1", "0"):
        folder = tmp_path / f"offline-{offline}"
        env = {**os.environ, "HF_HUB_OFFLINE": offline}
        subprocess.run(
            [sys.executable, "-c", script, target.path, target.gguf_file, str(folder)],
            env=env,
            check=True,
            cwd=REPO_ROOT,
        )
        saved[offline] = {name: (folder / name).read_bytes() for name in ("tokenizer_config.json", "tokenizer.json")}
    assert saved["1"] == saved["0"]
