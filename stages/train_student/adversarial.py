"""The segment objective's adversarial term (`--segment-adversarial-weight`, docs/architecture.md "Objectives"), in
the way of LADD and APT but teacher-free: a prompt-conditioned discriminator sees the cached teacher's final latents as
real and the student's final-segment outputs as fake, both re-noised to a random level. Its trunk is a student-shaped
WanTransformer3DModel copied from `--segment-disc-init` (the velocity student: the same latent space, no teacher), its
head one linear layer on the last block's tokens. It lives among the objective's heads: trained beside the student by
the same optimizer, checkpointed with it (objective.safetensors) and never exported.

One loss, one backward: the discriminator's loss sees the fakes detached, the student's adversarial term sees the
discriminator's parameters detached (`torch.func.functional_call`), so each gradient reaches only its own side. The
noise is drawn per sample from the sample's identity and the count of training batches (a buffer, checkpointed), so a
resumed run and any number of ranks draw the same noise as one process."""

from __future__ import annotations

import torch
import torch.nn.functional as nnf

from pipeline.errors import UserError
from pipeline.model_call import InputRule, Inputs, predict

R1_SIGMA = 0.01  # approximate R1 (APT): the real sample perturbed by this much noise, the logits' change penalised


class Discriminator(torch.nn.Module):
    """Logits [B] of latents at a noise level under a prompt: the trunk's last block's tokens, one linear layer, their
    mean. `calls` counts the training batches it has seen (the warm-up and the noise stream)."""

    def __init__(self, trunk: torch.nn.Module):
        super().__init__()
        self.trunk = trunk
        for m in (trunk.norm_out, trunk.proj_out):  # the trunk's own output layers feed no logit
            m.requires_grad_(False)
        trunk.scale_shift_table.requires_grad_(False)
        self.head = torch.nn.Linear(trunk.config.num_attention_heads * trunk.config.attention_head_dim, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Inputs, rule: InputRule) -> torch.Tensor:
        last: list[torch.Tensor] = []
        hook = self.trunk.blocks[-1].register_forward_hook(lambda _m, _i, out: last.append(out))
        try:
            predict(self.trunk, x, rule=rule)
        finally:
            hook.remove()
        return self.head(last[0].float()).mean(dim=(1, 2))


def build(student_config: dict, path: str | None) -> Discriminator:
    """The discriminator, its trunk shaped as the student and copied from `path` (--segment-disc-init)."""
    from stages.students.compact import build_student, init_from_teacher

    if not path:
        raise UserError("--segment-adversarial-weight needs --segment-disc-init PATH: the velocity student (its "
                        "student_ema folder) to start the discriminator's trunk from")
    trunk = build_student(student_config, "--student-config", 0)
    init_from_teacher(trunk, path, None, flag="--segment-disc-init")
    return Discriminator(trunk)


class AdversarialTerm:
    """The discriminator's loss and the student's adversarial term on one batch (per sample, [B], float32)."""

    def __init__(self, weight: float, r1: float, warmup: int):
        self.weight, self.r1, self.warmup = weight, r1, warmup

    @staticmethod
    def noise(codes: torch.Tensor, calls: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per sample: a level s = u^2 (u uniform in (0, 1): mostly low noise, where a student's output and the
        teacher's still differ), the re-noising noise and the R1 perturbation, from its own generator."""
        levels, eps, r1 = [], [], []
        for c in codes.tolist():
            g = torch.Generator().manual_seed(c * 1_000_003 + calls)
            levels.append(torch.rand((), generator=g).square())
            eps.append(torch.randn(like.shape[1:], generator=g))
            r1.append(torch.randn(like.shape[1:], generator=g))
        return tuple(torch.stack(t).to(like.device) for t in (levels, eps, r1))

    def terms(self, disc: Discriminator, real: torch.Tensor, fake: torch.Tensor, batch,
              autocast) -> dict[str, torch.Tensor]:
        """`real` and `fake` at sigma 0 [B, C, F, H, W]; `batch` gives the prompts, the timestep layout and each
        sample's noise seed (collate's crc32 of its key)."""
        s, eps, r1_noise = self.noise(batch.meta["sample"], int(disc.calls), real)
        disc.calls += 1
        level = s.view(-1, *[1] * (real.dim() - 1))
        renoise = lambda x: (1 - level) * x + level * eps  # noqa: E731 (flow matching's path, as the teacher's)
        t = s * 1000
        real_s, fake_s = renoise(real), renoise(fake)
        one = batch.inputs(fake_s, t)
        three = Inputs(torch.cat([real_s, fake_s.detach(), real_s + R1_SIGMA * r1_noise]), t.repeat(3),
                       one.text.repeat(3, 1, 1), condition=None if one.condition is None else one.condition.repeat(
                           3, *[1] * (one.condition.dim() - 1)))
        with autocast():  # real, detached fake and perturbed real in one forward
            logits = disc(three, batch.rule).float()
            frozen = {k: v.detach() for k, v in disc.named_parameters()}
            g_logits = torch.func.functional_call(disc, frozen, (one, batch.rule)).float()
        d_real, d_fake, d_pert = logits.chunk(3)
        terms = {"discriminator": nnf.softplus(-d_real) + nnf.softplus(d_fake) + self.r1 * (d_real - d_pert).pow(2)}
        on = float(self.weight) if int(disc.calls) > self.warmup else 0.0
        terms["adversarial"] = on * nnf.softplus(-g_logits)
        return terms
