"""``python -m labkit.core.attention``: build the ``"cpp"`` backend's kernel now (``make env`` does), or say why not."""

from labkit.core.attention.cpp_decode import load_result

built = load_result()
print("labkit's C++ paged decode attention: " + ("ready" if built.module is not None else
                                                  f'not built ({built.missing}); "auto" runs "torch"'))
