"""`--placement disk` (`--offload-dir`, default CACHE_DIR/offload): each expert streamed block by block from its
own folder of safetensors files (../group_offload.py)."""

from __future__ import annotations

from ..group_offload import load_disk_expert
from .base import ENCODER_FREED, Layout, PlacementKind, PlanInput


class Disk(PlacementKind):

    def load_expert(self, p, spec, comp, log=print):
        return load_disk_expert(spec, comp, p.torch_dtype, p.device, p.offload_dir, log)

    def layout(self, x: PlanInput) -> Layout:
        both, block_ram = sum(x.needs.experts), x.needs.block + x.needs.other
        if not x.inv.gpus:
            where = {"text_encoder": f"cpu, {ENCODER_FREED}"}
            where |= {e: "offload folder (disk), one block at a time in RAM" for e in x.sizes.experts}
            return Layout(where, dict(disk=both, cpu=block_ram + x.needs.activations), max(x.needs.experts))
        where = {"text_encoder": f"cpu, moved to cuda:0 as a whole to encode (model offload), {ENCODER_FREED}"}
        where |= {e: "offload folder (disk), one block at a time in RAM and on cuda:0" for e in x.sizes.experts}
        return Layout(where, dict(disk=both, cpu=block_ram) | {"cuda:0": x.needs.block_streaming_gpu},
                      max(x.needs.experts))
