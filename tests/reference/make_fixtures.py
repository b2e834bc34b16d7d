#!/usr/bin/python3
"""Writes the PyTorch reference fixtures that tests/test_reference.cpp checks lockstep against.

Each case builds one model family in PyTorch (float64) from weights it draws itself, runs one
batch forward and backward, then three AdamW steps (torch.optim.AdamW, clip_grad_norm_) on that
batch, and writes tests/reference/fixtures/<case>.bin. The tests read the fixtures only; they do
not need PyTorch. Regenerate with

    /usr/bin/python3 tests/reference/make_fixtures.py            (Debian's python3-torch)

The model is written from lockstep's documented mathematics (README, docs/moe.md, the headers of
src/lockstep/kernels/cpu/ and src/lockstep/model/), using PyTorch's own building blocks wherever
one exists (F.layer_norm, F.gelu(approximate="tanh"), F.silu, F.softmax, F.cross_entropy,
torch.optim.AdamW), so that the fixture says what the standard model computes.

File format (little-endian), version 1:
    8 bytes magic b"LSREF\\0\\0\\0", u32 version, u32 record count, then records:
    u32 name length, name (UTF-8), u32 dtype (0 text, 1 f32, 2 i32, 3 f64), u32 ndim,
    ndim x i64 dims, the data (text: dims = [bytes]).
Records: config (key=value lines for lockstep's load_config), tokens, targets (B, T) i32,
logits (N, V) f32, token_losses (N) f32, loss / lm_loss / aux_loss f64, with multi-token
prediction mtp_loss f64, param/<name> and grad/<name> for every parameter (lockstep's names),
step_loss (3) f64 (loss before each optimizer step), step_grad_norm (3) f64, final/<name>
(parameters after the 3 steps), and for routers with an expert bias final_expert_bias/<layer> (E) f32.
"""
import argparse
import math
import os
import struct

import torch
import torch.nn.functional as F

MAGIC = b"LSREF\0\0\0"
VERSION = 1
STEPS = 3
# Routing is discontinuous: a near tie between the K-th and (K+1)-th expert (or group) could go
# either way in lockstep's float32. Cases whose margins fall below this are rejected.
MIN_ROUTING_MARGIN = 1e-4


