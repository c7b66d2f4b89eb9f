"""Benchmark bookkeeping: machine description, the command line, markdown tables, and writing a result."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from griffin.io import atomic_write_json, atomic_write_text


def machine_info() -> dict:
    import torch
    import transformers

    from griffin.kernels import cpu_flags, cpu_name

    info = {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_1m": round(os.getloadavg()[0], 2),  # 1-minute load at the end, this run's threads included
    }
    return info


def machine_text(machine: dict) -> str:
    """One line for a result's Machine field: the CPU with its vector extensions (results written before
    ``cpu_flags`` existed show none), cores, torch threads where recorded, torch and date."""
    flags = f" ({', '.join(machine['cpu_flags'])})" if machine.get("cpu_flags") else ""
    threads = f", {machine['torch_threads']} torch threads" if "torch_threads" in machine else ""
    return f"{machine['cpu']}{flags}, {machine['cores']} cores{threads}, torch {machine['torch']}, {machine['date']}"


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that reproduces a run: ``argv`` when a module's main() was called with it, else sys.argv."""
    return f"python -m {module} {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip()


def tree_text(tree: dict) -> str:
    """A speed run's tree settings, as tables show them."""
    n = tree["total_tokens"]
    lookup = f" + lookup {tree['lookup']}" if tree.get("lookup") else ""
    return (f"{n} node{'' if n == 1 else 's'}, depth {tree['depth']}" if n else "no tree") + lookup


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if value is None:
            return "n/a"  # not measured
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def result_stem(bench: str, tag: str, temperature: float, dtype: str) -> str:
    """``<bench>-<draft>-T<temp>``, with ``-bf16`` for a bf16 target (fp32 runs keep the plain name)."""
    return f"{bench}-{tag}-T{temperature:g}" + ("" if dtype == "fp32" else f"-{dtype}")


def write_benchmark(out_dir: str | Path, stem: str, result: dict, markdown: str) -> None:
    """``<out_dir>/<stem>.json`` and ``<stem>.md`` (each written atomically), and the table on stdout."""
    atomic_write_json(Path(out_dir) / f"{stem}.json", result)
    atomic_write_text(Path(out_dir) / f"{stem}.md", markdown)
    print(markdown)


def fastest_plain(result: dict) -> tuple[float, str] | None:
    """A speed run's speedup over the fastest plain decoding it timed (``generate`` or our plain loop) and which one
    that was; computed from the tokens/s columns for runs written before the field existed."""
    rates = {name: result[key] for name, key in (("generate", "baseline_tokens_per_s"),
                                                 ("own loop", "own_loop_tokens_per_s")) if key in result}
    if not rates:
        return None
    name = max(rates, key=rates.get)
    return result["tokens_per_s"] / rates[name], name


def paired_difference(first: list[dict], other: list[dict]) -> dict | None:
    """Per-prompt τ of ``first`` minus ``other`` over the prompts both ran (matched by question and turn): mean, its
    standard error (NaN from fewer than two prompts) and the number of prompts; None where they share none."""
    mine = {(p["question_id"], p["turn"]): p["tau"] for p in first if "question_id" in p}
    diffs = [mine[k] - p["tau"] for p in other if "question_id" in p and (k := (p["question_id"], p["turn"])) in mine]
    if not diffs:
        return None
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return {"mean": statistics.fmean(diffs), "se": se, "n_prompts": len(diffs)}
