"""Reading a module's input on the hot path without a module hook.

A forward pre-hook puts every call of its module on torch's slow call path (the hook dictionaries
walked, the arguments repacked): ~3 us a call on these machines, at every sparse layer of every
token, where the prediction driver reads the residual stream (the input of the pre-router norm).
A tap instead wraps the module's own `forward` in an instance attribute (as accelerate's hooks do),
so the module keeps torch's fast call path and the tap costs one Python call. One tap serves all
the readers of a module; removing the last one puts back what `forward` was.
"""
from __future__ import annotations

from typing import Callable

from torch import nn


class _Tap:
    """The wrapper installed as `module.forward`, with the readers it calls."""

    def __init__(self, module: nn.Module):
        self.module, self.readers = module, []
        self.before = module.__dict__.get("forward")  # an instance `forward` set before the tap, else None
        self.inner = inner = module.forward
        readers = self.readers

        def forward(*args, **kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            for read in readers:
                read(x)
            return inner(*args, **kwargs)

        forward.tap = self
        self.forward = forward
        module.forward = forward

    def remove(self, read: Callable) -> None:
        self.readers[:] = [r for r in self.readers if r is not read]
        if self.readers or self.module.__dict__.get("forward") is not self.forward:
            return  # still read, or wrapped again since: leave it in place
        if self.before is None:
            del self.module.forward
        else:
            self.module.forward = self.before


class TapHandle:
    """Stops one reader (`remove`, like a torch hook's handle)."""

    def __init__(self, tap: _Tap, read: Callable):
        self.tap, self.read = tap, read

    def remove(self) -> None:
        if self.read is not None:
            self.tap.remove(self.read)
            self.read = None


def untapped(module: nn.Module) -> Callable:
    """`module`'s forward without its tap, for a caller whose input is not the model's (a predictor running
    a layer's norm on its own state must not feed the readers)."""
    forward = module.forward
    tap = getattr(forward, "tap", None)
    return forward if tap is None else tap.inner


def tap_input(module: nn.Module, read: Callable) -> TapHandle:
    """Call `read(x)` with `module`'s first input `x` before each of its calls."""
    tap = getattr(module.__dict__.get("forward"), "tap", None)
    if tap is None:
        tap = _Tap(module)
    tap.readers.append(read)
    return TapHandle(tap, read)
