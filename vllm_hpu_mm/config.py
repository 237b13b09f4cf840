"""The plugin's own settings: one typed, frozen tree, checked once.

Users set them through vLLM's ``--additional-config`` under the key ``hpu_mm``::

    vllm serve MODEL --additional-config \\
        '{"hpu_mm": {"graph_mode": "eager", "warmup": {"skip": true}}}'

and optionally from a YAML file named by ``hpu_mm.config_file``; keys given
inline override the file's. ``docs/configuration.md`` lists every key.

The classes check themselves in ``__post_init__`` (types, ranges, cross-field
rules), so any instance that exists is valid, whoever built it. The parser is
written once and walks ``dataclasses.fields`` and the type hints; adding a key
means adding a field (with ``doc`` and, where it applies, ``min`` metadata).

This module imports nothing from vLLM or torch: it is plain Python and PyYAML.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import logging
import math
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

__all__ = [
    "CONFIGS_DIR",
    "ROOT_KEY",
    "BucketingConfig",
    "ConfigError",
    "ExplicitBuckets",
    "HpuMMConfig",
    "KeyInfo",
    "MemoryConfig",
    "WarmupConfig",
    "describe_keys",
    "load_explicit_buckets",
    "load_plugin_config",
]

logger = logging.getLogger("vllm_hpu_mm.config")

ROOT_KEY = "hpu_mm"
"""The key of ``--additional-config`` that holds this plugin's settings."""

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The repository's ``configs/`` folder: the last place relative paths are tried."""


class ConfigError(ValueError):
    """A bad plugin setting; the message names the key, the value and its source."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# --------------------------------------------------------------------------
# Where each key's value came from (for error messages and relative paths)
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Origin:
    label: str  # "from --additional-config", "from /abs/x.yaml", ...
    base_dir: Path | None = None  # the YAML file's folder, for relative paths


@dataclass(frozen=True, slots=True)
class _Origins:
    """Dotted key -> origin, for one parse; keys nobody set are defaults."""

    by_key: Mapping[str, _Origin]
    fallback: _Origin

    def of(self, key: str) -> _Origin:
        return self.by_key.get(key, self.fallback)


_PYTHON = _Origins({}, _Origin("set in Python code"))
_CURRENT: contextvars.ContextVar[_Origins] = contextvars.ContextVar(
    "vllm_hpu_mm_config_origins", default=_PYTHON
)


def _source(key: str) -> _Origin:
    return _CURRENT.get().of(key)


# --------------------------------------------------------------------------
# Field helpers
# --------------------------------------------------------------------------


def _opt(default: Any, doc: str, *, low: float | None = None) -> Any:
    """A field with its one-line meaning and an optional lower bound."""
    metadata: dict[str, Any] = {"doc": doc}
    if low is not None:
        metadata["min"] = low
    return field(default=default, metadata=metadata)


def _join(prefix: str, name: object) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _error(key: str, value: Any, problem: str, doc: str | None = None) -> ConfigError:
    """``KEY = VALUE (SOURCE) PROBLEM (KEY: DOC)`` as one ConfigError."""
    message = f"{key} = {_show(value)} ({_source(key).label}) {problem}"
    if doc:
        message += f" [{key.rsplit('.', 1)[-1]}: {doc}]"
    return ConfigError(message, key=key)


def _suggest(word: str, choices: list[str]) -> str:
    """'; did you mean X?' for the choice nearest ``word`` (same but for case,
    the only one it begins, else the closest by difflib), or ''."""
    lower = word.lower()
    close = [c for c in choices if c.lower() == lower]
    close = close or [c for c in choices if lower and c.lower().startswith(lower)]
    if len(close) != 1:
        close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------------
# Types: checking and describing, generic over the type hints used here
# --------------------------------------------------------------------------

_NO = object()  # "does not fit the type"


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _coerce(tp: Any, value: Any) -> Any:
    """``value`` as type ``tp`` (ints widen to float, lists to tuples) or _NO."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        ok = any(type(value) is type(a) and value == a for a in typing.get_args(tp))
        return value if ok else _NO
    if _is_union(tp):
        for arm in typing.get_args(tp):
            out = _coerce(arm, value)
            if out is not _NO:
                return out
        return _NO
    if tp is type(None):
        return value if value is None else _NO
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return value if ok else _NO
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return _NO
        try:
            return float(value)
        except OverflowError:
            return _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    if origin is tuple:
        item_tp = typing.get_args(tp)[0]
        if not isinstance(value, list | tuple):
            return _NO
        items = [_coerce(item_tp, v) for v in value]
        return _NO if any(i is _NO for i in items) else tuple(items)
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else _NO  # type: ignore[arg-type]
    raise TypeError(f"unsupported config type {tp!r}")


