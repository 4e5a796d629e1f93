"""transformers' LlamaForCausalLM as the reference our model must agree with (torch on CPU).

An optional extra (`pip install -e '.[torch]'`): everything here imports torch
lazily and says how to install it when it is missing. The reference runs in
float32 with the eager attention, so the comparison measures our maths, not a
fused kernel's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from lib.config import ConfigError, ModelConfig
from lib.hf import hf_tensor_map, save_llama


def require_torch():
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ConfigError(f"the HF reference needs torch and transformers ({exc.name} is missing): pip install -e '.[torch]'") from exc
    return torch, transformers


def load_reference(hf_dir: str | Path):
    """LlamaForCausalLM from a folder, float32, eager attention, eval mode (no dropout)."""
    torch, transformers = require_torch()
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def reference_from_model(model, cfg: ModelConfig):
    """The same weights as our `model`, in transformers (through a temporary HF export)."""
    with tempfile.TemporaryDirectory() as tmp:
        save_llama(model, cfg, tmp)
        return load_reference(tmp)


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


def reference_forward(ref, tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """Embedding output, every layer's output, final normed hidden, logits and the mean next-token loss."""
    torch, _ = require_torch()
    captured: dict[str, object] = {}
    hooks = [ref.model.embed_tokens.register_forward_hook(lambda m, i, o: captured.__setitem__("embed", o)),
             ref.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("hidden", o))]
    for i, layer in enumerate(ref.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, inp, o, i=i: captured.__setitem__(f"layer{i}", _hidden(o))))
    try:
        ids = torch.tensor(np.asarray(tokens), dtype=torch.long)
        labels = torch.where(torch.tensor(np.asarray(mask)), ids, torch.full_like(ids, -100))  # -100: HF's "no target"
        out = ref(input_ids=ids, labels=labels)
    finally:
        for h in hooks:
            h.remove()
    as_np = lambda t: t.detach().float().numpy()  # noqa: E731
    layers = np.stack([as_np(captured[f"layer{i}"]) for i in range(len(ref.model.layers))])
    return {"embed": as_np(captured["embed"]), "layers": layers, "hidden": as_np(captured["hidden"]),
            "logits": as_np(out.logits), "loss": float(out.loss.detach()), "_loss_tensor": out.loss}


def reference_grads(ref, cfg: ModelConfig, tokens: np.ndarray, mask: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and its gradient for every parameter, in our layout: leaf path -> array (blocks stacked)."""
    ref.zero_grad(set_to_none=True)
    outputs = reference_forward(ref, tokens, mask)
    outputs["_loss_tensor"].backward()
    table = hf_tensor_map(cfg)
    grads: dict[str, np.ndarray] = {}
    for name, param in ref.named_parameters():
        ours, layer, transpose = table[name]
        g = param.grad.detach().float().numpy()
        g = g.T if transpose else g
        if layer is None:
            grads[ours] = g
        else:
            grads.setdefault(ours, np.zeros((cfg.n_layers, *g.shape), np.float32))[layer] = g
    ref.zero_grad(set_to_none=True)
    return outputs["loss"], grads
