// fp4moe's C++ host launcher: the CUDA kernels of torch.ops.fp4moe.{quantize, quantize_per_token,
// tile_amax} and of the recorded ops (fused_moe) on devices served by the CuTe DSL kernels
// (fp4moe/kernels/host_launcher.py builds and installs it).
//
// A quantization op's call whose configuration has gone through the op's Python kernel once takes the
// fast path, all in C++: read the static configuration off the arguments and spell its key, look up the
// compiled TVM-FFI function filed under that key, allocate the outputs with at::empty by the rules filed
// with it and call the function with DLTensor views, on the current stream. Everything else -- first
// calls (which compile), inputs that need a copy, empty inputs, inputs the op rejects -- goes to the op's
// Python implementation, which validates, raises, copies and compiles exactly as without this launcher.
// So the fast path accepts only arguments that the Python implementation has already accepted in the
// same static configuration, and checks here the per-call facts that configuration does not fix
// (devices, the shapes tying input_amax and the row count to x, alignment, sizes).
//
// What it knows of the ops' contract comes from Python: the numbers its checks need at `install`
// (host_launcher.contract()), and with each kernel the rules of the op's outputs (fp4moe.op_outputs).
// Keys are spelled here only. A call that finds no kernel under its key awaits that key while it runs
// the op's Python kernel; the Python launch layer, having launched the kernel of that call, files it
// under the awaited key (`register_kernel`). So a key needs no counterpart in Python, but must tell apart
// every configuration the launch layer compiles apart: a parameter missing from it would let two
// configurations share one kernel.
//
// A recorded op (several kernels per call, composed in Python) is served by replaying: its key spells
// every argument's metadata, and the first call of a key runs the op's Python kernel under the recorder,
// which files the call's allocations and launches as the key's program (see "Recorded ops" below).
//
// It also takes over the ops' Autograd kernels (the inference-only guard), so that a call in grad
// mode does not enter Python either. The Python kernels are reached through the callables given to
// `install`; the compiled functions through the handles given to `register_kernel` and
// `register_program` (one reference held each).

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace fp4moe {
namespace {

// The numbers of the ops' contract the fast paths' checks need. Python defines each of them once and
// hands them over at `install` (host_launcher.contract() names where each comes from); none is restated here.
struct Contract {
  int64_t amax_row_group = 0;  // rows per entry group of the blocked aux-amax layout
  int64_t vector_bytes = 0;    // activation rows are read this many bytes at a time
  int64_t max_elements = 0;    // the kernels index with 32-bit integers
  int64_t many_elements = 0;   // launches of at least this many elements (M * K) use the other kernel class
  // global_scale_inv and its reciprocal must be normal FP32 numbers. Compared in double, so a value
  // that only rounds into the range goes to Python, which accepts it.
  double min_global_scale_inv = 0;
  double max_global_scale_inv = 0;
};
Contract contract;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// The ops, in the order of host_launcher.OPS (the order `install` takes their Python kernels in).

enum Op { kQuantize, kQuantizePerToken, kTileAmax, kNumOps };
constexpr const char* kOpNames[kNumOps] = {"quantize", "quantize_per_token", "tile_amax"};

Op op_named(const std::string& name) {
  for (int op = 0; op < kNumOps; ++op) {
    if (name == kOpNames[op]) return static_cast<Op>(op);
  }
  TORCH_CHECK(false, "fp4moe host launcher: it serves no op ", name);
}

std::string qualified_name(Op op) { return std::string("fp4moe::") + kOpNames[op]; }

// How many tensors the op returns, read off its schema.
size_t output_count(Op op) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name(op).c_str(), "").schema().returns().size();
}

DLDataType dl_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::BFloat16: return {kDLBfloat, 16, 1};
    case c10::ScalarType::Half: return {kDLFloat, 16, 1};
    case c10::ScalarType::Float: return {kDLFloat, 32, 1};
    case c10::ScalarType::Byte: return {kDLUInt, 8, 1};
    case c10::ScalarType::Int: return {kDLInt, 32, 1};
    case c10::ScalarType::Float8_e4m3fn: return {kDLFloat8_e4m3fn, 8, 1};
    default: TORCH_CHECK(false, "fp4moe host launcher: no DLPack dtype for ", type);
  }
}

// ---------------------------------------------------------------------------------------------
// Output rules (op_outputs.OutputRule): how the fast path allocates an op's outputs from its input.

// One dimension: `size` entries per started group of `group` input rows (op_outputs.RowGroups), or
// `size` itself where `group` is 0 (a fixed size).
struct Dimension {
  int64_t group;
  int64_t size;
};

struct OutputRule {
  c10::ScalarType dtype;
  c10::SmallVector<Dimension, 3> shape;
};

using OutputRules = std::vector<OutputRule>;

// The rules of `op`'s outputs from their Python form: a tuple of (dtype, shape) with each dimension an
// int or a (group, size) pair. Checks them against the op: one rule per returned tensor, dtypes the
// kernels take, sizes that cannot be negative.
OutputRules output_rules(Op op, const py::tuple& rules) {
  const size_t count = output_count(op);
  TORCH_CHECK(rules.size() == count, "fp4moe host launcher: ", kOpNames[op], " returns ", count,
              " tensors, got rules for ", rules.size());
  OutputRules result;
  for (const py::handle item : rules) {
    const auto rule = item.cast<py::tuple>();
    TORCH_CHECK(rule.size() == 2 && THPDtype_Check(rule[0].ptr()),
                "fp4moe host launcher: an output rule is (dtype, shape), got ", py::str(item).cast<std::string>());
    OutputRule output{reinterpret_cast<THPDtype*>(rule[0].ptr())->scalar_type, {}};
    dl_dtype(output.dtype);  // throws for a dtype the kernels do not take
    for (const py::handle dimension : rule[1].cast<py::tuple>()) {
      Dimension d{0, 0};
      if (py::isinstance<py::int_>(dimension)) {
        d.size = dimension.cast<int64_t>();
      } else {
        std::tie(d.group, d.size) = dimension.cast<std::pair<int64_t, int64_t>>();
        TORCH_CHECK(d.group > 0, "fp4moe host launcher: row groups must hold at least one row");
      }
      TORCH_CHECK(d.size >= 0, "fp4moe host launcher: negative size in an output rule");
      output.shape.push_back(d);
    }
    result.push_back(std::move(output));
  }
  return result;
}

at::Tensor allocate(const OutputRule& rule, const at::Tensor& x) {
  c10::SmallVector<int64_t, 3> shape;
  for (const Dimension& d : rule.shape) shape.push_back(d.group == 0 ? d.size : ceil_div(x.size(0), d.group) * d.size);
  return at::empty(shape, x.options().dtype(rule.dtype));
}

// ---------------------------------------------------------------------------------------------
// Registry of compiled functions, keyed by the calls' static configurations (spelled by `join_key`).

// A compiled function and the rules of its op's outputs. It holds one reference to the function, and is
// shared by the registry and the calls using it, so a re-registration never releases a function a call
// is still calling.
class Kernel {
 public:
  Kernel(TVMFFIObjectHandle function, OutputRules outputs) : function_(function), outputs_(std::move(outputs)) {
    TVMFFIObjectIncRef(function_);
  }
  Kernel(const Kernel&) = delete;
  Kernel& operator=(const Kernel&) = delete;
  ~Kernel() { TVMFFIObjectDecRef(function_); }

