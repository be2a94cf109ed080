"""The serving kernels: host C kernels (``cpu_*``, C sources in ``csrc/``, built by
``cpu_build``) and the CUDA few-row matvec (``cuda_qmv``), each with a numpy reference
(``*_ref``). The conversion-time GGML codecs live in :mod:`hf2q.ggml`.
"""
