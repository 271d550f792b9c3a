#!/usr/bin/python3
"""The MoE layer written the usual PyTorch way: the peer `moe bench moe-layer` compares against.

Router linear -> softmax -> top-k -> renormalized gate weights, then a loop over experts with
index_select / index_add_ (as fastmoe-less PyTorch code and many tutorials do). Prints one JSON
line with the median forward and forward+backward times. Run by `moe bench moe-layer` with Debian's
python3-torch on the CPU (the benchmark sets OPENBLAS_CORETYPE for this process only) with `--serve`:
after its warm-ups it prints "ready", then times one pass for each line "fwd" or "fwdbwd" it reads
and prints the milliseconds, so the benchmark can alternate the peer's passes with its own and pair
each with one of moe's seconds apart (this machine's speed moves by up to 2x between spells). And by
`moe bench cuda` with `--device cuda --dtype bf16` on the GPU, where `--impl grouped_mm` also times
the experts as torch._grouped_mm calls (PyTorch's fused grouped GEMM) instead of the loop.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


class MoeLayer(torch.nn.Module):
    def __init__(self, d_model, d_ffn, n_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(d_model, n_experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(n_experts, d_ffn, d_model) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(n_experts, d_model, d_ffn) * 0.02)

    def forward(self, x, impl="loop"):  # x [N, C]
        if impl == "grouped_mm":
            return self.forward_grouped(x)
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1)
        p, idx = torch.topk(probs, self.top_k, dim=-1)       # [N, K]
        w = p / p.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            h = F.gelu(x.index_select(0, tok) @ self.w1[e].t(), approximate="tanh")
            out = (h @ self.w2[e].t()) * w[tok, slot].unsqueeze(1)
            y.index_add_(0, tok, out)
        return y

    def forward_grouped(self, x):
        # Assignments sorted by expert, each expert's rows one group of torch._grouped_mm.
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1)
        p, idx = torch.topk(probs, self.top_k, dim=-1)
        w = (p / p.sum(dim=-1, keepdim=True)).reshape(-1)
        order = torch.argsort(idx.reshape(-1), stable=True)
        tok = order // self.top_k
        counts = torch.bincount(idx.reshape(-1), minlength=self.w1.shape[0])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x.index_select(0, tok)
        h = F.gelu(torch._grouped_mm(xs, self.w1.transpose(1, 2), offs=offs), approximate="tanh")
        out = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offs) * w[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, tok, out)


def median_ms(fn, repeats, sync):
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def serve(passes, sync):
    for fn in passes.values():  # warm-up
        fn()
    sync()
    print("ready", flush=True)
    for line in sys.stdin:
        fn = passes[line.strip()]
        t0 = time.perf_counter()
        fn()
        sync()
        print(f"{(time.perf_counter() - t0) * 1e3:.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--impl", default="loop", choices=["loop", "grouped_mm"])
    ap.add_argument("--serve", action="store_true", help="time one pass per stdin line (fwd | fwdbwd)")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    layer = MoeLayer(a.d_model, a.d_ffn, a.experts, a.top_k).to(dev, dtype)
    x = torch.randn(a.tokens, a.d_model, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(a.tokens, a.d_model, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def fwd():
        with torch.no_grad():
            layer(x, a.impl)

    def fwd_bwd():
        layer.zero_grad(set_to_none=False)
        x.grad = None
        layer(x, a.impl).backward(dy)

    if a.serve:
        serve({"fwd": fwd, "fwdbwd": fwd_bwd}, sync)
        return
    print(json.dumps({"forward_ms": median_ms(fwd, a.repeats, sync),
                      "forward_backward_ms": median_ms(fwd_bwd, a.repeats, sync),
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "impl": a.impl,
                      "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu"}))


if __name__ == "__main__":
    main()
