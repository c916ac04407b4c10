"""A serving loop for a given time: a small decoder called once per generated token, under ``torch.no_grad``, no
optimizer anywhere (tests/test_long_run.py: steps of a job without an optimizer step).

    python serving_loop.py SECONDS [--slow-at S] [--prompt-encoder]

Each request encodes its prompt once (``--prompt-encoder``: a separate module, called once per request before the
decoding loop), then decodes 16 tokens greedily, one decoder call per token.
--slow-at: from S seconds on, for 30 decoder calls, each call also sorts 2M numbers (aten::sort): slow steps.
Prints one JSON line at the end: decoder calls made, the call where the planted slow run began, RSS once a second,
and a digest of the first 20 requests' tokens (the same under any capture).
"""

import argparse
import hashlib
import json
import resource
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("seconds", type=float)
parser.add_argument("--slow-at", type=float)
parser.add_argument("--prompt-encoder", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
VOCAB, WIDTH = 64, 96


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.slow = False

    def forward(self, tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        if self.slow:
            torch.sort(torch.rand(2_000_000))
        return self.head(self.body(self.embed(tokens[:, -1]) + context))


decoder = Decoder().eval()
encoder = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH)).eval()
digest = hashlib.sha256()
calls = requests = 0
slow_from = None
slow_left = 0
rss = []


def rss_kb() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4


start = time.monotonic()
next_rss = start
with torch.no_grad():
    while time.monotonic() - start < args.seconds:
        gen = torch.Generator().manual_seed(requests)
        tokens = torch.randint(0, VOCAB, (4, 8), generator=gen)
        context = encoder(tokens).mean(dim=1) if args.prompt_encoder else torch.zeros(4, WIDTH)
        for _ in range(16):
            now = time.monotonic()
            if args.slow_at is not None and slow_from is None and now - start >= args.slow_at:
                slow_from, slow_left = calls, 30
            decoder.slow = slow_left > 0
            slow_left = max(slow_left - 1, 0)
            logits = decoder(tokens, context)
            calls += 1
            tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True)], dim=1)
            if now >= next_rss:
                rss.append((round(now - start, 1), rss_kb()))
                next_rss += 1.0
        if requests < 20:
            digest.update(tokens.numpy().tobytes())
        requests += 1
print(
    json.dumps(
        {
            "calls": calls,
            "requests": requests,
            "slow_from": slow_from,
            "rss_samples": rss,
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "digest": digest.hexdigest(),
        }
    )
)
