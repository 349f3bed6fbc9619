# The folders below are the packages kvpush_cuda and kvpush_neuron; this one is not a package.
raise ImportError("'backends' is not a package; import kvpush_cuda or kvpush_neuron")
