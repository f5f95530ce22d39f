#!/usr/bin/env bash
# WildFed's TensorRT check on a machine with an NVIDIA GPU, in one run of at most --budget seconds (default 450).
#
#   bash benchmarks/device_check.sh --prepare       # first, where torch is: export the ONNX graphs to .device-check/
#   bash benchmarks/device_check.sh                 # on the GPU machine, from the repository root
#   bash benchmarks/device_check.sh --cpu-dry-run   # the same stages with ONNX Runtime CPU only (TensorRT: SKIP)
#
# Stages, each in its own process with a time box (a stage that fails, raises or runs out of time is reported and
# the next one runs): install (TensorRT 10 and onnxruntime-gpu, each in its own environment, never beside
# onnxruntime-training), probe, build (detector and backbone TensorRT FP16 engines through edge_sdk.inference),
# parity (TensorRT FP16 vs ONNX Runtime CPU on the ENA24 photos: embeddings max |diff| and cosine, detector box
# IoU and score), corrupt (a damaged cached engine is noticed and rebuilt), fallback (TensorRT absent: ONNX Runtime
# with the reason logged), bench (embeddings/s and detector images/s: TensorRT FP16, ORT CUDA, ORT CPU).
# Writes device_check.json, device_check.md and device_check.log to $OUT (else --out, else ./device-check-out).
# Exit: 0 pass; 1 a check failed (parity, rebuild, ...) or a stage raised or timed out; 2 usage; 3 nothing failed
# but TensorRT was not exercised (not installable, no GPU). See docs/inference.md, "Checking TensorRT on a GPU".
#
# Options:
#   --prepare          export the ONNX files (WildFed's exporters; needs torch) to --onnx-dir, print the run command
#   --cpu-dry-run      no install, no TensorRT, no ORT CUDA: exercises every stage's plumbing on a CPU machine
#   --onnx-dir DIR     the prepared ONNX files (default .device-check/onnx)
#   --wheels DIR       offline install: wheels to add (default .device-check/wheels; onnxruntime_gpu-* in its own
#                      environment, the rest beside the interpreter's packages)
#   --python PY        the interpreter (default python3; --prepare and --cpu-dry-run: .venv/bin/python if present)
#   --install MODE     auto (online when pip reaches its index, else offline), online, offline or none
#   --budget S         seconds for all stages (default 450; the report follows)
#   --photos N         ENA24 photos used (default 21, all)
#   --out DIR          where the summary goes (default $OUT, else ./device-check-out)
#   --keep-work        keep the work folder (engines, reference outputs; always kept when it holds environments)
# Environment: WILDFED_DC_TRT_SPEC (default tensorrt-cu<driver CUDA major>>=10.13,<11), WILDFED_DC_ORT_GPU_SPEC
# (default onnxruntime-gpu[cuda,cudnn]).

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HELPER="$ROOT/benchmarks/_device_check.py"
REPORT="$ROOT/benchmarks/_device_report.py"
MODE=device
PY=""
ONNX_DIR="$ROOT/.device-check/onnx"
WHEELS="$ROOT/.device-check/wheels"
INSTALL=auto
BUDGET=450
PHOTOS=21
OUT_DIR="${OUT:-$ROOT/device-check-out}"
KEEP_WORK=0

usage() { sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
value() {
  if [ $# -lt 2 ] || [ -z "$2" ]; then echo "device_check.sh: $1 needs a value (see --help)" >&2; exit 2; fi
}

while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) MODE=prepare ;;
    --cpu-dry-run) MODE="dry-run" ;;
    --onnx-dir) value "$@"; ONNX_DIR="$2"; shift ;;
    --wheels) value "$@"; WHEELS="$2"; shift ;;
    --python) value "$@"; PY="$2"; shift ;;
    --install) value "$@"; INSTALL="$2"; shift ;;
    --budget) value "$@"; BUDGET="$2"; shift ;;
    --photos) value "$@"; PHOTOS="$2"; shift ;;
    --out) value "$@"; OUT_DIR="$2"; shift ;;
    --keep-work) KEEP_WORK=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "device_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$INSTALL" in auto | online | offline | none) ;; *) echo "device_check.sh: --install auto|online|offline|none" >&2; exit 2 ;; esac
