"""Batched speculative generation at a real target's shape: throughput per batch size with an oracle drafter.

    python -m benchmarks.gpu_batching                                     # llama2-7b shape, bf16 on a GPU
    python -m benchmarks.gpu_batching --batch-sizes 1,4,16 --chains 2,4   # fewer points
    python -m benchmarks.gpu_batching --shape tiny --device cpu           # seconds, on any machine

The target is :func:`benchmarks.gpu_engine.random_target` (random weights of the named shape, built on the device),
so only an oracle can draft for it: row b proposes the next K tokens of its own reference run
(:class:`griffin.batch.BatchOracle`), the ceiling of any drafter that drafts chains of K. Per batch size B (the
first B of ``--batch-sizes``' largest set of prompts, lengths between half and all of ``--prompt-len``):

1. transformers' batched ``generate`` (left-padded, with its attention mask) and our batched plain loop
   (:func:`griffin.batch.decode_rows` without a drafter): new tokens per second over the batch;
2. one target pass over n = 1 and K+1 tokens per row (:func:`griffin.autotune.forward_cost_rows`);
3. for each chain length K: the oracle's τ (tokens per row per target pass), tokens per second and speedup over the
   faster plain decoding. The reference is our batched plain loop's rows; where a row's tokens differ from it (bf16
   rounds a near-tie differently in a pass over K+1 tokens), the oracle is run again on its own output
   (``--passes``), as :mod:`benchmarks.gpu_engine` does. Every run is timed after a short warm-up at that size, the
   GPU's clock is brought up first (:func:`benchmarks.gpu_engine.settle`), and the two plain decodings are timed
   before and after the oracle (the faster of each counts).

Writes ``<out-dir>/batching-<gpu>[-<tag>].{json,md}`` after every batch size, so a run stopped early keeps what it
measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.batching import sizes
from griffin.cli import positive_int, run_cli
from griffin.io import atomic_write_json, atomic_write_text
from griffin.report import command_line, machine_info, markdown_table, write_benchmark


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_batching", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b", help="a shape of benchmarks.gpu_engine (llama2-7b, llama3-8b, tiny)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default: bf16 on cuda, else fp32")
    p.add_argument("--batch-sizes", type=sizes, default=[1, 2, 4, 8, 16])
    p.add_argument("--chains", type=sizes, default=[1, 2, 4, 6], help="oracle chain lengths K (tokens per row)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="per row")
    p.add_argument("--prompt-len", type=positive_int, default=256, help="the longest prompt")
    p.add_argument("--passes", type=positive_int, default=3, help="oracle runs at most, per batch size and chain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="appended to the result file's name (batching-<gpu>-<tag>)")
    p.add_argument("--out-dir", default="benchmarks/results/gpu")
    p.add_argument("--table", metavar="FILE.json", help="only write FILE.md from a result file")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.gpu_engine import (
        SHAPES,
        IdTokenizer,
        gpu_info,
        random_target,
        settle,
        slug,
        timed,
        untrained_head,
        write_table,
    )
    if args.table:
        return write_table(Path(args.table), markdown)
    from griffin import SpecGenerator
    from griffin.autotune import forward_cost_rows
    from griffin.batch import BatchOracle, decode_rows
    from griffin.decode import GenerationStats
    from griffin.sampling import SamplingConfig
    from griffin.target import resolve_dtype

    if args.shape not in SHAPES:
        raise ValueError(f"--shape {args.shape!r} is not one of {', '.join(SHAPES)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA GPU")
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(args.seed)
    model, build_s = timed(device, lambda: random_target(args.shape, device, resolve_dtype(dtype_name)))
    vocab = model.config.vocab_size
    gen = SpecGenerator(model, IdTokenizer(vocab), untrained_head(model, device, 0), depth=1, top_k=1,
                        total_tokens=1, draft_dtype=resolve_dtype(dtype_name))
    rng = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (max(args.batch_sizes),), generator=rng)
    prompts = [torch.randint(0, vocab, (int(n),), generator=rng).to(device) for n in lengths]
    eos = torch.empty(0, dtype=torch.long, device=device)  # random targets have no EOS: every row runs its budget
    greedy = SamplingConfig()
    gpu = gpu_info(device)
    stem = f"batching-{slug(gpu['name'])}" + (f"-{args.tag}" if args.tag else "")
    result = {"shape": args.shape, "parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype_name,
              "build_s": build_s, "new_tokens": args.new_tokens, "prompt_lengths": lengths.tolist(),
              "chains": args.chains, "gpu": gpu, "machine": machine_info(), "batches": {}, "complete": False,
              "command": command_line("benchmarks.gpu_batching", argv)}

    def hf(rows: list[torch.Tensor], n: int) -> None:
        longest = max(r.shape[0] for r in rows)
        ids = torch.stack([torch.nn.functional.pad(r, (longest - r.shape[0], 0)) for r in rows])
        mask = torch.stack([torch.arange(longest, device=device) >= longest - r.shape[0] for r in rows]).long()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           top_p=None, top_k=None, temperature=None, pad_token_id=0)

    def ours(rows: list[torch.Tensor], n: int, drafter=None) -> tuple[list[list[int]], GenerationStats]:
        stats = GenerationStats()
        return decode_rows(gen.backend, drafter, rows, [n] * len(rows), greedy, eos, None, stats), stats

    def oracle(rows: list[torch.Tensor], reference: list[list[int]], k: int):
        """-> (rows' tokens, stats, seconds of the last run, runs): where a row's tokens differ from what the oracle
        proposed, the next run proposes the engine's own."""
        runs = 0
        while True:
            runs += 1
            drafter = BatchOracle(reference, k)
            (out, stats), seconds = timed(device, lambda: ours(rows, n, drafter))  # noqa: B023 - called at once
            if out == reference or runs == args.passes:
                return out, stats, seconds, runs
            reference = out

    n = args.new_tokens
    for b in args.batch_sizes:
        rows = prompts[:b]
        hf(rows, 4)  # warm-up at this batch size
        ours(rows, 4)
        ours(rows, 4, BatchOracle([[0] * 4] * b, max(args.chains)))
        settle(model, device, 6.0 if b == args.batch_sizes[0] else 1.0)
        _, hf_s = timed(device, lambda rows=rows: hf(rows, n))
        (reference, _), plain_s = timed(device, lambda rows=rows: ours(rows, n))
        costs = forward_cost_rows(gen, b, sorted({1, *(k + 1 for k in args.chains)}), context=args.prompt_len)
        oracles = {k: oracle(rows, reference, k) for k in args.chains}
        hf_s = min(hf_s, timed(device, lambda rows=rows: hf(rows, n))[1])  # baselines timed before and after
        plain_s = min(plain_s, timed(device, lambda rows=rows: ours(rows, n))[1])
        best = b * n / min(hf_s, plain_s)
        entry = {"generate_tokens_per_s": b * n / hf_s, "plain_tokens_per_s": b * n / plain_s,
                 "pass_s": {str(k): v for k, v in costs.items()}, "oracle": {}}
        for k, (out, stats, seconds, runs) in oracles.items():
            entry["oracle"][str(k)] = {"tau": stats.tau, "tokens_per_s": b * n / seconds,
                                       "speedup": b * n / seconds / best, "runs": runs,
                                       "identical_to_plain": out == reference,
                                       "pass_multiple": costs[k + 1] / costs[1]}
        result["batches"][str(b)] = entry
        print(f"B={b}: generate {entry['generate_tokens_per_s']:.1f}, plain {entry['plain_tokens_per_s']:.1f} "
              "tokens/s; oracle " + ", ".join(f"K={k} τ {o['tau']:.2f} {o['speedup']:.2f}x"
                                              for k, o in entry["oracle"].items()), file=sys.stderr, flush=True)
        atomic_write_json(Path(args.out_dir) / f"{stem}.json", result)
        atomic_write_text(Path(args.out_dir) / f"{stem}.md", markdown(result))
    result["complete"] = True
    write_benchmark(args.out_dir, stem, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    g, m = result["gpu"], result["machine"]
    where = (f"{g['name']} ({g['memory_gb']} GiB, {g['multiprocessors']} SMs), CUDA {g['cuda']}"
             if g["name"] != "cpu" else f"{m['cpu']}, {m['cores']} cores")
    chains = [str(k) for k in result["chains"]]
    rows = []
    for b, e in result["batches"].items():
        best_k = max(e["oracle"], key=lambda k: e["oracle"][k]["speedup"])
        rows.append([b, e["generate_tokens_per_s"], e["plain_tokens_per_s"],
                     *(f"{e['oracle'][k]['speedup']:.2f}x (τ {e['oracle'][k]['tau']:.2f}, pass "
                       f"{e['oracle'][k]['pass_multiple']:.2f}x)" for k in chains),
                     f"K={best_k}: {e['oracle'][best_k]['speedup']:.2f}x"])
    paying = [b for b, e in result["batches"].items() if max(o["speedup"] for o in e["oracle"].values()) >= 1.0]
    stops = [b for b in result["batches"] if b not in paying]
    verdict = (f"An oracle chain pays (≥ 1.0x the faster plain decoding) at batch {', '.join(paying) or 'none'}"
               + (f"; it stops paying at batch {', '.join(stops)}." if stops else " measured."))
    runs = sum(o["runs"] for e in result["batches"].values() for o in e["oracle"].values())
    same = sum(o["identical_to_plain"] for e in result["batches"].values() for o in e["oracle"].values())
    total = sum(len(e["oracle"]) for e in result["batches"].values())
    return (f"# Batched generation at the {result['shape']} shape on {g['name']}\n\n"
            f"{where}, torch {m['torch']}, transformers {m['transformers']}; {result['parameters'] / 1e9:.2f} B "
            f"random-weight parameters in {result['dtype']}, {result['new_tokens']} new tokens per row, prompts of "
            f"{min(result['prompt_lengths'])}-{max(result['prompt_lengths'])} tokens"
            f"{'' if result['complete'] else ' — INCOMPLETE (stopped early)'}.\n\n"
            "Throughput is new tokens per second over the batch. Each oracle column: speedup of our batched engine "
            "with an oracle chain of K tokens per row over the faster of transformers' batched `generate` and our "
            "batched plain loop, its τ (tokens per row per target pass) and the cost of its pass over K+1 tokens per "
            "row as a multiple of the one-token pass at that batch size.\n\n"
            + markdown_table(["B", "generate tok/s", "plain loop tok/s", *(f"oracle K={k}" for k in chains), "best"],
                             rows)
            + f"\n{verdict} Oracle rows identical to the batched plain loop's: {same} of {total} (chain, batch) runs "
              f"({runs} runs in all; bf16 may round a near-tie differently in a pass over K+1 tokens, and the oracle "
              "then re-proposes the engine's own tokens).\n\n"
            f"Command: `{result['command']}` ({m['date']})\n")


if __name__ == "__main__":
    sys.exit(run_cli(main, (RuntimeError,)))
