#include "lockstep/kernels/cpu/activations.h"

#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/vecmath.h"

namespace lockstep {
namespace {

// gelu(x) = x * sigmoid(z), z = 2u = x * (k + kc x^2), dz/dx = k + 3kc x^2, with
// k = 2 sqrt(2/pi) and c = 0.044715.
constexpr float kGeluK = 1.5957691216057308f;     // k
constexpr float kGeluKC = 0.07135481627260025f;   // k c
constexpr float kGeluKC3 = 0.21406444881780076f;  // 3 k c

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
  parallel_for(n, [&](int64_t begin, int64_t end) {
    vm::for_lanes(begin, end, [&]<class V>(int64_t i, V) {
      const V x = vm::load<V>(inp + i);
      const V z = x * vm::fma(x * x, vm::splat<V>(kGeluKC), vm::splat<V>(kGeluK));
      vm::store(out + i, x * vm::sigmoid(z));
    });
  });
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  parallel_for(n, [&](int64_t begin, int64_t end) {
    vm::for_lanes(begin, end, [&]<class V>(int64_t i, V) {
      const V x = vm::load<V>(inp + i);
      const V x2 = x * x;
      const V z = x * vm::fma(x2, vm::splat<V>(kGeluKC), vm::splat<V>(kGeluK));
      const V dz = vm::fma(x2, vm::splat<V>(kGeluKC3), vm::splat<V>(kGeluK));
      const V s = vm::sigmoid(z);
      // d/dx x sigmoid(z) = sigmoid(z) + x sigmoid(z) (1 - sigmoid(z)) dz/dx
      const V grad = vm::fma(x * (s * (1.0f - s)), dz, s);
      vm::store(dinp + i, vm::load<V>(dout + i) * grad);
    });
  });
}

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t H) {
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* gate = inp + n * 2 * H;
      const float* up = gate + H;
      float* o = out + n * H;
      vm::for_lanes(0, H, [&]<class V>(int64_t i, V) {
        const V g = vm::load<V>(gate + i);
        vm::store(o + i, (g * vm::sigmoid(g)) * vm::load<V>(up + i));
      });
    }
  });
}

void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t H) {
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* gate = inp + n * 2 * H;
      const float* up = gate + H;
      const float* dy = dout + n * H;
      float* dgate = dinp + n * 2 * H;
      float* dup = dgate + H;
      vm::for_lanes(0, H, [&]<class V>(int64_t i, V) {
        const V g = vm::load<V>(gate + i);
        const V s = vm::sigmoid(g);
        const V gs = g * s;
        const V d = vm::load<V>(dy + i);
        // silu'(g) = s + g s (1 - s)
        vm::store(dgate + i, (d * vm::load<V>(up + i)) * vm::fma(gs, 1.0f - s, s));
        vm::store(dup + i, d * gs);
      });
    }
  });
}

}  // namespace lockstep
