"""The plugin's own settings: one typed, frozen tree, checked once.

Users set them through vLLM's ``--additional-config`` under the key ``hpu_mm``::

    vllm serve MODEL --additional-config \\
        '{"hpu_mm": {"graph_mode": "eager", "warmup": {"skip": true}}}'

and optionally from a YAML file named by ``hpu_mm.config_file``; keys given
inline override the file's. ``docs/configuration.md`` lists every key; it is
generated from the models below (``python -m vllm_hpu_mm.tools.gen_config_docs``).

The tree is frozen pydantic models in strict mode: pydantic checks types and
ranges, this module turns its errors into one ``ConfigError`` that names the
dotted key, the value, where the value came from and what is allowed. Adding a
key means adding a field with a ``description``.

This module imports nothing from vLLM or torch: it is plain Python, pydantic
and PyYAML.
"""

from __future__ import annotations

import difflib
import logging
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

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


# -- where each key's value came from (messages, relative paths) ---------------------


@dataclass(frozen=True, slots=True)
class _Origin:
    label: str  # "from --additional-config", "from /abs/x.yaml", ...
    base_dir: Path | None = None  # the YAML file's folder, for relative paths


@dataclass(frozen=True, slots=True)
class _Origins:
    """Dotted key -> origin, for one parse; keys nobody set are defaults."""

    by_key: Mapping[str, _Origin] = field(default_factory=dict)
    fallback: _Origin = _Origin("set in Python code")

    def of(self, key: str) -> _Origin:
        return self.by_key.get(key, self.fallback)


def _origins_of(info: ValidationInfo) -> _Origins:
    return info.context if isinstance(info.context, _Origins) else _Origins()


def _record(out: dict[str, _Origin], key: str, data: Any, origin: _Origin) -> None:
    out[key] = origin
    if isinstance(data, Mapping):
        for name, value in data.items():
            _record(out, _join(key, name), value, origin)


def _join(prefix: str, name: object) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _error(
    key: str, value: Any, problem: str, origins: _Origins, doc: str | None = None
) -> ConfigError:
    """``KEY = VALUE (SOURCE) PROBLEM [NAME: DOC]`` as one ConfigError."""
    message = f"{key} = {_show(value)} ({origins.of(key).label}) {problem}"
    if doc:
        message += f" [{key.rsplit('.', 1)[-1]}: {_brief(doc)}]"
    return ConfigError(message, key=key)


def _brief(doc: str) -> str:
    """A field's description cut to its first sentence, for error messages."""
    first = " ".join(doc.split()).split(". ")[0].rstrip(".")
    return first[:1].lower() + first[1:]


def _suggest(word: str, choices: list[str]) -> str:
    """'; did you mean X?' for the choice nearest ``word`` (same but for case,
    the only one it begins, else the closest by difflib), or ''."""
    lower = word.lower()
    close = [c for c in choices if c.lower() == lower]
    close = close or [c for c in choices if lower and c.lower().startswith(lower)]
    if len(close) != 1:
        close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


# -- pydantic's errors in our words ------------------------------------------------

_EXPECTED = {  # pydantic error type -> what is allowed
    "bool_type": "true or false",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "tuple_type": "a list of integers",
}


def _field_at(cls: Any, loc: tuple[Any, ...]) -> tuple[str, Any]:
    """(dotted key, FieldInfo or None) of the setting that ``loc`` points into;
    an index into a list stops the walk at the list."""
    key, info = cls._KEY, None
    for part in loc:
        fields = getattr(cls, "model_fields", {})
        if part not in fields:
            break
        info = fields[part]
        key, cls = _join(key, part), info.annotation
    return key, info


def _problem(err: Any, info: Any) -> str:
    """What is wrong with the value of one pydantic error, and what is allowed."""
    kind, value, ctx = err["type"], err["input"], err.get("ctx") or {}
    in_list = isinstance(err["loc"][-1], int)
    if kind == "literal_error":
        choices = typing.get_args(info.annotation)
        text = "is not one of " + ", ".join(repr(c) for c in choices)
        return text + (_suggest(value, list(choices)) if isinstance(value, str) else "")
    if kind in ("greater_than_equal", "less_than_equal"):
        bound = f">= {ctx['ge']}" if "ge" in ctx else f"<= {ctx['le']}"
        what = "every item must be" if in_list else "must be"
        return f"is out of range: {what} {bound}"
    if kind in ("model_type", "dict_type"):
        return "must be a mapping of settings"
    if kind == "finite_number":
        return "must be a finite number"
    if kind == "too_short":
        return "must not be empty"
    allowed = _EXPECTED.get(kind, err["msg"])
    if info is not None and not info.is_required() and info.default is None:
        allowed += " or null"
    number = kind in ("int_type", "int_from_float", "float_type")
    why = " (true/false is not a number)" if number and isinstance(value, bool) else ""
    return f"must be {allowed}{why}"


