"""``vllm serve`` with the tiny Qwen2.5-VL and Qwen3-VL, one server each.

Qwen2.5-VL (eager, the dynamic plan): chat requests with base64 PNG images of
several sizes (dynamic resolution); empty, corrupt and too long videos get 400s
that say why, and the server keeps serving.

Both models: a video as a ``video_url`` data URL and as a ``file://`` URL
(``--allowed-local-media-path``), decoded by vLLM's OpenCV loader,
greedy-identical with HF on the prompt the chat template renders. Qwen3-VL's
prompt carries a ``<t seconds>`` timestamp before each temporal patch: from the
processor's 2 fps sampling of a short clip, and from the loader's frame indices
of a clip longer than its ``num_frames`` (32).

The Qwen3-VL server runs in graph mode over explicit buckets with a 32-token
step budget (chunks cut every video), the settings of
``test_qwen_video.py``'s Qwen3-VL engine, and its own metrics directory: its
``/metrics`` shows every graph compiled at warmup, none while serving, the
videos on the vision patch buckets and no fallback.

A third server runs Qwen2.5-VL on ``execution: static`` (Gaudi's path: every
step shape a static graph, compiled at warmup with the CPU's default backend
for that plan, ``aot_eager``) over a small bucket file, float32: an image chat
and a text chat are HF-identical and ``/metrics`` counts no compilation after
warmup.

The tiny models' saved chat template knows image parts only; the servers get
the same template with a video branch (``--chat-template``), as released
Qwen2.5-VL and Qwen3-VL templates have."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e import test_serve
from tests.e2e.test_serve import Server, serve, server_compiles
from tests.mm_reference import chat_messages, make_image
from tests.qwen_reference import (
    hf_qwen_greedy,
    hf_qwen_video_greedy,
    hf_qwen_video_inputs,
    load_hf_qwen_processor,
    load_video,
    tiny_qwen_dir,
    write_video,
)

pytestmark = pytest.mark.e2e

MAX_NEW = 8
QUESTION = "What is in the picture?"
QWEN3 = "tiny-qwen3-vl"
# test_qwen_video.py's Qwen3-VL engine: the same shapes, so the on-disk compile
# cache may serve both.
QWEN3_BUDGET = 32
QWEN3_BUCKETS = "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [8, 32]\n"
TIMESTAMP = re.compile(r"<(\d+(?:\.\d+)?) seconds>")


IMAGE_PART = "{% if part['type'] == 'image' %}"
VIDEO_BRANCH = (
    "{% if part['type'] == 'video' %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'image' %}"
)


def video_chat_template(model_dir: str) -> str:
    """The model's chat template with a video branch beside its image one."""
    template = (Path(model_dir) / "chat_template.jinja").read_text()
    assert IMAGE_PART in template
    return template.replace(IMAGE_PART, VIDEO_BRANCH, 1)


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both servers' ``--allowed-local-media-path``: the videos sent as files."""
    return tmp_path_factory.mktemp("media").resolve()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, media_root: Path
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve_qwen")
    template = root / "chat_template.jinja"
    template.write_text(video_chat_template(tiny_qwen_dir()))
    yield from serve(
        tiny_qwen_dir(),
        root / "server.log",
        "--limit-mm-per-prompt",
        json.dumps({"image": 2, "video": 1}),
        "--chat-template",
        str(template),
        "--allowed-local-media-path",
        str(media_root),
    )


@pytest.fixture(scope="module")
def server_qwen3(
    tmp_path_factory: pytest.TempPathFactory, media_root: Path
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve_qwen3")
    model = tiny_qwen_dir(QWEN3)
    template = root / "chat_template.jinja"
    template.write_text(video_chat_template(model))
    (root / "buckets.yaml").write_text(QWEN3_BUCKETS)
    plugin = {
        "hpu_mm": {
            "graph_mode": "compile",
            "bucketing": {"strategy": "explicit", "file": str(root / "buckets.yaml")},
            "warmup": {"progress_bar": False},
        }
    }
    patch = pytest.MonkeyPatch()
    # Its own counters (/metrics reads every file of the directory), set for
    # its start only; a longer start-up wait for the warmup compilations.
    patch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path_factory.mktemp("metrics")))
    patch.setattr(test_serve, "STARTUP_TIMEOUT_S", 600.0)
    servers = serve(
        model,
        root / "server.log",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        str(QWEN3_BUDGET),
        "--limit-mm-per-prompt",
        json.dumps({"image": 1, "video": 1}),
        "--chat-template",
        str(template),
        "--allowed-local-media-path",
        str(media_root),
        "--additional-config",
        json.dumps(plugin),
    )
    try:
        started = next(servers)
    finally:
        patch.undo()
    yield started
    next(servers, None)  # stop it and check its log


