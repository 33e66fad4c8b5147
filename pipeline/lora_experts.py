"""The LoRA student as one model (`LoraExperts`, docs/lora.md): the teacher's transformer(s), frozen, with peft
adapters, called like one transformer; `load` rebuilds it through diffusers' own LoRA loader."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from cache import safe_open, safe_write

from .artifact import LORA_JSON, LoraRecord, tensor_mismatch
from .model_call import forward
from .user_error import UserError

COMPONENTS = ("transformer", "transformer_2")  # expert 1 (high noise), expert 2 (low noise)
ADAPTER = "default"  # the adapter's name inside each expert (peft's default)
# A block's modules: diffusers' names -> the original Wan code's, which ComfyUI's Wan model keeps and diffusers' own
# Wan LoRA converter (lora_conversion_utils' `_convert_non_diffusers_wan_lora_to_diffusers`) reads back.
WAN_NAMES = {f"{a}.{d}": f"{w}.{o}" for a, w in (("attn1", "self_attn"), ("attn2", "cross_attn"))
             for d, o in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"))}
WAN_NAMES |= {"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


def add_adapter(model: torch.nn.Module, rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    """A peft LoRA adapter on `model`'s `targets`, the base frozen, the adapter in float32 (AdamW's master weights)."""
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=True),
                      adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)


class LoraExperts(torch.nn.Module):
    """Frozen Wan transformers with adapters called like one: each sample goes to the expert of its timestep."""

    def __init__(self, experts: dict[str, torch.nn.Module], boundary_timestep: float | None, record: LoraRecord):
        super().__init__()
        self.experts = torch.nn.ModuleDict(experts)
        self.boundary_timestep = boundary_timestep
        self.record = record
        # Under --strategy fsdp (set by lora_student.py's `shard`) every expert runs in every forward, in the same
        # order on every rank: its units' gathers and gradient reductions are collectives (`_every_expert`).
        self.every_expert = False

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.experts.values())).dtype

    def enable_gradient_checkpointing(self) -> None:
        for m in self.experts.values():
            m.enable_gradient_checkpointing()

    def _groups(self, timestep: torch.Tensor) -> list[tuple[str, torch.Tensor | None]]:
        """(expert, the batch rows it runs, None for all of them) for each expert with rows."""
        if self.boundary_timestep is None:
            return [(next(iter(self.experts)), None)]
        t = timestep if timestep.ndim == 1 else timestep[:, -1]  # (per token: the last's; frame 0's may be at 0)
        high = t >= self.boundary_timestep
        if bool(high.all()) or not bool(high.any()):
            return [(COMPONENTS[0] if bool(high.all()) else COMPONENTS[1], None)]
        return [(COMPONENTS[0], high.nonzero().flatten()), (COMPONENTS[1], (~high).nonzero().flatten())]

    def forward(self, hidden_states, timestep, encoder_hidden_states, attention_kwargs=None, return_dict=False):
        groups = self._groups(timestep)
        missing = [c for c, _ in groups if c not in self.experts]
        if missing:
            raise RuntimeError(f"a sample for {missing[0]}, which this LoRA student does not hold (--lora-experts)")
        inputs = (hidden_states, timestep, encoder_hidden_states, attention_kwargs)
        if self.every_expert:
            return (self._every_expert(groups, inputs),)
        out = self._merge(groups, [self._run(comp, rows, inputs) for comp, rows in groups], hidden_states.shape[0])
        if torch.is_grad_enabled():
            # An expert without a sample in this micro-batch still takes part in the backward, with zero gradients:
            # DDP then reduces every adapter at every step (no unused parameters to search for), and AdamW treats the
            # idle expert the same on one rank or many.
            used = {c for c, _ in groups}
            idle = [p for c, m in self.experts.items() if c not in used for p in m.parameters() if p.requires_grad]
            if idle:
                out = out + 0.0 * sum(p.sum() for p in idle)
        return (out,)

    def _run(self, comp: str, rows: torch.Tensor | None, inputs: tuple) -> torch.Tensor:
        """Expert `comp` on the batch `rows` (None: all of them)."""
        hidden_states, timestep, encoder_hidden_states, attention_kwargs = inputs
        pick = (lambda x: x) if rows is None else (lambda x: x.index_select(0, rows))  # noqa: E731
        return forward(self.experts[comp], pick(hidden_states), pick(timestep), pick(encoder_hidden_states),
                       attention_kwargs=attention_kwargs)

    @staticmethod
    def _merge(groups: list, outs: list[torch.Tensor], n: int) -> torch.Tensor:
        """The batch's prediction from each group's rows' (in `groups` order)."""
        out = outs[0]
        if len(outs) == 2:
            out = out.new_zeros((n, *out.shape[1:]))
            for (_, rows), o in zip(groups, outs):
                out = out.index_copy(0, rows, o)
        return out

    def _every_expert(self, groups: list, inputs: tuple) -> torch.Tensor:
        """FSDP's forward: every expert runs, in expert order, on every rank and in every forward, so that each rank
        gathers and reduces the same units in the same order. An expert without a sample runs on the first row, its
        output times 0.0 in the loss: exactly zero gradients, and its units' backward runs as on the other ranks."""
        rows_of = dict(groups)
        outs, idle = [], []
        for comp in self.experts:
            if comp in rows_of:
                outs.append(self._run(comp, rows_of[comp], inputs))
            else:
                idle.append(self._run(comp, torch.zeros(1, dtype=torch.long, device=inputs[0].device), inputs))
        out = self._merge(groups, outs, inputs[0].shape[0])  # (`groups` and the experts are both in expert order)
        if torch.is_grad_enabled():
            for o in idle:
                out = out + 0.0 * o.sum()
        return out

    def adapter_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each trained expert's adapter, whole and in host memory (FSDP: every rank calls this, to gather)."""
        from peft.utils import get_peft_model_state_dict

        states = {}
        for comp, model in self.experts.items():
            state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
            states[comp] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().contiguous()
                            for k, v in state.items()}  # (a DTensor's `full_tensor` is the gather)
        return states

    def save_pretrained(self, folder, safe_serialization: bool = True,
                        states: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Each expert's adapter in diffusers' LoRA format (with its LoraConfig as metadata, so that alpha comes back),
        and `lora.json`. `states`: `adapter_states()`, gathered beforehand (FSDP: on every rank, rank 0 writes)."""
        from diffusers import WanPipeline

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        states = self.adapter_states() if states is None else states
        for comp, model in self.experts.items():
            # peft keeps e.g. target_modules as a set, which diffusers writes in the process's string-hash order
            # (PYTHONHASHSEED): sorted, the same run writes the same bytes.
            metadata = {k: sorted(v) if isinstance(v, set) else v
                        for k, v in model.peft_config[ADAPTER].to_dict().items()}
            WanPipeline.save_lora_weights(folder, transformer_lora_layers=states[comp],
                                          weight_name=self.record.files[comp],
                                          transformer_lora_adapter_metadata=metadata)
            _sort_metadata(folder / self.record.files[comp])
        safe_write.write_json(folder / LORA_JSON, self.record.to_json(), indent=1)


def wan_state(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """An adapter file's tensors in diffusers' keys (`transformer.blocks.N.attn1.to_q.lora_A.weight`) under the
    original Wan key names (`diffusion_model.blocks.N.self_attn.q.lora_down.weight`, `.lora_up.weight`, `.alpha`)."""
    out = {}
    for key, v in state.items():
        m = re.fullmatch(r"transformer\.blocks\.(\d+)\.(.+)\.lora_([AB])\.weight", key)
        if m is None or m[2] not in WAN_NAMES:
            raise UserError(f"lora-format wan: the adapter on {key.removeprefix('transformer.').split('.lora_')[0]} "
                            "has no Wan key name (a block's attention and FFN have); use --lora-format diffusers")
        module = f"diffusion_model.blocks.{m[1]}.{WAN_NAMES[m[2]]}"
        out[f"{module}.lora_{'down' if m[3] == 'A' else 'up'}.weight"] = v
        out[f"{module}.alpha"] = torch.tensor(float(alpha))  # (the update is scaled by alpha / rank, as peft's)
    return out


def _sort_metadata(path: Path) -> None:
    """Rewrite the safetensors file `path` with its header's `__metadata__` keys sorted: safetensors (Rust) keeps them
    in a HashMap seeded anew in every process, so their order, and the file's bytes, change from run to run."""
    raw = safe_open.read_bytes(path.parent, path.name)  # (the file diffusers just wrote)
    n = int.from_bytes(raw[:8], "little")
    header = safe_open.parse_json(raw[8:8 + n], path)
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # (safetensors pads the header to 8 bytes with spaces)
    safe_write.write_file(path, len(text).to_bytes(8, "little") + text + raw[8 + n:])


def check_files(root: Path, folder: str, record: LoraRecord, base: torch.nn.Module) -> None:
    """Refuse LoRA files (ROOT/FOLDER/each of `record.files`, their headers alone, bounded) that are not what the
    record says: exactly the lora_A and lora_B of every linear module of `base` (the teacher's transformer, on the meta
    device) that its `targets` name (peft's rule: the module's name, or its last dotted parts), of its `rank`."""
    want = {}
    for name, m in base.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in record.targets):
            want[f"transformer.{name}.lora_A.weight"] = (record.rank, m.in_features)
            want[f"transformer.{name}.lora_B.weight"] = (m.out_features, record.rank)
    for comp, file in record.files.items():
        rel, fix = f"{folder}/{file}", "rerun the same train-student command, or pass another --student"
        found = {k: shape for k, (_, shape) in safe_open.safetensors_header(root, rel, fix).items()}
        if problem := tensor_mismatch(found, want):
            raise UserError(f"LoRA file {root / rel} is not the rank-{record.rank} adapter of "
                            f"{', '.join(record.targets)} its {LORA_JSON} describes ({problem}); {fix}")


def load(teacher: Path, folder: Path | dict[str, Path], record: LoraRecord, dtype: torch.dtype,
         device: torch.device) -> LoraExperts:
    """A trained LoRA student for inference: the teacher's experts, adapters from `folder` (or each expert's from its
    own folder: a pair of one-expert runs) by diffusers' loader."""
    from diffusers import WanPipeline, WanTransformer3DModel

    experts = {}
    for comp in record.experts:
        model = WanTransformer3DModel.from_pretrained(teacher / comp, torch_dtype=dtype, use_safetensors=True)
        if comp in record.files:
            where = folder[comp] if isinstance(folder, dict) else folder
            state, metadata = WanPipeline.lora_state_dict(str(where), weight_name=record.files[comp],
                                                          use_safetensors=True, return_lora_metadata=True)
            WanPipeline.load_lora_into_transformer(state, transformer=model, adapter_name=ADAPTER, metadata=metadata)
        experts[comp] = model.to(device).eval().requires_grad_(False)
    return LoraExperts(experts, record.boundary_timestep, record).eval()
