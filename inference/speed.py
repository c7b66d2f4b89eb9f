"""Speed runs on MT-Bench, HumanEval and GSM8K: acceptance length and speedup, measured side by side.

    python -m inference.speed --bench mt_bench --max-new-tokens 128 --temperature 0
    python -m inference.speed --bench all --draft checkpoints/smollm2-135m-instruct-eagle --methods ours

    python -m inference.speed --bench mt_bench --dtype bf16        # bf16 target: bf16 speculative vs bf16 plain
    python -m inference.speed --bench mt_bench --lookup 10         # head tree + a prompt-lookup chain of 10 tokens

For every question (chat-templated; MT-Bench's second turn too, after the baseline's first answer), in one process
after a warm-up, each method generates in turn: transformers' ``generate``, our speculative generator, our own plain
decoding loop (with the fastest one-row kernel measured on this machine, :func:`griffin.kernels.choose_kernels`), and
transformers' prompt lookup decoding, all with the target in the same dtype. The headline speedup is against the
*fastest* plain decoding (the higher tokens/s of ``generate`` and our plain loop); the speedup over ``generate`` is
kept beside it. At T=0 the speculative output is checked token for token against ``generate``'s. Results:
``benchmarks/results/<bench>-<draft>-T<temp>[-bf16].json``, a markdown table beside it, and the answers in FastChat's
JSONL format under ``benchmarks/results/answers/``. An interrupted run resumes (per-question records are kept in a
``.partial.jsonl`` file until the run completes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

from griffin.cli import add_tree_arguments, nonnegative_float, positive_int, run_cli
from griffin.constants import EMBEDDED_TARGET

from .questions import BENCHES, EXTRA_BENCHES, first_per_category, load_questions

METHODS = ("baseline", "ours", "own_loop", "prompt_lookup", "fixed")
PLAIN_NAMES = {"baseline": "transformers generate", "own_loop": "our plain loop"}
# "fixed": ours with the tuned tree held for the whole generation (adaptation off); not in the default methods
DEFAULT_METHODS = METHODS[:4]
RESULTS = Path("benchmarks/results")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default="mt_bench", choices=[*BENCHES, *EXTRA_BENCHES, "all"],
                   help="a question set, or all (the three headline sets)")
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--draft", default=None, help="head Hub id or folder (default: the head shipped for the target)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=nonnegative_float, default=0.0)
    p.add_argument("--limit", type=positive_int, default=None, help="only the first n questions")
    p.add_argument("--per-category", type=positive_int, default=None,
                   help="only the first n questions of each category (after --limit)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="target dtype")
    p.add_argument("--draft-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="draft head dtype (auto: bf16 where the hardware computes it natively)")
    p.add_argument("--depth", type=positive_int, default=None)
    p.add_argument("--top-k", type=positive_int, default=None)
    add_tree_arguments(p)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (ours is required; fixed: ours without "
                        "adapting the tuned tree during a generation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--tag", default=None, help="name of the draft in file names (default: the head folder's name)")
    args = p.parse_args(argv)
    args.argv = argv  # recorded as the command (None: sys.argv)
    methods = [m for m in args.methods.split(",") if m]
    if "ours" not in methods or any(m not in METHODS for m in methods):
        p.error(f"--methods must include ours and only name {', '.join(METHODS)}")
    args.methods = methods
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch

from griffin import SpecGenerator
from griffin.chat_template import prompt_ids
from griffin.io import atomic_write_json, atomic_write_text, read_journal, weights_digest
from griffin.plain import plain_generate
from griffin.progress import progress
from griffin.report import command_line, machine_info, machine_text, markdown_table, result_stem
from griffin.sampling import SamplingConfig
from griffin.target import load_target


class Runner:
    """Runs every method on one prompt and records tokens and wall time."""

    def __init__(self, gen: SpecGenerator, args: argparse.Namespace):
        self.gen, self.args = gen, args
        self.model, self.tok = gen.target, gen.tokenizer
        self.sampling = SamplingConfig(args.temperature)
        self.eos = gen.eos_ids(None)

    def hf_kwargs(self) -> dict:
        sample = self.args.temperature > 0
        return dict(max_new_tokens=self.args.max_new_tokens, do_sample=sample,
                    temperature=self.args.temperature if sample else None, top_p=None, top_k=None,
                    eos_token_id=self.eos.tolist(), pad_token_id=self.tok.pad_token_id)

    def run(self, method: str, ids: torch.Tensor, seed: int) -> dict:
        torch.manual_seed(seed)
        t0, cpu0 = time.perf_counter(), time.process_time()
        record: dict = {}
        with torch.inference_mode():
            if method == "baseline":
                new = self.model.generate(ids[None], **self.hf_kwargs())[0, ids.shape[0]:]
            elif method == "prompt_lookup":
                new = self.model.generate(ids[None], prompt_lookup_num_tokens=10, **self.hf_kwargs())[0, ids.shape[0]:]
            elif method == "own_loop":
                gen = torch.Generator().manual_seed(seed)
                new = plain_generate(self.model, ids, self.args.max_new_tokens, self.sampling, self.eos, gen)
            else:
                self.gen.adapt = method == "ours"
                try:
                    out = self.gen.generate(ids, max_new_tokens=self.args.max_new_tokens,
                                            temperature=self.args.temperature, seed=seed)
                finally:
                    self.gen.adapt = True
                new = out.sequences[0, ids.shape[0]:]
                record["stats"] = out.stats.as_dict()
        # CPU seconds beside wall seconds: on a shared machine they show the cost apart from others' load
        record.update(seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - cpu0, tokens=new.tolist())
        return record


def question_records(runner: Runner, question: dict, bench: str, seed: int) -> list[dict]:
    """All turns of one question; later turns see the baseline's earlier answers."""
    messages: list[dict] = []
    records = []
    for turn, text in enumerate(question["turns"]):
        messages.append({"role": "user", "content": text})
        ids = torch.tensor(prompt_ids(runner.tok, messages), device=runner.gen.device)
        record = {"question_id": question["question_id"], "turn": turn, "prompt_tokens": ids.shape[0],
                  "category": question.get("category")}
        for method in runner.args.methods:
            record[method] = runner.run(method, ids, seed + 1000 * turn)
        reference = record.get("baseline", record["ours"])["tokens"]
        messages.append({"role": "assistant", "content": runner.tok.decode(reference, skip_special_tokens=True)})
        records.append(record)
    return records