class Cfg:
    def __init__(self, **kw):
        self.preset = "gpt2"
        self.L, self.C, self.NH, self.NKV, self.F, self.T, self.V, self.B = 2, 32, 4, 4, 64, 16, 64, 2
        self.norm, self.pos, self.act = "layernorm", "learned", "gelu"
        self.bias, self.tie = True, True
        self.eps, self.theta = 1e-5, 10000.0
        self.E, self.K = 0, 2
        self.score, self.pre_softmax, self.groups, self.group_topk, self.scaling = "softmax", False, 0, 0, 1.0
        self.lb_types, self.aux_coeff, self.z_coeff = "aux_loss", 0.0, 0.0
        self.expert_bias, self.bias_rate = False, 1e-3
        self.expert_F, self.shared_F, self.shared_gate, self.layer_freq = 0, 0, False, None
        self.mtp, self.mtp_scale = 0, 0.1  # multi-token prediction depths, loss scaling factor
        # AdamW's eps is 1e-4, not the usual 1e-8, for two reasons. It makes eps matter for the
        # smaller gradients, so that where eps sits in the update is tested. And some gradients are
        # zero in exact arithmetic (the key bias: softmax ignores a constant added to a row of
        # scores), so both sides hold rounding noise there (1e-17 here, 1e-9 in float32), which
        # AdamW with a tiny eps turns into full +-lr steps of arbitrary sign.
        self.lr, self.beta1, self.beta2, self.adam_eps, self.wd, self.clip = 1e-2, 0.9, 0.95, 1e-4, 0.1, 1.0
        for k, v in kw.items():
            assert hasattr(self, k), k
            setattr(self, k, v)

    def is_moe(self, l):
        return self.E > 0 and (self.layer_freq is None or self.layer_freq[l] == 1)

    def overrides(self):
        """key=value lines that lockstep's load_config takes as overrides."""
        b = lambda v: "true" if v else "false"
        lines = [
            f"model.preset={self.preset}", f"model.num_layers={self.L}", f"model.hidden_size={self.C}",
            f"model.num_heads={self.NH}", f"model.num_query_groups={self.NKV}", f"model.ffn_hidden_size={self.F}",
            f"model.seq_length={self.T}", f"model.vocab_size={self.V}", f"model.normalization={self.norm}",
            f"model.position_embedding={self.pos}", f"model.activation={self.act}", f"model.bias={b(self.bias)}",
            f"model.tie_embeddings={b(self.tie)}", f"model.norm_eps={self.eps!r}", f"model.rope_theta={self.theta!r}",
            f"train.micro_batch={self.B}", f"train.global_batch={self.B}", f"train.steps={STEPS}",
            f"train.lr={self.lr!r}", f"train.min_lr={self.lr!r}", "train.lr_schedule=constant", "train.warmup_steps=0",
            f"optimizer.beta1={self.beta1!r}", f"optimizer.beta2={self.beta2!r}", f"optimizer.eps={self.adam_eps!r}",
            f"optimizer.weight_decay={self.wd!r}", f"optimizer.clip_grad={self.clip!r}",
            # The batch comes from the fixture; an indexed source is what lifts the byte-vocabulary
            # (256) check for these tiny vocabularies.
            "data.source=indexed:fixture",
        ]
        if self.E:
            lines += [
                f"moe.num_experts={self.E}", f"moe.router_topk={self.K}", f"moe.router_score_function={self.score}",
                f"moe.router_pre_softmax={b(self.pre_softmax)}", f"moe.router_num_groups={self.groups}",
                f"moe.router_group_topk={self.group_topk}", f"moe.router_topk_scaling_factor={self.scaling!r}",
                f"moe.router_load_balancing_type={self.lb_types}", f"moe.aux_loss_coeff={self.aux_coeff!r}",
                f"moe.z_loss_coeff={self.z_coeff!r}", f"moe.router_enable_expert_bias={b(self.expert_bias)}",
                f"moe.router_bias_update_rate={self.bias_rate!r}", f"moe.ffn_hidden_size={self.expert_F}",
                f"moe.shared_expert_intermediate_size={self.shared_F}", f"moe.shared_expert_gate={b(self.shared_gate)}",
            ]
            if self.layer_freq is not None:
                lines.append("moe.layer_freq=[" + ",".join(str(v) for v in self.layer_freq) + "]")
        if self.mtp:
            lines += [f"model.mtp_num_layers={self.mtp}", f"model.mtp_loss_scaling_factor={self.mtp_scale!r}"]
        return "\n".join(lines) + "\n"


def make_params(cfg, gen):
    """Every parameter under lockstep's name, drawn from gen. Norm weights near 1 and nonzero
    biases, so that every path carries a gradient well above float noise."""
    C, HS = cfg.C, cfg.C // cfg.NH
    p = {}

    def w(name, *shape, std=0.2):
        p[name] = torch.randn(*shape, generator=gen, dtype=torch.float64) * std

    def norm(name):
        p[name + ".weight"] = 1.0 + 0.1 * torch.randn(C, generator=gen, dtype=torch.float64)
        if cfg.norm == "layernorm":
            w(name + ".bias", C, std=0.1)

    def linear(name, out, inp):
        w(name + ".weight", out, inp)
        if cfg.bias:
            w(name + ".bias", out, std=0.1)

    fcw = lambda f: 2 * f if cfg.act == "swiglu" else f
    w("embedding.word.weight", cfg.V, C, std=0.5)
    if cfg.pos == "learned":
        w("embedding.position.weight", cfg.T, C, std=0.5)
    for l in range(cfg.L):
        pre = f"layers.{l}."
        norm(pre + "attn_norm")
        linear(pre + "attn.qkv", (cfg.NH + 2 * cfg.NKV) * HS, C)
        linear(pre + "attn.proj", C, cfg.NH * HS)
        norm(pre + "mlp_norm")
        if cfg.is_moe(l):
            Fe = cfg.expert_F or cfg.F
            w(pre + "moe.router.weight", cfg.E, C, std=0.5)
            w(pre + "moe.experts.fc.weight", cfg.E, fcw(Fe), C)
            if cfg.bias:
                w(pre + "moe.experts.fc.bias", cfg.E, fcw(Fe), std=0.1)
            w(pre + "moe.experts.proj.weight", cfg.E, C, Fe)
            if cfg.bias:
                w(pre + "moe.experts.proj.bias", cfg.E, C, std=0.1)
            if cfg.shared_F:
                linear(pre + "moe.shared.fc", fcw(cfg.shared_F), C)
                linear(pre + "moe.shared.proj", C, cfg.shared_F)
                if cfg.shared_gate:
                    w(pre + "moe.shared.gate.weight", 1, C)
        else:
            linear(pre + "mlp.fc", fcw(cfg.F), C)
            linear(pre + "mlp.proj", C, cfg.F)
    norm("final_norm")
    if not cfg.tie:
        w("output.weight", cfg.V, C, std=0.5)
    # Multi-token prediction depths: norms, the [e | h] projection (no bias), one dense layer and
    # a final norm each; the embedding and the output head are the main model's.
    for d in range(cfg.mtp):
        pre = f"mtp.layers.{d}."
        norm(pre + "enorm")
        norm(pre + "hnorm")
        w(pre + "eh_proj.weight", C, 2 * C)
        norm(pre + "attn_norm")
        linear(pre + "attn.qkv", (cfg.NH + 2 * cfg.NKV) * HS, C)
        linear(pre + "attn.proj", C, cfg.NH * HS)
        norm(pre + "mlp_norm")
        linear(pre + "mlp.fc", fcw(cfg.F), C)
        linear(pre + "mlp.proj", C, cfg.F)
        norm(pre + "final_norm")
    return p


