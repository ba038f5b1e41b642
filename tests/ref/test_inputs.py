"""Input handling of every public function: dtypes, empty input, and refused arguments."""

import subprocess
import sys

import numpy as np
import pytest

import hla_ref

from .helpers import func, random_qkv, rel_err

# Every public attention function: (module, name, takes gamma/normalize/eps, takes chunk_size,
# takes variant).
FUNCTIONS = [
    ("second_order", "hla2_naive", True, False, False),
    ("second_order", "hla2_stream", True, False, False),
    ("second_order", "hla2_scan", True, False, False),
    ("second_order", "hla2_chunked", True, True, False),
    ("asymmetric", "ahla_naive", True, False, False),
    ("asymmetric", "ahla_stream", True, False, False),
    ("asymmetric", "ahla_scan", True, False, False),
    ("asymmetric", "ahla_chunked", True, True, False),
    ("third_order", "hla3_naive", True, False, True),
    ("third_order", "hla3_stream", True, False, True),
    ("third_order", "hla3_scan", True, False, True),
    ("third_order", "hla3_chunked", True, True, True),
    ("baselines", "linear_attention", True, False, False),
    ("baselines", "softmax_attention", False, False, False),
    ("published", "hla2_stream_published", True, False, False),
    ("published", "hla2_scan_published", True, False, False),
    ("published", "ahla_scan_published", True, False, False),
]
IDS = [f[1] for f in FUNCTIONS]
WITH_GAMMA = [f for f in FUNCTIONS if f[2]]
# The operator forms take per-token gates; hla_ref.published (the paper as printed) does not.
WITH_GATES = [f for f in WITH_GAMMA if f[0] != "published"]
PUBLISHED = [f for f in WITH_GAMMA if f[0] == "published"]
WITH_CHUNK = [f for f in FUNCTIONS if f[3]]
WITH_VARIANT = [f for f in FUNCTIONS if f[4]]
ALL_IDS = lambda fs: [f[1] for f in fs]  # noqa: E731


def call(entry, Q, K, V, **kw):
    module, name, _, _, _ = entry
    return func(module, name)(Q, K, V, **kw)


def good(n=5, d=3, dv=2, dtype=np.float64):
    return random_qkv(31, n, d, dv, dtype)


# --- exports -------------------------------------------------------------------------------

EXPORTS = {
    "baselines": ["causal_mask", "softmax_attention", "linear_attention"],
    "scan": ["blelloch_scan"],
    "second_order": ["hla2_naive", "hla2_stream", "hla2_scan", "hla2_chunked", "HLA2State",
                     "HLA2CompactState", "HLA2Segment", "hla2_segment", "hla2_identity",
                     "hla2_combine"],
    "asymmetric": ["ahla_naive", "ahla_stream", "ahla_scan", "ahla_chunked", "AHLAState",
                   "AHLASegment", "ahla_segment", "ahla_identity", "ahla_combine"],
    "third_order": ["hla3_naive", "hla3_stream", "hla3_scan", "hla3_chunked", "HLA3State",
                    "HLA3PaperState", "HLA3Segment", "hla3_segment", "hla3_identity",
                    "hla3_combine", "HLA3PaperSegment", "hla3_paper_segment",
                    "hla3_paper_identity", "hla3_paper_combine"],
    "published": ["hla2_stream_published", "hla2_combine_published", "hla2_scan_published",
                  "ahla_combine_published", "ahla_scan_published"],
}


@pytest.mark.parametrize("module,name", [(m, n) for m, names in EXPORTS.items() for n in names
                                         if m != "published"])
def test_public_name_is_exported_from_the_package(module, name):
    assert getattr(hla_ref, name) is func(module, name)


@pytest.mark.parametrize("name", EXPORTS["published"])
def test_published_formulas_are_reachable_as_hla_ref_published(name):
    """The paper's (wrong) formulas live in hla_ref.published, reachable from the package."""
    assert callable(getattr(hla_ref.published, name))


def test_everything_in_all_exists():
    for name in hla_ref.__all__:
        assert hasattr(hla_ref, name), name


# --- dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_float32_input_gives_float32_output(entry, normalize):
    kw = {"normalize": normalize} if entry[2] else {}
    Q, K, V = good(dtype=np.float32)
    Q, K = np.abs(Q) + 0.1, np.abs(K) + 0.1  # keeps normalized denominators positive
    out32 = call(entry, Q, K, V, **kw)
    assert out32.dtype == np.float32
    assert out32.shape == (5, 2)
    # and it computes the same thing as float64, to float32 accuracy
    out64 = call(entry, Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64), **kw)
    assert rel_err(out32, out64) < 1e-4


