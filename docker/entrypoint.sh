#!/usr/bin/env bash
# Container start: model repository -> TensorRT engines for this GPU (if missing) -> tritonserver.
#
# Environment (defaults in brackets):
#   S3FLOW_CHECKPOINT           S3Gen checkpoint (.safetensors/.pt: flow.* and mel2wav.*) mounted in the
#                               container; empty: seeded random weights of S3FLOW_RANDOM_SIZE [full] (a demo)
#   S3FLOW_GPU_BACKEND          tensorrt | torch [tensorrt]
#   S3FLOW_TORCH_DTYPE          torch backend estimator dtype: fp32 | bf16 | fp16 [bf16]
#   S3FLOW_ESTIMATOR_PRECISION  auto | fp16 | fp32 [auto: fp16 if it passes its parity check, else fp32]
#   S3FLOW_FALLBACK_TO_TORCH    1: a model whose engine cannot be built is served by the torch backend [1]
#   S3FLOW_REPOSITORY_ARGS      extra scripts/build_repository.py flags (batching, limits) []
#   S3FLOW_STATE                where the repository, random checkpoint and engines live [/var/lib/s3flow]
#   S3FLOW_CUDA_POOL_BYTES      CUDA memory pool per GPU for GPU tensors between models [2147483648]
#   S3FLOW_DRAIN_DEADLINE_S     on SIGTERM: how long utterances in flight may take to finish while new ones
#                               are refused (python -m s3flow.server.drain; docs/reliability.md, "Rollout") [60]
#   S3FLOW_DRAIN_FILE           the drain flag file the solver checks; the k8s preStop hook and readiness
#                               probe use the same path [/tmp/s3flow-draining]
#   S3FLOW_EXIT_TIMEOUT_S       after the drain: how long tritonserver waits for requests still open [15]
#   S3FLOW_ADMIN_KEY_FILE       a file holding the admin key (a mounted Secret): every API category a streaming
#                               client does not need then answers only calls with header s3flow-admin-key
#                               (python -m s3flow.server.access; docs/security.md); empty: all open []
#   S3FLOW_TENANTS              1: voices per tenant, named by the s3flow-tenant header that the router sets
#                               after authenticating the client (docs/security.md) [0]
#   S3FLOW_VOICE_KEY_FILE       a file holding the fleet's voice-id key (a mounted Secret): ids are keyed
#                               digests, the same on every server with the key []
#   S3FLOW_SNAPSHOT_KEY_FILE    a file holding the fleet's snapshot key: answers carry the stream's sealed state,
#                               and a resume on any server with the key costs one chunk (s3flow.serving.keys);
#                               unset: the voice key stands in; neither: resumes replay the utterance []
# Arguments are appended to the tritonserver command line.
set -euo pipefail
cd "${S3FLOW_HOME:-/opt/s3flow}"
STATE=${S3FLOW_STATE:-/var/lib/s3flow}
REPO=$STATE/model_repository
ENGINES=$STATE/engines
BACKEND=${S3FLOW_GPU_BACKEND:-tensorrt}
DTYPE=${S3FLOW_TORCH_DTYPE:-bf16}
mkdir -p "$STATE" "$ENGINES"
log() { echo "[s3flow $(date +%H:%M:%S)] $*"; }

CKPT=${S3FLOW_CHECKPOINT:-}
if [ -n "$CKPT" ]; then
    [ -f "$CKPT" ] || { echo "S3FLOW_CHECKPOINT=$CKPT does not exist" >&2; exit 1; }
    WEIGHTS=(--checkpoint "$CKPT")
    WEIGHTS_ID=$(stat -c '%n %s %Y' "$CKPT")
else  # build_repository.py writes seeded random flow and vocoder checkpoints under $STATE/checkpoints
    SIZE=${S3FLOW_RANDOM_SIZE:-full}
    log "no S3FLOW_CHECKPOINT: seeded random weights ($SIZE; a demo: the output is not speech)"
    WEIGHTS=(--size "$SIZE" --seed 0)
    WEIGHTS_ID="random $SIZE"
    CKPT=$STATE/checkpoints/s3gen_random_${SIZE}_seed0.safetensors
fi

build_repository() {  # $1: gpu backend; skipped when the same weights, settings and code built it before
    local stamp
    stamp="$WEIGHTS_ID $1 $DTYPE ${S3FLOW_REPOSITORY_ARGS:-} $(find contract python_backend client scripts -name '*.py' | sort | xargs cat | sha256sum | cut -c1-16)"
    if [ -f "$REPO/.s3flow-stamp" ] && [ "$(cat "$REPO/.s3flow-stamp")" = "$stamp" ]; then
        log "model repository up to date ($REPO, $1)"
        return
    fi
    log "building the model repository ($1) ..."
    # shellcheck disable=SC2086
    python3 scripts/build_repository.py --target gpu --gpu-backend "$1" --torch-dtype "$DTYPE" \
        "${WEIGHTS[@]}" --output "$REPO" ${S3FLOW_REPOSITORY_ARGS:-}
    echo "$stamp" > "$REPO/.s3flow-stamp"
}

