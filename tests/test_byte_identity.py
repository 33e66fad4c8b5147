"""A refactor changes no byte the pipeline writes: the demo's flows at the tiny teacher's size (tests/byte_identity.py)
give the same sha256 for every file of the cache, the students and the exports as the record taken before it.

A change that is meant to alter what is written rewrites the record in the same commit
(`python -m tests.byte_identity record`) and says why, as a version bump would. The record names the environment it
was taken in (the libraries' versions, the CPU's widest instructions); on another, the test skips, naming what
differs: record on the commit before a change, then compare."""

from __future__ import annotations

import json

import pytest

import byte_identity as B

pytestmark = pytest.mark.slow


def test_caches_students_and_exports_are_byte_identical_to_the_record(tmp_path):
    want = json.loads(B.RECORD.read_text())
    recorded, here = want.pop("environment", None), B.environment()
    if recorded != here:
        differs = {k: (recorded or {}).get(k) for k in here if (recorded or {}).get(k) != here[k]}
        pytest.skip(f"the record was taken under {differs}, this machine has "
                    f"{ {k: here[k] for k in differs} }: its bytes cannot be compared here; run "
                    "`python -m tests.byte_identity record` on the commit before a change, then this test")
    got = B.run_flows(tmp_path)
    for what in want:
        assert got[what].keys() == want[what].keys(), f"{what}: other files"
        changed = sorted(f for f in want[what] if got[what][f] != want[what][f])
        assert not changed, f"{what}: these files changed: {changed}"
