// How a backend without fused bf16 kernels (the CPU; the CUDA backend's non-GEMM ops) runs
// a call that touches bf16 tensors, by backend.h's rule: as one fused kernel of a bf16
// device would. Every bf16 input is widened, exactly, to an f32 shadow; the f32 kernel runs
// on the shadows (and on the call's f32 tensors, unchanged); each bf16 output is rounded to
// nearest even once, when stored. Both backends share this recipe; only where the shadows
// live and what converts them (Bf16Convert: host loops, or device kernels on the backend's
// stream) differ.
//
// The shadows come from a private allocator: they are an artefact of running bf16 through
// f32 kernels, not memory a fused bf16 kernel would hold, so they stay out of the rank's
// ledger (whose bf16 tensors are counted at 2 bytes, as the device keeps them).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/tensor.h"

namespace tpsim {

// dst[n] = src[n] exactly / rounded to nearest even.
void widen_bf16(float* dst, const bf16* src, std::int64_t n);
void round_to_bf16(bf16* dst, const float* src, std::int64_t n);

bool any_bf16(std::initializer_list<const Tensor*> ts);

// Where the shadows' values come from and go: dst and src live in the scratch allocator's
// memory and the tensor's (the same device).
class Bf16Convert {
 public:
  virtual ~Bf16Convert() = default;
  virtual void widen(float* dst, const bf16* src, std::int64_t n) const = 0;
  virtual void round(bf16* dst, const float* src, std::int64_t n) const = 0;
};
class Bf16Widened {
 public:
  // convert null: host memory, widen_bf16 and round_to_bf16.
  explicit Bf16Widened(Allocator& scratch, const Bf16Convert* convert = nullptr)
      : scratch_(scratch), convert_(convert) {}
  Bf16Widened(const Bf16Widened&) = delete;
  Bf16Widened& operator=(const Bf16Widened&) = delete;

  // t itself when it is not bf16; else its f32 shadow, of t's shape and tag:
  Tensor in(const Tensor& t);     // holding t's values (read only)
  Tensor out(const Tensor& t);    // uninitialised (the op overwrites it); rounded by store()
  Tensor inout(const Tensor& t);  // holding t's values; rounded back by store()
  // Rounds every out/inout shadow into its bf16 tensor.
  void store();

 private:
  Tensor shadow(const Tensor& t, bool read);
  struct Pending {
    Tensor dst;     // bf16
    Tensor shadow;  // f32, same shape
  };
  Allocator& scratch_;
  const Bf16Convert* convert_;
  std::vector<Pending> pending_;
};

}  // namespace tpsim
