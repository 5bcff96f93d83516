"""Every recipe composes with every language; bad input fails at compose time in one line."""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
import typing

import pytest
from omegaconf import OmegaConf

from pipeline.config import (
    CONF_DIR,
    DEFAULT_RECIPE,
    RECIPES_DIR,
    REPO_ROOT,
    USER_CONFIG_ENV,
    Config,
    ConfigError,
    compose_config,
    options,
    with_overrides,
)

RECIPES = options("recipe")
LANGS = options("lang")


def test_the_paper_local_and_ci_recipes_exist():
    assert {"local", "ci", "paper-vicuna", "paper-llama2", "paper-gemma"} <= set(RECIPES)
    assert {"de-en", "fr-en", "ru-en", "ja-en", "zh-en"} <= set(LANGS)


@pytest.mark.parametrize("recipe,lang", list(itertools.product(RECIPES, LANGS)))
def test_every_recipe_composes_with_every_language(recipe, lang):
    cfg = compose_config([f"recipe={recipe}", f"lang={lang}"])
    assert cfg.recipe == recipe
    assert cfg.lang.pair == lang
    assert cfg.lang.src and cfg.lang.tgt and cfg.target.name and cfg.drafter.name


def leaves(node: dict, prefix: str = ""):
    """(dotted key, value) of every value of a YAML mapping that is not itself a mapping."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def holds(composed, chosen) -> bool:
    """``composed`` has every value of ``chosen`` (mappings may gain the schema's defaults)."""
    if isinstance(chosen, dict):
        return isinstance(composed, dict) and all(k in composed and holds(composed[k], v) for k, v in chosen.items())
    if isinstance(chosen, list):
        return isinstance(composed, list) and len(composed) == len(chosen) and all(map(holds, composed, chosen))
    return composed == chosen and isinstance(composed, bool) == isinstance(chosen, bool)  # 1 == 1.0, not True


@pytest.mark.parametrize("group", ["target", "drafter", "data", "train", "eval", "logger"])
def test_every_group_option_composes(group):
    """Each option's own file is what the composed config holds, but for the keys the recipe itself sets."""
    recipe = OmegaConf.to_container(OmegaConf.load(RECIPES_DIR / f"{DEFAULT_RECIPE}.yaml"))
    recipe_keys = [key for key, _ in leaves({k: v for k, v in recipe.items() if k != "defaults"})]
    for option in options(group):
        composed = OmegaConf.to_container(compose_config([f"{group}={option}"]), resolve=True, enum_to_str=True)[group]
        own_way = RECIPES_DIR / "local_drafters" / f"{option}.yaml"  # how the recipe trains this drafter
        set_here = recipe_keys + (
            [key for key, _ in leaves(OmegaConf.to_container(OmegaConf.load(own_way)))] if own_way.is_file() else []
        )
        chosen = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
        chosen.pop("defaults", None)  # Hydra's list of what the option extends, not a value
        checked = 0
        for key, value in leaves(chosen):
            full = f"{group}.{key}"
            if any(k == full or k.startswith(f"{full}.") or full.startswith(f"{k}.") for k in set_here):
                continue  # the recipe's own value wins
            node = composed
            for part in key.split("."):
                node = node[part]
            assert holds(node, value), f"{group}={option}: {key} is {node!r}, not {value!r}"
            checked += 1
        assert checked >= 1, (group, option)


def test_a_recipe_trains_a_drafter_its_own_way_where_it_says_so():
    """recipes/local_drafters/: the local recipe's head F-only at lr 1e-3 with one TTT step, its standalone
    drafters P-F at 5e-4, another recipe's head as that recipe trains; the command line wins over both."""
    head = compose_config(["drafter=eagle3-gemma3"])
    assert (head.train.finetune.mode, head.train.finetune.lr, head.drafter.ttt_steps) == ("finetune_only", 1e-3, 1)
    standalone = compose_config(["drafter=tiny-7m"])
    assert (standalone.train.finetune.mode, standalone.train.finetune.lr) == ("pretrain_finetune", 5e-4)
    mine = compose_config(["drafter=eagle3-gemma3", "train.finetune.mode=pretrain_finetune", "drafter.ttt_steps=3"])
    assert (mine.train.finetune.mode, mine.train.finetune.lr, mine.drafter.ttt_steps) == ("pretrain_finetune", 1e-3, 3)
    paper = compose_config(["recipe=paper-gemma", "drafter=eagle3-gemma3"])
    assert (paper.train.finetune.mode, paper.drafter.ttt_steps) == ("pretrain_finetune", 3)


def test_paper_recipes_carry_the_paper_settings():
    vicuna = compose_config(["recipe=paper-vicuna"])
    assert vicuna.target.path == "lmsys/vicuna-7b-v1.3"
    assert vicuna.target.system_prompt.startswith("A chat between a curious user and an artificial intelligence")
    assert vicuna.train.finetune.lr == 2e-5 and vicuna.train.finetune.epochs == 3
    assert vicuna.train.finetune.warmup_ratio == 0.03 and vicuna.train.finetune.max_length == 2048
    assert compose_config(["recipe=paper-llama2"]).train.finetune.lr == 3e-5
    f_only = compose_config(["recipe=paper-vicuna-f-only"])
    assert f_only.train.finetune.mode.value == "finetune_only" and f_only.train.finetune.epochs == 5
    gemma = compose_config(["recipe=paper-gemma"]).drafter
    assert (gemma.hidden_size, gemma.intermediate_size, gemma.num_heads, gemma.num_layers, gemma.num_kv_heads) == (
        768,
        6144,
        16,
        2,
        2,
    )
    assert gemma.hidden_act.startswith("gelu") and gemma.rms_norm_eps == 1e-6


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["lang=xx-yy"], "unknown lang 'xx-yy'"),
        (["recipe=nope"], "unknown recipe 'nope'; valid: ci, local"),
        (["target=nope"], "unknown target 'nope'; valid:"),
        (["train.finetune.lrr=1"], "Key 'lrr' not in 'FinetuneConfig'; valid keys: lr,"),
        (["+drafter.hidden=1"], "Key 'hidden' not in 'DrafterConfig'; valid keys:"),
        (["train.finetune.lr=fast"], "train.finetune.lr: Value 'fast' of type 'str' could not be converted to Float"),
        (["train.finetune.mode=both"], "expected one of [pretrain_finetune, finetune_only]"),
        (["drafter.num_heads=3"], "not divisible by drafter.num_heads 3"),
        (
            ["drafter.source=hub", "drafter.path=JackFram/llama-68m", "drafter.embeddings_from_target=true"],
            "needs drafter.source=init, not hub",
        ),
        (["eval.num_draft_tokens=0"], "must be >= 1"),
        (["train.pretrain.launch=nope"], "launch 'nope' unknown; valid: ddp"),
        (["eval.methods=[target,router]"], "the router is not a method; set eval.router_langs"),
        (["eval.draft_confidence=1.5"], "eval.draft_confidence must be in [0, 1)"),
        (["lang"], "is not KEY=VALUE"),
        (["train.finetune.data_fraction=0"], "train.finetune.data_fraction must be in (0, 1]"),
        (["scaling.fractions=[0.5,2]"], "scaling.fractions must be shares of the distilled prompts in (0, 1]"),
        (["scaling.anchors=[pf@0.3]"], "scaling.anchors: pf@0.3 not among the points; valid: f_only@0.125,"),
        (["scaling.series=[pf,both]"], "expected one of [pf, f_only, pf_on_policy, f_only_on_policy]"),
        (
            ["train.pretrain.mixed_precision=fp32"],
            "train.pretrain.mixed_precision: Invalid value 'fp32', expected one of [no, bf16, fp16]",
        ),
        (
            ["train.finetune.resume=sometimes"],
            "train.finetune.resume: Invalid value 'sometimes', expected one of [auto, never]",
        ),
        (["eval.engine=tgi"], "eval.engine: Invalid value 'tgi', expected one of [transformers, vllm]"),
        (["data.back_translation=10", "data.sources=hub"], "data.back_translation works on offline sources"),
        (["data.back_translation=10", "lang=de-en", "lang.examples=[]"], "conf/lang/de-en.yaml has no `examples`"),
        (["run=${nope}"], "run: Interpolation key 'nope' not found"),
        (["train.pretrain.batch_size=${eval.device}"], "train.pretrain.batch_size: While dereferencing interpolation"),
    ],
)
def test_bad_input_is_a_one_line_error(overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "override,expected",
    [
        ("eval.num_prompts=-3", "eval.num_prompts must be >= 1, not -3"),
        ("train.finetune.lr=-1", "train.finetune.lr must be > 0, not -1.0"),
        ("train.finetune.batch_size=0", "train.finetune.batch_size must be >= 1, not 0"),
    ],
)
def test_the_cli_refuses_a_count_size_or_rate_out_of_range_in_one_line(override, expected):
    """`specdraft config` (exit 0 before, the value in the printed config): exit 2, one line on stderr, nothing on
    stdout: composition refuses it before any stage asks for a GPU."""
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "config", "recipe=local", "lang=de-en", override],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: {expected}\n"


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["train.pretrain.grad_accum=0"], "train.pretrain.grad_accum must be >= 1, not 0"),  # was a ZeroDivisionError
        (["drafter.num_heads=0"], "drafter.num_heads must be >= 1, not 0"),  # was a ZeroDivisionError
        (["drafter.num_kv_heads=0"], "drafter.num_kv_heads must be >= 1, not 0"),
        (["drafter.hidden_size=-8"], "drafter.hidden_size must be >= 1, not -8"),
        (["drafter.reduced_vocab=0"], "drafter.reduced_vocab must be >= 1, not 0"),
        (["drafter.rms_norm_eps=0"], "drafter.rms_norm_eps must be > 0, not 0.0"),
        (["train.finetune.lr=nan"], "train.finetune.lr must be > 0, not nan"),
        (["train.finetune.warmup_ratio=1"], "train.finetune.warmup_ratio must be in [0, 1), not 1.0"),
        (["train.pretrain.epochs=0"], "train.pretrain.epochs must be > 0, not 0.0"),
        (["train.finetune.max_steps=0"], "train.finetune.max_steps must be >= 1, not 0"),
        (["train.pretrain.token_budget=-1"], "train.pretrain.token_budget must be >= 1, not -1"),
        (["train.finetune.max_length=0"], "train.finetune.max_length must be >= 1, not 0"),
        (["train.finetune.log_every=0"], "train.finetune.log_every must be >= 1, not 0"),
        (["train.finetune.save_every=0"], "train.finetune.save_every must be a positive integer or auto, not 0"),
        (["train.finetune.save_every=often"], "train.finetune.save_every must be a positive integer or auto, not"),
        (["train.finetune.weight_decay=-0.1"], "train.finetune.weight_decay must be >= 0, not -0.1"),
        (["train.finetune.grad_clip=-1"], "train.finetune.grad_clip must be >= 0, not -1.0"),
        (["train.finetune.data_fraction=1.5"], "train.finetune.data_fraction must be in (0, 1], not 1.5"),
        (["train.finetune.on_policy.rounds=0"], "train.finetune.on_policy.rounds must be >= 1, not 0"),
        (["train.finetune.on_policy.lr=0"], "train.finetune.on_policy.lr must be > 0, not 0.0"),
        (["train.finetune.parallel_draft.retention=0"], "parallel_draft.retention must be in (0, 1], not 0.0"),
        (["eval.max_new_tokens=0"], "eval.max_new_tokens must be >= 1, not 0"),
        (["eval.seeds=[0,-1]"], "eval.seeds[1] must be >= 0, not -1"),
        (["eval.temperatures=[0,-0.5]"], "eval.temperatures[1] must be >= 0, not -0.5"),
        (["distill.temperatures=[-1]"], "distill.temperatures[0] must be >= 0, not -1.0"),
        (["eval.top_p=0"], "eval.top_p must be in (0, 1], not 0.0"),
        (["eval.top_p=1.5"], "eval.top_p must be in (0, 1], not 1.5"),
        (["eval.top_k=-1"], "eval.top_k must be >= 0, not -1"),
        (["eval.num_draft_tokens=0"], "eval.num_draft_tokens must be >= 1, not 0"),
        (["eval.k_sweep=[0,4]"], "eval.k_sweep[0] must be >= 1, not 0"),
        (["eval.repetitions=0"], "eval.repetitions must be >= 1, not 0"),
        (["eval.tie_tolerance=-1"], "eval.tie_tolerance must be >= 0, not -1.0"),
        (["distill.concurrency_per_replica=0"], "distill.concurrency_per_replica must be >= 1, not 0"),
        (["distill.top_logprobs=-1"], "distill.top_logprobs must be >= 0, not -1"),
        (["distill.max_tokens=0"], "distill.max_tokens must be >= 1, not 0"),
        (["distill.samples_per_prompt=0"], "distill.samples_per_prompt must be >= 1, not 0"),
        (["distill.max_failed_share=1"], "distill.max_failed_share must be in [0, 1), not 1.0"),
        (["distill.num_shards=0"], "distill.num_shards must be >= 1, not 0"),
        (["distill.shard=2", "distill.num_shards=2"], "need num_shards >= 1 and 0 <= shard < num_shards"),
        (["distill.server.tensor_parallel=0"], "distill.server.tensor_parallel must be >= 1, not 0"),
        (["distill.server.port=70000"], "distill.server.port must be in [1, 65535], not 70000"),
        (["data.heldout_fraction=1"], "data.heldout_fraction must be in [0, 1), not 1.0"),
        (["data.back_translation=-1"], "data.back_translation must be >= 0, not -1"),
        (["data.max_train_prompts=0"], "data.max_train_prompts must be >= 1, not 0"),
        (["data.pretrain_corpora.0.weight=0"], "data.pretrain_corpora[0].weight must be > 0, not 0.0"),
        (["target.max_model_len=0"], "target.max_model_len must be >= 1, not 0"),
        (["export.num_prompts=0"], "export.num_prompts must be >= 1, not 0"),
        (["scaling.heldout_prompts=0"], "scaling.heldout_prompts must be >= 1, not 0"),
        (["seed=-1"], "seed must be >= 0, not -1"),
        (["eval.num_prompts=0", "train.pretrain.lr=0"], "train.pretrain.lr must be > 0, not 0.0; eval.num_prompts"),
    ],
)
def test_every_count_size_and_rate_is_checked_at_composition(overrides, expected):
    """One line that names the key, its value and the range, for every problem (here the last: two at once)."""
    with pytest.raises(ConfigError) as info:
        compose_config(["recipe=ci", *overrides])
    message = str(info.value)
    assert expected in message and "\n" not in message, message
    if not any(".0." in override for override in overrides):  # a variant's overrides cannot index into a list
        with pytest.raises(ConfigError, match=re.escape(expected)):  # a variant of a composed config too
            with_overrides(compose_config(["recipe=ci"]), overrides)


