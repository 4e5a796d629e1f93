"""Hugging Face LLaMA checkpoints <-> `lib.model.Llama`.

    model, cfg = load_llama(hf_dir)            # config.json + model.safetensors (or sharded, with an index)
    out = logits(model, tokens)                # int32 [B, T] -> float32 [B, T, vocab]
    save_llama(model, cfg, out_dir)            # loadable by transformers' LlamaForCausalLM.from_pretrained

Layout. HF `nn.Linear` weights are [out, in]; ours are [in, out] (`x @ w`), so
every projection is transposed and nothing else changes. Our blocks are stacked
([n_layers, ...] leaves), so layer i of HF fills slice i.

RoPE. HF's LLaMA stores q/k projections in the "rotate_half" layout (its
conversion script permuted Meta's interleaved pairs once) and rotates the two
halves of each head; `lib.model.apply_rope` rotates halves the same way, so no
permutation is needed (tests/test_hf.py checks logits against transformers).
Grouped-query attention maps identically too: query head h reads kv head
h // (n_heads / n_kv_heads) in both.

Memory. Import reads one safetensors file at a time (memory-mapped by
`safe_open`) straight into preallocated stacked numpy buffers, then turns them
into device arrays one leaf at a time: the weights are never held twice.
"""

from __future__ import annotations

import json
from functools import reduce
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lib.checkpoint import CheckpointError
from lib.config import ARCHITECTURE, ModelConfig
from lib.corpus import EOS_ID, PAD_ID
from lib.model import Llama

# (our leaf inside a Block, HF name inside model.layers.{i}, transpose?)
LAYER_TENSORS = [
    ("attn_norm.weight", "input_layernorm.weight", False),
    ("attn.wq", "self_attn.q_proj.weight", True),
    ("attn.wk", "self_attn.k_proj.weight", True),
    ("attn.wv", "self_attn.v_proj.weight", True),
    ("attn.wo", "self_attn.o_proj.weight", True),
    ("mlp_norm.weight", "post_attention_layernorm.weight", False),
    ("mlp.w_gate", "mlp.gate_proj.weight", True),
    ("mlp.w_up", "mlp.up_proj.weight", True),
    ("mlp.w_down", "mlp.down_proj.weight", True),
]
# (our leaf of Llama, HF name, transpose?); lm_head only when embeddings are untied.
GLOBAL_TENSORS = [
    ("embed", "model.embed_tokens.weight", False),
    ("final_norm.weight", "model.norm.weight", False),
    ("lm_head", "lm_head.weight", True),
]
# Buffers some older exports carry; they are recomputed from the config, never learned.
IGNORED_TENSORS = ("rotary_emb.inv_freq",)
SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _get(obj, dotted: str):
    return reduce(getattr, dotted.split("."), obj)


def hf_tensor_map(cfg: ModelConfig) -> dict[str, tuple[str, int | None, bool]]:
    """HF tensor name -> (our leaf path in Llama, layer index or None, transpose?)."""
    table = {}
    for ours, theirs, transpose in GLOBAL_TENSORS:
        if ours == "lm_head" and cfg.tie_embeddings:
            continue
        table[theirs] = (ours, None, transpose)
    for i in range(cfg.n_layers):
        for ours, theirs, transpose in LAYER_TENSORS:
            table[f"model.layers.{i}.{theirs}"] = (f"blocks.{ours}", i, transpose)
    return table