def tuning_summary(gen: SpecGenerator, temperature: float) -> dict | None:
    """Why the run's tree is what it is: the tuner's record for its temperature band, as the generator took it (None
    for a fixed tree)."""
    record = gen.tuning(temperature)
    keys = ("temperature", "reason", "expected_tau", "expected_speedup", "measured_s_per_token", "tuned_at")
    return {k: record[k] for k in keys if k in record} if record else None


def totals(records: list[dict], methods: list[str]) -> tuple[dict[str, float], dict[str, int], int]:
    """-> (seconds per method, new tokens per method, verification passes of ours) over ``records``."""
    seconds = {m: sum(r[m]["seconds"] for r in records) for m in methods}
    tokens = {m: sum(len(r[m]["tokens"]) for r in records) for m in methods}
    return seconds, tokens, sum(r["ours"]["stats"]["cycles"] for r in records)


def turn_summary(records: list[dict], methods: list[str]) -> dict:
    """τ and the speedups of the prompts of one turn (MT-Bench's follow-up turns carry a longer context)."""
    seconds, tokens, cycles = totals(records, methods)
    rate = {m: tokens[m] / seconds[m] for m in methods}
    plain = {m: rate[m] for m in ("baseline", "own_loop") if m in methods}
    summary = {"n_prompts": len(records), "tau": tokens["ours"] / cycles if cycles else None,
               "tokens_per_s": rate["ours"]}
    if plain:
        summary["speedup_vs_fastest_plain"] = rate["ours"] / max(plain.values())
    if "baseline" in methods:
        summary["speedup"] = rate["ours"] / rate["baseline"]
    return summary


def category_summary(records: list[dict], methods: list[str]) -> dict:
    """Per category: prompts, τ and tokens/s of ours (and of the fixed tree), and their speedups over the fastest
    plain decoding of the same prompts."""
    seconds, tokens, cycles = totals(records, methods)
    rate = {m: tokens[m] / seconds[m] for m in methods}
    plain = max((rate[m] for m in ("baseline", "own_loop") if m in methods), default=None)
    out = {"n_prompts": len(records), "tau": tokens["ours"] / cycles if cycles else None, "tokens_per_s": rate["ours"],
           "plain_fraction": sum(r["ours"]["stats"].get("plain_steps", 0) for r in records) / max(cycles, 1)}
    if plain:
        out["speedup_vs_fastest_plain"] = rate["ours"] / plain
        if "fixed" in methods:
            out["fixed_speedup_vs_fastest_plain"] = rate["fixed"] / plain
    return out | cpu_speedups(records, methods)


