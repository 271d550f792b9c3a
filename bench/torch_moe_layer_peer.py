#!/usr/bin/python3
"""The MoE layer written the usual PyTorch way: the peer `moe bench moe-layer` compares against.

Router linear -> softmax -> top-k -> renormalized gate weights, then a loop over experts with
index_select / index_add_ (as fastmoe-less PyTorch code and many tutorials do). Prints one JSON
line with the median forward and forward+backward times. Run by the benchmark with Debian's
python3-torch; the benchmark sets OPENBLAS_CORETYPE for this process only.
"""
import argparse
import json
import statistics
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

    def forward(self, x):  # x [N, C]
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


def median_ms(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    layer = MoeLayer(a.d_model, a.d_ffn, a.experts, a.top_k)
    x = torch.randn(a.tokens, a.d_model, requires_grad=True)
    dy = torch.randn(a.tokens, a.d_model)

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        layer.zero_grad(set_to_none=False)
        x.grad = None
        layer(x).backward(dy)

    print(json.dumps({"forward_ms": median_ms(fwd, a.repeats), "forward_backward_ms": median_ms(fwd_bwd, a.repeats),
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
