#!/usr/bin/env python3
"""Writes the Hugging Face fixtures that tests/test_hf_checkpoint.cpp checks lockstep against.

Each case is a tiny random model built by Hugging Face `transformers` itself (the implementation
people load these checkpoints with), saved with save_pretrained into tests/hf/fixtures/<case>/
(config.json, model.safetensors or shards with model.safetensors.index.json), plus
reference.safetensors: one batch's tokens and targets, and the loss and the gradient of every
checkpoint tensor (under its name in the checkpoint) that transformers computes in float64 for
that batch. The tests read the files only; they need neither Python nor transformers.

    bench/setup_peers.sh                                 (installs transformers 5.25.0)
    bench/.venv/bin/python tests/hf/make_fixtures.py

reference.safetensors: tokens, targets (B, T) I32; loss (1) F64, the mean cross-entropy of the
logits at every position against targets (no shift: targets are the next tokens already);
grad/<checkpoint tensor> F32; deepseek_v3_mtp adds mtp_loss (1) F64 (make_mtp_case). llama_fp8 has no reference batch: its model.safetensors holds
float8_e4m3fn weights with 128x128 block scales (`weight_scale_inv`, DeepSeek-V3's layout) and
reference.safetensors holds dequant/<tensor>, the float32 weights they stand for.

"""
import copy
import json
import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures")
B, T = 2, 16
# Routing is discontinuous: a near tie between the K-th and (K+1)-th expert could go either way in
# lockstep's float32. Draws whose margins fall below this are redrawn.
MIN_ROUTING_MARGIN = 1e-3

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.1)

CASES = {
    # Tied embeddings, Llama 3 RoPE scaling (original_max_position 64 puts the head's four
    # frequencies in all three bands), written as two shards with an index.
    "llama": (LlamaForCausalLM, LlamaConfig, dict(
        COMMON, intermediate_size=48, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64)), "40KB"),
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(
        COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5), None),
    # A shared expert with its sigmoid gate, q/k/v biases, softmax over all experts without
    # renormalising the top k (norm_topk_prob false), and a dense layer (mlp_only_layers).
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(
        COMMON, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], rms_norm_eps=1e-6), None),
    # Per-head RMSNorm of queries and keys (q_norm, k_norm), renormalised top k.
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=8,
        norm_topk_prob=True, rms_norm_eps=1e-6), None),
    # Multi-head latent attention (query rank 12, key/value rank 8, heads of 6 + 4 RoPE for queries
    # and keys, 5 for values, RoPE dimensions interleaved), a dense first layer, then sigmoid
    # group-limited routing (top 4 of 8 experts in 4 groups, 2 kept) with a random
    # e_score_correction_bias, renormalised and scaled by 2.5, one shared expert.
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config, dict(
        COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=12, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5,
        num_nextn_predict_layers=0, rms_norm_eps=1e-6), None),
    # DeepSeek-V3's YaRN (factor 40 there; 4 here, original context 8 < the batch's 16 positions,
    # mscale = mscale_all_dim = 1: the softmax scale grows by m^2, cos and sin stay).
    "deepseek_v3_yarn": (DeepseekV3ForCausalLM, DeepseekV3Config, dict(
        COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=12, kv_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=6,
        v_head_dim=5, num_nextn_predict_layers=0, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)), None),
}


