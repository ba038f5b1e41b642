"""Input handling of every public function: dtypes, empty input, and refused arguments."""

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


@pytest.mark.parametrize("gamma", ["0.5", None, [0.5]])
@pytest.mark.parametrize("entry", WITH_GAMMA, ids=ALL_IDS(WITH_GAMMA))
def test_gamma_of_wrong_type_is_refused(entry, gamma):
    with pytest.raises(TypeError, match="gamma"):
        call(entry, *good(), gamma=gamma)


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
    assert fn(Q[:0], K[:0], **kw).shape == (0, 0)


SEGMENTS = [("second_order", "hla2_segment"), ("asymmetric", "ahla_segment"),
            ("third_order", "hla3_segment"), ("third_order", "hla3_paper_segment")]


@pytest.mark.parametrize("module,name", SEGMENTS)
def test_segment_builders_refuse_bad_input(module, name):
    fn = func(module, name)
    q, k, v = np.ones(3), np.ones(3), np.ones(2)
    for gamma in (0.0, 1.5, np.nan):
        with pytest.raises(ValueError, match="gamma"):
            fn(q, k, v, gamma)
    with pytest.raises(ValueError):
        fn(q, np.ones(4), v, 0.5)
    with pytest.raises(TypeError):
        fn(q.astype(int), k, v, 0.5)
    with pytest.raises(ValueError):
        fn(np.array([1.0, np.nan, 0.0]), k, v, 0.5)