  TVMFFIObjectHandle function() const { return function_; }

  // The op's N outputs for the input x (registration checked that there are N rules).
  template <size_t N>
  std::array<at::Tensor, N> outputs(const at::Tensor& x) const {
    std::array<at::Tensor, N> result;
    for (size_t i = 0; i < N; ++i) result[i] = allocate(outputs_[i], x);
    return result;
  }

 private:
  TVMFFIObjectHandle function_;
  OutputRules outputs_;
};

// Never destroyed: at exit, releasing its functions could run TVM-FFI code after it is torn down.
struct Registry {
  std::mutex mutex;
  std::unordered_map<std::string, std::shared_ptr<const Kernel>> kernels;
};
Registry& registry = *new Registry;

std::atomic<int64_t> slow_path_calls{0};

// The kernel filed under `key`, or null.
std::shared_ptr<const Kernel> find_kernel(const std::string& key) {
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto it = registry.kernels.find(key);
  return it == registry.kernels.end() ? nullptr : it->second;
}

// The key a call that found no kernel awaits while the op's Python kernel runs it (`call_python`): the
// launch layer files the kernel it launched for that call under it (`register_kernel`). It belongs to
// that one trip into Python on this thread (a nested trip awaits its own key, or none, and restores the
// outer one after) and is taken by the first registration for its op.
class AwaitedKey {
 public:
  AwaitedKey(Op op, std::string key) : op_(op), key_(std::move(key)), outer_(current_) { current_ = this; }
  AwaitedKey(const AwaitedKey&) = delete;
  AwaitedKey& operator=(const AwaitedKey&) = delete;
  ~AwaitedKey() { current_ = outer_; }

  // The awaited key of the trip this thread is in, if it awaits one for `op`.
  static AwaitedKey* of(Op op) {
    return current_ != nullptr && current_->op_ == op && !current_->key_.empty() ? current_ : nullptr;
  }

  std::string take() { return std::exchange(key_, std::string()); }

 private:
  Op op_;
  std::string key_;
  AwaitedKey* outer_;
  static inline thread_local AwaitedKey* current_ = nullptr;
};

bool awaits(const std::string& op) { return AwaitedKey::of(op_named(op)) != nullptr; }

// Files the compiled function `handle` of `op`, with the rules of its outputs, under the key this
// thread's trip into Python awaits for `op` (Python checks `awaits` first).
void register_kernel(const std::string& op_name, int64_t handle, const py::tuple& rules) {
  const Op op = op_named(op_name);
  AwaitedKey* awaited = AwaitedKey::of(op);
  TORCH_CHECK(awaited != nullptr, "fp4moe host launcher: no ", op_name, " call awaits a kernel on this thread");
  auto function = reinterpret_cast<TVMFFIObjectHandle>(handle);
  TORCH_CHECK(function != nullptr, "fp4moe host launcher: null function handle for ", op_name);
  auto kernel = std::make_shared<const Kernel>(function, output_rules(op, rules));
  std::string key = awaited->take();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.kernels[key] = std::move(kernel);  // replaces the kernel of a call that missed it on another thread
}

// The keys kernels are filed under, sorted: the configurations the fast path serves.
std::vector<std::string> registered_keys() {
  std::lock_guard<std::mutex> lock(registry.mutex);
  std::vector<std::string> keys;
  for (const auto& entry : registry.kernels) keys.push_back(entry.first);
  std::sort(keys.begin(), keys.end());
  return keys;
}

// The quantizers have one class of kernels for launches of fewer elements (M * K) than
// `contract.many_elements` and one for the rest; the key spells which.
const char* rows_class(const at::Tensor& x) { return x.size(0) * x.size(1) >= contract.many_elements ? "1" : "0"; }

const char* dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::Float: return "float32";
    default: return nullptr;
  }
}

std::string join_key(std::initializer_list<std::string> parts) {
  std::string key;
  for (const auto& part : parts) {
    if (!key.empty()) key += '|';
    key += part;
  }
  return key;
}

// ---------------------------------------------------------------------------------------------
// Calling a compiled function.

// The argument list of one call: DLTensor views (of torch tensors, whose own metadata the shape and
// strides point into, or of raw memory described elsewhere), None, integers and FP32 scalars.
class Arguments {
 public:
  void tensor(const at::Tensor& t) {
    view(t.data_ptr(), t.device(), static_cast<int32_t>(t.dim()), const_cast<int64_t*>(t.sizes().data()),
         const_cast<int64_t*>(t.strides().data()), dl_dtype(t.scalar_type()));
  }

  // A one-element tensor of any shape, as the [1] tensor the kernels take.
  void one_element(const at::Tensor& t) {
    view(t.data_ptr(), t.device(), 1, const_cast<int64_t*>(&kOne), const_cast<int64_t*>(&kOne),
         dl_dtype(t.scalar_type()));
  }

  void optional_tensor(const std::optional<at::Tensor>& t) {
    if (t.has_value()) {
      tensor(*t);
    } else {
      none();
    }
  }

  // `ndim` sizes and strides at `shape` / `strides`, which must outlive the call.
  void view(void* data, const c10::Device& device, int32_t ndim, int64_t* shape, int64_t* strides, DLDataType dtype) {
    DLTensor& dl = tensors_[count_];
    dl.data = data;
    dl.device = {device.is_cuda() ? kDLCUDA : kDLCPU, static_cast<int32_t>(device.is_cuda() ? device.index() : 0)};
    dl.ndim = ndim;
    dl.dtype = dtype;
    dl.shape = shape;
    dl.strides = strides;
    dl.byte_offset = 0;
    TVMFFIAny& any = next();
    any.type_index = kTVMFFIDLTensorPtr;
    any.v_ptr = &dl;
  }

  void none() { next().type_index = kTVMFFINone; }

  void int64(int64_t value) {
    TVMFFIAny& any = next();
    any.type_index = kTVMFFIInt;
    any.v_int64 = value;
  }

  void float32(float value) { float64(value); }

  void float64(double value) {
    TVMFFIAny& any = next();
    any.type_index = kTVMFFIFloat;
    any.v_float64 = value;
  }

