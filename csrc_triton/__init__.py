"""Triton kernels, one file per op (`_<op>_kernel` + `<op>()` launcher); imported only by cachefuse.ops."""
