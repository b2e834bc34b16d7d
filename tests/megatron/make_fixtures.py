#!/usr/bin/env python3
"""Writes the Megatron Core fixtures that tests/test_megatron_oracle.cpp checks lockstep's router against.

Megatron Core's MoE utilities (megatron.core.transformer.moe.moe_utils) run on the CPU: here they
compute, from random logits, what lockstep's router ops must reproduce:

  route/<case>     topk_routing_with_score_function: the routing probabilities and map (softmax or
                   sigmoid, pre-softmax, group-limited top-k, scaling, expert bias) and, by autograd,
                   the logits' gradient of sum(probs * upstream);
  aux/<case>       switch_load_balancing_loss_func on compute_routing_scores_for_aux_loss's scores
                   (the aux loss; the sequence aux loss composed as TopKRouter._apply_seq_aux_loss
                   does on one rank), z_loss_func, and their logits' gradients;
  capacity/<case>  apply_router_token_dropping (probs and position policies);
  global_aux/<case> the global aux loss as TopKRouter._apply_global_aux_loss computes it over a
                   step's micro-batches on one rank (the running mean of the tokens per expert),
                   each micro-batch's loss and logits' gradient;
  bias/<case>      get_updated_expert_bias (the aux-loss-free expert bias update);
  permute/<case>   permute and unpermute (the dispatch to expert rows and the weighted combine),
                   also after apply_router_token_dropping with pad_to_capacity (drop_and_pad).

Every tensor is float32, as Megatron's router computes. Draws whose top-k margins (expert or
group) fall below 1e-4 are redrawn: a near tie could go either way. One file,
tests/megatron/fixtures/moe.safetensors; each case's parameters are JSON in its metadata.

    bench/setup_peers.sh                                 (installs megatron-core 0.16.1)
    bench/.venv/bin/python tests/megatron/make_fixtures.py
"""
import json
import os
import warnings

import torch

warnings.filterwarnings("ignore")
from megatron.core.transformer.moe import moe_utils as mu  # noqa: E402
import megatron.core  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_MARGIN = 1e-4

ROUTE = {
    "softmax_top2": dict(E=8, K=2),
    "softmax_pre_top2_scaled": dict(E=8, K=2, pre_softmax=True, scaling=2.0),
    "sigmoid_top3": dict(E=8, K=3, score="sigmoid"),
    "sigmoid_groups_scaled": dict(E=16, K=4, score="sigmoid", groups=4, group_topk=2, scaling=2.5),
    "sigmoid_groups_expert_bias": dict(E=16, K=4, score="sigmoid", groups=4, group_topk=2, scaling=2.5, bias=True),
    "softmax_groups": dict(E=16, K=4, groups=4, group_topk=2),
}
AUX = {
    "aux_softmax": dict(E=8, K=2, B=2, T=32, aux=0.01),
    "aux_sigmoid": dict(E=8, K=3, B=2, T=32, aux=0.01, score="sigmoid"),
    "seq_aux_softmax": dict(E=8, K=2, B=2, T=32, seq_aux=0.01),
    "z_loss": dict(E=8, K=2, B=2, T=32, z=0.001),
}
CAPACITY = {
    "capacity_probs": dict(E=8, K=2, N=64, factor=0.5, policy="probs"),
    "capacity_position": dict(E=8, K=2, N=64, factor=0.75, policy="position"),
}
GLOBAL_AUX = {
    "global_aux_softmax": dict(E=8, K=2, B=2, T=32, global_aux=0.01, micros=3),
    "global_aux_sigmoid": dict(E=8, K=3, B=2, T=32, global_aux=0.01, micros=2, score="sigmoid"),
}
BIAS = {"expert_bias_update": dict(E=16, rate=1e-3)}
PERMUTE = {
    "permute_top2": dict(E=8, K=2, N=64, C=16),
    "permute_pad_to_capacity": dict(E=8, K=2, N=64, C=16, factor=0.5, policy="probs", pad=True),
}


def margin(scores, k):
    top = scores.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]).min().item()


def draw(gen, n, e, ok):
    for _ in range(100):
        logits = torch.randn(n, e, generator=gen) * 2.0
        if ok(logits):
            return logits
    raise SystemExit("no draw with enough margin")


