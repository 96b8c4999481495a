"""Running the target model and capturing what EAGLE-3 needs from it.

Forward hooks on the decoder layers named by the aux layer ids record each layer's *output* (the
residual stream after layer ``id``: SGLang's convention, see ``draft_model.default_aux_layers``);
a hook on the final norm records the last hidden state. The base model is called, not the LM head,
so a long batch never materialises (tokens × vocabulary) logits; the greedy next token is computed
in chunks. Used by extraction, online training and the acceptance benchmark alike.

Which modules those are comes from the loaded model, never from tensor names: the *text backbone*
(:func:`text_backbone`: a causal LM's decoder, or the language model inside a vision-language
wrapper such as Kimi-K2.5's ``kimi_k25``), its own ``norm`` and ``embed_tokens``, and the model's
output embedding. How the target is spread: one device, ``device = "auto"`` (accelerate places
layers over the GPUs; captured tensors are moved to one device), or ``parallel = "tp"`` (every
rank of a ``torchrun`` group holds a tensor-parallel shard, transformers' ``tp_plan="auto"``, and
runs the same batch; every rank sees the same captured tensors).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline import tested_versions
from pipeline.data import model_assets
from pipeline.eagle3.draft_config import default_aux_layers, normalise_aux_layers
from pipeline.serving.sglang_capture import architecture_of


class TargetError(RuntimeError):
    pass


@dataclass
class Capture:
    aux: torch.Tensor  # (B, S, 3H), on the device of the final norm's output
    last_hidden: torch.Tensor  # (B, S, H), after the final norm


def _cache_kwarg(base: Any) -> str:
    """transformers 5.2x renamed ``past_key_values`` to ``cache``; the GPU image has an older 5.x."""
    import inspect

    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def text_backbone(model: Any) -> Any:
    """The decoder stack of the model's text part: what has ``layers``, ``norm`` and ``embed_tokens``.

    ``get_decoder()`` resolves wrappers (``Kimi_K25ForConditionalGeneration.model.language_model``);
    a vision tower also has layers and norms, which is why names are never guessed.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if (
        base is None
        or not isinstance(layers, nn.ModuleList)
        or not isinstance(getattr(base, "norm", None), nn.Module)
    ):
        mtype = getattr(getattr(model, "config", None), "model_type", "?")
        raise TargetError(
            f"model type {mtype!r} ({type(model).__name__}): cannot find a decoder-only text model to "
            "capture (looked for get_decoder() holding 'layers' and a final 'norm')"
        )
    return base


def module_name(root: nn.Module, target: nn.Module) -> str:
    for name, mod in root.named_modules(remove_duplicate=False):
        if mod is target:
            return name
    raise TargetError(f"{type(target).__name__} is not a module of {type(root).__name__}")


class Target:
    """A causal LM (or a VLM's text model) with hooks for the aux layers and the final norm."""

    def __init__(self, model: Any, aux_layer_ids: list[int]) -> None:
        self.model = model
        self.base = text_backbone(model)
        n = len(self.base.layers)
        try:
            self.aux_layer_ids = normalise_aux_layers(list(aux_layer_ids), n, "aux layer ids")
        except ValueError as exc:
            raise TargetError(str(exc)) from None
        self.head = model.get_output_embeddings()
        emb = getattr(self.base, "embed_tokens", None)
        self.embed = emb if isinstance(emb, nn.Module) else model.get_input_embeddings()
        if self.head is None or self.embed is None:
            raise TargetError(f"{type(model).__name__}: no LM head or input embedding")
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
        return self.embed.weight.device

    def _layer_hook(self, i: int) -> Callable[..., None]:
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
    def embed_weight(self) -> torch.Tensor:
        w = self.embed.weight
        return w.full_tensor() if hasattr(w, "full_tensor") else w

    @torch.no_grad()
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: Any = None
    ) -> Capture:
        """Aux and last hidden states; ``cache`` (a ``DynamicCache``) is extended in place when given."""
        self._aux.clear()
        self._last = None
        kw: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "use_cache": cache is not None,
        }
        if cache is not None:
            kw[self._cache_kw] = cache
        self.base(**kw)
        if self._last is None or len(self._aux) != len(self.aux_layer_ids):
            raise TargetError("the forward pass did not reach every hooked layer")
        last = self._last
        # With layers spread over devices each aux state stays on its layer's GPU: gather on one.
        aux = torch.cat([self._aux[i].to(last.device) for i in self.aux_layer_ids], dim=-1)
        return Capture(aux, last)

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The LM head applied by its own module (a tensor-parallel head gathers its output)."""
        w = self.head.weight
        return self.head(last_hidden.to(w.device, w.dtype))

    @torch.no_grad()
    def argmax(self, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """Greedy next token at every position, ``chunk`` positions of logits at a time."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.int64, device=flat.device)
        for a in range(0, flat.shape[0], chunk):
            out[a : a + chunk] = self.logits(flat[a : a + chunk]).argmax(-1).to(flat.device)
        return out.view(last_hidden.shape[:-1])


