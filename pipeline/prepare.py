"""`make prepare`: what a recipe takes from the hub, cached as files where the hub is reachable (a login node),
so that every stage after it runs offline (compute nodes without internet).

A recipe takes from the hub: a hub target (its snapshot in the HF cache at ``target.revision``: the weights in
one format, only config and tokenizer for a dry run's stand-in), a hub drafter or the weights
``drafter.init_from`` starts from, the rows of each evaluated pair's hub dataset (pipeline/data/sources.py), and
the pretraining tokens of a hub corpus (C4, tokenized into ``cache_dir/pretrain-tokens``). ``prepare`` fetches
each, for the recipe and its dry run, and writes ``cache_dir/prepared/<recipe>-<pair>.json``: what, from
where, the resolved commit, where it lies. At the start of every stage ``offline_when_prepared`` checks the
same list without a hub call: all cached, the stage and the processes it starts run with HF_HUB_OFFLINE=1;
something missing with the hub off, one line names `make prepare`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from pipeline.config import ModelSource, SourceKind, lang_config
from pipeline.data.sources import cached_sources, hub_sources, load_sources
from pipeline.durable import write_atomic
from pipeline.models.drafter import published_weights
from pipeline.models.provision import (
    NotPreparedError,
    cached_snapshot,
    check_model_name,
    download_snapshot,
    go_offline,
    hub_offline,
    is_local,
    load_tokenizer,
    model_path,
    prepare_hint,
)
from pipeline.training.data import READ_FILE, pretrain_cache, write_pretrain_tokens

PREPARED_DIR = "prepared"


@dataclass
class Need:
    what: str  # target llama2-7b-chat, zh-en rows, pretraining tokens
    source: str  # where it comes from: a hub id at a revision, a dataset and subset
    cached: Callable[[], str | None]  # where it lies when it is cached here, else None; never calls the hub
    fetch: Callable[[], tuple[str, str]]  # fetches it into the cache: where it lies, and what it holds ("" for a model)
    snapshot: bool = False  # where it lies is a hub snapshot folder, named by the commit it resolved to


def _model_need(what: str, repo_id: str, revision: str | None, weights: bool) -> Need:
    return Need(
        what,
        f"{repo_id}@{revision or 'main'}" + ("" if weights else ", config and tokenizer"),
        lambda: cached_snapshot(repo_id, revision, weights),
        lambda: (download_snapshot(repo_id, revision, weights), ""),
        snapshot=True,
    )


def evaluated_pairs(cfg: DictConfig) -> list[DictConfig]:
    """``cfg`` with each pair eval reads held-out prompts of: its own, the cross-language matrix's, the router's."""
    pairs = dict.fromkeys([*cfg.eval.matrix_langs, *cfg.eval.router_langs])
    return [cfg, *(lang_config(cfg, pair) for pair in pairs if pair != cfg.lang.pair)]


def _sources_need(cfg: DictConfig) -> Need:
    hub = cfg.lang.hub

    def cached() -> str | None:
        folder = cached_sources(cfg)
        return str(folder) if folder else (hub.dataset if is_local(hub.dataset) else None)

    def fetch() -> tuple[str, str]:
        train, heldout = hub_sources(cfg, keep=True)
        return str(cached_sources(cfg)), f"{len(train)} train, {len(heldout)} held-out prompts"

    return Need(f"{cfg.lang.pair} rows", f"{hub.dataset} {hub.subset}", cached, fetch)


def _pretrain_need(cfg: DictConfig, corpora: list[str], target: Need | None) -> Need:
    """The tokenized pretraining stream, cached by the pretrain stage's own function (its key: the target's
    tokenizer, the corpora, their limits and the token budget). ``target``: the hub target's need, if any."""
    budget = cfg.train.pretrain.token_budget

    def cached() -> str | None:
        if all(map(is_local, corpora)):
            return corpora[0]
        if target is not None and target.cached() is None:
            return None  # the tokenizer is not here either
        folder = pretrain_cache(cfg, load_tokenizer(model_path(cfg.target, cfg.paths.models_dir)), budget)
        return str(folder) if (folder / READ_FILE).exists() else None

    def fetch() -> tuple[str, str]:
        tokenizer = load_tokenizer(model_path(cfg.target, cfg.paths.models_dir))
        read = write_pretrain_tokens(cfg, tokenizer, budget)
        shares = ", ".join(f"{name} {counts['tokens']:,}" for name, counts in read["corpora"].items())
        return str(pretrain_cache(cfg, tokenizer, budget)), f"{read['tokens']:,} tokens: {shares}"

    return Need("pretraining tokens", ", ".join(corpora), cached, fetch)


