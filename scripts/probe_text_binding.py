"""How well do the frozen text encoder's embeddings say which colour goes in which corner? The measurement behind
train_tiny_teacher.TEXT_BIAS_SCALE.

A probe reads the embeddings of two-shape captions ("a large red circle in the top left and a small blue star in
the bottom right on a ...") the way a Wan expert reads text: a per-token MLP (Wan's text embedder), then
cross-attention from one learned query token with no key positions, and names the colour in each of the four
corners (or none). It is trained for --steps steps on --captions training captions and scored on --test others, for
the tiny teacher's random UMT5 with its relative-position bias scaled by each of --scales, side by side in one run
(same captions, same probe initialisation, same batches).

Example: .venv/bin/python scripts/probe_text_binding.py --scales 1 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import shapes  # noqa: E402
from pipeline.tiny_teacher import build_tiny_pipeline  # noqa: E402
from train_tiny_teacher import scale_text_position_bias, text_embeds  # noqa: E402

EMPTY = len(shapes.COLOURS)  # the class of a corner with no shape


def two_shape_captions(seed: int, n: int) -> tuple[list[str], torch.Tensor]:
    """The first `n` two-shape captions of the training stream and their corner colours [n, 4]."""
    colours, caps, target, i = list(shapes.COLOURS), [], [], 0
    while len(caps) < n:
        scene = shapes.scene_for(seed, i, "train")
        i += 1
        if len(scene.shapes) == 2:
            caps.append(scene.caption)
            corners = [EMPTY] * len(shapes.CORNERS)
            for s in scene.shapes:
                corners[shapes.CORNERS.index(s.position)] = colours.index(s.colour)
            target.append(corners)
    return caps, torch.tensor(target)


class Probe(nn.Module):
    def __init__(self, text_dim: int, width: int = 192, heads: int = 6, layers: int = 2):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(text_dim, width), nn.GELU(approximate="tanh"), nn.Linear(width, width))
        self.query = nn.Parameter(torch.randn(1, 1, width) * 0.1)
        self.attn = nn.ModuleList(nn.MultiheadAttention(width, heads, batch_first=True) for _ in range(layers))
        self.ff = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                              nn.Linear(2 * width, width)) for _ in range(layers))
        self.out = nn.Linear(width, len(shapes.CORNERS) * (EMPTY + 1))

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        k = self.embed(emb)
        h = self.query.expand(len(emb), -1, -1)
        for attn, ff in zip(self.attn, self.ff):
            h = h + attn(h, k, k, need_weights=False)[0]
            h = h + ff(h)
        return self.out(h[:, 0]).view(len(emb), len(shapes.CORNERS), EMPTY + 1)


def probe(emb: torch.Tensor, target: torch.Tensor, test: int, steps: int, every: int, batch: int = 256,
          seed: int = 0) -> list[tuple[int, float]]:
    """Train a probe on all but the last `test` rows; (step, accuracy on the last `test` rows' occupied corners)."""
    train_n = len(emb) - test
    torch.manual_seed(seed)
    model = Probe(emb.shape[-1])
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    test_t = target[train_n:]
    occupied = test_t != EMPTY
    scores = []
    for step in range(1, steps + 1):
        idx = torch.randint(0, train_n, (batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(emb[idx]).flatten(0, 1), target[idx].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0 or step == steps:
            with torch.no_grad():
                pred = model(emb[train_n:]).argmax(-1)
            scores.append((step, (pred[occupied] == test_t[occupied]).float().mean().item()))
    return scores


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 16.0],
                    help="Relative-position bias scales to compare (1: the encoder as drawn).")
    ap.add_argument("--seed", type=int, default=0, help="The tiny teacher's seed (its text encoder) and the data's.")
    ap.add_argument("--captions", type=int, default=10000, help="Captions the probe trains on.")
    ap.add_argument("--test", type=int, default=2000, help="Further captions it is scored on.")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--every", type=int, default=250, help="Steps between scores.")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    caps, target = two_shape_captions(args.seed, args.captions + args.test)
    for scale in args.scales:
        t0 = time.time()
        pipe = build_tiny_pipeline("wan2.2", args.seed)
        scale_text_position_bias(pipe.text_encoder, scale)
        emb = torch.cat([text_embeds(pipe, caps[i:i + 500]) for i in range(0, len(caps), 500)])
        scores = probe(emb, target, args.test, args.steps, args.every)
        shown = ", ".join(f"{acc:.1%} at step {step}" for step, acc in scores)
        print(f"bias scale {scale:g}: corner colours right {shown} ({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
