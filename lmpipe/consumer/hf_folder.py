"""`--model DIR`: a Hugging Face model folder (its `config.json`, and optional weights), read without torch or
transformers, so that the settings' check and the launcher's checks (lmpipe/checks.py) refuse a wrong folder
in one line before any process starts. The model itself is built in consumer/hf.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

HF_EXTRA = "pip install 'lmpipe[hf]'"
# what the positions a config allows are called, by model family (GPT-2: n_positions)
MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def is_folder(model: str, presets: tuple[str, ...] | list[str]) -> bool:
    """Whether --model names a folder, not a preset (a preset's name wins over a folder of that name)."""
    return model not in presets and Path(model).is_dir()


def model_problem(model: str, presets: tuple[str, ...]) -> str | None:
    """The --model setting's check: a preset, or a folder that holds a config.json."""
    if model in presets:
        return None
    p = Path(model)
    if p.is_dir():
        if not (p / "config.json").is_file():
            return (
                "a folder without a config.json; a Hugging Face model folder holds one (and optional weights)"
            )
        return None
    return (
        f"no preset and no folder of that name; choose one of {', '.join(presets)}, or a folder holding a "
        "Hugging Face config.json"
    )


def read_config(folder: str) -> dict[str, Any]:
    """config.json as a dict; ValueError (one line) where it is unreadable or names no model type."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model {folder}: config.json cannot be read ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model {folder}: config.json is not a JSON object")
    if "auto_map" in cfg and not cfg.get("model_type"):
        raise ValueError(remote_code_refusal(folder))
    if not isinstance(cfg.get("model_type"), str):
        raise ValueError(f"--model {folder}: config.json names no model_type; not a transformers config")
    return cfg


def remote_code_refusal(folder: str) -> str:
    return (
        f"--model {folder}: its config.json needs code from the folder (trust_remote_code), which lmpipe does "
        "not run; use a model type transformers has built in"
    )


def transformers_problem(folder: str) -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return f"--model {folder}: a Hugging Face model folder needs transformers: {HF_EXTRA}"
    return None


def max_positions(cfg: dict[str, Any]) -> int | None:
    for key in MAX_POSITION_KEYS:
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    return None


def size_problem(folder: str, vocab: int | None, positions: int | None, tokenizer_vocab: int,
                 seq_len: int) -> str | None:  # fmt: skip
    """The model's vocabulary must hold the tokenizer's ids, and its positions --seq-len's."""
    if vocab is not None and vocab < tokenizer_vocab:
        return (
            f"--model {folder}: its vocab_size {vocab:,} is smaller than the tokenizer's {tokenizer_vocab:,}; "
            "train with the model's own tokenizer (--tokenizer) or a config with a larger vocab_size"
        )
    if positions is not None and seq_len > positions:
        return (
            f"--seq-len {seq_len} is above --model {folder}'s {positions} positions (max_position_embeddings)"
        )
    return None


def folder_problem(folder: str, tokenizer_vocab: int, seq_len: int) -> str | None:
    """Everything about --model DIR that can be told without torch: one line, or None."""
    if why := transformers_problem(folder):
        return why
    try:
        cfg = read_config(folder)
    except ValueError as exc:
        return str(exc)
    vocab = cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else None
    return size_problem(folder, vocab, max_positions(cfg), tokenizer_vocab, seq_len)
