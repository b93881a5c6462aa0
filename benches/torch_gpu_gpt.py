"""PyTorch reference for `cargo xtask bench --gpu`: the same GPT (LayerNorm, tanh-GeLU, learned
positions, tied output layer) in bf16 autocast with torch.compile + SDPA and fused AdamW, timed over
`--iters` steps after warm-up. Prints one JSON line: tokens/s, MFU, peak memory.

Written for this project."""
import argparse, json, time
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
for name, default in [("layers", 12), ("hidden", 768), ("heads", 12), ("seq", 1024), ("vocab", 50304),
                      ("micro", 8), ("iters", 10), ("warmup", 3)]:
    p.add_argument(f"--{name}", type=int, default=default)
p.add_argument("--flops-per-token", type=float, required=True)
a = p.parse_args()
dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = True


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        h = a.hidden
        s.ln1, s.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        s.qkv, s.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        s.fc1, s.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(s, x):
        b, t, h = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(b, t, 3, a.heads, h // a.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + s.fc2(F.gelu(s.fc1(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(a.vocab, a.hidden), nn.Embedding(a.seq, a.hidden)
        s.blocks = nn.ModuleList(Block() for _ in range(a.layers))
        s.ln_f = nn.LayerNorm(a.hidden)

    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in s.blocks:
            x = blk(x)
        logits = s.ln_f(x) @ s.wte.weight.T
        return F.cross_entropy(logits.float().reshape(-1, a.vocab), tgt.reshape(-1))


m = GPT().to(dev)
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
model = torch.compile(m)
data = torch.randint(0, a.vocab, (a.micro, a.seq + 1), device=dev)


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(data[:, :-1], data[:, 1:])
    loss.backward()
    opt.step()


for _ in range(a.warmup):
    step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
for _ in range(a.iters):
    step()
torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / a.iters
tps = a.micro * a.seq / dt
print(json.dumps({"impl": "pytorch-compile-sdpa", "torch": torch.__version__, "tokens_per_s": tps,
                  "mfu": tps * a.flops_per_token / 989e12, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}))