build_repository "$BACKEND"
if [ "$BACKEND" = tensorrt ]; then
    log "TensorRT engines for this GPU (cached in $ENGINES) ..."
    # a model whose engine cannot be built (or fails its check) is switched to the torch backend in place,
    # unless S3FLOW_FALLBACK_TO_TORCH=0; a later start that builds it switches it back
    FALLBACK=torch
    [ "${S3FLOW_FALLBACK_TO_TORCH:-1}" = 1 ] || FALLBACK=none
    python3 scripts/build_engines.py --repository "$REPO" --cache "$ENGINES" --checkpoint "$CKPT" \
        --estimator-precision "${S3FLOW_ESTIMATOR_PRECISION:-auto}" --fallback "$FALLBACK" --torch-dtype "$DTYPE" \
        || { log "build_engines.py failed (see above; S3FLOW_FALLBACK_TO_TORCH=$FALLBACK): not starting"; exit 1; }
fi

POOL=${S3FLOW_CUDA_POOL_BYTES:-2147483648}
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
POOL_ARGS=()
for ((i = 0; i < GPUS; i++)); do POOL_ARGS+=("--cuda-memory-pool-byte-size=$i:$POOL"); done
ACCESS_ARGS=()
if [ -n "${S3FLOW_ADMIN_KEY_FILE:-}" ]; then
    mapfile -t ACCESS_ARGS < <(python3 -m s3flow.server.access flags "$S3FLOW_ADMIN_KEY_FILE")
    [ "${#ACCESS_ARGS[@]}" -gt 0 ] || { log "S3FLOW_ADMIN_KEY_FILE=$S3FLOW_ADMIN_KEY_FILE: no usable key"; exit 1; }
    log "API categories other than health, metadata and inference need the admin key"
fi
if [ "${S3FLOW_TENANTS:-0}" = 1 ]; then  # s3flow.server.access.tenant_flags
    ACCESS_ARGS+=(--grpc-header-forward-pattern=s3flow-tenant --http-header-forward-pattern=s3flow-tenant)
    log "voices are per tenant (header s3flow-tenant)"
fi
if [ -n "${S3FLOW_VOICE_KEY_FILE:-}" ]; then  # read by the python models (s3flow.serving.keys)
    [ -s "$S3FLOW_VOICE_KEY_FILE" ] || { log "S3FLOW_VOICE_KEY_FILE=$S3FLOW_VOICE_KEY_FILE is empty"; exit 1; }
    export S3FLOW_VOICE_KEY_FILE
fi
if [ -n "${S3FLOW_SNAPSHOT_KEY_FILE:-}" ]; then
    [ -s "$S3FLOW_SNAPSHOT_KEY_FILE" ] || { log "S3FLOW_SNAPSHOT_KEY_FILE=$S3FLOW_SNAPSHOT_KEY_FILE is empty"; exit 1; }
    export S3FLOW_SNAPSHOT_KEY_FILE
fi
log "starting tritonserver on $GPUS GPU(s) under the drain supervisor"
# SIGTERM (docker stop, Kubernetes) goes to the supervisor: it drains (new sequences refused, those in flight
# finish, up to S3FLOW_DRAIN_DEADLINE_S), then stops tritonserver
export S3FLOW_DRAIN_FILE=${S3FLOW_DRAIN_FILE:-/tmp/s3flow-draining}
# allocations of 1 MiB and more are mapped one by one, so what a long utterance needed goes back to the system
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1048576}
# a python stub that dies (Triton restarts none) has its model reloaded by the supervisor (s3flow.server.healing):
# explicit model control, every model loaded at start
exec python3 -m s3flow.server.drain supervise --deadline-s "${S3FLOW_DRAIN_DEADLINE_S:-60}" \
    --drain-file "$S3FLOW_DRAIN_FILE" --metrics-url http://127.0.0.1:8002/metrics \
    --heal-http-url http://127.0.0.1:8000 -- \
    tritonserver --model-repository="$REPO" --model-control-mode=explicit --load-model='*' --disable-auto-complete-config \
    --http-port=8000 --grpc-port=8001 --metrics-port=8002 --allow-metrics=true --allow-gpu-metrics=true \
    --backend-config=python,shm-default-byte-size=67108864 --backend-config=python,shm-region-prefix-name=s3flow_triton \
    --backend-config=python,shm-growth-byte-size=67108864 \
    "${POOL_ARGS[@]}" "${ACCESS_ARGS[@]}" --exit-timeout-secs="${S3FLOW_EXIT_TIMEOUT_S:-15}" "$@"
