"""Recording `fused_moe` and `aligned_moe_` calls' launches and replaying them in C++
(`fp4moe.kernels.launch_recording`, the recorded ops of `fp4moe.kernels.host_launcher`), on the CPU.

The sm90 pipelines run here with their device facts faked and every compiled kernel replaced by a
TVM-FFI function of a Python callable that notes its arguments (`benchmarks.host_cpu.stubbed_sm90_kernels`):
the Python kernel of the op and the C++ replay of its recording must then launch the same kernels with
the same arguments — every tensor the same view of the same op argument, or of the same one of the
call's own allocations — and return the same view of an allocation (or nothing, in place). The GPU
tests (`tests/test_host_launcher.py`) run the real kernels both ways."""

from __future__ import annotations

import numpy
import pytest
import torch
import tvm_ffi
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.host_cpu import EXPERTS, HIDDEN, fused_moe_arguments, fused_moe_python_kernel, stubbed_sm90_kernels
from fp4moe import dispatch, weight_layout
from fp4moe.kernels import host_launcher, launch_recording
from fp4moe.kernels.sm90 import pdl
from fp4moe.ops import aligned_moe as aligned_ops
from fp4moe.validation import byte_range

ARGUMENT_NAMES = [a.name for a in torch.ops.fp4moe.fused_moe.default._schema.arguments]
pytestmark = pytest.mark.usefixtures("recorded_calls_forgotten")  # each test counts its own calls


@pytest.fixture
def launcher():
    if host_launcher.mode() == "python":
        pytest.skip(f"{host_launcher.MODE_VARIABLE}=python")
    try:
        return host_launcher.module()
    except Exception as error:  # no C++ compiler: test_host_launcher covers the notice
        pytest.skip(f"the C++ host launcher does not build here ({error})")


@pytest.fixture
def launches():
    """The sm90 backend on the CPU, its kernels replaced (`benchmarks.host_cpu.stubbed_sm90_kernels`):
    the list every launch is noted in, as (kernel class, arguments), each tensor argument as (address,
    sizes, strides, dtype)."""
    noted = []

    def note(kernel, args):
        noted.append(
            (type(kernel).__name__,
             [(a.data_ptr(), tuple(a.shape), tuple(a.strides), str(a.dtype)) if isinstance(a, tvm_ffi.Tensor) else a for a in args])
        )

    with stubbed_sm90_kernels(note):
        yield noted


class KeepingAllocations(TorchDispatchMode):
    """Keeps every tensor allocated under it alive (the Python kernel's, and a replay's, whose C++
    allocations the mode sees too), so that no two allocations of a call share an address and
    `canonical` can tell them apart."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in launch_recording.ALLOCATIONS:
            self.kept.append(out)
        return out


def canonical(noted, args):
    """The noted launches with each tensor argument as ("argument", index, byte offset, ...) of the op
    argument it lies in, or ("allocation", n, ...) numbering the call's own allocations in the order of
    first use: the same for two calls that launch alike on different tensors."""
    spans = [(i, *byte_range(a)) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.numel()]
    allocations = {}
    described = []
    for name, values in noted:
        out = []
        for value in values:
            if isinstance(value, tuple):
                address = value[0]
                owners = [i for i, low, high in spans if low <= address < high]
                if owners:
                    out.append(("argument", owners, address - args[owners[0]].data_ptr(), *value[1:]))
                else:
                    out.append(("allocation", allocations.setdefault(address, len(allocations)), *value[1:]))
            else:
                out.append(value)
        described.append((name, out))
    return described


def record_and_file(launcher, args, key=b"test key"):
    """Record a call of `args` and file its program under `key`; the recorded program."""
    with torch.inference_mode():
        _, program, why_not = launch_recording.record(fused_moe_python_kernel, args)
    assert program is not None, why_not
    launcher.register_program(key, "fused_moe", program.buffers, program.launches, program.results)
    return program


MODES = ("w4a16", "w4a4_tensor", "w4a4_token")


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused finalize", "deterministic"])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("mode", MODES)
def test_a_replay_launches_what_the_python_kernel_launches(launcher, launches, mode, tokens, deterministic):
    """Recorded on one call's tensors, replayed on another's (same metadata, different tensors and
    routing): kernel for kernel, argument for argument, the launches of the Python kernel on the second
    call's tensors, each allocation used where the Python kernel uses its own; the same result view."""
    program = record_and_file(launcher, fused_moe_arguments(tokens, mode, seed=0, deterministic=deterministic))
    assert len(program.launches) >= 4
    args = fused_moe_arguments(tokens, mode, seed=1, deterministic=deterministic)
    with torch.inference_mode():
        launches.clear()
        with KeepingAllocations():
            expected = fused_moe_python_kernel(*args)
        expected_launches = canonical(launches, args)
        launches.clear()
        with KeepingAllocations():
            got = launcher.replay_for_test(b"test key", "fused_moe", args)
        got_launches = canonical(launches, args)
    assert [name for name, _ in got_launches] == [name for name, _ in expected_launches]
    for (name, want), (_, have) in zip(expected_launches, got_launches, strict=True):
        assert have == want, name
    assert (got.shape, got.stride(), got.dtype, got.device) == (expected.shape, expected.stride(), expected.dtype, expected.device)
    assert got.storage_offset() == expected.storage_offset()
    # The result is a fresh allocation, not one a launch reads as an input.
    assert all(got.data_ptr() != a.data_ptr() for a in args if isinstance(a, torch.Tensor))


