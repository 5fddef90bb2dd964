"""deploy/k8s as `kubectl apply -k` would send it, without kustomize: the kustomization there lists plain
manifests as `resources` and nothing else (no generators, patches or transformers), so the build is those
files' documents in order. `manifests()` refuses any other kustomization field, so a change that makes the
composition here differ from kustomize's fails loudly instead of testing something else."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.helpers import REPO

K8S = REPO / "deploy" / "k8s"
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources"}


def manifests(folder: Path = K8S) -> list[dict]:
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    extra = set(kust) - KUSTOMIZATION_FIELDS
    assert not extra, f"kustomization fields the test's composition does not apply: {sorted(extra)}"
    docs = []
    for res in kust["resources"]:
        path = folder / res
        assert path.is_file(), f"{res}: a plain manifest file (a folder would be a kustomization)"
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def by_kind(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"one {kind} {name or ''}: {len(found)}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container_argv(workload: dict, entrypoint: list[str]) -> list[str]:
    """The container's command line: its `command` (else the image's entrypoint) followed by its `args`."""
    c = pod_spec(workload)["containers"][0]
    return [str(a) for a in c.get("command", entrypoint)] + [str(a) for a in c.get("args", [])]


def flag(argv: list[str], name: str) -> str | None:
    """The value of `--name=VALUE` or `--name VALUE` in argv."""
    for i, a in enumerate(argv):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def settings_env(docs: list[dict]) -> dict[str, str]:
    return {k: str(v) for k, v in by_kind(docs, "ConfigMap", "lmpipe-settings")["data"].items()}


def scaler_queries(docs: list[dict]) -> list[str]:
    return [t["metadata"]["query"] for t in by_kind(docs, "ScaledObject")["spec"]["triggers"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\blmpipe_[a-z0-9_]+", expr))