# ----------------------------------------------------------------------------- config


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig for an HF LLaMA config dict; refuses variants the model does not implement."""
    if hf.get("model_type", "llama") != "llama":
        raise CheckpointError(f"{where}: model_type={hf.get('model_type')!r}, but only LLaMA checkpoints can be imported")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise CheckpointError(f"{where}: {key}={hf[key]!r} is not supported (this LLaMA needs {key}={ok!r})")
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta here
    scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling:
        raise CheckpointError(f"{where}: RoPE scaling {scaling} is not supported; only plain RoPE (rope_type 'default') imports")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        raise CheckpointError(f"{where}: head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads={d // heads}; not supported")
    try:
        return ModelConfig(
            d_model=d,
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            d_ff=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{where} lacks {exc.args[0]!r}: not a complete LLaMA config") from exc


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32", max_position_embeddings: int = 4096) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": max_position_embeddings,
        # The ids lib.corpus reserves in every tokenizer it trains.
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": None,
        "torch_dtype": dtype,
    }


def read_config(hf_dir: str | Path) -> ModelConfig:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder (no config.json); point at the folder save_pretrained wrote")
    try:
        return model_config_from_hf(json.loads(path.read_text()), str(path))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg})") from exc


# ----------------------------------------------------------------------------- import


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of a folder: the shards its index names, or the single model.safetensors."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [hf_dir / n for n in names]
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(
            f"{hf_dir}: {'missing shard(s) ' + ', '.join(missing) if missing else 'no *.safetensors weights'}; "
            "only safetensors checkpoints import (convert .bin with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def load_llama(hf_dir: str | Path) -> tuple[Llama, ModelConfig]:
    """Import an HF LLaMA folder into our Llama (float32 parameters), one safetensors file at a time."""
    from safetensors import safe_open

    cfg = read_config(hf_dir)
    abstract = eqx.filter_eval_shape(Llama, cfg, jax.random.PRNGKey(0))
    table = hf_tensor_map(cfg)
    leaves = sorted({ours for ours, _, _ in table.values()})
    buffers = {p: np.empty(_get(abstract, p).shape, np.float32) for p in leaves}
    seen: set[str] = set()
    for file in weight_files(hf_dir):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                if name.endswith(IGNORED_TENSORS) or (name == "lm_head.weight" and cfg.tie_embeddings):
                    continue  # a tied head may be saved anyway; it is the embedding
                if name not in table:
                    raise CheckpointError(f"{file}: unexpected tensor {name!r}; not a plain LLaMA checkpoint (or config.json disagrees with it)")
                ours, layer, transpose = table[name]
                dst = buffers[ours] if layer is None else buffers[ours][layer]
                tensor = f.get_tensor(name)
                src_shape = tensor.shape[::-1] if transpose else tensor.shape
                if src_shape != dst.shape:
                    raise CheckpointError(f"{file}: {name} has shape {tensor.shape}, config.json implies {dst.shape[::-1] if transpose else dst.shape}")
                dst[...] = tensor.T if transpose else tensor
                seen.add(name)
    missing = sorted(set(table) - seen)
    if missing:
        raise CheckpointError(f"{hf_dir}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}; the checkpoint is incomplete")
    # One leaf at a time to the device, dropping each host buffer as soon as it is copied.
    arrays = [jnp.asarray(buffers.pop(p)) for p in leaves]
    model = eqx.tree_at(lambda m: [_get(m, p) for p in leaves], abstract, arrays)
    return model, cfg


# ----------------------------------------------------------------------------- forward


@eqx.filter_jit
def _logits(model: Llama, tokens):
    return model(tokens).astype(jnp.float32)


def logits(model: Llama, tokens) -> jax.Array:
    """Next-token logits: int32 tokens [B, T] -> float32 [B, T, vocab]."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be an integer array [batch, time]; got {tokens.dtype} {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= model.cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, {model.cfg.vocab_size}); got [{tokens.min()}, {tokens.max()}]")
    return _logits(model, jnp.asarray(tokens, jnp.int32))


# ----------------------------------------------------------------------------- export


def _hf_tensor(model: Llama, ours: str, layer: int | None, transpose: bool) -> np.ndarray:
    """One tensor in HF layout, pulled to the host on its own (a layer's slice, not the whole stack)."""
    leaf = _get(model, ours)
    x = np.asarray(leaf if layer is None else leaf[layer])
    return np.ascontiguousarray(x.T if transpose else x)


def save_llama(
    model: Llama,
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = 4 << 30,
    max_position_embeddings: int = 4096,
    overwrite: bool = False,
) -> Path:
    """Write config.json and safetensors weights (sharded with an index above `max_shard_bytes`).

    Refuses a folder that already holds a model unless `overwrite`: an export must
    never clobber the checkpoint it was imported from by accident.
    """
    from safetensors.numpy import save_file

    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(SAVE_DTYPES)}")

    if any(getattr(model.cfg, k) != getattr(cfg, k) for k in ARCHITECTURE):
        raise ValueError("save_llama: cfg does not describe this model; pass the model's own config (model.cfg)")
    out = Path(out_dir)
    existing = sorted(p.name for p in out.glob("*") if p.suffix == ".safetensors" or p.name in ("config.json", "model.safetensors.index.json"))
    if existing and not overwrite:
        raise CheckpointError(f"{out} already holds a model ({', '.join(existing[:3])}); choose an empty folder or pass overwrite")
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = SAVE_DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize

    # Plan shards by size first, then write one shard at a time: only one shard's tensors are ever on the host.
    table = hf_tensor_map(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    for name, (ours, layer, _) in table.items():
        nbytes = int(np.prod(_get(model, ours).shape[0 if layer is None else 1:])) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()  # overwrite: a previous export with another shard count would otherwise be mixed in
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _hf_tensor(model, *table[name]).astype(np_dtype, copy=False) for name in shard}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: file for name in tensors})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config_from_model(cfg, dtype, max_position_embeddings), indent=2))
    return out
