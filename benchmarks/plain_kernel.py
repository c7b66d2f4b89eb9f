"""Which kernel makes plain decoding fastest: the one-row linear layers of a decode step, side by side.

    OMP_NUM_THREADS=1 python -m benchmarks.plain_kernel     # embedded target, fp32 and bf16, 100 rounds

A plain decode step feeds one token, so each of the target's linear layers multiplies one row. This times one decode
step of our plain loop (:func:`griffin.plain.plain_generate`: the target's forward over one token after a
``--context``-token cache, its logits and the argmax) with each one-row kernel of :mod:`griffin.kernels`:
``F.linear`` (what transformers runs), weight-major (W @ x^T), the row padded to two rows through the two-row
weight-major product, and oneDNN over a packed weight (where torch has oneDNN). After a warm-up the kernels take
turns step by step, in a rotated order each round, so that load from other processes falls on all of them alike;
the table reports the median wall time and the median CPU time of this process per step (on a shared machine the CPU
time is the steadier figure at one thread). It also checks that the plain loop writes the same tokens with every
kernel.

It also runs the measurement that :func:`griffin.kernels.choose_kernels` makes on each machine (every linear layer of
the target over 1..32 rows, ``F.linear`` against weight-major and oneDNN) and reports the choice. Writes
``benchmarks/results/plain-kernel.json`` and ``.md`` (``--out-dir`` for another machine's folder).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from griffin.cli import run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.report import command_line, machine_info, machine_text, markdown_table, write_benchmark

PROMPT = "Describe how a steam engine turns heat into motion."  # a generic request, not an evaluation question
RESULTS = Path("benchmarks/results")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plain_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated target dtypes")
    p.add_argument("--context", type=int, default=256, help="cached tokens before the timed step")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=32, help="tokens of the same-output check")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.argv = argv
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.dtypes or any(d not in ("fp32", "bf16") for d in args.dtypes):
        p.error("--dtypes must list fp32 and/or bf16")
    if min(args.context, args.rounds, args.new_tokens) < 1:
        p.error("--context, --rounds and --new-tokens must be at least 1")
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch
from tqdm.auto import tqdm

from griffin.chat_template import prompt_ids
from griffin.family import output_logits
from griffin.kernels import ONE_ROW_KERNELS, WeightMajorLinears, measure_kernels, pick
from griffin.kv_cache import BufferCache, cached_forward
from griffin.plain import plain_generate
from griffin.sampling import SamplingConfig, greedy
from griffin.target import load_target


@torch.inference_mode()
def measure(model, ids: torch.Tensor, context: int, rounds: int, new_tokens: int) -> dict:
    decoder = model.get_decoder()
    cache = BufferCache(model.config.get_text_config().num_hidden_layers, context + 1)
    tokens = torch.randint(0, model.config.vocab_size, (context + 1,), generator=torch.Generator().manual_seed(0))
    cached_forward(decoder, cache, input_ids=tokens[None, :context], position_ids=torch.arange(context)[None])
    position = torch.tensor([[context]])

    def step(kernel: str) -> tuple[float, float]:
        with WeightMajorLinears(model, 0, kernel):
            t0, c0 = time.perf_counter(), time.process_time()
            hidden = cached_forward(decoder, cache, input_ids=tokens[None, context:],
                                    position_ids=position).last_hidden_state
            greedy(output_logits(model, hidden[0, -1]))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        cache.crop(context)
        return wall, cpu

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ONE_ROW_KERNELS}
    for r in tqdm(range(rounds + 3), desc="rounds", dynamic_ncols=True):
        shift = r % len(ONE_ROW_KERNELS)
        for k in ONE_ROW_KERNELS[shift:] + ONE_ROW_KERNELS[:shift]:
            t = step(k)
            if r >= 3:  # three warm-up rounds
                times[k].append(t)
    no_eos = torch.tensor([], dtype=torch.long)
    outputs = {k: plain_generate(model, ids, new_tokens, SamplingConfig(0.0), no_eos, one_row=k)
               for k in ONE_ROW_KERNELS}
    return {k: {"wall_ms": 1000 * statistics.median(w for w, _ in t),
                "cpu_ms": 1000 * statistics.median(c for _, c in t),
                "same_tokens_as_linear": bool(torch.equal(outputs[k], outputs["linear"]))} for k, t in times.items()}


def table(result: dict) -> str:
    rows = []
    for dtype, kernels in result["dtypes"].items():
        base = kernels["linear"]
        for name, k in kernels.items():
            rows.append([dtype, name, k["wall_ms"], f"{base['wall_ms'] / k['wall_ms']:.3f}x", k["cpu_ms"],
                         f"{base['cpu_ms'] / k['cpu_ms']:.3f}x", "yes" if k["same_tokens_as_linear"] else "no",
                         "**fastest**" if name == result["best"][dtype] else ""])
    layer_rows = []
    kernels = [k for k in next(iter(next(iter(result["layers"].values()))["rows"].values())) if k != "linear"]
    for dtype, layers in result["layers"].items():
        for n, t in layers["rows"].items():
            layer_rows.append([dtype, n, 1000 * t["linear"], *(x for k in kernels for x in (
                1000 * t[k], f"{t['linear'] / t[k]:.2f}x"))])
    choices = "; ".join(f"{dtype}: {layers['choice']['text']}" for dtype, layers in result["layers"].items())
    machine = result["machine"]
    return (f"# One-row kernel of plain decoding\n\nOne decode step of our plain loop (one token after a "
            f"{result['context']}-token cache, logits, argmax), target {result['target']}; medians of "
            f"{result['rounds']} interleaved rounds after a warm-up. 'same tokens': the plain loop's "
            f"{result['new_tokens']} greedy tokens after a chat prompt equal those with `F.linear`. The fastest kernel "
            "is chosen by CPU time.\n\n"
            + markdown_table(["dtype", "one-row kernel", "wall ms/step", "speed vs F.linear", "CPU ms/step",
                              "speed vs F.linear (CPU)", "same tokens", ""], rows)
            + "\n## Small inputs: what `griffin.kernels.choose_kernels` measures\n\nEvery linear layer of the target "
            "once over n rows, medians of interleaved rounds (wall ms).\n\n"
            + markdown_table(["dtype", "rows", "F.linear ms", *(h for k in kernels for h in (f"{k} ms", f"{k} speed"))],
                             layer_rows)
            + f"\nChoice on this machine: {choices}.\n"
            + f"\nCommand: `{result['command']}`\n\nMachine: {machine_text(machine)}, load average "
            f"{machine['load_average_1m']} (this run's own threads count in it).\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict = {"target": args.target, "context": args.context, "rounds": args.rounds,
                    "new_tokens": args.new_tokens, "dtypes": {}, "best": {}, "layers": {}}
    for dtype in args.dtypes:
        model, tokenizer = load_target(args.target, dtype=dtype)
        ids = torch.tensor(prompt_ids(tokenizer, [{"role": "user", "content": PROMPT}]))
        kernels = measure(model, ids, args.context, args.rounds, args.new_tokens)
        result["dtypes"][dtype] = kernels
        result["best"][dtype] = min(kernels, key=lambda k: kernels[k]["cpu_ms"])
        layers = measure_kernels(model)
        one_row, max_rows, rows_kernel = pick(layers)
        text = WeightMajorLinears(model, max_rows, one_row, rows_kernel).describe()
        result["layers"][dtype] = {**layers, "choice": {"one_row": one_row, "max_rows": max_rows,
                                                        "rows_kernel": rows_kernel, "text": text}}
        del model
    result["machine"] = machine_info()
    result["command"] = command_line("benchmarks.plain_kernel", args.argv)
    write_benchmark(args.out_dir, "plain-kernel", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
