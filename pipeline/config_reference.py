"""The configuration reference, generated from the schemas in ``pipeline/config/schemas.py`` so it cannot drift.

    python -m pipeline.config_reference > docs/configuration.md

Every key is a field of a dataclass reachable from ``Config``; its help text is the field's comment in the
source (the trailing ``# comment`` of its line, after the comment lines right above it), read with
``inspect`` and ``tokenize``. ``tests/test_docs.py`` checks that docs/configuration.md equals ``markdown()``.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import tokenize
import types
import typing
from enum import Enum
from functools import cache
from typing import Any, NamedTuple

from omegaconf import MISSING, OmegaConf

from pipeline import config

# The sections of Config, in the order a user meets them; the config groups among them have conf/<group>/.
SECTIONS = (
    "target",
    "drafter",
    "lang",
    "data",
    "distill",
    "train",
    "eval",
    "export",
    "scaling",
    "serve_bench",
    "logger",
    "paths",
)
RECIPE = config.DEFAULT_RECIPE  # the reference shows this recipe's composed value of every key beside the default
MAX_CELL = 60  # longer values are cut in the recipe column (`specdraft config` prints them whole)


class KeyDoc(NamedTuple):
    key: str  # dotted, as written on the command line; `[]` stands for any item of a list
    type: str
    default: str  # the schema's default ("required" where a config file must set it)
    # the field's comment in pipeline/config/schemas.py, then what its values mean for an enum ("" where none)
    help: str


@cache
def _comments(cls: type) -> dict[str, str]:
    """{name: help text} of the fields (or enum members) ``cls`` itself declares, from the comments in its source."""
    tokens = tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline)
    helps: dict[str, str] = {}
    above: list[str] = []  # comment-only lines right above the next statement
    statement: list[tokenize.TokenInfo] = []
    depth, previous = 0, None
    for tok in tokens:
        if tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type == tokenize.COMMENT and not statement:
            above.append(tok.string)
        elif tok.type == tokenize.NL and not statement:
            if previous is None or previous.type != tokenize.COMMENT:
                above = []  # a blank line separates a comment from what follows
        elif tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            code = [t for t in statement if t.type not in (tokenize.COMMENT, tokenize.NL)]
            if depth == 1 and len(code) > 1 and code[0].type == tokenize.NAME and code[1].string in (":", "="):
                trailing = [t.string for t in statement if t.type == tokenize.COMMENT]
                helps[code[0].string] = " ".join(c.lstrip("#").strip() for c in above + trailing)
            statement, above = [], []
        else:
            statement.append(tok)
        previous = tok
    return helps


def _help(cls: type, name: str) -> str:
    """The field's help text from the class in the MRO that declares it (FinetuneConfig inherits TrainConfig's)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in inspect.get_annotations(klass):
            return _comments(klass).get(name, "")
    return ""


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    # Optional[X] or X | None
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _enum(tp: Any) -> type[Enum] | None:
    tp = _strip_optional(tp)[0]
    return tp if isinstance(tp, type) and issubclass(tp, Enum) else None


def _item(tp: Any) -> Any:
    """The item type of a list type, else the type itself."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp


def _meanings(tp: Any) -> str:
    """For an enum type or a list of one, what each of its values means (the members' comments in
    pipeline/config/schemas.py)."""
    enum = _enum(_item(tp))
    if enum is None:
        return ""
    comments = _comments(enum)
    return "; ".join(f"`{m.value}`: {comments[m.name]}" for m in enum if comments.get(m.name))


def _enums(cls: type) -> set[type[Enum]]:
    """The Enums of ``cls``'s fields, of their list items and of every section below."""
    found = set()
    for tp in typing.get_type_hints(cls).values():
        item = _item(_strip_optional(tp)[0])
        found |= _enums(item) if dataclasses.is_dataclass(item) else {_enum(item)} - {None}
    return found


def _type_name(tp: Any) -> str:
    tp, optional = _strip_optional(tp)
    if _enum(tp):
        name = " | ".join(member.value for member in tp)
    elif typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        name = "list" if dataclasses.is_dataclass(item) else f"list[{_type_name(item)}]"
    elif tp is Any:
        name = "any"
    else:
        name = getattr(tp, "__name__", str(tp))
    return f"{name} | null" if optional else name


def _value(value: Any) -> str:
    """A value as it is written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, str):
        plain = (
            value and value.strip() == value and value.isprintable() and value.lower() not in ("null", "true", "false")
        )
        return value if plain else json.dumps(value)
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items() if v is not None) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "required" if f.default is MISSING else _value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _value(f.default_factory())
    return "required"


def _walk(cls: type, prefix: str) -> list[KeyDoc]:
    hints = typing.get_type_hints(cls)
    docs = []
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", _strip_optional(hints[f.name])[0]
        if dataclasses.is_dataclass(tp):  # a nested section: its own keys
            docs += _walk(tp, f"{key}.")
            continue
        comment, meanings = _help(cls, f.name), _meanings(tp)
        text = f"{comment} ({meanings})" if comment and meanings else comment or meanings
        if bounds := f.metadata.get("bounds"):  # checked at composition (pipeline/config/checks.py out_of_range)
            text = f"{text}; {'each ' if typing.get_origin(tp) is list else ''}must be {bounds}"
        docs.append(KeyDoc(key, _type_name(hints[f.name]), _default(f), text))
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            docs += _walk(typing.get_args(tp)[0], f"{key}[].")
    return docs


def documented_keys() -> list[KeyDoc]:
    """Every key of the configuration, in the order of the schemas: top-level keys, then each section's."""
    return _walk(config.Config, "")