def _translate(cls: Any, exc: ValidationError, origins: _Origins) -> ConfigError:
    """The first of pydantic's errors as a ConfigError."""
    errors = exc.errors(include_url=False)
    for err in errors:  # our own validators' errors come back as they were
        if isinstance((err.get("ctx") or {}).get("error"), ConfigError):
            return err["ctx"]["error"]  # type: ignore[no-any-return]
    err = next((e for e in errors if e["type"] == "missing"), errors[0])
    loc = tuple(err["loc"])
    if err["type"] in ("missing", "extra_forbidden"):
        prefix, info = _field_at(cls, loc[:-1])
        section = info.annotation if info is not None else cls
        where, key = prefix or "the bucket file", _join(prefix, loc[-1])
        if err["type"] == "missing":
            names = [str(e["loc"][-1]) for e in errors if e["type"] == "missing"]
            return ConfigError(
                f"{where} ({origins.of(prefix).label}) is missing required "
                f"key(s): {', '.join(names)}",
                key=key,
            )
        known = list(section.model_fields)
        return ConfigError(
            f"{key} ({origins.of(key).label}) is not a known key"
            + (_REMOVED.get(key) or _suggest(str(loc[-1]), known) or ".")
            + f" Known keys of {where}: {', '.join(known)}.",
            key=key,
        )
    key, info = _field_at(cls, loc)
    doc = info.description if info is not None else None
    return _error(key, err["input"], _problem(err, info), origins, doc)


_REMOVED = {
    f"{ROOT_KEY}.mm_encoder_cache_items": (
        ": it was removed, because vLLM's scheduler decides which encoder outputs "
        "stay cached (its encoder cache is sized in embeddings from "
        "--max-num-batched-tokens) and the worker must keep each one until the "
        "scheduler frees it."
    ),
}


