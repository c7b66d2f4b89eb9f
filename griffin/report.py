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


def fill_section(path: str | Path, name: str, body: str) -> None:
    """Rewrite the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in the markdown file ``path``."""
    path = Path(path)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} section to fill")
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    atomic_write_text(path, before + start + "\n" + body + end + after)


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


def prompt_counts(record: dict) -> tuple[int, float]:
    """(new tokens, verification cycles) of one per-prompt record: an :mod:`inference.tau` replay's (``new_tokens``,
    ``cycles``) or an :mod:`inference.speed` run's (``ours.new_tokens``, ``cycles``; records written before ``cycles``
    was stored give it back as new tokens / τ, the ratio the engine computed τ from)."""
    tokens = record["new_tokens"] if "new_tokens" in record else record["ours"]["new_tokens"]
    return tokens, record["cycles"] if "cycles" in record else tokens / record["tau"]


def _residuals(records: list[dict]) -> tuple[float, list[float]]:
    """The pooled τ = Σ tokens / Σ cycles of ``records`` and each prompt's linearised residual
    (tokens_i − τ·cycles_i) / mean cycles, whose mean is 0 and whose spread gives τ's standard error (delta method)."""
    counts = [prompt_counts(r) for r in records]
    tokens, cycles = sum(t for t, _ in counts), sum(c for _, c in counts)
    if not cycles:
        return float("nan"), [float("nan")] * len(counts)
    tau = tokens / cycles
    mean_cycles = cycles / len(counts)
    return tau, [(t - tau * c) / mean_cycles for t, c in counts]


def _se(residuals: list[float]) -> float:
    return statistics.stdev(residuals) / len(residuals) ** 0.5 if len(residuals) > 1 else float("nan")


def pooled_tau(records: list[dict]) -> dict:
    """τ over a set of prompts as speed runs report it (all new tokens / all verification cycles, so a long answer
    weighs more than a short one), its standard error over prompts (delta method) and the number of prompts."""
    if not records:
        return {"tau": float("nan"), "se": float("nan"), "n_prompts": 0}
    tau, residuals = _residuals(records)
    return {"tau": tau, "se": _se(residuals), "n_prompts": len(records)}


def paired_difference(first: list[dict], other: list[dict]) -> dict | None:
    """Pooled τ of ``first`` minus pooled τ of ``other`` over the prompts both ran (matched by question and turn), the
    standard error of that difference (delta method, paired per prompt: NaN from fewer than two prompts) and the
    number of prompts; None where they share none."""
    mine = {(p["question_id"], p["turn"]): p for p in first if "question_id" in p}
    pairs = [(mine[k], p) for p in other if "question_id" in p and (k := (p["question_id"], p["turn"])) in mine]
    if not pairs:
        return None
    tau_a, res_a = _residuals([a for a, _ in pairs])
    tau_b, res_b = _residuals([b for _, b in pairs])
    return {"diff": tau_a - tau_b, "se": _se([a - b for a, b in zip(res_a, res_b)]), "n_prompts": len(pairs)}
