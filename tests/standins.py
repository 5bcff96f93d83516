"""Offline stand-ins for the paper recipes (issue 18), built by the tests, never downloaded.

- ``family_source(family, folder)``: what a dry run reads of a hub target: its tokenizer (trained here on
  this module's sentences, with the family's conventions) and its config.json at the real 7B shape (the dry
  run shrinks it). ``llama2``: ``<s>``/``</s>``, no pad token, BOS added by the tokenizer and rendered by the
  chat template too, Llama-2-chat's template and generation config (top_p 0.9). ``vicuna``: the same tokenizer
  without a template (the recipe's config carries the paper's format). ``gemma``: ``<bos>``/``<eos>``/``<pad>``,
  ``<start_of_turn>``/``<end_of_turn>``, gemma-7b-it's template (BOS inside).
- ``drafter_start(family_folder, folder)``: random weights of the paper's Llama-68M drafter shape on a family's
  tokenizer: what ``drafter.init_from`` (paper-vicuna: double7/vicuna-68m) starts from in a dry run.
- ``serve_hub({repo_id: folder})``: a stand-in of the hub's model API on a local port (HF_ENDPOINT): repo info,
  file tree and file downloads, so `make prepare` downloads a hub target through huggingface_hub's own calls.
- ``datasets_root(folder)``: local datasets in the hub's schemas, read through the same ``datasets`` calls:
  ``wmt16`` (``translation: {de, en}``, one config per pair, train/validation/test parquet), ``wmt19``
  (zh-en, train and validation only), ``c4`` (config ``en``, JSON lines {text, timestamp, url} gzipped), and
  a five-column JParaCrawl TSV (domain, domain, score, English, Japanese).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LLAMA2_CHAT_TEMPLATE = (  # meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_CHAT_TEMPLATE = (  # google/gemma-7b-it's tokenizer_config.json
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

# (German, English, Chinese, Japanese, French): the sentences of every stand-in dataset
SENTENCES = [
    (
        "Das Wetter ist heute sehr schön.",
        "The weather is very nice today.",
        "今天天气很好。",
        "今日はとても良い天気です。",
        "Il fait très beau aujourd'hui.",
    ),
    (
        "Bitte schicken Sie mir die Unterlagen bis Freitag.",
        "Please send me the documents by Friday.",
        "请在星期五之前把文件发给我。",
        "金曜日までに書類を送ってください。",
        "Envoyez-moi les documents avant vendredi.",
    ),
    (
        "Die Sitzung wurde auf Donnerstag verschoben.",
        "The meeting was moved to Thursday.",
        "会议改到了星期四。",
        "会議は木曜日に変更されました。",
        "La réunion a été déplacée à jeudi.",
    ),
    (
        "Wo ist der nächste Bahnhof?",
        "Where is the nearest train station?",
        "最近的火车站在哪里？",
        "一番近い駅はどこですか？",
        "Où est la gare la plus proche ?",
    ),
    (
        "Ich habe das Buch gestern gelesen.",
        "I read the book yesterday.",
        "我昨天读了这本书。",
        "昨日その本を読みました。",
        "J'ai lu le livre hier.",
    ),
    (
        "Der Preis ist in diesem Jahr gestiegen.",
        "The price has risen this year.",
        "今年价格上涨了。",
        "今年は価格が上がりました。",
        "Le prix a augmenté cette année.",
    ),
    (
        "Können Sie mir bitte helfen?",
        "Can you help me, please?",
        "你能帮我一下吗？",
        "手伝っていただけますか？",
        "Pouvez-vous m'aider, s'il vous plaît ?",
    ),
    (
        "Die Kinder spielen im Garten.",
        "The children are playing in the garden.",
        "孩子们在花园里玩。",
        "子供たちは庭で遊んでいます。",
        "Les enfants jouent dans le jardin.",
    ),
]
LANGS = ("de", "en", "zh", "ja", "fr")


def sentence_pairs(count: int, offset: int = 0) -> list[dict[str, str]]:
    """``count`` distinct rows {de, en, zh, ja, fr}: the sentences, numbered so every row is new."""
    rows = []
    for i in range(offset, offset + count):
        base = SENTENCES[i % len(SENTENCES)]
        rows.append({lang: f"{text} ({i})" for lang, text in zip(LANGS, base)})
    return rows


def _train_tokenizer(specials: list[str], bos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [text for row in sentence_pairs(64) for text in row.values()]
    corpus += [
        "Translate German to English:",
        "Chinese Japanese French English USER: ASSISTANT: [INST] [/INST]",
        "A chat between a curious user and an artificial intelligence assistant.",
        "model user",
    ]
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    return tokenizer


def family_source(family: str, folder: Path) -> Path:
    """A folder with the family's tokenizer and 7B config.json (no weights): ``target.source=local`` for a dry run."""
    from transformers import GemmaConfig, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    if family in ("llama2", "vicuna"):
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=_train_tokenizer(["<unk>", "<s>", "</s>"], "<s>"),
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
        )
        if family == "llama2":
            tokenizer.chat_template = LLAMA2_CHAT_TEMPLATE
            GenerationConfig(
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=0,
                do_sample=True,
                temperature=0.6,
                top_p=0.9,
                max_length=4096,
            ).save_pretrained(folder)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=None,
            tie_word_embeddings=False,
            dtype="float16",
        )
    elif family == "gemma":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=_train_tokenizer(specials, "<bos>"),
            bos_token="<bos>",
            eos_token="<eos>",
            unk_token="<unk>",
            pad_token="<pad>",
            additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        )
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
        GenerationConfig(bos_token_id=2, eos_token_id=1, pad_token_id=0).save_pretrained(folder)
        config = GemmaConfig(
            vocab_size=len(tokenizer),
            hidden_size=3072,
            intermediate_size=24576,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=256,
            max_position_embeddings=8192,
            hidden_activation="gelu_pytorch_tanh",
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
            dtype="bfloat16",
        )
    else:
        raise ValueError(f"unknown family {family}")
    tokenizer.save_pretrained(folder)
    config.save_pretrained(folder)
    return folder


