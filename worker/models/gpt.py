"""A small byte-level, nanoGPT-style GPT.

The forward pass is split into `embed` -> `blocks` -> `logits` so that a pipeline-parallel split can
place the embedding, a run of blocks, and the head on different stages without re-implementing the
model. For the same reason the head is NOT tied to the token embedding: tied weights would have to
live on two stages at once.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dilocox.common.config.run import ModelConfig


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on the fused SDPA kernel (no explicit mask tensor needed)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        # Residual output projection: gets the GPT-2 scaled init (see GPT._init_weights).
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.proj.is_residual_proj = True  # type: ignore[attr-defined]
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        # [B, T, C] -> [B, n_head, T, head_dim]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward, 4x wide with GELU, as in GPT-2."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.proj.is_residual_proj = True  # type: ignore[attr-defined]
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: normalising before each sublayer keeps the residual stream
    an identity path, which trains stably without warmup tricks at this size."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Byte-level GPT: 256-symbol vocabulary, learned absolute positions, untied head."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else ModelConfig()
        c = self.config
        self.tok_emb = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos_emb = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init. Residual projections are scaled by 1/sqrt(2*n_layer) because each block adds
        two of them to the residual stream; without it the stream's variance grows with depth.
        Every parameter is set here (LayerNorms too), so the init of one module is complete on its own:
        worker/models/materialize.py draws each module's values from a seed of its own this way."""
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_proj", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings: the first pipeline stage. [B, T] int64 -> [B, T, n_embd]."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, time], got shape {tuple(idx.shape)}")
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}: "
                "position embeddings only exist for the first block_size positions"
            )
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm + head: the last pipeline stage. [B, T, n_embd] -> [B, T, vocab]."""
        return self.head(self.ln_f(hidden))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits, loss); loss is the mean next-byte cross-entropy in nats, or None."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.logits(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        """Total parameter count (embeddings included: with an untied head nothing is shared)."""
        return sum(p.numel() for p in self.parameters())
