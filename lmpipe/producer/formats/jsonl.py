"""JSON Lines records.

One object per line with a `text` string (or the key --text-column names), or pre-tokenized `ids` (a list
of token ids), or, to train on only some tokens (fine-tuning), a `prompt` and a `completion` string (the
loss is taken on the completion and the end-of-text token after it) or `ids` with a `loss_mask` of 0/1 per
id (1: the model is trained to predict that token). A record with Hugging Face's per-token `labels` and no
text is a bad record (`bad_mask`) that names those two forms, as a table's `labels` column is warned about
(tables.py): never its ids trained in full unsaid. Anything else a line holds is a bad record with its file
and line, counted and skipped: never an exception out of the reader.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmpipe.producer.formats.kinds import DataFile
from lmpipe.producer.formats.lines import CR_HINT, read_lines
from lmpipe.producer.records import Record

log = logging.getLogger("lmpipe.producer")
_said_unread: set[str] = set()  # files whose records hold keys that are not read, said once


LABELS_HINT = (
    '"labels" is not read: write {"ids": [...], "loss_mask": [...]} (loss_mask 0 where labels is -100, '
    'else 1) or {"prompt": "...", "completion": "..."}'
)


def jsonl_records(
    path: Path | DataFile,
    first_rid: int,
    max_line_bytes: int,
    vocab_size: int | None,
    notes: dict[str, bool] | None = None,
    text_key: str = "text",
) -> Iterator[Record]:
    rid = first_rid
    notes = {} if notes is None else notes
    for lineno, raw, size in read_lines(path, max_line_bytes, notes):
        where = f"{path}:{lineno}"
        if raw is not None and not raw.strip():
            continue  # blank lines are not records
        rec = Record(rid=rid, where=where)
        rid += 1
        if raw is None:
            cr = f"; {CR_HINT}" if notes.get("cr") else ""
            rec.bad = ("line_too_long", f"line of {size} bytes exceeds {max_line_bytes}{cr}")
            yield rec
            continue
        if lineno == 1 and raw.strip() == b"[":  # a JSON array (what json.dump writes): each line is junk
            rec.bad = ("bad_json", "a JSON array, not JSON Lines: write one object per line (jq -c '.[]')")
            yield rec
            continue
        obj, rec.bad = _parse(raw, CR_HINT if notes.get("cr") and lineno == 1 else "")
        if rec.bad is None:
            _read_object(rec, obj, vocab_size, text_key)
            if rec.bad is None and _SURROGATE_ESCAPE.search(raw) and not _utf8(rec.text, rec.prompt):
                rec.bad = (
                    "invalid_utf8",
                    "a lone UTF-16 surrogate escape (\\ud800-\\udfff), which UTF-8 cannot hold",
                )
            if rec.bad is None:
                _say_unread(path, where, obj, text_key)
        yield rec


def _parse(raw: bytes, cr_hint: str) -> tuple[Any, tuple[str, str] | None]:
    """A line's JSON value, or why it has none: every way the parser fails is this line's problem only."""
    try:
        return json.loads(raw.decode("utf-8")), None
    except UnicodeDecodeError as exc:
        return None, ("invalid_utf8", f"invalid UTF-8 at byte {exc.start}")
    except json.JSONDecodeError as exc:
        cr = f"; {cr_hint}" if cr_hint else ""
        return None, ("bad_json", f"not valid JSON ({exc.msg} at column {exc.colno}){cr}")
    except RecursionError:  # [[[[... or {"a":{"a":... a few hundred KB deep: the parser's stack, not ours
        return None, ("bad_json", "JSON nested too deeply to parse")
    except ValueError as exc:  # an integer past Python's digit limit (4,300): {"n": 999...} stopped the job
        if "digits" in str(exc):
            limit = sys.get_int_max_str_digits()
            return None, ("bad_json", f"an integer of more than {limit:,} digits, which is not parsed")
        return None, ("bad_json", f"not valid JSON ({exc})")


def _read_object(rec: Record, obj: Any, vocab_size: int | None, text_key: str) -> None:
    """Fill `rec` from a line's JSON value: its text, prompt and completion, or ids (and loss mask), or
    `bad` saying why none."""
    if not isinstance(obj, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(obj), "a number"
        )
        rec.bad = ("bad_json", f"line is {kind}, not a JSON object (JSON Lines: one object per line)")
    elif "prompt" in obj or "completion" in obj:
        _prompt_completion(rec, obj)
    elif "loss_mask" in obj:
        _masked_ids(rec, obj, vocab_size)
    elif isinstance(obj.get(text_key), str):
        rec.text = obj[text_key]
        if not rec.text.strip():
            rec.bad = ("empty", "empty text")
    elif "labels" in obj:  # Hugging Face's targets: training every id instead would be silent harm
        rec.bad = ("bad_mask", LABELS_HINT)
    elif isinstance(obj.get("ids"), list):
        ids = obj["ids"]
        limit = vocab_size or (1 << 31)
        if not ids:
            rec.bad = ("empty", "empty ids")
        elif not _ids_in(ids, limit):
            rec.bad = ("bad_ids", f"ids must be integers in [0, {limit})")
        else:
            rec.ids = ids
    else:
        # a key is shown escaped: one with a lone surrogate ("\\ud800") cannot be written to the log
        strings = [_printable(k) for k, v in obj.items() if isinstance(v, str)][:4]
        hint = f"; its string keys: {', '.join(strings)} (--text-column NAME reads one)" if strings else ""
        rec.bad = (
            "missing_text",
            f'object has no "{text_key}" string, "ids" list, or "prompt" and "completion" strings{hint}',
        )


def _ids_in(ids: list, limit: int) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in ids)


def _printable(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


# JSON may escape half of a UTF-16 pair ("\ud800"); json.loads keeps it as a lone surrogate, which no UTF-8
# text holds and the tokenizer refuses with a TypeError that stopped the producer. Pairs decode to one
# character. Only lines with such an escape are checked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _utf8(*texts: str | None) -> bool:
    try:
        for t in texts:
            if t is not None:
                t.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


KNOWN_KEYS = ("text", "ids", "input_ids", "prompt", "completion", "loss_mask")


def _say_unread(path: Path | DataFile, where: str, obj: dict, text_key: str = "text") -> None:
    """Once per file: a good record that also holds the keys of another kind of record, not read."""
    if str(path) in _said_unread:
        return
    used: tuple[str, ...]
    if "prompt" in obj or "completion" in obj:  # the kinds as jsonl_records tells them apart
        used, rule = ("prompt", "completion"), "a prompt/completion record trains its completion"
    elif "loss_mask" in obj:
        used, rule = ("ids", "loss_mask"), "a record with a loss_mask trains the ids it marks"
    elif isinstance(obj.get(text_key), str):
        used, rule = (text_key,), f'a record with "{text_key}" trains its text'
        if isinstance(obj.get("ids"), list):
            rule += f' (drop "{text_key}" to train "ids" as they are)'
    else:
        used, rule = ("ids",), "an ids record trains its ids as they are"
    unread = [k for k in KNOWN_KEYS if k not in used and obj.get(k) is not None]
    if unread:
        _said_unread.add(str(path))  # once per file and process: files are reopened every epoch
        hint = '; token ids go in "ids" in JSON Lines' if "input_ids" in unread else ""
        log.warning("%s: %s not read: %s%s (said once per file)", where,
                    ", ".join(f'"{k}"' for k in unread), rule, hint)  # fmt: skip


def _prompt_completion(rec: Record, obj: dict) -> None:
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        got = ", ".join(f"{k} is {type(obj.get(k)).__name__ if k in obj else 'missing'}"
                        for k in ("prompt", "completion"))  # fmt: skip
        hint = '; a plain "text" record has neither key' if "text" in obj else ""
        rec.bad = ("bad_prompt", f'"prompt" and "completion" must both be strings ({got}){hint}')
    elif not completion.strip():
        rec.bad = ("empty", "empty completion: nothing to train on")
    else:
        rec.prompt, rec.text = prompt, completion


def _masked_ids(rec: Record, obj: dict, vocab_size: int | None) -> None:
    ids, mask = obj.get("ids"), obj.get("loss_mask")
    limit = vocab_size or (1 << 31)
    if not isinstance(ids, list):
        rec.bad = ("bad_mask", '"loss_mask" needs an "ids" list of the same length')
    elif not ids:
        rec.bad = ("empty", "empty ids")
    elif not _ids_in(ids, limit):
        rec.bad = ("bad_ids", f"ids must be integers in [0, {limit})")
    elif not isinstance(mask, list) or len(mask) != len(ids):
        what = f"{len(mask)} values" if isinstance(mask, list) else f"a {type(mask).__name__}"
        rec.bad = ("bad_mask", f"loss_mask must be a list of {len(ids)} values (one per id), not {what}")
    elif not all(type(m) is int and m in (0, 1) for m in mask):  # True/False are not 1/0 here either
        rec.bad = ("bad_mask", "loss_mask values must be 0 or 1")
    else:
        rec.ids, rec.loss_mask = ids, mask