@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_float64_input_gives_float64_output(entry):
    out = call(entry, *good())
    assert out.dtype == np.float64


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_mixed_float32_float64_gives_float64(entry, which):
    arrays = list(good(dtype=np.float32))
    arrays[which] = arrays[which].astype(np.float64)
    assert call(entry, *arrays).dtype == np.float64


# --- empty input -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_empty_sequence_gives_empty_output(entry, dtype):
    Q, K, V = good(n=0, d=3, dv=4, dtype=dtype)
    out = call(entry, Q, K, V)
    assert out.shape == (0, 4)
    assert out.dtype == dtype
    if entry[2]:
        assert call(entry, Q, K, V, normalize=True, gamma=0.5).shape == (0, 4)
    if entry[3]:
        assert call(entry, Q, K, V, chunk_size=3).shape == (0, 4)


# --- refused arrays --------------------------------------------------------------------------

def _replace(arrays, which, value):
    arrays = list(arrays)
    arrays["QKV".index(which)] = value
    return arrays


@pytest.mark.parametrize("shape", [(5,), (1, 5, 3), ()])
@pytest.mark.parametrize("which", ["Q", "K", "V"])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_wrong_ndim_is_refused(entry, which, shape):
    bad = np.ones(shape)
    with pytest.raises(ValueError, match=rf"\b{which}\b"):
        call(entry, *_replace(good(), which, bad))


@pytest.mark.parametrize("which,shape", [("K", (4, 3)), ("V", (6, 2)), ("K", (5, 2))])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_mismatched_shapes_are_refused(entry, which, shape):
    """Q is (5, 3): a K or V with another n, or a K with another d, is named in the error."""
    with pytest.raises(ValueError, match=rf"\b{which}\b"):
        call(entry, *_replace(good(), which, np.ones(shape)))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_, np.complex128])
@pytest.mark.parametrize("which", ["Q", "K", "V"])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_non_float_arrays_are_refused(entry, which, dtype):
    arrays = good()
    bad = np.ones(arrays["QKV".index(which)].shape, dtype=dtype)
    with pytest.raises(TypeError, match=rf"\b{which}\b"):
        call(entry, *_replace(arrays, which, bad))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["Q", "K", "V"])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_non_finite_values_are_refused(entry, which, value):
    arrays = [a.copy() for a in good()]
    arrays["QKV".index(which)][2, 1] = value
    with pytest.raises(ValueError, match=rf"\b{which}\b"):
        call(entry, *arrays)


# --- refused scalars -------------------------------------------------------------------------

@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5, 1.0 + 1e-12, np.nan, np.inf])
@pytest.mark.parametrize("entry", WITH_GAMMA, ids=ALL_IDS(WITH_GAMMA))
def test_gamma_out_of_range_is_refused(entry, gamma):
    with pytest.raises(ValueError, match="gamma"):
        call(entry, *good(), gamma=gamma)


@pytest.mark.parametrize("gamma", ["0.5", None, True, b"0.5"])
@pytest.mark.parametrize("entry", WITH_GAMMA, ids=ALL_IDS(WITH_GAMMA))
def test_gamma_of_wrong_type_is_refused(entry, gamma):
    with pytest.raises(TypeError, match="gamma"):
        call(entry, *good(), gamma=gamma)


# --- per-token gates: gamma as an array (n,) ----------------------------------------------------

@pytest.mark.parametrize("gamma", [[0.5] * 5, (0.5,) * 5, np.full(5, 0.5), [0.5], np.full(4, 0.5)])
@pytest.mark.parametrize("entry", PUBLISHED, ids=ALL_IDS(PUBLISHED))
def test_published_formulas_refuse_gate_arrays(entry, gamma):
    """The paper's formulas are printed for one constant gamma: an array is refused by name."""
    with pytest.raises(TypeError, match=r"gamma.*per-token"):
        call(entry, *good(), gamma=gamma)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: np.full(5, 0.5), id="float64"),
    pytest.param(lambda: np.full(5, 0.5, dtype=np.float32), id="float32"),
    pytest.param(lambda: np.full(5, 0.5, dtype=np.float16), id="float16"),
    pytest.param(lambda: [0.5] * 5, id="list"),
    pytest.param(lambda: (0.5,) * 5, id="tuple"),
])
@pytest.mark.parametrize("entry", WITH_GATES, ids=ALL_IDS(WITH_GATES))
def test_gate_arrays_of_any_float_kind_are_accepted(entry, make):
    assert np.array_equal(call(entry, *good(), gamma=make()), call(entry, *good(), gamma=0.5))


