"""Distilled draft LMs for the embedded target: acceptance per objective and data, and speed against plain decoding
and the shipped GRIFFIN head. Writes ``benchmarks/results/distill-lm.{json,md,png}``.

    OMP_NUM_THREADS=1 python -m benchmarks.distill_lm                          # the committed run (tiny budgets)
    OMP_NUM_THREADS=1 python -m benchmarks.distill_lm --train-only tvd,tvdpp   # train students in another process
    OMP_NUM_THREADS=1 python -m benchmarks.distill_lm --steps 150 --lr 3e-3 --gen-len 64 --questions 16 \
        --max-new-tokens 64 --val-every 25 --val-samples 8 --students fkl,fkl-fixed,fkl-target --tag study

1. Students (``python -m training.distill``, the default 2-layer student with a reduced output vocabulary), each
   from the same start and for the same number of updates: undistilled; FKL, RKL, JSD, TVD on on-policy data
   (student-generated responses); FKL on the fixed data (ShareGPT conversations); FKL on target-generated responses;
   the TVD++ direct-alignment recipe (target-generated responses); FKL on on-policy data with AdaSPEC selection
   (reference: the FKL student). ``--students`` runs a subset; ``--val-every`` adds held-out learning curves.
2. For each: the measured per-token acceptance rate α and τ (new tokens per target pass) with chains of ``--gamma``
   on MT-Bench first turns (every ``80 / --questions``-th question: all eight categories), greedy and at T=1.
3. Speed on the same prompts, greedy, methods interleaved per prompt in one process: transformers' ``generate``,
   our plain decoding loop (:mod:`griffin.plain`), the shipped GRIFFIN head, and the best student at γ = 1..4.

A killed run continues: finished students and evaluations are kept under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from griffin.cli import run_cli
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark
from inference.questions import load_questions

HEAD_TREE = {"depth": 1, "top_k": 8, "total_tokens": 3}  # the tree of the head's committed MT-Bench runs


def variants(work: Path) -> list[tuple[str, str, list[str]]]:
    """(name, description, distill arguments) in training order (AdaSPEC needs the FKL student first)."""
    return [
        ("undistilled", "the target's first layers, untrained", ["--steps", "0"]),
        ("fkl", "FKL, on-policy", ["--token-loss", "fkl"]),
        ("fkl-fixed", "FKL, fixed data", ["--token-loss", "fkl", "--lambda-fixed", "1"]),
        ("fkl-target", "FKL, target-generated", ["--token-loss", "fkl", "--lambda-student", "0"]),
        ("rkl", "RKL, on-policy", ["--token-loss", "rkl"]),
        ("jsd", "JSD(0.5), on-policy", ["--token-loss", "jsd"]),
        ("tvd", "TVD, on-policy", ["--token-loss", "tvd"]),
        ("tvdpp", "TVD++ recipe (target responses)", ["--recipe", "tvdpp"]),
        ("fkl-adaspec", "FKL, on-policy, AdaSPEC 0.4", ["--token-loss", "fkl", "--select", "adaspec",
                                                        "--reference", str(work / "fkl")]),
    ]


STUDENT_NAMES = [name for name, _, _ in variants(Path("."))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distill_lm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="students/distill-lm", help="students and partial results (resumable)")
    p.add_argument("--steps", type=int, default=10, help="distillation updates per student")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (high: the budgets are tiny)")
    p.add_argument("--gen-len", type=int, default=32, help="tokens of generated training responses")
    p.add_argument("--max-samples", type=int, default=400, help="ShareGPT conversations to draw data from")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--questions", type=int, default=4, help="MT-Bench first turns (evenly spaced)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--gamma", type=int, default=3, help="chain length for α and τ")
    p.add_argument("--speed-gammas", default="1,2,3")
    p.add_argument("--val-samples", type=int, default=2,
                   help="held-out ShareGPT conversations for the held-out acceptance rate")
    p.add_argument("--val-every", type=int, default=0, help="held-out acceptance every N updates (a learning curve)")
    p.add_argument("--students", default=None, metavar="NAMES",
                   help="only these students in the whole run and its report (comma-separated; undistilled is "
                        f"always included as the reference); default: all of {', '.join(STUDENT_NAMES)}")
    p.add_argument("--tag", default=None, help="results file name: distill-lm-TAG (default: distill-lm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--train-only", default=None, metavar="NAMES",
                   help="only train these students (comma-separated), e.g. to train in several processes first")
    p.add_argument("--eval-only", default=None, metavar="NAMES",
                   help="only evaluate these trained students (comma-separated; kept under --work for the full run)")
    args = p.parse_args(argv)
    for option in ("students", "train_only", "eval_only"):
        unknown = sorted(set((getattr(args, option) or "").split(",")) - set(STUDENT_NAMES) - {""})
        if unknown:
            p.error(f"--{option.replace('_', '-')}: unknown student {', '.join(unknown)} (choose from "
                    f"{', '.join(STUDENT_NAMES)})")
    if args.students and "fkl-adaspec" in args.students.split(",") and "fkl" not in args.students.split(","):
        p.error("--students: fkl-adaspec needs fkl too (the FKL student is its AdaSPEC reference)")
    args.argv = argv
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch
from tqdm.auto import tqdm

from griffin import SpecGenerator
from griffin.autotune import draft_step_cost, expected_tokens, forward_cost, measured_alpha
from griffin.chat_template import prompt_ids
from griffin.draft import DraftModel
from griffin.draft_lm import DraftLM, load_draft_lm
from griffin.generator import default_head, fast_draft_dtype
from griffin.io import atomic_write, atomic_write_json
from griffin.plain import plain_generate
from griffin.sampling import SamplingConfig
from griffin.target import EMBEDDED_TARGET, load_target
from training import distill


def chosen(args: argparse.Namespace, work: Path) -> list[tuple[str, str, list[str]]]:
    """The variants of this run (``--students``, with the undistilled reference always)."""
    names = set(args.students.split(",")) | {"undistilled"} if args.students else set(STUDENT_NAMES)
    return [v for v in variants(work) if v[0] in names]


def train_students(args: argparse.Namespace, work: Path) -> dict[str, dict]:
    common = ["--layers", str(args.layers), "--draft-vocab", str(args.draft_vocab), "--batch-size",
              str(args.batch_size), "--lr", str(args.lr), "--gen-len", str(args.gen_len), "--max-samples",
              str(args.max_samples), "--max-prompt", "80", "--max-len", "160", "--val-samples", str(args.val_samples),
              "--val-every", str(args.val_every), "--seed", str(args.seed), "--warmup", "2", "--save-every", "8"]
    reports = {}
    only = args.train_only.split(",") if args.train_only else None
    for name, _, extra in chosen(args, work):
        out = work / name
        if only is not None and name not in only:
            continue
        if not (out / distill.REPORT).is_file():
            steps = [] if "--steps" in extra else ["--steps", str(args.steps)]
            resume = ["--resume"] if (out / distill.STATE).exists() else []
            code = distill.main(["--out", str(out), *common, *steps, *extra, *resume])
            if code:
                raise RuntimeError(f"distilling {name} failed")
        reports[name] = json.loads((out / distill.REPORT).read_text())
    return reports


def prompts(tokenizer, n: int) -> tuple[list[int], list[torch.Tensor]]:
    questions = load_questions("mt_bench")
    stride = max(1, len(questions) // n)
    chosen = questions[::stride][:n]
    ids = [torch.tensor(prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}])) for q in chosen]
    return [q["question_id"] for q in chosen], ids


def evaluate(gen: SpecGenerator, ids: list[torch.Tensor], args: argparse.Namespace, temperature: float) -> dict:
    hist: dict[int, int] = {}
    new = cycles = 0
    outputs = []
    for i, prompt in enumerate(ids):
        out = gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed + i)
        for count, k in out.stats.accepted_hist.items():
            hist[count] = hist.get(count, 0) + k
        new += out.stats.new_tokens
        cycles += out.stats.cycles
        outputs.append(out.sequences[0, len(prompt):].tolist())
    return {"alpha": measured_alpha(hist, gen.gamma), "tau": new / max(cycles, 1), "new_tokens": new,
            "cycles": cycles, "accepted_hist": {str(k): v for k, v in sorted(hist.items())}, "outputs": outputs}


def student_generator(target, tokenizer, folder: Path, gamma: int) -> SpecGenerator:
    lm, _, vocab = load_draft_lm(folder)
    return SpecGenerator(target, tokenizer, DraftLM(lm, vocab, target.config.vocab_size), gamma=gamma)


@torch.inference_mode()
def speed(target, tokenizer, ids: list[torch.Tensor], best: Path, args: argparse.Namespace) -> dict:
    """Greedy wall times per method, interleaved per prompt after a warm-up; outputs compared to ``generate``."""
    eos = torch.tensor([target.generation_config.eos_token_id])
    head = SpecGenerator(target, tokenizer, DraftModel.from_pretrained(default_head(EMBEDDED_TARGET)),
                         draft_dtype=fast_draft_dtype(target.device), **HEAD_TREE)
    gammas = [int(g) for g in args.speed_gammas.split(",")]
    students = {g: student_generator(target, tokenizer, best, g) for g in gammas}
    budget = args.max_new_tokens

    def run(method: str, prompt: torch.Tensor) -> tuple[list[int], dict]:
        if method == "generate":
            out = target.generate(prompt[None], max_new_tokens=budget, do_sample=False, eos_token_id=eos.tolist(),
                                  pad_token_id=int(eos[0]))[0, len(prompt):]
            return out.tolist(), {}
        if method == "plain":
            return plain_generate(target, prompt, budget, SamplingConfig(), eos).tolist(), {}
        gen = head if method == "griffin-head" else students[int(method.split("=")[1])]
        result = gen.generate(prompt, max_new_tokens=budget)
        return result.sequences[0, len(prompt):].tolist(), {"tau": result.stats.tau, "cycles": result.stats.cycles}

    methods = ["generate", "plain", "griffin-head"] + [f"student gamma={g}" for g in gammas]
    for method in methods:  # warm-up
        run(method, ids[0][:24])
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    cycles = dict.fromkeys(methods, 0)
    identical = dict.fromkeys(methods, 0)
    for prompt in tqdm(ids, desc="speed", unit="prompt"):
        reference = None
        for method in methods:
            t0 = time.perf_counter()
            out, stats = run(method, prompt)
            seconds[method] += time.perf_counter() - t0
            tokens[method] += len(out)
            cycles[method] += stats.get("cycles", len(out))
            reference = out if reference is None else reference
            identical[method] += out == reference
    fastest_plain = max(("generate", "plain"), key=lambda m: tokens[m] / seconds[m])
    costs = break_even(students[gammas[0]], gammas)
    rows = {m: {"seconds": seconds[m], "tokens": tokens[m], "tokens_per_s": tokens[m] / seconds[m],
                "tau": tokens[m] / max(cycles[m], 1), "identical_fraction": identical[m] / len(ids),
                "speedup_vs_fastest_plain": seconds[fastest_plain] / seconds[m] * tokens[m] / tokens[fastest_plain]}
            for m in methods}
    return {"fastest_plain": fastest_plain, "costs": costs, "methods": rows}


def break_even(gen: SpecGenerator, gammas: list[int]) -> dict:
    """Measured draft-step and verification costs, and the acceptance rate α at which chains of γ break even with
    one-token target steps: ``τ(α, γ) · t(1) = γ · draft + t(γ+1)``."""
    t = forward_cost(gen, [1] + [g + 1 for g in gammas])
    step = draft_step_cost(gen.draft)
    alphas = {}
    for g in gammas:
        need = (g * step + t[g + 1]) / t[1]
        alphas[g] = next((a / 1000 for a in range(1001) if expected_tokens(a / 1000, g) >= need), None)
    return {"draft_step_s": step, "target_forward_s": t, "draft_step_vs_target_step": step / t[1],
            "break_even_alpha": alphas}


def target_nll_summary(history: list[dict], window: int = 10) -> dict:
    """The target's mean NLL of a student's training text: over the run, its first and its last ``window`` updates
    (whether training moved the text the student learns on closer to the target's)."""
    nll = [h["target_nll"] for h in history if "target_nll" in h]
    if not nll:
        return {"train_target_nll": None}
    return {"train_target_nll": sum(nll) / len(nll), "train_target_nll_first": sum(nll[:window]) / len(nll[:window]),
            "train_target_nll_last": sum(nll[-window:]) / len(nll[-window:])}


def report(result: dict) -> str:
    rows = []
    for name, r in result["students"].items():
        nll = "-" if r.get("train_target_nll") is None else (f"{r['train_target_nll']:.2f} (first 10 updates "
                                                             f"{r['train_target_nll_first']:.2f}, last 10 "
                                                             f"{r['train_target_nll_last']:.2f})")
        rows.append([name, r["description"], r["steps"], r["val_acceptance"], nll,
                     r["T0"]["alpha"], r["T0"]["tau"], r["T1"]["alpha"], r["T1"]["tau"], r["T0"]["identical_fraction"]])
    table = markdown_table(["student", "objective / data", "updates", "held-out 1-TVD", "target NLL of its training "
                            "text", "α T=0", "τ T=0", "α T=1", "τ T=1", "greedy identical"], rows)
    curves = {n: r["val_curve"] for n, r in result["students"].items() if len(r.get("val_curve", [])) > 2}
    if curves:
        points = sorted({c["updates"] for curve in curves.values() for c in curve})
        by_update = {n: {c["updates"]: c["acceptance"] for c in curve} for n, curve in curves.items()}
        table += ("\nHeld-out acceptance (1 − TVD at T=1 on held-out ShareGPT responses) as training goes:\n\n"
                  + markdown_table(["student"] + [f"{u} updates" for u in points],
                                   [[n] + [f"{v[u]:.3f}" if u in v else "-" for u in points]
                                    for n, v in by_update.items()]))
    table += ("\nTarget NLL of its training text: the target's mean negative log-likelihood (nats per token) of the "
              "response tokens the student was trained on; the text speculative decoding drafts after is the "
              "target's own, so the lower, the closer training is to inference.\n")
    sp = result["speed"]
    speed_rows = [[m, v["tokens_per_s"], v["tau"], f"{v['speedup_vs_fastest_plain']:.2f}x", v["identical_fraction"]]
                  for m, v in sp["methods"].items()]
    s = result["settings"]
    head = (f"# Standalone draft LMs distilled for {EMBEDDED_TARGET}\n\n"
            f"Students: the target's first {s['layers']} layers with its embeddings and a {s['draft_vocab']}-token "
            f"output vocabulary, each distilled for {s['steps']} updates of {s['batch_size']} sequences "
            f"(responses of up to {s['gen_len']} tokens; lr {s['lr']}), from the same start. Evaluation: MT-Bench "
            f"first turns of questions {result['question_ids']} (evenly spaced: every category), up to "
            f"{s['max_new_tokens']} new tokens, chains of γ = {s['gamma']}; α = accepted drafted tokens / drafted "
            "tokens judged. "
            f"One thread (OMP_NUM_THREADS=1) on a shared machine: tiny budgets, the paper's ordering at most, not "
            f"its scale.\n\n")
    speed_head = (f"\n## Speed (greedy, same prompts, interleaved; best student: {result['best_student']})\n\n"
                  f"Fastest plain decoding here: {sp['fastest_plain']}. GRIFFIN head: the shipped "
                  f"{default_head(EMBEDDED_TARGET).name} with tree {HEAD_TREE}.\n\n")
    foot = (f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}, one-minute load average "
            f"{result['load_average_before_speed']:.1f} before the speed runs and "
            f"{result['load_average_after_speed']:.1f} after them (a shared machine: ratios from interleaved runs are "
            f"what to read). Training: {result['train_minutes']:.1f} wall-minutes summed over the students; this "
            f"command's own run (the evaluations not already kept under --work, then speed): "
            f"{result['wall_minutes']:.1f} min. Students and evaluations may be produced first in parallel processes "
            "with --train-only / --eval-only (same settings), as this run's were.\n")
    c = sp["costs"]
    forward = {int(n): v for n, v in c["target_forward_s"].items()}  # int keys in memory, strings once in JSON
    costs = (f"\nMeasured costs: a draft step {1000 * c['draft_step_s']:.1f} ms, "
             f"{c['draft_step_vs_target_step']:.2f} of a one-token target step "
             f"({1000 * forward[1]:.1f} ms); verifying γ+1 tokens: "
             + ", ".join(f"{1000 * v:.1f} ms (n={n})" for n, v in forward.items() if n != 1)
             + ". Acceptance rate α a chain needs to break even: "
             + ", ".join(f"γ={g}: {a}" for g, a in c["break_even_alpha"].items()) + ".\n")
    return head + table + speed_head + markdown_table(["method", "tokens/s", "τ", "speedup vs fastest plain",
                                                       "identical to generate"], speed_rows) + costs + foot


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["students"])
    curves = {n: r["val_curve"] for n, r in result["students"].items() if len(r.get("val_curve", [])) > 2}
    fig, axes = plt.subplots(1, 3 if curves else 2, figsize=(17 if curves else 12, 4.5),
                             gridspec_kw={"width_ratios": [3, 2, 2] if curves else [3, 2]})
    ax, ax2 = axes[0], axes[1]
    for i, temp in enumerate(("T0", "T1")):
        ax.bar([j + 0.4 * i for j in range(len(names))], [result["students"][n][temp]["alpha"] for n in names], 0.4,
               label=f"α at {temp[0]}={temp[1]}")
    ax.set_xticks([j + 0.2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("acceptance rate α")
    ax.set_title(f"Distilled {result['settings']['layers']}-layer students (same budget)")
    ax.legend()
    methods = list(result["speed"]["methods"])
    ax2.bar(range(len(methods)), [result["speed"]["methods"][m]["speedup_vs_fastest_plain"] for m in methods])
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xticks(range(len(methods)))
    ax2.set_xticklabels(methods, rotation=30, ha="right")
    ax2.set_ylabel("speedup vs fastest plain decoding")
    ax2.set_title("Greedy speed on the same prompts")
    if curves:
        ax3 = axes[2]
        for n, curve in curves.items():
            ax3.plot([c["updates"] for c in curve], [c["acceptance"] for c in curve], marker="o", label=n)
        ax3.set_xlabel("updates")
        ax3.set_ylabel("held-out acceptance (1 - TVD)")
        ax3.set_title("Learning curves")
        ax3.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=120))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.eval_only:
        reports = train_students(args, work)
    if args.train_only:
        return 0
    target, tokenizer = load_target(EMBEDDED_TARGET)
    question_ids, ids = prompts(tokenizer, args.questions)
    for name, _, _ in chosen(args, work):
        cached = work / f"eval-{name}.json"
        if not cached.is_file() and (not args.eval_only or name in args.eval_only.split(",")):
            gen = student_generator(target, tokenizer, work / name, args.gamma)
            atomic_write_json(cached, {f"T{t}": evaluate(gen, ids, args, float(t)) for t in (0, 1)})
    if args.eval_only:
        return 0
    references = None
    students = {}
    for name, description, _ in chosen(args, work):
        cached = work / f"eval-{name}.json"
        evaluation = json.loads(cached.read_text())
        if references is None:
            references = [target.generate(p[None], max_new_tokens=args.max_new_tokens, do_sample=False)[0, len(p):]
                          .tolist() for p in ids]
        same = [a == b for a, b in zip(evaluation["T0"]["outputs"], references)]
        evaluation["T0"]["identical_fraction"] = sum(same) / len(same)
        for t in ("T0", "T1"):
            evaluation[t].pop("outputs")
        validation = reports[name]["validation"]
        students[name] = {"description": description, "steps": reports[name]["progress"]["updates"],
                          "val_acceptance": validation[-1]["acceptance"], "val_curve": validation,
                          **target_nll_summary(reports[name]["history"]),
                          "train_seconds": reports[name]["progress"]["seconds"],
                          "sources": reports[name]["progress"]["sources"], **evaluation}
    best = max((n for n in students if n != "undistilled"), key=lambda n: students[n]["T0"]["tau"])
    result = {"target": EMBEDDED_TARGET, "settings": {k: v for k, v in vars(args).items() if k != "argv"},
              "question_ids": question_ids, "students": students, "best_student": best,
              "alpha_ratio_T1_best_vs_undistilled": max(s["T1"]["alpha"] for s in students.values())
              / max(students["undistilled"]["T1"]["alpha"], 1e-9),
              "load_average_before_speed": os.getloadavg()[0],
              "speed": speed(target, tokenizer, ids, work / best, args),
              "load_average_after_speed": os.getloadavg()[0],
              "train_minutes": sum(s["train_seconds"] for s in students.values()) / 60, "machine": machine_info(),
              "command": "OMP_NUM_THREADS=1 " + command_line("benchmarks.distill_lm", args.argv)}
    result["wall_minutes"] = (time.perf_counter() - started) / 60
    out_dir = Path(args.out_dir)
    stem = f"distill-lm-{args.tag}" if args.tag else "distill-lm"
    write_benchmark(out_dir, stem, result, report(result))
    plot(result, out_dir / f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
