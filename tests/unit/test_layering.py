"""The layering of DESIGN.md, read from the source: what each part imports, and how large its pieces are.

shared/ imports nothing of ours; producer/ and consumer/ import shared/, never each other; lmpipe/ (CLI,
launcher) is on top and nothing imports it. Inside consumer/, the fast paths (consumer/fast/) stay behind
their boundary: the data path imports no kernel, and no kernel imports the trainer. Every import counts,
those inside functions too, and relative ones are resolved.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO

PARTS = ("shared", "producer", "consumer")
# The fast paths: consumer/fast/ and what they are built on. The flat names are where the kernels lived
# before consumer/fast/ (a module of that name back in consumer/ is a kernel outside its boundary).
KERNEL_MODULES = (
    "loss",
    "mlp_kernel",
    "qkv_kernel",
    "adamw",
    "cublaslt",
    "step_graph",
    "memset_nodes",
    "flash",
)
KERNEL_LIBRARIES = ("triton", "nvmath", "liger_kernel", "flash_attn", "cutlass")


def sources() -> dict[str, Path]:
    """Module name -> file, for every module of lmpipe (producer/, consumer/, shared/ under their lmpipe
    names, and lmpipe/'s own files; lmpipe/'s links to the three folders are not read twice)."""
    out: dict[str, Path] = {}
    for part in PARTS:
        for path in sorted((REPO / part).rglob("*.py")):
            rel = path.relative_to(REPO / part).with_suffix("").parts
            rel = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join(("lmpipe", part, *rel))] = path
    for path in sorted((REPO / "lmpipe").glob("*.py")):
        out["lmpipe" if path.stem == "__init__" else f"lmpipe.{path.stem}"] = path
    return out


SOURCES = sources()


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports(module: str) -> Iterator[str]:
    """Every module `module` imports: absolute names, `from X import submodule` as X.submodule."""
    path = SOURCES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            yield base
            for a in node.names:
                if f"{base}.{a.name}" in SOURCES:
                    yield f"{base}.{a.name}"


def ours(name: str) -> bool:
    return name == "lmpipe" or name.startswith("lmpipe.")


def closure(roots: list[str]) -> dict[str, str]:
    """Every module of ours reachable from `roots` by imports, with the one that imported it first."""
    seen = {r: r for r in roots}
    todo = list(roots)
    while todo:
        m = todo.pop()
        for name in imports(m):
            if ours(name) and name in SOURCES and name not in seen:
                seen[name] = m
                todo.append(name)
    return seen


def is_kernel(name: str) -> bool:
    return (
        name.startswith("lmpipe.consumer.fast")
        or name in {f"lmpipe.consumer.{k}" for k in KERNEL_MODULES}
        or name.split(".")[0] in KERNEL_LIBRARIES
    )


def test_every_part_imports_only_what_it_may():
    """shared imports nothing of ours; producer and consumer import shared, never each other; lmpipe/ is on
    top and nothing imports it (the `python -m` shims aside); in lmpipe/, cli imports launch, not back."""
    assert len(SOURCES) > 50 and "lmpipe.consumer.trainer" in SOURCES, "the source tree was read"
    may = {"shared": ("shared",), "producer": ("shared", "producer"), "consumer": ("shared", "consumer")}
    wrong = []
    for module, path in SOURCES.items():
        part = module.split(".")[1] if module.count(".") else "lmpipe"
        if path.name == "__main__.py" and part != "lmpipe":
            continue  # `python -m lmpipe.producer` starts the CLI on purpose
        for name in filter(ours, imports(module)):
            below = name.split(".")[1] if name.count(".") else ""
            if part in may and below not in may[part]:
                wrong.append(f"{module} imports {name}")
            if part == "lmpipe" and module in ("lmpipe.launch", "lmpipe.options") and name == "lmpipe.cli":
                wrong.append(f"{module} imports {name}")
    assert not wrong, wrong


def test_the_layering_check_sees_a_wrong_import(monkeypatch, tmp_path):
    """The check reads relative and function-level imports (a layering test that reads none passes always)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ..producer import stream\n    from . import feed\n")
    monkeypatch.setitem(SOURCES, "lmpipe.consumer.bad", bad)
    assert {"lmpipe.producer.stream", "lmpipe.consumer.feed"} <= set(imports("lmpipe.consumer.bad"))


def data_path() -> list[str]:
    """consumer/inputs.py and the receive side: every consumer module that talks to the wire (imports zmq
    or shared/wire.py) and the feed that hands batches to the trainer."""
    out = []
    for module in SOURCES:
        if not module.startswith("lmpipe.consumer.") or is_kernel(module):
            continue
        names = set(imports(module))
        if module.rsplit(".", 1)[1] in ("inputs", "feed") or "zmq" in names or "lmpipe.shared.wire" in names:
            out.append(module)
    return out


def test_the_data_path_imports_no_kernel():
    roots = data_path()
    assert "lmpipe.consumer.inputs" in roots and len(roots) >= 3, roots
    reached = closure(roots)
    wrong = [f"{m} (imported by {by})" for m, by in reached.items() if is_kernel(m)]
    wrong += [
        f"{m} imports {name}"
        for m in reached
        for name in imports(m)
        if name.split(".")[0] in KERNEL_LIBRARIES
    ]
    assert not wrong, wrong


def test_no_kernel_imports_the_trainer():
    kernels = [m for m in SOURCES if is_kernel(m)]
    assert kernels, "the fast paths were found"
    reached = closure(kernels)
    assert "lmpipe.consumer.trainer" not in reached, f"imported by {reached.get('lmpipe.consumer.trainer')}"


LONGEST_MODULE, LONGEST_FUNCTION = 500, 80


def test_no_module_over_500_lines():
    long = {m: n for m, p in SOURCES.items() if (n := len(p.read_text().splitlines())) > LONGEST_MODULE}
    assert not long, long


def test_no_function_over_80_lines():
    long = {}
    for module, path in SOURCES.items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > LONGEST_FUNCTION:
                    long[f"{module}.{node.name}"] = n
    assert not long, long


BENCH_IN_CODE = re.compile(r"^\s*(?:import|from)\s+(bench(?:\.\w+)*)(?:\s|$)", re.M)


def test_tests_share_helpers_not_test_modules_or_benchmarks():
    """What several tests need lives in a helpers module (tests/helpers.py, tests/deploy/*.py without the
    test_ prefix): a test module imports no other test module, no conftest (fixtures only) and nothing
    from bench/, not even in code it hands to another Python."""
    wrong = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names += BENCH_IN_CODE.findall(node.value)
            for name in names:
                last = name.split(".")[-1]
                if name.split(".")[0] == "bench" or last.startswith("test_") or last == "conftest":
                    wrong.append(f"{path.relative_to(REPO)} imports {name}")
    assert not wrong, wrong
