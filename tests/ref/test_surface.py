"""What ``help(hla_ref)`` and ``import hla_ref.published`` show a reader: a clean public surface."""

import pydoc
import types

import numpy as np
import pytest

import hla_ref
from hla_ref import published


def _public(module):
    return {name for name in vars(module) if not name.startswith("_")}


def test_help_shows_types_not_forward_references():
    for module in (hla_ref, published, hla_ref.second_order, hla_ref.third_order, hla_ref.asymmetric):
        text = pydoc.render_doc(module, renderer=pydoc.plaintext)
        assert "ForwardRef" not in text, module.__name__


STATE_TUPLES = [hla_ref.HLA2State, hla_ref.HLA2CompactState, hla_ref.HLA2Segment, hla_ref.AHLAState,
                hla_ref.AHLASegment, hla_ref.HLA3State, hla_ref.HLA3PaperState, hla_ref.HLA3Segment,
                hla_ref.HLA3PaperSegment]


@pytest.mark.parametrize("cls", STATE_TUPLES, ids=lambda c: c.__name__)
def test_state_tuple_fields_are_annotated_with_types(cls):
    for where in (cls.__annotations__, cls.__new__.__annotations__):
        assert list(where) == list(cls._fields)
        assert all(t in (np.ndarray, float) for t in where.values()), where


def test_published_exports_exactly_its_formulas():
    assert _public(published) == set(published.__all__)
    assert all(name.endswith("_published") for name in published.__all__)


def test_hla_ref_public_names_are_all_and_its_submodules():
    assert all(hasattr(hla_ref, name) for name in hla_ref.__all__)
    extra = _public(hla_ref) - set(hla_ref.__all__)
    assert all(isinstance(getattr(hla_ref, n), types.ModuleType)
               and getattr(hla_ref, n).__name__.startswith("hla_ref.") for n in extra), extra