case "$BUDGET$PHOTOS" in *[!0-9]*) echo "device_check.sh: --budget and --photos take whole numbers" >&2; exit 2 ;; esac
if [ -z "$PY" ]; then
  if [ "$MODE" != device ] && [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi

START=$(date +%s)
DEADLINE=$((START + BUDGET))
log() { printf '[device-check %4ss] %s\n' "$(($(date +%s) - START))" "$*"; }

# ---- --prepare ------------------------------------------------------------------------------------------------------
prepare() {
  log "prepare: exporting the detector and backbone ONNX graphs with $PY (needs torch and the weights)"
  PYTHONPATH="$ROOT" "$PY" "$HELPER" prepare --dest "$ONNX_DIR" || { log "prepare: FAILED"; return 1; }
  local tracked onnx rel
  tracked=$(cd "$ROOT" && git ls-files -z 2>/dev/null | du -cb --files0-from=- 2>/dev/null | tail -n1 | cut -f1)
  onnx=$(du -sb "$ONNX_DIR" | cut -f1)
  rel="${ONNX_DIR#"$ROOT"/}"
  log "prepare: $rel holds $((onnx / 1048576)) MiB; tracked files $((${tracked:-0} / 1048576)) MiB"
  if [ "$ONNX_DIR" = "$ROOT/.device-check/onnx" ]; then
    log "prepare: on the GPU machine, from the repository root, with .device-check/ (ignored by git) copied along:"
    log "  bash benchmarks/device_check.sh"
  else
    log "prepare: copy $ONNX_DIR to the GPU machine; there, from the repository root:"
    log "  bash benchmarks/device_check.sh --onnx-dir <that folder>"
  fi
}

if [ "$MODE" = prepare ]; then
  prepare
  exit $?
fi

# ---- stages ---------------------------------------------------------------------------------------------------------
if [ ! -f "$ONNX_DIR/manifest.json" ]; then
  echo "device_check.sh: no $ONNX_DIR/manifest.json: run 'bash benchmarks/device_check.sh --prepare' where torch is" >&2
  exit 2
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/wildfed-device-check.XXXXXX")
STAGES="$WORK/stages"
mkdir -p "$STAGES" "$OUT_DIR"
PY_A="$PY" PATH_A="" PY_B="" PATH_B="" ORTCUDA_SKIP=""

skip_stage() { printf '%s\n' "$2" >"$STAGES/$1.skip"; log "stage $1: SKIP ($2)"; }
status_of() { sed -n 's/^ *"status": "\([a-z ]*\)".*/\1/p' "$STAGES/$1.json" 2>/dev/null | head -n1; }

# run_stage NAME CLI_STAGE BOX PYTHON PYTHONPATH_EXTRA [ARGS...]: one helper stage under `timeout`
run_stage() {
  local name=$1 cli=$2 box=$3 pybin=$4 extra=$5 left t0 rc dry=()
  shift 5
  left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 10 ]; then skip_stage "$name" "not started: the run's ${BUDGET} s budget was spent"; return; fi
  [ "$box" -gt "$left" ] && box=$left
  [ "$MODE" = dry-run ] && dry=(--dry-run)
  log "stage $name: start (time box ${box} s, $pybin)"
  t0=$(date +%s)
  env PYTHONPATH="${extra:+$extra:}$ROOT" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    timeout -k 5 "$box" "$pybin" "$HELPER" "$cli" --result "$STAGES/$name.json" --work "$WORK" \
    --onnx-dir "$ONNX_DIR" --photos "$PHOTOS" --deadline "$((t0 + box - 5))" "${dry[@]}" "$@"
  rc=$?
  echo "$rc $(($(date +%s) - t0)) $box" >"$STAGES/$name.meta"
  local said
  said=$(status_of "$name" | tr '[:lower:]' '[:upper:]')
  case "$rc" in 124 | 137) said="TIMED OUT" ;; esac
  log "stage $name: ${said:-NO RESULT} (exit $rc) after $(($(date +%s) - t0)) s"
}

