"""The embedded demo model: a GPT-style decoder with dropout (random weights, built from code)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A GPT-style decoder with dropout everywhere (masks must be replayed on recomputation)."""

    def __init__(self, layers: int = 6, d: int = 64, heads: int = 4, vocab: int = 256, seq: int = 64,
                 dropout: float = 0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[GPTBlock(d, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        return self.head(self.ln(self.blocks(x)))
