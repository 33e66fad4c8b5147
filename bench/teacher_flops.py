"""The FLOP model of stage one's step (`costs.step_flops`, docs/costs.md) against a real Wan transformer here.

`plan` carries the table's one-frame step to a video run's tokens by FLOPs, assuming the device runs every length
at the same share of its peak. This times diffusers' WanTransformer3DModel (Wan2.1-1.3B's block width: 12 heads of
128, ffn 8960; one block by default, float32, one sequence: no CFG) at two sizes where attention's share of the
FLOPs differs a lot, calibrates the model by the small one and predicts the large one:

- teacher_flops_model: the model's prediction of the large size's forward (s) vs the measured one; ratio =
  predicted / measured (1: exact). The note has the sizes, attention's shares, and what scaling by tokens alone
  (plan's rule before issue 45) predicted.

text_dim is kept small (256) so that the text embedder, which the model does not count, stays under 1% here
(at A14B's 40 blocks it is 0.1%). tests/test_costs.py reads the recorded figure.

Run: python -m bench.teacher_flops [--dim 1536 --ffn 8960 --layers 1] [--reps 2] [--quick]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import cli_results_path, interleaved, pick_device, result, save, table
from stages.teacher_cache.costs import step_flops

HEAD_DIM = 128
TEXT_DIM = 256


def size_arg(text: str) -> tuple[int, int, int]:
    """'FRAMESxHEIGHTxWIDTH' (decoded frames and pixels, as `plan` takes them)."""
    frames, height, width = (int(v) for v in text.split("x"))
    return frames, height, width


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1536, help=f"Block width (heads of {HEAD_DIM}).")
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--small", type=size_arg, default=(1, 240, 416), help="Calibration size, FxHxW (390 tokens).")
    ap.add_argument("--large", type=size_arg, default=(9, 480, 832), help="Predicted size, FxHxW (4,680 tokens).")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2, help="Timed forwards per size (best taken), after one warm-up.")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="Minimal sizes (smoke test).")
    args = ap.parse_args(argv)
    if args.quick:
        args.dim, args.ffn, args.small, args.large, args.text_tokens, args.reps = 256, 1024, (1, 64, 64), (
            5, 64, 64), 64, 1
    from diffusers import WanTransformer3DModel

    from pipeline.model_call import Inputs, predict

    device = pick_device(args.device)
    torch.manual_seed(0)
    config = {"num_attention_heads": args.dim // HEAD_DIM, "attention_head_dim": HEAD_DIM, "ffn_dim": args.ffn,
              "num_layers": args.layers, "text_dim": TEXT_DIM, "in_channels": 16, "out_channels": 16}
    model = WanTransformer3DModel(**config).to(device).eval()
    text = torch.randn(1, args.text_tokens, TEXT_DIM, device=device)
    t = torch.full((1,), 999.0, device=device)

    def forward(size):
        frames, height, width = size
        x = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, device=device)

        def run():
            with torch.inference_mode():
                predict(model, Inputs(x, t, text))
        return run

    sizes = {"small": args.small, "large": args.large}
    fns = {k: forward(s) for k, s in sizes.items()}
    for fn in fns.values():  # warm-up
        fn()
    best = {k: min(v) for k, v in interleaved(fns, args.reps, device).items()}
    tokens = {k: ((f - 1) // 4 + 1) * (h // 16) * (w // 16) for k, (f, h, w) in sizes.items()}
    flops = {k: step_flops(config, n, args.text_tokens, cfg=False) for k, n in tokens.items()}
    predicted = best["small"] * flops["large"]["total"] / flops["small"]["total"]
    by_tokens = best["small"] * tokens["large"] / tokens["small"]

    def words(k):
        f, attention = flops[k], flops[k]["self_attention"] + flops[k]["cross_attention"]
        return (f"{'x'.join(map(str, sizes[k]))} ({tokens[k]:,} tokens, {f['total']:.3g} FLOP, attention "
                f"{attention / f['total']:.0%}): {best[k]:.3f} s, {f['total'] / best[k] / 1e9:.0f} GFLOP/s")
    dtype = next(model.parameters()).dtype
    note = (f"WanTransformer3DModel dim {args.dim}, ffn {args.ffn}, {args.layers} block(s), {dtype}, one sequence, "
            f"{args.text_tokens} text tokens; calibrated by {words('small')}; measured {words('large')}; by tokens "
            f"alone {by_tokens:.3f} s ({by_tokens / best['large'] - 1:+.0%}); best of {args.reps}")
    return [result("teacher_flops_model", predicted, best["large"], "s", None, "info", note=note)]


if __name__ == "__main__":
    import sys

    res = main()
    save(res, cli_results_path(sys.argv[1:]))
    print(table(res))
