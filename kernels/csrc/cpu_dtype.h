// Loads and stores of float32 / bfloat16 / float16 elements as float (and loads of fp8 e5m2 and e4m3), written on the bit patterns
// (not the c10 classes' conversions) so the compiler vectorizes the loops that use them.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace tandem_cpu {

inline float load(float x) { return x; }
inline float load(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(at::Half x) { return static_cast<float>(x); }
// fp8 e5m2 is the high byte of a float16
inline float load(at::Float8_e5m2 x) {
  return static_cast<float>(at::Half(static_cast<uint16_t>(x.x << 8), at::Half::from_bits()));
}
// fp8 e4m3fn's exponent and mantissa, moved into a float16's, read 2^8 too small (the biases
// differ by 8), subnormals and zero included; its one NaN code never reaches a KV pool (clamped)
inline float load(at::Float8_e4m3fn x) {
  const uint16_t bits = static_cast<uint16_t>(((x.x & 0x7F) << 7) | ((x.x & 0x80) << 8));
  return static_cast<float>(at::Half(bits, at::Half::from_bits())) * 256.f;
}

inline void store(float* dst, float v) { *dst = v; }
inline void store(at::BFloat16* dst, float v) {
  // round to nearest even, as torch's float -> bfloat16 cast does for finite values
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  dst->x = static_cast<uint16_t>(bits >> 16);
}
inline void store(at::Half* dst, float v) { *dst = at::Half(v); }

// what torch gets for one op in scalar_t: computed in float, rounded to scalar_t
template <typename scalar_t>
inline float round_to(float v) {
  scalar_t r;
  store(&r, v);
  return load(r);
}

// float32, bfloat16 or float16: calls fn with a value of that C++ type
template <typename Fn>
void dispatch_float_types(at::ScalarType dtype, const char* what, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    case at::kHalf: fn(at::Half{}); break;
    default: TORCH_CHECK(false, what, ": dtype ", dtype, " is not supported");
  }
}

}  // namespace tandem_cpu
