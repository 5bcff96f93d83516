"""The user documentation stays true: every relative link in README.md and docs/ resolves (files and GitHub
heading anchors), the make targets, benchmarks and recipes it names exist, and docs/configuration.md is what
``python -m pipeline.config_reference`` generates from the schemas. Fast, offline."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline import config, config_reference
from pipeline.config import REPO_ROOT, options

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append(CODE_SPAN.sub("", line))
    return lines


def code(path: Path) -> list[str]:
    """The file's code: lines of fenced and indented blocks, and inline code spans."""
    snippets, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif fenced or re.match(r" {4,}\S", line) and not re.match(r" *[-*|\[]", line):
            snippets.append(line.strip())
        else:
            snippets += [m.group(0).strip("`") for m in CODE_SPAN.finditer(line)]
    return snippets


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[str]:
    return [m.group(1) for line in prose_lines(path) for m in LINK.finditer(line)]


def test_the_docs_exist():
    names = {p.relative_to(REPO_ROOT).as_posix() for p in DOCS}
    assert {
        "README.md",
        "docs/README.md",
        "docs/configuration.md",
        "docs/custom-target-and-pair.md",
        "docs/stages.md",
        "docs/metrics.md",
        "docs/design.md",
        "docs/slurm.md",
        "docs/benchmarks.md",
        "docs/troubleshooting.md",
        "docs/results/README.md",
        "docs/glossary.md",
    } <= names


def test_readme_stays_short():
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 200


FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.])")  # 1.12 in "1.12×", "τ 1.33", "0.30 at"; not versions


def test_every_readme_figure_is_on_a_result_page_its_section_cites():
    """A README section that links pages of docs/results/ quotes them: each of its decimal figures appears on one of
    those pages (or rounds one of them: 1.34 quotes 1.337), so a remeasured page with a stale README (or a README
    edited past its page) fails here."""
    stale = []
    for section in re.split(r"\n(?=#{2,3} )", (REPO_ROOT / "README.md").read_text()):
        pages = sorted(set(re.findall(r"\((docs/results/[^)#\s]+\.md)", section)))
        if pages:
            on_pages = FIGURE.findall(" ".join((REPO_ROOT / page).read_text() for page in pages))
            quoted = {
                f"{float(figure):.{places}f}"
                for figure in on_pages
                for places in range(1, len(figure.partition(".")[2]) + 1)
            }
            stale += [
                f"{section.splitlines()[0]}: {figure} is on none of {', '.join(pages)}"
                for figure in FIGURE.findall(section)
                if figure not in quoted
            ]
    assert not stale, "; ".join(stale)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_relative_links_resolve(path):
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: — no network here
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.relative_to(REPO_ROOT)}")
    assert not broken, f"{path.relative_to(REPO_ROOT)}: " + "; ".join(broken)


def test_every_results_file_is_indexed():
    index = (REPO_ROOT / "docs" / "results" / "README.md").read_text()
    files = sorted(p.name for p in (REPO_ROOT / "docs" / "results").glob("*.md") if p.name != "README.md")
    assert files and not [name for name in files if f"]({name})" not in index]


def mentioned(pattern: str) -> set[str]:
    """Every first group of ``pattern`` in the docs' code (commands, code spans)."""
    return {m.group(1) for path in DOCS for snippet in code(path) for m in re.finditer(pattern, snippet)}


def test_named_make_targets_benches_recipes_and_pairs_exist():
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.MULTILINE))
    benches = {p.stem for p in (REPO_ROOT / "pipeline" / "bench").glob("*.py") if not p.stem.startswith("_")}
    # `make a b c VAR=...`: every word after `make` up to a variable, an option or a comment is a target
    named = {
        word for command in mentioned(r"(?:^|[\s;(])make((?: [a-z][a-z-]*)+)(?![\w=-])") for word in command.split()
    }
    assert named and named - targets == set(), "make targets the docs name but the Makefile lacks"
    assert mentioned(r"BENCH=([a-z_]+)") - benches == set()
    user_examples = {"myrecipe"}  # docs/custom-target-and-pair.md's recipe in a user config directory
    assert mentioned(r"\b(?:RECIPE|recipe)=([a-z][a-z0-9-]*)") - set(options("recipe")) - user_examples == set()
    user_pairs = {"es-en"}  # docs/custom-target-and-pair.md's pair in a user config directory
    assert mentioned(r"\bLANG=([a-z]{2}-[a-z]{2})\b") - set(options("lang")) - user_pairs == set()


def test_configuration_reference_is_generated(monkeypatch):
    monkeypatch.delenv("SPECDRAFT_CONFIG_DIR", raising=False)  # the shipped configs only
    committed = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_reference.markdown(), (
        "docs/configuration.md is stale: python -m pipeline.config_reference > docs/configuration.md"
    )


def test_configuration_reference_covers_every_section():
    keys = [doc.key for doc in config_reference.documented_keys()]
    assert len(keys) == len(set(keys))
    assert {config_reference.section_of(k) for k in keys} == {*config_reference.SECTIONS, ""}
    assert {
        "train.finetune.on_policy.lr",
        "distill.server.data_parallel",
        "data.pretrain_corpora[].weight",
        "export.num_prompts",
        "run",
    } <= set(keys)
    doc = {d.key: d for d in config_reference.documented_keys()}["eval.tie_tolerance"]
    assert (doc.type, doc.default) == ("float", "0.5") and doc.help.startswith("Greedy gate in bf16/fp16")


def test_help_text_is_read_from_comments():
    """Trailing comments, comment lines above a field, inherited fields and enum values all give help text."""
    docs = {d.key: d for d in config_reference.documented_keys()}
    assert docs["target.name"].help == "short id, used in run-directory paths"
    assert docs["data.back_translation"].help.startswith("offline sources: this many ShareGPT segments")
    assert docs["train.finetune.token_budget"].help == docs["train.pretrain.token_budget"].help != ""
    assert "`hub`: a Hugging Face hub id" in docs["target.source"].help
    assert docs["target.source"].type == "gguf_package | hub | local | init"
    assert docs["target.gguf_file"].type == "str | null" and docs["target.name"].default == "required"


def test_every_key_has_help_text():
    """A comment on every field in the schemas (nor on an enum's values): the reference's help column."""
    assert [doc.key for doc in config_reference.documented_keys() if not doc.help] == []


def test_every_enum_value_is_explained():
    """A comment on every value of the schemas' enums: the reference says what each value means."""
    assert (
        sorted(
            f"{e.__name__}.{m.name}"
            for e in config_reference._enums(config.Config)
            for m in e
            if not config_reference._comments(e).get(m.name)
        )
        == []
    )
