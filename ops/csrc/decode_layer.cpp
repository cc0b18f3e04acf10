// One decoder layer's decode step in one call: the CPU road's answer to per-op Python and dispatch cost
// (issue 39). A single stream's decode step of SmolLM2-135M spent ~31% of its time (~170 us per layer) in
// Python and torch dispatch around ~12 small ops per layer; here the same ops run back to back from C++.
//
// The decision: this file composes the project's existing kernels through the c10 dispatcher (typed
// handles looked up once), it does not re-implement them. So the fused layer computes exactly what the
// unfused path computes, bit for bit (same kernels, same order, same temporaries' layouts): the weight
// products stay the linear layers' own (`gguf_linear` for GGUF blocks and int8's Q8_0 blocks,
// `panel_linear[_silu_mul]` for fp32 panels), and a kernel improved in its own file is picked up here
// without a change. A dispatcher call costs well under a microsecond; the Python path it replaces costs
// ~5-20 us per op.
//
// The layer (Llama's; model_exec/models/decoder.py decides which layers qualify, model_exec/models/
// fused_decode.py builds `plan`):
//   [residual += hidden;] hidden = rmsnorm(residual) * w_in          (fused_add_rms_norm / rms_norm)
//   qkv = hidden W_qkv^T (+ b)                                        (the layer's linear kernel)
//   rotate-half rope of q|k in place (first rotary_dim features)      (rotate_half_rope)
//   k, v -> paged cache at slot_mapping                               (write_kv_cache)
//   attn = paged decode attention of q (window, soft-cap)             (paged_decode_attention)
//   o = attn W_o^T (+ b); residual += o; h2 = rmsnorm(residual) * w_post
//   act = silu(h2 W_gate^T) * (h2 W_up^T)                             (panel_linear_silu_mul, or linear + silu_and_mul)
//   return (act W_down^T (+ b), residual)
// Every row of the step is a decode row (one new token); tensor parallelism of 1 (no all-reduce here).
//
// plan (int list): [num_heads, num_kv_heads, head_dim, rotary_dim, window, fused_silu, then per linear
// (qkv, o, gate_up, down): kind, segments, out_features, has_bias, then `segments` GGML types (kinds 0, 2)].
// weights (tensor list): [w_in, w_post, then per linear its `segments` weight tensors (kind 2: blocks and packed
// copy per segment), then its bias if any].
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using Tensor = at::Tensor;

constexpr int64_t kKindGguf = 0;    // GGUF blocks (and int8's Q8_0 blocks): one gguf_linear per type segment
constexpr int64_t kKindPanels = 1;  // fp32 16-wide panels: panel_linear
constexpr int64_t kKindGguf16 = 2;  // as kKindGguf, each segment's blocks followed by its gguf_q4x16_pack copy

// The composed ops, found once (all of them are registered by the library's other files by the first call).
struct Ops {
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, double)> fused_add_rms_norm;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&)> rotate_half_rope;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)> write_kv_cache;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                                int64_t, double, const Tensor&)>
      paged_decode_attention;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, const std::optional<Tensor>&, int64_t, const std::optional<Tensor>&)> gguf_linear;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t)> panel_linear;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t)> panel_linear_silu_mul;
};

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

const Ops& ops() {
  static const Ops o{
      find<void(const Tensor&, const Tensor&, const Tensor&, double)>("raytp_cpu::rms_norm"),
      find<void(const Tensor&, const Tensor&, const Tensor&, double)>("raytp_cpu::fused_add_rms_norm"),
      find<void(const Tensor&, const Tensor&, const Tensor&)>("raytp_cpu::rotate_half_rope"),
      find<void(const Tensor&, const Tensor&)>("raytp_cpu::silu_and_mul"),
      find<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("raytp_cpu::write_kv_cache"),
      find<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, int64_t, double,
                const Tensor&)>("raytp_cpu::paged_decode_attention"),
      find<Tensor(const Tensor&, const Tensor&, int64_t, const std::optional<Tensor>&, int64_t, const std::optional<Tensor>&)>("raytp_cpu::gguf_linear"),
      find<Tensor(const Tensor&, const Tensor&, int64_t)>("raytp_cpu::panel_linear"),
      find<Tensor(const Tensor&, const Tensor&, int64_t)>("raytp_cpu::panel_linear_silu_mul"),
  };
  return o;
}

