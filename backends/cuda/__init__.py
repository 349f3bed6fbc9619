"""kvpush_cuda: the CUDA device backend for kvpush, a plugin like any third party's."""

if __name__ != "kvpush_cuda":
    raise ImportError(f"the folder 'backends/cuda' is the package 'kvpush_cuda', not {__name__!r}")
