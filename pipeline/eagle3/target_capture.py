"""Running the target model and capturing what EAGLE-3 needs from it.

Forward hooks on the decoder layers named by the aux layer ids record each layer's *output* (the
residual stream after layer ``id``: SGLang's convention, see ``eagle3_model.default_aux_layers``);
a hook on the final norm records the last hidden state. The base model is called, not the LM head,
so a long batch never materialises (tokens × vocabulary) logits; the greedy next token is computed
in chunks. Used by extraction, online training and the acceptance benchmark alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.data import model_assets


class TargetError(RuntimeError):
    pass


@dataclass
class Capture:
    aux: torch.Tensor  # (B, S, 3H)
    last_hidden: torch.Tensor  # (B, S, H), after the final norm


def _cache_kwarg(base: Any) -> str:
    """transformers 5.2x renamed ``past_key_values`` to ``cache``; the GPU image has an older 5.x."""
    import inspect

    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _decoder(model: Any) -> Any:
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TargetError(f"{type(model).__name__}: cannot find decoder layers and final norm")
    return base


class Target:
    """A causal LM with hooks for the aux layers and the final norm."""

    def __init__(self, model: Any, aux_layer_ids: list[int]) -> None:
        self.model = model
        self.base = _decoder(model)
        n = len(self.base.layers)
        for i in aux_layer_ids:
            if not 0 <= i < n:
                raise TargetError(f"aux layer id {i} out of range: the target has {n} layers (0..{n - 1})")
        self.aux_layer_ids = list(aux_layer_ids)
        self._aux: dict[int, torch.Tensor] = {}
        self._last: torch.Tensor | None = None
        self._hooks = []
        self._cache_kw = _cache_kwarg(self.base)
        for i in self.aux_layer_ids:
            self._hooks.append(self.base.layers[i].register_forward_hook(self._layer_hook(i)))
        self._hooks.append(self.base.norm.register_forward_hook(self._norm_hook))

    @property
    def num_layers(self) -> int:
        return len(self.base.layers)

    @property
    def device(self) -> torch.device:
        """Where inputs go: the embedding's device (the first GPU when layers are spread)."""
        return self.embed_weight.device

    def _layer_hook(self, i: int):  # noqa: ANN202
        def hook(_mod: Any, _inp: Any, out: Any) -> None:
            self._aux[i] = out[0] if isinstance(out, tuple) else out
        return hook

    def _norm_hook(self, _mod: Any, _inp: Any, out: Any) -> None:
        self._last = out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: Any = None) -> Capture:
        """Aux and last hidden states; ``cache`` (a ``DynamicCache``) is extended in place when given."""
        self._aux.clear()
        self._last = None
        kw: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": cache is not None}
        if cache is not None:
            kw[self._cache_kw] = cache
        self.base(**kw)
        if self._last is None or len(self._aux) != len(set(self.aux_layer_ids)):
            raise TargetError("the forward pass did not reach every hooked layer")
        aux = torch.cat([self._aux[i] for i in self.aux_layer_ids], dim=-1)
        return Capture(aux, self._last)

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        w = self.lm_head_weight
        return last_hidden.to(w.dtype) @ w.T

    @torch.no_grad()
    def argmax(self, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """Greedy next token at every position, ``chunk`` positions of logits at a time."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.int64, device=flat.device)
        for a in range(0, flat.shape[0], chunk):
            out[a:a + chunk] = self.logits(flat[a:a + chunk]).argmax(-1)
        return out.view(last_hidden.shape[:-1])


def load_target(model_id: str, aux_layer_ids: list[int] | None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Target:
    """Load the target for inference; ``aux_layer_ids=None`` picks SpecForge's default layers."""
    from pipeline.eagle3.draft_model import default_aux_layers

    if str(device) == "auto":  # accelerate places the layers over every visible GPU
        model = model_assets.load_model(model_id, dtype=dtype, device_map="auto")
    else:
        model = model_assets.load_model(model_id, dtype=dtype)
        model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = aux_layer_ids if aux_layer_ids is not None else default_aux_layers(len(_decoder(model).layers))
    return Target(model, ids)


def target_config(model_id: str) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_assets.resolve(model_id))
    return getattr(cfg, "text_config", None) or cfg


def load_target_tensors(model_id: str) -> dict[str, torch.Tensor]:
    """The target's input embedding, LM head (the embedding again when tied) and final norm weight.

    Read straight from the safetensors files of a local folder, without building the layers; other
    sources (a hub id) fall back to loading the model.
    """
    suffixes = {"embed": "embed_tokens.weight", "head": "lm_head.weight", "norm": "norm.weight"}
    path = Path(model_assets.resolve(model_id))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        from safetensors import safe_open

        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            where = {k: path / v for k, v in json.loads(index_file.read_text())["weight_map"].items()}
        else:
            where = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    where.update({k: f for k in h.keys()})  # noqa: SIM118 - safe_open is not iterable
        found: dict[str, torch.Tensor] = {}
        for name, suf in suffixes.items():
            # the decoder's own tensors, not e.g. a vision tower's: shortest matching key wins
            keys = sorted((k for k in where if k.endswith(suf) and "layers." not in k), key=len)
            if keys:
                with safe_open(str(where[keys[0]]), framework="pt") as h:
                    found[name] = h.get_tensor(keys[0]).float()
        if "embed" in found and "norm" in found:
            found.setdefault("head", found["embed"])
            return found
    model = model_assets.load_model(model_id)
    return {"embed": model.get_input_embeddings().weight.detach().float(),
            "head": model.get_output_embeddings().weight.detach().float(),
            "norm": _decoder(model).norm.weight.detach().float()}