  // Calls `function` (on a CUDA device: on its current torch stream).
  void call(TVMFFIObjectHandle function, const c10::Device& device) {
    TVMFFIStreamHandle previous = nullptr;
    if (device.is_cuda()) {
      void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
      TORCH_CHECK(TVMFFIEnvSetStream(kDLCUDA, device.index(), stream, &previous) == 0,
                  "fp4moe host launcher: could not set the TVM-FFI stream");
    }
    TVMFFIAny result{};
    result.type_index = kTVMFFINone;
    int status = TVMFFIFunctionCall(function, values_.data(), count_, &result);
    if (device.is_cuda()) TVMFFIEnvSetStream(kDLCUDA, device.index(), previous, nullptr);
    if (status != 0) {
      TVMFFIObjectHandle error = nullptr;
      TVMFFIErrorMoveFromRaised(&error);
      std::string message = "fp4moe kernel launch failed";
      if (error != nullptr) {
        const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
        message += ": " + std::string(cell->kind.data, cell->kind.size) + ": " +
                   std::string(cell->message.data, cell->message.size);
        TVMFFIObjectDecRef(error);
      }
      TORCH_CHECK(false, message);
    }
    if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != nullptr) {
      TVMFFIObjectDecRef(result.v_obj);
    }
  }

  static constexpr int kMaxArguments = 32;

 private:
  static constexpr int64_t kOne = 1;

  TVMFFIAny& next() {
    TORCH_CHECK(count_ < kMaxArguments, "fp4moe host launcher: too many arguments");
    TVMFFIAny& any = values_[count_++];
    any = TVMFFIAny{};
    return any;
  }

  std::array<DLTensor, kMaxArguments> tensors_{};  // tensors_[i] backs argument i
  std::array<TVMFFIAny, kMaxArguments> values_{};
  int32_t count_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Per-call checks shared by the ops' fast paths.

bool same_cuda_device(const at::Tensor& t, const at::Tensor& x) { return t.device() == x.device(); }

// Whether FP4MOE_BACKEND leaves each device to its kernels (unset or "auto"). Read on every call, as the
// Python kernels read it: under any other value a call goes to Python, which runs the reference backend
// or raises for a value it does not know.
bool kernels_serve() {
  const char* backend = std::getenv("FP4MOE_BACKEND");
  return backend == nullptr || std::strcmp(backend, "auto") == 0;
}

// x is a CUDA [M, K] activation with M > 0 that the kernels index with 32-bit integers, and the kernels
// serve its device.
bool launchable_activation(const at::Tensor& x) {
  return kernels_serve() && x.is_cuda() && x.dim() == 2 && x.size(0) > 0 && x.numel() <= contract.max_elements &&
         dtype_name(x.scalar_type()) != nullptr;
}

// Rows readable 16 bytes at a time (sm90/arguments.vector_rows returns x itself).
bool vector_rows(const at::Tensor& x) {
  return x.stride(1) == 1 && (x.stride(0) * x.element_size()) % contract.vector_bytes == 0 &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % contract.vector_bytes == 0;
}

// ---------------------------------------------------------------------------------------------
// Slow paths: the ops' Python kernels (set by `install`; never destroyed).

enum Role { kCuda, kAutograd, kNumRoles };
py::object* python_kernels[kNumOps][kNumRoles] = {};

// Runs the Python kernel of `op` in `role`, with `awaited_key` (empty: none) awaited meanwhile.
template <typename Result, typename... Args>
Result call_python(Op op, Role role, std::string awaited_key, const Args&... args) {
  slow_path_calls.fetch_add(1, std::memory_order_relaxed);
  py::gil_scoped_acquire gil;
  AwaitedKey awaited(op, std::move(awaited_key));
  return (*python_kernels[op][role])(args...).template cast<Result>();
}

// ---------------------------------------------------------------------------------------------
// The ops. Each spells the key of a call that the fast path can serve, and calls the kernel filed
// under it; a call without a key or without a kernel goes to Python, awaiting the key if it has one.

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, const at::Tensor& global_scale,
                                            c10::string_view sf_layout, c10::string_view four_over_six) {
  std::string key;
  if (launchable_activation(x) && vector_rows(x) && global_scale.scalar_type() == c10::ScalarType::Float &&
      global_scale.numel() == 1 && same_cuda_device(global_scale, x)) {
    key = join_key({kOpNames[kQuantize], dtype_name(x.scalar_type()), std::to_string(x.size(1)),
                    std::string(sf_layout), std::string(four_over_six), rows_class(x),
                    std::to_string(x.get_device())});
    if (const auto kernel = find_kernel(key)) {
      auto [codes, block_scales] = kernel->outputs<2>(x);
      Arguments args;
      args.tensor(x);
      args.one_element(global_scale);
      args.tensor(codes);
      args.tensor(block_scales);
      for (int i = 0; i < 4; ++i) args.none();
      args.call(kernel->function(), x.device());
      return {std::move(codes), std::move(block_scales)};
    }
  }
  return call_python<std::tuple<at::Tensor, at::Tensor>>(kQuantize, kCuda, std::move(key), x, global_scale,
                                                          std::string(sf_layout), std::string(four_over_six));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_per_token(
    const at::Tensor& x, double global_scale_inv, c10::string_view sf_layout, c10::string_view four_over_six,
    const std::optional<at::Tensor>& input_amax, const std::optional<at::Tensor>& input_amax_valid_rows) {
  bool fast = launchable_activation(x) && vector_rows(x) && global_scale_inv >= contract.min_global_scale_inv &&
              global_scale_inv <= contract.max_global_scale_inv;
  int64_t amax_tiles = 0;
  if (fast && input_amax.has_value()) {
    const at::Tensor& amax = *input_amax;
    fast = amax.scalar_type() == x.scalar_type() && amax.dim() == 3 && same_cuda_device(amax, x) &&
           amax.size(0) == ceil_div(x.size(0), contract.amax_row_group) && amax.size(1) >= 1 &&
           amax.size(2) == contract.amax_row_group && amax.is_contiguous() && amax.numel() <= contract.max_elements;
    amax_tiles = amax.size(1);
  }
  if (fast && input_amax_valid_rows.has_value()) {
    const at::Tensor& count = *input_amax_valid_rows;
    fast = input_amax.has_value() && count.scalar_type() == c10::ScalarType::Int && count.dim() == 1 &&
           count.size(0) == 1 && same_cuda_device(count, x);
  }
  std::string key;
  if (fast) {
    key = join_key({kOpNames[kQuantizePerToken], dtype_name(x.scalar_type()), std::to_string(x.size(1)),
                    std::string(sf_layout), std::string(four_over_six), input_amax.has_value() ? "aux" : "rescan",
                    input_amax_valid_rows.has_value() ? "1" : "0", rows_class(x), std::to_string(amax_tiles),
                    std::to_string(x.get_device())});
    if (const auto kernel = find_kernel(key)) {
      auto [codes, block_scales, per_token_scale] = kernel->outputs<3>(x);
      Arguments args;
      args.tensor(x);
      args.none();
      args.tensor(codes);
      args.tensor(block_scales);
      args.tensor(per_token_scale);
      // RN(1 / global_scale_inv) in FP32, global_scale_inv first rounded to FP32 (semantics §2.2).
      args.float32(1.0f / static_cast<float>(global_scale_inv));
      args.optional_tensor(input_amax);
      args.optional_tensor(input_amax_valid_rows);
      args.call(kernel->function(), x.device());
      return {std::move(codes), std::move(block_scales), std::move(per_token_scale)};
    }
  }
  return call_python<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
      kQuantizePerToken, kCuda, std::move(key), x, global_scale_inv, std::string(sf_layout),
      std::string(four_over_six), input_amax, input_amax_valid_rows);
}