@pytest.mark.parametrize("gamma", [
    pytest.param(np.ones(5, dtype=np.int64), id="int64"),
    pytest.param(np.ones(5, dtype=np.int32), id="int32"),
    pytest.param(np.ones(5, dtype=bool), id="bool"),
    pytest.param(np.full(5, 0.5, dtype=object), id="object"),
    pytest.param(np.full(5, 0.5, dtype=np.complex128), id="complex"),
    pytest.param([1] * 5, id="list-of-ints"),
    pytest.param([True] * 5, id="list-of-bools"),
    pytest.param(["0.5"] * 5, id="list-of-str"),
    pytest.param([0.5, 0.5, None, 0.5, 0.5], id="list-with-None"),
])
@pytest.mark.parametrize("entry", WITH_GATES, ids=ALL_IDS(WITH_GATES))
def test_gate_arrays_of_non_float_dtype_are_refused(entry, gamma):
    with pytest.raises(TypeError, match="gamma"):
        call(entry, *good(), gamma=gamma)


@pytest.mark.parametrize("shape", [(4,), (6,), (0,), (5, 1), (1, 5), ()])
@pytest.mark.parametrize("entry", WITH_GATES, ids=ALL_IDS(WITH_GATES))
def test_gate_arrays_of_wrong_shape_are_refused(entry, shape):
    """Exactly one factor per token (n = 5 here): no broadcasting, and the message gives the
    expected shape with the actual n."""
    with pytest.raises(ValueError, match=r"gamma.*\(n,\) = \(5,\).*got shape"):
        call(entry, *good(), gamma=np.full(shape, 0.5))