def section_of(key: str) -> str:
    """The section a dotted key belongs to ("" for the top-level keys)."""
    head = key.split(".")[0].removesuffix("[]")
    return head if head in SECTIONS else ""


def _recipe_values(recipe: str) -> dict[str, str]:
    """{dotted key: value} of the composed recipe (default language), for the reference's recipe column."""
    composed = OmegaConf.to_container(config.compose_config([f"recipe={recipe}"]), resolve=True, enum_to_str=True)
    values = {}

    def visit(node: Any, prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict):
                visit(value, f"{key}.")
            elif isinstance(value, list) and value and isinstance(value[0], dict):
                values[key] = f"{len(value)} item{'s' if len(value) > 1 else ''}"
            else:
                text = _value(value)
                values[key] = text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"

    visit(composed, "")
    return values


def _cell(text: str) -> str:
    """Text for a table cell: GitHub reads `|` as a column break (also in code) and `<word>` as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _code(text: str) -> str:
    """A table cell in code format (backticks inside the value get a longer fence; no HTML inside code)."""
    if not text:
        return ""
    text = text.replace("|", "\\|").replace("\n", " ")
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _options(group: str) -> str:
    names = config.options(group)
    return ", ".join(f"`{name}`" for name in names)


INTRO = f"""\
# Configuration reference

<!-- Generated by `python -m pipeline.config_reference > docs/configuration.md` from the schemas in
pipeline/config/schemas.py (types, defaults and the comments on each field); tests/test_docs.py fails when it is
stale. -->

Every key below can be set on the command line as `key=value` (`specdraft <stage> recipe=NAME lang=PAIR
key=value ...`, or `make <stage> ARGS='key=value ...'`), in a recipe (`recipes/NAME.yaml`) or in a group's
option file (`conf/<group>/NAME.yaml`). A group is chosen by name (`target=NAME`, `eval=paper`); its keys are
then set one by one (`target.dtype=bfloat16`). An unknown key, a wrong type or an unknown option fails when
the config is composed, in one line that lists the valid choices.

- **type**: `a | b` lists the allowed values; `null` means unset; `any` is explained in the help.
- **default**: the schema's default; *required* means the option file must set it.
- **help** ends with the range a number must be in (`must be >= 1`), checked when the config is composed.
- **{RECIPE}**: the value in the default recipe (`recipe={RECIPE}`, `lang=de-en`), where the group files and the
  recipe override the schema. `specdraft config recipe=NAME lang=PAIR [key=value ...]` prints every value of any
  composition.
- `[]` stands for every item of a list: `data.pretrain_corpora[].weight` is set as
  `data.pretrain_corpora.0.weight=0.5`.
"""


def markdown(recipe: str = RECIPE) -> str:
    """The whole reference: one section per group with its options and keys, then the top-level keys."""
    docs = documented_keys()
    values = _recipe_values(recipe)
    contents = ", ".join(f"[`{s}`](#{s})" for s in SECTIONS)
    lines = [INTRO, f"Sections: {contents}, [top-level keys](#top-level-keys).", ""]

    def table(keys: list[KeyDoc]) -> None:
        lines.extend([f"| key | type | default | {recipe} | help |", "|---|---|---|---|---|"])
        for doc in keys:
            default = "*required*" if doc.default == "required" else _code(doc.default)
            lines.append(
                f"| `{doc.key}` | {_cell(doc.type)} | {default} | {_code(values.get(doc.key, ''))} "
                f"| {_cell(doc.help)} |"
            )
        lines.append("")

    for section in SECTIONS:
        lines += [f"## {section}", ""]
        options = _options(section)
        if options:
            lines += [f"Options (`{section}=NAME`, files in `conf/{section}/`): {options}.", ""]
        table([d for d in docs if section_of(d.key) == section])
    lines += [
        "## Top-level keys",
        "",
        f"Recipes (`recipe=NAME`, files in `recipes/`): {_options('recipe')}. "
        "Dry run (`+dry_run=on`, `conf/dry_run/on.yaml`): the recipe's four stages in minutes on a tiny stand-in "
        "target. Launch configs (`train.pretrain.launch`, `train.finetune.launch`, files in `recipes/launch/`): "
        + ", ".join(f"`{p.stem}`" for p in sorted((config.RECIPES_DIR / "launch").glob("*.yaml")))
        + ". How the local recipe trains a drafter where that differs from its `train` section (files in "
        "`recipes/local_drafters/`, named by the drafter, applied when it is chosen; the command line still wins): "
        + ", ".join(f"`{p.stem}`" for p in sorted((config.RECIPES_DIR / "local_drafters").glob("*.yaml")))
        + ".",
        "",
    ]
    table([d for d in docs if not section_of(d.key)])
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
