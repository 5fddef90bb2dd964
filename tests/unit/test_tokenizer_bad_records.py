"""`lmpipe tokenizer train` says the bad records it skipped, as `lmpipe prepare` does: each of the first few
by line, all of them counted by reason in its last line. Before, they were skipped without a word."""

from __future__ import annotations

import json

from lmpipe.cli import main


def test_tokenizer_train_counts_and_says_its_bad_records(tmp_path, capsys):
    data = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"document {i} about tokenizers and merges"}) for i in range(200)]
    lines[10], lines[50], lines[120] = '{"text": "cut off', "[1, 2]", json.dumps({"text": ""})
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--out", str(out)]) == 0
    got = capsys.readouterr()
    last = got.out.strip().splitlines()[-1]
    assert last.startswith(f"wrote {out}: vocab size "), last
    assert last.endswith("; 3 bad records skipped (2 bad_json, 1 empty)"), last
    said = [line for line in got.err.splitlines() if line.endswith(", skipped")]  # the log, on stderr
    assert [next(n for n in (11, 51, 121) if f"{data}:{n}:" in line) for line in said] == [11, 51, 121], said
