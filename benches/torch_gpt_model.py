"""The GPT both PyTorch reference scripts time (LayerNorm, tanh-GeLU, learned positions, biases,
tied output layer): the same model as Ferrotron's gpt2 presets. Written for this project."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(s, h, heads, attn_dropout=0.0):
        super().__init__()
        s.heads, s.attn_dropout = heads, attn_dropout
        s.ln1, s.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        s.qkv, s.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        s.fc1, s.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(s, x):
        b, t, h = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(b, t, 3, s.heads, h // s.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=s.attn_dropout if s.training else 0.0)
        x = x + s.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + s.fc2(F.gelu(s.fc1(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s, layers, hidden, heads, seq, vocab, attn_dropout=0.0):
        super().__init__()
        s.vocab = vocab
        s.wte, s.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        s.blocks = nn.ModuleList(Block(hidden, heads, attn_dropout) for _ in range(layers))
        s.ln_f = nn.LayerNorm(hidden)

    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in s.blocks:
            x = blk(x)
        logits = s.ln_f(x) @ s.wte.weight.T  # tied output layer
        return F.cross_entropy(logits.float().reshape(-1, s.vocab), tgt.reshape(-1))


def rope(x, base):
    """Rotary embedding on [b, t, heads, d], rotate-half layout (Megatron's default)."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos()[None, :, None, :].to(x.dtype), ang.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MoE(nn.Module):
    """Ferrotron's MoE layer (Megatron's defaults): top-k router, softmax over the k chosen
    logits, SwiGLU experts on the token copies sorted by expert through torch._grouped_mm
    (static shapes for torch.compile), combined weighted by index_add; the load-balancing loss
    at `aux` (kept in `s.aux_loss` for the model to add)."""

    def __init__(s, h, ffn, experts, topk, aux):
        super().__init__()
        s.e, s.k, s.coeff = experts, topk, aux
        s.router = nn.Linear(h, experts, bias=False)
        s.w1 = nn.Parameter(torch.randn(experts, h, 2 * ffn) * 0.02)
        s.w2 = nn.Parameter(torch.randn(experts, ffn, h) * 0.02)

    def forward(s, x):
        b, t, h = x.shape
        x2 = x.reshape(-1, h)
        logits = s.router(x2).float()
        top, idx = logits.topk(s.k, dim=-1)
        w = top.softmax(-1)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        tok = order // s.k
        counts = torch.bincount(flat, minlength=s.e)
        offs = counts.cumsum(0).to(torch.int32)
        xs = x2[tok].to(torch.bfloat16)
        h1 = torch._grouped_mm(xs, s.w1.to(torch.bfloat16), offs=offs)
        gate, up = h1.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, s.w2.to(torch.bfloat16), offs=offs)
        y = y * w.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x2, dtype=y.dtype).index_add_(0, tok, y)
        n = x2.shape[0]
        s.aux_loss = s.coeff * s.e / (s.k * n * n) * (logits.softmax(-1).sum(0) * counts.float()).sum()
        return out.view(b, t, h).to(x.dtype)


class LlamaBlock(nn.Module):
    def __init__(s, h, heads, groups, ffn, base, attn_dropout=0.0, moe=None):
        super().__init__()
        s.heads, s.groups, s.d, s.base, s.attn_dropout = heads, groups, h // heads, base, attn_dropout
        s.n1, s.n2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        s.qkv = nn.Linear(h, (heads + 2 * groups) * s.d, bias=False)
        s.proj = nn.Linear(h, h, bias=False)
        s.moe = MoE(h, ffn, *moe) if moe else None
        if not moe:
            s.fc1, s.fc2 = nn.Linear(h, 2 * ffn, bias=False), nn.Linear(ffn, h, bias=False)

    def forward(s, x):
        b, t, h = x.shape
        q, k, v = s.qkv(s.n1(x)).split([s.heads * s.d, s.groups * s.d, s.groups * s.d], dim=-1)
        q = rope(q.view(b, t, s.heads, s.d), s.base).transpose(1, 2)
        k = rope(k.view(b, t, s.groups, s.d), s.base).transpose(1, 2)
        v = v.view(b, t, s.groups, s.d).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, dropout_p=s.attn_dropout if s.training else 0.0
        )
        x = x + s.proj(y.transpose(1, 2).reshape(b, t, h))
        if s.moe is not None:
            return x + s.moe(s.n2(x))
        gate, up = s.fc1(s.n2(x)).chunk(2, dim=-1)
        return x + s.fc2(F.silu(gate) * up)


class Llama(nn.Module):
    """Ferrotron's llama presets: RMSNorm, SwiGLU, RoPE, GQA, no biases, untied output layer."""

    def __init__(s, layers, hidden, heads, groups, ffn, vocab, base=500000.0, attn_dropout=0.0, moe=None):
        super().__init__()
        s.vocab = vocab
        s.wte = nn.Embedding(vocab, hidden)
        s.blocks = nn.ModuleList(LlamaBlock(hidden, heads, groups, ffn, base, attn_dropout, moe) for _ in range(layers))
        s.norm_f = nn.RMSNorm(hidden, eps=1e-5)
        s.head = nn.Linear(hidden, vocab, bias=False)

    def forward(s, idx, tgt):
        x = s.wte(idx)
        for blk in s.blocks:
            x = blk(x)
        logits = s.head(s.norm_f(x))
        loss = F.cross_entropy(logits.float().reshape(-1, s.vocab), tgt.reshape(-1))
        for blk in s.blocks:
            if blk.moe is not None:
                loss = loss + blk.moe.aux_loss
        return loss
