"""The work units `make test` hands its xdist workers (tests/conftest.py) name modules that exist:
a renamed module would quietly leave its unit, and its session model would load twice."""
from __future__ import annotations

from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_named_by_a_unit_or_the_order_exists():
    named = [m for modules in conftest.SHARED_UNITS.values() for m in modules]
    named += [key for key in conftest.LONGEST_FIRST if key not in conftest.SHARED_UNITS]
    missing = [m for m in named if not (ROOT / m).is_file()]
    assert not missing, missing
    assert len(set(named)) == len(named), "a module is named twice"


def test_a_units_modules_share_one_scope_and_the_rest_are_their_own():
    assert conftest.work_unit("tests/model/test_logits.py::test_x[a]") == "real model, float32"
    assert conftest.work_unit("tests/integration/test_openai_sdk.py::test_y") == "engine process"
    assert conftest.work_unit("tests/unit/test_heap.py::test_z") == "tests/unit/test_heap.py"