def test_every_number_of_the_schemas_declares_its_range():
    """A new int or float key gets its Bounds (pipeline/config/schemas.py), checked by validate with no code of its
    own; the few that have none are checked by their section (a count or auto, nested shares)."""
    unbounded = []

    def visit(schema, prefix):
        hints = typing.get_type_hints(schema)
        for spec in dataclasses.fields(schema):
            declared = hints[spec.name]
            kinds = {t for t in typing.get_args(declared) if t is not type(None)} or {declared}
            (kind,) = kinds
            item = next(iter(typing.get_args(kind)), kind) if typing.get_origin(kind) is list else kind
            if dataclasses.is_dataclass(item):
                visit(item, f"{prefix}{spec.name}.")
            elif item in (int, float, typing.Any) and "bounds" not in spec.metadata:
                unbounded.append(f"{prefix}{spec.name}")

    visit(Config, "")
    assert sorted(unbounded) == [
        "distill.client_processes",  # the checks' _positive_or_auto
        "distill.server.data_parallel",
        "eval.processes",
        "scaling.fractions",  # ScalingConfig.check: shares in (0, 1], not empty
        "serve_bench.concurrency",  # ServeBenchConfig.check: each >= 1, not empty
        "train.finetune.num_processes",
        "train.finetune.save_every",
        "train.pretrain.num_processes",
        "train.pretrain.save_every",
    ]