def load_target(
    model_id: str,
    aux_layer_ids: list[int] | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    parallel: str | None = None,
    *,
    trust_remote_code: bool = False,
) -> Target:
    """Load the target for inference; ``aux_layer_ids=None`` picks SpecForge's default layers.

    ``parallel="tp"`` must run under ``torchrun``: transformers shards the model over the ranks
    (``tp_plan="auto"``), starting the process group itself and placing each rank on its GPU (or the
    CPU, with gloo); ``device`` is the rank's device.
    """
    if parallel == "tp":
        for (
            note
        ) in tested_versions.untested():  # the stage log says so: the shards may differ from the deep check's
            print(
                f"aerie: warning: {note}; tensor-parallel sharding follows this release's TP plan", flush=True
            )
        model = model_assets.load_model(
            model_id, dtype=dtype, tp_plan="auto", trust_remote_code=trust_remote_code
        )
        # With one rank transformers applies no plan and leaves the weights where they were loaded.
        if str(device) not in ("cpu", "auto") and not any(
            hasattr(p, "device_mesh") for p in model.parameters()
        ):
            model.to(device)
    elif str(device) == "auto":  # accelerate places the layers over every visible GPU
        model = model_assets.load_model(
            model_id, dtype=dtype, device_map="auto", trust_remote_code=trust_remote_code
        )
    elif isinstance(device, dict):  # an explicit device map (tests split a model over cuda:0 and cpu)
        model = model_assets.load_model(
            model_id, dtype=dtype, device_map=device, trust_remote_code=trust_remote_code
        )
    else:
        model = model_assets.load_model(model_id, dtype=dtype, trust_remote_code=trust_remote_code)
        model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = aux_layer_ids if aux_layer_ids is not None else default_aux_layers(len(text_backbone(model).layers))
    return Target(model, ids)


def target_config(model_id: str, *, trust_remote_code: bool = False) -> Any:
    """The text model's config (``text_config`` of a vision-language wrapper)."""
    cfg = model_assets.model_config(model_id, trust_remote_code=trust_remote_code)
    return getattr(cfg, "text_config", None) or cfg


def target_architecture(model_id: str, *, trust_remote_code: bool = False) -> str | None:
    """The model class SGLang will pick for the target (a wrapper's, e.g. Kimi-K2.5's, not its text model's)."""
    cfg = model_assets.model_config(model_id, trust_remote_code=trust_remote_code)
    return architecture_of(cfg) or architecture_of(getattr(cfg, "text_config", None))


def tensor_roles(model_id: str, model: Any = None, *, trust_remote_code: bool = False) -> dict[str, str]:
    """The qualified parameter names of the input embedding, the final norm and the LM head.

    Found on the model built on the meta device (no memory, no weights) from the modules
    :class:`Target` uses: the text backbone's ``embed_tokens`` and ``norm``, the output embedding.
    ``model``: that model already built (the deep check builds it once).
    """
    if model is None:
        cfg = model_assets.model_config(model_id, trust_remote_code=trust_remote_code)
        cls = model_assets.model_class(cfg)
        with torch.device("meta"):
            model = cls.from_config(cfg)
    base = text_backbone(model)
    emb = getattr(base, "embed_tokens", None)
    emb = emb if isinstance(emb, nn.Module) else model.get_input_embeddings()
    head = model.get_output_embeddings()
    roles = {"embed": module_name(model, emb) + ".weight", "norm": module_name(model, base.norm) + ".weight"}
    if head is not None and head.weight is not emb.weight:
        roles["head"] = module_name(model, head) + ".weight"
    return roles


def checkpoint_key(name: str, keys: list[str]) -> str | None:
    """The checkpoint key holding the model parameter ``name``.

    Exact when the files use the model's names; otherwise a checkpoint written in the original
    layout (Kimi-K2.5: ``language_model.model.norm.weight`` for ``model.language_model.norm.weight``)
    is matched on the same module and attribute (``norm.weight``, not ``pre_norm.weight``), outside
    the decoder layers, sharing the most path components.
    """
    if name in keys:
        return name
    tail = name.split(".")[-2:]
    parts = set(name.split("."))
    cands = [
        k
        for k in keys
        if k.split(".")[-2:] == tail and ".layers." not in f".{k}" and ".blocks." not in f".{k}"
    ]
    if not cands:
        return None
    return max(cands, key=lambda k: (len(parts & set(k.split("."))), -len(k)))


def load_target_tensors(model_id: str, *, trust_remote_code: bool = False) -> dict[str, torch.Tensor]:
    """The target's input embedding, LM head (the embedding again when tied) and final norm weight.

    Read straight from the safetensors files of a local folder, without building the layers; other
    sources (a hub id) fall back to loading the model.
    """
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
        for role, name in tensor_roles(model_id, trust_remote_code=trust_remote_code).items():
            key = checkpoint_key(name, list(where))
            if key is None:
                raise TargetError(f"{path}: no tensor for the model's {role} ({name}) in the checkpoint")
            with safe_open(str(where[key]), framework="pt") as h:
                found[role] = h.get_tensor(key).float()
        found.setdefault("head", found["embed"])
        return found
    model = model_assets.load_model(model_id, trust_remote_code=trust_remote_code)
    t = Target(model, default_aux_layers(len(text_backbone(model).layers)))
    return {
        "embed": t.embed.weight.detach().float(),
        "head": t.head.weight.detach().float(),
        "norm": t.base.norm.weight.detach().float(),
    }