at::Tensor tile_amax(const at::Tensor& x, int64_t tile_n) {
  // Only the widest loads (16 bytes) are launched here; narrower ones go through Python.
  std::string key;
  if (launchable_activation(x) && tile_n >= 1) {
    const int64_t vector = contract.vector_bytes / x.element_size();
    const bool aligned = x.stride(1) == 1 && x.size(1) % vector == 0 && tile_n % vector == 0 &&
                         x.stride(0) % vector == 0 &&
                         reinterpret_cast<uintptr_t>(x.data_ptr()) % contract.vector_bytes == 0;
    if (aligned) {
      key = join_key({kOpNames[kTileAmax], dtype_name(x.scalar_type()), std::to_string(x.size(1)),
                      std::to_string(tile_n), std::to_string(vector), std::to_string(x.get_device())});
      if (const auto kernel = find_kernel(key)) {
        auto [out] = kernel->outputs<1>(x);
        Arguments args;
        args.tensor(x);
        args.tensor(out);
        args.call(kernel->function(), x.device());
        return std::move(out);
      }
    }
  }
  return call_python<at::Tensor>(kTileAmax, kCuda, std::move(key), x, tile_n);
}

// ---------------------------------------------------------------------------------------------
// Recorded ops (host_launcher.RECORDED_OPS): ops whose Python kernel costs more host time than its launches.
// A call's key spells every argument's metadata; a call without a program for its key runs the op's
// Python kernel under the recorder (host_launcher.serve_recorded_call), which records what it allocates
// and launches (fp4moe/kernels/launch_recording.py) and files it as the key's program; a call with one
// replays it here: the same allocations (at::empty_strided) and the same launches, each tensor argument
// the recorded view of an op argument or of an allocation of this call. Only metadata decides what the
// Python kernel does (it reads no tensor's values on the host), so equal keys make equal programs.

struct RecordedView {
  int64_t source = 0;  // the op argument (kInput) or the buffer (kBuffer) it is a view of
  int64_t byte_offset = 0;
  std::vector<int64_t> sizes, strides;
  DLDataType dtype{};
};

struct RecordedArgument {
  enum Kind { kInput, kBuffer, kEmpty, kInt, kFloat, kNone };
  Kind kind = kNone;
  RecordedView view;  // kInput, kBuffer, kEmpty
  int64_t int_value = 0;
  double float_value = 0;
};

struct RecordedBuffer {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
};

// A tensor the op returns: a view of one of the call's buffers.
struct RecordedResult {
  int64_t buffer = 0;
  int64_t offset = 0;  // elements
  std::vector<int64_t> sizes, strides;
};

// A recorded call: its allocations, its launches (holding one reference to each function) and which
// allocations, seen how, it returns.
class Program {
 public:
  Program() = default;
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  ~Program() {
    for (const auto& launch : launches) TVMFFIObjectDecRef(launch.first);
  }

  std::vector<RecordedBuffer> buffers;
  std::vector<std::pair<TVMFFIObjectHandle, std::vector<RecordedArgument>>> launches;
  // Per launch, the buffers a replay allocates just before it (their first launch) and lets go just after
  // it (their last launch, or the one after it where that one writes before it waits; never a result's).
  // A buffer no launch takes is never allocated (other than a result's, allocated at the end). The
  // caching allocator hands a block let go after a launch to later allocations on the same stream,
  // trusting stream order; PDL (`kernels/sm90/pdl.py`) loosens that order. Every kernel waits for its
  // predecessor before it completes, so a kernel's completion implies all earlier ones'; most wait
  // before they touch memory. But a kernel launched beside a predecessor that shares no memory with it
  // writes before it waits (the activation quantizer beside the plan kernel, the aligned MoE's decode
  // beside its setup kernel), and such a predecessor always waits first, then releases it. A block let
  // go right after its last launch i serves launches from i + 1 on: one that waits first touches it once
  // launch i is complete, and one that writes before it waits starts once its predecessor has waited,
  // which completes launch i, unless that predecessor is launch i itself. So a block whose next launch
  // writes before it waits is let go after that launch instead.
  std::vector<std::vector<int64_t>> allocated_before, released_after;
  std::vector<RecordedResult> results;  // one per tensor the op returns; none where it writes an argument in place

  bool returns(int64_t buffer) const {
    return std::any_of(results.begin(), results.end(), [&](const RecordedResult& r) { return r.buffer == buffer; });
  }
};

struct RecordedOps {
  std::mutex mutex;
  std::unordered_map<std::string, std::shared_ptr<const Program>> programs;  // by key
  std::unordered_set<std::string> unreplayable;  // keys whose recorded call was not replayable
  std::unordered_set<std::string> missed_once;   // keys called once, not recorded yet
  std::unordered_map<std::string, std::array<py::object*, kNumRoles>> python_kernels;  // by "fp4moe::<op>"
  py::object* recorder = nullptr;  // host_launcher.serve_recorded_call
};
RecordedOps& recorded_ops = *new RecordedOps;  // never destroyed, as `registry`

// Keys filed at most (programs and unreplayable keys; as many once-called keys, which are forgotten when
// that many have gathered): calls of further configurations go to Python unrecorded, so the registry's
// memory stays bounded.
constexpr size_t kMaxKeys = 4096;

std::shared_ptr<const Program> find_program(const std::string& key) {
  std::lock_guard<std::mutex> lock(recorded_ops.mutex);
  auto it = recorded_ops.programs.find(key);
  return it == recorded_ops.programs.end() ? nullptr : it->second;
}

const c10::FunctionSchema& recorded_schema(const std::string& op_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(("fp4moe::" + op_name).c_str(), "").schema();
}

// Bytes [first, last + 1) of a tensor's elements (empty for a tensor without elements).
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

void append_int(std::string& key, int64_t value) { key.append(reinterpret_cast<const char*>(&value), sizeof value); }

// The key of a recorded op's call: its name, FP4MOE_BACKEND (read on every call, as the Python kernel
// reads it), per argument its kind and metadata (a tensor's dtype, sizes, strides, device and address
// modulo 256, which decides the launch layers' alignment checks; another argument's value), then which
// tensors overlap in memory and by how much. False (no key) where an argument is of a kind the recorder
// does not take, or a tensor is not on the first tensor's CUDA device; `device` is that device.
bool spell_recorded_key(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, std::string& key,
                        c10::Device& device, bool cuda_only = true) {
  key = schema.name();
  key += '\0';
  const char* backend = std::getenv("FP4MOE_BACKEND");
  key += backend == nullptr ? "" : backend;
  key += '\0';
  bool found_device = false;
  c10::SmallVector<std::pair<uintptr_t, uintptr_t>, 16> spans;  // bytes [first, last + 1) of each tensor
  for (const c10::IValue& value : args) {
    if (value.isTensor()) {
      const at::Tensor& t = value.toTensor();
      if (!t.defined() || (cuda_only && !t.is_cuda())) return false;
      spans.push_back(byte_span(t));
      if (!found_device) {
        device = t.device();
        found_device = true;
      } else if (t.device() != device) {
        return false;
      }
      key += 'T';
      append_int(key, static_cast<int64_t>(t.scalar_type()));
      append_int(key, t.dim());
      for (int64_t d = 0; d < t.dim(); ++d) {
        append_int(key, t.size(d));
        append_int(key, t.stride(d));
      }
      append_int(key, static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 256));
    } else if (value.isNone()) {
      key += 'N';
    } else if (value.isBool()) {
      key += value.toBool() ? 't' : 'f';
    } else if (value.isInt()) {
      key += 'i';
      append_int(key, value.toInt());
    } else if (value.isDouble()) {
      key += 'd';
      const double d = value.toDouble();
      key.append(reinterpret_cast<const char*>(&d), sizeof d);
    } else if (value.isString()) {
      const auto text = value.toStringRef();
      key += 's';
      append_int(key, static_cast<int64_t>(text.size()));
      key += text;
    } else {
      return false;
    }
  }
  append_int(key, device.index());  // every tensor's, checked above
  // Which tensors share bytes, and how far apart they start: an op may reject a call by that (aligned_moe_'s
  // out overlapping an input), and the recorder takes a launch's tensor lying in several arguments as a
  // view of the first of them, which is the same view in every call of the key.
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = i + 1; j < spans.size(); ++j) {
      const bool overlap = spans[i].first < spans[j].second && spans[j].first < spans[i].second;
      key += overlap ? '1' : '0';
      if (overlap) append_int(key, static_cast<int64_t>(spans[j].first - spans[i].first));
    }
  }
  return found_device;
}

