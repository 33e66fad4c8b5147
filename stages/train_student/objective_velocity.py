"""Distillation objectives: what stage two teaches the student (`train-student --objective NAME`), each an
`Objective` subclass declared in pipeline/registries.py (docs/architecture.md "Objectives")."""

from __future__ import annotations

import logging
from dataclasses import asdict, replace

import torch

from cache import format as F
from cache.schema import recorded_steps
from pipeline import guidance_input
from pipeline.errors import UserError
from pipeline.registries import CHOSEN, FeatureSettings, SegmentSettings, VelocitySettings
from pipeline.sampling import pseudo_huber

from .objective_base import (  # noqa: F401 (OBJECTIVES, check_cache, registered: importable from here, as the rest)
    OBJECTIVES, Batch, Objective, Outputs, block_output, check_cache, mse, registered,
)

log = logging.getLogger(__name__)
_ADVERSARIAL = ("adversarial_weight", "disc_init", "disc_r1", "disc_warmup")  # SegmentSettings' adversarial term


class Velocity(Objective):
    """The teacher's prediction at every cached step, by MSE: the student follows the teacher's trajectory
    step by step (and samples with the teacher's steps)."""

    Config = VelocitySettings
    fields = (F.T_X_T, F.T_TARGET)

    def __init__(self, settings: dict | None = None):
        super().__init__(settings)  # --target-guidance, --guidance-range unset: unrecorded, the record as before them
        self.settings = {k: list(v) if isinstance(v, tuple) else v for k, v in self.settings.items() if v is not None}
        if self.settings.keys() & {"target_guidance", "guidance_range"}:  # the two branches, not the guided prediction
            self.fields = (F.T_X_T, F.T_TARGET_COND, F.T_TARGET_UNCOND)

    def check(self, manifest: dict, cache: str) -> None:
        if len(mine := [k for k in ("target_guidance", "guidance_range") if k in self.settings]) > 1:
            raise UserError("--target-guidance learns one scale and --guidance-range a range of them: drop one")
        if mine and not manifest.cfg:
            raise UserError(f"--{mine[0].replace('_', '-')}: the cache {cache} was drawn without CFG (guidance "
                            f"{float(manifest.guidance):g}): it holds no unconditional prediction; rebuild it with "
                            "--guidance above 1 and --save-cond-uncond")

    def adapt(self, model: torch.nn.Module) -> torch.nn.Module:
        if "guidance_range" not in self.settings:
            return model
        if not hasattr(model, "condition_embedder"):
            raise UserError("--guidance-range trains a compact student (--student-config): a LoRA run's adapter files "
                            "have no place for the scale's embedding; use --target-guidance W, one LoRA a scale")
        return guidance_input.attach(model, *self.settings["guidance_range"])

    def record_fields(self, manifest: dict) -> dict:
        w = self.settings.get("target_guidance")
        return {} if w is None else {"guidance": w, "guidance_2": None if manifest.guidance_2 is None else w}

    def loss(self, model, batch, autocast, heads=None):
        if "guidance_range" in self.settings:  # each sample's scale, from its noise seed (the same on a resume)
            lo, hi = self.settings["guidance_range"]
            u = batch.meta["sample"].to(batch.x_t.device, torch.float64) / 2.0 ** 32
            batch = replace(batch, guidance_input=(lo + (hi - lo) * u).float())
        return super().loss(model, batch, autocast, heads)

    def terms(self, out: Outputs, batch: Batch, heads) -> dict[str, torch.Tensor]:
        f = batch.fields
        w = self.settings.get("target_guidance") if batch.guidance_input is None else \
            batch.guidance_input.view(-1, *[1] * (out.prediction.dim() - 1))
        target = f[F.T_TARGET] if w is None else \
            f[F.T_TARGET_UNCOND].float() + w * (f[F.T_TARGET_COND].float() - f[F.T_TARGET_UNCOND].float())
        return {"velocity": mse(out.prediction, target)}


