#!/usr/bin/python3
"""PyTorch reference of the model of docs/model.md (issue 2: PyTorch parity).

Usage:
    /usr/bin/python3 tests/torch_reference.py IN_DIR OUT_DIR
    /usr/bin/python3 tests/torch_reference.py --selftest

Builds the model in plain PyTorch (float64, so a parity test measures only the f32 error of the
C++ side), runs forward and backward on the given weights and tokens, and writes what it computed.
Only the standard library and torch are used (no numpy, no safetensors).

IN_DIR/manifest.json:
    {"config": {ModelConfig::to_json() fields}, "B": int, "T": int,
     "tokens": "tokens.i32", "targets": "targets.i32",        # raw little-endian int32 [B*T]
     "params": [{"name": str, "shape": [int], "file": str}]}  # raw little-endian float32, row-major

OUT_DIR/manifest.json:
    {"ce": float, "aux": [float per MoE block], "z": [...], "moe_loss": float, "total": float,
     "moe_layers": [block index per MoE block],
     "tensors": [{"name": str, "shape": [int], "file": str}],  # raw little-endian float64
                  # names: "logits" [B,T,V] and "grad/<param name>" for every parameter
     "routing": [{"layer": l, "expert": [N*K], "row_token": [R], "row_assignment": [R],
                  "expert_offset": [E+1], "tokens_per_expert": [E], "dropped": int,
                  "capacity": int (-1 = dropless), "min_margin": float}]}

min_margin is the smallest gap, over tokens, between consecutive sorted router probabilities among
the first K+1 (the top-k order and the k-th/(k+1)-th boundary): how far the routing is from a tie.

Math (normative: src/moe/moe_layer.h, src/moe/layout.h):
  router logits = x @ W^T, probs = softmax, top-k in descending prob (ties -> lower expert);
  gate w = p (K == 1 or not renormalize) or p / sum_k p over all K choices (before dropping);
  capacity (cf > 0): ceil(cf * N * K / E) per expert, filled k-major: all first choices in token
  order, then all second choices, ...; dropped assignments contribute 0;
  permuted rows: experts ascending, within an expert kept assignments in increasing token order;
  aux = E * sum_e f_e * P_e with f_e = share of all N*K top-k choices (before dropping) that chose e
  (a constant: gradient through P_e = mean_n probs[n, e] only); z = mean_n logsumexp(logits[n])^2;
  total = mean CE + sum over MoE blocks of (aux_w * aux + z_w * z).
"""

import array
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

DTYPE = torch.float64
NORM_EPS = 1e-5


def f32(x):
    """x rounded to float32, as the C++ MoeConfig stores it."""
    return float(torch.tensor(x, dtype=torch.float32).item())


# ---- raw I/O (little-endian) ------------------------------------------------------------------

def read_raw(path, typecode, count):
    a = array.array(typecode)
    with open(path, "rb") as f:
        a.frombytes(f.read())
    if sys.byteorder != "little":
        a.byteswap()
    if len(a) != count:
        raise ValueError(f"{path}: {len(a)} values, expected {count}")
    return a


def write_raw(path, t):
    a = array.array("d", t.detach().to(torch.float64).reshape(-1).tolist())
    if sys.byteorder != "little":
        a.byteswap()
    with open(path, "wb") as f:
        f.write(a.tobytes())


# ---- model ---------------------------------------------------------------------------------------

class Config:
    def __init__(self, j):
        self.V = int(j["vocab_size"])
        self.T = int(j["seq_len"])
        self.C = int(j["d_model"])
        self.L = int(j["n_layers"])
        self.NH = int(j["n_heads"])
        self.F = int(j["d_ffn"])
        self.E = int(j["n_experts"])
        self.K = int(j["top_k"])
        self.swiglu = j["activation"] == "swiglu"
        self.rmsnorm = j["norm"] == "rmsnorm"
        self.dense_every_other = bool(j["dense_every_other"])
        self.renormalize = bool(j["renormalize"])
        # MoeConfig holds these as float; mirror that rounding.
        self.capacity_factor = f32(j["capacity_factor"])
        self.aux_w = f32(j["aux_loss_weight"])
        self.z_w = f32(j["z_loss_weight"])
        self.skew = float(j.get("router_skew", 0.0))

    def is_moe(self, l):
        return not (self.dense_every_other and l % 2 == 1)


