"""The summary of ``device_check.sh``: every stage's result merged into ``device_check.json`` and
``device_check.md`` (also printed), and the script's exit code.

    python benchmarks/_device_report.py --work DIR --out DIR --mode device|dry-run --seconds S --budget S

Reads ``<work>/stages/``: ``NAME.json`` (the stage's result, ``_device_common.Stage``), ``NAME.meta`` (``rc seconds
box`` written by the shell script), ``NAME.skip`` (why the script did not start the stage) and ``install.tsv``
(``step rc seconds note`` per install step). A stage whose process ended without a final status is reported as
``timeout`` (exit 124/137: stopped at its time box) or ``error``, with whatever it had written.

Exit code: 1 when any stage failed, raised or ran out of time; else 3 on a device run where the TensorRT stages
(``build``, ``parity``, ``corrupt``) did not all pass (TensorRT was not exercised); else 0.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

STAGES = ("install", "probe", "build", "parity", "corrupt", "fallback", "bench", "bench-ortcuda")
TRT_STAGES = ("build", "parity", "corrupt")
FAILED = ("fail", "error", "timeout")


def _stage(folder: Path, name: str) -> dict[str, Any]:
    skip, result, meta = folder / f"{name}.skip", folder / f"{name}.json", folder / f"{name}.meta"
    if skip.is_file():
        return {"stage": name, "status": "skip", "summary": skip.read_text().strip(), "checks": [], "data": {}}
    doc: dict[str, Any] = {"stage": name, "status": "not run", "summary": "", "checks": [], "data": {}}
    if result.is_file():
        try:
            doc = json.loads(result.read_text())
        except ValueError as exc:
            doc["summary"] = f"unreadable result file: {exc}"
    if meta.is_file():
        rc, seconds, box = (meta.read_text().split() + ["?", "?", "?"])[:3]
        doc.update(exit_code=rc, seconds=float(seconds) if seconds.replace(".", "").isdigit() else seconds,
                   time_box=box)
        if doc["status"] in ("running", "not run"):
            timed_out = rc in ("124", "137")
            doc["status"] = "timeout" if timed_out else "error"
            doc["summary"] = (f"stopped at its {box} s time box" if timed_out else
                              f"exited {rc} without a result") + (f"; {doc['summary']}" if doc["summary"] else "")
    return doc


def _install(folder: Path) -> dict[str, Any]:
    rows = []
    path = folder / "install.tsv"
    if path.is_file():
        for line in path.read_text().splitlines():
            step, rc, seconds, note = (line.split("\t") + ["", "", "", ""])[:4]
            rows.append({"step": step, "rc": rc, "seconds": seconds, "note": note})
    failed = [r["step"] for r in rows if r["rc"] not in ("0", "-")]
    return {"stage": "install", "status": "warn" if failed else ("info" if rows else "not run"),
            "summary": (f"failed: {', '.join(failed)} (the stages that need it skip)" if failed else
                        "; ".join(r["note"] for r in rows if r["note"])[:300]),
            "checks": [], "data": {"steps": rows}}


def _fmt(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else str(value)


def _bench_tables(stages: dict[str, dict]) -> list[str]:
    rows = [r for s in ("bench", "bench-ortcuda") for r in stages[s].get("data", {}).get("rows", [])]
    lines: list[str] = []
    engines = ("tensorrt-fp16", "ort-cuda", "ort-cpu")
    for model, unit in (("backbone", "embeddings/s"), ("detector", "images/s (engine call)")):
        mine = [r for r in rows if r["model"] == model]
        if not mine:
            continue
        lines += ["", f"{model} {unit}, host to host (median):", "",
                  "| batch | " + " | ".join(engines) + " | TRT / ORT CUDA | TRT / ORT CPU |",
                  "|---:|" + "---:|" * (len(engines) + 2)]
        for batch in sorted({r["batch"] for r in mine}):
            rate = {r["engine"]: r["per_s"] for r in mine if r["batch"] == batch}
            ratio = [f"{rate['tensorrt-fp16'] / rate[o]:.2f}x" if "tensorrt-fp16" in rate and o in rate else "-"
                     for o in ("ort-cuda", "ort-cpu")]
            lines.append(f"| {batch} | " + " | ".join(_fmt(rate.get(e, "-")) for e in engines) + " | "
                         + " | ".join(ratio) + " |")
    for name in ("bench", "bench-ortcuda"):
        for engine, why in stages[name].get("data", {}).get("skipped", {}).items():
            lines.append(f"\n{engine} not timed: {why}")
    return lines


def report(work: Path, out: Path, *, mode: str, seconds: float, budget: float) -> int:
    """Write the JSON and Markdown summaries to ``out``, print the Markdown, return the exit code."""
    folder = work / "stages"
    stages = {name: _install(folder) if name == "install" else _stage(folder, name) for name in STAGES}
    failed = [n for n, s in stages.items() if s["status"] in FAILED]
    trt_done = all(stages[n]["status"] == "pass" for n in TRT_STAGES)
    if failed:
        verdict, code = f"FAIL ({', '.join(failed)})", 1
    elif mode == "device" and not trt_done:
        verdict, code = ("INCOMPLETE: TensorRT was not exercised (" + "; ".join(
            f"{n}: {stages[n]['summary'] or stages[n]['status']}" for n in TRT_STAGES
            if stages[n]["status"] != "pass")[:400] + ")"), 3
    else:
        verdict, code = ("PASS" if mode == "device" else "PASS (dry run: ONNX Runtime CPU only)"), 0
    environment = stages["probe"].get("data", {}).get("environment", {})
    summary = {"mode": mode, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "seconds": round(seconds, 1), "budget_seconds": budget, "verdict": verdict, "exit_code": code,
               "stages": stages}
    md = [f"# WildFed device check ({mode})", "",
          (f"**{verdict}**, {seconds:.0f} s of a {budget:.0f} s budget; GPU "
           f"{(environment.get('gpu') or {}).get('name', 'none')}, TensorRT {environment.get('tensorrt', '?')}, "
           f"ONNX Runtime {environment.get('onnxruntime', '?')}, Python {environment.get('python', '?')}."), "",
          "| stage | status | seconds | summary |", "|---|---|---:|---|"]
    for name, s in stages.items():
        md.append(f"| {name} | {s['status'].upper()} | {_fmt(s.get('seconds', '-'))} | "
                  f"{str(s['summary']).replace('|', '/')[:300]} |")
    checks = [(n, c) for n, s in stages.items() for c in s.get("checks", [])]
    if checks:
        md += ["", "| stage | check | result | value | threshold |", "|---|---|---|---|---|"]
        md += [f"| {n} | {c['name']} | {'PASS' if c['ok'] else 'FAIL'} | {str(c['value']).replace('|', '/')[:200]} "
               f"| {c['threshold']} |" for n, c in checks]
    md += _bench_tables(stages)
    steps = stages["install"]["data"].get("steps", [])
    if steps:
        md += ["", "| install step | exit | seconds | note |", "|---|---:|---:|---|"]
        md += [f"| {r['step']} | {r['rc']} | {r['seconds']} | {r['note'][:200]} |" for r in steps]
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "device_check.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["device", "dry-run"], required=True)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--budget", type=float, default=0.0)
    args = parser.parse_args()
    return report(args.work, args.out, mode=args.mode, seconds=args.seconds, budget=args.budget)


if __name__ == "__main__":
    raise SystemExit(main())
