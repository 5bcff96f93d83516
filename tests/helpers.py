"""What several test files share: the tiny random models the tests build (no hub; the seed makes the weights
reproducible), a reduced-vocabulary copy, the decoding tests' models and prompt, a distribution test, and the
run directories and processes some tests set up or read."""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
)
from transformers.modeling_outputs import CausalLMOutput

from pipeline.config import REPO_ROOT
from pipeline.models.drafter import save_drafter
from pipeline.models.vocab import VocabMap
from pipeline.rundir import stage_dir
from pipeline.speculative.engine import StopCondition
from pipeline.training.launch import read_metrics

VOCAB = 64  # the decoding tests' vocabulary
NO_STOP = StopCondition(tokenizer=None)
PROMPT = torch.tensor([[1, 5, 9, 13, 5, 9, 22, 3]])
SMOLLM_VOCAB = 49152


def tiny_llama(
    seed: int,
    vocab: int,
    hidden: int = 32,
    intermediate: int = 64,
    layers: int = 1,
    kv_heads: int | None = None,
    positions: int = 64,
    **config,
) -> LlamaForCausalLM:
    """A Llama of two attention heads (``kv_heads`` of them shared; None: one each), in eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=kv_heads,
            max_position_embeddings=positions,
            **config,
        )
    ).eval()


def tiny_gemma3(seed: int, vocab: int, layer_types: list[str]) -> Gemma3ForCausalLM:
    """Gemma 3's layout: sliding-window layers (a window of 6, far shorter than the sequences) beside full ones."""
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=len(layer_types),
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=6,
            layer_types=layer_types,
            max_position_embeddings=256,
        )
    ).eval()


class MarkovLM(torch.nn.Module):
    """A causal LM for the statistical decoding tests: the next token's logits are a random table of the last two
    input ids (a second-order Markov chain over ``inputs`` ids, ``vocab`` outputs). It keeps the ids it has read in
    a real DynamicCache, so that the engine's cache and its rollback decide what it conditions on, as for any
    model. A three-token generation took 2.4 ms with it against 13.0 ms with two-layer Llamas (transformers'
    per-module Python) on a 2-core Zen 3, and these tests make 12,000 each."""

    def __init__(self, seed: int, vocab: int, inputs: int | None = None, scale: float = 1.0, **config):
        super().__init__()
        self.inputs = inputs or vocab
        generator = torch.Generator().manual_seed(seed)
        # The extra first row: the first position's "previous token".
        self.register_buffer("table", torch.randn(self.inputs + 1, self.inputs, vocab, generator=generator) * scale)
        self.config = PretrainedConfig(num_hidden_layers=1, vocab_size=vocab, **config)

    @property
    def device(self) -> torch.device:
        return self.table.device

    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0) -> CausalLMOutput:
        ids = input_ids
        if past_key_values is not None:  # the cache's keys are the ids read so far, as (B, 1, length, 1)
            as_states = input_ids[:, None, :, None].float()
            ids = past_key_values.update(as_states, as_states, 0)[0][:, 0, :, 0].long()
        previous = torch.cat([ids.new_full((ids.shape[0], 1), self.inputs), ids[:, :-1]], dim=1)
        logits = self.table[previous, ids][:, -input_ids.shape[1] :]
        return CausalLMOutput(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def reduced_copy(model, vocab_map: VocabMap):
    """The model restricted to the mapped ids: a reduced-vocabulary drafter that agrees with its target often."""
    config = model.config.__class__(**{**model.config.to_dict(), "vocab_size": vocab_map.drafter_vocab_size})
    drafter = model.__class__(config).eval()
    state = model.state_dict()
    rows = torch.cat([vocab_map.target_ids, vocab_map.target_ids[:1]])  # the unk row: any row
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][rows]
    drafter.load_state_dict(state)
    return drafter


def llama(seed: int, vocab: int = VOCAB, hidden: int = 32):
    """The decoding tests' model: two layers, one shared key-value head."""
    return tiny_llama(seed, vocab, hidden, layers=2, kv_heads=1, positions=256)


def gemma(seed: int):
    """The decoding tests' Gemma 3: two sliding-window layers, then a full one."""
    return tiny_gemma3(seed, VOCAB, ["sliding_attention", "sliding_attention", "full_attention"])


