"""Distillation objectives on our target: GRIFFIN heads fine-tuned from one initial head with each token objective.

    python -m benchmarks.distill_heads --train --features work/features-distill --heads work/distill-heads
    python -m benchmarks.distill_heads --evaluate --heads work/distill-heads    # τ of every head (inference.tau)
    python -m benchmarks.distill_heads --heads work/distill-heads               # only rebuild the report

Every head starts from ``--init`` (the shipped GRIFFIN head) and gets the same data, schedule and budget (one
``training.train`` run each, K=3, top-3 alignment mask, the init head's draft vocabulary); only the token loss
differs, plus AdaSPEC token selection on top of FKL with the FKL head as its reference. τ is measured offline
(``inference.tau``) on one fixed tree for every head; the initial head is measured too, as the no-fine-tuning row.
Training resumes where it stopped; a head whose ``validation.json`` exists is not retrained. τ results go to
``--results`` (one JSON per head and temperature), the report to ``benchmarks/results/distill-heads.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from griffin.cli import run_cli
from griffin.io import atomic_write, atomic_write_json, weights_digest
from griffin.report import (
    command_line,
    machine_info,
    markdown_table,
    paired_difference,
    pooled_tau,
    write_benchmark,
)

INIT = "init (no fine-tuning)"
OBJECTIVES = {  # head name -> training.train flags; {heads} is the heads folder
    "soft-ce": ["--token-loss", "soft-ce"],
    "fkl": ["--token-loss", "fkl"],
    "fkl-adaspec": ["--token-loss", "fkl", "--select", "adaspec", "--reference", "{heads}/fkl",
                    "--select-frac", "0.4"],
    "tvd": ["--token-loss", "tvd"],
    "tvdpp": ["--token-loss", "tvdpp"],
    "rkl": ["--token-loss", "rkl"],
    "jsd": ["--token-loss", "jsd", "--jsd-beta", "0.5"],
}
BASELINE = "soft-ce"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distill_heads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", action="store_true", help="train the missing heads first")
    p.add_argument("--evaluate", action="store_true", help="measure τ of the heads without results first")
    p.add_argument("--features", default="work/features-distill", help="feature store of the fine-tuning")
    p.add_argument("--heads", default="work/distill-heads", help="folder of the fine-tuned heads")
    p.add_argument("--init", default="checkpoints/smollm2-135m-instruct-griffin", help="the initial head of all")
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help="heads to train / evaluate, comma-separated")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-updates", type=int, default=None, help="per head (default: the epochs)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (the recipe's K>1 stages)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--results", default="benchmarks/results/distill-heads", help="folder of the τ runs")
    p.add_argument("--report", default="benchmarks/results/distill-heads.md", help="the table; json and png beside")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--limits", default="0:all,1:20", help="questions per temperature (all = every question)")
    p.add_argument("--total-tokens", type=int, default=24)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    args.names = [n for n in args.objectives.split(",") if n]
    unknown = sorted(set(args.names) - set(OBJECTIVES))
    if unknown:
        p.error(f"unknown objectives {unknown}: choose from {', '.join(OBJECTIVES)}")
    args.temps = [float(t) for t in args.temperatures.split(",")]
    limits = dict(item.split(":") for item in args.limits.split(","))
    args.limit = {t: (None if limits.get(f"{t:g}", "all") == "all" else int(limits[f"{t:g}"])) for t in args.temps}
    return args


def train_command(args, name: str) -> list[str]:
    flags = [f.format(heads=args.heads) for f in OBJECTIVES[name]]
    cmd = [sys.executable, "-m", "training.train", "--features", args.features, "--out", f"{args.heads}/{name}",
           "--init-from", args.init, "--steps", "3", "--topk", "3", "--lr", str(args.lr), "--batch-size",
           str(args.batch_size), "--epochs", str(args.epochs), "--mixed-precision", "bf16", "--save-every", "10"]
    if args.max_updates:
        cmd += ["--max-updates", str(args.max_updates)]
    return cmd + flags


def train_missing(args) -> None:
    order = sorted(args.names, key=lambda n: n != "fkl")  # the AdaSPEC reference first
    for name in order:
        out = Path(args.heads) / name
        if (out / "validation.json").is_file() and (out / "model.safetensors").is_file():
            print(f"{name}: trained already ({out})", flush=True)
            continue
        cmd = train_command(args, name) + (["--resume"] if (out / "train_state").exists() else [])
        print(f"{name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env)
        print(f"{name}: trained in {time.perf_counter() - start:.0f} s", flush=True)


def head_folders(args) -> dict[str, Path]:
    """The heads to measure, the initial one first (only those that finished training)."""
    folders = {INIT: Path(args.init)} | {name: Path(args.heads) / name for name in args.names}
    return {n: f for n, f in folders.items() if (f / "model.safetensors").is_file() and (f / "config.json").is_file()}


def result_path(args, name: str, temperature: float) -> Path:
    stem = "init" if name == INIT else name
    return Path(args.results) / f"{args.bench}-{stem}-T{temperature:g}.json"


def validate_init(args) -> list[dict]:
    """The initial head's validation on the fine-tuning store's held-out split, as ``training.train`` reports it
    (same split, batches, batch vocabulary and bf16 autocast), so that its row compares with the fine-tuned heads."""
    import torch

    from griffin.draft import DraftModel
    from griffin.target import load_target_head
    from training.objective import MultiPassObjective, pass_report, score_store
    from training.store import FeatureStore
    from training.train import VAL_FRACTION, split

    store = FeatureStore(args.features)
    _, val = split(len(store), VAL_FRACTION)
    draft = DraftModel.from_pretrained(args.init).attach(load_target_head(store.manifest["target"]))
    objective = MultiPassObjective(draft, 3, 3).eval()
    totals = score_store(objective, store, val, args.batch_size, store.manifest["max_len"], torch.device("cpu"),
                         lambda: torch.autocast("cpu", dtype=torch.bfloat16), progress=False)
    return pass_report(totals, objective.report_k)


def evaluate_missing(args, argv: list[str] | None) -> None:
    """τ of every head without a result, prompt by prompt: each replay is appended to a partial file, so a killed run
    resumes at the prompt it stopped at; the result files are written when a temperature is complete."""
    import dataclasses

    import torch
    from tqdm.auto import tqdm

    from griffin.target import EMBEDDED_TARGET, load_target
    from inference import tau

    torch.set_num_threads(1)
    init_validation = Path(args.results) / "init-validation.json"
    if not init_validation.is_file():
        atomic_write_json(init_validation, {"features": args.features, "init": args.init,
                                            "passes": validate_init(args)})
    model = tokenizer = None
    for temperature in args.temps:
        missing = {n: str(f) for n, f in head_folders(args).items() if not result_path(args, n, temperature).is_file()}
        if not missing:
            continue
        if model is None:
            model, tokenizer = load_target(EMBEDDED_TARGET)
        samples = tau.continuations(model, tokenizer, args.bench, temperature, 0, args.max_new_tokens,
                                    args.limit[temperature])
        heads = {name: tau.prepare_head(path, model) for name, path in missing.items()}
        key = f"{temperature:g}"
        settings = {"bench": args.bench, "temperature": temperature, "limit": args.limit[temperature],
                    "max_new_tokens": args.max_new_tokens, "tree": [args.total_tokens, args.depth, args.top_k],
                    "heads": {name: [path, weights_digest(path)] for name, path in missing.items()}}
        journal = tau.Journal(Path(args.results) / f".{args.bench}-T{key}.partial.jsonl", settings)
        done: dict[str, dict[tuple, tau.PromptTau]] = {name: {} for name in heads}
        for (name, question_id, turn), prompt in journal.replays(key).items():
            done[name][(question_id, turn)] = prompt
        print(f"τ at T={key} for {', '.join(missing)} on {len(samples)} prompts", flush=True)
        start = time.perf_counter()
        for sample in tqdm(samples, desc=f"τ T={key}", unit="prompt", dynamic_ncols=True):
            prompt_key = (sample.question_id, sample.turn)
            todo = {name: head for name, head in heads.items() if prompt_key not in done[name]}
            if not todo:
                continue
            for name, res in tau.evaluate(todo, model, [sample], args.depth, args.top_k, args.total_tokens,
                                          progress=False).items():
                done[name][prompt_key] = res.prompts[0]
                journal.add(("replay", name, key, *prompt_key), dataclasses.asdict(res.prompts[0]))
        seconds = time.perf_counter() - start
        for name in heads:
            res = tau.TauResult(args.depth, [done[name][(s.question_id, s.turn)] for s in samples])
            record = {"head": name, "path": missing[name], "bench": args.bench, "temperature": temperature,
                      "limit": args.limit[temperature], "max_new_tokens": args.max_new_tokens,
                      "tree": {"total_tokens": args.total_tokens, "depth": args.depth, "top_k": args.top_k},
                      **res.as_dict(), "seconds_this_run_all_heads": seconds, "machine": machine_info(),
                      "command": command_line("benchmarks.distill_heads", argv)}
            atomic_write_json(result_path(args, name, temperature), record)
            print(f"{name} T={key}: τ {res.tau:.3f} ± {res.tau_se:.3f}", flush=True)
        journal.finish()


def collect(args) -> dict:
    heads = {}
    for name, folder in head_folders(args).items():
        validation = json.loads((folder / "validation.json").read_text())
        run, last = validation["run"], validation["epochs"][-1]
        entry = {"path": str(folder), "token_loss": run.get("token_loss", "soft-ce"), "select": run.get("select"),
                 "select_frac": run.get("select_frac"), "jsd_beta": run.get("jsd_beta"),
                 "updates": run["total_updates"], "tokens": last["tokens"], "train_seconds": last["train_seconds"],
                 "lr": run["lr"], "init_from": run.get("init_from"), "features": run["features"],
                 "validation": last["passes"], "tau": {}}
        if name == INIT:  # its own report is on another store: use its validation on this one, when measured
            measured = Path(args.results) / "init-validation.json"
            entry["validation"] = json.loads(measured.read_text())["passes"] if measured.is_file() else []
        for temperature in args.temps:
            path = result_path(args, name, temperature)
            if path.is_file():
                entry["tau"][f"{temperature:g}"] = json.loads(path.read_text())
        heads[name] = entry
    if not any(h["tau"] for h in heads.values()):
        raise FileNotFoundError(f"no τ results under {args.results}: run with --evaluate first")
    for entry in heads.values():
        for key, res in entry["tau"].items():
            res["tau_se"] = pooled_tau(res["per_prompt"])["se"]  # files written before τ's ± was pooled too
            base = heads.get(BASELINE, {}).get("tau", {}).get(key)
            if base:
                pair = paired_difference(res["per_prompt"], base["per_prompt"]) or {"diff": math.nan, "se": math.nan}
                res["vs_baseline"] = {"ratio": res["tau"] / base["tau"], "paired_diff": pair["diff"],
                                      "paired_se": pair["se"]}
    return heads


def objective_label(name: str, entry: dict) -> str:
    if name == INIT:
        return "-"
    text = entry["token_loss"] + (f" (β={entry['jsd_beta']:g})" if entry["jsd_beta"] is not None else "")
    return text + (f" + AdaSPEC {entry['select_frac']:g}" if entry["select"] == "adaspec" else "")


def report(args, argv: list[str] | None) -> None:
    heads = collect(args)
    temps = [f"{t:g}" for t in args.temps]
    headers = ["head", "objective", "val top-1 (pass 1/2/3)"]
    for t in temps:
        headers += [f"τ T={t}", f"vs {BASELINE} T={t} (paired Δτ)"]
    headers += [f"α{d} T=0" for d in range(1, args.depth + 1)]
    rows = []
    for name, entry in heads.items():
        row = [name, objective_label(name, entry),
               " / ".join(f"{p['top1']:.3f}" for p in entry["validation"]) or "-"]
        for t in temps:
            res = entry["tau"].get(t)
            row.append(f"{res['tau']:.3f} ± {res['tau_se']:.3f}" if res else "-")
            vs = (res or {}).get("vs_baseline")
            row.append("-" if not vs or name == BASELINE or math.isnan(vs["paired_diff"]) else
                       f"{vs['ratio']:.3f}x ({vs['paired_diff']:+.3f} ± {vs['paired_se']:.3f})")
        alpha = entry["tau"].get("0", {}).get("alpha", [])
        row += [f"{a:.3f}" if not math.isnan(a) else "-" for a in alpha] + ["-"] * (args.depth - len(alpha))
        rows.append(row)
    first = next(h for n, h in heads.items() if n != INIT) if len(heads) > 1 else next(iter(heads.values()))
    prompts = {t: next((h["tau"][t]["n_prompts"] for h in heads.values() if t in h["tau"]), 0) for t in temps}
    commands = sorted({h["tau"][t]["command"] for h in heads.values() for t in h["tau"]})
    text = ("# Distillation objectives for the GRIFFIN head on SmolLM2-135M-Instruct\n\n"
            f"Every head starts from `{args.init}` and is fine-tuned with `training.train` on the same features "
            f"(`{first['features']}`), data order, schedule and budget ({first['updates']} updates of "
            f"{args.batch_size} conversations, {first['tokens']} tokens, lr {first['lr']:g}, K=3, top-3 alignment "
            "mask, bf16 autocast, one thread); only the token loss differs (AdaSPEC: FKL on the 40 % of aligned "
            "positions per batch where the head's per-token FKL exceeds the frozen FKL head's the most). "
            f"τ = new tokens per target verification, measured offline with `inference.tau` on {args.bench} "
            f"(prompts: {', '.join(f'T={t}: {n}' for t, n in prompts.items())}; MT-Bench counts both turns), "
            f"one fixed tree for every head ({args.total_tokens} nodes, depth {args.depth}, top-k {args.top_k}), up "
            f"to {args.max_new_tokens} new tokens; τ is pooled over the prompts (all new tokens / all passes) and ± is "
            f"its standard error over prompts (delta method); the paired Δτ is the difference from {BASELINE}'s τ over "
            "the same prompts and continuations, with its standard error (the figure that says whether two heads "
            "differ). α_d = fraction of cycles whose accepted path reaches depth d among those that reached d−1 "
            "(acceptance rate per draft depth). Validation top-1 is on the store's held-out conversations with the "
            "inference-time draft vocabulary. soft-CE and FKL "
            "differ by the target's entropy only, so they have the same gradient: the gap between those two heads is "
            "the run-to-run noise of this setup (float rounding through bf16 autocast and Adam).\n\n"
            + markdown_table(headers, rows) + "\nTraining commands (`python -m benchmarks.distill_heads --train`):"
            "\n\n" + "".join(f"- `{' '.join(['python'] + train_command(args, n)[1:])}`\n" for n in heads
                             if n != INIT) + "\nτ commands:\n\n" + "".join(f"- `{c}`\n" for c in commands) +
            f"\nReport: `{command_line('benchmarks.distill_heads', argv)}`\n")
    result = {"bench": args.bench, "init": args.init, "baseline": BASELINE,
              "tree": {"total_tokens": args.total_tokens, "depth": args.depth, "top_k": args.top_k},
              "max_new_tokens": args.max_new_tokens, "heads": heads, "machine": machine_info(),
              "command": command_line("benchmarks.distill_heads", argv)}
    report_path = Path(args.report)
    write_benchmark(report_path.parent, report_path.stem, result, text)
    plot(heads, temps, report_path.with_suffix(".png"), args.depth)


def plot(heads: dict, temps: list[str], path: Path, depth: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(heads)
    width = 0.8 / max(len(temps), 1)
    for i, t in enumerate(temps):
        taus = [heads[n]["tau"].get(t, {}).get("tau", 0) for n in names]
        errs = [heads[n]["tau"].get(t, {}).get("tau_se", 0) for n in names]
        left.bar([j + i * width for j in range(len(names))], taus, width, yerr=errs, capsize=2, label=f"T={t}")
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    left.set_xticklabels([n.replace(" (", "\n(") for n in names], fontsize=8, rotation=30)
    left.set_ylabel("acceptance length τ")
    low = min(h["tau"][t]["tau"] for h in heads.values() for t in h["tau"])
    left.set_ylim(low * 0.8, None)
    left.legend(fontsize=8)
    left.set_title("τ per objective (same init, data, budget, tree)")
    for n in names:
        alpha = heads[n]["tau"].get("0", {}).get("alpha")
        if alpha:
            right.plot(range(1, len(alpha) + 1), alpha, marker="o", label=n)
    right.set_xticks(range(1, depth + 1))
    right.set_xlabel("draft depth d")
    right.set_ylabel("α_d at T=0 (accepted at d | reached d−1)")
    right.legend(fontsize=7)
    right.set_title("acceptance rate per draft depth")
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.train:
        train_missing(args)
    if args.evaluate:
        evaluate_missing(args, argv)
    report(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, (subprocess.CalledProcessError,)))
