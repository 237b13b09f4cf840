"""Structured outputs and tool calling through ``vllm serve`` on the plugin.

The server runs with vLLM's auto tool choice (``--enable-auto-tool-choice
--tool-call-parser hermes``). A random tiny model never decides to call a
tool by itself, so the tool tests name the tool (``tool_choice`` with a
function): vLLM then constrains the arguments with the tool's JSON schema and
builds the call, the path that breaks when a bitmask lands on the wrong row.
(``tool_choice="required"`` goes through hermes' structural tag, whose
``<tool_call>`` envelope admits free whitespace: the random model fills
``max_tokens`` with it and hermes' parser then fails on the cut JSON, a fact of
the model, not of the runner.) The tools are strict: vLLM pins argument
schemas only for strict tools (OpenAI's semantics).
``--structured-outputs-config`` picks xgrammar and compact JSON. The server
runs in graph mode over a small explicit bucket set, and ``/metrics`` must show
no compilation while serving after all of it. The concurrent
test mixes tool calls, JSON-schema, regex, choice and free requests in flight
together; every constraint must hold and each free
request must answer exactly as it does alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.e2e import test_serve
from tests.e2e.test_serve import Server, serve, server_compiles
from tests.e2e.test_structured_output import (
    CHOICES,
    REGEX,
    SCHEMA,
    _check_schema,
    _loads,
)
from tests.graph_config import compiled_with_buckets

pytestmark = pytest.mark.e2e

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        # vLLM pins argument schemas only for strict tools (OpenAI's semantics)
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                # xgrammar's JSON strings admit raw control characters, which
                # hermes' parser (strict json.loads) refuses: keep to letters
                "city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                "days": {"type": "integer"},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a zone",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    # Graph mode over a small explicit bucket set: the constrained steps must
    # compile nothing after warmup (the bitmask and the sampler run outside the
    # graphs). A loaded machine may need more than the eager servers' wait.
    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "so_serve",
        "prefill_tokens: [16, 64]\ndecode_batch: [1, 4, 8]\nblocks: [4, 16, 32]\n",
    )
    patch = pytest.MonkeyPatch()
    patch.setattr(test_serve, "STARTUP_TIMEOUT_S", 900.0)
    try:
        yield from serve(
            tiny_llama_dir,
            tmp_path_factory.mktemp("so") / "server.log",
            "--additional-config",
            json.dumps(hpu_mm),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--max-num-batched-tokens",
            "64",
            # A random model loves whitespace, which JSON allows anywhere; compact
            # JSON keeps the outputs within max_tokens.
            "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true}',
        )
    finally:
        patch.undo()


def _chat(server: Server, **body: Any) -> dict[str, Any]:
    r = server.post(
        "/v1/chat/completions",
        {
            "model": server.model,
            "messages": MESSAGES,
            "temperature": 0.0,
            "max_tokens": 120,
            **body,
        },
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def _check_tool_call(call: dict[str, Any]) -> None:
    args = _loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(args) == {"city", "days"}, args
        assert isinstance(args["city"], str) and isinstance(args["days"], int)
    else:
        assert call["function"]["name"] == "get_time", call
        assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")


def test_response_format_json_schema(server: Server) -> None:
    out = _chat(
        server,
        max_tokens=200,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA},
        },
    )
    _check_schema(out["choices"][0]["message"]["content"])


def test_named_tool_choice(server: Server) -> None:
    out = _chat(
        server,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    calls = out["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"], out
    _check_tool_call(calls[0])


def _completion(server: Server, prompt: str, **extra: Any) -> str:
    r = server.post(
        "/v1/completions",
        {
            "model": server.model,
            "prompt": prompt,
            "temperature": 0.0,
            "max_tokens": extra.pop("max_tokens", 20),
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_mixed_concurrent_load(server: Server) -> None:
    long = " ".join(["memory blocks hold tokens"] * 10)
    free_prompts = [f"{long} {i}" if i % 2 else f"Hi {i}" for i in range(4)]
    alone = [_completion(server, p) for p in free_prompts]

    def job(i: int) -> tuple[str, Any]:
        kind = i % 6
        if kind == 0:
            return "tool", _chat(
                server,
                tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
        if kind == 1:
            return "schema", _completion(
                server,
                f"{long} person {i}",
                max_tokens=200,
                structured_outputs={"json": SCHEMA},
            )
        if kind == 2:
            return "regex", _completion(
                server, f"pet {i}", max_tokens=40, structured_outputs={"regex": REGEX}
            )
        if kind == 3:
            return "choice", _completion(
                server, f"{long} pick", structured_outputs={"choice": CHOICES}
            )
        return f"free{i // 6 * 2 + kind - 4}", _completion(
            server, free_prompts[i // 6 * 2 + kind - 4]
        )

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(job, range(12)))
    for kind, value in results:
        if kind == "tool":
            calls = value["choices"][0]["message"]["tool_calls"]
            assert calls, value
            for call in calls:
                _check_tool_call(call)
        elif kind == "schema":
            _check_schema(value)
        elif kind == "regex":
            assert re.fullmatch(REGEX, value), value
        elif kind == "choice":
            assert value in CHOICES, value
        else:
            assert value == alone[int(kind[4:])], (kind, value)


def test_no_compilation_while_serving(server: Server) -> None:
    """After every request above (constrained, tool calls, free, concurrent),
    ``/metrics`` shows the warmup's compilations and none while serving."""
    compiles = server_compiles(server)
    assert compiles["warmup"] > 0 and compiles["serving"] == 0, compiles