// One linear layer as the plan describes it (views into the call's lists: nothing is copied).
struct Linear {
  int64_t kind = 0, out_features = 0;
  const int64_t* qtypes = nullptr;  // kinds 0 and 2: one GGML type per segment
  const Tensor* weights = nullptr;  // `segments` of them (kind 2: `segments` pairs, blocks then packed copy)
  int64_t segments = 0;
  const Tensor* bias = nullptr;
};

// Reads the plan and the weight list in step, checking every count against what is left.
struct Cursor {
  c10::ArrayRef<int64_t> plan;
  c10::ArrayRef<Tensor> weights;
  size_t p = 0, w = 0;

  int64_t next_int() {
    TORCH_CHECK(p < plan.size(), "decode_layer: the plan ends early");
    return plan[p++];
  }
  const Tensor* next_tensors(int64_t n) {
    TORCH_CHECK(n >= 0 && w + n <= weights.size(), "decode_layer: the weight list ends early");
    const Tensor* t = weights.data() + w;
    w += n;
    return t;
  }
  Linear next_linear() {
    Linear l;
    l.kind = next_int();
    l.segments = next_int();
    l.out_features = next_int();
    const bool has_bias = next_int() != 0;
    TORCH_CHECK(l.kind == kKindGguf || l.kind == kKindGguf16 || (l.kind == kKindPanels && l.segments == 1),
                "decode_layer: unknown linear kind ", l.kind, " with ", l.segments, " segments");
    TORCH_CHECK(l.segments >= 1, "decode_layer: a linear needs at least one weight segment");
    if (l.kind != kKindPanels) {
      TORCH_CHECK(p + l.segments <= plan.size(), "decode_layer: the plan ends early");
      l.qtypes = plan.data() + p;
      p += l.segments;
    }
    l.weights = next_tensors(l.kind == kKindGguf16 ? 2 * l.segments : l.segments);
    if (has_bias) l.bias = next_tensors(1);
    return l;
  }
};

// x [T, in] -> x W^T (+ bias) [T, out_features], as the layer's quantization method's `apply` computes it; GGUF
// blocks on `road` (gguf_dequant_gemm.h's kRoad*).
Tensor linear(const Linear& l, const Tensor& x, int64_t road) {
  const Ops& o = ops();
  Tensor y;
  const int64_t stride = l.kind == kKindGguf16 ? 2 : 1;  // tensors per segment
  const auto segment = [&](int64_t s) {
    return o.gguf_linear.call(x, l.weights[stride * s], l.qtypes[s],
                              stride == 2 ? std::optional<Tensor>(l.weights[2 * s + 1]) : std::nullopt, road,
                              std::nullopt);
  };
  if (l.kind == kKindPanels) {
    y = o.panel_linear.call(x, l.weights[0], l.out_features);
  } else if (l.segments == 1) {
    y = segment(0);
  } else {  // a layer of mixed GGML types (Q4_K_M files): the segments' outputs side by side
    y = at::empty({x.size(0), l.out_features}, x.options());
    int64_t col = 0;
    for (int64_t s = 0; s < l.segments; ++s) {
      const Tensor part = segment(s);
      y.narrow(1, col, part.size(1)).copy_(part);
      col += part.size(1);
    }
  }
  TORCH_CHECK(y.size(1) == l.out_features, "decode_layer: a linear produced ", y.size(1), " features, the plan says ",
              l.out_features);
  if (l.bias != nullptr) y.add_(*l.bias);
  return y;
}