def cpu_speedups(records: list[dict], methods: list[str]) -> dict:
    """Speedups of ours (and of the fixed tree) over the fastest plain decoding by CPU seconds (runs that record
    them): what the methods cost apart from other processes' load on a shared machine."""
    if not all("cpu_seconds" in r[m] for r in records for m in methods):
        return {}
    rate = {m: sum(len(r[m]["tokens"]) for r in records) / sum(r[m]["cpu_seconds"] for r in records) for m in methods}
    plain = max((rate[m] for m in ("baseline", "own_loop") if m in methods), default=None)
    if plain is None:
        return {}
    return {f"{'' if m == 'ours' else m + '_'}cpu_speedup_vs_fastest_plain": rate[m] / plain
            for m in ("ours", "fixed") if m in methods}


def summarise(records: list[dict], args: argparse.Namespace, bench: str, gen: SpecGenerator, tag: str) -> dict:
    seconds, tokens, cycles = totals(records, args.methods)
    hist: dict[str, int] = {}
    split = {"draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0, "prefill_s": 0.0}
    for r in records:
        for k, v in r["ours"]["stats"]["accepted_hist"].items():
            hist[str(k)] = hist.get(str(k), 0) + v
        for k in split:
            split[k] += r["ours"]["stats"][k]
    result = {
        "bench": bench, "target": args.target, "draft": tag,
        "draft_digest": weights_digest(gen.draft_path) if gen.draft_path else None,  # which weights were measured
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
        "draft_dtype": str(gen.draft.fusion.fc.weight.dtype).removeprefix("torch."),
        "tree": {"depth": gen.depth, "top_k": gen.top_k, "total_tokens": gen.total_tokens, "lookup": gen.lookup},
        "kernels": {"one_row": gen.weight_major.one_row, "rows_kernel": gen.weight_major.rows_kernel,
                    "max_rows": gen.weight_major.max_rows, "source": gen.backend.kernels.source,
                    "text": gen.weight_major.describe()},
        "tuning": tuning_summary(gen, args.temperature),
        "n_questions": len({r["question_id"] for r in records}), "n_prompts": len(records),
        "tau": tokens["ours"] / cycles if cycles else None,  # new tokens per verification pass
        "tokens_per_s": tokens["ours"] / seconds["ours"],
        "accepted_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "time_split": {k: v / seconds["ours"] for k, v in split.items()},
    }
    if "baseline" in args.methods:
        result["baseline_tokens_per_s"] = tokens["baseline"] / seconds["baseline"]
        result["speedup"] = result["tokens_per_s"] / result["baseline_tokens_per_s"]
        if args.temperature == 0:
            same = [r["ours"]["tokens"] == r["baseline"]["tokens"] for r in records]
            result["identical_fraction"] = sum(same) / len(same)
    if "own_loop" in args.methods:
        result["own_loop_one_row"] = gen.backend.kernels.one_row  # its one-row kernel
        result["own_loop_tokens_per_s"] = tokens["own_loop"] / seconds["own_loop"]
        result["speedup_vs_own_loop"] = result["tokens_per_s"] / result["own_loop_tokens_per_s"]
    plain = {m: tokens[m] / seconds[m] for m in ("baseline", "own_loop") if m in args.methods}
    if plain:
        fastest = max(plain, key=plain.get)
        result["fastest_plain"] = fastest
        result["speedup_vs_fastest_plain"] = result["tokens_per_s"] / plain[fastest]
    if "own_loop" in args.methods and "baseline" in args.methods and args.temperature == 0:
        same = [r["own_loop"]["tokens"] == r["baseline"]["tokens"] for r in records]
        result["own_loop_identical_fraction"] = sum(same) / len(same)
    if "prompt_lookup" in args.methods and "baseline" in args.methods:
        result["prompt_lookup_tokens_per_s"] = tokens["prompt_lookup"] / seconds["prompt_lookup"]
        result["peers"] = {"prompt_lookup": result["prompt_lookup_tokens_per_s"] / result["baseline_tokens_per_s"]}
    if "fixed" in args.methods:
        result["fixed_tokens_per_s"] = tokens["fixed"] / seconds["fixed"]
        if plain:
            result["fixed_speedup_vs_fastest_plain"] = result["fixed_tokens_per_s"] / plain[fastest]
    result["plain_fraction"] = sum(r["ours"]["stats"].get("plain_steps", 0) for r in records) / max(cycles, 1)
    result.update(cpu_speedups(records, args.methods))
    categories = sorted({r["category"] for r in records if r.get("category")})
    if len(categories) > 1:
        result["by_category"] = {c: category_summary([r for r in records if r.get("category") == c], args.methods)
                                 for c in categories}
    turns = sorted({r["turn"] for r in records})
    if len(turns) > 1:
        result["by_turn"] = {str(t + 1): turn_summary([r for r in records if r["turn"] == t], args.methods)
                             for t in turns}
    result["seconds"] = seconds
    result["machine"] = machine_info()
    result["command"] = command_line("inference.speed", args.argv)
    return result


def table(result: dict) -> str:
    rows = [["acceptance length τ (tokens / target pass)", result["tau"]],
            ["griffin tokens/s", result["tokens_per_s"]]]
    if "speedup_vs_fastest_plain" in result:
        rows.append([f"**speedup vs the fastest plain decoding** ({PLAIN_NAMES[result['fastest_plain']]})",
                     result["speedup_vs_fastest_plain"]])
    if "speedup" in result:
        rows += [["transformers generate tokens/s", result["baseline_tokens_per_s"]],
                 ["speedup vs transformers generate", result["speedup"]]]
    if "speedup_vs_own_loop" in result:
        rows += [["our plain loop tokens/s", result["own_loop_tokens_per_s"]],
                 ["speedup vs our plain loop", result["speedup_vs_own_loop"]]]
    if "fixed_speedup_vs_fastest_plain" in result:
        rows.append(["the tuned tree held fixed (no adaptation): speedup vs the fastest plain decoding",
                     result["fixed_speedup_vs_fastest_plain"]])
    for key, name in (("cpu_speedup_vs_fastest_plain", "ours"), ("fixed_cpu_speedup_vs_fastest_plain", "fixed tree")):
        if key in result:
            rows.append([f"{name}: speedup vs the fastest plain decoding by CPU seconds", result[key]])
    if "plain_fraction" in result:
        rows.append(["cycles adaptation ran as plain steps (fraction)", result["plain_fraction"]])
    if "peers" in result:
        rows.append(["prompt lookup speedup vs transformers generate", result["peers"]["prompt_lookup"]])
    if "identical_fraction" in result:
        rows.append(["identical outputs (fraction of prompts)", result["identical_fraction"]])
    if "own_loop_identical_fraction" in result:
        rows.append(["our plain loop identical to generate (fraction of prompts)",
                     result["own_loop_identical_fraction"]])
    for turn, t in result.get("by_turn", {}).items():
        speedups = [f"{t[k]:.2f}x {name}" for k, name in (("speedup_vs_fastest_plain", "the fastest plain decoding"),
                                                          ("speedup", "generate")) if k in t]
        tau = "-" if t["tau"] is None else f"{t['tau']:.2f}"  # None: no verification pass
        rows.append([f"turn {turn} ({t['n_prompts']} prompts): τ, speedup vs", f"τ {tau}; " + ", ".join(speedups)])
    for name, c in result.get("by_category", {}).items():
        fixed = c.get("fixed_speedup_vs_fastest_plain")
        fixed = "" if fixed is None else f"; fixed tree {fixed:.2f}x"
        tau = "-" if c["tau"] is None else f"{c['tau']:.2f}"
        cpu = c.get("cpu_speedup_vs_fastest_plain")
        cpu = "" if cpu is None else f" (CPU seconds {cpu:.2f}x)"
        rows.append([f"{name} ({c['n_prompts']} prompts): τ, speedup vs the fastest plain decoding",
                     f"τ {tau}; {c.get('speedup_vs_fastest_plain', float('nan')):.2f}x{cpu}{fixed}"])
    head = (f"# {result['bench']} · draft {result['draft']} · T={result['temperature']}\n\n"
            f"{result['n_questions']} questions, {result['n_prompts']} prompts, up to {result['max_new_tokens']} new "
            f"tokens, target {result['target']} ({result['dtype']}), tree {result['tree']}.\n\n")
    if result.get("tuning"):
        head += f"Tree chosen by the tuner on this machine: {result['tuning']['reason']}.\n\n"
    foot = f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}.\n"
    return head + markdown_table(["metric", "value"], rows) + foot


