"""``python -m labkit.core.engine``: build the C++ decode step of ``decode_plan=True`` now (``make env`` does), or say
why not."""

from labkit.core.engine.decode_plan import load_step

built = load_step()
print("labkit's C++ decode step (decode_plan=True): " + ("ready" if built.module is not None else
                                                         f"not built ({built.missing}); the plan runs its layers "
                                                         "from Python"))