std::tuple<Tensor, Tensor> decode_layer(const Tensor& hidden, const std::optional<Tensor>& residual,
                                        c10::ArrayRef<Tensor> weights, c10::ArrayRef<int64_t> plan, double eps,
                                        double scale, double soft_cap, const Tensor& cos, const Tensor& sin,
                                        const Tensor& key_cache, const Tensor& value_cache, const Tensor& slot_mapping,
                                        const Tensor& block_tables, const Tensor& seq_lens, int64_t gguf_road) {
  const Ops& o = ops();
  Cursor c{plan, weights};
  const int64_t num_heads = c.next_int(), num_kv_heads = c.next_int(), head_dim = c.next_int();
  const int64_t rotary_dim = c.next_int(), window = c.next_int();
  const bool fused_silu = c.next_int() != 0;
  const Tensor& w_in = *c.next_tensors(1);
  const Tensor& w_post = *c.next_tensors(1);
  const Linear qkv_proj = c.next_linear(), o_proj = c.next_linear(), gate_up = c.next_linear(), down = c.next_linear();
  TORCH_CHECK(c.p == plan.size() && c.w == weights.size(), "decode_layer: the plan and weight list do not match");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "decode_layer: hidden must be [T, hidden] float32");
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(qkv_proj.out_features == q_size + 2 * kv_size, "decode_layer: qkv_proj's width does not match the heads");
  TORCH_CHECK(rotary_dim > 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0, "decode_layer: bad rotary_dim");

  // [residual += hidden;] hidden = norm(residual): as DecoderLayer.forward, in place where it is
  Tensor h, res;
  if (residual.has_value()) {
    res = *residual;
    o.fused_add_rms_norm.call(hidden, res, w_in, eps);
    h = hidden;
  } else {  // the first layer: the embedding output is the residual stream
    res = hidden;
    h = at::empty_like(hidden);
    o.rms_norm.call(h, hidden, w_in, eps);
  }

  // attention: q|k rotated in place in the projection's own output, k/v written, decode rows attended
  const Tensor qkv = linear(qkv_proj, h, gguf_road);
  const Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
  o.rotate_half_rope.call(rotary_dim == head_dim ? qk : qk.narrow(2, 0, rotary_dim), cos, sin);
  const Tensor q = qk.narrow(1, 0, num_heads);
  const Tensor k = qk.narrow(1, num_heads, num_kv_heads);
  const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  o.write_kv_cache.call(k, v, key_cache, value_cache, slot_mapping);
  const Tensor attn = at::empty({tokens, num_heads, head_dim}, hidden.options());
  o.paged_decode_attention.call(q, key_cache, value_cache, block_tables.narrow(0, 0, tokens),
                                seq_lens.narrow(0, 0, tokens), scale, window, soft_cap, attn);
  const Tensor attn_out = linear(o_proj, attn.view({tokens, q_size}), gguf_road);

  // MLP: residual += attention output; normed; gated SiLU; down
  o.fused_add_rms_norm.call(attn_out, res, w_post, eps);
  Tensor act;
  if (fused_silu) {  // one panel kernel for gate|up and the activation (no bias: the plan only says so then)
    TORCH_CHECK(gate_up.kind == kKindPanels && gate_up.bias == nullptr, "decode_layer: fused SiLU needs bias-free panels");
    act = o.panel_linear_silu_mul.call(attn_out, gate_up.weights[0], gate_up.out_features / 2);
  } else {
    const Tensor gu = linear(gate_up, attn_out, gguf_road);
    act = at::empty({tokens, gate_up.out_features / 2}, hidden.options());
    o.silu_and_mul.call(act, gu);
  }
  return {linear(down, act, gguf_road), res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raytp_cpu, m) {
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor(b!)? residual, Tensor[] weights, int[] plan, float eps, float scale, "
      "float soft_cap, Tensor cos, Tensor sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int gguf_road=0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(raytp_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
