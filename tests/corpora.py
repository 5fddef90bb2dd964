"""Write one list of documents in every corpus format lmpipe reads, so tests can compare them record by record.

`docs[i]` becomes record i; None becomes a bad record of that format (a null row in a table, a line of
broken JSON in JSONL). The Hugging Face folder is laid out as `datasets`' save_to_disk writes it (Arrow IPC
stream files, dataset_info.json, state.json), written with pyarrow alone.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmpipe.producer import builtin_corpus

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "arrow-file", "hf")


def builtin_docs(n: int, seed: int = 0) -> list[str | None]:
    return [builtin_corpus.document(seed, i) for i in range(n)]


def _jsonl_bytes(docs: list[str | None]) -> bytes:
    lines = [json.dumps({"text": d}) if d is not None else '{"text": "broken' for d in docs]
    return ("\n".join(lines) + "\n").encode()


def _table(docs: list[str | None], column: str = "text") -> pa.Table:
    features = {column: {"dtype": "string", "_type": "Value"}}
    return pa.table({column: pa.array(docs, pa.string())}).replace_schema_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})}
    )


def _write_stream(path: Path, table: pa.Table, batch_rows: int) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=batch_rows):
            w.write_batch(batch)


def write(
    dest: Path, docs: list[str | None], fmt: str, *, rows_per_group: int = 64, column: str = "text"
) -> Path:
    """Write `docs` as `fmt` at dest + its extension (a folder for "hf"); returns the path to pass."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = dest.with_name(dest.name + ".jsonl")
        path.write_bytes(_jsonl_bytes(docs))
    elif fmt == "jsonl.gz":
        path = dest.with_name(dest.name + ".jsonl.gz")
        path.write_bytes(gzip.compress(_jsonl_bytes(docs)))
    elif fmt == "jsonl.zst":
        path = dest.with_name(dest.name + ".jsonl.zst")
        data = _jsonl_bytes(docs)
        half = len(data) // 2  # two frames, as concatenated or appended files have
        import zstandard  # dev extra; imported where used, so the GPU machine (without it) can collect

        cctx = zstandard.ZstdCompressor()
        path.write_bytes(cctx.compress(data[:half]) + cctx.compress(data[half:]))
    elif fmt == "parquet":
        path = dest.with_name(dest.name + ".parquet")
        pq.write_table(_table(docs, column), path, row_group_size=rows_per_group)
    elif fmt == "arrow":
        path = dest.with_name(dest.name + ".arrow")
        _write_stream(path, _table(docs, column), rows_per_group)
    elif fmt == "arrow-file":
        path = dest.with_name(dest.name + ".arrow")
        table = _table(docs, column)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=rows_per_group):
                w.write_batch(batch)
    elif fmt == "hf":
        path = dest
        write_hf_dataset(path, docs, shards=2, column=column, batch_rows=rows_per_group)
    else:
        raise ValueError(fmt)
    return path


def write_hf_dataset(folder: Path, docs: list[str | None], *, shards: int = 2, column: str = "text",
                     batch_rows: int = 1000) -> None:  # fmt: skip
    """A `Dataset.save_to_disk` folder: data-0000k-of-0000n.arrow (IPC streams), dataset_info.json,
    state.json naming the files in order."""
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(docs), shards + 1).astype(int)
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    for k, name in enumerate(names):
        _write_stream(folder / name, _table(docs[bounds[k] : bounds[k + 1]], column), batch_rows)
    info = {"features": {column: {"dtype": "string", "_type": "Value"}}, "splits": {}, "description": ""}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2))


def token_lengths(tok, docs: dict[int, str]) -> dict[int, int]:
    """record id -> tokens the trainer must see for it (its ids plus the end-of-text token)."""
    rids = sorted(docs)
    encs = tok.tokenizer.encode_batch([docs[r] for r in rids], add_special_tokens=False)
    return {r: len(e.ids) + 1 for r, e in zip(rids, encs)}


def write_finetune_corpus(path: Path, n: int = 240, seed: int = 0, plain_head: int = 0) -> None:
    """A fine-tuning JSONL file: prompt/completion records, with ids + loss_mask (ids < 1000) and plain text
    records among them, and two bad ones (lines 18 and 102 when n > 101); `plain_head` plain text records
    first."""
    rng = random.Random(seed)
    words = [f"word{i}" for i in range(12)] + ["the", "cat", "sat", "on", "a", "mat"]
    lines: list[dict] = [
        {"text": f"plain document {i} " + " ".join(rng.sample(words, 5))} for i in range(plain_head)
    ]
    for i in range(n):
        say = " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
        if i % 5 == 3:
            ids = [rng.randint(1, 1000) for _ in range(rng.randint(1, 80))]
            lines.append({"ids": ids, "loss_mask": [int(rng.random() < 0.5) for _ in ids]})
        elif i % 7 == 6:
            lines.append({"text": say})
        else:
            lines.append({"prompt": f"Q{i}: {say}\nA:", "completion": " " + " ".join(rng.sample(words, 4))})
    if n > 101:
        lines[plain_head + 17] = {"ids": [1, 2], "loss_mask": [1]}
        lines[plain_head + 101] = {"prompt": "no completion"}
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
