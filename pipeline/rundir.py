"""The run-directory contract.

Every stage reads from and writes to a deterministic directory (no timestamps: every rank and every
Slurm job computes the same path):

    runs/<target>/distill/<lang>/
    runs/<target>/distill/<lang>.shards-<N>/shard-<K>/   distill.num_shards=N: one job's slice, read as one set
    runs/<target>/<drafter>/pretrain/<hash>/       content-addressed: one folder per pretraining config
    runs/<target>/<drafter>/<run>/<lang>/finetune/
    runs/<target>/<drafter>/<run>/<lang>/eval/
    runs/<target>/<drafter>/<run>/<lang>/export/

``run`` names the variant (default: the recipe), so a P-F recipe and its F-only ablation, a KD variant
or a sweep (``run=lr-1e-4 train.finetune.lr=1e-4``) never write into each other's folders. Pretraining is
language independent and costly, so every run whose pretraining config is the same shares its folder.

Each holds ``manifest.json`` (hash of the config sections the stage depends on, of its inputs'
hashes and of the contents of the files it reads besides them, git revision, inputs, counts) and, once
finished, the atomic completion marker ``COMPLETE``. A complete stage with the same hash is skipped; one
with a different hash is refused unless ``force=true``, which moves the old directory aside instead of
deleting it.

The contents (``input_contents``: the target's weights, a drafter's, the prompts file) are in the hash, not
only checked on reuse: a pretraining of other weights gets a folder of its own, a fixed-path stage is refused
in one line naming what changed (force=true keeps the old results aside), and every later stage, whose hash
covers its inputs' hashes, sees its input as made for another config: nothing stale is reused downstream.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.config import REPO_ROOT, ConfigError, SourceKind, compose_config, lang_config, last_of_each_key, options
from pipeline.durable import write_atomic
from pipeline.errors import StageConflictError, StageInputError
from pipeline.models.drafter import published_weights
from pipeline.models.provision import fingerprint, hub_snapshot, is_local, model_fingerprint
from pipeline.registry import stage as registered

MARKER = "COMPLETE"
MANIFEST = "manifest.json"

# Keys inside the sections a stage hashes (registry.Stage.sections) that do not change its result, so changing
# them keeps its hash: how often training logs and checkpoints, whether it resumes, and how many processes share
# each step (``batch_size`` is the global batch, split over the processes: the same data and loss per step; the eval's
# processes decode disjoint prompts with the same seeds: the same counts).
RESULT_NEUTRAL = {
    f"train.{stage}": ("log_every", "save_every", "resume", "launch", "num_processes")
    for stage in ("pretrain", "finetune")
} | {"eval": ("processes",)}


def git_revision() -> str:
    """The checkout's commit (``-dirty`` with local changes), or an installed package's version."""
    if not (REPO_ROOT / ".git").exists():
        return f"specdraft=={importlib.metadata.version('specdraft')}"
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# Keys added to a hashed section after stages were made with it: at these values they are left out of the section,
# so those stages keep their hash.
ADDED_LATER = {"data": {"extra_prompts": [], "max_extra_prompts": None}}


def sections(cfg: DictConfig, keys: list[str]) -> dict[str, Any]:
    """Plain-data copies of the config sections named by dotted keys."""
    out = {}
    for key in keys:
        node = OmegaConf.select(cfg, key)
        out[key] = OmegaConf.to_container(node, resolve=True, enum_to_str=True) if OmegaConf.is_config(node) else node
        for name, neutral in ADDED_LATER.get(key, {}).items():
            if out[key].get(name) == neutral:
                del out[key][name]
    return out


def config_hash(cfg: DictConfig, keys: list[str], upstream: dict[str, str] | None = None) -> str:
    """A stable hash of the config sections a stage depends on and of its inputs' hashes."""
    parts = sections(cfg, keys)
    parts["upstream"] = dict(sorted((upstream or {}).items()))
    text = OmegaConf.to_yaml(OmegaConf.create(parts), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_command(cfg: DictConfig, stage: str, args: tuple[str, ...] = ()) -> str:
    """The command that produces a stage's output (with ``args`` as more overrides), for messages."""
    parts = [f"make {stage}"]
    if stage != "pretrain":
        parts.append(f"LANG={cfg.lang.pair}")
    if cfg.recipe != "local":
        parts.append(f"RECIPE={cfg.recipe}")
    overrides = last_of_each_key([*cfg.overrides, *args])
    if overrides:
        parts.append(f"ARGS='{' '.join(overrides)}'")
    return " ".join(parts)


@dataclass
class StageDir:
    stage: str
    path: Path
    config_hash: str
    inputs: dict[str, StageDir] = field(default_factory=dict)
    # an input distill of distill.num_shards > 1: its shards' directories (``path`` is the folder holding them)
    shards: list[StageDir] = field(default_factory=list)
    contents: dict[str, str] = field(default_factory=dict)  # input_contents: in the hash, recorded in the manifest

    @property
    def parts(self) -> list[StageDir]:
        """The directories holding this output: the shards of a sharded distill, else the directory itself."""
        return self.shards or [self]

    @property
    def marker(self) -> Path:
        return self.path / MARKER

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def is_complete(self) -> bool:
        return self.marker.exists()

    def recorded(self) -> dict:
        return json.loads(self.manifest_path.read_text()) if self.manifest_path.exists() else {}

    def recorded_hash(self) -> str | None:
        return self.recorded().get("config_hash")

    def changed_contents(self) -> str:
        """What the recorded input contents differ in from the current ones, for a conflict's message."""
        recorded = self.recorded().get("input_contents")
        if recorded is None:
            return "made before input contents were recorded"
        changed = [
            f"{what} {recorded.get(what)} -> {now}" for what, now in self.contents.items() if recorded.get(what) != now
        ]
        return f"changed: {', '.join(changed)}" if changed else "another config"

    @property
    def lock_path(self) -> Path:
        """Beside the directory, not in it: ``force=true`` moves the directory aside, never the lock."""
        return self.path.with_name(f".{self.path.name}.lock")

    @contextlib.contextmanager
    def claim(self):
        """Hold the stage's exclusive lock from before ``begin`` (which may move a directory aside) to after
        ``finish``: a second run of the stage into this directory, ``force=true`` included, is refused in one
        line naming the holder. flock: the kernel releases it when the holder dies, even by kill -9."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.lock_path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise StageConflictError(
                f"another {self.stage} run holds {self.path} ({holder}): wait for it to end or "
                "stop it; this run changed nothing"
            ) from None
        try:
            handle.truncate(0)
            handle.write(
                f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
            )
            handle.flush()
            yield self
        finally:
            handle.close()  # releases the lock

    def begin(self, cfg: DictConfig, force: bool = False) -> bool:
        """Prepare the directory. Returns False when the stage is already complete (skip it)."""
        recorded = self.recorded_hash()
        if recorded is not None and (recorded != self.config_hash or force):
            if not force:
                state = "complete" if self.is_complete() else "partial"
                raise StageConflictError(
                    f"{self.path} holds {state} {self.stage} results of another config or other inputs "
                    f"(hash {recorded} != {self.config_hash}; {self.changed_contents()}); pass force=true to move "
                    "them aside and redo the stage"
                )
            aside = self.path.with_name(f"{self.path.name}.replaced-{recorded}")
            if aside.exists():
                aside = self.path.with_name(f"{aside.name}-{int(time.time())}")
            os.replace(self.path, aside)
        elif self.is_complete():
            return False
        self.path.mkdir(parents=True, exist_ok=True)
        self.path.chmod(0o700)  # configs, logs and data of one user: not readable by the node's other users
        self._write_manifest(cfg, status="running")
        return True

    def finish(self, cfg: DictConfig, counts: dict[str, Any]) -> None:
        self._write_manifest(cfg, status="complete", counts=counts)
        write_atomic(self.marker, self.config_hash + "\n")

    def _write_manifest(self, cfg: DictConfig, status: str, counts: dict[str, Any] | None = None) -> None:
        previous = self.recorded()
        manifest = {
            "stage": self.stage,
            "status": status,
            "config_hash": self.config_hash,
            "recipe": cfg.recipe,
            "git_revision": git_revision(),
            "host": socket.gethostname(),
            "python": platform.python_version(),
            "started_at": previous.get("started_at", time.strftime("%Y-%m-%dT%H:%M:%S%z")),
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "inputs": {name: {"path": str(d.path), "config_hash": d.config_hash} for name, d in self.inputs.items()},
            "input_contents": self.contents,
            "counts": counts or previous.get("counts", {}),
            "config": sections(cfg, list(registered(self.stage).sections)),
        }
        write_atomic(self.manifest_path, json.dumps(manifest, indent=2) + "\n")


VLLM_EVAL = "eval-vllm"  # eval.engine=vllm's folder, beside the transformers engine's eval/ of the same drafter


def stage_path(cfg: DictConfig, stage: str, digest: str) -> Path:
    root = Path(cfg.paths.runs_dir) / cfg.target.name
    if stage == "distill":
        if cfg.distill.num_shards == 1:
            return root / "distill" / cfg.lang.pair
        return shard_set_path(cfg) / f"shard-{cfg.distill.shard}"
    if stage == "pretrain":
        return root / cfg.drafter.name / "pretrain" / digest
    if stage == "eval" and cfg.eval.engine == "vllm":
        return root / cfg.drafter.name / cfg.run / cfg.lang.pair / VLLM_EVAL
    return root / cfg.drafter.name / cfg.run / cfg.lang.pair / stage


def shard_set_path(cfg: DictConfig) -> Path:
    return Path(cfg.paths.runs_dir) / cfg.target.name / "distill" / f"{cfg.lang.pair}.shards-{cfg.distill.num_shards}"


def shard_args(cfg: DictConfig, shard: int | str | None = None) -> tuple[str, ...]:
    """The overrides that name a distill shard (``shard``, else the config's own), none when unsharded."""
    if cfg.distill.num_shards == 1:
        return ()
    return (
        f"distill.num_shards={cfg.distill.num_shards}",
        f"distill.shard={cfg.distill.shard if shard is None else shard}",
    )


def distill_input(cfg: DictConfig, check_inputs: bool) -> StageDir:
    """The distill output a later stage reads: with distill.num_shards > 1, every shard as one set, whose hash
    (its readers' upstream hash) is the shards' config without the shard index."""
    if cfg.distill.num_shards == 1:
        return stage_dir(cfg, "distill", check_inputs)
    shards = [
        stage_dir(OmegaConf.merge(cfg, {"distill": {"shard": shard}}), "distill", check_inputs)
        for shard in range(cfg.distill.num_shards)
    ]
    keys = [key for key in hashed_keys(cfg, "distill") if key != "distill.shard"]
    contents = input_contents(cfg, "distill")
    return StageDir(
        stage="distill",
        path=shard_set_path(cfg),
        config_hash=config_hash(cfg, keys, contents),
        shards=shards,
        contents=contents,
    )


def check_shards(cfg: DictConfig, stage: str, distill: StageDir) -> None:
    """Every shard of the distill set complete and of the current config, else one line naming the shards to run."""
    incomplete = [s for s, part in enumerate(distill.shards) if not part.is_complete()]
    stale = [
        s for s, part in enumerate(distill.shards) if part.is_complete() and part.recorded_hash() != part.config_hash
    ]
    if incomplete or stale:
        shards, extra = (incomplete, ()) if incomplete else (stale, ("force=true",))
        listed = ", ".join(map(str, shards))
        state = "not complete" if incomplete else "made with another config"
        raise StageInputError(
            f"{stage} reads all {cfg.distill.num_shards} distill shards of {distill.path}, and shard(s) {listed} "
            f"{'is' if len(shards) == 1 else 'are'} {state}: "
            f"run `{make_command(cfg, 'distill', (*shard_args(cfg, 'K'), *extra))}` "
            f"for K in {' '.join(map(str, shards))} (slurm/submit.sh --distill-shards {cfg.distill.num_shards} runs "
            "them as an array)"
        )


def stage_dir(cfg: DictConfig, stage: str, check_inputs: bool = True) -> StageDir:
    """The stage's directory with its inputs resolved; fails fast when an input is not complete."""
    inputs = {
        name: distill_input(cfg, check_inputs) if name == "distill" else stage_dir(cfg, name, check_inputs)
        for name in registered(stage).inputs(cfg)
    }
    if check_inputs:
        for name, upstream in inputs.items():
            if upstream.shards:
                check_shards(cfg, stage, upstream)
                continue
            if not upstream.is_complete():
                sharded = (
                    sorted(p.name for p in upstream.path.parent.glob(f"{upstream.path.name}.shards-*"))
                    if name == "distill"
                    else []
                )
                raise StageInputError(
                    f"{stage} needs the {name} output {upstream.path}, which is not complete: "
                    f"run `{make_command(cfg, name)}` first"
                    + (
                        f" (or pass distill.num_shards=N to read a sharded one: {', '.join(sharded)})"
                        if sharded
                        else ""
                    )
                )
            if upstream.recorded_hash() != upstream.config_hash:
                raise StageInputError(
                    f"{stage} needs {upstream.path} for the current config and inputs, but it was made with other "
                    f"ones ({upstream.changed_contents()}): run `{make_command(cfg, name)}` with force=true"
                )
    contents = input_contents(cfg, stage)
    digest = config_hash(cfg, hashed_keys(cfg, stage), {name: d.config_hash for name, d in inputs.items()} | contents)
    return StageDir(
        stage=stage, path=stage_path(cfg, stage, digest), config_hash=digest, inputs=inputs, contents=contents
    )


def prompts_file(cfg: DictConfig) -> Path | None:
    """The local file the pair's prompts are read from (pipeline/data/sources.py load_sources), if any."""
    data, hub = cfg.data, cfg.lang.hub
    if data.sources == SourceKind.offline or (data.sources == SourceKind.hub and hub.dataset):
        return None
    name = data.source_file or hub.file
    if not name or not Path(name).is_file():
        raise ConfigError(
            f"prompts file {name} does not exist: set data.source_file (or lang.hub.file) to a JSONL or TSV file"
        )
    return Path(name)


def input_contents(cfg: DictConfig, stage: str) -> dict[str, str]:
    """The fingerprints (provision.fingerprint) of what a stage reads besides its input stages: the target's
    weights (every stage), the drafter's published weights, the prompts file (distill, and eval's held-out prompts)
    and eval.drafter_path, and the drafters an eval measures beside its own or routes to (retrained in place, their
    folders keep their paths). A hub id without a revision is taken at the commit the HF cache holds, as loaded."""
    contents = {"target weights": model_fingerprint(cfg.target, cfg.paths.models_dir)}
    if "drafter" in registered(stage).sections and (weights := published_weights(cfg.drafter)):
        contents["drafter weights"] = fingerprint(weights if is_local(weights) else hub_snapshot(weights, None))
    if stage in ("distill", "eval") and (prompts := prompts_file(cfg)):
        contents["prompts file"] = fingerprint(prompts)
    if stage == "eval" and cfg.eval.drafter_path:
        if not Path(cfg.eval.drafter_path).is_dir():
            raise ConfigError(f"eval.drafter_path {cfg.eval.drafter_path} is not a folder: set it to an HF folder")
        contents["eval.drafter_path"] = fingerprint(cfg.eval.drafter_path)
    if stage == "eval":
        contents |= {f"eval.beside {label}": fingerprint(path) for label, path in beside_folders(cfg).items()}
        contents |= {f"eval.router_langs {src}": fingerprint(path) for src, path in router_folders(cfg).items()}
    return contents


def beside_folders(cfg: DictConfig) -> dict[str, str]:
    """eval.beside's drafters as folders by label (LABEL:ENTRY, or a drafter config as its own label): a folder as
    given; a drafter config (conf/drafter/) as that drafter's finetuned drafter of this pair under this recipe, which
    must be complete and made with that drafter's config here (its own training settings, recipes/local_drafters/)."""
    folders = {}
    for item in cfg.eval.beside:
        label, _, entry = item.partition(":") if ":" in item else (item, "", item)
        if Path(entry).is_dir():
            folders[label] = str(entry)
            continue
        if entry not in options("drafter"):
            valid = ", ".join(options("drafter"))
            raise ConfigError(f"eval.beside: {entry} is neither a folder nor a drafter config ({valid})")
        # composed anew: the recipe may train that drafter its own way (recipes/local_drafters/)
        shared = [given for given in cfg.overrides if not given.startswith(("drafter=", "drafter."))]
        other = compose_config([f"recipe={cfg.recipe}", f"lang={cfg.lang.pair}", *shared, f"drafter={entry}"])
        folders[label] = finetuned_folder(other, "eval.beside", entry)
    return folders


def router_folders(cfg: DictConfig) -> dict[str, str]:
    """eval.router_langs' drafters as folders by source language: each pair's finetuned drafter under this config,
    which must be complete and made with it."""
    folders = {}
    for pair in cfg.eval.router_langs:
        other = lang_config(cfg, pair)
        folders[other.lang.src] = finetuned_folder(other, "eval.router_langs", other.drafter.name)
    return folders


def finetuned_folder(cfg: DictConfig, needed_by: str, drafter: str) -> str:
    """The drafter folder of ``cfg``'s finetune, which ``needed_by`` reads: refused in one line unless complete and
    made with ``cfg`` (compared as made, not a stale drafter in its place)."""
    finetune = stage_dir(cfg, "finetune", check_inputs=False)
    if not finetune.is_complete():
        raise StageInputError(
            f"{needed_by} needs the {drafter} drafter finetuned on {cfg.lang.pair}, and {finetune.path} "
            f"is not complete: run `{make_command(cfg, 'finetune')}` first"
        )
    if finetune.recorded_hash() != finetune.config_hash:
        raise StageInputError(
            f"{needed_by} needs {finetune.path} for {drafter}'s current config and inputs, but it was made with "
            f"other ones ({finetune.changed_contents()}): run `{make_command(cfg, 'finetune')}` with force=true"
        )
    return str(finetune.path / "drafter")


def hashed_keys(cfg: DictConfig, stage: str) -> list[str]:
    """The config keys a stage's hash covers: its sections, less their RESULT_NEUTRAL keys, and less the
    finetune's on-policy phase and either training's parallel drafting while they are off, its data_fraction while
    it is 1 and an unsharded distill's shard keys (stages made before they existed keep their hash)."""
    keys = []
    for key in registered(stage).sections:
        neutral = RESULT_NEUTRAL.get(key)
        if neutral is None:
            keys.append(key)
        else:
            keys.extend(f"{key}.{name}" for name in OmegaConf.select(cfg, key) if name not in neutral)
    if stage == "finetune" and not cfg.train.finetune.on_policy.enabled:
        keys.remove("train.finetune.on_policy")
    for section in ("pretrain", "finetune"):
        if f"train.{section}.parallel_draft" in keys and not cfg.train[section].parallel_draft.enabled:
            keys.remove(f"train.{section}.parallel_draft")
    if stage == "finetune" and cfg.train.finetune.data_fraction == 1:
        keys.remove("train.finetune.data_fraction")
    if stage == "distill" and cfg.distill.num_shards == 1:
        keys.remove("distill.num_shards")
        keys.remove("distill.shard")
    return keys