# The static plan's server: small buckets, so warmup compiles a handful of
# graphs (each step shape, logits size, sampler batch and vision patch bucket).
STATIC_BUDGET = 32
STATIC_BUCKETS = "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [8, 32]\n"


@pytest.fixture(scope="module")
def server_static(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve_qwen_static")
    (root / "buckets.yaml").write_text(STATIC_BUCKETS)
    plugin = {
        "hpu_mm": {
            "execution": "static",
            "graph_mode": "compile",  # serve() passes --enforce-eager
            "bucketing": {"strategy": "explicit", "file": str(root / "buckets.yaml")},
            "warmup": {"progress_bar": False},
        }
    }
    patch = pytest.MonkeyPatch()
    patch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path_factory.mktemp("metrics")))
    patch.setattr(test_serve, "STARTUP_TIMEOUT_S", 600.0)
    servers = serve(
        tiny_qwen_dir(),
        root / "server.log",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        str(STATIC_BUDGET),
        "--limit-mm-per-prompt",
        json.dumps({"image": 1}),
        "--additional-config",
        json.dumps(plugin),
    )
    try:
        started = next(servers)
    finally:
        patch.undo()
    yield started
    next(servers, None)


def test_static_plan_serves_hf_identical_answers_compiling_nothing(
    server_static: Server,
) -> None:
    log = server_static.log_path.read_text(errors="replace")
    assert "execution plan: static" in log
    assert "backend aot_eager" in log  # the CPU's default for the static plan
    warmed = server_compiles(server_static)
    assert warmed["warmup"] > 0 and warmed["serving"] == 0, warmed
    _check_chat(server_static, [make_image("gradient", (40, 24))])  # chunked
    _check_chat(server_static, [])
    assert server_compiles(server_static) == warmed


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def video_server(request: pytest.FixtureRequest) -> Server:
    """Each model's server in turn."""
    name = "server" if request.param == "qwen2_5_vl" else "server_qwen3"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def _check_chat(server: Server, images: list[Any]) -> None:
    out = server.greedy_image_chat(images, QUESTION, MAX_NEW)
    prompt = load_hf_qwen_processor(server.model).apply_chat_template(
        chat_messages(QUESTION, len(images)), add_generation_prompt=True, tokenize=False
    )
    want_prompt, want = hf_qwen_greedy(
        server.model, prompt, images, MAX_NEW, add_special_tokens=False
    )
    assert out["prompt_token_ids"] == want_prompt, (out["prompt_token_ids"], prompt)
    assert out["choices"][0]["token_ids"] == want


def test_chat_with_images_of_several_sizes_matches_hf(server: Server) -> None:
    _check_chat(server, [make_image("gradient", (40, 24))])
    _check_chat(
        server,
        [make_image("checkerboard", (64, 48), 1), make_image("stripes", (24, 56))],
    )
    _check_chat(server, [])


def _data_url(data: bytes) -> str:
    return "data:video/x-msvideo;base64," + base64.b64encode(data).decode()


def _video_chat(server: Server, data: bytes | str, max_tokens: int = MAX_NEW) -> Any:
    """A greedy chat completion with one ``video_url`` part: ``data`` as a
    base64 data URL, or a URL as it is."""
    url = data if isinstance(data, str) else _data_url(data)
    content = [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": QUESTION},
    ]
    return server.post(
        "/v1/chat/completions",
        {
            "model": server.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )


def _check_video_chat(server: Server, path: Path, url: str) -> list[str]:
    """The reply to the video at ``path`` sent as ``url`` has HF's prompt ids
    and greedy ids. Returns the prompt's timestamps (Qwen3-VL) after checking
    one per temporal patch, in increasing order."""
    response = _video_chat(server, url)
    assert response.status_code == 200, response.text
    out = response.json()
    messages = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": QUESTION}],
        }
    ]
    processor = load_hf_qwen_processor(server.model)
    prompt = processor.apply_chat_template(
        messages,
        chat_template=video_chat_template(server.model),
        add_generation_prompt=True,
        tokenize=False,
    )
    video = load_video(path)
    want_prompt, want = hf_qwen_video_greedy(
        server.model, prompt, [], [video], MAX_NEW, add_special_tokens=False
    )
    assert out["prompt_token_ids"] == want_prompt, (out["prompt_token_ids"], prompt)
    assert out["choices"][0]["token_ids"] == want
    stamps = TIMESTAMP.findall(processor.tokenizer.decode(out["prompt_token_ids"]))
    if server.model.endswith(QWEN3):
        grid = hf_qwen_video_inputs(
            server.model, prompt, [], [video], add_special_tokens=False
        )["video_grid_thw"]
        assert len(stamps) == int(grid[0, 0]), (stamps, grid)
        seconds = [float(s) for s in stamps]
        assert seconds == sorted(seconds) and seconds[-1] <= video[1]["duration"]
    else:
        assert stamps == []
    return stamps


