// The gemzoo op library: schemas (TORCH_LIBRARY) and the Python module gemzoo._C.
// Kernels live by family in jagged/, mx/, hadamard/, attention/; fake kernels and autograd are
// registered in Python (gemzoo/ops.py).
#include <Python.h>
#include <torch/library.h>

#define GEMZOO_STR2(x) #x
#define GEMZOO_STR(x) GEMZOO_STR2(x)
#ifdef GEMZOO_TORCH_VERSION_TOKENS
#define GEMZOO_TORCH_VERSION GEMZOO_STR(GEMZOO_TORCH_VERSION_TOKENS)
#else
#define GEMZOO_TORCH_VERSION "unknown"
#endif

TORCH_LIBRARY(gemzoo, m) {
  m.def("jagged_to_padded(Tensor values, Tensor offsets, SymInt max_len, float pad) -> Tensor");
  m.def("padded_to_jagged(Tensor padded, Tensor offsets, SymInt total) -> Tensor");
  m.def("quantize_mx(Tensor x, int axis, int block, ScalarType elem) -> (Tensor, Tensor)");
  m.def("dequantize_mx(Tensor data, Tensor scale, int axis, int block, ScalarType dtype) -> Tensor");
  m.def("hadamard_transform(Tensor x, int block, Tensor? signs, bool inverse) -> Tensor");
  // activation: a code of gemzoo.attention.semantics.ACTIVATION_CODES (enum Activation in
  // attention/jagged_attention.cpp): 0 softmax, 1 silu, 2 gelu, 3 relu, 4 identity, 5 gelu_tanh, 6 relu2,
  // 7 leaky_relu (slope 0.01), 8 hardswish. scale: None in Python is passed as 1/sqrt(D); norm divides the
  // pointwise activations (1.0 = none); window / block_size: -1 = off.
  // rel_positions [P] / rel_time_weights [NB + 1] / q_times [Tq] / k_times [Tk] (int64) / bucket_divisor: the
  // fused relative bias (gemzoo.interfaces.attention.RelativeAttentionBias); None: no bias, or positions only.
  // Returns out [Tq, H, Dv] in fp32 whatever q's dtype, and the logsumexp [H, Tq] (fp32; zeros for pointwise
  // activations) that the backward takes back. The backward returns dq, dk, dv and the gradients of the two
  // bias tables (empty when absent).
  m.def("jagged_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor q_offsets, Tensor k_offsets, bool causal, "
        "int activation, float scale, float norm, int window, int block_size, Tensor? rel_positions=None, "
        "Tensor? rel_time_weights=None, Tensor? q_times=None, Tensor? k_times=None, float bucket_divisor=0.301) "
        "-> (Tensor, Tensor)");
  m.def("jagged_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor q_offsets, Tensor k_offsets, bool causal, int activation, float scale, float norm, int window, "
        "int block_size, Tensor? rel_positions=None, Tensor? rel_time_weights=None, Tensor? q_times=None, "
        "Tensor? k_times=None, float bucket_divisor=0.301) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

static struct PyModuleDef gemzoo_module = {PyModuleDef_HEAD_INIT, "_C",
                                           "gemzoo C++/CUDA ops (registered under torch.ops.gemzoo)", -1,
                                           nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* mod = PyModule_Create(&gemzoo_module);
  if (mod == nullptr) return nullptr;
  PyModule_AddStringConstant(mod, "TORCH_VERSION", GEMZOO_TORCH_VERSION);
#ifdef GEMZOO_WITH_CUDA
  PyModule_AddIntConstant(mod, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(mod, "WITH_CUDA", 0);
#endif
  return mod;
}
