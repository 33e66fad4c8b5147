"""How stage two lays the student over the ranks (`train-student --strategy`): the one module a new strategy
starts in. docs/architecture.md "Strategies" and "Extension points", docs/multi-gpu.md."""

from __future__ import annotations

import contextlib
import hashlib
import math
import warnings
from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.distributed as dist

from pipeline.registries import STRATEGIES, StrategyCaps
from pipeline.runtime import DistEnv
from stages.students.student_kind import StudentKind, trained_parameters

from . import checkpoint
from .comm import all_gather_bytes
from .objective_base import WithHeads


def get_strategy(name: str, env: DistEnv, device: torch.device, mixed: torch.dtype | None) -> Strategy:
    """The strategy declared as `name` (its module imported now), for this rank."""
    entry = STRATEGIES[name]
    strategy = entry.load()(env, device, mixed)
    strategy.name, strategy.caps = entry.name, entry.caps
    return strategy


def state_sha(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names and bytes, in name order."""
    return items_sha(sorted(state.items()))


def items_sha(items) -> str:
    """sha256 over (name, tensor) pairs' names and bytes, in the order given (each tensor let go once hashed)."""
    h = hashlib.sha256()
    for k, v in items:
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Strategy:
    """One way of laying the student, its gradients, optimizer state and EMA over the ranks. A strategy implements
    - `wrap(model, heads, student: StudentKind)`: lay the student (built on the CPU) and the heads on the device as it
      trains them, before the optimizer is built; returns the module forward and backward run through (None: the
      student);
    - `accumulate(last)`: the context of one micro-step's forward and backward (`last`: the optimizer step's last
      one), holding back the gradient reduction until then where the strategy does;
    - `save_checkpoint(out, step, ema, optimizer, trainer_state, keep)`: write checkpoint `step` (every rank calls it);
    - `load_checkpoint(path, optimizer)`: restore weights, heads and optimizer; returns (trainer state, EMA tensors);
    - `ema_weights(ema)`: a context with the EMA weights (diffusers' EMAModel `ema`) in the student, the trained ones
      after;
    - `full_model(ema=None)`: a context giving rank 0 the student with its full weights (the EMA's when `ema` is
      given), for `save_pretrained`, and None the other ranks; every rank enters it;
    - `weights_sha()`: sha256 of the student's full weights, the same on every rank (checked to agree where
      replicated);
    and where it differs from the defaults below, `reduce_gradients`, `clip_grad_norm` and `inference`."""

    name: str  # its declared name and capabilities (set by get_strategy)
    caps: StrategyCaps
    # Every forward is a collective (all-gathers of weights): every rank must run the same forwards, in held-out
    # evaluation and validation by sampling too.
    lockstep: ClassVar[bool] = False
    # wrap() gives every rank rank 0's weights (DDP broadcasts them), so rank 0 alone initialises from a teacher.
    syncs_init: ClassVar[bool] = True

    def __init__(self, env: DistEnv, device: torch.device, mixed: torch.dtype | None):
        self.env, self.device, self.mixed = env, device, mixed
        self.model: torch.nn.Module | None = None
        self.heads: torch.nn.Module | None = None
        self.student: StudentKind | None = None  # the kind of `model` (set by wrap)

    def reduce_gradients(self) -> None:
        """After the last micro-step's backward: reduce any gradients the wrapping does not."""

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the gradients of `params` to a global norm of `max_norm`; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def inference(self) -> contextlib.AbstractContextManager:
        """Around forwards outside the training step's autocast (validation by sampling)."""
        return contextlib.nullcontext()


class DDP(Strategy):
    """A full replica per rank; DistributedDataParallel averages the gradients (no wrapping for one process)."""

    ddp: torch.nn.parallel.DistributedDataParallel | None = None

    def wrap(self, model, heads, student):
        self.model, self.heads, self.student = model.to(self.device), heads, student
        if heads is not None:
            heads.to(self.device)
        if self.env.world_size > 1:  # broadcasts rank 0's weights to every rank
            # Frozen weights (a LoRA student's base, read from the same teacher files on every rank) are neither
            # broadcast nor reduced: only the trained parameters are DDP's.
            module = model if heads is None else WithHeads(model, heads)
            if frozen := [k for k, p in module.named_parameters() if not p.requires_grad]:
                torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False, gradient_as_bucket_view=True)
        return self.ddp

    def accumulate(self, last):
        return contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()

    def save_checkpoint(self, out, step, ema, optimizer, trainer_state, keep):
        if self.env.is_main:
            checkpoint.save(out, step, self.student.checkpoint_state(self.model), ema, optimizer, trainer_state, keep,
                            self.heads)

    def load_checkpoint(self, path, optimizer):
        return checkpoint.load(path, lambda t: self.student.load_checkpoint_state(self.model, t), optimizer,
                               self.device, self.heads)

    @contextlib.contextmanager
    def ema_weights(self, ema) -> Iterator[None]:
        params = [p for _, p in trained_parameters(self.model)]
        ema.store(params)  # the trained weights wait in host memory
        ema.copy_to(params)
        try:
            yield
        finally:
            ema.restore(params)

    @contextlib.contextmanager
    def full_model(self, ema=None) -> Iterator[torch.nn.Module | None]:
        with self.ema_weights(ema) if ema is not None and self.env.is_main else contextlib.nullcontext():
            yield self.model if self.env.is_main else None

    def weights_sha(self) -> str:
        sha = state_sha(self.model.state_dict())
        shas = [x.decode() for x in all_gather_bytes(sha.encode(), self.device)]
        if len(set(shas)) != 1:
            raise RuntimeError(f"ranks ended with different weights ({[x[:12] for x in shas]}); this is a bug")
        return sha


