"""The same LLaMA block stack in plain PyTorch: the yardstick `recipes.bench` races against.

Same maths as `lib/model.py` (RMSNorm, RoPE on halves, grouped-query attention,
SwiGLU, untied head, fp32), same AdamW settings and loss, written the way a
PyTorch user would: `nn.Module`s, `F.scaled_dot_product_attention`, eager or
`torch.compile`. Needs the `torch` extra.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lib.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, hd
        self.attn_norm, self.mlp_norm = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.wq = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.w_gate = nn.Linear(d, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(d, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.wq(h).view(b, t, self.n_heads, self.hd), cos, sin).transpose(1, 2)
        k = rope(self.wk(h).view(b, t, self.n_kv, self.hd), cos, sin).transpose(1, 2)
        v = self.wv(h).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        x = x + self.wo(out.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class TorchLlama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=cfg.init_std)

    def forward(self, tokens):
        t = tokens.shape[1]
        hd = self.cfg.d_model // self.cfg.n_heads
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[None, :, None, :]
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.final_norm(x))


def make_torch_step(cfg: ModelConfig, lr: float = 1e-3, compile: bool = False):
    """A full training step (forward, loss over valid tokens, backward, clip, AdamW)."""
    model = TorchLlama(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))

    def loss_fn(tokens, mask):
        logits = model(tokens)[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
        valid = mask[:, 1:].reshape(-1)
        return (nll * valid).sum() / valid.sum().clamp(min=1)

    forward = torch.compile(loss_fn) if compile else loss_fn

    def step(tokens, mask):
        opt.zero_grad(set_to_none=True)
        loss = forward(tokens, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return step
