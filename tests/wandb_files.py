"""Reading wandb's offline run files in tests: wandb (0.31) has no Python reader for them, so tests check what a
stage logged before anything is synced with this one."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(wandb_file: str | Path) -> dict[str, Any]:
    """What an offline run file (``run-<id>.wandb``) holds: ``{"config", "history", "summary"}``.

    wandb has no reader for these files; they are a LevelDB-style log (32 KiB blocks, 7-byte chunk headers)
    of ``Record`` protobufs.
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(wandb_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{wandb_file} is not a wandb run file")
    block, pos, chunks = 32768, 7, []
    run: dict[str, Any] = {"config": {}, "history": [], "summary": {}}
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind not in (1, 4):  # FIRST/MIDDLE chunks of a record that spans blocks
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(b"".join(chunks))
        chunks = []
        if record.HasField("run"):
            run["config"].update({_item_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif record.HasField("config"):
            run["config"].update({_item_key(i): json.loads(i.value_json) for i in record.config.update})
        elif record.HasField("history"):
            run["history"].append({_item_key(i): json.loads(i.value_json) for i in record.history.item})
        elif record.HasField("summary"):
            run["summary"].update({_item_key(i): json.loads(i.value_json) for i in record.summary.update})
    return run
