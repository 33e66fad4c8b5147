"""The FLOP model of stage two's training sample (`pipeline/flops.py` `train_flops`, docs/costs.md) against real
training steps here, as bench/teacher_flops.py checks stage one's step.

`plan` and `train-student --dry-run` price a training sample by its FLOPs: forward, backward (dX and dW of a trained
transformer, dX alone of a frozen base with LoRA adapters; attention ~2x its forward) and the forward gradient
checkpointing repeats, at one share of the device's peak whatever the pass. This times the stage's own loss and
backward (`Velocity.loss`: the student's forward through `student_forward`, MSE to the target, `.backward()`) of
diffusers' WanTransformer3DModel (float32, batch 1) in three ways, calibrates the model by the first and predicts the
others:

- a compact student (every weight trained) at a small size (attention ~14% of the forward): the calibration;
- train_flops_compact: the same student at a large size (attention ~28%, 3x the tokens): predicted / measured;
- train_flops_lora: the same transformer frozen with peft LoRA adapters (`lora_experts.add_adapter`, rank 16 on
  train-student's default targets) and gradient checkpointing, at the large size: predicted / measured.

The optimizer's step (per parameter, not per token) is left out of the timing as it is of the model. On the CPU the
figure is the process's CPU seconds (torch's threads together), not wall time, so that other processes on a shared
machine do not enter it. text_dim is
small (256) so that the text embedder, which the model does not count, stays under 1%. tests/test_train_costs.py
reads the recorded figures and holds them within 15%.

Run: python -m bench.train_flops [--dim 1024 --ffn 4096 --layers 1] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from bench.common import cli_results_path, interleaved, pick_device, result, save, table
from bench.teacher_flops import HEAD_DIM, TEXT_DIM, size_arg
from cache import format as F
from pipeline.flops import train_flops
from pipeline.lora_experts import add_adapter
from pipeline.registries import LORA_TARGETS
from stages.train_student.objective_velocity import Batch, Velocity

RANK = 16


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1024, help=f"Block width (heads of {HEAD_DIM}).")
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--small", type=size_arg, default=(5, 240, 416), help="Calibration size, FxHxW (780 tokens).")
    ap.add_argument("--large", type=size_arg, default=(9, 480, 416), help="Predicted size, FxHxW (2,340 tokens).")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="Timed steps per case (best taken), after one warm-up.")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="Minimal sizes (smoke test).")
    args = ap.parse_args(argv)
    if args.quick:
        args.dim, args.ffn, args.small, args.large, args.text_tokens, args.reps = 256, 1024, (1, 64, 64), (
            5, 64, 64), 64, 1
    from diffusers import WanTransformer3DModel

    device = pick_device(args.device)
    config = {"num_attention_heads": args.dim // HEAD_DIM, "attention_head_dim": HEAD_DIM, "ffn_dim": args.ffn,
              "num_layers": args.layers, "text_dim": TEXT_DIM, "in_channels": 16, "out_channels": 16}
    torch.manual_seed(0)
    compact = WanTransformer3DModel(**config).to(device).train()
    torch.manual_seed(0)
    lora = WanTransformer3DModel(**config).to(device).train()
    targets = tuple(LORA_TARGETS.split(","))
    add_adapter(lora, RANK, float(RANK), targets)
    lora.enable_gradient_checkpointing()
    objective = Velocity()
    text = torch.randn(1, args.text_tokens, TEXT_DIM, device=device)

    def step(model, size):
        frames, height, width = size
        shape = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
        batch = Batch({F.T_X_T: torch.randn(shape, device=device), F.T_TARGET: torch.randn(shape, device=device)},
                      torch.full((1,), 500.0, device=device), text, torch.ones(1, device=device))

        def run():
            model.zero_grad(set_to_none=True)
            loss, _ = objective.loss(model, batch, contextlib.nullcontext)
            loss.sum().backward()
        return run

    cases = {"calibration": (compact, args.small), "compact": (compact, args.large), "lora": (lora, args.large)}
    fns = {k: step(*v) for k, v in cases.items()}
    for fn in fns.values():  # warm-up
        fn()
    if device.type == "cpu":  # the process's CPU seconds: what it computed, whoever else shares the machine
        fns = {k: _cpu_seconds(fn) for k, fn in fns.items()}
    best = {k: min(v) for k, v in interleaved(fns, args.reps, device).items()}
    if device.type == "cpu":
        best = {k: min(fns[k].took) for k in best}
    tokens = {k: ((f - 1) // 4 + 1) * (h // 16) * (w // 16) for k, (_, (f, h, w)) in cases.items()}
    lora_kw = {"adapter_rank": RANK, "adapter_targets": targets, "checkpointing": True}
    model = {k: train_flops(config, tokens[k], args.text_tokens, **(lora_kw if k == "lora" else {})) for k in cases}
    rate = model["calibration"]["total"] / best["calibration"]  # FLOP/s of the calibration step

    def words(k):
        f = train_flops(config, tokens[k], args.text_tokens)
        attention = 2 * tokens[k] * (tokens[k] + args.text_tokens) * args.dim * 2 * args.layers / f["forward"]
        return (f"{'x'.join(map(str, cases[k][1]))} ({tokens[k]:,} tokens, attention {attention:.0%} of the forward, "
                f"{model[k]['total']:.3g} FLOP): {best[k]:.3f} s, {model[k]['total'] / best[k] / 1e9:.0f} GFLOP/s")
    how = (f"CPU seconds of the process, torch on {torch.get_num_threads()} thread(s)" if device.type == "cpu"
           else "wall seconds")
    head = (f"WanTransformer3DModel dim {args.dim}, ffn {args.ffn}, {args.layers} block(s), float32, batch 1, "
            f"{args.text_tokens} text tokens, Velocity.loss + backward, {how}; calibrated by the compact student at "
            f"{words('calibration')}")
    whats = {"compact": "the compact student (every weight trained)",
             "lora": f"rank-{RANK} LoRA adapters on the frozen transformer, gradient checkpointing"}
    return [result(f"train_flops_{k}", model[k]["total"] / rate, best[k], "s", None, "info",
                   note=f"{head}; measured {whats[k]} at {words(k)}; best of {args.reps}") for k in ("compact", "lora")]


class _cpu_seconds:  # noqa: N801 (a timed function)
    """`fn` run as before, recording the CPU seconds of this process each call took (`took`)."""

    def __init__(self, fn):
        self.fn, self.took = fn, []

    def __call__(self):
        t = time.process_time()
        self.fn()
        self.took.append(time.process_time() - t)


if __name__ == "__main__":
    import sys

    res = main()
    save(res, cli_results_path(sys.argv[1:]))
    print(table(res))
