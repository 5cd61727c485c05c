// One decode step of a Llama-shaped model in C++ (engine/model/step.py): every layer's RMSNorm, projections,
// rotary embedding, attention over the runs' leases in the KV pool and gated MLP, with no Python between them.
//
// Why: through transformers' modules a step also runs thousands of small ATen ops and their Python; here it is the
// kernel calls plus short loops (measured: docs/models.md, "The decode step").
//
// The formulas are transformers' for LlamaDecoderLayer / Qwen2DecoderLayer (what step.py checks before using this):
//   h = x + o_proj(attention(rope(q), rope(k), v))      with RMSNorm(x) feeding q, k, v
//   x = h + down(silu(gate(n)) * up(n))                  with n = RMSNorm(h)
//   RMSNorm(x) = w * (x * rsqrt(mean(x^2) + eps));  rope: x * cos + rotate_half(x) * sin
// Each row is one run at its own length in its own lease: its new key and value are written at slot
// ``starts[row] + lengths[row]`` and its query attends to its lease's keys 0 .. lengths[row] (no other slot is read).
#include <torch/types.h>  // torch::Tensor and the ATen ops (not torch/extension.h: its nn, optim and data headers
                           // took a third of the build)
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor casters
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias);
torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scale_zero, c10::optional<torch::Tensor> fifth,
                          c10::optional<torch::Tensor> bias);

namespace {

c10::optional<torch::Tensor> given(const torch::Tensor& t) {
  return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// Which product a linear layer runs; engine/model/kernels.py's Kernel holds the same names and values.
enum class Kernel : int64_t { Dense = 0, Int8 = 1, Int4 = 2 };

// A linear layer as engine/model/weights.py keeps it: float32 [out, in] (Dense), the int8 kernel's packing
// (Int8: weight, scales) or the int4 kernel's (Int4: nibbles, scales and zero points, fifth bits or none).
struct Linear {
  Kernel kernel;
  torch::Tensor w, scale, fifth, bias;  // undefined where the layer has none

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kernel) {
      case Kernel::Int8: return int8_matmul(x, w, scale, given(bias));
      case Kernel::Int4: return int4_matmul(x, w, scale, given(fifth), given(bias));
      case Kernel::Dense: break;
    }
    return at::linear(x, w, given(bias));
  }
};

float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  __m512 s = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
  float t = _mm512_reduce_add_ps(s);
  for (; i < d; ++i) t += a[i] * b[i];
  return t;
}

// e^x for x <= 0 (a score less the largest of its row), 16 at a time: Cephes' expf polynomial after x = n ln2 + r;
// below -87.3 (a masked key's -inf too) it is 0
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(y, n));
}

// p[t] = e^(p[t] - top) for t < n; their sum
float exp_shifted(float* p, int64_t n, float top) {
  const __m512 t = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p + i), t));
    _mm512_mask_storeu_ps(p + i, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// out[0 .. 16 DV) = scale * sum over t < keys of p[t] * v[t] (v[t] at vb + t * stride), the sums in registers
template <int DV>
void weighted_sum(const float* p, int64_t keys, const float* vb, int64_t stride, float scale, float* out) {
  __m512 a[DV], b[DV];  // two keys at a time: two chains of sums
  for (int i = 0; i < DV; ++i) a[i] = b[i] = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 2 <= keys; t += 2) {
    const __m512 w0 = _mm512_set1_ps(p[t]), w1 = _mm512_set1_ps(p[t + 1]);
    const float *v0 = vb + t * stride, *v1 = v0 + stride;
    for (int i = 0; i < DV; ++i) {
      a[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * i), a[i]);
      b[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * i), b[i]);
    }
  }
  if (t < keys)
    for (int i = 0; i < DV; ++i)
      a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(vb + t * stride + 16 * i), a[i]);
  for (int i = 0; i < DV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(_mm512_add_ps(a[i], b[i]),
                                                                             _mm512_set1_ps(scale)));
}

// the same for any d
void weighted_sum_any(const float* p, int64_t keys, const float* vb, int64_t stride, float scale, float* out,
                      int64_t d) {
  std::fill(out, out + d, 0.f);
  for (int64_t t = 0; t < keys; ++t)
    for (int64_t i = 0; i < d; ++i) out[i] += p[t] * vb[t * stride + i];
  for (int64_t i = 0; i < d; ++i) out[i] *= scale;
}

// y = RMSNorm(x) row by row, x and y [rows, n]
void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    const float inv = 1.f / std::sqrt(dot(xr, xr, n) / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = w[i] * (xr[i] * inv);
  }
}