class Segment(Objective):
    """Few-step distillation from the cached trajectories alone: at every cached state x_k the student learns the
    average velocity to its segment's end, so one Euler step from a boundary lands on the next and the student
    samples in K steps without CFG (docs/architecture.md "Objectives", docs/results.md)."""

    Config = SegmentSettings
    fields = (F.T_X_T,)

    def __init__(self, settings: dict | None = None):
        super().__init__(settings)  # a schedule choice left unset is not recorded (a default run's distill.json)
        self.settings = {k: list(v) if isinstance(v, tuple) else v for k, v in self.settings.items()
                         if v is not None or k not in CHOSEN}
        if self.settings.get("loss", "mse") == "mse":  # the default distance is not recorded: what ran before it
            self.settings = {k: v for k, v in self.settings.items() if k not in ("loss", "huber_c")}
        self.adversarial = None  # off (weight 0): its settings unrecorded, as before the term existed
        if not float(self.settings.get("adversarial_weight", 0.0)):
            self.settings = {k: v for k, v in self.settings.items() if k not in _ADVERSARIAL}
        else:
            from .adversarial import AdversarialTerm

            s = self.settings
            self.adversarial = AdversarialTerm(s["adversarial_weight"], s["disc_r1"], s["disc_warmup"])
        if float(self.settings.get("velocity_weight", 0.0)) > 0:
            self.fields = (F.T_X_T, F.T_TARGET)
        self.end_step: list[int] | None = None
        self.grid = None  # the boundaries on the cache's schedule (pipeline.sampling.StudentGrid), once checked

    @classmethod
    def from_config(cls, cfg) -> Objective:
        s = cfg.objective_settings
        if s.student_steps is None and s.student_timesteps is None and s.student_expert_steps is None:
            raise UserError("--objective segment needs --student-steps K (the student's sampling steps, 1 up to the "
                            "cache's steps; K dividing them reproduces the schedule exactly), or --student-timesteps")
        return super().from_config(cfg)

    @property
    def k(self) -> int:
        return int(self.settings["student_steps"])

    def check(self, manifest: dict, cache: str) -> None:
        from pipeline.sampling import chosen_boundaries, is_flow_matching, segment_boundaries, student_grid

        steps = int(manifest.steps)
        sigmas, sched = manifest.sigmas, manifest.scheduler
        chosen = any(self.settings.get(c) is not None for c in CHOSEN)
        if not chosen and not 1 <= self.k <= steps:
            raise UserError(f"--student-steps {self.k}: the cache {cache} holds {steps}-step trajectories; choose K "
                            f"from 1 to {steps} (a divisor of {steps} reproduces the schedule exactly)")
        if not (isinstance(sigmas, list) and len(sigmas) == steps):
            raise UserError(f"--objective segment needs every state's sigma, and the cache {cache} does not record "
                            f"them (sigmas in its manifest); rebuild it with this version's teacher-cache")
        if not is_flow_matching(sched):
            raise UserError(f"--objective segment needs a flow-matching teacher schedule; the cache {cache} was "
                            f"sampled with {sched.get('_class_name')!r} {sched.get('prediction_type', '')}")
        # (each trajectory's final latent: `open_caches` has checked every store's final_latents array)
        if chosen:  # K steps landing exactly on the chosen boundaries (pipeline/sampling.py `chosen_points`)
            try:
                bounds, exact = chosen_boundaries(manifest, self.settings, recorded_steps(manifest)), True
            except ValueError as e:
                raise UserError(f"--objective segment on the cache {cache}: {e}{rebuild_cost(manifest)}") from None
            self.settings["student_steps"] = len(bounds)
            self.grid = student_grid(manifest, self.settings)
            if self.grid.off > 1e-4:  # never a silent snap: the student trains and samples at the teacher's sigmas
                log.warning("the %s grid falls between the teacher's steps: the student trains and samples at the "
                            "teacher's sigmas %s, up to %.4f from the grid's %s", self.grid.spec or "chosen",
                            ",".join(f"{v:.4g}" for v in self.grid.sigmas), self.grid.off,
                            ",".join(f"{v:.4g}" for v in self.grid.wanted))
        else:
            bounds, exact = segment_boundaries(sched, steps, self.k, [float(v) for v in sigmas])
        if len(bounds) != self.k:
            raise UserError(f"--student-steps {self.k}: only {len(bounds)} distinct cached steps lie near the {self.k}-"
                            f"step schedule of the cache {cache}; choose a divisor of {steps}")
        if not chosen:
            _check_boundaries_recorded(self.k, bounds, manifest, cache, sched, [float(v) for v in sigmas])
            self.grid = student_grid(manifest, self.settings)
        if not exact:
            log.warning("--student-steps %d does not divide the cache's %d steps: segments end at the nearest cached "
                        "steps %s, which the %d-step scheduler does not hit exactly", self.k, steps, bounds, self.k)
        ends = bounds[1:] + [steps]
        self.end_step = [next(e for e in ends if e > k) for k in range(steps)]
        self.sigma_end = [([float(v) for v in sigmas] + [0.0])[e] for e in self.end_step]
        self.settings.update(boundaries=bounds, exact_schedule=exact)

    def dataset(self, index, embedding_cache_size: int):
        from .data import SegmentDataset

        if self.end_step is None:
            self.check(index.manifest, str(index.caches[0].path))
        return SegmentDataset(index, embedding_cache_size, self.fields, self.end_step)

    def terms(self, out: Outputs, batch: Batch, heads) -> dict[str, torch.Tensor]:
        from .data import SEGMENT_VELOCITY

        pred, target = out.prediction, batch.fields[SEGMENT_VELOCITY]
        seg = pseudo_huber(pred, target, float(self.settings["huber_c"])) \
            if self.settings.get("loss") == "pseudo-huber" else mse(pred, target)  # (mse, the default: unrecorded)
        start_w = float(self.settings.get("start_weight", 1.0))
        if start_w != 1.0:  # the states the K-step sampler starts its steps from weigh start_w, the others 1
            starts = torch.as_tensor(self.settings["boundaries"], device=seg.device)
            step = batch.meta["step"].to(seg.device)
            seg = seg * torch.where(torch.isin(step, starts), start_w, 1.0).to(seg.dtype)
        terms = {"segment": seg}
        w = float(self.settings.get("velocity_weight", 0.0))
        if w > 0:
            terms["velocity"] = w * mse(out.prediction, batch.fields[F.T_TARGET])
        return terms

    def student_steps(self, manifest: dict) -> int | None:
        return self.k

    def heads(self, student_config: dict, manifest: dict) -> torch.nn.Module | None:
        from .adversarial import build

        return None if self.adversarial is None else build(student_config, self.settings["disc_init"])

    def model_terms(self, out, batch: Batch, heads, autocast) -> dict[str, torch.Tensor]:
        """In training with --segment-adversarial-weight, the discriminator's loss and the student's adversarial term
        on the samples of the final segment (stages/train_student/adversarial.py)."""
        if self.adversarial is None or heads is None or not heads.training:
            return {}
        from .data import SEGMENT_VELOCITY

        sigma_end = torch.tensor(self.sigma_end, device=batch.x_t.device)[batch.meta["step"].to(batch.x_t.device)]
        span = (sigma_end - batch.meta["sigma"].to(sigma_end.device)).view(-1, *[1] * (batch.x_t.dim() - 1))
        real = batch.x_t + span * batch.fields[SEGMENT_VELOCITY]  # the cached segment end: the teacher's latent
        fake = batch.x_t + span * out.prediction.float()  # the student's
        last = (sigma_end == 0).float()  # the final segment's samples: their ends are clean latents
        return {k: v * last for k, v in self.adversarial.terms(heads, real, fake, batch, autocast).items()}


