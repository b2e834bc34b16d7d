#!/usr/bin/env python3
"""lockstep's PyTorch peer: the benchmark models trained with PyTorch on the CPU.

The same models as configs/gpt2-peer.toml (--model dense) and configs/moe-peer.toml (--model moe),
for bench/train_vs_torch.sh, which runs this file side by side with lockstep on the same cores.

  dense  GPT-2 flavour as lockstep's model.preset = "gpt2": learned position embedding,
         pre-LayerNorm (eps 1e-5), fused QKV attention with causal softmax, tanh-GELU MLP
         C -> 4C -> C, biases in every linear layer, final LayerNorm, output head tied to the word
         embedding; L 4, C 256, 4 heads, T 256, micro-batch B 4, vocabulary 8192.
  moe    the same with every MLP an MoE sublayer: a router without bias, logits (N, E); per token
         the top-K logits, routing weights = softmax over those K (lockstep's default
         router_pre_softmax = false, which equals softmax over all E renormalised over the K);
         E experts, each a tanh-GELU MLP C -> H -> C with biases, applied to the token's rows and
         weighted after the expert; the switch aux loss (Megatron's aux_loss) of each layer,
         coeff * E / (K N^2) * sum_e T_e P_e (T_e: choices of expert e in the top-K map of
         softmax(logits), P_e: the sum of softmax(logits)[:, e]), added to the LM loss. E 8, K 2,
         H 512, coefficient 0.01.

Both: weights normal(0, 0.02), the attention and MLP output projections normal(0, 0.02 /
sqrt(2 L)) (lockstep's and Megatron's scaled init), biases 0, LayerNorm 1 / 0; AdamW(lr 3e-4,
betas 0.9 / 0.999, eps 1e-8, weight decay 0), constant LR, no gradient clipping, FP32. One
micro-batch per step of uniformly random tokens (from --seed), the next token as target.

Setup: bench/setup_peers.sh puts PyTorch from PyPI into bench/.venv (git ignores it):

  bench/.venv/bin/python bench/torch_peer.py --model dense|moe [--threads 2] [--steps 10]
      [--warmup 2] [--seed 0] [--L 4 --C 256 --NH 4 --T 256 --B 4 --V 8192] [--E 8 --K 2 --H 512]
      [--aux-coeff 0.01] [--attention sdpa|math] [--dump losses.txt]

Output: one line per step, `step S loss X [aux Y] Z ms` (`[warmup]` on the first --warmup steps);
the last line `RESULT torch=... model=... threads=... params=... median_ms=... min_ms=... max_ms=...
tok_per_s=...`, over the steps after warm-up (tok_per_s = B T / median step time). A step's time is
the forward, the backward and the optimizer update of one micro-batch.

Threads: --threads sets torch.set_num_threads. A PyTorch whose BLAS is OpenBLAS (Debian's
python3-torch) also needs OPENBLAS_NUM_THREADS, which torch does not set: bench/train_vs_torch.sh
tries both; PyPI's wheels (oneDNN / MKL) follow --threads alone.
"""
import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dense", choices=["dense", "moe"])
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    sizes = [("L", 4, "layers"), ("C", 256, "hidden size"), ("NH", 4, "attention heads"),
             ("T", 256, "sequence length"), ("B", 4, "sequences per step"), ("V", 8192, "vocabulary"),
             ("E", 8, "moe: experts"), ("K", 2, "moe: experts per token"),
             ("H", 512, "moe: expert hidden size")]
    for name, default, what in sizes:
        p.add_argument("--" + name, type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--aux-coeff", type=float, default=0.01, help="moe: switch aux loss coefficient")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "math"],
                   help="sdpa: torch's scaled_dot_product_attention (where it has one); "
                        "math: explicit masked softmax")
    p.add_argument("--dump", default="", help="write every step's LM loss to this file")
    a = p.parse_args(argv)
    if a.C % a.NH:
        p.error(f"--C {a.C} is not divisible by --NH {a.NH}")
    if a.model == "moe" and not 1 <= a.K <= a.E:
        p.error(f"--K {a.K} must be in [1, --E {a.E}]")
    if a.steps < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--steps and --threads must be >= 1, --warmup >= 0")
    return a


