// Shared by inferlab's CPU kernels: reading bf16/fp32 as fp32, and rounding/storing back.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace inferlab {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to the storage dtype and back, as a separate torch op's output would be.
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const at::BFloat16*) { return static_cast<float>(static_cast<at::BFloat16>(v)); }

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { p[i] = static_cast<at::BFloat16>(v); }

}  // namespace inferlab