def test_a_call_without_a_program_is_recorded_and_the_next_one_replayed(launcher, launches, monkeypatch):
    """The CUDA kernel's own path (`serve_for_test` serves CPU tensors too): the first call of a key goes
    to the op's Python kernel; the second too, recorded, and files a program; the next call of that key,
    on other tensors, replays it and launches what the Python kernel would. A call that is not replayable
    goes to Python, recorded once (its second call), then without recording."""
    record = launch_recording.record
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")
    def call_arguments_aligned(seed, **overrides):  # as the CUDA allocator places tensors: 256-byte aligned
        args = fused_moe_arguments(6, "w4a4_token", seed=seed, swiglu_limit=7.0, **overrides)  # a configuration of its own
        return tuple(aligned(a) if isinstance(a, torch.Tensor) else a for a in args)

    first = call_arguments_aligned(0)
    slow, programs = host_launcher.slow_path_calls(), launcher.recorded_program_count()
    launcher.serve_for_test("fused_moe", first)
    assert (host_launcher.slow_path_calls(), launcher.recorded_program_count()) == (slow + 1, programs), (
        "a configuration's first call is not recorded"
    )
    launcher.serve_for_test("fused_moe", first)
    slow += 1
    assert (host_launcher.slow_path_calls(), launcher.recorded_program_count()) == (slow + 1, programs + 1)
    args = call_arguments_aligned(1)
    launches.clear()
    with torch.inference_mode(), KeepingAllocations():
        expected = fused_moe_python_kernel(*args)
    expected_launches = canonical(launches, args)
    launches.clear()
    with KeepingAllocations():
        got = launcher.serve_for_test("fused_moe", args)
    assert host_launcher.slow_path_calls() == slow + 1, "the second call went to Python"
    assert canonical(launches, args) == expected_launches
    assert (got.shape, got.dtype) == (expected.shape, expected.dtype)
    misaligned = call_arguments_aligned(2, x=torch.randn(6, HIDDEN + 1).to(torch.bfloat16)[:, :HIDDEN])
    recordings = []
    monkeypatch.setattr(launch_recording, "record", lambda *a: recordings.append(1) or record(*a))
    for _ in range(3):
        launcher.serve_for_test("fused_moe", misaligned)
    assert host_launcher.slow_path_calls() == slow + 4, "a call that copies its rows is never replayed"
    assert len(recordings) == 1, "an unreplayable configuration is recorded once (its second call)"
    invalid = list(call_arguments_aligned(3))
    invalid[ARGUMENT_NAMES.index("topk_weights")] = invalid[ARGUMENT_NAMES.index("topk_weights")].double()
    with pytest.raises(TypeError, match="topk_weights"):  # the Python kernel's own error, through the recorder
        launcher.serve_for_test("fused_moe", tuple(invalid))
    assert launch_recording.current() is None
    assert launcher.recorded_program_count() == programs + 1


