"""Can a standalone draft LM speculate for a target? Only if both read and write the same token ids.

:func:`check_compatible` compares, in this order, and raises :class:`TokenizerMismatch` naming the first difference:

1. vocabulary size, and each model's logits width (it must cover the vocabulary; widths may differ by padding rows,
   which no text encodes: the draft then proposes only ids the target can score, and q = 0 beyond them is exact);
2. special tokens: every special token of either tokenizer (BOS, EOS, PAD, UNK, chat-template tokens such as
   ``<|im_start|>``) must have the same id in both. Roles may differ (a base draft whose EOS is ``<|endoftext|>`` can
   serve an instruct target whose EOS is ``<|im_end|>``): the target alone decides when to stop;
3. the rest of the vocabulary (token string -> id);
4. the encodings of sample strings (whitespace, digits, non-English text, code, emoji), which catches different
   normalisers and pre-tokenisers over the same vocabulary;
5. the target's chat template rendered on a sample conversation, encoded by both.

The whole check takes a fraction of a second, even for 150k-token vocabularies.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

SAMPLES = (
    "Hello, world! How are you today?",
    "  two leading spaces,   three inside,\ttab,\n\nnew lines and trailing space ",
    "0 7 42 1234567 3.14159 -2.5e-3 1,000,000 2024-11-23 12:30",
    "Grüße aus München. Ça va? ¿Qué tal? Привет, мир. 你好，世界。こんにちは。안녕하세요. مرحبا بالعالم",
    "def f(x: int) -> dict:\n    return {'a': [x ** 2, x // 3]}  # comment\n\tif x != 0: print(f\"{x!r}\")",
    "Emoji: 🙂 🚀👍🏽 👨‍👩‍👧 ❤️ and symbols ∑ √ ≤ → ©",
)
SAMPLE_CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi there!"},
               {"role": "assistant", "content": "Hello. 😀"}, {"role": "user", "content": "Count: 1 2 3"}]


class TokenizerMismatch(ValueError):
    """The draft's tokenizer (or logits) differ from the target's; the message names the first difference."""


def _show(token_id: int | None, tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    if token_id is None:
        return "absent"
    return f"id {token_id}" + (f" ({tokenizer.convert_ids_to_tokens(token_id)!r})" if tokenizer else "")


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Every special token string: the role tokens and the special added tokens (chat-template markers)."""
    roles = [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token]
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return list(dict.fromkeys(str(t) for t in [*roles, *tokenizer.all_special_tokens, *added] if t is not None))


def logits_width(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def check_compatible(target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase,
                     target_model=None, draft_model=None) -> None:
    """Raise :class:`TokenizerMismatch` unless the draft may propose tokens for the target (see the module doc)."""
    n_target, n_draft = len(target_tokenizer), len(draft_tokenizer)
    if n_target != n_draft:
        raise TokenizerMismatch(f"vocabulary size differs: the target's tokenizer has {n_target} tokens, the draft's "
                                f"{n_draft}; a draft LM must use the target's tokenizer")
    for name, model in (("target", target_model), ("draft", draft_model)):
        if model is not None and logits_width(model) < n_target:
            raise TokenizerMismatch(f"the {name} model's logits are {logits_width(model)} wide, fewer than its "
                                    f"tokenizer's {n_target} tokens")
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    for token in dict.fromkeys(_special_tokens(target_tokenizer) + _special_tokens(draft_tokenizer)):
        a, b = target_vocab.get(token), draft_vocab.get(token)
        if a != b:
            raise TokenizerMismatch(f"special token {token!r} is {_show(a)} in the target's tokenizer but {_show(b)} "
                                    "in the draft's")
    if target_vocab != draft_vocab:
        by_id = {i: t for t, i in draft_vocab.items()}
        for token, i in sorted(target_vocab.items(), key=lambda kv: kv[1]):
            if by_id.get(i) != token:
                raise TokenizerMismatch(f"vocabulary differs: id {i} is {token!r} in the target's tokenizer but "
                                        f"{by_id.get(i)!r} in the draft's")
    samples = list(SAMPLES)
    if getattr(target_tokenizer, "chat_template", None):
        samples.append(target_tokenizer.apply_chat_template(SAMPLE_CHAT, tokenize=False, add_generation_prompt=True))
    for text in samples:
        a = target_tokenizer(text, add_special_tokens=False)["input_ids"]
        b = draft_tokenizer(text, add_special_tokens=False)["input_ids"]
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise TokenizerMismatch(
                f"the tokenizers encode {text[:40]!r}{'...' if len(text) > 40 else ''} differently: token {i} is "
                f"{_show(a[i] if i < len(a) else None, target_tokenizer)} for the target but "
                f"{_show(b[i] if i < len(b) else None, draft_tokenizer)} for the draft")
