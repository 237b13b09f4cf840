#!/usr/bin/env bash
# Demo (run by `make demo` after `make models`): serve the tiny Mllama
# (Llama 3.2 Vision architecture, models/tiny-mllama) with `vllm serve` on
# 127.0.0.1:$PORT, send one chat completion with an image (scripts/demo_request.py),
# print the answer, then stop the server. The server is always stopped, whatever
# happens. MODEL=models/tiny-llama runs the text-only demo.
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8000}
HOST=127.0.0.1
MODEL=${MODEL:-models/tiny-mllama}
STARTUP_TIMEOUT_S=${STARTUP_TIMEOUT_S:-180}
VLLM=.venv/bin/vllm
PY=.venv/bin/python
LOG=$(mktemp -t vllm-demo.XXXXXX.log)
SERVER_PID=

[ -f "$MODEL/config.json" ] || { echo "demo: $MODEL missing; run 'make models'" >&2; exit 1; }

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

echo "demo: starting vllm serve $MODEL on http://$HOST:$PORT (log: $LOG)"
"$VLLM" serve "$MODEL" \
    --host "$HOST" --port "$PORT" \
    --dtype float32 --max-model-len 512 --enforce-eager --max-num-seqs 8 \
    --limit-mm-per-prompt '{"image": 2}' \
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

echo "demo: POST /v1/chat/completions"
REQUEST=$("$PY" scripts/demo_request.py "$MODEL")
curl -sS --fail-with-body -H "Content-Type: application/json" \
    -d "$REQUEST" "http://$HOST:$PORT/v1/chat/completions" | "$PY" -m json.tool

stop_server
echo "demo: server stopped"
