"""Benchmarks: one report format for every `pipeline bench NAME`.

A readable table by default; with --json one object
``{"bench", "machine", "results": [{"case", <figure_unit>...}], "targets": [...]}``.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass, field


def percentiles_us(ns: list[int]) -> tuple[float, float]:
    """p50 and p99, in microseconds, of nanosecond samples."""
    import numpy as np
    a = np.asarray(ns, dtype=np.float64) / 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def machine_info() -> dict:
    info: dict[str, str | int | float | None] = {
        "platform": platform.platform(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()}
    try:
        import psutil
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


@dataclass
class Report:
    bench: str
    results: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    machine: dict = field(default_factory=machine_info)

    def add(self, case: str, **figures) -> dict:
        row = {"case": case, **figures}
        self.results.append(row)
        return row

    def target(self, name: str, measured: float, goal: str, met: bool) -> None:
        self.targets.append({"name": name, "measured": measured, "goal": goal, "met": bool(met)})

    def emit(self, as_json: bool, out=sys.stdout) -> int:
        if as_json:
            out.write(json.dumps({"bench": self.bench, "machine": self.machine,
                                  "results": self.results, "targets": self.targets}) + "\n")
            return 0
        out.write(f"# pipeline bench {self.bench}  ({self.machine.get('cpu_model', '')}, "
                  f"{self.machine.get('cpus')} cpus)\n")
        out.write(format_table(self.results) + "\n")
        if self.targets:
            out.write("\ntargets:\n")
            out.write(format_table([{"target": t["name"], "measured": t["measured"],
                                     "goal": t["goal"], "met": "yes" if t["met"] else "NO"}
                                    for t in self.targets]) + "\n")
        return 0


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.3e}"
    return str(v)


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no results)"
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(vals: list[str]) -> str:
        return " | ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    return "\n".join([line(cols), "-+-".join("-" * w for w in widths)] + [line(r) for r in cells])
