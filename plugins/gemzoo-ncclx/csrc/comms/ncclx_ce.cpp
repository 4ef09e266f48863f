// gemzoo-ncclx: host-side plumbing of the copy-engine collectives, on raw CUDA runtime handles.
//
// Python (gemzoo_ncclx/cuda.py) drives the schedule; this module only does what Python cannot do cheaply:
// device buffers exported with CUDA IPC, interprocess events, cudaMemcpyAsync on a given stream (the copy
// engines do the work: no kernel, no SM), the peer-access check, and the launch of the reduction kernel
// (ncclx_reduce.cu). It includes no ATen headers, so the JIT build on first CUDA use takes seconds.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ncclx_ce.h"

namespace py = pybind11;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it, so the next call does not fail on our error
    throw std::runtime_error(std::string("ncclx: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

template <typename T>
T* as_ptr(int64_t v) { return reinterpret_cast<T*>(static_cast<uintptr_t>(v)); }

int64_t as_int(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

cudaStream_t as_stream(int64_t v) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(v)); }

int64_t ce_malloc(int64_t nbytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, static_cast<size_t>(nbytes)), "cudaMalloc of the staging buffer");
  return as_int(p);
}

void ce_free(int64_t ptr) { check(cudaFree(as_ptr<void>(ptr)), "cudaFree"); }

// An IPC handle crosses to the peer process as the bytes of its struct.
template <typename Handle>
py::bytes handle_bytes(const Handle& h) { return py::bytes(reinterpret_cast<const char*>(&h), sizeof(h)); }

template <typename Handle>
Handle handle_from_bytes(const std::string& bytes, const char* what) {
  if (bytes.size() != sizeof(Handle)) throw std::runtime_error(std::string("ncclx: bad IPC ") + what + " handle size");
  Handle h;
  memcpy(&h, bytes.data(), sizeof(h));
  return h;
}

py::bytes ipc_mem_handle(int64_t ptr) {
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, as_ptr<void>(ptr)), "cudaIpcGetMemHandle");
  return handle_bytes(h);
}

int64_t ipc_open_mem(const std::string& handle) {
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, handle_from_bytes<cudaIpcMemHandle_t>(handle, "memory"),
                             cudaIpcMemLazyEnablePeerAccess),
        "cudaIpcOpenMemHandle");
  return as_int(p);
}

void ipc_close_mem(int64_t ptr) { check(cudaIpcCloseMemHandle(as_ptr<void>(ptr)), "cudaIpcCloseMemHandle"); }

int64_t event_create(bool interprocess) {
  cudaEvent_t e;
  unsigned flags = cudaEventDisableTiming | (interprocess ? cudaEventInterprocess : 0);
  check(cudaEventCreateWithFlags(&e, flags), "cudaEventCreateWithFlags");
  return as_int(e);
}

py::bytes ipc_event_handle(int64_t ev) {
  cudaIpcEventHandle_t h;
  check(cudaIpcGetEventHandle(&h, as_ptr<CUevent_st>(ev)), "cudaIpcGetEventHandle");
  return handle_bytes(h);
}

int64_t ipc_open_event(const std::string& handle) {
  cudaEvent_t e;
  check(cudaIpcOpenEventHandle(&e, handle_from_bytes<cudaIpcEventHandle_t>(handle, "event")), "cudaIpcOpenEventHandle");
  return as_int(e);
}

void event_record(int64_t ev, int64_t stream) {
  check(cudaEventRecord(as_ptr<CUevent_st>(ev), as_stream(stream)), "cudaEventRecord");
}

void stream_wait_event(int64_t stream, int64_t ev) {
  check(cudaStreamWaitEvent(as_stream(stream), as_ptr<CUevent_st>(ev), 0), "cudaStreamWaitEvent");
}

void event_destroy(int64_t ev) { check(cudaEventDestroy(as_ptr<CUevent_st>(ev)), "cudaEventDestroy"); }

// The data path: one cudaMemcpyAsync, device to device (a peer's IPC-mapped buffer or a local one), on
// `stream`. With peer access the copy engines move it over NVLink; no kernel runs. `kind` is a
// cudaMemcpyKind: cudaMemcpyDefault (4) lets UVA infer it, e.g. for pinned host memory (the bench's H2D/D2H).
void copy_async(int64_t dst, int64_t src, int64_t nbytes, int64_t stream, int kind) {
  if (nbytes <= 0) return;
  if (kind != cudaMemcpyDeviceToDevice && kind != cudaMemcpyDefault && kind != cudaMemcpyHostToDevice &&
      kind != cudaMemcpyDeviceToHost)
    throw std::invalid_argument("ncclx: copy_async kind " + std::to_string(kind) +
                                " is not a cudaMemcpyKind it takes (1 H2D, 2 D2H, 3 D2D, 4 default)");
  check(cudaMemcpyAsync(as_ptr<void>(dst), as_ptr<const void>(src), static_cast<size_t>(nbytes),
                        static_cast<cudaMemcpyKind>(kind), as_stream(stream)),
        "cudaMemcpyAsync");
}

