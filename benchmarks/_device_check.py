"""The Python stages of ``benchmarks/device_check.sh`` (run by it, one process per stage; see that script).

    python benchmarks/_device_check.py prepare --dest .device-check/onnx          # here, where torch is
    python benchmarks/_device_check.py STAGE --result FILE --work DIR --onnx-dir DIR [--deadline EPOCH]
                                             [--photos N] [--dry-run] [--engines trt,ort-cpu|ort-cuda]

Stages: ``probe`` (versions, GPU, the prepared files' digests), ``build``, ``parity`` and ``corrupt``
(``_device_trt.py``: TensorRT FP16 engines through ``edge_sdk.inference``), ``bench`` (embeddings/s and detector
images/s per engine at the profiles' batches), ``fallback`` (``open_engine`` on this machine with TensorRT absent
names its reason and runs ONNX Runtime). Each writes its result file (``_device_common.Stage``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _device_common import (DETECT_BATCHES, EMBED_BATCHES, MANIFEST, LogCapture,  # noqa: E402
                            Stage, crops, load_manifest, measure, photos, sha256, tile)


def prepare(dest: Path, backbone: str | None, input_size: int | None) -> int:
    """Export (or take from WildFed's cache) the detector's and the backbone's ONNX graphs with WildFed's own
    exporters and copy them to ``dest`` with a manifest (SHA-256, backbone id, input size). Needs torch."""
    from edge_sdk.inference.detector import DETECTOR_ID, detector_onnx
    from edge_sdk.inference.embedder import embedder_onnx, onnx_backbone_id
    from shared.models.backbone import DEFAULT_BACKBONE, DEFAULT_INPUT_SIZE, get_variant

    variant = get_variant(backbone or DEFAULT_BACKBONE)
    size = int(input_size or DEFAULT_INPUT_SIZE)
    dest.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for role, source in (("detector", detector_onnx()), ("backbone", embedder_onnx(size, variant))):
        target = dest / f"{role}.onnx"
        shutil.copyfile(source, target)
        manifest[role] = {"file": target.name, "source": source.name, "sha256": sha256(target),
                          "bytes": target.stat().st_size}
        print(f"prepare: {role}: {source} -> {target} ({target.stat().st_size / 2**20:.1f} MiB)")
    manifest["detector"]["detector_id"] = DETECTOR_ID
    manifest["backbone"].update(backbone=variant.name, input_size=size,
                                backbone_id=onnx_backbone_id(dest / "backbone.onnx"))
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"prepare: wrote {dest / MANIFEST}")
    return 0


def probe(stage: Stage, args: argparse.Namespace) -> None:
    """Versions and providers of this interpreter, the GPU, and the prepared files' digests."""
    manifest = load_manifest(args.onnx_dir)
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable, "machine": platform.machine(),
                  "cpus": os.cpu_count()}
    for module in ("numpy", "PIL", "onnx", "onnxruntime", "torch", "tensorrt"):
        try:
            mod = importlib.import_module(module)
            info[module] = str(getattr(mod, "__version__", "?"))
        except Exception as exc:  # an absent or broken package is what the probe reports
            info[module] = f"absent ({type(exc).__name__}: {exc})"
    try:
        import onnxruntime

        info["onnxruntime_providers"] = onnxruntime.get_available_providers()
    except Exception:
        pass
    if "torch" in sys.modules:
        import torch

        info["torch_cuda"] = bool(torch.cuda.is_available())
        if info["torch_cuda"]:
            info["torch_device"] = torch.cuda.get_device_name(0)
    from edge_sdk.inference.engines import probe_gpu

    gpu = probe_gpu()
    info["gpu"] = None if gpu is None else {"name": gpu.name, "compute_capability": gpu.compute_capability}
    if shutil.which("ldconfig"):  # TensorRT's own libraries, wherever a system install put them
        proc = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=20, check=False)
        info["libnvinfer"] = sorted({ln.split("=>")[-1].strip() for ln in proc.stdout.splitlines()
                                     if "libnvinfer.so" in ln}) or "not in the linker cache"
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
        info["nvidia_smi"] = proc.stdout.strip()
    stage.data(environment=info, manifest=manifest)
    for key, value in info.items():
        print(f"  {key}: {value}")
    for role in ("detector", "backbone"):
        entry = manifest[role]
        stage.check(f"{role} ONNX file arrived intact", sha256(args.onnx_dir / entry["file"]) == entry["sha256"],
                    entry["file"], "SHA-256 equals the manifest's")
    stage.check("photos", len(photos(args.photos)) > 0, f"{len(photos(args.photos))} ENA24 photos")
    stage.finish("info" if all(c["ok"] for c in stage.doc["checks"]) else "fail",
                 f"GPU {info['gpu']['name'] if info['gpu'] else 'none'}; TensorRT {info['tensorrt']}; "
                 f"ONNX Runtime {info['onnxruntime']}")


