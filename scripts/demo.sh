#!/usr/bin/env bash
# Demo (run by `make demo` after `make models`): serve the tiny Mllama
# (Llama 3.2 Vision architecture, models/tiny-mllama, random weights) with
# `vllm serve` on 127.0.0.1:$PORT in graph mode (torch.compile per bucket, every
# bucket compiled at warmup), send one chat completion with an image, and print
# the answer and what the run proved (scripts/demo_request.py): the same greedy
# tokens as HF transformers, the warmup line, 0 graph compilations while serving,
# 1 encoder run for the image. The server is always stopped, whatever happens.
#
#   MODEL=models/tiny-llama make demo     the text-only demo
#   MODEL=/path/to/checkpoint make demo   any local checkpoint, the same way
#   HF_CHECK=auto|on|off                  compare with HF transformers (auto: when
#                                         the weights are at most 2 GiB)
#   GRAPH_MODE=eager                      no graphs (the warmup line says it skipped)
#   MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS engine limits (tiny models: 256 and 64, so
#                                         few buckets; other checkpoints: up to 4096
#                                         (the model's positions) and 1024)
#   QUESTION, EXPECT                      the user's message, and a word the answer
#                                         must contain (`make demo` asks the real
#                                         SmolLM2 for the capital of France: Paris)
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8000}
HOST=127.0.0.1
MODEL=${MODEL:-models/tiny-mllama}
GRAPH_MODE=${GRAPH_MODE:-compile}
HF_CHECK=${HF_CHECK:-auto}
DTYPE=${DTYPE:-float32}
STARTUP_TIMEOUT_S=${STARTUP_TIMEOUT_S:-600}
VLLM=.venv/bin/vllm
PY=.venv/bin/python
LOG=$(mktemp -t vllm-demo.XXXXXX.log)
SERVER_PID=

[ -f "$MODEL/config.json" ] || { echo "demo: $MODEL missing; run 'make models'" >&2; exit 1; }
# Small limits keep a tiny model's bucket set small (token buckets 1, 2, 32, 64;
# batch 1, 2), so its warmup compiles every graph within a minute on a CPU; a real
# checkpoint needs room for its chat template and image tokens.
if [ -f "$MODEL/tiny_model_build.json" ]; then
    MAX_MODEL_LEN=${MAX_MODEL_LEN:-256} MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-64}
else  # at most 4096, and never more than the model's own positions
    MAX_MODEL_LEN=${MAX_MODEL_LEN:-$("$PY" -c 'import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
n = [d.get("max_position_embeddings") for d in (c, c.get("text_config") or {})]
print(min([4096] + [int(x) for x in n if x]))' "$MODEL")}
    MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-1024}
fi

stop_server() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=
}
trap stop_server EXIT
trap 'exit 130' INT TERM

echo "demo: starting vllm serve $MODEL on http://$HOST:$PORT, graph mode $GRAPH_MODE (log: $LOG)"
"$VLLM" serve "$MODEL" \
    --host "$HOST" --port "$PORT" \
    --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 2 \
    --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" \
    --limit-mm-per-prompt '{"image": 1}' \
    --additional-config "{\"hpu_mm\": {\"graph_mode\": \"$GRAPH_MODE\", \"warmup\": {\"progress_bar\": false}}}" \
    >"$LOG" 2>&1 &
SERVER_PID=$!

deadline=$((SECONDS + STARTUP_TIMEOUT_S))
until curl -sf "http://$HOST:$PORT/health" >/dev/null 2>&1; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "demo: server exited during startup; log tail:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "demo: server not healthy after ${STARTUP_TIMEOUT_S}s; log tail:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
    sleep 1
done
echo "demo: server healthy after ${SECONDS}s"

status=0
ask=()
[ -z "${QUESTION:-}" ] || ask+=(--question "$QUESTION")
[ -z "${EXPECT:-}" ] || ask+=(--expect "$EXPECT")
"$PY" scripts/demo_request.py "$MODEL" --url "http://$HOST:$PORT" --log "$LOG" \
    --hf-check "$HF_CHECK" "${ask[@]}" || status=$?

stop_server
echo "demo: server stopped"
exit "$status"
