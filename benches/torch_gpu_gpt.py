"""PyTorch reference for `cargo xtask bench --gpu`: the same GPT (gpt2 style: LayerNorm, tanh-GeLU,
learned positions, tied output layer; or `--style llama`: RMSNorm, SwiGLU, RoPE, GQA, untied) in
bf16 autocast with torch.compile + SDPA and fused AdamW, gradients clipped by their global norm at
`--clip` (1.0, Ferrotron's and Megatron's default; 0 turns it off), timed over `--iters` steps
after warm-up.
Prints one JSON line: tokens/s, MFU, peak memory.

Written for this project."""
import argparse, json, time
import torch
from torch_gpt_model import GPT, Llama

p = argparse.ArgumentParser()
for name, default in [("layers", 12), ("hidden", 768), ("heads", 12), ("seq", 1024), ("vocab", 50304),
                      ("micro", 8), ("iters", 10), ("warmup", 3)]:
    p.add_argument(f"--{name}", type=int, default=default)
p.add_argument("--flops-per-token", type=float, required=True)
p.add_argument("--clip", type=float, default=1.0)
p.add_argument("--style", choices=["gpt2", "llama"], default="gpt2")
p.add_argument("--groups", type=int, default=0)  # llama: query groups (GQA)
p.add_argument("--ffn", type=int, default=0)  # llama: SwiGLU width
p.add_argument("--attn-dropout", type=float, default=0.0)  # SDPA's dropout_p (Ferrotron's --attention-dropout)
p.add_argument("--experts", type=int, default=0)  # llama: MoE layers of this many SwiGLU experts of --ffn
p.add_argument("--topk", type=int, default=2)  # with --experts: experts per token
p.add_argument("--aux", type=float, default=0.0)  # with --experts: load-balancing loss coefficient
p.add_argument("--profile", type=int, default=0)  # N > 0: a CUDA profiler range over N steps, no timing
p.add_argument("--trace", default="")  # FILE: torch.profiler's GPU timeline of --iters steps, no timing
a = p.parse_args()
dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = True


if a.style == "llama":
    moe = (a.experts, a.topk, a.aux) if a.experts else None
    m = Llama(a.layers, a.hidden, a.heads, a.groups, a.ffn, a.vocab, attn_dropout=a.attn_dropout, moe=moe).to(dev)
else:
    m = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab, attn_dropout=a.attn_dropout).to(dev)
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
model = torch.compile(m)
data = torch.randint(0, a.vocab, (a.micro, a.seq + 1), device=dev)


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(data[:, :-1], data[:, 1:])
    loss.backward()
    if a.clip > 0:
        torch.nn.utils.clip_grad_norm_(m.parameters(), a.clip, foreach=True)
    opt.step()


for _ in range(a.warmup):
    step()

if a.trace:
    # The GPU timeline of --iters steps (`cargo xtask bench --gpu-trace`, beside Ferrotron's
    # --profile-trace): kernels, copies and memsets with the GPU's own times, as a Chrome trace.
    # No synchronisation before it, so the warm-up steps' queue runs on into the traced ones as
    # in a running job; the first traced step, cut by the start, is left out of the tables.
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.iters):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(a.trace)
    raise SystemExit(0)
torch.cuda.synchronize()

if a.profile > 0:
    # A CUDA profiler range over N steps after warm-up, for `ncu --profile-from-start off`
    # (`cargo xtask bench --gpu-profile`, which runs Ferrotron's `--profile` range the same way).
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(a.profile):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    raise SystemExit(0)
torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
for _ in range(a.iters):
    step()
torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / a.iters
tps = a.micro * a.seq / dt
print(json.dumps({"impl": "pytorch-compile-sdpa", "torch": torch.__version__, "tokens_per_s": tps,
                  "mfu": tps * a.flops_per_token / 989e12, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}))
