"""Recording an op call's kernel launches, so that the C++ host launcher can replay them.

An eager call of a composed op (`fused_moe`: plan, GEMM1, GEMM2, finalize; `aligned_moe_`; a routing
op, one launch) spends most of its host time in Python around the launches: argument checks, dispatch, tile arithmetic,
allocations, the TVM-FFI calls' conversion of torch tensors. None of that depends on the tensors'
values: the pipeline never reads the device (no host synchronization), so what it launches is fixed by
the call's static configuration, the arguments' metadata. The C++ host launcher
(`host_launcher.RECORDED_OPS`) spells that configuration as a key; a call whose key has no program yet
runs the op's Python kernel once under `record`, which notes every allocation and every compiled-kernel
launch as a `Program`: which buffers to allocate, and for each launch its compiled function and its
arguments, each tensor argument a view (byte offset, sizes, strides, dtype) of an op argument or of one
of the buffers. Later calls of that key replay the program in C++: the same launches, with the same
arguments, relative to the new call's tensors and fresh buffers.

A call is replayable only if everything it did on the device is in the program. Under `record` a
torch dispatch mode sees every torch op the Python kernel runs: allocations (which become buffers) and
views pass; any other op (a copy, a fill, a read of a value) makes the call not replayable, and its
key then has no program: such configurations stay on the Python path. So do calls whose kernel
arguments cannot be described (a tensor within no op argument or buffer, a Python scalar of another
type), and calls that return anything but nothing (an op that writes an argument in place) or views of
the buffers. Compiled kernels report their launches through `note_launch` (the wrapper
`fp4moe.kernels.sm90.compiler` puts around each of them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp4moe.validation import byte_range

ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
        torch.ops.aten.empty_like.default,
    }
)
"""The torch ops that allocate without writing: their results become the program's buffers."""

_current = threading.local()


def current() -> "Recording | None":
    """The recording of the op call running on this thread, if one is being recorded."""
    return getattr(_current, "recording", None)


def note_launch(function, args: tuple, writes_before_wait: bool) -> None:
    """Called by a compiled kernel's wrapper before each launch: `function` is its TVM-FFI function
    (the program keeps it), `args` the launch's arguments, `writes_before_wait` whether the kernel
    writes global memory before it waits for its predecessor (`pdl.py`)."""
    recording = current()
    if recording is not None:
        recording.launch(function, args, writes_before_wait)


@dataclass
class Program:
    """What the C++ host launcher replays. `buffers`: (sizes, strides, dtype) of each allocation;
    `launches`: (function handle, arguments, whether the kernel writes before it waits for its
    predecessor), each argument one of ("input", op argument index,
    byte offset, sizes, strides, dtype), ("buffer", buffer index, byte offset, sizes, strides, dtype),
    ("empty", sizes, strides, dtype) (a tensor of no elements), ("int", value), ("float", value),
    ("none",); `results`: ("buffer", buffer index, element offset, sizes, strides) of each tensor the op
    returns, in order (none for an op that writes an argument in place).
    `functions` keeps the compiled functions alive as long as the program."""

    buffers: list = field(default_factory=list)
    launches: list = field(default_factory=list)
    results: list = field(default_factory=list)
    functions: list = field(default_factory=list)


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype


class Recording(TorchDispatchMode):
    """The launches of one op call (`record`). `why_not`: the first reason the call is not replayable
    (None while it is)."""

    def __init__(self, inputs: dict[int, torch.Tensor]):
        super().__init__()
        self.inputs = inputs  # op argument index -> tensor
        # op argument index -> (device, bytes [first, last + 1)) of the arguments with elements
        self.input_spans = {index: (a.device, byte_range(a)) for index, a in inputs.items() if a.numel()}
        # The replay allocates on the call's device: that of its first tensor argument.
        self.device = next(iter(inputs.values())).device if inputs else None
        self.program = Program()
        self.buffer_of_storage: dict[int, int] = {}  # storage data pointer -> buffer index
        self.why_not: str | None = None

    def refuse(self, reason: str) -> None:
        if self.why_not is None:
            self.why_not = reason

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in ALLOCATIONS:
            if out.device != self.device:
                self.refuse(f"it allocates on {out.device}")
            elif out.numel():
                self.buffer_of_storage[out.untyped_storage().data_ptr()] = len(self.program.buffers)
                self.program.buffers.append(_layout(out))
        elif not func.is_view:
            self.refuse(f"it runs {func}")
        return out

    def launch(self, function, args: tuple, writes_before_wait: bool) -> None:
        described = []
        for value in args:
            if isinstance(value, torch.Tensor):
                described.append(self.tensor_argument(value))
            elif value is None:
                described.append(("none",))
            elif isinstance(value, bool):
                self.refuse("a launch takes a bool")
                return
            elif isinstance(value, int):
                described.append(("int", value))
            elif isinstance(value, float):
                described.append(("float", value))
            else:
                self.refuse(f"a launch takes a {type(value).__name__}")
                return
        self.program.functions.append(function)
        self.program.launches.append((function.__chandle__(), described, writes_before_wait))

    def tensor_argument(self, t: torch.Tensor) -> tuple:
        if t.numel() == 0:
            return ("empty", *_layout(t))
        buffer = self.buffer_of_storage.get(t.untyped_storage().data_ptr())
        if buffer is not None:
            return ("buffer", buffer, t.data_ptr() - t.untyped_storage().data_ptr(), *_layout(t))
        start, end = byte_range(t)
        owners = [
            index for index, (device, (low, high)) in self.input_spans.items() if device == t.device and low <= start and end <= high
        ]
        if not owners:
            self.refuse("a launch's tensor lies in no op argument")
            return ("none",)
        # In several (the same tensor passed twice, say): the first, whose place relative to the others
        # the C++ key spells, so the view is the same in every call of the key.
        return ("input", owners[0], start - self.inputs[owners[0]].data_ptr(), *_layout(t))

    def finish(self, result) -> Program | None:
        """The program of the call that returned `result` (a tensor, a tuple of tensors, or None for an op
        that returns nothing), or None where it is not replayable."""
        returned = () if result is None else (result,) if isinstance(result, torch.Tensor) else result
        if not isinstance(returned, tuple) or not all(isinstance(t, torch.Tensor) for t in returned):
            self.refuse("the op returns neither tensors nor nothing")
            returned = ()
        for tensor in returned:
            buffer = self.buffer_of_storage.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
            if buffer is None or self.program.buffers[buffer][2] != tensor.dtype:
                self.refuse("a result is not one of the call's allocations")
                break
            self.program.results.append(
                ("buffer", buffer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
            )
        if not self.program.launches:
            self.refuse("it launches no kernel")
        return None if self.why_not is not None else self.program


def record(call, args: tuple):
    """Run `call(*args)` (an op's Python kernel with its arguments) while recording: (its result, its
    `Program` or None where the call is not replayable, the reason)."""
    recording = Recording({i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
    outer = current()
    _current.recording = recording
    try:
        with recording:
            result = call(*args)
    finally:
        _current.recording = outer
    program = recording.finish(result)
    return result, program, recording.why_not
