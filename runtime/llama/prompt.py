"""Prompt tokens: the GGUF's own chat template (jinja, as llama-cpp-python renders it), or raw text."""

from __future__ import annotations

from typing import Sequence


def render_chat(target, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = target.chat_template()
    if template is None:
        from blockspec.runtime.errors import BlockspecError

        raise BlockspecError(f"{target.path.name} has no chat template (tokenizer.chat_template); use --raw")
    fmt = Jinja2ChatFormatter(template=template, eos_token=target.token_text(target.eos),
                              bos_token=target.token_text(target.bos), add_generation_prompt=add_generation_prompt)
    return fmt(messages=list(messages)).prompt


def prompt_tokens(target, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
    if raw:
        return target.tokenize(prompt, add_special=True, parse_special=False)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return chat_tokens(target, messages)


def chat_tokens(target, messages: Sequence[dict]) -> list[int]:
    text = render_chat(target, messages)
    # a template that writes the BOS text itself must not get a second BOS from the tokenizer
    bos_text = target.token_text(target.bos)
    add_special = not (bos_text and text.startswith(bos_text))
    return target.tokenize(text, add_special=add_special, parse_special=True)
