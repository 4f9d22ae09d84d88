"""The building blocks of servelm's models: norm, rotary embedding, activation, fused linear, paged attention.

Each op picks servelm's native CPU kernel (``servelm.kernels``) or PyTorch in
one place, its own module, so that a model file (``servelm/models/llama.py``)
reads as the architecture only. The PyTorch code beside each kernel call is
the reference the kernel matches and the path everywhere else (other
devices, other dtypes, no C compiler).
"""
