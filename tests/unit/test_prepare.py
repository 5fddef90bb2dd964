"""`lmpipe prepare`'s output directory: it never deletes what it did not write (the corpus, a user's folder,
a file), and a failed prepare leaves neither the old shards changed nor a temporary directory behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lmpipe.cli import main
from lmpipe.producer import builtin_corpus
from lmpipe.producer.shards import ShardSet, is_shard_dir


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("\n\n".join(builtin_corpus.document(5, i) for i in range(30)) + "\n")
    return src


def prepare(*args: str) -> int:
    return main(["prepare", *args])


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("out", ["src", "src/a.txt"], ids=["the-corpus-folder", "the-corpus-file"])
def test_force_never_replaces_the_corpus(tmp_path, corpus, capsys, out):
    before = (corpus / "a.txt").read_bytes()
    assert prepare("--data", str(corpus), "--out", str(tmp_path / out), "--force") == 2
    assert "holds the corpus" in one_line(capsys)
    assert (corpus / "a.txt").read_bytes() == before


def test_force_replaces_only_a_shard_directory(tmp_path, corpus, capsys):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "p.jpg").write_bytes(b"\xff\xd8 not yours")
    assert prepare("--data", str(corpus), "--out", str(mine), "--force") == 2
    assert "is not a shard set" in one_line(capsys)
    assert (mine / "p.jpg").read_bytes() == b"\xff\xd8 not yours"
    # a dataset's own meta.json beside its files does not make it a shard set: it was deleted
    (mine / "meta.json").write_text('{"name": "my dataset", "version": 2}')
    assert prepare("--data", str(corpus), "--out", str(mine), "--force") == 2
    assert "is not a shard set (other files than prepare writes" in one_line(capsys)
    assert sorted(p.name for p in mine.iterdir()) == ["meta.json", "p.jpg"]

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert prepare("--data", str(corpus), "--out", str(afile), "--force") == 2
    assert "is not a directory" in one_line(capsys)
    assert afile.read_text() == "x"

    shards = tmp_path / "shards"
    assert prepare("--data", str(corpus), "--out", str(shards)) == 0
    assert prepare("--data", str(corpus), "--out", str(shards)) == 2  # without --force: refused
    assert "already exists" in capsys.readouterr().err
    assert prepare("--data", str(corpus), "--out", str(shards), "--force") == 0
    assert ShardSet(shards).meta["documents"] > 0 and is_shard_dir(shards)
    (shards / "notes.txt").write_text("mine")  # a shard set with a user's file in it is not replaced either
    assert prepare("--data", str(corpus), "--out", str(shards), "--force") == 2
    assert (shards / "notes.txt").read_text() == "mine"


def test_a_folder_named_like_the_temporary_one_is_left_alone(tmp_path, corpus):
    sibling = tmp_path / "shards.tmp"  # prepare once wrote to <out>.tmp and deleted it first
    sibling.mkdir()
    (sibling / "notes.txt").write_text("mine")
    assert prepare("--data", str(corpus), "--out", str(tmp_path / "shards")) == 0
    assert (sibling / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "shards.tmp", "src"]


def test_a_failed_prepare_leaves_the_old_shards_and_no_temporary_directory(tmp_path, corpus, monkeypatch):
    from lmpipe.producer import shards as shards_mod

    out = tmp_path / "shards"
    assert prepare("--data", str(corpus), "--out", str(out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*a, **k):
        raise KeyboardInterrupt  # Ctrl-C halfway through tokenizing

    monkeypatch.setattr(shards_mod, "_write_shards", fail)
    assert prepare("--data", str(corpus), "--out", str(out), "--force") == 130  # interrupted
    assert is_shard_dir(out) and {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards", "src"]


def test_a_corpus_of_bad_lines_is_counted_not_logged_line_by_line(tmp_path, capsys):
    bad = tmp_path / "mixed.txt"
    good = "\n\n".join(builtin_corpus.document(5, i) for i in range(5))
    bad.write_bytes(good.encode() + b"\n\n" + b"caf\xe9 au lait\n\n" * 1500)  # Latin-1 lines: not UTF-8
    assert prepare("--data", str(bad), "--out", str(tmp_path / "shards")) == 0
    out, err = capsys.readouterr()
    skipped = [line for line in err.splitlines() if "invalid UTF-8" in line]
    assert len(skipped) == 10, err[-3000:]  # LOGGED_BAD_RECORDS one by one
    assert "more bad records are counted, not logged one by one" in err
    assert "100 bad records skipped (100 invalid_utf8) so far" in err
    assert "1,000 bad records skipped (1,000 invalid_utf8) so far" in err
    assert len(err.splitlines()) < 20, err[-3000:]
    assert "; 1,500 bad records skipped (1,500 invalid_utf8)" in out


def test_files_a_directory_leaves_out_are_named(tmp_path, corpus, capsys):
    (corpus / "a.bin").write_bytes(b"\x00\x01")
    (corpus / "config.json").write_text("{}")
    (corpus / "._a.txt").write_bytes(b"\x00\x05\x16\x07 a Mac's AppleDouble file")  # stopped the run before
    (corpus / "en").mkdir()  # a subfolder was not said either
    assert prepare("--data", str(corpus), "--out", str(tmp_path / "shards")) == 0
    err = capsys.readouterr().err
    assert (
        "--data: 4 file(s) or folder(s) in its directories not read (not corpus files by name, hidden, "
        "links to nothing, not regular files, or subfolders" in err
    )
    assert f"{corpus / '._a.txt'}, {corpus / 'a.bin'}, {corpus / 'config.json'} and 1 more" in err


def test_a_shard_directory_is_not_said_to_leave_its_files_out(tmp_path, corpus, capsys):
    assert prepare("--data", str(corpus), "--out", str(tmp_path / "shards")) == 0
    capsys.readouterr()
    assert prepare("--data", str(tmp_path / "shards"), "--out", str(tmp_path / "again")) == 2  # not a corpus
    assert "not read" not in capsys.readouterr().err
    from lmpipe.producer.formats import left_out

    assert left_out([str(tmp_path / "shards")]) == []


def test_a_symlinked_out_is_refused_before_the_work_and_shards_are_readable_by_others(
    tmp_path, corpus, capsys
):
    """--out on a symbolic link failed in rmtree after all the tokenizing, leaving the finished copy behind;
    shard folders came out 0700 (mkdtemp's) whatever the umask, so no one else could read a team's set."""
    shards = tmp_path / "shards"
    old = os.umask(0o022)
    try:
        assert prepare("--data", str(corpus), "--out", str(shards)) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(shards.stat().st_mode) == 0o755
    capsys.readouterr()
    link = tmp_path / "link"
    link.symlink_to(shards)
    assert prepare("--data", str(corpus), "--out", str(link), "--force") == 2
    assert "--out " + str(link) + " is a symbolic link; name the folder itself" in one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "shards", "src"], "no copy left behind"


def test_a_shard_set_among_other_data_is_refused_not_left_out(tmp_path, corpus, capsys):
    shards = tmp_path / "shards"
    assert prepare("--data", str(corpus), "--out", str(shards)) == 0
    capsys.readouterr()
    assert prepare("--data", str(shards), str(corpus / "a.txt"), "--out", str(tmp_path / "again")) == 2
    assert f"--data {shards} is a shard set (lmpipe prepare): give it as the only --data" in one_line(capsys)
