"""Which token ids end an assistant turn, and which id pads: from the chat template and generation config.

``tok.eos_token_id`` alone is not a fact to build on. Measured here: transformers 5.17 converts the demo
model's GGUF with ``eos_token = "<|im_start|>"`` and no pad token, while 5.24 writes ``<|im_end|>`` for
both — and ``<|im_start|>`` is the token that *opens* a turn. Code that stopped decoding or counted
acceptance on ``tok.eos_token_id`` would generate past the end of every answer on one version only.

So the end of a turn is read where it is defined:

1. the chat template: render a conversation whose assistant turn is a unique marker and take the first
   token the template puts after the marker (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3,
   ``<end_of_turn>`` for Gemma);
2. the model's ``generation_config.eos_token_id`` (an id or a list), which serving stacks stop on;
3. only when neither exists, the tokenizer's ``eos_token_id`` (said so in ``sources``).

A token the template uses to *open* a turn is never an end-of-turn id, whatever the config says. The pad
id is the generation config's, else the tokenizer's unless it opens a turn, else the first end-of-turn id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MARK = "AERIE-TURN-MARKER-7f3a"


class TokenFactsError(ValueError):
    pass


@dataclass
class TokenFacts:
    end_of_turn: list[int]  # every id that ends an assistant turn (stop ids), most specific first
    pad: int
    turn_openers: list[int] = field(default_factory=list)  # ids the template opens turns with
    sources: dict[str, str] = field(default_factory=dict)  # where each fact came from, for messages and docs

    @property
    def stop_ids(self) -> set[int]:
        return set(self.end_of_turn)


def id_list(value: Any) -> list[int]:
    """A config's token id field (an id, a list of ids, or unset) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def template_turn_ids(tok: Any) -> tuple[list[int], list[int]]:
    """(ids that close the assistant turn, ids that open a turn) per the tokenizer's chat template; ([], []) without one."""
    if not getattr(tok, "chat_template", None):
        return [], []
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARK}]
    try:
        text = tok.apply_chat_template(conv, tokenize=False)
    except Exception as exc:  # a template that cannot render a plain two-turn chat is itself a finding
        raise TokenFactsError(f"the chat template cannot render a user/assistant exchange: {exc}") from None
    if MARK not in text:
        raise TokenFactsError(
            "the chat template drops the assistant's content; cannot tell where a turn ends"
        )
    after = text[text.index(MARK) + len(MARK) :]
    closing = []
    ids = tok(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(getattr(tok, "all_special_ids", []) or []) | set(_added_special_ids(tok))
    for i in ids:
        if i in special:
            closing.append(int(i))
            break
        if tok.decode([i]).strip():
            break  # plain text after the content (no special end-of-turn token)
    before = text[: text.index(MARK)]
    opener_ids = tok(before, add_special_tokens=False)["input_ids"]
    openers = sorted({int(i) for i in opener_ids if i in special} - set(closing))
    return closing, openers


def _added_special_ids(tok: Any) -> list[int]:
    dec = getattr(tok, "added_tokens_decoder", None) or {}
    return [int(i) for i, t in dec.items() if getattr(t, "special", False)]


def resolve(tok: Any, generation_config: Any = None) -> TokenFacts:
    """The end-of-turn ids and the pad id of a tokenizer (and the model's generation config, when known)."""
    closing, openers = template_turn_ids(tok)
    sources: dict[str, str] = {}
    eot: list[int] = []
    if closing:
        eot += closing
        sources["end_of_turn"] = "chat template"
    gen = [i for i in id_list(getattr(generation_config, "eos_token_id", None)) if i not in openers]
    for i in gen:
        if i not in eot:
            eot.append(i)
    if gen:
        sources["end_of_turn"] = " + ".join(x for x in (sources.get("end_of_turn"), "generation config") if x)
    if not eot:
        tok_eos = getattr(tok, "eos_token_id", None)
        if tok_eos is None or tok_eos in openers:
            raise TokenFactsError(
                "no end-of-turn token: the tokenizer has no chat template closing the assistant's "
                "turn, the model no generation config eos_token_id, and no usable eos_token"
            )
        eot = [int(tok_eos)]
        sources["end_of_turn"] = "tokenizer eos_token (no chat template, no generation config)"
    pad = getattr(generation_config, "pad_token_id", None)
    if isinstance(pad, int):
        sources["pad"] = "generation config"
    else:
        pad = getattr(tok, "pad_token_id", None)
        if pad is not None and pad not in openers:
            sources["pad"] = "tokenizer pad_token"
        else:
            pad = eot[0]
            sources["pad"] = "first end-of-turn id (the tokenizer has no usable pad token)"
    return TokenFacts(eot, int(pad), openers, sources)
