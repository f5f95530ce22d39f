"""The TensorRT stages of ``device_check.sh``: ``build``, ``parity`` and ``corrupt``.

Everything goes through WildFed's own path, as a gateway runs it: ``YoloxDetector.open`` and ``OnnxEmbedder.open``
with ``prefer="tensorrt"`` (``edge_sdk.inference.engines.open_engine`` -> ``EngineCache`` -> ``TensorRTBuilder`` /
``TensorRTEngine``), the ``--prepare`` ONNX files given as ``WILDFED_DETECTOR_ONNX`` / ``WILDFED_BACKBONE_ONNX``, and
the engine cache in ``$WILDFED_CACHE/engines`` (the run's work folder). What happened is read from WildFed's log
lines (``building TensorRT FP16 engine``, ``does not match the SHA-256``, ``does not load``) and the engine's name
(``tensorrt-fp16``; ``open_engine`` falls back to ONNX Runtime rather than fail, so the name is the proof).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from _device_common import DETECTOR_BATCH, LogCapture, Stage, crops, load_manifest, photos, sha256, tile
from _device_compare import (BOX_MAX_SCORE_DIFF, BOX_MIN_IOU, EMBEDDING_MAX_ABS, EMBEDDING_MIN_COSINE,
                             box_parity, embedding_parity)

BUILDING = "building TensorRT FP16 engine"


def engine_files(manifest: dict) -> dict[str, tuple[Path, Path]]:
    """``role -> (engine file, key file)`` of the detector's and the backbone's cache slots."""
    from edge_sdk.inference.embedder import engine_slot

    root = Path(os.environ["WILDFED_CACHE"]) / "engines"
    slots = {"detector": "yolox_tiny",
             "backbone": engine_slot(manifest["backbone"]["input_size"], manifest["backbone"]["backbone"])}
    return {role: (root / f"{slot}.engine", root / f"{slot}.engine.json") for role, slot in slots.items()}


def trt_unavailable(args: argparse.Namespace, *, need_engines: bool = False) -> str | None:
    """Why the TensorRT path cannot run here, or None when it can (GPU, ``tensorrt``, torch with CUDA, and with
    ``need_engines`` the engines the build stage made)."""
    if args.dry_run:
        return "--cpu-dry-run: TensorRT is not exercised"
    from edge_sdk.inference.engines import probe_gpu

    if probe_gpu() is None:
        return "no NVIDIA GPU found (nvidia-smi, torch CUDA)"
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        return f"tensorrt is not importable here ({exc}); see the install stage"
    try:
        import torch
    except ImportError:
        return "torch is not importable, and WildFed's TensorRT engine allocates its CUDA buffers with it"
    if not torch.cuda.is_available():
        return "torch has no CUDA device, and WildFed's TensorRT engine allocates its buffers with it"
    if need_engines:
        missing = [str(e) for e, k in engine_files(load_manifest(args.onnx_dir)).values()
                   if not (e.is_file() and k.is_file())]
        if missing:
            return f"the build stage left no engine ({', '.join(missing)})"
    return None


def _open(role: str, manifest: dict):
    """The detector (``YoloxDetector``) or the embedder (``OnnxEmbedder``) on the engine WildFed chooses with
    ``prefer="tensorrt"``."""
    if role == "detector":
        from edge_sdk.inference.detector import YoloxDetector

        return YoloxDetector.open(prefer="tensorrt", batch_size=DETECTOR_BATCH)
    from edge_sdk.inference.embedder import OnnxEmbedder

    return OnnxEmbedder.open(manifest["backbone"]["input_size"], backbone=manifest["backbone"]["backbone"],
                             prefer="tensorrt")


def open_trt(manifest: dict, capture: LogCapture):
    """``(embedder, detector, WildFed's log lines while opening them)``."""
    start = len(capture.records)
    detector = _open("detector", manifest)
    embedder = _open("backbone", manifest)
    return embedder, detector, capture.since(start)


def build(stage: Stage, args: argparse.Namespace) -> None:
    """Build both engines in FP16 (a fresh cache), then run one batch through each."""
    reason = trt_unavailable(args)
    if reason:
        stage.finish("skip", reason)
        return
    import tensorrt

    from edge_sdk.inference.detector import preprocess

    manifest = load_manifest(args.onnx_dir)
    stage.data(tensorrt=tensorrt.__version__)
    if int(tensorrt.__version__.split(".")[0]) >= 11:
        note = ("TensorRT 11 removed BuilderFlag.FP16 and platform_has_fast_fp16 (weak typing), which "
                "edge_sdk.inference.engines.TensorRTBuilder uses: expect this build to fail; install TensorRT 10")
        print(f"  NOTE {note}")
        stage.data(note=note)
    capture = LogCapture()
    images = photos(args.photos)
    for role, (engine_path, key_path) in engine_files(manifest).items():
        start = len(capture.records)
        t0 = time.perf_counter()
        model = _open(role, manifest)
        seconds = time.perf_counter() - t0
        lines = capture.since(start)
        built = model.engine.name == "tensorrt-fp16" and any(BUILDING in ln for ln in lines)
        stage.data(**{role: {"seconds": round(seconds, 1), "engine": model.engine.name, "log": lines,
                             "engine_bytes": engine_path.stat().st_size if engine_path.is_file() else None,
                             "key": json.loads(key_path.read_text()) if key_path.is_file() else None}})
        stage.check(f"{role}: WildFed built a TensorRT FP16 engine", built,
                    f"{model.engine.name} in {seconds:.1f} s" if built else lines[-2:])
        if not built:
            continue
        if role == "detector":
            out = model.engine.run(tile(np.stack([preprocess(im)[0] for im in images]), DETECTOR_BATCH))
            expected = (DETECTOR_BATCH, 8400, 6)
        else:
            x = crops(images, manifest["backbone"]["input_size"])
            out = model.embed(x)
            expected = (len(x), 1280)
        stage.check(f"{role}: the engine runs", out.shape == expected and bool(np.isfinite(out).all()),
                    f"output {out.shape}", f"{expected}, finite")
    stage.finish(summary=f"TensorRT {tensorrt.__version__}: " + ", ".join(
        f"{r} {stage.doc['data'][r]['seconds']} s" for r in ("detector", "backbone") if r in stage.doc["data"]))


def _embedding_reference(args: argparse.Namespace, manifest: dict, images: list) -> tuple[np.ndarray, np.ndarray]:
    """ONNX Runtime CPU (FP32) embeddings of the photos' crops: ``(inputs, embeddings)``, also saved to the work
    folder for the later stages."""
    from edge_sdk.inference.embedder import OnnxEmbedder, embedder_onnx
    from edge_sdk.inference.engines import OrtEngine

    size, variant = manifest["backbone"]["input_size"], manifest["backbone"]["backbone"]
    x = crops(images, size)
    embeddings = OnnxEmbedder(OrtEngine(embedder_onnx(size, variant), device="cpu"), size, backbone=variant).embed(x)
    np.savez(args.work / "reference.npz", inputs=x, embeddings=embeddings)
    return x, embeddings


def parity(stage: Stage, args: argparse.Namespace) -> None:
    """TensorRT FP16 against ONNX Runtime CPU FP32 on the photos: backbone embeddings (max abs diff, cosine) and
    detector boxes (IoU, score); also that the engines come from the cache the build stage filled."""
    manifest = load_manifest(args.onnx_dir)
    images = photos(args.photos)
    from edge_sdk.inference.detector import YoloxDetector, detector_onnx
    from edge_sdk.inference.engines import OrtEngine

    x, ref_embeddings = _embedding_reference(args, manifest, images)
    ref_boxes = YoloxDetector(OrtEngine(detector_onnx(), device="cpu"), batch_size=DETECTOR_BATCH).detect(images)
    stage.data(reference={"engine": "ort-cpu", "images": len(images), "boxes": sum(len(b) for b in ref_boxes),
                          "embedding_range": [float(ref_embeddings.min()), float(ref_embeddings.max())]})
    print(f"  ORT CPU reference: {len(images)} photos, {sum(len(b) for b in ref_boxes)} boxes")
    reason = trt_unavailable(args, need_engines=True)
    if reason:
        stage.finish("skip", f"{reason} (the ORT CPU reference was computed)")
        return
    capture = LogCapture()
    embedder, detector, lines = open_trt(manifest, capture)
    reused = embedder.name == detector.engine.name == "tensorrt-fp16" and not any(BUILDING in ln for ln in lines)
    stage.check("engines reused from the cache in a new process", reused, lines[-2:] if not reused else "cache hits")
    emb = embedding_parity(ref_embeddings, embedder.embed(x))
    stage.data(embeddings=emb)
    stage.check("backbone embeddings, TensorRT FP16 vs ORT CPU", emb["ok"],
                f"max abs diff {emb.get('max_abs', float('nan')):.4f}, min cosine {emb.get('min_cosine', 0):.6f}",
                f"max abs diff <= {EMBEDDING_MAX_ABS}, cosine >= {EMBEDDING_MIN_COSINE}")
    boxes = box_parity(ref_boxes, detector.detect(images))
    stage.data(boxes=boxes)
    stage.check("detector boxes, TensorRT FP16 vs ORT CPU", boxes["ok"],
                f"{boxes.get('checked')} boxes matched, min IoU {boxes.get('min_iou')}, max score diff "
                f"{boxes.get('max_score_diff')}, unmatched {boxes.get('unmatched')}",
                f"IoU >= {BOX_MIN_IOU}, score diff <= {BOX_MAX_SCORE_DIFF}, every box >= "
                f"{boxes.get('score_floor')} matched")
    stage.finish(summary=f"embeddings max abs diff {emb.get('max_abs', float('nan')):.4f}; boxes min IoU "
                         f"{boxes.get('min_iou')}")


def _damage(engine_path: Path, key_path: Path, how: str) -> None:
    """``flip``: invert 4 KiB in the middle of the engine (its key's digest no longer matches); ``truncate``: cut
    the engine in half and drop ``engine_sha256`` from its key (a key file as written before engine digests were
    recorded, so that TensorRT's deserialiser is what finds the damage)."""
    data = bytearray(engine_path.read_bytes())
    if how == "flip":
        mid = len(data) // 2
        data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])
    else:
        del data[len(data) // 2:]
        key = json.loads(key_path.read_text())
        key.pop("engine_sha256", None)
        key_path.write_text(json.dumps(key))
    engine_path.write_bytes(bytes(data))


def corrupt(stage: Stage, args: argparse.Namespace) -> None:
    """Damage the backbone's cached engine twice (see :func:`_damage`) and reopen it through WildFed each time: it
    must say so, rebuild, record the new engine's digest, and give embeddings within the parity thresholds."""
    reason = trt_unavailable(args, need_engines=True)
    if reason:
        stage.finish("skip", reason)
        return
    manifest = load_manifest(args.onnx_dir)
    engine_path, key_path = engine_files(manifest)["backbone"]
    ref_file = args.work / "reference.npz"
    if ref_file.is_file():
        ref = np.load(ref_file)
        x, ref_embeddings = ref["inputs"], ref["embeddings"]
    else:
        x, ref_embeddings = _embedding_reference(args, manifest, photos(args.photos))
    capture = LogCapture()
    for how, said in (("flip", "does not match the SHA-256"), ("truncate", "does not load")):
        _damage(engine_path, key_path, how)
        start = len(capture.records)
        embedder = _open("backbone", manifest)
        lines = capture.since(start)
        stage.data(**{how: {"log": lines, "engine": embedder.name}})
        stage.check(f"{how}: WildFed noticed the damage", any(said in ln for ln in lines), lines[:1] or lines)
        stage.check(f"{how}: and rebuilt the engine",
                    embedder.name == "tensorrt-fp16" and any(BUILDING in ln for ln in lines), embedder.name)
        recorded = json.loads(key_path.read_text()).get("engine_sha256") if key_path.is_file() else None
        stage.check(f"{how}: the key records the new engine's SHA-256",
                    engine_path.is_file() and recorded == sha256(engine_path), recorded)
        emb = embedding_parity(ref_embeddings, embedder.embed(x))
        stage.check(f"{how}: rebuilt engine's embeddings vs ORT CPU", emb["ok"],
                    f"max abs diff {emb.get('max_abs', float('nan')):.4f}",
                    f"<= {EMBEDDING_MAX_ABS}, cosine >= {EMBEDDING_MIN_COSINE}")
        del embedder
    stage.finish(summary="a flipped and a truncated engine were each noticed and rebuilt"
                 if all(c["ok"] for c in stage.doc["checks"]) else "see the failed checks")
