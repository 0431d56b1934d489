// One token a row from softmax(logits / T), in one call: what engine/sampler.py does with temperature alone.
//
// The torch path is a chain of passes over [N, V] fp32 (divide, softmax, a NaN check, a cumsum accumulated in
// double, searchsorted), each a fresh tensor: 1.3 ms of a 16-sequence step and 3.4 ms of a 64-sequence one on
// SmolLM2's 49,152 logits (benchmarks/step_profile.py). Here a row is read twice and nothing is written but the
// token:
//   1. its max (and whether any logit is NaN or +inf: that row is left to the torch path, which sanitises it);
//   2. e = exp((x - max) / T) 16 at a time, each group's sum kept (-inf logits, e.g. grammar masks, give exactly 0,
//      as does any token whose e would be below ~1e-38);
//   3. the CDF inverted as the torch path inverts it: the first token whose cumulative mass reaches (1 - u) * total,
//      u uniform in [0, 1) from the caller (seeded requests draw it from their own generator). The group sums are
//      walked in double, in the order they were added to the total, so the walk reaches the total exactly; only
//      the one group holding the target is recomputed. Within it, the running sum may round short of the target
//      by an ulp: then the group's last token with mass is drawn (a bias of ~1e-7 of a token's probability, the
//      size of the torch path's own fp32 rounding of its cumsum).
// A token whose e is 0 is never drawn: the target is above the mass before it. T = 0 marks a greedy row: the first
// index of the max, as torch.argmax. Rows are spread over the threads.

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Codes beside token ids in the result.
constexpr int64_t kNoToken = -1;    // every logit -inf: nothing to draw
constexpr int64_t kUnsettled = -2;  // a NaN or +inf logit: the caller's torch path decides

// exp16 holds its input at -87.3 or above; below this the mass is taken as 0, as fp32's exp underflows (to a
// denormal, then 0) a little further down. -inf logits land here too.
constexpr float kMinExponent = -87.f;

// e = exp((x - mx) * inv_t) for the lanes in `mask`, 0 where that exponent is below kMinExponent.
#if defined(INFERLAB_AVX512_BF16)
inline __m512 mass16(const float* x, __mmask16 mask, __m512 mx, __m512 inv_t) {
  const __m512 a = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x), mx), inv_t);
  const __mmask16 live = mask & _mm512_cmp_ps_mask(a, _mm512_set1_ps(kMinExponent), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, inferlab::exp16(a));
}
#endif

// The row's groups of 16: e of each token into `out`, their sum returned.
float group_mass(const float* x, int64_t n, float mx, float inv_t, float* out) {
#if defined(INFERLAB_AVX512_BF16)
  const __m512 e = mass16(x, inferlab::first_lanes(n), _mm512_set1_ps(mx), _mm512_set1_ps(inv_t));
  if (out) _mm512_storeu_ps(out, e);
  return _mm512_reduce_add_ps(e);
#else
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) {
    const float a = i < n ? (x[i] - mx) * inv_t : -kInf;
    const float e = a >= kMinExponent ? std::exp(a) : 0.f;
    if (out) out[i] = e;
    s += e;
  }
  return s;
#endif
}

// The row's max, or NaN if any logit is NaN or +inf.
float row_max(const float* x, int64_t V) {
#if defined(INFERLAB_AVX512_BF16)
  __m512 mx = _mm512_set1_ps(-kInf);
  __mmask16 bad = 0;
  for (int64_t i = 0; i < V; i += kLanes) {
    const __mmask16 m = inferlab::first_lanes(V - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), m, x + i);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, _mm512_set1_ps(kInf), _CMP_EQ_OQ);
    mx = _mm512_max_ps(mx, v);
  }
  return bad ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(mx);
#else
  float mx = -kInf;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i]) || x[i] == kInf) return std::numeric_limits<float>::quiet_NaN();
    mx = std::max(mx, x[i]);
  }
  return mx;
#endif
}

int64_t sample_row(const float* x, int64_t V, float t, float u, std::vector<float>& sums) {
  const float mx = row_max(x, V);
  if (std::isnan(mx)) return kUnsettled;
  if (mx == -kInf) return kNoToken;
  if (t == 0.f) {
    for (int64_t i = 0; i < V; ++i)
      if (x[i] == mx) return i;
  }
  const float inv_t = 1.f / t;
  const int64_t groups = (V + kLanes - 1) / kLanes;
  double total = 0.0;
  for (int64_t g = 0; g < groups; ++g) {
    sums[g] = group_mass(x + g * kLanes, V - g * kLanes, mx, inv_t, nullptr);
    total += sums[g];
  }
  const double target = (1.0 - static_cast<double>(u)) * total;
  double acc = 0.0;
  int64_t g = 0;
  for (; g < groups - 1 && acc + sums[g] < target; ++g) acc += sums[g];
  float e[kLanes];
  group_mass(x + g * kLanes, V - g * kLanes, mx, inv_t, e);
  int64_t last = -1;
  for (int64_t i = 0; i < kLanes && g * kLanes + i < V; ++i) {
    if (e[i] == 0.f) continue;
    acc += e[i];
    last = g * kLanes + i;
    if (acc >= target) break;
  }
  return last;  // the group holds mass (its sum took acc to the target), so last >= 0
}

}  // namespace

// logits [N, V] fp32, temperature [N] fp32 (0: greedy), u [N] fp32 in [0, 1) -> [N] int64: a token id, -1 where
// every logit is -inf, -2 where a logit is NaN or +inf.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat, "logits must be [N, V] float32");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat && temperature.numel() == N && u.scalar_type() ==
                  torch::kFloat && u.numel() == N, "temperature and u must be float32 with one value a row");
  logits = logits.contiguous();
  temperature = temperature.contiguous();
  u = u.contiguous();
  auto out = torch::empty({N}, logits.options().dtype(torch::kLong));
  const float *x = logits.data_ptr<float>(), *t = temperature.data_ptr<float>(), *up = u.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums((V + kLanes - 1) / kLanes);
    for (int64_t r = begin; r < end; ++r) o[r] = sample_row(x + r * V, V, t[r], up[r], sums);
  });
  return out;
}
