"""The motion checker (stages/sample/motion.py) on the tiny video teacher's VAE round trip of rendered clips, the
pixels it reads where it is used: held-out clips of pipeline/clips.py (the 128 of data/clips-heldout.txt, each the
clip of the seed-0 held-out stream its caption first names, and the streams of --seeds), each encoded to its
latent's posterior mean and decoded, checked clean and round-tripped. All right overall and per (shape colour,
background colour) pair, with counts and the reads that fail; docs/tiny-video-teacher.md, "The checker on the VAE
round trip", quotes the run.

    .venv/bin/python scripts/check_checker_vae.py [--per-seed 512] [--seeds 0 1] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import clips  # noqa: E402
from pipeline.prompts import read_prompt_file  # noqa: E402
from scripts.train_tiny_video_teacher import to_pixels, to_u8  # noqa: E402
from stages.sample import motion  # noqa: E402

VAE = ROOT / "data" / "tiny-video-teacher-pretrained" / "vae"
FAILS = ("colour", "background", "direction", "speed")


def committed_indices(path: Path) -> list[int]:
    """Where each caption of `path` first appears in the seed-0 held-out stream (how the file was made)."""
    want, first, i = read_prompt_file(str(path)), {}, 0
    while len(first) < len(set(want)):
        first.setdefault(clips.clip_for(0, i, "heldout").caption, i)
        i += 1
        if i > 100 * len(want):
            sys.exit(f"{path}: some captions are not in the seed-0 held-out stream; pass the committed file")
    return [first[c] for c in want]


def render(seed: int, indices) -> tuple[np.ndarray, list[str]]:
    """The held-out clips of `seed` at `indices`, as clips.batch draws them."""
    got = [clips.batch(seed, i, 1, "heldout") for i in indices]
    return np.concatenate([u8 for u8, _, _ in got]), [caps[0] for _, caps, _ in got]


@torch.no_grad()
def round_trip(vae, u8: np.ndarray, chunk: int, sample: bool) -> np.ndarray:
    """uint8 clips [n, F, 64, 64, 3] encoded (posterior mean, or a draw with `sample`) and decoded, as uint8."""
    out = []
    for s in range(0, len(u8), chunk):
        post = vae.encode(to_pixels(u8[s:s + chunk])).latent_dist
        out.append(to_u8(vae.decode(post.sample() if sample else post.mode()).sample))
    return np.concatenate(out)


def fails(r: dict, caption: str) -> list[str]:
    """Which reads of a `motion.check` are wrong."""
    want = clips.parse_caption(caption)
    return [k for k, bad in zip(FAILS, (any(s != want.colour for s in r["shapes"]),
                                        any(b != want.background for b in r["backgrounds"]),
                                        not r["direction_right"], bool(want.speed) and not r["speed_right"])) if bad]


def summarise(reads: list[dict], captions: list[str]) -> dict:
    """All right (with its Wilson interval) and the count of each failing read over `reads`."""
    k, n = sum(r["all_right"] for r in reads), len(reads)
    fail = Counter(f for r, c in zip(reads, captions) for f in fails(r, c))
    return {"clips": n, "all_right": k, "all": k / max(n, 1), "all_interval": motion.wilson(k, n),
            "fails": {f: fail[f] for f in FAILS if fail[f]}}


def wrong_colours(reads: list[dict], captions: list[str]) -> dict:
    """Per clip read with a wrong shape colour, the colour it was read as (the most common wrong one per frame)."""
    out = Counter()
    for r, c in zip(reads, captions):
        bad = [s for s in r["shapes"] if s != clips.parse_caption(c).colour]
        if bad:
            out[str(Counter(bad).most_common(1)[0][0])] += 1
    return dict(out.most_common())


def report(clean: list[dict], rt: list[dict], captions: list[str]) -> dict:
    """Clean against round trip, overall and per 'shape on background' pair."""
    pairs = defaultdict(list)
    for i, c in enumerate(captions):
        w = clips.parse_caption(c)
        pairs[f"{w.colour} on {w.background}"].append(i)

    def row(ix):
        caps = [captions[i] for i in ix]
        return {"clean": summarise([clean[i] for i in ix], caps), "round_trip": summarise([rt[i] for i in ix], caps),
                "round_trip_read_as": wrong_colours([rt[i] for i in ix], caps)}

    return {**row(range(len(captions))), "pairs": {p: row(ix) for p, ix in sorted(pairs.items())}}


def line(name: str, rep: dict) -> str:
    fig = "{all:.1%} ({all_right}/{clips})".format
    return (f"{name:<36} {fig(**rep['clean']):>16} {fig(**rep['round_trip']):>16}  {rep['round_trip']['fails'] or ''}"
            f" {rep['round_trip_read_as'] or ''}")


def show(sets: dict, pairs: dict) -> None:
    """The all-right table: every set, then every pair of the streams together, worst round trip first."""
    print(f"{'all right':<36} {'clean':>16} {'round trip':>16}  round-trip fails; shape colours read instead")
    for name, rep in sets.items():
        print(line(name, rep))
    for p, rep in sorted(pairs.items(), key=lambda kv: (kv[1]["round_trip"]["all"], kv[0])):
        print(line(p, rep))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vae", default=str(VAE))
    ap.add_argument("--captions", default="data/clips-heldout.txt",
                    help="captions of the seed-0 held-out stream, each rendered as the clip it first names")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="held-out streams, --per-seed clips each")
    ap.add_argument("--per-seed", type=int, default=512)
    ap.add_argument("--sample", action="store_true", help="decode a posterior draw, not the mean")
    ap.add_argument("--chunk", type=int, default=32, help="clips per VAE call")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    t0 = time.time()
    vae = AutoencoderKLWan.from_pretrained(args.vae, torch_dtype=torch.float32).eval()
    streams = [(f"seed {s} held-out stream, clips 0-{args.per_seed - 1}", s, range(args.per_seed)) for s in args.seeds]
    out, reads, times = {}, ([], [], []), Counter()
    for name, seed, ix in [(args.captions, 0, committed_indices(ROOT / args.captions)), *streams]:
        t = time.time()
        u8, captions = render(seed, ix)
        times["render_s"] += time.time() - t
        t = time.time()
        rec = round_trip(vae, u8, args.chunk, args.sample)
        times["vae_s"] += time.time() - t
        t = time.time()
        clean, rt = (motion.score(list(x), captions)["clip_reads"] for x in (u8, rec))
        times["check_s"] += time.time() - t
        out[name] = report(clean, rt, captions)
        if name != args.captions:
            for acc, got in zip(reads, (clean, rt, captions)):
                acc += got
    together = report(*reads)  # the streams together: the per-pair counts
    out = {"streams together": {k: v for k, v in together.items() if k != "pairs"}, **out}
    show(out, together["pairs"])
    times = {k: round(v, 1) for k, v in times.items()} | {"total_s": round(time.time() - t0, 1)}
    print(f"\nlatent: {'a posterior draw' if args.sample else 'posterior mean'}; time {times}")
    if args.json:
        Path(args.json).write_text(json.dumps({"vae": args.vae, "latent": "sample" if args.sample else "mean",
                                               "time": times, "sets": out,
                                               "pairs": together["pairs"]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
