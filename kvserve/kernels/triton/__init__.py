"""Triton kernels. Import only through kvserve.attention.triton_backend (lazily)."""
