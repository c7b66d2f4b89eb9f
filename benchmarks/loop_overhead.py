"""No tree against the plain loop: decoding with ``total_tokens=0`` against :func:`griffin.plain.plain_generate`.

    OMP_NUM_THREADS=1 python -m benchmarks.loop_overhead     # embedded target, fp32, 3 prompts x 64 tokens, 5 rounds

With ``total_tokens=0`` the generator drafts nothing and runs the plain loop's own steps
(:func:`griffin.plain.plain_steps`, same kernels), so the two should run at the same rate. Per round and prompt, each
of three modes (greedy ``generate``, sampled ``generate`` at T=1 with a fixed seed, greedy ``stream``) times the
generator and the plain loop back to back, in alternating order, after a warm-up; the table gives the median ms per
token of each and the median of the paired ratios (generator / plain loop), by wall time and by CPU time (this
process's, one thread: on a shared machine the code's cost apart from other processes' load). Greedy and sampled runs
must write the same tokens as the plain loop (same seed, same draws). It also times entering and leaving the
backend's :class:`griffin.kernels.WeightMajorLinears` alone. Writes ``<out>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from griffin.cli import positive_int, run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain what a hash table is in two sentences.",
           "Give me three tips for a good night's sleep."]
MODES = ("greedy", "sampled T=1", "stream")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--tokens", type=positive_int, default=64, help="new tokens per generation")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--switches", type=positive_int, default=200, help="enter/exit pairs timed")
    p.add_argument("--out", default="benchmarks/results/loop-overhead", help="path without suffix")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from griffin import SpecGenerator
    from griffin.plain import plain_generate
    from griffin.sampling import SamplingConfig

    gen = SpecGenerator.from_pretrained(args.target, total_tokens=0)
    eos = gen.eos_ids(None)
    prompts = [gen.encode([{"role": "user", "content": p}]) for p in PROMPTS]

    def ours(mode: str, ids: torch.Tensor) -> list[int]:
        if mode == "stream":
            return gen.tokenizer("".join(gen.stream(ids, max_new_tokens=args.tokens)))["input_ids"]
        temperature = 1.0 if mode.startswith("sampled") else 0.0
        return gen.generate(ids, max_new_tokens=args.tokens, temperature=temperature, seed=0).sequences[
            0, ids.shape[0]:].tolist()

    def plain(mode: str, ids: torch.Tensor) -> list[int]:
        sampled = mode.startswith("sampled")
        generator = torch.Generator().manual_seed(0) if sampled else None
        return plain_generate(gen.target, ids, args.tokens, SamplingConfig(1.0 if sampled else 0.0), eos,
                              generator).tolist()

    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    ms = {clock: {m: {"generator, no tree": [], "plain loop": []} for m in MODES} for clock in clocks}
    for round_ in range(args.rounds + 1):  # round 0: warm-up
        for i, ids in enumerate(prompts):
            for mode in MODES:
                pair = {}
                order = [("generator, no tree", ours), ("plain loop", plain)]
                for name, run in order if (round_ + i) % 2 else order[::-1]:
                    start = {clock: now() for clock, now in clocks.items()}
                    tokens = run(mode, ids)
                    pair[name] = ({clock: now() - start[clock] for clock, now in clocks.items()}, tokens)
                if mode != "stream" and pair["generator, no tree"][1] != pair["plain loop"][1]:
                    raise RuntimeError(f"{mode}: the generator without a tree and the plain loop wrote different "
                                       "tokens")
                if round_:
                    n = len(pair["plain loop"][1])  # the stream's text re-tokenized may differ in count
                    for name, (seconds, _) in pair.items():
                        for clock in clocks:
                            ms[clock][mode][name].append(seconds[clock] / n * 1000)
    switch = gen.backend.weight_major
    start = time.perf_counter()
    for _ in range(args.switches):
        with switch:
            pass
    switch_s = (time.perf_counter() - start) / args.switches
    summary: dict = {clock: {} for clock in clocks}
    for clock, modes in ms.items():
        for mode, times in modes.items():
            ratios = [o / p for o, p in zip(times["generator, no tree"], times["plain loop"], strict=True)]
            summary[clock][mode] = {name: statistics.median(t) for name, t in times.items()} | {
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "pairs": len(ratios)}
    result = {"target": args.target, "new_tokens": args.tokens, "rounds": args.rounds, "prompts": PROMPTS,
              "ms_per_token": summary, "ms_per_token_all": ms, "kernel_switch_ms": switch_s * 1000,
              "switched_layers": len(switch.linears), "kernels": switch.describe(), "machine": machine_info(),
              "command": command_line("benchmarks.loop_overhead", args.argv)}
    rows = [[f"{mode} ({clock})", f"{s['generator, no tree']:.2f}", f"{s['plain loop']:.2f}",
             f"{s['ratio_median']:.3f} ({s['ratio_min']:.3f}-{s['ratio_max']:.3f})"]
            for clock, modes in summary.items() for mode, s in modes.items()]
    text = (f"# No tree against the plain loop · {args.target}\n\n{args.rounds} rounds x {len(PROMPTS)} prompts x "
            f"{args.tokens} tokens per mode, the two methods back to back in alternating order, one thread; "
            f"kernels: {switch.describe()}; entering and leaving the kernel switch ({len(switch.linears)} layers): "
            f"{switch_s * 1000:.2f} ms.\n\n"
            + markdown_table(["mode", "generator, no tree (ms/token)", "plain loop (ms/token)",
                              "generator / plain, median of pairs (range)"], rows)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}.\n")
    out = Path(args.out)
    write_benchmark(out.parent, out.name, result, text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