class CausalSelfAttention(nn.Module):
    def __init__(self, C, heads, use_sdpa):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.use_sdpa = use_sdpa and hasattr(F, "scaled_dot_product_attention")

    def forward(self, x):
        B, T, C = x.shape
        D = C // self.heads
        # (3, B, heads, T, D)
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D).permute(2, 0, 3, 1, 4).unbind(0)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
            future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
            y = torch.matmul(scores.masked_fill(future, float("-inf")).softmax(dim=-1), v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class DenseMLP(nn.Module):
    def __init__(self, C, F_):
        super().__init__()
        self.fc = nn.Linear(C, F_)
        self.proj = nn.Linear(F_, C)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class MoEMLP(nn.Module):
    """Top-K softmax router, E GELU experts, weighted combine, switch aux loss.

    Dispatch: the N K (token, choice) pairs are sorted by expert (stable, so each expert sees its
    tokens in token order), each expert runs its two GEMMs on its contiguous rows, the outputs go
    back to (token, choice) order and each token sums its K weighted outputs (no scatter-add).
    """

    def __init__(self, C, E, K, H, aux_coeff):
        super().__init__()
        self.E, self.K, self.aux_coeff = E, K, aux_coeff
        self.router = nn.Linear(C, E, bias=False)
        # Laid out as lockstep's layers.<l>.moe.experts.{fc,proj}.{weight,bias}: (E, H, C), (E, C, H).
        self.fc_weight = nn.Parameter(torch.empty(E, H, C))
        self.fc_bias = nn.Parameter(torch.empty(E, H))
        self.proj_weight = nn.Parameter(torch.empty(E, C, H))
        self.proj_bias = nn.Parameter(torch.empty(E, C))
        self.aux_loss = None

    def forward(self, x):
        B, T, C = x.shape
        N, E, K = B * T, self.E, self.K
        tokens = x.reshape(N, C)
        logits = self.router(tokens)                                   # (N, E)
        top_logits, choice = logits.topk(K, dim=-1)                    # (N, K)
        weights = top_logits.softmax(dim=-1)                           # softmax over the K chosen

        expert_of = choice.reshape(-1)                                 # (N K)
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=E)
        rows = tokens.index_select(0, torch.div(order, K, rounding_mode="floor"))
        outputs = []
        for e, rows_e in enumerate(rows.split(counts.tolist())):
            hidden = F.gelu(torch.addmm(self.fc_bias[e], rows_e, self.fc_weight[e].t()), approximate="tanh")
            outputs.append(torch.addmm(self.proj_bias[e], hidden, self.proj_weight[e].t()))
        sorted_out = torch.cat(outputs, dim=0)                         # (N K, C) in expert order
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        per_choice = sorted_out.index_select(0, unsort).view(N, K, C)
        out = torch.bmm(weights.unsqueeze(1), per_choice).view(B, T, C)

        # Switch aux loss over softmax of all E; its routing map is the plain top-K of the scores
        # (the same experts as the top-K logits: softmax is monotone).
        scores = logits.softmax(dim=-1)
        routed = torch.bincount(expert_of, minlength=E).to(scores.dtype)   # T_e, no gradient
        self.aux_loss = self.aux_coeff * E / (K * N * N) * torch.dot(routed, scores.sum(dim=0))
        return out


