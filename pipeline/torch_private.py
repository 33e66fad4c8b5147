"""torch's private internals that WanDistiller uses, in one place, each read in the torch versions CHECKED names:
`internal` refuses in one line when one has moved; tests/test_private_adapters.py checks them (and the copy of
`DefaultLoadPlanner.load_bytes` below). Imported only by code that already runs torch."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import time

CHECKED = ("2.13",)  # torch major.minor versions these internals were read in
_ELASTIC = "torch.distributed.elastic.multiprocessing.errors"
INTERNALS = {  # every private name used below: (module, attribute path)
    "error_file_path": (_ELASTIC, "ErrorHandler._get_error_file_path"),
    "write_error_file": (_ELASTIC, "ErrorHandler._write_error_file"),
    "new_shared": ("torch", "UntypedStorage._new_shared"),
    "storage_info": ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # a DCP index's storage_data entries
    "set_element": ("torch.distributed.checkpoint._traverse", "set_element"),
}
# sha256 of the source of torch's DefaultLoadPlanner.load_bytes, which `planner_loading_with` copies with its own load.
LOAD_BYTES_SHA256 = "666701f9808c4bc29122aea82f71239bcbe5bfed8a21445f3818ef969d0dec75"


def internal(name: str):
    """The private name INTERNALS lists as `name`; RuntimeError in one line when this torch has moved it."""
    import torch

    module, attr = INTERNALS[name]
    obj = importlib.import_module(module)
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise RuntimeError(f"torch {torch.__version__} has no {module}.{attr}, which WanDistiller uses (checked "
                           f"with torch {', '.join(CHECKED)}); install one of those or update "
                           "pipeline/torch_private.py") from None
    return obj


def write_error_file(text: str) -> None:
    """`text` into torch elastic's per-worker error file, which torchrun's summary prints (torch writes a traceback)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    handler = ErrorHandler()
    path = internal("error_file_path")(handler)
    if path:
        info = {"py_callstack": text, "timestamp": str(int(time.time()))}
        internal("write_error_file")(handler, path, json.dumps({"message": {"message": text, "extraInfo": info}}))


def shared_bytes(nbytes: int):
    """A uint8 tensor of `nbytes` in shared memory (what a loader worker collates into: no copy to the trainer)."""
    import torch

    storage = internal("new_shared")(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]


def planner_loading_with(load):
    """DCP's DefaultLoadPlanner reading each non-tensor value with `load(planner, read_item, value)`, not torch.load."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    source = inspect.getsource(DefaultLoadPlanner.load_bytes)
    if hashlib.sha256(source.encode()).hexdigest() != LOAD_BYTES_SHA256:
        raise RuntimeError(f"torch {torch.__version__} changed DefaultLoadPlanner.load_bytes, which WanDistiller "
                           f"copies (checked with torch {', '.join(CHECKED)}); install one of those or update "
                           "pipeline/torch_private.py")
    set_element = internal("set_element")

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = load(self, read_item, value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()
