"""Score a trained head on a feature store, the way training validates it: top-1, top-k, kept and loss per pass.

    python -m training.evaluate checkpoints/smollm2-135m-instruct-griffin --features work/val --steps 3
    python -m training.evaluate HEAD --features STORE --steps 1 --topk 3 --out HEAD/fixed-val.json

Every conversation of the store is scored (training's own validation scores its held-out 5 % of the training store;
this scores any store, e.g. one fixed set across the chunks of ``training.recipe``, so that heads trained on different
data are compared on the same conversations). The head's own draft vocabulary is used; ``--steps`` passes are rolled
out with the ``--topk`` alignment mask, as in training. Top-1, top-k and kept are the accuracy figures; the loss is
the default training loss (soft cross-entropy, token weight 0.1), comparable only between heads scored alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from griffin.cli import nonnegative_int, positive_int, run_cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", help="head folder (config.json + model.safetensors) or its Hugging Face Hub id")
    p.add_argument("--features", required=True, help="feature store built by training.build_features")
    p.add_argument("--steps", type=positive_int, default=1, help="forward passes, K (default: %(default)s)")
    p.add_argument("--topk", type=nonnegative_int, default=3, help="alignment mask top-k; 0 = none")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16"], help="autocast, as in training")
    p.add_argument("--out", default=None, help="write the report here as JSON (atomically)")
    return p.parse_args(argv)


if __name__ == "__main__":  # --help and usage errors answer here, before torch loads
    parse_args()

import torch

from griffin.draft import DraftModel
from griffin.hub import resolve
from griffin.io import atomic_write_json
from griffin.target import load_target_head

from .objective import MultiPassObjective, pass_report, score_store
from .store import FeatureStore, StoreError
from .train import check_target


def evaluate(head: str | Path, features: str | Path, steps: int = 1, topk: int = 3, batch_size: int = 4,
             mixed_precision: str = "no") -> dict:
    """-> {"head", "features", "conversations", "steps", "topk", "passes": [per pass: loss, top1, topk, kept]}."""
    if not (resolve(head, kind="draft head") / "config.json").is_file():
        raise StoreError(f"{head} is not a head folder (no config.json)")
    store = FeatureStore(features)
    if len(store) == 0:
        raise StoreError(f"{features} holds no conversations")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target_head = load_target_head(store.manifest["target"], device=device)
    check_target(store, None, target_head)
    draft = DraftModel.from_pretrained(head).float().to(device).attach(target_head)
    if topk > draft.config.output_vocab_size:
        raise StoreError(f"--topk {topk} is larger than the head's draft vocabulary ({draft.config.output_vocab_size})")
    objective = MultiPassObjective(draft, steps, topk).eval()
    bf16 = mixed_precision == "bf16"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    totals = score_store(objective, store, list(range(len(store))), batch_size, None, device, autocast)
    return {"head": str(head), "features": str(features), "conversations": len(store), "steps": steps, "topk": topk,
            "mixed_precision": mixed_precision, "passes": pass_report(totals, objective.report_k)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = evaluate(args.head, args.features, args.steps, args.topk, args.batch_size, args.mixed_precision)
    if args.out:
        atomic_write_json(Path(args.out), report)
    print(json.dumps(report["passes"]))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, (StoreError,)))
