// A whole CPU decode step in one call: labkit.core.engine.decode_plan's list of kernel calls, looped over the
// layers here instead of in Python.
//
// DecodePlan records, once, which kernel runs each part of every layer and the tensors it reads; its Python loop
// (DecodePlan.run_layers) then makes ~12 calls a layer, each through pybind11 plus a few tensor views: 0.35-1.3 ms
// of a smollm2-135m step by format (one-off A/Bs), up to a tenth of a quantized step's time. This module holds the same
// records (a DecodeStep built once per plan) and runs the same calls in the same order from C++: the GEMV kernels of
// ../../quant/csrc/gemv_cpu.cpp and the paged K/V write and decode attention of ../../attention/csrc/
// paged_decode_cpu.cpp, included here as sources (LABKIT_KERNELS_ONLY leaves out their own Python modules), so the
// arithmetic is the same code and the tokens the same bits. Built by labkit/core/engine/decode_plan.py (the same
// cache and flags as the kernels' own modules); introduced in notebook 14.
#define LABKIT_KERNELS_ONLY
#include "../../quant/csrc/gemv_cpu.cpp"
#include "../../attention/csrc/paged_decode_cpu.cpp"

#include <string>

namespace {

// One linear layer as a decode step runs it: the GEMV kernel DecodePlan chose, its weight tensors and arguments.
struct PlannedLinear {
  std::string kernel;  // "gemv_f32", "gemv_int8", "gemv_int8_a16", "gemv_int4", "gemv_int4_a16" or "gemv_int4_a8"
  torch::Tensor weight;  // (out, in) float32, (out, in) int8, or (out, in / 2) uint8 packed int4
  c10::optional<torch::Tensor> scales;  // int8: (out,), int4: (out, in / group); float32: none
  int64_t group;  // int4's group size (unused otherwise)
  int64_t grain;  // output rows per thread task
  c10::optional<torch::Tensor> bias;  // (out,), or none

  PlannedLinear(std::string kernel_, torch::Tensor weight_, c10::optional<torch::Tensor> scales_, int64_t group_,
                int64_t grain_, c10::optional<torch::Tensor> bias_)
      : kernel(std::move(kernel_)), weight(std::move(weight_)), scales(std::move(scales_)), group(group_),
        grain(grain_), bias(std::move(bias_)) {
    TORCH_CHECK(kernel == "gemv_f32" || kernel == "gemv_int8" || kernel == "gemv_int8_a16" || kernel == "gemv_int4" ||
                    kernel == "gemv_int4_a16" || kernel == "gemv_int4_a8",
                "unknown GEMV kernel '", kernel, "' (gemv_f32, gemv_int8, gemv_int8_a16, gemv_int4, gemv_int4_a16 or ",
                "gemv_int4_a8)");
    TORCH_CHECK(kernel == "gemv_f32" || scales.has_value(), kernel, " needs its scales");
  }

  torch::Tensor gemv(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual) const {
    if (kernel == "gemv_f32") return gemv_f32(x, weight, grain, residual);
    if (kernel == "gemv_int8") return gemv_int8(x, weight, *scales, grain, residual);
    if (kernel == "gemv_int8_a16") return gemv_int8_a16(x, weight, *scales, grain, residual);
    if (kernel == "gemv_int4") return gemv_int4(x, weight, *scales, group, grain, residual);
    if (kernel == "gemv_int4_a16") return gemv_int4_a16(x, weight, *scales, group, grain, residual);
    return gemv_int4_a8(x, weight, *scales, group, grain, residual);
  }

  // residual + layer(x): the kernel adds the residual as it writes; with a bias, (y + bias) first and then the
  // residual, in DecodePlan's with_bias order (the layer-by-layer path's residual + (y + bias)): the same bits.
  torch::Tensor operator()(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual) const {
    if (!bias.has_value()) return gemv(x, residual);
    torch::Tensor y = gemv(x, c10::nullopt) + *bias;
    return residual.has_value() ? *residual + y : y;
  }
};

struct PlannedLayer {
  torch::Tensor input_norm;  // (hidden,)
  double input_eps;
  PlannedLinear qkv, o_proj;
  torch::Tensor post_norm;
  double post_eps;
  PlannedLinear gate_up, down;
};

// A model's decode step: every layer's calls, in DecodePlan.run_python's order.
class DecodeStep {
 public:
  DecodeStep(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim)
      : n_heads_(n_heads), n_kv_(n_kv_heads), d_(head_dim) {
    TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && head_dim > 0 && n_heads % n_kv_heads == 0,
                "n_heads (", n_heads, ") must be a positive multiple of n_kv_heads (", n_kv_heads, "), head_dim > 0");
  }