// x (one head, d values) rotated in place: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
void rope(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + (-b) * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

}  // namespace

class Decoder {
 public:
  Decoder(torch::Tensor embed, int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, double eps,
          torch::Tensor norm, Linear head)
      : embed_(embed), heads_(heads), kv_heads_(kv_heads), d_(head_dim), scaling_((float)scaling), eps_((float)eps),
        norm_(norm.contiguous()), head_(head) {
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 && embed.dim() == 2, "decoder: float32 embeddings");
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "decoder: heads in groups over the KV heads");
  }

  void add_layer(torch::Tensor ln1, torch::Tensor ln2, std::vector<Linear> qkv, Linear o, Linear gate_up, Linear down) {
    layers_.push_back({ln1.contiguous(), ln2.contiguous(), std::move(qkv), o, gate_up, down});
  }

  // ids [rows] int64; cos, sin [rows, head_dim] float32; kv [layers, 2, 1, kv_heads, slots, head_dim] float32 (the
  // last dimension contiguous): a KV pool, each row's lease from slot starts[row], lengths[row] of its slots written;
  // visible (optional) [rows, >= longest + 1] bool: the keys each row may read (a routed run's focus).
  // Each row's new key and value go to slot starts[row] + lengths[row]. Returns logits [rows, vocab].
  torch::Tensor step(torch::Tensor ids, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv, torch::Tensor starts,
                     torch::Tensor lengths, c10::optional<torch::Tensor> visible) {
    const int64_t rows = ids.size(0), hidden = embed_.size(1), d = d_;
    TORCH_CHECK(kv.scalar_type() == torch::kFloat32 && kv.dim() == 6 && kv.size(0) == (int64_t)layers_.size() &&
                kv.size(2) == 1 && kv.size(3) == kv_heads_ && kv.size(5) == d && kv.stride(5) == 1,
                "decoder: the KV pool's shape");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == rows && cos.size(1) == d &&
                lengths.scalar_type() == torch::kInt64 && lengths.numel() == rows &&
                starts.scalar_type() == torch::kInt64 && starts.numel() == rows, "decoder: positions' shape");
    starts = starts.contiguous();
    lengths = lengths.contiguous();
    const int64_t* len = lengths.data_ptr<int64_t>();
    const int64_t* at = starts.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(len[r] >= 0 && at[r] >= 0 && at[r] + len[r] < kv.size(4), "decoder: KV pool overflow");
    torch::Tensor vis;
    if (visible.has_value() && visible->defined()) {
      vis = visible->to(torch::kBool).contiguous();
      for (int64_t r = 0; r < rows; ++r)
        TORCH_CHECK(vis.dim() == 2 && vis.size(0) == rows && vis.size(1) > len[r], "decoder: the visible keys' shape");
    }
    const bool* seen = vis.defined() ? vis.data_ptr<bool>() : nullptr;
    const int64_t seen_row = vis.defined() ? vis.size(1) : 0;
    const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
    float* kvp = kv.data_ptr<float>();
    const int64_t s_layer = kv.stride(0), s_kv = kv.stride(1), s_head = kv.stride(3), s_pos = kv.stride(4);
    const int64_t q_width = heads_ * d, kv_width = kv_heads_ * d, group = heads_ / kv_heads_;

    torch::Tensor x = embed_.index_select(0, ids).contiguous();  // [rows, hidden], the residual stream
    torch::Tensor n = torch::empty({rows, hidden}, torch::kFloat32);
    torch::Tensor att = torch::empty({rows, q_width}, torch::kFloat32);
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, len[r] + 1);

    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      rms_norm(x.data_ptr<float>(), L.ln1.data_ptr<float>(), eps_, rows, hidden, n.data_ptr<float>());
      std::vector<torch::Tensor> parts;
      for (const Linear& p : L.qkv) parts.push_back(p(n));
      torch::Tensor qkv = parts.size() == 1 ? parts[0] : torch::cat(parts, 1).contiguous();  // [rows, q | k | v]
      float* base = qkv.data_ptr<float>();
      const int64_t width = qkv.size(1);
      float* layer_kv = kvp + l * s_layer;
      for (int64_t r = 0; r < rows; ++r) {
        float* qr = base + r * width;
        for (int64_t h = 0; h < heads_ + kv_heads_; ++h) rope(qr + h * d, cs + r * d, sn + r * d, d);
        for (int64_t h = 0; h < kv_heads_; ++h) {
          float* kd = layer_kv + h * s_head + (at[r] + len[r]) * s_pos;
          std::copy(qr + q_width + h * d, qr + q_width + (h + 1) * d, kd);
          std::copy(qr + q_width + kv_width + h * d, qr + q_width + kv_width + (h + 1) * d, kd + s_kv);
        }
      }
      // attention: one (row, KV head) per task, its group of query heads over keys 0 .. len[row]
      float* ap = att.data_ptr<float>();
      at::parallel_for(0, rows * kv_heads_, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(group * longest);
        std::vector<float> top(group);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t r = task / kv_heads_, g = task % kv_heads_, keys = len[r] + 1;
          const float* kb = layer_kv + g * s_head + at[r] * s_pos;
          const bool* see = seen ? seen + r * seen_row : nullptr;
          const float* vb = kb + s_kv;
          const float* q0 = base + r * width + g * group * d;
          std::fill(top.begin(), top.end(), -INFINITY);
          for (int64_t t = 0; t < keys; ++t) {  // each key read once for the group's heads
            const float* k = kb + t * s_pos;
            for (int64_t j = 0; j < group; ++j) {
              const float s = (see && !see[t]) ? -INFINITY : dot(q0 + j * d, k, d) * scaling_;
              scores[j * keys + t] = s;
              top[j] = std::max(top[j], s);
            }
          }
          for (int64_t j = 0; j < group; ++j) {
            float* p = scores.data() + j * keys;
            const float scale = 1.f / exp_shifted(p, keys, top[j]);
            float* out = ap + r * q_width + (g * group + j) * d;
            if (d == 64) weighted_sum<4>(p, keys, vb, s_pos, scale, out);
            else if (d == 128) weighted_sum<8>(p, keys, vb, s_pos, scale, out);
            else weighted_sum_any(p, keys, vb, s_pos, scale, out, d);
          }
        }
      });
      x.add_(L.o(att));
      rms_norm(x.data_ptr<float>(), L.ln2.data_ptr<float>(), eps_, rows, hidden, n.data_ptr<float>());
      torch::Tensor gu = L.gate_up(n);
      const int64_t inter = gu.size(1) / 2;
      torch::Tensor act = at::silu(gu.narrow(1, 0, inter)).mul_(gu.narrow(1, inter, inter));
      x.add_(L.down(act));
    }
    rms_norm(x.data_ptr<float>(), norm_.data_ptr<float>(), eps_, rows, hidden, n.data_ptr<float>());
    return head_(n);
  }

 private:
  struct Layer {
    torch::Tensor ln1, ln2;
    std::vector<Linear> qkv;  // q, k and v as one or several matrices, their outputs side by side
    Linear o, gate_up, down;
  };
  torch::Tensor embed_;
  int64_t heads_, kv_heads_, d_;
  float scaling_, eps_;
  torch::Tensor norm_;
  Linear head_;
  std::vector<Layer> layers_;
};