// A call of `program` for the op arguments `args` on `device`: the tensors it returns.
std::vector<at::Tensor> replay(const Program& program, c10::ArrayRef<c10::IValue> args, const c10::Device& device) {
  std::vector<at::Tensor> buffers(program.buffers.size());
  const auto allocate = [&](int64_t index) {
    const RecordedBuffer& b = program.buffers[index];
    buffers[index] = at::empty_strided(b.sizes, b.strides, at::TensorOptions().dtype(b.dtype).device(device));
  };
  for (size_t launch = 0; launch < program.launches.size(); ++launch) {
    for (const int64_t index : program.allocated_before[launch]) allocate(index);
    const auto& [function, recorded] = program.launches[launch];
    Arguments call;
    for (const RecordedArgument& a : recorded) {
      const RecordedView& v = a.view;
      auto* sizes = const_cast<int64_t*>(v.sizes.data());
      auto* strides = const_cast<int64_t*>(v.strides.data());
      const auto ndim = static_cast<int32_t>(v.sizes.size());
      switch (a.kind) {
        case RecordedArgument::kInput:
        case RecordedArgument::kBuffer: {
          const at::Tensor& base = a.kind == RecordedArgument::kInput ? args[v.source].toTensor() : buffers[v.source];
          call.view(static_cast<char*>(base.data_ptr()) + v.byte_offset, base.device(), ndim, sizes, strides, v.dtype);
          break;
        }
        case RecordedArgument::kEmpty: call.view(nullptr, device, ndim, sizes, strides, v.dtype); break;
        case RecordedArgument::kInt: call.int64(a.int_value); break;
        case RecordedArgument::kFloat: call.float64(a.float_value); break;
        case RecordedArgument::kNone: call.none(); break;
      }
    }
    call.call(function, device);
    for (const int64_t index : program.released_after[launch]) buffers[index].reset();
  }
  std::vector<at::Tensor> results;
  for (const RecordedResult& r : program.results) {
    if (!buffers[r.buffer].defined()) allocate(r.buffer);  // no launch wrote it
    const at::Tensor& buffer = buffers[r.buffer];
    if (r.offset == 0 && buffer.sizes().equals(r.sizes) && buffer.strides().equals(r.strides)) {
      results.push_back(buffer);  // the allocation itself, as the Python kernel returns it
    } else {
      at::AutoDispatchBelowADInplaceOrView not_a_view;  // a fresh tensor to autograd, as the Python kernel's
      results.push_back(buffer.as_strided(r.sizes, r.strides, r.offset));
    }
  }
  return results;
}

std::vector<int64_t> int_list(const py::handle& values) { return values.cast<std::vector<int64_t>>(); }

c10::ScalarType scalar_type_of(const py::handle& dtype) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "fp4moe host launcher: a program names a dtype by a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

// Whether a schema argument is a Tensor or a Tensor?.
bool is_tensor_argument(const c10::Argument& argument) {
  c10::TypePtr type = argument.type();
  if (type->kind() == c10::TypeKind::OptionalType) type = type->castRaw<c10::OptionalType>()->getElementType();
  return type->kind() == c10::TypeKind::TensorType;
}

// ("input" | "buffer", index, byte offset, sizes, strides, dtype) or ("empty", sizes, strides, dtype).
RecordedView view_of(const py::tuple& item, bool empty) {
  RecordedView view;
  const size_t first = empty ? 1 : 3;
  if (!empty) {
    view.source = item[1].cast<int64_t>();
    view.byte_offset = item[2].cast<int64_t>();
  }
  view.sizes = int_list(item[first]);
  view.strides = int_list(item[first + 1]);
  TORCH_CHECK(view.sizes.size() == view.strides.size(), "fp4moe host launcher: a view's sizes and strides differ in rank");
  view.dtype = dl_dtype(scalar_type_of(item[first + 2]));
  return view;
}

// Fills `program`'s allocated_before and released_after from the launches' buffer arguments and whether
// each launch writes before it waits for its predecessor.
void schedule_buffers(Program& program, const std::vector<bool>& writes_before_wait) {
  const size_t launches = program.launches.size();
  constexpr int64_t kUnused = -1;
  std::vector<int64_t> first(program.buffers.size(), kUnused), last(program.buffers.size(), kUnused);
  for (size_t launch = 0; launch < launches; ++launch) {
    for (const RecordedArgument& a : program.launches[launch].second) {
      if (a.kind != RecordedArgument::kBuffer) continue;
      const int64_t index = a.view.source;
      if (first[index] == kUnused) first[index] = static_cast<int64_t>(launch);
      last[index] = static_cast<int64_t>(launch);
    }
  }
  program.allocated_before.assign(launches, {});
  program.released_after.assign(launches, {});
  for (size_t index = 0; index < program.buffers.size(); ++index) {
    if (first[index] == kUnused) continue;
    program.allocated_before[first[index]].push_back(static_cast<int64_t>(index));
    if (!program.returns(static_cast<int64_t>(index))) {
      const int64_t next = last[index] + 1;
      const bool next_writes_first = next < static_cast<int64_t>(launches) && writes_before_wait[next];
      program.released_after[next_writes_first ? next : last[index]].push_back(static_cast<int64_t>(index));  // see Program
    }
  }
}

