"""ORT IO binding kept from one decode step to the next (FastCarSession's bound path).

A decode step changes little: the token, its position, the attention mask's length and the logits. The KV
buffers and the FastCar state are the same arrays for a whole video (the native kernels write them in place).
`StepBinding` binds each name once and again only when its array changes, so a step's Python work outside ORT
binds a few small arrays, not a pass over every state tensor.

One binding belongs to one video (it travels with that video's `DecodeState`), never to the session: an ORT
IO binding is not safe to use from two threads at once, and a session must be (ORT's `InferenceSession.run` is),
so videos stepped concurrently from several threads each bind their own buffers. The lock serialises steps of
the same video from two threads (a caller's race, which must not become a heap corruption).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np


class StepBinding:
    """One video's IO binding on an ORT session; every bound numpy array is kept alive here (ORT aliases its
    memory), with what is bound: the state arrays, whether tau is an input, the video_start value."""

    def __init__(self, session: Any):
        import onnxruntime as ort
        from onnxruntime.capi import _pybind_state as C

        self._io = ort.IOBinding(session)._iobinding
        self._run = session._sess.run_with_iobinding
        self._options = ort.RunOptions()
        self._cpu = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        self._wrap = C.OrtValue.ortvalue_from_numpy  # aliases the array (no copy)
        self.inputs: dict[str, np.ndarray] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self.state: tuple[tuple[str, ...], list[np.ndarray]] | None = None  # (names, arrays) bound in place
        self.tau_bound = False  # the bound input set includes the threshold
        self.video_start = 0  # the value in the bound video_start buffer
        self.lock = threading.Lock()

    def bind_input(self, name: str, a: np.ndarray) -> None:
        """Bind `a` (C-contiguous) to input `name` unless it already is."""
        if self.inputs.get(name) is not a:
            self._io.bind_ortvalue_input(name, self._wrap(a, self._cpu))
            self.inputs[name] = a

    def bind_output(self, name: str, a: np.ndarray) -> None:
        """Bind `a` (C-contiguous, writable) to output `name` unless it already is; ORT writes into it."""
        if self.outputs.get(name) is not a:
            self._io.bind_ortvalue_output(name, self._wrap(a, self._cpu))
            self.outputs[name] = a

    def copy_input(self, name: str, a: np.ndarray) -> None:
        """Give input `name` the values of `a` through a buffer bound once: copied into it when the shape is
        unchanged (the caller's array is never bound, so it may change afterwards)."""
        held = self.inputs.get(name)
        if held is not None and held.shape == a.shape:
            np.copyto(held, a)
        else:
            self.bind_input(name, np.array(a, order="C"))

    def output_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The buffer bound to output `name`, reallocated (and bound) only when its shape changes."""
        buf = self.outputs.get(name)
        if buf is None or buf.shape != shape:
            buf = np.empty(shape, dtype=dtype)
            self.bind_output(name, buf)
        return buf

    def run(self) -> float:
        """Run the session on the bound arrays; seconds spent inside ORT."""
        t0 = time.perf_counter()
        self._run(self._io, self._options)
        return time.perf_counter() - t0

    def clear_inputs(self) -> None:
        self._io.clear_binding_inputs()
        self.inputs.clear()

    def clear(self) -> None:
        """Drop every binding, so the arrays they kept alive can be freed."""
        self.clear_inputs()
        self._io.clear_binding_outputs()
        self.outputs.clear()
