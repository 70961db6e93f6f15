"""PyTorch side of bench_train: the same training step (forward, backward,
SGD momentum 0.9, weight decay 1e-4) on the same model, batch, input size and
thread count, channels-last, synthetic data. Prints "samples_per_second
peak_rss_mib" (for --model lstm_lm, gpt and llama: "tokens_per_second peak_rss_mib"). With
--precision bf16, forward and loss run under torch.autocast("cpu", torch.bfloat16), as
ours run under AutocastGuard(bf16). Not a project dependency: bench_train calls it when
torch is importable.
"""
import argparse
import contextlib
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class SmallCNN(nn.Module):
    """models/small.h SmallCNN: conv-bn-relu-pool x2, fc 3136-128, dropout, fc 128-10."""

    def __init__(self, channels, classes, size):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * (size // 4) ** 2, 128)
        self.fc2 = nn.Linear(128, classes)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = torch.flatten(x, 1)
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class LSTMLM(nn.Module):
    """models/lstm_lm.h LSTMLM: embedding, stacked LSTM (batch first), linear decoder."""

    def __init__(self, vocab, hidden, layers):
        super().__init__()
        self.encoder = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        y, _ = self.rnn(self.encoder(tokens))
        return self.decoder(y)


class Block(nn.Module):
    """nanoGPT's pre-LN block: fused QKV, F.scaled_dot_product_attention, exact GELU MLP
    (nn.GELU(), nanoGPT's and models/gpt.h's default)."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """models/gpt.h GPT (nanoGPT): token and position embeddings, blocks, ln_f, tied head."""

    def __init__(self, vocab, block_size, width, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block_size, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


class Llama(nn.Module):
    """models/llama.h's Llama: transformers' LlamaForCausalLM (SDPA attention), untied."""

    def __init__(self, a):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=a.classes, hidden_size=a.size,
                             intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                             num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                             max_position_embeddings=a.seq, tie_word_embeddings=False,
                             attn_implementation="sdpa")
        self.model = LlamaForCausalLM(config)

    def forward(self, tokens):
        return self.model(input_ids=tokens, use_cache=False).logits


def case_arguments(steps):
    """The arguments naming a case, shared with bench_dp_torch.py: --model (small_cnn or a
    torchvision model), --batch, --size (input side), --channels, --classes, --steps."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=steps)
    return p


def image_model(a):
    """The image classifier --model names: SmallCNN or a torchvision model."""
    if a.model == "small_cnn":
        return SmallCNN(a.channels, a.classes, a.size)
    import torchvision

    if a.model == "resnet18_small":
        # models/resnet.h small_input: a 3x3 stride-1 stem and no max-pool.
        m = torchvision.models.resnet18(num_classes=a.classes)
        m.conv1 = nn.Conv2d(a.channels, 64, 3, 1, 1, bias=False)
        m.maxpool = nn.Identity()
        return m
    return getattr(torchvision.models, a.model)(num_classes=a.classes)


def median_step_seconds(steps, loss, opt):
    """Median seconds of a training step (loss(), backward, opt step) over `steps` timed
    steps after 2 warm-up steps."""
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def autocast(a):
    """The context forward and loss run in: bf16 autocast for --precision bf16."""
    if a.precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_tokens_per_second(a):
    """Language models: vocab --classes, width --size, --layers layers, sequence --seq,
    batch --batch (GPT: --heads heads, context --seq)."""
    if a.model == "gpt":
        model = GPT(a.classes, a.seq, a.size, a.layers, a.heads)
    elif a.model == "llama":
        model = Llama(a)
    else:
        model = LSTMLM(a.classes, a.size, a.layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randint(0, a.classes, (a.batch, a.seq))
    y = torch.randint(0, a.classes, (a.batch, a.seq))

    def loss():
        with autocast(a):
            return F.cross_entropy(model(x).reshape(-1, a.classes), y.reshape(-1))

    return a.batch * a.seq / median_step_seconds(a.steps, loss, opt)


def main():
    p = case_arguments(steps=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=0)
    p.add_argument("--intermediate", type=int, default=0)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.model in ("lstm_lm", "gpt", "llama"):
        tps = lm_tokens_per_second(a)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        print(f"{tps:.3f} {peak:.1f}")
        return
    model = image_model(a).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(a.batch, a.channels, a.size, a.size).to(memory_format=torch.channels_last)
    y = torch.full((a.batch,), 3, dtype=torch.long)
    def loss():
        with autocast(a):
            return F.cross_entropy(model(x), y)

    sps = a.batch / median_step_seconds(a.steps, loss, opt)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"{sps:.3f} {peak:.1f}")


if __name__ == "__main__":
    main()
