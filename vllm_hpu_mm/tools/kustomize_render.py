"""Render a kustomization offline: the small subset of kustomize deploy/ uses.

There is no kustomize binary on the CI machine, so the manifests under deploy/
are kept to what this module implements, and it refuses everything else (an
unknown kustomization key, a patch directive, a URL resource) rather than
render something kustomize would render differently:

- ``resources``: YAML files (one or more documents) and directories holding a
  ``kustomization.yaml`` (rendered recursively), in order;
- ``patches``: strategic-merge patches (a resource document: merged into the
  resource with the same kind and name, or into every ``target`` match) and
  JSON 6902 patches (a list of ``add``/``remove``/``replace``/``test``
  operations, which needs a ``target``), from ``path`` or inline ``patch``;
- ``images``: ``name`` -> ``newName`` / ``newTag`` / ``digest`` on every
  ``containers`` and ``initContainers`` entry, custom resources included.

Strategic merge follows Kubernetes' rules for the fields the manifests patch:
maps merge key by key, ``null`` deletes a key, the lists named in
``MERGE_KEYS`` merge item by item on their key, any other list is replaced.
Resources come out in input order (``kustomize build --reorder none``).

    python -m vllm_hpu_mm.tools.kustomize_render deploy/overlays/cpu-dev
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILE = "kustomization.yaml"
KUSTOMIZATION_KEYS = frozenset({"apiVersion", "kind", "resources", "patches", "images"})
PATCH_KEYS = frozenset({"path", "patch", "target"})
TARGET_KEYS = frozenset({"group", "version", "kind", "name"})
IMAGE_KEYS = frozenset({"name", "newName", "newTag", "digest"})

# Lists that strategic merge patches merge item by item, by this key (the
# Kubernetes API's patchMergeKey of each field); every other list is replaced.
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}

Resource = dict[str, Any]


class RenderError(ValueError):
    """A kustomization this renderer does not implement, or a wrong one."""


# ---- loading -------------------------------------------------------------------


def _load_documents(path: Path) -> list[Resource]:
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        raise RenderError(f"{path}: {e}") from e
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise RenderError(f"{path}: a resource needs apiVersion and kind")
    return docs


def _load_kustomization(root: Path) -> dict[str, Any]:
    path = root / KUSTOMIZATION_FILE
    if not path.is_file():
        raise RenderError(f"{root}: no {KUSTOMIZATION_FILE}")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - KUSTOMIZATION_KEYS
    if unknown:
        raise RenderError(
            f"{path}: unsupported kustomization key(s) {sorted(unknown)}; this "
            f"renderer implements {sorted(KUSTOMIZATION_KEYS)}"
        )
    return data


def _inside(root: Path, rel: str) -> Path:
    if "://" in rel or rel.startswith(("github.com/", "git@")):
        raise RenderError(f"{root}: remote resource {rel!r} is not supported")
    return (root / rel).resolve()


def resource_id(r: Resource) -> tuple[str, str, str]:
    """(group, kind, name): what kustomize keys a resource by in one build."""
    group = r["apiVersion"].rpartition("/")[0]
    return group, r["kind"], r.get("metadata", {}).get("name", "")


# ---- strategic merge -------------------------------------------------------------


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into ``base`` (a new object; the inputs are not changed)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(k.startswith("$") for k in patch):
            raise RenderError(f"patch directive in {field or 'patch'} not supported")
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list) and field in MERGE_KEYS:
        return _merge_list(base, patch, MERGE_KEYS[field], field)
    return copy.deepcopy(patch)


def _merge_list(base: list[Any], patch: list[Any], key: str, field: str) -> list[Any]:
    out = copy.deepcopy(base)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise RenderError(f"every patch item of {field!r} needs its {key!r}")
        if any(k.startswith("$") for k in item):
            raise RenderError(f"patch directive in {field!r} not supported")
        for i, existing in enumerate(out):
            if isinstance(existing, dict) and existing.get(key) == item[key]:
                out[i] = strategic_merge(existing, item, field)
                break
        else:
            out.append(copy.deepcopy(item))
    return out


# ---- JSON 6902 -----------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, list):
        try:
            return node[int(token)]
        except (ValueError, IndexError) as e:
            raise RenderError(f"{path}: no list index {token!r}") from e
    if isinstance(node, dict) and token in node:
        return node[token]
    raise RenderError(f"{path}: no key {token!r}")


def json6902(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """``doc`` with the RFC 6902 operations applied (add, remove, replace, test)."""
    out = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        tokens = _pointer(path)
        if not tokens:
            raise RenderError(f"{kind} on the document root is not supported")
        parent = out
        for token in tokens[:-1]:
            parent = _child(parent, token, path)
        last = tokens[-1]
        if kind == "test":
            if _child(parent, last, path) != op.get("value"):
                raise RenderError(f"test failed at {path}")
        elif kind == "remove":
            _child(parent, last, path)
            del parent[int(last) if isinstance(parent, list) else last]
        elif kind == "replace":
            _child(parent, last, path)
            parent[int(last) if isinstance(parent, list) else last] = op["value"]
        elif kind == "add":
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if not 0 <= index <= len(parent):
                    raise RenderError(f"{path}: index {index} out of range")
                parent.insert(index, copy.deepcopy(op["value"]))
            elif isinstance(parent, dict):
                parent[last] = copy.deepcopy(op["value"])
            else:
                raise RenderError(f"{path}: cannot add under a scalar")
        else:
            raise RenderError(f"JSON 6902 op {kind!r} is not supported")
    return out


# ---- patches and images -----------------------------------------------------------


def _matches(r: Resource, target: dict[str, Any]) -> bool:
    group, kind, name = resource_id(r)
    version = r["apiVersion"].rpartition("/")[2]
    wanted = {"group": group, "version": version, "kind": kind, "name": name}
    return all(wanted[k] == v for k, v in target.items())


def _apply_patch(
    resources: list[Resource], entry: dict[str, Any], root: Path
) -> list[Resource]:
    unknown = set(entry) - PATCH_KEYS
    if unknown or ("path" in entry) == ("patch" in entry):
        raise RenderError(
            f"{root}: a patch has exactly one of 'path' or 'patch', and optionally "
            f"'target' (got {sorted(entry)})"
        )
    if "path" in entry:
        body = yaml.safe_load(_inside(root, entry["path"]).read_text())
    else:
        body = yaml.safe_load(entry["patch"])
    target = entry.get("target")
    if target is not None and set(target) - TARGET_KEYS:
        raise RenderError(f"{root}: target keys {sorted(target)} not supported")
    if isinstance(body, list):
        if target is None:
            raise RenderError(f"{root}: a JSON 6902 patch needs a target")
        apply = lambda r: json6902(r, body)  # noqa: E731
    elif isinstance(body, dict):
        if target is None:
            group, kind, name = resource_id(body)
            target = {"kind": kind, "name": name}
            if group:
                target["group"] = group
        apply = lambda r: strategic_merge(r, body)  # noqa: E731
    else:
        raise RenderError(f"{root}: a patch is a resource or a list of operations")
    hits = [i for i, r in enumerate(resources) if _matches(r, target)]
    if not hits:
        raise RenderError(f"{root}: patch target {target} matches no resource")
    out = list(resources)
    for i in hits:
        out[i] = apply(out[i])
    return out


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _image_name(image: str) -> str:
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def set_images(resources: list[Resource], images: list[dict[str, Any]]) -> None:
    """Kustomize's ``images`` transformer, in place."""
    for spec in images:
        if set(spec) - IMAGE_KEYS or "name" not in spec:
            raise RenderError(f"images entry {spec} not supported")
        for r in resources:
            for c in _containers(r):
                if "image" not in c or _image_name(c["image"]) != spec["name"]:
                    continue
                old = c["image"]
                name = spec.get("newName", spec["name"])
                if "digest" in spec:
                    c["image"] = f"{name}@{spec['digest']}"
                elif "newTag" in spec:
                    c["image"] = f"{name}:{spec['newTag']}"
                else:
                    rest = old[len(_image_name(old)) :]
                    c["image"] = name + rest


