#!/usr/bin/env python3
"""A PyTorch twin of a `data.name: tokens` Llama recipe, for convergence comparisons.

Trains transformers' LlamaForCausalLM with the recipe's model, on the same
token shards, reading the same windows in the same order as the trainer
(data/text.h: window i of epoch e starts at Philox(seed, 4 + (e << 8))
block i, 64 bits modulo train tokens - T), with the same optimizer (AdamW,
no weight decay on the RMSNorm weights when decay_norm_and_bias is false,
gradient clipping), the same learning rate at every step (cosine to min_lr
over training.steps after a linear warmup from a third of it) and the same
evaluation windows (val_windows spread evenly over the last val_fraction of
the tokens). Only the initial weights differ: torch's generator draws them
(normal(0, 0.02) as the trainer's, from another stream). Prints the
validation loss at every eval_every and at the end, as the trainer does.

  python3 scripts/llama_twin.py recipes/llama_kjv.yaml --seed 0 --threads 2
  ./build/trainer train recipes/llama_kjv.yaml seed=0   # the trainer's side

Needs torch, transformers and PyYAML; the trainer does not.
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
import yaml

STREAM_SHUFFLE = 4
M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK = 0xFFFFFFFF


def philox_block(seed, stream, block):
    """core/rng.h philox_block: Philox 4x32-10 of counter (block, stream) under key seed."""
    c = [block & MASK, block >> 32, stream & MASK, stream >> 32]
    k0, k1 = seed & MASK, seed >> 32
    for _ in range(10):
        p0, p1 = M0 * c[0], M1 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c[3] ^ k1) & MASK,
             p0 & MASK]
        k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
    return c


def read_tokens(directory):
    parts = []
    for path in sorted(glob.glob(os.path.join(directory, "shard_*.tok"))):
        with open(path, "rb") as f:
            header = f.read(48)
            assert header[:8] == b"TRTOKENS", path
            width = int.from_bytes(header[12:16], "little")
            count = int.from_bytes(header[24:32], "little")
            dtype = np.uint16 if width == 2 else np.uint32
            parts.append(np.frombuffer(f.read(count * width), dtype=dtype))
    tokens = np.concatenate(parts).astype(np.int64)
    with open(os.path.join(directory, "shard_00000.tok"), "rb") as f:
        vocab = int.from_bytes(f.read(48)[16:24], "little")
    return tokens, vocab


def windows(tokens, starts, T):
    x = np.stack([tokens[s:s + T + 1] for s in starts])
    return torch.from_numpy(x[:, :T].copy()), torch.from_numpy(x[:, 1:].copy())


def lr_at(t, o, s, steps):
    """optim/schedule.cpp: cosine (or constant) times the linear warmup from 1/3."""
    peak, floor, warm = o["lr"], s.get("min_lr", 0.0), s.get("warmup_steps", 0)
    main = peak
    if s.get("name", "constant") == "cosine":
        main = floor if t >= steps else floor + (peak - floor) * (1 + math.cos(math.pi * t / steps)) / 2
    factor = 1.0 if t >= warm else 1 / 3 + (2 / 3) * t / warm
    return main * factor


def build(m, vocab):
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden = m["hidden_size"]
    config = LlamaConfig(
        vocab_size=m.get("vocab_size", 0) or vocab, hidden_size=hidden,
        intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_hidden_layers"],
        num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m.get("num_key_value_heads", 0) or m["num_attention_heads"],
        max_position_embeddings=m["max_position_embeddings"], rms_norm_eps=m["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": float(m.get("rope_theta", 10000))},
        tie_word_embeddings=m["tie_word_embeddings"], attention_dropout=m.get("dropout", 0.0),
        attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def evaluate(model, tokens, train_tokens, T, max_windows):
    available = (len(tokens) - train_tokens - 1) // T
    count = min(max_windows, available) if max_windows > 0 else available
    starts = [train_tokens + (k * available // count) * T for k in range(count)]
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, count, 16):
            x, y = windows(tokens, starts[i:i + 16], T)
            logits = model(input_ids=x, use_cache=False).logits
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                     reduction="sum").item()
            n += y.numel()
    model.train()
    return total / n


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--root", default=".", help="data.path is relative to this directory")
    a = p.parse_args()
    r = yaml.safe_load(open(a.recipe))
    m, d, o, s, t = r["model"], r["data"], r["optimizer"], r.get("schedule", {}), r["training"]
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tokens, vocab = read_tokens(os.path.join(a.root, d["path"]))
    T, batch, steps = d["seq_len"], t["global_batch"], t["steps"]
    train_tokens = len(tokens) - int(round(len(tokens) * d.get("val_fraction", 0.1)))
    per_epoch = (train_tokens - 1) // T
    batches = per_epoch // batch
    model = build(m, vocab)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    wd = o.get("weight_decay", 0.0)
    groups = [{"params": decay, "weight_decay": wd},
              {"params": no_decay, "weight_decay": wd if o.get("decay_norm_and_bias", True) else 0.0}]
    opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(o.get("beta1", 0.9), o.get("beta2", 0.999)),
                            eps=o.get("eps", 1e-8))
    begin = time.time()
    for step in range(steps):
        epoch, position = divmod(step, batches)
        starts = []
        for i in range(position * batch, position * batch + batch):
            v = philox_block(a.seed, STREAM_SHUFFLE + (epoch << 8), i)
            starts.append((v[0] | (v[1] << 32)) % (train_tokens - T))
        x, y = windows(tokens, starts, T)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o, s, steps)
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if o.get("clip_grad_norm", 0) > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % t.get("log_every", 25) == 0:
            print(f"step {done}/{steps} | loss {loss.item():.4f} | "
                  f"{done * batch * T / (time.time() - begin):.0f} tokens/s", flush=True)
        if t.get("eval_every", 0) and (done % t["eval_every"] == 0 or done == steps):
            print(f"eval step {done}: loss "
                  f"{evaluate(model, tokens, train_tokens, T, d.get('val_windows', 0)):.5f}",
                  flush=True)
    print(f"done: {steps} steps in {time.time() - begin:.0f} s")


if __name__ == "__main__":
    main()