class _Section(BaseModel):
    """A frozen, strict settings model whose every failure is a ConfigError."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True
    )
    _KEY: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _translate(type(self), exc, _Origins()) from None

    # Tells pydantic this __init__ only wraps its own: validation (nested
    # sections, model_validate) then builds instances directly, keeping its
    # context (the origins) instead of calling __init__ with the data.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def _parse(cls, data: Any, origins: _Origins) -> Self:
        """``cls`` from plain data, with ``origins`` naming where each key came from."""
        if not isinstance(data, Mapping):
            raise _error(cls._KEY, data, "must be a mapping of settings", origins)
        try:
            return cls.model_validate(data, context=origins)
        except ValidationError as exc:
            raise _translate(cls, exc, origins) from None

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated like any other instance."""
        return type(self)(**{**dict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars; ``from_mapping`` of it is equal."""
        return self.model_dump(mode="json")


# -- YAML: YAML 1.2 booleans (`strategy: off` is the string "off"), no duplicate keys


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


def _resolve_path(key: str, value: str, origins: _Origins) -> Path:
    """The file ``value`` names: absolute, or tried against cwd, the folder of
    the YAML file that set it, then the repository's configs/ folder."""
    path = Path(value).expanduser()
    if path.is_absolute():
        tried = [path]
    else:
        base = origins.of(key).base_dir
        dirs = [Path.cwd(), *([base] if base else []), CONFIGS_DIR]
        tried = list(dict.fromkeys(d / path for d in dirs))
    for candidate in tried:
        if candidate.is_file():
            return candidate.resolve()
    tried_text = ", ".join(str(p) for p in tried)
    raise _error(key, value, "names no file; tried " + tried_text, origins)


def _read_yaml(key: str, value: str, path: Path, origins: _Origins) -> Any:
    try:
        with path.open(encoding="utf-8") as fh:
            return yaml.load(fh, Loader=_YamlLoader)  # a SafeLoader
    except OSError as exc:
        raise _error(key, value, f"cannot be read: {exc}", origins) from exc
    except yaml.YAMLError as exc:
        problem = f"is not valid YAML ({path}): {exc}"
        raise _error(key, value, problem, origins) from exc


# -- the configuration tree ----------------------------------------------------------

_Positive = Annotated[int, Field(ge=1)]
_Buckets = Annotated[  # a YAML list of positive ints, kept sorted and unique
    tuple[Annotated[int, Strict(), Field(ge=1)], ...],
    Field(min_length=1, strict=False),
    AfterValidator(lambda items: tuple(sorted(set(items)))),
]


class ExplicitBuckets(_Section):
    """The bucket lists of a ``bucketing.file`` (strategy ``explicit``).

    Each list is required, holds at least one positive integer, and is sorted
    and de-duplicated on load. A prefill bucket is a token count, a decode
    bucket a batch size; ``blocks`` are KV-block counts, used by both.
    """

    prefill_tokens: _Buckets
    """Prefill buckets: total prompt tokens in one forward pass."""
    decode_batch: _Buckets
    """Decode buckets: number of sequences in one decode step."""
    blocks: _Buckets
    """KV-cache block counts, used by both prefill and decode buckets."""


class BucketingConfig(_Section):
    """Which padded shapes are compiled and warmed up."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.bucketing"
    _buckets: ExplicitBuckets | None = PrivateAttr(default=None)

    strategy: Literal["exponential", "linear", "explicit", "off"] = "exponential"
    """How bucket sizes are generated. Inputs are padded up to a bucket, so only a known
    set of shapes gets compiled. `exponential`: powers of two from the minimum sizes.
    `linear`: fixed steps (`*_step_*`). `explicit`: the lists in `bucketing.file`.
    `off`: no padding, so every new shape compiles when it first appears."""
    file: str | None = None
    """YAML file with the explicit bucket lists (see [below](#explicit-bucket-files)).
    Required when `strategy` is `explicit`. The file must exist and parse. At other
    times it is ignored, with a warning."""
    prefill_min_tokens: _Positive = 32
    """Smallest prefill bucket, in tokens."""
    prefill_step_tokens: _Positive = 128
    """Step between prefill buckets, in tokens (strategy `linear`)."""
    decode_min_batch: _Positive = 1
    """Smallest decode batch bucket."""
    decode_step_batch: _Positive = 8
    """Step between decode batch buckets (strategy `linear`)."""
    block_step: _Positive = 16
    """Step between KV-cache block-count buckets."""
    fallback_max_pad_ratio: Annotated[float, Field(ge=1.0, allow_inf_nan=False)] = 2.0
    """For a shape that no warmed-up bucket fits: pad it to at most this many times its
    real size. A shape beyond that runs at a new size, which is compiled on first
    use."""

    @property
    def buckets(self) -> ExplicitBuckets | None:
        """The lists read from ``file`` when the strategy is 'explicit', else None."""
        return self._buckets

    @model_validator(mode="after")
    def _read_bucket_file(self, info: ValidationInfo) -> Self:
        origins = _origins_of(info)
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
            return self
        if self.file is None:
            raise _error(
                f"{self._KEY}.strategy",
                self.strategy,
                f"needs {file_key}, a YAML file with the bucket lists "
                "(see configs/buckets-example.yaml)",
                origins,
            )
        path = _resolve_path(file_key, self.file, origins)
        self._buckets = _load_buckets(file_key, self.file, path, origins)
        self.__dict__["file"] = str(path)  # frozen for users; the resolved path
        return self


class WarmupConfig(_Section):
    """Compiling and running every bucket before serving."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.warmup"

    skip: bool = False
    """Skip warm-up. Start-up is faster, but each bucket compiles on its first
    request."""
    progress_bar: bool = True
    """Show a progress bar during warm-up."""


class MemoryConfig(_Section):
    """How device memory is shared out when the engine starts."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.memory"

    graph_reserve_fraction: Annotated[
        float, Field(ge=0.0, le=0.9, allow_inf_nan=False)
    ] = 0.10
    """Share of device memory kept free for compiled graphs after the KV cache is sized
    (as the official Gaudi plugin's `VLLM_GRAPH_RESERVED_MEM`)."""


class HpuMMConfig(_Section):
    """All of the plugin's settings (``--additional-config`` key ``hpu_mm``)."""

    _KEY: ClassVar[str] = ROOT_KEY

    graph_mode: Literal["auto", "eager", "compile"] = "auto"
    """How the model runs. `eager`: plain PyTorch, with no graphs. `compile`:
    `torch.compile`, one compiled graph per bucket (the `hpu_backend` on Gaudi).
    `auto`: `eager` under `--enforce-eager`, else `compile`. Captured graphs
    (`graphs`: HPU or CUDA graphs) are not implemented and are refused."""
    bucketing: BucketingConfig = Field(default_factory=BucketingConfig)
    """Shape bucketing."""
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    """Warm-up before serving."""
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    """Device memory at start-up."""
    mm_max_image_pixels: _Positive = 4096 * 4096
    """Largest image a request may send, in pixels (width x height, 4096 x 4096 by
    default). It is read from the image header before any pixel is decoded, so a
    decompression bomb is refused with a 400 in the API server (see the README's
    Reliability section)."""
    config_file: str | None = None
    """YAML file that is read first. Keys given inline override its keys. After loading,
    this key holds the resolved absolute path."""

    @field_validator("graph_mode", mode="before")
    @classmethod
    def _no_captured_graphs(cls, value: Any, info: ValidationInfo) -> Any:
        if value == "graphs":
            raise _error(
                f"{ROOT_KEY}.graph_mode",
                value,
                "is not supported: captured HPU/CUDA graphs are not implemented. "
                "Allowed: 'auto', 'eager', 'compile'; 'compile' (torch.compile, one "
                "graph per warmed-up bucket) is the graph mode that runs",
                _origins_of(info),
            )
        return value

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
        by_key: dict[str, _Origin] = {}
        _record(by_key, ROOT_KEY, data, inline)
        origins = _Origins(by_key, _Origin("default"))
        file_value = data.get("config_file") if isinstance(data, Mapping) else None
        if file_value is None:
            return cls._parse(data, origins)
        file_key = f"{ROOT_KEY}.config_file"
        if not isinstance(file_value, str):
            raise _error(file_key, file_value, "must be a string (a path)", origins)
        path = _resolve_path(file_key, file_value, origins)
        file_data = _read_file_section(file_key, file_value, path, origins)
        from_file: dict[str, _Origin] = {}
        _record(from_file, ROOT_KEY, file_data, _Origin(f"from {path}", path.parent))
        merged = {**_deep_merge(file_data, data), "config_file": str(path)}
        return cls._parse(merged, _Origins({**from_file, **by_key}, origins.fallback))


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for name, value in over.items():
        old = merged.get(name)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[name] = _deep_merge(old, value)
        else:
            merged[name] = value
    return merged


def _read_file_section(
    key: str, value: str, path: Path, origins: _Origins
) -> Mapping[str, Any]:
    """The ``hpu_mm`` settings in a config file (a top-level ``hpu_mm:`` is
    unwrapped); an empty file is an empty mapping."""
    data = _read_yaml(key, value, path, origins)
    if data is None:
        return {}
    if isinstance(data, Mapping) and set(data) == {ROOT_KEY}:
        data = data[ROOT_KEY] or {}
    if not isinstance(data, Mapping):
        problem = f"must hold a mapping of settings; {path} holds {_show(data)}"
        raise _error(key, value, problem, origins)
    if "config_file" in data:
        problem = f"{path} sets config_file itself; config files do not nest"
        raise _error(key, value, problem, origins)
    return data


def _load_buckets(
    key: str, value: str, path: Path, origins: _Origins
) -> ExplicitBuckets:
    data = _read_yaml(key, value, path, origins)
    if not isinstance(data, Mapping):
        problem = f"must hold a mapping of bucket lists; got {_show(data)}"
        raise _error(key, value, problem, origins)
    by_key: dict[str, _Origin] = {}
    _record(by_key, "", data, _Origin(f"from {path}, the {key}", path.parent))
    return ExplicitBuckets._parse(data, _Origins(by_key, by_key[""]))


def load_explicit_buckets(path: str | Path) -> ExplicitBuckets:
    """Read and check a bucket-list file (the format of ``bucketing.file``)."""
    key = f"{BucketingConfig._KEY}.file"
    origins = _Origins({key: _Origin("passed to load_explicit_buckets")})
    resolved = _resolve_path(key, str(path), origins)
    return _load_buckets(key, str(path), resolved, origins)


def load_plugin_config(vllm_config: Any) -> HpuMMConfig:
    """The plugin settings of a ``VllmConfig`` (read afresh on every call)."""
    return HpuMMConfig.from_additional_config(
        getattr(vllm_config, "additional_config", None)
    )


# -- introspection, for docs and tools -------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One settable key: its dotted name and its pydantic field."""

    key: str
    field: FieldInfo

    @property
    def doc(self) -> str:
        return self.field.description or ""


def describe_keys(cls: type[_Section] = HpuMMConfig) -> Iterator[KeyInfo]:
    """Every leaf key of ``cls`` (default: the whole ``hpu_mm`` tree)."""
    for name, info in cls.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, _Section):
            yield from describe_keys(info.annotation)
        else:
            yield KeyInfo(_join(cls._KEY, name), info)