  void add_layer(torch::Tensor input_norm, double input_eps, PlannedLinear qkv, PlannedLinear o_proj,
                 torch::Tensor post_norm, double post_eps, PlannedLinear gate_up, PlannedLinear down) {
    layers_.push_back(PlannedLayer{std::move(input_norm), input_eps, std::move(qkv), std::move(o_proj),
                                   std::move(post_norm), post_eps, std::move(gate_up), std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x (N, hidden) the embedded tokens, cos / sin (N, head_dim), one K and one V pool per layer, slot_mapping (N,),
  // block_tables (N, W), context_lens (N,) -> (N, hidden), the last layer's output (before the final norm).
  torch::Tensor run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                    std::vector<torch::Tensor> k_pools, std::vector<torch::Tensor> v_pools,
                    const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                    const torch::Tensor& context_lens, double scale, int64_t num_splits) const {
    TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == num_layers() && v_pools.size() == k_pools.size(),
                "one K and one V pool per layer: ", num_layers(), " layers, ", k_pools.size(), " K and ",
                v_pools.size(), " V pools");
    const int64_t n = x.size(0), q_width = n_heads_ * d_;
    for (int64_t i = 0; i < num_layers(); ++i) {
      const PlannedLayer& layer = layers_[i];
      torch::Tensor h = rms_norm_f32(x, layer.input_norm, layer.input_eps);
      const torch::Tensor qkv = layer.qkv(h, c10::nullopt);  // (N, (n_heads + 2 * n_kv) * d)
      const torch::Tensor qk = rope_f32(qkv, cos, sin, n_heads_ + n_kv_);  // (N, (n_heads + n_kv) * d), rotated
      const torch::Tensor k = qk.slice(1, q_width).view({n, n_kv_, d_});
      const torch::Tensor v = qkv.slice(1, q_width + n_kv_ * d_).view({n, n_kv_, d_});
      write_kv(k_pools[i], v_pools[i], k, v, slot_mapping);
      const torch::Tensor q = qk.slice(1, 0, q_width).view({n, n_heads_, d_}).contiguous();  // a copy if N > 1
      const torch::Tensor out = paged_decode(q, k_pools[i], v_pools[i], block_tables, context_lens, scale, 1,
                                             num_splits);  // (N, n_heads, d)
      x = layer.o_proj(out.view({n, q_width}), x);  // x + o_proj(out)
      h = rms_norm_f32(x, layer.post_norm, layer.post_eps);
      x = layer.down(silu_mul_f32(layer.gate_up(h, c10::nullopt)), x);  // x + down(silu(gate) * up)
    }
    return x;
  }

 private:
  int64_t n_heads_, n_kv_, d_;
  std::vector<PlannedLayer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<PlannedLinear>(m, "PlannedLinear", "one linear layer's GEMV kernel and tensors")
      .def(py::init<std::string, torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t,
                    c10::optional<torch::Tensor>>(),
           py::arg("kernel"), py::arg("weight"), py::arg("scales"), py::arg("group"), py::arg("grain"),
           py::arg("bias"))
      .def_readonly("kernel", &PlannedLinear::kernel);
  py::class_<DecodeStep>(m, "DecodeStep", "a model's decode step as one call (labkit.core.engine.decode_plan)")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"))
      .def("add_layer", &DecodeStep::add_layer)
      .def_property_readonly("num_layers", &DecodeStep::num_layers)
      .def("run", &DecodeStep::run, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_pools"),
           py::arg("v_pools"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"),
           py::arg("scale"), py::arg("num_splits"));
}
