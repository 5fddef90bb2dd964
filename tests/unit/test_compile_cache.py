"""--compile's cache for restarts (consumer/compile_cache.py): a second start loads what the first compiled, and a
cache made for another key or with a damaged file is refused or rebuilt in one line, never trusted."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from lmpipe.consumer import compile_cache as cc
from lmpipe.consumer.compile_cache import ARTIFACTS, MANIFEST, PLANS, REBUILT, WARM, CompileCache
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.fast import cublaslt
from lmpipe.consumer.startup import cache_key
from lmpipe.shared.config import PipelineConfig

KEY = cache_key(PipelineConfig(seq_len=64), TrainConfig(compile=True), {"n_layer": 2}, torch.device("cpu"), "fp32",
                [], 1)  # fmt: skip


def new_process(inductor_dir: Path, monkeypatch) -> None:
    """A fresh process, as far as one process can be made one: dynamo's caches emptied, and torch's on-disk
    cache an empty folder (another host's)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir))
    torch._dynamo.reset()
    counters.clear()


def compile_once() -> dict[str, int]:
    """A compile, forward only; inductor's cache counters."""
    w = torch.randn(16, 16)
    f = torch.compile(lambda x: torch.mm(x, w), dynamic=False)  # an extern matmul only: no C++ to build
    f(torch.randn(4, 16))
    return dict(counters["inductor"])


def said_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lmpipe.trainer"]


def made(folder: Path, monkeypatch, tmp_path: Path) -> CompileCache:
    new_process(tmp_path / "inductor-first", monkeypatch)
    cache = CompileCache(folder, KEY)
    cache.open()
    compile_once()
    assert cache.save(graphs=1, step=1)
    return cache


def test_a_second_start_loads_what_the_first_compiled(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "lmpipe.trainer")
    folder = tmp_path / "compile-cache"
    first = made(folder, monkeypatch, tmp_path)
    assert first.state == "cold" and "compile cache: cold" in caplog.text
    assert json.loads((folder / MANIFEST).read_text())["key"]["torch"] == torch.__version__
    caplog.clear()
    new_process(tmp_path / "inductor-second", monkeypatch)  # empty: only the cache can serve it
    second = CompileCache(folder, KEY)
    assert "compile cache: warm" in second.open() and second.state == WARM
    assert caplog.text.count("compile cache: warm") == 1
    hits = compile_once()
    assert hits.get("fxgraph_cache_hit", 0) >= 1 and hits.get("fxgraph_cache_miss", 0) == 0, hits
    assert not second.save(graphs=1, step=5)  # nothing new: the file stays as it was
    assert second.save(graphs=2, step=9)  # another graph since: written again


@pytest.mark.parametrize(
    "field, other, said",
    [
        ("torch", "2.12.0+cpu", "made for torch 2.12.0+cpu (this run: " + torch.__version__ + ")"),
        ("seq_len", 128, "made for seq_len 128 (this run: 64)"),
    ],
)
def test_a_cache_made_for_another_key_is_refused_in_one_line(
    tmp_path, monkeypatch, caplog, field, other, said
):
    folder = tmp_path / "compile-cache"
    made(folder, monkeypatch, tmp_path)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["key"][field] = other  # made by another torch, or for another --seq-len
    (folder / MANIFEST).write_text(json.dumps(manifest))
    loads = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loads.append(data))
    caplog.set_level(logging.INFO, "lmpipe.trainer")
    caplog.clear()
    cache = CompileCache(folder, KEY)
    line = cache.open()
    assert cache.state == REBUILT and said in line and "not trusted, rebuilt" in line
    assert said_lines(caplog) == [line]  # one line, and it names what differs
    assert loads == []  # never loaded
    assert not (folder / MANIFEST).exists() and not (folder / ARTIFACTS).exists()


WANT = {
    "artifacts": "torch-compile.bin does not match its checksum",
    "manifest": f"its {MANIFEST} is unreadable",
    "content": "torch found nothing it could load in torch-compile.bin",
}