# ---- build ------------------------------------------------------------------------


def render(root: str | Path, _seen: tuple[Path, ...] = ()) -> list[Resource]:
    """The resources of the kustomization in directory ``root``."""
    root = Path(root).resolve()
    if root in _seen:
        raise RenderError(f"{root}: kustomization cycle")
    k = _load_kustomization(root)
    resources: list[Resource] = []
    for rel in k.get("resources") or []:
        path = _inside(root, rel)
        if path.is_dir():
            resources += render(path, (*_seen, root))
        elif path.is_file():
            resources += _load_documents(path)
        else:
            raise RenderError(f"{root}: resource {rel!r} not found")
    ids = [resource_id(r) for r in resources]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise RenderError(f"{root}: resources defined more than once: {dupes}")
    for entry in k.get("patches") or []:
        resources = _apply_patch(resources, entry, root)
    set_images(resources, k.get("images") or [])
    return resources


def render_yaml(root: str | Path) -> str:
    return yaml.safe_dump_all(render(root), sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_hpu_mm.tools.kustomize_render",
        description=(
            "Print the manifests of a kustomization (the subset of kustomize "
            "that deploy/ uses: resources, patches, images), offline."
        ),
    )
    parser.add_argument("directory", help="a directory holding kustomization.yaml")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render_yaml(args.directory))
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
