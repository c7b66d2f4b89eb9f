"""The recipe's command line (light: no torch), so that --help and usage errors answer at once."""

from __future__ import annotations

import argparse
import sys

from griffin.constants import EMBEDDED_TARGET

from ..data import DEFAULT_DATA
from .schedule import GEN3, HEADS, STAGE1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.recipe", description=sys.modules[__package__].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generation", type=int, choices=[2, 3], default=2,
                   help="2: the shipped heads (EAGLE-2, HASS, GRIFFIN and its ablation; one target layer); 3: the "
                        "EAGLE-3 generation, eagle3 and griffin3 (three target layers, training-time test), with "
                        "their own work folders and record (default: %(default)s)")
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--data", default=DEFAULT_DATA, help="ShareGPT-format conversations (default: the wheel's)")
    p.add_argument("--work", help="local work folder (regenerated text, chunk features, training runs); lost with "
                   "the machine (default: work/recipe, generation 3: work/recipe3)")
    p.add_argument("--sharegpt-store",
                   help="the feature store of all ShareGPT records, built a chunk at a time (shared; a chunk's "
                        "shards are deleted once every head has trained on it, unless --keep-features; default: "
                        "work/features-sharegpt, generation 3: work/features-sharegpt-3layers)")
    p.add_argument("--checkpoints",
                   help="the recipe's export folder: every head after every chunk, recipe.json and its README; a "
                        "rerun continues from it (default: work/recipe/heads, git-ignored; generation 3: "
                        "checkpoints/<target>-recipe3, tracked, since its heads are still training: commit it before "
                        "a machine goes, and a fresh clone continues from it)")
    p.add_argument("--ship", default="checkpoints",
                   help="where --promote ships the finished heads, as <target>-<head>; a fresh --checkpoints folder "
                        "starts from the heads there, as --record says they were trained")
    p.add_argument("--record",
                   help="the committed recipe.json of the run that trained the shipped heads: a fresh --checkpoints "
                        "folder continues from it where the settings are the same (default: "
                        "benchmarks/results/recipe/recipe.json, generation 3: benchmarks/results/recipe3/recipe.json)")
    p.add_argument("--shard-records", type=int, default=256, help="records per feature shard and regeneration part")
    p.add_argument("--chunk-shards", type=int, default=4, help="shards per chunk")
    p.add_argument("--stage-chunks", default="0.5,0.25,0.25",
                   help="fractions of the chunks given to stages 1 (K=1), 2 and 3")
    p.add_argument("--regen-records", type=int, default=1024,
                   help="first turns per group answered by the target (default: all of a group of 4 shards of 256; "
                        "0 = none; rounded up to whole shards, at most the group's records); a rerun may change it "
                        "for the groups it has not started (chunks 1-19 were answered with 512)")
    p.add_argument("--regen-batch", type=int, default=16, help="prompts per generate call (pipeline-throughput.md)")
    p.add_argument("--regen-engine", default="plain", choices=["plain", "speculative", "generate"],
                   help="training.regenerate --engine: our batched plain loop (default: no head needed, finished rows "
                        "leave the batch), batched speculation with the shipped head (its tree tuned per batch size) "
                        "or transformers generate (the answers of generation 3's chunks up to 17 and of every earlier "
                        "recipe); pipeline-throughput.md compares them")
    p.add_argument("--regen-new-tokens", type=int, default=320)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="tokens the heads can propose (default: 8192 for a new recipe, else its record's); a rerun "
                        "with a larger N widens each head before its next chunk (python -m training.vocab)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="compute dtype of every step (regeneration, features, and autocast in training and scoring); "
                        "auto: bf16 on a GPU or a CPU with bf16 instructions (AVX512-BF16 or AMX), else fp32, since "
                        "emulated bf16 is 6-16x slower (benchmarks/results/pipeline-throughput-avx2)")
    p.add_argument("--chunks", type=int, default=None, help="stop after this many chunks (default: all)")
    p.add_argument("--heads", default=None,
                   help="comma-separated heads to train now (default: all); the others catch up on a later run")
    p.add_argument("--threads", type=int, default=1, help="threads of every step (OMP_NUM_THREADS of its process)")
    p.add_argument("--jobs", type=int, default=1,
                   help="steps run at once, each a process of --threads threads: from 2 on, the data of the next "
                        "--ahead chunks (regeneration, features) is built while the heads train on this one, and the "
                        "heads of a chunk train side by side as processes are free; training steps go first")
    p.add_argument("--ahead", type=int, default=3,
                   help="with --jobs 2 or more: chunks whose data is built ahead of the training (each built once "
                        "a process is free and no training step waits for one); 0: none, every process goes to the "
                        "present chunk's heads (to finish a chunk sooner, e.g. before the machine goes)")
    p.add_argument("--commit", action="store_true",
                   help="git-commit --checkpoints as the run goes (a tracked folder, on a work branch: "
                        "docs/training.md)")
    p.add_argument("--commit-every", type=int, default=3600, help="seconds between commits (stage ends always)")
    p.add_argument("--keep-features", action="store_true",
                   help="keep each chunk's features after every head has trained on it (default: delete them, "
                        "3.2 GB per ShareGPT chunk with three target layers)")
    p.add_argument("--plan", action="store_true", help="print the state and the next steps, run nothing")
    p.add_argument("--promote", action="store_true",
                   help="once every head has consumed every chunk: ship them, exported with their cards to "
                        "--ship/<target>-<head> (the folders benchmarks.ablation and the default head read), and run "
                        "nothing else")
    args = p.parse_args(argv)
    try:
        fractions = [float(x) for x in args.stage_chunks.split(",")]
        assert len(fractions) == 3 and all(f > 0 for f in fractions)
    except (ValueError, AssertionError):
        p.error("--stage-chunks must be three positive fractions, e.g. 0.5,0.25,0.25")
    args.fractions = fractions
    third = args.generation == 3
    defaults = {"work": "work/recipe3" if third else "work/recipe",
                "sharegpt_store": "work/features-sharegpt-3layers" if third else "work/features-sharegpt",
                "checkpoints": f"checkpoints/{args.target.rstrip('/').split('/')[-1]}-recipe3" if third
                else "work/recipe/heads",
                "record": f"benchmarks/results/recipe{'3' if third else ''}/recipe.json"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = {h.name for h in (GEN3 if third else STAGE1 + HEADS)}
    args.heads = [h for h in args.heads.split(",") if h] if args.heads else []
    if any(h not in names for h in args.heads):
        p.error(f"--heads must name some of {', '.join(sorted(names))}")
    if min(args.chunk_shards, args.shard_records, args.jobs, args.threads) < 1 or min(args.ahead,
                                                                                     args.regen_records) < 0:
        p.error("--chunk-shards, --shard-records, --jobs and --threads must be at least 1, --ahead and "
                "--regen-records at least 0")
    return args
