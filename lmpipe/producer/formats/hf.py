"""Hugging Face `save_to_disk` folders: state.json beside data-*.arrow.

Such a folder stands for its Arrow files in state.json's order, read with pyarrow alone: the `datasets`
package is not needed. A DatasetDict folder (dataset_dict.json) is refused with the splits named: pass one
split's folder.
"""

from __future__ import annotations

import json

from lmpipe.producer.formats.kinds import FormatError


def hf_files(where: str, names: set[str], read) -> list[str] | None:
    """Arrow file names of a Hugging Face `save_to_disk` folder in order, or None if it is not one."""
    if "dataset_dict.json" in names:
        try:
            splits = json.loads(read("dataset_dict.json")).get("splits", [])
        except (ValueError, AttributeError, RecursionError):
            splits = []
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            splits = []  # a hand-edited file: the splits are not named, the folder is still refused
        raise FormatError(
            f"{where} is a Hugging Face DatasetDict (splits: {', '.join(map(str, splits)) or '?'}); "
            f"pass one split's folder, e.g. {where.rstrip('/')}/{splits[0] if splits else 'train'}"
        )
    if "state.json" not in names:
        return None
    try:
        files = [entry["filename"] for entry in json.loads(read("state.json"))["_data_files"]]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise FormatError(
            f"{where}/state.json: not a Hugging Face dataset state ({str(exc)[:200] or type(exc).__name__})"
        ) from None
    if not all(isinstance(f, str) for f in files):  # a number among them stopped the join below
        raise FormatError(
            f"{where}/state.json: not a Hugging Face dataset state (a filename is not a string)"
        )
    missing = [f for f in files if f not in names]
    if missing:
        raise FormatError(f"{where}: state.json lists {', '.join(missing)}, which is missing")
    return files
