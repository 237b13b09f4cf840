"""The plugin's own settings: one typed, frozen tree, checked once.

Set through vLLM's ``--additional-config`` under ``hpu_mm`` and optionally a YAML
file named by ``hpu_mm.config_file`` (inline keys override the file's). Frozen,
strict pydantic models check types, ranges and choices; this module words the
first error as a ``ConfigError`` naming the dotted key, the value, where it came
from and what is allowed. ``docs/configuration.md`` is generated from the models'
JSON schema. Plain Python, pydantic and PyYAML: nothing from vLLM or torch.
"""

from __future__ import annotations

import difflib
import logging
import operator
import typing
from collections.abc import Iterator, Mapping
from functools import reduce
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Self

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger("vllm_hpu_mm.config")

ROOT_KEY = "hpu_mm"  # the key of --additional-config that holds these settings
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"  # tried last


class ConfigError(ValueError):
    """A bad plugin setting; the message names the key, the value and its source."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class _Source(NamedTuple):
    label: str  # "from --additional-config", "from /abs/x.yaml", ...
    data: Any = None  # the settings it gave, nested as their dotted keys are
    base_dir: Path | None = None  # a YAML file's folder, for relative paths


class _Sources(tuple[_Source, ...]):
    """Where settings came from: a key's source is the first that sets it, the
    last one stands for all other keys ("default", "set in Python code")."""

    def of(self, key: str) -> _Source:
        for source in self[:-1]:
            try:
                reduce(operator.getitem, filter(None, key.split(".")), source.data)
            except (KeyError, TypeError):
                continue
            return source
        return self[-1]

    def error(self, key: str, value: Any, problem: str, doc: str = "") -> ConfigError:
        """``KEY = VALUE (SOURCE) PROBLEM [NAME: first sentence of DOC]``."""
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        message = f"{key} = {shown} ({self.of(key).label}) {problem}"
        if brief := " ".join(doc.split()).split(". ")[0].rstrip("."):
            brief = brief[0].lower() + brief[1:] if brief[1:2].islower() else brief
            message += f" [{key.rsplit('.', 1)[-1]}: {brief}]"
        return ConfigError(message, key=key)


_PYTHON = _Sources([_Source("set in Python code")])


def _join(prefix: str, name: object) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _suggest(word: str, choices: list[str]) -> str:
    """'; did you mean X?' for the one choice ``word`` begins (any case), else
    the closest by difflib, else ''."""
    close = [c for c in choices if word and c.lower().startswith(word.lower())]
    if len(close) != 1:
        close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


_PROBLEMS = {  # pydantic's error type -> our words; {...} filled in by _problem
    "bool_type": "must be true or false{null}",
    "int_type": "must be an integer{null}{bool}",
    "float_type": "must be a number{null}{bool}",
    "string_type": "must be a string{null}",
    "tuple_type": "must be a list of integers",
    "model_type": "must be a mapping of settings",
    "finite_number": "must be a finite number",
    "too_short": "must not be empty",
    "greater_than_equal": "is out of range: {every}must be >= {ge}",
    "less_than_equal": "is out of range: {every}must be <= {le}",
    "literal_error": "is not one of {choices}{suggest}",
    "value_error": "{error}",  # a ValueError raised by a validator below
}
_REMOVED = {  # key -> why it is gone
    f"{ROOT_KEY}.mm_encoder_cache_items": ": it was removed, because vLLM's scheduler "
    "decides which encoder outputs stay cached (its encoder cache is sized in "
    "embeddings from --max-num-batched-tokens) and the worker must keep each one "
    "until the scheduler frees it.",
    f"{ROOT_KEY}.mm_max_image_pixels": ": it was removed; the image pixel limit is "
    "vLLM's own environment variable VLLM_MAX_IMAGE_PIXELS (the plugin sets it to "
    "16777216, 4096 x 4096, when it is not set).",
}


def _field_at(cls: Any, loc: tuple[Any, ...]) -> tuple[str, Any]:
    """(dotted key, FieldInfo or None) of the setting ``loc`` points into (a list's
    index stops the walk at the list)."""
    key, info = cls._KEY, None
    for part in loc:
        if part not in getattr(cls, "model_fields", {}):
            break
        info = cls.model_fields[part]
        key, cls = _join(key, part), info.annotation
    return key, info


def _problem(err: Any, info: Any) -> str:
    """What is wrong with the value of one pydantic error, and what is allowed."""
    value, choices = err["input"], typing.get_args(getattr(info, "annotation", None))
    return _PROBLEMS.get(err["type"], err["msg"]).format(
        **err.get("ctx", {}),
        every="every item " if any(isinstance(p, int) for p in err["loc"]) else "",
        choices=", ".join(map(repr, choices)),
        suggest=_suggest(value, list(choices)) if isinstance(value, str) else "",
        null=" or null" if getattr(info, "default", 0) is None else "",
        bool=" (true/false is not a number)" if isinstance(value, bool) else "",
    )


def _translate(cls: Any, exc: ValidationError, sources: _Sources) -> ConfigError:
    """The first of pydantic's errors (missing keys first) as one ConfigError."""
    errors = exc.errors(include_url=False)
    for err in errors:  # a validator's own ConfigError comes back as it was
        if isinstance(own := err.get("ctx", {}).get("error"), ConfigError):
            return own
    missing = [str(e["loc"][-1]) for e in errors if e["type"] == "missing"]
    err = next((e for e in errors if e["type"] == "missing"), errors[0])
    if err["type"] not in ("missing", "extra_forbidden"):
        key, info = _field_at(cls, err["loc"])
        doc = getattr(info, "description", None) or ""
        return sources.error(key, err["input"], _problem(err, info), doc)
    prefix, info = _field_at(cls, err["loc"][:-1])
    where, key = prefix or "the bucket file", _join(prefix, err["loc"][-1])
    if missing:
        label = sources.of(prefix).label
        message = f"{where} ({label}) is missing required key(s): {', '.join(missing)}"
        return ConfigError(message, key=key)
    known = list(getattr(info, "annotation", cls).model_fields)
    hint = _REMOVED.get(key) or _suggest(str(err["loc"][-1]), known) or "."
    message = f"{key} ({sources.of(key).label}) is not a known key{hint} "
    return ConfigError(f"{message}Known keys of {where}: {', '.join(known)}.", key=key)