def route_case(name, c, gen, out, meta):
    E, K, N = c["E"], c["K"], 64
    score = c.get("score", "softmax")
    groups, gk = c.get("groups"), c.get("group_topk")
    bias = torch.randn(E, generator=gen) * 0.1 if c.get("bias") else None

    def ok(logits):
        s = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
        s = s + bias if bias is not None else s
        if margin(s, K) < MIN_MARGIN:
            return False
        if groups:
            per = s.view(N, groups, E // groups).topk(K // gk, dim=-1).values.sum(-1)
            return margin(per, gk) >= MIN_MARGIN
        return True

    logits = draw(gen, N, E, ok).requires_grad_(True)
    probs, routing_map = mu.topk_routing_with_score_function(
        logits, K, use_pre_softmax=c.get("pre_softmax", False), num_groups=groups, group_topk=gk,
        scaling_factor=c.get("scaling"), score_function=score, expert_bias=bias)
    upstream = torch.randn(N, E, generator=gen)
    (probs * upstream).sum().backward()
    out.update({f"route/{name}/logits": logits.detach(), f"route/{name}/probs": probs.detach(),
                f"route/{name}/map": routing_map.float(), f"route/{name}/upstream": upstream,
                f"route/{name}/dlogits": logits.grad})
    if bias is not None:
        out[f"route/{name}/expert_bias"] = bias
    meta[f"route/{name}"] = json.dumps(c)


def aux_case(name, c, gen, out, meta):
    E, K, B, T = c["E"], c["K"], c["B"], c["T"]
    score = c.get("score", "softmax")
    N = B * T

    def ok(logits):
        s = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
        return margin(s, K) >= MIN_MARGIN

    logits = draw(gen, N, E, ok).requires_grad_(True)  # lockstep's order: sequence b's T tokens, then b + 1's
    loss = torch.zeros(())
    if "aux" in c:
        routing_map, scores = mu.compute_routing_scores_for_aux_loss(logits, K, score)
        loss = loss + mu.switch_load_balancing_loss_func(scores, routing_map.sum(0), N, K, E, c["aux"])
    if "seq_aux" in c:
        # Megatron's tokens are sequence-major ([s, b]); its seq aux loss reshapes them to (s, b x E).
        sb = logits.view(B, T, E).transpose(0, 1).reshape(N, E)
        routing_map, scores = mu.compute_routing_scores_for_aux_loss(sb, K, score)
        scores, routing_map = scores.reshape(T, B * E), routing_map.reshape(T, B * E)
        loss = loss + mu.switch_load_balancing_loss_func(scores, routing_map.sum(0), T, K, E, c["seq_aux"]) / B
    if "z" in c:
        loss = loss + mu.z_loss_func(logits, c["z"])
    loss.backward()
    out.update({f"aux/{name}/logits": logits.detach(), f"aux/{name}/loss": loss.detach().reshape(1),
                f"aux/{name}/dlogits": logits.grad})
    meta[f"aux/{name}"] = json.dumps(c)


def capacity_case(name, c, gen, out, meta):
    E, K, N = c["E"], c["K"], c["N"]
    logits = draw(gen, N, E, lambda l: margin(torch.softmax(l, -1), K) >= MIN_MARGIN)
    probs, routing_map = mu.topk_routing_with_score_function(logits, K)

    def distinct(p):  # the probs policy ranks each expert's tokens by weight: no ties
        chosen = p[routing_map]
        return chosen.unique().numel() == chosen.numel()

    assert distinct(probs)
    kept_probs, kept_map = mu.apply_router_token_dropping(probs, routing_map, K, c["factor"], c["policy"])
    out.update({f"capacity/{name}/logits": logits, f"capacity/{name}/map": routing_map.float(),
                f"capacity/{name}/kept_map": kept_map.float(), f"capacity/{name}/kept_probs": kept_probs})
    meta[f"capacity/{name}"] = json.dumps(c)


def global_aux_case(name, c, gen, out, meta):
    E, K, B, T = c["E"], c["K"], c["B"], c["T"]
    score = c.get("score", "softmax")
    N = B * T
    running = torch.zeros(E)
    for m in range(c["micros"]):
        logits = draw(gen, N, E, lambda l: margin(torch.softmax(l, -1) if score == "softmax" else torch.sigmoid(l),
                                                  K) >= MIN_MARGIN).requires_grad_(True)
        routing_map, scores = mu.compute_routing_scores_for_aux_loss(logits, K, score)
        running = running + routing_map.sum(0)  # TopKRouter.global_tokens_per_expert, one rank
        loss = mu.switch_load_balancing_loss_func(scores, running / (m + 1), N, K, E, c["global_aux"])
        loss.backward()
        at = f"global_aux/{name}/{m}/"
        out.update({at + "logits": logits.detach(), at + "loss": loss.detach().reshape(1), at + "dlogits": logits.grad})
    meta[f"global_aux/{name}"] = json.dumps(c)


def bias_case(name, c, gen, out, meta):
    E = c["E"]
    for _ in range(100):  # one expert exactly at the mean load (no update), the rest off it
        counts = torch.randint(0, 50, (E,), generator=gen).float()
        counts[0] = 25
        counts[-1] = 25 * E - counts[:-1].sum()
        if counts[-1] >= 0 and counts[-1] != 25:
            break
    bias = torch.randn(E, generator=gen) * 0.1
    # One rank: the all-reduce over the tensor x data x context group is the identity.
    reduce, group = torch.distributed.all_reduce, mu.parallel_state.get_tensor_and_data_parallel_group
    torch.distributed.all_reduce = lambda *a, **k: None
    mu.parallel_state.get_tensor_and_data_parallel_group = lambda *a, **k: None
    try:
        updated = mu.get_updated_expert_bias(counts.clone(), bias, c["rate"])
    finally:
        torch.distributed.all_reduce, mu.parallel_state.get_tensor_and_data_parallel_group = reduce, group
    out.update({f"bias/{name}/counts": counts, f"bias/{name}/bias": bias, f"bias/{name}/updated": updated})
    meta[f"bias/{name}"] = json.dumps(c)


def permute_case(name, c, gen, out, meta):
    E, K, N, C = c["E"], c["K"], c["N"], c["C"]
    logits = draw(gen, N, E, lambda l: margin(torch.softmax(l, -1), K) >= MIN_MARGIN)
    probs, routing_map = mu.topk_routing_with_score_function(logits, K)
    tokens = torch.randn(N, C, generator=gen)
    at = f"permute/{name}/"
    if c.get("pad"):
        probs, routing_map = mu.apply_router_token_dropping(probs, routing_map, K, c["factor"], c["policy"],
                                                            pad_to_capacity=True)
        rows = int(routing_map.sum(0)[0]) * E
        permuted, _, order = mu.permute(tokens, routing_map, num_out_tokens=rows, drop_and_pad=True)
    else:
        permuted, _, order = mu.permute(tokens, routing_map)
    expert_out = torch.randn(permuted.shape, generator=gen)
    combined = mu.unpermute(expert_out, order, tokens.shape, probs=probs, routing_map=routing_map,
                            drop_and_pad=bool(c.get("pad")))
    out.update({at + "logits": logits, at + "tokens": tokens, at + "permuted": permuted,
                at + "sorted_indices": order.float(), at + "expert_out": expert_out,
                at + "combined": combined, at + "probs": probs})
    meta[f"permute/{name}"] = json.dumps(c)


def main():
    gen = torch.Generator().manual_seed(2026)
    out, meta = {}, {"megatron_core": megatron.core.__version__, "torch": torch.__version__}
    for cases, make in ((ROUTE, route_case), (AUX, aux_case), (CAPACITY, capacity_case),
                        (GLOBAL_AUX, global_aux_case), (BIAS, bias_case), (PERMUTE, permute_case)):
        for name, c in cases.items():
            make(name, c, gen, out, meta)
    os.makedirs(os.path.join(HERE, "fixtures"), exist_ok=True)
    path = os.path.join(HERE, "fixtures", "moe.safetensors")
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata=meta)
    print(f"{path}: {len(out)} tensors, megatron-core {megatron.core.__version__}")


if __name__ == "__main__":
    main()
