// cuda_emu's stand-in for cuBLAS: column-major GEMMs on the host, enqueued on the handle's
// stream, with cuBLAS's argument checks and every operand range-checked against the
// device-memory registry (an operand reaching past its allocation is reported as the
// illegal address a device would fault on).
#pragma once

#include <cuda_runtime.h>

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };
enum cublasMath_t {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_TENSOR_OP_MATH = 1,
  CUBLAS_PEDANTIC_MATH = 2,
  CUBLAS_TF32_TENSOR_OP_MATH = 3,
};

// cublasGemmEx's types: the storage types tpsim uses and the one compute type (f32).
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_64F = 1, CUDA_R_16BF = 14 };
typedef cudaDataType_t cudaDataType;
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_64F = 70 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };

struct cublasContext;
typedef cublasContext* cublasHandle_t;

cublasStatus_t cublasCreate(cublasHandle_t* h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasGetStream(cublasHandle_t h, cudaStream_t* s);
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode);
const char* cublasGetStatusString(cublasStatus_t s);

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float* alpha, const float* A, int lda,
                           const float* B, int ldb, const float* beta, float* C, int ldc);
cublasStatus_t cublasDgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const double* alpha, const double* A, int lda,
                           const double* B, int ldb, const double* beta, double* C, int ldc);
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float* alpha, const float* A, int lda,
                                         long long sA, const float* B, int ldb, long long sB,
                                         const float* beta, float* C, int ldc, long long sC,
                                         int batch);
cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const double* alpha, const double* A, int lda,
                                         long long sA, const double* B, int ldb, long long sB,
                                         const double* beta, double* C, int ldc, long long sC,
                                         int batch);
// A bf16 GEMM with f32 compute: A and B CUDA_R_16BF, C CUDA_R_16BF or CUDA_R_32F, alpha
// and beta float. The products of bf16 values are exact in f32, sums are f32 (here in
// k order; a tensor core adds in another tree), and a bf16 C is rounded once, to nearest
// even. Any other combination is CUBLAS_STATUS_NOT_SUPPORTED.
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void* alpha, const void* A, cudaDataType_t Atype,
                            int lda, const void* B, cudaDataType_t Btype, int ldb,
                            const void* beta, void* C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo);
// Grouped GEMMs (cuBLAS 12.5+): group i is group_size[i] problems sharing transa[i] ..
// ldc[i] and alpha[i], beta[i] (host arrays, read at the call; alpha and beta typed by the
// compute type); Aarray, Barray, Carray are device arrays of every problem's operands, in
// group order, read when the stream runs the call. Types: A, B and C all CUDA_R_32F or
// all CUDA_R_16BF with CUBLAS_COMPUTE_32F; anything else is CUBLAS_STATUS_NOT_SUPPORTED. Each problem as cublasGemmEx sums it.
cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t h, const cublasOperation_t transa_array[],
                                          const cublasOperation_t transb_array[],
                                          const int m_array[], const int n_array[],
                                          const int k_array[], const void* alpha_array,
                                          const void* const Aarray[], cudaDataType_t Atype,
                                          const int lda_array[], const void* const Barray[],
                                          cudaDataType_t Btype, const int ldb_array[],
                                          const void* beta_array, void* const Carray[],
                                          cudaDataType_t Ctype, const int ldc_array[],
                                          int group_count, const int group_size[],
                                          cublasComputeType_t compute);