def _check_boundaries_recorded(k: int, bounds: list[int], manifest: dict, cache: str, sched: dict,
                               sigmas: list[float]) -> None:
    """A segment student starts its segments at cached states: refuse (one line) a cache recorded with
    --record-steps that lacks one of the K boundaries, naming the settings that would have them."""
    from pipeline.sampling import segment_boundaries

    recorded = recorded_steps(manifest)
    if not (missing := [b for b in bounds if b not in recorded]):
        return
    steps = int(manifest.steps)
    usable = [j for j in range(1, min(steps, 16) + 1)
              if set(segment_boundaries(sched, steps, j, sigmas)[0]) <= set(recorded)]
    made = (f"teacher-cache --record-steps {manifest.record_steps} --record-seed "
            f"{manifest.record_seed}"
            + (f" --keep-steps {','.join(map(str, manifest.keep_steps))}" if manifest.keep_steps else ""))
    raise UserError(f"--student-steps {k} starts its segments at steps {','.join(map(str, bounds))} of the cache "
                    f"{cache}, which records only steps {','.join(map(str, recorded))} ({made}), not "
                    f"{','.join(map(str, missing))}; rebuild it with --for-students "
                    f"{','.join([*(manifest.for_students or []), str(k)])} (or without "
                    f"--record-steps), or choose --student-steps {','.join(map(str, usable))}{rebuild_cost(manifest)}")


