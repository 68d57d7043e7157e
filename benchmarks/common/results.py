"""Result files: JSON with one record per line (diff-friendly, and as small as the data) and CSV."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path


def _dumps(value) -> str:
    return json.dumps(value, default=str, allow_nan=True)


def write_json(path, data) -> Path:
    """Write ``data`` as JSON: each top-level key on its own line, and each element of a top-level list on
    its own line (a row of results is one line). ``json.load`` reads it back unchanged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, dict):
        lines = []
        for key, value in data.items():
            if isinstance(value, list) and value:
                items = ",\n  ".join(_dumps(v) for v in value)
                lines.append(f"{_dumps(key)}: [\n  {items}\n ]")
            else:
                lines.append(f"{_dumps(key)}: {_dumps(value)}")
        text = "{\n " + ",\n ".join(lines) + "\n}\n" if lines else "{}\n"
    elif isinstance(data, list):
        text = "[\n " + ",\n ".join(_dumps(v) for v in data) + "\n]\n" if data else "[]\n"
    else:
        text = _dumps(data) + "\n"
    # through a temporary file and a rename: scripts rewrite their results after every row, and a call's
    # time limit that kills one mid-write must leave the previous version whole
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_csv(path, rows: list[dict], fields: list[str] | None = None) -> Path:
    """One CSV row per dict; the columns are ``fields`` or every key in order of first appearance."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fields is None:
        fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path