def randomise(model, gen):
    """Every tensor drawn, so that a wrong mapping (a swapped gate and up, a norm weight on the wrong
    layer) changes the loss: matrices N(0, 0.1^2), norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)


def routing_margin(model, tokens, run=None):
    """The smallest gap between the K-th and (K+1)-th router logit of any token in any MoE layer,
    over model(input_ids=tokens) or run()."""
    k = getattr(model.config, "num_experts_per_tok", 0)
    gaps = []

    def hook(module, inputs, output):
        logits = inputs[0].reshape(-1, inputs[0].shape[-1]) @ module.weight.T
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None:  # DeepSeek: groups by their two best biased sigmoid scores, then top k
            scores = logits.sigmoid() + bias
            groups = model.config.n_group
            per = scores.view(scores.shape[0], groups, -1).topk(2, dim=-1).values.sum(-1)
            top = per.topk(model.config.topk_group + 1, dim=-1).values
            gaps.append((top[:, -2] - top[:, -1]).min().item())
            keep = per.topk(model.config.topk_group, dim=-1).indices
            mask = torch.zeros_like(per).scatter(1, keep, 1).repeat_interleave(scores.shape[1] // groups, 1)
            logits = scores.masked_fill(mask == 0, float("-inf"))
        top = logits.topk(k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    if not handles and k and any(n.endswith("mlp.experts") for n, _ in model.named_modules()):
        raise SystemExit("no router found to check the routing margins")
    with torch.no_grad():
        run() if run else model(input_ids=tokens)
    for h in handles:
        h.remove()
    return min(gaps) if gaps else float("inf")


def saved_tensors(model, directory):
    """{name: tensor} as save_pretrained writes them (on-disk names, e.g. per-expert tensors)."""
    model.save_pretrained(directory)
    index = os.path.join(directory, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else [
        "model.safetensors"]
    out = {}
    for f in files:
        with safe_open(os.path.join(directory, f), "pt") as st:
            for name in st.keys():
                out[name] = st.get_tensor(name)
    return out


def saved_grads(model):
    """{checkpoint name: float32 gradient} of a model after backward, under the names save_pretrained
    gives the tensors."""
    grads = copy.deepcopy(model)
    with torch.no_grad():
        for (_, p), (_, g) in zip(model.named_parameters(), grads.named_parameters()):
            g.copy_(p.grad)
    with tempfile.TemporaryDirectory() as tmp:
        return saved_tensors(grads.float(), tmp)


def make_case(name, model_cls, config_cls, kw, shard):
    for seed in range(100):
        gen = torch.Generator().manual_seed(1000 + seed)
        config = config_cls(**kw)
        # The plain PyTorch paths (float64 runs through them; the fused ones are float32 only).
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = model_cls(config).float()
        randomise(model, gen)
        tokens = torch.randint(0, kw["vocab_size"], (B, T), generator=gen, dtype=torch.int64)
        targets = torch.randint(0, kw["vocab_size"], (B, T), generator=gen, dtype=torch.int64)
        model64 = copy.deepcopy(model).double()
        if routing_margin(model64, tokens) >= MIN_ROUTING_MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no draw with routing margins >= {MIN_ROUTING_MARGIN}")

    directory = os.path.join(OUT, name)
    shutil.rmtree(directory, ignore_errors=True)
    if shard:
        model.save_pretrained(directory, max_shard_size=shard)
    else:
        model.save_pretrained(directory)

    logits = model64(input_ids=tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    named_grads = saved_grads(model64)
    reference = {"tokens": tokens.to(torch.int32), "targets": targets.to(torch.int32),
                 "loss": loss.detach().reshape(1)}
    reference.update({"grad/" + n: g.contiguous() for n, g in named_grads.items()})
    save_file(reference, os.path.join(directory, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{name}: seed {seed}, loss {loss.item():.6f}, {len(named_grads)} tensors")


class MtpDepth(torch.nn.Module):
    """The parts of DeepSeek-V3's multi-token prediction layer that are not a decoder layer, under
    their checkpoint names (model.layers.<L>.enorm, .hnorm, .eh_proj, .shared_head.norm)."""

    def __init__(self, config):
        super().__init__()
        C = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(C, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(C, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * C, C, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(C, eps=config.rms_norm_eps)


def mtp_losses(model, depth, tokens, targets):
    """The main model's loss and the depth's (k = 1), as Megatron and lockstep define multi-token
    prediction and vLLM runs DeepSeek-V3's layer: model holds L + 1 decoder layers, the first L the
    main model's, layer L the depth's transformer layer (transformers' own DeepseekV3DecoderLayer,
    MoE as the last decoder layer is). The depth reads the tokens one ahead (rolled within the
    sequence), e = enorm(embed(t_{i+1})), x = eh_proj([e | hnorm(h)]), h_1 = shared_head.norm(layer(x)),
    and predicts targets one ahead through the shared output head (the last position has none)."""
    inner, L = model.model, len(model.model.layers) - 1
    inner.config.num_hidden_layers = L  # the main model's forward stops before the depth's layer
    h = inner(input_ids=tokens).last_hidden_state
    inner.config.num_hidden_layers = L + 1
    V = model.config.vocab_size
    lm = F.cross_entropy(model.lm_head(h).reshape(-1, V), targets.reshape(-1))
    ahead = torch.roll(tokens, -1, dims=1)
    ahead_targets = torch.cat([targets[:, 1:], torch.full_like(targets[:, :1], -100)], dim=1)
    x = depth.eh_proj(torch.cat([depth.enorm(inner.embed_tokens(ahead)), depth.hnorm(h)], dim=-1))
    positions = torch.arange(tokens.shape[1])[None]
    mask = torch.full((tokens.shape[1],) * 2, float("-inf"), dtype=x.dtype).triu(1)[None, None]
    y = inner.layers[L](x, attention_mask=mask, position_ids=positions,
                        position_embeddings=inner.rotary_emb(x, positions))
    ce = F.cross_entropy(model.lm_head(depth.shared_head.norm(y)).reshape(-1, V), ahead_targets.reshape(-1),
                         ignore_index=-100)
    return lm, ce


def make_mtp_case(name, kw, weight=0.1):
    """deepseek_v3 with one multi-token prediction layer (num_nextn_predict_layers = 1), written as
    DeepSeek's release writes it: model.layers.<L>.* after the decoder's L layers, with copies of the
    embedding (embed_tokens) and the output head (shared_head.head). transformers has no MTP: the
    reference is mtp_losses over its modules. reference.safetensors adds mtp_loss (weight x the
    depth's loss, lockstep's mtp_loss with mtp_loss_scaling_factor = weight) and the gradients are
    those of loss + mtp_loss."""
    L = kw["num_hidden_layers"]
    for seed in range(100):
        gen = torch.Generator().manual_seed(2000 + seed)
        config = DeepseekV3Config(**dict(kw, num_hidden_layers=L + 1, num_nextn_predict_layers=0))
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model = DeepseekV3ForCausalLM(config).float()
        depth = MtpDepth(config).float()
        randomise(model, gen)
        randomise(depth, gen)
        tokens = torch.randint(0, kw["vocab_size"], (B, T), generator=gen, dtype=torch.int64)
        targets = torch.randint(0, kw["vocab_size"], (B, T), generator=gen, dtype=torch.int64)
        model64, depth64 = copy.deepcopy(model).double(), copy.deepcopy(depth).double()
        if routing_margin(model64, tokens, lambda: mtp_losses(model64, depth64, tokens, targets)) >= MIN_ROUTING_MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no draw with routing margins >= {MIN_ROUTING_MARGIN}")

    directory = os.path.join(OUT, name)
    shutil.rmtree(directory, ignore_errors=True)
    tensors = saved_tensors(model, directory)
    layer = f"model.layers.{L}."
    head = tensors["lm_head.weight"] if "lm_head.weight" in tensors else tensors["model.embed_tokens.weight"]
    extras = {n: p.detach().clone() for n, p in depth.named_parameters()}
    extras.update({"embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                   "shared_head.head.weight": head.clone()})
    tensors.update({layer + n: t.contiguous() for n, t in extras.items()})
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(directory, f))
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(directory, "config.json")
    saved = json.load(open(config_path))
    saved.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    json.dump(saved, open(config_path, "w"), indent=2)

    lm, ce = mtp_losses(model64, depth64, tokens, targets)
    (lm + weight * ce).backward()
    named_grads = saved_grads(model64)
    named_grads.update({layer + n: p.grad.float().contiguous() for n, p in depth64.named_parameters()})
    reference = {"tokens": tokens.to(torch.int32), "targets": targets.to(torch.int32),
                 "loss": lm.detach().reshape(1), "mtp_loss": (weight * ce).detach().reshape(1)}
    reference.update({"grad/" + n: g.contiguous() for n, g in named_grads.items()})
    save_file(reference, os.path.join(directory, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{name}: seed {seed}, loss {lm.item():.6f}, mtp {ce.item():.6f}, {len(named_grads)} tensors")


def quantise_blocks(w, block=128):
    """DeepSeek-V3's weight FP8: per 128x128 block, scale_inv = amax / 448, codes = e4m3(w / scale_inv)."""
    rows, cols = w.shape
    br, bc = (rows + block - 1) // block, (cols + block - 1) // block
    scale_inv = torch.empty(br, bc, dtype=torch.float32)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale_inv[i, j] = s
            codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
    return codes, scale_inv


