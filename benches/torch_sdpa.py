"""PyTorch SDPA (flash backend) on the shapes of examples/attention_bench.rs: causal, bf16, head
dims 64 and 128 (or --dims), 16k tokens per call over 2048 hidden; forward and backward TFLOP/s with
FlashAttention's FLOP convention. Written for this project."""
import sys, time
import torch
import torch.nn.functional as F

# --fused: Q, K and V as strided views of one [B, T, 3, H, D] projection output, as the GPT twin
# (benches/torch_gpt_model.py) passes them.
fused = "--fused" in sys.argv
# --dropout P: attention dropout at rate P (dropout_p), as ATTN_BENCH_DROPOUT=P for ours.
dropout = float(sys.argv[sys.argv.index("--dropout") + 1]) if "--dropout" in sys.argv else 0.0
# --dims 64,128,192: the head dims, as ATTN_BENCH_DIMS for ours.
dims = [int(d) for d in sys.argv[sys.argv.index("--dims") + 1].split(",")] if "--dims" in sys.argv else [64, 128]

print("| head dim | seq | batch × heads | SDPA fwd TFLOP/s | SDPA bwd TFLOP/s |")
print("|---|---|---|---|---|")
for d in dims:
    for t in (1024, 2048, 4096, 8192, 16384):
        b, h = max(1, 16384 // t), 2048 // d
        if fused:
            qkv = torch.randn(b, t, 3, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
        else:
            q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)

        def timed(f, reps=5):
            f()
            torch.cuda.synchronize()
            s = time.perf_counter()
            for _ in range(reps):
                f()
            torch.cuda.synchronize()
            return (time.perf_counter() - s) / reps

        fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        inputs = (qkv,) if fused else (q, k, v)
        bwd = timed(lambda: torch.autograd.grad(o, inputs, do, retain_graph=True))
        flops = 4 * b * h * t * t * d / 2
        print(f"| {d} | {t} | {b} × {h} | {flops / fwd / 1e12:.1f} | {2.5 * flops / bwd / 1e12:.1f} |")