// Files a recorded call (launch_recording.Program's fields) under `key`. Checks that every index points
// into the program or the op's arguments; the views themselves are the recorder's.
void register_program(const py::bytes& key, const std::string& op_name, const py::list& buffers,
                      const py::list& launches, const py::list& results) {
  const auto& schema = recorded_schema(op_name);
  const auto arguments = static_cast<int64_t>(schema.arguments().size());
  auto program = std::make_shared<Program>();
  for (const py::handle item : buffers) {
    const auto buffer = item.cast<py::tuple>();
    program->buffers.push_back({int_list(buffer[0]), int_list(buffer[1]), scalar_type_of(buffer[2])});
  }
  const auto buffer_count = static_cast<int64_t>(program->buffers.size());
  std::vector<bool> writes_before_wait;
  for (const py::handle item : launches) {
    const auto launch = item.cast<py::tuple>();
    TORCH_CHECK(launch.size() == 3, "fp4moe host launcher: a launch is (function, arguments, writes before wait)");
    writes_before_wait.push_back(launch[2].cast<bool>());
    std::vector<RecordedArgument> recorded;
    for (const py::handle argument : launch[1].cast<py::list>()) {
      const auto a = argument.cast<py::tuple>();
      const auto kind = a[0].cast<std::string>();
      RecordedArgument r;
      if (kind == "input" || kind == "buffer") {
        r.kind = kind == "input" ? RecordedArgument::kInput : RecordedArgument::kBuffer;
        r.view = view_of(a, false);
        const int64_t bound = r.kind == RecordedArgument::kInput ? arguments : buffer_count;
        TORCH_CHECK(r.view.source >= 0 && r.view.source < bound, "fp4moe host launcher: a view of no ", kind);
        TORCH_CHECK(r.kind == RecordedArgument::kBuffer || is_tensor_argument(schema.arguments()[r.view.source]),
                    "fp4moe host launcher: a view of an argument that is no tensor");
      } else if (kind == "empty") {
        r.kind = RecordedArgument::kEmpty;
        r.view = view_of(a, true);
      } else if (kind == "int") {
        r.kind = RecordedArgument::kInt;
        r.int_value = a[1].cast<int64_t>();
      } else if (kind == "float") {
        r.kind = RecordedArgument::kFloat;
        r.float_value = a[1].cast<double>();
      } else {
        TORCH_CHECK(kind == "none", "fp4moe host launcher: no argument kind ", kind);
        r.kind = RecordedArgument::kNone;
      }
      recorded.push_back(std::move(r));
    }
    TORCH_CHECK(recorded.size() <= static_cast<size_t>(Arguments::kMaxArguments),
                "fp4moe host launcher: a launch of ", recorded.size(), " arguments");
    auto function = reinterpret_cast<TVMFFIObjectHandle>(launch[0].cast<int64_t>());
    TORCH_CHECK(function != nullptr, "fp4moe host launcher: null function handle");
    TVMFFIObjectIncRef(function);
    program->launches.emplace_back(function, std::move(recorded));
  }
  TORCH_CHECK(results.size() == schema.returns().size(), "fp4moe host launcher: fp4moe::", op_name, " returns ",
              schema.returns().size(), " tensors, its program ", results.size());
  for (const py::handle item : results) {
    const auto returned = item.cast<py::tuple>();
    TORCH_CHECK(returned.size() == 5 && returned[0].cast<std::string>() == "buffer",
                "fp4moe host launcher: a program returns views of its buffers");
    RecordedResult r{returned[1].cast<int64_t>(), returned[2].cast<int64_t>(), int_list(returned[3]),
                     int_list(returned[4])};
    TORCH_CHECK(r.buffer >= 0 && r.buffer < buffer_count, "fp4moe host launcher: a program returns no buffer of its own");
    program->results.push_back(std::move(r));
  }
  schedule_buffers(*program, writes_before_wait);
  std::lock_guard<std::mutex> lock(recorded_ops.mutex);
  recorded_ops.programs[std::string(key)] = std::move(program);
}

size_t recorded_program_count() {
  std::lock_guard<std::mutex> lock(recorded_ops.mutex);
  return recorded_ops.programs.size();
}

// Files `key` as one whose call was recorded but is not replayable: its later calls go to Python
// without recording (the recorder's dispatch mode costs host time).
void refuse_key(const py::bytes& key) {
  std::lock_guard<std::mutex> lock(recorded_ops.mutex);
  recorded_ops.unreplayable.insert(std::string(key));
}

// Whether a call of `key`, which has no program, is recorded: on the key's second call (a configuration
// seen once, such as a prompt length in eager prefill, costs neither a recording nor a place), unless the
// key was refused before or the registry is full.
bool records(const std::string& key) {
  std::lock_guard<std::mutex> lock(recorded_ops.mutex);
  if (recorded_ops.unreplayable.count(key) != 0 ||
      recorded_ops.programs.size() + recorded_ops.unreplayable.size() >= kMaxKeys) {
    return false;
  }
  if (recorded_ops.missed_once.erase(key) != 0) return true;
  if (recorded_ops.missed_once.size() >= kMaxKeys) recorded_ops.missed_once.clear();
  recorded_ops.missed_once.insert(key);
  return false;
}

// Forgets every program and every key seen (the tests that patch the launch layer's rules: a program
// records the launches of the rules in force when it was recorded, which the key does not spell).
void forget_programs() {
  std::lock_guard<std::mutex> lock(recorded_ops.mutex);
  recorded_ops.programs.clear();
  recorded_ops.unreplayable.clear();
  recorded_ops.missed_once.clear();
}

// The Python kernel of a recorded op in `role`.
py::object& recorded_python_kernel(const c10::OperatorHandle& op, Role role) {
  std::lock_guard<std::mutex> lock(recorded_ops.mutex);
  return *recorded_ops.python_kernels.at(op.schema().name())[role];
}

// Runs `python(*args)` in place of the boxed call on `stack` (its arguments popped, its result, if the
// op returns one, pushed); with the recorder where `key` is given (its Python kernel then runs recorded).
void call_python_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack, py::object& python,
                       const std::string* key) {
  slow_path_calls.fetch_add(1, std::memory_order_relaxed);
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  py::gil_scoped_acquire gil;
  py::tuple values(n);
  size_t i = 0;
  for (const c10::IValue& value : torch::jit::last(*stack, n)) values[i++] = torch::jit::toPyObject(value);
  const std::string& name = schema.name();
  py::object result = key == nullptr ? python(*values)
                                     : (*recorded_ops.recorder)(py::bytes(*key), name.substr(name.find("::") + 2),
                                                                python, values);
  torch::jit::drop(*stack, n);
  const auto& returns = schema.returns();
  if (returns.size() == 1) {
    torch::jit::push(*stack, torch::jit::toIValue(result, returns[0].type()));
  } else if (!returns.empty()) {
    const auto returned = result.cast<py::tuple>();
    TORCH_CHECK(returned.size() == returns.size(), "fp4moe host launcher: ", schema.name(), " returned ",
                returned.size(), " values, its schema ", returns.size());
    for (size_t i = 0; i < returns.size(); ++i) torch::jit::push(*stack, torch::jit::toIValue(returned[i], returns[i].type()));
  }
}

// A recorded op's call on `stack`: replayed where its key has a program, else through the op's Python
// kernel, recorded where `records` says so (a key's second call). `cuda_only`: calls with tensors off
// CUDA have no key (the CUDA kernel's rule; the tests serve CPU calls too).
void serve_recorded(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool cuda_only) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  std::string key;
  c10::Device device(c10::kCUDA);
  if (spell_recorded_key(schema, torch::jit::last(*stack, n), key, device, cuda_only)) {
    if (const auto program = find_program(key)) {
      std::vector<at::Tensor> results = replay(*program, torch::jit::last(*stack, n), device);
      torch::jit::drop(*stack, n);
      for (at::Tensor& result : results) torch::jit::push(*stack, std::move(result));
      return;
    }
    if (records(key)) {
      call_python_boxed(op, stack, recorded_python_kernel(op, kCuda), &key);
      return;
    }
  }
  call_python_boxed(op, stack, recorded_python_kernel(op, kCuda), nullptr);
}

