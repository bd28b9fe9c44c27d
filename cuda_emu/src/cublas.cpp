// cuBLAS on the CPU: the GEMMs tpsim calls, column-major, enqueued on the handle's stream.
// Arguments are checked as cuBLAS checks them (CUBLAS_STATUS_INVALID_VALUE); operands are
// range-checked against the device-memory registry, where a device would read or write
// out of bounds (reported as a device fault, like the illegal address it would be).
#include <cublas_v2.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "internal.h"

namespace cuda_emu {
namespace {

struct Blas {
  int device = 0;
  cudaStream_t stream = nullptr;
};

std::mutex g_mu;
std::unordered_map<std::uint64_t, Blas> g_handles;
std::uint64_t g_next = 0x7b000000;

bool lookup(cublasHandle_t h, Blas* out) {
  std::lock_guard lk(g_mu);
  auto it = g_handles.find(reinterpret_cast<std::uintptr_t>(h));
  if (it == g_handles.end()) return false;
  *out = it->second;
  return true;
}

// CUDA_R_16BF storage, and how a device reads and writes it: exact widening to f32, and
// rounding to nearest even (NaN to the canonical 0x7FFF), as cvt.rn.bf16.f32 does.
struct Bf16 {
  std::uint16_t bits;
};
float widen(Bf16 h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
float widen(float x) { return x; }
double widen(double x) { return x; }
void store(float& out, float x) { out = x; }
void store(double& out, double x) { out = x; }
void store(Bf16& out, float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    out.bits = 0x7FFF;
    return;
  }
  out.bits = static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Elements of a column-major rows x cols operand with leading dimension ld.
long long span(int rows, int cols, int ld) {
  return rows == 0 || cols == 0 ? 0 : static_cast<long long>(cols - 1) * ld + rows;
}

template <class T>
std::string check_operand(const char* call, const char* name, const T* p, int rows, int cols,
                          int ld, long long stride, int batch) {
  const long long n = span(rows, cols, ld);
  if (n == 0 || batch == 0) return "";
  for (int b = 0; b < batch; ++b) {
    const std::string why =
        check_device_range(p + stride * b, static_cast<std::size_t>(n) * sizeof(T), name);
    if (!why.empty())
      return std::string(call) + ": operand " + name + " of batch " + std::to_string(b) + " (" +
             std::to_string(rows) + "x" + std::to_string(cols) + ", ld " + std::to_string(ld) +
             "): " + why;
  }
  return "";
}

// How many K slices a call of this shape sums separately (then adds in slice order).
// cuBLAS picks a kernel, and with it a split-K and a summation order, by shape; the
// emulator by default sums every element in k order, whatever the shape, and so could
// never show a result that depends on the shape of the call. TPSIM_EMU_CUBLAS_SPLITK=shape
// makes it depend: 1 to 4 slices, from a hash of (m, n, k), so that calls of different
// shapes round differently (not cuBLAS's rule, which is its own; a test instrument for
// code that must not depend on it). Read at every call, so a test can switch it.
int k_slices(int m, int n, int k) {
  const char* v = std::getenv("TPSIM_EMU_CUBLAS_SPLITK");
  if (!v || std::string(v) != "shape" || k < 8) return 1;
  // mixed so that power-of-two shapes (whose low bits are all 0) still spread
  std::uint64_t h = (static_cast<std::uint64_t>(m) << 42) ^ (static_cast<std::uint64_t>(n) << 21) ^
                    static_cast<std::uint64_t>(k);
  h *= 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return 1 + static_cast<int>(h % 4);
}

// What a call answers, said first: a handle destroyed or never created, an invalid
// argument, a handle whose stream was destroyed.
cublasStatus_t unknown_handle(const char* call, cublasHandle_t h) {
  say(std::string(call) + " on cuBLAS handle " + handle_name(h) + ", which was destroyed or never created");
  return CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t invalid_value(const char* call, const std::string& why) {
  say(std::string(call) + ": " + why + " (CUBLAS_STATUS_INVALID_VALUE)");
  return CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t lost_stream(const char* call, const Blas& blas) {
  say(std::string(call) + ": the handle's stream " + handle_name(blas.stream) + " was destroyed");
  return CUBLAS_STATUS_EXECUTION_FAILED;
}

// One problem's arguments as cuBLAS checks them: "" when valid, else why not.
std::string bad_args(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda,
                     int ldb, int ldc) {
  if (ta > CUBLAS_OP_C || tb > CUBLAS_OP_C) return "unknown transpose";
  if (m < 0 || n < 0 || k < 0) return "a negative size";
  const int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, a_rows))
    return "lda " + std::to_string(lda) + " < max(1, " + std::to_string(a_rows) + ")";
  if (ldb < std::max(1, b_rows))
    return "ldb " + std::to_string(ldb) + " < max(1, " + std::to_string(b_rows) + ")";
  if (ldc < std::max(1, m))
    return "ldc " + std::to_string(ldc) + " < max(1, " + std::to_string(m) + ")";
  return "";
}

// The operands of one problem against the device-memory registry ("" when in range);
// kk is k, or 0 when alpha is 0 (cuBLAS then reads neither A nor B).
template <class AB, class TC>
std::string operand_ranges(const char* call, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int kk, const AB* A, int lda, long long sA, const AB* B, int ldb,
                           long long sB, const TC* C, int ldc, long long sC, int batch) {
  const int a_rows = ta == CUBLAS_OP_N ? m : kk, a_cols = ta == CUBLAS_OP_N ? kk : m;
  const int b_rows = tb == CUBLAS_OP_N ? kk : n, b_cols = tb == CUBLAS_OP_N ? n : kk;
  std::string why = check_operand(call, "A", A, a_rows, kk ? a_cols : 0, lda, sA, batch);
  if (why.empty()) why = check_operand(call, "B", B, b_rows, kk ? b_cols : 0, ldb, sB, batch);
  if (why.empty()) why = check_operand(call, "C", C, m, n, ldc, sC, batch);
  return why;
}

// One column-major product C = al · op(A) · op(B) + be · C, summed in T in k order (or in
// k_slices' slices), C rounded once.
template <class T, class AB, class TC>
void compute(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int kk, T al, const AB* a,
             int lda, const AB* bb, int ldb, T be, TC* c, int ldc) {
  const int slices = k_slices(m, n, kk);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      T acc = T(0);
      for (int sl = 0; sl < slices; ++sl) {
        // slice sl: k in [kk·sl/slices, kk·(sl+1)/slices); one slice is plain k order
        T part = T(0);
        const int l1 = static_cast<int>(static_cast<long long>(kk) * (sl + 1) / slices);
        for (int l = static_cast<int>(static_cast<long long>(kk) * sl / slices); l < l1; ++l) {
          const T x = widen(ta == CUBLAS_OP_N ? a[i + static_cast<long long>(l) * lda]
                                              : a[l + static_cast<long long>(i) * lda]);
          const T y = widen(tb == CUBLAS_OP_N ? bb[l + static_cast<long long>(j) * ldb]
                                              : bb[j + static_cast<long long>(l) * ldb]);
          part += x * y;
        }
        acc = sl == 0 ? part : acc + part;
      }
      TC& out = c[i + static_cast<long long>(j) * ldc];
      // beta 0: C is not read (it may hold NaN), as cuBLAS documents
      store(out, be == T(0) ? al * acc : al * acc + be * T(widen(out)));
    }
}

// AB: the operands' storage type, TC: C's, T: the compute type (alpha, beta, the sums).
template <class T, class AB = T, class TC = T>
cublasStatus_t gemm(const char* call, cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                    int m, int n, int k, const T* alpha, const AB* A, int lda, long long sA,
                    const AB* B, int ldb, long long sB, const T* beta, TC* C, int ldc, long long sC,
                    int batch) {
  Blas blas;
  if (!lookup(h, &blas)) return unknown_handle(call, h);
  const auto invalid = [&](const std::string& why) { return invalid_value(call, why); };
  if (batch < 0) return invalid("a negative size");
  const std::string bad = bad_args(ta, tb, m, n, k, lda, ldb, ldc);
  if (!bad.empty()) return invalid(bad);
  if (!alpha || !beta) return invalid("null alpha or beta");
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  StreamPtr s = stream_of(blas.stream);
  if (!s) return lost_stream(call, blas);
  const T al = *alpha, be = *beta;  // host pointer mode: read at the call
  const int dev = s->device;
  const int kk = al == T(0) ? 0 : k;  // cuBLAS reads neither A nor B when alpha is 0
  const auto ranges = [=]() {
    return operand_ranges(call, ta, tb, m, n, kk, A, lda, sA, B, ldb, sB,
                          static_cast<const TC*>(C), ldc, sC, batch);
  };
  const std::string now = ranges();
  if (!now.empty()) {
    device_fault(dev, cudaErrorIllegalAddress, now);
    return CUBLAS_STATUS_SUCCESS;  // a device reports the fault at the next sync
  }
  enqueue(s, call, [=](bool) {
    if (sticky_error(dev) != cudaSuccess) return true;
    const std::string late = ranges();
    if (!late.empty()) {
      device_fault(dev, cudaErrorIllegalAddress, late + " (when the stream ran it)");
      return true;
    }
    for (int b = 0; b < batch; ++b)
      compute<T>(ta, tb, m, n, kk, al, A + sA * b, lda, B + sB * b, ldb, be, C + sC * b, ldc);
    return true;
  });
  return CUBLAS_STATUS_SUCCESS;
}

// cublasGemmGroupedBatchedEx: group i is group_size[i] problems of one shape, scalars and
// leading dimensions (host arrays, read at the call); the operands' pointers are device
// arrays (Aarray, Barray, Carray: every group's problems in order), read when the stream
// runs the call, as a kernel reads them.
template <class T, class AB, class TC>
cublasStatus_t grouped(const char* call, cublasHandle_t h, const cublasOperation_t* ta,
                       const cublasOperation_t* tb, const int* m, const int* n, const int* k,
                       const T* alpha, const void* const* Aarray, const int* lda,
                       const void* const* Barray, const int* ldb, const T* beta,
                       void* const* Carray, const int* ldc, int groups, const int* group_size) {
  Blas blas;
  if (!lookup(h, &blas)) return unknown_handle(call, h);
  const auto invalid = [&](const std::string& why) { return invalid_value(call, why); };
  if (groups < 0) return invalid("a negative group_count");
  if (groups == 0) return CUBLAS_STATUS_SUCCESS;
  if (!ta || !tb || !m || !n || !k || !alpha || !lda || !ldb || !beta || !ldc || !group_size)
    return invalid("a null host array");
  struct Group {
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldc, size;
    T al, be;
  };
  std::vector<Group> gs(static_cast<std::size_t>(groups));
  long long total = 0;  // problems, over every group
  for (int i = 0; i < groups; ++i) {
    const std::string bad = bad_args(ta[i], tb[i], m[i], n[i], k[i], lda[i], ldb[i], ldc[i]);
    if (!bad.empty()) return invalid("group " + std::to_string(i) + ": " + bad);
    if (group_size[i] < 0) return invalid("group " + std::to_string(i) + ": a negative group_size");
    gs[static_cast<std::size_t>(i)] = {ta[i], tb[i], m[i], n[i], k[i], lda[i], ldb[i], ldc[i],
                                       group_size[i], alpha[i], beta[i]};
    total += group_size[i];
  }
  if (total == 0) return CUBLAS_STATUS_SUCCESS;
  StreamPtr s = stream_of(blas.stream);
  if (!s) return lost_stream(call, blas);
  const int dev = s->device;
  const std::size_t bytes = static_cast<std::size_t>(total) * sizeof(void*);
  // The pointer arrays are device memory: a host array would be an illegal address.
  const auto arrays = [=]() {
    std::string why = check_device_range(Aarray, bytes, "Aarray");
    if (why.empty()) why = check_device_range(Barray, bytes, "Barray");
    if (why.empty()) why = check_device_range(Carray, bytes, "Carray");
    return why.empty() ? why : std::string(call) + ": " + why;
  };
  const std::string now = arrays();
  if (!now.empty()) {
    device_fault(dev, cudaErrorIllegalAddress, now);
    return CUBLAS_STATUS_SUCCESS;  // a device reports the fault at the next sync
  }
  enqueue(s, call, [=](bool) {
    if (sticky_error(dev) != cudaSuccess) return true;
    const std::string late = arrays();
    if (!late.empty()) {
      device_fault(dev, cudaErrorIllegalAddress, late + " (when the stream ran it)");
      return true;
    }
    long long p = 0;  // the problem's index in the pointer arrays
    for (std::size_t i = 0; i < gs.size(); ++i) {
      const Group& g = gs[i];
      const int kk = g.al == T(0) ? 0 : g.k;
      for (int j = 0; j < g.size; ++j, ++p) {
        const auto* A = static_cast<const AB*>(Aarray[p]);
        const auto* B = static_cast<const AB*>(Barray[p]);
        auto* C = static_cast<TC*>(Carray[p]);
        if (g.m == 0 || g.n == 0) continue;
        const std::string why = operand_ranges(call, g.ta, g.tb, g.m, g.n, kk, A, g.lda, 0, B, g.ldb,
                                               0, static_cast<const TC*>(C), g.ldc, 0, 1);
        if (!why.empty()) {
          device_fault(dev, cudaErrorIllegalAddress,
                       "group " + std::to_string(i) + " problem " + std::to_string(j) + ": " + why +
                           " (when the stream ran it)");
          return true;
        }
        compute<T>(g.ta, g.tb, g.m, g.n, kk, g.al, A, g.lda, B, g.ldb, g.be, C, g.ldc);
      }
    }
    return true;
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace cuda_emu

using namespace cuda_emu;

cublasStatus_t cublasCreate(cublasHandle_t* h) {
  if (!h) return CUBLAS_STATUS_INVALID_VALUE;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  std::lock_guard lk(g_mu);
  const std::uint64_t id = g_next++;
  g_handles[id] = Blas{current_device(), nullptr};
  *h = reinterpret_cast<cublasHandle_t>(id);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h) {
  std::lock_guard lk(g_mu);
  if (g_handles.erase(reinterpret_cast<std::uintptr_t>(h)) == 0) {
    say("cublasDestroy(" + handle_name(h) + "): destroyed or never created");
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  if (s && !stream_of(s)) return CUBLAS_STATUS_INVALID_VALUE;
  std::lock_guard lk(g_mu);
  auto it = g_handles.find(reinterpret_cast<std::uintptr_t>(h));
  if (it == g_handles.end()) return CUBLAS_STATUS_NOT_INITIALIZED;
  it->second.stream = s;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t h, cudaStream_t* s) {
  Blas b;
  if (!lookup(h, &b)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (s) *s = b.stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
  Blas b;
  if (!lookup(h, &b)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode > CUBLAS_TF32_TENSOR_OP_MATH) return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float* alpha, const float* A, int lda,
                           const float* B, int ldb, const float* beta, float* C, int ldc) {
  return gemm("cublasSgemm", h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}
cublasStatus_t cublasDgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const double* alpha, const double* A, int lda,
                           const double* B, int ldb, const double* beta, double* C, int ldc) {
  return gemm("cublasDgemm", h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float* alpha, const float* A, int lda,
                                         long long sA, const float* B, int ldb, long long sB,
                                         const float* beta, float* C, int ldc, long long sC,
                                         int batch) {
  return gemm("cublasSgemmStridedBatched", h, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB,
              beta, C, ldc, sC, batch);
}
cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const double* alpha, const double* A, int lda,
                                         long long sA, const double* B, int ldb, long long sB,
                                         const double* beta, double* C, int ldc, long long sC,
                                         int batch) {
  return gemm("cublasDgemmStridedBatched", h, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB,
              beta, C, ldc, sC, batch);
}
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void* alpha, const void* A, cudaDataType_t Atype,
                            int lda, const void* B, cudaDataType_t Btype, int ldb,
                            const void* beta, void* C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  const char* call = "cublasGemmEx";
  if (compute != CUBLAS_COMPUTE_32F || algo != CUBLAS_GEMM_DEFAULT ||
      Atype != Btype || (Atype != CUDA_R_16BF && Atype != CUDA_R_32F) ||
      (Ctype != CUDA_R_16BF && Ctype != CUDA_R_32F) || (Atype == CUDA_R_32F && Ctype != CUDA_R_32F)) {
    say(std::string(call) + ": a type combination cuda_emu does not emulate (CUBLAS_STATUS_NOT_SUPPORTED)");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const auto* al = static_cast<const float*>(alpha);
  const auto* be = static_cast<const float*>(beta);
  if (Atype == CUDA_R_32F)
    return gemm(call, h, ta, tb, m, n, k, al, static_cast<const float*>(A), lda, 0,
                static_cast<const float*>(B), ldb, 0, be, static_cast<float*>(C), ldc, 0, 1);
  const auto* a = static_cast<const Bf16*>(A);
  const auto* b = static_cast<const Bf16*>(B);
  if (Ctype == CUDA_R_16BF)
    return gemm(call, h, ta, tb, m, n, k, al, a, lda, 0, b, ldb, 0, be, static_cast<Bf16*>(C),
                ldc, 0, 1);
  return gemm(call, h, ta, tb, m, n, k, al, a, lda, 0, b, ldb, 0, be, static_cast<float*>(C), ldc,
              0, 1);
}

cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t h, const cublasOperation_t ta[],
                                          const cublasOperation_t tb[], const int m[],
                                          const int n[], const int k[], const void* alpha,
                                          const void* const Aarray[], cudaDataType_t Atype,
                                          const int lda[], const void* const Barray[],
                                          cudaDataType_t Btype, const int ldb[], const void* beta,
                                          void* const Carray[], cudaDataType_t Ctype,
                                          const int ldc[], int group_count, const int group_size[],
                                          cublasComputeType_t compute) {
  const char* call = "cublasGemmGroupedBatchedEx";
  // cuBLAS's table for this call, as tpsim's types meet it and as we read it: A, B and C
  // of one type, f32 or bf16, with f32 compute. Narrower than the real table may be (no
  // f64, which cuBLAS has as cublasDgemmGroupedBatched; no bf16 A·B into an f32 C, unlike
  // cublasGemmEx), so that the backend relies on nothing unconfirmed.
  const bool f32 = (Atype == CUDA_R_32F || Atype == CUDA_R_16BF) && compute == CUBLAS_COMPUTE_32F;
  if (Atype != Btype || Atype != Ctype || !f32) {
    say(std::string(call) + ": a type combination cuBLAS does not take here (CUBLAS_STATUS_NOT_SUPPORTED)");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const auto* al = static_cast<const float*>(alpha);
  const auto* be = static_cast<const float*>(beta);
  if (Atype == CUDA_R_32F)
    return grouped<float, float, float>(call, h, ta, tb, m, n, k, al, Aarray, lda, Barray, ldb, be,
                                        Carray, ldc, group_count, group_size);
  return grouped<float, Bf16, Bf16>(call, h, ta, tb, m, n, k, al, Aarray, lda, Barray, ldb, be,
                                    Carray, ldc, group_count, group_size);
}
