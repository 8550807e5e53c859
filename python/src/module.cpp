// pagedkv._C: the op schemas (TORCH_LIBRARY(pagedkv)) and the Python
// classes (pybind11). The ops' kernels are registered by cache.cpp and
// attention.cpp; the classes' methods are defined there and in
// sequences.cpp. Python's pagedkv/__init__.py wraps what this defines.
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "handles.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/prefix_cache.hpp"
#include "pagedkv/torch_compat.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

// The stateless ops. Mutated arguments carry (a!) annotations; k_scales /
// v_scales (float32, one scale per token slot and head) make a side
// quantized: its pages then hold uint8 fp8-e4m3 or int8 codes.
TORCH_LIBRARY(pagedkv, m) {
#if PAGEDKV_TORCH_AT_LEAST(2, 4)
  m.set_python_module("pagedkv._fake");  // where the fake (meta) implementations live
#endif
  m.def(
      "write(Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, Tensor page_table, int start_pos, Tensor k, "
      "Tensor v, str layout=\"NHD\", Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None) -> ()");
  m.def(
      "write.starts(Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, Tensor page_table, Tensor start_pos, "
      "Tensor k, Tensor v, str layout=\"NHD\", Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None) -> ()");
  m.def(
      "gather(Tensor k_cache, Tensor v_cache, int layer, Tensor page_table, int total_len=0, str layout=\"NHD\", "
      "Tensor? k_scales=None, Tensor? v_scales=None, ScalarType? dtype=None) -> (Tensor k, Tensor v)");
  m.def(
      "gather.lengths(Tensor k_cache, Tensor v_cache, int layer, Tensor page_table, Tensor lengths, "
      "str layout=\"NHD\", Tensor? k_scales=None, Tensor? v_scales=None, ScalarType? dtype=None) "
      "-> (Tensor k, Tensor v)");
  m.def(
      "paged_attention(Tensor k_cache, Tensor v_cache, int layer, Tensor page_table, Tensor lengths, Tensor q, "
      "float scale=0., str layout=\"NHD\", Tensor? k_scales=None, Tensor? v_scales=None, int window=0, "
      "float softcap=0., Tensor? sinks=None, Tensor? tree_mask=None) -> Tensor");
  m.def(
      "copy_pages(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor src, Tensor dst, str layout=\"NHD\", "
      "Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None) -> ()");
}