_PLAIN = {
    bool: ("true or false", "booleans", "bool"),
    int: ("an integer", "integers", "int"),
    float: ("a number", "numbers", "float"),
    str: ("a string", "strings", "str"),
    type(None): ("null", "nulls", "null"),
}


def _describe(tp: Any, *, plural: bool = False) -> str:
    """``tp`` in words, for messages: 'an integer', "one of 'a', 'b'"."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join(_describe(a, plural=plural) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return "a list of " + _describe(typing.get_args(tp)[0], plural=True)
    if dataclasses.is_dataclass(tp):
        return "mappings" if plural else "a mapping"
    return _PLAIN[tp][1 if plural else 0]


def _type_name(tp: Any) -> str:
    """``tp`` in short, for tables: 'int', 'str | null', '"a" | "b"'."""
    if typing.get_origin(tp) is Literal:
        return " | ".join(f'"{a}"' for a in typing.get_args(tp))
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return _PLAIN[tp][2]


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    # Memoises type hints of our own classes (code, not configuration).
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


# --------------------------------------------------------------------------
# Validation, run by every class's __post_init__
# --------------------------------------------------------------------------


def _validate_fields(obj: Any) -> None:
    """Check (and normalise: int -> float, list -> tuple) every field of obj."""
    cls = type(obj)
    hints = _hints(cls)
    for f in _init_fields(cls):
        key = _join(cls._KEY, f.name)
        doc = f.metadata.get("doc")
        value = getattr(obj, f.name)
        tp = hints[f.name]
        out = _coerce(tp, value)
        if out is _NO:
            literal = typing.get_origin(tp) is Literal
            if literal and isinstance(value, str):
                choices = [str(a) for a in typing.get_args(tp)]
                problem = f"is not {_describe(tp)}" + _suggest(value, choices)
            elif literal:
                problem = f"is not {_describe(tp)}"
            else:
                problem = f"must be {_describe(tp)}"
                if isinstance(value, bool) and tp in (int, float):
                    problem += " (true/false is not a number)"
            raise _error(key, value, problem, doc)
        if isinstance(out, float) and not math.isfinite(out):
            raise _error(key, value, "must be a finite number", doc)
        low = f.metadata.get("min")
        if low is not None:
            items = out if isinstance(out, tuple) else (out,)
            if any(v is not None and v < low for v in items):
                what = "every item must be" if isinstance(out, tuple) else "must be"
                raise _error(key, value, f"is out of range: {what} >= {low}", doc)
        if out is not value:
            object.__setattr__(obj, f.name, out)


# --------------------------------------------------------------------------
# YAML: YAML 1.2 booleans (so `strategy: off` is the string "off") and no
# duplicate keys
# --------------------------------------------------------------------------


class _YamlLoader(yaml.SafeLoader):
    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable key: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


_BOOL_TAG = "tag:yaml.org,2002:bool"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _resolve_path(key: str, value: str) -> Path:
    """The file ``value`` names: absolute, or tried against cwd, the folder of
    the YAML file that set it, then the repository's configs/ folder."""
    path = Path(value).expanduser()
    if path.is_absolute():
        tried = [path]
    else:
        base = _source(key).base_dir
        dirs = [Path.cwd(), *([base] if base else []), CONFIGS_DIR]
        tried = list(dict.fromkeys(d / path for d in dirs))
    for candidate in tried:
        if candidate.is_file():
            return candidate.resolve()
    raise _error(key, value, "names no file; tried " + ", ".join(str(p) for p in tried))