@pytest.mark.parametrize("mode", MODES)
def test_a_replay_holds_each_buffer_from_its_first_launch_to_its_last(launcher, launches, mode):
    """A replay allocates each buffer just before the first launch that takes it and lets it go just after
    its last (the result's at the end), or after the next launch where that one writes before it waits:
    with PDL such a kernel runs beside its predecessor, so a block let go after the predecessor could be
    handed to it while the predecessor still uses it (the activation quantizer beside the plan kernel;
    `Program` in host_launcher.cpp). One that no launch takes is never allocated; less than all of them
    are held at once."""
    program = record_and_file(launcher, fused_moe_arguments(300, mode, seed=0, deterministic=True))
    writes_before_wait = [early for _, _, early in program.launches]
    assert writes_before_wait.count(True) == (mode != "w4a16"), "only the activation quantizer writes before it waits"
    uses = {}  # buffer index -> the launches that take it
    for launch, (_, arguments, _) in enumerate(program.launches):
        for argument in arguments:
            if argument[0] == "buffer":
                uses.setdefault(argument[1], []).append(launch)
    ((_, result_buffer, *_),) = program.results
    want = [([], []) for _ in program.launches]
    for buffer, taken_by in sorted(uses.items()):
        want[taken_by[0]][0].append(buffer)
        if buffer != result_buffer:
            last = taken_by[-1]
            held = last + 1 < len(program.launches) and writes_before_wait[last + 1]
            want[last + held][1].append(buffer)
    schedule = launcher.buffer_schedule_for_test(b"test key")
    assert [(sorted(a), sorted(r)) for a, r in schedule] == want

    def size(buffer):
        sizes, strides, dtype = program.buffers[buffer]
        return (1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))) * dtype.itemsize

    live, peak = set(), 0
    for allocated, released in schedule:
        live |= set(allocated)
        peak = max(peak, sum(map(size, live)))
        live -= set(released)
    assert live == {result_buffer}
    assert peak < sum(map(size, range(len(program.buffers)))), "some buffer is let go before another is allocated"