def param_shapes(cfg):
    """Every parameter name and shape, in Model::params() order (src/model/model.h)."""
    V, T, C, F_, E = cfg.V, cfg.T, cfg.C, cfg.F, cfg.E
    out = [("wte.weight", [V, C]), ("wpe.weight", [T, C])]
    for l in range(cfg.L):
        p = f"blocks.{l}."
        out.append((p + "norm1.weight", [C]))
        if not cfg.rmsnorm:
            out.append((p + "norm1.bias", [C]))
        out += [(p + "attn.qkv.weight", [3 * C, C]), (p + "attn.proj.weight", [C, C])]
        out.append((p + "norm2.weight", [C]))
        if not cfg.rmsnorm:
            out.append((p + "norm2.bias", [C]))
        if cfg.is_moe(l):
            out += [(p + "moe.router.weight", [E, C]), (p + "moe.w1", [E, F_, C]), (p + "moe.w2", [E, C, F_])]
            if cfg.swiglu:
                out.append((p + "moe.w3", [E, F_, C]))
        else:
            out += [(p + "mlp.w1", [F_, C]), (p + "mlp.w2", [C, F_])]
            if cfg.swiglu:
                out.append((p + "mlp.w3", [F_, C]))
    out.append(("norm_f.weight", [C]))
    if not cfg.rmsnorm:
        out.append(("norm_f.bias", [C]))
    return out


def norm(cfg, P, prefix, x):
    w = P[prefix + ".weight"]
    if cfg.rmsnorm:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return x * rstd * w
    return F.layer_norm(x, (cfg.C,), w, P[prefix + ".bias"], eps=NORM_EPS)


def attention(cfg, x, qkv_w, proj_w):
    B, T, C = x.shape
    NH, HS = cfg.NH, C // cfg.NH
    q, k, v = F.linear(x, qkv_w).split(C, dim=-1)
    q, k, v = (t.view(B, T, NH, HS).transpose(1, 2) for t in (q, k, v))  # [B,NH,T,HS]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(HS)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    return F.linear(y, proj_w)


def ffn(cfg, x, w1, w2, w3):
    """w2 @ act(w1 @ x) (GELU, tanh approximation) or w2 @ (silu(w1 @ x) * (w3 @ x)) (SwiGLU)."""
    h = F.linear(x, w1)
    a = F.silu(h) * F.linear(x, w3) if cfg.swiglu else F.gelu(h, approximate="tanh")
    return F.linear(a, w2)


def route(cfg, probs):
    """Top-k, capacity dropping and the permuted-row layout. Discrete: no gradient."""
    N, E, K = probs.shape[0], cfg.E, cfg.K
    p_sorted, order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True)  # ties -> lower expert
    idx = order[:, :K]  # [N,K]
    top = min(K + 1, E)
    if top > 1:
        min_margin = float((p_sorted[:, : top - 1] - p_sorted[:, 1:top]).min())
    else:
        min_margin = float("inf")
    cap = -1
    if cfg.capacity_factor > 0:
        cap = int(math.ceil(float(cfg.capacity_factor) * float(N * K) / float(E)))
    ex = idx.tolist()
    kept = [[True] * K for _ in range(N)]
    if cap >= 0:
        used = [0] * E
        for k in range(K):          # global order: k-major ...
            for n in range(N):      # ... then token order
                e = ex[n][k]
                if used[e] < cap:
                    used[e] += 1
                else:
                    kept[n][k] = False
    row_token, row_assignment, tpe = [], [], [0] * E
    for e in range(E):              # experts ascending, each in increasing token order
        for n in range(N):
            for k in range(K):
                if ex[n][k] == e and kept[n][k]:
                    row_token.append(n)
                    row_assignment.append(n * K + k)
                    tpe[e] += 1
    offsets = [0]
    for e in range(E):
        offsets.append(offsets[-1] + tpe[e])
    return idx, kept, {
        "expert": [e for row in ex for e in row],
        "row_token": row_token,
        "row_assignment": row_assignment,
        "expert_offset": offsets,
        "tokens_per_expert": tpe,
        "dropped": N * K - sum(tpe),
        "capacity": cap,
        "min_margin": min_margin,
    }


def moe_layer(cfg, P, prefix, x):
    """x [N,C] -> (y [N,C], aux, z, routing record)."""
    N, E, K = x.shape[0], cfg.E, cfg.K
    logits = F.linear(x, P[prefix + "router.weight"])  # [N,E]
    if cfg.skew > 0:  # ModelConfig::router_skew: expert (l + j) mod E gets -s * ln(1 + j), as float32
        l = int(prefix.split(".")[1])
        rank = torch.tensor([(e - l) % E for e in range(E)], dtype=torch.float64)
        logits = logits + (-cfg.skew * torch.log1p(rank)).to(torch.float32).to(DTYPE)
    probs = logits.softmax(-1)
    idx, kept, rec = route(cfg, probs)
    p = probs.gather(1, idx)  # [N,K], differentiable
    w = p / p.sum(-1, keepdim=True) if (K > 1 and cfg.renormalize) else p
    keep = torch.tensor(kept, dtype=DTYPE)
    w = w * keep  # dropped assignments contribute 0
    y = torch.zeros_like(x)
    w1, w2 = P[prefix + "w1"], P[prefix + "w2"]
    w3 = P.get(prefix + "w3")
    for e in range(E):
        sel = (idx == e) & keep.bool()          # [N,K]; a token picks e at most once
        tok = sel.any(-1).nonzero(as_tuple=True)[0]
        if tok.numel() == 0:
            continue
        gate = (w * sel.to(DTYPE)).sum(-1)[tok]  # [n]
        out = ffn(cfg, x[tok], w1[e], w2[e], None if w3 is None else w3[e])
        y = y.index_add(0, tok, out * gate[:, None])
    f = torch.bincount(idx.reshape(-1), minlength=E).to(DTYPE) / float(N * K)  # constant
    aux = E * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    return y, aux, z, rec


