#!/usr/bin/env python3
"""Golden values for tests/test_models_golden.cpp, computed by PyTorch.

Builds tiny fixed-weight models in PyTorch -- torchvision's ResNet-18 (real
shapes, 64x64 input, batch 2, batch norm in training mode), a nanoGPT-style
GPT (2 layers, tied head, both GELU forms) and PyTorch's word_language_model
LSTM LM (2 layers) -- runs forward and backward on fixed inputs and writes
tests/golden_models.h: logits, loss, final states, updated batch-norm
statistics and a strided selection of parameter gradients. The C++ test
builds the same models through the registry, sets the same weights and
inputs from the same formulas, and compares. Needs torch (and torchvision
for the ResNet); the C++ tests do not.

The weights: parameter j of named_parameters() (each tensor once, so a tied
weight counts once), element i, with v = uniform(j, i) in [-1, 1) from
SplitMix64 of (j << 32 | i): 2 (z >> 40) / 2^24 - 1, exact in float32 (a
formula smooth in i, such as sin(i), makes channels so alike that batch
norm over ResNet-18's last 2x2 maps divides by near-zero variances):
  - two or more dims: v / sqrt(numel / size(0))  (fan-in scaling)
  - one dim, name ending in "weight" (norm gains): 1 + 0.1 v
  - any other one-dim tensor (biases): 0.1 v
Inputs: images uniform(1000, i); tokens (7 i + 3) % V; targets (5 i + 1) % V;
an LSTM state 0.5 sin(0.2 i + 1) (h) and 0.5 cos(0.3 i) (c).

  python3 scripts/golden_models.py                # rewrites tests/golden_models.h
  python3 scripts/golden_models.py --check-gpt-checkpoint \
      runs/gpt_kjv/checkpoints/step_00001200/model-rank00000.safetensors --n-head 4
      # loads a trainer GPT checkpoint into the nanoGPT-style module with strict=True
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SELECTED = 16  # elements kept per gradient: flat indices k * ((numel - 1) // 16), k < 16


# ---- shared formulas (tests/test_models_golden.cpp computes the same) ----

def uniform(j, n):
    """SplitMix64 of (j << 32 | i) for i < n, mapped to [-1, 1) with 24 bits (exact in float32)."""
    with np.errstate(over="ignore"):
        z = (np.uint64(j) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(40)).astype(np.float64) * (2.0 / 2**24) - 1.0)


def golden_weights_(model):
    with torch.no_grad():
        for j, (name, p) in enumerate(model.named_parameters()):
            v = uniform(j, p.numel())
            if p.dim() >= 2:
                v = v / math.sqrt(p.numel() // p.shape[0])
            elif name.endswith("weight"):
                v = 1.0 + 0.1 * v
            else:
                v = 0.1 * v
            p.copy_(v.to(torch.float32).view(p.shape))


def images(shape):
    return uniform(1000, math.prod(shape)).to(torch.float32).view(shape)


def tokens(b, t, v, mul, add):
    return ((mul * torch.arange(b * t) + add) % v).view(b, t)


# ---- nanoGPT's GPT, with its names (written for this script) ----

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd, gelu):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate=gelu)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, gelu):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, gelu)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, gelu="none"):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head, gelu) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ---- word_language_model's RNNModel (LSTM) ----

class LSTMLM(nn.Module):
    def __init__(self, vocab_size, emb, hidden, layers):
        super().__init__()
        self.encoder = nn.Embedding(vocab_size, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab_size)

    def forward(self, idx, state):
        y, state = self.rnn(self.encoder(idx), state)
        return self.decoder(y), state


# ---- the cases ----

def selected(t):
    flat = t.detach().reshape(-1)
    # (numel - 1) // 16 rather than numel // 16: a stride that divides the
    # shape would pick one input channel only.
    stride = max(1, (flat.numel() - 1) // SELECTED)
    count = min(SELECTED, flat.numel())
    return stride, flat[: stride * count : stride].tolist()


def entries_for(values, grads, model):
    out = [(name, 1, t.detach().reshape(-1).tolist()) for name, t in values]
    params = dict(model.named_parameters())
    for name in grads:
        stride, v = selected(params[name].grad)
        out.append(("grad:" + name, stride, v))
    return out


def resnet_case():
    import torchvision
    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=5)
    golden_weights_(net)
    net.train()
    x = images((2, 3, 64, 64))
    y = torch.tensor([1, 3])
    logits = net(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    buffers = dict(net.named_buffers())
    values = [("logits", logits), ("loss", loss.reshape(1))]
    entries = entries_for(values, ["conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight",
                                   "layer2.0.downsample.0.weight", "layer3.1.bn2.weight",
                                   "layer4.1.conv2.weight", "fc.weight", "fc.bias"], net)
    for name in ["bn1.running_mean", "bn1.running_var", "layer4.1.bn2.running_var"]:
        stride, v = selected(buffers[name])
        entries.append(("buffer:" + name, stride, v))
    return entries


def gpt_case(gelu):
    V, T = 13, 8
    gpt = GPT(V, T, n_layer=2, n_head=2, n_embd=16, gelu=gelu)
    golden_weights_(gpt)
    idx, targets = tokens(2, T, V, 7, 3), tokens(2, T, V, 5, 1)
    logits = gpt(idx)
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    loss.backward()
    return entries_for([("logits", logits), ("loss", loss.reshape(1))],
                       ["transformer.wte.weight", "transformer.wpe.weight",
                        "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.bias",
                        "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight",
                        "transformer.h.1.ln_2.bias", "transformer.ln_f.weight"], gpt)


def lstm_case():
    V, T, H, L = 11, 6, 12, 2
    lm = LSTMLM(V, H, H, L)
    golden_weights_(lm)
    idx, targets = tokens(2, T, V, 7, 3), tokens(2, T, V, 5, 1)
    n = L * 2 * H
    i = torch.arange(n, dtype=torch.float64)
    h0 = (0.5 * torch.sin(0.2 * i + 1)).to(torch.float32).view(L, 2, H)
    c0 = (0.5 * torch.cos(0.3 * i)).to(torch.float32).view(L, 2, H)
    logits, (h, c) = lm(idx, (h0, c0))
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    loss.backward()
    return entries_for([("logits", logits), ("loss", loss.reshape(1)), ("h", h), ("c", c)],
                       ["encoder.weight", "rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_ih_l0",
                        "rnn.weight_ih_l1", "rnn.weight_hh_l1", "rnn.bias_hh_l1", "decoder.weight",
                        "decoder.bias"], lm)


def cpp_float(v):
    text = "%.9g" % v
    return text + ("f" if any(c in text for c in ".e") else ".0f")


def cpp_case(name, entries):
    lines = [f"inline const std::vector<GoldenEntry> {name} = {{"]
    for entry, stride, values in entries:
        body = ", ".join(cpp_float(v) for v in values)
        lines.append(f'    {{"{entry}", {stride}, {{{body}}}}},')
    lines.append("};")
    return "\n".join(lines)


def write_header(path):
    torch.set_num_threads(1)
    cases = [("kResNet18", resnet_case()), ("kGPTExact", gpt_case("none")),
             ("kGPTTanh", gpt_case("tanh")), ("kLSTMLM", lstm_case())]
    text = [
        "// Generated by scripts/golden_models.py with PyTorch " + torch.__version__.split("+")[0]
        + "; do not edit.",
        "// Per case: tensors (whole) and parameter gradients / buffers (every",
        "// stride-th element) that tests/test_models_golden.cpp compares against.",
        "#pragma once", "", "#include <cstdint>", "#include <vector>", "",
        "namespace trainer::golden {", "",
        "struct GoldenEntry {",
        '  const char* name;  // "logits", "loss", "h", "c", "grad:<param>", "buffer:<name>"',
        "  int64_t stride;    // values are elements 0, stride, 2 stride, ... of the flat tensor",
        "  std::vector<float> values;",
        "};", ""]
    for name, entries in cases:
        text += [cpp_case(name, entries), ""]
    text += ["}  // namespace trainer::golden", ""]
    with open(path, "w") as f:
        f.write("\n".join(text))
    print("wrote", path)


def check_gpt_checkpoint(path, n_head):
    """Loads a trainer GPT checkpoint into the nanoGPT-style GPT with strict=True."""
    from safetensors.torch import load_file
    sd = load_file(path)
    V, D = sd["transformer.wte.weight"].shape
    T = sd["transformer.wpe.weight"].shape[0]
    L = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.h."))
    gpt = GPT(V, T, L, n_head, D)  # the head count changes no tensor's shape
    gpt.load_state_dict(sd, strict=True)
    tied = gpt.lm_head.weight.data_ptr() == gpt.transformer.wte.weight.data_ptr()
    print(f"{path}: {len(sd)} tensors loaded with strict=True into nanoGPT's GPT "
          f"(vocab {V}, context {T}, {L} layers, width {D}; head tied: {tied})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                      "golden_models.h"))
    parser.add_argument("--check-gpt-checkpoint", metavar="MODEL_SAFETENSORS")
    parser.add_argument("--n-head", type=int, default=1, help="of the checkpoint's GPT")
    args = parser.parse_args()
    if args.check_gpt_checkpoint:
        check_gpt_checkpoint(args.check_gpt_checkpoint, args.n_head)
    else:
        write_header(os.path.normpath(args.out))