void recorded_op_cuda(const c10::OperatorHandle& op, torch::jit::Stack* stack) { serve_recorded(op, stack, true); }

// The inference-only guard of a recorded op (as the typed ops' below).
void recorded_op_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  if (at::GradMode::is_enabled()) {
    for (const c10::IValue& value : torch::jit::last(*stack, n)) {
      if (value.isTensor() && value.toTensor().defined() && value.toTensor().requires_grad()) {
        call_python_boxed(op, stack, recorded_python_kernel(op, kAutograd), nullptr);
        return;
      }
    }
  }
  at::AutoDispatchBelowAutograd below_autograd;
  op.callBoxed(stack);
}

// Boxed arguments of an op from Python values (tensors, None, bools, ints, floats, strings).
std::vector<c10::IValue> boxed_arguments(const c10::FunctionSchema& schema, const py::tuple& values) {
  TORCH_CHECK(values.size() == schema.arguments().size(), "fp4moe host launcher: ", schema.arguments().size(),
              " arguments expected");
  std::vector<c10::IValue> args;
  for (size_t i = 0; i < values.size(); ++i) {
    args.push_back(torch::jit::toIValue(values[i], schema.arguments()[i].type()));
  }
  return args;
}

// For the tests: the key of a call of `op_name` with these arguments, spelled as for a CUDA call but on
// any device (None where a call has no key).
py::object recorded_key_for_test(const std::string& op_name, const py::tuple& values) {
  const auto& schema = recorded_schema(op_name);
  const auto args = boxed_arguments(schema, values);
  std::string key;
  c10::Device device(c10::kCPU);
  if (!spell_recorded_key(schema, args, key, device, false)) return py::none();
  return py::bytes(key);
}

// Tensors as an op returns them to Python: None, the tensor, or a tuple of them.
py::object as_returned(const std::vector<at::Tensor>& results) {
  if (results.empty()) return py::none();
  if (results.size() == 1) return py::cast(results[0]);
  py::tuple returned(results.size());
  for (size_t i = 0; i < results.size(); ++i) returned[i] = py::cast(results[i]);
  return returned;
}

// For the tests: a call of the recorded op `op_name` served as its CUDA kernel serves one, on any device
// (CPU tensors included): replayed, or through the op's Python kernel (installed), recorded.
py::object serve_for_test(const std::string& op_name, const py::tuple& values) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(("fp4moe::" + op_name).c_str(), "");
  torch::jit::Stack stack = boxed_arguments(op.schema(), values);
  {
    py::gil_scoped_release no_gil;  // as in a dispatcher call: the Python path takes it back
    serve_recorded(op, &stack, false);
  }
  std::vector<at::Tensor> results;
  for (const c10::IValue& value : stack) results.push_back(value.toTensor());
  return as_returned(results);
}

// For the tests: a recorded program replayed outside the dispatcher, on any device (CPU tensors
// included, with TVM-FFI functions of Python callables): what the op returns (`as_returned`), or None
// without a program.
py::object replay_for_test(const py::bytes& key, const std::string& op_name, const py::tuple& values) {
  const auto program = find_program(std::string(key));
  if (program == nullptr) return py::none();
  const auto args = boxed_arguments(recorded_schema(op_name), values);
  for (const c10::IValue& value : args) {
    if (value.isTensor()) {
      return as_returned(replay(*program, args, value.toTensor().device()));
    }
  }
  TORCH_CHECK(false, "fp4moe host launcher: a replay needs a tensor argument");
}

// For the tests: per launch of the program filed under a key, the buffers a replay allocates before it and
// lets go after it (None without a program).
py::object buffer_schedule_for_test(const py::bytes& key) {
  const auto program = find_program(std::string(key));
  if (program == nullptr) return py::none();
  py::list schedule;
  for (size_t launch = 0; launch < program->launches.size(); ++launch) {
    schedule.append(py::make_tuple(program->allocated_before[launch], program->released_after[launch]));
  }
  return schedule;
}

// ---------------------------------------------------------------------------------------------
// Autograd kernels: every op is inference-only (ops/library.py). An input that requires grad, with
// grad mode on, goes to the Python Autograd kernel, which raises; anything else is dispatched below
// autograd.

bool requires_grad(const at::Tensor& t) { return t.requires_grad(); }
bool requires_grad(const std::optional<at::Tensor>& t) { return t.has_value() && t->requires_grad(); }

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(Op op) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name(op).c_str(), "").typed<Signature>();
}

std::tuple<at::Tensor, at::Tensor> quantize_autograd(const at::Tensor& x, const at::Tensor& global_scale,
                                                     c10::string_view sf_layout, c10::string_view four_over_six) {
  if (at::GradMode::is_enabled() && (requires_grad(x) || requires_grad(global_scale))) {
    return call_python<std::tuple<at::Tensor, at::Tensor>>(kQuantize, kAutograd, {}, x, global_scale,
                                                            std::string(sf_layout), std::string(four_over_six));
  }
  static const auto op = op_handle<decltype(quantize)>(kQuantize);
  at::AutoDispatchBelowAutograd below_autograd;
  return op.call(x, global_scale, sf_layout, four_over_six);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_per_token_autograd(
    const at::Tensor& x, double global_scale_inv, c10::string_view sf_layout, c10::string_view four_over_six,
    const std::optional<at::Tensor>& input_amax, const std::optional<at::Tensor>& input_amax_valid_rows) {
  if (at::GradMode::is_enabled() &&
      (requires_grad(x) || requires_grad(input_amax) || requires_grad(input_amax_valid_rows))) {
    return call_python<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
        kQuantizePerToken, kAutograd, {}, x, global_scale_inv, std::string(sf_layout), std::string(four_over_six),
        input_amax, input_amax_valid_rows);
  }
  static const auto op = op_handle<decltype(quantize_per_token)>(kQuantizePerToken);
  at::AutoDispatchBelowAutograd below_autograd;
  return op.call(x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows);
}

at::Tensor tile_amax_autograd(const at::Tensor& x, int64_t tile_n) {
  if (at::GradMode::is_enabled() && requires_grad(x)) {
    return call_python<at::Tensor>(kTileAmax, kAutograd, {}, x, tile_n);
  }
  static const auto op = op_handle<decltype(tile_amax)>(kTileAmax);
  at::AutoDispatchBelowAutograd below_autograd;
  return op.call(x, tile_n);
}

std::unique_ptr<torch::Library> cuda_library, autograd_library;

// Every field of the contract, by name, in the order of `Contract`.
#define FP4MOE_CONTRACT_FIELDS(X)                                                                      \
  X(amax_row_group) X(vector_bytes) X(max_elements) X(many_elements) X(min_global_scale_inv)             \
      X(max_global_scale_inv)

