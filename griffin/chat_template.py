"""Chat templates: rendering conversations with the target's own template, and finding the assistant tokens.

Assistant spans are found by rendering the conversation turn by turn (template-agnostic): the text an assistant turn
adds is ``render(messages[:i+1]) - render(messages[:i], add_generation_prompt=True)``. Tokens whose first character
falls inside such a span get loss mask 1. Built-in templates cover tokenizers that ship none (Vicuna, Llama-2 base).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

# Written for this package from the public format descriptions of each family.
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama-2": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set sys = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}"
        "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
        "{% for m in msgs %}{% if m['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + (sys if loop.first else '') + m['content'].strip() + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
    ),
    "llama-3": (
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'].strip() + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "vicuna": (
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'].strip() + ' ' }}"
        "{% set msgs = messages[1:] %}"
        "{% else %}{{ \"A chat between a curious user and an artificial intelligence assistant. The assistant gives "
        "helpful, detailed, and polite answers to the user's questions. \" }}{% set msgs = messages %}{% endif %}"
        "{% for m in msgs %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'].strip() + ' ' }}"
        "{% else %}{{ 'ASSISTANT: ' + m['content'].strip() + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
    ),
}


ROLES = ("system", "user", "assistant", "tool")  # what chat templates know; anything else is refused up front


class TemplateError(ValueError):
    pass


def check_messages(messages) -> list[dict[str, str]]:
    """A conversation as a list of ``{"role", "content"}`` dicts with known roles and text content, or a clear error."""
    if isinstance(messages, dict) or not isinstance(messages, (list, tuple)) or not messages:
        raise TemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise TemplateError(f"message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
        if message["role"] not in ROLES:
            raise TemplateError(f"message {i} has role {message['role']!r}, which chat templates do not know: use "
                                f"one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise TemplateError(f"message {i} has content of type {type(message['content']).__name__}: pass text")
    return list(messages)


def set_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None) -> None:
    """Install a built-in template by name, a Jinja file, or keep the tokenizer's own (``None``)."""
    if template is None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template: pass one of "
                                f"{sorted(BUILTIN_TEMPLATES)} or a .jinja file (--chat-template)")
        return
    if template in BUILTIN_TEMPLATES:
        tokenizer.chat_template = BUILTIN_TEMPLATES[template]
    elif Path(template).is_file():
        tokenizer.chat_template = Path(template).read_text()
    else:
        raise TemplateError(f"unknown chat template {template!r}: use one of {sorted(BUILTIN_TEMPLATES)} or a file")


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The conversation as text by the tokenizer's chat template; a template that refuses it raises TemplateError."""
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template: pass token ids or a string instead of messages, or "
                            "set tokenizer.chat_template (training: --chat-template)")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as err:
        raise TemplateError(f"the chat template refused the conversation: {err}") from err


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[str, list[tuple]]:
    """The rendered conversation and the character spans of its assistant turns (end-of-turn marker included)."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise TemplateError("the chat template does not render conversations prefix by prefix, so assistant "
                                "tokens cannot be located; pass --chat-template with a template that does")
        spans.append((len(before), len(through)))
    return full, spans


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [T] (int64) and loss_mask [T] (uint8, 1 on assistant tokens), truncated to ``max_len``."""
    import torch

    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    starts = torch.tensor([start for start, _ in enc["offset_mapping"]], dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    for lo, hi in spans:
        mask |= ((starts >= lo) & (starts < hi)).to(torch.uint8)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ready for the assistant's next turn."""
    text = render(tokenizer, check_messages(messages), add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