def _read_yaml(key: str, value: str, path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as fh:
            return yaml.load(fh, Loader=_YamlLoader)  # a SafeLoader
    except OSError as exc:
        raise _error(key, value, f"cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise _error(key, value, f"is not valid YAML ({path}): {exc}") from exc


# --------------------------------------------------------------------------
# The configuration tree
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExplicitBuckets:
    """The bucket lists of a ``bucketing.file`` (strategy ``explicit``).

    Each list is sorted and de-duplicated on load. A prefill bucket is a token
    count, a decode bucket a batch size; ``blocks`` are KV-block counts, used
    by both.
    """

    _KEY: ClassVar[str] = ""

    prefill_tokens: tuple[int, ...] = field(
        metadata={"doc": "prefill token counts to compile and warm up", "min": 1}
    )
    decode_batch: tuple[int, ...] = field(
        metadata={"doc": "decode batch sizes to compile and warm up", "min": 1}
    )
    blocks: tuple[int, ...] = field(
        metadata={"doc": "KV-cache block counts to compile and warm up", "min": 1}
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        for f in dataclasses.fields(self):
            items = getattr(self, f.name)
            if not items:
                doc = f.metadata["doc"]
                raise _error(f.name, list(items), "must not be empty", doc)
            object.__setattr__(self, f.name, tuple(sorted(set(items))))


@dataclass(frozen=True, slots=True)
class BucketingConfig:
    """Which padded shapes are compiled and warmed up."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.bucketing"

    strategy: Literal["exponential", "linear", "explicit", "off"] = _opt(
        "exponential", "how bucket sizes are generated"
    )
    file: str | None = _opt(
        None, "YAML file with explicit bucket lists (strategy 'explicit')"
    )
    prefill_min_tokens: int = _opt(32, "smallest prefill bucket, in tokens", low=1)
    prefill_step_tokens: int = _opt(
        128, "step between prefill buckets for strategy 'linear', in tokens", low=1
    )
    decode_min_batch: int = _opt(1, "smallest decode batch bucket", low=1)
    decode_step_batch: int = _opt(
        8, "step between decode batch buckets for strategy 'linear'", low=1
    )
    block_step: int = _opt(16, "step between KV-block-count buckets", low=1)
    fallback_max_pad_ratio: float = _opt(
        2.0,
        "a shape with no warmed-up bucket is padded to at most this times its size",
        low=1.0,
    )
    buckets: ExplicitBuckets | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """The lists read from ``file`` when the strategy is 'explicit', else None."""

    def __post_init__(self) -> None:
        _validate_fields(self)
        file_key = f"{self._KEY}.file"
        if self.strategy != "explicit":
            if self.file is not None:
                logger.warning(
                    "%s = %r is ignored: %s.strategy is %r, not 'explicit'",
                    file_key,
                    self.file,
                    self._KEY,
                    self.strategy,
                )
            return
        if self.file is None:
            key = f"{self._KEY}.strategy"
            raise _error(
                key,
                self.strategy,
                f"needs {file_key}, a YAML file with the bucket lists "
                "(see configs/buckets-example.yaml)",
            )
        path = _resolve_path(file_key, self.file)
        object.__setattr__(self, "file", str(path))
        object.__setattr__(self, "buckets", _load_buckets(file_key, self.file, path))


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    """Compiling and running every bucket before serving."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.warmup"

    skip: bool = _opt(False, "skip warm-up (shapes then compile on first use)")
    progress_bar: bool = _opt(True, "show a progress bar during warm-up")

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """How device memory is shared between the KV cache and the rest."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.memory"

    graph_reserve_fraction: float = _opt(
        0.10,
        "share of the memory left after the profiled peak kept free for graphs "
        "(not given to the KV cache)",
        low=0.0,
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if self.graph_reserve_fraction >= 1.0:
            raise _error(
                f"{self._KEY}.graph_reserve_fraction",
                self.graph_reserve_fraction,
                "is out of range: must be < 1 (1 would leave no KV cache)",
            )


@dataclass(frozen=True, slots=True)
class HpuMMConfig:
    """All of the plugin's settings (``--additional-config`` key ``hpu_mm``)."""

    _KEY: ClassVar[str] = ROOT_KEY

    graph_mode: Literal["auto", "eager", "compile", "graphs"] = _opt(
        "auto", "how the model runs: eager, torch.compile, or captured graphs"
    )
    bucketing: BucketingConfig = field(
        default_factory=BucketingConfig, metadata={"doc": "shape bucketing"}
    )
    warmup: WarmupConfig = field(
        default_factory=WarmupConfig, metadata={"doc": "warm-up before serving"}
    )
    memory: MemoryConfig = field(
        default_factory=MemoryConfig, metadata={"doc": "memory sizing"}
    )
    mm_encoder_cache_items: int = _opt(
        64, "multimodal encoder outputs kept cached per worker", low=1
    )
    mm_max_image_pixels: int = _opt(
        4096 * 4096,
        "largest image (width x height, read from its header) a request may send",
        low=1,
    )
    config_file: str | None = _opt(
        None, "YAML file read first; keys given inline override it"
    )

    def __post_init__(self) -> None:
        _validate_fields(self)

    # -- building -------------------------------------------------------

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | Any | None
    ) -> HpuMMConfig:
        """The settings under ``hpu_mm`` of vLLM's ``additional_config``.

        None, an empty dict, a missing or null ``hpu_mm`` key, or a
        non-mapping ``additional_config`` (another plugin's object) give the
        defaults. Other top-level keys belong to others and are left alone.
        """
        if not isinstance(additional_config, Mapping):
            return cls()
        for other in additional_config:
            if other != ROOT_KEY and str(other).lower().replace("-", "_") == ROOT_KEY:
                raise ConfigError(
                    f"--additional-config key {other!r} is not read by vllm-hpu-mm; "
                    f"did you mean {ROOT_KEY!r}?",
                    key=str(other),
                )
        data = additional_config.get(ROOT_KEY)
        if data is None:
            return cls()
        return cls.from_mapping(data, source="--additional-config")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str) -> HpuMMConfig:
        """Build from the contents of ``hpu_mm``; ``source`` names where they
        came from in error messages (e.g. ``"--additional-config"``).

        If ``config_file`` is set, that YAML file is read first and the keys
        of ``data`` override its keys (nested sections merge key by key).
        """
        inline = _Origin(f"from {source}")
        origins: dict[str, _Origin] = {}
        if not isinstance(data, Mapping):
            with _origins({ROOT_KEY: inline}):
                raise _error(ROOT_KEY, data, "must be a mapping of settings")
        _record(origins, ROOT_KEY, data, inline)
        file_key = f"{ROOT_KEY}.config_file"
        merged: Mapping[str, Any] = data
        file_value = data.get("config_file")
        if file_value is not None:
            with _origins(origins):
                if not isinstance(file_value, str):
                    raise _error(file_key, file_value, "must be a string (a path)")
                path = _resolve_path(file_key, file_value)
                file_data = _read_file_section(file_key, file_value, path)
            from_file = _Origin(f"from {path}", base_dir=path.parent)
            file_origins: dict[str, _Origin] = {}
            _record(file_origins, ROOT_KEY, file_data, from_file)
            origins = {**file_origins, **origins}
            merged = {**_deep_merge(file_data, data), "config_file": str(path)}
        with _origins(origins):
            return _build(cls, merged)

    # -- reading --------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars; ``from_mapping`` of it is equal."""
        return _to_dict(self)


# --------------------------------------------------------------------------
# The parser, written once for every class above
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _origins(by_key: Mapping[str, _Origin]) -> Iterator[None]:
    """Within: error messages and relative paths use these origins."""
    token = _CURRENT.set(_Origins(dict(by_key), _Origin("default")))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _record(out: dict[str, _Origin], key: str, data: Any, origin: _Origin) -> None:
    out[key] = origin
    if isinstance(data, Mapping):
        for name, value in data.items():
            _record(out, _join(key, name), value, origin)


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for name, value in over.items():
        old = merged.get(name)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[name] = _deep_merge(old, value)
        else:
            merged[name] = value
    return merged


def _read_file_section(key: str, value: str, path: Path) -> Mapping[str, Any]:
    """The ``hpu_mm`` settings in a config file (a top-level ``hpu_mm:`` is
    unwrapped); an empty file is an empty mapping."""
    data = _read_yaml(key, value, path)
    if data is None:
        return {}
    if isinstance(data, Mapping) and set(data) == {ROOT_KEY}:
        data = data[ROOT_KEY] or {}
    if not isinstance(data, Mapping):
        raise _error(
            key, value, f"must hold a mapping of settings; {path} holds {_show(data)}"
        )
    if "config_file" in data:
        raise _error(
            key, value, f"{path} sets config_file itself; config files do not nest"
        )
    return data


def _build(cls: Any, data: Any) -> Any:
    """An instance of dataclass ``cls`` from a mapping, recursing into
    sections; unknown and missing keys are errors, the rest ``cls`` checks."""
    prefix: str = cls._KEY
    if not isinstance(data, Mapping):
        raise _error(prefix, data, "must be a mapping of settings")
    hints = _hints(cls)
    names = [f.name for f in _init_fields(cls)]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name not in names:
            key = _join(prefix, name)
            raise ConfigError(
                f"{key} ({_source(key).label}) is not a known key"
                + (_suggest(str(name), names) or ".")
                + f" Known keys of {prefix or 'the bucket file'}: {', '.join(names)}.",
                key=key,
            )
        tp = hints[name]
        kwargs[name] = _build(tp, value) if dataclasses.is_dataclass(tp) else value
    missing = [
        f.name
        for f in _init_fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = _source(prefix).label
        raise ConfigError(
            f"{prefix or 'the bucket file'} ({where}) is missing required key(s): "
            + ", ".join(missing),
            key=_join(prefix, missing[0]),
        )
    return cls(**kwargs)


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in _init_fields(type(obj)):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _load_buckets(key: str, value: str, path: Path) -> ExplicitBuckets:
    data = _read_yaml(key, value, path)
    where = _Origin(f"from {path}, the {key}", base_dir=path.parent)
    by_key: dict[str, _Origin] = {}
    _record(by_key, "", data, where)
    if not isinstance(data, Mapping):
        raise _error(
            key, value, f"must hold a mapping of bucket lists; got {_show(data)}"
        )
    with _origins(by_key):
        result: ExplicitBuckets = _build(ExplicitBuckets, data)
        return result


def load_explicit_buckets(path: str | Path) -> ExplicitBuckets:
    """Read and check a bucket-list file (the format of ``bucketing.file``)."""
    key = f"{BucketingConfig._KEY}.file"
    with _origins({key: _Origin("passed to load_explicit_buckets")}):
        resolved = _resolve_path(key, str(path))
        return _load_buckets(key, str(path), resolved)


def load_plugin_config(vllm_config: Any) -> HpuMMConfig:
    """The plugin settings of a ``VllmConfig`` (read afresh on every call)."""
    return HpuMMConfig.from_additional_config(
        getattr(vllm_config, "additional_config", None)
    )


# --------------------------------------------------------------------------
# Introspection, for docs and tools
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One settable key: dotted name, type, default and meaning."""

    key: str
    type: str
    default: Any
    doc: str


def describe_keys(cls: Any = HpuMMConfig) -> Iterator[KeyInfo]:
    """Every leaf key of ``cls`` (default: the whole ``hpu_mm`` tree)."""
    hints = _hints(cls)
    defaults = cls() if cls is not ExplicitBuckets else None
    for f in _init_fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from describe_keys(tp)
            continue
        default = getattr(defaults, f.name) if defaults is not None else None
        yield KeyInfo(
            _join(cls._KEY, f.name), _type_name(tp), default, f.metadata["doc"]
        )
