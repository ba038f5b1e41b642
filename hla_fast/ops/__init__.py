"""The operators of hla_fast, one subpackage each, on shared machinery in ``common``.

Each operator folder holds the same files: ``interface.py`` (the public functions and their
checks), ``chunk.py`` (configuration rule, launchers, autograd Function), ``chunk_kernels.py``
(the Triton kernels), ``decode.py`` (one-token step: kernel and torch twin), ``torch_backend.py``
(vectorized chunked torch with autograd), ``naive.py`` (plain torch definitions) and
``state.py`` (the state tuple).
"""