def forward(cfg, P, tokens, targets):
    """tokens, targets: int64 [B,T]. Returns logits, ce, total, [aux], [z], [routing]."""
    B, T = tokens.shape
    x = P["wte.weight"][tokens] + P["wpe.weight"][:T]
    auxs, zs, recs = [], [], []
    moe_extra = torch.zeros((), dtype=DTYPE)
    for l in range(cfg.L):
        p = f"blocks.{l}."
        h = x + attention(cfg, norm(cfg, P, p + "norm1", x), P[p + "attn.qkv.weight"], P[p + "attn.proj.weight"])
        xn = norm(cfg, P, p + "norm2", h)
        if cfg.is_moe(l):
            y, aux, z, rec = moe_layer(cfg, P, p + "moe.", xn.reshape(B * T, cfg.C))
            y = y.view(B, T, cfg.C)
            rec["layer"] = l
            auxs.append(aux)
            zs.append(z)
            recs.append(rec)
            moe_extra = moe_extra + cfg.aux_w * aux + cfg.z_w * z
        else:
            y = ffn(cfg, xn, P[p + "mlp.w1"], P[p + "mlp.w2"], P.get(p + "mlp.w3"))
        x = h + y
    logits = F.linear(norm(cfg, P, "norm_f", x), P["wte.weight"])
    ce = F.cross_entropy(logits.reshape(B * T, cfg.V), targets.reshape(B * T))
    return logits, ce, moe_extra, auxs, zs, recs


# ---- file mode -----------------------------------------------------------------------------------

