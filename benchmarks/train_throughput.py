"""Training throughput of DepthBench's pre_ln against transformers' LlamaForCausalLM.

Both models get the same shape, dtype, batch, thread count, optimizer (AdamW) and loss
(cross-entropy on the logits); they are timed alternately, several rounds, in one process, and
the median tokens/s of each is reported with their ratio and an MFU estimate against a matmul
peak measured in this same run. Prints a table and writes JSON with --json.

    .venv/bin/python benchmarks/train_throughput.py [--d-model 256 --n-layer 8 --vocab 8192
        --batch 8 --seq 256 --threads 2 --dtype float32 --rounds 5 --steps 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.train.flops import measured_cpu_peak, train_flops_per_token


def hf_llama(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    )
    hf_cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(hf_cfg)


def make_step(model, logits_of, dtype):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ctx = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else nullcontext()

    def step(x, y):
        with ctx:
            logits = logits_of(model, x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layer=args.n_layer,
        n_head=args.n_head,
        max_seq_len=args.seq,
    )
    torch.manual_seed(0)
    ours = build_model(cfg)
    theirs = hf_llama(cfg)
    n_ours = sum(q.numel() for q in ours.parameters())
    n_theirs = sum(q.numel() for q in theirs.parameters())
    assert n_ours == n_theirs, f"parameter counts differ: {n_ours} vs {n_theirs}"
    steps = {
        "depthbench_pre_ln": make_step(ours, lambda m, x: m(x).logits, dtype),
        "hf_llama": make_step(theirs, lambda m, x: m(input_ids=x).logits, dtype),
    }
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    y = torch.randint(0, args.vocab, (args.batch, args.seq))
    for step in steps.values():  # warm-up
        step(x, y)
        step(x, y)
    tokens = args.batch * args.seq * args.steps
    rates: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():  # alternate, so drift hits both equally
            t = time.perf_counter()
            for _ in range(args.steps):
                step(x, y)
            rates[name].append(tokens / (time.perf_counter() - t))
    peak = measured_cpu_peak(dtype)
    flops_tok = train_flops_per_token(ours, args.seq)
    result = {
        "config": vars(args),
        "params": n_ours,
        "matmul_peak_flops": peak,
        "flops_per_token": flops_tok,
    }
    print(
        f"shape d_model={args.d_model} n_layer={args.n_layer} vocab={args.vocab} "
        f"batch={args.batch}x{args.seq} "
        f"dtype={args.dtype} threads={args.threads} params={n_ours:,}"
    )
    print(f"measured matmul peak: {peak / 1e9:.1f} GFLOP/s")
    for name, r in rates.items():
        med = statistics.median(r)
        result[name] = {
            "tokens_per_s_median": med,
            "tokens_per_s_all": r,
            "mfu": med * flops_tok / peak,
        }
        print(
            f"{name:>18}: {med:10.0f} tokens/s  (min {min(r):.0f}, max {max(r):.0f})  "
            f"MFU {100 * med * flops_tok / peak:.1f}%"
        )
    ratio = (
        result["depthbench_pre_ln"]["tokens_per_s_median"]
        / result["hf_llama"]["tokens_per_s_median"]
    )
    result["ratio"] = ratio
    print(f"ratio depthbench / transformers: {ratio:.2f}x (target >= 1.25x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