def drafter_start(family_folder: Path, folder: Path) -> Path:
    """A folder of the vicuna-68m shape (conf/drafter/vicuna-68m.yaml) with ``family_folder``'s tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(family_folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def serve_hub(repos: dict[str, Path]) -> Iterator[str]:
    """Serve each folder as the model repo ``repo_id`` at one commit (its files' hash); yields the endpoint URL.
    Answers what huggingface_hub's snapshot_download and model_info ask: repo info, the file tree, file downloads."""
    files = {
        repo: {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        for repo, folder in repos.items()
    }
    commits = {
        repo: hashlib.sha1(b"".join(name.encode() + data for name, data in repo_files.items())).hexdigest()
        for repo, repo_files in files.items()
    }

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        def _json(self, value) -> None:
            self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

        def _answer(self) -> None:
            path = self.path.split("?")[0]
            for repo, repo_files in files.items():
                if path == f"/api/models/{repo}" or path.startswith(f"/api/models/{repo}/revision/"):
                    return self._json(
                        {"id": repo, "sha": commits[repo], "siblings": [{"rfilename": f} for f in repo_files]}
                    )
                if path.startswith(f"/api/models/{repo}/tree/"):
                    return self._json(
                        [
                            {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                            for name, data in repo_files.items()
                        ]
                    )
                if path.startswith(f"/{repo}/resolve/"):
                    name = path.split("/", 5)[5]  # /org/name/resolve/<revision>/<file>
                    if name in repo_files:
                        data = repo_files[name]
                        return self._send(
                            200, data, {"X-Repo-Commit": commits[repo], "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
                        )
            self._send(404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"})

        do_GET = do_HEAD = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _dataset_card(folder: Path, configs: dict[str, dict[str, str]]) -> None:
    """A README.md whose YAML declares the configs and their splits' files, as the hub's datasets do."""
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {path}" for split, path in splits.items()]
    (folder / "README.md").write_text("\n".join(lines + ["---", ""]))


def _translation_parquet(path: Path, rows: list[dict[str, str]], src: str, tgt: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"translation": [{src: row[src], tgt: row[tgt]} for row in rows]}), path)


def datasets_root(folder: Path) -> dict[str, Path]:
    """The stand-in datasets under ``folder``: {"wmt16", "wmt19", "c4", "jparacrawl"} -> path."""
    wmt16, wmt19, c4 = folder / "wmt16", folder / "wmt19", folder / "c4"
    splits = {"train": sentence_pairs(24), "validation": sentence_pairs(8, 100), "test": sentence_pairs(8, 200)}
    for pair in ("de-en", "fr-en"):
        for split, rows in splits.items():
            _translation_parquet(wmt16 / pair / f"{split}-00000-of-00001.parquet", rows, *pair.split("-"))
    _dataset_card(
        wmt16, {pair: {split: f"{pair}/{split}-*.parquet" for split in splits} for pair in ("de-en", "fr-en")}
    )
    for split in ("train", "validation"):  # wmt19 zh-en has no test split
        _translation_parquet(wmt19 / "zh-en" / f"{split}-00000-of-00001.parquet", splits[split], "zh", "en")
    _dataset_card(wmt19, {"zh-en": {split: f"zh-en/{split}-*.parquet" for split in ("train", "validation")}})
    (c4 / "en").mkdir(parents=True, exist_ok=True)
    with gzip.open(c4 / "en" / "c4-train.00000-of-01024.json.gz", "wt") as handle:
        for i, row in enumerate(sentence_pairs(60)):
            text = " ".join([row["en"]] * 8)
            handle.write(
                json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{i}"})
                + "\n"
            )
    _dataset_card(c4, {"en": {"train": "en/c4-train.*-of-01024.json.gz"}})
    jparacrawl = folder / "jparacrawl" / "en-ja.bicleaner05.txt"
    jparacrawl.parent.mkdir(parents=True, exist_ok=True)
    jparacrawl.write_text(
        "".join(
            f"site{i}.com\tsite{i}.jp\t0.{70 + i % 30}\t{row['en']}\t{row['ja']}\n"
            for i, row in enumerate(sentence_pairs(40))
        )
    )
    return {"wmt16": wmt16, "wmt19": wmt19, "c4": c4, "jparacrawl": jparacrawl}


# The recipes' families and the pair each dry run takes (every data path once: WMT16, WMT19 without a test
# split, JParaCrawl's file).
RECIPE_FAMILIES = {
    "paper-vicuna": ("vicuna", "de-en"),
    "paper-vicuna-f-only": ("vicuna", "de-en"),
    "paper-llama2": ("llama2", "zh-en"),
    "paper-gemma": ("gemma", "ja-en"),
}


# Two sequences a training step instead of the dry run's 8: the paper recipes train in bf16 autocast, native on a
# Xeon with AVX512-BF16 but still ~4x a float32 step of two sequences there (elsewhere the step is float32: 4.4 s for
# paper-gemma's drafter at 8 x 64 tokens on a 2-core AMD EPYC); two sequences still pad and collate as eight.
SMALL_BATCHES = ["train.pretrain.batch_size=2", "train.finetune.batch_size=2"]


def dry_run_overrides(
    family_folder: Path, data: dict[str, Path], pair: str, runs_dir: Path, cache_dir: Path
) -> list[str]:
    """The config overrides that point a paper recipe's dry run at the stand-ins (hub ids -> local folders)."""
    overrides = [
        *SMALL_BATCHES,
        "target.source=local",
        f"target.path={family_folder}",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={cache_dir}",
        f"paths.models_dir={cache_dir / 'models'}",
        f"data.pretrain_corpora.0.hub_dataset={data['c4']}",
        "logger.mode=offline",
    ]
    if pair == "ja-en":
        overrides.append(f"lang.hub.file={data['jparacrawl']}")
    else:
        overrides.append(f"lang.hub.dataset={data['wmt19' if pair == 'zh-en' else 'wmt16']}")
    return overrides