def norm_fwd(cfg, p, name, x):
    if cfg.norm == "layernorm":
        return F.layer_norm(x, (cfg.C,), p[name + ".weight"], p[name + ".bias"], cfg.eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps) * p[name + ".weight"]


def activation(cfg, h):
    if cfg.act == "swiglu":  # fc output is [gate | up]
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


def linear_fwd(cfg, p, name, x):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if cfg.bias else y


def rope(cfg, x):
    """Rotate-half layout: element i < HS/2 pairs with i + HS/2, angle pos * theta^(-2i/HS)."""
    T, HS = x.shape[1], x.shape[-1]
    inv = cfg.theta ** (-torch.arange(0, HS // 2, dtype=torch.float64) * 2.0 / HS)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang)[None, :, None, :], torch.sin(ang)[None, :, None, :]
    x1, x2 = x[..., : HS // 2], x[..., HS // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(cfg, p, pre, h):
    B, T, C = h.shape
    NH, NKV, HS = cfg.NH, cfg.NKV, C // cfg.NH
    qkv = linear_fwd(cfg, p, pre + "attn.qkv", h)
    q = qkv[..., : NH * HS].reshape(B, T, NH, HS)
    k = qkv[..., NH * HS : (NH + NKV) * HS].reshape(B, T, NKV, HS)
    v = qkv[..., (NH + NKV) * HS :].reshape(B, T, NKV, HS)
    if cfg.pos == "rope":
        q, k = rope(cfg, q), rope(cfg, k)
    # Query head h reads key/value head h / (NH / NKV).
    k = k.repeat_interleave(NH // NKV, dim=2)
    v = v.repeat_interleave(NH // NKV, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, NH, T, HS)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    s = s.masked_fill(~mask, float("-inf"))
    o = F.softmax(s, dim=-1) @ v
    return linear_fwd(cfg, p, pre + "attn.proj", o.transpose(1, 2).reshape(B, T, NH * HS))


def topk_margin(v, k):
    """Gap between the k-th and (k+1)-th largest of each row (inf when nothing is left out)."""
    if k >= v.shape[-1]:
        return float("inf")
    s = v.sort(dim=-1, descending=True).values
    return (s[..., k - 1] - s[..., k]).min().item()


def select(cfg, v, margins):
    """Top-K indices of v (N, E), group-limited when cfg.groups > 0."""
    N, E = v.shape
    if cfg.groups <= 0:
        margins.append(topk_margin(v, cfg.K))
        return v.topk(cfg.K, dim=-1).indices
    per, take = E // cfg.groups, cfg.K // cfg.group_topk
    grouped = v.view(N, cfg.groups, per)
    margins.append(topk_margin(grouped, take))
    gscore = grouped.topk(take, dim=-1).values.sum(-1)
    margins.append(topk_margin(gscore, cfg.group_topk))
    keep = gscore.topk(cfg.group_topk, dim=-1).indices
    allowed = torch.zeros(N, cfg.groups, dtype=torch.bool).scatter_(1, keep, True)
    allowed = allowed[:, :, None].expand(N, cfg.groups, per).reshape(N, E)
    masked = v.masked_fill(~allowed, float("-inf"))
    margins.append(topk_margin(masked, cfg.K))
    return masked.topk(cfg.K, dim=-1).indices


def aux_scores(cfg, z):
    if cfg.score == "softmax":
        return F.softmax(z, dim=-1)
    s = torch.sigmoid(z)
    return s / (s.sum(-1, keepdim=True) + 1e-20)


def switch_loss(cfg, a, n):
    """coeff * E / (K n^2) * sum_e T_e P_e over the n tokens of a (n, E); T_e counts the plain top-K."""
    counts = torch.zeros(cfg.E, dtype=torch.float64).scatter_add_(
        0, a.detach().topk(cfg.K, dim=-1).indices.reshape(-1), torch.ones(n * cfg.K, dtype=torch.float64))
    return cfg.aux_coeff * cfg.E / (cfg.K * n * n) * (counts * a.sum(0)).sum()


def moe(cfg, p, pre, h, expert_bias, margins):
    B, T, C = h.shape
    N = B * T
    x = h.reshape(N, C)
    z = x @ p[pre + "moe.router.weight"].T  # (N, E)
    if cfg.score == "softmax" and not cfg.pre_softmax:
        idx = select(cfg, z, margins)
        probs = F.softmax(z.gather(1, idx), dim=-1)
    elif cfg.score == "softmax":
        s = F.softmax(z, dim=-1)
        idx = select(cfg, s, margins)
        probs = s.gather(1, idx)
    else:
        s = torch.sigmoid(z)
        # The expert bias shifts the selection only; the weights are the unbiased scores.
        sel = s.detach() + expert_bias if expert_bias is not None else s.detach()
        idx = select(cfg, sel, margins)
        probs = s.gather(1, idx)
        if cfg.K > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    probs = probs * cfg.scaling

    # Every expert on every token, then the chosen ones gathered: the unchosen get no gradient.
    Fe = cfg.expert_F or cfg.F
    hfc = torch.einsum("nc,efc->enf", x, p[pre + "moe.experts.fc.weight"])
    if cfg.bias:
        hfc = hfc + p[pre + "moe.experts.fc.bias"][:, None, :]
    y = torch.einsum("enf,ecf->enc", activation(cfg, hfc), p[pre + "moe.experts.proj.weight"])
    if cfg.bias:
        y = y + p[pre + "moe.experts.proj.bias"][:, None, :]
    chosen = y[idx, torch.arange(N)[:, None]]  # (N, K, C)
    out = (probs[:, :, None] * chosen).sum(1)
    if cfg.shared_F:
        sh = linear_fwd(cfg, p, pre + "moe.shared.proj", activation(cfg, linear_fwd(cfg, p, pre + "moe.shared.fc", x)))
        if cfg.shared_gate:
            sh = sh * torch.sigmoid(x @ p[pre + "moe.shared.gate.weight"].T)
        out = out + sh

    aux = torch.zeros((), dtype=torch.float64)
    types = cfg.lb_types.split(",")
    if cfg.aux_coeff > 0:
        a = aux_scores(cfg, z)
        if "aux_loss" in types:
            aux = aux + switch_loss(cfg, a, N)
        if "seq_aux_loss" in types:
            aux = aux + sum(switch_loss(cfg, a[b * T : (b + 1) * T], T) for b in range(B)) / B
    if cfg.z_coeff > 0:
        aux = aux + cfg.z_coeff * torch.logsumexp(z, dim=-1).pow(2).mean()
    counts = torch.bincount(idx.reshape(-1), minlength=cfg.E)
    return out.reshape(B, T, C), aux, counts


def mtp_loss(cfg, p, tokens, targets, h, head):
    """DeepSeek-V3 multi-token prediction on the main model's normed output h (B, T, C). Depth k
    embeds t_{i+k} (the tokens rolled left by k within each sequence, at position i), projects
    [enorm(e) | hnorm(h_{k-1})], runs one dense pre-norm layer and a final norm, and predicts
    targets[i + k] with the shared head; positions i + k >= T have no target. Returns
    (mtp_loss_scaling_factor / D) * sum_k (mean loss of depth k over its valid positions)."""
    B, T = tokens.shape
    total = torch.zeros((), dtype=torch.float64)
    prev = h
    for k in range(1, cfg.mtp + 1):
        pre = f"mtp.layers.{k - 1}."
        emb = p["embedding.word.weight"][tokens.roll(-k, dims=1)]
        if cfg.pos == "learned":
            emb = emb + p["embedding.position.weight"][:T][None]
        eh = torch.cat([norm_fwd(cfg, p, pre + "enorm", emb), norm_fwd(cfg, p, pre + "hnorm", prev)], dim=-1)
        x = eh @ p[pre + "eh_proj.weight"].T
        x = x + attention(cfg, p, pre, norm_fwd(cfg, p, pre + "attn_norm", x))
        hm = norm_fwd(cfg, p, pre + "mlp_norm", x)
        x = x + linear_fwd(cfg, p, pre + "mlp.proj", activation(cfg, linear_fwd(cfg, p, pre + "mlp.fc", hm)))
        prev = norm_fwd(cfg, p, pre + "final_norm", x)
        shifted = torch.full_like(targets, -100)
        shifted[:, : T - k] = targets[:, k:]
        total = total + F.cross_entropy((prev @ head.T).reshape(B * T, cfg.V), shifted.reshape(-1), ignore_index=-100)
    return cfg.mtp_scale / cfg.mtp * total


def forward(cfg, p, tokens, targets, expert_bias):
    B, T = tokens.shape
    x = p["embedding.word.weight"][tokens]
    if cfg.pos == "learned":
        x = x + p["embedding.position.weight"][:T][None]
    aux = torch.zeros((), dtype=torch.float64)
    counts, margins = {}, []
    for l in range(cfg.L):
        pre = f"layers.{l}."
        x = x + attention(cfg, p, pre, norm_fwd(cfg, p, pre + "attn_norm", x))
        h = norm_fwd(cfg, p, pre + "mlp_norm", x)
        if cfg.is_moe(l):
            y, a, counts[l] = moe(cfg, p, pre, h, expert_bias.get(l), margins)
            x = x + y
            aux = aux + a
        else:
            x = x + linear_fwd(cfg, p, pre + "mlp.proj", activation(cfg, linear_fwd(cfg, p, pre + "mlp.fc", h)))
    x = norm_fwd(cfg, p, "final_norm", x)
    head = p["embedding.word.weight"] if cfg.tie else p["output.weight"]
    logits = (x @ head.T).reshape(B * T, cfg.V)
    token_losses = F.cross_entropy(logits, targets.reshape(-1), reduction="none")
    lm = token_losses.mean()
    mtp = mtp_loss(cfg, p, tokens, targets, x.reshape(B, T, cfg.C), head) if cfg.mtp else None
    loss = lm + aux if mtp is None else lm + aux + mtp
    return loss, lm, aux, mtp, logits, token_losses, counts, margins


def run_case(name, cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    params = make_params(cfg, gen)
    tokens = torch.randint(0, cfg.V, (cfg.B, cfg.T), generator=gen)
    targets = torch.randint(0, cfg.V, (cfg.B, cfg.T), generator=gen)
    for t in params.values():
        t.requires_grad_(True)
    init = {k: v.detach().clone() for k, v in params.items()}
    expert_bias = {l: torch.zeros(cfg.E, dtype=torch.float64) for l in range(cfg.L) if cfg.is_moe(l) and cfg.expert_bias}

    # Weight decay on weight matrices (expert weights too), never on biases or norm weights.
    decay = [t for n, t in params.items() if n.endswith(".weight") and "norm" not in n]
    no_decay = [t for n, t in params.items() if not (n.endswith(".weight") and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)

    records = [("config", cfg.overrides()), ("tokens", tokens.int()), ("targets", targets.int())]
    step_loss, step_norm, all_margins = [], [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=False)
        loss, lm, aux, mtp, logits, token_losses, counts, margins = forward(cfg, params, tokens, targets, expert_bias)
        loss.backward()
        all_margins += margins
        if step == 1:
            records += [("logits", logits.detach()), ("token_losses", token_losses.detach()),
                        ("loss", torch.tensor([loss.item()], dtype=torch.float64), "f64"),
                        ("lm_loss", torch.tensor([lm.item()], dtype=torch.float64), "f64"),
                        ("aux_loss", torch.tensor([aux.item()], dtype=torch.float64), "f64")]
            if mtp is not None:
                records.append(("mtp_loss", torch.tensor([mtp.item()], dtype=torch.float64), "f64"))
            records += [("param/" + n, init[n]) for n in params]
            records += [("grad/" + n, t.grad.detach().clone()) for n, t in params.items()]
        step_loss.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.clip) if cfg.clip > 0 else torch.tensor(0.0)
        step_norm.append(float(norm))
        opt.step()
        # Aux-loss-free balancing: after the optimizer, b_e += rate * sign(mean load - load_e).
        for l, b in expert_bias.items():
            load = counts[l].double()
            b += cfg.bias_rate * torch.sign(load.mean() - load)
    records += [("step_loss", torch.tensor(step_loss, dtype=torch.float64), "f64"),
                ("step_grad_norm", torch.tensor(step_norm, dtype=torch.float64), "f64")]
    records += [("final/" + n, t.detach()) for n, t in params.items()]
    records += [(f"final_expert_bias/{l}", b) for l, b in expert_bias.items()]
    margin = min(all_margins) if all_margins else float("inf")
    if margin < MIN_ROUTING_MARGIN:
        raise SystemExit(f"{name}: routing margin {margin:.3g} < {MIN_ROUTING_MARGIN}: pick another seed")
    return records, step_loss, step_norm, margin


def write_fixture(path, records):
    out = bytearray(MAGIC + struct.pack("<II", VERSION, len(records)))
    for rec in records:
        name, value = rec[0], rec[1]
        kind = rec[2] if len(rec) > 2 else None
        out += struct.pack("<I", len(name.encode())) + name.encode()
        if isinstance(value, str):
            data, dtype, dims = value.encode(), 0, [len(value.encode())]
        elif value.dtype in (torch.int32, torch.int64):
            data, dtype, dims = value.to(torch.int32).contiguous().numpy().tobytes(), 2, list(value.shape)
        elif kind == "f64":
            data, dtype, dims = value.double().contiguous().numpy().tobytes(), 3, list(value.shape)
        else:
            data, dtype, dims = value.float().contiguous().numpy().tobytes(), 1, list(value.shape)
        out += struct.pack("<II", dtype, len(dims)) + struct.pack(f"<{len(dims)}q", *dims) + data
    with open(path, "wb") as f:
        f.write(out)
    return len(out)


def cases():
    # GPT-2 flavour: learned positions, LayerNorm, tanh-GELU, biases, tied head.
    yield "gpt2", Cfg(), 1
    # Llama flavour: RoPE (rotate-half), RMSNorm, SwiGLU with fc = [gate | up], GQA, no biases, untied head.
    yield "llama", Cfg(preset="llama", NKV=2, F=48, norm="rmsnorm", pos="rope", act="swiglu", bias=False,
                       tie=False, eps=1e-6), 2
    # MoE, Mixtral-style routing on the GPT-2 flavour (expert biases): softmax over the top-2
    # logits, switch aux loss and z-loss.
    yield "moe_softmax", Cfg(C=16, F=32, E=4, K=2, aux_coeff=0.1, z_coeff=0.01), 3
    # MoE, DeepSeek-V3-style on the Llama flavour: sigmoid scores, group-limited routing, expert
    # bias for selection only (a large update rate so that steps 2 and 3 route with a nonzero
    # bias), sequence aux loss, a gated shared expert, a dense first layer.
    yield "moe_sigmoid", Cfg(preset="llama", C=16, NKV=2, F=32, norm="rmsnorm", pos="rope", act="swiglu", bias=False,
                             tie=False, E=8, K=2, score="sigmoid", groups=4, group_topk=2, scaling=2.5,
                             lb_types="seq_aux_loss", aux_coeff=0.1, expert_bias=True, bias_rate=0.05,
                             expert_F=16, shared_F=16, shared_gate=True, layer_freq=[0, 1]), 4
    # Multi-token prediction (one depth) on the GPT-2 flavour, one main layer: the tied embedding
    # serves the main input, the MTP input and both heads; the learned positions enter twice.
    yield "mtp", Cfg(L=1, mtp=1, mtp_scale=0.3), 5


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
    ap.add_argument("--only", default="", help="comma list of cases")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    total = 0
    for name, cfg, seed in cases():
        if args.only and name not in args.only.split(","):
            continue
        records, losses, norms, margin = run_case(name, cfg, seed)
        size = write_fixture(os.path.join(args.out, name + ".bin"), records)
        total += size
        print(f"{name}: {size} bytes, step losses {', '.join(f'{v:.6f}' for v in losses)}, "
              f"grad norms {', '.join(f'{v:.4f}' for v in norms)}, routing margin {margin:.3g}")
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