def bench(stage: Stage, args: argparse.Namespace) -> None:
    """Embeddings/s (backbone engine call on a (B, 3, S, S) batch of real crops, host to host) and detector
    engine images/s, per engine and batch; rows are written as they are measured."""
    import numpy as np
    from _device_trt import open_trt, trt_unavailable

    from edge_sdk.inference.detector import detector_onnx, preprocess
    from edge_sdk.inference.embedder import embedder_onnx
    from edge_sdk.inference.engines import OrtEngine

    manifest = load_manifest(args.onnx_dir)
    size, variant = manifest["backbone"]["input_size"], manifest["backbone"]["backbone"]
    capture = LogCapture()
    images = photos(args.photos)
    x_embed = crops(images, size)
    x_detect = np.stack([preprocess(im)[0] for im in images])
    engines: dict[str, dict] = {"backbone": {}, "detector": {}}
    skipped: dict[str, str] = {}
    wanted = args.engines.split(",")
    if "ort-cpu" in wanted:
        engines["backbone"]["ort-cpu"] = OrtEngine(embedder_onnx(size, variant), device="cpu")
        engines["detector"]["ort-cpu"] = OrtEngine(detector_onnx(), device="cpu")
    if "ort-cuda" in wanted:
        import onnxruntime

        if hasattr(onnxruntime, "preload_dlls"):
            onnxruntime.preload_dlls()  # CUDA and cuDNN from the nvidia-* wheels where they are installed
        backbone_cuda = OrtEngine(embedder_onnx(size, variant), device="cuda")
        if backbone_cuda.name == "ort-cuda":
            engines["backbone"]["ort-cuda"] = backbone_cuda
            engines["detector"]["ort-cuda"] = OrtEngine(detector_onnx(), device="cuda")
        else:
            skipped["ort-cuda"] = (f"the CUDA provider of ONNX Runtime {onnxruntime.__version__} did not load "
                                   f"(listed: {onnxruntime.get_available_providers()}; no GPU, or its CUDA / cuDNN "
                                   "libraries are missing: see the log)")
    if "trt" in wanted:
        reason = trt_unavailable(args, need_engines=True)
        if reason is None:
            embedder, detector, _ = open_trt(manifest, capture)
            engines["backbone"]["tensorrt-fp16"], engines["detector"]["tensorrt-fp16"] = \
                embedder.engine, detector.engine
        else:
            skipped["tensorrt-fp16"] = reason
    for name, why in skipped.items():
        print(f"  SKIP {name}: {why}")
    stage.data(skipped=skipped, rows=[], input_size=size, backbone=variant, threads="ONNX Runtime's default")
    rows = stage.doc["data"]["rows"]
    plan = [("backbone", b, x_embed) for b in EMBED_BATCHES] + [("detector", b, x_detect) for b in DETECT_BATCHES]
    for model, batch, x in plan:
        for name, engine in engines[model].items():
            if time.time() > args.deadline - 3:
                stage.finish("info", "stopped at its time box; rows so far are kept")
                return
            xb = tile(x, batch)
            if engine.max_batch is not None and batch > engine.max_batch:
                continue
            timing = measure(lambda e=engine, xb=xb: e.run(xb), batch, deadline=args.deadline - 3,
                             max_seconds=2.0 if model == "backbone" else 3.0)
            if timing is None:
                print(f"  {model:8s} {name:14s} batch {batch:3d}: not timed (its time box ends)", flush=True)
                continue
            row = {"model": model, "engine": name, "batch": batch, **timing}
            rows.append(row)
            stage.write()
            unit = "embeddings/s" if model == "backbone" else "images/s"
            print(f"  {model:8s} {name:14s} batch {batch:3d}: {row['per_s']:9.1f} {unit} "
                  f"(median {row['median_s'] * 1e3:.2f} ms, {row['repeats']} repeats)", flush=True)
    ran = sorted({r["engine"] for r in rows})
    stage.finish("info" if rows else "skip",
                 f"timed {', '.join(ran) or 'nothing'}" + (f"; skipped {', '.join(skipped)}" if skipped else ""))