def run(in_dir, out_dir):
    with open(os.path.join(in_dir, "manifest.json")) as f:
        man = json.load(f)
    cfg = Config(man["config"])
    B, T = int(man["B"]), int(man["T"])
    tokens = torch.tensor(read_raw(os.path.join(in_dir, man["tokens"]), "i", B * T), dtype=torch.int64).view(B, T)
    targets = torch.tensor(read_raw(os.path.join(in_dir, man["targets"]), "i", B * T), dtype=torch.int64).view(B, T)
    expected = param_shapes(cfg)
    given = [(p["name"], list(p["shape"])) for p in man["params"]]
    if given != expected:
        raise ValueError(f"parameter list differs from docs/model.md:\n given    {given}\n expected {expected}")
    P, order = {}, []
    for p in man["params"]:
        n = math.prod(p["shape"])
        t = torch.tensor(read_raw(os.path.join(in_dir, p["file"]), "f", n), dtype=DTYPE).view(p["shape"])
        P[p["name"]] = t.requires_grad_(True)
        order.append(p["name"])

    logits, ce, moe_extra, auxs, zs, recs = forward(cfg, P, tokens, targets)
    total = ce + moe_extra
    total.backward()

    os.makedirs(out_dir, exist_ok=True)
    tensors = []

    def put(name, t):
        fname = f"t{len(tensors)}.f64"
        write_raw(os.path.join(out_dir, fname), t)
        tensors.append({"name": name, "shape": list(t.shape), "file": fname})

    put("logits", logits)
    for name in order:
        g = P[name].grad
        put("grad/" + name, torch.zeros_like(P[name]) if g is None else g)
    out = {
        "ce": float(ce),
        "aux": [float(a) for a in auxs],
        "z": [float(z) for z in zs],
        "moe_loss": float(moe_extra),
        "total": float(total),
        "moe_layers": [r["layer"] for r in recs],
        "tensors": tensors,
        "routing": recs,
        "torch_version": torch.__version__,
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(out, f)
    print(f"torch_reference: ce {float(ce):.9f} total {float(total):.9f}, {len(order)} grads, "
          f"{len(recs)} MoE blocks -> {out_dir}")


# ---- self-test (no C++ involved) -----------------------------------------------------------------

def selftest():
    """Checks the reference against itself where it can be checked independently:
    1. gradients of the total loss equal central finite differences (float64) for every parameter,
       so the detach on f_e and the discrete routing/dropping are what the math says;
    2. the layout rules on a hand-made routing (k-major capacity, token-ordered rows)."""
    torch.manual_seed(0)
    ok = True
    configs = [
        dict(activation="gelu", norm="layernorm", top_k=2, renormalize=True, capacity_factor=0.0,
             dense_every_other=False),
        dict(activation="swiglu", norm="rmsnorm", top_k=1, renormalize=True, capacity_factor=0.75,
             dense_every_other=True),
        dict(activation="gelu", norm="layernorm", top_k=2, renormalize=True, capacity_factor=1.0,
             dense_every_other=False),
        dict(activation="swiglu", norm="layernorm", top_k=2, renormalize=False, capacity_factor=0.75,
             dense_every_other=False),
    ]
    for ci, over in enumerate(configs):
        j = dict(vocab_size=256, seq_len=8, d_model=8, n_layers=2, n_heads=2, d_ffn=12, n_experts=4,
                 aux_loss_weight=0.5, z_loss_weight=0.3)  # large weights so those terms show in grads
        j.update(over)
        cfg = Config(j)
        B = 2
        P = {}
        for name, shape in param_shapes(cfg):
            if name.endswith(".bias"):
                t = 0.1 * torch.randn(shape, dtype=DTYPE)
            elif "norm" in name:
                t = 1 + 0.1 * torch.randn(shape, dtype=DTYPE)
            else:
                t = 0.5 * torch.randn(shape, dtype=DTYPE)  # large: routing far from uniform
            P[name] = t.requires_grad_(True)
        tokens = torch.randint(0, 256, (B, cfg.T))
        targets = torch.randint(0, 256, (B, cfg.T))

        def total_loss():
            _, ce, extra, _, _, _ = forward(cfg, P, tokens, targets)
            return ce + extra

        loss = total_loss()
        for t in P.values():
            t.grad = None
        loss.backward()
        _, _, _, _, _, recs = forward(cfg, P, tokens, targets)
        drops = sum(r["dropped"] for r in recs)
        margin = min(r["min_margin"] for r in recs)
        eps, worst = 1e-6, 0.0
        with torch.no_grad():
            for name, t in P.items():
                flat, g = t.view(-1), t.grad.reshape(-1)
                for i in range(0, flat.numel(), max(1, flat.numel() // 8)):  # ~8 entries per tensor
                    orig = float(flat[i])
                    flat[i] = orig + eps
                    lp = float(total_loss())
                    flat[i] = orig - eps
                    lm = float(total_loss())
                    flat[i] = orig
                    num = (lp - lm) / (2 * eps)
                    err = abs(num - float(g[i])) / max(abs(num), abs(float(g[i])), 1e-3)
                    worst = max(worst, err)
        status = "ok" if worst < 1e-5 else "FAIL"
        ok &= worst < 1e-5
        print(f"selftest config {ci}: finite-difference max rel err {worst:.2e} ({status}); "
              f"dropped {drops}, min routing margin {margin:.2e}")

    # Layout on a hand-made routing: E=3, K=2, N=4, capacity ceil(0.75*4*2/3) = 2.
    cfg = Config(dict(vocab_size=256, seq_len=4, d_model=4, n_layers=1, n_heads=1, d_ffn=4, n_experts=3,
                      top_k=2, activation="gelu", norm="layernorm", dense_every_other=False, renormalize=True,
                      capacity_factor=0.75, aux_loss_weight=0.0, z_loss_weight=0.0))
    # choices (first, second) per token: (0,1) (0,2) (0,1) (1,0)
    probs = torch.tensor([[.5, .3, .2], [.5, .2, .3], [.6, .3, .1], [.3, .6, .1]], dtype=DTYPE)
    _, kept, rec = route(cfg, probs)
    # expert 0: first choices of tokens 0,1,2 -> keeps 0,1; drops token 2's and token 3's second choice.
    # expert 1: first choice of token 3, then second choices of tokens 0, 2 -> keeps 3 and 0; drops 2.
    # expert 2: second choice of token 1 -> kept.
    want_kept = [[True, True], [True, True], [False, False], [True, False]]
    want_rows = [0, 1, 0, 3, 1]
    good = kept == want_kept and rec["row_token"] == want_rows and rec["tokens_per_expert"] == [2, 2, 1] \
        and rec["dropped"] == 3 and rec["row_assignment"] == [0, 2, 1, 6, 3] and rec["expert_offset"] == [0, 2, 4, 5]
    ok &= good
    print(f"selftest layout: {'ok' if good else 'FAIL'} kept {kept} rows {rec['row_token']}")
    print("selftest:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    if len(sys.argv) == 2 and sys.argv[1] == "--selftest":
        sys.exit(selftest())
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    run(sys.argv[1], sys.argv[2])
