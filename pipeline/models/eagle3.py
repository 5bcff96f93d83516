"""EAGLE-3 heads (Li et al. 2025): a drafter that reads the target's own hidden states.

The head is one Llama-style decoder layer. At context position t it reads the target's residual stream at
three of its layers (``aux_layer_ids``), each RMS-normalised, fused by ``fc`` to the target's width, together
with the embedding of token t + 1 (the target's own embedding, frozen, not part of the head), and predicts
token t + 2 over a draft vocabulary (the project's ``VocabMap``: N target ids). Drafting further than one
token, the head feeds its own output (the residual stream before its final norm) back in place of the
target's fused states: the rollout it is trained for by training-time test (``ttt_loss`` steps).

Layer ids follow vLLM's convention, which its ``eagle_aux_hidden_state_layer_ids`` uses: id i is the residual
stream *entering* decoder layer i (transformers' ``hidden_states[i]`` with ``output_hidden_states``; id 0 the
embeddings, id N the last layer's output before the final norm). vLLM's default is (2, N // 2, N - 3).
Off-by-one layer ids are the most common EAGLE-3 bug: a head trained on other layers than it is served
with drafts from states it never saw, and no error says so.

Module and weight names are those of the EAGLE-3 checkpoints vLLM loads (``fc``, ``midlayer.*``, ``norm``,
``lm_head``), so the export renames nothing; ``fc_norm`` is vLLM's per-layer norm before ``fc``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from pipeline.config import ConfigError
from pipeline.models.vocab import VocabMap

MODEL_TYPE = "specdraft_eagle3"


def decoder_layers(model) -> nn.ModuleList:
    """The target's decoder layers (``model.model.layers``, as every transformers causal LM the pipeline serves
    lays them out); one line where it has none an EAGLE-3 head could read."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(model.model, "norm"):
        raise ConfigError(
            f"the target ({type(model).__name__}) exposes no decoder layers and final norm at model.model.layers / "
            "model.model.norm, so an eagle3 head cannot read its hidden states: choose a standalone drafter"
        )
    return layers


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 layers for a target of ``num_layers`` decoder layers: low, middle, high. A target too
    shallow for them (a dry run's 2-layer stand-in) gets the embeddings, the middle and the last layer's output;
    the export writes the ids into the head's config, so vLLM reads the same layers."""
    ids = [2, num_layers // 2, num_layers - 3]
    return ids if len(set(ids)) == 3 and ids[-1] > ids[1] else [0, num_layers // 2, num_layers]


def check_layer_ids(ids: Sequence[int], num_layers: int, key: str = "drafter.aux_layer_ids") -> list[int]:
    """``ids`` as a list, refused in one line unless each is a residual-stream position of the target."""
    ids = [int(i) for i in ids]
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i <= num_layers for i in ids):
        raise ConfigError(
            f"{key}={ids} must be 3 distinct layer ids in 0..{num_layers} for this {num_layers}-layer target "
            f"(vLLM's convention: id i is the input of decoder layer i; default {default_layer_ids(num_layers)})"
        )
    return ids


class TargetFeatures:
    """Captures the target's residual stream at the head's layer ids during the target's own forward, without
    ``output_hidden_states`` (which keeps every layer): a pre-hook on decoder layer i (the final norm for id N)
    keeps its input for the positions of that forward only."""

    def __init__(self, model, layer_ids: Sequence[int]):
        layers = decoder_layers(model)
        self.layer_ids = check_layer_ids(layer_ids, len(layers))
        self.modules = [layers[i] if i < len(layers) else model.model.norm for i in self.layer_ids]

    @contextlib.contextmanager
    def capture(self) -> Iterator[dict]:
        """Within, each forward of the target leaves its states at the layer ids in the dict, by their order."""
        captured: dict[int, torch.Tensor] = {}

        def keep(index):
            def hook(module, args, kwargs):
                captured[index] = args[0] if args else kwargs["hidden_states"]

            return hook

        handles = [module.register_forward_pre_hook(keep(i), with_kwargs=True) for i, module in enumerate(self.modules)]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def stacked(self, captured: dict) -> torch.Tensor:
        """The captured states side by side: (batch, length, 3 x hidden), low layer first."""
        return torch.cat([captured[i] for i in range(len(self.modules))], dim=-1)

    def __call__(self, model, **inputs):
        """The target's forward on ``inputs`` and its states at the layer ids: (output, (batch, length, 3 x hidden))."""
        with self.capture() as captured:
            output = model(**inputs)
        return output, self.stacked(captured)


class Eagle3Config(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        hidden_size: int = 256,
        target_hidden_size: int | None = None,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int = 1024,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        vocab_size: int = 32000,
        draft_vocab_size: int | None = None,
        aux_layer_ids: Sequence[int] = (2, 16, 29),
        target_layer_count: int = 32,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.target_hidden_size = target_hidden_size or hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.vocab_size = vocab_size  # the target's: the head reads its token embeddings
        self.draft_vocab_size = draft_vocab_size or vocab_size  # the ids it proposes (a VocabMap's N)
        self.aux_layer_ids = list(aux_layer_ids)
        self.target_layer_count = target_layer_count
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class RMSNorm(nn.Module):
    """Llama's RMSNorm, x / rms(x) * w (not Gemma's x / rms(x) * (1 + w)): the weight starts at one."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class KVCache:
    """The head's keys and values over the positions it has read; a rollback is a slice."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (Llama's half-split form) at ``positions`` (batch, length) on (batch, heads, length, head_dim)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = positions[:, None, :, None].float() * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.theta = config.rope_theta
        width = 2 * config.hidden_size  # the normalised token embedding beside the normalised hidden state
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """(queries, keys, values), rotated, as (batch, heads, length, head_dim)."""
        batch, length, _ = x.shape

        def split(linear, heads):
            return linear(x).view(batch, length, heads, self.head_dim).transpose(1, 2)

        q, k = split(self.q_proj, self.heads), split(self.k_proj, self.kv_heads)
        return rotate(q, positions, self.theta), rotate(k, positions, self.theta), split(self.v_proj, self.kv_heads)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Causal attention of the new positions over the cached ones and themselves."""
        q, k, v = self.project(x, positions)
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.append(k, v)
        new = q.shape[2]
        mask = torch.arange(past + new, device=x.device)[None, :] <= past + torch.arange(new, device=x.device)[:, None]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.output(attended)


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """vLLM's EAGLE-3 decoder layer: attention reads [norm(embedding), norm(hidden)]; the residual is the hidden."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def inputs(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def after_attention(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer: the output before the head's final norm."""
        residual = hidden + attended
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Head(PreTrainedModel):
    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    _supports_sdpa = True

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's states at the three layers (..., 3 x target width) -> the head's hidden input."""
        parts = features.chunk(3, dim=-1)
        return self.fc(torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1))

    def step(
        self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Decoding: one pass over pairs (hidden state at t, embedding of token t + 1) at ``positions``, through
        ``cache``; returns the residual stream out (batch, length, hidden): ``logits`` of it are the next tokens',
        and it is the hidden input of the next draft step."""
        attended = self.midlayer.self_attn(self.midlayer.inputs(hidden, embeds), positions, cache)
        return self.midlayer.after_attention(hidden, attended)

    def forward(
        self,
        states: torch.Tensor,
        embeds: Sequence[torch.Tensor],
        positions: torch.Tensor,
        select: Sequence[torch.Tensor],
        segment_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training (through ``forward``, so DDP and DeepSpeed see it): the target's ``states`` at the layer ids,
        ``len(embeds)`` draft steps (``rollout``), and each step's logits at the positions ``select[s]`` masks."""
        outputs = self.rollout(self.fuse(states), embeds, positions, segment_ids)
        return [self.logits(out[mask]) for out, mask in zip(outputs, select)]

    def logits(self, residual: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (its N ids)."""
        return self.lm_head(self.norm(residual))

    def rollout(
        self, hidden: torch.Tensor, embeds: Sequence[torch.Tensor], positions: torch.Tensor, segment_ids=None
    ) -> list[torch.Tensor]:
        """Training-time test: the residual streams of ``len(embeds)`` draft steps from every position at once.

        Step s at index i stands where decoding would draft the (s + 1)-th token after a context ending at i: its
        hidden input is step s - 1's output at i (the fused target states at step 0), its token embedding
        ``embeds[s][:, i]``, its position i + s, and it attends to the context pairs j <= i of step 0 (same
        segment when packed) and to its own earlier steps at i, exactly the keys decoding's cache holds then."""
        attention = self.midlayer.self_attn
        causal = torch.ones(hidden.shape[1], hidden.shape[1], dtype=torch.bool, device=hidden.device).tril()
        if segment_ids is not None:
            causal = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        scale = 1 / math.sqrt(attention.head_dim)
        repeat = attention.heads // attention.kv_heads
        keys, values, outputs = [], [], []
        for step, embed in enumerate(embeds):
            q, k, v = attention.project(self.midlayer.inputs(hidden, embed), positions + step)
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            keys.append(k)
            values.append(v)
            context = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
            own = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]  # this index's earlier steps
            weights = torch.softmax(torch.cat([context, *own], dim=-1).float(), dim=-1).to(q.dtype)
            attended = weights[..., : context.shape[-1]] @ values[0]
            for t, value in enumerate(values[1:]):
                attended = attended + weights[..., context.shape[-1] + t : context.shape[-1] + t + 1] * value
            hidden = self.midlayer.after_attention(hidden, attention.output(attended))
            outputs.append(hidden)
        return outputs


AutoConfig.register(MODEL_TYPE, Eagle3Config)
AutoModelForCausalLM.register(Eagle3Config, Eagle3Head)


def new_head(
    target,
    vocab: VocabMap | None,
    layer_ids: Sequence[int] | None = None,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int = 1024,
    rms_norm_eps: float = 1e-6,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    seed: int = 0,
) -> Eagle3Head:
    """A random head for ``target`` (a loaded causal LM): the target's width and layer count, its layer ids checked
    (None: vLLM's default), the output layer over ``vocab``'s ids (all of the target's without one) starting from
    the target's own output rows of those ids, so the head starts by reading the target's vocabulary as it does."""
    layers = decoder_layers(target)
    ids = check_layer_ids(layer_ids if layer_ids is not None else default_layer_ids(len(layers)), len(layers))
    width, vocab_size = target.config.get_text_config().hidden_size, target.config.get_text_config().vocab_size
    torch.manual_seed(seed)  # every rank builds the same weights
    config = Eagle3Config(
        hidden_size=width,
        target_hidden_size=width,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        vocab_size=vocab_size,
        draft_vocab_size=len(vocab.target_ids) if vocab is not None else vocab_size,
        aux_layer_ids=ids,
        target_layer_count=len(layers),
    )
    head = Eagle3Head(config).float()
    rows = target.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        head.lm_head.weight.copy_(rows[vocab.target_ids] if vocab is not None else rows[:vocab_size])
    return head