class Block(nn.Module):
    def __init__(self, a, moe):
        super().__init__()
        self.attn_norm = nn.LayerNorm(a.C, eps=1e-5)
        self.attn = CausalSelfAttention(a.C, a.NH, a.attention == "sdpa")
        self.mlp_norm = nn.LayerNorm(a.C, eps=1e-5)
        self.mlp = MoEMLP(a.C, a.E, a.K, a.H, a.aux_coeff) if moe else DenseMLP(a.C, 4 * a.C)

    def forward(self, h):
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class GPT(nn.Module):
    def __init__(self, a, moe):
        super().__init__()
        self.word = nn.Embedding(a.V, a.C)
        self.position = nn.Embedding(a.T, a.C)
        self.layers = nn.ModuleList(Block(a, moe) for _ in range(a.L))
        self.final_norm = nn.LayerNorm(a.C, eps=1e-5)
        self.register_buffer("positions", torch.arange(a.T), persistent=False)
        self._init(a)

    def _init(self, a):
        std, out_std = 0.02, 0.02 / math.sqrt(2 * a.L)
        with torch.no_grad():
            for name, t in self.named_parameters():
                if name.endswith("norm.weight"):
                    t.fill_(1.0)
                elif "bias" in name.rsplit(".", 1)[-1]:
                    t.zero_()
                elif name.endswith("proj.weight") or name.endswith("proj_weight"):
                    t.normal_(0.0, out_std)
                else:
                    t.normal_(0.0, std)

    def forward(self, tokens, targets):
        h = self.word(tokens) + self.position(self.positions[: tokens.shape[1]])
        for layer in self.layers:
            h = layer(h)
        logits = F.linear(self.final_norm(h), self.word.weight)        # tied output head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def aux_loss(self):
        terms = [layer.mlp.aux_loss for layer in self.layers if isinstance(layer.mlp, MoEMLP)]
        return torch.stack(terms).sum() if terms else None


def adamw(params):
    kwargs = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    # The fastest update this torch has on the CPU: fused (2.4+), else the multi-tensor one.
    for extra in ({"fused": True}, {"foreach": True}, {}):
        try:
            return torch.optim.AdamW(params, **kwargs, **extra), next(iter(extra), "for-loop")
        except (TypeError, RuntimeError, ValueError):
            continue
    raise RuntimeError("no AdamW")


def main(argv):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    moe = a.model == "moe"
    model = GPT(a, moe)
    params = list(model.parameters())
    nparam = sum(t.numel() for t in params)
    opt, impl = adamw(params)
    data = torch.Generator().manual_seed(a.seed + 1)
    sizes = f"L={a.L} C={a.C} NH={a.NH} T={a.T} B={a.B} V={a.V}" + (f" E={a.E} K={a.K} H={a.H}" if moe else "")
    print(f"peer: torch {torch.__version__}, model {a.model} ({sizes}), {nparam} parameters, "
          f"{torch.get_num_threads()} threads, AdamW {impl}, attention "
          f"{'sdpa' if model.layers[0].attn.use_sdpa else 'math'}", flush=True)

    losses, times = [], []
    for s in range(a.warmup + a.steps):
        seq = torch.randint(0, a.V, (a.B, a.T + 1), generator=data)
        inputs, targets = seq[:, :-1], seq[:, 1:]
        t0 = time.perf_counter()
        lm_loss = model(inputs, targets)
        aux = model.aux_loss()
        loss = lm_loss + aux if aux is not None else lm_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ms = (time.perf_counter() - t0) * 1000.0
        times.append(ms)
        losses.append(lm_loss.item())
        aux_text = f" aux {aux.item():.6f}" if aux is not None else ""
        print(f"step {s} loss {losses[-1]:.6f}{aux_text} {ms:.1f} ms{' [warmup]' if s < a.warmup else ''}",
              flush=True)

    timed = times[a.warmup:]
    median = statistics.median(timed)
    print(f"RESULT torch={torch.__version__} model={a.model} threads={torch.get_num_threads()} params={nparam} "
          f"median_ms={median:.2f} min_ms={min(timed):.2f} max_ms={max(timed):.2f} "
          f"tok_per_s={a.B * a.T / (median / 1000.0):.1f}", flush=True)
    if a.dump:
        with open(a.dump, "w") as f:
            f.writelines(f"{v!r}\n" for v in losses)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
