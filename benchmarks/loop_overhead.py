"""What the generator's loop costs beyond the target's forward: decoding with no draft tree against the plain loop.

    OMP_NUM_THREADS=1 python -m benchmarks.loop_overhead          # embedded target, fp32, 64 tokens, 5 rounds

With ``total_tokens=0`` the generator proposes nothing and verifies one token per cycle, which is plain decoding
through the speculative loop; :func:`griffin.plain.plain_generate` is plain decoding with nothing else. Both use the
same one-row kernel, so the difference per token is the loop's own cost per cycle (verification mask, verifier, KV
bookkeeping, switching the linear layers' kernels), which every speculative cycle pays too. The two take turns for
``--rounds`` rounds after a warm-up (medians reported); the table also times entering and leaving the backend's
:class:`griffin.kernels.WeightMajorLinears` alone, which happens once per verification pass. Greedy; the two must
write the same tokens. Writes ``<out>.json`` and ``.md``.
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

PROMPT = "Write a short story about a lighthouse keeper."


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
    ids = gen.encode([{"role": "user", "content": PROMPT}])
    eos = torch.tensor([gen.tokenizer.eos_token_id])
    greedy = SamplingConfig(0.0, 1.0, 0)
    per_token: dict[str, list[float]] = {"generator, no tree": [], "plain loop": []}
    for round_ in range(args.rounds + 1):  # round 0: warm-up
        start = time.perf_counter()
        ours = gen.generate(ids, max_new_tokens=args.tokens).sequences[0, ids.shape[0]:]
        spec_s = time.perf_counter() - start
        start = time.perf_counter()
        plain = plain_generate(gen.target, ids, args.tokens, greedy, eos)
        plain_s = time.perf_counter() - start
        if not torch.equal(ours.cpu(), plain.cpu()):
            raise RuntimeError("the generator without a tree and the plain loop wrote different tokens")
        if round_:
            per_token["generator, no tree"].append(spec_s / len(ours))
            per_token["plain loop"].append(plain_s / len(plain))
    switch = gen.backend.weight_major
    start = time.perf_counter()
    for _ in range(args.switches):
        with switch:
            pass
    switch_s = (time.perf_counter() - start) / args.switches
    ms = {name: statistics.median(t) * 1000 for name, t in per_token.items()}
    result = {"target": args.target, "new_tokens": args.tokens, "rounds": args.rounds, "ms_per_token": ms,
              "ms_per_token_all": {k: [s * 1000 for s in v] for k, v in per_token.items()},
              "kernel_switch_ms": switch_s * 1000, "switched_layers": len(switch.linears),
              "kernels": switch.describe(), "machine": machine_info(),
              "command": command_line("benchmarks.loop_overhead", args.argv)}
    rows = [[name, f"{value:.2f}"] for name, value in ms.items()]
    rows.append(["difference (the loop's cost per cycle)", f"{ms['generator, no tree'] - ms['plain loop']:.2f}"])
    rows.append([f"enter + exit of the kernel switch ({len(switch.linears)} layers)", f"{switch_s * 1000:.2f}"])
    text = (f"# Loop overhead · {args.target}\n\nMedian over {args.rounds} rounds of {args.tokens} greedy tokens, "
            f"the two methods in turns, same tokens; kernels: {switch.describe()}.\n\n"
            + markdown_table(["what", "ms"], rows)
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(result['machine'])}.\n")
    out = Path(args.out)
    write_benchmark(out.parent, out.name, result, text)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
