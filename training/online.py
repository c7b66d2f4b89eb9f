"""Target features computed inside the training step (``train --online``), with the read interface of a store.

A stored feature costs disk, ``T * H * 2`` bytes per token for the last layer and three times that again for the
three layers EAGLE-3-generation heads read (24 KB per token for an 8B target), and one target forward per token,
shared by every head trained on the store. Online features cost no disk and one target forward per token per head and
epoch. :class:`OnlineFeatures` tokenizes the data once and runs the frozen target on each batch through the same
function feature building uses (:func:`training.build_features.conversations_with_features`, features rounded to
the same storage dtype), so a batch is the same either way.
"""

from __future__ import annotations

import logging
from itertools import chain, islice
from pathlib import Path

import torch

from griffin.chat_template import set_chat_template
from griffin.target import load_target, target_fingerprint

from .build_features import conversations_with_features, feature_layers, tokenize_records
from .data import iter_records
from .store import Conversation, StoreError

log = logging.getLogger("train")


class OnlineFeatures:
    """``len``, ``length(i)``, ``loss_mask(i)``, ``token_counts()``, ``items(indices)``, ``manifest`` and
    ``feature_layers`` as :class:`training.store.FeatureStore` has them, the features computed on demand."""

    def __init__(self, target: str, data: list[str], max_len: int, max_samples: int | None, layers,
                 device: torch.device, prepare=None, chat_template: str | None = None, trust_remote_code: bool = False):
        """``layers``: ``build_features --feature-layers`` (None, 'auto' or three indices); ``prepare``: a function
        that places the frozen target for the trainer (``accelerator.prepare_model``: sharded under FSDP)."""
        model, self.tokenizer = load_target(target, device=device, trust_remote_code=trust_remote_code)
        set_chat_template(self.tokenizer, chat_template)
        self.device = device
        self.decoder = (prepare or (lambda m: m))(model.get_decoder())
        self.lm_head = model.get_output_embeddings()
        self.folder = Path(data[0])
        records = list(islice(chain.from_iterable(iter_records(source) for source in data), max_samples))
        self.conversations, skipped = tokenize_records(records, self.tokenizer, max_len)
        if skipped:
            log.info("online features: %d of %d records skipped %s", sum(skipped.values()), len(records), skipped)
        if not self.conversations:
            raise StoreError(f"every record of {', '.join(data)} was skipped ({skipped}): check --data, or raise "
                             "--max-len if the prompts are longer than it")
        self.vocab_size = model.get_input_embeddings().num_embeddings
        compute = model.get_input_embeddings().weight.dtype
        self.storage_dtype = torch.bfloat16 if compute == torch.bfloat16 else torch.float16
        self.manifest = {"target": target, "target_fingerprint": target_fingerprint(model.config),
                         "hidden_size": model.config.hidden_size, "max_len": max_len,
                         "dtype": str(self.storage_dtype).removeprefix("torch."),
                         "feature_layers": feature_layers(layers, model.config)}

    @property
    def feature_layers(self) -> list[int] | None:
        return self.manifest["feature_layers"]

    def __len__(self) -> int:
        return len(self.conversations)

    def length(self, i: int) -> int:
        return len(self.conversations[i][0])

    def loss_mask(self, i: int) -> torch.Tensor:
        return self.conversations[i][1]

    def token_counts(self) -> torch.Tensor:
        """Frequency of every token id among the assistant tokens [V]."""
        ids = torch.cat([ids[mask.bool()] for ids, mask in self.conversations])
        return torch.bincount(ids, minlength=self.vocab_size)

    def items(self, indices: list[int]) -> list[Conversation]:
        """Conversations ``indices`` with their features: one forward of the frozen target."""
        return conversations_with_features(self.decoder, [self.conversations[i] for i in indices],
                                           self.tokenizer.pad_token_id, self.device, self.storage_dtype,
                                           self.feature_layers, self.lm_head)