namespace {

const char* const kOps[] = {"write", "write.starts", "gather", "gather.lengths", "paged_attention", "copy_pages"};

/// The ops' Autograd kernel: they are not differentiable (KV cache
/// inference), so their outputs never require grad, whatever the inputs;
/// the call goes on below autograd (ADInplaceOrView, then the backend).
/// This is the registration PyTorch asks of a non-differentiable custom op
/// (torch.library.opcheck's autograd_registration_check).
void below_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::AutoDispatchBelowAutograd guard;
  op.callBoxed(stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv, Autograd, m) {
  for (const char* op : kOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&below_autograd>());
}
// Mutated arguments get their version counters bumped (autograd sees that
// a tensor it saved was overwritten).
TORCH_LIBRARY_IMPL(pagedkv, ADInplaceOrView, m) {
  for (const char* op : kOps) m.impl(op, torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}

namespace {

using pagedkv_py::Cache;
using pagedkv_py::Prefix;
using pagedkv_py::Sequences;
using pagedkv_py::View;

py::object dtype_object(at::ScalarType t) {
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(t)));
}

py::object tensor_or_none(const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

const char* type_name(const py::object& o) { return Py_TYPE(o.ptr())->tp_name; }

/// PagedCache.bind(page_table, total_len=0, lengths=None): the C++
/// overloads bind(page_table, total_len) and bind(page_table, lengths).
View bind(Cache& cache, const at::Tensor& page_table, const py::object& total_len, const py::object& lengths) {
  const auto is_tensor = [](const py::object& o) { return THPVariable_Check(o.ptr()); };
  if (!lengths.is_none()) {
    TORCH_CHECK(is_tensor(lengths), "pagedkv::PagedCache<", cache.layout(),
                ">::bind: argument 'lengths' expected a [B] tensor, got ", type_name(lengths));
    TORCH_CHECK(!is_tensor(total_len) && py::cast<int64_t>(total_len) == 0, "pagedkv::PagedCache<", cache.layout(),
                ">::bind: arguments 'total_len' and 'lengths' expected one or the other, got both");
    return cache.bind(page_table, py::cast<at::Tensor>(lengths));
  }
  if (is_tensor(total_len)) return cache.bind(page_table, py::cast<at::Tensor>(total_len));  // C++'s bind(pt, lengths)
  TORCH_CHECK(py::isinstance<py::int_>(total_len), "pagedkv::PagedCache<", cache.layout(),
              ">::bind: argument 'total_len' expected an int (or a [B] tensor of lengths), got ",
              type_name(total_len));
  return cache.bind(page_table, py::cast<int64_t>(total_len));
}

/// pagedkv.paged_attention(view, layer_id, q, scale=0.0, *, window=0,
/// softcap=0.0, sinks=None, tree_mask=None): the options as one
/// AttentionOptions.
at::Tensor view_attention(const View& view, int64_t layer, const at::Tensor& q, double scale, int64_t window,
                          double softcap, const std::optional<at::Tensor>& sinks,
                          const std::optional<at::Tensor>& tree_mask) {
  pagedkv::AttentionOptions options;
  options.scale = scale;
  options.window = window;
  options.softcap = softcap;
  if (sinks.has_value()) options.sinks = *sinks;
  if (tree_mask.has_value()) options.tree_mask = *tree_mask;
  return view.paged_attention(layer, q, options);
}

/// What Python raises for a c10::Error: RuntimeError with the message
/// (without the C++ backtrace), also for c10::IndexError (TORCH_CHECK_INDEX),
/// so that every bad call raises RuntimeError as the ops do.
void translate_errors(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

/// Scope in which the calling thread's kernels take the device-agnostic
/// ATen path (pagedkv::ScopedBackend), for tests: the path CUDA tensors take.
class GenericBackend {
 public:
  void enter() { scope_ = std::make_unique<pagedkv::ScopedBackend>(pagedkv::Backend::generic); }
  void exit(const py::args&) { scope_.reset(); }

 private:
  std::unique_ptr<pagedkv::ScopedBackend> scope_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkv's C++ extension: the PagedCache, CacheView, SequenceTable and PrefixCache classes "
            "(wrapped by the pagedkv package) and the torch.ops.pagedkv operators";
  py::register_local_exception_translator(&translate_errors);
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  py::class_<Cache>(m, "PagedCache")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, const at::Tensor&, const std::string&,
                    const std::string&, const std::string&>(),
           "n_layers"_a, "n_pages"_a, "page_size"_a, "n_kv_heads"_a, "head_dim"_a, "like"_a, "layout"_a,
           "k_format"_a, "v_format"_a)
      .def("alloc", &Cache::alloc, "The lowest free page, ref_count 1; -1 when none is free")
      .def("alloc_n", &Cache::alloc_n, "n"_a,
           "n pages, ascending, each the lowest free; [] and no change when fewer than n are free")
      .def("free", &Cache::free, "page"_a, "ref_count - 1; the page is free again at 0")
      .def("retain", &Cache::retain, "page"_a, "ref_count + 1 on an allocated page")
      .def("ref_count", &Cache::ref_count, "page"_a, "0 for a free page")
      .def("n_free", &Cache::n_free, "Free pages")
      .def("write", py::overload_cast<int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&>(&Cache::write),
           "layer_id"_a, "page_table"_a, "start_pos"_a, "k"_a, "v"_a, nogil,
           "Token s of sequence b goes to position start_pos[b] + s (start_pos: [B] int tensor)")
      .def("write", py::overload_cast<int64_t, const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&>(
                        &Cache::write),
           "layer_id"_a, "page_table"_a, "start_pos"_a, "k"_a, "v"_a, nogil,
           "Token s of every sequence goes to position start_pos + s")
      .def("gather", py::overload_cast<int64_t, const at::Tensor&>(&Cache::gather, py::const_), "layer_id"_a,
           "page_table"_a, nogil,
           "(k, v) [B, T, H, D], T = page_size x the leading columns that map a page in some row; -1 reads zeros")
      .def("gather", py::overload_cast<int64_t, const at::Tensor&, const at::Tensor&>(&Cache::gather, py::const_),
           "layer_id"_a, "page_table"_a, "lengths"_a, nogil,
           "(k, v) [B, max(lengths), H, D], zeros past each length")
      // One overload: pybind11 3.x runs an overload's keep_alive even when that overload did not match
      // (pybind/pybind11#6154), which crashed bind(page_table, 5) when a lengths overload came first.
      .def("bind", &bind, "page_table"_a, "total_len"_a = 0, "lengths"_a = py::none(), py::keep_alive<0, 1>(),
           "A view whose gather returns the first total_len tokens (0 = all), or, given lengths ([B] tensor, "
           "also accepted in total_len's place), uses per-sequence lengths")
      .def("copy_pages", &Cache::copy_pages, "src"_a, "dst"_a, nogil,
           "dst[i] <- src[i] for every layer, k and v (dst pages allocated, distinct, unshared)")
      .def("copy_pages_from", &Cache::copy_pages_from, "other"_a, "src"_a, "dst"_a, nogil,
           "this[dst[i]] <- other[src[i]] for every layer, k and v")
      .def("check", &Cache::check, "Audits every invariant of the pool and the storage; raises on a violation")
      .def_property_readonly("k_cache", &Cache::k_cache, "[n_layers, n_pages, <page>]: the K storage (no copy)")
      .def_property_readonly("v_cache", &Cache::v_cache, "[n_layers, n_pages, <page>]: the V storage (no copy)")
      .def_property_readonly(
          "k_scales", [](const Cache& c) { return tensor_or_none(c.k_scales()); },
          "[n_layers, n_pages, page_size * n_kv_heads] float32 scales of quantized K; None for native K")
      .def_property_readonly(
          "v_scales", [](const Cache& c) { return tensor_or_none(c.v_scales()); },
          "As k_scales, for V")
      .def_property_readonly(
          "k_format", [](const Cache& c) { return std::string(pagedkv::format_name(c.quant().k)); },
          "\"native\", \"fp8_e4m3\" or \"int8\"")
      .def_property_readonly(
          "v_format", [](const Cache& c) { return std::string(pagedkv::format_name(c.quant().v)); },
          "\"native\", \"fp8_e4m3\" or \"int8\"")
      .def_property_readonly(
          "dtype", [](const Cache& c) { return dtype_object(c.dtype()); },
          "The dtype write accepts and gather returns")
      .def_property_readonly(
          "device", [](const Cache& c) { return c.k_cache().device(); }, "The storage's device")
      .def_property_readonly("layout", &Cache::layout, "\"NHD\" or \"HND\"")
      .def_property_readonly("n_layers", &Cache::n_layers)
      .def_property_readonly("n_pages", &Cache::n_pages)
      .def_property_readonly("page_size", &Cache::page_size)
      .def_property_readonly("n_kv_heads", &Cache::n_kv_heads)
      .def_property_readonly("head_dim", &Cache::head_dim);

  py::class_<View>(m, "CacheView")
      .def("write", py::overload_cast<int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&>(
                        &View::write, py::const_),
           "layer_id"_a, "start_pos"_a, "k"_a, "v"_a, nogil)
      .def("write",
           py::overload_cast<int64_t, int64_t, const at::Tensor&, const at::Tensor&>(&View::write, py::const_),
           "layer_id"_a, "start_pos"_a, "k"_a, "v"_a, nogil)
      .def("gather", &View::gather, "layer_id"_a, nogil,
           "(k, v) [B, T, H, D]: the first total_len tokens (0 = every mapped one), or max(lengths) with zeros")
      .def("paged_attention", &view_attention, "layer_id"_a, "q"_a, "scale"_a = 0.0, py::kw_only(), "window"_a = 0,
           "softcap"_a = 0.0, "sinks"_a = py::none(), "tree_mask"_a = py::none(), nogil,
           "pagedkv.paged_attention(self, layer_id, q, scale, window=, softcap=, sinks=, tree_mask=)")
      .def_property_readonly("page_table", &View::page_table)
      .def_property_readonly(
          "lengths", [](const View& v) { return tensor_or_none(v.lengths()); }, "[B], or None (bound with total_len)")
      .def_property_readonly("total_len", &View::total_len);

  m.def("paged_attention", &view_attention, "view"_a, "layer_id"_a, "q"_a, "scale"_a = 0.0, py::kw_only(),
        "window"_a = 0, "softcap"_a = 0.0, "sinks"_a = py::none(), "tree_mask"_a = py::none(), nogil,
        "Causal paged attention: q [B, Sq, n_heads, D] over a view bound with lengths that count the Sq tokens "
        "(written first); scale <= 0 means 1/sqrt(D); window > 0: each query sees its last `window` positions; "
        "softcap > 0: logits become softcap * tanh(logit / softcap); sinks: [n_heads] float32 logits that join "
        "the softmax's denominator; tree_mask: [B, Sq, Sq] bool, which new tokens each query sees. Returns "
        "[B, Sq, n_heads, D]");

  py::class_<pagedkv::PrefixStats>(m, "PrefixStats")
      .def_readonly("lookups", &pagedkv::PrefixStats::lookups)
      .def_readonly("query_tokens", &pagedkv::PrefixStats::query_tokens)
      .def_readonly("hit_tokens", &pagedkv::PrefixStats::hit_tokens)
      .def_readonly("inserted_pages", &pagedkv::PrefixStats::inserted_pages)
      .def_readonly("evicted_pages", &pagedkv::PrefixStats::evicted_pages)
      .def("__repr__", [](const pagedkv::PrefixStats& s) {
        return "PrefixStats(lookups=" + std::to_string(s.lookups) + ", query_tokens=" +
               std::to_string(s.query_tokens) + ", hit_tokens=" + std::to_string(s.hit_tokens) +
               ", inserted_pages=" + std::to_string(s.inserted_pages) +
               ", evicted_pages=" + std::to_string(s.evicted_pages) + ")";
      });

  py::class_<Sequences>(m, "SequenceTable")
      .def(py::init<Cache&, int64_t>(), "cache"_a, "window"_a = 0, py::keep_alive<1, 2>())
      .def("create", &Sequences::create)
      .def("reserve", &Sequences::reserve, "seq"_a, "n_tokens"_a)
      .def("fork", &Sequences::fork, "seq"_a)
      .def("release", &Sequences::release, "seq"_a)
      .def("length", &Sequences::length, "seq"_a)
      .def("prepare_append", &Sequences::prepare_append, "seq"_a, "n_tokens"_a, nogil)
      .def("commit_append", &Sequences::commit_append, "seq"_a, "n_tokens"_a)
      .def("truncate", &Sequences::truncate, "seq"_a, "n_tokens"_a)
      .def("batch", &Sequences::batch, "seqs"_a)
      // A swapped sequence refers to its host table: the table keeps it alive.
      .def("swap_out", &Sequences::swap_out, "seq"_a, "host"_a, py::keep_alive<1, 3>(), nogil)
      .def("swap_in", &Sequences::swap_in, "seq"_a, "host"_a, nogil)
      .def("pages", &Sequences::pages, "seq"_a)
      .def("capacity", &Sequences::capacity, "seq"_a)
      .def("swapped", &Sequences::swapped, "seq"_a)
      .def("contains", &Sequences::contains, "seq"_a)
      .def("size", &Sequences::size)
      .def("window", &Sequences::window)
      .def("check", &Sequences::check);

  py::class_<Prefix>(m, "PrefixCache")
      .def(py::init<Sequences&>(), "seqs"_a, py::keep_alive<1, 2>())
      .def("peek", &Prefix::peek, "tokens"_a, "salt"_a = 0, "max_tokens"_a = -1)
      .def("acquire", &Prefix::acquire, "tokens"_a, "salt"_a = 0, "max_tokens"_a = -1)
      .def("insert", &Prefix::insert, "seq"_a, "tokens"_a, "salt"_a = 0)
      .def("evict", &Prefix::evict, "n_pages"_a)
      .def("clear", &Prefix::clear)
      .def("n_cached", &Prefix::n_cached)
      .def("n_evictable", &Prefix::n_evictable)
      .def("stats", &Prefix::stats)
      .def("reset_stats", &Prefix::reset_stats)
      .def("check", &Prefix::check);

  py::class_<GenericBackend>(m, "_GenericBackend")
      .def(py::init<>())
      .def("__enter__", &GenericBackend::enter)
      .def("__exit__", &GenericBackend::exit);
}
