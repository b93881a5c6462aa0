"""PyTorch eager reference for Ferrotron's CPU benchmark: the same GPT shapes, one training step =
forward + backward + AdamW over `global_batch // micro_batch` micro-batches. Prints one JSON line.

Written for this project (not derived from Megatron or nanoGPT code)."""
import argparse, json, math, time
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
for name, default in [("layers", 4), ("hidden", 128), ("heads", 4), ("seq", 128), ("vocab", 256),
                      ("micro", 16), ("global_batch", 32), ("iters", 12), ("threads", 2)]:
    p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(s, h, nh):
        super().__init__()
        s.nh = nh
        s.ln1, s.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        s.qkv, s.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        s.fc1, s.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(s, x):
        b, t, h = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(b, t, 3, s.nh, h // s.nh).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + s.fc2(F.gelu(s.fc1(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(a.vocab, a.hidden), nn.Embedding(a.seq, a.hidden)
        s.blocks = nn.ModuleList(Block(a.hidden, a.heads) for _ in range(a.layers))
        s.ln_f = nn.LayerNorm(a.hidden)

    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1]))
        for blk in s.blocks:
            x = blk(x)
        logits = s.ln_f(x) @ s.wte.weight.T  # tied output layer
        return F.cross_entropy(logits.reshape(-1, a.vocab), tgt.reshape(-1))


m = GPT()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
steps = a.global_batch // a.micro
data = torch.randint(0, a.vocab, (a.iters + 1, steps, a.micro, a.seq + 1))


def step(i):
    opt.zero_grad(set_to_none=True)
    for j in range(steps):
        batch = data[i, j]
        (m(batch[:, :-1], batch[:, 1:]) / steps).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()


step(a.iters)  # warm-up, not timed
t0 = time.perf_counter()
for i in range(a.iters):
    step(i)
dt = (time.perf_counter() - t0) / a.iters
print(json.dumps({"impl": "pytorch-eager", "torch": torch.__version__, "threads": a.threads,
                  "step_s": dt, "tokens_per_s": a.global_batch * a.seq / dt}))