def answers_jsonl(records: list[dict], questions: list[dict], tok, model_id: str) -> str:
    by_q: dict = {}
    for r in records:
        by_q.setdefault(r["question_id"], []).append(tok.decode(r["ours"]["tokens"], skip_special_tokens=True))
    lines = [json.dumps({"question_id": q["question_id"], "answer_id": uuid.uuid4().hex, "model_id": model_id,
                         "choices": [{"index": 0, "turns": by_q[q["question_id"]]}], "tstamp": time.time()})
             for q in questions if q["question_id"] in by_q]
    return "\n".join(lines) + "\n"


def load_partial(path: Path, settings: dict, questions: list[dict]) -> list[dict]:
    """Records of the questions an interrupted run with the same settings finished (all their turns); the file is
    rewritten to hold just those, so a line or a turn cut by a kill is measured again rather than kept."""
    records, clean = read_journal(path, settings)
    turns = {q["question_id"]: len(q["turns"]) for q in questions}
    counts = Counter(r["question_id"] for r in records)
    kept = [r for r in records if counts[r["question_id"]] == turns.get(r["question_id"])]
    if kept and (not clean or len(kept) < len(records)):
        atomic_write_text(path, "".join(json.dumps(x) + "\n" for x in [settings, *kept]))
    return kept


