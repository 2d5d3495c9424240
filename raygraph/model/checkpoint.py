"""A checkpoint's safetensors files and their headers, read without any tensor data, so that a
damaged file is refused by name, in the driver before Ray starts and again where a worker
loads it. No torch here: a damaged file is reported before the driver imports it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# what a model's weights may be stored as (cast to the model's dtype on load, FP8 e4m3 kept
# for the layers an FP8 config quantizes): bytes per element
FLOAT_DTYPES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "F8_E4M3": 1}
INDEX_DTYPES = {"I64": 8, "I32": 4, "BOOL": 1}  # read only where named (checkpoint._entry)
MAX_HEADER_BYTES = 100 << 20  # safetensors refuses larger headers too


class CheckpointError(ValueError):
    """A checkpoint that is damaged or does not match its config, with the file named."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a file's header describes it."""

    dtype: str  # safetensors' name: "BF16", "I8", ...
    shape: tuple[int, ...]


def checkpoint_files(path: str) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index.name} has no readable weight_map: {e}") from None
        files = [root / n for n in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint files listed in the index are missing: {missing}")
    return files


def read_headers(path: str) -> list[tuple[Path, dict[str, StoredTensor]]]:
    """Every file of the checkpoint at `path` with its tensors, each header checked."""
    return [(file, read_header(file)) for file in checkpoint_files(path)]


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, after checking that its header parses, that
    every tensor's bytes lie within the file (a truncated copy fails here) and that every
    tensor is floating point (the model's weights are; integers would be cast silently)."""
    size = file.stat().st_size
    with file.open("rb") as f:
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{file.name}: not a safetensors file, or truncated: its "
                                  f"header length {n} does not fit its {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file.name}: its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file.name}: its header is not a JSON object")
    data_bytes = size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name != "__metadata__":
            tensors[name] = _entry(file, name, entry, data_bytes)
    return tensors


def _entry(file: Path, name: str, entry: object, data_bytes: int) -> StoredTensor:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if not all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)):
            raise ValueError("negative or non-integer")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{name} in {file.name}: malformed header entry ({e})") from None
    # an EAGLE-3 head's vocabulary maps: integers and a mask
    sizes = {**FLOAT_DTYPES, **INDEX_DTYPES} if name in ("d2t", "t2d") else FLOAT_DTYPES
    if dtype not in sizes:
        raise CheckpointError(f"{name} in {file.name}: stored as {dtype}; the model's weights "
                              f"are floating point ({', '.join(FLOAT_DTYPES)})")
    if end > data_bytes:
        raise CheckpointError(f"{name} in {file.name}: its data ends at byte {end} of "
                              f"{data_bytes}: the file is truncated")
    if end - begin != math.prod(shape) * sizes[dtype]:
        raise CheckpointError(f"{name} in {file.name}: {end - begin} bytes stored for shape "
                              f"{list(shape)} of {dtype}")
    return StoredTensor(dtype, shape)