def test_chat_with_a_video_matches_hf(video_server: Server, tmp_path: Path) -> None:
    path = write_video(tmp_path / "clip.avi", frames=6, size=(48, 32), fps=4.0)
    _check_video_chat(video_server, path, _data_url(path.read_bytes()))


def test_chat_with_a_video_file_matches_hf(
    video_server: Server, media_root: Path, request: pytest.FixtureRequest
) -> None:
    # file:// under --allowed-local-media-path, as vLLM 0.33 loads local media.
    path = media_root / f"{request.node.callspec.id}.avi"
    write_video(path, frames=5, size=(32, 40), fps=4.0, variant=1)
    _check_video_chat(video_server, path, path.as_uri())


def test_qwen3_timestamps_of_a_video_the_loader_samples(
    server_qwen3: Server, tmp_path: Path
) -> None:
    # 40 frames: the loader keeps 32 (uneven indices, metadata
    # do_sample_frames false), the processor takes them as they are and the
    # timestamps come from the loader's frame indices at the video's fps.
    path = write_video(tmp_path / "long.avi", frames=40, size=(48, 32), fps=8.0)
    frames, metadata = load_video(path)
    assert len(frames) == 32 and not metadata["do_sample_frames"]
    stamps = _check_video_chat(server_qwen3, path, _data_url(path.read_bytes()))
    # Each temporal patch's time is the mean of its two frames' times.
    indices = metadata["frames_indices"]
    want = [(indices[i] + indices[i + 1]) / 2 / metadata["fps"] for i in (0, 2)]
    assert [float(s) for s in stamps[:2]] == [round(w, 1) for w in want], stamps


def test_bad_videos_get_400s_that_say_why(server: Server, tmp_path: Path) -> None:
    good = write_video(tmp_path / "ok.avi", frames=6).read_bytes()
    slow = write_video(tmp_path / "slow.avi", frames=6, fps=0.005).read_bytes()
    for data, why in [
        (b"", "video is empty"),
        (b"<html><body>not found</body></html>" * 4, "not a video OpenCV can open"),
        (good[:200], "video"),
        (slow, "video is too long: 1200 s"),
    ]:
        response = _video_chat(server, data)
        assert response.status_code == 400, (why, response.status_code, response.text)
        assert why in response.json()["error"]["message"], response.text
    # Still serving.
    assert _video_chat(server, good, max_tokens=2).status_code == 200


def _metric(server: Server, name: str, labels: str = "") -> float:
    """Sample ``name`` of the server's /metrics whose labels contain ``labels``
    (e.g. ``phase="serving"``), summed; 0.0 when absent."""
    total = 0.0
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        sample, _, label_text = key.partition("{")
        if sample == name and labels in label_text:
            total += float(value)
    return total


def test_qwen3_nothing_compiles_while_serving(server_qwen3: Server) -> None:
    # After the Qwen3-VL video requests above (module order): every shape was
    # compiled at warmup, the videos ran on the patch buckets, no fallback.
    assert (
        _metric(server_qwen3, "vllm_hpu_mm:graph_compiles_total", 'phase="warmup"') > 0
    )
    serving = _metric(
        server_qwen3, "vllm_hpu_mm:graph_compiles_total", 'phase="serving"'
    )
    assert serving == 0
    assert _metric(server_qwen3, "vllm_hpu_mm:vision_patches_total") > 0
    assert _metric(server_qwen3, "vllm_hpu_mm:fallback_buckets_total") == 0