void bind_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::enum_<Kernel>(m, "Kernel")
      .value("Dense", Kernel::Dense)
      .value("Int8", Kernel::Int8)
      .value("Int4", Kernel::Int4);
  py::class_<Linear>(m, "Linear")
      .def(py::init([](int64_t kind, torch::Tensor w, c10::optional<torch::Tensor> scale,
                       c10::optional<torch::Tensor> fifth, c10::optional<torch::Tensor> bias) {
             TORCH_CHECK(kind >= (int64_t)Kernel::Dense && kind <= (int64_t)Kernel::Int4,
                         "decoder: a linear layer's kind is a Kernel: 0 (Dense), 1 (Int8) or 2 (Int4)");
             return Linear{static_cast<Kernel>(kind), w, scale.value_or(torch::Tensor()),
                           fifth.value_or(torch::Tensor()), bias.value_or(torch::Tensor())};
           }),
           py::arg("kind"), py::arg("w"), py::arg("scale") = py::none(), py::arg("fifth") = py::none(),
           py::arg("bias") = py::none())
      .def("__call__", &Linear::operator());
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<torch::Tensor, int64_t, int64_t, int64_t, double, double, torch::Tensor, Linear>())
      .def("add_layer", &Decoder::add_layer)
      .def("step", &Decoder::step, py::arg("ids"), py::arg("cos"), py::arg("sin"), py::arg("kv"), py::arg("starts"),
           py::arg("lengths"), py::arg("visible") = py::none(), py::call_guard<py::gil_scoped_release>());
}