#define FP4MOE_COUNT_FIELD(name) +1
constexpr size_t kContractFields = 0 FP4MOE_CONTRACT_FIELDS(FP4MOE_COUNT_FIELD);
#undef FP4MOE_COUNT_FIELD

Contract contract_from(const py::dict& values) {
  Contract result;
  TORCH_CHECK(values.size() == kContractFields, "fp4moe host launcher: the contract has ", kContractFields,
              " numbers, got ", values.size());
#define FP4MOE_READ_FIELD(name)                                                                          \
  TORCH_CHECK(values.contains(#name), "fp4moe host launcher: the contract lacks " #name);               \
  result.name = values[#name].cast<decltype(result.name)>();                                            \
  TORCH_CHECK(result.name > 0, "fp4moe host launcher: " #name " must be positive");
  FP4MOE_CONTRACT_FIELDS(FP4MOE_READ_FIELD)
#undef FP4MOE_READ_FIELD
  return result;
}

py::dict contract_values() {
  py::dict values;
#define FP4MOE_WRITE_FIELD(name) values[#name] = contract.name;
  FP4MOE_CONTRACT_FIELDS(FP4MOE_WRITE_FIELD)
#undef FP4MOE_WRITE_FIELD
  return values;
}

// Takes over the CUDA and Autograd kernels of the ops (ops.library.hand_over_to_native), keeping the
// Python kernels it is given for the calls it hands back; `values` is host_launcher.contract(),
// `recorder` host_launcher.serve_recorded_call, `recorded` the names of the recorded ops, and `kernels`
// the Python CUDA kernels of host_launcher.OPS and of `recorded`, then their Autograd kernels, in that order.
void install(const py::dict& values, const py::object& recorder, const std::vector<std::string>& recorded,
             const py::args& kernels) {
  TORCH_CHECK(cuda_library == nullptr, "fp4moe host launcher: already installed");
  const size_t ops = kNumOps + recorded.size();
  TORCH_CHECK(kernels.size() == 2 * ops, "fp4moe host launcher: ", 2 * ops, " Python kernels expected, got ",
              kernels.size());
  for (const std::string& name : recorded) {
    const auto& schema = recorded_schema(name);
    for (const c10::Argument& returned : schema.returns()) {
      TORCH_CHECK(returned.type()->kind() == c10::TypeKind::TensorType,
                  "fp4moe host launcher: a recorded op returns tensors or nothing; ", name, " does not");
    }
  }
  contract = contract_from(values);
  for (int op = 0; op < kNumOps; ++op) {
    python_kernels[op][kCuda] = new py::object(kernels[op]);
    python_kernels[op][kAutograd] = new py::object(kernels[ops + op]);
  }
  recorded_ops.recorder = new py::object(recorder);
  for (size_t i = 0; i < recorded.size(); ++i) {
    recorded_ops.python_kernels["fp4moe::" + recorded[i]] = {new py::object(kernels[kNumOps + i]),
                                                              new py::object(kernels[ops + kNumOps + i])};
  }
  cuda_library = std::make_unique<torch::Library>(torch::Library::IMPL, "fp4moe", c10::DispatchKey::CUDA, __FILE__,
                                                  __LINE__);
  cuda_library->impl(kOpNames[kQuantize], TORCH_FN(quantize));
  cuda_library->impl(kOpNames[kQuantizePerToken], TORCH_FN(quantize_per_token));
  cuda_library->impl(kOpNames[kTileAmax], TORCH_FN(tile_amax));
  autograd_library = std::make_unique<torch::Library>(torch::Library::IMPL, "fp4moe", c10::DispatchKey::Autograd,
                                                      __FILE__, __LINE__);
  autograd_library->impl(kOpNames[kQuantize], TORCH_FN(quantize_autograd));
  autograd_library->impl(kOpNames[kQuantizePerToken], TORCH_FN(quantize_per_token_autograd));
  autograd_library->impl(kOpNames[kTileAmax], TORCH_FN(tile_amax_autograd));
  for (const std::string& name : recorded) {
    cuda_library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&recorded_op_cuda>());
    autograd_library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&recorded_op_autograd>());
  }
}

// What the fast path allocates for the input `like` from a kernel of `op` filed with `rules`.
std::vector<at::Tensor> allocate_by_rules(const std::string& op, const py::tuple& rules, const at::Tensor& like) {
  std::vector<at::Tensor> outputs;
  for (const OutputRule& rule : output_rules(op_named(op), rules)) outputs.push_back(allocate(rule, like));
  return outputs;
}

// Calls `function` as a call of `op` that found no kernel runs the op's Python kernel: awaiting `key`.
py::object call_awaiting(const std::string& op, std::string key, const py::function& function) {
  AwaitedKey awaited(op_named(op), std::move(key));
  return function();
}

}  // namespace
}  // namespace fp4moe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp4moe's C++ host launcher for the CuTe DSL kernels (see fp4moe/kernels/host_launcher.py)";
  m.def("install", &fp4moe::install,
        "Register the C++ CUDA and Autograd kernels of quantize, quantize_per_token, tile_amax and the recorded ops");
  m.def("register_program", &fp4moe::register_program,
        "File a recorded call of a recorded op (launch_recording.Program) under its key");
  m.def("recorded_program_count", &fp4moe::recorded_program_count, "How many recorded programs are filed");
  m.def("refuse_key", &fp4moe::refuse_key, "File a key whose recorded call is not replayable (later calls: Python)");
  m.def("forget_programs", &fp4moe::forget_programs, "Forget every recorded program and every key seen");
  m.def("recorded_key_for_test", &fp4moe::recorded_key_for_test,
        "The key of a recorded op's call with these arguments, spelled on any device (None without one)");
  m.def("serve_for_test", &fp4moe::serve_for_test,
        "Serve a call of a recorded op as its CUDA kernel does, on any device (replayed or recorded)");
  m.def("replay_for_test", &fp4moe::replay_for_test,
        "Replay the program filed under a key for these op arguments, outside the dispatcher (None without one)");
  m.def("buffer_schedule_for_test", &fp4moe::buffer_schedule_for_test,
        "Per launch of the program filed under a key: the buffers a replay allocates before it and lets go after it");
  m.def("awaits", &fp4moe::awaits, "Whether a call of the op on this thread awaits a kernel (see register_kernel)");
  m.def("register_kernel", &fp4moe::register_kernel,
        "File a compiled TVM-FFI function of the op, with its outputs' rules, under the key a call awaits");
  m.def("registered_keys", &fp4moe::registered_keys, "The keys of the configurations the fast path serves");
  m.def("allocate", &fp4moe::allocate_by_rules,
        "The outputs the fast path allocates for an input from a kernel of the op filed with these rules");
  m.def("call_awaiting", &fp4moe::call_awaiting,
        "Call a function as the fast path calls an op's Python kernel for a call without a kernel: awaiting its key");
  m.def("contract", &fp4moe::contract_values, "The contract's numbers given to install (zeros before)");
  m.def("slow_path_calls", [] { return fp4moe::slow_path_calls.load(); },
        "How many calls have gone to the Python implementations");
}