class FSDP(Strategy):
    """PyTorch FSDP2: weights, gradients, AdamW moments and EMA sharded over the ranks, a unit per block."""
    lockstep = True
    syncs_init = False  # nothing is broadcast: every rank builds (and initialises) the same student, then shards it
    policy = False  # the bf16 MixedPrecisionPolicy is on (set by wrap)

    def wrap(self, model, heads, student):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():  # one process: FSDP still wants a process group (of one)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        kw = {"mesh": init_device_mesh(self.device.type, (self.env.world_size,))}
        self.student = student
        self.policy = self.mixed == torch.bfloat16 and student.bf16_policy
        if self.policy:
            # Gather and compute in bf16, keep the float32 shards as master weights and reduce gradients in
            # float32. Inputs keep their dtype (autocast casts what it casts, as under ddp): bf16 holds integers
            # exactly only up to 256, and timesteps run to 1000.
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)
        # The transformer's output is a view (its final reshape); no objective changes it in place, which is
        # what FSDP2 warns about on every forward.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        student.shard(model, **kw)  # a unit per block (of each expert, and one per expert for the rest)
        fully_shard(model, **kw)  # the root: patch and condition embedders, output norm and projection
        # fully_shard moved each unit's shards to the mesh's device; the heads are whole on every rank
        self.model, self.heads = model, heads
        if heads is not None:
            heads.to(self.device)
        self.container = model if heads is None else WithHeads(model, heads)  # one module for the optimizer's names
        return None

    def accumulate(self, last):
        # Every micro-step's gradients are reduce-scattered and summed into the shards. Holding the reduction back
        # to the last micro-step (set_requires_gradient_sync(False), DDP's no_sync) would keep every block's full
        # float32 gradient on every rank in between: 4 bytes per parameter, a quarter of what sharding saves, in
        # the runs that accumulate because memory is short. The price is one reduce-scatter per micro-step.
        return contextlib.nullcontext()

    def inference(self):
        # Under the bf16 policy the gathered weights are bf16 whatever runs them: float inputs need autocast
        # (the training step has it); under ddp the sampler runs in the weights' float32 (a LoRA student: as ddp).
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.policy else contextlib.nullcontext()

    def _shards(self) -> list[torch.nn.Parameter]:
        """The student's parameters as the shards they are trained as. The root unit keeps its full weights after
        a forward (FSDP2 expects a backward to need them), and a forward without one (evaluation, validation)
        leaves them there, registered in place of the shards and used as they are by the next forward: so every
        unit is resharded before the parameters are read or swapped, and after a swap."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return list(self.model.parameters())

    def reduce_gradients(self) -> None:
        if self.heads is None or self.env.world_size == 1:
            return
        for _, p in trained_parameters(self.heads):
            if p.grad is None:  # unused on this rank: a zero contribution, and the collective still matches
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(self.env.world_size)

    def clip_grad_norm(self, params, max_norm):
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        sharded = [g for g in grads if isinstance(g, DTensor)]
        whole = [g for g in grads if not isinstance(g, DTensor)]
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        for group in (sharded, whole):  # DTensors and plain tensors do not mix in one norm
            if group:
                norm = torch.nn.utils.get_total_norm(group)
                if isinstance(norm, DTensor):
                    norm = norm.full_tensor()  # the sum over every rank's shard
                square = square + norm.float().square()
        total = square.sqrt()
        # clip_grad_norm_'s coefficient
        if math.isfinite(max_norm) and (coef := min(float(max_norm / (total + 1e-6)), 1.0)) < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def _options(self):
        """torch.distributed.checkpoint.state_dict's options: the frozen parameters (a LoRA student's base, read again
        from the teacher at every start) are neither saved nor loaded; the checkpoint must hold every trained one
        (dcp.load refuses a key it lacks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = any(not p.requires_grad for p in self.model.parameters())
        return StateDictOptions(ignore_frozen_params=True, strict=not frozen)

    def save_checkpoint(self, out, step, ema, optimizer, trainer_state, keep):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._shards()
        # this rank's shards, no copies
        model_state, optim_state = get_state_dict(self.container, optimizer, options=self._options())
        state = {checkpoint.DCP_MODEL: model_state, checkpoint.DCP_OPTIMIZER: optim_state}
        if ema is not None:
            state[checkpoint.DCP_EMA] = ema
        checkpoint.save_sharded(out, step, state, trainer_state, keep, self.env, self.device)

    def load_checkpoint(self, path, optimizer):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        options = self._options()
        model_state, optim_state = get_state_dict(self.container, optimizer, options=options)  # the shards to fill
        state = {checkpoint.DCP_MODEL: model_state, checkpoint.DCP_OPTIMIZER: optim_state}
        ema = None
        index = checkpoint.read_index(path)  # unpickled safely, once: DCP is handed this object, never the file
        if checkpoint.DCP_EMA in checkpoint.sharded_keys(path, index):
            ema = state[checkpoint.DCP_EMA] = {k: p.detach().clone() for k, p in trained_parameters(self.model)}
        checkpoint.load_sharded(path, state, index)
        set_state_dict(self.container, optimizer, model_state_dict=state[checkpoint.DCP_MODEL],
                       optim_state_dict=state[checkpoint.DCP_OPTIMIZER], options=options)
        return checkpoint.read_state(path), ema

    @contextlib.contextmanager
    def ema_weights(self, ema) -> Iterator[None]:
        params = [p for p in self._shards() if p.requires_grad]  # the EMA's: the trained ones
        kept = [p.detach().clone() for p in params]  # this rank's shards: 1/world of the student, on the device
        try:
            with torch.no_grad():
                for p, s in zip(params, ema.shadow_params):
                    p.copy_(s)
            yield
        finally:
            self._shards()  # no unit may keep full EMA weights for the next training forward
            with torch.no_grad():
                for p, k in zip(params, kept):
                    p.copy_(k)

    @contextlib.contextmanager
    def full_model(self, ema=None) -> Iterator[torch.nn.Module | None]:
        # The EMA weights stay swapped in until the caller is done: with one rank the gathered tensors are the
        # shards themselves, which the swap's end overwrites.
        with self.ema_weights(ema) if ema is not None else contextlib.nullcontext():
            self._shards()
            yield self.student.gathered(self.model, self.env.is_main)  # (a LoRA student's: its adapters alone)

    def weights_sha(self) -> str:
        """`state_sha` of the full weights, one tensor gathered at a time (a LoRA student's base is the teacher's
        whole transformer: never all of it at once in rank 0's memory)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.tensor import DTensor

        self._shards()
        held = sorted(get_model_state_dict(self.model).items())  # as held: shards as DTensors, whole buffers
        gathered = ((k, v.full_tensor() if isinstance(v, DTensor) else v) for k, v in held)
        sha = items_sha(gathered)  # every rank takes part in each gather, in the same order
        return all_gather_bytes(sha.encode(), self.device)[0].decode()