def run_bench(bench: str, gen: SpecGenerator, runner: Runner, args: argparse.Namespace, tag: str) -> dict:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem(bench, tag, args.temperature, args.dtype)
    questions = load_questions(bench, args.limit)
    if args.per_category:
        questions = first_per_category(questions, args.per_category)
    skip = ("bench", "out_dir", "argv", "retune")
    settings = {k: v for k, v in vars(args).items() if k not in skip} | {"bench": bench}
    partial = out_dir / f".{stem}.partial.jsonl"
    records = load_partial(partial, json.loads(json.dumps(settings)), questions)
    done = {r["question_id"] for r in records}
    if not records:
        partial.write_text(json.dumps(settings) + "\n")
    pending = [q for q in questions if q["question_id"] not in done]
    with open(partial, "a") as handle:
        for question in progress(pending, desc=bench, unit="q", initial=len(done), total=len(questions),
                             dynamic_ncols=True):
            new = question_records(runner, question, bench, args.seed + int(question["question_id"]))
            handle.write("".join(json.dumps(r) + "\n" for r in new))
            handle.flush()
            records += new
    result = summarise(records, args, bench, gen, tag)
    atomic_write_json(out_dir / f"{stem}.json", {**result, "per_prompt": [
        {"question_id": r["question_id"], "turn": r["turn"], "prompt_tokens": r["prompt_tokens"],
         **{m: {"seconds": r[m]["seconds"], "cpu_seconds": r[m].get("cpu_seconds"), "new_tokens": len(r[m]["tokens"])}
            for m in args.methods},
         "tau": r["ours"]["stats"]["tau"], "cycles": r["ours"]["stats"]["cycles"]} for r in records]})
    atomic_write_text(out_dir / f"{stem}.md", table(result))
    atomic_write_text(out_dir / "answers" / f"{stem}.jsonl",
                      answers_jsonl(records, questions, gen.tokenizer, f"{args.target}-{tag}"))
    partial.unlink()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    kwargs = {k: getattr(args, k) for k in ("depth", "top_k") if getattr(args, k) is not None}
    kwargs.update(total_tokens=args.total_tokens, retune=args.retune, lookup=args.lookup)
    gen = SpecGenerator.from_pretrained(model, args.draft, tokenizer=tokenizer, draft_dtype=args.draft_dtype,
                                        **kwargs)
    tag = args.tag or (Path(args.draft or gen.draft_path or "head").name
                       + (f"-lookup{args.lookup}" if args.lookup else ""))
    runner = Runner(gen, args)
    warm = torch.tensor(prompt_ids(tokenizer, [{"role": "user", "content": "Hello! Who are you?"}]))
    for method in args.methods:
        runner.run(method, warm, 0)
    for bench in BENCHES if args.bench == "all" else [args.bench]:
        result = run_bench(bench, gen, runner, args, tag)
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
