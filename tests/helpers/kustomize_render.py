"""Renders the kustomizations of deploy/kubernetes without kubectl, so that the manifests are
checked offline on every machine (``python -m tests.helpers.kustomize_render DIR`` prints one).

Why a renderer of our own: no maintained Python package renders a kustomization on this
project's Python (3.11). ``pykustomize`` (kustomize's Go library behind an FFI) requires
Python >= 3.14; the PyPI package ``kustomize`` writes kustomization files from Python code
instead of rendering them; ``pytest-kustomize`` runs the ``kustomize`` binary. kubectl, which
embeds kustomize, is no Python package and is not on every machine; where it is,
tests/deploy/test_kubernetes.py checks that it and this renderer produce the same objects.

It supports what the manifests use, and refuses anything else (:class:`Unsupported`) rather than
render it wrong:

- ``resources``: YAML files (several documents each) and directories holding a kustomization;
- ``components`` (kind ``Component``), applied after the resources, as kustomize does;
- ``patches`` given by ``path``: a strategic merge onto the object of the patch's kind and
  name. Maps merge key by key (a null deletes the key); a list of maps that all carry ``name``
  (containers, env, volumes) merges item by item on ``name``, new items first, as kustomize
  orders them; any other list, and every scalar, is replaced;
- ``replicas`` (``name``, ``count``) on Deployments;
- ``secretGenerator`` with ``files`` and ``envs`` (type Opaque), with ``generatorOptions``
  ``disableNameSuffixHash: true`` and ``labels`` (hashed names, which kustomize then rewrites in
  every reference, are not implemented);
- ``namespace``: set on every object but a Namespace, which is renamed to it (kustomize's rule).
"""

from __future__ import annotations

import base64
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION = "kustomize.config.k8s.io/v1beta1"
COMPONENT = "kustomize.config.k8s.io/v1alpha1"
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "replicas", "secretGenerator",
                    "generatorOptions", "namespace"}
CLUSTER_SCOPED = {"Namespace"}  # of the kinds the manifests use

Obj = dict[str, Any]


class Unsupported(ValueError):
    """A kustomization uses something this renderer does not implement (named in the message)."""


def render(directory: str | Path) -> list[Obj]:
    """The objects the kustomization in ``directory`` builds, as ``kubectl kustomize`` would.

    Raises:
        Unsupported: a field, option or patch form outside the list above.
        ValueError: a patch or ``replicas`` entry names no object, or two objects share a kind,
            namespace and name.
        OSError: a listed file is missing.
    """
    return _build(Path(directory), expect=KUSTOMIZATION)


def _build(directory: Path, expect: str, objects: list[Obj] | None = None) -> list[Obj]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    kind = "Kustomization" if expect == KUSTOMIZATION else "Component"
    if (spec.get("apiVersion"), spec.get("kind", "Kustomization")) != (expect, kind):
        raise Unsupported(f"{directory}: expected apiVersion {expect}, kind {kind}")
    if unknown := set(spec) - SUPPORTED_FIELDS:
        raise Unsupported(f"{directory}: {sorted(unknown)}")
    objects = [] if objects is None else objects  # a component transforms its parent's objects
    for entry in spec.get("resources", []):
        path = directory / entry
        objects += _build(path, KUSTOMIZATION) if path.is_dir() else _load(path)
    for entry in spec.get("components", []):
        objects = _build(directory / entry, COMPONENT, objects)
    objects += _generate_secrets(directory, spec.get("secretGenerator", []), spec.get("generatorOptions", {}))
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise Unsupported(f"{directory}: patches other than {{path: FILE}}: {patch}")
        for document in _load(directory / patch["path"]):
            target = _find(objects, document["kind"], document["metadata"]["name"], directory)
            _merge(target, document)
    for entry in spec.get("replicas", []):
        _find(objects, "Deployment", entry["name"], directory).setdefault("spec", {})["replicas"] = entry["count"]
    if namespace := spec.get("namespace"):
        for obj in objects:
            if obj["kind"] == "Namespace":
                obj["metadata"]["name"] = namespace
            elif obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
    ids = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    if duplicates := {i for i in ids if ids.count(i) > 1}:
        raise ValueError(f"{directory}: more than one object {sorted(duplicates, key=str)}")
    return objects


def _load(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _find(objects: list[Obj], kind: str, name: str, directory: Path) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(found) != 1:
        raise ValueError(f"{directory}: {len(found)} objects {kind}/{name}, expected one")
    return found[0]


def _merge(target: Obj, patch: Obj) -> None:
    """Strategic merge of ``patch`` into ``target`` (in place), as the module docstring says."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        elif isinstance(value, list) and isinstance(target.get(key), list) and _named(value + target[key]):
            by_name = {item["name"]: item for item in target[key]}
            new = []
            for item in value:
                if item["name"] in by_name:
                    _merge(by_name[item["name"]], item)
                else:
                    new.append(copy.deepcopy(item))
            target[key] = new + target[key]
        else:
            target[key] = copy.deepcopy(value)


def _named(items: list[Any]) -> bool:
    return all(isinstance(item, dict) and "name" in item for item in items)


def _generate_secrets(directory: Path, generators: list[Obj], options: Obj) -> list[Obj]:
    if not generators:
        return []
    if set(options) - {"disableNameSuffixHash", "labels"} or options.get("disableNameSuffixHash") is not True:
        raise Unsupported(f"{directory}: generatorOptions other than disableNameSuffixHash: true and labels")
    secrets = []
    for generator in generators:
        if unknown := set(generator) - {"name", "files", "envs"}:
            raise Unsupported(f"{directory}: secretGenerator {generator.get('name')}: {sorted(unknown)}")
        data: dict[str, bytes] = {}
        for entry in generator.get("files", []):
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = (directory / path).read_bytes()
        for entry in generator.get("envs", []):
            for line in (directory / entry).read_text().splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    key, sep, value = line.partition("=")
                    if not sep:
                        raise ValueError(f"{directory / entry}: {line!r} is not KEY=VALUE")
                    data[key.strip()] = value.encode()
        metadata = {"name": generator["name"], **({"labels": dict(options["labels"])} if "labels" in options else {})}
        secrets.append({"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque",
                        "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())}})
    return secrets


if __name__ == "__main__":
    yaml.safe_dump_all(render(sys.argv[1]), sys.stdout, sort_keys=False)
