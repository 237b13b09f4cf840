#!/usr/bin/env bash
# Demo (run by `make demo` after `make models`): serve models/tiny-llama with
# `vllm serve` on 127.0.0.1:$PORT, send one chat completion, print the answer,
# then stop the server. The server is always stopped, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8000}
HOST=127.0.0.1
MODEL=models/tiny-llama
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

REQUEST=$(cat <<EOF
{
  "model": "$MODEL",
  "messages": [{"role": "user", "content": "Hello! Write one sentence about the sea."}],
  "max_tokens": 32,
  "temperature": 0
}
EOF
)
echo "demo: POST /v1/chat/completions"
echo "$REQUEST"
curl -sS --fail-with-body -H "Content-Type: application/json" \
    -d "$REQUEST" "http://$HOST:$PORT/v1/chat/completions" | "$PY" -m json.tool

stop_server
echo "demo: server stopped"