class LiveAllocations(TorchDispatchMode):
    """Notes every allocation made under it (the Python kernel's, and a replay's, whose C++ allocations
    the mode sees too) by a weak reference to its storage: `live_bytes` sums those still alive, each
    rounded up to the CUDA caching allocator's 512-byte blocks."""

    def __init__(self):
        super().__init__()
        self.allocations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in launch_recording.ALLOCATIONS and out.numel():
            storage = out.untyped_storage()
            self.allocations.append((StorageWeakRef(storage), -(-storage.nbytes() // 512) * 512))
        return out

    def live_bytes(self) -> int:
        return sum(size for reference, size in self.allocations if not reference.expired())


def aligned_python_kernel(*args):
    """`aligned_moe_`'s Python kernel called with every schema argument in order."""
    return aligned_ops.aligned_moe_(**dict(zip([a.name for a in ALIGNED_SCHEMA.arguments], args, strict=True)))


@pytest.mark.parametrize("case", [*MODES, "aligned_moe_"])
def test_a_replay_holds_no_more_memory_at_any_launch_than_the_python_kernel(launcher, case):
    """At each launch, the bytes of the call's allocations still alive: at most as many at the replay's
    fullest launch as at the Python kernel's (which frees a tensor when its last reference goes), so a
    replay never needs more memory than the Python path. `fused_moe` in every mode (T = 300,
    deterministic), and `aligned_moe_`, whose decode writes before it waits beside its setup kernel. The
    GPU test `test_a_replay_needs_no_more_memory_than_the_python_pipeline` compares the peaks the caching
    allocator reports."""
    tracking = []  # the LiveAllocations of the call running, if any
    samples = []

    def on_launch(kernel, args):
        if tracking:
            samples.append(tracking[0].live_bytes())

    peaks = []
    with stubbed_sm90_kernels(on_launch):
        if case == "aligned_moe_":
            op, python_kernel, args = "aligned_moe_", aligned_python_kernel, aligned_arguments(0)
        else:
            op, python_kernel, args = "fused_moe", fused_moe_python_kernel, fused_moe_arguments(300, case, seed=0, deterministic=True)
        with torch.inference_mode():
            _, program, why_not = launch_recording.record(python_kernel, args)
        assert program is not None, why_not
        launcher.register_program(b"test key", op, program.buffers, program.launches, program.results)
        for call in (lambda: launcher.replay_for_test(b"test key", op, args), lambda: python_kernel(*args)):
            samples.clear()
            with torch.inference_mode(), LiveAllocations() as live:
                tracking.append(live)
                call()
                tracking.clear()
            peaks.append(max(samples))
    replay_peak, python_peak = peaks
    assert 0 < replay_peak <= python_peak, (replay_peak, python_peak)


def launch_orders_of(run) -> list[str]:
    """Where each kernel `run()` launches waits for its predecessor (`pdl.LAUNCH_ORDERS`; kernels without
    a `launch_order` wait first), on stubbed kernels."""
    orders = []
    with stubbed_sm90_kernels(lambda kernel, args: orders.append(getattr(kernel, "launch_order", "wait_first"))):
        with torch.inference_mode():
            run()
    return orders


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_a_kernel_that_signals_before_it_waits_follows_one_that_waits_first(tokens):
    """The premise of a replay's buffer schedule (`Program` in host_launcher.cpp): a block let go after
    the launch that follows its last, where that launch writes before it waits, is safe only if no
    kernel that signals its successor before waiting follows another such kernel. Every `fused_moe` mode and finalize, and `aligned_moe_`."""
    runs = [
        lambda mode=mode, deterministic=deterministic: fused_moe_python_kernel(
            *fused_moe_arguments(tokens, mode, seed=0, deterministic=deterministic)
        )
        for mode in MODES
        for deterministic in (False, True)
    ]
    runs.append(lambda: aligned_python_kernel(*aligned_arguments(0)))
    seen = set()
    for run in runs:
        orders = launch_orders_of(run)
        seen.update(orders)
        assert orders[0] == "wait_first", orders
        for before, after in zip(orders, orders[1:]):
            assert before == "wait_first" or after == "wait_first", orders
    assert seen == set(pdl.LAUNCH_ORDERS), "every launch order is exercised"


def test_the_replay_allocates_afresh_on_every_call(launcher, launches):
    """Two replays of one program get buffers of their own (the first call's results stay valid)."""
    record_and_file(launcher, fused_moe_arguments(5, "w4a16", seed=0))
    args = fused_moe_arguments(5, "w4a16", seed=1)
    first = launcher.replay_for_test(b"test key", "fused_moe", args)
    second = launcher.replay_for_test(b"test key", "fused_moe", args)
    assert first.data_ptr() != second.data_ptr()


def test_without_a_program_a_key_replays_nothing(launcher):
    assert launcher.replay_for_test(b"no program has this key", "fused_moe", fused_moe_arguments(1, "w4a16", seed=0)) is None


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` (its values, strides and storage offset) in a storage whose first byte is at a multiple of 256,
    as the CUDA allocator places its blocks (the CPU's places them at multiples of 64 only); a tensor
    already in such a storage (a view of one) stays as it is."""
    if t.untyped_storage().data_ptr() % 256 == 0:
        return t
    nbytes = t.untyped_storage().nbytes()
    room = numpy.empty(nbytes + 256, dtype=numpy.uint8)
    start = -room.ctypes.data % 256
    storage = torch.from_numpy(room[start : start + nbytes])  # a storage starting at that address
    storage.copy_(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()))
    return storage.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def test_the_key_spells_how_far_apart_overlapping_arguments_start(launcher):
    """Arguments that share bytes (one scale tensor for two arguments, say) key their calls by the
    distance between their starts, which the recorder's choice of owner relies on."""
    key = launcher.recorded_key_for_test

    def with_scales(fc1, fc2):
        args = fused_moe_arguments(2, "w4a4_tensor", seed=0, fc1_input_scale=fc1, fc2_input_scale=fc2)
        return tuple(aligned(a) if isinstance(a, torch.Tensor) else a for a in args)

    scales = aligned(torch.rand(256))
    same = key("fused_moe", with_scales(scales[:1], scales[:1]))
    assert same == key("fused_moe", with_scales(scales[:1], scales[:1]))
    assert same != key("fused_moe", with_scales(torch.tensor([3.0]), torch.tensor([40.0])))  # apart
    # Keys spell no values, so any shapes serve: 128 values each, their starts 0 or 256 bytes apart (the
    # same address modulo 256), overlapping either way.
    keys = {key("fused_moe", with_scales(scales[:128], scales[start : start + 128])) for start in (0, 64)}
    assert None not in keys and len(keys) == 2


def test_the_key_spells_every_argument_s_metadata(launcher, monkeypatch):
    """Equal for calls that differ only in their tensors' values; different where any argument's kind,
    dtype, sizes, strides, alignment or value (for non-tensors) differs, and where FP4MOE_BACKEND does."""
    def key(name, args):  # every tensor at an address that is a multiple of 256, unless given otherwise
        return launcher.recorded_key_for_test(name, tuple(aligned(a) if isinstance(a, torch.Tensor) else a for a in args))

    base = fused_moe_arguments(4, "w4a16", seed=0)
    assert key("fused_moe", base) == key("fused_moe", fused_moe_arguments(4, "w4a16", seed=1))

    wide = aligned(torch.randn(4, HIDDEN + 8).to(torch.bfloat16))
    offset = aligned(torch.randn(4 * HIDDEN + 8).to(torch.bfloat16))
    variants = {
        "tokens": fused_moe_arguments(5, "w4a16", seed=0),
        "dtype": fused_moe_arguments(4, "w4a16", seed=0, x=torch.randn(4, HIDDEN).half()),
        "strides": fused_moe_arguments(4, "w4a16", seed=0, x=wide[:, :HIDDEN]),
        "alignment": fused_moe_arguments(4, "w4a16", seed=0, x=offset[8:].view(4, HIDDEN)),
        "a tensor for None": fused_moe_arguments(4, "w4a16", seed=0, fc1_input_scale=torch.tensor([1.0])),
        "a bool": fused_moe_arguments(4, "w4a16", seed=0, deterministic=True),
        "an int": fused_moe_arguments(4, "w4a16", seed=0, local_expert_offset=1),
        "an optional int": fused_moe_arguments(4, "w4a16", seed=0, global_num_experts=EXPERTS),
        "a float": fused_moe_arguments(4, "w4a16", seed=0, swiglu_alpha=1.702),
        "a string": fused_moe_arguments(4, "w4a4_tensor", seed=0, fc1_input_scale=None, fc2_input_scale=None),
    }
    keys = {"base": key("fused_moe", base)}
    for name, args in variants.items():
        keys[name] = key("fused_moe", args)
    nearby = key("fused_moe", fused_moe_arguments(4, "w4a16", seed=0, swiglu_alpha=1.702 + 2**-50))
    monkeypatch.setenv(dispatch.BACKEND_VARIABLE, "reference")
    keys["FP4MOE_BACKEND"] = key("fused_moe", base)
    assert None not in keys.values()
    assert len(set(keys.values())) == len(keys), keys
    assert nearby != keys["a float"]


def test_calls_that_run_other_torch_ops_are_not_recorded(launches):
    """x with rows the kernels cannot read 16 bytes at a time: the launch layer copies it first (a torch
    op), which a replay would not do."""
    wide = torch.randn(3, HIDDEN + 1).to(torch.bfloat16)
    args = fused_moe_arguments(3, "w4a16", seed=0, x=wide[:, :HIDDEN])
    with torch.inference_mode():
        result, program, why_not = launch_recording.record(fused_moe_python_kernel, args)
    assert program is None and "clone" in why_not
    assert result.shape == (3, HIDDEN)


class _Launches:
    """A stand-in compiled kernel for the recorder's own tests: its TVM-FFI function notes the addresses
    (and the other values) it is called with in `called`."""

    def __init__(self):
        self.called = []
        self.function = tvm_ffi.convert(
            lambda *args: self.called.append([a.data_ptr() if isinstance(a, tvm_ffi.Tensor) else a for a in args])
        )

    def __call__(self, *args):
        launch_recording.note_launch(self.function, args, writes_before_wait=False)


def test_what_a_replay_could_not_reproduce_is_not_recorded(launcher):
    kernel = _Launches()
    a, b = torch.zeros(8), torch.zeros(8)
    shared = torch.zeros(16)

    def refused(call, args):
        with torch.inference_mode():
            _, program, why_not = launch_recording.record(call, args)
        assert program is None
        return why_not

    def fills(x):
        out = torch.empty_like(x)
        out.fill_(1.0)
        kernel(x, out)
        return out

    def launches_with(value):
        def call(x):
            out = torch.empty_like(x)
            kernel(x, out, value)
            return out

        return call

    def returns_an_argument(x):
        kernel(x)
        return x

    def launches_nothing(x):
        return torch.empty_like(x)

    def reads_overlapping_arguments(x, y):
        out = torch.empty_like(x)
        kernel(y[:8], out)
        return out

    def reads_past_an_argument(x):
        out = torch.empty_like(x)
        kernel(torch.as_strided(x, (8,), (1,), x.storage_offset() + 4), out)
        return out

    assert "fill_" in refused(fills, (a,))
    assert "bool" in refused(launches_with(True), (a,))
    assert "str" in refused(launches_with("text"), (a,))
    assert "allocations" in refused(returns_an_argument, (a,))
    assert "no kernel" in refused(launches_nothing, (a,))
    assert "no op argument" in refused(reads_past_an_argument, (shared[:8],))

    def recordable(x, y):
        out = torch.empty((2, 8))
        kernel(x, y[2:], out[1], 3, 0.5, None)
        return out[1:]

    with torch.inference_mode():
        result, program, why_not = launch_recording.record(recordable, (a, b))
    assert why_not is None
    assert program.buffers == [((2, 8), (8, 1), torch.float32)]
    ((_, arguments, writes_before_wait),) = program.launches
    assert not writes_before_wait
    assert arguments == [
        ("input", 0, 0, (8,), (1,), torch.float32),
        ("input", 1, 8, (6,), (1,), torch.float32),
        ("buffer", 0, 32, (8,), (1,), torch.float32),
        ("int", 3),
        ("float", 0.5),
        ("none",),
    ]
    assert program.results == [("buffer", 0, 8, (1, 8), (8, 1))]
    assert launch_recording.current() is None

    # A tensor within two arguments (the same tensor passed twice, say) is a view of the first of them.
    with torch.inference_mode():
        _, shared_program, why_not = launch_recording.record(reads_overlapping_arguments, (shared[:12], shared[4:]))
    assert why_not is None
    assert shared_program.launches[0][1][0] == ("input", 0, 16, (8,), (1,), torch.float32)

    # Replayed on other tensors: the views at the recorded offsets of those and of a fresh buffer.
    launcher.register_program(b"recordable", "fused_moe", program.buffers, program.launches, program.results)
    c, d = torch.zeros(8), torch.zeros(8)
    replayed = launcher.replay_for_test(b"recordable", "fused_moe", (c, d) + fused_moe_arguments(1, "w4a16", seed=0)[2:])
    assert (replayed.shape, replayed.stride()) == ((1, 8), (8, 1))
    assert kernel.called[-1] == [c.data_ptr(), d.data_ptr() + 8, replayed.data_ptr(), 3, 0.5, None]


def test_a_program_must_point_into_its_own_buffers_and_arguments(launcher):
    handle = tvm_ffi.convert(lambda *args: None).__chandle__()
    buffers = [((4,), (1,), torch.float32)]
    result = [("buffer", 0, 0, (4,), (1,))]
    with pytest.raises(RuntimeError, match="a view of no buffer"):
        launcher.register_program(b"bad", "fused_moe", buffers, [(handle, [("buffer", 1, 0, (4,), (1,), torch.float32)], False)], result)
    with pytest.raises(RuntimeError, match="a view of no input"):
        launcher.register_program(b"bad", "fused_moe", buffers, [(handle, [("input", 99, 0, (4,), (1,), torch.float32)], False)], result)
    with pytest.raises(RuntimeError, match="no tensor"):
        launcher.register_program(b"bad", "fused_moe", buffers, [(handle, [("input", 11, 0, (4,), (1,), torch.float32)], False)], result)
    with pytest.raises(RuntimeError, match="writes before wait"):
        launcher.register_program(b"bad", "fused_moe", buffers, [(handle, [])], result)
    with pytest.raises(RuntimeError, match="returns no buffer"):
        launcher.register_program(b"bad", "fused_moe", buffers, [], [("buffer", 1, 0, (4,), (1,))])
    with pytest.raises(RuntimeError, match="returns 1 tensors, its program 2"):
        launcher.register_program(b"bad", "fused_moe", buffers, [], result * 2)
    assert launcher.replay_for_test(b"bad", "fused_moe", fused_moe_arguments(1, "w4a16", seed=0)) is None


# ---------------------------------------------------------------------------------------------------
# aligned_moe_: in place (returns nothing), and it refuses an `out` that overlaps an input
# ---------------------------------------------------------------------------------------------------
ALIGNED_SCHEMA = torch.ops.fp4moe.aligned_moe_.default._schema
ALIGNED_TOKENS, ALIGNED_K, ALIGNED_N, ALIGNED_EXPERTS, ALIGNED_TOP_K, BLOCK_M = 19, 256, 256, 4, 2, 8


def aligned_arguments(seed, out=None, hidden=None):
    """Every schema argument of an `aligned_moe_` call on prepared weights, 256-byte aligned as the CUDA
    allocator places tensors; `out` and `hidden` may be given (the same shapes and dtypes)."""
    g = torch.Generator().manual_seed(seed)
    tokens, k, n, experts = ALIGNED_TOKENS, ALIGNED_K, ALIGNED_N, ALIGNED_EXPERTS
    codes1, scales1 = weight_layout.prepared_shapes(experts, n, k, gated=True)
    codes2, scales2 = weight_layout.prepared_shapes(experts, k, n // 2, gated=False)
    topk_ids = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)[:, :ALIGNED_TOP_K].to(torch.int32)
    plan = torch.ops.fp4moe.align_block_size(topk_ids, BLOCK_M, experts)
    values = dict(
        out=torch.randn(tokens, k, generator=g).to(torch.bfloat16) if out is None else out,
        hidden=torch.randint(0, 256, (tokens, k // 2), generator=g, dtype=torch.uint8) if hidden is None else hidden,
        hidden_scales=torch.ones(tokens, k // 16).to(torch.float8_e4m3fn),
        w1=torch.empty(codes1, dtype=torch.uint8),
        w1_scales=torch.empty(scales1, dtype=torch.uint8),
        w2=torch.empty(codes2, dtype=torch.uint8),
        w2_scales=torch.empty(scales2, dtype=torch.uint8),
        scale_gate=torch.rand(experts, generator=g),
        scale_up=torch.rand(experts, generator=g),
        scale_down=torch.rand(experts, generator=g),
        sorted_token_ids=plan[0],
        expert_ids=plan[1],
        num_tokens_post_padded=plan[2],
        topk_weights=torch.rand(tokens, ALIGNED_TOP_K, generator=g),
        routed_scaling_factor=2.5,
        block_m=BLOCK_M,
        weight_layout="sm90",
    )
    args = [values.get(a.name, a.default_value if a.has_default_value() else None) for a in ALIGNED_SCHEMA.arguments]
    return tuple(aligned(a) if isinstance(a, torch.Tensor) and a.numel() else a for a in args)


def test_an_in_place_op_is_recorded_and_replayed_returning_nothing(launcher, launches):
    """`aligned_moe_` through the CUDA kernel's own path: recorded on its second call, replayed on the
    next (on other tensors), launching what its Python kernel launches and returning nothing."""
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")
    slow, programs = host_launcher.slow_path_calls(), launcher.recorded_program_count()
    for _ in range(2):
        assert launcher.serve_for_test("aligned_moe_", aligned_arguments(0)) is None
    assert (host_launcher.slow_path_calls(), launcher.recorded_program_count()) == (slow + 2, programs + 1)
    slow += 1
    args = aligned_arguments(1)
    launches.clear()
    with torch.inference_mode(), KeepingAllocations():
        aligned_ops.aligned_moe_(**dict(zip([a.name for a in ALIGNED_SCHEMA.arguments], args, strict=True)))
    expected = canonical(launches, args)
    launches.clear()
    assert launcher.serve_for_test("aligned_moe_", args) is None
    assert host_launcher.slow_path_calls() == slow + 1, "the second call went to Python"
    assert canonical(launches, args) == expected
    assert any(value[:2] == ("argument", [0]) for _, values in expected for value in values if isinstance(value, tuple)), (
        "a launch writes out"
    )


def test_an_op_of_two_results_is_replayed_returning_both(launcher, launches):
    """`route_deepseek_v3` (ids and weights) through the CUDA kernel's own path: recorded on its second
    call, replayed on the next (other logits), launching what its Python kernel launches and returning two
    fresh allocations of the Python kernel's shapes, strides and dtypes. Logits whose elements are not
    contiguous (copied first) and a call without tokens (no launch) stay on the Python path."""
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")
    from fp4moe.ops import routing as routing_ops

    def arguments(seed, tokens=5, transposed=False):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(256, tokens, generator=g).t() if transposed else torch.randn(tokens, 256, generator=g)
        return (aligned(logits), aligned(torch.randn(256, generator=g)), 8, 8, 4, 2.5, True)

    slow, programs = host_launcher.slow_path_calls(), launcher.recorded_program_count()
    for _ in range(2):  # through Python (the second recorded): both results come back from its tuple
        ids, weights = launcher.serve_for_test("route_deepseek_v3", arguments(0))
        assert (ids.dtype, weights.dtype, ids.shape, weights.shape) == (torch.int32, torch.float32, (5, 8), (5, 8))
    assert (host_launcher.slow_path_calls(), launcher.recorded_program_count()) == (slow + 2, programs + 1)
    args = arguments(1)
    launches.clear()
    with torch.inference_mode(), KeepingAllocations():
        expected = routing_ops.route_deepseek_v3(*args)
    expected_launches = canonical(launches, args)
    launches.clear()
    with KeepingAllocations():
        got = launcher.serve_for_test("route_deepseek_v3", args)
    assert host_launcher.slow_path_calls() == slow + 2, "the third call went to Python"
    assert canonical(launches, args) == expected_launches and len(expected_launches) == 1
    assert len(got) == 2 and got[0].data_ptr() != got[1].data_ptr()
    for g, e in zip(got, expected, strict=True):
        assert (g.shape, g.stride(), g.dtype) == (e.shape, e.stride(), e.dtype)
    for unreplayable in (arguments(2, transposed=True), arguments(3, tokens=0)):
        for _ in range(3):
            launcher.serve_for_test("route_deepseek_v3", unreplayable)
    assert host_launcher.slow_path_calls() == slow + 8 and launcher.recorded_program_count() == programs + 1


def test_an_out_overlapping_an_input_changes_the_key_and_is_refused_again(launcher, launches):
    """The key spells which tensors share bytes: a call whose out overlaps hidden (each with the
    metadata of a recorded call) is not replayed but goes to the Python kernel, which refuses it."""
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")
    for _ in range(2):
        launcher.serve_for_test("aligned_moe_", aligned_arguments(2))
    hidden_bytes = ALIGNED_TOKENS * ALIGNED_K // 2
    shared = aligned(torch.zeros(ALIGNED_TOKENS * ALIGNED_K * 2, dtype=torch.uint8))
    apart = aligned_arguments(3)
    overlapping = aligned_arguments(3, out=shared.view(torch.bfloat16).view(ALIGNED_TOKENS, ALIGNED_K), hidden=shared[:hidden_bytes].view(ALIGNED_TOKENS, ALIGNED_K // 2))
    key = launcher.recorded_key_for_test
    assert key("aligned_moe_", apart) == key("aligned_moe_", aligned_arguments(2))
    assert key("aligned_moe_", overlapping) != key("aligned_moe_", apart)
    slow = host_launcher.slow_path_calls()
    with pytest.raises(RuntimeError, match="out overlaps hidden"):
        launcher.serve_for_test("aligned_moe_", overlapping)
    assert host_launcher.slow_path_calls() == slow + 1


def test_a_program_the_launcher_cannot_take_leaves_the_call_s_result_and_a_notice(launcher):
    """A recorded call whose program the launcher refuses (here an int64 tensor, a dtype it passes no
    kernel) still returns its result, warns once, and its key is filed as unreplayable."""
    kernel = _Launches()

    def launches_int64(x):
        out = torch.empty_like(x)
        kernel(x, out)
        return out

    key = b"a program with an int64 tensor"
    x = torch.arange(8)
    with pytest.warns(RuntimeWarning, match="stays on the Python path .*no DLPack dtype"):
        result = host_launcher.serve_recorded_call(key, "fused_moe", launches_int64, (x,))
    assert result.shape == x.shape
    assert launcher.replay_for_test(key, "fused_moe", fused_moe_arguments(1, "w4a16", seed=0)) is None


def test_forgotten_programs_are_recorded_afresh(launcher, launches):
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")
    args = tuple(aligned(a) if isinstance(a, torch.Tensor) else a for a in fused_moe_arguments(3, "w4a16", seed=5, swiglu_beta=0.5))
    for _ in range(3):  # Python, recorded, replayed
        launcher.serve_for_test("fused_moe", args)
    slow = host_launcher.slow_path_calls()
    assert launcher.recorded_program_count() >= 1
    host_launcher.forget_recorded_calls()
    assert launcher.recorded_program_count() == 0
    for _ in range(3):
        launcher.serve_for_test("fused_moe", args)
    assert host_launcher.slow_path_calls() == slow + 2, "once forgotten: Python, recorded, then replayed"


def test_the_cpu_host_benchmark_times_both_paths(launcher, capsys):
    from benchmarks import host_cpu

    assert host_cpu.main(["--calls", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| fused_moe", "| route"))]
    assert [row.split("|")[1].strip() for row in rows] == [f"fused_moe {mode}" for mode in host_cpu.MODES] + ["route_deepseek_v3"]
    assert all(len(row.split("|")) == 7 and "not replayable" not in row for row in rows)