# step NAME END CMD...: one install step under `timeout` until the epoch second END, its output in the work folder;
# a row in install.tsv
step() {
  local name=$1 end=$2 t0 rc
  shift 2
  t0=$(date +%s)
  if [ "$end" -le "$t0" ]; then
    echo "not started: the install's time box was spent" >"$WORK/install-$name.log"
    rc=124
  else
    timeout -k 5 "$((end - t0))" "$@" >"$WORK/install-$name.log" 2>&1
    rc=$?
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" \
    "$(tail -n 2 "$WORK/install-$name.log" | tr '\t\n' '  ' | cut -c1-240)" >>"$STAGES/install.tsv"
  log "install $name: exit $rc after $(($(date +%s) - t0)) s"
  [ "$rc" -eq 0 ] || tail -n 5 "$WORK/install-$name.log" | sed 's/^/    /'
  return "$rc"
}
note() { printf '%s\t-\t0\t%s\n' "$1" "$2" >>"$STAGES/install.tsv"; log "install $1: $2"; }

# imports PYTHON PYTHONPATH_EXTRA CODE: run a short Python check in an environment
imports() { env PYTHONPATH="${2:+$2:}$ROOT" timeout 60 "$1" -c "$3" >/dev/null 2>&1; }
HAS_CUDA_EP='import onnxruntime as o, sys; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())'

install_online() {
  local end=$1 major trt ort_gpu
  major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n1)
  trt="${WILDFED_DC_TRT_SPEC:-tensorrt-cu${major:-12}>=10.13,<11}"  # TensorRT 11 removed BuilderFlag.FP16
  ort_gpu="${WILDFED_DC_ORT_GPU_SPEC:-onnxruntime-gpu[cuda,cudnn]}"
  local pip=(-m pip install -q --disable-pip-version-check --no-cache-dir)
  if imports "$PY" "" 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    PATH_A="$WORK/site-a"  # the interpreter has CUDA torch: keep it, add TensorRT beside it
    note env-a "$PY with its own torch (CUDA) + $PATH_A"
    (step tensorrt "$end" "$PY" "${pip[@]}" --target "$PATH_A" "$trt") &
  else
    PY_A="$WORK/venv-a/bin/python"
    note env-a "virtual environment $WORK/venv-a: wildfed[edge,torch], onnx, onnxruntime, $trt"
    # the gateway's own install; where it cannot install (e.g. its Python is too old), what the stages import
    (step venv-a "$end" "$PY" -m venv "$WORK/venv-a" &&
      { step gateway "$end" "$PY_A" "${pip[@]}" "${ROOT}[edge,torch]" onnx onnxruntime ||
        step runtime "$end" "$PY_A" "${pip[@]}" numpy pillow onnx onnxruntime torch; } &&
      step tensorrt "$end" "$PY_A" "${pip[@]}" "$trt") &
  fi
  (if step venv-b "$end" "$PY" -m venv "$WORK/venv-b"; then
    step ort-gpu "$end" "$WORK/venv-b/bin/python" "${pip[@]}" numpy pillow onnx "$ort_gpu"
  else  # no venv module here: beside the interpreter's packages, in their own folder
    step ort-gpu "$end" "$PY" "${pip[@]}" --target "$WORK/site-b" "$ort_gpu"
  fi) &
  wait
  if [ -x "$WORK/venv-b/bin/python" ]; then PY_B="$WORK/venv-b/bin/python"; else PY_B="$PY" PATH_B="$WORK/site-b"; fi
  note env-b "$PY_B${PATH_B:+ + $PATH_B}: $ort_gpu"
}

