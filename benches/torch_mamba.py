"""PyTorch reference for the Mamba-2 GPU rows of benches/NOTES.md: a stack of Mamba-2 layers alone
(Megatron's `--hybrid-layer-pattern MM…M`: pre-RMSNorm, the mixer, the residual; final RMSNorm;
untied output layer) shaped as Ferrotron's run of the same flags, in bf16 autocast with
torch.compile and fused AdamW, timed over `--iters` steps after warm-up. The scan is Mamba-2's
chunked form (SSD) written in einsums here (64-step chunks: the intra-chunk products, the chunks'
states, a pass over the chunks, the states' contribution), in f32, as a user without mamba_ssm's
Triton kernels would run it; those kernels are not on the GPU machine.
Prints one JSON line: tokens/s, MFU, peak memory.

Written for this project."""
import argparse, json, time
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
for name, default in [("layers", 8), ("hidden", 1024), ("head_dim", 64), ("state", 128), ("groups", 8),
                      ("seq", 2048), ("vocab", 256), ("micro", 4), ("iters", 10), ("warmup", 3), ("chunk", 64)]:
    p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
p.add_argument("--flops-per-token", type=float, required=True)
a = p.parse_args()
dev = "cuda"


def rmsnorm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w


def ssd(x, dt, A, B, C, q):
    """y_t = Σ_{s≤t} ⟨C_t, B_s⟩ e^{A Σ_{s<r≤t} dt_r} dt_s x_s, chunked. x [b,T,H,P], dt [b,T,H], A [H],
    B, C [b,T,H,N] (already per head); f32."""
    b, t, h, pd = x.shape
    c = t // q
    x, dt, B, C = (v.reshape(b, c, q, *v.shape[2:]) for v in (x, dt, B, C))
    cum = torch.cumsum(dt * A, dim=2)  # [b,c,q,h]
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [b,c,i,j,h]
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    decay = torch.where(causal[None, None, :, :, None], seg, float("-inf")).exp()
    scores = torch.einsum("bcihn,bcjhn->bcijh", C, B) * decay * dt[:, :, None, :, :]
    y = torch.einsum("bcijh,bcjhp->bcihp", scores, x)
    w = (cum[:, :, -1:, :] - cum).exp() * dt  # [b,c,q,h]
    own = torch.einsum("bcjhn,bcjh,bcjhp->bchnp", B, w, x)
    last = cum[:, :, -1, :].exp()  # [b,c,h]
    s = torch.zeros_like(own[:, 0])
    starts = []
    for k in range(c):
        starts.append(s)
        s = last[:, k, :, None, None] * s + own[:, k]
    s0 = torch.stack(starts, dim=1)  # [b,c,h,n,p]
    y = y + torch.einsum("bcihn,bchnp->bcihp", C * cum.exp()[..., None], s0)
    return y.reshape(b, t, h, pd)


class Mixer(nn.Module):
    def __init__(s, hidden, head_dim, state, groups, chunk):
        super().__init__()
        s.d_inner = 2 * hidden
        s.h, s.p, s.n, s.g, s.q = s.d_inner // head_dim, head_dim, state, groups, chunk
        s.conv_dim = s.d_inner + 2 * groups * state
        s.in_proj = nn.Linear(hidden, 2 * s.d_inner + 2 * groups * state + s.h, bias=False)
        s.conv = nn.Conv1d(s.conv_dim, s.conv_dim, 4, groups=s.conv_dim, padding=3)
        s.dt_bias = nn.Parameter(torch.rand(s.h) - 4.0)
        s.A_log = nn.Parameter(torch.log(torch.rand(s.h) * 15 + 1))
        s.D = nn.Parameter(torch.ones(s.h))
        s.norm = nn.Parameter(torch.ones(s.d_inner))
        s.out_proj = nn.Linear(s.d_inner, hidden, bias=False)

    def forward(s, u):
        b, t, _ = u.shape
        z, xbc, dt = torch.split(s.in_proj(u), [s.d_inner, s.conv_dim, s.h], dim=-1)
        xbc = F.silu(s.conv(xbc.transpose(1, 2))[..., :t].transpose(1, 2))
        x, B, C = torch.split(xbc, [s.d_inner, s.g * s.n, s.g * s.n], dim=-1)
        rep = s.h // s.g
        B = B.reshape(b, t, s.g, s.n).repeat_interleave(rep, dim=2).float()
        C = C.reshape(b, t, s.g, s.n).repeat_interleave(rep, dim=2).float()
        x = x.reshape(b, t, s.h, s.p).float()
        dt = F.softplus(dt.float() + s.dt_bias)
        y = ssd(x, dt, -torch.exp(s.A_log.float()), B, C, s.q) + s.D[:, None] * x
        y = y.reshape(b, t, s.d_inner) * F.silu(z.float())
        # RMSNorm per group of d_inner / G channels, after the gate (Megatron's and mamba_ssm's).
        yg = y.reshape(b, t, s.g, -1)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + 1e-5)
        return s.out_proj((yg.reshape(b, t, s.d_inner) * s.norm).to(u.dtype))


class MambaStack(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(a.vocab, a.hidden)
        s.norms = nn.ParameterList([nn.Parameter(torch.ones(a.hidden)) for _ in range(a.layers)])
        s.mixers = nn.ModuleList([Mixer(a.hidden, a.head_dim, a.state, a.groups, a.chunk) for _ in range(a.layers)])
        s.final = nn.Parameter(torch.ones(a.hidden))
        s.out = nn.Linear(a.hidden, a.vocab, bias=False)

    def forward(s, idx, targets):
        h = s.emb(idx)
        for w, m in zip(s.norms, s.mixers):
            h = h + m(rmsnorm(h, w))
        logits = s.out(rmsnorm(h, s.final))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


m = MambaStack().to(dev)
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
model = torch.compile(m)
data = torch.randint(0, a.vocab, (a.micro, a.seq + 1), device=dev)


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(data[:, :-1], data[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
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
print(json.dumps({"impl": "pytorch-compile-ssd-einsum", "torch": torch.__version__, "tokens_per_s": tps,
                  "mfu": tps * a.flops_per_token / 989e12, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "params": sum(v.numel() for v in m.parameters())}))
