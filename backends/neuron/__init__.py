"""kvpush_neuron: the AWS Trainium/Inferentia device backend for kvpush."""

if __name__ != "kvpush_neuron":
    raise ImportError(
        f"the folder 'backends/neuron' is the package 'kvpush_neuron', not {__name__!r}"
    )
