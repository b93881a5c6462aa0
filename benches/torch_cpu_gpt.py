"""PyTorch eager reference for Ferrotron's CPU benchmark: the same GPT shapes, one training step =
forward + backward + AdamW over `global_batch // micro_batch` micro-batches. Prints one JSON line.

Written for this project (not derived from Megatron or nanoGPT code)."""
import argparse, json, time
import torch
from torch_gpt_model import GPT

p = argparse.ArgumentParser()
for name, default in [("layers", 4), ("hidden", 128), ("heads", 4), ("seq", 128), ("vocab", 256),
                      ("micro", 16), ("global_batch", 32), ("iters", 12), ("threads", 2)]:
    p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)


m = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab)
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
