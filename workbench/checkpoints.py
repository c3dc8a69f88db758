"""Checkpoint folders checked before an engine starts: configs, weights' headers, shards, quantization.

    checkpoint_problems(folder, role, weights=True) -> [problem, ...]

A truncated or half-copied checkpoint otherwise loads until vLLM's safetensors reader meets the
missing bytes inside a leg (``incomplete metadata, file not fully covered``), naming neither the
file nor the role, after other legs have run. These checks read only headers and JSON (a few
milliseconds for a 32B checkpoint's shards), so the run's preflight and each leg's early input check
make them for every role:

* ``config.json`` is a readable JSON object, and its ``quantization_config`` (and a
  ``quantization_config.json`` / ``quant_config.json`` beside it) is readable: an object naming its
  ``quant_method``; compressed-tensors' ``config_groups`` each with integer weight ``num_bits``;
* every ``*.safetensors`` file: the 8-byte header length, the JSON header, every tensor's
  ``data_offsets`` inside the data and matching its shape and dtype, and the file's size equal to
  8 + header length + the end of the last tensor (what the safetensors reader demands);
* ``model.safetensors.index.json``: readable, and every shard its ``weight_map`` names is there and
  holds the tensors the map assigns to it;
* a folder with no weights at all (unless ``weights=False``: the shape stand-ins, which vLLM fills
  with random weights under ``load_format: dummy``).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

__all__ = ["checkpoint_problems", "config_problems", "file_problems", "weight_problems", "safetensors_header",
           "quantization_problems", "INDEX"]


INDEX = "model.safetensors.index.json"
QUANT_FILES = ("quantization_config.json", "quant_config.json")
# bytes per element of the safetensors dtypes
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# a header larger than this is not a safetensors header (the reader's own limit is 100 MB)
_MAX_HEADER = 100_000_000


def _read_json(path: Path, what: str) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text()), None
    except json.JSONDecodeError as exc:
        return None, f"{what} {path} is not valid JSON ({exc})"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"cannot read {what} {path} ({getattr(exc, 'strerror', None) or exc})"


def safetensors_header(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the header's tensors, None) or (None, why the file is not a whole safetensors file)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None, f"{path} is {size} bytes: too short for a safetensors header"
            n = struct.unpack("<Q", head)[0]
            if n > min(size - 8, _MAX_HEADER):
                return None, (f"{path}: its header claims {n} bytes but the file has {size} "
                              "(truncated, or not a safetensors file)")
            raw = f.read(n)
    except OSError as exc:
        return None, f"cannot read {path} ({exc.strerror or exc})"
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"{path}: its header is not valid JSON ({exc}; truncated or not a safetensors file)"
    if not isinstance(header, dict):
        return None, f"{path}: its header is a JSON {type(header).__name__}, not an object"
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = 0
    for name, t in tensors.items():
        try:
            begin, stop = (int(x) for x in t["data_offsets"])
            count = math.prod(int(d) for d in t["shape"])
            width = _DTYPE_BYTES.get(t["dtype"])
        except (KeyError, TypeError, ValueError):
            return None, f"{path}: tensor {name!r} has no valid dtype, shape and data_offsets in the header"
        if not 0 <= begin <= stop:
            return None, f"{path}: tensor {name!r} has data_offsets [{begin}, {stop}]"
        if width is not None and stop - begin != count * width:
            return None, (f"{path}: tensor {name!r} ({t['dtype']} {list(t['shape'])}) needs {count * width} "
                          f"bytes, its data_offsets give {stop - begin}")
        end = max(end, stop)
    want = 8 + n + end
    if size != want:
        return None, (f"{path} is {size} bytes; its header describes {want} (8 + {n} header + {end} data): "
                      + ("truncated" if size < want else "bytes beyond the last tensor"))
    return tensors, None


def weight_problems(folder: str | Path) -> list[str]:
    """The folder's weights: every safetensors file whole, the index's shards present and consistent."""
    folder = Path(folder)
    problems: list[str] = []
    headers: dict[str, dict[str, Any] | None] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors, why = safetensors_header(f)
        headers[f.name] = tensors
        if why:
            problems.append(why)
    index = folder / INDEX
    if index.exists():
        data, why = _read_json(index, "weight index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if why:
            problems.append(why)
        elif not isinstance(weight_map, dict) or not weight_map:
            problems.append(f"weight index {index} has no weight_map (tensor name -> shard file)")
        else:
            by_shard: dict[str, list[str]] = {}
            for name, shard in weight_map.items():
                by_shard.setdefault(str(shard), []).append(name)
            for shard, names in sorted(by_shard.items()):
                if shard not in headers:
                    problems.append(f"weight index {index} names shard {shard} ({len(names)} tensors), "
                                    f"which is not in {folder}")
                elif headers[shard] is not None:
                    absent = [n for n in names if n not in headers[shard]]
                    if absent:
                        problems.append(f"{folder / shard} lacks {len(absent)} tensor(s) that {INDEX} assigns "
                                        f"to it (first: {absent[0]!r})")
    if not headers and not any(folder.glob("pytorch_model*.bin")) and not any(folder.glob("*.pt")):
        problems.append(f"{folder} holds no weights (no *.safetensors or pytorch_model*.bin)")
    return problems


def _quant_config_problem(q: Any, where: str) -> str | None:
    if not isinstance(q, dict):
        return f"{where} is a JSON {type(q).__name__}, not an object"
    method = q.get("quant_method")
    if not isinstance(method, str) or not method:
        return f"{where} names no quant_method"
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            return f"{where} (compressed-tensors) has no config_groups"
        for name, g in groups.items():
            w = g.get("weights") if isinstance(g, dict) else None
            if not isinstance(g, dict) or (w is not None and not (isinstance(w, dict)
                                                                  and isinstance(w.get("num_bits"), int))):
                return f"{where}: config group {name!r} has no readable weights scheme (integer num_bits)"
    return None


def quantization_problems(folder: str | Path, config: dict[str, Any]) -> list[str]:
    """The quantization config in ``config.json`` and in the files beside it, readable."""
    folder = Path(folder)
    problems = []
    for c, where in ((config, "config.json"), (config.get("text_config"), "config.json text_config")):
        if isinstance(c, dict) and "quantization_config" in c:
            why = _quant_config_problem(c["quantization_config"], f"{folder}: {where}'s quantization_config")
            if why:
                problems.append(why)
    for name in QUANT_FILES:
        path = folder / name
        if path.exists():
            data, why = _read_json(path, "quantization config")
            why = why or _quant_config_problem(data, f"quantization config {path}")
            if why:
                problems.append(why)
    return problems


def config_problems(folder: str | Path) -> tuple[dict[str, Any] | None, list[str]]:
    """(config.json as a dict or None, problems): the folder is there and has a readable config."""
    folder = Path(folder)
    if not folder.exists():
        return None, [f"checkpoint not found: {folder}"]
    if not (folder / "config.json").is_file():
        return None, [f"checkpoint {folder} has no config.json (not a model folder?)"]
    data, why = _read_json(folder / "config.json", "config")
    if why:
        return None, [why]
    if not isinstance(data, dict):
        return None, [f"{folder / 'config.json'} holds a JSON {type(data).__name__}, not an object"]
    return data, []


def file_problems(folder: str | Path, config: dict[str, Any], weights: bool = True) -> list[str]:
    """The problems of a folder whose ``config.json`` read as ``config``: its quantization config and
    (``weights``) its weight files."""
    return quantization_problems(folder, config) + (weight_problems(folder) if weights else [])


def checkpoint_problems(folder: str | Path, role: str, weights: bool = True) -> list[str]:
    """Every problem of one role's checkpoint folder, each line naming the role and the file."""
    config, problems = config_problems(folder)
    if config is not None:
        problems += file_problems(folder, config, weights)
    return [f"{role}: {p}" for p in problems]