@pytest.mark.parametrize("value", [0.0, -0.5, 1.0 + 1e-12, 2.0, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("entry", WITH_GATES, ids=ALL_IDS(WITH_GATES))
def test_gate_values_outside_the_unit_interval_are_refused(entry, value):
    gamma = np.full(5, 0.5)
    gamma[3] = value
    with pytest.raises(ValueError, match=r"gamma.*gamma\[3\]"):
        call(entry, *good(), gamma=gamma)


@pytest.mark.parametrize("gamma", [[[0.5, 0.5], [0.5]], [0.5, [0.5, 0.5], 0.5, 0.5, 0.5]])
@pytest.mark.parametrize("entry", WITH_GATES, ids=ALL_IDS(WITH_GATES))
def test_ragged_gate_lists_are_refused(entry, gamma):
    with pytest.raises(ValueError, match="gamma.*ragged"):
        call(entry, *good(), gamma=gamma)


@pytest.mark.parametrize("entry", WITH_GATES, ids=ALL_IDS(WITH_GATES))
def test_gate_boundary_values_are_accepted(entry):
    """a_t = 1 exactly, 1e-300 and the smallest positive float64 (log -744.4) are valid."""
    Q, K, V = good()
    gamma = np.array([1.0, 1e-300, np.nextafter(0.0, 1.0), 1.0, 0.5])
    for kw in (dict(gamma=gamma), dict(gamma=gamma, normalize=True, eps=0.0)):
        assert np.all(np.isfinite(call(entry, np.abs(Q) + 0.1, np.abs(K) + 0.1, V, **kw)))


@pytest.mark.parametrize("entry", WITH_GATES, ids=ALL_IDS(WITH_GATES))
def test_gates_for_the_empty_sequence(entry):
    Q, K, V = good(n=0)
    assert call(entry, Q, K, V, gamma=np.ones(0)).shape == (0, 2)
    assert call(entry, Q, K, V, gamma=[]).shape == (0, 2)
    with pytest.raises(ValueError, match=r"gamma.*\(0,\)"):
        call(entry, Q, K, V, gamma=np.ones(1))


def test_gate_arrays_are_not_modified():
    gamma = np.array([0.5, 1e-300, 1.0, 0.9, 0.7])
    copy = gamma.copy()
    for entry in WITH_GATES:
        call(entry, *good(), gamma=gamma)
    assert np.array_equal(gamma, copy)


# --- torch tensors and ragged lists are refused before NumPy sees them -----------------------

def _torch():
    return pytest.importorskip("torch")


def _subclass(torch):
    """A tensor subclass whose type comes from this module (its base from torch)."""
    return type("Sub", (torch.Tensor,), {})


def _tensors(torch, x):
    t = torch.from_numpy(np.ascontiguousarray(x))
    return {"float64": t, "bfloat16": t.to(torch.bfloat16),
            "requires_grad": t.clone().requires_grad_(True)}


@pytest.mark.parametrize("kind", ["float64", "bfloat16", "requires_grad"])
@pytest.mark.parametrize("which", ["Q", "K", "V"])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_torch_tensors_are_refused_by_name(entry, which, kind):
    torch = _torch()
    arrays = good()
    bad = _tensors(torch, arrays["QKV".index(which)])[kind]
    with pytest.raises(TypeError, match=rf"\b{which}\b.*torch.*NumPy.*\.numpy\(\)"):
        call(entry, *_replace(arrays, which, bad))


@pytest.mark.parametrize("kind", ["float64", "bfloat16", "requires_grad"])
@pytest.mark.parametrize("entry", WITH_GAMMA, ids=ALL_IDS(WITH_GAMMA))
def test_torch_gamma_is_refused_by_name(entry, kind):
    torch = _torch()
    for x in (np.full(5, 0.5), np.array(0.5)):     # gates, and a 0-d "scalar" tensor
        with pytest.raises(TypeError, match="gamma.*torch"):
            call(entry, *good(), gamma=_tensors(torch, x)[kind])


@pytest.mark.parametrize("entry", WITH_GAMMA, ids=ALL_IDS(WITH_GAMMA))
def test_torch_gamma_error_says_what_to_pass(entry):
    """The operator forms take a float or an array: the error offers both; a tensor subclass
    defined outside torch and a list holding tensors are refused like a tensor."""
    torch = _torch()
    if entry[1].endswith("_published"):   # one constant decay: the error offers no array
        with pytest.raises(TypeError, match=r"a Python float, e.g. gamma.item\(\)$"):
            call(entry, *good(), gamma=torch.tensor(0.5))
    else:
        with pytest.raises(TypeError, match=r"a Python float or a NumPy float array of per-token factors, e.g. "
                                            r"gamma.item\(\) or "):
            call(entry, *good(), gamma=torch.tensor(0.5))
    with pytest.raises(TypeError, match="gamma is a torch object"):
        call(entry, *good(), gamma=torch.full((5,), 0.5).as_subclass(_subclass(torch)))
    with pytest.raises(TypeError, match=r"gamma is a list holding torch objects; .*convert the tensors first\)$"):
        call(entry, *good(), gamma=[torch.tensor(0.5, requires_grad=True)] * 5)


@pytest.mark.parametrize("which", ["Q", "K", "V"])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_torch_inside_lists_and_subclasses_are_refused_by_name(entry, which):
    torch = _torch()
    arrays = good()
    x = arrays["QKV".index(which)]
    with pytest.raises(TypeError, match=rf"\b{which}\b is a torch object \(Sub"):
        call(entry, *_replace(arrays, which, torch.from_numpy(x).as_subclass(_subclass(torch))))
    with pytest.raises(TypeError, match=rf"\b{which}\b is a list holding torch objects"):
        call(entry, *_replace(arrays, which, [torch.from_numpy(row) for row in x]))
    with pytest.raises(TypeError, match=rf"\b{which}\b is a list holding torch objects"):
        call(entry, *_replace(arrays, which, [[torch.tensor(y) for y in row] for row in x]))


def test_a_package_named_like_torch_is_not_torch():
    """Only the torch package itself counts (torchaudio's or torchmetrics' types are not refused
    as torch's): an array-like from a module named so converts as NumPy converts it."""
    Fake = type("Fake", (), {"__array__": lambda self, dtype=None, copy=None: np.ones((5, 3)),
                             "__module__": "torchlike.tensor"})
    Q, K, V = good()
    assert np.array_equal(hla_ref.hla2_naive(Fake(), np.ones((5, 3)), V),
                          hla_ref.hla2_naive(np.ones((5, 3)), np.ones((5, 3)), V))


@pytest.mark.parametrize("entry", WITH_GAMMA, ids=ALL_IDS(WITH_GAMMA))
def test_torch_eps_is_refused_by_name(entry):
    torch = _torch()
    with pytest.raises(TypeError, match="eps.*torch"):
        call(entry, *good(), eps=torch.tensor(1e-6), normalize=True)


@pytest.mark.parametrize("which", ["Q", "K", "V"])
@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_ragged_lists_are_refused_by_name(entry, which):
    arrays = good()
    ragged = [list(row) for row in arrays["QKV".index(which)]]
    ragged[2] = ragged[2][:-1]
    with pytest.raises(ValueError, match=rf"\b{which}\b.*ragged"):
        call(entry, *_replace(arrays, which, ragged))


@pytest.mark.parametrize("entry", FUNCTIONS, ids=IDS)
def test_nested_lists_of_floats_are_accepted(entry):
    Q, K, V = good()
    assert np.array_equal(call(entry, Q.tolist(), K.tolist(), V.tolist()), call(entry, Q, K, V))


def test_hla_ref_does_not_import_torch():
    code = "import sys, hla_ref; assert 'torch' not in sys.modules, 'hla_ref imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("eps", [-1e-6, np.nan])
@pytest.mark.parametrize("entry", WITH_GAMMA, ids=ALL_IDS(WITH_GAMMA))
def test_bad_eps_is_refused(entry, eps):
    with pytest.raises(ValueError, match="eps"):
        call(entry, *good(), eps=eps, normalize=True)


@pytest.mark.parametrize("chunk_size,error", [(0, ValueError), (-3, ValueError), (2.5, TypeError),
                                              (True, TypeError), ("4", TypeError)])
@pytest.mark.parametrize("entry", WITH_CHUNK, ids=ALL_IDS(WITH_CHUNK))
def test_bad_chunk_size_is_refused(entry, chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        call(entry, *good(), chunk_size=chunk_size)


@pytest.mark.parametrize("variant", ["other", "Masked", ""])
@pytest.mark.parametrize("entry", WITH_VARIANT, ids=ALL_IDS(WITH_VARIANT))
def test_unknown_variant_is_refused(entry, variant):
    with pytest.raises(ValueError, match="variant"):
        call(entry, *good(), variant=variant)


@pytest.mark.parametrize("entry", WITH_GAMMA, ids=ALL_IDS(WITH_GAMMA))
def test_boundary_values_are_accepted(entry):
    """gamma = 1 exactly, a tiny positive gamma and eps = 0 are valid."""
    Q, K, V = good()
    for kw in (dict(gamma=1.0), dict(gamma=1e-3), dict(eps=0.0, normalize=True, gamma=0.5)):
        assert np.all(np.isfinite(call(entry, np.abs(Q) + 0.1, np.abs(K) + 0.1, V, **kw)))


@pytest.mark.parametrize("entry", WITH_CHUNK, ids=ALL_IDS(WITH_CHUNK))
def test_chunk_size_as_numpy_integer_is_accepted(entry):
    Q, K, V = good()
    assert np.array_equal(call(entry, Q, K, V, chunk_size=np.int64(2)),
                          call(entry, Q, K, V, chunk_size=2))


def test_inputs_are_not_modified():
    Q, K, V = good()
    copies = [a.copy() for a in (Q, K, V)]
    for entry in FUNCTIONS:
        call(entry, Q, K, V)
    for a, b in zip((Q, K, V), copies):
        assert np.array_equal(a, b)


# --- the helper functions: weights, segment builders ------------------------------------------

WEIGHTS = [("second_order", "hla2_weights", {}), ("asymmetric", "ahla_weights", {}),
           ("third_order", "hla3_weights", {"variant": "masked"}),
           ("third_order", "hla3_weights", {"variant": "paper"})]


@pytest.mark.parametrize("module,name,kw", WEIGHTS, ids=lambda x: str(x))
def test_weights_refuse_bad_input(module, name, kw):
    fn = func(module, name)
    Q, K, _ = good()
    with pytest.raises(ValueError, match=r"\bQ\b"):
        fn(Q[0], K, **kw)
    with pytest.raises(ValueError, match=r"\bK\b"):
        fn(Q, K[:4], **kw)
    with pytest.raises(TypeError, match=r"\bK\b"):
        fn(Q, K.astype(int), **kw)
    with pytest.raises(ValueError, match="gamma"):
        fn(Q, K, gamma=0.0, **kw)
    with pytest.raises(ValueError, match=r"gamma.*\(5,\)"):
        fn(Q, K, gamma=np.full(4, 0.5), **kw)
    with pytest.raises(ValueError, match=r"gamma.*gamma\[1\]"):
        fn(Q, K, gamma=np.array([0.5, 0.0, 0.5, 0.5, 0.5]), **kw)
    with pytest.raises(TypeError, match="gamma"):
        fn(Q, K, gamma=np.ones(5, dtype=int), **kw)
    with pytest.raises(ValueError, match=r"\bQ\b.*ragged"):
        fn([[1.0, 2.0], [3.0]], K, **kw)
    assert fn(Q[:0], K[:0], **kw).shape == (0, 0)
    assert fn(Q[:0], K[:0], gamma=np.ones(0), **kw).shape == (0, 0)


@pytest.mark.parametrize("masked", ["no", None, 0, 1])
def test_hla2_weights_takes_masked_as_a_bool_only(masked):
    Q, K, _ = good()
    with pytest.raises(TypeError, match="masked must be True or False"):
        hla_ref.hla2_weights(Q, K, masked=masked)


@pytest.mark.parametrize("scale", [1j, "0.5", True, np.nan, np.inf])
def test_softmax_scale_is_a_finite_real(scale):
    Q, K, V = good()
    with pytest.raises((TypeError, ValueError), match="scale"):
        hla_ref.softmax_attention(Q, K, V, scale=scale)


SEGMENTS = [("second_order", "hla2_segment"), ("asymmetric", "ahla_segment"),
            ("third_order", "hla3_segment"), ("third_order", "hla3_paper_segment")]


@pytest.mark.parametrize("module,name", SEGMENTS)
def test_segment_builders_refuse_bad_input(module, name):
    fn = func(module, name)
    q, k, v = np.ones(3), np.ones(3), np.ones(2)
    for gamma in (0.0, 1.5, np.nan):
        with pytest.raises(ValueError, match="gamma"):
            fn(q, k, v, gamma)
    # each error names the argument as the builder spells it (q, k, v) and the shape it was given
    with pytest.raises(ValueError, match=r"k must have the same shape \(d,\) as q \(3,\), got \(4,\)"):
        fn(q, np.ones(4), v, 0.5)
    with pytest.raises(ValueError, match=r"q must have shape \(features,\) with ndim 1, got shape \(1, 3\)"):
        fn(q[None], k, v, 0.5)
    with pytest.raises(ValueError, match=r"v must have at least one feature"):
        fn(q, k, np.ones(0), 0.5)
    with pytest.raises(TypeError, match=r"\bq\b"):
        fn(q.astype(int), k, v, 0.5)
    with pytest.raises(ValueError, match=r"\bq\b.*NaN"):
        fn(np.array([1.0, np.nan, 0.0]), k, v, 0.5)
    # a one-token segment takes that token's own factor: a float, not an array
    for gamma in (np.full(1, 0.5), [0.5], np.full(3, 0.5)):
        with pytest.raises(TypeError, match="gamma"):
            fn(q, k, v, gamma)
    with pytest.raises(ValueError, match=r"\bq\b.*ragged"):
        fn([1.0, [2.0, 3.0], 4.0], k, v, 0.5)


@pytest.mark.parametrize("module,name", SEGMENTS)
def test_segment_builders_refuse_torch_tensors_by_name(module, name):
    torch = _torch()
    fn = func(module, name)
    q, k, v = np.ones(3), np.ones(3), np.ones(2)
    for which, args in (("q", (torch.ones(3), k, v)), ("k", (q, torch.ones(3), v)),
                        ("v", (q, k, torch.ones(2)))):
        with pytest.raises(TypeError, match=rf"\b{which}\b.*torch"):
            fn(*args, 0.5)
    with pytest.raises(TypeError, match="gamma"):
        fn(q, k, v, torch.tensor(0.5))


IDENTITIES = [("second_order", "hla2_identity", "hla2_combine", "hla2_segment"),
              ("asymmetric", "ahla_identity", "ahla_combine", "ahla_segment"),
              ("third_order", "hla3_identity", "hla3_combine", "hla3_segment"),
              ("third_order", "hla3_paper_identity", "hla3_paper_combine", "hla3_paper_segment")]


@pytest.mark.parametrize("module,identity,combine,segment", IDENTITIES, ids=lambda x: str(x))
def test_identities_and_combines_refuse_bad_input(module, identity, combine, segment):
    """An empty segment's sizes are integers >= 1; a combine takes two segments of its kind and of
    one size (d, dv)."""
    ident, comb, seg = func(module, identity), func(module, combine), func(module, segment)
    for d, err in ((True, TypeError), (2.0, TypeError), (0, ValueError), (-1, ValueError)):
        with pytest.raises(err, match=r"\bd must be"):
            ident(d, 2)
        with pytest.raises(err, match=r"\bdv must be"):
            ident(2, d)
    a = seg(np.ones(3), np.ones(3), np.ones(2), 0.5)
    with pytest.raises(ValueError, match="segments of different sizes"):
        comb(a, ident(2, 2))
    with pytest.raises(ValueError, match="segments of different sizes"):
        comb(ident(3, 4), a)
    with pytest.raises(TypeError, match=f"B must be a {type(a).__name__}, got tuple"):
        comb(a, tuple(a))
    assert all(np.array_equal(x, y) for x, y in zip(comb(ident(3, 2), a), a))


@pytest.mark.parametrize("module,identity,combine,segment", IDENTITIES, ids=lambda x: str(x))
def test_combines_check_each_segment(module, identity, combine, segment):
    """A combine refuses a segment whose rho is not a real number in [0, 1] or whose arrays are not
    finite NumPy float arrays, naming the segment and the field; the identity's dtype is float32
    or float64."""
    torch = _torch()
    ident, comb, seg = func(module, identity), func(module, combine), func(module, segment)
    a = seg(np.ones(3), np.ones(3), np.ones(2), 0.5)
    first = type(a)._fields[0]
    for rho, err, msg in ((np.nan, ValueError, "B.rho must be finite"),
                          (2.0, ValueError, r"B.rho must lie in \[0, 1\]"),
                          (-1.0, ValueError, r"B.rho must lie in \[0, 1\]"), (True, TypeError, "B.rho must be a real"),
                          ("x", TypeError, "B.rho must be a real"), (np.ones(3), TypeError, "B.rho must be a real"),
                          (10 ** 400, ValueError, "B.rho must be finite")):
        with pytest.raises(err, match=msg):
            comb(a, a._replace(rho=rho))
    assert comb(a, a._replace(rho=0.0)).rho == 0.0        # a product of gates that underflowed
    bad = getattr(a, first)
    for value, err, msg in ((torch.tensor(bad), TypeError, r"NumPy float32/float64 array .*, got Tensor"),
                            (bad.tolist(), TypeError, r"NumPy float32/float64 array .*, got list"),
                            (np.ma.masked_array(bad), TypeError, "got MaskedArray"),
                            (bad.astype(int), TypeError, "float32 or float64 array, got dtype int"),
                            (np.full_like(bad, np.nan), ValueError, "NaN or infinite")):
        with pytest.raises(err, match=rf"A\.{first} .*{msg}"):
            comb(a._replace(**{first: value}), a)
    for dtype in (int, bool, complex, np.float16, object, None, "foo"):
        with pytest.raises(TypeError, match="dtype must be numpy.float32 or numpy.float64"):
            ident(3, 2, dtype=dtype)
    with pytest.raises(TypeError, match="dtype is a torch object"):
        ident(3, 2, dtype=torch.float64)
    assert all(x.dtype == np.float32 for x in ident(3, 2, dtype="float32")[:-1])


@pytest.mark.parametrize("module,identity,combine,segment", IDENTITIES, ids=lambda x: str(x))
def test_combines_check_every_fields_shape(module, identity, combine, segment):
    """Two segments malformed alike (one field's last axis cut to one entry) are refused, naming a
    field of A and the shape its kind needs; a NumPy float64 rho comes back as a float and leaves
    float32 fields float32."""
    ident, comb, seg = func(module, identity), func(module, combine), func(module, segment)
    a = seg(np.ones(3), np.ones(3), np.ones(2), 0.5)
    for field, value in zip(a._fields[:-1], a[:-1]):
        cut = a._replace(**{field: value[..., :1]})
        with pytest.raises(ValueError, match=r"A\.\w+ must have shape \(d[, dv]*,?\) = \([0-9, ]+\) \(d = "):
            comb(cut, cut)
    v_fields = [f for f, spec in zip(a._fields, type(a).SHAPES) if "v" in spec]
    if len(v_fields) > 2:   # the sizes most fields agree on: the odd field out is named
        with pytest.raises(ValueError, match=rf"A\.{v_fields[0]} must have shape \(d, [d, ]*dv\) = .*dv = 2"):
            comb(a._replace(**{v_fields[0]: getattr(a, v_fields[0])[..., :1]}), a)
    with pytest.raises(ValueError, match=rf"A\.{a._fields[0]} must be an array of .*got a 0-d array"):
        comb(a._replace(**{a._fields[0]: np.array(1.0)}), a)
    f32 = seg(*(np.ones(n, np.float32) for n in (3, 3, 2)), 0.5)
    out = comb(f32._replace(rho=np.float64(0.5)), f32._replace(rho=np.float64(0.5)))
    assert type(out.rho) is float and all(x.dtype == np.float32 for x in out[:-1])
    assert [x.shape for x in comb(ident(3, 2), a)[:-1]] == [x.shape for x in a[:-1]]


def test_segment_builders_and_indices_say_what_to_pass_for_a_tensor():
    """Where one number is expected (a segment builder's gamma, a published form's gamma, a
    token index) the torch error offers a number, not an array."""
    torch = _torch()
    from hla_ref import published
    q, k, v = np.ones(3), np.ones(3), np.ones(2)
    with pytest.raises(TypeError, match=r"gamma is a torch object .*a Python float, e.g. gamma.item\(\)"):
        hla_ref.hla2_segment(q, k, v, torch.tensor(0.5))
    with pytest.raises(TypeError, match=r"gamma is a torch object .*a Python float, e.g. gamma.item\(\)"):
        published.hla2_stream_published(*good(), gamma=torch.tensor(0.5))
    with pytest.raises(TypeError, match=r"\bi is a torch object .*a Python int or a NumPy integer array"):
        hla_ref.largest_index_twice(torch.tensor(1), 1, 0)


@pytest.mark.parametrize("name", ["hla2_combine_published", "ahla_combine_published"])
def test_published_combines_check_their_segments(name):
    from hla_ref import published
    comb = getattr(published, name)
    seg, ident = ((hla_ref.hla2_segment, hla_ref.hla2_identity) if name.startswith("hla2")
                  else (hla_ref.ahla_segment, hla_ref.ahla_identity))
    a = seg(np.ones(2), np.ones(2), np.ones(2), 0.5)
    with pytest.raises(ValueError, match="segments of different sizes"):
        comb(a, ident(2, 3))
    with pytest.raises(TypeError, match="B must be a"):
        comb(a, tuple(a))
    with pytest.raises(TypeError, match="A must be a"):
        comb(None, a)


@pytest.mark.parametrize("name", ["gamma", "eps", "ridge", "scale"])
def test_an_int_beyond_float_range_is_refused_by_name(name):
    Q, K, V = good()
    fn = {"gamma": hla_ref.hla2_chunked, "eps": hla_ref.hla2_chunked, "ridge": hla_ref.hla2_stream,
          "scale": hla_ref.softmax_attention}[name]
    kw = {name: 10 ** 400, **({"normalize": True} if name == "eps" else {})}
    with pytest.raises(ValueError, match=rf"^{name} must"):
        fn(Q, K, V, **kw)


def test_masked_arrays_are_refused_by_name():
    Q, K, V = good()
    with pytest.raises(TypeError, match=r"^K is a NumPy masked array"):
        hla_ref.hla2_naive(Q, np.ma.masked_array(K, K > 0), V)
    with pytest.raises(TypeError, match=r"^v is a NumPy masked array"):
        hla_ref.hla2_segment(Q[0], K[0], np.ma.masked_array(V[0]), 0.5)


def test_scan_helpers_name_their_arguments():
    add = lambda a, b: a + b   # noqa: E731
    for fn in (hla_ref.blelloch_scan, hla_ref.serial_exclusive_scan, hla_ref.inclusive_scan):
        with pytest.raises(TypeError, match="^items must be a sequence"):
            fn((x for x in [1, 2]), add, 0)
        with pytest.raises(TypeError, match="^combine must be a callable"):
            fn([1, 2], None, 0)
        assert fn(np.arange(3), add, 0) == fn([0, 1, 2], add, 0)
    with pytest.raises(TypeError, match="^record must be None or a list"):
        hla_ref.blelloch_scan([1, 2], add, 0, record=())
    assert hla_ref.blelloch_scan((1, 2, 3), add, 0) == [0, 1, 3]


def test_largest_index_twice_takes_integer_indices():
    assert hla_ref.largest_index_twice(2, 2, 1) and not hla_ref.largest_index_twice(1, 2, 0)
    for bad, name in ((("a", 1, 2), "i"), ((1, 1.5, 2), "u"), ((1, 2, [True]), "j")):
        with pytest.raises(TypeError, match=rf"^{name} must be an integer"):
            hla_ref.largest_index_twice(*bad)