def rebuild_cost(manifest) -> str:
    """What making the cache again costs (every teacher step runs again, recorded or not), from the FLOP model on
    an H100 (pipeline/flops.py); '' for a cache that did not record the teacher's shape."""
    from pipeline.flops import teacher_step_seconds

    if manifest.teacher_shape is None:
        return ""
    (_, f, h, w), (pt, ph, pw) = manifest.latent_shape, manifest.patch_size
    seconds, _ = teacher_step_seconds(manifest.teacher_shape, (f // pt) * (h // ph) * (w // pw),
                                      manifest.max_sequence_length)
    steps = manifest.prompts * manifest.seeds_per_prompt * manifest.steps
    hours = steps * seconds / 3600
    return (f" (a rebuild runs its {steps:,} teacher steps again: about {hours:,.1f}" if hours >= 0.1 else
            f" (a rebuild runs its {steps:,} teacher steps again: about {hours:.2g}") + (" GPU-hours on an "
            "H100, the FLOP model's; `wandistiller plan --gpu NAME` prices another GPU)")


def parse_pairs(text) -> tuple[tuple[int, int], ...]:
    """"S:T,S:T" -> ((S, T), ...); ValueError with the expected form otherwise."""
    if isinstance(text, (list, tuple)):
        text = ",".join(str(x) for x in text)
    pairs = []
    for item in str(text or "").split(","):
        s, sep, t = item.strip().partition(":")
        if not sep or not s.strip().isdigit() or not t.strip().isdigit():
            raise ValueError(f"feature-pairs must look like 0:10,1:30 (student block:teacher block), got {text!r}")
        pairs.append((int(s), int(t)))
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"feature-pairs names a pair twice: {text!r}")
    return tuple(pairs)


class VelocityFeature(Objective):
    """The teacher's prediction plus its hidden states (docs/architecture.md "Feature distillation")."""

    Config = FeatureSettings
    fields = (F.T_X_T, F.T_TARGET, F.T_FEATURES)

    def __init__(self, settings: dict | None = None):
        super().__init__(settings)
        self.pairs = parse_pairs(self.settings["feature_pairs"])
        self.weight = float(self.settings["feature_weight"])
        self.outputs = ("prediction", *dict.fromkeys(block_output(s) for s, _ in self.pairs))
        self.rows: dict[int, int] = {}  # teacher block -> row of the cached features (set by heads())
        self.pool = "none"

    @classmethod
    def from_config(cls, cfg) -> VelocityFeature:
        settings = cfg.objective_settings
        if not settings.feature_pairs:
            raise UserError("--objective velocity+feature needs --feature-pairs S:T,... (student block:teacher block "
                            "recorded by teacher-cache --record-features)")
        pairs = ",".join(f"{s}:{t}" for s, t in parse_pairs(settings.feature_pairs))
        return cls({**asdict(settings), "feature_pairs": pairs})

    def heads(self, student_config: dict, manifest: dict) -> torch.nn.Module:
        recorded = [int(b) for b in manifest.record_features or []]
        if unknown := sorted({t for _, t in self.pairs} - set(recorded)):
            raise UserError(f"--feature-pairs names teacher block(s) {unknown} that the cache did not record (it holds "
                            f"blocks {recorded}); pair with those or rebuild the cache with --record-features")
        self.rows = {b: i for i, b in enumerate(recorded)}
        self.pool = manifest.feature_pool
        width = int(student_config["num_attention_heads"]) * int(student_config["attention_head_dim"])
        dim = int(manifest.feature_dim)
        return torch.nn.ModuleDict({f"{s}:{t}": torch.nn.Linear(width, dim) for s, t in self.pairs})

    def terms(self, out: Outputs, batch: Batch, heads) -> dict[str, torch.Tensor]:
        cached = batch.fields[F.T_FEATURES]  # [B, recorded blocks, tokens or 1, D]
        feature = 0
        for s, t in self.pairs:
            mine = heads[f"{s}:{t}"](out.blocks[s].float())  # [B, tokens, D]
            feature = feature + mse(mine.mean(1, keepdim=True) if self.pool == "mean" else mine,
                                    cached[:, self.rows[t]])
        return {"velocity": mse(out.prediction, batch.fields[F.T_TARGET]),
                "feature": self.weight * feature / len(self.pairs)}