// The same copy through cudaMemcpyBatchAsync (CUDA runtime >= 12.8), a batch of one, with
// cudaMemcpyFlagPreferOverlapWithCompute (ask the driver for a copy engine rather than a copy kernel) and
// cudaMemcpySrcAccessOrderStream (the source is read in stream order, like cudaMemcpyAsync). Compiled in only
// where the toolkit declares it (HAS_COPY_BATCH); the build never fails on an older toolkit. 12.8/12.9 take a
// failIdx argument that 13.0 dropped. An old driver under a new runtime fails at run time (an exception: the
// caller falls back to copy_async).
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
constexpr bool kHasCopyBatch = true;
void copy_batch_async(int64_t dst, int64_t src, int64_t nbytes, int64_t stream) {
  if (nbytes <= 0) return;
  void* dsts[1] = {as_ptr<void>(dst)};
  const void* srcs[1] = {as_ptr<const void>(src)};
  size_t sizes[1] = {static_cast<size_t>(nbytes)};
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attrs.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attrs_idx[1] = {0};
#if CUDART_VERSION >= 13000
  check(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attrs, attrs_idx, 1, as_stream(stream)),
        "cudaMemcpyBatchAsync (PreferOverlapWithCompute)");
#else
  size_t fail_idx = 0;
  check(cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs), sizes, 1, &attrs, attrs_idx, 1,
                             &fail_idx, as_stream(stream)),
        "cudaMemcpyBatchAsync (PreferOverlapWithCompute)");
#endif
}
#else
constexpr bool kHasCopyBatch = false;
void copy_batch_async(int64_t, int64_t, int64_t, int64_t) {
  throw std::runtime_error("ncclx: copy_batch_async needs a CUDA runtime >= 12.8 at build time (cudaMemcpyBatchAsync)");
}
#endif

bool can_access_peer(int device, int peer) {
  if (device == peer) return true;
  int ok = 0;
  check(cudaDeviceCanAccessPeer(&ok, device, peer), "cudaDeviceCanAccessPeer");
  return ok != 0;
}

bool reduce(int64_t out, const std::vector<int64_t>& srcs, int64_t n, int dtype, int op, int world, int blocks,
            int64_t stream) {
  if (srcs.empty() || srcs.size() > static_cast<size_t>(ncclx::kMaxRanks)) return false;
  ncclx::Sources s{};
  for (size_t i = 0; i < srcs.size(); ++i) s.p[i] = as_ptr<const void>(srcs[i]);
  bool ok = ncclx::launch_reduce(as_ptr<void>(out), s, static_cast<int>(srcs.size()), n, dtype, op, world, blocks,
                                 as_stream(stream));
  if (ok) check(cudaGetLastError(), "the reduction kernel launch");
  return ok;
}

int sm_count(int device) {
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return n;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gemzoo-ncclx copy-engine plumbing (CUDA IPC buffers and events, cudaMemcpyAsync, cudaMemcpyBatchAsync, "
          "reduction launch)";
  m.def("ce_malloc", &ce_malloc);
  m.def("ce_free", &ce_free);
  m.def("ipc_mem_handle", &ipc_mem_handle);
  m.def("ipc_open_mem", [](py::bytes h) { return ipc_open_mem(std::string(h)); });
  m.def("ipc_close_mem", &ipc_close_mem);
  m.def("event_create", &event_create, py::arg("interprocess"));
  m.def("ipc_event_handle", &ipc_event_handle);
  m.def("ipc_open_event", [](py::bytes h) { return ipc_open_event(std::string(h)); });
  m.def("event_record", &event_record);
  m.def("stream_wait_event", &stream_wait_event);
  m.def("event_destroy", &event_destroy);
  m.def("copy_async", &copy_async, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"),
        py::arg("kind") = static_cast<int>(cudaMemcpyDeviceToDevice), py::call_guard<py::gil_scoped_release>());
  m.def("copy_batch_async", &copy_batch_async, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"),
        py::call_guard<py::gil_scoped_release>());
  m.attr("HAS_COPY_BATCH") = kHasCopyBatch;
  m.attr("CUDART_VERSION") = static_cast<int>(CUDART_VERSION);
  m.def("can_access_peer", &can_access_peer);
  m.def("reduce", &reduce, py::call_guard<py::gil_scoped_release>());
  m.def("sm_count", &sm_count);
  m.attr("MAX_RANKS") = ncclx::kMaxRanks;
}
