"""Drafter models: shapes of the config group, the compatibility gate, a saved drafter reloads and drafts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pipeline.config import compose_config
from pipeline.models.drafter import build_drafter, check_drafter, init_drafter, load_drafter, reduced_vocab, save_drafter
from pipeline.models.provision import load_model, load_tokenizer
from pipeline.models.vocab import TokenizerMismatchError, VocabMap


def parameters(drafter_name: str, target_vocab: int, tmp_path) -> float:
    """Millions of parameters of a drafter built (on the meta device) for a target of this vocabulary."""
    LlamaConfig(vocab_size=target_vocab, bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path)
    cfg = compose_config([f"drafter={drafter_name}"])
    with torch.device("meta"):
        model = init_drafter(cfg.drafter, str(tmp_path), None, seed=0)
    return sum(p.numel() for p in model.parameters()) / 1e6


@pytest.mark.parametrize(
    "drafter_name, target_vocab, millions",
    # gemma-250m: the Table 4 shape with head_dim 48 and tied 256k embeddings counts 228M.
    [("llama-68m", 32000, 68.0), ("vicuna-68m", 32000, 68.0), ("gemma-250m", 256000, 228.0), ("tiny-ci", 49152, 3.2)],
)
def test_drafter_shapes_match_the_paper(drafter_name, target_vocab, millions, tmp_path):
    assert parameters(drafter_name, target_vocab, tmp_path) == pytest.approx(millions, rel=0.05)


def test_gemma_drafter_has_table_4_architecture(tmp_path):
    LlamaConfig(vocab_size=256000).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = init_drafter(compose_config(["drafter=gemma-250m"]).drafter, str(tmp_path), None, seed=0)
    c = model.config
    assert (c.model_type, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (
        "gemma", 768, 6144, 16, 2)
    assert (c.num_hidden_layers, c.hidden_activation, c.rms_norm_eps) == (2, "gelu_pytorch_tanh", 1e-6)


@pytest.mark.slow
def test_reduced_vocab_drafter_for_gemma(gemma_path):
    cfg = compose_config(["recipe=local"])
    tokenizer = load_tokenizer(gemma_path)
    counts = torch.zeros(262144)
    counts[tokenizer("The dog runs through the park because it wants to find its ball.")["input_ids"]] = 1
    vocab = reduced_vocab(cfg.drafter, counts, tokenizer)
    assert vocab.drafter_vocab_size == 16385 and set(tokenizer.all_special_ids) <= set(vocab.target_ids.tolist())
    model, vocab = build_drafter(cfg.drafter, gemma_path, vocab, seed=0)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    assert 3 <= params <= 16, params  # CPU-sized: c well under 0.1 of a target step
    assert model.config.vocab_size == 16385
    assert model.config.eos_token_id == int(vocab.to_drafter[tokenizer.eos_token_id]) != vocab.unk_id


@pytest.mark.slow
def test_saved_drafter_reloads_and_drafts_for_the_target(smollm_path, tmp_path):
    """A full-vocabulary drafter folder is an HF assistant_model: greedy assisted decoding equals the target's."""
    cfg = compose_config(["recipe=ci"])
    model, vocab = build_drafter(cfg.drafter, smollm_path, None, seed=0)
    save_drafter(model, smollm_path, vocab, tmp_path / "drafter")
    drafter = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter")
    assert torch.equal(drafter.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert check_drafter(str(tmp_path / "drafter"), smollm_path) is None

    target, tokenizer = load_model(smollm_path), load_tokenizer(smollm_path)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    plain = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    assisted = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert torch.equal(plain, assisted)


@pytest.mark.slow
def test_reduced_vocab_drafter_folder_round_trips(smollm_path, tmp_path):
    cfg = compose_config(["recipe=ci", "drafter.reduced_vocab=100"])
    tokenizer = load_tokenizer(smollm_path)
    vocab = reduced_vocab(cfg.drafter, torch.arange(49152, dtype=torch.float), tokenizer)
    model, _ = build_drafter(cfg.drafter, smollm_path, vocab, seed=0)
    save_drafter(model, smollm_path, vocab, tmp_path / "drafter")
    loaded, loaded_vocab = load_drafter(str(tmp_path / "drafter"), smollm_path)
    assert torch.equal(loaded_vocab.target_ids, vocab.target_ids) and loaded.config.vocab_size == 101
    with torch.no_grad():
        logits = loaded(input_ids=vocab.encode(torch.tensor([[1, 49151, 5]]))).logits
    probs = torch.softmax(loaded_vocab.expand_logits(logits[0, -1]), -1)
    assert probs.shape == (49152,) and probs[vocab.target_ids].sum().item() == pytest.approx(1.0)


@pytest.mark.slow
def test_gate_refuses_another_tokenizer_or_vocabulary_size(smollm_path, gemma_path, tmp_path):
    cfg = compose_config(["recipe=ci"])
    model, _ = build_drafter(cfg.drafter, smollm_path, None, seed=0)
    save_drafter(model, gemma_path, None, tmp_path / "gemma-tokenizer")  # a SmolLM-sized drafter, Gemma's tokenizer
    with pytest.raises(TokenizerMismatchError, match="tokenizer is not the target's"):
        check_drafter(str(tmp_path / "gemma-tokenizer"), smollm_path)

    model.resize_token_embeddings(49152 + 64)  # right tokenizer, padded to another size
    save_drafter(model, smollm_path, None, tmp_path / "padded")
    with pytest.raises(TokenizerMismatchError, match="predicts 49216 tokens .* needs 49152"):
        check_drafter(str(tmp_path / "padded"), smollm_path)

    VocabMap(torch.arange(10), target_vocab_size=1000).save(tmp_path / "padded")  # a map made for another target
    with pytest.raises(TokenizerMismatchError, match="vocab map covers 1000 target ids"):
        check_drafter(str(tmp_path / "padded"), smollm_path)