def fallback(stage: Stage, args: argparse.Namespace) -> None:
    """``open_engine(prefer="auto")`` on this machine with ``tensorrt`` made unimportable: ONNX Runtime runs, and
    the log line names the reason (WARNING when a GPU is present, INFO when there is none)."""
    sys.modules["tensorrt"] = None  # type: ignore[assignment]  # as on a gateway without TensorRT
    import numpy as np

    from edge_sdk.inference.embedder import DEFAULT_MAX_BATCH, embedder_onnx, engine_slot
    from edge_sdk.inference.engines import OrtEngine, open_engine, probe_gpu

    manifest = load_manifest(args.onnx_dir)
    size, variant = manifest["backbone"]["input_size"], manifest["backbone"]["backbone"]
    capture = LogCapture()
    gpu = probe_gpu()
    onnx_path = embedder_onnx(size, variant)
    engine = open_engine(onnx_path, name=engine_slot(size, variant), prefer="auto", max_batch=DEFAULT_MAX_BATCH,
                         cache_root=args.work / "cache-fallback")
    lines = capture.since(0)
    stage.data(gpu=None if gpu is None else gpu.name, engine=engine.name, log=lines)
    stage.check("ONNX Runtime runs the backbone", engine.name.startswith("ort-"), engine.name)
    if gpu is not None:
        said = [ln for ln in lines if ln.startswith("WARNING") and "TensorRT is not available" in ln
                and "falling back to ONNX Runtime" in ln]
        stage.check("the fallback is one WARNING naming the reason", len(said) == 1, said[0] if said else lines)
    else:
        said = [ln for ln in lines if ln.startswith("INFO") and "no GPU found" in ln]
        stage.check("no GPU: one INFO line says so", len(said) == 1, said[0] if said else lines)
    x = crops(photos(min(args.photos, 4)), size)
    diff = float(np.abs(engine.run(x) - OrtEngine(onnx_path, device="cpu").run(x)).max())
    stage.check("its embeddings equal ORT CPU's", diff <= 1e-3, f"max abs diff {diff:.2e}", "<= 1e-3")
    stage.finish(summary=f"GPU {gpu.name if gpu else 'none'}, TensorRT absent -> {engine.name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["prepare", "probe", "build", "parity", "corrupt", "bench", "fallback"])
    parser.add_argument("--result", type=Path, help="the stage's JSON result file")
    parser.add_argument("--work", type=Path, help="the run's work folder (engine cache, reference outputs)")
    parser.add_argument("--onnx-dir", type=Path, help="the --prepare folder")
    parser.add_argument("--dest", type=Path, help="prepare: where the ONNX files go")
    parser.add_argument("--backbone", default=None, help="prepare: backbone variant (default WildFed's)")
    parser.add_argument("--input-size", type=int, default=None, help="prepare: backbone input size")
    parser.add_argument("--deadline", type=float, default=None, help="epoch seconds by which to stop")
    parser.add_argument("--photos", type=int, default=21)
    parser.add_argument("--dry-run", action="store_true", help="ONNX Runtime CPU only; TensorRT stages skip")
    parser.add_argument("--engines", default="trt,ort-cpu", help="bench: trt, ort-cpu, ort-cuda")
    args = parser.parse_args()
    if args.stage == "prepare":
        return prepare(args.dest, args.backbone, args.input_size)
    if args.result is None or args.work is None or args.onnx_dir is None:
        parser.error("--result, --work and --onnx-dir are required for every stage but prepare")
    args.deadline = args.deadline or time.time() + 600
    os.environ["WILDFED_CACHE"] = str(args.work / "cache")
    name = "bench-ortcuda" if args.stage == "bench" and args.engines == "ort-cuda" else args.stage
    stage = Stage(name, args.result)
    try:
        if args.stage in ("build", "parity", "corrupt"):
            import _device_trt

            getattr(_device_trt, args.stage)(stage, args)
        else:
            {"probe": probe, "bench": bench, "fallback": fallback}[args.stage](stage, args)
    except BaseException as exc:  # the result file must say what happened, whatever it was
        stage.data(traceback=traceback.format_exc()[-4000:])
        stage.finish("error", f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