def make_fp8_case():
    """A one-layer Llama whose projection weights are stored as DeepSeek-V3 stores them: 136 x 136
    and 68 x 136 matrices cut into 128 x 128 blocks, partial blocks at the edges."""
    kw = dict(vocab_size=64, hidden_size=136, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=136, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**kw)).float()
    randomise(model, gen)
    directory = os.path.join(OUT, "llama_fp8")
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    tensors, reference = {}, {}
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as st:
        for name in st.keys():
            w = st.get_tensor(name)
            if name.endswith("_proj.weight"):
                codes, scale_inv = quantise_blocks(w)
                tensors[name] = codes
                tensors[name + "_scale_inv"] = scale_inv
                expanded = scale_inv.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
                reference["dequant/" + name] = codes.to(torch.float32) * expanded
            else:
                tensors[name] = w
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(directory, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    json.dump(config, open(os.path.join(directory, "config.json"), "w"), indent=2)
    save_file(reference, os.path.join(directory, "reference.safetensors"))
    print(f"llama_fp8: {len(tensors)} tensors")


def main():
    torch.manual_seed(0)
    os.makedirs(OUT, exist_ok=True)
    for name, (model_cls, config_cls, kw, shard) in CASES.items():
        make_case(name, model_cls, config_cls, kw, shard)
    make_fp8_case()
    make_mtp_case("deepseek_v3_mtp", CASES["deepseek_v3"][2])


if __name__ == "__main__":
    main()