def full_greedy(model, prompt: torch.Tensor, steps: int) -> list[int]:
    """Reference greedy decoding by full recomputation, no cache."""
    sequence = prompt
    with torch.inference_mode():
        for _ in range(steps):
            token = model(input_ids=sequence).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, token], dim=1)
    return sequence[0, prompt.shape[1] :].tolist()


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(samples: torch.Tensor, expected: torch.Tensor, max_tv: float | None = 0.01) -> None:
    """``samples`` (N,) of category ids are distributed as ``expected`` (C,). ``max_tv=None``: the chi-square
    test alone (fewer samples than the TV bound needs: sampling noise alone gives TV ~ sqrt(C / N) / 2)."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    n = counts.sum()
    assert counts[expected == 0].sum() == 0, "sampled a token of probability 0"
    support = expected > 0
    chi2 = float(((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum())
    tv = float((counts / n - expected).abs().sum() / 2)
    assert chi2 < chi2_critical(int(support.sum()) - 1), f"chi2 {chi2:.1f}, total variation {tv:.4f}"
    assert max_tv is None or tv < max_tv, f"total variation {tv:.4f}"


def short_sharegpt(count: int):
    """A ShareGPT of ``count`` short conversations (the package's has 17,671), as iter_conversations yields them."""

    def conversations(limit=None):
        rows = [
            {
                "id": f"c{i}",
                "conversations": [
                    {"from": "human", "value": f"Question number {i}?"},
                    {"from": "gpt", "value": f"Answer number {i}."},
                ],
            }
            for i in range(count)
        ]
        return iter(rows[:limit])

    return conversations


def finished_finetune(cfg, smollm_path: str) -> None:
    """What `make finetune` leaves for ``cfg`` (drafter.reduced_vocab=2000): complete distill and pretrain stages and
    a finetune holding a random reduced-vocabulary drafter (its map: the most frequent tokens of some text)."""
    from pipeline.models.drafter import build_drafter

    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    counts = torch.bincount(
        torch.tensor(tokenizer("Guten Morgen, the quick brown fox. " * 50).input_ids), minlength=SMOLLM_VOCAB
    )
    vocab = VocabMap.most_frequent(counts, 2000, always=tokenizer.all_special_ids)
    for stage in ("distill", "pretrain", "finetune"):
        directory = stage_dir(cfg, stage, check_inputs=False)
        assert directory.begin(cfg)
        if stage == "finetune":
            save_drafter(
                build_drafter(cfg.drafter, smollm_path, vocab, seed=0)[0],
                smollm_path,
                vocab,
                directory.path / "drafter",
            )
        directory.finish(cfg, {})


def command_lines() -> list[bytes]:
    """Every process's /proc/PID/cmdline, which every user of the node can read."""
    lines = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(cmdline.read_bytes())
        except OSError:  # the process ended meanwhile
            continue
    return lines


def logged_losses(stage_path: Path) -> list[float]:
    """A training run's logged losses, step by step (its metrics.jsonl)."""
    metrics = read_metrics(stage_path)
    return [metrics[step]["loss"] for step in sorted(metrics)]


def start_stage(stage: str, args: list[str], output) -> subprocess.Popen:
    """``python -m pipeline STAGE``, as make and Slurm run it: in a process group of its own (for killpg), SIGINT
    at its default, as a terminal's shell leaves it (a shell without job control, CI's, starts background jobs
    with SIGINT ignored, and children inherit that)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", stage, *args],
        cwd=REPO_ROOT,
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def run_stage(stage: str, args: list[str]) -> None:
    """The stage to its end as its own process (``python -m pipeline``), as make and Slurm run it. Runs compared
    bit for bit are each started this way: nothing an earlier test left in pytest's process takes part."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", stage, *args], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@contextlib.contextmanager
def target_alone_on(session_server):
    """The vLLM eval's target-alone server (no extra arguments) is ``session_server`` (tests/conftest.py: the ci
    target in the ci recipe's launch), left running: one vLLM start fewer; its speculative server starts as the
    stage starts it."""
    from pipeline.evaluation import vllm_backend

    start = vllm_backend.target_server

    def target_server(cfg, folder, log_dir, extra_args=()):
        return start(cfg, folder, log_dir, extra_args) if extra_args else contextlib.nullcontext(session_server)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_backend, "target_server", target_server)
        yield
