"""`lmpipe prepare`'s output directory: it never deletes what it did not write (the corpus, a user's folder,
a file), and a failed prepare leaves neither the old shards changed nor a temporary directory behind."""

from __future__ import annotations

from lmpipe.producer import builtin_corpus


def test_a_prepare_stopped_by_sigterm_leaves_no_temporary_directory(tmp_path):
    """SIGTERM's default action (a scheduler's kill, `timeout`) left the half-written `.shards.tmp-*` beside
    --out; it now ends prepare as Ctrl-C does, through its cleanup."""
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import REPO, lmpipe_env

    big = tmp_path / "big.txt"
    block = ("\n\n".join(builtin_corpus.document(5, i) for i in range(200)) + "\n\n").encode()
    with open(big, "wb") as f:
        for _ in range(max(1, (40 << 20) // len(block))):  # about 40 MB: tokenizing takes seconds
            f.write(block)
    out = tmp_path / "shards"
    p = subprocess.Popen([sys.executable, "-m", "lmpipe", "prepare", "--data", str(big), "--out", str(out)],
                         cwd=REPO, env=lmpipe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".shards.tmp-*")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)  # tokenizing, well past the folder's creation
    assert p.poll() is None, "prepare ended before it could be stopped"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM, p.stderr.read() if p.stderr else ""
    assert sorted(x.name for x in tmp_path.iterdir()) == ["big.txt"]