@pytest.mark.parametrize("damage", list(WANT))
def test_a_corrupt_cache_file_is_rebuilt_not_trusted(tmp_path, monkeypatch, caplog, damage):
    folder = tmp_path / "compile-cache"
    made(folder, monkeypatch, tmp_path)
    if damage == "artifacts":  # a torn write: the file shorter than its manifest says
        data = (folder / ARTIFACTS).read_bytes()
        (folder / ARTIFACTS).write_bytes(data[: len(data) // 2])
    elif damage == "manifest":
        (folder / MANIFEST).write_text('{"format": 1, "key": ')
    else:  # bytes that match their checksum but are no torch artifacts (written so by something else)
        (folder / ARTIFACTS).write_bytes(b"not torch's")
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["files"][ARTIFACTS] = cc.file_digest(folder / ARTIFACTS)
        (folder / MANIFEST).write_text(json.dumps(manifest))
    loads = []
    real_load = torch.compiler.load_cache_artifacts
    monkeypatch.setattr(
        torch.compiler, "load_cache_artifacts", lambda data: loads.append(data) or real_load(data)
    )
    caplog.set_level(logging.WARNING, "lmpipe.trainer")
    cache = CompileCache(folder, KEY)
    line = cache.open()
    assert cache.state == REBUILT and len(loads) == (damage == "content"), line  # checksums first
    assert WANT[damage] in line and "not trusted, rebuilt" in line and said_lines(caplog) == [line]
    assert not (folder / ARTIFACTS).exists()
    new_process(tmp_path / "inductor-rebuilt", monkeypatch)
    compile_once()
    assert cache.save(graphs=1, step=3)  # rebuilt after the first step
    again = CompileCache(folder, KEY)
    assert again.open().startswith("compile cache: warm") and again.state == WARM


def test_no_checkpoint_dir_and_off_keep_no_cache(tmp_path):
    assert cc.place("auto", str(tmp_path)) == tmp_path / "compile-cache"
    assert cc.place("auto", None) is None and cc.place("off", str(tmp_path)) is None
    assert cc.place(str(tmp_path / "x"), None) == tmp_path / "x"
    off = CompileCache(None, KEY)
    assert off.open().startswith("compile cache: off") and not off.save(graphs=3)


def test_the_key_holds_what_changes_a_compiled_graph():
    other = cache_key(PipelineConfig(seq_len=64, batch_size=8), TrainConfig(compile=True, compile_mode="max-autotune"),
                      {"n_layer": 2}, torch.device("cpu"), "fp32", ["clip-in-step"], 1)  # fmt: skip
    diff = cc.differences(KEY, other)
    assert [d.split()[0] for d in diff] == ["compile_mode", "fast", "batch_size"], diff
    # what changes no graph leaves the key alone
    same = cache_key(PipelineConfig(seq_len=64), TrainConfig(compile=True, lr=1.0, steps=9), {"n_layer": 2},
                     torch.device("cpu"), "fp32", [], 1)  # fmt: skip
    assert same == KEY


class FakeAlgorithm:
    """What cublaslt.identity reads of nvmath's Algorithm (CUDA-only): its id and configuration."""

    def __init__(self, algorithm_id: int, tile: int, split_k: int = 1):
        self.algorithm_id, self.tile, self.split_k, self.stages = algorithm_id, tile, split_k, (2, 4)


def test_cublaslt_picks_are_kept_by_rank_and_identity(tmp_path, monkeypatch):
    candidates = [FakeAlgorithm(6, 20), FakeAlgorithm(21, 18), FakeAlgorithm(6, 24, split_k=2)]
    pick = {"rank": 2, "algorithm": cublaslt.identity(candidates[2])}
    assert pick["algorithm"] == {"algorithm_id": 6, "tile": 24, "stages": [2, 4], "split_k": 2}
    assert cublaslt.pick_rank(candidates, pick) == 2
    assert cublaslt.pick_rank(candidates[:2], pick) is None  # fewer candidates: timed again
    moved = [candidates[0], candidates[2], candidates[1]]
    assert cublaslt.pick_rank(moved, pick) is None  # another algorithm at that rank: timed again
    assert (
        cublaslt.pick_rank(candidates, {"rank": "2"}) is None and cublaslt.pick_rank(candidates, None) is None
    )
    a, b = torch.empty(64, 32), torch.empty(32, 16).t()
    key = cublaslt.pick_key(None, a, b)
    assert key == "None|[64, 32]:[32, 1]|[16, 32]:[1, 16]|torch.float32|torch.float32"
    # through the compile cache's file and back, with the cache's own checks
    folder = tmp_path / "compile-cache"
    new_process(tmp_path / "inductor", monkeypatch)
    cache = CompileCache(folder, KEY)
    cache.open()
    compile_once()
    assert cache.save(graphs=1, plans={key: pick})
    again = CompileCache(folder, KEY)
    again.open()
    assert again.state == WARM and again.plans == {key: pick}
    (folder / PLANS).write_text(json.dumps({key: {**pick, "rank": 1}}))  # changed: its checksum refuses it
    third = CompileCache(folder, KEY)
    assert "cublaslt-plans.json does not match its checksum" in third.open() and third.plans == {}
