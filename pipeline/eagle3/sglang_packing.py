"""SGLang's packed capture output mapped onto the padded batch the extract stage stores (pure, no SGLang).

SGLang runs a batch as one EXTEND forward over its rows *packed* end to end (no padding): row ``i`` holds
tokens ``offsets[i] : offsets[i] + lengths[i]`` of every per-token tensor. With EAGLE-3 capture on, the
model hands its logits processor the aux hidden states as a list of ``k`` tensors ``[T, H]`` (the inputs of
``layers_to_capture``, i.e. the outputs of the plan's aux layers) and the final hidden state ``[T, H]``
after the model's norm; SpecForge's capture concatenates the aux list to ``[T, k*H]`` and splits it by the
rows' input lengths. The extract stage's write path (``shard_sink.HostStager``) takes what the transformers
capture returns instead: right-padded ``(B, S, k*H)`` aux, ``(B, S, H)`` final and ``(B, S)`` greedy tokens,
of which it keeps the first ``length`` positions of each row. :func:`to_padded` turns one into the other,
so the two engines write the same store.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PackingError(ValueError):
    """SGLang's output does not have the shape the batch it was given implies."""


def row_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """The rows of a right-padded batch, unpadded: what SGLang is given, one request per row."""
    if input_ids.dim() != 2:
        raise PackingError(f"input_ids must be (batch, seq), got {tuple(input_ids.shape)}")
    if attention_mask is None:
        return [r.tolist() for r in input_ids.cpu()]
    lengths = attention_mask.sum(-1).tolist()
    m = attention_mask.cpu()
    for i, n in enumerate(lengths):
        if not bool(m[i, : int(n)].all()):
            raise PackingError(f"row {i}: padding must be on the right (attention_mask {m[i].tolist()})")
    ids = input_ids.cpu()
    return [ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]


def concat_aux(aux: torch.Tensor | Sequence[torch.Tensor], count: int) -> torch.Tensor:
    """``[T, k*H]`` from SGLang's aux list (or an already concatenated tensor), checked against ``count`` layers."""
    if isinstance(aux, torch.Tensor):
        return aux
    if len(aux) != count:
        raise PackingError(
            f"SGLang captured {len(aux)} aux hidden states, the plan asks for {count}: a layer to capture is "
            "outside the model's layers (the last layer's output is not an aux state SGLang can capture)"
        )
    return torch.cat(list(aux), dim=-1)


def to_padded(
    aux: torch.Tensor,
    last: torch.Tensor,
    tokens: torch.Tensor,
    lengths: Sequence[int],
    seq: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ``aux [T, k*H]``, ``last [T, H]``, ``tokens [T]`` → right-padded ``(B, seq, ·)``; pads are zero."""
    total = int(sum(lengths))
    for name, t in (("aux", aux), ("last hidden", last), ("greedy tokens", tokens)):
        if t.shape[0] != total:
            raise PackingError(
                f"SGLang's {name} has {t.shape[0]} token rows, the batch's {len(lengths)} rows hold {total}"
            )
    if aux.shape[-1] % last.shape[-1]:
        raise PackingError(f"aux width {aux.shape[-1]} is not a multiple of hidden size {last.shape[-1]}")
    if lengths and max(lengths) > seq:
        raise PackingError(f"a row of {max(lengths)} tokens does not fit the padded length {seq}")
    b = len(lengths)
    out_aux = aux.new_zeros(b, seq, aux.shape[-1])
    out_last = last.new_zeros(b, seq, last.shape[-1])
    out_tok = tokens.new_zeros(b, seq)
    a = 0
    for i, n in enumerate(lengths):
        out_aux[i, :n] = aux[a : a + n]
        out_last[i, :n] = last[a : a + n]
        out_tok[i, :n] = tokens[a : a + n]
        a += n
    return out_aux, out_last, out_tok
