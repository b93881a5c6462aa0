"""The GPT both PyTorch reference scripts time (LayerNorm, tanh-GeLU, learned positions, biases,
tied output layer): the same model as Ferrotron's gpt2 presets. Written for this project."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(s, h, heads):
        super().__init__()
        s.heads = heads
        s.ln1, s.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        s.qkv, s.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        s.fc1, s.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(s, x):
        b, t, h = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(b, t, 3, s.heads, h // s.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + s.fc2(F.gelu(s.fc1(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s, layers, hidden, heads, seq, vocab):
        super().__init__()
        s.vocab = vocab
        s.wte, s.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        s.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        s.ln_f = nn.LayerNorm(hidden)

    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in s.blocks:
            x = blk(x)
        logits = s.ln_f(x) @ s.wte.weight.T  # tied output layer
        return F.cross_entropy(logits.float().reshape(-1, s.vocab), tgt.reshape(-1))