class _Section(BaseModel):
    """A frozen, strict settings model whose every failure is a ConfigError."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True
    )
    _KEY: ClassVar[str] = ""  # the dotted key of this section

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _translate(type(self), exc, _PYTHON) from None

    # Tells pydantic this __init__ only wraps its own, so nested sections and
    # model_validate build instances directly, keeping the context (the sources).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def _parse(cls, data: Any, sources: _Sources) -> Self:
        try:
            return cls.model_validate(data, context=sources)
        except ValidationError as exc:
            raise _translate(cls, exc, sources) from None

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated like any other instance."""
        return type(self)(**{**dict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars; ``from_mapping`` of it is equal."""
        return self.model_dump(mode="json")


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans (``strategy: off`` is the string "off"), no duplicate keys."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        tag = super().resolve(kind, value, implicit)
        if tag == "tag:yaml.org,2002:bool" and value.lower() not in ("true", "false"):
            return "tag:yaml.org,2002:str"  # YAML 1.1's yes/no/on/off
        return tag

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                mark, problem = node.value[i][0].start_mark, f"duplicate key {key!r}"
                raise yaml.constructor.ConstructorError(None, None, problem, mark)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(
    key: str, value: str, sources: _Sources, what: str
) -> tuple[Path, Mapping[str, Any]]:
    """The file setting ``key`` names and the mapping of ``what`` it holds ({} if
    empty, a single top-level ``hpu_mm:`` unwrapped). A relative path is tried
    against cwd, the folder of the YAML file that set it, then configs/."""
    dirs = [Path.cwd(), sources.of(key).base_dir, CONFIGS_DIR]  # dir / "/abs" is "/abs"
    tried = list(dict.fromkeys(d / Path(value).expanduser() for d in dirs if d))
    path = next((p.resolve() for p in tried if p.is_file()), None)
    if path is None:
        problem = "names no file; tried " + ", ".join(map(str, tried))
        raise sources.error(key, value, problem)
    try:
        with path.open(encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_YamlLoader)  # a SafeLoader
    except (OSError, yaml.YAMLError) as exc:
        what = "cannot be read" if isinstance(exc, OSError) else "is not valid YAML"
        raise sources.error(key, value, f"{what} ({path}): {exc}") from exc
    if isinstance(data, Mapping) and set(data) == {ROOT_KEY}:
        data = data[ROOT_KEY]
    if not isinstance(data := {} if data is None else data, Mapping):
        problem = f"must hold a mapping of {what}; {path} holds {data!r:.80}"
        raise sources.error(key, value, problem)
    return path, data


_Buckets = Annotated[  # a YAML list of positive ints, kept sorted and unique
    tuple[Annotated[int, Field(ge=1)], ...],
    Field(min_length=1, strict=False),
    pydantic.AfterValidator(lambda items: tuple(sorted(set(items)))),
]


class ExplicitBuckets(_Section):
    """With `strategy: explicit`, the file named by `bucketing.file` holds three
    lists (and an optional fourth, `vision_patches`). Each list must contain at
    least one positive integer. Lists are sorted and de-duplicated when loaded.
    The parsed lists are available as `BucketingConfig.buckets` (an
    `ExplicitBuckets`), and `load_explicit_buckets(path)` reads such a file on its
    own."""

    prefill_tokens: _Buckets
    """Prefill buckets: total prompt tokens in one forward pass."""
    decode_batch: _Buckets
    """Decode buckets: number of sequences in one decode step."""
    blocks: _Buckets
    """KV-cache block counts, used by both prefill and decode buckets."""
    vision_patches: _Buckets | None = None
    """Optional. Image patches in one vision-tower run of a dynamic-resolution
    model (Qwen2.5-VL, Qwen3-VL); each is rounded up to whole merged tokens (4
    patches for a 2x2 merge). Runs larger than the largest are split by image; an
    image larger than it runs unpadded. Unset: powers of two from
    `vision_min_patches` up to the encoder budget."""


class BucketingConfig(_Section):
    """Which padded shapes are compiled and warmed up."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.bucketing"
    _buckets: ExplicitBuckets | None = pydantic.PrivateAttr(default=None)

    strategy: Literal["prior", "exponential", "linear", "explicit", "off"] = "prior"
    """How bucket sizes are generated. Inputs are padded up to a bucket, so only a known
    set of shapes gets compiled. `prior`: quarter (or half) octaves in the top of the
    token axis, half octaves in the top of the batch axis, 4x steps below, and a short
    block axis of its own for prefill, derived from the engine's limits
    (`vllm_hpu_mm/bucketing/prior.py` says how it was chosen); it pads fewer rows than
    `exponential` with fewer warmup graphs. `exponential`: powers of two from the
    minimum sizes.
    `linear`: fixed steps (`*_step_*`). `explicit`: the lists in `bucketing.file`.
    `off`: no padding, so every new shape compiles when it first appears."""
    file: str | None = None
    """YAML file with the explicit bucket lists (see [below](#explicit-bucket-files)).
    Required when `strategy` is `explicit`. The file must exist and parse. At other
    times it is ignored, with a warning."""
    prefill_min_tokens: int = Field(default=32, ge=1)
    """Smallest prefill bucket, in tokens."""
    prefill_step_tokens: int = Field(default=128, ge=1)
    """Step between prefill buckets, in tokens (strategy `linear`)."""
    decode_min_batch: int = Field(default=1, ge=1)
    """Smallest decode batch bucket."""
    decode_step_batch: int = Field(default=8, ge=1)
    """Step between decode batch buckets (strategy `linear`)."""
    block_step: int = Field(default=16, ge=1)
    """Step between KV-cache block-count buckets."""
    vision_min_patches: int = Field(default=16, ge=1)
    """Smallest vision patch bucket of a dynamic-resolution model (Qwen2.5-VL,
    Qwen3-VL): buckets double from it up to the scheduler's encoder budget (in
    patches), unless the bucket file lists `vision_patches`."""
    fallback_max_pad_ratio: float = Field(default=2.0, ge=1.0, allow_inf_nan=False)
    """For a shape that no warmed-up bucket fits: pad it to at most this many times its
    real size. A shape beyond that runs at a new size, compiled on first use."""
    prefill_one_request: bool = True
    """Static plan: a step whose prefill rows are one request's (above one 128-row
    tile) runs them as one tile, so the request's K/V is gathered once instead of
    once a tile, and a fresh prompt runs SDPA's causal form (FusedSDPA
    `is_causal`), skipping the masked half of its scores. Each form is a graph of
    its own, so warmup compiles more shapes (`vllm-hpu-mm buckets show` counts
    them); `false` keeps every prefill part in 128-row tiles."""
    record_steps: str | None = None
    """File to append each served step's exact shape to, one JSON object a line (the
    first rank writes; warmup is not recorded). `vllm-hpu-mm buckets plan --samples
    FILE` fits bucket lists to it: buckets from live traffic."""

    @property
    def buckets(self) -> ExplicitBuckets | None:
        """The lists read from ``file`` when the strategy is 'explicit', else None."""
        return self._buckets

    @pydantic.model_validator(mode="after")
    def _read_bucket_file(self, info: pydantic.ValidationInfo) -> Self:
        sources, key = info.context or _PYTHON, f"{self._KEY}.file"
        if self.strategy != "explicit":
            if self.file is not None:
                logger.warning(
                    "%s = %r is ignored: strategy is not 'explicit'", key, self.file
                )
            return self
        if self.file is None:
            problem = f"needs {key}, a YAML file with the bucket lists "
            problem += "(see configs/buckets-example.yaml)"
            raise sources.error(f"{self._KEY}.strategy", self.strategy, problem)
        path, data = _read_yaml(key, self.file, sources, "bucket lists")
        inner = _Sources([_Source(f"from {path}, the {key}", data)])
        self._buckets = ExplicitBuckets._parse(data, inner)
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
    compile_backend: Literal["auto", "inductor", "aot_eager"] = "auto"
    """The torch.compile backend of graph mode off Gaudi (Gaudi always compiles with
    Habana's `hpu_backend`; another value than `auto` is refused there). `inductor`:
    generated C++ (CPU) or Triton (CUDA) code per graph, the fastest steps, about 10 s
    of code generation and compilation per graph on a 2-core CPU. `aot_eager`: each
    graph traced by Dynamo and lowered by AOTAutograd as `hpu_backend` lowers it,
    KV-cache writes reinplaced, then run op by op with no code generated; the same
    static graphs, shapes and zero-compilation rule, a fraction of the warm-up (and
    nothing for `compile_cache_dir` to keep: each start traces again). `auto`:
    `aot_eager` on the CPU with `execution: static` (Gaudi's path, warm-up compiles
    every step shape), `inductor` otherwise."""
    compile_cache_dir: str | None = None
    """Directory of the compile caches in graph mode. CPU and CUDA: Inductor's
    FX graph and AOTAutograd caches (`TORCHINDUCTOR_CACHE_DIR`): a later start of
    the same model with the same buckets and KV-cache size reuses the generated
    code (Dynamo still traces each graph); the graphs go into a subdirectory named
    by the CPU kernels in use (e.g. `cpu-avx512-amx-onednn-all`;
    `ATEN_CPU_CAPABILITY` and `ONEDNN_MAX_CPU_ISA` change it), as torch's cache
    does not key on them. Gaudi: Inductor's cache does nothing for `hpu_backend`;
    the directory holds Habana's recipe cache instead
    (`PT_HPU_RECIPE_CACHE_CONFIG=<dir>/hpu-recipes,False,8192`, set when unset),
    the only on-disk cache of compiled HPU graphs. Unset: `TORCHINDUCTOR_CACHE_DIR`
    when that is set, else `$XDG_CACHE_HOME/vllm-hpu-mm/torch-compile` (by default
    under `~/.cache`), and on Gaudi no recipe cache unless the environment sets
    one."""


class MemoryConfig(_Section):
    """How device memory is shared out when the engine starts."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.memory"

    graph_reserve_fraction: float = Field(
        default=0.1, ge=0.0, le=0.9, allow_inf_nan=False
    )
    """Share of device memory kept free for compiled graphs after the KV cache is sized
    (as the official Gaudi plugin's `VLLM_GRAPH_RESERVED_MEM`)."""
    decode_cache_fraction: float = Field(
        default=0.25, ge=0.0, le=1.0, allow_inf_nan=False
    )
    """The CPU, where attention runs outside the compiled graphs (eager mode, or opaque
    attention, the default): decode reads a dense copy of each decoding request's keys
    and values (one slot per sequence, `max_num_seqs` x `max_model_len` tokens a layer)
    instead of gathering its paged blocks in every layer. It is built when it needs at
    most this share of the paged KV cache's bytes, on top of them; `0` turns it off.
    Not used on Gaudi or CUDA (the KV cache fills the device memory left there) or with
    traced attention."""
    cross_attention_cache_gib: float = Field(default=4.0, ge=0.0, allow_inf_nan=False)
    """Mllama: device memory (GiB, per tensor-parallel rank) of the cross-attention
    cache, which keeps each image's cross-attention keys and values (about 211 MB an
    image at Llama-3.2-11B-Vision shapes in bfloat16). It holds as many images as fit,
    at least one and at most `max_num_seqs` x images per prompt; idle images are evicted
    least recently used first, the scheduler admits a request only when its images fit
    beside those of the running requests, and a request with more distinct images than
    the cache holds is refused with a 400. Counted before the KV cache is sized."""
    cpu_prepacked_linear: bool = True
    """The CPU with bfloat16 oneDNN (AVX-512 BF16 or AMX): each bfloat16 linear weight
    is also kept reordered for oneDNN, and calls of at most 64 rows (decode steps) use
    it, 1.3-1.6x faster at 32 rows and bit-identical. It costs the linear weights'
    bytes once more in host memory; `false` keeps only the plain weights."""


class FusedConfig(_Section):
    """Gaudi's fused kernels (HPU only)."""

    _KEY: ClassVar[str] = f"{ROOT_KEY}.fused"

    softmax_mode: Literal["auto", "fast", "fp32", "exact"] = "auto"
    """Softmax of Habana's FusedSDPA in prefill attention. `fast`: reduced precision
    (bfloat16 accumulation), the fastest; `fp32`: a float32 softmax; `exact`: the
    kernel's default mode. `auto` follows the official Gaudi plugin: `fp32` for
    Qwen2 and Qwen2.5-VL, no FusedSDPA at all for Mllama (PyTorch's SDPA), `fast`
    for the other models. On the simulated Gaudi `fast` costs about 5e-3 of relative
    error in the attention output against `exact` (1.4e-7 for `fp32`)."""


class HpuMMConfig(_Section):
    """All of the plugin's settings (``--additional-config`` key ``hpu_mm``)."""

    _KEY: ClassVar[str] = ROOT_KEY

    graph_mode: Literal["auto", "eager", "compile"] = "auto"
    """How the model runs. `eager`: plain PyTorch, with no graphs. `compile`:
    `torch.compile`, one compiled graph per bucket (the `hpu_backend` on Gaudi).
    `auto`: `eager` under `--enforce-eager`, else `compile`. Captured graphs
    (`graphs`: HPU or CUDA graphs) are not implemented and are refused."""
    execution: Literal["auto", "static", "dynamic"] = "auto"
    """The execution plan, decided once at start-up (`vllm_hpu_mm/plan.py`; the log
    names it). `static`: Gaudi's path on any device: attention traced into one static
    graph per bucketed step shape, tiled prefill, flat paged decode, mixed steps as a
    decode pass and a prefill pass, Mllama's flat cross-attention layout, one encoder
    graph per image bucket; no dense decode cache, no prepacked linear weights; with
    `graph_mode: eager` the same layouts run without graphs. `dynamic`: the fast path
    off Gaudi: attention as vLLM's opaque op between compiled pieces (on the CPU and
    CUDA the token count is a symbolic size: two graphs per region), and, on the CPU
    and CUDA, prefill request by request, decode over the real rows and blocks (on the
    CPU from the dense decode cache), the batched decode table, prepacked bfloat16
    linear weights on the CPU. `auto`: `static` on Gaudi, `dynamic` elsewhere."""
    graph_attention: Literal["auto", "traced", "opaque"] = "auto"
    """Deprecated: use `execution`. `traced` is `execution: static`, `opaque` is
    `execution: dynamic`, `auto` follows `execution`. Given with an `execution` it
    contradicts (`traced` with `dynamic`, `opaque` with `static`), start-up is
    refused."""
    bucketing: BucketingConfig = Field(default_factory=BucketingConfig)
    """Shape bucketing."""
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    """Warm-up before serving."""
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    """Device memory at start-up."""
    fused: FusedConfig = Field(default_factory=FusedConfig)
    """Gaudi's fused kernels."""
    config_file: str | None = None
    """YAML file that is read first. Keys given inline override its keys. After loading,
    this key holds the resolved absolute path."""

    @pydantic.field_validator("graph_mode", mode="before")
    @classmethod
    def _no_captured_graphs(cls, value: Any) -> Any:
        if value == "graphs":
            raise ValueError(
                "is not supported: captured HPU/CUDA graphs are not implemented. "
                "Allowed: 'auto', 'eager', 'compile'; 'compile' (torch.compile, one "
                "graph per warmed-up bucket) is the graph mode that runs"
            )
        return value

    @pydantic.model_validator(mode="after")
    def _one_execution_plan(self, info: pydantic.ValidationInfo) -> Self:
        """``graph_attention`` (deprecated) may restate ``execution``, not
        contradict it."""
        sources = info.context or _PYTHON
        implied = {"traced": "static", "opaque": "dynamic"}.get(self.graph_attention)
        if implied is None:
            return self
        key = f"{self._KEY}.graph_attention"
        if self.execution not in ("auto", implied):
            problem = (
                f"contradicts {self._KEY}.execution = {self.execution!r}: "
                f"graph_attention {self.graph_attention!r} is execution {implied!r}. "
                "graph_attention is deprecated; set only execution "
                "('auto', 'static' or 'dynamic')"
            )
            raise sources.error(key, self.graph_attention, problem)
        return self  # the plan's start-up line names the deprecated setting

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> HpuMMConfig:
        """The settings under ``hpu_mm`` of vLLM's ``additional_config``: defaults
        for None, a missing or null ``hpu_mm`` or a non-mapping (another plugin's
        object). Other top-level keys belong to others and are left alone."""
        if not isinstance(additional_config, Mapping):
            return cls()
        for other in map(str, additional_config):
            if other != ROOT_KEY and other.lower().replace("-", "_") == ROOT_KEY:
                problem = (
                    f"--additional-config key {other!r} is not read by vllm-hpu-mm"
                )
                raise ConfigError(f"{problem}; did you mean {ROOT_KEY!r}?", key=other)
        if (data := additional_config.get(ROOT_KEY)) is None:
            return cls()
        return cls.from_mapping(data, source="--additional-config")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str) -> HpuMMConfig:
        """Build from the contents of ``hpu_mm``, read from ``source`` (for error
        messages). A ``config_file`` is read first; the keys of ``data`` override
        its keys (nested sections merge key by key)."""
        sources = _Sources([_Source(f"from {source}", {ROOT_KEY: data})])
        name = data.get("config_file") if isinstance(data, Mapping) else None
        if isinstance(name, str):
            key = f"{ROOT_KEY}.config_file"
            path, file_data = _read_yaml(key, name, sources, "settings")
            if "config_file" in file_data:
                problem = f"{path} sets config_file itself; config files do not nest"
                raise sources.error(key, name, problem)
            file_source = _Source(f"from {path}", {ROOT_KEY: file_data}, path.parent)
            sources = _Sources([*sources, file_source])
            data = {**_deep_merge(file_data, data), "config_file": str(path)}
        return cls._parse(data, _Sources([*sources, _Source("default")]))


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for name, value in over.items():
        old = merged.get(name)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            value = _deep_merge(old, value)
        merged[name] = value
    return merged


def load_explicit_buckets(path: str | Path) -> ExplicitBuckets:
    """Read and check a bucket-list file (the format of ``bucketing.file``)."""
    data = {"strategy": "explicit", "file": str(path)}
    sources = _Sources([_Source("passed to load_explicit_buckets")])
    return typing.cast(ExplicitBuckets, BucketingConfig._parse(data, sources).buckets)


def load_plugin_config(vllm_config: Any) -> HpuMMConfig:
    """The plugin settings of a ``VllmConfig`` (read afresh on every call)."""
    additional_config = getattr(vllm_config, "additional_config", None)
    return HpuMMConfig.from_additional_config(additional_config)


class KeyInfo(NamedTuple):
    """A settable key: dotted name and pydantic's JSON schema of its field."""

    key: str
    schema: dict[str, Any]


def describe_keys(cls: type[_Section] = HpuMMConfig) -> Iterator[KeyInfo]:
    """Every leaf key of ``cls`` (default: the whole ``hpu_mm`` tree)."""
    schema = cls.model_json_schema()["properties"]
    for name, info in cls.model_fields.items():
        if isinstance(sub := info.annotation, type) and issubclass(sub, _Section):
            yield from describe_keys(sub)
        else:
            yield KeyInfo(_join(cls._KEY, name), schema[name])