install_offline() {
  local end=$1 wheels_a=() wheels_b=() w
  local pip=(-m pip install -q --disable-pip-version-check --no-index --no-deps --no-cache-dir)
  for w in "$WHEELS"/*.whl; do
    [ -e "$w" ] || continue
    case "$(basename "$w")" in onnxruntime_gpu-*) wheels_b+=("$w") ;; *) wheels_a+=("$w") ;; esac
  done
  if [ ${#wheels_a[@]} -gt 0 ]; then
    PATH_A="$WORK/site-a"
    step wheels-a "$end" "$PY" "${pip[@]}" --target "$PATH_A" "${wheels_a[@]}"
  fi
  if [ ${#wheels_b[@]} -gt 0 ]; then
    PY_B="$PY" PATH_B="$WORK/site-b"
    step wheels-b "$end" "$PY" "${pip[@]}" --target "$PATH_B" "${wheels_b[@]}"
  fi
  [ ${#wheels_a[@]} -gt 0 ] || [ ${#wheels_b[@]} -gt 0 ] || note wheels "none in $WHEELS: $PY's own packages are used"
}

install() {
  local mode=$INSTALL box=240
  if [ "$mode" = auto ]; then
    if timeout 30 "$PY" -m pip index versions pip --retries 0 --timeout 8 --disable-pip-version-check \
      >/dev/null 2>&1; then mode=online; else mode=offline; fi
    note mode "$mode (pip $([ "$mode" = online ] && echo reaches || echo does not reach) its package index)"
  fi
  [ "$mode" = offline ] && box=60
  [ $((DEADLINE - $(date +%s) - 60)) -lt "$box" ] && box=$((DEADLINE - $(date +%s) - 60))
  case "$mode" in
    online) install_online "$(($(date +%s) + box))" ;;
    offline) install_offline "$(($(date +%s) + box))" ;;
    none) note mode "none: $PY's own packages are used" ;;
  esac
  if ! imports "$PY_A" "$PATH_A" 'import numpy, PIL, onnx, onnxruntime'; then
    note env-a "$PY_A lacks numpy, pillow, onnx or onnxruntime (its install did not finish): the stages use $PY"
    PY_A="$PY" PATH_A=""
  fi
  if imports "$PY_A" "$PATH_A" 'import tensorrt'; then note tensorrt "importable in environment A"; else
    note tensorrt "NOT importable in environment A: the TensorRT stages will skip"
  fi
  if [ -n "$PY_B" ] && ! imports "$PY_B" "$PATH_B" "$HAS_CUDA_EP"; then
    ORTCUDA_SKIP="environment B has no ONNX Runtime with a CUDA provider (see the install step ort-gpu or wheels-b)"
    PY_B=""
  fi
  if [ -z "$PY_B" ] && imports "$PY_A" "$PATH_A" "$HAS_CUDA_EP"; then PY_B="$PY_A" PATH_B="$PATH_A"; fi
  [ -n "$PY_B" ] || ORTCUDA_SKIP="${ORTCUDA_SKIP:-no ONNX Runtime with a CUDA provider here (onnxruntime-gpu not installed; see the install stage)}"
}

main() {
  log "WildFed device check ($MODE), budget ${BUDGET} s, work folder $WORK, summary to $OUT_DIR"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
    sed 's/^/[device-check] GPU: /'
  log "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1)"
  if [ "$MODE" = device ]; then
    install
  else
    note mode "--cpu-dry-run: nothing installed; $PY as it is"
    ORTCUDA_SKIP="--cpu-dry-run: ORT CUDA is not exercised"
  fi
  run_stage probe probe 45 "$PY_A" "$PATH_A"
  run_stage build build 150 "$PY_A" "$PATH_A"
  run_stage parity parity 60 "$PY_A" "$PATH_A"
  run_stage corrupt corrupt 120 "$PY_A" "$PATH_A"
  run_stage fallback fallback 30 "$PY_A" "$PATH_A"
  run_stage bench bench 75 "$PY_A" "$PATH_A" --engines trt,ort-cpu
  if [ -n "$PY_B" ]; then
    run_stage bench-ortcuda bench 45 "$PY_B" "$PATH_B" --engines ort-cuda
  else
    skip_stage bench-ortcuda "$ORTCUDA_SKIP"
  fi
  log "report (all stages done in $(($(date +%s) - START)) s)"
  PYTHONPATH="$ROOT" "$PY" "$REPORT" --work "$WORK" --out "$OUT_DIR" --mode "$MODE" \
    --seconds "$(($(date +%s) - START))" --budget "$BUDGET"
  local rc=$?
  log "exit $rc; summary in $OUT_DIR/device_check.md and device_check.json, this log in device_check.log"
  if [ "$KEEP_WORK" = 1 ] || [ -d "$WORK/venv-a" ] || [ -d "$WORK/venv-b" ]; then
    log "work folder kept (engines, environments; deleting GBs of files takes minutes): $WORK"
  else
    rm -rf "$WORK"
  fi
  return "$rc"
}

main 2>&1 | tee "$OUT_DIR/device_check.log"
exit "${PIPESTATUS[0]}"