def check_model_names(cfg: DictConfig) -> None:
    """Each model folder ``cfg`` names exists, or the name could be a hub id where the hub may serve it."""
    for key in ("target", "drafter"):
        if cfg[key].source in (ModelSource.hub, ModelSource.local):
            check_model_name(cfg[key].path, f"{key}.path", hub=cfg[key].source == ModelSource.hub)
    if cfg.drafter.init_from:
        check_model_name(cfg.drafter.init_from, "drafter.init_from")


def needs(cfg: DictConfig) -> list[Need]:
    """What ``cfg`` takes from the hub (or, for the rows and tokens, from a local copy `make prepare` keeps)."""
    check_model_names(cfg)
    target = cfg.target
    target_need = None
    if target.source == ModelSource.hub and not is_local(target.path):  # a stand-in reads only config and tokenizer
        target_need = _model_need(f"target {target.name}", target.path, target.revision, weights=not target.stand_in)
    found = [target_need] if target_need else []
    if (weights := published_weights(cfg.drafter)) and not is_local(weights):  # source=hub, or init_from
        found.append(_model_need(f"drafter {cfg.drafter.name}", weights, None, True))
    if cfg.data.sources == SourceKind.hub:
        for pair_cfg in evaluated_pairs(cfg):
            if pair_cfg.lang.hub.dataset:  # else a file (JParaCrawl), read where it lies
                found.append(_sources_need(pair_cfg))
    if corpora := [
        corpus.hub_dataset or corpus.name for corpus in cfg.data.pretrain_corpora if corpus.name != "sharegpt"
    ]:
        found.append(_pretrain_need(cfg, corpora, target_need))
    return found


def prepare(variants: dict[str, DictConfig]) -> Path | None:
    """Fetch every need of each config (``variants``: a title -> config, the recipe and its dry run) and record
    what was cached where; then the target as the stages load it and the pair's prompt counts. Returns the record
    (None: nothing comes from the hub)."""
    record, first = {}, next(iter(variants.values()))
    for title, cfg in variants.items():
        print(f"{title}:")
        items = []
        for need in needs(cfg):
            where, holds = need.fetch()
            holds = f"commit {Path(where).name}" if need.snapshot else holds
            items.append({"what": need.what, "source": need.source, "path": where, "holds": holds})
            print(f"  {need.what:<22} {need.source} -> {where} ({holds})")
        print(f"  target {cfg.target.name}: {model_path(cfg.target, cfg.paths.models_dir)}")
        for pair_cfg in evaluated_pairs(cfg):
            train, heldout = load_sources(pair_cfg)
            print(f"  {pair_cfg.lang.pair} sources: {len(train)} train prompts, {len(heldout)} held out")
        if items:
            record[title] = items
    if not record:
        return None
    path = Path(first.paths.cache_dir) / PREPARED_DIR / f"{first.recipe}-{first.lang.pair}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=2) + "\n")
    return path


def offline_when_prepared(cfg: DictConfig) -> None:
    """At a stage's start: everything ``cfg`` takes from the hub cached here -> HF_HUB_OFFLINE=1 for the stage and
    every process it starts (no hub call, and a branch that moved since `make prepare` does not change the target
    between stages); something missing with the hub off -> one line naming `make prepare`."""
    wanted = needs(cfg)
    if not wanted:
        return
    missing = [need for need in wanted if need.cached() is None]
    if not missing:
        go_offline()
    elif hub_offline():
        raise NotPreparedError(
            f"not cached here and the hub is off (HF_HUB_OFFLINE=1): "
            f"{'; '.join(f'{n.what} ({n.source})' for n in missing)}; {prepare_hint(cfg)}"
        )