def test_a_bad_file_in_the_config_dir_is_a_one_line_error(tmp_path, monkeypatch):
    """Hydra's errors while it merges a file, or for a defaults list that names no file, say the key and the fix."""
    monkeypatch.setenv(USER_CONFIG_ENV, str(tmp_path))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "typo.yaml").write_text("name: typo\nsourc: hub\npath: x\n")
    (tmp_path / "target" / "wrong.yaml").write_text("name: wrong\nsource: hubb\npath: x\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "gone.yaml").write_text(
        "defaults:\n  - specdraft\n  - override target: nope\n  - _self_\nrecipe: gone\n"
    )
    expected = {
        "target=typo": "target.sourc: Key 'sourc' not in 'TargetConfig'; valid keys: name, source, path,",
        "target=wrong": "target.source: Invalid value 'hubb', expected one of [gguf_package, hub, local, init]",
        "recipe=gone": "a defaults list names 'target/nope', which no config directory has; valid: gemma",
    }
    for override, message in expected.items():
        with pytest.raises(ConfigError) as info:
            compose_config([override])
        assert str(info.value).startswith(message) and "\n" not in str(info.value), override


def test_a_variant_with_a_bad_override_is_a_one_line_error():
    cfg = compose_config(["recipe=ci"])
    with pytest.raises(
        ConfigError,
        match=r"^train\.finetune\.lr: Value 'fast' of type 'str' could not be converted to "
        r"Float$",
    ):
        with_overrides(cfg, ["train.finetune.lr=fast"])
    with pytest.raises(ConfigError, match=r"^train\.finetune\.lrr: Key 'lrr' not in 'FinetuneConfig'; valid keys: lr,"):
        with_overrides(cfg, ["train.finetune.lrr=1"])
    with pytest.raises(
        ConfigError,
        match=r"^train\.pretrain\.mixed_precision: Invalid value 'False', expected one of "
        r"\[no, bf16, fp16\]; YAML reads an unquoted no as false: write \"no\"$",
    ):
        with_overrides(cfg, ["train.pretrain.mixed_precision=no"])  # OmegaConf's dotlist is YAML


def test_closed_sets_are_enums_that_compare_as_strings():
    """mixed_precision, resume, eval.engine and the items of eval.methods are Enums of the schema: the YAML files
    compose unchanged and the code's comparisons with strings hold."""
    cfg = compose_config(
        [
            "recipe=ci",
            "eval.engine=vllm",
            "eval.methods=[target,speculative]",
            "train.pretrain.mixed_precision=bf16",
            "train.finetune.resume=never",
        ]
    )
    assert cfg.eval.engine == "vllm" and "speculative" in cfg.eval.methods and "pld" not in cfg.eval.methods
    assert cfg.train.pretrain.mixed_precision.value == "bf16" and cfg.train.finetune.resume == "never"
    assert compose_config(["recipe=paper-vicuna"]).train.finetune.mixed_precision == "bf16"


def test_unknown_lang_lists_every_valid_pair():
    with pytest.raises(ConfigError) as info:
        compose_config(["lang=xx-yy"])
    assert all(pair in str(info.value) for pair in LANGS)


def test_cli_prints_one_line_and_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "distill", "lang=xx-yy"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: unknown lang 'xx-yy'")
