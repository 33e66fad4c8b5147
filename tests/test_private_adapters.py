"""Each library's private internals sit behind one adapter (pipeline/torch_private.py, pipeline/diffusers_private.py,
cache/zarr_private.py) that names the versions it was read in. These tests fail loudly on an upgrade: a version
outside CHECKED (re-read the internals, then widen it), an internal gone, or torch's copied code changed."""

from __future__ import annotations

import hashlib
import inspect

import numpy as np
import pytest
import torch
import zarr

from cache import zarr_private
from pipeline import diffusers_private, torch_private


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


@pytest.mark.parametrize("library, adapter", [(torch, torch_private), ("diffusers", diffusers_private),
                                              (zarr, zarr_private)])
def test_the_installed_version_is_one_the_adapter_was_checked_with(library, adapter):
    if isinstance(library, str):
        library = __import__(library)
    assert _minor(library.__version__) in adapter.CHECKED, (
        f"{library.__name__} {library.__version__} is not among the versions {adapter.__name__} was checked with "
        f"({', '.join(adapter.CHECKED)}): re-read the internals it names against this version, then add it")


@pytest.mark.parametrize("adapter", [torch_private, diffusers_private])
def test_every_private_name_is_still_there(adapter):
    for name in adapter.INTERNALS:
        adapter.internal(name)  # RuntimeError naming it otherwise


def test_a_moved_internal_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(torch_private.INTERNALS, "set_element", ("torch", "no_such_thing"))
    with pytest.raises(RuntimeError, match=r"^torch \S+ has no torch\.no_such_thing, which WanDistiller uses"):
        torch_private.internal("set_element")
    monkeypatch.setattr(diffusers_private, "INTERNALS", ("_NOPE",))
    with pytest.raises(RuntimeError, match=r"^diffusers \S+ has no diffusers\.hooks\.group_offloading\._NOPE, "):
        diffusers_private.internal("_NOPE")


def test_torchs_load_bytes_is_still_the_one_the_safe_planner_copies():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    source = inspect.getsource(DefaultLoadPlanner.load_bytes)
    assert hashlib.sha256(source.encode()).hexdigest() == torch_private.LOAD_BYTES_SHA256, (
        "torch's DefaultLoadPlanner.load_bytes changed: copy its new body into torch_private.planner_loading_with "
        f"(with the caller's load) and record its sha256:\n{source}")


def test_diffusers_module_groups_still_record_their_file_and_keys():
    from diffusers.hooks.group_offloading import ModuleGroup

    source = inspect.getsource(ModuleGroup.__init__)
    assert [a for a in diffusers_private.GROUP_ATTRIBUTES if f"self.{a}" not in source] == []
    assert torch.nn.Linear in diffusers_private.leaf_layers()


def test_shared_bytes_are_shared():
    t = torch_private.shared_bytes(10)
    assert t.shape == (10,) and t.dtype == torch.uint8 and t.is_shared()


def test_the_elastic_error_file_gets_our_record(tmp_path, monkeypatch):
    import json

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    torch_private.write_error_file("error: one line")
    record = json.loads(path.read_text())["message"]
    assert record["message"] == "error: one line" and record["extraInfo"]["py_callstack"] == "error: one line"


def test_zarr_puts_a_row_in_the_file_chunk_file_names(tmp_path):
    g = zarr.open_group(str(tmp_path / "z"), mode="w")
    arr = g.create_array("lat", shape=(6, 2, 3), dtype="float32", chunks=(1, 2, 3), shards=(2, 2, 3),
                         chunk_key_encoding=zarr_private.FLAT_KEYS)
    arr[5] = np.ones((2, 3), dtype="float32")
    written = sorted(p.relative_to(tmp_path / "z").as_posix() for p in (tmp_path / "z").rglob("c*"))
    assert written == [zarr_private.chunk_file(arr, 5)] == ["lat/c.2.0.0"]
