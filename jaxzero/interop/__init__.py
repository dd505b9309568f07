"""Foreign formats: moving weights, optimizer state and EMAs between other frameworks and
jaxzero. :mod:`jaxzero.interop.torch` covers PyTorch."""
