"""scripts/demo_request.py's parts that need no server: the request, the log line,
the /metrics parser (against a real local HTTP server), the HF-check choice.

The whole demo (a real ``vllm serve``) is ``make demo``; these tests keep its
helpers honest between runs.
"""

from __future__ import annotations

import argparse
import base64
import http.server
import importlib.util
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "demo_request", REPO / "scripts" / "demo_request.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_dir(
    tmp_path: Path, *, images: bool, weights_bytes: int = 10, tiny: bool = True
) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"eos_token_id": 2}')
    if tiny:
        (model / "tiny_model_build.json").write_text("{}")
    if images:
        (model / "processor_config.json").write_text("{}")
    with (model / "model.safetensors").open("wb") as fh:
        fh.truncate(weights_bytes)  # sparse: the size is what counts
    return model


def test_image_request_carries_the_picture_and_asks_for_token_ids(
    demo: ModuleType, tmp_path: Path
) -> None:
    from PIL import Image

    request = demo.build_request(str(_model_dir(tmp_path, images=True)))
    assert request["temperature"] == 0 and request["ignore_eos"] is True
    assert request["return_token_ids"] is True
    url = request["messages"][0]["content"][0]["image_url"]["url"]
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert sent.tobytes() == demo.picture().tobytes()  # HF gets the same pixels


def test_text_model_request_has_no_image(demo: ModuleType, tmp_path: Path) -> None:
    request = demo.build_request(str(_model_dir(tmp_path, images=False)))
    assert isinstance(request["messages"][0]["content"], str)


def test_trained_model_answers_the_question_and_stops_at_its_end_of_turn(
    demo: ModuleType, tmp_path: Path
) -> None:
    model = str(_model_dir(tmp_path, images=False, tiny=False))
    request = demo.build_request(model, "What is the capital of France?")
    assert request["messages"][0]["content"] == "What is the capital of France?"
    assert request["ignore_eos"] is False
    assert demo.eos_ids(model) == {2}


def test_an_early_stop_matches_hf_only_up_to_an_end_of_sequence_token(
    demo: ModuleType,
) -> None:
    want = [5, 6, 2, 9, 9]  # HF runs on past the end of turn (eos id 2)
    assert demo.matches_hf(want, want, {2})
    assert demo.matches_hf([5, 6, 2], want, {2})
    assert not demo.matches_hf([5, 6], want, {2})  # stopped, but not at an eos
    assert not demo.matches_hf([5, 7, 2], want, {2})
    assert not demo.matches_hf([], want, {2})


def test_warmup_line_is_the_last_one_in_the_log(
    demo: ModuleType, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    log.write_text(
        "(EngineCore pid=1) INFO 12-01 09:00:00 [warmup.py:90] Warmup skipped: x\n"
        "(EngineCore pid=2) INFO 12-01 09:01:00 [warmup.py:103] Warmup finished in "
        "7.6 s: 2 prefill + 2 decode graphs (8 compilations)\n"
        "INFO 12-01 09:01:01 [api_server.py:1] Starting vLLM server\n"
    )
    line = demo.warmup_line(log)
    assert (
        line == "Warmup finished in 7.6 s: 2 prefill + 2 decode graphs (8 compilations)"
    )
    log.write_text("no such line\n")
    assert demo.warmup_line(log) is None


METRICS = b"""# HELP vllm_hpu_mm:graph_compiles_total Graph compilations.
# TYPE vllm_hpu_mm:graph_compiles_total counter
vllm_hpu_mm:graph_compiles_total{phase="serving"} 0.0
vllm_hpu_mm:graph_compiles_total{phase="warmup"} 8.0
vllm_hpu_mm:encoder_runs_total 3.0
"""


@pytest.fixture
def metrics_url() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(METRICS)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()


def test_metrics_are_read_by_name_and_labels(
    demo: ModuleType, metrics_url: str
) -> None:
    samples = demo.metrics(metrics_url)
    assert samples[demo.SERVING_COMPILES] == 0.0
    assert samples[demo.WARMUP_COMPILES] == 8.0
    assert samples[demo.ENCODER_RUNS] == 3.0


@pytest.mark.parametrize(("mode", "weights"), [("off", 10), ("auto", 3 * 2**30)])
def test_hf_check_is_skipped_as_asked_and_says_so(
    demo: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mode: str,
    weights: int,
) -> None:
    model = _model_dir(tmp_path, images=False, weights_bytes=weights)
    args = argparse.Namespace(model=str(model), hf_check=mode, hf_max_gib=2.0)
    assert demo.hf_check(args, [1, 2], [3]) is True  # a skip is not a failure
    out = capsys.readouterr().out
    assert "[skip]" in out and "HF_CHECK=on" in out
